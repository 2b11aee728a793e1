//! Running `redis-benchmark` beside the G4 bench: how it reaches a
//! `redis://` / `rediss://` node (host, port, AUTH, database, TLS flags from
//! the URL), finding the binary, running it and reading the GET rate from
//! its CSV output.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::bench_error::{BenchError, Result, StepContext, fail};
use kvtier_store::remote::redact_url;

/// How redis-benchmark reaches a `redis://` / `rediss://` node.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct RbTarget {
    host: String,
    port: u16,
    user: Option<String>,
    password: Option<String>,
    db: Option<u32>,
    tls: bool,
    insecure: bool,
}

impl std::fmt::Debug for RbTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RbTarget")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("db", &self.db)
            .field("tls", &self.tls)
            .field("insecure", &self.insecure)
            .finish()
    }
}

impl RbTarget {
    /// redis-benchmark's connection flags.
    fn args(&self) -> Vec<String> {
        let mut a = vec![
            "-h".to_string(),
            self.host.clone(),
            "-p".into(),
            self.port.to_string(),
        ];
        if let Some(pw) = &self.password {
            if let Some(u) = &self.user {
                a.extend(["--user".into(), u.clone()]);
            }
            a.extend(["-a".into(), pw.clone()]);
        }
        if let Some(db) = self.db {
            a.extend(["--dbnum".into(), db.to_string()]);
        }
        if self.tls {
            a.push("--tls".into());
            if self.insecure {
                a.push("--insecure".into());
            }
        }
        a
    }
}

/// `%XX` escapes decoded (as the `redis` crate decodes user and password).
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let Some(v) = std::str::from_utf8(&b[i + 1..i + 3])
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(v);
            i += 3;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parses a one-node URL (`redis://[user[:password]@]host[:port][/db]`,
/// `rediss://...[#insecure]`, `valkey://`, `valkeys://`) for
/// redis-benchmark. Errors never show the password.
pub(crate) fn rb_target(url: &str) -> Result<RbTarget, String> {
    let bad = |why: &str| format!("G4 URL {}: {why}", redact_url(url));
    let (scheme, rest) = url.split_once("://").ok_or_else(|| bad("no scheme"))?;
    let tls = match scheme {
        "redis" | "valkey" => false,
        "rediss" | "valkeys" => true,
        _ => return Err(bad("not a one-node redis:// or rediss:// URL")),
    };
    let (rest, fragment) = match rest.split_once('#') {
        Some((r, f)) => (r, Some(f)),
        None => (rest, None),
    };
    let rest = rest.split_once('?').map_or(rest, |(r, _)| r);
    let (auth, rest) = match rest.rsplit_once('@') {
        Some((a, r)) => (Some(a), r),
        None => (None, rest),
    };
    let (hostport, path) = match rest.split_once('/') {
        Some((h, p)) => (h, p),
        None => (rest, ""),
    };
    let (host, port) = if let Some(v6) = hostport.strip_prefix('[') {
        let (h, after) = v6
            .split_once(']')
            .ok_or_else(|| bad("unclosed '[' in the host"))?;
        (h, after.strip_prefix(':'))
    } else {
        match hostport.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (hostport, None),
        }
    };
    if host.is_empty() {
        return Err(bad("no host"));
    }
    let port = match port {
        None | Some("") => 6379,
        Some(p) => p.parse().map_err(|_| bad("the port is not a number"))?,
    };
    let db = match path.trim_matches('/') {
        "" => None,
        d => Some(d.parse().map_err(|_| bad("the database is not a number"))?),
    };
    let (user, password) = match auth.map(|a| a.split_once(':')) {
        Some(Some((u, p))) => (
            Some(percent_decode(u)).filter(|u| !u.is_empty()),
            Some(percent_decode(p)),
        ),
        // The redis crate reads a lone field as a user name without a
        // password, and sends no AUTH.
        _ => (None, None),
    };
    Ok(RbTarget {
        host: host.to_string(),
        port,
        user,
        password,
        db,
        tls,
        insecure: fragment == Some("insecure"),
    })
}

/// The fields of one CSV line (double quotes, `""` inside them).
fn csv_fields(line: &str) -> Vec<String> {
    let mut fields = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' if quoted && chars.peek() == Some(&'"') => {
                cur.push('"');
                chars.next();
            }
            '"' => quoted = !quoted,
            ',' if !quoted => fields.push(std::mem::take(&mut cur)),
            c => cur.push(c),
        }
    }
    fields.push(cur);
    fields
}

/// Requests per second of the `GET` row of redis-benchmark's `--csv`
/// output (the `rps` column of a `"test","rps",...` header, else the second
/// column). `None` without a GET row or with a rate that is not a positive
/// number.
pub fn parse_get_rps(csv: &str) -> Option<f64> {
    let mut rps_col = 1;
    for line in csv.split(['\n', '\r']) {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let f = csv_fields(line);
        let first = f[0].trim();
        if first.eq_ignore_ascii_case("test") {
            if let Some(c) = f.iter().position(|x| x.trim().eq_ignore_ascii_case("rps")) {
                rps_col = c;
            }
            continue;
        }
        if first
            .split_whitespace()
            .next()
            .is_some_and(|w| w.eq_ignore_ascii_case("GET"))
        {
            return f
                .get(rps_col)?
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|r| r.is_finite() && *r > 0.0);
        }
    }
    None
}

/// The redis-benchmark binary: `$KVTIER_REDIS_BENCHMARK`, else
/// `redis-benchmark`, else `valkey-benchmark` on `PATH`.
pub(crate) fn find_redis_benchmark() -> Result<PathBuf> {
    let executable = |p: &Path| {
        use std::os::unix::fs::PermissionsExt;
        p.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    let on_path = |name: &str| -> Option<PathBuf> {
        if name.contains('/') {
            let p = PathBuf::from(name);
            return executable(&p).then_some(p);
        }
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
            .map(|d| d.join(name))
            .find(|p| executable(p))
    };
    if let Some(v) = std::env::var_os("KVTIER_REDIS_BENCHMARK").filter(|v| !v.is_empty()) {
        let v = v.to_string_lossy().into_owned();
        return on_path(&v).ok_or_else(|| {
            BenchError::Failed(format!(
                "$KVTIER_REDIS_BENCHMARK is {v:?}, which is not an executable"
            ))
        });
    }
    ["redis-benchmark", "valkey-benchmark"]
        .iter()
        .find_map(|n| on_path(n))
        .ok_or_else(|| {
            BenchError::Failed(
                "redis-benchmark not found on PATH (--tier g4 measures it beside G4): \
                 install it (apt-get install redis-tools, dnf install redis, brew install \
                 redis, or valkey-benchmark from valkey) or point $KVTIER_REDIS_BENCHMARK at it"
                    .into(),
            )
        })
}

/// One redis-benchmark set-up: binary, target and what to run.
#[derive(Debug)]
pub(crate) struct RedisBenchmark {
    pub(crate) bin: PathBuf,
    pub(crate) version: Option<String>,
    pub(crate) target: RbTarget,
    pub(crate) template: String,
    pub(crate) requests: u64,
    pub(crate) clients: u32,
    pub(crate) keyspace: u64,
    pub(crate) timeout: Duration,
}

impl RedisBenchmark {
    /// Runs it once; GET requests per second.
    pub(crate) fn run(&self) -> Result<f64> {
        let mut cmd = Command::new(&self.bin);
        cmd.args(self.target.args())
            .args(["-c", &self.clients.to_string()])
            .args(["-n", &self.requests.to_string()])
            .args(["-r", &self.keyspace.to_string()])
            .args(["-P", "1", "--csv", "GET", &self.template])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .with_step(|| format!("cannot run {}", self.bin.display()))?;
        let readers = [
            read_all(
                child
                    .stdout
                    .take()
                    .map(|p| Box::new(p) as Box<dyn Read + Send>),
            ),
            read_all(
                child
                    .stderr
                    .take()
                    .map(|p| Box::new(p) as Box<dyn Read + Send>),
            ),
        ];
        let deadline = Instant::now() + self.timeout;
        let status = loop {
            if let Some(st) = child.try_wait().step("waiting for redis-benchmark")? {
                break Some(st);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let [out, err] = readers.map(|r| r.join().unwrap_or_default());
        let hide = |s: &str| match &self.target.password {
            Some(pw) if !pw.is_empty() => s.replace(pw.as_str(), "***"),
            _ => s.to_string(),
        };
        let tail = |s: &str| {
            let s = hide(s.trim());
            let start = s.len().saturating_sub(2000);
            let start = (start..s.len())
                .find(|&i| s.is_char_boundary(i))
                .unwrap_or(0);
            s[start..].to_string()
        };
        let Some(status) = status else {
            fail!(
                "redis-benchmark ran past {:?} and was stopped; output: {} {}",
                self.timeout,
                tail(&out),
                tail(&err)
            );
        };
        match parse_get_rps(&out) {
            Some(rps) if status.success() => Ok(rps),
            _ => fail!(
                "redis-benchmark failed ({status}) or printed no GET rate; stdout: {:?}; \
                 stderr: {:?}",
                tail(&out),
                tail(&err)
            ),
        }
    }
}

/// Reads `pipe` to its end on a thread of its own (lossy UTF-8).
fn read_all(pipe: Option<Box<dyn Read + Send>>) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        if let Some(mut p) = pipe {
            let _ = p.read_to_end(&mut bytes);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    })
}

/// `redis-benchmark --version`'s first line, if it answers.
pub(crate) fn rb_version(bin: &Path) -> Option<String> {
    let out = Command::new(bin)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .ok()?;
    let s = String::from_utf8_lossy(&out.stdout);
    s.lines()
        .next()
        .map(|l| l.trim().to_string())
        .filter(|l| !l.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_become_redis_benchmark_flags() {
        let t = rb_target("redis://127.0.0.1:7000").unwrap();
        assert_eq!(t.args(), ["-h", "127.0.0.1", "-p", "7000"]);
        let t = rb_target("rediss://al%40ice:p%3Aw@cache.local/3#insecure").unwrap();
        assert_eq!(
            t.args(),
            [
                "-h",
                "cache.local",
                "-p",
                "6379",
                "--user",
                "al@ice",
                "-a",
                "p:w",
                "--dbnum",
                "3",
                "--tls",
                "--insecure"
            ]
        );
        assert!(!format!("{t:?}").contains("p:w"));
        let t = rb_target("redis://:pw@[::1]:6380/").unwrap();
        assert_eq!(t.args(), ["-h", "::1", "-p", "6380", "-a", "pw"]);
        let t = rb_target("valkey://user@h").unwrap();
        assert_eq!(t.args(), ["-h", "h", "-p", "6379"]);
        for bad in [
            "redis://",
            "redis://u:secret@h:port",
            "redis://u:secret@h:1/x",
            "s3://b",
        ] {
            let e = rb_target(bad).unwrap_err();
            assert!(!e.contains("secret"), "{e}");
        }
    }

    #[test]
    fn csv_rates_are_found() {
        let redis7 = "\"test\",\"rps\",\"avg_latency_ms\",\"min_latency_ms\"\n\
                      \"GET ns:abc__rand_int__\",\"33333.34\",\"0.065\",\"0.016\"\n";
        assert_eq!(parse_get_rps(redis7), Some(33333.34));
        let old = "\"PING_INLINE\",\"1.0\"\r\n\"GET\",\"1234.5\"\r\n";
        assert_eq!(parse_get_rps(old), Some(1234.5));
        let moved = "\"test\",\"avg\",\"rps\"\n\"GET x\",\"0.1\",\"99\"\n";
        assert_eq!(parse_get_rps(moved), Some(99.0));
        assert_eq!(parse_get_rps("\"GET x\",\"inf\"\n"), None);
        assert_eq!(parse_get_rps("\"SET x\",\"5\"\n"), None);
        assert_eq!(parse_get_rps(""), None);
        assert_eq!(csv_fields(r#""a,b","c""d",e"#), ["a,b", "c\"d", "e"]);
    }
}
