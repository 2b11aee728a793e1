//! The shape of a `kvtier serve` instance's cache, as the server states it
//! on `/metrics` ([`KV_CACHE_INFO`]).

use std::collections::HashMap;

use kvtier_store::eviction::EvictionKind;

/// The series `kvtier serve` renders on `/metrics` with its cache's shape
/// in its labels.
pub const KV_CACHE_INFO: &str = "kvtier_server_kv_cache_info";

/// What a `kvtier serve` instance's cache is: everything
/// [`ServerSim`](super::ServerSim) needs. [`from_metrics`](Self::from_metrics)
/// reads it from the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerShape {
    /// Tokens per G1 page and per store block.
    pub block_tokens: usize,
    /// G1 pages.
    pub g1_pages: usize,
    /// G2's capacity in bytes.
    pub g2_bytes: u64,
    /// G3's usable capacity in bytes.
    pub g3_bytes: u64,
    /// Bytes a stored block takes in G2, whatever its rows: the store keeps
    /// each block, a prompt tail's short one too, in a buffer of one G3
    /// slot.
    pub block_bytes: u64,
    /// G3's slots, one block each (0: no G3).
    pub g3_slots: u64,
    /// Bytes of one G3 slot.
    pub g3_slot_bytes: u64,
    /// G2's and G3's eviction policy.
    pub eviction: EvictionKind,
    /// The G3 admission filter's window (`None`: off).
    pub admission_window: Option<usize>,
    /// Cached KV is reused at all.
    pub prefix_reuse: bool,
    /// Prefixes are restored layer by layer (their G1 pages are taken
    /// before the store is read, so G1 reclaims earlier).
    pub layerwise_restore: bool,
    /// A store (G2, G3) sits below G1.
    pub store: bool,
    /// How often G2's blocks are copied to G3, in ms (0: never on a timer).
    pub g3_sync_ms: u64,
    /// Bytes the write-back queue takes before it drops blocks.
    pub writeback_max_bytes: u64,
    /// A G4 pool is attached.
    pub g4: bool,
}

impl ServerShape {
    /// The shape a server states in the labels of its
    /// [`KV_CACHE_INFO`] series, from the Prometheus (or OpenMetrics) text
    /// of its `GET /metrics`.
    pub fn from_metrics(text: &str) -> Result<Self, String> {
        let labels = info_labels(text)?;
        let get = |name: &str| {
            labels
                .get(name)
                .map(String::as_str)
                .ok_or_else(|| format!("{KV_CACHE_INFO} has no `{name}` label"))
        };
        let num = |name: &str| -> Result<u64, String> {
            let v = get(name)?;
            v.parse()
                .map_err(|_| format!("{KV_CACHE_INFO}: `{name}` is {v:?}, not a count"))
        };
        let size = |name: &str| -> Result<usize, String> {
            usize::try_from(num(name)?)
                .map_err(|_| format!("{KV_CACHE_INFO}: `{name}` does not fit this machine"))
        };
        let flag = |name: &str| match get(name)? {
            "true" => Ok(true),
            "false" => Ok(false),
            v => Err(format!(
                "{KV_CACHE_INFO}: `{name}` is {v:?}, not true or false"
            )),
        };
        Ok(Self {
            block_tokens: size("block_tokens")?,
            g1_pages: size("g1_pages")?,
            g2_bytes: num("g2_bytes")?,
            g3_bytes: num("g3_bytes")?,
            block_bytes: num("block_bytes")?,
            g3_slots: num("g3_slots")?,
            g3_slot_bytes: num("g3_slot_bytes")?,
            eviction: get("eviction")?
                .parse()
                .map_err(|e| format!("{KV_CACHE_INFO}: {e}"))?,
            admission_window: match get("admission")? {
                "off" => None,
                "second-sighting" => Some(size("admission_window")?),
                v => {
                    return Err(format!(
                        "{KV_CACHE_INFO}: admission {v:?} is not one this simulator knows"
                    ));
                }
            },
            prefix_reuse: flag("prefix_reuse")?,
            layerwise_restore: flag("layerwise_restore")?,
            store: flag("store")?,
            g3_sync_ms: num("g3_sync_ms")?,
            writeback_max_bytes: num("writeback_max_bytes")?,
            g4: get("g4")? != "none",
        })
    }
}

/// The labels of the one [`KV_CACHE_INFO`] series in `text`.
fn info_labels(text: &str) -> Result<HashMap<String, String>, String> {
    let mut found = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(KV_CACHE_INFO) else {
            continue;
        };
        let Some(rest) = rest.strip_prefix('{') else {
            continue;
        };
        if found.is_some() {
            return Err(format!("{KV_CACHE_INFO} appears more than once"));
        }
        found = Some(parse_labels(rest)?);
    }
    found.ok_or_else(|| {
        format!("no {KV_CACHE_INFO} series: the server predates it, or this is not its /metrics")
    })
}

/// `name="value",...}` (the text after a series' `{`) as a map, with the
/// exposition format's escapes (`\\`, `\"`, `\n`) undone.
pub(super) fn parse_labels(s: &str) -> Result<HashMap<String, String>, String> {
    let bad = || format!("{KV_CACHE_INFO}: malformed labels in {s:?}");
    let mut out = HashMap::new();
    let mut chars = s.chars();
    loop {
        let mut name = String::new();
        loop {
            match chars.next().ok_or_else(bad)? {
                '=' => break,
                '}' if name.is_empty() => return Ok(out),
                ',' if name.is_empty() => {}
                c if c.is_ascii_alphanumeric() || c == '_' => name.push(c),
                _ => return Err(bad()),
            }
        }
        if chars.next() != Some('"') {
            return Err(bad());
        }
        let mut value = String::new();
        loop {
            match chars.next().ok_or_else(bad)? {
                '"' => break,
                '\\' => match chars.next().ok_or_else(bad)? {
                    'n' => value.push('\n'),
                    c => value.push(c),
                },
                c => value.push(c),
            }
        }
        out.insert(name, value);
    }
}
