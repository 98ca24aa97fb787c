//! GEMV (decode) and GEMM (prefill) throughput per ISA.
//!
//! Prints, before the criterion runs, a summary per case: GB/s of weight bytes read, the
//! fraction of the one-core read roofline (27 GB/s measured on the dev box, override with
//! `ROOFLINE_GBS`), and the speed-up over the scalar reference measured in the same run.
//! Shapes are the hot matrices of Gemma 3 270M Q4_K_M plus 4096² k-quants.
//!
//! Multi-token (GEMM) cases run in both [`Numerics`]: the summary prints Invariant's time over
//! Parity's. `KERNELS_SKIP_SCALAR=1` leaves the (slow) scalar reference out of the summary.
//!
//! `cargo bench -p ternfleet-kernels -- --test` runs every case once (CI keeps it compiling).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::time::{Duration, Instant};
use ternfleet_kernels::{matmul_with, Activations, GgmlType, Isa, Numerics, QMatrix};

struct Case {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    n: usize,
}

const GEMV: [Case; 5] = [
    Case {
        ty: GgmlType::Q8_0,
        rows: 262144,
        cols: 640,
        n: 1,
    },
    Case {
        ty: GgmlType::Q5_0,
        rows: 2048,
        cols: 640,
        n: 1,
    },
    Case {
        ty: GgmlType::Q4_K,
        rows: 4096,
        cols: 4096,
        n: 1,
    },
    Case {
        ty: GgmlType::Q6_K,
        rows: 4096,
        cols: 4096,
        n: 1,
    },
    Case {
        ty: GgmlType::Q5_K,
        rows: 4096,
        cols: 4096,
        n: 1,
    },
];

const GEMM: [Case; 4] = [
    Case {
        ty: GgmlType::Q8_0,
        rows: 4096,
        cols: 640,
        n: 64,
    },
    Case {
        ty: GgmlType::Q5_0,
        rows: 2048,
        cols: 640,
        n: 64,
    },
    Case {
        ty: GgmlType::Q4_K,
        rows: 4096,
        cols: 4096,
        n: 64,
    },
    Case {
        ty: GgmlType::Q6_K,
        rows: 4096,
        cols: 4096,
        n: 64,
    },
];

/// Random weights with small finite f16 scales, or small float values (xorshift, fixed seed).
fn weights(ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let len = ty.row_size((rows * cols) as u64).expect("whole blocks") as usize;
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        v.extend_from_slice(&s.to_le_bytes());
    }
    v.truncate(len);
    // Float weights (KERNELS_CASE=F16:..): small finite values, no NaN or subnormal patterns.
    let small = |b: &[u8]| (b[0] as f32 - 127.5) / 4096.0;
    match ty {
        GgmlType::F32 => {
            return v
                .chunks_exact(4)
                .flat_map(|b| small(b).to_le_bytes())
                .collect()
        }
        GgmlType::F16 => {
            return v
                .chunks_exact(2)
                .flat_map(|b| half::f16::from_f32(small(b)).to_bits().to_le_bytes())
                .collect()
        }
        GgmlType::BF16 => {
            return v
                .chunks_exact(2)
                .flat_map(|b| half::bf16::from_f32(small(b)).to_bits().to_le_bytes())
                .collect()
        }
        _ => {}
    }
    let f16_offsets: &[usize] = match ty {
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 => &[0],
        GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        _ => &[],
    };
    let one = half::f16::from_f32(0.01).to_bits().to_le_bytes();
    for b in v.chunks_exact_mut(ty.type_size()) {
        for &o in f16_offsets {
            b[o..o + 2].copy_from_slice(&one);
        }
    }
    v
}

fn label(c: &Case) -> String {
    format!("{:?} {}x{} n={}", c.ty, c.rows, c.cols, c.n)
}

fn isas() -> Vec<Isa> {
    [Isa::Scalar, Isa::Avx2, Isa::Avx512]
        .into_iter()
        .filter(|i| i.is_available())
        .collect()
}

/// Best-of time of one matmul over the whole matrix.
fn time_one(
    isa: Isa,
    m: &QMatrix,
    x: &Activations,
    out: &mut [f32],
    numerics: Numerics,
    budget: Duration,
) -> f64 {
    let start = Instant::now();
    let mut best = f64::INFINITY;
    let mut iters = 0;
    while iters < 3 || (start.elapsed() < budget && iters < 200) {
        let t = Instant::now();
        matmul_with(isa, m, x, 0..m.rows(), out, numerics).expect("valid bench problem");
        best = best.min(t.elapsed().as_secs_f64());
        iters += 1;
    }
    best
}

fn summary() {
    let roof: f64 = std::env::var("ROOFLINE_GBS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(27.0);
    println!(
        "kernels: selected {} ; roofline {roof} GB/s (one core)",
        ternfleet_kernels::isa_name()
    );
    // KERNELS_CASE=Q8_0:2048:640:1 (type:rows:cols:n) measures just that shape.
    let custom: Vec<Case> = std::env::var("KERNELS_CASE")
        .ok()
        .and_then(|v| {
            let p: Vec<&str> = v.split(':').collect();
            let name = *p.first()?;
            let ty = GgmlType::ALL
                .into_iter()
                .find(|t| format!("{t:?}").eq_ignore_ascii_case(name))?;
            Some(vec![Case {
                ty,
                rows: p.get(1)?.parse().ok()?,
                cols: p.get(2)?.parse().ok()?,
                n: p.get(3)?.parse().ok()?,
            }])
        })
        .unwrap_or_default();
    let cases: Vec<&Case> = if custom.is_empty() {
        GEMV.iter().chain(GEMM.iter()).collect()
    } else {
        custom.iter().collect()
    };
    for c in cases {
        let w = weights(c.ty, c.rows, c.cols);
        let m = QMatrix::new(c.ty, c.rows, c.cols, &w).expect("valid matrix");
        let x: Vec<f32> = (0..c.n * c.cols)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let mut a = Activations::new();
        a.quantize_for(c.ty, &x, c.n, c.cols)
            .expect("valid activations");
        let mut out = vec![0f32; c.n * c.rows];
        let mut scalar_t = None;
        for isa in isas() {
            if isa == Isa::Scalar && std::env::var_os("KERNELS_SKIP_SCALAR").is_some() {
                continue;
            }
            let budget = if isa == Isa::Scalar {
                Duration::from_millis(300)
            } else {
                Duration::from_millis(700)
            };
            // Multi-token calls also in Invariant numerics: its cost over Parity is the ratio.
            let mut parity_t = None;
            for &numerics in numerics_for(c) {
                let t = time_one(isa, &m, &a, &mut out, numerics, budget);
                if isa == Isa::Scalar {
                    scalar_t.get_or_insert(t);
                }
                let vs_scalar =
                    scalar_t.map_or(String::new(), |s| format!("x{:.1} vs scalar", s / t));
                let parity = *parity_t.get_or_insert(t);
                let gbs = w.len() as f64 / t / 1e9;
                let gflops = 2.0 * (c.rows * c.cols * c.n) as f64 / t / 1e9;
                println!(
                    "{:<28} {:<12} {:<9} {:>9.3} ms  {:>7.2} GB/s  {:>5.1}% of roofline  {:>7.1} GFLOP/s  {:<14}  x{:.3} vs parity",
                    label(c),
                    isa.name(),
                    numerics.name(),
                    t * 1e3,
                    gbs,
                    100.0 * gbs / roof,
                    gflops,
                    vs_scalar,
                    t / parity
                );
            }
        }
    }
}

/// Both numerics for multi-token cases (one token is the same call in both).
fn numerics_for(c: &Case) -> &'static [Numerics] {
    if c.n > 1 {
        &[Numerics::Parity, Numerics::Invariant]
    } else {
        &[Numerics::Parity]
    }
}

fn bench(cr: &mut Criterion) {
    let test_mode = std::env::args().any(|a| a == "--test");
    if !test_mode && std::env::var_os("KERNELS_NO_SUMMARY").is_none() {
        summary();
    }
    for (name, cases) in [("gemv", &GEMV[..]), ("gemm", &GEMM[..])] {
        let mut group = cr.benchmark_group(name);
        group
            .sample_size(10)
            .warm_up_time(Duration::from_millis(200))
            .measurement_time(Duration::from_secs(1));
        for c in cases {
            let w = weights(c.ty, c.rows, c.cols);
            let m = QMatrix::new(c.ty, c.rows, c.cols, &w).expect("valid matrix");
            let x: Vec<f32> = (0..c.n * c.cols).map(|i| (i % 17) as f32 - 8.0).collect();
            let mut a = Activations::new();
            a.quantize_for(c.ty, &x, c.n, c.cols)
                .expect("valid activations");
            let mut out = vec![0f32; c.n * c.rows];
            group.throughput(Throughput::BytesDecimal(w.len() as u64));
            for isa in isas() {
                if isa == Isa::Scalar && !test_mode {
                    continue; // measured in the summary; too slow for criterion's sampling
                }
                for &numerics in numerics_for(c) {
                    let id = match numerics {
                        Numerics::Parity => isa.name().to_string(),
                        _ => format!("{} {}", isa.name(), numerics.name()),
                    };
                    group.bench_function(BenchmarkId::new(label(c), id), |b| {
                        b.iter(|| {
                            matmul_with(isa, &m, &a, 0..m.rows(), &mut out, numerics)
                                .expect("valid bench problem")
                        })
                    });
                }
            }
        }
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
