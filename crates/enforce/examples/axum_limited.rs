//! An axum service that enforces a capacity leased from a real `usher
//! server`, in-process: no sidecar hop, the same limiter and lease client as
//! `usher proxy` (see `usher_enforce::embed`).
//!
//! ```sh
//! usher server --config deploy/examples/resources.yaml &       # gRPC on 0.0.0.0:15100
//! cargo run -p usher-enforce --example axum_limited -- --server 127.0.0.1:15100 --listen 127.0.0.1:8080
//! curl -i http://127.0.0.1:8080/hello                          # 200, or 429 with Retry-After
//! ```
//!
//! Without `--server` it leases from an embedded capacity server instead
//! (the `embedded-server` feature, on by default).
//! It prints `listening on ADDR` once the first lease is in, and stops (giving
//! its lease back) on Ctrl-C or when its standard input closes.

use std::net::SocketAddr;

use axum::Router;
use axum::routing::get;
use usher_enforce::embed::{Limits, RoutesConfig};

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let listen: SocketAddr = arg("--listen").unwrap_or_else(|| "127.0.0.1:8080".into()).parse()?;
    // The routes file's format (docs/proxy.md, "The routes file"): `resources:`,
    // and `doorman:` to lease from servers rather than an embedded one.
    let doorman = match arg("--server") {
        Some(server) => format!("doorman: {{ servers: [\"{server}\"], client_id: axum-example }}\n"),
        None => String::new(),
    };
    let yaml = format!("{doorman}resources:\n  hello: {{ kind: rate, capacity: 100/s, wants: 100 }}\n");
    let limits = Limits::start(RoutesConfig::parse("axum_limited", &yaml)?).await?;

    let app = Router::new().route("/hello", get(|| async { "hello\n" })).layer(limits.layer("hello")?);
    let listener = tokio::net::TcpListener::bind(listen).await?;
    println!("listening on {} (capacity source: {:?})", listener.local_addr()?, limits.source());
    let stdin_closed = tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        while std::io::stdin().read_line(&mut line).is_ok_and(|n| n > 0) {
            line.clear();
        }
    });
    let stop = async {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = stdin_closed => {}
        }
    };
    axum::serve(listener, app).with_graceful_shutdown(stop).await?;
    limits.shutdown().await;
    Ok(())
}
