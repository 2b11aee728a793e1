//! A bf16 checkpoint loads through the same path (converted to f32 for CPU
//! compute) and gives the logits of the f32 model up to bf16 rounding.

// Test helpers outside #[test] fns may unwrap: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

use kvtier_engine::{Engine, EngineOptions, Preset, write_preset};
use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, TensorView};

#[test]
fn bf16_checkpoint_matches_f32_up_to_rounding() {
    let f32_dir = tempfile::tempdir().unwrap();
    write_preset(Preset::Tiny, 11, f32_dir.path()).unwrap();
    let bf16_dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(f32_dir.path().join(f), bf16_dir.path().join(f)).unwrap();
    }
    let bytes = std::fs::read(f32_dir.path().join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let converted: Vec<(String, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let data: Vec<u8> = view
                .data()
                .chunks_exact(4)
                .flat_map(|c| {
                    let x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                    half::bf16::from_f32(x).to_le_bytes()
                })
                .collect();
            (name, view.shape().to_vec(), data)
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = converted
        .iter()
        .map(|(n, s, d)| {
            (
                n.clone(),
                TensorView::new(Dtype::BF16, s.clone(), d).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &bf16_dir.path().join("model.safetensors"))
        .unwrap();

    let opts = || EngineOptions {
        block_tokens: 16,
        pool_pages: 16,
        max_seq_tokens: 256,
        prefix_reuse: false,
        ..Default::default()
    };
    let prompt: Vec<u32> = (0..40).map(|i| (i * 11 + 5) % 256).collect();
    let a = Engine::load(f32_dir.path(), opts(), None)
        .unwrap()
        .prefill(&prompt)
        .unwrap();
    let b = Engine::load(bf16_dir.path(), opts(), None)
        .unwrap()
        .prefill(&prompt)
        .unwrap();
    let diff = a
        .logits
        .iter()
        .zip(&b.logits)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(
        diff > 0.0,
        "bf16 rounding must show: the file really is bf16"
    );
    assert!(diff < 1e-2, "bf16 logits differ from f32 by {diff}");
}
