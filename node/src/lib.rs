//! ternfleet worker node: runs expert FFNs.
//!
//! Principal types:
//! - [`compute::Linear`]: a quantized weight matrix living in a memory-mapped model file, and
//!   [`compute::matmul_par`], which splits its rows across the rayon pool.
//! - [`expert::ExpertBackend`]: what the coordinator calls to run one layer's expert batch. The
//!   in-process implementation is [`expert::LocalExperts`]; the QUIC client of a later issue is
//!   the remote one. A dense model is served as one expert per layer, selected with weight 1.
//! - [`expert::FfnWeights`] / [`expert::run_ffn`]: the gate/up → activation → down executor.
//!
//! The coordinator drives these; nothing here does I/O besides reading mapped weights.
pub mod compute;
pub mod expert;
