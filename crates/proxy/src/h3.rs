//! HTTP/3 on the TLS listener's address, over UDP (`serve --http3`).
//!
//! QUIC is quinn's, on the same rustls as the TLS listener and with the
//! same certificates (the same SNI resolver over the live snapshot: a
//! certificate changed at runtime serves the next handshake); HTTP/3's
//! framing and QPACK are h3's (hyperium's, over quinn through `h3-quinn`).
//! quinn was chosen over `tokio-quiche` because it is pure Rust on the
//! rustls and tokio Tidegate already runs, so one TLS stack serves TCP and
//! QUIC. Every request goes through the same pipeline as HTTP/1.1 and
//! HTTP/2 ([`Proxy::handle`]): routes, rules, balancing, limits, access
//! log and metrics, with the protocol `HTTP/3`.
//!
//! Each worker has its own UDP socket on the address (`SO_REUSEPORT`):
//! the kernel hands a client's datagrams to one socket by their addresses
//! and ports, so a connection stays on the worker that accepted it.
//! Connection migration is off: a client whose address changes would
//! reach another worker, which does not know its connection; it opens a
//! new one.
//!
//! Protections, besides the pipeline's limits:
//! - a QUIC connection takes a place under `--max-connections` and
//!   `--max-connections-per-client`, like a TCP one; past them, new
//!   connections are refused;
//! - address validation: while [`Http3::retry_above`] or more
//!   handshakes are in progress on a worker, a client whose address is not
//!   validated yet gets a Retry (a token it must echo from that address),
//!   so a flood of Initial packets from forged addresses costs a stateless
//!   answer each, not a handshake; quinn also limits what a server sends
//!   to an unvalidated address to three times what it received;
//! - no 0-RTT: rustls accepts no early data (a replay risk for requests
//!   that are not idempotent);
//! - the idle timeout (`--header-timeout-s`), the handshake within
//!   the first request's timeout, at most `--h2-max-streams`
//!   request streams at once per connection, and request heads within
//!   `--max-header-bytes` (QPACK's field section size).

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::{Buf, Bytes};
use http::header::HeaderName;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use tidegate_snapshot::Snapshot;
use tokio::sync::watch;

use crate::conn::Peer;
use crate::handler::Proxy;
use crate::limits::Limits;

/// The ALPN of HTTP/3.
const ALPN_H3: &[u8] = b"h3";

/// HTTP/3's settings.
#[derive(Debug, Clone)]
pub struct Http3 {
    /// Handshakes in progress on a worker from which clients whose
    /// address is not validated get a Retry first (0: always).
    pub retry_above: usize,
    /// The `Alt-Svc` max age (seconds) advertised on the TLS listener's
    /// HTTP/1.1 and HTTP/2 responses (0: not advertised).
    pub alt_svc_max_age_s: u64,
}

impl Default for Http3 {
    fn default() -> Self {
        Http3 { retry_above: 64, alt_svc_max_age_s: 86_400 }
    }
}

/// Counters of the QUIC side, shared by the workers.
#[derive(Debug, Default)]
pub struct QuicCounters {
    /// Connections open now.
    pub open: AtomicUsize,
    /// Connections accepted since the start.
    pub accepted: AtomicUsize,
    /// Retries sent (address validation).
    pub retries: AtomicUsize,
    /// Connections refused at `--max-connections`.
    pub refused: AtomicUsize,
    /// Handshakes in progress now (all workers).
    pub handshaking: AtomicUsize,
}

/// The rustls configuration of QUIC handshakes: TLS 1.3 only (QUIC's),
/// ALPN `h3`, the live certificates, no early data.
pub(crate) fn server_config(
    snapshots: &Arc<ArcSwap<Snapshot>>,
    limits: &Limits,
) -> std::io::Result<quinn::ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(std::io::Error::other)?
        .with_no_client_auth()
        .with_cert_resolver(crate::tls::resolver(snapshots));
    tls.alpn_protocols = vec![ALPN_H3.to_vec()];
    tls.max_early_data_size = 0;
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls).map_err(std::io::Error::other)?;
    let mut config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    let mut transport = quinn::TransportConfig::default();
    transport
        .max_concurrent_bidi_streams(limits.h2_max_streams.into())
        // The client's control and QPACK streams; no server push.
        .max_concurrent_uni_streams(3u32.into())
        .max_idle_timeout(quinn::IdleTimeout::try_from(limits.idle_timeout).ok());
    config.transport_config(Arc::new(transport));
    config.migration(false);
    Ok(config)
}

/// A UDP socket on `addr` that other workers' sockets may share
/// (`SO_REUSEPORT`; in every runtime mode, so that a new process taking
/// over can bind beside this one).
pub(crate) fn bind_udp(addr: SocketAddr, reuse_port: bool) -> std::io::Result<std::net::UdpSocket> {
    let domain = socket2::Domain::for_address(addr);
    let socket = socket2::Socket::new(domain, socket2::Type::DGRAM, Some(socket2::Protocol::UDP))?;
    if reuse_port {
        socket.set_reuse_port(true)?;
    }
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    Ok(socket.into())
}

/// What a worker's endpoint serves with.
pub(crate) struct Endpoint {
    pub socket: std::net::UdpSocket,
    pub config: quinn::ServerConfig,
    pub proxy: Arc<Proxy>,
    pub limits: Arc<Limits>,
    pub settings: Http3,
    pub slots: Arc<tokio::sync::Semaphore>,
    pub counters: Arc<QuicCounters>,
    pub stop: watch::Receiver<bool>,
    pub drain: Duration,
}

impl Endpoint {
    /// Accepts QUIC connections until the data plane stops, then lets
    /// them finish their requests (at most the drain timeout).
    pub(crate) async fn run(self) {
        let Endpoint { socket, config, proxy, limits, settings, slots, counters, mut stop, drain } = self;
        let local = match socket.local_addr() {
            Ok(a) => a,
            Err(e) => return tracing::error!(error = %e, "HTTP/3 socket"),
        };
        let runtime = Arc::new(quinn::TokioRuntime);
        let endpoint = match quinn::Endpoint::new(quinn::EndpointConfig::default(), Some(config), socket, runtime) {
            Ok(e) => e,
            Err(e) => return tracing::error!(error = %e, "cannot serve HTTP/3"),
        };
        let handshaking = Arc::new(AtomicUsize::new(0));
        let (done_tx, mut done_rx) = tokio::sync::mpsc::channel::<()>(1);
        loop {
            let incoming = tokio::select! {
                i = endpoint.accept() => match i {
                    Some(i) => i,
                    None => break,
                },
                _ = stop.changed() => break,
            };
            if !incoming.remote_address_validated()
                && incoming.may_retry()
                && handshaking.load(Relaxed) >= settings.retry_above
            {
                counters.retries.fetch_add(1, Relaxed);
                let _ = incoming.retry();
                continue;
            }
            let Ok(permit) = slots.clone().try_acquire_owned() else {
                counters.refused.fetch_add(1, Relaxed);
                incoming.refuse();
                continue;
            };
            let connecting = match incoming.accept() {
                Ok(c) => c,
                Err(_) => continue,
            };
            // Counted before its task runs: a burst of new clients is
            // seen at once by the next ones' Retry decision.
            handshaking.fetch_add(1, Relaxed);
            counters.handshaking.fetch_add(1, Relaxed);
            let conn = Connection {
                proxy: proxy.clone(),
                limits: limits.clone(),
                local,
                counters: counters.clone(),
                handshaking: handshaking.clone(),
                stop: stop.clone(),
                _done: done_tx.clone(),
                _permit: permit,
            };
            tokio::spawn(conn.serve(connecting));
        }
        // Stopping: new connections are refused; the open ones were told
        // (GOAWAY) and finish their requests.
        endpoint.set_server_config(None);
        drop(done_tx);
        let _ = tokio::time::timeout(drain, done_rx.recv()).await;
        endpoint.close(0u32.into(), b"shutting down");
        let _ = tokio::time::timeout(Duration::from_secs(1), endpoint.wait_idle()).await;
    }
}

/// One QUIC connection and what it holds.
struct Connection {
    proxy: Arc<Proxy>,
    limits: Arc<Limits>,
    local: SocketAddr,
    counters: Arc<QuicCounters>,
    handshaking: Arc<AtomicUsize>,
    stop: watch::Receiver<bool>,
    /// Held while the connection lives: the endpoint waits for all at a
    /// stop.
    _done: tokio::sync::mpsc::Sender<()>,
    /// Its place under `--max-connections`.
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Connection {
    async fn serve(mut self, connecting: quinn::Connecting) {
        let handshake = tokio::time::timeout(self.limits.first_request_timeout, connecting).await;
        self.handshaking.fetch_sub(1, Relaxed);
        self.counters.handshaking.fetch_sub(1, Relaxed);
        let metrics = self.proxy.metrics();
        let conn = match handshake {
            Ok(Ok(c)) => c,
            _ => {
                metrics.tls_handshake(false);
                return;
            }
        };
        metrics.tls_handshake(true);
        // The client's place under `--max-connections-per-client`, taken
        // once the handshake proved its address (a forged source never
        // completes one, so it cannot take a victim's places).
        let Ok(_per_client) = self.proxy.admission().connection(conn.remote_address().ip()) else {
            self.counters.refused.fetch_add(1, Relaxed);
            metrics.error(crate::ErrorKind::ClientLimit);
            // H3_EXCESSIVE_LOAD (RFC 9114, section 8.1).
            conn.close(0x107u32.into(), b"too many connections from this address");
            return;
        };
        self.counters.accepted.fetch_add(1, Relaxed);
        self.counters.open.fetch_add(1, Relaxed);
        let _open = OpenGuard(self.counters.clone());
        // The address the client reached (the socket may be bound to a
        // wildcard address).
        let local = SocketAddr::new(conn.local_ip().unwrap_or(self.local.ip()), self.local.port());
        let mut peer = Peer::with_local(conn.remote_address(), local);
        peer.set_listener(self.local.port(), true);
        peer.trusted = self.limits.trusted_proxies.contains(peer.addr.ip());
        let peer = Arc::new(peer);
        let field_section = u64::try_from(self.limits.max_header_bytes).unwrap_or(u64::MAX);
        let quic = conn.clone();
        let mut h3 = match h3::server::builder()
            .max_field_section_size(field_section)
            .build::<_, Bytes>(h3_quinn::Connection::new(conn))
            .await
        {
            Ok(h) => h,
            Err(e) => return tracing::debug!(error = %e, "HTTP/3 connection setup failed"),
        };
        // Requests in progress: a connection with none is closed after the
        // idle timeout (QUIC's own idle timer restarts on any packet, a
        // PING included) and at once when stopping.
        let in_progress = Arc::new(AtomicUsize::new(0));
        let mut stopping = false;
        let mut idle_since = tokio::time::Instant::now();
        loop {
            if *self.stop.borrow() && !stopping {
                stopping = true;
                // GOAWAY: the requests already sent are served.
                let _ = h3.shutdown(0).await;
            }
            let busy = in_progress.load(Relaxed) > 0;
            if busy {
                idle_since = tokio::time::Instant::now();
            } else if stopping || idle_since.elapsed() >= self.limits.idle_timeout {
                quic.close(0u32.into(), b"idle");
                break;
            }
            // Looked at again this often while requests are in progress or
            // the connection drains; otherwise when the idle timeout is due.
            let next = match (busy, stopping) {
                (false, false) => idle_since + self.limits.idle_timeout,
                _ => tokio::time::Instant::now() + Duration::from_millis(100),
            };
            let accepted = tokio::select! {
                a = h3.accept() => a,
                _ = self.stop.changed(), if !stopping => continue,
                () = tokio::time::sleep_until(next) => continue,
            };
            match accepted {
                Ok(Some(resolver)) => {
                    let (proxy, peer, limits) = (self.proxy.clone(), peer.clone(), self.limits.clone());
                    let held = InProgress::new(&in_progress);
                    tokio::spawn(async move {
                        let head = tokio::time::timeout(limits.idle_timeout, resolver.resolve_request()).await;
                        if let Ok(Ok((req, stream))) = head {
                            request(proxy, &peer, &limits, req, stream).await;
                        }
                        drop(held);
                    });
                }
                Ok(None) => {
                    // No more requests: those in progress finish first
                    // (each bounded by its own timeouts).
                    while in_progress.load(Relaxed) > 0 {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    break;
                }
                Err(e) => {
                    tracing::debug!(client = %peer.addr, error = %e, "HTTP/3 connection ended");
                    break;
                }
            }
        }
    }
}

/// A request in progress on a connection, counted while it lives.
struct InProgress(Arc<AtomicUsize>);

impl InProgress {
    fn new(count: &Arc<AtomicUsize>) -> InProgress {
        count.fetch_add(1, Relaxed);
        InProgress(count.clone())
    }
}

impl Drop for InProgress {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

/// Counts a connection open while it lives.
struct OpenGuard(Arc<QuicCounters>);

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Relaxed);
    }
}

type Stream = h3::server::RequestStream<h3_quinn::BidiStream<Bytes>, Bytes>;

/// Serves one request stream through the pipeline. Each write to the
/// client must be done within the write timeout (a client that never
/// opens its flow-control window holds the stream that long at most).
async fn request(proxy: Arc<Proxy>, peer: &Peer, limits: &Limits, req: http::Request<()>, stream: Stream) {
    let (mut send, recv) = stream.split();
    let resp = match declared_length(req.headers()) {
        Ok(length) => {
            let body = RequestBody { recv, length, seen: 0, trailers: false, done: false };
            proxy.handle(req.map(|()| crate::upbody::Inbound::boxed(body)), peer).await
        }
        Err(()) => crate::reply::error(crate::ErrorKind::BadRequest),
    };
    let (mut parts, mut body) = resp.into_parts();
    // Connection-specific fields have no place in HTTP/3 (RFC 9114,
    // section 4.2).
    for name in CONNECTION_FIELDS {
        parts.headers.remove(name);
    }
    let timed = |r: Result<Result<(), h3::error::StreamError>, tokio::time::error::Elapsed>| matches!(r, Ok(Ok(())));
    let write = limits.write_timeout;
    if !timed(tokio::time::timeout(write, send.send_response(http::Response::from_parts(parts, ()))).await) {
        return;
    }
    while let Some(frame) = body.frame().await {
        let sent = match frame {
            Ok(f) if f.is_data() => match f.into_data() {
                Ok(data) if data.is_empty() => continue,
                Ok(data) => tokio::time::timeout(write, send.send_data(data)).await,
                Err(_) => continue,
            },
            Ok(f) => match f.into_trailers() {
                Ok(trailers) => tokio::time::timeout(write, send.send_trailers(trailers)).await,
                Err(_) => continue,
            },
            Err(_) => {
                // The answer broke off: the stream is reset, not ended.
                send.stop_stream(h3::error::Code::H3_INTERNAL_ERROR);
                return;
            }
        };
        if !timed(sent) {
            // Too slow or gone: the stream is reset, its backend freed.
            send.stop_stream(h3::error::Code::H3_REQUEST_CANCELLED);
            return;
        }
    }
    let _ = tokio::time::timeout(write, send.finish()).await;
}

/// A request's `content-length`: none, or one value (repeated values must
/// agree); anything else is refused.
fn declared_length(headers: &http::HeaderMap) -> Result<Option<u64>, ()> {
    let mut length = None;
    for v in headers.get_all(http::header::CONTENT_LENGTH) {
        let n: u64 = v.to_str().map_err(drop)?.trim().parse().map_err(drop)?;
        if length.is_some_and(|l| l != n) {
            return Err(());
        }
        length = Some(n);
    }
    Ok(length)
}

/// Fields HTTP/3 forbids in a message.
const CONNECTION_FIELDS: [HeaderName; 5] = [
    http::header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    http::header::TRANSFER_ENCODING,
    http::header::UPGRADE,
];

/// Why a request body broke off.
#[derive(Debug, thiserror::Error)]
enum BodyError {
    /// The stream failed or was reset.
    #[error("HTTP/3 request stream: {0}")]
    Stream(h3::error::StreamError),
    /// More or fewer bytes than its `content-length`.
    #[error("the body does not match its content-length")]
    Length,
}

/// A request stream's body (and trailers) as an `http_body::Body`.
struct RequestBody {
    recv: h3::server::RequestStream<h3_quinn::RecvStream, Bytes>,
    /// The declared length, if any: a body that does not keep to it is
    /// an error (the backend is told that length: a byte more would be
    /// the start of another request to it).
    length: Option<u64>,
    /// Data bytes received so far.
    seen: u64,
    /// The data ended: trailers next.
    trailers: bool,
    done: bool,
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        if !this.trailers {
            match this.recv.poll_recv_data(cx) {
                Poll::Ready(Ok(Some(mut buf))) => {
                    let data = buf.copy_to_bytes(buf.remaining());
                    this.seen += data.len() as u64;
                    if this.length.is_some_and(|n| this.seen > n) {
                        this.done = true;
                        return Poll::Ready(Some(Err(BodyError::Length)));
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Poll::Ready(Ok(None)) if this.length.is_some_and(|n| this.seen != n) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(BodyError::Length)));
                }
                Poll::Ready(Ok(None)) => this.trailers = true,
                Poll::Ready(Err(e)) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(BodyError::Stream(e))));
                }
                Poll::Pending => return Poll::Pending,
            }
        }
        match this.recv.poll_recv_trailers(cx) {
            Poll::Ready(Ok(Some(trailers))) => {
                this.done = true;
                Poll::Ready(Some(Ok(Frame::trailers(trailers))))
            }
            Poll::Ready(Ok(None)) => {
                this.done = true;
                Poll::Ready(None)
            }
            Poll::Ready(Err(e)) => {
                this.done = true;
                Poll::Ready(Some(Err(BodyError::Stream(e))))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.length == Some(0)
    }

    fn size_hint(&self) -> SizeHint {
        // What is still to come, as hyper's bodies tell it.
        match self.length {
            Some(n) => SizeHint::with_exact(n.saturating_sub(self.seen)),
            None => SizeHint::default(),
        }
    }
}
