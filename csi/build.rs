//! Generates the CSI v1.12 services from `proto/csi.proto`, and the controller's credentials
//! endpoint from `proto/node_credentials.proto`. protoc comes from the protoc-bin-vendored
//! crate, so the build needs no system protobuf compiler.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded; nothing else reads the environment concurrently.
    unsafe { std::env::set_var("PROTOC", protoc) };
    let descriptor = std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("csi_descriptor.bin");
    tonic_prost_build::configure()
        .file_descriptor_set_path(&descriptor)
        .compile_protos(&["proto/csi.proto"], &["proto"])?;
    // Its messages carry a token and secrets: `Debug` is written by hand, redacted.
    tonic_prost_build::configure()
        .skip_debug([
            ".pillar.credentials.v1.GetNodeCredentialsRequest",
            ".pillar.credentials.v1.GetNodeCredentialsResponse",
        ])
        .compile_protos(&["proto/node_credentials.proto"], &["proto"])?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
