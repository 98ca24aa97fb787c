//! The prefill GEMM of the 4-bit table types against q8_0 (q4_0, IQ4_NL) with tokens in the
//! register lanes, in the per-block order of ggml's repacked `q4_0_8x8` / `iq4_nl_8x8` GEMM
//! (`scalar::vec_dot_block_chain`): per (row, token) the exact integer sum of each 32-value
//! block, then one `acc = fma(isum, dw·da, acc)`.
//!
//! - Activations are rearranged once per band of up to [`BAND`] groups of 16 tokens: for each
//!   group and block, quad `q` (values `4q..4q+4`) of the 16 tokens fills one 64-byte line, so
//!   a register holds the same four values of 16 tokens; beside them each token's
//!   `-128 · Σa` (the lanes' starting value) and its f32 scale.
//! - Weights: a row's block is looked up as unsigned `value + 128` (one `vpshufb`) and four of
//!   its codes, broadcast to all lanes, are `vpdpbusd`'s unsigned operand: eight `vpdpbusd` per
//!   (row, 16 tokens, block), no horizontal sums. The float step per block then takes the
//!   16 tokens of a row at once.
//! - The K dimension is walked in chunks of [`KC`] blocks, each chunk's rearranged activations
//!   staying in L2 while every row passes over them; the accumulators of a (row, group) live in
//!   registers within a chunk and in a per-thread scratch between chunks.
//!
//! Used from 16 tokens on (fewer go through the row-lanes tiles of `iq4`).

#![allow(clippy::needless_range_loop)]

use super::{with_scratch, Pod, IQ4_NL, Q4_0};
use crate::matmul::Gemm;
use crate::quant::QK;
use crate::scalar::KVALUES_IQ4NL;
use core::arch::x86_64::*;

/// Tokens per register.
const LANES: usize = 16;
/// Token groups per band (their activations are prepared once and reused by every row).
const BAND: usize = 8;
/// Blocks per K chunk: a band's activations of one chunk (BAND · KC · 640 bytes) stay in L2.
const KC: usize = 32;
/// Rows × token groups of the register tile.
const R: usize = 4;
const G: usize = 2;

/// One group of 16 tokens at one block, rearranged.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct ActB {
    /// Quad `q`: bytes `4t..4t+4` = token `t`'s values `4q..4q+4`.
    codes: [__m512i; 8],
    /// Lane `t`: `-128 · Σ` of token `t`'s 32 values (removes the weights' +128).
    neg: __m512i,
    /// Lane `t`: token `t`'s f32 block scale.
    d: __m512,
}

// SAFETY: vectors only; alignment 64.
unsafe impl Pod for ActB {}

/// All of `g`'s rows × tokens `t0..t1`.
///
/// # Safety
/// AVX-512 F/BW/VL/DQ + VNNI, AVX2, FMA, F16C; `g` a validated problem with `KIND` (q4_0 or
/// IQ4_NL) weights and q8_0 activations, `t0 < t1 <= g.ntok`, `out.len() == g.ntok * g.nrows`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn gemm<const KIND: u8>(g: &Gemm<'_>, t0: usize, t1: usize, out: &mut [f32]) {
    let nb = g.cols / QK;
    let ngroups = (t1 - t0).div_ceil(LANES);
    let band = BAND.min(ngroups);
    let lut = {
        let v = if KIND == Q4_0 {
            _mm_setr_epi8(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
        } else {
            // SAFETY: 16 readable bytes.
            unsafe { _mm_loadu_si128(KVALUES_IQ4NL.as_ptr().cast()) }
        };
        let u = _mm_xor_si128(v, _mm_set1_epi8(-128));
        _mm256_set_m128i(u, u)
    };
    debug_assert!(KIND == Q4_0 || KIND == IQ4_NL);
    with_scratch(0, band * KC, |acts: &mut [ActB]| {
        with_scratch(1, g.nrows * band, |accs: &mut [__m512]| {
            let mut b0 = 0;
            while b0 < ngroups {
                let b1 = (b0 + band).min(ngroups);
                let nbg = b1 - b0;
                accs[..g.nrows * nbg].fill(_mm512_setzero_ps());
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
                                        micro::<R, G>(g, r, gi, nbg, k0, k1, acts, accs, lut)
                                    }
                                    (true, false) => {
                                        micro::<R, 1>(g, r, gi, nbg, k0, k1, acts, accs, lut)
                                    }
                                    (false, true) => {
                                        for i in r..r + nr {
                                            micro::<1, G>(g, i, gi, nbg, k0, k1, acts, accs, lut)
                                        }
                                    }
                                    (false, false) => {
                                        for i in r..r + nr {
                                            micro::<1, 1>(g, i, gi, nbg, k0, k1, acts, accs, lut)
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
                        // SAFETY: 16 floats.
                        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), accs[row * nbg + gi]) };
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

/// Block `k` of the q8_0 activations of tokens `ts..ts + n` (`n <= L`), tokens in lanes: quad
/// `q` (values `4q..4q+4`) of token `t` in `codes[q][t]`, `bias · Σ` of its 32 values in
/// `neg[t]`, its f32 scale in `d[t]`; lanes from `n` on zero. The rearranging step of this
/// GEMM and of its AVX2 twin (`nl_lanes2`), once per band and block.
pub(super) fn gather<const L: usize>(
    g: &Gemm<'_>,
    ts: usize,
    n: usize,
    k: usize,
    bias: i32,
) -> ([[u32; L]; 8], [i32; L], [f32; L]) {
    let nb = g.cols / QK;
    // q4_0's activations: q8_0 blocks.
    let (abs, aoff) = super::legacy_act(Q4_0);
    let mut codes = [[0u32; L]; 8];
    let mut neg = [0i32; L];
    let mut d = [0f32; L];
    for t in 0..n {
        let at = (ts + t) * g.a_stride + k * abs + aoff;
        let mut s = 0i32;
        for (c, w) in codes.iter_mut().zip(g.a[at..at + 32].chunks_exact(4)) {
            c[t] = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
            s += w.iter().map(|&b| b as i8 as i32).sum::<i32>();
        }
        neg[t] = bias * s;
        d[t] = g.a_scales[(ts + t) * nb + k];
    }
    (codes, neg, d)
}

/// Rearranges blocks `k0..k1` of groups `b0..b1` (tokens from `t0`, up to `t1`) into
/// `acts[(gi - b0) · KC + (k - k0)]`; lanes past `t1` are zero.
///
/// # Safety
/// As [`gemm`]; `acts.len() >= (b1 - b0) · KC`, `k1 - k0 <= KC`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
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
            let (codes, neg, d) = gather::<LANES>(g, ts, n, k, -128);
            let blk = &mut acts[(gi - b0) * KC + (k - k0)];
            // SAFETY: each array is 64 bytes.
            unsafe {
                for (o, c) in blk.codes.iter_mut().zip(&codes) {
                    *o = _mm512_loadu_si512(c.as_ptr().cast());
                }
                blk.neg = _mm512_loadu_si512(neg.as_ptr().cast());
                blk.d = _mm512_loadu_ps(d.as_ptr());
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
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn micro<const RR: usize, const GG: usize>(
    g: &Gemm<'_>,
    r: usize,
    gi: usize,
    nbg: usize,
    k0: usize,
    k1: usize,
    acts: &[ActB],
    accs: &mut [__m512],
    lut: __m256i,
) {
    // SAFETY (whole body): as the contract.
    unsafe {
        let mut acc: [[__m512; GG]; RR] =
            core::array::from_fn(|i| core::array::from_fn(|k| accs[(r + i) * nbg + gi + k]));
        let rows: [*const u8; RR] =
            core::array::from_fn(|i| g.w.as_ptr().add((r + i) * g.w_stride));
        let mut vals = [[0u32; 8]; RR];
        for b in k0..k1 {
            let mut dw = [_mm512_setzero_ps(); RR];
            for i in 0..RR {
                let p = rows[i].add(b * 18);
                let q = _mm_loadu_si128(p.add(2).cast());
                let both = _mm256_set_m128i(_mm_srli_epi16::<4>(q), q);
                let v = _mm256_shuffle_epi8(lut, _mm256_and_si256(both, _mm256_set1_epi8(0x0F)));
                _mm256_storeu_si256(vals[i].as_mut_ptr().cast(), v);
                dw[i] = _mm512_cvtph_ps(_mm256_set1_epi16(p.cast::<i16>().read_unaligned()));
            }
            let a: [&ActB; GG] = core::array::from_fn(|k| &acts[(gi + k) * KC + (b - k0)]);
            let mut raw: [[__m512i; GG]; RR] =
                core::array::from_fn(|_| core::array::from_fn(|k| a[k].neg));
            for q in 0..8 {
                let c: [__m512i; GG] = core::array::from_fn(|k| a[k].codes[q]);
                for i in 0..RR {
                    let wv = _mm512_set1_epi32(vals[i][q] as i32);
                    for k in 0..GG {
                        raw[i][k] = _mm512_dpbusd_epi32(raw[i][k], wv, c[k]);
                    }
                }
            }
            for i in 0..RR {
                for k in 0..GG {
                    acc[i][k] = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(raw[i][k]),
                        _mm512_mul_ps(dw[i], a[k].d),
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
