//! Raft messages over the cluster's QUIC connections (mutual TLS against the cluster CA).
//!
//! Each message travels as one [`Frame::Raft`] on a uni-stream of its own (Raft tolerates loss
//! and reordering; a stream per message keeps a large snapshot from holding up heartbeats).
//! Outgoing: one task and one bounded queue per peer ([`PEER_QUEUE`]; a full queue drops the
//! message, Raft resends), connecting on demand to the address the replicated state gives for
//! that peer, or reusing the connection the peer opened to us (a member that just joined knows
//! no addresses until the leader's snapshot arrives, but the leader has already connected).
//! Incoming: the server's accept loop hands each authenticated connection to
//! [`QuicRaft::serve_connection`]; a frame whose `from` is not named by the connection's
//! certificate, or whose `to` is not this member, is refused.
//!
//! A member's Raft id is derived from its id ([`raft_id`]): no id allocation protocol, and a
//! certificate (which names the id) fixes the Raft id its holder may speak for.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

use ternfleet_shared::mtls;
use ternfleet_shared::net::{write_frame, CONNECT_TIMEOUT};
use ternfleet_shared::wire::Frame;

use crate::driver::{ControlHandle, RaftTransport};
use crate::replica::Outgoing;

/// Messages queued per peer before new ones are dropped.
pub const PEER_QUEUE: usize = 1024;
/// Largest Raft frame read from a peer: the replica's own message limit plus the frame's
/// fields (below the wire's 256 MiB, so 64 streams of a peer cannot pin 16 GiB).
pub const MAX_RAFT_FRAME: usize = crate::replica::MAX_MESSAGE_BYTES + 4096;
/// Longest a message (a snapshot included) may take to go out.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(10);

/// The Raft id of the member with this id: 63 bits of its SHA-256, never 0.
pub fn raft_id(id: &str) -> u64 {
    let h = Sha256::digest(id.as_bytes());
    let mut b = [0u8; 8];
    b.copy_from_slice(&h[..8]);
    (u64::from_le_bytes(b) >> 1).max(1)
}

/// Finds a member's id and QUIC address from its Raft id (the replicated state, static seeds).
pub type Resolver = Arc<dyn Fn(u64) -> Option<(String, String)> + Send + Sync>;

struct Shared {
    me: String,
    me_raft: u64,
    endpoint: quinn::Endpoint,
    client: quinn::ClientConfig,
    resolve: Resolver,
    /// Open connections by the peer's Raft id (either direction).
    conns: Mutex<HashMap<u64, quinn::Connection>>,
    control: OnceLock<ControlHandle>,
}

/// The QUIC transport of one member.
pub struct QuicRaft {
    shared: Arc<Shared>,
    rt: tokio::runtime::Handle,
    links: Mutex<HashMap<u64, mpsc::Sender<Outgoing>>>,
}

impl QuicRaft {
    /// A transport for member `me` on `endpoint` (the process's QUIC endpoint), dialling with
    /// `client`; tasks run on `rt`.
    pub fn new(
        me: &str,
        endpoint: quinn::Endpoint,
        client: quinn::ClientConfig,
        resolve: Resolver,
        rt: tokio::runtime::Handle,
    ) -> Arc<QuicRaft> {
        Arc::new(QuicRaft {
            shared: Arc::new(Shared {
                me: me.to_string(),
                me_raft: raft_id(me),
                endpoint,
                client,
                resolve,
                conns: Mutex::new(HashMap::new()),
                control: OnceLock::new(),
            }),
            rt,
            links: Mutex::new(HashMap::new()),
        })
    }

    /// Connects the transport to the member it serves (reports and received messages go
    /// there). Once only.
    pub fn attach(&self, handle: ControlHandle) {
        let _ = self.shared.control.set(handle);
    }

    /// Reads Raft frames from the uni-streams of an authenticated connection until it closes.
    pub async fn serve_connection(self: Arc<Self>, conn: quinn::Connection) {
        serve(self.shared.clone(), conn).await;
    }

    /// Takes one Raft frame read elsewhere (a coordinator's connection, which carries expert
    /// calls too): checked as on [`QuicRaft::serve_connection`]'s streams.
    pub fn receive(&self, conn: &quinn::Connection, frame: Frame) -> Result<(), String> {
        self.shared.receive(conn, frame)
    }
}

impl Shared {
    /// Handles one Raft frame received on a connection whose certificate `conn` carries.
    fn receive(&self, conn: &quinn::Connection, frame: Frame) -> Result<(), String> {
        let Frame::Raft { from, to, msg } = frame else {
            return Err("not a Raft frame".into());
        };
        mtls::peer_id(conn, std::slice::from_ref(&from))
            .map_err(|e| format!("Raft frame from {from:?}: {e}"))?;
        if to != self.me_raft {
            return Err(format!(
                "Raft frame for member {to}, this is {} ({})",
                self.me_raft, self.me
            ));
        }
        let peer = raft_id(&from);
        {
            let mut conns = lock(&self.conns);
            let stale = conns.get(&peer).is_none_or(|c| c.close_reason().is_some());
            if stale {
                conns.insert(peer, conn.clone());
            }
        }
        let control = self
            .control
            .get()
            .ok_or("the Raft member is not running yet")?;
        control.deliver(msg).map_err(|e| e.to_string())
    }
}

/// Reads Raft frames from the uni-streams of a connection (either direction) until it closes.
async fn serve(s: Arc<Shared>, conn: quinn::Connection) {
    while let Ok(mut recv) = conn.accept_uni().await {
        let s = s.clone();
        let conn = conn.clone();
        tokio::spawn(async move {
            let read = async {
                let b = recv
                    .read_to_end(MAX_RAFT_FRAME)
                    .await
                    .map_err(|e| e.to_string())?;
                Frame::decode(&b).map_err(|e| e.to_string())
            };
            match tokio::time::timeout(SEND_TIMEOUT, read).await {
                Ok(Ok(f @ Frame::Raft { .. })) => {
                    if let Err(e) = s.receive(&conn, f) {
                        tracing::warn!("{e}");
                    }
                }
                Ok(Ok(_)) => tracing::warn!("a non-Raft frame on a Raft stream"),
                Ok(Err(e)) => tracing::warn!("Raft stream: {e}"),
                Err(_) => tracing::warn!("Raft stream: no frame within {SEND_TIMEOUT:?}"),
            }
        });
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl RaftTransport for QuicRaft {
    fn send(&self, _from: u64, msg: Outgoing) {
        let to = msg.to;
        let snapshot = msg.snapshot;
        let mut links = lock(&self.links);
        let tx = links.entry(to).or_insert_with(|| {
            let (tx, rx) = mpsc::channel(PEER_QUEUE);
            self.rt.spawn(link(self.shared.clone(), to, rx));
            tx
        });
        if tx.try_send(msg).is_err() {
            if let Some(c) = self.shared.control.get() {
                if snapshot {
                    c.report_snapshot(to, false);
                }
            }
        }
    }
}

async fn connection(s: &Arc<Shared>, to: u64) -> Result<quinn::Connection, String> {
    if let Some(c) = lock(&s.conns)
        .get(&to)
        .filter(|c| c.close_reason().is_none())
    {
        return Ok(c.clone());
    }
    let (id, addr) = (s.resolve)(to).ok_or_else(|| format!("no address known for member {to}"))?;
    let sock = tokio::net::lookup_host(&addr)
        .await
        .map_err(|e| format!("{id} at {addr}: {e}"))?
        .next()
        .ok_or_else(|| format!("{id} at {addr}: no address"))?;
    let connecting = s
        .endpoint
        .connect_with(s.client.clone(), sock, &id)
        .map_err(|e| format!("{id} at {addr}: {e}"))?;
    let conn = tokio::time::timeout(CONNECT_TIMEOUT, connecting)
        .await
        .map_err(|_| format!("{id} at {addr}: no handshake within {CONNECT_TIMEOUT:?}"))?
        .map_err(|e| format!("{id} at {addr}: {e}"))?;
    lock(&s.conns).insert(to, conn.clone());
    // The peer may answer on this connection too.
    tokio::spawn(serve(s.clone(), conn.clone()));
    Ok(conn)
}

/// Sends one peer's messages in order, reconnecting as needed.
async fn link(s: Arc<Shared>, to: u64, mut rx: mpsc::Receiver<Outgoing>) {
    while let Some(m) = rx.recv().await {
        let frame = Frame::Raft {
            from: s.me.clone(),
            to,
            msg: m.bytes,
        }
        .encode();
        let sent = async {
            let frame = frame.map_err(|e| e.to_string())?;
            let conn = connection(&s, to).await?;
            let mut stream = conn.open_uni().await.map_err(|e| e.to_string())?;
            write_frame(&mut stream, &frame).await
        };
        let r = tokio::time::timeout(SEND_TIMEOUT, sent)
            .await
            .unwrap_or_else(|_| Err(format!("not sent within {SEND_TIMEOUT:?}")));
        let control = s.control.get();
        if m.snapshot {
            if let Some(c) = control {
                c.report_snapshot(to, r.is_ok());
            }
        }
        if let Err(e) = r {
            tracing::debug!(to, "Raft message not sent: {e}");
            lock(&s.conns).remove(&to);
            if let Some(c) = control {
                c.report_unreachable(to);
            }
            // Do not spin on a dead peer: Raft resends what matters. A dropped snapshot is
            // reported, or the leader would wait for it forever.
            tokio::time::sleep(Duration::from_millis(100)).await;
            while let Ok(dropped) = rx.try_recv() {
                if dropped.snapshot {
                    if let Some(c) = control {
                        c.report_snapshot(to, false);
                    }
                }
            }
        }
    }
}
