//! Typed errors of the safetensors reader and header encoder.

use std::io;
use std::path::PathBuf;

use super::limits::MAX_HEADER_BYTES;

/// Why a safetensors file (or a header being encoded) was rejected.
///
/// Every variant names the file; variants about one tensor name it too.
/// Headers being encoded by [`encode_header`](super::encode::encode_header) have no
/// file yet and carry [`ENCODE_PATH`](super::limits::ENCODE_PATH) instead.
#[derive(Debug, thiserror::Error)]
pub enum SafetensorsError {
    /// Opening or reading the file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The file is shorter than the 8-byte header length.
    #[error("{}: file is {len} bytes, too short for the 8-byte header length", path.display())]
    TooShort {
        /// The file.
        path: PathBuf,
        /// Its length.
        len: u64,
    },
    /// The header length exceeds [`MAX_HEADER_BYTES`].
    #[error("{}: header length {len} exceeds the limit of {MAX_HEADER_BYTES} bytes", path.display())]
    HeaderTooLarge {
        /// The file.
        path: PathBuf,
        /// The header length from the prefix.
        len: u64,
    },
    /// The header runs past the end of the file.
    #[error("{}: header of {header_len} bytes runs past the end of the {file_len}-byte file", path.display())]
    HeaderPastEnd {
        /// The file.
        path: PathBuf,
        /// The header length from the prefix.
        header_len: u64,
        /// The file's length.
        file_len: u64,
    },
    /// The header bytes handed to [`parse_header`](super::header::parse_header) are
    /// not as many as the length prefix says.
    #[error("{}: header slice holds {got} bytes but the prefix says {expected}", path.display())]
    HeaderLenMismatch {
        /// The file.
        path: PathBuf,
        /// The header length from the prefix.
        expected: u64,
        /// Bytes handed over.
        got: u64,
    },
    /// The header does not start with `{`.
    #[error("{}: header does not start with '{{' (first byte {})", path.display(), first_byte(*found))]
    NotStartingWithBrace {
        /// The file.
        path: PathBuf,
        /// The first header byte, if there is one.
        found: Option<u8>,
    },
    /// The header is not UTF-8.
    #[error("{}: header is not UTF-8 (invalid byte at header offset {valid_up_to})", path.display())]
    NotUtf8 {
        /// The file.
        path: PathBuf,
        /// Length of the valid UTF-8 prefix.
        valid_up_to: usize,
    },
    /// The header is not valid JSON (outside any tensor entry).
    #[error("{}: header is not valid JSON: {msg}", path.display())]
    InvalidJson {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        msg: String,
    },
    /// A tensor entry is malformed (missing field, wrong type, bad JSON).
    #[error("{}: tensor {name:?}: {msg}", path.display())]
    InvalidTensor {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// What is wrong.
        msg: String,
    },
    /// The `__metadata__` entry is not a map of strings to strings.
    #[error("{}: invalid __metadata__: {msg}", path.display())]
    InvalidMetadata {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// Two entries share a name.
    #[error("{}: tensor name {name:?} appears more than once", path.display())]
    DuplicateTensor {
        /// The file.
        path: PathBuf,
        /// The repeated name.
        name: String,
    },
    /// A tensor's dtype is not one of [`Dtype`](super::dtype::Dtype).
    #[error("{}: tensor {name:?} has unknown dtype {dtype:?}", path.display())]
    UnknownDtype {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// The dtype as written.
        dtype: String,
    },
    /// The element count or byte size of a shape overflows.
    #[error("{}: tensor {name:?}: shape {shape:?} overflows", path.display())]
    BadShape {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// The shape.
        shape: Vec<usize>,
    },
    /// A tensor's end offset is before its start.
    #[error("{}: tensor {name:?}: data offsets [{start}, {end}] end before they start", path.display())]
    BadOffsets {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// Start offset.
        start: u64,
        /// End offset.
        end: u64,
    },
    /// shape x dtype size differs from the span of the data offsets.
    #[error("{}: tensor {name:?}: shape x dtype is {expected} bytes but its offsets span {got}", path.display())]
    SizeMismatch {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// Bytes implied by shape and dtype.
        expected: u64,
        /// Bytes spanned by the offsets.
        got: u64,
    },
    /// A tensor starts before the previous one ends.
    #[error("{}: tensor {name:?} starts at {start}, inside tensor {previous:?} which ends at {previous_end}", path.display())]
    Overlap {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// The tensor it overlaps.
        previous: String,
        /// Its start offset.
        start: u64,
        /// Where the previous tensor ends.
        previous_end: u64,
    },
    /// Bytes between tensors (or before the first) belong to none.
    #[error("{}: tensor {name:?} starts at {start} but the previous data ends at {expected}: a gap", path.display())]
    Gap {
        /// The file.
        path: PathBuf,
        /// The tensor after the gap.
        name: String,
        /// Its start offset.
        start: u64,
        /// Where it should start.
        expected: u64,
    },
    /// A tensor ends past the end of the file (a truncated file).
    #[error("{}: tensor {name:?} ends at data byte {end} but the file holds only {data_len} data bytes (truncated?)", path.display())]
    OffsetsPastEnd {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// Its end offset.
        end: u64,
        /// Data bytes present in the file.
        data_len: u64,
    },
    /// The file is longer than header plus tensor data.
    #[error("{}: header and tensors account for {expected} bytes but the file has {got}", path.display())]
    FileLengthMismatch {
        /// The file.
        path: PathBuf,
        /// Length implied by the header.
        expected: u64,
        /// Actual length.
        got: u64,
    },
    /// [`encode_header`](super::encode::encode_header) was given an alignment that
    /// is not a power of two.
    #[error("{}: header alignment {align} is not a power of two", path.display())]
    BadAlignment {
        /// [`ENCODE_PATH`](super::limits::ENCODE_PATH).
        path: PathBuf,
        /// The alignment asked for.
        align: usize,
    },
}

fn first_byte(b: Option<u8>) -> String {
    match b {
        Some(b) => format!("0x{b:02x}"),
        None => "none: empty header".to_string(),
    }
}

impl SafetensorsError {
    /// The file the error is about.
    pub fn path(&self) -> &std::path::Path {
        use SafetensorsError::*;
        match self {
            Io { path, .. }
            | TooShort { path, .. }
            | HeaderTooLarge { path, .. }
            | HeaderPastEnd { path, .. }
            | HeaderLenMismatch { path, .. }
            | NotStartingWithBrace { path, .. }
            | NotUtf8 { path, .. }
            | InvalidJson { path, .. }
            | InvalidTensor { path, .. }
            | InvalidMetadata { path, .. }
            | DuplicateTensor { path, .. }
            | UnknownDtype { path, .. }
            | BadShape { path, .. }
            | BadOffsets { path, .. }
            | SizeMismatch { path, .. }
            | Overlap { path, .. }
            | Gap { path, .. }
            | OffsetsPastEnd { path, .. }
            | FileLengthMismatch { path, .. }
            | BadAlignment { path, .. } => path,
        }
    }

    /// The tensor the error is about, when it is about one.
    pub fn tensor(&self) -> Option<&str> {
        use SafetensorsError::*;
        match self {
            InvalidTensor { name, .. }
            | DuplicateTensor { name, .. }
            | UnknownDtype { name, .. }
            | BadShape { name, .. }
            | BadOffsets { name, .. }
            | SizeMismatch { name, .. }
            | Overlap { name, .. }
            | Gap { name, .. }
            | OffsetsPastEnd { name, .. } => Some(name),
            _ => None,
        }
    }
}
