//! Forwarding to a backend: pooled clients, headers, timeouts, retries,
//! upgrades.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::request::Parts;
use http::uri::{PathAndQuery, Scheme};
use http::{Method, Request, Response, StatusCode, Uri, Version};
use http_body::Body as _;
use http_body_util::{BodyExt, Either, Full, Limited};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use std::sync::atomic::Ordering::Relaxed;

use tidegate_balance::{clock, orca, record_outcome, Backend, InFlight, Outcome, RequestCtx};
use tidegate_distributor::{DistributorClient, Query};
use tidegate_model::{ExternalSpec, PolicySpec, Timeouts};
use tidegate_snapshot::{ServiceLive, ServiceRuntime};

use crate::body::ProxyBody;
use crate::errors::ProxyError;
use crate::metrics::Counters;

/// The client end of a connection, prepared once per connection.
#[derive(Debug, Clone)]
pub struct Peer {
    /// The client's address.
    pub addr: SocketAddr,
    /// Its IP as a header value, for `X-Forwarded-For`.
    pub ip_header: HeaderValue,
}

impl Peer {
    /// Describes a client connection.
    pub fn new(addr: SocketAddr) -> Peer {
        let ip_header =
            HeaderValue::from_str(&addr.ip().to_string()).unwrap_or_else(|_| HeaderValue::from_static("unknown"));
        Peer { addr, ip_header }
    }
}

/// The body sent upstream: buffered (replayable) or streamed through.
type UpBody = Either<Full<Bytes>, Incoming>;
type UpClient = Client<HttpConnector, UpBody>;
/// Clients by (connect_ms, idle_ms).
type ClientList = Vec<((u64, u64), Arc<UpClient>)>;

/// Request bodies up to this size are buffered so a failed attempt can be
/// replayed on another backend; larger ones stream and are not retried.
const REPLAY_LIMIT: u64 = 64 * 1024;

/// Pooled clients, one per distinct (connect, idle) timeout pair: connect and
/// idle timeouts are properties of a hyper-util client's connector and pool.
/// A handful of distinct pairs is the norm, so a list scan beats hashing.
#[derive(Default)]
pub(crate) struct Upstreams {
    clients: ArcSwap<ClientList>,
    /// Asks external distributors (paper S4); one per worker.
    distributor: DistributorClient,
}

impl Upstreams {
    fn client(&self, t: &Timeouts) -> Arc<UpClient> {
        let key = (t.connect_ms, t.idle_ms);
        if let Some((_, c)) = self.clients.load().iter().find(|(k, _)| *k == key) {
            return c.clone();
        }
        let client = Arc::new(build_client(t));
        self.clients.rcu(|list| {
            let mut list = Vec::clone(list);
            if !list.iter().any(|(k, _)| *k == key) {
                list.push((key, client.clone()));
            }
            list
        });
        client
    }

    /// Forwards `req` to a backend of `service`, trying others on failure.
    pub(crate) async fn forward(
        &self,
        service: &ServiceRuntime,
        mut req: Request<Incoming>,
        peer: &Peer,
        metrics: &Counters,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let settings = &service.settings;
        let client = self.client(&settings.timeouts);
        let upgrade = wants_upgrade(&req);
        let downstream_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
        let (mut parts, body) = req.into_parts();
        let mut body = Replay::new(body).await?;
        prepare_headers(&mut parts, peer, upgrade);
        let idempotent = is_idempotent(&parts.method);
        let path_and_query = parts.uri.path_and_query().cloned().unwrap_or_else(|| PathAndQuery::from_static("/"));
        let ctx = RequestCtx { client: Some(peer.addr), path: path_and_query.as_str(), headers: &parts.headers };
        let response_timeout = Duration::from_millis(settings.timeouts.response_ms);
        let mut _retry_token = None;
        let reads_orca = settings.load_metrics.orca || matches!(settings.policy, PolicySpec::OrcaWrr(_));
        let mut tried: Vec<Arc<Backend>> = Vec::new();
        let mut queue = Queue::new(settings.queue.timeout_ms);
        let mut first = match &settings.policy {
            PolicySpec::External(spec) => self.ask_distributor(spec, service, &parts, &path_and_query, peer).await,
            _ => None,
        };
        let mut last_error = ProxyError::NoBackend;
        let mut shed: Option<Response<ProxyBody>> = None;
        for attempt in 0..=settings.retries {
            // The budget bounds the extra work retries put on backends; a
            // connect failure put none there, so its retry is not counted.
            if attempt > 0 && (shed.is_some() || last_error != ProxyError::ConnectFailed) {
                let in_flight = service.selector.backends().iter().map(|b| b.stats.in_flight()).sum();
                if !service.live.try_retry(&settings.retry_budget, in_flight) {
                    break;
                }
                _retry_token = Some(RetryToken(&service.live));
            }
            let picked = match first.take() {
                Some(b) => Some(b),
                None => pick_or_wait(service, &ctx, &tried, &mut queue).await?,
            };
            let Some(backend) = picked else {
                break;
            };
            queue.waiting = None; // no longer waiting: free the queue place
            tried.push(backend.clone());
            let Some(up_body) = body.take() else {
                break;
            };
            if attempt > 0 {
                metrics.retry();
            }
            let up = upstream_request(&parts, &backend, &path_and_query, up_body)?;
            let limited = backend.max_conns.is_some();
            let mut guard = Slot { guard: Some(backend.stats.start()), live: limited.then(|| service.live.clone()) };
            let result = tokio::time::timeout(response_timeout, client.request(up)).await;
            let outcome = match &result {
                Ok(Ok(resp)) if matches!(resp.status().as_u16(), 429 | 503) => Outcome::Overloaded,
                Ok(Ok(resp)) if !resp.status().is_server_error() => Outcome::Success,
                _ => Outcome::Failure,
            };
            guard.record(outcome);
            let pool = service.selector.backends();
            if record_outcome(&backend, outcome, clock::now_ms(), &settings.health.passive, pool) {
                tracing::warn!(service = %service.name, backend = %backend.id, addr = %backend.addr, "backend ejected after consecutive failures");
            }
            match result {
                Ok(Ok(mut resp)) => {
                    if reads_orca {
                        read_orca(&resp, &backend);
                    }
                    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
                        if let Some(down) = downstream_upgrade {
                            splice_upgrade(down, hyper::upgrade::on(&mut resp));
                        }
                        return Ok(resp.map(|_| ProxyBody::empty()));
                    }
                    strip_hop_by_hop(resp.headers_mut());
                    let resp = resp.map(|b| ProxyBody::Upstream { body: b, guard: Some(guard) });
                    // A backend that shed the request (503) did not process it:
                    // an idempotent request may try another one; if none can
                    // take it, the client gets this 503.
                    if resp.status() == StatusCode::SERVICE_UNAVAILABLE && idempotent && attempt < settings.retries {
                        shed = Some(resp);
                        continue;
                    }
                    return Ok(resp);
                }
                Ok(Err(e)) => {
                    let connect = e.is_connect();
                    tracing::debug!(backend = %backend.addr, error = %e, connect, "upstream attempt failed");
                    last_error = if connect { ProxyError::ConnectFailed } else { ProxyError::UpstreamFailed };
                    // Nothing was sent on a connect failure, so any method may go
                    // elsewhere; after a send, only idempotent ones.
                    if !(connect || idempotent) {
                        break;
                    }
                }
                Err(_) => {
                    last_error = ProxyError::Timeout;
                    break;
                }
            }
        }
        shed.ok_or(last_error)
    }
}

/// What a pick found.
enum Pick {
    /// A backend to try.
    Backend(Arc<Backend>),
    /// Available backends exist, but all are at their `max_conns`.
    Full,
    /// No untried backend at all.
    Nothing,
}

/// Picks a backend not tried yet for this request: preferably one that is
/// available (active checks pass, not ejected) with room under its
/// `max_conns`, admitted by slow start's ramp; else any available one with
/// room. If available backends exist but are all full, that is `Full`. When
/// no backend is available at all, any untried one with room is tried
/// (panic mode: health data may be wrong, an attempt costs less than a
/// certain 503).
fn pick(service: &ServiceRuntime, ctx: &RequestCtx<'_>, tried: &[Arc<Backend>], now: u64) -> Pick {
    let untried = |b: &Backend| !tried.iter().any(|t| std::ptr::eq(&**t, b));
    let available = |b: &Backend| untried(b) && b.stats.is_available(now);
    let ramp = service.settings.health.slow_start_ms;
    let sel = &service.selector;
    if ramp > 0 {
        // A primary held back by its ramp must not hand its turn to a backup.
        let primary_open = sel.primaries().any(|b| b.weight > 0 && available(b) && b.has_room());
        let mut ramped = |b: &Backend| {
            available(b)
                && b.has_room()
                && (!b.backup || !primary_open)
                && fastrand::f64() < b.stats.slow_start_factor(now, ramp)
        };
        if let Some(b) = sel.select(ctx, &mut ramped) {
            return Pick::Backend(b);
        }
    }
    if let Some(b) = sel.select(ctx, &mut |b: &Backend| available(b) && b.has_room()) {
        return Pick::Backend(b);
    }
    if sel.backends().iter().any(|b| b.weight > 0 && available(b) && !b.has_room()) {
        return Pick::Full;
    }
    match sel.select(ctx, &mut |b: &Backend| untried(b) && b.has_room()) {
        Some(b) => Pick::Backend(b),
        None if sel.backends().iter().any(|b| b.weight > 0 && untried(b) && !b.has_room()) => Pick::Full,
        None => Pick::Nothing,
    }
}

/// A request's place in its service's queue.
struct Queue<'a> {
    timeout: Duration,
    deadline: Option<tokio::time::Instant>,
    waiting: Option<Waiting<'a>>,
}

impl Queue<'_> {
    fn new(timeout_ms: u64) -> Self {
        Queue { timeout: Duration::from_millis(timeout_ms), deadline: None, waiting: None }
    }
}

/// Counts a request in `queued` while it waits.
struct Waiting<'a>(&'a ServiceLive);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.queued.fetch_sub(1, Relaxed);
    }
}

/// Picks a backend, waiting in the service's bounded queue while every
/// available backend is at its `max_conns` (HAProxy's maxconn queue).
async fn pick_or_wait<'a>(
    service: &'a ServiceRuntime,
    ctx: &RequestCtx<'_>,
    tried: &[Arc<Backend>],
    queue: &mut Queue<'a>,
) -> Result<Option<Arc<Backend>>, ProxyError> {
    let live = &*service.live;
    loop {
        match pick(service, ctx, tried, clock::now_ms()) {
            Pick::Backend(b) => return Ok(Some(b)),
            Pick::Nothing => return Ok(None),
            Pick::Full => {}
        }
        if queue.waiting.is_none() {
            let max = u64::from(service.settings.queue.max);
            if live.queued.fetch_add(1, Relaxed) >= max {
                live.queued.fetch_sub(1, Relaxed);
                return Err(ProxyError::QueueFull);
            }
            queue.waiting = Some(Waiting(live));
        }
        let deadline = *queue.deadline.get_or_insert_with(|| tokio::time::Instant::now() + queue.timeout);
        // A slot freed between the pick and here left a permit: no lost wake-up.
        if tokio::time::timeout_at(deadline, live.freed.notified()).await.is_err() {
            return Err(ProxyError::QueueTimeout);
        }
    }
}

/// One attempt's hold on a backend: counted in flight until dropped; for a
/// backend with `max_conns`, dropping it also wakes a queued request.
#[derive(Debug)]
pub struct Slot {
    guard: Option<InFlight>,
    live: Option<Arc<ServiceLive>>,
}

impl Slot {
    fn record(&mut self, outcome: Outcome) {
        if let Some(g) = &mut self.guard {
            g.record(outcome);
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        // Free the slot first, so the woken request finds room.
        drop(self.guard.take());
        if let Some(live) = &self.live {
            live.freed.notify_one();
        }
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

fn build_client(t: &Timeouts) -> UpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(Duration::from_millis(t.connect_ms)));
    connector.set_keepalive(Some(Duration::from_secs(60)));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_millis(t.idle_ms))
        .pool_max_idle_per_host(usize::MAX)
        .pool_timer(TokioTimer::new())
        .timer(TokioTimer::new())
        .build(connector)
}

/// The request body, buffered when small so it can be sent more than once.
enum Replay {
    Buffered(Bytes),
    Streaming(Option<Incoming>),
}

impl Replay {
    async fn new(body: Incoming) -> Result<Replay, ProxyError> {
        if body.is_end_stream() {
            return Ok(Replay::Buffered(Bytes::new()));
        }
        match body.size_hint().exact() {
            Some(n) if n <= REPLAY_LIMIT => {
                let collected =
                    Limited::new(body, REPLAY_LIMIT as usize).collect().await.map_err(|_| ProxyError::BadRequest)?;
                Ok(Replay::Buffered(collected.to_bytes()))
            }
            _ => Ok(Replay::Streaming(Some(body))),
        }
    }

    /// The body for one more attempt, if it can be sent again.
    fn take(&mut self) -> Option<UpBody> {
        match self {
            Replay::Buffered(b) => Some(Either::Left(Full::new(b.clone()))),
            Replay::Streaming(b) => b.take().map(Either::Right),
        }
    }
}

fn is_idempotent(m: &Method) -> bool {
    matches!(*m, Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE)
}

fn wants_upgrade<B>(req: &Request<B>) -> bool {
    req.version() == Version::HTTP_11
        && req.headers().contains_key(header::UPGRADE)
        && req
            .headers()
            .get_all(header::CONNECTION)
            .iter()
            .any(|v| v.to_str().is_ok_and(|s| s.split(',').any(|t| t.trim().eq_ignore_ascii_case("upgrade"))))
}

static HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
];

/// Removes hop-by-hop headers, including those named in `Connection`.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|s| s.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .collect();
    for h in HOP_BY_HOP.iter().chain(&named) {
        headers.remove(h);
    }
    headers.remove(header::UPGRADE);
}

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

fn prepare_headers(parts: &mut Parts, peer: &Peer, upgrade: bool) {
    let h = &mut parts.headers;
    let upgrade_value = h.get(header::UPGRADE).cloned();
    strip_hop_by_hop(h);
    if upgrade {
        if let Some(v) = upgrade_value {
            h.insert(header::UPGRADE, v);
            h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        }
    }
    let xff = match h.get(&X_FORWARDED_FOR).and_then(|v| v.to_str().ok()) {
        Some(prev) => HeaderValue::from_str(&format!("{prev}, {}", peer.addr.ip())).ok(),
        None => Some(peer.ip_header.clone()),
    };
    if let Some(v) = xff {
        h.insert(X_FORWARDED_FOR.clone(), v);
    }
    h.insert(X_FORWARDED_PROTO.clone(), HeaderValue::from_static("http"));
    // HTTP/2 carries the host in the URI; HTTP/1.1 backends need the header.
    let original_host = h
        .get(header::HOST)
        .cloned()
        .or_else(|| parts.uri.authority().and_then(|a| HeaderValue::from_str(a.as_str()).ok()));
    if let Some(v) = original_host {
        h.insert(X_FORWARDED_HOST.clone(), v.clone());
        h.insert(header::HOST, v);
    }
}

fn upstream_request(
    parts: &Parts,
    backend: &Backend,
    path_and_query: &PathAndQuery,
    body: UpBody,
) -> Result<Request<UpBody>, ProxyError> {
    let mut uri = http::uri::Parts::default();
    uri.scheme = Some(Scheme::HTTP);
    uri.authority = Some(backend.authority.clone());
    uri.path_and_query = Some(path_and_query.clone());
    let uri = Uri::from_parts(uri).map_err(|_| ProxyError::BadRequest)?;
    let mut req = Request::new(body);
    *req.method_mut() = parts.method.clone();
    *req.uri_mut() = uri;
    *req.version_mut() = Version::HTTP_11;
    *req.headers_mut() = parts.headers.clone();
    Ok(req)
}

/// Joins the client's and the backend's upgraded connections.
fn splice_upgrade(down: hyper::upgrade::OnUpgrade, up: hyper::upgrade::OnUpgrade) {
    tokio::spawn(async move {
        let (Ok(down), Ok(up)) = tokio::join!(down, up) else {
            return;
        };
        let mut down = TokioIo::new(down);
        let mut up = TokioIo::new(up);
        let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
    });
}
