//! Limits and timeouts of client connections, and the trusted-proxy list.
//!
//! Everything a client controls is bounded: how long it may stay silent
//! before its first request, how long a request head or an idle keep-alive
//! gap may take, how slowly it may send a body or read a response, how
//! large its headers may be, how many streams an HTTP/2 connection may
//! open, and how many connections the listener holds at once.

use std::net::IpAddr;
use std::pin::Pin;
use std::str::FromStr;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// Client-side limits of the data plane. Every field has a safe default.
#[derive(Debug, Clone)]
pub struct Limits {
    /// A new connection must complete its first request head within this
    /// time (a silent connection, a half HTTP/2 preface, or a preface and
    /// nothing else are closed). Default 10 s.
    pub first_request_timeout: Duration,
    /// HTTP/1: time allowed for each later request head, which is also how
    /// long a keep-alive connection may stay idle between requests. HTTP/2:
    /// how long a connection with no request in progress stays open.
    /// Default 30 s.
    pub idle_timeout: Duration,
    /// Longest gap between two pieces of a request body. Default 30 s.
    pub body_read_timeout: Duration,
    /// Longest time for a whole request body. Default 600 s.
    pub body_total_timeout: Duration,
    /// Longest time a write to the client may stay blocked (a client that
    /// stops reading its response). Default 60 s.
    pub write_timeout: Duration,
    /// An upgraded (WebSocket) tunnel in which neither side sends a byte
    /// for this long is closed. Default 300 s.
    pub tunnel_idle_timeout: Duration,
    /// Most client connections open at once, over all workers; beyond it
    /// the listener stops accepting until one closes. Default 10,000.
    pub max_connections: usize,
    /// Largest request head (request line and headers), bytes; larger
    /// gets 431. Default 64 KiB.
    pub max_header_bytes: usize,
    /// Most request headers; more gets 431. Default 100.
    pub max_headers: usize,
    /// Most concurrent streams per HTTP/2 connection. Default 100.
    pub h2_max_streams: u32,
    /// Peers whose forwarding headers (`X-Forwarded-For`, `Forwarded`,
    /// `X-Real-IP`) are kept and appended to. Default: none.
    pub trusted_proxies: TrustedProxies,
    /// Balancers in front that put a PROXY protocol header (version 1 or
    /// 2) before each connection's bytes: a connection from one of these
    /// networks must start with one (read within `first_request_timeout`),
    /// and the client it names is the connection's client for everything
    /// (routing conditions, rules, rate limits, per-client caps, logs,
    /// `X-Forwarded-For`). From anywhere else a header is not accepted (it
    /// is not HTTP, nor TLS, and the connection is closed). Default: none.
    pub proxy_protocol_from: TrustedProxies,
    /// A request body up to this size is read whole before a backend is
    /// chosen (a slow client holds no backend, and the body can be retried
    /// on another); a larger one has this much read first, then streams.
    /// 0 reads nothing ahead. Default 1 MiB.
    pub request_buffer_bytes: usize,
    /// Memory all workers may hold in request bodies read ahead; when it
    /// is spent, bodies stream at once (under the minimum pace). Default
    /// 256 MiB.
    pub request_buffer_total_bytes: usize,
    /// A request body streamed to a backend (one larger than the buffer,
    /// or read when the budget was spent) must arrive at this many bytes
    /// per second on average over each `upload_rate_window`, or it is cut
    /// with `408` and its backend freed. 0 turns the check off. Default
    /// 1,024.
    pub min_upload_rate: u64,
    /// The window of `min_upload_rate`. Default 10 s.
    pub upload_rate_window: Duration,
    /// Most connections open at once from one client address (IPv6: one
    /// /64); more are closed at once. 0: no cap (the default: clients
    /// behind one NAT or proxy share an address).
    pub max_connections_per_client: usize,
    /// Most requests at once from one client address (IPv6: one /64), over
    /// all its connections, waiting for a backend (in the service's queue)
    /// or being answered, until each answer's head; a body being read
    /// ahead does not count. More get `429`. 0: no cap (the default).
    pub max_requests_per_client: usize,
    /// Requests per second one client address (IPv6: one /64) may send
    /// on average to services, over all its connections: a token bucket
    /// per address, holding `request_burst_per_client` tokens. A request
    /// over it gets `429` with `Retry-After: 1` before a backend is
    /// chosen. A cap on requests in progress does not bound a client whose
    /// requests the backend answers at once; this does. 0: no limit (the
    /// default, as for the caps: clients behind one NAT share an address).
    pub max_request_rate_per_client: u32,
    /// The requests one client address may send at once above its rate
    /// (the bucket's size). 0: as many as `max_request_rate_per_client`
    /// (one second's worth).
    pub request_burst_per_client: u32,
    /// How long a request refused for its client's rate waits before its
    /// `429` is written (at most 1 s, its `Retry-After`): a client that
    /// sends its next request as soon as it has an answer then spends its
    /// connections waiting, not the proxy's CPU on refusals (HAProxy's
    /// tarpit). Zero (the default): answered at once.
    pub request_rate_tarpit: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            first_request_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(30),
            body_read_timeout: Duration::from_secs(30),
            body_total_timeout: Duration::from_secs(600),
            write_timeout: Duration::from_secs(60),
            tunnel_idle_timeout: Duration::from_secs(300),
            max_connections: 10_000,
            max_header_bytes: 64 * 1024,
            max_headers: 100,
            h2_max_streams: 100,
            trusted_proxies: TrustedProxies::default(),
            proxy_protocol_from: TrustedProxies::default(),
            request_buffer_bytes: 1024 * 1024,
            request_buffer_total_bytes: 256 * 1024 * 1024,
            min_upload_rate: 1024,
            upload_rate_window: Duration::from_secs(10),
            max_connections_per_client: 0,
            max_requests_per_client: 0,
            max_request_rate_per_client: 0,
            request_burst_per_client: 0,
            request_rate_tarpit: Duration::ZERO,
        }
    }
}

/// How far past the proxy's own head limits hyper's parsers read (HTTP/1
/// with `--http1 hyper`, and HTTP/2 on either engine): a head over
/// `max_header_bytes` or `max_headers` but within this many times them
/// reaches the handler, which refuses it with the proxy's own `431` and
/// text, as the native engine does; only a head past this answers with
/// hyper's own empty `431`, written before the proxy sees the request.
pub(crate) const HYPER_HEAD_MARGIN: usize = 2;

impl Limits {
    /// The largest head hyper's HTTP/1 parser reads (its read buffer's
    /// bound, which must be at least hyper's minimum of 8 KiB), and the
    /// largest header list h2 decodes: [`HYPER_HEAD_MARGIN`] times
    /// `max_header_bytes`.
    pub(crate) fn hyper_max_header_bytes(&self) -> usize {
        self.max_header_bytes.saturating_mul(HYPER_HEAD_MARGIN).max(8192)
    }

    /// The most header fields hyper's HTTP/1 parser reads:
    /// [`HYPER_HEAD_MARGIN`] times `max_headers`.
    pub(crate) fn hyper_max_headers(&self) -> usize {
        self.max_headers.saturating_mul(HYPER_HEAD_MARGIN)
    }
}

/// A list of address blocks (`10.0.0.0/8`, `::1/128`, `192.0.2.7`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrustedProxies(Vec<(IpAddr, u8)>);

impl TrustedProxies {
    /// Whether `ip` is in one of the blocks.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = canonical(ip);
        self.0.iter().any(|(net, bits)| in_block(ip, *net, *bits))
    }

    /// True when no peer is trusted.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// An IPv4-mapped IPv6 address as the IPv4 address it is.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

fn in_block(ip: IpAddr, net: IpAddr, bits: u8) -> bool {
    let (a, b, width) = match (ip, net) {
        (IpAddr::V4(a), IpAddr::V4(b)) => (u128::from(u32::from(a)), u128::from(u32::from(b)), 32),
        (IpAddr::V6(a), IpAddr::V6(b)) => (u128::from(a), u128::from(b), 128),
        _ => return false,
    };
    if bits == 0 {
        return true;
    }
    let shift = width - u32::from(bits);
    (a >> shift) == (b >> shift)
}

impl FromStr for TrustedProxies {
    type Err = String;

    /// Comma-separated blocks; an address without `/bits` is one host.
    fn from_str(s: &str) -> Result<Self, String> {
        let mut blocks = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (addr, bits) = part.split_once('/').map_or((part, None), |(a, b)| (a, Some(b)));
            let ip: IpAddr = addr.parse().map_err(|_| format!("{part:?}: not an IP address or CIDR block"))?;
            let ip = canonical(ip);
            let width = if ip.is_ipv4() { 32 } else { 128 };
            let bits = match bits {
                None => width,
                Some(b) => b
                    .parse::<u8>()
                    .ok()
                    .filter(|b| *b <= width)
                    .ok_or_else(|| format!("{part:?}: prefix length must be 0..={width}"))?,
            };
            blocks.push((ip, bits));
        }
        Ok(TrustedProxies(blocks))
    }
}

/// A client socket whose writes fail with `TimedOut` once one has been
/// blocked for longer than the write timeout (a client that stopped
/// reading). The timer exists only while a write is blocked. It counts the
/// bytes read and written through it (for the access log).
pub(crate) struct TimedIo<T> {
    inner: T,
    write_timeout: Duration,
    blocked: Option<Pin<Box<Sleep>>>,
    read: u64,
    written: u64,
}

impl<T> TimedIo<T> {
    pub(crate) fn new(inner: T, write_timeout: Duration) -> Self {
        TimedIo { inner, write_timeout, blocked: None, read: 0, written: 0 }
    }

    /// The socket itself (its reads and writes are not counted).
    pub(crate) fn get_mut(&mut self) -> &mut T {
        &mut self.inner
    }

    /// The socket itself.
    pub(crate) fn get_ref(&self) -> &T {
        &self.inner
    }

    /// Bytes read through this wrapper so far.
    pub(crate) fn bytes_read(&self) -> u64 {
        self.read
    }

    /// Bytes written through this wrapper so far.
    pub(crate) fn bytes_written(&self) -> u64 {
        self.written
    }

    /// Turns a pending write into an error once it waited too long.
    fn pending_write<R>(&mut self, cx: &mut Context<'_>, polled: Poll<std::io::Result<R>>) -> Poll<std::io::Result<R>> {
        if polled.is_ready() {
            self.blocked = None;
            return polled;
        }
        let timeout = self.write_timeout;
        let sleep = self.blocked.get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(std::io::ErrorKind::TimedOut.into())),
            Poll::Pending => Poll::Pending,
        }
    }
}

use std::future::Future as _;

impl<T: AsyncRead + Unpin> AsyncRead for TimedIo<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        self.read += (buf.filled().len() - before) as u64;
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for TimedIo<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = polled {
            self.written += n as u64;
        }
        self.pending_write(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = polled {
            self.written += n as u64;
        }
        self.pending_write(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_flush(cx);
        self.pending_write(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trusted_blocks_parse_and_match() {
        let t: TrustedProxies = "10.0.0.0/8, 192.0.2.7,::1/128,2001:db8::/32".parse().unwrap();
        assert!(t.contains("10.1.2.3".parse().unwrap()));
        assert!(t.contains("192.0.2.7".parse().unwrap()));
        assert!(!t.contains("192.0.2.8".parse().unwrap()));
        assert!(t.contains("::ffff:10.9.9.9".parse().unwrap()), "mapped IPv4");
        assert!(t.contains("2001:db8:1::5".parse().unwrap()));
        assert!(!t.contains("2001:db9::5".parse().unwrap()));
        assert!("".parse::<TrustedProxies>().unwrap().is_empty());
        assert!("10.0.0.0/33".parse::<TrustedProxies>().is_err());
        assert!("nonsense".parse::<TrustedProxies>().is_err());
        let all: TrustedProxies = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains("8.8.8.8".parse().unwrap()));
    }
}
