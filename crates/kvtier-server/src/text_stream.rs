//! From generated token ids to text, piece by piece: incremental decoding
//! that never splits a UTF-8 character, and stop strings matched on the
//! decoded text.

use std::sync::Arc;

use kvtier_engine::EngineError;
use kvtier_engine::text::tokenizer::TextTokenizer;

/// Turns a stream of token ids into a stream of text pieces.
///
/// Decodes a small window of recent tokens (so tokenizers whose decoding
/// depends on context, like SentencePiece's leading space, stay right) and
/// emits the new text only once it does not end in a replacement character,
/// i.e. once a multi-byte character is complete.
#[derive(Debug)]
pub struct Detokenizer {
    tok: Arc<TextTokenizer>,
    ids: Vec<u32>,
    /// Start of the window decoded for context.
    prefix: usize,
    /// End of the tokens whose text was emitted.
    read: usize,
}

/// Prompt tokens a [`Detokenizer`] keeps as context (as vLLM's
/// incremental detokenizer does).
pub const CONTEXT_TOKENS: usize = 6;

impl Detokenizer {
    /// A detokenizer with no tokens yet.
    pub fn new(tok: Arc<TextTokenizer>) -> Self {
        Self::after(tok, &[])
    }

    /// A detokenizer whose text continues `prompt`: its last
    /// [`CONTEXT_TOKENS`] are decoded with the generated ones and their text
    /// left out, so a generated token reads as it does after the prompt
    /// (SentencePiece drops the space of a sequence's first word, but not
    /// of a word that follows the prompt's).
    pub fn after(tok: Arc<TextTokenizer>, prompt: &[u32]) -> Self {
        let context = &prompt[prompt.len().saturating_sub(CONTEXT_TOKENS)..];
        Self {
            tok,
            ids: context.to_vec(),
            prefix: 0,
            read: context.len(),
        }
    }

    /// Adds one token; returns the text that became final (maybe empty).
    pub fn push(&mut self, id: u32) -> Result<String, EngineError> {
        self.ids.push(id);
        let before = self.tok.decode(&self.ids[self.prefix..self.read])?;
        let now = self.tok.decode(&self.ids[self.prefix..])?;
        if now.len() > before.len() && !now.ends_with('\u{FFFD}') {
            let delta = new_suffix(&before, &now);
            self.prefix = self.read;
            self.read = self.ids.len();
            return Ok(delta);
        }
        Ok(String::new())
    }

    /// The text still held back (an incomplete character at the end),
    /// emitted as is when generation ends.
    pub fn flush(&mut self) -> Result<String, EngineError> {
        let before = self.tok.decode(&self.ids[self.prefix..self.read])?;
        let now = self.tok.decode(&self.ids[self.prefix..])?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        Ok(new_suffix(&before, &now))
    }
}

/// The part of `now` after `before`; when `now` does not start with
/// `before` (a tokenizer whose text changed retroactively), the part after
/// the same byte length, moved forward to a character boundary.
fn new_suffix(before: &str, now: &str) -> String {
    if let Some(rest) = now.strip_prefix(before) {
        return rest.to_string();
    }
    let mut at = before.len().min(now.len());
    while !now.is_char_boundary(at) {
        at += 1;
    }
    now.get(at..).unwrap_or_default().to_string()
}

/// What [`StopMatcher::push`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopOutcome {
    /// Text safe to emit (it cannot be part of a stop string).
    Emit(String),
    /// A stop string matched: the text before it; generation must end.
    Stopped(String),
}

/// Matches stop strings on decoded text, holding back any tail that could
/// still become one.
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored).
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
        }
    }

    /// Adds text; returns what can be emitted now, or the text before a
    /// stop string that matched.
    pub fn push(&mut self, text: &str) -> StopOutcome {
        self.held.push_str(text);
        if self.stops.is_empty() {
            return StopOutcome::Emit(std::mem::take(&mut self.held));
        }
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(at) = first {
            let out = self.held.get(..at).unwrap_or_default().to_string();
            self.held.clear();
            return StopOutcome::Stopped(out);
        }
        let hold = self
            .stops
            .iter()
            .map(|s| partial_match(&self.held, s))
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - hold;
        let rest = self.held.split_off(cut);
        StopOutcome::Emit(std::mem::replace(&mut self.held, rest))
    }

    /// The held-back text, released when generation ends without a match.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// Length of the longest proper prefix of `stop` that `text` ends with.
fn partial_match(text: &str, stop: &str) -> usize {
    let mut k = stop.len().saturating_sub(1).min(text.len());
    while k > 0 {
        if stop.is_char_boundary(k) && text.ends_with(&stop[..k]) {
            return k;
        }
        k -= 1;
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> (tempfile::TempDir, Arc<TextTokenizer>) {
        let dir = tempfile::tempdir().expect("tempdir");
        kvtier_engine::model_dir::preset::build_tokenizer()
            .expect("tokenizer")
            .save(dir.path().join("tokenizer.json"), false)
            .expect("save");
        let tok = TextTokenizer::from_dir(dir.path()).expect("load");
        (dir, Arc::new(tok))
    }

    #[test]
    fn detokenizer_never_splits_a_character() {
        let (_d, tok) = tokenizer();
        let text = "aé€😀b";
        let ids = tok.encode(text).expect("encode");
        let mut d = Detokenizer::new(tok);
        let mut out = String::new();
        for id in ids {
            let piece = d.push(id).expect("push");
            assert!(!piece.contains('\u{FFFD}'), "{piece:?}");
            out.push_str(&piece);
        }
        out.push_str(&d.flush().expect("flush"));
        assert_eq!(out, text);
    }

    #[test]
    fn text_after_a_prompt_leaves_the_prompt_out() {
        let (_d, tok) = tokenizer();
        let prompt = tok.encode("The prompt ").expect("encode");
        let gen_ = tok.encode("and more").expect("encode");
        let mut d = Detokenizer::after(tok, &prompt);
        let mut out = String::new();
        for id in gen_ {
            out.push_str(&d.push(id).expect("push"));
        }
        out.push_str(&d.flush().expect("flush"));
        assert_eq!(out, "and more");
    }

    #[test]
    fn detokenizer_flushes_invalid_bytes_as_replacement() {
        let (_d, tok) = tokenizer();
        let mut d = Detokenizer::new(tok);
        let mut out = String::new();
        // 'A', a lone UTF-8 lead byte, 'B', another lone lead byte at the end.
        for id in [b'A', 0xC3, b'B', 0xE2].map(u32::from) {
            out.push_str(&d.push(id).expect("push"));
        }
        assert_eq!(out, "A\u{FFFD}B");
        out.push_str(&d.flush().expect("flush"));
        assert_eq!(out, "A\u{FFFD}B\u{FFFD}");
    }

    #[test]
    fn stop_strings_truncate_and_hold_back_prefixes() {
        let mut m = StopMatcher::new(vec!["END".into(), "".into()]);
        assert_eq!(m.push("hello E"), StopOutcome::Emit("hello ".into()));
        assert_eq!(m.push("N"), StopOutcome::Emit(String::new()));
        assert_eq!(m.push("x"), StopOutcome::Emit("ENx".into()));
        assert_eq!(m.push(" and EN"), StopOutcome::Emit(" and ".into()));
        assert_eq!(m.push("D more"), StopOutcome::Stopped(String::new()));

        let mut m = StopMatcher::new(vec!["abcd".into(), "bc".into()]);
        assert_eq!(m.push("xab"), StopOutcome::Emit("x".into()));
        // The earliest match wins.
        assert_eq!(m.push("cd"), StopOutcome::Stopped(String::new()));
        let mut m = StopMatcher::new(vec!["abcd".into(), "bc".into()]);
        assert_eq!(m.push("xabce"), StopOutcome::Stopped("xa".into()));

        let mut m = StopMatcher::new(vec!["é!".into()]);
        assert_eq!(m.push("café"), StopOutcome::Emit("caf".into()));
        assert_eq!(m.finish(), "é");

        let mut m = StopMatcher::new(vec![]);
        assert_eq!(m.push("anything"), StopOutcome::Emit("anything".into()));
    }
}
