//! The prefill GEMM of q2_K, q3_K, q4_K, q5_K and q6_K on AVX2 with tokens in the register
//! lanes: [`super::kq_lanes`] (the AVX-512 VNNI kernel) with eight tokens per register and no
//! `vpdpbusd`.
//!
//! - Activations (q8_K) are rearranged once per band of token groups: quad `q` (values
//!   `4q..4q+4`) of 8 tokens fills one 32-byte register, the sub-block sums beside them as i16
//!   pairs, the scales as f32.
//! - Four codes of one row, broadcast, are the unsigned operand of `vpmaddubsw`; its i16 pair
//!   sums are added up over as many quads as cannot overflow (q4_K a whole 32-value sub-block,
//!   q5_K half of one, q6_K 8 values, q3_K / q2_K a 16-value sub-block), then scaled and widened
//!   by one `vpmaddwd` with the sub-block's scale. That is one multiply per 32 multiply-adds
//!   plus one per chunk, where `vec_dot` and llama.cpp's AVX2 tiled kernel spend two.
//! - The float steps, per (row, token), are the scalar reference's ([`KOrder::Sb256`],
//!   [`KOrder::Sb128`], [`KOrder::Sb64`], [`KOrder::Tiled`]), as in the AVX-512 kernel; every
//!   integer sum is exact, so every output equals `scalar::matmul`'s bit for bit.
//!
//! The IQ types stay on their tiles: their codes as `value + 128` would saturate `vpmaddubsw`.

#![allow(clippy::needless_range_loop)]

use super::kq_lanes::{unpack_row, WRow};
use super::{k_block_bytes, with_scratch, Pod, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K};
use crate::matmul::Gemm;
use crate::quant::{Q8_K_BYTES, QK_K};
use crate::scalar::KOrder;
use core::arch::x86_64::*;

/// Tokens per register.
const LANES: usize = 8;
/// Token groups per band: the band's rearranged activations are reused by every row panel.
const BAND_GROUPS: usize = 16;
/// Rows × token groups of the register tile (AMD Zen 3: 3 × 2 and 4 × 2 within noise, 3 × 2
/// ahead on q4_K and q6_K).
const R: usize = 3;
const G: usize = 2;
/// Weight rows per panel: one super-block of them is unpacked at a time and stays in L1 while
/// every group of the band passes over it.
const PANEL: usize = 16 * R;

/// From this many tokens on, `run_k` and the q2_K / q3_K entries take this GEMM.
pub(super) const MIN_TOKENS: usize = 16;

/// One group of 8 tokens at one super-block, rearranged.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct ActBlock {
    /// Quad `q`: bytes `4t..4t+4` = token `t`'s values `4q..4q+4`.
    codes: [__m256i; 64],
    /// Pair `p`: lane `t` = token `t`'s sub-block sums `2p` and `2p + 1` as two i16 (q4_K /
    /// q5_K: 4 pairs over 32-value sub-blocks; q6_K, q3_K, q2_K: 8 pairs over 16-value ones).
    pairs: [__m256i; 8],
    /// Lane `t` = token `t`'s q8_K scale.
    d: __m256,
}

// SAFETY: vectors only; alignment 32.
unsafe impl Pod for ActBlock {}

/// Whether the kernel takes weights of `kind` (see the module comment).
const fn takes(kind: u8) -> bool {
    matches!(kind, Q2_K | Q3_K | Q4_K | Q5_K | Q6_K)
}

/// As [`super::kq_lanes::gemm_then_rest`]: from 16 tokens, the batch in its first token's
/// order, the 1–3 tokens whose order differs (q4_K's and q2_K's parity orders) through `rest`.
///
/// # Safety
/// As [`gemm`] for all of `g`'s tokens, `g.ntok >= 16`; `rest` may be called with any
/// sub-problem of `g` (the caller's own entry point).
#[target_feature(enable = "avx2,fma,f16c")]
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

/// As [`super::kq_lanes::tiled_batch`]: q3_K / q6_K from 16 tokens when the batch sums in the
/// tiled order, all of it here and `true`; else nothing and `false`.
///
/// # Safety
/// As [`gemm`] for all of `g`'s tokens.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn tiled_batch<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) -> bool {
    if g.ntok < MIN_TOKENS || crate::scalar::token_order(g, 0) != KOrder::Tiled {
        return false;
    }
    debug_assert!((0..g.ntok).all(|t| crate::scalar::token_order(g, t) == KOrder::Tiled));
    // SAFETY: as this function's contract; every token sums in the tiled order.
    unsafe { gemm::<KIND>(g, 0, g.ntok, KOrder::Tiled, out) };
    true
}

/// Tokens `t0..t1` of `g`, which all sum in `order`, for every row.
///
/// # Safety
/// AVX2, FMA, F16C; `g` a validated problem of kind `KIND` (one [`takes`]), `t0 < t1 <=
/// g.ntok`, `out.len() == g.ntok * g.nrows`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn gemm<const KIND: u8>(
    g: &Gemm<'_>,
    t0: usize,
    t1: usize,
    order: KOrder,
    out: &mut [f32],
) {
    debug_assert!(takes(KIND));
    debug_assert!(match KIND {
        Q6_K | Q3_K => order == KOrder::Tiled,
        Q2_K => matches!(order, KOrder::Sb256 | KOrder::Sb128),
        _ => matches!(order, KOrder::Sb256 | KOrder::Sb64 | KOrder::Tiled),
    });
    let nsb = g.cols / QK_K;
    let wbs = k_block_bytes(KIND);
    let ngroups = (t1 - t0).div_ceil(LANES);
    let band = BAND_GROUPS.min(ngroups);
    let panel = PANEL.min(g.nrows.div_ceil(R) * R);
    with_scratch(0, band * nsb, |acts: &mut [ActBlock]| {
        with_scratch(1, panel, |wrows: &mut [WRow]| {
            let mut accs = vec![_mm256_setzero_ps(); 2 * panel * band];
            let mut b0 = 0;
            while b0 < ngroups {
                let b1 = (b0 + band).min(ngroups);
                // SAFETY: as this function's contract; `acts` holds `band · nsb` blocks.
                unsafe { prep_band(g, t0, t1, b0, b1, acts) };
                let mut r0 = 0;
                while r0 < g.nrows {
                    let np = panel.min(g.nrows - r0);
                    accs.fill(_mm256_setzero_ps());
                    for sb in 0..nsb {
                        for (i, wr) in wrows[..np].iter_mut().enumerate() {
                            // SAFETY: row r0 + i < nrows, super-block sb lies in `g.w`; the
                            // closure writes the 256 codes.
                            unsafe {
                                let p = g.w.as_ptr().add((r0 + i) * g.w_stride + sb * wbs);
                                unpack_row::<KIND>(p, wr, |c| {
                                    for (k, v) in codes_k::<KIND>(p).iter().enumerate() {
                                        _mm256_storeu_si256(c.as_mut_ptr().add(32 * k).cast(), *v);
                                    }
                                });
                            }
                        }
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
                                    if ng == G {
                                        let a: [&ActBlock; G] = core::array::from_fn(ab);
                                        micro::<KIND, G>(&w, &a, order, p, band, base)
                                    } else {
                                        micro::<KIND, 1>(&w, &[ab(0)], order, p, band, base)
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
                                _mm256_sub_ps(accs[k], accs[k + 1])
                            };
                            // SAFETY: 8 floats.
                            unsafe { _mm256_storeu_ps(lanes[i].as_mut_ptr(), v) };
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

/// The 256 codes of a q4_K / q5_K / q6_K super-block at `p` in value order, unsigned (q6_K:
/// `value + 32`). Other kinds: unused (zeros).
///
/// # Safety
/// AVX2 available; `p` readable for one super-block of `KIND`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn codes_k<const KIND: u8>(p: *const u8) -> [__m256i; 8] {
    let low4 = _mm256_set1_epi8(0x0F);
    let mut u = [_mm256_setzero_si256(); 8];
    // SAFETY (whole body): reads within the super-block.
    unsafe {
        if KIND == Q6_K {
            let m30 = _mm256_set1_epi8(0x30);
            for h in 0..2 {
                let ql0 = _mm256_loadu_si256(p.add(64 * h).cast());
                let ql1 = _mm256_loadu_si256(p.add(64 * h + 32).cast());
                let qh = _mm256_loadu_si256(p.add(128 + 32 * h).cast());
                let hi = |v: __m256i| _mm256_and_si256(v, m30);
                u[4 * h] =
                    _mm256_or_si256(_mm256_and_si256(ql0, low4), hi(_mm256_slli_epi16(qh, 4)));
                u[4 * h + 1] =
                    _mm256_or_si256(_mm256_and_si256(ql1, low4), hi(_mm256_slli_epi16(qh, 2)));
                u[4 * h + 2] =
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4), hi(qh));
                u[4 * h + 3] = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                    hi(_mm256_srli_epi16(qh, 2)),
                );
            }
        } else if KIND == Q4_K || KIND == Q5_K {
            let qs = if KIND == Q5_K { p.add(48) } else { p.add(16) };
            let qh = _mm256_loadu_si256(p.add(16).cast());
            for c in 0..4 {
                let q = _mm256_loadu_si256(qs.add(32 * c).cast());
                let mut lo = _mm256_and_si256(q, low4);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
                if KIND == Q5_K {
                    let b0 = _mm256_set1_epi8(1 << (2 * c));
                    let b1 = _mm256_set1_epi8((2u8 << (2 * c)) as i8);
                    let h0 = _mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0);
                    let h1 = _mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1);
                    lo = _mm256_or_si256(lo, _mm256_and_si256(h0, _mm256_set1_epi8(16)));
                    hi = _mm256_or_si256(hi, _mm256_and_si256(h1, _mm256_set1_epi8(16)));
                }
                u[2 * c] = lo;
                u[2 * c + 1] = hi;
            }
        }
    }
    u
}

/// Rearranges groups `b0..b1` (of tokens from `t0`, up to `t1`) into `acts[(gi - b0) · nsb +
/// sb]`; lanes past `t1` are zero.
///
/// # Safety
/// As [`gemm`]; `acts.len() >= (b1 - b0) · nsb`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn prep_band(
    g: &Gemm<'_>,
    t0: usize,
    t1: usize,
    b0: usize,
    b1: usize,
    acts: &mut [ActBlock],
) {
    let nsb = g.cols / QK_K;
    // 16-value sub-blocks (q6_K, q3_K, q2_K) take their block sums as they are.
    let sub16 = matches!(
        g.wty,
        crate::quant::GgmlType::Q6_K | crate::quant::GgmlType::Q3_K | crate::quant::GgmlType::Q2_K
    );
    for gi in b0..b1 {
        let ts = t0 + gi * LANES;
        let n = (t1 - ts).min(LANES);
        for sb in 0..nsb {
            let blk = &mut acts[(gi - b0) * nsb + sb];
            let mut codes = [[0u32; LANES]; 64];
            let mut pairs = [[0u32; LANES]; 8];
            let mut d = [0f32; LANES];
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
                for (c, v) in codes.iter_mut().zip(q) {
                    c[t] = v;
                }
                let pair = |a: i16, b: i16| (a as u16 as u32) | ((b as u16 as u32) << 16);
                if sub16 {
                    for p in 0..8 {
                        pairs[p][t] = pair(bs[2 * p], bs[2 * p + 1]);
                    }
                } else {
                    // |bsums| <= 16 · 128, so a 32-value sum fits in i16.
                    let s = |j: usize| bs[2 * j] + bs[2 * j + 1];
                    for p in 0..4 {
                        pairs[p][t] = pair(s(2 * p), s(2 * p + 1));
                    }
                }
            }
            // SAFETY: each array is 32 bytes.
            unsafe {
                for (o, c) in blk.codes.iter_mut().zip(&codes) {
                    *o = _mm256_loadu_si256(c.as_ptr().cast());
                }
                for (o, c) in blk.pairs.iter_mut().zip(&pairs) {
                    *o = _mm256_loadu_si256(c.as_ptr().cast());
                }
                blk.d = _mm256_loadu_ps(d.as_ptr());
            }
        }
    }
}

/// `Σ_{p < n} pairs_w[p] · pairs_a[p]` per token lane (i16 pairs, exact).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn pair_dot(w: &WRow, a: &ActBlock, n: usize) -> __m256i {
    let mut s = _mm256_setzero_si256();
    for p in 0..n {
        s = _mm256_add_epi32(
            s,
            _mm256_madd_epi16(_mm256_set1_epi32(w.pairs[p]), a.pairs[p]),
        );
    }
    s
}

/// R rows × NG groups at one super-block: the exact integer sums, then each (row, token)'s
/// float step(s) of `order` into `accs[base + 2(i·band + k)]` (and `+ 1`, the mins' chain).
///
/// # Safety
/// AVX2, FMA, F16C; the accumulators of rows `0..R` and groups `0..NG` from `base` lie in
/// `accs`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn micro<const KIND: u8, const NG: usize>(
    w: &[&WRow; R],
    a: &[&ActBlock; NG],
    order: KOrder,
    accs: *mut __m256,
    band: usize,
    base: usize,
) {
    let sub16 = KIND == Q6_K || KIND == Q3_K || KIND == Q2_K;
    // Sub-blocks, quads per sub-block, and sub-blocks per float step.
    let (nsub, nq) = if sub16 { (16, 4) } else { (8, 8) };
    // Quads whose i16 pair sums cannot overflow: 2 · chunk · max code · 128 <= 32767.
    let chunk = match KIND {
        Q4_K => 8,
        Q6_K => 2,
        _ => 4,
    };
    let per = match order {
        KOrder::Sb64 => 2,
        KOrder::Sb128 => nsub / 2,
        _ => nsub,
    };
    let stepped = matches!(order, KOrder::Sb64 | KOrder::Sb128);
    let acc = |i: usize, k: usize| 2 * (i * band + k);
    // SAFETY (whole body): the pointers come from the live `WRow`/`ActBlock` references;
    // accumulator indices as this function's contract.
    unsafe {
        let mut s1 = [[_mm256_setzero_si256(); NG]; R];
        for j0 in (0..nsub).step_by(per) {
            for j in j0..j0 + per {
                for q0 in (j * nq..j * nq + nq).step_by(chunk) {
                    let mut raw = [[_mm256_setzero_si256(); NG]; R];
                    for q in q0..q0 + chunk {
                        let c: [__m256i; NG] = core::array::from_fn(|k| a[k].codes[q]);
                        for i in 0..R {
                            let wv = _mm256_set1_epi32(
                                w[i].codes
                                    .as_ptr()
                                    .add(4 * q)
                                    .cast::<i32>()
                                    .read_unaligned(),
                            );
                            for k in 0..NG {
                                raw[i][k] =
                                    _mm256_add_epi16(raw[i][k], _mm256_maddubs_epi16(wv, c[k]));
                            }
                        }
                    }
                    for i in 0..R {
                        let sc = _mm256_set1_epi16(w[i].sc[j] as i16);
                        for k in 0..NG {
                            s1[i][k] = _mm256_add_epi32(s1[i][k], _mm256_madd_epi16(raw[i][k], sc));
                        }
                    }
                }
            }
            if stepped {
                // One step per 64 (q4_K) or 128 (q2_K) values.
                for i in 0..R {
                    for k in 0..NG {
                        let sv = _mm256_mul_ps(_mm256_set1_ps(w[i].d), a[k].d);
                        let mv = _mm256_mul_ps(_mm256_set1_ps(w[i].dmin), a[k].d);
                        let mut imin = _mm256_setzero_si256();
                        for p in j0 / 2..(j0 + per) / 2 {
                            let m = _mm256_set1_epi32(w[i].pairs[p]);
                            imin = _mm256_add_epi32(imin, _mm256_madd_epi16(m, a[k].pairs[p]));
                        }
                        let x = accs.add(base + acc(i, k));
                        *x = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1[i][k]), sv, *x);
                        let y = x.add(1);
                        *y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(imin), mv, *y);
                        s1[i][k] = _mm256_setzero_si256();
                    }
                }
            }
        }
        match order {
            KOrder::Sb64 | KOrder::Sb128 => {}
            KOrder::Tiled if !sub16 => {
                // q4_K / q5_K: fnmadd(dmin, imin, isum · d), then one FMA with da.
                for i in 0..R {
                    for k in 0..NG {
                        let imin = pair_dot(w[i], a[k], 4);
                        let res =
                            _mm256_mul_ps(_mm256_cvtepi32_ps(s1[i][k]), _mm256_set1_ps(w[i].d));
                        let res = _mm256_fnmadd_ps(
                            _mm256_set1_ps(w[i].dmin),
                            _mm256_cvtepi32_ps(imin),
                            res,
                        );
                        let x = accs.add(base + acc(i, k));
                        *x = _mm256_fmadd_ps(res, a[k].d, *x);
                    }
                }
            }
            KOrder::Tiled => {
                // q6_K: codes carry +32, q3_K +4; remove offset · Σ_j sc_j · bsums_j.
                for i in 0..R {
                    for k in 0..NG {
                        let corr = pair_dot(w[i], a[k], 8);
                        let corr = if KIND == Q3_K {
                            _mm256_slli_epi32::<2>(corr)
                        } else {
                            _mm256_slli_epi32::<5>(corr)
                        };
                        let isum = _mm256_sub_epi32(s1[i][k], corr);
                        let res = _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(w[i].d));
                        let x = accs.add(base + acc(i, k));
                        *x = _mm256_fmadd_ps(res, a[k].d, *x);
                    }
                }
            }
            _ => {
                // Sb256: the super-block's sums and mins, one FMA each.
                for i in 0..R {
                    for k in 0..NG {
                        let imin = pair_dot(w[i], a[k], if sub16 { 8 } else { 4 });
                        let sv = _mm256_mul_ps(_mm256_set1_ps(w[i].d), a[k].d);
                        let mv = _mm256_mul_ps(_mm256_set1_ps(w[i].dmin), a[k].d);
                        let x = accs.add(base + acc(i, k));
                        *x = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1[i][k]), sv, *x);
                        let y = x.add(1);
                        *y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(imin), mv, *y);
                    }
                }
            }
        }
    }
}
