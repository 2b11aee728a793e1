//! Serialising a header for writing (used by the checkpoint writer).

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;

use super::header::{TensorInfo, check_layout, sort_by_offset};
use super::json::METADATA_KEY;
use super::limits::{ENCODE_PATH, MAX_HEADER_BYTES, PREFIX_BYTES};
use super::safetensors_error::SafetensorsError;

/// Serialises a header for writing: returns the full prefix, the 8-byte
/// little-endian length N followed by N bytes of JSON, padded with spaces so
/// that 8 + N is a multiple of `align` (a power of two; the data section
/// then starts aligned).
///
/// The tensors must tile their data section exactly, as [`parse_header`]
/// demands: no gaps, so alignment padding between tensors has to be an
/// explicit (for example `U8`) tensor of its own. Entries are written in
/// offset order, `__metadata__` first when not empty. Errors carry
/// [`ENCODE_PATH`] as their path.
///
/// [`parse_header`]: super::parse_header
pub fn encode_header(
    tensors: &[TensorInfo],
    metadata: &BTreeMap<String, String>,
    align: usize,
) -> Result<Vec<u8>, SafetensorsError> {
    let path = || PathBuf::from(ENCODE_PATH);
    if !align.is_power_of_two() {
        return Err(SafetensorsError::BadAlignment {
            path: path(),
            align,
        });
    }
    let mut seen = HashSet::with_capacity(tensors.len());
    for t in tensors {
        if t.name == METADATA_KEY || !seen.insert(t.name.as_str()) {
            return Err(SafetensorsError::DuplicateTensor {
                path: path(),
                name: t.name.clone(),
            });
        }
    }
    let mut sorted = tensors.to_vec();
    sort_by_offset(&mut sorted);
    check_layout(&path(), &sorted, None)?;

    let json_err = |e: serde_json::Error| SafetensorsError::InvalidJson {
        path: path(),
        msg: e.to_string(),
    };
    let mut json: Vec<u8> = Vec::with_capacity(64 + 96 * sorted.len());
    json.push(b'{');
    let mut first = true;
    if !metadata.is_empty() {
        json.extend_from_slice(b"\"__metadata__\":");
        serde_json::to_writer(&mut json, metadata).map_err(json_err)?;
        first = false;
    }
    for t in &sorted {
        if !first {
            json.push(b',');
        }
        first = false;
        serde_json::to_writer(&mut json, &t.name).map_err(json_err)?;
        json.extend_from_slice(b":{\"dtype\":\"");
        json.extend_from_slice(t.dtype.as_str().as_bytes());
        json.extend_from_slice(b"\",\"shape\":");
        serde_json::to_writer(&mut json, &t.shape).map_err(json_err)?;
        let (s, e) = t.data_offsets;
        json.extend_from_slice(format!(",\"data_offsets\":[{s},{e}]}}").as_bytes());
    }
    json.push(b'}');

    let unpadded = PREFIX_BYTES as usize + json.len();
    let padded = unpadded.next_multiple_of(align);
    let header_len = (padded - PREFIX_BYTES as usize) as u64;
    if header_len > MAX_HEADER_BYTES {
        return Err(SafetensorsError::HeaderTooLarge {
            path: path(),
            len: header_len,
        });
    }
    let mut out = Vec::with_capacity(padded);
    out.extend_from_slice(&header_len.to_le_bytes());
    out.extend_from_slice(&json);
    out.resize(padded, b' ');
    Ok(out)
}
