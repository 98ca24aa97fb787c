//! AVX2 matmuls of ternary weights (TQ1_0, TQ2_0 against Q8_K; TF2, TF1 against Q8_TF),
//! bit-identical to `crate::ternary`: per block the weights are decoded to their codes
//! `c ∈ {0,1,2}` in 32-value chunks, `vpmaddubsw` (codes unsigned, activations signed) and
//! one `vpmaddwd` by ones give the eight exact i32 lanes, the activation correction is
//! subtracted, and one FMA per lane per block accumulates in f32, reduced by [`hsum`] at the
//! end. The chunk decoders are shared with the AVX-512 kernels (`tern_avx512`).

// Tile loops index per-token and per-chunk register arrays with the same counter.
#![allow(clippy::needless_range_loop)]

use super::avx2::hsum;
use super::{TF2, TQ1_0, TQ2_0};
use crate::matmul::Gemm;
use crate::quant::{Q8_K_BYTES, QK_K, QK_TF};
use core::arch::x86_64::*;

/// Geometry of a ternary kind: (values per block, weight bytes per block, activation bytes
/// per block, offset of the weight block's f16 scale).
pub(super) const fn geometry(kind: u8) -> (usize, usize, usize, usize) {
    match kind {
        TQ2_0 => (QK_K, 66, Q8_K_BYTES, 64),
        TQ1_0 => (QK_K, 54, Q8_K_BYTES, 52),
        TF2 => (QK_TF, 34, 164, 0),
        _ => (QK_TF, 28, 164, 0),
    }
}

/// Whether the kind pairs with Q8_K (ggml's TQ types) rather than Q8_TF.
pub(super) const fn is_tq(kind: u8) -> bool {
    kind == TQ1_0 || kind == TQ2_0
}

/// The f16 at `p` as f32.
///
/// # Safety
/// F16C available; `p` readable for 2 bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: 2 readable bytes at `p`.
    let bits = unsafe { p.cast::<u16>().read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// `x · 3` per byte, wrapping.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn mul3(x: __m256i) -> __m256i {
    _mm256_add_epi8(x, _mm256_add_epi8(x, x))
}

/// `x · 9` per byte, wrapping (ggml's shift-mask-add).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn mul9(x: __m256i) -> __m256i {
    _mm256_add_epi8(
        _mm256_and_si256(_mm256_slli_epi16::<3>(x), _mm256_set1_epi8(-8)),
        x,
    )
}

/// The top trit of each byte, `(x · 3) >> 8`, via ggml's `subs`/`avg` sequence (equal for all
/// 256 byte values; checked by the tests through the scalar reference).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn top_trit(x: __m256i) -> __m256i {
    let x = _mm256_subs_epu8(x, _mm256_set1_epi8(1));
    let x = _mm256_avg_epu8(x, _mm256_avg_epu8(x, _mm256_setzero_si256()));
    _mm256_and_si256(_mm256_srli_epi16::<6>(x), _mm256_set1_epi8(3))
}

/// Decode the weight block at `p` into its codes, 32 values per register in value order
/// (`c[v]` holds values `32v..32v+32`; 8 chunks for TQ kinds, 4 for TF kinds).
///
/// # Safety
/// AVX2 available; `p` readable for one block of `KIND`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn decode<const KIND: u8>(p: *const u8, c: &mut [__m256i; 8]) {
    let three = _mm256_set1_epi8(3);
    // SAFETY (whole body): every read lies inside the block at `p` (geometry above).
    unsafe {
        match KIND {
            TQ2_0 | TF2 => {
                let groups = if KIND == TQ2_0 { 2 } else { 1 };
                let base = if KIND == TQ2_0 { p } else { p.add(2) };
                for j in 0..groups {
                    let q = _mm256_loadu_si256(base.add(32 * j).cast());
                    c[4 * j] = _mm256_and_si256(q, three);
                    c[4 * j + 1] = _mm256_and_si256(_mm256_srli_epi16::<2>(q), three);
                    c[4 * j + 2] = _mm256_and_si256(_mm256_srli_epi16::<4>(q), three);
                    c[4 * j + 3] = _mm256_and_si256(_mm256_srli_epi16::<6>(q), three);
                }
            }
            TQ1_0 => {
                // ggml-common.h block_tq1_0: qs[0..32] hold values m + 32n (n = 0..4),
                // qs[32..48] values 160 + m + 16n, qh[0..4] values 240 + j + 4n.
                let q = _mm256_loadu_si256(p.cast());
                let (q3, q9) = (mul3(q), mul9(q));
                c[0] = top_trit(q);
                c[1] = top_trit(q3);
                c[2] = top_trit(q9);
                c[3] = top_trit(mul9(q3));
                c[4] = top_trit(mul9(q9));
                let r = _mm_loadu_si128(p.add(32).cast());
                let rr = _mm256_set_m128i(r, r);
                let (r3, r9) = (mul3(rr), mul9(rr));
                let (r27, r81) = (mul9(r3), mul9(r9));
                let qh = p.add(48).cast::<u32>().read_unaligned();
                // Byte i of the qh chunk is qh[i % 4] · 3^(i / 4).
                let h16 = _mm256_cvtepu8_epi16(_mm_set1_epi32(qh as i32));
                let h16 = _mm256_mullo_epi16(
                    h16,
                    _mm256_set_epi16(27, 27, 27, 27, 9, 9, 9, 9, 3, 3, 3, 3, 1, 1, 1, 1),
                );
                let h16 = _mm256_and_si256(h16, _mm256_set1_epi16(0xFF));
                let h = _mm_packus_epi16(
                    _mm256_castsi256_si128(h16),
                    _mm256_extracti128_si256::<1>(h16),
                );
                c[5] = top_trit(_mm256_blend_epi32::<0xF0>(rr, r3));
                c[6] = top_trit(_mm256_blend_epi32::<0xF0>(r9, r27));
                c[7] = top_trit(_mm256_set_m128i(h, _mm256_castsi256_si128(r81)));
            }
            _ => {
                // TF1 (quant.rs): value 32n + m (m < 26) is trit n of qs[m]; values
                // 32n + 26..32n + 32 are trit 4 of qs[6n..6n + 6]. Both loads stay inside the
                // 28-byte block: qs[0..16] and qs[10..26].
                let lo = _mm_loadu_si128(p.add(2).cast());
                let hi = _mm_loadu_si128(p.add(12).cast());
                // High lane: qs[16..26] at positions 0..10, zeros above (trit 0 of 0 is 0).
                let up = _mm_shuffle_epi8(
                    hi,
                    _mm_setr_epi8(6, 7, 8, 9, 10, 11, 12, 13, 14, 15, -1, -1, -1, -1, -1, -1),
                );
                let x = _mm256_set_m128i(up, lo);
                let (x3, x9) = (mul3(x), mul9(x));
                c[0] = top_trit(x);
                c[1] = top_trit(x3);
                c[2] = top_trit(x9);
                c[3] = top_trit(mul9(x3));
                // Trit 4 of qs[0..16] (low lane) and qs[10..26] (high lane).
                let t4 = top_trit(mul9(mul9(_mm256_set_m128i(hi, lo))));
                let t4lo = _mm256_permute2x128_si256::<0x00>(t4, t4);
                let t4hi = _mm256_permute2x128_si256::<0x11>(t4, t4);
                // Chunk n takes qs[6n..6n + 6] into positions 26..32 (high lane 10..16).
                let pick = |src: __m256i, first: i8| {
                    let f = first;
                    _mm256_shuffle_epi8(
                        src,
                        _mm256_setr_epi8(
                            -1,
                            -1,
                            -1,
                            -1,
                            -1,
                            -1,
                            -1,
                            -1,
                            -1,
                            -1,
                            -1,
                            -1,
                            -1,
                            -1,
                            -1,
                            -1,
                            -1,
                            -1,
                            -1,
                            -1,
                            -1,
                            -1,
                            -1,
                            -1,
                            -1,
                            -1,
                            f,
                            f + 1,
                            f + 2,
                            f + 3,
                            f + 4,
                            f + 5,
                        ),
                    )
                };
                c[0] = _mm256_or_si256(c[0], pick(t4lo, 0));
                c[1] = _mm256_or_si256(c[1], pick(t4lo, 6));
                c[2] = _mm256_or_si256(c[2], pick(t4hi, 2));
                c[3] = _mm256_or_si256(c[3], pick(t4hi, 8));
            }
        }
    }
}

/// The eight i32 corrections of the activation block at `y` (Q8_K: `bsums[2k] + bsums[2k+1]`;
/// Q8_TF: `lsums[k]`).
///
/// # Safety
/// AVX2 available; `y` readable for one activation block of `KIND`'s type.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn correction<const KIND: u8>(y: *const u8) -> __m256i {
    // SAFETY: the bsums / lsums lie inside the block at `y`.
    unsafe {
        if is_tq(KIND) {
            let bs = _mm256_loadu_si256(y.add(4 + QK_K).cast());
            _mm256_madd_epi16(bs, _mm256_set1_epi16(1))
        } else {
            _mm256_loadu_si256(y.add(4 + QK_TF).cast())
        }
    }
}

/// Every tile width sums a (row, token) in the same order (the module's), so the result does
/// not depend on the batch and `Numerics` changes nothing. Tokens run in blocks whose
/// activations stay in L2 while the rows stream past; per row, tiles of four tokens and one
/// narrower tile for the rest, so the row's blocks are decoded once per four tokens and read
/// from memory once per block (once per call for a decode batch).
///
/// # Safety
/// The CPU has AVX2, FMA, F16C; `g` comes from `Gemm::new` with `out.len() == g.ntok *
/// g.nrows` and `g.wty` of kind `KIND`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn run_tern<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) {
    let tb = g.token_block(super::TOKEN_BLOCK_BYTES, 4);
    let mut t0 = 0;
    while t0 < g.ntok {
        let t1 = (t0 + tb).min(g.ntok);
        for r in 0..g.nrows {
            let mut t = t0;
            while t1 - t >= 4 {
                // SAFETY: r < nrows, t + 4 <= ntok; the caller has the features.
                unsafe { tile::<KIND, 4>(g, r, t, out) };
                t += 4;
            }
            // SAFETY: as above with the `t1 - t` (< 4) tokens left.
            unsafe {
                match t1 - t {
                    0 => {}
                    1 => tile::<KIND, 1>(g, r, t, out),
                    2 => tile::<KIND, 2>(g, r, t, out),
                    _ => tile::<KIND, 3>(g, r, t, out),
                }
            }
        }
        t0 = t1;
    }
}

/// Row `r` against tokens `t0..t0+T`: the weights are decoded once per block for all T.
///
/// # Safety
/// As [`run_tern`], with `r < g.nrows` and `t0 + T <= g.ntok`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const KIND: u8, const T: usize>(g: &Gemm<'_>, r: usize, t0: usize, out: &mut [f32]) {
    let (bv, wb, ab, dpos) = geometry(KIND);
    let nb = g.cols / bv;
    let nch = bv / 32;
    let w = g.w_row(r).as_ptr();
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); T];
    let mut c = [_mm256_setzero_si256(); 8];
    // SAFETY (whole body): block `b < nb` of a row / activation row lies inside it, as
    // `Gemm::new` checked the sizes.
    unsafe {
        for b in 0..nb {
            let x = w.add(b * wb);
            decode::<KIND>(x, &mut c);
            let dw = f16_at(x.add(dpos));
            for t in 0..T {
                let y = g.act_row(t0 + t).as_ptr().add(b * ab);
                let mut s16 = _mm256_setzero_si256();
                for v in 0..nch {
                    let a = _mm256_loadu_si256(y.add(4 + 32 * v).cast());
                    s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(c[v], a));
                }
                let lanes = _mm256_sub_epi32(_mm256_madd_epi16(s16, ones), correction::<KIND>(y));
                let d = if is_tq(KIND) {
                    y.cast::<f32>().read_unaligned() * dw
                } else {
                    dw
                };
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(d), acc[t]);
            }
        }
        for t in 0..T {
            let a = g.act_row(t0 + t);
            let mut s = hsum(acc[t]);
            if !is_tq(KIND) && nb > 0 {
                s *= a.as_ptr().cast::<f32>().read_unaligned();
            }
            out[(t0 + t) * g.nrows + r] = s;
        }
    }
}
