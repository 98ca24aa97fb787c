//! A node's HTTP side port (`--metrics`, default 127.0.0.1:9400): `GET /metrics` (Prometheus
//! text), `/health` (200 once bound) and `/ready` (200 while serving its shard, else 503 with
//! the state), so Prometheus and a load balancer's health check can watch a node without a
//! cluster certificate. Read-only; plaintext (a non-loopback address needs `--listen-any`).
//!
//! Every series is written at scrape time from the node's own counters ([`CallStats`], the
//! expert store's, the Raft member's), so a scrape never waits on compute.

use std::collections::HashMap;
use std::fmt::Result as FmtResult;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::registry::Registry;
use ternfleet_shared::expert::Latencies;
use ternfleet_shared::metrics::{self as pm, RaftGauges};
use ternfleet_shared::wire::NodeState;

use crate::service::Service;

/// What a node counts of the calls it serves.
#[derive(Debug, Default)]
pub struct CallStats {
    pub ok: AtomicU64,
    pub failed: AtomicU64,
    /// Routes (one row through one expert) computed.
    pub routes: AtomicU64,
    /// Prefetch hints received.
    pub hints: AtomicU64,
    /// Calls waiting for a compute permit, and computing.
    pub waiting: AtomicI64,
    pub running: AtomicI64,
    /// Compute time of each call (decode to result, on the node).
    pub compute: Mutex<Latencies>,
    /// Routes per (layer, expert), model numbers.
    pub per_expert: Mutex<HashMap<(u32, u32), u64>>,
}

impl CallStats {
    /// Counts one finished call of `routes` over `experts` (one entry per route).
    pub fn call(&self, ok: bool, ns: u64, layer: u32, experts: &[u32]) {
        if ok {
            self.ok.fetch_add(1, Relaxed);
            self.routes.fetch_add(experts.len() as u64, Relaxed);
            if let Ok(mut m) = self.per_expert.lock() {
                for &e in experts {
                    *m.entry((layer, e)).or_default() += 1;
                }
            }
        } else {
            self.failed.fetch_add(1, Relaxed);
        }
        if let Ok(mut c) = self.compute.lock() {
            c.observe(ns);
        }
    }
}

/// Writes a node's series at each scrape.
struct NodeCollector {
    svc: Arc<Service>,
    raft: Arc<Mutex<Option<RaftGauges>>>,
}

impl std::fmt::Debug for NodeCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeCollector")
            .field("node", &self.svc.id)
            .finish()
    }
}

impl Collector for NodeCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> FmtResult {
        let svc = &self.svc;
        let (ready, done, total) = match svc.state() {
            NodeState::Ready => (1.0, 0, 0),
            NodeState::Loading { done, total } => (0.0, done, total),
            NodeState::Unavailable(_) => (0.0, 0, 0),
        };
        pm::gauge(
            &mut enc,
            "ternfleet_node_ready",
            "1 while the node serves its shard (0 loading, draining or failed)",
            ready,
        )?;
        pm::gauge(
            &mut enc,
            "ternfleet_node_load_done_bytes",
            "While loading: bytes of the shard opened so far",
            done as f64,
        )?;
        pm::gauge(
            &mut enc,
            "ternfleet_node_load_total_bytes",
            "While loading: bytes of the shard to open",
            total as f64,
        )?;
        let shard = svc.shard();
        pm::gauge(
            &mut enc,
            "ternfleet_node_held_experts",
            "Experts this node serves (its placement)",
            shard.as_ref().map_or(0, |s| s.held()) as f64,
        )?;
        let c = &svc.calls;
        let r = |v: &'static str| vec![("result", v)];
        pm::counters(
            &mut enc,
            "ternfleet_node_calls",
            "Expert calls answered, by result (ok, error)",
            &[
                (r("ok"), c.ok.load(Relaxed)),
                (r("error"), c.failed.load(Relaxed)),
            ],
        )?;
        pm::counter(
            &mut enc,
            "ternfleet_node_routes",
            "Rows computed (one token through one expert)",
            c.routes.load(Relaxed),
        )?;
        pm::counter(
            &mut enc,
            "ternfleet_node_hints",
            "Prefetch hints received from coordinators",
            c.hints.load(Relaxed),
        )?;
        pm::gauge(
            &mut enc,
            "ternfleet_node_queue_depth",
            "Calls waiting for a compute slot",
            c.waiting.load(Relaxed).max(0) as f64,
        )?;
        pm::gauge(
            &mut enc,
            "ternfleet_node_running_calls",
            "Calls computing now",
            c.running.load(Relaxed).max(0) as f64,
        )?;
        let compute = c.compute.lock().map(|l| l.clone()).unwrap_or_default();
        pm::histograms(
            &mut enc,
            "ternfleet_node_call_seconds",
            "Compute time of an expert call on the node (frame decoded to result)",
            &[(pm::Labels::new(), &compute)],
        )?;
        let mut per: Vec<((u32, u32), u64)> = c
            .per_expert
            .lock()
            .map(|m| m.iter().map(|(k, v)| (*k, *v)).collect())
            .unwrap_or_default();
        per.sort_unstable();
        let per: Vec<(Vec<(&str, u32)>, u64)> = per
            .into_iter()
            .map(|((l, e), v)| (vec![("layer", l), ("expert", e)], v))
            .collect();
        pm::counters(
            &mut enc,
            "ternfleet_node_expert_routes",
            "Rows computed per expert (model numbers)",
            &per,
        )?;
        if let Some(st) = shard.as_ref().and_then(|s| s.store_stats()) {
            pm::store(&mut enc, &st)?;
        }
        if let Some(r) = self.raft.lock().ok().and_then(|r| r.clone()) {
            pm::raft(&mut enc, &r)?;
        }
        Ok(())
    }
}

/// The node's metrics registry over `svc` (and, for a control-plane member, the Raft
/// gauges published into `raft`).
pub fn registry(svc: Arc<Service>, raft: Arc<Mutex<Option<RaftGauges>>>) -> Registry {
    let mut reg = Registry::default();
    reg.register_collector(Box::new(NodeCollector { svc, raft }));
    reg
}

/// Serves `/metrics`, `/health` and `/ready` on `listener` until the runtime stops.
pub async fn serve(listener: tokio::net::TcpListener, svc: Arc<Service>, reg: Registry) {
    use axum::http::{header, StatusCode};
    use axum::response::IntoResponse;
    use axum::routing::get;
    let reg = Arc::new(reg);
    let metrics = move || {
        let reg = reg.clone();
        async move {
            let mut text = String::new();
            match prometheus_client::encoding::text::encode(&mut text, &reg) {
                Ok(()) => (
                    StatusCode::OK,
                    [(
                        header::CONTENT_TYPE,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    )],
                    text,
                )
                    .into_response(),
                Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "encoding failed").into_response(),
            }
        }
    };
    let ready = move || {
        let svc = svc.clone();
        async move {
            match svc.state() {
                NodeState::Ready => (StatusCode::OK, "ready\n".to_string()),
                st => (StatusCode::SERVICE_UNAVAILABLE, format!("{st:?}\n")),
            }
        }
    };
    let app = axum::Router::new()
        .route("/metrics", get(metrics))
        .route("/health", get(|| async { "ok\n" }))
        .route("/ready", get(ready));
    if let Err(e) = axum::serve(listener, app).await {
        tracing::warn!("node: the metrics server stopped: {e}");
    }
}
