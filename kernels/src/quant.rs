//! The registry of tensor element types: every ggml type id we know, with its block geometry.
//!
//! Sizes cite ggml-common.h (`block_q4_K` etc.). Row sizes are computed with checked arithmetic
//! because the element counts come from files.

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
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    BF16 = 30,
    TQ1_0 = 34,
    TQ2_0 = 35,
}

/// Super-block size of the k-quants (ggml-common.h `QK_K`).
pub const QK_K: usize = 256;
/// Block size of the legacy quants (ggml-common.h `QK4_0`, `QK5_0`, `QK8_0`).
pub const QK: usize = 32;

impl GgmlType {
    /// Every type in the registry.
    pub const ALL: [GgmlType; 22] = [
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
        GgmlType::I8,
        GgmlType::I16,
        GgmlType::I32,
        GgmlType::I64,
        GgmlType::F64,
        GgmlType::BF16,
        GgmlType::TQ1_0,
        GgmlType::TQ2_0,
    ];

    /// The type with ggml id `id`, if we know it.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        Self::ALL.iter().copied().find(|t| *t as u32 == id)
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
            GgmlType::I8 => "i8",
            GgmlType::I16 => "i16",
            GgmlType::I32 => "i32",
            GgmlType::I64 => "i64",
            GgmlType::F64 => "f64",
            GgmlType::BF16 => "bf16",
            GgmlType::TQ1_0 => "tq1_0",
            GgmlType::TQ2_0 => "tq2_0",
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
            GgmlType::Q8_0 | GgmlType::Q8_1 => QK,
            GgmlType::Q2_K
            | GgmlType::Q3_K
            | GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K
            | GgmlType::Q8_K
            | GgmlType::TQ1_0
            | GgmlType::TQ2_0 => QK_K,
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
            GgmlType::TQ1_0 => 2 + 4 * 13,
            GgmlType::TQ2_0 => 2 + 64,
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
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
        }
        assert_eq!(GgmlType::from_id(4), None); // removed Q4_2
        assert_eq!(GgmlType::from_id(39), None);
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
        assert_eq!(GgmlType::Q2_K.type_size(), 84);
        assert_eq!(GgmlType::Q3_K.type_size(), 110);
        assert_eq!(GgmlType::TQ1_0.type_size(), 54);
        assert_eq!(GgmlType::TQ2_0.type_size(), 66);
        assert_eq!(GgmlType::Q4_K.row_size(512), Some(288));
        assert_eq!(GgmlType::Q4_K.row_size(100), None);
    }
}
