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

/// The commands this build applies, as a level: 1 = the first control-plane release; 2 adds
/// `begin_moves`. A member of an older level rejects a command it cannot decode (its state
/// would part from the others'), so a command of a new level is proposed only once every
/// node registered at that level or above ([`ClusterState::min_level`]): the rolling
/// upgrade order is nodes first.
pub const COMMAND_LEVEL: u32 = 2;

/// Largest encoded command accepted (a seed placement of a 1,000-expert × 100-layer model fits).
pub const MAX_COMMAND_BYTES: usize = 16 << 20;

/// A node's lifecycle as the control plane sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeStatus {
    /// Registered, loading its experts (its heartbeats say so: a slow load is not a death).
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
    /// Its name as logs, the admin API and `ctl` print it.
    pub fn name(self) -> &'static str {
        match self {
            NodeStatus::Loading => "loading",
            NodeStatus::Up => "up",
            NodeStatus::Down => "down",
            NodeStatus::Draining => "draining",
            NodeStatus::Decommissioning => "decommissioning",
        }
    }

    /// Whether the node serves now.
    pub fn routable(self) -> bool {
        self == NodeStatus::Up
    }

    /// Whether the coordinator keeps the node among the holders of its experts: every state
    /// but an operator's drain or decommission. (A node loading or marked down by missed
    /// heartbeats stays a holder: the coordinator's own probe decides when to call it — a node
    /// the leader cannot hear may still answer the coordinator, and a loading one is used the
    /// moment it is ready, not a heartbeat later.)
    pub fn in_service(self) -> bool {
        !matches!(self, NodeStatus::Draining | NodeStatus::Decommissioning)
    }
}

/// What a node reports about itself when it registers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
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
    /// [`COMMAND_LEVEL`] of its build (absent: 1, a release before levels).
    #[serde(default = "first_level")]
    pub level: u32,
}

fn first_level() -> u32 {
    1
}

impl Default for NodeCaps {
    fn default() -> Self {
        NodeCaps {
            kernels: String::new(),
            cpu_features: Vec::new(),
            mem_bw_mbs: 0,
            ram_bytes: 0,
            disk_bytes: 0,
            level: first_level(),
        }
    }
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
    /// Its Raft applied index at its last heartbeat (`status` shows the lag behind the commit
    /// index from it; 0: not reported).
    #[serde(default)]
    pub applied: u64,
}

/// A coordinator's seat in the Raft group (a learner: it never votes).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeatRecord {
    pub raft_id: u64,
    /// QUIC `host:port` where the group reaches it.
    pub addr: String,
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
    /// The coordinators that joined the Raft group (learners), by id.
    #[serde(default)]
    pub seats: BTreeMap<String, SeatRecord>,
    pub nodes: BTreeMap<String, NodeRecord>,
    /// Bumped by every command that changes who holds what or who may be routed to.
    pub placement_version: u64,
    pub moves: BTreeMap<u64, Move>,
    pub next_move: u64,
}

/// The first word of a snapshot file.
pub const SNAPSHOT_MAGIC: &str = "ternfleet-snapshot";

impl Default for ClusterState {
    fn default() -> Self {
        ClusterState {
            format: FORMAT_VERSION,
            bundle: None,
            coordinators: BTreeSet::new(),
            seats: BTreeMap::new(),
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
    /// A coordinator of the placement takes a seat (a learner) or moves to a new address.
    RegisterCoordinator {
        id: String,
        raft_id: u64,
        addr: String,
    },
    /// A node is alive (`loading`: still loading its experts; `applied`: its Raft applied
    /// index).
    Heartbeat {
        id: String,
        at_ms: u64,
        loading: bool,
        #[serde(default)]
        applied: u64,
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
    /// Start a plan's moves at once (all or none; one placement version), guarded by the
    /// version the plan was made at.
    BeginMoves {
        moves: Vec<Move>,
        expect_version: Option<u64>,
    },
    /// The copy is on `to` and verified: switch holders.
    CompleteMove { id: u64 },
    /// Give a move up (copy failed, node gone).
    AbortMove { id: u64 },
    /// Remove a node that holds no experts.
    Remove { id: String },
    /// Operator: replace the state with a saved one (`ctl snapshot restore`), carried
    /// encoded ([`ClusterState::encode`]: a state's integer-keyed maps do not survive serde's
    /// buffering of an internally tagged enum). The placement version continues past both the
    /// saved and the current one (versions never go back).
    Restore { state: String },
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
    /// Applied: moves `first`, `first + 1`, … (`count` of them) started.
    MovesStarted {
        first: u64,
        count: u64,
        placement_version: u64,
    },
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

    /// The state as a snapshot file: one header line (`ternfleet-snapshot format=F
    /// sha256=HEX bytes=N`), then the encoded state.
    pub fn to_snapshot_file(&self) -> Vec<u8> {
        let body = self.encode();
        let sum = Sha256::digest(&body);
        let hex: String = sum.iter().map(|b| format!("{b:02x}")).collect();
        let mut out = format!(
            "{SNAPSHOT_MAGIC} format={} sha256={hex} bytes={}\n",
            self.format,
            body.len()
        )
        .into_bytes();
        out.extend(body);
        out
    }

    /// Reads [`ClusterState::to_snapshot_file`]'s output: the header, the length, the
    /// checksum and the format version checked.
    pub fn from_snapshot_file(b: &[u8]) -> Result<ClusterState, String> {
        let nl = b
            .iter()
            .take(256)
            .position(|&c| c == b'\n')
            .ok_or("not a ternfleet snapshot (no header line)")?;
        let header = std::str::from_utf8(&b[..nl]).map_err(|_| "not a ternfleet snapshot")?;
        let mut words = header.split(' ');
        if words.next() != Some(SNAPSHOT_MAGIC) {
            return Err("not a ternfleet snapshot".into());
        }
        let (mut format, mut sum, mut len) = (None, None, None);
        for w in words {
            match w.split_once('=') {
                Some(("format", v)) => format = v.parse::<u32>().ok(),
                Some(("sha256", v)) => sum = Some(v.to_string()),
                Some(("bytes", v)) => len = v.parse::<usize>().ok(),
                _ => return Err(format!("snapshot header: unknown field {w:?}")),
            }
        }
        let (Some(format), Some(sum), Some(len)) = (format, sum, len) else {
            return Err("snapshot header: format, sha256 and bytes are required".into());
        };
        if format != FORMAT_VERSION {
            return Err(format!(
                "snapshot format {format}, this build reads {FORMAT_VERSION}"
            ));
        }
        let body = &b[nl + 1..];
        if body.len() != len {
            return Err(format!(
                "snapshot truncated or padded: {} bytes, the header says {len}",
                body.len()
            ));
        }
        let got: String = Sha256::digest(body)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        if got != sum {
            return Err(format!(
                "snapshot checksum mismatch: sha256 {got}, the header says {sum}"
            ));
        }
        ClusterState::decode(body)
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
                                applied: 0,
                            },
                        );
                    }
                }
                self.bump()
            }
            Command::RegisterCoordinator { id, raft_id, addr } => {
                if !self.coordinators.contains(id) {
                    return reject(format!(
                        "{id} is not a coordinator of this cluster (the placement names {:?})",
                        self.coordinators
                    ));
                }
                if let Some(n) = self.nodes.iter().find(|(_, n)| n.raft_id == *raft_id) {
                    return reject(format!("raft id {raft_id} already belongs to node {}", n.0));
                }
                self.seats.insert(
                    id.clone(),
                    SeatRecord {
                        raft_id: *raft_id,
                        addr: addr.clone(),
                    },
                );
                self.applied()
            }
            Command::Heartbeat {
                id,
                at_ms,
                loading,
                applied,
            } => {
                let Some(n) = self.nodes.get_mut(id) else {
                    return reject(format!("no node {id}"));
                };
                n.last_heartbeat_ms = n.last_heartbeat_ms.max(*at_ms);
                n.applied = n.applied.max(*applied);
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
                // The leader proposes this after heartbeats stopped, and a loading node
                // heartbeats too (so a slow load is never taken for a death): a silent one is
                // down whether it was serving or loading. An operator's state is kept.
                Some(NodeStatus::Up | NodeStatus::Loading) => self.set_status(id, NodeStatus::Down),
                Some(_) => self.applied(),
            },
            Command::Drain { id } => match self.nodes.get(id).map(|n| n.status) {
                None => reject(format!("no node {id}")),
                Some(NodeStatus::Decommissioning) => {
                    reject(format!("{id} is being decommissioned"))
                }
                Some(_) => match self.sole_holder_of(id) {
                    Some(why) => reject(format!("draining {id} {why}")),
                    None => self.set_status(id, NodeStatus::Draining),
                },
            },
            Command::Recommission { id } => match self.nodes.get(id).map(|n| n.status) {
                None => reject(format!("no node {id}")),
                Some(NodeStatus::Draining | NodeStatus::Decommissioning) => {
                    self.set_status(id, NodeStatus::Loading)
                }
                Some(s) => reject(format!("{id} is {s:?}, not drained")),
            },
            // Allowed while the node is the only holder of some experts: it keeps serving
            // those ([`ClusterState::to_cluster_file`]) until moves have copied them
            // elsewhere, then it is removed.
            Command::Decommission { id } => match self.nodes.get(id) {
                None => reject(format!("no node {id}")),
                Some(_) => self.set_status(id, NodeStatus::Decommissioning),
            },
            Command::BeginMove { mv, expect_version } => self.begin_move(mv, *expect_version),
            Command::BeginMoves {
                moves,
                expect_version,
            } => {
                if let Some(v) = expect_version.filter(|v| *v != self.placement_version) {
                    return reject(format!(
                        "placement changed (version {} now, the plan was made at {v}): plan again",
                        self.placement_version
                    ));
                }
                let mut next = self.clone();
                let first = next.next_move;
                for mv in moves {
                    if let Outcome::Rejected(why) = next.begin_move(mv, None) {
                        return reject(format!(
                            "layer {} expert {} to {}: {why} (no move started)",
                            mv.layer, mv.expert, mv.to
                        ));
                    }
                }
                next.placement_version = self.placement_version + 1;
                *self = next;
                Outcome::MovesStarted {
                    first,
                    count: moves.len() as u64,
                    placement_version: self.placement_version,
                }
            }
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
                // A decommissioned node goes once every expert it holds has a holder in
                // service elsewhere.
                let covered =
                    n.status == NodeStatus::Decommissioning && self.sole_holder_of(id).is_none();
                if held > 0 && !covered {
                    return reject(match n.status {
                        NodeStatus::Decommissioning => format!(
                            "{id} is the only holder of some of its {held} experts: let the re-replicating moves finish"
                        ),
                        _ => format!("{id} still holds {held} experts: decommission it first"),
                    });
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
            Command::Restore { state } => {
                let mut state = match ClusterState::decode(state.as_bytes()) {
                    Ok(s) => s,
                    Err(e) => return reject(e),
                };
                // The placement comes back (who holds what, operators' statuses, moves, the
                // bundle); where a member is registered now, its registration (address, Raft
                // id, capacity, last heartbeat) stays: the snapshot's addresses may be gone.
                for (id, n) in state.nodes.iter_mut() {
                    if let Some(cur) = self.nodes.get(id) {
                        n.addr.clone_from(&cur.addr);
                        n.raft_id = cur.raft_id;
                        n.caps = cur.caps.clone();
                        n.last_heartbeat_ms = cur.last_heartbeat_ms;
                    }
                }
                for (id, seat) in &self.seats {
                    state.seats.insert(id.clone(), seat.clone());
                }
                let version = self.placement_version.max(state.placement_version) + 1;
                *self = state;
                self.placement_version = version;
                self.applied()
            }
            Command::Noop { .. } => self.applied(),
        }
    }

    /// Why taking `id` out of service would leave an expert with no holder in service, if it
    /// would (the first layer where it does).
    fn sole_holder_of(&self, id: &str) -> Option<String> {
        let (l, alone) = self.sole_held(id).into_iter().next()?;
        Some(no_holder(l, &alone))
    }

    /// The lowest command level among the registered nodes (a seeded node not registered
    /// yet counts as level 1), and a node at it.
    pub fn min_level(&self) -> Option<(u32, &str)> {
        self.nodes
            .iter()
            .map(|(id, n)| (n.caps.level, id.as_str()))
            .min()
    }

    /// The member (id, QUIC address) with this Raft id: a node or a coordinator's seat.
    pub fn raft_member(&self, raft_id: u64) -> Option<(String, String)> {
        let node = self.nodes.iter().map(|(id, n)| (id, n.raft_id, &n.addr));
        let seat = self.seats.iter().map(|(id, c)| (id, c.raft_id, &c.addr));
        node.chain(seat)
            .find(|(_, r, _)| *r == raft_id)
            .map(|(id, _, addr)| (id.clone(), addr.clone()))
    }

    /// Whether this Raft id is a coordinator's seat (a learner that is never promoted).
    pub fn is_seat(&self, raft_id: u64) -> bool {
        self.seats.values().any(|c| c.raft_id == raft_id)
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
                    applied: 0,
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

    /// Why taking `id` out of service now would leave experts with no *live* holder, if it
    /// would: experts whose other holders in service are all marked down (missed
    /// heartbeats). The state machine's own check ([`Command::Drain`]) counts a down node as
    /// a holder (it may come back, and replicas applying a command must not depend on
    /// timing); the admin API checks this too before proposing a drain or decommission, so
    /// an operator does not uncover experts while another holder is cut off.
    ///
    /// `keeps_sole`: the node keeps serving the experts no other node in service holds (a
    /// decommission), so only experts whose other holders are all down count.
    pub fn uncovered_without(&self, id: &str, keeps_sole: bool) -> Option<String> {
        let sole = self.held_alone(id, false);
        let (l, alone) = self
            .held_alone(id, true)
            .into_iter()
            .find_map(|(l, mut es)| {
                if keeps_sole {
                    es.retain(|e| !sole.get(&l).is_some_and(|s| s.contains(e)));
                }
                (!es.is_empty()).then_some((l, es))
            })?;
        let down: Vec<&str> = self
            .nodes
            .iter()
            .filter(|(o, m)| {
                o.as_str() != id
                    && m.status == NodeStatus::Down
                    && m.experts
                        .get(&l)
                        .is_some_and(|s| alone.iter().any(|e| s.contains(e)))
            })
            .map(|(o, _)| o.as_str())
            .collect();
        Some(if down.is_empty() {
            no_holder(l, &alone)
        } else {
            format!(
                "would leave layer {l} experts {:?} with no live holder ({} marked down): bring {} back or place replicas elsewhere first",
                alone.iter().collect::<Vec<_>>(),
                down.join(", "),
                if down.len() == 1 { "it" } else { "them" }
            )
        })
    }

    /// The experts of node `id` that no other node in service holds.
    fn sole_held(&self, id: &str) -> BTreeMap<u32, BTreeSet<u32>> {
        self.held_alone(id, false)
    }

    /// The experts of node `id` that no other node in service holds (`live`: no other node
    /// in service and not marked down).
    fn held_alone(&self, id: &str, live: bool) -> BTreeMap<u32, BTreeSet<u32>> {
        let Some(n) = self.nodes.get(id) else {
            return BTreeMap::new();
        };
        n.experts
            .iter()
            .map(|(l, es)| {
                let alone = es
                    .iter()
                    .copied()
                    .filter(|e| {
                        !self.nodes.iter().any(|(o, m)| {
                            o != id
                                && m.status.in_service()
                                && (!live || m.status != NodeStatus::Down)
                                && m.experts.get(l).is_some_and(|s| s.contains(e))
                        })
                    })
                    .collect::<BTreeSet<u32>>();
                (*l, alone)
            })
            .filter(|(_, s)| !s.is_empty())
            .collect()
    }

    /// The placement as a static cluster file, for the coordinator's router: the nodes in
    /// service ([`NodeStatus::in_service`]), each expert listed once per holder; a node being
    /// decommissioned with the experts only it holds (until moves re-replicate them).
    pub fn to_cluster_file(&self) -> ClusterFile {
        let listed = |id: &str, n: &NodeRecord| -> Option<BTreeMap<u32, BTreeSet<u32>>> {
            match n.status {
                NodeStatus::Decommissioning => Some(self.sole_held(id)).filter(|m| !m.is_empty()),
                s if s.in_service() => Some(n.experts.clone()),
                _ => None,
            }
        };
        ClusterFile {
            coordinators: self.coordinators.iter().cloned().collect(),
            bundle: self.bundle.clone(),
            nodes: self
                .nodes
                .iter()
                .filter_map(|(id, n)| listed(id, n).map(|ex| (id, n, ex)))
                .map(|(id, n, experts)| NodeEntry {
                    id: id.clone(),
                    addr: n.addr.clone(),
                    experts: experts
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

/// Why an operator's command is refused when it would leave layer `l`'s experts `alone` on
/// no node in service.
fn no_holder(l: u32, alone: &BTreeSet<u32>) -> String {
    format!(
        "would leave layer {l} experts {:?} on no node in service: place replicas elsewhere first",
        alone.iter().collect::<Vec<_>>()
    )
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

    /// Node `id` holds all 8 experts of both layers (as if moves had brought them).
    fn hold_every_expert(s: &mut ClusterState, id: &str) {
        for l in 0..2 {
            s.nodes
                .get_mut(id)
                .unwrap()
                .experts
                .insert(l, (0..8).collect());
        }
    }

    #[test]
    fn a_drain_that_leaves_only_down_holders_is_named() {
        let mut s = seeded();
        hold_every_expert(&mut s, "n1");
        let beat = |s: &mut ClusterState, id: &str| {
            s.apply(&Command::Heartbeat {
                id: id.into(),
                at_ms: 5,
                loading: false,
                applied: 0,
            });
        };
        beat(&mut s, "n1");
        beat(&mut s, "n2");
        // n1 holds everything n2 does: n2 may go, n1 may not (experts 0 and 1 are its alone).
        assert_eq!(s.uncovered_without("n2", false), None);
        let why = s.uncovered_without("n1", false).unwrap();
        assert!(
            why.contains("layer 0 experts [0, 1] on no node in service"),
            "{why}"
        );
        // A decommission keeps serving what only it holds.
        assert_eq!(s.uncovered_without("n1", true), None);
        // n1 cut off: the state machine still counts it, the admin's check does not.
        s.apply(&Command::MarkDown { id: "n1".into() });
        for keeps_sole in [false, true] {
            let why = s.uncovered_without("n2", keeps_sole).unwrap();
            assert!(
                why.contains(
                    "layer 0 experts [2, 3, 4, 5, 6, 7] with no live holder (n1 marked down)"
                ),
                "{why}"
            );
        }
        assert_eq!(s.sole_holder_of("n2"), None);
        beat(&mut s, "n1");
        assert_eq!(s.uncovered_without("n2", false), None);
        assert_eq!(s.uncovered_without("nope", false), None);
    }

    #[test]
    fn seed_then_route_to_nodes_in_service() {
        let mut s = seeded();
        // Loading nodes stay holders (the coordinator's probe decides when to call them).
        let p = s.to_cluster_file().placement(2, 8).unwrap();
        assert_eq!(p.holders(1, 3).len(), 2);
        assert_eq!(p.holders(1, 7).len(), 1);
        for id in ["n1", "n2"] {
            s.apply(&Command::Heartbeat {
                id: id.into(),
                at_ms: 5,
                loading: false,
                applied: 0,
            });
        }
        // A drain that would leave experts on no node in service is refused; once n1 holds
        // replicas of n2's experts, n2 drains and leaves the routing file.
        let refused = s.apply(&Command::Drain { id: "n2".into() });
        assert!(
            matches!(&refused, Outcome::Rejected(m) if m.contains("layer 0 experts [4, 5, 6, 7]")),
            "{refused:?}"
        );
        for e in 4..8 {
            let Outcome::MoveStarted { id, .. } = s.apply(&Command::BeginMove {
                mv: Move {
                    layer: 0,
                    expert: e,
                    from: None,
                    to: "n1".into(),
                },
                expect_version: None,
            }) else {
                panic!("move refused")
            };
            s.apply(&Command::CompleteMove { id });
        }
        assert!(matches!(
            s.apply(&Command::Drain { id: "n2".into() }),
            Outcome::Rejected(m) if m.contains("layer 1")
        ));
        hold_every_expert(&mut s, "n1");
        assert!(matches!(
            s.apply(&Command::Drain { id: "n2".into() }),
            Outcome::Applied { .. }
        ));
        let f = s.to_cluster_file();
        assert_eq!(f.nodes.len(), 1);
        assert_eq!(f.placement(2, 8).unwrap().holders(1, 7), &[0]);
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
    fn coordinators_take_seats_and_only_named_ones() {
        let mut s = seeded();
        s.apply(&Command::Register {
            id: "n1".into(),
            raft_id: 11,
            addr: "127.0.0.1:7001".into(),
            caps: NodeCaps::default(),
        });
        let seat = |id: &str, raft_id| Command::RegisterCoordinator {
            id: id.into(),
            raft_id,
            addr: "127.0.0.1:7500".into(),
        };
        assert!(
            matches!(s.apply(&seat("intruder", 5)), Outcome::Rejected(m) if m.contains("not a coordinator"))
        );
        assert!(
            matches!(s.apply(&seat("coordinator", 11)), Outcome::Rejected(m) if m.contains("node n1"))
        );
        let v = s.placement_version;
        assert!(
            matches!(s.apply(&seat("coordinator", 5)), Outcome::Applied { placement_version } if placement_version == v)
        );
        assert!(s.is_seat(5) && !s.is_seat(11));
        assert_eq!(
            s.raft_member(5),
            Some(("coordinator".into(), "127.0.0.1:7500".into()))
        );
        assert_eq!(
            s.raft_member(11),
            Some(("n1".into(), "127.0.0.1:7001".into()))
        );
        assert_eq!(ClusterState::decode(&s.encode()).unwrap(), s);
    }

    #[test]
    fn a_decommissioned_node_serves_what_only_it_holds_until_moves_take_it_then_goes() {
        let mut s = seeded();
        // n1 alone holds experts 0 and 1 of both layers; 2 and 3 are on n2 too.
        assert!(matches!(
            s.apply(&Command::Decommission { id: "n1".into() }),
            Outcome::Applied { .. }
        ));
        assert_eq!(s.nodes["n1"].status, NodeStatus::Decommissioning);
        let f = s.to_cluster_file();
        let n1 = f.nodes.iter().find(|n| n.id == "n1").unwrap();
        assert_eq!(n1.experts, ["0:0,1", "1:0,1"]);
        assert!(matches!(
            s.apply(&Command::Remove { id: "n1".into() }),
            Outcome::Rejected(m) if m.contains("only holder")
        ));
        for l in 0..2 {
            for e in 0..2 {
                let mv = Move {
                    layer: l,
                    expert: e,
                    from: Some("n1".into()),
                    to: "n2".into(),
                };
                let id = match s.apply(&Command::BeginMove {
                    mv,
                    expect_version: None,
                }) {
                    Outcome::MoveStarted { id, .. } => id,
                    o => panic!("{o:?}"),
                };
                s.apply(&Command::CompleteMove { id });
            }
        }
        // Nothing only it holds: out of the routing, and removable (its copies of 2 and 3
        // are covered by n2).
        assert!(s.to_cluster_file().nodes.iter().all(|n| n.id != "n1"));
        assert!(matches!(
            s.apply(&Command::Remove { id: "n1".into() }),
            Outcome::Applied { .. }
        ));
        assert!(!s.nodes.contains_key("n1"));
    }

    #[test]
    fn a_plans_moves_start_all_or_none_at_one_version() {
        let mut s = seeded();
        let mv = |e: u32, to: &str| Move {
            layer: 0,
            expert: e,
            from: Some("n1".into()),
            to: to.into(),
        };
        let v = s.placement_version;
        // The second is bad (n1 already holds expert 2): nothing starts.
        let bad = Command::BeginMoves {
            moves: vec![mv(0, "n2"), mv(2, "n1")],
            expect_version: Some(v),
        };
        assert!(matches!(s.apply(&bad), Outcome::Rejected(m) if m.contains("no move started")));
        assert!(s.moves.is_empty());
        assert_eq!(s.placement_version, v);
        let good = Command::BeginMoves {
            moves: vec![mv(0, "n2"), mv(1, "n2")],
            expect_version: Some(v),
        };
        let good = Command::decode(&good.encode()).unwrap();
        assert_eq!(
            s.apply(&good),
            Outcome::MovesStarted {
                first: 1,
                count: 2,
                placement_version: v + 1
            }
        );
        assert_eq!(s.moves.len(), 2);
        // Planned at a version since gone: refused.
        assert!(matches!(s.apply(&good), Outcome::Rejected(m) if m.contains("plan again")));
    }

    #[test]
    fn loading_is_not_down_and_operator_states_stick() {
        let mut s = seeded();
        // n2 holds a replica of everything n1 does, so n1 may be drained.
        s.nodes.get_mut("n2").unwrap().experts = (0..2).map(|l| (l, (0..8).collect())).collect();
        // Silent while loading (it would have heartbeated "loading"): down too.
        s.apply(&Command::MarkDown { id: "n1".into() });
        assert_eq!(s.nodes["n1"].status, NodeStatus::Down);
        s.apply(&Command::Heartbeat {
            id: "n1".into(),
            at_ms: 1,
            loading: false,
            applied: 0,
        });
        s.apply(&Command::MarkDown { id: "n1".into() });
        assert_eq!(s.nodes["n1"].status, NodeStatus::Down);
        s.apply(&Command::Drain { id: "n1".into() });
        s.apply(&Command::Heartbeat {
            id: "n1".into(),
            at_ms: 2,
            loading: false,
            applied: 0,
        });
        assert_eq!(s.nodes["n1"].status, NodeStatus::Draining);
        assert!(matches!(
            s.apply(&Command::Remove { id: "n1".into() }),
            Outcome::Rejected(m) if m.contains("holds")
        ));
    }

    #[test]
    fn snapshot_files_round_trip_and_damage_is_named_and_restore_moves_versions_on() {
        let s = seeded();
        let f = s.to_snapshot_file();
        assert_eq!(ClusterState::from_snapshot_file(&f).unwrap(), s);
        let mut flipped = f.clone();
        let last = flipped.len() - 2;
        flipped[last] ^= 1;
        assert!(ClusterState::from_snapshot_file(&flipped)
            .unwrap_err()
            .contains("checksum"));
        assert!(ClusterState::from_snapshot_file(&f[..f.len() - 1])
            .unwrap_err()
            .contains("truncated"));
        let text = String::from_utf8(f.clone()).unwrap();
        let v2 = text.replacen("format=1", "format=9", 1);
        assert!(ClusterState::from_snapshot_file(v2.as_bytes())
            .unwrap_err()
            .contains("format 9"));
        assert!(ClusterState::from_snapshot_file(b"hello\n{}").is_err());
        // Restored into a cluster that moved on: the same state, a later version.
        let mut other = seeded();
        other.nodes.get_mut("n1").unwrap().addr = "10.0.0.1:7400".into();
        other.nodes.get_mut("n1").unwrap().experts.clear();
        for _ in 0..4 {
            other.bump();
        }
        let cmd = Command::Restore {
            state: String::from_utf8(s.encode()).unwrap(),
        };
        let cmd = Command::decode(&cmd.encode()).unwrap();
        other.apply(&cmd);
        // The saved placement, the current address.
        assert_eq!(other.nodes["n1"].experts, s.nodes["n1"].experts);
        assert_eq!(other.nodes["n1"].addr, "10.0.0.1:7400");
        assert_eq!(other.nodes["n2"], s.nodes["n2"]);
        assert_eq!(other.placement_version, 6);
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
