//! The batched engine: batch invariance, transactional steps and prefix sharing, on the real
//! default model (Gemma 3 270M Q4_K_M: q4_K and q6_K matrices, whose llama.cpp float order
//! changes with the batch) and on an MoE test model.
//!
//! The reference of every comparison is the same model run another way (alone, unfailed,
//! without sharing); the llama.cpp references pin parity mode in tests/parity.rs.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use ternfleet_coordinator::engine::{self, EngineOptions, Output};
use ternfleet_coordinator::model::{Logits, Model, NoObserver, Observer, SeqInput, StepOptions};
use ternfleet_coordinator::sampler::SamplerParams;
use ternfleet_kernels::{GgmlType, Numerics};
use ternfleet_shared::expert::{ExpertBackend, ExpertBatch, ExpertError, InFlight};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("crate lives in the workspace")
        .to_path_buf()
}

fn set_threads() {
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build_global();
}

/// The default model; its absence fails the test (scripts/test.sh fetches it).
fn gemma() -> Model {
    let p = root().join("models/gemma-3-270m-q4_k_m.gguf");
    assert!(
        p.exists(),
        "{} missing: run scripts/fetch-model.sh",
        p.display()
    );
    Model::open(&p).expect("default model loads")
}

fn moe() -> Model {
    Model::open(&root().join("tests/data/models/tiny-qwen3moe-q8_0.gguf")).expect("MoE test model")
}

/// 16 prompts of 3 to ~150 tokens cut from the GPL text, each different.
fn prompts(m: &Model) -> Vec<Vec<u32>> {
    let text = std::fs::read_to_string(root().join("tests/data/text/gpl-3.txt")).expect("text");
    let toks = m.tokenizer.encode(&text, false, false);
    (0..16)
        .map(|i| {
            let len = 3 + (i * 37) % 150;
            let start = 200 + i * 211;
            let mut p = vec![m.tokenizer.bos().unwrap_or(toks[0])];
            p.extend_from_slice(&toks[start..start + len]);
            p
        })
        .collect()
}

fn options(numerics: Numerics, parallel: usize, chunk: usize, max_tokens: usize) -> EngineOptions {
    EngineOptions {
        parallel,
        chunk,
        max_tokens,
        stop_at_eog: false,
        numerics,
        kv_budget: 256 << 20,
        top_experts: None,
        sampling: SamplerParams {
            temperature: 0.0,
            ..SamplerParams::default()
        },
        keep_logits: true,
    }
}

fn assert_same_bits(a: &[Output], b: &[Output], what: &str) {
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.tokens, y.tokens, "{what}: prompt {i} tokens");
        assert_eq!(x.logits.len(), y.logits.len(), "{what}: prompt {i}");
        for (s, (lx, ly)) in x.logits.iter().zip(&y.logits).enumerate() {
            let same = lx.iter().zip(ly).all(|(p, q)| p.to_bits() == q.to_bits());
            assert!(same, "{what}: prompt {i}, logits of step {s} differ");
        }
    }
}

/// Each prompt alone (one sequence, whole prompt in one step) and all 16 together (6 at a
/// time, so they join staggered as others finish; prompts fed 7 tokens per step, so prefill
/// chunks and decode tokens share steps): identical logits, bit for bit, in invariant mode.
fn invariance(m: &Model, max_tokens: usize) {
    let ps = prompts(m);
    let alone: Vec<Output> = ps
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let n = 2 + (i * 5) % (max_tokens - 1);
            let (mut o, _) = engine::run(
                m,
                std::slice::from_ref(p),
                &options(Numerics::Invariant, 1, 512, n),
            )
            .expect("alone");
            o.pop().expect("one output")
        })
        .collect();
    // Together, each generating up to `max_tokens`: compare the first steps each had alone.
    let mut pool = m.new_pool(256 << 20, Numerics::Invariant).unwrap();
    let (together, stats) = engine::run_on(
        m,
        &mut pool,
        &ps,
        &options(Numerics::Invariant, 6, 7, max_tokens),
    )
    .expect("together");
    let together: Vec<Output> = together
        .into_iter()
        .zip(&alone)
        .map(|(mut t, a)| {
            t.tokens.truncate(a.tokens.len());
            t.logits.truncate(a.logits.len());
            t
        })
        .collect();
    assert_same_bits(&alone, &together, "invariant, alone vs 16 together");
    println!(
        "invariance: 16 prompts, {} steps together, every logit bit-identical",
        stats.steps
    );
}

#[test]
fn gemma_logits_do_not_depend_on_what_shares_the_step() {
    set_threads();
    invariance(&gemma(), 12);
}

#[test]
fn moe_logits_do_not_depend_on_what_shares_the_step() {
    set_threads();
    invariance(&moe(), 12);
}

#[test]
fn parity_mode_is_not_batch_invariant_on_gemma() {
    // The check above could pass by accident if the modes were the same; parity mode's
    // q4_K/q6_K orders change with the batch, so there the two runs differ.
    set_threads();
    let m = gemma();
    let ps = prompts(&m);
    let alone = engine::run(&m, &ps[..4], &options(Numerics::Parity, 1, 512, 4)).unwrap();
    let together = engine::run(&m, &ps[..4], &options(Numerics::Parity, 4, 512, 4)).unwrap();
    let differ = alone.0.iter().zip(&together.0).any(|(a, b)| {
        a.logits
            .iter()
            .zip(&b.logits)
            .any(|(x, y)| x.iter().zip(y).any(|(p, q)| p.to_bits() != q.to_bits()))
    });
    assert!(
        differ,
        "parity mode gave batch-invariant logits: is the mode ignored?"
    );
}

/// An expert backend that fails the `fail_at`-th call, then works.
struct FailOnce {
    inner: Box<dyn ExpertBackend>,
    calls: AtomicUsize,
    fail_at: usize,
}

impl ExpertBackend for FailOnce {
    fn input_type(&self, layer: usize) -> Result<GgmlType, ExpertError> {
        self.inner.input_type(layer)
    }
    fn submit(&self, batch: &ExpertBatch<'_>) -> Result<Box<dyn InFlight>, ExpertError> {
        if self.calls.fetch_add(1, Ordering::SeqCst) == self.fail_at {
            return Err(ExpertError::Unavailable {
                layer: batch.layer,
                reason: "injected failure".into(),
            });
        }
        self.inner.submit(batch)
    }
}

#[test]
fn a_failed_step_leaves_the_cache_unchanged_and_a_retry_gives_the_same_logits() {
    set_threads();
    for numerics in [Numerics::Parity, Numerics::Invariant] {
        let clean = gemma();
        let mut failing = gemma();
        let inner = std::mem::replace(&mut failing.experts, Box::new(NoExperts));
        let n_layer = failing.cfg.n_layer;
        let ps = prompts(&clean);
        let opts = StepOptions {
            numerics,
            ..StepOptions::default()
        };
        // Two sequences: a prefill, then a step mixing a decode token and a prompt chunk.
        let run = |m: &Model,
                   fail: bool|
         -> (
            Vec<Vec<f32>>,
            Option<ternfleet_coordinator::model::ForwardError>,
        ) {
            let mut pool = m.new_pool(64 << 20, numerics).unwrap();
            let a = pool.add_sequence(1000);
            let b = pool.add_sequence(1000);
            let first = [SeqInput {
                seq: a,
                tokens: &ps[5],
                logits: Logits::Last,
                top_experts: None,
            }];
            m.step(&mut pool, &first, &opts, &mut NoObserver).unwrap();
            let second = [
                SeqInput {
                    seq: a,
                    tokens: &[818],
                    logits: Logits::Last,
                    top_experts: None,
                },
                SeqInput {
                    seq: b,
                    tokens: &ps[9],
                    logits: Logits::From(0),
                    top_experts: None,
                },
            ];
            let mut err = None;
            if fail {
                let before = (pool.stats(), pool.len(a).unwrap(), pool.len(b).unwrap());
                let blocks_a = pool.blocks(a).unwrap().to_vec();
                // The committed positions of a's first block (the failed step may write past
                // them: those slots are not part of any sequence until a step commits).
                let committed = pool.len(a).unwrap().min(64) * m.cfg.k_dim();
                let keys: Vec<Vec<u16>> = (0..n_layer)
                    .map(|l| {
                        pool.key_block(l, blocks_a[0])[..committed]
                            .iter()
                            .map(|h| h.to_bits())
                            .collect()
                    })
                    .collect();
                err = m.step(&mut pool, &second, &opts, &mut NoObserver).err();
                assert!(err.is_some(), "the injected failure surfaced");
                assert_eq!(
                    (pool.stats(), pool.len(a).unwrap(), pool.len(b).unwrap()),
                    before,
                    "a failed step changed the pool"
                );
                assert_eq!(pool.blocks(a).unwrap(), blocks_a.as_slice());
                for (l, k) in keys.iter().enumerate() {
                    let now: Vec<u16> = pool.key_block(l, blocks_a[0])[..committed]
                        .iter()
                        .map(|h| h.to_bits())
                        .collect();
                    assert_eq!(&now, k, "layer {l} keys of committed positions changed");
                }
            }
            (
                m.step(&mut pool, &second, &opts, &mut NoObserver).unwrap(),
                err,
            )
        };
        failing.experts = Box::new(FailOnce {
            inner,
            calls: AtomicUsize::new(0),
            // The second step's 7th layer (the first step made n_layer calls).
            fail_at: n_layer + 6,
        });
        let (want, _) = run(&clean, false);
        let (got, err) = run(&failing, true);
        let err = err.expect("failure");
        assert!(err.to_string().contains("injected failure"), "{err}");
        assert_eq!(want.len(), got.len());
        for (w, g) in want.iter().zip(&got) {
            assert!(
                w.iter().zip(g).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{numerics:?}: retried step differs from an unfailed one"
            );
        }
    }
}

struct NoExperts;
impl ExpertBackend for NoExperts {
    fn input_type(&self, layer: usize) -> Result<GgmlType, ExpertError> {
        Err(ExpertError::Unavailable {
            layer,
            reason: "placeholder".into(),
        })
    }
    fn submit(&self, b: &ExpertBatch<'_>) -> Result<Box<dyn InFlight>, ExpertError> {
        Err(ExpertError::Unavailable {
            layer: b.layer,
            reason: "placeholder".into(),
        })
    }
}

#[test]
fn a_shared_1000_token_prefix_is_computed_once_for_8_sequences() {
    set_threads();
    let m = gemma();
    let text = std::fs::read_to_string(root().join("tests/data/text/gpl-3.txt")).unwrap();
    let toks = m.tokenizer.encode(&text, true, false);
    let prefix = &toks[..1000];
    let ps: Vec<Vec<u32>> = (0..8)
        .map(|i| {
            let mut p = prefix.to_vec();
            p.extend_from_slice(&toks[2000 + 10 * i..2010 + 10 * i]);
            p
        })
        .collect();
    let opts = options(Numerics::Invariant, 8, 256, 4);
    let t = Instant::now();
    let (shared, s1) = engine::run(&m, &ps, &opts).unwrap();
    let t_shared = t.elapsed().as_secs_f64();
    // The same without sharing: a parity-mode pool never shares, so run invariant numerics on
    // a pool built with sharing off.
    let mut pool = ternfleet_coordinator::kv_pool::KvPool::new(
        m.cfg.n_layer,
        m.cfg.k_dim(),
        m.cfg.v_dim(),
        256 << 20,
        false,
    )
    .unwrap();
    let t = Instant::now();
    let (unshared, s2) = engine::run_on(&m, &mut pool, &ps, &opts).unwrap();
    let t_unshared = t.elapsed().as_secs_f64();
    assert_same_bits(&shared, &unshared, "shared prefix vs computed");
    // 1010-token prompts: the first 15 blocks (960 positions) are whole prefix blocks.
    assert_eq!(s1.prefix_reused, 7 * 960);
    assert_eq!(s2.prefix_reused, 0);
    let prompt_rows = |s: &engine::RunStats| s.rows - s.generated + 8;
    assert_eq!(prompt_rows(&s1), 1010 + 7 * 50);
    assert_eq!(prompt_rows(&s2), 8 * 1010);
    println!(
        "prefix sharing: prompt rows computed {} vs {} without sharing; {:.2}s vs {:.2}s",
        prompt_rows(&s1),
        prompt_rows(&s2),
        t_shared,
        t_unshared
    );
}

/// The rows an observer is shown, per layer: FFN inputs and routed tokens.
struct RowCounter {
    d: usize,
    ffn_rows: Vec<usize>,
    routed_rows: Vec<usize>,
}

impl Observer for RowCounter {
    fn ffn_input(&mut self, layer: usize, x: &[f32]) {
        self.ffn_rows[layer] += x.len() / self.d;
    }
    fn routes(&mut self, layer: usize, routes: &[ternfleet_shared::expert::Route], _: &[f32]) {
        let mut tokens: Vec<u32> = routes.iter().map(|r| r.token).collect();
        tokens.dedup();
        self.routed_rows[layer] += tokens.len();
    }
}

/// The last layer's FFN runs only on the rows that want logits (llama.cpp's `inp_out_ids`;
/// in parity numerics the row count decides its matmuls' float order): an observed pass must
/// give the same bits as a plain one, and still show its observer every row there.
#[test]
fn an_observed_pass_gives_the_same_logits_and_sees_every_row_of_the_last_layer() {
    set_threads();
    // A dense model whose matmul order moves with the row count at any prompt of 8 or more
    // tokens (the IQ grid types' vec_dot / tiled orders; whether that reaches the logits
    // depends on the prompt: one of these 16 does when the observed pass runs the last FFN
    // on every row), and an MoE model for the routes.
    let iq2_xs = Model::open(&root().join("tests/data/models/tiny-llama-iq2_xs.gguf"))
        .expect("IQ2_XS test model");
    for (m, routed) in [(iq2_xs, false), (moe(), true)] {
        let n_layer = m.cfg.n_layer;
        for prompt in prompts(&m).into_iter().filter(|p| p.len() >= 8) {
            let mut c = m.new_cache(prompt.len() + 1);
            let plain = m.forward(&mut c, &prompt, Logits::Last).unwrap();
            let mut obs = RowCounter {
                d: m.cfg.n_embd,
                ffn_rows: vec![0; n_layer],
                routed_rows: vec![0; n_layer],
            };
            let mut c = m.new_cache(prompt.len() + 1);
            let observed = m
                .forward_observed(&mut c, &prompt, Logits::Last, &mut obs)
                .unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&plain), bits(&observed), "observed logits differ");
            assert_eq!(obs.ffn_rows, vec![prompt.len(); n_layer]);
            let want_routed = if routed { prompt.len() } else { 0 };
            assert_eq!(obs.routed_rows, vec![want_routed; n_layer]);
        }
    }
}
