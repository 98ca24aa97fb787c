//! AVX2 (+FMA, F16C) kernels, for x86 nodes without AVX-512.
//!
//! Same structure as `avx512.rs` with 256-bit registers: one 32-value block per register for
//! the legacy types, 32 values per step for the k-quants. Without VNNI the integer dot is
//! `vpmaddubsw` + `vpmaddwd`; the unsigned operand is again the weight code (q8_0 uses
//! ggml's `abs`/`sign` trick instead, because `x + 128` would overflow `vpmaddubsw`'s i16
//! pairs). Only 16 vector registers: tiles are smaller than AVX-512's.

// Tile loops index several per-row / per-token arrays with the same counter, and the
// transcriptions of ggml keep its index arithmetic: iterator chains would obscure both.
#![allow(clippy::needless_range_loop)]

use super::tern_avx2::run_tern;
use super::{drive, k4_scales_mins, k_block_bytes, legacy_block_bytes, legacy_offset};
use super::{legacy_act, legacy_has_min, legacy_nibbles};
use super::{BF16, F16, F32, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0};
use super::{TF1, TF2, TQ1_0, TQ2_0};
use crate::dispatch::{Isa, Kernels, MatmulFn};
use crate::matmul::Gemm;
use crate::quant::{GgmlType, Q8_K_BYTES, QK, QK_K};
use crate::scalar::{token_order, KOrder};
use core::arch::x86_64::*;
use half::f16;

/// Proof that this CPU has AVX2, FMA and F16C. Only [`Avx2::new`] makes one.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx2(());

impl Avx2 {
    pub fn new() -> Option<Self> {
        let ok = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        ok.then_some(Avx2(()))
    }

    pub fn kernels(self) -> Kernels {
        Kernels {
            isa: Isa::Avx2,
            matmul_for,
            dot_f32,
            dot_f32_tinyblas,
            dot_f16,
            mad_f16,
            scale_f16,
            mad_f32,
            fa_scores,
            fa_pv,
            // ggml's AVX2 build has its own `ggml_v_expf`; we follow the AVX-512 one everywhere.
            softmax_exp,
            quantize,
            swiglu,
            widen_transpose_f16,
        }
    }
}

// The safe entry points below are private to this module and only handed out through
// `Avx2::kernels`, which needs a token, which exists only if `Avx2::new` saw the features:
// that is the SAFETY argument of every `unsafe` call in them.

fn quantize(ty: GgmlType, x: &[f32], y: &mut [u8]) -> bool {
    // SAFETY: see above (this module's features include AVX2, FMA and F16C).
    unsafe { super::quant_avx2::quantize(ty, x, y) }
}

fn matmul_for(ty: GgmlType) -> Option<MatmulFn> {
    Some(match ty {
        GgmlType::Q8_0 => mm_q8_0,
        GgmlType::Q4_0 => mm_q4_0,
        GgmlType::Q5_0 => mm_q5_0,
        GgmlType::Q4_1 => mm_q4_1,
        GgmlType::Q5_1 => mm_q5_1,
        GgmlType::Q2_K => mm_q2_k,
        GgmlType::Q3_K => mm_q3_k,
        GgmlType::Q4_K => mm_q4_k,
        GgmlType::Q5_K => mm_q5_k,
        GgmlType::Q6_K => mm_q6_k,
        GgmlType::IQ4_NL => mm_iq4_nl,
        GgmlType::IQ4_XS => mm_iq4_xs,
        GgmlType::IQ2_XXS => mm_iq2_xxs,
        GgmlType::IQ3_XXS => mm_iq3_xxs,
        GgmlType::IQ2_XS => mm_iq2_xs,
        GgmlType::IQ2_S => mm_iq2_s,
        GgmlType::IQ3_S => mm_iq3_s,
        GgmlType::IQ1_S => mm_iq1_s,
        GgmlType::IQ1_M => mm_iq1_m,
        GgmlType::F32 => mm_f32,
        GgmlType::F16 => mm_f16,
        GgmlType::BF16 => mm_bf16,
        GgmlType::TQ1_0 => mm_tq1_0,
        GgmlType::TQ2_0 => mm_tq2_0,
        GgmlType::TF2 => mm_tf2,
        GgmlType::TF1 => mm_tf1,
        _ => return None,
    })
}

macro_rules! entry {
    ($name:ident, $inner:ident, $kind:ident) => {
        fn $name(g: &Gemm<'_>, out: &mut [f32]) {
            // SAFETY: reachable only through a table built from an `Avx2` token (see above);
            // `g` was validated by `Gemm::new`, which is what the tiles rely on.
            unsafe { $inner::<$kind>(g, out) }
        }
    };
}

entry!(mm_q8_0, run_legacy, Q8_0);
entry!(mm_q5_0, run_legacy, Q5_0);
entry!(mm_q4_1, run_legacy, Q4_1);
entry!(mm_q5_1, run_legacy, Q5_1);
entry!(mm_q4_k, run_k, Q4_K);

fn mm_q3_k(g: &Gemm<'_>, out: &mut [f32]) {
    // SAFETY: reachable only through a table built from an `Avx2` token (see above), which
    // proves AVX2, FMA and F16C; `g` was validated by `Gemm::new`.
    unsafe { super::q3k::run_q3k(g, out) }
}
entry!(mm_q5_k, run_k, Q5_K);

super::grid_entries!(run_grid);

fn mm_q2_k(g: &Gemm<'_>, out: &mut [f32]) {
    // SAFETY: as `mm_iq4_nl`.
    unsafe { super::q2k::run_q2k(g, out) }
}

fn mm_q4_0(g: &Gemm<'_>, out: &mut [f32]) {
    // SAFETY: as `mm_iq4_nl`.
    unsafe { super::iq4::run_nl::<{ super::Q4_0 }>(g, out) }
}

fn mm_iq4_nl(g: &Gemm<'_>, out: &mut [f32]) {
    // SAFETY: reachable only through a table built from an `Avx2` token (see above), which
    // proves AVX2, FMA and F16C; `g` was validated by `Gemm::new`.
    unsafe { super::iq4::run_nl::<{ super::IQ4_NL }>(g, out) }
}

fn mm_iq4_xs(g: &Gemm<'_>, out: &mut [f32]) {
    // SAFETY: as `mm_iq4_nl`.
    unsafe { super::iq4::run_iq4xs(g, out) }
}
entry!(mm_q6_k, run_k, Q6_K);
entry!(mm_f32, run_float, F32);
entry!(mm_f16, run_float, F16);
entry!(mm_bf16, run_float, BF16);
entry!(mm_tq1_0, run_tern, TQ1_0);
entry!(mm_tq2_0, run_tern, TQ2_0);
entry!(mm_tf2, run_tern, TF2);
entry!(mm_tf1, run_tern, TF1);

fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    // SAFETY: token-gated as above; both slices have `n` elements.
    unsafe { dot_raw::<F32>(a.as_ptr().cast(), b.as_ptr().cast(), a.len().min(b.len())) }
}

pub(super) fn dot_f32_tinyblas(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len()) & !15;
    // SAFETY: token-gated as above (the AVX-512 table shares it: its features include AVX2 and
    // FMA); both slices have at least `n` elements.
    unsafe { dot_tinyblas_raw(a.as_ptr(), b.as_ptr(), n) }
}

/// `scalar::dot_f32_tinyblas` over `n` (a multiple of 16) elements: the 16 lanes as two
/// 8-lane FMA accumulators, halved in the same order.
///
/// # Safety
/// AVX2 and FMA available; `a` and `b` readable for `n` f32.
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_tinyblas_raw(a: *const f32, b: *const f32, n: usize) -> f32 {
    let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    // SAFETY (whole loop): offsets below `n`.
    unsafe {
        while i < n {
            lo = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(b.add(i)), lo);
            hi = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.add(i + 8)),
                _mm256_loadu_ps(b.add(i + 8)),
                hi,
            );
            i += 16;
        }
    }
    let v8 = _mm256_add_ps(lo, hi);
    let v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps(v8, 1));
    let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
    _mm_cvtss_f32(_mm_add_ss(v2, _mm_shuffle_ps(v2, v2, 1)))
}

fn dot_f16(a: &[f16], b: &[f16]) -> f32 {
    // SAFETY: as `dot_f32`.
    unsafe { dot_raw::<F16>(a.as_ptr().cast(), b.as_ptr().cast(), a.len().min(b.len())) }
}

fn mad_f16(y: &mut [f16], x: &[f16], v: f32) {
    let n = y.len().min(x.len());
    // SAFETY: token-gated as above; both slices have at least `n` elements.
    unsafe { mad_raw(y.as_mut_ptr().cast(), x.as_ptr().cast(), v, n, true) };
    crate::scalar::mad_f16(&mut y[n & !7..n], &x[n & !7..n], v);
}

fn scale_f16(y: &mut [f16], v: f32) {
    let n = y.len();
    // SAFETY: token-gated as above; `x` is not read when `mad` is false.
    unsafe { mad_raw(y.as_mut_ptr().cast(), core::ptr::null(), v, n, false) };
    crate::scalar::scale_f16(&mut y[n & !7..], v);
}

fn mad_f32(y: &mut [f32], x: &[f32], v: f32) {
    let n = y.len().min(x.len());
    // SAFETY: token-gated as above; both slices have at least `n` elements.
    unsafe { mad_f32_raw(y.as_mut_ptr(), x.as_ptr(), v, n) };
    crate::scalar::mad_f32(&mut y[n & !7..n], &x[n & !7..n], v);
}

/// `y = fma(x, v, y)` over the first `n & !7` elements (the caller does the tail).
///
/// # Safety
/// AVX2 and FMA available; `y` readable and writable, `x` readable, for `n` f32.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn mad_f32_raw(y: *mut f32, x: *const f32, v: f32, n: usize) {
    let vv = _mm256_set1_ps(v);
    let mut i = 0;
    // SAFETY (whole body): element offsets below `n & !7`.
    unsafe {
        while i + 8 <= n {
            let r = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(i)), vv, _mm256_loadu_ps(y.add(i)));
            _mm256_storeu_ps(y.add(i), r);
            i += 8;
        }
    }
}

/// `y = f16(x * v + y)` (`mad`) or `y = f16(y * v)` over the first `n & !7` elements, 8 at a
/// time (the caller finishes the tail with the scalar reference, which rounds the same way).
///
/// # Safety
/// AVX2, FMA, F16C available; `y` readable and writable for `n` u16, `x` readable for `n`
/// when `mad`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn mad_raw(y: *mut u16, x: *const u16, v: f32, n: usize, mad: bool) {
    let vv = _mm256_set1_ps(v);
    let mut i = 0;
    // SAFETY (whole body): element offsets below `n & !7`.
    unsafe {
        while i + 8 <= n {
            let yv = _mm256_cvtph_ps(_mm_loadu_si128(y.add(i).cast()));
            let r = if mad {
                let xv = _mm256_cvtph_ps(_mm_loadu_si128(x.add(i).cast()));
                _mm256_fmadd_ps(xv, vv, yv)
            } else {
                _mm256_mul_ps(yv, vv)
            };
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(r);
            _mm_storeu_si128(y.add(i).cast(), h);
            i += 8;
        }
    }
}

/// Every tile shape sums a (row, token) in `scalar::vec_dot_legacy`'s order, so the result does
/// not depend on the batch and `Numerics` changes nothing.
///
/// # Safety
/// The CPU has AVX2, FMA, F16C; `g` comes from `Gemm::new` with `out.len() == g.ntok *
/// g.nrows` and `g.wty` of kind `KIND`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_legacy<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) {
    if g.ntok == 1 && KIND == Q8_0 {
        // One row at a time: a single sequential weight stream, which the hardware prefetchers
        // follow (~20 GB/s from DRAM on the 640-column LM head, against ~8.6 GB/s for 4-row
        // tiles). q4_0/q5_0 unpack more per byte and keep the activation reuse of 4 rows.
        drive!(g, out, tile_legacy, 1, 1, KIND);
    } else if g.ntok == 1 {
        // q5_0 one row at a time ([`tile_signed`]'s 1 × 1) measured 0.83-0.87× this on an AMD
        // EPYC Zen 3, in L2 and from DRAM alike: its unpacking is shared by no token.
        drive!(g, out, tile_legacy, 4, 1, KIND);
    } else if (KIND == Q8_0 || KIND == Q5_0) && signed_one_row(g.ntok) {
        if g.ntok < 4 {
            // SAFETY: this function's contract.
            unsafe { signed_one_row_tiles::<KIND>(g, out) };
            return;
        }
        // From four tokens, the tokens' block scales block-major, so that the one-row tile
        // multiplies a block's weight scale by up to eight tokens' at once (Golden Cove, AVX2
        // forced, LM head 262144 x 640 q8_0 at 2 threads: 1.04-1.06x at 4 tokens, 1.07-1.12x
        // at 8, 1.08-1.16x at 16; 0.96-0.99x at 2 and level at 3, where the copy costs more
        // than the multiplies it saves).
        let nb = g.cols / QK;
        super::with_scratch(1, nb * g.ntok + 8, |tr: &mut [f32]| {
            for t in 0..g.ntok {
                for b in 0..nb {
                    tr[b * g.ntok + t] = g.a_scales[t * nb + b];
                }
            }
            let g = &Gemm {
                a_scales_tr: tr,
                ..*g
            };
            // SAFETY: this function's contract; `tr` is `g.a_scales` block-major, padded.
            unsafe { signed_one_row_tiles::<KIND>(g, out) }
        })
    } else if KIND == Q8_0 || KIND == Q5_0 {
        drive!(g, out, tile_signed, 4, 6, KIND);
    } else {
        drive!(g, out, tile_legacy, 2, 4, KIND);
    }
}

/// Every row of a q8_0 / q5_0 call through [`tile_signed`] one row at a time: per row, the
/// tokens of a block (about 256 KiB of activations) in as few passes as tiles of up to eight
/// allow, of near-equal widths: 12 tokens as 6 and 6, 15 as 8 and 7, where [`drive!`] takes
/// 8, 3, 1 and 8, 3, 3, 1. Each pass unpacks the row's blocks once (a second pass finds them
/// in L1). Golden Cove, AVX2 forced, against `drive!`, alternated: the 262144 × 640 q8_0 LM
/// head at 12-15 tokens 1.03-1.10× (three rounds each; single rounds 1.00-1.24×), q5_0
/// 2048 × 640 at 12 tokens 1.06-1.07×.
///
/// # Safety
/// As [`run_legacy`], `KIND` q8_0 or q5_0.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn signed_one_row_tiles<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) {
    let tb = g.token_block(super::TOKEN_BLOCK_BYTES, 8);
    let mut t0 = 0;
    while t0 < g.ntok {
        let t1 = (t0 + tb).min(g.ntok);
        let passes = (t1 - t0).div_ceil(8);
        for r in 0..g.nrows {
            let mut t = t0;
            for p in 0..passes {
                let w = (t1 - t).div_ceil(passes - p);
                // SAFETY: r < nrows and t + w <= t1 <= ntok with w <= 8; the caller has the
                // features.
                unsafe {
                    match w {
                        1 => tile_signed::<1, 1, KIND>(g, r, t, out),
                        2 => tile_signed::<1, 2, KIND>(g, r, t, out),
                        3 => tile_signed::<1, 3, KIND>(g, r, t, out),
                        4 => tile_signed::<1, 4, KIND>(g, r, t, out),
                        5 => tile_signed::<1, 5, KIND>(g, r, t, out),
                        6 => tile_signed::<1, 6, KIND>(g, r, t, out),
                        7 => tile_signed::<1, 7, KIND>(g, r, t, out),
                        _ => tile_signed::<1, 8, KIND>(g, r, t, out),
                    }
                }
                t += w;
            }
        }
        t0 = t1;
    }
}

/// Whether a q8_0 / q5_0 call of `ntok` (> 1) tokens runs [`tile_signed`] one row at a time with up
/// to eight tokens (each row's blocks one sequential stream, eight accumulators in registers)
/// rather than four rows by six tokens (24 accumulators: spilled to the stack in AVX2's 16
/// registers, and four interleaved streams that the hardware prefetchers follow badly). One row at
/// a time for decode batches (up to 16 tokens) everywhere, and for every batch on AMD. On an AMD
/// EPYC Zen 3 (AVX2 only; session 34, 2 threads, timed alternately in one process) one row at a
/// time took Gemma's 262144 × 640 q8_0 LM head at 4 tokens from 41-44 ms to 21-22 (its 1-token time
/// 11-13), at 8 tokens 1.58×, at 16 1.25-1.35×; q5_0 2048 × 640 1.31-1.42× at 4 tokens, 1.09-1.17×
/// at 8, 1.11× at 16 (0.94× at 3 in L2, 1.18× from DRAM); and prefill 4096 × 14336 × 512 q8_0
/// 1.07-1.10×, q5_0 1.02×. Two rows by four or six and three by four measured between the two.
/// Intel keeps the four-row tile past 16 tokens: measured with the AVX2 kernels forced on an
/// Intel Xeon of the Golden Cove core (the P-core of AVX2-only Alder / Raptor Lake desktops;
/// session 35, alternated runs), one row at a time takes the 262144 × 640 LM head at 4 tokens
/// 1.95-2.05× faster, at 16 1.18-1.23×, at 32 1.03-1.05×, but 4096 × 14336 q8_0 only up to 16
/// tokens (1.02-1.08×): at 32 tokens 0.92-0.94×, at 128 0.90-0.95×, at 512 0.87-0.95×; q5_0
/// about level at 32 and 512.
fn signed_one_row(ntok: usize) -> bool {
    #[cfg(test)]
    if let Some(f) = FORCE_SIGNED_ONE_ROW.with(|c| c.get()) {
        return f;
    }
    ntok <= 16 || super::is_amd()
}

#[cfg(test)]
std::thread_local! {
    static FORCE_SIGNED_ONE_ROW: std::cell::Cell<Option<bool>> =
        const { std::cell::Cell::new(None) };
}

/// Runs `f` with [`signed_one_row`] forced to `one_row` on this thread.
#[cfg(test)]
pub(crate) fn with_signed_one_row<R>(one_row: bool, f: impl FnOnce() -> R) -> R {
    super::with_forced(&FORCE_SIGNED_ONE_ROW, one_row, f)
}

/// # Safety
/// As [`run_legacy`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_k<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) {
    if g.ntok >= super::kq_lanes2::MIN_TOKENS {
        // Tokens in the register lanes; the 1-3 tokens of another order come back here.
        // SAFETY: as this function's contract; the rest is this entry point's own problem.
        unsafe { super::kq_lanes2::gemm_then_rest::<KIND>(g, out, run_k::<KIND>) };
    } else if g.ntok == 1 {
        // One row at a time, as q8_0 (Q6_K 2048 columns: ~18 GB/s against ~9.5 with 2 rows).
        drive!(g, out, tile_k, 1, 1, KIND);
    } else {
        drive!(g, out, tile_k, 2, 4, KIND);
    }
}

/// Tile shapes differ with `ntok`, float orders do not: each (row, token) has its own
/// accumulator over all columns in order, so batched rows equal 1-token rows bit for bit and
/// `Numerics` changes nothing here (as in [`run_legacy`]).
///
/// # Safety
/// As [`run_legacy`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_float<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) {
    if g.ntok == 1 {
        drive!(g, out, tile_float, 4, 1, KIND);
    } else if KIND == F32 {
        drive!(g, out, tile_float, 2, 4, F32);
    } else {
        match float_act(KIND) {
            FloatAct::Tiles => drive!(@ TILES_BLOCK, g, out, tile_float, 3, 3, KIND),
            // SAFETY: as this function's contract, `KIND` f16 or bf16, ntok > 1.
            FloatAct::Convert => unsafe { float_gemm::<KIND, true>(g, out) },
            FloatAct::Widen => unsafe { float_gemm::<KIND, false>(g, out) },
        }
    }
}

/// Columns per K chunk of [`float_block`]: a row tile's widened chunk (4 · 512 f32, 8 KiB)
/// stays in L1 while every token tile of the block passes over it.
const FKC: usize = 512;

/// Bytes of widened (f32) activations per token block of [`float_gemm`]: 27 tokens at 14336
/// columns, which stay in L2 while every row tile of the call passes over them. (Intel
/// Sapphire Rapids, 2 threads, 4096 × 14336 × 512, f16 / bf16 ms by tokens per block: 6:
/// 496 / 505, 12: 405 / 406, 18: 375 / 380, 24: 375 / 376, 27: 387 / 396, 30: 377 / 385; not
/// measured on a CPU with a smaller L2, e.g. AMD Zen 3's 512 KiB.)
const WIDE_BLOCK: usize = 3 << 19;

/// Bytes of f16 / bf16 activations per token block when the micro-kernel converts them as it
/// loads them ([`FloatAct::Convert`]): 6 MiB, 219 tokens at 14336 columns, which stay in
/// L3 while the row tiles pass over them. (AMD EPYC Zen 5, 2 threads, 4096 × 14336 × 512, f16
/// ms by f16 bytes per block: 0.75 MiB 301, 1.5 MiB 290, 3 MiB 281, 6 MiB 277, 8 MiB 284–293,
/// 14 MiB 360–384.)
const CONVERT_BLOCK: usize = 6 << 20;

/// Bytes of activations per token block of [`FloatAct::Tiles`] (72 f16 tokens at 14336
/// columns, in L3). AMD EPYC Zen 3, 1 thread, 1024 × 14336 × 512, ms by 3 × 3 tiles' block:
/// 1 MiB 195–218, 2 MiB 187–198, 4 MiB 177–188, 8 MiB 202–213 (llama.cpp 185–190); 2 threads,
/// 4096 × 14336 × 512, ratio to llama.cpp: 2 MiB 0.94×, 4 MiB 0.93×, 6 MiB 0.92×.
const TILES_BLOCK: usize = 2 << 20;

/// How the f16 / bf16 GEMM feeds the micro-kernel its activations.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum FloatAct {
    /// Widened to f32 per token block ([`WIDE_BLOCK`]): no conversion in the inner loop, where
    /// Intel runs `vcvtph2ps` on port 0 beside the FMAs.
    Widen,
    /// Converted in the inner loop from the half-size activations ([`CONVERT_BLOCK`]), with
    /// the next chunk's weights prefetched: AMD Zen cores run the conversions on other pipes
    /// than the FMAs, and read half the bytes. AMD EPYC Zen 5, both engines held to AVX2, 2
    /// threads, 4096 × 14336 × 512: f16 364 → 277 ms, bf16 367 → 292 (llama.cpp 255 / 315).
    Convert,
    /// No chunked feed: [`tile_float`]'s 3 rows × 3 tokens tile (9 accumulators: LLVM keeps
    /// tinyBLAS's 4 × 3 in the 16 registers only with a spill) converts both operands as it
    /// loads them over all columns, in token blocks of [`TILES_BLOCK`] bytes — tinyBLAS's
    /// scheme. For f16 on AMD CPUs without AVX-512 (Zen 2 / 3), where the converted feed's
    /// micro-kernel ran at 45–60 GFLOP/s a core against tinyBLAS's 80–88: AMD EPYC Zen 3, 2
    /// threads, 4096 × 14336 × 512, 0.72× llama.cpp → 0.80–0.95× (1 thread 0.63× → 0.88×).
    /// bf16 keeps [`FloatAct::Convert`] there (1.04×; the tiles measured 0.83–0.89×: its
    /// conversion is two integer instructions, not one).
    Tiles,
}

/// [`FloatAct::Tiles`] for f16 on AMD CPUs without AVX-512, [`FloatAct::Convert`] on other
/// AMD CPUs, [`FloatAct::Widen`] elsewhere (the tests run all three).
pub(crate) fn float_act(kind: u8) -> FloatAct {
    #[cfg(test)]
    if let Some(f) = FORCE_FLOAT_ACT.with(|c| c.get()) {
        return f;
    }
    if !super::is_amd() {
        FloatAct::Widen
    } else if kind == F16 && !is_x86_feature_detected!("avx512f") {
        FloatAct::Tiles
    } else {
        FloatAct::Convert
    }
}

#[cfg(test)]
std::thread_local! {
    static FORCE_FLOAT_ACT: std::cell::Cell<Option<FloatAct>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with the f16 / bf16 GEMM's activation feed forced to `a` on this thread.
#[cfg(test)]
pub(crate) fn with_float_act<R>(a: FloatAct, f: impl FnOnce() -> R) -> R {
    super::with_forced(&FORCE_FLOAT_ACT, a, f)
}

/// f16 / bf16 GEMM (more tokens). Each row tile's weights are widened once per K chunk of
/// [`FKC`] columns into an L1 buffer; the activations are either widened to f32 one token
/// block of [`WIDE_BLOCK`] bytes at a time ([`FloatAct::Widen`], no conversion in the inner
/// loop; `CONVERT` false) or converted as loaded ([`FloatAct::Convert`], `CONVERT` true); a 4
/// rows × 3 tokens register tile (tinyBLAS's AVX2 tile) of 12 FMAs per 7 loads — where converting both sides in the loop
/// costs tinyBLAS's 4 × 3 tile 7 conversions per 12 FMAs and [`tile_float`]'s 2 × 4 6 per 8
/// (on Intel one port-0 µop each, beside the FMAs' ports 0 and 1). The 12 accumulators go to
/// a per-row-tile buffer between chunks. Each (row, token) still has one 8-lane accumulator
/// over all columns in order, then the scalar tail: the bits of [`tile_float`].
///
/// # Safety
/// As [`run_legacy`], `KIND` f16 or bf16.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn float_gemm<const KIND: u8, const CONVERT: bool>(g: &Gemm<'_>, out: &mut [f32]) {
    let n = g.cols;
    if CONVERT {
        let tb = ((CONVERT_BLOCK / (2 * n.max(1))).max(3) / 3 * 3).min(g.ntok);
        let mut t0 = 0;
        while t0 < g.ntok {
            let t1 = (t0 + tb).min(g.ntok);
            let sub = Gemm {
                a: &g.a[t0 * g.a_stride..],
                ntok: t1 - t0,
                ..*g
            };
            // SAFETY: as this function's contract; the block's tokens keep their `KIND`
            // activations, which the micro-kernel converts as it loads them.
            unsafe { float_block::<KIND, KIND>(&sub, &mut out[t0 * g.nrows..t1 * g.nrows]) };
            t0 = t1;
        }
        return;
    }
    let tb = ((WIDE_BLOCK / (4 * n.max(1))).max(3) / 3 * 3).min(g.ntok);
    super::with_scratch(0, tb * n, |wa: &mut [f32]| {
        let mut t0 = 0;
        while t0 < g.ntok {
            let t1 = (t0 + tb).min(g.ntok);
            for t in t0..t1 {
                let dst = &mut wa[(t - t0) * n..(t - t0 + 1) * n];
                // SAFETY: token t < ntok has `n` values of `KIND` at its offset.
                unsafe { widen::<KIND>(g.a.as_ptr().add(t * g.a_stride), dst) };
            }
            let sub = Gemm {
                a: super::f32_bytes(&wa[..(t1 - t0) * n]),
                a_stride: 4 * n,
                ntok: t1 - t0,
                ..*g
            };
            // SAFETY: as this function's contract, the block's activations widened to f32.
            unsafe { float_block::<KIND, F32>(&sub, &mut out[t0 * g.nrows..t1 * g.nrows]) };
            t0 = t1;
        }
    });
}

/// Every row × token of `g` (one token block), its activations of kind `AK`: f32 (widened)
/// or `KIND` (converted in the micro-kernel).
///
/// # Safety
/// As [`float_gemm`], with activations of kind `AK`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn float_block<const KIND: u8, const AK: u8>(g: &Gemm<'_>, out: &mut [f32]) {
    const R: usize = 4;
    const T: usize = 3;
    let n = g.cols;
    let n8 = n / 8 * 8;
    let tb = g.ntok;
    let es = if AK == F32 { 4 } else { 2 };
    // A cache line aligned buffer, so the micro-kernel's 32-byte loads never straddle two.
    #[repr(C, align(64))]
    struct Wide([f32; R * FKC]);
    let mut wide = Wide([0f32; R * FKC]);
    let wide = &mut wide.0;
    super::with_scratch(1, R * tb, |accs: &mut [__m256]| {
        let mut r0 = 0;
        while r0 < g.nrows {
            let nr = (g.nrows - r0).min(R);
            accs.fill(_mm256_setzero_ps());
            let mut c0 = 0;
            while c0 < n8 {
                let c1 = (c0 + FKC).min(n8);
                for r in 0..nr {
                    // SAFETY: row r0 + r < nrows has `n` values; c1 <= n8 <= n.
                    unsafe {
                        widen::<KIND>(
                            g.w.as_ptr().add((r0 + r) * g.w_stride + 2 * c0),
                            &mut wide[r * FKC..r * FKC + (c1 - c0)],
                        )
                    };
                }
                if AK == KIND {
                    // The next chunk's weights (this row tile's, or the next tile's first),
                    // runs of 1 KiB 28 KiB apart that the hardware prefetchers do not follow
                    // from DRAM: widening them was a fifth of the time on an AMD Zen 5.
                    let (pr0, pc0) = if c1 < n8 { (r0, c1) } else { (r0 + R, 0) };
                    let pc1 = (pc0 + FKC).min(n8);
                    for r in pr0..(pr0 + R).min(g.nrows) {
                        let base = g.w.as_ptr().wrapping_add(r * g.w_stride + 2 * pc0);
                        let mut o = 0;
                        while o < 2 * (pc1 - pc0) {
                            _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(o).cast());
                            o += 64;
                        }
                    }
                }
                let mut t = 0;
                while t < tb {
                    let nt = (tb - t).min(T);
                    // SAFETY: rows r0..r0+nr, tokens t..t+nt, columns c0..c1 of `g`;
                    // `wide` holds the rows' chunk, `accs` the tile's accumulators.
                    unsafe {
                        match (nr, nt) {
                            (4, 3) => float_micro::<4, 3, AK>(g, wide, accs, t, c0, c1),
                            (4, 2) => float_micro::<4, 2, AK>(g, wide, accs, t, c0, c1),
                            (4, _) => float_micro::<4, 1, AK>(g, wide, accs, t, c0, c1),
                            (3, 3) => float_micro::<3, 3, AK>(g, wide, accs, t, c0, c1),
                            (3, 2) => float_micro::<3, 2, AK>(g, wide, accs, t, c0, c1),
                            (3, _) => float_micro::<3, 1, AK>(g, wide, accs, t, c0, c1),
                            (2, 3) => float_micro::<2, 3, AK>(g, wide, accs, t, c0, c1),
                            (2, 2) => float_micro::<2, 2, AK>(g, wide, accs, t, c0, c1),
                            (2, _) => float_micro::<2, 1, AK>(g, wide, accs, t, c0, c1),
                            (_, 3) => float_micro::<1, 3, AK>(g, wide, accs, t, c0, c1),
                            (_, 2) => float_micro::<1, 2, AK>(g, wide, accs, t, c0, c1),
                            _ => float_micro::<1, 1, AK>(g, wide, accs, t, c0, c1),
                        }
                    }
                    t += nt;
                }
                c0 = c1;
            }
            for r in 0..nr {
                let row = r0 + r;
                for t in 0..tb {
                    let mut s = 0f32;
                    // SAFETY: columns n8..n of row `row` and token `t`.
                    unsafe {
                        for j in n8..n {
                            let w = load_one::<KIND>(g.w.as_ptr().add(row * g.w_stride + 2 * j));
                            let a = load_one::<AK>(g.a.as_ptr().add(t * g.a_stride + es * j));
                            s += w * a;
                        }
                    }
                    out[t * g.nrows + row] = hsum(accs[r * tb + t]) + s;
                }
            }
            r0 += nr;
        }
    });
}

/// Rows `0..RR` of the widened chunk (`wide`, row `r` at `r · FKC`) × tokens `t..t+TT` over
/// columns `c0..c1`: accumulators `accs[r · ntok + t]` loaded, stepped 8 columns at a time,
/// stored back. Activations of kind `AK` (f32, f16 or bf16; the last two widened per load,
/// exactly).
///
/// # Safety
/// AVX2, FMA, F16C; tokens `t..t+TT` of `g` have columns `c0..c1` (multiples of 8 apart) of
/// kind `AK`; `wide` holds `RR` rows of `c1 - c0` values; `accs` the tile's entries.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn float_micro<const RR: usize, const TT: usize, const AK: u8>(
    g: &Gemm<'_>,
    wide: &[f32],
    accs: &mut [__m256],
    t: usize,
    c0: usize,
    c1: usize,
) {
    let tb = g.ntok;
    let mut acc: [[__m256; TT]; RR] =
        core::array::from_fn(|r| core::array::from_fn(|k| accs[r * tb + t + k]));
    // SAFETY (whole body): as the contract.
    unsafe {
        let es = if AK == F32 { 4 } else { 2 };
        let a: [*const u8; TT] =
            core::array::from_fn(|k| g.a.as_ptr().add((t + k) * g.a_stride + es * c0));
        let mut i = 0;
        while c0 + i < c1 {
            let av: [__m256; TT] = core::array::from_fn(|k| load_f::<AK>(a[k].add(es * i)));
            for r in 0..RR {
                let w = _mm256_loadu_ps(wide.as_ptr().add(r * FKC + i));
                for k in 0..TT {
                    acc[r][k] = _mm256_fmadd_ps(w, av[k], acc[r][k]);
                }
            }
            i += 8;
        }
    }
    for r in 0..RR {
        for k in 0..TT {
            accs[r * tb + t + k] = acc[r][k];
        }
    }
}

/// `dst[i]` = value `i` of the `KIND` (f16 or bf16) row at `src`, as f32.
///
/// # Safety
/// AVX2, FMA, F16C; `dst.len()` values readable at `src`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen<const KIND: u8>(src: *const u8, dst: &mut [f32]) {
    let n = dst.len();
    let mut i = 0;
    // SAFETY (whole body): elements below `n` of both.
    unsafe {
        while i + 8 <= n {
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), load_f::<KIND>(src.add(2 * i)));
            i += 8;
        }
        for (j, d) in dst.iter_mut().enumerate().skip(i) {
            *d = load_one::<KIND>(src.add(2 * j));
        }
    }
}

/// ggml's `hsum_float_8`: `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// # Safety
/// AVX2 available; `p` readable for 2 bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn f16_splat(p: *const u8) -> __m256 {
    // SAFETY: 2 readable bytes at `p`.
    let bits = unsafe { p.cast::<i16>().read_unaligned() };
    _mm256_cvtph_ps(_mm_set1_epi16(bits))
}

/// # Safety
/// As `store` in avx512.rs: `r0 + R <= g.nrows`, `t0 + T <= g.ntok`, `out.len() == ntok*nrows`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn store<const R: usize, const T: usize>(
    g: &Gemm<'_>,
    r0: usize,
    t0: usize,
    acc: &[[__m256; T]; R],
    out: &mut [f32],
) {
    for r in 0..R {
        for t in 0..T {
            // SAFETY: in bounds by the contract above.
            unsafe { *out.get_unchecked_mut((t0 + t) * g.nrows + r0 + r) = hsum(acc[r][t]) };
        }
    }
}

/// How many row tiles ahead the weight stream is prefetched (the hardware prefetcher alone
/// leaves DRAM-resident GEMVs far below bandwidth).
const PF_ROWS: usize = 2;

/// Prefetch the cache line at `p` (a hint: never faults, any address is fine).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn prefetch(p: *const u8) {
    _mm_prefetch::<_MM_HINT_T0>(p.cast())
}

// ---------------------------------------------------------------------------------------------
// Legacy 32-value blocks.

/// 32 weight codes of the block at `p` in value order: unsigned (q4_0, q5_0, q4_1, q5_1) or
/// signed (q8_0).
///
/// # Safety
/// AVX2 available; `p` readable for one `KIND` block.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn unpack_legacy<const KIND: u8>(p: *const u8) -> __m256i {
    // SAFETY (whole body): reads within the block.
    unsafe {
        if KIND == Q8_0 {
            return _mm256_loadu_si256(p.add(2).cast());
        }
        let (qoff, hoff) = legacy_nibbles(KIND);
        let q = _mm_loadu_si128(p.add(qoff).cast());
        let lo = _mm_and_si128(q, _mm_set1_epi8(0x0F));
        let hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0F));
        let mut u = _mm256_set_m128i(hi, lo);
        if hoff != 0 {
            // ggml's bytes_from_bits_32: byte i = 0xFF where bit i of qh is set.
            let qh = p.add(hoff).cast::<i32>().read_unaligned();
            let shuf = _mm256_set_epi64x(
                0x0303_0303_0303_0303,
                0x0202_0202_0202_0202,
                0x0101_0101_0101_0101,
                0,
            );
            let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(qh), shuf);
            let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe));
            let set = _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
            u = _mm256_or_si256(u, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
        }
        u
    }
}

/// Rows `r0..r0+R` × tokens `t0..t0+T` of a legacy-type matmul. Kinds with a min (q4_1,
/// q5_1) also keep each (row, token)'s scalar `fma(m, s, summs)` chain and add it after the
/// lanes' sum, as `scalar::vec_dot_legacy1`.
///
/// # Safety
/// AVX2 available; `g` validated, `r0 + R <= g.nrows`, `t0 + T <= g.ntok`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_legacy<const R: usize, const T: usize, const KIND: u8>(
    g: &Gemm<'_>,
    r0: usize,
    t0: usize,
    out: &mut [f32],
) {
    let nb = g.cols / QK;
    let bs = legacy_block_bytes(KIND);
    let k = legacy_offset(KIND);
    let (abs, aoff) = legacy_act(KIND);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let mut summs = [[0f32; T]; R];
    // A one-row tile is one sequential stream, prefetched as the AVX-512 GEMVs'.
    let pf = if R == 1 { super::stream_prefetch() } else { 0 };
    // SAFETY (whole body): offsets within rows r0..r0+R / tokens t0..t0+T (nb blocks each)
    // and side-table indices below `g.ntok * nb`.
    unsafe {
        for b in 0..nb {
            let mut av = [_mm256_setzero_si256(); T];
            let mut cv = [_mm256_setzero_si256(); T];
            let mut dav = [_mm256_setzero_ps(); T];
            let mut sa = [0f32; T];
            for t in 0..T {
                let i = (t0 + t) * nb + b;
                let ap = g.a.as_ptr().add((t0 + t) * g.a_stride + b * abs);
                av[t] = _mm256_loadu_si256(ap.add(aoff).cast());
                dav[t] = _mm256_set1_ps(*g.a_scales.as_ptr().add(i));
                if legacy_has_min(KIND) {
                    sa[t] = *g.a_sums.as_ptr().add(i);
                } else if KIND != Q8_0 {
                    // `-offset · Σa` over each lane's four activations (ggml sums per lane).
                    let s4 =
                        _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), av[t]), ones);
                    cv[t] = _mm256_mullo_epi32(s4, _mm256_set1_epi32(-k));
                }
            }
            for r in 0..R {
                let wp = g.w.as_ptr().add((r0 + r) * g.w_stride + b * bs);
                // Multi-row tiles prefetch rows ahead; one row (the q8_0 GEMV) is one stream,
                // prefetched `stream_prefetch` bytes ahead (Intel: 2 KB; session 31, both
                // kernels held to AVX2, Gemma's q8_0 LM head 18.6-19.6 -> 13.1-13.7 ms at two
                // threads, 33-35 -> 24.5 at one; AMD without AVX-512 (Zen 3): 2 KB too,
                // 11.1-13.2 -> 9.1-10.6 ms at two, 20-22 -> 14.7-16.2 at one, session 34; Zen 4:
                // none; Zen 5: 4 KB).
                if R > 1 && b % 2 == 0 {
                    prefetch(wp.wrapping_add(PF_ROWS * R * g.w_stride));
                } else if R == 1 && pf > 0 {
                    prefetch(wp.wrapping_add(pf));
                }
                let u = unpack_legacy::<KIND>(wp);
                let dw = f16_splat(wp);
                if legacy_has_min(KIND) {
                    let m = _mm_cvtss_f32(_mm256_castps256_ps128(f16_splat(wp.add(2))));
                    for t in 0..T {
                        summs[r][t] = m.mul_add(sa[t], summs[r][t]);
                    }
                }
                let au = if KIND == Q8_0 {
                    _mm256_sign_epi8(u, u)
                } else {
                    u
                };
                for t in 0..T {
                    let a = if KIND == Q8_0 {
                        _mm256_sign_epi8(av[t], u)
                    } else {
                        av[t]
                    };
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(au, a), ones);
                    let p = if KIND == Q8_0 || legacy_has_min(KIND) {
                        p
                    } else {
                        _mm256_add_epi32(p, cv[t])
                    };
                    let s = _mm256_mul_ps(dw, dav[t]);
                    acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc[r][t]);
                }
            }
        }
        if legacy_has_min(KIND) {
            for r in 0..R {
                for t in 0..T {
                    *out.get_unchecked_mut((t0 + t) * g.nrows + r0 + r) =
                        hsum(acc[r][t]) + summs[r][t];
                }
            }
        } else {
            store(g, r0, t0, &acc, out);
        }
    }
}

/// Rows `r0..r0+R` (R ≤ 4) × tokens `t0..t0+T` of a q8_0 or q5_0 matmul, in
/// `scalar::vec_dot_legacy`'s order as [`tile_legacy`], with both operands signed (q5_0's
/// codes made values by `- 16`) through ggml's `abs`/`sign` trick, and the scale products of a
/// block made one vector per token: the R rows' f16 scales converted together, times the
/// token's, each row's lane spread by one in-lane permute (llama.cpp's AVX2 tinyBLAS `gemm4xN`
/// does the same). Per (row, token, block): sign, `vpmaddubsw`, `vpmaddwd`, convert, FMA —
/// one multiply fewer than [`tile_legacy`], which also multiplies the two scales there. One row
/// ([`signed_one_row`]) has no lanes to spread: with the tokens' scales block-major
/// (`g.a_scales_tr`, from four tokens) its scale times up to eight tokens' in one multiply,
/// each product read back by a broadcast load (five operations per (row, token, block)), else
/// its scale splat times each token's, one multiply per (row, token, block) as [`tile_legacy`].
/// Exact for activation codes in `-127..=127`, all that q8_0 quantization writes (`sign`
/// cannot negate -128; ggml's AVX2 q5_0 / q8_0 dot products share the limit).
///
/// # Safety
/// As [`tile_legacy`], with `R <= 4`; `g.a_scales_tr` empty, or `g.a_scales` block-major for
/// this `g` (`[b * g.ntok + t]`) with at least 8 values after the last.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_signed<const R: usize, const T: usize, const KIND: u8>(
    g: &Gemm<'_>,
    r0: usize,
    t0: usize,
    out: &mut [f32],
) {
    const { assert!(R <= 4) };
    debug_assert!(KIND == Q8_0 || KIND == Q5_0);
    let nb = g.cols / QK;
    let bs = legacy_block_bytes(KIND);
    let (abs, aoff) = legacy_act(KIND);
    let off = _mm256_set1_epi8(legacy_offset(KIND) as i8);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let tr = T <= 8 && !g.a_scales_tr.is_empty();
    debug_assert!(!tr || g.a_scales_tr.len() >= nb * g.ntok + 8);
    // One row is one sequential stream, prefetched as the one-row GEMV's ([`tile_legacy`]).
    let pf = if R == 1 { super::stream_prefetch() } else { 0 };
    // SAFETY (whole body): offsets within rows r0..r0+R / tokens t0..t0+T (nb blocks each),
    // side-table indices below `g.ntok * nb`, and `a_scales_tr` read at most to index
    // `(nb - 1) * ntok + t0 + 7 < nb * ntok + 8` (its padding, as the contract says).
    unsafe {
        for b in 0..nb {
            let mut w = [_mm256_setzero_si256(); R];
            let mut dh = [0i16; 8];
            for r in 0..R {
                let wp = g.w.as_ptr().add((r0 + r) * g.w_stride + b * bs);
                if R == 1 && pf > 0 {
                    prefetch(wp.wrapping_add(pf));
                }
                w[r] = if KIND == Q8_0 {
                    unpack_legacy::<KIND>(wp)
                } else {
                    _mm256_sub_epi8(unpack_legacy::<KIND>(wp), off)
                };
                dh[r] = wp.cast::<i16>().read_unaligned();
            }
            let aw: [__m256i; R] = core::array::from_fn(|r| _mm256_sign_epi8(w[r], w[r]));
            // R rows: their scales converted together (`dw4`), each token's product spread to
            // the rows by permutes. One row ([`signed_one_row`]) has no lanes to spread: its
            // scale splat (`dw1`) times the tokens' (eight at once from `a_scales_tr`, else one
            // each), the product of the same two floats.
            let dw4 = _mm_cvtph_ps(_mm_loadu_si128(dh.as_ptr().cast()));
            let dw1 = _mm256_cvtph_ps(_mm_set1_epi16(dh[0]));
            // With the scales block-major (`a_scales_tr`), one row's products with its
            // tokens' scales in one multiply, each read back by a broadcast load.
            let mut d8 = [0f32; 8];
            if R == 1 && tr {
                let da8 = _mm256_loadu_ps(g.a_scales_tr.as_ptr().add(b * g.ntok + t0));
                _mm256_storeu_ps(d8.as_mut_ptr(), _mm256_mul_ps(dw1, da8));
            }
            for t in 0..T {
                let i = (t0 + t) * nb + b;
                let ap = g.a.as_ptr().add((t0 + t) * g.a_stride + b * abs + aoff);
                let av = _mm256_loadu_si256(ap.cast());
                let da = *g.a_scales.as_ptr().add(i);
                let d = _mm_mul_ps(dw4, _mm_set1_ps(da));
                let d = _mm256_set_m128(d, d);
                for r in 0..R {
                    let dr = match r {
                        _ if R == 1 && tr => _mm256_broadcast_ss(&d8[t]),
                        _ if R == 1 => _mm256_mul_ps(dw1, _mm256_set1_ps(da)),
                        0 => _mm256_permute_ps::<0x00>(d),
                        1 => _mm256_permute_ps::<0x55>(d),
                        2 => _mm256_permute_ps::<0xAA>(d),
                        _ => _mm256_permute_ps::<0xFF>(d),
                    };
                    let p = _mm256_madd_epi16(
                        _mm256_maddubs_epi16(aw[r], _mm256_sign_epi8(av, w[r])),
                        ones,
                    );
                    acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), dr, acc[r][t]);
                }
            }
        }
        store(g, r0, t0, &acc, out);
    }
}

// ---------------------------------------------------------------------------------------------
// k-quants.

/// Rows `r0..r0+R` × tokens `t0..t0+T` of a k-quant matmul.
///
/// # Safety
/// As [`tile_legacy`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_k<const R: usize, const T: usize, const KIND: u8>(
    g: &Gemm<'_>,
    r0: usize,
    t0: usize,
    out: &mut [f32],
) {
    let nsb = g.cols / QK_K;
    let wbs = k_block_bytes(KIND);
    let low4 = _mm256_set1_epi8(0x0F);
    let m30 = _mm256_set1_epi8(0x30);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    // The float order per token (scalar::token_order: the batch's under Parity, the 1-token
    // GEMV's under Invariant, the same as this function's 1×1 tiles for `ntok == 1`): Lanes8
    // keeps `acc`, the others these.
    let mut acc_s = [[0f32; T]; R];
    let mut acc_m = [[0f32; T]; R];
    let mut order = [KOrder::Lanes8; T];
    for t in 0..T {
        order[t] = token_order(g, t0 + t);
    }
    // SAFETY (whole body): offsets within rows r0..r0+R and tokens t0..t0+T, nsb super-blocks
    // each (q8_K: f32 d at 0, qs at 4, bsums at 260).
    unsafe {
        for sb in 0..nsb {
            let mut ap = [core::ptr::null::<u8>(); T];
            for t in 0..T {
                ap[t] = g.a.as_ptr().add((t0 + t) * g.a_stride + sb * Q8_K_BYTES);
            }
            for r in 0..R {
                let p = g.w.as_ptr().add((r0 + r) * g.w_stride + sb * wbs);
                if R > 1 {
                    for l in (0..wbs).step_by(64) {
                        prefetch(p.wrapping_add(PF_ROWS * R * g.w_stride + l));
                    }
                }
                let mut isum = [_mm256_setzero_si256(); T];
                let (d, dmin, bsum_w);
                if KIND == Q6_K {
                    d = _mm256_cvtph_ps(_mm_set1_epi16(p.add(208).cast::<i16>().read_unaligned()));
                    dmin = _mm256_setzero_ps();
                    bsum_w = _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(192).cast()));
                    let sc = p.add(192).cast::<i8>();
                    for h in 0..2 {
                        let ql0 = _mm256_loadu_si256(p.add(64 * h).cast());
                        let ql1 = _mm256_loadu_si256(p.add(64 * h + 32).cast());
                        let qh = _mm256_loadu_si256(p.add(128 + 32 * h).cast());
                        let qs = [
                            _mm256_or_si256(
                                _mm256_and_si256(ql0, low4),
                                _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30),
                            ),
                            _mm256_or_si256(
                                _mm256_and_si256(ql1, low4),
                                _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30),
                            ),
                            _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                                _mm256_and_si256(qh, m30),
                            ),
                            _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                                _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30),
                            ),
                        ];
                        for (c, u) in qs.iter().enumerate() {
                            let j = 8 * h + 2 * c;
                            let s = _mm256_set_m128i(
                                _mm_set1_epi16(*sc.add(j + 1) as i16),
                                _mm_set1_epi16(*sc.add(j) as i16),
                            );
                            for t in 0..T {
                                let a = _mm256_loadu_si256(ap[t].add(4 + 128 * h + 32 * c).cast());
                                let pr = _mm256_madd_epi16(_mm256_maddubs_epi16(*u, a), s);
                                isum[t] = _mm256_add_epi32(isum[t], pr);
                            }
                        }
                    }
                } else {
                    d = f16_splat(p);
                    dmin = f16_splat(p.add(2));
                    let (scales, mins) = k4_scales_mins(&*p.add(4).cast::<[u8; 12]>());
                    let m = _mm_cvtsi64_si128(mins as i64);
                    bsum_w = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m));
                    // Sb64 tokens: per sub-block j, min_j · (bsums[2j] + bsums[2j+1]), and the
                    // super-block's scales as f32, once per (row, token) rather than per chunk.
                    let (dw, dm) = (
                        _mm_cvtss_f32(_mm256_castps256_ps128(d)),
                        _mm_cvtss_f32(_mm256_castps256_ps128(dmin)),
                    );
                    let mut min_lanes = [[0i32; 8]; T];
                    for t in 0..T {
                        if order[t] == KOrder::Sb64 {
                            let bs = _mm256_loadu_si256(ap[t].add(4 + QK_K).cast());
                            let mins = _mm256_madd_epi16(bs, bsum_w);
                            _mm256_storeu_si256(min_lanes[t].as_mut_ptr().cast(), mins);
                        }
                    }
                    let qs = if KIND == Q5_K { p.add(48) } else { p.add(16) };
                    let qh = if KIND == Q5_K {
                        _mm256_loadu_si256(p.add(16).cast())
                    } else {
                        _mm256_setzero_si256()
                    };
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
                        let s0 = _mm256_set1_epi16(((scales >> (16 * c)) & 0xFF) as i16);
                        let s1 = _mm256_set1_epi16(((scales >> (16 * c + 8)) & 0xFF) as i16);
                        for t in 0..T {
                            let a0 = _mm256_loadu_si256(ap[t].add(4 + 64 * c).cast());
                            let a1 = _mm256_loadu_si256(ap[t].add(36 + 64 * c).cast());
                            let p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, a0), s0);
                            let p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, a1), s1);
                            let pc = _mm256_add_epi32(p0, p1);
                            if order[t] == KOrder::Sb64 {
                                // One FMA per 64 values (the repacked q4_K GEMM), scales and mins.
                                let ad = ap[t].cast::<f32>().read_unaligned();
                                let imin = min_lanes[t][2 * c] + min_lanes[t][2 * c + 1];
                                acc_s[r][t] = (hsum_i32(pc) as f32).mul_add(dw * ad, acc_s[r][t]);
                                acc_m[r][t] = (imin as f32).mul_add(dm * ad, acc_m[r][t]);
                            } else {
                                isum[t] = _mm256_add_epi32(isum[t], pc);
                            }
                        }
                    }
                }
                for t in 0..T {
                    let ad = _mm256_set1_ps(ap[t].cast::<f32>().read_unaligned());
                    let bsums = _mm256_loadu_si256(ap[t].add(4 + QK_K).cast());
                    let corr = _mm256_madd_epi16(bsums, bsum_w);
                    let (dw, ads) = (
                        _mm_cvtss_f32(_mm256_castps256_ps128(d)),
                        _mm_cvtss_f32(_mm256_castps256_ps128(ad)),
                    );
                    if order[t] == KOrder::Sb64 {
                        continue;
                    }
                    if order[t] == KOrder::Tiled && KIND == Q6_K {
                        let i = _mm256_sub_epi32(isum[t], _mm256_slli_epi32(corr, 5));
                        acc_s[r][t] = (hsum_i32(i) as f32 * dw).mul_add(ads, acc_s[r][t]);
                        continue;
                    }
                    if order[t] == KOrder::Tiled {
                        // q4_K / q5_K: fnmadd(dmin, imin, isum · d), then one FMA with da.
                        let dm = _mm_cvtss_f32(_mm256_castps256_ps128(dmin));
                        let res =
                            (-dm).mul_add(hsum_i32(corr) as f32, hsum_i32(isum[t]) as f32 * dw);
                        acc_s[r][t] = res.mul_add(ads, acc_s[r][t]);
                        continue;
                    }
                    if order[t] == KOrder::Sb256 {
                        let dm = _mm_cvtss_f32(_mm256_castps256_ps128(dmin));
                        acc_s[r][t] = (hsum_i32(isum[t]) as f32).mul_add(dw * ads, acc_s[r][t]);
                        acc_m[r][t] = (hsum_i32(corr) as f32).mul_add(dm * ads, acc_m[r][t]);
                        continue;
                    }
                    if KIND == Q6_K {
                        let i = _mm256_sub_epi32(isum[t], _mm256_slli_epi32(corr, 5));
                        acc[r][t] =
                            _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(d, ad), acc[r][t]);
                    } else {
                        acc[r][t] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(isum[t]),
                            _mm256_mul_ps(d, ad),
                            acc[r][t],
                        );
                        acc[r][t] = _mm256_fnmadd_ps(
                            _mm256_cvtepi32_ps(corr),
                            _mm256_mul_ps(dmin, ad),
                            acc[r][t],
                        );
                    }
                }
            }
        }
        for r in 0..R {
            for t in 0..T {
                *out.get_unchecked_mut((t0 + t) * g.nrows + r0 + r) = match order[t] {
                    KOrder::Lanes8 => hsum(acc[r][t]),
                    KOrder::Tiled => acc_s[r][t],
                    KOrder::Sb64 | KOrder::Sb128 | KOrder::Sb256 => acc_s[r][t] - acc_m[r][t],
                };
            }
        }
    }
}

/// The sum of the 8 i32 lanes (exact).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn hsum_i32(v: __m256i) -> i32 {
    let x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let x = _mm_add_epi32(x, _mm_unpackhi_epi64(x, x));
    _mm_cvtsi128_si32(_mm_add_epi32(x, _mm_shuffle_epi32::<0b01>(x)))
}

// ---------------------------------------------------------------------------------------------
// Float weights.

/// Load 8 values of `KIND` at `p` as f32.
///
/// # Safety
/// AVX2 available; 8 elements readable at `p`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load_f<const KIND: u8>(p: *const u8) -> __m256 {
    // SAFETY: 8 readable elements.
    unsafe {
        match KIND {
            F32 => _mm256_loadu_ps(p.cast()),
            F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
            _ => _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast())),
                16,
            )),
        }
    }
}

/// One value of `KIND` at `p` as f32.
///
/// # Safety
/// The element at `p` is readable.
unsafe fn load_one<const KIND: u8>(p: *const u8) -> f32 {
    // SAFETY: readable element.
    unsafe {
        match KIND {
            F32 => p.cast::<f32>().read_unaligned(),
            F16 => f16::from_bits(p.cast::<u16>().read_unaligned()).to_f32(),
            _ => half::bf16::from_bits(p.cast::<u16>().read_unaligned()).to_f32(),
        }
    }
}

/// Rows `r0..r0+R` × tokens `t0..t0+T` of a float matmul.
///
/// # Safety
/// As [`tile_legacy`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_float<const R: usize, const T: usize, const KIND: u8>(
    g: &Gemm<'_>,
    r0: usize,
    t0: usize,
    out: &mut [f32],
) {
    let esz = if KIND == F32 { 4 } else { 2 };
    let n = g.cols;
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    // SAFETY (whole body): element offsets below `n` within validated rows and tokens.
    unsafe {
        let mut i = 0;
        while i + 8 <= n {
            let mut av = [_mm256_setzero_ps(); T];
            for t in 0..T {
                av[t] = load_f::<KIND>(g.a.as_ptr().add((t0 + t) * g.a_stride + i * esz));
            }
            for r in 0..R {
                let w = load_f::<KIND>(g.w.as_ptr().add((r0 + r) * g.w_stride + i * esz));
                for t in 0..T {
                    acc[r][t] = _mm256_fmadd_ps(w, av[t], acc[r][t]);
                }
            }
            i += 8;
        }
        store(g, r0, t0, &acc, out);
        for r in 0..R {
            for t in 0..T {
                let mut s = 0f32;
                for j in i..n {
                    let w = load_one::<KIND>(g.w.as_ptr().add((r0 + r) * g.w_stride + j * esz));
                    let a = load_one::<KIND>(g.a.as_ptr().add((t0 + t) * g.a_stride + j * esz));
                    s += w * a;
                }
                *out.get_unchecked_mut((t0 + t) * g.nrows + r0 + r) += s;
            }
        }
    }
}

/// Dot product of `n` elements of `KIND` (f32 or f16), summed in the order of ggml's AVX-512
/// `ggml_vec_dot_f16`/`_f32` (four 16-lane accumulators, each held here as two 8-lane halves),
/// so every ISA gives the same attention scores as the llama.cpp build we compare against.
///
/// # Safety
/// The CPU has AVX2, FMA, F16C; `a` and `b` readable for `n` elements.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_raw<const KIND: u8>(a: *const u8, b: *const u8, n: usize) -> f32 {
    let esz = if KIND == F32 { 4 } else { 2 };
    // acc[2k] holds lanes 0..8 of the 16-lane accumulator k, acc[2k+1] lanes 8..16.
    let mut acc = [_mm256_setzero_ps(); 8];
    let np = n & !63;
    let mut sum;
    // SAFETY (whole body): offsets below `n` elements.
    unsafe {
        let mut i = 0;
        while i < np {
            for (k, v) in acc.iter_mut().enumerate() {
                let o = (i + 8 * k) * esz;
                *v = _mm256_fmadd_ps(load_f::<KIND>(a.add(o)), load_f::<KIND>(b.add(o)), *v);
            }
            i += 64;
        }
        // (a0 + a2) + (a1 + a3), per half.
        let lo = _mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6]));
        let hi = _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7]));
        // _mm512_reduce_add_ps: lanes i + i+8, then i + i+4, then i + i+2, then 0 + 1.
        let h8 = _mm256_add_ps(lo, hi);
        let h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
        let h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
        let h1 = _mm_add_ss(h2, _mm_movehdup_ps(h2));
        sum = _mm_cvtss_f32(h1) as f64;
        for i in np..n {
            sum += (load_one::<KIND>(a.add(i * esz)) * load_one::<KIND>(b.add(i * esz))) as f64;
        }
    }
    sum as f32
}

/// Whether this module has a matmul for `ty` (the registry completeness test).
#[cfg(test)]
pub(crate) fn has_matmul(ty: GgmlType) -> bool {
    matmul_for(ty).is_some()
}

// ---------------------------------------------------------------------------------------------
// Tiled flash attention pieces, bit-identical to `scalar::fa_scores` / `fa_pv` / `softmax_exp`
// (each element one FMA chain in the reference's order; 8 lanes are 8 independent elements).

/// Lanes `0..left.min(8)` set: the mask of a ragged 8-column tail.
#[target_feature(enable = "avx2,fma,f16c")]
fn tail_mask(left: usize) -> __m256i {
    _mm256_cmpgt_epi32(
        _mm256_set1_epi32(left.min(8) as i32),
        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
    )
}

/// In 8 × 8 blocks transposed in registers ([`super::widen_transpose_blocks`]). On an AMD EPYC
/// Zen 3 the scalar copy was a tenth of Gemma 3 270M's invariant one-sequence decode (every step
/// widens its sequence's K tiles for the tiled attention).
fn widen_transpose_f16(
    src: &[f16],
    src_stride: usize,
    rows: usize,
    cols: usize,
    dst: &mut [f32],
    dst_stride: usize,
) {
    // SAFETY: reachable only through `Avx2::kernels`' table, built from its token (AVX2, F16C:
    // what `transpose8_raw` needs); it reads and writes 8 × 8 blocks as the helper's contract.
    unsafe {
        super::widen_transpose_blocks::<8>(
            src,
            src_stride,
            rows,
            cols,
            dst,
            dst_stride,
            transpose8_raw,
        )
    }
}

/// One 8 × 8 block: 8 f16 rows widened, transposed in registers, stored as 8 f32 rows.
///
/// # Safety
/// AVX2, FMA, F16C; 8 rows of 8 values readable at `src` (stride `ss`), writable at `dst`
/// (stride `ds`).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn transpose8_raw(src: *const f16, ss: usize, dst: *mut f32, ds: usize) {
    // SAFETY (whole body): as the contract.
    unsafe {
        let r: [__m256; 8] =
            core::array::from_fn(|i| _mm256_cvtph_ps(_mm_loadu_si128(src.add(i * ss).cast())));
        // Pairs of rows interleaved, then quads; then 128-bit halves across quads.
        let mut t = [_mm256_setzero_ps(); 8];
        for i in 0..4 {
            t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        // u[4i + k], half H: column 4H + k of rows 4i..4i+4.
        let mut u = [_mm256_setzero_ps(); 8];
        for i in 0..2 {
            u[4 * i] = _mm256_shuffle_ps::<0x44>(t[4 * i], t[4 * i + 2]);
            u[4 * i + 1] = _mm256_shuffle_ps::<0xEE>(t[4 * i], t[4 * i + 2]);
            u[4 * i + 2] = _mm256_shuffle_ps::<0x44>(t[4 * i + 1], t[4 * i + 3]);
            u[4 * i + 3] = _mm256_shuffle_ps::<0xEE>(t[4 * i + 1], t[4 * i + 3]);
        }
        for k in 0..4 {
            let lo = _mm256_permute2f128_ps::<0x20>(u[k], u[4 + k]);
            let hi = _mm256_permute2f128_ps::<0x31>(u[k], u[4 + k]);
            _mm256_storeu_ps(dst.add(k * ds), lo);
            _mm256_storeu_ps(dst.add((4 + k) * ds), hi);
        }
    }
}

fn fa_scores(q: &[f32], kt: &[f32], w: usize, out: &mut [f32]) {
    let dk = kt.len() / w.max(1);
    assert!(w > 0 && dk > 0 && q.len().is_multiple_of(dk) && out.len() == q.len() / dk * w);
    let rows = q.len() / dk;
    let mut r = 0;
    while r < rows {
        let n = (rows - r).min(4);
        let (qr, orow) = (&q[r * dk..(r + n) * dk], &mut out[r * w..(r + n) * w]);
        // SAFETY: token-gated (see above); the slices hold `n` rows of `dk` / `w`, `kt` is
        // `dk x w` (asserted).
        unsafe {
            match n {
                4 => fa_scores_raw::<4>(qr, kt.as_ptr(), dk, w, orow),
                3 => fa_scores_raw::<3>(qr, kt.as_ptr(), dk, w, orow),
                2 => fa_scores_raw::<2>(qr, kt.as_ptr(), dk, w, orow),
                _ => fa_scores_raw::<1>(qr, kt.as_ptr(), dk, w, orow),
            }
        }
        r += n;
    }
}

/// `R` query rows against the tile, 8 keys per register, two registers per row, each `kt` load
/// shared by the rows.
///
/// # Safety
/// Features as the module; `q` holds `R * dk`, `out` `R * w` floats, `kt` `dk * w`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fa_scores_raw<const R: usize>(
    q: &[f32],
    kt: *const f32,
    dk: usize,
    w: usize,
    out: &mut [f32],
) {
    let mut j0 = 0;
    // SAFETY (whole body): columns below `w` of rows below `dk`; masked tails.
    unsafe {
        while j0 < w {
            let m = [tail_mask(w - j0), tail_mask(w.saturating_sub(j0 + 8))];
            let live = [true, w > j0 + 8];
            let mut acc = [[_mm256_setzero_ps(); 2]; R];
            for d in 0..dk {
                let row = kt.add(d * w + j0);
                let mut k = [_mm256_setzero_ps(); 2];
                for c in 0..2 {
                    if live[c] {
                        k[c] = _mm256_maskload_ps(row.add(8 * c), m[c]);
                    }
                }
                for r in 0..R {
                    let qv = _mm256_set1_ps(*q.get_unchecked(r * dk + d));
                    for c in 0..2 {
                        acc[r][c] = _mm256_fmadd_ps(k[c], qv, acc[r][c]);
                    }
                }
            }
            for r in 0..R {
                for c in 0..2 {
                    if live[c] {
                        let o = out.as_mut_ptr().add(r * w + j0 + 8 * c);
                        _mm256_maskstore_ps(o, m[c], acc[r][c]);
                    }
                }
            }
            j0 += 16;
        }
    }
}

fn fa_pv(acc: &mut [f32], p: &[f32], v: &[f32], n: usize) {
    let w = v.len() / n.max(1);
    assert!(n > 0 && acc.len().is_multiple_of(n) && p.len() == acc.len() / n * w);
    let rows = acc.len() / n;
    let mut r = 0;
    while r < rows {
        let k = (rows - r).min(4);
        let (ar, pr) = (&mut acc[r * n..(r + k) * n], &p[r * w..(r + k) * w]);
        // SAFETY: token-gated; `ar` holds `k` rows of `n`, `pr` `k` rows of `w`, `v` `w x n`.
        unsafe {
            match k {
                4 => fa_pv_raw::<4>(ar, pr, v.as_ptr(), n, w),
                3 => fa_pv_raw::<3>(ar, pr, v.as_ptr(), n, w),
                2 => fa_pv_raw::<2>(ar, pr, v.as_ptr(), n, w),
                _ => fa_pv_raw::<1>(ar, pr, v.as_ptr(), n, w),
            }
        }
        r += k;
    }
}

/// `R` rows of P·V, 16 columns at a time, each `v` load shared by the rows.
///
/// # Safety
/// Features as the module; `acc` holds `R * n`, `p` `R * w` floats, `v` `w * n`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fa_pv_raw<const R: usize>(acc: &mut [f32], p: &[f32], v: *const f32, n: usize, w: usize) {
    let mut i0 = 0;
    // SAFETY (whole body): columns below `n` of rows below `w`; masked tails.
    unsafe {
        while i0 < n {
            let m = [tail_mask(n - i0), tail_mask(n.saturating_sub(i0 + 8))];
            let live = [true, n > i0 + 8];
            let mut a = [[_mm256_setzero_ps(); 2]; R];
            for r in 0..R {
                for c in 0..2 {
                    if live[c] {
                        a[r][c] = _mm256_maskload_ps(acc.as_ptr().add(r * n + i0 + 8 * c), m[c]);
                    }
                }
            }
            for j in 0..w {
                let row = v.add(j * n + i0);
                let mut x = [_mm256_setzero_ps(); 2];
                for c in 0..2 {
                    if live[c] {
                        x[c] = _mm256_maskload_ps(row.add(8 * c), m[c]);
                    }
                }
                for r in 0..R {
                    let pv = _mm256_set1_ps(*p.get_unchecked(r * w + j));
                    for c in 0..2 {
                        a[r][c] = _mm256_fmadd_ps(x[c], pv, a[r][c]);
                    }
                }
            }
            for r in 0..R {
                for c in 0..2 {
                    if live[c] {
                        _mm256_maskstore_ps(
                            acc.as_mut_ptr().add(r * n + i0 + 8 * c),
                            m[c],
                            a[r][c],
                        );
                    }
                }
            }
            i0 += 16;
        }
    }
}

fn swiglu(g: &mut [f32], u: &[f32]) {
    // SAFETY: token-gated.
    unsafe { swiglu_fma(g, u) }
}

/// The reference itself, compiled with FMA (as [`softmax_exp_fma`]).
///
/// # Safety
/// Features as the module.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn swiglu_fma(g: &mut [f32], u: &[f32]) {
    crate::scalar::swiglu(g, u)
}

fn softmax_exp(x: &mut [f32], max: f32) -> f64 {
    // SAFETY: token-gated.
    unsafe { softmax_exp_fma(x, max) }
}

/// The reference itself, compiled with FMA so its `mul_add`s are instructions, not calls.
///
/// # Safety
/// Features as the module.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn softmax_exp_fma(x: &mut [f32], max: f32) -> f64 {
    crate::scalar::softmax_exp(x, max)
}
