//! A server child process: spawned with its output in a log file, polled
//! until ready, killed and reaped on demand or on drop.

use std::ffi::OsString;
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::Context;

/// How many log lines an error quotes.
const LOG_TAIL_LINES: usize = 40;

/// How often readiness is polled.
const POLL_INTERVAL: Duration = Duration::from_millis(50);

/// How many times a server is started on a fresh port when it exits before
/// becoming ready (usually another process took the port first).
pub(crate) const START_ATTEMPTS: usize = 4;

/// One server process and how to start it again.
pub(crate) struct ServerProcess {
    child: Option<Child>,
    program: PathBuf,
    args: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
    dir: PathBuf,
    log: PathBuf,
}

/// A failed start, and whether trying again on another port may help.
pub(crate) struct StartError {
    /// The process exited before it was ready (a port clash, typically).
    pub(crate) retry: bool,
    /// What went wrong, with the log tail where there is one.
    pub(crate) error: anyhow::Error,
}

impl From<anyhow::Error> for StartError {
    fn from(error: anyhow::Error) -> Self {
        StartError {
            retry: false,
            error,
        }
    }
}

/// Runs `start` until it succeeds, fails for good, or `START_ATTEMPTS`
/// retryable failures have happened; returns the last error.
pub(crate) fn with_retries<T>(
    mut start: impl FnMut() -> Result<T, StartError>,
) -> anyhow::Result<T> {
    let mut attempt = 1;
    loop {
        match start() {
            Ok(value) => return Ok(value),
            Err(e) if e.retry && attempt < START_ATTEMPTS => attempt += 1,
            Err(e) => {
                return Err(e
                    .error
                    .context(format!("failed after {attempt} attempt(s)")));
            }
        }
    }
}

impl ServerProcess {
    /// Starts `program args` in `dir` with `env` added to the environment,
    /// stdout and stderr to `log` (truncated).
    pub(crate) fn spawn(
        program: &Path,
        args: Vec<OsString>,
        env: &[(&str, &str)],
        dir: &Path,
        log: &Path,
    ) -> anyhow::Result<Self> {
        let mut process = ServerProcess {
            child: None,
            program: program.to_path_buf(),
            args,
            env: env
                .iter()
                .map(|(k, v)| (OsString::from(k), OsString::from(v)))
                .collect(),
            dir: dir.to_path_buf(),
            log: log.to_path_buf(),
        };
        let file = File::create(log).with_context(|| format!("create {}", log.display()))?;
        process.launch(file)?;
        Ok(process)
    }

    /// Starts the same command again (after [`ServerProcess::kill`]),
    /// appending to the log; kills the running one first if there is one.
    pub(crate) fn respawn(&mut self) -> anyhow::Result<()> {
        self.kill();
        let file = File::options()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("open {}", self.log.display()))?;
        self.launch(file)
    }

    fn launch(&mut self, log: File) -> anyhow::Result<()> {
        let stderr = log.try_clone().context("clone log file handle")?;
        let child = Command::new(&self.program)
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(stderr)
            .spawn()
            .with_context(|| format!("spawn {}", self.program.display()))?;
        self.child = Some(child);
        Ok(())
    }

    /// SIGKILL and reap; a no-op when not running.
    pub(crate) fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            // kill() fails only when the child was already reaped; wait() then
            // returns at once.
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The last lines of the log, for error messages.
    pub(crate) fn log_tail(&self) -> String {
        match fs::read(&self.log) {
            Ok(bytes) => {
                let text = String::from_utf8_lossy(&bytes);
                let lines: Vec<&str> = text.lines().collect();
                let start = lines.len().saturating_sub(LOG_TAIL_LINES);
                lines[start..].join("\n")
            }
            Err(e) => format!("(cannot read {}: {e})", self.log.display()),
        }
    }

    /// Polls `ready` until it returns true. Fails (retryable) as soon as
    /// the process exits, or (not retryable, after killing the process)
    /// when `timeout` passes; both errors quote the log tail.
    pub(crate) fn wait_ready(
        &mut self,
        what: &str,
        timeout: Duration,
        mut ready: impl FnMut() -> bool,
    ) -> Result<(), StartError> {
        let name = crate::program_name(&self.program);
        let deadline = Instant::now() + timeout;
        loop {
            if ready() {
                return Ok(());
            }
            let exited = match self.child.as_mut() {
                None => Some("was not running".to_string()),
                Some(child) => match child.try_wait() {
                    Ok(Some(status)) => Some(format!("exited ({status})")),
                    Ok(None) => None,
                    Err(e) => Some(format!("cannot be waited on ({e})")),
                },
            };
            if let Some(how) = exited {
                self.child = None;
                return Err(StartError {
                    retry: true,
                    error: anyhow::anyhow!(
                        "{name} {how} before it could {what}; log {}:\n{}",
                        self.log.display(),
                        self.log_tail()
                    ),
                });
            }
            if Instant::now() >= deadline {
                self.kill();
                return Err(StartError {
                    retry: false,
                    error: anyhow::anyhow!(
                        "{name} did not {what} within {timeout:?}; log {}:\n{}",
                        self.log.display(),
                        self.log_tail()
                    ),
                });
            }
            thread::sleep(POLL_INTERVAL);
        }
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}
