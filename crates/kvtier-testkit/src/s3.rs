//! moto's standalone server: a local S3-compatible endpoint.

use std::env;
use std::ffi::OsString;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};
use tempfile::TempDir;

use crate::process::{ServerProcess, with_retries};

/// How long moto may take to answer `GET /` (it imports a lot of Python).
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// How long connecting to the server may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// How long one read or write may block.
const IO_TIMEOUT: Duration = Duration::from_secs(30);

/// The moto server command: `$KVTIER_MOTO_SERVER`, else `moto_server` on
/// `PATH`, else `python3 -m moto.server` when python3 can import it.
fn moto_command() -> anyhow::Result<(PathBuf, Vec<OsString>)> {
    const VAR: &str = "KVTIER_MOTO_SERVER";
    if env::var_os(VAR).is_some_and(|v| !v.is_empty()) {
        return Ok((crate::find_binary(VAR, &[])?, Vec::new()));
    }
    if let Ok(path) = crate::require("moto_server") {
        return Ok((path, Vec::new()));
    }
    if let Ok(python) = crate::require("python3") {
        let importable = Command::new(&python)
            .args(["-c", "import moto.server"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if importable {
            return Ok((python, vec!["-m".into(), "moto.server".into()]));
        }
    }
    Err(crate::not_found("moto_server"))
}

/// One HTTP response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpResponse {
    /// The status code (200, 404, ...).
    pub status: u16,
    /// The headers in the order received, names as sent.
    pub headers: Vec<(String, String)>,
    /// The body, de-chunked.
    pub body: Vec<u8>,
}

impl HttpResponse {
    /// The first header named `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// moto's S3-compatible server on 127.0.0.1 (in-memory: a killed server
/// loses every bucket); killed on drop. It accepts any credentials without
/// checking signatures ([`S3Server::ACCESS_KEY_ID`] and friends are as good
/// as any); the region is [`S3Server::REGION`]. Buckets are addressed by
/// path (`ENDPOINT/bucket/key`).
pub struct S3Server {
    // Field order matters: the process is killed before its directory goes.
    process: ServerProcess,
    port: u16,
    dir: TempDir,
}

impl S3Server {
    /// An access key id for clients (moto accepts any).
    pub const ACCESS_KEY_ID: &'static str = "testing";

    /// A secret access key for clients (moto accepts any).
    pub const SECRET_ACCESS_KEY: &'static str = "testing";

    /// The region moto serves by default.
    pub const REGION: &'static str = "us-east-1";

    /// Starts moto's server on a free port and waits (30 s at most) until
    /// `GET /` answers 200.
    ///
    /// # Errors
    ///
    /// When moto is not installed (see [`crate::require`]), or the server
    /// does not come up; the error then quotes its log.
    pub fn start() -> anyhow::Result<Self> {
        let (program, base_args) = moto_command()?;
        let dir = tempfile::Builder::new()
            .prefix("kvtier-moto-")
            .tempdir()
            .context("create a temporary directory for moto")?;
        let log = dir.path().join("moto.log");
        let (process, port) = with_retries(|| {
            let port = crate::free_port()?;
            let mut args = base_args.clone();
            args.extend(["-H", "127.0.0.1", "-p", &port.to_string()].map(OsString::from));
            let mut process = ServerProcess::spawn(
                &program,
                args,
                &[("PYTHONUNBUFFERED", "1")],
                dir.path(),
                &log,
            )?;
            process.wait_ready("answer GET / with 200", READY_TIMEOUT, || {
                http_request(port, "GET", "/", &[], b"").is_ok_and(|r| r.status == 200)
            })?;
            Ok((process, port))
        })?;
        Ok(S3Server { process, port, dir })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The TCP port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's working directory (its log is `moto.log` there).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Creates bucket `name` (an unsigned `PUT /name`).
    ///
    /// # Errors
    ///
    /// When the request fails or is not answered with 200.
    pub fn create_bucket(&self, name: &str) -> anyhow::Result<()> {
        let response = self.request("PUT", &format!("/{name}"), &[], b"")?;
        if response.status != 200 {
            bail!(
                "PUT /{name} answered {}: {}",
                response.status,
                String::from_utf8_lossy(&response.body)
            );
        }
        Ok(())
    }

    /// Sends one HTTP/1.1 request (`Host`, `Content-Length` and
    /// `Connection: close` are added) and returns the response, whatever
    /// its status; for example `request("PUT", "/bucket/key", &[], b"v")`
    /// then `request("GET", "/bucket/key", &[], b"")`.
    ///
    /// Unless `headers` has an `Authorization`, a placeholder SigV4 one is
    /// added: moto does not check signatures, but treats a request without
    /// one as anonymous, and anonymous reads of (private) objects get 403.
    ///
    /// # Errors
    ///
    /// On connection failures or a malformed response.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> anyhow::Result<HttpResponse> {
        if headers
            .iter()
            .any(|(name, _)| name.eq_ignore_ascii_case("authorization"))
        {
            return http_request(self.port, method, path, headers, body);
        }
        let authorization = format!(
            "AWS4-HMAC-SHA256 Credential={}/20240101/{}/s3/aws4_request, \
             SignedHeaders=host, Signature=0",
            Self::ACCESS_KEY_ID,
            Self::REGION
        );
        let mut all = Vec::with_capacity(headers.len() + 1);
        all.push(("Authorization", authorization.as_str()));
        all.extend_from_slice(headers);
        http_request(self.port, method, path, &all, body)
    }

    /// Kills the server (SIGKILL) and waits until it has exited.
    pub fn kill(&mut self) {
        self.process.kill();
    }
}

/// One HTTP/1.1 request to 127.0.0.1:`port` over a fresh connection.
fn http_request(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> anyhow::Result<HttpResponse> {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let mut stream = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)
        .with_context(|| format!("connect to {addr}"))?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    let mut bytes = request.into_bytes();
    bytes.extend_from_slice(body);
    stream
        .write_all(&bytes)
        .with_context(|| format!("send {method} {path} to {addr}"))?;
    let mut raw = Vec::new();
    stream
        .read_to_end(&mut raw)
        .with_context(|| format!("read the response to {method} {path} from {addr}"))?;
    parse_response(&raw, method == "HEAD")
        .with_context(|| format!("response to {method} {path} from {addr}"))
}

/// Parses a whole response read until the server closed the connection.
fn parse_response(raw: &[u8], head_only: bool) -> anyhow::Result<HttpResponse> {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("no end of headers")?;
    let head = std::str::from_utf8(&raw[..end]).context("headers are not UTF-8")?;
    let rest = &raw[end + 4..];
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("bad status line {status_line:?}"))?;
    let mut headers = Vec::new();
    for line in lines {
        let (name, value) = line
            .split_once(':')
            .with_context(|| format!("bad header line {line:?}"))?;
        headers.push((name.trim().to_string(), value.trim().to_string()));
    }
    let mut response = HttpResponse {
        status,
        headers,
        body: Vec::new(),
    };
    if head_only {
        return Ok(response);
    }
    let chunked = response
        .header("transfer-encoding")
        .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
    response.body = if chunked {
        dechunk(rest)?
    } else if let Some(len) = response.header("content-length") {
        let len: usize = len
            .parse()
            .with_context(|| format!("bad Content-Length {len:?}"))?;
        rest.get(..len)
            .with_context(|| format!("body of {} bytes, Content-Length {len}", rest.len()))?
            .to_vec()
    } else {
        rest.to_vec()
    };
    Ok(response)
}

/// Decodes a chunked body.
fn dechunk(mut rest: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let line_end = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .context("chunk size line not terminated")?;
        let size_line = std::str::from_utf8(&rest[..line_end]).context("chunk size not UTF-8")?;
        let size_hex = size_line.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_hex, 16)
            .with_context(|| format!("bad chunk size {size_line:?}"))?;
        rest = &rest[line_end + 2..];
        if size == 0 {
            return Ok(body);
        }
        let chunk = rest.get(..size).context("truncated chunk")?;
        body.extend_from_slice(chunk);
        rest = rest.get(size + 2..).context("chunk not terminated")?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_content_length_and_chunked_bodies() {
        let r = parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc", false).unwrap();
        assert_eq!((r.status, r.body.as_slice()), (200, &b"abc"[..]));
        let r = parse_response(
            b"HTTP/1.1 404 Not Found\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\n1;x=y\r\nc\r\n0\r\n\r\n",
            false,
        )
        .unwrap();
        assert_eq!((r.status, r.body.as_slice()), (404, &b"abc"[..]));
        assert_eq!(r.header("Transfer-Encoding"), Some("chunked"));
        let r = parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n", true).unwrap();
        assert!(r.body.is_empty());
        assert!(parse_response(b"HTTP/1.1 200 OK\r\n", false).is_err());
    }
}
