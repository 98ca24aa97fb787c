//! The IQ grid types against q8_K: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M (one
//! tile, compiled for AVX2 and for AVX-512), bit-identical to `scalar::vec_dot_lanes8` in
//! either order a token takes: llama.cpp's `ggml_vec_dot_iq*_q8_K` lanes (each sub-block's 32
//! grid values from the type's grid table, the signs applied to the activations by `vpsignb`,
//! `vpmaddubsw`, then `vpmaddwd` by the scales `2·ls + 1` of its 32 or two 16 values) in
//! `KOrder::Lanes8` with `post · hsum8` at the end (0.125, 0.25, 1), their exact sum in
//! `KOrder::Tiled` with `d · post`. The IQ1 types' grid values are −1, 0, 1 (their magnitude
//! against the activations signed by the value, ggml's `mul_add_epi8`) and a delta of ±1/8 per
//! 8 values, summed apart (`scalar::Delta`). On AVX-512, from 16 tokens, the tokens-in-lanes
//! k-quant GEMM (`kq_lanes`, values looked up as `value + 128`; the IQ1 types' as
//! `8 · grid + delta + 128`); where gathers are fast (`super::fast_gathers`), the GEMVs of all
//! but IQ2_S, and IQ1_S up to 15 tokens (on AMD Zen 4 IQ1_S), take tiles that gather whole
//! grid rows, two sub-blocks a register ([`tile512_iq1`], [`tile512_sign_gather`]), with the
//! same integer lanes; on AMD Zen 5 the same two tiles fetch IQ1_S's, IQ1_M's and IQ3_S's grid
//! rows by loads ([`rows4`], [`rows8`]) instead, and the GEMVs of those and of IQ2_XXS and
//! IQ3_XXS run one row at a time; elsewhere, on CPUs with AVX512-VBMI and GFNI, IQ2_XXS,
//! IQ2_XS and IQ3_XXS compute a super-block's sign masks in three vector instructions
//! ([`sign_masks`]) instead of looking each group's signs up, and IQ3_S its 64 grid indices in
//! four ([`iq3s_indices`]).

// Tile loops index several per-row / per-token arrays with the same counter.
#![allow(clippy::needless_range_loop)]

use super::drive;
use super::lanes8::{f16_at, signed_pairs, Chains};
use super::{IQ1_M, IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS};
use crate::iq_grids::{
    IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS,
};
use crate::matmul::Gemm;
use crate::quant::{Q8_K_BYTES, QK_K};
use crate::scalar::Delta;
use core::arch::x86_64::*;

/// (bytes per super-block, the factor ggml applies after the lanes / folds into `d`, how the
/// IQ1 types' delta is summed).
pub(super) const fn geometry(kind: u8) -> (usize, f32, Delta) {
    match kind {
        IQ2_XXS => (66, 0.125, Delta::No),
        IQ2_XS => (74, 0.125, Delta::No),
        IQ2_S => (82, 0.125, Delta::No),
        IQ3_XXS => (98, 0.25, Delta::No),
        IQ3_S => (110, 1.0, Delta::No),
        IQ1_S => (50, 0.125, Delta::Scalar),
        _ => (56, 0.125, Delta::Lanes),
    }
}

/// Whether `kind` is an IQ1 type (values `8 · grid + delta`).
pub(super) const fn is_iq1(kind: u8) -> bool {
    matches!(kind, IQ1_S | IQ1_M)
}

/// Whether `kind`'s sub-block scales cover 16 values (else 32).
pub(super) const fn scales16(kind: u8) -> bool {
    matches!(kind, IQ2_XS | IQ2_S | IQ1_M)
}

/// ggml's `keven_signs_q2xs`: byte `j` of entry `i` is -1 where bit `j` of
/// `ksigns_iq2xs[i]` is set, else 1 (what `vpsignb` applies to the activations).
static SIGNS64: [u64; 128] = {
    let mut t = [0u64; 128];
    let mut i = 0;
    while i < 128 {
        let mut j = 0;
        while j < 8 {
            let b: u64 = if KSIGNS_IQ2XS[i] & (1 << j) != 0 {
                0xFF
            } else {
                0x01
            };
            t[i] |= b << (8 * j);
            j += 1;
        }
        i += 1;
    }
    t
};

/// The 32 bits at `p` (bit `j` of byte `k` for value `8k + j`) as ±1 bytes, -1 where set
/// (IQ2_S's and IQ3_S's sign bytes).
///
/// # Safety
/// AVX2 available; 4 bytes readable at `p`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn sign_bits(p: *const u8) -> __m256i {
    // SAFETY: as the contract.
    let w = unsafe { p.cast::<u32>().read_unaligned() };
    let bytes = _mm256_shuffle_epi8(
        _mm256_set1_epi32(w as i32),
        _mm256_setr_epi64x(
            0,
            0x0101_0101_0101_0101,
            0x0202_0202_0202_0202,
            0x0303_0303_0303_0303,
        ),
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
    _mm256_or_si256(set, _mm256_set1_epi8(1))
}

/// The 16-value sub-block scales `2·ls + 1` of an IQ2_XS, IQ2_S or IQ1_M super-block at `p`,
/// once per super-block: i16 lane `j` of the low half is sub-block `j`'s scale of values 0..16,
/// of the high half its scale of values 16..32 ([`pick`] takes one sub-block's). Zero for the
/// other kinds.
///
/// # Safety
/// AVX2 available; `p` readable for one super-block.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn scales16_vec<const KIND: u8>(p: *const u8) -> __m256i {
    // SAFETY (whole body): the scale bytes lie in the super-block.
    unsafe {
        let ls = match KIND {
            IQ2_XS | IQ2_S => {
                // Eight bytes (at 66 / 74): the low nibbles, then the high ones.
                let o = if KIND == IQ2_XS { 66 } else { 74 };
                let v = _mm_cvtepu8_epi16(_mm_loadl_epi64(p.add(o).cast()));
                _mm256_set_m128i(
                    _mm_srli_epi16::<4>(v),
                    _mm_and_si128(v, _mm_set1_epi16(0xF)),
                )
            }
            IQ1_M => {
                // Four words at 48, 12 bits per pair of sub-blocks: sub-block j's two scales
                // at bits 6(j%2) (low half) and 6(j%2) + 3 (high half) of word j/2. Lane j
                // takes word j/2 (`vpshufb`), then a multiply by 2^(13 - shift) and a shift
                // right by 13 isolate the three bits.
                let x = p.add(48).cast::<i64>().read_unaligned();
                let w = _mm256_shuffle_epi8(
                    _mm256_set1_epi64x(x),
                    _mm256_setr_epi8(
                        0, 1, 0, 1, 2, 3, 2, 3, 4, 5, 4, 5, 6, 7, 6, 7, 0, 1, 0, 1, 2, 3, 2, 3, 4,
                        5, 4, 5, 6, 7, 6, 7,
                    ),
                );
                let m = _mm256_setr_epi16(
                    1 << 13,
                    1 << 7,
                    1 << 13,
                    1 << 7,
                    1 << 13,
                    1 << 7,
                    1 << 13,
                    1 << 7,
                    1 << 10,
                    1 << 4,
                    1 << 10,
                    1 << 4,
                    1 << 10,
                    1 << 4,
                    1 << 10,
                    1 << 4,
                );
                _mm256_srli_epi16::<13>(_mm256_mullo_epi16(w, m))
            }
            _ => return _mm256_setzero_si256(),
        };
        _mm256_add_epi16(_mm256_add_epi16(ls, ls), _mm256_set1_epi16(1))
    }
}

/// Four entries of a table of 8-byte grid rows as one register, entry `i[k]` in lane `k`: a
/// broadcast load per entry and a `vpblendd` joining it in. Written out in assembly because
/// LLVM turns the same intrinsics (or `_mm256_setr_epi64x`) into `vmovq` loads joined by
/// `vpunpcklqdq` / `vinserti128` shuffles, which only some vector pipes run (port 5 alone on
/// Intel); a broadcast from memory is a plain load and a blend runs on any vector ALU pipe.
/// On a Zen 5 (session 40) the IQ1 tile 1.15-1.25x faster with it than with LLVM's sequence,
/// and IQ3_S's GEMV ([`rows8`]) 1.29-1.32x than with its gathers; in the sub-block tiles of
/// the other grid types level or slower there, so only those two take it.
///
/// # Safety
/// AVX2 available; every `i[k] < N`.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn rows4<const N: usize>(t: &[u64; N], i: [usize; 4]) -> __m256i {
    debug_assert!(i.iter().all(|&k| k < N));
    let v: __m256i;
    // SAFETY: the four reads are entries of `t` (the contract); registers only otherwise.
    unsafe {
        core::arch::asm!(
            "vpbroadcastq {v}, qword ptr [{t} + {a}*8]",
            "vpbroadcastq {x}, qword ptr [{t} + {b}*8]",
            "vpblendd {v}, {v}, {x}, 0x0C",
            "vpbroadcastq {x}, qword ptr [{t} + {c}*8]",
            "vpblendd {v}, {v}, {x}, 0x30",
            "vpbroadcastq {x}, qword ptr [{t} + {d}*8]",
            "vpblendd {v}, {v}, {x}, 0xC0",
            t = in(reg) t.as_ptr(),
            a = in(reg) i[0],
            b = in(reg) i[1],
            c = in(reg) i[2],
            d = in(reg) i[3],
            v = out(ymm_reg) v,
            x = out(ymm_reg) _,
            options(pure, readonly, nostack, preserves_flags),
        );
    }
    v
}

/// [`rows4`] for tables of 4-byte grid rows: eight entries, `i[k]` in dword lane `k`.
///
/// # Safety
/// AVX2 available; every `i[k] < N`.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn rows8<const N: usize>(t: &[u32; N], i: [usize; 8]) -> __m256i {
    debug_assert!(i.iter().all(|&k| k < N));
    let v: __m256i;
    // SAFETY: the eight reads are entries of `t` (the contract); registers only otherwise.
    unsafe {
        core::arch::asm!(
            "vpbroadcastd {v}, dword ptr [{t} + {i0}*4]",
            "vpbroadcastd {x}, dword ptr [{t} + {i1}*4]",
            "vpblendd {v}, {v}, {x}, 0x02",
            "vpbroadcastd {x}, dword ptr [{t} + {i2}*4]",
            "vpblendd {v}, {v}, {x}, 0x04",
            "vpbroadcastd {x}, dword ptr [{t} + {i3}*4]",
            "vpblendd {v}, {v}, {x}, 0x08",
            "vpbroadcastd {x}, dword ptr [{t} + {i4}*4]",
            "vpblendd {v}, {v}, {x}, 0x10",
            "vpbroadcastd {x}, dword ptr [{t} + {i5}*4]",
            "vpblendd {v}, {v}, {x}, 0x20",
            "vpbroadcastd {x}, dword ptr [{t} + {i6}*4]",
            "vpblendd {v}, {v}, {x}, 0x40",
            "vpbroadcastd {x}, dword ptr [{t} + {i7}*4]",
            "vpblendd {v}, {v}, {x}, 0x80",
            t = in(reg) t.as_ptr(),
            i0 = in(reg) i[0],
            i1 = in(reg) i[1],
            i2 = in(reg) i[2],
            i3 = in(reg) i[3],
            i4 = in(reg) i[4],
            i5 = in(reg) i[5],
            i6 = in(reg) i[6],
            i7 = in(reg) i[7],
            v = out(ymm_reg) v,
            x = out(ymm_reg) _,
            options(pure, readonly, nostack, preserves_flags),
        );
    }
    v
}

/// Sub-block `ib`'s i16 scale vector from [`scales16_vec`]: its scale of values 0..16 in the
/// first eight lanes (the first eight `vpmaddubsw` pairs), of values 16..32 in the rest.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn pick(sv: __m256i, ib: usize) -> __m256i {
    let k = 2 * ib as i16;
    _mm256_shuffle_epi8(sv, _mm256_set1_epi16(k | ((k + 1) << 8)))
}

/// One 32-value sub-block, as the tile multiplies it: `maddubs(grid, sign(a, signs))` is the
/// grid's dot with the activations `a`, `madd` by `scale` applies the scales.
pub(super) struct Sub {
    /// The magnitudes, unsigned, in value order.
    pub(super) grid: __m256i,
    /// The signs: ±1 bytes, or the IQ1 types' grid values themselves (−1, 0, 1).
    pub(super) signs: __m256i,
    /// i16 scales `2·ls + 1`: the first eight lanes for values 0..16, the rest for 16..32.
    pub(super) scale: __m256i,
    /// The IQ1 types: the delta of each value as ±1 bytes (else unused).
    pub(super) delta: __m256i,
    /// IQ1_S: its one scale times its one delta (its delta's sum comes from the activations'
    /// block sums); else 0.
    pub(super) dscale: i32,
}

/// The f16 super-block scale of the `KIND` super-block at `p` (IQ1_M's from the top nibbles
/// of its scale words).
///
/// # Safety
/// F16C available; `p` readable for one super-block.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn d_of<const KIND: u8>(p: *const u8) -> f32 {
    // SAFETY: as the contract.
    unsafe {
        if KIND == IQ1_M {
            let u = crate::scalar::iq1m_d_bits(p.add(48).cast::<[u16; 4]>().read_unaligned());
            _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(u as i32)))
        } else {
            f16_at(p)
        }
    }
}

/// Sub-block `ib` of the `KIND` super-block at `p` (layouts in `crate::scalar`).
///
/// # Safety
/// AVX2 available; `p` readable for one super-block; `ib < 8`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn sub_block<const KIND: u8>(p: *const u8, ib: usize, sv: __m256i) -> Sub {
    // SAFETY: as the contract.
    unsafe { sub_block_with::<KIND>(p, ib, sv, None) }
}

/// The four 11-bit (IQ1_S, IQ1_M) or 10-bit (IQ2_S) grid indices of sub-block `ib`, one per
/// 16-bit word, built by `pdep` as ggml does for IQ1_S: the low bytes from the four index
/// bytes, the high bits from the sub-block's bit fields. Only AVX-512 tiles call it (the
/// sub-block tile and [`tile512_iq1`] by loads): every AVX-512 CPU runs `pdep` in a cycle or
/// so, while the AVX2-only AMD Zen 1/2 microcode it (hundreds of cycles), so the AVX2 tile
/// keeps shifts and masks. `None` for the other kinds. The sub-block tile takes it wherever it
/// runs: IQ1_M's GEMV on AMD Zen 4 (on an AMD EPYC Zen 5,
/// session 25, its `pdep` form was the faster by a fifth: the 4096 × 14336 GEMV, one thread,
/// medians 3.05–3.33 ms against 3.48–4.84 with shifts; on an Intel Xeon in session 22 it was
/// the slower, 0.91× against 0.95× llama.cpp; such CPUs now gather whole grid rows,
/// [`tile512_iq1`], and Intel AVX-512 CPUs before Sapphire Rapids take `pdep`
/// unmeasured), and everyone's 2 to 15 tokens of IQ1_M (not measured against the shifts; the
/// indices are built once for the tile's tokens).
///
/// # Safety
/// BMI2 available; `p` readable for one super-block of `KIND`; `ib < 8`.
#[target_feature(enable = "bmi2")]
#[inline]
pub(super) unsafe fn grid_index_pdep<const KIND: u8>(p: *const u8, ib: usize) -> Option<u64> {
    const LOW: u64 = 0x00FF_00FF_00FF_00FF;
    // SAFETY (whole body): reads within the super-block at `p`.
    unsafe {
        let u16_at = |o: usize| p.add(o).cast::<u16>().read_unaligned() as u64;
        let u32_at = |o: usize| p.add(o).cast::<u32>().read_unaligned() as u64;
        match KIND {
            IQ1_S => Some(
                _pdep_u64(u32_at(2 + 4 * ib), LOW)
                    | _pdep_u64(u16_at(34 + 2 * ib), 0x0700_0700_0700_0700),
            ),
            // IQ1_M: nibble l of the u16 at 32 + 2ib gives index l's top three bits (its bit
            // 3, the delta's sign, lands in bit 11, which the index mask drops).
            IQ1_M => Some(
                _pdep_u64(u32_at(4 * ib), LOW)
                    | _pdep_u64(u16_at(32 + 2 * ib), 0x0F00_0F00_0F00_0F00),
            ),
            // Bits 2l, 2l + 1 of the byte at 66 + ib: index l's top two bits.
            IQ2_S => Some(
                _pdep_u64(u32_at(2 + 4 * ib), LOW)
                    | _pdep_u64(*p.add(66 + ib) as u64, 0x0300_0300_0300_0300),
            ),
            _ => None,
        }
    }
}

/// [`sub_block`] with the grid indices, where given, from [`grid_index_pdep`] (word `l` is
/// group `l`'s index).
///
/// # Safety
/// As [`sub_block`].
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn sub_block_with<const KIND: u8>(
    p: *const u8,
    ib: usize,
    sv: __m256i,
    idx: Option<u64>,
) -> Sub {
    // Group l's index from the packed words (masked to the table: the bounds check folds).
    let word = |w: u64, l: usize, mask: u64| ((w >> (16 * l)) & mask) as usize;
    let zero = _mm256_setzero_si256();
    let one = |ls: u32| _mm256_set1_epi16((2 * ls + 1) as i16);
    // SAFETY (whole body): reads within the super-block at `p`.
    unsafe {
        let b = |o: usize| *p.add(o) as usize;
        match KIND {
            IQ2_XXS | IQ3_XXS => {
                let (grid, w1) = if KIND == IQ2_XXS {
                    let w0 = p.add(2 + 8 * ib).cast::<u32>().read_unaligned();
                    let g = |l: u32| IQ2XXS_GRID[((w0 >> (8 * l)) & 0xFF) as usize] as i64;
                    (
                        _mm256_setr_epi64x(g(0), g(1), g(2), g(3)),
                        p.add(6 + 8 * ib).cast::<u32>().read_unaligned(),
                    )
                } else {
                    let g = |i: usize| IQ3XXS_GRID[b(2 + 8 * ib + i)] as i32;
                    (
                        _mm256_setr_epi32(g(0), g(1), g(2), g(3), g(4), g(5), g(6), g(7)),
                        p.add(66 + 4 * ib).cast::<u32>().read_unaligned(),
                    )
                };
                let s = |l: u32| SIGNS64[((w1 >> (7 * l)) & 127) as usize] as i64;
                Sub {
                    grid,
                    signs: _mm256_setr_epi64x(s(0), s(1), s(2), s(3)),
                    scale: one(w1 >> 28),
                    delta: zero,
                    dscale: 0,
                }
            }
            IQ2_XS => {
                let q = p.add(2 + 8 * ib).cast::<[u16; 4]>().read_unaligned();
                let g = |l: usize| IQ2XS_GRID[(q[l] & 511) as usize] as i64;
                let s = |l: usize| SIGNS64[(q[l] >> 9) as usize] as i64;
                Sub {
                    grid: _mm256_setr_epi64x(g(0), g(1), g(2), g(3)),
                    signs: _mm256_setr_epi64x(s(0), s(1), s(2), s(3)),
                    scale: pick(sv, ib),
                    delta: zero,
                    dscale: 0,
                }
            }
            IQ2_S => {
                let qh = b(66 + ib);
                let g = |l: usize| {
                    IQ2S_GRID[match idx {
                        Some(w) => word(w, l, 0x3FF),
                        None => b(2 + 4 * ib + l) | ((qh << (8 - 2 * l)) & 0x300),
                    }] as i64
                };
                Sub {
                    grid: _mm256_setr_epi64x(g(0), g(1), g(2), g(3)),
                    signs: sign_bits(p.add(34 + 4 * ib)),
                    scale: pick(sv, ib),
                    delta: zero,
                    dscale: 0,
                }
            }
            IQ3_S => {
                let qh = b(66 + ib);
                let g = |k: usize| IQ3S_GRID[b(2 + 8 * ib + k) | ((qh << (8 - k)) & 256)] as i32;
                Sub {
                    grid: _mm256_setr_epi32(g(0), g(1), g(2), g(3), g(4), g(5), g(6), g(7)),
                    signs: sign_bits(p.add(74 + 4 * ib)),
                    scale: one(((b(106 + ib / 2) >> (4 * (ib % 2))) & 0xF) as u32),
                    delta: zero,
                    dscale: 0,
                }
            }
            IQ1_S => {
                let qh = p.add(34 + 2 * ib).cast::<u16>().read_unaligned() as usize;
                let g = |l: usize| {
                    IQ1S_GRID[match idx {
                        Some(w) => word(w, l, 0x7FF),
                        None => b(2 + 4 * ib + l) | (((qh >> (3 * l)) & 7) << 8),
                    }] as i64
                };
                let v = _mm256_setr_epi64x(g(0), g(1), g(2), g(3));
                let ls = ((qh >> 12) & 7) as i32;
                let delta = if qh & 0x8000 != 0 { -1 } else { 1 };
                Sub {
                    grid: _mm256_abs_epi8(v),
                    signs: v,
                    scale: one(ls as u32),
                    delta: _mm256_set1_epi8(delta as i8),
                    dscale: delta * (2 * ls + 1),
                }
            }
            _ => {
                // IQ1_M: per group `l` of 8 values a nibble of the u16 `h` at 32 + 2ib (three
                // index bits, the delta's sign in bit 3); the 16-value scales six bits per 32
                // values in the words at 48.
                let h = p.add(32 + 2 * ib).cast::<u16>().read_unaligned() as usize;
                let g = |l: usize| {
                    IQ1S_GRID[match idx {
                        Some(w) => word(w, l, 0x7FF),
                        None => b(4 * ib + l) | (((h >> (4 * l)) & 7) << 8),
                    }] as i64
                };
                let v = _mm256_setr_epi64x(g(0), g(1), g(2), g(3));
                // Group l is i16 lanes 4l..4l+4: its bit 3 + 4l set gives -1 bytes, else 1.
                let bit = _mm256_setr_epi16(
                    8, 8, 8, 8, 0x80, 0x80, 0x80, 0x80, 0x800, 0x800, 0x800, 0x800, -0x8000,
                    -0x8000, -0x8000, -0x8000,
                );
                let set =
                    _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16(h as i16), bit), bit);
                Sub {
                    grid: _mm256_abs_epi8(v),
                    signs: v,
                    scale: pick(sv, ib),
                    delta: _mm256_or_si256(set, _mm256_set1_epi8(1)),
                    dscale: 0,
                }
            }
        }
    }
}

/// The super-block at `p` as the tokens-in-lanes GEMM wants it: its 256 signed values (the
/// IQ1 types' `8 · grid + delta`) as unsigned `value + 128`, eight 32-value chunks in value
/// order, and its sub-block scales `2·ls + 1`: 8 of 32 values, or 16 of 16 ([`scales16`]),
/// the rest zero.
///
/// # Safety
/// AVX2 available; `p` readable for one super-block.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn unpack<const KIND: u8>(p: *const u8) -> ([__m256i; 8], [i32; 16]) {
    let mut sc = [0i32; 16];
    // SAFETY: as the contract.
    let sv = unsafe { scales16_vec::<KIND>(p) };
    let codes = core::array::from_fn(|ib| {
        // SAFETY: as the contract.
        let s = unsafe { sub_block::<KIND>(p, ib, sv) };
        let (lo, hi) = (
            _mm256_extract_epi16::<0>(s.scale),
            _mm256_extract_epi16::<8>(s.scale),
        );
        if scales16(KIND) {
            sc[2 * ib] = lo;
            sc[2 * ib + 1] = hi;
        } else {
            sc[ib] = lo;
        }
        let v = if is_iq1(KIND) {
            _mm256_add_epi8(_mm256_sign_epi8(_mm256_set1_epi8(8), s.signs), s.delta)
        } else {
            _mm256_sign_epi8(s.grid, s.signs)
        };
        _mm256_xor_si256(v, _mm256_set1_epi8(-128))
    });
    (codes, sc)
}

/// # Safety
/// The CPU has AVX2, FMA and F16C; `g` comes from `Gemm::new` with `out.len() == g.ntok *
/// g.nrows` and weights of kind `KIND` (an IQ grid type).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn run_grid<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) {
    if g.ntok == 1 {
        drive!(g, out, tile, 4, 1, KIND);
    } else {
        drive!(g, out, tile, 2, 4, KIND);
    }
}

/// The AVX-512 table's entry: [`run_grid`]'s tiles compiled for AVX-512 or the gather tiles
/// (below), and from 16 tokens
/// in the tiled order the tokens-in-lanes GEMM.
///
/// # Safety
/// As [`run_grid`], and the CPU has AVX-512 F/BW/VL/DQ, VNNI and BMI2.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi2")]
pub(super) unsafe fn run_grid_avx512<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) {
    // SAFETY: as this function's contract.
    if unsafe { super::kq_lanes::tiled_batch::<KIND>(g, out) } {
        return;
    }
    // Where gathers are fast ([`super::fast_gathers`]), grid rows gathered where that measured
    // faster on an Intel Xeon (model 207, session 26; both paths alternated in one process,
    // 4096 × 14336): IQ1_S at every token count (GEMV 1.5-3x, 4 tokens 1.05-1.23x), the others
    // but IQ2_S for one token (GEMV IQ1_M 1.3-2x, IQ2_XXS 1.10x, IQ3_XXS 1.16-1.19x, IQ2_XS
    // 1.45x, IQ3_S 2.05x; at 4 tokens the sub-block tile, which unpacks each sub-block once
    // for its four tokens, is level or ahead: IQ1_M 0.91-0.93x, IQ2_XXS 0.80-0.95x, IQ3_XXS
    // 0.91-1.06x with gathers). On a Zen 4 only IQ1_S gathers (session 28, alternated
    // in one process) its GEMV 1.00-1.09x at 1 thread, 1.14-1.23x at 2, 4 tokens 1.10-1.19x;
    // the others 0.53-0.90x (IQ3_S 0.94-1.11x). On a Zen 5 (session 30, four alternated
    // rounds, 4096 × 14336, against what the dispatch takes otherwise) IQ3_S's GEMV gathers too:
    // 1.10-1.11x (parity) and 1.16-1.17x (invariant) at 1 and 2 threads; IQ1_S's gathers are
    // level in parity (0.99-1.00x) and 1.20-1.21x in invariant; IQ1_M's 0.72-0.90x. Measured
    // on one KVM EPYC (family 26 model 2); Zen 5 parts with 256-bit AVX-512 datapaths
    // (Ryzen, mobile) take the same, unmeasured. (Session 40 replaced both Zen 5 gathers by
    // loads, below.)
    //
    // On a Zen 5 (session 40, the same EPYC family 26 model 2) the GEMVs of IQ2_XXS, IQ3_XXS
    // and IQ3_S run one row at a time, one sequential stream through the matrix: their four
    // interleaved row streams ran from DRAM well below their in-cache speed (IQ2_XS and IQ2_S
    // at one row 0.77-0.85x: they keep four). IQ1_S and IQ1_M take `tile512_iq1` with grid
    // rows by loads (`rows4`), one row at a time for one token; IQ1_S also from 2 to 15 tokens
    // (1.05-1.14x its gathers; IQ1_M keeps the sub-block tile there, 0.90-0.97x with loads),
    // both IQ1 types there in tiles of one row by four tokens (against two rows by four,
    // alternated, 4 and 8 tokens: IQ1_S 1.25-1.45x, IQ1_M 1.05-1.41x; the other grid kinds
    // 1.05-1.13x at 4 tokens but 0.86-1.02x at 8, so they keep two rows).
    // IQ3_S's GEMV, one row, takes its grid rows by loads too (`rows8`; 1.29-1.32x its
    // gathers at one row). GEMVs against the dispatch before (4096 × 14336, medians of five
    // runs alternated in separate processes, 1 / 2 threads): IQ1_S 1.75 / 1.85x, IQ1_M 2.11 /
    // 1.35x, IQ2_XXS 1.78 / 1.50x, IQ3_XXS 1.46 / 1.24x, IQ3_S 1.08 / 1.17x with one row alone
    // and 1.32 / 1.29x more with loads (IQ2_XS, unchanged: 1.00 / 1.00x).
    let zen5 = super::is_amd_zen5_or_later();
    let one_row = zen5 && matches!(KIND, IQ2_XXS | IQ3_XXS | IQ3_S);
    let gather = match KIND {
        IQ1_S => super::fast_gathers() || super::is_amd(),
        IQ3_S => (super::fast_gathers() || zen5) && g.ntok == 1,
        IQ1_M | IQ2_XXS | IQ2_XS | IQ3_XXS => super::fast_gathers() && g.ntok == 1,
        _ => false,
    };
    if zen5 && (KIND == IQ1_S || (KIND == IQ1_M && g.ntok == 1)) {
        if g.ntok == 1 {
            drive!(g, out, tile512_iq1, 1, 1, KIND, LOADS);
        } else {
            drive!(g, out, tile512_iq1, 1, 4, KIND, LOADS);
        }
    } else if gather && is_iq1(KIND) {
        if g.ntok == 1 {
            drive!(g, out, tile512_iq1, 4, 1, KIND, GATHERS);
        } else {
            drive!(g, out, tile512_iq1, 2, 4, KIND, GATHERS);
        }
    } else if gather && zen5 && KIND == IQ3_S {
        drive!(g, out, tile512_sign_gather, 1, 1, KIND, LOADS);
    } else if gather {
        drive!(g, out, tile512_sign_gather, 4, 1, KIND, GATHERS);
    } else if masks_ok::<KIND>() {
        // The sign-table kinds' signs as bit masks, IQ3_S's grid indices built in registers:
        // on an AMD EPYC Zen 4 (session 28, both tiles alternated in one process, 4096 ×
        // 14336) GEMV 1.24-1.43x the sub-block tile's speed at 1 and 2 threads, 4 tokens
        // 1.10-1.12x; IQ3_S 1.01-1.14x and 1.15x. Not measured on Intel or Zen 5.
        // SAFETY (both drives): `masks_ok` checked AVX512-VBMI and GFNI, the features this
        // tile adds to this function's.
        if g.ntok == 1 && one_row {
            drive!(g, out, tile512_masks, 1, 1, KIND);
        } else if g.ntok == 1 {
            drive!(g, out, tile512_masks, 4, 1, KIND);
        } else {
            drive!(g, out, tile512_masks, 2, 4, KIND);
        }
    } else if g.ntok == 1 {
        drive!(g, out, tile512, 4, 1, KIND);
    } else if zen5 && KIND == IQ1_M {
        drive!(g, out, tile512, 1, 4, KIND);
    } else {
        drive!(g, out, tile512, 2, 4, KIND);
    }
}

/// Whether `KIND` takes [`tile512_masks`] here: IQ2_XXS, IQ2_XS, IQ3_XXS and IQ3_S where the
/// CPU has AVX512-VBMI and GFNI (Ice Lake, Sapphire Rapids, Zen 4 and later) and gathers do
/// not run.
fn masks_ok<const KIND: u8>() -> bool {
    (sign_table(KIND) || KIND == IQ3_S) && super::has_vbmi_gfni()
}

/// Rows `r0..r0+R` × tokens `t0..t0+T`: `tile` with AVX2's features, `tile512` the same code
/// compiled for AVX-512 (32 registers, EVEX encodings), which the AVX-512 table runs, and
/// `tile512_masks` that with VBMI and GFNI, where IQ2_XXS, IQ2_XS and IQ3_XXS take their signs
/// from [`sign_masks`] (one masked `vpsubb` negating the activations, instead of four
/// `SIGNS64` loads, their shifts and masks, and the shuffles joining them, per sub-block) and
/// IQ3_S its grid indices from [`iq3s_indices`].
macro_rules! tile_fn {
    ($name:ident, $features:literal, $pdep:literal, $mask:literal) => {
        /// # Safety
        /// As [`run_grid`] (and the features named); `r0 + R <= g.nrows`, `t0 + T <= g.ntok`.
        #[target_feature(enable = $features)]
        unsafe fn $name<const R: usize, const T: usize, const KIND: u8>(
            g: &Gemm<'_>,
            r0: usize,
            t0: usize,
            out: &mut [f32],
        ) {
            let nb = g.cols / QK_K;
            let (wb, post, delta) = geometry(KIND);
            let mut ch = Chains::<R, T>::new(g, t0, post, delta);
            // SAFETY (whole body): super-blocks below `nb` of rows r0..r0+R and tokens
            // t0..t0+T.
            unsafe {
                for b in 0..nb {
                    let ad = Chains::<R, T>::dy(g, t0, b);
                    for r in 0..R {
                        let wp = g.w.as_ptr().add((r0 + r) * g.w_stride + b * wb);
                        let dw = d_of::<KIND>(wp);
                        // Sub-block by sub-block, each unpacked once for the tile's tokens.
                        let mut lanes = [_mm256_setzero_si256(); T];
                        let mut dl = [_mm256_setzero_si256(); T];
                        let mut dsum = [0i32; T];
                        let sv = scales16_vec::<KIND>(wp);
                        let masks = if $mask && sign_table(KIND) {
                            sign_masks::<KIND>(wp)
                        } else {
                            [0; 16]
                        };
                        let ix = if $mask && KIND == IQ3_S {
                            iq3s_indices(wp)
                        } else {
                            [0; 64]
                        };
                        for ib in 0..8 {
                            let idx = if $pdep {
                                grid_index_pdep::<KIND>(wp, ib)
                            } else {
                                None
                            };
                            let mut sb = sub_block_with::<KIND>(wp, ib, sv, idx);
                            if $mask && KIND == IQ3_S {
                                // The grid from the indices built once per super-block;
                                // `sub_block_with`'s own lookups are dead then and compiled
                                // out (pure loads whose results go unused).
                                let grid = |k: usize| IQ3S_GRID[ix[8 * ib + k] as usize & 511];
                                sb.grid = _mm256_setr_epi32(
                                    grid(0) as i32,
                                    grid(1) as i32,
                                    grid(2) as i32,
                                    grid(3) as i32,
                                    grid(4) as i32,
                                    grid(5) as i32,
                                    grid(6) as i32,
                                    grid(7) as i32,
                                );
                            }
                            for t in 0..T {
                                let q8 =
                                    g.a.as_ptr().add((t0 + t) * g.a_stride + b * Q8_K_BYTES + 4);
                                let a = _mm256_loadu_si256(q8.add(32 * ib).cast());
                                let sa = if $mask && sign_table(KIND) {
                                    let k = masks[if KIND == IQ3_XXS { ib } else { 2 * ib }];
                                    _mm256_mask_sub_epi8(a, k, _mm256_setzero_si256(), a)
                                } else {
                                    _mm256_sign_epi8(a, sb.signs)
                                };
                                let p = _mm256_maddubs_epi16(sb.grid, sa);
                                lanes[t] =
                                    _mm256_add_epi32(lanes[t], _mm256_madd_epi16(p, sb.scale));
                                if KIND == IQ1_S {
                                    // The sub-block's sum: two of the q8_K block sums at 256.
                                    let bs =
                                        q8.add(256 + 4 * ib).cast::<[i16; 2]>().read_unaligned();
                                    dsum[t] += sb.dscale * (bs[0] as i32 + bs[1] as i32);
                                } else if KIND == IQ1_M {
                                    let p = _mm256_maddubs_epi16(
                                        _mm256_set1_epi8(1),
                                        _mm256_sign_epi8(a, sb.delta),
                                    );
                                    dl[t] = _mm256_add_epi32(dl[t], _mm256_madd_epi16(p, sb.scale));
                                }
                            }
                        }
                        for t in 0..T {
                            if KIND == IQ1_S {
                                ch.step_delta_sum(r, t, lanes[t], dsum[t], dw, ad[t]);
                            } else if is_iq1(KIND) {
                                ch.step_delta(r, t, lanes[t], dl[t], dw, ad[t]);
                            } else {
                                ch.step(r, t, lanes[t], dw, ad[t]);
                            }
                        }
                    }
                }
                ch.finish(g, r0, t0, out);
            }
        }
    };
}

tile_fn!(tile, "avx2,fma,f16c", false, false);
tile_fn!(
    tile512,
    "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi2",
    true,
    false
);
tile_fn!(
    tile512_masks,
    "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c,bmi2",
    true,
    true
);

/// Whether `kind`'s signs are 7-bit fields looked up in ggml's `ksigns_iq2xs` (what
/// [`sign_masks`] computes instead).
const fn sign_table(kind: u8) -> bool {
    matches!(kind, IQ2_XXS | IQ2_XS | IQ3_XXS)
}

/// An IQ3_S super-block's 64 grid indices at `p`: index `8 · ib + k` is byte `k` of sub-block
/// `ib`'s eight at 2, plus 256 where bit `k` of its high-bits byte at 66 is set, so bit
/// `8 · ib + k` of the eight bytes at 66 read as one u64. Two zero-extensions and two masked
/// adds, where each index took a load, a shift, a mask and an or.
///
/// # Safety
/// AVX-512 F/BW available; `p` readable for one IQ3_S super-block.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn iq3s_indices(p: *const u8) -> [u16; 64] {
    let mut ix = [0u16; 64];
    // SAFETY: 64 bytes at 2 and 8 at 66 within the super-block; `ix` holds 128 bytes.
    unsafe {
        let high = p.add(66).cast::<u64>().read_unaligned();
        let lo = _mm512_cvtepu8_epi16(_mm256_loadu_si256(p.add(2).cast()));
        let hi = _mm512_cvtepu8_epi16(_mm256_loadu_si256(p.add(34).cast()));
        let add = _mm512_set1_epi16(256);
        let lo = _mm512_mask_add_epi16(lo, high as u32, lo, add);
        let hi = _mm512_mask_add_epi16(hi, (high >> 32) as u32, hi, add);
        _mm512_storeu_si512(ix.as_mut_ptr().cast(), lo);
        _mm512_storeu_si512(ix.as_mut_ptr().add(32).cast(), hi);
    }
    ix
}

/// The sign masks of the eight sub-blocks of an IQ2_XXS, IQ2_XS or IQ3_XXS super-block at `p`:
/// bit `j` of a mask is the sign of the sub-block's value `j` (ggml's `ksigns_iq2xs` entry of
/// its four 7-bit fields, the eighth sign of each 8 values their parity). IQ2_XXS and IQ2_XS:
/// sub-block `ib`'s mask at `2 · ib`; IQ3_XXS: at `ib`. One `vpmultishiftqb` moves each 7-bit
/// field into a byte (with one stray bit on top), one `gf2p8affineqb` keeps the seven bits and
/// puts their parity in the eighth.
///
/// # Safety
/// AVX-512 F/BW/VL, VBMI and GFNI available; `p` readable for one super-block of `KIND`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,gfni")]
#[inline]
unsafe fn sign_masks<const KIND: u8>(p: *const u8) -> [u32; 16] {
    // Output bit i of a byte is the parity of (row byte 7 - i) & x: bits 0..6 copied, bit 7
    // the parity of bits 0..6.
    const PARITY: i64 = 0x0102_0408_1020_407F;
    // SAFETY (whole body): reads within the super-block at `p`.
    let fields = unsafe {
        match KIND {
            // Per qword (a sub-block) w0 | w1 << 32: the fields at bits 32 + 7l of the qword.
            IQ2_XXS => _mm512_multishift_epi64_epi8(
                _mm512_set1_epi64(i64::from_le_bytes([32, 39, 46, 53, 32, 39, 46, 53])),
                _mm512_loadu_si512(p.add(2).cast()),
            ),
            // Per qword four u16 words, each field at bits 9..16 of its word.
            IQ2_XS => _mm512_multishift_epi64_epi8(
                _mm512_set1_epi64(i64::from_le_bytes([9, 25, 41, 57, 9, 25, 41, 57])),
                _mm512_loadu_si512(p.add(2).cast()),
            ),
            // The eight u32 at 66, two per qword: fields at 7l and 32 + 7l (masks 8..16
            // zero).
            _ => _mm512_zextsi256_si512(_mm256_multishift_epi64_epi8(
                _mm256_set1_epi64x(i64::from_le_bytes([0, 7, 14, 21, 32, 39, 46, 53])),
                _mm256_loadu_si256(p.add(66).cast()),
            )),
        }
    };
    let signs = _mm512_gf2p8affine_epi64_epi8::<0>(fields, _mm512_set1_epi64(PARITY));
    let mut m = [0u32; 16];
    // SAFETY: 64 writable bytes.
    unsafe { _mm512_storeu_si512(m.as_mut_ptr().cast(), signs) };
    m
}

/// A `[$t; $n]` of `$e` over `$j` in 0..$n (a const block); `[u16; 32]` unless named.
macro_rules! table32 {
    (|$j:ident| $e:expr) => {
        table32!(u16; 32, |$j| $e)
    };
    ($t:ty; $n:expr, |$j:ident| $e:expr) => {{
        let mut t: [$t; $n] = [0; $n];
        let mut $j = 0;
        while $j < $n {
            t[$j] = ($e) as $t;
            $j += 1;
        }
        t
    }};
}

/// A `[[u16; 32]; 4]` of `$e` over pairs `$p` in 0..4 and lanes `$i` in 0..32.
macro_rules! pair_table {
    (|$p:ident, $i:ident| $e:expr) => {{
        let mut t = [[0u16; 32]; 4];
        let mut $p = 0;
        while $p < 4 {
            let mut $i = 0;
            while $i < 32 {
                t[$p][$i] = ($e) as u16;
                $i += 1;
            }
            $p += 1;
        }
        t
    }};
}

/// For [`tile512_iq1`]'s gathers, the 32 grid indices of a super-block (index `j` belongs to
/// sub-block `j / 4`): which 16-bit word of the high bits each takes, and the shift of its
/// three bits there (IQ1_S: `3 · (j % 4)`; IQ1_M: `4 · (j % 4)`).
static IQ1_WORD: [u16; 32] = table32!(|j| j / 4);

/// [`tile512_iq1`]'s two ways to its grid rows.
const GATHERS: bool = true;
const LOADS: bool = false;

/// ggml's `iq1s_grid` with one added to each of its eight bytes (-1, 0, 1 become 0, 1, 2).
static IQ1S_GRID_P1: [u64; 2048] = {
    let mut t = [0u64; 2048];
    let mut i = 0;
    while i < 2048 {
        let mut v = 0u64;
        let mut k = 0;
        while k < 8 {
            let b = ((IQ1S_GRID[i] >> (8 * k)) as u8).wrapping_add(1);
            v |= (b as u64) << (8 * k);
            k += 1;
        }
        t[i] = v;
        i += 1;
    }
    t
};
static IQ1S_SHIFT: [u16; 32] = table32!(|j| 3 * (j % 4));
static IQ1M_SHIFT: [u16; 32] = table32!(|j| 4 * (j % 4));

/// Per pair `p` of sub-blocks (one 64-byte register, 32 i16 pair sums, 16 a sub-block), which
/// of eight per-sub-block words each i16 lane takes (`PAIR_SCALE`: the one scale of IQ1_S and
/// the sign-gather types, IQ1_M's delta word) or which of [`scales16_vec`]'s sixteen
/// (`PAIR_SCALE16`: IQ1_M's and IQ2_XS's two scales a sub-block, values 0..16 then 16..32);
/// `DELTA_BIT`: which bit of IQ1_M's word (3 + 4l for the group l of 8 values) is the sign of
/// a lane's delta.
static PAIR_SCALE: [[u16; 32]; 4] = pair_table!(|p, i| 2 * p + i / 16);
static PAIR_SCALE16: [[u16; 32]; 4] = pair_table!(|p, i| (i / 8) % 2 * 8 + 2 * p + i / 16);
static DELTA_BIT: [u16; 32] = table32!(|i| 1 << (3 + 4 * (i / 4 % 4)));

/// The IQ1 types' rows `r0..r0+R` × tokens `t0..t0+T` on AVX-512, a super-block's 32 grid rows
/// in four 64-byte registers (two sub-blocks each), values plus one (0..2, unsigned), fetched
/// one of two ways:
/// - `GATHER`: its 32 eleven-bit indices built in one register (the low bytes widened, the
///   high bits from each sub-block's 16-bit word by a variable shift) and four `vpgatherdq`;
/// - else by [`rows4`] from [`IQ1S_GRID_P1`], the indices from [`grid_index_pdep`]: per grid
///   row a broadcast load and a blend (on the Zen 5 of session 40 faster than its gathers,
///   and than LLVM's own sequence for the same loads, which is bound by shuffles).
///
/// Then per token and pair of sub-blocks one `vpmaddubsw` against the activations, minus the
/// activations' own pair sums (once per token and super-block), and one `vpdpwssd` by the
/// scales. That is ggml's pair sum `v·a` exactly (|pair| ≤ 508) for activations in
/// −127..127, which is all the q8_K quantizer writes (ggml's `vpsignb` of −128 wraps, ours
/// would not), so each of the eight i32 lanes (the register's halves added) equals
/// [`tile512`]'s, and the f32 steps are the same [`Chains`]. The delta: IQ1_S's every
/// sub-block's `±(2·ls + 1)` against the q8_K block sums by one `vpmaddwd`; IQ1_M's pair sums
/// negated where a group's delta is −1 and one `vpdpwssd` by the scales.
///
/// # Safety
/// As [`run_grid_avx512`] with `KIND` IQ1_S or IQ1_M; `r0 + R <= g.nrows`, `t0 + T <= g.ntok`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi2")]
unsafe fn tile512_iq1<const R: usize, const T: usize, const KIND: u8, const GATHER: bool>(
    g: &Gemm<'_>,
    r0: usize,
    t0: usize,
    out: &mut [f32],
) {
    debug_assert!(is_iq1(KIND));
    let m = KIND == IQ1_M;
    let nb = g.cols / QK_K;
    let (wb, post, delta) = geometry(KIND);
    // Where a super-block's index bytes and high-bit words are.
    let (qs_at, words_at) = if m { (0, 32) } else { (2, 34) };
    let mut ch = Chains::<R, T>::new(g, t0, post, delta);
    // SAFETY (whole body): super-blocks below `nb` of rows r0..r0+R and tokens t0..t0+T; the
    // gathered and loaded indices are masked to 11 bits, inside the 2048-entry grids.
    unsafe {
        let load = |t: &[u16; 32]| _mm512_loadu_si512(t.as_ptr().cast());
        let word = load(&IQ1_WORD);
        let shift = load(if m { &IQ1M_SHIFT } else { &IQ1S_SHIFT });
        let pair: [__m512i; 4] =
            core::array::from_fn(|p| load(if m { &PAIR_SCALE16[p] } else { &PAIR_SCALE[p] }));
        // IQ1_M's delta signs: each lane's sub-block word (as IQ1_S's scales take it).
        let pair_sub: [__m512i; 4] = core::array::from_fn(|p| load(&PAIR_SCALE[p]));
        let delta_bit = load(&DELTA_BIT);
        let ones = _mm512_set1_epi8(1);
        let table: &'static [u64; 2048] = &IQ1S_GRID;
        let grid = table.as_ptr().cast::<i64>();
        for b in 0..nb {
            let ad = Chains::<R, T>::dy(g, t0, b);
            // The tile's activations: per token four 64-byte pairs of sub-blocks, their i16
            // pair sums, and (IQ1_S) the sixteen block sums.
            let mut a = [[_mm512_setzero_si512(); 4]; T];
            let mut a1 = [[_mm512_setzero_si512(); 4]; T];
            let mut bsums = [_mm256_setzero_si256(); T];
            for t in 0..T {
                let q8 = g.a.as_ptr().add((t0 + t) * g.a_stride + b * Q8_K_BYTES + 4);
                for p in 0..4 {
                    a[t][p] = _mm512_loadu_si512(q8.add(64 * p).cast());
                    a1[t][p] = _mm512_maddubs_epi16(ones, a[t][p]);
                }
                bsums[t] = _mm256_loadu_si256(q8.add(256).cast());
            }
            for r in 0..R {
                let wp = g.w.as_ptr().add((r0 + r) * g.w_stride + b * wb);
                let dw = d_of::<KIND>(wp);
                let words = _mm_loadu_si128(wp.add(words_at).cast());
                // Values plus one (0, 1, 2): unsigned for vpmaddubsw.
                let codes: [__m512i; 4] = if GATHER {
                    let high = _mm512_and_si512(
                        _mm512_srlv_epi16(
                            _mm512_permutexvar_epi16(word, _mm512_castsi128_si512(words)),
                            shift,
                        ),
                        _mm512_set1_epi16(7),
                    );
                    let idx = _mm512_or_si512(
                        _mm512_cvtepu8_epi16(_mm256_loadu_si256(wp.add(qs_at).cast())),
                        _mm512_slli_epi16::<8>(high),
                    );
                    let lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(idx));
                    let hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64::<1>(idx));
                    let halves = [
                        _mm512_castsi512_si256(lo),
                        _mm512_extracti64x4_epi64::<1>(lo),
                        _mm512_castsi512_si256(hi),
                        _mm512_extracti64x4_epi64::<1>(hi),
                    ];
                    core::array::from_fn(|p| {
                        _mm512_add_epi8(_mm512_i32gather_epi64::<8>(halves[p], grid), ones)
                    })
                } else {
                    let w: [u64; 8] =
                        core::array::from_fn(|ib| grid_index_pdep::<KIND>(wp, ib).unwrap_or(0));
                    let four = |ib: usize| {
                        let i = |l: usize| ((w[ib] >> (16 * l)) & 0x7FF) as usize;
                        rows4(&IQ1S_GRID_P1, [i(0), i(1), i(2), i(3)])
                    };
                    core::array::from_fn(|p| {
                        _mm512_inserti64x4::<1>(
                            _mm512_castsi256_si512(four(2 * p)),
                            four(2 * p + 1),
                        )
                    })
                };
                // The scales 2·ls + 1 (IQ1_S: one a sub-block, from the top of its word;
                // IQ1_M: two) per pair of sub-blocks; IQ1_S's with its delta's sign for the
                // block sums (each twice: two sums a sub-block); IQ1_M's delta signs as masks.
                let (sc, sd2, neg_delta) = if m {
                    let sv = _mm512_castsi256_si512(scales16_vec::<KIND>(wp));
                    let sc: [__m512i; 4] =
                        core::array::from_fn(|p| _mm512_permutexvar_epi16(pair[p], sv));
                    let nd: [__mmask32; 4] = core::array::from_fn(|p| {
                        _mm512_test_epi16_mask(
                            _mm512_permutexvar_epi16(pair_sub[p], _mm512_castsi128_si512(words)),
                            delta_bit,
                        )
                    });
                    (sc, _mm256_setzero_si256(), nd)
                } else {
                    let ls = _mm_and_si128(_mm_srli_epi16::<12>(words), _mm_set1_epi16(7));
                    let s = _mm_add_epi16(_mm_add_epi16(ls, ls), _mm_set1_epi16(1));
                    let sc: [__m512i; 4] = core::array::from_fn(|p| {
                        _mm512_permutexvar_epi16(pair[p], _mm512_castsi128_si512(s))
                    });
                    let neg = _mm_srai_epi16::<15>(words);
                    let sd = _mm_sub_epi16(_mm_xor_si128(s, neg), neg);
                    let sd2 =
                        _mm256_set_m128i(_mm_unpackhi_epi16(sd, sd), _mm_unpacklo_epi16(sd, sd));
                    (sc, sd2, [0; 4])
                };
                for t in 0..T {
                    let mut acc = _mm512_setzero_si512();
                    let mut dacc = _mm512_setzero_si512();
                    for p in 0..4 {
                        let pr =
                            _mm512_sub_epi16(_mm512_maddubs_epi16(codes[p], a[t][p]), a1[t][p]);
                        acc = _mm512_dpwssd_epi32(acc, pr, sc[p]);
                        if m {
                            let dp = _mm512_mask_sub_epi16(
                                a1[t][p],
                                neg_delta[p],
                                _mm512_setzero_si512(),
                                a1[t][p],
                            );
                            dacc = _mm512_dpwssd_epi32(dacc, dp, sc[p]);
                        }
                    }
                    let halves_sum = |v: __m512i| {
                        _mm256_add_epi32(
                            _mm512_castsi512_si256(v),
                            _mm512_extracti64x4_epi64::<1>(v),
                        )
                    };
                    let lanes = halves_sum(acc);
                    if m {
                        ch.step_delta(r, t, lanes, halves_sum(dacc), dw, ad[t]);
                    } else {
                        let dsum = super::avx2::hsum_i32(_mm256_madd_epi16(bsums[t], sd2));
                        ch.step_delta_sum(r, t, lanes, dsum, dw, ad[t]);
                    }
                }
            }
        }
        ch.finish(g, r0, t0, out);
    }
}

/// For [`tile512_sign_gather`]'s 32 sign fields of an IQ2_XXS / IQ3_XXS super-block, in two
/// registers of 16 dword lanes (lanes `16h..16h + 16` of the word table): field `j` takes
/// sub-block `j / 4`'s sign word, shifted right by `7 · (j % 4)`.
static XXS_SIGN_WORD: [u32; 32] = table32!(u32; 32, |j| j / 4);
static XXS_SIGN_SHIFT: [u32; 16] = table32!(u32; 16, |j| 7 * (j % 4));

/// The grid types whose signs are apart from their grid values (IQ2_XXS, IQ2_XS, IQ3_XXS,
/// IQ3_S), rows `r0..r0+R` × tokens `t0..t0+T` on AVX-512 with the grid rows gathered: per
/// super-block four `vpgatherdq` of 8-value grid rows (IQ2_XXS, IQ2_XS) or `vpgatherdd` of
/// 4-value ones (IQ3_XXS, IQ3_S), two sub-blocks a register, their indices built in registers
/// (IQ2_XS's nine bits of each word, IQ3_S's index bytes plus one bit of its `qh` byte); the
/// signs as a byte mask a pair of sub-blocks: IQ3_S's sign bits as they are, the others' 7-bit
/// sign indices shifted out of their words and gathered from the ±1 table. Per token and pair
/// of sub-blocks the activations are negated under the mask, one `vpmaddubsw` against the grid
/// magnitudes and one `vpdpwssd` by the two sub-blocks' scales ([`signed_pairs`]): ggml's
/// `maddubs(grid, sign(a, signs))` pair sums and `madd` by `2·ls + 1` exactly (negating under
/// the mask wraps −128 as `vpsignb` does), so the eight i32 lanes (the register's halves
/// added) equal [`tile512`]'s and the f32 steps are the same [`Chains`]. With `GATHER` false
/// (IQ3_S only) the grid rows come by [`rows8`] instead, each sub-block's eight indices built
/// four to a word by `pdep` (Zen 5's GEMV).
///
/// # Safety
/// As [`run_grid_avx512`] with `KIND` IQ2_XXS, IQ2_XS, IQ3_XXS or IQ3_S (`GATHER` false: IQ3_S
/// only); `r0 + R <= g.nrows`, `t0 + T <= g.ntok`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi2")]
unsafe fn tile512_sign_gather<
    const R: usize,
    const T: usize,
    const KIND: u8,
    const GATHER: bool,
>(
    g: &Gemm<'_>,
    r0: usize,
    t0: usize,
    out: &mut [f32],
) {
    debug_assert!(matches!(KIND, IQ2_XXS | IQ3_XXS | IQ2_XS | IQ3_S));
    debug_assert!(GATHER || KIND == IQ3_S);
    let nb = g.cols / QK_K;
    let (wb, post, delta) = geometry(KIND);
    let mut ch = Chains::<R, T>::new(g, t0, post, delta);
    // SAFETY (whole body): super-blocks below `nb` of rows r0..r0+R and tokens t0..t0+T; the
    // gathered and loaded indices are bytes (grids of 256 entries), masked to 7 bits (128
    // signs) or 9 bits (IQ2_XS's and IQ3_S's grids of 512).
    unsafe {
        let sign_word: [__m512i; 2] =
            core::array::from_fn(|h| _mm512_loadu_si512(XXS_SIGN_WORD[16 * h..].as_ptr().cast()));
        let sign_shift = _mm512_loadu_si512(XXS_SIGN_SHIFT.as_ptr().cast());
        let pair: [__m512i; 4] =
            core::array::from_fn(|p| _mm512_loadu_si512(PAIR_SCALE[p].as_ptr().cast()));
        let pair16: [__m512i; 4] =
            core::array::from_fn(|p| _mm512_loadu_si512(PAIR_SCALE16[p].as_ptr().cast()));
        let signs = SIGNS64.as_ptr().cast::<i64>();
        // Quarter `p` of 32 dword indices held in two registers: the eight of pair `p`.
        let quarter = |lo: __m512i, hi: __m512i, p: usize| {
            let v = if p < 2 { lo } else { hi };
            if p.is_multiple_of(2) {
                _mm512_castsi512_si256(v)
            } else {
                _mm512_extracti64x4_epi64::<1>(v)
            }
        };
        let gather8 = |idx: __m256i, table: *const i64| _mm512_i32gather_epi64::<8>(idx, table);
        // Eight sub-block scales `ls` (i16) as 2·ls + 1, spread over each pair's 32 lanes.
        let pair_scales = |pair: &[__m512i; 4], ls: __m128i| -> [__m512i; 4] {
            let s = _mm512_castsi128_si512(_mm_add_epi16(_mm_add_epi16(ls, ls), _mm_set1_epi16(1)));
            core::array::from_fn(|p| _mm512_permutexvar_epi16(pair[p], s))
        };
        for b in 0..nb {
            let ad = Chains::<R, T>::dy(g, t0, b);
            for r in 0..R {
                let wp = g.w.as_ptr().add((r0 + r) * g.w_stride + b * wb);
                let dw = f16_at(wp);
                // The grid rows (two sub-blocks a register), the sign masks (a bit a value),
                // and the i16 scales 2·ls + 1 per pair of sub-blocks.
                let (grid, neg, sc): ([__m512i; 4], [__mmask64; 4], [__m512i; 4]) = match KIND {
                    IQ2_XXS | IQ3_XXS => {
                        let (words, grid): (__m256i, [__m512i; 4]) = if KIND == IQ3_XXS {
                            let q = |p: usize| {
                                _mm512_cvtepu8_epi32(_mm_loadu_si128(wp.add(2 + 16 * p).cast()))
                            };
                            let table: &'static [u32; 256] = &IQ3XXS_GRID;
                            let table = table.as_ptr().cast::<i32>();
                            (
                                _mm256_loadu_si256(wp.add(66).cast()),
                                core::array::from_fn(|p| _mm512_i32gather_epi32::<4>(q(p), table)),
                            )
                        } else {
                            // Sub-block k: its four index bytes (dword 2k of qs), then its word.
                            let qs = _mm512_loadu_si512(wp.add(2).cast());
                            let even = _mm512_castsi512_si256(_mm512_permutexvar_epi32(
                                _mm512_setr_epi32(
                                    0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                ),
                                qs,
                            ));
                            let odd = _mm512_castsi512_si256(_mm512_permutexvar_epi32(
                                _mm512_setr_epi32(
                                    1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12, 14,
                                ),
                                qs,
                            ));
                            let lo = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(even));
                            let hi = _mm512_cvtepu8_epi32(_mm256_extracti128_si256::<1>(even));
                            let table: &'static [u64; 256] = &IQ2XXS_GRID;
                            let table = table.as_ptr().cast::<i64>();
                            (
                                odd,
                                core::array::from_fn(|p| gather8(quarter(lo, hi, p), table)),
                            )
                        };
                        let w512 = _mm512_castsi256_si512(words);
                        let fields: [__m512i; 2] = core::array::from_fn(|h| {
                            _mm512_and_si512(
                                _mm512_srlv_epi32(
                                    _mm512_permutexvar_epi32(sign_word[h], w512),
                                    sign_shift,
                                ),
                                _mm512_set1_epi32(127),
                            )
                        });
                        let neg = core::array::from_fn(|p| {
                            _mm512_movepi8_mask(gather8(quarter(fields[0], fields[1], p), signs))
                        });
                        // Each word's top four bits.
                        let ls = _mm256_cvtepi32_epi16(_mm256_srli_epi32::<28>(words));
                        (grid, neg, pair_scales(&pair, ls))
                    }
                    IQ2_XS => {
                        // Four words a sub-block: a 9-bit grid index, a 7-bit sign index.
                        let q = _mm512_loadu_si512(wp.add(2).cast());
                        let wide = |v: __m512i| {
                            (
                                _mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)),
                                _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64::<1>(v)),
                            )
                        };
                        let (glo, ghi) = wide(_mm512_and_si512(q, _mm512_set1_epi16(511)));
                        let (slo, shi) = wide(_mm512_srli_epi16::<9>(q));
                        let table: &'static [u64; 512] = &IQ2XS_GRID;
                        let table = table.as_ptr().cast::<i64>();
                        let sv = _mm512_castsi256_si512(scales16_vec::<KIND>(wp));
                        (
                            core::array::from_fn(|p| gather8(quarter(glo, ghi, p), table)),
                            core::array::from_fn(|p| {
                                _mm512_movepi8_mask(gather8(quarter(slo, shi, p), signs))
                            }),
                            core::array::from_fn(|p| _mm512_permutexvar_epi16(pair16[p], sv)),
                        )
                    }
                    _ => {
                        // IQ3_S: eight index bytes a sub-block, the ninth bits one byte a
                        // sub-block (bit k for index k), the signs one bit a value, the scales
                        // a nibble a sub-block.
                        let iota =
                            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
                        let table: &'static [u32; 512] = &IQ3S_GRID;
                        let table = table.as_ptr().cast::<i32>();
                        let grid = core::array::from_fn(|p| {
                            if !GATHER {
                                // Sub-block k's eight indices, four a word by `pdep`: its index
                                // bytes below, bit j of its `qh` byte as bit 8 of index j.
                                let eight = |k: usize| {
                                    let q = wp.add(2 + 8 * k).cast::<u64>().read_unaligned();
                                    let h = *wp.add(66 + k) as u64;
                                    let four = |x: u64, hb: u64| {
                                        _pdep_u64(x & 0xFFFF_FFFF, 0x00FF_00FF_00FF_00FF)
                                            | _pdep_u64(hb & 0xF, 0x0100_0100_0100_0100)
                                    };
                                    let (w0, w1) = (four(q, h), four(q >> 32, h >> 4));
                                    let i = |w: u64, l: usize| ((w >> (16 * l)) & 0x1FF) as usize;
                                    rows8(
                                        &IQ3S_GRID,
                                        [
                                            i(w0, 0),
                                            i(w0, 1),
                                            i(w0, 2),
                                            i(w0, 3),
                                            i(w1, 0),
                                            i(w1, 1),
                                            i(w1, 2),
                                            i(w1, 3),
                                        ],
                                    )
                                };
                                return _mm512_inserti64x4::<1>(
                                    _mm512_castsi256_si512(eight(2 * p)),
                                    eight(2 * p + 1),
                                );
                            }
                            let lo =
                                _mm512_cvtepu8_epi32(_mm_loadu_si128(wp.add(2 + 16 * p).cast()));
                            let qh = wp.add(66 + 2 * p).cast::<u16>().read_unaligned() as i32;
                            let hi = _mm512_slli_epi32::<8>(_mm512_and_si512(
                                _mm512_srlv_epi32(_mm512_set1_epi32(qh), iota),
                                _mm512_set1_epi32(1),
                            ));
                            _mm512_i32gather_epi32::<4>(_mm512_or_si512(lo, hi), table)
                        });
                        let neg = core::array::from_fn(|p| {
                            wp.add(74 + 8 * p).cast::<u64>().read_unaligned()
                        });
                        let nib = wp.add(106).cast::<u32>().read_unaligned() as i32;
                        let ls = _mm256_cvtepi32_epi16(_mm256_and_si256(
                            _mm256_srlv_epi32(
                                _mm256_set1_epi32(nib),
                                _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28),
                            ),
                            _mm256_set1_epi32(15),
                        ));
                        (grid, neg, pair_scales(&pair, ls))
                    }
                };
                for t in 0..T {
                    let q8 = g.a.as_ptr().add((t0 + t) * g.a_stride + b * Q8_K_BYTES + 4);
                    let lanes = signed_pairs(q8, &grid, &neg, &sc);
                    ch.step(r, t, lanes, dw, ad[t]);
                }
            }
        }
        ch.finish(g, r0, t0, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random super-blocks of `ty` (`rows × cols`) with a sane f16 scale (IQ1_M's in the top
    /// nibbles of its scale words), as `gemm_bench` writes them.
    fn blocks(ty: crate::GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let len = ty.row_size((rows * cols) as u64).expect("whole blocks") as usize;
        let mut v = super::super::xorshift_bytes(seed, len);
        let d = half::f16::from_f32(0.01).to_bits();
        for b in v.chunks_exact_mut(ty.type_size()) {
            if ty == crate::GgmlType::IQ1_M {
                for i in 0..4 {
                    b[49 + 2 * i] = (b[49 + 2 * i] & 0x0F) | ((((d >> (4 * i)) & 0xF) as u8) << 4);
                }
            } else {
                b[..2].copy_from_slice(&d.to_le_bytes());
            }
        }
        v
    }

    /// One kind's gather tile (and, for the kinds [`masks_ok`] gives the mask tile on this CPU,
    /// that one) against the sub-block tile, driven over the same rows and tokens with the
    /// same tile shapes: every output bit equal.
    fn gather_equals_sub_block<const KIND: u8>(ty: crate::GgmlType) {
        // 7 rows: the 4 × 1 tiles end in three one-row tiles, the 2 × 4 ones in one.
        let (rows, cols) = (7, 2 * QK_K);
        let w = blocks(ty, rows, cols, 0x9E37_79B9_7F4A_7C15 ^ KIND as u64);
        let q = crate::QMatrix::new(ty, rows, cols, &w).expect("matrix");
        for n in 1..=5 {
            let x = super::super::xorshift_f32(0x2545_F491_4F6C_DD1D ^ n as u64, n * cols);
            let mut act = crate::Activations::new();
            act.quantize_for(ty, &x, n, cols).expect("activations");
            for numerics in [crate::Numerics::Parity, crate::Numerics::Invariant] {
                let g = Gemm::new(&q, &act, 0..rows, n * rows, numerics).expect("gemm");
                let (mut want, mut got) = (vec![0f32; n * rows], vec![0f32; n * rows]);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                // `$tile` against the sub-block tile, `$r` x `$t` rows x tokens. SAFETY (its
                // drives): AVX-512 F/BW/VL/DQ, VNNI and BMI2 checked by the caller (VBMI and
                // GFNI for the mask tile, below); `g` is a Gemm of KIND's weights with outputs
                // of `n * rows`.
                macro_rules! same {
                    ($tile:ident, $r:literal, $t:literal $(, $x:ident)?) => {
                        drive!(&g, &mut want, tile512, $r, $t, KIND);
                        drive!(&g, &mut got, $tile, $r, $t, KIND $(, $x)?);
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "{ty:?} {n} tokens {numerics:?}: {} {} x {}",
                            stringify!($tile),
                            $r,
                            $t
                        );
                    };
                }
                if masks_ok::<KIND>() {
                    same!(tile512_masks, 4, 1);
                    same!(tile512_masks, 1, 1);
                    same!(tile512_masks, 2, 4);
                }
                if is_iq1(KIND) {
                    same!(tile512_iq1, 4, 1, GATHERS);
                    same!(tile512_iq1, 2, 4, GATHERS);
                    same!(tile512_iq1, 4, 1, LOADS);
                    same!(tile512_iq1, 1, 1, LOADS);
                    same!(tile512_iq1, 2, 4, LOADS);
                    same!(tile512_iq1, 1, 4, LOADS);
                } else {
                    same!(tile512_sign_gather, 4, 1, GATHERS);
                    same!(tile512_sign_gather, 1, 1, GATHERS);
                    same!(tile512_sign_gather, 2, 4, GATHERS);
                    if KIND == IQ3_S {
                        same!(tile512_sign_gather, 4, 1, LOADS);
                        same!(tile512_sign_gather, 1, 1, LOADS);
                        same!(tile512_sign_gather, 2, 4, LOADS);
                    }
                }
            }
        }
    }

    /// The gather tiles and the tiles with grid rows by loads (IQ1_S, IQ1_M, IQ3_S), called
    /// directly (the dispatch takes them only where gathers are fast, IQ1_S's on AMD Zen 4, the
    /// loads on Zen 5, and some kinds only for one token), and the mask tile
    /// where the CPU has VBMI and GFNI (which the dispatch then takes instead of the sub-block
    /// tile, so this keeps that one checked too): equal to the sub-block tile on any CPU with
    /// the AVX-512 table, for every kind they serve, 1 to 5 tokens, tiles of 4 × 1, 1 × 1 (the
    /// one-row GEMVs of Zen 5), 2 × 4 and (IQ1 by loads, Zen 5's) 1 × 4 rows × tokens with
    /// their one-row and short-token tails (7 rows), both numerics.
    #[test]
    fn gather_and_mask_tiles_equal_the_sub_block_tile() {
        if super::super::avx512::Avx512::new().is_none() {
            eprintln!("no AVX-512 VNNI here: the gather tiles do not run on this CPU");
            return;
        }
        use crate::GgmlType as G;
        gather_equals_sub_block::<IQ1_S>(G::IQ1_S);
        gather_equals_sub_block::<IQ1_M>(G::IQ1_M);
        gather_equals_sub_block::<IQ2_XXS>(G::IQ2_XXS);
        gather_equals_sub_block::<IQ2_XS>(G::IQ2_XS);
        gather_equals_sub_block::<IQ3_XXS>(G::IQ3_XXS);
        gather_equals_sub_block::<IQ3_S>(G::IQ3_S);
    }

    /// IQ1_M's grid indices by `pdep` equal the shifts' for every high-bits word and every
    /// sub-block (the AVX-512 sub-block tile uses them where gathers are not fast, and IQ1_M's
    /// from two tokens everywhere; this needs just BMI2).
    #[test]
    fn iq1_m_grid_indices_by_pdep_equal_the_shifts() {
        assert!(
            is_x86_feature_detected!("bmi2"),
            "every x86-64 machine we test on has BMI2"
        );
        let mut block = [0u8; 56];
        let mut x = 0x2545_F491u32;
        for b in block.iter_mut() {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            *b = x as u8;
        }
        for h in 0..=u16::MAX {
            for ib in 0..8 {
                block[32 + 2 * ib..34 + 2 * ib].copy_from_slice(&h.to_le_bytes());
                // SAFETY: BMI2 checked above; the block is one IQ1_M super-block, ib < 8.
                let w = unsafe { grid_index_pdep::<IQ1_M>(block.as_ptr(), ib) }
                    .expect("IQ1_M has a pdep form");
                for l in 0..4 {
                    let want = block[4 * ib + l] as u64 | ((h as u64 >> (4 * l)) & 7) << 8;
                    assert_eq!((w >> (16 * l)) & 0x7FF, want, "h={h:#x} ib={ib} l={l}");
                }
            }
        }
    }
}
