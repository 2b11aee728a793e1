//! Rotary position embeddings: cos/sin tables for every position, built once.
//!
//! A sequence resuming from a restored prefix of any length simply reads the
//! table rows for its own absolute positions, so RoPE is right wherever the
//! suffix starts.
//!
//! Frequencies follow `transformers`' `modeling_rope_utils` for the scaling
//! kinds of [`RopeKind`]; only the first `rotary_dim` dimensions of a head
//! rotate (Phi-3's partial rotary factor), the rest pass through.

use candle_core::{DType, Device, Tensor};

use crate::model_dir::model_config::{RopeKind, RopeParams};

/// Precomputed RoPE tables, `(max_positions, rotary_dim / 2)`.
#[derive(Debug, Clone)]
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
    /// The same tables as host vectors, for the hand-written decode step.
    host: Option<(Vec<f32>, Vec<f32>)>,
    max_positions: usize,
    rotary_dim: usize,
}

/// Inverse frequencies, one per rotating pair of dimensions.
pub fn inv_freqs(p: &RopeParams) -> Vec<f32> {
    let dim = p.rotary_dim;
    let base: Vec<f64> = (0..dim)
        .step_by(2)
        .map(|i| 1.0 / p.theta.powf(i as f64 / dim as f64))
        .collect();
    match p.kind {
        RopeKind::Default => base.into_iter().map(|f| f as f32).collect(),
        RopeKind::Linear { factor } => base.into_iter().map(|f| (f / factor) as f32).collect(),
        RopeKind::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original,
        } => {
            let old = original as f64;
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            base.into_iter()
                .map(|freq| {
                    let wavelen = 2.0 * std::f64::consts::PI / freq;
                    let f = if wavelen < high_wavelen {
                        freq
                    } else if wavelen > low_wavelen {
                        freq / factor
                    } else {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * freq / factor + smooth * freq
                    };
                    f as f32
                })
                .collect()
        }
        RopeKind::Yarn {
            factor,
            original,
            beta_fast,
            beta_slow,
            truncate,
        } => {
            // The dimension at which a frequency makes `rotations` turns
            // over the pretraining context.
            let correction_dim = |rotations: f64| {
                dim as f64 * (original as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln()
                    / (2.0 * p.theta.ln())
            };
            let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
            if truncate {
                low = low.floor();
                high = high.ceil();
            }
            let low = low.max(0.0);
            let high = high.min(dim as f64 - 1.0);
            let span = if low == high { 0.001 } else { high - low };
            base.into_iter()
                .enumerate()
                .map(|(i, extrapolated)| {
                    // transformers computes these in f32.
                    let ramp = ((i as f64 - low) / span).clamp(0.0, 1.0) as f32;
                    let keep = 1.0 - ramp;
                    let interpolated = (extrapolated / factor) as f32;
                    interpolated * (1.0 - keep) + extrapolated as f32 * keep
                })
                .collect()
        }
    }
}

impl Rope {
    /// Tables for positions `0..max_positions`.
    pub fn new(p: &RopeParams, max_positions: usize, device: &Device) -> candle_core::Result<Self> {
        let inv = inv_freqs(p);
        let half = inv.len();
        let inv = Tensor::from_vec(inv, (1, half), device)?;
        let pos = Tensor::arange(0u32, max_positions as u32, device)?
            .to_dtype(DType::F32)?
            .reshape((max_positions, 1))?;
        let freqs = pos.matmul(&inv)?;
        let scale = p.attention_factor;
        let cos = (freqs.cos()? * scale)?;
        let sin = (freqs.sin()? * scale)?;
        let host = if device.is_cpu() {
            Some((cos.flatten_all()?.to_vec1()?, sin.flatten_all()?.to_vec1()?))
        } else {
            None
        };
        Ok(Self {
            cos,
            sin,
            host,
            max_positions,
            rotary_dim: p.rotary_dim,
        })
    }

    /// Rotates one head's vector `x` (`head_dim` values) to position `pos`
    /// in place, as [`apply`](Self::apply) does (host tables; false when
    /// there are none or `pos` is past them).
    pub fn rotate(&self, x: &mut [f32], pos: usize) -> bool {
        let Some((cos, sin)) = &self.host else {
            return false;
        };
        let half = self.rotary_dim / 2;
        let (Some(c), Some(s)) = (
            cos.get(pos * half..(pos + 1) * half),
            sin.get(pos * half..(pos + 1) * half),
        ) else {
            return false;
        };
        if x.len() < self.rotary_dim {
            return false;
        }
        let (lo, hi) = x[..self.rotary_dim].split_at_mut(half);
        for i in 0..half {
            let (a, b) = (lo[i], hi[i]);
            lo[i] = a * c[i] - b * s[i];
            hi[i] = b * c[i] + a * s[i];
        }
        true
    }

    /// Positions covered.
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// Applies RoPE to `x` of shape `(heads, t, head_dim)` at positions
    /// `start..start + t` (the non-interleaved "rotate half" form of HF
    /// Llama, over the first `rotary_dim` dimensions).
    pub fn apply(&self, x: &Tensor, start: usize) -> candle_core::Result<Tensor> {
        let (_h, t, d) = x.dims3()?;
        let cos = self.cos.narrow(0, start, t)?;
        let sin = self.sin.narrow(0, start, t)?;
        if self.rotary_dim == d {
            return candle_nn::rotary_emb::rope(&x.unsqueeze(0)?.contiguous()?, &cos, &sin)?
                .squeeze(0);
        }
        let rot = x
            .narrow(2, 0, self.rotary_dim)?
            .unsqueeze(0)?
            .contiguous()?;
        let rot = candle_nn::rotary_emb::rope(&rot, &cos, &sin)?.squeeze(0)?;
        let pass = x.narrow(2, self.rotary_dim, d - self.rotary_dim)?;
        Tensor::cat(&[&rot, &pass], 2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(kind: RopeKind, rotary_dim: usize) -> RopeParams {
        RopeParams {
            theta: 10_000.0,
            rotary_dim,
            kind,
            attention_factor: 1.0,
        }
    }

    #[test]
    fn yarn_keeps_high_frequencies_and_divides_low_ones() {
        let p = params(
            RopeKind::Yarn {
                factor: 4.0,
                original: 256,
                beta_fast: 32.0,
                beta_slow: 1.0,
                truncate: true,
            },
            64,
        );
        let plain = inv_freqs(&params(RopeKind::Default, 64));
        let yarn = inv_freqs(&p);
        assert_eq!(plain.len(), 32);
        // The first pair turns fast: extrapolated (unchanged); the last
        // turns slowly: interpolated (divided by the factor).
        assert!((yarn[0] - plain[0]).abs() < 1e-7);
        assert!((yarn[31] - plain[31] / 4.0).abs() < 1e-9);
        assert!(yarn.iter().zip(&plain).all(|(y, p)| *y <= *p + 1e-9));
    }

    #[test]
    fn partial_rotary_leaves_the_other_dimensions_alone() {
        let dev = Device::Cpu;
        let rope = Rope::new(&params(RopeKind::Default, 4), 16, &dev).unwrap();
        let x = Tensor::arange(0f32, 2. * 3. * 8., &dev)
            .unwrap()
            .reshape((2, 3, 8))
            .unwrap();
        let y = rope.apply(&x, 5).unwrap();
        let pass_x: Vec<f32> = x
            .narrow(2, 4, 4)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let pass_y: Vec<f32> = y
            .narrow(2, 4, 4)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(pass_x, pass_y);
        let rot_x: Vec<f32> = x
            .narrow(2, 0, 4)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let rot_y: Vec<f32> = y
            .narrow(2, 0, 4)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_ne!(rot_x, rot_y);
    }
}
