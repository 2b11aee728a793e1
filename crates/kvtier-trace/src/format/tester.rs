//! kv-cache-tester sessions (WEKA's Claude Code traces): one JSON file per
//! session with `block_size` and `requests[]`, each request with `t`
//! (seconds since the session start), `in`, `out` and `hash_ids` (one id
//! per full block). A request of `type` `"subagent"` carries its own
//! `requests[]`, timed from the marker's `t`; they are flattened into the
//! session in time order. Ids are local to a file, so each file is its own
//! namespace (sub-agents share their session's). A folder is read as all
//! its `.json` files in name order, every session starting at time 0, as
//! the tester replays them.

use std::path::{Path, PathBuf};

use crate::trace::{Ids, ReadOptions, block_tokens, open_regular, raw_id};
use crate::{Format, Request, Trace, TraceError};

/// The block size when a file does not say.
pub const BLOCK_SIZE: u32 = 64;

/// The largest session file read (the public ones are a few MB).
const MAX_FILE_BYTES: u64 = 1 << 30;

/// Reads one session file or a folder of them.
pub fn read(path: &Path, options: ReadOptions) -> Result<Trace, TraceError> {
    let files = if std::fs::metadata(path)
        .map_err(|e| TraceError::io(path, e))?
        .is_dir()
    {
        let mut files: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(|e| TraceError::io(path, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "json"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(TraceError::trace(
                path,
                "no .json session files in the folder",
            ));
        }
        files
    } else {
        vec![path.to_path_buf()]
    };
    let mut ids = Ids::default();
    let mut requests = Vec::new();
    let mut block_size = options.block_size;
    for (session, file) in files.iter().enumerate() {
        let size = open_regular(file)?
            .metadata()
            .map_err(|e| TraceError::io(file, e))?
            .len();
        if size > MAX_FILE_BYTES {
            return Err(TraceError::trace(
                file,
                format!("a session file over {MAX_FILE_BYTES} bytes"),
            ));
        }
        let text = std::fs::read_to_string(file).map_err(|e| TraceError::io(file, e))?;
        let doc: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| TraceError::line(file, e.line(), format!("not JSON: {e}")))?;
        let field = |at: String, why: String| TraceError::Field {
            path: file.clone(),
            at,
            why,
        };
        let bs = match doc.get("block_size") {
            None => options.block_size.unwrap_or(BLOCK_SIZE),
            Some(v) => v
                .as_u64()
                .and_then(|b| u32::try_from(b).ok())
                .filter(|b| *b > 0)
                .ok_or_else(|| {
                    field(
                        "block_size".into(),
                        format!("must be a positive integer, not {v}"),
                    )
                })?,
        };
        let bs = options.block_size.unwrap_or(bs);
        block_size.get_or_insert(bs);
        let top = doc
            .get("requests")
            .and_then(|r| r.as_array())
            .ok_or_else(|| field("requests".into(), "must be a list".into()))?;
        let mut flat = Vec::new();
        flatten(top, 0.0, "requests", &mut flat, &field)?;
        for (t, at, r) in flat {
            let num = |name: &str| -> Result<u64, TraceError> {
                r.get(name).and_then(|v| v.as_u64()).ok_or_else(|| {
                    field(
                        format!("{at}.{name}"),
                        "must be a non-negative integer".into(),
                    )
                })
            };
            let input_tokens = num("in")?;
            let output_tokens = num("out")?;
            let raw = r
                .get("hash_ids")
                .and_then(|h| h.as_array())
                .ok_or_else(|| field(format!("{at}.hash_ids"), "must be a list".into()))?;
            let mut blocks = Vec::with_capacity(raw.len());
            for id in raw {
                let id = raw_id(id).map_err(|why| field(format!("{at}.hash_ids"), why))?;
                blocks.push(ids.id(session as u64 + 1, id));
            }
            requests.push(Request {
                time_s: t,
                session: Some(session as u64),
                block_tokens: (0..blocks.len())
                    .map(|i| block_tokens(input_tokens, bs, i))
                    .collect(),
                blocks,
                input_tokens,
                output_tokens,
            });
        }
    }
    Ok(Trace {
        name: crate::format::generic::name_of(path),
        format: Format::Tester,
        block_size: block_size.unwrap_or(BLOCK_SIZE),
        requests,
    })
}

type Flat<'a> = Vec<(f64, String, &'a serde_json::Value)>;

/// Collects the requests (not the sub-agent markers) of `list`, timed from
/// `start`, with where each sits in the document.
fn flatten<'a>(
    list: &'a [serde_json::Value],
    start: f64,
    at: &str,
    out: &mut Flat<'a>,
    field: &impl Fn(String, String) -> TraceError,
) -> Result<(), TraceError> {
    for (i, r) in list.iter().enumerate() {
        let here = format!("{at}[{i}]");
        let t = r
            .get("t")
            .and_then(|t| t.as_f64())
            .filter(|t| t.is_finite() && *t >= 0.0)
            .ok_or_else(|| field(format!("{here}.t"), "must be a non-negative number".into()))?;
        if r.get("type").and_then(|t| t.as_str()) == Some("subagent") {
            let nested = r
                .get("requests")
                .and_then(|n| n.as_array())
                .ok_or_else(|| {
                    field(
                        format!("{here}.requests"),
                        "a subagent needs a requests list".into(),
                    )
                })?;
            flatten(nested, start + t, &format!("{here}.requests"), out, field)?;
        } else {
            out.push((start + t, here, r));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) {
        std::fs::write(dir.join(name), text).expect("write");
    }

    #[test]
    fn sub_agents_flattened_in_time_and_ids_local_to_a_file() {
        let dir = tempfile::tempdir().expect("dir");
        let session = r#"{"block_size": 64, "requests": [
            {"t": 0, "type": "s", "in": 130, "out": 5, "hash_ids": [1, 2]},
            {"t": 10, "type": "subagent", "requests": [
                {"t": 1, "type": "n", "in": 64, "out": 1, "hash_ids": [1]},
                {"t": 30, "type": "n", "in": 64, "out": 1, "hash_ids": [9]}]},
            {"t": 20, "type": "s", "in": 200, "out": 5, "hash_ids": [1, 2, 3]}]}"#;
        write(dir.path(), "a.json", session);
        write(dir.path(), "b.json", session);
        let t =
            crate::read(dir.path(), Some(Format::Tester), ReadOptions::default()).expect("read");
        assert_eq!(t.requests.len(), 8);
        let a: Vec<_> = t
            .requests
            .iter()
            .filter(|r| r.session == Some(0))
            .map(|r| r.time_s)
            .collect();
        assert_eq!(a, vec![0.0, 11.0, 20.0, 40.0]);
        // Id 1 of file a is not id 1 of file b; a sub-agent shares its
        // session's ids.
        let first: Vec<_> = t
            .requests
            .iter()
            .filter(|r| r.time_s == 0.0)
            .map(|r| r.blocks[0])
            .collect();
        assert_ne!(first[0], first[1]);
        let sub = t
            .requests
            .iter()
            .find(|r| r.time_s == 11.0 && r.session == Some(0))
            .expect("sub");
        assert_eq!(sub.blocks[0], first[0]);
        assert_eq!(t.requests[0].block_tokens, vec![64, 64]);
    }

    #[test]
    fn malformed_sessions_name_the_place() {
        let dir = tempfile::tempdir().expect("dir");
        let p = dir.path().join("s.json");
        std::fs::write(&p, "{\"requests\": [\n{\"t\": 0, \"in\": 5, \"out\": 1, \"hash_ids\": [1]},\n{\"t\": 1, \"in\": -3, \"out\": 1, \"hash_ids\": []}]}").expect("write");
        let e = read(&p, ReadOptions::default())
            .expect_err("negative in")
            .to_string();
        assert!(e.contains("requests[1].in"), "{e}");
        std::fs::write(&p, "{\"requests\": [\n{\"t\": 0,,}]}").expect("write");
        let e = read(&p, ReadOptions::default())
            .expect_err("bad json")
            .to_string();
        assert!(e.contains("s.json:2: not JSON"), "{e}");
    }
}
