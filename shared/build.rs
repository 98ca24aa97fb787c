//! Generates the gRPC code of `proto/` (tonic-prost-build over protox: no system `protoc`)
//! and writes the encoded descriptor set that server reflection serves.

use prost::Message;
use std::path::PathBuf;

fn main() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../proto");
    println!("cargo:rerun-if-changed={}", root.display());
    let fds = protox::compile(
        ["ternfleet/v1/inference.proto", "ternfleet/v1/admin.proto"],
        [&root],
    )
    .unwrap_or_else(|e| panic!("compiling the protos under {}: {e}", root.display()));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    std::fs::write(out.join("ternfleet_descriptor.bin"), fds.encode_to_vec())
        .expect("writing the descriptor set to OUT_DIR");
    // Serializable, so `ternfleet ctl --json` prints exactly the admin API's response.
    tonic_prost_build::configure()
        .type_attribute(".ternfleet.v1", "#[derive(serde::Serialize)]")
        .compile_fds(fds)
        .expect("generating the gRPC code");
}
