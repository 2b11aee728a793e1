//! kvtier-testkit: real servers on 127.0.0.1 for integration tests.
//!
//! Every server here is the real program, started as a child process on a
//! free port of 127.0.0.1 with its working directory in a
//! [`tempfile::TempDir`], and killed (SIGKILL, then reaped) on `Drop`:
//!
//! - [`RedisServer`]: one `redis-server` (or `valkey-server`); optionally
//!   with an ACL user and the default user disabled
//!   ([`RedisServer::start_with_acl`]); can be killed and restarted on the
//!   same port to test reconnects.
//! - [`RedisCluster`]: `n` cluster-enabled nodes joined with
//!   `redis-cli --cluster create`, ready once every node reports
//!   `cluster_state:ok`.
//! - [`S3Server`]: moto's standalone server, an S3-compatible endpoint.
//! - [`Resp`] and [`resp_command`]: a tiny RESP2 client, so tests can read
//!   and write raw values (`SET`, `GET`, `DBSIZE`, `KEYS`, `FLUSHALL`)
//!   without another Redis client.
//!
//! The API is synchronous (std threads and sockets, no async runtime).
//!
//! # Missing binaries fail, never skip
//!
//! A test that needs a server and cannot find its binary gets an error from
//! `start()` that says what is missing and how to get it ([`require`]);
//! `./scripts/test` installs `redis-server`, `redis-cli` and moto first.
//! Binaries are looked up as follows:
//!
//! | server | binary |
//! |---|---|
//! | Redis | `$KVTIER_REDIS_SERVER`, else `redis-server`, else `valkey-server` on `PATH` |
//! | cluster set-up | `$KVTIER_REDIS_CLI`, else `redis-cli`, else `valkey-cli` on `PATH` |
//! | S3 | `$KVTIER_MOTO_SERVER`, else `moto_server` on `PATH`, else `python3 -m moto.server` |
//!
//! # Why moto for S3
//!
//! moto (`pip install 'moto[server]'`) is pure Python from the Python
//! package index: no Docker, no daemon to provision, and it starts from a
//! plain `pip install`. Its server mode implements enough of the S3 API for
//! the object tier (PUT, GET, HEAD and DELETE object, buckets, listing) and
//! accepts any credentials and unsigned requests. MinIO, the usual
//! alternative, is not on a package registry this project can reach.

mod process;
mod redis;
mod resp;
mod s3;

use std::env;
use std::ffi::OsStr;
use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::Context;

pub use redis::{RedisCluster, RedisServer};
pub use resp::{Resp, resp_command};
pub use s3::{HttpResponse, S3Server};

/// What to do when a server binary is missing; part of every "not found"
/// error.
const INSTALL_HINT: &str =
    "./scripts/test installs it (apt-get install redis-server / pip install 'moto[server]')";

/// The error for a binary that is not there.
fn not_found(bin: &str) -> anyhow::Error {
    anyhow::anyhow!("{bin} not found: {INSTALL_HINT}")
}

/// Whether `path` is a regular file with an execute bit set.
fn is_executable(path: &Path) -> bool {
    path.metadata()
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// Finds the executable `bin`: a path (anything with a `/`) is checked as
/// given, a bare name is looked up on `PATH`.
///
/// # Errors
///
/// When there is no such executable, with the message
/// `"<bin> not found: ./scripts/test installs it (apt-get install redis-server / pip install 'moto[server]')"`.
pub fn require(bin: &str) -> anyhow::Result<PathBuf> {
    if bin.contains('/') {
        let path = PathBuf::from(bin);
        return if is_executable(&path) {
            Ok(path)
        } else {
            Err(not_found(bin))
        };
    }
    let path_var = env::var_os("PATH").unwrap_or_default();
    env::split_paths(&path_var)
        .map(|dir| dir.join(bin))
        .find(|candidate| is_executable(candidate))
        .ok_or_else(|| not_found(bin))
}

/// The binary named by the environment variable `var` when it is set and
/// not empty, else the first of `candidates` found by [`require`]; the
/// error names the first candidate.
fn find_binary(var: &str, candidates: &[&str]) -> anyhow::Result<PathBuf> {
    if let Some(value) = env::var_os(var).filter(|v| !v.is_empty()) {
        let value = value.to_string_lossy().into_owned();
        return require(&value).with_context(|| format!("${var} is set to {value:?}"));
    }
    let mut first_err = None;
    for bin in candidates {
        match require(bin) {
            Ok(path) => return Ok(path),
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    Err(first_err.unwrap_or_else(|| anyhow::anyhow!("no candidate binary for ${var}")))
}

/// A TCP port on 127.0.0.1 that was free a moment ago: binds port 0, reads
/// the port the kernel picked and closes the socket. Another process may
/// take it before the caller binds it; the servers here retry on a clash.
///
/// # Errors
///
/// When 127.0.0.1 cannot be bound at all.
pub fn free_port() -> anyhow::Result<u16> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("bind 127.0.0.1:0")?;
    Ok(listener.local_addr().context("local_addr")?.port())
}

/// The display form of a program path for error messages.
fn program_name(program: &Path) -> String {
    program
        .file_name()
        .unwrap_or(OsStr::new("server"))
        .to_string_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn require_finds_sh_and_names_missing_binaries() {
        assert!(require("sh").is_ok());
        let err = require("kvtier-no-such-binary").unwrap_err().to_string();
        assert_eq!(
            err,
            "kvtier-no-such-binary not found: ./scripts/test installs it \
             (apt-get install redis-server / pip install 'moto[server]')"
        );
        assert!(require("/nonexistent/redis-server").is_err());
    }

    #[test]
    fn free_port_is_bindable() {
        let port = free_port().unwrap();
        assert_ne!(port, 0);
        TcpListener::bind((Ipv4Addr::LOCALHOST, port)).unwrap();
    }
}
