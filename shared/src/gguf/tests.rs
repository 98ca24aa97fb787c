//! Round trips through [`GgufWriter`] and [`GgufFile`], the typed getters, and what the writer
//! refuses. Hostile files are in `shared/tests/gguf_hostile.rs`.

use super::*;

fn all_values() -> Vec<(String, Value)> {
    let v = |k: &str, v| (k.to_owned(), v);
    vec![
        v("general.architecture", Value::String("llama".into())),
        v("t.u8", Value::U8(200)),
        v("t.i8", Value::I8(-100)),
        v("t.u16", Value::U16(60_000)),
        v("t.i16", Value::I16(-30_000)),
        v("t.u32", Value::U32(4_000_000_000)),
        v("t.i32", Value::I32(-2_000_000_000)),
        v("t.f32", Value::F32(1.5e-6)),
        v("t.bool", Value::Bool(true)),
        v("t.string", Value::String("héllo ✓ \u{1F600}".into())),
        v("t.empty_string", Value::String(String::new())),
        v("t.u64", Value::U64(u64::MAX)),
        v("t.i64", Value::I64(i64::MIN)),
        v("t.f64", Value::F64(-2.5e300)),
        v("a.u8", Value::Array(ArrayValue::U8(vec![0, 1, 255]))),
        v("a.i8", Value::Array(ArrayValue::I8(vec![-128, 127]))),
        v("a.u16", Value::Array(ArrayValue::U16(vec![1, 65535]))),
        v("a.i16", Value::Array(ArrayValue::I16(vec![-1, 2]))),
        v("a.u32", Value::Array(ArrayValue::U32(vec![7; 5]))),
        v("a.i32", Value::Array(ArrayValue::I32(vec![-7, 0, 7]))),
        v(
            "a.f32",
            Value::Array(ArrayValue::F32(vec![0.0, -1.25, f32::MAX])),
        ),
        v(
            "a.bool",
            Value::Array(ArrayValue::Bool(vec![true, false, true])),
        ),
        v(
            "a.string",
            Value::Array(ArrayValue::String(vec![
                "<s>".into(),
                "".into(),
                "▁the".into(),
            ])),
        ),
        v("a.u64", Value::Array(ArrayValue::U64(vec![u64::MAX, 0]))),
        v(
            "a.i64",
            Value::Array(ArrayValue::I64(vec![i64::MIN, i64::MAX])),
        ),
        v("a.f64", Value::Array(ArrayValue::F64(vec![1e-300, 3.0]))),
        v("a.empty", Value::Array(ArrayValue::U32(vec![]))),
    ]
}

/// Deterministic filler bytes, different per tensor.
fn pattern(seed: u8, n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

struct Spec {
    name: &'static str,
    dims: Vec<u64>,
    ty: GgmlType,
}

fn specs() -> Vec<Spec> {
    let s = |name, dims: &[u64], ty| Spec {
        name,
        dims: dims.to_vec(),
        ty,
    };
    vec![
        s("token_embd.weight", &[4, 3], GgmlType::F32),
        s("blk.0.attn_norm.weight", &[8], GgmlType::F16),
        s("blk.0.ffn_up.weight", &[64, 2], GgmlType::Q8_0),
        s("blk.0.ffn_down.weight", &[256, 1, 2], GgmlType::Q4_K),
        s("odd", &[3], GgmlType::I8),
        s("four_d", &[2, 1, 3, 2], GgmlType::BF16),
    ]
}

/// A written file, the KVs it should read back as, and each tensor's bytes.
type Built = (Vec<u8>, Vec<(String, Value)>, Vec<Vec<u8>>);

fn build(alignment: Option<u64>) -> Built {
    let mut w = GgufWriter::new();
    let mut kvs = all_values();
    for (k, v) in &kvs {
        w.add_kv(k.clone(), v.clone()).unwrap();
    }
    if let Some(a) = alignment {
        w.set_alignment(a).unwrap();
        if a != DEFAULT_ALIGNMENT {
            kvs.push(("general.alignment".into(), Value::U32(a as u32)));
        }
    }
    let mut datas = Vec::new();
    for (i, s) in specs().iter().enumerate() {
        let n: u64 = s.dims.iter().product();
        let size = s.ty.row_size(n).unwrap() as usize;
        let data = pattern(i as u8, size);
        w.add_tensor(s.name, &s.dims, s.ty, data.clone()).unwrap();
        datas.push(data);
    }
    (w.to_bytes(), kvs, datas)
}

#[test]
fn writer_output_reads_back_with_every_kv_and_tensor_byte() {
    for alignment in [None, Some(32), Some(1), Some(8), Some(64), Some(4096)] {
        let (bytes, kvs, datas) = build(alignment);
        let a = alignment.unwrap_or(32);
        assert_eq!(bytes.len() as u64 % a, 0, "file ends padded");
        let f = GgufFile::from_bytes(bytes).unwrap();
        assert_eq!(f.version(), 3);
        assert_eq!(f.alignment(), a);
        assert_eq!(f.metadata(), &kvs[..]);
        for (k, v) in &kvs {
            assert_eq!(f.get(k), Some(v), "{k}");
        }
        assert_eq!(f.data_offset() % a, 0);
        assert_eq!(f.tensors().len(), specs().len());
        for ((t, s), data) in f.tensors().iter().zip(specs()).zip(&datas) {
            assert_eq!(t.name, s.name);
            assert_eq!(t.dims, s.dims);
            assert_eq!(t.ty, s.ty);
            assert_eq!(t.size, data.len() as u64);
            assert_eq!((t.offset - f.data_offset()) % a, 0);
            assert_eq!(f.tensor_data(t), &data[..], "{}", t.name);
            assert_eq!(f.tensor(s.name), Some(t));
        }
        let q = f.tensor("blk.0.ffn_down.weight").unwrap();
        assert_eq!(
            (q.cols(), q.rows(), q.n_elements(), q.size),
            (256, 2, 512, 288)
        );
    }
    println!(
        "round trip: 6 alignments x {} KVs x {} tensors",
        all_values().len(),
        specs().len()
    );
}

#[test]
fn rewriting_a_read_file_from_borrowed_slices_is_byte_identical() {
    let (bytes, _, _) = build(Some(64));
    let f = GgufFile::from_bytes(bytes.clone()).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in f.metadata() {
        w.add_kv(k.clone(), v.clone()).unwrap();
    }
    for t in f.tensors() {
        w.add_tensor(t.name.clone(), &t.dims, t.ty, f.tensor_data(t))
            .unwrap();
    }
    assert_eq!(w.to_bytes(), bytes);
}

#[test]
fn version_2_reads_like_version_3() {
    let (mut bytes, kvs, _) = build(None);
    bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
    let f = GgufFile::from_bytes(bytes).unwrap();
    assert_eq!(f.version(), 2);
    assert_eq!(f.metadata(), &kvs[..]);
}

#[test]
fn a_file_without_tensors_may_end_unpadded() {
    // gguf.cpp only seeks to the aligned data section when n_tensors > 0.
    let mut bytes = b"GGUF".to_vec();
    bytes.extend_from_slice(&3u32.to_le_bytes());
    bytes.extend_from_slice(&0u64.to_le_bytes());
    bytes.extend_from_slice(&1u64.to_le_bytes());
    bytes.extend_from_slice(&1u64.to_le_bytes());
    bytes.push(b'k');
    bytes.extend_from_slice(&7u32.to_le_bytes()); // bool
    bytes.push(2); // any non-zero byte is true (gguf.cpp)
    let f = GgufFile::from_bytes(bytes).unwrap();
    assert_eq!(f.get_bool("k").unwrap(), Some(true));
    assert!(f.tensors().is_empty());
}

#[test]
fn tensors_need_not_be_stored_in_directory_order() {
    let mut bytes = b"GGUF".to_vec();
    let mut put = |b: &[u8]| bytes.extend_from_slice(b);
    put(&3u32.to_le_bytes());
    put(&2u64.to_le_bytes());
    put(&0u64.to_le_bytes());
    for (name, offset) in [(b"a", 32u64), (b"b", 0)] {
        put(&1u64.to_le_bytes());
        put(name);
        put(&1u32.to_le_bytes());
        put(&4u64.to_le_bytes());
        put(&0u32.to_le_bytes());
        put(&offset.to_le_bytes());
    }
    bytes.resize(96, 0);
    bytes.extend_from_slice(&[0xbb; 16]);
    bytes.resize(128, 0);
    bytes.extend_from_slice(&[0xaa; 16]);
    let f = GgufFile::from_bytes(bytes).unwrap();
    assert_eq!(f.tensor_data(f.tensor("a").unwrap()), &[0xaa; 16]);
    assert_eq!(f.tensor_data(f.tensor("b").unwrap()), &[0xbb; 16]);
}

#[test]
fn typed_getters_convert_checked_and_name_the_key_on_mismatch() {
    let mut w = GgufWriter::new();
    for (k, v) in [
        ("u8", Value::U8(7)),
        ("i32.neg", Value::I32(-1)),
        ("i64.big", Value::I64(1 << 40)),
        ("u64.max", Value::U64(u64::MAX)),
        ("f64", Value::F64(0.25)),
        ("s", Value::String("x".into())),
        ("arr", Value::Array(ArrayValue::String(vec!["a".into()]))),
        ("b", Value::Bool(false)),
    ] {
        w.add_kv(k, v).unwrap();
    }
    let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
    assert_eq!(f.get_u32("u8").unwrap(), Some(7));
    assert_eq!(f.get_u64("u8").unwrap(), Some(7));
    assert_eq!(f.get_i64("i32.neg").unwrap(), Some(-1));
    assert_eq!(f.get_u64("i64.big").unwrap(), Some(1 << 40));
    assert_eq!(f.get_u32("absent").unwrap(), None);
    assert_eq!(f.get_str("absent").unwrap(), None);
    assert!(matches!(
        f.get_u32("i32.neg"),
        Err(GgufError::MetadataRange {
            expected: "u32",
            ..
        })
    ));
    assert!(matches!(
        f.get_u32("i64.big"),
        Err(GgufError::MetadataRange { .. })
    ));
    assert!(matches!(
        f.get_i64("u64.max"),
        Err(GgufError::MetadataRange { .. })
    ));
    assert_eq!(f.get_u64("u64.max").unwrap(), Some(u64::MAX));
    let e = f.get_u32("s").unwrap_err();
    assert!(matches!(&e, GgufError::MetadataType { key, found: "string", .. } if key == "s"));
    assert_eq!(
        e.to_string(),
        "metadata key 's' has type string, expected an integer"
    );
    assert_eq!(f.get_f32("f64").unwrap(), Some(0.25));
    assert!(matches!(
        f.get_f32("u8"),
        Err(GgufError::MetadataType { .. })
    ));
    assert_eq!(f.get_str("s").unwrap(), Some("x"));
    assert!(matches!(
        f.get_str("u8"),
        Err(GgufError::MetadataType { .. })
    ));
    assert_eq!(f.get_bool("b").unwrap(), Some(false));
    assert!(matches!(
        f.get_bool("s"),
        Err(GgufError::MetadataType { .. })
    ));
    assert_eq!(f.get_array("arr").unwrap().map(ArrayValue::len), Some(1));
    assert!(matches!(
        f.get_array("s"),
        Err(GgufError::MetadataType {
            expected: "array",
            ..
        })
    ));
}

#[test]
fn writer_refuses_what_the_reader_would_reject() {
    let mut w = GgufWriter::new();
    w.add_kv("k", Value::U8(1)).unwrap();
    assert!(matches!(
        w.add_kv("k", Value::U8(2)),
        Err(GgufError::WriterKey { .. })
    ));
    assert!(matches!(
        w.add_kv("", Value::U8(2)),
        Err(GgufError::WriterKey { .. })
    ));
    assert!(matches!(
        w.add_kv("general.alignment", Value::U64(64)),
        Err(GgufError::WriterKey { .. })
    ));
    assert!(matches!(
        w.add_kv("general.alignment", Value::U32(3)),
        Err(GgufError::WriterKey { .. })
    ));
    assert!(w.set_alignment(0).is_err());
    assert!(w.set_alignment(1 << 21).is_err());
    let e = w
        .add_tensor("t", &[4, 2], GgmlType::F32, vec![0u8; 31])
        .unwrap_err();
    assert!(
        matches!(
            e,
            GgufError::WriterTensorSize {
                expected: 32,
                got: 31,
                ..
            }
        ),
        "{e}"
    );
    w.add_tensor("t", &[4, 2], GgmlType::F32, vec![0u8; 32])
        .unwrap();
    assert!(matches!(
        w.add_tensor("t", &[4], GgmlType::F32, vec![0u8; 16]),
        Err(GgufError::WriterTensor { .. })
    ));
    for dims in [&[][..], &[1, 1, 1, 1, 1], &[0], &[1 << 40]] {
        assert!(matches!(
            w.add_tensor("u", dims, GgmlType::F32, vec![]),
            Err(GgufError::WriterTensor { .. })
        ));
    }
    assert!(matches!(
        w.add_tensor("q", &[100], GgmlType::Q4_K, vec![]),
        Err(GgufError::WriterTensor { .. })
    ));
    assert!(matches!(
        w.add_tensor("x".repeat(257), &[1], GgmlType::F32, vec![0; 4]),
        Err(GgufError::WriterTensor { .. })
    ));
    // What was accepted still writes a readable file.
    let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
    assert_eq!(f.tensors().len(), 1);
}

#[test]
fn explicit_alignment_key_sets_the_alignment() {
    let mut w = GgufWriter::new();
    w.add_kv("general.alignment", Value::U32(128)).unwrap();
    w.add_tensor("t", &[3], GgmlType::F32, vec![1u8; 12])
        .unwrap();
    w.add_tensor("u", &[3], GgmlType::F32, vec![2u8; 12])
        .unwrap();
    let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
    assert_eq!(f.alignment(), 128);
    assert_eq!(f.tensor("u").unwrap().offset - f.data_offset(), 128);
}

#[test]
fn open_maps_a_file_and_reports_missing_ones_with_their_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let (bytes, kvs, _) = build(Some(64));
    let mut w = GgufWriter::new();
    for (k, v) in &kvs {
        w.add_kv(k.clone(), v.clone()).unwrap();
    }
    w.write_file(&path).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.metadata(), &kvs[..]);
    std::fs::write(&path, &bytes).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.data(), &bytes[..]);
    let missing = dir.path().join("nope.gguf");
    let e = GgufFile::open(&missing).unwrap_err();
    assert!(matches!(e, GgufError::Io { .. }));
    assert!(e.to_string().contains("nope.gguf"), "{e}");
    std::fs::write(&path, b"").unwrap();
    assert!(matches!(
        GgufFile::open(&path),
        Err(GgufError::TooSmall { size: 0 })
    ));
}

#[test]
fn gguf_file_can_be_shared_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<GgufFile>();
    assert_send_sync::<GgufError>();
}

#[test]
fn out_of_bounds_message_names_tensor_absolute_offset_and_sizes() {
    let mut w = GgufWriter::new();
    w.add_tensor("blk.3.ffn_up.weight", &[8], GgmlType::F32, vec![0u8; 32])
        .unwrap();
    let mut bytes = w.to_bytes();
    bytes.truncate(bytes.len() - 1);
    let e = GgufFile::from_bytes(bytes).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.starts_with("tensor blk.3.ffn_up.weight: data offset 0x60 + 32 bytes runs past end of file (size 127)"),
        "{msg}"
    );
}
