//! Ternary (BitNet b1.58) weights, the scalar reference: ggml's TQ1_0 / TQ2_0 against Q8_K
//! activations, and ternfleet's TF2 / TF1 against Q8_TF (layouts in `quant.rs` and
//! docs/ternary.md).
//!
//! Every block is first turned into its codes `c ∈ {0,1,2}` (`c = q + 1`) in value order; the
//! dot products then follow one fixed float order per family, which the SIMD kernels in
//! `x86_64/` reproduce bit for bit (all integer sums are exact, so only the f32 steps matter):
//! - TQ1_0 / TQ2_0: `ggml_vec_dot_tq{1,2}_0_q8_K` (ggml-cpu/arch/x86/quants.c, its AVX2 branch,
//!   which llama.cpp's AVX-512 build runs too). Per super-block eight i32 lanes
//!   `lane_k = Σ_{e: (e%32)/4 = k} c_e·y_e − (bsums[2k] + bsums[2k+1])`, then
//!   `acc_k = fma(lane_k, y.d · fp16(x.d), acc_k)`; the result is `hsum_float_8(acc)`.
//! - TF2 / TF1: per 128-block eight exact lanes `lane_k = Σ_{e: (e%32)/4 = k} q_e·a_e`, then
//!   `acc_k = fma(lane_k, fp16(x.d), acc_k)` in block order; the result is
//!   `hsum_float_8(acc) · a.d` (the row's activation scale, applied once).

// Transcriptions of ggml keep its index arithmetic.
#![allow(clippy::needless_range_loop)]

use crate::quant::{GgmlType, QK_K, QK_TF};
use crate::scalar::{f16_at, f32_at, hsum8, nearest_int};
use half::f16;

/// ggml's `MAX(amax, fabsf(v))` (a NaN input makes the result NaN, as in C).
#[inline(always)]
fn amax_step(amax: f32, v: f32) -> f32 {
    let a = v.abs();
    if amax > a {
        amax
    } else {
        a
    }
}

/// ggml-quants.c: `((uint16_t)q * 256 + (243 - 1)) / 243`, the ceiling that lets
/// `((q·3^n mod 256)·3) >> 8` read trit `n` back.
#[inline(always)]
fn pack_trits(n: u32) -> u8 {
    (n * 256).div_ceil(243) as u8
}

/// Trit `n` (0 = most significant) of a base-3 byte made by [`pack_trits`].
#[inline(always)]
pub(crate) const fn trit(q: u8, n: usize) -> u8 {
    const POW3: [u8; 5] = [1, 3, 9, 27, 81];
    ((q.wrapping_mul(POW3[n]) as u16 * 3) >> 8) as u8
}

/// ggml-quants.c `quantize_row_tq1_0_ref` / `quantize_row_tq2_0_ref`: `d = amax`, code
/// `lroundf(x / d) + 1` (half away from zero).
pub(crate) fn quantize_tq(ty: GgmlType, x: &[f32], y: &mut [u8]) {
    for (xb, yb) in x.chunks_exact(QK_K).zip(y.chunks_exact_mut(ty.type_size())) {
        let d = xb.iter().fold(0f32, |m, &v| amax_step(m, v));
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let code = |v: f32| ((v * id).round() as i32 + 1) as u32;
        let dbits = f16::from_f32(d).to_bits().to_le_bytes();
        if ty == GgmlType::TQ2_0 {
            for j in (0..64).step_by(32) {
                for m in 0..32 {
                    let mut q = 0u32;
                    for n in 0..4 {
                        q += (code(xb[4 * j + m + 32 * n]) & 3) << (2 * n);
                    }
                    yb[j + m] = q as u8;
                }
            }
            yb[64..66].copy_from_slice(&dbits);
        } else {
            for m in 0..32 {
                let n = (0..5).fold(0, |q, n| q * 3 + code(xb[m + 32 * n]));
                yb[m] = pack_trits(n);
            }
            for m in 0..16 {
                let n = (0..5).fold(0, |q, n| q * 3 + code(xb[160 + m + 16 * n]));
                yb[32 + m] = pack_trits(n);
            }
            for j in 0..4 {
                let n = (0..4).fold(0, |q, n| q * 3 + code(xb[240 + j + 4 * n]));
                yb[48 + j] = pack_trits(n * 3);
            }
            yb[52..54].copy_from_slice(&dbits);
        }
    }
}

/// The 256 codes of a TQ1_0 / TQ2_0 super-block in value order (`dequantize_row_tq*_0`).
pub(crate) fn tq_codes(ty: GgmlType, x: &[u8]) -> [u8; QK_K] {
    let mut c = [0u8; QK_K];
    if ty == GgmlType::TQ2_0 {
        for j in (0..64).step_by(32) {
            for n in 0..4 {
                for m in 0..32 {
                    c[4 * j + 32 * n + m] = (x[j + m] >> (2 * n)) & 3;
                }
            }
        }
    } else {
        for n in 0..5 {
            for m in 0..32 {
                c[32 * n + m] = trit(x[m], n);
            }
            for m in 0..16 {
                c[160 + 16 * n + m] = trit(x[32 + m], n);
            }
        }
        for n in 0..4 {
            for j in 0..4 {
                c[240 + 4 * n + j] = trit(x[48 + j], n);
            }
        }
    }
    c
}

/// TQ1_0 / TQ2_0 against q8_K in the order of `ggml_vec_dot_tq{1,2}_0_q8_K` (module docs).
pub(crate) fn vec_dot_tq(ty: GgmlType, n: usize, w: &[u8], a: &[u8]) -> f32 {
    let dpos = if ty == GgmlType::TQ2_0 { 64 } else { 52 };
    let q8k = GgmlType::Q8_K.type_size();
    let mut acc = [0f32; 8];
    for (x, y) in w
        .chunks_exact(ty.type_size())
        .zip(a.chunks_exact(q8k))
        .take(n / QK_K)
    {
        let c = tq_codes(ty, x);
        let bsum = |j: usize| i16::from_le_bytes([y[4 + QK_K + 2 * j], y[5 + QK_K + 2 * j]]);
        let d = f32_at(y, 0) * f16_at(x, dpos);
        for k in 0..8 {
            let mut lane = 0i32;
            for v in 0..8 {
                for e in 32 * v + 4 * k..32 * v + 4 * k + 4 {
                    lane += c[e] as i32 * (y[4 + e] as i8) as i32;
                }
            }
            lane -= bsum(2 * k) as i32 + bsum(2 * k + 1) as i32;
            acc[k] = (lane as f32).mul_add(d, acc[k]);
        }
    }
    hsum8(&acc)
}

/// Where weight `e` of a TF1 block lives: (byte, trit).
#[inline(always)]
pub(crate) const fn tf1_slot(e: usize) -> (usize, usize) {
    let (n, m) = (e / 32, e % 32);
    if m < 26 {
        (m, n)
    } else {
        (6 * n + m - 26, 4)
    }
}

/// TF2 / TF1 from f32: per 128-block the absmean `s = Σ|w| / 128` (summed in order), codes
/// `clamp(round(w / s), -1, 1) + 1` (half away from zero), `d = f16(s)`; an all-zero block
/// gets `d = 0` and zero weights.
pub(crate) fn quantize_tf(ty: GgmlType, x: &[f32], y: &mut [u8]) {
    for (xb, yb) in x
        .chunks_exact(QK_TF)
        .zip(y.chunks_exact_mut(ty.type_size()))
    {
        let s = xb.iter().map(|v| v.abs()).sum::<f32>() / QK_TF as f32;
        let id = if s > 0.0 { 1.0 / s } else { 0.0 };
        let mut c = [1u8; QK_TF];
        for (c, &v) in c.iter_mut().zip(xb) {
            *c = ((v * id).round().clamp(-1.0, 1.0) as i32 + 1) as u8;
        }
        let d = if s > 0.0 { s } else { 0.0 };
        yb[0..2].copy_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
        if ty == GgmlType::TF2 {
            for m in 0..32 {
                yb[2 + m] = c[m] | c[32 + m] << 2 | c[64 + m] << 4 | c[96 + m] << 6;
            }
        } else {
            let mut digits = [[0u8; 5]; 26];
            for (e, &ce) in c.iter().enumerate() {
                let (b, t) = tf1_slot(e);
                digits[b][t] = ce;
            }
            for (o, dg) in yb[2..28].iter_mut().zip(&digits) {
                *o = pack_trits(dg.iter().fold(0, |q, &t| q * 3 + t as u32));
            }
        }
    }
}

/// The 128 codes of a TF2 / TF1 block in value order.
pub(crate) fn tf_codes(ty: GgmlType, x: &[u8]) -> [u8; QK_TF] {
    let mut c = [0u8; QK_TF];
    for (e, c) in c.iter_mut().enumerate() {
        *c = if ty == GgmlType::TF2 {
            (x[2 + e % 32] >> (2 * (e / 32))) & 3
        } else {
            let (b, t) = tf1_slot(e);
            trit(x[2 + b], t)
        };
    }
    c
}

/// Q8_TF from one token row: `d = amax / 127`, `q = round(x · 127 / amax)` (ties to even,
/// like `nearest_int`), the same `d` in every block, and the per-lane sums.
pub(crate) fn quantize_q8_tf(x: &[f32], y: &mut [u8]) {
    let amax = x.iter().fold(0f32, |m, &v| amax_step(m, v));
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let d = amax / 127.0;
    let bs = GgmlType::Q8_TF.type_size();
    for (xb, yb) in x.chunks_exact(QK_TF).zip(y.chunks_exact_mut(bs)) {
        yb[0..4].copy_from_slice(&d.to_le_bytes());
        let mut lsums = [0i32; 8];
        for (e, &v) in xb.iter().enumerate() {
            let q = nearest_int(v * id).clamp(-127, 127);
            yb[4 + e] = q as i8 as u8;
            lsums[(e % 32) / 4] += q;
        }
        for (k, s) in lsums.iter().enumerate() {
            let o = 4 + QK_TF + 4 * k;
            yb[o..o + 4].copy_from_slice(&s.to_le_bytes());
        }
    }
}

/// Dequantize one block of TF2 / TF1 / Q8_TF.
pub(crate) fn dequantize_tf_block(ty: GgmlType, x: &[u8], y: &mut [f32]) {
    if ty == GgmlType::Q8_TF {
        let d = f32_at(x, 0);
        for (o, &q) in y.iter_mut().zip(&x[4..4 + QK_TF]) {
            *o = (q as i8) as f32 * d;
        }
    } else {
        let d = f16_at(x, 0);
        for (o, &c) in y.iter_mut().zip(tf_codes(ty, x).iter()) {
            *o = (c as i32 - 1) as f32 * d;
        }
    }
}

/// TF2 / TF1 against Q8_TF in ternfleet's order (module docs).
pub(crate) fn vec_dot_tf(ty: GgmlType, n: usize, w: &[u8], a: &[u8]) -> f32 {
    let bs = GgmlType::Q8_TF.type_size();
    let mut acc = [0f32; 8];
    for (x, y) in w
        .chunks_exact(ty.type_size())
        .zip(a.chunks_exact(bs))
        .take(n / QK_TF)
    {
        let c = tf_codes(ty, x);
        let d = f16_at(x, 0);
        for k in 0..8 {
            let mut lane = 0i32;
            for v in 0..4 {
                for e in 32 * v + 4 * k..32 * v + 4 * k + 4 {
                    lane += (c[e] as i32 - 1) * (y[4 + e] as i8) as i32;
                }
            }
            acc[k] = (lane as f32).mul_add(d, acc[k]);
        }
    }
    if n < QK_TF {
        return 0.0;
    }
    hsum8(&acc) * f32_at(a, 0)
}
