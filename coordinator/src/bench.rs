//! Throughput measurement shaped like `llama-bench` (tools/llama-bench/llama-bench.cpp
//! `test_prompt`/`test_gen`): pp = one prompt of `n_prompt` random tokens (BOS first) from an
//! empty cache, logits for the last token only; tg = `n_gen` single-token decodes from an empty
//! cache. One warm-up run, then the mean over `reps` runs (each run's rate is kept too: on a
//! noisy host the spread says whether two means differ).

use crate::model::{ForwardError, Logits, Model};

/// Measured throughput.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BenchResult {
    pub pp_tps: f64,
    pub tg_tps: f64,
    /// Each timed run's prefill tokens/s (`reps` of them; empty without a prompt).
    pub pp_tps_runs: Vec<f64>,
    /// Each timed run's decode tokens/s (`reps` of them; empty without `n_gen`).
    pub tg_tps_runs: Vec<f64>,
    pub n_prompt: usize,
    pub n_gen: usize,
    pub threads: usize,
    pub reps: usize,
    pub kernels: &'static str,
    pub numerics: &'static str,
    /// `--parallel N`: sequences decoding together.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parallel: Option<usize>,
    /// `--parallel N`: aggregate decode tokens/s of N sequences.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agg_tg_tps: Option<f64>,
    /// `--ram-budget`: the expert store's counters over the whole run (warm-up included).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub store: Option<ternfleet_shared::expert::StoreStats>,
}

/// Token ids below `n_vocab` from a xorshift64 stream seeded with `seed` (benchmark prompts:
/// random, reproducible).
fn random_tokens(seed: u64, n_vocab: u64) -> impl FnMut() -> u32 {
    let mut rng = seed;
    move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % n_vocab) as u32
    }
}

/// Runs the benchmark; `batch` is the prompt tokens per forward pass.
pub fn bench(
    model: &Model,
    opts: crate::kv_cache::SeqOptions,
    n_prompt: usize,
    n_gen: usize,
    batch: usize,
    reps: usize,
) -> Result<BenchResult, ForwardError> {
    let n_vocab = model.cfg.n_vocab as u64;
    let mut rand_tok = random_tokens(0x2545_F491_4F6C_DD1D, n_vocab);
    let mut cache = model.new_cache_with(n_prompt.max(n_gen.saturating_add(1)), opts);
    let mut run_pp = |cache: &mut crate::kv_cache::KvCache| -> Result<f64, ForwardError> {
        let mut toks: Vec<u32> = (0..n_prompt).map(|_| rand_tok()).collect();
        if let (true, Some(b)) = (model.tokenizer.add_bos(), model.tokenizer.bos()) {
            toks[0] = b;
        }
        cache.clear();
        let t = std::time::Instant::now();
        for c in toks.chunks(batch.max(1)) {
            model.forward(cache, c, Logits::Last)?;
        }
        Ok(t.elapsed().as_secs_f64())
    };
    let reps = reps.max(1);
    let (mut pp_runs, mut tg_runs) = (Vec::new(), Vec::new());
    if n_prompt > 0 {
        run_pp(&mut cache)?;
        for _ in 0..reps {
            pp_runs.push(run_pp(&mut cache)?);
        }
    }
    let mut tok = model.tokenizer.bos().unwrap_or(0);
    let mut run_tg = |cache: &mut crate::kv_cache::KvCache| -> Result<f64, ForwardError> {
        cache.clear();
        let t = std::time::Instant::now();
        for i in 0..n_gen {
            model.forward(cache, &[tok], Logits::Last)?;
            tok = ((i as u64).wrapping_mul(2_654_435_761) % n_vocab) as u32;
        }
        Ok(t.elapsed().as_secs_f64())
    };
    if n_gen > 0 {
        run_tg(&mut cache)?;
        for _ in 0..reps {
            tg_runs.push(run_tg(&mut cache)?);
        }
    }
    // The mean is tokens over total time (the harmonic mean of the runs' rates; llama-bench's
    // avg_ts is their arithmetic mean), each run's rate its own tokens over its time.
    let rate = |n: usize, runs: &[f64]| {
        let s: f64 = runs.iter().sum();
        if s > 0.0 {
            (n * runs.len()) as f64 / s
        } else {
            0.0
        }
    };
    let each = |n: usize, runs: &[f64]| runs.iter().map(|&s| rate(n, &[s])).collect();
    Ok(BenchResult {
        pp_tps: rate(n_prompt, &pp_runs),
        tg_tps: rate(n_gen, &tg_runs),
        pp_tps_runs: each(n_prompt, &pp_runs),
        tg_tps_runs: each(n_gen, &tg_runs),
        n_prompt,
        n_gen,
        threads: rayon::current_num_threads(),
        reps,
        kernels: ternfleet_kernels::isa_name(),
        numerics: opts.numerics.name(),
        parallel: None,
        agg_tg_tps: None,
        store: None,
    })
}

/// Aggregate decode throughput of `n_seq` sequences decoding together, shaped like
/// `llama-batched-bench`'s S_TG: each sequence first prefills `n_prompt` random tokens (not
/// timed), then `n_gen` steps each decode one token of every sequence. One warm-up run, then
/// the mean over `reps`.
pub fn bench_parallel(
    model: &Model,
    opts: crate::kv_cache::SeqOptions,
    n_seq: usize,
    n_prompt: usize,
    n_gen: usize,
    reps: usize,
    micro_batches: usize,
) -> Result<f64, ForwardError> {
    use crate::model::{NoObserver, SeqInput, StepOptions};
    let n_vocab = model.cfg.n_vocab as u64;
    let positions = (n_prompt.max(1) + n_gen) as u64;
    let block = crate::kv_pool::KvPool::block_bytes(
        model.cfg.n_layer,
        model.cfg.k_dim(),
        model.cfg.v_dim(),
    );
    let blocks = positions.div_ceil(crate::kv_pool::BLOCK as u64) + 1;
    let mut pool = model.new_pool(block * blocks * n_seq as u64, opts.numerics)?;
    let step = StepOptions {
        numerics: opts.numerics,
        micro_batches,
        ..StepOptions::default()
    };
    let mut once = || -> Result<f64, ForwardError> {
        let seqs: Vec<_> = (0..n_seq)
            .map(|_| pool.add_sequence(positions as usize))
            .collect();
        let mut rand_tok = random_tokens(0x9E37_79B9_7F4A_7C15 ^ n_seq as u64, n_vocab);
        let prompts: Vec<Vec<u32>> = (0..n_seq)
            .map(|_| (0..n_prompt.max(1)).map(|_| rand_tok()).collect())
            .collect();
        for (s, p) in seqs.iter().zip(&prompts) {
            let inp = [SeqInput {
                seq: *s,
                tokens: p,
                logits: crate::model::Logits::Last,
                top_experts: opts.top_experts,
            }];
            model.step(&mut pool, &inp, &step, &mut NoObserver)?;
        }
        let toks: Vec<[u32; 1]> = (0..n_seq).map(|_| [rand_tok()]).collect();
        let t = std::time::Instant::now();
        for _ in 0..n_gen {
            let inputs: Vec<SeqInput<'_>> = seqs
                .iter()
                .zip(&toks)
                .map(|(s, t)| SeqInput {
                    seq: *s,
                    tokens: t,
                    logits: crate::model::Logits::Last,
                    top_experts: opts.top_experts,
                })
                .collect();
            model.step(&mut pool, &inputs, &step, &mut NoObserver)?;
        }
        let dt = t.elapsed().as_secs_f64();
        for s in seqs {
            pool.remove(s)?;
        }
        Ok(dt)
    };
    once()?;
    let reps = reps.max(1);
    let mut total = 0.0;
    for _ in 0..reps {
        total += once()?;
    }
    Ok(if total > 0.0 {
        (n_seq * n_gen * reps) as f64 / total
    } else {
        0.0
    })
}
