//! RAGPulse (a RAG Q&A service's two weeks): `0_trace.jsonl` names, per
//! request, the chunks of each prompt component (`sys_prompt`,
//! `passages_ids`, `history`, `web_search`, `user_input`, in that order),
//! and the files beside it give each chunk's token length.
//!
//! Chunks are variable-sized, so the prompt is laid out as the components'
//! chunks in order and cut into fixed blocks (`--block-size`, default 512);
//! a block's id is chained: its parent block's id and the chunk pieces it
//! covers, so equal ids mean the same tokens after the same prefix, as a
//! prefix cache sees them.
//!
//! `timestamp` is seconds, as a string, and restarts at 0 where the file's
//! second week begins; the dataset's README says the weeks are consecutive,
//! so every restart adds one week to the clock.

use std::collections::HashMap;
use std::path::Path;

use crate::trace::{Ids, ReadOptions, count, for_each_json_line, raw_id, seconds};
use crate::{Format, Request, Trace, TraceError};

/// The trace file's name.
pub const TRACE_FILE: &str = "0_trace.jsonl";

/// The default block size.
pub const BLOCK_SIZE: u32 = 512;

/// The prompt components in prompt order: the trace's key, the file of
/// chunk lengths and the id field in it.
const COMPONENTS: [(&str, &str, &str); 5] = [
    ("sys_prompt", "1_sys_prompt.jsonl", "sys_prompt_id"),
    ("passages_ids", "2_passages.jsonl", "passage_id"),
    ("history", "3_history.jsonl", "history_id"),
    ("web_search", "5_web_search.jsonl", "web_search_id"),
    ("user_input", "4_user_input.jsonl", "user_input_id"),
];

/// A week, the length of each of the file's segments.
const SEGMENT_S: f64 = 7.0 * 24.0 * 3600.0;

/// One piece of a chunk inside a block: (component, chunk, first token, tokens).
type Piece = (u8, u64, u32, u32);

/// Reads RAGPulse from its folder or its `0_trace.jsonl`.
pub fn read(path: &Path, options: ReadOptions) -> Result<Trace, TraceError> {
    let (dir, trace_file) = if path.is_dir() {
        (path.to_path_buf(), path.join(TRACE_FILE))
    } else {
        (
            path.parent().map(Path::to_path_buf).unwrap_or_default(),
            path.to_path_buf(),
        )
    };
    let block_size = options.block_size.unwrap_or(BLOCK_SIZE);
    let lengths = COMPONENTS
        .iter()
        .map(|(_, file, field)| chunk_lengths(&dir.join(file), field))
        .collect::<Result<Vec<_>, _>>()?;
    let mut blocks_by_content: HashMap<(u64, Vec<Piece>), u64> = HashMap::new();
    let mut sessions = Ids::default();
    let mut requests = Vec::new();
    let (mut offset, mut last) = (0.0, 0.0);
    for_each_json_line(&trace_file, |n, v| {
        let bad = |why: String| TraceError::line(&trace_file, n, why);
        let t = seconds(&v, "timestamp").map_err(bad)?;
        if t < last {
            offset += SEGMENT_S;
        }
        last = t;
        let input_tokens = count(&v, "input_length").map_err(bad)?;
        let output_tokens = count(&v, "output_length").map_err(bad)?;
        let ids = v
            .get("hash_ids")
            .and_then(|h| h.as_object())
            .ok_or_else(|| bad("hash_ids must be an object of component lists".into()))?;
        // The prompt's chunks in order, with their lengths.
        let mut chunks = Vec::new();
        for (c, ((key, file, _), lengths)) in COMPONENTS.iter().zip(&lengths).enumerate() {
            let Some(list) = ids.get(*key) else { continue };
            let list = list
                .as_array()
                .ok_or_else(|| bad(format!("hash_ids.{key} must be a list")))?;
            for id in list {
                let id = raw_id(id).map_err(bad)?;
                let id: u64 = id
                    .parse()
                    .map_err(|_| bad(format!("hash_ids.{key}: id {id:?} is not an integer")))?;
                let len = *lengths
                    .get(&id)
                    .ok_or_else(|| bad(format!("hash_ids.{key}: id {id} is not in {file}")))?;
                if len > 0 {
                    chunks.push((c as u8, id, len));
                }
            }
        }
        let (blocks, block_tokens) = cut(&chunks, block_size, &mut blocks_by_content);
        let session = match v.get("session_id") {
            Some(s) => Some(sessions.id(0, raw_id(s).map_err(bad)?)),
            None => None,
        };
        requests.push(Request {
            time_s: t + offset,
            session,
            blocks,
            block_tokens,
            input_tokens,
            output_tokens,
        });
        Ok(())
    })?;
    Ok(Trace {
        name: crate::format::generic::name_of(&dir),
        format: Format::Ragpulse,
        block_size,
        requests,
    })
}

/// Cuts chunks laid end to end into blocks of `block_size` tokens with
/// chained ids.
fn cut(
    chunks: &[(u8, u64, u32)],
    block_size: u32,
    known: &mut HashMap<(u64, Vec<Piece>), u64>,
) -> (Vec<u64>, Vec<u32>) {
    let mut blocks = Vec::new();
    let mut tokens = Vec::new();
    let mut pieces: Vec<Piece> = Vec::new();
    let mut filled = 0u32;
    // Id 0 is the root (no parent); block ids start at 1.
    let mut parent = 0u64;
    let mut close = |pieces: &mut Vec<Piece>, filled: u32, parent: &mut u64| {
        let next = known.len() as u64 + 1;
        let id = *known
            .entry((*parent, std::mem::take(pieces)))
            .or_insert(next);
        blocks.push(id);
        tokens.push(filled);
        *parent = id;
    };
    for &(component, chunk, len) in chunks {
        let mut at = 0;
        while at < len {
            let take = (len - at).min(block_size - filled);
            pieces.push((component, chunk, at, take));
            filled += take;
            at += take;
            if filled == block_size {
                close(&mut pieces, filled, &mut parent);
                filled = 0;
            }
        }
    }
    if filled > 0 {
        close(&mut pieces, filled, &mut parent);
    }
    (blocks, tokens)
}

/// Chunk id -> token length, from one of the length files.
fn chunk_lengths(path: &Path, field: &str) -> Result<HashMap<u64, u32>, TraceError> {
    let mut out = HashMap::new();
    for_each_json_line(path, |n, v| {
        let bad = |why: String| TraceError::line(path, n, why);
        let id = count(&v, field).map_err(bad)?;
        let len = count(&v, "token_length").map_err(bad)?;
        let len =
            u32::try_from(len).map_err(|_| bad(format!("token_length {len} out of range")))?;
        out.insert(id, len);
        Ok(())
    })?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn folder(trace: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("dir");
        let w =
            |name: &str, text: &str| std::fs::write(dir.path().join(name), text).expect("write");
        w(
            "1_sys_prompt.jsonl",
            "{\"sys_prompt_id\": 1, \"token_length\": 6}\n{\"sys_prompt_id\": 2, \"token_length\": 3}\n",
        );
        w(
            "2_passages.jsonl",
            "{\"passage_id\": 10, \"token_length\": 5}\n",
        );
        w("3_history.jsonl", "");
        w(
            "4_user_input.jsonl",
            "{\"user_input_id\": 30, \"token_length\": 2}\n{\"user_input_id\": 31, \"token_length\": 2}\n",
        );
        w("5_web_search.jsonl", "");
        w(TRACE_FILE, trace);
        dir
    }

    #[test]
    fn chunks_cut_into_chained_blocks_and_the_clock_continues() {
        let dir = folder(
            "{\"timestamp\": \"5\", \"input_length\": 13, \"output_length\": 1, \"hash_ids\": {\"sys_prompt\": [1], \"passages_ids\": [10], \"user_input\": [30]}, \"session_id\": \"a\"}\n\
             {\"timestamp\": \"1\", \"input_length\": 13, \"output_length\": 1, \"hash_ids\": {\"sys_prompt\": [1], \"passages_ids\": [10], \"user_input\": [31]}, \"session_id\": \"a\"}\n\
             {\"timestamp\": \"2\", \"input_length\": 10, \"output_length\": 1, \"hash_ids\": {\"sys_prompt\": [2], \"passages_ids\": [10], \"user_input\": [30]}, \"session_id\": \"b\"}\n",
        );
        let t = read(
            dir.path(),
            ReadOptions {
                block_size: Some(4),
            },
        )
        .expect("read");
        let r = &t.requests;
        assert_eq!(r[0].block_tokens, vec![4, 4, 4, 1]);
        // The same first 11 tokens (system prompt and passage); the user
        // input differs from the 12th, in the third block.
        assert_eq!(r[0].blocks[..2], r[1].blocks[..2]);
        assert_ne!(r[0].blocks[2], r[1].blocks[2]);
        // Another system prompt: no block in common, even the later ones
        // with the same passage pieces (chained ids).
        assert!(r[2].blocks.iter().all(|b| !r[0].blocks.contains(b)));
        assert_eq!(r[1].time_s, SEGMENT_S + 1.0);
        assert_eq!(r[0].session, r[1].session);
    }

    #[test]
    fn an_unknown_chunk_names_line_and_file() {
        let dir = folder(
            "{\"timestamp\": \"5\", \"input_length\": 1, \"output_length\": 1, \"hash_ids\": {\"sys_prompt\": [99]}}\n",
        );
        let e = read(dir.path(), ReadOptions::default())
            .expect_err("unknown")
            .to_string();
        assert!(
            e.contains("0_trace.jsonl:1: hash_ids.sys_prompt: id 99 is not in 1_sys_prompt.jsonl"),
            "{e}"
        );
    }
}
