//! Fitting the learned shadow predictor ([`LearnedPredictor`]) on calibration text.
//!
//! The model runs over the text as `ternfleet perplexity` runs it. At every layer `s` the
//! residual entering the FFN, RMS-normalised without the norm weight, is a feature row `x̂`
//! (plus a constant 1); at every routed layer `t` the router's logits on the state it really
//! sees are the targets. For each source layer and lookahead `j` (`t = s + j`) a ridge
//! regression
//!
//! `W = argmin ‖X̂ W − Y‖² + λ ‖W − W₀‖²`
//!
//! pulls toward `W₀`, the router predictor (layer `t`'s router times its norm weight, its bias
//! last): with little data, or where the residual barely changes, the fit stays the router
//! predictor; where it learns something, it moves. The last part of the text (10 % by default)
//! is held out: for each pair the strength `λ` is chosen among a grid, the router predictor
//! itself included, by recall of the true top-k on those tokens, so the fitted predictor is at
//! least as good as the router predictor on text it was not fitted on.
//!
//! The normal equations `(X̂ᵀX̂ + λI) W = X̂ᵀY + λW₀` are accumulated in f64 per source layer
//! (one `(d+1)²` matrix, shared by every lookahead) and solved by Cholesky.

use rayon::prelude::*;

use super::predict::{map_logits, rms_scale, top_k, LearnedPredictor};
use super::{Model, Observer};
use crate::kv_cache::SeqOptions;
use crate::perplexity::{perplexity_observed, PerplexityError};

/// Ridge strengths tried, as multiples of the number of training tokens (the features have
/// unit mean square, so `X̂ᵀX̂`'s diagonal is about that number). The router predictor
/// (an infinite strength) is always a candidate too.
pub const ALPHAS: [f64; 6] = [1e-4, 1e-3, 1e-2, 3e-2, 1e-1, 1.0];

/// How to fit.
#[derive(Debug, Clone)]
pub struct FitOptions {
    /// Calibration tokens used (fitting plus held out).
    pub tokens: usize,
    /// The farthest lookahead fitted.
    pub lookahead: usize,
    /// Tokens per forward pass.
    pub ctx: usize,
    /// Fraction of the tokens held out to choose the ridge strength.
    pub holdout: f64,
}

impl Default for FitOptions {
    fn default() -> Self {
        FitOptions {
            tokens: 16384,
            lookahead: 4,
            ctx: 512,
            holdout: 0.1,
        }
    }
}

/// What a fit measured on the held-out tokens.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FitReport {
    pub train_tokens: usize,
    pub holdout_tokens: usize,
    pub k: usize,
    /// Recall of the true top-k at lookahead 1, 2, … on the held-out tokens: the router
    /// predictor, then the fitted one (`None` where the model has too few layers).
    pub router_recall: Vec<Option<f64>>,
    pub learned_recall: Vec<Option<f64>>,
    /// How many (source, lookahead) pairs kept the router predictor (no strength beat it).
    pub pairs_router: usize,
    pub pairs: usize,
}

/// Errors of [`fit`].
#[derive(Debug, thiserror::Error)]
pub enum FitError {
    #[error("{0} is not a mixture-of-experts model")]
    Dense(String),
    #[error("--lookahead must be 1 to 16, got {0}")]
    Lookahead(usize),
    #[error("too few calibration tokens: {train} to fit and {holdout} held out (need at least 64 of each; a longer text or more --tokens)")]
    TooFew { train: usize, holdout: usize },
    #[error(transparent)]
    Run(#[from] PerplexityError),
    #[error("layer {layer}: the normal equations are not positive definite (degenerate features)")]
    Singular { layer: usize },
}

/// The model's routers as the targets' source: per layer, `(n_expert × n_embd, bias)`.
type Routers<'a> = Vec<Option<(&'a [f32], Option<&'a [f32]>)>>;

/// Accumulates the normal equations and the held-out set while the model runs.
struct Collector<'a> {
    routers: Routers<'a>,
    d: usize,
    ne: usize,
    k: usize,
    la: usize,
    eps: f32,
    train: usize,
    total: usize,
    /// Rows seen before the current forward pass.
    seen: usize,
    /// Rows in the current forward pass.
    rows: usize,
    /// The current pass's training features per layer, transposed: `(d + 1) × m`.
    feat_t: Vec<Vec<f32>>,
    /// Per layer: `X̂ᵀX̂` (`(d+1)²`, row-major, upper triangle filled).
    ata: Vec<Vec<f64>>,
    /// Per source layer, per lookahead: `X̂ᵀY` (`(d+1) × ne`).
    aty: Vec<Vec<Vec<f64>>>,
    /// Held-out features per layer (`n × d`, normalised).
    val_x: Vec<Vec<f32>>,
    /// Held-out true top-k per routed layer (`n × k`).
    val_truth: Vec<Vec<u32>>,
}

impl Collector<'_> {
    fn train_rows(&self) -> usize {
        self.rows.min(self.train.saturating_sub(self.seen))
    }

    fn val_rows(&self) -> std::ops::Range<usize> {
        let a = self.train.saturating_sub(self.seen).min(self.rows);
        let b = self.total.saturating_sub(self.seen).min(self.rows);
        a..b.max(a)
    }
}

impl Observer for Collector<'_> {
    fn ffn_residual(&mut self, layer: usize, x: &[f32]) {
        let d = self.d;
        if layer == 0 {
            self.seen += self.rows;
            self.rows = x.len() / d;
        }
        let m = self.train_rows();
        // Training rows: transposed features, then X̂ᵀX̂ += (upper triangle).
        let mut ft = vec![0f32; (d + 1) * m];
        for (r, row) in x.chunks_exact(d).take(m).enumerate() {
            let s = rms_scale(row, self.eps);
            for (i, v) in row.iter().enumerate() {
                ft[i * m + r] = v * s;
            }
            ft[d * m + r] = 1.0;
        }
        if m > 0 {
            let ata = &mut self.ata[layer];
            let ftr = &ft;
            ata.par_chunks_mut(d + 1).enumerate().for_each(|(i, out)| {
                let a = &ftr[i * m..(i + 1) * m];
                for (j, o) in out.iter_mut().enumerate().skip(i) {
                    *o += ternfleet_kernels::dot_f32(a, &ftr[j * m..(j + 1) * m]) as f64;
                }
            });
        }
        self.feat_t[layer] = ft;
        // Held-out rows: normalised features.
        let val = self.val_rows();
        for row in x.chunks_exact(d).skip(val.start).take(val.len()) {
            let s = rms_scale(row, self.eps);
            self.val_x[layer].extend(row.iter().map(|v| v * s));
        }
    }

    fn ffn_input(&mut self, layer: usize, h: &[f32]) {
        let Some(Some((r, bias))) = self.routers.get(layer).copied() else {
            return;
        };
        let (d, ne) = (self.d, self.ne);
        let logits_of = |row: &[f32]| -> Vec<f32> {
            r.chunks_exact(d)
                .enumerate()
                .map(|(e, w)| ternfleet_kernels::dot_f32(w, row) + bias.map_or(0.0, |b| b[e]))
                .collect()
        };
        let m = self.train_rows();
        if m > 0 {
            // Targets, transposed: ne × m.
            let mut yt = vec![0f32; ne * m];
            for (t, row) in h.chunks_exact(d).take(m).enumerate() {
                for (e, v) in logits_of(row).into_iter().enumerate() {
                    yt[e * m + t] = v;
                }
            }
            for j in 1..=self.la {
                let Some(s) = layer.checked_sub(j) else {
                    break;
                };
                let ft = &self.feat_t[s];
                let out = &mut self.aty[s][j - 1];
                out.par_chunks_mut(ne).enumerate().for_each(|(i, o)| {
                    let a = &ft[i * m..(i + 1) * m];
                    for (e, o) in o.iter_mut().enumerate() {
                        *o += ternfleet_kernels::dot_f32(a, &yt[e * m..(e + 1) * m]) as f64;
                    }
                });
            }
        }
        let val = self.val_rows();
        for row in h.chunks_exact(d).skip(val.start).take(val.len()) {
            let logits = logits_of(row);
            self.val_truth[layer].extend(top_k(&logits, self.k));
        }
    }
}

/// Fits a [`LearnedPredictor`] for `model` on `text`; `progress(done, total)` per chunk.
pub fn fit(
    model: &Model,
    opts: SeqOptions,
    text: &str,
    fo: &FitOptions,
    mut progress: impl FnMut(usize, usize),
) -> Result<(LearnedPredictor, FitReport), FitError> {
    let cfg = &model.cfg;
    let Some(m) = &cfg.moe else {
        return Err(FitError::Dense(cfg.arch.name().to_string()));
    };
    if !(1..=16).contains(&fo.lookahead) {
        return Err(FitError::Lookahead(fo.lookahead));
    }
    let (d, ne, nl) = (cfg.n_embd, m.n_expert, cfg.n_layer);
    let la = fo.lookahead.min(nl.saturating_sub(1)).max(1);
    let k = opts.top_experts.unwrap_or(m.n_expert_used).clamp(1, ne);
    // The text is run in whole chunks: use at most what it has.
    let text_tokens = model
        .tokenizer
        .encode(text.strip_suffix('\n').unwrap_or(text), true, false)
        .len();
    let tokens = fo.tokens.min(text_tokens / fo.ctx.max(1) * fo.ctx);
    let holdout = ((tokens as f64 * fo.holdout).round() as usize).max(64);
    let train = tokens.saturating_sub(holdout);
    let routers: Routers = model
        .weights
        .layers
        .iter()
        .map(|l| l.router.as_ref().map(|r| r.weights()))
        .collect();
    let mut c = Collector {
        routers,
        d,
        ne,
        k,
        la,
        eps: cfg.rms_eps,
        train,
        total: tokens,
        seen: 0,
        rows: 0,
        feat_t: vec![Vec::new(); nl],
        ata: vec![vec![0f64; (d + 1) * (d + 1)]; nl],
        aty: vec![vec![vec![0f64; (d + 1) * ne]; la]; nl],
        val_x: vec![Vec::new(); nl],
        val_truth: vec![Vec::new(); nl],
    };
    let chunks = tokens.div_ceil(fo.ctx).max(1);
    perplexity_observed(
        model,
        opts,
        text,
        fo.ctx,
        fo.ctx,
        Some(chunks),
        |dn, t, _| progress(dn, t),
        &mut c,
        |_| {},
    )?;
    let seen = c.seen + c.rows;
    let (n_train, n_val) = (seen.min(train), seen.saturating_sub(train).min(holdout));
    if n_train < 64 || n_val < 64 {
        return Err(FitError::TooFew {
            train: n_train,
            holdout: n_val,
        });
    }
    // The last pass's features are not needed any more.
    c.feat_t.clear();
    let mut pred = LearnedPredictor::new(d, ne, nl, cfg.rms_eps, la);
    let solved: Vec<Result<Vec<PairFit>, FitError>> = (0..nl)
        .into_par_iter()
        .map(|s| solve_layer(&c, model, s, n_train, n_val))
        .collect();
    let (mut rh, mut lh, mut tot) = (vec![0usize; la], vec![0usize; la], vec![0usize; la]);
    let (mut pairs, mut pairs_router) = (0, 0);
    for (s, per) in solved.into_iter().enumerate() {
        for (j, p) in per?.into_iter().enumerate() {
            if let Some(map) = p.map {
                pred.set(s, j + 1, map);
                pairs += 1;
                pairs_router += p.kept_router as usize;
            }
            rh[j] += p.router_hits;
            lh[j] += p.learned_hits;
            tot[j] += p.total;
        }
    }
    // One entry per lookahead asked for (`None` beyond the model's depth).
    let ratio = |h: &[usize]| -> Vec<Option<f64>> {
        (0..fo.lookahead)
            .map(|j| match (h.get(j), tot.get(j)) {
                (Some(&h), Some(&t)) if t > 0 => Some(h as f64 / t as f64),
                _ => None,
            })
            .collect()
    };
    let report = FitReport {
        train_tokens: n_train,
        holdout_tokens: n_val,
        k,
        router_recall: ratio(&rh),
        learned_recall: ratio(&lh),
        pairs_router,
        pairs,
    };
    Ok((pred, report))
}

/// One (source, lookahead) pair's fit and its held-out recall.
#[derive(Default)]
struct PairFit {
    /// `None`: no such pair (no router at the target, or beyond the last layer).
    map: Option<Vec<f32>>,
    /// Held-out top-k hits of the router predictor and of the chosen map, of `total`.
    router_hits: usize,
    learned_hits: usize,
    total: usize,
    /// No ridge strength beat the router predictor: the map is the router predictor's.
    kept_router: bool,
}

/// Solves every lookahead from source layer `s` (one [`PairFit`] per lookahead): for each,
/// the map with the best held-out recall among the ridge strengths and the router predictor.
fn solve_layer(
    c: &Collector<'_>,
    model: &Model,
    s: usize,
    n_train: usize,
    n_val: usize,
) -> Result<Vec<PairFit>, FitError> {
    let (d, ne, k) = (c.d, c.ne, c.k);
    let dp = d + 1;
    let nl = c.routers.len();
    // The targets from this layer and their priors (the router predictor as a map).
    let targets: Vec<(usize, Vec<f64>)> = (1..=c.la)
        .filter_map(|j| {
            let t = s + j;
            let (r, bias) = (*c.routers.get(t)?)?;
            let g = &model.weights.layers[t].ffn_norm;
            // W₀ as (d+1) × ne (row i: feature i's weight into every expert).
            let mut w0 = vec![0f64; dp * ne];
            for e in 0..ne {
                for i in 0..d {
                    w0[i * ne + e] = r[e * d + i] as f64 * g[i] as f64;
                }
                w0[d * ne + e] = bias.map_or(0.0, |b| b[e] as f64);
            }
            Some((j, w0))
        })
        .collect();
    let mut out: Vec<PairFit> = (0..c.la).map(|_| PairFit::default()).collect();
    if targets.is_empty() || s + 1 >= nl {
        return Ok(out);
    }
    // (d+1) × ne f64 → ne rows of d + 1, f32: the stored form.
    let to_map = |w: &[f64]| -> Vec<f32> {
        let mut map = vec![0f32; ne * dp];
        for i in 0..dp {
            for e in 0..ne {
                map[e * dp + i] = w[i * ne + e] as f32;
            }
        }
        map
    };
    let recall = |map: &[f32], t: usize| -> (usize, usize) {
        let xs = &c.val_x[s];
        let truth = &c.val_truth[t];
        let n = (xs.len() / d).min(truth.len() / k).min(n_val);
        let mut logits = vec![0f32; ne];
        let mut hit = 0;
        for r in 0..n {
            // Held-out rows are stored normalised already.
            map_logits(map, &xs[r * d..(r + 1) * d], 1.0, &mut logits);
            let want = &truth[r * k..(r + 1) * k];
            hit += top_k(&logits, k).filter(|e| want.contains(e)).count();
        }
        (hit, n * k)
    };
    // Start from the router predictor.
    let mut best: Vec<(usize, Vec<f32>, bool)> = Vec::new();
    for (j, w0) in &targets {
        let map = to_map(w0);
        let (h, total) = recall(&map, s + j);
        out[j - 1].router_hits = h;
        out[j - 1].total = total;
        best.push((h, map, true));
    }
    let cols = targets.len() * ne;
    for &alpha in ALPHAS.iter().rev() {
        let lambda = alpha * n_train as f64;
        // M = X̂ᵀX̂ + λI (mirror the upper triangle).
        let mut mat = vec![0f64; dp * dp];
        for i in 0..dp {
            for j in i..dp {
                let v = c.ata[s][i * dp + j];
                mat[i * dp + j] = v;
                mat[j * dp + i] = v;
            }
            mat[i * dp + i] += lambda;
        }
        // RHS = X̂ᵀY + λW₀, all lookaheads side by side.
        let mut rhs = vec![0f64; dp * cols];
        for (ti, (j, w0)) in targets.iter().enumerate() {
            let aty = &c.aty[s][j - 1];
            for i in 0..dp {
                for e in 0..ne {
                    rhs[i * cols + ti * ne + e] = aty[i * ne + e] + lambda * w0[i * ne + e];
                }
            }
        }
        let l = cholesky(&mat, dp).ok_or(FitError::Singular { layer: s })?;
        cholesky_solve(&l, dp, &mut rhs, cols);
        for (ti, (j, _)) in targets.iter().enumerate() {
            let w: Vec<f64> = (0..dp)
                .flat_map(|i| {
                    rhs[i * cols + ti * ne..i * cols + (ti + 1) * ne]
                        .iter()
                        .copied()
                })
                .collect();
            let map = to_map(&w);
            let (h, _) = recall(&map, s + j);
            // Strictly better only: ties keep the stronger pull toward the router.
            if h > best[ti].0 {
                best[ti] = (h, map, false);
            }
        }
    }
    for ((j, _), (h, map, router)) in targets.iter().zip(best) {
        out[j - 1].map = Some(map);
        out[j - 1].learned_hits = h;
        out[j - 1].kept_router = router;
    }
    Ok(out)
}

/// `Σ a[i]·b[i]` in f64 (eight partial sums, so it vectorises).
fn dot64(a: &[f64], b: &[f64]) -> f64 {
    let mut acc = [0f64; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f64 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f64>() + tail
}

/// The lower Cholesky factor of the symmetric `n × n` matrix `a` (row-major), or `None`
/// if it is not positive definite.
fn cholesky(a: &[f64], n: usize) -> Option<Vec<f64>> {
    let mut l = vec![0f64; n * n];
    for i in 0..n {
        for j in 0..=i {
            let (li, lj) = (i * n, j * n);
            let s = a[li + j] - dot64(&l[li..li + j], &l[lj..lj + j]);
            if i == j {
                if s <= 0.0 || !s.is_finite() {
                    return None;
                }
                l[li + i] = s.sqrt();
            } else {
                l[li + j] = s / l[lj + j];
            }
        }
    }
    Some(l)
}

/// Solves `L Lᵀ X = B` in place for `B` (`n × cols`, row-major).
fn cholesky_solve(l: &[f64], n: usize, b: &mut [f64], cols: usize) {
    // L Y = B.
    for i in 0..n {
        let (done, rest) = b.split_at_mut(i * cols);
        let row = &mut rest[..cols];
        for (j, prev) in done.chunks_exact(cols).enumerate() {
            let f = l[i * n + j];
            if f != 0.0 {
                row.iter_mut().zip(prev).for_each(|(r, p)| *r -= f * p);
            }
        }
        let inv = 1.0 / l[i * n + i];
        row.iter_mut().for_each(|r| *r *= inv);
    }
    // Lᵀ X = Y.
    for i in (0..n).rev() {
        let (head, tail) = b.split_at_mut((i + 1) * cols);
        let row = &mut head[i * cols..];
        for (jj, later) in tail.chunks_exact(cols).enumerate() {
            let f = l[(i + 1 + jj) * n + i];
            if f != 0.0 {
                row.iter_mut().zip(later).for_each(|(r, p)| *r -= f * p);
            }
        }
        let inv = 1.0 / l[i * n + i];
        row.iter_mut().for_each(|r| *r *= inv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cholesky_solves_a_known_system() {
        // A = M Mᵀ + I for a fixed M: symmetric positive definite.
        let n = 7;
        let m: Vec<f64> = (0..n * n)
            .map(|i| ((i * 37 % 11) as f64 - 5.0) / 3.0)
            .collect();
        let mut a = vec![0f64; n * n];
        for i in 0..n {
            for j in 0..n {
                a[i * n + j] = (0..n).map(|k| m[i * n + k] * m[j * n + k]).sum::<f64>()
                    + if i == j { 1.0 } else { 0.0 };
            }
        }
        let x: Vec<f64> = (0..n * 2).map(|i| i as f64 - 3.5).collect();
        // B = A X (2 columns).
        let mut b = vec![0f64; n * 2];
        for i in 0..n {
            for c in 0..2 {
                b[i * 2 + c] = (0..n).map(|k| a[i * n + k] * x[k * 2 + c]).sum();
            }
        }
        let l = cholesky(&a, n).expect("positive definite");
        cholesky_solve(&l, n, &mut b, 2);
        for (got, want) in b.iter().zip(&x) {
            assert!((got - want).abs() < 1e-9, "{got} vs {want}");
        }
        // Not positive definite: refused.
        let mut bad = a.clone();
        bad[0] = -1.0;
        assert!(cholesky(&bad, n).is_none());
    }

    #[test]
    fn top_k_breaks_ties_toward_the_lower_index() {
        let v = [0.5, 2.0, 2.0, -1.0];
        assert_eq!(top_k(&v, 3).collect::<Vec<_>>(), vec![1, 2, 0]);
    }
}
