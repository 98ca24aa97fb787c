//! Prometheus series written at scrape time from plain counters, shared by the coordinator's
//! and the nodes' `/metrics`: the expert store's counters, per-node call statistics and
//! latency histograms. The counters themselves stay plain structs ([`StoreStats`],
//! [`RemoteStats`]) that `bench --json` prints too; these functions only encode them.
//!
//! Names follow Prometheus's rules: `ternfleet_` prefix, base units (`_seconds`, `_bytes`),
//! counters get `_total` from the encoder.

use std::fmt::Result;

use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

use crate::expert::{Latencies, NodeCalls, StoreStats, LATENCY_BOUNDS};

/// A label set of string pairs, e.g. `[("node", "n1")]`.
pub type Labels = Vec<(&'static str, String)>;

/// One counter without labels.
pub fn counter(enc: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> Result {
    ConstCounter::new(v).encode(enc.encode_descriptor(name, help, None, MetricType::Counter)?)
}

/// One counter of seconds (a float).
pub fn seconds(enc: &mut DescriptorEncoder, name: &str, help: &str, ns: u64) -> Result {
    ConstCounter::new(ns as f64 / 1e9).encode(enc.encode_descriptor(
        name,
        help,
        None,
        MetricType::Counter,
    )?)
}

/// One gauge without labels.
pub fn gauge(enc: &mut DescriptorEncoder, name: &str, help: &str, v: f64) -> Result {
    ConstGauge::new(v).encode(enc.encode_descriptor(name, help, None, MetricType::Gauge)?)
}

/// A counter family: one series per label set.
pub fn counters<L: EncodeLabelSet>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    items: &[(L, u64)],
) -> Result {
    family(
        enc,
        name,
        help,
        MetricType::Counter,
        items,
        ConstCounter::new,
    )
}

/// One series per label set, each made by `make`.
fn family<L: EncodeLabelSet, V: Copy, M: EncodeMetric>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    ty: MetricType,
    items: &[(L, V)],
    make: impl Fn(V) -> M,
) -> Result {
    let mut m = enc.encode_descriptor(name, help, None, ty)?;
    for (labels, v) in items {
        make(*v).encode(m.encode_family(labels)?)?;
    }
    Ok(())
}

/// A histogram family of latencies (seconds): one series per label set.
pub fn histograms<L: EncodeLabelSet>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    items: &[(L, &Latencies)],
) -> Result {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Histogram)?;
    for (labels, l) in items {
        // Per-bucket counts (the encoder accumulates them); the last bound is +Inf.
        let buckets: Vec<(f64, u64)> = LATENCY_BOUNDS
            .iter()
            .copied()
            .chain([f64::MAX])
            .zip(l.buckets.iter().copied())
            .collect();
        m.encode_family(labels)?
            .encode_histogram::<prometheus_client::encoding::NoLabelSet>(
                l.sum_ns as f64 / 1e9,
                l.count,
                &buckets,
                None,
            )?;
    }
    Ok(())
}

/// The expert store's series (`--ram-budget`): demands by result, prefetch outcomes,
/// evictions, reads, read latency, resident experts and bytes.
pub fn store(enc: &mut DescriptorEncoder, s: &StoreStats) -> Result {
    let r = |v: &'static str| vec![("result", v)];
    counters(
        enc,
        "ternfleet_expert_store_demands",
        "Expert demands by result: hit (resident), wait (prefetch in flight), miss (read)",
        &[
            (r("hit"), s.hits),
            (r("wait"), s.waits),
            (r("miss"), s.misses),
        ],
    )?;
    let o = |v: &'static str| vec![("outcome", v)];
    counters(
        enc,
        "ternfleet_expert_store_prefetches",
        "Shadow-predictor hints by outcome: issued, used, wasted, skipped",
        &[
            (o("issued"), s.prefetches),
            (o("used"), s.prefetch_used),
            (o("wasted"), s.prefetch_wasted),
            (o("skipped"), s.hints_skipped),
        ],
    )?;
    counter(
        enc,
        "ternfleet_expert_store_evictions",
        "Experts dropped from RAM to make room",
        s.evictions,
    )?;
    counter(
        enc,
        "ternfleet_expert_store_read_bytes",
        "Bytes of experts read from disk",
        s.bytes_read,
    )?;
    counter(
        enc,
        "ternfleet_expert_store_reads",
        "Expert reads completed",
        s.reads,
    )?;
    counter(
        enc,
        "ternfleet_expert_store_read_errors",
        "Expert reads that failed",
        s.read_errors,
    )?;
    seconds(
        enc,
        "ternfleet_expert_store_read_seconds",
        "Summed latency of completed expert reads",
        s.read_ns,
    )?;
    gauge(
        enc,
        "ternfleet_expert_store_read_max_seconds",
        "Worst expert read latency so far",
        s.read_ns_max as f64 / 1e9,
    )?;
    gauge(
        enc,
        "ternfleet_expert_store_resident_experts",
        "Experts resident in RAM now",
        s.resident as f64,
    )?;
    gauge(
        enc,
        "ternfleet_expert_store_used_bytes",
        "Bytes of experts resident or being read",
        s.used_bytes as f64,
    )?;
    gauge(
        enc,
        "ternfleet_expert_store_budget_bytes",
        "The store's RAM budget (--ram-budget)",
        s.budget_bytes as f64,
    )?;
    gauge(
        enc,
        "ternfleet_expert_store_spare_bytes",
        "Bytes of evicted experts' buffers kept for the next reads (within the budget)",
        s.spare_bytes as f64,
    )?;
    counter(
        enc,
        "ternfleet_expert_store_buffers_reused",
        "Expert reads into a spare buffer instead of a fresh mapping",
        s.buffers_reused,
    )
}

/// The coordinator's per-node series: calls, routes, bytes each way, failures and the
/// round-trip time histogram, labelled `node`.
pub fn node_calls(enc: &mut DescriptorEncoder, nodes: &[NodeCalls]) -> Result {
    let by = |f: fn(&NodeCalls) -> u64| -> Vec<(Labels, u64)> {
        nodes
            .iter()
            .filter(|n| !n.id.is_empty())
            .map(|n| (vec![("node", n.id.clone())], f(n)))
            .collect()
    };
    counters(
        enc,
        "ternfleet_cluster_node_calls",
        "Expert calls sent to each node (resends included)",
        &by(|n| n.calls),
    )?;
    counters(
        enc,
        "ternfleet_cluster_node_routes",
        "Rows (one token through one expert) sent to each node",
        &by(|n| n.routes),
    )?;
    counters(
        enc,
        "ternfleet_cluster_node_sent_bytes",
        "Bytes of expert calls sent to each node",
        &by(|n| n.bytes_sent),
    )?;
    counters(
        enc,
        "ternfleet_cluster_node_received_bytes",
        "Bytes of expert results received from each node",
        &by(|n| n.bytes_received),
    )?;
    counters(
        enc,
        "ternfleet_cluster_node_failures",
        "Calls to each node that failed (error, timeout, lost connection)",
        &by(|n| n.failures),
    )?;
    let hist: Vec<(Labels, &Latencies)> = nodes
        .iter()
        .filter(|n| !n.id.is_empty())
        .map(|n| (vec![("node", n.id.clone())], &n.rtt))
        .collect();
    histograms(
        enc,
        "ternfleet_cluster_node_round_trip_seconds",
        "Round-trip time of answered expert calls, per node",
        &hist,
    )
}

/// Raft gauges of a control-plane member.
#[derive(Clone, Debug, Default)]
pub struct RaftGauges {
    pub term: u64,
    pub commit: u64,
    pub applied: u64,
    pub is_leader: bool,
    pub placement_version: u64,
}

/// `ternfleet_raft_*` and the placement version.
pub fn raft(enc: &mut DescriptorEncoder, r: &RaftGauges) -> Result {
    gauge(enc, "ternfleet_raft_term", "Raft term", r.term as f64)?;
    gauge(
        enc,
        "ternfleet_raft_commit_index",
        "Raft commit index",
        r.commit as f64,
    )?;
    gauge(
        enc,
        "ternfleet_raft_applied_index",
        "Raft index applied to the state machine",
        r.applied as f64,
    )?;
    gauge(
        enc,
        "ternfleet_raft_apply_lag",
        "Committed entries not applied yet (commit - applied)",
        r.commit.saturating_sub(r.applied) as f64,
    )?;
    gauge(
        enc,
        "ternfleet_raft_leader",
        "1 on the Raft leader, 0 elsewhere",
        if r.is_leader { 1.0 } else { 0.0 },
    )?;
    gauge(
        enc,
        "ternfleet_placement_version",
        "Version of the newest committed placement this process follows",
        r.placement_version as f64,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::collector::Collector;
    use prometheus_client::registry::Registry;

    #[derive(Debug)]
    struct Fixed(Vec<NodeCalls>, StoreStats);

    impl Collector for Fixed {
        fn encode(&self, mut enc: DescriptorEncoder) -> Result {
            node_calls(&mut enc, &self.0)?;
            store(&mut enc, &self.1)
        }
    }

    /// The text the encoder writes: per-node histograms with cumulative buckets, counters
    /// with `_total`, every line parseable as `name{labels} value`.
    #[test]
    fn per_node_histograms_accumulate_and_counters_get_total() {
        let mut n1 = NodeCalls {
            id: "n1".into(),
            calls: 3,
            routes: 24,
            ..Default::default()
        };
        for ns in [150_000, 150_000, 5_000_000] {
            n1.rtt.observe(ns);
        }
        let mut reg = Registry::default();
        reg.register_collector(Box::new(Fixed(
            vec![n1, NodeCalls::default()],
            StoreStats {
                hits: 7,
                resident: 2,
                ..Default::default()
            },
        )));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
        for want in [
            "ternfleet_cluster_node_calls_total{node=\"n1\"} 3",
            "ternfleet_cluster_node_routes_total{node=\"n1\"} 24",
            "ternfleet_cluster_node_round_trip_seconds_count{node=\"n1\"} 3",
            "ternfleet_cluster_node_round_trip_seconds_bucket{le=\"0.0001\",node=\"n1\"} 0",
            "ternfleet_cluster_node_round_trip_seconds_bucket{le=\"0.0002\",node=\"n1\"} 2",
            "ternfleet_cluster_node_round_trip_seconds_bucket{le=\"0.0064\",node=\"n1\"} 3",
            "ternfleet_cluster_node_round_trip_seconds_bucket{le=\"+Inf\",node=\"n1\"} 3",
            "ternfleet_expert_store_demands_total{result=\"hit\"} 7",
            "ternfleet_expert_store_resident_experts 2.0",
        ] {
            assert!(
                text.lines().any(|l| l == want),
                "missing {want:?} in\n{text}"
            );
        }
        // A node never named (an empty slot) writes no series.
        assert!(!text.contains("node=\"\""), "{text}");
    }
}
