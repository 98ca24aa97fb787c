//! The gRPC API's generated types, client and server stubs (`proto/ternfleet/v1/*.proto`,
//! generated at build time by `build.rs`). Clients use these; they never depend on a server
//! crate.

/// `ternfleet.v1`: the inference service.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod v1 {
    tonic::include_proto!("ternfleet.v1");
}

/// The encoded descriptor set of every ternfleet proto (server reflection serves it).
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/ternfleet_descriptor.bin"));
