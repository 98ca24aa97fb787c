//! One member of the Raft group: a raft-rs `RawNode` over the durable [`RaftStore`], the
//! replicated [`ClusterState`], and the `Ready` handling. No sockets, no clock: the caller
//! feeds ticks and received message bytes in and hands the bytes this gives out to its
//! transport, so the same code runs over QUIC and inside the simulation tests.
//!
//! # The order a `Ready` is handled in (raft-rs `src/lib.rs`, "Processing the Ready State")
//!
//! 1. `messages`: a leader's appends and heartbeats may leave before its own log is durable;
//! 2. persist, in one transaction, the `snapshot` (a follower catching up: it replaces the
//!    state machine and the log), the new `entries` and the `HardState`;
//! 3. only then send `persisted_messages` (votes and append acknowledgements promise what is
//!    now on disk);
//! 4. apply `committed_entries` to the state machine and persist it with its applied index in
//!    one transaction (their commit index was persisted in step 2 or, for a `LightReady`, just
//!    before: applied never exceeds a durable commit);
//! 5. `advance`; then the `LightReady`: persist its commit index, send its messages, apply its
//!    committed entries as in 4, `advance_apply`;
//! 6. release the linearizable reads whose read index is now applied, compact the log.
//!
//! Reads are linearizable through ReadIndex (raft-rs `ReadOnlyOption::Safe`): the leader
//! confirms it is still leader with a heartbeat round before a read is served, no clock bound
//! assumed.

use protobuf::Message as _;
use raft::prelude::{
    ConfChange, ConfChangeType, ConfChangeV2, ConfState, Entry, EntryType, Message, MessageType,
    Snapshot,
};
use raft::{RawNode, ReadOnlyOption, StateRole, Storage};

use crate::state::{ClusterState, Command, Outcome};
use crate::store::{RaftStore, StoreError};

/// Largest Raft message accepted from a peer (a snapshot of a large placement fits).
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// Settings of one member.
#[derive(Clone, Debug)]
pub struct ReplicaConfig {
    /// Raft id, unique in the group, not 0.
    pub id: u64,
    /// Ticks without a leader before a follower campaigns (randomised up to twice this).
    pub election_tick: usize,
    /// Ticks between a leader's heartbeats.
    pub heartbeat_tick: usize,
    /// Compact the log once it holds this many applied entries, keeping the last quarter of
    /// them (a follower a little behind then catches up from the log, not from a snapshot).
    pub compact_after: u64,
    /// Use this election timeout (ticks, at least `election_tick`) instead of one raft-rs draws
    /// from its thread-local RNG: simulation tests give each member its own from their seed,
    /// so a seed replays exactly.
    pub fixed_election_timeout: Option<usize>,
    /// First proposal sequence number of this incarnation (`None`: the wall clock in
    /// nanoseconds, which no earlier incarnation's sequences reach); tests give one from
    /// their seed.
    pub seq_base: Option<u64>,
}

impl ReplicaConfig {
    pub fn new(id: u64) -> ReplicaConfig {
        ReplicaConfig {
            id,
            election_tick: 10,
            heartbeat_tick: 3,
            compact_after: 1024,
            fixed_election_timeout: None,
            seq_base: None,
        }
    }
}

/// Errors of a member.
#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("raft: {0}")]
    Raft(#[from] raft::Error),
    #[error("not the leader (leader: {})", leader.map_or("unknown".into(), |l| l.to_string()))]
    NotLeader { leader: Option<u64> },
    #[error("bad message from a peer: {0}")]
    BadMessage(String),
    /// A simulated crash ([`Stage`]): the member must be dropped and reopened from its store.
    #[error("crashed at {0:?} (simulated)")]
    Crashed(Stage),
}

/// Points in the `Ready` handling where a simulation crashes a member.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// After the leader's early messages went out, before persisting.
    BeforePersist,
    /// After persisting, before the persisted messages went out.
    AfterPersist,
    /// After the persisted messages (votes, acknowledgements) went out, before applying.
    AfterSend,
    /// Committed entries applied in memory, their state not yet saved.
    MidApply,
    /// State saved, before `advance`.
    BeforeAdvance,
}

/// Identifies a proposal: the proposer's Raft id and a sequence number unique across its
/// restarts (each incarnation counts up from its own base, [`ReplicaConfig::seq_base`]).
/// Without that, a restarted member's waiter could be answered with the outcome of a command
/// its previous incarnation proposed (the simulation found this when sequences restarted at
/// 1).
pub type ProposalId = (u64, u64);

/// One applied log entry.
#[derive(Clone, Debug)]
pub struct Applied {
    pub index: u64,
    pub term: u64,
    /// The command (`None`: an empty or membership entry).
    pub command: Option<Command>,
    pub outcome: Outcome,
    /// Set when this member proposed it.
    pub proposal: Option<ProposalId>,
}

/// What one round of [`Replica::handle_ready`] produced.
#[derive(Debug, Default)]
pub struct Output {
    pub applied: Vec<Applied>,
    /// Read ids now safe to serve from [`Replica::state`].
    pub reads: Vec<u64>,
}

/// A member's view, for status and checks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaStatus {
    pub id: u64,
    pub role: StateRole,
    pub term: u64,
    pub leader: Option<u64>,
    pub commit: u64,
    pub applied: u64,
    pub voters: Vec<u64>,
    pub learners: Vec<u64>,
}

/// One Raft member and its state machine.
pub struct Replica {
    node: RawNode<RaftStore>,
    store: RaftStore,
    state: ClusterState,
    conf: ConfState,
    applied: u64,
    applied_term: u64,
    next_seq: u64,
    /// (read id, read index) confirmed by the leader, waiting for apply.
    reads: Vec<(u64, u64)>,
    compact_after: u64,
    /// A membership change removed this member: it takes no further part (raft-rs has no
    /// step-down for a leader removing itself; TiKV likewise destroys a removed peer).
    removed: bool,
}

/// An entry's context: the proposer's Raft id and sequence number.
fn encode_ctx((id, seq): ProposalId) -> Vec<u8> {
    let mut v = id.to_le_bytes().to_vec();
    v.extend(seq.to_le_bytes());
    v
}

fn decode_ctx(b: &[u8]) -> Option<ProposalId> {
    let (a, rest) = b.split_first_chunk::<8>()?;
    let b = rest.first_chunk::<8>()?;
    (rest.len() == 8).then(|| (u64::from_le_bytes(*a), u64::from_le_bytes(*b)))
}

impl Replica {
    /// Writes the first membership (`voters`) into an empty store: the `--init-cluster` member
    /// (with itself alone) or every member of a fixed group.
    pub fn bootstrap(store: &RaftStore, voters: &[u64]) -> Result<(), ReplicaError> {
        store.bootstrap(ConfState::from((voters.to_vec(), vec![])))?;
        Ok(())
    }

    /// Opens a member on its store: the state machine and applied index as last persisted.
    pub fn open(cfg: &ReplicaConfig, store: RaftStore) -> Result<Replica, ReplicaError> {
        let (state, applied, applied_term, conf) = store.applied()?;
        let commit = store.hard_state().commit;
        if applied > commit {
            return Err(StoreError::Invalid(format!(
                "applied index {applied} is past the durable commit {commit}"
            ))
            .into());
        }
        let mut config = raft::Config {
            id: cfg.id,
            election_tick: cfg.election_tick,
            heartbeat_tick: cfg.heartbeat_tick,
            applied,
            check_quorum: true,
            pre_vote: true,
            read_only_option: ReadOnlyOption::Safe,
            max_size_per_msg: 1 << 20,
            max_inflight_msgs: 256,
            ..Default::default()
        };
        if let Some(t) = cfg.fixed_election_timeout {
            config.min_election_tick = t.max(cfg.election_tick);
            config.max_election_tick = config.min_election_tick + 1;
        }
        config.validate()?;
        let logger = crate::slog_tracing::logger(cfg.id);
        let node = RawNode::new(&config, store.clone(), &logger)?;
        // A member whose store holds a cluster that no longer lists it was removed.
        let removed = store.initialized()
            && !conf.voters.contains(&cfg.id)
            && !conf.learners.contains(&cfg.id)
            && !conf.voters_outgoing.contains(&cfg.id);
        Ok(Replica {
            node,
            store,
            state,
            conf,
            applied,
            applied_term,
            next_seq: cfg.seq_base.unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(1, |d| d.as_nanos() as u64)
            }),
            reads: Vec::new(),
            compact_after: cfg.compact_after.max(1),
            removed,
        })
    }

    /// The applied state machine.
    pub fn state(&self) -> &ClusterState {
        &self.state
    }

    /// The store (to reopen it after a crash, and for checks).
    pub fn store(&self) -> &RaftStore {
        &self.store
    }

    pub fn id(&self) -> u64 {
        self.node.raft.id
    }

    pub fn status(&self) -> ReplicaStatus {
        let r = &self.node.raft;
        ReplicaStatus {
            id: r.id,
            role: r.state,
            term: r.term,
            leader: (r.leader_id != raft::INVALID_ID).then_some(r.leader_id),
            commit: r.raft_log.committed,
            applied: self.applied,
            voters: self.conf.voters.clone(),
            learners: self.conf.learners.clone(),
        }
    }

    pub fn is_leader(&self) -> bool {
        !self.removed && self.node.raft.state == StateRole::Leader
    }

    /// Whether an applied membership change removed this member (it must stop: its store
    /// keeps what it had, and it never takes part again under this id).
    pub fn removed(&self) -> bool {
        self.removed
    }

    /// One logical clock tick.
    pub fn tick(&mut self) {
        if !self.removed {
            self.node.tick();
        }
    }

    /// Feeds a message received from a peer (its bytes as sent).
    pub fn step(&mut self, bytes: &[u8]) -> Result<(), ReplicaError> {
        if self.removed {
            return Ok(());
        }
        if bytes.len() > MAX_MESSAGE_BYTES {
            return Err(ReplicaError::BadMessage(format!(
                "{} bytes, the limit is {MAX_MESSAGE_BYTES}",
                bytes.len()
            )));
        }
        let msg = Message::parse_from_bytes(bytes)
            .map_err(|e| ReplicaError::BadMessage(e.to_string()))?;
        if msg.to != self.id() {
            return Err(ReplicaError::BadMessage(format!(
                "addressed to {}, this member is {}",
                msg.to,
                self.id()
            )));
        }
        if raft::raw_node::is_local_msg(msg.get_msg_type()) {
            return Err(ReplicaError::BadMessage(format!(
                "{:?} is a local message type",
                msg.get_msg_type()
            )));
        }
        // A snapshot's state is checked before raft-rs takes it: once stepped it would be in
        // the next Ready, and a state that does not decode could then only stop this member.
        if msg.get_msg_type() == MessageType::MsgSnapshot {
            ClusterState::decode(&msg.get_snapshot().data).map_err(|e| {
                ReplicaError::BadMessage(format!("snapshot from {}: {e}", msg.from))
            })?;
        }
        match self.node.step(msg) {
            // A message for a peer this member no longer knows (removed, or not yet added), or
            // a proposal forwarded to a member that no longer leads (its proposer times out).
            Err(raft::Error::StepPeerNotFound)
            | Err(raft::Error::StepLocalMsg)
            | Err(raft::Error::ProposalDropped) => Ok(()),
            r => Ok(r?),
        }
    }

    fn not_leader(&self) -> ReplicaError {
        let l = self.node.raft.leader_id;
        ReplicaError::NotLeader {
            leader: (l != raft::INVALID_ID).then_some(l),
        }
    }

    /// Proposes a command; a follower forwards it to the leader. Its [`Applied`] carries the
    /// returned id once committed and applied here. A proposal may be lost (leadership changes
    /// before it commits, the forward is dropped): the caller times out and retries.
    pub fn propose(&mut self, cmd: &Command) -> Result<ProposalId, ReplicaError> {
        if self.removed || self.node.raft.leader_id == raft::INVALID_ID {
            return Err(self.not_leader());
        }
        let id = (self.id(), self.next_seq);
        self.next_seq += 1;
        self.node.propose(encode_ctx(id), cmd.encode())?;
        Ok(id)
    }

    /// Proposes a membership change (on the leader).
    pub fn propose_conf_change(&mut self, cc: ConfChangeV2) -> Result<ProposalId, ReplicaError> {
        if !self.is_leader() {
            return Err(self.not_leader());
        }
        let id = (self.id(), self.next_seq);
        self.next_seq += 1;
        self.node.propose_conf_change(encode_ctx(id), cc)?;
        Ok(id)
    }

    /// Asks for a linearizable read: `id` comes back in [`Output::reads`] once the state
    /// reflects every write committed before the request.
    pub fn read_index(&mut self, id: u64) {
        self.node.read_index(id.to_le_bytes().to_vec());
    }

    /// On the leader, with no membership change pending: a learner whose log has caught up
    /// with the commit index (within `slack` entries), ready to become a voter. A
    /// coordinator's seat stays a learner (voters are nodes: a coordinator's restart never
    /// touches the quorum).
    pub fn learner_to_promote(&self, slack: u64) -> Option<u64> {
        let r = &self.node.raft;
        if r.state != StateRole::Leader || r.pending_conf_index > self.applied {
            return None;
        }
        let commit = r.raft_log.committed;
        self.conf
            .learners
            .iter()
            .copied()
            .filter(|&id| !self.state.is_seat(id))
            .find(|&id| r.prs().get(id).is_some_and(|p| p.matched + slack >= commit))
    }

    /// The transport's word on a snapshot sent to `to`: delivered or lost.
    pub fn report_snapshot(&mut self, to: u64, delivered: bool) {
        let status = if delivered {
            raft::SnapshotStatus::Finish
        } else {
            raft::SnapshotStatus::Failure
        };
        self.node.report_snapshot(to, status);
    }

    /// The transport could not reach `to` (its connection failed): raft-rs slows down to probing.
    pub fn report_unreachable(&mut self, to: u64) {
        self.node.report_unreachable(to);
    }

    /// Campaigns at once (a single-member group on start, tests).
    pub fn campaign(&mut self) -> Result<(), ReplicaError> {
        Ok(self.node.campaign()?)
    }

    /// Handles what raft-rs has ready, in the order written at the top of this file; `send`
    /// gets each outgoing message (peer id, bytes) as soon as it may leave. `crash_at` stops at
    /// that point with [`ReplicaError::Crashed`] (simulation tests only).
    pub fn handle_ready(
        &mut self,
        send: &mut dyn FnMut(Outgoing),
        crash_at: Option<Stage>,
    ) -> Result<Output, ReplicaError> {
        let mut out = Output::default();
        if self.removed || !self.node.has_ready() {
            return Ok(out);
        }
        let crash = |s: Stage| match crash_at {
            Some(c) if c == s => Err(ReplicaError::Crashed(s)),
            _ => Ok(()),
        };
        let mut rd = self.node.ready();
        // 1. A leader's messages.
        send_all(rd.take_messages(), send);
        crash(Stage::BeforePersist)?;
        // 2. Snapshot, entries and hard state, durable together.
        let snapshot = (!rd.snapshot().is_empty()).then(|| rd.snapshot().clone());
        self.store
            .persist(snapshot.as_ref(), rd.entries(), rd.hs())?;
        if let Some(s) = &snapshot {
            self.restore(s)?;
        }
        crash(Stage::AfterPersist)?;
        // 3. Messages that promise what is now durable.
        send_all(rd.take_persisted_messages(), send);
        crash(Stage::AfterSend)?;
        // 4. Committed entries.
        for r in rd.take_read_states() {
            if let Some(id) = r.request_ctx.first_chunk::<8>() {
                self.reads.push((u64::from_le_bytes(*id), r.index));
            }
        }
        let committed = rd.take_committed_entries();
        self.apply(committed, &mut out, crash_at)?;
        if self.removed {
            // Advancing would have raft-rs look up this member's own progress, which the
            // change removed (a leader removing itself panics there).
            return Ok(out);
        }
        crash(Stage::BeforeAdvance)?;
        // 5. Advance, then what became ready by it.
        let mut light = self.node.advance(rd);
        if let Some(commit) = light.commit_index() {
            self.store.set_commit(commit)?;
        }
        send_all(light.take_messages(), send);
        let committed = light.take_committed_entries();
        self.apply(committed, &mut out, crash_at)?;
        if self.removed {
            return Ok(out);
        }
        self.node.advance_apply();
        // 6. Reads and compaction.
        let applied = self.applied;
        self.reads.retain(|&(id, index)| {
            let ready = index <= applied;
            if ready {
                out.reads.push(id);
            }
            !ready
        });
        let (first, _) = self.store.bounds();
        if applied >= first && applied - first + 1 >= self.compact_after {
            self.store.compact(applied - self.compact_after / 4)?;
        }
        Ok(out)
    }

    /// Replaces the state machine with a snapshot the leader sent (already persisted).
    fn restore(&mut self, s: &Snapshot) -> Result<(), ReplicaError> {
        let md = s.get_metadata();
        self.state = ClusterState::decode(&s.data).map_err(|msg| StoreError::Corrupt {
            what: "snapshot",
            msg,
        })?;
        self.applied = md.index;
        self.applied_term = md.term;
        self.conf = md.get_conf_state().clone();
        Ok(())
    }

    fn apply(
        &mut self,
        entries: Vec<Entry>,
        out: &mut Output,
        crash_at: Option<Stage>,
    ) -> Result<(), ReplicaError> {
        let Some(last) = entries.last() else {
            return Ok(());
        };
        let (last_index, last_term) = (last.index, last.term);
        for e in entries {
            if e.index <= self.applied {
                continue;
            }
            let proposal = decode_ctx(&e.context).filter(|p| p.0 == self.id());
            let (command, outcome) = match e.get_entry_type() {
                EntryType::EntryNormal if e.data.is_empty() => (None, self.noop_outcome()),
                EntryType::EntryNormal => match Command::decode(&e.data) {
                    Ok(cmd) => {
                        let outcome = self.state.apply(&cmd);
                        (Some(cmd), outcome)
                    }
                    // The same bytes on every member: rejected the same everywhere.
                    Err(msg) => (None, Outcome::Rejected(msg)),
                },
                EntryType::EntryConfChange => {
                    let outcome = match ConfChange::parse_from_bytes(&e.data) {
                        Ok(cc) => self.apply_conf(&cc),
                        Err(err) => Outcome::Rejected(format!("membership change: {err}")),
                    };
                    (None, outcome)
                }
                EntryType::EntryConfChangeV2 => {
                    let outcome = match ConfChangeV2::parse_from_bytes(&e.data) {
                        Ok(cc) => self.apply_conf(&cc),
                        Err(err) => Outcome::Rejected(format!("membership change: {err}")),
                    };
                    (None, outcome)
                }
            };
            self.applied = e.index;
            self.applied_term = e.term;
            out.applied.push(Applied {
                index: e.index,
                term: e.term,
                command,
                outcome,
                proposal,
            });
        }
        if crash_at == Some(Stage::MidApply) {
            return Err(ReplicaError::Crashed(Stage::MidApply));
        }
        debug_assert_eq!((self.applied, self.applied_term), (last_index, last_term));
        self.store
            .save_applied(self.applied, self.applied_term, &self.conf, &self.state)?;
        Ok(())
    }

    fn apply_conf(&mut self, cc: &impl raft_proto::ConfChangeI) -> Outcome {
        match self.node.apply_conf_change(cc) {
            Ok(cs) => {
                let me = self.id();
                let was_member = self.conf.voters.contains(&me) || self.conf.learners.contains(&me);
                let is_member = cs.voters.contains(&me)
                    || cs.learners.contains(&me)
                    || cs.voters_outgoing.contains(&me);
                if was_member && !is_member {
                    tracing::warn!(
                        raft_id = me,
                        "control: this member was removed from the group"
                    );
                    self.removed = true;
                }
                self.conf = cs;
                self.noop_outcome()
            }
            Err(e) => Outcome::Rejected(format!("membership change: {e}")),
        }
    }

    fn noop_outcome(&self) -> Outcome {
        Outcome::Applied {
            placement_version: self.state.placement_version,
        }
    }

    /// Entries of this member's log still held, for invariant checks.
    pub fn log(&self) -> (u64, Vec<Entry>) {
        let (first, last) = self.store.bounds();
        (first, self.store.log_slice(first, last + 1))
    }

    /// Term of a log index, if still held.
    pub fn term_of(&self, index: u64) -> Option<u64> {
        self.node.raft.raft_log.term(index).ok()
    }

    /// The raft-rs store's last index (durable).
    pub fn last_index(&self) -> u64 {
        self.store.last_index().unwrap_or(0)
    }
}

/// A membership change of one member.
pub fn conf_change(raft: u64, kind: ConfChangeType) -> ConfChangeV2 {
    let mut cc = ConfChangeV2::default();
    cc.set_changes(vec![raft_proto::new_conf_change_single(raft, kind)].into());
    cc
}

/// A message for a peer.
#[derive(Debug)]
pub struct Outgoing {
    pub to: u64,
    pub bytes: Vec<u8>,
    /// A snapshot: the transport reports whether it arrived ([`Replica::report_snapshot`]),
    /// or the leader would wait for it forever.
    pub snapshot: bool,
}

fn send_all(msgs: Vec<Message>, send: &mut dyn FnMut(Outgoing)) {
    for m in msgs {
        let to = m.to;
        let snapshot = m.get_msg_type() == MessageType::MsgSnapshot;
        match m.write_to_bytes() {
            Ok(bytes) => send(Outgoing {
                to,
                bytes,
                snapshot,
            }),
            Err(e) => tracing::error!(to, "raft message not encodable: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_whose_state_does_not_decode_is_refused_and_the_member_goes_on() {
        let store = RaftStore::in_memory().unwrap();
        Replica::bootstrap(&store, &[1, 2]).unwrap();
        let mut r = Replica::open(&ReplicaConfig::new(2), store).unwrap();
        let mut m = Message::default();
        m.set_msg_type(MessageType::MsgSnapshot);
        m.from = 1;
        m.to = 2;
        m.term = 5;
        let mut snap = Snapshot::default();
        snap.mut_metadata().index = 10;
        snap.mut_metadata().term = 5;
        snap.mut_metadata()
            .set_conf_state(ConfState::from((vec![1, 2], vec![])));
        snap.data = b"{not a state".to_vec().into();
        m.set_snapshot(snap.clone());
        let bytes = m.write_to_bytes().unwrap();
        let e = r.step(&bytes).unwrap_err().to_string();
        assert!(e.contains("snapshot from 1"), "{e}");
        assert!(r.handle_ready(&mut |_| {}, None).is_ok());
        assert_eq!(r.status().applied, 1, "nothing restored");
        // The same snapshot with a real state is taken.
        snap.data = ClusterState::default().encode().into();
        m.set_snapshot(snap);
        r.step(&m.write_to_bytes().unwrap()).unwrap();
        r.handle_ready(&mut |_| {}, None).unwrap();
        assert_eq!(r.status().applied, 10);
    }
}
