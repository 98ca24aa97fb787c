//! Formats and types shared by every ternfleet process.
//!
//! [`gguf`] is the one GGUF reader every process uses and the writer that builds bundles and
//! fixtures. Its principal types:
//!
//! - [`gguf::GgufFile`]: a model file opened read-only (memory-mapped, private) and validated
//!   once at open, by the coordinator when it plans placement and by each node when it loads
//!   its layers; after open, every tensor's bytes are in bounds, aligned and disjoint.
//! - [`gguf::TensorInfo`]: one tensor's name, shape (ggml `ne` order), type and byte range.
//! - [`gguf::Value`] / [`gguf::ArrayValue`]: metadata values, read through typed getters that
//!   convert integers with checks.
//! - [`gguf::GgufWriter`]: builds GGUF v3 files (bundles, test fixtures).
//! - [`gguf::GgufError`]: every way a file can be wrong, with offsets and names; hostile input
//!   (TESTING.md "GGUF and bundles: hostile files") never panics and never drives an
//!   allocation beyond the file's own size.
//!
//! [`expert`] is the expert-backend interface (routes, batches of quantized rows, per-route
//! results, a deadline) that the coordinator calls and the in-process and remote backends
//! implement; [`compute`] the matmul helpers both roles run (a [`compute::Linear`] over
//! mapped weights, split across the rayon pool); [`error::ErrorClass`] the error classes every
//! API maps to.
//!
//! [`bundle`] is the directory format nodes serve (`ternfleet convert` writes it): a manifest,
//! a coordinator part and one GGUF per routed expert, each checksummed.
//!
//! The cluster: [`cluster::ClusterFile`] (static placement: which node holds which experts),
//! [`mtls`] (the cluster CA, node certificates, mutual TLS with identities checked),
//! [`wire::Frame`] (the typed, capped frames coordinator and nodes exchange) and [`net`] (QUIC
//! endpoints and the [`net::Transport`] the coordinator's remote backend sends through).

pub mod bundle;
pub mod cluster;
pub mod compute;
pub mod error;
pub mod expert;
pub mod gguf;
pub mod metrics;
pub mod mtls;
pub mod net;
pub mod proto;
pub mod testing;
pub mod trace;
pub mod wire;
