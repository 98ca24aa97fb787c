#!/usr/bin/env python3
"""Write the gguf-py interop fixtures for ternfleet-shared's GGUF reader.

For each fixture this writes, with gguf-py's GGUFWriter (the reference writer used by
llama.cpp's convert scripts), `shared/tests/data/<name>.gguf` and a JSON sidecar
`<name>.json` holding what the Rust test must read back: every key with its GGUF type and the
value this script put there, and for every tensor its ggml dims (ne order), type id, absolute
data offset (as gguf-py's GGUFReader reports it), size and the sha256 of its bytes.

Fixtures:
  gguf-py-small  default alignment (32); every scalar value type, arrays of every element type
                 (incl. strings), tensors of types F32, F16, Q8_0 with random data.
  gguf-py-align  general.alignment = 64 and tensors whose sizes are not multiples of it.

Run from the repository root:  python3 scripts/make-gguf-fixtures.py
Requires: gguf (gguf-py >= 0.10), numpy. Deterministic (fixed RNG seed).
"""

import hashlib
import importlib.metadata
import json
import pathlib
import sys

import numpy as np
import gguf
from gguf import GGUFValueType as T, GGMLQuantizationType as Q

OUT = pathlib.Path(__file__).resolve().parent.parent / "shared" / "tests" / "data"

# gguf.md gguf_metadata_value_type ids -> the names the Rust test uses.
TYPE_NAMES = {
    T.UINT8: "u8", T.INT8: "i8", T.UINT16: "u16", T.INT16: "i16", T.UINT32: "u32",
    T.INT32: "i32", T.FLOAT32: "f32", T.BOOL: "bool", T.STRING: "string", T.UINT64: "u64",
    T.INT64: "i64", T.FLOAT64: "f64", T.ARRAY: "array",
}


def f32(x):
    """The float32 nearest x, as a Python float (exact in JSON)."""
    return float(np.float32(x))


def scalar_kvs():
    return [
        ("test.u8", T.UINT8, 250),
        ("test.i8", T.INT8, -120),
        ("test.u16", T.UINT16, 65000),
        ("test.i16", T.INT16, -32000),
        ("test.u32", T.UINT32, 4_000_000_000),
        ("test.i32", T.INT32, -2_000_000_000),
        ("test.f32", T.FLOAT32, f32(1e-6)),
        ("test.bool", T.BOOL, True),
        ("test.string", T.STRING, "héllo ✓ 😀"),
        ("test.u64", T.UINT64, 2**64 - 1),
        ("test.i64", T.INT64, -(2**63)),
        ("test.f64", T.FLOAT64, -2.5e300),
    ]


def array_kvs():
    return [
        ("arr.u8", T.UINT8, [0, 1, 255]),
        ("arr.i8", T.INT8, [-128, 0, 127]),
        ("arr.u16", T.UINT16, [0, 65535]),
        ("arr.i16", T.INT16, [-32768, 32767]),
        ("arr.u32", T.UINT32, [1, 2, 4_294_967_295]),
        ("arr.i32", T.INT32, [-1, 0, 1]),
        ("arr.f32", T.FLOAT32, [f32(0.1), f32(-3.5), f32(3.4e38)]),
        ("arr.bool", T.BOOL, [True, False, True]),
        ("tokenizer.ggml.tokens", T.STRING, ["<unk>", "<s>", "</s>", "▁the", "", "<0x0A>"]),
        ("arr.u64", T.UINT64, [0, 2**64 - 1]),
        ("arr.i64", T.INT64, [-(2**63), 2**63 - 1]),
        ("arr.f64", T.FLOAT64, [1e-300, 2.0]),
    ]


def write_fixture(name, alignment, tensors, rng):
    path = OUT / f"{name}.gguf"
    w = gguf.GGUFWriter(str(path), arch="ternfleet-test")
    # GGUFWriter adds general.architecture itself, first.
    kvs = [{"key": "general.architecture", "type": "string", "value": "ternfleet-test"}]
    if alignment is not None:
        w.add_custom_alignment(alignment)
        kvs.append({"key": "general.alignment", "type": "u32", "value": alignment})
    for key, vtype, value in scalar_kvs():
        w.add_key_value(key, value, vtype)
        kvs.append({"key": key, "type": TYPE_NAMES[vtype], "value": value})
    for key, sub, values in array_kvs():
        w.add_key_value(key, values, T.ARRAY, sub_type=sub)
        kvs.append({"key": key, "type": "array", "element_type": TYPE_NAMES[sub], "value": values})

    for tname, dims, qtype in tensors:
        # numpy shape is the reverse of ggml's ne order (gguf-py: "shape is reversed").
        shape = tuple(reversed(dims))
        data = rng.standard_normal(shape).astype(np.float32)
        if qtype == Q.F32:
            w.add_tensor(tname, data)
        elif qtype == Q.F16:
            w.add_tensor(tname, data.astype(np.float16))
        else:
            w.add_tensor(tname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    # Offsets and bytes as gguf-py's reader sees them.
    r = gguf.GGUFReader(str(path))
    out_tensors = []
    for t in r.tensors:
        raw = bytes(r.data[t.data_offset:t.data_offset + t.n_bytes])
        out_tensors.append({
            "name": t.name,
            "dims": [int(d) for d in t.shape],
            "type": int(t.tensor_type),
            "offset": int(t.data_offset),
            "size": int(t.n_bytes),
            "sha256": hashlib.sha256(raw).hexdigest(),
        })
    expected_names = [t[0] for t in tensors]
    assert [t["name"] for t in out_tensors] == expected_names, out_tensors
    for (tname, dims, qtype), t in zip(tensors, out_tensors):
        assert t["dims"] == dims and t["type"] == int(qtype), (tname, t)

    sidecar = {
        "generator": f"scripts/make-gguf-fixtures.py with gguf-py {importlib.metadata.version('gguf')}",
        "version": 3,
        "alignment": alignment or 32,
        "kvs": kvs,
        "tensors": out_tensors,
    }
    (OUT / f"{name}.json").write_text(json.dumps(sidecar, indent=1, ensure_ascii=False) + "\n")
    size = path.stat().st_size
    assert size < 50_000, f"{path} is {size} bytes; keep fixtures small"
    print(f"wrote {path} ({size} bytes, {len(kvs)} KVs, {len(out_tensors)} tensors)")


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(20240611)
    write_fixture("gguf-py-small", None, [
        ("token_embd.weight", [64, 8], Q.Q8_0),
        ("blk.0.attn_norm.weight", [64], Q.F32),
        ("blk.0.ffn_up.weight", [32, 3, 2], Q.F16),
        ("blk.0.ffn_down.weight", [96, 4], Q.Q8_0),
        ("output_norm.weight", [5], Q.F32),
    ], rng)
    write_fixture("gguf-py-align", 64, [
        ("a", [3], Q.F32),
        ("b", [7, 3], Q.F16),
        ("c", [32], Q.Q8_0),
    ], rng)
    return 0


if __name__ == "__main__":
    sys.exit(main())
