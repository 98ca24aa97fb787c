//! Throughput measurement shaped like `llama-bench` (tools/llama-bench/llama-bench.cpp
//! `test_prompt`/`test_gen`): pp = one prompt of `n_prompt` random tokens (BOS first) from an
//! empty cache, logits for the last token only; tg = `n_gen` single-token decodes from an empty
//! cache. One warm-up run, then the mean over `reps` runs.

use crate::model::{ForwardError, Logits, Model};

/// Measured throughput.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BenchResult {
    pub pp_tps: f64,
    pub tg_tps: f64,
    pub n_prompt: usize,
    pub n_gen: usize,
    pub threads: usize,
    pub reps: usize,
    pub kernels: &'static str,
}

/// Runs the benchmark; `batch` is the prompt tokens per forward pass.
pub fn bench(
    model: &Model,
    n_prompt: usize,
    n_gen: usize,
    batch: usize,
    reps: usize,
) -> Result<BenchResult, ForwardError> {
    let n_vocab = model.cfg.n_vocab as u64;
    let mut rng = 0x2545_F491_4F6C_DD1Du64;
    let mut rand_tok = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % n_vocab) as u32
    };
    let mut cache = model.new_cache(n_prompt.max(n_gen + 1));
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
    let (mut pp_s, mut tg_s) = (0.0, 0.0);
    if n_prompt > 0 {
        run_pp(&mut cache)?;
        for _ in 0..reps {
            pp_s += run_pp(&mut cache)?;
        }
    }
    let mut tok = model.tokenizer.bos().unwrap_or(0);
    let mut run_tg = |cache: &mut crate::kv_cache::KvCache| -> Result<f64, ForwardError> {
        cache.clear();
        let t = std::time::Instant::now();
        for i in 0..n_gen {
            model.forward(cache, &[tok], Logits::Last)?;
            tok = (i as u32 * 2_654_435_761u32) % n_vocab as u32;
        }
        Ok(t.elapsed().as_secs_f64())
    };
    if n_gen > 0 {
        run_tg(&mut cache)?;
        for _ in 0..reps {
            tg_s += run_tg(&mut cache)?;
        }
    }
    let rate = |n: usize, s: f64| if s > 0.0 { (n * reps) as f64 / s } else { 0.0 };
    Ok(BenchResult {
        pp_tps: rate(n_prompt, pp_s),
        tg_tps: rate(n_gen, tg_s),
        n_prompt,
        n_gen,
        threads: rayon::current_num_threads(),
        reps,
        kernels: ternfleet_kernels::isa_name(),
    })
}
