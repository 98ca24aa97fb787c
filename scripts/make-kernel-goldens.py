#!/usr/bin/env python3
"""Make the dequantization / quantization goldens for ternfleet-kernels.

For each ggml type, a fixed-seed set of random *valid* blocks (random bytes, with every f16
scale field replaced by a random finite value) is dequantized with gguf-py
(`gguf.quants.dequantize`, an independent implementation of ggml-quants.c), and written as

    kernels/tests/data/<type>.bin   the raw blocks
    kernels/tests/data/<type>.f32   the dequantized values, little-endian f32

plus q8_0 quantization: `q8_0_quant_in.f32` (inputs) and `q8_0_quant.bin`
(`gguf.quants.quantize(x, Q8_0)`, bit-exact with ggml's quantize_row_q8_0_ref), and ternary
quantization: `tq_quant_in.f32` (three 256-value super-blocks: random, exact ties, zeros) with
`tq1_0_quant.bin` / `tq2_0_quant.bin` (`gguf.quants.quantize(x, TQ1_0 / TQ2_0)`, byte-identical
to ggml's quantize_row_tq{1,2}_0_ref) and their gguf-py dequantizations `tq{1,2}_0_quant.f32`,
and the IQ types' dequantization goldens (from a second generator, appended last).

Usage: python3 scripts/make-kernel-goldens.py   (needs `pip install gguf numpy`)
"""
import os

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels", "tests", "data")

# Byte offsets of the f16 scale fields inside one block (ggml-common.h).
F16_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
    T.TQ1_0: [52], T.TQ2_0: [64],
}
TYPES = [T.F16, T.BF16, *F16_FIELDS]


def random_f16(rng, n):
    mag = np.exp2(rng.uniform(-10, 1, n))
    return (mag * rng.choice([-1.0, 1.0], n)).astype(np.float16)


def main():
    rng = np.random.default_rng(20240611)
    os.makedirs(OUT, exist_ok=True)
    for t in TYPES:
        block, size = GGML_QUANT_SIZES[t]
        nblocks = 8 if block == 32 else (4 if block == 256 else 64)
        if t == T.F16:
            raw = random_f16(rng, nblocks).view(np.uint8)
        elif t == T.BF16:
            f = rng.standard_normal(nblocks).astype(np.float32)
            raw = (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        else:
            raw = rng.integers(0, 256, size=(nblocks, size), dtype=np.uint8)
            for off in F16_FIELDS[t]:
                raw[:, off:off + 2] = random_f16(rng, nblocks).view(np.uint8).reshape(nblocks, 2)
            raw = raw.reshape(-1)
        vals = dequantize(raw, t).astype("<f4").reshape(-1)
        assert vals.size == nblocks * block and np.all(np.isfinite(vals)), t.name
        name = t.name.lower()
        raw.tofile(os.path.join(OUT, f"{name}.bin"))
        vals.tofile(os.path.join(OUT, f"{name}.f32"))

    # q8_0 quantization, with a zero block and a block of exact ties.
    x = rng.standard_normal(32 * 16).astype(np.float32) * np.float32(3.0)
    x[32:64] = 0.0
    # A block whose scaled values land exactly on .5: roundf rounds those away from zero.
    x[96:128] = np.arange(-16, 16, dtype=np.float32) + np.float32(0.5)
    x[127] = 127.0
    x.astype("<f4").tofile(os.path.join(OUT, "q8_0_quant_in.f32"))
    quantize(x.reshape(1, -1), T.Q8_0).reshape(-1).tofile(os.path.join(OUT, "q8_0_quant.bin"))

    # TQ1_0 / TQ2_0 quantization (appended last so the files above keep their bytes).
    x = (rng.standard_normal(256 * 3) * 0.7).astype(np.float32)
    # Exact ties: amax 2 makes id = 0.5, so +-1 lands on +-0.5 (lroundf: away from zero).
    x[256:512] = rng.choice(np.array([-2.0, -1.0, 0.0, 1.0, 2.0], dtype=np.float32), 256)
    x[256] = 2.0
    x[512:768] = 0.0
    x.astype("<f4").tofile(os.path.join(OUT, "tq_quant_in.f32"))
    for t in (T.TQ1_0, T.TQ2_0):
        q = quantize(x.reshape(1, -1), t).reshape(-1)
        q.tofile(os.path.join(OUT, f"{t.name.lower()}_quant.bin"))
        dequantize(q, t).astype("<f4").reshape(-1).tofile(
            os.path.join(OUT, f"{t.name.lower()}_quant.f32"))

    # The IQ types (issue 19), from their own generator so the files above keep their bytes.
    rng = np.random.default_rng(20261126)
    for t, fields in ((T.IQ4_NL, [0]), (T.IQ4_XS, [0]), (T.IQ2_XXS, [0]), (T.IQ3_XXS, [0])):
        block, size = GGML_QUANT_SIZES[t]
        nblocks = 8 if block == 32 else 4
        raw = rng.integers(0, 256, size=(nblocks, size), dtype=np.uint8)
        for off in fields:
            raw[:, off:off + 2] = random_f16(rng, nblocks).view(np.uint8).reshape(nblocks, 2)
        raw = raw.reshape(-1)
        vals = dequantize(raw, t).astype("<f4").reshape(-1)
        assert vals.size == nblocks * block and np.all(np.isfinite(vals)), t.name
        raw.tofile(os.path.join(OUT, f"{t.name.lower()}.bin"))
        vals.tofile(os.path.join(OUT, f"{t.name.lower()}.f32"))

    # The remaining IQ grid types (issue 19), from a third generator so the files above keep
    # their bytes. IQ1_M has no d field: its f16 scale is the top nibbles of the four u16
    # scale words at 48.
    rng = np.random.default_rng(20261127)
    for t in (T.IQ2_XS, T.IQ2_S, T.IQ3_S, T.IQ1_S, T.IQ1_M):
        block, size = GGML_QUANT_SIZES[t]
        nblocks = 4
        raw = rng.integers(0, 256, size=(nblocks, size), dtype=np.uint8)
        d = random_f16(rng, nblocks).view(np.uint16)
        if t == T.IQ1_M:
            for i in range(4):
                hi = ((d >> (4 * i)) & 0xF).astype(np.uint8)
                raw[:, 49 + 2 * i] = (raw[:, 49 + 2 * i] & 0x0F) | (hi << 4)
        else:
            raw[:, 0:2] = d.view(np.uint8).reshape(nblocks, 2)
        raw = raw.reshape(-1)
        vals = dequantize(raw, t).astype("<f4").reshape(-1)
        assert vals.size == nblocks * block and np.all(np.isfinite(vals)), t.name
        raw.tofile(os.path.join(OUT, f"{t.name.lower()}.bin"))
        vals.tofile(os.path.join(OUT, f"{t.name.lower()}.f32"))


if __name__ == "__main__":
    main()
