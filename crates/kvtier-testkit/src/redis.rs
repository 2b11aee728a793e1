//! `redis-server` (or `valkey-server`) as a single server or a cluster.

use std::collections::HashSet;
use std::collections::hash_map::RandomState;
use std::ffi::OsString;
use std::fs::{self, File};
use std::hash::BuildHasher;
use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tempfile::TempDir;

use crate::process::{ServerProcess, with_retries};
use crate::resp::{Resp, resp_command};

/// How long a server may take to answer `PING`.
const READY_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a new cluster may take to reach `cluster_state:ok` everywhere.
const CLUSTER_OK_TIMEOUT: Duration = Duration::from_secs(20);

/// How long `redis-cli --cluster create` may run.
const CLUSTER_CREATE_TIMEOUT: Duration = Duration::from_secs(30);

/// Cluster node ports stay below this; the bus port is the node port + 10000.
const CLUSTER_PORT_LIMIT: u16 = 55000;

/// The offset of a cluster node's bus port from its client port.
const CLUSTER_BUS_OFFSET: u16 = 10000;

/// What the readiness wait is waiting for.
const READY_WHAT: &str = "answer PING with +PONG";

/// The server binary: `$KVTIER_REDIS_SERVER`, `redis-server`, `valkey-server`.
fn redis_server_bin() -> anyhow::Result<PathBuf> {
    crate::find_binary("KVTIER_REDIS_SERVER", &["redis-server", "valkey-server"])
}

/// The CLI binary: `$KVTIER_REDIS_CLI`, `redis-cli`, `valkey-cli`.
fn redis_cli_bin() -> anyhow::Result<PathBuf> {
    crate::find_binary("KVTIER_REDIS_CLI", &["redis-cli", "valkey-cli"])
}

/// The command line of a server on `port` in `dir`, without persistence,
/// in the foreground, plus `extra` options.
fn server_args(port: u16, dir: &Path, extra: &[OsString]) -> Vec<OsString> {
    let mut args: Vec<OsString> = [
        "--port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--protected-mode",
        "no",
        "--daemonize",
        "no",
        "--dir",
    ]
    .iter()
    .map(OsString::from)
    .collect();
    args.push(dir.as_os_str().to_owned());
    args.extend(extra.iter().cloned());
    args
}

/// Whether the server on `port` answers `PING` with `+PONG`.
fn pongs(port: u16, auth: Option<(&str, &str)>) -> bool {
    matches!(resp_command(port, auth, &[b"PING"]), Ok(Resp::Simple(s)) if s == "PONG")
}

/// A `redis-server` on 127.0.0.1, persistence off, its directory a
/// temporary one; killed and its directory removed on drop.
///
/// ```no_run
/// # fn main() -> anyhow::Result<()> {
/// use kvtier_testkit::{RedisServer, Resp};
/// let redis = RedisServer::start()?;
/// redis.command(&[b"SET", b"k", b"v"])?;
/// assert_eq!(redis.command(&[b"GET", b"k"])?, Resp::Bulk(Some(b"v".to_vec())));
/// # Ok(())
/// # }
/// ```
pub struct RedisServer {
    // Field order matters: the process is killed before its directory goes.
    process: ServerProcess,
    port: u16,
    auth: Option<(String, String)>,
    dir: TempDir,
}

impl RedisServer {
    /// Starts a server on a free port and waits (10 s at most) until it
    /// answers `PING`.
    ///
    /// # Errors
    ///
    /// When no server binary is found (see [`crate::require`]), or the
    /// server does not come up; the error then quotes its log.
    pub fn start() -> anyhow::Result<Self> {
        Self::launch(Vec::new(), None)
    }

    /// Like [`RedisServer::start`], with an ACL user `user` (`on
    /// >password ~* +@all`: every key and command) and the default user
    /// disabled, so a connection must `AUTH user password` before anything
    /// else. [`RedisServer::command`] authenticates first;
    /// [`RedisServer::command_no_auth`] does not.
    ///
    /// # Errors
    ///
    /// As [`RedisServer::start`].
    pub fn start_with_acl(user: &str, password: &str) -> anyhow::Result<Self> {
        if user.is_empty() || user == "default" {
            bail!("the ACL user must have a name other than \"default\"");
        }
        let extra = [
            "--user",
            user,
            "on",
            &format!(">{password}"),
            "~*",
            "+@all",
            "--user",
            "default",
            "off",
        ]
        .iter()
        .map(OsString::from)
        .collect();
        Self::launch(extra, Some((user.to_string(), password.to_string())))
    }

    fn launch(extra: Vec<OsString>, auth: Option<(String, String)>) -> anyhow::Result<Self> {
        let program = redis_server_bin()?;
        let dir = tempfile::Builder::new()
            .prefix("kvtier-redis-")
            .tempdir()
            .context("create a temporary directory for redis-server")?;
        let log = dir.path().join("redis.log");
        let auth_ref = auth.as_ref().map(|(u, p)| (u.as_str(), p.as_str()));
        let (process, port) = with_retries(|| {
            let port = crate::free_port()?;
            let args = server_args(port, dir.path(), &extra);
            let mut process = ServerProcess::spawn(&program, args, &[], dir.path(), &log)?;
            process.wait_ready(READY_WHAT, READY_TIMEOUT, || pongs(port, auth_ref))?;
            Ok((process, port))
        })?;
        Ok(RedisServer {
            process,
            port,
            auth,
            dir,
        })
    }

    /// The TCP port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:PORT` (no credentials: see
    /// [`RedisServer::credentials`]).
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The ACL user and password of a server from
    /// [`RedisServer::start_with_acl`].
    pub fn credentials(&self) -> Option<(&str, &str)> {
        self.auth.as_ref().map(|(u, p)| (u.as_str(), p.as_str()))
    }

    /// The server's working directory (its log is `redis.log` there).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Kills the server (SIGKILL) and waits until it has exited: the port
    /// refuses connections afterwards. Data is lost (persistence is off).
    pub fn kill(&mut self) {
        self.process.kill();
    }

    /// Starts the server again on the same port and directory (killing it
    /// first if it is still running) and waits until it answers `PING`.
    /// It comes back empty.
    ///
    /// # Errors
    ///
    /// When the server does not come up; the error quotes its log.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.process.respawn()?;
        let port = self.port;
        let auth = self
            .credentials()
            .map(|(u, p)| (u.to_string(), p.to_string()));
        let auth_ref = auth.as_ref().map(|(u, p)| (u.as_str(), p.as_str()));
        self.process
            .wait_ready(READY_WHAT, READY_TIMEOUT, || pongs(port, auth_ref))
            .map_err(|e| e.error.context(format!("restart on port {port}")))
    }

    /// Sends one command over a fresh connection (after `AUTH` when the
    /// server has an ACL user) and returns the reply; see
    /// [`resp_command`]. An error reply is `Ok(Resp::Error(..))`.
    ///
    /// # Errors
    ///
    /// On connection or protocol failures, or a refused `AUTH`.
    pub fn command(&self, args: &[&[u8]]) -> anyhow::Result<Resp> {
        resp_command(self.port, self.credentials(), args)
    }

    /// Sends one command without authenticating first, to check that the
    /// server refuses it (`-NOAUTH ...`).
    ///
    /// # Errors
    ///
    /// On connection or protocol failures.
    pub fn command_no_auth(&self, args: &[&[u8]]) -> anyhow::Result<Resp> {
        resp_command(self.port, None, args)
    }
}

/// One node of a [`RedisCluster`].
struct ClusterNode {
    process: ServerProcess,
    port: u16,
}

/// A Redis Cluster of masters (no replicas) on 127.0.0.1, every node in
/// its own directory; all killed on drop.
pub struct RedisCluster {
    // Field order matters: the processes are killed before their
    // directories go.
    nodes: Vec<ClusterNode>,
    dir: TempDir,
}

impl RedisCluster {
    /// Starts `nodes` cluster-enabled servers (ports below 55000, their bus
    /// ports + 10000 free too), joins them with `redis-cli --cluster create
    /// ... --cluster-replicas 0` so the slots are spread over all of them,
    /// and waits (20 s at most) until every node reports `cluster_state:ok`.
    ///
    /// # Errors
    ///
    /// When `nodes < 3` (Redis Cluster needs three masters), a binary is
    /// missing (see [`crate::require`]), a node does not come up, the
    /// create fails, or the cluster does not become ok in time; the error
    /// quotes the relevant log.
    pub fn start(nodes: usize) -> anyhow::Result<Self> {
        if nodes < 3 {
            bail!("a Redis Cluster needs at least 3 masters, asked for {nodes}");
        }
        let server = redis_server_bin()?;
        let cli = redis_cli_bin()?;
        let dir = tempfile::Builder::new()
            .prefix("kvtier-redis-cluster-")
            .tempdir()
            .context("create a temporary directory for the cluster")?;
        let mut cluster = RedisCluster {
            nodes: Vec::with_capacity(nodes),
            dir,
        };
        let mut used = HashSet::new();
        for index in 0..nodes {
            let node = cluster.start_node(&server, index, &used)?;
            used.insert(node.port);
            used.insert(node.port + CLUSTER_BUS_OFFSET);
            cluster.nodes.push(node);
        }
        cluster.create(&cli)?;
        cluster.wait_ok()?;
        Ok(cluster)
    }

    fn start_node(
        &self,
        program: &Path,
        index: usize,
        used: &HashSet<u16>,
    ) -> anyhow::Result<ClusterNode> {
        let dir = self.dir.path().join(format!("node-{index}"));
        fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        let log = dir.join("redis.log");
        let extra: Vec<OsString> = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "2000",
        ]
        .iter()
        .map(OsString::from)
        .collect();
        with_retries(|| {
            let port = cluster_port(used)?;
            let args = server_args(port, &dir, &extra);
            let mut process = ServerProcess::spawn(program, args, &[], &dir, &log)?;
            process.wait_ready(READY_WHAT, READY_TIMEOUT, || pongs(port, None))?;
            Ok(ClusterNode { process, port })
        })
        .with_context(|| format!("start cluster node {index}"))
    }

    /// Runs `redis-cli --cluster create` over all nodes.
    fn create(&self, cli: &Path) -> anyhow::Result<()> {
        let log = self.dir.path().join("cluster-create.log");
        let file = File::create(&log).with_context(|| format!("create {}", log.display()))?;
        let stderr = file.try_clone().context("clone log file handle")?;
        let mut command = Command::new(cli);
        command.arg("--cluster").arg("create");
        for port in self.ports() {
            command.arg(format!("127.0.0.1:{port}"));
        }
        command.args(["--cluster-replicas", "0", "--cluster-yes"]);
        let mut child = command
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(stderr)
            .spawn()
            .with_context(|| format!("spawn {}", cli.display()))?;
        let deadline = Instant::now() + CLUSTER_CREATE_TIMEOUT;
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break Some(status);
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            thread::sleep(Duration::from_millis(50));
        };
        let output = fs::read(&log).unwrap_or_default();
        let output = String::from_utf8_lossy(&output);
        match status {
            Some(status) if status.success() => Ok(()),
            Some(status) => bail!(
                "{} --cluster create failed ({status}):\n{output}",
                cli.display()
            ),
            None => bail!(
                "{} --cluster create did not finish within {CLUSTER_CREATE_TIMEOUT:?}:\n{output}",
                cli.display()
            ),
        }
    }

    /// Waits until `CLUSTER INFO` says `cluster_state:ok` on every node.
    fn wait_ok(&self) -> anyhow::Result<()> {
        let deadline = Instant::now() + CLUSTER_OK_TIMEOUT;
        loop {
            let states: Vec<String> = (0..self.nodes.len())
                .map(|i| match self.command_on(i, &[b"CLUSTER", b"INFO"]) {
                    Ok(reply) => reply
                        .as_str()
                        .and_then(|info| {
                            info.lines()
                                .find(|l| l.starts_with("cluster_state:"))
                                .map(|l| l.trim().to_string())
                        })
                        .unwrap_or_else(|| format!("unexpected reply {reply:?}")),
                    Err(e) => format!("{e:#}"),
                })
                .collect();
            if states.iter().all(|s| s == "cluster_state:ok") {
                return Ok(());
            }
            if Instant::now() >= deadline {
                let mut report = String::new();
                for (node, state) in self.nodes.iter().zip(&states) {
                    report.push_str(&format!(
                        "node 127.0.0.1:{}: {state}; log tail:\n{}\n",
                        node.port,
                        node.process.log_tail()
                    ));
                }
                bail!(
                    "the cluster did not reach cluster_state:ok within {CLUSTER_OK_TIMEOUT:?}:\n{report}"
                );
            }
            thread::sleep(Duration::from_millis(100));
        }
    }

    /// `redis://127.0.0.1:P` for every node, in node order.
    pub fn node_urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("redis://127.0.0.1:{}", n.port))
            .collect()
    }

    /// `redis+cluster://127.0.0.1:P1,127.0.0.1:P2,...`: every node as a
    /// seed.
    pub fn url(&self) -> String {
        let seeds: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        format!("redis+cluster://{}", seeds.join(","))
    }

    /// The nodes' client ports, in node order.
    pub fn ports(&self) -> Vec<u16> {
        self.nodes.iter().map(|n| n.port).collect()
    }

    /// Sends one command to node `node_index` (no redirection is
    /// followed: a key on another node answers `-MOVED ...`).
    ///
    /// # Errors
    ///
    /// When `node_index` is out of range, or on connection or protocol
    /// failures.
    pub fn command_on(&self, node_index: usize, args: &[&[u8]]) -> anyhow::Result<Resp> {
        let Some(node) = self.nodes.get(node_index) else {
            bail!(
                "node index {node_index} out of range: the cluster has {} nodes",
                self.nodes.len()
            );
        };
        resp_command(node.port, None, args)
    }
}

/// A port below 55000 that, like its bus port (+10000), was free a moment
/// ago and is not in `used`: first from the kernel's choice (port 0),
/// then, where its ephemeral range lies higher, from random candidates.
fn cluster_port(used: &HashSet<u16>) -> anyhow::Result<u16> {
    let random = RandomState::new();
    for attempt in 0u64..400 {
        let listener = if attempt < 100 {
            TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        } else {
            let span = u64::from(CLUSTER_PORT_LIMIT - 20000);
            let port = 20000 + (random.hash_one(attempt) % span) as u16;
            TcpListener::bind((Ipv4Addr::LOCALHOST, port))
        };
        let Ok(listener) = listener else { continue };
        let port = listener.local_addr().context("local_addr")?.port();
        if port >= CLUSTER_PORT_LIMIT
            || used.contains(&port)
            || used.contains(&(port + CLUSTER_BUS_OFFSET))
        {
            continue;
        }
        if TcpListener::bind((Ipv4Addr::LOCALHOST, port + CLUSTER_BUS_OFFSET)).is_ok() {
            return Ok(port);
        }
    }
    bail!("no free port pair (P < {CLUSTER_PORT_LIMIT}, P + {CLUSTER_BUS_OFFSET}) on 127.0.0.1")
}
