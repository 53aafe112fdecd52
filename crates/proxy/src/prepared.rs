//! A request of hyper's engines (or the native engine's HTTP/2 backends)
//! prepared once for its attempts: the head with its forwarding headers,
//! and the body, buffered when small so that it can be replayed.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::request::Parts;
use http::uri::PathAndQuery;
use http::{Request, Response, Version};
use http_body::Body as _;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use tidegate_balance::{orca, Backend, RequestCtx};
use tidegate_snapshot::ServiceRuntime;

use crate::admission::{is_streaming_protocol, BufferBudget, MinRate, Reserved};
use crate::attempts::{self, is_idempotent, Answered, Exchange, Trace};
use crate::conn::{Peer, REPLAY_LIMIT};
use crate::error::ErrorKind;
use crate::headers;
use crate::hyper_conn::Unsent;
use crate::limits::Limits;
use crate::pick::Slot;
use crate::upbody::{ClientBody, Inbound, UpBody};
use crate::upstream_error::ClientBodyError;
use crate::upstream_h2::{self, H2Pool};

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
    /// `max_body`: the most body bytes the route's rules take.
    pub(crate) async fn new(
        mut req: Request<Inbound>,
        peer: &Peer,
        limits: &Limits,
        budget: &Arc<BufferBudget>,
        max_body: Option<u64>,
    ) -> Result<(Prepared, Replay, Option<Reserved>, Option<hyper::upgrade::OnUpgrade>), ErrorKind> {
        let upgrade = wants_upgrade(&req).then(|| hyper::upgrade::on(&mut req));
        let (mut parts, body) = req.into_parts();
        let streaming = || is_streaming_protocol(parts.headers.get(header::CONTENT_TYPE).map(HeaderValue::as_bytes));
        let (body, reserved) = Replay::new(body, limits, budget, streaming, max_body).await?;
        let te_trailers = parts.headers.get(header::TE).is_some_and(|v| upstream_h2::wants_trailers(v.as_bytes()));
        headers::request_headers(&mut parts, peer, upgrade.is_some());
        let path_and_query = parts.uri.path_and_query().cloned().unwrap_or_else(|| PathAndQuery::from_static("/"));
        let idempotent = is_idempotent(parts.method.as_str().as_bytes());
        Ok((Prepared { parts, path_and_query, idempotent, te_trailers }, body, reserved, upgrade))
    }
}

impl Prepared {
    /// What the retry decision needs to know of this request and its body.
    pub(crate) fn retry_request(&self, body: &Replay) -> crate::retry::Request {
        crate::retry::Request { idempotent: self.idempotent, replayable: body.replayable() }
    }
}

/// A request sent over a worker's shared HTTP/2 connections.
pub(crate) struct H2Exchange<'a> {
    pub(crate) pool: &'a H2Pool,
    pub(crate) req: &'a Prepared,
    pub(crate) body: Replay,
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
        let cs = crate::upstreams::conn_settings(service);
        let sending = async {
            let sent = self.pool.send(&backend.addr, profile, cs, up, fresh).await;
            sent.map_err(|u| Unsent { kind: upstream_h2::h2_kind(&u.error), request: u.request })
        };
        self.body.settle(tokio::time::timeout_at(deadline, sending).await.unwrap_or(Err(Unsent::TIMED_OUT)))
    }

    fn status(answer: &Response<Incoming>) -> u16 {
        answer.status().as_u16()
    }

    fn orca(answer: &Response<Incoming>) -> Option<&[u8]> {
        answer.headers().get(orca::ORCA_HEADER).map(HeaderValue::as_bytes)
    }
}

/// Sends a prepared request to an HTTP/2 backend of `service`, trying
/// others on failure; the response head and the slot its body holds.
pub(crate) async fn send_h2(
    h2: &H2Pool,
    service: &ServiceRuntime,
    req: &Prepared,
    body: Replay,
    ctx: &RequestCtx<'_>,
    first: Option<Arc<Backend>>,
    trace: &mut Trace,
) -> Result<(Response<Incoming>, Slot), ErrorKind> {
    let mut ex = H2Exchange { pool: h2, req, body };
    let Answered { answer, slot } = attempts::run(service, &mut ex, ctx, first, trace).await?;
    Ok((answer, slot))
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
    pub(crate) async fn new(
        body: Inbound,
        limits: &Limits,
        budget: &Arc<BufferBudget>,
        streaming: impl FnOnce() -> bool,
        max_body: Option<u64>,
    ) -> Result<(Replay, Option<Reserved>), ErrorKind> {
        if body.is_end_stream() {
            return Ok((Replay::Buffered(Bytes::new()), None));
        }
        let mut body = ClientBody::new(body, limits.body_read_timeout, limits.body_total_timeout).limited(max_body);
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
    pub(crate) fn replayable(&self) -> bool {
        matches!(self, Replay::Buffered(_))
    }

    /// Whether there is a body to send (a streamed one not yet taken).
    pub(crate) fn sendable(&self) -> bool {
        !matches!(self, Replay::Streaming(None))
    }

    /// The body for one more attempt, if it can be sent again.
    pub(crate) fn take(&mut self) -> Option<UpBody> {
        match self {
            Replay::Buffered(b) => Some(UpBody::Buffered(Full::new(b.clone()))),
            Replay::Streaming(b) => b.take(),
        }
    }

    /// An attempt's outcome, with a streamed body that no byte of was sent
    /// taken back for the next attempt.
    pub(crate) fn settle<T>(&mut self, sent: Result<T, Unsent>) -> Result<T, ErrorKind> {
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
pub(crate) fn wants_upgrade<B>(req: &Request<B>) -> bool {
    req.version() == Version::HTTP_11
        && req.headers().get(header::UPGRADE).is_some_and(|v| crate::hygiene::upgrade_allowed(v.as_bytes()))
        && req
            .headers()
            .get_all(header::CONNECTION)
            .iter()
            .any(|v| v.to_str().is_ok_and(|s| s.split(',').any(|t| t.trim().eq_ignore_ascii_case("upgrade"))))
}
