//! Checkpoint save/load: round trips, the file format seen by the reference
//! `safetensors` crate, checksums, async saves, bad input, stray files.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::fs;
use std::os::unix::fs::FileExt;
use std::path::Path;

use kvtier_io::checkpoint::{
    self, CheckpointError, LoadOptions, MANIFEST_FILE, PAD_PREFIX, SaveOptions, TensorRef,
};
use kvtier_io::safetensors::Dtype;
use safetensors::SafeTensors;

/// An owned tensor for tests.
#[derive(Debug, Clone)]
struct T {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl T {
    fn new(name: &str, dtype: Dtype, shape: &[usize], seed: u64) -> Self {
        let n = shape.iter().product::<usize>() * dtype.size_bytes();
        Self {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            data: bytes(seed, n),
        }
    }

    fn r(&self) -> TensorRef<'_> {
        TensorRef::new(&self.name, self.dtype, &self.shape, &self.data)
    }
}

fn refs(ts: &[T]) -> Vec<TensorRef<'_>> {
    ts.iter().map(T::r).collect()
}

/// Deterministic pseudo-random bytes (xorshift64*).
fn bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 56) as u8
        })
        .collect()
}

/// Odd sizes, many small tensors, an empty one, and one bigger than the
/// shard target (256 KiB here).
fn mixed() -> Vec<T> {
    let mut ts = vec![
        T::new("one_byte", Dtype::U8, &[1], 1),
        T::new("odd.f32", Dtype::F32, &[3, 341], 2),
        T::new("page_minus_one", Dtype::I8, &[4095], 3),
        T::new("page_plus_one", Dtype::U8, &[4097], 4),
        T::new("empty", Dtype::F16, &[0, 7], 5),
        T::new("scalar", Dtype::F64, &[], 6),
        T::new("bigger_than_a_shard", Dtype::Bf16, &[3, 174_763], 7),
    ];
    for i in 0..300 {
        ts.push(T::new(
            &format!("layers.{i}.bias"),
            Dtype::F32,
            &[1 + i % 37],
            100 + i as u64,
        ));
    }
    ts.push(T::new("tail.i64", Dtype::I64, &[12_345], 8));
    ts
}

fn small_opts() -> SaveOptions {
    SaveOptions {
        shard_bytes: 256 << 10,
        chunk_bytes: 64 << 10,
        in_flight: 8,
        ..SaveOptions::default()
    }
}

fn assert_same(ck: &checkpoint::Checkpoint, ts: &[T]) {
    assert_eq!(ck.len(), ts.len());
    let names: Vec<&str> = ck.names().collect();
    let want: Vec<&str> = ts.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, want, "names in save order, no padding tensors");
    for t in ts {
        let v = ck
            .tensor(&t.name)
            .unwrap_or_else(|| panic!("{} missing", t.name));
        assert_eq!(v.dtype, t.dtype, "{}", t.name);
        assert_eq!(v.shape, &t.shape[..], "{}", t.name);
        assert!(v.data == &t.data[..], "{}: bytes differ", t.name);
    }
    assert_eq!(ck.tensors().count(), ts.len());
}

fn dir_names(dir: &Path) -> BTreeSet<String> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| !n.starts_with('.'))
        .collect()
}

#[test]
fn round_trip_odd_sizes_many_small_and_a_tensor_bigger_than_a_shard() {
    let dir = tempfile::tempdir().unwrap();
    let ts = mixed();
    let info = checkpoint::save(dir.path(), &refs(&ts), &small_opts()).unwrap();
    assert_eq!(info.generation, 1);
    assert!(info.files.len() >= 3, "{} shards", info.files.len());
    let on_disk: u64 = info
        .files
        .iter()
        .map(|f| fs::metadata(f).unwrap().len())
        .sum();
    assert_eq!(info.bytes, on_disk, "files truncated to their exact length");
    let payload: usize = ts.iter().map(|t| t.data.len()).sum();
    assert_eq!(info.tensor_bytes, payload as u64);
    assert_eq!(info.direct, kvtier_io::probe_direct(dir.path()).direct);

    let ck = checkpoint::load(dir.path()).unwrap();
    assert_eq!(ck.generation(), 1);
    assert_same(&ck, &ts);
    // The oversized tensor sits alone in its shard.
    let m = ck.manifest();
    let big = m
        .tensors
        .iter()
        .find(|t| t.name == "bigger_than_a_shard")
        .unwrap();
    assert_eq!(
        m.tensors.iter().filter(|t| t.shard == big.shard).count(),
        1,
        "a tensor over the shard target gets its own shard"
    );
    // The manifest's checksums (computed piecewise while gathering, then
    // joined) are those of each whole tensor.
    for (entry, t) in m.tensors.iter().zip(&ts) {
        assert_eq!(entry.crc32c, crc32c::crc32c(&t.data), "{}", t.name);
    }

    // A second generation replaces the first; its files are gone.
    let mut ts2 = ts.clone();
    ts2[1].data = bytes(99, ts2[1].data.len());
    ts2.truncate(10);
    let info2 = checkpoint::save(dir.path(), &refs(&ts2), &small_opts()).unwrap();
    assert_eq!(info2.generation, 2);
    let mut want: BTreeSet<String> = info2
        .files
        .iter()
        .map(|f| f.file_name().unwrap().to_str().unwrap().to_string())
        .collect();
    want.insert(MANIFEST_FILE.to_string());
    assert_eq!(dir_names(dir.path()), want, "only generation 2 remains");
    assert_same(&checkpoint::load(dir.path()).unwrap(), &ts2);
}

#[test]
fn shards_load_with_the_reference_crate_and_tensors_are_4k_aligned() {
    let dir = tempfile::tempdir().unwrap();
    let ts = mixed();
    let info = checkpoint::save(dir.path(), &refs(&ts), &small_opts()).unwrap();
    let mut seen = BTreeSet::new();
    let mut pads = 0;
    for f in &info.files {
        let buf = fs::read(f).unwrap();
        let st = SafeTensors::deserialize(&buf)
            .unwrap_or_else(|e| panic!("{} rejected by safetensors: {e}", f.display()));
        let (n, meta) = SafeTensors::read_metadata(&buf).unwrap();
        let data_start = 8 + n;
        assert_eq!(
            data_start % 4096,
            0,
            "{}: data section aligned",
            f.display()
        );
        for (name, view) in st.tensors() {
            if name.starts_with(PAD_PREFIX) {
                pads += 1;
                assert_eq!(view.dtype(), safetensors::Dtype::U8);
                assert!(view.data().iter().all(|&b| b == 0), "padding is zeros");
                assert!(view.data().len() < 4096);
                continue;
            }
            let t = ts.iter().find(|t| t.name == name).unwrap();
            let (begin, _) = meta.info(&name).unwrap().data_offsets;
            assert_eq!(
                (data_start + begin) % 4096,
                0,
                "{name} starts at file offset {}",
                data_start + begin
            );
            assert_eq!(view.dtype().to_string(), t.dtype.as_str());
            assert_eq!(view.shape(), &t.shape[..]);
            assert!(view.data() == &t.data[..], "{name}: bytes differ");
            assert!(seen.insert(name.clone()), "{name} in two shards");
        }
    }
    assert!(pads > 0, "odd sizes need padding tensors");
    let want: BTreeSet<String> = ts.iter().map(|t| t.name.clone()).collect();
    assert_eq!(seen, want);
}

#[test]
fn flipped_byte_is_a_checksum_error_naming_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let ts = mixed();
    checkpoint::save(dir.path(), &refs(&ts), &small_opts()).unwrap();
    let m = checkpoint::read_manifest(dir.path()).unwrap().unwrap();
    let victim = m
        .tensors
        .iter()
        .find(|t| t.name == "layers.150.bias")
        .unwrap();
    let shard = &m.shards[victim.shard];
    let path = dir.path().join(&shard.file);
    let at = shard.data_start + victim.data_offsets.0 + victim.len() / 2;
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0x10], at).unwrap();
    f.sync_all().unwrap();
    drop(f);

    match checkpoint::load(dir.path()) {
        Err(CheckpointError::Checksum { name, path: p, .. }) => {
            assert_eq!(name, "layers.150.bias");
            assert_eq!(p, path);
        }
        other => panic!("expected a checksum error, got {other:?}"),
    }
    let msg = checkpoint::load(dir.path()).unwrap_err().to_string();
    assert!(
        msg.contains("layers.150.bias") && msg.contains("checksum"),
        "{msg}"
    );
    // Without verification the same files load: the checksum is what caught it.
    let opts = LoadOptions {
        verify: false,
        ..LoadOptions::default()
    };
    assert!(checkpoint::load_with(dir.path(), &opts).is_ok());

    // A truncated shard is caught by its recorded length.
    let f = fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(shard.bytes - 1).unwrap();
    let e = checkpoint::load(dir.path()).unwrap_err();
    assert!(matches!(e, CheckpointError::Shard { .. }), "{e}");
    assert!(e.to_string().contains(&shard.file), "{e}");
}

#[test]
fn async_save_equals_sync_save_and_snapshots_before_returning() {
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    let ts = mixed();
    let opts = small_opts();
    let sync = checkpoint::save(a.path(), &refs(&ts), &opts).unwrap();

    let mut scratch = ts.clone();
    let handle = checkpoint::save_async(b.path(), &refs(&scratch), &opts).unwrap();
    // The caller may reuse its buffers at once: the snapshot is taken.
    for t in &mut scratch {
        t.data.iter_mut().for_each(|x| *x = !*x);
    }
    while !handle.is_done() {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let info = handle.wait().unwrap();
    assert_eq!(info.generation, sync.generation);
    assert_eq!(info.bytes, sync.bytes);
    assert_eq!(info.files.len(), sync.files.len());
    for (fa, fb) in sync.files.iter().zip(&info.files) {
        assert_eq!(fa.file_name(), fb.file_name());
        assert!(
            fs::read(fa).unwrap() == fs::read(fb).unwrap(),
            "{fb:?} differs"
        );
    }
    assert_eq!(
        checkpoint::read_manifest(a.path()).unwrap(),
        checkpoint::read_manifest(b.path()).unwrap()
    );
    assert_same(&checkpoint::load(b.path()).unwrap(), &ts);

    // A dropped handle still finishes its save.
    let ts2: Vec<T> = ts[..5].to_vec();
    drop(checkpoint::save_async(b.path(), &refs(&ts2), &opts).unwrap());
    let ck = checkpoint::load(b.path()).unwrap();
    assert_eq!(ck.generation(), 2);
    assert_same(&ck, &ts2);
}

#[test]
fn aligned_tensors_are_written_from_the_callers_memory_and_match_a_gathered_save() {
    let opts = small_opts();
    let ts = vec![
        T::new("big.f32", Dtype::F32, &[50_001], 11), // 200 004 bytes: a 4 B tail
        T::new("small", Dtype::U8, &[4000], 12),      // under an eighth of a chunk
        T::new("exact.bf16", Dtype::Bf16, &[81_920], 13), // 163 840 bytes, 40 pages
        T::new("mid", Dtype::U8, &[9000], 14),        // 8192 B body, chunk/8 = 8192
    ];
    // One page-aligned arena with every tensor at a 4 KiB-aligned address,
    // and one where every tensor sits 64 bytes past a page boundary.
    let place = |shift: usize| {
        let mut offsets = Vec::new();
        let mut at = 0usize;
        for t in &ts {
            offsets.push(at + shift);
            at = (at + shift + t.data.len()).next_multiple_of(4096);
        }
        let mut arena = kvtier_io::AlignedBuf::zeroed(at, 4096).unwrap();
        for (t, &o) in ts.iter().zip(&offsets) {
            arena[o..o + t.data.len()].copy_from_slice(&t.data);
        }
        (arena, offsets)
    };
    let save_from = |dir: &Path, shift: usize| {
        let (arena, offsets) = place(shift);
        let refs: Vec<TensorRef<'_>> = ts
            .iter()
            .zip(&offsets)
            .map(|(t, &o)| TensorRef::new(&t.name, t.dtype, &t.shape, &arena[o..o + t.data.len()]))
            .collect();
        checkpoint::save(dir, &refs, &opts).unwrap()
    };
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    let aligned = save_from(a.path(), 0);
    let shifted = save_from(b.path(), 64);

    // Whole 4 KiB blocks of the tensors of at least an eighth of a chunk.
    let bodies: u64 = [200_004u64, 163_840, 9000]
        .iter()
        .map(|n| n - n % 4096)
        .sum();
    assert_eq!(aligned.borrowed_bytes, bodies);
    if shifted.direct {
        assert_eq!(shifted.borrowed_bytes, 0, "O_DIRECT needs aligned memory");
    } else {
        assert_eq!(
            shifted.borrowed_bytes, bodies,
            "buffered writes borrow any memory"
        );
    }
    for (fa, fb) in aligned.files.iter().zip(&shifted.files) {
        assert!(
            fs::read(fa).unwrap() == fs::read(fb).unwrap(),
            "{fb:?} differs"
        );
    }
    let ck = checkpoint::load(a.path()).unwrap();
    assert_same(&ck, &ts);
    for (entry, t) in ck.manifest().tensors.iter().zip(&ts) {
        assert_eq!(entry.crc32c, crc32c::crc32c(&t.data), "{}", t.name);
    }

    // A kvtier checkpoint loaded by kvtier has its tensors page-aligned in
    // memory, so saving it again borrows them too.
    let c = tempfile::tempdir().unwrap();
    let again: Vec<TensorRef<'_>> = ck
        .tensors()
        .map(|v| TensorRef::new(v.name, v.dtype, v.shape, v.data))
        .collect();
    let resaved = checkpoint::save(c.path(), &again, &opts).unwrap();
    assert_eq!(resaved.borrowed_bytes, bodies);
    assert_same(&checkpoint::load(c.path()).unwrap(), &ts);
}

#[test]
fn bad_tensors_are_rejected_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let good = T::new("w", Dtype::F32, &[4], 1);
    let short = TensorRef::new("short", Dtype::F32, &[4], &good.data[..15]);
    let e = checkpoint::save(dir.path(), &[good.r(), short], &SaveOptions::default()).unwrap_err();
    assert!(
        matches!(&e, CheckpointError::InvalidTensor { name, .. } if name == "short"),
        "{e}"
    );
    let pad = TensorRef::new("__kvtier_pad_0", Dtype::U8, &[1], &good.data[..1]);
    let e = checkpoint::save_async(dir.path(), &[pad], &SaveOptions::default()).unwrap_err();
    assert!(e.to_string().contains("reserved"), "{e}");
    assert!(dir_names(dir.path()).is_empty(), "nothing written");
    assert!(matches!(
        checkpoint::load(dir.path()),
        Err(CheckpointError::NoCheckpoint { .. })
    ));
}

#[test]
fn stray_files_are_ignored_by_load_and_removed_by_cleanup_and_save() {
    let dir = tempfile::tempdir().unwrap();
    let ts = vec![T::new("a", Dtype::U8, &[5000], 1)];
    let opts = small_opts();
    checkpoint::save(dir.path(), &refs(&ts), &opts).unwrap();
    let stray = dir.path().join(checkpoint::shard_file_name(7, 0, 1));
    fs::write(&stray, b"half a shard").unwrap();
    fs::write(dir.path().join(checkpoint::MANIFEST_TMP), b"{\"torn").unwrap();
    fs::write(dir.path().join("notes.txt"), b"keep me").unwrap();

    assert_same(&checkpoint::load(dir.path()).unwrap(), &ts);
    let removed = checkpoint::cleanup(dir.path()).unwrap();
    assert_eq!(removed.len(), 2, "{removed:?}");
    assert!(!stray.exists());
    assert!(
        dir.path().join("notes.txt").exists(),
        "other files untouched"
    );

    fs::write(&stray, b"again").unwrap();
    let info = checkpoint::save(dir.path(), &refs(&ts), &opts).unwrap();
    assert_eq!(info.generation, 2);
    assert!(!stray.exists(), "the next save removes stray files");
    assert_same(&checkpoint::load(dir.path()).unwrap(), &ts);
}

#[test]
fn buffered_mode_is_reported_and_empty_checkpoints_work() {
    let dir = tempfile::tempdir().unwrap();
    let opts = SaveOptions {
        direct: false,
        ..small_opts()
    };
    let ts = mixed();
    let info = checkpoint::save(dir.path(), &refs(&ts), &opts).unwrap();
    assert!(!info.direct);
    assert!(info.direct_reason.unwrap().contains("direct = false"));
    assert_same(&checkpoint::load(dir.path()).unwrap(), &ts);

    let info = checkpoint::save(dir.path(), &[], &opts).unwrap();
    assert_eq!((info.generation, info.files.len()), (2, 0));
    let ck = checkpoint::load(dir.path()).unwrap();
    assert!(ck.is_empty());
    assert_eq!(dir_names(dir.path()).len(), 1, "only the manifest is left");
}

#[test]
fn corrupt_manifest_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let ts = vec![T::new("a", Dtype::U8, &[10], 1)];
    checkpoint::save(dir.path(), &refs(&ts), &small_opts()).unwrap();
    let path = dir.path().join(MANIFEST_FILE);
    let text = fs::read_to_string(&path).unwrap();
    fs::write(&path, text.replace("ckpt-000001", "../ckpt-000001")).unwrap();
    let e = checkpoint::load(dir.path()).unwrap_err();
    assert!(matches!(e, CheckpointError::Manifest { .. }), "{e}");
    assert!(e.to_string().contains("plain file name"), "{e}");
    fs::write(&path, b"\xff\xfe not json").unwrap();
    let e = checkpoint::load(dir.path()).unwrap_err();
    assert!(e.to_string().contains(MANIFEST_FILE), "{e}");
}
