//! AVX-512 (F, BW, VL, DQ, VNNI) matmuls of quantized weights, bit-identical to the scalar
//! reference: they sum in the float order llama.cpp's x86 CPU backend uses (see
//! `scalar::vec_dot_legacy`, `scalar::KOrder`), so our logits equal its logits.
//!
//! Integer products use VNNI. Exact integer partial sums may be grouped any way; only the f32
//! steps have to happen where ggml does them:
//! - Legacy blocks (q8_0, q4_0, q5_0): per block, eight i32 lanes of four products, one FMA
//!   per lane, the lanes reduced as `hsum_float_8` at the end. One token: one 256-bit
//!   accumulator per row (unsigned weight codes, the offset removed by starting the lanes at
//!   `-offset·Σa`). Several tokens: a 512-bit register holds a (row, token pair) — weights
//!   broadcast to both halves, the two tokens' activations side by side, biased by +128 to be
//!   the unsigned operand, the bias removed by starting the lanes at `-128·Σw`.
//! - k-quants: the exact integer sum of a super-block (or of 64 values for the q4_K GEMM
//!   order) is reduced horizontally, four tokens at a time so one transposing reduction serves
//!   four dot products, then scaled in f32 lanes that hold those four tokens; q6_K's `vec_dot`
//!   order keeps eight lanes per token, two tokens per register. Which order a token takes is
//!   `scalar::token_order`: under `Numerics::Invariant` always the 1-token one, so a batched
//!   row equals what the GEMV gives that token alone.
//!
//! Legacy and float orders do not depend on the batch (the GEMV and the GEMM sum each row in
//! the same order), so `Numerics` changes nothing for them.

// Tile loops index several per-row / per-token arrays with the same counter.
#![allow(clippy::needless_range_loop)]

use super::avx2::{hsum as hsum8, hsum_i32};
use super::{k4_scales_mins, k_block_bytes, legacy_block_bytes, legacy_offset};
use super::{Q4_0, Q5_0, Q5_K, Q6_K, Q8_0};
use crate::matmul::Gemm;
use crate::quant::{QK, QK_K};
use crate::scalar::{token_order, KOrder};
use core::arch::x86_64::*;

/// # Safety
/// Features as the module; `p` readable for 2 bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn f16_to_f32(p: *const u8) -> f32 {
    // SAFETY: 2 readable bytes at `p`.
    let bits = unsafe { p.cast::<u16>().read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

// ---------------------------------------------------------------------------------------------
// Legacy 32-value blocks: q8_0, q4_0, q5_0 against q8_0.

/// The 32 codes of the legacy block at `p` in value order, unsigned (`value + offset`).
///
/// # Safety
/// Features as the module; `p` readable for one `KIND` block.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn unpack_u8<const KIND: u8>(p: *const u8) -> __m256i {
    // SAFETY (whole body): reads within the block at `p`.
    unsafe {
        if KIND == Q8_0 {
            return _mm256_xor_si256(_mm256_loadu_si256(p.add(2).cast()), _mm256_set1_epi8(-128));
        }
        let qoff = if KIND == Q4_0 { 2 } else { 6 };
        let q = _mm_loadu_si128(p.add(qoff).cast());
        let both = _mm256_set_m128i(_mm_srli_epi16::<4>(q), q);
        let u = _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
        if KIND == Q5_0 {
            let qh = p.add(2).cast::<u32>().read_unaligned();
            _mm256_mask_add_epi8(u, qh, u, _mm256_set1_epi8(16))
        } else {
            u
        }
    }
}

/// The GEMV and the GEMM both sum a (row, token) in `scalar::vec_dot_legacy`'s order (the
/// module docs), so batched rows equal 1-token rows and `Numerics` changes nothing.
///
/// # Safety
/// The CPU has this module's features; `g` comes from `Gemm::new` with `out.len() ==
/// g.ntok * g.nrows` and `g.wty` of kind `KIND`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn run_legacy<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) {
    if g.ntok == 1 {
        // SAFETY: as this function's contract.
        unsafe { gemv_legacy::<KIND>(g, out) };
    } else {
        // SAFETY: as this function's contract.
        unsafe { gemm_legacy::<KIND>(g, out) };
    }
}

/// GEMV (one token): four rows at a time, two per 512-bit register (row `r` in the low half,
/// `r + 1` in the high half), each half one row's own chain of per-block FMAs; activations
/// prepared once per call, broadcast to both halves. Remaining rows one at a time.
///
/// # Safety
/// As [`run_legacy`], with `g.ntok == 1`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn gemv_legacy<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) {
    let nb = g.cols / QK;
    let bs = legacy_block_bytes(KIND);
    let ones = _mm256_set1_epi8(1);
    let negk = _mm256_set1_epi32(-legacy_offset(KIND));
    let mut codes = Vec::with_capacity(nb);
    let mut corr = Vec::with_capacity(nb);
    // SAFETY (whole body): blocks below `nb` of the one activation row and of each row.
    unsafe {
        for b in 0..nb {
            let a = _mm256_loadu_si256(g.a.as_ptr().add(b * 34 + 2).cast());
            codes.push(_mm512_broadcast_i64x4(a));
            let sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, a);
            corr.push(_mm512_broadcast_i64x4(_mm256_mullo_epi32(sums, negk)));
        }
        let sel_a = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        let sel_b = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
        let mut r = 0;
        while r + 4 <= g.nrows {
            let w = g.w.as_ptr().add(r * g.w_stride);
            let st = g.w_stride;
            let mut acc_a = _mm512_setzero_ps();
            let mut acc_b = _mm512_setzero_ps();
            for b in 0..nb {
                let p = w.add(b * bs);
                // The rows two groups ahead, a block at a time (a hint: never faults). The
                // hardware prefetchers alone left the 4-stream GEMV at ~7 GB/s from DRAM, with
                // these ~11 GB/s (one core, Gemma's LM head).
                let q = p.wrapping_add(PF_GROUPS * 4 * st);
                for i in 0..4 {
                    _mm_prefetch::<_MM_HINT_T0>(q.wrapping_add(i * st).cast());
                }
                let (ua, ub) = (
                    unpack_pair_u8::<KIND>(p, p.add(st)),
                    unpack_pair_u8::<KIND>(p.add(2 * st), p.add(3 * st)),
                );
                let c = *corr.get_unchecked(b);
                let a = *codes.get_unchecked(b);
                let ia = _mm512_dpbusd_epi32(c, ua, a);
                let ib = _mm512_dpbusd_epi32(c, ub, a);
                // The four rows' f16 scales, times the activation's, spread per half.
                let dh = _mm_setr_epi16(
                    p.cast::<i16>().read_unaligned(),
                    p.add(st).cast::<i16>().read_unaligned(),
                    p.add(2 * st).cast::<i16>().read_unaligned(),
                    p.add(3 * st).cast::<i16>().read_unaligned(),
                    0,
                    0,
                    0,
                    0,
                );
                let dd = _mm_mul_ps(_mm_cvtph_ps(dh), _mm_set1_ps(*g.a_scales.get_unchecked(b)));
                let dz = _mm512_castps128_ps512(dd);
                let (da, db) = (
                    _mm512_permutexvar_ps(sel_a, dz),
                    _mm512_permutexvar_ps(sel_b, dz),
                );
                acc_a = _mm512_fmadd_ps(da, _mm512_cvtepi32_ps(ia), acc_a);
                acc_b = _mm512_fmadd_ps(db, _mm512_cvtepi32_ps(ib), acc_b);
            }
            *out.get_unchecked_mut(r) = hsum8(_mm512_castps512_ps256(acc_a));
            *out.get_unchecked_mut(r + 1) = hsum8(_mm512_extractf32x8_ps::<1>(acc_a));
            *out.get_unchecked_mut(r + 2) = hsum8(_mm512_castps512_ps256(acc_b));
            *out.get_unchecked_mut(r + 3) = hsum8(_mm512_extractf32x8_ps::<1>(acc_b));
            r += 4;
        }
        while r < g.nrows {
            let w = g.w.as_ptr().add(r * g.w_stride);
            let mut acc = _mm256_setzero_ps();
            for b in 0..nb {
                let p = w.add(b * bs);
                let isum = _mm256_dpbusd_epi32(
                    _mm512_castsi512_si256(*corr.get_unchecked(b)),
                    unpack_u8::<KIND>(p),
                    _mm512_castsi512_si256(*codes.get_unchecked(b)),
                );
                let d = _mm256_set1_ps(f16_to_f32(p) * *g.a_scales.get_unchecked(b));
                acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(isum), acc);
            }
            *out.get_unchecked_mut(r) = hsum8(acc);
            r += 1;
        }
    }
}

/// How many 4-row groups ahead the GEMVs prefetch.
const PF_GROUPS: usize = 2;

/// The unsigned codes of the blocks at `p0` (low half) and `p1` (high half), value order.
///
/// # Safety
/// Features as the module; `p0`, `p1` readable for one `KIND` block each.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn unpack_pair_u8<const KIND: u8>(p0: *const u8, p1: *const u8) -> __m512i {
    // SAFETY (whole body): reads within the two blocks.
    unsafe {
        if KIND == Q8_0 {
            let lo = _mm256_loadu_si256(p0.add(2).cast());
            let v = _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(lo),
                _mm256_loadu_si256(p1.add(2).cast()),
            );
            return _mm512_xor_si512(v, _mm512_set1_epi8(-128));
        }
        let qoff = if KIND == Q4_0 { 2 } else { 6 };
        let q = _mm256_inserti128_si256::<1>(
            _mm256_castsi128_si256(_mm_loadu_si128(p0.add(qoff).cast())),
            _mm_loadu_si128(p1.add(qoff).cast()),
        );
        // 128-bit lanes [q0, q0, q1, q1], the second of each pair shifted to its high nibbles.
        let qq = _mm512_shuffle_i64x2::<0b01_01_00_00>(
            _mm512_castsi256_si512(q),
            _mm512_castsi256_si512(q),
        );
        let sh = _mm512_mask_srli_epi16(qq, 0xFF00_FF00, qq, 4);
        let u = _mm512_and_si512(sh, _mm512_set1_epi8(0x0F));
        if KIND == Q5_0 {
            let h0 = p0.add(2).cast::<u32>().read_unaligned() as u64;
            let h1 = p1.add(2).cast::<u32>().read_unaligned() as u64;
            _mm512_mask_add_epi8(u, h0 | (h1 << 32), u, _mm512_set1_epi8(16))
        } else {
            u
        }
    }
}

/// One weight block unpacked for the GEMM: signed codes, the lanes' `-128·Σw`, the scale.
#[derive(Clone, Copy)]
struct WBlock {
    w: __m256i,
    corr: __m256i,
    d: f32,
}

/// One token pair's block for the GEMM: both tokens' codes biased by +128 (token `2q` in the
/// low half), and their scales spread over the halves.
#[derive(Clone, Copy)]
struct APair {
    a: __m512i,
    d: __m512,
}

/// GEMM (several tokens). Every row of the call is unpacked once; the tokens run in pairs and
/// in blocks whose prepared activations stay in L2; tiles of 4 rows × 4 pairs keep 16
/// accumulators in registers for the whole row length (the per-lane chains must run over all
/// blocks in order).
///
/// # Safety
/// As [`run_legacy`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn gemm_legacy<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) {
    const R: usize = 4;
    const P: usize = 4;
    let nb = g.cols / QK;
    let bs = legacy_block_bytes(KIND);
    let off = _mm256_set1_epi8(legacy_offset(KIND) as u8 as i8);
    let ones = _mm256_set1_epi8(1);
    let npairs = g.ntok.div_ceil(2);
    // Pairs per token block: their prepared activations (128 bytes per block) within ~192 KiB.
    let pb = ((192 * 1024) / (nb * 128).max(1)).max(P) / P * P;
    let mut wsc: Vec<WBlock> = Vec::with_capacity(g.nrows * nb);
    let mut act: Vec<APair> = Vec::with_capacity(pb.min(npairs) * nb);
    // SAFETY (whole body): rows below `g.nrows`, tokens below `g.ntok` (an odd last token's
    // partner is a zero block, never read from `g.a`), blocks below `nb`.
    unsafe {
        for r in 0..g.nrows {
            let w = g.w.as_ptr().add(r * g.w_stride);
            for b in 0..nb {
                let p = w.add(b * bs);
                let sw = _mm256_sub_epi8(unpack_u8::<KIND>(p), off);
                let sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, sw);
                wsc.push(WBlock {
                    w: sw,
                    corr: _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32::<7>(sums)),
                    d: f16_to_f32(p),
                });
            }
        }
        let bias = _mm256_set1_epi8(-128);
        let mut q0 = 0;
        while q0 < npairs {
            let q1 = (q0 + pb).min(npairs);
            act.clear();
            for q in q0..q1 {
                let t = 2 * q;
                let has1 = t + 1 < g.ntok;
                for b in 0..nb {
                    let p0 = g.a.as_ptr().add(t * g.a_stride + b * 34 + 2);
                    let lo = _mm256_xor_si256(_mm256_loadu_si256(p0.cast()), bias);
                    let (hi, d1) = if has1 {
                        let p1 = p0.add(g.a_stride);
                        (
                            _mm256_xor_si256(_mm256_loadu_si256(p1.cast()), bias),
                            *g.a_scales.get_unchecked((t + 1) * nb + b),
                        )
                    } else {
                        (bias, 0.0)
                    };
                    let d0 = *g.a_scales.get_unchecked(t * nb + b);
                    act.push(APair {
                        a: _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi),
                        d: _mm512_insertf32x8::<1>(
                            _mm512_castps256_ps512(_mm256_set1_ps(d0)),
                            _mm256_set1_ps(d1),
                        ),
                    });
                }
            }
            let mut r = 0;
            while r < g.nrows {
                let nr = if g.nrows - r >= R { R } else { 1 };
                let mut q = q0;
                while q < q1 {
                    let np = if q1 - q >= P { P } else { 1 };
                    match (nr, np) {
                        (R, P) => legacy_tile::<R, P>(g, &wsc, &act, nb, r, q0, q, out),
                        (R, _) => legacy_tile::<R, 1>(g, &wsc, &act, nb, r, q0, q, out),
                        (_, P) => legacy_tile::<1, P>(g, &wsc, &act, nb, r, q0, q, out),
                        _ => legacy_tile::<1, 1>(g, &wsc, &act, nb, r, q0, q, out),
                    }
                    q += np;
                }
                r += nr;
            }
            q0 = q1;
        }
    }
}

/// Rows `r0..r0+R` × token pairs `q..q+P` over all `nb` blocks, written to `out` (the second
/// token of a pair only when it exists).
///
/// # Safety
/// Features as the module; `wsc` holds `nb` blocks of every row, `act` `nb` blocks of the pairs
/// `q0..` (so `q - q0 + P` of them), `r0 + R <= g.nrows`, `2q < g.ntok`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn legacy_tile<const R: usize, const P: usize>(
    g: &Gemm<'_>,
    wsc: &[WBlock],
    act: &[APair],
    nb: usize,
    r0: usize,
    q0: usize,
    q: usize,
    out: &mut [f32],
) {
    let mut acc = [[_mm512_setzero_ps(); P]; R];
    // SAFETY (whole body): indices as the contract.
    unsafe {
        for b in 0..nb {
            let mut ap = [act.get_unchecked(0); P];
            for j in 0..P {
                ap[j] = act.get_unchecked((q - q0 + j) * nb + b);
            }
            for i in 0..R {
                let wb = wsc.get_unchecked((r0 + i) * nb + b);
                let w = _mm512_broadcast_i64x4(wb.w);
                let c = _mm512_broadcast_i64x4(wb.corr);
                let dw = _mm512_set1_ps(wb.d);
                for j in 0..P {
                    let isum = _mm512_dpbusd_epi32(c, ap[j].a, w);
                    let d = _mm512_mul_ps(dw, ap[j].d);
                    acc[i][j] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(isum), acc[i][j]);
                }
            }
        }
        for i in 0..R {
            for j in 0..P {
                let t = 2 * (q + j);
                let lo = _mm512_castps512_ps256(acc[i][j]);
                *out.get_unchecked_mut(t * g.nrows + r0 + i) = hsum8(lo);
                if t + 1 < g.ntok {
                    let hi = _mm512_extractf32x8_ps::<1>(acc[i][j]);
                    *out.get_unchecked_mut((t + 1) * g.nrows + r0 + i) = hsum8(hi);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// k-quants: q4_K, q5_K, q6_K against q8_K.

/// One unpacked weight super-block: 4 × 64 unsigned codes in value order, the sub-block scales
/// as i16 lanes matching `vpmaddubsw` output, f32 `d` and `dmin`, and the i16 vector that
/// multiplies the q8_K `bsums` (mins, duplicated per pair of 16, for q4_K/q5_K; the scales for
/// q6_K, whose codes carry an offset of 32).
#[derive(Clone, Copy)]
pub(super) struct KBlock {
    u: [__m512i; 4],
    sc: [__m512i; 4],
    d: f32,
    dmin: f32,
    bsum_w: __m256i,
}

/// # Safety
/// Features as the module; `p` readable for one `KIND` super-block.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn unpack_k<const KIND: u8>(p: *const u8) -> KBlock {
    // SAFETY (whole body): reads within the super-block at `p` (layouts in scalar.rs).
    unsafe {
        let low4 = _mm512_set1_epi8(0x0F);
        let mut u = [_mm512_setzero_si512(); 4];
        let mut sc = [_mm512_setzero_si512(); 4];
        if KIND == Q6_K {
            let d = f16_to_f32(p.add(208));
            let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(192).cast()));
            let k = 0x0001_0001_0001_0001i64;
            let idx0 = _mm512_set_epi64(3 * k, 3 * k, 2 * k, 2 * k, k, k, 0, 0);
            let sc512 = _mm512_castsi256_si512(sc16);
            let sl = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
            let sr = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
            let m30 = _mm512_set1_epi8(0x30);
            for h in 0..2 {
                let ql = _mm512_loadu_si512(p.add(64 * h).cast());
                let hb = _mm512_broadcast_i64x4(_mm256_loadu_si256(p.add(128 + 32 * h).cast()));
                let ha = _mm512_and_si512(_mm512_sllv_epi16(hb, sl), m30);
                let hbb = _mm512_and_si512(_mm512_srlv_epi16(hb, sr), m30);
                u[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, low4), ha);
                u[2 * h + 1] =
                    _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4), hbb);
            }
            for (c, s) in sc.iter_mut().enumerate() {
                let idx = _mm512_add_epi16(idx0, _mm512_set1_epi16(4 * c as i16));
                *s = _mm512_permutexvar_epi16(idx, sc512);
            }
            KBlock {
                u,
                sc,
                d,
                dmin: 0.0,
                bsum_w: sc16,
            }
        } else {
            let d = f16_to_f32(p);
            let dmin = f16_to_f32(p.add(2));
            let (scales, mins) = k4_scales_mins(&*p.add(4).cast::<[u8; 12]>());
            let sc512 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(scales as i64)));
            let m = _mm_cvtsi64_si128(mins as i64);
            let bsum_w = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m));
            let idx0 = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(1), 1);
            let qs = if KIND == Q5_K { p.add(48) } else { p.add(16) };
            let hb = if KIND == Q5_K {
                _mm512_broadcast_i64x4(_mm256_loadu_si256(p.add(16).cast()))
            } else {
                _mm512_setzero_si512()
            };
            let bit0 = _mm512_inserti64x4(_mm512_set1_epi8(1), _mm256_set1_epi8(2), 1);
            for c in 0..4 {
                let qq = _mm512_broadcast_i64x4(_mm256_loadu_si256(qs.add(32 * c).cast()));
                let sh = _mm512_mask_srli_epi16(qq, 0xFFFF_0000, qq, 4);
                u[c] = _mm512_and_si512(sh, low4);
                if KIND == Q5_K {
                    let bits = _mm512_sllv_epi16(bit0, _mm512_set1_epi16(2 * c as i16));
                    let hm = _mm512_test_epi8_mask(hb, bits);
                    u[c] = _mm512_mask_add_epi8(u[c], hm, u[c], _mm512_set1_epi8(16));
                }
                let idx = _mm512_add_epi16(idx0, _mm512_set1_epi16(2 * c as i16));
                sc[c] = _mm512_permutexvar_epi16(idx, sc512);
            }
            KBlock {
                u,
                sc,
                d,
                dmin,
                bsum_w,
            }
        }
    }
}

/// One q8_K super-block of a token: its codes, f32 scale and `bsums`.
#[derive(Clone, Copy)]
struct KAct {
    p: *const u8,
    d: f32,
    bsums: __m256i,
}

/// # Safety
/// Features as the module; `p` readable for one q8_K super-block (f32 d, 256 codes, 16 bsums).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn k_act(p: *const u8) -> KAct {
    // SAFETY: within the super-block.
    unsafe {
        KAct {
            p: p.add(4),
            d: p.cast::<f32>().read_unaligned(),
            bsums: _mm256_loadu_si256(p.add(4 + QK_K).cast()),
        }
    }
}

/// The 64-value chunk `c` of `kb` against the same chunk of `a`: 16 i32 lanes of four scaled
/// products each.
///
/// # Safety
/// Features as the module; `a.p` readable for 256 codes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn chunk_dot(kb: &KBlock, a: &KAct, c: usize, acc: __m512i) -> __m512i {
    // SAFETY: within the 256 codes.
    let av = unsafe { _mm512_loadu_si512(a.p.add(64 * c).cast()) };
    _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(kb.u[c], av), kb.sc[c])
}

/// The whole super-block's scaled integer lanes (without the q6_K offset or q4_K mins).
///
/// # Safety
/// As [`chunk_dot`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn block_dot(kb: &KBlock, a: &KAct) -> __m512i {
    let mut v = _mm512_setzero_si512();
    for c in 0..4 {
        // SAFETY: as this function's contract.
        v = unsafe { chunk_dot(kb, a, c, v) };
    }
    v
}

/// Four vectors summed horizontally into the four lanes of one (exact integer sums).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
fn reduce4(v: [__m512i; 4]) -> __m128i {
    let a01 = _mm512_add_epi32(
        _mm512_unpacklo_epi32(v[0], v[1]),
        _mm512_unpackhi_epi32(v[0], v[1]),
    );
    let a23 = _mm512_add_epi32(
        _mm512_unpacklo_epi32(v[2], v[3]),
        _mm512_unpackhi_epi32(v[2], v[3]),
    );
    let b = _mm512_add_epi32(
        _mm512_unpacklo_epi64(a01, a23),
        _mm512_unpackhi_epi64(a01, a23),
    );
    let c = _mm256_add_epi32(_mm512_castsi512_si256(b), _mm512_extracti64x4_epi64::<1>(b));
    _mm_add_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256::<1>(c))
}

/// One super-block of [`KOrder::Lanes8`] (q6_K `vec_dot`): the eight lanes of four products
/// (both 256-bit halves of [`block_dot`] summed), less the offset 32 via `bsums`, then
/// `acc = fma(da·dw, lanes, acc)`.
///
/// # Safety
/// As [`chunk_dot`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn lanes8_step(acc: __m256, b: &KBlock, a: &KAct) -> __m256 {
    // SAFETY: as this function's contract.
    let v = unsafe { block_dot(b, a) };
    let v8 = _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v));
    let corr = _mm256_madd_epi16(a.bsums, b.bsum_w);
    let v8 = _mm256_sub_epi32(v8, _mm256_slli_epi32::<5>(corr));
    _mm256_fmadd_ps(_mm256_set1_ps(a.d * b.d), _mm256_cvtepi32_ps(v8), acc)
}

/// One super-block of [`KOrder::Sb256`] (repacked q4_K GEMV): `(acc, acc_min)` each advanced by
/// one FMA of the super-block's exact integer sum.
///
/// # Safety
/// As [`chunk_dot`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn sb256_step(acc: (f32, f32), b: &KBlock, a: &KAct) -> (f32, f32) {
    // SAFETY: as this function's contract.
    let isum = _mm512_reduce_add_epi32(unsafe { block_dot(b, a) });
    let imin = hsum_i32(_mm256_madd_epi16(a.bsums, b.bsum_w));
    (
        (isum as f32).mul_add(b.d * a.d, acc.0),
        (imin as f32).mul_add(b.dmin * a.d, acc.1),
    )
}

/// # Safety
/// As [`run_legacy`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn run_k<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) {
    if g.ntok == 1 {
        // SAFETY: as this function's contract.
        unsafe { gemv_k::<KIND>(g, out) };
        return;
    }
    let nsb = g.cols / QK_K;
    let wbs = k_block_bytes(KIND);
    let ntok = g.ntok;
    let mut kb: Vec<KBlock> = Vec::with_capacity(nsb);
    // Token block (a multiple of 4): its activations stay in L2 while the rows stream past.
    let tb = ((256 * 1024) / g.a_stride.max(1)).max(4) / 4 * 4;
    // SAFETY (whole body): rows below `g.nrows`, tokens below `ntok` (padding repeats a valid
    // token), super-blocks below `nsb`, as validated by `Gemm::new`.
    unsafe {
        let act = |t: usize, sb: usize| k_act(g.a.as_ptr().add(t * g.a_stride + sb * 292));
        let mut t0 = 0;
        while t0 < ntok {
            let t1 = (t0 + tb).min(ntok);
            for r in 0..g.nrows {
                let w = g.w.as_ptr().add(r * g.w_stride);
                kb.clear();
                for sb in 0..nsb {
                    kb.push(unpack_k::<KIND>(w.add(sb * wbs)));
                }
                let mut t = t0;
                while t < t1 {
                    // Tokens from `t` on share `t`'s order up to the next multiple of 4 (Parity
                    // switches q4_K from Sb64 to Sb256 at `ntok - ntok % 4`, and `t0` and `tb`
                    // are multiples of 4), so groups of four never mix orders.
                    let order = token_order(g, t);
                    let n = (t1 - t).min(4);
                    let group = |j: usize, sb: usize| act(t + j.min(n - 1), sb);
                    let mut res = [0f32; 4];
                    match order {
                        KOrder::Sb64 | KOrder::Tiled => {
                            _mm_storeu_ps(res.as_mut_ptr(), k_group(&kb, order, group))
                        }
                        KOrder::Lanes8 if n == 4 => {
                            _mm_storeu_ps(res.as_mut_ptr(), lanes8_group(&kb, group))
                        }
                        KOrder::Sb256 if n == 4 => {
                            _mm_storeu_ps(res.as_mut_ptr(), k_group(&kb, order, group))
                        }
                        // Fewer than four tokens left: one at a time, not a padded group.
                        KOrder::Lanes8 => {
                            for j in 0..n {
                                let mut acc = _mm256_setzero_ps();
                                for sb in 0..nsb {
                                    acc = lanes8_step(acc, kb.get_unchecked(sb), &act(t + j, sb));
                                }
                                res[j] = hsum8(acc);
                            }
                        }
                        KOrder::Sb256 => {
                            for j in 0..n {
                                let mut acc = (0f32, 0f32);
                                for sb in 0..nsb {
                                    acc = sb256_step(acc, kb.get_unchecked(sb), &act(t + j, sb));
                                }
                                res[j] = acc.0 - acc.1;
                            }
                        }
                    }
                    for j in 0..n {
                        *out.get_unchecked_mut((t + j) * g.nrows + r) = res[j];
                    }
                    t += n;
                }
            }
            t0 = t1;
        }
    }
}

/// One row (`kb`, all its super-blocks) against four tokens (`act(j, sb)`, j < 4; padding
/// repeats a token) in [`KOrder::Lanes8`] order (q6_K's `vec_dot`, which Invariant gives every
/// q6_K token): [`lanes8_step`] with tokens 0 and 1 in the 256-bit halves of one accumulator,
/// 2 and 3 in another (the same exact lanes, the same `da·dw` product, one FMA per lane per
/// super-block), each half reduced by `hsum_float_8` at the end; lane `j` is token `j`.
///
/// # Safety
/// As [`k_group`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn lanes8_group(kb: &[KBlock], act: impl Fn(usize, usize) -> KAct) -> __m128 {
    let mut acc = [_mm512_setzero_ps(); 2];
    // SAFETY (whole body): `act` as the contract.
    unsafe {
        for (sb, b) in kb.iter().enumerate() {
            let w2 = _mm512_broadcast_i64x4(b.bsum_w);
            for (p, acc) in acc.iter_mut().enumerate() {
                let (x, y) = (act(2 * p, sb), act(2 * p + 1, sb));
                let (vx, vy) = (block_dot(b, &x), block_dot(b, &y));
                // [x.lo, y.lo] + [x.hi, y.hi]: each token's halves summed, as lanes8_step.
                let lo = _mm512_shuffle_i64x2::<0b01_00_01_00>(vx, vy);
                let hi = _mm512_shuffle_i64x2::<0b11_10_11_10>(vx, vy);
                let bs = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(x.bsums), y.bsums);
                let corr = _mm512_slli_epi32::<5>(_mm512_madd_epi16(bs, w2));
                let v = _mm512_sub_epi32(_mm512_add_epi32(lo, hi), corr);
                let d =
                    _mm512_insertf32x8::<1>(_mm512_set1_ps(x.d * b.d), _mm256_set1_ps(y.d * b.d));
                *acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(v), *acc);
            }
        }
    }
    _mm_setr_ps(
        hsum8(_mm512_castps512_ps256(acc[0])),
        hsum8(_mm512_extractf32x8_ps::<1>(acc[0])),
        hsum8(_mm512_castps512_ps256(acc[1])),
        hsum8(_mm512_extractf32x8_ps::<1>(acc[1])),
    )
}

/// One row (`kb`, all its super-blocks) against four tokens (`act(j, sb)`, j < 4; padding
/// repeats a token) in [`KOrder::Sb64`], [`KOrder::Sb256`] or [`KOrder::Tiled`] order; lane `j`
/// is token `j`. Sb256 (the q4_K/q5_K GEMV order, which Invariant uses for every token) is
/// [`sb256_step`] in four lanes: the same exact integer sums, the same two FMAs per
/// super-block with the same `dw·da` and `dmin·da` products, as [`gemv_k`]'s four-row lanes.
///
/// # Safety
/// Features as the module; `act` returns readable q8_K super-blocks for every `sb < kb.len()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn k_group(kb: &[KBlock], order: KOrder, act: impl Fn(usize, usize) -> KAct) -> __m128 {
    let mut acc = _mm_setzero_ps();
    let mut acc_min = _mm_setzero_ps();
    // SAFETY (whole body): `act` as the contract; chunks below 4.
    unsafe {
        for (sb, b) in kb.iter().enumerate() {
            let a = [act(0, sb), act(1, sb), act(2, sb), act(3, sb)];
            let da = _mm_setr_ps(a[0].d, a[1].d, a[2].d, a[3].d);
            if order == KOrder::Tiled {
                let mut v = [_mm512_setzero_si512(); 4];
                for j in 0..4 {
                    let corr = _mm256_slli_epi32::<5>(_mm256_madd_epi16(a[j].bsums, b.bsum_w));
                    v[j] = _mm512_sub_epi32(block_dot(b, &a[j]), _mm512_zextsi256_si512(corr));
                }
                let res = _mm_mul_ps(_mm_cvtepi32_ps(reduce4(v)), _mm_set1_ps(b.d));
                acc = _mm_fmadd_ps(res, da, acc);
            } else if order == KOrder::Sb256 {
                let mut v = [_mm512_setzero_si512(); 4];
                let mut m = [_mm256_setzero_si256(); 4];
                for j in 0..4 {
                    v[j] = block_dot(b, &a[j]);
                    m[j] = _mm256_madd_epi16(a[j].bsums, b.bsum_w);
                }
                let h =
                    _mm256_hadd_epi32(_mm256_hadd_epi32(m[0], m[1]), _mm256_hadd_epi32(m[2], m[3]));
                let imin =
                    _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
                let sv = _mm_mul_ps(_mm_set1_ps(b.d), da);
                let mv = _mm_mul_ps(_mm_set1_ps(b.dmin), da);
                acc = _mm_fmadd_ps(_mm_cvtepi32_ps(reduce4(v)), sv, acc);
                acc_min = _mm_fmadd_ps(_mm_cvtepi32_ps(imin), mv, acc_min);
            } else {
                // Mins: per token, lanes j = min_j·(bsums[2j] + bsums[2j+1]); pairs of
                // sub-blocks summed and transposed to one vector per 64 values.
                let mut m = [_mm256_setzero_si256(); 4];
                for j in 0..4 {
                    m[j] = _mm256_madd_epi16(a[j].bsums, b.bsum_w);
                }
                let h01 = _mm256_hadd_epi32(m[0], m[1]);
                let h23 = _mm256_hadd_epi32(m[2], m[3]);
                let (l01, l23) = (_mm256_castsi256_ps(h01), _mm256_castsi256_ps(h23));
                let lo = _mm256_shuffle_ps::<0b10_00_10_00>(l01, l23);
                let hi = _mm256_shuffle_ps::<0b11_01_11_01>(l01, l23);
                let mins = [
                    _mm256_castps256_ps128(lo),
                    _mm256_castps256_ps128(hi),
                    _mm256_extractf128_ps::<1>(lo),
                    _mm256_extractf128_ps::<1>(hi),
                ];
                let sv = _mm_mul_ps(_mm_set1_ps(b.d), da);
                let mv = _mm_mul_ps(_mm_set1_ps(b.dmin), da);
                for c in 0..4 {
                    let mut v = [_mm512_setzero_si512(); 4];
                    for j in 0..4 {
                        v[j] = chunk_dot(b, &a[j], c, _mm512_setzero_si512());
                    }
                    let isum = _mm_cvtepi32_ps(reduce4(v));
                    acc = _mm_fmadd_ps(isum, sv, acc);
                    let imin = _mm_cvtepi32_ps(_mm_castps_si128(mins[c]));
                    acc_min = _mm_fmadd_ps(imin, mv, acc_min);
                }
            }
        }
    }
    if order == KOrder::Tiled {
        acc
    } else {
        _mm_sub_ps(acc, acc_min)
    }
}

/// GEMV (one token) of a k-quant: super-blocks unpacked as they stream past. q4_K/q5_K
/// ([`KOrder::Sb256`]) take four rows at a time, so one transposing reduction serves their
/// four integer sums and the f32 chains run in the lanes of one register; q6_K
/// ([`KOrder::Lanes8`]) keeps its eight lanes per row.
///
/// # Safety
/// As [`run_k`], with `g.ntok == 1`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn gemv_k<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) {
    let nsb = g.cols / QK_K;
    let wbs = k_block_bytes(KIND);
    // SAFETY (whole body): rows below `g.nrows`, super-blocks below `nsb`.
    unsafe {
        let act = |sb: usize| k_act(g.a.as_ptr().add(sb * 292));
        let mut r = 0;
        if KIND != Q6_K {
            while r + 4 <= g.nrows {
                let w = g.w.as_ptr().add(r * g.w_stride);
                let mut acc = _mm_setzero_ps();
                let mut acc_min = _mm_setzero_ps();
                for sb in 0..nsb {
                    let a = act(sb);
                    let mut v = [_mm512_setzero_si512(); 4];
                    let mut m = [_mm256_setzero_si256(); 4];
                    let mut d = [0f32; 4];
                    let mut dm = [0f32; 4];
                    for i in 0..4 {
                        let p = w.add(i * g.w_stride + sb * wbs);
                        let q = p.wrapping_add(PF_GROUPS * 4 * g.w_stride);
                        for l in (0..wbs).step_by(64) {
                            _mm_prefetch::<_MM_HINT_T0>(q.wrapping_add(l).cast());
                        }
                        let kb = unpack_k::<KIND>(p);
                        v[i] = block_dot(&kb, &a);
                        m[i] = _mm256_madd_epi16(a.bsums, kb.bsum_w);
                        d[i] = kb.d;
                        dm[i] = kb.dmin;
                    }
                    let isum = _mm_cvtepi32_ps(reduce4(v));
                    let h = _mm256_hadd_epi32(
                        _mm256_hadd_epi32(m[0], m[1]),
                        _mm256_hadd_epi32(m[2], m[3]),
                    );
                    let imin =
                        _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
                    let da = _mm_set1_ps(a.d);
                    let sv = _mm_mul_ps(_mm_loadu_ps(d.as_ptr()), da);
                    let mv = _mm_mul_ps(_mm_loadu_ps(dm.as_ptr()), da);
                    acc = _mm_fmadd_ps(isum, sv, acc);
                    acc_min = _mm_fmadd_ps(_mm_cvtepi32_ps(imin), mv, acc_min);
                }
                _mm_storeu_ps(out.as_mut_ptr().add(r), _mm_sub_ps(acc, acc_min));
                r += 4;
            }
        }
        while r < g.nrows {
            let w = g.w.as_ptr().add(r * g.w_stride);
            *out.get_unchecked_mut(r) = if KIND == Q6_K {
                let mut acc = _mm256_setzero_ps();
                for sb in 0..nsb {
                    let p = w.add(sb * wbs);
                    let q = p.wrapping_add(PF_GROUPS * 4 * g.w_stride);
                    for l in (0..wbs).step_by(64) {
                        _mm_prefetch::<_MM_HINT_T0>(q.wrapping_add(l).cast());
                    }
                    acc = lanes8_step(acc, &unpack_k::<KIND>(p), &act(sb));
                }
                hsum8(acc)
            } else {
                let mut acc = (0f32, 0f32);
                for sb in 0..nsb {
                    acc = sb256_step(acc, &unpack_k::<KIND>(w.add(sb * wbs)), &act(sb));
                }
                acc.0 - acc.1
            };
            r += 1;
        }
    }
}
