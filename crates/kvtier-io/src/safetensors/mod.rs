//! A validating reader (and header encoder) for the safetensors format.
//!
//! A file is an 8-byte little-endian length N, N bytes of JSON, then the
//! data section. The JSON maps tensor names to `{dtype, shape,
//! data_offsets}` (offsets relative to the data section) plus an optional
//! `__metadata__` string map.
//!
//! [`parse_header`] makes every check the `safetensors` crate makes (size
//! limit, UTF-8 JSON, offsets contiguous with no gap or overlap, size =
//! shape x dtype, file length matches) and more: the header must start with
//! `{`, tensor names must not repeat, every dtype must be known. Each
//! failure is a typed [`SafetensorsError`] naming the file and, where there
//! is one, the tensor. No number read from a file sizes an allocation before
//! it is checked against the file's length.

mod dtype;
mod encode;
mod header;
mod header_read;
mod json;
mod limits;
mod safetensors_error;

pub use dtype::Dtype;
pub use encode::encode_header;
pub use header::{Header, TensorInfo, parse_header};
pub use header_read::{read_header, read_header_from};
pub use limits::{ENCODE_PATH, MAX_HEADER_BYTES, PREFIX_BYTES};
pub use safetensors_error::SafetensorsError;
