//! `ternfleet node`: serves one shard of a bundle's routed experts over QUIC with mutual TLS.
//!
//! Start-up (../shared/CONVENTIONS.md): load the identity and the cluster file, bind, print the
//! start-up line, then open the shard in the background — a node answers `Hello` with its load
//! progress while it loads, so a slow load is never mistaken for a dead node. Every
//! connection is authenticated before a byte of it is parsed: the TLS handshake checks the
//! client's certificate against the cluster CA, then [`mtls::peer_id`] checks it names an
//! allowed coordinator; a `Hello` must repeat that id. A malformed frame fails its stream only.
//! SIGTERM or SIGINT: stop taking calls (`Unavailable: draining`), let running calls finish
//! (at most [`DRAIN`]), exit.

use rayon::prelude::*;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ternfleet_shared::bundle::{Gating, Manifest};
use ternfleet_shared::cluster::ClusterFile;
use ternfleet_shared::error::ErrorClass;
use ternfleet_shared::mtls::{self, Identity};
use ternfleet_shared::net::{write_frame, CLOSE_IDENTITY, CLOSE_SHUTDOWN};
use ternfleet_shared::wire::{Frame, NodeState, HEADER, MAX_FRAME};

use crate::control::Member;
use crate::expert::Activation;
use crate::moves::{BackendOptions, Holdings, MoveOptions};
use crate::service::Service;
use crate::shard::{open_experts_with, ExpertShape};
use crate::store::Evict;
use ternfleet_shared::bundle::VerifiedParts;

/// How long a client has to send its request on a stream.
pub const READ_TIMEOUT: Duration = Duration::from_secs(30);
/// How long running calls may finish after SIGTERM.
pub const DRAIN: Duration = Duration::from_secs(10);
/// Calls computing at once (more wait for a permit; the rayon pool does the work).
const MAX_CALLS: usize = 32;

/// `ternfleet node`'s options.
#[derive(Clone, Debug)]
pub struct NodeOptions {
    pub bundle: PathBuf,
    pub id: String,
    pub certs: PathBuf,
    pub cluster: PathBuf,
    /// Bind address; `None`: this node's address in the cluster file.
    pub listen: Option<String>,
    pub ram_budget: Option<u64>,
    pub io_threads: usize,
    pub evict: Evict,
    /// The FFN activation of the bundle's architecture (the coordinator's model code knows
    /// it; the manifest names the architecture).
    pub act: Activation,
    /// Where the node remembers which blobs it verified (`ID/verified-*.json`; `None`: hash
    /// every start), and keeps its Raft store (`ID/raft.redb`) when it is a control-plane
    /// member. Per node id: nodes sharing one state directory never overwrite each other's.
    pub state_dir: Option<PathBuf>,
    /// A seat in the control plane's Raft group (`--init-cluster`, `--join ADDR`); `None`:
    /// the static cluster file only.
    pub control: Option<crate::control::ControlOptions>,
    /// With a control-plane seat: delete the blob file of an expert a move took away (the
    /// bundle directory is this node's own).
    pub prune: bool,
    /// Copy rate of moves into this node, bytes per second (0: unlimited).
    pub move_rate: u64,
    /// Bytes asked for per `Fetch` of a move's copy.
    pub move_chunk: u32,
    /// The HTTP side port (`/metrics`, `/health`, `/ready`).
    pub metrics: MetricsAddr,
    /// Allow the plaintext metrics port on a non-loopback address.
    pub listen_any: bool,
}

/// Where `--metrics` binds.
#[derive(Clone, Debug, PartialEq)]
pub enum MetricsAddr {
    /// Not given: [`DEFAULT_METRICS`]; taken already (another node on this machine), the node
    /// runs without it and says so.
    Default,
    /// `--metrics off`.
    Off,
    /// `--metrics ADDR`: failing to bind it is an error.
    At(String),
}

/// The metrics port's default address (../shared/CONVENTIONS.md).
pub const DEFAULT_METRICS: &str = "127.0.0.1:9400";

/// Binds the metrics port as `--metrics` says (`None`: off, or the default was taken).
fn bind_metrics(
    want: &MetricsAddr,
    listen_any: bool,
) -> Result<Option<std::net::TcpListener>, NodeError> {
    let (addr, soft) = match want {
        MetricsAddr::Off => return Ok(None),
        MetricsAddr::Default => (DEFAULT_METRICS, true),
        MetricsAddr::At(a) => (a.as_str(), false),
    };
    let a: SocketAddr = addr.parse().map_err(|_| {
        setup(format!(
            "--metrics {addr:?}: not an IP:port address (or off)"
        ))
    })?;
    if !a.ip().is_loopback() && !listen_any {
        return Err(setup(format!(
            "--metrics {a}: the metrics port is plaintext HTTP; binding a non-loopback address needs --listen-any"
        )));
    }
    match std::net::TcpListener::bind(a) {
        Ok(l) => {
            l.set_nonblocking(true).map_err(setup)?;
            Ok(Some(l))
        }
        Err(e) if soft => {
            tracing::warn!("node: no metrics port: {a} is taken ({e}); pass --metrics ADDR (port 0 picks one) or --metrics off");
            Ok(None)
        }
        Err(e) => Err(setup(format!("--metrics {a}: cannot bind: {e}"))),
    }
}

/// Errors starting a node (loading its shard later is reported through its status).
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("{0}")]
    Setup(String),
}

fn setup(e: impl std::fmt::Display) -> NodeError {
    NodeError::Setup(e.to_string())
}

/// Runs a node until SIGTERM / SIGINT.
pub fn run(opts: NodeOptions) -> Result<(), NodeError> {
    let me = Identity::load(&opts.certs, &opts.id).map_err(setup)?;
    let cluster = ClusterFile::read(&opts.cluster).map_err(setup)?;
    let man = Manifest::read(&opts.bundle).map_err(setup)?;
    let digest = ternfleet_shared::bundle::manifest_digest(&opts.bundle).map_err(setup)?;
    if let Some(want) = cluster.bundle.as_deref().filter(|w| *w != digest) {
        return Err(setup(format!(
            "{}: the placement is for bundle {want}, {} is {digest}",
            opts.cluster.display(),
            opts.bundle.display()
        )));
    }
    let placement = cluster
        .placement(man.n_layer, man.moe.n_expert)
        .map_err(setup)?;
    // A node the cluster file does not list may still join a control plane (it holds
    // nothing until moves bring it experts).
    let idx = placement.node(&opts.id);
    if idx.is_none() && opts.control.is_none() {
        return Err(setup(format!(
            "--id {}: not a node of {} (its nodes: {}); a new node joins a control plane with --join ADDR",
            opts.id,
            opts.cluster.display(),
            placement
                .nodes
                .iter()
                .map(|n| n.id.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    let listen = match (opts.listen.clone(), idx) {
        (Some(l), _) => l,
        (None, Some(i)) => placement.nodes[i].addr.clone(),
        (None, None) => {
            return Err(setup(format!(
                "--id {}: not in {}, so --listen ADDR is needed",
                opts.id,
                opts.cluster.display()
            )))
        }
    };
    let addr: SocketAddr = listen
        .parse()
        .map_err(|_| setup(format!("--listen {listen:?}: not an IP:port address")))?;
    // One network thread: compute runs on the rayon pool, so nothing blocks it, and the
    // connection driver and the stream tasks then share a thread (no wake-up between them).
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("ternfleet-node-net")
        .enable_all()
        .build()
        .map_err(setup)?;
    let server_cfg = me.server_config().map_err(setup)?;
    let endpoint = {
        let _g = rt.enter();
        ternfleet_shared::net::endpoint(addr, Some(server_cfg))
            .map_err(|e| setup(format!("binding QUIC on {addr}: {e}")))?
    };
    let bound = endpoint.local_addr().map_err(setup)?;
    let metrics_listener = bind_metrics(&opts.metrics, opts.listen_any)?;
    let mut line = serde_json::json!({"ternfleet": "listening", "role": "node", "id": opts.id, "quic": bound.to_string()});
    if let Some(a) = metrics_listener.as_ref().and_then(|l| l.local_addr().ok()) {
        line["metrics"] = serde_json::Value::String(a.to_string());
    }
    println!("{line}");
    // Every kernel table of this build (scalar, AVX2, AVX-512) computes the scalar
    // reference's bits (kernels' tests), so its results may replicate any other node's.
    let svc = Arc::new(Service::new(
        &opts.id,
        ternfleet_kernels::isa_name(),
        true,
        &digest,
        0,
    ));
    // A node that was a member restarts as one without --init-cluster / --join.
    let control = opts.control.clone().or_else(|| {
        let store = opts.state_dir.as_ref()?.join(&opts.id).join("raft.redb");
        store.exists().then(crate::control::ControlOptions::default)
    });
    let member = match &control {
        None => None,
        Some(c) => {
            let dir = opts.state_dir.clone().ok_or_else(|| {
                setup("--init-cluster / --join need a state directory (--state-dir) for the Raft store")
            })?;
            // Peers reach this node at the address it was bound to, or, bound to every
            // interface, at its address in the cluster file.
            let advertise = match idx.filter(|_| bound.ip().is_unspecified()) {
                Some(i) => placement.nodes[i].addr.clone(),
                None => bound.to_string(),
            };
            let seed = ternfleet_control::Command::Seed {
                bundle: Some(digest.clone()),
                file: cluster.clone(),
                n_layer: man.n_layer as u32,
                n_expert: man.moe.n_expert as u32,
            };
            let health: crate::control::Health = {
                let svc = svc.clone();
                Arc::new(move || match svc.state() {
                    NodeState::Ready => Some(false),
                    NodeState::Loading { .. } => Some(true),
                    NodeState::Unavailable(_) => None,
                })
            };
            let m = crate::control::start(
                &me,
                &opts.id,
                &advertise,
                dir,
                endpoint.clone(),
                rt.handle(),
                c,
                crate::control::Role::Node {
                    seed: Some(seed),
                    health,
                },
            )
            .map_err(setup)?;
            Some(m)
        }
    };
    // What to open: a member's committed holdings (a restart: the cluster file may be
    // older than the moves since), else its entry in the cluster file, else nothing yet.
    let from_state = member.as_ref().and_then(|m| {
        let st = m.handle.applied().borrow().clone();
        st.nodes.get(&opts.id).map(|n| {
            (0..man.n_layer)
                .map(|l| {
                    n.experts
                        .get(&(l as u32))
                        .map(|s| s.iter().map(|&e| e as usize).collect())
                        .unwrap_or_default()
                })
                .collect::<Vec<Vec<usize>>>()
        })
    });
    let held: Vec<Vec<usize>> = match (from_state, idx) {
        (Some(h), _) => h,
        (None, Some(i)) => placement.nodes[i]
            .experts
            .iter()
            .map(|s| s.iter().copied().collect())
            .collect(),
        (None, None) => vec![Vec::new(); man.n_layer],
    };
    let total: u64 = man
        .experts
        .iter()
        .filter(|e| held.get(e.layer).is_some_and(|h| h.contains(&e.expert)))
        .map(|e| e.part.bytes)
        .sum();
    svc.progress(0, total);
    tracing::info!(id = %opts.id, quic = %bound, experts = held.iter().map(Vec::len).sum::<usize>(), bytes = total, "node: serving placement from {}", if member.is_some() { "the control plane" } else { "the cluster file" });
    if let Some(l) = metrics_listener {
        let raft = Arc::new(std::sync::Mutex::new(None));
        if let Some(m) = &member {
            let r = raft.clone();
            crate::control::publish_gauges(m.clone(), rt.handle(), move |g| {
                if let Ok(mut r) = r.lock() {
                    *r = Some(g);
                }
            });
        }
        let reg = crate::metrics::registry(svc.clone(), raft);
        let _g = rt.enter();
        let l = tokio::net::TcpListener::from_std(l).map_err(setup)?;
        tracing::info!(
            "node: metrics on http://{}/metrics",
            l.local_addr().map_err(setup)?
        );
        rt.spawn(crate::metrics::serve(l, svc.clone(), reg));
    }
    let allowed = Arc::new(placement.coordinators.clone());
    let permits = Arc::new(tokio::sync::Semaphore::new(MAX_CALLS));
    rt.spawn(accept_loop(
        endpoint.clone(),
        svc.clone(),
        allowed,
        permits.clone(),
        member.clone(),
    ));
    {
        let holdings = Arc::new(holdings(&svc, &opts, Arc::new(man)));
        let opts = opts.clone();
        let follow = match &member {
            Some(m) => {
                let _ = m.blobs.set(holdings.clone());
                let client = me.client_config().map_err(setup)?;
                Some((m.clone(), endpoint.clone(), client, rt.handle().clone()))
            }
            None => None,
        };
        std::thread::Builder::new()
            .name("shard-load".into())
            .spawn(move || {
                if load(&holdings, &opts, held, total) {
                    if let Some((m, endpoint, client, rt)) = follow {
                        crate::moves::follow(holdings, m, endpoint, client, rt);
                    }
                }
            })
            .map_err(setup)?;
    }
    rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .map_err(setup)?;
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        tracing::info!("node: draining");
        // New calls are refused as Unavailable (the coordinator sends them to a replica);
        // running ones finish (every permit back) before the endpoint closes.
        svc.set_state(NodeState::Unavailable("draining".into()));
        let t = Instant::now();
        let _ = tokio::time::timeout(DRAIN, permits.acquire_many(MAX_CALLS as u32)).await;
        endpoint.close(CLOSE_SHUTDOWN.into(), b"node stopping");
        let _ = tokio::time::timeout(Duration::from_secs(1), endpoint.wait_idle()).await;
        tracing::info!("node: stopped after {:.2}s", t.elapsed().as_secs_f64());
        Ok::<_, NodeError>(())
    })?;
    rt.shutdown_timeout(Duration::from_millis(500));
    Ok(())
}

/// The node's holdings (nothing open yet).
fn holdings(svc: &Arc<Service>, opts: &NodeOptions, man: Arc<Manifest>) -> Holdings {
    // Hidden width: an expert's up matrix reads rows of it (ggml ne[0]).
    let n_embd = man
        .experts
        .first()
        .and_then(|e| {
            e.tensors
                .iter()
                .find(|t| t.name == crate::shard::BLOB_TENSORS[1])
        })
        .and_then(|t| t.dims.first())
        .map_or(0, |&d| d as usize);
    let shape = ExpertShape {
        n_embd,
        n_ff: man.moe.n_ff_exp,
        act: opts.act,
        routed: man.moe.gating != Gating::TopKUnit,
    };
    Holdings::new(
        &opts.id,
        opts.bundle.clone(),
        man,
        shape,
        BackendOptions {
            ram_budget: opts.ram_budget,
            evict: opts.evict,
            io_threads: opts.io_threads,
        },
        VerifiedParts::open(
            opts.state_dir.as_ref().map(|s| s.join(&opts.id)).as_deref(),
            &opts.bundle,
        ),
        svc.clone(),
        MoveOptions {
            prune: opts.prune,
            rate: opts.move_rate,
            chunk: opts.move_chunk,
        },
    )
}

/// Opens the shard's experts layer by layer (progress after each), then serves them.
/// `false`: loading failed (the node reports it and serves nothing).
fn load(h: &Holdings, opts: &NodeOptions, held: Vec<Vec<usize>>, total: u64) -> bool {
    let t = Instant::now();
    let man = h.manifest();
    let mut open = Vec::new();
    let mut done = 0u64;
    for (l, es) in held.iter().enumerate() {
        let r = open_experts_with(
            &opts.bundle,
            man,
            h.shape(),
            |ll, e| ll == l && es.binary_search(&e).is_ok(),
            h.verified(),
        );
        match r {
            Ok(v) => {
                // Without a RAM budget the shard is served from its mappings: read it in now,
                // so the node is resident when it says ready (a cold shard's first calls
                // otherwise wait on page faults from disk and can miss the step deadline).
                if opts.ram_budget.is_none() {
                    if let Err(e) = v.par_iter().try_for_each(|(_, _, w)| w.populate()) {
                        tracing::error!("node: reading the shard in failed: {e}");
                        h.svc().set_state(NodeState::Unavailable(format!(
                            "loading failed: reading layer {l}'s experts: {e}"
                        )));
                        return false;
                    }
                }
                done += man
                    .experts
                    .iter()
                    .filter(|p| p.layer == l && es.binary_search(&p.expert).is_ok())
                    .map(|p| p.part.bytes)
                    .sum::<u64>();
                open.extend(v.into_iter().map(|(l, e, w)| ((l as u32, e as u32), w)));
                h.svc().progress(done, total);
            }
            Err(e) => {
                tracing::error!("node: loading the shard failed: {e}");
                h.svc()
                    .set_state(NodeState::Unavailable(format!("loading failed: {e}")));
                return false;
            }
        }
    }
    if let Err(e) = h.verified().save() {
        tracing::warn!("node: could not remember the verified blobs (they are hashed again at the next start): {e}");
    }
    // Logged before the shard is served: whoever sees the node answer finds the line.
    let (hashed, remembered) = h.verified().counts();
    tracing::info!(
        bytes = total,
        "node: ready in {:.2}s ({hashed} blobs hashed, {remembered} verified at an earlier start)",
        t.elapsed().as_secs_f64()
    );
    if let Err(e) = h.install(open) {
        tracing::error!("node: {e}");
        h.svc().set_state(NodeState::Unavailable(e));
        return false;
    }
    true
}

async fn accept_loop(
    endpoint: quinn::Endpoint,
    svc: Arc<Service>,
    allowed: Arc<Vec<String>>,
    permits: Arc<tokio::sync::Semaphore>,
    member: Option<Arc<Member>>,
) {
    while let Some(incoming) = endpoint.accept().await {
        let (svc, allowed, permits) = (svc.clone(), allowed.clone(), permits.clone());
        let member = member.clone();
        tokio::spawn(async move {
            let remote = incoming.remote_address();
            let conn = match tokio::time::timeout(READ_TIMEOUT, incoming).await {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => {
                    tracing::warn!(%remote, "node: handshake refused: {e}");
                    return;
                }
                Err(_) => {
                    tracing::warn!(%remote, "node: handshake timed out");
                    return;
                }
            };
            // Authenticated before any stream is read. The coordinators allowed: the
            // replicated state's once it has them, else the cluster file's.
            let allowed: Vec<String> = match member.as_ref().map(|m| m.handle.applied()) {
                Some(rx) if !rx.borrow().coordinators.is_empty() => {
                    rx.borrow().coordinators.iter().cloned().collect()
                }
                _ => allowed.to_vec(),
            };
            let peer = match mtls::peer_id(&conn, &allowed) {
                Ok(p) => p,
                // Another member of the control plane (the CA vouched for it; each Raft
                // frame and Join is checked against the id its certificate names).
                Err(_) if member.is_some() => {
                    if let Some(m) = member {
                        crate::control::serve_connection(conn, m).await;
                    }
                    return;
                }
                Err(why) => {
                    tracing::warn!(%remote, "node: connection refused: {why}");
                    conn.close(CLOSE_IDENTITY.into(), why.as_bytes());
                    return;
                }
            };
            tracing::info!(%remote, %peer, "node: connection");
            connection(conn, peer, svc, permits, member).await;
        });
    }
}

/// Writes one frame (an error frame if it cannot be encoded) and finishes the stream.
async fn answer(send: &mut quinn::SendStream, frame: &Frame, peer: &str) {
    let bytes = frame.encode().unwrap_or_else(|e| {
        Frame::Error {
            class: ErrorClass::Internal,
            message: e.to_string(),
        }
        .encode()
        .unwrap_or_default()
    });
    if let Err(e) = write_frame(send, &bytes).await {
        tracing::debug!(%peer, "node: stream write: {e}");
    }
}

/// One request stream: read (bounded in size and time), answer. `Hello` is answered at once
/// (a status poll never waits behind compute); a `Call` takes one of the compute permits.
async fn stream(
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    conn: quinn::Connection,
    peer: String,
    svc: Arc<Service>,
    permits: Arc<tokio::sync::Semaphore>,
    member: Option<Arc<Member>>,
) {
    let req = match tokio::time::timeout(READ_TIMEOUT, recv.read_to_end(HEADER + MAX_FRAME)).await {
        Ok(Ok(b)) => b,
        Ok(Err(quinn::ReadToEndError::TooLong)) => {
            let e = Frame::Error {
                class: ErrorClass::BadRequest,
                message: format!("request larger than {} bytes", HEADER + MAX_FRAME),
            };
            answer(&mut send, &e, &peer).await;
            return;
        }
        Ok(Err(e)) => {
            tracing::debug!(%peer, "node: stream read: {e}");
            return;
        }
        Err(_) => {
            let _ = send.reset(0u32.into());
            return;
        }
    };
    let reply = match Frame::decode(&req) {
        Err(e) => Ok(Frame::Error {
            class: ErrorClass::BadRequest,
            message: e.to_string(),
        }),
        Ok(f @ (Frame::Hello { .. } | Frame::ReportQuery)) => svc.handle(&peer, f),
        Ok(Frame::Join { id, addr }) => match &member {
            Some(m) => Ok(crate::control::answer_join(m, &conn, id, addr).await),
            None => Ok(Frame::Error {
                class: ErrorClass::BadRequest,
                message: format!("node {} has no seat in a control plane", svc.id),
            }),
        },
        Ok(f) => {
            svc.calls
                .waiting
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let permit = permits.acquire_owned().await;
            svc.calls
                .waiting
                .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            let Ok(_permit) = permit else {
                return;
            };
            // On a compute (rayon) worker: the call's matmuls split across the pool from
            // there with no further hand-off, and the answer wakes this task. (block_in_place
            // here cost a tokio worker hand-off plus an injection into the pool, two more
            // thread wake-ups on every call's critical path: a decode call of the 30B-shaped
            // model took 2.44 ms on the node against 2.18 ms for the same experts in one
            // process; now 2.18.)
            let (tx, rx) = tokio::sync::oneshot::channel();
            let (svc2, peer2) = (svc.clone(), peer.clone());
            rayon::spawn(move || {
                let run = std::panic::AssertUnwindSafe(|| svc2.handle(&peer2, f));
                let _ = tx.send(std::panic::catch_unwind(run));
            });
            match rx.await {
                Ok(Ok(a)) => a,
                _ => Ok(Frame::Error {
                    class: ErrorClass::Internal,
                    message: format!("node {}: the call panicked", svc.id),
                }),
            }
        }
    };
    match reply {
        Ok(f) => answer(&mut send, &f, &peer).await,
        Err(f) => {
            // The peer broke the protocol (a hello naming another id): say why, then close.
            answer(&mut send, &f, &peer).await;
            tracing::warn!(%peer, "node: closing a connection that broke the protocol");
            let _ = tokio::time::timeout(Duration::from_secs(1), send.stopped()).await;
            conn.close(CLOSE_IDENTITY.into(), b"protocol violation");
        }
    }
}

/// A coordinator's connection: expert calls and hints, and (a seated coordinator's, when this
/// node has a seat too) Raft frames and `Join`.
async fn connection(
    conn: quinn::Connection,
    peer: String,
    svc: Arc<Service>,
    permits: Arc<tokio::sync::Semaphore>,
    member: Option<Arc<Member>>,
) {
    loop {
        tokio::select! {
            bi = conn.accept_bi() => match bi {
                Ok((send, recv)) => {
                    tokio::spawn(stream(send, recv, conn.clone(), peer.clone(), svc.clone(), permits.clone(), member.clone()));
                }
                Err(e) => {
                    tracing::debug!(%peer, "node: connection closed: {e}");
                    return;
                }
            },
            uni = conn.accept_uni() => match uni {
                Ok(mut recv) => {
                    let (svc, peer, member, conn) = (svc.clone(), peer.clone(), member.clone(), conn.clone());
                    tokio::spawn(async move {
                        // A hint names at most MAX_HINT experts: a few hundred KiB at most;
                        // a Raft frame (with a seat) up to the Raft limit.
                        let cap = match member {
                            Some(_) => ternfleet_control::quic::MAX_RAFT_FRAME,
                            None => HEADER + 8 + 4 * ternfleet_shared::wire::MAX_HINT,
                        };
                        if let Ok(Ok(b)) = tokio::time::timeout(READ_TIMEOUT, recv.read_to_end(cap)).await {
                            match (Frame::decode(&b), member) {
                                (Ok(f @ Frame::Hint { .. }), _) => {
                                    let _ = svc.handle(&peer, f);
                                }
                                (Ok(f @ Frame::Raft { .. }), Some(m)) => {
                                    if let Err(e) = m.transport.receive(&conn, f) {
                                        tracing::warn!(%peer, "node: {e}");
                                    }
                                }
                                _ => {}
                            }
                        }
                    });
                }
                Err(_) => return,
            },
        }
    }
}
