//! Forwarding to a backend: prepare the request once, then attempts, each
//! against one backend, until one succeeds or [`decide`] says to stop.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::request::Parts;
use http::uri::PathAndQuery;
use http::{Method, Request, Response, StatusCode, Uri, Version};
use http_body::Body as _;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;

use tidegate_balance::{clock, orca, record_outcome, Backend, Outcome, RequestCtx};
use tidegate_distributor::{DistributorClient, Query};
use tidegate_model::{ExternalSpec, PolicySpec, ServiceSettings};
use tidegate_snapshot::{ServiceLive, ServiceRuntime};

use crate::body::{ClientBody, Hold, ProxyBody, UpBody};
use crate::error::ClientBodyError;
use crate::error::ErrorKind;
use crate::headers;
use crate::limits::Limits;
use crate::metrics::Counters;
use crate::pick::{pick_or_wait, Queue, Slot};
use crate::pool::{ConnSettings, Sent, UpstreamPool};
use crate::retry::{decide, Decision, Failure, Progress};
use crate::tunnel;

/// The client end of a connection, prepared once per connection.
#[derive(Debug, Clone)]
pub struct Peer {
    /// The client's address.
    pub addr: SocketAddr,
    /// Its IP as a header value, for `X-Forwarded-For`.
    pub ip_header: HeaderValue,
    /// Whether it is a trusted proxy, whose forwarding headers are kept.
    pub trusted: bool,
    /// The connection's place under `--max-connections`, shared with an
    /// upgraded tunnel so that the tunnel keeps it.
    pub conn_slot: Option<Arc<tokio::sync::OwnedSemaphorePermit>>,
}

impl Peer {
    /// Describes a client connection (untrusted).
    pub fn new(addr: SocketAddr) -> Peer {
        let ip_header =
            HeaderValue::from_str(&addr.ip().to_string()).unwrap_or_else(|_| HeaderValue::from_static("unknown"));
        Peer { addr, ip_header, trusted: false, conn_slot: None }
    }
}

/// Request bodies up to this size are buffered so a failed attempt can be
/// replayed on another backend; larger ones stream and are retried only
/// when no byte of them was sent.
const REPLAY_LIMIT: u64 = 64 * 1024;

/// A worker's way to its backends: its connection pool and its
/// external-distributor client.
pub(crate) struct Upstreams {
    pool: UpstreamPool,
    /// Asks external distributors (paper S4); one per worker.
    distributor: DistributorClient,
    /// Client-side limits (body timeouts).
    limits: Arc<Limits>,
}

impl Upstreams {
    pub(crate) fn new(limits: Arc<Limits>) -> Upstreams {
        Upstreams { pool: UpstreamPool::default(), distributor: DistributorClient::default(), limits }
    }
}

/// A request ready to be sent, any number of times its body allows.
struct Prepared {
    parts: Parts,
    body: Replay,
    path_and_query: PathAndQuery,
    /// The client's side of an upgrade (WebSocket), if it asked for one.
    upgrade: Option<hyper::upgrade::OnUpgrade>,
    idempotent: bool,
}

/// What every attempt sends, apart from the body.
#[derive(Clone, Copy)]
struct Target<'a> {
    parts: &'a Parts,
    path_and_query: &'a PathAndQuery,
    upgrade: bool,
}

impl Prepared {
    /// Reads what the attempts need from the client's request: forwarding
    /// headers, and the body, buffered when it is small and complete.
    async fn new(mut req: Request<Incoming>, peer: &Peer, limits: &Limits) -> Result<Prepared, ErrorKind> {
        let upgrade = wants_upgrade(&req).then(|| hyper::upgrade::on(&mut req));
        let (mut parts, body) = req.into_parts();
        let body = Replay::new(body, limits).await?;
        headers::request_headers(&mut parts, peer, upgrade.is_some());
        let path_and_query = parts.uri.path_and_query().cloned().unwrap_or_else(|| PathAndQuery::from_static("/"));
        let idempotent = is_idempotent(&parts.method);
        Ok(Prepared { parts, body, path_and_query, upgrade, idempotent })
    }

    fn retry_traits(&self) -> crate::retry::Request {
        crate::retry::Request { idempotent: self.idempotent, replayable: self.body.replayable() }
    }
}

impl ConnSettings {
    fn of(settings: &ServiceSettings) -> ConnSettings {
        ConnSettings {
            connect: Duration::from_millis(settings.timeouts.connect_ms),
            idle: Duration::from_millis(settings.timeouts.idle_ms),
            max_idle: settings.upstream.max_idle as usize,
        }
    }
}

/// How one attempt ended, as passive health sees it: `None` when the
/// backend is not to blame (the client broke the exchange, or a pooled
/// connection raced its idle close).
fn outcome_of(result: &Result<Sent, ErrorKind>) -> Option<Outcome> {
    match result {
        Ok(sent) => Some(match sent.response.status().as_u16() {
            429 | 503 => Outcome::Overloaded,
            s if s >= 500 => Outcome::Failure,
            _ => Outcome::Success,
        }),
        Err(kind) if kind.blames_backend() => Some(Outcome::Failure),
        Err(_) => None,
    }
}

impl Upstreams {
    /// Forwards `req` to a backend of `service`, trying others on failure.
    pub(crate) async fn forward(
        &self,
        service: &ServiceRuntime,
        req: Request<Incoming>,
        peer: &Peer,
        metrics: &Counters,
    ) -> Result<Response<ProxyBody>, ErrorKind> {
        let settings = &service.settings;
        let mut req = Prepared::new(req, peer, &self.limits).await?;
        let ctx =
            RequestCtx { client: Some(peer.addr), path: req.path_and_query.as_str(), headers: &req.parts.headers };
        let reads_orca = settings.load_metrics.orca || matches!(settings.policy, PolicySpec::OrcaWrr(_));
        let mut tried: Vec<Arc<Backend>> = Vec::new();
        let mut queue = Queue::new(settings.queue.timeout_ms);
        let mut first = match &settings.policy {
            PolicySpec::External(spec) => {
                self.ask_distributor(spec, service, &req.parts, &req.path_and_query, peer).await
            }
            _ => None,
        };
        let mut progress = Progress { retries: 0, max_retries: settings.retries, fresh_retries: 0 };
        let mut _retry_token = None;
        // What the client gets when no attempt succeeds.
        let mut last = ErrorKind::NoBackend;
        let mut shed: Option<Response<ProxyBody>> = None;
        let mut same_backend: Option<Arc<Backend>> = None;
        loop {
            let fresh = same_backend.is_some();
            let backend = match same_backend.take() {
                Some(b) => b,
                None => {
                    let picked = match first.take() {
                        Some(b) => Some(b),
                        None => pick_or_wait(service, &ctx, &tried, &mut queue).await?,
                    };
                    queue.waiting = None; // no longer waiting: free the queue place
                    let Some(b) = picked else { break };
                    tried.push(b.clone());
                    b
                }
            };
            let Some(body) = req.body.take() else { break };
            if progress.retries + progress.fresh_retries > 0 {
                metrics.retry();
            }
            let upgrade = req.upgrade.is_some();
            let target = Target { parts: &req.parts, path_and_query: &req.path_and_query, upgrade };
            let (result, slot) = self.attempt(service, &backend, target, &mut req.body, body, fresh).await?;
            let failure = match result {
                Ok(Sent { mut response, conn }) => {
                    if reads_orca {
                        read_orca(&response, &backend);
                    }
                    let hold = Hold { slot, conn: Some(conn) };
                    if response.status() == StatusCode::SWITCHING_PROTOCOLS {
                        if let Some(down) = req.upgrade.take() {
                            let up = hyper::upgrade::on(&mut response);
                            tunnel::splice(down, up, hold, peer.conn_slot.clone(), self.limits.tunnel_idle_timeout);
                        }
                        return Ok(response.map(|_| ProxyBody::empty()));
                    }
                    headers::response_headers(response.headers_mut());
                    let response = response.map(|b| ProxyBody::upstream(b, hold));
                    if response.status() != StatusCode::SERVICE_UNAVAILABLE {
                        return Ok(response);
                    }
                    // The backend shed the request: another one may take it;
                    // if none can, the client gets this 503.
                    shed = Some(response);
                    Failure::Shed
                }
                Err(kind) => {
                    tracing::debug!(backend = %backend.addr, error = kind.name(), "upstream attempt failed");
                    last = kind;
                    Failure::Error(kind)
                }
            };
            match decide(failure, req.retry_traits(), progress) {
                Decision::GiveUp => break,
                Decision::SameBackendFreshConnection => {
                    progress.fresh_retries += 1;
                    same_backend = Some(backend);
                }
                Decision::OtherBackend { budgeted } => {
                    if budgeted {
                        // The budget bounds the extra work retries put on
                        // backends; a request that reached none costs none.
                        let in_flight = service.selector.backends().iter().map(|b| b.stats.in_flight()).sum();
                        if !service.live.try_retry(&settings.retry_budget, in_flight) {
                            break;
                        }
                        _retry_token = Some(RetryToken(&service.live));
                    }
                    progress.retries += 1;
                }
            }
        }
        shed.ok_or(last)
    }
}

impl Upstreams {
    /// One attempt against one backend: sends the request (on a new
    /// connection when `fresh`) and waits for the response head within the
    /// service's response timeout. Records the outcome for passive health
    /// when the backend is to blame, and takes back a streamed body no byte
    /// of which was sent (into `replay`). Returns the result and the backend
    /// slot it holds.
    async fn attempt(
        &self,
        service: &ServiceRuntime,
        backend: &Arc<Backend>,
        target: Target<'_>,
        replay: &mut Replay,
        body: UpBody,
        fresh: bool,
    ) -> Result<(Result<Sent, ErrorKind>, Slot), ErrorKind> {
        let settings = &service.settings;
        let up = upstream_request(target.parts, backend, target.path_and_query, body)?;
        let mut slot = Slot::take(backend, service);
        let conn = ConnSettings::of(settings);
        let sending = self.pool.send(&backend.addr, conn, up, fresh, target.upgrade);
        let result = match tokio::time::timeout(Duration::from_millis(settings.timeouts.response_ms), sending).await {
            Ok(Ok(sent)) => Ok(sent),
            Ok(Err(unsent)) => {
                if let Some(r) = unsent.request {
                    replay.put_back(r.into_body());
                }
                Err(unsent.kind)
            }
            Err(_) => Err(ErrorKind::ResponseTimeout),
        };
        if let Some(outcome) = outcome_of(&result) {
            slot.record(outcome);
            let pool = service.selector.backends();
            if record_outcome(backend, outcome, clock::now_ms(), &settings.health.passive, pool) {
                tracing::warn!(service = %service.name, backend = %backend.id, addr = %backend.addr, "backend ejected after consecutive failures");
            }
        }
        Ok((result, slot))
    }
}

/// Stores an ORCA load report carried by a response.
fn read_orca<B>(resp: &Response<B>, backend: &Backend) {
    let report = resp.headers().get(orca::ORCA_HEADER).and_then(|v| v.to_str().ok()).and_then(orca::parse);
    if let Some(r) = report {
        r.apply(&backend.stats.load, clock::now_ms());
    }
}

/// A retry admitted by the service's retry budget, returned when dropped.
struct RetryToken<'a>(&'a ServiceLive);

impl Drop for RetryToken<'_> {
    fn drop(&mut self) {
        self.0.retry_done();
    }
}

impl Upstreams {
    /// The backend an external distributor names for this request, if it
    /// answers with one of the service's available backends with room; on no
    /// answer, a backup backend (the paper's fallback), else `None` (the
    /// local policy decides).
    async fn ask_distributor(
        &self,
        spec: &ExternalSpec,
        service: &ServiceRuntime,
        parts: &Parts,
        path: &PathAndQuery,
        peer: &Peer,
    ) -> Option<Arc<Backend>> {
        let query = Query {
            policy: &spec.policy,
            client: peer.addr,
            method: parts.method.as_str(),
            path: path.as_str(),
            host: parts.uri.authority().map(|a| a.as_str()),
            headers: &parts.headers,
        };
        let timeout = Duration::from_millis(spec.timeout_ms);
        let answer = self.distributor.query(spec.addr, &query, timeout, spec.tries).await;
        let now = clock::now_ms();
        let usable = |b: &Backend| b.stats.is_available(now) && b.has_room();
        let backends = service.selector.backends();
        match answer {
            Some(addr) => {
                let found = backends.iter().find(|b| b.addr.as_str().parse::<SocketAddr>().ok() == Some(addr));
                if found.is_none() {
                    tracing::debug!(service = %service.name, %addr, "distributor named a backend outside the pool");
                }
                found.filter(|b| usable(b)).cloned()
            }
            None => backends.iter().filter(|b| b.backup && usable(b)).min_by_key(|b| b.stats.in_flight()).cloned(),
        }
    }
}

/// The request body, buffered when small so it can be sent more than once.
enum Replay {
    Buffered(Bytes),
    Streaming(Option<ClientBody>),
}

impl Replay {
    async fn new(body: Incoming, limits: &Limits) -> Result<Replay, ErrorKind> {
        if body.is_end_stream() {
            return Ok(Replay::Buffered(Bytes::new()));
        }
        let body = ClientBody::new(body, limits.body_read_timeout, limits.body_total_timeout);
        match body.size_hint().exact() {
            Some(n) if n <= REPLAY_LIMIT => match Limited::new(body, REPLAY_LIMIT as usize).collect().await {
                Ok(collected) => Ok(Replay::Buffered(collected.to_bytes())),
                Err(e) => Err(e.downcast_ref::<ClientBodyError>().map_or(ErrorKind::ClientBody, ClientBodyError::kind)),
            },
            _ => Ok(Replay::Streaming(Some(body))),
        }
    }

    /// Whether every attempt can send the whole body.
    fn replayable(&self) -> bool {
        matches!(self, Replay::Buffered(_))
    }

    /// The body for one more attempt, if it can be sent again.
    fn take(&mut self) -> Option<UpBody> {
        match self {
            Replay::Buffered(b) => Some(UpBody::Buffered(Full::new(b.clone()))),
            Replay::Streaming(b) => b.take().map(UpBody::Streaming),
        }
    }

    /// Takes back a streamed body that no attempt started to send.
    fn put_back(&mut self, body: UpBody) {
        if let (Replay::Streaming(slot), UpBody::Streaming(b)) = (self, body) {
            *slot = Some(b);
        }
    }
}

fn is_idempotent(m: &Method) -> bool {
    matches!(*m, Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE)
}

/// Whether the client asks for a protocol upgrade the proxy passes on
/// (WebSocket and the like). `h2c` is never passed on: the proxy speaks
/// HTTP/2 to clients itself, and a backend must not switch protocols under
/// it.
fn wants_upgrade<B>(req: &Request<B>) -> bool {
    req.version() == Version::HTTP_11
        && req.headers().get(header::UPGRADE).is_some_and(|v| !v.as_bytes().eq_ignore_ascii_case(b"h2c"))
        && req
            .headers()
            .get_all(header::CONNECTION)
            .iter()
            .any(|v| v.to_str().is_ok_and(|s| s.split(',').any(|t| t.trim().eq_ignore_ascii_case("upgrade"))))
}

fn upstream_request(
    parts: &Parts,
    backend: &Backend,
    path_and_query: &PathAndQuery,
    body: UpBody,
) -> Result<Request<UpBody>, ErrorKind> {
    // Origin-form (`/path?query`): an HTTP/1.1 connection writes the URI
    // as it is given.
    let uri = Uri::from(path_and_query.clone());
    let mut req = Request::new(body);
    *req.method_mut() = parts.method.clone();
    *req.uri_mut() = uri;
    *req.version_mut() = Version::HTTP_11;
    *req.headers_mut() = parts.headers.clone();
    if !req.headers().contains_key(header::HOST) {
        // An HTTP/1.0 client may send none; HTTP/1.1 requires one.
        let host = HeaderValue::from_str(backend.authority.as_str()).map_err(|_| ErrorKind::BadRequest)?;
        req.headers_mut().insert(header::HOST, host);
    }
    Ok(req)
}
