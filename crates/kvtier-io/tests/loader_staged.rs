//! The staging ring (`loader::staged`) end to end, with the copy-thread
//! sink standing for a GPU's copy engine: every byte lands, on both engine
//! backends, direct and buffered; the ring never holds more buffers than
//! asked; a slow copy engine never sees its source reused; device failures
//! are errors, not panics.

// Helpers outside #[test] fns unwrap too: clippy.toml lets tests unwrap.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use common::{engines, write_shard};
use kvtier_io::loader::staged::{
    DeviceShard, DeviceSink, StagedLoad, ThreadCopySink, ThreadFence, load_model_dir_staged,
    load_shards_staged,
};
use kvtier_io::loader::{INDEX_FILE, LoadError, LoaderConfig};
use kvtier_io::{AlignedBuf, HostAllocator, IoEngine, probe_direct};
use safetensors::SafeTensors;

fn cfg(chunk_bytes: usize, in_flight: usize, direct: bool) -> LoaderConfig {
    LoaderConfig {
        chunk_bytes,
        in_flight,
        direct: Some(direct),
        prefault: false,
    }
}

/// The device memory holds the file byte for byte, and every tensor range
/// is the reference crate's tensor.
fn same_as_file(shard: &DeviceShard<AlignedBuf>) {
    let bytes = std::fs::read(shard.path()).unwrap();
    assert_eq!(
        &shard.memory()[..],
        &bytes[..],
        "{}",
        shard.path().display()
    );
    let theirs = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(shard.tensors().count(), theirs.len());
    for (info, range) in shard.tensors() {
        let r = theirs.tensor(&info.name).unwrap();
        assert_eq!(&shard.memory()[range.clone()], r.data(), "{}", info.name);
        assert_eq!(shard.tensor(&info.name).map(|(_, r)| r), Some(range));
    }
}

fn shards(dir: &std::path::Path) -> Vec<PathBuf> {
    vec![
        write_shard(&dir.join("a.safetensors"), 1, 9),
        write_shard(&dir.join("b.safetensors"), 2, 4),
        write_shard(&dir.join("c.safetensors"), 3, 1),
    ]
}

#[test]
fn every_byte_lands_on_both_backends_direct_and_buffered() {
    let dir = tempfile::tempdir().unwrap();
    let paths = shards(dir.path());
    let direct_ok = probe_direct(dir.path()).direct;
    for engine in engines() {
        for direct in [false, true] {
            if direct && !direct_ok {
                continue;
            }
            let sink = ThreadCopySink::new(Duration::ZERO).unwrap();
            let StagedLoad { shards, stats } =
                load_shards_staged(&paths, &cfg(8192, 4, direct), 3, &engine, sink).unwrap();
            assert_eq!(shards.len(), 3);
            for s in &shards {
                same_as_file(s);
                assert_eq!(s.direct(), direct);
            }
            let total: u64 = paths.iter().map(|p| p.metadata().unwrap().len()).sum();
            assert_eq!(stats.load.bytes, total);
            assert_eq!(stats.load.direct, direct);
            assert_eq!(stats.load.shards, 3);
            assert!(stats.staging_buffers <= 3, "{stats:?}");
            assert_eq!(stats.device, "host (copy thread)");
        }
    }
}

/// A copy engine far slower than the reads: the ring fills up with queued
/// copies, waits on the oldest, and never refills a buffer whose copy has
/// not finished (that would put the next chunk's bytes in the device
/// memory, which `same_as_file` would catch).
#[test]
fn a_slow_copy_engine_never_sees_its_source_reused() {
    let dir = tempfile::tempdir().unwrap();
    let paths = shards(dir.path());
    for engine in engines() {
        let sink = ThreadCopySink::new(Duration::from_millis(3)).unwrap();
        let StagedLoad { shards, stats } =
            load_shards_staged(&paths, &cfg(4096, 8, false), 3, &engine, sink).unwrap();
        for s in &shards {
            same_as_file(s);
        }
        assert_eq!(stats.staging_buffers, 3, "{stats:?}");
        // Copies were queued while other buffers were being read.
        assert!(stats.max_queued_copies >= 2, "{stats:?}");
    }
}

/// Fails the `n`th copy, or every allocation, on purpose; otherwise a
/// copy-thread sink.
#[derive(Debug)]
struct Faulty {
    inner: ThreadCopySink,
    fail_copy_at: usize,
    fail_alloc: bool,
    copies: usize,
}

impl DeviceSink for Faulty {
    type Memory = AlignedBuf;
    type Fence = ThreadFence;
    fn describe(&self) -> String {
        "faulty".into()
    }
    fn staging_allocator(&self) -> Arc<dyn HostAllocator> {
        self.inner.staging_allocator()
    }
    fn allocate(&mut self, len: usize) -> Result<AlignedBuf, String> {
        if self.fail_alloc {
            return Err("out of device memory".into());
        }
        self.inner.allocate(len)
    }
    unsafe fn copy_async(
        &mut self,
        src: &[u8],
        dst: &mut AlignedBuf,
        offset: usize,
    ) -> Result<ThreadFence, String> {
        self.copies += 1;
        if self.copies == self.fail_copy_at {
            return Err("device lost".into());
        }
        // SAFETY: forwarded; our caller keeps the contract.
        unsafe { self.inner.copy_async(src, dst, offset) }
    }
}

#[test]
fn device_failures_are_errors_naming_the_device() {
    let dir = tempfile::tempdir().unwrap();
    let paths = shards(dir.path());
    let faulty = |fail_copy_at, fail_alloc| Faulty {
        inner: ThreadCopySink::new(Duration::from_millis(1)).unwrap(),
        fail_copy_at,
        fail_alloc,
        copies: 0,
    };
    let run = |sink| load_shards_staged(&paths, &cfg(4096, 4, false), 3, IoEngine::shared(), sink);
    match run(faulty(5, false)) {
        Err(LoadError::Device { device, msg }) => {
            assert_eq!(device, "faulty");
            assert!(msg.contains("device lost"), "{msg}");
        }
        other => panic!("expected a device error, got {other:?}"),
    }
    match run(faulty(0, true)) {
        Err(LoadError::Device { msg, .. }) => {
            assert!(msg.contains("out of device memory"), "{msg}")
        }
        other => panic!("expected a device error, got {other:?}"),
    }
}

#[test]
fn bad_ring_and_bad_files_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let paths = shards(dir.path());
    let sink = || ThreadCopySink::new(Duration::ZERO).unwrap();
    let engine = IoEngine::shared();
    assert!(matches!(
        load_shards_staged(&paths, &cfg(4096, 4, false), 1, engine, sink()),
        Err(LoadError::BadConfig(_))
    ));
    assert!(matches!(
        load_shards_staged(&paths, &cfg(1000, 4, false), 4, engine, sink()),
        Err(LoadError::BadConfig(_))
    ));
    // A truncated shard fails validation before any device memory is used.
    let cut = dir.path().join("cut.safetensors");
    let bytes = std::fs::read(&paths[0]).unwrap();
    std::fs::write(&cut, &bytes[..bytes.len() - 3]).unwrap();
    let err = load_shards_staged(&[cut], &cfg(4096, 4, false), 4, engine, sink()).unwrap_err();
    assert!(err.to_string().contains("cut.safetensors"), "{err}");
}

#[test]
fn a_model_dir_with_an_index_is_checked_against_it() {
    let dir = tempfile::tempdir().unwrap();
    let paths = shards(dir.path());
    let index = |map: serde_json::Value| {
        let text = serde_json::json!({ "metadata": {}, "weight_map": map });
        std::fs::write(dir.path().join(INDEX_FILE), text.to_string()).unwrap();
    };
    index(serde_json::json!({
        "s1.t0": "a.safetensors",
        "s2.t3": "b.safetensors",
        "s3.t0": "c.safetensors",
    }));
    let sink = || ThreadCopySink::new(Duration::ZERO).unwrap();
    let load = load_model_dir_staged(dir.path(), &cfg(8192, 4, false), 4, sink()).unwrap();
    assert_eq!(load.shards.len(), 3);
    for s in &load.shards {
        same_as_file(s);
    }
    assert!(
        paths
            .iter()
            .all(|p| load.shards.iter().any(|s| s.path() == p))
    );
    // The index puts a tensor in a shard that does not hold it.
    index(serde_json::json!({ "s1.t0": "b.safetensors" }));
    let err = load_model_dir_staged(dir.path(), &cfg(8192, 4, false), 4, sink()).unwrap_err();
    assert!(matches!(err, LoadError::TensorNotInShard { .. }), "{err}");
}
