//! The reference kernels: plain Rust, written line by line from ggml.
//!
//! Dequantizers follow `ggml/src/ggml-quants.c` (`dequantize_row_*`), the activation quantizers
//! `quantize_row_q8_0_ref` / `quantize_row_q8_K_ref` from the same file, and the dot products
//! `ggml/src/ggml-cpu/quants.c` (`ggml_vec_dot_*_generic`) and `ggml-cpu/vec.cpp`
//! (`ggml_vec_dot_f32/f16/bf16`, which accumulate in `ggml_float` = double in their scalar form).
//! Every SIMD kernel is tested against these. They read only the raw block bytes (never the
//! side tables that [`crate::Activations`] keeps for the SIMD kernels), so they check those too.
//!
//! Block layouts (ggml-common.h), little-endian, no padding:
//! - `block_q4_0`  { f16 d; u8 qs[16] }                      18 bytes / 32 values
//! - `block_q4_1`  { f16 d; f16 m; u8 qs[16] }               20 bytes
//! - `block_q5_0`  { f16 d; u8 qh[4]; u8 qs[16] }            22 bytes
//! - `block_q5_1`  { f16 d; f16 m; u8 qh[4]; u8 qs[16] }     24 bytes
//! - `block_q8_0`  { f16 d; i8 qs[32] }                      34 bytes
//! - `block_q8_1`  { f16 d; f16 s; i8 qs[32] }               36 bytes (s = d · Σqs)
//! - `block_q2_K`  { u8 scales[16]; u8 qs[64]; f16 d; f16 dmin }             84 bytes / 256 values
//! - `block_q3_K`  { u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d }         110 bytes
//! - `block_q4_K`  { f16 d; f16 dmin; u8 scales[12]; u8 qs[128] }            144 bytes
//! - `block_q5_K`  { f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128] } 176 bytes
//! - `block_q6_K`  { u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d }           210 bytes
//! - `block_q8_K`  { f32 d; i8 qs[256]; i16 bsums[16] }                      292 bytes
//! - `block_tq1_0` { u8 qs[48]; u8 qh[4]; f16 d }                            54 bytes
//! - `block_tq2_0` { u8 qs[64]; f16 d }                                      66 bytes
//! - `block_iq4_nl` { f16 d; u8 qs[16] }                     18 bytes / 32 values
//! - `block_iq4_xs` { f16 d; u16 scales_h; u8 scales_l[4]; u8 qs[128] }      136 bytes / 256
//! - `block_iq2_xxs` { f16 d; u16 qs[32] }                                     66 bytes / 256
//! - `block_iq3_xxs` { f16 d; u8 qs[96] }                                      98 bytes / 256
//! - `block_iq2_xs` { f16 d; u16 qs[32]; u8 scales[8] }                        74 bytes / 256
//! - `block_iq2_s`  { f16 d; u8 qs[32]; u8 signs[32]; u8 qh[8]; u8 scales[8] } 82 bytes / 256
//! - `block_iq3_s`  { f16 d; u8 qs[64]; u8 qh[8]; u8 signs[32]; u8 scales[4] } 110 bytes / 256
//! - `block_iq1_s`  { f16 d; u8 qs[32]; u16 qh[8] }                            50 bytes / 256
//! - `block_iq1_m`  { u8 qs[32]; u8 qh[16]; u16 scales[4] (the f16 d in their top nibbles) }
//!   56 bytes / 256
//!
//! The ternary formats' quantizers and dot products live in `crate::ternary`.

// Tile loops index several per-row / per-token arrays with the same counter, and the
// transcriptions of ggml keep its index arithmetic: iterator chains would obscure both.
#![allow(clippy::needless_range_loop)]

use crate::quant::{GgmlType, QK, QK_K};
use half::{bf16, f16};

#[inline(always)]
pub(crate) fn f16_at(b: &[u8], off: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

#[inline(always)]
pub(crate) fn f32_at(b: &[u8], off: usize) -> f32 {
    f32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

#[inline(always)]
fn i16_at(b: &[u8], off: usize) -> i16 {
    i16::from_le_bytes([b[off], b[off + 1]])
}

#[inline(always)]
fn bf16_at(b: &[u8], off: usize) -> f32 {
    bf16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

/// ggml.c `ggml_compute_fp32_to_bf16`: round to nearest even, NaN kept quiet.
pub(crate) fn f32_to_bf16_bits(x: f32) -> u16 {
    let u = x.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return ((u >> 16) | 64) as u16;
    }
    ((u + (0x7fff + ((u >> 16) & 1))) >> 16) as u16
}

/// ggml-quants.c `get_scale_min_k4`: the 6-bit scale and min of sub-block `j` of a q4_K/q5_K.
#[inline(always)]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// ggml-common.h `kvalues_iq4nl`: the 16 values an IQ4_NL / IQ4_XS code stands for.
pub(crate) use crate::iq_grids::KVALUES_IQ4NL;

/// The 6-bit scale (still offset by 32) of 32-value sub-block `ib` of an IQ4_XS super-block
/// (`dequantize_row_iq4_xs`): four bits from `scales_l`, two from `scales_h`.
#[inline(always)]
pub(crate) fn iq4xs_scale(x: &[u8], ib: usize) -> i32 {
    let sh = u16::from_le_bytes([x[2], x[3]]);
    (((x[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | ((((sh >> (2 * ib)) & 3) as u8) << 4)) as i32
}

/// ggml-quants.c `dequantize_row_q3_K`'s `aux` words: the 12 scale bytes of a q3_K block as
/// four little-endian words of four 6-bit scales each (still offset by 32).
#[inline(always)]
pub(crate) fn q3k_scale_words(s: &[u8; 12]) -> [u32; 4] {
    const KMASK1: u32 = 0x0303_0303;
    const KMASK2: u32 = 0x0f0f_0f0f;
    let w = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (a0, a1, tmp) = (w(0), w(1), w(2));
    [
        (a0 & KMASK2) | ((tmp & KMASK1) << 4),
        (a1 & KMASK2) | (((tmp >> 2) & KMASK1) << 4),
        ((a0 >> 4) & KMASK2) | (((tmp >> 4) & KMASK1) << 4),
        ((a1 >> 4) & KMASK2) | (((tmp >> 6) & KMASK1) << 4),
    ]
}

/// ggml-quants.c `dequantize_row_q3_K`: unpack the 12 scale bytes into 16 signed 6-bit scales
/// (still offset by 32).
fn q3k_scales(s: &[u8; 12]) -> [i8; 16] {
    let aux = q3k_scale_words(s);
    let mut out = [0i8; 16];
    for (i, a) in aux.iter().enumerate() {
        for (k, b) in a.to_le_bytes().iter().enumerate() {
            out[4 * i + k] = *b as i8;
        }
    }
    out
}

/// Dequantize whole blocks. `src.len() == ty.row_size(dst.len())` is checked by the caller.
/// Returns false for types without a dequantizer.
pub(crate) fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> bool {
    let ts = ty.type_size();
    let bs = ty.block_size();
    match ty {
        GgmlType::F32 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32_at(s, 0);
            }
        }
        GgmlType::F16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = f16_at(s, 0);
            }
        }
        GgmlType::BF16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = bf16_at(s, 0);
            }
        }
        _ => {
            for (b, y) in src.chunks_exact(ts).zip(dst.chunks_exact_mut(bs)) {
                if !dequantize_block(ty, b, y) {
                    return false;
                }
            }
        }
    }
    true
}

fn dequantize_block(ty: GgmlType, x: &[u8], y: &mut [f32]) -> bool {
    match ty {
        // dequantize_row_q4_0
        GgmlType::Q4_0 => {
            let d = f16_at(x, 0);
            for j in 0..QK / 2 {
                let q = x[2 + j];
                y[j] = ((q & 0x0F) as i32 - 8) as f32 * d;
                y[j + QK / 2] = ((q >> 4) as i32 - 8) as f32 * d;
            }
        }
        // dequantize_row_q4_1
        GgmlType::Q4_1 => {
            let (d, m) = (f16_at(x, 0), f16_at(x, 2));
            for j in 0..QK / 2 {
                let q = x[4 + j];
                y[j] = (q & 0x0F) as f32 * d + m;
                y[j + QK / 2] = (q >> 4) as f32 * d + m;
            }
        }
        // dequantize_row_q5_0
        GgmlType::Q5_0 => {
            let d = f16_at(x, 0);
            let qh = u32::from_le_bytes([x[2], x[3], x[4], x[5]]);
            for j in 0..QK / 2 {
                let q = x[6 + j];
                let xh0 = (((qh >> j) << 4) & 0x10) as u8;
                let xh1 = ((qh >> (j + 12)) & 0x10) as u8;
                y[j] = (((q & 0x0F) | xh0) as i32 - 16) as f32 * d;
                y[j + QK / 2] = (((q >> 4) | xh1) as i32 - 16) as f32 * d;
            }
        }
        // dequantize_row_q5_1
        GgmlType::Q5_1 => {
            let (d, m) = (f16_at(x, 0), f16_at(x, 2));
            let qh = u32::from_le_bytes([x[4], x[5], x[6], x[7]]);
            for j in 0..QK / 2 {
                let q = x[8 + j];
                let xh0 = (((qh >> j) << 4) & 0x10) as u8;
                let xh1 = ((qh >> (j + 12)) & 0x10) as u8;
                y[j] = ((q & 0x0F) | xh0) as f32 * d + m;
                y[j + QK / 2] = ((q >> 4) | xh1) as f32 * d + m;
            }
        }
        // dequantize_row_q8_0
        GgmlType::Q8_0 => {
            let d = f16_at(x, 0);
            for j in 0..QK {
                y[j] = (x[2 + j] as i8) as f32 * d;
            }
        }
        // q8_1 (ggml has no dequantizer for it: the activation type of q4_1 / q5_1): d · q
        GgmlType::Q8_1 => {
            let d = f16_at(x, 0);
            for j in 0..QK {
                y[j] = (x[4 + j] as i8) as f32 * d;
            }
        }
        // dequantize_row_q8_K
        GgmlType::Q8_K => {
            let d = f32_at(x, 0);
            for j in 0..QK_K {
                y[j] = d * (x[4 + j] as i8) as f32;
            }
        }
        // dequantize_row_q2_K
        GgmlType::Q2_K => {
            let sc = &x[0..16];
            let qs = &x[16..80];
            let (d, min) = (f16_at(x, 80), f16_at(x, 82));
            let mut o = 0;
            let mut is = 0;
            for n in 0..2 {
                let q = &qs[32 * n..];
                for shift in [0, 2, 4, 6] {
                    for half in 0..2 {
                        let s = sc[is];
                        is += 1;
                        let dl = d * (s & 0xF) as f32;
                        let ml = min * (s >> 4) as f32;
                        for l in 0..16 {
                            y[o] = dl * ((q[l + 16 * half] >> shift) & 3) as f32 - ml;
                            o += 1;
                        }
                    }
                }
            }
        }
        // dequantize_row_q3_K
        GgmlType::Q3_K => {
            let hm = &x[0..32];
            let qs = &x[32..96];
            let scales = q3k_scales(x[96..108].try_into().expect("a q3_K block has 110 bytes"));
            let d_all = f16_at(x, 108);
            let mut o = 0;
            let mut is = 0;
            let mut m = 1u8;
            for n in 0..2 {
                let q = &qs[32 * n..];
                for shift in [0, 2, 4, 6] {
                    for half in 0..2 {
                        let dl = d_all * (scales[is] as i32 - 32) as f32;
                        is += 1;
                        for l in 0..16 {
                            let i = l + 16 * half;
                            let v =
                                ((q[i] >> shift) & 3) as i32 - if hm[i] & m != 0 { 0 } else { 4 };
                            y[o] = dl * v as f32;
                            o += 1;
                        }
                    }
                    m <<= 1;
                }
            }
        }
        // dequantize_row_q4_K
        GgmlType::Q4_K => {
            let (d, min) = (f16_at(x, 0), f16_at(x, 2));
            let scales = &x[4..16];
            let qs = &x[16..144];
            for j in 0..4 {
                let (sc1, m1) = scale_min_k4(2 * j, scales);
                let (sc2, m2) = scale_min_k4(2 * j + 1, scales);
                let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
                let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
                let q = &qs[32 * j..32 * j + 32];
                for l in 0..32 {
                    y[64 * j + l] = d1 * (q[l] & 0xF) as f32 - m1;
                    y[64 * j + 32 + l] = d2 * (q[l] >> 4) as f32 - m2;
                }
            }
        }
        // dequantize_row_q5_K
        GgmlType::Q5_K => {
            let (d, min) = (f16_at(x, 0), f16_at(x, 2));
            let scales = &x[4..16];
            let qh = &x[16..48];
            let qs = &x[48..176];
            for j in 0..4 {
                let (sc1, m1) = scale_min_k4(2 * j, scales);
                let (sc2, m2) = scale_min_k4(2 * j + 1, scales);
                let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
                let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
                let (u1, u2) = (1u8 << (2 * j), 2u8 << (2 * j));
                let q = &qs[32 * j..32 * j + 32];
                for l in 0..32 {
                    let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
                    let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
                    y[64 * j + l] = d1 * ((q[l] & 0xF) + h1) as f32 - m1;
                    y[64 * j + 32 + l] = d2 * ((q[l] >> 4) + h2) as f32 - m2;
                }
            }
        }
        // dequantize_row_q6_K
        GgmlType::Q6_K => {
            let d = f16_at(x, 208);
            for n in 0..2 {
                let ql = &x[64 * n..64 * n + 64];
                let qh = &x[128 + 32 * n..128 + 32 * n + 32];
                let sc = &x[192 + 8 * n..192 + 8 * n + 8];
                let y = &mut y[128 * n..128 * n + 128];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                    let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                    y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                    y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                    y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                }
            }
        }
        // dequantize_row_tq1_0
        GgmlType::TQ1_0 => {
            const POW3: [u8; 6] = [1, 3, 9, 27, 81, 243];
            let qs = &x[0..48];
            let qh = &x[48..52];
            let d = f16_at(x, 52);
            let trit = |q: u8, n: usize| -> f32 {
                let q = q.wrapping_mul(POW3[n]);
                let xi = ((q as u16 * 3) >> 8) as i16;
                (xi - 1) as f32 * d
            };
            let mut o = 0;
            for j in (0..32).step_by(32) {
                for n in 0..5 {
                    for m in 0..32 {
                        y[o] = trit(qs[j + m], n);
                        o += 1;
                    }
                }
            }
            for j in (32..48).step_by(16) {
                for n in 0..5 {
                    for m in 0..16 {
                        y[o] = trit(qs[j + m], n);
                        o += 1;
                    }
                }
            }
            for n in 0..4 {
                for &q in qh {
                    y[o] = trit(q, n);
                    o += 1;
                }
            }
        }
        // dequantize_row_tq2_0
        GgmlType::TQ2_0 => {
            let d = f16_at(x, 64);
            let mut o = 0;
            for j in (0..64).step_by(32) {
                for l in 0..4 {
                    for m in 0..32 {
                        let q = ((x[j + m] >> (2 * l)) & 3) as i32;
                        y[o] = (q - 1) as f32 * d;
                        o += 1;
                    }
                }
            }
        }
        // dequantize_row_iq4_nl
        GgmlType::IQ4_NL => {
            let d = f16_at(x, 0);
            for j in 0..QK / 2 {
                y[j] = d * KVALUES_IQ4NL[(x[2 + j] & 0xF) as usize] as f32;
                y[j + QK / 2] = d * KVALUES_IQ4NL[(x[2 + j] >> 4) as usize] as f32;
            }
        }
        // dequantize_row_iq4_xs
        GgmlType::IQ4_XS => {
            let d = f16_at(x, 0);
            for ib in 0..QK_K / 32 {
                let dl = d * (iq4xs_scale(x, ib) - 32) as f32;
                let qs = &x[8 + 16 * ib..];
                let y = &mut y[32 * ib..];
                for j in 0..16 {
                    y[j] = dl * KVALUES_IQ4NL[(qs[j] & 0xF) as usize] as f32;
                    y[j + 16] = dl * KVALUES_IQ4NL[(qs[j] >> 4) as usize] as f32;
                }
            }
        }
        // dequantize_row_iq2_xxs and the other grid types: `d · (0.5 + ls) · 0.25 · grid ·
        // sign` (IQ2_XXS/XS/S; the same as `(d · (2ls + 1)) · 0.125`, scaling by powers of two
        // being exact), `d · (0.5 + ls) · 0.5` (IQ3_XXS), `d · (1 + 2ls)` (IQ3_S).
        GgmlType::IQ2_XXS => grid_dequant(f16_at(x, 0), iq2xxs_values(x), 0.125, y),
        GgmlType::IQ3_XXS => grid_dequant(f16_at(x, 0), iq3xxs_values(x), 0.25, y),
        GgmlType::IQ2_XS => grid_dequant(f16_at(x, 0), iq2xs_values(x), 0.125, y),
        GgmlType::IQ2_S => grid_dequant(f16_at(x, 0), iq2s_values(x), 0.125, y),
        GgmlType::IQ3_S => grid_dequant(f16_at(x, 0), iq3s_values(x), 1.0, y),
        // dequantize_row_iq1_s / _m: `(d · (2ls + 1)) · (grid + delta)`, delta ±0.125; the
        // values are `8 · grid + delta`, so `value · 0.125` is `grid + delta` exactly.
        GgmlType::IQ1_S => iq1_dequant(f16_at(x, 0), iq1s_values(x), y),
        GgmlType::IQ1_M => iq1_dequant(iq1m_d(x), iq1m_values(x), y),
        GgmlType::TF2 | GgmlType::TF1 | GgmlType::Q8_TF => {
            crate::ternary::dequantize_tf_block(ty, x, y)
        }
        _ => return false,
    }
    true
}

/// ggml-quants.c `nearest_int`: round to nearest, ties to even, via the 1.5·2^23 trick.
#[inline(always)]
pub(crate) fn nearest_int(fval: f32) -> i32 {
    let val = fval + 12582912.0;
    (val.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// One 32-value block as llama.cpp's x86 `quantize_row_q8_0` / `quantize_row_q8_1` (AVX path)
/// quantize it: `d = amax / 127` (f32, before its f16 rounding) and the codes.
fn q8_block(xb: &[f32]) -> (f32, [i8; QK]) {
    // What llama.cpp runs on x86 (ggml-cpu/arch/x86/quants.c, AVX path): multiply by
    // 127/amax and round half to even (`_mm256_round_ps(_MM_ROUND_NEAREST)`). The portable
    // reference (`quantize_row_q8_0_ref`, and gguf-py) multiplies by 1/d and rounds half away
    // from zero; the two differ on ties and 1-ulp products. Activations are never stored, so
    // we follow the engine we must match token for token.
    let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut q = [0i8; QK];
    for (q, v) in q.iter_mut().zip(xb) {
        let r = v * id;
        // `nearest_int` equals `round_ties_even` below 2^22 and is not a libm call (`rintf`
        // without SSE4.1 in the baseline target); NaN and huge values take the exact path.
        *q = if r.abs() < 4_194_304.0 {
            nearest_int(r) as i8
        } else {
            r.round_ties_even() as i8
        };
    }
    (d, q)
}

/// ggml-quants.c `quantize_row_q8_0_ref` (in the x86 rounding of [`q8_block`]): one 34-byte
/// block per 32 values.
pub(crate) fn quantize_q8_0(x: &[f32], y: &mut [u8]) {
    for (xb, yb) in x
        .chunks_exact(QK)
        .zip(y.chunks_exact_mut(GgmlType::Q8_0.type_size()))
    {
        let (d, q) = q8_block(xb);
        yb[0..2].copy_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
        for (o, q) in yb[2..].iter_mut().zip(q) {
            *o = q as u8;
        }
    }
}

/// llama.cpp's x86 `quantize_row_q8_1` (the activations of q4_1 / q5_1): q8_0's `d` and codes
/// plus `s = f16(d · Σq)`, with the f32 `d` before its f16 rounding; 36 bytes per 32 values.
pub(crate) fn quantize_q8_1(x: &[f32], y: &mut [u8]) {
    for (xb, yb) in x
        .chunks_exact(QK)
        .zip(y.chunks_exact_mut(GgmlType::Q8_1.type_size()))
    {
        let (d, q) = q8_block(xb);
        let sum: i32 = q.iter().map(|&v| v as i32).sum();
        yb[0..2].copy_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
        yb[2..4].copy_from_slice(&f16::from_f32(d * sum as f32).to_bits().to_le_bytes());
        for (o, q) in yb[4..].iter_mut().zip(q) {
            *o = q as u8;
        }
    }
}

/// ggml-quants.c `quantize_row_q8_K_ref`: one 292-byte block per 256 values. The scale is the
/// signed value of largest magnitude, so its own element quantizes to -127 exactly.
pub(crate) fn quantize_q8_k(x: &[f32], y: &mut [u8]) {
    for (xb, yb) in x
        .chunks_exact(QK_K)
        .zip(y.chunks_exact_mut(GgmlType::Q8_K.type_size()))
    {
        let mut max = 0.0f32;
        let mut amax = 0.0f32;
        for &v in xb {
            let ax = v.abs();
            if ax > amax {
                amax = ax;
                max = v;
            }
        }
        if amax == 0.0 {
            yb.fill(0);
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in yb[4..4 + QK_K].iter_mut().zip(xb) {
            *q = (nearest_int(iscale * v).min(127) as i8) as u8;
        }
        for j in 0..QK_K / 16 {
            let s: i32 = yb[4 + 16 * j..4 + 16 * j + 16]
                .iter()
                .map(|&q| (q as i8) as i32)
                .sum();
            let o = 4 + QK_K + 2 * j;
            yb[o..o + 2].copy_from_slice(&(s as i16).to_le_bytes());
        }
        yb[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
    }
}

/// Quantize to an activation type. Returns false for types we cannot produce.
pub(crate) fn quantize(ty: GgmlType, x: &[f32], y: &mut [u8]) -> bool {
    match ty {
        GgmlType::Q8_0 => quantize_q8_0(x, y),
        GgmlType::Q8_1 => quantize_q8_1(x, y),
        GgmlType::Q8_K => quantize_q8_k(x, y),
        GgmlType::TQ1_0 | GgmlType::TQ2_0 => crate::ternary::quantize_tq(ty, x, y),
        GgmlType::TF2 | GgmlType::TF1 => crate::ternary::quantize_tf(ty, x, y),
        // One token row: the scale is the row's absmax.
        GgmlType::Q8_TF => crate::ternary::quantize_q8_tf(x, y),
        GgmlType::F32 => {
            for (v, o) in x.iter().zip(y.chunks_exact_mut(4)) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for (v, o) in x.iter().zip(y.chunks_exact_mut(2)) {
                o.copy_from_slice(&f16::from_f32(*v).to_bits().to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for (v, o) in x.iter().zip(y.chunks_exact_mut(2)) {
                o.copy_from_slice(&f32_to_bf16_bits(*v).to_le_bytes());
            }
        }
        _ => return false,
    }
    true
}

// ---------------------------------------------------------------------------------------------
// Dot products of one weight row with one activation row (both raw bytes, `n` elements).

/// `ggml_vec_dot_f32` (vec.cpp, scalar branch: double accumulation).
pub(crate) fn vec_dot_f32(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut s = 0f64;
    for i in 0..n {
        s += (f32_at(w, 4 * i) * f32_at(a, 4 * i)) as f64;
    }
    s as f32
}

/// `ggml_vec_dot_f16` (vec.cpp, scalar branch).
pub(crate) fn vec_dot_f16(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut s = 0f64;
    for i in 0..n {
        s += (f16_at(w, 2 * i) * f16_at(a, 2 * i)) as f64;
    }
    s as f32
}

/// `ggml_vec_dot_bf16` (vec.cpp, scalar branch).
pub(crate) fn vec_dot_bf16(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut s = 0f64;
    for i in 0..n {
        s += (bf16_at(w, 2 * i) * bf16_at(a, 2 * i)) as f64;
    }
    s as f32
}

// Quantized dot products in the float order llama.cpp's x86 CPU backend (AVX2 / AVX-512 build)
// uses, so that every rounding matches it: integer partial sums are exact whatever their
// grouping, so only where the f32 conversions, multiplies and adds happen matters. The order
// depends on the weight type and, for k-quants, on how many tokens the matmul has and where a
// token sits in it, because ggml picks a different kernel per case ([`KOrder`]).

/// ggml's x86 `hsum_float_8` (quants.c) and tinyBLAS `hsum` (sgemm.cpp): the 8 lanes of an
/// accumulator summed as `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`.
#[inline(always)]
pub(crate) fn hsum8(l: &[f32; 8]) -> f32 {
    let s = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
    (s[0] + s[2]) + (s[1] + s[3])
}

/// The 32 signed weight values of a legacy block (value order) and its scale.
fn legacy_block(ty: GgmlType, x: &[u8]) -> (f32, [i8; QK]) {
    let mut v = [0i8; QK];
    match ty {
        GgmlType::Q8_0 => {
            for j in 0..QK {
                v[j] = x[2 + j] as i8;
            }
        }
        GgmlType::Q4_0 => {
            for j in 0..QK / 2 {
                v[j] = (x[2 + j] & 0x0F) as i8 - 8;
                v[j + QK / 2] = (x[2 + j] >> 4) as i8 - 8;
            }
        }
        _ => {
            let qh = u32::from_le_bytes([x[2], x[3], x[4], x[5]]);
            for j in 0..QK / 2 {
                let h0 = (((qh >> j) & 1) << 4) as u8;
                let h1 = (((qh >> (j + 16)) & 1) << 4) as u8;
                v[j] = ((x[6 + j] & 0x0F) | h0) as i8 - 16;
                v[j + QK / 2] = ((x[6 + j] >> 4) | h1) as i8 - 16;
            }
        }
    }
    (f16_at(x, 0), v)
}

/// Q8_0 / Q5_0 against q8_0, as `ggml_vec_dot_{q8_0,q5_0}_q8_0` (AVX2 branch,
/// one token) and tinyBLAS `tinyBLAS_Q0_AVX` (several tokens) both compute it: per block,
/// eight i32 lanes of four consecutive products, converted to f32 and accumulated as
/// `acc[l] = fma(dw * da, lane[l], acc[l])`; then [`hsum8`].
pub(crate) fn vec_dot_legacy(ty: GgmlType, n: usize, w: &[u8], a: &[u8]) -> f32 {
    let bs = ty.type_size();
    let mut acc = [0f32; 8];
    for (x, y) in w.chunks_exact(bs).zip(a.chunks_exact(34)).take(n / QK) {
        let (dw, v) = legacy_block(ty, x);
        legacy_lanes(&mut acc, dw * f16_at(y, 0), |j| v[j] as i32, &y[2..]);
    }
    hsum8(&acc)
}

/// One legacy block's step: eight i32 lanes of four consecutive products `w(j) · a[j]`, each
/// `acc[l] = fma(d, lane, acc[l])`.
fn legacy_lanes(acc: &mut [f32; 8], d: f32, w: impl Fn(usize) -> i32, a: &[u8]) {
    for l in 0..8 {
        let mut lane = 0i32;
        for j in 4 * l..4 * l + 4 {
            lane += w(j) * (a[j] as i8) as i32;
        }
        acc[l] = d.mul_add(lane as f32, acc[l]);
    }
}

/// The 32 unsigned codes of a q4_1 / q5_1 block (value order), its scale and its min.
fn legacy1_block(ty: GgmlType, x: &[u8]) -> (f32, f32, [u8; QK]) {
    let mut v = [0u8; QK];
    if ty == GgmlType::Q4_1 {
        for j in 0..QK / 2 {
            v[j] = x[4 + j] & 0x0F;
            v[j + QK / 2] = x[4 + j] >> 4;
        }
    } else {
        let qh = u32::from_le_bytes([x[4], x[5], x[6], x[7]]);
        for j in 0..QK / 2 {
            v[j] = (x[8 + j] & 0x0F) | ((((qh >> j) & 1) << 4) as u8);
            v[j + QK / 2] = (x[8 + j] >> 4) | ((((qh >> (j + 16)) & 1) << 4) as u8);
        }
    }
    (f16_at(x, 0), f16_at(x, 2), v)
}

/// Q4_1 / Q5_1 against q8_1, as `ggml_vec_dot_{q4_1,q5_1}_q8_1` (AVX2 branch; ggml runs it
/// for any number of tokens, there is no GEMM for these types on x86): per block eight i32
/// lanes of four products of the unsigned codes, `acc[l] = fma(dw·da, lane, acc[l])`, and a
/// scalar `summs = fma(m, s, summs)` (GCC contracts its `summs += m * s`: `vfmadd231ss` in the
/// reference build); the result is `hsum8(acc) + summs`.
pub(crate) fn vec_dot_legacy1(ty: GgmlType, n: usize, w: &[u8], a: &[u8]) -> f32 {
    let bs = ty.type_size();
    let mut acc = [0f32; 8];
    let mut summs = 0f32;
    for (x, y) in w.chunks_exact(bs).zip(a.chunks_exact(36)).take(n / QK) {
        let (dw, m, v) = legacy1_block(ty, x);
        summs = m.mul_add(f16_at(y, 2), summs);
        legacy_lanes(&mut acc, dw * f16_at(y, 0), |j| v[j] as i32, &y[4..]);
    }
    hsum8(&acc) + summs
}

/// The 16 values a 4-bit code of a [`vec_dot_block_chain`] type stands for: q4_0's `code - 8`,
/// IQ4_NL's `kvalues_iq4nl`.
pub(crate) fn nibble_values(ty: GgmlType) -> [i8; 16] {
    if ty == GgmlType::IQ4_NL {
        KVALUES_IQ4NL
    } else {
        core::array::from_fn(|c| c as i8 - 8)
    }
}

/// Q4_0 / IQ4_NL against q8_0 in the order of ggml's repacked `q4_0_8x8` / `iq4_nl_8x8` GEMV
/// and GEMM (x86 `gemv/gemm_q4_b32_8x8_q8_0_lut_avx`, which llama.cpp uses on AVX2 machines for
/// any number of tokens when the matrix has a multiple of 8 rows — every real model's): per
/// block the exact integer sum of the 32 products, then one `acc = fma(isum, dw·da, acc)`.
/// (Matrices with other row counts run `ggml_vec_dot_{q4_0,iq4_nl}_q8_0` / tinyBLAS there,
/// whose eight-lane orders we do not follow: docs/quant-types.md.)
pub(crate) fn vec_dot_block_chain(ty: GgmlType, n: usize, w: &[u8], a: &[u8]) -> f32 {
    let val = nibble_values(ty);
    let mut acc = 0f32;
    for (x, y) in w.chunks_exact(18).zip(a.chunks_exact(34)).take(n / QK) {
        let mut isum = 0i32;
        for j in 0..QK / 2 {
            isum += val[(x[2 + j] & 0xF) as usize] as i32 * (y[2 + j] as i8) as i32;
            isum += val[(x[2 + j] >> 4) as usize] as i32 * (y[2 + j + QK / 2] as i8) as i32;
        }
        acc = (isum as f32).mul_add(f16_at(x, 0) * f16_at(y, 0), acc);
    }
    acc
}

/// The 256 signed values and eight 32-value sub-block scales of an IQ4_XS super-block
/// (`dequantize_row_iq4_xs`: value `kvalues_iq4nl[code]`, scale `ls - 32`).
pub(crate) fn iq4xs_values(x: &[u8]) -> ([i8; QK_K], [i32; 8]) {
    let v = core::array::from_fn(|e| {
        let (ib, j) = (e / 32, e % 32);
        let q = x[8 + 16 * ib + j % 16];
        KVALUES_IQ4NL[(if j < 16 { q & 0xF } else { q >> 4 }) as usize]
    });
    (v, core::array::from_fn(|ib| iq4xs_scale(x, ib) - 32))
}

/// The 256 signed values (grid byte times its sign) and eight sub-block scales `2·ls + 1` of
/// an IQ2_XXS super-block (`dequantize_row_iq2_xxs`: sub-block `ib` is two words at
/// `2 + 8·ib`; the first holds four grid indices, the second four 7-bit sign indices and `ls`).
pub(crate) fn iq2xxs_values(x: &[u8]) -> ([i8; QK_K], [i32; 8]) {
    use crate::iq_grids::{IQ2XXS_GRID, KSIGNS_IQ2XS};
    let word = |o: usize| u32::from_le_bytes([x[o], x[o + 1], x[o + 2], x[o + 3]]);
    let v = core::array::from_fn(|e| {
        let (ib, l, j) = (e / 32, (e % 32) / 8, e % 8);
        let (idx, sg) = (word(2 + 8 * ib).to_le_bytes()[l], word(6 + 8 * ib));
        let g = (IQ2XXS_GRID[idx as usize] >> (8 * j)) as u8 as i8;
        let signs = KSIGNS_IQ2XS[((sg >> (7 * l)) & 127) as usize];
        if signs & (1 << j) != 0 {
            -g
        } else {
            g
        }
    });
    (
        v,
        core::array::from_fn(|ib| 2 * (word(6 + 8 * ib) >> 28) as i32 + 1),
    )
}

/// The 256 signed values and eight sub-block scales `2·ls + 1` of an IQ3_XXS super-block
/// (`dequantize_row_iq3_xxs`: 64 grid indices of four values each at 2, then per sub-block a
/// word at `66 + 4·ib` with four 7-bit sign indices and `ls`).
pub(crate) fn iq3xxs_values(x: &[u8]) -> ([i8; QK_K], [i32; 8]) {
    use crate::iq_grids::{IQ3XXS_GRID, KSIGNS_IQ2XS};
    let word = |o: usize| u32::from_le_bytes([x[o], x[o + 1], x[o + 2], x[o + 3]]);
    let v = core::array::from_fn(|e| {
        let (ib, l, j) = (e / 32, (e % 32) / 8, e % 8);
        let idx = x[2 + 8 * ib + 2 * l + j / 4];
        let g = (IQ3XXS_GRID[idx as usize] >> (8 * (j % 4))) as u8 as i8;
        let signs = KSIGNS_IQ2XS[((word(66 + 4 * ib) >> (7 * l)) & 127) as usize];
        if signs & (1 << j) != 0 {
            -g
        } else {
            g
        }
    });
    (
        v,
        core::array::from_fn(|ib| 2 * (word(66 + 4 * ib) >> 28) as i32 + 1),
    )
}

/// `y = ±(db · |value|)`, `db = (d · scale) · f` per sub-block of `QK_K / NS` values.
fn grid_dequant<const NS: usize>(d: f32, (v, sc): ([i8; QK_K], [i32; NS]), f: f32, y: &mut [f32]) {
    for (e, y) in y.iter_mut().enumerate().take(QK_K) {
        let db = d * sc[e / (QK_K / NS)] as f32 * f;
        let g = v[e].unsigned_abs() as f32;
        *y = if v[e] < 0 { -(db * g) } else { db * g };
    }
}

/// `y = (d · scale) · (value · 0.125)` for the IQ1 types (values `8 · grid + delta`).
fn iq1_dequant<const NS: usize>(d: f32, (v, sc): ([i8; QK_K], [i32; NS]), y: &mut [f32]) {
    for (e, y) in y.iter_mut().enumerate().take(QK_K) {
        *y = d * sc[e / (QK_K / NS)] as f32 * (v[e] as f32 * 0.125);
    }
}

/// Applies the sign bit `j` of `signs` to the unsigned grid value `g`.
#[inline(always)]
fn signed(g: u8, signs: u8, j: usize) -> i8 {
    if signs & (1 << j) != 0 {
        -(g as i8)
    } else {
        g as i8
    }
}

/// The 16 scales `2·ls + 1` of the IQ2_XS / IQ2_S sub-blocks of 16 values: low nibble of
/// `scales[ib]` for values `32ib..32ib+16`, high nibble for the next 16.
fn iq2_scales16(scales: &[u8]) -> [i32; 16] {
    core::array::from_fn(|s| 2 * ((scales[s / 2] >> (4 * (s % 2))) & 0xF) as i32 + 1)
}

/// IQ2_XS (`dequantize_row_iq2_xs`): 32 u16 at 2, each a 9-bit `iq2xs_grid` index (8 values)
/// and a 7-bit `ksigns_iq2xs` index; 16-value sub-block scales at 66.
pub(crate) fn iq2xs_values(x: &[u8]) -> ([i8; QK_K], [i32; 16]) {
    use crate::iq_grids::{IQ2XS_GRID, KSIGNS_IQ2XS};
    let v = core::array::from_fn(|e| {
        let (k, j) = (e / 8, e % 8);
        let q = u16::from_le_bytes([x[2 + 2 * k], x[3 + 2 * k]]);
        let g = (IQ2XS_GRID[(q & 511) as usize] >> (8 * j)) as u8;
        signed(g, KSIGNS_IQ2XS[(q >> 9) as usize], j)
    });
    (v, iq2_scales16(&x[66..74]))
}

/// IQ2_S (`dequantize_row_iq2_s`): 32 grid index bytes at 2 whose two high bits are in `qh`
/// (at 66, two bits per group of 8 values), 32 sign bytes at 34, scales at 74.
pub(crate) fn iq2s_values(x: &[u8]) -> ([i8; QK_K], [i32; 16]) {
    use crate::iq_grids::IQ2S_GRID;
    let v = core::array::from_fn(|e| {
        let (k, j) = (e / 8, e % 8);
        let (ib, l) = (k / 4, k % 4);
        let idx = x[2 + k] as usize | (((x[66 + ib] as usize) << (8 - 2 * l)) & 0x300);
        signed((IQ2S_GRID[idx] >> (8 * j)) as u8, x[34 + k], j)
    });
    (v, iq2_scales16(&x[74..82]))
}

/// IQ3_S (`dequantize_row_iq3_s`): 64 grid index bytes at 2 (four values each) whose ninth
/// bit is in `qh` (at 66, one bit per index), 32 sign bytes at 74, 4-bit scales of the
/// 32-value sub-blocks at 106 (two per byte).
pub(crate) fn iq3s_values(x: &[u8]) -> ([i8; QK_K], [i32; 8]) {
    use crate::iq_grids::IQ3S_GRID;
    let v = core::array::from_fn(|e| {
        let (ib, k) = (e / 32, (e % 32) / 4);
        let idx = x[2 + 8 * ib + k] as usize | (((x[66 + ib] as usize) << (8 - k)) & 256);
        let g = (IQ3S_GRID[idx] >> (8 * (e % 4))) as u8;
        signed(g, x[74 + e / 8], e % 8)
    });
    (
        v,
        core::array::from_fn(|ib| 2 * ((x[106 + ib / 2] >> (4 * (ib % 2))) & 0xF) as i32 + 1),
    )
}

/// One `iq1s_grid` value (−1, 0 or 1) as `8 · value + delta`.
#[inline(always)]
fn iq1_value(idx: usize, j: usize, delta: i8) -> i8 {
    8 * ((crate::iq_grids::IQ1S_GRID[idx] >> (8 * j)) as u8 as i8) + delta
}

/// IQ1_S (`dequantize_row_iq1_s`) as `8 · grid + delta`: 32 index bytes at 2, and per
/// 32-value sub-block a u16 at 34 with the indices' three high bits (three per group of 8),
/// the 3-bit scale (bits 12..15) and the delta's sign (bit 15).
pub(crate) fn iq1s_values(x: &[u8]) -> ([i8; QK_K], [i32; 8]) {
    let qh = |ib: usize| u16::from_le_bytes([x[34 + 2 * ib], x[35 + 2 * ib]]) as usize;
    let v = core::array::from_fn(|e| {
        let (ib, l) = (e / 32, (e % 32) / 8);
        let h = qh(ib);
        let delta = if h & 0x8000 != 0 { -1 } else { 1 };
        iq1_value(
            x[2 + 4 * ib + l] as usize | (((h >> (3 * l)) & 7) << 8),
            e % 8,
            delta,
        )
    });
    (
        v,
        core::array::from_fn(|ib| 2 * ((qh(ib) >> 12) & 7) as i32 + 1),
    )
}

/// The four u16 scale words of an IQ1_M super-block (at 48).
fn iq1m_words(x: &[u8]) -> [u16; 4] {
    core::array::from_fn(|i| u16::from_le_bytes([x[48 + 2 * i], x[49 + 2 * i]]))
}

/// The bits of IQ1_M's f16 super-block scale: the top nibbles of its four scale words.
pub(crate) fn iq1m_d_bits(sc: [u16; 4]) -> u16 {
    (sc[0] >> 12) | ((sc[1] >> 8) & 0x00F0) | ((sc[2] >> 4) & 0x0F00) | (sc[3] & 0xF000)
}

/// IQ1_M's f16 super-block scale ([`iq1m_d_bits`]).
pub(crate) fn iq1m_d(x: &[u8]) -> f32 {
    f16::from_bits(iq1m_d_bits(iq1m_words(x))).to_f32()
}

/// IQ1_M (`dequantize_row_iq1_m`) as `8 · grid + delta`: 32 index bytes at 0, per group of 8
/// values a nibble of `qh` (at 32) with three high index bits and the delta's sign (bit 3),
/// and 3-bit scales of the 16-value sub-blocks in the scale words (six bits per 32 values).
pub(crate) fn iq1m_values(x: &[u8]) -> ([i8; QK_K], [i32; 16]) {
    let v = core::array::from_fn(|e| {
        let k = e / 8;
        let h = (x[32 + k / 2] >> (4 * (k % 2))) as usize;
        let delta = if h & 8 != 0 { -1 } else { 1 };
        iq1_value(x[k] as usize | ((h & 7) << 8), e % 8, delta)
    });
    let sc = iq1m_words(x);
    (
        v,
        core::array::from_fn(|s| {
            let (ib, half) = (s / 2, s % 2);
            2 * ((sc[ib / 2] >> (6 * (ib % 2) + 3 * half)) & 7) as i32 + 1
        }),
    )
}

/// A super-block's 256 signed values and its `NS` sub-block scales.
type Lanes8Values<const NS: usize> = fn(&[u8]) -> ([i8; QK_K], [i32; NS]);

/// How the IQ1 types' delta enters their `vec_dot` (their values are `8 · grid + delta`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Delta {
    /// Every other type: no delta.
    No,
    /// IQ1_S: the grid's lanes as any type's, and beside them one scalar chain
    /// `acc1 = fma(dw·dy, Σ scale · delta · q8, acc1)`; `hsum8 + 0.125 · acc1` at the end.
    Scalar,
    /// IQ1_M: a second set of eight lanes for `scale · delta · q8`; `hsum8(grid lanes) +
    /// 0.125 · hsum8(delta lanes)`.
    Lanes,
}

/// A super-block type whose `vec_dot` keeps eight f32 lanes (`lanes8_then_tiled`).
pub(crate) struct Lanes8Type<const NS: usize> {
    /// Bytes per super-block.
    pub bs: usize,
    /// The f16 super-block scale.
    pub dw: fn(&[u8]) -> f32,
    /// The factor ggml applies after the lanes (IQ2 types 0.125, IQ3_XXS 0.25, else 1) and
    /// folds into the tiled step's scale; for the IQ1 types (0.125) the factor of the delta's
    /// chain in the lanes order.
    pub post: f32,
    pub delta: Delta,
    /// The 256 signed values and the `NS` sub-block scales.
    pub values: Lanes8Values<NS>,
}

/// q3_K (16 sub-blocks of 16 values, its value offset 4 taken per value), IQ4_XS, IQ2_XXS,
/// IQ3_XXS, IQ3_S, IQ1_S (8 sub-blocks of 32), IQ2_XS, IQ2_S, IQ1_M (16 of 16), against q8_K.
/// [`KOrder::Lanes8`] is the type's `ggml_vec_dot_*_q8_K` (AVX2 branch): lane `l` holds values
/// `4l..4l+4` of every 32-value chunk, each times its sub-block's scale, one `fma(dw·dy, lane,
/// acc_l)` per super-block, `post · hsum8` at the end (the IQ1 types: see [`Delta`]).
/// [`KOrder::Tiled`] is the tiled matmul's one step per super-block, `res = isum · (dw·post)`,
/// `acc = fma(res, dy, acc)` (ggml folds `post` into the tile's scale; the IQ1 types' codes
/// are `8 · grid + delta`).
fn vec_dot_lanes8<const NS: usize>(
    n: usize,
    w: &[u8],
    a: &[u8],
    order: KOrder,
    ty: &Lanes8Type<NS>,
) -> f32 {
    let mut lanes_acc = [0f32; 8];
    let mut delta_acc = [0f32; 8];
    let mut acc = 0f32;
    for (x, y) in w
        .chunks_exact(ty.bs)
        .zip(a.chunks_exact(292))
        .take(n / QK_K)
    {
        let (yd, q8, _) = q8k_parts(y);
        let dw = (ty.dw)(x);
        let (v, sc) = (ty.values)(x);
        // The full values' lanes; for the IQ1 types also the grid's and the delta's.
        let iq1 = ty.delta != Delta::No;
        let mut lanes = [0i32; 8];
        let mut grid = [0i32; 8];
        let mut delta = [0i32; 8];
        for e in 0..QK_K {
            let (s, q, v) = (sc[e / (QK_K / NS)], (q8[e] as i8) as i32, v[e] as i32);
            let l = (e % 32) / 4;
            lanes[l] += s * v * q;
            if iq1 {
                let g = (v + 4).div_euclid(8);
                grid[l] += s * g * q;
                delta[l] += s * (v - 8 * g) * q;
            }
        }
        if order == KOrder::Tiled {
            let isum: i32 = lanes.iter().sum();
            acc = (isum as f32 * (dw * ty.post)).mul_add(yd, acc);
            continue;
        }
        let d = dw * yd;
        let lanes = if iq1 { grid } else { lanes };
        for l in 0..8 {
            lanes_acc[l] = d.mul_add(lanes[l] as f32, lanes_acc[l]);
        }
        match ty.delta {
            Delta::No => {}
            Delta::Lanes => {
                for l in 0..8 {
                    delta_acc[l] = d.mul_add(delta[l] as f32, delta_acc[l]);
                }
            }
            // IQ1_S: `accum1 += d * sumi1`, contracted to an FMA (`vfmadd231ss` in the
            // reference build).
            Delta::Scalar => acc = d.mul_add(delta.iter().sum::<i32>() as f32, acc),
        }
    }
    match (order, ty.delta) {
        (KOrder::Tiled, _) => acc,
        (_, Delta::No) => ty.post * hsum8(&lanes_acc),
        (_, Delta::Scalar) => hsum8(&lanes_acc) + ty.post * acc,
        (_, Delta::Lanes) => hsum8(&lanes_acc) + ty.post * hsum8(&delta_acc),
    }
}

const fn lanes8<const NS: usize>(
    bs: usize,
    dw: fn(&[u8]) -> f32,
    post: f32,
    delta: Delta,
    values: Lanes8Values<NS>,
) -> Lanes8Type<NS> {
    Lanes8Type {
        bs,
        dw,
        post,
        delta,
        values,
    }
}

fn f16_0(x: &[u8]) -> f32 {
    f16_at(x, 0)
}

const Q3K: Lanes8Type<16> = lanes8(110, |x| f16_at(x, 108), 1.0, Delta::No, q3k_values);
const IQ4XS: Lanes8Type<8> = lanes8(136, f16_0, 1.0, Delta::No, iq4xs_values);
const IQ2XXS: Lanes8Type<8> = lanes8(66, f16_0, 0.125, Delta::No, iq2xxs_values);
const IQ3XXS: Lanes8Type<8> = lanes8(98, f16_0, 0.25, Delta::No, iq3xxs_values);
const IQ2XS: Lanes8Type<16> = lanes8(74, f16_0, 0.125, Delta::No, iq2xs_values);
const IQ2S: Lanes8Type<16> = lanes8(82, f16_0, 0.125, Delta::No, iq2s_values);
const IQ3S: Lanes8Type<8> = lanes8(110, f16_0, 1.0, Delta::No, iq3s_values);
const IQ1S: Lanes8Type<8> = lanes8(50, f16_0, 0.125, Delta::Scalar, iq1s_values);
const IQ1M: Lanes8Type<16> = lanes8(56, iq1m_d, 0.125, Delta::Lanes, iq1m_values);

/// Which ggml kernel, hence which float order, a k-quant dot follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KOrder {
    /// `ggml_vec_dot_q6_K_q8_K` / `ggml_vec_dot_q3_K_q8_K` (AVX2): eight i32 lanes per
    /// super-block, one FMA each, [`hsum8`].
    Lanes8,
    /// Repacked `ggml_gemv_q4_K_8x8_q8_K`: one FMA per super-block for the scales and one for
    /// the mins, `acc - acc_min` at the end.
    Sb256,
    /// Repacked `ggml_gemm_q4_K_8x8_q8_K`: the same per 64 values (two sub-blocks).
    Sb64,
    /// Repacked `ggml_gemm_q2_K_8x8_q8_K` (AVX-512 machines): the same per 128 values.
    Sb128,
    /// The tiled K-quant matmul (ggml-cpu/tiled): per super-block `acc = fma(res, da, acc)`
    /// (its `acc + result * d1` intrinsics, contracted to an FMA by GCC) with
    /// `res = isum * dw` (q6_K, q3_K) or `res = fnmadd(dmin, imin, isum * dw)` (q4_K / q5_K).
    Tiled,
}

/// The k-quants llama.cpp repacks on x86 (q4_K, and q2_K on AVX-512 machines): a token sums in
/// the repacked GEMM's order when it is in a whole group of four, else in the GEMV's.
pub(crate) fn repacked_k(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_K | GgmlType::Q2_K)
}

/// The types whose `vec_dot` keeps eight f32 lanes per super-block ([`KOrder::Lanes8`]) and
/// which ggml's tiled matmul takes from 8 tokens ([`KOrder::Tiled`]): q6_K, q3_K, IQ4_XS and
/// the IQ grid types.
pub(crate) fn lanes8_then_tiled(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q6_K | GgmlType::Q3_K | GgmlType::IQ4_XS) || iq_grid(ty)
}

/// The IQ types whose values come from ggml's grid tables (`crate::iq_grids`).
pub(crate) fn iq_grid(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::IQ2_XXS
            | GgmlType::IQ2_XS
            | GgmlType::IQ2_S
            | GgmlType::IQ3_XXS
            | GgmlType::IQ3_S
            | GgmlType::IQ1_S
            | GgmlType::IQ1_M
    )
}

/// The order ggml uses for token `t` of an `ntok`-token matmul with weights `ty`.
///
/// - q4_K is repacked to `q4_K_8x8` on AVX2 machines: tokens in whole groups of four from the
///   start go through the GEMM, the remaining `ntok % 4` through the GEMV. (ggml repacks only
///   matrices whose row count is a multiple of 8; we use these orders for every q4_K matrix.)
///   q2_K likewise (`q2_K_8x8`), but only on AVX-512 machines, and its GEMM steps per 128
///   values; we follow those machines everywhere (an AVX2-only llama.cpp runs q2_K's
///   `vec_dot` and tiled orders instead: docs/quant-types.md).
/// - q6_K, q3_K, IQ4_XS and the IQ grid types run the tiled matmul from 8 tokens on and their
///   `vec_dot` below.
/// - q5_K is not repacked on x86: ggml runs it through the tiled matmul from 8 tokens on, as
///   q6_K. Below 8 tokens (`ggml_vec_dot_q5_K_q8_K`) we keep the q4_K GEMV order: no model we
///   test against llama.cpp token for token has q5_K weights.
pub(crate) fn k_order(ty: GgmlType, t: usize, ntok: usize) -> KOrder {
    match ty {
        GgmlType::Q5_K if ntok >= 8 => KOrder::Tiled,
        _ if lanes8_then_tiled(ty) => {
            if ntok >= 8 {
                KOrder::Tiled
            } else {
                KOrder::Lanes8
            }
        }
        GgmlType::Q2_K if t < ntok - ntok % 4 => KOrder::Sb128,
        _ if t < ntok - ntok % 4 => KOrder::Sb64,
        _ => KOrder::Sb256,
    }
}

/// The order token `t` of the matmul `g` sums in. Parity: [`k_order`] of the whole batch.
/// Invariant: one order per weight type whatever the batch holds and wherever the token sits,
/// so a token's row equals its 1-token matmul bit for bit: q4_K/q5_K `Sb256` (the repacked
/// GEMV's, one f32 step per super-block) and q6_K / q3_K `Tiled` (also one f32 step per
/// super-block, which a GEMM with tokens in the register lanes does as cheaply as the GEMV; their
/// `vec_dot` order `Lanes8` would need eight f32 chains per token there). Every other weight
/// type sums in one order for any batch (`vec_dot_legacy`, `vec_dot_legacy1`, the float dots,
/// `crate::ternary`), on every ISA.
/// Routed (`MUL_MAT_ID`): repacked q4_K one token at a time, the rest as Parity.
pub(crate) fn token_order(g: &crate::matmul::Gemm<'_>, t: usize) -> KOrder {
    match g.numerics {
        crate::Numerics::Invariant => match g.wty {
            ty if lanes8_then_tiled(ty) => KOrder::Tiled,
            _ => KOrder::Sb256,
        },
        crate::Numerics::Routed if repacked_k(g.wty) => k_order(g.wty, 0, 1),
        crate::Numerics::Routed | crate::Numerics::Parity => k_order(g.wty, t, g.ntok),
    }
}

fn q8k_parts(y: &[u8]) -> (f32, &[u8], [i16; 16]) {
    let mut bsums = [0i16; 16];
    for (j, b) in bsums.iter_mut().enumerate() {
        *b = i16_at(y, 4 + QK_K + 2 * j);
    }
    (f32_at(y, 0), &y[4..4 + QK_K], bsums)
}

/// q4_K / q5_K against q8_K in [`KOrder::Sb256`], [`KOrder::Sb64`] or [`KOrder::Tiled`] order.
fn vec_dot_qk45(n: usize, w: &[u8], a: &[u8], q5: bool, order: KOrder) -> f32 {
    let ts = if q5 { 176 } else { 144 };
    let per = if order == KOrder::Sb64 { 2 } else { 8 };
    let (mut acc, mut acc_min) = (0f32, 0f32);
    for (x, y) in w.chunks_exact(ts).zip(a.chunks_exact(292)).take(n / QK_K) {
        let (yd, q8, bsums) = q8k_parts(y);
        let scales = &x[4..16];
        let qs = if q5 { &x[48..176] } else { &x[16..144] };
        // Sub-block j holds values 32j..32j+32: low nibbles of qs[32(j/2)..] for even j, high
        // nibbles for odd j (+16 from qh bit j on q5_K).
        let mut raw = [0i32; 8];
        for j in 0..8 {
            for l in 0..32 {
                let b = qs[32 * (j / 2) + l];
                let mut c = if j % 2 == 0 { b & 0xF } else { b >> 4 } as i32;
                if q5 && x[16 + l] & (1 << j) != 0 {
                    c += 16;
                }
                raw[j] += c * (q8[32 * j + l] as i8) as i32;
            }
        }
        if order == KOrder::Tiled {
            let (mut isum, mut imin) = (0i32, 0i32);
            for j in 0..8 {
                let (sc, m) = scale_min_k4(j, scales);
                isum += sc as i32 * raw[j];
                imin += m as i32 * (bsums[2 * j] as i32 + bsums[2 * j + 1] as i32);
            }
            let res = (-f16_at(x, 2)).mul_add(imin as f32, isum as f32 * f16_at(x, 0));
            acc = res.mul_add(yd, acc);
            continue;
        }
        let dw = f16_at(x, 0) * yd;
        let dm = f16_at(x, 2) * yd;
        for g in (0..8).step_by(per) {
            let (mut isum, mut imin) = (0i32, 0i32);
            for j in g..g + per {
                let (sc, m) = scale_min_k4(j, scales);
                isum += sc as i32 * raw[j];
                imin += m as i32 * (bsums[2 * j] as i32 + bsums[2 * j + 1] as i32);
            }
            acc = (isum as f32).mul_add(dw, acc);
            acc_min = (imin as f32).mul_add(dm, acc_min);
        }
    }
    if order == KOrder::Tiled {
        acc
    } else {
        acc - acc_min
    }
}

/// The 256 q2_K codes (0..3) of a super-block in value order: value `e` is bits `2s..2s+2`
/// (s = (e % 128) / 32) of `qs[32·(e / 128) + e % 32]`, in sub-block `e / 16`.
pub(crate) fn q2k_codes(x: &[u8]) -> [u8; QK_K] {
    let qs = &x[16..80];
    core::array::from_fn(|e| (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3)
}

/// q2_K against q8_K in [`KOrder::Sb256`] (the repacked GEMV: one FMA per super-block for the
/// scaled sums and one for the mins, `acc - acc_min` at the end) or [`KOrder::Sb128`] (the
/// repacked GEMM: the same per 128 values).
fn vec_dot_q2k(n: usize, w: &[u8], a: &[u8], order: KOrder) -> f32 {
    let per = if order == KOrder::Sb128 { 8 } else { 16 };
    let (mut acc, mut acc_min) = (0f32, 0f32);
    for (x, y) in w.chunks_exact(84).zip(a.chunks_exact(292)).take(n / QK_K) {
        let (yd, q8, bsums) = q8k_parts(y);
        let c = q2k_codes(x);
        let dw = f16_at(x, 80) * yd;
        let dm = f16_at(x, 82) * yd;
        for j0 in (0..16).step_by(per) {
            let (mut isum, mut imin) = (0i32, 0i32);
            for j in j0..j0 + per {
                let mut raw = 0i32;
                for e in 16 * j..16 * j + 16 {
                    raw += c[e] as i32 * (q8[e] as i8) as i32;
                }
                isum += (x[j] & 0xF) as i32 * raw;
                imin += (x[j] >> 4) as i32 * bsums[j] as i32;
            }
            acc = (isum as f32).mul_add(dw, acc);
            acc_min = (imin as f32).mul_add(dm, acc_min);
        }
    }
    acc - acc_min
}

/// The 256 q6_K codes of a super-block, unsigned (value + 32), in value order.
fn q6k_codes(x: &[u8]) -> [u8; QK_K] {
    let mut c = [0u8; QK_K];
    for h in 0..2 {
        let ql = &x[64 * h..];
        let qh = &x[128 + 32 * h..];
        let a = &mut c[128 * h..];
        for l in 0..32 {
            a[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
            a[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
            a[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            a[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
    c
}

/// The 256 signed values (-4..3) and the 16 scales (-32..31) of a q3_K super-block, as
/// `dequantize_row_q3_K` reads them (value `e` uses scale `e / 16`).
pub(crate) fn q3k_values(x: &[u8]) -> ([i8; QK_K], [i32; 16]) {
    let hm = &x[0..32];
    let qs = &x[32..96];
    let raw = q3k_scales(x[96..108].try_into().expect("a q3_K block has 110 bytes"));
    let mut sc = [0i32; 16];
    for (s, r) in sc.iter_mut().zip(raw) {
        *s = r as i32 - 32;
    }
    let mut v = [0i8; QK_K];
    for e in 0..QK_K {
        // Chunk c of 32 values: 2-bit field c % 4 of bytes 32·(c / 4).., high bit c of hmask.
        let (c, i) = (e / 32, e % 32);
        let low = (qs[32 * (c / 4) + i] >> (2 * (c % 4))) & 3;
        let high = (hm[i] >> c) & 1;
        v[e] = low as i8 - if high != 0 { 0 } else { 4 };
    }
    (v, sc)
}

/// q6_K against q8_K in [`KOrder::Lanes8`] or [`KOrder::Tiled`] order.
fn vec_dot_q6k(n: usize, w: &[u8], a: &[u8], order: KOrder) -> f32 {
    let mut lanes_acc = [0f32; 8];
    let mut acc = 0f32;
    for (x, y) in w.chunks_exact(210).zip(a.chunks_exact(292)).take(n / QK_K) {
        let (yd, q8, bsums) = q8k_parts(y);
        let c = q6k_codes(x);
        let sc = |j: usize| (x[192 + j] as i8) as i32;
        let dw = f16_at(x, 208);
        if order == KOrder::Tiled {
            let mut isum = 0i32;
            for e in 0..QK_K {
                isum += sc(e / 16) * (c[e] as i32 - 32) * (q8[e] as i8) as i32;
            }
            acc = (isum as f32 * dw).mul_add(yd, acc);
        } else {
            // Lane l: bytes 4l..4l+4 of every 32-value chunk, each with its sub-block scale,
            // minus the offset 32 over chunk l's two sub-blocks (via bsums).
            let d = yd * dw;
            for l in 0..8 {
                let mut lane = 0i32;
                for ch in 0..8 {
                    for e in 32 * ch + 4 * l..32 * ch + 4 * l + 4 {
                        lane += sc(e / 16) * c[e] as i32 * (q8[e] as i8) as i32;
                    }
                }
                lane -= 32
                    * (bsums[2 * l] as i32 * sc(2 * l) + bsums[2 * l + 1] as i32 * sc(2 * l + 1));
                lanes_acc[l] = d.mul_add(lane as f32, lanes_acc[l]);
            }
        }
    }
    if order == KOrder::Tiled {
        acc
    } else {
        hsum8(&lanes_acc)
    }
}

/// `dot(n, weight row bytes, activation row bytes)` for the float weight types.
pub(crate) type VecDotFn = fn(usize, &[u8], &[u8]) -> f32;

/// The reference dot product of a float weight type against its `vec_dot_type` activations.
fn float_dot_fn(w: GgmlType) -> Option<VecDotFn> {
    Some(match w {
        GgmlType::F32 => vec_dot_f32,
        GgmlType::F16 => vec_dot_f16,
        GgmlType::BF16 => vec_dot_bf16,
        _ => return None,
    })
}

/// Whether the reference has a dot product (hence a matmul) for weights of type `w`.
pub(crate) fn has_dot(w: GgmlType) -> bool {
    matches!(
        w,
        GgmlType::Q8_0
            | GgmlType::Q4_0
            | GgmlType::Q5_0
            | GgmlType::Q4_1
            | GgmlType::Q5_1
            | GgmlType::Q2_K
            | GgmlType::Q3_K
            | GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K
            | GgmlType::IQ4_NL
            | GgmlType::IQ4_XS
            | GgmlType::TQ1_0
            | GgmlType::TQ2_0
            | GgmlType::TF2
            | GgmlType::TF1
    ) || iq_grid(w)
        || float_dot_fn(w).is_some()
}

/// The reference dot of weight row `w` with activation row `a` (`n` elements); k-quants sum in
/// `order` (see [`token_order`]), the other types ignore it.
pub(crate) fn dot(ty: GgmlType, order: KOrder, n: usize, w: &[u8], a: &[u8]) -> f32 {
    match ty {
        GgmlType::Q8_0 | GgmlType::Q5_0 => vec_dot_legacy(ty, n, w, a),
        GgmlType::Q4_0 | GgmlType::IQ4_NL => vec_dot_block_chain(ty, n, w, a),
        GgmlType::Q4_1 | GgmlType::Q5_1 => vec_dot_legacy1(ty, n, w, a),
        GgmlType::Q4_K => vec_dot_qk45(n, w, a, false, order),
        GgmlType::Q5_K => vec_dot_qk45(n, w, a, true, order),
        GgmlType::Q6_K => vec_dot_q6k(n, w, a, order),
        GgmlType::Q2_K => vec_dot_q2k(n, w, a, order),
        GgmlType::Q3_K => vec_dot_lanes8(n, w, a, order, &Q3K),
        GgmlType::IQ4_XS => vec_dot_lanes8(n, w, a, order, &IQ4XS),
        GgmlType::IQ2_XXS => vec_dot_lanes8(n, w, a, order, &IQ2XXS),
        GgmlType::IQ3_XXS => vec_dot_lanes8(n, w, a, order, &IQ3XXS),
        GgmlType::IQ2_XS => vec_dot_lanes8(n, w, a, order, &IQ2XS),
        GgmlType::IQ2_S => vec_dot_lanes8(n, w, a, order, &IQ2S),
        GgmlType::IQ3_S => vec_dot_lanes8(n, w, a, order, &IQ3S),
        GgmlType::IQ1_S => vec_dot_lanes8(n, w, a, order, &IQ1S),
        GgmlType::IQ1_M => vec_dot_lanes8(n, w, a, order, &IQ1M),
        GgmlType::TQ1_0 | GgmlType::TQ2_0 => crate::ternary::vec_dot_tq(ty, n, w, a),
        GgmlType::TF2 | GgmlType::TF1 => crate::ternary::vec_dot_tf(ty, n, w, a),
        _ => float_dot_fn(ty).expect("Gemm is only built for weight types with a dot")(n, w, a),
    }
}

/// Reference matmul: one [`dot`] per (row, token), in the token's [`token_order`]. Same
/// contract as the SIMD kernels.
pub(crate) fn matmul(g: &crate::matmul::Gemm<'_>, out: &mut [f32]) {
    for t in 0..g.ntok {
        let a = g.act_row(t);
        let order = token_order(g, t);
        for r in 0..g.nrows {
            out[t * g.nrows + r] = dot(g.wty, order, g.cols, g.w_row(r), a);
        }
    }
}

/// `Σ a[i]·b[i]` as llamafile's `tinyBLAS<16, __m512>` sums a row (ggml's f32 `mul_mat` for
/// two or more tokens): one 16-lane FMA accumulator over 16-element steps, then halved
/// 16 → 8 → 4 → 2 → 1 (`_mm512_reduce_add_ps`). Lengths are equal multiples of 16.
pub(crate) fn dot_f32_tinyblas(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    for (x, y) in a.chunks_exact(16).zip(b.chunks_exact(16)) {
        for l in 0..16 {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    let mut width = 8;
    while width > 0 {
        for l in 0..width {
            acc[l] += acc[l + width];
        }
        width /= 2;
    }
    acc[0]
}

/// `ggml_vec_dot_f32` over f32 slices (double accumulation, like the scalar ggml path).
pub(crate) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    ggml_order_dot(a.len().min(b.len()), |i| (a[i], b[i]))
}

/// `ggml_vec_dot_f16` as llama.cpp's AVX-512 build sums it (ggml-cpu/vec.cpp with the
/// simd-mappings.h AVX-512 macros): four 16-lane FMA accumulators over 64-element steps,
/// reduced `(a0+a2)+(a1+a3)`, then across lanes pairwise (i+8, i+4, i+2, i+1) like
/// `_mm512_reduce_add_ps`, in f64 from there on with the tail's f32 products. Every ISA follows
/// this order, because attention scores decide greedy parity with llama.cpp.
pub(crate) fn dot_f16(a: &[f16], b: &[f16]) -> f32 {
    ggml_order_dot(a.len().min(b.len()), |i| (a[i].to_f32(), b[i].to_f32()))
}

/// `y[i] = f16(x[i] * v + y[i])`: widen, one f32 fused multiply-add, narrow with
/// round-to-nearest-even (llama.cpp's AVX-512 `ggml_vec_mad_f16`). Every ISA is bit-identical.
pub(crate) fn mad_f16(y: &mut [f16], x: &[f16], v: f32) {
    for (y, x) in y.iter_mut().zip(x) {
        *y = f16::from_f32(x.to_f32().mul_add(v, y.to_f32()));
    }
}

/// `y[i] = fma(x[i], v, y[i])`: one rounding per element (`ggml_vec_mad_f32`'s FMA lanes).
pub(crate) fn mad_f32(y: &mut [f32], x: &[f32], v: f32) {
    for (y, x) in y.iter_mut().zip(x) {
        *y = x.mul_add(v, *y);
    }
}

/// `y[i] = f16(y[i] * v)` (`ggml_vec_scale_f16`).
pub(crate) fn scale_f16(y: &mut [f16], v: f32) {
    for y in y.iter_mut() {
        *y = f16::from_f32(y.to_f32() * v);
    }
}

/// The summation order of [`dot_f16`], for any element source.
pub(crate) fn ggml_order_dot(n: usize, at: impl Fn(usize) -> (f32, f32)) -> f32 {
    let np = n & !63;
    let mut acc = [[0f32; 16]; 4];
    for i in (0..np).step_by(64) {
        for (k, lanes) in acc.iter_mut().enumerate() {
            for (l, v) in lanes.iter_mut().enumerate() {
                let (x, y) = at(i + 16 * k + l);
                *v = x.mul_add(y, *v);
            }
        }
    }
    let mut v = [0f32; 16];
    for l in 0..16 {
        v[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    }
    let mut width = 8;
    while width > 0 {
        for l in 0..width {
            v[l] += v[l + width];
        }
        width /= 2;
    }
    let mut sum = v[0] as f64;
    for i in np..n {
        let (x, y) = at(i);
        sum += (x * y) as f64;
    }
    sum as f32
}

// ---------------------------------------------------------------------------------------------
// Tiled flash attention (llama.cpp's `ggml_compute_forward_flash_attn_ext_tiled`, used for 64
// or more queries): f32 score and P·V GEMMs that sum each element in one sequential FMA chain,
// and the vectorised `ggml_v_expf` of its softmax.

/// `out[r·w + j] = Σ_d q[r·dk + d]·kt[d·w + j]` for each query row `r` (`dk = kt.len() / w`),
/// one FMA per `d` in order from 0: the elements of `simd_gemm(KQ, Q, Kᵀ)` in
/// ggml-cpu/simd-gemm.h.
pub(crate) fn fa_scores(q: &[f32], kt: &[f32], w: usize, out: &mut [f32]) {
    let dk = kt.len() / w;
    for (qr, orow) in q.chunks_exact(dk).zip(out.chunks_exact_mut(w)) {
        for (j, o) in orow.iter_mut().enumerate() {
            let mut acc = 0f32;
            for (d, &qd) in qr.iter().enumerate() {
                acc = kt[d * w + j].mul_add(qd, acc);
            }
            *o = acc;
        }
    }
}

/// `acc[r·n + i] += Σ_j p[r·w + j]·v[j·n + i]` for each row `r` (`w = v.len() / n`), one FMA
/// per `j` in order: the elements of `simd_gemm(VKQ, P, V)`.
pub(crate) fn fa_pv(acc: &mut [f32], p: &[f32], v: &[f32], n: usize) {
    let w = v.len() / n;
    for (arow, prow) in acc.chunks_exact_mut(n).zip(p.chunks_exact(w)) {
        for (j, &pj) in prow.iter().enumerate() {
            for (i, a) in arow.iter_mut().enumerate() {
                *a = v[j * n + i].mul_add(pj, *a);
            }
        }
    }
}

const EXP_SHIFT: u32 = 0x4b40_0000; // 0x1.8p23
const EXP_LOG2E: u32 = 0x3fb8_aa3b; // 0x1.715476p+0
const EXP_LN2_HI: u32 = 0x3f31_7200; // 0x1.62e4p-1
const EXP_LN2_LO: u32 = 0x35bf_be8e; // 0x1.7f7d1cp-20
const EXP_P: [u32; 5] = [
    0x3c07_2010, // 0x1.0e4020p-7
    0x3d2b_9f17, // 0x1.573e2ep-5
    0x3e2a_af33, // 0x1.555e66p-3
    0x3eff_fedb, // 0x1.fffdb6p-2
    0x3f7f_fff6, // 0x1.ffffecp-1
];

/// One lane of ggml's AVX-512 `ggml_v_expf` (ggml-cpu/vec.h): `2^n · p(b)` with
/// `n = round(x·log2 e)`, `b = x - n·ln 2` in two FMAs, `p` a degree-5 polynomial, and
/// `_mm512_scalef_ps` for the power of two; 0 or ∞ when `|n| > 192`.
#[inline(always)]
pub(crate) fn ggml_v_expf(x: f32) -> f32 {
    let f = f32::from_bits;
    let r = f(EXP_SHIFT);
    let z = x.mul_add(f(EXP_LOG2E), r);
    let n = z - r;
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    let b = (-n).mul_add(f(EXP_LN2_LO), (-n).mul_add(f(EXP_LN2_HI), x));
    let u = b * b;
    let p = |i: usize| f(EXP_P[i]);
    let j = p(0)
        .mul_add(b, p(1))
        .mul_add(u, p(2).mul_add(b, p(3)))
        .mul_add(u, p(4).mul_add(b, 1.0));
    // scalef: j·2^floor(n), one rounding (subnormal results included) via the exact f64 product.
    // `n` is a whole number in [-192, 192], so 2^n is built from its exponent bits (no libm).
    let pow2 = f64::from_bits(((n as i64 + 1023) as u64) << 52);
    (j as f64 * pow2) as f32
}

/// See [`crate::widen_transpose_f16`].
pub(crate) fn widen_transpose_f16(
    src: &[f16],
    src_stride: usize,
    rows: usize,
    cols: usize,
    dst: &mut [f32],
    dst_stride: usize,
) {
    for r in 0..rows {
        for c in 0..cols {
            dst[c * dst_stride + r] = src[r * src_stride + c].to_f32();
        }
    }
}

/// `ggml_vec_swiglu_f32` (AVX-512 build): `ggml_v_silu(x) * u` for whole 16-lane chunks
/// (`x / (1 + ggml_v_expf(0 - x))`, a true division), `x / (1 + expf(-x)) * u` for the tail.
#[inline(always)]
pub(crate) fn swiglu(g: &mut [f32], u: &[f32]) {
    let whole = g.len() - g.len() % 16;
    let (gv, gt) = g.split_at_mut(whole);
    let (uv, ut) = u.split_at(whole);
    for (x, u) in gv.iter_mut().zip(uv) {
        *x = *x / (1.0 + ggml_v_expf(0.0 - *x)) * u;
    }
    for (x, u) in gt.iter_mut().zip(ut) {
        *x = *x / (1.0 + (-*x).exp()) * u;
    }
}

/// `ggml_vec_soft_max_f32` (AVX-512 build): `x[i] = exp(x[i] - max)` and the sum, 16 lanes at
/// a time with `ggml_v_expf` and `_mm512_reduce_add_ps` (halving: +8, +4, +2, +1) into an f64,
/// the tail with libm `expf`.
#[inline(always)]
pub(crate) fn softmax_exp(x: &mut [f32], max: f32) -> f64 {
    let mut sum = 0f64;
    let mut chunks = x.chunks_exact_mut(16);
    for c in &mut chunks {
        let mut v = [0f32; 16];
        for (o, xi) in v.iter_mut().zip(c.iter_mut()) {
            *xi = ggml_v_expf(*xi - max);
            *o = *xi;
        }
        let mut width = 8;
        while width > 0 {
            for l in 0..width {
                v[l] += v[l + width];
            }
            width /= 2;
        }
        sum += v[0] as f64;
    }
    for xi in chunks.into_remainder() {
        *xi = (*xi - max).exp();
        sum += *xi as f64;
    }
    sum
}
