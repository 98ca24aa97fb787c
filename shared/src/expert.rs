//! The expert backend: the one interface through which a layer's FFN runs, in process or on a
//! remote node.
//!
//! DESIGN.md "Interfaces worth keeping stable". The coordinator routes each token of a layer to
//! experts (a dense FFN is one expert that every token selects with weight 1), quantizes the
//! layer's hidden rows once to the activation type the layer's experts read
//! ([`ExpertBackend::input_type`]: the exact bytes the kernels consume, so a remote expert
//! computes the same bits as a local one), and [`ExpertBackend::submit`]s an [`ExpertBatch`].
//! The call is in flight until [`InFlight::wait`] with a deadline returns **one output row per
//! route**, unweighted and unsummed: the coordinator adds them into the residual in route order
//! itself, so the float sum — and the output — does not depend on which node held which expert.
//!
//! Errors carry an [`ErrorClass`]: `Unavailable` and `Timeout` are worth a retry on another
//! replica; the rest are not.

use std::time::{Duration, Instant};

use ternfleet_kernels::{Activations, GgmlType, Numerics};

use crate::compute::ComputeError;
use crate::error::ErrorClass;

/// One (token, expert, weight) selection made by a router.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Route {
    /// Row of the batch's input.
    pub token: u32,
    /// Expert index within the layer.
    pub expert: u32,
    /// Mixing weight of this expert's output for this token (applied by the coordinator).
    pub weight: f32,
}

/// A layer's worth of expert work for the rows of one engine step.
#[derive(Clone, Copy, Debug)]
pub struct ExpertBatch<'a> {
    /// Layer index.
    pub layer: usize,
    /// The normalised FFN inputs, one row per token, already quantized to
    /// [`ExpertBackend::input_type`] of `layer`.
    pub input: &'a Activations,
    /// Selections; the result has one row per route, in this order.
    pub routes: &'a [Route],
    /// The float order the experts' matmuls follow.
    pub numerics: Numerics,
}

impl ExpertBatch<'_> {
    /// Rows in the input.
    pub fn n_tokens(&self) -> usize {
        self.input.n()
    }
}

/// Health as seen by the coordinator's scheduler.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Health {
    /// Serving.
    Ready,
    /// Loading; `done` of `total` bytes resident.
    Loading { done: u64, total: u64 },
    /// Not serving, with a reason.
    Unavailable(String),
}

/// Counters, as `bench --json` and `/metrics` report them.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct StoreStats {
    /// Demands served from memory.
    pub hits: u64,
    /// Demands that found their expert's prefetch still in flight (a late prefetch).
    pub waits: u64,
    /// Demands that had to read (or found another demand's read in flight).
    pub misses: u64,
    /// Reads started by hints.
    pub prefetches: u64,
    /// Prefetched experts demanded before eviction.
    pub prefetch_used: u64,
    /// Prefetched experts evicted (or failed) before any demand.
    pub prefetch_wasted: u64,
    /// Hints ignored: already resident or in flight, or no room without evicting pinned experts.
    pub hints_skipped: u64,
    pub evictions: u64,
    pub bytes_read: u64,
    pub read_errors: u64,
    /// Completed reads and their summed latency (start of read to [`Policy::read_done`]).
    pub reads: u64,
    pub read_ns: u64,
    /// Worst read latency.
    pub read_ns_max: u64,
    /// Experts resident now, and the bytes the store holds (resident and being read) within
    /// its budget.
    pub resident: u64,
    pub used_bytes: u64,
    pub budget_bytes: u64,
    /// Buffers of evicted experts kept for the next reads (no page faults, no unmapping):
    /// their bytes (with `used_bytes` within the budget whenever no read waits to start and
    /// no batch holds them), and reads that took one instead of a fresh mapping.
    pub spare_bytes: u64,
    pub buffers_reused: u64,
}

impl StoreStats {
    /// Hits over demands (a wait on a prefetch counts as a hit: the read was already on its way).
    pub fn hit_rate(&self) -> f64 {
        let d = self.hits + self.waits + self.misses;
        if d == 0 {
            0.0
        } else {
            (self.hits + self.waits) as f64 / d as f64
        }
    }
}

/// Counters of the remote backend (`/metrics`, bench output).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct RemoteStats {
    /// Calls sent (first tries and resends).
    pub calls: u64,
    /// Calls resent to a replica after their node failed.
    pub failovers: u64,
    /// Request and answer bytes.
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// Summed and worst round-trip time of successful calls.
    pub rtt_ns: u64,
    pub rtt_ns_max: u64,
    /// Longest wait from a call's send to its replica's answer, over calls that failed over.
    pub stall_ns_max: u64,
    /// Layer steps that sent rows to nodes: `calls / layer_steps` is the round trips per
    /// layer and step (per token at batch 1).
    pub layer_steps: u64,
    /// The same per node, by the node's index in the transport (the list only grows).
    pub nodes: Vec<NodeCalls>,
}

impl RemoteStats {
    /// Node `i`'s counters (created on first use), named `id`.
    pub fn node(&mut self, i: usize, id: &str) -> &mut NodeCalls {
        if self.nodes.len() <= i {
            self.nodes.resize_with(i + 1, NodeCalls::default);
        }
        let n = &mut self.nodes[i];
        if n.id != id {
            n.id = id.to_string();
        }
        n
    }
}

/// One node's share of [`RemoteStats`].
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct NodeCalls {
    pub id: String,
    pub calls: u64,
    /// Routes (one row through one expert) sent.
    pub routes: u64,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// Calls that failed (error, timeout, lost connection) and went to a replica or failed
    /// their step.
    pub failures: u64,
    /// Round-trip times of answered calls.
    pub rtt: Latencies,
    /// Filled by [`ExpertBackend::remote_view`] only (not counted): whether the coordinator
    /// routes to it, its state as the last probe saw it, the experts the placement gives it,
    /// and its own report (`None`: not answered yet, or a node of an older release).
    pub up: bool,
    pub state: String,
    pub held: u64,
    pub report: Option<crate::wire::NodeReport>,
}

/// Upper bounds (seconds) of [`Latencies`]' buckets: 100 µs doubling to 3.3 s, then +Inf.
pub const LATENCY_BOUNDS: [f64; 16] = {
    let mut b = [0.0; 16];
    let mut i = 0;
    let mut v = 1e-4;
    while i < 16 {
        b[i] = v;
        v *= 2.0;
        i += 1;
    }
    b
};

/// A latency histogram as plain counters (published as a Prometheus histogram).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Latencies {
    /// `buckets[i]`: observations in (`LATENCY_BOUNDS[i-1]`, `LATENCY_BOUNDS[i]`]; the last
    /// one above every bound.
    pub buckets: [u64; LATENCY_BOUNDS.len() + 1],
    pub count: u64,
    pub sum_ns: u64,
    pub max_ns: u64,
}

impl Latencies {
    pub fn observe(&mut self, ns: u64) {
        let s = ns as f64 / 1e9;
        let i = LATENCY_BOUNDS
            .iter()
            .position(|&b| s <= b)
            .unwrap_or(LATENCY_BOUNDS.len());
        self.buckets[i] += 1;
        self.count += 1;
        self.sum_ns += ns;
        self.max_ns = self.max_ns.max(ns);
    }

    /// Mean in seconds (0 with no observation).
    pub fn mean_s(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum_ns as f64 / self.count as f64 / 1e9
        }
    }
}

/// Errors of an expert backend.
#[derive(Debug, thiserror::Error)]
pub enum ExpertError {
    #[error("layer {layer}: no such layer (the backend holds {n_layers})")]
    NoLayer { layer: usize, n_layers: usize },
    #[error("layer {layer}: expert {expert} not held here (layer has {n_experts})")]
    NoExpert {
        layer: usize,
        expert: u32,
        n_experts: usize,
    },
    #[error("layer {layer}: route names token {token} but the batch has {n_tokens} tokens")]
    BadToken {
        layer: usize,
        token: u32,
        n_tokens: usize,
    },
    #[error("layer {layer}: input is {n_tokens} rows of {cols} {ty:?} values, the experts read rows of {n_embd} {want:?} values")]
    BadInput {
        layer: usize,
        n_tokens: usize,
        cols: usize,
        ty: GgmlType,
        n_embd: usize,
        want: GgmlType,
    },
    #[error("layer {layer}: no result within {waited:?} (deadline)")]
    Timeout { layer: usize, waited: Duration },
    #[error("layer {layer}: expert backend unavailable: {reason}")]
    Unavailable { layer: usize, reason: String },
    #[error("layer {layer}: {source}")]
    Compute {
        layer: usize,
        #[source]
        source: ComputeError,
    },
}

impl ExpertError {
    /// The class of ../shared/CONVENTIONS.md this error maps to.
    pub fn class(&self) -> ErrorClass {
        match self {
            ExpertError::NoLayer { .. }
            | ExpertError::NoExpert { .. }
            | ExpertError::BadToken { .. }
            | ExpertError::BadInput { .. } => ErrorClass::BadRequest,
            ExpertError::Timeout { .. } => ErrorClass::Timeout,
            ExpertError::Unavailable { .. } => ErrorClass::Unavailable,
            ExpertError::Compute { .. } => ErrorClass::Internal,
        }
    }
}

/// A submitted batch whose result has not been collected yet.
pub trait InFlight: Send {
    /// The batch's output: `routes.len() × n_embd` floats, row `i` = FFN of route `i`'s expert
    /// on route `i`'s token (not weighted). Gives up with [`ExpertError::Timeout`] at
    /// `deadline`.
    fn wait(self: Box<Self>, deadline: Instant) -> Result<Vec<f32>, ExpertError>;
}

/// A result that was ready at submission (the in-process backend computes in `submit`).
pub struct Ready(pub Result<Vec<f32>, ExpertError>);

impl InFlight for Ready {
    fn wait(self: Box<Self>, _deadline: Instant) -> Result<Vec<f32>, ExpertError> {
        self.0
    }
}

/// Runs expert FFNs for the coordinator: in process ([`ternfleet-node`'s `LocalExperts`]) or
/// on remote nodes (QUIC, a later issue).
pub trait ExpertBackend: Send + Sync {
    /// The activation type layer `layer`'s experts read (their gate/up matrices' dot type).
    fn input_type(&self, layer: usize) -> Result<GgmlType, ExpertError>;
    /// Starts `batch`. Validation errors may come back here or from [`InFlight::wait`].
    fn submit(&self, batch: &ExpertBatch<'_>) -> Result<Box<dyn InFlight>, ExpertError>;
    /// Hint that these experts of `layer` will be needed soon. Fire and forget.
    fn prefetch(&self, _layer: usize, _experts: &[u32]) {}
    /// Whether [`ExpertBackend::prefetch`] does anything (the caller then runs the shadow
    /// predictor; backends that hold every expert say no and cost nothing).
    fn wants_hints(&self) -> bool {
        false
    }
    /// Whether [`ExpertBackend::submit`] returns while the work is still being done
    /// elsewhere (remote nodes), so the caller gains by computing meanwhile (micro-batches).
    fn overlaps(&self) -> bool {
        false
    }
    /// The expert store's counters, when the backend has a store.
    fn store_stats(&self) -> Option<StoreStats> {
        None
    }
    /// The cluster counters, when the experts run on remote nodes (cheap: read every step).
    fn remote_stats(&self) -> Option<RemoteStats> {
        None
    }
    /// [`ExpertBackend::remote_stats`] with each node's `up`, `state`, `held` and `report`
    /// filled in (the console; takes the backend's locks, so not for every step).
    fn remote_view(&self) -> Option<RemoteStats> {
        self.remote_stats()
    }
    /// Per layer and routed expert, the ids of the nodes holding it, when the experts run on
    /// remote nodes (`None`: all in this process).
    fn holders(&self) -> Option<Vec<Vec<Vec<String>>>> {
        None
    }
    /// Current health.
    fn health(&self) -> Health {
        Health::Ready
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latencies_fall_in_the_bucket_of_their_upper_bound() {
        let mut l = Latencies::default();
        for ns in [50_000, 100_000, 100_001, 3_000_000, 10_000_000_000] {
            l.observe(ns);
        }
        // 50 µs and 100 µs: the first bucket (le 0.0001); 100.001 µs: the second; 3 ms:
        // le 0.0032 (index 5); 10 s: above every bound.
        assert_eq!(l.buckets[0], 2);
        assert_eq!(l.buckets[1], 1);
        assert_eq!(l.buckets[5], 1);
        assert_eq!(l.buckets[LATENCY_BOUNDS.len()], 1);
        assert_eq!(l.count, 5);
        assert_eq!(l.max_ns, 10_000_000_000);
        assert!((LATENCY_BOUNDS[15] - 3.2768).abs() < 1e-12);
    }

    #[test]
    fn transient_errors_are_retryable_and_bad_batches_are_not() {
        let t = ExpertError::Timeout {
            layer: 3,
            waited: Duration::from_millis(250),
        };
        assert_eq!(t.class(), ErrorClass::Timeout);
        assert!(t.class().is_retryable());
        let u = ExpertError::Unavailable {
            layer: 0,
            reason: "node n2 is down".into(),
        };
        assert!(u.class().is_retryable());
        let b = ExpertError::BadToken {
            layer: 1,
            token: 9,
            n_tokens: 4,
        };
        assert_eq!(b.class(), ErrorClass::BadRequest);
        assert!(!b.class().is_retryable());
        assert!(b.to_string().contains("token 9") && b.to_string().contains("4 tokens"));
    }
}
