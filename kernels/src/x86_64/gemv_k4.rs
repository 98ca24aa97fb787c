//! The q4_K / q5_K GEMV (one token) on AVX-512 in `KOrder::Sb256` order — the repacked
//! `ggml_gemv_q4_K_8x8_q8_K`'s: per row and super-block one FMA of the exact integer sum of the
//! scaled products and one of the mins, `acc - acc_min` at the end.
//!
//! What makes it cheaper than unpacking a super-block into value order
//! (`avx512q::unpack_k`) and reducing each (row, super-block) horizontally:
//! - **The token is rearranged once per call into the weights' nibble order**, so the weights
//!   need no shuffle: a 64-byte load of `qs` holds chunks 0 and 1 (values 0–127), its low
//!   nibbles sub-blocks 0 and 2, its high nibbles 1 and 3; the activations are laid out
//!   `[a0..32, a64..96]`, `[a32..64, a96..128]`, and so on. Each sub-block's 6-bit scale reaches
//!   its 16 `vpmaddubsw` lanes through one in-lane `vpshufb` of the 8 scales.
//! - **Reductions are shared**: rows are read one after another (one sequential stream from
//!   memory, which software prefetch leads on Intel and AMD Zen 5 and the hardware prefetchers
//!   follow on Zen 4, `super::stream_prefetch`); one transposing reduction turns the 16
//!   partial-sum lanes of four consecutive super-blocks of a row into their four exact sums,
//!   parked in L1 (48 bytes per row and four super-blocks) until four rows are done; then the
//!   f32 steps of those four rows run in the lanes of one register, each row's in the
//!   reference's order.
//! - A row's super-blocks go in groups of a constant size (`group`: four, and the row's last
//!   one to three), so the group's loop unrolls and its sums stay in registers. Until session
//!   37 the group was a loop over a slice: its sums went through the stack, and the four words
//!   of `d` and `dmin`, stored one by one and read back as one vector, missed store forwarding
//!   once per group; unrolled, 512 × 2048 in L2 took 21.0 µs instead of 25.2, and 151936 ×
//!   2048 from DRAM 8.4–8.8 ms instead of 9.6–10.0 (AMD Zen 4, one thread, the weights in a
//!   mapped file). Weights are loaded 64 bytes at a time: the two 256-bit halves this kernel
//!   once loaded (faster from DRAM on Zen 4 then) had been merged into one 512-bit load by the
//!   compiler anyway.
//!
//! Measured on that machine when it was written, before session 37's change (one thread;
//! `gemm_bench`; in parentheses the one-row-at-a-time `avx512q::sb256_row` path it replaces):
//! 768 × 2048, in L2, 32 µs (46.5); 16384 × 4096, from DRAM, 1.73–1.84 ms (1.96–2.05). Rows
//! longer than 16 super-blocks keep `avx512q`'s four-row path with software prefetch, which
//! streamed long rows faster then (not measured again since both changed).
//!
//! Integer sums are exact, so grouping them differently changes nothing; every f32 step is
//! `scalar::vec_dot_qk45`'s Sb256 step for that row, so the output equals the scalar reference
//! bit for bit (kernel tests).

use super::avx512q::{reduce4, sb256_row};
use super::{k4_scales_mins, k_block_bytes, with_scratch, Pod};
use super::{Q4_K, Q5_K};
use crate::matmul::Gemm;
use crate::quant::{Q8_K_BYTES, QK_K};
use core::arch::x86_64::*;

/// One super-block of the token in the weights' nibble order.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Prep {
    /// `[a0..32, a64..96]`, `[a32..64, a96..128]`, then the same from value 128.
    a: [__m512i; 4],
    /// The 8 sub-blocks' activation sums (i16; each the sum of two q8_K `bsums`).
    bp: __m128i,
    da: f32,
}
// SAFETY: integers and floats only; any bytes are valid.
unsafe impl Pod for Prep {}

/// Four rows' exact sums at four consecutive super-blocks, parked until the four rows are
/// done: 48 bytes per row and four super-blocks. (Parking each (row, super-block)'s 16 lanes
/// instead, 84 bytes per super-block, ran q4_K 8192 × 14336 from DRAM in 9.3–12 ms against
/// 4.3–5.0 for the four-row path: the parked state outgrew L1.)
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Parked {
    /// Per row: the scaled-product sums of the four super-blocks (i32).
    s: [__m128i; 4],
    /// Per row: the mins × activation sums of the four super-blocks (i32).
    m: [__m128i; 4],
    /// Per row: the four super-blocks' f16 `d` and `dmin`, as stored.
    dd: [__m128i; 4],
}
// SAFETY: integers only.
unsafe impl Pod for Parked {}

/// The `vpshufb` controls that spread sub-block `k`'s scale (byte `k` of the 8 scale bytes, which
/// fill every 64-bit lane; taken as an i16 word, zero-extended) over the lanes its products
/// land in:
/// vector 0 (low nibbles of chunk 0 | chunk 1) sub-blocks 0 | 2, vector 1 (high nibbles) 1 | 3,
/// vectors 2 and 3 the same from sub-block 4.
const SCALE_CTRL: [[u8; 64]; 4] = {
    let mut c = [[0u8; 64]; 4];
    let mut t = 0;
    while t < 4 {
        let first = [0, 1, 4, 5][t];
        let mut i = 0;
        while i < 64 {
            let sub = if i < 32 { first } else { first + 2 };
            // Even bytes take the scale byte, odd bytes zero (0x80): a zero-extended i16.
            c[t][i] = if i % 2 == 0 { sub } else { 0x80 };
            i += 1;
        }
        t += 1;
    }
    c
};

/// q5_K: which bit of `qh` (broadcast to both halves) is the fifth bit of each byte of vector
/// `t`: low nibbles of chunk `c` take bit `2c`, high nibbles bit `2c + 1`.
const QH_BITS: [[u8; 64]; 4] = {
    let mut b = [[0u8; 64]; 4];
    let mut t = 0;
    while t < 4 {
        let mut i = 0;
        while i < 64 {
            let c = [0, 0, 2, 2][t] + if i >= 32 { 1 } else { 0 };
            b[t][i] = 1 << (2 * c + t % 2);
            i += 1;
        }
        t += 1;
    }
    b
};

/// q4_K / q5_K GEMV in Sb256 order, four rows at a time with deferred reductions; rows past the
/// last whole four go through `avx512q`'s one-row path.
///
/// # Safety
/// The CPU has the module's features (AVX-512 F/BW/VL/DQ/VNNI); `g` comes from `Gemm::new`
/// with `g.ntok == 1`, `out.len() == g.nrows`, `g.wty` of kind `KIND` (q4_K or q5_K).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn gemv<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) {
    debug_assert!(KIND == Q4_K || KIND == Q5_K);
    let nsb = g.cols / QK_K;
    let whole = g.nrows - g.nrows % 4;
    if whole > 0 {
        with_scratch(0, nsb, |prep: &mut [Prep]| {
            with_scratch(1, nsb.div_ceil(4), |park: &mut [Parked]| {
                // SAFETY: as this function's contract; the buffers hold every super-block and
                // every group of four.
                unsafe {
                    prepare(g, prep);
                    for r in (0..whole).step_by(4) {
                        for i in 0..4 {
                            let w = g.w.as_ptr().add((r + i) * g.w_stride);
                            row::<KIND>(w, prep, park, i);
                        }
                        finish(prep, park, &mut out[r..r + 4]);
                    }
                }
            })
        });
    }
    for (r, o) in out.iter_mut().enumerate().skip(whole) {
        // SAFETY: row `r` is below `g.nrows`.
        *o = unsafe { sb256_row::<KIND>(g, r) };
    }
}

/// The token's super-blocks in the weights' nibble order.
///
/// # Safety
/// Features as the module; `g.a` holds `prep.len()` q8_K super-blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn prepare(g: &Gemm<'_>, prep: &mut [Prep]) {
    for (sb, p) in prep.iter_mut().enumerate() {
        // SAFETY (block): within super-block `sb` of the q8_K row (f32 d, 256 codes, 16 bsums).
        unsafe {
            let y = g.a.as_ptr().add(sb * Q8_K_BYTES);
            let q = y.add(4);
            let half = |o: usize| _mm256_loadu_si256(q.add(o).cast());
            for (t, a) in p.a.iter_mut().enumerate() {
                // Vector t starts at value 128·(t/2) + 32·(t%2); its high half 64 values on.
                let o = 128 * (t / 2) + 32 * (t % 2);
                *a = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(half(o)), half(o + 64));
            }
            let bsums = _mm256_loadu_si256(y.add(4 + QK_K).cast());
            let pairs = _mm256_madd_epi16(bsums, _mm256_set1_epi16(1));
            // |bsum| <= 16·128, so a pair fits i16: pack without saturating.
            p.bp = _mm256_cvtepi32_epi16(pairs);
            p.da = y.cast::<f32>().read_unaligned();
        }
    }
}

/// Row `w`'s super-blocks against the prepared token, parked as row `i` of its group of four:
/// four super-blocks' vectors at a time reduced to their four sums by one transposing
/// reduction.
///
/// # Safety
/// Features as the module; `w` readable for `prep.len()` `KIND` super-blocks; `park` holds
/// `prep.len().div_ceil(4)` entries; `i < 4`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn row<const KIND: u8>(w: *const u8, prep: &[Prep], park: &mut [Parked], i: usize) {
    let k = Consts::new();
    let wbs = k_block_bytes(KIND);
    for (gi, (g4, pk)) in prep.chunks(4).zip(park.iter_mut()).enumerate() {
        let p = w.wrapping_add(4 * gi * wbs);
        // A group of a constant size (four, or the row's last one to three), so its loop
        // unrolls and the sums stay in registers: indexed by a run-time `j`, they went through
        // the stack, and the four words of `d` and `dmin`, stored one by one and read back as
        // one vector, missed store forwarding once per group (about a fifth of this GEMV's
        // time on an AMD Zen 4).
        // SAFETY (every call): `g4` holds `N` super-blocks of the token, so the row has `N`
        // super-blocks from `p` (the caller's contract).
        unsafe {
            if let Ok(g) = g4.try_into() {
                group::<KIND, 4>(p, g, pk, i, &k);
            } else if let Ok(g) = g4.try_into() {
                group::<KIND, 3>(p, g, pk, i, &k);
            } else if let Ok(g) = g4.try_into() {
                group::<KIND, 2>(p, g, pk, i, &k);
            } else if let Ok(g) = g4.try_into() {
                group::<KIND, 1>(p, g, pk, i, &k);
            }
        }
    }
}

/// The loop-invariant vectors of [`row`].
struct Consts {
    low4: __m512i,
    ctrl: [__m512i; 4],
    bits: [__m512i; 4],
    five: __m512i,
    pf: usize,
}

impl Consts {
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    #[inline]
    fn new() -> Consts {
        Consts {
            low4: _mm512_set1_epi8(0x0F),
            ctrl: [0, 1, 2, 3].map(|t| {
                // SAFETY: 64 readable bytes.
                unsafe { _mm512_loadu_si512(SCALE_CTRL[t].as_ptr().cast()) }
            }),
            bits: [0, 1, 2, 3].map(|t| {
                // SAFETY: 64 readable bytes.
                unsafe { _mm512_loadu_si512(QH_BITS[t].as_ptr().cast()) }
            }),
            five: _mm512_set1_epi8(16),
            pf: super::stream_prefetch(),
        }
    }
}

/// `N` (1..=4) consecutive super-blocks of a row from `p` against the token's `g4`, parked as
/// row `i` of `pk`.
///
/// # Safety
/// Features as the module; `p` readable for `N` `KIND` super-blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn group<const KIND: u8, const N: usize>(
    p: *const u8,
    g4: &[Prep; N],
    pk: &mut Parked,
    i: usize,
    k: &Consts,
) {
    let wbs = k_block_bytes(KIND);
    let mut v = [_mm512_setzero_si512(); 4];
    let mut m = [_mm_setzero_si128(); 4];
    let mut dd = [0i32; 4];
    for j in 0..N {
        let a = &g4[j];
        // SAFETY (block): within the row's super-block (layouts in scalar.rs: d, dmin, 12
        // scale bytes, q5_K's 32 bytes of fifth bits, 128 bytes of nibbles).
        unsafe {
            let p = p.add(j * wbs);
            if k.pf > 0 {
                // The rows are one stream (`super::stream_prefetch`).
                for l in (0..wbs).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(k.pf + l).cast());
                }
            }
            let qs = if KIND == Q5_K { p.add(48) } else { p.add(16) };
            let q0 = _mm512_loadu_si512(qs.cast());
            let q1 = _mm512_loadu_si512(qs.add(64).cast());
            let mut u = [
                _mm512_and_si512(q0, k.low4),
                _mm512_and_si512(_mm512_srli_epi16::<4>(q0), k.low4),
                _mm512_and_si512(q1, k.low4),
                _mm512_and_si512(_mm512_srli_epi16::<4>(q1), k.low4),
            ];
            if KIND == Q5_K {
                let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(p.add(16).cast()));
                for (ut, bits) in u.iter_mut().zip(k.bits) {
                    let hk = _mm512_test_epi8_mask(qh, bits);
                    *ut = _mm512_mask_add_epi8(*ut, hk, *ut, k.five);
                }
            }
            let (scales, mins) = k4_scales_mins(&*p.add(4).cast::<[u8; 12]>());
            let sc = _mm512_set1_epi64(scales as i64);
            for ((ut, at), ctrl) in u.iter().zip(&a.a).zip(k.ctrl) {
                let prod = _mm512_maddubs_epi16(*ut, *at);
                v[j] = _mm512_dpwssd_epi32(v[j], prod, _mm512_shuffle_epi8(sc, ctrl));
            }
            let m8 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(mins as i64));
            m[j] = _mm_madd_epi16(m8, a.bp);
            dd[j] = p.cast::<i32>().read_unaligned();
        }
    }
    pk.s[i] = reduce4(v);
    pk.m[i] = _mm_hadd_epi32(_mm_hadd_epi32(m[0], m[1]), _mm_hadd_epi32(m[2], m[3]));
    pk.dd[i] = _mm_setr_epi32(dd[0], dd[1], dd[2], dd[3]);
}

/// `[a0 b0 c0 d0]`, `[a1 b1 c1 d1]`, ... from rows `a, b, c, d`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
fn transpose4(r: [__m128i; 4]) -> [__m128i; 4] {
    let t0 = _mm_unpacklo_epi32(r[0], r[1]);
    let t1 = _mm_unpacklo_epi32(r[2], r[3]);
    let t2 = _mm_unpackhi_epi32(r[0], r[1]);
    let t3 = _mm_unpackhi_epi32(r[2], r[3]);
    [
        _mm_unpacklo_epi64(t0, t1),
        _mm_unpackhi_epi64(t0, t1),
        _mm_unpacklo_epi64(t2, t3),
        _mm_unpackhi_epi64(t2, t3),
    ]
}

/// The four parked rows' f32 chains, each row's super-blocks in order, into `out[0..4]`.
///
/// # Safety
/// Features as the module; `park` filled for all four rows; `out.len() == 4`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn finish(prep: &[Prep], park: &[Parked], out: &mut [f32]) {
    let mut acc = _mm_setzero_ps();
    let mut acc_min = _mm_setzero_ps();
    // (d0, dmin0, d1, dmin1, ...) -> (d0..d3 | dmin0..dmin3).
    let split = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    for (g4, pk) in prep.chunks(4).zip(park) {
        let s = transpose4(pk.s);
        let m = transpose4(pk.m);
        let dd = transpose4(pk.dd);
        for (j, a) in g4.iter().enumerate() {
            let ds = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(dd[j]), split);
            let da = _mm_set1_ps(a.da);
            let sv = _mm_mul_ps(_mm256_castps256_ps128(ds), da);
            let mv = _mm_mul_ps(_mm256_extractf128_ps::<1>(ds), da);
            acc = _mm_fmadd_ps(_mm_cvtepi32_ps(s[j]), sv, acc);
            acc_min = _mm_fmadd_ps(_mm_cvtepi32_ps(m[j]), mv, acc_min);
        }
    }
    // SAFETY: `out` holds four values.
    unsafe { _mm_storeu_ps(out.as_mut_ptr(), _mm_sub_ps(acc, acc_min)) };
}
