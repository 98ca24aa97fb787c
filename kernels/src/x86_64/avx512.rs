//! AVX-512 (F, BW, VL, VNNI) kernels.
//!
//! Integer products use VNNI with the *unsigned* operand on the weight side: every weight code
//! is made non-negative (`q8_0` by `x ^ 0x80` = `x + 128`, `q4_0`/`q5_0`/`q*_K` are stored
//! unsigned with an implicit offset), and the offset is removed exactly by starting the i32
//! accumulator at `-offset * Σ activations` (the per-block sums `Activations` keeps, or the
//! q8_K `bsums`). So no `sign`/`abs` work per row, and every block's integer dot equals ggml's.
//!
//! Legacy types (32-value blocks) take two blocks per 512-bit register and apply the f32
//! scales per lane; k-quants fold the 6-bit sub-block scales in with `vpdpwssd` and convert to
//! f32 once per 256 values. A tile of R weight rows × T tokens shares every activation load
//! across the rows and every weight unpack across the tokens; the f32 accumulators are reduced
//! once per (row, token) at the end.

// Tile loops index several per-row / per-token arrays with the same counter, and the
// transcriptions of ggml keep its index arithmetic: iterator chains would obscure both.
#![allow(clippy::needless_range_loop)]

use super::{drive, k4_scales_mins, k_block_bytes, legacy_block_bytes, legacy_offset};
use super::{BF16, F16, F32, Q4_0, Q4_K, Q5_0, Q5_K, Q6_K, Q8_0};
use crate::dispatch::{Isa, Kernels, MatmulFn};
use crate::matmul::Gemm;
use crate::quant::{GgmlType, QK, QK_K};
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
            && is_x86_feature_detected!("avx512vnni")
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
            dot_f16,
            mad_f16,
            scale_f16,
            mad_f32,
        }
    }
}

// The safe entry points below are private to this module and only handed out through
// `Avx512::kernels`, which needs a token, which exists only if `Avx512::new` saw the features:
// that is the SAFETY argument of every `unsafe` call in them.

fn matmul_for(ty: GgmlType) -> Option<MatmulFn> {
    Some(match ty {
        GgmlType::Q8_0 => mm_q8_0,
        GgmlType::Q4_0 => mm_q4_0,
        GgmlType::Q5_0 => mm_q5_0,
        GgmlType::Q4_K => mm_q4_k,
        GgmlType::Q5_K => mm_q5_k,
        GgmlType::Q6_K => mm_q6_k,
        GgmlType::F32 => mm_f32,
        GgmlType::F16 => mm_f16,
        GgmlType::BF16 => mm_bf16,
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
entry!(mm_q4_0, run_legacy, Q4_0);
entry!(mm_q5_0, run_legacy, Q5_0);
entry!(mm_q4_k, run_k, Q4_K);
entry!(mm_q5_k, run_k, Q5_K);
entry!(mm_q6_k, run_k, Q6_K);
entry!(mm_f32, run_float, F32);
entry!(mm_f16, run_float, F16);
entry!(mm_bf16, run_float, BF16);

fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    // SAFETY: token-gated as above; both slices have `n` elements (checked by the caller).
    unsafe { dot_raw::<F32>(a.as_ptr().cast(), b.as_ptr().cast(), a.len().min(b.len())) }
}

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
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
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
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
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

/// # Safety
/// The CPU has this module's features; `g` comes from `Gemm::new` with `out.len() ==
/// g.ntok * g.nrows` and `g.wty` of kind `KIND`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn run_legacy<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) {
    if g.ntok == 1 {
        // SAFETY: as this function's contract.
        unsafe { gemv_legacy::<KIND>(g, out) };
    } else {
        // SAFETY: as this function's contract.
        unsafe { gemm_legacy::<KIND>(g, out) };
    }
}

/// # Safety
/// As [`run_legacy`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn run_k<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) {
    if g.ntok == 1 {
        // One row at a time: a single sequential stream (see `gemv_legacy`), 12-16 GB/s from
        // DRAM on Q6_K/Q4_K against 7-9 GB/s with 4-row tiles.
        drive!(g, out, tile_k, 1, 1, KIND);
    } else {
        // SAFETY: as this function's contract.
        unsafe { gemm_k::<KIND>(g, out) };
    }
}

/// # Safety
/// As [`run_legacy`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn run_float<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) {
    if g.ntok == 1 {
        drive!(g, out, tile_float, 4, 1, KIND);
    } else {
        drive!(g, out, tile_float, 4, 4, KIND);
    }
}

// ---------------------------------------------------------------------------------------------
// Legacy 32-value blocks: q8_0, q4_0, q5_0 against q8_0.

/// Unpack the two consecutive blocks at `p` into 64 unsigned codes and the per-lane weight
/// scales. Byte order: q8_0 `[b0 0..32, b1 0..32]`; q4_0/q5_0 `[b0 0..16, b1 0..16, b0 16..32,
/// b1 16..32]` (nibble order), so i32 lanes of block 1 are 8..16 (q8_0) or 4..8, 12..16.
///
/// # Safety
/// Features as the module; `p` is readable for two blocks of `KIND`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn unpack_legacy<const KIND: u8>(p: *const u8) -> (__m512i, __m512) {
    let bs = legacy_block_bytes(KIND);
    // SAFETY (whole body): reads stay within the two blocks at `p`.
    unsafe {
        let d0 = p.cast::<u16>().read_unaligned() as u64 * 0x0001_0001_0001_0001;
        let d1 = p.add(bs).cast::<u16>().read_unaligned() as u64 * 0x0001_0001_0001_0001;
        let dh = if KIND == Q8_0 {
            _mm256_setr_epi64x(d0 as i64, d0 as i64, d1 as i64, d1 as i64)
        } else {
            _mm256_setr_epi64x(d0 as i64, d1 as i64, d0 as i64, d1 as i64)
        };
        let dw = _mm512_cvtph_ps(dh);
        let u = if KIND == Q8_0 {
            let lo = _mm256_loadu_si256(p.add(2).cast());
            let hi = _mm256_loadu_si256(p.add(2 + bs).cast());
            let v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            _mm512_xor_si512(v, _mm512_set1_epi8(-128))
        } else {
            let qoff = if KIND == Q4_0 { 2 } else { 6 };
            let q0 = _mm_loadu_si128(p.add(qoff).cast());
            let q1 = _mm_loadu_si128(p.add(qoff + bs).cast());
            let q = _mm256_inserti128_si256(_mm256_castsi128_si256(q0), q1, 1);
            let qq = _mm512_broadcast_i64x4(q);
            let sh = _mm512_mask_srli_epi16(qq, 0xFFFF_0000, qq, 4);
            let mut u = _mm512_and_si512(sh, _mm512_set1_epi8(0x0F));
            if KIND == Q5_0 {
                let h0 = p.add(2).cast::<u32>().read_unaligned() as u64;
                let h1 = p.add(2 + bs).cast::<u32>().read_unaligned() as u64;
                let m =
                    (h0 & 0xFFFF) | ((h1 & 0xFFFF) << 16) | ((h0 >> 16) << 32) | ((h1 >> 16) << 48);
                u = _mm512_mask_add_epi8(u, m, u, _mm512_set1_epi8(16));
            }
            u
        };
        (u, dw)
    }
}

/// The activation side of one block pair for [`gemv_pair`]: codes in the weight's byte order,
/// the `-offset·Σa` corrections in each block's first i32 lane, and per-lane scales.
#[derive(Clone, Copy)]
struct PairAct {
    a: __m512i,
    c: __m512i,
    d: __m512,
}

/// GEMV (one token) of a legacy type, one weight row at a time.
///
/// A single sequential weight stream is what the hardware prefetchers follow: tiles of 4 rows
/// (four streams 680 bytes apart on Gemma's LM head) left the GEMV at ~5 GB/s from DRAM, with
/// or without software prefetch, against ~20 GB/s for one stream. The activation side is
/// prepared once per call for up to `CHUNK` block pairs; wider rows run in column chunks.
///
/// # Safety
/// As [`run_legacy`], with `g.ntok == 1`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn gemv_legacy<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) {
    const CHUNK: usize = 64;
    let nb = g.cols / QK;
    let npair = nb.div_ceil(2);
    let k = legacy_offset(KIND);
    let (hi_mask, lane1): (u16, u32) = if KIND == Q8_0 {
        (0xFF00, 8)
    } else {
        (0xF0F0, 4)
    };
    let zero = PairAct {
        a: _mm512_setzero_si512(),
        c: _mm512_setzero_si512(),
        d: _mm512_setzero_ps(),
    };
    let mut prep = [zero; CHUNK];
    // SAFETY (whole body): block offsets below `nb` in the one activation row; an odd last
    // block is read from a zero-padded stack copy.
    unsafe {
        let a = g.a.as_ptr();
        let mut p0 = 0;
        while p0 < npair {
            let p1 = (p0 + CHUNK).min(npair);
            for p in p0..p1 {
                let b = 2 * p;
                let two = b + 1 < nb;
                let mut abuf = [0u8; 68];
                let ap = if two {
                    a.add(b * 34)
                } else {
                    core::ptr::copy_nonoverlapping(a.add(b * 34), abuf.as_mut_ptr(), 34);
                    abuf.as_ptr()
                };
                let (d1, s1) = if two {
                    (g.a_scales[b + 1], g.a_sums[b + 1])
                } else {
                    (0.0, 0)
                };
                let lo = _mm256_loadu_si256(ap.add(2).cast());
                let hi = _mm256_loadu_si256(ap.add(36).cast());
                let v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
                let codes = if KIND == Q8_0 {
                    v
                } else {
                    _mm512_permutexvar_epi64(_mm512_set_epi64(7, 6, 3, 2, 5, 4, 1, 0), v)
                };
                let c0 = _mm512_maskz_set1_epi32(1, -k * g.a_sums[b]);
                prep[p - p0] = PairAct {
                    a: codes,
                    c: _mm512_mask_set1_epi32(c0, 1 << lane1, -k * s1),
                    d: _mm512_mask_blend_ps(
                        hi_mask,
                        _mm512_set1_ps(g.a_scales[b]),
                        _mm512_set1_ps(d1),
                    ),
                };
            }
            let odd = p1 == npair && nb % 2 == 1;
            let full = if odd { p1 - 1 } else { p1 };
            gemv_rows::<KIND>(g, out, &prep[..p1 - p0], p0, full - p0, odd);
            p0 = p1;
        }
    }
}

/// Every row's dot with `np` prepared pairs from pair `p0` on (and the padded odd last block
/// after them when `odd`), added to `out` unless `p0 == 0`.
///
/// # Safety
/// As [`gemv_legacy`]; `prep` holds `np` pairs (+1 when `odd`, the row's last block).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn gemv_rows<const KIND: u8>(
    g: &Gemm<'_>,
    out: &mut [f32],
    prep: &[PairAct],
    p0: usize,
    np: usize,
    odd: bool,
) {
    let bs = legacy_block_bytes(KIND);
    // SAFETY (whole body): pairs p0..p0+np (and the odd block) lie in each validated row.
    unsafe {
        for r in 0..g.nrows {
            let w = g.w.as_ptr().add(r * g.w_stride + 2 * p0 * bs);
            // Two accumulators (even and odd pairs) in named locals: an array indexed by
            // `i & 1` was kept on the stack, a store-to-load chain per pair.
            let mut acc0 = _mm512_setzero_ps();
            let mut acc1 = _mm512_setzero_ps();
            let mut i = 0;
            while i + 2 <= np {
                let wp = w.add(2 * i * bs);
                acc0 = gemv_pair::<KIND>(wp, prep.get_unchecked(i), acc0);
                acc1 = gemv_pair::<KIND>(wp.add(2 * bs), prep.get_unchecked(i + 1), acc1);
                i += 2;
            }
            if i < np {
                acc0 = gemv_pair::<KIND>(w.add(2 * i * bs), prep.get_unchecked(i), acc0);
            }
            if odd {
                let mut wbuf = [0u8; 68];
                core::ptr::copy_nonoverlapping(w.add(2 * np * bs), wbuf.as_mut_ptr(), bs);
                acc1 = gemv_pair::<KIND>(wbuf.as_ptr(), prep.get_unchecked(np), acc1);
            }
            let s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
            let o = out.get_unchecked_mut(r);
            *o = if p0 == 0 { s } else { *o + s };
        }
    }
}

/// `acc + Σ` over the block pair at `wp` against prepared activations (see [`gemv_legacy`]).
///
/// # Safety
/// Features as the module; `wp` readable for two `KIND` blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn gemv_pair<const KIND: u8>(wp: *const u8, x: &PairAct, acc: __m512) -> __m512 {
    // SAFETY: reads within the two blocks at `wp`.
    unsafe {
        // Two 32-byte loads per q8_0 pair, not one 64-byte load (+ a masked one for the last
        // two codes): the line-splitting 64-byte loads cost a third of the DRAM throughput.
        let (u, dw) = unpack_legacy::<KIND>(wp);
        let isum = _mm512_dpbusd_epi32(x.c, u, x.a);
        _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, x.d), acc)
    }
}

/// One weight block pair unpacked for the GEMM: 64 unsigned codes in q8_0 byte order
/// (`[b0 0..32, b1 0..32]`, whatever the kind) and the per-lane f32 weight scales.
#[derive(Clone, Copy)]
struct WPair {
    u: __m512i,
    d: __m512,
}

/// Block pairs per column chunk of [`gemm_legacy`]'s weight scratch (2048 columns).
const GEMM_CHUNK: usize = 32;

/// GEMM (several tokens) of a legacy type. Each group of 4 rows is unpacked once per token
/// block and column chunk into a stack scratch of ready-to-`vpdpbusd` codes in the activation's
/// byte order, then every token of the block streams past it 4 at a time; column chunks after
/// the first add to `out`.
///
/// # Safety
/// As [`run_legacy`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn gemm_legacy<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) {
    const R: usize = 8;
    const T: usize = 2;
    let nb = g.cols / QK;
    let npair = nb.div_ceil(2);
    let zero = WPair {
        u: _mm512_setzero_si512(),
        d: _mm512_setzero_ps(),
    };
    let mut scratch = [[zero; GEMM_CHUNK]; R];
    // Token block: the activations of one block stay in L2 while the row groups stream past.
    let tb = ((256 * 1024) / g.a_stride.max(1)).max(T) / T * T;
    let mut t0 = 0;
    // SAFETY (whole body): rows below `g.nrows`, tokens below `g.ntok`, pairs below `npair`
    // (the helpers' contracts), as validated by `Gemm::new`.
    unsafe {
        while t0 < g.ntok {
            let t1 = (t0 + tb).min(g.ntok);
            let mut r0 = 0;
            while r0 < g.nrows {
                let nr = if g.nrows - r0 >= R { R } else { 1 };
                let mut p0 = 0;
                while p0 < npair {
                    let p1 = (p0 + GEMM_CHUNK).min(npair);
                    for r in 0..nr {
                        let w = g.w.as_ptr().add((r0 + r) * g.w_stride);
                        prepack_legacy::<KIND>(w, nb, p0, p1, &mut scratch[r]);
                    }
                    let mut t = t0;
                    if nr == R {
                        while t1 - t >= T {
                            gemm_tile::<R, T, KIND>(g, &scratch, r0, t, p0, p1, out);
                            t += T;
                        }
                        while t < t1 {
                            gemm_tile::<R, 1, KIND>(g, &scratch, r0, t, p0, p1, out);
                            t += 1;
                        }
                    } else {
                        let s1 = core::slice::from_ref(&scratch[0])
                            .try_into()
                            .unwrap_unchecked();
                        while t1 - t >= T {
                            gemm_tile::<1, T, KIND>(g, s1, r0, t, p0, p1, out);
                            t += T;
                        }
                        while t < t1 {
                            gemm_tile::<1, 1, KIND>(g, s1, r0, t, p0, p1, out);
                            t += 1;
                        }
                    }
                    p0 = p1;
                }
                r0 += nr;
            }
            t0 = t1;
        }
    }
}

/// Unpack pairs `p0..p1` of the row at `w` (`nb` blocks) into `dst[..p1 - p0]`; an odd last
/// block is paired with a zero block (codes 0, scale 0).
///
/// # Safety
/// Features as the module; `w` readable for `nb` blocks of `KIND`, `p1 <= nb.div_ceil(2)`,
/// `p1 - p0 <= GEMM_CHUNK`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn prepack_legacy<const KIND: u8>(
    w: *const u8,
    nb: usize,
    p0: usize,
    p1: usize,
    dst: &mut [WPair; GEMM_CHUNK],
) {
    let bs = legacy_block_bytes(KIND);
    // SAFETY (whole body): blocks below `nb`; the odd last block goes through a stack copy.
    unsafe {
        for p in p0..p1 {
            let b = 2 * p;
            let mut wbuf = [0u8; 68];
            let wp = if b + 1 < nb {
                w.add(b * bs)
            } else {
                core::ptr::copy_nonoverlapping(w.add(b * bs), wbuf.as_mut_ptr(), bs);
                wbuf.as_ptr()
            };
            let (u, d) = unpack_legacy::<KIND>(wp);
            *dst.get_unchecked_mut(p - p0) = if KIND == Q8_0 {
                WPair { u, d }
            } else {
                // Nibble order → block order, so the activations load as they are stored.
                let idx = _mm512_set_epi64(7, 6, 3, 2, 5, 4, 1, 0);
                WPair {
                    u: _mm512_permutexvar_epi64(idx, u),
                    d: _mm512_castsi512_ps(_mm512_permutexvar_epi64(idx, _mm512_castps_si512(d))),
                }
            };
        }
        let np = p1 - p0;
        if np % 2 == 1 {
            // An odd pair count pads the last quad with a zero pair (p1 - p0 < GEMM_CHUNK).
            *dst.get_unchecked_mut(np) = WPair {
                u: _mm512_setzero_si512(),
                d: _mm512_setzero_ps(),
            };
        }
        // Quad scales: `unpacklo(dA, dB)` is the lane order of `unpacklo(iA, iB) +
        // unpackhi(iA, iB)` in `gemm_tile`, kept in pair A's slot.
        for q in (0..np).step_by(2) {
            let db = dst.get_unchecked(q + 1).d;
            let a = dst.get_unchecked_mut(q);
            a.d = _mm512_unpacklo_ps(a.d, db);
        }
    }
}

/// Rows `r0..r0+R` × tokens `t0..t0+T` over pairs `p0..p1`, from unpacked weights; written to
/// `out` when `p0 == 0`, else added.
///
/// # Safety
/// Features as the module; `g` validated, `r0 + R <= g.nrows`, `t0 + T <= g.ntok`, `w[r]`
/// holds pairs `p0..p1` of row `r0 + r` (`p1 <= nb.div_ceil(2)`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn gemm_tile<const R: usize, const T: usize, const KIND: u8>(
    g: &Gemm<'_>,
    w: &[[WPair; GEMM_CHUNK]; R],
    r0: usize,
    t0: usize,
    p0: usize,
    p1: usize,
    out: &mut [f32],
) {
    let nb = g.cols / QK;
    let k = legacy_offset(KIND);
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    // SAFETY (whole body): activation blocks below `nb` of tokens t0..t0+T (the second block
    // of an odd last pair is neither loaded nor its side tables read), pairs below `p1 - p0`
    // of the scratch.
    unsafe {
        let sc = g.a_scales.as_ptr();
        let zi = _mm512_setzero_si512();
        let kv = _mm512_set1_epi8(k as u8 as i8);
        let sel = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi32(1), 1);
        // One quad (two pairs, A and B) at a time: the two pairs' i32 lanes are folded into
        // one register of four blocks (see `prepack_legacy`) before the float work.
        let mut p = p0;
        while p < p1 {
            let mut av = [[_mm512_setzero_si512(); 2]; T];
            let mut cv = [[_mm512_setzero_si512(); 2]; T];
            let mut dav = [_mm512_setzero_ps(); T];
            for t in 0..T {
                let mut dh = [_mm512_setzero_ps(); 2];
                for h in 0..2 {
                    if p + h == p1 {
                        break;
                    }
                    let b = 2 * (p + h);
                    let ap = g.a.as_ptr().add((t0 + t) * g.a_stride + b * 34);
                    let i = (t0 + t) * nb + b;
                    let lo = _mm256_loadu_si256(ap.add(2).cast());
                    let (hi, d1) = if b + 1 < nb {
                        (_mm256_loadu_si256(ap.add(36).cast()), *sc.add(i + 1))
                    } else {
                        (_mm256_setzero_si256(), 0.0)
                    };
                    av[t][h] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
                    // `-offset·Σa` spread over each block's lanes, from the codes themselves.
                    cv[t][h] = _mm512_sub_epi32(zi, _mm512_dpbusd_epi32(zi, kv, av[t][h]));
                    let d2 = _mm_unpacklo_ps(_mm_set_ss(*sc.add(i)), _mm_set_ss(d1));
                    dh[h] = _mm512_permutexvar_ps(sel, _mm512_castps128_ps512(d2));
                }
                dav[t] = _mm512_unpacklo_ps(dh[0], dh[1]);
            }
            for r in 0..R {
                let wa = w[r].get_unchecked(p - p0);
                let ub = w[r].get_unchecked(p + 1 - p0).u;
                for t in 0..T {
                    let ia = _mm512_dpbusd_epi32(cv[t][0], wa.u, av[t][0]);
                    let ib = _mm512_dpbusd_epi32(cv[t][1], ub, av[t][1]);
                    let isum = _mm512_add_epi32(
                        _mm512_unpacklo_epi32(ia, ib),
                        _mm512_unpackhi_epi32(ia, ib),
                    );
                    acc[r][t] = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(isum),
                        _mm512_mul_ps(wa.d, dav[t]),
                        acc[r][t],
                    );
                }
            }
            p += 2;
        }
        for r in 0..R {
            for t in 0..T {
                let s = _mm512_reduce_add_ps(acc[r][t]);
                let o = out.get_unchecked_mut((t0 + t) * g.nrows + r0 + r);
                *o = if p0 == 0 { s } else { *o + s };
            }
        }
    }
}

/// How many row tiles ahead the weight stream is prefetched.
const PF_ROWS: usize = 2;

/// Prefetch the cache line at `p` into all levels (a hint: never faults, any address is fine).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn prefetch(p: *const u8) {
    _mm_prefetch::<_MM_HINT_T0>(p.cast())
}

/// Reduce and write the tile's results.
///
/// # Safety
/// Features as the module; `r0 + R <= g.nrows`, `t0 + T <= g.ntok`, `out.len() == ntok*nrows`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
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
// k-quants: q4_K, q5_K, q6_K against q8_K.

/// One unpacked weight super-block: 4 × 64 unsigned codes in value order, the sub-block scales
/// as i16 lanes matching `vpmaddubsw` output, f32 `d` and `dmin`, and the i16 vector that
/// multiplies the q8_K `bsums` (mins, duplicated per pair of 16, for q4_K/q5_K; the scales for
/// q6_K, whose codes carry an offset of 32).
#[derive(Clone, Copy)]
struct KBlock {
    u: [__m512i; 4],
    sc: [__m512i; 4],
    d: f32,
    dmin: f32,
    bsum_w: __m256i,
}

/// # Safety
/// Features as the module; `p` readable for one `KIND` super-block.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
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

/// # Safety
/// Features as the module; `p` readable for 2 bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn f16_to_f32(p: *const u8) -> f32 {
    // SAFETY: 2 readable bytes at `p`.
    let bits = unsafe { p.cast::<u16>().read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// Super-blocks per column chunk of [`gemm_k`]'s weight scratch (2048 columns).
const GEMM_K_CHUNK: usize = 8;

/// GEMM (several tokens) of a k-quant: each group of 4 rows is unpacked once per token block
/// and column chunk into a stack scratch of [`KBlock`]s, then the tokens of the block stream
/// past it 4 at a time; column chunks after the first add to `out`.
///
/// # Safety
/// As [`run_legacy`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn gemm_k<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) {
    const R: usize = 4;
    const T: usize = 4;
    let nsb = g.cols / QK_K;
    let wbs = k_block_bytes(KIND);
    let zero = KBlock {
        u: [_mm512_setzero_si512(); 4],
        sc: [_mm512_setzero_si512(); 4],
        d: 0.0,
        dmin: 0.0,
        bsum_w: _mm256_setzero_si256(),
    };
    let mut scratch = [[zero; GEMM_K_CHUNK]; R];
    let tb = ((256 * 1024) / g.a_stride.max(1)).max(T) / T * T;
    let mut t0 = 0;
    // SAFETY (whole body): rows below `g.nrows`, tokens below `g.ntok`, super-blocks below
    // `nsb` (the helpers' contracts), as validated by `Gemm::new`.
    unsafe {
        while t0 < g.ntok {
            let t1 = (t0 + tb).min(g.ntok);
            let mut r0 = 0;
            while r0 < g.nrows {
                let nr = if g.nrows - r0 >= R { R } else { 1 };
                let mut s0 = 0;
                while s0 < nsb {
                    let s1 = (s0 + GEMM_K_CHUNK).min(nsb);
                    for r in 0..nr {
                        let w = g.w.as_ptr().add((r0 + r) * g.w_stride);
                        for sb in s0..s1 {
                            scratch[r][sb - s0] = unpack_k::<KIND>(w.add(sb * wbs));
                        }
                    }
                    let mut t = t0;
                    if nr == R {
                        while t1 - t >= T {
                            gemm_k_tile::<R, T, KIND>(g, &scratch, r0, t, s0, s1, out);
                            t += T;
                        }
                        while t < t1 {
                            gemm_k_tile::<R, 1, KIND>(g, &scratch, r0, t, s0, s1, out);
                            t += 1;
                        }
                    } else {
                        let w1 = core::slice::from_ref(&scratch[0])
                            .try_into()
                            .unwrap_unchecked();
                        while t1 - t >= T {
                            gemm_k_tile::<1, T, KIND>(g, w1, r0, t, s0, s1, out);
                            t += T;
                        }
                        while t < t1 {
                            gemm_k_tile::<1, 1, KIND>(g, w1, r0, t, s0, s1, out);
                            t += 1;
                        }
                    }
                    s0 = s1;
                }
                r0 += nr;
            }
            t0 = t1;
        }
    }
}

/// Rows `r0..r0+R` × tokens `t0..t0+T` over super-blocks `s0..s1`, from unpacked weights;
/// written to `out` when `s0 == 0`, else added.
///
/// # Safety
/// Features as the module; `g` validated, `r0 + R <= g.nrows`, `t0 + T <= g.ntok`, `w[r]`
/// holds super-blocks `s0..s1` of row `r0 + r` (`s1 <= g.cols / QK_K`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn gemm_k_tile<const R: usize, const T: usize, const KIND: u8>(
    g: &Gemm<'_>,
    w: &[[KBlock; GEMM_K_CHUNK]; R],
    r0: usize,
    t0: usize,
    s0: usize,
    s1: usize,
    out: &mut [f32],
) {
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    // SAFETY (whole body): super-blocks s0..s1 of tokens t0..t0+T (q8_K: f32 d at 0, qs at 4,
    // bsums at 260), scratch entries below `s1 - s0`.
    unsafe {
        for sb in s0..s1 {
            let mut ap = [core::ptr::null::<u8>(); T];
            let mut ad = [0f32; T];
            let mut bsums = [_mm256_setzero_si256(); T];
            for t in 0..T {
                ap[t] = g.a.as_ptr().add((t0 + t) * g.a_stride + sb * 292);
                ad[t] = ap[t].cast::<f32>().read_unaligned();
                bsums[t] = _mm256_loadu_si256(ap[t].add(4 + QK_K).cast());
            }
            for r in 0..R {
                let kb = w[r].get_unchecked(sb - s0);
                for t in 0..T {
                    k_block_dot::<KIND>(kb, ap[t], ad[t], bsums[t], &mut acc[r][t]);
                }
            }
        }
        for r in 0..R {
            for t in 0..T {
                let s = _mm512_reduce_add_ps(acc[r][t]);
                let o = out.get_unchecked_mut((t0 + t) * g.nrows + r0 + r);
                *o = if s0 == 0 { s } else { *o + s };
            }
        }
    }
}

/// `acc += ` one unpacked super-block times the q8_K super-block at `ap` (scale `ad`, `bsums`).
///
/// # Safety
/// Features as the module; `ap` readable for one q8_K super-block.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn k_block_dot<const KIND: u8>(
    kb: &KBlock,
    ap: *const u8,
    ad: f32,
    bsums: __m256i,
    acc: &mut __m512,
) {
    let mut isum = _mm512_setzero_si512();
    for c in 0..4 {
        // SAFETY: within the q8_K super-block at `ap`.
        let a = unsafe { _mm512_loadu_si512(ap.add(4 + 64 * c).cast()) };
        isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(kb.u[c], a), kb.sc[c]);
    }
    let corr = _mm256_madd_epi16(bsums, kb.bsum_w);
    if KIND == Q6_K {
        isum = _mm512_sub_epi32(isum, _mm512_zextsi256_si512(_mm256_slli_epi32(corr, 5)));
        let s = _mm512_set1_ps(kb.d * ad);
        *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), s, *acc);
    } else {
        let s = _mm512_set1_ps(kb.d * ad);
        *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), s, *acc);
        let m = _mm512_set1_ps(kb.dmin * ad);
        let mins = _mm512_cvtepi32_ps(_mm512_zextsi256_si512(corr));
        *acc = _mm512_fnmadd_ps(mins, m, *acc);
    }
}

/// Rows `r0..r0+R` × tokens `t0..t0+T` of a k-quant matmul.
///
/// # Safety
/// As [`tile_legacy`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tile_k<const R: usize, const T: usize, const KIND: u8>(
    g: &Gemm<'_>,
    r0: usize,
    t0: usize,
    out: &mut [f32],
) {
    let nsb = g.cols / QK_K;
    let wbs = k_block_bytes(KIND);
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    // SAFETY (whole body): offsets stay within rows r0..r0+R and tokens t0..t0+T, nsb
    // super-blocks each (q8_K: f32 d at 0, qs at 4, bsums at 260).
    unsafe {
        for sb in 0..nsb {
            let mut ap = [core::ptr::null::<u8>(); T];
            let mut ad = [0f32; T];
            let mut bsums = [_mm256_setzero_si256(); T];
            for t in 0..T {
                ap[t] = g.a.as_ptr().add((t0 + t) * g.a_stride + sb * 292);
                ad[t] = ap[t].cast::<f32>().read_unaligned();
                bsums[t] = _mm256_loadu_si256(ap[t].add(4 + QK_K).cast());
            }
            for r in 0..R {
                let p = g.w.as_ptr().add((r0 + r) * g.w_stride + sb * wbs);
                if R > 1 {
                    for l in (0..wbs).step_by(64) {
                        prefetch(p.wrapping_add(PF_ROWS * R * g.w_stride + l));
                    }
                }
                let kb = unpack_k::<KIND>(p);
                for t in 0..T {
                    let mut isum = _mm512_setzero_si512();
                    for c in 0..4 {
                        let a = _mm512_loadu_si512(ap[t].add(4 + 64 * c).cast());
                        isum =
                            _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(kb.u[c], a), kb.sc[c]);
                    }
                    let corr = _mm256_madd_epi16(bsums[t], kb.bsum_w);
                    if KIND == Q6_K {
                        isum = _mm512_sub_epi32(
                            isum,
                            _mm512_zextsi256_si512(_mm256_slli_epi32(corr, 5)),
                        );
                        let s = _mm512_set1_ps(kb.d * ad[t]);
                        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), s, acc[r][t]);
                    } else {
                        let s = _mm512_set1_ps(kb.d * ad[t]);
                        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), s, acc[r][t]);
                        let m = _mm512_set1_ps(kb.dmin * ad[t]);
                        let mins = _mm512_cvtepi32_ps(_mm512_zextsi256_si512(corr));
                        acc[r][t] = _mm512_fnmadd_ps(mins, m, acc[r][t]);
                    }
                }
            }
        }
        store(g, r0, t0, &acc, out);
    }
}

// ---------------------------------------------------------------------------------------------
// Float weights: f32, f16, bf16 against the same type.

/// Load up to 16 values (`m` selects them) of `KIND` at `p` as f32.
///
/// # Safety
/// Features as the module; the selected elements at `p` are readable.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
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

/// Rows `r0..r0+R` × tokens `t0..t0+T` of a float matmul.
///
/// # Safety
/// As [`tile_legacy`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tile_float<const R: usize, const T: usize, const KIND: u8>(
    g: &Gemm<'_>,
    r0: usize,
    t0: usize,
    out: &mut [f32],
) {
    let esz = if KIND == F32 { 4 } else { 2 };
    let n = g.cols;
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    // SAFETY (whole body): element offsets below `n` within validated rows and tokens.
    unsafe {
        let mut i = 0;
        while i < n {
            let m: u16 = if n - i >= 16 {
                0xFFFF
            } else {
                (1u16 << (n - i)) - 1
            };
            let mut av = [_mm512_setzero_ps(); T];
            for t in 0..T {
                av[t] = load_f::<KIND>(g.a.as_ptr().add((t0 + t) * g.a_stride + i * esz), m);
            }
            for r in 0..R {
                let w = load_f::<KIND>(g.w.as_ptr().add((r0 + r) * g.w_stride + i * esz), m);
                for t in 0..T {
                    acc[r][t] = _mm512_fmadd_ps(w, av[t], acc[r][t]);
                }
            }
            i += 16;
        }
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
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
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
