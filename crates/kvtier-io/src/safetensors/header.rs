//! The parsed header: tensor entries and metadata, and the checks that make
//! a header trustworthy before any of its numbers size an allocation.

use std::collections::BTreeMap;
use std::path::Path;

use super::dtype::Dtype;
use super::json::{RawHeader, parse_raw};
use super::limits::{MAX_HEADER_BYTES, PREFIX_BYTES};
use super::safetensors_error::SafetensorsError;

/// One tensor's entry in a header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// The tensor's name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Dimensions, outermost first (row-major, little-endian elements).
    pub shape: Vec<usize>,
    /// `[start, end)` byte offsets relative to the data section, as in the file.
    pub data_offsets: (u64, u64),
}

impl TensorInfo {
    /// Number of elements (1 for a scalar), or `None` on overflow.
    pub fn num_elements(&self) -> Option<u64> {
        self.shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(u64::try_from(d).ok()?))
    }

    /// Bytes implied by shape and dtype, or `None` on overflow.
    pub fn byte_len(&self) -> Option<u64> {
        self.num_elements()?
            .checked_mul(self.dtype.size_bytes() as u64)
    }
}

/// A validated safetensors header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Tensor entries, sorted by start offset (ties by end offset, then name).
    pub tensors: Vec<TensorInfo>,
    /// The `__metadata__` string map (empty when absent).
    pub metadata: BTreeMap<String, String>,
    /// N: the header's byte length from the 8-byte prefix (padding included).
    pub header_len: u64,
}

impl Header {
    /// File offset of the data section: 8 + N.
    pub fn data_start(&self) -> u64 {
        PREFIX_BYTES + self.header_len
    }

    /// Bytes in the data section (the last tensor's end offset).
    pub fn data_len(&self) -> u64 {
        self.tensors.last().map_or(0, |t| t.data_offsets.1)
    }

    /// Total file length the header describes: 8 + N + data.
    pub fn file_len(&self) -> u64 {
        self.data_start() + self.data_len()
    }

    /// Where `t`'s bytes lie in the file (`data_start` + its offsets), or
    /// `None` if that overflows this platform's `usize`.
    pub fn file_range(&self, t: &TensorInfo) -> Option<std::ops::Range<usize>> {
        let start = self.data_start().checked_add(t.data_offsets.0)?;
        let end = self.data_start().checked_add(t.data_offsets.1)?;
        Some(usize::try_from(start).ok()?..usize::try_from(end).ok()?)
    }

    /// The entry named `name` (a linear scan; index it for repeated lookups).
    pub fn get(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// Parses and validates the JSON header bytes (the N bytes after the 8-byte
/// length) of `file`, whose total length is `file_len`.
///
/// Checks, in order: N within [`MAX_HEADER_BYTES`] and within the file, the
/// slice is N bytes, it starts with `{`, it is UTF-8 and JSON, no name
/// repeats, every dtype is known, `__metadata__` maps strings to strings,
/// and the tensors tile the data section exactly: each one's offsets span
/// shape x dtype bytes, with no overlap, no gap, nothing past the end, and
/// nothing after the last tensor.
pub fn parse_header(
    file: &Path,
    header_json: &[u8],
    header_len: u64,
    file_len: u64,
) -> Result<Header, SafetensorsError> {
    let path = || file.to_path_buf();
    if header_len > MAX_HEADER_BYTES {
        return Err(SafetensorsError::HeaderTooLarge {
            path: path(),
            len: header_len,
        });
    }
    let data_start = PREFIX_BYTES + header_len;
    if data_start > file_len {
        return Err(SafetensorsError::HeaderPastEnd {
            path: path(),
            header_len,
            file_len,
        });
    }
    if header_json.len() as u64 != header_len {
        return Err(SafetensorsError::HeaderLenMismatch {
            path: path(),
            expected: header_len,
            got: header_json.len() as u64,
        });
    }
    if header_json.first() != Some(&b'{') {
        return Err(SafetensorsError::NotStartingWithBrace {
            path: path(),
            found: header_json.first().copied(),
        });
    }
    let text = std::str::from_utf8(header_json).map_err(|e| SafetensorsError::NotUtf8 {
        path: path(),
        valid_up_to: e.valid_up_to(),
    })?;
    let RawHeader {
        tensors: raw,
        metadata,
    } = parse_raw(file, text)?;
    let mut tensors = Vec::with_capacity(raw.len());
    for (name, t) in raw {
        let Some(dtype) = Dtype::from_str_name(&t.dtype) else {
            return Err(SafetensorsError::UnknownDtype {
                path: path(),
                name,
                dtype: t.dtype,
            });
        };
        tensors.push(TensorInfo {
            name,
            dtype,
            shape: t.shape,
            data_offsets: t.data_offsets,
        });
    }
    sort_by_offset(&mut tensors);
    let data_len = file_len - data_start;
    let end = check_layout(file, &tensors, Some(data_len))?;
    if end != data_len {
        return Err(SafetensorsError::FileLengthMismatch {
            path: path(),
            expected: data_start + end,
            got: file_len,
        });
    }
    Ok(Header {
        tensors,
        metadata,
        header_len,
    })
}

/// Sorts entries by `(start, end)`, then name, the order they must tile.
pub(crate) fn sort_by_offset(tensors: &mut [TensorInfo]) {
    tensors.sort_by(|a, b| {
        a.data_offsets
            .cmp(&b.data_offsets)
            .then_with(|| a.name.cmp(&b.name))
    });
}

/// Checks that sorted entries tile `[0, end)` exactly and that each spans
/// shape x dtype bytes; with `data_len`, also that none ends past it.
/// Returns the end of the last tensor.
pub(crate) fn check_layout(
    path: &Path,
    tensors: &[TensorInfo],
    data_len: Option<u64>,
) -> Result<u64, SafetensorsError> {
    let mut expected = 0u64;
    let mut previous: Option<&str> = None;
    for t in tensors {
        let (start, end) = t.data_offsets;
        let name = || t.name.clone();
        if end < start {
            return Err(SafetensorsError::BadOffsets {
                path: path.to_path_buf(),
                name: name(),
                start,
                end,
            });
        }
        let Some(size) = t.byte_len() else {
            return Err(SafetensorsError::BadShape {
                path: path.to_path_buf(),
                name: name(),
                shape: t.shape.clone(),
            });
        };
        if end - start != size {
            return Err(SafetensorsError::SizeMismatch {
                path: path.to_path_buf(),
                name: name(),
                expected: size,
                got: end - start,
            });
        }
        if start < expected {
            return Err(SafetensorsError::Overlap {
                path: path.to_path_buf(),
                name: name(),
                previous: previous.unwrap_or_default().to_string(),
                start,
                previous_end: expected,
            });
        }
        if start > expected {
            return Err(SafetensorsError::Gap {
                path: path.to_path_buf(),
                name: name(),
                start,
                expected,
            });
        }
        if let Some(data_len) = data_len
            && end > data_len
        {
            return Err(SafetensorsError::OffsetsPastEnd {
                path: path.to_path_buf(),
                name: name(),
                end,
                data_len,
            });
        }
        expected = end;
        previous = Some(&t.name);
    }
    Ok(expected)
}
