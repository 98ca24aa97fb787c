//! The remote expert backend: a layer's routed experts run on the nodes of a cluster file,
//! reached through a [`Transport`] (QUIC in production, an in-memory fault injector in
//! `coordinator/tests/cluster_mem.rs`).
//!
//! Per layer and step, [`RemoteExperts::submit`] groups the batch's routes by node (per
//! token, the fewest live holders of its experts — [`ternfleet_shared::cluster::cover`] — so
//! co-located experts cost one round trip; ties rotate with the layer's step count, so
//! replicas share the load), sends each node **one** call with the rows
//! it needs — the quantized bytes the kernels read — and returns at once; shared experts
//! (index ≥ the routed count) run here while the calls are away. [`RemoteInFlight::wait`]
//! collects one row per route; the model then adds them in route order, so the output does
//! not depend on which node computed what.
//!
//! Faults: a call that fails (connection lost, an `Unavailable` answer) or passes its step
//! deadline (base + per route, so a large prefill is not cut short) marks its node down and
//! goes again, same rows, to the next live holder of each of its experts; the result is the
//! same bits. A node marked down is asked for its status at once (a call lost on a healthy
//! node costs one deadline, not an outage) and then every [`PROBE_EVERY`]. With no live
//! holder left the batch fails with `Unavailable` naming the nodes and the experts, and the
//! step rolls back; the server then fails only the requests whose rows needed them. The
//! prober thread also asks every node for its status every [`HEARTBEAT_EVERY`] (a heartbeat:
//! an idle cluster notices a dead node, and [`ExpertBackend::health`] says which experts have
//! no live node); a down node is used again once it answers `Ready`.

use std::collections::BTreeMap;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use ternfleet_kernels::{Activations, GgmlType, Numerics};
use ternfleet_node::expert::LocalExperts;
use ternfleet_shared::cluster::{ClusterFile, NodeEntry, Placement};
use ternfleet_shared::error::ErrorClass;
use ternfleet_shared::expert::{
    ExpertBackend, ExpertBatch, ExpertError, Health, InFlight, RemoteStats, Route,
};
use ternfleet_shared::net::{NetError, Transport};
use ternfleet_shared::wire::{Call, Frame, NodeReport, NodeState, WireRoute};

/// How often down nodes are asked whether they are back.
pub const PROBE_EVERY: Duration = Duration::from_millis(250);
/// How often every node is asked for its status (a node that does not answer within a
/// second, or answers not ready, is marked down). `Hello` is answered at once by a node,
/// never behind its compute, so a busy node is not mistaken for a dead one.
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(1);

/// Deadlines of the remote backend.
#[derive(Clone, Copy, Debug)]
pub struct RemoteOptions {
    /// A call's deadline: this plus [`RemoteOptions::per_route`] per route it carries.
    pub step_base: Duration,
    pub per_route: Duration,
    /// How long start-up waits for every expert to have a ready holder (nodes report load
    /// progress meanwhile).
    pub load_timeout: Duration,
}

impl Default for RemoteOptions {
    fn default() -> Self {
        RemoteOptions {
            step_base: Duration::from_millis(750),
            per_route: Duration::from_micros(500),
            load_timeout: Duration::from_secs(600),
        }
    }
}

impl RemoteOptions {
    /// The deadline of a call with `routes` routes sent now.
    fn call_deadline(&self, routes: usize) -> Instant {
        Instant::now() + self.step_base + self.per_route * routes as u32
    }
}

struct NodeHealth {
    id: String,
    /// `Some(when)`: marked down then (a call failed); the prober brings it back.
    down: Option<Instant>,
    why: String,
}

struct Inner {
    transport: Arc<dyn Transport>,
    /// The newest placement; node `i` is the transport's node `i` (the list only grows).
    placement: RwLock<Arc<Placement>>,
    n_expert: usize,
    nodes: Mutex<Vec<NodeHealth>>,
    stats: Mutex<RemoteStats>,
    opts: RemoteOptions,
    me: String,
    /// The bundle's manifest digest: a node serving another bundle is not used.
    bundle: String,
    /// Rows routed to each (layer, expert) so far (what the placement planner balances).
    routed: RoutingCounts,
    /// Each node's last report (the console's node panel), by node index.
    reports: Mutex<Vec<Option<NodeReport>>>,
}

/// What the coordinator routed, shared with whoever plans the placement (the admin API).
pub type RoutingCounts = Arc<Mutex<RoutingStats>>;

/// Tokens whose routing is kept per layer for the planner's co-location.
pub const SAMPLE_TOKENS: usize = 4096;

/// The routing observed: rows per expert (load) and, per layer, the experts of the last
/// [`SAMPLE_TOKENS`] tokens (which experts fire together).
#[derive(Clone, Debug, Default)]
pub struct RoutingStats {
    /// `rows[layer][expert]`: rows routed to it.
    pub rows: Vec<Vec<u64>>,
    /// `recent[layer]`: a ring of the routed experts of recent tokens.
    pub recent: Vec<Vec<Vec<u32>>>,
    /// Per layer: steps seen, and tokens recorded (the ring's next slot is
    /// `tokens % SAMPLE_TOKENS`).
    steps: Vec<u64>,
    tokens: Vec<u64>,
}

impl RoutingStats {
    /// Records one step of `layer`: `routes` (token, expert) over `n_tokens` tokens, experts
    /// below `n_expert` (the routed ones). Returns the layer's step count before this one.
    fn record(&mut self, layer: usize, n_expert: usize, n_tokens: usize, routes: &[Route]) -> u64 {
        if self.rows.len() <= layer {
            self.rows.resize(layer + 1, Vec::new());
            self.recent.resize(layer + 1, Vec::new());
            self.steps.resize(layer + 1, 0);
            self.tokens.resize(layer + 1, 0);
        }
        let row = &mut self.rows[layer];
        if row.len() < n_expert {
            row.resize(n_expert, 0);
        }
        let mut per_token: Vec<Vec<u32>> = vec![Vec::new(); n_tokens];
        for r in routes {
            if (r.expert as usize) < n_expert {
                row[r.expert as usize] += 1;
                if let Some(t) = per_token.get_mut(r.token as usize) {
                    t.push(r.expert);
                }
            }
        }
        for experts in per_token.into_iter().filter(|t| !t.is_empty()) {
            let ring = &mut self.recent[layer];
            let slot = (self.tokens[layer] % SAMPLE_TOKENS as u64) as usize;
            if ring.len() < SAMPLE_TOKENS {
                ring.push(experts);
            } else {
                ring[slot] = experts;
            }
            self.tokens[layer] += 1;
        }
        let s = self.steps[layer];
        self.steps[layer] += 1;
        s
    }
}

/// The remote backend (see the module docs).
pub struct RemoteExperts {
    inner: Arc<Inner>,
    /// Shared experts per layer (computed here; index `e - n_expert`).
    local: LocalExperts,
    /// The activation type each layer's experts read (from the bundle manifest).
    input_types: Vec<GgmlType>,
}

impl RemoteExperts {
    /// A backend over the cluster `c` (node `i` = `c.placement.nodes[i]`) serving the bundle
    /// whose manifest digest is `bundle`: `n_expert` routed experts per layer,
    /// `shared[layer]` the shared experts computed here, `input_types` the dot type of each
    /// layer's experts. Waits until every expert has a ready holder (at most
    /// `opts.load_timeout`), logging the nodes' load progress and taking every newer placement
    /// from `c.follow` meanwhile.
    pub fn connect(
        c: &crate::model::ClusterSpec,
        bundle: &str,
        n_expert: usize,
        shared: Vec<Vec<ternfleet_node::expert::FfnWeights>>,
        input_types: Vec<GgmlType>,
    ) -> Result<RemoteExperts, ExpertError> {
        let (transport, placement, me, opts) =
            (c.transport.clone(), c.placement.clone(), &c.me, c.opts);
        let nodes = placement
            .nodes
            .iter()
            .map(|n| NodeHealth {
                id: n.id.clone(),
                down: Some(Instant::now()),
                why: "not contacted yet".into(),
            })
            .collect();
        let inner = Arc::new(Inner {
            transport,
            placement: RwLock::new(Arc::new(placement)),
            n_expert,
            nodes: Mutex::new(nodes),
            stats: Mutex::new(RemoteStats::default()),
            opts,
            me: me.to_string(),
            bundle: bundle.to_string(),
            routed: c.routed.clone(),
            reports: Mutex::new(Vec::new()),
        });
        let start = Instant::now();
        let mut last_log = Instant::now() - Duration::from_secs(10);
        // Newer placements are taken while waiting too: a coordinator that starts while the
        // nodes are still registering gets their seeded addresses first, their bound ones
        // in a later version.
        let mut feed = c.follow.clone();
        let mut version = 0;
        loop {
            if let Some(feed) = feed.as_mut() {
                take_newer(&inner, feed, &mut version);
            }
            let states = inner.probe_all(Duration::from_secs(2));
            if inner.uncovered().is_none() {
                break;
            }
            if last_log.elapsed() >= Duration::from_secs(2) {
                last_log = Instant::now();
                for (id, s) in &states {
                    tracing::info!(node = %id, "waiting for the node: {s}");
                }
            }
            if start.elapsed() > opts.load_timeout {
                let (layer, experts) = inner.uncovered().unwrap_or_default();
                return Err(ExpertError::Unavailable {
                    layer,
                    reason: format!(
                        "no ready node holds experts {experts:?} of layer {layer} after {:?} ({})",
                        opts.load_timeout,
                        states
                            .iter()
                            .map(|(i, s)| format!("{i}: {s}"))
                            .collect::<Vec<_>>()
                            .join("; ")
                    ),
                });
            }
            std::thread::sleep(PROBE_EVERY);
        }
        let weak = Arc::downgrade(&inner);
        spawn_worker("node-prober", "the node prober", move || prober(weak))?;
        let weak = Arc::downgrade(&inner);
        spawn_worker("node-reports", "the node reporter", move || reporter(weak))?;
        if let Some(feed) = feed {
            let weak = Arc::downgrade(&inner);
            spawn_worker("placement", "the placement follower", move || {
                follow(weak, feed, version)
            })?;
        }
        Ok(RemoteExperts {
            inner,
            local: LocalExperts::new(shared),
            input_types,
        })
    }

    /// The counters so far.
    pub fn stats(&self) -> RemoteStats {
        self.inner
            .stats
            .lock()
            .map(|s| s.clone())
            .unwrap_or_default()
    }

    /// [`RemoteExperts::stats`] with each node's health, holdings and last report filled in
    /// (the console's view; not for every step).
    pub fn view(&self) -> RemoteStats {
        let mut s = self.stats();
        let placement = self.inner.placement();
        let reports = self
            .inner
            .reports
            .lock()
            .map(|r| r.clone())
            .unwrap_or_default();
        if let Ok(nodes) = self.inner.nodes.lock() {
            for (i, h) in nodes.iter().enumerate() {
                let n = s.node(i, &h.id);
                n.up = h.down.is_none();
                n.state = if n.up { "ready".into() } else { h.why.clone() };
                n.held = placement
                    .nodes
                    .get(i)
                    .map_or(0, |p| p.experts.iter().map(|e| e.len() as u64).sum());
                n.report = reports.get(i).cloned().flatten();
            }
        }
        s
    }
}

impl Drop for RemoteExperts {
    fn drop(&mut self) {
        let s = self.stats();
        let ok = s.calls.saturating_sub(s.failovers).max(1);
        tracing::info!(
            "cluster: {} calls to {} nodes ({} failovers), {:.2} MB sent, {:.2} MB received, round trip mean {:.3} ms, worst {:.3} ms, longest failover stall {:.1} ms",
            s.calls,
            self.inner.placement().nodes.len(),
            s.failovers,
            s.bytes_sent as f64 / 1e6,
            s.bytes_received as f64 / 1e6,
            s.rtt_ns as f64 / ok as f64 / 1e6,
            s.rtt_ns_max as f64 / 1e6,
            s.stall_ns_max as f64 / 1e6,
        );
        for n in s.nodes.iter().filter(|n| n.calls > 0) {
            tracing::info!(
                "cluster: node {}: {} calls, {} routes, {} failed, round trip mean {:.3} ms, worst {:.3} ms",
                n.id,
                n.calls,
                n.routes,
                n.failures,
                n.rtt.mean_s() * 1e3,
                n.rtt.max_ns as f64 / 1e6,
            );
        }
    }
}

/// The newest committed placement from the control plane: its version and the routing file
/// (the nodes in service and what each holds).
pub type PlacementFeed = tokio::sync::watch::Receiver<(u64, ClusterFile)>;

/// Routes with the feed's placement if its version is not `version` (the one taken last;
/// versions only grow).
fn take_newer(inner: &Inner, feed: &mut PlacementFeed, version: &mut u64) {
    let (v, file) = feed.borrow_and_update().clone();
    if v == *version {
        return;
    }
    match inner.update(&file) {
        Ok(()) => {
            *version = v;
            tracing::info!(
                placement_version = v,
                nodes = file.nodes.len(),
                "cluster: routing with placement version {v}"
            );
        }
        Err(e) => tracing::error!(
            placement_version = v,
            "cluster: placement version {v} not taken: {e}"
        ),
    }
}

/// Takes every placement newer than `version` from `feed` until the backend is dropped or
/// the feed ends.
fn follow(inner: Weak<Inner>, mut feed: PlacementFeed, mut version: u64) {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!("placement follower: {e}");
            return;
        }
    };
    loop {
        {
            let Some(inner) = inner.upgrade() else { return };
            take_newer(&inner, &mut feed, &mut version);
        }
        let changed = rt
            .block_on(async { tokio::time::timeout(Duration::from_secs(1), feed.changed()).await });
        match changed {
            Ok(Err(_)) => return, // the control plane stopped
            _ if inner.strong_count() == 0 => return,
            _ => {}
        }
    }
}

/// Asks down nodes for their status until the backend is dropped.
fn prober(inner: Weak<Inner>) {
    let mut beat = Instant::now();
    loop {
        std::thread::sleep(PROBE_EVERY);
        let Some(inner) = inner.upgrade() else { return };
        // Heartbeat: every node now and then (an idle cluster notices a dead node too);
        // down nodes every round.
        let all = beat.elapsed() >= HEARTBEAT_EVERY;
        if all {
            beat = Instant::now();
        }
        let which: Vec<usize> = match inner.nodes.lock() {
            Ok(n) => (0..n.len())
                .filter(|&i| all || n[i].down.is_some())
                .collect(),
            Err(_) => return,
        };
        if !which.is_empty() {
            inner.probe(&which, Duration::from_secs(1));
        }
    }
}

/// Starts one of the backend's background threads (`name`), or says which could not start.
fn spawn_worker(
    name: &str,
    what: &str,
    f: impl FnOnce() + Send + 'static,
) -> Result<(), ExpertError> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map(drop)
        .map_err(|e| ExpertError::Unavailable {
            layer: 0,
            reason: format!("starting {what}: {e}"),
        })
}

/// How often the nodes are asked for their reports.
pub const REPORT_EVERY: Duration = Duration::from_secs(2);

/// Asks every node that is up for its report every [`REPORT_EVERY`], until the backend is
/// dropped. A node that does not answer (or speaks an older protocol) keeps its last report.
fn reporter(inner: Weak<Inner>) {
    let query = match Frame::ReportQuery.encode() {
        Ok(b) => Arc::new(b),
        Err(_) => return,
    };
    loop {
        std::thread::sleep(REPORT_EVERY);
        let Some(inner) = inner.upgrade() else { return };
        let up: Vec<usize> = match inner.nodes.lock() {
            Ok(n) => (0..n.len()).filter(|&i| n[i].down.is_none()).collect(),
            Err(_) => return,
        };
        let deadline = Instant::now() + Duration::from_secs(1);
        let rxs: Vec<(usize, Receiver<_>)> = up
            .iter()
            .map(|&i| (i, inner.transport.send(i, query.clone(), deadline)))
            .collect();
        for (i, rx) in rxs {
            let wait = deadline.saturating_duration_since(Instant::now());
            if let Ok(Ok(Frame::Report(r))) = rx.recv_timeout(wait) {
                if let Ok(mut reports) = inner.reports.lock() {
                    if reports.len() <= i {
                        reports.resize(i + 1, None);
                    }
                    reports[i] = Some(r);
                }
            }
        }
    }
}

impl Inner {
    /// The placement now.
    fn placement(&self) -> Arc<Placement> {
        match self.placement.read() {
            Ok(p) => p.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    /// Routes with `file` from now on (a newer committed placement). Nodes keep their
    /// indices: a node new to this coordinator is appended (and probed before it is used),
    /// one no longer in the file stays with nothing to hold.
    fn update(&self, file: &ClusterFile) -> Result<(), String> {
        let old = self.placement();
        let mut slots: Vec<(String, String)> = old
            .nodes
            .iter()
            .map(|n| (n.id.clone(), n.addr.clone()))
            .collect();
        for n in &file.nodes {
            match slots.iter_mut().find(|s| s.0 == n.id) {
                Some(s) => s.1.clone_from(&n.addr),
                None => slots.push((n.id.clone(), n.addr.clone())),
            }
        }
        let moved = slots.len() != old.nodes.len()
            || slots.iter().zip(&old.nodes).any(|(s, n)| s.1 != n.addr);
        if moved {
            self.transport.set_nodes(&slots)?;
        }
        let ordered = ClusterFile {
            coordinators: file.coordinators.clone(),
            bundle: file.bundle.clone(),
            nodes: slots
                .iter()
                .map(|(id, addr)| {
                    file.nodes
                        .iter()
                        .find(|n| n.id == *id)
                        .cloned()
                        .unwrap_or_else(|| NodeEntry {
                            id: id.clone(),
                            addr: addr.clone(),
                            experts: Vec::new(),
                        })
                })
                .collect(),
        };
        let p = ordered
            .placement_with_gaps(old.n_layer(), self.n_expert)
            .map_err(|e| e.to_string())?;
        {
            let mut n = self.nodes.lock().map_err(|_| "poisoned".to_string())?;
            for (id, _) in &slots[n.len()..] {
                tracing::info!(node = %id, "cluster: new node in the placement");
                n.push(NodeHealth {
                    id: id.clone(),
                    down: Some(Instant::now()),
                    why: "not contacted yet".into(),
                });
            }
        }
        if let Ok(mut g) = self.placement.write() {
            *g = Arc::new(p);
        }
        Ok(())
    }

    /// Sends `Hello` to every node and records who is ready; returns each node's state as
    /// text.
    fn probe_all(&self, timeout: Duration) -> Vec<(String, String)> {
        let all: Vec<usize> = (0..self.placement().nodes.len()).collect();
        self.probe(&all, timeout)
    }

    fn probe(&self, which: &[usize], timeout: Duration) -> Vec<(String, String)> {
        let hello = match (Frame::Hello {
            id: self.me.clone(),
        })
        .encode()
        {
            Ok(b) => Arc::new(b),
            Err(_) => return Vec::new(),
        };
        let deadline = Instant::now() + timeout;
        let rxs: Vec<(usize, Receiver<_>)> = which
            .iter()
            .map(|&i| (i, self.transport.send(i, hello.clone(), deadline)))
            .collect();
        let mut out = Vec::new();
        for (i, rx) in rxs {
            let wait =
                deadline.saturating_duration_since(Instant::now()) + Duration::from_millis(50);
            let (ready, text) = match rx.recv_timeout(wait) {
                Ok(Ok(Frame::Status { bundle, .. })) if bundle != self.bundle => (
                    false,
                    format!(
                        "serves bundle {}…, this coordinator's is {}…",
                        bundle.chars().take(12).collect::<String>(),
                        self.bundle.chars().take(12).collect::<String>()
                    ),
                ),
                Ok(Ok(Frame::Status {
                    state,
                    kernels,
                    exact,
                    ..
                })) => {
                    let text = match &state {
                        NodeState::Ready => "ready".to_string(),
                        NodeState::Loading { done, total } => format!(
                            "loading {:.1} of {:.1} MB",
                            *done as f64 / 1e6,
                            *total as f64 / 1e6
                        ),
                        NodeState::Unavailable(why) => format!("unavailable: {why}"),
                    };
                    if state == NodeState::Ready && !exact {
                        (false, format!("kernels {kernels} are not bit-equal to the reference: replicas would change the output"))
                    } else {
                        (state == NodeState::Ready, text)
                    }
                }
                Ok(Ok(other)) => (false, format!("unexpected answer {other:?}")),
                Ok(Err(e)) => (false, e.to_string()),
                Err(_) => (false, "no answer".into()),
            };
            if let Ok(mut n) = self.nodes.lock() {
                let h = &mut n[i];
                if ready && h.down.is_some() {
                    tracing::info!(node = %h.id, "node is ready: routing to it");
                    h.down = None;
                } else if !ready {
                    if h.down.is_none() {
                        tracing::warn!(node = %h.id, "node marked down: {text}");
                        h.down = Some(Instant::now());
                    }
                    h.why.clone_from(&text);
                }
            }
            out.push((self.node_id(i), text));
        }
        out
    }

    /// The first (layer, experts) with no ready holder.
    fn uncovered(&self) -> Option<(usize, Vec<u32>)> {
        let placement = self.placement();
        let n = self.nodes.lock().ok()?;
        for l in 0..placement.n_layer() {
            let missing: Vec<u32> = (0..self.n_expert)
                .filter(|&e| placement.holders(l, e).iter().all(|&h| n[h].down.is_some()))
                .map(|e| e as u32)
                .collect();
            if !missing.is_empty() {
                return Some((l, missing));
            }
        }
        None
    }

    fn mark_down(&self, node: usize, why: &str) {
        if let Ok(mut n) = self.nodes.lock() {
            let h = &mut n[node];
            if h.down.is_none() {
                tracing::warn!(node = %h.id, "node marked down: {why}");
                h.down = Some(Instant::now());
            }
            h.why = why.to_string();
        }
    }

    /// The node to send `expert` of `layer` to: its first holder that is up and not in
    /// `tried` (`None` when every live holder failed this call).
    fn pick(
        &self,
        placement: &Placement,
        layer: usize,
        expert: usize,
        tried: &[usize],
    ) -> Option<usize> {
        let n = self.nodes.lock().ok()?;
        placement
            .holders(layer, expert)
            .iter()
            .copied()
            .find(|h| n[*h].down.is_none() && !tried.contains(h))
    }

    fn node_id(&self, i: usize) -> String {
        self.placement()
            .nodes
            .get(i)
            .map_or_else(|| format!("#{i}"), |n| n.id.clone())
    }
}

/// One call in flight: which routes of the batch it carries.
struct Part {
    node: usize,
    /// Indices into the batch's routes.
    routes: Vec<usize>,
    rx: Receiver<Result<Frame, NetError>>,
    sent: Instant,
    /// When the first try of these routes went out (stall accounting across failovers).
    first_sent: Instant,
    deadline: Instant,
    /// Nodes already tried for these routes.
    tried: Vec<usize>,
    /// The call's trace span (disabled unless traces are exported).
    _span: tracing::Span,
}

/// A layer's calls in flight.
pub struct RemoteInFlight {
    inner: Arc<Inner>,
    layer: usize,
    numerics: Numerics,
    input: Activations,
    routes: Vec<Route>,
    parts: Vec<Part>,
    /// Routes to shared experts, computed here in `wait` while the calls are away.
    local_routes: Vec<usize>,
    local: Option<Result<Vec<f32>, ExpertError>>,
    n_embd: usize,
    /// The layer's step count: rotates which replica takes a tie.
    turn: usize,
}

/// Groups routes `which` of batch `b` by node (per token, the fewest live holders not in
/// `tried`: [`ternfleet_shared::cluster::cover`]) and sends one call per node.
fn send_parts(
    inner: &Arc<Inner>,
    b: &ExpertBatch<'_>,
    which: &[usize],
    tried: &[usize],
    first_sent: Option<Instant>,
    turn: usize,
) -> Result<Vec<Part>, ExpertError> {
    let (layer, input, routes) = (b.layer, b.input, b.routes);
    let mut by_node: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    let mut orphans: Vec<u32> = Vec::new();
    // One placement for the whole call (a newer one may arrive meanwhile: the next call
    // takes it).
    let placement = inner.placement();
    let live: Vec<bool> = match inner.nodes.lock() {
        Ok(n) => (0..n.len())
            .map(|i| n[i].down.is_none() && !tried.contains(&i))
            .collect(),
        Err(_) => Vec::new(),
    };
    // Per token, the fewest live nodes that hold its experts (co-located experts cost one
    // round trip); ties rotate with `turn`, so replicas share the load over steps.
    let mut by_token: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    for &r in which {
        by_token.entry(routes[r].token).or_default().push(r);
    }
    for rs in by_token.values() {
        let holders: Vec<Vec<usize>> = rs
            .iter()
            .map(|&r| {
                placement
                    .holders(layer, routes[r].expert as usize)
                    .iter()
                    .copied()
                    .filter(|&h| live.get(h).copied().unwrap_or(false))
                    .collect()
            })
            .collect();
        let picked = ternfleet_shared::cluster::cover(rs.len(), |i| &holders[i], turn);
        for (&r, node) in rs.iter().zip(picked) {
            match node {
                Some(n) => by_node.entry(n).or_default().push(r),
                None => orphans.push(routes[r].expert),
            }
        }
    }
    if !orphans.is_empty() {
        orphans.sort_unstable();
        orphans.dedup();
        let n = inner.nodes.lock().ok();
        let holders: Vec<String> = orphans
            .iter()
            .flat_map(|&e| placement.holders(layer, e as usize).to_vec())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .map(|h| match &n {
                Some(n) => format!("{} ({})", n[h].id, n[h].why),
                None => inner.node_id(h),
            })
            .collect();
        return Err(ExpertError::Unavailable {
            layer,
            reason: format!(
                "experts {orphans:?} have no live replica: held by {}",
                holders.join(", ")
            ),
        });
    }
    let mut parts = Vec::with_capacity(by_node.len());
    for (node, mut rs) in by_node {
        rs.sort_unstable();
        // The rows this node needs, once each, in first-use order.
        let mut rows: Vec<usize> = Vec::new();
        let mut slot: BTreeMap<u32, u32> = BTreeMap::new();
        let mut wire = Vec::with_capacity(rs.len());
        for &r in &rs {
            let t = routes[r].token;
            let s = *slot.entry(t).or_insert_with(|| {
                rows.push(t as usize);
                (rows.len() - 1) as u32
            });
            wire.push(WireRoute {
                token: s,
                expert: routes[r].expert,
            });
        }
        let id = inner.node_id(node);
        // One span per call (ends when the part is dropped: answered, failed over or
        // abandoned); its context rides the frame so the node's span joins the trace.
        let span = tracing::debug_span!("node_call", node = %id, layer, routes = rs.len());
        // The rows' kernel bytes, straight into the frame (no intermediate Activations).
        let call = Frame::Call(Call {
            layer: layer as u32,
            numerics: b.numerics,
            ty: input.ty(),
            n_tokens: rows.len() as u32,
            cols: input.cols() as u32,
            routes: wire,
            input: rows.iter().flat_map(|&r| input.row(r)).copied().collect(),
            trace: ternfleet_shared::trace::traceparent(&span),
        });
        let bytes = call.encode().map_err(|e| ExpertError::Unavailable {
            layer,
            reason: e.to_string(),
        })?;
        let deadline = inner.opts.call_deadline(rs.len());
        if let Ok(mut s) = inner.stats.lock() {
            s.calls += 1;
            s.bytes_sent += bytes.len() as u64;
            if !tried.is_empty() {
                s.failovers += 1;
            }
            let n = s.node(node, &id);
            n.calls += 1;
            n.routes += rs.len() as u64;
            n.bytes_sent += bytes.len() as u64;
        }
        let now = Instant::now();
        let rx = inner.transport.send(node, Arc::new(bytes), deadline);
        let mut t = tried.to_vec();
        t.push(node);
        parts.push(Part {
            node,
            routes: rs,
            rx,
            sent: now,
            first_sent: first_sent.unwrap_or(now),
            deadline,
            tried: t,
            _span: span,
        });
    }
    Ok(parts)
}

impl ExpertBackend for RemoteExperts {
    fn input_type(&self, layer: usize) -> Result<GgmlType, ExpertError> {
        self.input_types
            .get(layer)
            .copied()
            .ok_or(ExpertError::NoLayer {
                layer,
                n_layers: self.input_types.len(),
            })
    }

    fn submit(&self, b: &ExpertBatch<'_>) -> Result<Box<dyn InFlight>, ExpertError> {
        let layer = b.layer;
        let want = self.input_type(layer)?;
        let n_tokens = b.n_tokens();
        let n_shared = self.local_count(layer);
        let mut remote = Vec::new();
        let mut local_routes = Vec::new();
        for (i, r) in b.routes.iter().enumerate() {
            if r.token as usize >= n_tokens {
                return Err(ExpertError::BadToken {
                    layer,
                    token: r.token,
                    n_tokens,
                });
            }
            let e = r.expert as usize;
            if e < self.inner.n_expert {
                remote.push(i);
            } else if e < self.inner.n_expert + n_shared {
                local_routes.push(i);
            } else {
                return Err(ExpertError::NoExpert {
                    layer,
                    expert: r.expert,
                    n_experts: self.inner.n_expert + n_shared,
                });
            }
        }
        let turn = match self.inner.routed.lock() {
            Ok(mut c) => c.record(layer, self.inner.n_expert, n_tokens, b.routes) as usize,
            Err(_) => 0,
        };
        if !remote.is_empty() {
            if let Ok(mut s) = self.inner.stats.lock() {
                s.layer_steps += 1;
            }
        }
        if b.input.ty() != want {
            return Err(ExpertError::BadInput {
                layer,
                n_tokens,
                cols: b.input.cols(),
                ty: b.input.ty(),
                n_embd: b.input.cols(),
                want,
            });
        }
        let parts = send_parts(&self.inner, b, &remote, &[], None, turn)?;
        // Shared experts: computed now, while the calls are away.
        let local = if local_routes.is_empty() {
            None
        } else {
            let sub: Vec<Route> = local_routes
                .iter()
                .map(|&i| Route {
                    expert: b.routes[i].expert - self.inner.n_expert as u32,
                    ..b.routes[i]
                })
                .collect();
            Some(self.local.run(&ExpertBatch {
                layer,
                input: b.input,
                routes: &sub,
                numerics: b.numerics,
            }))
        };
        Ok(Box::new(RemoteInFlight {
            inner: self.inner.clone(),
            layer,
            numerics: b.numerics,
            input: b.input.clone(),
            routes: b.routes.to_vec(),
            parts,
            local_routes,
            local,
            n_embd: b.input.cols(),
            turn,
        }))
    }

    fn prefetch(&self, layer: usize, experts: &[u32]) {
        let mut by_node: BTreeMap<usize, Vec<u32>> = BTreeMap::new();
        let placement = self.inner.placement();
        for &e in experts {
            if let Some(n) = self.inner.pick(&placement, layer, e as usize, &[]) {
                by_node.entry(n).or_default().push(e);
            }
        }
        for (n, es) in by_node {
            if let Ok(f) = (Frame::Hint {
                layer: layer as u32,
                experts: es,
            })
            .encode()
            {
                self.inner.transport.hint(n, f);
            }
        }
    }

    fn wants_hints(&self) -> bool {
        true
    }

    fn overlaps(&self) -> bool {
        true
    }

    fn remote_stats(&self) -> Option<RemoteStats> {
        Some(self.stats())
    }

    fn remote_view(&self) -> Option<RemoteStats> {
        Some(self.view())
    }

    fn holders(&self) -> Option<Vec<Vec<Vec<String>>>> {
        let p = self.inner.placement();
        Some(
            (0..p.n_layer())
                .map(|l| {
                    (0..self.inner.n_expert)
                        .map(|e| {
                            p.holders(l, e)
                                .iter()
                                .filter_map(|&i| p.nodes.get(i).map(|n| n.id.clone()))
                                .collect()
                        })
                        .collect()
                })
                .collect(),
        )
    }

    fn health(&self) -> Health {
        match self.inner.uncovered() {
            None => Health::Ready,
            Some((l, es)) => {
                Health::Unavailable(format!("experts {es:?} of layer {l} have no live node"))
            }
        }
    }
}

impl RemoteExperts {
    fn local_count(&self, layer: usize) -> usize {
        self.local.layer_len(layer)
    }
}

impl InFlight for RemoteInFlight {
    fn wait(mut self: Box<Self>, deadline: Instant) -> Result<Vec<f32>, ExpertError> {
        let d = self.n_embd;
        let layer = self.layer;
        let mut ys = vec![0f32; self.routes.len() * d];
        if let Some(local) = self.local.take() {
            let local = local?;
            for (k, &r) in self.local_routes.iter().enumerate() {
                ys[r * d..(r + 1) * d].copy_from_slice(&local[k * d..(k + 1) * d]);
            }
        }
        let inner = self.inner.clone();
        while let Some(p) = self.parts.pop() {
            let until = p.deadline.min(deadline);
            let got = match p
                .rx
                .recv_timeout(until.saturating_duration_since(Instant::now()))
            {
                Ok(r) => r,
                Err(RecvTimeoutError::Timeout) => Err(NetError::Timeout {
                    node: inner.node_id(p.node),
                    waited: p.sent.elapsed(),
                }),
                Err(RecvTimeoutError::Disconnected) => Err(NetError::Lost {
                    node: inner.node_id(p.node),
                    msg: "the transport dropped the call".into(),
                }),
            };
            let failure: (ErrorClass, String) = match got {
                Ok(Frame::Result { rows, .. }) if rows.len() == p.routes.len() * d => {
                    let rtt = p.sent.elapsed().as_nanos() as u64;
                    let id = inner.node_id(p.node);
                    if let Ok(mut s) = inner.stats.lock() {
                        s.bytes_received += rows.len() as u64 * 4;
                        s.rtt_ns += rtt;
                        s.rtt_ns_max = s.rtt_ns_max.max(rtt);
                        let n = s.node(p.node, &id);
                        n.bytes_received += rows.len() as u64 * 4;
                        n.rtt.observe(rtt);
                        if p.tried.len() > 1 {
                            let stall = p.first_sent.elapsed().as_nanos() as u64;
                            s.stall_ns_max = s.stall_ns_max.max(stall);
                        }
                    }
                    if p.tried.len() > 1 {
                        tracing::warn!(
                            layer,
                            node = %inner.node_id(p.node),
                            stall_ms = p.first_sent.elapsed().as_secs_f64() * 1e3,
                            "failover: a replica answered"
                        );
                    }
                    for (k, &r) in p.routes.iter().enumerate() {
                        ys[r * d..(r + 1) * d].copy_from_slice(&rows[k * d..(k + 1) * d]);
                    }
                    continue;
                }
                Ok(Frame::Result { rows, .. }) => (
                    ErrorClass::Unavailable,
                    format!(
                        "{} floats for {} routes of width {d}",
                        rows.len(),
                        p.routes.len()
                    ),
                ),
                Ok(Frame::Error { class, message }) => (class, message),
                Ok(other) => (ErrorClass::Unavailable, format!("answered {other:?}")),
                Err(e) => (e.class(), e.to_string()),
            };
            let (class, msg) = failure;
            let node = inner.node_id(p.node);
            if let Ok(mut s) = inner.stats.lock() {
                s.node(p.node, &node).failures += 1;
            }
            if Instant::now() >= deadline {
                let mut experts: Vec<u32> =
                    p.routes.iter().map(|&r| self.routes[r].expert).collect();
                experts.sort_unstable();
                experts.dedup();
                tracing::warn!(layer, node = %node, "the step's deadline passed waiting for experts {experts:?}: {msg}");
                return Err(ExpertError::Timeout {
                    layer,
                    waited: p.first_sent.elapsed(),
                });
            }
            // Worth a replica: the node is gone, stalled, failed inside, or does not hold
            // what the file says it holds. A bad request would fail anywhere.
            if !(class.is_retryable()
                || class == ErrorClass::NotFound
                || class == ErrorClass::Internal)
            {
                return Err(ExpertError::Unavailable {
                    layer,
                    reason: format!("node {node}: {msg}"),
                });
            }
            inner.mark_down(p.node, &msg);
            {
                // Ask it at once whether it is really gone (a lost call is not a dead node).
                let (inner, node) = (inner.clone(), p.node);
                let _ = std::thread::Builder::new()
                    .name("node-probe".into())
                    .spawn(move || inner.probe(&[node], Duration::from_millis(500)));
            }
            let batch = ExpertBatch {
                layer,
                input: &self.input,
                routes: &self.routes,
                numerics: self.numerics,
            };
            let again = send_parts(
                &inner,
                &batch,
                &p.routes,
                &p.tried,
                Some(p.first_sent),
                self.turn,
            )
            .map_err(|e| match e {
                ExpertError::Unavailable { layer, reason } => ExpertError::Unavailable {
                    layer,
                    reason: format!("node {node} failed ({msg}); {reason}"),
                },
                e => e,
            })?;
            self.parts.extend(again);
        }
        Ok(ys)
    }
}
