//! What the proxy saw of one request: filled in while it is served, read
//! once it is answered, for the request-duration histograms and the
//! access log.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::header::{self, HeaderValue};
use http::{Request, Version};
use tidegate_balance::Backend;
use tidegate_model::{RouteName, ServiceName};
use tidegate_snapshot::{Entry, RouteStats};
use tokio::time::Instant;

use crate::access_log::{AccessLog, Line};
use crate::conn::Peer;
use crate::error::ErrorKind;
use crate::metrics::Counters;
use crate::traces::Traced;
use crate::upbody::Inbound;

/// One request, as seen.
#[derive(Debug)]
pub(crate) struct Seen {
    /// When its head was read.
    pub start: Instant,
    /// The matched route's statistics.
    pub route: Option<Arc<RouteStats>>,
    /// The route's and its service's names, kept for the access log only.
    pub names: Option<(RouteName, Option<ServiceName>)>,
    /// The status sent (0 until one is).
    pub status: u16,
    /// Why the proxy answered itself, if it did.
    pub error: Option<ErrorKind>,
    /// The backend that answered last, and how many attempts were made.
    pub backend: Option<Arc<Backend>>,
    pub attempts: u32,
    /// The id generated for it, if the client sent no acceptable one
    /// ([`crate::headers::client_request_id`]).
    pub request_id: Option<[u8; 32]>,
    /// The rule step that answered it, or the steps that changed it
    /// (`set[step] kind`, comma-separated), for the access log.
    pub rule: Option<String>,
    /// What the route's rules hold while it is served (a
    /// `concurrency_limit`'s places), until its response ends.
    pub held: Vec<tidegate_rules::Permit>,
    /// Its trace, when tracing is on.
    pub trace: Option<Box<Traced>>,
}

impl Seen {
    /// A request whose head was read at `start`.
    pub(crate) fn new(start: Instant) -> Seen {
        Seen {
            start,
            route: None,
            names: None,
            status: 0,
            error: None,
            backend: None,
            attempts: 0,
            request_id: None,
            rule: None,
            held: Vec::new(),
            trace: None,
        }
    }

    /// Whether the route's and service's names are kept: for the access
    /// log (`logging`), or for a recorded trace.
    fn keeps_names(&self, logging: bool) -> bool {
        logging || self.trace.as_ref().is_some_and(|t| t.records_attempts())
    }

    /// A new [`crate::attempts::Trace`] for the request's attempts: each
    /// one recorded when the request's trace is.
    pub(crate) fn attempts_trace(&self) -> crate::attempts::Trace {
        crate::attempts::Trace {
            record: self.trace.as_ref().filter(|t| t.records_attempts()).map(|_| Vec::new()),
            ..crate::attempts::Trace::default()
        }
    }

    /// The request ended at `ended`: its spans are exported, when it is
    /// traced and recorded.
    pub(crate) fn finish_trace(&mut self, ended: Instant) {
        if let Some(mut t) = self.trace.take() {
            t.finish(self, ended);
            // (Kept for the access log's trace id.)
            self.trace = Some(t);
        }
    }

    /// The request matched `route`; its names are kept only if `logging`.
    pub(crate) fn routed(&mut self, route: &Entry, logging: bool) {
        self.route = Some(route.stats.clone());
        if self.keeps_names(logging) {
            self.names = Some((route.name.clone(), route.spec.service().cloned()));
        }
    }

    /// Takes what the route's rules hold while the request is served, and
    /// when logging (`chain`: the route's chain then), the steps that
    /// changed it.
    pub(crate) fn rules_changed(&mut self, edits: &mut tidegate_rules::Forward, chain: Option<&tidegate_rules::Chain>) {
        if !edits.permits.is_empty() {
            self.held = std::mem::take(&mut edits.permits);
        }
        if let Some(chain) = chain.filter(|_| !edits.changed.is_empty()) {
            let steps: Vec<String> = chain.changed_rules(edits).map(describe_rule).collect();
            self.rule = Some(steps.join(","));
        }
    }

    /// Notes the rule step that gave `answer`, if one did, when `logging`.
    pub(crate) fn rule_answered(&mut self, answer: &crate::pipeline::Local, logging: bool) {
        if let (true, crate::pipeline::Local::Rule(a)) = (logging, answer) {
            self.rule = Some(describe_rule(&a.answer.rule));
        }
    }

    /// Takes what the attempts did.
    pub(crate) fn traced(&mut self, trace: crate::attempts::Trace) {
        self.attempts = trace.attempts;
        self.backend = trace.backend;
        if let (Some(t), Some(records)) = (&mut self.trace, trace.record) {
            t.attempts(records);
        }
    }

    /// The request id as text: the generated one (the client's own is in
    /// its headers).
    pub(crate) fn generated_id(&self) -> Option<String> {
        self.request_id.map(|id| String::from_utf8_lossy(&id).into_owned())
    }

    /// A line with what this record of a request that `ended` holds; the
    /// caller fills in what the request itself says (method, host, target,
    /// headers, bytes).
    pub(crate) fn line(&self, client: SocketAddr, protocol: &'static str, ended: Instant) -> Line {
        let mut line = blank(client, protocol);
        self.fill(&mut line, ended);
        line
    }

    /// Writes what this record of a request that `ended` holds into
    /// `line`: the end (wall clock) and duration, the status, route,
    /// service, backend, attempts and error, and the generated request id
    /// if the line has none.
    pub(crate) fn fill(&self, line: &mut Line, ended: Instant) {
        line.end = SystemTime::now();
        line.duration = ended.saturating_duration_since(self.start);
        line.status = self.status;
        if let Some((route, service)) = &self.names {
            line.route = Some(route.clone());
            line.service = service.clone();
        }
        line.backend = self.backend.as_ref().map(|b| (b.id.clone(), b.addr.clone()));
        line.attempts = self.attempts;
        line.error = self.error.map(ErrorKind::name);
        line.rule.clone_from(&self.rule);
        if line.request_id.is_none() {
            line.request_id = self.generated_id();
        }
        line.trace_id = self.trace.as_ref().map(|t| t.ctx.trace_id_hex());
    }
}

/// A rule step as the access log names it: `set[step] kind`.
fn describe_rule(rule: &tidegate_rules::RuleRef) -> String {
    format!("{}[{}] {}", rule.set, rule.step, rule.kind)
}

/// A line with only the client and protocol known.
fn blank(client: SocketAddr, protocol: &'static str) -> Line {
    Line {
        end: SystemTime::now(),
        duration: Duration::ZERO,
        client,
        method: String::new(),
        host: String::new(),
        target: String::new(),
        protocol,
        status: 0,
        bytes_in: 0,
        bytes_out: 0,
        route: None,
        service: None,
        backend: None,
        attempts: 0,
        error: None,
        rule: None,
        request_id: None,
        trace_id: None,
        user_agent: None,
        referer: None,
        client_cert: None,
    }
}

/// The subject of the client's verified certificate, for the access log.
pub(crate) fn client_cert_subject(client: &Peer) -> Option<String> {
    client.client_cert.as_ref().map(|c| String::from_utf8_lossy(c.cert.subject.as_bytes()).into_owned())
}

/// Counts a finished request: in its route's duration histogram (or the
/// one of requests that matched no route), and its retries.
pub(crate) fn count(seen: &Seen, ended: Instant, counters: &Counters) {
    let took = ended.saturating_duration_since(seen.start);
    seen.route.as_deref().unwrap_or(&counters.unrouted).observe(seen.status, took);
    if seen.attempts > 1 {
        counters.retried(u64::from(seen.attempts - 1));
    }
}

/// The access-log line of a request that arrived over hyper, as far as
/// the request says (the rest comes from its [`Seen`] when it ends). A
/// request without one acceptable `X-Request-Id` gets a new one here
/// ([`crate::headers::settle_request_id`]), so that the line and the
/// backend see the same.
pub(crate) fn describe(req: &mut Request<Inbound>, client: &Peer) -> Line {
    let protocol = match req.version() {
        Version::HTTP_10 => "HTTP/1.0",
        Version::HTTP_2 => "HTTP/2.0",
        Version::HTTP_3 => "HTTP/3",
        _ => "HTTP/1.1",
    };
    let mut line = blank(client.addr, protocol);
    line.client_cert = client_cert_subject(client);
    let text = |v: &HeaderValue| String::from_utf8_lossy(v.as_bytes()).into_owned();
    let h = req.headers();
    line.method = req.method().as_str().to_string();
    line.target = req.uri().path_and_query().map_or_else(|| "/".to_string(), |pq| pq.as_str().to_string());
    line.host = req.uri().host().map(str::to_string).or_else(|| h.get(header::HOST).map(text)).unwrap_or_default();
    line.user_agent = h.get(header::USER_AGENT).map(text);
    line.referer = h.get(header::REFERER).map(text);
    line.bytes_in = http_body::Body::size_hint(req.body()).exact().unwrap_or(0);
    line.request_id = Some(text(&crate::headers::settle_request_id(req.headers_mut())));
    line
}

/// The end of a request that arrived over hyper: when dropped (its
/// response body ended or was dropped, or its handler was dropped before an
/// answer: the client went away), the request is counted and logged. A
/// request that never got an answer is counted as 499, as nginx logs a
/// client that closed first.
#[derive(Debug)]
pub(crate) struct Finish {
    pub seen: Seen,
    /// What the request said, when the access log is on.
    pub line: Option<Line>,
    pub counters: Arc<Counters>,
    pub log: Option<Arc<AccessLog>>,
    /// Body bytes sent.
    pub bytes_out: u64,
}

/// The status counted for a request whose client went away first.
pub(crate) const CLIENT_GONE: u16 = 499;

impl Drop for Finish {
    fn drop(&mut self) {
        if self.seen.status == 0 {
            self.seen.status = CLIENT_GONE;
        }
        let ended = Instant::now();
        count(&self.seen, ended, &self.counters);
        self.seen.finish_trace(ended);
        if let (Some(log), Some(mut line)) = (&self.log, self.line.take()) {
            self.seen.fill(&mut line, ended);
            line.bytes_out = self.bytes_out;
            log.send(line);
        }
    }
}
