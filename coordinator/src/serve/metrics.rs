//! The server's Prometheus metrics (`GET /metrics`, OpenMetrics text). Names follow
//! Prometheus's rules: `ternfleet_` prefix, base units (seconds), `_total` on counters (the
//! encoder appends it).

use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use ternfleet_shared::expert::RemoteStats;
use ternfleet_shared::metrics::{self as pm, RaftGauges};

/// Label of the requests counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// `completions`, `chat`, `tokenize`, ...
    pub endpoint: String,
    /// The HTTP status answered.
    pub status: String,
}

/// What the engine thread last published, and the control plane's gauges: written into
/// `/metrics` at scrape time (the counters are the store's and the remote backend's own,
/// cumulative, so nothing is lost between scrapes).
#[derive(Debug, Default)]
pub struct Snapshot {
    pub store: Option<ternfleet_shared::expert::StoreStats>,
    pub remote: Option<ternfleet_shared::expert::RemoteStats>,
    pub raft: Option<RaftGauges>,
}

/// Writes a [`Snapshot`] at each scrape.
#[derive(Debug, Default)]
struct SnapshotCollector(Arc<Mutex<Snapshot>>);

impl Collector for SnapshotCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let s = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(st) = &s.store {
            pm::store(&mut enc, st)?;
        }
        if let Some(r) = &s.remote {
            cluster(&mut enc, r)?;
            pm::node_calls(&mut enc, &r.nodes)?;
        }
        if let Some(r) = &s.raft {
            pm::raft(&mut enc, r)?;
        }
        Ok(())
    }
}

/// The cluster's totals (`--cluster` / `--join`).
fn cluster(enc: &mut DescriptorEncoder, r: &RemoteStats) -> std::fmt::Result {
    pm::counter(
        enc,
        "ternfleet_cluster_calls",
        "Expert calls sent to nodes (one per node holding a layer's routes per step, resends included)",
        r.calls,
    )?;
    pm::counter(
        enc,
        "ternfleet_cluster_layer_steps",
        "Layer steps that sent rows to nodes (calls / layer steps = round trips per layer and step; per token at batch 1)",
        r.layer_steps,
    )?;
    pm::counter(
        enc,
        "ternfleet_cluster_failovers",
        "Calls resent to a replica after their node failed or stalled",
        r.failovers,
    )?;
    pm::counter(
        enc,
        "ternfleet_cluster_sent_bytes",
        "Bytes of expert calls sent to nodes",
        r.bytes_sent,
    )?;
    pm::counter(
        enc,
        "ternfleet_cluster_received_bytes",
        "Bytes of expert results received from nodes",
        r.bytes_received,
    )?;
    pm::seconds(
        enc,
        "ternfleet_cluster_round_trip_seconds",
        "Summed round-trip time of answered expert calls",
        r.rtt_ns,
    )?;
    pm::gauge(
        enc,
        "ternfleet_cluster_round_trip_max_seconds",
        "Worst round-trip time of an answered expert call so far",
        r.rtt_ns_max as f64 / 1e9,
    )?;
    pm::gauge(
        enc,
        "ternfleet_cluster_failover_stall_max_seconds",
        "Longest wait from a call's first send to its replica's answer",
        r.stall_ns_max as f64 / 1e9,
    )
}

/// Every metric, cheap to update from any thread.
pub struct Metrics {
    pub registry: Registry,
    pub requests: Family<RequestLabels, Counter>,
    pub prompt_tokens: Counter,
    pub generated_tokens: Counter,
    pub prefix_cache_hit_tokens: Counter,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    pub batch_rows: Histogram,
    pub queue_depth: Gauge,
    pub running: Gauge,
    pub kv_blocks_used: Gauge,
    pub kv_blocks_total: Gauge,
    pub steps: Counter,
    pub step_failures: Counter,
    /// The store's, the cluster's and the control plane's series, written at scrape time.
    pub snapshot: Arc<Mutex<Snapshot>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let m = Metrics {
            requests: Family::default(),
            prompt_tokens: Counter::default(),
            generated_tokens: Counter::default(),
            prefix_cache_hit_tokens: Counter::default(),
            ttft: Histogram::new(exponential_buckets(0.005, 2.0, 14)),
            itl: Histogram::new(exponential_buckets(0.001, 2.0, 14)),
            e2e: Histogram::new(exponential_buckets(0.01, 2.0, 16)),
            batch_rows: Histogram::new(exponential_buckets(1.0, 2.0, 12)),
            queue_depth: Gauge::default(),
            running: Gauge::default(),
            kv_blocks_used: Gauge::default(),
            kv_blocks_total: Gauge::default(),
            steps: Counter::default(),
            step_failures: Counter::default(),
            snapshot: Default::default(),
            registry: Registry::default(),
        };
        registry.register(
            "ternfleet_requests",
            "API requests by endpoint and HTTP status",
            m.requests.clone(),
        );
        registry.register(
            "ternfleet_prompt_tokens",
            "Prompt tokens of admitted requests",
            m.prompt_tokens.clone(),
        );
        registry.register(
            "ternfleet_generated_tokens",
            "Tokens generated",
            m.generated_tokens.clone(),
        );
        registry.register(
            "ternfleet_prefix_cache_hit_tokens",
            "Prompt tokens reused from the KV pool's shared prefixes",
            m.prefix_cache_hit_tokens.clone(),
        );
        registry.register(
            "ternfleet_time_to_first_token_seconds",
            "From request arrival to its first generated token",
            m.ttft.clone(),
        );
        registry.register(
            "ternfleet_inter_token_latency_seconds",
            "Between consecutive generated tokens of a request",
            m.itl.clone(),
        );
        registry.register(
            "ternfleet_request_duration_seconds",
            "From request arrival to its last token",
            m.e2e.clone(),
        );
        registry.register(
            "ternfleet_batch_rows",
            "Rows (tokens of all sequences) per engine step",
            m.batch_rows.clone(),
        );
        registry.register(
            "ternfleet_queue_depth",
            "Requests waiting for a sequence slot",
            m.queue_depth.clone(),
        );
        registry.register(
            "ternfleet_running_sequences",
            "Requests admitted to the engine",
            m.running.clone(),
        );
        registry.register(
            "ternfleet_kv_blocks_used",
            "KV pool blocks held by sequences",
            m.kv_blocks_used.clone(),
        );
        registry.register(
            "ternfleet_kv_blocks_total",
            "KV pool blocks in all",
            m.kv_blocks_total.clone(),
        );
        registry.register("ternfleet_steps", "Engine steps run", m.steps.clone());
        registry.register(
            "ternfleet_step_failures",
            "Engine steps that failed (each is retried once)",
            m.step_failures.clone(),
        );
        registry.register_collector(Box::new(SnapshotCollector(m.snapshot.clone())));
        Metrics { registry, ..m }
    }

    /// Publishes the remote backend's cumulative counters (read at the next scrape).
    pub fn cluster(&self, now: &RemoteStats) {
        self.snapshot
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remote = Some(now.clone());
    }

    /// Publishes the expert store's cumulative counters (read at the next scrape).
    pub fn store(&self, now: &ternfleet_shared::expert::StoreStats) {
        self.snapshot
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .store = Some(now.clone());
    }

    /// Publishes the control plane's gauges.
    pub fn raft(&self, now: RaftGauges) {
        self.snapshot.lock().unwrap_or_else(|e| e.into_inner()).raft = Some(now);
    }

    /// Counts one answered request.
    pub fn request(&self, endpoint: &str, status: u16) {
        self.requests
            .get_or_create(&RequestLabels {
                endpoint: endpoint.to_string(),
                status: status.to_string(),
            })
            .inc();
    }

    /// The OpenMetrics text of every metric.
    pub fn encode(&self) -> String {
        let mut s = String::new();
        prometheus_client::encoding::text::encode(&mut s, &self.registry)
            .expect("writing to a String cannot fail");
        s
    }
}
