//! The server's Prometheus metrics (`GET /metrics`, OpenMetrics text). Names follow
//! Prometheus's rules: `ternfleet_` prefix, base units (seconds), `_total` on counters (the
//! encoder appends it).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Label of the requests counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// `completions`, `chat`, `tokenize`, ...
    pub endpoint: String,
    /// The HTTP status answered.
    pub status: String,
}

/// Label of the expert store's demand counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DemandLabels {
    /// `hit` (resident), `wait` (its prefetch in flight), `miss` (read on demand).
    pub result: &'static str,
}

/// Label of the expert store's prefetch counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PrefetchLabels {
    /// `issued`, `used` (demanded before eviction), `wasted` (evicted unused), `skipped`
    /// (hint ignored: resident, in flight or no room).
    pub outcome: &'static str,
}

/// The expert store's series (`--ram-budget`), fed from its cumulative counters.
pub struct StoreMetrics {
    pub demands: Family<DemandLabels, Counter>,
    pub prefetches: Family<PrefetchLabels, Counter>,
    pub evictions: Counter,
    pub read_bytes: Counter,
    pub reads: Counter,
    pub read_errors: Counter,
    pub read_seconds: Counter<f64, std::sync::atomic::AtomicU64>,
    pub read_seconds_max: Gauge<f64, std::sync::atomic::AtomicU64>,
    /// The counters as last published (the store's are cumulative).
    last: std::sync::Mutex<ternfleet_shared::expert::StoreStats>,
}

/// The cluster's series (`--cluster`), fed from the remote backend's cumulative counters.
pub struct ClusterMetrics {
    pub calls: Counter,
    pub layer_steps: Counter,
    pub failovers: Counter,
    pub sent_bytes: Counter,
    pub received_bytes: Counter,
    pub round_trip_seconds: Counter<f64, std::sync::atomic::AtomicU64>,
    pub round_trip_max_seconds: Gauge<f64, std::sync::atomic::AtomicU64>,
    pub failover_stall_max_seconds: Gauge<f64, std::sync::atomic::AtomicU64>,
    last: std::sync::Mutex<ternfleet_shared::expert::RemoteStats>,
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
    pub store: StoreMetrics,
    pub cluster: ClusterMetrics,
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
            store: StoreMetrics {
                demands: Family::default(),
                prefetches: Family::default(),
                evictions: Counter::default(),
                read_bytes: Counter::default(),
                reads: Counter::default(),
                read_errors: Counter::default(),
                read_seconds: Counter::default(),
                read_seconds_max: Gauge::default(),
                last: Default::default(),
            },
            cluster: ClusterMetrics {
                calls: Counter::default(),
                layer_steps: Counter::default(),
                failovers: Counter::default(),
                sent_bytes: Counter::default(),
                received_bytes: Counter::default(),
                round_trip_seconds: Counter::default(),
                round_trip_max_seconds: Gauge::default(),
                failover_stall_max_seconds: Gauge::default(),
                last: Default::default(),
            },
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
        let st = &m.store;
        registry.register(
            "ternfleet_expert_store_demands",
            "Expert demands by result: hit (resident), wait (prefetch in flight), miss (read)",
            st.demands.clone(),
        );
        registry.register(
            "ternfleet_expert_store_prefetches",
            "Shadow-predictor hints by outcome: issued, used, wasted, skipped",
            st.prefetches.clone(),
        );
        registry.register(
            "ternfleet_expert_store_evictions",
            "Experts dropped from RAM to make room",
            st.evictions.clone(),
        );
        registry.register(
            "ternfleet_expert_store_read_bytes",
            "Bytes of experts read from disk",
            st.read_bytes.clone(),
        );
        registry.register(
            "ternfleet_expert_store_reads",
            "Expert reads completed",
            st.reads.clone(),
        );
        registry.register(
            "ternfleet_expert_store_read_errors",
            "Expert reads that failed",
            st.read_errors.clone(),
        );
        registry.register(
            "ternfleet_expert_store_read_seconds",
            "Summed latency of completed expert reads",
            st.read_seconds.clone(),
        );
        registry.register(
            "ternfleet_expert_store_read_max_seconds",
            "Worst expert read latency so far",
            st.read_seconds_max.clone(),
        );
        let cl = &m.cluster;
        registry.register(
            "ternfleet_cluster_calls",
            "Expert calls sent to nodes (one per node holding a layer's routes per step, resends included)",
            cl.calls.clone(),
        );
        registry.register(
            "ternfleet_cluster_layer_steps",
            "Layer steps that sent rows to nodes (calls / layer steps = round trips per layer and step; per token at batch 1)",
            cl.layer_steps.clone(),
        );
        registry.register(
            "ternfleet_cluster_failovers",
            "Calls resent to a replica after their node failed or stalled",
            cl.failovers.clone(),
        );
        registry.register(
            "ternfleet_cluster_sent_bytes",
            "Bytes of expert calls sent to nodes",
            cl.sent_bytes.clone(),
        );
        registry.register(
            "ternfleet_cluster_received_bytes",
            "Bytes of expert results received from nodes",
            cl.received_bytes.clone(),
        );
        registry.register(
            "ternfleet_cluster_round_trip_seconds",
            "Summed round-trip time of answered expert calls",
            cl.round_trip_seconds.clone(),
        );
        registry.register(
            "ternfleet_cluster_round_trip_max_seconds",
            "Worst round-trip time of an answered expert call so far",
            cl.round_trip_max_seconds.clone(),
        );
        registry.register(
            "ternfleet_cluster_failover_stall_max_seconds",
            "Longest wait from a call's first send to its replica's answer",
            cl.failover_stall_max_seconds.clone(),
        );
        Metrics { registry, ..m }
    }

    /// Publishes the remote backend's cumulative counters (the increase since the last call).
    pub fn cluster(&self, now: &ternfleet_shared::expert::RemoteStats) {
        let c = &self.cluster;
        let mut last = c.last.lock().unwrap_or_else(|e| e.into_inner());
        let d = |a: u64, b: u64| a.saturating_sub(b);
        c.calls.inc_by(d(now.calls, last.calls));
        c.layer_steps.inc_by(d(now.layer_steps, last.layer_steps));
        c.failovers.inc_by(d(now.failovers, last.failovers));
        c.sent_bytes.inc_by(d(now.bytes_sent, last.bytes_sent));
        c.received_bytes
            .inc_by(d(now.bytes_received, last.bytes_received));
        c.round_trip_seconds
            .inc_by(d(now.rtt_ns, last.rtt_ns) as f64 / 1e9);
        c.round_trip_max_seconds.set(now.rtt_ns_max as f64 / 1e9);
        c.failover_stall_max_seconds
            .set(now.stall_ns_max as f64 / 1e9);
        *last = now.clone();
    }

    /// Publishes the expert store's cumulative counters (the increase since the last call).
    pub fn store(&self, now: &ternfleet_shared::expert::StoreStats) {
        let st = &self.store;
        let mut last = st.last.lock().unwrap_or_else(|e| e.into_inner());
        let d = |a: u64, b: u64| a.saturating_sub(b);
        for (result, v) in [
            ("hit", d(now.hits, last.hits)),
            ("wait", d(now.waits, last.waits)),
            ("miss", d(now.misses, last.misses)),
        ] {
            st.demands.get_or_create(&DemandLabels { result }).inc_by(v);
        }
        for (outcome, v) in [
            ("issued", d(now.prefetches, last.prefetches)),
            ("used", d(now.prefetch_used, last.prefetch_used)),
            ("wasted", d(now.prefetch_wasted, last.prefetch_wasted)),
            ("skipped", d(now.hints_skipped, last.hints_skipped)),
        ] {
            st.prefetches
                .get_or_create(&PrefetchLabels { outcome })
                .inc_by(v);
        }
        st.evictions.inc_by(d(now.evictions, last.evictions));
        st.read_bytes.inc_by(d(now.bytes_read, last.bytes_read));
        st.reads.inc_by(d(now.reads, last.reads));
        st.read_errors.inc_by(d(now.read_errors, last.read_errors));
        st.read_seconds
            .inc_by(d(now.read_ns, last.read_ns) as f64 / 1e9);
        st.read_seconds_max.set(now.read_ns_max as f64 / 1e9);
        *last = now.clone();
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
