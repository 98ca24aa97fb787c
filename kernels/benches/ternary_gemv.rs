//! Ternary GEMV (one token) at 1 and 2 threads: TQ2_0 and TQ1_0 (llama.cpp's formats, same
//! float order as llama.cpp) and ternfleet's TF2 / TF1. Prints one line per case,
//!
//!     ours TYPE ROWSxCOLS t=THREADS median_us=.. min_us=.. gbs=..
//!
//! which benches/ternary-vs-llama-cpp.sh pairs with llama.cpp's lines from
//! benches/ref/ref-gemv.cpp to print ratios. As in llama.cpp's timing, each run includes
//! quantizing the f32 activation row. Two threads split the rows in halves; the second thread
//! is a persistent worker that spins on an epoch counter (as ggml's OpenMP threads do), so no
//! thread is spawned inside the timed region.
//!
//! `tf1l` is TF1 repacked (`ternfleet_kernels::tf1_lut`, as the engine runs TF1 matrices mapped
//! from a file on AVX-512 VBMI/VNNI CPUs; the copy has as many bytes as TF1).
//!
//! Environment: TERN_TOKENS (default 1: more times the multi-token matmul, `tf1l` through
//! `Tf1Lut::gemm`), TERN_RUNS (default 50), TERN_TYPES (e.g. "tq2_0,tf2"), TERN_SHAPES
//! (e.g. "4096x14336,2048x5632"), TERN_THREADS (e.g. "1,2"), TERN_TF1_SHARED (1: `tf1l` at two
//! threads with tables built in halves and shared, see `time_lut`).
//! `cargo bench -- --test` (CI) runs one tiny case so the bench cannot rot.

use std::hint::spin_loop;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::RwLock;
use std::time::Instant;
use ternfleet_kernels::tf1_lut::{Tf1Lut, Tf1Tables};
use ternfleet_kernels::{matmul, quantize_row, Activations, GgmlType, Numerics, QMatrix};

/// splitmix64 → roughly normal f32 (sum of three uniforms).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn normalish(&mut self) -> f32 {
        let u = |r: &mut Self| (r.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
        u(self) + u(self) + u(self)
    }
}

fn weights(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let rb = ty
        .row_size(cols as u64)
        .expect("bench shapes are whole blocks") as usize;
    let mut w = vec![0u8; rb * rows];
    let mut row = vec![0f32; cols];
    for dst in w.chunks_exact_mut(rb) {
        row.iter_mut().for_each(|v| *v = rng.normalish() * 0.02);
        quantize_row(ty, &row, dst).expect("sizes match");
    }
    w
}

/// Microseconds per run (quantize the activation row + GEMV), `runs` runs after 5 warm-ups.
/// With `x` of several rows (`TERN_TOKENS`), the multi-token matmul.
fn time_gemv(m: &QMatrix<'_>, x: &[f32], threads: usize, runs: usize) -> Vec<f64> {
    let rows = m.rows();
    let ntok = x.len() / m.cols();
    // Even split so the AVX-512 kernels keep their row pairs.
    let split = if threads == 2 { (rows / 2) & !1 } else { rows };
    let mut outs = [vec![0f32; split * ntok], vec![0f32; (rows - split) * ntok]];
    time_runs(
        Activations::new(),
        |act| {
            act.quantize_for(m.ty(), x, ntok, m.cols())
                .expect("valid bench problem")
        },
        |act, half, out| {
            let range = if half == 0 { 0..split } else { split..rows };
            matmul(m, act, range, out, Numerics::Parity).expect("valid bench problem");
        },
        threads,
        runs,
        &mut outs,
    )
}

/// The same for the repacked TF1 GEMV as the engine runs it (`compute::tf1_par`): each run
/// quantizes the row on the first thread; then each thread builds the token's tables and
/// computes its half of the row groups. With `TERN_TF1_SHARED=1`, the way session 38 ran it
/// instead, for comparison: each thread builds the tables of half the blocks, waits for the
/// other's, and computes its half from both.
fn time_lut(lut: &Tf1Lut, cols: usize, x: &[f32], threads: usize, runs: usize) -> Vec<f64> {
    let (g, nb) = (lut.groups(), lut.blocks());
    let shared = std::env::var("TERN_TF1_SHARED").is_ok_and(|v| v == "1");
    let (split_g, split_b) = match (threads, shared) {
        (2, true) => (g / 2, nb / 2),
        (2, false) => (g / 2, nb),
        _ => (g, nb),
    };
    let parts = [
        RwLock::new(Tf1Tables::default()),
        RwLock::new(Tf1Tables::default()),
    ];
    let built = AtomicUsize::new(0);
    let lock = "no panics while holding the lock";
    let mut outs = [
        vec![0f32; split_g * 64],
        vec![0f32; lut.rows().saturating_sub(split_g * 64)],
    ];
    time_runs(
        Activations::new(),
        |act| {
            act.quantize_for(GgmlType::TF1, x, 1, cols)
                .expect("valid bench problem")
        },
        |act, half, out| {
            let blocks = match (half, shared) {
                (1, true) => split_b..nb,
                _ => 0..split_b,
            };
            lut.tables(act, blocks, &mut parts[half].write().expect(lock))
                .expect("valid bench problem");
            let range = if half == 0 { 0..split_g } else { split_g..g };
            if !shared || threads == 1 {
                let own = parts[half].read().expect(lock);
                lut.gemv(&[&own], range, out).expect("valid bench problem");
                return;
            }
            // Both halves' tables before either computes: every thread counts once a run.
            let n = built.fetch_add(1, Ordering::AcqRel) + 1;
            while built.load(Ordering::Acquire) < n.div_ceil(threads) * threads {
                spin_loop();
            }
            let (p0, p1) = (parts[0].read().expect(lock), parts[1].read().expect(lock));
            lut.gemv(&[&p0, &p1], range, out)
                .expect("valid bench problem");
        },
        threads,
        runs,
        &mut outs,
    )
}

/// The repacked TF1 matmul of several tokens (`Tf1Lut::gemm`), row groups split in halves.
fn time_lut_gemm(lut: &Tf1Lut, cols: usize, x: &[f32], threads: usize, runs: usize) -> Vec<f64> {
    let (g, rows, ntok) = (lut.groups(), lut.rows(), x.len() / cols);
    let split = if threads == 2 { g / 2 } else { g };
    let mut outs = [
        vec![0f32; split * 64 * ntok],
        vec![0f32; rows.saturating_sub(split * 64) * ntok],
    ];
    time_runs(
        Activations::new(),
        |act| {
            act.quantize_for(GgmlType::TF1, x, ntok, cols)
                .expect("valid bench problem")
        },
        |act, half, out| {
            let range = if half == 0 { 0..split } else { split..g };
            lut.gemm(act, range, out).expect("valid bench problem");
        },
        threads,
        runs,
        &mut outs,
    )
}

/// Times `prepare` (on this thread) and then `work(state, half, out)` for half 0 here and, with
/// two threads, half 1 on a persistent spinning worker.
fn time_runs<S: Send + Sync>(
    state: S,
    mut prepare: impl FnMut(&mut S),
    work: impl Fn(&S, usize, &mut [f32]) + Sync,
    threads: usize,
    runs: usize,
    outs: &mut [Vec<f32>; 2],
) -> Vec<f64> {
    let state = RwLock::new(state);
    let epoch = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let mut us = Vec::with_capacity(runs);
    let [out0, out1] = outs;
    std::thread::scope(|s| {
        if threads == 2 {
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
                    work(
                        &state.read().expect("no panics while holding the lock"),
                        1,
                        out1,
                    );
                    done.fetch_add(1, Ordering::Release);
                }
            });
        }
        for i in 0..runs + 5 {
            let t0 = Instant::now();
            prepare(&mut state.write().expect("no panics while holding the lock"));
            epoch.fetch_add(1, Ordering::Release);
            work(
                &state.read().expect("no panics while holding the lock"),
                0,
                out0,
            );
            if threads == 2 {
                while done.load(Ordering::Acquire) != i + 1 {
                    spin_loop();
                }
            }
            let dt = t0.elapsed().as_secs_f64() * 1e6;
            if i >= 5 {
                us.push(dt);
            }
        }
        stop.store(true, Ordering::Release);
        epoch.fetch_add(1, Ordering::Release);
    });
    us.sort_by(f64::total_cmp);
    us
}

fn env_list(key: &str, default: &str) -> Vec<String> {
    std::env::var(key)
        .unwrap_or_else(|_| default.to_string())
        .split(',')
        .map(|s| s.trim().to_ascii_lowercase())
        .filter(|s| !s.is_empty())
        .collect()
}

fn main() {
    let test_mode = std::env::args().any(|a| a == "--test");
    let runs: usize = if test_mode {
        1
    } else {
        std::env::var("TERN_RUNS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(50)
    };
    let (types, shapes, threads) = if test_mode {
        (
            vec!["tf2".to_string(), "tf1l".to_string()],
            vec!["8x256".to_string()],
            vec!["2".to_string()],
        )
    } else {
        (
            env_list("TERN_TYPES", "tq2_0,tq1_0,tf2,tf1"),
            env_list("TERN_SHAPES", "4096x14336,2048x5632,5632x2048"),
            env_list("TERN_THREADS", "1,2"),
        )
    };
    let ntok: usize = std::env::var("TERN_TOKENS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(1);
    println!("kernels: {}", ternfleet_kernels::isa_name());
    let mut rng = Rng(42);
    for shape in &shapes {
        let Some((rows, cols)) = shape
            .split_once('x')
            .and_then(|(r, c)| Some((r.parse::<usize>().ok()?, c.parse::<usize>().ok()?)))
        else {
            eprintln!("skipping shape {shape:?}: expected ROWSxCOLS");
            continue;
        };
        let x: Vec<f32> = (0..cols * ntok).map(|_| rng.normalish()).collect();
        for tname in &types {
            let lut = tname == "tf1l";
            if lut && !Tf1Lut::supported() {
                eprintln!("skipping tf1l: needs AVX-512 VBMI");
                continue;
            }
            let want = if lut { "tf1" } else { tname.as_str() };
            let Some(ty) = GgmlType::ALL.into_iter().find(|t| t.name() == want) else {
                eprintln!("skipping type {tname:?}");
                continue;
            };
            if ty.row_size(cols as u64).is_none() {
                eprintln!("skipping {tname} {shape}: {cols} is not whole blocks");
                continue;
            }
            let w = weights(ty, rows, cols, &mut rng);
            let m = QMatrix::new(ty, rows, cols, &w).expect("sizes match");
            let t0 = Instant::now();
            let packed = lut.then(|| Tf1Lut::pack(&m).expect("a TF1 matrix"));
            if lut {
                eprintln!(
                    "tf1l {shape}: packed in {:.1} ms",
                    t0.elapsed().as_secs_f64() * 1e3
                );
            }
            for t in &threads {
                let Ok(nt @ (1 | 2)) = t.parse::<usize>() else {
                    eprintln!("skipping threads {t:?}: 1 or 2");
                    continue;
                };
                let us = match &packed {
                    Some(p) if ntok > 1 => time_lut_gemm(p, cols, &x, nt, runs),
                    Some(p) => time_lut(p, cols, &x, nt, runs),
                    None => time_gemv(&m, &x, nt, runs),
                };
                let med = us[us.len() / 2];
                let toks = if ntok > 1 {
                    format!(" tokens={ntok}")
                } else {
                    String::new()
                };
                println!(
                    "ours {tname} {rows}x{cols} t={nt} median_us={med:.1} min_us={:.1} gbs={:.1}{toks}",
                    us[0],
                    w.len() as f64 / med / 1e3
                );
            }
        }
    }
}
