//! Trace context across processes: a span's W3C `traceparent` (`00-TRACEID-SPANID-FLAGS`,
//! carried in a traced call frame over QUIC) and a span made the child of one received. With
//! no OpenTelemetry layer installed (`--otlp-endpoint` unset) spans carry no context:
//! [`traceparent`] is `None` and nothing is sent. Written and parsed directly (no propagator
//! carrier map): one of each per expert call.

use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use opentelemetry::Context;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The `traceparent` of `span`, when it belongs to a trace.
pub fn traceparent(span: &tracing::Span) -> Option<String> {
    if span.is_disabled() {
        return None;
    }
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| {
        format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags().to_u8()
        )
    })
}

/// The remote span a `traceparent` names (`None` when it does not parse).
fn parse(tp: &str) -> Option<SpanContext> {
    let mut it = tp.split('-');
    let (v, t, s, f) = (it.next()?, it.next()?, it.next()?, it.next()?);
    if v != "00" || t.len() != 32 || s.len() != 16 || f.len() != 2 || it.next().is_some() {
        return None;
    }
    let sc = SpanContext::new(
        TraceId::from_hex(t).ok()?,
        SpanId::from_hex(s).ok()?,
        TraceFlags::new(u8::from_str_radix(f, 16).ok()?),
        true,
        TraceState::NONE,
    );
    sc.is_valid().then_some(sc)
}

/// Makes `span` a child of the remote span `traceparent` names (ignored when it does not
/// parse: a trace is never worth failing a call).
pub fn set_parent(span: &tracing::Span, traceparent: &str) {
    if span.is_disabled() {
        return;
    }
    if let Some(sc) = parse(traceparent) {
        let _ = span.set_parent(Context::new().with_remote_span_context(sc));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparents_parse_as_the_w3c_format_says() {
        let sc = parse("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01").unwrap();
        assert_eq!(
            sc.trace_id().to_string(),
            "0af7651916cd43dd8448eb211c80319c"
        );
        assert_eq!(sc.span_id().to_string(), "b7ad6b7169203331");
        assert!(sc.is_sampled() && sc.is_remote());
        for bad in [
            "",
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x",
            "00-0af7651916cd43dd8448eb211c8031zz-b7ad6b7169203331-01",
        ] {
            assert!(parse(bad).is_none(), "{bad:?}");
        }
    }
}
