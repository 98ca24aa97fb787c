//! q3_K against q8_K (one tile, compiled for AVX2 and for AVX-512), bit-identical to
//! `scalar::vec_dot_lanes8` in either order a token takes (`scalar::token_order`): the eight
//! i32 lanes of a super-block are llama.cpp's `ggml_vec_dot_q3_K_q8_K` lanes (values `4l..4l+4` of
//! each 32-value chunk times the chunk's sub-block scales; the i16 pairs `v·a` computed as
//! `vpmaddubsw(u, a) − vpmaddubsw(4, a)` with the unsigned codes `u = v + 4`); `Lanes8` takes one
//! FMA per lane per super-block and [`hsum8`] at the end, `Tiled` sums the lanes exactly and
//! takes one f32 step per super-block. From 16 tokens in the tiled order, the k-quant GEMM
//! with tokens in the register lanes (`kq_lanes` on AVX-512, `kq_lanes2` on AVX2) takes q3_K like q6_K (unsigned
//! codes `v + 4`, the offset removed through the activations' block sums).

// Tile loops index several per-row / per-token arrays with the same counter.
#![allow(clippy::needless_range_loop)]

use super::drive;
use super::lanes8::{f16_at, Chains};
use crate::matmul::Gemm;
use crate::quant::{Q8_K_BYTES, QK_K};
use crate::scalar::{q3k_scale_words, Delta};
use core::arch::x86_64::*;

/// Bytes of a q3_K super-block.
const WB: usize = 110;

/// `vpshufb` controls: in both 128-bit halves, i16 `2k` of the half in the low half's lanes
/// and `2k + 1` in the high half's (ggml's `get_scale_shuffle_q3k`).
const SHUF: [[u8; 32]; 4] = {
    let mut t = [[0u8; 32]; 4];
    let mut k = 0;
    while k < 4 {
        let mut i = 0;
        while i < 16 {
            t[k][i] = (4 * k + i % 2) as u8;
            t[k][16 + i] = (4 * k + 2 + i % 2) as u8;
            i += 1;
        }
        k += 1;
    }
    t
};

/// # Safety
/// The CPU has AVX2, FMA and F16C; `g` comes from `Gemm::new` with `out.len() == g.ntok *
/// g.nrows` and q3_K weights.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn run_q3k(g: &Gemm<'_>, out: &mut [f32]) {
    // SAFETY: as this function's contract.
    if unsafe { super::kq_lanes2::tiled_batch::<{ super::Q3_K }>(g, out) } {
        return;
    }
    if g.ntok == 1 {
        drive!(g, out, tile, 4, 1);
    } else {
        drive!(g, out, tile, 2, 4);
    }
}

/// The AVX-512 table's entry: [`run_q3k`], but from 16 tokens in the tiled order (every
/// token's, then: Parity from 8 tokens, Invariant always) the tokens-in-lanes GEMM.
///
/// # Safety
/// As [`run_q3k`], and the CPU has AVX-512 F/BW/VL/DQ and VNNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn run_q3k_avx512(g: &Gemm<'_>, out: &mut [f32]) {
    // SAFETY: as this function's contract.
    if unsafe { super::kq_lanes::tiled_batch::<{ super::Q3_K }>(g, out) } {
        return;
    }
    if super::is_amd_zen5_or_later() {
        // Zen 5's 512-bit datapaths (session 40, EPYC family 26 model 2, 4096 × 14336, two
        // sets of alternated runs against the 256-bit tile): the GEMV one row at a time
        // 1.48-1.62x at one thread and 1.39-1.52x at two (four rows side by side 0.92x of
        // one), 4 and 8 tokens in tiles of one row by four tokens 1.33-1.40x. Zen 5 parts with
        // 256-bit AVX-512 datapaths take it too, unmeasured.
        if g.ntok == 1 {
            drive!(g, out, tile_zmm, 1, 1);
        } else {
            drive!(g, out, tile_zmm, 1, 4);
        }
    } else if g.ntok == 1 {
        drive!(g, out, tile512, 4, 1);
    } else {
        drive!(g, out, tile512, 2, 4);
    }
}

/// Rows `r0..r0+R` × tokens `t0..t0+T` with two 32-value chunks a 64-byte register, for CPUs
/// whose AVX-512 datapaths are 512 bits wide (taken on AMD Zen 5): the pair `p` of chunks `2p`, `2p +
/// 1` (four 16-value sub-blocks, one scale per 128-bit lane) takes its low bits from one
/// broadcast 32-byte half of `qs` by a variable shift and a mask, its high bits by one
/// `vptestmb` of the broadcast `hmask` and a masked add of 4, then per token `vpmaddubsw`
/// against the activations, minus the offset's share (`4·(a[2i] + a[2i+1])`, once per token,
/// shared by the rows), and one `vpdpwssd` by the scales. The register's two halves are the
/// two chunks' eight lanes, which added give [`tile`]'s eight i32 lanes exactly (integer sums
/// of the same products), so the f32 steps are the same [`Chains`].
///
/// # Safety
/// As [`run_q3k_avx512`]; `r0 + R <= g.nrows`, `t0 + T <= g.ntok`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn tile_zmm<const R: usize, const T: usize>(
    g: &Gemm<'_>,
    r0: usize,
    t0: usize,
    out: &mut [f32],
) {
    let nb = g.cols / QK_K;
    let mut ch = Chains::<R, T>::new(g, t0, 1.0, Delta::No);
    // Pair p's shifts of the 16-bit words of its `qs` half: 2·(2p % 4) for chunk 2p (the low
    // 256 bits), 2·((2p + 1) % 4) for chunk 2p + 1; its hmask bits 2p and 2p + 1.
    let shift = |p: usize| {
        _mm512_inserti64x4::<1>(
            _mm512_set1_epi16((4 * (p % 2)) as i16),
            _mm256_set1_epi16((4 * (p % 2) + 2) as i16),
        )
    };
    let bit = |p: usize| {
        _mm512_inserti64x4::<1>(
            _mm512_set1_epi8((1u8 << (2 * p)) as i8),
            _mm256_set1_epi8((1u8 << (2 * p + 1)) as i8),
        )
    };
    let shifts: [__m512i; 4] = core::array::from_fn(shift);
    let bits: [__m512i; 4] = core::array::from_fn(bit);
    // Pair p's i16 scale lanes: 128-bit lane k takes scale 4p + k.
    let pick: [__m512i; 4] = core::array::from_fn(|p| {
        let mut ix = [0u16; 32];
        for (i, x) in ix.iter_mut().enumerate() {
            *x = (4 * p + i / 8) as u16;
        }
        // SAFETY: 64 bytes.
        unsafe { _mm512_loadu_si512(ix.as_ptr().cast()) }
    });
    let three = _mm512_set1_epi8(3);
    let four = _mm512_set1_epi8(4);
    // SAFETY (whole body): super-blocks below `nb` of rows r0..r0+R and tokens t0..t0+T.
    unsafe {
        for b in 0..nb {
            let ad = Chains::<R, T>::dy(g, t0, b);
            // Per token the four 64-byte pairs of chunks and the offset's share of their pairs.
            let mut a = [[_mm512_setzero_si512(); 4]; T];
            let mut corr = [[_mm512_setzero_si512(); 4]; T];
            for t in 0..T {
                let q8 = g.a.as_ptr().add((t0 + t) * g.a_stride + b * Q8_K_BYTES + 4);
                for p in 0..4 {
                    a[t][p] = _mm512_loadu_si512(q8.add(64 * p).cast());
                    corr[t][p] = _mm512_maddubs_epi16(four, a[t][p]);
                }
            }
            for r in 0..R {
                let wp = g.w.as_ptr().add((r0 + r) * g.w_stride + b * WB);
                let hm = _mm512_broadcast_i64x4(_mm256_loadu_si256(wp.cast()));
                let q = [
                    _mm512_broadcast_i64x4(_mm256_loadu_si256(wp.add(32).cast())),
                    _mm512_broadcast_i64x4(_mm256_loadu_si256(wp.add(64).cast())),
                ];
                let sc16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(scales(wp)));
                let dw = f16_at(wp.add(108));
                let u: [__m512i; 4] = core::array::from_fn(|p| {
                    let low = _mm512_and_si512(_mm512_srlv_epi16(q[p / 2], shifts[p]), three);
                    let high = _mm512_test_epi8_mask(hm, bits[p]);
                    _mm512_mask_add_epi8(low, high, low, four)
                });
                let sc: [__m512i; 4] =
                    core::array::from_fn(|p| _mm512_permutexvar_epi16(pick[p], sc16));
                for t in 0..T {
                    let mut acc = _mm512_setzero_si512();
                    for p in 0..4 {
                        let pr = _mm512_sub_epi16(_mm512_maddubs_epi16(u[p], a[t][p]), corr[t][p]);
                        acc = _mm512_dpwssd_epi32(acc, pr, sc[p]);
                    }
                    let lanes = _mm256_add_epi32(
                        _mm512_castsi512_si256(acc),
                        _mm512_extracti64x4_epi64::<1>(acc),
                    );
                    ch.step(r, t, lanes, dw, ad[t]);
                }
            }
        }
        ch.finish(g, r0, t0, out);
    }
}

/// One super-block's unsigned codes `v + 4` (0..7) as eight 32-value chunks in value order,
/// and its 16 scales (-32..31): see [`codes`] and [`scales`].
///
/// # Safety
/// AVX2 available; `p` readable for one super-block.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn unpack(p: *const u8) -> ([__m256i; 8], [i8; 16]) {
    let mut sc = [0i8; 16];
    // SAFETY: as the contract; `sc` holds 16 bytes.
    unsafe {
        _mm_storeu_si128(sc.as_mut_ptr().cast(), scales(p));
        (codes(p), sc)
    }
}

/// The 16 scales of the super-block at `p` as i8 lanes (-32..31), built in registers from
/// `dequantize_row_q3_K`'s four aux words (no byte stores to reload).
///
/// # Safety
/// AVX2 available; `p` readable for one super-block.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn scales(p: *const u8) -> __m128i {
    // SAFETY: the 12 scale bytes at 96.
    let aux = q3k_scale_words(unsafe { &*p.add(96).cast::<[u8; 12]>() });
    let aux = _mm_setr_epi32(aux[0] as i32, aux[1] as i32, aux[2] as i32, aux[3] as i32);
    _mm_sub_epi8(aux, _mm_set1_epi8(32))
}

/// Chunk `c` of the codes is 2-bit field `c % 4` of the 32 bytes at `32 + 32·(c / 4)`, plus 4
/// where bit `c` of the 32 hmask bytes is set.
///
/// # Safety
/// AVX2 available; `p` readable for one super-block.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn codes(p: *const u8) -> [__m256i; 8] {
    // SAFETY (whole body): reads within the super-block.
    unsafe {
        let hm = _mm256_loadu_si256(p.cast());
        let q = [
            _mm256_loadu_si256(p.add(32).cast()),
            _mm256_loadu_si256(p.add(64).cast()),
        ];
        let three = _mm256_set1_epi8(3);
        let mut u = [_mm256_setzero_si256(); 8];
        for c in 0..8 {
            let sh = _mm_cvtsi32_si128(2 * (c as i32 % 4));
            let low = _mm256_and_si256(_mm256_srl_epi16(q[c / 4], sh), three);
            // Bit c of each byte moved to bit 2 (= +4): the only bit left in a byte cannot
            // cross into its neighbour, whichever way the 16-bit shift goes.
            let hb = _mm256_and_si256(hm, _mm256_set1_epi8(1 << c));
            let h4 = if c <= 2 {
                _mm256_sll_epi16(hb, _mm_cvtsi32_si128(2 - c as i32))
            } else {
                _mm256_srl_epi16(hb, _mm_cvtsi32_si128(c as i32 - 2))
            };
            u[c] = _mm256_or_si256(low, h4);
        }
        u
    }
}

/// Rows `r0..r0+R` × tokens `t0..t0+T`: `tile` with AVX2's features, `tile512` the same code
/// compiled for AVX-512 (32 registers, EVEX encodings), which the AVX-512 table runs.
macro_rules! tile_fn {
    ($name:ident, $features:literal) => {
        /// # Safety
        /// As [`run_q3k`] (and the features named); `r0 + R <= g.nrows`, `t0 + T <= g.ntok`.
        #[target_feature(enable = $features)]
        unsafe fn $name<const R: usize, const T: usize>(
            g: &Gemm<'_>,
            r0: usize,
            t0: usize,
            out: &mut [f32],
        ) {
            let nb = g.cols / QK_K;
            let mut ch = Chains::<R, T>::new(g, t0, 1.0, Delta::No);
            // SAFETY (whole body): super-blocks below `nb` of rows r0..r0+R and tokens t0..t0+T.
            unsafe {
                for b in 0..nb {
                    let ad = Chains::<R, T>::dy(g, t0, b);
                    // Per token and chunk: 4 · (a[2i] + a[2i+1]), the offset's share of each i16
                    // pair (exact: |·| <= 1016), shared by the tile's rows.
                    let mut corr = [[_mm256_setzero_si256(); 8]; T];
                    for t in 0..T {
                        let q8 = g.a.as_ptr().add((t0 + t) * g.a_stride + b * Q8_K_BYTES + 4);
                        for c in 0..8 {
                            let a = _mm256_loadu_si256(q8.add(32 * c).cast());
                            corr[t][c] = _mm256_maddubs_epi16(_mm256_set1_epi8(4), a);
                        }
                    }
                    for r in 0..R {
                        let wp = g.w.as_ptr().add((r0 + r) * g.w_stride + b * WB);
                        let u = codes(wp);
                        // The 16 scales as i16, the low eight in both halves for chunks 0..4 and
                        // the high eight for 4..8; chunk c's lanes pick theirs by SHUF[c % 4].
                        let sc16 = _mm256_cvtepi8_epi16(scales(wp));
                        let halves = [
                            _mm256_permute2x128_si256::<0x00>(sc16, sc16),
                            _mm256_permute2x128_si256::<0x11>(sc16, sc16),
                        ];
                        let dw = f16_at(wp.add(108));
                        let s: [__m256i; 8] = core::array::from_fn(|c| {
                            _mm256_shuffle_epi8(
                                halves[c / 4],
                                _mm256_loadu_si256(SHUF[c % 4].as_ptr().cast()),
                            )
                        });
                        for t in 0..T {
                            let q8 = g.a.as_ptr().add((t0 + t) * g.a_stride + b * Q8_K_BYTES + 4);
                            let mut lanes = _mm256_setzero_si256();
                            for c in 0..8 {
                                let a = _mm256_loadu_si256(q8.add(32 * c).cast());
                                // i16 pairs of (u - 4)·a: ggml's (low - 4·!high)·a pairs.
                                let p = _mm256_sub_epi16(_mm256_maddubs_epi16(u[c], a), corr[t][c]);
                                lanes = _mm256_add_epi32(lanes, _mm256_madd_epi16(s[c], p));
                            }
                            ch.step(r, t, lanes, dw, ad[t]);
                        }
                    }
                }
                ch.finish(g, r0, t0, out);
            }
        }
    };
}

tile_fn!(tile, "avx2,fma,f16c");
tile_fn!(
    tile512,
    "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c"
);

#[cfg(test)]
mod tests {
    use super::*;

    /// [`tile_zmm`] (the Zen 5 tile, called directly so that every AVX-512 CPU checks it)
    /// against [`tile512`] over the same rows and tokens, tiles of 1 × 1, 4 × 1, 1 × 4 and
    /// 2 × 4 rows × tokens with their one-row and short-token tails, 1 to 6 tokens, both
    /// numerics: every output bit equal.
    #[test]
    fn zmm_tile_equals_the_ymm_tile() {
        if super::super::avx512::Avx512::new().is_none() {
            eprintln!("no AVX-512 VNNI here: the zmm tile does not run on this CPU");
            return;
        }
        let ty = crate::GgmlType::Q3_K;
        let (rows, cols) = (7, 3 * QK_K);
        let len = ty.row_size((rows * cols) as u64).expect("whole blocks") as usize;
        let mut w = super::super::xorshift_bytes(0x9E37_79B9_7F4A_7C15, len);
        for b in w.chunks_exact_mut(WB) {
            b[108..].copy_from_slice(&half::f16::from_f32(0.01).to_bits().to_le_bytes());
        }
        let q = crate::QMatrix::new(ty, rows, cols, &w).expect("matrix");
        for n in 1..=6 {
            let xs = super::super::xorshift_f32(0x2545_F491_4F6C_DD1D ^ n as u64, n * cols);
            let mut act = crate::Activations::new();
            act.quantize_for(ty, &xs, n, cols).expect("activations");
            for numerics in [crate::Numerics::Parity, crate::Numerics::Invariant] {
                let g = Gemm::new(&q, &act, 0..rows, n * rows, numerics).expect("gemm");
                let (mut want, mut got) = (vec![0f32; n * rows], vec![0f32; n * rows]);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                // SAFETY (the drives): AVX-512 F/BW/VL/DQ and VNNI checked above; `g` is a
                // Gemm of q3_K weights with outputs of `n * rows`.
                macro_rules! same {
                    ($r:literal, $t:literal) => {
                        drive!(&g, &mut want, tile512, $r, $t);
                        drive!(&g, &mut got, tile_zmm, $r, $t);
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "{n} tokens {numerics:?}: {} x {}",
                            $r,
                            $t
                        );
                    };
                }
                same!(1, 1);
                same!(4, 1);
                same!(1, 4);
                same!(2, 4);
            }
        }
    }
}
