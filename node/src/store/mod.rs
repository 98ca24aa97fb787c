//! The expert store: which experts a process keeps in RAM within a byte budget, which it reads
//! from disk on demand or ahead of time on a hint (DESIGN.md "Node memory hierarchy").
//!
//! [`policy`] is the decision logic (no I/O, time as input).
pub mod policy;

pub use policy::{Demand, ExpertId, Policy, PolicyError, StoreStats};
