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

/// The last few seconds, for the console: generated tokens per second (per-second buckets)
/// and recent times to first token.
#[derive(Debug, Default)]
pub struct Recent {
    start: Option<std::time::Instant>,
    /// (second since start, tokens generated in it), oldest first.
    tokens: std::collections::VecDeque<(u64, u64)>,
    /// The last [`Recent::TTFTS`] times to first token, seconds.
    ttfts: std::collections::VecDeque<f64>,
}

impl Recent {
    /// Seconds of token history kept (the rate is over the last full [`Recent::WINDOW`]).
    const KEEP: u64 = 16;
    pub const WINDOW: u64 = 5;
    const TTFTS: usize = 32;

    fn second(&mut self, now: std::time::Instant) -> u64 {
        let start = *self.start.get_or_insert(now);
        now.saturating_duration_since(start).as_secs()
    }

    /// One token generated at `now`.
    pub fn token(&mut self, now: std::time::Instant) {
        let sec = self.second(now);
        match self.tokens.back_mut() {
            Some((s, n)) if *s == sec => *n += 1,
            _ => self.tokens.push_back((sec, 1)),
        }
        while self
            .tokens
            .front()
            .is_some_and(|(s, _)| s + Self::KEEP < sec)
        {
            self.tokens.pop_front();
        }
    }

    pub fn ttft(&mut self, secs: f64) {
        self.ttfts.push_back(secs);
        while self.ttfts.len() > Self::TTFTS {
            self.ttfts.pop_front();
        }
    }

    /// Tokens per second over the [`Recent::WINDOW`] full seconds before `now`.
    pub fn tokens_per_s(&mut self, now: std::time::Instant) -> f64 {
        let sec = self.second(now);
        let from = sec.saturating_sub(Self::WINDOW);
        let n: u64 = self
            .tokens
            .iter()
            .filter(|(s, _)| *s >= from && *s < sec)
            .map(|(_, n)| n)
            .sum();
        n as f64 / Self::WINDOW as f64
    }

    /// Mean of the recent times to first token (`None`: none yet).
    pub fn ttft_mean(&self) -> Option<f64> {
        (!self.ttfts.is_empty()).then(|| self.ttfts.iter().sum::<f64>() / self.ttfts.len() as f64)
    }
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
    /// Recent tokens/s and TTFT (the console).
    pub recent: Mutex<Recent>,
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
            recent: Default::default(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// Tokens per second over the last full seconds; old seconds drop out; TTFT mean of the
    /// recent ones.
    #[test]
    fn recent_rate_counts_the_last_full_seconds() {
        let mut r = Recent::default();
        let t0 = Instant::now();
        for i in 0..50 {
            // 10 tokens in each of seconds 0..5.
            r.token(t0 + Duration::from_millis(i * 100));
        }
        assert_eq!(r.tokens_per_s(t0 + Duration::from_millis(5_000)), 10.0);
        // Half a second into second 5: still the five full seconds before it.
        assert_eq!(r.tokens_per_s(t0 + Duration::from_millis(5_500)), 10.0);
        // Two seconds later only three of them are in the window.
        assert_eq!(r.tokens_per_s(t0 + Duration::from_millis(7_000)), 6.0);
        assert_eq!(r.tokens_per_s(t0 + Duration::from_secs(60)), 0.0);
        assert_eq!(r.ttft_mean(), None);
        r.ttft(0.1);
        r.ttft(0.3);
        assert!((r.ttft_mean().unwrap() - 0.2).abs() < 1e-12);
    }
}
