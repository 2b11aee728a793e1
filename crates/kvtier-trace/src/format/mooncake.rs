//! Mooncake JSONL: one request per line,
//! `{"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [..]}`.
//! One id per block of 512 tokens (the last one partial); ids name their
//! whole prefix.

use std::path::Path;

use crate::trace::{Ids, ReadOptions, block_tokens, count, for_each_json_line, raw_id, seconds};
use crate::{Format, Request, Trace, TraceError};

/// Mooncake's block size.
pub const BLOCK_SIZE: u32 = 512;

/// Reads a Mooncake trace.
pub fn read(path: &Path, options: ReadOptions) -> Result<Trace, TraceError> {
    let block_size = options.block_size.unwrap_or(BLOCK_SIZE);
    let mut ids = Ids::default();
    let mut requests = Vec::new();
    for_each_json_line(path, |n, v| {
        let bad = |why: String| TraceError::line(path, n, why);
        let time_s = seconds(&v, "timestamp").map_err(bad)? / 1000.0;
        let input_tokens = count(&v, "input_length").map_err(bad)?;
        let output_tokens = count(&v, "output_length").map_err(bad)?;
        let raw = v
            .get("hash_ids")
            .and_then(|h| h.as_array())
            .ok_or_else(|| bad("hash_ids must be a list".into()))?;
        let mut blocks = Vec::with_capacity(raw.len());
        for id in raw {
            blocks.push(ids.id(0, raw_id(id).map_err(bad)?));
        }
        let block_tokens = (0..blocks.len())
            .map(|i| block_tokens(input_tokens, block_size, i))
            .collect();
        requests.push(Request {
            time_s,
            session: None,
            blocks,
            block_tokens,
            input_tokens,
            output_tokens,
        });
        Ok(())
    })?;
    Ok(Trace {
        name: crate::format::generic::name_of(path),
        format: Format::Mooncake,
        block_size,
        requests,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn file(text: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().expect("temp file");
        f.write_all(text.as_bytes()).expect("write");
        f
    }

    #[test]
    fn reads_lines_and_cuts_the_last_block() {
        let f = file(
            "{\"timestamp\": 0, \"input_length\": 1000, \"output_length\": 5, \"hash_ids\": [7, 8]}\n\n\
             {\"timestamp\": 1500, \"input_length\": 512, \"output_length\": 0, \"hash_ids\": [7]}\n",
        );
        let t = read(f.path(), ReadOptions::default()).expect("read");
        assert_eq!(t.requests.len(), 2);
        assert_eq!(t.requests[0].block_tokens, vec![512, 488]);
        assert_eq!(t.requests[1].time_s, 1.5);
        // Equal raw ids are equal trace ids.
        assert_eq!(t.requests[0].blocks[0], t.requests[1].blocks[0]);
        assert_ne!(t.requests[0].blocks[0], t.requests[0].blocks[1]);
    }

    #[test]
    fn a_malformed_line_names_its_number() {
        for (bad, why) in [
            (
                "{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1}",
                "hash_ids",
            ),
            (
                "{\"timestamp\": -1, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": [1]}",
                "timestamp",
            ),
            (
                "{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": [1.5]}",
                "block id",
            ),
            ("not json", "not JSON"),
        ] {
            let f = file(&format!(
                "{{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": [1]}}\n{bad}\n"
            ));
            let e = read(f.path(), ReadOptions::default())
                .expect_err(bad)
                .to_string();
            assert!(e.contains(":2: ") && e.contains(why), "{e}");
        }
    }
}
