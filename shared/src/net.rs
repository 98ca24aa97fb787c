//! Cluster networking: frames over QUIC streams, and the [`Transport`] through which the
//! coordinator's remote expert backend reaches its nodes.
//!
//! The transport is a trait so the failover logic above it is tested without sockets (an
//! in-memory implementation that drops, delays and partitions, seeded, lives with those
//! tests); [`QuicTransport`] is the real one: one QUIC connection per node (mutual TLS,
//! [`crate::mtls`]), opened on first use and again after it breaks, one bi-stream per call.
//! Each connection starts with a `Hello` whose answer must come from the node's own id.
//! Nothing here blocks a caller: [`Transport::send`] returns a channel at once, and every
//! network wait is bounded (connect, handshake, the call's own deadline).

use std::net::SocketAddr;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::error::ErrorClass;
use crate::mtls::Identity;
use crate::wire::{Frame, NodeState, WireError, HEADER, MAX_FRAME};

/// How long opening a connection (resolve, QUIC + TLS handshake, `Hello`) may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// QUIC application error codes a node closes a connection with.
pub const CLOSE_IDENTITY: u32 = 1;
pub const CLOSE_SHUTDOWN: u32 = 2;

/// Why a call to a node did not return a result frame.
#[derive(Clone, Debug, thiserror::Error)]
pub enum NetError {
    #[error("node {node} ({addr}): cannot connect: {msg}")]
    Connect {
        node: String,
        addr: String,
        msg: String,
    },
    #[error("node {node}: connection lost: {msg}")]
    Lost { node: String, msg: String },
    #[error("node {node}: no answer within {waited:?}")]
    Timeout { node: String, waited: Duration },
    #[error("node {node}: {err}")]
    Wire { node: String, err: WireError },
    #[error("node {node}: unexpected answer: {msg}")]
    Protocol { node: String, msg: String },
}

impl NetError {
    /// Every transport failure is worth a retry on a replica.
    pub fn class(&self) -> ErrorClass {
        match self {
            NetError::Timeout { .. } => ErrorClass::Timeout,
            _ => ErrorClass::Unavailable,
        }
    }
}

/// The largest UDP payload an endpoint accepts. quinn's default (1,472: Ethernet) also caps
/// path-MTU discovery whatever its own upper bound (`mtls::MTU_UPPER_BOUND`), so a layer's
/// results crossed loopback or a jumbo-frame LAN as 1,472-byte packets. (quinn sizes its
/// receive buffers by this, so it is no larger than discovery may reach.)
pub const MAX_UDP_PAYLOAD: u16 = crate::mtls::MTU_UPPER_BOUND;

/// Socket buffers asked for, each way.
pub const SOCKET_BUFFER: usize = 4 << 20;

/// A QUIC endpoint bound to `addr` (a server when `server` is given), inside the current tokio
/// runtime, accepting datagrams up to [`MAX_UDP_PAYLOAD`].
pub fn endpoint(
    addr: SocketAddr,
    server: Option<quinn::ServerConfig>,
) -> std::io::Result<quinn::Endpoint> {
    let mut cfg = quinn::EndpointConfig::default();
    cfg.max_udp_payload_size(MAX_UDP_PAYLOAD)
        .map_err(|e| std::io::Error::other(format!("QUIC endpoint: {e}")))?;
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::DGRAM,
        Some(socket2::Protocol::UDP),
    )?;
    // Room for a burst of a large answer (a prefill's results are megabytes; the default
    // ~208 KB overflowed on loopback: UDP RcvbufErrors); the kernel caps these at
    // net.core.{r,w}mem_max, which is no error.
    socket.set_recv_buffer_size(SOCKET_BUFFER)?;
    socket.set_send_buffer_size(SOCKET_BUFFER)?;
    socket.bind(&addr.into())?;
    quinn::Endpoint::new(cfg, server, socket.into(), Arc::new(quinn::TokioRuntime))
}

/// The answer to one request: a frame from the node (a `Result`, `Status` or `Error`), or
/// why none came.
pub type Reply = Result<Frame, NetError>;

/// How the coordinator reaches nodes `0..n` (indices into its placement).
pub trait Transport: Send + Sync {
    /// Sends an encoded request frame to `node` on a stream of its own; the answer arrives
    /// on the returned channel (one message), or an error by `deadline` at the latest.
    /// Returns at once.
    fn send(&self, node: usize, request: Arc<Vec<u8>>, deadline: Instant) -> Receiver<Reply>;
    /// Fire and forget (prefetch hints): no answer, failures ignored.
    fn hint(&self, node: usize, frame: Vec<u8>);
    /// Brings the node list to `nodes` (id, `host:port`) in index order, when the placement
    /// changed: the list only grows at its end (a node keeps its index for the transport's
    /// life), and a changed address is used from the next connection. A transport with a
    /// fixed list (the tests' in-memory one) refuses.
    fn set_nodes(&self, nodes: &[(String, String)]) -> Result<(), String> {
        let _ = nodes;
        Err("this transport's node list is fixed".into())
    }
}

/// Reads one frame: the stream's bytes up to its end (the sender finishes after one frame),
/// at most a header plus [`MAX_FRAME`].
pub async fn read_frame(recv: &mut quinn::RecvStream) -> Result<Frame, String> {
    let bytes = recv
        .read_to_end(HEADER + MAX_FRAME)
        .await
        .map_err(|e| e.to_string())?;
    Frame::decode(&bytes).map_err(|e| e.to_string())
}

/// Writes one frame and finishes the stream.
pub async fn write_frame(send: &mut quinn::SendStream, bytes: &[u8]) -> Result<(), String> {
    send.write_all(bytes).await.map_err(|e| e.to_string())?;
    send.finish().map_err(|e| e.to_string())
}

/// What a node said about itself at its last `Hello`.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeStatus {
    pub kernels: String,
    pub exact: bool,
    pub state: NodeState,
}

struct Peer {
    id: String,
    addr: Mutex<String>,
    conn: tokio::sync::Mutex<Option<quinn::Connection>>,
    status: Mutex<Option<NodeStatus>>,
}

struct Inner {
    endpoint: quinn::Endpoint,
    client: quinn::ClientConfig,
    me: String,
    peers: std::sync::RwLock<Vec<Arc<Peer>>>,
}

/// The QUIC transport (see the module docs).
pub struct QuicTransport {
    rt: Option<tokio::runtime::Runtime>,
    inner: Arc<Inner>,
}

impl QuicTransport {
    /// A client endpoint for `me` reaching `nodes` (id, `host:port`). Opens nothing yet.
    pub fn new(me: &Identity, nodes: &[(String, String)]) -> Result<QuicTransport, String> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("ternfleet-net")
            .enable_all()
            .build()
            .map_err(|e| format!("network runtime: {e}"))?;
        let client = me.client_config().map_err(|e| e.to_string())?;
        let endpoint = {
            let _g = rt.enter();
            endpoint(SocketAddr::from(([0, 0, 0, 0], 0)), None)
                .map_err(|e| format!("QUIC client endpoint: {e}"))?
        };
        let peers = nodes.iter().map(|(id, addr)| Peer::new(id, addr)).collect();
        Ok(QuicTransport {
            rt: Some(rt),
            inner: Arc::new(Inner {
                endpoint,
                client,
                me: me.id.clone(),
                peers: std::sync::RwLock::new(peers),
            }),
        })
    }

    fn rt(&self) -> &tokio::runtime::Runtime {
        self.rt.as_ref().expect("the runtime lives until drop")
    }

    /// What node `i` reported at its last `Hello` (connect or [`QuicTransport::poll`]).
    pub fn status(&self, node: usize) -> Option<NodeStatus> {
        self.inner.peer(node)?.status.lock().ok()?.clone()
    }

    /// Asks node `i` for its status now (connecting if needed), waiting at most `timeout`.
    pub fn poll(&self, node: usize, timeout: Duration) -> Result<NodeStatus, NetError> {
        let peer = self.inner.peer_or_err(node)?;
        let fut = {
            let peer = peer.clone();
            let inner = self.inner.clone();
            async move {
                let conn = inner.connection(&peer).await?;
                inner.hello(&peer, &conn).await
            }
        };
        self.rt()
            .block_on(async { tokio::time::timeout(timeout, fut).await })
            .unwrap_or_else(|_| {
                Err(NetError::Timeout {
                    node: peer.id.clone(),
                    waited: timeout,
                })
            })
    }
}

impl Drop for QuicTransport {
    fn drop(&mut self) {
        self.inner
            .endpoint
            .close(0u32.into(), b"coordinator stopping");
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_millis(200));
        }
    }
}

impl Peer {
    fn new(id: &str, addr: &str) -> Arc<Peer> {
        Arc::new(Peer {
            id: id.to_string(),
            addr: Mutex::new(addr.to_string()),
            conn: tokio::sync::Mutex::new(None),
            status: Mutex::new(None),
        })
    }

    fn addr(&self) -> String {
        self.addr.lock().map(|a| a.clone()).unwrap_or_default()
    }
}

impl Inner {
    fn peer(&self, i: usize) -> Option<Arc<Peer>> {
        self.peers.read().ok()?.get(i).cloned()
    }

    fn peer_or_err(&self, i: usize) -> Result<Arc<Peer>, NetError> {
        self.peer(i).ok_or_else(|| NetError::Protocol {
            node: format!("#{i}"),
            msg: "no such node in the transport".into(),
        })
    }

    /// The open connection to `p`, or a new one (handshake and `Hello` checked).
    async fn connection(&self, p: &Peer) -> Result<quinn::Connection, NetError> {
        let mut slot = p.conn.lock().await;
        if let Some(c) = slot.as_ref() {
            if c.close_reason().is_none() {
                return Ok(c.clone());
            }
        }
        *slot = None;
        let target = p.addr();
        let err = |msg: String| NetError::Connect {
            node: p.id.clone(),
            addr: target.clone(),
            msg,
        };
        let connect = async {
            // The client endpoint is IPv4 (0.0.0.0:0): take the name's IPv4 address.
            let addr = tokio::net::lookup_host(&target)
                .await
                .map_err(|e| err(format!("resolving: {e}")))?
                .find(SocketAddr::is_ipv4)
                .ok_or_else(|| err("the name resolves to no IPv4 address".into()))?;
            let conn = self
                .endpoint
                .connect_with(self.client.clone(), addr, &p.id)
                .map_err(|e| err(e.to_string()))?
                .await
                .map_err(|e| err(e.to_string()))?;
            self.hello(p, &conn).await?;
            Ok::<_, NetError>(conn)
        };
        let conn = tokio::time::timeout(CONNECT_TIMEOUT, connect)
            .await
            .map_err(|_| err(format!("no handshake within {CONNECT_TIMEOUT:?}")))??;
        tracing::info!(node = %p.id, addr = %target, "connected");
        *slot = Some(conn.clone());
        Ok(conn)
    }

    /// `Hello` on `conn`: the answer must be a `Status` from node `p`'s own id.
    async fn hello(&self, p: &Peer, conn: &quinn::Connection) -> Result<NodeStatus, NetError> {
        let hello = Frame::Hello {
            id: self.me.clone(),
        }
        .encode()
        .map_err(|err| NetError::Wire {
            node: p.id.clone(),
            err,
        })?;
        match exchange(conn, &p.id, &hello).await? {
            Frame::Status {
                id,
                kernels,
                exact,
                state,
                ..
            } if id == p.id => {
                let s = NodeStatus {
                    kernels,
                    exact,
                    state,
                };
                if let Ok(mut g) = p.status.lock() {
                    *g = Some(s.clone());
                }
                Ok(s)
            }
            Frame::Status { id, .. } => Err(NetError::Protocol {
                node: p.id.clone(),
                msg: format!("it says it is {id:?}"),
            }),
            Frame::Error { message, .. } => Err(NetError::Protocol {
                node: p.id.clone(),
                msg: format!("hello refused: {message}"),
            }),
            other => Err(NetError::Protocol {
                node: p.id.clone(),
                msg: format!("{other:?} in answer to hello"),
            }),
        }
    }
}

/// One request / answer on a new bi-stream of `conn`.
async fn exchange(conn: &quinn::Connection, node: &str, req: &[u8]) -> Reply {
    let lost = |msg: String| NetError::Lost {
        node: node.to_string(),
        msg,
    };
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| lost(e.to_string()))?;
    write_frame(&mut send, req).await.map_err(lost)?;
    let bytes = recv
        .read_to_end(HEADER + MAX_FRAME)
        .await
        .map_err(|e| lost(e.to_string()))?;
    Frame::decode(&bytes).map_err(|err| NetError::Wire {
        node: node.to_string(),
        err,
    })
}

impl Transport for QuicTransport {
    fn send(&self, node: usize, request: Arc<Vec<u8>>, deadline: Instant) -> Receiver<Reply> {
        let (tx, rx): (SyncSender<Reply>, _) = sync_channel(1);
        let inner = self.inner.clone();
        let peer = match inner.peer_or_err(node) {
            Ok(p) => p,
            Err(e) => {
                let _ = tx.send(Err(e));
                return rx;
            }
        };
        let id = peer.id.clone();
        self.rt().spawn(async move {
            let waited = deadline.saturating_duration_since(Instant::now());
            let timeout = || NetError::Timeout {
                node: id.clone(),
                waited,
            };
            let conn = match tokio::time::timeout(waited, inner.connection(&peer)).await {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => {
                    let _ = tx.send(Err(e));
                    return;
                }
                Err(_) => {
                    let _ = tx.send(Err(timeout()));
                    return;
                }
            };
            let left = deadline.saturating_duration_since(Instant::now());
            let r = tokio::time::timeout(left, exchange(&conn, &peer.id, &request))
                .await
                .unwrap_or_else(|_| Err(timeout()));
            if matches!(r, Err(NetError::Lost { .. } | NetError::Timeout { .. })) {
                // Broken or stalled: drop the connection so the next call (or the prober)
                // connects afresh — a restarted node is then reached at once.
                let mut slot = peer.conn.lock().await;
                if slot
                    .as_ref()
                    .is_some_and(|c| c.stable_id() == conn.stable_id())
                {
                    conn.close(0u32.into(), b"call failed");
                    *slot = None;
                }
            }
            let _ = tx.send(r);
        });
        rx
    }

    fn hint(&self, node: usize, frame: Vec<u8>) {
        let Some(peer) = self.inner.peer(node) else {
            return;
        };
        self.rt().spawn(async move {
            // Only on an open connection: a hint is not worth a connect.
            let conn = match peer.conn.try_lock() {
                Ok(g) => g.clone(),
                Err(_) => None,
            };
            if let Some(conn) = conn {
                if let Ok(mut s) = conn.open_uni().await {
                    let _ = write_frame(&mut s, &frame).await;
                }
            }
        });
    }

    fn set_nodes(&self, nodes: &[(String, String)]) -> Result<(), String> {
        let mut peers = self
            .inner
            .peers
            .write()
            .map_err(|_| "poisoned".to_string())?;
        for (i, (id, addr)) in nodes.iter().enumerate() {
            match peers.get(i) {
                Some(p) if p.id == *id => {
                    if p.addr() != *addr {
                        tracing::info!(node = %id, %addr, "node moved: connecting there from now on");
                        if let Ok(mut a) = p.addr.lock() {
                            a.clone_from(addr);
                        }
                        // The next call connects afresh, to the new address.
                        if let Ok(mut c) = p.conn.try_lock() {
                            if let Some(c) = c.take() {
                                c.close(0u32.into(), b"node moved");
                            }
                        }
                    }
                }
                Some(p) => {
                    return Err(format!(
                        "node #{i} is {}, the new list says {id}: the list may only grow",
                        p.id
                    ))
                }
                None => peers.push(Peer::new(id, addr)),
            }
        }
        Ok(())
    }
}
