//! ternfleet-kernels: the pure compute under the engine — ggml tensor formats, dequantization,
//! activation quantization, and quantized matrix products on the CPU.
//!
//! What flows in: weight bytes exactly as they lie in a GGUF file (borrowed, typically from a
//! memory map) and f32 activations. What flows out: f32 results. No I/O, no threads, no logging;
//! the caller (the coordinator's executor) splits work across its rayon pool.
//!
//! Principal types:
//! - [`GgmlType`]: the registry of element types (ids, block geometry).
//! - [`QMatrix`]: a borrowed, size-checked quantized weight matrix.
//! - [`Activations`]: reusable activation rows quantized to a weight type's [`vec_dot_type`].
//! - [`Isa`]: which implementation runs, chosen once from CPU features ([`isa`]), overridable
//!   with `TERNFLEET_KERNELS=scalar|avx2|avx512`.
//!
//! Invariants: every public function validates sizes once at the top and returns a
//! [`KernelError`] naming the sizes and types; the per-ISA kernels then run unchecked loops.
//! Numerics follow ggml (`ggml-quants.c`, `ggml-cpu/quants.c`): the same activation
//! quantization (bit-exact with the `_ref` quantizers) and the same integer dot products per
//! block; only the order of f32 accumulation differs between ISAs. The scalar module is the
//! reference that every SIMD kernel is tested against. `unsafe` lives only in `x86_64/`.

mod dispatch;
/// ggml's IQ lookup tables, as data (MIT, the ggml authors): see the module's header.
#[rustfmt::skip]
pub mod iq_grids;
mod matmul;
pub mod quant;
mod scalar;
mod ternary;
pub mod tf1_lut;
#[cfg(target_arch = "x86_64")]
mod x86_64;

pub use dispatch::{isa, isa_name, isa_note, Isa};
pub use matmul::{is_activation_type, Activations, QMatrix};

/// Which float order a matmul (and everything above it) follows.
///
/// ggml changes the order in which some weight types sum a dot product with the number of
/// tokens in the batch (q4_K: the repacked GEMM for whole groups of four tokens, the GEMV for
/// the rest; q6_K: the tiled kernel from eight tokens on), so a row's result depends on what
/// shares its batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Numerics {
    /// llama.cpp's orders, which change with the batch (the CLI default; parity tests).
    #[default]
    Parity,
    /// Every token row summed in the single-token (GEMV) order whatever the batch holds, so a
    /// row's result never depends on the other rows (the server default). Multi-token calls
    /// stay GEMMs: each weight block is still unpacked once for several tokens.
    Invariant,
    /// llama.cpp's `MUL_MAT_ID` orders, the parity order of a routed expert over the rows
    /// routed to it: weights it repacks (q4_K) sum every token in their one-token GEMV order,
    /// however many tokens the expert gets; the rest as a plain matmul of those rows (q5_K,
    /// q6_K: the tiled order from 8 rows, `vec_dot` below). Internal: not a `--numerics`
    /// choice.
    Routed,
}

impl Numerics {
    /// `parity` or `invariant`.
    pub fn name(self) -> &'static str {
        match self {
            Numerics::Parity => "parity",
            Numerics::Invariant => "invariant",
            Numerics::Routed => "routed",
        }
    }
}

impl std::str::FromStr for Numerics {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "parity" => Ok(Numerics::Parity),
            "invariant" => Ok(Numerics::Invariant),
            _ => Err(format!("numerics {s:?}: expected parity or invariant")),
        }
    }
}
pub use quant::{GgmlType, QK, QK_K};

/// What went wrong, with the sizes and types involved.
#[derive(thiserror::Error, Debug, Clone, PartialEq, Eq)]
pub enum KernelError {
    #[error("{ty:?}: {cols} elements is not a whole number of {block}-element blocks")]
    PartialBlock {
        ty: GgmlType,
        cols: usize,
        block: usize,
    },
    #[error("{ty:?} matrix of {rows} rows x {cols} columns needs {want} bytes, got {got}")]
    MatrixSize {
        ty: GgmlType,
        rows: usize,
        cols: usize,
        want: usize,
        got: usize,
    },
    #[error("{ty:?} tensor of {rows} rows x {cols} columns: byte size overflows usize")]
    TooLarge {
        ty: GgmlType,
        rows: usize,
        cols: usize,
    },
    #[error("{ty:?} is not supported by {op} (matmul supports F32, F16, BF16, Q8_0, Q4_0, Q5_0, Q4_1, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, TQ1_0, TQ2_0, TF2, TF1)")]
    Unsupported { ty: GgmlType, op: &'static str },
    #[error("{what}: expected {want} elements, got {got}")]
    InputLen {
        what: &'static str,
        want: usize,
        got: usize,
    },
    #[error("{ty:?}: {n} elements take {want} bytes, got {got}")]
    RowBytes {
        ty: GgmlType,
        n: usize,
        want: usize,
        got: usize,
    },
    #[error("activations are {got:?} but {weight:?} weights need {want:?}: call Activations::quantize_for({weight:?}, ..)")]
    ActivationType {
        weight: GgmlType,
        want: GgmlType,
        got: GgmlType,
    },
    #[error("weight matrix has {weight} columns but the activations have {act}")]
    ColsMismatch { weight: usize, act: usize },
    #[error("row range {start}..{end} is outside a matrix of {rows} rows")]
    RowRange {
        start: usize,
        end: usize,
        rows: usize,
    },
    #[error("kernels for {isa:?} are not available on this CPU")]
    IsaUnavailable { isa: Isa },
}

/// The activation type ggml pairs with a weight type for its dot product (ggml-cpu.c
/// `type_traits_cpu[..].vec_dot_type`). `None` for weight types [`matmul`] does not support.
pub fn vec_dot_type(w: GgmlType) -> Option<GgmlType> {
    Some(match w {
        GgmlType::F32 => GgmlType::F32,
        GgmlType::F16 => GgmlType::F16,
        GgmlType::BF16 => GgmlType::BF16,
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::IQ4_NL => GgmlType::Q8_0,
        GgmlType::Q4_1 | GgmlType::Q5_1 => GgmlType::Q8_1,
        GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => GgmlType::Q8_K,
        GgmlType::Q2_K | GgmlType::IQ4_XS | GgmlType::IQ2_XXS | GgmlType::IQ3_XXS => GgmlType::Q8_K,
        GgmlType::IQ2_XS | GgmlType::IQ2_S | GgmlType::IQ3_S => GgmlType::Q8_K,
        GgmlType::IQ1_S | GgmlType::IQ1_M => GgmlType::Q8_K,
        GgmlType::TQ1_0 | GgmlType::TQ2_0 => GgmlType::Q8_K,
        GgmlType::TF2 | GgmlType::TF1 => GgmlType::Q8_TF,
        _ => return None,
    })
}

/// Whether [`dequantize_row`] handles `ty`.
pub fn can_dequantize(ty: GgmlType) -> bool {
    !matches!(
        ty,
        GgmlType::I8 | GgmlType::I16 | GgmlType::I32 | GgmlType::I64 | GgmlType::F64
    )
}

/// Dequantize one row (or any contiguous run of whole blocks): `src.len()` must equal
/// `ty.row_size(dst.len())`.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), KernelError> {
    if !can_dequantize(ty) {
        return Err(KernelError::Unsupported {
            ty,
            op: "dequantize_row",
        });
    }
    let want = matmul::row_bytes(ty, dst.len())?;
    if src.len() != want {
        return Err(KernelError::RowBytes {
            ty,
            n: dst.len(),
            want,
            got: src.len(),
        });
    }
    let ok = scalar::dequantize(ty, src, dst);
    debug_assert!(ok, "can_dequantize and scalar::dequantize agree");
    Ok(())
}

/// Quantize f32 values to an activation type (Q8_0, Q8_1, Q8_K, F16, BF16, F32), bit-exact
/// with what llama.cpp's x86 build computes for `quantize_row_q8_0` / `quantize_row_q8_1` and
/// ggml's `quantize_row_q8_K_ref` (ggml-quants.c) and its
/// round-to-nearest-even f16/bf16 conversions, or to a ternary weight type: TQ1_0 / TQ2_0
/// bit-exact with `quantize_row_tq{1,2}_0_ref`, TF2 / TF1 with per-block absmean scales.
/// Q8_TF takes ONE token row (its scale is the row's absmax). `dst.len()` must equal
/// `ty.row_size(src.len())`.
pub fn quantize_row(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), KernelError> {
    if !can_quantize(ty) {
        return Err(KernelError::Unsupported {
            ty,
            op: "quantize_row",
        });
    }
    let want = matmul::row_bytes(ty, src.len())?;
    if dst.len() != want {
        return Err(KernelError::RowBytes {
            ty,
            n: src.len(),
            want,
            got: dst.len(),
        });
    }
    scalar::quantize(ty, src, dst);
    Ok(())
}

/// Whether [`quantize_row`] handles `ty`.
pub fn can_quantize(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q8_0
            | GgmlType::Q8_1
            | GgmlType::Q8_K
            | GgmlType::F16
            | GgmlType::BF16
            | GgmlType::F32
            | GgmlType::TQ1_0
            | GgmlType::TQ2_0
            | GgmlType::TF2
            | GgmlType::TF1
            | GgmlType::Q8_TF
    )
}

/// `out[t * rows.len() + (r - rows.start)] = dot(weight row r, activation row t)` for `r` in
/// `rows`, `t` in `0..x.n()`. `out.len()` must be `x.n() * rows.len()`.
///
/// `x.n() == 1` is the decode GEMV (bandwidth-bound: the weights stream past once); `x.n() > 1` is prefill, computed in tiles of weight rows × tokens so each weight
/// block is unpacked once for several tokens. Single-threaded and allocation-free: the caller
/// splits `rows` across its threads.
///
/// `numerics` picks the float order of multi-token calls (see [`Numerics`]).
pub fn matmul(
    w: &QMatrix<'_>,
    x: &Activations,
    rows: std::ops::Range<usize>,
    out: &mut [f32],
    numerics: Numerics,
) -> Result<(), KernelError> {
    let g = matmul::Gemm::new(w, x, rows, out.len(), numerics)?;
    let f = dispatch::selected()
        .matmul(g.wty)
        .ok_or(KernelError::Unsupported {
            ty: g.wty,
            op: "matmul",
        })?;
    f(&g, out);
    Ok(())
}

/// [`matmul`] on a named implementation rather than the selected one (benches, tests, A/B
/// checks on a node). Fails with [`KernelError::IsaUnavailable`] when the CPU lacks it.
pub fn matmul_with(
    isa: Isa,
    w: &QMatrix<'_>,
    x: &Activations,
    rows: std::ops::Range<usize>,
    out: &mut [f32],
    numerics: Numerics,
) -> Result<(), KernelError> {
    let k = dispatch::kernels_for(isa).ok_or(KernelError::IsaUnavailable { isa })?;
    let g = matmul::Gemm::new(w, x, rows, out.len(), numerics)?;
    let f = k.matmul(g.wty).ok_or(KernelError::Unsupported {
        ty: g.wty,
        op: "matmul",
    })?;
    f(&g, out);
    Ok(())
}

/// `Σ a[i]·b[i]` summed in the order of ggml's AVX-512 `ggml_vec_dot_f32` on every ISA (see
/// `scalar::ggml_order_dot`). Panics when the lengths differ.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot_f32 of slices of different lengths");
    (dispatch::selected().dot_f32)(a, b)
}

/// `Σ a[i]·b[i]` in the order of llamafile's `tinyBLAS<16, __m512>` (ggml's f32 `mul_mat` of
/// two or more tokens): one 16-lane FMA accumulator, halved 16 → 8 → 4 → 2 → 1; bit-identical on
/// every ISA. Panics when the lengths differ or are not a multiple of 16.
pub fn dot_f32_tinyblas(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(
        a.len(),
        b.len(),
        "dot_f32_tinyblas of slices of different lengths"
    );
    assert!(
        a.len().is_multiple_of(16),
        "dot_f32_tinyblas of {} elements (not a multiple of 16)",
        a.len()
    );
    (dispatch::selected().dot_f32_tinyblas)(a, b)
}

/// `ggml_vec_dot_f16`: products of f16 values accumulated in f32, bit-identical to llama.cpp's
/// AVX-512 build on every ISA. Panics when the lengths differ.
pub fn dot_f16(a: &[half::f16], b: &[half::f16]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot_f16 of slices of different lengths");
    (dispatch::selected().dot_f16)(a, b)
}

#[cfg(test)]
mod tests;

/// `y[i] = f16(x[i] * v + y[i])` with one f32 rounding before the f16 one: llama.cpp's
/// `ggml_vec_mad_f16` (AVX-512 build: widen, `_mm512_fmadd_ps`, narrow with round-to-nearest-
/// even), the V accumulation of its flash-attention decode path. Panics when lengths differ.
pub fn mad_f16(y: &mut [half::f16], x: &[half::f16], v: f32) {
    assert_eq!(y.len(), x.len(), "mad_f16 of slices of different lengths");
    (dispatch::selected().mad_f16)(y, x, v)
}

/// `y[i] = fma(x[i], v, y[i])` in f32, bit-identical on every ISA (one rounding per element,
/// like the FMA lanes of llama.cpp's `ggml_vec_mad_f32`). Panics when lengths differ.
pub fn mad_f32(y: &mut [f32], x: &[f32], v: f32) {
    assert_eq!(y.len(), x.len(), "mad_f32 of slices of different lengths");
    (dispatch::selected().mad_f32)(y, x, v)
}

/// Flash-attention scores of query rows against a tile of `w` keys, as llama.cpp's tiled path
/// (`ggml_compute_forward_flash_attn_ext_tiled`) sums them: `out[r·w + j] = Σ_d q[r·dk + d] ·
/// kt[d·w + j]`, one FMA per `d` in order, where `kt` is the tile transposed (`dk` rows of `w`
/// keys) and `q` holds whole rows of `dk`. Several rows per call share the tile's loads.
/// Bit-identical on every ISA. Panics when the lengths do not fit.
pub fn fa_scores(q: &[f32], kt: &[f32], w: usize, out: &mut [f32]) {
    assert!(
        w > 0 && kt.len().is_multiple_of(w),
        "fa_scores: kt is not dk x w"
    );
    let dk = kt.len() / w;
    assert!(
        dk > 0 && q.len().is_multiple_of(dk),
        "fa_scores: q is not whole rows of dk"
    );
    assert_eq!(
        out.len(),
        q.len() / dk * w,
        "fa_scores: out is not rows x w"
    );
    (dispatch::selected().fa_scores)(q, kt, w, out)
}

/// `dst[c·dst_stride + r] = f32(src[r·src_stride + c])` for `r < rows`, `c < cols`: a tile of
/// f16 rows (keys) widened and transposed for [`fa_scores`]. Exact (a copy) on every ISA.
/// Panics when the slices are too short.
pub fn widen_transpose_f16(
    src: &[half::f16],
    src_stride: usize,
    rows: usize,
    cols: usize,
    dst: &mut [f32],
    dst_stride: usize,
) {
    if widen_transpose_fits(src.len(), src_stride, rows, cols, dst.len(), dst_stride) {
        (dispatch::selected().widen_transpose_f16)(src, src_stride, rows, cols, dst, dst_stride)
    }
}

/// The bounds of [`widen_transpose_f16`]: false when there is nothing to copy, a panic when a
/// slice is too short. Every implementation checks through here.
pub(crate) fn widen_transpose_fits(
    src_len: usize,
    src_stride: usize,
    rows: usize,
    cols: usize,
    dst_len: usize,
    dst_stride: usize,
) -> bool {
    if rows == 0 || cols == 0 {
        return false;
    }
    assert!(
        src_stride >= cols && src_len >= (rows - 1) * src_stride + cols,
        "widen_transpose_f16: src holds fewer than {rows} rows of {cols}"
    );
    assert!(
        dst_stride >= rows && dst_len >= (cols - 1) * dst_stride + rows,
        "widen_transpose_f16: dst holds fewer than {cols} rows of {rows}"
    );
    true
}

/// `acc[r·n + i] += Σ_j p[r·w + j]·v[j·n + i]` for each row `r`, one FMA per `j` in order (the
/// P·V product of llama.cpp's tiled flash attention; `v` is `w` rows of `n`). Bit-identical on
/// every ISA. Panics when the lengths do not fit.
pub fn fa_pv(acc: &mut [f32], p: &[f32], v: &[f32], n: usize) {
    assert!(n > 0 && v.len().is_multiple_of(n), "fa_pv: v is not w x n");
    let w = v.len() / n;
    assert!(
        acc.len().is_multiple_of(n) && p.len() == acc.len() / n * w,
        "fa_pv: rows differ"
    );
    (dispatch::selected().fa_pv)(acc, p, v, n)
}

/// `x[i] = exp(x[i] - max)` in place, returning `Σ x[i]` as llama.cpp's
/// `ggml_vec_soft_max_f32` computes both (AVX-512 build: its polynomial `ggml_v_expf` 16 lanes
/// at a time, lane sums halved into an f64; libm `expf` for a tail). Bit-identical on every ISA.
pub fn softmax_exp(x: &mut [f32], max: f32) -> f64 {
    (dispatch::selected().softmax_exp)(x, max)
}

/// `g[i] = silu(g[i]) * u[i]` as llama.cpp's `ggml_vec_swiglu_f32` rounds it (AVX-512 build):
/// 16 lanes at a time `x / (1 + ggml_v_expf(-x)) * u`, the tail with libm `expf`; the same
/// bits on every ISA. Panics when the lengths differ.
pub fn swiglu(g: &mut [f32], u: &[f32]) {
    assert_eq!(g.len(), u.len(), "swiglu of slices of different lengths");
    (dispatch::selected().swiglu)(g, u)
}

/// `y[i] = f16(y[i] * v)`: llama.cpp's `ggml_vec_scale_f16`.
pub fn scale_f16(y: &mut [half::f16], v: f32) {
    (dispatch::selected().scale_f16)(y, v)
}
