//! Forwarding a request that arrived over hyper (HTTP/2, or HTTP/1.1
//! when the native path is off): prepare it once, then hand it to the
//! shared attempt loop ([`attempts::run`]) as a [`HyperExchange`].

use std::sync::Arc;

use http::header::{self, HeaderValue};
use http::request::Parts;
use http::uri::PathAndQuery;
use http::{Request, Response, StatusCode, Uri, Version};
use tidegate_balance::{orca, Backend, RequestCtx};
use tidegate_model::UpstreamProtocol;
use tidegate_snapshot::ServiceRuntime;

use crate::admission::Admission;
use crate::attempts::{self, Answered, Exchange, Trace};
use crate::body::{Hold, ProxyBody};
use crate::conn::Peer;
use crate::error::ErrorKind;
use crate::headers;
use crate::hyper_conn::{HyperConn, HyperPool, Sent, Unsent};
use crate::native::bridge::{self, BridgeExchange, Payload};
use crate::prepared::{Prepared, Replay};
use crate::tunnel;
use crate::upbody::{Inbound, UpBody};
use crate::upstreams::{Asked, Upstreams};
use tidegate_upstream::pool::UpstreamPool;

impl Upstreams {
    /// Forwards `req` to a backend of `service`, trying others on failure.
    pub(crate) async fn forward(
        &self,
        service: &ServiceRuntime,
        req: Request<Inbound>,
        peer: &Peer,
        admission: &Admission,
        trace: &mut Trace,
        edits: Option<&tidegate_rules::Forward>,
    ) -> Result<Response<ProxyBody>, ErrorKind> {
        // Read before a backend is chosen: a slow client holds no backend.
        let (mut req, body, _buffered, mut upgrade) =
            Prepared::new(req, peer, &self.limits, &admission.buffers, edits.and_then(|e| e.max_body)).await?;
        if let Some(edits) = edits {
            // The route's rules: the path sent upstream, and header edits
            // after the proxy's own forwarding fields.
            if edits.changes_path() {
                let asked = crate::pipeline::Asked::of(&req.path_and_query);
                let target = crate::pipeline::upstream_target(Some(edits), asked);
                req.path_and_query = PathAndQuery::try_from(target.as_ref()).map_err(|_| ErrorKind::InvalidPath)?;
            }
            for edit in edits.request_edits() {
                edit.apply(&mut req.parts.headers);
            }
        }
        // At most the client's cap of requests waiting for a backend or
        // being answered, until the answer's head (reading a body takes no
        // backend).
        let _per_client = admission.admit_request(peer.addr.ip()).await?;
        let host = req.parts.uri.authority().map(|a| a.as_str());
        let asked = Asked { method: req.parts.method.as_str(), path: req.path_and_query.as_str(), host };
        let first = self.first_pick(service, asked, &req.parts.headers, peer).await;
        let ctx = RequestCtx::new(Some(peer.addr), req.path_and_query.as_str(), &req.parts.headers);
        if upgrade.is_none() && service.upstream.protocol() == UpstreamProtocol::Http2 {
            let (mut response, slot) =
                crate::prepared::send_h2(&self.h2, service, &req, body, &ctx, first, trace).await?;
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
                peer,
                parts: &req.parts,
                path_and_query: req.path_and_query.as_str(),
                body,
                idempotent: req.idempotent,
                body_sent: None,
            };
            let Answered { answer, slot } = attempts::run(service, &mut ex, &ctx, first, trace).await?;
            return bridge::response(answer, slot).map(|resp| resp.map(ProxyBody::Native));
        }
        let mut ex = HyperExchange { pool: &self.pool, peer, req: &req, body, upgrade: upgrade.is_some() };
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

/// A request carried by hyper, sent over the worker's hyper connections.
struct HyperExchange<'a> {
    pool: &'a UpstreamPool<HyperConn>,
    peer: &'a Peer,
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
        let cs = crate::upstreams::client_settings(service, self.peer);
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
