//! MoEfication: a dense model's FFNs split into experts (after Zhang et al., "MoEfication:
//! Transformer Feed-forward Layers are Mixtures of Experts", 2022).
//!
//! For each layer, on a calibration text:
//! 1. the FFN activations `h = act(gate·x) ⊙ (up·x)` of every calibration token are recorded;
//! 2. the `n_ff` neurons are clustered into E equal-sized experts by co-activation: each
//!    neuron is the unit vector of its `|h|` over the calibration tokens, and a balanced
//!    k-means (cosine similarity; each step assigns the most similar (neuron, expert) pairs
//!    first while experts have room) groups neurons that fire on the same tokens;
//! 3. a linear router (with bias) is fitted by ridge regression from the FFN input `x` to
//!    each expert's share of the token's FFN output, estimated as
//!    `Σ_{j ∈ expert} |h_j| · ‖down[:, j]‖` over the sum across experts.
//!
//! At run time a token uses the k experts with the highest router scores, each with weight 1
//! ([`Gating::TopKUnit`](ternfleet_shared::bundle::Gating)): with k = E every neuron is used
//! and the layer computes the dense FFN.

use std::path::Path;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::{dequantize, io, ConvertError, Progress};
use crate::model::{Logits, Model, Observer};
use crate::sampler::Rng;

/// One layer's experts and router.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LayerPlan {
    /// Neuron indices of each expert, ascending.
    pub experts: Vec<Vec<u32>>,
    /// `n_expert × n_embd` router weights.
    pub router_w: Vec<f32>,
    /// Per-expert router bias.
    pub router_b: Vec<f32>,
    /// How well this layer's split works on held-out calibration tokens.
    #[serde(default)]
    pub validation: Vec<Validation>,
}

/// Held-out check of one layer at one top-k: the FFN output error when the router picks the
/// experts, and when an oracle picks the k experts with the largest outputs (the best this
/// clustering allows), relative to the dense FFN output (`‖y − y_k‖ / ‖y‖`, mean over tokens).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Validation {
    pub k: usize,
    pub router_error: f64,
    pub oracle_error: f64,
    /// Mean fraction of the oracle's experts the router also picks.
    pub recall: f64,
    pub tokens: usize,
}

/// The MoEfication of a whole model.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Plan {
    /// The conversion this plan belongs to (see `convert`'s journal).
    pub fingerprint: String,
    /// Calibration tokens used.
    pub tokens: usize,
    pub layers: Vec<LayerPlan>,
}

const PLAN_FILE: &str = ".moefy-plan.json";

/// The plan saved by an earlier run of the same conversion, or `make()`'s, saved for the next.
pub fn plan_cached(
    dir: &Path,
    fingerprint: &str,
    make: impl FnOnce() -> Result<Plan, ConvertError>,
) -> Result<Plan, ConvertError> {
    let path = dir.join(PLAN_FILE);
    if let Some(p) = std::fs::read(&path)
        .ok()
        .and_then(|b| serde_json::from_slice::<Plan>(&b).ok())
        .filter(|p| p.fingerprint == fingerprint)
    {
        tracing::info!("reusing the MoEfication plan in {}", path.display());
        return Ok(p);
    }
    let mut plan = make()?;
    plan.fingerprint = fingerprint.to_owned();
    let tmp = dir.join(format!("{PLAN_FILE}.tmp"));
    let text = serde_json::to_vec(&plan).map_err(|e| ConvertError::Options(e.to_string()))?;
    std::fs::write(&tmp, text).map_err(io(&tmp))?;
    std::fs::rename(&tmp, &path).map_err(io(&path))?;
    Ok(plan)
}

/// Records every layer's FFN input.
struct Capture {
    x: Vec<Vec<f32>>,
}

impl Observer for Capture {
    fn ffn_input(&mut self, layer: usize, x: &[f32]) {
        self.x[layer].extend_from_slice(x);
    }
}

/// How neurons are grouped into experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Grouping {
    /// Balanced k-means on co-activation (the MoEfication method).
    #[default]
    Coactivation,
    /// Neurons `e·n/E .. (e+1)·n/E` form expert `e`. When `n/E` is a multiple of the
    /// quantized `ffn_down`'s block width, each expert keeps the source's exact bytes and runs
    /// on the same activation blocks as the dense model, so all experts together reproduce it
    /// to the last rounding of the sum; routing quality then rests on the router alone.
    Contiguous,
}

impl Grouping {
    /// Parses `--grouping`.
    pub fn parse(s: &str) -> Result<Grouping, ConvertError> {
        match s {
            "coactivation" => Ok(Grouping::Coactivation),
            "contiguous" => Ok(Grouping::Contiguous),
            _ => Err(ConvertError::Options(format!(
                "--grouping {s:?}: expected coactivation or contiguous"
            ))),
        }
    }
}

/// Calibration chunk length: prompts of this many tokens, each from an empty cache.
const CALIB_CTX: usize = 512;
/// Balanced k-means iterations.
const KMEANS_ITERS: usize = 12;
/// Ridge strength, relative to the mean diagonal of XᵀX.
const RIDGE: f64 = 1e-3;
/// Share of the calibration tokens held out to validate clustering and router.
const HOLDOUT: f64 = 0.2;

/// Clusters every FFN of `model` into `n_expert` experts and fits their routers on `text`.
pub fn calibrate(
    model: &Model,
    text: &str,
    n_expert: usize,
    max_tokens: usize,
    seed: u64,
    grouping: Grouping,
    progress: Progress<'_>,
) -> Result<Plan, ConvertError> {
    let cfg = &model.cfg;
    let (d, ff) = (cfg.n_embd, cfg.n_ff);
    if n_expert < 2 || !ff.is_multiple_of(n_expert) {
        return Err(ConvertError::Options(format!(
            "--experts {n_expert}: the FFN width {ff} must split into at least 2 equal experts"
        )));
    }
    let mut tokens = model.tokenizer.encode(text, false, false);
    tokens.truncate(max_tokens);
    if tokens.len() < 4 * n_expert {
        return Err(ConvertError::Options(format!(
            "the calibration text gives {} tokens; MoEfication into {n_expert} experts needs \
             at least {}",
            tokens.len(),
            4 * n_expert
        )));
    }
    // 1. Record the FFN inputs over the calibration text, in chunks with BOS first.
    let mut cap = Capture {
        x: vec![Vec::new(); cfg.n_layer],
    };
    let mut cache = model.new_cache(CALIB_CTX + 1);
    let chunks: Vec<&[u32]> = tokens.chunks(CALIB_CTX).collect();
    for (i, c) in chunks.iter().enumerate() {
        cache.clear();
        let mut chunk = Vec::with_capacity(c.len() + 1);
        if let (true, Some(b)) = (model.tokenizer.add_bos(), model.tokenizer.bos()) {
            chunk.push(b);
        }
        chunk.extend_from_slice(c);
        model.forward_observed(&mut cache, &chunk, Logits::Last, &mut cap)?;
        progress("calibration forward", (i + 1) as u64, chunks.len() as u64);
    }
    let (_, ffns) = crate::model::weights::load(model.file(), cfg, true)?;
    let mut layers = Vec::with_capacity(cfg.n_layer);
    for (l, x) in cap.x.iter().enumerate() {
        let w = ffns[l]
            .first()
            .ok_or_else(|| ConvertError::Options(format!("layer {l} has no FFN")))?;
        let t_all = x.len() / d;
        // The last HOLDOUT of the tokens only validates.
        let t = t_all - ((t_all as f64 * HOLDOUT) as usize).min(t_all / 2);
        // 2. Activations.
        let mut act = ternfleet_kernels::Activations::new();
        let mut g = vec![0f32; t_all * ff];
        let mut u = vec![0f32; t_all * ff];
        ternfleet_shared::compute::quantize_par(&mut act, w.gate.ty(), x, t_all, d)?;
        w.gate
            .forward(&act, &mut g, ternfleet_kernels::Numerics::Parity)
            .map_err(forward_err)?;
        ternfleet_shared::compute::quantize_par(&mut act, w.up.ty(), x, t_all, d)?;
        w.up.forward(&act, &mut u, ternfleet_kernels::Numerics::Parity)
            .map_err(forward_err)?;
        ternfleet_node::expert::apply_activation(w.act, &mut g, &u);
        let (h, h_val) = g.split_at(t * ff);
        let x_val = &x[t * d..];
        let x = &x[..t * d];
        // 3. Co-activation clustering.
        let experts = match grouping {
            Grouping::Coactivation => cluster(h, t, ff, n_expert, seed ^ l as u64),
            Grouping::Contiguous => {
                let k = ff / n_expert;
                (0..n_expert)
                    .map(|e| (e * k) as u32..((e + 1) * k) as u32)
                    .map(Iterator::collect)
                    .collect()
            }
        };
        // 4. Router.
        let down = dequantize(w.down.ty(), w.down.data(), ff)?;
        let mut colnorm = vec![0f64; ff];
        for row in down.chunks_exact(ff) {
            for (c, v) in colnorm.iter_mut().zip(row) {
                *c += (*v as f64) * (*v as f64);
            }
        }
        let colnorm: Vec<f32> = colnorm.iter().map(|c| c.sqrt() as f32).collect();
        let mut target = vec![0f32; t * n_expert];
        target
            .par_chunks_mut(n_expert)
            .zip(h.par_chunks(ff))
            .for_each(|(y, hr)| {
                for (e, ids) in experts.iter().enumerate() {
                    y[e] = ids
                        .iter()
                        .map(|&j| hr[j as usize].abs() * colnorm[j as usize])
                        .sum();
                }
                let s: f32 = y.iter().sum();
                if s > 0.0 {
                    y.iter_mut().for_each(|v| *v /= s);
                } else {
                    y.fill(1.0 / n_expert as f32);
                }
            });
        let (router_w, router_b) = ridge(x, t, d, &target, n_expert)?;
        let validation = validate(&experts, &router_w, &router_b, x_val, h_val, &down, d, ff);
        for v in &validation {
            tracing::info!(
                "layer {l} k={}: FFN output error {:.3} with the router, {:.3} with oracle \
                 experts; router recall {:.2} ({} held-out tokens)",
                v.k,
                v.router_error,
                v.oracle_error,
                v.recall,
                v.tokens
            );
        }
        layers.push(LayerPlan {
            experts,
            router_w,
            router_b,
            validation,
        });
        progress("clustering", (l + 1) as u64, cfg.n_layer as u64);
    }
    Ok(Plan {
        fingerprint: String::new(),
        tokens: tokens.len(),
        layers,
    })
}

fn forward_err(e: ternfleet_shared::compute::ComputeError) -> ConvertError {
    ConvertError::Forward(crate::model::ForwardError::Compute(e))
}

/// Held-out validation of one layer (see [`Validation`]) at k = E/2 and E/4.
#[allow(clippy::too_many_arguments)]
fn validate(
    experts: &[Vec<u32>],
    router_w: &[f32],
    router_b: &[f32],
    x: &[f32],
    h: &[f32],
    down: &[f32],
    d: usize,
    ff: usize,
) -> Vec<Validation> {
    let ne = experts.len();
    let t = x.len() / d;
    if t == 0 {
        return Vec::new();
    }
    let ks: Vec<usize> = [ne / 2, ne / 4].into_iter().filter(|&k| k >= 1).collect();
    // Per token: each expert's output y_e = down[:, e] · h_e, the router's scores.
    let per_token: Vec<Vec<(f64, f64, f64, usize)>> = (0..t)
        .into_par_iter()
        .map(|ti| {
            let hr = &h[ti * ff..(ti + 1) * ff];
            let xr = &x[ti * d..(ti + 1) * d];
            let ys: Vec<Vec<f64>> = experts
                .iter()
                .map(|ids| {
                    let mut y = vec![0f64; d];
                    for &j in ids {
                        let hj = hr[j as usize] as f64;
                        if hj == 0.0 {
                            continue;
                        }
                        for (r, yr) in y.iter_mut().enumerate() {
                            *yr += down[r * ff + j as usize] as f64 * hj;
                        }
                    }
                    y
                })
                .collect();
            let mut total = vec![0f64; d];
            for y in &ys {
                total.iter_mut().zip(y).for_each(|(a, b)| *a += b);
            }
            let norm = total.iter().map(|v| v * v).sum::<f64>().sqrt().max(1e-30);
            let score: Vec<f32> = (0..ne)
                .map(|e| {
                    let w = &router_w[e * d..(e + 1) * d];
                    w.iter().zip(xr).map(|(a, b)| a * b).sum::<f32>() + router_b[e]
                })
                .collect();
            let out_norm: Vec<f64> = ys
                .iter()
                .map(|y| y.iter().map(|v| v * v).sum::<f64>())
                .collect();
            let top = |key: &dyn Fn(usize) -> f64, k: usize| -> Vec<usize> {
                let mut idx: Vec<usize> = (0..ne).collect();
                idx.sort_by(|&a, &b| key(b).total_cmp(&key(a)));
                idx.truncate(k);
                idx
            };
            let err = |set: &[usize]| -> f64 {
                let mut r = total.clone();
                for &e in set {
                    r.iter_mut().zip(&ys[e]).for_each(|(a, b)| *a -= b);
                }
                r.iter().map(|v| v * v).sum::<f64>().sqrt() / norm
            };
            ks.iter()
                .map(|&k| {
                    let rs = top(&|e| score[e] as f64, k);
                    let os = top(&|e| out_norm[e], k);
                    let common = rs.iter().filter(|e| os.contains(e)).count();
                    (err(&rs), err(&os), common as f64 / k as f64, k)
                })
                .collect()
        })
        .collect();
    ks.iter()
        .enumerate()
        .map(|(i, &k)| {
            let n = t as f64;
            Validation {
                k,
                router_error: per_token.iter().map(|p| p[i].0).sum::<f64>() / n,
                oracle_error: per_token.iter().map(|p| p[i].1).sum::<f64>() / n,
                recall: per_token.iter().map(|p| p[i].2).sum::<f64>() / n,
                tokens: t,
            }
        })
        .collect()
}

fn normalize(v: &mut [f32]) {
    let n = v
        .iter()
        .map(|x| (*x as f64) * (*x as f64))
        .sum::<f64>()
        .sqrt();
    if n > 0.0 {
        let inv = (1.0 / n) as f32;
        v.iter_mut().for_each(|x| *x *= inv);
    }
}

/// Balanced k-means of the `n` neurons of `h` (`t × n`, token-major) into `k` groups of
/// `n / k` by cosine similarity of their `|h|` profiles. Returns each group's neurons,
/// ascending.
pub fn cluster(h: &[f32], t: usize, n: usize, k: usize, seed: u64) -> Vec<Vec<u32>> {
    // Neuron-major unit profiles.
    let mut f = vec![0f32; n * t];
    for (ti, row) in h.chunks_exact(n).enumerate() {
        for (j, v) in row.iter().enumerate() {
            f[j * t + ti] = v.abs();
        }
    }
    f.par_chunks_mut(t).for_each(normalize);
    // Initial centroids: k distinct neurons.
    let mut rng = Rng(seed);
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    let mut cent: Vec<f32> = order[..k]
        .iter()
        .flat_map(|&j| f[j * t..(j + 1) * t].to_vec())
        .collect();
    let cap = n / k;
    let mut assign = vec![0usize; n];
    for _ in 0..KMEANS_ITERS {
        let sims: Vec<f32> = f
            .par_chunks(t)
            .flat_map_iter(|fj| {
                cent.chunks_exact(t)
                    .map(|c| fj.iter().zip(c).map(|(a, b)| a * b).sum::<f32>())
                    .collect::<Vec<_>>()
            })
            .collect();
        assign = balanced_assign(&sims, n, k, cap);
        let mut next = vec![0f32; k * t];
        for (j, &c) in assign.iter().enumerate() {
            next[c * t..(c + 1) * t]
                .iter_mut()
                .zip(&f[j * t..(j + 1) * t])
                .for_each(|(a, b)| *a += b);
        }
        next.par_chunks_mut(t).for_each(normalize);
        cent = next;
    }
    let mut groups = vec![Vec::with_capacity(cap); k];
    for (j, &c) in assign.iter().enumerate() {
        groups[c].push(j as u32);
    }
    groups
}

/// Assigns each of `n` items to one of `k` groups of exactly `cap` (`n = k·cap`), taking
/// (item, group) pairs in order of decreasing similarity (`sims` is `n × k`).
pub fn balanced_assign(sims: &[f32], n: usize, k: usize, cap: usize) -> Vec<usize> {
    let mut pairs: Vec<(f32, u32, u32)> = (0..n)
        .flat_map(|j| (0..k).map(move |c| (sims[j * k + c], j as u32, c as u32)))
        .collect();
    pairs.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let mut assign = vec![usize::MAX; n];
    let mut room = vec![cap; k];
    let mut left = n;
    for (_, j, c) in pairs {
        let (j, c) = (j as usize, c as usize);
        if assign[j] == usize::MAX && room[c] > 0 {
            assign[j] = c;
            room[c] -= 1;
            left -= 1;
            if left == 0 {
                break;
            }
        }
    }
    assign
}

/// Ridge regression `y ≈ W x + b` over `t` rows (`x`: `t × d`, `y`: `t × k`). Returns `W`
/// (`k × d`) and `b`.
fn ridge(
    x: &[f32],
    t: usize,
    d: usize,
    y: &[f32],
    k: usize,
) -> Result<(Vec<f32>, Vec<f32>), ConvertError> {
    let m = d + 1;
    // A = X̃ᵀX̃ and B = X̃ᵀY with X̃ = [x, 1], rows of A in parallel.
    let mut a = vec![0f64; m * m];
    a.par_chunks_mut(m).enumerate().for_each(|(i, arow)| {
        for r in 0..t {
            let xi = if i < d { x[r * d + i] as f64 } else { 1.0 };
            if xi == 0.0 {
                continue;
            }
            let xr = &x[r * d..(r + 1) * d];
            for (aj, &xj) in arow[..d].iter_mut().zip(xr) {
                *aj += xi * xj as f64;
            }
            arow[d] += xi;
        }
    });
    let mut b = vec![0f64; m * k];
    b.par_chunks_mut(k).enumerate().for_each(|(i, brow)| {
        for r in 0..t {
            let xi = if i < d { x[r * d + i] as f64 } else { 1.0 };
            for (bj, &yj) in brow.iter_mut().zip(&y[r * k..(r + 1) * k]) {
                *bj += xi * yj as f64;
            }
        }
    });
    let mean_diag = (0..d).map(|i| a[i * m + i]).sum::<f64>() / d as f64;
    for i in 0..d {
        a[i * m + i] += RIDGE * mean_diag.max(1e-12);
    }
    a[d * m + d] += 1e-9;
    let sol = cholesky_solve(&mut a, m, &b, k).ok_or_else(|| {
        ConvertError::Options("router fit: the calibration activations are degenerate".into())
    })?;
    let mut w = vec![0f32; k * d];
    let mut bias = vec![0f32; k];
    for e in 0..k {
        for i in 0..d {
            w[e * d + i] = sol[i * k + e] as f32;
        }
        bias[e] = sol[d * k + e] as f32;
    }
    Ok((w, bias))
}

/// Solves `A X = B` for symmetric positive definite `A` (`m × m`, overwritten by its Cholesky
/// factor) and `B` (`m × k`). `None` when `A` is not positive definite.
fn cholesky_solve(a: &mut [f64], m: usize, b: &[f64], k: usize) -> Option<Vec<f64>> {
    for j in 0..m {
        let mut s = a[j * m + j];
        for p in 0..j {
            s -= a[j * m + p] * a[j * m + p];
        }
        if s <= 0.0 || !s.is_finite() {
            return None;
        }
        let ljj = s.sqrt();
        a[j * m + j] = ljj;
        for i in j + 1..m {
            let mut s = a[i * m + j];
            for p in 0..j {
                s -= a[i * m + p] * a[j * m + p];
            }
            a[i * m + j] = s / ljj;
        }
    }
    let mut x = b.to_vec();
    for c in 0..k {
        // L z = b
        for i in 0..m {
            let mut s = x[i * k + c];
            for p in 0..i {
                s -= a[i * m + p] * x[p * k + c];
            }
            x[i * k + c] = s / a[i * m + i];
        }
        // Lᵀ x = z
        for i in (0..m).rev() {
            let mut s = x[i * k + c];
            for p in i + 1..m {
                s -= a[p * m + i] * x[p * k + c];
            }
            x[i * k + c] = s / a[i * m + i];
        }
    }
    Some(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_assign_fills_every_group_exactly() {
        // 6 items, 3 groups of 2; everyone prefers group 0.
        let sims = [
            0.9, 0.1, 0.0, 0.8, 0.2, 0.0, 0.7, 0.0, 0.3, 0.6, 0.5, 0.0, 0.5, 0.4, 0.1, 0.4, 0.0,
            0.3,
        ];
        let a = balanced_assign(&sims, 6, 3, 2);
        for g in 0..3 {
            assert_eq!(a.iter().filter(|&&c| c == g).count(), 2);
        }
        assert_eq!(&a[..2], &[0, 0]);
    }

    #[test]
    fn cluster_separates_neurons_that_fire_on_different_tokens() {
        // 8 neurons over 40 tokens: neurons 0-3 fire on even tokens, 4-7 on odd ones.
        let (t, n) = (40, 8);
        let mut h = vec![0f32; t * n];
        for ti in 0..t {
            for j in 0..n {
                let on = (j < 4) == (ti % 2 == 0);
                h[ti * n + j] = if on {
                    1.0 + (j * ti % 5) as f32 * 0.1
                } else {
                    0.01
                };
            }
        }
        let mut g = cluster(&h, t, n, 2, 7);
        g.sort();
        assert_eq!(g, vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
    }

    #[test]
    fn ridge_recovers_a_linear_map() {
        let (t, d, k) = (200, 3, 2);
        let mut rng = Rng(1);
        let x: Vec<f32> = (0..t * d)
            .map(|_| (rng.next_u64() % 2000) as f32 / 1000.0 - 1.0)
            .collect();
        let y: Vec<f32> = x
            .chunks(d)
            .flat_map(|r| [2.0 * r[0] - r[2] + 0.5, r[1] - 0.25])
            .collect();
        let (w, b) = ridge(&x, t, d, &y, k).unwrap();
        let want_w = [2.0, 0.0, -1.0, 0.0, 1.0, 0.0];
        for (g, w) in w.iter().zip(want_w) {
            assert!((g - w).abs() < 0.01, "{g} vs {w}");
        }
        assert!(
            (b[0] - 0.5).abs() < 0.01 && (b[1] + 0.25).abs() < 0.01,
            "{b:?}"
        );
    }
}
