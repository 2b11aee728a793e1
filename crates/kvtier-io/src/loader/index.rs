//! Finding a model's shard files: the Hugging Face index, a single file, or
//! every `*.safetensors` in the directory.

use std::collections::BTreeMap;
use std::io;
use std::path::{Component, Path, PathBuf};

use serde::Deserialize;

use super::load_error::LoadError;
use crate::safetensors::Header;

/// The sharded-model index file name.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The single-file model name.
pub const SINGLE_FILE: &str = "model.safetensors";

#[derive(Debug, Deserialize)]
struct IndexJson {
    weight_map: BTreeMap<String, String>,
}

/// A parsed index: which shard holds which tensor.
#[derive(Debug)]
pub(crate) struct ModelIndex {
    pub(crate) path: PathBuf,
    pub(crate) weight_map: BTreeMap<String, String>,
}

impl ModelIndex {
    /// Reads `dir`'s index, if it has one.
    pub(crate) fn read(dir: &Path) -> Result<Option<Self>, LoadError> {
        let path = dir.join(INDEX_FILE);
        let text = match std::fs::read(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(LoadError::Io { path, source }),
        };
        let parsed: IndexJson = match serde_json::from_slice(&text) {
            Ok(p) => p,
            Err(e) => {
                return Err(LoadError::BadIndex {
                    path,
                    msg: e.to_string(),
                });
            }
        };
        for shard in parsed.weight_map.values() {
            let plain = !shard.is_empty()
                && Path::new(shard)
                    .components()
                    .all(|c| matches!(c, Component::Normal(_)));
            if !plain {
                return Err(LoadError::BadIndex {
                    path,
                    msg: format!(
                        "shard name {shard:?} is not a relative path inside the model directory"
                    ),
                });
            }
        }
        Ok(Some(Self {
            path,
            weight_map: parsed.weight_map,
        }))
    }

    /// The unique shard names, sorted.
    pub(crate) fn shard_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.weight_map.values().map(String::as_str).collect();
        names.sort_unstable();
        names.dedup();
        names
    }

    /// Checks that every tensor the index names is in the shard it names.
    pub(crate) fn check<'a>(
        &self,
        dir: &Path,
        shards: impl Iterator<Item = (&'a Path, &'a Header)> + Clone,
    ) -> Result<(), LoadError> {
        for (tensor, shard) in &self.weight_map {
            let path = dir.join(shard);
            let holds = shards
                .clone()
                .find(|(p, _)| *p == path)
                .is_some_and(|(_, h)| h.get(tensor).is_some());
            if !holds {
                return Err(LoadError::TensorNotInShard {
                    index: self.path.clone(),
                    tensor: tensor.clone(),
                    shard: shard.clone(),
                });
            }
        }
        Ok(())
    }
}

/// When `dir` has an index, checks that every tensor it lists is in the
/// shard it names, among the loaded `shards` (path and header).
pub(crate) fn check_index<'a>(
    dir: &Path,
    shards: impl Iterator<Item = (&'a Path, &'a Header)> + Clone,
) -> Result<(), LoadError> {
    match ModelIndex::read(dir)? {
        Some(index) => index.check(dir, shards),
        None => Ok(()),
    }
}

/// The shard files of the model in `dir`: the unique files of
/// `model.safetensors.index.json`'s `weight_map` (sorted; every one must
/// exist, a missing one is an error naming it), else `model.safetensors`,
/// else every `*.safetensors` file, sorted.
pub fn model_shards(dir: &Path) -> Result<Vec<PathBuf>, LoadError> {
    if let Some(index) = ModelIndex::read(dir)? {
        let mut out = Vec::new();
        for shard in index.shard_names() {
            let path = dir.join(shard);
            match std::fs::metadata(&path) {
                Ok(m) if m.is_file() => out.push(path),
                Ok(_) => {
                    return Err(LoadError::MissingShard {
                        index: index.path.clone(),
                        shard: shard.to_string(),
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    return Err(LoadError::MissingShard {
                        index: index.path.clone(),
                        shard: shard.to_string(),
                    });
                }
                Err(source) => return Err(LoadError::Io { path, source }),
            }
        }
        if out.is_empty() {
            return Err(LoadError::BadIndex {
                path: index.path,
                msg: "weight_map is empty".into(),
            });
        }
        return Ok(out);
    }
    let single = dir.join(SINGLE_FILE);
    if single.is_file() {
        return Ok(vec![single]);
    }
    let io_err = |source| LoadError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_err)? {
        let path = entry.map_err(io_err)?.path();
        if path.extension().is_some_and(|e| e == "safetensors") && path.is_file() {
            out.push(path);
        }
    }
    out.sort();
    if out.is_empty() {
        return Err(LoadError::NoShards {
            dir: dir.to_path_buf(),
        });
    }
    Ok(out)
}
