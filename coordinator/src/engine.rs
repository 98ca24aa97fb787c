//! The batched engine: many prompts through [`Model::step`], continuously batched.
//!
//! Up to `parallel` sequences run at once; each step carries one decode token of every
//! sequence that is generating and prefill chunks of those still reading their prompt (at most
//! `chunk` prompt tokens per sequence per step, so a long prompt cannot stall the others'
//! next token). When a sequence ends, its blocks go back to the pool and the next prompt joins
//! at the following step. Prompts whose first blocks are already in the pool (a shared
//! prefix) start after them (invariant mode; see [`crate::kv_pool`]).
//!
//! This is the engine the server's scheduler will drive; here it serves the CLI
//! (`generate --prompts FILE --parallel N`, `bench --parallel N`) and the tests.

use std::time::Instant;

use ternfleet_kernels::Numerics;

use crate::kv_pool::{KvPool, SeqId, BLOCK};
use crate::model::{ForwardError, Logits, Model, NoObserver, SeqInput, StepOptions};
use crate::sampler::{ParamError, Sampler, SamplerParams};

/// How the engine runs.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Sequences at once.
    pub parallel: usize,
    /// Prompt tokens per sequence per step.
    pub chunk: usize,
    /// New tokens per prompt at most.
    pub max_tokens: usize,
    /// Stop at an end-of-generation token (not emitted).
    pub stop_at_eog: bool,
    pub numerics: Numerics,
    /// KV pool size in bytes.
    pub kv_budget: u64,
    /// MoE models: experts per token.
    pub top_experts: Option<usize>,
    pub sampling: SamplerParams,
    /// Keep every logits row each sequence produced (tests compare them).
    pub keep_logits: bool,
}

/// One prompt's result.
#[derive(Clone, Debug, Default)]
pub struct Output {
    pub tokens: Vec<u32>,
    /// Logits of the prompt's last position, then of each generated token but the last
    /// (`keep_logits` only).
    pub logits: Vec<Vec<f32>>,
}

/// Totals of a run.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct RunStats {
    pub steps: usize,
    /// Rows computed (prompt tokens not reused + decode tokens).
    pub rows: usize,
    pub prompt_tokens: usize,
    pub generated: usize,
    pub prefix_reused: usize,
    pub wall_s: f64,
}

/// Errors of a run.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Forward(#[from] ForwardError),
    #[error(transparent)]
    Sampler(#[from] ParamError),
    #[error("prompt {index} is empty")]
    EmptyPrompt { index: usize },
    #[error(transparent)]
    Kv(#[from] crate::kv_pool::KvError),
}

struct Active {
    index: usize,
    seq: SeqId,
    prompt: Vec<u32>,
    /// Prompt tokens already in the cache.
    done: usize,
    out: Output,
    sampler: Sampler,
    history: Vec<u32>,
    /// The token to feed next (decode phase).
    next: Option<u32>,
}

/// Tokens two prompts have in common from the start.
fn shared_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Runs every prompt to completion and returns the outputs in prompt order.
pub fn run(
    model: &Model,
    prompts: &[Vec<u32>],
    opts: &EngineOptions,
) -> Result<(Vec<Output>, RunStats), EngineError> {
    let mut pool = model.new_pool(opts.kv_budget, opts.numerics)?;
    run_on(model, &mut pool, prompts, opts)
}

/// [`run`] on a given pool (its cached prefixes are used and kept).
pub fn run_on(
    model: &Model,
    pool: &mut KvPool,
    prompts: &[Vec<u32>],
    opts: &EngineOptions,
) -> Result<(Vec<Output>, RunStats), EngineError> {
    if let Some(i) = prompts.iter().position(|p| p.is_empty()) {
        return Err(EngineError::EmptyPrompt { index: i });
    }
    if opts.max_tokens == 0 {
        return Ok((vec![Output::default(); prompts.len()], RunStats::default()));
    }
    let t_start = Instant::now();
    let step_opts = StepOptions {
        numerics: opts.numerics,
        ..StepOptions::default()
    };
    let mut outputs: Vec<Option<Output>> = vec![None; prompts.len()];
    let mut stats = RunStats::default();
    let mut queue = (0..prompts.len()).peekable();
    let mut active: Vec<Active> = Vec::new();
    let chunk = opts.chunk.max(1);
    loop {
        // Admit.
        while active.len() < opts.parallel.max(1) {
            let Some(&index) = queue.peek() else { break };
            // A prompt that shares a whole block with one still being prefilled waits for it,
            // so the shared blocks are computed once and then reused (prefix sharing only).
            if pool.sharing()
                && active
                    .iter()
                    .any(|a| a.next.is_none() && shared_prefix(&a.prompt, &prompts[index]) >= BLOCK)
            {
                break;
            }
            queue.next();
            let prompt = prompts[index].clone();
            let limit = prompt.len() + opts.max_tokens;
            let seq = pool.add_sequence(limit);
            let reused = pool.reuse_prefix(seq, &prompt)?;
            stats.prefix_reused += reused;
            stats.prompt_tokens += prompt.len();
            let mut params = opts.sampling.clone();
            params.seed = params.seed.wrapping_add(index as u64);
            active.push(Active {
                index,
                seq,
                history: prompt.clone(),
                prompt,
                done: reused,
                out: Output::default(),
                sampler: Sampler::new(params)?,
                next: None,
            });
        }
        if active.is_empty() {
            break;
        }
        // One step.
        let mut feeds: Vec<Vec<u32>> = Vec::with_capacity(active.len());
        for a in &active {
            if let Some(t) = a.next {
                feeds.push(vec![t]);
            } else {
                let end = (a.done + chunk).min(a.prompt.len());
                // Chunks end on block boundaries where they can, so the blocks a prompt fills
                // are whole and shareable as soon as possible.
                let end = if end < a.prompt.len() && end > a.done + BLOCK {
                    end - end % BLOCK
                } else {
                    end
                };
                feeds.push(a.prompt[a.done..end].to_vec());
            }
        }
        let inputs: Vec<SeqInput<'_>> = active
            .iter()
            .zip(&feeds)
            .map(|(a, f)| SeqInput {
                seq: a.seq,
                tokens: f,
                logits: if a.next.is_some() || a.done + f.len() == a.prompt.len() {
                    Logits::Last
                } else {
                    Logits::None
                },
                top_experts: opts.top_experts,
            })
            .collect();
        let logits = model.step(pool, &inputs, &step_opts, &mut NoObserver)?;
        stats.steps += 1;
        stats.rows += feeds.iter().map(Vec::len).sum::<usize>();
        // Sample, finish.
        let mut finished = Vec::new();
        for (i, ((a, f), l)) in active.iter_mut().zip(&feeds).zip(logits).enumerate() {
            if a.next.is_none() {
                a.done += f.len();
                if a.done < a.prompt.len() {
                    continue;
                }
            }
            let tok = a.sampler.sample(&l, &a.history);
            if opts.keep_logits {
                a.out.logits.push(l);
            }
            let eog = opts.stop_at_eog && model.tokenizer.is_eog(tok);
            if !eog {
                a.out.tokens.push(tok);
                a.history.push(tok);
                stats.generated += 1;
            }
            if eog || a.out.tokens.len() >= opts.max_tokens {
                finished.push(i);
            } else {
                a.next = Some(tok);
            }
        }
        for i in finished.into_iter().rev() {
            let a = active.swap_remove(i);
            pool.remove(a.seq)?;
            outputs[a.index] = Some(a.out);
        }
        // Keep admission order stable after swap_remove (deterministic step composition).
        active.sort_by_key(|a| a.index);
    }
    stats.wall_s = t_start.elapsed().as_secs_f64();
    Ok((
        outputs
            .into_iter()
            .map(|o| o.expect("every admitted prompt finishes before the loop ends"))
            .collect(),
        stats,
    ))
}
