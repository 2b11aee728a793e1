//! Chat templates: a model's own Jinja template rendered as `transformers`'
//! `apply_chat_template` renders it, with minijinja.
//!
//! Where the template comes from, first found wins (as in `transformers`
//! and vLLM):
//!
//! 1. a file given by the operator (`kvtier serve --chat-template FILE`);
//! 2. `chat_template.jinja` in the model directory (what newer
//!    `transformers` writes);
//! 3. `chat_template` in `tokenizer_config.json` (a string, or the entry
//!    named "default" of a list);
//! 4. none: the documented default, ChatML
//!    (`<|im_start|>role\ncontent<|im_end|>\n`, then
//!    `<|im_start|>assistant\n`), with a warning in the log and in
//!    `/v1/models`. (`transformers` and vLLM refuse to chat with such a
//!    model; kvtier's embedded presets were built for ChatML, so it stays
//!    their fallback, said out loud.)
//!
//! The environment matches the one `transformers` builds: `trim_blocks`
//! and `lstrip_blocks` on, loop controls (`break`/`continue`), Python
//! string and dict methods (`.strip()`, `.startswith()`, `.items()`, ...,
//! from minijinja-contrib's pycompat), `raise_exception(msg)` (an error the
//! client sees), `strftime_now(fmt)` (Llama 3.1's date line), and a
//! `tojson` that writes JSON as Python's `json.dumps` does (`", "` and
//! `": "` separators, non-ASCII kept). The variables are `messages`,
//! `add_generation_prompt`, the special token strings of
//! `tokenizer_config.json` (`bos_token`, `eos_token`, `unk_token`,
//! `pad_token`), and the request's `chat_template_kwargs` (vLLM's
//! extension, e.g. `enable_thinking`).

use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, Serde, Value as JValue, ValueKind};
use minijinja::{Environment, Error as JError, ErrorKind};
use serde_json::{Map, Value};

use crate::engine_error::EngineError;
use crate::model_dir::model_files::read_bounded_text;
use crate::text::tokenizer::{ChatMessage, TokenizerConfig};

/// Most bytes of a chat template file read.
pub const TEMPLATE_MAX_BYTES: u64 = 4 << 20;

/// The template used when a model has none: ChatML.
pub const DEFAULT_TEMPLATE: &str = "{% for message in messages %}\
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Where a chat template came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TemplateOrigin {
    /// A file the operator named.
    File(PathBuf),
    /// `chat_template.jinja` of the model directory.
    ModelJinja(PathBuf),
    /// `chat_template` of `tokenizer_config.json`.
    TokenizerConfig(PathBuf),
    /// None found: [`DEFAULT_TEMPLATE`].
    Default,
}

impl std::fmt::Display for TemplateOrigin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TemplateOrigin::File(p) => write!(f, "{}", p.display()),
            TemplateOrigin::ModelJinja(p) => write!(f, "{}", p.display()),
            TemplateOrigin::TokenizerConfig(p) => write!(f, "chat_template of {}", p.display()),
            TemplateOrigin::Default => f.write_str("the default ChatML template"),
        }
    }
}

/// Why a chat prompt could not be rendered (the client's messages, or a
/// `raise_exception` of the template): the message says which.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct RenderError(pub String);

/// A compiled chat template with its variables.
pub struct ChatTemplate {
    env: Environment<'static>,
    origin: TemplateOrigin,
    specials: Map<String, Value>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .finish()
    }
}

impl ChatTemplate {
    /// Finds the template of the model in `dir` (`file`, when given, wins;
    /// see the module docs) and compiles it. A template that does not
    /// compile is an error naming its file.
    pub fn load(
        dir: &Path,
        file: Option<&Path>,
        config: &TokenizerConfig,
    ) -> Result<Self, EngineError> {
        let jinja = dir.join("chat_template.jinja");
        let (source, origin) = if let Some(f) = file {
            (
                read_bounded_text(f, TEMPLATE_MAX_BYTES)?,
                TemplateOrigin::File(f.to_path_buf()),
            )
        } else if jinja.exists() {
            (
                read_bounded_text(&jinja, TEMPLATE_MAX_BYTES)?,
                TemplateOrigin::ModelJinja(jinja),
            )
        } else if let (Some(t), Some(p)) = (&config.chat_template, &config.path) {
            (t.clone(), TemplateOrigin::TokenizerConfig(p.clone()))
        } else {
            (DEFAULT_TEMPLATE.to_string(), TemplateOrigin::Default)
        };
        Self::compile(source, origin, config)
    }

    /// Compiles `source`.
    pub fn compile(
        source: String,
        origin: TemplateOrigin,
        config: &TokenizerConfig,
    ) -> Result<Self, EngineError> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| template_error(&origin, &e))?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned("chat", source)
            .map_err(|e| template_error(&origin, &e))?;
        let mut specials = Map::new();
        for (name, v) in [
            ("bos_token", &config.bos_token),
            ("eos_token", &config.eos_token),
            ("unk_token", &config.unk_token),
            ("pad_token", &config.pad_token),
        ] {
            if let Some(v) = v {
                specials.insert(name.into(), Value::String(v.clone()));
            }
        }
        Ok(Self {
            env,
            origin,
            specials,
        })
    }

    /// Where the template came from.
    pub fn origin(&self) -> &TemplateOrigin {
        &self.origin
    }

    /// The warning to show when the model has no template of its own.
    pub fn warning(&self) -> Option<String> {
        (self.origin == TemplateOrigin::Default).then(|| {
            "the model has no chat template (no chat_template.jinja, none in \
             tokenizer_config.json): chat prompts use the default ChatML template; \
             give the right one with --chat-template FILE"
                .to_string()
        })
    }

    /// Renders `messages`, ending with the assistant's turn when
    /// `add_generation_prompt`. `kwargs` (vLLM's `chat_template_kwargs`)
    /// are further template variables.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: Option<&Map<String, Value>>,
    ) -> Result<String, RenderError> {
        // Built as minijinja values (insertion-ordered maps), so `tojson`
        // writes a message's keys in the order Python's dicts keep them.
        let mut ctx: Vec<(String, JValue)> = self
            .specials
            .iter()
            .map(|(k, v)| (k.clone(), JValue::from(Serde(v))))
            .collect();
        if let Some(kw) = kwargs {
            ctx.extend(kw.iter().map(|(k, v)| (k.clone(), JValue::from(Serde(v)))));
        }
        let msgs: Vec<JValue> = messages
            .iter()
            .map(|m| {
                JValue::from_pairs([
                    ("role", JValue::from(m.role.as_str())),
                    ("content", JValue::from(m.content.as_str())),
                ])
            })
            .collect();
        ctx.push(("messages".into(), JValue::from(msgs)));
        ctx.push((
            "add_generation_prompt".into(),
            JValue::from(add_generation_prompt),
        ));
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| RenderError(describe(&e)))?;
        tmpl.render(JValue::from_pairs(ctx))
            .map_err(|e| RenderError(describe(&e)))
    }
}

fn template_error(origin: &TemplateOrigin, e: &JError) -> EngineError {
    EngineError::ChatTemplate {
        origin: origin.to_string(),
        msg: describe(e),
    }
}

/// The error's text with its causes (minijinja keeps the cause apart);
/// a `raise_exception` is its message alone.
fn describe(e: &JError) -> String {
    if let Some(msg) = e.detail().and_then(|d| d.strip_prefix(RAISED)) {
        return msg.to_string();
    }
    let mut s = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}

/// Marks the detail of an error `raise_exception` made.
const RAISED: &str = "template raised: ";

fn raise_exception(msg: String) -> Result<JValue, JError> {
    Err(JError::new(
        ErrorKind::InvalidOperation,
        format!("{RAISED}{msg}"),
    ))
}

fn strftime_now(format: String) -> Result<JValue, JError> {
    use std::fmt::Write;
    let mut out = String::new();
    write!(out, "{}", chrono::Local::now().format(&format)).map_err(|_| {
        JError::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: bad format {format:?}"),
        )
    })?;
    Ok(JValue::from(out))
}

/// `tojson` as `transformers` defines it: `json.dumps(x, ensure_ascii=False,
/// indent=indent, sort_keys=sort_keys)`.
fn tojson(value: JValue, kwargs: Kwargs) -> Result<JValue, JError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    python_json(&value, indent, sort_keys.unwrap_or(false), 0, &mut out)?;
    Ok(JValue::from_safe_string(out))
}

/// Writes `v` as Python's `json.dumps` does with `ensure_ascii=False`:
/// `", "` and `": "` between items, or one item per line at `indent`; maps
/// in their own order unless `sort`.
fn python_json(
    v: &JValue,
    indent: Option<usize>,
    sort: bool,
    depth: usize,
    out: &mut String,
) -> Result<(), JError> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    let string = |s: &str| Value::String(s.to_string()).to_string();
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => match v.as_i64() {
            Some(i) if v.is_integer() => out.push_str(&i.to_string()),
            _ => {
                let f = f64::try_from(v.clone())?;
                // Python writes floats with a fraction or an exponent.
                let text = Value::from(f).to_string();
                out.push_str(&text);
                if f.is_finite() && f.fract() == 0.0 && !text.contains(['.', 'e', 'E']) {
                    out.push_str(".0");
                }
            }
        },
        ValueKind::String => out.push_str(&string(v.as_str().unwrap_or_default())),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<JValue> = v.try_iter()?.collect();
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                python_json(item, indent, sort, depth + 1, out)?;
            }
            if !items.is_empty() {
                newline(out, depth);
            }
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<JValue> = v.try_iter()?.collect();
            if sort {
                keys.sort();
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                out.push_str(&string(&k.to_string()));
                out.push_str(": ");
                python_json(&v.get_item(k)?, indent, sort, depth + 1, out)?;
            }
            if !keys.is_empty() {
                newline(out, depth);
            }
            out.push('}');
        }
        _ => out.push_str(&string(&v.to_string())),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }

    fn config() -> TokenizerConfig {
        TokenizerConfig {
            bos_token: Some("<|begin_of_text|>".into()),
            eos_token: Some("<|eot_id|>".into()),
            ..Default::default()
        }
    }

    #[test]
    fn the_default_is_chatml_and_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let t = ChatTemplate::load(dir.path(), None, &TokenizerConfig::default()).unwrap();
        assert_eq!(t.origin(), &TemplateOrigin::Default);
        assert!(t.warning().unwrap().contains("--chat-template"));
        let out = t
            .render(&[msg("system", "S"), msg("user", "hi")], true, None)
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
        let out = t.render(&[msg("user", "hi")], false, None).unwrap();
        assert_eq!(out, "<|im_start|>user\nhi<|im_end|>\n");
    }

    /// The shape of Llama 3's template (its header lines, `bos_token`, a
    /// `trim` and a loop index), rendered as transformers does.
    #[test]
    fn a_llama3_style_template_renders_with_its_specials_and_python_methods() {
        let src = "{% set loop_messages = messages %}{% for message in loop_messages %}\
{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}\
{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}\
{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";
        let t = ChatTemplate::compile(src.into(), TemplateOrigin::Default, &config()).unwrap();
        let out = t.render(&[msg("user", " hi \n")], true, None).unwrap();
        assert_eq!(
            out,
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );
        // trim_blocks / lstrip_blocks: block tags on their own lines leave
        // no blank lines; Python string methods work.
        let src = "{% for m in messages %}\n  {% if m.content.startswith('x') %}\n{{ m.content.upper() }}\n  {% endif %}\n{% endfor %}";
        let t = ChatTemplate::compile(src.into(), TemplateOrigin::Default, &config()).unwrap();
        assert_eq!(
            t.render(&[msg("user", "xa"), msg("user", "b")], false, None)
                .unwrap(),
            "XA\n"
        );
    }

    #[test]
    fn raise_exception_and_kwargs_reach_the_caller() {
        let src = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}\
{% if enable_thinking is defined and not enable_thinking %}no-think {% endif %}{{ messages[0]['content'] }}";
        let t = ChatTemplate::compile(src.into(), TemplateOrigin::Default, &config()).unwrap();
        let e = t.render(&[msg("system", "s")], true, None).unwrap_err();
        assert_eq!(e.0, "Conversation must start with user");
        let mut kw = Map::new();
        kw.insert("enable_thinking".into(), Value::Bool(false));
        assert_eq!(
            t.render(&[msg("user", "q")], true, Some(&kw)).unwrap(),
            "no-think q"
        );
    }

    #[test]
    fn tojson_writes_as_python_does() {
        let src = "{{ messages | tojson }}|{{ {'b': 1, 'a': [1.5, 'é']} | tojson(indent=2) }}";
        let t = ChatTemplate::compile(src.into(), TemplateOrigin::Default, &config()).unwrap();
        let out = t.render(&[msg("user", "q\"<")], false, None).unwrap();
        assert_eq!(
            out,
            "[{\"role\": \"user\", \"content\": \"q\\\"<\"}]|{\n  \"b\": 1,\n  \"a\": [\n    1.5,\n    \"é\"\n  ]\n}"
        );
    }

    #[test]
    fn a_template_that_does_not_compile_names_its_file() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("bad.jinja");
        std::fs::write(&f, "{% for m in messages %}never closed").unwrap();
        let e = ChatTemplate::load(dir.path(), Some(&f), &TokenizerConfig::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("bad.jinja"), "{e}");
        // chat_template.jinja of the model directory wins over the config's.
        std::fs::write(
            dir.path().join("chat_template.jinja"),
            "J{{ messages|length }}",
        )
        .unwrap();
        let cfg = TokenizerConfig {
            chat_template: Some("C".into()),
            path: Some(dir.path().join("tokenizer_config.json")),
            ..Default::default()
        };
        let t = ChatTemplate::load(dir.path(), None, &cfg).unwrap();
        assert!(matches!(t.origin(), TemplateOrigin::ModelJinja(_)));
        assert_eq!(t.render(&[msg("user", "q")], false, None).unwrap(), "J1");
        std::fs::remove_file(dir.path().join("chat_template.jinja")).unwrap();
        let t = ChatTemplate::load(dir.path(), None, &cfg).unwrap();
        assert_eq!(t.render(&[msg("user", "q")], false, None).unwrap(), "C");
    }
}
