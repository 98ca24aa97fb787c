//! The expert FFN executor and the in-process expert backend.
//!
//! [`FfnWeights`] / [`run_ffn`] compute one expert (gate/up → activation → down) over the rows
//! routed to it; [`LocalExperts`] holds every expert of every layer in this process and
//! implements `ternfleet_shared::expert::ExpertBackend`, the interface the coordinator calls (a
//! node serving its shard over QUIC wraps the same executor).

use half::f16;
use rayon::prelude::*;
use ternfleet_kernels::{Activations, GgmlType, Numerics};
use ternfleet_shared::compute::{forward_pair, quantize_par, ComputeError, Linear};
use ternfleet_shared::expert::{ExpertBackend, ExpertBatch, ExpertError, InFlight, Ready, Route};

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
    /// A routed expert of an MoE layer. llama.cpp runs those through `MUL_MAT_ID`: repacked
    /// q4_K weights one token at a time (the GEMV's order) however many tokens the expert
    /// gets, other types as a matmul of the expert's rows (tiled q5_K/q6_K from 8 rows);
    /// dense FFNs and shared experts batch tokens as usual.
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

    /// Reads the three matrices into memory now ([`ternfleet_shared::compute::populate`]): a
    /// node serving from mappings is then resident when it says ready.
    pub fn populate(&self) -> std::io::Result<()> {
        for lin in [&self.gate, &self.up, &self.down] {
            ternfleet_shared::compute::populate(lin.data())?;
        }
        Ok(())
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

/// The activations of `x`'s rows for `w`: `x` itself when it already has `w`'s dot type,
/// else `x`'s f32 rows quantized into `scratch`.
fn input_for<'a>(
    w: &Linear,
    x: &'a Activations,
    scratch: &'a mut Activations,
) -> Result<&'a Activations, ComputeError> {
    let want = ternfleet_kernels::vec_dot_type(w.ty());
    if Some(x.ty()) == want {
        return Ok(x);
    }
    if x.ty() != GgmlType::F32 {
        return Err(ComputeError::Shape(format!(
            "{}: activations are {:?}, its kernel reads {want:?}",
            w.name(),
            x.ty()
        )));
    }
    let f: Vec<f32> = x
        .bytes()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    quantize_par(scratch, w.ty(), &f, x.n(), x.cols())?;
    Ok(scratch)
}

/// `out = W x` for every row of `x`. In parity mode a routed expert follows llama.cpp's
/// `MUL_MAT_ID` (see [`FfnWeights::routed`]): [`Numerics::Routed`], still one GEMM over the
/// expert's rows.
fn project(
    w: &Linear,
    x: &Activations,
    routed: bool,
    numerics: Numerics,
    out: &mut [f32],
) -> Result<(), ComputeError> {
    w.forward(x, out, expert_numerics(routed, numerics))
}

/// The float order of a routed expert's matmuls in `numerics` (see [`project`]).
fn expert_numerics(routed: bool, numerics: Numerics) -> Numerics {
    if routed && numerics == Numerics::Parity {
        Numerics::Routed
    } else {
        numerics
    }
}

/// Runs one FFN over the rows of `x` (quantized for the gate and up matrices, or f32),
/// writing `rows × n_embd` into `out`.
pub fn run_ffn(
    w: &FfnWeights,
    x: &Activations,
    numerics: Numerics,
    out: &mut [f32],
) -> Result<(), ComputeError> {
    let (n, d, ff) = (x.n(), w.n_embd(), w.n_ff());
    if x.cols() != d || out.len() != n * d {
        return Err(ComputeError::Shape(format!(
            "FFN of width {d}: input rows of {} values, output {} floats for {n} rows",
            x.cols(),
            out.len()
        )));
    }
    let mut scratch = Activations::new();
    let mut g = vec![0f32; n * ff];
    let mut u = vec![0f32; n * ff];
    if w.gate.ty() == w.up.ty() {
        // One input for both (repacked TF1 builds its activation tables once for the pair).
        let xi = input_for(&w.gate, x, &mut scratch)?;
        let numerics = expert_numerics(w.routed, numerics);
        forward_pair(&w.gate, &w.up, xi, &mut g, &mut u, numerics)?;
    } else {
        project(
            &w.gate,
            input_for(&w.gate, x, &mut scratch)?,
            w.routed,
            numerics,
            &mut g,
        )?;
        project(
            &w.up,
            input_for(&w.up, x, &mut scratch)?,
            w.routed,
            numerics,
            &mut u,
        )?;
    }
    dump("ffn_gate", &g, ff);
    dump("ffn_up", &u, ff);
    // Row by row, as ggml applies its fused activations (`ggml_vec_swiglu_f32` per row): the
    // vector/tail split of SwiGLU then never depends on how many rows share the call.
    for (g, u) in g.chunks_exact_mut(ff).zip(u.chunks_exact(ff)) {
        apply_activation(w.act, g, u);
    }
    dump("ffn_act", &g, ff);
    let mut act = Activations::new();
    quantize_par(&mut act, w.down.ty(), &g, n, ff)?;
    project(&w.down, &act, w.routed, numerics, out)?;
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

    /// Experts held for `layer` (0 past the last layer).
    pub fn layer_len(&self, layer: usize) -> usize {
        self.layers.get(layer).map_or(0, Vec::len)
    }
}

impl LocalExperts {
    fn layer(&self, layer: usize) -> Result<&[FfnWeights], ExpertError> {
        let experts = self.layers.get(layer).ok_or(ExpertError::NoLayer {
            layer,
            n_layers: self.layers.len(),
        })?;
        if experts.is_empty() {
            return Err(ExpertError::NoExpert {
                layer,
                expert: 0,
                n_experts: 0,
            });
        }
        Ok(experts)
    }

    /// Checks a batch against the layer it names: input width and type, routes in range.
    pub fn check(&self, b: &ExpertBatch<'_>) -> Result<(), ExpertError> {
        let layer = b.layer;
        let experts = self.layer(layer)?;
        let d = experts[0].n_embd();
        let want = self.input_type(layer)?;
        let n_tokens = b.n_tokens();
        // f32 rows are always accepted: each matrix then quantizes them for itself, exactly
        // as for a layer whose experts read different types (a node holding some of a
        // layer's experts may see f32 where its own experts agree on a type).
        if b.input.cols() != d || (b.input.ty() != want && b.input.ty() != GgmlType::F32) {
            return Err(ExpertError::BadInput {
                layer,
                n_tokens,
                cols: b.input.cols(),
                ty: b.input.ty(),
                n_embd: d,
                want,
            });
        }
        check_routes(layer, b.routes, n_tokens, experts.len())
    }

    /// Runs a batch now: each route's expert output, in route order.
    pub fn run(&self, b: &ExpertBatch<'_>) -> Result<Vec<f32>, ExpertError> {
        self.check(b)?;
        let layer = b.layer;
        let experts = self.layer(layer)?;
        let d = experts[0].n_embd();
        let n_tokens = b.n_tokens();
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
        let compute = |source| ExpertError::Compute { layer, source };
        let outputs: Vec<Vec<f32>> = active
            .par_iter()
            .map(|&(e, mine)| {
                let n = mine.len();
                let mut y = vec![0f32; n * d];
                // Every token in batch order: use the input as it is (the dense case).
                let identity = n == n_tokens
                    && mine
                        .iter()
                        .enumerate()
                        .all(|(i, &r)| b.routes[r].token as usize == i);
                if identity {
                    run_ffn(&experts[e], b.input, b.numerics, &mut y)?;
                } else {
                    let rows: Vec<usize> =
                        mine.iter().map(|&r| b.routes[r].token as usize).collect();
                    let mut x = Activations::new();
                    x.gather(b.input, &rows);
                    run_ffn(&experts[e], &x, b.numerics, &mut y)?;
                }
                Ok(y)
            })
            .collect::<Result<_, ComputeError>>()
            .map_err(compute)?;
        let mut ys = vec![0f32; b.routes.len() * d];
        for ((_, mine), y) in active.iter().zip(&outputs) {
            for (i, &r) in mine.iter().enumerate() {
                ys[r * d..(r + 1) * d].copy_from_slice(&y[i * d..(i + 1) * d]);
            }
        }
        Ok(ys)
    }
}

/// Every route names a row of the batch and an expert of the layer.
fn check_routes(
    layer: usize,
    routes: &[Route],
    n_tokens: usize,
    n_experts: usize,
) -> Result<(), ExpertError> {
    for r in routes {
        if r.token as usize >= n_tokens {
            return Err(ExpertError::BadToken {
                layer,
                token: r.token,
                n_tokens,
            });
        }
        if r.expert as usize >= n_experts {
            return Err(ExpertError::NoExpert {
                layer,
                expert: r.expert,
                n_experts,
            });
        }
    }
    Ok(())
}

impl ExpertBackend for LocalExperts {
    /// The gate's dot type when every expert of the layer reads the same one for gate and up,
    /// else f32 (each matrix then quantizes for itself).
    fn input_type(&self, layer: usize) -> Result<GgmlType, ExpertError> {
        let experts = self.layer(layer)?;
        let dot = |w: &Linear| ternfleet_kernels::vec_dot_type(w.ty());
        let first = dot(&experts[0].gate);
        let same = experts
            .iter()
            .all(|e| dot(&e.gate) == first && dot(&e.up) == first);
        Ok(match (same, first) {
            (true, Some(t)) => t,
            _ => GgmlType::F32,
        })
    }

    /// Computes the batch on this process's rayon pool before returning (nothing to overlap
    /// in process); the result waits in the returned handle.
    fn submit(&self, batch: &ExpertBatch<'_>) -> Result<Box<dyn InFlight>, ExpertError> {
        Ok(Box::new(Ready(self.run(batch))))
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
