//! AVX-512 VNNI matmuls of ternary weights, bit-identical to `crate::ternary` (the float
//! order is the same as the AVX2 kernels', see `tern_avx2`).
//!
//! Two weight rows share a 512-bit register (row `r` in the low half, row `r + 1` in the high
//! half), so the eight lanes of each row are still one 256-bit half and the per-block f32 FMA
//! serves both rows. Codes are unsigned, activations signed: `vpdpbusd` sums four products
//! per i32 lane exactly, and the activation correction (Q8_K `bsums` pairs or Q8_TF `lsums`)
//! turns the codes `c = q + 1` back into `q`.
//!
//! The base-3 kinds (TQ1_0, TF1) have a second decoder for CPUs with AVX512-VBMI (Ice Lake,
//! Sapphire Rapids, Zen 4): each byte's trits come from two tables folded to 128 entries (see
//! [`Sym`]), one `vpermi2b` and a masked subtraction each per 64 bytes, instead of ggml's byte
//! multiplies and top-trit arithmetic per trit; one table packs trits 0..3 of a byte two bits
//! each (as TQ2_0 packs codes), taken apart by one `vgf2p8affineqb` per field, the other holds
//! trit 4. Same codes, so the same sums and bits.

// Tile loops index per-token and per-chunk register arrays with the same counter.
#![allow(clippy::needless_range_loop)]

use super::tern_avx2::{correction, decode, geometry, is_tq};
use super::{TF1, TF2, TQ1_0, TQ2_0};
use crate::matmul::Gemm;
use crate::ternary::trit;
use core::arch::x86_64::*;

/// The codes of block `b` of rows `a` (low halves) and `bb` (high halves), 32 values per half.
///
/// # Safety
/// This module's features; `a` and `bb` readable for one block of `KIND`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn decode_pair<const KIND: u8>(a: *const u8, bb: *const u8, c: &mut [__m512i; 8]) {
    // SAFETY (whole body): reads inside the two blocks.
    unsafe {
        if KIND == TQ2_0 || KIND == TF2 {
            let three = _mm512_set1_epi8(3);
            let groups = if KIND == TQ2_0 { 2 } else { 1 };
            let off = if KIND == TQ2_0 { 0 } else { 2 };
            for j in 0..groups {
                let lo = _mm256_loadu_si256(a.add(off + 32 * j).cast());
                let hi = _mm256_loadu_si256(bb.add(off + 32 * j).cast());
                let q = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
                c[4 * j] = _mm512_and_si512(q, three);
                c[4 * j + 1] = _mm512_and_si512(_mm512_srli_epi16::<2>(q), three);
                c[4 * j + 2] = _mm512_and_si512(_mm512_srli_epi16::<4>(q), three);
                c[4 * j + 3] = _mm512_and_si512(_mm512_srli_epi16::<6>(q), three);
            }
        } else {
            let mut ca = [_mm256_setzero_si256(); 8];
            let mut cb = [_mm256_setzero_si256(); 8];
            decode::<KIND>(a, &mut ca);
            decode::<KIND>(bb, &mut cb);
            for v in 0..8 {
                c[v] = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(ca[v]), cb[v]);
            }
        }
    }
}

/// A 128-entry byte table, aligned for 512-bit loads: what a 256-entry table of a byte's trits
/// shrinks to by the base-3 bytes' symmetry (see [`Sym`]), with the value its complemented
/// entries are taken from (`full`: every trit at 2).
#[repr(align(64))]
struct Lut {
    t: [u8; 128],
    full: u8,
}

/// `f` of every byte folded to 128 entries: entry `i` is `f(i)` for `i` in 1..128, and entry 0
/// serves byte 128 (whose index `|-128|` keeps only its top bit, which `vpermi2b` ignores),
/// stored complemented as `full - f(128)`. Byte 0 reads entry 1: bytes 0 and 1 both hold five
/// zero trits.
const fn fold(f: [u8; 256], full: u8) -> Lut {
    let mut t = [0u8; 128];
    let mut i = 1;
    while i < 128 {
        t[i] = f[i];
        i += 1;
    }
    t[0] = full - f[128];
    assert!(f[0] == 0 && f[1] == 0);
    Lut { t, full }
}

/// Trits 0..3 of each byte packed two bits each (trit n in bits 2n..2n+2), as TQ2_0 packs
/// codes.
const fn pack4() -> [u8; 256] {
    let mut t = [0u8; 256];
    let mut q = 0;
    while q < 256 {
        let b = q as u8;
        t[q] = trit(b, 0) | trit(b, 1) << 2 | trit(b, 2) << 4 | trit(b, 3) << 6;
        q += 1;
    }
    t
}

/// Trit 4 of each byte.
const fn trit4() -> [u8; 256] {
    let mut t = [0u8; 256];
    let mut q = 0;
    while q < 256 {
        t[q] = trit(q as u8, 4);
        q += 1;
    }
    t
}

/// Trits 0..3 packed: `PACK4[256 - q] = 0xAA - PACK4[q]` (all four trits at 2).
static PACK4: Lut = fold(pack4(), 0xAA);
/// Trit 4: `TRIT4[256 - q] = 2 - TRIT4[q]`.
static TRIT4: Lut = fold(trit4(), 2);

/// A folded table in registers: entries 0..64 and 64..128, and `full` in every byte.
struct Folded {
    regs: [__m512i; 2],
    full: __m512i,
}

/// A table as two registers and its `full` broadcast.
///
/// # Safety
/// AVX-512F available.
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
#[inline]
fn lut_regs(t: &Lut) -> Folded {
    Folded {
        // SAFETY: the table is 128 bytes, 64-byte aligned.
        regs: unsafe {
            core::array::from_fn(|i| _mm512_load_si512(t.t.as_ptr().add(64 * i).cast()))
        },
        full: _mm512_set1_epi8(t.full as i8),
    }
}

/// The bytes of a register as indices into folded 128-entry tables. Every trit of byte
/// `256 - q` is 2 minus the same trit of `q` (for q in 1..256: `q·3^n` and `-q·3^n` are
/// negatives mod 256, and the top-trit map `(y·3) >> 8` sends `y` and `256 - y` to `t` and
/// `2 - t`), so a byte with its top bit set reads entry `-q` (1..128, or 0 for 128) and
/// complements what it finds; byte 0 reads entry 1 (see [`fold`]). One `vpermi2b` and one
/// masked subtraction per table instead of two `vpermi2b` and a blend.
struct Sym {
    /// `max(|q as i8|, 1)`: `q`, or `-q` where the top bit is set, and 1 for 0.
    idx: __m512i,
    /// Bytes with the top bit set (128..256).
    hi: __mmask64,
}

#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
#[inline]
fn sym(x: __m512i) -> Sym {
    Sym {
        idx: _mm512_max_epu8(_mm512_abs_epi8(x), _mm512_set1_epi8(1)),
        hi: top_bits(x),
    }
}

/// The bytes of `x` with the top bit set, by `vptestmb` against `0x80` (port 5 on Intel),
/// written out because the compiler turns the intrinsic form into `vpmovb2m` (port 0, which
/// the field extraction and the activation products crowd).
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
#[inline]
fn top_bits(x: __m512i) -> __mmask64 {
    let k: __mmask64;
    let m = _mm512_set1_epi8(i8::MIN);
    // SAFETY: a register-only instruction of the enabled features.
    unsafe {
        core::arch::asm!(
            "vptestmb {k}, {x}, {m}",
            k = out(kreg) k,
            x = in(zmm_reg) x,
            m = in(zmm_reg) m,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    k
}

/// `f[x]` per byte from `f`'s folded table `t`.
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
#[inline]
fn lut(s: &Sym, t: &Folded) -> __m512i {
    let v = _mm512_permutex2var_epi8(t.regs[0], s.idx, t.regs[1]);
    _mm512_mask_sub_epi8(v, s.hi, t.full, v)
}

/// What the VBMI decoder keeps in registers across a tile's blocks.
struct Tables {
    pack4: Folded,
    trit4: Folded,
    /// TF1: `[0]` gathers trit 4 of qs[j], qs[6 + j], qs[12 + j], qs[18 + j] into dword j
    /// (j < 6) of each half, `[1]` puts byte 4j of each half at position 26 + j.
    /// TQ1_0: `[0]` spreads qs[32..48] and qh of each row into lanes (see `decode_pair_vbmi`).
    idx: [__m512i; 2],
}

/// # Safety
/// The VBMI module features.
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
#[inline]
fn tables<const KIND: u8>() -> Tables {
    let idx = if KIND == TF1 { &TF1_TAIL } else { &TQ1_SPREAD };
    // SAFETY: 64-byte aligned 64-byte rows.
    let idx = core::array::from_fn(|i| unsafe { _mm512_load_si512(idx[i].0.as_ptr().cast()) });
    Tables {
        pack4: lut_regs(&PACK4),
        trit4: lut_regs(&TRIT4),
        idx,
    }
}

/// 64 index bytes, aligned for a 512-bit load.
#[repr(align(64))]
struct Idx([u8; 64]);

/// TF1's tails (see [`Tables::idx`]): chunk n takes trit 4 of qs[6n..6n + 6] at positions
/// 26..32 of each half. `[0]`: byte 4j + n of a half = byte 6n + j (trit 4 of qs[6n + j]);
/// `[1]`: position 26 + j of a half = byte 4j (the four trits packed there, chunk n in bits
/// 2n..2n+2).
static TF1_TAIL: [Idx; 2] = {
    let mut idx = [Idx([0; 64]), Idx([0; 64])];
    let mut h = 0;
    while h < 2 {
        let mut j = 0;
        while j < 6 {
            let mut n = 0;
            while n < 4 {
                idx[0].0[32 * h + 4 * j + n] = (32 * h + 6 * n + j) as u8;
                n += 1;
            }
            idx[1].0[32 * h + 26 + j] = (32 * h + 4 * j) as u8;
            j += 1;
        }
        h += 1;
    }
    idx
};

/// TQ1_0, `[0]`: lane 0 = qs[32..48] of row a (bytes 0..16 of its load), lane 1 = byte i is
/// qh[i % 4] (bytes 16..20); lanes 2, 3 the same for row b (bytes 32..). Unused: `[1]`.
static TQ1_SPREAD: [Idx; 2] = {
    let mut idx = [Idx([0; 64]), Idx([0; 64])];
    let mut i = 0;
    while i < 16 {
        idx[0].0[i] = i as u8;
        idx[0].0[16 + i] = (16 + i % 4) as u8;
        idx[0].0[32 + i] = (32 + i) as u8;
        idx[0].0[48 + i] = (48 + i % 4) as u8;
        i += 1;
    }
    idx
};

/// `x`'s two-bit field `n` of every byte, in its low bits: one GF(2) affine transform per byte
/// (bit 2n of the byte to bit 0, bit 2n + 1 to bit 1), where a shift and a mask take two
/// operations. `matrix` holds one [`field_matrix`] per qword.
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
#[inline]
fn field(x: __m512i, matrix: __m512i) -> __m512i {
    _mm512_gf2p8affine_epi64_epi8::<0>(x, matrix)
}

/// The `vgf2p8affineqb` matrix taking bits 2n, 2n + 1 of a byte to bits 0, 1 (row `7 - k`
/// of the matrix, byte `7 - k` of the qword, selects the source bits of result bit `k`).
const fn field_matrix(n: u32) -> i64 {
    (((1u64 << (2 * n)) << 56) | ((1u64 << (2 * n + 1)) << 48)) as i64
}

/// [`decode_pair`] for the VBMI module: table lookups for TQ1_0 and TF1, the plain decoder
/// for the others. `last`: the rows' last block, where the loads must not run past the block
/// (masked loads; elsewhere plain 32-byte loads may read into the next block, whose bytes
/// land in positions this decoder overwrites or never uses).
///
/// # Safety
/// The VBMI module features; `a` and `bb` readable for one block of `KIND`, and for 6
/// (TF1) or 10 (TQ1_0) bytes more unless `last`.
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
#[inline]
unsafe fn decode_pair_vbmi<const KIND: u8>(
    a: *const u8,
    bb: *const u8,
    c: &mut [__m512i; 8],
    t: &Tables,
    last: bool,
) {
    // Codes of the packed trits 0..3: chunk n + first is trit n.
    let unpack4 = |p: __m512i, c: &mut [__m512i; 8], first: usize| {
        for n in 0..4 {
            c[first + n] = field(p, _mm512_set1_epi64(field_matrix(n as u32)));
        }
    };
    // 32 bytes of each row from `off`: row a in the low half, row b in the high half (only
    // the first `len` bytes of each when `last`, zeros after them).
    let pair_load = |off: usize, len: u32| {
        // SAFETY: the caller's contract (see above).
        unsafe {
            if last {
                let m = (1u64 << len) - 1;
                let x = _mm512_maskz_loadu_epi8(m, a.add(off).cast());
                _mm512_mask_loadu_epi8(x, m << 32, bb.add(off).wrapping_sub(32).cast())
            } else {
                _mm512_inserti64x4::<1>(
                    _mm512_castsi256_si512(_mm256_loadu_si256(a.add(off).cast())),
                    _mm256_loadu_si256(bb.add(off).cast()),
                )
            }
        }
    };
    // SAFETY (whole body): reads as the contract allows.
    unsafe {
        match KIND {
            TF1 => {
                // qs[0..26] of row a in bytes 0..26, of row b in bytes 32..58; bytes 26..32 of
                // each half (the next block, or zeros) give codes that are replaced below.
                let x = pair_load(2, 26);
                let s = sym(x);
                let p = lut(&s, &t.pack4);
                // Positions 26..32 of each half: trit 4 of qs[6n + j] in field n of byte
                // 26 + j, so that the field extraction places every chunk's tail: the four
                // trits gathered into a dword, packed by one `vpdpbusd` against 1, 4, 16, 64
                // (at most 170: the low byte), and moved to their positions.
                let t4 = _mm512_permutexvar_epi8(t.idx[0], lut(&s, &t.trit4));
                let packed =
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), t4, _mm512_set1_epi32(0x4010_0401));
                let tail = (0x3Fu64 << 26) | (0x3Fu64 << 58);
                unpack4(permb_merge(p, tail, t.idx[1], packed), c, 0);
            }
            TQ1_0 => {
                // qs[0..32]: values m + 32n are trit n of qs[m] (n = 0..4).
                let x = pair_load(0, 32);
                let s = sym(x);
                unpack4(lut(&s, &t.pack4), c, 0);
                c[4] = lut(&s, &t.trit4);
                // qs[32..48] (values 160 + m + 16n) and qh (values 240 + j + 4n) of each row:
                // y = [qs_a[32..48] | qh_a spread | qs_b[32..48] | qh_b spread] by lanes.
                let z = pair_load(32, 20);
                let y = _mm512_permutexvar_epi8(t.idx[0], z);
                let sy = sym(y);
                let py = lut(&sy, &t.pack4);
                // Lanes [0, 0, 2, 2]: chunk 5 = [trit 0 | trit 1] of qs[32..48], chunk 6 =
                // [trit 2 | trit 3] per row (a field per qword: one matrix per lane).
                let pr = _mm512_shuffle_i64x2::<0b1010_0000>(py, py);
                let (f0, f1, f2, f3) = (
                    field_matrix(0),
                    field_matrix(1),
                    field_matrix(2),
                    field_matrix(3),
                );
                c[5] = field(pr, _mm512_set_epi64(f1, f1, f0, f0, f1, f1, f0, f0));
                c[6] = field(pr, _mm512_set_epi64(f3, f3, f2, f2, f3, f3, f2, f2));
                // Chunk 7 = [trit 4 of qs[32..48] | byte i = trit i / 4 of qh[i % 4]].
                let h = _mm512_and_si512(
                    _mm512_srlv_epi32(
                        py,
                        _mm512_set_epi32(6, 4, 2, 0, 0, 0, 0, 0, 6, 4, 2, 0, 0, 0, 0, 0),
                    ),
                    _mm512_set1_epi8(3),
                );
                c[7] = _mm512_mask_blend_epi64(0b1100_1100, lut(&sy, &t.trit4), h);
            }
            _ => decode_pair::<KIND>(a, bb, c),
        }
    }
}

/// The f16 scales at `a` and `b` as f32: `a` in the low eight lanes, `b` in the high eight.
/// Each is converted from an 8-byte load that ends at (TQ kinds, scale last) or starts at
/// (TF kinds, scale first) the scale, inside the block, and one two-source permute spreads
/// them (in place of a broadcast per f16 and an insert).
///
/// # Safety
/// This module's features; `a` and `b` point at the scales of two blocks of `KIND`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn pair_scales<const KIND: u8>(a: *const u8, b: *const u8) -> __m512 {
    let (back, lane) = if is_tq(KIND) { (6, 3) } else { (0, 0) };
    // SAFETY: the 8 bytes lie inside each block (the scale and the 6 bytes beside it).
    let (fa, fb) = unsafe {
        (
            _mm_cvtph_ps(_mm_loadl_epi64(a.sub(back).cast())),
            _mm_cvtph_ps(_mm_loadl_epi64(b.sub(back).cast())),
        )
    };
    _mm512_permutex2var_ps(
        _mm512_castps128_ps512(fa),
        _mm512_set_epi32(
            16 + lane,
            16 + lane,
            16 + lane,
            16 + lane,
            16 + lane,
            16 + lane,
            16 + lane,
            16 + lane,
            lane,
            lane,
            lane,
            lane,
            lane,
            lane,
            lane,
            lane,
        ),
        _mm512_castps128_ps512(fb),
    )
}

/// `vpermb` merged under a mask: byte i is `table[idx[i]]` where `k` is set, else `src[i]`.
/// Written out because the compiler turns the intrinsic form into a two-source `vpermt2b`,
/// twice the shuffle-port time on the CPUs measured.
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
#[inline]
fn permb_merge(src: __m512i, k: __mmask64, idx: __m512i, table: __m512i) -> __m512i {
    let mut dst = src;
    // SAFETY: a register-only instruction of the enabled features.
    unsafe {
        core::arch::asm!(
            "vpermb {dst}{{{k}}}, {idx}, {tab}",
            dst = inout(zmm_reg) dst,
            k = in(kreg) k,
            idx = in(zmm_reg) idx,
            tab = in(zmm_reg) table,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    dst
}

/// Whether the table decoder runs (TQ1_0 or TF1 on a CPU with AVX512-VBMI and GFNI; tests can
/// turn it off per thread to check the plain decoder on the same CPU).
fn use_vbmi<const KIND: u8>() -> bool {
    #[cfg(test)]
    if PLAIN.with(|p| p.get()) {
        return false;
    }
    (KIND == TQ1_0 || KIND == TF1) && super::has_vbmi_gfni()
}

#[cfg(test)]
std::thread_local! {
    static PLAIN: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with the VBMI decoder off on this thread (the test of the plain decoder).
#[cfg(test)]
pub(crate) fn without_vbmi<R>(f: impl FnOnce() -> R) -> R {
    let before = PLAIN.with(|p| p.replace(true));
    let r = f();
    PLAIN.with(|p| p.set(before));
    r
}

/// Whether this CPU runs the table decoder (the test says when it could only check one).
#[cfg(test)]
pub(crate) fn has_table_decoder() -> bool {
    super::has_vbmi_gfni()
}

/// Every tile width sums a (row, token) in the same order (the module's), so the result does
/// not depend on the batch and `Numerics` changes nothing. Tokens run in blocks whose
/// activations stay in L2 while the rows stream past; per row pair, tiles of four or eight
/// tokens and one narrower tile for the rest, so the pair's blocks are decoded once per tile
/// and read from memory once per block (once per call for a decode batch).
///
/// # Safety
/// The CPU has this module's features; `g` comes from `Gemm::new` with `out.len() ==
/// g.ntok * g.nrows` and `g.wty` of kind `KIND`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn run_tern<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) {
    if use_vbmi::<KIND>() {
        // SAFETY: the CPU has AVX512-VBMI and GFNI (checked just above) and this module's
        // features.
        unsafe { run_vbmi::<KIND>(g, out) }
    } else {
        // SAFETY: this function's contract.
        unsafe { run_plain::<KIND>(g, out) }
    }
}

/// Defines a driver and its tile over one pair decoder: the same loops for both decoders, each
/// compiled with its decoder's features so the decoder inlines.
macro_rules! tern_driver {
    ($run:ident, $tile:ident, $features:literal, $tables:expr, $decode:expr) => {
        /// The driver of [`run_tern`] for one decoder.
        ///
        /// # Safety
        /// As [`run_tern`], and the CPU has this function's features.
        #[target_feature(enable = $features)]
        unsafe fn $run<const KIND: u8>(g: &Gemm<'_>, out: &mut [f32]) {
            // Tokens per tile: eight where decoding the weights costs more than the products
            // (TQ1_0 and TF1's base-3 digits), else four (more would spill registers).
            let wide = if KIND == TQ2_0 || KIND == TF2 { 4 } else { 8 };
            let tb = g.token_block(super::TOKEN_BLOCK_BYTES, 8);
            let mut t0 = 0;
            while t0 < g.ntok {
                let t1 = (t0 + tb).min(g.ntok);
                let mut r = 0;
                while r < g.nrows {
                    // One token: two row pairs per tile, the token's activations, correction
                    // and scale read once for four rows (AMD Zen 4, 2048 x 5632, one thread:
                    // TQ2_0, TF2 and TF1 (not repacked) 11 % less time, TQ1_0 2.5 %).
                    if t1 - t0 == 1 && g.nrows - r >= 4 {
                        // SAFETY: r + 3 < nrows, t0 < ntok; the caller has the features.
                        unsafe { $tile::<KIND, 1, 2>(g, r, true, t0, out) };
                        r += 4;
                        continue;
                    }
                    let pair = g.nrows - r >= 2;
                    let mut t = t0;
                    while t1 - t >= wide {
                        // SAFETY: r (+1 when `pair`) < nrows, t + wide <= ntok; the caller
                        // has the features.
                        unsafe {
                            if wide == 8 {
                                $tile::<KIND, 8, 1>(g, r, pair, t, out)
                            } else {
                                $tile::<KIND, 4, 1>(g, r, pair, t, out)
                            }
                        };
                        t += wide;
                    }
                    // SAFETY: as above with the `t1 - t` (< 8) tokens left.
                    unsafe {
                        match t1 - t {
                            0 => {}
                            1 => $tile::<KIND, 1, 1>(g, r, pair, t, out),
                            2 => $tile::<KIND, 2, 1>(g, r, pair, t, out),
                            3 => $tile::<KIND, 3, 1>(g, r, pair, t, out),
                            4 => $tile::<KIND, 4, 1>(g, r, pair, t, out),
                            5 => $tile::<KIND, 5, 1>(g, r, pair, t, out),
                            6 => $tile::<KIND, 6, 1>(g, r, pair, t, out),
                            _ => $tile::<KIND, 7, 1>(g, r, pair, t, out),
                        }
                    }
                    r += if pair { 2 } else { 1 };
                }
                t0 = t1;
            }
        }

        /// `P` row pairs from row `r` (rows `r + 2p` and `r + 2p + 1`; the last pair's second
        /// row is its first again when `!pair`, the high half then discarded) against tokens
        /// `t0..t0+T`. Each token's activations, correction and scale are read once for every
        /// pair; each row's sums are the same whatever `P` and `T`.
        ///
        /// # Safety
        /// As the driver, with `r + 2P - 2 + pair < g.nrows` and `t0 + T <= g.ntok`.
        #[target_feature(enable = $features)]
        unsafe fn $tile<const KIND: u8, const T: usize, const P: usize>(
            g: &Gemm<'_>,
            r: usize,
            pair: bool,
            t0: usize,
            out: &mut [f32],
        ) {
            let (bv, wb, ab, dpos) = geometry(KIND);
            let nb = g.cols / bv;
            let nch = bv / 32;
            let two = |p: usize| pair || p + 1 < P;
            let w: [[*const u8; 2]; P] = core::array::from_fn(|p| {
                let r0 = r + 2 * p;
                [
                    g.w_row(r0).as_ptr(),
                    g.w_row(if two(p) { r0 + 1 } else { r0 }).as_ptr(),
                ]
            });
            let mut acc = [[_mm512_setzero_ps(); T]; P];
            let mut c = [[_mm512_setzero_si512(); 8]; P];
            #[allow(clippy::let_unit_value)]
            let tables = $tables;
            // SAFETY (whole body): block `b < nb` of a row / activation row lies inside it, as
            // `Gemm::new` checked the sizes.
            unsafe {
                for b in 0..nb {
                    let mut dw = [_mm512_setzero_ps(); P];
                    for p in 0..P {
                        let (xa, xb) = (w[p][0].add(b * wb), w[p][1].add(b * wb));
                        $decode(xa, xb, &mut c[p], &tables, b + 1 == nb);
                        dw[p] = pair_scales::<KIND>(xa.add(dpos), xb.add(dpos));
                    }
                    for t in 0..T {
                        let y = g.act_row(t0 + t).as_ptr().add(b * ab);
                        // The products summed onto minus the correction (exact integers).
                        let neg = _mm512_sub_epi32(
                            _mm512_setzero_si512(),
                            _mm512_broadcast_i64x4(correction::<KIND>(y)),
                        );
                        let mut a = [_mm512_setzero_si512(); 8];
                        for (v, a) in a.iter_mut().enumerate().take(nch) {
                            *a = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                                y.add(4 + 32 * v).cast(),
                            ));
                        }
                        let ys = _mm512_set1_ps(y.cast::<f32>().read_unaligned());
                        for p in 0..P {
                            let mut s = neg;
                            for v in 0..nch {
                                s = _mm512_dpbusd_epi32(s, c[p][v], a[v]);
                            }
                            let d = if is_tq(KIND) {
                                _mm512_mul_ps(dw[p], ys)
                            } else {
                                dw[p]
                            };
                            acc[p][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), d, acc[p][t]);
                        }
                    }
                }
                for t in 0..T {
                    let a = g.act_row(t0 + t);
                    let scale = if !is_tq(KIND) && nb > 0 {
                        a.as_ptr().cast::<f32>().read_unaligned()
                    } else {
                        1.0
                    };
                    for (p, acc) in acc.iter().enumerate() {
                        let lo = super::avx2::hsum(_mm512_castps512_ps256(acc[t]));
                        let hi = super::avx2::hsum(_mm512_extractf32x8_ps::<1>(acc[t]));
                        let base = (t0 + t) * g.nrows + r + 2 * p;
                        out[base] = if is_tq(KIND) { lo } else { lo * scale };
                        if two(p) {
                            out[base + 1] = if is_tq(KIND) { hi } else { hi * scale };
                        }
                    }
                }
            }
        }
    };
}

tern_driver!(
    run_plain,
    tile_plain,
    "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
    (),
    |xa, xb, c, _: &(), _| decode_pair::<KIND>(xa, xb, c)
);

tern_driver!(
    run_vbmi,
    tile_vbmi,
    "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c",
    tables::<KIND>(),
    |xa, xb, c, t: &Tables, last| decode_pair_vbmi::<KIND>(xa, xb, c, t, last)
);

#[cfg(test)]
mod tests {
    use super::*;

    /// The folded tables, read as [`Sym`] and [`lut`] read them (the index `max(|q as i8|, 1)`
    /// in its low seven bits, complemented where the top bit is set), give every byte's trits:
    /// on any CPU, beside the SIMD tests that need AVX512-VBMI.
    #[test]
    fn folded_tables_give_every_byte() {
        for (want, folded) in [(pack4(), &PACK4), (trit4(), &TRIT4)] {
            for q in 0..=255u8 {
                let idx = (q as i8).unsigned_abs().max(1) & 0x7F;
                let v = folded.t[idx as usize];
                let got = if q >= 128 { folded.full - v } else { v };
                assert_eq!(got, want[q as usize], "byte {q}");
            }
        }
    }
}
