//! The real servers: start, talk to, kill and restart them.
//!
//! These tests need `redis-server`, `redis-cli` and moto (`./scripts/test`
//! installs them) and fail, never skip, without them.

#![allow(clippy::unwrap_used)]

use kvtier_testkit::{RedisCluster, RedisServer, Resp, S3Server};

fn bulk(bytes: &[u8]) -> Resp {
    Resp::Bulk(Some(bytes.to_vec()))
}

fn ok() -> Resp {
    Resp::Simple("OK".into())
}

#[test]
fn redis_set_get_kill_restart() {
    let mut redis = RedisServer::start().unwrap();
    let port = redis.port();
    assert_eq!(redis.url(), format!("redis://127.0.0.1:{port}"));
    assert_eq!(
        redis.command(&[b"PING"]).unwrap(),
        Resp::Simple("PONG".into())
    );

    let value: &[u8] = b"\x00binary\r\nvalue\xff";
    assert_eq!(redis.command(&[b"SET", b"k1", value]).unwrap(), ok());
    assert_eq!(redis.command(&[b"GET", b"k1"]).unwrap(), bulk(value));
    assert!(redis.command(&[b"GET", b"missing"]).unwrap().is_null());
    assert_eq!(redis.command(&[b"DBSIZE"]).unwrap(), Resp::Integer(1));
    assert_eq!(
        redis.command(&[b"KEYS", b"*"]).unwrap(),
        Resp::Array(Some(vec![bulk(b"k1")]))
    );
    let err = redis.command(&[b"NOSUCHCOMMAND"]).unwrap();
    assert!(err.as_error().unwrap().starts_with("ERR"), "{err:?}");
    assert_eq!(redis.command(&[b"FLUSHALL"]).unwrap(), ok());
    assert_eq!(redis.command(&[b"DBSIZE"]).unwrap(), Resp::Integer(0));

    redis.command(&[b"SET", b"k2", b"v2"]).unwrap();
    redis.kill();
    let down = redis.command(&[b"PING"]);
    assert!(down.is_err(), "PING after kill answered {down:?}");

    redis.restart().unwrap();
    assert_eq!(redis.port(), port);
    assert_eq!(
        redis.command(&[b"PING"]).unwrap(),
        Resp::Simple("PONG".into())
    );
    // Persistence is off: the restarted server is empty.
    assert!(redis.command(&[b"GET", b"k2"]).unwrap().is_null());
    assert!(redis.dir().join("redis.log").exists());
}

#[test]
fn redis_acl_requires_auth() {
    let redis = RedisServer::start_with_acl("kvtier", "s3cret pass").unwrap();
    assert_eq!(redis.credentials(), Some(("kvtier", "s3cret pass")));

    let refused = redis.command_no_auth(&[b"SET", b"k", b"v"]).unwrap();
    assert!(
        refused.as_error().unwrap().starts_with("NOAUTH"),
        "{refused:?}"
    );
    assert_eq!(redis.command(&[b"SET", b"k", b"v"]).unwrap(), ok());
    assert_eq!(redis.command(&[b"GET", b"k"]).unwrap(), bulk(b"v"));
    assert_eq!(
        redis.command(&[b"ACL", b"WHOAMI"]).unwrap(),
        bulk(b"kvtier")
    );

    // The default user is off: AUTH with a wrong password is refused.
    let wrong = kvtier_testkit::resp_command(redis.port(), Some(("kvtier", "nope")), &[b"PING"]);
    assert!(wrong.is_err(), "{wrong:?}");
    let default = kvtier_testkit::resp_command(redis.port(), Some(("default", "")), &[b"PING"]);
    assert!(default.is_err(), "{default:?}");
}

#[test]
fn redis_cluster_of_three() {
    let cluster = RedisCluster::start(3).unwrap();
    let ports = cluster.ports();
    assert_eq!(ports.len(), 3);
    assert!(ports.iter().all(|&p| p < 55000));
    assert_eq!(
        cluster.url(),
        format!(
            "redis+cluster://127.0.0.1:{},127.0.0.1:{},127.0.0.1:{}",
            ports[0], ports[1], ports[2]
        )
    );
    assert_eq!(
        cluster.node_urls(),
        ports
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect::<Vec<_>>()
    );
    for node in 0..3 {
        let info = cluster.command_on(node, &[b"CLUSTER", b"INFO"]).unwrap();
        assert!(info.as_str().unwrap().contains("cluster_state:ok"));
    }

    // Every slot is served, by three masters, each on one of our ports.
    let slots = cluster.command_on(0, &[b"CLUSTER", b"SLOTS"]).unwrap();
    let ranges = slots.as_array().unwrap();
    assert_eq!(ranges.len(), 3);
    let mut covered = 0;
    let mut owner_of = Vec::new();
    for range in ranges {
        let r = range.as_array().unwrap();
        let (start, end) = (r[0].as_integer().unwrap(), r[1].as_integer().unwrap());
        let master = r[2].as_array().unwrap();
        let port = u16::try_from(master[1].as_integer().unwrap()).unwrap();
        let node = ports.iter().position(|&p| p == port).unwrap();
        covered += end - start + 1;
        owner_of.push((start, end, node));
    }
    assert_eq!(covered, 16384);

    // A key is stored on the node that owns its slot; the others redirect.
    let slot = cluster
        .command_on(1, &[b"CLUSTER", b"KEYSLOT", b"kvtier-key"])
        .unwrap()
        .as_integer()
        .unwrap();
    let owner = owner_of
        .iter()
        .find(|(s, e, _)| (*s..=*e).contains(&slot))
        .unwrap()
        .2;
    assert_eq!(
        cluster
            .command_on(owner, &[b"SET", b"kvtier-key", b"v"])
            .unwrap(),
        ok()
    );
    assert_eq!(
        cluster.command_on(owner, &[b"GET", b"kvtier-key"]).unwrap(),
        bulk(b"v")
    );
    let other = (owner + 1) % 3;
    let moved = cluster.command_on(other, &[b"GET", b"kvtier-key"]).unwrap();
    let expected = format!("MOVED {slot} 127.0.0.1:{}", ports[owner]);
    assert_eq!(moved.as_error(), Some(expected.as_str()));
    assert!(cluster.command_on(3, &[b"PING"]).is_err());
}

#[test]
fn redis_cluster_needs_three_masters() {
    let err = RedisCluster::start(2).err().unwrap().to_string();
    assert!(err.contains("at least 3"), "{err}");
}

#[test]
fn s3_bucket_and_object_roundtrip() {
    let s3 = S3Server::start().unwrap();
    assert_eq!(s3.endpoint(), format!("http://127.0.0.1:{}", s3.port()));
    s3.create_bucket("kvtier-test").unwrap();
    assert!(
        s3.create_bucket("b1").is_err(),
        "bucket names have 3 to 63 characters"
    );

    let body: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    let put = s3
        .request("PUT", "/kvtier-test/blocks/obj-1", &[], &body)
        .unwrap();
    assert_eq!(put.status, 200, "{put:?}");

    let get = s3
        .request("GET", "/kvtier-test/blocks/obj-1", &[], b"")
        .unwrap();
    assert_eq!(get.status, 200);
    assert_eq!(get.body, body);

    let head = s3
        .request("HEAD", "/kvtier-test/blocks/obj-1", &[], b"")
        .unwrap();
    assert_eq!(head.status, 200);
    assert_eq!(head.header("content-length"), Some("70000"));

    let range = s3
        .request(
            "GET",
            "/kvtier-test/blocks/obj-1",
            &[("Range", "bytes=10-19")],
            b"",
        )
        .unwrap();
    assert_eq!(range.status, 206);
    assert_eq!(range.body, body[10..20]);

    let delete = s3
        .request("DELETE", "/kvtier-test/blocks/obj-1", &[], b"")
        .unwrap();
    assert_eq!(delete.status, 204);
    let gone = s3
        .request("GET", "/kvtier-test/blocks/obj-1", &[], b"")
        .unwrap();
    assert_eq!(gone.status, 404);

    let no_bucket = s3.request("GET", "/no-such-bucket/k", &[], b"").unwrap();
    assert_eq!(no_bucket.status, 404);
}

#[test]
fn s3_server_kill() {
    let mut s3 = S3Server::start().unwrap();
    let port = s3.port();
    s3.kill();
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err());
}
