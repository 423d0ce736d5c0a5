//! The build script of the `usher-proto` crate (crates/proto): compiles
//! `proto/doorman.proto` with protox, a pure-Rust protobuf compiler, so
//! building usher needs no system `protoc`.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let dir = manifest.join("../../proto");
    let file = dir.join("doorman.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let fds = protox::compile([&file], [&dir])?;
    tonic_prost_build::configure().build_client(true).build_server(true).compile_fds(fds)?;
    Ok(())
}
