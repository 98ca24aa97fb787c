//! `ternfleet otlp-sink`: a minimal OTLP/gRPC trace receiver for tests, benches and quick
//! looks without a collector. Prints one JSON line per span received on stdout (after the
//! start-up line): trace and span ids (hex), parent span id, name, the sender's
//! `service.name` and `ternfleet.id`, start and end (ns since the epoch). Not a collector:
//! it keeps nothing and forwards nothing.

use std::io::Write;
use std::net::SocketAddr;

use anyhow::{Context, Result};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{any_value, KeyValue};

struct Sink;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn attr(kvs: &[KeyValue], key: &str) -> String {
    kvs.iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v| match &v.value {
            Some(any_value::Value::StringValue(s)) => Some(s.clone()),
            Some(any_value::Value::IntValue(i)) => Some(i.to_string()),
            _ => None,
        })
        .unwrap_or_default()
}

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut out = String::new();
        for rs in &req.get_ref().resource_spans {
            let res = rs
                .resource
                .as_ref()
                .map(|r| r.attributes.as_slice())
                .unwrap_or(&[]);
            let (service, id) = (attr(res, "service.name"), attr(res, "ternfleet.id"));
            for ss in &rs.scope_spans {
                for s in &ss.spans {
                    let line = serde_json::json!({
                        "trace_id": hex(&s.trace_id),
                        "span_id": hex(&s.span_id),
                        "parent": hex(&s.parent_span_id),
                        "name": s.name,
                        "service": service,
                        "id": id,
                        "node": attr(&s.attributes, "node"),
                        "layer": attr(&s.attributes, "layer"),
                        "start_ns": s.start_time_unix_nano,
                        "end_ns": s.end_time_unix_nano,
                    });
                    out.push_str(&line.to_string());
                    out.push('\n');
                }
            }
        }
        let mut o = std::io::stdout().lock();
        let _ = o.write_all(out.as_bytes());
        let _ = o.flush();
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// Serves until SIGTERM / Ctrl-C.
pub fn run(listen: &str) -> Result<()> {
    let addr: SocketAddr = listen
        .parse()
        .with_context(|| format!("--listen {listen:?}: not an IP:port address"))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let l = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        let bound = l.local_addr()?;
        println!(
            "{}",
            serde_json::json!({"ternfleet": "listening", "role": "otlp-sink", "grpc": bound.to_string()})
        );
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(Sink).max_decoding_message_size(64 << 20))
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(l),
                async {
                    let _ = tokio::signal::ctrl_c().await;
                },
            )
            .await
            .context("serving OTLP")
    })
}
