//! Start here for kvtier-testkit: a real redis-server on a free port of
//! 127.0.0.1 for a test, talked to, and stopped when dropped.
//!
//! ```text
//! cargo run -p kvtier-testkit --example redis_for_a_test
//! ```
//!
//! Needs `redis-server` on PATH (the test command installs it).

fn main() -> anyhow::Result<()> {
    let redis = kvtier_testkit::RedisServer::start()?;
    println!("redis-server at {}", redis.url());
    redis.command(&[b"SET", b"kvtier:example", b"hello"])?;
    let got = redis.command(&[b"GET", b"kvtier:example"])?;
    let text = got.as_bytes().map(String::from_utf8_lossy);
    println!("GET kvtier:example -> {text:?}");
    anyhow::ensure!(text.as_deref() == Some("hello"), "unexpected reply {got:?}");
    Ok(())
    // Dropping `redis` stops the server and removes its directory.
}
