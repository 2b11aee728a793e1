//! Reading a header from a file: the 8-byte length first, the size limit and
//! the file length checked before the header buffer is allocated.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::header::{Header, parse_header};
use super::limits::{MAX_HEADER_BYTES, PREFIX_BYTES};
use super::safetensors_error::SafetensorsError;

/// Reads the 8-byte length and the header of the file at `path` (the size
/// limit and the file length are checked before allocating) and validates
/// it against the file's length.
pub fn read_header(path: &Path) -> Result<Header, SafetensorsError> {
    let file = File::open(path).map_err(|source| SafetensorsError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    read_header_from(&file, path).map(|(header, _)| header)
}

/// Like [`read_header`] on an open file; also returns the raw prefix (the
/// 8-byte length and the N header bytes) exactly as read, so that a later
/// read of the same bytes can be checked against it.
pub fn read_header_from(file: &File, path: &Path) -> Result<(Header, Vec<u8>), SafetensorsError> {
    let io_err = |source: io::Error| SafetensorsError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file_len = file.metadata().map_err(io_err)?.len();
    if file_len < PREFIX_BYTES {
        return Err(SafetensorsError::TooShort {
            path: path.to_path_buf(),
            len: file_len,
        });
    }
    let mut len_bytes = [0u8; PREFIX_BYTES as usize];
    file.read_exact_at(&mut len_bytes, 0).map_err(io_err)?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > MAX_HEADER_BYTES {
        return Err(SafetensorsError::HeaderTooLarge {
            path: path.to_path_buf(),
            len: header_len,
        });
    }
    if PREFIX_BYTES + header_len > file_len {
        return Err(SafetensorsError::HeaderPastEnd {
            path: path.to_path_buf(),
            header_len,
            file_len,
        });
    }
    // Bounded by MAX_HEADER_BYTES and by the file's length: safe to allocate.
    let mut prefix = vec![0u8; (PREFIX_BYTES + header_len) as usize];
    file.read_exact_at(&mut prefix, 0).map_err(io_err)?;
    if prefix[..PREFIX_BYTES as usize] != len_bytes {
        return Err(io_err(io::Error::other(
            "the header length changed while it was being read",
        )));
    }
    let header = parse_header(path, &prefix[PREFIX_BYTES as usize..], header_len, file_len)?;
    Ok((header, prefix))
}
