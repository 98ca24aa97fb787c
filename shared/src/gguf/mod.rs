//! GGUF v2/v3 reader and writer (format: ggml/docs/gguf.md; reference reader: ggml/src/gguf.cpp).
//!
//! [`GgufFile`] owns a model file's bytes (a private read-only memory map, or a `Vec<u8>`) and
//! the metadata and tensor directory parsed from them. Everything is validated once, in
//! [`GgufFile::open`] / [`GgufFile::from_bytes`]: after that every [`TensorInfo`] names a
//! byte range inside the file, aligned, of exactly the size its shape and type need, overlapping
//! no other tensor, so [`GgufFile::tensor_data`] cannot fail. [`GgufWriter`] builds v3 files.
//!
//! The reader treats the file as hostile (TESTING.md "GGUF and bundles: hostile files"): counts
//! and lengths are capped ([`MAX_TENSORS`], [`MAX_KVS`], [`MAX_STRING_LEN`], [`MAX_ARRAY_LEN`],
//! [`MAX_TENSOR_NAME`], [`MAX_DIMS`], [`MAX_DIM`], [`MAX_ALIGNMENT`]) and compared with the bytes
//! left before anything is reserved, all size arithmetic is checked, and every failure is a
//! [`GgufError`] variant, never a panic.
//!
//! ```
//! use ternfleet_shared::gguf::{GgmlType, GgufFile, GgufWriter, Value};
//!
//! let mut w = GgufWriter::new();
//! w.add_kv("general.architecture", Value::String("llama".into()))?;
//! w.add_kv("llama.block_count", Value::U8(2))?;
//! w.add_tensor("output_norm.weight", &[4], GgmlType::F32, vec![0u8; 16])?;
//!
//! let f = GgufFile::from_bytes(w.to_bytes())?; // or GgufFile::open(path)
//! assert_eq!(f.get_str("general.architecture")?, Some("llama"));
//! assert_eq!(f.get_u32("llama.block_count")?, Some(2)); // any integer type that fits
//! assert_eq!(f.get_u32("llama.context_length")?, None); // absent
//! let t = f.tensor("output_norm.weight").expect("present");
//! assert_eq!((t.cols(), t.rows(), f.tensor_data(t).len()), (4, 1, 16));
//! # Ok::<(), ternfleet_shared::gguf::GgufError>(())
//! ```

mod error;
mod reader;
mod value;
mod writer;

#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::path::Path;

pub use ternfleet_kernels::GgmlType;

pub use error::GgufError;
pub use value::{ArrayValue, Value};
pub use writer::GgufWriter;

/// Most tensors a file may declare (llama.cpp allows `SIZE_MAX / sizeof(gguf_tensor_info)`).
pub const MAX_TENSORS: u64 = 65_536;
/// Most metadata key-value pairs a file may declare.
pub const MAX_KVS: u64 = 65_536;
/// Longest string (key, value or array element), in bytes.
pub const MAX_STRING_LEN: u64 = 16 << 20;
/// Most elements in one metadata array (tokenizer tokens and merges are the big ones:
/// 262,144 tokens in Gemma 3).
pub const MAX_ARRAY_LEN: u64 = 4 << 20;
/// Longest tensor name in bytes. ggml's `GGML_MAX_NAME` is 64 (gguf.cpp rejects names of 64
/// bytes or more); we accept up to 256 since names are never copied into a fixed buffer here.
pub const MAX_TENSOR_NAME: u64 = 256;
/// Most dimensions of a tensor (ggml.h `GGML_MAX_DIMS`).
pub const MAX_DIMS: u32 = 4;
/// Exclusive upper bound of one dimension (2^40; ggml allows up to `i64::MAX`).
pub const MAX_DIM: u64 = 1 << 40;
/// Largest accepted `general.alignment` (1 MiB).
pub const MAX_ALIGNMENT: u64 = 1 << 20;
/// Alignment when `general.alignment` is absent (gguf.md `GGUF_DEFAULT_ALIGNMENT`).
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// A tensor's entry in the directory, with its data offset resolved and validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// The tensor name, e.g. `blk.3.ffn_up.weight`.
    pub name: String,
    /// Dimensions in ggml `ne` order: `dims[0]` is the row length (contiguous elements).
    pub dims: Vec<u64>,
    /// Element type.
    pub ty: GgmlType,
    /// Absolute file offset of the first data byte.
    pub offset: u64,
    /// Data size in bytes (ggml `ggml_nbytes`, no padding).
    pub size: u64,
}

impl TensorInfo {
    /// Number of elements (product of `dims`; checked at open).
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Number of rows: the product of `dims[1..]`.
    pub fn rows(&self) -> u64 {
        self.dims.iter().skip(1).product()
    }

    /// Row length in elements: `dims[0]`.
    pub fn cols(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }
}

/// Where a [`GgufFile`]'s bytes live.
enum Storage {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// Metadata key (bool) that lets a GGUF file hold ternfleet's own tensor types (its ternary
/// layouts, ids from `ternfleet_kernels::quant::TERNFLEET_ID_BASE`). llama.cpp cannot read such
/// files; ternfleet writes them only for expert blobs converted to its layouts.
pub const EXTENDED_TYPES_KEY: &str = "ternfleet.extended_types";

/// A validated GGUF file: its bytes, metadata and tensor directory.
pub struct GgufFile {
    storage: Storage,
    /// The file it was mapped from (`None`: parsed from memory).
    path: Option<std::path::PathBuf>,
    version: u32,
    alignment: u64,
    data_start: u64,
    metadata: Vec<(String, Value)>,
    kv_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("size", &self.data().len())
            .field("alignment", &self.alignment)
            .field("kvs", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Maps `path` read-only and private, then parses and validates it.
    pub fn open(path: &Path) -> Result<GgufFile, GgufError> {
        let io = |source| GgufError::Io {
            path: path.to_owned(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len == 0 {
            return GgufFile::from_bytes(Vec::new());
        }
        // SAFETY: the map is private and read-only, so we never write through it; another
        // process truncating or rewriting the file while it is mapped would change or remove
        // the bytes under us (SIGBUS). Model files are immutable while served, as for llama.cpp's
        // mmap loader.
        let map = unsafe { memmap2::MmapOptions::new().map_copy_read_only(&file) }.map_err(io)?;
        let mut f = GgufFile::with_storage(Storage::Mapped(map))?;
        f.path = Some(path.to_owned());
        Ok(f)
    }

    /// The file this was mapped from (`None` for one parsed from memory).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Parses and validates a file held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
        GgufFile::with_storage(Storage::Owned(bytes))
    }

    fn with_storage(storage: Storage) -> Result<GgufFile, GgufError> {
        let p = reader::parse(storage.bytes())?;
        Ok(GgufFile {
            path: None,
            storage,
            version: p.version,
            alignment: p.alignment,
            data_start: p.data_start,
            metadata: p.metadata,
            kv_index: p.kv_index,
            tensors: p.tensors,
            tensor_index: p.tensor_index,
        })
    }

    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The data alignment: `general.alignment`, or 32 when absent.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute offset of the data section (tensor offsets in the file are relative to it).
    pub fn data_offset(&self) -> u64 {
        self.data_start
    }

    /// All key-value pairs, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.kv_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// An integer of any GGUF integer type whose value fits in `T` (like llama.cpp's
    /// `llama_model_loader::get_key`).
    fn get_int<T: TryFrom<i128>>(
        &self,
        key: &str,
        expected: &'static str,
    ) -> Result<Option<T>, GgufError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let Some(i) = v.as_integer() else {
            return Err(GgufError::MetadataType {
                key: key.to_owned(),
                expected: "an integer",
                found: v.type_name(),
            });
        };
        T::try_from(i)
            .map(Some)
            .map_err(|_| GgufError::MetadataRange {
                key: key.to_owned(),
                expected,
                value: i.to_string(),
            })
    }

    /// `key` as a `u32`: any integer type whose value fits.
    pub fn get_u32(&self, key: &str) -> Result<Option<u32>, GgufError> {
        self.get_int(key, "u32")
    }

    /// `key` as a `u64`: any integer type whose value fits.
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>, GgufError> {
        self.get_int(key, "u64")
    }

    /// `key` as an `i64`: any integer type whose value fits.
    pub fn get_i64(&self, key: &str) -> Result<Option<i64>, GgufError> {
        self.get_int(key, "i64")
    }

    /// `key` as an `f32`: an F32, or an F64 rounded to the nearest f32.
    pub fn get_f32(&self, key: &str) -> Result<Option<f32>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::F32(v)) => Ok(Some(*v)),
            // Rounding to nearest is the intent: hyperparameters are used as f32.
            Some(Value::F64(v)) => Ok(Some(*v as f32)),
            Some(v) => Err(self.type_error(key, "f32 or f64", v)),
        }
    }

    /// `key` as a `bool`.
    pub fn get_bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(v)) => Ok(Some(*v)),
            Some(v) => Err(self.type_error(key, "bool", v)),
        }
    }

    /// `key` as a string.
    pub fn get_str(&self, key: &str) -> Result<Option<&str>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(v)) => Ok(Some(v)),
            Some(v) => Err(self.type_error(key, "string", v)),
        }
    }

    /// `key` as an array (of any element type).
    pub fn get_array(&self, key: &str) -> Result<Option<&ArrayValue>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(v)) => Ok(Some(v)),
            Some(v) => Err(self.type_error(key, "array", v)),
        }
    }

    fn type_error(&self, key: &str, expected: &'static str, found: &Value) -> GgufError {
        GgufError::MetadataType {
            key: key.to_owned(),
            expected,
            found: found.type_name(),
        }
    }

    /// The tensor directory, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor named `name`, if present.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The `t.size` data bytes of tensor `t`.
    ///
    /// # Panics
    ///
    /// If `t` is not a [`TensorInfo`] of this file (its bounds were validated at open only for
    /// this file's tensors).
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let range = usize::try_from(t.offset)
            .ok()
            .and_then(|start| Some(start..start.checked_add(usize::try_from(t.size).ok()?)?));
        range.and_then(|r| self.data().get(r)).expect(
            "TensorInfo must come from this GgufFile, whose tensor bounds were validated at open",
        )
    }

    /// The whole file.
    pub fn data(&self) -> &[u8] {
        self.storage.bytes()
    }
}
