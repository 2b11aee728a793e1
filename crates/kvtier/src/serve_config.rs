//! `kvtier serve`'s settings from three places: flags, then `KVTIER_<KEY>`
//! environment variables, then a TOML file (`--config FILE`, or
//! `KVTIER_CONFIG`). Flags win over the environment, the environment over
//! the file, the file over the defaults.
//!
//! Every serve flag is a key: its long name in snake case (`cache_dir`,
//! `g2_bytes`; the kebab spelling is accepted too), and `KVTIER_` plus the
//! key in capitals (`KVTIER_CACHE_DIR`). Values are what the flag takes
//! (`g2_bytes = "8GiB"`, `port = 8000`); a switch (`no_prefix_reuse`) takes
//! `true` or `false`. An unknown key is an error naming the file, so a typo
//! never passes silently.
//!
//! How: the settings that the command line lacks are turned into flags put
//! in front of it, and clap parses the whole as usual, so every value gets
//! the same checks as a typed flag. [`print_default`] writes the whole file
//! with each flag's help as comments (`kvtier config --print-default`).

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::Path;

use anyhow::{Context, Result, bail};
use clap::{ArgAction, CommandFactory};

use crate::cli::Cli;

/// The flag naming the config file.
const CONFIG_FLAG: &str = "config";

/// A serve flag as a config key.
struct Key {
    /// The long flag (`cache-dir`).
    long: String,
    /// A switch (no value).
    switch: bool,
    /// Repeatable (`--api-key`): a file may give a list of strings.
    repeat: bool,
    help: String,
    default: Option<String>,
}

impl Key {
    /// The key in a file: snake case.
    fn name(&self) -> String {
        self.long.replace('-', "_")
    }

    /// Its environment variable.
    fn env(&self) -> String {
        format!("KVTIER_{}", self.name().to_uppercase())
    }
}

/// Every `kvtier serve` flag that takes part (not `--config` or `--help`).
fn serve_keys() -> Vec<Key> {
    let cmd = Cli::command();
    let Some(serve) = cmd.find_subcommand("serve") else {
        return Vec::new();
    };
    serve
        .get_arguments()
        .filter_map(|a| {
            let long = a.get_long()?.to_string();
            if long == CONFIG_FLAG || long == "help" || a.is_global_set() {
                return None;
            }
            let switch = matches!(a.get_action(), ArgAction::SetTrue);
            let repeat = matches!(a.get_action(), ArgAction::Append);
            Some(Key {
                long,
                switch,
                repeat,
                help: a
                    .get_long_help()
                    .or(a.get_help())
                    .map(|h| h.to_string())
                    .unwrap_or_default(),
                default: a
                    .get_default_values()
                    .first()
                    .map(|v| v.to_string_lossy().into_owned()),
            })
        })
        .collect()
}

/// True when `raw` (the words after `serve`) sets `--long` or one of its
/// aliases.
fn given(raw: &[OsString], long: &str, aliases: &[String]) -> bool {
    raw.iter().any(|w| {
        let w = w.to_string_lossy();
        let Some(name) = w.strip_prefix("--") else {
            return false;
        };
        let name = name.split_once('=').map_or(name, |(n, _)| n);
        name == long || aliases.iter().any(|a| a == name)
    })
}

/// The value of `--config` in `raw`, if any.
fn config_flag(raw: &[OsString]) -> Option<OsString> {
    let mut it = raw.iter();
    while let Some(w) = it.next() {
        let s = w.to_string_lossy();
        if s == "--config" {
            return it.next().cloned();
        }
        if let Some(v) = s.strip_prefix("--config=") {
            return Some(v.into());
        }
    }
    None
}

/// The file's keys as flag values (strings), checked against `keys`.
fn read_file(path: &Path, keys: &[Key]) -> Result<BTreeMap<String, Vec<String>>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the config file {}", path.display()))?;
    let table: toml::Table = text
        .parse()
        .with_context(|| format!("config file {} is not valid TOML", path.display()))?;
    let mut out = BTreeMap::new();
    for (k, v) in table {
        let name = k.replace('-', "_");
        let Some(key) = keys.iter().find(|key| key.name() == name) else {
            let known: Vec<String> = keys.iter().map(Key::name).collect();
            bail!(
                "config file {}: unknown key {k:?} (known: {})",
                path.display(),
                known.join(", ")
            );
        };
        let values = match v {
            toml::Value::String(s) => vec![s],
            toml::Value::Integer(i) => vec![i.to_string()],
            toml::Value::Float(f) => vec![f.to_string()],
            toml::Value::Boolean(b) if key.switch => vec![b.to_string()],
            toml::Value::Array(items) if key.repeat => items
                .into_iter()
                .map(|item| match item {
                    toml::Value::String(s) => Ok(s),
                    other => bail!(
                        "config file {}: key {k:?} takes strings, not {}",
                        path.display(),
                        other.type_str()
                    ),
                })
                .collect::<Result<_>>()?,
            other => bail!(
                "config file {}: key {k:?} takes {}, not {}",
                path.display(),
                if key.switch {
                    "true or false"
                } else if key.repeat {
                    "a string or a list of strings"
                } else {
                    "a string or a number"
                },
                other.type_str()
            ),
        };
        out.insert(name, values);
    }
    Ok(out)
}

/// True for a switch's "on" spellings.
fn switch_on(v: &str) -> Result<bool> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" | "" => Ok(false),
        other => bail!("{other:?} is not true or false"),
    }
}

/// `argv` with `serve`'s missing settings filled in from `env` (a lookup of
/// environment variables) and the config file, ahead of the command line.
/// Any other command comes back unchanged.
pub fn expand_args(
    argv: Vec<OsString>,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Vec<OsString>> {
    // The subcommand is the first word that is neither a global flag nor
    // its value (`kvtier --log info serve ...`).
    let mut at = 1;
    while at < argv.len() {
        let w = argv[at].to_string_lossy();
        if w == "--log" {
            at += 2;
        } else if w.starts_with('-') {
            at += 1;
        } else {
            break;
        }
    }
    if argv.get(at).is_none_or(|w| w != "serve") {
        return Ok(argv);
    }
    let raw = argv[at + 1..].to_vec();
    let keys = serve_keys();
    let file = match config_flag(&raw).or_else(|| env("KVTIER_CONFIG").map(OsString::from)) {
        Some(p) => read_file(Path::new(&p), &keys)?,
        None => BTreeMap::new(),
    };
    let cmd = Cli::command();
    let aliases = |long: &str| -> Vec<String> {
        cmd.find_subcommand("serve")
            .and_then(|s| s.get_arguments().find(|a| a.get_long() == Some(long)))
            .map(|a| {
                a.get_all_aliases()
                    .unwrap_or_default()
                    .into_iter()
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut injected: Vec<OsString> = Vec::new();
    for key in &keys {
        if given(&raw, &key.long, &aliases(&key.long)) {
            continue;
        }
        let (values, from) = match (env(&key.env()), file.get(&key.name())) {
            (Some(v), _) => (vec![v], key.env()),
            (None, Some(v)) => (v.clone(), format!("the config file's {}", key.name())),
            (None, None) => continue,
        };
        for value in values {
            if key.switch {
                if switch_on(&value).with_context(|| from.clone())? {
                    injected.push(format!("--{}", key.long).into());
                }
            } else {
                injected.push(format!("--{}={value}", key.long).into());
            }
        }
    }
    let mut out = argv[..=at].to_vec();
    out.extend(injected);
    out.extend(raw);
    Ok(out)
}

/// The whole config file with every key at its default and each flag's
/// help as comments (keys without a default are commented out).
pub fn print_default() -> String {
    let mut out = String::from(
        "# kvtier serve configuration: `kvtier serve --config FILE`.\n\
         # Every key is also an environment variable KVTIER_<KEY>; flags win over\n\
         # the environment, the environment over this file.\n",
    );
    for key in serve_keys() {
        out.push('\n');
        for line in key.help.lines() {
            for wrapped in wrap(line, 76) {
                out.push_str(format!("# {wrapped}").trim_end());
                out.push('\n');
            }
        }
        // Numbers as TOML numbers, everything else (sizes, paths) quoted.
        let value = |v: &str| -> String {
            if v.parse::<i64>().is_ok() {
                v.to_string()
            } else {
                toml::Value::String(v.to_string()).to_string()
            }
        };
        match (&key.default, key.switch) {
            (_, true) => out.push_str(&format!("{} = false\n", key.name())),
            (Some(d), false) => out.push_str(&format!("{} = {}\n", key.name(), value(d))),
            (None, false) => out.push_str(&format!("# {} =\n", key.name())),
        }
    }
    out
}

/// `line` in pieces of at most about `width` characters, split at spaces.
fn wrap(line: &str, width: usize) -> Vec<String> {
    let mut out = vec![String::new()];
    for word in line.split(' ') {
        let cur = out.last_mut().map_or(0, |l| l.len());
        if cur > 0 && cur + 1 + word.len() > width {
            out.push(String::new());
        }
        if let Some(l) = out.last_mut() {
            if !l.is_empty() {
                l.push(' ');
            }
            l.push_str(word);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::time::Duration;

    use clap::Parser;

    use super::*;
    use crate::cli::Command;

    fn parse(argv: &[&str], env: &[(&str, &str)]) -> Result<crate::cmd_serve::ServeArgs> {
        let env: HashMap<String, String> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let argv = argv.iter().map(OsString::from).collect();
        let argv = expand_args(argv, |k| env.get(k).cloned())?;
        let cli = Cli::try_parse_from(argv)?;
        match cli.command {
            Command::Serve(a) => Ok(a),
            _ => bail!("not serve"),
        }
    }

    #[test]
    fn flags_beat_the_environment_which_beats_the_file() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("kvtier.toml");
        std::fs::write(
            &file,
            "port = 1111\ng2-bytes = \"2MiB\"\nno_prefix_reuse = true\nmodel = \"from-file\"\n",
        )
        .unwrap();
        let f = file.to_str().unwrap();
        let a = parse(&["kvtier", "serve", "--config", f], &[]).unwrap();
        assert_eq!(
            (a.port, a.g2_bytes, a.no_prefix_reuse),
            (1111, 2 << 20, true)
        );
        assert_eq!(a.options().model, std::path::PathBuf::from("from-file"));
        let env = [("KVTIER_PORT", "2222"), ("KVTIER_NO_PREFIX_REUSE", "false")];
        let a = parse(&["kvtier", "serve", "--config", f], &env).unwrap();
        assert_eq!(
            (a.port, a.g2_bytes, a.no_prefix_reuse),
            (2222, 2 << 20, false)
        );
        let a = parse(&["kvtier", "serve", "--config", f, "--port", "3333"], &env).unwrap();
        assert_eq!(a.port, 3333);
        // KVTIER_CONFIG names the file when no flag does.
        let a = parse(&["kvtier", "serve"], &[("KVTIER_CONFIG", f)]).unwrap();
        assert_eq!(a.port, 1111);
    }

    #[test]
    fn unknown_keys_wrong_types_and_bad_values_are_errors_naming_them() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("bad.toml");
        let f = file.to_str().unwrap();
        for (text, needle) in [
            ("prot = 1\n", "unknown key \"prot\""),
            ("port = [1]\n", "\"port\" takes a string or a number"),
            ("port = \"x\"\n", "port"),
            ("no_prefix_reuse = \"maybe\"\n", "maybe"),
            ("port = \n", "not valid TOML"),
        ] {
            std::fs::write(&file, text).unwrap();
            let err = format!(
                "{:#}",
                parse(&["kvtier", "serve", "--config", f, "--model", "m"], &[]).unwrap_err()
            );
            assert!(err.contains(needle), "{text:?}: {err}");
        }
        let err = format!(
            "{:#}",
            parse(&["kvtier", "serve", "--config", "/no/such.toml"], &[]).unwrap_err()
        );
        assert!(err.contains("/no/such.toml"), "{err}");
    }

    #[test]
    fn a_repeatable_key_takes_a_list_and_connection_bounds_reach_the_options() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("kvtier.toml");
        std::fs::write(
            &file,
            "model = \"m\"\napi_key = [\"k1\", \"k2\"]\nmax_connections = 7\n\
             header_timeout_ms = 250\nmax_in_flight = 3\n",
        )
        .unwrap();
        let f = file.to_str().unwrap();
        let o = parse(&["kvtier", "serve", "--config", f], &[])
            .unwrap()
            .options();
        assert_eq!(o.api_keys, ["k1", "k2"]);
        assert_eq!(o.conn_limits.max_connections, 7);
        assert_eq!(o.conn_limits.header_timeout, Duration::from_millis(250));
        assert_eq!(o.conn_limits.max_in_flight, 3);
        // The environment's one key replaces the file's list.
        let o = parse(
            &["kvtier", "serve", "--config", f],
            &[("KVTIER_API_KEY", "k9")],
        )
        .unwrap()
        .options();
        assert_eq!(o.api_keys, ["k9"]);
        // A list of numbers, or a list for a key that is not repeatable, is refused.
        for (text, needle) in [
            ("api_key = [1]\n", "takes strings"),
            ("port = [\"1\"]\n", "takes a string or a number"),
        ] {
            std::fs::write(&file, text).unwrap();
            let err = format!(
                "{:#}",
                parse(&["kvtier", "serve", "--config", f, "--model", "m"], &[]).unwrap_err()
            );
            assert!(err.contains(needle), "{text:?}: {err}");
        }
    }

    #[test]
    fn vllm_spellings_and_a_positional_model_are_accepted() {
        let a = parse(
            &[
                "kvtier",
                "serve",
                "models/tiny",
                "--served-model-name",
                "x",
                "--max-model-len",
                "4096",
            ],
            &[],
        )
        .unwrap();
        let o = a.options();
        assert_eq!(o.model, std::path::PathBuf::from("models/tiny"));
        assert_eq!(o.model_name.as_deref(), Some("x"));
        assert_eq!(o.max_seq_tokens, 4096);
        // A flag given by an alias is not filled in from the environment.
        let a = parse(
            &["kvtier", "serve", "--model", "m", "--max-model-len", "4096"],
            &[("KVTIER_MAX_SEQ_TOKENS", "9")],
        )
        .unwrap();
        assert_eq!(a.max_seq_tokens, 4096);
    }

    #[test]
    fn the_printed_default_file_parses_to_the_defaults() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("default.toml");
        let text = print_default();
        assert!(text.contains("# Port to listen on"), "{text}");
        assert!(text.contains("g2_bytes = \"1GiB\""), "{text}");
        std::fs::write(&file, &text).unwrap();
        let a = parse(
            &[
                "kvtier",
                "serve",
                "--config",
                file.to_str().unwrap(),
                "--model",
                "m",
            ],
            &[],
        )
        .unwrap();
        let b = parse(&["kvtier", "serve", "--model", "m"], &[]).unwrap();
        assert_eq!(format!("{:?}", a.options()), format!("{:?}", b.options()));
    }
}
