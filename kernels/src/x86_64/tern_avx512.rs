//! AVX-512 VNNI matmuls of ternary weights, bit-identical to `crate::ternary` (the float
//! order is the same as the AVX2 kernels', see `tern_avx2`).
//!
//! Two weight rows share a 512-bit register (row `r` in the low half, row `r + 1` in the high
//! half), so the eight lanes of each row are still one 256-bit half and the per-block f32 FMA
//! serves both rows. Codes are unsigned, activations signed: `vpdpbusd` sums four products
//! per i32 lane exactly, and the activation correction (Q8_K `bsums` pairs or Q8_TF `lsums`)
//! turns the codes `c = q + 1` back into `q`.

// Tile loops index per-token and per-chunk register arrays with the same counter.
#![allow(clippy::needless_range_loop)]

use super::tern_avx2::{correction, decode, f16_at, geometry, is_tq};
use super::{TF2, TQ2_0};
use crate::matmul::Gemm;
use core::arch::x86_64::*;

/// The codes of block `b` of rows `a` (low halves) and `bb` (high halves), 32 values per half.
///
/// # Safety
/// This module's features; `a` and `bb` readable for one block of `KIND`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn decode_pair<const KIND: u8>(a: *const u8, bb: *const u8, c: &mut [__m512i; 8]) {
    // SAFETY (whole body): reads inside the two blocks.
    unsafe {
        if KIND == TQ2_0 || KIND == TF2 {
            let three = _mm512_set1_epi8(3);
            let groups = if KIND == TQ2_0 { 2 } else { 1 };
            let off = if KIND == TQ2_0 { 0 } else { 2 };
            for j in 0..groups {
                let lo = _mm256_loadu_si256(a.add(off + 32 * j).cast());
                let hi = _mm256_loadu_si256(bb.add(off + 32 * j).cast());
                let q = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
                c[4 * j] = _mm512_and_si512(q, three);
                c[4 * j + 1] = _mm512_and_si512(_mm512_srli_epi16::<2>(q), three);
                c[4 * j + 2] = _mm512_and_si512(_mm512_srli_epi16::<4>(q), three);
                c[4 * j + 3] = _mm512_and_si512(_mm512_srli_epi16::<6>(q), three);
            }
        } else {
            let mut ca = [_mm256_setzero_si256(); 8];
            let mut cb = [_mm256_setzero_si256(); 8];
            decode::<KIND>(a, &mut ca);
            decode::<KIND>(bb, &mut cb);
            for v in 0..8 {
                c[v] = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(ca[v]), cb[v]);
            }
        }
    }
}

/// Every tile width sums a (row, token) in the same order (the module's), so the result does
/// not depend on the batch and `Numerics` changes nothing. Tokens run in blocks whose
/// activations stay in L2 while the rows stream past; per row pair, tiles of four or eight
/// tokens and one narrower tile for the rest, so the pair's blocks are decoded once per tile
/// and read from memory once per block (once per call for a decode batch).
///
/// # Safety
/// The CPU has this module's features; `g` comes from `Gemm::new` with `out.len() ==
/// g.ntok * g.nrows` and `g.wty` of kind `KIND`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn run_tern<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) {
    // Tokens per tile: eight where decoding the weights costs more than the products
    // (TQ1_0 and TF1's base-3 digits), else four (more would spill registers).
    let wide = if KIND == TQ2_0 || KIND == TF2 { 4 } else { 8 };
    let tb = ((256 * 1024) / g.a_stride.max(1)).max(8) / 8 * 8;
    let mut t0 = 0;
    while t0 < g.ntok {
        let t1 = (t0 + tb).min(g.ntok);
        let mut r = 0;
        while r < g.nrows {
            let pair = g.nrows - r >= 2;
            let mut t = t0;
            while t1 - t >= wide {
                // SAFETY: r (+1 when `pair`) < nrows, t + wide <= ntok; the caller has the
                // features.
                unsafe {
                    if wide == 8 {
                        tile::<KIND, 8>(g, r, pair, t, out)
                    } else {
                        tile::<KIND, 4>(g, r, pair, t, out)
                    }
                };
                t += wide;
            }
            // SAFETY: as above with the `t1 - t` (< 8) tokens left.
            unsafe {
                match t1 - t {
                    0 => {}
                    1 => tile::<KIND, 1>(g, r, pair, t, out),
                    2 => tile::<KIND, 2>(g, r, pair, t, out),
                    3 => tile::<KIND, 3>(g, r, pair, t, out),
                    4 => tile::<KIND, 4>(g, r, pair, t, out),
                    5 => tile::<KIND, 5>(g, r, pair, t, out),
                    6 => tile::<KIND, 6>(g, r, pair, t, out),
                    _ => tile::<KIND, 7>(g, r, pair, t, out),
                }
            }
            r += if pair { 2 } else { 1 };
        }
        t0 = t1;
    }
}

/// Rows `r` and `r + 1` (or row `r` twice when `!pair`, the high half then discarded) against
/// tokens `t0..t0+T`.
///
/// # Safety
/// As [`run_tern`], with `r + pair < g.nrows` and `t0 + T <= g.ntok`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn tile<const KIND: u8, const T: usize>(
    g: &Gemm<'_>,
    r: usize,
    pair: bool,
    t0: usize,
    out: &mut [f32],
) {
    let (bv, wb, ab, dpos) = geometry(KIND);
    let nb = g.cols / bv;
    let nch = bv / 32;
    let wa = g.w_row(r).as_ptr();
    let wbb = g.w_row(if pair { r + 1 } else { r }).as_ptr();
    let mut acc = [_mm512_setzero_ps(); T];
    let mut c = [_mm512_setzero_si512(); 8];
    // SAFETY (whole body): block `b < nb` of a row / activation row lies inside it, as
    // `Gemm::new` checked the sizes.
    unsafe {
        for b in 0..nb {
            let (xa, xb) = (wa.add(b * wb), wbb.add(b * wb));
            decode_pair::<KIND>(xa, xb, &mut c);
            let dw = _mm512_insertf32x8::<1>(
                _mm512_set1_ps(f16_at(xa.add(dpos))),
                _mm256_set1_ps(f16_at(xb.add(dpos))),
            );
            for t in 0..T {
                let y = g.act_row(t0 + t).as_ptr().add(b * ab);
                let mut s = _mm512_setzero_si512();
                for v in 0..nch {
                    let a = _mm256_loadu_si256(y.add(4 + 32 * v).cast());
                    s = _mm512_dpbusd_epi32(s, c[v], _mm512_broadcast_i64x4(a));
                }
                let lanes = _mm512_sub_epi32(s, _mm512_broadcast_i64x4(correction::<KIND>(y)));
                let d = if is_tq(KIND) {
                    _mm512_mul_ps(dw, _mm512_set1_ps(y.cast::<f32>().read_unaligned()))
                } else {
                    dw
                };
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes), d, acc[t]);
            }
        }
        for t in 0..T {
            let a = g.act_row(t0 + t);
            let scale = if !is_tq(KIND) && nb > 0 {
                a.as_ptr().cast::<f32>().read_unaligned()
            } else {
                1.0
            };
            let lo = super::avx2::hsum(_mm512_castps512_ps256(acc[t]));
            let hi = super::avx2::hsum(_mm512_extractf32x8_ps::<1>(acc[t]));
            let base = (t0 + t) * g.nrows + r;
            out[base] = if is_tq(KIND) { lo } else { lo * scale };
            if pair {
                out[base + 1] = if is_tq(KIND) { hi } else { hi * scale };
            }
        }
    }
}
