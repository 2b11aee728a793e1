//! Finding and loading a model directory: the index, a single file, or a
//! glob, and the errors for missing or inconsistent shards.

// Helpers outside #[test] fns unwrap too: clippy.toml lets tests unwrap.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use kvtier_io::loader::{INDEX_FILE, LoadError, LoaderConfig, load_model_dir, model_shards};
use safetensors::tensor::TensorView as RefView;

/// Writes a shard holding `names` (U8 tensors, content from the name).
fn write_shard(path: &Path, names: &[&str]) {
    let datas: Vec<(String, Vec<u8>)> = names
        .iter()
        .enumerate()
        .map(|(i, n)| (n.to_string(), vec![i as u8 + n.len() as u8; 5000 + i]))
        .collect();
    let views: Vec<(String, RefView<'_>)> = datas
        .iter()
        .map(|(n, b)| {
            (
                n.clone(),
                RefView::new(safetensors::Dtype::U8, vec![b.len()], b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None::<HashMap<String, String>>, path).unwrap();
}

fn write_index(dir: &Path, map: &[(&str, &str)]) {
    let weight_map: BTreeMap<_, _> = map.iter().copied().collect();
    let json = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    std::fs::write(dir.join(INDEX_FILE), json.to_string()).unwrap();
}

const SHARDS: [(&str, &[&str]); 3] = [
    ("model-00001-of-00003.safetensors", &["embed", "l0.q"]),
    ("model-00002-of-00003.safetensors", &["l0.k", "l1.q"]),
    ("model-00003-of-00003.safetensors", &["head"]),
];

fn sharded_model(dir: &Path) {
    let mut map = Vec::new();
    for (file, names) in SHARDS {
        write_shard(&dir.join(file), names);
        map.extend(names.iter().map(|n| (*n, file)));
    }
    write_index(dir, &map);
    // A stray file the index does not name must not be loaded.
    write_shard(&dir.join("stray.safetensors"), &["stray"]);
}

#[test]
fn multi_shard_dir_with_index() {
    let dir = tempfile::tempdir().unwrap();
    sharded_model(dir.path());
    let paths = model_shards(dir.path()).unwrap();
    let want: Vec<_> = SHARDS.iter().map(|(f, _)| dir.path().join(f)).collect();
    assert_eq!(paths, want);

    let (shards, stats) = load_model_dir(dir.path(), &LoaderConfig::default()).unwrap();
    assert_eq!(stats.shards, 3);
    for ((file, names), shard) in SHARDS.iter().zip(&shards) {
        assert_eq!(shard.path(), dir.path().join(file));
        assert_eq!(shard.len(), names.len());
        for (i, n) in names.iter().enumerate() {
            let v = shard.tensor(n).unwrap();
            assert_eq!(v.data, &vec![i as u8 + n.len() as u8; 5000 + i][..]);
        }
    }
}

#[test]
fn missing_shard_is_named_in_the_error() {
    let dir = tempfile::tempdir().unwrap();
    sharded_model(dir.path());
    std::fs::remove_file(dir.path().join(SHARDS[1].0)).unwrap();
    let err = model_shards(dir.path()).unwrap_err();
    match &err {
        LoadError::MissingShard { index, shard } => {
            assert_eq!(shard, SHARDS[1].0);
            assert_eq!(index, &dir.path().join(INDEX_FILE));
        }
        e => panic!("wrong error: {e}"),
    }
    assert!(err.to_string().contains(SHARDS[1].0), "{err}");
    assert!(matches!(
        load_model_dir(dir.path(), &LoaderConfig::default()),
        Err(LoadError::MissingShard { .. })
    ));
}

#[test]
fn index_naming_a_tensor_its_shard_lacks_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    write_shard(&dir.path().join("a.safetensors"), &["x"]);
    write_index(
        dir.path(),
        &[("x", "a.safetensors"), ("ghost", "a.safetensors")],
    );
    match load_model_dir(dir.path(), &LoaderConfig::default()).unwrap_err() {
        LoadError::TensorNotInShard { tensor, shard, .. } => {
            assert_eq!(
                (tensor.as_str(), shard.as_str()),
                ("ghost", "a.safetensors")
            )
        }
        e => panic!("wrong error: {e}"),
    }
}

#[test]
fn index_escaping_the_directory_or_malformed_is_bad() {
    let dir = tempfile::tempdir().unwrap();
    write_index(dir.path(), &[("x", "../a.safetensors")]);
    assert!(matches!(
        model_shards(dir.path()),
        Err(LoadError::BadIndex { .. })
    ));
    write_index(dir.path(), &[("x", "/etc/a.safetensors")]);
    assert!(matches!(
        model_shards(dir.path()),
        Err(LoadError::BadIndex { .. })
    ));
    std::fs::write(dir.path().join(INDEX_FILE), b"{\"weight_map\": 3}").unwrap();
    assert!(matches!(
        model_shards(dir.path()),
        Err(LoadError::BadIndex { .. })
    ));
    write_index(dir.path(), &[]);
    assert!(matches!(
        model_shards(dir.path()),
        Err(LoadError::BadIndex { .. })
    ));
}

#[test]
fn single_file_then_glob_then_nothing() {
    let dir = tempfile::tempdir().unwrap();
    assert!(matches!(
        model_shards(dir.path()),
        Err(LoadError::NoShards { .. })
    ));
    write_shard(&dir.path().join("z.safetensors"), &["z"]);
    write_shard(&dir.path().join("b.safetensors"), &["b"]);
    std::fs::write(dir.path().join("notes.txt"), b"x").unwrap();
    let found = model_shards(dir.path()).unwrap();
    assert_eq!(
        found,
        vec![
            dir.path().join("b.safetensors"),
            dir.path().join("z.safetensors")
        ]
    );
    let (shards, _) = load_model_dir(dir.path(), &LoaderConfig::default()).unwrap();
    assert_eq!(shards.len(), 2);
    write_shard(&dir.path().join("model.safetensors"), &["m"]);
    assert_eq!(
        model_shards(dir.path()).unwrap(),
        vec![dir.path().join("model.safetensors")]
    );
}
