//! The shadow predictor: from the residual stream at one MoE layer, guess the experts of the
//! next few layers, so the expert store can read them before they are needed.
//!
//! The router-based predictor (DESIGN.md "Node memory hierarchy", issue 14): apply layer
//! `l + j`'s FFN norm and router to the residual entering layer `l`'s FFN. It costs one router
//! matmul per lookahead layer (`n_expert × n_embd`, small beside the experts) and needs no
//! training: the residual stream changes slowly from layer to layer, so a later router applied
//! to the current state is a good guess of what it will pick. Predictions only steer what the
//! store holds; they never change the output.

use std::path::Path;

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

/// Where `ternfleet fit-predictor` writes a model's learned predictor by default: inside a
/// bundle directory `predictor.gguf`, beside a GGUF file `FILE.predictor.gguf`.
pub fn default_path(model: &Path) -> std::path::PathBuf {
    if model.is_dir() {
        model.join("predictor.gguf")
    } else {
        let mut s = model.as_os_str().to_owned();
        s.push(".predictor.gguf");
        std::path::PathBuf::from(s)
    }
}

/// The file format version [`LearnedPredictor::save`] writes.
const LEARNED_VERSION: u32 = 1;
/// The GGUF `general.type` of a predictor file.
const LEARNED_TYPE: &str = "ternfleet-predictor";

/// Reading or writing a predictor file.
#[derive(Debug, thiserror::Error)]
pub enum PredictorError {
    #[error("{path}: {err}")]
    Gguf {
        path: String,
        err: ternfleet_shared::gguf::GgufError,
    },
    #[error("{path}: not a ternfleet predictor file ({why})")]
    Invalid { path: String, why: String },
    #[error("{path}: the predictor was fitted for {what} {file}, the model has {model}")]
    Mismatch {
        path: String,
        what: &'static str,
        file: usize,
        model: usize,
    },
}

/// The learned shadow predictor (issue 14): for a source layer `s` and a lookahead `j`, a
/// linear map from the RMS-normalised residual entering `s`'s FFN (no norm weight) to layer
/// `s + j`'s router logits, fitted by ridge regression on calibration text
/// ([`crate::model::fit`]) toward the router predictor (which is such a map too: layer
/// `s + j`'s router times its norm weight), so it is never worse on the data it was fitted on.
/// Stored as a small GGUF file (`predictor.gguf` in a bundle).
#[derive(Debug, Clone)]
pub struct LearnedPredictor {
    n_embd: usize,
    n_expert: usize,
    n_layer: usize,
    eps: f32,
    /// `maps[s][j - 1]`: `n_expert` rows of `n_embd + 1` (weights, then the bias).
    maps: Vec<Vec<Option<Vec<f32>>>>,
}

impl LearnedPredictor {
    /// An empty predictor for a model (maps added with [`LearnedPredictor::set`]).
    pub fn new(n_embd: usize, n_expert: usize, n_layer: usize, eps: f32, lookahead: usize) -> Self {
        LearnedPredictor {
            n_embd,
            n_expert,
            n_layer,
            eps,
            maps: vec![vec![None; lookahead]; n_layer],
        }
    }

    /// The farthest lookahead it holds maps for.
    pub fn lookahead(&self) -> usize {
        self.maps.first().map_or(0, Vec::len)
    }

    /// Sets the map from layer `source` to `source + j` (`n_expert × (n_embd + 1)`).
    pub fn set(&mut self, source: usize, j: usize, map: Vec<f32>) {
        debug_assert_eq!(map.len(), self.n_expert * (self.n_embd + 1));
        if let Some(slot) = self.maps.get_mut(source).and_then(|m| m.get_mut(j - 1)) {
            *slot = Some(map);
        }
    }

    /// Whether it predicts layer `target` from layer `source`.
    pub fn has(&self, source: usize, target: usize) -> bool {
        self.map(source, target).is_some()
    }

    fn map(&self, source: usize, target: usize) -> Option<&[f32]> {
        let j = target.checked_sub(source)?.checked_sub(1)?;
        self.maps.get(source)?.get(j)?.as_deref()
    }

    /// For each of the `n` rows of `x` (the residual entering layer `source`'s FFN), the `k`
    /// experts predicted for layer `target`, best first (`n × k` ids); empty when it has no
    /// map for the pair.
    pub fn predict(&self, x: &[f32], n: usize, source: usize, target: usize, k: usize) -> Vec<u32> {
        let Some(map) = self.map(source, target) else {
            return Vec::new();
        };
        let d = self.n_embd;
        let mut out = Vec::with_capacity(n * k);
        let mut logits = vec![0f32; self.n_expert];
        for row in x.chunks_exact(d).take(n) {
            map_logits(map, row, rms_scale(row, self.eps), &mut logits);
            out.extend(top_k(&logits, k));
        }
        out
    }

    /// Writes the predictor as a GGUF file.
    pub fn save(&self, path: &Path, calib_tokens: usize) -> Result<(), PredictorError> {
        use ternfleet_shared::gguf::{GgufWriter, Value};
        let gg = |err| PredictorError::Gguf {
            path: path.display().to_string(),
            err,
        };
        let mut w = GgufWriter::new();
        let kvs = [
            ("general.type", Value::String(LEARNED_TYPE.into())),
            ("ternfleet.predictor.version", Value::U32(LEARNED_VERSION)),
            ("ternfleet.predictor.n_embd", Value::U64(self.n_embd as u64)),
            (
                "ternfleet.predictor.n_expert",
                Value::U64(self.n_expert as u64),
            ),
            (
                "ternfleet.predictor.n_layer",
                Value::U64(self.n_layer as u64),
            ),
            (
                "ternfleet.predictor.lookahead",
                Value::U64(self.lookahead() as u64),
            ),
            ("ternfleet.predictor.rms_eps", Value::F32(self.eps)),
            (
                "ternfleet.predictor.calib_tokens",
                Value::U64(calib_tokens as u64),
            ),
        ];
        for (k, v) in kvs {
            w.add_kv(k, v).map_err(gg)?;
        }
        for (s, maps) in self.maps.iter().enumerate() {
            for (j, map) in maps.iter().enumerate() {
                if let Some(map) = map {
                    let bytes: Vec<u8> = map.iter().flat_map(|v| v.to_le_bytes()).collect();
                    w.add_tensor(
                        format!("predictor.{s}.{}", j + 1),
                        &[(self.n_embd + 1) as u64, self.n_expert as u64],
                        ternfleet_kernels::GgmlType::F32,
                        bytes,
                    )
                    .map_err(gg)?;
                }
            }
        }
        w.write_file(path).map_err(gg)
    }

    /// Reads a predictor file and checks it fits `cfg` (an MoE model).
    pub fn load(path: &Path, cfg: &ModelConfig) -> Result<LearnedPredictor, PredictorError> {
        use ternfleet_shared::gguf::GgufFile;
        let p = path.display().to_string();
        let gg = |err| PredictorError::Gguf {
            path: p.clone(),
            err,
        };
        let invalid = |why: String| PredictorError::Invalid {
            path: p.clone(),
            why,
        };
        let f = GgufFile::open(path).map_err(gg)?;
        if f.get_str("general.type").map_err(gg)? != Some(LEARNED_TYPE) {
            return Err(invalid(format!("general.type is not {LEARNED_TYPE}")));
        }
        let version = f.get_u32("ternfleet.predictor.version").map_err(gg)?;
        if version != Some(LEARNED_VERSION) {
            return Err(invalid(format!(
                "version {version:?}, this build reads {LEARNED_VERSION}"
            )));
        }
        let num = |key: &str| -> Result<usize, PredictorError> {
            let v = f.get_u64(key).map_err(gg)?;
            v.map(|v| v as usize)
                .ok_or_else(|| invalid(format!("{key} missing")))
        };
        let n_expert_model = cfg.moe.as_ref().map_or(0, |m| m.n_expert);
        let (d, ne, nl, la) = (
            num("ternfleet.predictor.n_embd")?,
            num("ternfleet.predictor.n_expert")?,
            num("ternfleet.predictor.n_layer")?,
            num("ternfleet.predictor.lookahead")?,
        );
        for (what, file, model) in [
            ("hidden size", d, cfg.n_embd),
            ("experts per layer", ne, n_expert_model),
            ("layers", nl, cfg.n_layer),
        ] {
            if file != model {
                return Err(PredictorError::Mismatch {
                    path: p.clone(),
                    what,
                    file,
                    model,
                });
            }
        }
        if !(1..=16).contains(&la) {
            return Err(invalid(format!("lookahead {la} outside 1..=16")));
        }
        let eps = f
            .get_f32("ternfleet.predictor.rms_eps")
            .map_err(gg)?
            .unwrap_or(cfg.rms_eps);
        let mut pred = LearnedPredictor::new(d, ne, nl, eps, la);
        for t in f.tensors() {
            let Some((s, j)) = t
                .name
                .strip_prefix("predictor.")
                .and_then(|r| r.split_once('.'))
                .and_then(|(s, j)| Some((s.parse::<usize>().ok()?, j.parse::<usize>().ok()?)))
            else {
                return Err(invalid(format!("unexpected tensor {}", t.name)));
            };
            if j == 0 || j > la || s + j >= nl {
                return Err(invalid(format!("{}: no such layer pair", t.name)));
            }
            if t.ty != ternfleet_kernels::GgmlType::F32 || t.dims != [(d + 1) as u64, ne as u64] {
                return Err(invalid(format!(
                    "{}: {:?} {:?}, expected F32 [{}, {ne}]",
                    t.name,
                    t.ty,
                    t.dims,
                    d + 1
                )));
            }
            let map: Vec<f32> = f
                .tensor_data(t)
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            if map.iter().any(|v| !v.is_finite()) {
                return Err(invalid(format!("{}: non-finite weights", t.name)));
            }
            pred.set(s, j, map);
        }
        Ok(pred)
    }
}

/// One row's logits through a map (`n_expert` rows of `row.len() + 1`): `scale` times the
/// weights' dot with `row`, plus the bias.
pub fn map_logits(map: &[f32], row: &[f32], scale: f32, out: &mut [f32]) {
    let d = row.len();
    for (l, w) in out.iter_mut().zip(map.chunks_exact(d + 1)) {
        *l = scale * ternfleet_kernels::dot_f32(&w[..d], row) + w[d];
    }
}

/// The `k` best indices of `v`, best first (ties: the lower index first, as the router).
pub fn top_k(v: &[f32], k: usize) -> impl Iterator<Item = u32> {
    let mut idx: Vec<u32> = (0..v.len() as u32).collect();
    idx.sort_by(|&a, &b| v[b as usize].total_cmp(&v[a as usize]));
    idx.truncate(k);
    idx.into_iter()
}

/// `1 / sqrt(mean(x²) + eps)`, the RMS norm's scale (f64 sum: the fitter's features).
pub fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let ss: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
    (1.0 / (ss / x.len().max(1) as f64 + eps as f64).sqrt()) as f32
}
