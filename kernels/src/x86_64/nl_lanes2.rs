//! The prefill GEMM of q4_0 against q8_0 on AVX2 with tokens in the register lanes:
//! [`super::nl_lanes`] (the AVX-512 VNNI kernel) with eight tokens per register and
//! `vpmaddubsw` for `vpdpbusd`, in the same per-block order of ggml's repacked `q4_0_8x8` GEMM
//! (`scalar::vec_dot_block_chain`): per (row, token) the exact integer sum of each 32-value
//! block, then one `acc = fma(isum, dw·da, acc)`.
//!
//! - Activations are rearranged once per band of up to [`BAND`] groups of 8 tokens: for each
//!   group and block, quad `q` (values `4q..4q+4`) of the 8 tokens fills one 32-byte register;
//!   beside them each token's `-8 · Σa` and its f32 scale.
//! - Weights: a row's block is unpacked to its 32 codes `value + 8` (0..15, no table) and four
//!   of them, broadcast to all lanes, are `vpmaddubsw`'s unsigned operand. Its i16 pair sums
//!   are added up over the whole block without overflow (16 products of at most 15 · 128 each:
//!   30,720 ≤ 32,767), then widened by one `vpmaddwd` by ones and started at `-8 · Σa`: one
//!   multiply per 32 multiply-adds plus one per block, where ggml's AVX2 `q4_0_8x8` GEMM and
//!   our 8-row tile (`iq4::nl_tile8`) spend two per 32.
//! - The K dimension is walked in chunks of [`KC`] blocks, each chunk's rearranged activations
//!   staying in L2 while every row passes over them; a (row, group)'s f32 accumulator lives in
//!   registers within a chunk and in a per-thread scratch between chunks.
//!
//! IQ4_NL stays on its tile: its values + 128 reach 241, and 16 products of 241 · 128 would
//! overflow the i16 sums (two already saturate `vpmaddubsw`). Used from [`MIN_TOKENS`] tokens.

#![allow(clippy::needless_range_loop)]

use super::{with_scratch, Pod};
use crate::matmul::Gemm;
use crate::quant::QK;
use core::arch::x86_64::*;

/// Tokens per register.
const LANES: usize = 8;
/// Token groups per band (their activations are prepared once and reused by every row).
const BAND: usize = 16;
/// Blocks per K chunk: a band's activations of one chunk (BAND · KC · 320 bytes) stay in L2.
const KC: usize = 32;
/// Rows × token groups of the register tile (Intel Sapphire Rapids, 2 threads, 4096 × 14336 ×
/// 512: 6 × 2 179 ms, 4 × 3 179, 5 × 3 185, 4 × 4 194, 8 × 2 202, 4 × 2 221, 3 × 2 299; the
/// twelve i16 sums stay in registers, the f32 accumulators are touched once per block).
const R: usize = 6;
const G: usize = 2;

/// From this many tokens on, `iq4::run_nl` takes this GEMM for q4_0.
pub(super) const MIN_TOKENS: usize = 16;

/// Bytes of a q4_0 block.
const Q4_0_B: usize = 18;

/// One group of 8 tokens at one block, rearranged.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct ActB {
    /// Quad `q`: bytes `4t..4t+4` = token `t`'s values `4q..4q+4`.
    codes: [__m256i; 8],
    /// Lane `t`: `-8 · Σ` of token `t`'s 32 values (removes the codes' +8).
    neg: __m256i,
    /// Lane `t`: token `t`'s f32 block scale.
    d: __m256,
}

// SAFETY: vectors only; alignment 32.
unsafe impl Pod for ActB {}

/// All of `g`'s rows × tokens `t0..t1`.
///
/// # Safety
/// AVX2, FMA, F16C; `g` a validated problem with q4_0 weights and q8_0 activations,
/// `t0 < t1 <= g.ntok`, `out.len() == g.ntok * g.nrows`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn gemm(g: &Gemm<'_>, t0: usize, t1: usize, out: &mut [f32]) {
    let nb = g.cols / QK;
    let ngroups = (t1 - t0).div_ceil(LANES);
    let band = BAND.min(ngroups);
    with_scratch(0, band * KC, |acts: &mut [ActB]| {
        with_scratch(1, g.nrows * band, |accs: &mut [__m256]| {
            let mut b0 = 0;
            while b0 < ngroups {
                let b1 = (b0 + band).min(ngroups);
                let nbg = b1 - b0;
                accs[..g.nrows * nbg].fill(_mm256_setzero_ps());
                let mut k0 = 0;
                while k0 < nb {
                    let k1 = (k0 + KC).min(nb);
                    // SAFETY: as this function's contract; `acts` holds `band · KC` blocks.
                    unsafe { prep(g, t0, t1, b0, b1, k0, k1, acts) };
                    let mut r = 0;
                    while r < g.nrows {
                        let nr = (g.nrows - r).min(R);
                        let mut gi = 0;
                        while gi < nbg {
                            let ng = (nbg - gi).min(G);
                            // SAFETY: rows r..r+nr, groups gi..gi+ng of the band, blocks
                            // k0..k1: all inside `g`, `acts` and `accs`.
                            unsafe {
                                match (nr == R, ng == G) {
                                    (true, true) => {
                                        micro::<R, G>(g, r, gi, nbg, k0, k1, acts, accs)
                                    }
                                    (true, false) => {
                                        micro::<R, 1>(g, r, gi, nbg, k0, k1, acts, accs)
                                    }
                                    (false, true) => {
                                        for i in r..r + nr {
                                            micro::<1, G>(g, i, gi, nbg, k0, k1, acts, accs)
                                        }
                                    }
                                    (false, false) => {
                                        for i in r..r + nr {
                                            micro::<1, 1>(g, i, gi, nbg, k0, k1, acts, accs)
                                        }
                                    }
                                }
                            }
                            gi += ng;
                        }
                        r += nr;
                    }
                    k0 = k1;
                }
                // Out: token-major.
                for gi in 0..nbg {
                    let ts = t0 + (b0 + gi) * LANES;
                    let n = (t1 - ts).min(LANES);
                    for row in 0..g.nrows {
                        let mut lanes = [0f32; LANES];
                        // SAFETY: 8 floats.
                        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), accs[row * nbg + gi]) };
                        for l in 0..n {
                            out[(ts + l) * g.nrows + row] = lanes[l];
                        }
                    }
                }
                b0 = b1;
            }
        })
    });
}

/// Rearranges blocks `k0..k1` of groups `b0..b1` (tokens from `t0`, up to `t1`) into
/// `acts[(gi - b0) · KC + (k - k0)]`; lanes past `t1` are zero.
///
/// # Safety
/// As [`gemm`]; `acts.len() >= (b1 - b0) · KC`, `k1 - k0 <= KC`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn prep(
    g: &Gemm<'_>,
    t0: usize,
    t1: usize,
    b0: usize,
    b1: usize,
    k0: usize,
    k1: usize,
    acts: &mut [ActB],
) {
    for gi in b0..b1 {
        let ts = t0 + gi * LANES;
        let n = (t1 - ts).min(LANES);
        for k in k0..k1 {
            let (codes, neg, d) = super::nl_lanes::gather::<LANES>(g, ts, n, k, -8);
            let blk = &mut acts[(gi - b0) * KC + (k - k0)];
            // SAFETY: each array is 32 bytes.
            unsafe {
                for (o, c) in blk.codes.iter_mut().zip(&codes) {
                    *o = _mm256_loadu_si256(c.as_ptr().cast());
                }
                blk.neg = _mm256_loadu_si256(neg.as_ptr().cast());
                blk.d = _mm256_loadu_ps(d.as_ptr());
            }
        }
    }
}

/// Rows `r..r+RR` × groups `gi..gi+GG` of the band (`nbg` groups) over blocks `k0..k1`: the
/// accumulators come from and go back to `accs[row · nbg + group]`.
///
/// # Safety
/// Features as [`gemm`]; the rows, groups and blocks lie inside `g`, `acts` (from block `k0`)
/// and `accs`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn micro<const RR: usize, const GG: usize>(
    g: &Gemm<'_>,
    r: usize,
    gi: usize,
    nbg: usize,
    k0: usize,
    k1: usize,
    acts: &[ActB],
    accs: &mut [__m256],
) {
    // SAFETY (whole body): as the contract.
    unsafe {
        let mut acc: [[__m256; GG]; RR] =
            core::array::from_fn(|i| core::array::from_fn(|k| accs[(r + i) * nbg + gi + k]));
        let rows: [*const u8; RR] =
            core::array::from_fn(|i| g.w.as_ptr().add((r + i) * g.w_stride));
        let nib = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let mut vals = [[0u32; 8]; RR];
        for b in k0..k1 {
            let mut dw = [_mm256_setzero_ps(); RR];
            for i in 0..RR {
                let p = rows[i].add(b * Q4_0_B);
                let q = _mm_loadu_si128(p.add(2).cast());
                let both = _mm256_set_m128i(_mm_srli_epi16::<4>(q), q);
                _mm256_storeu_si256(vals[i].as_mut_ptr().cast(), _mm256_and_si256(both, nib));
                dw[i] = _mm256_cvtph_ps(_mm_set1_epi16(p.cast::<i16>().read_unaligned()));
            }
            let a: [&ActB; GG] = core::array::from_fn(|k| &acts[(gi + k) * KC + (b - k0)]);
            let mut raw: [[__m256i; GG]; RR] = [[_mm256_setzero_si256(); GG]; RR];
            for q in 0..8 {
                let c: [__m256i; GG] = core::array::from_fn(|k| a[k].codes[q]);
                for i in 0..RR {
                    let wv = _mm256_set1_epi32(vals[i][q] as i32);
                    for k in 0..GG {
                        raw[i][k] = _mm256_add_epi16(raw[i][k], _mm256_maddubs_epi16(wv, c[k]));
                    }
                }
            }
            for i in 0..RR {
                for k in 0..GG {
                    let isum = _mm256_add_epi32(_mm256_madd_epi16(raw[i][k], ones), a[k].neg);
                    acc[i][k] = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(isum),
                        _mm256_mul_ps(dw[i], a[k].d),
                        acc[i][k],
                    );
                }
            }
        }
        for i in 0..RR {
            for k in 0..GG {
                accs[(r + i) * nbg + gi + k] = acc[i][k];
            }
        }
    }
}
