//! The registry of tensor element types: every ggml type id we know, with its block geometry.
//!
//! Sizes cite ggml-common.h (`block_q4_K` etc.). Row sizes are computed with checked arithmetic
//! because the element counts come from files.
//!
//! Besides ggml's types the registry holds ternfleet's own ternary formats (ids from
//! [`TERNFLEET_ID_BASE`] on, outside ggml's range; see docs/ternary.md). [`GgmlType::from_id`]
//! returns only ggml types, so a GGUF file cannot smuggle ours in under a ggml type id;
//! [`GgmlType::from_ternfleet_id`] is the explicit way to accept both.
//!
//! - `TF2`  `{ f16 d; u8 qs[32] }`, 128 weights in 34 bytes (2.125 bits per weight): the code
//!   `c = q + 1 ∈ {0,1,2}` of weight `32n + m` is bits `2n..2n+2` of `qs[m]`; the value is
//!   `q·d` with `d` the block's absmean (BitNet b1.58).
//! - `TF1`  `{ f16 d; u8 qs[26] }`, 128 weights in 28 bytes (1.75 bits per weight): five codes
//!   per byte in base 3, the first most significant, stored like TQ1_0 as
//!   `ceil(Σ c_n·3^(4-n) · 256 / 243)`; weight `32n + m` (n < 4) is trit `n` of `qs[m]` for
//!   m < 26, and the remaining 24 weights `26 + m + 32n` (m < 6, n < 4) are trit 4 of `qs[6n + m]`.
//! - `Q8_TF` `{ f32 d; i8 qs[128]; i32 lsums[8] }`, 164 bytes: the activations of TF1/TF2 —
//!   int8 with ONE absmax scale per token row (`d = amax/127`, repeated in every block of
//!   the row), plus `lsums[k] = Σ qs[e]` over the block's elements with `(e % 32) / 4 == k`
//!   (what the unsigned-weight dot products subtract, like Q8_K's `bsums`).

/// A ggml tensor element type. The discriminant is the ggml type id (ggml.h `enum ggml_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2_K = 10,
    Q3_K = 11,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    Q8_K = 15,
    IQ2_XXS = 16,
    IQ2_XS = 17,
    IQ3_XXS = 18,
    IQ1_S = 19,
    IQ4_NL = 20,
    IQ3_S = 21,
    IQ2_S = 22,
    IQ4_XS = 23,
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    IQ1_M = 29,
    BF16 = 30,
    TQ1_0 = 34,
    TQ2_0 = 35,
    /// ternfleet: ternary, 128-weight blocks, 2 bits per code (module docs).
    TF2 = TERNFLEET_ID_BASE,
    /// ternfleet: ternary, 128-weight blocks, 5 codes per byte (module docs).
    TF1 = TERNFLEET_ID_BASE + 1,
    /// ternfleet: int8 activations with one scale per row, for TF1/TF2 (module docs).
    Q8_TF = TERNFLEET_ID_BASE + 2,
}

/// The first id of ternfleet's own types; ggml's ids stay far below it.
pub const TERNFLEET_ID_BASE: u32 = 1024;
/// Block size of ternfleet's ternary formats (at most 128 so that 640-column rows and
/// 128-column expert slices are whole blocks).
pub const QK_TF: usize = 128;

/// Super-block size of the k-quants (ggml-common.h `QK_K`).
pub const QK_K: usize = 256;
/// Block size of the legacy quants (ggml-common.h `QK4_0`, `QK5_0`, `QK8_0`).
pub const QK: usize = 32;
/// Bytes of a q8_K block, the k-quants' activations (ggml-common.h `block_q8_K`: f32 `d`,
/// 256 i8 codes, 16 i16 `bsums`).
pub(crate) const Q8_K_BYTES: usize = 4 + QK_K + 2 * (QK_K / 16);

impl GgmlType {
    /// Every type in the registry: ggml's, then ternfleet's.
    pub const ALL: [GgmlType; 34] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_K,
        GgmlType::IQ2_XXS,
        GgmlType::IQ2_XS,
        GgmlType::IQ3_XXS,
        GgmlType::IQ1_S,
        GgmlType::IQ4_NL,
        GgmlType::IQ3_S,
        GgmlType::IQ2_S,
        GgmlType::IQ4_XS,
        GgmlType::I8,
        GgmlType::I16,
        GgmlType::I32,
        GgmlType::I64,
        GgmlType::F64,
        GgmlType::IQ1_M,
        GgmlType::BF16,
        GgmlType::TQ1_0,
        GgmlType::TQ2_0,
        GgmlType::TF2,
        GgmlType::TF1,
        GgmlType::Q8_TF,
    ];

    /// The ggml type with id `id`, if we know it. Never one of ternfleet's own types: this is
    /// what a GGUF reader should call for a tensor's type field.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        Self::from_ternfleet_id(id).filter(|t| t.is_ggml())
    }

    /// Any type in the registry by id, ternfleet's own included (for our own containers).
    pub fn from_ternfleet_id(id: u32) -> Option<GgmlType> {
        Self::ALL.iter().copied().find(|t| *t as u32 == id)
    }

    /// Whether this is one of ggml's types (as opposed to one of ternfleet's own).
    pub fn is_ggml(self) -> bool {
        (self as u32) < TERNFLEET_ID_BASE
    }

    /// The ggml id.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// ggml's name (`ggml.c` type_traits `.type_name`).
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "f32",
            GgmlType::F16 => "f16",
            GgmlType::Q4_0 => "q4_0",
            GgmlType::Q4_1 => "q4_1",
            GgmlType::Q5_0 => "q5_0",
            GgmlType::Q5_1 => "q5_1",
            GgmlType::Q8_0 => "q8_0",
            GgmlType::Q8_1 => "q8_1",
            GgmlType::Q2_K => "q2_K",
            GgmlType::Q3_K => "q3_K",
            GgmlType::Q4_K => "q4_K",
            GgmlType::Q5_K => "q5_K",
            GgmlType::Q6_K => "q6_K",
            GgmlType::Q8_K => "q8_K",
            GgmlType::IQ2_XXS => "iq2_xxs",
            GgmlType::IQ2_XS => "iq2_xs",
            GgmlType::IQ3_XXS => "iq3_xxs",
            GgmlType::IQ1_S => "iq1_s",
            GgmlType::IQ4_NL => "iq4_nl",
            GgmlType::IQ3_S => "iq3_s",
            GgmlType::IQ2_S => "iq2_s",
            GgmlType::IQ4_XS => "iq4_xs",
            GgmlType::IQ1_M => "iq1_m",
            GgmlType::I8 => "i8",
            GgmlType::I16 => "i16",
            GgmlType::I32 => "i32",
            GgmlType::I64 => "i64",
            GgmlType::F64 => "f64",
            GgmlType::BF16 => "bf16",
            GgmlType::TQ1_0 => "tq1_0",
            GgmlType::TQ2_0 => "tq2_0",
            GgmlType::TF2 => "tf2",
            GgmlType::TF1 => "tf1",
            GgmlType::Q8_TF => "q8_tf",
        }
    }

    /// Elements per block.
    pub fn block_size(self) -> usize {
        match self {
            GgmlType::F32
            | GgmlType::F16
            | GgmlType::BF16
            | GgmlType::I8
            | GgmlType::I16
            | GgmlType::I32
            | GgmlType::I64
            | GgmlType::F64 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 => QK,
            GgmlType::Q8_0 | GgmlType::Q8_1 | GgmlType::IQ4_NL => QK,
            GgmlType::Q2_K
            | GgmlType::Q3_K
            | GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K
            | GgmlType::Q8_K
            | GgmlType::IQ2_XXS
            | GgmlType::IQ2_XS
            | GgmlType::IQ3_XXS
            | GgmlType::IQ1_S
            | GgmlType::IQ3_S
            | GgmlType::IQ2_S
            | GgmlType::IQ4_XS
            | GgmlType::IQ1_M
            | GgmlType::TQ1_0
            | GgmlType::TQ2_0 => QK_K,
            GgmlType::TF2 | GgmlType::TF1 | GgmlType::Q8_TF => QK_TF,
        }
    }

    /// Bytes per block (ggml-common.h `static_assert(sizeof(block_*) == ...)`).
    pub fn type_size(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::I32 => 4,
            GgmlType::F16 | GgmlType::BF16 | GgmlType::I16 => 2,
            GgmlType::I8 => 1,
            GgmlType::I64 | GgmlType::F64 => 8,
            GgmlType::Q4_0 => 2 + QK / 2,
            GgmlType::Q4_1 => 4 + QK / 2,
            GgmlType::Q5_0 => 2 + 4 + QK / 2,
            GgmlType::Q5_1 => 4 + 4 + QK / 2,
            GgmlType::Q8_0 => 2 + QK,
            GgmlType::Q8_1 => 4 + QK,
            GgmlType::Q2_K => 2 * 2 + QK_K / 16 + QK_K / 4,
            GgmlType::Q3_K => 2 + QK_K / 4 + QK_K / 8 + 12,
            GgmlType::Q4_K => 2 * 2 + 12 + QK_K / 2,
            GgmlType::Q5_K => 2 * 2 + 12 + QK_K / 8 + QK_K / 2,
            GgmlType::Q6_K => 2 + QK_K / 16 + 3 * QK_K / 4,
            GgmlType::Q8_K => 4 + QK_K + QK_K / 16 * 2,
            GgmlType::IQ2_XXS => 2 + QK_K / 8 * 2,
            GgmlType::IQ2_XS => 2 + QK_K / 8 * 2 + QK_K / 32,
            GgmlType::IQ3_XXS => 2 + 3 * (QK_K / 8),
            GgmlType::IQ1_S => 2 + QK_K / 8 + QK_K / 16,
            GgmlType::IQ4_NL => 2 + QK / 2,
            GgmlType::IQ3_S => 2 + 13 * (QK_K / 32) + QK_K / 64,
            GgmlType::IQ2_S => 2 + QK_K / 4 + QK_K / 16,
            GgmlType::IQ4_XS => 2 + 2 + QK_K / 64 + QK_K / 2,
            GgmlType::IQ1_M => QK_K / 8 + QK_K / 16 + QK_K / 32,
            GgmlType::TQ1_0 => 2 + 4 * 13,
            GgmlType::TQ2_0 => 2 + 64,
            GgmlType::TF2 => 2 + QK_TF / 4,
            GgmlType::TF1 => 2 + QK_TF.div_ceil(5),
            GgmlType::Q8_TF => 4 + QK_TF + 4 * 8,
        }
    }

    /// Bytes of `n` consecutive elements, or `None` when `n` is not a whole number of blocks or
    /// the size overflows.
    pub fn row_size(self, n: u64) -> Option<u64> {
        let bs = self.block_size() as u64;
        if !n.is_multiple_of(bs) {
            return None;
        }
        (n / bs).checked_mul(self.type_size() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_are_unique() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_ternfleet_id(t.id()), Some(t));
            if t.is_ggml() {
                assert_eq!(GgmlType::from_id(t.id()), Some(t));
            }
        }
        assert_eq!(GgmlType::from_id(4), None); // removed Q4_2
        assert_eq!(GgmlType::from_id(39), None);
    }

    #[test]
    fn ternfleet_types_are_not_ggml_ids() {
        for t in [GgmlType::TF2, GgmlType::TF1, GgmlType::Q8_TF] {
            assert!(!t.is_ggml());
            assert_eq!(
                GgmlType::from_id(t.id()),
                None,
                "{t:?} accepted as a ggml id"
            );
            assert_eq!(GgmlType::from_ternfleet_id(t.id()), Some(t));
        }
        assert_eq!(GgmlType::from_ternfleet_id(35), Some(GgmlType::TQ2_0));
        assert_eq!(GgmlType::TF2.type_size(), 34);
        assert_eq!(GgmlType::TF1.type_size(), 28);
        assert_eq!(GgmlType::Q8_TF.type_size(), 164);
        assert_eq!(GgmlType::TF2.row_size(640), Some(5 * 34));
    }

    #[test]
    fn block_sizes_match_ggml_static_asserts() {
        // ggml-common.h static_asserts.
        assert_eq!(GgmlType::Q4_0.type_size(), 18);
        assert_eq!(GgmlType::Q5_0.type_size(), 22);
        assert_eq!(GgmlType::Q8_0.type_size(), 34);
        assert_eq!(GgmlType::Q4_K.type_size(), 144);
        assert_eq!(GgmlType::Q5_K.type_size(), 176);
        assert_eq!(GgmlType::Q6_K.type_size(), 210);
        assert_eq!(GgmlType::Q8_K.type_size(), 292);
        assert_eq!(Q8_K_BYTES, 292);
        assert_eq!(GgmlType::Q2_K.type_size(), 84);
        assert_eq!(GgmlType::Q3_K.type_size(), 110);
        assert_eq!(GgmlType::TQ1_0.type_size(), 54);
        assert_eq!(GgmlType::TQ2_0.type_size(), 66);
        // The IQ types (ggml-common.h block_iq*).
        assert_eq!(GgmlType::IQ2_XXS.type_size(), 66);
        assert_eq!(GgmlType::IQ2_XS.type_size(), 74);
        assert_eq!(GgmlType::IQ2_S.type_size(), 82);
        assert_eq!(GgmlType::IQ3_XXS.type_size(), 98);
        assert_eq!(GgmlType::IQ3_S.type_size(), 110);
        assert_eq!(GgmlType::IQ1_S.type_size(), 50);
        assert_eq!(GgmlType::IQ1_M.type_size(), 56);
        assert_eq!(GgmlType::IQ4_NL.type_size(), 18);
        assert_eq!(GgmlType::IQ4_XS.type_size(), 136);
        assert_eq!(GgmlType::Q4_K.row_size(512), Some(288));
        assert_eq!(GgmlType::Q4_K.row_size(100), None);
    }
}
