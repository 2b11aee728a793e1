//! The synthetic model writer (`kvtier model synth`): a sharded
//! safetensors model of a given size (pseudo-random F16 and F32 tensors, the Hugging Face shard
//! names and `model.safetensors.index.json`), to benchmark loaders on.
//!
//! Tensors are F16 and F32 rather than BF16 so that every contender,
//! `safetensors.numpy` included (NumPy has no bfloat16), can load them; the
//! bytes on disk are what matters to a loader, not their type.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::bench_error::{Result, StepContext, fail};
use kvtier_io::checkpoint::fsync_dir;
use kvtier_io::loader::{INDEX_FILE, SINGLE_FILE};
use kvtier_io::safetensors::{Dtype, TensorInfo, encode_header};

use crate::common::fill::{fill_random, random_state};
use crate::common::progress::progress_bar;
use crate::common::size::format_size;
use crate::machine::host::free_bytes;
use crate::reporting::text_report::TextReport;

/// Largest tensor of a synthetic model.
const MAX_TENSOR_BYTES: u64 = 32 << 20;
/// Bytes of one norm vector (4096 F32 values).
const NORM_BYTES: u64 = 16 << 10;
/// Bytes generated and written per `write_all`.
const WRITE_CHUNK: usize = 8 << 20;

/// One shard of the plan: its file name and its tensors, in file order.
#[derive(Debug, Clone)]
pub struct ShardPlan {
    /// File name inside the model directory.
    pub file: String,
    /// Tensors with offsets relative to the data section.
    pub tensors: Vec<TensorInfo>,
}

impl ShardPlan {
    /// Bytes of tensor data.
    pub fn data_bytes(&self) -> u64 {
        self.tensors.last().map_or(0, |t| t.data_offsets.1)
    }
}

/// Shard file name `i` (from 0) of `n`, as Hugging Face names them.
pub fn shard_name(i: usize, n: usize) -> String {
    format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
}

fn shape_for(dtype: Dtype, bytes: u64) -> Vec<usize> {
    let elems = (bytes / dtype.size_bytes() as u64) as usize;
    let cols = match dtype {
        Dtype::F16 => 2048,
        _ => 1024,
    };
    if elems >= cols && elems.is_multiple_of(cols) {
        vec![elems / cols, cols]
    } else {
        vec![elems]
    }
}

/// Plans `total` bytes of tensor data (rounded down to a multiple of 4 per
/// shard) in `shards` shards: per layer an F16 attention matrix, an F32 MLP
/// matrix and an F32 norm vector, at most 32 MiB each.
pub fn plan_model(total: u64, shards: u32) -> Result<Vec<ShardPlan>> {
    let n = u64::from(shards.max(1));
    let per_shard = total / n / 4 * 4;
    if per_shard == 0 {
        fail!(
            "{} is too small for {n} shard(s): each needs at least 4 bytes of tensor data",
            format_size(total)
        );
    }
    let big = (per_shard / 8).clamp(4 << 10, MAX_TENSOR_BYTES) / 4 * 4;
    let mut layer = 0u64;
    let mut out = Vec::with_capacity(n as usize);
    for s in 0..n as usize {
        let mut tensors = Vec::new();
        let mut off = 0u64;
        let mut push = |name: String, dtype: Dtype, want: u64, off: &mut u64| {
            let bytes = want.min(per_shard - *off);
            if bytes == 0 {
                return;
            }
            tensors.push(TensorInfo {
                name,
                dtype,
                shape: shape_for(dtype, bytes),
                data_offsets: (*off, *off + bytes),
            });
            *off += bytes;
        };
        while off < per_shard {
            let p = format!("model.layers.{layer}");
            push(format!("{p}.self_attn.weight"), Dtype::F16, big, &mut off);
            push(format!("{p}.mlp.weight"), Dtype::F32, big, &mut off);
            push(
                format!("{p}.input_layernorm.weight"),
                Dtype::F32,
                NORM_BYTES,
                &mut off,
            );
            layer += 1;
        }
        out.push(ShardPlan {
            file: shard_name(s, n as usize),
            tensors,
        });
    }
    Ok(out)
}

/// Removes an existing model from `dir` when `force`, else refuses to
/// overwrite one.
fn clear_dir(dir: &Path, force: bool) -> Result<()> {
    let mut existing: Vec<PathBuf> = Vec::new();
    for entry in std::fs::read_dir(dir).with_step(|| format!("cannot list {}", dir.display()))? {
        let path = entry
            .with_step(|| format!("cannot list {}", dir.display()))?
            .path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.ends_with(".safetensors") || name == INDEX_FILE {
            existing.push(path);
        }
    }
    if existing.is_empty() {
        return Ok(());
    }
    if !force {
        fail!(
            "{} already holds a model ({} file(s) such as {}); pass --force to replace it",
            dir.display(),
            existing.len(),
            existing[0].display()
        );
    }
    for p in existing {
        std::fs::remove_file(&p).with_step(|| format!("cannot remove {}", p.display()))?;
    }
    Ok(())
}

/// What `model synth` wrote.
#[derive(Debug, Clone)]
pub struct Synthesized {
    /// The shard files.
    pub files: Vec<PathBuf>,
    /// Their total length in bytes.
    pub file_bytes: u64,
    /// Number of tensors.
    pub tensors: usize,
}

/// Writes the model `plan` into `dir` (which must exist), with contents
/// from `seed`, and the index; everything fsynced.
pub fn write_model(dir: &Path, plan: &[ShardPlan], seed: u64, quiet: bool) -> Result<Synthesized> {
    let total: u64 = plan.iter().map(ShardPlan::data_bytes).sum();
    let pb = progress_bar(total, quiet);
    let mut state = random_state(seed);
    let mut chunk = vec![0u8; WRITE_CHUNK];
    let mut files = Vec::with_capacity(plan.len());
    let mut file_bytes = 0u64;
    let mut weight_map = BTreeMap::new();
    for shard in plan {
        pb.set_message(shard.file.clone());
        let path = dir.join(&shard.file);
        let mut meta = BTreeMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        let header = encode_header(&shard.tensors, &meta, 8)
            .with_step(|| format!("encoding the header of {}", shard.file))?;
        let mut f =
            File::create(&path).with_step(|| format!("cannot create {}", path.display()))?;
        f.write_all(&header)
            .with_step(|| format!("writing {}", path.display()))?;
        let mut left = shard.data_bytes();
        while left > 0 {
            let n = (left as usize).min(WRITE_CHUNK);
            fill_random(&mut chunk[..n], &mut state);
            f.write_all(&chunk[..n])
                .with_step(|| format!("writing {}", path.display()))?;
            left -= n as u64;
            pb.inc(n as u64);
        }
        f.sync_all()
            .with_step(|| format!("syncing {}", path.display()))?;
        file_bytes += header.len() as u64 + shard.data_bytes();
        for t in &shard.tensors {
            weight_map.insert(t.name.clone(), shard.file.clone());
        }
        files.push(path);
    }
    pb.finish_and_clear();
    let index = serde_json::json!({
        "metadata": { "total_size": total },
        "weight_map": weight_map,
    });
    let index_path = dir.join(INDEX_FILE);
    let text = serde_json::to_vec_pretty(&index)?;
    let mut f = File::create(&index_path)
        .with_step(|| format!("cannot create {}", index_path.display()))?;
    f.write_all(&text)
        .and_then(|()| f.sync_all())
        .with_step(|| format!("writing {}", index_path.display()))?;
    fsync_dir(dir)?;
    Ok(Synthesized {
        files,
        file_bytes,
        tensors: weight_map.len(),
    })
}

/// What to write (`kvtier model synth`).
#[derive(Debug, Clone)]
pub struct ModelSynthOptions {
    /// Directory to write the model into (created if missing).
    pub dir: PathBuf,
    /// Bytes of tensor data in all.
    pub bytes: u64,
    /// Number of shard files.
    pub shards: u32,
    /// Replace an existing model in `dir` (its `*.safetensors` and index).
    pub force: bool,
    /// Seed of the pseudo-random tensor contents.
    pub seed: u64,
    /// Show a progress bar on stderr.
    pub progress: bool,
}

impl ModelSynthOptions {
    /// `kvtier model synth`'s defaults (4 GiB in 2 shards, seed 1) into
    /// `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            bytes: 4 << 30,
            shards: 2,
            force: false,
            seed: 1,
            progress: true,
        }
    }
}

/// What [`run_model_synth`] wrote.
#[derive(Debug, Clone)]
pub struct SynthReport {
    /// The model directory.
    pub dir: PathBuf,
    /// The model.
    pub model: Synthesized,
    /// Seconds the writing took.
    pub seconds: f64,
}

impl TextReport for SynthReport {
    fn table(&self) -> String {
        format!(
            "wrote {}: {} in {} shard(s), {} tensors (F16/F32), {:.1} s ({:.2} GB/s)\n",
            self.dir.display(),
            format_size(self.model.file_bytes),
            self.model.files.len(),
            self.model.tensors,
            self.seconds,
            self.model.file_bytes as f64 / self.seconds.max(1e-9) / 1e9
        )
    }
}

/// Writes the synthetic model `opts` describe, after checking that `dir`
/// holds no model (unless `force`) and has the room.
pub fn run_model_synth(opts: &ModelSynthOptions) -> Result<SynthReport> {
    let plan = plan_model(opts.bytes, opts.shards)?;
    let dir = &opts.dir;
    std::fs::create_dir_all(dir).with_step(|| format!("cannot create {}", dir.display()))?;
    if dir.join(SINGLE_FILE).exists() && !opts.force {
        fail!(
            "{} already holds {SINGLE_FILE}; pass --force to replace it",
            dir.display()
        );
    }
    clear_dir(dir, opts.force)?;
    let data: u64 = plan.iter().map(ShardPlan::data_bytes).sum();
    let need = data + data / 100 + (1 << 20);
    let free =
        free_bytes(dir).with_step(|| format!("cannot read free space of {}", dir.display()))?;
    if free < need {
        fail!(
            "not enough free disk space in {}: the model needs {} but {} is free",
            dir.display(),
            format_size(need),
            format_size(free)
        );
    }
    let t = Instant::now();
    let model = write_model(dir, &plan, opts.seed, !opts.progress)?;
    Ok(SynthReport {
        dir: dir.clone(),
        model,
        seconds: t.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use kvtier_io::loader::{LoaderConfig, load_model_dir};

    use super::*;

    #[test]
    fn plans_tile_each_shard() {
        let plan = plan_model(4 << 20, 2).unwrap();
        assert_eq!(plan.len(), 2);
        for s in &plan {
            assert_eq!(s.data_bytes(), 2 << 20);
            let mut off = 0;
            for t in &s.tensors {
                assert_eq!(t.data_offsets.0, off);
                assert_eq!(t.byte_len(), Some(t.data_offsets.1 - t.data_offsets.0));
                off = t.data_offsets.1;
            }
        }
        assert_eq!(plan[1].file, "model-00002-of-00002.safetensors");
        assert!(plan_model(3, 1).is_err());
        assert_eq!(plan_model(4 << 30, 2).unwrap()[0].data_bytes(), 2 << 30);
        let odd = plan_model(1_000_003, 3).unwrap();
        assert!(odd.iter().all(|s| s.data_bytes() == 333_332));
    }

    #[test]
    fn writes_a_model_the_loader_reads() {
        let dir = tempfile::tempdir().unwrap();
        let plan = plan_model(1 << 20, 2).unwrap();
        let out = write_model(dir.path(), &plan, 7, true).unwrap();
        assert_eq!(out.files.len(), 2);
        let (shards, stats) = load_model_dir(dir.path(), &LoaderConfig::default()).unwrap();
        assert_eq!(stats.bytes, out.file_bytes);
        let n: usize = shards.iter().map(|s| s.len()).sum();
        assert_eq!(n, out.tensors);
        // The reference crate reads it too.
        let bytes = std::fs::read(&out.files[0]).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.len(), shards[0].len());
        assert!(clear_dir(dir.path(), false).is_err());
        clear_dir(dir.path(), true).unwrap();
        assert!(!out.files[0].exists());
    }
}
