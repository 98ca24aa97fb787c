//! Two models on the same text: perplexity of each, how often their top-1 predictions agree,
//! and (for two MoE models with the same experts) how often each layer routes a token to the
//! same set of experts. This is how a converted bundle (MoEfied, ternary) is measured against
//! its source.

use ternfleet_shared::expert::Route;

use crate::kv_cache::SeqOptions;

use crate::model::{Model, Observer};
use crate::perplexity::{perplexity_observed, PerplexityError};

/// Records each token's routed-expert set per layer (as a bit set; models with more than
/// 128 experts are not recorded).
#[derive(Default)]
struct RouteSets {
    sets: Vec<Vec<u128>>,
}

impl Observer for RouteSets {
    fn routes(&mut self, layer: usize, routes: &[Route], scores: &[f32]) {
        let Some(n_tokens) = routes.iter().map(|r| r.token as usize + 1).max() else {
            return;
        };
        let n_expert = scores.len() / n_tokens.max(1);
        if n_expert > 128 {
            return;
        }
        if self.sets.len() <= layer {
            self.sets.resize(layer + 1, Vec::new());
        }
        let base = self.sets[layer].len();
        self.sets[layer].resize(base + n_tokens, 0);
        for r in routes.iter().filter(|r| (r.expert as usize) < n_expert) {
            self.sets[layer][base + r.token as usize] |= 1u128 << r.expert;
        }
    }
}

/// The result of [`compare`].
#[derive(Debug, serde::Serialize)]
pub struct Comparison {
    pub ppl: f64,
    pub ppl_ref: f64,
    /// Scored positions whose most likely next token is the same in both models.
    pub top1_agreement: f64,
    pub scored: usize,
    pub chunks: usize,
    /// Per layer: the fraction of tokens whose routed-expert set is the same in both models
    /// (both MoE with the same expert count).
    pub routing_agreement: Option<Vec<f64>>,
}

fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best
}

/// Runs `model` and `reference` over `text` as `ternfleet perplexity` does and compares them.
#[allow(clippy::too_many_arguments)]
pub fn compare(
    model: &Model,
    reference: &Model,
    opts: SeqOptions,
    ref_opts: SeqOptions,
    text: &str,
    n_ctx: usize,
    batch: usize,
    max_chunks: Option<usize>,
    mut progress: impl FnMut(&str, usize, usize),
) -> Result<Comparison, PerplexityError> {
    let mut run = |m: &Model, o: SeqOptions, what: &str| {
        let n_vocab = m.cfg.n_vocab;
        let mut obs = RouteSets::default();
        let mut top = Vec::new();
        let r = perplexity_observed(
            m,
            o,
            text,
            n_ctx,
            batch,
            max_chunks,
            |d, t, _| progress(what, d, t),
            &mut obs,
            |rows| top.extend(rows.chunks_exact(n_vocab).map(argmax)),
        )?;
        Ok::<_, PerplexityError>((r, top, obs.sets))
    };
    let (a, top_a, sets_a) = run(model, opts, "model")?;
    let (b, top_b, sets_b) = run(reference, ref_opts, "reference")?;
    let same = top_a.iter().zip(&top_b).filter(|(x, y)| x == y).count();
    let same_experts = matches!(
        (&model.cfg.moe, &reference.cfg.moe),
        (Some(x), Some(y)) if x.n_expert == y.n_expert
    );
    let routing_agreement = (same_experts && !sets_a.is_empty() && sets_a.len() == sets_b.len())
        .then(|| {
            sets_a
                .iter()
                .zip(&sets_b)
                .map(|(x, y)| {
                    let n = x.len().min(y.len()).max(1);
                    x.iter().zip(y).filter(|(p, q)| p == q).count() as f64 / n as f64
                })
                .collect()
        });
    Ok(Comparison {
        ppl: a.ppl,
        ppl_ref: b.ppl,
        top1_agreement: same as f64 / top_a.len().max(1) as f64,
        scored: top_a.len(),
        chunks: a.chunks,
        routing_agreement,
    })
}
