//! Activation quantization (f32 → q8_0 / q8_1 / q8_K / Q8_TF, and conversion to f16 / bf16)
//! with AVX2, bit-identical to `scalar::quantize`. Both the AVX2 and the AVX-512 tables use it:
//! it is bound by the loads and the per-block scalar scale, so wider registers buy nothing.
//!
//! A block holding an infinity or a NaN, or whose scale factor overflows, takes the scalar
//! reference (the SIMD max and round-to-int treat them differently from the reference's folds
//! and saturating casts); for Q8_TF, whose scale is the row's, the whole row does.

use crate::quant::{GgmlType, QK, QK_K, QK_TF};
use crate::scalar;
use core::arch::x86_64::*;

/// # Safety
/// Needs AVX2 + FMA + F16C (the callers' tokens prove it).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn quantize(ty: GgmlType, x: &[f32], y: &mut [u8]) -> bool {
    match ty {
        // SAFETY: as this function's contract.
        GgmlType::Q8_0 => unsafe { quantize_q8::<false>(x, y) },
        // SAFETY: as above.
        GgmlType::Q8_1 => unsafe { quantize_q8::<true>(x, y) },
        // SAFETY: as above.
        GgmlType::Q8_K => unsafe { quantize_q8_k(x, y) },
        // SAFETY: as above.
        GgmlType::Q8_TF => unsafe { quantize_q8_tf(x, y) },
        // SAFETY: as above.
        GgmlType::F16 => unsafe { to_f16(x, y) },
        // SAFETY: as above.
        GgmlType::BF16 => unsafe { to_bf16(x, y) },
        _ => return scalar::quantize(ty, x, y),
    }
    true
}

/// f32 → f16 with round-to-nearest-even (`vcvtps2ph`, as `half::f16::from_f32`).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn to_f16(x: &[f32], y: &mut [u8]) {
    let n = x.len().min(y.len() / 2);
    let mut i = 0;
    // SAFETY: 8 values read below `n` and 16 bytes written below `2n` per step.
    unsafe {
        while i + 8 <= n {
            let v = _mm256_loadu_ps(x.as_ptr().add(i));
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
            _mm_storeu_si128(y.as_mut_ptr().add(2 * i).cast(), h);
            i += 8;
        }
    }
    scalar::quantize(GgmlType::F16, &x[i..n], &mut y[2 * i..2 * n]);
}

/// f32 → bf16 as `scalar::f32_to_bf16_bits` (ggml's `GGML_FP32_TO_BF16`): round to nearest
/// even, a NaN kept quiet.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn to_bf16(x: &[f32], y: &mut [u8]) {
    let n = x.len().min(y.len() / 2);
    let eight = |p: *const f32| {
        // SAFETY: the caller's 8 readable values.
        let u = unsafe { _mm256_loadu_si256(p.cast()) };
        let nan = _mm256_cmpgt_epi32(
            _mm256_and_si256(u, _mm256_set1_epi32(0x7fff_ffff)),
            _mm256_set1_epi32(0x7f80_0000),
        );
        let hi = _mm256_srli_epi32::<16>(u);
        let bias = _mm256_add_epi32(
            _mm256_set1_epi32(0x7fff),
            _mm256_and_si256(hi, _mm256_set1_epi32(1)),
        );
        let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(u, bias));
        let quiet = _mm256_or_si256(hi, _mm256_set1_epi32(64));
        _mm256_blendv_epi8(rounded, quiet, nan)
    };
    let mut i = 0;
    // SAFETY: 16 values read below `n` and 32 bytes written below `2n` per step.
    unsafe {
        while i + 16 <= n {
            let a = eight(x.as_ptr().add(i));
            let b = eight(x.as_ptr().add(i + 8));
            // packus interleaves 128-bit halves: a0-3 b0-3 a4-7 b4-7 -> a0-7 b0-7.
            let p = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(a, b));
            _mm256_storeu_si256(y.as_mut_ptr().add(2 * i).cast(), p);
            i += 16;
        }
    }
    scalar::quantize(GgmlType::BF16, &x[i..n], &mut y[2 * i..2 * n]);
}

/// `|v|` of eight lanes, and whether any of them is an infinity or a NaN.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn abs_and_odd(v: __m256) -> (__m256, i32) {
    let a = _mm256_andnot_ps(_mm256_set1_ps(-0.0), v);
    // Not-less-than infinity, unordered true: +inf and NaN.
    let odd = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_NLT_UQ>(
        a,
        _mm256_set1_ps(f32::INFINITY),
    ));
    (a, odd)
}

/// The largest `|v|` of a block, or `None` when it holds an infinity or a NaN.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn block_amax(v: &[__m256]) -> Option<f32> {
    let mut odd = 0;
    let mut m = _mm256_setzero_ps();
    for vi in v {
        let (a, o) = abs_and_odd(*vi);
        odd |= o;
        m = _mm256_max_ps(m, a);
    }
    (odd == 0).then(|| hmax(m))
}

/// Horizontal max of eight non-NaN lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn hmax(v: __m256) -> f32 {
    let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let m = _mm_max_ss(m, _mm_movehdup_ps(m));
    _mm_cvtss_f32(m)
}

/// 32 i32 (four vectors, value order) to 32 i8 with signed saturation, in order.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn pack32(q: [__m256i; 4]) -> __m256i {
    // packs work per 128-bit lane: [q0.lo q1.lo | q0.hi q1.hi] → restore order at the end.
    let w01 = _mm256_packs_epi32(q[0], q[1]);
    let w23 = _mm256_packs_epi32(q[2], q[3]);
    let b = _mm256_packs_epi16(w01, w23);
    _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// q8_0 (`Q81 = false`) or q8_1 (`true`: the block also carries `s = f16(d · Σq)`).
///
/// # Safety
/// As [`quantize`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_q8<const Q81: bool>(x: &[f32], y: &mut [u8]) {
    let (ty, qoff) = if Q81 {
        (GgmlType::Q8_1, 4)
    } else {
        (GgmlType::Q8_0, 2)
    };
    let reference = if Q81 {
        scalar::quantize_q8_1
    } else {
        scalar::quantize_q8_0
    };
    for (xb, yb) in x.chunks_exact(QK).zip(y.chunks_exact_mut(ty.type_size())) {
        // SAFETY: `xb` holds 32 floats.
        let v = unsafe { [0, 8, 16, 24].map(|i| _mm256_loadu_ps(xb.as_ptr().add(i))) };
        let Some(amax) = block_amax(&v) else {
            reference(xb, yb);
            continue;
        };
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        if !id.is_finite() {
            // Denormal amax: the factor overflows, and the reference saturates where the
            // conversion would not.
            reference(xb, yb);
            continue;
        }
        yb[0..2].copy_from_slice(&half::f16::from_f32(d).to_bits().to_le_bytes());
        let idv = _mm256_set1_ps(id);
        // |v · id| <= 127: the conversion rounds half to even (MXCSR default), as `nearest_int`.
        let q = v.map(|vi| _mm256_cvtps_epi32(_mm256_mul_ps(vi, idv)));
        if Q81 {
            let sum = super::avx2::hsum_i32(_mm256_add_epi32(
                _mm256_add_epi32(q[0], q[1]),
                _mm256_add_epi32(q[2], q[3]),
            ));
            let s = half::f16::from_f32(d * sum as f32);
            yb[2..4].copy_from_slice(&s.to_bits().to_le_bytes());
        }
        // SAFETY: `yb` holds `qoff` + 32 bytes.
        unsafe { _mm256_storeu_si256(yb.as_mut_ptr().add(qoff).cast(), pack32(q)) };
    }
}

/// Q8_TF (`ternary::quantize_q8_tf`): one `d = amax / 127` for the whole row, codes rounded
/// half to even (the conversion under the default MXCSR, as `nearest_int` for |v| <= 127),
/// and per block the eight lane sums (`vpmaddubsw` by ones, `vpmaddwd` by ones: exact).
///
/// # Safety
/// As [`quantize`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_q8_tf(x: &[f32], y: &mut [u8]) {
    let n = x.len() / QK_TF * QK_TF;
    if n != x.len() {
        // A partial block: the reference's row maximum covers it too (callers pass whole
        // blocks; this keeps the bits equal for any input).
        crate::ternary::quantize_q8_tf(x, y);
        return;
    }
    let mut odd = 0;
    let mut m = _mm256_setzero_ps();
    for c in x[..n].chunks_exact(8) {
        // SAFETY: 8 floats.
        let (a, o) = abs_and_odd(unsafe { _mm256_loadu_ps(c.as_ptr()) });
        odd |= o;
        m = _mm256_max_ps(m, a);
    }
    let amax = hmax(m);
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    if odd != 0 || !id.is_finite() {
        // Infinities, NaNs, or an amax below ~3.7e-37 whose factor 127 / amax overflows: the
        // reference's saturating integer conversion.
        crate::ternary::quantize_q8_tf(x, y);
        return;
    }
    let d = amax / 127.0;
    let idv = _mm256_set1_ps(id);
    let (lo, hi) = (_mm256_set1_epi32(-127), _mm256_set1_epi32(127));
    let (ones8, ones16) = (_mm256_set1_epi8(1), _mm256_set1_epi16(1));
    let bs = GgmlType::Q8_TF.type_size();
    for (xb, yb) in x[..n].chunks_exact(QK_TF).zip(y.chunks_exact_mut(bs)) {
        yb[0..4].copy_from_slice(&d.to_le_bytes());
        let mut lsums = _mm256_setzero_si256();
        for ch in 0..QK_TF / 32 {
            // SAFETY: `xb` holds 128 floats.
            let v: [__m256; 4] = core::array::from_fn(|i| unsafe {
                _mm256_loadu_ps(xb.as_ptr().add(32 * ch + 8 * i))
            });
            let q = v.map(|vi| {
                let r = _mm256_cvtps_epi32(_mm256_mul_ps(vi, idv));
                _mm256_min_epi32(_mm256_max_epi32(r, lo), hi)
            });
            let b = pack32(q);
            // Byte e of the chunk lands in lane e / 4 (value e of the chunk: lane (e % 32) / 4).
            lsums = _mm256_add_epi32(
                lsums,
                _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, b), ones16),
            );
            // SAFETY: `yb` holds 4 + 128 + 32 bytes.
            unsafe { _mm256_storeu_si256(yb.as_mut_ptr().add(4 + 32 * ch).cast(), b) };
        }
        // SAFETY: as above.
        unsafe { _mm256_storeu_si256(yb.as_mut_ptr().add(4 + QK_TF).cast(), lsums) };
    }
}

/// # Safety
/// As [`quantize`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_q8_k(x: &[f32], y: &mut [u8]) {
    let bs = GgmlType::Q8_K.type_size();
    for (xb, yb) in x.chunks_exact(QK_K).zip(y.chunks_exact_mut(bs)) {
        // SAFETY: `xb` holds 256 floats.
        let v: [__m256; 32] =
            core::array::from_fn(|i| unsafe { _mm256_loadu_ps(xb.as_ptr().add(8 * i)) });
        let Some(amax) = block_amax(&v) else {
            scalar::quantize_q8_k(xb, yb);
            continue;
        };
        if amax == 0.0 {
            yb.fill(0);
            continue;
        }
        // The reference keeps the first value of largest magnitude (with its sign).
        let av = _mm256_set1_ps(amax);
        let mut max = amax;
        for (i, vi) in v.iter().enumerate() {
            let (a, _) = abs_and_odd(*vi);
            let hit = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(a, av));
            if hit != 0 {
                max = xb[8 * i + hit.trailing_zeros() as usize];
                break;
            }
        }
        let iscale = -127.0 / max;
        if !iscale.is_finite() {
            // Denormal max: as in `quantize_q8_0`.
            scalar::quantize_q8_k(xb, yb);
            continue;
        }
        let sv = _mm256_set1_ps(iscale);
        let lim = _mm256_set1_epi32(127);
        let q: [__m256i; 32] = core::array::from_fn(|i| {
            _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], sv)), lim)
        });
        for c in 0..8 {
            let p = pack32([q[4 * c], q[4 * c + 1], q[4 * c + 2], q[4 * c + 3]]);
            // SAFETY: `yb` holds 4 + 256 + 32 bytes.
            unsafe { _mm256_storeu_si256(yb.as_mut_ptr().add(4 + 32 * c).cast(), p) };
        }
        // bsums: group j = q[2j] + q[2j + 1], summed across lanes; four groups per hadd tree.
        for j4 in 0..4 {
            let s = |j: usize| _mm256_add_epi32(q[2 * j], q[2 * j + 1]);
            let (a, b, c, d) = (s(4 * j4), s(4 * j4 + 1), s(4 * j4 + 2), s(4 * j4 + 3));
            let h = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
            let sums = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
            let s16 = _mm_packs_epi32(sums, sums);
            // SAFETY: bsums 4j4..4j4+4 lie at 4 + 256 + 8·j4 (8 bytes).
            unsafe { _mm_storel_epi64(yb.as_mut_ptr().add(4 + QK_K + 8 * j4).cast(), s16) };
        }
        yb[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
    }
}
