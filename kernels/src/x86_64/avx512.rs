//! AVX-512 (F, BW, VL, DQ, VNNI) kernels: the table, the float-weight matmuls (bf16 through
//! `vdpbf16ps` where the CPU has AVX512-BF16) and the f16/f32 helpers attention uses. The
//! quantized matmuls are in `avx512q` (bit-identical to the scalar reference, in llama.cpp's
//! float order).

// Tile loops index several per-row / per-token arrays with the same counter, and the
// transcriptions of ggml keep its index arithmetic: iterator chains would obscure both.
#![allow(clippy::needless_range_loop)]

use super::avx512q::{run_k, run_legacy};
use super::drive;
use super::legacy_min::run_legacy_min;
use super::tern_avx512::run_tern;
use super::{BF16, F16, F32, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0};
use super::{TF1, TF2, TQ1_0, TQ2_0};
use crate::dispatch::{Isa, Kernels, MatmulFn};
use crate::matmul::Gemm;
use crate::quant::GgmlType;
use core::arch::x86_64::*;
use half::f16;

/// Proof that this CPU has the features of this module. Only [`Avx512::new`] makes one.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx512(());

impl Avx512 {
    pub fn new() -> Option<Self> {
        let ok = is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512dq")
            && is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("bmi2")
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        ok.then_some(Avx512(()))
    }

    pub fn kernels(self) -> Kernels {
        Kernels {
            isa: Isa::Avx512,
            matmul_for,
            dot_f32,
            dot_f32_tinyblas,
            dot_f16,
            mad_f16,
            scale_f16,
            mad_f32,
            fa_scores,
            fa_pv,
            softmax_exp,
            quantize,
            swiglu,
            widen_transpose_f16,
        }
    }
}

// The safe entry points below are private to this module and only handed out through
// `Avx512::kernels`, which needs a token, which exists only if `Avx512::new` saw the features:
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
            // SAFETY: reachable only through a table built from an `Avx512` token (see above);
            // `g` was validated by `Gemm::new`, which is what the tiles rely on.
            unsafe { $inner::<$kind>(g, out) }
        }
    };
}

entry!(mm_q8_0, run_legacy, Q8_0);
entry!(mm_q5_0, run_legacy, Q5_0);
entry!(mm_q4_1, run_legacy_min, Q4_1);
entry!(mm_q5_1, run_legacy_min, Q5_1);
entry!(mm_q4_k, run_k, Q4_K);

fn mm_q3_k(g: &Gemm<'_>, out: &mut [f32]) {
    // SAFETY: reachable only through a table built from an `Avx512` token (see above), which
    // proves every feature `run_q3k_avx512` needs; `g` was validated by `Gemm::new`.
    unsafe { super::q3k::run_q3k_avx512(g, out) }
}
entry!(mm_q5_k, run_k, Q5_K);

super::grid_entries!(run_grid_avx512);

fn mm_q2_k(g: &Gemm<'_>, out: &mut [f32]) {
    // SAFETY: as `mm_iq4_nl`.
    unsafe { super::q2k::run_q2k_avx512(g, out) }
}

fn mm_q4_0(g: &Gemm<'_>, out: &mut [f32]) {
    // SAFETY: as `mm_iq4_nl`.
    unsafe { super::iq4::run_nl_avx512::<{ super::Q4_0 }>(g, out) }
}

fn mm_iq4_nl(g: &Gemm<'_>, out: &mut [f32]) {
    // SAFETY: reachable only through a table built from an `Avx512` token (see above), which
    // proves every feature the IQ4 kernels need; `g` was validated by `Gemm::new`.
    unsafe { super::iq4::run_nl_avx512::<{ super::IQ4_NL }>(g, out) }
}

fn mm_iq4_xs(g: &Gemm<'_>, out: &mut [f32]) {
    // SAFETY: as `mm_iq4_nl`.
    unsafe { super::iq4::run_iq4xs_avx512(g, out) }
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
    // SAFETY: token-gated as above; both slices have `n` elements (checked by the caller).
    unsafe { dot_raw::<F32>(a.as_ptr().cast(), b.as_ptr().cast(), a.len().min(b.len())) }
}

use super::avx2::dot_f32_tinyblas;

fn dot_f16(a: &[f16], b: &[f16]) -> f32 {
    // SAFETY: as `dot_f32`.
    unsafe { dot_raw::<F16>(a.as_ptr().cast(), b.as_ptr().cast(), a.len().min(b.len())) }
}

fn mad_f16(y: &mut [f16], x: &[f16], v: f32) {
    let n = y.len().min(x.len());
    // SAFETY: token-gated as above; both slices have at least `n` elements.
    unsafe { mad_raw(y.as_mut_ptr().cast(), x.as_ptr().cast(), v, n, true) }
}

fn scale_f16(y: &mut [f16], v: f32) {
    let n = y.len();
    // SAFETY: token-gated as above; `x` is not read when `mad` is false.
    unsafe { mad_raw(y.as_mut_ptr().cast(), core::ptr::null(), v, n, false) }
}

fn mad_f32(y: &mut [f32], x: &[f32], v: f32) {
    let n = y.len().min(x.len());
    // SAFETY: token-gated as above; both slices have at least `n` elements.
    unsafe { mad_f32_raw(y.as_mut_ptr(), x.as_ptr(), v, n) }
}

/// `y = fma(x, v, y)`, 16 lanes at a time with a masked tail.
///
/// # Safety
/// Features as the module; `y` readable and writable, `x` readable, for `n` f32.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn mad_f32_raw(y: *mut f32, x: *const f32, v: f32, n: usize) {
    let vv = _mm512_set1_ps(v);
    let mut i = 0;
    // SAFETY (whole body): element offsets below `n`; masked loads/stores touch only those.
    unsafe {
        while i < n {
            let m: u16 = if n - i >= 16 {
                0xFFFF
            } else {
                (1u16 << (n - i)) - 1
            };
            let yv = _mm512_maskz_loadu_ps(m, y.add(i));
            let xv = _mm512_maskz_loadu_ps(m, x.add(i));
            _mm512_mask_storeu_ps(y.add(i), m, _mm512_fmadd_ps(xv, vv, yv));
            i += 16;
        }
    }
}

/// `y = f16(x * v + y)` (`mad`) or `y = f16(y * v)`, 16 lanes at a time with a masked tail:
/// the same single f32 rounding and round-to-nearest-even narrowing as `scalar::mad_f16`.
///
/// # Safety
/// Features as the module; `y` readable and writable for `n` u16, `x` readable for `n` when
/// `mad`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn mad_raw(y: *mut u16, x: *const u16, v: f32, n: usize, mad: bool) {
    let vv = _mm512_set1_ps(v);
    let mut i = 0;
    // SAFETY (whole body): element offsets below `n`; masked loads/stores touch only those.
    unsafe {
        while i < n {
            let m: u16 = if n - i >= 16 {
                0xFFFF
            } else {
                (1u16 << (n - i)) - 1
            };
            let yv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, y.add(i).cast()));
            let r = if mad {
                let xv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, x.add(i).cast()));
                _mm512_fmadd_ps(xv, vv, yv)
            } else {
                _mm512_mul_ps(yv, vv)
            };
            let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(r);
            _mm256_mask_storeu_epi16(y.add(i).cast(), m, h);
            i += 16;
        }
    }
}

/// Tile shapes differ with `ntok`, float orders do not: each (row, token) has its own 16-lane
/// accumulator over all columns in order, so batched rows equal 1-token rows bit for bit and
/// `Numerics` changes nothing here. f32 and f16 step 16 columns with one FMA per lane
/// (tinyBLAS's AVX-512 order, `llamafile/sgemm.cpp`); bf16 steps 32 columns as `vdpbf16ps`
/// does (lane j adds the product of columns 2j+1, then of 2j), which tinyBLAS uses on
/// AVX512-BF16 CPUs: with that instruction where the CPU has it, with two FMAs on the split
/// halves where not (same bits: a product of two bf16 values is exact in f32; inputs or sums in
/// the subnormal range, which `vdpbf16ps` flushes to zero, are the exception).
///
/// Blocking as tinyBLAS's: a register tile of 4 rows × 6 tokens (24 accumulators; 4 × 4 for
/// the bf16 emulation, which needs twice the weight registers) over the whole row, the tokens
/// in blocks of [`FLOAT_BLOCK`] bytes of activations (L3) that every row tile of the call
/// streams past; a tile's rows stay in L2 across the block's token tiles.
///
/// # Safety
/// As [`run_legacy`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn run_float<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) {
    if KIND == BF16 && is_x86_feature_detected!("avx512bf16") {
        // SAFETY: the CPU has AVX512-BF16 (checked just above) and this module's features.
        unsafe { run_bf16_dp(g, out) }
    } else if KIND == BF16 {
        drive!(@ FLOAT_BLOCK, g, out, tile_float, 4, 4, KIND, KIND);
    } else if KIND == F16 && g.ntok > 1 && super::is_amd_zen5_or_later() {
        // On Zen 5 converting the f16 activations as they are loaded (10 conversions per 24
        // FMAs, half the activation bytes) ran 1.45× faster than widening them first (session
        // 45: 185–190 ms against 272–282 for 4096 × 14336 × 512 at two threads).
        drive!(@ float_block(), g, out, tile_float, 4, 6, F16, F16);
    } else if KIND == F16 && g.ntok > 1 {
        // Activations widened to f32 one token block at a time (the block `drive!` then runs
        // as one): a tile converts only its rows' weights (4 per 24 FMAs instead of 10).
        let tb = ((FLOAT_BLOCK / (4 * g.cols.max(1))).max(6) / 6 * 6).min(g.ntok);
        super::with_scratch(0, tb * g.cols, |wide: &mut [f32]| {
            let mut t0 = 0;
            while t0 < g.ntok {
                let t1 = (t0 + tb).min(g.ntok);
                for t in t0..t1 {
                    // SAFETY: token `t` < ntok has `cols` f16 values at its offset.
                    let src = unsafe {
                        core::slice::from_raw_parts(
                            g.a.as_ptr().add(t * g.a_stride).cast::<f16>(),
                            g.cols,
                        )
                    };
                    let dst = &mut wide[(t - t0) * g.cols..(t - t0 + 1) * g.cols];
                    // SAFETY: this module's features.
                    unsafe { widen_f16(src, dst) };
                }
                let sub = Gemm {
                    a: super::f32_bytes(&wide[..(t1 - t0) * g.cols]),
                    a_stride: 4 * g.cols,
                    ntok: t1 - t0,
                    ..*g
                };
                drive!(@ FLOAT_BLOCK, &sub, &mut out[t0 * g.nrows..t1 * g.nrows], tile_float, 4, 6, F16, F32);
                t0 = t1;
            }
        });
    } else {
        drive!(@ FLOAT_BLOCK, g, out, tile_float, 4, 6, KIND, KIND);
    }
}

/// `dst[i] = src[i] as f32` (equal lengths).
///
/// # Safety
/// This module's features.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn widen_f16(src: &[f16], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    // SAFETY: masked loads and stores touch only elements below `n`.
    col_steps::<16>(n, |i, m| unsafe {
        let m = m as u16;
        let v = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, src.as_ptr().add(i).cast()));
        _mm512_mask_storeu_ps(dst.as_mut_ptr().add(i), m, v);
    });
}

/// bf16 through `vdpbf16ps`.
///
/// # Safety
/// As [`run_legacy`], and the CPU has AVX512-BF16.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,avx2,fma,f16c")]
unsafe fn run_bf16_dp(g: &Gemm<'_>, out: &mut [f32]) {
    drive!(@ float_block(), g, out, tile_bf16_dp, 4, 6);
}

/// Activation bytes per token block of the float GEMMs (tinyBLAS's ~72 tokens of 14336 f16
/// values): the block sits in L3 while every row tile of the call streams past it.
const FLOAT_BLOCK: usize = 2 << 20;

/// The token block of the f16 (Zen 5) and bf16 (`vdpbf16ps`) GEMMs whose activations are not
/// widened: [`FLOAT_BLOCK`], or twice that on AMD Zen 5 (144 tokens at 14336 columns, so the
/// weights stream from memory half as often), where it was the faster in every alternated
/// round of session 45 (bf16 4096 × 14336 × 512, two threads: 141–160 ms against 156–176; f16
/// in most rounds; 6 and 8 MiB no better than 4).
fn float_block() -> usize {
    if super::is_amd_zen5_or_later() {
        2 * FLOAT_BLOCK
    } else {
        FLOAT_BLOCK
    }
}

/// Reduce and write the tile's results.
///
/// # Safety
/// Features as the module; `r0 + R <= g.nrows`, `t0 + T <= g.ntok`, `out.len() == ntok*nrows`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn store<const R: usize, const T: usize>(
    g: &Gemm<'_>,
    r0: usize,
    t0: usize,
    acc: &[[__m512; T]; R],
    out: &mut [f32],
) {
    for r in 0..R {
        for t in 0..T {
            // SAFETY: in bounds by the contract above.
            unsafe {
                *out.get_unchecked_mut((t0 + t) * g.nrows + r0 + r) =
                    _mm512_reduce_add_ps(acc[r][t])
            };
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Float weights: f32, f16, bf16 against the same type.

/// Load up to 16 values (`m` selects them) of `KIND` at `p` as f32.
///
/// # Safety
/// Features as the module; the selected elements at `p` are readable.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn load_f<const KIND: u8>(p: *const u8, m: u16) -> __m512 {
    // SAFETY: masked loads touch only the selected elements.
    unsafe {
        match KIND {
            F32 => _mm512_maskz_loadu_ps(m, p.cast()),
            F16 => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p.cast())),
            _ => {
                let h = _mm256_maskz_loadu_epi16(m, p.cast());
                _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
            }
        }
    }
}

/// `step(i, m)` at columns `i = 0, W, 2W, ...` below `n`: `m` selects the step's columns, all
/// W of them (a constant, so the inlined loads are plain ones) but in the tail.
#[inline(always)]
fn col_steps<const W: usize>(n: usize, mut step: impl FnMut(usize, u32)) {
    let full = if W == 32 { u32::MAX } else { (1u32 << W) - 1 };
    let mut i = 0;
    while i + W <= n {
        step(i, full);
        i += W;
    }
    if i < n {
        step(i, (1u32 << (n - i)) - 1);
    }
}

/// Rows `r0..r0+R` × tokens `t0..t0+T` of a float matmul (the order: [`run_float`]).
///
/// # Safety
/// As [`tile_legacy`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn tile_float<const R: usize, const T: usize, const KIND: u8, const AK: u8>(
    g: &Gemm<'_>,
    r0: usize,
    t0: usize,
    out: &mut [f32],
) {
    let n = g.cols;
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    // SAFETY (whole body): element offsets below `n` within validated rows and tokens.
    unsafe {
        let wp = |r: usize| g.w.as_ptr().add((r0 + r) * g.w_stride);
        let ap = |t: usize| g.a.as_ptr().add((t0 + t) * g.a_stride);
        if KIND == BF16 {
            // 32 columns a step as 16 pairs: the high half of each 32-bit lane is column 2j+1,
            // the low half column 2j; each is an f32 once the other half is cleared.
            let hi = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
            let step = |i: usize, m: u32| {
                let mut wo = [_mm512_setzero_ps(); R];
                let mut we = [_mm512_setzero_ps(); R];
                for r in 0..R {
                    let v = _mm512_maskz_loadu_epi16(m, wp(r).add(2 * i).cast());
                    wo[r] = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
                    we[r] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
                }
                for t in 0..T {
                    let v = _mm512_maskz_loadu_epi16(m, ap(t).add(2 * i).cast());
                    let ao = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
                    let ae = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
                    for r in 0..R {
                        acc[r][t] = _mm512_fmadd_ps(wo[r], ao, acc[r][t]);
                        acc[r][t] = _mm512_fmadd_ps(we[r], ae, acc[r][t]);
                    }
                }
            };
            col_steps::<32>(n, step);
        } else {
            let esz = if KIND == F32 { 4 } else { 2 };
            let aesz = if AK == F32 { 4 } else { 2 };
            let step = |i: usize, m: u32| {
                let m = m as u16;
                let mut wv = [_mm512_setzero_ps(); R];
                for r in 0..R {
                    wv[r] = load_f::<KIND>(wp(r).add(i * esz), m);
                }
                for t in 0..T {
                    let a = load_f::<AK>(ap(t).add(i * aesz), m);
                    for r in 0..R {
                        acc[r][t] = _mm512_fmadd_ps(wv[r], a, acc[r][t]);
                    }
                }
            };
            col_steps::<16>(n, step);
        }
        store(g, r0, t0, &acc, out);
    }
}

/// [`tile_float`] for bf16 with `vdpbf16ps`.
///
/// # Safety
/// As [`tile_legacy`], and the CPU has AVX512-BF16.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,avx2,fma,f16c")]
unsafe fn tile_bf16_dp<const R: usize, const T: usize>(
    g: &Gemm<'_>,
    r0: usize,
    t0: usize,
    out: &mut [f32],
) {
    let n = g.cols;
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    // SAFETY (whole body): element offsets below `n` within validated rows and tokens; the
    // transmutes reinterpret 512 bits as 32 bf16 values.
    unsafe {
        let wp = |r: usize| g.w.as_ptr().add((r0 + r) * g.w_stride);
        let ap = |t: usize| g.a.as_ptr().add((t0 + t) * g.a_stride);
        let bh = |v: __m512i| core::mem::transmute::<__m512i, __m512bh>(v);
        let step = |i: usize, m: u32| {
            let mut wv = [_mm512_setzero_si512(); R];
            for r in 0..R {
                wv[r] = _mm512_maskz_loadu_epi16(m, wp(r).add(2 * i).cast());
            }
            for t in 0..T {
                let a = bh(_mm512_maskz_loadu_epi16(m, ap(t).add(2 * i).cast()));
                for r in 0..R {
                    acc[r][t] = _mm512_dpbf16_ps(acc[r][t], bh(wv[r]), a);
                }
            }
        };
        col_steps::<32>(n, step);
        store(g, r0, t0, &acc, out);
    }
}

/// Dot product of `n` elements of `KIND` (f32 or f16) in exactly ggml's order
/// (ggml-cpu/vec.cpp `ggml_vec_dot_f16`/`_f32` with the AVX-512 mappings of simd-mappings.h):
/// four 16-lane FMA accumulators over 64-element steps, reduced `(a0+a2)+(a1+a3)` then across
/// lanes as `_mm512_reduce_add_ps`, widened to f64, plus the tail's f32 products in f64.
/// Attention scores go through this, and greedy parity with llama.cpp depends on its rounding.
///
/// # Safety
/// Features as the module; `a` and `b` readable for `n` elements.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_raw<const KIND: u8>(a: *const u8, b: *const u8, n: usize) -> f32 {
    let esz = if KIND == F32 { 4 } else { 2 };
    let mut acc = [_mm512_setzero_ps(); 4];
    let np = n & !63;
    let mut sum;
    // SAFETY (whole body): offsets below `n` elements.
    unsafe {
        let mut i = 0;
        while i < np {
            for (k, s) in acc.iter_mut().enumerate() {
                let o = (i + 16 * k) * esz;
                *s = _mm512_fmadd_ps(
                    load_f::<KIND>(a.add(o), 0xFFFF),
                    load_f::<KIND>(b.add(o), 0xFFFF),
                    *s,
                );
            }
            i += 64;
        }
        let s = _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3]));
        sum = _mm512_reduce_add_ps(s) as f64;
        for i in np..n {
            let x = load_one::<KIND>(a.add(i * esz));
            let y = load_one::<KIND>(b.add(i * esz));
            sum += (x * y) as f64;
        }
    }
    sum as f32
}

/// One element of `KIND` as f32.
///
/// # Safety
/// `p` readable for one element.
#[inline(always)]
unsafe fn load_one<const KIND: u8>(p: *const u8) -> f32 {
    // SAFETY: one readable element.
    unsafe {
        match KIND {
            F32 => p.cast::<f32>().read_unaligned(),
            _ => f16::from_bits(p.cast::<u16>().read_unaligned()).to_f32(),
        }
    }
}

/// Whether this module has a matmul for `ty` (the registry completeness test).
#[cfg(test)]
pub(crate) fn has_matmul(ty: GgmlType) -> bool {
    matmul_for(ty).is_some()
}

/// A bf16 matmul through `vdpbf16ps` and through the FMA emulation of its order, or `None`
/// when this CPU lacks AVX-512 or AVX512-BF16 (the test that they agree bit for bit).
#[cfg(test)]
pub(crate) fn bf16_dp_and_fma(g: &Gemm<'_>) -> Option<(Vec<f32>, Vec<f32>)> {
    Avx512::new()?;
    if !is_x86_feature_detected!("avx512bf16") {
        return None;
    }
    let mut dp = vec![f32::NAN; g.ntok * g.nrows];
    let mut fma = dp.clone();
    // SAFETY: both features checked above; `g` was validated by `Gemm::new`.
    unsafe {
        run_bf16_dp(g, &mut dp);
        bf16_fma(g, &mut fma);
    }
    Some((dp, fma))
}

/// # Safety
/// As [`run_float`].
#[cfg(test)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn bf16_fma(g: &Gemm<'_>, out: &mut [f32]) {
    drive!(@ FLOAT_BLOCK, g, out, tile_float, 4, 4, BF16, BF16);
}

// ---------------------------------------------------------------------------------------------
// Tiled flash attention pieces, bit-identical to `scalar::fa_scores` / `fa_pv` / `softmax_exp`.

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

/// `R` query rows against the tile, 16 keys per register, each `kt` load shared by the rows.
///
/// # Safety
/// Features as the module; `q` holds `R * dk`, `out` `R * w` floats, `kt` `dk * w`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
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
            let mut m = [0u16; 4];
            for (c, mc) in m.iter_mut().enumerate() {
                let left = w.saturating_sub(j0 + 16 * c);
                *mc = if left >= 16 {
                    0xFFFF
                } else {
                    (1u16 << left) - 1
                };
            }
            let mut acc = [[_mm512_setzero_ps(); 4]; R];
            for d in 0..dk {
                let row = kt.add(d * w + j0);
                let mut k = [_mm512_setzero_ps(); 4];
                for c in 0..4 {
                    if m[c] != 0 {
                        k[c] = _mm512_maskz_loadu_ps(m[c], row.add(16 * c));
                    }
                }
                for r in 0..R {
                    let qv = _mm512_set1_ps(*q.get_unchecked(r * dk + d));
                    for c in 0..4 {
                        if m[c] != 0 {
                            acc[r][c] = _mm512_fmadd_ps(k[c], qv, acc[r][c]);
                        }
                    }
                }
            }
            for r in 0..R {
                for c in 0..4 {
                    if m[c] != 0 {
                        let o = out.as_mut_ptr().add(r * w + j0 + 16 * c);
                        _mm512_mask_storeu_ps(o, m[c], acc[r][c]);
                    }
                }
            }
            j0 += 64;
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

/// `R` rows of P·V, 64 columns at a time, each `v` load shared by the rows.
///
/// # Safety
/// Features as the module; `acc` holds `R * n`, `p` `R * w` floats, `v` `w * n`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn fa_pv_raw<const R: usize>(acc: &mut [f32], p: &[f32], v: *const f32, n: usize, w: usize) {
    let mut i0 = 0;
    // SAFETY (whole body): columns below `n` of rows below `w`; masked tails.
    unsafe {
        while i0 < n {
            let mut m = [0u16; 4];
            for (c, mc) in m.iter_mut().enumerate() {
                let left = n.saturating_sub(i0 + 16 * c);
                *mc = if left >= 16 {
                    0xFFFF
                } else {
                    (1u16 << left) - 1
                };
            }
            let mut a = [[_mm512_setzero_ps(); 4]; R];
            for r in 0..R {
                for c in 0..4 {
                    a[r][c] = _mm512_maskz_loadu_ps(m[c], acc.as_ptr().add(r * n + i0 + 16 * c));
                }
            }
            for j in 0..w {
                let row = v.add(j * n + i0);
                let mut x = [_mm512_setzero_ps(); 4];
                for c in 0..4 {
                    if m[c] != 0 {
                        x[c] = _mm512_maskz_loadu_ps(m[c], row.add(16 * c));
                    }
                }
                for r in 0..R {
                    let pv = _mm512_set1_ps(*p.get_unchecked(r * w + j));
                    for c in 0..4 {
                        if m[c] != 0 {
                            a[r][c] = _mm512_fmadd_ps(x[c], pv, a[r][c]);
                        }
                    }
                }
            }
            for r in 0..R {
                for c in 0..4 {
                    _mm512_mask_storeu_ps(acc.as_mut_ptr().add(r * n + i0 + 16 * c), m[c], a[r][c]);
                }
            }
            i0 += 64;
        }
    }
}

/// 16 lanes of `ggml_v_expf` (see `scalar::ggml_v_expf`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
fn v_expf(xv: __m512) -> __m512 {
    let f = |b: u32| _mm512_set1_ps(f32::from_bits(b));
    let r = f(0x4b40_0000);
    let z = _mm512_fmadd_ps(xv, f(0x3fb8_aa3b), r);
    let n = _mm512_sub_ps(z, r);
    let b = _mm512_fnmadd_ps(n, f(0x35bf_be8e), _mm512_fnmadd_ps(n, f(0x3f31_7200), xv));
    let d = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(_mm512_abs_ps(n), _mm512_set1_ps(192.0));
    let u = _mm512_mul_ps(b, b);
    let j = _mm512_fmadd_ps(
        _mm512_fmadd_ps(
            _mm512_fmadd_ps(f(0x3c07_2010), b, f(0x3d2b_9f17)),
            u,
            _mm512_fmadd_ps(f(0x3e2a_af33), b, f(0x3eff_fedb)),
        ),
        u,
        _mm512_fmadd_ps(f(0x3f7f_fff6), b, _mm512_set1_ps(1.0)),
    );
    let mut res = _mm512_scalef_ps(j, n);
    if d != 0 {
        let le0 = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(n, _mm512_setzero_ps());
        let alt = _mm512_mask_blend_ps(le0, _mm512_set1_ps(f32::INFINITY), _mm512_setzero_ps());
        res = _mm512_mask_blend_ps(d, res, alt);
    }
    res
}

fn widen_transpose_f16(
    src: &[f16],
    src_stride: usize,
    rows: usize,
    cols: usize,
    dst: &mut [f32],
    dst_stride: usize,
) {
    // SAFETY: token-gated (this table exists only with the module's features, which
    // `transpose16_raw` needs); it reads and writes 16 × 16 blocks as the helper's contract.
    unsafe {
        super::widen_transpose_blocks::<16>(
            src,
            src_stride,
            rows,
            cols,
            dst,
            dst_stride,
            transpose16_raw,
        )
    }
}

/// One 16 × 16 block: 16 f16 rows widened, transposed in registers, stored as 16 f32 rows.
///
/// # Safety
/// Features as the module; 16 rows of 16 values readable at `src` (stride `ss`), writable at
/// `dst` (stride `ds`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn transpose16_raw(src: *const f16, ss: usize, dst: *mut f32, ds: usize) {
    // SAFETY (whole body): as the contract.
    unsafe {
        let r: [__m512; 16] =
            core::array::from_fn(|i| _mm512_cvtph_ps(_mm256_loadu_si256(src.add(i * ss).cast())));
        // Pairs of rows interleaved, then quads, then 128-bit lanes across quads.
        let mut t = [_mm512_setzero_ps(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        let mut u = [_mm512_setzero_ps(); 16];
        for i in 0..4 {
            u[4 * i] = _mm512_shuffle_ps::<0x44>(t[4 * i], t[4 * i + 2]);
            u[4 * i + 1] = _mm512_shuffle_ps::<0xEE>(t[4 * i], t[4 * i + 2]);
            u[4 * i + 2] = _mm512_shuffle_ps::<0x44>(t[4 * i + 1], t[4 * i + 3]);
            u[4 * i + 3] = _mm512_shuffle_ps::<0xEE>(t[4 * i + 1], t[4 * i + 3]);
        }
        // u[4i + k], 128-bit lane L: column 4L + k of rows 4i..4i+4.
        let mut v = [_mm512_setzero_ps(); 16];
        for k in 0..4 {
            v[k] = _mm512_shuffle_f32x4::<0x88>(u[k], u[4 + k]);
            v[4 + k] = _mm512_shuffle_f32x4::<0xDD>(u[k], u[4 + k]);
            v[8 + k] = _mm512_shuffle_f32x4::<0x88>(u[8 + k], u[12 + k]);
            v[12 + k] = _mm512_shuffle_f32x4::<0xDD>(u[8 + k], u[12 + k]);
        }
        let mut o = [_mm512_setzero_ps(); 16];
        for k in 0..4 {
            o[k] = _mm512_shuffle_f32x4::<0x88>(v[k], v[8 + k]);
            o[8 + k] = _mm512_shuffle_f32x4::<0xDD>(v[k], v[8 + k]);
            o[4 + k] = _mm512_shuffle_f32x4::<0x88>(v[4 + k], v[12 + k]);
            o[12 + k] = _mm512_shuffle_f32x4::<0xDD>(v[4 + k], v[12 + k]);
        }
        for (c, x) in o.iter().enumerate() {
            _mm512_storeu_ps(dst.add(c * ds), *x);
        }
    }
}

fn swiglu(g: &mut [f32], u: &[f32]) {
    // SAFETY: token-gated.
    unsafe { swiglu_raw(g, u) }
}

/// `ggml_vec_swiglu_f32`'s 16-lane body (`x / (1 + v_expf(0 - x)) * u`), the tail as the
/// scalar reference.
///
/// # Safety
/// Features as the module; equal lengths.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn swiglu_raw(g: &mut [f32], u: &[f32]) {
    let n16 = g.len().min(u.len()) / 16 * 16;
    // SAFETY (whole body): 16-element groups below `n16` of both slices.
    unsafe {
        for i in (0..n16).step_by(16) {
            let p = g.as_mut_ptr().add(i);
            let x = _mm512_loadu_ps(p);
            let e = v_expf(_mm512_sub_ps(_mm512_setzero_ps(), x));
            let s = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0), e));
            _mm512_storeu_ps(p, _mm512_mul_ps(s, _mm512_loadu_ps(u.as_ptr().add(i))));
        }
    }
    crate::scalar::swiglu(&mut g[n16..], &u[n16..]);
}

fn softmax_exp(x: &mut [f32], max: f32) -> f64 {
    // SAFETY: token-gated.
    unsafe { softmax_exp_raw(x, max) }
}

/// # Safety
/// Features as the module.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn softmax_exp_raw(x: &mut [f32], max: f32) -> f64 {
    let mut sum = 0f64;
    let n16 = x.len() / 16 * 16;
    let mv = _mm512_set1_ps(max);
    // SAFETY (whole body): 16-element groups below `n16`.
    unsafe {
        for i in (0..n16).step_by(16) {
            let p = x.as_mut_ptr().add(i);
            let xv = _mm512_sub_ps(_mm512_loadu_ps(p), mv);
            let res = v_expf(xv);
            _mm512_storeu_ps(p, res);
            // `_mm512_reduce_add_ps` as GCC expands it: halves +8, +4, +2, +1.
            let h = _mm256_add_ps(
                _mm512_castps512_ps256(res),
                _mm512_extractf32x8_ps::<1>(res),
            );
            let q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
            let q = _mm_add_ps(q, _mm_movehl_ps(q, q));
            let q = _mm_add_ss(q, _mm_movehdup_ps(q));
            sum += _mm_cvtss_f32(q) as f64;
        }
    }
    for xi in &mut x[n16..] {
        *xi = (*xi - max).exp();
        sum += *xi as f64;
    }
    sum
}
