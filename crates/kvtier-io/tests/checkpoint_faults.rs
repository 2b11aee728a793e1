//! Checkpoint faults: SIGKILL at random moments during saves, and a full
//! disk during a save. After either, the committed checkpoint is complete
//! and verifies: the old generation or the new one, never a mix.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::fs;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvtier_io::checkpoint::{
    self, Checkpoint, CheckpointError, LOCK_FILE, MANIFEST_FILE, SaveOptions, TensorRef,
};
use kvtier_io::safetensors::Dtype;

/// Set (to a directory) in the child process of the SIGKILL test.
const CHILD_ENV: &str = "KVTIER_CKPT_KILL_CHILD_DIR";
/// The child test's name, as passed to `--exact`.
const CHILD_TEST: &str = "kill_child_saves_generations_in_a_loop";

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

/// The tensors of generation `g`: their number, names, sizes and bytes all
/// depend on `g`, so a mix of two generations cannot pass for either.
fn generation_tensors(g: u64) -> Vec<(String, Vec<usize>, Vec<u8>)> {
    let count = 4 + (g % 3) as usize;
    let mut ts: Vec<(String, Vec<usize>, Vec<u8>)> = (0..count)
        .map(|i| {
            let n = 1000 + ((g * 7919 + i as u64 * 104_729) % 300_000) as usize;
            (format!("t{i}"), vec![n], bytes(g * 1000 + i as u64, n))
        })
        .collect();
    let big = (2 << 20) + (g % 5) as usize * 4097;
    ts.push(("big".into(), vec![big], bytes(g * 1000 + 999, big)));
    ts
}

fn tensor_refs(ts: &[(String, Vec<usize>, Vec<u8>)]) -> Vec<TensorRef<'_>> {
    ts.iter()
        .map(|(n, s, d)| TensorRef::new(n, Dtype::U8, s, d))
        .collect()
}

fn kill_opts() -> SaveOptions {
    SaveOptions {
        shard_bytes: 1 << 20,
        chunk_bytes: 256 << 10,
        in_flight: 8,
        ..SaveOptions::default()
    }
}

/// Asserts that `ck` holds exactly generation `ck.generation()`'s tensors.
fn assert_is_generation(ck: &Checkpoint) {
    let g = ck.generation();
    let want = generation_tensors(g);
    let names: Vec<&str> = ck.names().collect();
    let want_names: Vec<&str> = want.iter().map(|(n, _, _)| n.as_str()).collect();
    assert_eq!(names, want_names, "generation {g}: tensor names");
    for (name, shape, data) in &want {
        let v = ck.tensor(name).unwrap();
        assert_eq!(v.shape, &shape[..], "generation {g}: {name} shape");
        assert!(
            v.data == &data[..],
            "generation {g}: {name} holds other bytes"
        );
    }
}

/// Not a test on its own: the child process of
/// `sigkill_during_saves_leaves_the_old_or_the_new_checkpoint`. Without the
/// environment variable it returns at once.
#[test]
fn kill_child_saves_generations_in_a_loop() {
    let Some(dir) = std::env::var_os(CHILD_ENV) else {
        return;
    };
    let dir = PathBuf::from(dir);
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        let g = checkpoint::current_generation(&dir).unwrap().unwrap_or(0) + 1;
        let ts = generation_tensors(g);
        let info = if g.is_multiple_of(2) {
            checkpoint::save(&dir, &tensor_refs(&ts), &kill_opts()).unwrap()
        } else {
            checkpoint::save_async(&dir, &tensor_refs(&ts), &kill_opts())
                .unwrap()
                .wait()
                .unwrap()
        };
        assert_eq!(info.generation, g);
    }
}

/// Kills the child if the parent test fails half-way.
struct ChildGuard(Option<Child>);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn sigkill_during_saves_leaves_the_old_or_the_new_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let first = generation_tensors(1);
    checkpoint::save(dir.path(), &tensor_refs(&first), &kill_opts()).unwrap();
    let exe = std::env::current_exe().unwrap();
    let delays_ms = [5u64, 200, 37, 120, 12, 80, 160, 25, 60, 100, 150, 8];
    let mut last = 1;
    let mut advanced = 0;
    for (round, &delay) in delays_ms.iter().enumerate() {
        let child = Command::new(&exe)
            .args(["--exact", CHILD_TEST, "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut guard = ChildGuard(Some(child));
        std::thread::sleep(Duration::from_millis(delay));
        let mut child = guard.0.take().unwrap();
        child.kill().unwrap(); // SIGKILL
        let out = child.wait_with_output().unwrap();
        assert_eq!(
            out.status.signal(),
            Some(libc::SIGKILL),
            "round {round}: the child must die by SIGKILL mid-loop, not exit ({:?}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );

        let ck = checkpoint::load(dir.path()).unwrap_or_else(|e| {
            panic!("round {round} (killed after {delay} ms): no loadable checkpoint: {e}")
        });
        let g = ck.generation();
        assert!(
            g >= last,
            "round {round}: generation went back from {last} to {g}"
        );
        assert_is_generation(&ck);
        if g > last {
            advanced += 1;
        }
        last = g;
        eprintln!("round {round}: killed after {delay} ms, committed generation {g}");
    }
    eprintln!(
        "{advanced} of {} rounds committed new generations",
        delays_ms.len()
    );

    // The next save removes whatever the kills left behind, dot files (a
    // direct-I/O probe's scratch file) included: only the lock file stays.
    let next = generation_tensors(last + 1);
    let info = checkpoint::save(dir.path(), &tensor_refs(&next), &kill_opts()).unwrap();
    assert_eq!(info.generation, last + 1);
    let mut want: BTreeSet<String> = info
        .files
        .iter()
        .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    want.insert(MANIFEST_FILE.into());
    want.insert(LOCK_FILE.into());
    assert_eq!(all_files(dir.path()), want);
    assert_is_generation(&checkpoint::load(dir.path()).unwrap());
}

fn all_files(dir: &Path) -> BTreeSet<String> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect()
}

fn visible_files(dir: &Path) -> BTreeSet<String> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| !n.starts_with('.'))
        .collect()
}

/// A small tmpfs mounted over a directory; lazily unmounted on drop.
struct TmpfsMount(PathBuf);

impl TmpfsMount {
    fn new(at: &Path, size: &str) -> Self {
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(at)
            .output();
        match out {
            Ok(o) if o.status.success() => Self(at.to_path_buf()),
            Ok(o) => panic!(
                "this test needs to mount a {size} tmpfs at {} to fill a device for real \
                 (CI runs as root); `mount` failed: {}",
                at.display(),
                String::from_utf8_lossy(&o.stderr).trim()
            ),
            Err(e) => panic!(
                "this test needs to mount a {size} tmpfs at {} (CI runs as root); \
                 cannot run `mount`: {e}",
                at.display()
            ),
        }
    }
}

impl Drop for TmpfsMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[test]
fn disk_full_save_fails_cleanly_and_keeps_the_previous_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let _mount = TmpfsMount::new(tmp.path(), "8m");
    let dir = tmp.path().join("ckpt");
    let opts = SaveOptions {
        shard_bytes: 1 << 20,
        chunk_bytes: 256 << 10,
        ..SaveOptions::default()
    };
    let small: Vec<(String, Vec<usize>, Vec<u8>)> = (0..3)
        .map(|i| (format!("s{i}"), vec![700_000], bytes(i, 700_000)))
        .collect();
    let info = checkpoint::save(&dir, &tensor_refs(&small), &opts).unwrap();
    assert_eq!(info.generation, 1);
    let committed = visible_files(&dir);

    let large: Vec<(String, Vec<usize>, Vec<u8>)> = (0..7)
        .map(|i| (format!("l{i}"), vec![1_000_000], bytes(100 + i, 1_000_000)))
        .collect();
    for (how, preallocate, async_save) in [
        ("preallocated", true, false),
        ("written until full", false, false),
        ("async", false, true),
    ] {
        let o = SaveOptions {
            preallocate,
            ..opts.clone()
        };
        let r = if async_save {
            checkpoint::save_async(&dir, &tensor_refs(&large), &o)
                .unwrap()
                .wait()
        } else {
            checkpoint::save(&dir, &tensor_refs(&large), &o)
        };
        let e = r.expect_err(&format!("{how}: 7 MB more cannot fit in an 8 MiB tmpfs"));
        assert!(e.is_disk_full(), "{how}: {e}");
        match &e {
            CheckpointError::DiskFull {
                generation,
                previous,
                ..
            } => assert_eq!((*generation, *previous), (2, Some(1)), "{how}"),
            other => panic!("{how}: expected DiskFull, got {other:?}"),
        }
        let msg = e.to_string();
        assert!(
            msg.contains("disk full") && msg.contains("generation 1"),
            "{how}: {msg}"
        );
        assert_eq!(
            visible_files(&dir),
            committed,
            "{how}: partial files removed"
        );
        let ck = checkpoint::load(&dir).unwrap();
        assert_eq!(ck.generation(), 1, "{how}");
        for (name, _, data) in &small {
            assert!(ck.tensor(name).unwrap().data == &data[..], "{how}: {name}");
        }
    }

    // The directory stays usable: a save that fits commits.
    let info = checkpoint::save(&dir, &tensor_refs(&small[..1]), &opts).unwrap();
    assert_eq!(info.generation, 2);
    assert_eq!(checkpoint::load(&dir).unwrap().len(), 1);
}

#[test]
fn a_probe_file_left_by_a_killed_save_is_removed_by_the_next_save() {
    let dir = tempfile::tempdir().unwrap();
    checkpoint::save(
        dir.path(),
        &tensor_refs(&generation_tensors(1)),
        &kill_opts(),
    )
    .unwrap();
    // A save killed inside its O_DIRECT probe leaves the probe's scratch
    // file, named after its (now dead) process.
    let mut dead = Command::new("true").spawn().unwrap();
    let dead_pid = dead.id();
    dead.wait().unwrap();
    let stale = format!(".kvtier-direct-probe-{dead_pid}-0");
    // One of a live process may be a probe in progress: it stays.
    let live = format!(
        ".kvtier-direct-probe-{}-0",
        std::os::unix::process::parent_id()
    );
    for name in [&stale, &live] {
        fs::write(dir.path().join(name), [0u8; 4096]).unwrap();
    }
    checkpoint::save(
        dir.path(),
        &tensor_refs(&generation_tensors(2)),
        &kill_opts(),
    )
    .unwrap();
    let files = all_files(dir.path());
    assert!(!files.contains(&stale), "{files:?}");
    assert!(files.contains(&live), "{files:?}");
    assert_is_generation(&checkpoint::load(dir.path()).unwrap());
}
