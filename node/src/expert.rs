//! The expert backend: the one interface through which a layer's FFN runs.
//!
//! DESIGN.md "Interfaces worth keeping stable": run a layer's expert batch, accept prefetch
//! hints, report health. The coordinator groups (token, expert, weight) routes and calls
//! [`ExpertBackend::run`]; the backend adds `weight * FFN_expert(hidden[token])` into the output
//! row of each token. A dense model is one expert per layer that every token selects with
//! weight 1, so the dense path and the MoE path are the same code.

use half::f16;
use rayon::prelude::*;
use ternfleet_kernels::{Activations, GgmlType};

use crate::compute::{quantize_par, ComputeError, Linear};

/// One (token, expert, weight) selection made by a router.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Route {
    /// Row of the batch's hidden matrix.
    pub token: u32,
    /// Expert index within the layer.
    pub expert: u32,
    /// Mixing weight of this expert's output for this token.
    pub weight: f32,
}

/// A layer's worth of FFN work for a batch of tokens.
#[derive(Clone, Copy, Debug)]
pub struct ExpertBatch<'a> {
    /// Layer index.
    pub layer: usize,
    /// `n_tokens × n_embd` inputs (already normalised by the coordinator).
    pub hidden: &'a [f32],
    /// Rows in `hidden`.
    pub n_tokens: usize,
    /// Selections. Each token sums its expert outputs in this order.
    pub routes: &'a [Route],
}

/// Health as seen by the coordinator's scheduler.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Health {
    /// Serving.
    Ready,
    /// Loading; `done` of `total` bytes resident.
    Loading { done: u64, total: u64 },
    /// Not serving, with a reason.
    Unavailable(String),
}

/// Errors of an expert backend.
#[derive(Debug, thiserror::Error)]
pub enum ExpertError {
    #[error("layer {layer}: no such layer (the backend holds {n_layers})")]
    NoLayer { layer: usize, n_layers: usize },
    #[error("layer {layer}: expert {expert} not held here (layer has {n_experts})")]
    NoExpert {
        layer: usize,
        expert: u32,
        n_experts: usize,
    },
    #[error("layer {layer}: route names token {token} but the batch has {n_tokens} tokens")]
    BadToken {
        layer: usize,
        token: u32,
        n_tokens: usize,
    },
    #[error("layer {layer}: hidden has {got} floats, expected {n_tokens} x {n_embd}")]
    BadHidden {
        layer: usize,
        got: usize,
        n_tokens: usize,
        n_embd: usize,
    },
    #[error(transparent)]
    Compute(#[from] ComputeError),
}

/// Runs expert FFNs for the coordinator (in process, or over QUIC in a later issue).
pub trait ExpertBackend: Send + Sync {
    /// Adds `weight * FFN_{layer,expert}(hidden[token])` into `out[token]` for every route,
    /// in the order of `routes` (so the coordinator decides the order of each token's sum).
    /// `out` is `n_tokens × n_embd`.
    fn run(&self, batch: &ExpertBatch<'_>, out: &mut [f32]) -> Result<(), ExpertError>;
    /// Hint that these experts of `layer` will be needed soon. Fire and forget.
    fn prefetch(&self, _layer: usize, _experts: &[u32]) {}
    /// Current health.
    fn health(&self) -> Health {
        Health::Ready
    }
}

/// The FFN activation between gate and up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `silu(gate) * up` (llama, qwen).
    SwiGlu,
    /// `gelu_tanh(gate) * up` with ggml's f16-table GELU (gemma).
    GeGlu,
}

/// The weights of one expert (or of a dense FFN).
#[derive(Clone, Debug)]
pub struct FfnWeights {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
    pub act: Activation,
    /// A routed expert of an MoE layer. llama.cpp runs those through `MUL_MAT_ID`, which
    /// multiplies repacked q4_K weights one token at a time (its GEMV float order) however
    /// many tokens the expert gets; dense FFNs and shared experts batch tokens as usual.
    pub routed: bool,
}

impl FfnWeights {
    /// Input width.
    pub fn n_embd(&self) -> usize {
        self.up.cols()
    }
    /// Intermediate width.
    pub fn n_ff(&self) -> usize {
        self.up.rows()
    }
}

/// ggml's tanh-GELU constants (ggml-cpu/vec.h `GELU_COEF_A`, `SQRT_2_OVER_PI`).
const GELU_COEF_A: f32 = 0.044715;
const SQRT_2_OVER_PI: f32 = 0.797_884_6;

/// `ggml_gelu_f32` as GCC compiles it (`-ffp-contract=fast` turns `1 + A·x·x` into
/// `fma(A·x, x, 1)`; without that one table entry of 65536 differs by an f16 step).
fn gelu_f32(x: f32) -> f32 {
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (GELU_COEF_A * x).mul_add(x, 1.0)).tanh())
}

/// ggml evaluates GELU through a 64 Ki-entry f16 table (vec.h `GGML_GELU_FP16`,
/// `ggml_vec_geglu_f32`): round x to f16, look up f16(gelu(x)). We reproduce it for parity.
fn gelu_table() -> &'static [f32] {
    static TABLE: std::sync::OnceLock<Vec<f32>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|b| f16::from_f32(gelu_f32(f16::from_bits(b).to_f32())).to_f32())
            .collect()
    })
}

/// `h = act(g) * u` elementwise, in place in `g`.
pub fn apply_activation(act: Activation, g: &mut [f32], u: &[f32]) {
    match act {
        Activation::SwiGlu => ternfleet_kernels::swiglu(g, u),
        Activation::GeGlu => {
            let table = gelu_table();
            for (g, u) in g.iter_mut().zip(u) {
                let x = *g;
                *g = if x <= -10.0 {
                    0.0
                } else if x >= 10.0 {
                    x * u
                } else {
                    table[f16::from_f32(x).to_bits() as usize] * u
                };
            }
        }
    }
}

/// `out = W x` for `n` rows of `x`, one token at a time when `per_token` asks for the GEMV
/// order of a repacked q4_K expert (see [`FfnWeights::routed`]).
fn project(
    w: &Linear,
    act: &mut Activations,
    x: &[f32],
    n: usize,
    per_token: bool,
    out: &mut [f32],
) -> Result<(), ComputeError> {
    let (cols, rows) = (w.cols(), w.rows());
    let gemv_only = per_token && matches!(w.ty(), GgmlType::Q4_K | GgmlType::Q5_K);
    if !gemv_only || n == 1 {
        quantize_par(act, w.ty(), x, n, cols)?;
        return w.forward(act, out);
    }
    for (xr, or) in x.chunks_exact(cols).zip(out.chunks_exact_mut(rows)) {
        quantize_par(act, w.ty(), xr, 1, cols)?;
        w.forward(act, or)?;
    }
    Ok(())
}

/// Runs one FFN over `n` rows of `x` (`n × n_embd`), writing `n × n_embd` into `out`.
pub fn run_ffn(w: &FfnWeights, x: &[f32], n: usize, out: &mut [f32]) -> Result<(), ComputeError> {
    let (d, ff) = (w.n_embd(), w.n_ff());
    let mut act = Activations::new();
    let mut g = vec![0f32; n * ff];
    let mut u = vec![0f32; n * ff];
    project(&w.gate, &mut act, x, n, w.routed, &mut g)?;
    project(&w.up, &mut act, x, n, w.routed, &mut u)?;
    dump("ffn_gate", &g, ff);
    dump("ffn_up", &u, ff);
    apply_activation(w.act, &mut g, &u);
    dump("ffn_act", &g, ff);
    project(&w.down, &mut act, &g, n, w.routed, out)?;
    dump("ffn_down", out, d);
    Ok(())
}

/// The in-process backend: every expert of every layer, executed on this machine's threads.
pub struct LocalExperts {
    layers: Vec<Vec<FfnWeights>>,
}

impl LocalExperts {
    /// `layers[l][e]` is expert `e` of layer `l`.
    pub fn new(layers: Vec<Vec<FfnWeights>>) -> LocalExperts {
        LocalExperts { layers }
    }

    /// Number of layers held.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }
}

impl ExpertBackend for LocalExperts {
    fn run(&self, b: &ExpertBatch<'_>, out: &mut [f32]) -> Result<(), ExpertError> {
        let layer = b.layer;
        let experts = self.layers.get(layer).ok_or(ExpertError::NoLayer {
            layer,
            n_layers: self.layers.len(),
        })?;
        let Some(first) = experts.first() else {
            return Err(ExpertError::NoExpert {
                layer,
                expert: 0,
                n_experts: 0,
            });
        };
        let d = first.n_embd();
        if b.hidden.len() != b.n_tokens * d || out.len() != b.n_tokens * d {
            return Err(ExpertError::BadHidden {
                layer,
                got: b.hidden.len(),
                n_tokens: b.n_tokens,
                n_embd: d,
            });
        }
        for r in b.routes {
            if r.token as usize >= b.n_tokens {
                return Err(ExpertError::BadToken {
                    layer,
                    token: r.token,
                    n_tokens: b.n_tokens,
                });
            }
            if r.expert as usize >= experts.len() {
                return Err(ExpertError::NoExpert {
                    layer,
                    expert: r.expert,
                    n_experts: experts.len(),
                });
            }
        }
        // Each route's expert output, then the sums in route order: llama.cpp adds a token's
        // expert outputs slot by slot in router order (shared expert last), and float addition
        // is not associative.
        // The experts this batch uses, with the routes each serves. They run in parallel:
        // small expert matmuls split across threads cost more in joins than they save.
        let mut mine: Vec<Vec<usize>> = vec![Vec::new(); experts.len()];
        for (i, r) in b.routes.iter().enumerate() {
            mine[r.expert as usize].push(i);
        }
        let active: Vec<(usize, &Vec<usize>)> = mine
            .iter()
            .enumerate()
            .filter(|(_, m)| !m.is_empty())
            .collect();
        let outputs: Vec<Vec<f32>> = active
            .par_iter()
            .map(|&(e, mine)| {
                let n = mine.len();
                let mut y = vec![0f32; n * d];
                // Every token in batch order: use the hidden matrix as it is (the dense case).
                let identity = n == b.n_tokens
                    && mine
                        .iter()
                        .enumerate()
                        .all(|(i, &r)| b.routes[r].token as usize == i);
                if identity {
                    run_ffn(&experts[e], b.hidden, n, &mut y)?;
                } else {
                    let mut x = Vec::with_capacity(n * d);
                    for &r in mine {
                        let t = b.routes[r].token as usize;
                        x.extend_from_slice(&b.hidden[t * d..(t + 1) * d]);
                    }
                    run_ffn(&experts[e], &x, n, &mut y)?;
                }
                Ok(y)
            })
            .collect::<Result<_, ComputeError>>()?;
        let mut ys = vec![0f32; b.routes.len() * d];
        for ((_, mine), y) in active.iter().zip(&outputs) {
            for (i, &r) in mine.iter().enumerate() {
                ys[r * d..(r + 1) * d].copy_from_slice(&y[i * d..(i + 1) * d]);
            }
        }
        for (r, y) in b.routes.iter().zip(ys.chunks_exact(d)) {
            let t = r.token as usize;
            let dst = &mut out[t * d..(t + 1) * d];
            if r.weight == 1.0 {
                dst.iter_mut().zip(y).for_each(|(o, v)| *o += v);
            } else {
                // `ggml_mul` then `ggml_add`: two roundings, no FMA.
                dst.iter_mut().zip(y).for_each(|(o, v)| *o += r.weight * v);
            }
        }
        Ok(())
    }
}

/// Debugging aid: with `TERNFLEET_DUMP=1`, prints statistics of the last row of an activation
/// in the format of `benches/ref/ref-dump.cpp` (llama.cpp's tensors), so the two engines can be
/// diffed layer by layer. Off by default; costs one relaxed load when off.
pub fn dump(name: &str, x: &[f32], width: usize) {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if !*ON.get_or_init(|| std::env::var_os("TERNFLEET_DUMP").is_some())
        || width == 0
        || x.len() < width
    {
        return;
    }
    let r = &x[x.len() - width..];
    let s: f64 = r.iter().map(|&v| v as f64).sum();
    let sa: f64 = r.iter().map(|&v| v.abs() as f64).sum();
    let all: f64 = x.iter().map(|&v| v.abs() as f64).sum();
    let at = |i: usize| r.get(i).copied().unwrap_or(0.0);
    eprintln!(
        "{name:<24} [{width}] all-abs {all:.9} last-row sum {s:.9} abs {sa:.9} first {:.9} {:.9} {:.9} {:.9}",
        at(0),
        at(1),
        at(2),
        at(3)
    );
    if std::env::var_os("DUMP_ROWS").is_some() {
        let rows: Vec<String> = x
            .chunks(width)
            .take(16)
            .map(|r| format!("{:.7}", r.iter().map(|v| v.abs() as f64).sum::<f64>()))
            .collect();
        eprintln!("  rows: {}", rows.join(" "));
        if let Some(q) = std::env::var("DUMP_ROW")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
        {
            if let Some(r) = x.chunks(width).nth(q) {
                let v: Vec<String> = r.iter().map(|v| format!("{v:.8e}")).collect();
                eprintln!("  row {q}: {}", v.join(" "));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gelu_table_matches_ggml_definition_at_f16_points() {
        // For inputs exactly representable in f16 the table is f16(gelu(x)).
        for x in [-3.0f32, -0.5, 0.0, 0.25, 1.0, 2.5, 9.5] {
            let mut g = [x];
            apply_activation(Activation::GeGlu, &mut g, &[1.0]);
            assert_eq!(g[0], f16::from_f32(gelu_f32(x)).to_f32(), "x={x}");
        }
        let mut g = [-11.0f32, 12.0];
        apply_activation(Activation::GeGlu, &mut g, &[2.0, 2.0]);
        assert_eq!(g, [0.0, 24.0]);
    }

    #[test]
    fn swiglu_is_silu_times_up() {
        let mut g = [1.0f32, -2.0];
        apply_activation(Activation::SwiGlu, &mut g, &[3.0, 0.5]);
        let silu = |x: f32| x / (1.0 + (-x).exp());
        assert!((g[0] - silu(1.0) * 3.0).abs() < 1e-6);
        assert!((g[1] - silu(-2.0) * 0.5).abs() < 1e-6);
    }
}
