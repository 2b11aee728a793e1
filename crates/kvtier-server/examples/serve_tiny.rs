//! Start a server in this process on the embedded tiny model, send it one
//! completion over loopback, print the answer, shut down.
//!
//! ```sh
//! cargo run -p kvtier-server --example serve_tiny
//! ```

use std::io::{Read, Write};
use std::net::TcpStream;

use kvtier_engine::{Preset, write_preset};
use kvtier_server::ServeOptions;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A model with deterministic random weights and a byte-level
    // tokenizer, written in a temporary directory: no download.
    let dir = tempfile::tempdir()?;
    let model = dir.path().join("tiny");
    write_preset(Preset::Tiny, 0, &model)?;

    // Any free port on 127.0.0.1; the KV cache's G3 in the same temp dir.
    let opts = ServeOptions {
        port: 0,
        cache_dir: dir.path().join("cache"),
        g3_bytes: 64 << 20,
        ..ServeOptions::new(&model)
    };
    let server = kvtier_server::start(opts)?;
    let addr = server.addr();
    println!("serving {} on http://{addr}", server.summary().model_name);

    // One completion over plain HTTP/1.1.
    let body = r#"{"prompt": "Hello, kvtier", "max_tokens": 8, "temperature": 0}"#;
    let mut conn = TcpStream::connect(addr)?;
    write!(
        conn,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut response = String::new();
    conn.read_to_string(&mut response)?;
    let json = response.split("\r\n\r\n").nth(1).unwrap_or_default();
    println!("{json}");

    // Requests in flight finish, the KV cache goes to G3.
    server.shutdown()?;
    Ok(())
}
