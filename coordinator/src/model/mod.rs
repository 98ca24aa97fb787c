//! The dense model graph: embeddings, attention with its KV cache, norms and the LM head. The
//! FFN of every layer runs through an [`ExpertBackend`] so the same graph serves dense models
//! (one expert, weight 1) and, later, routed experts on remote nodes.

pub mod config;
pub mod moe;
pub mod weights;

use std::path::Path;
use std::sync::Arc;

use half::f16;
use rayon::prelude::*;
use ternfleet_kernels::Activations;
use ternfleet_node::compute::Linear;
use ternfleet_node::expert::{dump, ExpertBackend, ExpertBatch, LocalExperts, Route};
use ternfleet_shared::bundle::BundleError;
use ternfleet_shared::gguf::GgufFile;

use crate::kv_cache::{KvCache, KvError};
use crate::ops;
use crate::tokenizer::Tokenizer;
pub use config::{Arch, ModelConfig, ModelError, MoeConfig};
use weights::DenseWeights;

/// Errors of a forward pass.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("token id {id} at batch position {pos} is outside the vocabulary (n_vocab {n_vocab})")]
    BadToken { id: u32, pos: usize, n_vocab: usize },
    #[error("empty batch")]
    Empty,
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error(transparent)]
    Expert(#[from] ternfleet_node::expert::ExpertError),
    #[error(transparent)]
    Compute(#[from] ternfleet_node::compute::ComputeError),
    #[error(transparent)]
    Kernel(#[from] ternfleet_kernels::KernelError),
}

/// Sees inside a forward pass (see [`Model::forward_observed`]). Both methods default to
/// doing nothing.
pub trait Observer {
    /// The normalised FFN input of layer `layer`: `n_tokens × n_embd`.
    fn ffn_input(&mut self, _layer: usize, _x: &[f32]) {}
    /// The routes of an MoE layer (per token, best first; a shared expert last) and the
    /// router's scores (`n_tokens × n_expert`).
    fn routes(&mut self, _layer: usize, _routes: &[Route], _scores: &[f32]) {}
}

/// An [`Observer`] that looks at nothing.
pub struct NoObserver;
impl Observer for NoObserver {}

/// Which positions of a batch need logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last token (generation, prefill benchmarks).
    Last,
    /// Tokens `from..` of the batch (perplexity).
    From(usize),
}

/// A loaded model: configuration, tokenizer, dense weights and the FFN backend.
pub struct Model {
    pub cfg: ModelConfig,
    pub tokenizer: Tokenizer,
    pub weights: DenseWeights,
    pub experts: Box<dyn ExpertBackend>,
    file: Arc<GgufFile>,
}

/// Opening a model: a GGUF error, or a model/tokenizer error.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: {err}")]
    Gguf {
        path: String,
        err: ternfleet_shared::gguf::GgufError,
    },
    #[error("{path}: {err}")]
    Model { path: String, err: ModelError },
    #[error("{path}: tokenizer: {err}")]
    Tokenizer {
        path: String,
        err: crate::tokenizer::TokenizerError,
    },
    #[error(transparent)]
    Bundle(#[from] BundleError),
}

/// Metadata keys of an expert blob naming its place in the model.
pub const BLOB_LAYER_KEY: &str = "ternfleet.bundle.layer";
pub const BLOB_EXPERT_KEY: &str = "ternfleet.bundle.expert";

impl Model {
    /// Opens a GGUF model file, or a bundle directory (see [`Model::open_bundle`]), and binds
    /// its weights (memory-mapped, nothing copied but norms and routers).
    pub fn open(path: &Path) -> Result<Model, LoadError> {
        if path.is_dir() {
            return Model::open_bundle(path);
        }
        let p = path.display().to_string();
        let file = Arc::new(GgufFile::open(path).map_err(|err| LoadError::Gguf {
            path: p.clone(),
            err,
        })?);
        Self::from_file(file).map_err(|e| match e {
            LoadError::Model { err, .. } => LoadError::Model {
                path: p.clone(),
                err,
            },
            LoadError::Tokenizer { err, .. } => LoadError::Tokenizer {
                path: p.clone(),
                err,
            },
            other => other,
        })
    }

    /// Binds an already opened file.
    pub fn from_file(file: Arc<GgufFile>) -> Result<Model, LoadError> {
        let wrap = |err| LoadError::Model {
            path: String::new(),
            err,
        };
        let cfg = ModelConfig::from_gguf(&file).map_err(wrap)?;
        let tokenizer = Tokenizer::from_gguf(&file).map_err(|err| LoadError::Tokenizer {
            path: String::new(),
            err,
        })?;
        let (weights, ffns) = weights::load(&file, &cfg, true).map_err(wrap)?;
        let experts = Box::new(LocalExperts::new(ffns));
        Ok(Model {
            cfg,
            tokenizer,
            weights,
            experts,
            file,
        })
    }

    /// Opens a bundle written by `ternfleet convert`: checks the manifest, the size and
    /// SHA-256 of every part and that each part is the one the manifest describes, then binds
    /// the coordinator part and every expert blob (all held by this process's backend).
    pub fn open_bundle(dir: &Path) -> Result<Model, LoadError> {
        use ternfleet_shared::bundle::{Gating, Manifest};
        let man = Manifest::read(dir)?;
        let cpath = Manifest::verify_part(dir, &man.coordinator)?;
        let cp = cpath.display().to_string();
        let mismatch = |path: &Path, msg: String| {
            LoadError::Bundle(BundleError::Mismatch {
                path: path.to_owned(),
                msg,
            })
        };
        let file = Arc::new(GgufFile::open(&cpath).map_err(|err| LoadError::Gguf {
            path: cp.clone(),
            err,
        })?);
        let wrap = |err| LoadError::Model {
            path: cp.clone(),
            err,
        };
        let mut cfg = ModelConfig::from_gguf(&file).map_err(wrap)?;
        if cfg.arch.name() != man.architecture || cfg.n_layer != man.n_layer {
            return Err(mismatch(
                &cpath,
                format!(
                    "architecture {} with {} layers, the manifest says {} with {}",
                    cfg.arch.name(),
                    cfg.n_layer,
                    man.architecture,
                    man.n_layer
                ),
            ));
        }
        let mi = &man.moe;
        let moe = MoeConfig {
            n_expert: mi.n_expert,
            n_expert_used: mi.n_expert_used,
            n_ff_exp: mi.n_ff_exp,
            gating: mi.gating,
            n_ff_shexp: mi.n_ff_shexp,
        };
        if let Some(own) = &cfg.moe {
            if own.n_expert != moe.n_expert
                || own.n_ff_exp != moe.n_ff_exp
                || own.n_ff_shexp != moe.n_ff_shexp
            {
                return Err(mismatch(
                    &cpath,
                    format!("its experts are {own:?}, the manifest says {moe:?}"),
                ));
            }
        }
        cfg.moe = Some(moe);
        let tokenizer = Tokenizer::from_gguf(&file).map_err(|err| LoadError::Tokenizer {
            path: cp.clone(),
            err,
        })?;
        let (weights, shared) = weights::load(&file, &cfg, false).map_err(wrap)?;
        let routed = mi.gating != Gating::TopKUnit;
        let blobs: Vec<ternfleet_node::expert::FfnWeights> = man
            .experts
            .par_iter()
            .map(|e| {
                let path = Manifest::verify_part(dir, &e.part)?;
                let p = path.display().to_string();
                let f = Arc::new(GgufFile::open(&path).map_err(|err| LoadError::Gguf {
                    path: p.clone(),
                    err,
                })?);
                let at = |k: &str| f.get_u32(k).ok().flatten().map(|v| v as usize);
                if at(BLOB_LAYER_KEY) != Some(e.layer) || at(BLOB_EXPERT_KEY) != Some(e.expert) {
                    return Err(mismatch(
                        &path,
                        format!(
                            "the blob says layer {:?} expert {:?}, the manifest layer {} expert {}",
                            at(BLOB_LAYER_KEY),
                            at(BLOB_EXPERT_KEY),
                            e.layer,
                            e.expert
                        ),
                    ));
                }
                for t in &e.tensors {
                    let got = f.tensor(&t.name).map(|i| (i.ty.name(), i.dims.clone()));
                    if got != Some((t.ty.as_str(), t.dims.clone())) {
                        return Err(mismatch(
                            &path,
                            format!(
                                "tensor {} is {got:?}, the manifest says {} {:?}",
                                t.name, t.ty, t.dims
                            ),
                        ));
                    }
                }
                weights::expert_from_blob(&f, &cfg, mi.n_ff_exp, routed)
                    .map_err(|err| LoadError::Model { path: p, err })
            })
            .collect::<Result<_, _>>()?;
        let mut blobs = blobs.into_iter();
        let ffns = shared
            .into_iter()
            .map(|sh| {
                let mut layer: Vec<_> = blobs.by_ref().take(mi.n_expert).collect();
                layer.extend(sh);
                layer
            })
            .collect();
        Ok(Model {
            cfg,
            tokenizer,
            weights,
            experts: Box::new(LocalExperts::new(ffns)),
            file,
        })
    }

    /// Uses `k` experts per token from now on (MoE models; clamped to 1..=n_expert).
    /// Returns the value in effect.
    pub fn set_top_k(&mut self, k: usize) -> Option<usize> {
        let m = self.cfg.moe.as_mut()?;
        m.n_expert_used = k.clamp(1, m.n_expert);
        Some(m.n_expert_used)
    }

    /// The mapped file.
    pub fn file(&self) -> &Arc<GgufFile> {
        &self.file
    }

    /// A KV cache sized for `n_ctx` positions.
    pub fn new_cache(&self, n_ctx: usize) -> KvCache {
        KvCache::new(self.cfg.n_layer, self.cfg.k_dim(), self.cfg.v_dim(), n_ctx)
    }

    /// Runs `tokens` at the next positions of `cache` and returns logits (`rows × n_vocab`) for
    /// the positions `want` selects.
    pub fn forward(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        want: Logits,
    ) -> Result<Vec<f32>, ForwardError> {
        self.forward_observed(cache, tokens, want, &mut NoObserver)
    }

    /// [`Model::forward`], showing `obs` each layer's FFN input and routing decisions
    /// (MoEfication calibration, routing statistics).
    pub fn forward_observed(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        want: Logits,
        obs: &mut dyn Observer,
    ) -> Result<Vec<f32>, ForwardError> {
        let cfg = &self.cfg;
        let n = tokens.len();
        if n == 0 {
            return Err(ForwardError::Empty);
        }
        cache.reserve(n)?;
        let d = cfg.n_embd;
        let p0 = cache.len();
        let w = &self.weights;

        // Embeddings (ggml get_rows + scale).
        let mut x = vec![0f32; n * d];
        for (i, (&t, row)) in tokens.iter().zip(x.chunks_exact_mut(d)).enumerate() {
            if t as usize >= cfg.n_vocab {
                return Err(ForwardError::BadToken {
                    id: t,
                    pos: i,
                    n_vocab: cfg.n_vocab,
                });
            }
            w.token_embd.dequantize_row(t as usize, row)?;
            if cfg.embd_scale != 1.0 {
                row.iter_mut().for_each(|v| *v *= cfg.embd_scale);
            }
        }

        let mut act = Activations::new();
        let mut h = vec![0f32; n * d];
        let mut q = vec![0f32; n * cfg.q_dim()];
        let mut k = vec![0f32; n * cfg.k_dim()];
        let mut v = vec![0f32; n * cfg.v_dim()];
        let mut attn = vec![0f32; n * cfg.n_head * cfg.head_dim_v];
        let mut o = vec![0f32; n * d];
        // cos/sin per position for the (at most two) RoPE settings, computed once per batch
        // instead of once per layer: the global and the sliding-window layers' bases.
        let rope_tables = |base: f32, scale: f32| -> Vec<Vec<(f32, f32)>> {
            (0..n)
                .map(|t| {
                    let mut c = Vec::with_capacity(cfg.n_rot / 2);
                    ops::rope_cache(p0 + t, cfg.n_rot, base, scale, &mut c);
                    c
                })
                .collect()
        };
        let rope_global = rope_tables(cfg.rope_base, cfg.rope_scale);
        let rope_swa = if cfg.is_swa.iter().any(|&s| s) {
            rope_tables(cfg.rope_base_swa, 1.0)
        } else {
            Vec::new()
        };
        let all_tokens: Vec<Route> = (0..n as u32)
            .map(|t| Route {
                token: t,
                expert: 0,
                weight: 1.0,
            })
            .collect();

        dump("embd", &x, d);
        for (il, lw) in w.layers.iter().enumerate() {
            // Attention block.
            h.copy_from_slice(&x);
            ops::rms_norm_rows(&mut h, &lw.attn_norm, cfg.rms_eps);
            dump(&format!("attn_norm-{il}"), &h, d);
            linear(&mut act, &lw.wq, &h, n, lw.bq.as_deref(), &mut q)?;
            linear(&mut act, &lw.wk, &h, n, lw.bk.as_deref(), &mut k)?;
            linear(&mut act, &lw.wv, &h, n, lw.bv.as_deref(), &mut v)?;
            dump(&format!("Qcur-{il}"), &q, cfg.q_dim());
            dump(&format!("Kcur-{il}"), &k, cfg.k_dim());
            dump(&format!("Vcur-{il}"), &v, cfg.v_dim());
            if let Some(qn) = &lw.q_norm {
                ops::rms_norm_rows(&mut q, qn, cfg.rms_eps);
            }
            if let Some(kn) = &lw.k_norm {
                ops::rms_norm_rows(&mut k, kn, cfg.rms_eps);
            }
            dump(&format!("Kcur_normed-{il}"), &k, cfg.k_dim());
            let rope = if cfg.is_swa[il] {
                &rope_swa
            } else {
                &rope_global
            };
            for (t, rope) in rope.iter().enumerate() {
                for head in
                    q[t * cfg.q_dim()..(t + 1) * cfg.q_dim()].chunks_exact_mut(cfg.head_dim_k)
                {
                    ops::rope_apply(head, rope, cfg.rope_type);
                }
                for head in
                    k[t * cfg.k_dim()..(t + 1) * cfg.k_dim()].chunks_exact_mut(cfg.head_dim_k)
                {
                    ops::rope_apply(head, rope, cfg.rope_type);
                }
            }
            if cfg.q_scale != 1.0 {
                q.iter_mut().for_each(|v| *v *= cfg.q_scale);
            }
            dump(&format!("Qrope-{il}"), &q, cfg.head_dim_k);
            dump(&format!("Krope-{il}"), &k, cfg.k_dim());
            cache.push(il, &k, &v);
            let window = if cfg.is_swa[il] {
                cfg.sliding_window
            } else {
                None
            };
            attention(cfg, cache, il, p0, &q, window, &mut attn);
            dump(&format!("kqv_out-{il}"), &attn, cfg.n_head * cfg.head_dim_v);
            linear(&mut act, &lw.wo, &attn, n, lw.bo.as_deref(), &mut o)?;
            dump(&format!("attn_out-{il}"), &o, d);
            if let Some(pn) = &lw.post_attn_norm {
                ops::rms_norm_rows(&mut o, pn, cfg.rms_eps);
            }
            x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);
            dump(&format!("ffn_inp-{il}"), &x, d);

            // FFN block, through the expert backend.
            h.copy_from_slice(&x);
            ops::rms_norm_rows(&mut h, &lw.ffn_norm, cfg.rms_eps);
            dump(&format!("ffn_norm-{il}"), &h, d);
            obs.ffn_input(il, &h);
            o.iter_mut().for_each(|v| *v = 0.0);
            let routed;
            let routes = match (&lw.router, &cfg.moe) {
                (Some(r), Some(m)) => {
                    let scores;
                    (routed, scores) = r.route(m, &h, n);
                    obs.routes(il, &routed, &scores);
                    &routed
                }
                _ => &all_tokens,
            };
            let batch = ExpertBatch {
                layer: il,
                hidden: &h,
                n_tokens: n,
                routes,
            };
            self.experts.run(&batch, &mut o)?;
            if let Some(pn) = &lw.post_ffn_norm {
                ops::rms_norm_rows(&mut o, pn, cfg.rms_eps);
            }
            x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);
            dump(&format!("l_out-{il}"), &x, d);
        }
        cache.commit(n);

        let from = match want {
            Logits::Last => n - 1,
            Logits::From(f) => f.min(n - 1),
        };
        let rows = n - from;
        let mut xo = x[from * d..].to_vec();
        ops::rms_norm_rows(&mut xo, &w.output_norm, cfg.rms_eps);
        let mut logits = vec![0f32; rows * cfg.n_vocab];
        linear(&mut act, &w.output, &xo, rows, None, &mut logits)?;
        dump("result_norm", &xo, d);
        dump("result_output", &logits, cfg.n_vocab);
        if let Some(cap) = cfg.final_logit_softcap {
            logits.iter_mut().for_each(|l| *l = (*l / cap).tanh() * cap);
        }
        Ok(logits)
    }
}

/// `out = W x (+ b)` for `n` rows of `x`, quantizing `x` for W's kernel.
fn linear(
    act: &mut Activations,
    w: &Linear,
    x: &[f32],
    n: usize,
    b: Option<&[f32]>,
    out: &mut [f32],
) -> Result<(), ForwardError> {
    ternfleet_node::compute::quantize_par(act, w.ty(), x, n, w.cols())?;
    w.forward(act, out)?;
    if let Some(b) = b {
        ops::add_bias_rows(out, b);
    }
    Ok(())
}

/// ggml's flash-attention processes fewer than this many queries with its one-query-at-a-time
/// kernel and more with its tiled GEMM kernel (ggml-cpu/common.h `GGML_FA_TILE_Q`).
const FA_TILE_Q: usize = 64;

/// Causal (optionally sliding-window) attention of the `n` queries in `q` (positions `p0..`)
/// over every cached position of layer `il`.
///
/// Greedy parity with llama.cpp needs its rounding, so this follows the two CPU paths of
/// `ggml_compute_forward_flash_attn_ext_f16` (ggml-cpu/ops.cpp) with the f16 KV cache:
/// - fewer than 64 queries (decode, short prompts): Q rounded to f16, K·Q by
///   `ggml_vec_dot_f16`, online softmax in key order with an f16 V accumulator
///   (`ggml_vec_scale_f16` / `ggml_vec_mad_f16`), divided by the sum at the end;
/// - 64 or more (prefill): the tiled kernel, see [`attention_batched`].
fn attention(
    cfg: &ModelConfig,
    cache: &KvCache,
    il: usize,
    p0: usize,
    q: &[f32],
    window: Option<usize>,
    out: &mut [f32],
) {
    if q.len() / cfg.q_dim() >= FA_TILE_Q {
        attention_batched(cfg, cache, il, p0, q, window, out);
        return;
    }
    let (hk, hv) = (cfg.head_dim_k, cfg.head_dim_v);
    let (k_dim, v_dim) = cache.dims();
    let group = cfg.n_head / cfg.n_head_kv;
    let keys = cache.keys(il);
    let values = cache.values(il);
    out.par_chunks_mut(hv).enumerate().for_each(|(i, o)| {
        let (t, head) = (i / cfg.n_head, i % cfg.n_head);
        let g = head / group;
        let pos = p0 + t;
        let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let qrow = &q[t * cfg.q_dim() + head * hk..t * cfg.q_dim() + (head + 1) * hk];
        let key = |j: usize| &keys[j * k_dim + g * hk..j * k_dim + (g + 1) * hk];
        let value = |j: usize| &values[j * v_dim + g * hv..j * v_dim + (g + 1) * hv];
        let q16: Vec<f16> = qrow.iter().map(|&v| f16::from_f32(v)).collect();
        let mut acc = vec![f16::ZERO; hv];
        let (mut sum, mut max) = (0f32, f32::NEG_INFINITY);
        for j in lo..=pos {
            let s = ternfleet_kernels::dot_f16(key(j), &q16) * cfg.kq_scale;
            let (mut ms, mut vs) = (1f32, 1f32);
            if s > max {
                let old = max;
                max = s;
                ms = (old - max).exp();
                ternfleet_kernels::scale_f16(&mut acc, ms);
            } else {
                vs = (s - max).exp();
            }
            ternfleet_kernels::mad_f16(&mut acc, value(j), vs);
            // `S = S*ms + vs`, contracted to one FMA by the C compiler (-ffp-contract=fast).
            sum = sum.mul_add(ms, vs);
        }
        let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
        o.iter_mut()
            .zip(&acc)
            .for_each(|(o, a)| *o = a.to_f32() * inv);
    });
}

/// Keys per tile of ggml's tiled flash attention (ggml-cpu/common.h `GGML_FA_TILE_KV`).
const FA_TILE_KV: usize = 64;

/// Attention for 64 or more queries (prefill), computed as llama.cpp's tiled flash attention
/// (`ggml_compute_forward_flash_attn_ext_tiled`) rounds it, so prompts of any length give its
/// logits: Q stays f32, K and V are widened from the f16 cache; per query, keys go in tiles of
/// 64 from position 0: scores as one FMA chain over the head dimension, scaled, masked, the
/// running max and sum updated once per tile (`ggml_vec_soft_max_f32` with ggml's polynomial
/// exp, summed in f64), and P·V accumulated one FMA per key in order; divided by the sum last.
fn attention_batched(
    cfg: &ModelConfig,
    cache: &KvCache,
    il: usize,
    p0: usize,
    q: &[f32],
    window: Option<usize>,
    out: &mut [f32],
) {
    const W: usize = FA_TILE_KV;
    let (hk, hv) = (cfg.head_dim_k, cfg.head_dim_v);
    let (k_dim, v_dim) = cache.dims();
    let group = cfg.n_head / cfg.n_head_kv;
    let n = q.len() / cfg.q_dim();
    let n_kv = p0 + n;
    let ntiles = n_kv.div_ceil(W);
    let keys = cache.keys(il);
    let values = cache.values(il);
    // Per KV head: every key tile transposed (hk rows of W keys) and every value tile (W rows
    // of hv), in f32, zero past the last position.
    let tiles: Vec<(Vec<f32>, Vec<f32>)> = (0..cfg.n_head_kv)
        .into_par_iter()
        .map(|g| {
            let mut kt = vec![0f32; ntiles * hk * W];
            let mut vt = vec![0f32; ntiles * W * hv];
            for j in 0..n_kv {
                let (tile, c) = (j / W, j % W);
                let krow = &keys[j * k_dim + g * hk..j * k_dim + (g + 1) * hk];
                let kt_tile = &mut kt[tile * hk * W..(tile + 1) * hk * W];
                for (d, kv) in krow.iter().enumerate() {
                    kt_tile[d * W + c] = kv.to_f32();
                }
                let vrow = &values[j * v_dim + g * hv..j * v_dim + (g + 1) * hv];
                half::slice::HalfFloatSliceExt::convert_to_f32_slice(
                    vrow,
                    &mut vt[j * hv..(j + 1) * hv],
                );
            }
            (kt, vt)
        })
        .collect();
    // Tasks of up to 4 consecutive queries of one head: the kernels share each K and V tile
    // load among them (every row keeps its own max, sum and FMA chains).
    const R: usize = 4;
    let groups = n.div_ceil(R);
    let results: Vec<Vec<f32>> = (0..cfg.n_head * groups)
        .into_par_iter()
        .map(|task| {
            let (head, t0) = (task / groups, task % groups * R);
            let rows = (n - t0).min(R);
            let (kt, vt) = &tiles[head / group];
            let mut qb = Vec::with_capacity(rows * hk);
            for t in t0..t0 + rows {
                qb.extend_from_slice(
                    &q[t * cfg.q_dim() + head * hk..t * cfg.q_dim() + (head + 1) * hk],
                );
            }
            let pos = |r: usize| p0 + t0 + r;
            let lo = |r: usize| window.map_or(0, |w| (pos(r) + 1).saturating_sub(w));
            let mut vkq = vec![0f32; rows * hv];
            let mut sum = [0f32; R];
            let mut max = [f32::NEG_INFINITY; R];
            let mut kq = vec![0f32; rows * W];
            for tile in lo(0) / W..=pos(rows - 1) / W {
                let k0 = tile * W;
                ternfleet_kernels::fa_scores(
                    &qb,
                    &kt[tile * hk * W..(tile + 1) * hk * W],
                    W,
                    &mut kq,
                );
                for r in 0..rows {
                    let row = &mut kq[r * W..(r + 1) * W];
                    for (j, s) in row.iter_mut().enumerate() {
                        *s = if k0 + j < lo(r) || k0 + j > pos(r) {
                            f32::NEG_INFINITY
                        } else {
                            *s * cfg.kq_scale
                        };
                    }
                    let tile_max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    if tile_max == f32::NEG_INFINITY {
                        // No key of this tile is visible to the row: it adds nothing.
                        row.fill(0.0);
                        continue;
                    }
                    let new_max = max[r].max(tile_max);
                    if new_max > max[r] {
                        let ms = (max[r] - new_max).exp();
                        vkq[r * hv..(r + 1) * hv].iter_mut().for_each(|v| *v *= ms);
                        sum[r] *= ms;
                    }
                    max[r] = new_max;
                    sum[r] = (sum[r] as f64 + ternfleet_kernels::softmax_exp(row, new_max)) as f32;
                }
                ternfleet_kernels::fa_pv(&mut vkq, &kq, &vt[k0 * hv..(k0 + W) * hv], hv);
            }
            for r in 0..rows {
                let inv = if sum[r] == 0.0 { 0.0 } else { 1.0 / sum[r] };
                vkq[r * hv..(r + 1) * hv].iter_mut().for_each(|v| *v *= inv);
            }
            vkq
        })
        .collect();
    for (task, res) in results.iter().enumerate() {
        let (head, t0) = (task / groups, task % groups * R);
        for (r, row) in res.chunks_exact(hv).enumerate() {
            let dst = (t0 + r) * cfg.n_head * hv + head * hv;
            out[dst..dst + hv].copy_from_slice(row);
        }
    }
}
