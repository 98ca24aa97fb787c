//! AVX-512 (F, BW, VL, DQ, VNNI) matmuls of quantized weights, bit-identical to the scalar
//! reference: they sum in the float order llama.cpp's x86 CPU backend uses (see
//! `scalar::vec_dot_legacy`, `scalar::KOrder`), so our logits equal its logits.
//!
//! Integer products use VNNI. Exact integer partial sums may be grouped any way; only the f32
//! steps have to happen where ggml does them:
//! - Legacy blocks (q8_0, q5_0; q4_0 runs `iq4`): per block, eight i32 lanes of four products, one
//!   FMA per lane, the lanes reduced as `hsum_float_8` at the end. On AMD the GEMV one row at a
//!   time (one 256-bit `vpdpbusd` per block; `legacy_gemv_one_row`); elsewhere from 1, on AMD
//!   from 2, up to `SMALL_LEGACY_MAX` tokens (batched decode): two rows per 512-bit register,
//!   unsigned weight codes unpacked once per block for every token, the offset removed by starting the lanes at `-offset·Σa`. More tokens (prefill): a register holds
//!   a (row, token pair) — weights unpacked once per row chunk and broadcast to both halves, the
//!   two tokens' activations side by side, biased by +128 to be the unsigned operand, the bias
//!   removed by starting the lanes at `-128·Σw`.
//! - k-quants: the exact integer sum of a super-block (or of 64 values for the q4_K GEMM
//!   order) is reduced horizontally, 16 (row, token) pairs at a time — four rows by four
//!   tokens — so one transposing reduction serves sixteen dot products, then scaled in f32
//!   lanes that hold those pairs; q6_K's `vec_dot` order keeps eight lanes per token, two
//!   tokens per register. Which order a token takes is `scalar::token_order`: under
//!   `Numerics::Invariant` always the 1-token one, so a batched row equals what the GEMV
//!   gives that token alone.
//!
//! Multi-token calls read each weight block from memory once per call (per token block for a
//! long prefill) and apply every token while it is in cache; their buffers (prepared
//! activations, the unpacked weights of a row chunk) are per-thread scratch reused across
//! calls and never grow with the row count.
//!
//! Legacy and float orders do not depend on the batch (the GEMV and the GEMM sum each row in
//! the same order), so `Numerics` changes nothing for them.

// Tile loops index several per-row / per-token arrays with the same counter.
#![allow(clippy::needless_range_loop)]

use super::avx2::{hsum as hsum8, hsum_i32};
use super::{k4_scales_mins, k_block_bytes, legacy_block_bytes, legacy_nibbles, legacy_offset};
use super::{with_scratch, Pod};
use super::{Q5_K, Q6_K, Q8_0};
use crate::matmul::Gemm;
use crate::quant::{Q8_K_BYTES, QK, QK_K};
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
// Legacy 32-value blocks: q8_0, q5_0 against q8_0 (q4_0 runs `iq4`).

/// The 32 codes of the legacy block at `p` in value order, unsigned (`value + offset`; q4_1 /
/// q5_1: the codes themselves).
///
/// # Safety
/// Features as the module; `p` readable for one `KIND` block.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn unpack_u8<const KIND: u8>(p: *const u8) -> __m256i {
    // SAFETY (whole body): reads within the block at `p`.
    unsafe {
        if KIND == Q8_0 {
            return _mm256_xor_si256(_mm256_loadu_si256(p.add(2).cast()), _mm256_set1_epi8(-128));
        }
        let (qoff, hoff) = legacy_nibbles(KIND);
        let q = _mm_loadu_si128(p.add(qoff).cast());
        let both = _mm256_set_m128i(_mm_srli_epi16::<4>(q), q);
        let u = _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
        if hoff != 0 {
            let qh = p.add(hoff).cast::<u32>().read_unaligned();
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
    if g.ntok == 1 && legacy_gemv_one_row() {
        // SAFETY: as this function's contract.
        unsafe { gemv_legacy::<KIND>(g, out) };
    } else {
        // SAFETY: as this function's contract.
        unsafe { run_legacy_multi::<KIND>(g, out) };
    }
}

/// Whether a one-token call runs [`gemv_legacy`] (one row at a time: AMD) or
/// [`gemm_small_legacy`]'s tiles, four rows two per register (elsewhere). Both give the same
/// bits. On an Intel Xeon (family 6 model 167, KVM, cores reading 10.6 GB/s each; session 33),
/// timed alternately in one process (`gemm_bench`, medians of nine invocations), the tiles
/// ran 1.19× as fast as one row at a time on q5_0 2048 × 640 in L2 at one thread (compute-bound
/// there: 5.4 GB/s one row at a time), 1.11× on q8_0, 1.17× (q5_0) and 1.24× (q8_0) on 32768 ×
/// 4096 from DRAM at two threads, and even (1.02×) on Gemma's 262144 × 640 q8_0 LM head, which
/// the memory paces; Gemma 3 270M decoded 10 % faster (q5_0 is a fifth of its time). On an
/// AMD EPYC Zen 4 four rows at a time streamed a matrix from DRAM at half the one-row rate (see
/// [`gemv_legacy`]; that was before the tiles' prefetch, and Zen 5 is not measured), so AMD
/// keeps the one-row GEMV.
fn legacy_gemv_one_row() -> bool {
    #[cfg(test)]
    if let Some(f) = FORCE_ONE_ROW.with(|c| c.get()) {
        return f;
    }
    super::is_amd()
}

#[cfg(test)]
std::thread_local! {
    static FORCE_ONE_ROW: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with [`legacy_gemv_one_row`] forced to `one_row` on this thread.
#[cfg(test)]
pub(crate) fn with_legacy_gemv_one_row<R>(one_row: bool, f: impl FnOnce() -> R) -> R {
    super::with_forced(&FORCE_ONE_ROW, one_row, f)
}

/// GEMV (one token; AMD, [`legacy_gemv_one_row`]): one row at a time, one 256-bit accumulator
/// (the row's eight lanes), so the weights are read as one sequential stream; activations prepared once per call. On an
/// AMD EPYC (Zen 4) this streams a Q8_0 matrix larger than L3 at 15-18 GB/s from one core,
/// where four rows at a time two per 512-bit register (four interleaved streams, software
/// prefetch) reached 8 GB/s (Gemma's 262144 × 640 LM head: 21 ms → 11 ms). Each block is
/// prefetched `stream_prefetch` bytes ahead: on an Intel Xeon whose cores read 10 GB/s each
/// (session 31) that LM head took 23 ms instead of 31 at one thread and 11.7 instead of 15.7 at
/// two; at two threads, back to back (so largely from that host's L3), a q8_0 4096 × 14336
/// matrix 1.49 ms instead of 2.1-4.5 and q5_0 1.5 instead of 1.7. A burst of prefetches per row
/// instead (rows of 10 KB) made q5_0 slower. (q4_1 / q5_1 run `legacy_min`, q4_0 `iq4`.)
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
            codes.push(a);
            let sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, a);
            corr.push(_mm256_mullo_epi32(sums, negk));
        }
        // One sequential stream, prefetched as the k-quant GEMVs' (`super::stream_prefetch`).
        let pf = super::stream_prefetch();
        for r in 0..g.nrows {
            let w = g.w.as_ptr().add(r * g.w_stride);
            let mut acc = _mm256_setzero_ps();
            for b in 0..nb {
                let p = w.add(b * bs);
                if pf > 0 {
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(pf).cast());
                }
                let isum = _mm256_dpbusd_epi32(
                    *corr.get_unchecked(b),
                    unpack_u8::<KIND>(p),
                    *codes.get_unchecked(b),
                );
                let d = _mm256_set1_ps(f16_to_f32(p) * *g.a_scales.get_unchecked(b));
                acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(isum), acc);
            }
            *out.get_unchecked_mut(r) = hsum8(acc);
        }
    }
}

/// Rows of at most this many super-blocks (4096 values) run [`gemv_k`] one row at a time
/// (q4_K / q5_K: `gemv_k4`, which reads rows one after another too).
const GEMV_K_ONE_ROW_MAX_SB: usize = 16;

/// How many 4-row groups ahead the four-row k-quant GEMVs prefetch.
const PF_GROUPS: usize = 2;

/// The unsigned codes of the blocks at `p0` (low half) and `p1` (high half), value order.
///
/// # Safety
/// Features as the module; `p0`, `p1` readable for one `KIND` block each.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn unpack_pair_u8<const KIND: u8>(p0: *const u8, p1: *const u8) -> __m512i {
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
        let (qoff, hoff) = legacy_nibbles(KIND);
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
        if hoff != 0 {
            let h0 = p0.add(hoff).cast::<u32>().read_unaligned() as u64;
            let h1 = p1.add(hoff).cast::<u32>().read_unaligned() as u64;
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
    /// Explicit padding (written as zeros), so a scratch buffer that held `WBlock`s holds only
    /// initialized bytes whatever type views it next.
    _pad: [f32; 7],
}

/// One token pair's block for the GEMM: both tokens' codes biased by +128 (token `2q` in the
/// low half), and their scales spread over the halves.
#[derive(Clone, Copy)]
struct APair {
    a: __m512i,
    d: __m512,
}

// SAFETY: vectors and floats without implicit padding: every bit pattern is a value; alignment
// 32 / 64.
unsafe impl Pod for WBlock {}
// SAFETY: as above.
unsafe impl Pod for APair {}

/// Up to this many tokens, [`gemm_small_legacy`]; from there on [`gemm_legacy`].
const SMALL_LEGACY_MAX: usize = 40;

/// Bytes of unpacked weights [`gemm_legacy`] keeps per row chunk, and of prepared activations
/// one of its token blocks spans: each pass streams the other operand, so both as large as L2
/// (1-2 MiB) allows. At K = 14336 (43 KiB of unpacked blocks per row) 192 KiB each left 4-row
/// chunks that re-read every token's activations per 4 rows: q8_0 4096×14336×512 on a Zen 4
/// took 378 ms with 192/192 KiB and 248 ms with these (2 threads).
const WCHUNK_BYTES: usize = 768 * 1024;
const ABLOCK_BYTES: usize = 384 * 1024;

/// The tiled path for `g.ntok` tokens (one token too, where [`legacy_gemv_one_row`] says so),
/// on this thread's scratch buffers.
///
/// # Safety
/// As [`run_legacy`], with `g.ntok >= 1`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn run_legacy_multi<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) {
    let nb = g.cols / QK;
    if g.ntok <= SMALL_LEGACY_MAX {
        // Per token and block: the codes broadcast to both halves, then their corrections.
        with_scratch(0, 2 * g.ntok * nb, |prep: &mut [__m512i]| {
            // SAFETY: as this function's contract; `prep` holds `2 · ntok · nb` vectors.
            unsafe { gemm_small_legacy::<KIND>(g, prep, out) }
        })
    } else {
        let rc = (WCHUNK_BYTES / (nb * core::mem::size_of::<WBlock>()).max(1)).max(4) / 4 * 4;
        let rc = rc.min(g.nrows);
        with_scratch(0, g.ntok.div_ceil(2) * nb, |act: &mut [APair]| {
            with_scratch(1, rc * nb, |wsc: &mut [WBlock]| {
                // SAFETY: as this function's contract; the buffers hold every pair's blocks
                // and `rc` rows' blocks.
                unsafe { gemm_legacy::<KIND>(g, act, wsc, rc, out) }
            })
        })
    }
}

/// Few tokens (decode of several sequences; one token, the GEMV, on Intel): four rows at a time
/// two per register, with up to eight tokens per pass over the rows' blocks, so each weight block is loaded and unpacked
/// once for all of them and streamed from memory once per call. Per (row, token) the lanes
/// are [`gemv_legacy`]'s, so the results equal its bit for bit.
///
/// # Safety
/// As [`run_legacy`]; `prep` holds `2 · g.ntok · nb` vectors.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn gemm_small_legacy<const KIND: u8>(g: &Gemm<'_>, prep: &mut [__m512i], out: &mut [f32]) {
    let nb = g.cols / QK;
    let ones = _mm256_set1_epi8(1);
    let negk = _mm256_set1_epi32(-legacy_offset(KIND));
    let (codes, corr) = prep.split_at_mut(g.ntok * nb);
    // SAFETY (whole body): tokens below `g.ntok`, blocks below `nb`, rows below `g.nrows`.
    unsafe {
        for t in 0..g.ntok {
            for b in 0..nb {
                let a = _mm256_loadu_si256(g.a.as_ptr().add(t * g.a_stride + b * 34 + 2).cast());
                *codes.get_unchecked_mut(t * nb + b) = _mm512_broadcast_i64x4(a);
                let sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, a);
                *corr.get_unchecked_mut(t * nb + b) =
                    _mm512_broadcast_i64x4(_mm256_mullo_epi32(sums, negk));
            }
        }
        let (codes, corr) = (&*codes, &*corr);
        let mut r = 0;
        while r + 4 <= g.nrows {
            let mut t = 0;
            while t < g.ntok {
                // The first pass over the rows prefetches the rows ahead; later ones find
                // these rows in L1/L2.
                let pf = t == 0;
                match g.ntok - t {
                    1 => small_legacy_tile::<KIND, 1>(g, codes, corr, r, t, pf, out),
                    2 => small_legacy_tile::<KIND, 2>(g, codes, corr, r, t, pf, out),
                    3 => small_legacy_tile::<KIND, 3>(g, codes, corr, r, t, pf, out),
                    4 => small_legacy_tile::<KIND, 4>(g, codes, corr, r, t, pf, out),
                    5 => small_legacy_tile::<KIND, 5>(g, codes, corr, r, t, pf, out),
                    6 => small_legacy_tile::<KIND, 6>(g, codes, corr, r, t, pf, out),
                    7 => small_legacy_tile::<KIND, 7>(g, codes, corr, r, t, pf, out),
                    _ => small_legacy_tile::<KIND, 8>(g, codes, corr, r, t, pf, out),
                }
                t += 8;
            }
            r += 4;
        }
        // The last rows one at a time, as the GEMV's.
        let bs = legacy_block_bytes(KIND);
        while r < g.nrows {
            let w = g.w.as_ptr().add(r * g.w_stride);
            for t in 0..g.ntok {
                let mut acc = _mm256_setzero_ps();
                for b in 0..nb {
                    let p = w.add(b * bs);
                    let i = t * nb + b;
                    let isum = _mm256_dpbusd_epi32(
                        _mm512_castsi512_si256(*corr.get_unchecked(i)),
                        unpack_u8::<KIND>(p),
                        _mm512_castsi512_si256(*codes.get_unchecked(i)),
                    );
                    let d = _mm256_set1_ps(f16_to_f32(p) * *g.a_scales.get_unchecked(i));
                    acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(isum), acc);
                }
                *out.get_unchecked_mut(t * g.nrows + r) = hsum8(acc);
            }
            r += 1;
        }
    }
}

/// Rows `r..r+4` × tokens `t0..t0+T` of [`gemm_small_legacy`]: rows `r`, `r+1` in the halves of
/// one register and `r+2`, `r+3` of another, per token; one FMA per lane per block with
/// `d = dw·da`, each half reduced by `hsum_float_8`.
///
/// # Safety
/// Features as the module; `r + 4 <= g.nrows`, `t0 + T <= g.ntok`, `codes` / `corr` prepared
/// for every token.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn small_legacy_tile<const KIND: u8, const T: usize>(
    g: &Gemm<'_>,
    codes: &[__m512i],
    corr: &[__m512i],
    r: usize,
    t0: usize,
    prefetch: bool,
    out: &mut [f32],
) {
    let nb = g.cols / QK;
    let bs = legacy_block_bytes(KIND);
    let st = g.w_stride;
    let sel_a = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    let sel_b = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    let mut acc_a = [_mm512_setzero_ps(); T];
    let mut acc_b = [_mm512_setzero_ps(); T];
    // SAFETY (whole body): blocks below `nb` of rows `r..r+4` and of tokens `t0..t0+T`.
    unsafe {
        let w = g.w.as_ptr().add(r * st);
        for b in 0..nb {
            let p = w.add(b * bs);
            if prefetch {
                let q = p.wrapping_add(PF_GROUPS * 4 * st);
                for i in 0..4 {
                    _mm_prefetch::<_MM_HINT_T0>(q.wrapping_add(i * st).cast());
                }
            }
            let (ua, ub) = (
                unpack_pair_u8::<KIND>(p, p.add(st)),
                unpack_pair_u8::<KIND>(p.add(2 * st), p.add(3 * st)),
            );
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
            let dz = _mm512_castps128_ps512(_mm_cvtph_ps(dh));
            let (dwa, dwb) = (
                _mm512_permutexvar_ps(sel_a, dz),
                _mm512_permutexvar_ps(sel_b, dz),
            );
            for j in 0..T {
                let i = (t0 + j) * nb + b;
                let c = *corr.get_unchecked(i);
                let a = *codes.get_unchecked(i);
                let da = _mm512_set1_ps(*g.a_scales.get_unchecked(i));
                let ia = _mm512_dpbusd_epi32(c, ua, a);
                let ib = _mm512_dpbusd_epi32(c, ub, a);
                acc_a[j] =
                    _mm512_fmadd_ps(_mm512_mul_ps(dwa, da), _mm512_cvtepi32_ps(ia), acc_a[j]);
                acc_b[j] =
                    _mm512_fmadd_ps(_mm512_mul_ps(dwb, da), _mm512_cvtepi32_ps(ib), acc_b[j]);
            }
        }
        for j in 0..T {
            let o = out.as_mut_ptr().add((t0 + j) * g.nrows + r);
            *o = hsum8(_mm512_castps512_ps256(acc_a[j]));
            *o.add(1) = hsum8(_mm512_extractf32x8_ps::<1>(acc_a[j]));
            *o.add(2) = hsum8(_mm512_castps512_ps256(acc_b[j]));
            *o.add(3) = hsum8(_mm512_extractf32x8_ps::<1>(acc_b[j]));
        }
    }
}

/// GEMM (more tokens, prefill). The tokens run in pairs, prepared once per call; the rows run
/// in chunks of `rc` whose unpacked blocks (`wsc`) stay in L2 while every token block passes
/// over them, so each weight block is read from memory and unpacked once per call and no
/// buffer grows with the row count. Tiles of 4 rows × 4 pairs keep 16 accumulators in
/// registers for the whole row length (the per-lane chains must run over all blocks in order).
///
/// # Safety
/// As [`run_legacy`]; `act` holds `nb` blocks of every token pair, `wsc` `nb` blocks of `rc`
/// rows, `rc >= 1` unless `g.nrows == 0`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn gemm_legacy<const KIND: u8>(
    g: &Gemm<'_>,
    act: &mut [APair],
    wsc: &mut [WBlock],
    rc: usize,
    out: &mut [f32],
) {
    const R: usize = 4;
    const P: usize = 4;
    let nb = g.cols / QK;
    let bs = legacy_block_bytes(KIND);
    let off = _mm256_set1_epi8(legacy_offset(KIND) as u8 as i8);
    let ones = _mm256_set1_epi8(1);
    let npairs = g.ntok.div_ceil(2);
    // Pairs per token block: their prepared activations (128 bytes per block) within L2.
    let pb = (ABLOCK_BYTES / (nb * 128).max(1)).max(P) / P * P;
    // SAFETY (whole body): rows below `g.nrows`, tokens below `g.ntok` (an odd last token's
    // partner is a zero block, never read from `g.a`), blocks below `nb`, chunk rows below `rc`.
    unsafe {
        let bias = _mm256_set1_epi8(-128);
        for q in 0..npairs {
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
                *act.get_unchecked_mut(q * nb + b) = APair {
                    a: _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi),
                    d: _mm512_insertf32x8::<1>(
                        _mm512_castps256_ps512(_mm256_set1_ps(d0)),
                        _mm256_set1_ps(d1),
                    ),
                };
            }
        }
        let act = &*act;
        let mut r0 = 0;
        while r0 < g.nrows {
            let r1 = (r0 + rc).min(g.nrows);
            for r in r0..r1 {
                let w = g.w.as_ptr().add(r * g.w_stride);
                for b in 0..nb {
                    let p = w.add(b * bs);
                    let sw = _mm256_sub_epi8(unpack_u8::<KIND>(p), off);
                    let sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, sw);
                    *wsc.get_unchecked_mut((r - r0) * nb + b) = WBlock {
                        w: sw,
                        corr: _mm256_sub_epi32(
                            _mm256_setzero_si256(),
                            _mm256_slli_epi32::<7>(sums),
                        ),
                        d: f16_to_f32(p),
                        _pad: [0.0; 7],
                    };
                }
            }
            let wsc = &*wsc;
            let mut q0 = 0;
            while q0 < npairs {
                let q1 = (q0 + pb).min(npairs);
                let mut r = r0;
                while r < r1 {
                    let nr = if r1 - r >= R { R } else { 1 };
                    let mut q = q0;
                    while q < q1 {
                        let np = if q1 - q >= P { P } else { 1 };
                        match (nr, np) {
                            (R, P) => legacy_tile::<R, P>(g, wsc, act, r0, r, q, out),
                            (R, _) => legacy_tile::<R, 1>(g, wsc, act, r0, r, q, out),
                            (_, P) => legacy_tile::<1, P>(g, wsc, act, r0, r, q, out),
                            _ => legacy_tile::<1, 1>(g, wsc, act, r0, r, q, out),
                        }
                        q += np;
                    }
                    r += nr;
                }
                q0 = q1;
            }
            r0 = r1;
        }
    }
}

/// Rows `r..r+R` × token pairs `q..q+P` over all blocks, written to `out` (the second token of
/// a pair only when it exists).
///
/// # Safety
/// Features as the module; `wsc` holds the blocks of rows `c0..` (the chunk from `c0`, which
/// includes `r..r+R`), `act` those of every pair, `r + R <= g.nrows`, `2(q + P - 1) < g.ntok`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn legacy_tile<const R: usize, const P: usize>(
    g: &Gemm<'_>,
    wsc: &[WBlock],
    act: &[APair],
    c0: usize,
    r: usize,
    q: usize,
    out: &mut [f32],
) {
    let nb = g.cols / QK;
    let mut acc = [[_mm512_setzero_ps(); P]; R];
    // SAFETY (whole body): indices as the contract.
    unsafe {
        for b in 0..nb {
            let mut ap = [act.get_unchecked(0); P];
            for j in 0..P {
                ap[j] = act.get_unchecked((q + j) * nb + b);
            }
            for i in 0..R {
                let wb = wsc.get_unchecked((r - c0 + i) * nb + b);
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
                *out.get_unchecked_mut(t * g.nrows + r + i) = hsum8(lo);
                if t + 1 < g.ntok {
                    let hi = _mm512_extractf32x8_ps::<1>(acc[i][j]);
                    *out.get_unchecked_mut((t + 1) * g.nrows + r + i) = hsum8(hi);
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
    pub(super) u: [__m512i; 4],
    sc: [__m512i; 4],
    pub(super) d: f32,
    pub(super) dmin: f32,
    bsum_w: __m256i,
    /// q4_K/q5_K: the 8 mins (i16), once each.
    m8: __m128i,
}

/// # Safety
/// Features as the module; `p` readable for one `KIND` super-block.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn unpack_k<const KIND: u8>(p: *const u8) -> KBlock {
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
                m8: _mm_setzero_si128(),
            }
        } else {
            let d = f16_to_f32(p);
            let dmin = f16_to_f32(p.add(2));
            let (scales, mins) = k4_scales_mins(&*p.add(4).cast::<[u8; 12]>());
            let sc512 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(scales as i64)));
            let m = _mm_cvtsi64_si128(mins as i64);
            let bsum_w = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m));
            let m8 = _mm_cvtepu8_epi16(m);
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
                m8,
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
pub(super) fn reduce4(v: [__m512i; 4]) -> __m128i {
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

/// One super-block of [`KOrder::Tiled`] for q6_K: the exact sum less the offset 32 via
/// `bsums`, then `acc = fma(isum · d, da, acc)`.
///
/// # Safety
/// As [`chunk_dot`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn tiled_step(acc: f32, b: &KBlock, a: &KAct) -> f32 {
    // SAFETY: as this function's contract.
    let raw = _mm512_reduce_add_epi32(unsafe { block_dot(b, a) });
    let corr = hsum_i32(_mm256_madd_epi16(a.bsums, b.bsum_w));
    ((raw - 32 * corr) as f32 * b.d).mul_add(a.d, acc)
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
    if g.ntok == 0 || g.nrows == 0 {
        return;
    }
    if g.ntok >= LANES_MIN_TOKENS {
        // From 16 tokens every token sums in Sb64, Sb256 or Tiled (`token_order`).
        // SAFETY: as this function's contract; the rest is this entry point's own problem.
        unsafe { super::kq_lanes::gemm_then_rest::<KIND>(g, out, run_k::<KIND>) };
        return;
    }
    let nsb = g.cols / QK_K;
    let ngroups = g.ntok.div_ceil(4);
    // Token block (whole groups of four): its activations stay in L2 while the rows stream past.
    let gb = (KBLOCK_BYTES / (4 * g.a_stride).max(1)).clamp(1, ngroups);
    with_scratch(0, ngroups * nsb, |groups: &mut [KGroup]| {
        with_scratch(1, gb, |accs: &mut [[__m512; 8]]| {
            // SAFETY: as this function's contract; the buffers hold every group's super-blocks
            // and one block of groups' accumulators.
            unsafe { gemm_k::<KIND>(g, groups, accs, out) }
        })
    })
}

/// From this many tokens on, the k-quant GEMM puts tokens in the register lanes
/// (`kq_lanes`).
const LANES_MIN_TOKENS: usize = 16;

/// Bytes of activations one token block of [`gemm_k`] spans (L2-resident).
const KBLOCK_BYTES: usize = 512 * 1024;

/// One group of (up to) four tokens at one super-block, prepared once per call for
/// [`gemm_k`]; a missing token's fields are zero.
#[derive(Clone, Copy)]
struct KGroup {
    /// q4_K/q5_K: in the 128-bit lane of token `t`, its 8 sums `bsums[2j] + bsums[2j+1]`
    /// (i16), so one `vpmaddwd` with a row's 8 mins gives the four tokens' per-64-value mins.
    s: __m512i,
    /// Lane `4t + r`: token `t`'s scale (the tile's lanes are token-major).
    da4: __m512,
    /// q6_K: tokens `2p` and `2p + 1`'s 16 `bsums` (i16), side by side.
    bs2: [__m512i; 2],
    /// q6_K: tokens `2p` and `2p + 1`'s scales, each over its 8 lanes.
    da8: [__m512; 2],
}

// SAFETY: vectors only: every bit pattern is a value; alignment 64.
unsafe impl Pod for KGroup {}

/// The group of tokens `t0..t0+n` (`n <= 4`) at super-block `sb`.
///
/// # Safety
/// Features as the module; `t0 + n <= g.ntok`, `sb < g.cols / QK_K`, `g` of a k-quant.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn k_prep<const KIND: u8>(g: &Gemm<'_>, t0: usize, n: usize, sb: usize) -> KGroup {
    let mut s = [0i16; 32];
    let mut da4 = [0f32; 16];
    let mut bs2 = [[0i16; 32]; 2];
    let mut da8 = [[0f32; 16]; 2];
    for t in 0..n {
        // SAFETY: token `t0 + t` and super-block `sb` lie inside the activations.
        let p = unsafe { g.a.as_ptr().add((t0 + t) * g.a_stride + sb * Q8_K_BYTES) };
        // SAFETY: q8_K super-block: f32 d at 0, 16 i16 bsums at 4 + 256.
        let (d, bs) = unsafe {
            (
                p.cast::<f32>().read_unaligned(),
                p.add(4 + QK_K).cast::<[i16; 16]>().read_unaligned(),
            )
        };
        for j in 0..8 {
            // |bsums| <= 16 · 128: a pair fits in i16.
            s[8 * t + j] = bs[2 * j] + bs[2 * j + 1];
        }
        for r in 0..4 {
            da4[4 * t + r] = d;
        }
        bs2[t / 2][16 * (t % 2)..16 * (t % 2) + 16].copy_from_slice(&bs);
        for l in 0..8 {
            da8[t / 2][8 * (t % 2) + l] = d;
        }
    }
    // SAFETY: the arrays are 64 bytes each.
    unsafe {
        KGroup {
            s: _mm512_loadu_si512(s.as_ptr().cast()),
            da4: _mm512_loadu_ps(da4.as_ptr()),
            bs2: [
                _mm512_loadu_si512(bs2[0].as_ptr().cast()),
                _mm512_loadu_si512(bs2[1].as_ptr().cast()),
            ],
            da8: [
                _mm512_loadu_ps(da8[0].as_ptr()),
                _mm512_loadu_ps(da8[1].as_ptr()),
            ],
        }
    }
}

/// Four rows' super-block `sb`, unpacked once for every token of a block, with the per-row
/// values the tiles spread over their token-major lanes.
#[derive(Clone, Copy)]
struct KRows {
    kb: [KBlock; 4],
    /// Lane `4t + r`: row `r`'s `d` / `dmin`.
    dw: __m512,
    dm: __m512,
    /// q4_K/q5_K: row `r`'s 8 mins (i16) in every 128-bit lane. q6_K: its 16 scales (i16) in
    /// both 256-bit halves.
    m: [__m512i; 4],
}

/// # Safety
/// Features as the module; `p[i]` readable for one `KIND` super-block each.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn k_rows<const KIND: u8>(p: [*const u8; 4]) -> KRows {
    // SAFETY: as this function's contract.
    let kb = unsafe { p.map(|p| unpack_k::<KIND>(p)) };
    let dw = _mm512_broadcast_f32x4(_mm_setr_ps(kb[0].d, kb[1].d, kb[2].d, kb[3].d));
    let dm = _mm512_broadcast_f32x4(_mm_setr_ps(kb[0].dmin, kb[1].dmin, kb[2].dmin, kb[3].dmin));
    let m = kb.map(|b| {
        if KIND == Q6_K {
            _mm512_broadcast_i64x4(b.bsum_w)
        } else {
            _mm512_broadcast_i32x4(b.m8)
        }
    });
    KRows { kb, dw, dm, m }
}

/// Per 128-bit lane `L`: `[Σ_L v0, Σ_L v1, Σ_L v2, Σ_L v3]`, the sums of each vector's four i32
/// of that lane (exact).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
pub(super) fn reduce_lanes(v0: __m512i, v1: __m512i, v2: __m512i, v3: __m512i) -> __m512i {
    let a01 = _mm512_add_epi32(_mm512_unpacklo_epi32(v0, v1), _mm512_unpackhi_epi32(v0, v1));
    let a23 = _mm512_add_epi32(_mm512_unpacklo_epi32(v2, v3), _mm512_unpackhi_epi32(v2, v3));
    _mm512_add_epi32(
        _mm512_unpacklo_epi64(a01, a23),
        _mm512_unpackhi_epi64(a01, a23),
    )
}

/// Lane `4t + r` = the sum of all 16 lanes of `v[4t + r]` (exact), for `t < T` (the others
/// zero).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
fn reduce16<const T: usize>(v: &[__m512i; 16]) -> __m512i {
    let mut b = [_mm512_setzero_si512(); 4];
    for t in 0..T {
        b[t] = reduce_lanes(v[4 * t], v[4 * t + 1], v[4 * t + 2], v[4 * t + 3]);
    }
    // Lane group t of the result: the four 128-bit lanes of b[t] summed.
    let s01 = _mm512_add_epi32(
        _mm512_shuffle_i64x2::<0b10_00_10_00>(b[0], b[1]),
        _mm512_shuffle_i64x2::<0b11_01_11_01>(b[0], b[1]),
    );
    let s23 = _mm512_add_epi32(
        _mm512_shuffle_i64x2::<0b10_00_10_00>(b[2], b[3]),
        _mm512_shuffle_i64x2::<0b11_01_11_01>(b[2], b[3]),
    );
    _mm512_add_epi32(
        _mm512_shuffle_i64x2::<0b10_00_10_00>(s01, s23),
        _mm512_shuffle_i64x2::<0b11_01_11_01>(s01, s23),
    )
}

/// Four rows × tokens `0..T` of one group at one super-block: every (row, token) takes one
/// step of its order's float chain in `acc` (Sb256 / Sb64: `[acc, acc_min]` with lane `4t + r`;
/// Tiled: `[acc]`; Lanes8: `acc[2r + p]` holds row `r` with tokens `2p`, `2p + 1` in its
/// halves). The integer sums are exact, so grouping them differently from the scalar
/// reference changes nothing; the f32 steps are its own, per (row, token), in order.
///
/// # Safety
/// Features as the module; `a[t]` readable for the 256 codes and 16 bsums of token `t`'s
/// super-block (`t < T`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn k_tile<const KIND: u8, const T: usize>(
    rows: &KRows,
    grp: &KGroup,
    a: &[*const u8; 4],
    order: KOrder,
    acc: &mut [__m512; 8],
) {
    let kb = &rows.kb;
    let mut v = [_mm512_setzero_si512(); 16];
    // SAFETY (whole body): reads within the tokens' super-blocks.
    unsafe {
        if order == KOrder::Sb64 {
            // Row r's mins against the four tokens: lane (t, c) = chunk c's mins of (r, t).
            let x = rows.m.map(|m| _mm512_madd_epi16(grp.s, m));
            let lo01 = _mm512_unpacklo_epi32(x[0], x[1]);
            let hi01 = _mm512_unpackhi_epi32(x[0], x[1]);
            let lo23 = _mm512_unpacklo_epi32(x[2], x[3]);
            let hi23 = _mm512_unpackhi_epi32(x[2], x[3]);
            // Chunk c's mins, lane 4t + r.
            let mins = [
                _mm512_unpacklo_epi64(lo01, lo23),
                _mm512_unpackhi_epi64(lo01, lo23),
                _mm512_unpacklo_epi64(hi01, hi23),
                _mm512_unpackhi_epi64(hi01, hi23),
            ];
            let sv = _mm512_mul_ps(rows.dw, grp.da4);
            let mv = _mm512_mul_ps(rows.dm, grp.da4);
            for c in 0..4 {
                for r in 0..4 {
                    let (u, sc) = (kb[r].u[c], kb[r].sc[c]);
                    for t in 0..T {
                        let av = _mm512_loadu_si512(a[t].add(64 * c).cast());
                        let pr = _mm512_maddubs_epi16(u, av);
                        v[4 * t + r] = _mm512_dpwssd_epi32(_mm512_setzero_si512(), pr, sc);
                    }
                }
                let isum = _mm512_cvtepi32_ps(reduce16::<T>(&v));
                acc[0] = _mm512_fmadd_ps(isum, sv, acc[0]);
                acc[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mins[c]), mv, acc[1]);
            }
            return;
        }
        for c in 0..4 {
            for r in 0..4 {
                let (u, sc) = (kb[r].u[c], kb[r].sc[c]);
                for t in 0..T {
                    let av = _mm512_loadu_si512(a[t].add(64 * c).cast());
                    let pr = _mm512_maddubs_epi16(u, av);
                    v[4 * t + r] = _mm512_dpwssd_epi32(v[4 * t + r], pr, sc);
                }
            }
        }
        match order {
            KOrder::Lanes8 => {
                for p in 0..T.div_ceil(2) {
                    for r in 0..4 {
                        // [x.lo, y.lo] + [x.hi, y.hi]: each token's halves summed, as
                        // `lanes8_step`, less the offset 32 through the bsums.
                        let (x, y) = (v[8 * p + r], v[8 * p + 4 + r]);
                        let lo = _mm512_shuffle_i64x2::<0b01_00_01_00>(x, y);
                        let hi = _mm512_shuffle_i64x2::<0b11_10_11_10>(x, y);
                        let corr = _mm512_slli_epi32::<5>(_mm512_madd_epi16(grp.bs2[p], rows.m[r]));
                        let s = _mm512_sub_epi32(_mm512_add_epi32(lo, hi), corr);
                        let d = _mm512_mul_ps(grp.da8[p], _mm512_set1_ps(kb[r].d));
                        acc[2 * r + p] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(s), acc[2 * r + p]);
                    }
                }
            }
            KOrder::Tiled if KIND != Q6_K => {
                // q4_K / q5_K: fnmadd(dmin, imin, isum · d), then one FMA with da.
                let x = rows.m.map(|m| _mm512_madd_epi16(grp.s, m));
                let imin = reduce_lanes(x[0], x[1], x[2], x[3]);
                let res = _mm512_mul_ps(_mm512_cvtepi32_ps(reduce16::<T>(&v)), rows.dw);
                let res = _mm512_fnmadd_ps(rows.dm, _mm512_cvtepi32_ps(imin), res);
                acc[0] = _mm512_fmadd_ps(res, grp.da4, acc[0]);
            }
            KOrder::Tiled => {
                for t in 0..T {
                    let bs = _mm256_loadu_si256(a[t].add(QK_K).cast());
                    for r in 0..4 {
                        let corr = _mm256_slli_epi32::<5>(_mm256_madd_epi16(bs, kb[r].bsum_w));
                        v[4 * t + r] = _mm512_sub_epi32(v[4 * t + r], _mm512_zextsi256_si512(corr));
                    }
                }
                let res = _mm512_mul_ps(_mm512_cvtepi32_ps(reduce16::<T>(&v)), rows.dw);
                acc[0] = _mm512_fmadd_ps(res, grp.da4, acc[0]);
            }
            _ => {
                // Sb256: the super-block's sums and mins, one FMA each.
                let x = rows.m.map(|m| _mm512_madd_epi16(grp.s, m));
                let imin = reduce_lanes(x[0], x[1], x[2], x[3]);
                let sv = _mm512_mul_ps(rows.dw, grp.da4);
                let mv = _mm512_mul_ps(rows.dm, grp.da4);
                acc[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(reduce16::<T>(&v)), sv, acc[0]);
                acc[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(imin), mv, acc[1]);
            }
        }
    }
}

/// GEMM (several tokens) of a k-quant. The tokens run in groups of four, prepared once per
/// call, and in blocks whose activations stay in L2; per block, four rows at a time (the last
/// rows repeated to fill a group, their copies discarded) are unpacked one super-block at a
/// time, once for every group of the block, so the weights stream from memory once per block
/// (once per call for a decode batch) and no buffer grows with the row count. Each token's
/// float order is `token_order`'s (groups start at multiples of four, so a group never mixes
/// orders).
///
/// # Safety
/// As [`run_legacy`], with `g.ntok >= 1`; `groups` holds `g.ntok.div_ceil(4) · nsb` entries,
/// `accs` at least one.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn gemm_k<const KIND: u8>(
    g: &Gemm<'_>,
    groups: &mut [KGroup],
    accs: &mut [[__m512; 8]],
    out: &mut [f32],
) {
    let nsb = g.cols / QK_K;
    let wbs = k_block_bytes(KIND);
    let ngroups = g.ntok.div_ceil(4);
    let st = g.w_stride;
    // SAFETY (whole body): rows below `g.nrows` (the group's copies too), tokens below
    // `g.ntok` (padding repeats the group's last token), super-blocks below `nsb`.
    unsafe {
        for gi in 0..ngroups {
            let n = (g.ntok - 4 * gi).min(4);
            for sb in 0..nsb {
                *groups.get_unchecked_mut(gi * nsb + sb) = k_prep::<KIND>(g, 4 * gi, n, sb);
            }
        }
        let groups = &*groups;
        let mut g0 = 0;
        while g0 < ngroups {
            let g1 = (g0 + accs.len()).min(ngroups);
            let mut r = 0;
            while r < g.nrows {
                let nv = (g.nrows - r).min(4);
                let w = [0, 1, 2, 3].map(|i| g.w.as_ptr().add((r + i.min(nv - 1)) * st));
                for a in &mut accs[..g1 - g0] {
                    *a = [_mm512_setzero_ps(); 8];
                }
                for sb in 0..nsb {
                    if g0 == 0 {
                        // The rows two groups ahead (a hint: never faults), as the GEMV.
                        for p in w {
                            let q = p.wrapping_add(PF_GROUPS * 4 * st + sb * wbs);
                            for l in (0..wbs).step_by(64) {
                                _mm_prefetch::<_MM_HINT_T0>(q.wrapping_add(l).cast());
                            }
                        }
                    }
                    let rows = k_rows::<KIND>(w.map(|p| p.add(sb * wbs)));
                    for gi in g0..g1 {
                        let t0 = 4 * gi;
                        let n = (g.ntok - t0).min(4);
                        let a = [0, 1, 2, 3].map(|j| {
                            g.a.as_ptr()
                                .add((t0 + j.min(n - 1)) * g.a_stride + sb * Q8_K_BYTES + 4)
                        });
                        let grp = groups.get_unchecked(gi * nsb + sb);
                        let acc = accs.get_unchecked_mut(gi - g0);
                        let order = token_order(g, t0);
                        match n {
                            1 => k_tile::<KIND, 1>(&rows, grp, &a, order, acc),
                            2 => k_tile::<KIND, 2>(&rows, grp, &a, order, acc),
                            3 => k_tile::<KIND, 3>(&rows, grp, &a, order, acc),
                            _ => k_tile::<KIND, 4>(&rows, grp, &a, order, acc),
                        }
                    }
                }
                for gi in g0..g1 {
                    let t0 = 4 * gi;
                    let n = (g.ntok - t0).min(4);
                    let acc = accs.get_unchecked(gi - g0);
                    let o = out.as_mut_ptr();
                    match token_order(g, t0) {
                        KOrder::Lanes8 => {
                            for i in 0..nv {
                                for t in 0..n {
                                    let v = acc[2 * i + t / 2];
                                    let h = if t % 2 == 0 {
                                        _mm512_castps512_ps256(v)
                                    } else {
                                        _mm512_extractf32x8_ps::<1>(v)
                                    };
                                    *o.add((t0 + t) * g.nrows + r + i) = hsum8(h);
                                }
                            }
                        }
                        order => {
                            let v = if order == KOrder::Tiled {
                                acc[0]
                            } else {
                                _mm512_sub_ps(acc[0], acc[1])
                            };
                            let mut lanes = [0f32; 16];
                            _mm512_storeu_ps(lanes.as_mut_ptr(), v);
                            for i in 0..nv {
                                for t in 0..n {
                                    *o.add((t0 + t) * g.nrows + r + i) = lanes[4 * t + i];
                                }
                            }
                        }
                    }
                }
                r += nv;
            }
            g0 = g1;
        }
    }
}

/// Row `r` of a one-token q4_K / q5_K matmul in [`KOrder::Sb256`] order, super-blocks unpacked
/// as they stream past.
///
/// # Safety
/// As [`run_k`], with `g.ntok == 1`, `KIND` q4_K or q5_K and `r < g.nrows`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn sb256_row<const KIND: u8>(g: &Gemm<'_>, r: usize) -> f32 {
    let wbs = k_block_bytes(KIND);
    let mut acc = (0f32, 0f32);
    // SAFETY: row `r` and its super-blocks, the token's super-blocks, are in bounds.
    unsafe {
        let w = g.w.as_ptr().add(r * g.w_stride);
        for sb in 0..g.cols / QK_K {
            let a = k_act(g.a.as_ptr().add(sb * Q8_K_BYTES));
            acc = sb256_step(acc, &unpack_k::<KIND>(w.add(sb * wbs)), &a);
        }
    }
    acc.0 - acc.1
}

/// GEMV (one token) of a k-quant: super-blocks unpacked as they stream past. q4_K/q5_K rows of
/// up to [`GEMV_K_ONE_ROW_MAX_SB`] super-blocks go to `gemv_k4` (the token rearranged once, one
/// reduction per four super-blocks of a row, four rows' f32 steps in one register). Longer
/// rows of q4_K/q5_K ([`KOrder::Sb256`]) and q6_K under invariant numerics
/// ([`KOrder::Tiled`]) take four rows at a time with software prefetch, so one transposing
/// reduction serves their four integer sums and the f32 chains run in the lanes of one
/// register (on an AMD EPYC Zen 4, q4_K 8192 × 14336 from DRAM, one thread, three
/// alternations: 3.94–3.97 ms, against 4.53–4.61 ms through `gemv_k4`, both measured before
/// session 37 took both paths' sums off the stack: this one 3.36–3.58 ms since); shorter q6_K
/// rows go one at a time (one sequential stream from memory, prefetched ahead on Intel and Zen 5:
/// `super::stream_prefetch`), as does q6_K's `vec_dot` order ([`KOrder::Lanes8`], eight lanes
/// per row).
///
/// # Safety
/// As [`run_k`], with `g.ntok == 1`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn gemv_k<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) {
    let nsb = g.cols / QK_K;
    if KIND != Q6_K && nsb <= GEMV_K_ONE_ROW_MAX_SB {
        // SAFETY: as this function's contract (q4_K / q5_K, one token).
        unsafe { super::gemv_k4::gemv::<KIND>(g, out) };
        return;
    }
    let wbs = k_block_bytes(KIND);
    let tiled = token_order(g, 0) == KOrder::Tiled;
    // SAFETY (whole body): rows below `g.nrows`, super-blocks below `nsb`.
    unsafe {
        let act = |sb: usize| k_act(g.a.as_ptr().add(sb * Q8_K_BYTES));
        let mut r = 0;
        // Four rows at a time only for long rows: from DRAM on an AMD EPYC (Zen 4), one row at
        // a time (one sequential stream) ran q4_K 16384×4096 in 1.95 ms against 2.75 ms
        // (32768×2048: 2.1 against 2.8 ms), but 8192×14336 in 4.6 against 4.2 ms.
        if (KIND != Q6_K || tiled) && nsb > GEMV_K_ONE_ROW_MAX_SB {
            while r + 4 <= g.nrows {
                let w = g.w.as_ptr().add(r * g.w_stride);
                let mut acc = _mm_setzero_ps();
                let mut acc_min = _mm_setzero_ps();
                for sb in 0..nsb {
                    let a = act(sb);
                    // Row `i`'s block, called four times by name rather than in a loop over
                    // arrays: indexed by a run-time `i`, the four `d`s were stored as words
                    // and read back as one vector, past store forwarding (session 37, the
                    // same as `gemv_k4`'s groups).
                    let one = |i: usize| {
                        let p = w.add(i * g.w_stride + sb * wbs);
                        let q = p.wrapping_add(PF_GROUPS * 4 * g.w_stride);
                        for l in (0..wbs).step_by(64) {
                            _mm_prefetch::<_MM_HINT_T0>(q.wrapping_add(l).cast());
                        }
                        let kb = unpack_k::<KIND>(p);
                        let m = _mm256_madd_epi16(a.bsums, kb.bsum_w);
                        (block_dot(&kb, &a), m, kb.d, kb.dmin)
                    };
                    let (v0, m0, d0, dm0) = one(0);
                    let (v1, m1, d1, dm1) = one(1);
                    let (v2, m2, d2, dm2) = one(2);
                    let (v3, m3, d3, dm3) = one(3);
                    let v = [v0, v1, v2, v3];
                    let d = _mm_setr_ps(d0, d1, d2, d3);
                    let h = _mm256_hadd_epi32(_mm256_hadd_epi32(m0, m1), _mm256_hadd_epi32(m2, m3));
                    let imin =
                        _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
                    let da = _mm_set1_ps(a.d);
                    if KIND == Q6_K {
                        // Tiled: the offset 32 out of the exact sum, then
                        // fma(isum · d, da, acc).
                        let isum = _mm_sub_epi32(reduce4(v), _mm_slli_epi32::<5>(imin));
                        let res = _mm_mul_ps(_mm_cvtepi32_ps(isum), d);
                        acc = _mm_fmadd_ps(res, da, acc);
                        continue;
                    }
                    let isum = _mm_cvtepi32_ps(reduce4(v));
                    let sv = _mm_mul_ps(d, da);
                    let mv = _mm_mul_ps(_mm_setr_ps(dm0, dm1, dm2, dm3), da);
                    acc = _mm_fmadd_ps(isum, sv, acc);
                    acc_min = _mm_fmadd_ps(_mm_cvtepi32_ps(imin), mv, acc_min);
                }
                _mm_storeu_ps(out.as_mut_ptr().add(r), _mm_sub_ps(acc, acc_min));
                r += 4;
            }
        }
        // One sequential stream: prefetched `stream_prefetch` bytes ahead on Intel and AMD
        // Zen 5; on Zen 4 the hardware prefetchers follow it (there, prefetching 8
        // rows ahead made q6_K 8192×14336 take 8.8–10.3 ms instead of 6.2–6.8).
        let pf = super::stream_prefetch();
        let ahead = |p: *const u8| {
            if pf > 0 {
                for l in (0..wbs).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(pf + l).cast());
                }
            }
        };
        while r < g.nrows {
            let w = g.w.as_ptr().add(r * g.w_stride);
            *out.get_unchecked_mut(r) = if KIND == Q6_K && tiled {
                let mut acc = 0f32;
                for sb in 0..nsb {
                    ahead(w.add(sb * wbs));
                    acc = tiled_step(acc, &unpack_k::<KIND>(w.add(sb * wbs)), &act(sb));
                }
                acc
            } else if KIND == Q6_K {
                let mut acc = _mm256_setzero_ps();
                for sb in 0..nsb {
                    let p = w.add(sb * wbs);
                    ahead(p);
                    acc = lanes8_step(acc, &unpack_k::<KIND>(p), &act(sb));
                }
                hsum8(acc)
            } else {
                sb256_row::<KIND>(g, r)
            };
            r += 1;
        }
    }
}
