//! Model hyperparameters read from GGUF metadata, and the registry of architectures.
//!
//! Key names and defaults follow llama.cpp (src/llama-arch.cpp `LLM_KV_*`, src/models/*.cpp
//! `load_arch_hparams`). Every value is checked against the tensors before a forward pass can
//! run, so the graph code can index without re-validating.

pub use ternfleet_shared::bundle::Gating;
use ternfleet_shared::gguf::{GgufError, GgufFile};

/// Errors while reading a model's configuration or weights.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("unsupported architecture {0:?} (supported: {list})", list = Arch::names())]
    UnsupportedArch(String),
    #[error("metadata key {key} is missing; the file was not written for architecture {arch}")]
    MissingKey { key: String, arch: &'static str },
    #[error("metadata key {key}: {msg}")]
    BadValue { key: String, msg: String },
    #[error("tensor {name} is missing")]
    MissingTensor { name: String },
    #[error("tensor {name}: dims {got:?}, expected {want:?}")]
    TensorShape {
        name: String,
        got: Vec<u64>,
        want: Vec<u64>,
    },
    #[error("tensor {name}: type {ty} is not supported here ({why})")]
    TensorType {
        name: String,
        ty: &'static str,
        why: &'static str,
    },
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Compute(#[from] ternfleet_shared::compute::ComputeError),
}

/// How rotary position embedding pairs up dimensions (llama.h `LLAMA_ROPE_TYPE_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeType {
    /// Adjacent pairs (x[2i], x[2i+1]): llama.
    Norm,
    /// Halves (x[i], x[i + n_rot/2]): gemma, qwen2, qwen3.
    Neox,
}

/// The architectures this engine runs. Each variant must have a config reader, a tensor loader
/// and a graph; `tests::every_arch_has_its_parts` checks it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// llama, and Mixtral-style MoE when `llama.expert_count` is set.
    Llama,
    Qwen2,
    Qwen3,
    Gemma3,
    /// Qwen1.5/Qwen2-MoE: routed experts plus a sigmoid-gated shared expert.
    Qwen2Moe,
    /// Qwen3-MoE: routed experts, top-k weights renormalised.
    Qwen3Moe,
}

impl Arch {
    /// Every supported architecture.
    pub const ALL: [Arch; 6] = [
        Arch::Llama,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::Gemma3,
        Arch::Qwen2Moe,
        Arch::Qwen3Moe,
    ];

    /// `general.architecture` value.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3",
            Arch::Qwen2Moe => "qwen2moe",
            Arch::Qwen3Moe => "qwen3moe",
        }
    }

    /// Parses `general.architecture`.
    pub fn from_name(s: &str) -> Result<Arch, ModelError> {
        Arch::ALL
            .iter()
            .copied()
            .find(|a| a.name() == s)
            .ok_or_else(|| ModelError::UnsupportedArch(s.to_string()))
    }

    fn names() -> String {
        Arch::ALL
            .iter()
            .map(|a| a.name())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// llama.cpp `llama_model_rope_type`.
    pub fn rope_type(self) -> RopeType {
        match self {
            Arch::Llama => RopeType::Norm,
            Arch::Qwen2 | Arch::Qwen3 | Arch::Gemma3 | Arch::Qwen2Moe | Arch::Qwen3Moe => {
                RopeType::Neox
            }
        }
    }
}

/// The routed-expert part of a Mixture-of-Experts model (llama.cpp `build_moe_ffn`).
///
/// Every architecture here gates with a softmax over all experts, picks the `n_expert_used`
/// most probable, and mixes their outputs with those probabilities; they differ in whether the
/// chosen probabilities are renormalised to sum to one and in the shared expert.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// Routed experts per layer (`{arch}.expert_count`).
    pub n_expert: usize,
    /// Experts each token uses (`{arch}.expert_used_count`).
    pub n_expert_used: usize,
    /// Intermediate width of one routed expert.
    pub n_ff_exp: usize,
    /// How router scores become expert weights.
    pub gating: Gating,
    /// Intermediate width of the shared expert (qwen2moe), gated per token by
    /// `sigmoid(ffn_gate_inp_shexp · x)`.
    pub n_ff_shexp: Option<usize>,
}

/// Hyperparameters of a dense transformer, validated.
#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub arch: Arch,
    pub n_vocab: usize,
    pub n_ctx_train: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    /// Per-head width of Q and K.
    pub head_dim_k: usize,
    /// Per-head width of V.
    pub head_dim_v: usize,
    pub n_ff: usize,
    pub rms_eps: f32,
    pub rope_type: RopeType,
    /// Rotated dimensions per head.
    pub n_rot: usize,
    pub rope_base: f32,
    pub rope_scale: f32,
    /// RoPE base of sliding-window layers (gemma3: 10 000).
    pub rope_base_swa: f32,
    /// Sliding window size of SWA layers (`None`: every layer is global).
    pub sliding_window: Option<usize>,
    /// Per layer: does it use the sliding window?
    pub is_swa: Vec<bool>,
    /// Multiplies the input embeddings (gemma: sqrt(n_embd)).
    pub embd_scale: f32,
    /// Multiplies Q before attention (gemma3: 1/sqrt(head_dim)); 1 otherwise.
    pub q_scale: f32,
    /// Scale of Q·K inside softmax (1/sqrt(head_dim) for llama/qwen; 1 for gemma3).
    pub kq_scale: f32,
    /// `tanh` soft-capping of the final logits, when set.
    pub final_logit_softcap: Option<f32>,
    /// Routed experts, for MoE models.
    pub moe: Option<MoeConfig>,
}

fn key(arch: Arch, k: &str) -> String {
    format!("{}.{k}", arch.name())
}

fn req_u32(f: &GgufFile, arch: Arch, k: &str) -> Result<usize, ModelError> {
    let k = key(arch, k);
    match f.get_u32(&k)? {
        Some(v) => Ok(v as usize),
        None => Err(ModelError::MissingKey {
            key: k,
            arch: arch.name(),
        }),
    }
}

fn opt_u32(f: &GgufFile, arch: Arch, k: &str) -> Result<Option<usize>, ModelError> {
    Ok(f.get_u32(&key(arch, k))?.map(|v| v as usize))
}

fn opt_f32(f: &GgufFile, arch: Arch, k: &str) -> Result<Option<f32>, ModelError> {
    Ok(f.get_f32(&key(arch, k))?)
}

/// Upper bounds far above any real model and far below anything that could overflow sizes.
const MAX_LAYERS: usize = 4096;
const MAX_DIM: usize = 1 << 20;

fn check_range(k: &str, v: usize, lo: usize, hi: usize) -> Result<usize, ModelError> {
    if v < lo || v > hi {
        return Err(ModelError::BadValue {
            key: k.to_string(),
            msg: format!("{v} is outside {lo}..={hi}"),
        });
    }
    Ok(v)
}

impl ModelConfig {
    /// Reads the configuration of `f`. Shapes are cross-checked against tensors by the loader.
    pub fn from_gguf(f: &GgufFile) -> Result<ModelConfig, ModelError> {
        let arch_name =
            f.get_str("general.architecture")?
                .ok_or_else(|| ModelError::MissingKey {
                    key: "general.architecture".into(),
                    arch: "any",
                })?;
        let arch = Arch::from_name(arch_name)?;
        let n_embd = check_range(
            "embedding_length",
            req_u32(f, arch, "embedding_length")?,
            1,
            MAX_DIM,
        )?;
        let n_layer = check_range(
            "block_count",
            req_u32(f, arch, "block_count")?,
            1,
            MAX_LAYERS,
        )?;
        let moe_arch = matches!(arch, Arch::Qwen2Moe | Arch::Qwen3Moe);
        // MoE models may leave out the dense width (llama.cpp reads it as optional there).
        let n_ff = match opt_u32(f, arch, "feed_forward_length")? {
            Some(v) => check_range("feed_forward_length", v, 1, MAX_DIM)?,
            None if moe_arch => 0,
            None => req_u32(f, arch, "feed_forward_length")?,
        };
        let n_head = check_range(
            "attention.head_count",
            req_u32(f, arch, "attention.head_count")?,
            1,
            4096,
        )?;
        let n_head_kv = check_range(
            "attention.head_count_kv",
            opt_u32(f, arch, "attention.head_count_kv")?.unwrap_or(n_head),
            1,
            n_head,
        )?;
        if n_head % n_head_kv != 0 {
            return Err(ModelError::BadValue {
                key: key(arch, "attention.head_count_kv"),
                msg: format!("{n_head} query heads are not a multiple of {n_head_kv} kv heads"),
            });
        }
        let head_dim_k = opt_u32(f, arch, "attention.key_length")?.unwrap_or(n_embd / n_head);
        let head_dim_v = opt_u32(f, arch, "attention.value_length")?.unwrap_or(n_embd / n_head);
        check_range("attention.key_length", head_dim_k, 2, 4096)?;
        check_range("attention.value_length", head_dim_v, 1, 4096)?;
        let n_rot = opt_u32(f, arch, "rope.dimension_count")?.unwrap_or(head_dim_k);
        if n_rot > head_dim_k || n_rot % 2 != 0 {
            return Err(ModelError::BadValue {
                key: key(arch, "rope.dimension_count"),
                msg: format!("{n_rot} must be even and at most the head width {head_dim_k}"),
            });
        }
        let rms_eps = opt_f32(f, arch, "attention.layer_norm_rms_epsilon")?.ok_or_else(|| {
            ModelError::MissingKey {
                key: key(arch, "attention.layer_norm_rms_epsilon"),
                arch: arch.name(),
            }
        })?;
        if !(rms_eps.is_finite() && rms_eps >= 0.0) {
            return Err(ModelError::BadValue {
                key: key(arch, "attention.layer_norm_rms_epsilon"),
                msg: format!("{rms_eps}"),
            });
        }
        let rope_base = opt_f32(f, arch, "rope.freq_base")?.unwrap_or(10_000.0);
        let rope_scale = match opt_f32(f, arch, "rope.scaling.factor")? {
            Some(s) if s > 0.0 => 1.0 / s,
            _ => 1.0,
        };
        if let Some(t) = f.get_str(&key(arch, "rope.scaling.type"))? {
            if t != "none" && t != "linear" {
                return Err(ModelError::BadValue {
                    key: key(arch, "rope.scaling.type"),
                    msg: format!("{t:?} is not supported yet (none, linear)"),
                });
            }
        }
        let n_ctx_train = opt_u32(f, arch, "context_length")?.unwrap_or(2048);
        let n_vocab = match f.tensor("token_embd.weight") {
            Some(t) if t.dims.len() >= 2 => usize::try_from(t.dims[1]).unwrap_or(usize::MAX),
            _ => {
                return Err(ModelError::MissingTensor {
                    name: "token_embd.weight".into(),
                })
            }
        };
        check_range("n_vocab (token_embd.weight dims[1])", n_vocab, 1, 1 << 24)?;

        let mut cfg = ModelConfig {
            arch,
            n_vocab,
            n_ctx_train,
            n_embd,
            n_layer,
            n_head,
            n_head_kv,
            head_dim_k,
            head_dim_v,
            n_ff,
            rms_eps,
            rope_type: arch.rope_type(),
            n_rot,
            rope_base,
            rope_scale,
            rope_base_swa: rope_base,
            sliding_window: None,
            is_swa: vec![false; n_layer],
            embd_scale: 1.0,
            q_scale: 1.0,
            kq_scale: 1.0 / (head_dim_k as f32).sqrt(),
            final_logit_softcap: None,
            moe: None,
        };
        cfg.moe = moe_config(f, arch, n_ff)?;
        if arch == Arch::Gemma3 {
            // src/models/gemma3.cpp load_arch_hparams: SWA pattern 6 (every 6th layer global),
            // SWA rope base 10 000 unless given, Q pre-scaled by 1/sqrt(head_dim) (27B: n_embd/n_head).
            if let Some(w) = opt_u32(f, arch, "attention.sliding_window")?.filter(|&w| w > 0) {
                cfg.sliding_window = Some(w);
                let pattern = opt_u32(f, arch, "attention.sliding_window_pattern")?.unwrap_or(6);
                cfg.is_swa = (0..n_layer)
                    .map(|il| pattern == 0 || il % pattern < pattern - 1)
                    .collect();
                cfg.rope_base_swa = opt_f32(f, arch, "rope.freq_base_swa")?.unwrap_or(10_000.0);
            }
            cfg.final_logit_softcap =
                opt_f32(f, arch, "final_logit_softcapping")?.filter(|&c| c != 0.0);
            cfg.embd_scale = (n_embd as f32).sqrt();
            let d = if n_layer == 62 {
                n_embd / n_head
            } else {
                head_dim_k
            };
            cfg.q_scale = 1.0 / (d as f32).sqrt();
            cfg.kq_scale = 1.0;
        }
        Ok(cfg)
    }

    /// Whether layer FFNs are routed experts.
    pub fn is_moe(&self) -> bool {
        self.moe.is_some()
    }

    /// Width of all query heads.
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim_k
    }
    /// Width of all key heads.
    pub fn k_dim(&self) -> usize {
        self.n_head_kv * self.head_dim_k
    }
    /// Width of all value heads.
    pub fn v_dim(&self) -> usize {
        self.n_head_kv * self.head_dim_v
    }
}

/// Reads the expert hyperparameters (src/llama-model.cpp `load_hparams`, src/models/*.cpp).
fn moe_config(f: &GgufFile, arch: Arch, n_ff: usize) -> Result<Option<MoeConfig>, ModelError> {
    let n_expert = opt_u32(f, arch, "expert_count")?.unwrap_or(0);
    let moe_arch = matches!(arch, Arch::Qwen2Moe | Arch::Qwen3Moe);
    if n_expert == 0 {
        if moe_arch {
            return Err(ModelError::MissingKey {
                key: key(arch, "expert_count"),
                arch: arch.name(),
            });
        }
        return Ok(None);
    }
    let n_expert = check_range(&key(arch, "expert_count"), n_expert, 1, 1 << 16)?;
    let k_used = key(arch, "expert_used_count");
    let n_expert_used = match f.get_u32(&k_used) {
        Ok(Some(v)) => v as usize,
        Ok(None) => {
            return Err(ModelError::MissingKey {
                key: k_used,
                arch: arch.name(),
            })
        }
        Err(_) => {
            return Err(ModelError::BadValue {
                key: k_used,
                msg: "must be one integer (per-layer expert counts are not supported)".into(),
            })
        }
    };
    check_range(&k_used, n_expert_used, 1, n_expert)?;
    let (n_ff_exp, gating, n_ff_shexp) = match arch {
        // Mixtral: experts as wide as the dense FFN, weights renormalised.
        Arch::Llama => (n_ff, Gating::SoftmaxNorm, None),
        Arch::Qwen3Moe | Arch::Qwen2Moe => {
            let exp = match opt_u32(f, arch, "expert_feed_forward_length")? {
                Some(v) => v,
                None => n_ff / n_expert_used,
            };
            let exp = check_range(&key(arch, "expert_feed_forward_length"), exp, 1, MAX_DIM)?;
            if arch == Arch::Qwen3Moe {
                (exp, Gating::SoftmaxNorm, None)
            } else {
                let sh = match opt_u32(f, arch, "expert_shared_feed_forward_length")? {
                    Some(v) => v,
                    None => n_ff,
                };
                let sh = check_range(
                    &key(arch, "expert_shared_feed_forward_length"),
                    sh,
                    1,
                    MAX_DIM,
                )?;
                (exp, Gating::Softmax, Some(sh))
            }
        }
        Arch::Qwen2 | Arch::Qwen3 | Arch::Gemma3 => {
            return Err(ModelError::BadValue {
                key: key(arch, "expert_count"),
                msg: format!("{} has no mixture-of-experts variant", arch.name()),
            })
        }
    };
    Ok(Some(MoeConfig {
        n_expert,
        n_expert_used,
        n_ff_exp,
        gating,
        n_ff_shexp,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_arch_has_its_parts() {
        for a in Arch::ALL {
            assert_eq!(Arch::from_name(a.name()).ok(), Some(a));
            // Each architecture names its tensors in the loader and has a rope type.
            let _ = a.rope_type();
            let plan = crate::model::weights::layer_tensor_plan(a);
            assert!(
                plan.contains(&"ffn_down") || plan.contains(&"ffn_down_exps"),
                "{a:?} has no FFN plan"
            );
        }
        assert!(matches!(
            Arch::from_name("mamba"),
            Err(ModelError::UnsupportedArch(_))
        ));
    }
}
