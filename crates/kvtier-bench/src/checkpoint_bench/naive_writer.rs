//! The naive contender of the checkpoint bench: per shard,
//! `safetensors::serialize_to_file` (buffered, 1 MiB `BufWriter`, temp
//! file + rename), then `fsync` of the file; at the end `fsync` of the
//! directory. Durable, not crash-consistent across shards.

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use kvtier_io::checkpoint::fsync_dir;
use kvtier_io::safetensors::{Dtype, TensorInfo};

use crate::bench_error::{BenchError, Result, StepContext};

/// The `safetensors` crate's name of `d`.
pub fn st_dtype(d: Dtype) -> safetensors::Dtype {
    use safetensors::Dtype as S;
    match d {
        Dtype::Bool => S::BOOL,
        Dtype::U8 => S::U8,
        Dtype::I8 => S::I8,
        Dtype::F8E5M2 => S::F8_E5M2,
        Dtype::F8E4M3 => S::F8_E4M3,
        Dtype::I16 => S::I16,
        Dtype::U16 => S::U16,
        Dtype::F16 => S::F16,
        Dtype::Bf16 => S::BF16,
        Dtype::I32 => S::I32,
        Dtype::U32 => S::U32,
        Dtype::F32 => S::F32,
        Dtype::F64 => S::F64,
        Dtype::I64 => S::I64,
        Dtype::U64 => S::U64,
    }
}

/// Splits tensors (in order) into shards of at most `shard_bytes` of data,
/// never splitting one (the kvtier writer's rule).
pub fn group_shards(tensors: &[TensorInfo], shard_bytes: u64) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut cur = Vec::new();
    let mut cur_bytes = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        let b = t.data_offsets.1 - t.data_offsets.0;
        if !cur.is_empty() && cur_bytes + b > shard_bytes {
            out.push(std::mem::take(&mut cur));
            cur_bytes = 0;
        }
        cur.push(i);
        cur_bytes += b;
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// One naive save into `dir` (which exists) of `tensors` with bytes `data`
/// (indexed alike): returns (files, file bytes).
pub fn naive_save(
    dir: &Path,
    tensors: &[TensorInfo],
    data: &[&[u8]],
    groups: &[Vec<usize>],
) -> Result<(usize, u64)> {
    let mut file_bytes = 0;
    for (s, group) in groups.iter().enumerate() {
        let path = dir.join(format!(
            "model-{:05}-of-{:05}.safetensors",
            s + 1,
            groups.len()
        ));
        let views = group
            .iter()
            .map(|&i| {
                let t = &tensors[i];
                safetensors::tensor::TensorView::new(st_dtype(t.dtype), t.shape.clone(), data[i])
                    .map(|v| (t.name.clone(), v))
                    .map_err(|e| BenchError::Failed(format!("tensor {}: {e}", t.name)))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut meta = HashMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        safetensors::serialize_to_file(views, Some(meta), &path)
            .map_err(|e| BenchError::Failed(format!("writing {}: {e}", path.display())))?;
        let f = File::open(&path).with_step(|| format!("cannot open {}", path.display()))?;
        f.sync_all()
            .with_step(|| format!("fsync of {}", path.display()))?;
        file_bytes += f.metadata()?.len();
    }
    fsync_dir(dir)?;
    Ok((groups.len(), file_bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::common::fill::{fill_random, random_state};
    use crate::models::model_synth::plan_model;

    fn t(name: &str, a: u64, b: u64) -> TensorInfo {
        TensorInfo {
            name: name.into(),
            dtype: Dtype::U8,
            shape: vec![(b - a) as usize],
            data_offsets: (a, b),
        }
    }

    #[test]
    fn groups_like_the_writer() {
        let ts = [
            t("a", 0, 10),
            t("b", 10, 20),
            t("c", 20, 45),
            t("d", 45, 50),
        ];
        assert_eq!(group_shards(&ts, 20), vec![vec![0, 1], vec![2], vec![3]]);
        assert_eq!(group_shards(&ts, 1000), vec![vec![0, 1, 2, 3]]);
        assert!(group_shards(&[], 10).is_empty());
    }

    #[test]
    fn naive_save_writes_readable_shards() {
        let dir = tempfile::tempdir().unwrap();
        let plan = plan_model(1 << 20, 1).unwrap();
        let tensors = &plan[0].tensors;
        let mut data = vec![0u8; plan[0].data_bytes() as usize];
        fill_random(&mut data, &mut random_state(1));
        let slices: Vec<&[u8]> = tensors
            .iter()
            .map(|t| &data[t.data_offsets.0 as usize..t.data_offsets.1 as usize])
            .collect();
        let groups = group_shards(tensors, 256 << 10);
        let (files, bytes) = naive_save(dir.path(), tensors, &slices, &groups).unwrap();
        assert_eq!(files, groups.len());
        assert!(bytes > data.len() as u64);
        let f = std::fs::read(
            dir.path()
                .join(format!("model-00001-of-{:05}.safetensors", files)),
        )
        .unwrap();
        assert!(safetensors::SafeTensors::deserialize(&f).is_ok());
    }

    #[test]
    fn dtypes_map_by_name() {
        for d in Dtype::ALL {
            let s = format!("{:?}", st_dtype(d)).replace('_', "");
            assert_eq!(s, d.as_str().replace('_', ""), "{d}");
        }
    }
}
