//! Parsing and validation of a GGUF file held in memory.
//!
//! Layout (ggml/docs/gguf.md "File Structure"; gguf.cpp `gguf_init_from_file_impl`), all
//! little-endian:
//!
//! ```text
//! magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
//! n_kv × (key: string, type: u32, value)          string = len u64 + UTF-8 bytes
//! n_tensors × (name: string, n_dims u32, dims u64 × n_dims, type u32, offset u64)
//! padding to ALIGNMENT | data section (each tensor at data_start + offset)
//! ```
//!
//! Every length, count and offset read here is hostile until checked: counts are capped and
//! compared with the bytes left *before* anything is reserved for them, and all size arithmetic
//! is checked (TESTING.md "GGUF and bundles: hostile files").

use std::collections::HashMap;

use ternfleet_kernels::GgmlType;

use super::value::{ArrayValue, Value, ValueType};
use super::{
    GgufError, TensorInfo, DEFAULT_ALIGNMENT, MAX_ALIGNMENT, MAX_ARRAY_LEN, MAX_DIM, MAX_DIMS,
    MAX_KVS, MAX_STRING_LEN, MAX_TENSORS, MAX_TENSOR_NAME,
};

/// gguf.md: `uint32_t magic` "GGUF" as bytes.
pub(crate) const MAGIC: [u8; 4] = *b"GGUF";

/// Key-value pair at its smallest: key length (8) + a 1-byte key + type (4) + a 1-byte value.
const MIN_KV_BYTES: u64 = 8 + 1 + 4 + 1;
/// Tensor info at its smallest: name length (8) + a 1-byte name + n_dims (4) + one dim (8) +
/// type (4) + offset (8).
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 1 + 4 + 8 + 4 + 8;

/// Most key-value pairs or tensor infos reserved before they are read.
const RESERVE_ENTRIES: usize = 1024;

/// The validated contents of a GGUF file, without the bytes.
pub(crate) struct Parsed {
    pub version: u32,
    pub alignment: u64,
    pub data_start: u64,
    pub metadata: Vec<(String, Value)>,
    pub kv_index: HashMap<String, usize>,
    pub tensors: Vec<TensorInfo>,
    pub tensor_index: HashMap<String, usize>,
}

/// A file position or length as u64. `usize` is at most 64 bits on every target Rust supports,
/// so this never truncates.
fn to_u64(n: usize) -> u64 {
    n as u64
}

/// A bounds-checked little-endian reader over the file bytes.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    /// The key or tensor being read, for error messages.
    context: Option<String>,
}

impl<'a> Cursor<'a> {
    fn offset(&self) -> u64 {
        to_u64(self.pos)
    }

    fn remaining(&self) -> u64 {
        to_u64(self.buf.len() - self.pos)
    }

    fn truncated(&self, what: &'static str, needed: u64) -> GgufError {
        GgufError::Truncated {
            what,
            context: self.context.clone(),
            offset: self.offset(),
            needed,
            available: self.remaining(),
        }
    }

    /// The next `n` bytes, or `Truncated` when fewer are left.
    fn take(&mut self, n: u64, what: &'static str) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(self.truncated(what, n));
        }
        let n = usize::try_from(n).map_err(|_| self.truncated(what, n))?;
        let bytes = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], GgufError> {
        let bytes = self.take(to_u64(N), what)?;
        Ok(bytes.try_into().expect("take(N) returns exactly N bytes"))
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, GgufError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, GgufError> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A gguf string's bytes (gguf.md `gguf_string_t`: u64 length, then the bytes, no NUL),
    /// with the length capped at `max` before anything is read.
    fn string_bytes(&mut self, what: &'static str) -> Result<(u64, &'a [u8]), GgufError> {
        let len_offset = self.offset();
        let len = self.u64("string length")?;
        if len > MAX_STRING_LEN {
            return Err(GgufError::StringTooLong {
                context: self.context.clone(),
                offset: len_offset,
                len,
                max: MAX_STRING_LEN,
            });
        }
        let start = self.offset();
        Ok((start, self.take(len, what)?))
    }

    fn string(&mut self, what: &'static str) -> Result<String, GgufError> {
        let (start, bytes) = self.string_bytes(what)?;
        self.utf8(bytes, start, what)
    }

    fn utf8(&self, bytes: &[u8], start: u64, what: &'static str) -> Result<String, GgufError> {
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(source) => Err(GgufError::InvalidUtf8 {
                what,
                context: self.context.clone(),
                offset: start,
                source,
            }),
        }
    }

    /// `count` fixed-size elements decoded with `decode`; the caller has checked `count`
    /// against the bytes left, and `take` checks again.
    fn fixed<T, const N: usize>(
        &mut self,
        count: u64,
        decode: fn([u8; N]) -> T,
    ) -> Result<Vec<T>, GgufError> {
        let n_bytes = count
            .checked_mul(to_u64(N))
            .ok_or_else(|| self.truncated("array elements", u64::MAX))?;
        let bytes = self.take(n_bytes, "array elements")?;
        Ok(bytes
            .chunks_exact(N)
            .map(|c| decode(c.try_into().expect("chunks_exact yields N-byte chunks")))
            .collect())
    }

    fn value_type(&mut self, key: &str) -> Result<ValueType, GgufError> {
        let offset = self.offset();
        let type_id = self.u32("value type")?;
        ValueType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType {
            key: key.to_owned(),
            offset,
            type_id,
        })
    }

    fn scalar(&mut self, ty: ValueType, key: &str) -> Result<Value, GgufError> {
        Ok(match ty {
            ValueType::U8 => Value::U8(u8::from_le_bytes(self.array("u8 value")?)),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.array("i8 value")?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array("u16 value")?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array("i16 value")?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.array("u32 value")?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array("i32 value")?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array("f32 value")?)),
            // gguf.cpp `gguf_reader::read(bool &)`: any non-zero byte is true.
            ValueType::Bool => Value::Bool(self.array::<1>("bool value")?[0] != 0),
            ValueType::String => Value::String(self.string("string value")?),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.array("u64 value")?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array("i64 value")?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array("f64 value")?)),
            ValueType::Array => Value::Array(self.array_value(key)?),
        })
    }

    /// gguf.md: an array is its element type (u32), its length (u64), then the elements.
    fn array_value(&mut self, key: &str) -> Result<ArrayValue, GgufError> {
        let type_offset = self.offset();
        let elem = self.value_type(key)?;
        if elem == ValueType::Array {
            // gguf.cpp rejects nested arrays (`case GGUF_TYPE_ARRAY: ... invalid GGUF type`).
            return Err(GgufError::NestedArray {
                key: key.to_owned(),
                offset: type_offset,
            });
        }
        let len_offset = self.offset();
        let len = self.u64("array length")?;
        if len > MAX_ARRAY_LEN {
            return Err(GgufError::ArrayTooLong {
                key: key.to_owned(),
                offset: len_offset,
                len,
                max: MAX_ARRAY_LEN,
            });
        }
        // Before reserving: every element takes at least min_size bytes (8 for a string's
        // length prefix), so a count the rest of the file cannot hold is corrupt.
        let min_bytes = len.saturating_mul(elem.min_size());
        if min_bytes > self.remaining() {
            return Err(GgufError::CountExceedsFile {
                what: "array length",
                context: self.context.clone(),
                offset: len_offset,
                count: len,
                min_bytes,
                available: self.remaining(),
            });
        }
        Ok(match elem {
            ValueType::U8 => ArrayValue::U8(self.fixed(len, u8::from_le_bytes)?),
            ValueType::I8 => ArrayValue::I8(self.fixed(len, i8::from_le_bytes)?),
            ValueType::U16 => ArrayValue::U16(self.fixed(len, u16::from_le_bytes)?),
            ValueType::I16 => ArrayValue::I16(self.fixed(len, i16::from_le_bytes)?),
            ValueType::U32 => ArrayValue::U32(self.fixed(len, u32::from_le_bytes)?),
            ValueType::I32 => ArrayValue::I32(self.fixed(len, i32::from_le_bytes)?),
            ValueType::F32 => ArrayValue::F32(self.fixed(len, f32::from_le_bytes)?),
            ValueType::Bool => ArrayValue::Bool(self.fixed(len, |[b]: [u8; 1]| b != 0)?),
            ValueType::U64 => ArrayValue::U64(self.fixed(len, u64::from_le_bytes)?),
            ValueType::I64 => ArrayValue::I64(self.fixed(len, i64::from_le_bytes)?),
            ValueType::F64 => ArrayValue::F64(self.fixed(len, f64::from_le_bytes)?),
            ValueType::String => {
                let n = usize::try_from(len).expect("len <= MAX_ARRAY_LEN fits in usize");
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.string("string array element")?);
                }
                ArrayValue::String(v)
            }
            ValueType::Array => unreachable!("nested arrays were rejected above"),
        })
    }
}

/// One tensor info as read, before its data offset is resolved against the data section.
struct RawTensor {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    /// Relative to the data section (gguf.md `gguf_tensor_info_t.offset`).
    offset: u64,
    size: u64,
}

/// Parses and validates `buf` as a GGUF v2/v3 file.
pub(crate) fn parse(buf: &[u8]) -> Result<Parsed, GgufError> {
    let mut cur = Cursor {
        buf,
        pos: 0,
        context: None,
    };
    if buf.len() < 4 {
        return Err(GgufError::TooSmall {
            size: to_u64(buf.len()),
        });
    }
    let magic: [u8; 4] = cur.array("magic")?;
    if magic != MAGIC {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = cur.u32("version")?;
    // gguf.cpp: a version with its low 16 bits zero is a byte-swapped (big-endian) small one.
    if version & 0x0000_FFFF == 0 && version != 0 {
        return Err(GgufError::ByteSwapped { version });
    }
    if !(2..=3).contains(&version) {
        return Err(GgufError::UnsupportedVersion { version });
    }
    let counts_offset = cur.offset();
    let n_tensors = cur.u64("tensor count")?;
    let n_kv = cur.u64("metadata key count")?;
    if n_tensors > MAX_TENSORS {
        return Err(GgufError::TooManyTensors {
            count: n_tensors,
            max: MAX_TENSORS,
        });
    }
    if n_kv > MAX_KVS {
        return Err(GgufError::TooManyKvs {
            count: n_kv,
            max: MAX_KVS,
        });
    }
    let min_bytes = n_kv
        .saturating_mul(MIN_KV_BYTES)
        .saturating_add(n_tensors.saturating_mul(MIN_TENSOR_INFO_BYTES));
    if min_bytes > cur.remaining() {
        return Err(GgufError::CountExceedsFile {
            what: "key-value and tensor counts",
            context: None,
            offset: counts_offset,
            count: n_kv.saturating_add(n_tensors),
            min_bytes,
            available: cur.remaining(),
        });
    }

    let n_kv = usize::try_from(n_kv).expect("n_kv <= MAX_KVS fits in usize");
    // Reserve for at most RESERVE_ENTRIES up front: a count that passed the bytes-left check
    // can still promise far more entries than the file holds valid ones, and `(String, Value)`
    // is larger than the 14 bytes a pair takes at least. Growth past it is amortised.
    let mut metadata = Vec::with_capacity(n_kv.min(RESERVE_ENTRIES));
    let mut kv_index = HashMap::with_capacity(n_kv.min(RESERVE_ENTRIES));
    for i in 0..n_kv {
        cur.context = Some(format!("key #{i}"));
        let key_offset = cur.offset();
        let key = cur.string("key")?;
        if key.is_empty() {
            return Err(GgufError::EmptyKey {
                index: to_u64(i),
                offset: key_offset,
            });
        }
        if kv_index.contains_key(&key) {
            return Err(GgufError::DuplicateKey {
                key,
                offset: key_offset,
            });
        }
        cur.context = Some(format!("key '{key}'"));
        let ty = cur.value_type(&key)?;
        let value = cur.scalar(ty, &key)?;
        kv_index.insert(key.clone(), metadata.len());
        metadata.push((key, value));
    }
    cur.context = None;

    // gguf.md: `general.alignment` is a uint32, default 32; gguf.cpp requires a power of two.
    let alignment = match kv_index.get("general.alignment").map(|&i| &metadata[i].1) {
        None => DEFAULT_ALIGNMENT,
        Some(Value::U32(a)) => {
            let a = u64::from(*a);
            if a == 0 || !a.is_power_of_two() || a > MAX_ALIGNMENT {
                return Err(GgufError::BadAlignment {
                    alignment: a,
                    max: MAX_ALIGNMENT,
                });
            }
            a
        }
        Some(other) => {
            return Err(GgufError::AlignmentType {
                found: other.type_name(),
            })
        }
    };

    // ternfleet's bundle parts may hold its own tensor types (ternary layouts); only a file
    // that says so explicitly gets them, every other file is held to ggml's types.
    let extended = matches!(
        kv_index
            .get(super::EXTENDED_TYPES_KEY)
            .map(|&i| &metadata[i].1),
        Some(Value::Bool(true))
    );
    let n_tensors = usize::try_from(n_tensors).expect("n_tensors <= MAX_TENSORS fits in usize");
    let mut raw = Vec::with_capacity(n_tensors.min(RESERVE_ENTRIES));
    let mut tensor_index = HashMap::with_capacity(n_tensors.min(RESERVE_ENTRIES));
    for i in 0..n_tensors {
        cur.context = Some(format!("tensor #{i}"));
        let t = read_tensor_info(&mut cur, to_u64(i), alignment, extended)?;
        if tensor_index.contains_key(&t.name) {
            return Err(GgufError::DuplicateTensor {
                name: t.name,
                index: to_u64(i),
            });
        }
        tensor_index.insert(t.name.clone(), raw.len());
        raw.push(t);
    }
    cur.context = None;

    // gguf.cpp: the data section starts at the next multiple of the alignment; a file without
    // tensors may end before it (gguf-py writes no padding then).
    let file_size = to_u64(buf.len());
    let data_start =
        cur.offset()
            .checked_next_multiple_of(alignment)
            .ok_or(GgufError::DataSectionPastEof {
                data_start: u64::MAX,
                file_size,
            })?;
    if n_tensors > 0 && data_start > file_size {
        return Err(GgufError::DataSectionPastEof {
            data_start,
            file_size,
        });
    }

    let mut tensors = Vec::with_capacity(raw.len());
    for t in raw {
        let out_of_bounds = || GgufError::TensorOutOfBounds {
            tensor: t.name.clone(),
            data_start,
            offset: t.offset,
            size: t.size,
            file_size,
        };
        let start = data_start.checked_add(t.offset).ok_or_else(out_of_bounds)?;
        let end = start.checked_add(t.size).ok_or_else(out_of_bounds)?;
        if end > file_size {
            return Err(out_of_bounds());
        }
        tensors.push(TensorInfo {
            name: t.name,
            dims: t.dims,
            ty: t.ty,
            offset: start,
            size: t.size,
        });
    }
    check_overlaps(&tensors)?;

    Ok(Parsed {
        version,
        alignment,
        data_start,
        metadata,
        kv_index,
        tensors,
        tensor_index,
    })
}

/// Reads one `gguf_tensor_info_t` and validates its name, shape and type (gguf.cpp
/// `gguf_init_from_file_impl`, "tensor shape" / "tensor type" blocks), stricter than ggml:
/// dimensions must be in 1..2^40.
fn read_tensor_info(
    cur: &mut Cursor<'_>,
    index: u64,
    alignment: u64,
    extended: bool,
) -> Result<RawTensor, GgufError> {
    // ggml.h `GGML_MAX_NAME` is 64 and gguf.cpp rejects names of 64 bytes or more; we allow
    // MAX_TENSOR_NAME (256) because we never copy names into a fixed ggml buffer, and checking
    // the length before reading keeps a hostile length from driving an allocation.
    let len_offset = cur.offset();
    let len = cur.u64("tensor name length")?;
    if len == 0 || len > MAX_TENSOR_NAME {
        return Err(GgufError::BadTensorName {
            index,
            offset: len_offset,
            len,
            max: MAX_TENSOR_NAME,
        });
    }
    let name_offset = cur.offset();
    let name_bytes = cur.take(len, "tensor name")?;
    let name = cur.utf8(name_bytes, name_offset, "tensor name")?;
    cur.context = Some(format!("tensor {name}"));

    let n_dims_offset = cur.offset();
    let n_dims = cur.u32("tensor dimension count")?;
    if !(1..=MAX_DIMS).contains(&n_dims) {
        return Err(GgufError::BadDimCount {
            tensor: name,
            offset: n_dims_offset,
            n_dims,
            max: MAX_DIMS,
        });
    }
    let n_dims = usize::try_from(n_dims).expect("n_dims <= MAX_DIMS fits in usize");
    let mut dims = Vec::with_capacity(n_dims);
    for index in 0..n_dims {
        let offset = cur.offset();
        let value = cur.u64("tensor dimension")?;
        if value == 0 || value >= MAX_DIM {
            return Err(GgufError::BadDim {
                tensor: name,
                index,
                offset,
                value,
                max: MAX_DIM,
            });
        }
        dims.push(value);
    }

    let type_offset = cur.offset();
    let type_id = cur.u32("tensor type")?;
    let ty = if extended {
        GgmlType::from_ternfleet_id(type_id)
    } else {
        GgmlType::from_id(type_id)
    };
    let Some(ty) = ty else {
        return Err(GgufError::UnknownTensorType {
            tensor: name,
            offset: type_offset,
            type_id,
        });
    };
    let offset = cur.u64("tensor data offset")?;

    let too_large = |name: String, dims: Vec<u64>, reason| GgufError::TensorTooLarge {
        tensor: name,
        dims,
        ty,
        reason,
    };
    let block_size = to_u64(ty.block_size());
    if !dims[0].is_multiple_of(block_size) {
        return Err(GgufError::BlockMisfit {
            tensor: name,
            ty,
            row_len: dims[0],
            block_size,
        });
    }
    // ggml uses int64 element counts: the product must stay below i64::MAX.
    let n_elements = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .filter(|&n| i64::try_from(n).is_ok());
    let Some(n_elements) = n_elements else {
        return Err(too_large(name, dims, "element count overflows i64"));
    };
    // ggml_nbytes: row size × rows; row_size(n_elements) is equal since dims[0] is whole blocks.
    let Some(size) = ty.row_size(n_elements) else {
        return Err(too_large(name, dims, "byte size overflows u64"));
    };
    // gguf.cpp: "GGML_PAD adds (alignment - 1) to nbytes. when nbytes is near SIZE_MAX this
    // wraps to 0" — the padded size must be representable too.
    if size.checked_next_multiple_of(alignment).is_none() {
        return Err(too_large(
            name,
            dims,
            "byte size overflows u64 after alignment padding",
        ));
    }
    if !offset.is_multiple_of(alignment) {
        return Err(GgufError::MisalignedOffset {
            tensor: name,
            offset,
            alignment,
        });
    }
    Ok(RawTensor {
        name,
        dims,
        ty,
        offset,
        size,
    })
}

/// Tensors may appear in any order (gguf.cpp also demands they be packed in file order; we
/// only demand that no two share a byte).
fn check_overlaps(tensors: &[TensorInfo]) -> Result<(), GgufError> {
    let mut order: Vec<&TensorInfo> = tensors.iter().collect();
    order.sort_by_key(|t| t.offset);
    for pair in order.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        // Validated in `parse`: offset + size <= file size.
        let a_end = a.offset + a.size;
        if a_end > b.offset {
            return Err(GgufError::OverlappingTensors {
                first: a.name.clone(),
                first_end: a_end,
                second: b.name.clone(),
                second_start: b.offset,
            });
        }
    }
    Ok(())
}
