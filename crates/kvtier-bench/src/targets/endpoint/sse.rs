//! A reader of server-sent events: yields each event's `data` payload (its
//! `data:` lines joined by newlines), skipping comments and other fields.

use std::io::{self, BufRead};

/// Reads events from an SSE byte stream.
pub(super) struct SseReader<R> {
    inner: R,
    line: Vec<u8>,
}

impl<R: BufRead> SseReader<R> {
    /// Reads from `inner`.
    pub(super) fn new(inner: R) -> Self {
        Self {
            inner,
            line: Vec::new(),
        }
    }

    /// The next event's data; `None` at the end of the stream. An event cut
    /// short by the end of the stream (no blank line after it) is still
    /// returned: whether the stream was complete is the caller's call.
    pub(super) fn next_event(&mut self) -> io::Result<Option<String>> {
        let mut data: Option<String> = None;
        loop {
            self.line.clear();
            if self.inner.read_until(b'\n', &mut self.line)? == 0 {
                return Ok(data);
            }
            let text = String::from_utf8_lossy(&self.line);
            let line = text.trim_end_matches(['\n', '\r']);
            if line.is_empty() {
                if data.is_some() {
                    return Ok(data);
                }
                continue;
            }
            if line.starts_with(':') {
                continue;
            }
            let (field, value) = match line.split_once(':') {
                Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
                None => (line, ""),
            };
            if field == "data" {
                match &mut data {
                    Some(d) => {
                        d.push('\n');
                        d.push_str(value);
                    }
                    None => data = Some(value.to_string()),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(raw: &str) -> Vec<String> {
        let mut r = SseReader::new(raw.as_bytes());
        let mut out = Vec::new();
        while let Some(e) = r.next_event().unwrap() {
            out.push(e);
        }
        out
    }

    #[test]
    fn splits_events_joins_data_lines_and_skips_the_rest() {
        let raw = ": keep-alive\r\n\r\nevent: x\r\ndata: {\"a\":1}\r\n\r\ndata: one\ndata:two\n\n\n\ndata: [DONE]\n\n";
        assert_eq!(events(raw), vec!["{\"a\":1}", "one\ntwo", "[DONE]"]);
    }

    #[test]
    fn an_unterminated_last_event_is_returned() {
        assert_eq!(events("data: a\n\ndata: b"), vec!["a", "b"]);
        assert!(events("").is_empty());
    }
}
