//! `ternfleet routing`: how an MoE model routes a text, and how well the shadow predictor and
//! the expert store would do on it.
//!
//! Over the first `tokens` tokens of a text (run as `ternfleet perplexity` runs it):
//! - per layer, the distinct experts used and the entropy of the routing histogram (a model
//!   whose routing collapsed onto a few experts makes every memory figure meaningless, so
//!   these numbers go next to every figure measured on a model);
//! - the router-based predictor's recall of the true top-k at lookahead 1..=4 layers
//!   ([`crate::model::predict::RouterPredictor`], hinted set fixed at k experts per layer:
//!   hinting everything is not a prediction);
//! - with `--prefetch learned`, the same for the learned predictor
//!   ([`crate::model::predict::LearnedPredictor`], `model.learned`);
//! - the expert store's hit rate with and without those hints when 25 % and 50 % of the
//!   experts fit the budget: the routing trace replayed token by token (decode order) through
//!   the store's own policy (`ternfleet_node::store::Policy`), reads completing at once.

use std::time::Instant;

use ternfleet_node::store::{Demand, Evict, ExpertId, Policy};
use ternfleet_shared::expert::Route;

use crate::kv_cache::SeqOptions;
use crate::model::predict::{LearnedPredictor, RouterPredictor};
use crate::model::{Model, Observer};
use crate::perplexity::{perplexity_observed, PerplexityError};

/// The farthest lookahead measured.
pub const MAX_LOOKAHEAD: usize = 4;

/// One layer's routing over the measured tokens.
#[derive(Debug, serde::Serialize)]
pub struct LayerRouting {
    pub layer: usize,
    pub distinct: usize,
    /// Entropy of the histogram of routed experts, in bits (the maximum is log2(n_expert)).
    pub entropy_bits: f64,
}

/// One store replay.
#[derive(Debug, serde::Serialize)]
pub struct StoreReplay {
    /// Fraction of all experts the budget holds.
    pub resident: f64,
    /// `lru` or `lfu`.
    pub evict: &'static str,
    /// What hinted the store: `none`, `router` or `learned`.
    pub hints: &'static str,
    pub hit_rate: f64,
    pub prefetches: u64,
    pub prefetch_used: u64,
    pub prefetch_wasted: u64,
}

/// The result of [`routing`].
#[derive(Debug, serde::Serialize)]
pub struct RoutingReport {
    pub tokens: usize,
    pub n_expert: usize,
    pub k: usize,
    pub layers: Vec<LayerRouting>,
    pub distinct_min: usize,
    pub distinct_mean: f64,
    pub entropy_mean_bits: f64,
    pub entropy_max_bits: f64,
    /// Router predictor: mean recall of the true top-k at lookahead 1, 2, 3, 4 layers
    /// (`None` where the model has too few layers).
    pub recall: Vec<Option<f64>>,
    /// The same for the learned predictor (`None`: not measured).
    pub recall_learned: Option<Vec<Option<f64>>>,
    pub store: Vec<StoreReplay>,
}

/// Per layer, per token: the routed experts and the predictions made for it from earlier
/// layers (`pred[j-1]`: made at layer `l - j`).
struct Trace<'a> {
    predictor: RouterPredictor<'a>,
    learned: Option<&'a LearnedPredictor>,
    k: usize,
    n_layer: usize,
    n_embd: usize,
    limit: usize,
    /// `routed[l]`: k experts per token, in token order.
    routed: Vec<Vec<u32>>,
    /// `pred[l][j-1]`: k predicted experts per token for layer l, made j layers earlier.
    pred: Vec<Vec<Vec<u32>>>,
    /// The same from the learned predictor.
    pred_learned: Vec<Vec<Vec<u32>>>,
}

impl Observer for Trace<'_> {
    fn ffn_residual(&mut self, layer: usize, x: &[f32]) {
        let n = x.len() / self.n_embd.max(1);
        // Predictions for tokens beyond the limit are not recorded.
        let have = self.routed[layer].len() / self.k;
        let n = n.min(self.limit.saturating_sub(have));
        if n == 0 {
            return;
        }
        for j in 1..=MAX_LOOKAHEAD {
            let target = layer + j;
            if target >= self.n_layer {
                break;
            }
            let p = self.predictor.predict(x, n, target, self.k);
            if let Some(lp) = self.learned {
                // Where it has no map, the learned predictor is the router predictor.
                let pl = if lp.has(layer, target) {
                    lp.predict(x, n, layer, target, self.k)
                } else {
                    p.clone()
                };
                self.pred_learned[target][j - 1].extend(pl);
            }
            self.pred[target][j - 1].extend(p);
        }
    }

    fn routes(&mut self, layer: usize, routes: &[Route], scores: &[f32]) {
        let Some(n) = routes.iter().map(|r| r.token as usize + 1).max() else {
            return;
        };
        let n_expert = scores.len() / n;
        let have = self.routed[layer].len() / self.k;
        let take = n.min(self.limit.saturating_sub(have));
        let mut per = vec![Vec::with_capacity(self.k); take];
        for r in routes {
            if (r.token as usize) < take && (r.expert as usize) < n_expert {
                per[r.token as usize].push(r.expert);
            }
        }
        for p in per {
            self.routed[layer].extend(p.iter().copied().take(self.k));
        }
    }
}

fn entropy_bits(counts: &[u64]) -> f64 {
    let total: u64 = counts.iter().sum();
    if total == 0 {
        return 0.0;
    }
    counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = c as f64 / total as f64;
            -p * p.log2()
        })
        .sum()
}

/// Replays `routed` (per layer, k experts per token) token by token through the store's
/// policy with a budget of `resident` of all experts (every expert counted as one unit),
/// hinting each layer's predicted experts 1 to 4 layers ahead from `hints` (its name and
/// predictions) when given.
fn replay(
    routed: &[Vec<u32>],
    hints: Option<(&'static str, &[Vec<Vec<u32>>])>,
    k: usize,
    n_expert: usize,
    resident: f64,
    evict: Evict,
) -> StoreReplay {
    let budget = ((routed.len() * n_expert) as f64 * resident)
        .round()
        .max(k as f64) as u64;
    let mut p = Policy::with_eviction(budget, evict);
    let t = Instant::now();
    let tokens = routed.iter().map(|r| r.len() / k).min().unwrap_or(0);
    let id = |l: usize, e: u32| ExpertId {
        layer: l as u32,
        expert: e,
    };
    for tok in 0..tokens {
        for (l, layer) in routed.iter().enumerate() {
            if let Some((_, pred)) = hints {
                for (j, pj) in pred.iter().skip(l + 1).take(MAX_LOOKAHEAD).enumerate() {
                    // pred[l + 1 + j][j]: made at layer l for layer l + 1 + j.
                    if let Some(set) = pj.get(j).and_then(|v| v.get(tok * k..(tok + 1) * k)) {
                        for &e in set {
                            if p.hint(id(l + 1 + j, e), 1, t).is_some() {
                                p.read_done(id(l + 1 + j, e), true, t);
                            }
                        }
                    }
                }
            }
            let set = &layer[tok * k..(tok + 1) * k];
            for &e in set {
                if let Ok(Demand::Read { .. }) = p.demand(id(l, e), 1, t) {
                    p.read_done(id(l, e), true, t);
                }
            }
            // Hints for this layer that it did not use lose their protection.
            p.layer_ran(l as u32);
            for &e in set {
                p.release(id(l, e));
            }
        }
    }
    let s = p.stats();
    StoreReplay {
        resident,
        evict: match evict {
            Evict::Lru => "lru",
            Evict::Lfu => "lfu",
        },
        hints: hints.map_or("none", |h| h.0),
        hit_rate: s.hit_rate(),
        prefetches: s.prefetches,
        prefetch_used: s.prefetch_used,
        prefetch_wasted: s.prefetch_wasted,
    }
}

/// Errors of [`routing`].
#[derive(Debug, thiserror::Error)]
pub enum RoutingError {
    #[error("{0} is not a mixture-of-experts model")]
    Dense(String),
    #[error(transparent)]
    Run(#[from] PerplexityError),
}

/// Routes the first `tokens` tokens of `text` (chunks of `n_ctx`) and reports.
pub fn routing(
    model: &Model,
    opts: SeqOptions,
    text: &str,
    tokens: usize,
    n_ctx: usize,
    mut progress: impl FnMut(usize, usize),
) -> Result<RoutingReport, RoutingError> {
    let cfg = &model.cfg;
    let (Some(m), Some(predictor)) = (&cfg.moe, RouterPredictor::new(cfg, &model.weights)) else {
        return Err(RoutingError::Dense(cfg.arch.name().to_string()));
    };
    let k = opts.top_experts.unwrap_or(m.n_expert_used);
    let n_layer = cfg.n_layer;
    let mut trace = Trace {
        predictor,
        learned: model.learned.as_deref(),
        k,
        n_layer,
        n_embd: cfg.n_embd,
        limit: tokens,
        routed: vec![Vec::new(); n_layer],
        pred: vec![vec![Vec::new(); MAX_LOOKAHEAD]; n_layer],
        pred_learned: vec![vec![Vec::new(); MAX_LOOKAHEAD]; n_layer],
    };
    let chunks = tokens.div_ceil(n_ctx).max(1);
    perplexity_observed(
        model,
        opts,
        text,
        n_ctx,
        n_ctx,
        Some(chunks),
        |d, t, _| progress(d, t),
        &mut trace,
        |_| {},
    )?;
    let n_tok = trace.routed.iter().map(|r| r.len() / k).min().unwrap_or(0);
    let mut layers = Vec::new();
    for (l, r) in trace.routed.iter().enumerate() {
        if r.is_empty() {
            continue;
        }
        let mut counts = vec![0u64; m.n_expert];
        for &e in &r[..n_tok * k] {
            counts[e as usize] += 1;
        }
        layers.push(LayerRouting {
            layer: l,
            distinct: counts.iter().filter(|&&c| c > 0).count(),
            entropy_bits: entropy_bits(&counts),
        });
    }
    let recall = recall_of(&trace.routed, &trace.pred, k, n_tok);
    let recall_learned = trace
        .learned
        .map(|_| recall_of(&trace.routed, &trace.pred_learned, k, n_tok));
    let mut store = Vec::new();
    for resident in [0.25, 0.5] {
        for evict in [Evict::Lru, Evict::Lfu] {
            let mut hints = vec![None, Some(("router", &trace.pred[..]))];
            if trace.learned.is_some() {
                hints.push(Some(("learned", &trace.pred_learned[..])));
            }
            for h in hints {
                store.push(replay(&trace.routed, h, k, m.n_expert, resident, evict));
            }
        }
    }
    let nl = layers.len().max(1) as f64;
    Ok(RoutingReport {
        tokens: n_tok,
        n_expert: m.n_expert,
        k,
        distinct_min: layers.iter().map(|l| l.distinct).min().unwrap_or(0),
        distinct_mean: layers.iter().map(|l| l.distinct as f64).sum::<f64>() / nl,
        entropy_mean_bits: layers.iter().map(|l| l.entropy_bits).sum::<f64>() / nl,
        entropy_max_bits: (m.n_expert as f64).log2(),
        layers,
        recall,
        recall_learned,
        store,
    })
}

/// Mean recall of the true top-k at lookahead 1..=[`MAX_LOOKAHEAD`] (`pred[l][j-1]`: made
/// `j` layers before `l`).
fn recall_of(
    routed: &[Vec<u32>],
    pred: &[Vec<Vec<u32>>],
    k: usize,
    n_tok: usize,
) -> Vec<Option<f64>> {
    let mut recall = Vec::new();
    for j in 1..=MAX_LOOKAHEAD {
        let (mut hit, mut total) = (0usize, 0usize);
        for l in j..routed.len() {
            let (truth, pred) = (&routed[l], &pred[l][j - 1]);
            let n = (truth.len().min(pred.len()) / k).min(n_tok);
            for t in 0..n {
                let want = &truth[t * k..(t + 1) * k];
                hit += pred[t * k..(t + 1) * k]
                    .iter()
                    .filter(|e| want.contains(e))
                    .count();
                total += k;
            }
        }
        recall.push((total > 0).then(|| hit as f64 / total as f64));
    }
    recall
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entropy_of_uniform_and_collapsed_histograms() {
        assert!((entropy_bits(&[5, 5, 5, 5]) - 2.0).abs() < 1e-12);
        assert_eq!(entropy_bits(&[0, 9, 0, 0]), 0.0);
        assert_eq!(entropy_bits(&[0, 0]), 0.0);
    }

    #[test]
    fn perfect_hints_turn_every_cold_miss_into_a_hit() {
        // 3 layers, 4 experts, k = 1; every token uses expert (token + layer) % 4.
        let (n_layer, k, ne, n_tok) = (3, 1, 4, 40);
        let routed: Vec<Vec<u32>> = (0..n_layer)
            .map(|l| (0..n_tok).map(|t| ((t + l) % ne) as u32).collect())
            .collect();
        // Exact predictions from every earlier layer.
        let pred: Vec<Vec<Vec<u32>>> = (0..n_layer)
            .map(|l| vec![routed[l].clone(); MAX_LOOKAHEAD])
            .collect();
        let cold = replay(&routed, None, k, ne, 0.5, Evict::Lru);
        let hinted = replay(&routed, Some(("router", &pred)), k, ne, 0.5, Evict::Lru);
        assert!(cold.hit_rate < 0.5, "{cold:?}");
        // Layer 0 has no earlier layer to predict it: its misses remain.
        assert!(hinted.hit_rate > 0.6, "{hinted:?}");
        assert!(hinted.prefetch_used > 0 && hinted.prefetches >= hinted.prefetch_used);
    }
}
