//! The web console (`GET /`, one page embedded in the binary: no CDN, no build step) and the
//! read-only JSON mirrors it reads under `/admin/v1/` (../shared/CONVENTIONS.md: guarded by
//! the API key when keys are configured; every admin write goes through the gRPC admin API).
//!
//! - `/admin/v1/cluster`: readiness, mode, the control plane's term / indexes / placement
//!   version, and per node its health, experts held, calls, round-trip time, and what it
//!   reports of itself (RAM budget, bytes used, resident experts, hit rate, queue);
//! - `/admin/v1/routing`: rows routed to each (layer, expert) and the nodes holding each;
//! - `/admin/v1/stats`: tokens/s over the last seconds, recent time to first token, queue
//!   depth, running sequences, KV blocks.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use ternfleet_shared::error::ErrorClass;

use super::http::{authorize, status, AppState};
use super::metrics::Recent;
use super::openai::ApiError;

/// The page: HTML, CSS and script in one file.
const PAGE: &str = include_str!("console.html");

pub async fn page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        PAGE,
    )
        .into_response()
}

fn ratio(a: u64, b: u64) -> Option<f64> {
    (b > 0).then(|| a as f64 / b as f64)
}

pub async fn cluster(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    authorize(&s, &headers)?;
    let (st, reason) = status(&s);
    let snap_raft = s.metrics.snapshot.lock().ok().and_then(|g| g.raft.clone());
    let experts = s.engine.get().map(|e| &e.model.experts);
    let remote = experts.and_then(|e| e.remote_view());
    let own_store = experts.and_then(|e| e.store_stats());
    let mode = match (&remote, &snap_raft) {
        (None, _) => "single",
        (Some(_), None) => "cluster",
        (Some(_), Some(_)) => "control-plane",
    };
    let nodes: Vec<Value> = remote
        .iter()
        .flat_map(|r| r.nodes.iter())
        .filter(|n| !n.id.is_empty())
        .map(|n| {
            let rep = n.report.as_ref();
            json!({
                "id": n.id,
                "up": n.up,
                "state": n.state,
                "held": n.held,
                "calls": n.calls,
                "routes": n.routes,
                "failures": n.failures,
                "rtt_mean_ms": (n.rtt.count > 0).then(|| n.rtt.mean_s() * 1e3),
                "rtt_max_ms": (n.rtt.count > 0).then(|| n.rtt.max_ns as f64 / 1e6),
                "reported": rep.is_some(),
                "ram_budget_bytes": rep.map(|r| r.budget_bytes),
                "used_bytes": rep.map(|r| r.used_bytes),
                "resident": rep.map(|r| r.resident),
                "hit_rate": rep.and_then(|r| ratio(r.hits + r.waits, r.hits + r.waits + r.misses)),
                "read_bytes": rep.map(|r| r.read_bytes),
                "queue": rep.map(|r| r.queue),
                "node_calls": rep.map(|r| r.calls),
            })
        })
        .collect();
    Ok(Json(json!({
        "model": s.model_name,
        "status": st,
        "reason": reason,
        "mode": mode,
        "raft": snap_raft.map(|r| json!({
            "term": r.term,
            "commit": r.commit,
            "applied": r.applied,
            "lag": r.commit.saturating_sub(r.applied),
            "placement_version": r.placement_version,
        })),
        "nodes": nodes,
        "store": own_store.map(|st| json!({
            "budget_bytes": st.budget_bytes,
            "used_bytes": st.used_bytes,
            "resident": st.resident,
            "hit_rate": ratio(st.hits + st.waits, st.hits + st.waits + st.misses),
        })),
    })))
}

pub async fn routing(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    authorize(&s, &headers)?;
    let Some(e) = s.engine.get() else {
        return Err(ApiError::new(
            ErrorClass::Unavailable,
            "the model is still loading",
        ));
    };
    let moe = e.model.cfg.moe.as_ref();
    let rows = e.model.routed.lock().map(|r| r.clone()).unwrap_or_default();
    Ok(Json(json!({
        "n_layer": e.model.cfg.n_layer,
        "n_expert": moe.map_or(0, |m| m.n_expert),
        "rows": rows,
        "holders": e.model.experts.holders(),
    })))
}

pub async fn stats(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    authorize(&s, &headers)?;
    let m = &s.metrics;
    let (tps, ttft) = {
        let mut r = m.recent.lock().unwrap_or_else(|e| e.into_inner());
        (r.tokens_per_s(Instant::now()), r.ttft_mean())
    };
    Ok(Json(json!({
        "tokens_per_s": tps,
        "window_s": Recent::WINDOW,
        "ttft_mean_s": ttft,
        "queue_depth": m.queue_depth.get(),
        "running": m.running.get(),
        "kv_blocks_used": m.kv_blocks_used.get(),
        "kv_blocks_total": m.kv_blocks_total.get(),
        "generated_tokens": m.generated_tokens.get(),
        "prompt_tokens": m.prompt_tokens.get(),
    })))
}
