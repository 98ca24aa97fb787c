#!/usr/bin/env python3
"""Write a float copy of a quantized GGUF model: every quantized tensor dequantized with gguf-py
(2-D+ tensors to F16 or F32, 1-D to F32), metadata copied unchanged except general.file_type.

ternfleet uses it to MoEfy Gemma 3 270M from float weights: splitting a quantized model's FFN
into experts cannot keep its int8 activation blocks, so only a float model's experts add up to
the dense model to the last rounding (docs/moe.md).

usage: scripts/dequantize-model.py IN.gguf OUT.gguf [--type f16|f32]
"""
import argparse
import sys

import numpy as np

import gguf
from gguf.quants import dequantize


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--type", choices=["f16", "f32"], default="f16")
    a = ap.parse_args()
    r = gguf.GGUFReader(a.src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(a.dst, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type", "general.alignment"):
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, f.contents(), vt, f.types[-1])
        else:
            w.add_key_value(name, f.contents(), vt)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if a.type == "f16" else gguf.LlamaFileType.ALL_F32)
    for t in r.tensors:
        x = dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = tuple(int(d) for d in reversed(t.shape))
        x = x.reshape(shape)
        if x.ndim >= 2 and a.type == "f16":
            x = x.astype(np.float16)
        w.add_tensor(t.name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{a.dst}: written", file=sys.stderr)


if __name__ == "__main__":
    main()
