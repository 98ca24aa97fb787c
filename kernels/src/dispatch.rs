//! Run-time selection of the kernel implementation, done once.
//!
//! Like memchr's `arch/x86_64/memchr.rs`: CPU features are detected on first use and the chosen
//! function pointers cached. A SIMD table can only be obtained from a token (`Avx2`, `Avx512`
//! in `x86_64/`) whose constructor checked the features, so no `#[target_feature]` code is
//! reachable on a CPU without them. One binary serves every x86 node of a mixed fleet.

use crate::matmul::Gemm;
use crate::quant::GgmlType;
use half::f16;
use std::sync::OnceLock;

/// Which implementation runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable Rust, the reference.
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512 F/BW/VL/DQ with VNNI (plus AVX2, FMA, F16C, BMI2).
    Avx512,
}

impl Isa {
    /// All implementations, best first.
    pub const ALL: [Isa; 3] = [Isa::Avx512, Isa::Avx2, Isa::Scalar];

    /// The name used in logs and in `TERNFLEET_KERNELS`.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512-vnni",
        }
    }

    /// Whether this CPU can run it.
    pub fn is_available(self) -> bool {
        kernels_for(self).is_some()
    }
}

/// One implementation's entry points.
#[derive(Clone, Copy)]
pub(crate) struct Kernels {
    pub isa: Isa,
    /// The matmul for a weight type (against its `vec_dot_type` activations).
    pub matmul_for: fn(GgmlType) -> Option<MatmulFn>,
    pub dot_f32: fn(&[f32], &[f32]) -> f32,
    /// See `scalar::dot_f32_tinyblas` (equal lengths, multiples of 16).
    pub dot_f32_tinyblas: fn(&[f32], &[f32]) -> f32,
    pub dot_f16: fn(&[f16], &[f16]) -> f32,
    /// `y[i] = f16(x[i] * v + y[i])`, one f32 FMA then round-to-nearest-even (equal lengths).
    pub mad_f16: fn(&mut [f16], &[f16], f32),
    /// `y[i] = f16(y[i] * v)`.
    pub scale_f16: fn(&mut [f16], f32),
    /// `y[i] = fma(x[i], v, y[i])` in f32 (equal lengths).
    pub mad_f32: fn(&mut [f32], &[f32], f32),
    /// Flash-attention tile pieces (see `scalar::fa_scores`, `fa_pv`, `softmax_exp`).
    pub fa_scores: fn(&[f32], &[f32], usize, &mut [f32]),
    pub fa_pv: fn(&mut [f32], &[f32], &[f32], usize),
    pub softmax_exp: fn(&mut [f32], f32) -> f64,
    /// Activation quantization, bit-identical to `scalar::quantize` (false: a type it cannot
    /// produce).
    pub quantize: fn(GgmlType, &[f32], &mut [u8]) -> bool,
    /// `g[i] = silu(g[i]) · u[i]` (see `scalar::swiglu`; equal lengths).
    pub swiglu: fn(&mut [f32], &[f32]),
    /// See [`crate::widen_transpose_f16`] (sizes checked by the caller).
    pub widen_transpose_f16: fn(&[f16], usize, usize, usize, &mut [f32], usize),
}

/// A matmul over a validated problem; `out.len() == g.ntok * g.nrows`.
pub(crate) type MatmulFn = fn(&Gemm<'_>, &mut [f32]);

impl Kernels {
    pub fn matmul(&self, ty: GgmlType) -> Option<MatmulFn> {
        (self.matmul_for)(ty)
    }
}

fn scalar_matmul_for(ty: GgmlType) -> Option<MatmulFn> {
    crate::scalar::has_dot(ty).then_some(crate::scalar::matmul as MatmulFn)
}

const SCALAR: Kernels = Kernels {
    isa: Isa::Scalar,
    matmul_for: scalar_matmul_for,
    dot_f32: crate::scalar::dot_f32,
    dot_f32_tinyblas: crate::scalar::dot_f32_tinyblas,
    dot_f16: crate::scalar::dot_f16,
    mad_f16: crate::scalar::mad_f16,
    scale_f16: crate::scalar::scale_f16,
    mad_f32: crate::scalar::mad_f32,
    fa_scores: crate::scalar::fa_scores,
    fa_pv: crate::scalar::fa_pv,
    softmax_exp: crate::scalar::softmax_exp,
    quantize: crate::scalar::quantize,
    swiglu: crate::scalar::swiglu,
    widen_transpose_f16: crate::scalar::widen_transpose_f16,
};

/// The kernels of `isa`, or `None` when this CPU lacks its features.
pub(crate) fn kernels_for(isa: Isa) -> Option<Kernels> {
    match isa {
        Isa::Scalar => Some(SCALAR),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => crate::x86_64::avx2::Avx2::new().map(|t| t.kernels()),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => crate::x86_64::avx512::Avx512::new().map(|t| t.kernels()),
        #[cfg(not(target_arch = "x86_64"))]
        _ => None,
    }
}

/// Choose an implementation from the value of `TERNFLEET_KERNELS` (if set) and a predicate
/// telling which are available. Returns the choice and, when the request was ignored, why.
pub(crate) fn choose(
    request: Option<&str>,
    available: impl Fn(Isa) -> bool,
) -> (Isa, Option<String>) {
    let best = Isa::ALL
        .into_iter()
        .find(|i| available(*i))
        .unwrap_or(Isa::Scalar);
    let Some(raw) = request else {
        return (best, None);
    };
    let want = match raw.trim().to_ascii_lowercase().as_str() {
        "" => return (best, None),
        "scalar" => Isa::Scalar,
        "avx2" => Isa::Avx2,
        "avx512" | "avx512-vnni" => Isa::Avx512,
        _ => {
            let note = format!(
                "TERNFLEET_KERNELS={raw:?} ignored: expected scalar, avx2 or avx512; using {}",
                best.name()
            );
            return (best, Some(note));
        }
    };
    if available(want) {
        (want, None)
    } else {
        let note = format!(
            "TERNFLEET_KERNELS={raw:?} ignored: this CPU lacks the features for {}; using {}",
            want.name(),
            best.name()
        );
        (best, Some(note))
    }
}

struct Selected {
    kernels: Kernels,
    note: Option<String>,
}

fn selection() -> &'static Selected {
    static SELECTED: OnceLock<Selected> = OnceLock::new();
    SELECTED.get_or_init(|| {
        let request = std::env::var("TERNFLEET_KERNELS").ok();
        let (isa, note) = choose(request.as_deref(), |i| kernels_for(i).is_some());
        let kernels = kernels_for(isa).expect("choose only returns available implementations");
        Selected { kernels, note }
    })
}

pub(crate) fn selected() -> &'static Kernels {
    &selection().kernels
}

/// The implementation in use (decided on first call, then fixed for the process).
pub fn isa() -> Isa {
    selected().isa
}

/// Its name for logs: `avx512-vnni`, `avx2` or `scalar`.
pub fn isa_name() -> &'static str {
    isa().name()
}

/// Why a `TERNFLEET_KERNELS` request was ignored, if it was.
pub fn isa_note() -> Option<&'static str> {
    selection().note.as_deref()
}
