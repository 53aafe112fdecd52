//! Forwarding a request that arrived over hyper (HTTP/2, or HTTP/1.1
//! when the native path is off): prepare it once, then hand it to the
//! shared attempt loop ([`attempts::run`]) as a [`HyperExchange`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::request::Parts;
use http::uri::PathAndQuery;
use http::{Request, Response, StatusCode, Uri, Version};
use http_body::Body as _;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;

use tidegate_balance::{clock, orca, Backend, Headers, RequestCtx};
use tidegate_distributor_protocol::{DistributorClient, Query};
use tidegate_model::{ExternalSpec, PolicySpec, UpstreamProtocol};
use tidegate_snapshot::ServiceRuntime;

use crate::admission::{is_streaming_protocol, Admission, BufferBudget, MinRate, Reserved};
use crate::attempts::{self, is_idempotent, Answered, Exchange, Trace};
use crate::body::{ClientBody, Hold, ProxyBody, UpBody};
use crate::error::ClientBodyError;
use crate::error::ErrorKind;
use crate::headers;
use crate::host_addrs::HostAddrs;
use crate::limits::Limits;
use crate::metrics::Counters;
use crate::native::bridge::{self, BridgeExchange, Payload};
use crate::pick::Slot;
use crate::pool::{ConnSettings, HyperConn, Sent, Unsent, UpstreamPool};
use crate::tunnel;
use crate::upstream_h2::{self, H2Pool};

/// What a client connection holds while anything of it lives, a tunnel
/// that outlives its request included: its place under
/// `--max-connections`, and its worker's count of live connections, which
/// a stopping worker waits on (at most the drain timeout).
#[derive(Debug)]
pub struct ConnHold {
    _permit: tokio::sync::OwnedSemaphorePermit,
    _alive: tokio::sync::mpsc::Sender<()>,
}

impl ConnHold {
    /// Holds `permit` and one sender of the worker's `alive` channel.
    pub fn new(permit: tokio::sync::OwnedSemaphorePermit, alive: tokio::sync::mpsc::Sender<()>) -> ConnHold {
        ConnHold { _permit: permit, _alive: alive }
    }
}

/// The client end of a connection, prepared once per connection.
#[derive(Debug, Clone)]
pub struct Peer {
    /// The client's address.
    pub addr: SocketAddr,
    /// Its IP as a header value, for `X-Forwarded-For`.
    pub ip_header: HeaderValue,
    /// Whether it is a trusted proxy, whose forwarding headers are kept.
    pub trusted: bool,
    /// The connection's place under `--max-connections` and in its
    /// worker's count of live connections, shared with an upgraded tunnel
    /// so that the tunnel keeps both.
    pub conn_slot: Option<Arc<ConnHold>>,
    /// Whether the client connected over TLS (`X-Forwarded-Proto: https`).
    pub https: bool,
    /// The port the client connected to, as a header value
    /// (`X-Forwarded-Port`).
    pub port_header: HeaderValue,
}

impl Peer {
    /// Describes a plain-HTTP client connection (untrusted).
    pub fn new(addr: SocketAddr) -> Peer {
        let ip_header =
            HeaderValue::from_str(&addr.ip().to_string()).unwrap_or_else(|_| HeaderValue::from_static("unknown"));
        Peer {
            addr,
            ip_header,
            trusted: false,
            conn_slot: None,
            https: false,
            port_header: HeaderValue::from_static("0"),
        }
    }

    /// Records the listener the client came through: its port, and whether
    /// it terminates TLS.
    pub fn set_listener(&mut self, port: u16, tls: bool) {
        self.https = tls;
        self.port_header = HeaderValue::from(port);
    }

    /// `https` or `http`.
    pub fn scheme(&self) -> &'static str {
        if self.https {
            "https"
        } else {
            "http"
        }
    }
}

/// Request bodies up to this size are buffered so a failed attempt can be
/// replayed on another backend; larger ones stream and are retried only
/// when no byte of them was sent.
pub(crate) const REPLAY_LIMIT: u64 = 64 * 1024;

/// A worker's way to its backends: its connection pool and its
/// external-distributor client.
pub(crate) struct Upstreams {
    pool: UpstreamPool<HyperConn>,
    /// The native HTTP/1 path's connections.
    native: UpstreamPool<crate::native::Upstream>,
    /// Shared connections to HTTP/2 backends.
    h2: H2Pool,
    /// Asks external distributors (paper S4); one per worker.
    distributor: DistributorClient,
    /// What host-named backends resolve to, to match distributors'
    /// `IP:PORT` answers.
    host_addrs: HostAddrs,
    /// Client-side limits (body timeouts).
    limits: Arc<Limits>,
}

impl Upstreams {
    /// The client-side limits.
    pub(crate) fn limits(&self) -> &Limits {
        &self.limits
    }

    /// `counters`: the worker's, where its pools count the connections
    /// they open.
    pub(crate) fn new(limits: Arc<Limits>, counters: &Arc<Counters>) -> Upstreams {
        Upstreams {
            pool: UpstreamPool::new(counters.clone()),
            native: UpstreamPool::new(counters.clone()),
            h2: H2Pool::default(),
            distributor: DistributorClient::default(),
            host_addrs: HostAddrs::default(),
            limits,
        }
    }

    /// The native HTTP/1 path's upstream connections.
    pub(crate) fn native_pool(&self) -> &UpstreamPool<crate::native::Upstream> {
        &self.native
    }
}

/// What every attempt sends, apart from the body: the request with its
/// forwarding headers.
pub(crate) struct Prepared {
    pub parts: Parts,
    pub path_and_query: PathAndQuery,
    pub idempotent: bool,
    /// The client's `TE` asked for trailers (kept for HTTP/2 backends).
    pub te_trailers: bool,
}

impl Prepared {
    /// Reads what the attempts need from the client's request: forwarding
    /// headers, the body (buffered when it is small and complete), and the
    /// client's side of an upgrade (WebSocket), if it asked for one.
    async fn new(
        mut req: Request<Incoming>,
        peer: &Peer,
        limits: &Limits,
        budget: &Arc<BufferBudget>,
    ) -> Result<(Prepared, Replay, Option<Reserved>, Option<hyper::upgrade::OnUpgrade>), ErrorKind> {
        let upgrade = wants_upgrade(&req).then(|| hyper::upgrade::on(&mut req));
        let (mut parts, body) = req.into_parts();
        let streaming = || is_streaming_protocol(parts.headers.get(header::CONTENT_TYPE).map(HeaderValue::as_bytes));
        let (body, reserved) = Replay::new(body, limits, budget, streaming).await?;
        let te_trailers = parts.headers.get(header::TE).is_some_and(|v| upstream_h2::wants_trailers(v.as_bytes()));
        headers::request_headers(&mut parts, peer, upgrade.is_some());
        let path_and_query = parts.uri.path_and_query().cloned().unwrap_or_else(|| PathAndQuery::from_static("/"));
        let idempotent = is_idempotent(parts.method.as_str().as_bytes());
        Ok((Prepared { parts, path_and_query, idempotent, te_trailers }, body, reserved, upgrade))
    }
}

impl Prepared {
    /// What the retry decision needs to know of this request and its body.
    fn retry_request(&self, body: &Replay) -> crate::retry::Request {
        crate::retry::Request { idempotent: self.idempotent, replayable: body.replayable() }
    }
}

impl ConnSettings {
    pub(crate) fn of(service: &ServiceRuntime) -> ConnSettings {
        let settings = &service.settings;
        ConnSettings {
            connect: Duration::from_millis(settings.timeouts.connect_ms),
            idle: Duration::from_millis(settings.timeouts.idle_ms),
            max_idle: settings.upstream.max_idle as usize,
            profile: service.upstream.key(),
        }
    }
}

impl Upstreams {
    /// Forwards `req` to a backend of `service`, trying others on failure.
    pub(crate) async fn forward(
        &self,
        service: &ServiceRuntime,
        req: Request<Incoming>,
        peer: &Peer,
        admission: &Admission,
        trace: &mut Trace,
    ) -> Result<Response<ProxyBody>, ErrorKind> {
        // Read before a backend is chosen: a slow client holds no backend.
        let (req, body, _buffered, mut upgrade) = Prepared::new(req, peer, &self.limits, &admission.buffers).await?;
        // At most the client's cap of requests waiting for a backend or
        // being answered, until the answer's head (reading a body takes no
        // backend).
        let _per_client = admission.request(peer.addr.ip()).map_err(|_| ErrorKind::ClientLimit)?;
        let first = match &service.settings.policy {
            PolicySpec::External(spec) => {
                let host = req.parts.uri.authority().map(|a| a.as_str());
                let asked = Asked { method: req.parts.method.as_str(), path: req.path_and_query.as_str(), host };
                self.ask_distributor(spec, service, asked, &req.parts.headers, peer).await
            }
            _ => None,
        };
        let ctx = RequestCtx::new(Some(peer.addr), req.path_and_query.as_str(), &req.parts.headers);
        if upgrade.is_none() && service.upstream.protocol() == UpstreamProtocol::Http2 {
            let (mut response, slot) = self.send_h2(service, &req, body, &ctx, first, trace).await?;
            headers::response_headers(response.headers_mut());
            return Ok(response.map(|b| ProxyBody::upstream(b, Hold { slot, conn: None })));
        }
        if upgrade.is_none() {
            // Over the worker's native connections (no connection task or
            // channel per request); upgrades stay on hyper's client, which
            // hands the socket over after a 101.
            let body = match body {
                Replay::Buffered(b) => Payload::Buffered(b),
                Replay::Streaming(Some(UpBody::Streaming(b))) => Payload::Streaming(Some(b)),
                Replay::Streaming(_) => Payload::Streaming(None),
            };
            let mut ex = BridgeExchange {
                pool: &self.native,
                parts: &req.parts,
                path_and_query: req.path_and_query.as_str(),
                body,
                idempotent: req.idempotent,
                body_sent: None,
            };
            let Answered { answer, slot } = attempts::run(service, &mut ex, &ctx, first, trace).await?;
            return bridge::response(answer, slot);
        }
        let mut ex = HyperExchange { pool: &self.pool, req: &req, body, upgrade: upgrade.is_some() };
        let Answered { answer: Sent { mut response, conn }, slot } =
            attempts::run(service, &mut ex, &ctx, first, trace).await?;
        let hold = Hold { slot, conn: Some(conn) };
        if response.status() == StatusCode::SWITCHING_PROTOCOLS {
            // Only to a protocol the client offered (never `h2c`); anything
            // else breaks the exchange.
            let asked = req.parts.headers.get(header::UPGRADE).map(HeaderValue::as_bytes);
            let to = response.headers().get(header::UPGRADE).map(HeaderValue::as_bytes);
            let Some(down) = upgrade.take().filter(|_| asked.is_some_and(|a| crate::hygiene::switched_as_asked(a, to)))
            else {
                return Err(ErrorKind::InvalidResponse);
            };
            let up = hyper::upgrade::on(&mut response);
            tunnel::splice_hyper(down, up, hold, peer.conn_slot.clone(), self.limits.tunnel_idle_timeout);
            return Ok(response.map(|_| ProxyBody::empty()));
        }
        headers::response_headers(response.headers_mut());
        Ok(response.map(|b| ProxyBody::upstream(b, hold)))
    }
}

impl Upstreams {
    /// Sends a prepared request to an HTTP/2 backend of `service`, trying
    /// others on failure; the response head and the slot its body holds.
    pub(crate) async fn send_h2(
        &self,
        service: &ServiceRuntime,
        req: &Prepared,
        body: Replay,
        ctx: &RequestCtx<'_>,
        first: Option<Arc<Backend>>,
        trace: &mut Trace,
    ) -> Result<(Response<Incoming>, Slot), ErrorKind> {
        let mut ex = H2Exchange { pool: &self.h2, req, body };
        let Answered { answer, slot } = attempts::run(service, &mut ex, ctx, first, trace).await?;
        Ok((answer, slot))
    }
}

/// A request sent over a worker's shared HTTP/2 connections.
struct H2Exchange<'a> {
    pool: &'a H2Pool,
    req: &'a Prepared,
    body: Replay,
}

impl Exchange for H2Exchange<'_> {
    type Answer = Response<Incoming>;

    fn request(&self) -> crate::retry::Request {
        self.req.retry_request(&self.body)
    }

    fn sendable(&self) -> bool {
        self.body.sendable()
    }

    async fn send(
        &mut self,
        backend: &Arc<Backend>,
        service: &ServiceRuntime,
        fresh: bool,
        deadline: tokio::time::Instant,
    ) -> Result<Response<Incoming>, ErrorKind> {
        let body = self.body.take().ok_or(ErrorKind::ClientBody)?;
        let (req, profile) = (self.req, &service.upstream);
        let up =
            upstream_h2::request(&req.parts, backend, profile.scheme(), &req.path_and_query, req.te_trailers, body)?;
        let sending = self.pool.send(backend, profile, ConnSettings::of(service), up, fresh);
        self.body.settle(tokio::time::timeout_at(deadline, sending).await.unwrap_or(Err(Unsent::TIMED_OUT)))
    }

    fn status(answer: &Response<Incoming>) -> u16 {
        answer.status().as_u16()
    }

    fn orca(answer: &Response<Incoming>) -> Option<&[u8]> {
        answer.headers().get(orca::ORCA_HEADER).map(HeaderValue::as_bytes)
    }
}

/// A request carried by hyper, sent over the worker's hyper connections.
struct HyperExchange<'a> {
    pool: &'a UpstreamPool<HyperConn>,
    req: &'a Prepared,
    body: Replay,
    upgrade: bool,
}

impl Exchange for HyperExchange<'_> {
    type Answer = Sent;

    fn request(&self) -> crate::retry::Request {
        self.req.retry_request(&self.body)
    }

    fn sendable(&self) -> bool {
        self.body.sendable()
    }

    /// Sends the request (on a new connection when `fresh`); takes back a
    /// streamed body no byte of which was sent.
    async fn send(
        &mut self,
        backend: &Arc<Backend>,
        service: &ServiceRuntime,
        fresh: bool,
        deadline: tokio::time::Instant,
    ) -> Result<Sent, ErrorKind> {
        let body = self.body.take().ok_or(ErrorKind::ClientBody)?;
        let up = upstream_request(&self.req.parts, backend, &self.req.path_and_query, body)?;
        let cs = ConnSettings::of(service);
        let sending = self.pool.send(&backend.addr, &service.upstream, cs, up, fresh, self.upgrade);
        self.body.settle(tokio::time::timeout_at(deadline, sending).await.unwrap_or(Err(Unsent::TIMED_OUT)))
    }

    fn status(answer: &Sent) -> u16 {
        answer.response.status().as_u16()
    }

    fn orca(answer: &Sent) -> Option<&[u8]> {
        answer.response.headers().get(orca::ORCA_HEADER).map(HeaderValue::as_bytes)
    }
}

/// What an external distributor is told of a request, apart from its
/// headers.
pub(crate) struct Asked<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub host: Option<&'a str>,
}

impl Upstreams {
    /// The backend an external distributor names for this request, if it
    /// answers with one of the service's available backends with room; on no
    /// answer, a backup backend (the paper's fallback), else `None` (the
    /// local policy decides).
    pub(crate) async fn ask_distributor(
        &self,
        spec: &ExternalSpec,
        service: &ServiceRuntime,
        asked: Asked<'_>,
        headers: &dyn Headers,
        peer: &Peer,
    ) -> Option<Arc<Backend>> {
        let query = Query {
            policy: &spec.policy,
            client: peer.addr,
            method: asked.method,
            path: asked.path,
            host: asked.host,
            headers,
        };
        let timeout = Duration::from_millis(spec.timeout_ms);
        let answer = self.distributor.query(spec.addr, &query, timeout, spec.tries).await;
        let now = clock::now_ms();
        let usable = |b: &Backend| b.stats.is_available(now) && b.has_room();
        let backends = service.selector.backends();
        match answer {
            Some(addr) => {
                let found = backends
                    .iter()
                    .find(|b| b.socket_addr == Some(addr))
                    .or_else(|| self.host_addrs.backend_at(backends, addr));
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
pub(crate) enum Replay {
    /// Held in memory: every attempt sends it whole.
    Buffered(Bytes),
    /// Streamed; `None` once an attempt took it.
    Streaming(Option<UpBody>),
}

impl Replay {
    /// Reads what may be read of the body before a backend is chosen (see
    /// [`crate::admission`]): a small body, or one up to the buffer size
    /// within the budget, whole (then it can be replayed); the start of a
    /// larger one; nothing of a stream (`streaming`: gRPC). Returns the
    /// body and the part of the budget it holds.
    async fn new(
        body: Incoming,
        limits: &Limits,
        budget: &Arc<BufferBudget>,
        streaming: impl FnOnce() -> bool,
    ) -> Result<(Replay, Option<Reserved>), ErrorKind> {
        if body.is_end_stream() {
            return Ok((Replay::Buffered(Bytes::new()), None));
        }
        let mut body = ClientBody::new(body, limits.body_read_timeout, limits.body_total_timeout);
        let exact = body.size_hint().exact();
        if let Some(n) = exact.filter(|n| *n <= REPLAY_LIMIT) {
            // Small bodies are always read whole, outside the budget.
            return match Limited::new(body, n as usize).collect().await {
                Ok(collected) => Ok((Replay::Buffered(collected.to_bytes()), None)),
                Err(e) => Err(e.downcast_ref::<ClientBodyError>().map_or(ErrorKind::ClientBody, ClientBodyError::kind)),
            };
        }
        let rate = MinRate::of(limits);
        let bound = limits.request_buffer_bytes;
        let stream =
            |body: ClientBody, read: Vec<Bytes>| Replay::Streaming(Some(UpBody::Streaming(body.streamed(read, rate))));
        let ahead = exact.map_or(bound, |n| usize::try_from(n).unwrap_or(usize::MAX).min(bound));
        let reserved = match budget.reserve(ahead) {
            Some(r) if bound > 0 && !streaming() => r,
            _ => return Ok((stream(body, Vec::new()), None)),
        };
        let (mut read, mut len) = (Vec::new(), 0usize);
        while len < bound {
            match body.frame().await {
                None => return Ok((Replay::Buffered(concat(read, len)), Some(reserved))),
                Some(Err(e)) => return Err(e.kind()),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        len += data.len();
                        read.push(data);
                    }
                }
            }
        }
        if body.is_end_stream() {
            return Ok((Replay::Buffered(concat(read, len)), Some(reserved)));
        }
        Ok((stream(body, read), Some(reserved)))
    }

    /// Whether every attempt can send the whole body.
    fn replayable(&self) -> bool {
        matches!(self, Replay::Buffered(_))
    }

    /// Whether there is a body to send (a streamed one not yet taken).
    fn sendable(&self) -> bool {
        !matches!(self, Replay::Streaming(None))
    }

    /// The body for one more attempt, if it can be sent again.
    fn take(&mut self) -> Option<UpBody> {
        match self {
            Replay::Buffered(b) => Some(UpBody::Buffered(Full::new(b.clone()))),
            Replay::Streaming(b) => b.take(),
        }
    }

    /// An attempt's outcome, with a streamed body that no byte of was sent
    /// taken back for the next attempt.
    fn settle<T>(&mut self, sent: Result<T, Unsent>) -> Result<T, ErrorKind> {
        sent.map_err(|unsent| {
            if let (Replay::Streaming(slot), Some(r)) = (&mut *self, unsent.request) {
                *slot = Some(r.into_body());
            }
            unsent.kind
        })
    }
}

/// The pieces of a body read whole, as one.
fn concat(pieces: Vec<Bytes>, len: usize) -> Bytes {
    if pieces.len() == 1 {
        return pieces.into_iter().next().unwrap_or_default();
    }
    let mut whole = bytes::BytesMut::with_capacity(len);
    for p in pieces {
        whole.extend_from_slice(&p);
    }
    whole.freeze()
}

/// Whether the client asks for a protocol upgrade the proxy passes on
/// (WebSocket and the like). `h2c` is never passed on: the proxy speaks
/// HTTP/2 to clients itself, and a backend must not switch protocols under
/// it.
fn wants_upgrade<B>(req: &Request<B>) -> bool {
    req.version() == Version::HTTP_11
        && req.headers().get(header::UPGRADE).is_some_and(|v| crate::hygiene::upgrade_allowed(v.as_bytes()))
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
