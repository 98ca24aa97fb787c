//! Crate tests: every SIMD path against the scalar reference, the scalar reference against
//! gguf-py goldens (scripts/make-kernel-goldens.py), activation quantization against ggml's
//! reference, the dispatcher, and the registry's completeness.

use crate::dispatch::{choose, kernels_for, Isa};
use crate::*;
use half::f16;

/// splitmix64: a small seeded generator, so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    fn normalish(&mut self) -> f32 {
        (self.f32() + self.f32() + self.f32()) * 1.5
    }
}

/// Byte offsets of the f16 scale fields in one block (ggml-common.h).
fn f16_fields(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::IQ4_NL | GgmlType::IQ4_XS | GgmlType::IQ2_XXS | GgmlType::IQ3_XXS => &[0],
        GgmlType::IQ2_XS | GgmlType::IQ2_S | GgmlType::IQ3_S | GgmlType::IQ1_S => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q6_K => &[208],
        GgmlType::TQ1_0 => &[52],
        GgmlType::TQ2_0 => &[64],
        GgmlType::TF2 | GgmlType::TF1 => &[0],
        _ => &[],
    }
}

/// `n` random, valid elements of `ty`: random bytes with finite scales (2^-10..2^1).
fn random_weights(ty: GgmlType, n: usize, rng: &mut Rng) -> Vec<u8> {
    let bytes = ty.row_size(n as u64).unwrap() as usize;
    match ty {
        GgmlType::F32 => (0..n).flat_map(|_| rng.normalish().to_le_bytes()).collect(),
        GgmlType::F16 => (0..n)
            .flat_map(|_| f16::from_f32(rng.normalish()).to_bits().to_le_bytes())
            .collect(),
        GgmlType::BF16 => (0..n)
            .flat_map(|_| {
                half::bf16::from_f32(rng.normalish())
                    .to_bits()
                    .to_le_bytes()
            })
            .collect(),
        _ => {
            let mut v: Vec<u8> = (0..bytes).map(|_| rng.next() as u8).collect();
            for b in v.chunks_exact_mut(ty.type_size()) {
                let mut scale = || {
                    let mag = (2f32).powf(rng.f32() * 5.5 - 4.5);
                    let s = if rng.next() & 1 == 0 { mag } else { -mag };
                    f16::from_f32(s).to_bits()
                };
                for &off in f16_fields(ty) {
                    b[off..off + 2].copy_from_slice(&scale().to_le_bytes());
                }
                if ty == GgmlType::IQ1_M {
                    // The f16 scale is the top nibbles of the four scale words at 48.
                    let d = scale();
                    for i in 0..4 {
                        let hi = ((d >> (4 * i)) & 0xF) as u8;
                        b[49 + 2 * i] = (b[49 + 2 * i] & 0x0F) | (hi << 4);
                    }
                }
            }
            v
        }
    }
}

const MATMUL_TYPES: [GgmlType; 26] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q5_0,
    GgmlType::Q4_1,
    GgmlType::Q5_1,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
    GgmlType::IQ2_XXS,
    GgmlType::IQ3_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ2_S,
    GgmlType::IQ3_S,
    GgmlType::IQ1_S,
    GgmlType::IQ1_M,
    GgmlType::TQ1_0,
    GgmlType::TQ2_0,
    GgmlType::TF2,
    GgmlType::TF1,
];

fn col_shapes(ty: GgmlType) -> &'static [usize] {
    match ty.block_size() {
        // 8200: more than one token block of the AVX-512 float GEMM at 130 tokens (and, for f16,
        // of its widened activations).
        1 => &[1, 7, 16, 33, 200, 8200],
        // 4128 and 4160: wider than the AVX-512 GEMV's 64-pair column chunk (odd and even).
        32 => &[32, 64, 96, 640, 4128, 4160],
        128 => &[128, 640, 1920],
        // 768: three super-blocks (a partial group of four in the AVX-512 q4_K/q5_K GEMV;
        // Qwen3-30B-A3B's expert down-projection); 2560: wider than the AVX-512 k-quant GEMM's
        // 8-super-block column chunk; 4352: than the rows the k-quant GEMV runs one at a time.
        _ => &[256, 768, 1024, 2560, 4352],
    }
}

/// The bit patterns of `v`, for comparisons that must be exact (NaN and -0 included).
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Σ|w_i·a_i| from the dequantized operands: the scale of the rounding error of a dot.
fn abs_dot(w: &[f32], a: &[f32]) -> f32 {
    w.iter().zip(a).map(|(x, y)| (x * y).abs()).sum()
}

#[test]
fn every_simd_matmul_matches_scalar() {
    let mut rng = Rng(0x5EED);
    let mut checked = 0;
    for ty in MATMUL_TYPES {
        for &cols in col_shapes(ty) {
            for &(nrows, start) in &[(1usize, 0usize), (5, 1), (9, 2)] {
                let total_rows = start + nrows + 1;
                let w = random_weights(ty, cols * total_rows, &mut rng);
                // Misalign: the matrix starts 1 byte into a larger buffer.
                let mut buf = vec![0u8; w.len() + 1];
                buf[1..].copy_from_slice(&w);
                let m = QMatrix::new(ty, total_rows, cols, &buf[1..]).unwrap();
                let mut wf = vec![0f32; cols * total_rows];
                dequantize_row(ty, &w, &mut wf).unwrap();
                for &n in &[1usize, 3, 5, 8, 17, 64, 130] {
                    let x: Vec<f32> = (0..n * cols).map(|_| rng.normalish()).collect();
                    let mut act = Activations::new();
                    act.quantize_for(ty, &x, n, cols).unwrap();
                    let mut af = vec![0f32; n * cols];
                    for t in 0..n {
                        dequantize_row(act.ty(), act.row(t), &mut af[t * cols..(t + 1) * cols])
                            .unwrap();
                    }
                    let rows = start..start + nrows;
                    let mut want = vec![0f32; n * nrows];
                    matmul_with(
                        Isa::Scalar,
                        &m,
                        &act,
                        rows.clone(),
                        &mut want,
                        Numerics::Parity,
                    )
                    .unwrap();
                    for isa in [Isa::Avx2, Isa::Avx512] {
                        if !isa.is_available() {
                            continue;
                        }
                        let mut got = vec![f32::NAN; n * nrows];
                        matmul_with(isa, &m, &act, rows.clone(), &mut got, Numerics::Parity)
                            .unwrap();
                        for t in 0..n {
                            for r in 0..nrows {
                                let i = t * nrows + r;
                                let wr = &wf[(start + r) * cols..(start + r + 1) * cols];
                                let scale = abs_dot(wr, &af[t * cols..(t + 1) * cols]);
                                // Quantized dots sum in exactly the scalar reference's
                                // (llama.cpp's) order on every ISA; float weights within
                                // rounding.
                                let exact = ty.block_size() > 1;
                                let tol = if exact { 0.0 } else { 2e-5 * scale + 1e-30 };
                                assert!(
                                    (got[i] - want[i]).abs() <= tol && !got[i].is_nan(),
                                    "{isa:?} {ty:?} cols={cols} rows={rows:?} n={n} (t={t}, r={r}): got {} want {} tol {tol}",
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
    assert!(checked > 1000, "only {checked} comparisons ran");
}

#[cfg(target_arch = "x86_64")]
#[test]
fn bf16_vdpbf16ps_equals_its_fma_emulation() {
    // The bf16 order is vdpbf16ps's (lane j: + column 2j+1's product, then 2j's); CPUs without
    // AVX512-BF16 emulate it with two FMAs. Normal-range values: the instruction flushes
    // subnormals, the emulation does not.
    let mut rng = Rng(0xBF16);
    let mut ran = 0;
    for &cols in &[7usize, 32, 33, 64, 96, 200, 4128, 14336] {
        for &n in &[1usize, 2, 5, 6, 7, 13, 73] {
            let rows = 9;
            let w = random_weights(GgmlType::BF16, cols * rows, &mut rng);
            let m = QMatrix::new(GgmlType::BF16, rows, cols, &w).unwrap();
            let x: Vec<f32> = (0..n * cols).map(|_| rng.normalish()).collect();
            let mut act = Activations::new();
            act.quantize_for(GgmlType::BF16, &x, n, cols).unwrap();
            let g =
                crate::matmul::Gemm::new(&m, &act, 0..rows, n * rows, Numerics::Parity).unwrap();
            let Some((dp, fma)) = crate::x86_64::avx512::bf16_dp_and_fma(&g) else {
                eprintln!("skipped: this CPU lacks AVX-512 or AVX512-BF16");
                return;
            };
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&dp), bits(&fma), "cols={cols} n={n}");
            ran += 1;
        }
    }
    assert!(ran > 0);
}

#[test]
fn scalar_matmul_equals_dequantized_dot() {
    // Independent of the ggml-style integer path: dequantize both operands and dot in f64.
    let mut rng = Rng(7);
    for ty in MATMUL_TYPES {
        let cols = col_shapes(ty)[1];
        let w = random_weights(ty, cols * 3, &mut rng);
        let m = QMatrix::new(ty, 3, cols, &w).unwrap();
        let x: Vec<f32> = (0..2 * cols).map(|_| rng.normalish()).collect();
        let mut act = Activations::new();
        act.quantize_for(ty, &x, 2, cols).unwrap();
        let mut got = vec![0f32; 6];
        matmul_with(Isa::Scalar, &m, &act, 0..3, &mut got, Numerics::Parity).unwrap();
        let mut wf = vec![0f32; 3 * cols];
        dequantize_row(ty, &w, &mut wf).unwrap();
        for t in 0..2 {
            let mut af = vec![0f32; cols];
            dequantize_row(act.ty(), act.row(t), &mut af).unwrap();
            for r in 0..3 {
                let wr = &wf[r * cols..(r + 1) * cols];
                let want: f64 = wr.iter().zip(&af).map(|(a, b)| *a as f64 * *b as f64).sum();
                let tol = 1e-4 * abs_dot(wr, &af) as f64;
                assert!(
                    (got[t * 3 + r] as f64 - want).abs() <= tol,
                    "{ty:?} t={t} r={r}: {} vs {want}",
                    got[t * 3 + r]
                );
            }
        }
    }
}

#[test]
fn dot_helpers_match_scalar_on_every_isa() {
    let mut rng = Rng(11);
    for n in [0usize, 1, 7, 8, 15, 16, 17, 63, 64, 65, 256, 1000] {
        let a: Vec<f32> = (0..n).map(|_| rng.normalish()).collect();
        let b: Vec<f32> = (0..n).map(|_| rng.normalish()).collect();
        let ah: Vec<f16> = a.iter().map(|v| f16::from_f32(*v)).collect();
        let bh: Vec<f16> = b.iter().map(|v| f16::from_f32(*v)).collect();
        let scale: f32 = a.iter().zip(&b).map(|(x, y)| (x * y).abs()).sum::<f32>() + 1e-30;
        let want32 = scalar::dot_f32(&a, &b);
        let want16 = scalar::dot_f16(&ah, &bh);
        for isa in Isa::ALL {
            let Some(k) = kernels_for(isa) else { continue };
            // Every ISA sums in ggml's AVX-512 order: bit-identical results.
            assert_eq!(
                (k.dot_f32)(&a, &b).to_bits(),
                want32.to_bits(),
                "{isa:?} dot_f32 n={n}"
            );
            assert_eq!(
                (k.dot_f16)(&ah, &bh).to_bits(),
                want16.to_bits(),
                "{isa:?} dot_f16 n={n}"
            );
            if n % 16 == 0 {
                let tb = scalar::dot_f32_tinyblas(&a, &b);
                assert_eq!(
                    (k.dot_f32_tinyblas)(&a, &b).to_bits(),
                    tb.to_bits(),
                    "{isa:?} dot_f32_tinyblas n={n}"
                );
                let exact: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
                assert!(
                    (tb as f64 - exact).abs() <= 1e-5 * scale as f64,
                    "dot_f32_tinyblas n={n}"
                );
            }
            // ... and that order is a faithful dot product.
            let exact: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!(
                (want32 as f64 - exact).abs() <= 1e-5 * scale as f64,
                "dot_f32 n={n}"
            );
        }
    }
    // The public entry points run the selected ISA.
    assert_eq!(dot_f32(&[1.0, 2.0, 3.0], &[4.0, 5.0, 6.0]), 32.0);
    let h = |v: f32| f16::from_f32(v);
    assert_eq!(dot_f16(&[h(1.0), h(-2.0)], &[h(0.5), h(4.0)]), -7.5);
}

#[test]
fn mad_and_scale_are_bit_identical_on_every_isa() {
    let mut rng = Rng(23);
    // Random f16 bit patterns cover subnormals, infinities and NaNs; normal-ish values and
    // factors that overflow or underflow exercise the rounding on the way back to f16.
    let value = |rng: &mut Rng| match rng.next() % 4 {
        0 => f16::from_bits(rng.next() as u16),
        _ => f16::from_f32(rng.normalish() * 4.0),
    };
    for n in [0usize, 1, 7, 8, 9, 15, 16, 17, 31, 33, 64, 256, 257, 1000] {
        let x: Vec<f16> = (0..n).map(|_| value(&mut rng)).collect();
        let y0: Vec<f16> = (0..n).map(|_| value(&mut rng)).collect();
        for v in [0.0f32, 1.0, -0.3, 1.7e-3, 3.1e4, 1e-9, rng.normalish()] {
            let mut want_mad = y0.clone();
            scalar::mad_f16(&mut want_mad, &x, v);
            let mut want_scale = y0.clone();
            scalar::scale_f16(&mut want_scale, v);
            for isa in Isa::ALL {
                let Some(k) = kernels_for(isa) else { continue };
                // Unaligned sub-slices too: the SIMD loads must not assume alignment.
                for off in [0usize, 1] {
                    if off > n {
                        continue;
                    }
                    let mut got = y0.clone();
                    (k.mad_f16)(&mut got[off..], &x[off..], v);
                    let mut want = y0.clone();
                    scalar::mad_f16(&mut want[off..], &x[off..], v);
                    let bits = |s: &[f16]| s.iter().map(|h| h.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{isa:?} mad_f16 n={n} off={off} v={v}"
                    );
                    let mut got = y0.clone();
                    (k.scale_f16)(&mut got[off..], v);
                    let mut want = y0.clone();
                    scalar::scale_f16(&mut want[off..], v);
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{isa:?} scale_f16 n={n} off={off} v={v}"
                    );
                }
            }
            // f32 mad on the widened values, same rule: bit-identical on every ISA.
            let xf: Vec<f32> = x.iter().map(|h| h.to_f32()).collect();
            let yf: Vec<f32> = y0.iter().map(|h| h.to_f32() * 1.37).collect();
            let mut want_f32 = yf.clone();
            scalar::mad_f32(&mut want_f32, &xf, v);
            for isa in Isa::ALL {
                let Some(k) = kernels_for(isa) else { continue };
                for off in [0usize, 1].into_iter().filter(|&o| o <= n) {
                    let mut got = yf.clone();
                    (k.mad_f32)(&mut got[off..], &xf[off..], v);
                    let mut want = yf.clone();
                    scalar::mad_f32(&mut want[off..], &xf[off..], v);
                    let bits = |s: &[f32]| s.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{isa:?} mad_f32 n={n} off={off} v={v}"
                    );
                }
            }
            let mut got = yf.clone();
            mad_f32(&mut got, &xf, v);
            assert!(got
                .iter()
                .zip(&want_f32)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            // The public entry points run the selected ISA with the same results.
            let mut got = y0.clone();
            mad_f16(&mut got, &x, v);
            assert!(got
                .iter()
                .zip(&want_mad)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            let mut got = y0.clone();
            scale_f16(&mut got, v);
            assert!(got
                .iter()
                .zip(&want_scale)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }
}

#[test]
fn override_parsing() {
    let all = |_: Isa| true;
    let no512 = |i: Isa| i != Isa::Avx512;
    let scalar_only = |i: Isa| i == Isa::Scalar;
    assert_eq!(choose(None, all), (Isa::Avx512, None));
    assert_eq!(choose(None, no512), (Isa::Avx2, None));
    assert_eq!(choose(None, scalar_only), (Isa::Scalar, None));
    assert_eq!(choose(Some(""), all), (Isa::Avx512, None));
    assert_eq!(choose(Some("scalar"), all), (Isa::Scalar, None));
    assert_eq!(choose(Some(" AVX2 "), all), (Isa::Avx2, None));
    assert_eq!(choose(Some("avx512"), all), (Isa::Avx512, None));
    assert_eq!(choose(Some("avx512-vnni"), all), (Isa::Avx512, None));
    let (isa, note) = choose(Some("avx512"), no512);
    assert_eq!(isa, Isa::Avx2);
    assert!(note.unwrap().contains("lacks"));
    let (isa, note) = choose(Some("neon"), no512);
    assert_eq!(isa, Isa::Avx2);
    let note = note.unwrap();
    assert!(
        note.contains("\"neon\"") && note.contains("expected scalar, avx2 or avx512"),
        "{note}"
    );
    // The process-wide choice is consistent with itself.
    assert_eq!(isa_name(), crate::isa().name());
    assert!(crate::isa().is_available());
}

#[test]
fn registry_is_complete() {
    // Every weight type with a vec_dot_type has a scalar, AVX2 and AVX-512 matmul and a
    // dequantizer, and its activation type can be produced by quantize_row.
    let mut n = 0;
    for ty in GgmlType::ALL {
        let Some(act) = vec_dot_type(ty) else {
            continue;
        };
        n += 1;
        assert!(can_dequantize(ty), "{ty:?} has no dequantizer");
        assert!(can_dequantize(act), "{act:?} has no dequantizer");
        let mut buf = vec![0u8; act.row_size(QK_K as u64).unwrap() as usize];
        quantize_row(act, &[0.5; QK_K], &mut buf).unwrap();
        for isa in Isa::ALL {
            // Scalar always exists; the SIMD ones must exist whenever the CPU has them.
            if let Some(k) = kernels_for(isa) {
                assert!(k.matmul(ty).is_some(), "{isa:?} has no matmul for {ty:?}");
            }
        }
        assert!(crate::scalar::has_dot(ty));
        #[cfg(target_arch = "x86_64")]
        {
            // Independently of this CPU: the tables list the type.
            assert!(
                crate::x86_64::avx2::has_matmul(ty),
                "avx2 table lacks {ty:?}"
            );
            assert!(
                crate::x86_64::avx512::has_matmul(ty),
                "avx512 table lacks {ty:?}"
            );
        }
    }
    assert_eq!(n, MATMUL_TYPES.len());
    for ty in MATMUL_TYPES {
        assert!(vec_dot_type(ty).is_some());
    }
}

fn le_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

macro_rules! golden {
    ($name:literal) => {
        (
            &include_bytes!(concat!("../tests/data/", $name, ".bin"))[..],
            &include_bytes!(concat!("../tests/data/", $name, ".f32"))[..],
        )
    };
}

#[test]
fn dequantize_matches_gguf_py_goldens() {
    type Golden = (&'static [u8], &'static [u8]);
    let cases: [(GgmlType, Golden); 23] = [
        (GgmlType::F16, golden!("f16")),
        (GgmlType::BF16, golden!("bf16")),
        (GgmlType::Q4_0, golden!("q4_0")),
        (GgmlType::Q4_1, golden!("q4_1")),
        (GgmlType::Q5_0, golden!("q5_0")),
        (GgmlType::Q5_1, golden!("q5_1")),
        (GgmlType::Q8_0, golden!("q8_0")),
        (GgmlType::Q2_K, golden!("q2_k")),
        (GgmlType::Q3_K, golden!("q3_k")),
        (GgmlType::Q4_K, golden!("q4_k")),
        (GgmlType::Q5_K, golden!("q5_k")),
        (GgmlType::Q6_K, golden!("q6_k")),
        (GgmlType::TQ1_0, golden!("tq1_0")),
        (GgmlType::TQ2_0, golden!("tq2_0")),
        (GgmlType::IQ4_NL, golden!("iq4_nl")),
        (GgmlType::IQ4_XS, golden!("iq4_xs")),
        (GgmlType::IQ2_XXS, golden!("iq2_xxs")),
        (GgmlType::IQ3_XXS, golden!("iq3_xxs")),
        (GgmlType::IQ2_XS, golden!("iq2_xs")),
        (GgmlType::IQ2_S, golden!("iq2_s")),
        (GgmlType::IQ3_S, golden!("iq3_s")),
        (GgmlType::IQ1_S, golden!("iq1_s")),
        (GgmlType::IQ1_M, golden!("iq1_m")),
    ];
    for (ty, (raw, want)) in cases {
        let want = le_f32(want);
        assert!(!want.is_empty());
        let mut got = vec![0f32; want.len()];
        dequantize_row(ty, raw, &mut got).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            // gguf-py may round an intermediate product differently: allow 1 ulp.
            let ulps = (g.to_bits() as i64 - w.to_bits() as i64).abs();
            assert!(g == w || ulps <= 1, "{ty:?}[{i}]: got {g} want {w}");
        }
    }
}

/// ggml-cpu/arch/x86/quants.c `quantize_row_q8_0` (AVX2 path), transcribed independently:
/// scale 127/amax, round half to even.
fn q8_0_x86(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for xb in x.chunks(QK) {
        let amax = xb.iter().map(|v| v.abs()).fold(0f32, f32::max);
        out.extend(half::f16::from_f32(amax / 127.0).to_bits().to_le_bytes());
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        out.extend(xb.iter().map(|v| (v * id).round_ties_even() as i8 as u8));
    }
    out
}

/// Activation rows that probe a q8 quantizer: ties (amax 127 makes the factor exactly 1, so
/// every k + 0.5 is one: even k up, odd k down), random blocks and a zero block — then two
/// blocks holding a NaN and an infinity (the guarded slow path). Returns the values and how
/// many come before the NaN / infinity blocks.
fn q8_probe_rows(seed: u64) -> (Vec<f32>, usize) {
    let mut rng = Rng(seed);
    let mut x: Vec<f32> = (0..256).map(|i| (i % 255) as f32 - 127.0 + 0.5).collect();
    x[0] = 127.0;
    x[32] = -127.0;
    x.extend((0..32 * 40).map(|_| rng.normalish() * 3.0));
    x.extend([0.0f32; 32]);
    let clean = x.len();
    let mut odd = vec![1.0f32; 64];
    odd[3] = f32::NAN;
    odd[40] = f32::INFINITY;
    x.extend(odd);
    (x, clean)
}

#[test]
fn quantize_q8_0_is_bit_exact_on_ties_and_odd_inputs() {
    let (x, _) = q8_probe_rows(77);
    let mut got = vec![0u8; GgmlType::Q8_0.row_size(x.len() as u64).unwrap() as usize];
    quantize_row(GgmlType::Q8_0, &x, &mut got).unwrap();
    assert_eq!(got, q8_0_x86(&x));
}

/// ggml-cpu/arch/x86/quants.c `quantize_row_q8_1` (AVX2 path), transcribed independently: q8_0's
/// scale and codes, then `s = f16(d · Σq)` with the f32 `d = amax / 127`.
fn q8_1_x86(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for (xb, q0) in x.chunks(QK).zip(q8_0_x86(x).chunks(34)) {
        let amax = xb.iter().map(|v| v.abs()).fold(0f32, f32::max);
        let sum: i32 = q0[2..].iter().map(|&q| q as i8 as i32).sum();
        out.extend_from_slice(&q0[..2]);
        out.extend(
            half::f16::from_f32(amax / 127.0 * sum as f32)
                .to_bits()
                .to_le_bytes(),
        );
        out.extend_from_slice(&q0[2..]);
    }
    out
}

#[test]
fn quantize_q8_1_is_bit_exact_with_llama_cpp_x86_on_every_isa() {
    // The NaN / infinity blocks (the guarded slow path, which only the reference's folds
    // define) are compared between implementations, not with q8_1_x86.
    let (x, clean) = q8_probe_rows(78);
    let bytes = GgmlType::Q8_1.row_size(x.len() as u64).unwrap() as usize;
    let mut want = vec![0u8; bytes];
    quantize_row(GgmlType::Q8_1, &x, &mut want).unwrap();
    let clean_bytes = clean / QK * 36;
    assert_eq!(want[..clean_bytes], q8_1_x86(&x[..clean])[..]);
    for isa in Isa::ALL {
        let Some(k) = kernels_for(isa) else { continue };
        let mut got = vec![0u8; bytes];
        assert!((k.quantize)(GgmlType::Q8_1, &x, &mut got));
        assert_eq!(got, want, "{isa:?}");
    }
}

#[test]
fn quantize_q8_0_matches_llama_cpp_x86_and_gguf_py_within_one_step() {
    let x = le_f32(include_bytes!("../tests/data/q8_0_quant_in.f32"));
    let want = include_bytes!("../tests/data/q8_0_quant.bin");
    let mut got = vec![0u8; want.len()];
    quantize_row(GgmlType::Q8_0, &x, &mut got).unwrap();
    assert_eq!(
        got,
        q8_0_x86(&x),
        "bit-exact with llama.cpp's x86 quantize_row_q8_0"
    );
    // gguf-py follows the portable reference (1/d, ties away from zero): same scale, and
    // quants at most one step apart (only on ties / 1-ulp products).
    for (b, ((g, w), xb)) in got
        .chunks(34)
        .zip(want.chunks(34))
        .zip(x.chunks(QK))
        .enumerate()
    {
        assert_eq!(g[..2], w[..2], "q8_0 block {b} scale");
        let amax = xb.iter().map(|v| v.abs()).fold(0f32, f32::max);
        for (i, (a, c)) in g[2..].iter().zip(&w[2..]).enumerate() {
            if a != c {
                // Only a value that scales to (almost) exactly k + 0.5 may round differently.
                let t = (xb[i] * 127.0 / amax).abs();
                assert!(
                    ((t - t.trunc()) - 0.5).abs() < 1e-3
                        && (*a as i8 as i32 - *c as i8 as i32).abs() == 1,
                    "q8_0 block {b}[{i}]: {} vs gguf-py {} for {}",
                    *a as i8,
                    *c as i8,
                    xb[i]
                );
            }
        }
    }
}

/// ggml-quants.c `quantize_row_q8_K_ref`, transcribed independently of `scalar.rs` (round via
/// `f32::round_ties_even`, the documented effect of ggml's `nearest_int`).
fn q8k_ref(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for xb in x.chunks(QK_K) {
        let (mut max, mut amax) = (0f32, 0f32);
        for &v in xb {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            out.extend([0u8; 292]);
            continue;
        }
        let iscale = -127.0 / max;
        let qs: Vec<i8> = xb
            .iter()
            .map(|v| ((iscale * v).round_ties_even() as i32).min(127) as i8)
            .collect();
        out.extend((1.0 / iscale).to_le_bytes());
        out.extend(qs.iter().map(|q| *q as u8));
        for j in 0..16 {
            let s: i16 = qs[16 * j..16 * j + 16].iter().map(|q| *q as i16).sum();
            out.extend(s.to_le_bytes());
        }
    }
    out
}

#[test]
fn quantize_q8_k_matches_ggml_reference_and_round_trips() {
    let mut rng = Rng(3);
    let mut x: Vec<f32> = (0..QK_K * 6).map(|_| rng.normalish()).collect();
    x[QK_K..2 * QK_K].fill(0.0);
    for (i, v) in x[2 * QK_K..3 * QK_K].iter_mut().enumerate() {
        *v = i as f32 - 127.5; // max |v| = 128.5 at the end: scaled ties
    }
    x[4 * QK_K + 3] = 1e6; // one outlier
    let mut got = vec![0u8; 6 * 292];
    quantize_row(GgmlType::Q8_K, &x, &mut got).unwrap();
    assert_eq!(got, q8k_ref(&x));
    let mut back = vec![0f32; x.len()];
    dequantize_row(GgmlType::Q8_K, &got, &mut back).unwrap();
    for (b, (xb, yb)) in x.chunks(QK_K).zip(back.chunks(QK_K)).enumerate() {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (v, y) in xb.iter().zip(yb) {
            assert!(
                (v - y).abs() <= amax / 127.0 * 0.5001 + 1e-30,
                "block {b}: {v} -> {y}"
            );
        }
    }
}

#[test]
fn quantize_q8_0_round_trips_within_half_step() {
    let mut rng = Rng(5);
    let x: Vec<f32> = (0..QK * 40).map(|_| rng.normalish() * 10.0).collect();
    let mut q = vec![0u8; 40 * 34];
    quantize_row(GgmlType::Q8_0, &x, &mut q).unwrap();
    let mut back = vec![0f32; x.len()];
    dequantize_row(GgmlType::Q8_0, &q, &mut back).unwrap();
    for (xb, yb) in x.chunks(QK).zip(back.chunks(QK)) {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (v, y) in xb.iter().zip(yb) {
            // d is rounded to f16 (rel. 2^-11), so allow a little over half a step.
            assert!(
                (v - y).abs() <= amax / 127.0 * 0.5 + amax * 1e-3,
                "{v} -> {y}"
            );
        }
    }
}

#[test]
fn float_activation_conversions_are_round_to_nearest_even() {
    let x = [
        1.0f32,
        1.0 + 2f32.powi(-11),
        1.0 + 3.0 * 2f32.powi(-11),
        -0.0,
        65504.0,
        1.0 + 2f32.powi(-8),
    ];
    let mut h = vec![0u8; 12];
    quantize_row(GgmlType::F16, &x, &mut h).unwrap();
    let bits: Vec<u16> = h
        .chunks(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect();
    assert_eq!(bits, [0x3C00, 0x3C00, 0x3C02, 0x8000, 0x7BFF, 0x3C04]);
    let mut b = vec![0u8; 12];
    quantize_row(GgmlType::BF16, &x, &mut b).unwrap();
    let bits: Vec<u16> = b
        .chunks(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect();
    // 1 + 2^-8 is exactly halfway between two bf16 values: ties to even (0x3F80).
    assert_eq!(bits, [0x3F80, 0x3F80, 0x3F80, 0x8000, 0x4780, 0x3F80]);
}

#[test]
fn sizes_are_validated_with_clear_errors() {
    let e = dequantize_row(GgmlType::Q4_K, &[0u8; 10], &mut [0f32; 100]).unwrap_err();
    assert!(
        matches!(
            e,
            KernelError::PartialBlock {
                cols: 100,
                block: 256,
                ..
            }
        ),
        "{e}"
    );
    let e = dequantize_row(GgmlType::Q4_0, &[0u8; 17], &mut [0f32; 32]).unwrap_err();
    assert_eq!(e.to_string(), "Q4_0: 32 elements take 18 bytes, got 17");
    let e = QMatrix::new(GgmlType::Q8_0, 2, 64, &[0u8; 135]).unwrap_err();
    assert!(e.to_string().contains("needs 136 bytes, got 135"), "{e}");
    let w = vec![0u8; 2 * 68];
    let m = QMatrix::new(GgmlType::Q8_0, 2, 64, &w).unwrap();
    let mut act = Activations::new();
    act.quantize_for(GgmlType::Q4_K, &[0.0; 256], 1, 256)
        .unwrap();
    let e = matmul(&m, &act, 0..2, &mut [0.0; 2], Numerics::Parity).unwrap_err();
    assert!(
        matches!(
            e,
            KernelError::ActivationType {
                want: GgmlType::Q8_0,
                got: GgmlType::Q8_K,
                ..
            }
        ),
        "{e}"
    );
    act.quantize_for(GgmlType::Q8_0, &[0.0; 128], 2, 64)
        .unwrap();
    assert_eq!(
        matmul(&m, &act, 1..3, &mut [0.0; 4], Numerics::Parity).unwrap_err(),
        KernelError::RowRange {
            start: 1,
            end: 3,
            rows: 2
        }
    );
    assert!(matches!(
        matmul(&m, &act, 0..2, &mut [0.0; 3], Numerics::Parity).unwrap_err(),
        KernelError::InputLen {
            want: 4,
            got: 3,
            ..
        }
    ));
    matmul(&m, &act, 0..2, &mut [0.0; 4], Numerics::Parity).unwrap();
    matmul(&m, &act, 1..1, &mut [], Numerics::Parity).unwrap();
    let e = act
        .quantize_for(GgmlType::Q8_K, &[0.0; 256], 1, 256)
        .unwrap_err();
    assert!(matches!(
        e,
        KernelError::Unsupported {
            ty: GgmlType::Q8_K,
            ..
        }
    ));
    assert!(act.quantize_for(GgmlType::Q8_0, &[0.0; 10], 1, 64).is_err());
    assert!(quantize_row(GgmlType::Q4_0, &[0.0; 32], &mut [0u8; 18]).is_err());
    assert!(dequantize_row(GgmlType::I32, &[0u8; 4], &mut [0f32; 1]).is_err());
}

#[test]
fn activations_reuse_their_buffers() {
    let mut act = Activations::new();
    act.quantize_for(GgmlType::Q8_0, &vec![1.0; 8 * 640], 8, 640)
        .unwrap();
    let p = act.row(0).as_ptr();
    act.quantize_for(GgmlType::Q5_0, &vec![2.0; 640], 1, 640)
        .unwrap();
    assert_eq!(act.row(0).as_ptr(), p, "a smaller quantization reallocated");
    assert_eq!((act.n(), act.cols(), act.ty()), (1, 640, GgmlType::Q8_0));
}

#[test]
fn matmul_n_zero_and_empty_ranges_are_fine() {
    let mut rng = Rng(9);
    let w = random_weights(GgmlType::Q6_K, 256 * 4, &mut rng);
    let m = QMatrix::new(GgmlType::Q6_K, 4, 256, &w).unwrap();
    let mut act = Activations::new();
    act.quantize_for(GgmlType::Q6_K, &[], 0, 256).unwrap();
    for isa in Isa::ALL.into_iter().filter(|i| i.is_available()) {
        matmul_with(isa, &m, &act, 0..4, &mut [], Numerics::Parity).unwrap();
    }
}

#[test]
fn matmul_with_zero_columns_writes_zeros() {
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
    ] {
        let m = QMatrix::new(ty, 5, 0, &[]).unwrap();
        let mut act = Activations::new();
        act.quantize_for(ty, &[], 1, 0).unwrap();
        for isa in Isa::ALL.into_iter().filter(|i| i.is_available()) {
            let mut out = [f32::NAN; 5];
            matmul_with(isa, &m, &act, 0..5, &mut out, Numerics::Parity).unwrap();
            assert!(
                out.iter().all(|v| v.to_bits() == 0),
                "{isa:?} {ty:?}: {out:?}"
            );
        }
    }
}

#[test]
fn flash_attention_pieces_are_bit_identical_on_every_isa() {
    let mut rng = Rng(23);
    for (dk, w) in [
        (1usize, 1usize),
        (64, 64),
        (256, 64),
        (80, 37),
        (128, 17),
        (3, 70),
    ] {
        for rows in [1usize, 2, 3, 4, 5, 9] {
            let q: Vec<f32> = (0..rows * dk).map(|_| rng.normalish()).collect();
            let kt: Vec<f32> = (0..dk * w).map(|_| rng.normalish()).collect();
            let mut want = vec![0f32; rows * w];
            scalar::fa_scores(&q, &kt, w, &mut want);
            // The reference is a faithful dot product (one FMA chain per key).
            for r in 0..rows {
                for j in 0..w {
                    let qr = &q[r * dk..(r + 1) * dk];
                    let exact: f64 = (0..dk).map(|d| qr[d] as f64 * kt[d * w + j] as f64).sum();
                    let scale: f64 = (0..dk).map(|d| (qr[d] * kt[d * w + j]).abs() as f64).sum();
                    assert!((want[r * w + j] as f64 - exact).abs() <= 1e-5 * scale + 1e-30);
                }
            }
            let p: Vec<f32> = (0..rows * w).map(|_| rng.f32()).collect();
            let v: Vec<f32> = (0..w * dk).map(|_| rng.normalish()).collect();
            let acc0: Vec<f32> = (0..rows * dk).map(|_| rng.normalish()).collect();
            let mut want_pv = acc0.clone();
            scalar::fa_pv(&mut want_pv, &p, &v, dk);
            for isa in Isa::ALL {
                let Some(k) = kernels_for(isa) else { continue };
                let mut got = vec![f32::NAN; rows * w];
                (k.fa_scores)(&q, &kt, w, &mut got);
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "{isa:?} fa_scores dk={dk} w={w} rows={rows}"
                );
                let mut acc = acc0.clone();
                (k.fa_pv)(&mut acc, &p, &v, dk);
                assert_eq!(
                    bits(&acc),
                    bits(&want_pv),
                    "{isa:?} fa_pv dk={dk} w={w} rows={rows}"
                );
            }
        }
    }
}

#[test]
fn softmax_exp_follows_ggml_v_expf_on_every_isa() {
    let mut rng = Rng(29);
    // Scores below a max, with the values that take the special paths: -inf (masked), far
    // below (subnormal and zero results), exactly the max, NaN.
    let mut x: Vec<f32> = (0..200).map(|_| -rng.f32() * 30.0).collect();
    x.extend([
        f32::NEG_INFINITY,
        -87.0,
        -100.0,
        -104.0,
        -140.0,
        -200.0,
        0.0,
        -0.0,
        f32::NAN,
    ]);
    x.extend((0..23).map(|i| -(i as f32) * 0.37));
    for n in [0usize, 5, 16, 31, 64, x.len()] {
        let mut want = x[..n].to_vec();
        let sum = scalar::softmax_exp(&mut want, 0.0);
        for (i, (&w, &xi)) in want.iter().zip(&x[..n]).enumerate() {
            if xi.is_nan() {
                assert!(w.is_nan());
                continue;
            }
            // ggml's polynomial is within a few ulp of exp (and exactly 0 for masked scores).
            let e = (xi as f64).exp();
            assert!(
                (w as f64 - e).abs() <= 4e-7 * e + 1e-44,
                "x[{i}] = {xi}: {w} vs {e}"
            );
        }
        for isa in Isa::ALL {
            let Some(k) = kernels_for(isa) else { continue };
            let mut got = x[..n].to_vec();
            let s = (k.softmax_exp)(&mut got, 0.0);
            assert_eq!(s.to_bits(), sum.to_bits(), "{isa:?} sum n={n}");
            for i in 0..n {
                assert!(
                    got[i].to_bits() == want[i].to_bits() || (got[i].is_nan() && want[i].is_nan()),
                    "{isa:?} n={n} x[{i}]={}: {} vs {}",
                    x[i],
                    got[i],
                    want[i]
                );
            }
        }
    }
}

mod batched;
mod invariant;
mod ternary;

#[test]
fn every_isa_quantizes_activations_bit_identically_to_the_scalar_reference() {
    // Per 256-value block (a q8_K block, eight q8_0 blocks): random values, exact ties after
    // scaling, zeros, negative zero, a value of largest magnitude appearing with both signs
    // (q8_K keeps the first), an infinity, a NaN, denormals and huge finite values.
    let mut rng = Rng(91);
    let mut x: Vec<f32> = Vec::new();
    let block = |f: &mut dyn FnMut(usize) -> f32| (0..QK_K).map(f).collect::<Vec<f32>>();
    x.extend(block(&mut |_| rng.normalish() * 4.0));
    x.extend(block(&mut |i| (i % 255) as f32 - 127.0 + 0.5));
    x.extend(block(&mut |_| 0.0));
    x.extend(block(&mut |i| if i % 3 == 0 { -0.0 } else { 0.0 }));
    x.extend(block(&mut |i| match i {
        5 => -3.0,
        9 => 3.0,
        _ => (i as f32 * 0.01).sin(),
    }));
    x.extend(block(&mut |i| match i {
        5 => 3.0,
        9 => -3.0,
        _ => (i as f32 * 0.01).cos(),
    }));
    x.extend(block(&mut |i| if i == 77 { f32::INFINITY } else { 1.0 }));
    x.extend(block(&mut |i| if i == 200 { f32::NAN } else { -1.0 }));
    x.extend(block(&mut |i| f32::from_bits(1 + i as u32)));
    x.extend(block(&mut |i| (i as f32 - 128.0) * 1e36));
    for ty in [GgmlType::Q8_0, GgmlType::Q8_K] {
        let rb = ty.row_size(x.len() as u64).unwrap() as usize;
        let mut want = vec![0u8; rb];
        assert!(crate::scalar::quantize(ty, &x, &mut want));
        for isa in Isa::ALL {
            let Some(k) = kernels_for(isa) else { continue };
            let mut got = vec![0xA5u8; rb];
            assert!((k.quantize)(ty, &x, &mut got));
            let bs = ty.type_size();
            for (b, (g, w)) in got.chunks(bs).zip(want.chunks(bs)).enumerate() {
                assert_eq!(g, w, "{ty:?} {}: block {b} differs", isa.name());
            }
        }
    }
    // Q8_TF has one scale per row: each 256-value block above is a row of its own (the
    // infinity and NaN rows and the denormal row, whose factor overflows, take the reference's
    // path; the huge row the SIMD one), then the finite rows together, a row of seven 128-value
    // blocks, and a row of exact ties (amax 127, so every value·127/amax is k + 0.5).
    let q8tf = |row: &[f32]| {
        let ty = GgmlType::Q8_TF;
        let rb = ty.row_size(row.len() as u64).unwrap() as usize;
        let mut want = vec![0u8; rb];
        assert!(crate::scalar::quantize(ty, row, &mut want));
        for isa in Isa::ALL {
            let Some(k) = kernels_for(isa) else { continue };
            let mut got = vec![0xA5u8; rb];
            assert!((k.quantize)(ty, row, &mut got));
            assert_eq!(got, want, "Q8_TF {} row of {}", isa.name(), row.len());
        }
    };
    for row in x.chunks(QK_K) {
        q8tf(row);
    }
    q8tf(&x[..6 * QK_K]);
    q8tf(&x[QK_K..4 * QK_K + 128]);
    let ties: Vec<f32> = (0..QK_K)
        .map(|i| {
            if i == 7 {
                -127.0
            } else {
                (i % 253) as f32 - 126.5
            }
        })
        .collect();
    q8tf(&ties);
    // The float activation types, element by element: also random bit patterns, NaNs with
    // their payload only in the low half (plain rounding would make them infinities) or
    // signalling, the largest finite value, exact bf16 rounding ties, and a tail shorter than
    // a vector.
    x.extend((0..QK_K).map(|_| f32::from_bits(rng.next() as u32)));
    x.extend(
        [
            0x7F80_0001u32,
            0xFF80_0001,
            0x7FA0_0000,
            0x7FFF_FFFF,
            0x7F7F_FFFF,
            0xFF7F_FFFF,
        ]
        .map(f32::from_bits),
    );
    x.extend((0..QK_K as u32).map(|i| f32::from_bits((i << 17) | 0x8000 | ((i & 1) << 16))));
    for ty in [GgmlType::F16, GgmlType::BF16] {
        for n in [x.len(), x.len() - 3, 5] {
            let mut want = vec![0u8; 2 * n];
            assert!(crate::scalar::quantize(ty, &x[..n], &mut want));
            for isa in Isa::ALL {
                let Some(k) = kernels_for(isa) else { continue };
                let mut got = vec![0xA5u8; 2 * n];
                assert!((k.quantize)(ty, &x[..n], &mut got));
                assert_eq!(got, want, "{ty:?} {} n={n}", isa.name());
            }
        }
    }
}

#[test]
fn swiglu_is_the_same_on_every_isa_and_close_to_silu() {
    let mut rng = Rng(41);
    // Gate values across the polynomial's range, the clamps (|x| large: exp over/underflows),
    // zeros, NaN and infinities; lengths with and without a tail.
    let mut g: Vec<f32> = (0..300).map(|_| rng.normalish() * 6.0).collect();
    g.extend([
        0.0, -0.0, 88.0, -88.0, 104.0, -104.0, 150.0, -150.0, 300.0, -300.0,
    ]);
    g.extend([f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e-40, -1e-40]);
    let u: Vec<f32> = (0..g.len()).map(|_| rng.normalish()).collect();
    for n in [0usize, 7, 16, 33, g.len()] {
        let mut want = g[..n].to_vec();
        crate::scalar::swiglu(&mut want, &u[..n]);
        for (i, (&w, (&x, &ui))) in want.iter().zip(g.iter().zip(&u)).enumerate() {
            if !x.is_finite() || x.abs() > 80.0 {
                continue;
            }
            let e = x as f64 / (1.0 + (-(x as f64)).exp()) * ui as f64;
            assert!(
                (w as f64 - e).abs() <= 1e-6 * e.abs() + 1e-30,
                "x[{i}] = {x}: {w} vs {e}"
            );
        }
        for isa in Isa::ALL {
            let Some(k) = kernels_for(isa) else { continue };
            let mut got = g[..n].to_vec();
            (k.swiglu)(&mut got, &u[..n]);
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "{} n={n} x[{i}] = {}",
                    isa.name(),
                    g[i]
                );
            }
        }
    }
}

#[test]
fn widen_transpose_is_a_transposed_copy_on_every_isa() {
    let mut rng = Rng(61);
    for (rows, cols) in [
        (1, 1),
        (16, 16),
        (64, 256),
        (17, 33),
        (63, 64),
        (5, 100),
        (64, 80),
    ] {
        let ss = cols + 3;
        let src: Vec<f16> = (0..rows * ss)
            .map(|_| f16::from_f32(rng.normalish()))
            .collect();
        let ds = rows + 5;
        let mut want = vec![f32::NAN; cols * ds];
        for r in 0..rows {
            for c in 0..cols {
                want[c * ds + r] = src[r * ss + c].to_f32();
            }
        }
        for isa in Isa::ALL {
            let Some(k) = kernels_for(isa) else { continue };
            let mut got = vec![f32::NAN; cols * ds];
            (k.widen_transpose_f16)(&src, ss, rows, cols, &mut got, ds);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    w.to_bits(),
                    "{} {rows}x{cols} at {i}",
                    isa.name()
                );
            }
        }
    }
}
