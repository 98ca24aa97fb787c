//! ternfleet worker node: runs expert FFNs.
//!
//! Principal types:
//! - [`expert::FfnWeights`] / [`expert::run_ffn`]: the gate/up → activation → down executor,
//!   over rows already quantized by the coordinator (`ternfleet_shared::expert`).
//! - [`expert::LocalExperts`]: every expert of every layer in this process, behind
//!   `ternfleet_shared::expert::ExpertBackend` — the in-process backend of single-node mode;
//!   the QUIC server of a later issue runs the same executor over a node's shard. A dense
//!   model is served as one expert per layer, selected with weight 1.
//! - [`shard::open_experts`]: opens the expert blobs of a bundle that a predicate selects
//!   (a node's shard; all of them in single-node mode), verified against the manifest.
//!
//! - [`service::Service`]: what a node does with each cluster frame (status, calls on its
//!   [`service::Shard`], hints), apart from the network; [`server::run`] is `ternfleet node`,
//!   the QUIC server with mutual TLS around it.
//!
//! The coordinator drives the executor and the store; the server is the only network code. The
//! matmul helpers (`Linear`, `matmul_par`) live in `ternfleet_shared::compute`, which both
//! roles use.
pub mod control;
pub mod expert;
pub mod metrics;
pub mod moves;
pub mod server;
pub mod service;
pub mod shard;
pub mod store;
