//! The replicated state machine: what the Raft group agrees on (members, their capacity and
//! status, which node holds which routed expert, moves in flight, the bundle) and the commands
//! that change it. Pure logic: [`ClusterState::apply`] is deterministic, so every member that
//! applies the same commands in the same order holds the same state ([`ClusterState::digest`]
//! compares them). A command that does not fit the state (an unknown node, a stale placement
//! version) is *rejected* at apply time, identically on every member, and changes nothing.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use ternfleet_shared::cluster::{check_id, ClusterFile, NodeEntry};

/// Version of the serialized state and command formats (in every snapshot and log entry).
pub const FORMAT_VERSION: u32 = 1;

/// Largest encoded command accepted (a seed placement of a 1,000-expert × 100-layer model fits).
pub const MAX_COMMAND_BYTES: usize = 16 << 20;

/// A node's lifecycle as the control plane sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeStatus {
    /// Registered, loading its experts: not routed to, and not declared down while loading.
    Loading,
    /// Serving.
    Up,
    /// Missed heartbeats: not routed to until it reports again.
    Down,
    /// Operator drain: not routed to, keeps its files.
    Draining,
    /// Drained, its experts re-replicated elsewhere, removed once none is left on it.
    Decommissioning,
}

impl NodeStatus {
    /// Whether the coordinator may send rows to a node in this state.
    pub fn routable(self) -> bool {
        self == NodeStatus::Up
    }
}

/// What a node reports about itself when it registers.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeCaps {
    /// Kernel family (`avx512`, `avx2`, `neon`, `scalar`); replicas only across bit-equal families.
    pub kernels: String,
    /// CPU feature names, informational.
    #[serde(default)]
    pub cpu_features: Vec<String>,
    /// Measured memory bandwidth, MB/s.
    pub mem_bw_mbs: u64,
    pub ram_bytes: u64,
    pub disk_bytes: u64,
}

/// One member node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    /// Its Raft id (0: not a Raft member).
    pub raft_id: u64,
    /// QUIC `host:port`.
    pub addr: String,
    pub caps: NodeCaps,
    pub status: NodeStatus,
    /// Leader clock (ms since the Unix epoch) of the last heartbeat committed for it.
    pub last_heartbeat_ms: u64,
    /// `experts[layer]`: the routed experts it holds.
    pub experts: BTreeMap<u32, BTreeSet<u32>>,
}

/// A copy of one expert from one node to another, in flight.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Move {
    pub layer: u32,
    pub expert: u32,
    /// Node that drops its copy once the move completes (`None`: a new replica).
    pub from: Option<String>,
    pub to: String,
}

/// The replicated state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterState {
    pub format: u32,
    /// SHA-256 of the bundle manifest every node serves (set by the seed).
    pub bundle: Option<String>,
    /// Ids allowed to call the nodes.
    pub coordinators: BTreeSet<String>,
    pub nodes: BTreeMap<String, NodeRecord>,
    /// Bumped by every command that changes who holds what or who may be routed to.
    pub placement_version: u64,
    pub moves: BTreeMap<u64, Move>,
    pub next_move: u64,
}

impl Default for ClusterState {
    fn default() -> Self {
        ClusterState {
            format: FORMAT_VERSION,
            bundle: None,
            coordinators: BTreeSet::new(),
            nodes: BTreeMap::new(),
            placement_version: 0,
            moves: BTreeMap::new(),
            next_move: 1,
        }
    }
}

/// A change to the state, proposed through Raft.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "op")]
pub enum Command {
    /// The first placement (from a static cluster file); only while the state has none.
    Seed {
        bundle: Option<String>,
        file: ClusterFile,
        n_layer: u32,
        n_expert: u32,
    },
    /// A node joins or re-registers (address or capacity changed).
    Register {
        id: String,
        raft_id: u64,
        addr: String,
        caps: NodeCaps,
    },
    /// A node is alive (`loading`: still loading its experts).
    Heartbeat {
        id: String,
        at_ms: u64,
        loading: bool,
    },
    /// Missed heartbeats, noticed by the leader.
    MarkDown { id: String },
    /// Operator: stop routing to the node.
    Drain { id: String },
    /// Operator: route to a drained node again.
    Recommission { id: String },
    /// Operator: drain, re-replicate, remove.
    Decommission { id: String },
    /// Start copying an expert; `expect_version` guards against a plan made on stale state.
    BeginMove {
        mv: Move,
        expect_version: Option<u64>,
    },
    /// The copy is on `to` and verified: switch holders.
    CompleteMove { id: u64 },
    /// Give a move up (copy failed, node gone).
    AbortMove { id: u64 },
    /// Remove a node that holds no experts.
    Remove { id: String },
    /// A no-op that carries a sequence number (tests, and a leader's barrier).
    Noop { seq: u64 },
}

/// The result of applying one command, the same on every member.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// Applied; the placement version after it.
    Applied { placement_version: u64 },
    /// Applied and a move id assigned.
    MoveStarted { id: u64, placement_version: u64 },
    /// Refused, nothing changed.
    Rejected(String),
}

impl Command {
    /// Encoded log-entry payload: the format version, then JSON.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = FORMAT_VERSION.to_le_bytes().to_vec();
        // Serializing plain data with string keys cannot fail.
        out.extend(serde_json::to_vec(self).unwrap_or_default());
        out
    }

    /// Decodes [`Command::encode`]'s output.
    pub fn decode(b: &[u8]) -> Result<Command, String> {
        if b.len() > MAX_COMMAND_BYTES {
            return Err(format!(
                "command of {} bytes, the limit is {MAX_COMMAND_BYTES}",
                b.len()
            ));
        }
        let (v, body) = b
            .split_first_chunk::<4>()
            .ok_or("command shorter than its version")?;
        let v = u32::from_le_bytes(*v);
        if v != FORMAT_VERSION {
            return Err(format!(
                "command format {v}, this build reads {FORMAT_VERSION}"
            ));
        }
        serde_json::from_slice(body).map_err(|e| format!("command: {e}"))
    }
}

fn reject(msg: impl Into<String>) -> Outcome {
    Outcome::Rejected(msg.into())
}

impl ClusterState {
    /// The state as the bytes of a snapshot.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Decodes [`ClusterState::encode`]'s output (a snapshot or the stored state).
    pub fn decode(b: &[u8]) -> Result<ClusterState, String> {
        let s: ClusterState = serde_json::from_slice(b).map_err(|e| format!("state: {e}"))?;
        if s.format != FORMAT_VERSION {
            return Err(format!(
                "state format {}, this build reads {FORMAT_VERSION}",
                s.format
            ));
        }
        Ok(s)
    }

    /// SHA-256 of the encoded state: equal on members that applied the same commands.
    pub fn digest(&self) -> [u8; 32] {
        Sha256::digest(self.encode()).into()
    }

    /// Applies one committed command.
    pub fn apply(&mut self, cmd: &Command) -> Outcome {
        match cmd {
            Command::Seed {
                bundle,
                file,
                n_layer,
                n_expert,
            } => self.seed(bundle, file, *n_layer, *n_expert),
            Command::Register {
                id,
                raft_id,
                addr,
                caps,
            } => {
                if let Err(e) = check_id(id) {
                    return reject(e);
                }
                if self.coordinators.contains(id) {
                    return reject(format!("{id} is a coordinator id"));
                }
                if let Some(other) = self
                    .nodes
                    .iter()
                    .find(|(o, n)| *o != id && *raft_id != 0 && n.raft_id == *raft_id)
                {
                    return reject(format!(
                        "raft id {raft_id} already belongs to node {}",
                        other.0
                    ));
                }
                match self.nodes.get_mut(id) {
                    Some(n) => {
                        n.addr.clone_from(addr);
                        n.caps = caps.clone();
                        if *raft_id != 0 {
                            n.raft_id = *raft_id;
                        }
                    }
                    None => {
                        self.nodes.insert(
                            id.clone(),
                            NodeRecord {
                                raft_id: *raft_id,
                                addr: addr.clone(),
                                caps: caps.clone(),
                                status: NodeStatus::Loading,
                                last_heartbeat_ms: 0,
                                experts: BTreeMap::new(),
                            },
                        );
                    }
                }
                self.bump()
            }
            Command::Heartbeat { id, at_ms, loading } => {
                let Some(n) = self.nodes.get_mut(id) else {
                    return reject(format!("no node {id}"));
                };
                n.last_heartbeat_ms = n.last_heartbeat_ms.max(*at_ms);
                let next = match n.status {
                    NodeStatus::Loading | NodeStatus::Down | NodeStatus::Up => {
                        if *loading {
                            NodeStatus::Loading
                        } else {
                            NodeStatus::Up
                        }
                    }
                    s => s,
                };
                self.set_status(id, next)
            }
            Command::MarkDown { id } => match self.nodes.get(id).map(|n| n.status) {
                None => reject(format!("no node {id}")),
                // A loading node is slow, not dead; an operator's state is kept.
                Some(NodeStatus::Up) => self.set_status(id, NodeStatus::Down),
                Some(_) => self.applied(),
            },
            Command::Drain { id } => match self.nodes.get(id).map(|n| n.status) {
                None => reject(format!("no node {id}")),
                Some(NodeStatus::Decommissioning) => {
                    reject(format!("{id} is being decommissioned"))
                }
                Some(_) => self.set_status(id, NodeStatus::Draining),
            },
            Command::Recommission { id } => match self.nodes.get(id).map(|n| n.status) {
                None => reject(format!("no node {id}")),
                Some(NodeStatus::Draining | NodeStatus::Decommissioning) => {
                    self.set_status(id, NodeStatus::Loading)
                }
                Some(s) => reject(format!("{id} is {s:?}, not drained")),
            },
            Command::Decommission { id } => match self.nodes.get(id) {
                None => reject(format!("no node {id}")),
                Some(_) => self.set_status(id, NodeStatus::Decommissioning),
            },
            Command::BeginMove { mv, expect_version } => self.begin_move(mv, *expect_version),
            Command::CompleteMove { id } => {
                let Some(mv) = self.moves.remove(id) else {
                    return reject(format!("no move {id}"));
                };
                let Some(to) = self.nodes.get_mut(&mv.to) else {
                    return reject(format!("move {id}: target {} is gone", mv.to));
                };
                to.experts.entry(mv.layer).or_default().insert(mv.expert);
                if let Some(from) = mv.from.as_ref().and_then(|f| self.nodes.get_mut(f)) {
                    if let Some(set) = from.experts.get_mut(&mv.layer) {
                        set.remove(&mv.expert);
                        if set.is_empty() {
                            from.experts.remove(&mv.layer);
                        }
                    }
                }
                self.bump()
            }
            Command::AbortMove { id } => match self.moves.remove(id) {
                Some(_) => self.bump(),
                None => reject(format!("no move {id}")),
            },
            Command::Remove { id } => {
                let Some(n) = self.nodes.get(id) else {
                    return reject(format!("no node {id}"));
                };
                let held: usize = n.experts.values().map(BTreeSet::len).sum();
                if held > 0 {
                    return reject(format!(
                        "{id} still holds {held} experts: decommission it first"
                    ));
                }
                if self
                    .moves
                    .values()
                    .any(|m| m.to == *id || m.from.as_deref() == Some(id))
                {
                    return reject(format!("{id} has moves in flight"));
                }
                self.nodes.remove(id);
                self.bump()
            }
            Command::Noop { .. } => self.applied(),
        }
    }

    fn applied(&self) -> Outcome {
        Outcome::Applied {
            placement_version: self.placement_version,
        }
    }

    fn bump(&mut self) -> Outcome {
        self.placement_version += 1;
        self.applied()
    }

    fn set_status(&mut self, id: &str, status: NodeStatus) -> Outcome {
        match self.nodes.get_mut(id) {
            Some(n) if n.status != status => {
                n.status = status;
                self.bump()
            }
            _ => self.applied(),
        }
    }

    fn seed(
        &mut self,
        bundle: &Option<String>,
        file: &ClusterFile,
        n_layer: u32,
        n_expert: u32,
    ) -> Outcome {
        if self.placement_version != 0 || !self.nodes.is_empty() {
            return reject("the cluster already has a placement");
        }
        let placement = match file.placement(n_layer as usize, n_expert as usize) {
            Ok(p) => p,
            Err(e) => return reject(e.to_string()),
        };
        self.bundle = bundle.clone().or_else(|| file.bundle.clone());
        self.coordinators = placement.coordinators.iter().cloned().collect();
        for n in &placement.nodes {
            let experts = n
                .experts
                .iter()
                .enumerate()
                .filter(|(_, s)| !s.is_empty())
                .map(|(l, s)| (l as u32, s.iter().map(|&e| e as u32).collect()))
                .collect();
            self.nodes.insert(
                n.id.clone(),
                NodeRecord {
                    raft_id: 0,
                    addr: n.addr.clone(),
                    caps: NodeCaps::default(),
                    status: NodeStatus::Loading,
                    last_heartbeat_ms: 0,
                    experts,
                },
            );
        }
        self.bump()
    }

    fn begin_move(&mut self, mv: &Move, expect_version: Option<u64>) -> Outcome {
        if let Some(v) = expect_version {
            if v != self.placement_version {
                return reject(format!(
                    "placement changed (version {} now, the plan was made at {v}): plan again",
                    self.placement_version
                ));
            }
        }
        let holds = |id: &str| {
            self.nodes
                .get(id)
                .and_then(|n| n.experts.get(&mv.layer))
                .is_some_and(|s| s.contains(&mv.expert))
        };
        match self.nodes.get(&mv.to) {
            None => return reject(format!("no node {}", mv.to)),
            Some(n) if n.status == NodeStatus::Decommissioning => {
                return reject(format!("{} is being decommissioned", mv.to))
            }
            Some(_) => {}
        }
        if holds(&mv.to) {
            return reject(format!(
                "{} already holds layer {} expert {}",
                mv.to, mv.layer, mv.expert
            ));
        }
        if let Some(from) = &mv.from {
            if !holds(from) {
                return reject(format!(
                    "{from} does not hold layer {} expert {}",
                    mv.layer, mv.expert
                ));
            }
        }
        if self
            .moves
            .values()
            .any(|m| m.layer == mv.layer && m.expert == mv.expert && m.to == mv.to)
        {
            return reject("the same move is already in flight");
        }
        let id = self.next_move;
        self.next_move += 1;
        self.moves.insert(id, mv.clone());
        self.placement_version += 1;
        Outcome::MoveStarted {
            id,
            placement_version: self.placement_version,
        }
    }

    /// The placement as a static cluster file, for the coordinator's router: only routable
    /// nodes, each expert listed once per holder.
    pub fn to_cluster_file(&self) -> ClusterFile {
        ClusterFile {
            coordinators: self.coordinators.iter().cloned().collect(),
            bundle: self.bundle.clone(),
            nodes: self
                .nodes
                .iter()
                .filter(|(_, n)| n.status.routable())
                .map(|(id, n)| NodeEntry {
                    id: id.clone(),
                    addr: n.addr.clone(),
                    experts: n
                        .experts
                        .iter()
                        .map(|(l, s)| {
                            let list: Vec<String> = s.iter().map(u32::to_string).collect();
                            format!("{l}:{}", list.join(","))
                        })
                        .collect(),
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file() -> ClusterFile {
        ClusterFile {
            coordinators: vec!["coordinator".into()],
            bundle: None,
            nodes: vec![
                NodeEntry {
                    id: "n1".into(),
                    addr: "127.0.0.1:7001".into(),
                    experts: vec!["0-1:0-3".into()],
                },
                NodeEntry {
                    id: "n2".into(),
                    addr: "127.0.0.1:7002".into(),
                    experts: vec!["0-1:2-7".into()],
                },
            ],
        }
    }

    fn seeded() -> ClusterState {
        let mut s = ClusterState::default();
        let out = s.apply(&Command::Seed {
            bundle: Some("abc".into()),
            file: file(),
            n_layer: 2,
            n_expert: 8,
        });
        assert_eq!(
            out,
            Outcome::Applied {
                placement_version: 1
            }
        );
        s
    }

    #[test]
    fn seed_then_route_only_to_up_nodes() {
        let mut s = seeded();
        assert!(
            s.to_cluster_file().nodes.is_empty(),
            "loading nodes are not routed to"
        );
        for id in ["n1", "n2"] {
            s.apply(&Command::Heartbeat {
                id: id.into(),
                at_ms: 5,
                loading: false,
            });
        }
        let p = s.to_cluster_file().placement(2, 8).unwrap();
        assert_eq!(p.holders(1, 3).len(), 2);
        assert_eq!(p.holders(1, 7).len(), 1);
        // A second seed is refused and changes nothing.
        let before = s.digest();
        assert!(matches!(
            s.apply(&Command::Seed {
                bundle: None,
                file: file(),
                n_layer: 2,
                n_expert: 8
            }),
            Outcome::Rejected(_)
        ));
        assert_eq!(before, s.digest());
    }

    #[test]
    fn a_move_switches_holders_and_a_stale_plan_is_refused() {
        let mut s = seeded();
        let v = s.placement_version;
        let mv = Move {
            layer: 0,
            expert: 7,
            from: Some("n2".into()),
            to: "n1".into(),
        };
        let stale = s.apply(&Command::BeginMove {
            mv: mv.clone(),
            expect_version: Some(v - 1),
        });
        assert!(matches!(stale, Outcome::Rejected(m) if m.contains("plan again")));
        let Outcome::MoveStarted { id, .. } = s.apply(&Command::BeginMove {
            mv,
            expect_version: Some(v),
        }) else {
            panic!("move refused")
        };
        assert!(
            s.nodes["n2"].experts[&0].contains(&7),
            "source keeps it until the switch"
        );
        s.apply(&Command::CompleteMove { id });
        assert!(s.nodes["n1"].experts[&0].contains(&7));
        assert!(!s.nodes["n2"].experts[&0].contains(&7));
        assert!(matches!(
            s.apply(&Command::CompleteMove { id }),
            Outcome::Rejected(_)
        ));
    }

    #[test]
    fn loading_is_not_down_and_operator_states_stick() {
        let mut s = seeded();
        s.apply(&Command::MarkDown { id: "n1".into() });
        assert_eq!(s.nodes["n1"].status, NodeStatus::Loading);
        s.apply(&Command::Heartbeat {
            id: "n1".into(),
            at_ms: 1,
            loading: false,
        });
        s.apply(&Command::MarkDown { id: "n1".into() });
        assert_eq!(s.nodes["n1"].status, NodeStatus::Down);
        s.apply(&Command::Drain { id: "n1".into() });
        s.apply(&Command::Heartbeat {
            id: "n1".into(),
            at_ms: 2,
            loading: false,
        });
        assert_eq!(s.nodes["n1"].status, NodeStatus::Draining);
        assert!(matches!(
            s.apply(&Command::Remove { id: "n1".into() }),
            Outcome::Rejected(m) if m.contains("holds")
        ));
    }

    #[test]
    fn commands_and_state_round_trip_and_bad_bytes_are_errors() {
        let s = seeded();
        assert_eq!(ClusterState::decode(&s.encode()).unwrap(), s);
        let c = Command::Noop { seq: 9 };
        assert_eq!(Command::decode(&c.encode()).unwrap(), c);
        assert!(Command::decode(b"").is_err());
        assert!(Command::decode(&[2, 0, 0, 0, b'{', b'}'])
            .unwrap_err()
            .contains("format 2"));
        assert!(Command::decode(&[1, 0, 0, 0, 0xff]).is_err());
    }
}
