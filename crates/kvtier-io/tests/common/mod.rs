//! Helpers shared by the loader tests.

// Helpers outside #[test] fns unwrap too: clippy.toml lets tests unwrap.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use kvtier_io::{Backend, EngineConfig, IoEngine};
use safetensors::tensor::TensorView as RefView;

/// One engine per backend.
pub fn engines() -> Vec<IoEngine> {
    [Backend::ThreadPool, Backend::IoUring]
        .into_iter()
        .map(|b| IoEngine::new(EngineConfig { backend: Some(b) }))
        .collect()
}

/// Writes a shard with the reference crate; returns its path.
pub fn write_shard(path: &Path, seed: usize, count: usize) -> PathBuf {
    let datas: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = (0..count)
        .map(|i| {
            let (dtype, width) = match i % 3 {
                0 => (safetensors::Dtype::F32, 4),
                1 => (safetensors::Dtype::BF16, 2),
                _ => (safetensors::Dtype::U8, 1),
            };
            let shape = vec![7 + i, 1001 + seed];
            let n = shape.iter().product::<usize>() * width;
            let data = (0..n)
                .map(|k| ((k * 31 + i * 7 + seed * 3) % 251) as u8)
                .collect();
            (format!("s{seed}.t{i}"), dtype, shape, data)
        })
        .collect();
    let views: Vec<(String, RefView<'_>)> = datas
        .iter()
        .map(|(n, d, s, b)| (n.clone(), RefView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(
        views,
        Some(HashMap::from([("seed".into(), seed.to_string())])),
        path,
    )
    .unwrap();
    path.to_path_buf()
}
