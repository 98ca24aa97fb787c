//! Metadata values (gguf.md "gguf_metadata_value_type").

/// The type ids of gguf.md's `gguf_metadata_value_type` (gguf.h `enum gguf_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub(crate) enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    pub(crate) fn from_id(id: u32) -> Option<ValueType> {
        Some(match id {
            0 => ValueType::U8,
            1 => ValueType::I8,
            2 => ValueType::U16,
            3 => ValueType::I16,
            4 => ValueType::U32,
            5 => ValueType::I32,
            6 => ValueType::F32,
            7 => ValueType::Bool,
            8 => ValueType::String,
            9 => ValueType::Array,
            10 => ValueType::U64,
            11 => ValueType::I64,
            12 => ValueType::F64,
            _ => return None,
        })
    }

    /// Bytes one value takes in the file; for strings the 8-byte length prefix, which is the
    /// least a string can take. Arrays are never elements (see [`GgufError::NestedArray`]).
    ///
    /// [`GgufError::NestedArray`]: super::GgufError::NestedArray
    pub(crate) fn min_size(self) -> u64 {
        match self {
            ValueType::U8 | ValueType::I8 | ValueType::Bool => 1,
            ValueType::U16 | ValueType::I16 => 2,
            ValueType::U32 | ValueType::I32 | ValueType::F32 => 4,
            ValueType::U64 | ValueType::I64 | ValueType::F64 | ValueType::String => 8,
            // type (4) + element type (4) + count (8)
            ValueType::Array => 16,
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            ValueType::U8 => "u8",
            ValueType::I8 => "i8",
            ValueType::U16 => "u16",
            ValueType::I16 => "i16",
            ValueType::U32 => "u32",
            ValueType::I32 => "i32",
            ValueType::F32 => "f32",
            ValueType::Bool => "bool",
            ValueType::String => "string",
            ValueType::Array => "array",
            ValueType::U64 => "u64",
            ValueType::I64 => "i64",
            ValueType::F64 => "f64",
        }
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// `GGUF_METADATA_VALUE_TYPE_UINT8`
    U8(u8),
    /// `GGUF_METADATA_VALUE_TYPE_INT8`
    I8(i8),
    /// `GGUF_METADATA_VALUE_TYPE_UINT16`
    U16(u16),
    /// `GGUF_METADATA_VALUE_TYPE_INT16`
    I16(i16),
    /// `GGUF_METADATA_VALUE_TYPE_UINT32`
    U32(u32),
    /// `GGUF_METADATA_VALUE_TYPE_INT32`
    I32(i32),
    /// `GGUF_METADATA_VALUE_TYPE_FLOAT32`
    F32(f32),
    /// `GGUF_METADATA_VALUE_TYPE_BOOL`; any non-zero byte reads as `true`, as in gguf.cpp.
    Bool(bool),
    /// `GGUF_METADATA_VALUE_TYPE_STRING` (UTF-8, checked on read).
    String(String),
    /// `GGUF_METADATA_VALUE_TYPE_UINT64`
    U64(u64),
    /// `GGUF_METADATA_VALUE_TYPE_INT64`
    I64(i64),
    /// `GGUF_METADATA_VALUE_TYPE_FLOAT64`
    F64(f64),
    /// `GGUF_METADATA_VALUE_TYPE_ARRAY` of non-array elements.
    Array(ArrayValue),
}

/// A homogeneous metadata array. GGUF arrays of arrays are rejected on read and cannot be built.
#[derive(Clone, Debug, PartialEq)]
pub enum ArrayValue {
    /// Array of `u8`.
    U8(Vec<u8>),
    /// Array of `i8`.
    I8(Vec<i8>),
    /// Array of `u16`.
    U16(Vec<u16>),
    /// Array of `i16`.
    I16(Vec<i16>),
    /// Array of `u32`.
    U32(Vec<u32>),
    /// Array of `i32`.
    I32(Vec<i32>),
    /// Array of `f32`.
    F32(Vec<f32>),
    /// Array of `bool`.
    Bool(Vec<bool>),
    /// Array of strings (e.g. `tokenizer.ggml.tokens`).
    String(Vec<String>),
    /// Array of `u64`.
    U64(Vec<u64>),
    /// Array of `i64`.
    I64(Vec<i64>),
    /// Array of `f64`.
    F64(Vec<f64>),
}

impl Value {
    pub(crate) fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
            Value::Array(_) => ValueType::Array,
        }
    }

    /// The gguf type name (`"u32"`, `"string"`, `"array"`, ...), as used in error messages.
    pub fn type_name(&self) -> &'static str {
        self.value_type().name()
    }

    /// The value as an `i128` when it is an integer (any width, signed or not).
    pub(crate) fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }
}

impl ArrayValue {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            ArrayValue::U8(v) => v.len(),
            ArrayValue::I8(v) => v.len(),
            ArrayValue::U16(v) => v.len(),
            ArrayValue::I16(v) => v.len(),
            ArrayValue::U32(v) => v.len(),
            ArrayValue::I32(v) => v.len(),
            ArrayValue::F32(v) => v.len(),
            ArrayValue::Bool(v) => v.len(),
            ArrayValue::String(v) => v.len(),
            ArrayValue::U64(v) => v.len(),
            ArrayValue::I64(v) => v.len(),
            ArrayValue::F64(v) => v.len(),
        }
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn element_type(&self) -> ValueType {
        match self {
            ArrayValue::U8(_) => ValueType::U8,
            ArrayValue::I8(_) => ValueType::I8,
            ArrayValue::U16(_) => ValueType::U16,
            ArrayValue::I16(_) => ValueType::I16,
            ArrayValue::U32(_) => ValueType::U32,
            ArrayValue::I32(_) => ValueType::I32,
            ArrayValue::F32(_) => ValueType::F32,
            ArrayValue::Bool(_) => ValueType::Bool,
            ArrayValue::String(_) => ValueType::String,
            ArrayValue::U64(_) => ValueType::U64,
            ArrayValue::I64(_) => ValueType::I64,
            ArrayValue::F64(_) => ValueType::F64,
        }
    }

    /// The element type name (`"u32"`, `"string"`, ...).
    pub fn element_type_name(&self) -> &'static str {
        self.element_type().name()
    }
}
