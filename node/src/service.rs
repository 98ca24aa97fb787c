//! What a node does with each frame, apart from the network: [`Service`] answers `Hello` with
//! its status, runs `Call`s on its shard and passes `Hint`s to its expert store. The QUIC
//! server ([`crate::server`]) and the coordinator's in-memory test transport both drive it.
//!
//! A shard holds some experts of some layers under their model-wide numbers; [`Shard`] maps
//! them to the dense local numbering of the backend (`LocalExperts` or the expert store), so
//! a node computes exactly what the single process computes for the same expert and rows.

use std::sync::atomic::Ordering;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use ternfleet_kernels::Activations;
use ternfleet_shared::error::ErrorClass;
use ternfleet_shared::expert::{ExpertBackend, ExpertBatch, ExpertError, Route};
use ternfleet_shared::wire::{Call, Frame, NodeState};

/// How long a node lets one call compute before giving up (the coordinator's own step
/// deadline is shorter; this bounds work nobody waits for any more).
pub const COMPUTE_DEADLINE: Duration = Duration::from_secs(600);

/// A node's experts: the backend holding them under local numbers, and the map from the
/// model's numbers.
pub struct Shard {
    backend: Box<dyn ExpertBackend>,
    /// `local[layer][expert]`: the backend's index of a model expert this node holds.
    local: Vec<Vec<Option<u32>>>,
}

impl Shard {
    /// `backend` holds, for each layer, the experts `held[layer]` lists (model numbers,
    /// ascending), at local indices 0, 1, …; `n_expert` experts per layer in the model.
    pub fn new(backend: Box<dyn ExpertBackend>, held: &[Vec<usize>], n_expert: usize) -> Shard {
        let local = held
            .iter()
            .map(|es| {
                let mut m = vec![None; n_expert];
                for (i, &e) in es.iter().enumerate() {
                    if let Some(slot) = m.get_mut(e) {
                        *slot = Some(i as u32);
                    }
                }
                m
            })
            .collect();
        Shard { backend, local }
    }

    /// How many experts this shard serves.
    pub fn held(&self) -> usize {
        self.local.iter().flatten().flatten().count()
    }

    /// The expert store's counters, when the shard is served through one.
    pub fn store_stats(&self) -> Option<ternfleet_shared::expert::StoreStats> {
        self.backend.store_stats()
    }

    /// Runs a call: one f32 row per route, in route order.
    pub fn run(&self, node: &str, c: Call) -> Result<Vec<f32>, (ErrorClass, String)> {
        let layer = c.layer as usize;
        let bad = |msg: String| (ErrorClass::BadRequest, format!("node {node}: {msg}"));
        let map = self
            .local
            .get(layer)
            .ok_or_else(|| bad(format!("layer {layer}: the model has {}", self.local.len())))?;
        let mut routes = Vec::with_capacity(c.routes.len());
        for r in &c.routes {
            let e = map
                .get(r.expert as usize)
                .copied()
                .flatten()
                .ok_or_else(|| {
                    (
                        ErrorClass::NotFound,
                        format!(
                            "node {node}: layer {layer} expert {} is not held here",
                            r.expert
                        ),
                    )
                })?;
            routes.push(Route {
                token: r.token,
                expert: e,
                weight: 1.0,
            });
        }
        let want = self
            .backend
            .input_type(layer)
            .map_err(|e| (e.class(), format!("node {node}: {e}")))?;
        if c.ty != want && c.ty != ternfleet_kernels::GgmlType::F32 {
            return Err(bad(format!(
                "layer {layer}: rows of {} values, its experts read {}",
                c.ty.name(),
                want.name()
            )));
        }
        let input = Activations::from_bytes(c.ty, c.n_tokens as usize, c.cols as usize, c.input)
            .map_err(|e| bad(format!("layer {layer}: {e}")))?;
        let batch = ExpertBatch {
            layer,
            input: &input,
            routes: &routes,
            numerics: c.numerics,
        };
        let err = |e: ExpertError| (e.class(), format!("node {node}: {e}"));
        self.backend
            .submit(&batch)
            .map_err(err)?
            .wait(Instant::now() + COMPUTE_DEADLINE)
            .map_err(err)
    }
}

/// One node's frame handler.
pub struct Service {
    pub id: String,
    /// The kernel table in use (`avx512`, `avx2`, `scalar`, ...).
    pub kernels: String,
    /// Whether its results are bit-equal to the scalar reference (every x86 table is).
    pub exact: bool,
    /// SHA-256 of the bundle manifest it serves.
    pub bundle: String,
    state: RwLock<NodeState>,
    /// The experts served now: replaced whole when a move adds or drops one (a call keeps
    /// the shard it started with).
    shard: RwLock<Option<Arc<Shard>>>,
    /// What `/metrics` reports of the calls served.
    pub calls: crate::metrics::CallStats,
}

impl Service {
    /// A node that is loading (`total` bytes to open) the bundle whose manifest digest is
    /// `bundle`.
    pub fn new(id: &str, kernels: &str, exact: bool, bundle: &str, total: u64) -> Service {
        Service {
            id: id.to_string(),
            kernels: kernels.to_string(),
            exact,
            bundle: bundle.to_string(),
            state: RwLock::new(NodeState::Loading { done: 0, total }),
            shard: RwLock::new(None),
            calls: Default::default(),
        }
    }

    /// Load progress.
    pub fn progress(&self, done: u64, total: u64) {
        if let Ok(mut s) = self.state.write() {
            if matches!(*s, NodeState::Loading { .. }) {
                *s = NodeState::Loading { done, total };
            }
        }
    }

    /// The shard is open: serve it.
    pub fn ready(&self, shard: Shard) {
        self.replace(shard);
        self.set_state(NodeState::Ready);
    }

    /// Serve `shard` from the next call on (calls running finish on the one they started
    /// with).
    pub fn replace(&self, shard: Shard) {
        if let Ok(mut s) = self.shard.write() {
            *s = Some(Arc::new(shard));
        }
    }

    /// Loading failed, or the node is draining.
    pub fn set_state(&self, st: NodeState) {
        if let Ok(mut s) = self.state.write() {
            *s = st;
        }
    }

    pub fn state(&self) -> NodeState {
        self.state
            .read()
            .map(|s| s.clone())
            .unwrap_or(NodeState::Unavailable("state lock poisoned".into()))
    }

    /// The open shard (none while loading).
    pub fn shard(&self) -> Option<Arc<Shard>> {
        self.shard.read().ok().and_then(|s| s.clone())
    }

    /// This node's counters for the coordinator's console.
    pub fn report(&self) -> ternfleet_shared::wire::NodeReport {
        let shard = self.shard();
        let st = shard
            .as_ref()
            .and_then(|s| s.store_stats())
            .unwrap_or_default();
        let c = &self.calls;
        ternfleet_shared::wire::NodeReport {
            held: shard.as_ref().map_or(0, |s| s.held()) as u64,
            budget_bytes: st.budget_bytes,
            used_bytes: st.used_bytes,
            resident: st.resident,
            hits: st.hits,
            waits: st.waits,
            misses: st.misses,
            read_bytes: st.bytes_read,
            calls: c.ok.load(Ordering::Relaxed) + c.failed.load(Ordering::Relaxed),
            routes: c.routes.load(Ordering::Relaxed),
            queue: c.waiting.load(Ordering::Relaxed).max(0) as u64,
        }
    }

    fn status(&self) -> Frame {
        Frame::Status {
            id: self.id.clone(),
            kernels: self.kernels.clone(),
            exact: self.exact,
            bundle: self.bundle.clone(),
            state: self.state(),
        }
    }

    /// Answers a request frame from authenticated peer `peer`. `Err`: the peer broke the
    /// protocol (a `Hello` naming another id than its certificate): answer with the error
    /// frame, then close the connection. Runs the compute of a `Call` on the caller's thread
    /// (a blocking one).
    pub fn handle(&self, peer: &str, f: Frame) -> Result<Frame, Frame> {
        let error = |class, message| Frame::Error { class, message };
        match f {
            Frame::Hello { id } if id == peer => Ok(self.status()),
            Frame::Hello { id } => Err(error(
                ErrorClass::Unauthenticated,
                format!("hello says {id:?}, the certificate says {peer:?}"),
            )),
            Frame::Call(c) => {
                let st = self.state();
                let Some(shard) = self.shard().filter(|_| st == NodeState::Ready) else {
                    return Ok(error(
                        ErrorClass::Unavailable,
                        format!("node {}: not serving ({st:?})", self.id),
                    ));
                };
                // An FFN's output rows are as wide as its input rows.
                let cols = c.cols.max(1);
                let (layer, experts): (u32, Vec<u32>) =
                    (c.layer, c.routes.iter().map(|r| r.expert).collect());
                // A child of the coordinator's node-call span when it sent its context.
                let span = tracing::debug_span!("expert_execution", layer, routes = experts.len());
                if let Some(tp) = &c.trace {
                    ternfleet_shared::trace::set_parent(&span, tp);
                }
                let _entered = span.enter();
                let t = Instant::now();
                self.calls.running.fetch_add(1, Ordering::Relaxed);
                let r = shard.run(&self.id, c);
                self.calls.running.fetch_sub(1, Ordering::Relaxed);
                let ns = t.elapsed().as_nanos() as u64;
                self.calls.call(r.is_ok(), ns, layer, &experts);
                Ok(match r {
                    Ok(rows) => Frame::Result { cols, rows },
                    Err((class, message)) => error(class, message),
                })
            }
            Frame::Hint { layer, experts } => {
                self.calls.hints.fetch_add(1, Ordering::Relaxed);
                if let Some(shard) = self.shard() {
                    let layer = layer as usize;
                    if let Some(map) = shard.local.get(layer) {
                        let local: Vec<u32> = experts
                            .iter()
                            .filter_map(|&e| map.get(e as usize).copied().flatten())
                            .collect();
                        if !local.is_empty() {
                            shard.backend.prefetch(layer, &local);
                        }
                    }
                }
                Ok(self.status())
            }
            Frame::ReportQuery => Ok(Frame::Report(self.report())),
            other => Ok(error(
                ErrorClass::BadRequest,
                format!("node {}: a node does not take {other:?}", self.id),
            )),
        }
    }
}
