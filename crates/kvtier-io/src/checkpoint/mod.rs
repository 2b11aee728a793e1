//! Crash-safe checkpoint saving and verified loading.
//!
//! A checkpoint is a set of named tensors saved as sharded safetensors
//! files plus a `manifest.json` that commits them. The decisions:
//!
//! # Files
//!
//! * **Shards.** Tensors are packed in the order given into shard files of
//!   about [`SaveOptions::shard_bytes`] of data (default 2 GiB). A tensor is
//!   never split: one bigger than the target gets a shard of its own.
//! * **Names.** Generation `g` writes
//!   `ckpt-<g, 6 digits>-<i, 5 digits>-of-<n, 5 digits>.safetensors`
//!   ([`shard_file_name`]), always new files: a save never overwrites a
//!   committed file.
//! * **Alignment.** Each shard's header is padded with spaces so that the
//!   data section starts at a multiple of 4096 (4096 itself unless the header
//!   is larger), and every tensor starts at a 4096-aligned offset in the data
//!   section, hence in the file. The safetensors format forbids gaps between
//!   tensors, so the alignment is explicit: padding tensors named
//!   `__kvtier_pad_<n>` ([`PAD_PREFIX`]), dtype `U8`, shape `[k]`, zero-filled,
//!   sit between tensors where needed. Each shard is therefore a valid
//!   safetensors file that any reader (the reference `safetensors` crate
//!   included) loads; the padding tensors carry no data and **loaders skip
//!   names starting with `__kvtier_pad_`**. [`Checkpoint`] only shows the
//!   tensors listed in the manifest. Names with that prefix, and
//!   `__metadata__`, are rejected by `save`.
//! * **Manifest.** `manifest.json` ([`Manifest`]) holds the format version,
//!   the generation number, the shard files with their exact lengths, and per
//!   tensor: shard, name, dtype, shape, data offsets and crc32c. The caller's
//!   [`SaveOptions::metadata`] goes into the manifest and into every shard's
//!   `__metadata__`.
//!
//! # Writing
//!
//! Each shard file image (header, tensors, zero padding) is cut into aligned
//! chunks of [`SaveOptions::chunk_bytes`] (default 8 MiB) and written with
//! the [`IoEngine`](crate::IoEngine), [`SaveOptions::in_flight`] writes
//! outstanding. Files are opened with `O_DIRECT` when the directory accepts
//! it ([`probe_direct`](crate::direct::probe_direct)); otherwise writes are buffered,
//! a warning is logged and [`CheckpointInfo::direct`] is false with the
//! reason in [`CheckpointInfo::direct_reason`]. Space is reserved up front
//! with `fallocate` ([`SaveOptions::preallocate`]), so a full disk is
//! usually found before any data is written. The last chunk of a file is
//! written padded to 4 KiB with zeros, and the file is then truncated
//! (`ftruncate`) to its exact length.
//!
//! A synchronous [`save`] streams chunk writes through the I/O engine,
//! [`SaveOptions::in_flight`] outstanding. A tensor of at least an eighth of
//! a chunk whose bytes start at a 4 KiB-aligned address (a page-aligned
//! allocation, pinned staging memory, a tensor loaded by kvtier's loader
//! from a kvtier checkpoint) is written straight from the caller's memory,
//! up to its last whole 4 KiB block, with no copy
//! ([`CheckpointInfo::borrowed_bytes`]). Everything else (headers, small or
//! unaligned tensors, tensor tails, padding) is gathered by
//! [`SaveOptions::threads`] threads into aligned chunk buffers, each
//! refilled as soon as its write completes. The same threads compute the
//! crc32c values, from what they just copied or while a borrowed write is
//! in flight. The buffers come from
//! [`SaveOptions::allocator`], by default [`default_write_allocator`], which
//! keeps them for the process's next save. [`save_async`] copies the file images into host buffers
//! from [`SaveOptions::allocator`] (the snapshot), returns a [`SaveHandle`],
//! and writes them from a background thread with no further copy.
//!
//! # Commit protocol
//!
//! Under an exclusive `flock` on `.kvtier-checkpoint.lock` in the directory
//! (so two saves never interleave; the kernel drops it if the process dies):
//!
//! 1. read `manifest.json` (the committed generation `g`, or none) and remove
//!    files of uncommitted generations left by earlier crashes ([`cleanup`]);
//! 2. write the shard files of generation `g + 1`, truncate and fsync each;
//!    fsync the directory;
//! 3. write the manifest to `manifest.json.tmp`, fsync it, rename it over
//!    `manifest.json`, fsync the directory: **this is the commit point**;
//! 4. only then delete generation `g`'s shard files.
//!
//! A crash (or SIGKILL) anywhere leaves `manifest.json` naming either the
//! complete old generation or the complete new one, never a mix; stray files
//! of an uncommitted generation are ignored by [`load`] and removed by the
//! next save. An error before the commit point (a full disk included:
//! [`CheckpointError::DiskFull`]) removes the new generation's files and
//! leaves the previous checkpoint committed and loadable. If the final
//! directory fsync fails, no file is deleted and the error is returned.
//!
//! # Loading
//!
//! [`load`] reads `manifest.json`, checks each shard's length, loads the
//! shards with the [loader](crate::loader), checks every tensor's dtype,
//! shape and offsets against the manifest, and verifies every tensor's
//! crc32c: a flipped byte is [`CheckpointError::Checksum`] naming the tensor.

mod background;
mod checkpoint_error;
mod cleanup;
mod dirs;
mod manifest;
mod options;
mod reader;
mod shard_layout;
mod writer;

pub use background::{SaveHandle, save_async};
pub use checkpoint_error::CheckpointError;
pub use cleanup::cleanup;
pub use dirs::{fsync_dir, shard_file_name};
pub use manifest::{
    MANIFEST_FORMAT, MANIFEST_VERSION, Manifest, ShardEntry, TensorEntry, current_generation,
    read_manifest,
};
pub use options::{
    CheckpointInfo, LOCK_FILE, MANIFEST_FILE, MANIFEST_TMP, PAD_PREFIX, SaveOptions, TensorRef,
    default_write_allocator,
};
pub use reader::{Checkpoint, LoadOptions, load, load_with};
pub use shard_layout::TENSOR_ALIGN;
pub use writer::save;
