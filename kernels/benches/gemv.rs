//! GEMV (decode) and GEMM (prefill) throughput per ISA.
//!
//! Prints, before the criterion runs, a summary per case: GB/s of weight bytes read, the
//! fraction of the one-core read roofline (27 GB/s measured on the dev box, override with
//! `ROOFLINE_GBS`), and the speed-up over the scalar reference measured in the same run.
//! Shapes are the hot matrices of Gemma 3 270M Q4_K_M plus 4096² k-quants, one token (GEMV),
//! four (a batched decode step) and 64 (prefill).
//!
//! Multi-token (GEMM) cases run in both [`Numerics`]: the summary prints Invariant's time over
//! Parity's. `KERNELS_SKIP_SCALAR=1` leaves the (slow) scalar reference out of the summary.
//!
//! `cargo bench -p ternfleet-kernels -- --test` runs every case once (CI keeps it compiling).
//!
//! `KERNELS_BATCH=1` prints instead the batched-decode table and skips criterion: per matrix,
//! per token count `n` (small batches of decode tokens up to a prefill) and per thread count,
//! the median time of the whole matrix split into tasks as the engine's `matmul_par` splits it
//! (`rows.div_ceil(threads * 4)` rounded up to 16; each task writes its own token-major tile,
//! the scatter into one output is left out), in both numerics, and the ratio to `n = 1`.
//! `KERNELS_BATCH_CASES=Q8_0:262144:640,Q4_K:2048:8192` (type:rows:cols), `KERNELS_BATCH_N=1,2,4`,
//! `KERNELS_BATCH_THREADS=1,2`, `KERNELS_BATCH_RUNS=7` override the defaults.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::hint::spin_loop;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use ternfleet_kernels::{matmul, matmul_with, Activations, GgmlType, Isa, Numerics, QMatrix};

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

/// Batched decode: a few tokens (one per sequence) against a large matrix, which should cost
/// little more than the 1-token GEMV (the weights are read once for all of them).
const BATCH: [Case; 3] = [
    Case {
        ty: GgmlType::Q8_0,
        rows: 262144,
        cols: 640,
        n: 4,
    },
    Case {
        ty: GgmlType::Q4_K,
        rows: 4096,
        cols: 4096,
        n: 4,
    },
    Case {
        ty: GgmlType::Q6_K,
        rows: 4096,
        cols: 4096,
        n: 4,
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
        GgmlType::TQ1_0 => &[52],
        GgmlType::TQ2_0 => &[64],
        GgmlType::TF2 | GgmlType::TF1 => &[0],
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
        GEMV.iter().chain(BATCH.iter()).chain(GEMM.iter()).collect()
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

/// Rows per task as the engine's `matmul_par` picks them (shared/src/compute.rs).
fn rows_per_task(rows: usize, threads: usize) -> usize {
    rows.div_ceil(threads.max(1) * 4)
        .next_multiple_of(16)
        .max(16)
}

/// Median and minimum seconds of `runs` whole-matrix matmuls (after two warm-ups) on `threads`
/// threads (1 or 2: the second one a persistent worker spinning on an epoch counter, so no
/// thread is spawned in the timed region), the rows split into `matmul_par`'s tasks, which the
/// threads take in turn from a shared counter.
fn time_split(
    m: &QMatrix,
    x: &Activations,
    numerics: Numerics,
    threads: usize,
    runs: usize,
) -> (f64, f64) {
    let rows = m.rows();
    let n = x.n();
    let chunk = rows_per_task(rows, threads);
    let ntasks = rows.div_ceil(chunk);
    let tiles: Vec<Mutex<Vec<f32>>> = (0..ntasks)
        .map(|i| Mutex::new(vec![0f32; (((i + 1) * chunk).min(rows) - i * chunk) * n]))
        .collect();
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let epoch = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    // Runs the worker finished (so the next run's counters are not reset under it).
    let parked = AtomicUsize::new(0);
    let work = || loop {
        let i = next.fetch_add(1, Ordering::AcqRel);
        if i >= ntasks {
            return;
        }
        let r = i * chunk..((i + 1) * chunk).min(rows);
        let mut tile = tiles[i].lock().expect("no panics while holding the lock");
        matmul(m, x, r, &mut tile, numerics).expect("valid bench problem");
        drop(tile);
        done.fetch_add(1, Ordering::AcqRel);
    };
    let mut secs = Vec::with_capacity(runs);
    std::thread::scope(|s| {
        if threads > 1 {
            s.spawn(|| {
                let mut seen = 0;
                loop {
                    while epoch.load(Ordering::Acquire) == seen {
                        spin_loop();
                    }
                    seen = epoch.load(Ordering::Acquire);
                    if stop.load(Ordering::Acquire) {
                        return;
                    }
                    work();
                    parked.fetch_add(1, Ordering::AcqRel);
                }
            });
        }
        for i in 0..runs + 2 {
            next.store(0, Ordering::Release);
            done.store(0, Ordering::Release);
            let t0 = Instant::now();
            epoch.fetch_add(1, Ordering::AcqRel);
            work();
            while done.load(Ordering::Acquire) != ntasks {
                spin_loop();
            }
            let dt = t0.elapsed().as_secs_f64();
            while threads > 1 && parked.load(Ordering::Acquire) != i + 1 {
                spin_loop();
            }
            if i >= 2 {
                secs.push(dt);
            }
        }
        stop.store(true, Ordering::Release);
        epoch.fetch_add(1, Ordering::AcqRel);
    });
    secs.sort_by(f64::total_cmp);
    (secs[secs.len() / 2], secs[0])
}

fn env_list(key: &str, default: &str) -> Vec<String> {
    std::env::var(key)
        .unwrap_or_else(|_| default.to_string())
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

/// The batched-decode table (`KERNELS_BATCH=1`, see the module docs).
fn batch_table() {
    let cases = env_list(
        "KERNELS_BATCH_CASES",
        "Q8_0:262144:640,Q4_K:2048:8192,Q6_K:2048:8192",
    );
    let ns: Vec<usize> = env_list("KERNELS_BATCH_N", "1,2,4,8,16,64,512")
        .iter()
        .filter_map(|v| v.parse().ok())
        .collect();
    let threads: Vec<usize> = env_list("KERNELS_BATCH_THREADS", "1,2")
        .iter()
        .filter_map(|v| v.parse().ok())
        .collect();
    let runs: usize = std::env::var("KERNELS_BATCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(7);
    println!("kernels: selected {}", ternfleet_kernels::isa_name());
    for case in &cases {
        let p: Vec<&str> = case.split(':').collect();
        let parsed = (|| {
            let name = *p.first()?;
            let ty = GgmlType::ALL
                .into_iter()
                .find(|t| format!("{t:?}").eq_ignore_ascii_case(name))?;
            Some((ty, p.get(1)?.parse().ok()?, p.get(2)?.parse().ok()?))
        })();
        let Some((ty, rows, cols)) = parsed else {
            eprintln!("skipping case {case:?}: expected TYPE:ROWS:COLS");
            continue;
        };
        let w = weights(ty, rows, cols);
        let m = QMatrix::new(ty, rows, cols, &w).expect("valid matrix");
        for &nt in &threads {
            let mut one = None;
            for &n in &ns {
                let x: Vec<f32> = (0..n * cols)
                    .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
                    .collect();
                let mut a = Activations::new();
                a.quantize_for(ty, &x, n, cols).expect("valid activations");
                let nums: &[Numerics] = if n > 1 {
                    &[Numerics::Parity, Numerics::Invariant]
                } else {
                    &[Numerics::Parity]
                };
                for &numerics in nums {
                    let (med, min) = time_split(&m, &a, numerics, nt, runs);
                    let base = *one.get_or_insert(med);
                    println!(
                        "batch {:<5} {rows}x{cols} threads={nt} n={n:<4} {:<9} median {:>9.3} ms  min {:>9.3} ms  x{:.2} of n=1  {:>6.2} GB/s",
                        format!("{ty:?}"),
                        numerics.name(),
                        med * 1e3,
                        min * 1e3,
                        med / base,
                        w.len() as f64 / med / 1e9
                    );
                }
            }
        }
    }
}

fn bench(cr: &mut Criterion) {
    let test_mode = std::env::args().any(|a| a == "--test");
    if !test_mode && std::env::var_os("KERNELS_BATCH").is_some() {
        batch_table();
        return;
    }
    if !test_mode && std::env::var_os("KERNELS_NO_SUMMARY").is_none() {
        summary();
    }
    for (name, cases) in [
        ("gemv", &GEMV[..]),
        ("batch", &BATCH[..]),
        ("gemm", &GEMM[..]),
    ] {
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
