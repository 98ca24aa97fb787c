//! The prefill GEMM of the k-quants (q2_K, q3_K, q4_K, q5_K, q6_K), IQ4_XS and the IQ grid types
//! with tokens in the register lanes, as
//! llama.cpp's `ggml-cpu/tiled` VNNI kernel shapes it: one `vpdpbusd` per 64 multiply-adds,
//! each weight super-block unpacked once per panel and token band, no horizontal reductions.
//!
//! - Activations (q8_K) are rearranged once per token band: for each group of 16 tokens and
//!   each super-block, quad `q` (values `4q..4q+4`) of the 16 tokens fills one 64-byte line,
//!   so a register holds the same four values of 16 tokens. The per-sub-block sums the
//!   k-quants need (q4_K/q5_K and the 32-value IQ types: `bsums[2j] + bsums[2j+1]`; q6_K,
//!   q3_K, q2_K, IQ2_XS, IQ2_S, IQ1_M: `bsums[j]`) sit beside
//!   them as i16 pairs, and the 16 scales as f32.
//! - Weights: four codes of one row, broadcast to all lanes, are the unsigned operand. A
//!   sub-block's 16 raw sums are scaled by one `vpmulld`; the mins (q4_K/q5_K) and the codes'
//!   offset (q6_K 32, the IQ types 128: their values looked up as `value + 128`) come from the
//!   i16 pairs by `vpdpwssd`. The [`folded`] kinds (q2_K, q3_K, IQ1_S) carry each sub-block's
//!   scale in their codes: no `vpmulld`, q3_K's and IQ1_S's offset out through each token's
//!   sum ([`ActBlock::asum_off`]), IQ1_S's `sc · δ` through the pairs. (Weights as the signed operand, broadcast from memory into each
//!   `vpdpbusd` and the activations biased instead, measured slower: a broadcast register
//!   serves the G token groups, a memory operand is loaded again for each.)
//! - The float steps are the scalar reference's, per (row, token): [`KOrder::Sb256`],
//!   [`KOrder::Sb64`] / [`KOrder::Sb128`] (one step per 64 / 128 values) or [`KOrder::Tiled`]. All integer sums are
//!   exact, so every output equals `scalar::matmul`'s bit for bit.
//!
//! Used from 16 tokens on, where every token's order is one of those four ([`KOrder::Lanes8`],
//! the `vec_dot` order of q6_K, q3_K and the IQ types, applies only below 8 tokens).

#![allow(clippy::needless_range_loop)]

use super::{k4_scales_mins, k_block_bytes, with_scratch, Pod, IQ1_M, IQ1_S, IQ2_S, IQ2_XS};
use super::{IQ2_XXS, IQ3_S, IQ3_XXS, IQ4_XS};
use super::{Q2_K, Q3_K, Q6_K};
use crate::matmul::Gemm;
use crate::quant::{Q8_K_BYTES, QK_K};
use crate::scalar::KOrder;
use core::arch::x86_64::*;

/// Tokens per register.
const LANES: usize = 16;
/// Token groups per band: the band's rearranged activations are reused by every row panel, and
/// each weight super-block is unpacked once per band. 32 groups (512 tokens, 8.4 MB of
/// rearranged activations at K = 14336) took the IQ types and q6_K 1.07-1.10x faster than 8
/// (Intel Xeon, session 27; each panel streams the band from L2/L3 while its 64 rows x 512
/// tokens of products take ~2 ms). On an AMD EPYC Zen 4 (session 28, 1 MB of L2; both
/// alternated in one process, 4096 x 14336, 512 tokens) 8 groups were the faster for the
/// k-quants and IQ4_XS (q2_K 1.18x, q3_K 1.13x, q4_K 1.07-1.22x, q5_K 1.11x, q6_K 1.05-1.10x
/// with one short round at 0.82x, IQ4_XS 1.16x) and level for the grid types (0.87-1.08x,
/// inside that host's noise), so AMD takes 8. On an AMD EPYC Zen 5 (session 30, 1 MB of L2;
/// alternated, three rounds, 2 threads) 32 groups ran the grid types faster (IQ1_S 1.18x,
/// IQ3_S 1.18x, IQ2_XS 1.14x, IQ2_S 1.06-1.10x, IQ2_XXS 1.05-1.08x, IQ3_XXS 1.04-1.08x, IQ1_M
/// 0.98-1.04x) and the others mostly slower (q2_K 0.92-0.95x, q4_K 0.92-0.99x, q5_K
/// 0.90-0.96x, IQ4_XS 0.94-0.97x; q6_K 1.04x and q3_K 1.08x in one set of rounds only), so
/// there the grid kinds take 32.
fn band_groups<const KIND: u8>() -> usize {
    #[cfg(test)]
    match FORCE_BAND.load(std::sync::atomic::Ordering::Relaxed) {
        0 => {}
        forced => return forced,
    }
    if super::is_amd() && !(is_grid(KIND) && super::is_amd_zen5_or_later()) {
        8
    } else {
        32
    }
}
/// Weight rows per panel: one super-block of them is unpacked at a time and stays in L1 while
/// every group of the band passes over it.
const PANEL: usize = 16 * R;
/// Super-blocks ahead that [`unpack_panel`] prefetches.
const PREFETCH: usize = 2;
/// Rows of the register tile; its token groups are [`gemm`]'s `G`: 3 on Intel, 2 on AMD. On an
/// AMD EPYC (Zen 4, whose 512-bit operations are double-pumped) 4 × 2 ran q6_K 0.99-1.05×
/// llama.cpp's tiled matmul and 6 × 2 0.87× (4 × 3, 3 × 3, 8 × 1 and 2 × 4 in between); on an
/// Intel Xeon (session 27, with each order's loops unrolled) 4 × 3 beat 4 × 2 and 6 × 2: twelve
/// accumulators keep both `vpdpbusd` ports busy past its latency.
const R: usize = 4;

/// One group of 16 tokens at one super-block, rearranged.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct ActBlock {
    /// Quad `q`: bytes `4t..4t+4` = token `t`'s values `4q..4q+4`.
    codes: [__m512i; 64],
    /// Pair `p`: lane `t` = token `t`'s sub-block sums `2p` and `2p + 1` as two i16 (q4_K /
    /// q5_K, IQ4_XS and the 32-value IQ grid types: 4 pairs over 32-value sub-blocks; the
    /// [`sub16`] kinds: 8 pairs over 16-value sub-blocks).
    pairs: [__m512i; 8],
    /// Lane `t` = token `t`'s q8_K scale.
    d: __m512,
    /// q3_K and IQ1_S: lane `t` = the sum of token `t`'s 256 values times the offset of the
    /// [`folded`] codes (q3_K 127, IQ1_S 128).
    asum_off: __m512i,
}

// SAFETY: vectors only; alignment 64.
unsafe impl Pod for ActBlock {}

/// One weight row's super-block, unpacked: codes in value order and the row's scales.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(super) struct WRow {
    /// After [`fold`], a [`folded`] kind's codes carry their sub-block's scale.
    pub(super) codes: [u8; QK_K],
    /// Sub-block scales (q4_K/q5_K: 8, 6-bit; q6_K, q3_K: 16, signed; q2_K: 16, 4-bit; IQ4_XS
    /// and the 32-value IQ grid types: 8, signed; IQ2_XS, IQ2_S, IQ1_M: 16, positive).
    pub(super) sc: [i32; 16],
    /// i16 pairs for `vpdpwssd`: q4_K/q5_K (4) and q2_K (8) the mins `(m[2p], m[2p+1])`; q6_K
    /// (8) and the IQ types (4, or 8 for the 16-value ones) the scales `(sc[2p], sc[2p+1])`,
    /// which remove the codes' offset; after [`fold`], IQ1_S's first 4 the `sc · δ` of its
    /// sub-blocks (q3_K's are unused then).
    pub(super) pairs: [i32; 8],
    pub(super) d: f32,
    pub(super) dmin: f32,
}

// SAFETY: plain integers and floats; alignment 64.
unsafe impl Pod for WRow {}

/// The IQ grid kinds (`super::iq2`).
const fn is_grid(kind: u8) -> bool {
    matches!(
        kind,
        IQ2_XXS | IQ2_XS | IQ2_S | IQ3_XXS | IQ3_S | IQ1_S | IQ1_M
    )
}

/// The kinds whose sub-blocks are 16 values (16 scales, block sums taken as they are).
const fn sub16(kind: u8) -> bool {
    matches!(kind, Q6_K | Q3_K | Q2_K) || super::iq2::scales16(kind)
}

/// The kinds whose unpacked codes carry their sub-block's scale (`v · sc` fits a byte), so the
/// micro-kernel needs no multiply per sub-block: q2_K (`v · sc` in 0..=45), q3_K (`v · sc +
/// 127` in 3..=255, the offset removed from the token's sum) and IQ1_S (values `8g + δ`, `δ =
/// ±1` per 32-value sub-block: `g · sc + 128` with `sc` in 1..=15; the `sc · δ` part from the
/// block sums, as [`fold`] leaves it in the row's pairs).
const fn folded(kind: u8) -> bool {
    matches!(kind, Q2_K | Q3_K | IQ1_S)
}

/// Whether [`gemm`] computes this order.
pub(super) fn handles(order: KOrder) -> bool {
    matches!(
        order,
        KOrder::Sb256 | KOrder::Sb128 | KOrder::Sb64 | KOrder::Tiled
    )
}

/// From 16 tokens: the batch through [`gemm`] in its first token's order. Where that order
/// changes for the last `ntok % 4` tokens (q4_K's and q2_K's parity orders: the repacked GEMM
/// for whole groups of four, the GEMV's for the rest), those 1–3 tokens go through `rest` as
/// a problem of their own (the lanes GEMM would spend a 16-token group on them); `k_order`
/// gives each of them the GEMV's order there too, as in the whole batch.
///
/// # Safety
/// As [`gemm`] for all of `g`'s tokens, `g.ntok >= 16`; `rest` may be called with any
/// sub-problem of `g` (the caller's own entry point).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn gemm_then_rest<const KIND: u8>(
    g: &Gemm<'_>,
    out: &mut [f32],
    rest: unsafe fn(&Gemm<'_>, &mut [f32]),
) {
    let first = crate::scalar::token_order(g, 0);
    let split = if first == crate::scalar::token_order(g, g.ntok - 1) {
        g.ntok
    } else {
        g.ntok / 4 * 4
    };
    debug_assert!(handles(first));
    // SAFETY: as this function's contract; every token of 0..split sums in `first`.
    unsafe { gemm::<KIND>(g, 0, split, first, out) };
    if split < g.ntok {
        let tail = Gemm {
            a: &g.a[split * g.a_stride..],
            ntok: g.ntok - split,
            a_scales: &[],
            ..*g
        };
        // SAFETY: as this function's contract, for the tail's tokens and output rows.
        unsafe { rest(&tail, &mut out[split * g.nrows..]) };
    }
}

/// The `lanes8_then_tiled` types' entry from 16 tokens: when the batch sums in the tiled order
/// (then every token does: Parity from 8 tokens, Invariant always), all of it through [`gemm`]
/// and `true`; else nothing and `false` (the caller's tiles take it).
///
/// # Safety
/// As [`gemm`] for all of `g`'s tokens.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn tiled_batch<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) -> bool {
    if g.ntok < 16 || crate::scalar::token_order(g, 0) != KOrder::Tiled {
        return false;
    }
    debug_assert!((0..g.ntok).all(|t| crate::scalar::token_order(g, t) == KOrder::Tiled));
    // SAFETY: as this function's contract; every token sums in the tiled order.
    unsafe { gemm::<KIND>(g, 0, g.ntok, KOrder::Tiled, out) };
    true
}

/// Tokens `t0..t1` of `g`, which all sum in `order` (one [`handles`] accepts), for every row.
///
/// # Safety
/// AVX-512 F/BW/VL/DQ + VNNI; `g` a validated k-quant problem of kind `KIND`, `t0 < t1 <=
/// g.ntok`, `out.len() == g.ntok * g.nrows`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn gemm<const KIND: u8>(
    g: &Gemm<'_>,
    t0: usize,
    t1: usize,
    order: KOrder,
    out: &mut [f32],
) {
    #[cfg(test)]
    let forced = FORCE_G.load(std::sync::atomic::Ordering::Relaxed);
    #[cfg(not(test))]
    let forced = 0;
    // SAFETY: as this function's contract.
    unsafe {
        if forced == 2 || (forced == 0 && super::is_amd()) {
            gemm_g::<KIND, 2>(g, t0, t1, order, out)
        } else {
            gemm_g::<KIND, 3>(g, t0, t1, order, out)
        }
    }
}

/// Tests: the token groups of [`gemm`]'s register tile, 2 or 3 (0: by vendor), so that CI on
/// either vendor runs both tiles. Every tile gives the same bits, so tests running meanwhile
/// are unaffected.
#[cfg(test)]
pub(crate) static FORCE_G: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Tests: the token groups of a band (0: [`band_groups`]'s by vendor), so that either vendor's
/// CI runs both. Same bits at any band, as for [`FORCE_G`].
#[cfg(test)]
pub(crate) static FORCE_BAND: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(0);

/// [`gemm`] with a register tile of [`R`] rows × `G` token groups (2 or 3).
///
/// # Safety
/// As [`gemm`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn gemm_g<const KIND: u8, const G: usize>(
    g: &Gemm<'_>,
    t0: usize,
    t1: usize,
    order: KOrder,
    out: &mut [f32],
) {
    // The (kind, order) pairs `micro` implements: the IQ types and q6_K / q3_K only tiled
    // (their offset comes out there), q2_K never tiled.
    debug_assert!(match KIND {
        Q6_K | Q3_K | IQ4_XS => order == KOrder::Tiled,
        _ if is_grid(KIND) => order == KOrder::Tiled,
        Q2_K => matches!(order, KOrder::Sb256 | KOrder::Sb128),
        _ => matches!(order, KOrder::Sb256 | KOrder::Sb64 | KOrder::Tiled),
    });
    let nsb = g.cols / QK_K;
    let ngroups = (t1 - t0).div_ceil(LANES);
    let band = band_groups::<KIND>().min(ngroups);
    let panel = PANEL.min(g.nrows.div_ceil(R) * R);
    with_scratch(0, band * nsb, |acts: &mut [ActBlock]| {
        with_scratch(1, panel, |wrows: &mut [WRow]| {
            let mut accs = vec![_mm512_setzero_ps(); 2 * panel * band];
            let mut b0 = 0;
            while b0 < ngroups {
                let b1 = (b0 + band).min(ngroups);
                // SAFETY: as this function's contract; `acts` holds `band · nsb` blocks.
                unsafe { prep_band::<KIND>(g, t0, t1, b0, b1, acts) };
                let mut r0 = 0;
                while r0 < g.nrows {
                    let np = panel.min(g.nrows - r0);
                    accs.fill(_mm512_setzero_ps());
                    for sb in 0..nsb {
                        // SAFETY: rows r0..r0+np and super-block sb lie in `g.w`.
                        unsafe { unpack_panel::<KIND>(g, r0, np, sb, wrows) };
                        let mut gi = b0;
                        while gi < b1 {
                            let ng = (b1 - gi).min(G);
                            let mut r = 0;
                            while r < np.div_ceil(R) * R {
                                let ab = |k: usize| &acts[(gi - b0 + k) * nsb + sb];
                                let w: [&WRow; R] =
                                    core::array::from_fn(|i| &wrows[(r + i).min(np - 1)]);
                                let base = (r * band + (gi - b0)) * 2;
                                let p = accs.as_mut_ptr();
                                // SAFETY: the tile's accumulators lie in `accs` (rows r..r+R of
                                // the panel, groups gi..gi+ng of the band).
                                unsafe {
                                    match ng {
                                        3 => {
                                            let a: [&ActBlock; 3] = core::array::from_fn(ab);
                                            micro_in::<KIND, 3>(&w, &a, order, p, band, base)
                                        }
                                        2 => {
                                            let a: [&ActBlock; 2] = core::array::from_fn(ab);
                                            micro_in::<KIND, 2>(&w, &a, order, p, band, base)
                                        }
                                        // The band's last group (G = 2 or 3).
                                        _ => {
                                            micro_in::<KIND, 1>(&w, &[ab(0)], order, p, band, base)
                                        }
                                    }
                                };
                                r += R;
                            }
                            gi += ng;
                        }
                    }
                    // Out: token-major, one token's `np` rows at a time.
                    let mut lanes = [[0f32; LANES]; PANEL];
                    for gi in b0..b1 {
                        for i in 0..np {
                            let k = (i * band + (gi - b0)) * 2;
                            let v = if order == KOrder::Tiled {
                                accs[k]
                            } else {
                                _mm512_sub_ps(accs[k], accs[k + 1])
                            };
                            // SAFETY: 16 floats.
                            unsafe { _mm512_storeu_ps(lanes[i].as_mut_ptr(), v) };
                        }
                        let ts = t0 + gi * LANES;
                        for l in 0..(t1 - ts).min(LANES) {
                            let o = &mut out[(ts + l) * g.nrows + r0..][..np];
                            for (i, x) in o.iter_mut().enumerate() {
                                *x = lanes[i][l];
                            }
                        }
                    }
                    r0 += np;
                }
                b0 = b1;
            }
        })
    });
}

/// Rearranges groups `b0..b1` (of tokens from `t0`, up to `t1`) into `acts[(gi - b0) · nsb +
/// sb]`; lanes past `t1` are zero.
///
/// # Safety
/// As [`gemm`]; `acts.len() >= (b1 - b0) · nsb`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn prep_band<const KIND: u8>(
    g: &Gemm<'_>,
    t0: usize,
    t1: usize,
    b0: usize,
    b1: usize,
    acts: &mut [ActBlock],
) {
    let nsb = g.cols / QK_K;
    // 16-value sub-blocks take their block sums as they are.
    let sub16 = sub16(KIND);
    for gi in b0..b1 {
        let ts = t0 + gi * LANES;
        let n = (t1 - ts).min(LANES);
        for sb in 0..nsb {
            let blk = &mut acts[(gi - b0) * nsb + sb];
            let mut codes = [[0u32; LANES]; 64];
            let mut pairs = [[0u32; LANES]; 8];
            let mut d = [0f32; LANES];
            let mut asum_off = [0i32; LANES];
            for t in 0..n {
                // SAFETY: token ts + t < t1 <= ntok, super-block sb < nsb: Q8_K_BYTES.
                let p = unsafe { g.a.as_ptr().add((ts + t) * g.a_stride + sb * Q8_K_BYTES) };
                // SAFETY: q8_K: f32 d at 0, 256 codes at 4, 16 i16 bsums at 260.
                let (dt, q, bs) = unsafe {
                    (
                        p.cast::<f32>().read_unaligned(),
                        p.add(4).cast::<[u32; 64]>().read_unaligned(),
                        p.add(4 + QK_K).cast::<[i16; 16]>().read_unaligned(),
                    )
                };
                d[t] = dt;
                if matches!(KIND, Q3_K | IQ1_S) {
                    let off = if KIND == Q3_K { 127 } else { 128 };
                    asum_off[t] = off * bs.iter().map(|&b| b as i32).sum::<i32>();
                }
                for (c, v) in codes.iter_mut().zip(q) {
                    c[t] = v;
                }
                let pair = |a: i16, b: i16| (a as u16 as u32) | ((b as u16 as u32) << 16);
                if sub16 {
                    for p in 0..8 {
                        pairs[p][t] = pair(bs[2 * p], bs[2 * p + 1]);
                    }
                } else {
                    // |bsums| <= 16 · 127, so a 32-value sum fits in i16.
                    let s = |j: usize| bs[2 * j] + bs[2 * j + 1];
                    for p in 0..4 {
                        pairs[p][t] = pair(s(2 * p), s(2 * p + 1));
                    }
                }
            }
            // SAFETY: each array is 64 bytes.
            unsafe {
                for (o, c) in blk.codes.iter_mut().zip(&codes) {
                    *o = _mm512_loadu_si512(c.as_ptr().cast());
                }
                for (o, c) in blk.pairs.iter_mut().zip(&pairs) {
                    *o = _mm512_loadu_si512(c.as_ptr().cast());
                }
                blk.d = _mm512_loadu_ps(d.as_ptr());
                blk.asum_off = _mm512_loadu_si512(asum_off.as_ptr().cast());
            }
        }
    }
}

/// Unpacks super-block `sb` of rows `r0..r0 + np` into `wrows[0..np]`.
///
/// # Safety
/// As [`gemm`]; `r0 + np <= g.nrows`, `sb < nsb`, `wrows.len() >= np`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn unpack_panel<const KIND: u8>(
    g: &Gemm<'_>,
    r0: usize,
    np: usize,
    sb: usize,
    wrows: &mut [WRow],
) {
    let wbs = k_block_bytes(KIND);
    // The panel's rows are `w_stride` apart, more streams than the hardware prefetcher follows:
    // each row's super-block `PREFETCH` ahead is fetched here, while this one is unpacked.
    let ahead = sb + PREFETCH < g.cols / QK_K;
    for (i, wr) in wrows[..np].iter_mut().enumerate() {
        // SAFETY: row r0 + i < nrows, super-block sb: `wbs` bytes; the closure writes 256 bytes;
        // the prefetched super-block sb + PREFETCH < nsb lies in the same row.
        unsafe {
            let p = g.w.as_ptr().add((r0 + i) * g.w_stride + sb * wbs);
            if ahead {
                let q = p.add(PREFETCH * wbs);
                for off in (0..wbs).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(q.add(off).cast());
                }
                _mm_prefetch::<_MM_HINT_T0>(q.add(wbs - 1).cast());
            }
            unpack_row::<KIND>(p, wr, |codes| {
                let kb = super::avx512q::unpack_k::<KIND>(p);
                for c in 0..4 {
                    _mm512_storeu_si512(codes.as_mut_ptr().add(64 * c).cast(), kb.u[c]);
                }
            });
            if folded(KIND) {
                fold::<KIND>(wr);
            }
        }
    }
}

/// A [`folded`] kind's codes times their sub-block's scale: q2_K `code · sc` (codes 0..=3,
/// scales 0..=15), q3_K `(code - 4) · sc + 127` (codes 0..=7, scales -32..=31), IQ1_S (codes
/// `8g + δ + 128`, g in -1..=1, one δ = ±1 per 32-value sub-block, scales 1..=15) `g · sc +
/// 128`, with each sub-block's `sc · δ` into the row's first four pairs.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
fn fold<const KIND: u8>(wr: &mut WRow) {
    if KIND == IQ1_S {
        let pair = |a: i32, b: i32| (a as i16 as u16 as i32) | ((b as i16 as u16 as i32) << 16);
        let mut scd = [0i32; 8];
        for (j, x) in scd.iter_mut().enumerate() {
            // Codes `8g + δ + 128`, g in -1..=1; (v + 4) >> 3 = g for δ = ±1. The sub-block's
            // δ from its first value.
            let v0 = wr.codes[32 * j] as i32 - 128;
            *x = wr.sc[j] * (v0 - 8 * ((v0 + 4) >> 3));
            // SAFETY: bytes 32j..32j + 32 of the 256 codes.
            let b = unsafe { _mm256_loadu_si256(wr.codes.as_ptr().add(32 * j).cast()) };
            let v = _mm512_sub_epi16(_mm512_cvtepu8_epi16(b), _mm512_set1_epi16(128 - 4));
            let gv = _mm512_srai_epi16::<3>(v);
            let sc = _mm512_set1_epi16(wr.sc[j] as i16);
            let p = _mm512_add_epi16(_mm512_mullo_epi16(gv, sc), _mm512_set1_epi16(128));
            // SAFETY: as the load.
            unsafe {
                _mm256_storeu_si256(
                    wr.codes.as_mut_ptr().add(32 * j).cast(),
                    _mm512_cvtepi16_epi8(p),
                )
            };
        }
        for q in 0..4 {
            wr.pairs[q] = pair(scd[2 * q], scd[2 * q + 1]);
        }
        return;
    }
    let (off, bias) = if KIND == Q3_K { (4, 127) } else { (0, 0) };
    for c in 0..8 {
        // Two 16-value sub-blocks: 32 codes widened to i16 against their two scales.
        // SAFETY: bytes 32c..32c + 32 of the 256 codes.
        let b = unsafe { _mm256_loadu_si256(wr.codes.as_ptr().add(32 * c).cast()) };
        let v = _mm512_sub_epi16(_mm512_cvtepu8_epi16(b), _mm512_set1_epi16(off));
        let sc = _mm512_inserti64x4::<1>(
            _mm512_set1_epi16(wr.sc[2 * c] as i16),
            _mm256_set1_epi16(wr.sc[2 * c + 1] as i16),
        );
        let p = _mm512_add_epi16(_mm512_mullo_epi16(v, sc), _mm512_set1_epi16(bias));
        // SAFETY: as the load.
        unsafe {
            _mm256_storeu_si256(
                wr.codes.as_mut_ptr().add(32 * c).cast(),
                _mm512_cvtepi16_epi8(p),
            )
        };
    }
}

/// One row's super-block at `p` into `wr`: the codes of q4_K, q5_K and q6_K by `kcodes` (each
/// ISA's unpacker, in value order), every other kind's by the AVX2 unpackers; then the scales,
/// pairs, `d` and `dmin`. Inlined into a caller with at least AVX2, FMA and F16C.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `p` is readable for one super-block of `KIND`.
#[inline(always)]
pub(super) unsafe fn unpack_row<const KIND: u8>(
    p: *const u8,
    wr: &mut WRow,
    kcodes: impl FnOnce(&mut [u8; QK_K]),
) {
    let pair = |a: i32, b: i32| (a as i16 as u16 as i32) | ((b as i16 as u16 as i32) << 16);
    // SAFETY: 2 readable bytes at `q`.
    let f16_at =
        |q: *const u8| unsafe { half::f16::from_bits(q.cast::<u16>().read_unaligned()).to_f32() };
    let store = |wr: &mut WRow, u: &[__m256i; 8]| {
        for (c, v) in u.iter().enumerate() {
            // SAFETY: 32 bytes of `codes` at 32c; the caller has AVX2.
            unsafe { _mm256_storeu_si256(wr.codes.as_mut_ptr().add(32 * c).cast(), *v) };
        }
    };
    // SAFETY (whole body): reads within the super-block at `p`; the AVX2 unpackers need the
    // features the caller has.
    unsafe {
        // q6_K and q3_K: 16 signed scales, whose i16 pairs remove the codes' offset.
        let signed: [i8; 16];
        if KIND == Q2_K {
            store(wr, &super::q2k::codes(p));
            // The 16 scale bytes at 0.
            let sb = p.cast::<[u8; 16]>().read();
            for j in 0..16 {
                wr.sc[j] = (sb[j] & 0xF) as i32;
            }
            for q in 0..8 {
                wr.pairs[q] = pair((sb[2 * q] >> 4) as i32, (sb[2 * q + 1] >> 4) as i32);
            }
            // The f16 scale and min at 80, 82.
            wr.d = f16_at(p.add(80));
            wr.dmin = f16_at(p.add(82));
            return;
        } else if is_grid(KIND) {
            let (codes, sc) = super::iq2::unpack::<KIND>(p);
            store(wr, &codes);
            wr.sc = sc;
            for q in 0..8 {
                wr.pairs[q] = pair(wr.sc[2 * q], wr.sc[2 * q + 1]);
            }
            // ggml's tiled matmul folds 1/8 (IQ3_XXS 1/4, IQ3_S 1) into the f16 scale.
            wr.d = super::iq2::d_of::<KIND>(p) * super::iq2::geometry(KIND).1;
            wr.dmin = 0.0;
            return;
        } else if KIND == IQ4_XS {
            store(wr, &super::iq4::xs_codes_u8(p));
            let x = &*p.cast::<[u8; 136]>();
            for j in 0..8 {
                wr.sc[j] = crate::scalar::iq4xs_scale(x, j) - 32;
            }
            for q in 0..4 {
                wr.pairs[q] = pair(wr.sc[2 * q], wr.sc[2 * q + 1]);
            }
            wr.d = f16_at(p);
            wr.dmin = 0.0;
            return;
        } else if KIND == Q3_K {
            let (u, sc) = super::q3k::unpack(p);
            store(wr, &u);
            // The f16 scale at 108.
            wr.d = f16_at(p.add(108));
            wr.dmin = 0.0;
            signed = sc;
        } else {
            kcodes(&mut wr.codes);
            if KIND != Q6_K {
                // q4_K / q5_K: f16 d and dmin at 0 and 2, the 12 packed scale bytes at 4.
                wr.d = f16_at(p);
                wr.dmin = f16_at(p.add(2));
                let (sc, m) = k4_scales_mins(&*p.add(4).cast::<[u8; 12]>());
                let sc = sc.to_le_bytes();
                let m = m.to_le_bytes();
                for j in 0..8 {
                    wr.sc[j] = sc[j] as i32;
                }
                for q in 0..4 {
                    wr.pairs[q] = pair(m[2 * q] as i32, m[2 * q + 1] as i32);
                }
                return;
            }
            // q6_K: the 16 i8 scales at 192, the f16 d at 208.
            wr.d = f16_at(p.add(208));
            wr.dmin = 0.0;
            signed = p.add(192).cast::<[i8; 16]>().read();
        }
        for j in 0..16 {
            wr.sc[j] = signed[j] as i32;
        }
        for q in 0..8 {
            wr.pairs[q] = pair(signed[2 * q] as i32, signed[2 * q + 1] as i32);
        }
    }
}

/// `Σ_{p < n} pairs_w[p] · pairs_a[p]` per token lane (i16 pairs, exact): a row's mins
/// against the tokens' block sums (q4_K/q5_K `n = 4`, q2_K `n = 8`), the scales against them
/// to remove the codes' offset (q6_K and the 16-value IQ types `n = 8`; the others `n = 4`),
/// or IQ1_S's `sc · δ` against them (`n = 4`, the deltas' part of its sums).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
fn pair_dot(w: &WRow, a: &ActBlock, n: usize) -> __m512i {
    let mut s = _mm512_setzero_si512();
    for p in 0..n {
        s = _mm512_dpwssd_epi32(s, _mm512_set1_epi32(w.pairs[p]), a.pairs[p]);
    }
    s
}

/// `acc[i][k] +=` row `i`'s codes against group `k`'s activations over quads `qs` (four values
/// each): per quad, the row's four codes broadcast, one `vpdpbusd` per group.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
fn dot_quads<const NG: usize>(
    w: &[&WRow; R],
    a: &[&ActBlock; NG],
    qs: core::ops::Range<usize>,
    acc: &mut [[__m512i; NG]; R],
) {
    for q in qs {
        let c: [__m512i; NG] = core::array::from_fn(|k| a[k].codes[q]);
        for i in 0..R {
            // SAFETY: quad q < 64 of the row's 256 codes.
            let wv = unsafe {
                _mm512_set1_epi32(
                    w[i].codes
                        .as_ptr()
                        .add(4 * q)
                        .cast::<i32>()
                        .read_unaligned(),
                )
            };
            for k in 0..NG {
                acc[i][k] = _mm512_dpbusd_epi32(acc[i][k], wv, c[k]);
            }
        }
    }
}

/// [`micro`] for `order`, as a constant so that each order's loops are unrolled.
///
/// # Safety
/// As [`micro`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn micro_in<const KIND: u8, const NG: usize>(
    w: &[&WRow; R],
    a: &[&ActBlock; NG],
    order: KOrder,
    accs: *mut __m512,
    band: usize,
    base: usize,
) {
    // SAFETY: as this function's contract.
    unsafe {
        match order {
            KOrder::Tiled => micro::<KIND, NG, { KOrder::Tiled as u8 }>(w, a, accs, band, base),
            KOrder::Sb256 => micro::<KIND, NG, { KOrder::Sb256 as u8 }>(w, a, accs, band, base),
            KOrder::Sb128 => micro::<KIND, NG, { KOrder::Sb128 as u8 }>(w, a, accs, band, base),
            KOrder::Sb64 => micro::<KIND, NG, { KOrder::Sb64 as u8 }>(w, a, accs, band, base),
            KOrder::Lanes8 => unreachable!("kq_lanes::handles excludes Lanes8"),
        }
    }
}

/// R rows × NG groups (NG = `gemm_g`'s G, or fewer for a band's last groups) at one super-block: the exact
/// integer sums, then each (row, token)'s float step(s) of the order `ORD` (a [`KOrder`] as
/// `u8`) into `accs[base + 2(i·band + k)]` (and `+ 1`, the mins' chain).
///
/// # Safety
/// Features as the module; the accumulators of rows `0..R` and groups `0..NG` from `base` lie
/// in `accs`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn micro<const KIND: u8, const NG: usize, const ORD: u8>(
    w: &[&WRow; R],
    a: &[&ActBlock; NG],
    accs: *mut __m512,
    band: usize,
    base: usize,
) {
    let order = match ORD {
        o if o == KOrder::Sb64 as u8 => KOrder::Sb64,
        o if o == KOrder::Sb128 as u8 => KOrder::Sb128,
        o if o == KOrder::Sb256 as u8 => KOrder::Sb256,
        _ => KOrder::Tiled,
    };
    // q6_K, q3_K, q2_K, IQ2_XS, IQ2_S, IQ1_M: 16-value sub-blocks (q6_K's and q3_K's with
    // signed scales and codes carrying an offset, q2_K's with mins).
    let sub16 = sub16(KIND);
    // Sub-blocks, quads per sub-block, and sub-blocks per float step.
    let (nsub, nq) = if sub16 { (16, 4) } else { (8, 8) };
    let per = match order {
        KOrder::Sb64 => 2,
        KOrder::Sb128 => nsub / 2,
        _ => nsub,
    };
    // Whether the float steps come inside the sub-block loop (per 64 or 128 values).
    let stepped = matches!(order, KOrder::Sb64 | KOrder::Sb128);
    let acc = |i: usize, k: usize| 2 * (i * band + k);
    // SAFETY (whole body): the pointers come from the live `WRow`/`ActBlock` references;
    // accumulator indices as this function's contract.
    unsafe {
        let mut s1 = [[_mm512_setzero_si512(); NG]; R];
        for j0 in (0..nsub).step_by(per) {
            if folded(KIND) {
                // The codes carry their sub-block's scale: one chain over the whole step.
                dot_quads(w, a, j0 * nq..(j0 + per) * nq, &mut s1);
            } else {
                for j in j0..j0 + per {
                    let mut raw = [[_mm512_setzero_si512(); NG]; R];
                    dot_quads(w, a, j * nq..j * nq + nq, &mut raw);
                    for i in 0..R {
                        let sc = _mm512_set1_epi32(w[i].sc[j]);
                        for k in 0..NG {
                            let scaled = _mm512_mullo_epi32(raw[i][k], sc);
                            s1[i][k] = _mm512_add_epi32(s1[i][k], scaled);
                        }
                    }
                }
            }
            if stepped {
                // One step per 64 (q4_K) or 128 (q2_K) values: these sub-blocks' sums and mins
                // (their pairs of mins against the pairs of block sums).
                for i in 0..R {
                    for k in 0..NG {
                        let sv = _mm512_mul_ps(_mm512_set1_ps(w[i].d), a[k].d);
                        let mv = _mm512_mul_ps(_mm512_set1_ps(w[i].dmin), a[k].d);
                        let mut imin = _mm512_setzero_si512();
                        for p in j0 / 2..(j0 + per) / 2 {
                            let m = _mm512_set1_epi32(w[i].pairs[p]);
                            imin = _mm512_dpwssd_epi32(imin, m, a[k].pairs[p]);
                        }
                        let x = accs.add(base + acc(i, k));
                        *x = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1[i][k]), sv, *x);
                        let y = x.add(1);
                        *y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(imin), mv, *y);
                        s1[i][k] = _mm512_setzero_si512();
                    }
                }
            }
        }
        match order {
            KOrder::Sb64 | KOrder::Sb128 => {}
            KOrder::Tiled if KIND == IQ1_S => {
                // Folded codes `g · sc + 128` of values `8g + δ`: 8 · (the sums less 128 · the
                // token's sum) plus each sub-block's `sc · δ` against its block sums.
                for i in 0..R {
                    for k in 0..NG {
                        let grid =
                            _mm512_slli_epi32::<3>(_mm512_sub_epi32(s1[i][k], a[k].asum_off));
                        let isum = _mm512_add_epi32(grid, pair_dot(w[i], a[k], 4));
                        let res = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(w[i].d));
                        let x = accs.add(base + acc(i, k));
                        *x = _mm512_fmadd_ps(res, a[k].d, *x);
                    }
                }
            }
            KOrder::Tiled if KIND == IQ4_XS || is_grid(KIND) => {
                // Codes carry +128: remove 128 · Σ_j sc_j · (the sub-blocks' sums).
                for i in 0..R {
                    for k in 0..NG {
                        let n = if sub16 { 8 } else { 4 };
                        let corr = _mm512_slli_epi32::<7>(pair_dot(w[i], a[k], n));
                        let isum = _mm512_sub_epi32(s1[i][k], corr);
                        let res = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(w[i].d));
                        let x = accs.add(base + acc(i, k));
                        *x = _mm512_fmadd_ps(res, a[k].d, *x);
                    }
                }
            }
            KOrder::Tiled if !sub16 => {
                // q4_K / q5_K: fnmadd(dmin, imin, isum · d), then one FMA with da.
                for i in 0..R {
                    for k in 0..NG {
                        let imin = pair_dot(w[i], a[k], 4);
                        let res =
                            _mm512_mul_ps(_mm512_cvtepi32_ps(s1[i][k]), _mm512_set1_ps(w[i].d));
                        let res = _mm512_fnmadd_ps(
                            _mm512_set1_ps(w[i].dmin),
                            _mm512_cvtepi32_ps(imin),
                            res,
                        );
                        let x = accs.add(base + acc(i, k));
                        *x = _mm512_fmadd_ps(res, a[k].d, *x);
                    }
                }
            }
            KOrder::Tiled => {
                // q6_K: codes carry +32; remove 32 · Σ_j sc_j · bsums_j. q3_K (folded): codes
                // `v · sc + 127`; remove 127 · the token's sum.
                for i in 0..R {
                    for k in 0..NG {
                        let corr = if KIND == Q3_K {
                            a[k].asum_off
                        } else {
                            _mm512_slli_epi32::<5>(pair_dot(w[i], a[k], 8))
                        };
                        let isum = _mm512_sub_epi32(s1[i][k], corr);
                        let res = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(w[i].d));
                        let x = accs.add(base + acc(i, k));
                        *x = _mm512_fmadd_ps(res, a[k].d, *x);
                    }
                }
            }
            _ => {
                // Sb256: the super-block's sums and mins, one FMA each.
                for i in 0..R {
                    for k in 0..NG {
                        let imin = pair_dot(w[i], a[k], if sub16 { 8 } else { 4 });
                        let sv = _mm512_mul_ps(_mm512_set1_ps(w[i].d), a[k].d);
                        let mv = _mm512_mul_ps(_mm512_set1_ps(w[i].dmin), a[k].d);
                        let x = accs.add(base + acc(i, k));
                        *x = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1[i][k]), sv, *x);
                        let y = x.add(1);
                        *y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(imin), mv, *y);
                    }
                }
            }
        }
    }
}
