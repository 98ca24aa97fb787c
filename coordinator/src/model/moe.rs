//! Expert routing: which experts each token of an MoE layer uses, and with what weight.
//!
//! The coordinator routes; the expert backend runs the chosen experts and sums their outputs in
//! the order of the routes made here. Everything follows llama.cpp's `build_moe_ffn`
//! (src/llama-graph.cpp) and the float order of its CPU kernels (docs/llama-cpp-moe-ternary-notes.md §1), so
//! that a model routes every token exactly as the reference engine does:
//!
//! 1. router logits `ffn_gate_inp · x` in f32, summed like ggml's `mul_mat` for an f32 matrix
//!    (see [`router_dot_order`]);
//! 2. softmax over all experts (`ggml_soft_max`: ggml's vector `expf` for 16-lane chunks, libm
//!    `expf` for the rest, the sum in f64, then `e · (float)(1/sum)`);
//! 3. the `k` most probable experts, most probable first (ties: lower index first);
//! 4. weights = their probabilities, divided by their f64 sum (clamped at 2^-14) when the
//!    architecture renormalises (qwen3moe, Mixtral) and left alone otherwise (qwen2moe);
//! 5. qwen2moe's shared expert joins every token last, weighted `silu(g)/g` (a sigmoid, computed
//!    the way llama.cpp does) with `g = ffn_gate_inp_shexp · x`.

use ternfleet_kernels::Numerics;
use ternfleet_shared::expert::Route;

use super::config::{Gating, MoeConfig};

/// How ggml sums an f32 `mul_mat` row: `ggml_vec_dot_f32` for one token, llamafile's tinyBLAS
/// for two or more when the shapes allow it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DotOrder {
    /// `ggml_vec_dot_f32` (AVX-512): four 16-lane FMA accumulators over 64-element steps.
    VecDot,
    /// `tinyBLAS<16, __m512>`: one 16-lane FMA accumulator over 16-element steps, then
    /// `_mm512_reduce_add_ps`.
    TinyBlas,
}

/// ggml-cpu `ggml_compute_forward_mul_mat` with f32 weights and activations: llamafile_sgemm
/// takes batches of at least 2 rows when `k % 16 == 0` and the weight has a multiple of 4 rows
/// (`tinyBLAS::matmul`); everything else goes to `ggml_vec_dot_f32`.
pub fn router_dot_order(n_tokens: usize, k: usize, m: usize) -> DotOrder {
    if n_tokens >= 2 && k.is_multiple_of(16) && m.is_multiple_of(4) {
        DotOrder::TinyBlas
    } else {
        DotOrder::VecDot
    }
}

/// `Σ a[i]·b[i]` in the order `order` selects.
pub fn dot(order: DotOrder, a: &[f32], b: &[f32]) -> f32 {
    match order {
        DotOrder::VecDot => ternfleet_kernels::dot_f32(a, b),
        DotOrder::TinyBlas => ternfleet_kernels::dot_f32_tinyblas(a, b),
    }
}

/// `ggml_clamp`'s lower bound on the sum of the chosen probabilities: 2^-14 (6.1035e-5).
const WEIGHT_SUM_MIN: f32 = 1.0 / 16384.0;

/// One MoE layer's router.
#[derive(Clone, Debug)]
pub struct Router {
    n_embd: usize,
    n_expert: usize,
    /// `n_expert × n_embd`, f32.
    gate_inp: Vec<f32>,
    /// MoEfied layers: a bias per expert added to the score.
    bias: Option<Vec<f32>>,
    /// qwen2moe: the shared expert's gate vector (`n_embd`).
    shexp_gate: Option<Vec<f32>>,
}

impl Router {
    /// A router over `gate_inp` (`n_expert × n_embd`; the loader checked the shapes).
    pub fn new(
        n_embd: usize,
        gate_inp: Vec<f32>,
        bias: Option<Vec<f32>>,
        shexp_gate: Option<Vec<f32>>,
    ) -> Router {
        Router {
            n_embd,
            n_expert: gate_inp.len() / n_embd.max(1),
            gate_inp,
            bias,
            shexp_gate,
        }
    }

    /// The routed expert count.
    pub fn n_expert(&self) -> usize {
        self.n_expert
    }

    /// The router matrix (`n_expert × n_embd`) and bias.
    pub fn weights(&self) -> (&[f32], Option<&[f32]>) {
        (&self.gate_inp, self.bias.as_deref())
    }

    /// Routes `n` rows of `h` (`n × n_embd`, the normalised FFN input): per token its
    /// `cfg.n_expert_used` experts, best first, then the shared expert (index `n_expert`) if
    /// the layer has one. Also returns each token's scores (`n × n_expert`: probabilities for
    /// softmax gating, the linear scores for [`Gating::TopKUnit`]) for statistics.
    pub fn route(&self, cfg: &MoeConfig, h: &[f32], n: usize) -> (Vec<Route>, Vec<f32>) {
        self.route_rows(cfg, h, n, &[], Numerics::Parity)
    }

    /// [`Router::route`] with each row's own expert count (`ks[t]`, clamped to 1..=n_expert;
    /// empty: the model's) and float order: parity follows ggml's batch-size-dependent choice
    /// of dot ([`router_dot_order`]), invariant always the single-token `vec_dot` order.
    pub fn route_rows(
        &self,
        cfg: &MoeConfig,
        h: &[f32],
        n: usize,
        ks: &[usize],
        numerics: Numerics,
    ) -> (Vec<Route>, Vec<f32>) {
        let (d, ne) = (self.n_embd, self.n_expert);
        let k_of = |t: usize| {
            ks.get(t)
                .copied()
                .unwrap_or(cfg.n_expert_used)
                .clamp(1, ne.max(1))
                .min(ne)
        };
        let rows = if numerics == Numerics::Invariant {
            1
        } else {
            n
        };
        let order = router_dot_order(rows, d, ne);
        let shexp_order = router_dot_order(rows, d, 1);
        let mut routes = Vec::with_capacity(n * (cfg.n_expert_used + 1));
        let mut all_probs = vec![0f32; n * ne];
        let mut idx: Vec<usize> = Vec::with_capacity(ne);
        for (t, (x, probs)) in h
            .chunks_exact(d)
            .zip(all_probs.chunks_exact_mut(ne))
            .enumerate()
        {
            for (p, w) in probs.iter_mut().zip(self.gate_inp.chunks_exact(d)) {
                *p = dot(order, w, x);
            }
            if let Some(b) = &self.bias {
                probs.iter_mut().zip(b).for_each(|(p, b)| *p += b);
            }
            if cfg.gating != Gating::TopKUnit {
                softmax(probs);
            }
            idx.clear();
            idx.extend(0..ne);
            // Descending probability; a stable sort keeps lower indices first on ties, as
            // libstdc++'s insertion sort does for ggml_argsort's small rows.
            idx.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
            let chosen = &idx[..k_of(t)];
            let scale = if cfg.gating == Gating::SoftmaxNorm {
                let sum: f64 = chosen.iter().map(|&e| probs[e] as f64).sum();
                Some((sum as f32).max(WEIGHT_SUM_MIN))
            } else {
                None
            };
            for &e in chosen {
                let p = probs[e];
                routes.push(Route {
                    token: t as u32,
                    expert: e as u32,
                    weight: match cfg.gating {
                        Gating::TopKUnit => 1.0,
                        _ => scale.map_or(p, |s| p / s),
                    },
                });
            }
            if let Some(g) = &self.shexp_gate {
                let g = dot(shexp_order, g, x);
                // ggml_div(ggml_silu(g), g): libm expf (a one-element row), then a division.
                let silu = g / (1.0 + (-g).exp());
                routes.push(Route {
                    token: t as u32,
                    expert: ne as u32,
                    weight: silu / g,
                });
            }
        }
        (routes, all_probs)
    }
}

/// `ggml_soft_max` of one row in place (scale 1, no mask): max by a plain loop, the exps and
/// their f64 sum as `ggml_vec_soft_max_f32`, then `p = e · (float)(1 / sum)`.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum = ternfleet_kernels::softmax_exp(x, max);
    let inv = (1.0 / sum) as f32;
    x.iter_mut().for_each(|v| *v *= inv);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(n_expert: usize, k: usize, gating: Gating, shared: bool) -> MoeConfig {
        MoeConfig {
            n_expert,
            n_expert_used: k,
            n_ff_exp: 8,
            gating,
            n_ff_shexp: shared.then_some(8),
        }
    }

    #[test]
    fn picks_top_k_in_probability_order_and_normalises() {
        // 2-wide hidden state, 4 experts whose logits are the first coordinate times 1..4.
        let gate = vec![1.0, 0.0, 3.0, 0.0, 2.0, 0.0, 4.0, 0.0];
        let r = Router::new(2, gate.clone(), None, None);
        let (routes, probs) = r.route(&cfg(4, 2, Gating::SoftmaxNorm, false), &[1.0, 0.5], 1);
        assert_eq!(
            routes.iter().map(|r| r.expert).collect::<Vec<_>>(),
            vec![3, 1]
        );
        let e: Vec<f64> = [1.0f64, 3.0, 2.0, 4.0].iter().map(|l| l.exp()).collect();
        let z: f64 = e.iter().sum();
        for (p, e) in probs.iter().zip(&e) {
            assert!((*p as f64 - e / z).abs() < 1e-6);
        }
        let w3 = e[3] / (e[3] + e[1]);
        assert!((routes[0].weight as f64 - w3).abs() < 1e-6);
        assert!((routes[0].weight + routes[1].weight - 1.0).abs() < 1e-6);

        // Without renormalisation the weights are the probabilities themselves.
        let r = Router::new(2, gate.clone(), None, None);
        let (routes, probs) = r.route(&cfg(4, 2, Gating::Softmax, false), &[1.0, 0.5], 1);
        assert_eq!(routes[0].weight, probs[3]);
        assert_eq!(routes[1].weight, probs[1]);

        // MoEfied: linear scores plus bias, weight 1 each.
        let r = Router::new(2, gate, Some(vec![0.0, 0.0, 5.0, 0.0]), None);
        let (routes, scores) = r.route(&cfg(4, 2, Gating::TopKUnit, false), &[1.0, 0.5], 1);
        assert_eq!(scores, vec![1.0, 3.0, 7.0, 4.0]);
        assert_eq!(
            routes
                .iter()
                .map(|r| (r.expert, r.weight))
                .collect::<Vec<_>>(),
            vec![(2, 1.0), (3, 1.0)]
        );
    }

    #[test]
    fn shared_expert_comes_last_with_sigmoid_weight() {
        let gate = vec![1.0, 0.0, 0.0, 1.0];
        let r = Router::new(2, gate, None, Some(vec![0.5, 0.5]));
        let (routes, _) = r.route(&cfg(2, 1, Gating::Softmax, true), &[2.0, 1.0, -1.0, 3.0], 2);
        assert_eq!(routes.len(), 4);
        assert_eq!((routes[0].token, routes[0].expert), (0, 0));
        assert_eq!((routes[1].token, routes[1].expert), (0, 2));
        assert_eq!((routes[2].token, routes[2].expert), (1, 1));
        assert_eq!((routes[3].token, routes[3].expert), (1, 2));
        let sig = |g: f64| 1.0 / (1.0 + (-g).exp());
        assert!((routes[1].weight as f64 - sig(1.5)).abs() < 1e-6);
        assert!((routes[3].weight as f64 - sig(1.0)).abs() < 1e-6);
    }

    #[test]
    fn tinyblas_order_is_a_dot_product() {
        let a: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..64).map(|i| (i as f32 * 0.11).cos()).collect();
        let exact: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
        for o in [DotOrder::VecDot, DotOrder::TinyBlas] {
            assert!((dot(o, &a, &b) as f64 - exact).abs() < 1e-5, "{o:?}");
        }
        assert_eq!(router_dot_order(1, 64, 8), DotOrder::VecDot);
        assert_eq!(router_dot_order(2, 64, 8), DotOrder::TinyBlas);
        assert_eq!(router_dot_order(2, 64, 6), DotOrder::VecDot);
        assert_eq!(router_dot_order(2, 40, 8), DotOrder::VecDot);
    }
}
