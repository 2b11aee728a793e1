//! Rotary position embeddings: cos/sin tables for every position, built once.
//!
//! A sequence resuming from a restored prefix of any length simply reads the
//! table rows for its own absolute positions, so RoPE is right wherever the
//! suffix starts.

use candle_core::{DType, Device, Tensor};

use crate::model_config::ModelConfig;

/// Precomputed RoPE tables, `(max_positions, head_dim / 2)`.
#[derive(Debug, Clone)]
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
    max_positions: usize,
}

/// Inverse frequencies, with Llama 3 scaling when configured.
pub fn inv_freqs(cfg: &ModelConfig) -> Vec<f32> {
    let dim = cfg.head_dim();
    let base: Vec<f64> = (0..dim)
        .step_by(2)
        .map(|i| 1.0 / cfg.rope_theta.powf(i as f64 / dim as f64))
        .collect();
    let Some(rs) = &cfg.rope_scaling else {
        return base.into_iter().map(|f| f as f32).collect();
    };
    let old = rs.original_max_position_embeddings as f64;
    let low_wavelen = old / rs.low_freq_factor;
    let high_wavelen = old / rs.high_freq_factor;
    base.into_iter()
        .map(|freq| {
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            let f = if wavelen < high_wavelen {
                freq
            } else if wavelen > low_wavelen {
                freq / rs.factor
            } else {
                let smooth = (old / wavelen - rs.low_freq_factor)
                    / (rs.high_freq_factor - rs.low_freq_factor);
                (1.0 - smooth) * freq / rs.factor + smooth * freq
            };
            f as f32
        })
        .collect()
}

impl Rope {
    /// Tables for positions `0..max_positions`.
    pub fn new(
        cfg: &ModelConfig,
        max_positions: usize,
        device: &Device,
    ) -> candle_core::Result<Self> {
        let inv = inv_freqs(cfg);
        let half = inv.len();
        let inv = Tensor::from_vec(inv, (1, half), device)?;
        let pos = Tensor::arange(0u32, max_positions as u32, device)?
            .to_dtype(DType::F32)?
            .reshape((max_positions, 1))?;
        let freqs = pos.matmul(&inv)?;
        Ok(Self {
            cos: freqs.cos()?,
            sin: freqs.sin()?,
            max_positions,
        })
    }

    /// Positions covered.
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// Applies RoPE to `x` of shape `(heads, t, head_dim)` at positions
    /// `start..start + t` (the non-interleaved "rotate half" form of HF Llama).
    pub fn apply(&self, x: &Tensor, start: usize) -> candle_core::Result<Tensor> {
        let (_h, t, _d) = x.dims3()?;
        let cos = self.cos.narrow(0, start, t)?;
        let sin = self.sin.narrow(0, start, t)?;
        candle_nn::rotary_emb::rope(&x.unsqueeze(0)?.contiguous()?, &cos, &sin)?.squeeze(0)
    }
}
