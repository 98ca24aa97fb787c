//! TF1 repacked: a copy of a TF1 matrix in interleaved groups of 64 rows ([`Tf1Lut::pack`],
//! as many bytes as TF1), its one-token GEMV by tables of each token's activation sums
//! ([`Tf1Lut::tables`], whole or in parts by block that threads build and share;
//! [`Tf1Lut::gemv`]) and its multi-token GEMM ([`Tf1Lut::gemm`]), both equal to the TF1 matmul
//! bit for bit. The kernels and the layout: `x86_64/tf1_lut.rs`. They need AVX-512 VBMI and
//! VNNI ([`Tf1Lut::supported`]). `compute::Linear` in the shared crate runs TF1 matrices this
//! way where they are.

use crate::matmul::AlignedBytes;
use crate::{Activations, GgmlType, KernelError, QMatrix};

/// Memory a repacked matrix can live in: zeroed bytes whose start is 64-byte aligned (e.g. a
/// caller's huge-page arena; [`Tf1Lut::pack`] uses the heap).
pub trait PackedBytes: Send + Sync {
    fn bytes(&self) -> &[u8];
    fn bytes_mut(&mut self) -> &mut [u8];
}

impl PackedBytes for AlignedBytes {
    fn bytes(&self) -> &[u8] {
        self
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}

/// A TF1 matrix repacked into interleaved groups of 64 rows.
pub struct Tf1Lut {
    rows: usize,
    cols: usize,
    data: Box<dyn PackedBytes>,
}

impl std::fmt::Debug for Tf1Lut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tf1Lut({}x{})", self.rows, self.cols)
    }
}

/// A part of one token's tables (the blocks `blocks` of a [`Tf1Lut`] of its width), reused
/// between tokens.
#[derive(Debug, Default, Clone)]
pub struct Tf1Tables {
    cols: usize,
    ad: f32,
    blocks: std::ops::Range<usize>,
    bytes: AlignedBytes,
}

impl Tf1Lut {
    /// Rows per group: [`gemv`](Self::gemv) computes whole groups.
    pub const GROUP: usize = 64;

    /// Whether this CPU runs the kernels (x86-64 with AVX-512 F/BW/VBMI/VNNI).
    pub fn supported() -> bool {
        token().is_ok()
    }

    /// Bytes of the repacked copy of a `rows` × `cols` TF1 matrix.
    pub fn packed_len(rows: usize, cols: usize) -> usize {
        rows.div_ceil(Self::GROUP) * (cols / 128) * GROUP_BLOCK
    }

    /// Repacks a TF1 matrix into heap memory.
    pub fn pack(w: &QMatrix<'_>) -> Result<Self, KernelError> {
        Self::pack_in(w, |len| {
            let mut b = AlignedBytes::default();
            b.resize(len);
            Some(b)
        })
    }

    /// Repacks a TF1 matrix into the buffer `alloc(len)` returns (`len` zeroed bytes, 64-byte
    /// aligned); `None` from it, or a buffer of another size or alignment, is an error.
    pub fn pack_in<B: PackedBytes + 'static>(
        w: &QMatrix<'_>,
        alloc: impl FnOnce(usize) -> Option<B>,
    ) -> Result<Self, KernelError> {
        if w.ty() != GgmlType::TF1 {
            return Err(KernelError::Unsupported {
                ty: w.ty(),
                op: "the repacked TF1 kernels",
            });
        }
        token()?;
        if w.rows() == 0 || w.cols() == 0 {
            return Err(KernelError::InputLen {
                what: "TF1 matrix rows and columns to repack (none may be 0)",
                want: 1,
                got: 0,
            });
        }
        let len = Self::packed_len(w.rows(), w.cols());
        let unusable = KernelError::InputLen {
            what: "repacked TF1 buffer bytes (zeroed, 64-byte aligned)",
            want: len,
            got: 0,
        };
        let mut data = alloc(len).ok_or(unusable)?;
        let out = data.bytes_mut();
        if out.len() != len || out.as_ptr().align_offset(64) != 0 {
            return Err(KernelError::InputLen {
                what: "repacked TF1 buffer bytes (zeroed, 64-byte aligned)",
                want: len,
                got: out.len(),
            });
        }
        #[cfg(target_arch = "x86_64")]
        crate::x86_64::tf1_lut::pack(w.rows(), w.cols() / 128, |r| w.row_bytes(r), out);
        #[cfg(not(target_arch = "x86_64"))]
        let _ = out;
        Ok(Self {
            rows: w.rows(),
            cols: w.cols(),
            data: Box::new(data),
        })
    }

    /// Rows of the matrix.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Groups of 64 rows (the last padded).
    pub fn groups(&self) -> usize {
        self.rows.div_ceil(Self::GROUP)
    }

    /// Bytes of the repacked matrix.
    pub fn bytes(&self) -> usize {
        self.data.bytes().len()
    }

    /// 128-element blocks of a row.
    pub fn blocks(&self) -> usize {
        self.cols / 128
    }

    /// Builds the tables of blocks `blocks` of token 0 of `act` (quantized for TF1).
    pub fn tables(
        &self,
        act: &Activations,
        blocks: std::ops::Range<usize>,
        out: &mut Tf1Tables,
    ) -> Result<(), KernelError> {
        let tok = self.check(act)?;
        if act.n() == 0 {
            return Err(KernelError::InputLen {
                what: "tokens to build tables for",
                want: 1,
                got: 0,
            });
        }
        if blocks.start > blocks.end || blocks.end > self.blocks() {
            return Err(KernelError::InputLen {
                what: "table blocks",
                want: self.blocks(),
                got: blocks.end,
            });
        }
        out.cols = self.cols;
        out.bytes.resize(blocks.len() * 8 * LANE_TABLES);
        let row = act.row(0);
        out.ad = crate::scalar::f32_at(row, 0);
        out.blocks = blocks.clone();
        tok.build_tables(row, blocks, &mut out.bytes);
        Ok(())
    }

    /// Rows of groups `groups` into `out` (`out[0]` is row `groups.start * 64`; rows past the
    /// matrix are not written), from one token's tables made by [`tables`](Self::tables):
    /// `parts` in block order, together covering every block.
    pub fn gemv(
        &self,
        parts: &[&Tf1Tables],
        groups: std::ops::Range<usize>,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        let tok = token()?;
        let mut next = 0;
        for t in parts {
            if t.cols != self.cols {
                return Err(KernelError::ColsMismatch {
                    weight: self.cols,
                    act: t.cols,
                });
            }
            if t.blocks.start != next || t.ad.to_bits() != parts[0].ad.to_bits() {
                return Err(KernelError::InputLen {
                    what: "table parts of one token in block order",
                    want: next,
                    got: t.blocks.start,
                });
            }
            next = t.blocks.end;
        }
        if next != self.blocks() {
            return Err(KernelError::InputLen {
                what: "table blocks",
                want: self.blocks(),
                got: next,
            });
        }
        let first = groups.start * Self::GROUP;
        let end = (groups.end * Self::GROUP).min(self.rows);
        if groups.start > groups.end || groups.end > self.groups() {
            return Err(KernelError::RowRange {
                start: first,
                end: groups.end * Self::GROUP,
                rows: self.rows,
            });
        }
        if out.len() < end.saturating_sub(first) {
            return Err(KernelError::InputLen {
                what: "output rows",
                want: end - first,
                got: out.len(),
            });
        }
        let tp: Vec<(&[u8], std::ops::Range<usize>)> = parts
            .iter()
            .map(|t| (&t.bytes[..], t.blocks.clone()))
            .collect();
        tok.gemv_groups(
            self.data.bytes(),
            self.blocks(),
            &tp,
            parts[0].ad,
            groups,
            |g, y| {
                let r0 = g * Self::GROUP;
                let n = (self.rows - r0).min(Self::GROUP);
                out[r0 - first..r0 - first + n].copy_from_slice(&y[..n]);
            },
        );
        Ok(())
    }

    /// Rows of groups `groups` for every token of `act` (quantized for TF1) into `out`
    /// (`out[t * n + i]` for row `groups.start * 64 + i`, `n` the rows the groups cover):
    /// the multi-token matmul from the same repacked weights, equal to the TF1 matmul bit for
    /// bit.
    pub fn gemm(
        &self,
        act: &Activations,
        groups: std::ops::Range<usize>,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        let tok = self.check(act)?;
        let first = groups.start * Self::GROUP;
        if groups.start > groups.end || groups.end > self.groups() {
            return Err(KernelError::RowRange {
                start: first,
                end: groups.end * Self::GROUP,
                rows: self.rows,
            });
        }
        let n = (groups.end * Self::GROUP).min(self.rows) - first.min(self.rows);
        let ntok = act.n();
        if out.len() < n * ntok {
            return Err(KernelError::InputLen {
                what: "output rows x tokens",
                want: n * ntok,
                got: out.len(),
            });
        }
        let nb = self.blocks();
        let gb = nb * GROUP_BLOCK;
        let rb = nb * GgmlType::Q8_TF.type_size();
        let all = act.bytes();
        let mut y = vec![0f32; GEMM_TOKENS * Self::GROUP];
        for t0 in (0..ntok).step_by(GEMM_TOKENS) {
            let nt = (ntok - t0).min(GEMM_TOKENS);
            for g in groups.clone() {
                tok.gemm_group(
                    &self.data.bytes()[g * gb..(g + 1) * gb],
                    nb,
                    &all[t0 * rb..(t0 + nt) * rb],
                    nt,
                    &mut y,
                );
                let r0 = g * Self::GROUP;
                let m = (self.rows - r0).min(Self::GROUP);
                for t in 0..nt {
                    let o = (t0 + t) * n + r0 - first;
                    out[o..o + m].copy_from_slice(&y[t * Self::GROUP..t * Self::GROUP + m]);
                }
            }
        }
        Ok(())
    }

    fn check(&self, act: &Activations) -> Result<Token, KernelError> {
        let tok = token()?;
        if act.ty() != GgmlType::Q8_TF {
            return Err(KernelError::ActivationType {
                weight: GgmlType::TF1,
                want: GgmlType::Q8_TF,
                got: act.ty(),
            });
        }
        if act.cols() != self.cols {
            return Err(KernelError::ColsMismatch {
                weight: self.cols,
                act: act.cols(),
            });
        }
        Ok(tok)
    }
}

#[cfg(target_arch = "x86_64")]
use crate::x86_64::tf1_lut::{Token, GEMM_TOKENS, GROUP_BLOCK, LANE_TABLES};

/// The kernels' token, or the error a CPU without them gets.
#[cfg(target_arch = "x86_64")]
fn token() -> Result<Token, KernelError> {
    Token::new().ok_or(KernelError::Unsupported {
        ty: GgmlType::TF1,
        op: "the repacked TF1 kernels on this CPU (they need AVX-512 VBMI and VNNI)",
    })
}

/// Other architectures: no kernels (nothing repacks: `supported()` is false), so the
/// functions below only ever return the error.
#[cfg(not(target_arch = "x86_64"))]
mod portable {
    #[derive(Clone, Copy)]
    pub(super) struct Token;
    impl Token {
        pub(super) fn build_tables(self, _: &[u8], _: std::ops::Range<usize>, _: &mut [u8]) {}
        pub(super) fn gemv_groups(
            self,
            _: &[u8],
            _: usize,
            _: &[(&[u8], std::ops::Range<usize>)],
            _: f32,
            _: std::ops::Range<usize>,
            _: impl FnMut(usize, &[f32; 64]),
        ) {
        }
        pub(super) fn gemm_group(self, _: &[u8], _: usize, _: &[u8], _: usize, _: &mut [f32]) {}
    }
    pub(super) const GEMM_TOKENS: usize = 1;
    pub(super) const GROUP_BLOCK: usize = 0;
    pub(super) const LANE_TABLES: usize = 0;
}
#[cfg(not(target_arch = "x86_64"))]
use portable::{Token, GEMM_TOKENS, GROUP_BLOCK, LANE_TABLES};
#[cfg(not(target_arch = "x86_64"))]
fn token() -> Result<Token, KernelError> {
    Err(KernelError::Unsupported {
        ty: GgmlType::TF1,
        op: "the repacked TF1 kernels (x86-64 only)",
    })
}
