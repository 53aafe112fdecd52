//! Requests traced in OpenTelemetry's model (`tidegate-trace`), as both
//! engines use it: the context is decided from the request's
//! `traceparent` when its head is read, the backend gets the proxy's
//! `traceparent` (and the caller's `tracestate` with it), and when the
//! request ends a recorded request goes to the exporter's queue as what
//! it saw ([`Finished`]); its spans are built on the export thread.

use std::net::SocketAddr;

use tidegate_model::{RouteName, ServiceName};
use tidegate_trace::{
    AttemptFacts, Context, Exporter, RandomIds, Recording, RequestFacts, Sampler, Span, TRACEPARENT_LEN,
};
use tokio::time::Instant;

use crate::attempts::AttemptRecord;
use crate::observe::Seen;

/// Tracing, when it is on (`serve --otlp-endpoint`).
#[derive(Debug, Clone)]
pub struct Tracing {
    /// Which requests are recorded.
    pub sampler: Sampler,
    /// Where recorded spans go.
    pub exporter: Exporter,
}

/// What a request says about itself, for its span (taken when it is
/// recorded only).
#[derive(Debug)]
pub(crate) struct Said {
    pub method: String,
    pub path: String,
    pub host: Option<String>,
    pub scheme: &'static str,
    pub protocol: &'static str,
    pub client: SocketAddr,
    pub request_id: Option<String>,
    pub trace_state: Option<String>,
}

/// One request's trace.
#[derive(Debug)]
pub(crate) struct Traced {
    /// Its context (the trace, the proxy's span, the decision).
    pub ctx: Context,
    /// The `traceparent` its backend gets.
    pub header: [u8; TRACEPARENT_LEN],
    /// When it is recorded: what it said, its attempts and where its
    /// spans go.
    pub recorded: Option<(Said, Vec<AttemptRecord>, Exporter)>,
}

impl Traced {
    /// The trace of a request whose `traceparent` fields are `incoming`;
    /// `said` is asked only when the request is recorded.
    pub(crate) fn start<'a>(
        tracing: &Tracing,
        incoming: impl Iterator<Item = &'a [u8]>,
        said: impl FnOnce() -> Said,
    ) -> Box<Traced> {
        let ctx = tracing.sampler.decide(incoming, &mut RandomIds);
        let recorded = ctx.sampled.then(|| (said(), Vec::new(), tracing.exporter.clone()));
        Box::new(Traced { header: ctx.upstream_traceparent(), ctx, recorded })
    }

    /// Whether the request's attempts are to be recorded.
    pub(crate) fn records_attempts(&self) -> bool {
        self.recorded.is_some()
    }

    /// Keeps the attempts' records.
    pub(crate) fn attempts(&mut self, records: Vec<AttemptRecord>) {
        if let Some((_, attempts, _)) = &mut self.recorded {
            *attempts = records;
        }
    }

    /// The request, as `seen`, ended at `ended`: when it is recorded,
    /// what it saw goes to the exporter (once; its spans are built there).
    pub(crate) fn finish(&mut self, seen: &Seen, ended: Instant) {
        let Some((mut said, attempts, exporter)) = self.recorded.take() else { return };
        // The client's id when it was kept, else the one generated for it.
        let request_id = said.request_id.take().or_else(|| seen.generated_id());
        exporter.record_request(Box::new(Finished {
            ctx: self.ctx,
            said,
            attempts,
            names: seen.names.clone(),
            request_id,
            status: seen.status,
            error: seen.error.map(crate::ErrorKind::name),
            start: seen.start,
            end: ended,
        }));
    }
}

/// A recorded request as it ended: what its spans are built from, on the
/// export thread.
#[derive(Debug)]
pub(crate) struct Finished {
    ctx: Context,
    said: Said,
    attempts: Vec<AttemptRecord>,
    names: Option<(RouteName, Option<ServiceName>)>,
    request_id: Option<String>,
    status: u16,
    error: Option<&'static str>,
    start: Instant,
    end: Instant,
}

impl Recording for Finished {
    fn span_count(&self) -> usize {
        1 + self.attempts.len() + self.attempts.iter().filter(|a| a.queued_at.is_some()).count()
    }

    fn spans(self: Box<Self>, out: &mut Vec<Span>) {
        let (said, names) = (&self.said, self.names.as_ref());
        let req = RequestFacts {
            method: &said.method,
            path: &said.path,
            host: said.host.as_deref(),
            scheme: said.scheme,
            client: said.client,
            protocol: said.protocol,
            route: names.map(|(r, _)| r.as_str()),
            service: names.and_then(|(_, s)| s.as_ref()).map(|s| s.as_str()),
            request_id: self.request_id.as_deref(),
            status: self.status,
            error: self.error,
            trace_state: said.trace_state.as_deref().filter(|_| self.ctx.keeps_tracestate()),
            start: self.start.into_std(),
            end: self.end.into_std(),
        };
        let facts: Vec<AttemptFacts<'_>> = self
            .attempts
            .iter()
            .map(|a| AttemptFacts {
                backend: a.backend.id.as_str(),
                addr: a.backend.addr.as_str(),
                queued_at: a.queued_at.map(Instant::into_std),
                sent: a.sent.into_std(),
                ended: a.ended.into_std(),
                status: a.result.ok(),
                error: match a.result {
                    Ok(503) => Some("shed"),
                    Ok(_) => None,
                    Err(kind) => Some(kind.name()),
                },
                fresh_connection: a.fresh,
            })
            .collect();
        out.extend(tidegate_trace::request_spans(&self.ctx, &req, &facts, &mut RandomIds));
    }
}

/// The trace of a request that arrived over hyper (tracing is on).
pub(crate) fn trace_of_hyper(
    tracing: &Tracing,
    req: &http::Request<crate::upbody::Inbound>,
    client: &crate::conn::Peer,
) -> Box<Traced> {
    let h = req.headers();
    let incoming = h.get_all("traceparent").iter().map(http::HeaderValue::as_bytes);
    Traced::start(tracing, incoming, || {
        let text = |v: &http::HeaderValue| String::from_utf8_lossy(v.as_bytes()).into_owned();
        let states: Vec<&[u8]> = h.get_all("tracestate").iter().map(http::HeaderValue::as_bytes).collect();
        Said {
            method: req.method().as_str().to_owned(),
            path: req.uri().path().to_owned(),
            host: req.uri().host().map(str::to_owned).or_else(|| h.get(http::header::HOST).map(text)),
            scheme: client.scheme(),
            protocol: match req.version() {
                http::Version::HTTP_2 => "2",
                http::Version::HTTP_10 => "1.0",
                _ => "1.1",
            },
            client: client.addr,
            request_id: h.get(&crate::headers::X_REQUEST_ID).map(text),
            trace_state: (!states.is_empty()).then(|| String::from_utf8_lossy(&states.join(&b","[..])).into_owned()),
        }
    })
}
