//! A missing server binary is an error that says how to get it.
//!
//! One test in its own binary: it changes the process environment.

#![allow(clippy::unwrap_used)]

use kvtier_testkit::{RedisCluster, RedisServer, S3Server};

const HINT: &str = "not found: ./scripts/test installs it (apt-get install redis-server / pip install 'moto[server]')";

#[test]
fn missing_binaries_fail_with_the_install_hint() {
    // SAFETY: the only test in this binary; no other thread reads the
    // environment meanwhile.
    unsafe {
        std::env::set_var("KVTIER_REDIS_SERVER", "/nonexistent/redis-server");
        std::env::set_var("KVTIER_MOTO_SERVER", "/nonexistent/moto_server");
    }
    let err = format!("{:#}", RedisServer::start().err().unwrap());
    assert!(
        err.contains(&format!("/nonexistent/redis-server {HINT}")),
        "{err}"
    );
    assert!(err.contains("KVTIER_REDIS_SERVER"), "{err}");
    let err = format!("{:#}", RedisServer::start_with_acl("u", "p").err().unwrap());
    assert!(err.contains(HINT), "{err}");
    let err = format!("{:#}", RedisCluster::start(3).err().unwrap());
    assert!(err.contains(HINT), "{err}");
    let err = format!("{:#}", S3Server::start().err().unwrap());
    assert!(
        err.contains(&format!("/nonexistent/moto_server {HINT}")),
        "{err}"
    );

    // SAFETY: as above.
    unsafe {
        std::env::set_var("KVTIER_REDIS_SERVER", "redis-server");
        std::env::set_var("KVTIER_REDIS_CLI", "/nonexistent/redis-cli");
    }
    let err = format!("{:#}", RedisCluster::start(3).err().unwrap());
    assert!(
        err.contains(&format!("/nonexistent/redis-cli {HINT}")),
        "{err}"
    );
}
