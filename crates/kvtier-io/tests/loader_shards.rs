//! The loader against the reference crate: every tensor's bytes, on both
//! engine backends, with and without `O_DIRECT`, on files whose length is
//! not a multiple of 4 KiB; one allocation per shard and none before every
//! header is validated.

// Helpers outside #[test] fns unwrap too: clippy.toml lets tests unwrap.
#![allow(clippy::unwrap_used)]

use std::alloc::Layout;
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

mod common;

use common::{engines, write_shard};
use kvtier_io::loader::{LoadError, LoadedShard, LoaderConfig, load_shards};
use kvtier_io::safetensors::SafetensorsError;
use kvtier_io::{HostAllocator, IoEngine, probe_direct, system_allocator};
use safetensors::SafeTensors;

/// Counts allocations, delegating to the system allocator.
#[derive(Debug, Default)]
struct Counting {
    allocs: AtomicUsize,
    bytes: AtomicUsize,
}

// SAFETY: delegates to the system allocator, which upholds the contract.
unsafe impl HostAllocator for Counting {
    fn allocate_zeroed(&self, layout: Layout) -> Option<NonNull<u8>> {
        self.allocs.fetch_add(1, Ordering::SeqCst);
        self.bytes.fetch_add(layout.size(), Ordering::SeqCst);
        system_allocator().allocate_zeroed(layout)
    }
    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: forwarded from our caller.
        unsafe { system_allocator().deallocate(ptr, layout) }
    }
    fn name(&self) -> &'static str {
        "counting"
    }
}

/// Every tensor of `shard` equals the reference crate's reading of its file.
fn same_as_reference(shard: &LoadedShard) {
    let bytes = std::fs::read(shard.path()).unwrap();
    let theirs = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(shard.len(), theirs.len());
    assert_eq!(shard.bytes(), bytes.len() as u64);
    assert_eq!(shard.file_bytes(), &bytes[..]);
    let buf = shard.buffer();
    let range = buf.as_ptr() as usize..buf.as_ptr() as usize + buf.len();
    for v in shard.tensors() {
        let r = theirs.tensor(v.name).unwrap();
        assert_eq!(v.shape, r.shape(), "{}", v.name);
        assert_eq!(v.data, r.data(), "{}", v.name);
        assert_eq!(serde_json::to_value(r.dtype()).unwrap(), v.dtype.as_str());
        // Zero copy: the view points into the shard's one buffer.
        assert!(range.contains(&(v.data.as_ptr() as usize)) || v.data.is_empty());
        assert_eq!(shard.tensor(v.name), Some(v));
    }
    assert!(shard.tensor("no such tensor").is_none());
}

#[test]
fn both_backends_direct_and_buffered_on_unaligned_files() {
    let dir = tempfile::tempdir().unwrap();
    let paths = vec![
        write_shard(&dir.path().join("a.safetensors"), 1, 9),
        write_shard(&dir.path().join("b.safetensors"), 2, 4),
    ];
    for p in &paths {
        let len = std::fs::metadata(p).unwrap().len();
        assert_ne!(len % 4096, 0, "fixture must not be 4 KiB-aligned");
        assert!(len > 64 * 1024, "fixture must span several chunks");
    }
    let direct_here = probe_direct(dir.path()).direct;
    let mut modes = vec![Some(false), None];
    if direct_here {
        modes.push(Some(true));
    }
    for engine in engines() {
        for &direct in &modes {
            for (chunk_bytes, in_flight, prefault) in [
                (4096, 1, false),
                (16 << 10, 8, true),
                (8 << 20, 32, true),
                (8 << 20, 32, false),
            ] {
                let cfg = LoaderConfig {
                    chunk_bytes,
                    in_flight,
                    direct,
                    prefault,
                };
                let alloc = Arc::new(Counting::default());
                let dyn_alloc: Arc<dyn HostAllocator> = alloc.clone();
                let (shards, stats) = load_shards(&paths, &cfg, &engine, &dyn_alloc)
                    .unwrap_or_else(|e| panic!("{} {cfg:?}: {e}", engine.describe()));
                assert_eq!(
                    alloc.allocs.load(Ordering::SeqCst),
                    2,
                    "one allocation per shard"
                );
                assert_eq!(stats.io_backend, engine.backend().name());
                assert_eq!(stats.shards, 2);
                let total: u64 = paths
                    .iter()
                    .map(|p| std::fs::metadata(p).unwrap().len())
                    .sum();
                assert_eq!(stats.bytes, total);
                match direct {
                    Some(true) => assert!(stats.direct && stats.buffered_reason.is_none()),
                    Some(false) => assert!(!stats.direct && stats.buffered_reason.is_some()),
                    None => {
                        assert_eq!(stats.direct, stats.buffered_reason.is_none());
                        // The per-file probe agrees with the directory probe.
                        assert_eq!(stats.direct, direct_here, "{:?}", stats.buffered_reason);
                    }
                }
                for s in &shards {
                    same_as_reference(s);
                }
            }
        }
    }
}

#[test]
fn every_header_is_validated_before_any_shard_buffer_is_allocated() {
    let dir = tempfile::tempdir().unwrap();
    let good = write_shard(&dir.path().join("good.safetensors"), 3, 3);
    // A header that claims a 1 TiB tensor in a tiny file.
    let liar = dir.path().join("liar.safetensors");
    let json = br#"{"w":{"dtype":"U8","shape":[1099511627776],"data_offsets":[0,1099511627776]}}"#;
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(json);
    bytes.extend_from_slice(&[0u8; 100]);
    std::fs::write(&liar, bytes).unwrap();

    let alloc = Arc::new(Counting::default());
    let dyn_alloc: Arc<dyn HostAllocator> = alloc.clone();
    let err = load_shards(
        &[good, liar.clone()],
        &LoaderConfig::default(),
        IoEngine::shared(),
        &dyn_alloc,
    )
    .unwrap_err();
    match err {
        LoadError::Safetensors(SafetensorsError::OffsetsPastEnd { path, name, .. }) => {
            assert_eq!((path, name.as_str()), (liar, "w"))
        }
        e => panic!("wrong error: {e}"),
    }
    assert_eq!(alloc.allocs.load(Ordering::SeqCst), 0);
}

#[test]
fn a_four_gib_header_length_fails_without_allocating() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("huge.safetensors");
    let mut bytes = 0x1_0000_0000u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(&path, bytes).unwrap();
    let alloc = Arc::new(Counting::default());
    let dyn_alloc: Arc<dyn HostAllocator> = alloc.clone();
    let err = load_shards(
        &[path],
        &LoaderConfig::default(),
        IoEngine::shared(),
        &dyn_alloc,
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            LoadError::Safetensors(SafetensorsError::HeaderTooLarge {
                len: 0x1_0000_0000,
                ..
            })
        ),
        "{err}"
    );
    assert_eq!(alloc.allocs.load(Ordering::SeqCst), 0);
}

#[test]
fn an_empty_shard_and_an_aligned_shard_load() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.safetensors");
    let mut bytes = 8u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}      ");
    std::fs::write(&empty, &bytes).unwrap();
    // Exactly 8 KiB: prefix + header + data.
    let aligned = dir.path().join("aligned.safetensors");
    let json_for =
        |n: usize| format!(r#"{{"w":{{"dtype":"U8","shape":[{n}],"data_offsets":[0,{n}]}}}}"#);
    let n = 8192 - 8 - json_for(1000).len();
    let json = json_for(n);
    let data_start = 8 + json.len();
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(json.as_bytes());
    bytes.extend((0..n).map(|i| (i % 7) as u8));
    assert_eq!(bytes.len(), 8192);
    std::fs::write(&aligned, &bytes).unwrap();
    for engine in engines() {
        let cfg = LoaderConfig {
            chunk_bytes: 4096,
            ..LoaderConfig::default()
        };
        let (shards, stats) = load_shards(
            &[empty.clone(), aligned.clone()],
            &cfg,
            &engine,
            &system_allocator(),
        )
        .unwrap();
        assert!(shards[0].is_empty());
        assert_eq!(shards[0].bytes(), 16);
        assert_eq!(shards[1].tensor("w").unwrap().data, &bytes[data_start..]);
        assert_eq!(shards[1].data(), &bytes[data_start..]);
        assert_eq!(stats.bytes, 8192 + 16);
    }
}

#[test]
fn bad_configs_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let p = write_shard(&dir.path().join("c.safetensors"), 4, 1);
    for cfg in [
        LoaderConfig {
            chunk_bytes: 1000,
            ..LoaderConfig::default()
        },
        LoaderConfig {
            chunk_bytes: 0,
            ..LoaderConfig::default()
        },
        LoaderConfig {
            in_flight: 0,
            ..LoaderConfig::default()
        },
    ] {
        let err = load_shards(
            std::slice::from_ref(&p),
            &cfg,
            IoEngine::shared(),
            &system_allocator(),
        )
        .unwrap_err();
        assert!(matches!(err, LoadError::BadConfig(_)), "{err}");
    }
}

#[test]
fn a_missing_file_is_an_io_error_naming_it() {
    let path = PathBuf::from("/nonexistent/kvtier/x.safetensors");
    let err = load_shards(
        std::slice::from_ref(&path),
        &LoaderConfig::default(),
        IoEngine::shared(),
        &system_allocator(),
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("/nonexistent/kvtier/x.safetensors"),
        "{err}"
    );
}

#[test]
fn a_fifo_a_device_and_a_directory_are_errors_not_hangs() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo.safetensors");
    let c_path = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path; mkfifo touches no memory of ours.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
    let zero = dir.path().join("zero.safetensors");
    std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
    for (path, what) in [
        (fifo, "a FIFO"),
        (zero, "a device"),
        (dir.path().to_path_buf(), "a directory"),
    ] {
        // No writer ever opens the FIFO: a blocking open would hang here.
        let err = load_shards(
            std::slice::from_ref(&path),
            &LoaderConfig::default(),
            IoEngine::shared(),
            &system_allocator(),
        )
        .unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, LoadError::Io { .. }), "{msg}");
        assert!(msg.contains(&*path.to_string_lossy()), "{msg}");
        assert!(msg.contains(what), "{msg}");
    }
}
