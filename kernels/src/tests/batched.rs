//! Batched decode and prefill shapes on many rows: every SIMD matmul equals the scalar
//! reference bit for bit (quantized weights; float weights within rounding) in both numerics,
//! for every small token count and for row ranges long enough to cross the kernels' row chunks
//! (the unpacked-weight buffers cover a few dozen to a few hundred rows) and their 4-row
//! groups, starting at an odd row.

use super::{abs_dot, bits, random_weights, Rng, MATMUL_TYPES};
use crate::dispatch::Isa;
use crate::*;

/// Token counts: each small tile width, the small/large kernel switches, and past them (133:
/// a ragged last group, `ntok % 4 == 1`; more than one band of the k-quant lanes GEMM in
/// [`lanes_gemm_past_one_band_matches_scalar`]).
const NS: [usize; 17] = [2, 3, 4, 5, 6, 7, 8, 9, 12, 15, 16, 17, 24, 37, 45, 64, 133];

fn cols_for(ty: GgmlType) -> &'static [usize] {
    match ty.block_size() {
        1 => &[200],
        // 4160: 130 blocks, a few rows per chunk of unpacked weights.
        32 => &[640, 4160],
        128 => &[640],
        _ => &[2560],
    }
}

fn run(
    isa: Isa,
    m: &QMatrix<'_>,
    act: &Activations,
    rows: std::ops::Range<usize>,
    numerics: Numerics,
) -> Vec<f32> {
    let mut out = vec![f32::NAN; act.n() * rows.len()];
    matmul_with(isa, m, act, rows, &mut out, numerics).unwrap();
    out
}

#[test]
fn batched_matmuls_on_many_rows_match_scalar() {
    let mut rng = Rng(0xBA7E);
    let mut checked = 0usize;
    for ty in MATMUL_TYPES {
        for &cols in cols_for(ty) {
            let total_rows = 160;
            let w = random_weights(ty, cols * total_rows, &mut rng);
            let m = QMatrix::new(ty, total_rows, cols, &w).unwrap();
            let mut wf = vec![0f32; cols * total_rows];
            dequantize_row(ty, &w, &mut wf).unwrap();
            let rows = 3..total_rows - 2;
            let nr = rows.len();
            for n in NS {
                let x: Vec<f32> = (0..n * cols).map(|_| rng.normalish()).collect();
                let mut act = Activations::new();
                act.quantize_for(ty, &x, n, cols).unwrap();
                let mut af = vec![0f32; n * cols];
                for t in 0..n {
                    dequantize_row(act.ty(), act.row(t), &mut af[t * cols..(t + 1) * cols])
                        .unwrap();
                }
                for numerics in [Numerics::Parity, Numerics::Invariant] {
                    let want = run(Isa::Scalar, &m, &act, rows.clone(), numerics);
                    for isa in [Isa::Avx2, Isa::Avx512] {
                        if !isa.is_available() {
                            continue;
                        }
                        let got = run(isa, &m, &act, rows.clone(), numerics);
                        for t in 0..n {
                            for r in 0..nr {
                                let i = t * nr + r;
                                let row = rows.start + r;
                                let tol = if ty.block_size() > 1 {
                                    0.0
                                } else {
                                    let wr = &wf[row * cols..(row + 1) * cols];
                                    2e-5 * abs_dot(wr, &af[t * cols..(t + 1) * cols]) + 1e-30
                                };
                                assert!(
                                    (got[i] - want[i]).abs() <= tol && !got[i].is_nan(),
                                    "{isa:?} {ty:?} {numerics:?} cols={cols} n={n} t={t} \
                                     row={row}: got {} want {}",
                                    got[i],
                                    want[i]
                                );
                                checked += 1;
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(checked > 100_000, "only {checked} comparisons ran");
}

/// The k-quant lanes GEMM (k-quants, IQ4_XS and the IQ grid types from 16 tokens) past one
/// band of token groups, with each register tile (3 token groups, Intel's, and 2, AMD's) and
/// each band (32 groups, Intel's, and 8, AMD's) forced in turn: with bands of 32, 529 tokens
/// are two bands (32 groups, then one full and one of a single token), 561 two with four
/// groups in the second (with bands of 8, five); each tile then takes the band's last one or
/// two groups (q4_K and q2_K in Parity: 528 and 560 tokens through the GEMM, the rest apart);
/// 70 rows cross its 64-row panel, from an odd row.
#[test]
fn lanes_gemm_past_one_band_matches_scalar() {
    if !Isa::Avx512.is_available() {
        eprintln!("no AVX-512 VNNI here: the lanes GEMM does not run on this CPU");
        return;
    }
    let mut rng = Rng(0xBA7D);
    let (cols, total_rows) = (512usize, 73usize);
    let rows = 1..71;
    let mut checked = 0usize;
    let lanes_kinds = MATMUL_TYPES
        .into_iter()
        .filter(|t| t.block_size() == 256 && !matches!(t, GgmlType::TQ1_0 | GgmlType::TQ2_0));
    for ty in lanes_kinds {
        let w = random_weights(ty, cols * total_rows, &mut rng);
        let m = QMatrix::new(ty, total_rows, cols, &w).unwrap();
        for n in [529usize, 561] {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.normalish()).collect();
            let mut act = Activations::new();
            act.quantize_for(ty, &x, n, cols).unwrap();
            for numerics in [Numerics::Parity, Numerics::Invariant] {
                let want = run(Isa::Scalar, &m, &act, rows.clone(), numerics);
                for (groups, band) in [(2, 8), (3, 32), (2, 32), (3, 8)] {
                    crate::x86_64::kq_lanes::FORCE_G
                        .store(groups, std::sync::atomic::Ordering::Relaxed);
                    crate::x86_64::kq_lanes::FORCE_BAND
                        .store(band, std::sync::atomic::Ordering::Relaxed);
                    let got = run(Isa::Avx512, &m, &act, rows.clone(), numerics);
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            g.to_bits() == w.to_bits(),
                            "{ty:?} {numerics:?} n={n} tile 4x{groups} band {band} t={} row={}: \
                             got {g} want {w}",
                            i / rows.len(),
                            rows.start + i % rows.len()
                        );
                        checked += 1;
                    }
                }
            }
        }
    }
    crate::x86_64::kq_lanes::FORCE_G.store(0, std::sync::atomic::Ordering::Relaxed);
    crate::x86_64::kq_lanes::FORCE_BAND.store(0, std::sync::atomic::Ordering::Relaxed);
    assert!(checked > 6_000_000, "only {checked} comparisons ran");
}

/// The AVX-512 q8_0 / q5_0 GEMV both ways — one row at a time (AMD's) and the small-batch
/// tiles of four rows (Intel's) — gives the scalar reference's bits: row ranges from odd rows
/// with every remainder of the four-row tiles (0 to 3) and an empty one, one-block rows and
/// rows longer than the tiles' prefetch distance.
#[cfg(target_arch = "x86_64")]
#[test]
fn legacy_gemv_one_row_and_four_rows_match_scalar() {
    if !Isa::Avx512.is_available() {
        eprintln!("skipped: this CPU lacks AVX-512 VNNI");
        return;
    }
    let mut rng = Rng(0x6E3F);
    let mut checked = 0usize;
    for ty in [GgmlType::Q8_0, GgmlType::Q5_0] {
        for cols in [32usize, 640, 4160] {
            let total_rows = 14;
            let w = random_weights(ty, cols * total_rows, &mut rng);
            let m = QMatrix::new(ty, total_rows, cols, &w).unwrap();
            let x: Vec<f32> = (0..cols).map(|_| rng.normalish()).collect();
            let mut act = Activations::new();
            act.quantize_for(ty, &x, 1, cols).unwrap();
            for rows in [0..14, 1..14, 3..10, 2..10, 5..8, 2..4, 13..14, 4..4] {
                let want = run(Isa::Scalar, &m, &act, rows.clone(), Numerics::Parity);
                for one_row in [true, false] {
                    let got = crate::x86_64::avx512q::with_legacy_gemv_one_row(one_row, || {
                        run(Isa::Avx512, &m, &act, rows.clone(), Numerics::Parity)
                    });
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{ty:?} cols={cols} rows={rows:?} one_row={one_row}"
                    );
                    checked += got.len();
                }
            }
        }
    }
    assert!(checked > 200, "only {checked} comparisons ran");
}

/// The AVX2 q8_0 / q5_0 multi-token tiles both ways — one row by up to eight tokens (small
/// batches; every batch on AMD) and four rows by six (Intel past 16 tokens) — give the scalar
/// reference's bits for every small token count and past the switch at 16, on row ranges from
/// odd rows with every remainder of the four-row tiles and an empty one.
#[cfg(target_arch = "x86_64")]
#[test]
fn avx2_signed_one_row_and_four_rows_match_scalar() {
    if !Isa::Avx2.is_available() {
        eprintln!("skipped: this CPU lacks AVX2");
        return;
    }
    let mut rng = Rng(0x51C7);
    let mut checked = 0usize;
    for ty in [GgmlType::Q8_0, GgmlType::Q5_0] {
        // 8192 columns: activation rows of 8.7 KB, so the drivers' token blocks (about 256 KiB)
        // hold 24-32 tokens and the larger counts start tiles past token 0 of a block and of
        // the call.
        for cols in [32usize, 640, 8192] {
            let total_rows = 14;
            let w = random_weights(ty, cols * total_rows, &mut rng);
            let m = QMatrix::new(ty, total_rows, cols, &w).unwrap();
            for n in NS {
                let x: Vec<f32> = (0..n * cols).map(|_| rng.normalish()).collect();
                let mut act = Activations::new();
                act.quantize_for(ty, &x, n, cols).unwrap();
                for rows in [0..14, 1..14, 3..10, 2..10, 5..8, 13..14, 4..4] {
                    let want = run(Isa::Scalar, &m, &act, rows.clone(), Numerics::Parity);
                    for one_row in [true, false] {
                        let got = crate::x86_64::avx2::with_signed_one_row(one_row, || {
                            run(Isa::Avx2, &m, &act, rows.clone(), Numerics::Parity)
                        });
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "{ty:?} cols={cols} n={n} rows={rows:?} one_row={one_row}"
                        );
                        checked += got.len();
                    }
                }
            }
        }
    }
    assert!(checked > 50_000, "only {checked} comparisons ran");
}

/// The largest codes every k-quant (and q4_0, q5_0, q8_0: the largest and the most negative)
/// can hold against activations at their extremes (every value of a block at the block's
/// maximum magnitude: all -127; or q8_K a leading -127 then 127s, q8_0 a leading 127 then
/// -127s):
/// the sums the SIMD kernels keep in 16-bit lanes (AVX2's `vpmaddubsw` pair sums, added up
/// over several quads) are at their extremes, so a chunk one quad too long overflows and
/// differs from the scalar reference. (The chunks are sized for -128, which `quantize_for`
/// never writes.)
#[test]
fn quant_matmuls_at_extreme_codes_match_scalar() {
    // (type, bytes per block, offsets of its f16 scales, the code bytes: every bit set, or
    // q8_0's -127)
    let kinds: [(GgmlType, usize, &[usize], u8); 12] = [
        (GgmlType::Q2_K, 84, &[80, 82], 0xFF),
        (GgmlType::Q3_K, 110, &[108], 0xFF),
        // Every value -4 with every scale -32: the lanes GEMM's folded code at its top (255).
        (GgmlType::Q3_K, 110, &[108], 0x00),
        (GgmlType::Q4_K, 144, &[0, 2], 0xFF),
        (GgmlType::Q5_K, 176, &[0, 2], 0xFF),
        (GgmlType::Q6_K, 210, &[208], 0xFF),
        (GgmlType::Q4_0, 18, &[0], 0xFF),
        (GgmlType::Q4_0, 18, &[0], 0x00),
        (GgmlType::Q5_0, 22, &[0], 0xFF),
        (GgmlType::Q5_0, 22, &[0], 0x00),
        (GgmlType::Q8_0, 34, &[0], 0x81),
        (GgmlType::Q8_0, 34, &[0], 0x80),
    ];
    let (rows, cols) = (7usize, 512usize);
    let mut checked = 0usize;
    for (ty, bs, scales, fill) in kinds {
        // Every code bit set; q6_K's scales (0xFF = -1) and q3_K's stay as all-ones bytes give.
        let mut w = vec![fill; rows * cols / ty.block_size() * bs];
        for blk in w.chunks_exact_mut(bs) {
            for &o in scales {
                blk[o..o + 2].copy_from_slice(&half::f16::from_f32(0.01).to_bits().to_le_bytes());
            }
        }
        let m = QMatrix::new(ty, rows, cols, &w).unwrap();
        for first in [-1.0f32, 1.0] {
            for n in [1usize, 8, 16, 19, 33] {
                // All -1: every code -127. A leading +1: q8_K -127, then 127 for the -1s;
                // q8_0 127, then -127s.
                let x: Vec<f32> = (0..n * cols)
                    .map(|i| if i % 256 == 0 { first } else { -1.0 })
                    .collect();
                let mut act = Activations::new();
                act.quantize_for(ty, &x, n, cols).unwrap();
                for numerics in [Numerics::Parity, Numerics::Invariant] {
                    let want = run(Isa::Scalar, &m, &act, 0..rows, numerics);
                    for isa in [Isa::Avx2, Isa::Avx512] {
                        if !isa.is_available() {
                            continue;
                        }
                        let got = run(isa, &m, &act, 0..rows, numerics);
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "{isa:?} {ty:?} {numerics:?} n={n} first={first}"
                        );
                        checked += got.len();
                    }
                }
            }
        }
    }
    assert!(checked > 1000, "only {checked} comparisons ran");
}
