//! Weights checked as they load: a NaN or infinite value anywhere, or a
//! tensor that is all zeros (a bias excepted: zero biases are a common
//! initialisation), is an error naming the tensor and its file. Such a model
//! would start and answer every prompt with garbage (`"\u0000"`), so it is
//! refused instead.
//!
//! The checks read the stored bits (no conversion): one pass over the
//! bytes, about a tenth of a second per 100 M f32 parameters here.

use kvtier_io::safetensors::Dtype;

/// What is wrong with tensor `name` of `dtype` stored as `data`, if
/// anything (integer tensors are not checked).
pub fn check_tensor(name: &str, dtype: Dtype, data: &[u8]) -> Result<(), String> {
    // (exponent mask, magnitude mask) per float width.
    let (found_bad, all_zero) = match dtype {
        Dtype::F32 => scan::<4>(data, 0x7f80_0000, 0x7fff_ffff),
        Dtype::F64 => scan::<8>(data, 0x7ff0_0000_0000_0000, 0x7fff_ffff_ffff_ffff),
        Dtype::F16 => scan::<2>(data, 0x7c00, 0x7fff),
        Dtype::Bf16 => scan::<2>(data, 0x7f80, 0x7fff),
        _ => return Ok(()),
    };
    if let Some(i) = found_bad {
        return Err(format!(
            "tensor {name} holds a NaN or infinite value (element {i})"
        ));
    }
    if all_zero && !data.is_empty() && !name.ends_with(".bias") {
        return Err(format!("tensor {name} is all zeros"));
    }
    Ok(())
}

/// The first element whose exponent bits are all set (NaN or infinity),
/// and whether every element's magnitude is zero. `N` bytes per element,
/// little-endian.
fn scan<const N: usize>(data: &[u8], exp: u64, mag: u64) -> (Option<usize>, bool) {
    let mut all_zero = true;
    for (i, c) in data.chunks_exact(N).enumerate() {
        let mut b = [0u8; 8];
        b[..N].copy_from_slice(c);
        let bits = u64::from_le_bytes(b);
        if bits & exp == exp {
            return (Some(i), false);
        }
        all_zero &= bits & mag == 0;
    }
    (None, all_zero)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn nan_inf_and_all_zero_tensors_are_named_and_good_ones_pass() {
        let w = "model.layers.0.mlp.up_proj.weight";
        assert!(check_tensor(w, Dtype::F32, &f32s(&[0.5, -1.0, 0.0])).is_ok());
        let e = check_tensor(w, Dtype::F32, &f32s(&[0.5, f32::NAN])).unwrap_err();
        assert!(e.contains(w) && e.contains("element 1"), "{e}");
        assert!(check_tensor(w, Dtype::F32, &f32s(&[f32::NEG_INFINITY])).is_err());
        let e = check_tensor(w, Dtype::F32, &f32s(&[0.0, -0.0])).unwrap_err();
        assert!(e.contains("all zeros"), "{e}");
        // A zero bias is fine; integer tensors are not checked.
        assert!(check_tensor("q_proj.bias", Dtype::F32, &f32s(&[0.0, 0.0])).is_ok());
        assert!(check_tensor(w, Dtype::I32, &[0, 0, 0, 0]).is_ok());
        let bf16 = |x: f32| half::bf16::from_f32(x).to_bits().to_le_bytes();
        let f16 = |x: f32| half::f16::from_f32(x).to_bits().to_le_bytes();
        assert!(check_tensor(w, Dtype::Bf16, &[bf16(1.5), bf16(0.0)].concat()).is_ok());
        assert!(check_tensor(w, Dtype::Bf16, &bf16(f32::NAN)).is_err());
        assert!(check_tensor(w, Dtype::F16, &f16(f32::INFINITY)).is_err());
        assert!(check_tensor(w, Dtype::F16, &[f16(-0.0), f16(0.0)].concat()).is_err());
        assert!(check_tensor(w, Dtype::F64, &f64::NAN.to_le_bytes()).is_err());
        assert!(check_tensor(w, Dtype::F64, &2.0f64.to_le_bytes()).is_ok());
    }
}
