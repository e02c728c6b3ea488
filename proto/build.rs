//! Compiles `switchyard/v1/*.proto` with protox (pure Rust), so building this crate needs no
//! system `protoc`.

use std::path::PathBuf;

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=switchyard");
    let file_descriptors = protox::compile(["switchyard/v1/switchyard.proto"], ["."])?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out_dir.join("switchyard_descriptor.bin"),
        file_descriptors.encode_to_vec(),
    )?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(file_descriptors)?;
    Ok(())
}
