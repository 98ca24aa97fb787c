//! The cluster wire protocol: typed, versioned, length-prefixed frames between the coordinator
//! and the nodes (../shared/TESTING.md "Worker protocol": high-level messages whose shapes are
//! checked, never pointers, op codes or graphs).
//!
//! Every frame is an 8-byte header — magic `TF`, [`VERSION`], kind, payload length (u32 LE) —
//! then the payload, little-endian throughout. Every length is capped before anything is
//! allocated ([`MAX_FRAME`], [`MAX_ROUTES`], [`MAX_TEXT`]); decoding never panics (a proptest
//! feeds it arbitrary bytes) and a frame that does not parse is an error for that stream
//! only.
//!
//! One QUIC bi-stream carries one exchange: the coordinator writes a request frame and
//! finishes its side; the node answers with one frame. Hints travel on uni-streams, with no
//! answer. Activations cross as the bytes the kernels read (the coordinator quantized them to
//! the experts' dot type), results as f32 rows, one per route in the call's route order, so a
//! remote expert computes the same bits as a local one.

use ternfleet_kernels::{GgmlType, Numerics};

use crate::error::ErrorClass;

/// First two bytes of every frame.
pub const MAGIC: [u8; 2] = *b"TF";
/// The protocol version this build speaks; a frame of another version is refused.
pub const VERSION: u8 = 1;
/// Header bytes before the payload.
pub const HEADER: usize = 8;
/// Largest payload accepted (a 512-row prefill of a 2048-wide model with top-8 experts
/// returns 32 MiB of results).
pub const MAX_FRAME: usize = 256 << 20;
/// Most routes in one call.
pub const MAX_ROUTES: usize = 1 << 20;
/// Longest string (ids, messages).
pub const MAX_TEXT: usize = 4096;
/// Most experts named in one hint.
pub const MAX_HINT: usize = 1 << 16;

/// Frame kinds (the header's fourth byte).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Kind {
    Hello = 1,
    Status = 2,
    Call = 3,
    Result = 4,
    Error = 5,
    Hint = 6,
    Raft = 7,
    Join = 8,
    Joined = 9,
    Fetch = 10,
    Blob = 11,
    ReportQuery = 12,
    Report = 13,
    TracedCall = 14,
}

/// A node's state as it reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeState {
    /// Serving its experts.
    Ready,
    /// Opening its shard: `done` of `total` bytes.
    Loading { done: u64, total: u64 },
    /// Not serving (draining, or its shard failed to open), with the reason.
    Unavailable(String),
}

/// One (row, expert) pair of a call: row `token` of the call's input through `expert`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WireRoute {
    pub token: u32,
    pub expert: u32,
}

/// A layer's rows for one node.
#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    pub layer: u32,
    pub numerics: Numerics,
    /// The activation type of `input` (the experts' dot type, or f32).
    pub ty: GgmlType,
    pub n_tokens: u32,
    pub cols: u32,
    pub routes: Vec<WireRoute>,
    /// `n_tokens` rows of `cols` values of `ty`, back to back.
    pub input: Vec<u8>,
    /// The calling span's W3C `traceparent` when the coordinator exports traces: the frame
    /// is then a `TracedCall` (a kind of its own, so a node of an older release only ever
    /// sees it from a coordinator that was asked to trace).
    pub trace: Option<String>,
}

/// What a node reports of itself for the coordinator's console (`Report`): cumulative
/// counters and current gauges. A node of an older release answers the query with an error
/// (unknown frame kind), which the coordinator takes as "no report".
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct NodeReport {
    /// Experts it serves.
    pub held: u64,
    /// Its expert store (zeros without `--ram-budget`): budget, bytes used, experts resident,
    /// demands by result, bytes read from disk.
    pub budget_bytes: u64,
    pub used_bytes: u64,
    pub resident: u64,
    pub hits: u64,
    pub waits: u64,
    pub misses: u64,
    pub read_bytes: u64,
    /// Calls answered, routes computed, calls waiting for a compute slot.
    pub calls: u64,
    pub routes: u64,
    pub queue: u64,
}

impl NodeReport {
    const FIELDS: usize = 11;

    fn values(&self) -> [u64; Self::FIELDS] {
        [
            self.held,
            self.budget_bytes,
            self.used_bytes,
            self.resident,
            self.hits,
            self.waits,
            self.misses,
            self.read_bytes,
            self.calls,
            self.routes,
            self.queue,
        ]
    }

    fn from_values(v: [u64; Self::FIELDS]) -> NodeReport {
        let [held, budget_bytes, used_bytes, resident, hits, waits, misses, read_bytes, calls, routes, queue] =
            v;
        NodeReport {
            held,
            budget_bytes,
            used_bytes,
            resident,
            hits,
            waits,
            misses,
            read_bytes,
            calls,
            routes,
            queue,
        }
    }
}

/// Every message of the protocol.
#[derive(Clone, Debug, PartialEq)]
pub enum Frame {
    /// Coordinator → node, first on a connection (and as a status poll): who is calling.
    /// The node checks `id` against the identity in the caller's certificate.
    Hello { id: String },
    /// Node → coordinator, the answer to `Hello`: who answers, its kernels (`exact`: results
    /// bit-equal to the scalar reference, so it may replicate experts held by any other exact
    /// node) and its state.
    Status {
        id: String,
        kernels: String,
        exact: bool,
        /// SHA-256 of the bundle manifest it serves.
        bundle: String,
        state: NodeState,
    },
    /// Coordinator → node: run these routes.
    Call(Call),
    /// Node → coordinator: one row of `cols` f32 per route, in route order.
    Result { cols: u32, rows: Vec<f32> },
    /// Either way: the request failed.
    Error { class: ErrorClass, message: String },
    /// Coordinator → node, on a uni-stream: these experts of `layer` will be needed soon.
    Hint { layer: u32, experts: Vec<u32> },
    /// Member → member of the control plane's Raft group, on a uni-stream: one raft-rs message,
    /// opaque here (raft-rs pins its own protobuf). `from` is the sender's id, which its
    /// certificate must name (its Raft id is derived from it); `to` the receiver's Raft id.
    Raft { from: String, to: u64, msg: Vec<u8> },
    /// A node → any member (`--join ADDR`): add me to the group. `id` must be named by the
    /// caller's certificate; `addr` is its QUIC address.
    Join { id: String, addr: String },
    /// The answer to `Join`: `member` is the answering member's id (the caller checks the
    /// server certificate names it); `accepted` when the leader added the caller as a
    /// learner, else `leader`/`leader_addr` say where to ask (empty: unknown yet) and
    /// `message` why.
    Joined {
        member: String,
        accepted: bool,
        leader: String,
        leader_addr: String,
        message: String,
    },
    /// Member → member holding an expert's blob (a move's copy): up to `max` bytes of the
    /// blob file of (`layer`, `expert`) from `offset` on (a resumed copy asks from where its
    /// partial file ends). The blob is checked against the manifest's SHA-256 once whole.
    Fetch {
        layer: u32,
        expert: u32,
        offset: u64,
        max: u32,
    },
    /// The answer to `Fetch`: `bytes` of the blob from `offset`, whose whole file is `total`
    /// bytes long.
    Blob {
        layer: u32,
        expert: u32,
        offset: u64,
        total: u64,
        bytes: Vec<u8>,
    },
    /// Coordinator → node: report your counters (the console's node panel).
    ReportQuery,
    /// The answer to `ReportQuery`.
    Report(NodeReport),
}

/// Largest chunk one `Fetch` is answered with.
pub const MAX_BLOB_CHUNK: u32 = 8 << 20;

/// Why bytes are not a frame.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("frame: {0}")]
    Malformed(String),
    #[error("frame: protocol version {got}, this build speaks {VERSION}")]
    Version { got: u8 },
    #[error("frame: {what} is {got}, the limit is {max}")]
    TooLarge {
        what: &'static str,
        got: usize,
        max: usize,
    },
}

fn bad(msg: impl Into<String>) -> WireError {
    WireError::Malformed(msg.into())
}

fn class_code(c: ErrorClass) -> u8 {
    match c {
        ErrorClass::BadRequest => 1,
        ErrorClass::NotFound => 2,
        ErrorClass::Unauthenticated => 3,
        ErrorClass::Overloaded => 4,
        ErrorClass::Unavailable => 5,
        ErrorClass::Timeout => 6,
        ErrorClass::Cancelled => 7,
        ErrorClass::Internal => 8,
    }
}

fn class_of(code: u8) -> Option<ErrorClass> {
    Some(match code {
        1 => ErrorClass::BadRequest,
        2 => ErrorClass::NotFound,
        3 => ErrorClass::Unauthenticated,
        4 => ErrorClass::Overloaded,
        5 => ErrorClass::Unavailable,
        6 => ErrorClass::Timeout,
        7 => ErrorClass::Cancelled,
        8 => ErrorClass::Internal,
        _ => return None,
    })
}

fn numerics_code(n: Numerics) -> u8 {
    match n {
        Numerics::Parity => 0,
        Numerics::Invariant => 1,
        Numerics::Routed => 2,
    }
}

fn numerics_of(code: u8) -> Option<Numerics> {
    Some(match code {
        0 => Numerics::Parity,
        1 => Numerics::Invariant,
        2 => Numerics::Routed,
        _ => return None,
    })
}

/// Appends little-endian fields.
struct Out(Vec<u8>);

impl Out {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    /// A u64 length, then the bytes.
    fn bytes(&mut self, b: &[u8]) {
        self.u64(b.len() as u64);
        self.0.extend_from_slice(b);
    }
    /// A string, cut to [`MAX_TEXT`] bytes at a character boundary.
    fn text(&mut self, s: &str) {
        let mut end = s.len().min(MAX_TEXT);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.u32(end as u32);
        self.0.extend_from_slice(&s.as_bytes()[..end]);
    }
}

/// Reads little-endian fields, every one bounds-checked.
struct In<'a> {
    b: &'a [u8],
}

impl<'a> In<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], WireError> {
        if self.b.len() < n {
            return Err(bad(format!(
                "{what}: needs {n} bytes, {} left in the payload",
                self.b.len()
            )));
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    /// A u64 length, then that many bytes (checked against what is left before it is used).
    fn bytes(&mut self, what: &str) -> Result<Vec<u8>, WireError> {
        let n = self.u64(what)?;
        let n = usize::try_from(n)
            .ok()
            .filter(|&n| n <= self.b.len())
            .ok_or_else(|| {
                bad(format!(
                    "{what}: {n} bytes announced, {} left",
                    self.b.len()
                ))
            })?;
        Ok(self.take(n, what)?.to_vec())
    }
    fn u8(&mut self, what: &str) -> Result<u8, WireError> {
        Ok(self.take(1, what)?[0])
    }
    fn u32(&mut self, what: &str) -> Result<u32, WireError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self, what: &str) -> Result<u64, WireError> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    /// A count, checked against `max` before anything is allocated.
    fn count(&mut self, what: &'static str, max: usize) -> Result<usize, WireError> {
        let n = self.u32(what)? as usize;
        if n > max {
            return Err(WireError::TooLarge { what, got: n, max });
        }
        Ok(n)
    }
    fn text(&mut self, what: &'static str) -> Result<String, WireError> {
        let n = self.count(what, MAX_TEXT)?;
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| bad(format!("{what}: not UTF-8")))
    }
    fn end(&self, kind: &str) -> Result<(), WireError> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(bad(format!(
                "{kind}: {} bytes after the last field",
                self.b.len()
            )))
        }
    }
}

impl Frame {
    fn kind(&self) -> Kind {
        match self {
            Frame::Hello { .. } => Kind::Hello,
            Frame::Status { .. } => Kind::Status,
            Frame::Call(c) if c.trace.is_some() => Kind::TracedCall,
            Frame::Call(_) => Kind::Call,
            Frame::Result { .. } => Kind::Result,
            Frame::Error { .. } => Kind::Error,
            Frame::Hint { .. } => Kind::Hint,
            Frame::Raft { .. } => Kind::Raft,
            Frame::Join { .. } => Kind::Join,
            Frame::Joined { .. } => Kind::Joined,
            Frame::Fetch { .. } => Kind::Fetch,
            Frame::Blob { .. } => Kind::Blob,
            Frame::ReportQuery => Kind::ReportQuery,
            Frame::Report(_) => Kind::Report,
        }
    }

    /// The frame kind's name (for messages; a frame's Debug form may be megabytes).
    pub fn name(&self) -> &'static str {
        match self.kind() {
            Kind::Hello => "Hello",
            Kind::Status => "Status",
            Kind::Call | Kind::TracedCall => "Call",
            Kind::Result => "Result",
            Kind::Error => "Error",
            Kind::Hint => "Hint",
            Kind::Raft => "Raft",
            Kind::Join => "Join",
            Kind::Joined => "Joined",
            Kind::Fetch => "Fetch",
            Kind::Blob => "Blob",
            Kind::ReportQuery => "ReportQuery",
            Kind::Report => "Report",
        }
    }

    /// The frame's bytes, header included. Fails only when the payload would pass
    /// [`MAX_FRAME`] (the peer would refuse it).
    pub fn encode(&self) -> Result<Vec<u8>, WireError> {
        let mut o = Out(Vec::with_capacity(HEADER + 64));
        o.0.extend_from_slice(&MAGIC);
        o.u8(VERSION);
        o.u8(self.kind() as u8);
        o.u32(0);
        match self {
            Frame::Hello { id } => o.text(id),
            Frame::Status {
                id,
                kernels,
                exact,
                bundle,
                state,
            } => {
                o.text(id);
                o.text(kernels);
                o.u8(*exact as u8);
                o.text(bundle);
                match state {
                    NodeState::Ready => o.u8(0),
                    NodeState::Loading { done, total } => {
                        o.u8(1);
                        o.u64(*done);
                        o.u64(*total);
                    }
                    NodeState::Unavailable(why) => {
                        o.u8(2);
                        o.text(why);
                    }
                }
            }
            Frame::Call(c) => {
                o.0.reserve(24 + c.routes.len() * 8 + c.input.len());
                if let Some(t) = &c.trace {
                    o.text(t);
                }
                o.u32(c.layer);
                o.u8(numerics_code(c.numerics));
                o.u32(c.ty.id());
                o.u32(c.n_tokens);
                o.u32(c.cols);
                o.u32(c.routes.len() as u32);
                for r in &c.routes {
                    o.u32(r.token);
                    o.u32(r.expert);
                }
                o.u64(c.input.len() as u64);
                o.0.extend_from_slice(&c.input);
            }
            Frame::Result { cols, rows } => {
                o.0.reserve(8 + rows.len() * 4);
                o.u32(*cols);
                o.u64(rows.len() as u64);
                for v in rows {
                    o.0.extend_from_slice(&v.to_le_bytes());
                }
            }
            Frame::Error { class, message } => {
                o.u8(class_code(*class));
                o.text(message);
            }
            Frame::Hint { layer, experts } => {
                o.u32(*layer);
                let n = experts.len().min(MAX_HINT);
                o.u32(n as u32);
                for &e in &experts[..n] {
                    o.u32(e);
                }
            }
            Frame::Raft { from, to, msg } => {
                o.0.reserve(24 + from.len() + msg.len());
                o.text(from);
                o.u64(*to);
                o.bytes(msg);
            }
            Frame::Join { id, addr } => {
                o.text(id);
                o.text(addr);
            }
            Frame::Joined {
                member,
                accepted,
                leader,
                leader_addr,
                message,
            } => {
                o.text(member);
                o.u8(*accepted as u8);
                o.text(leader);
                o.text(leader_addr);
                o.text(message);
            }
            Frame::Fetch {
                layer,
                expert,
                offset,
                max,
            } => {
                o.u32(*layer);
                o.u32(*expert);
                o.u64(*offset);
                o.u32(*max);
            }
            Frame::Blob {
                layer,
                expert,
                offset,
                total,
                bytes,
            } => {
                o.0.reserve(32 + bytes.len());
                o.u32(*layer);
                o.u32(*expert);
                o.u64(*offset);
                o.u64(*total);
                o.bytes(bytes);
            }
            Frame::ReportQuery => {}
            Frame::Report(r) => {
                for v in r.values() {
                    o.u64(v);
                }
            }
        }
        let len = o.0.len() - HEADER;
        if len > MAX_FRAME {
            return Err(WireError::TooLarge {
                what: "payload",
                got: len,
                max: MAX_FRAME,
            });
        }
        o.0[4..8].copy_from_slice(&(len as u32).to_le_bytes());
        Ok(o.0)
    }

    /// The payload length a header announces, checked (magic, version, [`MAX_FRAME`]): read
    /// that many bytes next.
    pub fn payload_len(header: &[u8; HEADER]) -> Result<usize, WireError> {
        if header[..2] != MAGIC {
            return Err(bad(format!(
                "magic {:02x}{:02x}, expected \"TF\"",
                header[0], header[1]
            )));
        }
        if header[2] != VERSION {
            return Err(WireError::Version { got: header[2] });
        }
        let len = u32::from_le_bytes([header[4], header[5], header[6], header[7]]) as usize;
        if len > MAX_FRAME {
            return Err(WireError::TooLarge {
                what: "payload",
                got: len,
                max: MAX_FRAME,
            });
        }
        Ok(len)
    }

    /// Parses one whole frame (header and exactly its payload).
    pub fn decode(bytes: &[u8]) -> Result<Frame, WireError> {
        let Some((h, payload)) = bytes.split_first_chunk::<HEADER>() else {
            return Err(bad(format!(
                "{} bytes, shorter than the {HEADER}-byte header",
                bytes.len()
            )));
        };
        let len = Frame::payload_len(h)?;
        if payload.len() != len {
            return Err(bad(format!(
                "the header announces {len} payload bytes, {} arrived",
                payload.len()
            )));
        }
        let mut r = In { b: payload };
        let f = match h[3] {
            k if k == Kind::Hello as u8 => Frame::Hello {
                id: r.text("hello id")?,
            },
            k if k == Kind::Status as u8 => {
                let id = r.text("status id")?;
                let kernels = r.text("status kernels")?;
                let exact = match r.u8("status exact")? {
                    0 => false,
                    1 => true,
                    v => return Err(bad(format!("status exact: {v} is not 0 or 1"))),
                };
                let bundle = r.text("status bundle")?;
                let state = match r.u8("status state")? {
                    0 => NodeState::Ready,
                    1 => NodeState::Loading {
                        done: r.u64("loading done")?,
                        total: r.u64("loading total")?,
                    },
                    2 => NodeState::Unavailable(r.text("unavailable reason")?),
                    v => return Err(bad(format!("status state: unknown code {v}"))),
                };
                Frame::Status {
                    id,
                    kernels,
                    exact,
                    bundle,
                    state,
                }
            }
            k if k == Kind::Call as u8 => Frame::Call(decode_call(&mut r)?),
            k if k == Kind::TracedCall as u8 => {
                let trace = r.text("call traceparent")?;
                Frame::Call(Call {
                    trace: Some(trace),
                    ..decode_call(&mut r)?
                })
            }
            k if k == Kind::Result as u8 => {
                let cols = r.u32("result cols")?;
                let n = r.u64("result rows")?;
                let bytes = n
                    .checked_mul(4)
                    .filter(|&b| b <= r.b.len() as u64)
                    .ok_or_else(|| {
                        bad(format!(
                            "result: {n} floats announced, {} bytes left",
                            r.b.len()
                        ))
                    })? as usize;
                let data = r.take(bytes, "result rows")?;
                if cols == 0 || n % cols as u64 != 0 {
                    return Err(bad(format!(
                        "result: {n} floats are not whole rows of {cols}"
                    )));
                }
                Frame::Result {
                    cols,
                    rows: data
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect(),
                }
            }
            k if k == Kind::Error as u8 => {
                let code = r.u8("error class")?;
                let class = class_of(code)
                    .ok_or_else(|| bad(format!("error class: unknown code {code}")))?;
                Frame::Error {
                    class,
                    message: r.text("error message")?,
                }
            }
            k if k == Kind::Hint as u8 => {
                let layer = r.u32("hint layer")?;
                let n = r.count("hint experts", MAX_HINT)?;
                let mut experts = Vec::with_capacity(n.min(r.b.len() / 4));
                for _ in 0..n {
                    experts.push(r.u32("hint expert")?);
                }
                Frame::Hint { layer, experts }
            }
            k if k == Kind::Raft as u8 => {
                let from = r.text("raft from")?;
                let to = r.u64("raft to")?;
                let msg = r.bytes("raft message")?;
                Frame::Raft { from, to, msg }
            }
            k if k == Kind::Join as u8 => Frame::Join {
                id: r.text("join id")?,
                addr: r.text("join addr")?,
            },
            k if k == Kind::Joined as u8 => {
                let member = r.text("joined member")?;
                let accepted = match r.u8("joined accepted")? {
                    0 => false,
                    1 => true,
                    v => return Err(bad(format!("joined accepted: {v} is not 0 or 1"))),
                };
                Frame::Joined {
                    member,
                    accepted,
                    leader: r.text("joined leader")?,
                    leader_addr: r.text("joined leader addr")?,
                    message: r.text("joined message")?,
                }
            }
            k if k == Kind::Fetch as u8 => Frame::Fetch {
                layer: r.u32("fetch layer")?,
                expert: r.u32("fetch expert")?,
                offset: r.u64("fetch offset")?,
                max: r.u32("fetch max")?,
            },
            k if k == Kind::Blob as u8 => {
                let layer = r.u32("blob layer")?;
                let expert = r.u32("blob expert")?;
                let offset = r.u64("blob offset")?;
                let total = r.u64("blob total")?;
                let bytes = r.bytes("blob bytes")?;
                Frame::Blob {
                    layer,
                    expert,
                    offset,
                    total,
                    bytes,
                }
            }
            k if k == Kind::ReportQuery as u8 => Frame::ReportQuery,
            k if k == Kind::Report as u8 => {
                let mut v = [0u64; NodeReport::FIELDS];
                for x in &mut v {
                    *x = r.u64("report field")?;
                }
                Frame::Report(NodeReport::from_values(v))
            }
            k => return Err(bad(format!("unknown frame kind {k}"))),
        };
        r.end(match f.kind() {
            Kind::Hello => "hello",
            Kind::Status => "status",
            Kind::Call | Kind::TracedCall => "call",
            Kind::Result => "result",
            Kind::Error => "error",
            Kind::Hint => "hint",
            Kind::Raft => "raft",
            Kind::Join => "join",
            Kind::Joined => "joined",
            Kind::Fetch => "fetch",
            Kind::Blob => "blob",
            Kind::ReportQuery => "report query",
            Kind::Report => "report",
        })?;
        Ok(f)
    }
}

fn decode_call(r: &mut In<'_>) -> Result<Call, WireError> {
    let layer = r.u32("call layer")?;
    let nc = r.u8("call numerics")?;
    let numerics = numerics_of(nc).ok_or_else(|| bad(format!("call numerics: unknown {nc}")))?;
    let tid = r.u32("call type")?;
    let ty = GgmlType::from_ternfleet_id(tid)
        .ok_or_else(|| bad(format!("call type: unknown type id {tid}")))?;
    let n_tokens = r.u32("call rows")?;
    let cols = r.u32("call cols")?;
    let n_routes = r.count("call routes", MAX_ROUTES)?;
    let route_bytes = r.take(n_routes * 8, "call routes")?;
    let routes: Vec<WireRoute> = route_bytes
        .chunks_exact(8)
        .map(|b| WireRoute {
            token: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            expert: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
        })
        .collect();
    for (i, rt) in routes.iter().enumerate() {
        let rt: &WireRoute = rt;
        if rt.token >= n_tokens {
            return Err(bad(format!(
                "call route {i}: row {} of a {n_tokens}-row input",
                rt.token
            )));
        }
    }
    // The answer (one f32 row of `cols` per route) must fit a frame too: a small call must
    // not make a node compute gigabytes it could never send.
    let answer = (n_routes as u64)
        .saturating_mul(cols as u64)
        .saturating_mul(4);
    if answer > MAX_FRAME as u64 {
        return Err(WireError::TooLarge {
            what: "call answer bytes",
            got: answer.min(usize::MAX as u64) as usize,
            max: MAX_FRAME,
        });
    }
    let n_in = r.u64("call input bytes")?;
    if n_in != r.b.len() as u64 {
        return Err(bad(format!(
            "call input: {n_in} bytes announced, {} left",
            r.b.len()
        )));
    }
    let input = r.take(n_in as usize, "call input")?.to_vec();
    // The rows' size must match their type and shape (checked again against the layer by the
    // node; here only that the bytes are self-consistent).
    let want = ty
        .row_size(cols as u64)
        .and_then(|rb| rb.checked_mul(n_tokens as u64));
    if want != Some(input.len() as u64) {
        return Err(bad(format!(
            "call input: {} bytes for {n_tokens} rows of {cols} {} values (expected {want:?})",
            input.len(),
            ty.name()
        )));
    }
    Ok(Call {
        layer,
        numerics,
        ty,
        n_tokens,
        cols,
        routes,
        input,
        trace: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn call() -> Call {
        Call {
            layer: 3,
            numerics: Numerics::Invariant,
            ty: GgmlType::Q8_0,
            n_tokens: 2,
            cols: 64,
            routes: vec![
                WireRoute {
                    token: 1,
                    expert: 7,
                },
                WireRoute {
                    token: 0,
                    expert: 2,
                },
            ],
            input: (0..2 * 2 * 34).map(|i| i as u8).collect(),
            trace: None,
        }
    }

    fn frames() -> Vec<Frame> {
        vec![
            Frame::Hello {
                id: "coordinator".into(),
            },
            Frame::Status {
                id: "n1".into(),
                kernels: "avx512".into(),
                exact: true,
                bundle: "3f5a".into(),
                state: NodeState::Loading {
                    done: 5,
                    total: 1 << 40,
                },
            },
            Frame::Status {
                id: "n2".into(),
                kernels: "scalar".into(),
                exact: false,
                bundle: String::new(),
                state: NodeState::Unavailable("draining".into()),
            },
            Frame::Call(call()),
            Frame::Result {
                cols: 2,
                rows: vec![1.5, -0.0, f32::MAX, 3.25e-39],
            },
            Frame::Error {
                class: ErrorClass::Unavailable,
                message: "layer 3: expert 9 not held here".into(),
            },
            Frame::Hint {
                layer: 4,
                experts: vec![0, 9, 127],
            },
            Frame::Raft {
                from: "n3".into(),
                to: u64::MAX,
                msg: vec![0, 1, 255, 7],
            },
            Frame::Raft {
                from: "n1".into(),
                to: 2,
                msg: Vec::new(),
            },
            Frame::Join {
                id: "n4".into(),
                addr: "10.0.0.4:7400".into(),
            },
            Frame::Joined {
                member: "n2".into(),
                accepted: false,
                leader: "n1".into(),
                leader_addr: "10.0.0.1:7400".into(),
                message: "not the leader".into(),
            },
            Frame::Call(Call {
                trace: Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into()),
                ..call()
            }),
            Frame::ReportQuery,
            Frame::Report(NodeReport {
                held: 11,
                budget_bytes: 1 << 33,
                resident: 7,
                misses: u64::MAX,
                queue: 2,
                ..Default::default()
            }),
            Frame::Fetch {
                layer: 3,
                expert: 17,
                offset: 1 << 33,
                max: MAX_BLOB_CHUNK,
            },
            Frame::Blob {
                layer: 3,
                expert: 17,
                offset: 4096,
                total: 9000,
                bytes: vec![7; 4904],
            },
            Frame::Blob {
                layer: 0,
                expert: 0,
                offset: 0,
                total: 0,
                bytes: Vec::new(),
            },
        ]
    }

    #[test]
    fn every_frame_survives_a_round_trip_bit_for_bit() {
        for f in frames() {
            let b = f.encode().unwrap();
            let back = Frame::decode(&b).unwrap();
            assert_eq!(back, f);
            if let (Frame::Result { rows: a, .. }, Frame::Result { rows: b, .. }) = (&f, &back) {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(a), bits(b), "-0.0 and subnormals keep their bits");
            }
        }
    }

    #[test]
    fn a_bad_header_is_refused_with_what_was_wrong() {
        let mut b = frames()[0].encode().unwrap();
        b[2] = 9;
        assert_eq!(Frame::decode(&b), Err(WireError::Version { got: 9 }));
        let mut b = frames()[0].encode().unwrap();
        b[0] = b'X';
        assert!(Frame::decode(&b).unwrap_err().to_string().contains("magic"));
        let mut h = [0u8; HEADER];
        h[..2].copy_from_slice(&MAGIC);
        h[2] = VERSION;
        h[4..].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            Frame::payload_len(&h),
            Err(WireError::TooLarge {
                what: "payload",
                ..
            })
        ));
    }

    #[test]
    fn a_call_whose_input_does_not_match_its_shape_is_refused() {
        let mut c = call();
        c.input.pop();
        let b = Frame::Call(c).encode().unwrap();
        let e = Frame::decode(&b).unwrap_err().to_string();
        assert!(e.contains("135 bytes for 2 rows of 64 q8_0"), "{e}");
        // A route count past the cap is refused before anything is allocated.
        let mut b = Frame::Call(call()).encode().unwrap();
        let at = HEADER + 4 + 1 + 4 + 4 + 4;
        b[at..at + 4].copy_from_slice(&(MAX_ROUTES as u32 + 1).to_le_bytes());
        assert!(matches!(
            Frame::decode(&b),
            Err(WireError::TooLarge {
                what: "call routes",
                ..
            })
        ));
    }

    #[test]
    fn a_call_whose_answer_could_not_be_sent_or_whose_routes_name_no_row_is_refused() {
        // 2^20 routes on one row of 2048: an 8 GiB answer from a few-MB request.
        let c = Call {
            layer: 0,
            numerics: Numerics::Invariant,
            ty: GgmlType::F32,
            n_tokens: 1,
            cols: 2048,
            routes: vec![
                WireRoute {
                    token: 0,
                    expert: 0
                };
                MAX_ROUTES
            ],
            input: vec![0; 2048 * 4],
            trace: None,
        };
        assert!(matches!(
            Frame::decode(&Frame::Call(c).encode().unwrap()),
            Err(WireError::TooLarge {
                what: "call answer bytes",
                ..
            })
        ));
        let mut c = call();
        c.routes[0].token = 2;
        let e = Frame::decode(&Frame::Call(c).encode().unwrap()).unwrap_err();
        assert!(e.to_string().contains("row 2 of a 2-row input"), "{e}");
    }

    #[test]
    fn trailing_and_missing_bytes_are_refused() {
        for f in frames() {
            let mut b = f.encode().unwrap();
            b.push(0);
            assert!(Frame::decode(&b).is_err(), "{f:?} with a trailing byte");
            let mut b = f.encode().unwrap();
            b.pop();
            assert!(Frame::decode(&b).is_err(), "{f:?} one byte short");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4000))]
        /// Arbitrary bytes never panic the decoder.
        #[test]
        fn decoder_never_panics_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = Frame::decode(&bytes);
        }

        /// Valid frames with bytes flipped or cut never panic it either (deeper than random
        /// bytes, which rarely pass the header).
        #[test]
        fn decoder_never_panics_on_mutated_frames(
            which in 0usize..7,
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..8),
            cut in any::<usize>(),
        ) {
            let mut b = frames()[which].encode().unwrap();
            for (at, v) in flips {
                let n = b.len();
                b[at % n] = v;
            }
            let keep = cut % (b.len() + 1);
            let _ = Frame::decode(&b[..keep]);
            let _ = Frame::decode(&b);
        }
    }
}
