//! Interoperability with gguf-py, the reference Python implementation used by llama.cpp's
//! converters, in both directions:
//!
//! - files written by gguf-py's `GGUFWriter` (`scripts/make-gguf-fixtures.py`, committed in
//!   `tests/data/`) read back with the values the script wrote and the tensor offsets, sizes
//!   and bytes (sha256) gguf-py's `GGUFReader` reports;
//! - files written by our `GgufWriter` are read by gguf-py's `GGUFReader` with every value,
//!   shape, type, offset and byte intact (skipped when python3 or gguf-py is missing).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value as Json};
use sha2::{Digest, Sha256};
use ternfleet_shared::gguf::{ArrayValue, GgmlType, GgufFile, GgufWriter, Value};

fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data")
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// `(type name, element type name, value)` of a metadata value, as in the sidecar JSON.
fn describe(v: &Value) -> (&'static str, Option<&'static str>, Json) {
    let arr = |a: &ArrayValue| -> Json {
        match a {
            ArrayValue::U8(v) => json!(v),
            ArrayValue::I8(v) => json!(v),
            ArrayValue::U16(v) => json!(v),
            ArrayValue::I16(v) => json!(v),
            ArrayValue::U32(v) => json!(v),
            ArrayValue::I32(v) => json!(v),
            ArrayValue::F32(v) => json!(v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>()),
            ArrayValue::Bool(v) => json!(v),
            ArrayValue::String(v) => json!(v),
            ArrayValue::U64(v) => json!(v),
            ArrayValue::I64(v) => json!(v),
            ArrayValue::F64(v) => json!(v),
        }
    };
    let value = match v {
        Value::U8(x) => json!(x),
        Value::I8(x) => json!(x),
        Value::U16(x) => json!(x),
        Value::I16(x) => json!(x),
        Value::U32(x) => json!(x),
        Value::I32(x) => json!(x),
        Value::F32(x) => json!(f64::from(*x)),
        Value::Bool(x) => json!(x),
        Value::String(x) => json!(x),
        Value::U64(x) => json!(x),
        Value::I64(x) => json!(x),
        Value::F64(x) => json!(x),
        Value::Array(a) => arr(a),
    };
    let elem = match v {
        Value::Array(a) => Some(a.element_type_name()),
        _ => None,
    };
    (v.type_name(), elem, value)
}

fn check_fixture(name: &str) -> (usize, usize) {
    let gguf = data_dir().join(format!("{name}.gguf"));
    let sidecar: Json = serde_json::from_str(
        &std::fs::read_to_string(data_dir().join(format!("{name}.json"))).unwrap(),
    )
    .unwrap();
    let f = GgufFile::open(&gguf).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(u64::from(f.version()), sidecar["version"].as_u64().unwrap());
    assert_eq!(f.alignment(), sidecar["alignment"].as_u64().unwrap());

    let kvs = sidecar["kvs"].as_array().unwrap();
    assert_eq!(f.metadata().len(), kvs.len(), "{name}: KV count");
    for ((key, value), want) in f.metadata().iter().zip(kvs) {
        assert_eq!(key, want["key"].as_str().unwrap(), "{name}: KV order");
        let (ty, elem, got) = describe(value);
        assert_eq!(ty, want["type"].as_str().unwrap(), "{name}: type of {key}");
        assert_eq!(
            elem,
            want["element_type"].as_str(),
            "{name}: element type of {key}"
        );
        assert_eq!(got, want["value"], "{name}: value of {key}");
    }

    let tensors = sidecar["tensors"].as_array().unwrap();
    assert_eq!(f.tensors().len(), tensors.len(), "{name}: tensor count");
    for (t, want) in f.tensors().iter().zip(tensors) {
        assert_eq!(t.name, want["name"].as_str().unwrap());
        assert_eq!(json!(t.dims), want["dims"], "{}", t.name);
        assert_eq!(
            u64::from(t.ty.id()),
            want["type"].as_u64().unwrap(),
            "{}",
            t.name
        );
        assert_eq!(t.offset, want["offset"].as_u64().unwrap(), "{}", t.name);
        assert_eq!(t.size, want["size"].as_u64().unwrap(), "{}", t.name);
        assert_eq!(
            sha256_hex(f.tensor_data(t)),
            want["sha256"].as_str().unwrap(),
            "{}",
            t.name
        );
    }
    (kvs.len(), tensors.len())
}

#[test]
fn gguf_py_written_files_read_back_as_gguf_py_wrote_them() {
    for name in ["gguf-py-small", "gguf-py-align"] {
        let (kvs, tensors) = check_fixture(name);
        println!("{name}: {kvs}/{kvs} KVs and {tensors}/{tensors} tensors match gguf-py");
    }
}

/// Reads a GGUF with gguf-py's GGUFReader and prints what it saw as JSON.
const GGUF_PY_DUMP: &str = r#"
import hashlib, json, sys
import gguf
r = gguf.GGUFReader(sys.argv[1])
kvs = []
for name, field in r.fields.items():
    if name.startswith("GGUF."):
        continue
    types = [int(t) for t in field.types]
    kvs.append({"key": name, "types": types, "value": field.contents()})
tensors = []
for t in r.tensors:
    raw = bytes(r.data[t.data_offset:t.data_offset + t.n_bytes])
    tensors.append({"name": t.name, "dims": [int(d) for d in t.shape], "type": int(t.tensor_type),
                    "offset": int(t.data_offset), "size": int(t.n_bytes),
                    "sha256": hashlib.sha256(raw).hexdigest()})
# numpy scalars (the alignment is a numpy uint32) become Python numbers.
print(json.dumps({"alignment": r.alignment, "kvs": kvs, "tensors": tensors}, default=lambda o: o.item()))
"#;

/// gguf.md value type id of a type name from [`describe`].
fn type_id(name: &str) -> u64 {
    let names = [
        "u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array", "u64", "i64",
        "f64",
    ];
    names.iter().position(|&n| n == name).unwrap() as u64
}

fn gguf_py_available() -> bool {
    Command::new("timeout")
        .args(["30", "python3", "-c", "import gguf"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

fn gguf_py_dump(path: &Path) -> Json {
    let out = Command::new("timeout")
        .args(["60", "python3", "-c", GGUF_PY_DUMP])
        .arg(path)
        .output()
        .expect("run python3");
    assert!(
        out.status.success(),
        "gguf-py failed to read our file: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("gguf-py dump is JSON")
}

#[test]
fn our_writer_output_is_read_by_gguf_py() {
    if !gguf_py_available() {
        ternfleet_shared::testing::skip("gguf-py interop", "python3/gguf not available");
        return;
    }
    let kvs: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String("llama".into())),
        ("t.u8", Value::U8(200)),
        ("t.i8", Value::I8(-100)),
        ("t.u16", Value::U16(60_000)),
        ("t.i16", Value::I16(-30_000)),
        ("t.u32", Value::U32(4_000_000_000)),
        ("t.i32", Value::I32(-2_000_000_000)),
        ("t.f32", Value::F32(1.5e-6)),
        ("t.bool", Value::Bool(true)),
        ("t.string", Value::String("héllo ✓ 😀".into())),
        ("t.u64", Value::U64(u64::MAX)),
        ("t.i64", Value::I64(i64::MIN)),
        ("t.f64", Value::F64(-2.5e300)),
        ("a.u8", Value::Array(ArrayValue::U8(vec![0, 255]))),
        ("a.i8", Value::Array(ArrayValue::I8(vec![-128, 127]))),
        ("a.u16", Value::Array(ArrayValue::U16(vec![1, 65535]))),
        ("a.i16", Value::Array(ArrayValue::I16(vec![-1, 2]))),
        ("a.u32", Value::Array(ArrayValue::U32(vec![7, 8]))),
        ("a.i32", Value::Array(ArrayValue::I32(vec![-7, 7]))),
        ("a.f32", Value::Array(ArrayValue::F32(vec![0.1, -1.25]))),
        ("a.bool", Value::Array(ArrayValue::Bool(vec![false, true]))),
        (
            "tokenizer.ggml.tokens",
            Value::Array(ArrayValue::String(vec![
                "<s>".into(),
                "".into(),
                "▁the".into(),
            ])),
        ),
        ("a.u64", Value::Array(ArrayValue::U64(vec![u64::MAX, 0]))),
        (
            "a.i64",
            Value::Array(ArrayValue::I64(vec![i64::MIN, i64::MAX])),
        ),
        ("a.f64", Value::Array(ArrayValue::F64(vec![1e-300, 3.0]))),
    ];
    let tensors: Vec<(&str, Vec<u64>, GgmlType)> = vec![
        ("token_embd.weight", vec![64, 3], GgmlType::Q8_0),
        ("blk.0.ffn_down.weight", vec![256, 2], GgmlType::Q4_K),
        ("blk.0.attn_norm.weight", vec![5], GgmlType::F32),
        ("blk.0.attn_q.weight", vec![6, 2, 2], GgmlType::F16),
    ];
    for alignment in [32, 64] {
        let mut w = GgufWriter::new();
        for (k, v) in &kvs {
            w.add_kv(*k, v.clone()).unwrap();
        }
        w.set_alignment(alignment).unwrap();
        let mut datas = Vec::new();
        for (i, (name, dims, ty)) in tensors.iter().enumerate() {
            let size = ty.row_size(dims.iter().product()).unwrap() as usize;
            let data: Vec<u8> = (0..size)
                .map(|j| (j as u8).wrapping_mul(13).wrapping_add(i as u8))
                .collect();
            w.add_tensor(*name, dims, *ty, data.clone()).unwrap();
            datas.push(data);
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ours.gguf");
        w.write_file(&path).unwrap();
        let ours = GgufFile::open(&path).unwrap();
        let py = gguf_py_dump(&path);

        assert_eq!(py["alignment"].as_u64(), Some(alignment));
        let py_kvs = py["kvs"].as_array().unwrap();
        let n_expected = kvs.len() + usize::from(alignment != 32);
        assert_eq!(py_kvs.len(), n_expected, "gguf-py KV count");
        for ((key, value), got) in ours.metadata().iter().zip(py_kvs) {
            assert_eq!(got["key"].as_str(), Some(key.as_str()));
            let (ty, elem, want) = describe(value);
            let mut types = vec![json!(type_id(ty))];
            if let Some(e) = elem {
                types.push(json!(type_id(e)));
            }
            assert_eq!(got["types"], json!(types), "types of {key}");
            assert_eq!(got["value"], want, "value of {key}");
        }
        let py_tensors = py["tensors"].as_array().unwrap();
        assert_eq!(py_tensors.len(), tensors.len());
        for ((t, got), data) in ours.tensors().iter().zip(py_tensors).zip(&datas) {
            assert_eq!(got["name"].as_str(), Some(t.name.as_str()));
            assert_eq!(got["dims"], json!(t.dims), "{}", t.name);
            assert_eq!(
                got["type"].as_u64(),
                Some(u64::from(t.ty.id())),
                "{}",
                t.name
            );
            assert_eq!(got["offset"].as_u64(), Some(t.offset), "{}", t.name);
            assert_eq!(got["size"].as_u64(), Some(t.size), "{}", t.name);
            assert_eq!(
                got["sha256"].as_str(),
                Some(sha256_hex(data).as_str()),
                "{}",
                t.name
            );
        }
        println!(
            "gguf-py read our alignment-{alignment} file: {n_expected} KVs, {} tensors match",
            tensors.len()
        );
    }
}
