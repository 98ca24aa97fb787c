//! Byte-level builders for GGUF test files, and the table of hostile files every reader test
//! (variant checks, allocation cap, fuzz seeds) uses. Layout: ggml/docs/gguf.md.

#![allow(dead_code)] // each test binary uses a different part

use ternfleet_shared::gguf::GgufError;

/// gguf.md `gguf_metadata_value_type` ids.
pub mod ty {
    pub const U8: u32 = 0;
    pub const U32: u32 = 4;
    pub const F32: u32 = 6;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
}

/// ggml type ids (ggml.h `enum ggml_type`).
pub mod gt {
    pub const F32: u32 = 0;
    pub const F64: u32 = 28;
    pub const Q4_K: u32 = 12;
}

/// A GGUF file written field by field, so that any field can hold any value.
#[derive(Clone, Default)]
pub struct Raw(pub Vec<u8>);

impl Raw {
    /// Magic, version, tensor count, KV count.
    pub fn header(version: u32, n_tensors: u64, n_kv: u64) -> Raw {
        Raw(b"GGUF".to_vec()).u32(version).u64(n_tensors).u64(n_kv)
    }
    pub fn u32(mut self, v: u32) -> Raw {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(mut self, v: u64) -> Raw {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn bytes(mut self, b: &[u8]) -> Raw {
        self.0.extend_from_slice(b);
        self
    }
    /// gguf.md `gguf_string_t`.
    pub fn str(self, s: &str) -> Raw {
        self.u64(s.len() as u64).bytes(s.as_bytes())
    }
    pub fn kv_u32(self, key: &str, v: u32) -> Raw {
        self.str(key).u32(ty::U32).u32(v)
    }
    pub fn kv_str(self, key: &str, v: &str) -> Raw {
        self.str(key).u32(ty::STRING).str(v)
    }
    /// gguf.md `gguf_tensor_info_t`.
    pub fn tensor(self, name: &str, dims: &[u64], ggml_type: u32, offset: u64) -> Raw {
        let mut r = self.str(name).u32(dims.len() as u32);
        for &d in dims {
            r = r.u64(d);
        }
        r.u32(ggml_type).u64(offset)
    }
    pub fn pad(mut self, alignment: usize) -> Raw {
        while !self.0.len().is_multiple_of(alignment) {
            self.0.push(0);
        }
        self
    }
    pub fn zeros(mut self, n: usize) -> Raw {
        self.0.resize(self.0.len() + n, 0);
        self
    }
    pub fn done(self) -> Vec<u8> {
        self.0
    }
}

/// A valid file: two KVs, two F32 tensors ([4] and [8, 2]), default alignment.
pub fn valid_small() -> Vec<u8> {
    Raw::header(3, 2, 2)
        .kv_str("general.architecture", "llama")
        .kv_u32("llama.block_count", 2)
        .tensor("a", &[4], gt::F32, 0)
        .tensor("b", &[8, 2], gt::F32, 32)
        .pad(32)
        .bytes(&[1; 16])
        .zeros(16)
        .bytes(&[2; 64])
        .done()
}

/// One hostile file and the error it must produce.
pub struct Case {
    pub name: &'static str,
    pub bytes: Vec<u8>,
    pub expect: fn(&GgufError) -> bool,
}

macro_rules! case {
    ($name:expr, $bytes:expr, $pat:pat) => {
        Case {
            name: $name,
            bytes: $bytes,
            expect: |e| matches!(e, $pat),
        }
    };
}

/// A file with one tensor `t` of `dims` and type `ggml_type` at `offset`, followed by `data`
/// zero bytes after the aligned data start.
fn one_tensor(dims: &[u64], ggml_type: u32, offset: u64, data: usize) -> Vec<u8> {
    Raw::header(3, 1, 0)
        .tensor("t", dims, ggml_type, offset)
        .pad(32)
        .zeros(data)
        .done()
}

/// A file with one KV whose key is `key_bytes` (raw, maybe not UTF-8), then `rest`.
fn one_kv_raw_key(key_bytes: &[u8], rest: Raw) -> Vec<u8> {
    Raw::header(3, 0, 1)
        .u64(key_bytes.len() as u64)
        .bytes(key_bytes)
        .bytes(&rest.0)
        .done()
}

/// The hostile files of TESTING.md "GGUF and bundles: hostile files", items 1–10.
pub fn hostile_cases() -> Vec<Case> {
    use GgufError as E;
    let u64max = u64::MAX;
    let mut byte_swapped = Raw::header(3, 0, 0).done();
    byte_swapped[4..8].copy_from_slice(&3u32.to_be_bytes());
    let mut truncated_tensor = valid_small();
    truncated_tensor.truncate(truncated_tensor.len() - 10);
    let mut truncated_info = valid_small();
    // Inside tensor b's offset field (header 24 + KVs 78 + tensor a 33 + 36 bytes of b).
    truncated_info.truncate(171);
    vec![
        // 1. header
        case!("empty file", vec![], E::TooSmall { size: 0 }),
        case!("3-byte file", b"GGU".to_vec(), E::TooSmall { size: 3 }),
        case!(
            "wrong magic",
            b"GGML\x03\0\0\0".to_vec(),
            E::BadMagic { .. }
        ),
        case!(
            "version 0",
            Raw::header(0, 0, 0).done(),
            E::UnsupportedVersion { version: 0 }
        ),
        case!(
            "version 1",
            Raw::header(1, 0, 0).done(),
            E::UnsupportedVersion { version: 1 }
        ),
        case!(
            "version 4",
            Raw::header(4, 0, 0).done(),
            E::UnsupportedVersion { version: 4 }
        ),
        case!(
            "byte-swapped version 3",
            byte_swapped,
            E::ByteSwapped {
                version: 0x0300_0000
            }
        ),
        case!(
            "header cut after version",
            b"GGUF\x03\0\0\0\0\0".to_vec(),
            E::Truncated {
                what: "tensor count",
                ..
            }
        ),
        // 2. counts
        case!(
            "tensor count 2^63",
            Raw::header(3, 1 << 63, 0).done(),
            E::TooManyTensors { .. }
        ),
        case!(
            "kv count 2^63",
            Raw::header(3, 0, 1 << 63).done(),
            E::TooManyKvs { .. }
        ),
        case!(
            "kv count u64::MAX",
            Raw::header(3, 0, u64max).done(),
            E::TooManyKvs { .. }
        ),
        case!(
            "kv count more than the bytes left hold",
            Raw::header(3, 0, 1000).zeros(100).done(),
            E::CountExceedsFile { .. }
        ),
        case!(
            "tensor count more than the bytes left hold",
            Raw::header(3, 60_000, 0).zeros(1000).done(),
            E::CountExceedsFile { .. }
        ),
        // 3. strings and keys
        case!(
            "key length 2^64-1",
            Raw::header(3, 0, 1).u64(u64max).zeros(16).done(),
            E::StringTooLong { len: u64::MAX, .. }
        ),
        case!(
            "key length one past EOF",
            Raw::header(3, 0, 1).u64(15).zeros(14).done(),
            E::Truncated {
                what: "key",
                needed: 15,
                available: 14,
                ..
            }
        ),
        case!(
            "string value length one past EOF",
            Raw::header(3, 0, 1)
                .str("k")
                .u32(ty::STRING)
                .u64(9)
                .zeros(8)
                .done(),
            E::Truncated {
                what: "string value",
                ..
            }
        ),
        case!(
            "string value length 2^64-1",
            Raw::header(3, 0, 1)
                .str("k")
                .u32(ty::STRING)
                .u64(u64max)
                .zeros(8)
                .done(),
            E::StringTooLong { .. }
        ),
        case!(
            "empty key",
            Raw::header(3, 0, 1)
                .str("")
                .u32(ty::U32)
                .u32(1)
                .zeros(8)
                .done(),
            E::EmptyKey { index: 0, .. }
        ),
        case!(
            "duplicate key",
            Raw::header(3, 0, 2)
                .kv_u32("a.b", 1)
                .kv_u32("a.b", 2)
                .done(),
            E::DuplicateKey { .. }
        ),
        case!(
            "invalid UTF-8 in key",
            one_kv_raw_key(b"ab\xff", Raw::default().u32(ty::U32).u32(1)),
            E::InvalidUtf8 { what: "key", .. }
        ),
        case!(
            "invalid UTF-8 in string value",
            Raw::header(3, 0, 1)
                .str("k")
                .u32(ty::STRING)
                .u64(2)
                .bytes(b"\xc3\x28")
                .done(),
            E::InvalidUtf8 {
                what: "string value",
                ..
            }
        ),
        case!(
            "u32 value cut short",
            Raw::header(3, 0, 1)
                .str("k")
                .u32(ty::U32)
                .bytes(&[1, 2])
                .zeros(0)
                .done(),
            E::Truncated { .. }
        ),
        // 4. value types and arrays
        case!(
            "unknown value type 13",
            Raw::header(3, 0, 1).str("k").u32(13).u32(0).zeros(8).done(),
            E::UnknownValueType { type_id: 13, .. }
        ),
        case!(
            "unknown value type u32::MAX",
            Raw::header(3, 0, 1)
                .str("k")
                .u32(u32::MAX)
                .u32(0)
                .zeros(8)
                .done(),
            E::UnknownValueType { .. }
        ),
        case!(
            "unknown array element type",
            Raw::header(3, 0, 1)
                .str("k")
                .u32(ty::ARRAY)
                .u32(77)
                .u64(1)
                .zeros(8)
                .done(),
            E::UnknownValueType { type_id: 77, .. }
        ),
        case!(
            "array of arrays",
            Raw::header(3, 0, 1)
                .str("k")
                .u32(ty::ARRAY)
                .u32(ty::ARRAY)
                .u64(1)
                .u32(ty::U8)
                .u64(1)
                .bytes(&[0])
                .done(),
            E::NestedArray { .. }
        ),
        case!(
            "array count 2^40",
            Raw::header(3, 0, 1)
                .str("k")
                .u32(ty::ARRAY)
                .u32(ty::U8)
                .u64(1 << 40)
                .zeros(64)
                .done(),
            E::ArrayTooLong { .. }
        ),
        case!(
            "array count u64::MAX",
            Raw::header(3, 0, 1)
                .str("k")
                .u32(ty::ARRAY)
                .u32(ty::U64)
                .u64(u64max)
                .zeros(64)
                .done(),
            E::ArrayTooLong { .. }
        ),
        case!(
            "string array count x 8 past the bytes left",
            Raw::header(3, 0, 1)
                .str("tokenizer.ggml.tokens")
                .u32(ty::ARRAY)
                .u32(ty::STRING)
                .u64(1000)
                .zeros(7999)
                .done(),
            E::CountExceedsFile {
                what: "array length",
                ..
            }
        ),
        case!(
            "u32 array longer than the bytes left",
            Raw::header(3, 0, 1)
                .str("k")
                .u32(ty::ARRAY)
                .u32(ty::U32)
                .u64(100)
                .zeros(399)
                .done(),
            E::CountExceedsFile { .. }
        ),
        case!(
            "string array element past EOF",
            Raw::header(3, 0, 1)
                .str("k")
                .u32(ty::ARRAY)
                .u32(ty::STRING)
                .u64(2)
                .str("ok")
                .u64(100)
                .zeros(10)
                .done(),
            E::Truncated {
                what: "string array element",
                ..
            }
        ),
        // 5. alignment
        case!(
            "general.alignment of type u64",
            Raw::header(3, 0, 1)
                .str("general.alignment")
                .u32(ty::U64)
                .u64(32)
                .done(),
            E::AlignmentType { found: "u64" }
        ),
        case!(
            "general.alignment of type string",
            Raw::header(3, 0, 1)
                .kv_str("general.alignment", "32")
                .done(),
            E::AlignmentType { found: "string" }
        ),
        case!(
            "general.alignment 0",
            Raw::header(3, 0, 1).kv_u32("general.alignment", 0).done(),
            E::BadAlignment { alignment: 0, .. }
        ),
        case!(
            "general.alignment 3",
            Raw::header(3, 0, 1).kv_u32("general.alignment", 3).done(),
            E::BadAlignment { alignment: 3, .. }
        ),
        case!(
            "general.alignment 2^31",
            Raw::header(3, 0, 1)
                .kv_u32("general.alignment", 1 << 31)
                .done(),
            E::BadAlignment { .. }
        ),
        // 6. tensor names and dimension counts
        case!(
            "tensor name of 257 bytes",
            one_tensor_named(&"x".repeat(257)),
            E::BadTensorName { len: 257, .. }
        ),
        case!(
            "tensor name length 2^64-1",
            Raw::header(3, 1, 0).u64(u64max).zeros(64).done(),
            E::BadTensorName { .. }
        ),
        case!(
            "empty tensor name",
            one_tensor_named(""),
            E::BadTensorName { len: 0, .. }
        ),
        case!(
            "invalid UTF-8 in tensor name",
            Raw::header(3, 1, 0)
                .u64(2)
                .bytes(b"\xff\xfe")
                .u32(1)
                .u64(4)
                .u32(gt::F32)
                .u64(0)
                .pad(32)
                .zeros(16)
                .done(),
            E::InvalidUtf8 {
                what: "tensor name",
                ..
            }
        ),
        case!(
            "duplicate tensor names",
            Raw::header(3, 2, 0)
                .tensor("w", &[8], gt::F32, 0)
                .tensor("w", &[8], gt::F32, 32)
                .pad(32)
                .zeros(64)
                .done(),
            E::DuplicateTensor { .. }
        ),
        case!(
            "n_dims 0",
            one_tensor(&[], gt::F32, 0, 64),
            E::BadDimCount { n_dims: 0, .. }
        ),
        case!(
            "n_dims 5",
            one_tensor(&[1, 1, 1, 1, 1], gt::F32, 0, 64),
            E::BadDimCount { n_dims: 5, .. }
        ),
        case!(
            "n_dims 0xFFFFFFFF",
            Raw::header(3, 1, 0).str("t").u32(u32::MAX).zeros(64).done(),
            E::BadDimCount {
                n_dims: u32::MAX,
                ..
            }
        ),
        // 7. dimensions
        case!(
            "dimension -1",
            one_tensor(&[4, u64::MAX], gt::F32, 0, 64),
            E::BadDim {
                index: 1,
                value: u64::MAX,
                ..
            }
        ),
        case!(
            "dimension 0",
            one_tensor(&[0], gt::F32, 0, 64),
            E::BadDim { value: 0, .. }
        ),
        case!(
            "dimensions (i64::MAX, 2, 1, 1)",
            one_tensor(&[i64::MAX as u64, 2, 1, 1], gt::F32, 0, 64),
            E::BadDim { index: 0, .. }
        ),
        case!(
            "dimensions (4, 2^30-1, 2^30+1, 1) F32 wrap after padding",
            one_tensor(&[4, (1 << 30) - 1, (1 << 30) + 1, 1], gt::F32, 0, 64),
            E::TensorTooLarge { .. }
        ),
        case!(
            "dimension 2^42+1",
            one_tensor(&[(1 << 42) + 1], gt::F32, 0, 64),
            E::BadDim { .. }
        ),
        case!(
            "element count over i64::MAX",
            one_tensor(&[1 << 39, 1 << 39], gt::F32, 0, 64),
            E::TensorTooLarge { .. }
        ),
        case!(
            "byte size over u64::MAX",
            one_tensor(&[1 << 38, 1 << 24], gt::F64, 0, 64),
            E::TensorTooLarge { .. }
        ),
        case!(
            "dimensions cut short",
            Raw::header(3, 1, 0)
                .str("a_long_tensor_name")
                .u32(4)
                .u64(1)
                .u64(1)
                .done(),
            E::Truncated {
                what: "tensor dimension",
                ..
            }
        ),
        // 8. types
        case!(
            "unknown tensor type 4 (removed Q4_2)",
            one_tensor(&[32], 4, 0, 64),
            E::UnknownTensorType { type_id: 4, .. }
        ),
        case!(
            "unknown tensor type u32::MAX",
            one_tensor(&[32], u32::MAX, 0, 64),
            E::UnknownTensorType { .. }
        ),
        case!(
            "Q4_K row of 100 elements",
            one_tensor(&[100, 2], gt::Q4_K, 0, 1024),
            E::BlockMisfit {
                row_len: 100,
                block_size: 256,
                ..
            }
        ),
        // 9. offsets
        case!(
            "misaligned offset",
            one_tensor(&[4], gt::F32, 1, 64),
            E::MisalignedOffset { offset: 1, .. }
        ),
        case!(
            "offset 2^64-8 (misaligned at 32)",
            one_tensor(&[4], gt::F32, u64::MAX - 7, 64),
            E::MisalignedOffset { .. }
        ),
        case!(
            "offset 2^64-8 with alignment 8",
            Raw::header(3, 1, 1)
                .kv_u32("general.alignment", 8)
                .tensor("t", &[4], gt::F32, u64::MAX - 7)
                .pad(8)
                .zeros(64)
                .done(),
            E::TensorOutOfBounds { .. }
        ),
        case!(
            "offset 2^64-32",
            one_tensor(&[4], gt::F32, u64::MAX - 31, 64),
            E::TensorOutOfBounds { .. }
        ),
        case!(
            "offset + size one byte past EOF",
            one_tensor(&[4], gt::F32, 32, 47),
            E::TensorOutOfBounds {
                offset: 32,
                size: 16,
                ..
            }
        ),
        case!(
            "overlapping tensors",
            Raw::header(3, 2, 0)
                .tensor("a", &[16], gt::F32, 0)
                .tensor("b", &[4], gt::F32, 32)
                .pad(32)
                .zeros(128)
                .done(),
            E::OverlappingTensors { .. }
        ),
        case!(
            "identical offsets",
            Raw::header(3, 2, 0)
                .tensor("a", &[4], gt::F32, 0)
                .tensor("b", &[4], gt::F32, 0)
                .pad(32)
                .zeros(128)
                .done(),
            E::OverlappingTensors { .. }
        ),
        // 10. truncation
        case!(
            "data section past EOF",
            Raw::header(3, 1, 0).tensor("t", &[4], gt::F32, 0).done(),
            E::DataSectionPastEof { .. }
        ),
        case!(
            "truncated in the middle of a tensor",
            truncated_tensor,
            E::TensorOutOfBounds { .. }
        ),
        case!(
            "truncated in the tensor infos",
            truncated_info,
            E::Truncated {
                what: "tensor data offset",
                ..
            }
        ),
    ]
}

fn one_tensor_named(name: &str) -> Vec<u8> {
    Raw::header(3, 1, 0)
        .tensor(name, &[4], gt::F32, 0)
        .pad(32)
        .zeros(64)
        .done()
}
