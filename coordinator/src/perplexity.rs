//! Perplexity exactly as llama.cpp's `llama-perplexity` computes it (tools/perplexity/
//! perplexity.cpp `perplexity()`): the text is tokenized with BOS, cut into non-overlapping
//! chunks of `n_ctx` tokens, the first token of each chunk is replaced by BOS, each chunk runs
//! from an empty cache, and only the second half of each chunk is scored:
//! tokens `first = n_ctx/2 .. n_ctx-1` predict their successors; `log_softmax` in f64.

use crate::model::{ForwardError, Logits, Model};
use crate::ops;

/// Result of a perplexity run.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Perplexity {
    pub ppl: f64,
    pub chunks: usize,
    /// Tokens in the text (with BOS).
    pub tokens: usize,
    /// Running estimate after each chunk (llama-perplexity prints these).
    pub ppl_chunks: Vec<f64>,
}

/// Errors of a perplexity run.
#[derive(Debug, thiserror::Error)]
pub enum PerplexityError {
    #[error(
        "the text has {tokens} tokens; perplexity at ctx {n_ctx} needs at least {need} (2 × ctx)"
    )]
    TooShort {
        tokens: usize,
        n_ctx: usize,
        need: usize,
    },
    #[error("ctx must be at least 8, got {0}")]
    BadCtx(usize),
    #[error(transparent)]
    Forward(#[from] ForwardError),
}

/// llama-perplexity's default `n_batch` (tokens per `llama_decode`).
const LLAMA_PPL_N_BATCH: usize = 2048;

/// Computes perplexity of `text` at context `n_ctx`, `batch` tokens per forward pass (llama.cpp's
/// `n_ubatch`; shared among the chunks llama-perplexity evaluates together), calling
/// `progress(done, total, running_ppl)` after each chunk. `max_chunks` limits the chunks scored.
pub fn perplexity(
    model: &Model,
    opts: crate::kv_cache::SeqOptions,
    text: &str,
    n_ctx: usize,
    batch: usize,
    max_chunks: Option<usize>,
    progress: impl FnMut(usize, usize, f64),
) -> Result<Perplexity, PerplexityError> {
    perplexity_observed(
        model,
        opts,
        text,
        n_ctx,
        batch,
        max_chunks,
        progress,
        &mut crate::model::NoObserver,
        |_| {},
    )
}

/// [`perplexity`], showing `obs` inside every forward pass and `scored` the logits rows of
/// each chunk's scored positions (`(n_ctx - 1 - n_ctx/2) × n_vocab`, in order).
#[allow(clippy::too_many_arguments)]
pub fn perplexity_observed(
    model: &Model,
    opts: crate::kv_cache::SeqOptions,
    text: &str,
    n_ctx: usize,
    batch: usize,
    max_chunks: Option<usize>,
    mut progress: impl FnMut(usize, usize, f64),
    obs: &mut dyn crate::model::Observer,
    mut scored: impl FnMut(&[f32]),
) -> Result<Perplexity, PerplexityError> {
    if n_ctx < 8 {
        return Err(PerplexityError::BadCtx(n_ctx));
    }
    // llama-perplexity reads the file and drops one trailing newline before tokenizing.
    let text = text.strip_suffix('\n').unwrap_or(text);
    let tokens = model.tokenizer.encode(text, true, false);
    if tokens.len() < 2 * n_ctx {
        return Err(PerplexityError::TooShort {
            tokens: tokens.len(),
            n_ctx,
            need: 2 * n_ctx,
        });
    }
    let mut n_chunk = tokens.len() / n_ctx;
    if let Some(m) = max_chunks {
        n_chunk = n_chunk.min(m.max(1));
    }
    let first = n_ctx / 2;
    let add_bos = model.tokenizer.add_bos();
    let bos = model.tokenizer.bos();
    let n_vocab = model.cfg.n_vocab;
    let mut nll = 0f64;
    let mut count = 0usize;
    let mut ppl_chunks = Vec::with_capacity(n_chunk);
    let mut cache = model.new_cache_with(n_ctx, opts);
    for c in 0..n_chunk {
        let start = c * n_ctx;
        let mut chunk = tokens[start..start + n_ctx].to_vec();
        if let (true, Some(b)) = (add_bos, bos) {
            chunk[0] = b;
        }
        cache.clear();
        let mut logits = Vec::with_capacity((n_ctx - first) * n_vocab);
        // llama-perplexity decodes n_seq = 2048 / n_ctx chunks at once as parallel sequences,
        // and llama.cpp splits that batch into ubatches of `batch` tokens holding an equal
        // share of every sequence. The share decides which attention kernel (and rounding) it
        // uses, so each chunk goes through our forward passes in the same pieces.
        let n_seq = (LLAMA_PPL_N_BATCH / n_ctx).max(1);
        let group = (n_chunk - c / n_seq * n_seq).min(n_seq);
        let step = if n_seq == 1 { batch } else { batch / group }.max(1);
        let mut pos = 0;
        for part in chunk.chunks(step) {
            let end = pos + part.len();
            if end > first {
                let from = first.saturating_sub(pos);
                logits.extend(model.forward_observed(&mut cache, part, Logits::From(from), obs)?);
            } else {
                model.forward_observed(&mut cache, part, Logits::None, obs)?;
            }
            pos = end;
        }
        // logits row r is position first + r; it predicts tokens[start + first + r + 1].
        for r in 0..n_ctx - 1 - first {
            let row = &logits[r * n_vocab..(r + 1) * n_vocab];
            nll -= ops::log_softmax_at(row, tokens[start + first + r + 1] as usize);
            count += 1;
        }
        scored(&logits[..(n_ctx - 1 - first) * n_vocab]);
        let running = (nll / count as f64).exp();
        ppl_chunks.push(running);
        progress(c + 1, n_chunk, running);
    }
    Ok(Perplexity {
        ppl: (nll / count as f64).exp(),
        chunks: n_chunk,
        tokens: tokens.len(),
        ppl_chunks,
    })
}
