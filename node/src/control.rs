//! The node's seat in the control plane's Raft group (`ternfleet node --init-cluster` or
//! `--join ADDR`): a [`Replica`] on its own thread ([`Driver`]), its store in
//! `STATE_DIR/ID/raft.redb`, Raft messages over the node's own QUIC endpoint ([`QuicRaft`]).
//!
//! - `--init-cluster`: the first voter. A fresh store is bootstrapped with this node as the
//!   only voter; once it leads, the static `--cluster FILE` seeds the placement and the node
//!   registers itself. Given again on a restart, it is ignored (the store already holds the
//!   cluster).
//! - `--join ADDR`: asks the member at ADDR (any member; a follower answers with the leader's
//!   address, and the node asks there) to add it. The leader registers it, adds it as a
//!   learner, and promotes it to voter once its log has caught up (the driver does that).
//! - Neither, with a store that holds a cluster: a restart, rejoining as what it was.
//!
//! - Liveness: every node proposes a heartbeat each second (loading or serving); the leader
//!   marks down a node whose heartbeats stopped for 5 s; its next heartbeat brings it up.
//!
//! Peers reach the group on the node's QUIC endpoint with any certificate of the cluster CA;
//! each Raft frame must come from the id its sender's certificate names, and a `Join` from the
//! id it asks to add.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use ternfleet_control::driver::{ControlHandle, Driver, DriverConfig};
use ternfleet_control::quic::{raft_id, QuicRaft, Resolver};
use ternfleet_control::replica::{Replica, ReplicaConfig};
use ternfleet_control::state::{ClusterState, Command, NodeCaps, NodeStatus, Outcome};
use ternfleet_control::{conf_change, ConfChangeType, RaftStore};
use ternfleet_shared::error::ErrorClass;
use ternfleet_shared::mtls::{self, Identity};
use ternfleet_shared::net::{read_frame, write_frame, CONNECT_TIMEOUT};
use ternfleet_shared::wire::{Frame, HEADER};

/// How long a peer may take to finish a handshake or send a request.
const PEER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// How often a node tells the group it is alive (and whether it is still loading).
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(1);
/// A node whose heartbeats stop for this long is marked down by the leader (a loading node
/// heartbeats too, so a slow load is never taken for a death).
pub const DOWN_AFTER: Duration = Duration::from_secs(5);

/// What the node says of itself in a heartbeat: `Some(true)` loading, `Some(false)` serving,
/// `None` not serving (draining, failed): no heartbeat, so the leader marks it down.
pub type Health = Arc<dyn Fn() -> Option<bool> + Send + Sync>;

/// How the node takes its seat.
#[derive(Clone, Debug, Default)]
pub struct ControlOptions {
    pub init_cluster: bool,
    pub join: Option<String>,
}

/// The running member.
pub struct Member {
    pub handle: ControlHandle,
    pub transport: Arc<QuicRaft>,
    id: String,
    addr: String,
    /// The node's blobs, served to members copying them (a move); unset on a coordinator.
    pub blobs: OnceLock<Arc<crate::moves::Holdings>>,
    // Stops the thread when the node exits.
    _driver: Driver,
}

fn lookup(state: &ClusterState, raft: u64) -> Option<(String, String)> {
    state.raft_member(raft)
}

/// What the member is.
pub enum Role {
    /// A node: a voter once caught up. `seed`: the placement `--init-cluster` proposes when
    /// the group has none; `health`: what its heartbeats say.
    Node {
        seed: Option<Command>,
        health: Health,
    },
    /// A coordinator (`serve --join`): a learner that follows the committed placement, never
    /// a voter, never the leader; it proposes operators' commands.
    Coordinator,
}

/// Starts the member.
#[allow(clippy::too_many_arguments)]
pub fn start(
    me: &Identity,
    id: &str,
    addr: &str,
    dir: PathBuf,
    endpoint: quinn::Endpoint,
    rt: &tokio::runtime::Handle,
    opts: &ControlOptions,
    role: Role,
) -> Result<Arc<Member>, String> {
    let coordinator = matches!(role, Role::Coordinator);
    if coordinator && opts.init_cluster {
        return Err(
            "a coordinator cannot start a cluster: --init-cluster is for the first node".into(),
        );
    }
    let path = dir.join(id).join("raft.redb");
    let store = RaftStore::open(&path).map_err(|e| e.to_string())?;
    let me_raft = raft_id(id);
    let restart = store.initialized();
    if restart {
        if opts.init_cluster || opts.join.is_some() {
            tracing::info!(
                "control: {} already holds this node's cluster: restarting as a member (--init-cluster / --join ignored)",
                path.display()
            );
        }
    } else if opts.init_cluster {
        Replica::bootstrap(&store, &[me_raft]).map_err(|e| e.to_string())?;
        tracing::info!("control: new cluster, {id} its first voter");
    } else if opts.join.is_none() {
        return Err(format!(
            "{} holds no cluster: start the first member with --init-cluster, others with --join ADDR",
            path.display()
        ));
    }
    let state_rx: Arc<OnceLock<watch::Receiver<Arc<ClusterState>>>> = Arc::new(OnceLock::new());
    let resolve: Resolver = {
        let state_rx = state_rx.clone();
        Arc::new(move |r| state_rx.get().and_then(|s| lookup(&s.borrow(), r)))
    };
    let client = me.client_config().map_err(|e| e.to_string())?;
    let transport = QuicRaft::new(id, endpoint.clone(), client, resolve, rt.clone());
    let replica = Replica::open(&ReplicaConfig::new(me_raft), store).map_err(|e| e.to_string())?;
    let driver = Driver::spawn(replica, transport.clone(), DriverConfig::default())
        .map_err(|e| e.to_string())?;
    let handle = driver.handle.clone();
    let _ = state_rx.set(handle.applied());
    transport.attach(handle.clone());
    let member = Arc::new(Member {
        handle: handle.clone(),
        transport,
        id: id.to_string(),
        addr: addr.to_string(),
        blobs: OnceLock::new(),
        _driver: driver,
    });
    rt.spawn(watch_leadership(member.clone()));
    match role {
        Role::Node { seed, health } => {
            rt.spawn(heartbeats(member.clone(), health));
            rt.spawn(watch_liveness(member.clone()));
            if opts.init_cluster && !restart {
                rt.spawn(init(member.clone(), seed));
            } else if let Some(target) = opts.join.clone().filter(|_| !restart) {
                let any = me.client_config_any_member().map_err(|e| e.to_string())?;
                rt.spawn(join(member.clone(), endpoint, any, vec![target], false));
            }
        }
        Role::Coordinator => {
            // A coordinator joins at every start: its QUIC address may have changed (the
            // leader re-registers it). On a restart it asks the members its store knows.
            let mut targets: Vec<String> = opts.join.iter().cloned().collect();
            targets.extend(
                handle
                    .applied()
                    .borrow()
                    .nodes
                    .values()
                    .map(|n| n.addr.clone()),
            );
            let any = me.client_config_any_member().map_err(|e| e.to_string())?;
            rt.spawn(join(member.clone(), endpoint, any, targets, true));
        }
    }
    Ok(member)
}

/// Logs every change of leader, term or membership (tests and operators read these lines).
async fn watch_leadership(m: Arc<Member>) {
    let mut last = None;
    let mut statuses: std::collections::BTreeMap<String, NodeStatus> = Default::default();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tick.tick().await;
        let Ok(s) = m.handle.status().await else {
            return;
        };
        let state = m.handle.applied().borrow().clone();
        let name = |r: u64| lookup(&state, r).map_or_else(|| r.to_string(), |(id, _)| id);
        let now = (s.leader, s.term, s.voters.clone(), s.learners.clone());
        if last.as_ref() != Some(&now) {
            let voters: Vec<String> = s.voters.iter().map(|&v| name(v)).collect();
            let learners: Vec<String> = s.learners.iter().map(|&v| name(v)).collect();
            tracing::info!(
                term = s.term,
                leader = %s.leader.map_or_else(|| "none".to_string(), name),
                voters = %voters.join(","),
                raw_voters = ?s.voters,
                learners = %learners.join(","),
                placement_version = state.placement_version,
                "control: membership"
            );
            last = Some(now);
        }
        for (id, n) in &state.nodes {
            if statuses.get(id) != Some(&n.status) {
                tracing::info!(
                    placement_version = state.placement_version,
                    "control: node {id} is {}",
                    n.status.name()
                );
                statuses.insert(id.clone(), n.status);
            }
        }
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Proposes a heartbeat every [`HEARTBEAT_EVERY`] (through the leader) while the node serves
/// or loads.
async fn heartbeats(m: Arc<Member>, health: Health) {
    let mut tick = tokio::time::interval(HEARTBEAT_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(loading) = health() else { continue };
        let registered = m.handle.applied().borrow().nodes.get(&m.id).map(|n| {
            n.caps.level != ternfleet_control::state::COMMAND_LEVEL
                || n.caps.kernels != ternfleet_kernels::isa_name()
                || n.addr != m.addr
        });
        match registered {
            None => continue, // not registered yet
            // Restarted as another build (a rolling upgrade) or on another address: say so.
            Some(true) => {
                if let Some(why) = register(&m, &m.id, &m.addr).await {
                    tracing::debug!("control: registering again: {why}");
                }
            }
            Some(false) => {}
        }
        let applied = m.handle.status().await.map_or(0, |s| s.applied);
        let cmd = Command::Heartbeat {
            id: m.id.clone(),
            at_ms: now_ms(),
            loading,
            applied,
        };
        if let Err(e) = m.handle.propose(cmd).await {
            tracing::debug!("control: heartbeat: {e}");
        }
    }
}

/// A Raft member the state no longer names (a removed node) is taken out of the group after
/// this long (a joiner is registered before it is added, so it is never caught).
pub const REMOVE_AFTER: Duration = Duration::from_secs(10);

/// On the leader: marks down the nodes whose heartbeats stopped for [`DOWN_AFTER`] (as this
/// leader saw the applied heartbeats arrive; a new leader gives every node that long again),
/// and takes out of the Raft group the members the state no longer names ([`REMOVE_AFTER`];
/// never itself).
async fn watch_liveness(m: Arc<Member>) {
    let mut seen: std::collections::HashMap<String, (u64, Instant)> = Default::default();
    let mut absent: std::collections::HashMap<u64, Instant> = Default::default();
    let mut leading = false;
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tick.tick().await;
        let Ok(st) = m.handle.status().await else {
            return;
        };
        if st.leader != Some(st.id) {
            leading = false;
            continue;
        }
        if !leading {
            seen.clear();
            absent.clear();
            leading = true;
        }
        let state = m.handle.applied().borrow().clone();
        let now = Instant::now();
        let members: Vec<u64> = st.voters.iter().chain(&st.learners).copied().collect();
        absent.retain(|r, _| members.contains(r) && state.raft_member(*r).is_none());
        for &r in &members {
            if r == st.id || state.placement_version == 0 || state.raft_member(r).is_some() {
                continue;
            }
            let since = *absent.entry(r).or_insert(now);
            if now - since > REMOVE_AFTER {
                tracing::info!("control: Raft member {r} is no longer in the cluster: removing it from the group");
                let cc = conf_change(r, ConfChangeType::RemoveNode);
                match m.handle.change_membership(cc).await {
                    Ok(_) => {
                        absent.remove(&r);
                    }
                    Err(e) => tracing::warn!("control: removing Raft member {r}: {e}"),
                }
            }
        }
        for (id, n) in &state.nodes {
            let e = seen.entry(id.clone()).or_insert((n.last_heartbeat_ms, now));
            if e.0 != n.last_heartbeat_ms {
                *e = (n.last_heartbeat_ms, now);
            }
            let live = matches!(n.status, NodeStatus::Up | NodeStatus::Loading);
            if live && now - e.1 > DOWN_AFTER {
                tracing::warn!(
                    "control: no heartbeat from {id} for {DOWN_AFTER:?}: marking it down"
                );
                if let Err(err) = m.handle.propose(Command::MarkDown { id: id.clone() }).await {
                    tracing::debug!("control: marking {id} down: {err}");
                }
            }
        }
    }
}

/// The first voter: lead, seed the placement, register.
async fn init(m: Arc<Member>, seed: Option<Command>) {
    let _ = m.handle.campaign();
    let t0 = Instant::now();
    loop {
        if let Ok(s) = m.handle.status().await {
            if s.leader == Some(s.id) {
                break;
            }
        }
        if t0.elapsed() > Duration::from_secs(30) {
            tracing::warn!("control: not leading 30 s after --init-cluster; another member leads");
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let state = m.handle.applied().borrow().clone();
    if let Some(cmd) = seed.filter(|_| state.placement_version == 0 && state.nodes.is_empty()) {
        match m.handle.propose(cmd).await {
            Ok(Outcome::Rejected(why)) => {
                tracing::error!("control: the seed placement was refused: {why}")
            }
            Ok(_) => tracing::info!("control: placement seeded from the cluster file"),
            Err(e) => tracing::error!("control: seeding the placement: {e}"),
        }
    }
    register(&m, &m.id, &m.addr).await;
}

async fn register(m: &Member, id: &str, addr: &str) -> Option<String> {
    let cmd = Command::Register {
        id: id.to_string(),
        raft_id: raft_id(id),
        addr: addr.to_string(),
        caps: NodeCaps {
            kernels: ternfleet_kernels::isa_name().to_string(),
            level: ternfleet_control::state::COMMAND_LEVEL,
            ..NodeCaps::default()
        },
    };
    match m.handle.propose(cmd).await {
        Ok(Outcome::Rejected(why)) => Some(why),
        Ok(_) => None,
        Err(e) => Some(e.to_string()),
    }
}

/// Serves a `Join` (on the leader: register, add as learner; elsewhere: say who leads).
pub async fn answer_join(m: &Member, conn: &quinn::Connection, id: String, addr: String) -> Frame {
    let reply = |accepted: bool, leader: (String, String), message: String| Frame::Joined {
        member: m.id.clone(),
        accepted,
        leader: leader.0,
        leader_addr: leader.1,
        message,
    };
    if let Err(e) = mtls::peer_id(conn, std::slice::from_ref(&id)) {
        return reply(false, Default::default(), format!("join as {id:?}: {e}"));
    }
    let Ok(st) = m.handle.status().await else {
        return reply(
            false,
            Default::default(),
            "the control plane stopped".into(),
        );
    };
    let state = m.handle.applied().borrow().clone();
    let leader = st
        .leader
        .and_then(|l| lookup(&state, l))
        .unwrap_or_default();
    if st.leader != Some(st.id) {
        return reply(false, leader, "not the leader".into());
    }
    // Before the first placement is applied the state names no coordinators yet: a
    // coordinator joining then would be registered as a node (and promoted to voter). The
    // joiner retries.
    if state.placement_version == 0 {
        return reply(
            false,
            leader,
            "the cluster has no placement yet (the first voter is seeding it)".into(),
        );
    }
    let seat = state.coordinators.contains(&id);
    let why = if seat {
        let cmd = Command::RegisterCoordinator {
            id: id.clone(),
            raft_id: raft_id(&id),
            addr: addr.clone(),
        };
        match m.handle.propose(cmd).await {
            Ok(Outcome::Rejected(why)) => Some(why),
            Ok(_) => None,
            Err(e) => Some(e.to_string()),
        }
    } else {
        register(m, &id, &addr).await
    };
    if let Some(why) = why {
        return reply(false, leader, format!("registering {id}: {why}"));
    }
    let r = raft_id(&id);
    if !st.voters.contains(&r) && !st.learners.contains(&r) {
        let cc = conf_change(r, ConfChangeType::AddLearnerNode);
        if let Err(e) = m.handle.change_membership(cc).await {
            return reply(false, leader, format!("adding {id} as a learner: {e}"));
        }
        tracing::info!(%id, %addr, coordinator = seat, "control: {id} joined as a learner");
    }
    reply(true, leader, String::new())
}

/// Asks the members at `targets` in turn (then the leader one names) to add this member,
/// until accepted or, unless `until_accepted` (a coordinator re-registering its address),
/// until the leader's snapshot made it a member.
async fn join(
    m: Arc<Member>,
    endpoint: quinn::Endpoint,
    any: quinn::ClientConfig,
    targets: Vec<String>,
    until_accepted: bool,
) {
    if targets.is_empty() {
        tracing::error!("control: no member to join through (give --join ADDR)");
        return;
    }
    let mut target = targets[0].clone();
    let mut attempt = 0usize;
    loop {
        attempt += 1;
        let mut next = None;
        match ask_join(&m, &endpoint, &any, &target).await {
            Ok(Frame::Joined {
                accepted: true,
                member,
                ..
            }) => {
                tracing::info!("control: {member} at {target} added this member to the cluster");
                return;
            }
            Ok(Frame::Joined {
                leader_addr,
                message,
                member,
                ..
            }) => {
                tracing::info!("control: join via {member} at {target}: {message}");
                if !leader_addr.is_empty() {
                    next = Some(leader_addr);
                }
            }
            Ok(other) => tracing::warn!(
                "control: join via {target}: unexpected answer {}",
                other.name()
            ),
            Err(e) => {
                if attempt % 10 == 1 {
                    tracing::warn!("control: join via {target}: {e} (retrying)");
                }
            }
        }
        // Already a member (the leader's snapshot arrived): done.
        if let Ok(s) = m.handle.status().await {
            if !until_accepted && (s.voters.contains(&s.id) || s.learners.contains(&s.id)) {
                return;
            }
        }
        target = next.unwrap_or_else(|| targets[attempt % targets.len()].clone());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

async fn ask_join(
    m: &Member,
    endpoint: &quinn::Endpoint,
    any: &quinn::ClientConfig,
    target: &str,
) -> Result<Frame, String> {
    let sock = tokio::net::lookup_host(target)
        .await
        .map_err(|e| format!("{target}: {e}"))?
        .next()
        .ok_or_else(|| format!("{target}: no address"))?;
    // The member's id is not known yet: the CA is checked now, the id it claims below.
    let connecting = endpoint
        .connect_with(any.clone(), sock, "member")
        .map_err(|e| e.to_string())?;
    let conn = tokio::time::timeout(CONNECT_TIMEOUT, connecting)
        .await
        .map_err(|_| format!("no handshake within {CONNECT_TIMEOUT:?}"))?
        .map_err(|e| e.to_string())?;
    let ask = async {
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
        let req = Frame::Join {
            id: m.id.clone(),
            addr: m.addr.clone(),
        }
        .encode()
        .map_err(|e| e.to_string())?;
        write_frame(&mut send, &req).await?;
        read_frame(&mut recv).await
    };
    let reply = tokio::time::timeout(Duration::from_secs(10), ask)
        .await
        .map_err(|_| "no answer within 10 s".to_string())??;
    if let Frame::Joined { member, .. } = &reply {
        mtls::peer_id(&conn, std::slice::from_ref(member))
            .map_err(|e| format!("the member answering as {member:?}: {e}"))?;
    }
    conn.close(0u32.into(), b"joined");
    Ok(reply)
}

/// Serves a control-plane peer's connection: Raft frames on uni-streams, `Join`, `Hello`
/// (the node's state) and `Fetch` (a move's copy of a blob) on bi-streams (each checked
/// against the id the peer's certificate names).
pub async fn serve_connection(conn: quinn::Connection, m: Arc<Member>) {
    let raft = m.transport.clone().serve_connection(conn.clone());
    let joins = async {
        while let Ok((mut send, mut recv)) = conn.accept_bi().await {
            let (m, conn) = (m.clone(), conn.clone());
            tokio::spawn(async move {
                let cap = HEADER + 3 * ternfleet_shared::wire::MAX_TEXT;
                let reply = match tokio::time::timeout(PEER_READ_TIMEOUT, recv.read_to_end(cap))
                    .await
                {
                    Ok(Ok(b)) => match Frame::decode(&b) {
                        Ok(Frame::Join { id, addr }) => answer_join(&m, &conn, id, addr).await,
                        // A member asking this node's state (`ternfleet probe quic://`, a
                        // healthcheck run with the node's own certificate).
                        Ok(Frame::Hello { id }) => {
                            match (mtls::peer_id(&conn, std::slice::from_ref(&id)), m.blobs.get())
                            {
                                (Ok(peer), Some(b)) => b
                                    .svc()
                                    .handle(&peer, Frame::Hello { id })
                                    .unwrap_or_else(|f| f),
                                (Err(why), _) => Frame::Error {
                                    class: ErrorClass::Unauthenticated,
                                    message: format!("hello says {id:?}: {why}"),
                                },
                                (Ok(_), None) => Frame::Error {
                                    class: ErrorClass::Unavailable,
                                    message: format!("{} serves no experts", m.id),
                                },
                            }
                        }
                        Ok(Frame::Fetch {
                            layer,
                            expert,
                            offset,
                            max,
                        }) => match m.blobs.get().cloned() {
                            Some(b) => tokio::task::spawn_blocking(move || {
                                b.serve_fetch(layer, expert, offset, max)
                            })
                            .await
                            .unwrap_or_else(|e| Frame::Error {
                                class: ErrorClass::Internal,
                                message: e.to_string(),
                            }),
                            None => Frame::Error {
                                class: ErrorClass::NotFound,
                                message: format!("{} holds no expert blobs", m.id),
                            },
                        },
                        Ok(other) => Frame::Error {
                            class: ErrorClass::BadRequest,
                            message: format!(
                                "a control-plane peer may send Join, Hello, Fetch or Raft frames, not {}",
                                other.name()
                            ),
                        },
                        Err(e) => Frame::Error {
                            class: ErrorClass::BadRequest,
                            message: e.to_string(),
                        },
                    },
                    _ => return,
                };
                if let Ok(bytes) = reply.encode() {
                    if let Err(e) = write_frame(&mut send, &bytes).await {
                        tracing::debug!("control: answering a peer: {e}");
                    }
                }
            });
        }
    };
    tokio::join!(raft, joins);
}

/// Accepts connections on an endpoint that serves only the control plane (a coordinator's
/// seat): any certificate of the cluster CA, then [`serve_connection`].
pub async fn accept_members(endpoint: quinn::Endpoint, m: Arc<Member>) {
    while let Some(incoming) = endpoint.accept().await {
        let m = m.clone();
        tokio::spawn(async move {
            let remote = incoming.remote_address();
            match tokio::time::timeout(PEER_READ_TIMEOUT, incoming).await {
                Ok(Ok(conn)) => serve_connection(conn, m).await,
                Ok(Err(e)) => tracing::warn!(%remote, "control: handshake refused: {e}"),
                Err(_) => tracing::warn!(%remote, "control: handshake timed out"),
            }
        });
    }
}

/// Refreshes `m`'s Raft gauges (term, commit, applied, leader, placement version) into `sink`
/// every second, on `rt`, for `/metrics` (a scrape never waits on the Raft loop).
pub fn publish_gauges(
    m: Arc<Member>,
    rt: &tokio::runtime::Handle,
    sink: impl Fn(ternfleet_shared::metrics::RaftGauges) + Send + 'static,
) {
    rt.spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            let st = tokio::time::timeout(Duration::from_secs(1), m.handle.status()).await;
            let Ok(Ok(s)) = st else { continue };
            let placement_version = m.handle.applied().borrow().placement_version;
            sink(ternfleet_shared::metrics::RaftGauges {
                term: s.term,
                commit: s.commit,
                applied: s.applied,
                is_leader: s.leader == Some(s.id),
                placement_version,
            });
        }
    });
}
