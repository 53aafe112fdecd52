//! A request read by the native HTTP/1 path, sent to an HTTP/2 backend.
//!
//! The head becomes an `http::Request` with the same forwarding headers
//! the hyper path sets (one function writes both). A small body is
//! buffered (replayable); a larger one streams through a channel that
//! this task feeds from the client connection while the backend reads it,
//! so a body of any size passes with bounded memory. The response is
//! written back as HTTP/1.1 (trailers, which HTTP/1 clients rarely take,
//! are dropped).

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::uri::PathAndQuery;
use tidegate_balance::{Backend, Headers, RequestCtx};
use tidegate_h1::RequestBody;
use tidegate_snapshot::ServiceRuntime;
use tokio::io::AsyncWrite;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::PollSender;

use super::exchange::Body;
use super::relay::{self, RelayError, Source};
use super::{ClientIo, ClientSide, Ctx, Routed};
use crate::attempts::is_idempotent;
use crate::body::{Hold, ProxyBody};
use crate::error::ErrorKind;
use crate::headers;
use crate::prepared::{Prepared, Replay};
use crate::upbody::ChannelBody;
use crate::upbody::UpBody;
use crate::upstream_error::ClientBodyError;
use crate::upstream_h2::wants_trailers;

/// Sends a routed request to an HTTP/2 backend of `service` and writes its
/// answer; `Ok(keep)` once a response was sent.
pub(super) async fn forward<S: ClientIo>(
    client: &mut ClientSide<S>,
    ctx: &Ctx<'_>,
    req: &Routed<'_>,
    service: &ServiceRuntime,
    body: Body,
    first: Option<Arc<Backend>>,
    body_until: Instant,
) -> Result<bool, ErrorKind> {
    let prepared = prepare(ctx, req)?;
    let (replay, feed) = match body {
        Body::Buffered(b) => (Replay::Buffered(b), None),
        Body::Streaming(framing) => {
            let length = match framing {
                RequestBody::Length(n) => Some(n),
                _ => None,
            };
            let (tx, channel) = ChannelBody::new(length);
            (Replay::Streaming(Some(UpBody::Channel(channel))), Some((tx, framing)))
        }
        Body::Sent => return Err(ErrorKind::ClientBody),
    };
    let picking = RequestCtx::new(Some(ctx.peer.addr), req.path_and_query, req.view);
    let upstreams = ctx.proxy.upstreams();
    let mut trace = client.seen.attempts_trace();
    let sending = crate::prepared::send_h2(&upstreams.h2, service, &prepared, replay, &picking, first, &mut trace);
    let answered = match feed {
        None => sending.await,
        Some((tx, framing)) => {
            let gap = ctx.limits.body_read_timeout;
            let (answered, done) = {
                let pace = crate::admission::MinRate::of(ctx.limits).map(crate::admission::Pace::new);
                let max_body = req.edits.and_then(|e| e.max_body);
                let pumping = pump(client, tx, framing, gap, body_until, pace, max_body);
                tokio::pin!(sending, pumping);
                let mut pumped = None;
                let answered = loop {
                    tokio::select! {
                        answered = &mut sending => break answered,
                        done = &mut pumping, if pumped.is_none() => pumped = Some(done),
                    }
                };
                // The backend answered; the rest of the body still goes to
                // it (it ends early if the backend stops reading).
                let done = match pumped {
                    Some(done) => done,
                    None if answered.is_ok() => pumping.await,
                    None => false,
                };
                (answered, done)
            };
            client.body_done = done;
            answered
        }
    };
    client.seen.traced(trace);
    let (mut response, slot) = answered?;
    headers::response_headers(response.headers_mut());
    if let Some(edits) = req.edits {
        edits.apply_response_headers(response.headers_mut());
    }
    let mut resp = response.map(|b| ProxyBody::upstream(b, Hold { slot, conn: None }));
    if let Some(edits) = req.edits {
        let to_head = *req.method == http::Method::HEAD;
        resp = crate::compress::response(resp, &edits.response, req.view.first("accept-encoding"), to_head);
    }
    let close = ctx.closes(client);
    Ok(ctx.answer(client, resp, close).await)
}

/// The request as hyper's HTTP/2 client takes it, with the forwarding
/// headers.
fn prepare(ctx: &Ctx<'_>, req: &Routed<'_>) -> Result<Prepared, ErrorKind> {
    let path_and_query = PathAndQuery::try_from(req.path_and_query).map_err(|_| ErrorKind::InvalidPath)?;
    let mut builder = http::Request::builder().method(req.method.clone()).uri(path_and_query.clone());
    let headers = builder.headers_mut().ok_or(ErrorKind::BadRequest)?;
    req.view.each(&mut |name, value| {
        if let (Ok(n), Ok(v)) = (header::HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_bytes(value)) {
            headers.append(n, v);
        }
    });
    if let Some(host) = req.host {
        // The authority of an absolute-form target wins over `Host`.
        headers.insert(header::HOST, HeaderValue::from_str(host).map_err(|_| ErrorKind::InvalidHost)?);
    }
    // The id chosen for this request (the log records the same), in place
    // of whatever the client sent.
    headers.insert(&headers::X_REQUEST_ID, HeaderValue::from_bytes(req.request_id).map_err(|_| ErrorKind::BadRequest)?);
    if let Some(t) = &req.trace {
        t.set(headers);
    }
    let te_trailers = req.view.any("te", &mut |v| wants_trailers(v));
    let (mut parts, ()) = builder.body(()).map_err(|_| ErrorKind::BadRequest)?.into_parts();
    headers::request_headers(&mut parts, ctx.peer, false);
    if let Some(edits) = req.edits {
        for edit in edits.request_edits() {
            edit.apply(&mut parts.headers);
        }
    }
    let idempotent = is_idempotent(req.method.as_str().as_bytes());
    Ok(Prepared { parts, path_and_query, idempotent, te_trailers })
}

/// Feeds the client's body into the channel the backend reads, under the
/// client body timeouts; says whether the body was read whole. A body the
/// client breaks off ends the backend's body with an error.
async fn pump<S: ClientIo>(
    client: &mut ClientSide<S>,
    tx: mpsc::Sender<Result<Bytes, ClientBodyError>>,
    framing: RequestBody,
    gap: std::time::Duration,
    until: Instant,
    pace: Option<crate::admission::Pace>,
    max_body: Option<u64>,
) -> bool {
    let (stream, inbox, timer) = (&mut client.io, &mut client.inbox, &mut client.timer);
    let mut src = Source { stream, inbox, timer, gap, until: Some(until), pace, read_max: relay::READ_CHUNK };
    let mut sink = ChannelWriter(PollSender::new(tx.clone()));
    let relayed = match framing {
        RequestBody::Empty => Ok(()),
        RequestBody::Length(n) => relay::relay_length(&mut src, &mut sink, n).await,
        RequestBody::Chunked => relay::relay_chunked(&mut src, &mut sink, false, max_body).await,
    };
    match relayed {
        Ok(()) => true,
        Err(e) => {
            let error = match e {
                RelayError::Timeout | RelayError::TooSlow(_) => Some(ClientBodyError::TimedOut),
                RelayError::Eof | RelayError::Read(_) | RelayError::Malformed => Some(ClientBodyError::Broken),
                RelayError::TooLarge => Some(ClientBodyError::TooLarge),
                // The backend stopped reading: nothing to tell it.
                RelayError::Write(_) => None,
            };
            if let Some(error) = error {
                let _ = tx.send(Err(error)).await;
            }
            false
        }
    }
}

/// The channel's sending side as a byte sink, so the native path's body
/// relays (by length, or de-chunked) can write into it.
struct ChannelWriter(PollSender<Result<Bytes, ClientBodyError>>);

impl AsyncWrite for ChannelWriter {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let closed = || io::Error::from(io::ErrorKind::BrokenPipe);
        ready!(self.0.poll_reserve(cx)).map_err(|_| closed())?;
        self.0.send_item(Ok(Bytes::copy_from_slice(buf))).map_err(|_| closed())?;
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.0.close();
        Poll::Ready(Ok(()))
    }
}
