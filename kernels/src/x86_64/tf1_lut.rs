//! TF1 repacked: a one-token GEMV by activation tables (T-MAC style) and a multi-token GEMM,
//! AVX-512 VBMI/VNNI, bit-identical to `crate::ternary::vec_dot_tf`.
//!
//! TF1's float order needs, per row and 128-block, eight exact lane sums
//! `lane_k = Σ q_e·a_e` over the 16 values `e = 32v + 4k + j` (v, j in 0..4). These kernels read
//! a repacked copy of the weights ([`pack`], as many bytes as TF1) whose bytes are *lane-pure*:
//! each lane's 16 trits are three groups of five plus one leftover, and each group is one byte
//! holding its base-3 number `n = Σ c_i·3^i` folded by the trits' symmetry (`n` and `242 − n`
//! are each other's negation): a 7-bit index `min(n, 242 − n)` and the sign in bit 7 (which
//! `vpermi2b` ignores). 64 rows are interleaved.
//!
//! GEMV: per token and (block, lane, group) a table holds `4·T` for the 122 signed sums
//! `T = Σ (c_i − 1)·a_i` of that group's five activations ([`build_tables`]), as a low-byte and
//! a high-byte plane of 128 entries; one `vpermi2b` per plane looks up a position of 64 rows.
//! A negated row's two bytes are complemented (`−4·T − 1`), the planes joined into words and
//! the three positions added to 3, so an arithmetic shift by two floors to the exact sum; the
//! leftover trit adds or subtracts its activation under two masks.
//!
//! GEMM: the codes come back from the indices through two 128-entry tables (trits 0..3 packed
//! two bits each, trit 4), complemented for negated rows, are 4 × 4-byte transposed so each
//! dword holds four values of one row, and `vpdpbusd` takes each token's four activations
//! broadcast; the Q8_TF lane sums turn the codes `c` into `q = c − 1`.
//!
//! Either way the lane sums are the scalar reference's integers, converted and fused with the
//! row scales in the same order, so every output bit is the same.
//!
//! Group layout: one record of 1,792 bytes per block (28 a row, as TF1), read in order:
//! - `idx[k][g][64]`: the folded indices (bit 7 the sign), byte position [`slot`]`(r).0` for
//!   row `r`;
//! - `masks[k][2]` u64: the leftover's `+1` and `−1`, bit [`slot`]`(r).1` for row `r`;
//! - `d[64]` f16: the rows' block scales in row order.
//!
//! The rows sit in the byte positions that make `vpunpck{l,h}bw` of the two planes give rows
//! 0..32 and 32..64 as words, `word 2l` / `word 2l + 1` of the first being rows `l` and `16 + l`
//! (the even and odd words widen to i32 apart, rows 0..16 and 16..32), so the GEMV's f32
//! accumulators come out in row order; the GEMM's in the order [`gemm_rows`] gives.

// Register arrays of the same lanes are indexed by one counter.
#![allow(clippy::needless_range_loop)]

use crate::ternary::{tf1_slot, trit};
use core::arch::x86_64::*;

/// Rows per interleaved group.
pub(crate) const GROUP: usize = 64;
/// Table bytes per (lane, block) of a token: three groups' planes and the leftover's
/// activation broadcast to 32 words.
pub(crate) const LANE_TABLES: usize = 3 * 256 + 64;
/// Group bytes per block.
pub(crate) const GROUP_BLOCK: usize = 8 * (3 * GROUP + 2 * 8) + 2 * GROUP;

/// The block element of lane `k`'s value `i` (0..16).
#[inline(always)]
const fn elem(k: usize, i: usize) -> usize {
    32 * (i / 4) + 4 * k + i % 4
}

/// Row `r` of a group: its byte position in an index vector and its bit in a mask.
#[inline(always)]
pub(crate) fn slot(r: usize) -> (usize, usize) {
    let (vec, lane) = (r / 16, r % 16);
    let (w, j) = (vec / 2, 2 * lane + vec % 2);
    (16 * (j / 8) + 8 * w + j % 8, 32 * w + j)
}

/// Offset of the masks and of the scales in a block record.
const MASKS_AT: usize = 8 * 3 * GROUP;
const D_AT: usize = MASKS_AT + 8 * 2 * 8;

/// `(byte, trit)` of each repacked byte's five digits, and of each lane's leftover.
type Sources = ([[(u8, u8); 5]; 24], [(u8, u8); 8]);

/// Where the five trits of each repacked byte `(k, g)` (digit `i` = lane value `5g + i`) and
/// each lane's leftover (value 15) sit in a TF1 block's 26 base-3 bytes: `(byte, trit)`.
const fn sources() -> Sources {
    const fn slot_of(k: usize, i: usize) -> (u8, u8) {
        let (b, t) = tf1_slot(elem(k, i));
        (b as u8, t as u8)
    }
    let mut src = [[(0u8, 0u8); 5]; 24];
    let mut left = [(0u8, 0u8); 8];
    let mut k = 0;
    while k < 8 {
        let mut p = 0;
        while p < 15 {
            src[k * 3 + p / 5][p % 5] = slot_of(k, p);
            p += 1;
        }
        left[k] = slot_of(k, 15);
        k += 1;
    }
    (src, left)
}

const SOURCES: Sources = sources();

/// A byte's base-3 number folded: `n` up to 121, else `242 − n` with bit 7 set.
static FOLD: [u8; 243] = {
    let mut t = [0u8; 243];
    let mut n = 0;
    while n < 243 {
        t[n] = if n <= 121 {
            n as u8
        } else {
            (242 - n) as u8 | 0x80
        };
        n += 1;
    }
    t
};

/// `3^j · trit(q, t)`, digit `j` of a repacked byte when it is trit `t` of TF1 byte `q`:
/// `[j][t][q]` (the five digits of a byte sum to at most 242).
static DIGIT: [[[u8; 256]; 5]; 5] = {
    let mut d = [[[0u8; 256]; 5]; 5];
    let mut j = 0;
    let mut w = 1u8;
    while j < 5 {
        let mut t = 0;
        while t < 5 {
            let mut q = 0;
            while q < 256 {
                d[j][t][q] = w * trit(q as u8, t);
                q += 1;
            }
            t += 1;
        }
        j += 1;
        w = w.wrapping_mul(3);
    }
    d
};

/// Repacks `rows` TF1 rows of `nb` blocks (`row(r)` gives row `r`'s bytes) into groups of 64 in
/// `out` (zeroed, `rows.div_ceil(64) * nb * GROUP_BLOCK` bytes), the last group padded with zero
/// rows (codes 1, `d = 0`), each digit a lookup in [`DIGIT`].
pub(crate) fn pack<'a>(rows: usize, nb: usize, row: impl Fn(usize) -> &'a [u8], out: &mut [u8]) {
    let groups = rows.div_ceil(GROUP);
    assert_eq!(out.len(), groups * nb * GROUP_BLOCK, "repacked TF1 size");
    for (gi, g) in out.chunks_exact_mut(nb * GROUP_BLOCK).enumerate() {
        pack_group(rows, nb, &row, gi, g);
    }
}

/// Group `gi` of [`pack`] into `g` (its `nb` block records).
fn pack_group<'a>(
    rows: usize,
    nb: usize,
    row: &impl Fn(usize) -> &'a [u8],
    gi: usize,
    g: &mut [u8],
) {
    let (src, left) = &SOURCES;
    let mut masks = vec![[0u64; 16]; nb];
    for r in 0..GROUP {
        let (byte, bit) = slot(r);
        let Some(x) = (gi * GROUP + r < rows).then(|| row(gi * GROUP + r)) else {
            for rec in g.chunks_exact_mut(GROUP_BLOCK) {
                for p in 0..24 {
                    rec[p * GROUP + byte] = FOLD[121];
                }
                rec[D_AT + 2 * r..][..2].fill(0);
            }
            continue;
        };
        for ((rec, x), m) in g
            .chunks_exact_mut(GROUP_BLOCK)
            .zip(x.chunks_exact(28))
            .zip(masks.iter_mut())
        {
            let qs: &[u8; 26] = x[2..28].try_into().expect("26 bytes");
            let digit =
                |j: usize, &(b, t): &(u8, u8)| DIGIT[j][t as usize][qs[b as usize] as usize];
            for p in 0..24 {
                let s = &src[p];
                let n = digit(0, &s[0])
                    + digit(1, &s[1])
                    + digit(2, &s[2])
                    + digit(3, &s[3])
                    + digit(4, &s[4]);
                rec[p * GROUP + byte] = FOLD[n as usize];
            }
            for (k, &(b, t)) in left.iter().enumerate() {
                let c = trit(qs[b as usize], t as usize);
                m[2 * k] |= ((c == 2) as u64) << bit;
                m[2 * k + 1] |= ((c == 0) as u64) << bit;
            }
            rec[D_AT + 2 * r..][..2].copy_from_slice(&x[0..2]);
        }
    }
    for (rec, m) in g.chunks_exact_mut(GROUP_BLOCK).zip(&masks) {
        for (o, v) in rec[MASKS_AT..D_AT].chunks_exact_mut(8).zip(m) {
            o.copy_from_slice(&v.to_le_bytes());
        }
    }
}

/// Digit `i` of `n` in base 3.
const fn digit(n: usize, i: usize) -> u8 {
    let mut n = n;
    let mut j = 0;
    while j < i {
        n /= 3;
        j += 1;
    }
    (n % 3) as u8
}

/// For table entries `n = 0..128` as words (four registers of 32), the byte pairs
/// `(digit(n, 2p), digit(n, 2p + 1))` for `p = 0, 1, 2` (digit 5 is 0): `[p][n]`.
const fn digit_pairs() -> [[[u8; 2]; 128]; 3] {
    let mut t = [[[0u8; 2]; 128]; 3];
    let mut p = 0;
    while p < 3 {
        let mut n = 0;
        while n < 128 {
            t[p][n][0] = digit(n, 2 * p);
            t[p][n][1] = if 2 * p + 1 < 5 {
                digit(n, 2 * p + 1)
            } else {
                0
            };
            n += 1;
        }
        p += 1;
    }
    t
}

#[repr(align(64))]
struct Aligned<T>(T);

static PAIRS: Aligned<[[[u8; 2]; 128]; 3]> = Aligned(digit_pairs());

/// Builds the tables of a token's blocks `blocks` (`[b - blocks.start][k]`, `LANE_TABLES`
/// bytes each) from its Q8_TF row.
///
/// # Safety
/// AVX-512 F/BW/VBMI; `act` holds `blocks.end` Q8_TF blocks and `out` `blocks.len() * 8 *
/// LANE_TABLES` bytes, 64-byte aligned.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
unsafe fn build_tables(act: &[u8], blocks: core::ops::Range<usize>, out: &mut [u8]) {
    debug_assert!(act.len() >= blocks.end * 164 && out.len() >= blocks.len() * 8 * LANE_TABLES);
    // SAFETY (whole body): reads of PAIRS' 768 bytes and of `act`'s blocks, aligned stores
    // inside `out` (64-byte aligned, LANE_TABLES a multiple of 64).
    unsafe {
        let pairs = PAIRS.0.as_ptr().cast::<u8>();
        let mut c = [[_mm512_setzero_si512(); 4]; 3];
        for (p, cp) in c.iter_mut().enumerate() {
            for (z, v) in cp.iter_mut().enumerate() {
                *v = _mm512_load_si512(pairs.add(p * 256 + z * 64).cast());
            }
        }
        let even = _mm512_set_epi64(
            0x7E7C7A7876747270,
            0x6E6C6A6866646260,
            0x5E5C5A5856545250,
            0x4E4C4A4846444240,
            0x3E3C3A3836343230,
            0x2E2C2A2826242220,
            0x1E1C1A1816141210,
            0x0E0C0A0806040200,
        );
        let odd = _mm512_add_epi8(even, _mm512_set1_epi8(1));
        for b in blocks.clone() {
            let a = &act[b * 164 + 4..b * 164 + 4 + 128];
            for k in 0..8 {
                let la: [i8; 16] = core::array::from_fn(|i| a[elem(k, i)] as i8);
                let base = out
                    .as_mut_ptr()
                    .add(((b - blocks.start) * 8 + k) * LANE_TABLES);
                for g in 0..3 {
                    let v = &la[5 * g..5 * g + 5];
                    let pair = |x: i8, y: i8| (x as u8 as u16 | (y as u8 as u16) << 8) as i16;
                    let ap = [
                        _mm512_set1_epi16(pair(v[0], v[1])),
                        _mm512_set1_epi16(pair(v[2], v[3])),
                        _mm512_set1_epi16(pair(v[4], 0)),
                    ];
                    let s = _mm512_set1_epi16(v.iter().map(|&x| x as i16).sum());
                    let t: [__m512i; 4] = core::array::from_fn(|z| {
                        let p0 = _mm512_maddubs_epi16(c[0][z], ap[0]);
                        let p1 = _mm512_maddubs_epi16(c[1][z], ap[1]);
                        let p2 = _mm512_maddubs_epi16(c[2][z], ap[2]);
                        let t = _mm512_sub_epi16(_mm512_add_epi16(_mm512_add_epi16(p0, p1), p2), s);
                        _mm512_slli_epi16::<2>(t)
                    });
                    let o = base.add(g * 256);
                    _mm512_store_si512(o.cast(), _mm512_permutex2var_epi8(t[0], even, t[1]));
                    _mm512_store_si512(
                        o.add(64).cast(),
                        _mm512_permutex2var_epi8(t[2], even, t[3]),
                    );
                    _mm512_store_si512(
                        o.add(128).cast(),
                        _mm512_permutex2var_epi8(t[0], odd, t[1]),
                    );
                    _mm512_store_si512(
                        o.add(192).cast(),
                        _mm512_permutex2var_epi8(t[2], odd, t[3]),
                    );
                }
                _mm512_store_si512(base.add(768).cast(), _mm512_set1_epi16(la[15] as i16));
            }
        }
    }
}

/// Register `v`'s 16 outputs from the eight lane accumulators: `hsum8` of the lanes in
/// `scalar::hsum8`'s order, times the token's activation scale `ad`.
///
/// # Safety
/// AVX-512 F.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn rows_out(lacc: &[[__m512; 4]; 8], v: usize, ad: f32) -> __m512 {
    let s0 = _mm512_add_ps(lacc[0][v], lacc[4][v]);
    let s1 = _mm512_add_ps(lacc[1][v], lacc[5][v]);
    let s2 = _mm512_add_ps(lacc[2][v], lacc[6][v]);
    let s3 = _mm512_add_ps(lacc[3][v], lacc[7][v]);
    let r = _mm512_add_ps(_mm512_add_ps(s0, s2), _mm512_add_ps(s1, s3));
    _mm512_mul_ps(r, _mm512_set1_ps(ad))
}

/// One group's eight lane accumulators of 64 rows (four registers of 16 rows per lane).
type Acc = [[__m512; 4]; 8];

/// Blocks of one pass of [`gemv_groups`] over a matrix of more than twice as many: their
/// tables (6.5 KiB a block) stay in L2 while every group of a batch runs over them. Measured on
/// AMD Zen 4 (1 MiB L2, session 39): 14336 columns (112 blocks, 728 KiB of tables) 6-7 %
/// faster in passes of 32 or 16 blocks than in one; 5632 columns (44 blocks) 2-3 % slower in
/// passes than in one.
pub(crate) const GEMV_CHUNK: usize = 32;

/// Groups that share each pass of [`gemv_groups`] over a chunk of blocks (their accumulators,
/// 2 KiB each, on the stack).
pub(crate) const GEMV_BATCH: usize = 16;

/// Groups `g0..g0 + ys.len()` of `data` (groups of `nb` blocks): `ys[i][r] = hsum8(acc[r]) ·
/// ad` in row order. Blocks run in chunks of `chunk`, every group of the batch over one
/// chunk before the next chunk, so a wide matrix's tables are read from near caches; each
/// row still adds its blocks in order, so the outputs do not depend on `chunk`.
///
/// # Safety
/// AVX-512 F/BW/VBMI; `data` holds the groups (64-byte aligned), `parts` the token's tables
/// from [`build_tables`] (64-byte aligned), each with the blocks it covers, in order and
/// together every block; `chunk > 0`; `ys.len() <= GEMV_BATCH`.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,f16c,fma")]
unsafe fn gemv_groups(
    data: &[u8],
    nb: usize,
    parts: &[(&[u8], core::ops::Range<usize>)],
    ad: f32,
    g0: usize,
    chunk: usize,
    ys: &mut [[f32; GROUP]],
) {
    let gb = nb * GROUP_BLOCK;
    debug_assert!(data.len() >= (g0 + ys.len()) * gb && ys.len() <= GEMV_BATCH && chunk > 0);
    let mut accs = [[[_mm512_setzero_ps(); 4]; 8]; GEMV_BATCH];
    let mut c0 = 0;
    while c0 < nb {
        let blocks = c0..(c0 + chunk).min(nb);
        for (i, acc) in accs[..ys.len()].iter_mut().enumerate() {
            // SAFETY: group g0 + i lies inside `data` (checked by the caller).
            unsafe { gemv_blocks(data.as_ptr().add((g0 + i) * gb), parts, blocks.clone(), acc) };
        }
        c0 = blocks.end;
    }
    for (y, acc) in ys.iter_mut().zip(&accs) {
        for v in 0..4 {
            // SAFETY: `y` holds 64 floats.
            unsafe { _mm512_storeu_ps(y.as_mut_ptr().add(16 * v), rows_out(acc, v, ad)) };
        }
    }
}

/// Adds blocks `blocks` of the group at `grp` to its lane accumulators.
///
/// # Safety
/// As [`gemv_groups`]; `grp` points to a whole group of the blocks `parts` cover.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,f16c,fma")]
#[inline]
unsafe fn gemv_blocks(
    grp: *const u8,
    parts: &[(&[u8], core::ops::Range<usize>)],
    blocks: core::ops::Range<usize>,
    lacc: &mut Acc,
) {
    // SAFETY (whole body): every pointer below stays inside the group or a part's tables by
    // the layout sizes the caller checked.
    unsafe {
        let (three, ones) = (_mm512_set1_epi16(3), _mm512_set1_epi8(-1));
        let even = _mm512_set1_epi32(1);
        for (b, tb) in parts.iter().flat_map(|(t, r)| {
            (r.start.max(blocks.start)..r.end.min(blocks.end))
                .map(move |b| (b, t.as_ptr().add((b - r.start) * 8 * LANE_TABLES)))
        }) {
            let rec = grp.add(b * GROUP_BLOCK);
            let m = rec.add(MASKS_AT).cast::<u32>();
            let dp = rec.add(D_AT);
            let dv: [__m512; 4] =
                core::array::from_fn(|v| _mm512_cvtph_ps(_mm256_load_si256(dp.add(32 * v).cast())));
            for (k, acc) in lacc.iter_mut().enumerate() {
                let t = tb.add(k * LANE_TABLES);
                let ix = rec.add(k * 3 * GROUP);
                let m = m.add(k * 4);
                // Three positions of 4·T (negated ones complemented: −4·T − 1) and 3, so that
                // the shift by two below floors to the exact sum.
                let mut lo = three;
                let mut hi = three;
                for g in 0..3 {
                    let i = _mm512_load_si512(ix.add(g * GROUP).cast());
                    let neg = _mm512_movepi8_mask(i);
                    let tg = t.add(g * 256);
                    let l = _mm512_permutex2var_epi8(
                        _mm512_load_si512(tg.cast()),
                        i,
                        _mm512_load_si512(tg.add(64).cast()),
                    );
                    let h = _mm512_permutex2var_epi8(
                        _mm512_load_si512(tg.add(128).cast()),
                        i,
                        _mm512_load_si512(tg.add(192).cast()),
                    );
                    let l = _mm512_mask_sub_epi8(l, neg, ones, l);
                    let h = _mm512_mask_sub_epi8(h, neg, ones, h);
                    lo = _mm512_add_epi16(lo, _mm512_unpacklo_epi8(l, h));
                    hi = _mm512_add_epi16(hi, _mm512_unpackhi_epi8(l, h));
                }
                lo = _mm512_srai_epi16::<2>(lo);
                hi = _mm512_srai_epi16::<2>(hi);
                let a15 = _mm512_load_si512(t.add(768).cast());
                lo = _mm512_mask_add_epi16(lo, m.add(0).read_unaligned(), lo, a15);
                hi = _mm512_mask_add_epi16(hi, m.add(1).read_unaligned(), hi, a15);
                lo = _mm512_mask_sub_epi16(lo, m.add(2).read_unaligned(), lo, a15);
                hi = _mm512_mask_sub_epi16(hi, m.add(3).read_unaligned(), hi, a15);
                // Even words sign-extended by a multiply-add with (1, 0), odd ones by a shift.
                let lanes = [
                    _mm512_madd_epi16(lo, even),
                    _mm512_srai_epi32::<16>(lo),
                    _mm512_madd_epi16(hi, even),
                    _mm512_srai_epi32::<16>(hi),
                ];
                for v in 0..4 {
                    acc[v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes[v]), dv[v], acc[v]);
                }
            }
        }
    }
}

/// Trits 0..3 of a folded index packed two bits each (trit `n` in bits `2n..2n+2`), and trit 4:
/// `[0]` and `[1]`, 128 entries each.
const fn code_tables() -> [[u8; 128]; 2] {
    let mut t = [[0u8; 128]; 2];
    let mut n = 0;
    while n < 128 {
        t[0][n] = digit(n, 0) | digit(n, 1) << 2 | digit(n, 2) << 4 | digit(n, 3) << 6;
        t[1][n] = digit(n, 4);
        n += 1;
    }
    t
}

static CODES: Aligned<[[u8; 128]; 2]> = Aligned(code_tables());

/// The GEMM's output slot `16v + l` (dword `l` of product register `v`) → row of the group.
const fn gemm_rows() -> [u8; GROUP] {
    let mut out = [0u8; GROUP];
    let mut s = 0;
    while s < GROUP {
        let (v, l) = (s / 16, s % 16);
        // The 4x4 byte transpose puts byte position 16L + 4v + d in dword 4L + d of register v.
        let p = 16 * (l / 4) + 4 * v + l % 4;
        let (lane128, t) = (p / 16, p % 16);
        let (w, j) = (t / 8, 8 * lane128 + t % 8);
        out[s] = (16 * (2 * w + j % 2) + j / 2) as u8;
        s += 1;
    }
    out
}

static GEMM_ROWS: Aligned<[u8; GROUP]> = Aligned(gemm_rows());
/// As words, for the scale permutation.
static GEMM_ROWS16: Aligned<[u16; GROUP]> = Aligned({
    let mut w = [0u16; GROUP];
    let mut s = 0;
    while s < GROUP {
        w[s] = gemm_rows()[s] as u16;
        s += 1;
    }
    w
});

/// Tokens per pass over a group in [`gemm_group`] (their accumulators, 8 KiB each, stay in L1
/// and L2; the group's codes are decoded once per pass).
pub(crate) const GEMM_TOKENS: usize = 16;

/// One group's 64 rows for `ntok` tokens (`ntok <= GEMM_TOKENS`): `y[t * 64 + r]`, from the
/// codes decoded out of the folded indices (bit 7 the sign, the leftover from its masks),
/// 4 × 4-byte transposed so each dword holds four values of one row, and `vpdpbusd` against
/// each token's four activations broadcast; the Q8_TF lane sums turn codes into `q`.
///
/// # Safety
/// AVX-512 F/BW/VBMI/VNNI; `grp` is one group of `nb` blocks from [`pack`], `act` holds `ntok`
/// Q8_TF rows of `nb` blocks back to back.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vnni,f16c,fma")]
unsafe fn gemm_group(grp: &[u8], nb: usize, act: &[u8], ntok: usize, y: &mut [f32]) {
    debug_assert!(ntok <= GEMM_TOKENS && y.len() >= ntok * GROUP);
    debug_assert!(grp.len() >= nb * GROUP_BLOCK && act.len() >= ntok * nb * 164);
    // SAFETY (whole body): pointers stay inside `grp` (records of GROUP_BLOCK bytes), `act`
    // (`ntok` rows of `nb` blocks of 164 bytes), the static tables and `lacc`.
    unsafe {
        let mut lacc = [[[_mm512_setzero_ps(); 4]; 8]; GEMM_TOKENS];
        let codes = CODES.0.as_ptr().cast::<u8>();
        let p4 = [
            _mm512_load_si512(codes.cast()),
            _mm512_load_si512(codes.add(64).cast()),
        ];
        let t4 = [
            _mm512_load_si512(codes.add(128).cast()),
            _mm512_load_si512(codes.add(192).cast()),
        ];
        let (aa, two, one, three) = (
            _mm512_set1_epi8(0xAAu8 as i8),
            _mm512_set1_epi8(2),
            _mm512_set1_epi8(1),
            _mm512_set1_epi8(3),
        );
        let rows16 = GEMM_ROWS16.0.as_ptr().cast::<u8>();
        let didx = [
            _mm512_load_si512(rows16.cast()),
            _mm512_load_si512(rows16.add(64).cast()),
        ];
        let arow = nb * 164;
        for b in 0..nb {
            let rec = grp.as_ptr().add(b * GROUP_BLOCK);
            let m = rec.add(MASKS_AT).cast::<u32>();
            let dp = rec.add(D_AT);
            let dw = [
                _mm512_load_si512(dp.cast()),
                _mm512_load_si512(dp.add(64).cast()),
            ];
            let dv: [__m512; 4] = core::array::from_fn(|v| {
                let w = _mm512_permutex2var_epi16(dw[0], didx[v / 2], dw[1]);
                let h = if v % 2 == 0 {
                    _mm512_castsi512_si256(w)
                } else {
                    _mm512_extracti64x4_epi64::<1>(w)
                };
                _mm512_cvtph_ps(h)
            });
            for k in 0..8 {
                let mut e = [_mm512_setzero_si512(); 16];
                for g in 0..3 {
                    let i = _mm512_load_si512(rec.add((k * 3 + g) * GROUP).cast());
                    let neg = _mm512_movepi8_mask(i);
                    let p = _mm512_permutex2var_epi8(p4[0], i, p4[1]);
                    let p = _mm512_mask_sub_epi8(p, neg, aa, p);
                    let c4 = _mm512_permutex2var_epi8(t4[0], i, t4[1]);
                    e[5 * g] = _mm512_and_si512(p, three);
                    e[5 * g + 1] = _mm512_and_si512(_mm512_srli_epi16::<2>(p), three);
                    e[5 * g + 2] = _mm512_and_si512(_mm512_srli_epi16::<4>(p), three);
                    e[5 * g + 3] = _mm512_and_si512(_mm512_srli_epi16::<6>(p), three);
                    e[5 * g + 4] = _mm512_mask_sub_epi8(c4, neg, two, c4);
                }
                let mk = m.add(k * 4);
                let lw = _mm512_sub_epi16(
                    _mm512_movm_epi16(mk.add(2).read_unaligned()),
                    _mm512_movm_epi16(mk.add(0).read_unaligned()),
                );
                let hw = _mm512_sub_epi16(
                    _mm512_movm_epi16(mk.add(3).read_unaligned()),
                    _mm512_movm_epi16(mk.add(1).read_unaligned()),
                );
                e[15] = _mm512_add_epi8(_mm512_packs_epi16(lw, hw), one);
                let mut u = [[_mm512_setzero_si512(); 4]; 4];
                for (q, uq) in u.iter_mut().enumerate() {
                    let t0 = _mm512_unpacklo_epi8(e[4 * q], e[4 * q + 1]);
                    let t1 = _mm512_unpackhi_epi8(e[4 * q], e[4 * q + 1]);
                    let t2 = _mm512_unpacklo_epi8(e[4 * q + 2], e[4 * q + 3]);
                    let t3 = _mm512_unpackhi_epi8(e[4 * q + 2], e[4 * q + 3]);
                    *uq = [
                        _mm512_unpacklo_epi16(t0, t2),
                        _mm512_unpackhi_epi16(t0, t2),
                        _mm512_unpacklo_epi16(t1, t3),
                        _mm512_unpackhi_epi16(t1, t3),
                    ];
                }
                for (t, lt) in lacc.iter_mut().enumerate().take(ntok) {
                    let a = act.as_ptr().add(t * arow + b * 164);
                    let lsum = a.add(4 + 128 + 4 * k).cast::<i32>().read_unaligned();
                    let mut acc = [_mm512_set1_epi32(-lsum); 4];
                    for (q, uq) in u.iter().enumerate() {
                        let aq = _mm512_set1_epi32(
                            a.add(4 + 32 * q + 4 * k).cast::<i32>().read_unaligned(),
                        );
                        for v in 0..4 {
                            acc[v] = _mm512_dpbusd_epi32(acc[v], uq[v], aq);
                        }
                    }
                    for v in 0..4 {
                        lt[k][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[v]), dv[v], lt[k][v]);
                    }
                }
            }
        }
        let rows = GEMM_ROWS.0;
        for (t, lt) in lacc.iter().enumerate().take(ntok) {
            let ad = act.as_ptr().add(t * arow).cast::<f32>().read_unaligned();
            for v in 0..4 {
                let mut o = [0f32; 16];
                _mm512_storeu_ps(o.as_mut_ptr(), rows_out(lt, v, ad));
                for (l, &x) in o.iter().enumerate() {
                    y[t * GROUP + rows[16 * v + l] as usize] = x;
                }
            }
        }
    }
}

/// Proof that this CPU has the features of this module's kernels (AVX-512 F/BW/VBMI/VNNI, FMA,
/// F16C): only a token calls them, and its methods check the sizes their safety needs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Token(());

impl Token {
    pub(crate) fn new() -> Option<Token> {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let has = *HAS.get_or_init(|| {
            is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vbmi")
                && is_x86_feature_detected!("avx512vnni")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
        });
        has.then_some(Token(()))
    }

    /// [`build_tables`]; panics when `act` or `out` is too short or `out` is not 64-byte
    /// aligned.
    pub(crate) fn build_tables(self, act: &[u8], blocks: core::ops::Range<usize>, out: &mut [u8]) {
        assert!(act.len() >= blocks.end * 164 && out.len() >= blocks.len() * 8 * LANE_TABLES);
        assert!(
            out.as_ptr().align_offset(64) == 0,
            "tables must start on a cache line"
        );
        // SAFETY: the token proves the features; sizes and alignment checked above.
        unsafe { build_tables(act, blocks, out) }
    }

    /// Groups `groups` of `data` (groups of `nb` blocks) from one token's tables `parts` (each
    /// with the blocks it covers, in order, together all `nb`; [`gemv_groups`], in passes of
    /// [`GEMV_CHUNK`] blocks when `nb` is more than twice that); `emit(g, y)` receives group
    /// `g`'s 64 outputs. Panics when a part is too short or misaligned, `data` too short or
    /// misaligned, or the parts do not cover every block in order.
    pub(crate) fn gemv_groups(
        self,
        data: &[u8],
        nb: usize,
        parts: &[(&[u8], core::ops::Range<usize>)],
        ad: f32,
        groups: core::ops::Range<usize>,
        mut emit: impl FnMut(usize, &[f32; GROUP]),
    ) {
        let mut next = 0;
        for (t, r) in parts {
            assert!(r.start == next && r.start <= r.end && t.len() >= r.len() * 8 * LANE_TABLES);
            assert!(
                t.as_ptr().align_offset(64) == 0,
                "tables must start on a cache line"
            );
            next = r.end;
        }
        assert!(
            next == nb
                && groups
                    .end
                    .checked_mul(nb * GROUP_BLOCK)
                    .is_some_and(|n| data.len() >= n)
        );
        assert!(
            data.as_ptr().align_offset(64) == 0,
            "groups must start on a cache line"
        );
        let chunk = if nb > 2 * GEMV_CHUNK { GEMV_CHUNK } else { nb };
        let mut ys = [[0f32; GROUP]; GEMV_BATCH];
        let mut g0 = groups.start;
        while g0 < groups.end {
            let n = (groups.end - g0).min(GEMV_BATCH);
            // SAFETY: the token proves the features; sizes and alignment checked above.
            unsafe { gemv_groups(data, nb, parts, ad, g0, chunk.max(1), &mut ys[..n]) };
            for (i, y) in ys[..n].iter().enumerate() {
                emit(g0 + i, y);
            }
            g0 += n;
        }
    }

    /// [`gemm_group`]; panics when `grp`, `act` or `y` is too short or `ntok` too large.
    pub(crate) fn gemm_group(self, grp: &[u8], nb: usize, act: &[u8], ntok: usize, y: &mut [f32]) {
        assert!(nb > 0 && ntok <= GEMM_TOKENS && y.len() >= ntok * GROUP);
        assert!(grp.len() >= nb * GROUP_BLOCK && act.len() >= ntok * nb * 164);
        assert!(
            grp.as_ptr().align_offset(64) == 0,
            "groups must start on a cache line"
        );
        // SAFETY: the token proves the features; sizes and alignment checked above.
        unsafe { gemm_group(grp, nb, act, ntok, y) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`pack`] as it was before its digits became lookups and its groups parallel (one
    /// thread, each trit computed): the reference the faster one must equal byte for byte.
    fn pack_one_by_one<'a>(
        rows: usize,
        nb: usize,
        row: impl Fn(usize) -> &'a [u8],
        out: &mut [u8],
    ) {
        let (src, left) = &SOURCES;
        let mut masks = vec![[0u64; 16]; nb];
        for (gi, g) in out.chunks_exact_mut(nb * GROUP_BLOCK).enumerate() {
            masks.iter_mut().for_each(|m| *m = [0; 16]);
            for r in 0..GROUP {
                let (byte, bit) = slot(r);
                let Some(x) = (gi * GROUP + r < rows).then(|| row(gi * GROUP + r)) else {
                    for rec in g.chunks_exact_mut(GROUP_BLOCK) {
                        for p in 0..24 {
                            rec[p * GROUP + byte] = FOLD[121];
                        }
                        rec[D_AT + 2 * r..][..2].fill(0);
                    }
                    continue;
                };
                for ((rec, x), m) in g
                    .chunks_exact_mut(GROUP_BLOCK)
                    .zip(x.chunks_exact(28))
                    .zip(masks.iter_mut())
                {
                    let qs = &x[2..28];
                    let tr = |&(b, t): &(u8, u8)| trit(qs[b as usize], t as usize) as usize;
                    for (p, s) in src.iter().enumerate() {
                        let n = tr(&s[0])
                            + 3 * tr(&s[1])
                            + 9 * tr(&s[2])
                            + 27 * tr(&s[3])
                            + 81 * tr(&s[4]);
                        rec[p * GROUP + byte] = FOLD[n];
                    }
                    for (k, l) in left.iter().enumerate() {
                        let c = tr(l);
                        m[2 * k] |= ((c == 2) as u64) << bit;
                        m[2 * k + 1] |= ((c == 0) as u64) << bit;
                    }
                    rec[D_AT + 2 * r..][..2].copy_from_slice(&x[0..2]);
                }
            }
            for (rec, m) in g.chunks_exact_mut(GROUP_BLOCK).zip(&masks) {
                for (o, v) in rec[MASKS_AT..D_AT].chunks_exact_mut(8).zip(m) {
                    o.copy_from_slice(&v.to_le_bytes());
                }
            }
        }
    }

    /// Every byte of [`pack`]'s output equals the one-by-one repack's, for every byte value in
    /// every position (random bytes, each block scale included), three groups the last of
    /// which is padded (129 rows), three blocks a row.
    #[test]
    fn pack_equals_the_one_by_one_repack() {
        let (rows, nb) = (129, 3);
        let w = super::super::xorshift_bytes(0x9E37_79B9_7F4A_7C15, rows * nb * 28);
        let row = |r: usize| &w[r * nb * 28..(r + 1) * nb * 28];
        let len = rows.div_ceil(GROUP) * nb * GROUP_BLOCK;
        let (mut want, mut got) = (vec![0u8; len], vec![0u8; len]);
        pack_one_by_one(rows, nb, row, &mut want);
        pack(rows, nb, row, &mut got);
        assert_eq!(got, want);
    }
}
