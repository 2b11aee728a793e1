//! G3's index kept on disk, so an open reads what was written since the
//! last checkpoint instead of every slot's header.
//!
//! Two kinds of files in the first slot directory, both kvtier's own:
//!
//! * `index.kvti`, the **checkpoint**: the (slot, key) of every indexed
//!   block at one moment, numbered by an epoch. A 64-byte header names the
//!   tier's shape (slots, slot size, slots per segment, the directories) and
//!   carries its own CRC32C; the entries follow, then a CRC32C of the
//!   entries. Written to a temporary file, synced, renamed over the old one,
//!   the directory synced.
//! * `journal-<epoch>.kvtj`, the **journal**: every slot change since
//!   checkpoint `epoch`, in order: `take` (a slot is about to be
//!   overwritten: what it held is gone), `put` (a slot holds a key's whole
//!   block), `free` (a slot was wiped). A 64-byte header like the
//!   checkpoint's, then 32-byte records, each with its own CRC32C, appended
//!   with one `write` per batch and synced with the segments
//!   ([`DiskTier::sync`](super::DiskTier::sync)).
//!
//! **Open** ([`load`]): the checkpoint, then the journals of its epoch and
//! later, in order (a crash between starting a journal and renaming its
//! checkpoint leaves two). A journal ends at its first bad record (a torn
//! tail). A missing, torn or foreign checkpoint or journal (another shape,
//! a bad checksum, an unknown version) means a full scan of the slot
//! headers (`recover`), never an index trusted in part. Either way the open
//! ends by writing a fresh checkpoint and journal ([`SavedIndex::start`]).
//! **Checkpoints** are written again at every sync (a clean stop) and when
//! the journal holds more records than twice the blocks indexed (at least
//! 65,536), so reopening costs the blocks stored plus a bounded journal.
//!
//! **Never wrong**: every read verifies the whole block (key, layout, both
//! checksums), so an entry the journal got wrong (a write it missed, say on
//! power loss before a sync) is a miss, never a wrong block. The journal
//! keeps such misses rare: a slot is `take`n before its write is issued, so
//! after a kill -9 a half-written slot is free, not indexed; `put` is
//! appended once the write completed. A failed append deletes the
//! checkpoint (the next open scans) until the next checkpoint succeeds.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use parking_lot::Mutex;

use crate::key::BlockKey;

/// The checkpoint's file name.
pub(super) const INDEX_FILE: &str = "index.kvti";
const INDEX_MAGIC: &[u8; 4] = b"KVTI";
const JOURNAL_MAGIC: &[u8; 4] = b"KVTJ";
const VERSION: u16 = 1;
const HEADER_BYTES: usize = 64;
const ENTRY_BYTES: usize = 20;
const RECORD_BYTES: usize = 32;
/// Journal records past which a checkpoint is written, at the least.
const MIN_CHECKPOINT_RECORDS: u64 = 1 << 16;

/// What the files must describe: a checkpoint of another shape is foreign.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Shape {
    /// Slots in all.
    pub total: u32,
    /// Bytes of one slot.
    pub slot_bytes: u64,
    /// Slots per segment file.
    pub slots_per_segment: u64,
    /// CRC32C of the slot directories' paths, in order (striping depends on
    /// their order).
    pub dirs_crc: u32,
}

impl Shape {
    /// The shape of a tier over `dirs`.
    pub(super) fn new(
        total: u32,
        slot_bytes: u64,
        slots_per_segment: u64,
        dirs: &[PathBuf],
    ) -> Self {
        let mut names = Vec::new();
        for d in dirs {
            names.extend_from_slice(d.as_os_str().as_encoded_bytes());
            names.push(0);
        }
        Self {
            total,
            slot_bytes,
            slots_per_segment,
            dirs_crc: crc32c::crc32c(&names),
        }
    }

    fn header(&self, magic: &[u8; 4], epoch: u64, entries: u64) -> [u8; HEADER_BYTES] {
        let mut h = [0u8; HEADER_BYTES];
        h[0..4].copy_from_slice(magic);
        h[4..6].copy_from_slice(&VERSION.to_le_bytes());
        h[8..16].copy_from_slice(&epoch.to_le_bytes());
        h[16..20].copy_from_slice(&self.total.to_le_bytes());
        h[20..24].copy_from_slice(&self.dirs_crc.to_le_bytes());
        h[24..32].copy_from_slice(&self.slot_bytes.to_le_bytes());
        h[32..40].copy_from_slice(&self.slots_per_segment.to_le_bytes());
        h[40..48].copy_from_slice(&entries.to_le_bytes());
        let crc = crc32c::crc32c(&h[..60]);
        h[60..64].copy_from_slice(&crc.to_le_bytes());
        h
    }

    /// Checks a header; returns (epoch, entries).
    fn check_header(&self, magic: &[u8; 4], h: &[u8]) -> Result<(u64, u64), Fault> {
        if h.len() < HEADER_BYTES {
            return Err(Fault::ShortHeader);
        }
        if &h[0..4] != magic {
            return Err(Fault::BadMagic);
        }
        if crc32c::crc32c(&h[..60]) != u32_at(h, 60) {
            return Err(Fault::HeaderChecksum);
        }
        if u16::from_le_bytes([h[4], h[5]]) != VERSION {
            return Err(Fault::UnknownVersion);
        }
        let epoch = u64_at(h, 8);
        let entries = u64_at(h, 40);
        if *self != self.with_header_fields(h) {
            return Err(Fault::OtherShape);
        }
        Ok((epoch, entries))
    }

    fn with_header_fields(&self, h: &[u8]) -> Self {
        Self {
            total: u32_at(h, 16),
            dirs_crc: u32_at(h, 20),
            slot_bytes: u64_at(h, 24),
            slots_per_segment: u64_at(h, 32),
        }
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// One slot change, as the journal records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Change {
    /// The slot is about to be overwritten.
    Take(u32),
    /// The slot holds the key's whole block.
    Put(u32, BlockKey),
    /// The slot was wiped.
    Free(u32),
}

impl Change {
    fn encode(self, out: &mut Vec<u8>) {
        let mut r = [0u8; RECORD_BYTES];
        let (kind, slot, key) = match self {
            Change::Take(s) => (1u8, s, [0u8; 16]),
            Change::Put(s, k) => (2, s, k.0),
            Change::Free(s) => (3, s, [0u8; 16]),
        };
        r[0] = kind;
        r[4..8].copy_from_slice(&slot.to_le_bytes());
        r[8..24].copy_from_slice(&key);
        let crc = crc32c::crc32c(&r[..28]);
        r[28..32].copy_from_slice(&crc.to_le_bytes());
        out.extend_from_slice(&r);
    }

    fn decode(r: &[u8]) -> Option<Self> {
        if r.len() < RECORD_BYTES || crc32c::crc32c(&r[..28]) != u32_at(r, 28) {
            return None;
        }
        let slot = u32_at(r, 4);
        let mut key = [0u8; 16];
        key.copy_from_slice(&r[8..24]);
        match r[0] {
            1 => Some(Change::Take(slot)),
            2 => Some(Change::Put(slot, BlockKey(key))),
            3 => Some(Change::Free(slot)),
            _ => None,
        }
    }
}

/// The index as the files left it.
#[derive(Debug)]
pub(super) struct Loaded {
    /// (slot, key) of every indexed block: each slot and each key once.
    pub entries: Vec<(u32, BlockKey)>,
    /// The newest epoch found (the next checkpoint takes a later one).
    pub epoch: u64,
    /// Journal records replayed.
    pub replayed: u64,
}

fn journal_name(epoch: u64) -> String {
    format!("journal-{epoch:016}.kvtj")
}

/// Epochs of the journal files in `dir`, ascending.
fn journal_epochs(dir: &Path) -> io::Result<Vec<u64>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let name = e?.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(epoch) = name
            .strip_prefix("journal-")
            .and_then(|n| n.strip_suffix(".kvtj"))
            .and_then(|n| n.parse::<u64>().ok())
        {
            out.push(epoch);
        }
    }
    out.sort_unstable();
    Ok(out)
}

/// Reads a file of kvtier's that must be regular and at most `max` bytes.
fn read_regular(path: &Path, max: u64) -> Result<Vec<u8>, Fault> {
    let meta = std::fs::symlink_metadata(path)?;
    if !meta.file_type().is_file() {
        return Err(Fault::NotRegular);
    }
    if meta.len() > max {
        return Err(Fault::TooLong(meta.len()));
    }
    Ok(std::fs::read(path)?)
}

/// Slot -> key and key -> slot while the files are replayed.
struct Table {
    held: Vec<Option<BlockKey>>,
    at: HashMap<BlockKey, u32>,
}

impl Table {
    fn slot(&mut self, slot: u32) -> Result<&mut Option<BlockKey>, Fault> {
        let total = self.held.len();
        self.held
            .get_mut(slot as usize)
            .ok_or(Fault::SlotPast { slot, total })
    }

    /// `slot` holds nothing.
    fn clear(&mut self, slot: u32) -> Result<(), Fault> {
        if let Some(old) = self.slot(slot)?.take() {
            self.at.remove(&old);
        }
        Ok(())
    }

    /// `slot` holds `key`; one slot per key, the later write winning (an
    /// earlier copy was dropped from the index without being wiped).
    fn put(&mut self, slot: u32, key: BlockKey) -> Result<(), Fault> {
        self.clear(slot)?;
        if let Some(prev) = self.at.insert(key, slot) {
            self.held[prev as usize] = None;
        }
        self.held[slot as usize] = Some(key);
        Ok(())
    }
}

/// Why the saved index cannot be used: the tier then scans every slot.
#[derive(Debug, thiserror::Error)]
pub(super) enum Unusable {
    /// A segment file was created or extended at this open.
    #[error("segment {0} was shorter than its slots (new, or truncated)")]
    Resized(PathBuf),
    /// An index file is missing, unreadable or not what it should be.
    #[error("{path}: {fault}")]
    File {
        /// The checkpoint, a journal, or the directory holding them.
        path: PathBuf,
        /// What is wrong with it.
        fault: Fault,
    },
}

/// What is wrong with one index file.
#[derive(Debug, thiserror::Error)]
pub(super) enum Fault {
    /// It could not be read.
    #[error("{0}")]
    Io(#[from] io::Error),
    /// A directory, FIFO, device or link where a file should be.
    #[error("not a regular file")]
    NotRegular,
    /// Longer than any index of this tier's shape.
    #[error("{0} bytes, more than its shape allows")]
    TooLong(u64),
    /// It ends inside its header.
    #[error("shorter than its header")]
    ShortHeader,
    /// Not an index file of kvtier's.
    #[error("bad magic")]
    BadMagic,
    /// The header's checksum does not match.
    #[error("header checksum mismatch")]
    HeaderChecksum,
    /// A format version this reader does not know.
    #[error("unknown version")]
    UnknownVersion,
    /// Written by a tier of another shape.
    #[error("written for another capacity, slot size or directory list")]
    OtherShape,
    /// Its length does not match its entries.
    #[error("torn (length does not match its entries)")]
    Torn,
    /// The entries' checksum does not match.
    #[error("entries checksum mismatch")]
    EntriesChecksum,
    /// An entry names a slot the tier does not have.
    #[error("slot {slot} is past the tier's {total} slots")]
    SlotPast {
        /// The slot named.
        slot: u32,
        /// The tier's slots.
        total: usize,
    },
    /// A journal whose header names another epoch than its file name.
    #[error("its header says epoch {0}")]
    WrongEpoch(u64),
}

/// Reads the checkpoint and its journals in `dir`. `Err` says why the
/// caller must scan every slot instead.
pub(super) fn load(dir: &Path, shape: Shape) -> Result<Loaded, Unusable> {
    let path = dir.join(INDEX_FILE);
    let at = |path: &Path| {
        let path = path.to_path_buf();
        move |fault: Fault| Unusable::File { path, fault }
    };
    let max = (HEADER_BYTES + 4) as u64 + u64::from(shape.total) * ENTRY_BYTES as u64;
    let bytes = read_regular(&path, max).map_err(at(&path))?;
    let (epoch, n) = shape.check_header(INDEX_MAGIC, &bytes).map_err(at(&path))?;
    let body_end = usize::try_from(n)
        .ok()
        .and_then(|n| n.checked_mul(ENTRY_BYTES))
        .and_then(|b| b.checked_add(HEADER_BYTES))
        .filter(|&end| end + 4 == bytes.len())
        .ok_or(Fault::Torn)
        .map_err(at(&path))?;
    let body = &bytes[HEADER_BYTES..body_end];
    if crc32c::crc32c(body) != u32_at(&bytes, body_end) {
        return Err(at(&path)(Fault::EntriesChecksum));
    }
    let mut table = Table {
        held: vec![None; shape.total as usize],
        at: HashMap::new(),
    };
    for e in body.chunks_exact(ENTRY_BYTES) {
        let mut key = [0u8; 16];
        key.copy_from_slice(&e[4..20]);
        table.put(u32_at(e, 0), BlockKey(key)).map_err(at(&path))?;
    }
    let mut newest = epoch;
    let mut replayed = 0u64;
    let epochs = journal_epochs(dir).map_err(|e| at(dir)(e.into()))?;
    for j in epochs.into_iter().filter(|&j| j >= epoch) {
        let jpath = dir.join(journal_name(j));
        // Bounded: a journal past a few GiB is not one of ours.
        let bytes = read_regular(&jpath, 4 << 30).map_err(at(&jpath))?;
        let (jepoch, _) = shape
            .check_header(JOURNAL_MAGIC, &bytes)
            .map_err(at(&jpath))?;
        if jepoch != j {
            return Err(at(&jpath)(Fault::WrongEpoch(jepoch)));
        }
        newest = newest.max(j);
        for r in bytes[HEADER_BYTES..].chunks(RECORD_BYTES) {
            // A torn or garbled tail ends the journal.
            let Some(change) = Change::decode(r) else {
                break;
            };
            match change {
                Change::Take(s) | Change::Free(s) => table.clear(s),
                Change::Put(s, k) => table.put(s, k),
            }
            .map_err(at(&jpath))?;
            replayed += 1;
        }
    }
    let entries = table
        .held
        .into_iter()
        .enumerate()
        .filter_map(|(s, k)| k.map(|k| (s as u32, k)))
        .collect();
    Ok(Loaded {
        entries,
        epoch: newest,
        replayed,
    })
}

/// The journal being appended to.
#[derive(Debug)]
struct Journal {
    /// `None` after a failure: nothing is recorded until a checkpoint
    /// succeeds (the checkpoint file was deleted, so an open scans).
    file: Option<File>,
    epoch: u64,
    records: u64,
}

/// The saved index of an open tier: the journal it appends to and the
/// checkpoints it writes.
#[derive(Debug)]
pub(super) struct SavedIndex {
    dir: PathBuf,
    shape: Shape,
    journal: Mutex<Journal>,
}

impl SavedIndex {
    /// Writes checkpoint `epoch` of `entries` and starts its journal,
    /// removing older journals. On failure the files are removed (an open
    /// scans) and the index is kept in memory only until a checkpoint
    /// succeeds.
    pub(super) fn start(dir: &Path, shape: Shape, epoch: u64, entries: &[(u32, BlockKey)]) -> Self {
        // Past every journal on disk (one a failed cleanup left behind after
        // a scan must never be replayed over this checkpoint).
        let epoch = match journal_epochs(dir).ok().and_then(|e| e.last().copied()) {
            Some(newest) => epoch.max(newest.saturating_add(1)),
            None => epoch,
        };
        let saved = Self {
            dir: dir.to_path_buf(),
            shape,
            journal: Mutex::new(Journal {
                file: None,
                epoch,
                records: 0,
            }),
        };
        let mut j = saved.journal.lock();
        if let Err(e) = saved.switch(&mut j, epoch, entries) {
            saved.give_up(&mut j, &e);
        }
        drop(j);
        saved
    }

    /// Starts journal `epoch`, writes checkpoint `epoch` of `entries` and
    /// removes the older journals.
    fn switch(&self, j: &mut Journal, epoch: u64, entries: &[(u32, BlockKey)]) -> io::Result<()> {
        // Named only once its header is written: a journal file is never
        // found without one.
        let jpath = self.dir.join(journal_name(epoch));
        let jtmp = self.dir.join(format!("{}.tmp", journal_name(epoch)));
        let mut file = OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .open(&jtmp)?;
        file.write_all(&self.shape.header(JOURNAL_MAGIC, epoch, 0))?;
        std::fs::rename(&jtmp, &jpath)?;
        // From here the new journal takes the changes; the checkpoint
        // below covers everything before.
        *j = Journal {
            file: Some(file),
            epoch,
            records: 0,
        };
        let mut bytes = Vec::with_capacity(HEADER_BYTES + entries.len() * ENTRY_BYTES + 4);
        bytes.extend_from_slice(&self.shape.header(INDEX_MAGIC, epoch, entries.len() as u64));
        for (slot, key) in entries {
            bytes.extend_from_slice(&slot.to_le_bytes());
            bytes.extend_from_slice(&key.0);
        }
        let crc = crc32c::crc32c(&bytes[HEADER_BYTES..]);
        bytes.extend_from_slice(&crc.to_le_bytes());
        let tmp = self.dir.join(format!("{INDEX_FILE}.tmp"));
        {
            let mut f = File::create(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_data()?;
        }
        std::fs::rename(&tmp, self.dir.join(INDEX_FILE))?;
        File::open(&self.dir)?.sync_all()?;
        for old in journal_epochs(&self.dir)?
            .into_iter()
            .filter(|&e| e < epoch)
        {
            let _ = std::fs::remove_file(self.dir.join(journal_name(old)));
        }
        Ok(())
    }

    /// After a failure: the checkpoint and journals are removed so that an
    /// open scans rather than trust them.
    fn give_up(&self, j: &mut Journal, e: &io::Error) {
        tracing::warn!(
            "G3 index in {} cannot be saved ({e}); the next open scans every slot",
            self.dir.display()
        );
        j.file = None;
        let _ = std::fs::remove_file(self.dir.join(INDEX_FILE));
        if let Ok(epochs) = journal_epochs(&self.dir) {
            for old in epochs {
                let _ = std::fs::remove_file(self.dir.join(journal_name(old)));
            }
        }
    }

    /// Appends `changes` in one write.
    pub(super) fn append(&self, changes: &[Change]) {
        if changes.is_empty() {
            return;
        }
        let mut bytes = Vec::with_capacity(changes.len() * RECORD_BYTES);
        for c in changes {
            c.encode(&mut bytes);
        }
        let mut j = self.journal.lock();
        // Counted even when not recorded (after a failure), so that a
        // checkpoint is retried after as many changes as a full journal.
        j.records += changes.len() as u64;
        let Some(file) = j.file.as_mut() else { return };
        if let Err(e) = file.write_all(&bytes) {
            self.give_up(&mut j, &e);
        }
    }

    /// True when the journal holds enough records that a checkpoint is due
    /// (`blocks` indexed now).
    pub(super) fn checkpoint_due(&self, blocks: usize) -> bool {
        self.journal.lock().records > MIN_CHECKPOINT_RECORDS.max(2 * blocks as u64)
    }

    /// Writes a checkpoint of `snapshot()` (taken while no change can be
    /// appended) and starts its journal.
    pub(super) fn checkpoint(&self, snapshot: impl FnOnce() -> Vec<(u32, BlockKey)>) {
        let mut j = self.journal.lock();
        let epoch = j.epoch + 1;
        let entries = snapshot();
        if let Err(e) = self.switch(&mut j, epoch, &entries) {
            self.give_up(&mut j, &e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> Shape {
        Shape::new(8, 8192, 4, &[PathBuf::from("/a")])
    }

    fn k(i: u8) -> BlockKey {
        BlockKey([i; 16])
    }

    #[test]
    fn a_checkpoint_and_its_journal_replay_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let s = SavedIndex::start(dir.path(), shape(), 7, &[(0, k(1)), (1, k(2))]);
        s.append(&[Change::Take(1), Change::Put(1, k(3)), Change::Put(5, k(1))]);
        s.append(&[Change::Free(5)]);
        let l = load(dir.path(), shape()).unwrap();
        // k(1) moved to slot 5, which was then wiped; k(2) overwritten by k(3).
        assert_eq!(l.entries, vec![(1, k(3))]);
        assert_eq!((l.epoch, l.replayed), (7, 4));
        // A checkpoint folds the journal in and starts the next one.
        s.checkpoint(|| vec![(1, k(3)), (2, k(4))]);
        s.append(&[Change::Put(3, k(5))]);
        let l = load(dir.path(), shape()).unwrap();
        assert_eq!(l.entries, vec![(1, k(3)), (2, k(4)), (3, k(5))]);
        assert_eq!((l.epoch, l.replayed), (8, 1));
        assert_eq!(journal_epochs(dir.path()).unwrap(), vec![8]);
    }

    #[test]
    fn a_torn_journal_tail_is_dropped_and_a_torn_or_foreign_checkpoint_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let s = SavedIndex::start(dir.path(), shape(), 1, &[(0, k(1))]);
        s.append(&[Change::Put(2, k(2)), Change::Put(3, k(3))]);
        drop(s);
        // Half of the last record lost.
        let jpath = dir.path().join(journal_name(1));
        let len = std::fs::metadata(&jpath).unwrap().len();
        OpenOptions::new()
            .write(true)
            .open(&jpath)
            .unwrap()
            .set_len(len - 16)
            .unwrap();
        let l = load(dir.path(), shape()).unwrap();
        assert_eq!(l.entries, vec![(0, k(1)), (2, k(2))]);

        let other = Shape::new(8, 8192, 4, &[PathBuf::from("/b")]);
        let fault = |e: Unusable| match e {
            Unusable::File { fault, .. } => fault,
            other => panic!("{other}"),
        };
        assert!(matches!(
            fault(load(dir.path(), other).unwrap_err()),
            Fault::OtherShape
        ));
        let ipath = dir.path().join(INDEX_FILE);
        let mut bytes = std::fs::read(&ipath).unwrap();
        let last = bytes.len() - 5;
        bytes[last] ^= 1;
        std::fs::write(&ipath, &bytes).unwrap();
        assert!(matches!(
            fault(load(dir.path(), shape()).unwrap_err()),
            Fault::EntriesChecksum
        ));
        bytes.truncate(bytes.len() - 3);
        std::fs::write(&ipath, &bytes).unwrap();
        assert!(matches!(
            fault(load(dir.path(), shape()).unwrap_err()),
            Fault::Torn
        ));
        std::fs::remove_file(&ipath).unwrap();
        assert!(load(dir.path(), shape()).is_err());
    }

    #[test]
    fn a_checkpoint_after_a_scan_outnumbers_a_journal_left_behind() {
        let dir = tempfile::tempdir().unwrap();
        // A journal of epoch 9 whose checkpoint is gone (a failed cleanup).
        let s = SavedIndex::start(dir.path(), shape(), 9, &[]);
        s.append(&[Change::Put(1, k(1))]);
        drop(s);
        std::fs::remove_file(dir.path().join(INDEX_FILE)).unwrap();
        // The open scanned and starts over at epoch 1: it must not replay 9.
        let s = SavedIndex::start(dir.path(), shape(), 1, &[(2, k(2))]);
        drop(s);
        let l = load(dir.path(), shape()).unwrap();
        assert_eq!(l.entries, vec![(2, k(2))]);
        assert_eq!(l.epoch, 10);
        assert_eq!(journal_epochs(dir.path()).unwrap(), vec![10]);
    }

    #[test]
    fn two_journals_left_by_a_crash_mid_checkpoint_both_replay() {
        let dir = tempfile::tempdir().unwrap();
        let s = SavedIndex::start(dir.path(), shape(), 3, &[(0, k(1))]);
        s.append(&[Change::Put(1, k(2))]);
        drop(s);
        // The next journal was started but its checkpoint never renamed in.
        let mut f = File::create(dir.path().join(journal_name(4))).unwrap();
        f.write_all(&shape().header(JOURNAL_MAGIC, 4, 0)).unwrap();
        let mut rec = Vec::new();
        Change::Take(0).encode(&mut rec);
        f.write_all(&rec).unwrap();
        drop(f);
        let l = load(dir.path(), shape()).unwrap();
        assert_eq!(l.entries, vec![(1, k(2))]);
        assert_eq!(l.epoch, 4);
    }
}
