//! G4 against real servers started by the test (kvtier-testkit): a
//! redis-server, a three-node Redis Cluster and a local S3 server (moto).
//! Two stores with their own G2/G3 share blocks through G4; corrupt values
//! are misses and deleted; tenants never see each other's blocks; a dead
//! pool is misses with the breaker open, and hits resume after a restart.

#![allow(clippy::unwrap_used)]

mod common;

use std::alloc::Layout;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::*;
use kvtier_io::buffer::SystemAllocator;
use kvtier_io::{HostAllocator, IoEngine};
use kvtier_store::remote::{BreakerConfig, BreakerState};
use kvtier_store::{KeyChain, RemoteConfig, StoreConfig, Tier, TieredStore};
use kvtier_testkit::{RedisCluster, RedisServer, S3Server};

/// A store with G2 (and G3 on `dir` when given) over the G4 `remote`.
fn remote_store(dir: Option<&Path>, remote: RemoteConfig) -> TieredStore {
    let mut c = store_config(dir, 256, 256);
    c.remote = Some(remote);
    open(c)
}

fn fast_breaker(url: &str) -> RemoteConfig {
    let mut r = RemoteConfig::new(url);
    r.timeout = Duration::from_millis(800);
    r.connect_timeout = Duration::from_millis(300);
    r.breaker = BreakerConfig {
        failures_to_open: 2,
        open_for: Duration::from_millis(200),
        max_open_for: Duration::from_millis(400),
    };
    r
}

/// Store A writes `ks` through to G4; store B, with empty G2/G3 of its own,
/// finds them in G4, reads them verified, promotes them, and writes them to
/// its own G3 when they leave G2. Returns B.
fn shares_blocks_between_two_stores(remote: RemoteConfig) -> TieredStore {
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let ks = keys(0..48);
    let a = remote_store(Some(da.path()), remote.clone());
    assert_eq!(put(&a, &ks).stored, 48);
    a.flush().unwrap();
    assert_eq!(
        a.metrics().g4.written_bytes.get(),
        48 * (PAYLOAD as u64 + 128),
        "header and payload of every block, without the disk padding"
    );
    assert_eq!(a.metrics().remote.dropped_puts.get(), 0);

    let b = remote_store(Some(db.path()), remote);
    let look = b.lookup_prefix(&ks);
    assert_eq!(look.hits(), 48, "{look:?}");
    assert_eq!(look.hits_in(Tier::G4), 48);
    let tiers = assert_all_hits(&ks, &b.get_many(&ks));
    assert!(tiers.iter().all(|&t| t == Tier::G4), "{tiers:?}");
    assert_eq!(b.metrics().g4.hits.get(), 48);
    assert_eq!(b.metrics().g4.corrupt_blocks.get(), 0);

    // Promoted into G2, then written to B's own G3 when G2 lets them go.
    assert_eq!(b.lookup_prefix(&ks).hits_in(Tier::G2), 48);
    b.evict_memory().unwrap();
    assert_eq!(b.lookup_prefix(&ks).hits_in(Tier::G3), 48);
    let tiers = assert_all_hits(&ks, &b.get_many(&ks));
    assert!(tiers.iter().all(|&t| t == Tier::G3), "{tiers:?}");
    assert_eq!(b.metrics().g4.hits.get(), 48, "no second G4 read");
    b
}

#[test]
fn redis_two_stores_share_blocks_through_g4() {
    let redis = RedisServer::start().unwrap();
    let _ = shares_blocks_between_two_stores(RemoteConfig::new(redis.url()));
    // Blocks live under the namespace.
    let listed = redis.command(&[b"KEYS", b"kvtier:*"]).unwrap();
    assert_eq!(listed.as_array().map(<[_]>::len), Some(48), "{listed:?}");

    // With fewer connections than blocks, each connection reads many blocks
    // one after another, and every one still lands in its own place.
    let mut few = RemoteConfig::new(redis.url());
    few.in_flight = 5;
    let c = remote_store(None, few);
    let ks = keys(0..48);
    let tiers = assert_all_hits(&ks, &c.get_many(&ks));
    assert!(tiers.iter().all(|&t| t == Tier::G4), "{tiers:?}");
}

#[test]
fn redis_cluster_spreads_blocks_over_its_nodes_and_serves_them() {
    let cluster = RedisCluster::start(3).unwrap();
    let _ = shares_blocks_between_two_stores(RemoteConfig::new(cluster.url()));
    let mut total = 0;
    for node in 0..3 {
        let n = cluster
            .command_on(node, &[b"DBSIZE"])
            .unwrap()
            .as_integer()
            .unwrap();
        assert!(n > 0, "node {node} holds no block: slots not spread");
        total += n;
    }
    assert_eq!(total, 48);
}

#[test]
fn s3_two_stores_share_blocks_through_g4() {
    let mut s3 = S3Server::start().unwrap();
    s3.create_bucket("kvpool").unwrap();
    let mut r = RemoteConfig::new(format!("s3://kvpool/pool?endpoint={}", s3.endpoint()));
    r.s3.access_key_id = Some("test".into());
    r.s3.secret_access_key = Some("test".into());
    r.s3.region = Some("us-east-1".into());
    r.timeout = Duration::from_millis(800);
    let b = shares_blocks_between_two_stores(r);
    let listing = s3
        .request("GET", "/kvpool?list-type=2&prefix=pool/kvtier/", &[], b"")
        .unwrap();
    assert_eq!(listing.status, 200);
    let body = String::from_utf8_lossy(&listing.body);
    assert_eq!(body.matches("<Key>pool/kvtier/").count(), 48, "{body}");

    // The endpoint goes away: misses, counted as errors, never a hang.
    s3.kill();
    let fresh = keys(500..504);
    assert_eq!(b.lookup_prefix(&fresh).hits(), 0);
    assert!(b.get_many(&fresh).iter().all(Option::is_none));
    assert!(b.metrics().remote.errors.get() + b.metrics().remote.timeouts.get() > 0);
}

#[test]
fn a_corrupt_or_foreign_value_in_redis_is_a_miss_and_is_deleted() {
    let redis = RedisServer::start().unwrap();
    let remote = RemoteConfig::new(redis.url());
    let ks = keys(0..5);
    let a = remote_store(None, remote.clone());
    put(&a, &ks);
    a.flush().unwrap();
    let name = |k: &kvtier_store::BlockKey| format!("kvtier:{}", k.to_hex()).into_bytes();

    // 0: one payload byte flipped; 1: cut short; 2: garbage; 3: longer than
    // a block; 4: intact.
    let mut v = redis
        .command(&[b"GET", &name(&ks[0])])
        .unwrap()
        .as_bytes()
        .unwrap()
        .to_vec();
    v[128 + 77] ^= 0x40;
    redis.command(&[b"SET", &name(&ks[0]), &v]).unwrap();
    let v = redis
        .command(&[b"GET", &name(&ks[1])])
        .unwrap()
        .as_bytes()
        .unwrap()
        .to_vec();
    redis
        .command(&[b"SET", &name(&ks[1]), &v[..v.len() / 2]])
        .unwrap();
    redis
        .command(&[b"SET", &name(&ks[2]), b"not a block"])
        .unwrap();
    let oversized = vec![7u8; SLOT as usize + 10];
    redis.command(&[b"SET", &name(&ks[3]), &oversized]).unwrap();

    let b = remote_store(None, remote);
    let got = b.get_many(&ks);
    assert!(got[..4].iter().all(Option::is_none));
    assert_all_hits(&ks[4..], &got[4..]);
    assert_eq!(b.metrics().g4.corrupt_blocks.get(), 4);
    assert_eq!(b.metrics().g4.misses.get(), 4);
    for k in &ks[..4] {
        let exists = redis.command(&[b"EXISTS", &name(k)]).unwrap();
        assert_eq!(
            exists.as_integer(),
            Some(0),
            "corrupt block {k} not deleted"
        );
    }

    // A block of another model under the right key is refused too.
    let mut other = store_config(None, 16, 0);
    other.fingerprint = kvtier_store::ModelFingerprint::of_bytes(b"another model");
    other.remote = Some(RemoteConfig::new(redis.url()));
    let o = open(other);
    put(&o, &ks[..1]);
    o.flush().unwrap();
    assert!(b.get_many(&ks[..1])[0].is_none());
    assert_eq!(b.metrics().g4.corrupt_blocks.get(), 5);
}

#[test]
fn a_tenants_prefix_never_hits_for_another_tenant() {
    let redis = RedisServer::start().unwrap();
    let tokens: Vec<u32> = (0..16 * 8).collect();
    let chain = |salt: &[u8]| KeyChain::new(&fingerprint(), &layout(), salt);
    let keys_a = chain(b"tenant-a").keys(&tokens);
    let keys_b = chain(b"tenant-b").keys(&tokens);
    assert_eq!(keys_a.len(), 8);

    let a = remote_store(None, RemoteConfig::new(redis.url()));
    put(&a, &keys_a);
    a.flush().unwrap();
    let b = remote_store(None, RemoteConfig::new(redis.url()));
    assert_eq!(b.lookup_prefix(&keys_b).hits(), 0);
    assert!(b.get_many(&keys_b).iter().all(Option::is_none));
    assert_eq!(b.lookup_prefix(&keys_a).hits_in(Tier::G4), 8);

    // Another namespace on the same pool sees nothing either.
    let mut other_ns = RemoteConfig::new(redis.url());
    other_ns.namespace = "staging".into();
    let c = remote_store(None, other_ns);
    assert_eq!(c.lookup_prefix(&keys_a).hits(), 0);
}

#[test]
fn prefix_lookup_stops_at_the_first_block_no_tier_holds() {
    let redis = RedisServer::start().unwrap();
    let remote = RemoteConfig::new(redis.url());
    let dir = tempfile::tempdir().unwrap();
    let a = remote_store(None, remote.clone());
    put(&a, &keys(0..8));
    a.flush().unwrap();
    // B holds 0..2 and 9 itself; G4 holds 0..8.
    let b = remote_store(Some(dir.path()), remote);
    put(&b, &keys(0..2));
    put(&b, &keys(9..10));
    let look = b.lookup_prefix(&keys(0..12));
    assert_eq!(
        look.tiers,
        [vec![Tier::G2; 2], vec![Tier::G4; 6]].concat(),
        "G2, G2, then G4 up to the missing key 8"
    );
}

#[test]
fn a_batch_larger_than_the_write_queue_keeps_its_leading_blocks() {
    let redis = RedisServer::start().unwrap();
    let mut remote = RemoteConfig::new(redis.url());
    // Room for three blocks as sent (header and payload).
    remote.write_queue_bytes = 3 * (PAYLOAD as u64 + 128);
    let a = remote_store(None, remote.clone());
    assert_eq!(put(&a, &keys(0..8)).stored, 8, "all eight in G2");
    a.flush().unwrap();
    assert_eq!(a.metrics().remote.dropped_puts.get(), 5);
    assert_eq!(
        a.metrics().g4.written_bytes.get(),
        3 * (PAYLOAD as u64 + 128)
    );
    // Another node restores the head of the prefix from G4.
    let b = remote_store(None, remote);
    let got = b.read_prefix(&keys(0..8));
    let tiers: Vec<Tier> = got.iter().map(|b| b.tier).collect();
    assert_eq!(tiers, vec![Tier::G4; 3], "blocks 0, 1, 2: the first three");
    got.iter().for_each(assert_content);
}

/// Calls of `cmd` the server has answered since its stats were reset.
fn calls(redis: &RedisServer, cmd: &str) -> u64 {
    let info = redis.command(&[b"INFO", b"commandstats"]).unwrap();
    let text = String::from_utf8_lossy(info.as_bytes().unwrap()).into_owned();
    let prefix = format!("cmdstat_{cmd}:calls=");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().unwrap())
}

#[test]
fn read_prefix_sends_one_get_per_block_below_the_local_tiers_and_no_exists() {
    let redis = RedisServer::start().unwrap();
    let remote = RemoteConfig::new(redis.url());
    let dir = tempfile::tempdir().unwrap();
    let a = remote_store(None, remote.clone());
    put(&a, &keys(0..8));
    a.flush().unwrap();
    // B holds 2..4 in G3, 0..2 and 9 in G2; G4 holds 0..8.
    let b = remote_store(Some(dir.path()), remote);
    put(&b, &keys(2..4));
    b.evict_memory().unwrap();
    put(&b, &keys(0..2));
    put(&b, &keys(9..10));
    b.flush().unwrap();
    redis.command(&[b"CONFIG", b"RESETSTAT"]).unwrap();

    let got = b.read_prefix(&keys(0..12));
    let tiers: Vec<Tier> = got.iter().map(|b| b.tier).collect();
    assert_eq!(
        tiers,
        [vec![Tier::G2; 2], vec![Tier::G3; 2], vec![Tier::G4; 4]].concat(),
        "G2, G3, then G4 up to the missing key 8"
    );
    got.iter().for_each(assert_content);
    assert_eq!(calls(&redis, "exists"), 0, "no EXISTS before the GETs");
    assert_eq!(
        calls(&redis, "get"),
        7,
        "one GET per key no local tier holds (4..9 and 10..12), one batch"
    );
}

#[test]
fn a_dead_pool_is_misses_with_the_breaker_open_and_hits_resume_after_restart() {
    let mut redis = RedisServer::start().unwrap();
    let url = redis.url();
    let ks = keys(0..16);
    let a = remote_store(None, fast_breaker(&url));
    put(&a, &ks);
    a.flush().unwrap();
    let b = remote_store(None, fast_breaker(&url));
    assert_eq!(b.lookup_prefix(&ks[..4]).hits_in(Tier::G4), 4);

    redis.kill();
    // Every call returns, with misses; the breaker opens.
    for _ in 0..6 {
        assert_eq!(b.lookup_prefix(&ks[4..]).hits(), 0);
        assert!(b.get_many(&ks[8..]).iter().all(Option::is_none));
    }
    assert_ne!(b.remote().unwrap().breaker_state(), BreakerState::Closed);
    let m = b.metrics();
    assert!(m.remote.errors.get() + m.remote.timeouts.get() >= 2);
    assert!(m.render().contains("kvtier_store_remote_breaker_open 1"));
    // Puts never wait on the dead pool; what cannot be written is counted.
    put(&a, &keys(100..104));
    a.flush().unwrap();
    put(&a, &keys(104..108));
    a.flush().unwrap();
    assert!(a.metrics().remote.dropped_puts.get() > 0);

    redis.restart().unwrap();
    // The breaker lets a probe through after its open time; lookups make
    // the probes. The restarted server is empty (no persistence).
    let deadline = Instant::now() + Duration::from_secs(15);
    while b.remote().unwrap().breaker_state() != BreakerState::Closed {
        assert!(Instant::now() < deadline, "breaker never closed again");
        b.lookup_prefix(&ks[..1]);
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        b.metrics()
            .render()
            .contains("kvtier_store_remote_breaker_open 0")
    );
    let fresh = keys(200..208);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        put(&a, &fresh);
        a.flush().unwrap();
        if b.lookup_prefix(&fresh).hits_in(Tier::G4) == 8 {
            break;
        }
        assert!(Instant::now() < deadline, "writes through A never resumed");
        std::thread::sleep(Duration::from_millis(100));
        // A's G2 already holds them: evict so the next put writes through.
        a.memory().drain();
    }
    assert_all_hits(&fresh, &b.get_many(&fresh));
}

#[test]
fn an_unreachable_pool_at_start_is_not_an_error() {
    let port = kvtier_testkit::free_port().unwrap();
    let s = remote_store(None, fast_breaker(&format!("redis://127.0.0.1:{port}")));
    put(&s, &keys(0..4));
    s.flush().unwrap();
    assert_eq!(s.lookup_prefix(&keys(10..14)).hits(), 0);
    assert_eq!(s.lookup_prefix(&keys(0..4)).hits_in(Tier::G2), 4);
}

#[test]
fn redis_acl_credentials_are_used_and_never_shown() {
    let redis = RedisServer::start_with_acl("kv", "s3cret-pw").unwrap();
    let good = format!("redis://kv:s3cret-pw@127.0.0.1:{}", redis.port());
    let a = remote_store(None, RemoteConfig::new(&good));
    put(&a, &keys(0..2));
    a.flush().unwrap();
    assert_eq!(a.metrics().remote.dropped_puts.get(), 0);
    let b = remote_store(None, RemoteConfig::new(&good));
    assert_eq!(b.lookup_prefix(&keys(0..2)).hits_in(Tier::G4), 2);
    assert!(!format!("{:?}", b.remote().unwrap()).contains("s3cret"));

    let bad = format!("redis://kv:wrong@127.0.0.1:{}", redis.port());
    let c = remote_store(None, fast_breaker(&bad));
    assert_eq!(
        c.lookup_prefix(&keys(0..2)).hits(),
        0,
        "wrong password: misses"
    );
    assert!(c.metrics().remote.errors.get() > 0);
    assert!(!format!("{:?}", c).contains("wrong"));
}

#[test]
fn bad_g4_urls_are_config_errors_that_hide_the_password() {
    for url in ["redis+cluster://u:topsecret@", "memcached://x", "s3://"] {
        let mut c = StoreConfig::new(layout(), fingerprint());
        c.remote = Some(RemoteConfig::new(url));
        let e = TieredStore::open(c).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("G4"), "{e}");
        assert!(!e.contains("topsecret"), "{e}");
    }
}

/// A redis-server speaking only TLS, with a certificate signed by a CA of
/// the test's own (made with the `openssl` command); killed on drop.
struct TlsRedis {
    child: std::process::Child,
    port: u16,
    ca: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = std::process::Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl not found: ./scripts/test installs it");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn start_tls_redis() -> TlsRedis {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    openssl(
        d,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "2",
            "-subj",
            "/CN=kvtier test CA",
        ],
    );
    openssl(
        d,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "srv.key",
            "-out",
            "srv.csr",
            "-subj",
            "/CN=127.0.0.1",
        ],
    );
    std::fs::write(
        d.join("ext.cnf"),
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    openssl(
        d,
        &[
            "x509",
            "-req",
            "-in",
            "srv.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "srv.crt",
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
        ],
    );
    let port = kvtier_testkit::free_port().unwrap();
    let server = kvtier_testkit::require("redis-server").unwrap();
    let child = std::process::Command::new(server)
        .args([
            "--port",
            "0",
            "--tls-port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
        ])
        .args(["--tls-cert-file", "srv.crt", "--tls-key-file", "srv.key"])
        .args(["--tls-ca-cert-file", "ca.crt", "--tls-auth-clients", "no"])
        .args(["--save", "", "--appendonly", "no"])
        .current_dir(d)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "TLS redis-server never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
    TlsRedis {
        child,
        port,
        ca: d.join("ca.crt"),
        _dir: dir,
    }
}

#[test]
fn rediss_verifies_the_server_against_the_configured_ca() {
    let tls = start_tls_redis();
    let url = format!("rediss://127.0.0.1:{}", tls.port);
    let mut trusted = RemoteConfig::new(&url);
    trusted.tls_ca_file = Some(tls.ca.clone());
    let a = remote_store(None, trusted.clone());
    put(&a, &keys(0..3));
    a.flush().unwrap();
    assert_eq!(a.metrics().remote.dropped_puts.get(), 0);
    let b = remote_store(None, trusted);
    assert_eq!(b.lookup_prefix(&keys(0..3)).hits_in(Tier::G4), 3);
    assert_all_hits(&keys(0..3), &b.get_many(&keys(0..3)));

    // Without the CA the certificate is not trusted: no connection, misses.
    let c = remote_store(None, fast_breaker(&url));
    assert_eq!(c.lookup_prefix(&keys(0..3)).hits(), 0);
    assert!(c.metrics().remote.errors.get() > 0);

    // A CA file that is not there is a configuration error.
    let mut missing = RemoteConfig::new(&url);
    missing.tls_ca_file = Some(tls.ca.with_file_name("nope.crt"));
    let mut cfg = store_config(None, 4, 0);
    cfg.remote = Some(missing);
    let e = TieredStore::open(cfg).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("nope.crt"), "{e}");
}

#[test]
fn a_slow_pool_times_out_into_misses_and_is_used_again_when_it_answers() {
    let redis = RedisServer::start().unwrap();
    let ks = keys(0..8);
    let a = remote_store(None, fast_breaker(&redis.url()));
    put(&a, &ks);
    a.flush().unwrap();
    let mut slow = fast_breaker(&redis.url());
    slow.timeout = Duration::from_millis(300);
    let b = remote_store(None, slow);
    assert_eq!(b.lookup_prefix(&ks).hits_in(Tier::G4), 8, "connected");

    // Redis holds every client's commands for 4 s: a pool that hangs.
    let paused = redis
        .command(&[b"CLIENT", b"PAUSE", b"4000", b"ALL"])
        .unwrap();
    assert_eq!(paused.as_str(), Some("OK"), "{paused:?}");
    let started = Instant::now();
    assert_eq!(b.lookup_prefix(&ks).hits(), 0);
    assert!(b.get_many(&ks).iter().all(Option::is_none));
    let during_pause = started.elapsed() < Duration::from_secs(4);
    assert!(b.metrics().remote.timeouts.get() >= 2);
    assert_ne!(b.remote().unwrap().breaker_state(), BreakerState::Closed);
    assert!(
        during_pause,
        "both calls returned while the pool still hung"
    );

    let deadline = Instant::now() + Duration::from_secs(20);
    while b.lookup_prefix(&ks).hits_in(Tier::G4) != 8 {
        assert!(
            Instant::now() < deadline,
            "hits never resumed after the pause"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_all_hits(&ks, &b.get_many(&ks));
}

/// The system allocator, counting the block-sized buffers it hands out
/// each way; a buffer asked for overwrite comes filled with 0xAB, as a
/// recycled buffer comes with its old bytes.
#[derive(Debug, Default)]
struct Dirty {
    for_overwrite: AtomicUsize,
    zeroed: AtomicUsize,
}

impl Dirty {
    fn count(&self, layout: Layout, counter: &AtomicUsize) {
        if layout.size() == SLOT as usize {
            counter.fetch_add(1, Ordering::SeqCst);
        }
    }
}

// SAFETY: delegates to the system allocator (a buffer for overwrite may
// hold any initialised bytes).
unsafe impl HostAllocator for Dirty {
    fn allocate_zeroed(&self, layout: Layout) -> Option<NonNull<u8>> {
        self.count(layout, &self.zeroed);
        SystemAllocator.allocate_zeroed(layout)
    }

    fn allocate_for_overwrite(&self, layout: Layout) -> Option<NonNull<u8>> {
        self.count(layout, &self.for_overwrite);
        let p = SystemAllocator.allocate_zeroed(layout)?;
        // SAFETY: a fresh allocation of `layout.size()` bytes.
        unsafe { std::ptr::write_bytes(p.as_ptr(), 0xAB, layout.size()) };
        Some(p)
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: allocated above with this layout.
        unsafe { SystemAllocator.deallocate(ptr, layout) }
    }

    fn name(&self) -> &'static str {
        "dirty"
    }
}

#[test]
fn a_g4_only_store_warms_its_read_buffers_and_reads_whole_blocks_into_dirty_ones() {
    let redis = RedisServer::start().unwrap();
    let ks = keys(0..8);
    let a = remote_store(None, RemoteConfig::new(redis.url()));
    put(&a, &ks);
    a.flush().unwrap();
    // No G3: G4 reads are what the warmed buffers are for.
    let g4_only = || {
        let mut c = store_config(None, 16, 0);
        c.remote = Some(RemoteConfig::new(redis.url()));
        c
    };

    // Warmed: once the warming has ended, reads take no fresh memory.
    let mut c = g4_only();
    c.warm_read_buffers = true;
    let b = open(c);
    let warm = b
        .wait_read_buffers_warm(Some(Duration::from_secs(60)))
        .expect("warming was asked for");
    assert!(
        warm.done && warm.warmed == warm.target && warm.target >= 16,
        "{warm:?}: want every buffer of the 16 blocks G2 holds warmed"
    );
    let fresh = b.fresh_buffers();
    assert!(fresh.is_some(), "the store's own allocator counts");
    let tiers = assert_all_hits(&ks, &b.get_many(&ks));
    assert!(tiers.iter().all(|&t| t == Tier::G4), "{tiers:?}");
    assert_eq!(
        b.fresh_buffers(),
        fresh,
        "a G4 read took fresh memory after the warming"
    );

    // Values shorter than a block (no disk padding), each read into a
    // buffer full of old bytes: whole and exact, none zeroed first.
    let dirty = Arc::new(Dirty::default());
    let alloc: Arc<dyn HostAllocator> = dirty.clone();
    let b = TieredStore::open_with(g4_only(), IoEngine::shared().clone(), alloc).unwrap();
    let zeroed = dirty.zeroed.load(Ordering::SeqCst);
    let tiers = assert_all_hits(&ks, &b.get_many(&ks));
    assert!(tiers.iter().all(|&t| t == Tier::G4), "{tiers:?}");
    assert_eq!(b.metrics().g4.corrupt_blocks.get(), 0);
    assert!(
        dirty.for_overwrite.load(Ordering::SeqCst) >= ks.len(),
        "the reads took buffers for overwrite"
    );
    assert_eq!(
        dirty.zeroed.load(Ordering::SeqCst),
        zeroed,
        "a G4 read zero-filled a block buffer it overwrites"
    );
}
