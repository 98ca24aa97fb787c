//! AVX-512 VNNI matmuls of the legacy kinds with a min, q4_1 and q5_1, against q8_1
//! activations: bit-identical to `scalar::vec_dot_legacy1`, which is llama.cpp's x86
//! `ggml_vec_dot_{q4_1,q5_1}_q8_1` — the order ggml uses for any number of tokens (it has no
//! GEMM for these types on x86), so `Numerics` changes nothing.
//!
//! Per (row, token): eight i32 lanes of four products of the unsigned codes (one 256-bit
//! `vpdpbusd` per block: exact), `acc = fma(dw·da, lanes, acc)`, a scalar `summs = fma(m, s,
//! summs)`, and `hsum8(acc) + summs` at the end. The GEMV runs one row at a time (one 1 × 1 tile); with
//! more tokens a tile of R rows × T tokens unpacks each weight block once for its T tokens and
//! loads each activation block once for its R rows.

// Tile loops index several per-row / per-token arrays with the same counter.
#![allow(clippy::needless_range_loop)]

use super::avx2::hsum as hsum8;
use super::avx512q::{f16_to_f32, unpack_u8};
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
        // The GEMV one row at a time: one sequential stream from memory. On an AMD EPYC
        // (Zen 4), q4_1 65536×1024 from DRAM 4.7 ms with four rows two per 512-bit register,
        // 3.2 ms this way (16384×4096: equal).
        drive!(g, out, tile, 1, 1, KIND);
    } else {
        drive!(g, out, tile, 4, 4, KIND);
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
