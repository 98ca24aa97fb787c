//! q2_K against q8_K (one tile, compiled for AVX2 and for AVX-512), bit-identical to
//! `scalar::vec_dot_q2k` in the order a token takes (`scalar::token_order`): llama.cpp's
//! repacked `q2_K_8x8` kernels, which sum per super-block the exact scaled integer sums and
//! the mins against the block sums and take one FMA for each — the GEMV per 256 values
//! (`KOrder::Sb256`), the GEMM per 128 (`KOrder::Sb128`) — and `acc - acc_min` at the end.
//! From 16 tokens, the k-quant GEMM with tokens in the register lanes (`kq_lanes` on AVX-512,
//! `kq_lanes2` on AVX2) takes q2_K like q6_K's 16-value sub-blocks, the mins through the block sums.

// Tile loops index several per-row / per-token arrays with the same counter.
#![allow(clippy::needless_range_loop)]

use super::avx2::hsum_i32;
use super::drive;
use crate::matmul::Gemm;
use crate::quant::{Q8_K_BYTES, QK_K};
use crate::scalar::{token_order, KOrder};
use core::arch::x86_64::*;

/// Bytes of a q2_K super-block.
const WB: usize = 84;

/// `vpshufb` controls: chunk `c`'s sub-block scales, `2c` for its first 16 values and
/// `2c + 1` for the next 16.
const SCALE_SEL: [[u8; 16]; 8] = {
    let mut t = [[0u8; 16]; 8];
    let mut c = 0;
    while c < 8 {
        let mut i = 0;
        while i < 16 {
            t[c][i] = (2 * c + i / 8) as u8;
            i += 1;
        }
        c += 1;
    }
    t
};

/// # Safety
/// The CPU has AVX2, FMA and F16C; `g` comes from `Gemm::new` with `out.len() == g.ntok *
/// g.nrows` and q2_K weights.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn run_q2k(g: &Gemm<'_>, out: &mut [f32]) {
    if g.ntok >= super::kq_lanes2::MIN_TOKENS {
        // SAFETY: as this function's contract; the rest is this entry point's own problem.
        unsafe { super::kq_lanes2::gemm_then_rest::<{ super::Q2_K }>(g, out, run_q2k) };
    } else if g.ntok == 1 {
        drive!(g, out, tile, 4, 1);
    } else {
        drive!(g, out, tile, 2, 4);
    }
}

/// The AVX-512 table's entry: [`run_q2k`]'s tiles compiled for AVX-512, and from 16 tokens the
/// tokens-in-lanes GEMM for the tokens in whole groups of four (the 1–3 left take the GEMV's
/// order, as in llama.cpp, through the tiles).
///
/// # Safety
/// As [`run_q2k`], and the CPU has AVX-512 F/BW/VL/DQ and VNNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn run_q2k_avx512(g: &Gemm<'_>, out: &mut [f32]) {
    if g.ntok >= 16 {
        // SAFETY: as this function's contract; the rest is this entry point's own problem.
        unsafe { super::kq_lanes::gemm_then_rest::<{ super::Q2_K }>(g, out, run_q2k_avx512) };
    } else if g.ntok == 1 {
        // SAFETY: as this function's contract, with one token.
        unsafe { gemv512(g, out) };
    } else {
        drive!(g, out, tile512, 2, 4);
    }
}

/// The AVX-512 GEMV: four rows per pass, two 32-value chunks per register (chunk `s` of each
/// 128-value half: one shift of the 64 code bytes), `vpmaddubsw` then `vpdpwssd` by the
/// sub-blocks' scales; the four rows' exact sums reduced together into the lanes of one
/// 128-bit register, whose lanes carry the four rows' own `acc` / `acc_min` chains.
///
/// # Safety
/// As [`run_q2k_avx512`], with `g.ntok == 1`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn gemv512(g: &Gemm<'_>, out: &mut [f32]) {
    let nb = g.cols / QK_K;
    let st = g.w_stride;
    // Pair s's scales: i16 lanes 0..8 sub-block 2s, 8..16 2s + 1, 16..24 8 + 2s, 24..32 9 + 2s.
    let sel: [__m512i; 4] = core::array::from_fn(|s| {
        let mut idx = [0i16; 32];
        for (l, x) in idx.iter_mut().enumerate() {
            *x = (8 * (l / 16) + 2 * s + (l % 16) / 8) as i16;
        }
        // SAFETY: 64 bytes.
        unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) }
    });
    let three = _mm512_set1_epi8(3);
    let lo4 = _mm_set1_epi8(0xF);
    super::with_scratch(0, nb * 4, |act: &mut [__m512i]| {
        // SAFETY (whole body): super-blocks below `nb` of the activation row and of rows below
        // `g.nrows`.
        unsafe {
            // Pair s of super-block b: the token's chunk s in the low half, chunk 4 + s high.
            for b in 0..nb {
                let ap = g.a.as_ptr().add(b * Q8_K_BYTES + 4);
                for s in 0..4 {
                    act[4 * b + s] = _mm512_inserti64x4::<1>(
                        _mm512_castsi256_si512(_mm256_loadu_si256(ap.add(32 * s).cast())),
                        _mm256_loadu_si256(ap.add(128 + 32 * s).cast()),
                    );
                }
            }
            let mut r = 0;
            while r + 4 <= g.nrows {
                let w = g.w.as_ptr().add(r * st);
                let mut acc = _mm_setzero_ps();
                let mut acc_m = _mm_setzero_ps();
                for b in 0..nb {
                    let ap = g.a.as_ptr().add(b * Q8_K_BYTES);
                    let dy = _mm_set1_ps(ap.cast::<f32>().read_unaligned());
                    let bs = _mm256_loadu_si256(ap.add(4 + QK_K).cast());
                    let mut isv = [_mm512_setzero_si512(); 4];
                    let mut imv = [_mm256_setzero_si256(); 4];
                    for i in 0..4 {
                        let wp = w.add(i * st + b * WB);
                        _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add(8 * st).cast());
                        _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add(8 * st + 64).cast());
                        let q = _mm512_loadu_si512(wp.add(16).cast());
                        let sb = _mm_loadu_si128(wp.cast());
                        let sc16 =
                            _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_and_si128(sb, lo4)));
                        let mins =
                            _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(sb), lo4));
                        let mut lanes = _mm512_setzero_si512();
                        for s in 0..4 {
                            let u = _mm512_and_si512(
                                _mm512_srl_epi16(q, _mm_cvtsi32_si128(2 * s as i32)),
                                three,
                            );
                            let p = _mm512_maddubs_epi16(u, *act.get_unchecked(4 * b + s));
                            lanes = _mm512_dpwssd_epi32(
                                lanes,
                                p,
                                _mm512_permutexvar_epi16(sel[s], sc16),
                            );
                        }
                        isv[i] = lanes;
                        imv[i] = _mm256_madd_epi16(mins, bs);
                    }
                    let isum = super::avx512q::reduce4(isv);
                    let h = _mm256_hadd_epi32(
                        _mm256_hadd_epi32(imv[0], imv[1]),
                        _mm256_hadd_epi32(imv[2], imv[3]),
                    );
                    let imin =
                        _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
                    let f16x4 = |off: usize| {
                        let h =
                            |i: usize| w.add(i * st + b * WB + off).cast::<i16>().read_unaligned();
                        _mm_cvtph_ps(_mm_setr_epi16(h(0), h(1), h(2), h(3), 0, 0, 0, 0))
                    };
                    acc = _mm_fmadd_ps(_mm_cvtepi32_ps(isum), _mm_mul_ps(f16x4(80), dy), acc);
                    acc_m = _mm_fmadd_ps(_mm_cvtepi32_ps(imin), _mm_mul_ps(f16x4(82), dy), acc_m);
                }
                _mm_storeu_ps(out.as_mut_ptr().add(r), _mm_sub_ps(acc, acc_m));
                r += 4;
            }
            while r < g.nrows {
                tile512::<1, 1>(g, r, 0, out);
                r += 1;
            }
        }
    })
}

/// The super-block at `p`: its 256 codes (0..3) as eight 32-value chunks in value order.
///
/// # Safety
/// AVX2 available; `p` readable for one super-block.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn codes(p: *const u8) -> [__m256i; 8] {
    // SAFETY: the 64 code bytes at 16.
    let q = unsafe {
        [
            _mm256_loadu_si256(p.add(16).cast()),
            _mm256_loadu_si256(p.add(48).cast()),
        ]
    };
    let three = _mm256_set1_epi8(3);
    core::array::from_fn(|c| {
        let sh = _mm_cvtsi32_si128(2 * (c as i32 % 4));
        _mm256_and_si256(_mm256_srl_epi16(q[c / 4], sh), three)
    })
}

/// Rows `r0..r0+R` × tokens `t0..t0+T`: `tile` with AVX2's features, `tile512` the same code
/// compiled for AVX-512 (32 registers, EVEX encodings), which the AVX-512 table runs.
macro_rules! tile_fn {
    ($name:ident, $features:literal) => {
        /// # Safety
        /// As [`run_q2k`] (and the features named); `r0 + R <= g.nrows`, `t0 + T <= g.ntok`.
        #[target_feature(enable = $features)]
        unsafe fn $name<const R: usize, const T: usize>(
            g: &Gemm<'_>,
            r0: usize,
            t0: usize,
            out: &mut [f32],
        ) {
            let nb = g.cols / QK_K;
            let order: [KOrder; T] = core::array::from_fn(|t| token_order(g, t0 + t));
            let mut acc = [[0f32; T]; R];
            let mut acc_m = [[0f32; T]; R];
            // SAFETY (whole body): super-blocks below `nb` of rows r0..r0+R and tokens t0..t0+T.
            unsafe {
                for b in 0..nb {
                    let mut ad = [0f32; T];
                    let mut bs = [_mm256_setzero_si256(); T];
                    for t in 0..T {
                        let ap = g.a.as_ptr().add((t0 + t) * g.a_stride + b * Q8_K_BYTES);
                        ad[t] = ap.cast::<f32>().read_unaligned();
                        bs[t] = _mm256_loadu_si256(ap.add(4 + QK_K).cast());
                    }
                    for r in 0..R {
                        let wp = g.w.as_ptr().add((r0 + r) * g.w_stride + b * WB);
                        let u = codes(wp);
                        let sb = _mm_loadu_si128(wp.cast());
                        let sc = _mm_and_si128(sb, _mm_set1_epi8(0xF));
                        let mins = _mm256_cvtepu8_epi16(_mm_and_si128(
                            _mm_srli_epi16::<4>(sb),
                            _mm_set1_epi8(0xF),
                        ));
                        let s: [__m256i; 8] = core::array::from_fn(|c| {
                            _mm256_cvtepu8_epi16(_mm_shuffle_epi8(
                                sc,
                                _mm_loadu_si128(SCALE_SEL[c].as_ptr().cast()),
                            ))
                        });
                        let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
                            wp.add(80).cast::<u16>().read_unaligned() as i32,
                        )));
                        let dmin = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
                            wp.add(82).cast::<u16>().read_unaligned() as i32,
                        )));
                        for t in 0..T {
                            let q8 = g.a.as_ptr().add((t0 + t) * g.a_stride + b * Q8_K_BYTES + 4);
                            // Lanes of each 128-value half: (code · a) pairs times the
                            // sub-block's scale.
                            let mut half = [_mm256_setzero_si256(); 2];
                            for c in 0..8 {
                                let a = _mm256_loadu_si256(q8.add(32 * c).cast());
                                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(u[c], a), s[c]);
                                half[c / 4] = _mm256_add_epi32(half[c / 4], p);
                            }
                            // Lane k: mins 2k, 2k + 1 against their block sums (lanes 0..4
                            // the first half's sub-blocks, 4..8 the second's).
                            let m = _mm256_madd_epi16(mins, bs[t]);
                            let (dw, dm) = (d * ad[t], dmin * ad[t]);
                            if order[t] == KOrder::Sb128 {
                                for h in 0..2 {
                                    let mh = if h == 0 {
                                        _mm256_castsi256_si128(m)
                                    } else {
                                        _mm256_extracti128_si256::<1>(m)
                                    };
                                    let mh = _mm_add_epi32(mh, _mm_unpackhi_epi64(mh, mh));
                                    let imin = _mm_cvtsi128_si32(_mm_add_epi32(
                                        mh,
                                        _mm_shuffle_epi32::<0b01>(mh),
                                    ));
                                    acc[r][t] = (hsum_i32(half[h]) as f32).mul_add(dw, acc[r][t]);
                                    acc_m[r][t] = (imin as f32).mul_add(dm, acc_m[r][t]);
                                }
                            } else {
                                let isum = hsum_i32(_mm256_add_epi32(half[0], half[1]));
                                acc[r][t] = (isum as f32).mul_add(dw, acc[r][t]);
                                acc_m[r][t] = (hsum_i32(m) as f32).mul_add(dm, acc_m[r][t]);
                            }
                        }
                    }
                }
                for r in 0..R {
                    for t in 0..T {
                        *out.get_unchecked_mut((t0 + t) * g.nrows + r0 + r) =
                            acc[r][t] - acc_m[r][t];
                    }
                }
            }
        }
    };
}

tile_fn!(tile, "avx2,fma,f16c");
tile_fn!(
    tile512,
    "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c"
);
