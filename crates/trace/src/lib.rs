//! Traces of the requests the proxy serves, in OpenTelemetry's model.
//!
//! - [`context`]: the W3C `traceparent` a request arrives with, whether it
//!   is recorded ([`Sampler`]: the caller's decision, else a ratio of new
//!   traces), and the `traceparent` its backend gets (the proxy's span as
//!   the parent). Pure.
//! - [`request_spans`]: one request's spans from what the proxy saw: a
//!   server span for the request, and under it, per attempt, a client span
//!   from sending to the backend's answer head (its time to first byte)
//!   and, when the attempt waited for room in its service's queue, an
//!   internal `queue` span. Pure.
//! - [`otlp`]: the OTLP protobuf messages; [`Exporter`]: a bounded queue
//!   of recorded requests ([`Recording`]) and one task that builds their
//!   spans and posts them in batches to an OTLP/HTTP receiver, dropping
//!   and counting spans when it is behind.

pub mod context;
mod export;
pub mod otlp;
pub mod span;

use std::net::SocketAddr;
use std::time::Instant;

pub use context::{Context, Ids, RandomIds, Sampler, TraceParent, TRACEPARENT_LEN};
pub use export::{ExportOptions, ExportStats, Exporter, Recording};
pub use span::{Kind, Span, Value, WallClock};

/// What the proxy saw of one request, for its span.
#[derive(Debug, Clone)]
pub struct RequestFacts<'a> {
    /// Its method.
    pub method: &'a str,
    /// Its path (normalized, without the query).
    pub path: &'a str,
    /// The host it named, if any.
    pub host: Option<&'a str>,
    /// `http` or `https`.
    pub scheme: &'a str,
    /// The client's address (after a trusted PROXY protocol header).
    pub client: SocketAddr,
    /// `1.1` or `2`.
    pub protocol: &'a str,
    /// The route it matched and the route's service.
    pub route: Option<&'a str>,
    /// See `route`.
    pub service: Option<&'a str>,
    /// Its `X-Request-Id`.
    pub request_id: Option<&'a str>,
    /// The status the client got (0 when none was sent).
    pub status: u16,
    /// Why the proxy answered itself, if it did (an error kind's name).
    pub error: Option<&'static str>,
    /// The caller's `tracestate`, passed on.
    pub trace_state: Option<&'a str>,
    /// When its head was read, and when it was done.
    pub start: Instant,
    /// See `start`.
    pub end: Instant,
}

/// One attempt to a backend, for its span.
#[derive(Debug, Clone)]
pub struct AttemptFacts<'a> {
    /// The backend's id and address.
    pub backend: &'a str,
    /// See `backend` (`host:port`).
    pub addr: &'a str,
    /// When the attempt started waiting in its service's queue, if it had
    /// to.
    pub queued_at: Option<Instant>,
    /// When it was sent, and when the backend's answer head came (or it
    /// failed).
    pub sent: Instant,
    /// See `sent`.
    pub ended: Instant,
    /// The backend's status, if it answered.
    pub status: Option<u16>,
    /// Why it failed, if it did (an error kind's name, or `shed` for a 503
    /// another backend may take).
    pub error: Option<&'static str>,
    /// Sent again on a new connection after a kept-alive one was found
    /// closed.
    pub fresh_connection: bool,
}

/// One request's spans: the request's own (the caller's span, if any, as
/// its parent), then for each attempt its queue wait (if any) and the
/// attempt, both children of the request's span.
pub fn request_spans(
    ctx: &Context,
    req: &RequestFacts<'_>,
    attempts: &[AttemptFacts<'_>],
    ids: &mut impl Ids,
) -> Vec<Span> {
    let clock = WallClock::now();
    let mut spans = Vec::with_capacity(1 + attempts.len() * 2);
    let mut attributes: Vec<(&'static str, Value)> = vec![
        ("http.request.method", known(req.method)),
        ("url.path", Value::text(req.path)),
        ("url.scheme", known(req.scheme)),
        ("network.protocol.version", known(req.protocol)),
        ("client.address", req.client.ip().to_string().into()),
        ("client.port", Value::Int(i64::from(req.client.port()))),
    ];
    if let Some(host) = req.host {
        attributes.push(("server.address", Value::text(host)));
    }
    if req.status != 0 {
        attributes.push(("http.response.status_code", req.status.into()));
    }
    if let Some(route) = req.route {
        attributes.push(("tidegate.route", Value::text(route)));
    }
    if let Some(service) = req.service {
        attributes.push(("tidegate.service", Value::text(service)));
    }
    if let Some(id) = req.request_id {
        attributes.push(("tidegate.request_id", Value::text(id)));
    }
    attributes.push(("tidegate.attempts", Value::Int(attempts.len() as i64)));
    // A server span fails on a 5xx (OpenTelemetry's HTTP conventions); the
    // proxy's own reason is `error.type`.
    let error = match (req.error, req.status) {
        (Some(kind), _) => Some(kind.to_owned()),
        (None, s) if s >= 500 => Some(s.to_string()),
        _ => None,
    };
    if let Some(e) = &error {
        attributes.push(("error.type", e.clone().into()));
    }
    spans.push(Span {
        trace_id: ctx.trace_id,
        span_id: ctx.span_id,
        parent_id: ctx.parent_id,
        trace_state: req.trace_state.unwrap_or_default().to_owned(),
        name: match req.route {
            Some(route) => format!("{} {route}", req.method),
            None => req.method.to_owned(),
        },
        kind: Kind::Server,
        start_unix_ns: clock.unix_ns(req.start),
        end_unix_ns: clock.unix_ns(req.end),
        attributes,
        error,
    });
    let mut previous: Option<&'static str> = None;
    for (i, a) in attempts.iter().enumerate() {
        let number = i as i64 + 1;
        if let Some(queued) = a.queued_at {
            spans.push(Span {
                trace_id: ctx.trace_id,
                span_id: ids.span_id(),
                parent_id: Some(ctx.span_id),
                trace_state: String::new(),
                name: "queue".to_owned(),
                kind: Kind::Internal,
                start_unix_ns: clock.unix_ns(queued),
                end_unix_ns: clock.unix_ns(a.sent),
                attributes: vec![("tidegate.attempt", Value::Int(number))],
                error: None,
            });
        }
        // `host:port`, `[v6]:port`.
        let (host, port) = match a.addr.rsplit_once(':') {
            Some((h, p)) => (h.trim_start_matches('[').trim_end_matches(']'), p.parse::<u16>().ok()),
            None => (a.addr, None),
        };
        let mut attributes: Vec<(&'static str, Value)> = vec![
            ("http.request.method", known(req.method)),
            ("server.address", Value::text(host)),
            ("tidegate.backend", Value::text(a.backend)),
            ("tidegate.attempt", Value::Int(number)),
            ("tidegate.queue_wait_us", Value::Int(a.queued_at.map_or(0, |q| micros(a.sent.duration_since(q))))),
            ("tidegate.time_to_first_byte_us", Value::Int(micros(a.ended.duration_since(a.sent)))),
        ];
        if let Some(port) = port {
            attributes.push(("server.port", port.into()));
        }
        if let Some(s) = a.status {
            attributes.push(("http.response.status_code", s.into()));
        }
        if a.fresh_connection {
            attributes.push(("tidegate.fresh_connection", true.into()));
        }
        if let Some(cause) = previous {
            attributes.push(("tidegate.retry_cause", cause.into()));
        }
        if let Some(e) = a.error {
            attributes.push(("error.type", e.into()));
        }
        spans.push(Span {
            trace_id: ctx.trace_id,
            span_id: ids.span_id(),
            parent_id: Some(ctx.span_id),
            trace_state: String::new(),
            name: req.method.to_owned(),
            kind: Kind::Client,
            start_unix_ns: clock.unix_ns(a.sent),
            end_unix_ns: clock.unix_ns(a.ended),
            attributes,
            error: a.error.map(str::to_owned),
        });
        previous = a.error;
    }
    spans
}

/// A value that is most often one of a few constants (a method, a
/// scheme, a protocol version): borrowed then, copied otherwise.
fn known(s: &str) -> Value {
    const KNOWN: [&str; 12] =
        ["GET", "POST", "PUT", "DELETE", "HEAD", "PATCH", "OPTIONS", "http", "https", "1.1", "2", "1.0"];
    match KNOWN.iter().find(|k| **k == s) {
        Some(k) => Value::from(*k),
        None => Value::text(s),
    }
}

fn micros(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_retried_request_gives_a_server_span_and_its_attempts_under_it() {
        let t0 = Instant::now();
        let ctx = Context { trace_id: [9; 16], parent_id: Some([1; 8]), span_id: [2; 8], sampled: true };
        let req = RequestFacts {
            method: "GET",
            path: "/x",
            host: Some("app.example"),
            scheme: "http",
            client: "127.0.0.3:5000".parse().unwrap(),
            protocol: "1.1",
            route: Some("web"),
            service: Some("web"),
            request_id: Some("req-1"),
            status: 200,
            error: None,
            trace_state: Some("k=v"),
            start: t0,
            end: t0 + Duration::from_millis(30),
        };
        let attempts = [
            AttemptFacts {
                backend: "b0",
                addr: "127.0.0.1:8001",
                queued_at: Some(t0 + Duration::from_millis(1)),
                sent: t0 + Duration::from_millis(5),
                ended: t0 + Duration::from_millis(10),
                status: None,
                error: Some("connect_failed"),
                fresh_connection: false,
            },
            AttemptFacts {
                backend: "b1",
                addr: "[::1]:8002",
                queued_at: None,
                sent: t0 + Duration::from_millis(11),
                ended: t0 + Duration::from_millis(29),
                status: Some(200),
                error: None,
                fresh_connection: false,
            },
        ];
        let spans = request_spans(&ctx, &req, &attempts, &mut RandomIds);
        assert_eq!(spans.len(), 4, "request, queue, attempt, attempt");
        let server = &spans[0];
        assert_eq!((server.kind, server.parent_id, &server.name[..]), (Kind::Server, Some([1; 8]), "GET web"));
        assert_eq!(server.trace_state, "k=v");
        assert_eq!(server.end_unix_ns - server.start_unix_ns, 30_000_000);
        assert!(server.error.is_none());
        let (queue, first, second) = (&spans[1], &spans[2], &spans[3]);
        assert_eq!((queue.kind, queue.end_unix_ns - queue.start_unix_ns), (Kind::Internal, 4_000_000));
        for child in [queue, first, second] {
            assert_eq!((child.trace_id, child.parent_id), ([9; 16], Some([2; 8])));
        }
        assert_eq!(first.error.as_deref(), Some("connect_failed"));
        let attr = |s: &Span, k: &str| s.attributes.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
        assert_eq!(attr(first, "tidegate.queue_wait_us"), Some(Value::Int(4_000)));
        assert_eq!(attr(second, "tidegate.retry_cause"), Some(Value::from("connect_failed")));
        assert_eq!(attr(second, "tidegate.time_to_first_byte_us"), Some(Value::Int(18_000)));
        assert_eq!(attr(second, "http.response.status_code"), Some(Value::Int(200)));
        assert_eq!(attr(second, "server.address"), Some(Value::from("::1")));
        assert_eq!(attr(second, "server.port"), Some(Value::Int(8002)));
        assert_ne!(first.span_id, second.span_id);
    }

    #[test]
    fn a_proxy_error_fails_the_request_span() {
        let t0 = Instant::now();
        let ctx = Context { trace_id: [9; 16], parent_id: None, span_id: [2; 8], sampled: true };
        let req = RequestFacts {
            method: "POST",
            path: "/",
            host: None,
            scheme: "https",
            client: "127.0.0.1:1".parse().unwrap(),
            protocol: "2",
            route: None,
            service: None,
            request_id: None,
            status: 404,
            error: Some("no_route"),
            trace_state: None,
            start: t0,
            end: t0,
        };
        let spans = request_spans(&ctx, &req, &[], &mut RandomIds);
        assert_eq!(spans.len(), 1);
        assert_eq!((spans[0].name.as_str(), spans[0].error.as_deref()), ("POST", Some("no_route")));
        assert_eq!(spans[0].parent_id, None);
    }
}
