//! The operands of a matmul: a borrowed quantized weight matrix, reusable quantized activations,
//! and [`Gemm`], the validated view the per-ISA kernels receive.

use crate::quant::GgmlType;
use crate::{scalar, vec_dot_type, KernelError};

/// Whether `ty` is a type activations are quantized to (some weight type's [`vec_dot_type`]).
pub fn is_activation_type(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::F32
            | GgmlType::F16
            | GgmlType::BF16
            | GgmlType::Q8_0
            | GgmlType::Q8_1
            | GgmlType::Q8_K
            | GgmlType::Q8_TF
    )
}

/// A borrowed row-major quantized weight matrix: `rows` rows of `cols` elements, each row
/// `ty.row_size(cols)` bytes, rows back to back (a GGUF tensor as mapped from the file).
#[derive(Clone, Copy, Debug)]
pub struct QMatrix<'a> {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    data: &'a [u8],
}

impl<'a> QMatrix<'a> {
    /// Checks that `cols` is a whole number of blocks and that `data` holds exactly
    /// `rows * ty.row_size(cols)` bytes.
    pub fn new(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &'a [u8],
    ) -> Result<Self, KernelError> {
        let row_bytes = row_bytes(ty, cols)?;
        let want = row_bytes
            .checked_mul(rows)
            .ok_or(KernelError::TooLarge { ty, rows, cols })?;
        if data.len() != want {
            return Err(KernelError::MatrixSize {
                ty,
                rows,
                cols,
                want,
                got: data.len(),
            });
        }
        Ok(QMatrix {
            ty,
            rows,
            cols,
            row_bytes,
            data,
        })
    }

    /// Element type of the weights.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    /// Number of rows (output features).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Elements per row (input features).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes of one row.
    pub fn row_stride(&self) -> usize {
        self.row_bytes
    }

    /// The bytes of row `r`. Panics when `r >= rows()`.
    pub fn row_bytes(&self, r: usize) -> &'a [u8] {
        assert!(
            r < self.rows,
            "row {r} out of range for a matrix of {} rows",
            self.rows
        );
        &self.data[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    pub(crate) fn data(&self) -> &'a [u8] {
        self.data
    }
}

/// Bytes of `cols` elements of `ty`, or an error naming both when `cols` is not whole blocks.
pub(crate) fn row_bytes(ty: GgmlType, cols: usize) -> Result<usize, KernelError> {
    match ty.row_size(cols as u64) {
        Some(b) => usize::try_from(b).map_err(|_| KernelError::TooLarge { ty, rows: 1, cols }),
        None => Err(KernelError::PartialBlock {
            ty,
            cols,
            block: ty.block_size(),
        }),
    }
}

/// One cache line: the unit of [`AlignedBytes`] and of the x86 kernels' scratch buffers, so
/// both are 64-byte aligned.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
pub(crate) struct Line(pub(crate) [u8; 64]);

/// A byte buffer that starts on a cache line: activation rows whose size is a multiple of 64
/// bytes (f16/bf16/f32 rows of 32·k values) then all start on one, so a kernel's 64-byte
/// loads never straddle two lines (a `Vec<u8>` from malloc starts 16 bytes into a line).
#[derive(Clone, Debug, Default)]
pub(crate) struct AlignedBytes {
    lines: Vec<Line>,
    len: usize,
}

impl AlignedBytes {
    /// `len` bytes; bytes kept from before stay as they were, new lines are zero.
    pub(crate) fn resize(&mut self, len: usize) {
        self.lines.resize(len.div_ceil(64), Line([0; 64]));
        self.len = len;
    }

    /// A copy of `v`.
    pub(crate) fn from_slice(v: &[u8]) -> Self {
        let mut b = Self::default();
        b.resize(v.len());
        b.copy_from_slice(v);
        b
    }

    fn clear(&mut self) {
        self.lines.clear();
        self.len = 0;
    }

    fn extend_from_slice(&mut self, src: &[u8]) {
        let start = self.len;
        self.resize(start + src.len());
        self[start..].copy_from_slice(src);
    }
}

impl std::ops::Deref for AlignedBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `lines` holds at least `len` initialized bytes (`resize`); u8 has no
        // alignment or validity requirement.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `deref`, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast(), self.len) }
    }
}

/// `n` activation rows of `cols` elements, quantized to the `vec_dot_type` of a weight type.
///
/// Besides the ggml-format bytes (which the scalar reference reads), a Q8_0 quantization keeps
/// each block's scale as f32, so the SIMD kernels do not convert f16 per block. The buffers are
/// reused: a call allocates only when it needs more room than any before it.
#[derive(Debug, Default, Clone)]
pub struct Activations {
    ty: Option<GgmlType>,
    n: usize,
    cols: usize,
    row_bytes: usize,
    data: AlignedBytes,
    /// Q8_0 and Q8_1: per block `d` as f32, `n * cols / 32` of them.
    scales: Vec<f32>,
    /// Q8_1 only: per block `s` (= d · Σq, f16 in the block) as f32.
    sums: Vec<f32>,
}

impl Activations {
    /// Empty activations; the first [`Activations::quantize_for`] sizes the buffers.
    pub fn new() -> Self {
        Self::default()
    }

    /// Quantize `n` rows of `cols` values (`x.len() == n * cols`, row-major) to
    /// `vec_dot_type(weight_ty)`, with ggml's reference rounding.
    pub fn quantize_for(
        &mut self,
        weight_ty: GgmlType,
        x: &[f32],
        n: usize,
        cols: usize,
    ) -> Result<(), KernelError> {
        self.quantize_for_with(weight_ty, x, n, cols, |x, y, _, _, q| q(x, y))
    }

    /// [`Activations::quantize_for`] with the row work handed to `split`, which must call
    /// `quantize(x_rows, out_rows)` over all of `x` and `out` in pieces of whole rows (`cols`
    /// floats in, `row_bytes` bytes out per row) — in any order, on any threads. The result is
    /// the same however it splits (each row is quantized on its own).
    pub fn quantize_for_with<S>(
        &mut self,
        weight_ty: GgmlType,
        x: &[f32],
        n: usize,
        cols: usize,
        split: S,
    ) -> Result<(), KernelError>
    where
        S: FnOnce(&[f32], &mut [u8], usize, usize, &(dyn Fn(&[f32], &mut [u8]) + Sync)),
    {
        let ty = vec_dot_type(weight_ty).ok_or(KernelError::Unsupported {
            ty: weight_ty,
            op: "matmul",
        })?;
        let rb = row_bytes(ty, cols)?;
        let want = n
            .checked_mul(cols)
            .ok_or(KernelError::TooLarge { ty, rows: n, cols })?;
        if x.len() != want {
            return Err(KernelError::InputLen {
                what: "activations",
                want,
                got: x.len(),
            });
        }
        let total = rb
            .checked_mul(n)
            .ok_or(KernelError::TooLarge { ty, rows: n, cols })?;
        self.data.resize(total);
        if n > 0 && cols > 0 {
            let simd = crate::dispatch::selected().quantize;
            let quantize = |xr: &[f32], yr: &mut [u8]| {
                assert!(
                    xr.len().is_multiple_of(cols) && yr.len() == xr.len() / cols * rb,
                    "quantize_for_with: pieces must be whole, matching rows"
                );
                // Row by row: Q8_TF's scale is per row.
                for (x1, y1) in xr.chunks_exact(cols).zip(yr.chunks_exact_mut(rb)) {
                    let ok = simd(ty, x1, y1);
                    debug_assert!(ok, "vec_dot_type only returns quantizable types");
                }
            };
            split(x, &mut self.data[..total], cols, rb, &quantize);
        }
        self.ty = Some(ty);
        self.n = n;
        self.cols = cols;
        self.row_bytes = rb;
        self.fill_scales();
        Ok(())
    }

    /// Rows quantized elsewhere (a coordinator's batch as it arrives at a node): `data` must
    /// be `n` rows of `cols` values of the activation type `ty` (a [`vec_dot_type`] result),
    /// byte for byte what [`Activations::quantize_for`] would have written.
    pub fn from_bytes(
        ty: GgmlType,
        n: usize,
        cols: usize,
        data: Vec<u8>,
    ) -> Result<Self, KernelError> {
        if !is_activation_type(ty) {
            return Err(KernelError::Unsupported {
                ty,
                op: "activations",
            });
        }
        let rb = row_bytes(ty, cols)?;
        let want = rb
            .checked_mul(n)
            .ok_or(KernelError::TooLarge { ty, rows: n, cols })?;
        if data.len() != want {
            return Err(KernelError::RowBytes {
                ty,
                n: n.saturating_mul(cols),
                want,
                got: data.len(),
            });
        }
        let mut a = Activations {
            ty: Some(ty),
            n,
            cols,
            row_bytes: rb,
            // One copy, into a cache-line-aligned buffer.
            data: AlignedBytes::from_slice(&data),
            scales: Vec::new(),
            sums: Vec::new(),
        };
        a.fill_scales();
        Ok(a)
    }

    /// Rows `rows` of `src` (any order, repeats allowed), replacing what `self` held. Panics
    /// when a row is out of range.
    pub fn gather(&mut self, src: &Activations, rows: &[usize]) {
        self.data.clear();
        for &r in rows {
            self.data.extend_from_slice(src.row(r));
        }
        self.ty = src.ty;
        self.n = rows.len();
        self.cols = src.cols;
        self.row_bytes = src.row_bytes;
        self.fill_scales();
    }

    /// The ggml-format bytes of every row, back to back (what crosses the wire).
    pub fn bytes(&self) -> &[u8] {
        &self.data[..self.n * self.row_bytes]
    }

    fn fill_scales(&mut self) {
        self.scales.clear();
        self.sums.clear();
        if let Some(ty @ (GgmlType::Q8_0 | GgmlType::Q8_1)) = self.ty {
            let n = self.n * self.row_bytes;
            for b in self.data[..n].chunks_exact(ty.type_size()) {
                self.scales.push(scalar::f16_at(b, 0));
                if ty == GgmlType::Q8_1 {
                    self.sums.push(scalar::f16_at(b, 2));
                }
            }
        }
    }

    /// Number of rows (tokens).
    pub fn n(&self) -> usize {
        self.n
    }

    /// Elements per row.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The activation type (F32 before the first quantization).
    pub fn ty(&self) -> GgmlType {
        self.ty.unwrap_or(GgmlType::F32)
    }

    /// The ggml-format bytes of row `t`.
    pub fn row(&self, t: usize) -> &[u8] {
        &self.data[t * self.row_bytes..(t + 1) * self.row_bytes]
    }
}

/// A validated matmul problem: everything a kernel needs, with sizes already checked, so the
/// kernels can run unchecked inner loops. Built by [`Gemm::new`]; kernels derive
/// sub-problems from one by struct update (fewer tokens, widened activations, `a_scales_tr`),
/// each keeping what the fields it changes promise.
pub(crate) struct Gemm<'a> {
    pub wty: GgmlType,
    /// Rows `rows.start..rows.end` of the weight matrix, back to back.
    pub w: &'a [u8],
    pub w_stride: usize,
    pub nrows: usize,
    pub cols: usize,
    pub a: &'a [u8],
    pub a_stride: usize,
    pub ntok: usize,
    /// Q8_0 / Q8_1 activations: per-block f32 scales (`ntok * cols / 32`).
    pub a_scales: &'a [f32],
    /// Q8_1 activations: per-block f32 `s` (`ntok * cols / 32`).
    pub a_sums: &'a [f32],
    /// Empty, or `a_scales` transposed, block-major (`[b * ntok + t]`, 8 values of padding
    /// after the last): set by a kernel for its tiles that read a block's scales for several
    /// tokens at once (`x86_64::avx2::tile_signed`'s one-row case).
    pub a_scales_tr: &'a [f32],
    /// The float order of multi-token calls (`crate::scalar::token_order`).
    pub numerics: crate::Numerics,
}

impl<'a> Gemm<'a> {
    pub fn new(
        w: &QMatrix<'a>,
        x: &'a Activations,
        rows: std::ops::Range<usize>,
        out_len: usize,
        numerics: crate::Numerics,
    ) -> Result<Self, KernelError> {
        let want_ty = vec_dot_type(w.ty()).ok_or(KernelError::Unsupported {
            ty: w.ty(),
            op: "matmul",
        })?;
        if x.ty != Some(want_ty) {
            return Err(KernelError::ActivationType {
                weight: w.ty(),
                want: want_ty,
                got: x.ty(),
            });
        }
        if x.cols != w.cols() {
            return Err(KernelError::ColsMismatch {
                weight: w.cols(),
                act: x.cols,
            });
        }
        if rows.start > rows.end || rows.end > w.rows() {
            return Err(KernelError::RowRange {
                start: rows.start,
                end: rows.end,
                rows: w.rows(),
            });
        }
        let want = x.n * rows.len();
        if out_len != want {
            return Err(KernelError::InputLen {
                what: "matmul output",
                want,
                got: out_len,
            });
        }
        let rb = w.row_stride();
        Ok(Gemm {
            wty: w.ty(),
            w: &w.data()[rows.start * rb..rows.end * rb],
            w_stride: rb,
            nrows: rows.len(),
            cols: w.cols(),
            a: &x.data[..x.n * x.row_bytes],
            a_stride: x.row_bytes,
            ntok: x.n,
            a_scales: &x.scales,
            a_sums: &x.sums,
            a_scales_tr: &[],
            numerics,
        })
    }

    /// Tokens per block when every row tile streams past one block's activations kept in cache:
    /// about `budget` bytes of them, a multiple of `multiple` (the tile width), at least one
    /// tile.
    pub fn token_block(&self, budget: usize, multiple: usize) -> usize {
        (budget / self.a_stride.max(1)).max(multiple) / multiple * multiple
    }

    pub fn w_row(&self, r: usize) -> &'a [u8] {
        &self.w[r * self.w_stride..(r + 1) * self.w_stride]
    }

    pub fn act_row(&self, t: usize) -> &'a [u8] {
        &self.a[t * self.a_stride..(t + 1) * self.a_stride]
    }
}
