//! The common event stream every trace format is read into, and [`read`].

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::str::FromStr;

use crate::TraceError;
use crate::format::{generic, mooncake, ragpulse, tester};

/// One request of a trace.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// Arrival, in seconds from the trace's start.
    pub time_s: f64,
    /// The session (conversation, agent run) it belongs to, when the trace
    /// says.
    pub session: Option<u64>,
    /// The prompt's blocks, head first. Ids are unique within the trace:
    /// equal ids are the same KV. A trace whose ids are not chained (equal
    /// ids after different prefixes) is still read right: the simulator
    /// keys a block by its whole prefix.
    pub blocks: Vec<u64>,
    /// Tokens in each block (the last one may be partial).
    pub block_tokens: Vec<u32>,
    /// Prompt tokens (may exceed the blocks' sum when the trace names only
    /// full blocks).
    pub input_tokens: u64,
    /// Generated tokens.
    pub output_tokens: u64,
}

/// A whole trace, requests in arrival order.
#[derive(Debug, Clone)]
pub struct Trace {
    /// Where it came from (a file or folder name).
    pub name: String,
    /// The format it was read as.
    pub format: Format,
    /// Tokens per full block.
    pub block_size: u32,
    /// The requests, in arrival order (ties keep file order).
    pub requests: Vec<Request>,
}

/// The trace formats kvtier reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Mooncake JSONL (`timestamp` ms, `input_length`, `output_length`,
    /// `hash_ids`), the format LMCache's and vLLM's trace tools read.
    Mooncake,
    /// kv-cache-tester session JSON: one file per session, or a folder of
    /// them.
    Tester,
    /// RAGPulse: `0_trace.jsonl` beside its chunk-length files.
    Ragpulse,
    /// kvtier's generic JSONL (docs/guides/traces.md).
    Generic,
}

impl Format {
    /// Every format, as `--format` spells them.
    pub const ALL: [Format; 4] = [Self::Mooncake, Self::Tester, Self::Ragpulse, Self::Generic];

    /// The format's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Mooncake => "mooncake",
            Self::Tester => "tester",
            Self::Ragpulse => "ragpulse",
            Self::Generic => "generic",
        }
    }

    /// Guesses the format of `path`: a folder of `.json` files is
    /// kv-cache-tester sessions, a folder or file named `0_trace.jsonl` is
    /// RAGPulse, a `.json` file a tester session; otherwise the first line
    /// decides (`hash_ids` as a list: Mooncake, as an object: RAGPulse,
    /// `blocks`: generic).
    pub fn detect(path: &Path) -> Result<Format, TraceError> {
        let meta = std::fs::metadata(path).map_err(|e| TraceError::io(path, e))?;
        if meta.is_dir() {
            if path.join(ragpulse::TRACE_FILE).is_file() {
                return Ok(Self::Ragpulse);
            }
            return Ok(Self::Tester);
        }
        if path.file_name().is_some_and(|n| n == ragpulse::TRACE_FILE) {
            return Ok(Self::Ragpulse);
        }
        if path.extension().is_some_and(|e| e == "json") {
            return Ok(Self::Tester);
        }
        let mut first = None;
        for_each_line(path, |_, line| {
            if first.is_none() {
                first = Some(line.to_owned());
            }
            Ok(())
        })?;
        let first = first.ok_or_else(|| TraceError::trace(path, "empty trace"))?;
        let v: serde_json::Value = serde_json::from_str(&first)
            .map_err(|e| TraceError::line(path, 1, format!("not JSON: {e}")))?;
        match (v.get("hash_ids"), v.get("blocks")) {
            (Some(serde_json::Value::Array(_)), _) => Ok(Self::Mooncake),
            (Some(serde_json::Value::Object(_)), _) => Ok(Self::Ragpulse),
            (None, Some(_)) => Ok(Self::Generic),
            _ => Err(TraceError::trace(
                path,
                "cannot tell the format from the first line (no hash_ids or blocks); give --format",
            )),
        }
    }
}

impl FromStr for Format {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|f| f.as_str() == s)
            .ok_or_else(|| {
                format!(
                    "unknown trace format {s:?}: expected mooncake, tester, ragpulse or generic"
                )
            })
    }
}

/// Options every reader takes.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReadOptions {
    /// Tokens per block, overriding the format's (Mooncake 512, tester the
    /// file's, RAGPulse 512, generic the lines').
    pub block_size: Option<u32>,
}

/// Reads a trace; `format` `None` guesses it ([`Format::detect`]).
pub fn read(
    path: &Path,
    format: Option<Format>,
    options: ReadOptions,
) -> Result<Trace, TraceError> {
    let format = match format {
        Some(f) => f,
        None => Format::detect(path)?,
    };
    let mut trace = match format {
        Format::Mooncake => mooncake::read(path, options)?,
        Format::Tester => tester::read(path, options)?,
        Format::Ragpulse => ragpulse::read(path, options)?,
        Format::Generic => generic::read(path, options)?,
    };
    if trace.requests.is_empty() {
        return Err(TraceError::trace(path, "the trace has no requests"));
    }
    trace.requests.sort_by(|a, b| a.time_s.total_cmp(&b.time_s));
    Ok(trace)
}

/// The longest line a reader accepts: a longer one is an error, not an
/// allocation the size of the file.
pub const MAX_LINE_BYTES: u64 = 64 << 20;

/// Opens a regular file (not a FIFO, device or folder).
pub(crate) fn open_regular(path: &Path) -> Result<File, TraceError> {
    let meta = std::fs::metadata(path).map_err(|e| TraceError::io(path, e))?;
    if !meta.is_file() {
        return Err(TraceError::trace(path, "not a regular file"));
    }
    File::open(path).map_err(|e| TraceError::io(path, e))
}

/// Calls `f(line_number, line)` for every non-blank line of a text file
/// (1-based numbers), stopping at the first error.
pub(crate) fn for_each_line(
    path: &Path,
    mut f: impl FnMut(usize, &str) -> Result<(), TraceError>,
) -> Result<(), TraceError> {
    let mut reader = BufReader::new(open_regular(path)?);
    let mut buf = Vec::new();
    let mut number = 0;
    loop {
        buf.clear();
        number += 1;
        let n = (&mut reader)
            .take(MAX_LINE_BYTES + 1)
            .read_until(b'\n', &mut buf)
            .map_err(|e| TraceError::io(path, e))?;
        if n == 0 {
            return Ok(());
        }
        if n as u64 > MAX_LINE_BYTES {
            return Err(TraceError::line(
                path,
                number,
                format!("line longer than {MAX_LINE_BYTES} bytes"),
            ));
        }
        let line = std::str::from_utf8(&buf)
            .map_err(|_| TraceError::line(path, number, "not UTF-8"))?
            .trim();
        if !line.is_empty() {
            f(number, line)?;
        }
    }
}

/// [`for_each_line`] for JSONL: `f(line_number, value)` for every line,
/// a line that is not JSON an error naming it.
pub(crate) fn for_each_json_line(
    path: &Path,
    mut f: impl FnMut(usize, serde_json::Value) -> Result<(), TraceError>,
) -> Result<(), TraceError> {
    for_each_line(path, |n, line| {
        let v = serde_json::from_str(line)
            .map_err(|e| TraceError::line(path, n, format!("not JSON: {e}")))?;
        f(n, v)
    })
}

/// Tokens in block `index` of a prompt of `input` tokens cut in blocks of
/// `block_size`: full blocks, then what is left (at least 1).
pub fn block_tokens(input: u64, block_size: u32, index: usize) -> u32 {
    let before = index as u64 * u64::from(block_size);
    input.saturating_sub(before).clamp(1, u64::from(block_size)) as u32
}

/// Maps a trace's own block ids (strings or numbers, within a namespace
/// such as a session) to ids unique in the trace.
#[derive(Debug, Default)]
pub(crate) struct Ids {
    ids: HashMap<(u64, String), u64>,
}

impl Ids {
    /// The trace-wide id of `raw` in `namespace`.
    pub(crate) fn id(&mut self, namespace: u64, raw: String) -> u64 {
        let next = self.ids.len() as u64;
        *self.ids.entry((namespace, raw)).or_insert(next)
    }
}

/// A JSON block id (a non-negative integer or a string) as text.
pub(crate) fn raw_id(v: &serde_json::Value) -> Result<String, String> {
    match v {
        serde_json::Value::Number(n) if n.is_u64() || n.is_i64() => Ok(n.to_string()),
        serde_json::Value::String(s) => Ok(s.clone()),
        other => Err(format!(
            "a block id must be an integer or a string, not {other}"
        )),
    }
}

/// A non-negative integer field of a JSON object.
pub(crate) fn count(v: &serde_json::Value, field: &str) -> Result<u64, String> {
    match v.get(field) {
        Some(x) => x
            .as_u64()
            .or_else(|| {
                x.as_f64()
                    .filter(|f| *f >= 0.0 && f.fract() == 0.0)
                    .map(|f| f as u64)
            })
            .ok_or_else(|| format!("{field} must be a non-negative integer, not {x}")),
        None => Err(format!("missing {field}")),
    }
}

/// A finite, non-negative number field (a number or a numeric string).
pub(crate) fn seconds(v: &serde_json::Value, field: &str) -> Result<f64, String> {
    let x = v.get(field).ok_or_else(|| format!("missing {field}"))?;
    let f = match x {
        serde_json::Value::Number(n) => n.as_f64(),
        serde_json::Value::String(s) => s.trim().parse::<f64>().ok(),
        _ => None,
    };
    f.filter(|f| f.is_finite() && *f >= 0.0)
        .ok_or_else(|| format!("{field} must be a non-negative number, not {x}"))
}
