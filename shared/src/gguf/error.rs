//! The error type of the GGUF reader and writer.
//!
//! Every variant names what is wrong, where (byte offset, key or tensor name) and, in its message,
//! what to do about it. Offsets are absolute byte offsets into the file.

use std::path::PathBuf;

use ternfleet_kernels::GgmlType;

/// What went wrong reading or writing a GGUF file.
#[derive(thiserror::Error, Debug)]
#[non_exhaustive]
pub enum GgufError {
    /// The file could not be opened, mapped, created or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file concerned (empty when writing to a stream).
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },

    /// The file is shorter than the 4-byte magic.
    #[error("file is {size} bytes long, too short to be a GGUF file (a header is at least 24 bytes); is it empty or a partial download?")]
    TooSmall {
        /// The file size.
        size: u64,
    },

    /// The first four bytes are not `GGUF`.
    #[error("not a GGUF file: magic is {found:02x?}, expected \"GGUF\" (47 47 55 46)")]
    BadMagic {
        /// The first four bytes.
        found: [u8; 4],
    },

    /// The version looks byte-swapped: a big-endian file (gguf.md: "models are little-endian
    /// by default"; gguf.cpp rejects the same pattern).
    #[error("GGUF version field {version:#010x} looks byte-swapped: this is a big-endian file; convert it to little-endian (gguf-py `gguf-convert-endian`)")]
    ByteSwapped {
        /// The version as read little-endian.
        version: u32,
    },

    /// A version other than 2 or 3.
    #[error("unsupported GGUF version {version}: this reader supports versions 2 and 3 (version 1 is obsolete: re-convert the model with a current llama.cpp)")]
    UnsupportedVersion {
        /// The version read.
        version: u32,
    },

    /// The file ends in the middle of a field.
    #[error("unexpected end of file at offset {offset:#x} reading {what}{}: needs {needed} bytes, {available} left; the file is truncated or corrupt — re-download it", context_suffix(context))]
    Truncated {
        /// What was being read (`"tensor count"`, `"string length"`, ...).
        what: &'static str,
        /// The key or tensor being read, if any.
        context: Option<String>,
        /// Where the field starts.
        offset: u64,
        /// Bytes the field needs.
        needed: u64,
        /// Bytes left in the file from `offset`.
        available: u64,
    },

    /// More tensors than [`MAX_TENSORS`](super::MAX_TENSORS).
    #[error("tensor count {count} exceeds the limit of {max}; the header is corrupt or the file is not a model this engine can serve")]
    TooManyTensors {
        /// The count read.
        count: u64,
        /// The limit.
        max: u64,
    },

    /// More key-value pairs than [`MAX_KVS`](super::MAX_KVS).
    #[error("metadata key count {count} exceeds the limit of {max}; the header is corrupt")]
    TooManyKvs {
        /// The count read.
        count: u64,
        /// The limit.
        max: u64,
    },

    /// A count that the rest of the file cannot possibly hold, rejected before anything is
    /// reserved for it.
    #[error("{what} {count} at offset {offset:#x}{} needs at least {min_bytes} bytes but only {available} are left; the file is truncated or the count is corrupt", context_suffix(context))]
    CountExceedsFile {
        /// What is counted (`"key-value pair count"`, `"array length"`, ...).
        what: &'static str,
        /// The key holding the array, if any.
        context: Option<String>,
        /// Where the count was read.
        offset: u64,
        /// The count.
        count: u64,
        /// The fewest bytes `count` items could take (saturating).
        min_bytes: u64,
        /// Bytes left after the count.
        available: u64,
    },

    /// A string longer than [`MAX_STRING_LEN`](super::MAX_STRING_LEN).
    #[error("string length {len} at offset {offset:#x}{} exceeds the limit of {max} bytes; the file is corrupt", context_suffix(context))]
    StringTooLong {
        /// The key or tensor whose string this is, if any.
        context: Option<String>,
        /// Where the length was read.
        offset: u64,
        /// The length read.
        len: u64,
        /// The limit.
        max: u64,
    },

    /// A key, string value or tensor name that is not UTF-8 (gguf.md: "strings are UTF-8").
    #[error(
        "invalid UTF-8 in {what} at offset {offset:#x}{}: {source}",
        context_suffix(context)
    )]
    InvalidUtf8 {
        /// `"key"`, `"string value"` or `"tensor name"`.
        what: &'static str,
        /// The key holding the value, if any.
        context: Option<String>,
        /// Where the string bytes start.
        offset: u64,
        /// Where decoding failed.
        source: std::str::Utf8Error,
    },

    /// A zero-length metadata key (gguf.cpp rejects these too).
    #[error("metadata key #{index} at offset {offset:#x} is empty")]
    EmptyKey {
        /// The index of the pair.
        index: u64,
        /// Where the key starts.
        offset: u64,
    },

    /// The same key twice.
    #[error("duplicate metadata key '{key}' at offset {offset:#x}")]
    DuplicateKey {
        /// The key.
        key: String,
        /// Where the second occurrence starts.
        offset: u64,
    },

    /// A value type id outside gguf.md's `gguf_metadata_value_type` (0..=12).
    #[error("key '{key}': unknown value type id {type_id} at offset {offset:#x} (known: 0..=12); the file is corrupt or from a newer GGUF revision")]
    UnknownValueType {
        /// The key.
        key: String,
        /// Where the type id was read.
        offset: u64,
        /// The id read.
        type_id: u32,
    },

    /// An array whose elements are arrays: gguf.cpp rejects these and no writer produces them.
    #[error("key '{key}': array of arrays at offset {offset:#x} is not supported")]
    NestedArray {
        /// The key.
        key: String,
        /// Where the element type was read.
        offset: u64,
    },

    /// An array longer than [`MAX_ARRAY_LEN`](super::MAX_ARRAY_LEN).
    #[error(
        "key '{key}': array length {len} at offset {offset:#x} exceeds the limit of {max} elements"
    )]
    ArrayTooLong {
        /// The key.
        key: String,
        /// Where the length was read.
        offset: u64,
        /// The length read.
        len: u64,
        /// The limit.
        max: u64,
    },

    /// A typed getter found the key with another type.
    #[error("metadata key '{key}' has type {found}, expected {expected}")]
    MetadataType {
        /// The key.
        key: String,
        /// What the getter accepts.
        expected: &'static str,
        /// The type in the file.
        found: &'static str,
    },

    /// An integer getter found an integer that does not fit its return type.
    #[error("metadata key '{key}' = {value} does not fit in {expected}")]
    MetadataRange {
        /// The key.
        key: String,
        /// The target type.
        expected: &'static str,
        /// The value, printed.
        value: String,
    },

    /// `general.alignment` is not a `u32` (gguf.cpp: "must be of type u32").
    #[error("general.alignment has type {found}, expected u32")]
    AlignmentType {
        /// The type in the file.
        found: &'static str,
    },

    /// `general.alignment` is 0, not a power of two, or above [`MAX_ALIGNMENT`](super::MAX_ALIGNMENT).
    #[error(
        "general.alignment = {alignment} is invalid: it must be a power of two between 1 and {max}"
    )]
    BadAlignment {
        /// The value.
        alignment: u64,
        /// The limit.
        max: u64,
    },

    /// A tensor name that is empty or longer than [`MAX_TENSOR_NAME`](super::MAX_TENSOR_NAME).
    #[error("tensor #{index}: name length {len} at offset {offset:#x} is outside 1..={max} bytes")]
    BadTensorName {
        /// The index of the tensor.
        index: u64,
        /// Where the name length was read.
        offset: u64,
        /// The length read.
        len: u64,
        /// The limit.
        max: u64,
    },

    /// Two tensors with one name.
    #[error("duplicate tensor name '{name}' (tensor #{index})")]
    DuplicateTensor {
        /// The name.
        name: String,
        /// The index of the second occurrence.
        index: u64,
    },

    /// `n_dims` outside 1..=4 (ggml.h `GGML_MAX_DIMS`).
    #[error("tensor {tensor}: {n_dims} dimensions at offset {offset:#x}, expected 1..={max}")]
    BadDimCount {
        /// The tensor.
        tensor: String,
        /// Where `n_dims` was read.
        offset: u64,
        /// The count read.
        n_dims: u32,
        /// `GGML_MAX_DIMS`.
        max: u32,
    },

    /// A dimension of 0 or at least [`MAX_DIM`](super::MAX_DIM).
    #[error(
        "tensor {tensor}: dimension {index} = {value} at offset {offset:#x} is outside 1..{max}"
    )]
    BadDim {
        /// The tensor.
        tensor: String,
        /// Which dimension (0 is the row length).
        index: usize,
        /// Where it was read.
        offset: u64,
        /// The value read (as u64: -1 reads as 18446744073709551615).
        value: u64,
        /// The exclusive limit.
        max: u64,
    },

    /// A ggml type id this engine does not know.
    #[error("tensor {tensor}: unknown ggml type id {type_id} at offset {offset:#x}; the file is corrupt or uses a type this engine does not support")]
    UnknownTensorType {
        /// The tensor.
        tensor: String,
        /// Where the id was read.
        offset: u64,
        /// The id read.
        type_id: u32,
    },

    /// A row length that is not a whole number of quantisation blocks (gguf.cpp: "not a
    /// multiple of block size").
    #[error("tensor {tensor}: row length {row_len} is not a multiple of the {} block size {block_size}", ty.name())]
    BlockMisfit {
        /// The tensor.
        tensor: String,
        /// Its type.
        ty: GgmlType,
        /// `dims[0]`.
        row_len: u64,
        /// Elements per block of `ty`.
        block_size: u64,
    },

    /// The element count or byte size (before or after alignment padding) overflows.
    #[error("tensor {tensor}: shape {dims:?} of type {} is too large ({reason})", ty.name())]
    TensorTooLarge {
        /// The tensor.
        tensor: String,
        /// Its dimensions.
        dims: Vec<u64>,
        /// Its type.
        ty: GgmlType,
        /// Which computation overflowed.
        reason: &'static str,
    },

    /// A data offset that is not a multiple of the alignment (gguf.md: "must be a multiple of
    /// ALIGNMENT").
    #[error(
        "tensor {tensor}: data offset {offset:#x} is not a multiple of the alignment {alignment}"
    )]
    MisalignedOffset {
        /// The tensor.
        tensor: String,
        /// The offset relative to the data section.
        offset: u64,
        /// The alignment.
        alignment: u64,
    },

    /// The tensor infos declare tensors but the data section starts past the end of the file.
    #[error("data section starts at {data_start:#x}, past the end of the file (size {file_size}); the file is truncated — re-download it")]
    DataSectionPastEof {
        /// Where the data section would start.
        data_start: u64,
        /// The file size.
        file_size: u64,
    },

    /// A tensor's bytes run past the end of the file.
    #[error("tensor {tensor}: data offset {} + {size} bytes runs past end of file (size {file_size}); the file is truncated or the tensor info is corrupt — re-download it", absolute(*data_start, *offset))]
    TensorOutOfBounds {
        /// The tensor.
        tensor: String,
        /// Start of the data section.
        data_start: u64,
        /// The offset relative to the data section.
        offset: u64,
        /// The tensor's size in bytes.
        size: u64,
        /// The file size.
        file_size: u64,
    },

    /// Two tensors share bytes.
    #[error("tensors {first} and {second} overlap: {first} ends at {first_end:#x}, {second} starts at {second_start:#x}")]
    OverlappingTensors {
        /// The tensor with the lower offset.
        first: String,
        /// Its end (absolute, exclusive).
        first_end: u64,
        /// The tensor starting inside it.
        second: String,
        /// Its start (absolute).
        second_start: u64,
    },

    /// The writer was given a key or value it cannot write (empty, duplicate, over a limit).
    #[error("cannot write key '{key}': {reason}")]
    WriterKey {
        /// The key.
        key: String,
        /// Why.
        reason: String,
    },

    /// The writer was given a tensor it cannot write (name, shape, duplicate).
    #[error("cannot write tensor '{tensor}': {reason}")]
    WriterTensor {
        /// The tensor.
        tensor: String,
        /// Why.
        reason: String,
    },

    /// The writer was given tensor bytes of the wrong length.
    #[error("cannot write tensor '{tensor}': shape {dims:?} of type {} needs {expected} bytes, got {got}", ty.name())]
    WriterTensorSize {
        /// The tensor.
        tensor: String,
        /// Its dimensions.
        dims: Vec<u64>,
        /// Its type.
        ty: GgmlType,
        /// Bytes the shape needs.
        expected: u64,
        /// Bytes given.
        got: u64,
    },
}

/// An absolute data offset, or the sum that overflows.
fn absolute(data_start: u64, offset: u64) -> String {
    match data_start.checked_add(offset) {
        Some(a) => format!("{a:#x}"),
        None => format!("{data_start:#x} + {offset:#x} (overflows u64)"),
    }
}

fn context_suffix(context: &Option<String>) -> String {
    match context {
        Some(c) => format!(" ({c})"),
        None => String::new(),
    }
}
