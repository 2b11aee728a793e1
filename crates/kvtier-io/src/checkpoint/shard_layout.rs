//! Shard layout: which tensor goes in which shard file, at which offset,
//! with which padding tensors, and how the file images split into aligned
//! write chunks. Pure computation; no I/O.

use std::collections::HashSet;

use super::checkpoint_error::CheckpointError;
use super::options::{PAD_PREFIX, SaveOptions, TensorRef};
use crate::buffer::DIRECT_IO_ALIGN;
use crate::safetensors::{Dtype, TensorInfo, encode_header};

/// Alignment of every real tensor's first byte, in the file and in the
/// data section (the data section itself starts at a multiple of it).
pub const TENSOR_ALIGN: u64 = DIRECT_IO_ALIGN as u64;

/// Largest piece [`Plan::fill_with`] copies before handing it on: small
/// enough to still be in the core's cache when it is checksummed.
pub(crate) const FILL_PIECE: usize = 256 << 10;

/// Where one input tensor lands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Placed {
    /// Shard index.
    pub shard: usize,
    /// Start offset relative to the shard's data section.
    pub begin: u64,
    /// End offset (exclusive) relative to the data section.
    pub end: u64,
}

/// One shard file's image.
#[derive(Debug, Clone)]
pub(crate) struct ShardLayout {
    /// The 8-byte length prefix plus the space-padded JSON header; its
    /// length is the data section's start, a multiple of [`TENSOR_ALIGN`].
    pub header: Vec<u8>,
    /// Exact file length: header plus data section.
    pub file_len: u64,
    /// Input indices of the tensors in this shard, in offset order.
    pub members: Vec<usize>,
    /// Index of this shard's first chunk in [`Plan::chunks`].
    pub first_chunk: usize,
    /// Number of chunks of this shard.
    pub n_chunks: usize,
}

impl ShardLayout {
    /// File offset of the data section.
    pub fn data_start(&self) -> u64 {
        self.header.len() as u64
    }
}

/// One aligned write: a piece of a shard file image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Chunk {
    /// Shard index.
    pub shard: usize,
    /// File offset (a multiple of [`TENSOR_ALIGN`]).
    pub offset: u64,
    /// Bytes (a multiple of [`TENSOR_ALIGN`]; the last chunk of a shard is
    /// padded past the file's end and the file truncated afterwards).
    pub len: usize,
    /// The input tensor whose bytes alone fill this chunk, if one does: the
    /// writer may then write it straight from the caller's memory.
    pub tensor: Option<usize>,
}

/// The complete layout of one save.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    /// One per input tensor, in input order.
    pub placed: Vec<Placed>,
    /// The shard files.
    pub shards: Vec<ShardLayout>,
    /// Every write, shard by shard, in file order.
    pub chunks: Vec<Chunk>,
    /// Largest chunk.
    pub chunk_bytes: usize,
}

impl Plan {
    /// Sum of the shard files' exact lengths.
    pub fn file_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.file_len).sum()
    }

    /// File range `[start, end)` of input tensor `i` in its shard.
    pub fn file_range(&self, i: usize) -> (u64, u64) {
        let p = self.placed[i];
        let ds = self.shards[p.shard].data_start();
        (ds + p.begin, ds + p.end)
    }

    /// Fills `out` with the bytes of shard `shard`'s image at file offset
    /// `offset`: header, tensor bytes from `data` (indexed like the input),
    /// zeros for padding and past the file's end.
    pub fn fill(&self, shard: usize, offset: u64, out: &mut [u8], data: &[&[u8]]) {
        self.fill_with(shard, offset, out, data, |_, _| {});
    }

    /// [`fill`](Self::fill), calling `copied(i, bytes)` with each piece of
    /// input tensor `i` right after it is copied (pieces of at most
    /// [`FILL_PIECE`] bytes, in file order), while it is still in cache.
    pub fn fill_with(
        &self,
        shard: usize,
        offset: u64,
        out: &mut [u8],
        data: &[&[u8]],
        mut copied: impl FnMut(usize, &[u8]),
    ) {
        let sl = &self.shards[shard];
        let end = offset + out.len() as u64;
        let mut pos = offset;
        // `tensor`: the input index, `None` for the header.
        let mut copy = |tensor: Option<usize>, seg_start: u64, src: &[u8], pos: &mut u64| {
            let seg_end = seg_start + src.len() as u64;
            let s = seg_start.max(offset);
            let e = seg_end.min(end);
            if e <= s {
                return;
            }
            if s > *pos {
                out[(*pos - offset) as usize..(s - offset) as usize].fill(0);
            }
            let dst = &mut out[(s - offset) as usize..(e - offset) as usize];
            let src = &src[(s - seg_start) as usize..(e - seg_start) as usize];
            for (d, s) in dst.chunks_mut(FILL_PIECE).zip(src.chunks(FILL_PIECE)) {
                d.copy_from_slice(s);
                if let Some(i) = tensor {
                    copied(i, d);
                }
            }
            *pos = e;
        };
        copy(None, 0, &sl.header, &mut pos);
        let ds = sl.data_start();
        // First member that ends after `offset`.
        let first = sl
            .members
            .partition_point(|&i| ds + self.placed[i].end <= offset);
        for &i in &sl.members[first..] {
            let start = ds + self.placed[i].begin;
            if start >= end {
                break;
            }
            copy(Some(i), start, data[i], &mut pos);
        }
        if pos < end {
            out[(pos - offset) as usize..].fill(0);
        }
    }
}

/// Checks the tensors and lays them out in shards.
pub(crate) fn plan(tensors: &[TensorRef<'_>], opts: &SaveOptions) -> Result<Plan, CheckpointError> {
    validate_options(opts)?;
    validate_tensors(tensors)?;

    // Greedy packing in input order; a tensor is never split, and one larger
    // than the target gets a shard of its own.
    let mut placed = Vec::with_capacity(tensors.len());
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut cur: Vec<usize> = Vec::new();
    let mut cur_end = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        let size = t.data.len() as u64;
        let mut begin = cur_end.next_multiple_of(TENSOR_ALIGN);
        if !cur.is_empty() && begin.saturating_add(size) > opts.shard_bytes {
            groups.push(std::mem::take(&mut cur));
            begin = 0;
        }
        placed.push(Placed {
            shard: groups.len(),
            begin,
            end: begin + size,
        });
        cur.push(i);
        cur_end = begin + size;
    }
    if !cur.is_empty() {
        groups.push(cur);
    }

    let chunk_bytes = opts.chunk_bytes;
    let mut shards = Vec::with_capacity(groups.len());
    let mut chunks = Vec::new();
    for (s, members) in groups.into_iter().enumerate() {
        let mut infos = Vec::with_capacity(members.len() * 2);
        let mut at = 0u64;
        let mut pads = 0usize;
        for &i in &members {
            let p = placed[i];
            if p.begin > at {
                infos.push(TensorInfo {
                    name: format!("{PAD_PREFIX}{pads}"),
                    dtype: Dtype::U8,
                    shape: vec![(p.begin - at) as usize],
                    data_offsets: (at, p.begin),
                });
                pads += 1;
            }
            let t = &tensors[i];
            infos.push(TensorInfo {
                name: t.name.to_string(),
                dtype: t.dtype,
                shape: t.shape.to_vec(),
                data_offsets: (p.begin, p.end),
            });
            at = p.end;
        }
        let header = encode_header(&infos, &opts.metadata, DIRECT_IO_ALIGN)
            .map_err(|source| CheckpointError::Header { shard: s, source })?;
        let data_start = header.len() as u64;
        let file_len = data_start + at;
        let first_chunk = chunks.len();
        split_chunks(
            s,
            members.iter().map(|&i| {
                let p = placed[i];
                (i, data_start + p.begin, data_start + p.end)
            }),
            file_len.next_multiple_of(TENSOR_ALIGN),
            chunk_bytes,
            &mut chunks,
        );
        shards.push(ShardLayout {
            header,
            file_len,
            members,
            first_chunk,
            n_chunks: chunks.len() - first_chunk,
        });
    }
    Ok(Plan {
        placed,
        shards,
        chunks,
        chunk_bytes,
    })
}

/// Smallest tensor body, as a fraction of the chunk size, that gets chunks
/// of its own (written from the caller's memory when it is aligned); the
/// bytes of smaller tensors are gathered into shared chunks, so that a
/// model with many small tensors is not written with many small writes.
const OWN_CHUNKS_DIVISOR: u64 = 8;

/// Splits one shard image of `padded` bytes into chunks of at most
/// `chunk_bytes`. `members` gives each tensor's input index and file range,
/// in file order. A large tensor's aligned body, from its first byte to its
/// last whole [`TENSOR_ALIGN`] block, gets chunks of its own (marked with
/// [`Chunk::tensor`]); everything else (the header, small tensors, the
/// partial block at a tensor's end, padding) goes into gathered chunks.
fn split_chunks(
    shard: usize,
    members: impl Iterator<Item = (usize, u64, u64)>,
    padded: u64,
    chunk_bytes: usize,
    out: &mut Vec<Chunk>,
) {
    let step = chunk_bytes as u64;
    let mut push = |from: u64, to: u64, tensor: Option<usize>| {
        let mut off = from;
        while off < to {
            let len = (to - off).min(step);
            out.push(Chunk {
                shard,
                offset: off,
                len: len as usize,
                tensor,
            });
            off += len;
        }
    };
    // Start of the bytes not yet in a chunk (always aligned).
    let mut gathered_from = 0u64;
    for (i, begin, end) in members {
        let body_end = end - end % TENSOR_ALIGN;
        if body_end <= begin || body_end - begin < (step / OWN_CHUNKS_DIVISOR).max(TENSOR_ALIGN) {
            continue;
        }
        push(gathered_from, begin, None);
        push(begin, body_end, Some(i));
        gathered_from = body_end;
    }
    push(gathered_from, padded, None);
}

fn validate_options(opts: &SaveOptions) -> Result<(), CheckpointError> {
    let bad = |m: String| Err(CheckpointError::InvalidOptions(m));
    if opts.shard_bytes == 0 {
        return bad("shard_bytes must be positive".into());
    }
    if opts.chunk_bytes == 0 || !opts.chunk_bytes.is_multiple_of(DIRECT_IO_ALIGN) {
        return bad(format!(
            "chunk_bytes {} must be a positive multiple of {DIRECT_IO_ALIGN}",
            opts.chunk_bytes
        ));
    }
    Ok(())
}

fn validate_tensors(tensors: &[TensorRef<'_>]) -> Result<(), CheckpointError> {
    let mut seen = HashSet::with_capacity(tensors.len());
    for t in tensors {
        let bad = |reason: String| {
            Err(CheckpointError::InvalidTensor {
                name: t.name.to_string(),
                reason,
            })
        };
        if t.name.is_empty() {
            return bad("the name is empty".into());
        }
        if t.name.starts_with(PAD_PREFIX) {
            return bad(format!(
                "names starting with {PAD_PREFIX:?} are reserved for padding"
            ));
        }
        if t.name == "__metadata__" {
            return bad("\"__metadata__\" is reserved by the safetensors format".into());
        }
        if !seen.insert(t.name) {
            return bad("the name appears more than once".into());
        }
        let expected = t
            .shape
            .iter()
            .try_fold(t.dtype.size_bytes(), |acc, &d| acc.checked_mul(d));
        match expected {
            None => return bad(format!("shape {:?} overflows", t.shape)),
            Some(n) if n != t.data.len() => {
                return bad(format!(
                    "shape {:?} x {} is {n} bytes but {} bytes of data were given",
                    t.shape,
                    t.dtype,
                    t.data.len()
                ));
            }
            Some(_) => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use proptest::prelude::*;

    fn opts(shard_bytes: u64, chunk_bytes: usize) -> SaveOptions {
        SaveOptions {
            shard_bytes,
            chunk_bytes,
            ..SaveOptions::default()
        }
    }

    #[test]
    fn pads_align_every_tensor_and_big_ones_get_their_own_shard() {
        let a = vec![1u8; 10];
        let b = vec![2u8; 20_000];
        let c = vec![3u8; 5];
        let ts = [
            TensorRef::new("a", Dtype::U8, &[10], &a),
            TensorRef::new("b", Dtype::F32, &[5000], &b),
            TensorRef::new("c", Dtype::U8, &[5], &c),
        ];
        let p = plan(&ts, &opts(16_384, 8192)).unwrap();
        assert_eq!(p.shards.len(), 3, "{:?}", p.placed);
        assert_eq!(
            p.placed[1],
            Placed {
                shard: 1,
                begin: 0,
                end: 20_000
            }
        );
        assert_eq!(p.shards[1].data_start() % TENSOR_ALIGN, 0);
        // A single 20 000-byte tensor: data starts at 4096; its body (16 384
        // bytes) gets chunks of its own, the last 3616 bytes go with the
        // padding. The header chunk ends where the tensor starts.
        let chunks: Vec<(u64, usize, Option<usize>)> = p
            .chunks
            .iter()
            .filter(|c| c.shard == 1)
            .map(|c| (c.offset, c.len, c.tensor))
            .collect();
        assert_eq!(
            chunks,
            vec![
                (0, 4096, None),
                (4096, 8192, Some(1)),
                (12_288, 8192, Some(1)),
                (20_480, 4096, None)
            ]
        );
        // The 10-byte tensor is too small for chunks of its own.
        assert!(
            p.chunks
                .iter()
                .filter(|c| c.shard == 0)
                .all(|c| c.tensor.is_none())
        );
    }

    #[test]
    fn bad_tensors_are_rejected_by_name() {
        let d = vec![0u8; 8];
        for (ts, needle) in [
            (vec![TensorRef::new("x", Dtype::F32, &[3], &d)], "12 bytes"),
            (
                vec![TensorRef::new("__kvtier_pad_1", Dtype::U8, &[8], &d)],
                "reserved",
            ),
            (
                vec![TensorRef::new("__metadata__", Dtype::U8, &[8], &d)],
                "reserved",
            ),
            (vec![TensorRef::new("", Dtype::U8, &[8], &d)], "empty"),
            (
                vec![
                    TensorRef::new("x", Dtype::U8, &[8], &d),
                    TensorRef::new("x", Dtype::U8, &[8], &d),
                ],
                "more than once",
            ),
            (
                vec![TensorRef::new("x", Dtype::U8, &[usize::MAX, 2], &d)],
                "overflows",
            ),
        ] {
            let e = plan(&ts, &SaveOptions::default()).unwrap_err();
            assert!(e.to_string().contains(needle), "{e}");
        }
        let e = plan(&[], &opts(1, 100)).unwrap_err();
        assert!(matches!(e, CheckpointError::InvalidOptions(_)), "{e}");
    }

    proptest! {
        #[test]
        fn layout_is_contiguous_aligned_and_fill_reproduces_the_data(
            sizes in proptest::collection::vec(0usize..20_000, 0..24),
            shard_bytes in 1u64..60_000,
            chunk_pages in 1usize..4,
        ) {
            let bufs: Vec<Vec<u8>> = sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| (0..n).map(|j| (i * 7 + j * 13 % 251) as u8 | 1).collect())
                .collect();
            let names: Vec<String> = (0..sizes.len()).map(|i| format!("t{i}")).collect();
            let shapes: Vec<[usize; 1]> = sizes.iter().map(|&n| [n]).collect();
            let ts: Vec<TensorRef<'_>> = (0..sizes.len())
                .map(|i| TensorRef::new(&names[i], Dtype::U8, &shapes[i], &bufs[i]))
                .collect();
            let p = plan(&ts, &opts(shard_bytes, chunk_pages * 4096)).unwrap();
            let data: Vec<&[u8]> = bufs.iter().map(|b| &b[..]).collect();
            for (s, sl) in p.shards.iter().enumerate() {
                prop_assert_eq!(sl.data_start() % TENSOR_ALIGN, 0);
                // A shard over the target holds exactly one tensor.
                let span = sl.file_len - sl.data_start();
                prop_assert!(span <= shard_bytes || sl.members.len() == 1);
                // Rebuild the image from chunks and compare with the data.
                let mut image = Vec::new();
                for c in &p.chunks[sl.first_chunk..sl.first_chunk + sl.n_chunks] {
                    prop_assert_eq!(c.shard, s);
                    prop_assert_eq!(c.offset as usize, image.len());
                    prop_assert!(c.len > 0 && c.len <= p.chunk_bytes);
                    prop_assert_eq!(c.offset % TENSOR_ALIGN, 0);
                    prop_assert_eq!(c.len as u64 % TENSOR_ALIGN, 0);
                    if let Some(i) = c.tensor {
                        // A tensor's own chunk lies wholly inside it.
                        let (a, b) = p.file_range(i);
                        prop_assert_eq!(p.placed[i].shard, s);
                        prop_assert!(a <= c.offset && c.offset + c.len as u64 <= b);
                    }
                    let mut buf = vec![0xAAu8; c.len];
                    p.fill(s, c.offset, &mut buf, &data);
                    image.extend_from_slice(&buf);
                }
                prop_assert_eq!(image.len() as u64, sl.file_len.next_multiple_of(TENSOR_ALIGN));
                prop_assert!(image[sl.file_len as usize..].iter().all(|&b| b == 0));
                prop_assert_eq!(&image[..sl.header.len()], &sl.header[..]);
                let mut prev_end = sl.data_start();
                for &i in &sl.members {
                    let (a, b) = p.file_range(i);
                    prop_assert_eq!(a % TENSOR_ALIGN, 0);
                    prop_assert!(a >= prev_end);
                    prop_assert!(image[prev_end as usize..a as usize].iter().all(|&x| x == 0));
                    prop_assert_eq!(&image[a as usize..b as usize], &bufs[i][..]);
                    prev_end = b;
                }
                prop_assert_eq!(prev_end, sl.file_len);
            }
            let total: usize = p.shards.iter().map(|s| s.members.len()).sum();
            prop_assert_eq!(total, sizes.len());
        }
    }
}
