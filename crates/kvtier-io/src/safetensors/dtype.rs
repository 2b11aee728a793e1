//! Element types of safetensors tensors.

use std::fmt;

/// The element type of a tensor, as named in a safetensors header.
///
/// Only byte-sized types are supported; sub-byte (`F4`, `F6_*`) and complex
/// types are rejected as unknown dtypes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dtype {
    /// Boolean, one byte.
    Bool,
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 8-bit integer.
    I8,
    /// 8-bit float, 5 exponent and 2 mantissa bits.
    F8E5M2,
    /// 8-bit float, 4 exponent and 3 mantissa bits.
    F8E4M3,
    /// Signed 16-bit integer.
    I16,
    /// Unsigned 16-bit integer.
    U16,
    /// IEEE half-precision float.
    F16,
    /// bfloat16.
    Bf16,
    /// Signed 32-bit integer.
    I32,
    /// Unsigned 32-bit integer.
    U32,
    /// IEEE single-precision float.
    F32,
    /// IEEE double-precision float.
    F64,
    /// Signed 64-bit integer.
    I64,
    /// Unsigned 64-bit integer.
    U64,
}

impl Dtype {
    /// Every supported dtype, smallest first.
    pub const ALL: [Dtype; 15] = [
        Dtype::Bool,
        Dtype::U8,
        Dtype::I8,
        Dtype::F8E5M2,
        Dtype::F8E4M3,
        Dtype::I16,
        Dtype::U16,
        Dtype::F16,
        Dtype::Bf16,
        Dtype::I32,
        Dtype::U32,
        Dtype::F32,
        Dtype::F64,
        Dtype::I64,
        Dtype::U64,
    ];

    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            Dtype::Bool | Dtype::U8 | Dtype::I8 | Dtype::F8E5M2 | Dtype::F8E4M3 => 1,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 4,
            Dtype::F64 | Dtype::I64 | Dtype::U64 => 8,
        }
    }

    /// The name used in safetensors headers ("F32", "BF16", "F8_E4M3", ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::Bool => "BOOL",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8E5M2 => "F8_E5M2",
            Dtype::F8E4M3 => "F8_E4M3",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::Bf16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::F64 => "F64",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
        }
    }

    /// The dtype a header names, if it is a supported one (exact, case-sensitive).
    pub fn from_str_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|d| d.as_str() == name)
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_are_case_sensitive() {
        for d in Dtype::ALL {
            assert_eq!(Dtype::from_str_name(d.as_str()), Some(d));
        }
        assert_eq!(Dtype::from_str_name("f32"), None);
        assert_eq!(Dtype::from_str_name("F4"), None);
        assert_eq!(Dtype::from_str_name("C64"), None);
    }

    #[test]
    fn sizes() {
        assert_eq!(Dtype::Bool.size_bytes(), 1);
        assert_eq!(Dtype::Bf16.size_bytes(), 2);
        assert_eq!(Dtype::U32.size_bytes(), 4);
        assert_eq!(Dtype::I64.size_bytes(), 8);
    }
}
