//! Generates the agent API from `proto/`. protoc comes from the protoc-bin-vendored crate, so the
//! build needs no system protobuf compiler.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded; nothing else reads the environment concurrently.
    unsafe { std::env::set_var("PROTOC", protoc) };
    let descriptor =
        std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("agent_descriptor.bin");
    tonic_prost_build::configure()
        .file_descriptor_set_path(&descriptor)
        .compile_protos(&["proto/pillar/agent/v1/agent.proto"], &["proto"])?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
