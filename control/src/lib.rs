//! The control plane: Raft-replicated cluster state (members, placement, moves).
//!
//! Three parts kept apart, as raft-rs's own examples do: the state machine ([`state`]: pure
//! logic), the durable store ([`store`]: redb), and the replica driver ([`replica`]: a raft-rs
//! `RawNode` and its `Ready` handling, with no I/O of its own: messages go out as bytes through
//! whatever transport the caller runs, and time is a tick the caller gives). Beside them, the
//! placement planner ([`planner`]: pure logic over the state and the routing counts).

pub mod driver;
pub mod planner;
pub mod quic;
pub mod replica;
pub mod slog_tracing;
pub mod state;
pub mod store;

pub use driver::{ControlError, ControlHandle, Driver, DriverConfig, RaftTransport};
pub use raft::prelude::{ConfChangeType, ConfChangeV2};
pub use replica::{conf_change, Replica, ReplicaConfig, ReplicaError};
pub use state::{ClusterState, Command, Move, NodeCaps, NodeRecord, NodeStatus, Outcome};
pub use store::{RaftStore, StoreError};
