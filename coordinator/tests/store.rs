//! The expert store (`--ram-budget`): a model whose routed experts are read from disk within a
//! RAM budget computes exactly what the fully mapped model computes — any budget, with and
//! without the shadow predictor's hints, both numerics, GGUF files and bundles — and a failed
//! read fails the requests that needed it while the next request reads again.

mod common;
use common::*;

use std::path::{Path, PathBuf};

use ternfleet_coordinator::convert::{convert, ConvertOptions, ExpertType};
use ternfleet_coordinator::kv_cache::SeqOptions;
use ternfleet_coordinator::model::fit::{fit, FitOptions};
use ternfleet_coordinator::model::predict::{LearnedPredictor, PredictorError};
use ternfleet_coordinator::model::{ForwardError, LoadError, Model, OpenOptions};
use ternfleet_kernels::Numerics;
use ternfleet_node::store::Evict;
use ternfleet_shared::bundle::Manifest;
use ternfleet_shared::expert::ExpertError;

fn model(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("crate is in the workspace")
        .join("tests/data/models")
        .join(name)
}

fn open(path: &Path, budget: Option<u64>, hints: bool) -> Model {
    open_evict(path, budget, hints, Evict::default())
}

fn open_evict(path: &Path, budget: Option<u64>, hints: bool, evict: Evict) -> Model {
    let mut m = Model::open_with(
        path,
        &OpenOptions {
            ram_budget: budget,
            io_threads: Some(2),
            evict,
            ..OpenOptions::default()
        },
    )
    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    m.lookahead = if hints { 4 } else { 0 };
    m
}

/// Splits a native MoE test model into a bundle in `out`.
fn bundle(name: &str, out: &Path) {
    convert(
        &ConvertOptions {
            model: model(name),
            out: out.to_owned(),
            experts: None,
            top_k: None,
            calib: None,
            calib_tokens: 2048,
            expert_type: ExpertType::Keep,
            seed: 0,
            grouping: Default::default(),
        },
        &|_: &str, _: u64, _: u64| {},
    )
    .unwrap();
}

const PROMPTS: [&str; 2] = [
    "The capital of France is",
    "This License applies to any program",
];

/// Budgets: one expert at a time (the store must take a batch's experts one by one), a few,
/// and all of them.
const BUDGETS: [u64; 3] = [80 << 10, 400 << 10, 64 << 20];

fn assert_same_as_mapped(path: &Path) {
    let mapped = open(path, None, true);
    for numerics in [Numerics::Parity, Numerics::Invariant] {
        for p in PROMPTS {
            let want = run(&mapped, numerics, p, 8).unwrap();
            for budget in BUDGETS {
                for (hints, evict) in [
                    (false, Evict::Lru),
                    (true, Evict::Lru),
                    (false, Evict::Lfu),
                    (true, Evict::Lfu),
                ] {
                    let m = open_evict(path, Some(budget), hints, evict);
                    // Twice: the second run meets a warm store.
                    for pass in 0..2 {
                        let got = run(&m, numerics, p, 8).unwrap();
                        assert!(
                            got == want,
                            "{}: {p:?} {numerics:?} budget {budget} hints {hints} {evict:?} \
                             pass {pass}: output differs from the mapped model",
                            path.display()
                        );
                    }
                    let s = m.experts.store_stats().expect("a store");
                    assert!(s.reads > 0 && s.bytes_read > 0, "{s:?}");
                    if budget == BUDGETS[0] {
                        assert!(s.evictions > 0, "a one-expert budget evicts: {s:?}");
                        assert!(s.buffers_reused > 0, "evicted buffers are reused: {s:?}");
                    }
                    // Spare buffers never take the store past its budget.
                    assert!(s.used_bytes + s.spare_bytes <= s.budget_bytes, "{s:?}");
                    if !hints {
                        assert_eq!(s.prefetches, 0);
                    }
                }
            }
        }
    }
}

#[test]
fn any_budget_and_any_hints_give_the_mapped_models_output() {
    assert_same_as_mapped(&model("tiny-qwen3moe-q8_0.gguf"));
}

#[test]
fn a_bundle_served_from_the_store_is_the_mapped_bundle() {
    // qwen2moe: a shared expert that stays mapped beside the stored routed ones.
    let dir = tempfile::tempdir().unwrap();
    bundle("tiny-qwen2moe-q8_0.gguf", dir.path());
    assert_same_as_mapped(dir.path());
}

#[test]
fn a_learned_predictor_fits_round_trips_and_never_changes_the_output() {
    let path = model("tiny-qwen3moe-q8_0.gguf");
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/text/gpl-3.txt"),
    )
    .unwrap();
    let mapped = open(&path, None, false);
    let fo = FitOptions {
        tokens: 2048,
        lookahead: 4,
        ctx: 64,
        holdout: 0.25,
    };
    let (pred, report) = fit(&mapped, SeqOptions::default(), &text, &fo, |_, _| {}).unwrap();
    assert_eq!(
        report.train_tokens + report.holdout_tokens,
        2048,
        "{report:?}"
    );
    assert_eq!(report.holdout_tokens, 512, "{report:?}");
    // The strength is chosen on the held-out tokens with the router predictor among the
    // candidates: never worse there. Two layers: only lookahead 1 exists.
    let (r, l) = (
        report.router_recall[0].expect("lookahead 1"),
        report.learned_recall[0].expect("lookahead 1"),
    );
    assert!(l >= r && (0.0..=1.0).contains(&l), "{report:?}");
    assert!(report.router_recall[1].is_none(), "{report:?}");
    assert_eq!(report.pairs, 1, "{report:?}");
    // Saved and read back: the same predictions.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("p.gguf");
    pred.save(&file, report.train_tokens).unwrap();
    let back = LearnedPredictor::load(&file, &mapped.cfg).unwrap();
    let d = mapped.cfg.n_embd;
    let x: Vec<f32> = (0..5 * d)
        .map(|i| ((i * 7919 % 113) as f32 - 56.0) / 9.0)
        .collect();
    let want = pred.predict(&x, 5, 0, 1, 4);
    assert_eq!(want.len(), 20);
    assert_eq!(back.predict(&x, 5, 0, 1, 4), want);
    assert!(back.has(0, 1) && !back.has(1, 2) && !back.has(0, 0));
    // Its hints steer what the store reads, never what the model computes.
    let want = run(&mapped, Numerics::Parity, PROMPTS[1], 8).unwrap();
    for budget in BUDGETS {
        let mut m = open(&path, Some(budget), true);
        m.learned = Some(std::sync::Arc::new(back.clone()));
        assert!(run(&m, Numerics::Parity, PROMPTS[1], 8).unwrap() == want);
        let s = m.experts.store_stats().expect("a store");
        assert!(
            s.prefetches + s.hints_skipped > 0,
            "hints reached the store: {s:?}"
        );
    }
    // A predictor fitted for another model, a model file and a truncated file are refused.
    let other = Model::open(&model("tiny-qwen2moe-q8_0.gguf")).unwrap();
    let err = LearnedPredictor::load(&file, &other.cfg).expect_err("another model");
    assert!(matches!(err, PredictorError::Mismatch { .. }), "{err}");
    assert!(err.to_string().contains("experts per layer"), "{err}");
    let err = LearnedPredictor::load(&path, &mapped.cfg).expect_err("a model file");
    assert!(matches!(err, PredictorError::Invalid { .. }), "{err}");
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() - 9]).unwrap();
    let err = LearnedPredictor::load(&file, &mapped.cfg).expect_err("truncated");
    assert!(matches!(err, PredictorError::Gguf { .. }), "{err}");
}

#[test]
fn a_budget_too_small_for_one_expert_and_a_dense_model_are_clear_errors() {
    let err = Model::open_with(
        &model("tiny-qwen3moe-q8_0.gguf"),
        &OpenOptions {
            ram_budget: Some(1000),
            ..OpenOptions::default()
        },
    )
    .err()
    .expect("refused");
    let msg = err.to_string();
    assert!(msg.contains("cannot hold the largest expert"), "{msg}");
    let err = Model::open_with(
        &model("tiny-qwen3-f16.gguf"),
        &OpenOptions {
            ram_budget: Some(1 << 30),
            ..OpenOptions::default()
        },
    )
    .err()
    .expect("refused");
    assert!(matches!(err, LoadError::NoStore { .. }), "{err}");
    assert!(err.to_string().contains("no routed experts"), "{err}");
}

#[test]
fn a_failed_read_fails_its_request_and_the_next_request_reads_again() {
    let dir = tempfile::tempdir().unwrap();
    bundle("tiny-qwen3moe-q8_0.gguf", dir.path());
    let mapped = open(dir.path(), None, false);
    let want = run(&mapped, Numerics::Parity, PROMPTS[0], 4).unwrap();
    // A budget below one layer's experts: nothing of layer 1 stays resident across requests.
    let m = open(dir.path(), Some(80 << 10), false);
    // Layer 1's blobs vanish from under the store (a disk error): every request needs them.
    let man = Manifest::read(dir.path()).unwrap();
    let blobs: Vec<(PathBuf, Vec<u8>)> = man
        .experts
        .iter()
        .filter(|e| e.layer == 1)
        .map(|e| {
            let p = dir.path().join(&e.part.file);
            let bytes = std::fs::read(&p).unwrap();
            (p, bytes)
        })
        .collect();
    assert!(!blobs.is_empty());
    for (p, _) in &blobs {
        std::fs::OpenOptions::new()
            .write(true)
            .open(p)
            .unwrap()
            .set_len(0)
            .unwrap();
    }
    let err = run(&m, Numerics::Parity, PROMPTS[0], 4).expect_err("the read fails");
    match &err {
        ForwardError::Expert(e @ ExpertError::Unavailable { layer: 1, reason }) => {
            assert!(reason.contains("short read"), "{reason}");
            assert!(e.class().is_retryable());
        }
        other => panic!("expected layer 1 unavailable, got {other}"),
    }
    // The disk is back: the next request reads again and computes the mapped model's output.
    for (p, bytes) in &blobs {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new().write(true).open(p).unwrap();
        f.write_all(bytes).unwrap();
    }
    assert_eq!(run(&m, Numerics::Parity, PROMPTS[0], 4).unwrap(), want);
    let s = m.experts.store_stats().unwrap();
    assert!(s.read_errors > 0, "{s:?}");
}
