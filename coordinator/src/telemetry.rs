//! Logs and traces for every command: logs on stderr as text (default) or JSON lines
//! (`--log-format json`), filtered by `RUST_LOG` (default `info`); with `--otlp-endpoint URL`
//! the trace spans — request → step → layer → node call on the coordinator, expert execution
//! on the nodes (joined to the coordinator's trace through the call frame) — exported over
//! OTLP/gRPC by a batch processor. Unset, the spans are disabled at their call sites: no
//! cost beyond a check.

use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{Context, Result};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry::KeyValue;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider};
use opentelemetry_sdk::Resource;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

/// `--log-format`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line (timestamp, level, target, fields, spans).
    Json,
}

/// What the command line says about logs and traces, and who this process is.
#[derive(Clone, Debug, Default)]
pub struct Options {
    pub format: LogFormat,
    pub otlp_endpoint: Option<String>,
    /// `service.name` of the exported spans (`ternfleet-coordinator`, `ternfleet-node`, ...).
    pub service: String,
    /// `ternfleet.id` of the exported spans (the node's or coordinator's id).
    pub id: String,
}

static OPTIONS: OnceLock<Options> = OnceLock::new();
static PROVIDER: OnceLock<(SdkTracerProvider, tokio::runtime::Runtime)> = OnceLock::new();

/// Records the options (the first call wins); [`init`] applies them.
pub fn configure(o: Options) {
    let _ = OPTIONS.set(o);
}

/// Installs the subscriber (once per process; later calls do nothing).
pub fn init() -> Result<()> {
    static DONE: OnceLock<()> = OnceLock::new();
    if DONE.set(()).is_err() {
        return Ok(());
    }
    let o = OPTIONS.get().cloned().unwrap_or_default();
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let fmt = match o.format {
        LogFormat::Text => fmt.boxed(),
        LogFormat::Json => fmt.json().with_current_span(true).boxed(),
    }
    .with_filter(filter);
    let provider = match &o.otlp_endpoint {
        Some(ep) => Some(provider(ep, &o)?),
        None => None,
    };
    // Only ternfleet's spans go to the exporter (not events, not other crates' spans).
    let otel = provider.map(|p| {
        // No per-span extras (busy/idle time, code location, thread): one expert call costs
        // a span on each side, and decode runs dozens of calls per token.
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("ternfleet"))
            .with_tracked_inactivity(false)
            .with_location(false)
            .with_threads(false)
            .with_target(false)
            .with_filter(tracing_subscriber::filter::filter_fn(|m| {
                m.is_span() && m.target().starts_with("ternfleet")
            }))
    });
    let _ = tracing_subscriber::registry()
        .with(fmt)
        .with(otel)
        .try_init();
    if let Some(ep) = &o.otlp_endpoint {
        tracing::info!(service = %o.service, id = %o.id, "traces: exporting spans over OTLP/gRPC to {ep}");
    }
    Ok(())
}

fn provider(endpoint: &str, o: &Options) -> Result<SdkTracerProvider> {
    // The tonic client needs a runtime of its own (commands like `generate` have none, and
    // the node's is busy serving): one thread, kept for the life of the process.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("otlp-export")
        .enable_all()
        .build()
        .context("starting the OTLP exporter's runtime")?;
    let exporter = {
        let _g = rt.enter();
        opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint)
            .with_timeout(Duration::from_secs(5))
            .build()
            .with_context(|| format!("--otlp-endpoint {endpoint}"))?
    };
    let batch = BatchSpanProcessor::builder(exporter)
        .with_batch_config(
            BatchConfigBuilder::default()
                .with_scheduled_delay(Duration::from_secs(2))
                .with_max_queue_size(1 << 16)
                .with_max_export_batch_size(4096)
                .build(),
        )
        .build();
    let resource = Resource::builder()
        .with_service_name(o.service.clone())
        .with_attribute(KeyValue::new("ternfleet.id", o.id.clone()))
        .build();
    let p = SdkTracerProvider::builder()
        .with_span_processor(batch)
        .with_resource(resource)
        .build();
    let _ = PROVIDER.set((p.clone(), rt));
    Ok(p)
}

/// Exports what is still queued (at most 5 s) before the process exits.
pub fn shutdown() {
    if let Some((p, _)) = PROVIDER.get() {
        if let Err(e) = p.shutdown_with_timeout(Duration::from_secs(5)) {
            eprintln!("traces: flushing the last spans failed: {e}");
        }
    }
}
