//! `ternfleet serve`: the model behind an OpenAI-compatible HTTP API, many requests at once.
//!
//! Three parts, apart (STYLE.md): [`scheduler`] decides (pure logic, time as input),
//! [`driver`] computes (the model and the KV pool, on its own thread and the rayon pool), and
//! [`http`] is how it is reached (axum on a small tokio runtime). [`config`] holds every
//! option, from a TOML file (`--config`) with command-line overrides.
//!
//! Start-up follows ../shared/CONVENTIONS.md: bind, print the start-up line, then load;
//! `/health` answers from the start, `/ready` and the API only once the model is loaded.
//! SIGTERM / Ctrl-C: `/ready` turns 503, new requests get 503, running ones finish within the
//! grace period (then are cancelled), and the process exits 0.

pub mod chat;
pub mod config;
pub mod console;
pub mod driver;
pub mod grpc;
pub mod http;
pub mod metrics;
pub mod openai;
pub mod scheduler;
pub mod text;
pub mod tls;

use std::future::{Future, IntoFuture};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::model::{Model, StepOptions};
use config::ServeConfig;

/// Runs the server until SIGTERM / Ctrl-C.
pub fn serve(cfg: ServeConfig) -> Result<()> {
    cfg.validate()?;
    let addr: std::net::SocketAddr = cfg
        .http
        .parse()
        .with_context(|| format!("--http {:?}: expected HOST:PORT", cfg.http))?;
    cfg.check_exposure("--http", addr)?;
    let tls = match (&cfg.tls_cert, &cfg.tls_key) {
        (Some(c), Some(k)) => Some(tls::TlsFiles::load(c, k)?),
        _ => None,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("ternfleet-http")
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(run(cfg, addr, tls))
}

async fn run(
    cfg: ServeConfig,
    addr: std::net::SocketAddr,
    tls: Option<tls::TlsFiles>,
) -> Result<()> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the HTTP API to {addr}"))?;
    let bound = listener.local_addr().context("reading the bound address")?;
    let grpc_listener = match cfg.grpc_addr()? {
        Some(a) => Some(
            tokio::net::TcpListener::bind(a)
                .await
                .with_context(|| format!("binding the gRPC API to {a}"))?,
        ),
        None => None,
    };
    let grpc_bound = match &grpc_listener {
        Some(l) => Some(l.local_addr().context("reading the bound gRPC address")?),
        None => None,
    };
    // `--join`: the seat in the control plane (its QUIC endpoint bound now, for the start-up
    // line; the placement is awaited on the engine thread).
    let seat = match &cfg.join {
        Some(join) => {
            let certs = cfg.certs.as_deref().context("--join needs --certs DIR")?;
            let dir = cfg
                .state_dir
                .clone()
                .or_else(crate::seat::default_state_dir)
                .context("--join needs --state-dir (no HOME to default to)")?;
            Some(Arc::new(crate::seat::Seat::start(
                certs,
                &cfg.id,
                &cfg.listen,
                &cfg.advertise,
                Some(join.clone()),
                dir,
            )?))
        }
        None => None,
    };
    // With a seat: the admin API (mutual TLS), bound now for the start-up line.
    let admin = match (&seat, cfg.admin.as_str()) {
        (Some(seat), a) if !a.is_empty() => {
            let addr: std::net::SocketAddr = a
                .parse()
                .with_context(|| format!("--admin {a:?}: expected HOST:PORT"))?;
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding the admin API to {addr}"))?;
            let certs = cfg.certs.as_deref().context("--join needs --certs DIR")?;
            let man = ternfleet_shared::bundle::Manifest::read(&cfg.model)?;
            let mut sizes = vec![vec![0u64; man.moe.n_expert]; man.n_layer];
            for e in &man.experts {
                if let Some(x) = sizes.get_mut(e.layer).and_then(|l| l.get_mut(e.expert)) {
                    *x = e.part.bytes;
                }
            }
            let svc = crate::admin::AdminService {
                seat: seat.clone(),
                n_layer: man.n_layer,
                n_expert: man.moe.n_expert,
                sizes,
            };
            Some((listener, svc, crate::admin::tls(certs, &cfg.id)?))
        }
        _ => None,
    };
    let admin_bound = match &admin {
        Some((l, _, _)) => Some(l.local_addr().context("reading the bound admin address")?),
        None => None,
    };
    {
        use std::io::Write;
        let mut line = serde_json::json!({
            "ternfleet": "listening",
            "role": "coordinator",
            "id": cfg.id,
            "http": bound.to_string(),
        });
        if let Some(g) = grpc_bound {
            line["grpc"] = serde_json::Value::String(g.to_string());
        }
        if let Some(s) = &seat {
            line["quic"] = serde_json::Value::String(s.quic.to_string());
        }
        if let Some(a) = admin_bound {
            line["admin"] = serde_json::Value::String(a.to_string());
        }
        let mut out = std::io::stdout().lock();
        writeln!(out, "{line}").context("writing the start-up line")?;
        out.flush().context("writing the start-up line")?;
    }
    let metrics = Arc::new(metrics::Metrics::new());
    if let Some(seat) = &seat {
        let m = metrics.clone();
        ternfleet_node::control::publish_gauges(
            seat.member.clone(),
            &tokio::runtime::Handle::current(),
            move |g| m.raft(g),
        );
    }
    let slots = cfg.parallel + cfg.max_queue;
    let ready = Arc::new(AtomicBool::new(false));
    let state = Arc::new(http::AppState {
        engine: OnceLock::new(),
        ready: ready.clone(),
        degraded: Default::default(),
        draining: AtomicBool::new(false),
        limits: cfg.limits(),
        metrics: metrics.clone(),
        permits: Arc::new(tokio::sync::Semaphore::new(slots)),
        slots,
        api_keys: cfg.api_keys()?,
        model_name: cfg.model_name(),
        next_id: AtomicU64::new(0),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        default_max_tokens: cfg.default_max_tokens,
        timeout: Duration::from_secs_f64(cfg.timeout_s),
    });
    let scheme = if tls.is_some() { "https" } else { "http" };
    match grpc_bound {
        Some(g) => tracing::info!(
            "HTTP API on {scheme}://{bound}, gRPC{} on {g}; loading {}",
            if tls.is_some() { " (TLS)" } else { "" },
            cfg.model.display()
        ),
        None => tracing::info!(
            "HTTP API on {scheme}://{bound}; loading {}",
            cfg.model.display()
        ),
    }

    // Load and compute on a thread of its own; the runtime only does I/O.
    let loader_state = state.clone();
    let loader_cfg = cfg.clone();
    let loader_seat = seat.clone().map(|s| (s, tokio::runtime::Handle::current()));
    let compute = std::thread::Builder::new()
        .name("ternfleet-engine".into())
        .spawn(move || {
            if let Err(e) = load_and_run(loader_cfg, loader_state, metrics, ready, loader_seat) {
                tracing::error!("{e:#}");
                eprintln!("error: {e:#}");
                std::process::exit(1);
            }
        })
        .context("starting the engine thread")?;

    let app = http::router(state.clone(), cfg.max_body_bytes()?);
    let grace = Duration::from_secs_f64(cfg.grace_s);
    // SIGTERM / Ctrl-C: drain the engine, then stop both listeners.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let signal_state = state.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("shutting down: draining for up to {grace:?}");
        signal_state.draining.store(true, Ordering::SeqCst);
        if let Some(e) = signal_state.engine.get() {
            let _ = e.tx.send(driver::Cmd::Drain {
                deadline: Instant::now() + grace,
            });
        }
        let _ = stop_tx.send(true);
    });
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|v| *v).await;
    };
    let http_server: std::pin::Pin<Box<dyn Future<Output = std::io::Result<()>> + Send>> =
        match &tls {
            Some(t) => Box::pin(
                axum::serve(t.listener(listener)?, app)
                    .with_graceful_shutdown(stopped(stop_rx.clone()))
                    .into_future(),
            ),
            None => Box::pin(
                axum::serve(listener, app)
                    .with_graceful_shutdown(stopped(stop_rx.clone()))
                    .into_future(),
            ),
        };
    let grpc_tls = tls.as_ref().map(tls::TlsFiles::grpc);
    let grpc_server = async {
        match grpc_listener {
            Some(l) => grpc::serve(l, state.clone(), grpc_tls, stopped(stop_rx.clone()))
                .await
                .context("serving gRPC"),
            None => Ok(()),
        }
    };
    let admin_server = async {
        match admin {
            Some((l, svc, tls)) => {
                tracing::info!(
                    "admin API (mutual TLS) on {}",
                    admin_bound.map_or(String::new(), |a| a.to_string())
                );
                crate::admin::serve(l, svc, tls, stopped(stop_rx.clone()))
                    .await
                    .context("serving the admin API")
            }
            None => Ok(()),
        }
    };
    // In-flight streams end when the engine drains; bound the wait anyway.
    let drained = async {
        stopped(stop_rx.clone()).await;
        tokio::time::sleep(grace + Duration::from_secs(5)).await;
    };
    tokio::select! {
        (h, g, a) = async { tokio::join!(http_server, grpc_server, admin_server) } => {
            h.context("serving HTTP")?;
            g?;
            a?;
        }
        () = drained => tracing::warn!("connections still open after the grace period; closing"),
    }
    // The engine thread exits once drained (or immediately if it never finished loading).
    let deadline = Instant::now() + grace + Duration::from_secs(5);
    while !compute.is_finished() && Instant::now() < deadline && state.engine.get().is_some() {
        std::thread::sleep(Duration::from_millis(20));
    }
    tracing::info!("stopped");
    Ok(())
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {},
                    _ = tokio::signal::ctrl_c() => {},
                }
            }
            Err(e) => {
                tracing::warn!("cannot listen for SIGTERM ({e}); Ctrl-C only");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

fn load_and_run(
    cfg: ServeConfig,
    state: Arc<http::AppState>,
    metrics: Arc<metrics::Metrics>,
    ready: Arc<AtomicBool>,
    seat: Option<(Arc<crate::seat::Seat>, tokio::runtime::Handle)>,
) -> Result<()> {
    let t = Instant::now();
    let cluster = match &seat {
        Some((seat, rt)) => Some(seat.cluster_spec(rt, &cfg.model, cfg.step_deadline_ms)?),
        None => crate::cli::cluster_spec(
            &cfg.model,
            cfg.cluster.as_deref(),
            cfg.certs.as_deref(),
            &cfg.id,
            cfg.step_deadline_ms,
        )?,
    };
    let mut model = Model::open_with(
        &cfg.model,
        &crate::model::OpenOptions {
            ram_budget: cfg.ram_budget_bytes()?,
            io_threads: Some(cfg.io_threads),
            evict: cfg.evict()?,
            cluster,
        },
    )
    .with_context(|| format!("loading {}", cfg.model.display()))?;
    crate::cli::set_prefetch(
        &mut model,
        &cfg.model,
        &cfg.prefetch,
        cfg.lookahead,
        cfg.predictor.as_deref(),
    )?;
    let chat = cfg.chat_template(&model)?;
    let ctx = cfg.ctx_for(&model);
    let budget = cfg.kv_budget_for(&model, ctx)?;
    let pool = model.new_pool(budget, cfg.numerics()?)?;
    let kv_blocks = pool.stats().blocks_total;
    tracing::info!(
        arch = model.cfg.arch.name(),
        ctx,
        kv_blocks,
        parallel = cfg.parallel,
        numerics = cfg.numerics,
        chat_template = chat.name,
        "loaded {} in {:.2}s",
        cfg.model.display(),
        t.elapsed().as_secs_f64()
    );
    let sched = scheduler::Scheduler::new(scheduler::SchedConfig {
        max_running: cfg.parallel,
        max_waiting: cfg.max_queue,
        chunk: cfg.chunk,
        step_tokens: cfg.step_tokens,
        kv_blocks,
        sharing: pool.sharing(),
    });
    // Room for every request slot's submit plus drain commands: a full channel means 429.
    let (tx, rx) = std::sync::mpsc::sync_channel(cfg.parallel + cfg.max_queue + 8);
    let model = Arc::new(model);
    if state
        .engine
        .set(http::Engine {
            model: model.clone(),
            chat,
            tx,
        })
        .is_err()
    {
        bail!("the engine was started twice");
    }
    let opts = driver::DriverOptions {
        step: StepOptions {
            numerics: cfg.numerics()?,
            ..StepOptions::default()
        },
        top_experts: cfg.top_experts,
    };
    let degraded = state.degraded.clone();
    driver::run(model, pool, sched, opts, rx, metrics, (ready, degraded));
    Ok(())
}
