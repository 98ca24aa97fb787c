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

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ternfleet_shared::bundle::{Gating, Manifest};
use ternfleet_shared::cluster::ClusterFile;
use ternfleet_shared::error::ErrorClass;
use ternfleet_shared::expert::ExpertBackend;
use ternfleet_shared::mtls::{self, Identity};
use ternfleet_shared::net::{write_frame, CLOSE_IDENTITY, CLOSE_SHUTDOWN};
use ternfleet_shared::wire::{Frame, NodeState, HEADER, MAX_FRAME};

use crate::control::Member;
use crate::expert::{Activation, LocalExperts};
use crate::service::{Service, Shard};
use crate::shard::{open_experts_with, ExpertShape};
use crate::store::{Evict, StoreExperts};
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
    /// Where the node remembers which blobs it verified (`None`: hash every start), and keeps
    /// its Raft store (`ID/raft.redb`) when it is a control-plane member.
    pub state_dir: Option<PathBuf>,
    /// A seat in the control plane's Raft group (`--init-cluster`, `--join ADDR`); `None`:
    /// the static cluster file only.
    pub control: Option<crate::control::ControlOptions>,
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
    let idx = placement.node(&opts.id).ok_or_else(|| {
        setup(format!(
            "--id {}: not a node of {} (its nodes: {})",
            opts.id,
            opts.cluster.display(),
            placement
                .nodes
                .iter()
                .map(|n| n.id.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ))
    })?;
    let held: Vec<Vec<usize>> = placement.nodes[idx]
        .experts
        .iter()
        .map(|s| s.iter().copied().collect())
        .collect();
    let listen = opts
        .listen
        .clone()
        .unwrap_or_else(|| placement.nodes[idx].addr.clone());
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
    println!(
        "{}",
        serde_json::json!({"ternfleet": "listening", "role": "node", "id": opts.id, "quic": bound.to_string()})
    );
    let total: u64 = man
        .experts
        .iter()
        .filter(|e| held.get(e.layer).is_some_and(|h| h.contains(&e.expert)))
        .map(|e| e.part.bytes)
        .sum();
    // Every kernel table of this build (scalar, AVX2, AVX-512) computes the scalar
    // reference's bits (kernels' tests), so its results may replicate any other node's.
    let svc = Arc::new(Service::new(
        &opts.id,
        ternfleet_kernels::isa_name(),
        true,
        &digest,
        total,
    ));
    tracing::info!(id = %opts.id, quic = %bound, experts = held.iter().map(Vec::len).sum::<usize>(), bytes = total, "node: serving placement from {}", opts.cluster.display());
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
            let advertise = if bound.ip().is_unspecified() {
                placement.nodes[idx].addr.clone()
            } else {
                bound.to_string()
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
        let svc = svc.clone();
        let opts = opts.clone();
        std::thread::Builder::new()
            .name("shard-load".into())
            .spawn(move || load(&svc, &opts, &man, held, total))
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

/// Opens the shard's experts layer by layer (progress after each), then serves them.
fn load(svc: &Service, opts: &NodeOptions, man: &Manifest, held: Vec<Vec<usize>>, total: u64) {
    let t = Instant::now();
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
    let mut layers = Vec::with_capacity(held.len());
    let mut done = 0u64;
    let verified = VerifiedParts::open(opts.state_dir.as_deref(), &opts.bundle);
    for (l, es) in held.iter().enumerate() {
        let r = open_experts_with(
            &opts.bundle,
            man,
            shape,
            |ll, e| ll == l && es.binary_search(&e).is_ok(),
            &verified,
        );
        match r {
            Ok(v) => {
                done += man
                    .experts
                    .iter()
                    .filter(|p| p.layer == l && es.binary_search(&p.expert).is_ok())
                    .map(|p| p.part.bytes)
                    .sum::<u64>();
                layers.push(v.into_iter().map(|(_, _, w)| w).collect::<Vec<_>>());
                svc.progress(done, total);
            }
            Err(e) => {
                tracing::error!("node: loading the shard failed: {e}");
                svc.set_state(NodeState::Unavailable(format!("loading failed: {e}")));
                return;
            }
        }
    }
    if let Err(e) = verified.save() {
        tracing::warn!("node: could not remember the verified blobs (they are hashed again at the next start): {e}");
    }
    let backend: Box<dyn ExpertBackend> = match opts.ram_budget {
        None => Box::new(LocalExperts::new(layers)),
        Some(b) => {
            match StoreExperts::new(layers, usize::MAX, b, opts.evict, opts.io_threads.max(1)) {
                Ok(s) => Box::new(s),
                Err(e) => {
                    tracing::error!("node: expert store: {e}");
                    svc.set_state(NodeState::Unavailable(format!("expert store: {e}")));
                    return;
                }
            }
        }
    };
    svc.ready(Shard::new(backend, &held, man.moe.n_expert));
    let (hashed, remembered) = verified.counts();
    tracing::info!(
        bytes = total,
        "node: ready in {:.2}s ({hashed} blobs hashed, {remembered} verified at an earlier start)",
        t.elapsed().as_secs_f64()
    );
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
            // Authenticated before any stream is read.
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
        Ok(f @ Frame::Hello { .. }) => svc.handle(&peer, f),
        Ok(Frame::Join { id, addr }) => match &member {
            Some(m) => Ok(crate::control::answer_join(m, &conn, id, addr).await),
            None => Ok(Frame::Error {
                class: ErrorClass::BadRequest,
                message: format!("node {} has no seat in a control plane", svc.id),
            }),
        },
        Ok(f) => {
            let Ok(_permit) = permits.acquire_owned().await else {
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
