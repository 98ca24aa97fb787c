//! The dense part of a model (everything but the FFN experts), bound to a mapped GGUF file, and
//! the FFN weights handed to the expert backend.

use std::sync::Arc;

use ternfleet_kernels::GgmlType;
use ternfleet_node::expert::{Activation, FfnWeights};
use ternfleet_shared::compute::Linear;
use ternfleet_shared::gguf::GgufFile;

use super::config::{Arch, Gating, ModelConfig, ModelError};
use super::moe::Router;

/// A small f32 vector (norm weights, biases), copied out of the file at load.
pub type Vector = Vec<f32>;

/// The attention half of one transformer block, plus its norms.
#[derive(Debug)]
pub struct LayerWeights {
    pub attn_norm: Vector,
    pub wq: Linear,
    pub wk: Linear,
    pub wv: Linear,
    pub bq: Option<Vector>,
    pub bk: Option<Vector>,
    pub bv: Option<Vector>,
    pub wo: Linear,
    pub bo: Option<Vector>,
    pub q_norm: Option<Vector>,
    pub k_norm: Option<Vector>,
    pub post_attn_norm: Option<Vector>,
    pub ffn_norm: Vector,
    pub post_ffn_norm: Option<Vector>,
    /// MoE layers: the router (and shared-expert gate); the experts live in the backend.
    pub router: Option<Router>,
}

/// The dense (coordinator-side) weights.
#[derive(Debug)]
pub struct DenseWeights {
    pub token_embd: Linear,
    pub output_norm: Vector,
    /// The LM head: `output.weight`, or the token embedding when tied.
    pub output: Linear,
    pub layers: Vec<LayerWeights>,
}

/// Per-block tensor names each architecture uses (documentation and the completeness test).
pub fn layer_tensor_plan(arch: Arch) -> &'static [&'static str] {
    match arch {
        Arch::Llama | Arch::Qwen2 => &[
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ],
        Arch::Qwen3Moe => &[
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_q_norm",
            "attn_k_norm",
            "attn_output",
            "ffn_norm",
            "ffn_gate_inp",
            "ffn_gate_exps",
            "ffn_up_exps",
            "ffn_down_exps",
        ],
        Arch::Qwen2Moe => &[
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_norm",
            "ffn_gate_inp",
            "ffn_gate_exps",
            "ffn_up_exps",
            "ffn_down_exps",
            "ffn_gate_inp_shexp",
            "ffn_gate_shexp",
            "ffn_up_shexp",
            "ffn_down_shexp",
        ],
        Arch::Qwen3 => &[
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_q_norm",
            "attn_k_norm",
            "attn_output",
            "ffn_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ],
        Arch::Gemma3 => &[
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_q_norm",
            "attn_k_norm",
            "attn_output",
            "post_attention_norm",
            "ffn_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
            "post_ffw_norm",
        ],
    }
}

struct Loader<'a> {
    file: &'a Arc<GgufFile>,
}

impl Loader<'_> {
    fn linear(&self, name: &str, cols: usize, rows: usize) -> Result<Linear, ModelError> {
        let t = self
            .file
            .tensor(name)
            .ok_or_else(|| ModelError::MissingTensor { name: name.into() })?;
        let want = [cols as u64, rows as u64];
        if t.dims.len() < 2
            || t.dims[0] != want[0]
            || t.dims[1] != want[1]
            || t.dims[2..].iter().any(|&d| d != 1)
        {
            return Err(ModelError::TensorShape {
                name: name.into(),
                got: t.dims.clone(),
                want: want.to_vec(),
            });
        }
        Ok(Linear::new(self.file, t)?)
    }

    fn vector(&self, name: &str, len: usize) -> Result<Option<Vector>, ModelError> {
        let Some(t) = self.file.tensor(name) else {
            return Ok(None);
        };
        if t.dims.iter().product::<u64>() != len as u64 || t.dims[0] != len as u64 {
            return Err(ModelError::TensorShape {
                name: name.into(),
                got: t.dims.clone(),
                want: vec![len as u64],
            });
        }
        let mut out = vec![0f32; len];
        match t.ty {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
                ternfleet_kernels::dequantize_row(t.ty, self.file.tensor_data(t), &mut out)
                    .map_err(|e| ModelError::BadValue {
                        key: name.into(),
                        msg: e.to_string(),
                    })?;
            }
            _ => {
                return Err(ModelError::TensorType {
                    name: name.into(),
                    ty: t.ty.name(),
                    why: "norms and biases must be f32/f16/bf16",
                })
            }
        }
        Ok(Some(out))
    }

    /// An f32 matrix copied out of the file (routers: small, and kept in f32 by llama.cpp's
    /// converter and quantizer, so the routing decisions are made at full precision).
    fn f32_matrix(&self, name: &str, cols: usize, rows: usize) -> Result<Vec<f32>, ModelError> {
        let t = self
            .file
            .tensor(name)
            .ok_or_else(|| ModelError::MissingTensor { name: name.into() })?;
        let want = if rows == 1 {
            vec![cols as u64]
        } else {
            vec![cols as u64, rows as u64]
        };
        let got: Vec<u64> = t.dims.iter().copied().filter(|&d| d != 1).collect();
        let want_nz: Vec<u64> = want.iter().copied().filter(|&d| d != 1).collect();
        if t.dims[0] != cols as u64 || got != want_nz {
            return Err(ModelError::TensorShape {
                name: name.into(),
                got: t.dims.clone(),
                want,
            });
        }
        if t.ty != GgmlType::F32 {
            return Err(ModelError::TensorType {
                name: name.into(),
                ty: t.ty.name(),
                why: "routers must be f32, as llama.cpp's converter writes them",
            });
        }
        let mut out = vec![0f32; cols * rows];
        ternfleet_kernels::dequantize_row(t.ty, self.file.tensor_data(t), &mut out).map_err(
            |e| ModelError::BadValue {
                key: name.into(),
                msg: e.to_string(),
            },
        )?;
        Ok(out)
    }

    /// One matrix of a stacked `[cols, rows, n]` expert tensor.
    fn stacked(
        &self,
        name: &str,
        cols: usize,
        rows: usize,
        n: usize,
        index: usize,
    ) -> Result<Linear, ModelError> {
        let t = self
            .file
            .tensor(name)
            .ok_or_else(|| ModelError::MissingTensor { name: name.into() })?;
        let want = [cols as u64, rows as u64, n as u64];
        if t.dims != want {
            return Err(ModelError::TensorShape {
                name: name.into(),
                got: t.dims.clone(),
                want: want.to_vec(),
            });
        }
        Ok(Linear::stacked(self.file, t, index)?)
    }

    fn req_vector(&self, name: &str, len: usize) -> Result<Vector, ModelError> {
        self.vector(name, len)?
            .ok_or_else(|| ModelError::MissingTensor { name: name.into() })
    }
}

/// The FFN activation of an architecture.
pub fn activation(arch: Arch) -> Activation {
    match arch {
        Arch::Gemma3 => Activation::GeGlu,
        Arch::Llama | Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen2Moe | Arch::Qwen3Moe => {
            Activation::SwiGlu
        }
    }
}

pub use ternfleet_node::shard::BLOB_TENSORS;

/// A layer's FFN as the expert backend holds it: the routed experts (or the one dense FFN),
/// then the shared expert if any.
pub type LayerFfn = Vec<FfnWeights>;

/// Loads the dense weights and, per layer, the FFN experts of `file` (one for a dense layer;
/// for an MoE layer the routed experts in order, then the shared expert if any). With
/// `routed_in_file` false (a bundle's coordinator part) the routed experts are left out: the
/// caller loads them from the expert blobs and puts them in front.
pub fn load(
    file: &Arc<GgufFile>,
    cfg: &ModelConfig,
    routed_in_file: bool,
) -> Result<(DenseWeights, Vec<LayerFfn>), ModelError> {
    let l = Loader { file };
    let d = cfg.n_embd;
    let token_embd = l.linear("token_embd.weight", d, cfg.n_vocab)?;
    let output = if file.tensor("output.weight").is_some() {
        l.linear("output.weight", d, cfg.n_vocab)?
    } else {
        token_embd.clone()
    };
    let output_norm = l.req_vector("output_norm.weight", d)?;
    let act = activation(cfg.arch);
    let mut layers = Vec::with_capacity(cfg.n_layer);
    let mut ffns = Vec::with_capacity(cfg.n_layer);
    for i in 0..cfg.n_layer {
        let n = |s: &str| format!("blk.{i}.{s}");
        let has_qk_norm = matches!(cfg.arch, Arch::Qwen3 | Arch::Gemma3 | Arch::Qwen3Moe);
        let has_post_norms = cfg.arch == Arch::Gemma3;
        let lw = LayerWeights {
            attn_norm: l.req_vector(&n("attn_norm.weight"), d)?,
            wq: l.linear(&n("attn_q.weight"), d, cfg.q_dim())?,
            wk: l.linear(&n("attn_k.weight"), d, cfg.k_dim())?,
            wv: l.linear(&n("attn_v.weight"), d, cfg.v_dim())?,
            bq: l.vector(&n("attn_q.bias"), cfg.q_dim())?,
            bk: l.vector(&n("attn_k.bias"), cfg.k_dim())?,
            bv: l.vector(&n("attn_v.bias"), cfg.v_dim())?,
            wo: l.linear(&n("attn_output.weight"), cfg.n_head * cfg.head_dim_v, d)?,
            bo: l.vector(&n("attn_output.bias"), d)?,
            q_norm: if has_qk_norm {
                Some(l.req_vector(&n("attn_q_norm.weight"), cfg.head_dim_k)?)
            } else {
                None
            },
            k_norm: if has_qk_norm {
                Some(l.req_vector(&n("attn_k_norm.weight"), cfg.head_dim_k)?)
            } else {
                None
            },
            post_attn_norm: if has_post_norms {
                Some(l.req_vector(&n("post_attention_norm.weight"), d)?)
            } else {
                None
            },
            ffn_norm: l.req_vector(&n("ffn_norm.weight"), d)?,
            post_ffn_norm: if has_post_norms {
                Some(l.req_vector(&n("post_ffw_norm.weight"), d)?)
            } else {
                None
            },
            router: None,
        };
        let mut lw = lw;
        let ffn = match &cfg.moe {
            None => vec![FfnWeights {
                gate: l.linear(&n("ffn_gate.weight"), d, cfg.n_ff)?,
                up: l.linear(&n("ffn_up.weight"), d, cfg.n_ff)?,
                down: l.linear(&n("ffn_down.weight"), cfg.n_ff, d)?,
                act,
                routed: false,
            }],
            Some(m) => {
                let (ne, ff) = (m.n_expert, m.n_ff_exp);
                let mut experts = Vec::with_capacity(ne + 1);
                for e in (0..ne).filter(|_| routed_in_file) {
                    experts.push(FfnWeights {
                        gate: l.stacked(&n("ffn_gate_exps.weight"), d, ff, ne, e)?,
                        up: l.stacked(&n("ffn_up_exps.weight"), d, ff, ne, e)?,
                        down: l.stacked(&n("ffn_down_exps.weight"), ff, d, ne, e)?,
                        act,
                        routed: true,
                    });
                }
                let mut shexp_gate = None;
                if let Some(sh) = m.n_ff_shexp {
                    experts.push(FfnWeights {
                        gate: l.linear(&n("ffn_gate_shexp.weight"), d, sh)?,
                        up: l.linear(&n("ffn_up_shexp.weight"), d, sh)?,
                        down: l.linear(&n("ffn_down_shexp.weight"), sh, d)?,
                        act,
                        routed: false,
                    });
                    shexp_gate = Some(l.f32_matrix(&n("ffn_gate_inp_shexp.weight"), d, 1)?);
                }
                let bias = match m.gating {
                    Gating::TopKUnit => l.vector(&n("ffn_gate_inp.bias"), ne)?,
                    Gating::Softmax | Gating::SoftmaxNorm => None,
                };
                lw.router = Some(Router::new(
                    d,
                    l.f32_matrix(&n("ffn_gate_inp.weight"), d, ne)?,
                    bias,
                    shexp_gate,
                ));
                experts
            }
        };
        layers.push(lw);
        ffns.push(ffn);
    }
    Ok((
        DenseWeights {
            token_embd,
            output_norm,
            output,
            layers,
        },
        ffns,
    ))
}
