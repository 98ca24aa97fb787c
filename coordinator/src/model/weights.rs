//! The dense part of a model (everything but the FFN experts), bound to a mapped GGUF file, and
//! the FFN weights handed to the expert backend.

use std::sync::Arc;

use ternfleet_kernels::GgmlType;
use ternfleet_node::compute::Linear;
use ternfleet_node::expert::{Activation, FfnWeights};
use ternfleet_shared::gguf::GgufFile;

use super::config::{Arch, ModelConfig, ModelError};

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

    fn req_vector(&self, name: &str, len: usize) -> Result<Vector, ModelError> {
        self.vector(name, len)?
            .ok_or_else(|| ModelError::MissingTensor { name: name.into() })
    }
}

/// Loads the dense weights and the per-layer FFN weights of `file`.
pub fn load(
    file: &Arc<GgufFile>,
    cfg: &ModelConfig,
) -> Result<(DenseWeights, Vec<FfnWeights>), ModelError> {
    let l = Loader { file };
    let d = cfg.n_embd;
    let token_embd = l.linear("token_embd.weight", d, cfg.n_vocab)?;
    let output = if file.tensor("output.weight").is_some() {
        l.linear("output.weight", d, cfg.n_vocab)?
    } else {
        token_embd.clone()
    };
    let output_norm = l.req_vector("output_norm.weight", d)?;
    let act = match cfg.arch {
        Arch::Gemma3 => Activation::GeGlu,
        Arch::Llama | Arch::Qwen2 | Arch::Qwen3 => Activation::SwiGlu,
    };
    let mut layers = Vec::with_capacity(cfg.n_layer);
    let mut ffns = Vec::with_capacity(cfg.n_layer);
    for i in 0..cfg.n_layer {
        let n = |s: &str| format!("blk.{i}.{s}");
        let has_qk_norm = matches!(cfg.arch, Arch::Qwen3 | Arch::Gemma3);
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
        };
        let ffn = FfnWeights {
            gate: l.linear(&n("ffn_gate.weight"), d, cfg.n_ff)?,
            up: l.linear(&n("ffn_up.weight"), d, cfg.n_ff)?,
            down: l.linear(&n("ffn_down.weight"), cfg.n_ff, d)?,
            act,
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
