//! Per-request handling: snapshot, route, dispatch.

use std::sync::Arc;

use arc_swap::ArcSwap;
use http::{Request, Response};
use tidegate_snapshot::Snapshot;
use tokio::time::Instant;

use crate::access_log::{AccessLog, Line};
use crate::admission::Admission;
use crate::body::ProxyBody;
use crate::conn::Peer;
use crate::error::ErrorKind;
use crate::hygiene;
use crate::limits::Limits;
use crate::metrics::{Counters, ProxyMetrics};
use crate::observe::{describe, Finish, Seen};
use crate::pipeline::{self, Action, Facts, Local, Settings};
use crate::rules_work;
use crate::upbody::Inbound;
use crate::upstreams::Upstreams;

/// The request handler. One per worker (or one shared, in the multi-thread
/// runtime); holds the upstream connection pools.
pub struct Proxy {
    snapshots: Arc<ArcSwap<Snapshot>>,
    upstreams: Upstreams,
    metrics: Arc<Counters>,
    /// What the request pipeline reads of the worker: the health path and
    /// the TLS listener's port.
    settings: Settings,
    /// Where each request's line goes, if anywhere.
    access_log: Option<Arc<AccessLog>>,
    /// The body buffer budget and per-client caps, shared by the workers.
    admission: Arc<Admission>,
    /// Traces, when they are on.
    tracing: Option<crate::Tracing>,
    /// `Alt-Svc` on the TLS listener's HTTP/1.1 and HTTP/2 responses,
    /// when HTTP/3 is on: the value, and the line the native engine adds.
    alt_svc: Option<(http::HeaderValue, Arc<Vec<u8>>)>,
}

impl Proxy {
    /// A handler reading snapshots from `snapshots`.
    /// `https_port`: the TLS listener's port, if there is one.
    pub fn new(
        snapshots: Arc<ArcSwap<Snapshot>>,
        metrics: &ProxyMetrics,
        limits: Arc<Limits>,
        https_port: Option<u16>,
    ) -> Proxy {
        let metrics = metrics.worker();
        let admission = Arc::new(Admission::new(&limits));
        let trusted_proxies = limits.trusted_proxies.clone();
        Proxy {
            snapshots,
            admission,
            upstreams: Upstreams::new(limits, &metrics),
            metrics,
            settings: Settings { health_path: None, https_port, trusted_proxies },
            access_log: None,
            tracing: None,
            alt_svc: None,
        }
    }

    /// Advertises HTTP/3 on `port` for `max_age_s` seconds in the TLS
    /// listener's HTTP/1.1 and HTTP/2 responses (`Alt-Svc`, RFC 7838).
    pub fn set_alt_svc(&mut self, port: u16, max_age_s: u64) {
        let value = format!("h3=\":{port}\"; ma={max_age_s}");
        // A thin pointer: every connection's task holds a copy.
        let line = Arc::new(format!("alt-svc: {value}\r\n").into_bytes());
        self.alt_svc = http::HeaderValue::from_str(&value).ok().map(|v| (v, line));
    }

    /// The `Alt-Svc` line the native engine adds to a client's responses
    /// (a client of the default TLS listener, when HTTP/3 is on: a named
    /// listener has routes of its own, which HTTP/3 does not serve).
    pub(crate) fn alt_svc_line(&self, client: &Peer) -> Option<Arc<Vec<u8>>> {
        self.alt_svc.as_ref().filter(|_| advertises(client)).map(|(_, line)| line.clone())
    }

    /// Shares one body buffer budget and one set of per-client counters
    /// with the other workers.
    pub(crate) fn share_admission(&mut self, admission: Arc<Admission>) {
        self.admission = admission;
    }

    /// The body buffer budget and per-client caps.
    pub(crate) fn admission(&self) -> &Arc<Admission> {
        &self.admission
    }

    /// Writes a line per request to `log`.
    pub fn set_access_log(&mut self, log: Option<Arc<AccessLog>>) {
        self.access_log = log;
    }

    /// The access log, when it is on.
    pub(crate) fn access_log(&self) -> Option<&Arc<AccessLog>> {
        self.access_log.as_ref()
    }

    /// Traces requests (`None`: off).
    pub fn set_tracing(&mut self, tracing: Option<crate::Tracing>) {
        self.tracing = tracing;
    }

    /// Tracing, when it is on.
    pub(crate) fn tracing(&self) -> Option<&crate::Tracing> {
        self.tracing.as_ref()
    }

    /// Answers `path` itself, before routing, for load balancers' health
    /// checks.
    pub fn set_health_path(&mut self, path: Option<&str>) {
        self.settings.health_path = path.map(Into::into);
    }

    /// What the request pipeline reads of the worker.
    pub(crate) fn settings(&self) -> &Settings {
        &self.settings
    }

    /// The current snapshot.
    pub(crate) fn snapshot(&self) -> Arc<Snapshot> {
        self.snapshots.load_full()
    }

    /// The worker's way to its backends.
    pub(crate) fn upstreams(&self) -> &Upstreams {
        &self.upstreams
    }

    /// The counters this handler updates.
    pub(crate) fn metrics(&self) -> &Arc<Counters> {
        &self.metrics
    }

    /// Serves one request. Its duration (and access-log line) is taken
    /// when the response body ends.
    pub async fn handle(&self, mut req: Request<Inbound>, client: &Peer) -> Response<ProxyBody> {
        let line = self.access_log.is_some().then(|| describe(&mut req, client));
        let alt_svc = self.alt_svc.as_ref().filter(|_| advertises(client) && req.version() != http::Version::HTTP_3);
        // Counted and logged when dropped: with the response body, or here
        // if the client goes away first (hyper drops this future).
        let mut seen = Seen::new(tokio::time::Instant::now());
        if let Some(tracing) = &self.tracing {
            seen.trace = Some(crate::traces::trace_of_hyper(tracing, &req, client));
        }
        let mut finish =
            Finish { seen, line, counters: self.metrics.clone(), log: self.access_log.clone(), bytes_out: 0 };
        let mut resp = match self.dispatch(req, client, &mut finish.seen).await {
            Ok(resp) => resp,
            Err(e) => {
                finish.seen.error = Some(e);
                self.metrics.error(e);
                crate::reply::error(e)
            }
        };
        if let Some((value, _)) = alt_svc {
            // Added beside a backend's own, as the native engine does.
            resp.headers_mut().append(http::header::ALT_SVC, value.clone());
        }
        self.metrics.response(resp.status());
        finish.seen.status = resp.status().as_u16();
        resp.map(|body| ProxyBody::observed(body, finish))
    }

    async fn dispatch(
        &self,
        mut req: Request<Inbound>,
        client: &Peer,
        seen: &mut Seen,
    ) -> Result<Response<ProxyBody>, ErrorKind> {
        // This engine's checks of the head; refused or not, the pipeline
        // decides (it refuses `CONNECT` before reading them).
        let checked = check_head(&mut req, self.upstreams.limits());
        let host = hygiene::request_routing_host(&req);
        let facts = Facts {
            host,
            target: pipeline::Asked::of_uri(req.uri()),
            received: seen.start.into_std(),
            headers: req.headers(),
            tls: client.https,
            stopping: false,
            peer: client.addr.ip(),
            client_cert: client.client_cert.as_deref(),
            listener: client.listener.as_deref(),
            content_length: req.headers().get(http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse().ok()),
        };
        let snapshot = self.snapshots.load_full();
        let decision = pipeline::decide(req.method(), checked.map(|()| &facts), &self.settings, &snapshot);
        if let Some(route) = decision.route {
            seen.routed(route, self.access_log.is_some());
        }
        let logging = self.access_log.is_some();
        if let Action::Local(answer) = decision.action {
            seen.rule_answered(&answer, logging);
            return crate::reply::local_response(answer);
        }
        // (A request the pipeline serves passed the engine's checks.)
        let mut rules = match rules_work::settle(decision.rules, &facts, req.method(), &self.settings).await {
            Ok(edits) => edits,
            Err(answer) => {
                seen.rule_answered(&answer, logging);
                return crate::reply::local_response(answer);
            }
        };
        if let Some(edits) = rules.as_deref_mut() {
            let chain = decision.route.filter(|_| logging).and_then(|r| r.attached.as_ref());
            seen.rules_changed(edits, chain.map(|c| &**c));
        }
        // What a `compress` step reads of the request.
        let accept_encoding = rules
            .as_deref()
            .filter(|e| e.response.compress.is_some())
            .and_then(|_| req.headers().get(http::header::ACCEPT_ENCODING).cloned());
        let to_head = req.method() == http::Method::HEAD;
        let target = rules
            .as_deref()
            .filter(|e| e.changes_path())
            .map(|_| pipeline::upstream_target(rules.as_deref(), facts.target).into_owned());
        drop(facts);
        let mut resp = match decision.action {
            Action::Local(answer) => return crate::reply::local_response(answer),
            Action::Static { dir, prefix } => {
                if let Some(target) = &target {
                    *req.uri_mut() = http::Uri::try_from(target.as_str()).map_err(|_| ErrorKind::InvalidPath)?;
                }
                tidegate_static::serve(dir, prefix, &req).await.map(ProxyBody::Static)
            }
            Action::Forward(service) => {
                drop(snapshot);
                if let Some(t) = &seen.trace {
                    let up = crate::native::Upstream { traceparent: t.header, tracestate: t.ctx.keeps_tracestate() };
                    up.set(req.headers_mut());
                }
                let mut trace = seen.attempts_trace();
                let edits = rules.as_deref();
                let forwarded = self.upstreams.forward(&service, req, client, &self.admission, &mut trace, edits).await;
                seen.traced(trace);
                forwarded?
            }
        };
        if let Some(edits) = &rules {
            if resp.status() != http::StatusCode::SWITCHING_PROTOCOLS {
                edits.apply_response_headers(resp.headers_mut());
                let accept = accept_encoding.as_ref().map(http::HeaderValue::as_bytes);
                resp = crate::compress::response(resp, &edits.response, accept, to_head);
            }
        }
        Ok(resp)
    }
}

/// Whether `client`'s answers advertise HTTP/3: a client of the default
/// TLS listener, whose address HTTP/3 shares.
fn advertises(client: &Peer) -> bool {
    client.https && client.listener.is_none()
}

/// The hyper engine's checks of a request head, in place: the header
/// count and the head's size against the proxy's limits (hyper's parsers
/// read a little past them, see [`crate::limits::HYPER_HEAD_MARGIN`], so
/// that a head over them gets the proxy's own answer here), then
/// [`hygiene::sanitize`].
fn check_head<B>(req: &mut Request<B>, limits: &Limits) -> Result<(), Local> {
    if req.headers().len() > limits.max_headers || head_size(req) > limits.max_header_bytes {
        return Err(Local::HeadTooLarge);
    }
    hygiene::sanitize(req).map_err(Local::Error)
}

/// A request head's size as the proxy counts it against
/// `max_header_bytes`, whichever version carried it: the request line and
/// the fields as HTTP/1.1 writes them (`name: value` and a line end each,
/// and the empty line). An HTTP/2 request's target counts with its scheme
/// and authority, as an absolute-form target would. Whitespace a client
/// padded an HTTP/1.1 line with is not counted.
fn head_size<B>(req: &Request<B>) -> usize {
    let uri = req.uri();
    let target = uri.scheme_str().map_or(0, |s| s.len() + "://".len())
        + uri.authority().map_or(0, |a| a.as_str().len())
        + uri.path_and_query().map_or(1, |pq| pq.as_str().len());
    let line = req.method().as_str().len() + " ".len() + target + " HTTP/1.1\r\n".len();
    let fields: usize = req.headers().iter().map(|(n, v)| n.as_str().len() + ": ".len() + v.len() + "\r\n".len()).sum();
    line + fields + "\r\n".len()
}

impl Proxy {
    /// Counts a request that `ended` (its last byte written) in its route's
    /// histogram and, when the access log is on, sends its line (`describe`
    /// fills in what only the request knows, from the record and `ended`:
    /// the line's duration is the histogram's).
    pub(crate) fn finish(&self, seen: &mut Seen, ended: Instant, describe: impl FnOnce(&Seen, Instant) -> Line) {
        crate::observe::count(seen, ended, self.metrics());
        seen.finish_trace(ended);
        if let Some(log) = self.access_log() {
            log.send(describe(seen, ended));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(uri: &str, fields: &[(&str, &str)]) -> Request<()> {
        let mut b = Request::builder().uri(uri);
        for (n, v) in fields {
            b = b.header(*n, *v);
        }
        b.body(()).unwrap()
    }

    #[test]
    fn a_head_counts_as_http11_writes_it() {
        let raw = "GET /a?b HTTP/1.1\r\nhost: example.com\r\nx-y: z\r\n\r\n";
        let req = request("/a?b", &[("host", "example.com"), ("x-y", "z")]);
        assert_eq!(head_size(&req), raw.len());
        let absolute = request("http://example.com/a?b", &[]);
        assert_eq!(head_size(&absolute), "GET http://example.com/a?b HTTP/1.1\r\n\r\n".len());
    }

    #[test]
    fn a_head_over_either_limit_is_refused_by_the_proxy() {
        let limits = Limits { max_header_bytes: 100, max_headers: 2, ..Limits::default() };
        let mut within = request("/", &[("host", "h"), ("x-a", "1")]);
        assert_eq!(check_head(&mut within, &limits), Ok(()));
        let mut many = request("/", &[("host", "h"), ("x-a", "1"), ("x-b", "2")]);
        assert_eq!(check_head(&mut many, &limits), Err(Local::HeadTooLarge));
        let mut large = request("/", &[("host", "h"), ("x-a", &"a".repeat(100))]);
        assert_eq!(check_head(&mut large, &limits), Err(Local::HeadTooLarge));
        assert!(limits.hyper_max_headers() > limits.max_headers, "hyper reads past the count");
        assert!(Limits::default().hyper_max_header_bytes() > Limits::default().max_header_bytes, "and the size");
    }
}
