//! One request sent to backends over the native path's own upstream
//! connections: the [`Exchange`] the shared attempt loop drives.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tidegate_balance::Backend;
use tidegate_h1::{HeadLimits, RequestBody};
use tidegate_snapshot::ServiceRuntime;
use tidegate_upstream::Stream;
use tokio::time::Instant;

use super::relay::{self, write_all, RelayError, Source};
use super::rewrite::{request_head, Forwarding, Framing};
use super::{ClientIo, ClientSide};
use crate::admission::{BufferBudget, MinRate, Pace, Reserved};
use crate::attempts::Exchange;
use crate::conn::REPLAY_LIMIT;
use crate::error::ErrorKind;
use crate::limits::Limits;
use crate::upstreams::{open_native as open, read_native as read_response};
use tidegate_upstream::h1::{early_answer, NativeAnswer, Upstream};
use tidegate_upstream::pool::{Conn, UpstreamPool};

/// The request body, as attempts can send it.
pub(crate) enum Body {
    /// Held in memory (empty, or small enough to replay).
    Buffered(Bytes),
    /// Still in the client connection, not read yet.
    Streaming(RequestBody),
    /// Streamed to a backend by an earlier attempt: gone.
    Sent,
}

/// A request as the native path sends it.
pub(crate) struct NativeExchange<'a, S> {
    /// The worker's connections (a service that sends the PROXY protocol
    /// uses the client connection's own).
    pub pool: &'a UpstreamPool<Upstream>,
    pub client: &'a mut ClientSide<S>,
    /// The request head the client sent, and its parse.
    pub buf: &'a [u8],
    pub head: &'a tidegate_h1::RequestHead,
    /// The normalized path and the query, as written upstream.
    pub target: &'a str,
    pub forwarding: Forwarding<'a>,
    pub body: Body,
    pub idempotent: bool,
    pub to_head: bool,
    pub limits: HeadLimits,
    pub body_gap: Duration,
    pub body_until: tokio::time::Instant,
    /// The minimum pace of a body streamed to a backend, if any.
    pub min_rate: Option<MinRate>,
    /// When the last attempt finished sending a streamed body.
    pub body_sent: Option<Instant>,
    /// The most body bytes the route's rules take (`max_body_bytes`).
    pub max_body: Option<u64>,
}

impl<S: ClientIo> Exchange for NativeExchange<'_, S> {
    type Answer = NativeAnswer;

    fn request(&self) -> crate::retry::Request {
        crate::retry::Request { idempotent: self.idempotent, replayable: matches!(self.body, Body::Buffered(_)) }
    }

    fn sendable(&self) -> bool {
        !matches!(self.body, Body::Sent)
    }

    async fn send(
        &mut self,
        backend: &Arc<Backend>,
        service: &ServiceRuntime,
        fresh: bool,
        deadline: Instant,
    ) -> Result<NativeAnswer, ErrorKind> {
        let (pool, cs) = crate::upstreams::native_pool(self.pool, service, self.forwarding.peer);
        let fresh = fresh || self.forwarding.upgrade.is_some();
        let mut conn = open(pool, &backend.addr, &service.upstream, cs, fresh).await?;
        let host = (!self.forwarding.named_host).then_some(backend.authority.as_str());
        match self.write_head(&mut conn, host, deadline).await {
            // The backend closed the pooled connection while it was idle
            // and none of the request reached it: send it on a new one.
            Err(ErrorKind::StaleConnection) if self.sendable() => {
                conn = open(pool, &backend.addr, &service.upstream, cs, true).await?;
                self.write_head(&mut conn, host, deadline).await?;
            }
            // The backend stopped reading the request: it may have
            // answered early (a 413 to a large upload) and closed. Its
            // answer, if one came, is what the client gets.
            Err(ErrorKind::UpstreamClosed) => {
                let reading = read_response(&mut conn, self.to_head, self.limits);
                return match self.client.timer.run(deadline, reading).await {
                    Some(Ok(())) => {
                        // The rest of the body is unread: the client
                        // connection closes after this answer.
                        self.client.body_done = false;
                        Ok(NativeAnswer { conn: early_answer(conn) })
                    }
                    _ => Err(ErrorKind::UpstreamClosed),
                };
            }
            written => written?,
        }
        let reading = read_response(&mut conn, self.to_head, self.limits);
        match self.client.timer.run(deadline, reading).await {
            Some(read) => read?,
            None => return Err(ErrorKind::ResponseTimeout),
        }
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

impl<S: ClientIo> NativeExchange<'_, S> {
    /// Writes the request head and its body to `conn`. `host`: the host to
    /// send when the client named none (the backend's authority).
    async fn write_head(
        &mut self,
        conn: &mut Conn<Upstream>,
        host: Option<&str>,
        deadline: Instant,
    ) -> Result<(), ErrorKind> {
        let mut out = std::mem::take(&mut self.client.scratch);
        let mut forwarding = self.forwarding;
        if let Some(h) = host {
            forwarding.host = h;
        }
        request_head(&mut out, self.buf, self.head, self.target, &forwarding);
        let reused = conn.reused;
        let upstream_failed = |_| if reused { ErrorKind::StaleConnection } else { ErrorKind::UpstreamClosed };
        let stream = &mut conn.conn.stream;
        let written = match std::mem::replace(&mut self.body, Body::Sent) {
            Body::Buffered(b) => {
                let r = match self.client.timer.run(deadline, write_all(stream, &mut [&out, &b])).await {
                    Some(written) => written.map_err(upstream_failed),
                    None => Err(ErrorKind::ResponseTimeout),
                };
                self.body = Body::Buffered(b);
                r
            }
            Body::Streaming(framing) => match write_all(stream, &mut [&out]).await {
                // The body leaves the client connection now: it cannot be
                // sent again. Like the head, it must be sent within the
                // response timeout (the client's own pace is bounded by the
                // body timeouts).
                Ok(()) => tokio::time::timeout_at(deadline, self.stream_body(stream, framing))
                    .await
                    .unwrap_or(Err(ErrorKind::ResponseTimeout)),
                Err(e) => {
                    self.body = Body::Streaming(framing);
                    Err(upstream_failed(e))
                }
            },
            Body::Sent => Err(ErrorKind::ClientBody),
        };
        self.client.scratch = out;
        written
    }

    /// Streams the client's body to the backend under the client body
    /// timeouts and the minimum pace, chunked as it came or by its length.
    async fn stream_body(&mut self, up: &mut Stream, framing: RequestBody) -> Result<(), ErrorKind> {
        let client = &mut *self.client;
        let mut src = Source {
            stream: &mut client.io,
            inbox: &mut client.inbox,
            timer: &mut client.timer,
            gap: self.body_gap,
            until: Some(self.body_until),
            pace: self.min_rate.map(Pace::new),
            read_max: relay::READ_CHUNK,
        };
        let relayed = match framing {
            RequestBody::Empty => Ok(()),
            RequestBody::Length(n) => relay::relay_length(&mut src, up, n).await,
            RequestBody::Chunked => relay::relay_chunked(&mut src, up, true, self.max_body).await,
        };
        client.body_done = relayed.is_ok();
        if relayed.is_ok() {
            self.body_sent = Some(Instant::now());
        }
        relayed.map_err(|e| match e {
            RelayError::Timeout | RelayError::TooSlow(_) => ErrorKind::ClientTimeout,
            RelayError::Eof | RelayError::Read(_) | RelayError::Malformed => ErrorKind::ClientBody,
            RelayError::TooLarge => ErrorKind::BodyTooLarge,
            RelayError::Write(_) => ErrorKind::UpstreamClosed,
        })
    }
}

/// Reads what may be read of a request body before a backend is chosen
/// (see [`crate::admission`]): a body up to the buffer size whole (then it
/// can be replayed), the start of a larger one (left in the inbox for the
/// relay), nothing of a stream (`streaming`: gRPC) or when the budget is
/// spent. Returns the body and the part of the budget it holds.
pub(crate) async fn read_ahead<S: ClientIo>(
    client: &mut ClientSide<S>,
    declared: RequestBody,
    streaming: impl FnOnce() -> bool,
    limits: &Limits,
    budget: &Arc<BufferBudget>,
    until: Instant,
    max_body: Option<u64>,
) -> Result<(Body, Option<Reserved>), ErrorKind> {
    let bound = limits.request_buffer_bytes;
    let mut src = Source {
        stream: &mut client.io,
        inbox: &mut client.inbox,
        timer: &mut client.timer,
        gap: limits.body_read_timeout,
        until: Some(until),
        pace: None,
        read_max: relay::READ_CHUNK,
    };
    let failed = |e: RelayError| match e {
        RelayError::Timeout | RelayError::TooSlow(_) => ErrorKind::ClientTimeout,
        RelayError::TooLarge => ErrorKind::BodyTooLarge,
        _ => ErrorKind::ClientBody,
    };
    let (body, reserved) = match declared {
        RequestBody::Empty => (Body::Buffered(Bytes::new()), None),
        // Small bodies are always read whole, outside the budget.
        RequestBody::Length(n) if n <= REPLAY_LIMIT => (Body::Buffered(buffer_body(&mut src, n).await?), None),
        _ if bound == 0 || streaming() => (Body::Streaming(declared), None),
        RequestBody::Length(n) => {
            let whole = n <= bound as u64;
            let ahead = if whole { n as usize } else { bound };
            match budget.reserve(ahead) {
                None => (Body::Streaming(declared), None),
                Some(r) if whole => (Body::Buffered(buffer_body(&mut src, n).await?), Some(r)),
                Some(r) => {
                    src.fill_to(ahead).await.map_err(failed)?;
                    (Body::Streaming(declared), Some(r))
                }
            }
        }
        RequestBody::Chunked => match budget.reserve(bound) {
            None => (Body::Streaming(declared), None),
            Some(r) => {
                if src.read_ahead_chunked(bound).await.map_err(failed)? {
                    // Complete: decoded into memory, sent with its length.
                    let mut whole = Vec::new();
                    relay::relay_chunked(&mut src, &mut whole, false, max_body).await.map_err(failed)?;
                    (Body::Buffered(whole.into()), Some(r))
                } else {
                    (Body::Streaming(declared), Some(r))
                }
            }
        },
    };
    client.body_done = matches!(body, Body::Buffered(_));
    Ok((body, reserved))
}

/// Reads a small request body whole, so that it can be replayed.
pub(crate) async fn buffer_body(
    src: &mut Source<'_, impl tokio::io::AsyncRead + Unpin>,
    n: u64,
) -> Result<Bytes, ErrorKind> {
    let n = usize::try_from(n).map_err(|_| ErrorKind::ClientBody)?;
    src.read_exact(n).await.map_err(|e| match e {
        RelayError::Timeout | RelayError::TooSlow(_) => ErrorKind::ClientTimeout,
        _ => ErrorKind::ClientBody,
    })
}

/// The framing of a request body towards a backend.
pub(crate) fn upstream_framing(body: &Body, declared: RequestBody) -> Framing {
    match (body, declared) {
        (Body::Buffered(b), _) if b.is_empty() => Framing::None,
        (Body::Buffered(b), _) => Framing::Length(b.len() as u64),
        (_, RequestBody::Length(n)) => Framing::Length(n),
        (_, RequestBody::Chunked) => Framing::Chunked,
        (_, RequestBody::Empty) => Framing::None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use tidegate_model::BackendAddr;
    use tidegate_upstream::h1::NativeConn;
    use tidegate_upstream::pool::ConnSettings;
    use tokio::io::AsyncWriteExt;

    /// A connection waiting for its answer holds no read buffer; it takes
    /// one when the answer arrives.
    #[tokio::test]
    async fn a_connection_waiting_for_its_answer_holds_no_buffer() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = BackendAddr::new(&l.local_addr().unwrap().to_string()).unwrap();
        let (tcp, accepted) = tokio::join!(tokio::net::TcpStream::connect(l.local_addr().unwrap()), l.accept());
        let (mut backend, _) = accepted.unwrap();
        let pool = UpstreamPool::<Upstream>::new(Arc::<crate::metrics::Counters>::default());
        let settings = ConnSettings {
            connect: Duration::from_secs(1),
            idle: Duration::from_secs(60),
            max_idle: 8,
            profile: 0,
            origin: None,
        };
        let mut conn = pool.fresh(NativeConn::new(Stream::Plain(tcp.unwrap())), &addr, settings);
        let limits = HeadLimits { max_bytes: 8192, max_headers: 100 };
        {
            let mut reading = std::pin::pin!(read_response(&mut conn, false, limits));
            let waker = std::task::Waker::noop();
            let pending = reading.as_mut().poll(&mut std::task::Context::from_waker(waker)).is_pending();
            assert!(pending, "no answer yet");
        }
        assert_eq!(conn.conn.inbox.capacity(), 0, "no buffer while waiting");
        backend.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await.unwrap();
        read_response(&mut conn, false, limits).await.unwrap();
        assert_eq!(conn.conn.head.code, 200);
        assert!(conn.conn.inbox.capacity() > 0);
    }
}
