//! hyper's server side, for HTTP/2 (always) and HTTP/1.1 (with
//! `--http1 hyper`): a connection served by hyper, with its requests'
//! activity tracked for the idle timer, the rapid-reset bound and the
//! stall watch of HTTP/2 streams.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tidegate_balance::clock;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::watch;

use crate::conn::Peer;
use crate::handler::Proxy;
use crate::limits::Limits;

/// What a connection has in progress, for its idle timer: requests being
/// handled, and when the last one started or ended; and how many of its
/// requests the client cancelled before their answer.
#[derive(Debug, Default)]
struct Activity {
    in_progress: AtomicUsize,
    /// Milliseconds on [`clock`]; 0 until the first request.
    last_ms: AtomicU64,
    /// Requests started on the connection.
    requests: AtomicU64,
    /// Requests the client reset (HTTP/2 `RST_STREAM`) before their
    /// response head: each one still cost a backend exchange.
    cancelled: AtomicU64,
    /// Woken when cancellations cross [`CANCEL_LIMIT`].
    abusive: tokio::sync::Notify,
    /// Woken when a request starts (for a connection told to stop before
    /// its first one).
    started: tokio::sync::Notify,
    /// Response bodies of HTTP/2 streams still in progress, which the
    /// client's flow control may stall.
    streams: std::sync::Mutex<Vec<std::sync::Weak<Watched>>>,
}

/// Cancelled requests a connection may have before it is told to go away
/// (HTTP/2 `GOAWAY`), when they are also most of its requests: the
/// "rapid reset" attack (CVE-2023-44487) opens streams and resets them
/// before their answer, to make the proxy and its backends work for
/// nothing. h2 refuses resets of streams not yet accepted; this covers
/// those reset a little later. nginx, HAProxy and Envoy bound the same.
const CANCEL_LIMIT: u64 = 100;

/// Marks a request in progress on its connection until dropped; dropped
/// before it was `answered`, the client cancelled it.
struct InProgress {
    activity: Arc<Activity>,
    answered: bool,
}

impl Drop for InProgress {
    fn drop(&mut self) {
        let a = &self.activity;
        a.last_ms.store(clock::now_ms().max(1), Relaxed);
        a.in_progress.fetch_sub(1, Relaxed);
        if !self.answered {
            let cancelled = a.cancelled.fetch_add(1, Relaxed) + 1;
            if cancelled > CANCEL_LIMIT && cancelled * 2 > a.requests.load(Relaxed) {
                a.abusive.notify_one();
            }
        }
    }
}

impl Activity {
    fn start(self: &Arc<Self>) -> InProgress {
        // No clock read here: while a request is in progress the connection
        // is not idle, and its end stamps the time.
        self.in_progress.fetch_add(1, Relaxed);
        self.requests.fetch_add(1, Relaxed);
        self.started.notify_one();
        InProgress { activity: self.clone(), answered: false }
    }

    /// Watches an HTTP/2 stream's response body for flow-control stalls.
    fn watch(&self, body: crate::body::ProxyBody) -> Arc<Watched> {
        let watched = Arc::new(Watched {
            body: std::sync::Mutex::new(Some(body)),
            // hyper owes the client the first frame from the start: a
            // stream with no window never asks for it.
            owed_since: AtomicU64::new(clock::now_ms().max(1)),
        });
        let mut streams = self.streams.lock().unwrap_or_else(|e| e.into_inner());
        streams.retain(|w| w.strong_count() > 0);
        streams.push(Arc::downgrade(&watched));
        watched
    }

    /// Takes the body (and so the backend connection and slot) away from
    /// every stream whose client has not let hyper send anything for
    /// `timeout`: the stream ends with a reset when hyper next asks for its
    /// body. Says what it found.
    fn release_stalled(&self, now_ms: u64, timeout: Duration) -> Stalls {
        let timeout_ms = timeout.as_millis() as u64;
        let mut stalls = Stalls::default();
        let mut streams = self.streams.lock().unwrap_or_else(|e| e.into_inner());
        streams.retain(|w| {
            let Some(stream) = w.upgrade() else { return false };
            if stream.released() {
                stalls.stalled += 1;
                return true;
            }
            let owed = stream.owed_since.load(Relaxed);
            if owed != 0 && now_ms.saturating_sub(owed) >= timeout_ms {
                stream.release();
                stalls.released += 1;
                stalls.stalled += 1;
            } else {
                stalls.moving += 1;
            }
            true
        });
        stalls
    }

    /// When the connection counts as idle too long, or `None` while a
    /// request is in progress.
    fn idle_deadline(&self, accepted_ms: u64, limits: &Limits) -> Option<u64> {
        if self.in_progress.load(Relaxed) > 0 {
            return None;
        }
        Some(match self.last_ms.load(Relaxed) {
            0 => accepted_ms + limits.first_request_timeout.as_millis() as u64,
            last => last + limits.idle_timeout.as_millis() as u64,
        })
    }
}

/// What the stall watch found on a connection.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Stalls {
    /// Streams whose backend was released now.
    released: usize,
    /// Streams stalled (released now or before) and still open.
    stalled: usize,
    /// Streams in progress and not stalled.
    moving: usize,
}

impl Stalls {
    /// Every stream in progress is stalled: the connection is closed.
    fn all_stalled(self) -> bool {
        self.stalled > 0 && self.moving == 0
    }
}

/// An HTTP/2 stream's response body, shared with its connection's stall
/// watch, which can take it away (releasing its backend connection and
/// slot) when the client's flow-control window stalls the stream.
#[derive(Debug)]
struct Watched {
    body: std::sync::Mutex<Option<crate::body::ProxyBody>>,
    /// Since when (ms on [`clock`]) hyper owes the client a frame it took
    /// from the body, or 0 while it waits for the backend.
    owed_since: AtomicU64,
}

impl Watched {
    fn released(&self) -> bool {
        self.body.lock().is_ok_and(|b| b.is_none())
    }

    fn release(&self) {
        let body = self.body.lock().map(|mut b| b.take());
        drop(body);
    }
}

/// A response body that keeps its request counted as in progress until
/// the body ends (or hyper drops it), so the idle check never closes a
/// connection that is still streaming a response.
struct Tracked {
    body: TrackedBody,
    in_progress: Option<InProgress>,
}

/// A response body as its connection holds it.
enum TrackedBody {
    Own(crate::body::ProxyBody),
    /// On HTTP/2, watched for flow-control stalls.
    Watched(Arc<Watched>),
}

/// A stream whose backend the stall watch released.
#[derive(Debug)]
struct Stalled;

impl std::fmt::Display for Stalled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the client's flow control stalled the response past the write timeout")
    }
}

impl std::error::Error for Stalled {}

impl http_body::Body for Tracked {
    type Data = bytes::Bytes;
    type Error = crate::body::BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        use std::task::Poll;
        let this = &mut *self;
        let (polled, ended) = match &mut this.body {
            TrackedBody::Own(body) => {
                let polled = std::pin::Pin::new(&mut *body).poll_frame(cx);
                let ended = body.is_end_stream();
                (polled, ended)
            }
            TrackedBody::Watched(w) => {
                let mut guard = w.body.lock().unwrap_or_else(|e| e.into_inner());
                match guard.as_mut() {
                    None => (Poll::Ready(Some(Err(Box::new(Stalled) as crate::body::BoxError))), true),
                    Some(body) => {
                        let polled = std::pin::Pin::new(&mut *body).poll_frame(cx);
                        let ended = body.is_end_stream();
                        // A frame handed to hyper is owed to the client
                        // until hyper asks for the next one.
                        let owed = match &polled {
                            Poll::Ready(Some(Ok(_))) if !ended => clock::now_ms().max(1),
                            _ => 0,
                        };
                        w.owed_since.store(owed, Relaxed);
                        (polled, ended)
                    }
                }
            }
        };
        if matches!(polled, Poll::Ready(None | Some(Err(_)))) || ended {
            this.in_progress = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        match &self.body {
            TrackedBody::Own(body) => body.is_end_stream(),
            TrackedBody::Watched(w) => w.body.lock().is_ok_and(|b| b.as_ref().is_some_and(|b| b.is_end_stream())),
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match &self.body {
            TrackedBody::Own(body) => body.size_hint(),
            TrackedBody::Watched(w) => {
                w.body.lock().ok().and_then(|b| b.as_ref().map(|b| b.size_hint())).unwrap_or_default()
            }
        }
    }
}

/// hyper's server side: HTTP/1.1 (when it is the engine) and HTTP/2.
#[derive(Clone)]
pub(crate) struct HyperServer {
    builder: Arc<auto::Builder<TokioExecutor>>,
}

impl HyperServer {
    /// hyper's server side with the client limits.
    pub(crate) fn new(limits: &Limits) -> HyperServer {
        let mut builder = auto::Builder::new(TokioExecutor::new());
        // No hyper timer for HTTP/1: a slow or missing request head is a
        // connection with no request in progress, which the connection's own
        // idle check closes (see `serve_connection`); hyper's header timeout
        // would cost a timer allocation per request.
        // hyper's parsers read heads a little past the proxy's limits, so
        // that the handler refuses one over them with the proxy's own
        // answer (`handler::check_head`); hyper answers only past the
        // margin, with an empty 431 of its own.
        builder
            .http1()
            .keep_alive(true)
            .max_buf_size(limits.hyper_max_header_bytes())
            .max_headers(limits.hyper_max_headers());
        builder
            .http2()
            .timer(TokioTimer::new())
            .max_concurrent_streams(limits.h2_max_streams)
            .max_header_list_size(u32::try_from(limits.hyper_max_header_bytes()).unwrap_or(u32::MAX))
            .keep_alive_interval(Some(limits.idle_timeout))
            .keep_alive_timeout(Duration::from_secs(20));
        HyperServer { builder: Arc::new(builder) }
    }

    #[cfg(test)]
    pub(crate) fn for_tests() -> HyperServer {
        HyperServer::new(&Limits::default())
    }

    /// Serves one client connection (HTTP/1.1 or h2c) until it ends, it
    /// stays idle too long (no first request within the first-request
    /// timeout, or no request in progress for the idle timeout), or the
    /// worker stops; the last two close it gracefully.
    pub(crate) async fn serve<I>(
        &self,
        io: I,
        client: Peer,
        proxy: Arc<Proxy>,
        stop: watch::Receiver<bool>,
        limits: Limits,
    ) where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        serve_connection(io, client, proxy, &self.builder, stop, limits).await;
    }
}

async fn serve_connection<I>(
    io: I,
    client: Peer,
    proxy: Arc<Proxy>,
    builder: &auto::Builder<TokioExecutor>,
    mut stop: watch::Receiver<bool>,
    limits: Limits,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let activity = Arc::new(Activity::default());
    let accepted_ms = clock::now_ms();
    let accepted = tokio::time::Instant::now();
    let addr = client.addr;
    let client = Arc::new(client);
    let tracked = activity.clone();
    let service = service_fn(move |req: http::Request<hyper::body::Incoming>| {
        let proxy = proxy.clone();
        let client = client.clone();
        let mut in_progress = tracked.start();
        let activity = tracked.clone();
        async move {
            let h2 = req.version() == http::Version::HTTP_2;
            // In progress until the response body ends, not only its head:
            // a long download or stream is not an idle connection.
            let resp = proxy.handle(req.map(crate::upbody::Inbound::Hyper), &client).await;
            in_progress.answered = true;
            let body = |body: crate::body::ProxyBody| {
                // HTTP/2 flow control can stall a stream that still holds
                // a backend: the connection's watch may take its body away.
                let body = match h2 && !http_body::Body::is_end_stream(&body) {
                    true => TrackedBody::Watched(activity.watch(body)),
                    false => TrackedBody::Own(body),
                };
                Tracked { body, in_progress: Some(in_progress) }
            };
            Ok::<_, Infallible>(resp.map(body))
        }
    });
    let conn = builder.serve_connection_with_upgrades(TokioIo::new(io), service);
    tokio::pin!(conn);
    let check_every = limits
        .first_request_timeout
        .min(limits.idle_timeout)
        .min(limits.write_timeout / 2)
        .max(Duration::from_millis(100));
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + check_every, check_every);
    let grace = loop {
        tokio::select! {
            _ = conn.as_mut() => return,
            _ = tick.tick() => {
                let idle = activity.idle_deadline(accepted_ms, &limits).is_some_and(|d| clock::now_ms() >= d);
                if idle {
                    // Nothing in progress: a short grace for the goodbye
                    // (HTTP/2 GOAWAY), not for a peer that never finished
                    // its preface or its request head.
                    break IDLE_CLOSE_GRACE;
                }
                let stalls = activity.release_stalled(clock::now_ms(), limits.write_timeout);
                if stalls.released > 0 {
                    tracing::debug!(peer = %addr, streams = stalls.released,
                        "released the backends of HTTP/2 streams the client's flow control stalled");
                }
                if stalls.all_stalled() {
                    tracing::debug!(peer = %addr, "closing a connection whose every stream is stalled by its client");
                    break IDLE_CLOSE_GRACE;
                }
            }
            () = activity.abusive.notified() => {
                tracing::warn!(peer = %addr, cancelled = activity.cancelled.load(Relaxed),
                    "closing a connection whose client cancels most of its requests (rapid reset)");
                break IDLE_CLOSE_GRACE;
            }
            // Draining: requests in progress may finish; the worker's
            // drain timeout bounds the wait.
            _ = stop.changed() => break Duration::MAX,
        }
    };
    if grace == Duration::MAX && activity.requests.load(Relaxed) == 0 {
        // Stopped before its first request: accepted just before the stop,
        // its request on the way (a hand-over to a new process stops this
        // one while clients keep connecting). Shut down now, hyper would
        // close it unanswered; it waits for that request instead, bounded
        // by the first request's timeout.
        let left = limits.first_request_timeout.saturating_sub(accepted.elapsed());
        tokio::select! {
            _ = conn.as_mut() => return,
            _ = tokio::time::timeout(left, activity.started.notified()) => {}
        }
    }
    conn.as_mut().graceful_shutdown();
    let _ = tokio::time::timeout(grace, conn).await;
}

/// How long a connection closed for idleness has to say goodbye.
const IDLE_CLOSE_GRACE: Duration = Duration::from_secs(1);

/// A connection whose first bytes were already read: they are read again
/// first (the native path hands HTTP/2 connections to hyper this way).
pub(crate) struct Prefixed<T> {
    prefix: bytes::Bytes,
    inner: T,
}

impl<T> Prefixed<T> {
    pub(crate) fn new(prefix: bytes::Bytes, inner: T) -> Self {
        Prefixed { prefix, inner }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Prefixed<T> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix[..n]);
            bytes::Buf::advance(&mut self.prefix, n);
            return std::task::Poll::Ready(Ok(()));
        }
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Prefixed<T> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
