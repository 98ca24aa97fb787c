//! IQ2_XXS and IQ3_XXS against q8_K (one tile, compiled for AVX2 and for AVX-512),
//! bit-identical to `scalar::vec_dot_lanes8` in either order a token takes: llama.cpp's
//! `ggml_vec_dot_iq{2,3}_xxs_q8_K` lanes (each sub-block's 32 grid values from `iq2xxs_grid`
//! — four rows of 8 — or `iq3xxs_grid` — eight rows of 4 —, the signs applied to the
//! activations by `vpsignb`, `vpmaddubsw`, then `vpmaddwd` by the sub-block's `2·ls + 1`) in
//! `KOrder::Lanes8` with `post · hsum8` at the end (0.125, 0.25), their exact sum in
//! `KOrder::Tiled` with `d · post`. On AVX-512, from 16 tokens, the tokens-in-lanes k-quant
//! GEMM (`kq_lanes`, values looked up as `value + 128`).

// Tile loops index several per-row / per-token arrays with the same counter.
#![allow(clippy::needless_range_loop)]

use super::drive;
use super::lanes8::{f16_at, Chains};
use super::IQ2_XXS;
use crate::iq_grids::{IQ2XXS_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS};
use crate::matmul::Gemm;
use crate::quant::QK_K;
use core::arch::x86_64::*;

/// Bytes of a q8_K super-block.
const AB: usize = 292;

/// (bytes per super-block, the factor ggml applies after the lanes / folds into `d`).
pub(super) const fn geometry(kind: u8) -> (usize, f32) {
    if kind == IQ2_XXS {
        (66, 0.125)
    } else {
        (98, 0.25)
    }
}

/// ggml's `keven_signs_q2xs`: byte `j` of entry `i` is -1 where bit `j` of
/// `ksigns_iq2xs[i]` is set, else 1 (what `vpsignb` applies to the activations).
static SIGNS64: [u64; 128] = {
    let mut t = [0u64; 128];
    let mut i = 0;
    while i < 128 {
        let mut j = 0;
        while j < 8 {
            let b: u64 = if KSIGNS_IQ2XS[i] & (1 << j) != 0 {
                0xFF
            } else {
                0x01
            };
            t[i] |= b << (8 * j);
            j += 1;
        }
        i += 1;
    }
    t
};

/// Sub-block `ib` of the `KIND` super-block at `p`: its 32 grid values (unsigned, value
/// order), the 32 signs as ±1 bytes, and its scale `2·ls + 1`.
///
/// # Safety
/// AVX2 available; `p` readable for one super-block; `ib < 8`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn sub_block<const KIND: u8>(p: *const u8, ib: usize) -> (__m256i, __m256i, i16) {
    // SAFETY (whole body): the sub-block's grid indices and its sign/scale word.
    unsafe {
        let (grid, w1) = if KIND == IQ2_XXS {
            let w0 = p.add(2 + 8 * ib).cast::<u32>().read_unaligned();
            let g = |l: u32| IQ2XXS_GRID[((w0 >> (8 * l)) & 0xFF) as usize] as i64;
            (
                _mm256_setr_epi64x(g(0), g(1), g(2), g(3)),
                p.add(6 + 8 * ib).cast::<u32>().read_unaligned(),
            )
        } else {
            let q = p.add(2 + 8 * ib);
            let g = |i: usize| IQ3XXS_GRID[*q.add(i) as usize] as i32;
            (
                _mm256_setr_epi32(g(0), g(1), g(2), g(3), g(4), g(5), g(6), g(7)),
                p.add(66 + 4 * ib).cast::<u32>().read_unaligned(),
            )
        };
        let s = |l: u32| SIGNS64[((w1 >> (7 * l)) & 127) as usize] as i64;
        (
            grid,
            _mm256_setr_epi64x(s(0), s(1), s(2), s(3)),
            (2 * (w1 >> 28) + 1) as i16,
        )
    }
}

/// The super-block at `p` as the tokens-in-lanes GEMM wants it: its 256 signed values as
/// unsigned `value + 128`, eight 32-value chunks in value order.
///
/// # Safety
/// AVX2 available; `p` readable for one super-block.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn codes_u8<const KIND: u8>(p: *const u8) -> [__m256i; 8] {
    core::array::from_fn(|ib| {
        // SAFETY: as the contract.
        let (g, s, _) = unsafe { sub_block::<KIND>(p, ib) };
        _mm256_xor_si256(_mm256_sign_epi8(g, s), _mm256_set1_epi8(-128))
    })
}

/// # Safety
/// The CPU has AVX2, FMA and F16C; `g` comes from `Gemm::new` with `out.len() == g.ntok *
/// g.nrows` and weights of kind `KIND` (IQ2_XXS or IQ3_XXS).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn run_grid<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) {
    if g.ntok == 1 {
        drive!(g, out, tile, 4, 1, KIND);
    } else {
        drive!(g, out, tile, 2, 4, KIND);
    }
}

/// The AVX-512 table's entry: [`run_grid`]'s tiles compiled for AVX-512, and from 16 tokens
/// in the tiled order the tokens-in-lanes GEMM.
///
/// # Safety
/// As [`run_grid`], and the CPU has AVX-512 F/BW/VL/DQ and VNNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn run_grid_avx512<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) {
    // SAFETY: as this function's contract.
    if unsafe { super::kq_lanes::tiled_batch::<KIND>(g, out) } {
        return;
    }
    if g.ntok == 1 {
        drive!(g, out, tile512, 4, 1, KIND);
    } else {
        drive!(g, out, tile512, 2, 4, KIND);
    }
}

/// Rows `r0..r0+R` × tokens `t0..t0+T`: `tile` with AVX2's features, `tile512` the same code
/// compiled for AVX-512 (32 registers, EVEX encodings), which the AVX-512 table runs.
macro_rules! tile_fn {
    ($name:ident, $features:literal) => {
        /// # Safety
        /// As [`run_grid`] (and the features named); `r0 + R <= g.nrows`, `t0 + T <= g.ntok`.
        #[target_feature(enable = $features)]
        unsafe fn $name<const R: usize, const T: usize, const KIND: u8>(
            g: &Gemm<'_>,
            r0: usize,
            t0: usize,
            out: &mut [f32],
        ) {
            let nb = g.cols / QK_K;
            let (wb, post) = geometry(KIND);
            let mut ch = Chains::<R, T>::new(g, t0, post);
            // SAFETY (whole body): super-blocks below `nb` of rows r0..r0+R and tokens
            // t0..t0+T.
            unsafe {
                for b in 0..nb {
                    let ad = Chains::<R, T>::dy(g, t0, b);
                    for r in 0..R {
                        let wp = g.w.as_ptr().add((r0 + r) * g.w_stride + b * wb);
                        let dw = f16_at(wp);
                        // Sub-block by sub-block, each unpacked once for the tile's tokens.
                        let mut lanes = [_mm256_setzero_si256(); T];
                        for ib in 0..8 {
                            let (gv, sv, ls) = sub_block::<KIND>(wp, ib);
                            let ls = _mm256_set1_epi16(ls);
                            for t in 0..T {
                                let q8 = g.a.as_ptr().add((t0 + t) * g.a_stride + b * AB + 4);
                                let a = _mm256_loadu_si256(q8.add(32 * ib).cast());
                                let p = _mm256_maddubs_epi16(gv, _mm256_sign_epi8(a, sv));
                                lanes[t] = _mm256_add_epi32(lanes[t], _mm256_madd_epi16(p, ls));
                            }
                        }
                        for t in 0..T {
                            ch.step(r, t, lanes[t], dw, ad[t]);
                        }
                    }
                }
                ch.finish(g, r0, t0, out);
            }
        }
    };
}

tile_fn!(tile, "avx2,fma,f16c");
tile_fn!(
    tile512,
    "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c"
);
