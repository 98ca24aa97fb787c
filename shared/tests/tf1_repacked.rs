//! TF1 matrices mapped from a model file run from their repacked copy
//! (`ternfleet_kernels::tf1_lut`) where the CPU has the kernels: `Linear::forward` must equal
//! the plain TF1 matmul bit for bit, for one token and several, for a 2-D tensor and a matrix of
//! a stacked (expert) tensor, and for a gate/up pair that shares one token's tables
//! (`forward_pair`): small matrices on the calling thread, wide ones split across pools of 2
//! and 3 threads. Without the kernels both sides run the plain matmul.

use std::sync::Arc;
use ternfleet_kernels::tf1_lut::Tf1Lut;
use ternfleet_kernels::{quantize_row, Activations, GgmlType, Numerics};
use ternfleet_shared::compute::{forward_pair, matmul_par, Linear};
use ternfleet_shared::gguf::{GgufFile, GgufWriter, Value, EXTENDED_TYPES_KEY};

/// splitmix64 → roughly normal f32.
fn normalish(state: &mut u64) -> f32 {
    let mut u = || {
        *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    u() + u() + u()
}

fn tf1_rows(rows: usize, cols: usize, seed: &mut u64) -> Vec<u8> {
    let rb = GgmlType::TF1.row_size(cols as u64).unwrap() as usize;
    let mut w = vec![0u8; rows * rb];
    for dst in w.chunks_exact_mut(rb) {
        let x: Vec<f32> = (0..cols).map(|_| normalish(seed)).collect();
        quantize_row(GgmlType::TF1, &x, dst).unwrap();
    }
    w
}

#[test]
fn repacked_tf1_forward_equals_the_plain_matmul() {
    let (rows, cols, experts) = (200, 640, 3);
    let mut seed = 5;
    let mut g = GgufWriter::new();
    g.add_kv(EXTENDED_TYPES_KEY, Value::Bool(true)).unwrap();
    g.add_tensor(
        "dense.weight",
        &[cols as u64, rows as u64],
        GgmlType::TF1,
        tf1_rows(rows, cols, &mut seed),
    )
    .unwrap();
    g.add_tensor(
        "ffn_up_exps.weight",
        &[cols as u64, rows as u64, experts as u64],
        GgmlType::TF1,
        tf1_rows(rows * experts, cols, &mut seed),
    )
    .unwrap();
    let f = Arc::new(GgufFile::from_bytes(g.to_bytes()).unwrap());
    let dense = Linear::new(&f, f.tensor("dense.weight").unwrap()).unwrap();
    let expert = Linear::stacked(&f, f.tensor("ffn_up_exps.weight").unwrap(), 2).unwrap();
    for lin in [&dense, &expert] {
        assert_eq!(
            lin.tf1_repacked().is_some(),
            Tf1Lut::supported() && ternfleet_kernels::isa() == ternfleet_kernels::Isa::Avx512,
            "repacked where the kernels run"
        );
        for threads in 1..=3 {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            for n in [1, 2, 7, 20] {
                let x: Vec<f32> = (0..n * cols).map(|_| normalish(&mut seed)).collect();
                let mut act = Activations::new();
                act.quantize_for(GgmlType::TF1, &x, n, cols).unwrap();
                let (mut got, mut want) = (vec![f32::NAN; rows * n], vec![0f32; rows * n]);
                pool.install(|| {
                    lin.forward(&act, &mut got, Numerics::Parity).unwrap();
                    matmul_par(&lin.matrix(), &act, &mut want, Numerics::Parity).unwrap();
                });
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "{lin:?}, {threads} threads, {n} tokens"
                );
                // A gate/up pair sharing one token's tables (or, for several, each on its own).
                let (mut a, mut b) = (vec![f32::NAN; rows * n], vec![f32::NAN; rows * n]);
                let mut want_b = vec![0f32; rows * n];
                pool.install(|| {
                    forward_pair(lin, &dense, &act, &mut a, &mut b, Numerics::Parity).unwrap();
                    matmul_par(&dense.matrix(), &act, &mut want_b, Numerics::Parity).unwrap();
                });
                assert_eq!(bits(&a), bits(&want), "pair, first, {n} tokens");
                assert_eq!(bits(&b), bits(&want_b), "pair, second, {n} tokens");
            }
        }
    }
}

#[test]
fn repacked_tf1_splits_across_the_pool() {
    // Wide enough (32 groups x 32 blocks, at least 1024 per token: `compute::TF1_SPLIT`) that
    // pools of 2 and 3 threads split the row groups (and the GEMM's tiles), each thread with
    // its own tables, for one matrix and for a gate/up pair; two one-token calls in a row, each
    // of a new token, on the same pool (tables kept from the first must not serve the second).
    let (rows, cols) = (2048, 4096);
    let mut seed = 9;
    let mut g = GgufWriter::new();
    g.add_kv(EXTENDED_TYPES_KEY, Value::Bool(true)).unwrap();
    for name in ["gate.weight", "up.weight"] {
        g.add_tensor(
            name,
            &[cols as u64, rows as u64],
            GgmlType::TF1,
            tf1_rows(rows, cols, &mut seed),
        )
        .unwrap();
    }
    let f = Arc::new(GgufFile::from_bytes(g.to_bytes()).unwrap());
    let gate = Linear::new(&f, f.tensor("gate.weight").unwrap()).unwrap();
    let up = Linear::new(&f, f.tensor("up.weight").unwrap()).unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for threads in [2, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        for n in [1, 1, 3] {
            let x: Vec<f32> = (0..n * cols).map(|_| normalish(&mut seed)).collect();
            let mut act = Activations::new();
            act.quantize_for(GgmlType::TF1, &x, n, cols).unwrap();
            let mut want = [vec![0f32; rows * n], vec![0f32; rows * n]];
            let (mut a, mut b) = (vec![f32::NAN; rows * n], vec![f32::NAN; rows * n]);
            let mut one = vec![f32::NAN; rows * n];
            pool.install(|| {
                for (w, lin) in want.iter_mut().zip([&gate, &up]) {
                    matmul_par(&lin.matrix(), &act, w, Numerics::Parity).unwrap();
                }
                gate.forward(&act, &mut one, Numerics::Parity).unwrap();
                forward_pair(&gate, &up, &act, &mut a, &mut b, Numerics::Parity).unwrap();
            });
            assert_eq!(bits(&one), bits(&want[0]), "{threads} threads, {n} tokens");
            assert_eq!(
                bits(&a),
                bits(&want[0]),
                "pair gate, {threads} threads, {n} tokens"
            );
            assert_eq!(
                bits(&b),
                bits(&want[1]),
                "pair up, {threads} threads, {n} tokens"
            );
        }
    }
}
