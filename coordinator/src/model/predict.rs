//! The shadow predictor: from the residual stream at one MoE layer, guess the experts of the
//! next few layers, so the expert store can read them before they are needed.
//!
//! The router-based predictor (DESIGN.md "Node memory hierarchy", issue 14): apply layer
//! `l + j`'s FFN norm and router to the residual entering layer `l`'s FFN. It costs one router
//! matmul per lookahead layer (`n_expert × n_embd`, small beside the experts) and needs no
//! training: the residual stream changes slowly from layer to layer, so a later router applied
//! to the current state is a good guess of what it will pick. Predictions only steer what the
//! store holds; they never change the output.

use ternfleet_kernels::Numerics;

use super::weights::DenseWeights;
use super::ModelConfig;
use crate::ops;

/// How many layers ahead the engine hints the expert store by default (`--lookahead`; the
/// best of 1, 2 and 4 measured, docs/moe-scale.md).
pub const LOOKAHEAD: usize = 1;

/// Predicts later layers' experts with their own routers applied to the current state.
pub struct RouterPredictor<'a> {
    cfg: &'a ModelConfig,
    weights: &'a DenseWeights,
}

impl<'a> RouterPredictor<'a> {
    /// `None` for a dense model.
    pub fn new(cfg: &'a ModelConfig, weights: &'a DenseWeights) -> Option<Self> {
        cfg.moe.as_ref()?;
        Some(RouterPredictor { cfg, weights })
    }

    /// For each of the `n` rows of `x` (the residual entering layer `layer`'s FFN), the `k`
    /// experts layer `target` would pick were the state unchanged, best first
    /// (`n × k` ids; the shared expert is never predicted: it is always used). Empty when
    /// `target` has no router.
    pub fn predict(&self, x: &[f32], n: usize, target: usize, k: usize) -> Vec<u32> {
        let (Some(m), Some(lw)) = (&self.cfg.moe, self.weights.layers.get(target)) else {
            return Vec::new();
        };
        let Some(router) = &lw.router else {
            return Vec::new();
        };
        let mut h = x[..n * self.cfg.n_embd].to_vec();
        ops::rms_norm_rows(&mut h, &lw.ffn_norm, self.cfg.rms_eps);
        let ks = vec![k; n];
        let (routes, _) = router.route_rows(m, &h, n, &ks, Numerics::Invariant);
        routes
            .iter()
            .filter(|r| (r.expert as usize) < m.n_expert)
            .map(|r| r.expert)
            .collect()
    }
}
