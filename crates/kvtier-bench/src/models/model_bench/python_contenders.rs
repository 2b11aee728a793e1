//! The Python contenders of `kvtier model bench`: `python-safetensors`
//! (`safetensors.numpy.load_file`) and `runai-streamer` (Run:ai Model
//! Streamer's `SafetensorsStreamer`), run by `scripts/bench-model-python.py`
//! (embedded in this crate, written next to the bench files at run time).
//!
//! Missing packages are installed with `python3 -m pip install` unless told
//! not to; a contender that cannot run is skipped with the reason, never an
//! error of the bench.
//!
//! Each load is one Python process: it imports its modules (and, warm, loads
//! everything once untimed), says it is ready, waits until the bench has
//! dropped the page cache and let freed memory settle, then times its own
//! load and prints the result as JSON.

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use serde::Deserialize;

use super::rust_contenders::Loaded;

/// The helper script's text.
pub const SCRIPT: &str = include_str!("../../../../../scripts/bench-model-python.py");

/// A Python contender.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PyLoader {
    /// `safetensors.numpy.load_file`.
    Safetensors,
    /// Run:ai Model Streamer.
    Runai,
}

impl PyLoader {
    /// Both, in bench order.
    pub const ALL: [PyLoader; 2] = [PyLoader::Safetensors, PyLoader::Runai];

    /// The contender's name in reports (a JSON contract).
    pub fn name(self) -> &'static str {
        match self {
            PyLoader::Safetensors => "python-safetensors",
            PyLoader::Runai => "runai-streamer",
        }
    }

    fn script_arg(self) -> &'static str {
        match self {
            PyLoader::Safetensors => "safetensors",
            PyLoader::Runai => "runai",
        }
    }

    /// Modules that must import.
    fn imports(self) -> &'static str {
        match self {
            PyLoader::Safetensors => "import numpy, safetensors.numpy",
            PyLoader::Runai => "import numpy, torch, runai_model_streamer",
        }
    }

    /// Packages to pip-install when an import fails.
    pub fn packages(self) -> &'static [&'static str] {
        match self {
            PyLoader::Safetensors => &["safetensors", "numpy"],
            PyLoader::Runai => &["runai-model-streamer", "numpy"],
        }
    }
}

/// The interpreter and the written-out script.
#[derive(Debug, Clone)]
pub struct Python {
    interpreter: PathBuf,
    script: PathBuf,
    logs: PathBuf,
}

fn last_line(text: &[u8]) -> String {
    String::from_utf8_lossy(text)
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("(no output)")
        .trim()
        .to_string()
}

impl Python {
    /// Checks that `interpreter` runs and writes the script into `dir`.
    pub fn prepare(interpreter: &Path, dir: &Path) -> Result<Self, String> {
        let out = Command::new(interpreter)
            .args(["-c", "import sys; print(sys.version.split()[0])"])
            .output()
            .map_err(|e| format!("cannot run {}: {e}", interpreter.display()))?;
        if !out.status.success() {
            return Err(format!(
                "{} does not run: {}",
                interpreter.display(),
                last_line(&out.stderr)
            ));
        }
        let script = dir.join("bench-model-python.py");
        std::fs::write(&script, SCRIPT)
            .map_err(|e| format!("cannot write {}: {e}", script.display()))?;
        Ok(Self {
            interpreter: interpreter.to_path_buf(),
            script,
            logs: dir.to_path_buf(),
        })
    }

    fn imports_ok(&self, loader: PyLoader) -> Result<(), String> {
        let out = Command::new(&self.interpreter)
            .args(["-c", loader.imports()])
            .output()
            .map_err(|e| format!("cannot run {}: {e}", self.interpreter.display()))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(last_line(&out.stderr))
        }
    }

    /// Makes `loader`'s modules importable, pip-installing its packages
    /// when `install`. `Err` is the reason to skip it.
    pub fn ensure(&self, loader: PyLoader, install: bool) -> Result<(), String> {
        let Err(why) = self.imports_ok(loader) else {
            return Ok(());
        };
        if !install {
            return Err(format!("not installed ({why}); --no-install given"));
        }
        tracing::info!(
            "installing {} for {} with pip",
            loader.packages().join(" "),
            loader.name()
        );
        let out = Command::new(&self.interpreter)
            .args([
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "--quiet",
            ])
            .args(loader.packages())
            .output()
            .map_err(|e| format!("cannot run pip: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "pip install {} failed: {}",
                loader.packages().join(" "),
                last_line(&out.stderr)
            ));
        }
        self.imports_ok(loader)
            .map_err(|e| format!("installed, but the import still fails: {e}"))
    }

    /// Starts one load of `files` and waits until the process is ready
    /// (modules imported; warm: everything loaded once and freed).
    pub fn start(
        &self,
        loader: PyLoader,
        warm: bool,
        files: &[PathBuf],
    ) -> Result<Pending, String> {
        let log_path = self.logs.join(format!("{}.log", loader.name()));
        let log = File::options()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| format!("cannot open {}: {e}", log_path.display()))?;
        let mut cmd = Command::new(&self.interpreter);
        cmd.arg(&self.script)
            .args(["--loader", loader.script_arg()])
            .args(files)
            .env("RUNAI_STREAMER_LOG_TO_STDERR", "1")
            .env("RUNAI_STREAMER_LOG_LEVEL", "WARNING")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log));
        if warm {
            // glibc: no mmap'd chunks and no trimming, so memory freed after
            // the untimed load stays resident for the timed one.
            cmd.arg("--warm")
                .env("MALLOC_MMAP_MAX_", "0")
                .env("MALLOC_TRIM_THRESHOLD_", "68719476736");
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.interpreter.display()))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            let _ = child.wait();
            return Err("no pipes to the Python process".into());
        };
        let mut pending = Pending {
            child,
            stdin: Some(stdin),
            stdout: BufReader::new(stdout),
            log: log_path,
        };
        match pending.next_message() {
            Ok(Message::Ready) => Ok(pending),
            Ok(Message::Done(_)) => Err(pending.fail("finished before it was told to start")),
            Ok(Message::Error(e)) => Err(pending.fail(&e)),
            Err(e) => Err(pending.fail(&e)),
        }
    }
}

/// One line the script prints.
#[derive(Debug, Deserialize)]
struct Line {
    ready: Option<bool>,
    error: Option<String>,
    bytes: Option<u64>,
    seconds: Option<f64>,
    tensors: Option<usize>,
    checksum: Option<u64>,
}

enum Message {
    Ready,
    Done(Loaded),
    Error(String),
}

/// A Python load, ready to start.
#[derive(Debug)]
pub struct Pending {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    log: PathBuf,
}

impl Pending {
    /// Reads stdout up to the script's next JSON message (other lines, a
    /// library's chatter, are skipped).
    fn next_message(&mut self) -> Result<Message, String> {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self
                .stdout
                .read_line(&mut line)
                .map_err(|e| format!("reading the Python process's output: {e}"))?;
            if n == 0 {
                return Err("the Python process exited without a result".into());
            }
            let Ok(msg) = serde_json::from_str::<Line>(line.trim()) else {
                continue;
            };
            if let Some(e) = msg.error {
                return Ok(Message::Error(e));
            }
            if msg.ready == Some(true) {
                return Ok(Message::Ready);
            }
            if let (Some(bytes), Some(seconds)) = (msg.bytes, msg.seconds) {
                return Ok(Message::Done(Loaded {
                    bytes,
                    seconds,
                    tensors: msg.tensors.unwrap_or(0),
                    checksum: msg.checksum.unwrap_or(0),
                }));
            }
        }
    }

    /// Ends the process and describes the failure (with the log's last
    /// line when there is one).
    fn fail(&mut self, why: &str) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let log = std::fs::read(&self.log).unwrap_or_default();
        if log.is_empty() {
            why.to_string()
        } else {
            format!("{why} (log {}: {})", self.log.display(), last_line(&log))
        }
    }

    /// Starts the timed load and waits for its result.
    pub fn go(mut self) -> Result<Loaded, String> {
        if let Some(mut stdin) = self.stdin.take()
            && let Err(e) = stdin.write_all(b"go\n").and_then(|()| stdin.flush())
        {
            return Err(self.fail(&format!("cannot signal the Python process: {e}")));
        }
        match self.next_message() {
            Ok(Message::Done(l)) => {
                let _ = self.child.wait();
                Ok(l)
            }
            Ok(Message::Ready) => Err(self.fail("said ready twice")),
            Ok(Message::Error(e)) => Err(self.fail(&e)),
            Err(e) => Err(self.fail(&e)),
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_the_contract() {
        assert_eq!(PyLoader::Safetensors.name(), "python-safetensors");
        assert_eq!(PyLoader::Runai.name(), "runai-streamer");
        assert!(SCRIPT.contains("--loader"));
    }

    #[test]
    fn a_missing_interpreter_is_a_reason_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        let err = Python::prepare(Path::new("/nonexistent/python3"), dir.path()).unwrap_err();
        assert!(err.contains("cannot run"), "{err}");
    }

    #[test]
    fn last_line_skips_blanks() {
        assert_eq!(last_line(b"a\nb\n\n  \n"), "b");
        assert_eq!(last_line(b""), "(no output)");
    }
}
