//! The G4 read hot path for one plain-TCP Redis/Valkey node: `GET`s on
//! many connections whose values are read straight into block buffers.
//!
//! Why hand-written: a profile of `kvtier store bench --tier g4` (through
//! the `redis` crate) spent much of its CPU in `memmove` and in page
//! faults (docs/decisions.md): each reply was parsed into a growing read buffer,
//! copied into a freshly allocated `Vec` (fresh pages fault in slowly) and
//! copied again into the store's block buffer, while `redis-benchmark` reads
//! and discards. Here a reply's `$<len>\r\n` header is parsed from a small
//! scratch buffer and the value is read with `read_exact` into a recycled,
//! already-faulted block buffer: one kernel copy per byte. Everything else
//! (lookups, writes, clusters, TLS) stays on the `redis` crate.
//!
//! Requests are spread over up to `in_flight` connections, each with one
//! `GET` outstanding at a time (see [`FastGet::get`] for why), so parsing
//! runs on every runtime thread. A connection that fails is dropped, never
//! reused.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::future::join_all;
use kvtier_io::{AlignedBuf, DIRECT_IO_ALIGN, HostAllocator};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Mutex;

use super::backend::{Fetched, Landing};
use super::remote_error::RemoteError;
use crate::key::BlockKey;

/// Bytes read at a time while looking for a reply header.
const SCRATCH: usize = 4096;

/// Where and how to connect.
#[derive(Clone)]
pub struct NodeAddr {
    /// `host:port`.
    pub host_port: String,
    /// `AUTH` user (ACL), if any.
    pub user: Option<String>,
    /// `AUTH` password, if any.
    pub password: Option<String>,
    /// Database to `SELECT` when not 0.
    pub db: i64,
}

/// One connection and the bytes read past the last reply.
struct Conn {
    stream: TcpStream,
    scratch: Vec<u8>,
    start: usize,
}

/// A pool of connections for `GET`s into block buffers.
pub struct FastGet {
    addr: NodeAddr,
    shown: String,
    connect_timeout: Duration,
    pool: Mutex<Vec<Conn>>,
}

fn err(shown: &str, what: impl std::fmt::Display) -> RemoteError {
    RemoteError::Backend(format!("{shown}: {what}"))
}

fn command(args: &[&[u8]]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
    out
}

impl Conn {
    /// Reads one reply header line (without its `\r\n`).
    async fn line(&mut self, shown: &str) -> Result<Vec<u8>, RemoteError> {
        loop {
            if let Some(end) = self.scratch[self.start..]
                .windows(2)
                .position(|w| w == b"\r\n")
            {
                let line = self.scratch[self.start..self.start + end].to_vec();
                self.start += end + 2;
                return Ok(line);
            }
            if self.scratch.len() - self.start > 1024 {
                return Err(err(shown, "reply header longer than 1 KiB"));
            }
            self.scratch.drain(..self.start);
            self.start = 0;
            let have = self.scratch.len();
            self.scratch.resize(have + SCRATCH, 0);
            let n = self
                .stream
                .read(&mut self.scratch[have..])
                .await
                .map_err(|e| err(shown, e))?;
            self.scratch.truncate(have + n);
            if n == 0 {
                return Err(err(shown, "connection closed"));
            }
        }
    }

    /// Fills `dst` with the next bytes of the stream: first what the
    /// scratch buffer holds, then straight from the socket.
    async fn exact(&mut self, dst: &mut [u8], shown: &str) -> Result<(), RemoteError> {
        let buffered = (self.scratch.len() - self.start).min(dst.len());
        dst[..buffered].copy_from_slice(&self.scratch[self.start..self.start + buffered]);
        self.start += buffered;
        if buffered < dst.len() {
            self.stream
                .read_exact(&mut dst[buffered..])
                .await
                .map_err(|e| err(shown, e))?;
        }
        Ok(())
    }

    /// Skips `n` bytes of the stream.
    async fn skip(&mut self, mut n: usize, shown: &str) -> Result<(), RemoteError> {
        let mut sink = vec![0u8; SCRATCH];
        while n > 0 {
            let step = n.min(SCRATCH);
            self.exact(&mut sink[..step], shown).await?;
            n -= step;
        }
        Ok(())
    }

    /// Sends `cmd` and expects `+OK`.
    async fn expect_ok(&mut self, cmd: &[u8], what: &str, shown: &str) -> Result<(), RemoteError> {
        self.stream
            .write_all(cmd)
            .await
            .map_err(|e| err(shown, e))?;
        let line = self.line(shown).await?;
        if line != b"+OK" {
            return Err(err(
                shown,
                format!("{what} refused: {}", String::from_utf8_lossy(&line)),
            ));
        }
        Ok(())
    }

    /// Reads one `GET` reply into a buffer of `slot` bytes from `alloc`
    /// (its length the value's; `None`: no such key). A value longer than
    /// `slot` comes back as an empty buffer, which fails the check like any
    /// other bad block.
    async fn reply(
        &mut self,
        alloc: &Arc<dyn HostAllocator>,
        slot: usize,
        shown: &str,
    ) -> Result<Option<AlignedBuf>, RemoteError> {
        let line = self.line(shown).await?;
        match line.first() {
            Some(b'$') => {}
            Some(b'-') => {
                return Err(err(shown, String::from_utf8_lossy(&line[1..])));
            }
            _ => {
                return Err(err(
                    shown,
                    format!("unexpected reply {:?}", String::from_utf8_lossy(&line)),
                ));
            }
        }
        let len: i64 = std::str::from_utf8(&line[1..])
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| err(shown, "bad bulk length"))?;
        let Ok(len) = usize::try_from(len) else {
            return Ok(None); // `$-1`: no such key
        };
        let mut crlf = [0u8; 2];
        if len > slot {
            self.skip(len, shown).await?;
            self.exact(&mut crlf, shown).await?;
            return Ok(Some(AlignedBuf::empty()));
        }
        // Not zeroed: the read overwrites the value's bytes and
        // `Landing::check` zeroes the rest of the slot.
        let mut buf = AlignedBuf::for_overwrite_in(alloc, slot, DIRECT_IO_ALIGN)
            .map_err(|e| err(shown, format!("no memory for a block: {e}")))?;
        self.exact(&mut buf[..len], shown).await?;
        self.exact(&mut crlf, shown).await?;
        if &crlf != b"\r\n" {
            return Err(err(shown, "bulk reply not terminated by CRLF"));
        }
        buf.set_len(len);
        Ok(Some(buf))
    }
}

impl FastGet {
    /// A pool for `addr`; connects lazily.
    pub fn new(addr: NodeAddr, shown: String, connect_timeout: Duration) -> Self {
        Self {
            addr,
            shown,
            connect_timeout,
            pool: Mutex::new(Vec::new()),
        }
    }

    async fn connect(&self) -> Result<Conn, RemoteError> {
        let shown = &self.shown;
        let stream = tokio::time::timeout(
            self.connect_timeout,
            TcpStream::connect(&self.addr.host_port),
        )
        .await
        .map_err(|_| RemoteError::Timeout(self.connect_timeout))?
        .map_err(|e| err(shown, e))?;
        stream.set_nodelay(true).map_err(|e| err(shown, e))?;
        let mut c = Conn {
            stream,
            scratch: Vec::with_capacity(SCRATCH),
            start: 0,
        };
        if let Some(pass) = &self.addr.password {
            let cmd = match &self.addr.user {
                Some(u) => command(&[b"AUTH", u.as_bytes(), pass.as_bytes()]),
                None => command(&[b"AUTH", pass.as_bytes()]),
            };
            c.expect_ok(&cmd, "AUTH", shown).await?;
        }
        if self.addr.db != 0 {
            let db = self.addr.db.to_string();
            c.expect_ok(&command(&[b"SELECT", db.as_bytes()]), "SELECT", shown)
                .await?;
        }
        Ok(c)
    }

    async fn take(&self) -> Result<Conn, RemoteError> {
        if let Some(c) = self.pool.lock().await.pop() {
            return Ok(c);
        }
        self.connect().await
    }

    /// Runs `GET`s on one connection, one at a time, claiming the next
    /// name from `next` until none is left; checks each value as soon as it
    /// is read. Returns `(index, value)` pairs.
    async fn run_on(
        &self,
        names: &[String],
        keys: &[BlockKey],
        next: &AtomicUsize,
        landing: &Landing,
    ) -> Result<Vec<(usize, Fetched)>, RemoteError> {
        let mut c = self.take().await?;
        let mut out = Vec::new();
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let (Some(name), Some(key)) = (names.get(i), keys.get(i)) else {
                break;
            };
            c.stream
                .write_all(&command(&[b"GET", name.as_bytes()]))
                .await
                .map_err(|e| err(&self.shown, e))?;
            let value = c.reply(&landing.alloc, landing.slot, &self.shown).await?;
            out.push((i, value.map(|b| landing.check(key, b))));
        }
        // Only a connection that read every reply goes back to the pool.
        self.pool.lock().await.push(c);
        Ok(out)
    }

    /// The values of `names` (the names of `keys`), in order, landed and
    /// checked by `landing`.
    ///
    /// Up to `in_flight` connections each keep one `GET` outstanding (as
    /// `redis-benchmark -c <in_flight> -P 1` does), taking the next name as
    /// soon as a reply is in; they run as separate tasks, so reading and
    /// checking spread over the runtime's threads. Why not deep pipelines
    /// on a few connections: with large values the server buffers every
    /// pipelined reply of a connection before the socket drains, so
    /// pipelined `GET`s restored far below redis-benchmark's rate where one
    /// `GET` per connection kept up with it (docs/decisions.md).
    pub async fn get(
        self: Arc<Self>,
        names: &[String],
        keys: &[BlockKey],
        in_flight: usize,
        landing: &Landing,
    ) -> Result<Vec<Fetched>, RemoteError> {
        let n = names.len().min(keys.len());
        let shared = Arc::new((names.to_vec(), keys.to_vec(), AtomicUsize::new(0)));
        let tasks: Vec<_> = (0..in_flight.clamp(1, n.max(1)))
            .map(|_| {
                let (me, shared, landing) = (self.clone(), shared.clone(), landing.clone());
                tokio::spawn(async move {
                    let (names, keys, next) = &*shared;
                    me.run_on(names, keys, next, &landing).await
                })
            })
            .collect();
        let mut out: Vec<Fetched> = (0..n).map(|_| None).collect();
        for t in join_all(tasks).await {
            let part = t.map_err(|e| err(&self.shown, format!("read task failed: {e}")))?;
            for (i, v) in part? {
                out[i] = v;
            }
        }
        Ok(out)
    }
}
