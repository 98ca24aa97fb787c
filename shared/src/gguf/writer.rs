//! Building GGUF v3 files (layout as gguf.cpp `gguf_write_out`: header, key-value pairs, tensor
//! infos, padding to the alignment, then each tensor's data padded to the alignment).
//!
//! The writer refuses anything the reader would reject (empty or duplicate keys and names,
//! strings and arrays over the limits, shapes outside 1..2^40, data of the wrong length), so
//! every file it writes reads back.

use std::borrow::Cow;
use std::collections::HashSet;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use ternfleet_kernels::GgmlType;

use super::reader::MAGIC;
use super::value::{ArrayValue, Value};
use super::{
    GgufError, DEFAULT_ALIGNMENT, MAX_ALIGNMENT, MAX_ARRAY_LEN, MAX_DIM, MAX_DIMS, MAX_KVS,
    MAX_STRING_LEN, MAX_TENSORS, MAX_TENSOR_NAME,
};

/// The version this writer produces (gguf.md: current version 3).
const VERSION: u32 = 3;
const ALIGNMENT_KEY: &str = "general.alignment";

struct PendingTensor<'a> {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    bytes: Cow<'a, [u8]>,
}

/// Builds a GGUF v3 file from metadata and tensors, in the order they were added.
///
/// Tensor data may be borrowed (`&'a [u8]`, e.g. slices of a mapped [`GgufFile`]) or owned.
///
/// [`GgufFile`]: super::GgufFile
pub struct GgufWriter<'a> {
    alignment: u64,
    kvs: Vec<(String, Value)>,
    keys: HashSet<String>,
    tensors: Vec<PendingTensor<'a>>,
    names: HashSet<String>,
}

impl Default for GgufWriter<'_> {
    fn default() -> Self {
        GgufWriter::new()
    }
}

fn key_error(key: &str, reason: impl Into<String>) -> GgufError {
    GgufError::WriterKey {
        key: key.to_owned(),
        reason: reason.into(),
    }
}

fn tensor_error(name: &str, reason: impl Into<String>) -> GgufError {
    GgufError::WriterTensor {
        tensor: name.to_owned(),
        reason: reason.into(),
    }
}

fn check_string(key: &str, s: &str, what: &str) -> Result<(), GgufError> {
    if s.len() as u64 > MAX_STRING_LEN {
        return Err(key_error(
            key,
            format!("{what} of {} bytes exceeds {MAX_STRING_LEN}", s.len()),
        ));
    }
    Ok(())
}

fn check_alignment(alignment: u64) -> Result<(), GgufError> {
    if alignment == 0 || !alignment.is_power_of_two() || alignment > MAX_ALIGNMENT {
        return Err(key_error(
            ALIGNMENT_KEY,
            format!("alignment {alignment} must be a power of two between 1 and {MAX_ALIGNMENT}"),
        ));
    }
    Ok(())
}

impl<'a> GgufWriter<'a> {
    /// An empty file with the default alignment (32).
    pub fn new() -> Self {
        GgufWriter {
            alignment: DEFAULT_ALIGNMENT,
            kvs: Vec::new(),
            keys: HashSet::new(),
            tensors: Vec::new(),
            names: HashSet::new(),
        }
    }

    /// Sets the data alignment; `general.alignment` is written when it is not 32 (or when it
    /// was added explicitly).
    pub fn set_alignment(&mut self, alignment: u64) -> Result<(), GgufError> {
        check_alignment(alignment)?;
        let value =
            Value::U32(u32::try_from(alignment).expect("alignment <= MAX_ALIGNMENT fits in u32"));
        self.alignment = alignment;
        if let Some(kv) = self.kvs.iter_mut().find(|(k, _)| k == ALIGNMENT_KEY) {
            kv.1 = value;
        } else if alignment != DEFAULT_ALIGNMENT {
            self.keys.insert(ALIGNMENT_KEY.to_owned());
            self.kvs.push((ALIGNMENT_KEY.to_owned(), value));
        }
        Ok(())
    }

    /// Appends a key-value pair. `general.alignment` must be a `U32` and also sets the
    /// alignment.
    pub fn add_kv(&mut self, key: impl Into<String>, value: Value) -> Result<(), GgufError> {
        let key = key.into();
        if key.is_empty() {
            return Err(key_error(&key, "key is empty"));
        }
        check_string(&key, &key, "key")?;
        if self.keys.contains(&key) {
            return Err(key_error(&key, "duplicate key"));
        }
        if self.kvs.len() as u64 >= MAX_KVS {
            return Err(key_error(&key, format!("more than {MAX_KVS} keys")));
        }
        match &value {
            Value::String(s) => check_string(&key, s, "string value")?,
            Value::Array(a) => {
                if a.len() as u64 > MAX_ARRAY_LEN {
                    return Err(key_error(
                        &key,
                        format!("array of {} elements exceeds {MAX_ARRAY_LEN}", a.len()),
                    ));
                }
                if let ArrayValue::String(v) = a {
                    for s in v {
                        check_string(&key, s, "string element")?;
                    }
                }
            }
            _ => {}
        }
        if key == ALIGNMENT_KEY {
            let Value::U32(a) = value else {
                return Err(key_error(
                    &key,
                    format!("must be u32, not {}", value.type_name()),
                ));
            };
            check_alignment(a.into())?;
            self.alignment = a.into();
        }
        self.keys.insert(key.clone());
        self.kvs.push((key, value));
        Ok(())
    }

    /// Appends a tensor. `dims` are in ggml `ne` order (`dims[0]` is the row length); `bytes`
    /// must be exactly the tensor's size (`ggml_nbytes`).
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ty: GgmlType,
        bytes: impl Into<Cow<'a, [u8]>>,
    ) -> Result<(), GgufError> {
        let name = name.into();
        let bytes = bytes.into();
        if name.is_empty() || name.len() as u64 > MAX_TENSOR_NAME {
            return Err(tensor_error(
                &name,
                format!(
                    "name length {} is outside 1..={MAX_TENSOR_NAME}",
                    name.len()
                ),
            ));
        }
        if self.names.contains(&name) {
            return Err(tensor_error(&name, "duplicate tensor name"));
        }
        if self.tensors.len() as u64 >= MAX_TENSORS {
            return Err(tensor_error(
                &name,
                format!("more than {MAX_TENSORS} tensors"),
            ));
        }
        if dims.is_empty() || dims.len() > MAX_DIMS as usize {
            return Err(tensor_error(
                &name,
                format!("{} dimensions, expected 1..={MAX_DIMS}", dims.len()),
            ));
        }
        if let Some(d) = dims.iter().find(|&&d| d == 0 || d >= MAX_DIM) {
            return Err(tensor_error(
                &name,
                format!("dimension {d} is outside 1..{MAX_DIM}"),
            ));
        }
        let n_elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| i64::try_from(n).is_ok());
        if !ty.is_ggml() && !self.keys.contains(super::EXTENDED_TYPES_KEY) {
            return Err(tensor_error(
                &name,
                format!(
                    "type {} is ternfleet's own: set {} = true first",
                    ty.name(),
                    super::EXTENDED_TYPES_KEY
                ),
            ));
        }
        let block = ty.block_size() as u64;
        if !dims[0].is_multiple_of(block) {
            return Err(tensor_error(
                &name,
                format!(
                    "row length {} is not a multiple of the {} block size {block}",
                    dims[0],
                    ty.name()
                ),
            ));
        }
        let Some(size) = n_elements.and_then(|n| ty.row_size(n)) else {
            return Err(tensor_error(&name, format!("shape {dims:?} is too large")));
        };
        if bytes.len() as u64 != size {
            return Err(GgufError::WriterTensorSize {
                tensor: name,
                dims: dims.to_vec(),
                ty,
                expected: size,
                got: bytes.len() as u64,
            });
        }
        self.names.insert(name.clone());
        self.tensors.push(PendingTensor {
            name,
            dims: dims.to_vec(),
            ty,
            bytes,
        });
        Ok(())
    }

    /// Writes the file to `out`; returns the number of bytes written.
    pub fn write_to(&self, out: impl Write) -> Result<u64, GgufError> {
        let mut w = Counting { inner: out, n: 0 };
        self.write_all(&mut w).map_err(|source| GgufError::Io {
            path: Default::default(),
            source,
        })?;
        Ok(w.n)
    }

    /// Writes the file to `path` (created or truncated).
    pub fn write_file(&self, path: &Path) -> Result<(), GgufError> {
        let io = |source| GgufError::Io {
            path: path.to_owned(),
            source,
        };
        let file = File::create(path).map_err(io)?;
        let mut out = BufWriter::new(file);
        let mut w = Counting {
            inner: &mut out,
            n: 0,
        };
        self.write_all(&mut w).map_err(io)?;
        out.flush().map_err(io)?;
        out.into_inner()
            .map_err(|e| io(e.into_error()))?
            .sync_all()
            .map_err(io)
    }

    /// The file as bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::new();
        self.write_to(&mut v)
            .expect("writing to a Vec<u8> cannot fail");
        v
    }

    fn write_all<W: Write>(&self, w: &mut Counting<W>) -> std::io::Result<()> {
        w.write_all(&MAGIC)?;
        w.write_all(&VERSION.to_le_bytes())?;
        w.u64(self.tensors.len() as u64)?;
        w.u64(self.kvs.len() as u64)?;
        for (key, value) in &self.kvs {
            w.string(key)?;
            w.write_all(&(value.value_type() as u32).to_le_bytes())?;
            write_value(w, value)?;
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            w.string(&t.name)?;
            w.write_all(&(t.dims.len() as u32).to_le_bytes())?;
            for &d in &t.dims {
                w.u64(d)?;
            }
            w.write_all(&t.ty.id().to_le_bytes())?;
            w.u64(offset)?;
            offset = (offset + t.bytes.len() as u64).next_multiple_of(self.alignment);
        }
        w.pad(self.alignment)?;
        for t in &self.tensors {
            w.write_all(&t.bytes)?;
            w.pad(self.alignment)?;
        }
        Ok(())
    }
}

fn write_value<W: Write>(w: &mut Counting<W>, value: &Value) -> std::io::Result<()> {
    match value {
        Value::U8(v) => w.write_all(&v.to_le_bytes()),
        Value::I8(v) => w.write_all(&v.to_le_bytes()),
        Value::U16(v) => w.write_all(&v.to_le_bytes()),
        Value::I16(v) => w.write_all(&v.to_le_bytes()),
        Value::U32(v) => w.write_all(&v.to_le_bytes()),
        Value::I32(v) => w.write_all(&v.to_le_bytes()),
        Value::F32(v) => w.write_all(&v.to_le_bytes()),
        Value::Bool(v) => w.write_all(&[u8::from(*v)]),
        Value::String(s) => w.string(s),
        Value::U64(v) => w.write_all(&v.to_le_bytes()),
        Value::I64(v) => w.write_all(&v.to_le_bytes()),
        Value::F64(v) => w.write_all(&v.to_le_bytes()),
        Value::Array(a) => {
            w.write_all(&(a.element_type() as u32).to_le_bytes())?;
            w.u64(a.len() as u64)?;
            write_array(w, a)
        }
    }
}

fn write_array<W: Write>(w: &mut Counting<W>, a: &ArrayValue) -> std::io::Result<()> {
    fn each<W: Write, T, const N: usize>(
        w: &mut Counting<W>,
        v: &[T],
        enc: impl Fn(&T) -> [u8; N],
    ) -> std::io::Result<()> {
        v.iter().try_for_each(|x| w.write_all(&enc(x)))
    }
    match a {
        ArrayValue::U8(v) => w.write_all(v),
        ArrayValue::I8(v) => each(w, v, |x| x.to_le_bytes()),
        ArrayValue::U16(v) => each(w, v, |x| x.to_le_bytes()),
        ArrayValue::I16(v) => each(w, v, |x| x.to_le_bytes()),
        ArrayValue::U32(v) => each(w, v, |x| x.to_le_bytes()),
        ArrayValue::I32(v) => each(w, v, |x| x.to_le_bytes()),
        ArrayValue::F32(v) => each(w, v, |x| x.to_le_bytes()),
        ArrayValue::Bool(v) => each(w, v, |&x| [u8::from(x)]),
        ArrayValue::String(v) => v.iter().try_for_each(|s| w.string(s)),
        ArrayValue::U64(v) => each(w, v, |x| x.to_le_bytes()),
        ArrayValue::I64(v) => each(w, v, |x| x.to_le_bytes()),
        ArrayValue::F64(v) => each(w, v, |x| x.to_le_bytes()),
    }
}

/// A writer that counts bytes, for padding to the alignment.
struct Counting<W> {
    inner: W,
    n: u64,
}

impl<W: Write> Counting<W> {
    fn write_all(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.inner.write_all(b)?;
        self.n += b.len() as u64;
        Ok(())
    }

    fn u64(&mut self, v: u64) -> std::io::Result<()> {
        self.write_all(&v.to_le_bytes())
    }

    /// gguf.md `gguf_string_t`: u64 length, then the bytes.
    fn string(&mut self, s: &str) -> std::io::Result<()> {
        self.u64(s.len() as u64)?;
        self.write_all(s.as_bytes())
    }

    fn pad(&mut self, alignment: u64) -> std::io::Result<()> {
        const ZEROS: [u8; 4096] = [0; 4096];
        let mut left = self.n.next_multiple_of(alignment) - self.n;
        while left > 0 {
            let k = left.min(ZEROS.len() as u64);
            self.write_all(&ZEROS[..k as usize])?;
            left -= k;
        }
        Ok(())
    }
}
