//! Ternary formats: quantizers against gguf-py (TQ1_0/TQ2_0) and against independent
//! recomputations (TF2/TF1/Q8_TF), dots against f64 references. The SIMD-vs-scalar matmul
//! checks for these types run in `every_simd_matmul_matches_scalar` (MATMUL_TYPES).

use super::{abs_dot, le_f32, Rng};
use crate::dispatch::Isa;
use crate::*;

fn quantized(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    let mut q = vec![0u8; ty.row_size(x.len() as u64).unwrap() as usize];
    quantize_row(ty, x, &mut q).unwrap();
    q
}

fn dequantized(ty: GgmlType, q: &[u8], n: usize) -> Vec<f32> {
    let mut y = vec![0f32; n];
    dequantize_row(ty, q, &mut y).unwrap();
    y
}

/// gguf-py's TQ1_0 / TQ2_0 quantization of `tq_quant_in.f32`: bytes and dequantized values.
fn tq_fixtures() -> [(GgmlType, &'static [u8], &'static [u8]); 2] {
    [
        (
            GgmlType::TQ1_0,
            include_bytes!("../../tests/data/tq1_0_quant.bin"),
            include_bytes!("../../tests/data/tq1_0_quant.f32"),
        ),
        (
            GgmlType::TQ2_0,
            include_bytes!("../../tests/data/tq2_0_quant.bin"),
            include_bytes!("../../tests/data/tq2_0_quant.f32"),
        ),
    ]
}

#[test]
fn tq_quantizers_match_gguf_py_bytes() {
    // gguf.quants.quantize == ggml quantize_row_tq{1,2}_0_ref (scripts/make-kernel-goldens.py),
    // including exact ties (lroundf rounds them away from zero) and an all-zero block.
    let x = le_f32(include_bytes!("../../tests/data/tq_quant_in.f32"));
    let cases = tq_fixtures();
    for (ty, want, want_f) in cases {
        let got = quantized(ty, &x);
        assert_eq!(got, want, "{ty:?} bytes differ from gguf-py");
        assert_eq!(dequantized(ty, &got, x.len()), le_f32(want_f), "{ty:?}");
    }
}

#[test]
fn tq_scalar_dot_equals_f64_dot_of_gguf_py_values() {
    // Weights quantized by gguf-py and dequantized by gguf-py; activations q8_K, dequantized.
    let x = le_f32(include_bytes!("../../tests/data/tq_quant_in.f32"));
    let cols = x.len();
    let mut rng = Rng(99);
    let cases = tq_fixtures();
    for (ty, wq, wf) in cases {
        let wf = le_f32(wf);
        let m = QMatrix::new(ty, 1, cols, wq).unwrap();
        for _ in 0..4 {
            let a: Vec<f32> = (0..cols).map(|_| rng.normalish()).collect();
            let mut act = Activations::new();
            act.quantize_for(ty, &a, 1, cols).unwrap();
            let af = dequantized(act.ty(), act.row(0), cols);
            let want: f64 = wf.iter().zip(&af).map(|(w, a)| *w as f64 * *a as f64).sum();
            for isa in Isa::ALL.into_iter().filter(|i| i.is_available()) {
                let mut got = [0f32];
                matmul_with(isa, &m, &act, 0..1, &mut got, Numerics::Parity).unwrap();
                let tol = 1e-5 * abs_dot(&wf, &af) as f64 + 1e-6;
                assert!(
                    (got[0] as f64 - want).abs() <= tol,
                    "{isa:?} {ty:?}: {} vs {want}",
                    got[0]
                );
            }
        }
    }
}

/// TF2 / TF1 quantization recomputed in f64 from the definition (absmean per 128-block).
fn tf_reference(x: &[f32]) -> Vec<f32> {
    let mut out = Vec::new();
    for b in x.chunks(128) {
        let s = b.iter().map(|v| v.abs()).sum::<f32>() / 128.0;
        let d = half::f16::from_f32(s).to_f32();
        for &v in b {
            let q = if s > 0.0 {
                (v as f64 / s as f64).round().clamp(-1.0, 1.0)
            } else {
                0.0
            };
            out.push(q as f32 * d);
        }
    }
    out
}

#[test]
fn tf_quantizers_follow_the_absmean_definition_and_round_trip() {
    let mut rng = Rng(5);
    let mut x: Vec<f32> = (0..128 * 7).map(|_| rng.normalish()).collect();
    x[128..256].fill(0.0); // zero block: d = 0
    x[300] = 40.0; // an outlier block
    for ty in [GgmlType::TF2, GgmlType::TF1] {
        let q = quantized(ty, &x);
        assert_eq!(q.len(), 7 * ty.type_size());
        let got = dequantized(ty, &q, x.len());
        let want = tf_reference(&x);
        // Only exact ties (x == s/2) may round differently in f32 and f64: none here.
        assert_eq!(got, want, "{ty:?}");
        // Quantizing the dequantized values again is the identity on the codes (the scale
        // changes: the absmean of {-d, 0, d} values is below d).
        let again = quantized(ty, &got);
        let ts = ty.type_size();
        for (b0, b1) in q.chunks_exact(ts).zip(again.chunks_exact(ts)) {
            let (c0, c1) = (
                crate::ternary::tf_codes(ty, b0),
                crate::ternary::tf_codes(ty, b1),
            );
            assert_eq!(c0, c1, "{ty:?} codes are not stable");
        }
    }
    // TF1 and TF2 hold the same codes.
    assert_eq!(
        dequantized(GgmlType::TF1, &quantized(GgmlType::TF1, &x), x.len()),
        dequantized(GgmlType::TF2, &quantized(GgmlType::TF2, &x), x.len())
    );
}

#[test]
fn tf1_packs_every_code_pattern() {
    // All 3^5 digit patterns of a byte appear, trit 4 slots included.
    let mut x = vec![0f32; 128 * 243];
    for (b, blk) in x.chunks_mut(128).enumerate() {
        for (e, v) in blk.iter_mut().enumerate() {
            let (byte, t) = crate::ternary::tf1_slot(e);
            let digit = (b + byte * 7) / 3usize.pow(t as u32) % 3;
            *v = digit as f32 - 1.0;
        }
    }
    let q = quantized(GgmlType::TF1, &x);
    let got = dequantized(GgmlType::TF1, &q, x.len());
    for (i, (g, w)) in got.iter().zip(&x).enumerate() {
        // Block absmean is 2/3 or so; values are sign(w) · d.
        assert_eq!(g.signum() * (g != &0.0) as i32 as f32, *w, "element {i}");
    }
}

#[test]
fn q8_tf_has_one_scale_per_row_and_exact_lane_sums() {
    let mut rng = Rng(8);
    let x: Vec<f32> = (0..640).map(|_| rng.normalish()).collect();
    let q = quantized(GgmlType::Q8_TF, &x);
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let bs = GgmlType::Q8_TF.type_size();
    for (b, blk) in q.chunks_exact(bs).enumerate() {
        assert_eq!(
            f32::from_le_bytes(blk[0..4].try_into().unwrap()),
            amax / 127.0
        );
        let mut lsums = [0i32; 8];
        for e in 0..128 {
            let v = blk[4 + e] as i8;
            let want = (x[128 * b + e] * 127.0 / amax).round_ties_even();
            assert_eq!(v as f32, want);
            lsums[(e % 32) / 4] += v as i32;
        }
        for (k, want) in lsums.iter().enumerate() {
            let o = 4 + 128 + 4 * k;
            assert_eq!(i32::from_le_bytes(blk[o..o + 4].try_into().unwrap()), *want);
        }
    }
    // Zero rows quantize to zeros with d = 0.
    let z = quantized(GgmlType::Q8_TF, &[0.0; 128]);
    assert!(z.iter().all(|&b| b == 0));
}

#[test]
fn tf_matmul_equals_f64_dot_of_dequantized_operands() {
    let mut rng = Rng(21);
    for ty in [GgmlType::TF2, GgmlType::TF1] {
        for cols in [128usize, 640, 5632] {
            let rows = 3;
            let w: Vec<f32> = (0..rows * cols).map(|_| rng.normalish() * 0.05).collect();
            let wq = quantized(ty, &w);
            let wf = dequantized(ty, &wq, w.len());
            let m = QMatrix::new(ty, rows, cols, &wq).unwrap();
            let x: Vec<f32> = (0..2 * cols).map(|_| rng.normalish()).collect();
            let mut act = Activations::new();
            act.quantize_for(ty, &x, 2, cols).unwrap();
            for isa in Isa::ALL.into_iter().filter(|i| i.is_available()) {
                let mut got = vec![0f32; 2 * rows];
                matmul_with(isa, &m, &act, 0..rows, &mut got, Numerics::Parity).unwrap();
                for t in 0..2 {
                    let af = dequantized(act.ty(), act.row(t), cols);
                    for r in 0..rows {
                        let wr = &wf[r * cols..(r + 1) * cols];
                        let want: f64 =
                            wr.iter().zip(&af).map(|(a, b)| *a as f64 * *b as f64).sum();
                        let tol = 1e-5 * abs_dot(wr, &af) as f64 + 1e-6;
                        let g = got[t * rows + r] as f64;
                        assert!(
                            (g - want).abs() <= tol,
                            "{isa:?} {ty:?} {cols}: {g} vs {want}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn ternary_quantize_row_checks_sizes() {
    let mut small = [0u8; 10];
    assert!(matches!(
        quantize_row(GgmlType::TF2, &[0.0; 128], &mut small),
        Err(KernelError::RowBytes { .. })
    ));
    assert!(matches!(
        quantize_row(GgmlType::TQ2_0, &[0.0; 100], &mut small),
        Err(KernelError::PartialBlock { .. })
    ));
}

#[cfg(target_arch = "x86_64")]
#[test]
fn avx512_plain_and_table_decoders_match_scalar() {
    // On a CPU with AVX512-VBMI and GFNI, `every_simd_matmul_matches_scalar` runs the table
    // decoder of TQ1_0 / TF1; this runs the plain one (the path of AVX-512 CPUs without VBMI)
    // beside it. Random bytes include invalid base-3 bytes (>= 243); one-block rows make every
    // block a row's last (the masked loads), wider rows the plain loads.
    if !Isa::Avx512.is_available() {
        eprintln!("skipped: this CPU lacks AVX-512");
        return;
    }
    if !crate::x86_64::tern_avx512::has_table_decoder() {
        eprintln!("only the plain decoder checked: this CPU lacks AVX512-VBMI or GFNI");
    }
    // Seven rows: one token takes a tile of two pairs, a pair and the odd row. The widest rows
    // (activation rows over 16 KiB) make token blocks of 8, so 9 tokens end in a block of one
    // whose four-row tiles start at token 8. TQ2_0 and TF2 have one decoder; they run here
    // for the row and token shapes.
    let mut rng = Rng(0x7E57);
    for ty in [
        GgmlType::TQ1_0,
        GgmlType::TF1,
        GgmlType::TQ2_0,
        GgmlType::TF2,
    ] {
        let bv = ty.block_size();
        let wide = if bv == 256 { 57 } else { 100 };
        for blocks in [1usize, 2, 5, wide] {
            let cols = bv * blocks;
            let rows = 7;
            let w = super::random_weights(ty, cols * rows, &mut rng);
            let m = QMatrix::new(ty, rows, cols, &w).unwrap();
            let tokens: &[usize] = if blocks == wide { &[9] } else { &[1, 3, 9] };
            for &n in tokens {
                let x: Vec<f32> = (0..n * cols).map(|_| rng.normalish()).collect();
                let mut act = Activations::new();
                act.quantize_for(ty, &x, n, cols).unwrap();
                let run = |isa| {
                    let mut out = vec![f32::NAN; n * rows];
                    matmul_with(isa, &m, &act, 0..rows, &mut out, Numerics::Parity).unwrap();
                    out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                };
                let want = run(Isa::Scalar);
                let table = run(Isa::Avx512);
                let plain = crate::x86_64::tern_avx512::without_vbmi(|| run(Isa::Avx512));
                assert_eq!(table, want, "{ty:?} cols={cols} n={n}: table decoder");
                assert_eq!(plain, want, "{ty:?} cols={cols} n={n}: plain decoder");
            }
        }
    }
}

#[test]
fn tf1_table_gemv_equals_the_scalar_matmul() {
    // The table kernel against the scalar reference, bit for bit: a padded last group, rows of
    // every code pattern (random, all −1, all +1, alternating), activations at ±127 (the
    // largest group sums) and random ones, all groups and group 1 alone, tables in two parts;
    // and a matrix wide and tall enough (66 blocks, 17 groups with today's constants) that the
    // GEMV runs its blocks in passes (the second straddling the two parts) and its groups in
    // two batches.
    if !tf1_lut::Tf1Lut::supported() {
        eprintln!("skipped: no AVX-512 VBMI");
        return;
    }
    let mut rng = Rng(7);
    use crate::x86_64::tf1_lut::{GEMV_BATCH, GEMV_CHUNK};
    for (rows, cols) in [
        (64, 128),
        (150, 384),
        (129, 1024),
        (GEMV_BATCH * 64 + 6, (2 * GEMV_CHUNK + 2) * 128),
    ] {
        let mut w = Vec::new();
        for r in 0..rows {
            let x: Vec<f32> = (0..cols)
                .map(|i| match r % 5 {
                    0 => -1.0 - (i % 3) as f32,
                    1 => 1.0 + (i % 2) as f32,
                    2 => [1.0, -1.0, 0.0][i % 3],
                    _ => rng.normalish(),
                })
                .collect();
            w.extend(quantized(GgmlType::TF1, &x));
        }
        let m = QMatrix::new(GgmlType::TF1, rows, cols, &w).unwrap();
        let lut = tf1_lut::Tf1Lut::pack(&m).unwrap();
        let mut t = tf1_lut::Tf1Tables::default();
        let (mut t0, mut t1) = Default::default();
        for case in 0..4 {
            let a: Vec<f32> = (0..cols)
                .map(|i| match case {
                    0 => 1.0,
                    1 => [1.0, -1.0][i % 2],
                    2 => [1.0, -1.0][(i / 5) % 2] * (1.0 + (i % 7) as f32),
                    _ => rng.normalish(),
                })
                .collect();
            let mut act = Activations::new();
            act.quantize_for(GgmlType::TF1, &a, 1, cols).unwrap();
            let mut want = vec![0f32; rows];
            matmul_with(Isa::Scalar, &m, &act, 0..rows, &mut want, Numerics::Parity).unwrap();
            let nb = lut.blocks();
            lut.tables(&act, 0..nb, &mut t).unwrap();
            let mut got = vec![f32::NAN; rows];
            lut.gemv(&[&t], 0..lut.groups(), &mut got).unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{rows}x{cols} case {case}");
            // The tables in two parts (as threads of a larger pool build them), the first possibly
            // empty.
            lut.tables(&act, 0..nb / 2, &mut t0).unwrap();
            lut.tables(&act, nb / 2..nb, &mut t1).unwrap();
            let mut got = vec![f32::NAN; rows];
            lut.gemv(&[&t0, &t1], 0..lut.groups(), &mut got).unwrap();
            assert_eq!(
                bits(&got),
                bits(&want),
                "{rows}x{cols} case {case}, two parts"
            );
            assert!(
                lut.gemv(&[&t1, &t0], 0..1, &mut got).is_err(),
                "parts out of order"
            );
            assert!(
                lut.gemv(&[&t1], 0..1, &mut got).is_err() || nb / 2 == 0,
                "a part missing"
            );
            if lut.groups() > 1 {
                let mut part = vec![f32::NAN; 64];
                lut.gemv(&[&t], 1..2, &mut part).unwrap();
                let n = (rows - 64).min(64);
                assert_eq!(bits(&part[..n]), bits(&want[64..64 + n]), "group 1");
                // Groups 1.. to the end (a batch starting mid-matrix).
                let mut rest = vec![f32::NAN; rows - 64];
                lut.gemv(&[&t], 1..lut.groups(), &mut rest).unwrap();
                assert_eq!(bits(&rest), bits(&want[64..]), "groups 1..");
            }
        }
    }
}

#[test]
fn tf1_repacked_gemm_equals_the_scalar_matmul() {
    // The multi-token matmul from the repacked layout against the scalar reference, bit for
    // bit: token counts across the pass size (1, 3, 16, 17, 35), a padded last group, rows of
    // every code pattern, activations at ±127 and spread between.
    if !tf1_lut::Tf1Lut::supported() {
        eprintln!("skipped: no AVX-512 VBMI/VNNI");
        return;
    }
    let mut rng = Rng(11);
    for (rows, cols) in [(64, 128), (150, 384), (129, 640)] {
        let mut w = Vec::new();
        for r in 0..rows {
            let x: Vec<f32> = (0..cols)
                .map(|i| match r % 4 {
                    0 => -1.0 - (i % 3) as f32,
                    1 => [1.0, -1.0, 0.0][(i * 7 + r) % 3],
                    _ => rng.normalish(),
                })
                .collect();
            w.extend(quantized(GgmlType::TF1, &x));
        }
        let m = QMatrix::new(GgmlType::TF1, rows, cols, &w).unwrap();
        let lut = tf1_lut::Tf1Lut::pack(&m).unwrap();
        for ntok in [1, 3, 16, 17, 35] {
            // Spikes at ±8 make some values ±127 while the rest (about ±3) spread over the range.
            let a: Vec<f32> = (0..ntok * cols)
                .map(|i| match i % 11 {
                    0 => 8.0,
                    1 => -8.0,
                    _ => rng.normalish(),
                })
                .collect();
            let mut act = Activations::new();
            act.quantize_for(GgmlType::TF1, &a, ntok, cols).unwrap();
            let mut want = vec![0f32; rows * ntok];
            matmul_with(Isa::Scalar, &m, &act, 0..rows, &mut want, Numerics::Parity).unwrap();
            let mut got = vec![f32::NAN; rows * ntok];
            lut.gemm(&act, 0..lut.groups(), &mut got).unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{rows}x{cols}, {ntok} tokens");
            if lut.groups() > 1 {
                let n = (rows - 64).min(64);
                let mut part = vec![f32::NAN; n * ntok];
                lut.gemm(&act, 1..2, &mut part).unwrap();
                for t in 0..ntok {
                    let w = &want[t * rows + 64..t * rows + 64 + n];
                    assert_eq!(
                        bits(&part[t * n..(t + 1) * n]),
                        bits(w),
                        "group 1, token {t}"
                    );
                }
            }
        }
    }
}
