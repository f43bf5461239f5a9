//! Compiles `nuwa/*.proto` with protox (pure Rust, no system `protoc`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=nuwa/sync.proto");
    let fds = protox::compile(["nuwa/sync.proto"], ["."])?;
    prost_build::Config::new().compile_fds(fds)?;
    Ok(())
}
