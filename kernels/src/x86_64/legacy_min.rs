//! AVX-512 VNNI matmuls of the legacy kinds with a min, q4_1 and q5_1, against q8_1
//! activations: bit-identical to `scalar::vec_dot_legacy1`, which is llama.cpp's x86
//! `ggml_vec_dot_{q4_1,q5_1}_q8_1` — the order ggml uses for any number of tokens (it has no
//! GEMM for these types on x86), so `Numerics` changes nothing.
//!
//! Per (row, token): eight i32 lanes of four products of the unsigned codes (one 256-bit
//! `vpdpbusd` per block: exact), `acc = fma(dw·da, lanes, acc)`, a scalar `summs = fma(m, s,
//! summs)`, and `hsum8(acc) + summs` at the end. The GEMV keeps two rows per 512-bit register
//! (four rows per pass, their mins' chains in the lanes of one 128-bit register); with more
//! tokens a tile of R rows × T tokens unpacks each weight block once for its T tokens and loads
//! each activation block once for its R rows.

// Tile loops index several per-row / per-token arrays with the same counter.
#![allow(clippy::needless_range_loop)]

use super::avx2::hsum as hsum8;
use super::avx512q::{f16_to_f32, unpack_pair_u8, unpack_u8};
use super::{drive, legacy_act, legacy_block_bytes};
use crate::matmul::Gemm;
use crate::quant::QK;
use core::arch::x86_64::*;

/// How many row tiles ahead the weight stream is prefetched.
const PF_TILES: usize = 2;

/// # Safety
/// The CPU has AVX-512 F/BW/VL/DQ, VNNI, AVX2, FMA, F16C; `g` comes from `Gemm::new` with
/// `out.len() == g.ntok * g.nrows` and `g.wty` of kind `KIND` (q4_1 or q5_1).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn run_legacy_min<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) {
    if g.ntok == 1 {
        // SAFETY: as this function's contract, with one token.
        unsafe { gemv::<KIND>(g, out) };
    } else {
        drive!(g, out, tile, 4, 4, KIND);
    }
}

/// The f16 field at byte `off` of four blocks `st` bytes apart, as four f32 lanes.
///
/// # Safety
/// Features as [`run_legacy_min`]; the four fields readable.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn f16x4(p: *const u8, st: usize, off: usize) -> __m128 {
    // SAFETY: as the contract.
    unsafe {
        let h = |i: usize| p.add(i * st + off).cast::<i16>().read_unaligned();
        _mm_cvtph_ps(_mm_setr_epi16(h(0), h(1), h(2), h(3), 0, 0, 0, 0))
    }
}

/// How many 4-row groups ahead the GEMV prefetches.
const PF_GROUPS: usize = 2;

/// One token: four rows per pass, rows `r`, `r + 1` in the halves of one accumulator and
/// `r + 2`, `r + 3` in another, each half its row's own chain of per-block FMAs; the four rows'
/// `fma(m, s, summs)` chains are the four lanes of one 128-bit FMA. The rows left over go
/// through the 1 × 1 tile.
///
/// # Safety
/// As [`run_legacy_min`], with `g.ntok == 1`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn gemv<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) {
    let nb = g.cols / QK;
    let bs = legacy_block_bytes(KIND);
    let (abs, aoff) = legacy_act(KIND);
    let st = g.w_stride;
    let sel_a = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    let sel_b = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    let mut r = 0;
    // SAFETY (whole body): blocks below `nb` of the activation row and of rows below
    // `g.nrows`; side-table indices below `nb`.
    unsafe {
        while r + 4 <= g.nrows {
            let w = g.w.as_ptr().add(r * st);
            let mut acc_a = _mm512_setzero_ps();
            let mut acc_b = _mm512_setzero_ps();
            let mut summs = _mm_setzero_ps();
            for b in 0..nb {
                let p = w.add(b * bs);
                let q = p.wrapping_add(PF_GROUPS * 4 * st);
                for i in 0..4 {
                    _mm_prefetch::<_MM_HINT_T0>(q.wrapping_add(i * st).cast());
                }
                let a = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                    g.a.as_ptr().add(b * abs + aoff).cast(),
                ));
                let ia = _mm512_dpbusd_epi32(
                    _mm512_setzero_si512(),
                    unpack_pair_u8::<KIND>(p, p.add(st)),
                    a,
                );
                let ib = _mm512_dpbusd_epi32(
                    _mm512_setzero_si512(),
                    unpack_pair_u8::<KIND>(p.add(2 * st), p.add(3 * st)),
                    a,
                );
                // The four rows' scales times the activation's (one rounding each, as
                // `dw * da`), spread over the halves.
                let dd = _mm_mul_ps(f16x4(p, st, 0), _mm_set1_ps(*g.a_scales.get_unchecked(b)));
                let dz = _mm512_castps128_ps512(dd);
                acc_a = _mm512_fmadd_ps(
                    _mm512_permutexvar_ps(sel_a, dz),
                    _mm512_cvtepi32_ps(ia),
                    acc_a,
                );
                acc_b = _mm512_fmadd_ps(
                    _mm512_permutexvar_ps(sel_b, dz),
                    _mm512_cvtepi32_ps(ib),
                    acc_b,
                );
                summs = _mm_fmadd_ps(
                    f16x4(p, st, 2),
                    _mm_set1_ps(*g.a_sums.get_unchecked(b)),
                    summs,
                );
            }
            let mut sm = [0f32; 4];
            _mm_storeu_ps(sm.as_mut_ptr(), summs);
            *out.get_unchecked_mut(r) = hsum8(_mm512_castps512_ps256(acc_a)) + sm[0];
            *out.get_unchecked_mut(r + 1) = hsum8(_mm512_extractf32x8_ps::<1>(acc_a)) + sm[1];
            *out.get_unchecked_mut(r + 2) = hsum8(_mm512_castps512_ps256(acc_b)) + sm[2];
            *out.get_unchecked_mut(r + 3) = hsum8(_mm512_extractf32x8_ps::<1>(acc_b)) + sm[3];
            r += 4;
        }
        while r < g.nrows {
            tile::<1, 1, KIND>(g, r, 0, out);
            r += 1;
        }
    }
}

/// Rows `r0..r0+R` × tokens `t0..t0+T`.
///
/// # Safety
/// As [`run_legacy_min`]; `r0 + R <= g.nrows`, `t0 + T <= g.ntok`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn tile<const R: usize, const T: usize, const KIND: u8>(
    g: &Gemm<'_>,
    r0: usize,
    t0: usize,
    out: &mut [f32],
) {
    let nb = g.cols / QK;
    let bs = legacy_block_bytes(KIND);
    let (abs, aoff) = legacy_act(KIND);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let mut summs = [[0f32; T]; R];
    // SAFETY (whole body): offsets within rows r0..r0+R / tokens t0..t0+T (nb blocks each)
    // and side-table indices below `g.ntok * nb`.
    unsafe {
        for b in 0..nb {
            let mut av = [_mm256_setzero_si256(); T];
            let mut da = [0f32; T];
            let mut sa = [0f32; T];
            for t in 0..T {
                let i = (t0 + t) * nb + b;
                av[t] = _mm256_loadu_si256(
                    g.a.as_ptr()
                        .add((t0 + t) * g.a_stride + b * abs + aoff)
                        .cast(),
                );
                da[t] = *g.a_scales.get_unchecked(i);
                sa[t] = *g.a_sums.get_unchecked(i);
            }
            for r in 0..R {
                let wp = g.w.as_ptr().add((r0 + r) * g.w_stride + b * bs);
                if b % 2 == 0 {
                    _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add(PF_TILES * R * g.w_stride).cast());
                }
                let u = unpack_u8::<KIND>(wp);
                let dw = f16_to_f32(wp);
                let m = f16_to_f32(wp.add(2));
                for t in 0..T {
                    summs[r][t] = m.mul_add(sa[t], summs[r][t]);
                    let lanes = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, av[t]);
                    acc[r][t] = _mm256_fmadd_ps(
                        _mm256_set1_ps(dw * da[t]),
                        _mm256_cvtepi32_ps(lanes),
                        acc[r][t],
                    );
                }
            }
        }
        for r in 0..R {
            for t in 0..T {
                *out.get_unchecked_mut((t0 + t) * g.nrows + r0 + r) =
                    hsum8(acc[r][t]) + summs[r][t];
            }
        }
    }
}
