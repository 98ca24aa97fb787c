//! The float side shared by the tiles of the types whose `vec_dot` keeps eight f32 lanes per
//! super-block and whose tiled matmul takes one f32 step (`scalar::lanes8_then_tiled`: q3_K,
//! IQ4_XS and the IQ grid types): each (row, token) of a tile keeps the chain of the order its
//! token takes, [`KOrder::Lanes8`] (eight lanes, `post · hsum8` at the end; the IQ1 types'
//! delta in a chain of its own, `scalar::Delta`) or [`KOrder::Tiled`] (one scalar, `dw · post`
//! per step), exactly as `scalar::vec_dot_lanes8` does.

use super::avx2::{hsum as hsum8, hsum_i32};
use crate::matmul::Gemm;
use crate::quant::Q8_K_BYTES;
use crate::scalar::{token_order, Delta, KOrder};
use core::arch::x86_64::*;

/// The chains of an `R`-row × `T`-token tile.
pub(super) struct Chains<const R: usize, const T: usize> {
    order: [KOrder; T],
    post: f32,
    delta: Delta,
    acc: [[__m256; T]; R],
    /// IQ1_M's delta lanes.
    acc2: [[__m256; T]; R],
    /// The tiled order's chain, or IQ1_S's delta chain.
    acc_s: [[f32; T]; R],
}

impl<const R: usize, const T: usize> Chains<R, T> {
    /// Empty chains for tokens `t0..t0+T` of `g`; `post` is the type's factor after the lanes
    /// (and inside the tiled step's scale): 1, or 0.125 / 0.25 for the IQ2 types / IQ3_XXS;
    /// the IQ1 types (0.125) with their `delta`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) fn new(g: &Gemm<'_>, t0: usize, post: f32, delta: Delta) -> Self {
        Chains {
            order: core::array::from_fn(|t| token_order(g, t0 + t)),
            post,
            delta,
            acc: [[_mm256_setzero_ps(); T]; R],
            acc2: [[_mm256_setzero_ps(); T]; R],
            acc_s: [[0f32; T]; R],
        }
    }

    /// The q8_K scales of tokens `t0..t0+T` at super-block `b`.
    ///
    /// # Safety
    /// Super-block `b` and the tokens lie in `g`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) unsafe fn dy(g: &Gemm<'_>, t0: usize, b: usize) -> [f32; T] {
        core::array::from_fn(|t| {
            // SAFETY: as the contract: the f32 at the start of the token's super-block.
            unsafe {
                g.a.as_ptr()
                    .add((t0 + t) * g.a_stride + b * Q8_K_BYTES)
                    .cast::<f32>()
                    .read_unaligned()
            }
        })
    }

    /// One super-block of (row `r`, token `t`): its eight exact lanes, the row's f16 scale `dw`
    /// and the token's `dy`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) fn step(&mut self, r: usize, t: usize, lanes: __m256i, dw: f32, dy: f32) {
        if self.order[t] == KOrder::Tiled {
            self.tiled_step(r, t, hsum_i32(lanes), dw, dy);
        } else {
            self.acc[r][t] = _mm256_fmadd_ps(
                _mm256_set1_ps(dw * dy),
                _mm256_cvtepi32_ps(lanes),
                self.acc[r][t],
            );
        }
    }

    /// The tiled order's step for (row `r`, token `t`): the super-block's exact sum `isum`,
    /// scaled by `dw · post`, then `fma(·, dy, acc)`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn tiled_step(&mut self, r: usize, t: usize, isum: i32, dw: f32, dy: f32) {
        self.acc_s[r][t] = (isum as f32 * (dw * self.post)).mul_add(dy, self.acc_s[r][t]);
    }

    /// One super-block of (row `r`, token `t`) of IQ1_M: the exact lanes of the grid values and
    /// of the deltas (each times its sub-block's scale). IQ1_S: [`Self::step_delta_sum`].
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) fn step_delta(
        &mut self,
        r: usize,
        t: usize,
        grid: __m256i,
        delta: __m256i,
        dw: f32,
        dy: f32,
    ) {
        if self.order[t] == KOrder::Tiled {
            // The codes are `8 · grid + delta`.
            let full = _mm256_add_epi32(_mm256_slli_epi32::<3>(grid), delta);
            self.step(r, t, full, dw, dy);
            return;
        }
        let d = dw * dy;
        self.acc[r][t] =
            _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(grid), self.acc[r][t]);
        debug_assert!(self.delta == Delta::Lanes);
        self.acc2[r][t] = _mm256_fmadd_ps(
            _mm256_set1_ps(d),
            _mm256_cvtepi32_ps(delta),
            self.acc2[r][t],
        );
    }

    /// One super-block of (row `r`, token `t`) of IQ1_S: the grid lanes and its delta as one
    /// integer (`dsum`, from the activations' block sums; its chain is a scalar).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) fn step_delta_sum(
        &mut self,
        r: usize,
        t: usize,
        grid: __m256i,
        dsum: i32,
        dw: f32,
        dy: f32,
    ) {
        let d = dw * dy;
        if self.order[t] == KOrder::Tiled {
            // The codes are `8 · grid + delta`: their total, as `step` sums it.
            let isum = hsum_i32(_mm256_slli_epi32::<3>(grid)).wrapping_add(dsum);
            self.tiled_step(r, t, isum, dw, dy);
            return;
        }
        self.acc[r][t] =
            _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(grid), self.acc[r][t]);
        self.acc_s[r][t] = d.mul_add(dsum as f32, self.acc_s[r][t]);
    }

    /// Writes the tile's results to `out` (token-major).
    ///
    /// # Safety
    /// Rows `r0..r0+R` and tokens `t0..t0+T` lie in `g`; `out.len() == g.ntok * g.nrows`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) unsafe fn finish(&self, g: &Gemm<'_>, r0: usize, t0: usize, out: &mut [f32]) {
        for r in 0..R {
            for t in 0..T {
                let v = match (self.order[t], self.delta) {
                    (KOrder::Tiled, _) => self.acc_s[r][t],
                    (_, Delta::No) => self.post * hsum8(self.acc[r][t]),
                    (_, Delta::Scalar) => hsum8(self.acc[r][t]) + self.post * self.acc_s[r][t],
                    (_, Delta::Lanes) => hsum8(self.acc[r][t]) + self.post * hsum8(self.acc2[r][t]),
                };
                // SAFETY: as the contract.
                unsafe { *out.get_unchecked_mut((t0 + t) * g.nrows + r0 + r) = v };
            }
        }
    }
}

/// The f16 at `p` as f32.
///
/// # Safety
/// F16C available; 2 bytes readable at `p`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: as the contract.
    let bits = unsafe { p.cast::<u16>().read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// A super-block's eight exact lanes for one token on AVX-512, two 32-value sub-blocks a
/// register: per pair `p` the token's 64 q8_K values at `q8 + 64p`, negated where `neg[p]`
/// has a bit, `vpmaddubsw` against the unsigned magnitudes `mag[p]` (ggml's
/// `maddubs(|w|, sign(a, w))`: negating wraps −128 as `vpsignb` does) and `vpdpwssd` by the
/// i16 scales `sc[p]`; the register's halves added (exact: i32 sums).
///
/// # Safety
/// AVX-512 F/BW/VNNI available; 256 bytes readable at `q8`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn signed_pairs(
    q8: *const u8,
    mag: &[__m512i; 4],
    neg: &[__mmask64; 4],
    sc: &[__m512i; 4],
) -> __m256i {
    let mut lanes = _mm512_setzero_si512();
    for p in 0..4 {
        // SAFETY: as the contract.
        let a = unsafe { _mm512_loadu_si512(q8.add(64 * p).cast()) };
        let sa = _mm512_mask_sub_epi8(a, neg[p], _mm512_setzero_si512(), a);
        lanes = _mm512_dpwssd_epi32(lanes, _mm512_maddubs_epi16(mag[p], sa), sc[p]);
    }
    _mm256_add_epi32(
        _mm512_castsi512_si256(lanes),
        _mm512_extracti64x4_epi64::<1>(lanes),
    )
}
