//! Text generation on one sequence: prefill the prompt in batches, then decode token by token.

use crate::kv_cache::KvCache;
use crate::model::{ForwardError, Logits, Model};
use crate::sampler::Sampler;

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt_tokens: Vec<u32>,
    /// Maximum new tokens.
    pub max_tokens: usize,
    /// Prompt tokens per forward pass (llama.cpp's n_ubatch).
    pub batch: usize,
    /// Stop at an end-of-generation token (it is not emitted).
    pub stop_at_eog: bool,
    /// Hash every logit vector sampled from ([`Generation::logits_sha256`]).
    pub digest: bool,
}

/// Result of [`generate`].
#[derive(Clone, Debug, Default)]
pub struct Generation {
    pub tokens: Vec<u32>,
    /// Seconds spent on the prompt and on decoding.
    pub prefill_s: f64,
    pub decode_s: f64,
    /// With [`GenerateRequest::digest`]: SHA-256 of the bits of every logit vector a token
    /// was sampled from, in order (two runs agree on it only if every logit is bit-equal).
    pub logits_sha256: Option<String>,
}

/// Runs `req`, calling `on_token` with each new token as soon as it is chosen.
pub fn generate(
    model: &Model,
    cache: &mut KvCache,
    sampler: &mut Sampler,
    req: &GenerateRequest,
    mut on_token: impl FnMut(u32),
) -> Result<Generation, ForwardError> {
    let mut out = Generation::default();
    if req.max_tokens == 0 || req.prompt_tokens.is_empty() {
        return Ok(out);
    }
    cache.reserve(req.prompt_tokens.len() + req.max_tokens - 1)?;
    let t0 = std::time::Instant::now();
    let mut logits = Vec::new();
    let chunks: Vec<&[u32]> = req.prompt_tokens.chunks(req.batch.max(1)).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        // Only the prompt's last position needs logits.
        let want = if i + 1 == chunks.len() {
            Logits::Last
        } else {
            Logits::None
        };
        logits = model.forward(cache, chunk, want)?;
    }
    out.prefill_s = t0.elapsed().as_secs_f64();
    let t1 = std::time::Instant::now();
    let mut history = req.prompt_tokens.clone();
    let mut digest = req.digest.then(<sha2::Sha256 as sha2::Digest>::new);
    for i in 0..req.max_tokens {
        if let Some(h) = digest.as_mut() {
            for v in &logits {
                sha2::Digest::update(h, v.to_bits().to_le_bytes());
            }
        }
        let tok = sampler.sample(&logits, &history);
        if req.stop_at_eog && model.tokenizer.is_eog(tok) {
            break;
        }
        out.tokens.push(tok);
        history.push(tok);
        on_token(tok);
        if i + 1 < req.max_tokens {
            logits = model.forward(cache, &[tok], Logits::Last)?;
        }
    }
    out.decode_s = t1.elapsed().as_secs_f64();
    out.logits_sha256 = digest.map(hex);
    Ok(out)
}

/// SHA-256 (hex) of the bits of logit rows, in order: what `--logits-digest` prints.
pub fn logits_sha256(rows: &[Vec<f32>]) -> String {
    let mut h = <sha2::Sha256 as sha2::Digest>::new();
    for v in rows.iter().flatten() {
        sha2::Digest::update(&mut h, v.to_bits().to_le_bytes());
    }
    hex(h)
}

fn hex(h: sha2::Sha256) -> String {
    sha2::Digest::finalize(h)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
