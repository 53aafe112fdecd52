//! The native HTTP/1.1 path: Tidegate's own client and upstream
//! connections on the [`tidegate_h1`] codec, in place of hyper's.
//!
//! One task per client connection does everything for its requests: reads
//! the head into the connection's inbox, routes, sends it to a backend
//! over the worker's own upstream connections, and relays the response,
//! with no channel or task between the two sides. What it saves over hyper
//! is the per-request machinery (a dispatch task per connection on both
//! sides, header maps, body channels) and the memory of idle connections:
//! an idle client connection holds no read buffer at all, an idle upstream
//! connection none either.
//!
//! The rules are the hyper path's, decided by the same code where they
//! are the same: request hygiene ([`crate::hygiene`], [`crate::normalize`]),
//! the attempt loop ([`crate::attempts`]), static files, errors and limits.
//! HTTP/2 (prior knowledge, `PRI * HTTP/2.0`) is handed to hyper with the
//! bytes already read.

pub(crate) mod bridge;
mod exchange;
mod h2;
mod relay;
mod rewrite;
mod timer;

use std::borrow::Cow;
use std::sync::Arc;

use bytes::{Buf, BytesMut};
use http::{Method, Response, StatusCode};
use http_body_util::BodyExt;
use tidegate_balance::{Headers, RequestCtx};
use tidegate_h1::{parse_request, HeadError, HeadLimits, Header, HeaderKind, RequestBody, RequestHead};
use tidegate_model::UpstreamProtocol;
use tidegate_snapshot::ServiceRuntime;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::access_log::Line;
use crate::attempts::{self, is_idempotent, Answered};
use crate::body::ProxyBody;
use crate::compress;
use crate::conn::Peer;
use crate::error::{ErrorKind, Source as FailureSource};
use crate::handler::Proxy;
use crate::hygiene;
use crate::limits::{Limits, TimedIo};
use crate::normalize::normalize;
use crate::observe::Seen;
use crate::pick::Slot;
use crate::pipeline::{self, Action, Facts, Local};
use crate::reply::local_response;
use crate::rules_work;
use crate::traces::{Said, Traced};
use crate::upstreams::Asked;

use exchange::{read_ahead, upstream_framing, NativeExchange};
use relay::{fill, write_all, RelayError, Source};
pub(crate) use rewrite::Upstream;
use rewrite::{local_head, response_head, Forwarding, Framing};
use tidegate_upstream::h1::{NativeAnswer, NativeConn};
use timer::Timer;

/// The HTTP/2 connection preface (RFC 9113, section 3.4).
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// A client connection the native path can serve: plain TCP, or TLS.
pub(crate) trait ClientIo: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static {
    /// Waits until reading would find something, so that an idle
    /// connection needs no read buffer while it waits. Streams that cannot
    /// tell (TLS may hold decrypted bytes) answer at once.
    fn readable(&self) -> impl std::future::Future<Output = std::io::Result<()>> + Send;

    /// Makes the connection's close a reset (`SO_LINGER` 0), for a response
    /// delimited by the close that was cut short: a clean close would tell
    /// the client it is complete.
    fn reset_on_close(&self);
}

impl ClientIo for TcpStream {
    /// In the socket's read waker slot, as `tidegate_upstream::Stream::readable`
    /// waits: the connection's one task both waits and reads, so the
    /// waiters' list of `TcpStream::readable` (two locks a request) buys
    /// nothing.
    fn readable(&self) -> impl std::future::Future<Output = std::io::Result<()>> + Send {
        std::future::poll_fn(move |cx| self.poll_read_ready(cx))
    }

    fn reset_on_close(&self) {
        let _ = self.set_zero_linger();
    }
}

impl ClientIo for tokio_rustls::server::TlsStream<TcpStream> {
    fn readable(&self) -> impl std::future::Future<Output = std::io::Result<()>> + Send {
        std::future::ready(Ok(()))
    }

    fn reset_on_close(&self) {
        let _ = self.get_ref().0.set_zero_linger();
    }
}

/// The client side of a connection, as the native path holds it.
pub(crate) struct ClientSide<S> {
    /// The socket; writes are bounded by the write timeout.
    pub io: TimedIo<S>,
    /// Bytes read and not used yet. Empty and unallocated while idle.
    pub inbox: BytesMut,
    /// The connection's one timer.
    pub timer: Timer,
    /// Room to build heads in.
    pub scratch: Vec<u8>,
    /// Whether the current request's body has been read whole (a
    /// connection is reused only then).
    pub body_done: bool,
    /// What was seen of the current request.
    pub seen: Seen,
    /// A response delimited by the close was cut short: the connection
    /// ends with a reset, not with a clean close the client would take for
    /// the end of the body.
    pub cut_short: bool,
    /// A line added to every response head (`Alt-Svc` on a TLS listener
    /// when HTTP/3 is on).
    pub extra: Option<Arc<Vec<u8>>>,
}

impl<S: ClientIo> ClientSide<S> {
    /// The answer delimited by the close was cut short: the connection will
    /// end with a reset, so the client cannot take the close for the end of
    /// the body.
    fn end_with_reset(&mut self) {
        self.io.get_ref().reset_on_close();
        self.cut_short = true;
    }
}

impl<S> ClientSide<S> {
    /// Records the status the client gets: in the request's record and in
    /// `tidegate_responses_total`.
    fn answered(&mut self, status: StatusCode, proxy: &Proxy) {
        proxy.metrics().response(status);
        self.seen.status = status.as_u16();
    }
}

/// What reading the next request head found.
enum Next {
    Request,
    Closed,
    /// The worker stops while the connection waits for its next request.
    Stopped,
    Http2,
    Refused(HeadError),
}

/// How long a kept-alive connection waiting for its next request may
/// still bring one once the worker stops (a drain, a hand-over): a
/// request already on its way is answered (with `Connection: close`)
/// instead of crossing the server's close, which a client may not resend
/// (a `POST`). Bounded by the idle timeout.
const STOP_LINGER: std::time::Duration = std::time::Duration::from_secs(1);

/// Serves one client connection until it closes, it stays idle too long,
/// or the worker stops. Hands it to hyper if it speaks HTTP/2.
pub(crate) async fn serve<S: ClientIo>(
    stream: S,
    peer: Peer,
    proxy: Arc<Proxy>,
    stop: watch::Receiver<bool>,
    limits: Limits,
    hyper: crate::hyper_server::HyperServer,
) {
    let accepted = Instant::now();
    let mut client = ClientSide {
        io: TimedIo::new(stream, limits.write_timeout),
        inbox: BytesMut::new(),
        timer: Timer::new(),
        scratch: Vec::new(),
        body_done: true,
        seen: Seen::new(accepted),
        cut_short: false,
        extra: proxy.alt_svc_line(&peer),
    };
    let head_limits = HeadLimits { max_bytes: limits.max_header_bytes, max_headers: limits.max_headers };
    // Bytes of the connection used by requests before the current one.
    let (mut consumed, mut sent) = (0u64, 0u64);
    let mut head = RequestHead::default();
    let mut served = 0u64;
    // When the last request ended: one clock read for its metrics and the
    // idle deadline of the next.
    let mut ended = accepted;
    // One wait for the worker's stop, registered once for the connection.
    let mut stop_wait = stop.clone();
    // Fused: after it fired, the connection's last wait for a request
    // (`STOP_LINGER`) polls it again, and it stays pending.
    let mut stopped = std::pin::pin!(futures_util::FutureExt::fuse(async move {
        let _ = stop_wait.changed().await;
    }));
    loop {
        let deadline = match served {
            0 => accepted + limits.first_request_timeout,
            _ => ended + limits.idle_timeout,
        };
        let mut next = next_head(&mut client, &mut head, served == 0, deadline, head_limits, stopped.as_mut()).await;
        if let Next::Stopped = next {
            let linger = deadline.min(Instant::now() + STOP_LINGER);
            next = next_head(&mut client, &mut head, false, linger, head_limits, stopped.as_mut()).await;
        }
        match next {
            Next::Request => {}
            Next::Closed | Next::Stopped => return,
            Next::Http2 => {
                let read = client.inbox.split().freeze();
                let io = crate::hyper_server::Prefixed::new(read, client.io);
                // Boxed: rare, and large; not part of every connection's task.
                in_box(|| hyper.serve(io, peer, proxy, stop, limits)).await;
                return;
            }
            Next::Refused(e) => {
                client.seen = Seen::new(Instant::now());
                refuse(&mut client, e, &proxy).await;
                proxy.finish(&mut client.seen, Instant::now(), |seen, ended| {
                    let mut line = seen.line(peer.addr, "HTTP/1.1", ended);
                    line.method = "-".into();
                    line.client_cert = crate::observe::client_cert_subject(&peer);
                    line.bytes_in = client.io.bytes_read() - consumed;
                    line.bytes_out = client.io.bytes_written() - sent;
                    line
                });
                return;
            }
        }
        served += 1;
        client.seen = Seen::new(Instant::now());
        let buf = tidegate_upstream::buffers::take_head(&mut client.inbox, head.len);
        if let Some(tracing) = proxy.tracing() {
            client.seen.trace = Some(trace_of(tracing, &head, &buf, &peer));
        }
        let stopping = *stop.borrow();
        // Boxed: the state of a request in progress (a few KiB) lives only
        // while the request does, not in every idle connection's task.
        let ctx = Ctx { head: &head, buf: &buf, peer: &peer, proxy: &proxy, limits: &limits, stopping };
        let keep = in_box(|| handle(&mut client, &ctx)).await;
        ended = Instant::now();
        // This request's bytes: those used since the previous one ended
        // (less what is already read of the next).
        let used = client.io.bytes_read() - client.inbox.len() as u64;
        let (bytes_in, bytes_out) = (used - consumed, client.io.bytes_written() - sent);
        (consumed, sent) = (used, client.io.bytes_written());
        proxy.finish(&mut client.seen, ended, |seen, ended| {
            log_line(seen, ended, &head, &buf, &peer, (bytes_in, bytes_out))
        });
        // The response is written: a concurrency limit's places go now,
        // not when the connection's next request comes.
        client.seen.held.clear();
        drop(buf);
        if !keep {
            let unread = !client.body_done;
            end(&mut client, unread).await;
            return;
        }
        if client.inbox.is_empty() {
            tidegate_upstream::buffers::give_back(std::mem::take(&mut client.inbox));
        }
        if client.scratch.capacity() > 4 * 1024 {
            client.scratch = Vec::new();
        }
    }
}

/// The future `make` returns, built in a box of its own.
///
/// `Box::pin(f)` builds the future on the stack and then copies all of it
/// into the box: 3.6 KiB for a request's state, most of it space for
/// states not yet reached. Allocating first lets the compiler build the
/// future where it will live (checked in the release build's code: the
/// copy is gone), so a request starts by writing a few words.
#[inline(always)]
fn in_box<F>(make: impl FnOnce() -> F) -> std::pin::Pin<Box<F>> {
    Box::into_pin(Box::write(Box::new_uninit(), make()))
}

/// Reads until a request head is complete in the inbox (and parsed into
/// `head`), the connection ends, or the deadline passes.
async fn next_head<S: ClientIo>(
    client: &mut ClientSide<S>,
    head: &mut RequestHead,
    first: bool,
    deadline: Instant,
    limits: HeadLimits,
    mut stopped: std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
) -> Next {
    loop {
        if !client.inbox.is_empty() {
            let seen = &client.inbox[..];
            if first && PREFACE.starts_with(&seen[..seen.len().min(PREFACE.len())]) {
                if seen.len() >= PREFACE.len() {
                    return Next::Http2;
                }
            } else {
                match parse_request(seen, limits, head) {
                    Ok(Some(())) => return Next::Request,
                    Ok(None) => {}
                    Err(e) => return Next::Refused(e),
                }
            }
        }
        let io = &mut client.io;
        let inbox = &mut client.inbox;
        let read = async {
            tokio::select! {
                r = async {
                    // No buffer until there is something to read.
                    if inbox.capacity() == 0 {
                        ClientIo::readable(io.get_ref()).await?;
                    }
                    fill(io, inbox).await
                } => Some(r),
                // A connection that has not sent its first request yet
                // was accepted just before the stop, its request on the
                // way (a hand-over to a new process stops this one while
                // clients keep connecting): it is served, bounded by the
                // first request's timeout, rather than reset.
                () = stopped.as_mut(), if !first => None,
            }
        };
        match client.timer.run(deadline, read).await {
            Some(None) => return Next::Stopped,
            Some(Some(Ok(n))) if n > 0 => {}
            // Timed out, closed or failed.
            _ => return Next::Closed,
        }
    }
}

/// The trace of a request whose head is `head` (tracing is on).
fn trace_of(tracing: &crate::Tracing, head: &RequestHead, buf: &[u8], peer: &Peer) -> Box<Traced> {
    let named = |name: &'static str| {
        head.headers
            .iter()
            .filter(move |h| h.kind == HeaderKind::Other && h.name.of(buf).eq_ignore_ascii_case(name.as_bytes()))
            .map(move |h| h.value.of(buf))
    };
    Traced::start(tracing, named("traceparent"), || {
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        let target = head.target.of(buf);
        let path = target.split(|b| *b == b'?').next().unwrap_or(target);
        let states: Vec<&[u8]> = named("tracestate").collect();
        Said {
            method: text(head.method.of(buf)),
            path: text(path),
            host: head.host.map(|h| text(h.of(buf))),
            scheme: peer.scheme(),
            protocol: "1.1",
            client: peer.addr,
            request_id: client_request_id(head, buf).map(text),
            trace_state: (!states.is_empty()).then(|| text(&states.join(&b","[..]))),
        }
    })
}

/// The access-log line of a request served on this connection that `ended`.
fn log_line(
    seen: &Seen,
    ended: Instant,
    head: &RequestHead,
    buf: &[u8],
    peer: &Peer,
    (bytes_in, bytes_out): (u64, u64),
) -> Line {
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let view = HeadView { buf, headers: &head.headers };
    let mut line = seen.line(peer.addr, if head.minor == 0 { "HTTP/1.0" } else { "HTTP/1.1" }, ended);
    line.method = text(head.method.of(buf));
    line.target = text(head.target.of(buf));
    line.host = head.host.map(|h| text(h.of(buf))).unwrap_or_default();
    line.bytes_in = bytes_in;
    line.bytes_out = bytes_out;
    line.user_agent = view.first("user-agent").map(text);
    line.referer = view.first("referer").map(text);
    line.client_cert = crate::observe::client_cert_subject(peer);
    // The client's id when it was kept; else the generated one (already
    // in the line, from `Seen::fill`), if the request was forwarded.
    if let Some(id) = client_request_id(head, buf) {
        line.request_id = Some(text(id));
    }
    line
}

/// The client's `X-Request-Id`, when it is kept
/// ([`crate::headers::client_request_id`]).
fn client_request_id<'a>(head: &RequestHead, buf: &'a [u8]) -> Option<&'a [u8]> {
    let values = head.headers.iter().filter(|h| h.kind == HeaderKind::XRequestId).map(|h| h.value.of(buf));
    crate::headers::client_request_id(values)
}

/// Answers a request head that cannot be served, and closes.
async fn refuse<S: ClientIo>(client: &mut ClientSide<S>, e: HeadError, proxy: &Proxy) {
    let resp = match e {
        HeadError::Framing(cause) => error_response(ErrorKind::InvalidFraming(cause), proxy),
        HeadError::DuplicateHost => error_response(ErrorKind::InvalidHost, proxy),
        HeadError::TooLarge | HeadError::TooManyHeaders => crate::reply::head_too_large(),
        HeadError::UnsupportedCoding => {
            crate::reply::plain(StatusCode::NOT_IMPLEMENTED, "501 only the chunked transfer coding is supported\n")
        }
        HeadError::Version => {
            crate::reply::plain(StatusCode::HTTP_VERSION_NOT_SUPPORTED, "505 only HTTP/1.0 and HTTP/1.1 here\n")
        }
        HeadError::Syntax(_) => crate::reply::plain(StatusCode::BAD_REQUEST, "400 the request is malformed\n"),
    };
    client.answered(resp.status(), proxy);
    write_local(client, resp, true, false, 1).await;
    // Whatever followed the refused head is unread.
    end(client, true).await;
}

/// How long a connection closed with part of a request unread keeps
/// reading (and discarding) it, at most [`LINGER_BYTES`] ([`end`]).
const LINGER: std::time::Duration = std::time::Duration::from_secs(2);
const LINGER_BYTES: usize = 1024 * 1024;

/// Ends a connection after its last answer. An answer cut short ends
/// with the reset [`ClientSide::end_with_reset`] set up; any other with
/// our FIN (`shutdown`), and, when part of a request is `unread`, by
/// reading what the client still sends until it closes too, for a little
/// while: closing a socket with unread bytes sends a reset, and a reset
/// can make the client's stack drop the answer before the client read it
/// (nginx's `lingering_close`).
async fn end<S: ClientIo>(client: &mut ClientSide<S>, unread: bool) {
    use tokio::io::AsyncReadExt;
    if client.cut_short {
        return;
    }
    let _ = client.io.shutdown().await;
    if !unread {
        return;
    }
    let io = &mut client.io;
    let drain = async {
        // On the heap: this future is part of every connection's task.
        let (mut buf, mut total) = (vec![0u8; 4096], 0);
        while total < LINGER_BYTES {
            match io.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => total += n,
            }
        }
    };
    client.timer.run(Instant::now() + LINGER, drain).await;
}

/// The proxy's answer for `kind`, counted.
fn error_response(kind: ErrorKind, proxy: &Proxy) -> Response<ProxyBody> {
    proxy.metrics().error(kind);
    crate::reply::error(kind)
}

/// What serving one request reads, besides its client connection.
struct Ctx<'a> {
    /// The parsed head, as spans of `buf`.
    head: &'a RequestHead,
    buf: &'a [u8],
    peer: &'a Peer,
    proxy: &'a Proxy,
    limits: &'a Limits,
    /// The worker is stopping: this is the connection's last request.
    stopping: bool,
}

impl Ctx<'_> {
    /// Whether the connection closes after this request's answer: the
    /// client asked, the worker stops, or the body was not read whole.
    fn closes<S>(&self, client: &ClientSide<S>) -> bool {
        self.head.close || self.stopping || !client.body_done
    }

    /// Writes a response the proxy made and says whether the connection
    /// may carry another request.
    async fn answer<S: ClientIo>(&self, client: &mut ClientSide<S>, resp: Response<ProxyBody>, close: bool) -> bool {
        client.answered(resp.status(), self.proxy);
        let is_head = self.head.method.of(self.buf) == b"HEAD";
        write_local(client, resp, close, is_head, self.head.minor).await
    }
}

/// Serves one request; returns whether the connection may carry another.
async fn handle<S: ClientIo>(client: &mut ClientSide<S>, ctx: &Ctx<'_>) -> bool {
    client.body_done = ctx.head.body == RequestBody::Empty;
    match dispatch(client, ctx).await {
        Ok(keep) => keep && !ctx.closes(client),
        Err(kind) => {
            client.seen.error = Some(kind);
            let resp = error_response(kind, ctx.proxy);
            // A client's error closes the connection (what follows may not
            // be framed as it seems), except its cap or rate: it may ask again.
            let close = ctx.closes(client) || (kind.source() == FailureSource::Client && !kind.client_over_its_share());
            ctx.answer(client, resp, close).await
        }
    }
}

/// A request's target, split: the authority of an absolute-form target,
/// the path, and the path with its query.
struct Target<'a> {
    authority: Option<&'a str>,
    path: &'a str,
    query: Option<&'a str>,
}

/// Splits a request target. One with a `#` is refused: a fragment is not
/// part of a request target (RFC 9112, section 3.2), and a proxy that
/// routed on the path before it while the backend read past it (or the
/// reverse) would let `/public/a#/../../internal` reach `/internal`.
fn split_target(target: &str) -> Result<Target<'_>, ErrorKind> {
    let (authority, rest) = if target.starts_with('/') {
        (None, target)
    } else {
        if target.contains('#') {
            return Err(ErrorKind::InvalidPath);
        }
        let after_scheme = ["http://", "https://"]
            .iter()
            .find_map(|s| target.get(..s.len()).filter(|p| p.eq_ignore_ascii_case(s)).map(|_| &target[s.len()..]))
            // `*` (OPTIONS) and authority-form (CONNECT) name no path.
            .ok_or(ErrorKind::InvalidPath)?;
        let end = after_scheme.find(['/', '?']).unwrap_or(after_scheme.len());
        let authority = &after_scheme[..end];
        if http::uri::Authority::try_from(authority).is_err() {
            return Err(ErrorKind::InvalidHost);
        }
        (Some(authority), &after_scheme[end..])
    };
    // One pass for the query's `?` and a fragment's `#` (anywhere).
    let bytes = rest.as_bytes();
    let (path, query) = match memchr::memchr2(b'?', b'#', bytes) {
        None => (rest, None),
        Some(at) if bytes[at] == b'?' && memchr::memchr(b'#', &bytes[at + 1..]).is_none() => {
            (&rest[..at], Some(&rest[at + 1..]))
        }
        Some(_) => return Err(ErrorKind::InvalidPath),
    };
    Ok(Target { authority, path: if path.is_empty() { "/" } else { path }, query })
}

/// A parsed head's fields, read as routing and balancing read headers.
struct HeadView<'a> {
    buf: &'a [u8],
    headers: &'a [Header],
}

impl Headers for HeadView<'_> {
    fn first(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|h| h.name.of(self.buf).eq_ignore_ascii_case(name.as_bytes()))
            .map(|h| h.value.of(self.buf))
    }

    fn any(&self, name: &str, f: &mut dyn FnMut(&[u8]) -> bool) -> bool {
        self.headers
            .iter()
            .filter(|h| h.name.of(self.buf).eq_ignore_ascii_case(name.as_bytes()))
            .any(|h| f(h.value.of(self.buf)))
    }

    fn each(&self, f: &mut dyn FnMut(&str, &[u8])) {
        for h in self.headers {
            if let Ok(name) = std::str::from_utf8(h.name.of(self.buf)) {
                f(name, h.value.of(self.buf));
            }
        }
    }
}

/// What this engine reads of a request's target and `Host`.
struct Parsed<'a> {
    /// The host the request names ([`hygiene::effective_host`]).
    host: Option<&'a str>,
    /// The normalized path.
    path: Cow<'a, str>,
    /// What the backend receives: the normalized path and the query.
    path_and_query: Cow<'a, str>,
    /// The query, without `?`.
    query: Option<&'a str>,
}

impl Parsed<'_> {
    /// The target, as the pipeline reads it.
    fn asked(&self) -> pipeline::Asked<'_> {
        pipeline::Asked { path: &self.path, query: self.query, path_and_query: &self.path_and_query }
    }
}

/// Reads a request's target and host, and checks them.
fn parse_target<'a>(head: &RequestHead, buf: &'a [u8]) -> Result<Parsed<'a>, ErrorKind> {
    let raw_target = std::str::from_utf8(head.target.of(buf)).map_err(|_| ErrorKind::BadRequest)?;
    let target = split_target(raw_target)?;
    let host = hygiene::effective_host(target.authority, head.host.map(|h| h.of(buf)), head.minor == 1)?;
    let path = normalize(target.path).map_err(|_| ErrorKind::InvalidPath)?;
    let path_and_query: Cow<'_, str> = match (&path, target.query) {
        (Cow::Borrowed(_), None) => Cow::Borrowed(target.path),
        (Cow::Borrowed(_), Some(_)) if target.authority.is_none() => Cow::Borrowed(raw_target),
        (p, Some(q)) => Cow::Owned(format!("{p}?{q}")),
        (p, None) => Cow::Owned(p.to_string()),
    };
    Ok(Parsed { host, path, path_and_query, query: target.query })
}

/// Decides what to do with a request ([`crate::pipeline`]) and does it;
/// `Ok(keep)` once a response was sent.
async fn dispatch<S: ClientIo>(client: &mut ClientSide<S>, ctx: &Ctx<'_>) -> Result<bool, ErrorKind> {
    let (head, buf, proxy) = (ctx.head, ctx.buf, ctx.proxy);
    let method = Method::from_bytes(head.method.of(buf)).map_err(|_| ErrorKind::BadRequest)?;
    // Refused or not, the pipeline decides (it refuses `CONNECT` before
    // reading the target, which names no path then).
    let parsed = parse_target(head, buf);
    let view = HeadView { buf, headers: &head.headers };
    let facts = parsed.as_ref().map_err(|kind| Local::Error(*kind)).map(|p| Facts {
        host: hygiene::routing_host(p.host.unwrap_or("")),
        target: p.asked(),
        received: client.seen.start.into_std(),
        headers: &view,
        tls: ctx.peer.https,
        stopping: ctx.stopping,
        peer: ctx.peer.addr.ip(),
        client_cert: ctx.peer.client_cert.as_deref(),
        listener: ctx.peer.listener.as_deref(),
        content_length: match head.body {
            RequestBody::Length(n) => Some(n),
            _ => None,
        },
    });
    let snapshot = proxy.snapshot();
    let decision = pipeline::decide(&method, facts.as_ref().map_err(Clone::clone), proxy.settings(), &snapshot);
    let route = decision.route;
    if let Some(route) = route {
        client.seen.routed(route, proxy.access_log().is_some());
    }
    let logging = proxy.access_log().is_some();
    let rules = match (&decision.action, facts.as_ref()) {
        (Action::Local(_), _) | (_, Err(_)) => None,
        (_, Ok(facts)) => {
            let settled = rules_work::settle(decision.rules, facts, &method, proxy.settings()).await;
            match settled {
                Ok(mut edits) => {
                    if let Some(edits) = edits.as_deref_mut() {
                        let chain = route.filter(|_| logging).and_then(|r| r.attached.as_ref());
                        client.seen.rules_changed(edits, chain.map(|c| &**c));
                    }
                    edits
                }
                Err(answer) => return answer_locally(client, ctx, answer).await,
            }
        }
    };
    match decision.action {
        Action::Local(answer) => answer_locally(client, ctx, answer).await,
        Action::Static { dir, prefix } => {
            // (The pipeline serves and forwards only requests with facts.)
            let parsed = parsed.as_ref().map_err(|kind| *kind)?;
            let target = pipeline::upstream_target(rules.as_deref(), parsed.asked());
            let req = static_request(&method, &target, &view)?;
            let mut resp = tidegate_static::serve(dir, prefix, &req).await.map(ProxyBody::Static);
            if let Some(edits) = &rules {
                edits.apply_response_headers(resp.headers_mut());
                let to_head = method == Method::HEAD;
                resp = compress::response(resp, &edits.response, view.first("accept-encoding"), to_head);
            }
            Ok(ctx.answer(client, resp, ctx.closes(client)).await)
        }
        Action::Forward(service) => {
            let parsed = parsed.as_ref().map_err(|kind| *kind)?;
            drop(facts);
            drop(snapshot);
            // One id for the backend and the access log.
            let generated;
            let request_id = match client_request_id(head, buf) {
                Some(id) => id,
                None => {
                    generated = crate::headers::new_request_id();
                    client.seen.request_id = Some(generated);
                    &generated[..]
                }
            };
            let path_and_query = &pipeline::upstream_target(rules.as_deref(), parsed.asked());
            let edits = rules.as_deref();
            let trace = client
                .seen
                .trace
                .as_ref()
                .map(|t| Upstream { traceparent: t.header, tracestate: t.ctx.keeps_tracestate() });
            let req =
                Routed { view: &view, method: &method, host: parsed.host, path_and_query, request_id, edits, trace };
            forward(client, ctx, req, &service).await
        }
    }
}

/// Writes the pipeline's (or a rule's) own answer.
async fn answer_locally<S: ClientIo>(
    client: &mut ClientSide<S>,
    ctx: &Ctx<'_>,
    answer: Local,
) -> Result<bool, ErrorKind> {
    client.seen.rule_answered(&answer, ctx.proxy.access_log().is_some());
    let close = answer == Local::ConnectRefused || ctx.closes(client);
    let resp = local_response(answer)?;
    Ok(ctx.answer(client, resp, close).await)
}

/// What forwarding needs of a routed request.
struct Routed<'a> {
    view: &'a HeadView<'a>,
    method: &'a Method,
    host: Option<&'a str>,
    path_and_query: &'a str,
    /// The `X-Request-Id` the backend gets (and the access log records).
    request_id: &'a [u8],
    /// What the route's rules change (the path is already in
    /// `path_and_query`).
    edits: Option<&'a tidegate_rules::Forward>,
    /// The trace context the backend gets, when tracing is on.
    trace: Option<Upstream>,
}

/// An `http::Request` for the static file server.
fn static_request(method: &Method, path_and_query: &str, view: &HeadView<'_>) -> Result<http::Request<()>, ErrorKind> {
    let mut req = http::Request::new(());
    *req.method_mut() = method.clone();
    *req.uri_mut() = http::Uri::try_from(path_and_query).map_err(|_| ErrorKind::InvalidPath)?;
    let headers = req.headers_mut();
    view.each(&mut |name, value| {
        if let (Ok(n), Ok(v)) = (http::HeaderName::from_bytes(name.as_bytes()), http::HeaderValue::from_bytes(value)) {
            headers.append(n, v);
        }
    });
    Ok(req)
}

/// The `Upgrade` value of an upgrade the client asks for and the proxy
/// passes on (never `h2c`: the proxy speaks HTTP/2 to clients itself).
fn wants_upgrade<'a>(head: &RequestHead, buf: &'a [u8]) -> Option<&'a [u8]> {
    if head.minor != 1 || !head.connection.upgrade {
        return None;
    }
    let value = head.headers.iter().find(|h| h.kind == HeaderKind::Upgrade)?.value.of(buf);
    hygiene::upgrade_allowed(value).then_some(value)
}

/// Sends a routed request to a backend of `service` and relays the answer.
async fn forward<S: ClientIo>(
    client: &mut ClientSide<S>,
    ctx: &Ctx<'_>,
    req: Routed<'_>,
    service: &ServiceRuntime,
) -> Result<bool, ErrorKind> {
    let (head, peer, proxy, limits, stopping) = (ctx.head, ctx.peer, ctx.proxy, ctx.limits, ctx.stopping);
    let upgrade = wants_upgrade(head, ctx.buf);
    if head.expect_continue && head.body != RequestBody::Empty {
        client.io.write_all(b"HTTP/1.1 100 Continue\r\n\r\n").await.map_err(|_| ErrorKind::ClientBody)?;
    }
    // The body's time counts from the request's head.
    let body_until = client.seen.start + limits.body_total_timeout;
    // Read before a backend is chosen: a slow client holds no backend.
    let streaming = || crate::admission::is_streaming_protocol(req.view.first("content-type"));
    let budget = &proxy.admission().buffers;
    let max_body = req.edits.and_then(|e| e.max_body);
    let (body, buffered) = read_ahead(client, head.body, streaming, limits, budget, body_until, max_body).await?;
    // At most the client's cap of requests waiting for a backend or being
    // answered, until the answer's head (reading a body takes no backend).
    let per_client = proxy.admission().admit_request(peer.addr.ip()).await?;
    let asked = Asked { method: req.method.as_str(), path: req.path_and_query, host: req.host };
    let first = proxy.upstreams().first_pick(service, asked, req.view, peer).await;
    if upgrade.is_none() && service.upstream.protocol() == UpstreamProtocol::Http2 {
        // Boxed: its state (hyper's client, the body channel) is large, and
        // inline it would make every request's state as large.
        return in_box(|| h2::forward(client, ctx, &req, service, body, first, body_until)).await;
    }
    let forwarding = Forwarding {
        request_id: req.request_id,
        trace: req.trace.as_ref(),
        host: req.host.unwrap_or(""),
        named_host: req.host.is_some(),
        peer,
        upgrade,
        body: upstream_framing(&body, head.body),
        edits: req.edits,
    };
    let picking = RequestCtx::new(Some(peer.addr), req.path_and_query, req.view);
    let to_head = *req.method == Method::HEAD;
    let mut trace = client.seen.attempts_trace();
    let mut ex = NativeExchange {
        pool: proxy.upstreams().native_pool(),
        client: &mut *client,
        buf: ctx.buf,
        head,
        target: req.path_and_query,
        forwarding,
        body,
        idempotent: is_idempotent(req.method.as_str().as_bytes()),
        to_head,
        limits: HeadLimits { max_bytes: limits.max_header_bytes, max_headers: tidegate_h1::MAX_HEADERS },
        body_gap: limits.body_read_timeout,
        body_until,
        min_rate: crate::admission::MinRate::of(limits),
        body_sent: None,
        max_body,
    };
    let answered = attempts::run(service, &mut ex, &picking, first, &mut trace).await;
    drop((ex, buffered, per_client));
    client.seen.traced(trace);
    let Answered { answer, slot } = answered?;
    client.seen.status = answer.conn.conn.head.code;
    let gap = std::time::Duration::from_millis(service.settings.timeouts.response_ms);
    let accept_encoding = req.view.first("accept-encoding");
    let edits = req.edits;
    let reply = Reply { head, upgrade, gap, tunnel_idle: limits.tunnel_idle_timeout, stopping, edits, accept_encoding };
    let keep = respond(client, answer, slot, reply).await;
    // What the client got (`respond` answers a broken exchange itself).
    if let Some(kind) = client.seen.error {
        proxy.metrics().error(kind);
    }
    let status = StatusCode::from_u16(client.seen.status).unwrap_or(StatusCode::OK);
    client.answered(status, proxy);
    Ok(keep)
}

/// What relaying a response needs to know of its request.
struct Reply<'a> {
    head: &'a RequestHead,
    /// The `Upgrade` value offered to the backend, if any.
    upgrade: Option<&'a [u8]>,
    /// Longest wait for more of the backend's body.
    gap: std::time::Duration,
    tunnel_idle: std::time::Duration,
    stopping: bool,
    /// The route's rules (their response phase).
    edits: Option<&'a tidegate_rules::Forward>,
    /// The request's `Accept-Encoding` (for a `compress` step).
    accept_encoding: Option<&'a [u8]>,
}

/// Writes a backend's response to the client and relays its body; returns
/// whether the client connection may carry another request. The upstream
/// connection goes back to the pool only after a complete body.
async fn respond<S: ClientIo>(client: &mut ClientSide<S>, answer: NativeAnswer, slot: Slot, r: Reply<'_>) -> bool {
    let NativeAnswer { mut conn } = answer;
    let resp = std::mem::take(&mut conn.conn.head);
    let minor = r.head.minor;
    let switched_to =
        || resp.headers.iter().find(|h| h.kind == HeaderKind::Upgrade).map(|h| h.value.of(&conn.conn.inbox));
    if resp.code == 101 && r.upgrade.is_some_and(|asked| hygiene::switched_as_asked(asked, switched_to())) {
        let mut out = std::mem::take(&mut client.scratch);
        response_head(&mut out, &conn.conn.inbox, &resp, Framing::None, false, false);
        conn.conn.inbox.advance(resp.len);
        let up = &mut conn.conn;
        let ok = write_all(&mut client.io, &mut [&out, &up.inbox]).await.is_ok()
            && up.stream.write_all(&client.inbox).await.is_ok();
        client.scratch = out;
        if ok {
            up.inbox.clear();
            client.inbox.clear();
            crate::tunnel::join(client.io.get_mut(), &mut up.stream, r.tunnel_idle).await;
        }
        drop(slot);
        return false;
    }
    if resp.code == 101 {
        // A protocol switch the client did not ask for (or to a protocol
        // it did not offer): the backend broke the exchange. Nothing was
        // sent to the client yet.
        tracing::debug!("backend switched protocols without a matching upgrade request");
        let resp = crate::reply::error(ErrorKind::InvalidResponse);
        client.seen.status = resp.status().as_u16();
        client.seen.error = Some(ErrorKind::InvalidResponse);
        write_local(client, resp, true, false, minor).await;
        return false;
    }
    // A `compress` step: decided from the head; a compressed body streams.
    let choice = r.edits.map(|e| &e.response).filter(|p| p.compress.is_some()).map(|plan| {
        let fields = response_fields(&resp, &conn.conn.inbox);
        let length = match resp.body {
            tidegate_h1::ResponseBody::Length(n) => Some(n),
            _ => None,
        };
        compress::choose(plan, r.accept_encoding, resp.code, &fields, length)
    });
    let encoder = match choice {
        Some(compress::Choice::Compressible(Some(coding))) if resp.body != tidegate_h1::ResponseBody::None => {
            tidegate_rules::Compressor::new(coding).ok()
        }
        _ => None,
    };
    let framing = match resp.body {
        tidegate_h1::ResponseBody::None => Framing::None,
        tidegate_h1::ResponseBody::Length(n) if encoder.is_none() => Framing::Length(n),
        _ if minor == 1 => Framing::Chunked,
        _ => Framing::UntilClose,
    };
    let close = r.head.close || r.stopping || framing == Framing::UntilClose;
    let mut out = std::mem::take(&mut client.scratch);
    response_head(&mut out, &conn.conn.inbox, &resp, framing, close, minor == 0 && !close);
    if let Some(line) = &client.extra {
        rewrite::add_line(&mut out, line);
    }
    if let Some(edits) = r.edits.filter(|e| e.edits_response()) {
        let (buf, extra) = (&conn.conn.inbox[..], client.extra.as_deref().map(Vec::as_slice));
        let written = |n: &[u8]| rewrite::response_field_written(extra, n);
        let lines = rewrite::fitting(edits.response_lines(), written, buf, &resp.headers);
        rewrite::edit_head(&mut out, lines, edits.response_edits(), |name| {
            rewrite::response_may_have(buf, &resp, extra, name)
        });
    }
    if let Some(compress::Choice::Compressible(coding)) = choice {
        let named = |n: &[u8]| compress::HEAD_FIELDS.iter().any(|f| f.as_bytes().eq_ignore_ascii_case(n));
        rewrite::edit_fields(&mut out, named, |fields| tidegate_rules::response::compression_head(fields, coding));
    }
    conn.conn.inbox.advance(resp.len);
    let relayed = relay_body(client, &mut conn.conn, &mut out, resp.body, framing, r.gap, encoder).await;
    client.scratch = out;
    if let Err(e) = &relayed {
        tracing::debug!(error = %e, status = resp.code, "response relay ended early");
        if framing == Framing::UntilClose {
            client.end_with_reset();
        }
    }
    let complete = relayed.is_ok();
    let reusable = !resp.close;
    conn.conn.head = resp;
    if complete && reusable && conn.conn.inbox.is_empty() {
        conn.conn.park();
        conn.release();
    }
    drop(slot); // after the release, so a woken queued request can reuse it
    complete && !close
}

/// The largest whole body [`relay_body`] copies after its head: one buffer
/// goes out with `send`, two with `writev` (through the file layer, and an
/// import of the buffers), and copying a small body costs little
/// (docs/benchmarks.md, "No `writev` for a small answer": the sampled
/// difference is within the runs' spread). Within the scratch buffer a
/// connection keeps (`serve` frees one over 4 KiB).
const ONE_BUFFER_MAX: usize = 1024;

/// Writes the response head `out` and the body after it.
///
/// A body of known length up to [`relay::GATHER`] that did not all come
/// with the head is first read as far as the backend has sent it, without
/// waiting: the head and the whole body then usually go out in one write
/// (and, compressed, as one piece), where each piece read would otherwise
/// be a write, and a wakeup of the client, of its own. A whole body of up
/// to [`ONE_BUFFER_MAX`] bytes is copied after the head in `out`, so that
/// both go out in one single-buffer write.
async fn relay_body<S: ClientIo>(
    client: &mut ClientSide<S>,
    up: &mut NativeConn,
    out: &mut Vec<u8>,
    body: tidegate_h1::ResponseBody,
    framing: Framing,
    gap: std::time::Duration,
    encoder: Option<tidegate_rules::Compressor>,
) -> Result<(), RelayError> {
    use tidegate_h1::ResponseBody as B;
    let dst = &mut client.io;
    let mut src = Source {
        stream: &mut up.stream,
        inbox: &mut up.inbox,
        timer: &mut client.timer,
        gap,
        until: None,
        pace: None,
        read_max: relay::GATHER,
    };
    // The body's length when all of it is in the inbox (after gathering).
    let whole = match body {
        B::Length(n) => usize::try_from(n).ok().filter(|&n| src.gather(n)),
        _ => None,
    };
    if let Some(encoder) = encoder {
        // Compressed as it is relayed, chunked (or until the close).
        let mut w = compress::Compressing::new(dst, encoder, framing == Framing::Chunked, out);
        if let Some(n) = whole {
            let last = w.finish(&src.inbox[..n]).await.map_err(RelayError::Write);
            src.inbox.advance(n);
            return last;
        }
        match body {
            B::Length(n) => relay::relay_length(&mut src, &mut w, n).await?,
            B::Chunked => relay::relay_chunked(&mut src, &mut w, false, None).await?,
            B::UntilClose => relay::relay_until_close(&mut src, &mut w, false).await?,
            B::None => {}
        }
        return w.finish(&[]).await.map_err(RelayError::Write);
    }
    match (body, whole) {
        (B::None, _) => write_all(dst, &mut [out]).await.map_err(RelayError::Write),
        (B::Length(_), Some(n)) if n <= ONE_BUFFER_MAX => {
            out.extend_from_slice(&src.inbox[..n]);
            write_all(dst, &mut [out]).await.map_err(RelayError::Write)?;
            src.inbox.advance(n);
            Ok(())
        }
        (B::Length(_), Some(n)) => {
            write_all(dst, &mut [out, &src.inbox[..n]]).await.map_err(RelayError::Write)?;
            src.inbox.advance(n);
            Ok(())
        }
        (B::Length(n), None) => {
            // What came so far goes with the head; the rest as it comes.
            let have = src.inbox.len();
            write_all(dst, &mut [out, &src.inbox[..have]]).await.map_err(RelayError::Write)?;
            src.inbox.advance(have);
            relay::relay_length(&mut src, dst, n - have as u64).await
        }
        (B::Chunked, _) => {
            write_all(dst, &mut [out]).await.map_err(RelayError::Write)?;
            relay::relay_chunked(&mut src, dst, framing == Framing::Chunked, None).await
        }
        (B::UntilClose, _) => {
            write_all(dst, &mut [out]).await.map_err(RelayError::Write)?;
            relay::relay_until_close(&mut src, dst, framing == Framing::Chunked).await
        }
    }
}

/// The fields of a backend's response head, as a map (read for a
/// `compress` step's choice).
fn response_fields(resp: &tidegate_h1::ResponseHead, buf: &[u8]) -> http::HeaderMap {
    let mut fields = http::HeaderMap::new();
    for h in &resp.headers {
        if let (Ok(n), Ok(v)) =
            (http::HeaderName::from_bytes(h.name.of(buf)), http::HeaderValue::from_bytes(h.value.of(buf)))
        {
            fields.append(n, v);
        }
    }
    fields
}

/// Writes a response the proxy made (an error, a static file); returns
/// whether the connection may carry another request (it was written whole
/// and the connection stays open).
async fn write_local<S: ClientIo>(
    client: &mut ClientSide<S>,
    resp: Response<ProxyBody>,
    close: bool,
    to_head: bool,
    minor: u8,
) -> bool {
    let (parts, mut body) = resp.into_parts();
    let framing = match http_body::Body::size_hint(&body).exact() {
        _ if to_head => Framing::None,
        Some(n) => Framing::Length(n),
        None if minor == 1 => Framing::Chunked,
        None => Framing::UntilClose,
    };
    // A body delimited by the close ends only when the connection does.
    let close = close || framing == Framing::UntilClose;
    let mut out = std::mem::take(&mut client.scratch);
    local_head(&mut out, parts.status, &parts.headers, framing, close, minor);
    if let Some(line) = &client.extra {
        rewrite::add_line(&mut out, line);
    }
    let mut written = !to_head || write_all(&mut client.io, &mut [&out]).await.is_ok();
    let mut first = true;
    let mut line = [0u8; 18];
    while written && !to_head {
        let data = match body.frame().await {
            Some(Ok(frame)) => match frame.into_data() {
                Ok(d) => d,
                Err(_) => continue,
            },
            Some(Err(_)) => {
                written = false;
                break;
            }
            None => {
                let end: &[u8] = if framing == Framing::Chunked { tidegate_h1::CHUNKED_END } else { b"" };
                let head: &[u8] = if first { &out } else { b"" };
                written = write_all(&mut client.io, &mut [head, end]).await.is_ok();
                break;
            }
        };
        let head: &[u8] = if first { &out } else { b"" };
        first = false;
        written = if framing == Framing::Chunked && !data.is_empty() {
            let size = tidegate_h1::chunk_size_line(data.len(), &mut line);
            write_all(&mut client.io, &mut [head, size, &data, b"\r\n"]).await.is_ok()
        } else {
            write_all(&mut client.io, &mut [head, &data]).await.is_ok()
        };
    }
    client.scratch = out;
    written && !close
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_split_into_authority_path_and_query() {
        let t = split_target("/a/b?x=1").unwrap();
        assert_eq!((t.authority, t.path, t.query), (None, "/a/b", Some("x=1")));
        let t = split_target("HTTP://Example.com:8080?q").unwrap();
        assert_eq!((t.authority, t.path, t.query), (Some("Example.com:8080"), "/", Some("q")));
        let t = split_target("https://a.example/x").unwrap();
        assert_eq!((t.authority, t.path), (Some("a.example"), "/x"));
        assert_eq!(split_target("*").err(), Some(ErrorKind::InvalidPath));
        assert_eq!(split_target("a.example:443").err(), Some(ErrorKind::InvalidPath));
        assert_eq!(split_target("http://a b/").err(), Some(ErrorKind::InvalidHost));
        let t = split_target("/a?b?c=/d").unwrap();
        assert_eq!((t.path, t.query), ("/a", Some("b?c=/d")), "the first `?` ends the path");
        let t = split_target("/a?").unwrap();
        assert_eq!((t.path, t.query), ("/a", Some("")));
        for fragment in ["/public/a#/../../internal", "/a?q#f", "/a#?q", "/a?q?#", "http://a.example/#x", "#"] {
            assert_eq!(split_target(fragment).err(), Some(ErrorKind::InvalidPath), "{fragment}");
        }
    }
}

#[cfg(test)]
mod sizes {
    use super::*;

    fn size<F: std::future::Future>(_: &F) -> usize {
        std::mem::size_of::<F>()
    }

    /// Every idle connection's task holds this future: the state of a
    /// request in progress and the HTTP/2 handoff are boxed, not inline.
    #[tokio::test]
    async fn a_connection_task_stays_small() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let s = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let snaps = Arc::new(arc_swap::ArcSwap::from_pointee(tidegate_snapshot::Snapshot::empty()));
        let proxy = Arc::new(Proxy::new(snaps, &crate::ProxyMetrics::default(), Arc::new(Limits::default()), None));
        let (_tx, rx) = watch::channel(false);
        let peer = Peer::new("127.0.0.1:1".parse().unwrap());
        let f = serve(s, peer, proxy, rx, Limits::default(), crate::hyper_server::HyperServer::for_tests());
        assert!(size(&f) <= 3 * 1024, "the connection future grew to {} bytes", size(&f));
    }

    /// The state of a request in progress, boxed once per request: rare
    /// paths (HTTP/2 backends, TLS handshakes) are boxed apart, so the
    /// common one stays small and cheap to move.
    #[tokio::test]
    async fn a_request_future_stays_small() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let s = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let snaps = Arc::new(arc_swap::ArcSwap::from_pointee(tidegate_snapshot::Snapshot::empty()));
        let proxy = Arc::new(Proxy::new(snaps, &crate::ProxyMetrics::default(), Arc::new(Limits::default()), None));
        let limits = Limits::default();
        let mut client = ClientSide {
            io: TimedIo::new(s, limits.write_timeout),
            inbox: BytesMut::new(),
            timer: Timer::new(),
            scratch: Vec::new(),
            body_done: true,
            seen: Seen::new(tokio::time::Instant::now()),
            cut_short: false,
            extra: None,
        };
        let (head, buf) = (RequestHead::default(), BytesMut::new());
        let peer = Peer::new("127.0.0.1:1".parse().unwrap());
        let ctx = Ctx { head: &head, buf: &buf, peer: &peer, proxy: &proxy, limits: &limits, stopping: false };
        let f = handle(&mut client, &ctx);
        assert!(size(&f) <= 4 * 1024, "the request future grew to {} bytes", size(&f));
    }
}
