//! Requests that arrive over hyper (HTTP/2 clients, and HTTP/1.1 with
//! `--http1 hyper`) sent over the native upstream connections: the head is
//! written from the request's header map, the body as it is (buffered) or
//! streamed (by its length, else chunked), and the response body is handed
//! to hyper as frames read straight from the upstream connection. No
//! connection task and no channel per request, as on the native path.
//! Upgrades (WebSocket) stay on hyper's client, which hands over the socket.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::request::Parts;
use http_body::{Body as _, Frame, SizeHint};
use http_body_util::BodyExt;
use tidegate_balance::Backend;
use tidegate_h1::{ChunkedDecoder, HeadLimits, ResponseBody, CHUNKED_END};
use tidegate_snapshot::ServiceRuntime;
use tokio::time::Instant;

use super::relay::{write_all, write_piece};
use super::rewrite::{announced_length, field, forwards_response_field, framing_fields, Framing};
use crate::attempts::Exchange;
use crate::error::ErrorKind;
use crate::pick::Slot;
use crate::upbody::ClientBody;
use crate::upstreams::{open_native as open, read_native as read_response};
use tidegate_upstream::h1::{early_answer, NativeAnswer, Upstream};
use tidegate_upstream::pool::{Conn, UpstreamPool};

/// The error of a response body read from a native connection.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body of a bridged request.
pub(crate) enum Payload {
    /// Held in memory (empty, or small enough to replay).
    Buffered(Bytes),
    /// The client's body, streamed; `None` once an attempt took it.
    Streaming(Option<ClientBody>),
}

/// A request carried by hyper, sent over the worker's native connections.
pub(crate) struct BridgeExchange<'a> {
    /// The worker's connections (a service that sends the PROXY protocol
    /// uses the client connection's own).
    pub pool: &'a UpstreamPool<Upstream>,
    /// The client whose request this is.
    pub peer: &'a crate::conn::Peer,
    /// The request with its forwarding headers.
    pub parts: &'a Parts,
    pub path_and_query: &'a str,
    pub body: Payload,
    pub idempotent: bool,
    /// When the last attempt finished streaming the client's body.
    pub body_sent: Option<Instant>,
}

impl Exchange for BridgeExchange<'_> {
    type Answer = NativeAnswer;

    fn request(&self) -> crate::retry::Request {
        crate::retry::Request { idempotent: self.idempotent, replayable: matches!(self.body, Payload::Buffered(_)) }
    }

    fn sendable(&self) -> bool {
        !matches!(self.body, Payload::Streaming(None))
    }

    async fn send(
        &mut self,
        backend: &Arc<Backend>,
        service: &ServiceRuntime,
        fresh: bool,
        deadline: Instant,
    ) -> Result<NativeAnswer, ErrorKind> {
        let (pool, cs) = crate::upstreams::native_pool(self.pool, service, self.peer);
        let mut conn = open(pool, &backend.addr, &service.upstream, cs, fresh).await?;
        let sending = self.write(&mut conn, backend);
        let written = tokio::time::timeout_at(deadline, sending).await.unwrap_or(Err(ErrorKind::ResponseTimeout));
        let limits = HeadLimits { max_bytes: 64 * 1024, max_headers: tidegate_h1::MAX_HEADERS };
        let to_head = self.parts.method == http::Method::HEAD;
        match written {
            Err(ErrorKind::StaleConnection) => {
                // Closed while idle, nothing of the request sent: a new one.
                conn = open(pool, &backend.addr, &service.upstream, cs, true).await?;
                let sending = self.write(&mut conn, backend);
                tokio::time::timeout_at(deadline, sending).await.unwrap_or(Err(ErrorKind::ResponseTimeout))?;
            }
            Err(ErrorKind::UpstreamClosed) => {
                // The backend stopped reading the request: it may have
                // answered early (a 413 to a large upload) and closed.
                let reading = read_response(&mut conn, to_head, limits);
                return match tokio::time::timeout_at(deadline, reading).await {
                    Ok(Ok(())) => Ok(NativeAnswer { conn: early_answer(conn) }),
                    _ => Err(ErrorKind::UpstreamClosed),
                };
            }
            written => written?,
        }
        let reading = read_response(&mut conn, to_head, limits);
        tokio::time::timeout_at(deadline, reading).await.unwrap_or(Err(ErrorKind::ResponseTimeout))?;
        Ok(NativeAnswer { conn })
    }

    fn status(answer: &NativeAnswer) -> u16 {
        answer.status()
    }

    fn orca(answer: &NativeAnswer) -> Option<&[u8]> {
        answer.field(tidegate_balance::orca::ORCA_HEADER)
    }

    fn body_sent(&self) -> Option<Instant> {
        self.body_sent
    }
}

impl BridgeExchange<'_> {
    /// Writes the head and the body. A write that fails on a reused
    /// connection before any body byte left is a stale connection.
    async fn write(&mut self, conn: &mut Conn<Upstream>, backend: &Backend) -> Result<(), ErrorKind> {
        let reused = conn.reused;
        let failed = |_| if reused { ErrorKind::StaleConnection } else { ErrorKind::UpstreamClosed };
        let stream = &mut conn.conn.stream;
        match &mut self.body {
            Payload::Buffered(b) => {
                let head = request_head(self.parts, self.path_and_query, backend, Some(b.len() as u64));
                write_all(stream, &mut [&head, b]).await.map_err(failed)
            }
            Payload::Streaming(slot) => {
                let Some(mut body) = slot.take() else {
                    return Err(ErrorKind::ClientBody);
                };
                let length = body.size_hint().exact();
                let head = request_head(self.parts, self.path_and_query, backend, length);
                if let Err(e) = write_all(stream, &mut [&head]).await {
                    *slot = Some(body); // nothing of it was read
                    return Err(failed(e));
                }
                let chunked = length.is_none();
                // Never more than the length the backend was told: a byte
                // past it would be the start of another request to it.
                let mut left = length;
                while let Some(frame) = body.frame().await {
                    let frame = frame.map_err(|e| e.kind())?;
                    let Ok(data) = frame.into_data() else { continue };
                    if let Some(left) = &mut left {
                        *left = left.checked_sub(data.len() as u64).ok_or(ErrorKind::ClientBody)?;
                    }
                    if !data.is_empty() {
                        write_piece(stream, &data, chunked).await.map_err(|_| ErrorKind::UpstreamClosed)?;
                    }
                }
                if left.is_some_and(|n| n > 0) {
                    return Err(ErrorKind::ClientBody);
                }
                if chunked {
                    write_all(stream, &mut [CHUNKED_END]).await.map_err(|_| ErrorKind::UpstreamClosed)?;
                }
                self.body_sent = Some(Instant::now());
                Ok(())
            }
        }
    }
}

/// The HTTP/1.1 head of a request carried by hyper: its forwarding headers
/// (already rewritten), `Host` (the backend's authority when the request
/// named none), and the framing of `length` (chunked when unknown).
fn request_head(parts: &Parts, path_and_query: &str, backend: &Backend, length: Option<u64>) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(parts.method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(path_and_query.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    if !parts.headers.contains_key(header::HOST) {
        field(&mut out, b"host", backend.authority.as_str().as_bytes());
    }
    for (name, value) in &parts.headers {
        if *name != header::CONTENT_LENGTH && *name != header::TRANSFER_ENCODING {
            field(&mut out, name.as_str().as_bytes(), value.as_bytes());
        }
    }
    framing_fields(
        &mut out,
        match length {
            Some(0) => Framing::None,
            Some(n) => Framing::Length(n),
            None => Framing::Chunked,
        },
    );
    out.extend_from_slice(b"\r\n");
    out
}

/// The backend's answer as a hyper response whose body is read from the
/// upstream connection as hyper polls it.
pub(crate) fn response(answer: NativeAnswer, slot: Slot) -> Result<http::Response<NativeBody>, ErrorKind> {
    let NativeAnswer { mut conn } = answer;
    let head = std::mem::take(&mut conn.conn.head);
    if head.code == 101 {
        return Err(ErrorKind::InvalidResponse); // no upgrade was asked for
    }
    let buf = conn.conn.inbox.split_to(head.len);
    let mut headers = HeaderMap::with_capacity(head.headers.len());
    // hyper frames what it is given: a length goes on only with the body
    // it measures.
    let framing = match head.body {
        ResponseBody::None => Framing::None,
        ResponseBody::Length(n) => Framing::Length(n),
        ResponseBody::Chunked | ResponseBody::UntilClose => Framing::Chunked,
    };
    for h in head.headers.iter().filter(|h| forwards_response_field(&buf, &head, h)) {
        if let (Ok(n), Ok(v)) = (HeaderName::from_bytes(h.name.of(&buf)), HeaderValue::from_bytes(h.value.of(&buf))) {
            headers.append(n, v);
        }
    }
    if let Some(n) = announced_length(&head, framing) {
        headers.insert(http::header::CONTENT_LENGTH, HeaderValue::from(n));
    }
    let status = http::StatusCode::from_u16(head.code).map_err(|_| ErrorKind::InvalidResponse)?;
    let state = match head.body {
        ResponseBody::None | ResponseBody::Length(0) => State::Done,
        ResponseBody::Length(n) => State::Length(n),
        ResponseBody::Chunked => State::Chunked(ChunkedDecoder::default()),
        ResponseBody::UntilClose => State::UntilClose,
    };
    let reusable = !head.close;
    conn.conn.head = head;
    let mut body = NativeBody { conn: Some(conn), slot: Some(slot), state, reusable };
    if matches!(body.state, State::Done) {
        body.finish();
    }
    let mut resp = http::Response::new(body);
    *resp.status_mut() = status;
    *resp.headers_mut() = headers;
    Ok(resp)
}

/// Where a response body stands.
#[derive(Debug)]
enum State {
    Length(u64),
    Chunked(ChunkedDecoder),
    UntilClose,
    Done,
}

/// A backend's response body read from a native upstream connection. The
/// connection goes back to the pool after a clean end; a body that breaks
/// off (or is dropped unread) closes it.
#[derive(Debug)]
pub struct NativeBody {
    conn: Option<Conn<Upstream>>,
    slot: Option<Slot>,
    state: State,
    reusable: bool,
}

impl NativeBody {
    /// The body ended cleanly: the connection may serve another request.
    fn finish(&mut self) {
        if let Some(mut c) = self.conn.take() {
            if self.reusable && c.conn.inbox.is_empty() {
                c.conn.park_and_free();
                c.release();
            }
        }
        self.slot.take(); // after the release, so a woken queued request can reuse it
    }

    fn broken(&mut self, why: &str) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.conn.take();
        self.slot.take();
        Poll::Ready(Some(Err(std::io::Error::other(why.to_string()).into())))
    }
}

impl http_body::Body for NativeBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        loop {
            let Some(conn) = this.conn.as_mut() else {
                return Poll::Ready(None);
            };
            let inbox: &mut BytesMut = &mut conn.conn.inbox;
            match &mut this.state {
                State::Done => {
                    this.finish();
                    return Poll::Ready(None);
                }
                State::Length(left) if !inbox.is_empty() => {
                    let n = usize::try_from(*left).unwrap_or(usize::MAX).min(inbox.len());
                    *left -= n as u64;
                    let data = inbox.split_to(n).freeze();
                    if *left == 0 {
                        this.state = State::Done;
                        this.finish();
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                State::Chunked(decoder) if !inbox.is_empty() => {
                    let Ok(step) = decoder.decode(inbox) else {
                        return this.broken("malformed chunked body from the backend");
                    };
                    let data = step.data.clone().map(|r| {
                        inbox.advance(r.start);
                        let d = inbox.split_to(r.len()).freeze();
                        inbox.advance(step.consumed - r.end);
                        d
                    });
                    if data.is_none() {
                        inbox.advance(step.consumed);
                    }
                    if step.done {
                        this.state = State::Done;
                    }
                    if let Some(d) = data.filter(|d| !d.is_empty()) {
                        return Poll::Ready(Some(Ok(Frame::data(d))));
                    }
                    continue;
                }
                State::UntilClose if !inbox.is_empty() => {
                    let data = inbox.split().freeze();
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                _ => {}
            }
            if inbox.capacity() - inbox.len() < 1024 {
                inbox.reserve(super::relay::READ_CHUNK);
            }
            match tokio_util::io::poll_read_buf(Pin::new(&mut conn.conn.stream), cx, inbox) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(0)) if matches!(this.state, State::UntilClose) => {
                    this.reusable = false;
                    this.state = State::Done;
                }
                Poll::Ready(Ok(0)) => return this.broken("the backend closed before the end of the body"),
                Poll::Ready(Ok(_)) => {}
                Poll::Ready(Err(_)) => return this.broken("reading the backend's body failed"),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.conn.is_none() || matches!(self.state, State::Done | State::Length(0))
    }

    fn size_hint(&self) -> SizeHint {
        match self.state {
            State::Length(n) => SizeHint::with_exact(n),
            State::Done => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}
