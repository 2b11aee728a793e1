//! A tiny RESP2 client: one command per fresh TCP connection.

use std::io::{BufRead, BufReader, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{Context, bail};

/// How long connecting to a server may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// How long one read or write may block.
const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// The largest bulk string accepted (Redis' own `proto-max-bulk-len`).
const MAX_BULK: usize = 512 << 20;

/// One RESP2 reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resp {
    /// `+OK`: a simple string.
    Simple(String),
    /// `-ERR ...`: an error reply, the text after the `-` (for example
    /// `"NOAUTH Authentication required."`).
    Error(String),
    /// `:42`: an integer.
    Integer(i64),
    /// `$3\r\nabc`: a bulk string; `None` for the null bulk string (`$-1`),
    /// as `GET` answers for a missing key.
    Bulk(Option<Vec<u8>>),
    /// `*2\r\n...`: an array; `None` for the null array (`*-1`).
    Array(Option<Vec<Resp>>),
}

impl Resp {
    /// The bytes of a simple or (non-null) bulk string.
    pub fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            Resp::Simple(s) => Some(s.as_bytes()),
            Resp::Bulk(Some(b)) => Some(b),
            _ => None,
        }
    }

    /// A simple or (non-null) bulk string as UTF-8 text.
    pub fn as_str(&self) -> Option<&str> {
        self.as_bytes().and_then(|b| std::str::from_utf8(b).ok())
    }

    /// The value of an integer reply.
    pub fn as_integer(&self) -> Option<i64> {
        match self {
            Resp::Integer(i) => Some(*i),
            _ => None,
        }
    }

    /// The elements of a (non-null) array.
    pub fn as_array(&self) -> Option<&[Resp]> {
        match self {
            Resp::Array(Some(items)) => Some(items),
            _ => None,
        }
    }

    /// The text of an error reply.
    pub fn as_error(&self) -> Option<&str> {
        match self {
            Resp::Error(e) => Some(e),
            _ => None,
        }
    }

    /// Whether this is an error reply.
    pub fn is_error(&self) -> bool {
        matches!(self, Resp::Error(_))
    }

    /// Whether this is the null bulk string or the null array.
    pub fn is_null(&self) -> bool {
        matches!(self, Resp::Bulk(None) | Resp::Array(None))
    }
}

/// Sends one command (an array of bulk strings) to the server on
/// 127.0.0.1:`port` over a fresh connection and reads its reply. With
/// `auth` (user, password) an `AUTH user password` goes first.
///
/// An error reply from the server is `Ok(Resp::Error(..))`; only I/O and
/// protocol failures (and a refused `AUTH`) are `Err`.
///
/// # Errors
///
/// When the connection fails, the reply is not valid RESP2, or `AUTH` is
/// answered with an error.
pub fn resp_command(port: u16, auth: Option<(&str, &str)>, args: &[&[u8]]) -> anyhow::Result<Resp> {
    if args.is_empty() {
        bail!("empty Redis command");
    }
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let stream = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)
        .with_context(|| format!("connect to {addr}"))?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let _ = stream.set_nodelay(true);

    let mut request = Vec::new();
    if let Some((user, password)) = auth {
        encode(
            &mut request,
            &[b"AUTH", user.as_bytes(), password.as_bytes()],
        );
    }
    encode(&mut request, args);
    (&stream)
        .write_all(&request)
        .with_context(|| format!("send to {addr}"))?;

    let mut reader = BufReader::new(&stream);
    if let Some((user, _)) = auth {
        let reply = read_reply(&mut reader).with_context(|| format!("AUTH reply from {addr}"))?;
        if let Resp::Error(e) = reply {
            bail!("AUTH as {user:?} on {addr} failed: {e}");
        }
    }
    let name = String::from_utf8_lossy(args[0]).into_owned();
    read_reply(&mut reader).with_context(|| format!("{name} reply from {addr}"))
}

/// Appends `args` as a RESP array of bulk strings.
fn encode(out: &mut Vec<u8>, args: &[&[u8]]) {
    out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for arg in args {
        out.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
        out.extend_from_slice(arg);
        out.extend_from_slice(b"\r\n");
    }
}

/// One line without its CRLF.
fn read_line(reader: &mut impl BufRead) -> anyhow::Result<String> {
    let mut line = Vec::new();
    reader.read_until(b'\n', &mut line)?;
    if line.is_empty() {
        bail!("connection closed before a reply");
    }
    if !line.ends_with(b"\r\n") {
        bail!(
            "reply line not terminated by CRLF: {:?}",
            String::from_utf8_lossy(&line)
        );
    }
    line.truncate(line.len() - 2);
    String::from_utf8(line).context("reply line is not UTF-8")
}

/// Parses one reply.
pub(crate) fn read_reply(reader: &mut impl BufRead) -> anyhow::Result<Resp> {
    let line = read_line(reader)?;
    let (kind, rest) = line.split_at_checked(1).context("empty reply line")?;
    match kind {
        "+" => Ok(Resp::Simple(rest.to_string())),
        "-" => Ok(Resp::Error(rest.to_string())),
        ":" => Ok(Resp::Integer(
            rest.parse()
                .with_context(|| format!("bad integer {rest:?}"))?,
        )),
        "$" => {
            let len: i64 = rest
                .parse()
                .with_context(|| format!("bad bulk length {rest:?}"))?;
            if len < 0 {
                return Ok(Resp::Bulk(None));
            }
            let len = usize::try_from(len)?;
            if len > MAX_BULK {
                bail!("bulk string of {len} bytes is over {MAX_BULK}");
            }
            let mut data = vec![0; len + 2];
            reader.read_exact(&mut data)?;
            if !data.ends_with(b"\r\n") {
                bail!("bulk string not terminated by CRLF");
            }
            data.truncate(len);
            Ok(Resp::Bulk(Some(data)))
        }
        "*" => {
            let len: i64 = rest
                .parse()
                .with_context(|| format!("bad array length {rest:?}"))?;
            if len < 0 {
                return Ok(Resp::Array(None));
            }
            let len = usize::try_from(len)?;
            let mut items = Vec::with_capacity(len.min(1024));
            for _ in 0..len {
                items.push(read_reply(reader)?);
            }
            Ok(Resp::Array(Some(items)))
        }
        other => bail!("unknown RESP2 reply type {other:?} in {line:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(bytes: &[u8]) -> anyhow::Result<Resp> {
        read_reply(&mut &bytes[..])
    }

    #[test]
    fn encodes_bulk_string_arrays() {
        let mut out = Vec::new();
        encode(&mut out, &[b"SET", b"k", b""]);
        assert_eq!(out, b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$0\r\n\r\n");
    }

    #[test]
    fn parses_every_reply_type() {
        assert_eq!(parse(b"+OK\r\n").unwrap(), Resp::Simple("OK".into()));
        assert_eq!(
            parse(b"-NOAUTH Authentication required.\r\n").unwrap(),
            Resp::Error("NOAUTH Authentication required.".into())
        );
        assert_eq!(parse(b":-7\r\n").unwrap().as_integer(), Some(-7));
        assert_eq!(
            parse(b"$4\r\na\r\nb\r\n").unwrap().as_bytes(),
            Some(&b"a\r\nb"[..])
        );
        assert!(parse(b"$-1\r\n").unwrap().is_null());
        assert!(parse(b"*-1\r\n").unwrap().is_null());
        let nested = parse(b"*2\r\n:1\r\n*1\r\n$0\r\n\r\n").unwrap();
        assert_eq!(
            nested,
            Resp::Array(Some(vec![
                Resp::Integer(1),
                Resp::Array(Some(vec![Resp::Bulk(Some(Vec::new()))])),
            ]))
        );
    }

    #[test]
    fn rejects_malformed_replies() {
        assert!(parse(b"").is_err());
        assert!(parse(b"+OK\n").is_err());
        assert!(parse(b"$5\r\nab\r\n").is_err());
        assert!(parse(b"%1\r\n").is_err());
        assert!(parse(b":x\r\n").is_err());
    }
}
