//! kvtier's generic JSONL trace, for traffic no public format covers. One
//! request per line:
//!
//! ```json
//! {"time_s": 1.25, "input_tokens": 300, "output_tokens": 20,
//!  "block_size": 128, "blocks": [11, 12, "c"], "session": "s1"}
//! ```
//!
//! * `time_s`: arrival in seconds (number); `input_tokens`,
//!   `output_tokens`: integers;
//! * `blocks`: the prompt's block ids head first (integers or strings;
//!   equal ids are equal KV), one per `block_size` tokens, the last one
//!   possibly partial;
//! * `block_size` (optional, default 16 or `--block-size`): tokens per full
//!   block; every line must agree;
//! * `session` (optional): an integer or string naming the conversation.
//!
//! docs/guides/traces.md has the same description.

use std::collections::HashMap;
use std::path::Path;

use crate::trace::{Ids, ReadOptions, block_tokens, count, for_each_json_line, raw_id, seconds};
use crate::{Format, Request, Trace, TraceError};

/// The block size when neither the lines nor `--block-size` give one.
pub const DEFAULT_BLOCK_SIZE: u32 = 16;

/// Reads a generic trace.
pub fn read(path: &Path, options: ReadOptions) -> Result<Trace, TraceError> {
    let mut ids = Ids::default();
    let mut sessions: HashMap<String, u64> = HashMap::new();
    let mut block_size: Option<u32> = options.block_size;
    let mut requests = Vec::new();
    for_each_json_line(path, |n, v| {
        let bad = |why: String| TraceError::line(path, n, why);
        let time_s = seconds(&v, "time_s").map_err(bad)?;
        let input_tokens = count(&v, "input_tokens").map_err(bad)?;
        let output_tokens = count(&v, "output_tokens").map_err(bad)?;
        if v.get("block_size").is_some() {
            let bs = count(&v, "block_size").map_err(bad)?;
            let bs = u32::try_from(bs)
                .ok()
                .filter(|b| *b > 0)
                .ok_or_else(|| bad(format!("block_size {bs} out of range")))?;
            match block_size {
                None => block_size = Some(bs),
                Some(b) if b != bs && options.block_size.is_none() => {
                    return Err(bad(format!("block_size {bs} differs from the trace's {b}")));
                }
                Some(_) => {}
            }
        }
        let bs = block_size.unwrap_or(DEFAULT_BLOCK_SIZE);
        let raw = v
            .get("blocks")
            .and_then(|b| b.as_array())
            .ok_or_else(|| bad("blocks must be a list".into()))?;
        let mut blocks = Vec::with_capacity(raw.len());
        for id in raw {
            blocks.push(ids.id(0, raw_id(id).map_err(bad)?));
        }
        let session = match v.get("session") {
            None | Some(serde_json::Value::Null) => None,
            Some(s) => {
                let s = raw_id(s)
                    .map_err(|_| bad(format!("session must be an integer or a string, not {s}")))?;
                let next = sessions.len() as u64;
                Some(*sessions.entry(s).or_insert(next))
            }
        };
        requests.push(Request {
            time_s,
            session,
            block_tokens: (0..blocks.len())
                .map(|i| block_tokens(input_tokens, bs, i))
                .collect(),
            blocks,
            input_tokens,
            output_tokens,
        });
        Ok(())
    })?;
    Ok(Trace {
        name: name_of(path),
        format: Format::Generic,
        block_size: block_size.unwrap_or(DEFAULT_BLOCK_SIZE),
        requests,
    })
}

/// A trace's name: its file or folder name.
pub(crate) fn name_of(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn sessions_string_ids_and_errors() {
        let mut f = tempfile::NamedTempFile::new().expect("temp");
        writeln!(
            f,
            "{{\"time_s\": 0.5, \"input_tokens\": 20, \"output_tokens\": 1, \"block_size\": 8, \"blocks\": [\"a\", 2, 3], \"session\": \"x\"}}\n\
             {{\"time_s\": 1, \"input_tokens\": 8, \"output_tokens\": 1, \"blocks\": [\"a\"], \"session\": 9}}"
        )
        .expect("write");
        let t = read(f.path(), ReadOptions::default()).expect("read");
        assert_eq!(t.block_size, 8);
        assert_eq!(t.requests[0].block_tokens, vec![8, 8, 4]);
        assert_eq!(t.requests[0].session, Some(0));
        assert_eq!(t.requests[1].session, Some(1));
        assert_eq!(t.requests[1].blocks[0], t.requests[0].blocks[0]);
        writeln!(f, "{{\"time_s\": 2, \"input_tokens\": 8, \"output_tokens\": 1, \"block_size\": 4, \"blocks\": [1]}}")
            .expect("write");
        let e = read(f.path(), ReadOptions::default())
            .expect_err("mixed block sizes")
            .to_string();
        assert!(e.contains(":3: block_size 4 differs"), "{e}");
    }
}
