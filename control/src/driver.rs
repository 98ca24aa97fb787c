//! Runs a [`Replica`] on its own thread: the thin I/O layer around the I/O-free member.
//!
//! The thread owns the replica and its store (every `Ready` ends in an fsync'd redb commit, so
//! it must not sit on an async runtime's worker). Everything else talks to it through a
//! [`ControlHandle`]: received Raft messages, proposals (answered with their [`Outcome`] once
//! applied here), linearizable reads, membership changes, transport reports. Outgoing messages
//! go to a [`RaftTransport`], which must never block (a full peer queue drops the message:
//! Raft retries). The newest applied state is published on a `watch` channel, so the router
//! always routes with the newest committed placement.
//!
//! Ticks: one every [`DriverConfig::tick`]; with the replica's defaults (election after 10 to
//! 20 ticks, heartbeat every 3) and a 100 ms tick a leader that dies is replaced in 1 to 2 s.

use std::collections::HashMap;
use std::sync::mpsc::{self, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use raft::prelude::{ConfChangeType, ConfChangeV2};
use tokio::sync::{oneshot, watch};

use crate::replica::{conf_change, Outgoing, ProposalId, Replica, ReplicaError, ReplicaStatus};
use crate::state::{ClusterState, Command, Outcome};

/// Where a member's outgoing Raft messages go.
pub trait RaftTransport: Send + Sync + 'static {
    /// Queues `msg` for its peer without blocking. A snapshot's fate must come back through
    /// [`ControlHandle::report_snapshot`].
    fn send(&self, from: u64, msg: Outgoing);
}

/// Settings of the driver thread.
#[derive(Clone, Debug)]
pub struct DriverConfig {
    pub tick: Duration,
    /// Inputs queued at most (messages, proposals, reads); more are refused at once.
    pub queue: usize,
    /// A proposal or read not answered in this time fails with [`ControlError::Timeout`].
    pub request_timeout: Duration,
}

impl Default for DriverConfig {
    fn default() -> Self {
        DriverConfig {
            tick: Duration::from_millis(100),
            queue: 4096,
            request_timeout: Duration::from_secs(5),
        }
    }
}

/// Errors answering a control-plane request.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ControlError {
    #[error("not the Raft leader (leader: {})", leader.map_or("unknown".into(), |l| l.to_string()))]
    NotLeader { leader: Option<u64> },
    #[error("no answer from the Raft group within {0:?}")]
    Timeout(Duration),
    #[error("the control plane is overloaded: {0} requests queued")]
    Busy(usize),
    #[error("the control plane stopped: {0}")]
    Stopped(String),
    #[error("{0}")]
    Failed(String),
}

type Reply<T> = oneshot::Sender<Result<T, ControlError>>;

enum Input {
    Message(Vec<u8>),
    Propose(Command, Reply<Outcome>),
    ConfChange(ConfChangeV2, Reply<()>),
    Read(Reply<Arc<ClusterState>>),
    Status(oneshot::Sender<ReplicaStatus>),
    SnapshotReport { to: u64, delivered: bool },
    Unreachable(u64),
    Campaign,
    Stop,
}

/// A handle on a running member; cheap to clone.
#[derive(Clone)]
pub struct ControlHandle {
    tx: SyncSender<Input>,
    state: watch::Receiver<Arc<ClusterState>>,
    queue: usize,
    timeout: Duration,
}

/// The running driver thread.
pub struct Driver {
    pub handle: ControlHandle,
    thread: Option<JoinHandle<Result<(), String>>>,
}

impl Driver {
    /// Starts the thread.
    pub fn spawn(
        replica: Replica,
        transport: Arc<dyn RaftTransport>,
        cfg: DriverConfig,
    ) -> Result<Driver, ControlError> {
        let (tx, rx) = mpsc::sync_channel(cfg.queue);
        let (state_tx, state_rx) = watch::channel(Arc::new(replica.state().clone()));
        let handle = ControlHandle {
            tx,
            state: state_rx,
            queue: cfg.queue,
            timeout: cfg.request_timeout,
        };
        let thread = std::thread::Builder::new()
            .name(format!("ternfleet-raft-{}", replica.id()))
            .spawn(move || run(replica, transport, cfg, rx, state_tx))
            .map_err(|e| ControlError::Stopped(e.to_string()))?;
        Ok(Driver {
            handle,
            thread: Some(thread),
        })
    }

    /// Stops the thread (pending requests fail with `Stopped`) and waits for it.
    pub fn stop(mut self) -> Result<(), String> {
        self.halt()
    }

    fn halt(&mut self) -> Result<(), String> {
        let _ = self.handle.tx.send(Input::Stop);
        match self.thread.take() {
            Some(t) => t
                .join()
                .map_err(|_| "the Raft thread panicked".to_string())?,
            None => Ok(()),
        }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.halt();
    }
}

impl ControlHandle {
    fn push(&self, input: Input) -> Result<(), ControlError> {
        self.tx.try_send(input).map_err(|e| match e {
            TrySendError::Full(_) => ControlError::Busy(self.queue),
            TrySendError::Disconnected(_) => ControlError::Stopped("the Raft thread ended".into()),
        })
    }

    async fn ask<T>(&self, make: impl FnOnce(Reply<T>) -> Input) -> Result<T, ControlError> {
        let (tx, rx) = oneshot::channel();
        self.push(make(tx))?;
        match tokio::time::timeout(self.timeout + Duration::from_millis(500), rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(ControlError::Stopped("the Raft thread ended".into())),
            Err(_) => Err(ControlError::Timeout(self.timeout)),
        }
    }

    /// A Raft message received from a peer (dropped when the queue is full: Raft retries).
    pub fn deliver(&self, bytes: Vec<u8>) -> Result<(), ControlError> {
        self.push(Input::Message(bytes))
    }

    /// Proposes a command (a follower forwards it to the leader) and waits until it is
    /// applied here; `NotLeader` when no leader is known, `Timeout` when the proposal was lost
    /// (retry: commands are idempotent or refused when repeated).
    pub async fn propose(&self, cmd: Command) -> Result<Outcome, ControlError> {
        self.ask(|r| Input::Propose(cmd, r)).await
    }

    /// Proposes a membership change on this member (it must lead); answered once applied.
    pub async fn change_membership(&self, cc: ConfChangeV2) -> Result<(), ControlError> {
        self.ask(|r| Input::ConfChange(cc, r)).await
    }

    /// A linearizable read (ReadIndex): the state reflects every write committed before it.
    pub async fn read(&self) -> Result<Arc<ClusterState>, ControlError> {
        self.ask(Input::Read).await
    }

    /// This member's view (role, term, leader, indexes, membership).
    pub async fn status(&self) -> Result<ReplicaStatus, ControlError> {
        let (tx, rx) = oneshot::channel();
        self.push(Input::Status(tx))?;
        rx.await
            .map_err(|_| ControlError::Stopped("the Raft thread ended".into()))
    }

    /// The newest state applied here (not linearizable: see [`ControlHandle::read`]).
    pub fn applied(&self) -> watch::Receiver<Arc<ClusterState>> {
        self.state.clone()
    }

    pub fn report_snapshot(&self, to: u64, delivered: bool) {
        let _ = self.push(Input::SnapshotReport { to, delivered });
    }

    pub fn report_unreachable(&self, to: u64) {
        let _ = self.push(Input::Unreachable(to));
    }

    /// Campaigns at once (a single-member group need not wait an election timeout).
    pub fn campaign(&self) -> Result<(), ControlError> {
        self.push(Input::Campaign)
    }
}

struct Waiting<T> {
    reply: Reply<T>,
    since: Instant,
}

fn run(
    mut replica: Replica,
    transport: Arc<dyn RaftTransport>,
    cfg: DriverConfig,
    rx: mpsc::Receiver<Input>,
    state_tx: watch::Sender<Arc<ClusterState>>,
) -> Result<(), String> {
    let id = replica.id();
    let mut proposals: HashMap<ProposalId, Waiting<Outcome>> = HashMap::new();
    let mut confs: HashMap<ProposalId, Waiting<()>> = HashMap::new();
    let mut reads: HashMap<u64, Waiting<Arc<ClusterState>>> = HashMap::new();
    let mut next_read = 1u64;
    let mut next_tick = Instant::now() + cfg.tick;
    // Every change of the state is an applied entry: publish when the applied index moves.
    let mut published_applied = replica.status().applied;
    let result = loop {
        let now = Instant::now();
        let input = if now >= next_tick {
            None
        } else {
            match rx.recv_timeout(next_tick - now) {
                Ok(i) => Some(i),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => break Ok(()),
            }
        };
        if Instant::now() >= next_tick {
            replica.tick();
            next_tick += cfg.tick;
            if next_tick < Instant::now() {
                next_tick = Instant::now() + cfg.tick;
            }
            // Learners that caught up become voters (one membership change at a time).
            if let Some(l) = replica.learner_to_promote(8) {
                match replica.propose_conf_change(conf_change(l, ConfChangeType::AddNode)) {
                    Ok(_) => {
                        tracing::info!(raft_id = id, "control: promoting learner {l} to voter")
                    }
                    Err(e) => tracing::debug!(raft_id = id, "control: promoting {l}: {e}"),
                }
            }
            let t = cfg.request_timeout;
            fail(&mut proposals, t, || ControlError::Timeout(t));
            fail(&mut confs, t, || ControlError::Timeout(t));
            fail(&mut reads, t, || ControlError::Timeout(t));
        }
        // Take this input and whatever else is queued, then handle one Ready for all of them.
        let mut inputs: Vec<Input> = input.into_iter().collect();
        while inputs.len() < 256 {
            match rx.try_recv() {
                Ok(i) => inputs.push(i),
                Err(_) => break,
            }
        }
        let mut stop = false;
        for input in inputs {
            let now = Instant::now();
            match input {
                Input::Message(b) => {
                    if let Err(e) = replica.step(&b) {
                        tracing::warn!(raft_id = id, "dropped a Raft message: {e}");
                    }
                }
                Input::Propose(cmd, reply) => match replica.propose(&cmd) {
                    Ok(pid) => {
                        proposals.insert(pid, Waiting { reply, since: now });
                    }
                    Err(e) => {
                        let _ = reply.send(Err(control_error(e)));
                    }
                },
                Input::ConfChange(cc, reply) => match replica.propose_conf_change(cc) {
                    Ok(pid) => {
                        confs.insert(pid, Waiting { reply, since: now });
                    }
                    Err(e) => {
                        let _ = reply.send(Err(control_error(e)));
                    }
                },
                Input::Read(reply) => {
                    let rid = next_read;
                    next_read += 1;
                    replica.read_index(rid);
                    reads.insert(rid, Waiting { reply, since: now });
                }
                Input::Status(reply) => {
                    let _ = reply.send(replica.status());
                }
                Input::SnapshotReport { to, delivered } => replica.report_snapshot(to, delivered),
                Input::Unreachable(to) => replica.report_unreachable(to),
                Input::Campaign => {
                    if let Err(e) = replica.campaign() {
                        tracing::warn!(raft_id = id, "campaign: {e}");
                    }
                }
                Input::Stop => stop = true,
            }
        }
        if stop {
            break Ok(());
        }
        let out = match replica.handle_ready(&mut |o| transport.send(id, o), None) {
            Ok(out) => out,
            // The store failed: this member cannot go on without risking what it promised.
            Err(e) => break Err(format!("Raft member {id} stopped: {e}")),
        };
        if replica.removed() {
            tracing::warn!(
                raft_id = id,
                "control: removed from the Raft group; this member stops"
            );
            break Ok(());
        }
        for a in out.applied {
            let Some(pid) = a.proposal else { continue };
            if let Some(w) = proposals.remove(&pid) {
                let _ = w.reply.send(Ok(a.outcome));
            } else if let Some(w) = confs.remove(&pid) {
                let _ = w.reply.send(match a.outcome {
                    Outcome::Rejected(m) => Err(ControlError::Failed(m)),
                    _ => Ok(()),
                });
            }
        }
        let applied = replica.status().applied;
        if !out.reads.is_empty() || applied != published_applied {
            let s = Arc::new(replica.state().clone());
            for rid in out.reads {
                if let Some(w) = reads.remove(&rid) {
                    let _ = w.reply.send(Ok(s.clone()));
                }
            }
            if applied != published_applied {
                published_applied = applied;
                state_tx.send_replace(s);
            }
        }
    };
    let why = result
        .as_ref()
        .err()
        .cloned()
        .unwrap_or_else(|| "shut down".into());
    let now = Duration::ZERO;
    fail(&mut proposals, now, || ControlError::Stopped(why.clone()));
    fail(&mut confs, now, || ControlError::Stopped(why.clone()));
    fail(&mut reads, now, || ControlError::Stopped(why.clone()));
    if let Err(e) = &result {
        tracing::error!("{e}");
    }
    result
}

/// Answers `err()` to the requests waiting at least `older` (`Duration::ZERO`: all of them).
fn fail<K: Eq + std::hash::Hash, T>(
    map: &mut HashMap<K, Waiting<T>>,
    older: Duration,
    err: impl Fn() -> ControlError,
) {
    for (_, w) in map.extract_if(|_, w| w.since.elapsed() >= older) {
        let _ = w.reply.send(Err(err()));
    }
}

fn control_error(e: ReplicaError) -> ControlError {
    match e {
        ReplicaError::NotLeader { leader } => ControlError::NotLeader { leader },
        e => ControlError::Failed(e.to_string()),
    }
}
