//! [`Numerics::Invariant`]: a token's row of a multi-token matmul is bit-identical to its
//! 1-token matmul, whatever the batch size and the token's place in it, on every ISA; and the
//! flag matters (Parity's multi-token k-quant orders really differ).

use super::{abs_dot, bits, random_weights, Rng, MATMUL_TYPES};
use crate::dispatch::Isa;
use crate::*;

/// Batch sizes around every grouping the kernels use: q4_K's groups of 4, q6_K's tiled
/// threshold at 8, the AVX-512 legacy GEMM's token pairs, AVX2's 4-token tiles.
const NS: [usize; 11] = [1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17];

/// Columns per block size: ragged f32/f16 rows (tails shorter than a vector), several blocks,
/// and rows longer than the AVX-512 GEMV/GEMM column chunks.
fn cols_for(ty: GgmlType) -> &'static [usize] {
    match ty.block_size() {
        // 1100: several K chunks of the AVX2 f16/bf16 GEMM with a ragged tail; 27000: its
        // token blocks shorter than the largest batch here.
        1 => &[1, 7, 16, 33, 200, 1100, 27000],
        32 => &[32, 96, 640, 4160],
        128 => &[128, 640],
        // 4352: longer than the rows the k-quant GEMV runs one at a time.
        _ => &[256, 1024, 2560, 4352],
    }
}

fn available() -> Vec<Isa> {
    Isa::ALL.into_iter().filter(|i| i.is_available()).collect()
}

/// `rows` of `m` against `x` (n tokens) on `isa`.
fn run(
    isa: Isa,
    m: &QMatrix<'_>,
    x: &[f32],
    n: usize,
    rows: std::ops::Range<usize>,
    numerics: Numerics,
) -> Vec<f32> {
    let mut act = Activations::new();
    act.quantize_for(m.ty(), x, n, m.cols()).unwrap();
    let mut out = vec![f32::NAN; n * rows.len()];
    matmul_with(isa, m, &act, rows, &mut out, numerics).unwrap();
    out
}

#[test]
fn invariant_rows_equal_their_one_token_matmuls_on_every_isa() {
    let mut rng = Rng(0x1A7A);
    let isas = available();
    let mut checked = 0usize;
    for ty in MATMUL_TYPES {
        for &cols in cols_for(ty) {
            let total_rows = 11;
            let w = random_weights(ty, cols * total_rows, &mut rng);
            let m = QMatrix::new(ty, total_rows, cols, &w).unwrap();
            // 9 rows: the AVX-512 GEMVs' 4-row groups, the ternary row pairs and AVX2's row
            // tiles, each with a remainder; 3 rows: remainders only.
            for rows in [1..10, 8..11] {
                let nr = rows.len();
                for n in NS {
                    let x: Vec<f32> = (0..n * cols).map(|_| rng.normalish()).collect();
                    let mut scalar_inv = None;
                    for &isa in &isas {
                        // Each token alone. At n = 1 Parity and Invariant are the same call,
                        // except q6_K, q3_K and IQ4_XS: Parity keeps llama.cpp's `vec_dot` order for
                        // decode, Invariant the tiled order of its GEMM.
                        let mut alone = Vec::with_capacity(n * nr);
                        let mut alone_parity = Vec::with_capacity(n * nr);
                        for t in 0..n {
                            let xt = &x[t * cols..(t + 1) * cols];
                            let p = run(isa, &m, xt, 1, rows.clone(), Numerics::Parity);
                            let i = run(isa, &m, xt, 1, rows.clone(), Numerics::Invariant);
                            if !crate::scalar::lanes8_then_tiled(ty) {
                                assert_eq!(bits(&p), bits(&i), "{isa:?} {ty:?} cols={cols} n=1");
                            }
                            alone.extend(i);
                            alone_parity.extend(p);
                        }
                        // Routed (MUL_MAT_ID's order): q4_K and q2_K rows equal their 1-token
                        // parity matmuls; every other type is the batch's parity matmul.
                        let routed = run(isa, &m, &x, n, rows.clone(), Numerics::Routed);
                        let want = if crate::scalar::repacked_k(ty) {
                            alone_parity.clone()
                        } else {
                            run(isa, &m, &x, n, rows.clone(), Numerics::Parity)
                        };
                        assert_eq!(
                            bits(&routed),
                            bits(&want),
                            "{isa:?} {ty:?} cols={cols} rows={rows:?} n={n}: routed order"
                        );
                        let got = run(isa, &m, &x, n, rows.clone(), Numerics::Invariant);
                        for t in 0..n {
                            for r in 0..nr {
                                let (g, a) = (got[t * nr + r], alone[t * nr + r]);
                                assert!(
                                    g.to_bits() == a.to_bits(),
                                    "{isa:?} {ty:?} cols={cols} rows={rows:?} n={n} t={t} r={r}: \
                                     batched {g} vs alone {a}"
                                );
                                checked += 1;
                            }
                        }
                        // Every ISA computes the Invariant order of the scalar reference: bit
                        // for bit for the quantized types. Float weights sum in f64 in the
                        // reference and in f32 lanes in SIMD (`every_simd_matmul_matches_scalar`
                        // bounds that difference); their batch invariance is checked above.
                        let reference = scalar_inv.get_or_insert_with(|| {
                            run(Isa::Scalar, &m, &x, n, rows.clone(), Numerics::Invariant)
                        });
                        if ty.block_size() > 1 {
                            assert_eq!(
                                bits(&got),
                                bits(reference),
                                "{isa:?} {ty:?} cols={cols} rows={rows:?} n={n}: invariant \
                                 SIMD differs from invariant scalar"
                            );
                        }
                    }
                }
            }
        }
    }
    assert!(checked > 10_000, "only {checked} comparisons ran");
}

#[test]
fn invariant_rows_do_not_depend_on_the_batch_they_share() {
    // The same token in different batches (alone, with others, at another position) gives the
    // same row, through the public entry point and its selected ISA.
    let mut rng = Rng(0xBA7C);
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q2_K,
        GgmlType::Q6_K,
        GgmlType::Q5_K,
        GgmlType::Q3_K,
        GgmlType::IQ4_XS,
    ] {
        let (rows, cols) = (12, 512);
        let w = random_weights(ty, rows * cols, &mut rng);
        let m = QMatrix::new(ty, rows, cols, &w).unwrap();
        let tok: Vec<f32> = (0..cols).map(|_| rng.normalish()).collect();
        let mut want = vec![0f32; rows];
        let mut act = Activations::new();
        act.quantize_for(ty, &tok, 1, cols).unwrap();
        matmul(&m, &act, 0..rows, &mut want, Numerics::Invariant).unwrap();
        for (n, pos) in [(4, 0), (4, 3), (8, 5), (12, 7), (33, 32)] {
            let mut x: Vec<f32> = (0..n * cols).map(|_| rng.normalish()).collect();
            x[pos * cols..(pos + 1) * cols].copy_from_slice(&tok);
            act.quantize_for(ty, &x, n, cols).unwrap();
            let mut out = vec![0f32; n * rows];
            matmul(&m, &act, 0..rows, &mut out, Numerics::Invariant).unwrap();
            assert_eq!(
                bits(&out[pos * rows..(pos + 1) * rows]),
                bits(&want),
                "{ty:?} token at {pos} of {n}"
            );
        }
    }
}

#[test]
fn parity_still_differs_from_invariant_where_llama_cpp_changes_order() {
    // q4_K/q5_K at 4 tokens: Parity runs the repacked GEMM's per-64-value order, Invariant the
    // GEMV's per-super-block one (and from 8 tokens q5_K the tiled one); q6_K, q3_K and IQ4_XS
    // below 8 tokens: vec_dot against tiled. Over many rows the
    // two orders round differently somewhere (if the flag were ignored they would not), while
    // staying the same dot product.
    let mut rng = Rng(0xD1FF);
    for (ty, n) in [
        (GgmlType::Q4_K, 4),
        (GgmlType::Q2_K, 4),
        (GgmlType::Q5_K, 4),
        // q5_K from 8 tokens: the tiled matmul's order (mins folded in per super-block).
        (GgmlType::Q5_K, 8),
        (GgmlType::Q6_K, 1),
        (GgmlType::Q6_K, 4),
        (GgmlType::Q3_K, 1),
        (GgmlType::Q3_K, 4),
        (GgmlType::IQ4_XS, 1),
        (GgmlType::IQ4_XS, 4),
    ] {
        let (rows, cols) = (64, 1024);
        let w = random_weights(ty, rows * cols, &mut rng);
        let m = QMatrix::new(ty, rows, cols, &w).unwrap();
        let x: Vec<f32> = (0..n * cols).map(|_| rng.normalish()).collect();
        // Rounding is bounded by the sum of the terms' magnitudes (the values as the kernels
        // see them: dequantized weights and activations).
        let mut wf = vec![0f32; rows * cols];
        dequantize_row(ty, &w, &mut wf).unwrap();
        let mut act = Activations::new();
        act.quantize_for(ty, &x, n, cols).unwrap();
        let mut af = vec![0f32; n * cols];
        for t in 0..n {
            dequantize_row(act.ty(), act.row(t), &mut af[t * cols..(t + 1) * cols]).unwrap();
        }
        for isa in available() {
            let p = run(isa, &m, &x, n, 0..rows, Numerics::Parity);
            let i = run(isa, &m, &x, n, 0..rows, Numerics::Invariant);
            let differ = p
                .iter()
                .zip(&i)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            assert!(
                differ > 0,
                "{isa:?} {ty:?} n={n}: Parity and Invariant agree on all {} outputs",
                p.len()
            );
            for (k, (a, b)) in p.iter().zip(&i).enumerate() {
                let (t, r) = (k / rows, k % rows);
                let mag = abs_dot(&wf[r * cols..(r + 1) * cols], &af[t * cols..(t + 1) * cols]);
                assert!(
                    (a - b).abs() <= 1e-6 * mag + 1e-6,
                    "{isa:?} {ty:?} n={n} row {r} token {t}: {a} vs {b} (sum of |terms| {mag})"
                );
            }
        }
    }
}

#[test]
fn numerics_only_matter_for_batch_dependent_k_quant_orders() {
    // Every other weight type sums each token in one order whatever the batch: Parity and
    // Invariant are the same bits (so serving Invariant costs them nothing).
    let mut rng = Rng(0x0DE5);
    for ty in MATMUL_TYPES {
        if matches!(ty, GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q2_K)
            || crate::scalar::lanes8_then_tiled(ty)
        {
            continue;
        }
        let cols = cols_for(ty)[1];
        let rows = 9;
        let w = random_weights(ty, rows * cols, &mut rng);
        let m = QMatrix::new(ty, rows, cols, &w).unwrap();
        for n in [4usize, 8, 17] {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.normalish()).collect();
            for isa in available() {
                let p = run(isa, &m, &x, n, 0..rows, Numerics::Parity);
                let i = run(isa, &m, &x, n, 0..rows, Numerics::Invariant);
                assert_eq!(bits(&p), bits(&i), "{isa:?} {ty:?} n={n}");
            }
        }
    }
}

/// The AVX2 f16 / bf16 GEMM's three activation feeds — widened to f32 per token block,
/// converted as loaded (the default on AMD CPUs), or 3 × 3 tiles converting both operands
/// over all columns (f16 on AMD CPUs without AVX-512) — give the same bits as each token's
/// 1-token matmul: ragged columns, several K chunks, several token blocks of every feed (27004
/// columns: 12 tokens per widened block, 114 per converted one, 36 per tiled one, and a
/// ragged tail), a one-row remainder of the 3-row tiles (7 rows) and 1- and 2-token
/// remainders of the 3-token tiles (16 and 125 tokens).
#[cfg(target_arch = "x86_64")]
#[test]
fn avx2_float_gemm_feeds_equal_the_one_token_matmuls() {
    use crate::x86_64::avx2::{with_float_act, FloatAct};
    assert!(
        Isa::Avx2.is_available(),
        "every x86-64 machine we test on has AVX2"
    );
    let mut rng = Rng(0xF16A);
    for ty in [GgmlType::F16, GgmlType::BF16] {
        for (cols, n) in [(1100, 16), (27004, 125)] {
            let rows = 7;
            let w = random_weights(ty, cols * rows, &mut rng);
            let m = QMatrix::new(ty, rows, cols, &w).unwrap();
            let x: Vec<f32> = (0..n * cols).map(|_| rng.normalish()).collect();
            let mut alone = Vec::with_capacity(n * rows);
            for t in 0..n {
                let xt = &x[t * cols..(t + 1) * cols];
                alone.extend(run(Isa::Avx2, &m, xt, 1, 0..rows, Numerics::Parity));
            }
            for feed in [FloatAct::Widen, FloatAct::Convert, FloatAct::Tiles] {
                let got = with_float_act(feed, || {
                    run(Isa::Avx2, &m, &x, n, 0..rows, Numerics::Parity)
                });
                assert_eq!(
                    bits(&got),
                    bits(&alone),
                    "{ty:?} cols={cols} n={n} {feed:?}"
                );
            }
        }
    }
}
