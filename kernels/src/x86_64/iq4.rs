//! The 4-bit types whose code is an index into a table of 16 values, looked up with one
//! `vpshufb`: q4_0 (`code - 8`) and IQ4_NL (ggml's `kvalues_iq4nl`) against q8_0, IQ4_XS
//! (`kvalues_iq4nl`, 256-value super-blocks) against q8_K; bit-identical to
//! `scalar::vec_dot_block_chain` / `scalar::vec_dot_lanes8`.
//!
//! - q4_0 and IQ4_NL sum in the order of ggml's repacked `q4_0_8x8` / `iq4_nl_8x8` kernels
//!   (one template, `gemv/gemm_q4_b32_8x8_q8_0_lut_avx`): per (row, token) one f32
//!   chain with one FMA per 32-value block of the exact integer sum. The exact sums of a tile's
//!   rows are reduced horizontally together, so one vector holds a block's sums for every row
//!   and one FMA takes the step for all of them (rows in lanes, as ggml's repacked layout has
//!   them, without repacking the weights). AVX2: 8 rows per tile, the i8 products by ggml's
//!   `abs`/`sign` trick (q4_0 from 16 tokens: the tokens-in-lanes GEMM of `nl_lanes2`).
//!   AVX-512: 16 rows, two per 512-bit register, the codes as unsigned
//!   `value + 128` through `vpdpbusd` with the lanes started at `-128·Σa`.
//! - IQ4_XS: llama.cpp's `ggml_vec_dot_iq4_xs_q8_K` lanes (values `4l..4l+4` of each 32-value
//!   sub-block times the sub-block's scale) in `KOrder::Lanes8`, their exact sum in
//!   `KOrder::Tiled`. AVX2 per 32-value sub-block as ggml; AVX-512 two sub-blocks per
//!   register (`vpdpwssd` applies the scales), and from 16 tokens the tokens-in-lanes GEMM.

// Tile loops index several per-row / per-token arrays with the same counter.
#![allow(clippy::needless_range_loop)]

use super::avx512q::reduce_lanes;
use super::lanes8::{f16_at, signed_pairs, Chains};
use super::{drive, IQ4_NL, Q4_0};
use crate::matmul::Gemm;
use crate::quant::{Q8_K_BYTES, QK, QK_K};
use crate::scalar::{iq4xs_scale, Delta, KVALUES_IQ4NL};
use core::arch::x86_64::*;

/// Bytes of an IQ4_NL block, a q8_0 block and an IQ4_XS super-block.
const NL_B: usize = 18;
const Q8_0_B: usize = 34;
const XS_B: usize = 136;

/// Tokens per IQ4_NL tile (the unpacked codes of a tile's rows serve this many tokens).
const NL_T: usize = 4;

/// `kvalues_iq4nl` in both 128-bit halves (signed values).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn lut_signed() -> __m256i {
    let v = lut128::<IQ4_NL>();
    _mm256_set_m128i(v, v)
}

/// The 16 signed values of a `KIND` (q4_0 or IQ4_NL) code, as bytes of a 128-bit lane.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn lut128<const KIND: u8>() -> __m128i {
    if KIND == Q4_0 {
        _mm_setr_epi8(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
    } else {
        // SAFETY: 16 readable bytes.
        unsafe { _mm_loadu_si128(KVALUES_IQ4NL.as_ptr().cast()) }
    }
}

/// The values + 128 (unsigned codes for `vpdpbusd`) of a `KIND` code in a 128-bit lane.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn lut_unsigned128<const KIND: u8>() -> __m128i {
    _mm_xor_si128(lut128::<KIND>(), _mm_set1_epi8(-128))
}

/// The IQ4_XS super-block at `p` as the tokens-in-lanes GEMM wants it: its 256 codes as
/// unsigned `value + 128`, eight 32-value chunks in value order.
///
/// # Safety
/// AVX2 available; `p` readable for one IQ4_XS super-block.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn xs_codes_u8(p: *const u8) -> [__m256i; 8] {
    let l = lut_unsigned128::<IQ4_NL>();
    let lut = _mm256_set_m128i(l, l);
    // SAFETY: chunk c's 16 code bytes at 8 + 16c.
    core::array::from_fn(|c| unsafe { values(p.add(8 + 16 * c), lut) })
}

/// The 32 signed values of the 16 code bytes at `p` in value order: low nibbles (values
/// 0..16) in the low half, high nibbles (16..32) in the high half.
///
/// # Safety
/// AVX2 available; 16 bytes readable at `p`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn values(p: *const u8, lut: __m256i) -> __m256i {
    // SAFETY: as the contract.
    let q = unsafe { _mm_loadu_si128(p.cast()) };
    let both = _mm256_set_m128i(_mm_srli_epi16::<4>(q), q);
    _mm256_shuffle_epi8(lut, _mm256_and_si256(both, _mm256_set1_epi8(0x0F)))
}

/// i16 pairs of `w·a` (ggml's `mul_add_epi8`: `|w|` unsigned times `a` with `w`'s sign; every
/// pair at most 2·127·127, exact).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn mul_pairs(w: __m256i, a: __m256i) -> __m256i {
    _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w))
}

/// Lane `r` = the sum of the eight i32 lanes of `v[r]` (exact).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn reduce8(v: &[__m256i; 8]) -> __m256i {
    let h0123 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    let h4567 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    _mm256_add_epi32(
        _mm256_permute2x128_si256::<0x20>(h0123, h4567),
        _mm256_permute2x128_si256::<0x31>(h0123, h4567),
    )
}

// ---------------------------------------------------------------------------------------------
// IQ4_NL

/// Rows of the tile at `r0` (`n` of them valid) as byte offsets from row `r0`: the rows past
/// `n` repeat the last valid one (computed, never stored).
fn row_offsets<const R: usize>(g: &Gemm<'_>, n: usize) -> [usize; R] {
    core::array::from_fn(|i| i.min(n - 1) * g.w_stride)
}

/// Cover the matrix with tiles of `R` rows × up to [`NL_T`] tokens, tokens blocked so one
/// block's activations stay in L2 while the rows stream past.
macro_rules! drive_nl {
    ($g:expr, $out:expr, $tile:ident, $R:literal, $K:ident) => {{
        let g: &Gemm<'_> = $g;
        let out: &mut [f32] = $out;
        let tb = g.token_block(super::TOKEN_BLOCK_BYTES, NL_T);
        let mut t0 = 0;
        while t0 < g.ntok {
            let t1 = (t0 + tb).min(g.ntok);
            let mut r = 0;
            while r < g.nrows {
                let n = (g.nrows - r).min($R);
                let mut t = t0;
                while t < t1 {
                    // SAFETY: rows r..r+n and tokens t..t+T are in the problem; the caller
                    // has the features.
                    unsafe {
                        match t1 - t {
                            1 => $tile::<1, $K>(g, r, n, t, out),
                            2 => $tile::<2, $K>(g, r, n, t, out),
                            3 => $tile::<3, $K>(g, r, n, t, out),
                            _ => $tile::<NL_T, $K>(g, r, n, t, out),
                        }
                    }
                    t += (t1 - t).min(NL_T);
                }
                r += $R;
            }
            t0 = t1;
        }
    }};
}

/// # Safety
/// The CPU has AVX2, FMA and F16C; `g` comes from `Gemm::new` with `out.len() == g.ntok *
/// g.nrows` and weights of kind `KIND` (q4_0 or IQ4_NL).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn run_nl<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) {
    if KIND == Q4_0 && g.ntok >= super::nl_lanes2::MIN_TOKENS {
        // SAFETY: as this function's contract, with q4_0 weights.
        unsafe { super::nl_lanes2::gemm(g, 0, g.ntok, out) };
    } else {
        drive_nl!(g, out, nl_tile8, 8, KIND);
    }
}

/// Rows `r0..r0+n` (n ≤ 8) × tokens `t0..t0+T`, AVX2.
///
/// # Safety
/// As [`run_nl`]; `1 <= n`, `r0 + n <= g.nrows`, `t0 + T <= g.ntok`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nl_tile8<const T: usize, const KIND: u8>(
    g: &Gemm<'_>,
    r0: usize,
    n: usize,
    t0: usize,
    out: &mut [f32],
) {
    let nb = g.cols / QK;
    let l = lut128::<KIND>();
    let lut = _mm256_set_m128i(l, l);
    let ones = _mm256_set1_epi16(1);
    let rows = row_offsets::<8>(g, n);
    let mut acc = [_mm256_setzero_ps(); T];
    // SAFETY (whole body): blocks below `nb` of rows r0..r0+n (the offsets repeat valid rows)
    // and of tokens t0..t0+T; side-table indices below `g.ntok * nb`.
    unsafe {
        let w = g.w.as_ptr().add(r0 * g.w_stride);
        for b in 0..nb {
            let p = w.add(b * NL_B);
            let v: [__m256i; 8] = core::array::from_fn(|r| values(p.add(rows[r] + 2), lut));
            let dh = |r: usize| p.add(rows[r]).cast::<i16>().read_unaligned();
            let dw = _mm256_cvtph_ps(_mm_setr_epi16(
                dh(0),
                dh(1),
                dh(2),
                dh(3),
                dh(4),
                dh(5),
                dh(6),
                dh(7),
            ));
            for t in 0..T {
                let a = _mm256_loadu_si256(
                    g.a.as_ptr()
                        .add((t0 + t) * g.a_stride + b * Q8_0_B + 2)
                        .cast(),
                );
                let m: [__m256i; 8] =
                    core::array::from_fn(|r| _mm256_madd_epi16(mul_pairs(v[r], a), ones));
                let isum = _mm256_cvtepi32_ps(reduce8(&m));
                let da = _mm256_set1_ps(*g.a_scales.get_unchecked((t0 + t) * nb + b));
                acc[t] = _mm256_fmadd_ps(isum, _mm256_mul_ps(dw, da), acc[t]);
            }
        }
        for t in 0..T {
            let mut s = [0f32; 8];
            _mm256_storeu_ps(s.as_mut_ptr(), acc[t]);
            let o = (t0 + t) * g.nrows + r0;
            out.get_unchecked_mut(o..o + n).copy_from_slice(&s[..n]);
        }
    }
}

/// The AVX-512 table's entry: 16-row tiles below 16 tokens, from 16 the tokens-in-lanes GEMM
/// (`nl_lanes`).
///
/// # Safety
/// As [`run_nl`], and the CPU has AVX-512 F/BW/VL/DQ and VNNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn run_nl_avx512<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) {
    if g.ntok >= 16 {
        // SAFETY: as this function's contract.
        unsafe { super::nl_lanes::gemm::<KIND>(g, 0, g.ntok, out) };
    } else if 15 * g.w_stride <= i32::MAX as usize {
        drive_nl!(g, out, nl_tile16, 16, KIND);
    } else {
        // Rows too long for the 16-row tile's i32 gather offsets (over ~254M columns): the
        // 8-row tile, same bits.
        drive_nl!(g, out, nl_tile8, 8, KIND);
    }
}

/// Which row each lane of [`reduce16_pairs`] holds.
const ROW_OF_LANE: [usize; 16] = [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15];

/// `v[i]` holds row `2i` in its low 256 bits and row `2i + 1` in its high ones; the result's
/// lane `j` is the sum of row [`ROW_OF_LANE`]`[j]`'s eight lanes (exact).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
fn reduce16_pairs(v: &[__m512i; 8]) -> __m512i {
    // x: 128-bit lane L holds [Σ_L v0..Σ_L v3]; lanes 0, 1 are the even rows', 2, 3 the odd.
    let x = reduce_lanes(v[0], v[1], v[2], v[3]);
    let y = reduce_lanes(v[4], v[5], v[6], v[7]);
    _mm512_add_epi32(
        _mm512_shuffle_i64x2::<0b10_00_10_00>(x, y),
        _mm512_shuffle_i64x2::<0b11_01_11_01>(x, y),
    )
}

/// The unsigned codes `value + 128` of the blocks at `p0` (low half) and `p1` (high half).
///
/// # Safety
/// Features as [`run_nl_avx512`]; 16 code bytes readable at each pointer.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn codes_pair(p0: *const u8, p1: *const u8, lut: __m512i) -> __m512i {
    // SAFETY: as the contract.
    let (q0, q1) = unsafe { (_mm_loadu_si128(p0.cast()), _mm_loadu_si128(p1.cast())) };
    let lo = _mm256_set_m128i(q1, q0);
    let both = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), _mm256_srli_epi16::<4>(lo));
    // Lanes (128-bit): [q0 low nibbles, q1 low, q0 high, q1 high]; put each row's two halves
    // together: [q0 low, q0 high, q1 low, q1 high].
    let both = _mm512_shuffle_i64x2::<0b11_01_10_00>(both, both);
    _mm512_shuffle_epi8(lut, _mm512_and_si512(both, _mm512_set1_epi8(0x0F)))
}

/// Rows `r0..r0+n` (n ≤ 16) × tokens `t0..t0+T`, AVX-512.
///
/// # Safety
/// As [`run_nl_avx512`]; `1 <= n`, `r0 + n <= g.nrows`, `t0 + T <= g.ntok`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn nl_tile16<const T: usize, const KIND: u8>(
    g: &Gemm<'_>,
    r0: usize,
    n: usize,
    t0: usize,
    out: &mut [f32],
) {
    let nb = g.cols / QK;
    let lut = _mm512_broadcast_i32x4(lut_unsigned128::<KIND>());
    let rows = row_offsets::<16>(g, n);
    // Lane j's f16 scale is row ROW_OF_LANE[j]'s (gathered 4 bytes at a time).
    let idx = _mm512_setr_epi32(
        rows[ROW_OF_LANE[0]] as i32,
        rows[ROW_OF_LANE[1]] as i32,
        rows[ROW_OF_LANE[2]] as i32,
        rows[ROW_OF_LANE[3]] as i32,
        rows[ROW_OF_LANE[4]] as i32,
        rows[ROW_OF_LANE[5]] as i32,
        rows[ROW_OF_LANE[6]] as i32,
        rows[ROW_OF_LANE[7]] as i32,
        rows[ROW_OF_LANE[8]] as i32,
        rows[ROW_OF_LANE[9]] as i32,
        rows[ROW_OF_LANE[10]] as i32,
        rows[ROW_OF_LANE[11]] as i32,
        rows[ROW_OF_LANE[12]] as i32,
        rows[ROW_OF_LANE[13]] as i32,
        rows[ROW_OF_LANE[14]] as i32,
        rows[ROW_OF_LANE[15]] as i32,
    );
    let c128 = _mm256_set1_epi8(-128);
    let mut acc = [_mm512_setzero_ps(); T];
    // SAFETY (whole body): blocks below `nb` of rows r0..r0+n (the offsets repeat valid rows,
    // and the gather's offsets, at most 15 · w_stride, fit i32: `run_nl_avx512` takes this
    // tile only then) and of tokens t0..t0+T; side-table indices below `g.ntok * nb`.
    unsafe {
        let w = g.w.as_ptr().add(r0 * g.w_stride);
        for b in 0..nb {
            let p = w.add(b * NL_B);
            if b % 3 == 0 {
                // The next tile's rows, about one cache line per three blocks (a hint).
                for i in 0..16 {
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add((16 + i) * g.w_stride).cast());
                }
            }
            let u: [__m512i; 8] = core::array::from_fn(|i| {
                codes_pair(p.add(rows[2 * i] + 2), p.add(rows[2 * i + 1] + 2), lut)
            });
            let dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_i32gather_epi32::<1>(
                idx,
                p.cast::<i32>(),
            )));
            for t in 0..T {
                let ap = g.a.as_ptr().add((t0 + t) * g.a_stride + b * Q8_0_B + 2);
                let a256 = _mm256_loadu_si256(ap.cast());
                // Each lane starts at -128 · (its four activations' sum).
                let neg = _mm256_sub_epi32(
                    _mm256_setzero_si256(),
                    _mm256_dpbusd_epi32(_mm256_setzero_si256(), c128, a256),
                );
                let (a, neg) = (_mm512_broadcast_i64x4(a256), _mm512_broadcast_i64x4(neg));
                let m: [__m512i; 8] = core::array::from_fn(|i| _mm512_dpbusd_epi32(neg, u[i], a));
                let isum = _mm512_cvtepi32_ps(reduce16_pairs(&m));
                let da = _mm512_set1_ps(*g.a_scales.get_unchecked((t0 + t) * nb + b));
                acc[t] = _mm512_fmadd_ps(isum, _mm512_mul_ps(dw, da), acc[t]);
            }
        }
        for t in 0..T {
            let mut s = [0f32; 16];
            _mm512_storeu_ps(s.as_mut_ptr(), acc[t]);
            let o = (t0 + t) * g.nrows + r0;
            for j in 0..16 {
                if ROW_OF_LANE[j] < n {
                    *out.get_unchecked_mut(o + ROW_OF_LANE[j]) = s[j];
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// IQ4_XS

/// # Safety
/// The CPU has AVX2, FMA and F16C; `g` comes from `Gemm::new` with `out.len() == g.ntok *
/// g.nrows` and IQ4_XS weights.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn run_iq4xs(g: &Gemm<'_>, out: &mut [f32]) {
    if g.ntok == 1 {
        drive!(g, out, xs_tile, 4, 1);
    } else {
        drive!(g, out, xs_tile, 2, 4);
    }
}

/// The AVX-512 table's entry: [`run_iq4xs`]'s tiles compiled for AVX-512, and from 16 tokens
/// in the tiled order the tokens-in-lanes k-quant GEMM (`kq_lanes`, codes as `value + 128`).
///
/// # Safety
/// As [`run_iq4xs`], and the CPU has AVX-512 F/BW/VL/DQ and VNNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn run_iq4xs_avx512(g: &Gemm<'_>, out: &mut [f32]) {
    // SAFETY: as this function's contract.
    if unsafe { super::kq_lanes::tiled_batch::<{ super::IQ4_XS }>(g, out) } {
        return;
    }
    if g.ntok == 1 && super::is_amd_zen5_or_later() {
        // One row at a time on a Zen 5 (session 40, EPYC family 26 model 2, 4096 × 14336: 1.43x
        // / 1.31x the four-row tile's speed at 1 / 2 threads, medians of five alternated runs:
        // one sequential stream through the matrix, where four interleaved row streams ran well
        // below their speed in cache).
        drive!(g, out, xs_tile512, 1, 1);
    } else if g.ntok == 1 {
        drive!(g, out, xs_tile512, 4, 1);
    } else {
        drive!(g, out, xs_tile512, 4, 4);
    }
}

/// Rows `r0..r0+R` × tokens `t0..t0+T` of IQ4_XS, AVX2: per 32-value chunk `vpmaddubsw` on
/// ggml's `abs`/`sign` operands and `vpmaddwd` by the chunk's scale.
macro_rules! xs_tile_fn {
    ($name:ident, $features:literal) => {
        /// # Safety
        /// As [`run_iq4xs`] (and the features named); `r0 + R <= g.nrows`, `t0 + T <= g.ntok`.
        #[target_feature(enable = $features)]
        unsafe fn $name<const R: usize, const T: usize>(
            g: &Gemm<'_>,
            r0: usize,
            t0: usize,
            out: &mut [f32],
        ) {
            let nb = g.cols / QK_K;
            let lut = lut_signed();
            let mut ch = Chains::<R, T>::new(g, t0, 1.0, Delta::No);
            // SAFETY (whole body): super-blocks below `nb` of rows r0..r0+R and tokens
            // t0..t0+T.
            unsafe {
                for b in 0..nb {
                    let ad = Chains::<R, T>::dy(g, t0, b);
                    for r in 0..R {
                        let wp = g.w.as_ptr().add((r0 + r) * g.w_stride + b * XS_B);
                        let x = &*wp.cast::<[u8; XS_B]>();
                        let dw = f16_at(wp);
                        let v: [__m256i; 8] =
                            core::array::from_fn(|c| values(wp.add(8 + 16 * c), lut));
                        let s: [__m256i; 8] = core::array::from_fn(|c| {
                            _mm256_set1_epi16((iq4xs_scale(x, c) - 32) as i16)
                        });
                        for t in 0..T {
                            let q8 = g.a.as_ptr().add((t0 + t) * g.a_stride + b * Q8_K_BYTES + 4);
                            let mut lanes = _mm256_setzero_si256();
                            for c in 0..8 {
                                let a = _mm256_loadu_si256(q8.add(32 * c).cast());
                                let p = _mm256_madd_epi16(mul_pairs(v[c], a), s[c]);
                                lanes = _mm256_add_epi32(lanes, p);
                            }
                            ch.step(r, t, lanes, dw, ad[t]);
                        }
                    }
                }
                ch.finish(g, r0, t0, out);
            }
        }
    };
}

xs_tile_fn!(xs_tile, "avx2,fma,f16c");

/// The eight scales `ls - 32` of the IQ4_XS super-block at `p` as i16 lanes, from its
/// `scales_l` nibbles and `scales_h` bit pairs in registers.
///
/// # Safety
/// Features as [`run_iq4xs_avx512`]; `p` readable for one super-block.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn xs_scales16(p: *const u8) -> __m128i {
    // SAFETY: scales_h at 2, scales_l at 4..8.
    let (sh, sl) = unsafe {
        (
            p.add(2).cast::<u16>().read_unaligned(),
            p.add(4).cast::<i32>().read_unaligned(),
        )
    };
    // Sub-block j's low four bits: nibble j % 2 of scales_l[j / 2].
    let l = _mm_cvtepu8_epi16(_mm_unpacklo_epi8(
        _mm_cvtsi32_si128(sl),
        _mm_cvtsi32_si128(sl),
    ));
    let l = _mm_and_si128(
        _mm_srlv_epi16(l, _mm_setr_epi16(0, 4, 0, 4, 0, 4, 0, 4)),
        _mm_set1_epi16(0xF),
    );
    // Its high two: bits 2j..2j+2 of scales_h.
    let h = _mm_and_si128(
        _mm_srlv_epi16(
            _mm_set1_epi16(sh as i16),
            _mm_setr_epi16(0, 2, 4, 6, 8, 10, 12, 14),
        ),
        _mm_set1_epi16(3),
    );
    _mm_sub_epi16(_mm_or_si128(l, _mm_slli_epi16::<4>(h)), _mm_set1_epi16(32))
}

/// Rows `r0..r0+R` × tokens `t0..t0+T` of IQ4_XS on AVX-512: two 32-value sub-blocks per
/// register — values by one `vpshufb`, i16 pairs `|w|·(a with w's sign)` by `vpmaddubsw`,
/// scaled and summed into the lanes by `vpdpwssd` — the two halves added at the end of the
/// super-block into ggml's eight lanes (exact).
///
/// # Safety
/// As [`run_iq4xs_avx512`]; `r0 + R <= g.nrows`, `t0 + T <= g.ntok`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn xs_tile512<const R: usize, const T: usize>(
    g: &Gemm<'_>,
    r0: usize,
    t0: usize,
    out: &mut [f32],
) {
    let nb = g.cols / QK_K;
    // SAFETY: 16 readable bytes.
    let lut = _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(KVALUES_IQ4NL.as_ptr().cast()) });
    // Pair m's scales: sub-block 2m in the low 256 bits, 2m + 1 in the high.
    let sel: [__m512i; 4] = core::array::from_fn(|m| {
        _mm512_inserti64x4::<1>(
            _mm512_set1_epi16(2 * m as i16),
            _mm256_set1_epi16(2 * m as i16 + 1),
        )
    });
    let mut ch = Chains::<R, T>::new(g, t0, 1.0, Delta::No);
    // SAFETY (whole body): super-blocks below `nb` of rows r0..r0+R and tokens t0..t0+T.
    unsafe {
        for b in 0..nb {
            let ad = Chains::<R, T>::dy(g, t0, b);
            for r in 0..R {
                let wp = g.w.as_ptr().add((r0 + r) * g.w_stride + b * XS_B);
                if b % 2 == 0 {
                    for line in 0..4 {
                        _mm_prefetch::<_MM_HINT_T0>(
                            wp.wrapping_add(2 * R * g.w_stride + 64 * line).cast(),
                        );
                    }
                }
                let dw = f16_at(wp);
                let sc8 = _mm512_castsi128_si512(xs_scales16(wp));
                let mut aw = [_mm512_setzero_si512(); 4];
                let mut neg = [0u64; 4];
                let mut sc = [_mm512_setzero_si512(); 4];
                for m in 0..4 {
                    let q = _mm256_loadu_si256(wp.add(8 + 32 * m).cast());
                    let both = _mm512_inserti64x4::<1>(
                        _mm512_castsi256_si512(q),
                        _mm256_srli_epi16::<4>(q),
                    );
                    // [chunk 2m low nibbles, its high ones, chunk 2m + 1 low, high].
                    let both = _mm512_shuffle_i64x2::<0b11_01_10_00>(both, both);
                    let v =
                        _mm512_shuffle_epi8(lut, _mm512_and_si512(both, _mm512_set1_epi8(0x0F)));
                    aw[m] = _mm512_abs_epi8(v);
                    neg[m] = _mm512_movepi8_mask(v);
                    sc[m] = _mm512_permutexvar_epi16(sel[m], sc8);
                }
                for t in 0..T {
                    let q8 = g.a.as_ptr().add((t0 + t) * g.a_stride + b * Q8_K_BYTES + 4);
                    let lanes = signed_pairs(q8, &aw, &neg, &sc);
                    ch.step(r, t, lanes, dw, ad[t]);
                }
            }
        }
        ch.finish(g, r0, t0, out);
    }
}
