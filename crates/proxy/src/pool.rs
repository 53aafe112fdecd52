//! Upstream connections, owned by the worker.
//!
//! Each worker keeps its own idle HTTP/1.1 keep-alive connections per
//! backend address (hyper's client connections for requests that arrive
//! over hyper, native ones for the native HTTP/1 path; the same pool type
//! holds either), reused last-in first-out (the most recently used
//! connection has warm caches on both ends, and the oldest ones age out).
//! A request takes a connection out of the pool for the whole exchange and
//! gives it back only when the response body ended cleanly, so a connection
//! in the pool is never half-way through a message. Idle connections are
//! closed after the service's `timeouts.idle_ms`, or as soon as the backend
//! closes them (hyper's connection task notices the close and marks the
//! sender closed). Past `upstream.max_idle`, a connection given back at a
//! peak is kept only for [`SURPLUS_GRACE`]: long enough for the next burst
//! to reuse it instead of opening a new one, not so long that a past peak
//! holds sockets on both ends.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper::Response;
use hyper_util::rt::TokioIo;
use tidegate_model::{BackendAddr, UpstreamProtocol};
use tidegate_upstream::{ConnectError, Profile, Stream};

use crate::error::ErrorKind;
use crate::metrics::Counters;
use crate::upbody::UpBody;
use crate::upstream_error::classify_upstream;

/// How often idle connections are checked for expiry.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// How long a connection given back while `max_idle` others are idle is
/// kept. Closing it at once, as a plain cap would, makes a load that comes
/// in bursts close connections after every burst and open new ones for the
/// next: a handshake on both ends each time, and a socket left in
/// TIME_WAIT on the proxy's side (at 5,000 client connections over three
/// backends, one new connection for every 14 requests; see
/// docs/benchmarks.md). HAProxy purges its surplus idle connections on a
/// similar delay (`pool-purge-delay`, 5 s).
const SURPLUS_GRACE: Duration = Duration::from_secs(5);

/// What a service asks of its connections.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConnSettings {
    /// Time allowed to open a connection.
    pub connect: Duration,
    /// How long an idle connection is kept.
    pub idle: Duration,
    /// Most idle connections kept per backend (in this worker) for `idle`;
    /// more are kept for [`SURPLUS_GRACE`] only.
    pub max_idle: usize,
    /// The [`Profile::key`] of the service's upstream settings: connections
    /// of different profiles (plain, TLS with other trust) never mix.
    pub profile: u64,
}

/// A connection the pool can hold while it is idle.
pub(crate) trait Reusable: Send + 'static {
    /// Whether the backend closed it (or it can no longer carry a request).
    fn is_closed(&mut self) -> bool;
}

impl<C: Reusable> Reusable for Box<C> {
    fn is_closed(&mut self) -> bool {
        (**self).is_closed()
    }
}

impl Reusable for http1::SendRequest<UpBody> {
    fn is_closed(&mut self) -> bool {
        http1::SendRequest::is_closed(self)
    }
}

/// A worker's idle upstream connections, by backend address.
pub(crate) struct UpstreamPool<C> {
    inner: Arc<Inner<C>>,
}

impl<C> UpstreamPool<C> {
    /// A worker's pool, counting the connections it opens in `counters`.
    pub(crate) fn new(counters: Arc<Counters>) -> Self {
        UpstreamPool::with_grace(SURPLUS_GRACE, counters)
    }

    /// A pool keeping connections past `max_idle` for `grace`.
    fn with_grace(grace: Duration, counters: Arc<Counters>) -> Self {
        let sweeper = AtomicBool::new(false);
        UpstreamPool { inner: Arc::new(Inner { idle: Mutex::default(), sweeper, grace, counters }) }
    }
}

/// Idle connections by backend address.
type ByAddr<C> = HashMap<BackendAddr, VecDeque<Idle<C>>, foldhash::fast::RandomState>;

struct Inner<C> {
    /// By profile key, then address (operator-configured values: a fast
    /// hash is enough). There is usually one profile.
    idle: Mutex<HashMap<u64, ByAddr<C>, foldhash::fast::RandomState>>,
    sweeper: AtomicBool,
    /// How long a connection past `max_idle` is kept ([`SURPLUS_GRACE`]).
    grace: Duration,
    /// The worker's counters (connections opened).
    counters: Arc<Counters>,
}

struct Idle<C> {
    conn: C,
    expires: Instant,
}

impl<C: Reusable> Idle<C> {
    fn usable(&mut self, now: Instant) -> bool {
        now < self.expires && !self.conn.is_closed()
    }
}

/// An upstream connection taken out of the pool (or just opened) for one
/// exchange. Dropping it closes the connection; [`Conn::release`] returns it.
pub(crate) struct Conn<C> {
    pub(crate) conn: C,
    /// Whether it served a request before this one.
    pub(crate) reused: bool,
    addr: BackendAddr,
    settings: ConnSettings,
    pool: Weak<Inner<C>>,
}

impl<C> std::fmt::Debug for Conn<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn").field("addr", &self.addr).field("reused", &self.reused).finish()
    }
}

impl<C: Reusable> Conn<C> {
    /// Gives the connection back for reuse, unless the backend closed it or
    /// the service keeps no idle connections. It is kept for the idle
    /// timeout, or for the surplus grace when `max_idle` are idle already.
    pub(crate) fn release(mut self) {
        if self.settings.max_idle == 0 || self.conn.is_closed() {
            return;
        }
        let Some(inner) = self.pool.upgrade() else {
            return;
        };
        let now = Instant::now();
        if let Ok(mut map) = inner.idle.lock() {
            let list = map.entry(self.settings.profile).or_default().entry(self.addr).or_default();
            // The least recently used are at the front: expire them here
            // (the sweeper finds those behind a live one).
            while list.front_mut().is_some_and(|c| !c.usable(now)) {
                list.pop_front();
            }
            let keep = match list.len() < self.settings.max_idle {
                true => self.settings.idle,
                false => self.settings.idle.min(inner.grace),
            };
            list.push_back(Idle { conn: self.conn, expires: now + keep });
        }
        if !inner.sweeper.swap(true, Relaxed) {
            tokio::spawn(sweep(Arc::downgrade(&inner)));
        }
    }
}

/// Closes expired idle connections about every second, until the pool is
/// gone.
async fn sweep<C: Reusable>(inner: Weak<Inner<C>>) {
    loop {
        tokio::time::sleep(SWEEP_EVERY).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let now = Instant::now();
        // Dropped outside the lock: closing a connection is not free.
        let mut expired = Vec::new();
        if let Ok(mut map) = inner.idle.lock() {
            map.retain(|_, by_addr| {
                by_addr.retain(|_, list| {
                    // Expiry times are not in list order (a surplus
                    // connection expires sooner): look at every one.
                    if list.iter_mut().any(|c| !c.usable(now)) {
                        let mut live = VecDeque::with_capacity(list.len());
                        for mut c in list.drain(..) {
                            match c.usable(now) {
                                true => live.push_back(c),
                                false => expired.push(c),
                            }
                        }
                        *list = live;
                    }
                    // Entries for backends that went away, or went quiet.
                    !list.is_empty()
                });
                !by_addr.is_empty()
            });
        }
        drop(expired);
    }
}

/// A request answered: the response head, and the connection its body
/// arrives on.
pub(crate) struct Sent {
    pub response: Response<Incoming>,
    pub conn: Conn<HyperConn>,
}

/// hyper's client side of an HTTP/1.1 connection.
pub(crate) type HyperConn = http1::SendRequest<UpBody>;

/// A failed exchange: why, and the request itself when none of it was
/// written (a connect failure), so a streamed body can go elsewhere.
pub(crate) struct Unsent {
    pub kind: ErrorKind,
    pub request: Option<http::Request<UpBody>>,
}

impl Unsent {
    /// No response head within the response timeout.
    pub(crate) const TIMED_OUT: Unsent = Unsent { kind: ErrorKind::ResponseTimeout, request: None };
}

impl<C: Reusable> UpstreamPool<C> {
    /// The most recently used live idle connection to `addr`, if any.
    pub(crate) fn checkout(&self, addr: &BackendAddr, settings: ConnSettings) -> Option<Conn<C>> {
        let now = Instant::now();
        let mut map = self.inner.idle.lock().ok()?;
        let list = map.get_mut(&settings.profile)?.get_mut(addr)?;
        while let Some(mut idle) = list.pop_back() {
            if idle.usable(now) {
                return Some(Conn {
                    conn: idle.conn,
                    reused: true,
                    addr: addr.clone(),
                    settings,
                    pool: Arc::downgrade(&self.inner),
                });
            }
        }
        None
    }

    /// Wraps a connection just opened to `addr`, and counts it.
    pub(crate) fn fresh(&self, conn: C, addr: &BackendAddr, settings: ConnSettings) -> Conn<C> {
        self.inner.counters.upstream_opened();
        Conn { conn, reused: false, addr: addr.clone(), settings, pool: Arc::downgrade(&self.inner) }
    }
}

/// Opens a connection to `addr` as `profile` says (TCP, then TLS if
/// asked), within the connect timeout, to speak `protocol` on.
pub(crate) async fn connect(
    addr: &BackendAddr,
    profile: &Profile,
    settings: ConnSettings,
    protocol: UpstreamProtocol,
) -> Result<Stream, ErrorKind> {
    profile.connect_for(addr, settings.connect, protocol).await.map_err(|e| match e {
        ConnectError::Failed(_) => ErrorKind::ConnectFailed,
        ConnectError::TimedOut => ErrorKind::ConnectTimeout,
        ConnectError::Tls(_) => ErrorKind::UpstreamTls,
    })
}

impl UpstreamPool<HyperConn> {
    /// Opens a new connection to `addr`; `upgrades` keeps the socket usable
    /// after a `101 Switching Protocols`.
    async fn connect(
        &self,
        addr: &BackendAddr,
        profile: &Profile,
        settings: ConnSettings,
        upgrades: bool,
    ) -> Result<Conn<HyperConn>, ErrorKind> {
        let stream = connect(addr, profile, settings, UpstreamProtocol::Http1).await?;
        let (sender, conn) =
            http1::Builder::new().handshake(TokioIo::new(stream)).await.map_err(|_| ErrorKind::ConnectFailed)?;
        if upgrades {
            tokio::spawn(async move {
                let _ = conn.with_upgrades().await;
            });
        } else {
            tokio::spawn(async move {
                let _ = conn.await;
            });
        }
        Ok(self.fresh(sender, addr, settings))
    }

    /// Sends `req` to `addr` and waits for the response head. Uses a pooled
    /// connection unless `fresh` or `upgrade`; a pooled connection that
    /// turns out closed before the request was written is replaced by a new
    /// one at once (nothing was sent, so this is always safe). An upgrade
    /// gets a connection of its own, never pooled.
    pub(crate) async fn send(
        &self,
        addr: &BackendAddr,
        profile: &Profile,
        settings: ConnSettings,
        mut req: http::Request<UpBody>,
        fresh: bool,
        upgrade: bool,
    ) -> Result<Sent, Unsent> {
        let mut pooled = if fresh || upgrade { None } else { self.checkout(addr, settings) };
        loop {
            let mut conn = match pooled.take() {
                Some(c) => c,
                None => match self.connect(addr, profile, settings, upgrade).await {
                    Ok(c) => c,
                    Err(kind) => return Err(Unsent { kind, request: Some(req) }),
                },
            };
            // A new connection takes one request before its task first runs;
            // a pooled one may still be finishing its previous exchange.
            if conn.reused && !conn.conn.is_ready() && conn.conn.ready().await.is_err() {
                continue; // closed while idle: take a fresh one
            }
            match conn.conn.try_send_request(req).await {
                Ok(response) => return Ok(Sent { response, conn }),
                Err(mut e) => match e.take_message() {
                    // Not written: safe to send on a new connection.
                    Some(unsent) if conn.reused => req = unsent,
                    request => return Err(Unsent { kind: classify_upstream(e.error(), conn.reused), request }),
                },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    fn settings(idle_ms: u64, max_idle: usize) -> ConnSettings {
        ConnSettings { connect: Duration::from_secs(1), idle: Duration::from_millis(idle_ms), max_idle, profile: 0 }
    }

    fn get() -> http::Request<UpBody> {
        let mut req = http::Request::new(UpBody::empty());
        req.headers_mut().insert(http::header::HOST, http::HeaderValue::from_static("test"));
        req
    }

    /// A backend answering every request on a connection with a tiny 200;
    /// `close_after`: close each connection after that many responses.
    /// Reports the number of accepted connections.
    async fn backend(close_after: usize) -> (BackendAddr, Arc<std::sync::atomic::AtomicUsize>) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = BackendAddr::new(&l.local_addr().unwrap().to_string()).unwrap();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                count.fetch_add(1, Relaxed);
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    let mut served = 0;
                    while served < close_after {
                        let mut got = Vec::new();
                        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                            match s.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => got.extend_from_slice(&buf[..n]),
                            }
                        }
                        let _ = s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await;
                        served += 1;
                    }
                });
            }
        });
        (addr, accepted)
    }

    async fn exchange(pool: &UpstreamPool<HyperConn>, addr: &BackendAddr, s: ConnSettings) -> Result<bool, ErrorKind> {
        let Sent { response: resp, conn } =
            pool.send(addr, &Profile::default(), s, get(), false, false).await.map_err(|u| u.kind)?;
        let reused = conn.reused;
        http_body_util::BodyExt::collect(resp.into_body()).await.map_err(|_| ErrorKind::UpstreamClosed)?;
        conn.release();
        tokio::task::yield_now().await;
        Ok(reused)
    }

    #[tokio::test]
    async fn connections_are_reused_last_in_first_out() {
        let (addr, accepted) = backend(usize::MAX).await;
        let pool = UpstreamPool::<HyperConn>::new(Arc::default());
        let s = settings(60_000, 8);
        assert!(!exchange(&pool, &addr, s).await.unwrap());
        assert!(exchange(&pool, &addr, s).await.unwrap());
        assert!(exchange(&pool, &addr, s).await.unwrap());
        assert_eq!(accepted.load(Relaxed), 1);
    }

    #[tokio::test]
    async fn a_connection_the_backend_closed_is_not_used() {
        let (addr, accepted) = backend(1).await;
        let pool = UpstreamPool::<HyperConn>::new(Arc::default());
        let s = settings(60_000, 8);
        for _ in 0..5 {
            // Give the connection task time to see the close.
            exchange(&pool, &addr, s).await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(accepted.load(Relaxed), 5);
    }

    /// Takes `n` connections to `addr` at once (a burst), then gives them
    /// all back.
    async fn burst(pool: &UpstreamPool<HyperConn>, addr: &BackendAddr, s: ConnSettings, n: usize) {
        let mut held = Vec::new();
        for _ in 0..n {
            let Sent { response: resp, conn } =
                pool.send(addr, &Profile::default(), s, get(), false, false).await.ok().unwrap();
            http_body_util::BodyExt::collect(resp.into_body()).await.unwrap();
            held.push(conn);
        }
        for c in held {
            c.release();
        }
    }

    fn idle(pool: &UpstreamPool<HyperConn>, addr: &BackendAddr) -> usize {
        pool.inner.idle.lock().unwrap().get(&0).and_then(|m| m.get(addr)).map_or(0, |l| l.len())
    }

    #[tokio::test]
    async fn idle_connections_expire() {
        let (addr, _) = backend(usize::MAX).await;
        let pool = UpstreamPool::<HyperConn>::new(Arc::default());
        burst(&pool, &addr, settings(50, 8), 3).await;
        assert_eq!(idle(&pool, &addr), 3);
        tokio::time::sleep(Duration::from_millis(1_300)).await;
        assert_eq!(idle(&pool, &addr), 0, "the sweeper closes expired connections");
    }

    #[tokio::test]
    async fn past_max_idle_a_burst_keeps_its_connections_for_the_grace_only() {
        let (addr, accepted) = backend(usize::MAX).await;
        let pool = UpstreamPool::<HyperConn>::with_grace(Duration::from_millis(400), Arc::default());
        let s = settings(60_000, 2);
        burst(&pool, &addr, s, 5).await;
        assert_eq!(idle(&pool, &addr), 5, "the surplus is not closed at once");
        // The next burst within the grace reuses them all.
        burst(&pool, &addr, s, 5).await;
        assert_eq!(accepted.load(Relaxed), 5);
        assert_eq!(pool.inner.counters.upstream_opened_total(), 5, "the worker counts what it opens");
        // After the grace, the sweeper leaves max_idle of them.
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        assert_eq!(idle(&pool, &addr), 2);
        burst(&pool, &addr, s, 3).await;
        assert_eq!(accepted.load(Relaxed), 6, "two reused, one new");
    }

    #[tokio::test]
    async fn max_idle_zero_keeps_nothing() {
        let (addr, accepted) = backend(usize::MAX).await;
        let pool = UpstreamPool::<HyperConn>::new(Arc::default());
        let s = settings(60_000, 0);
        burst(&pool, &addr, s, 2).await;
        assert_eq!(idle(&pool, &addr), 0);
        burst(&pool, &addr, s, 1).await;
        assert_eq!(accepted.load(Relaxed), 3);
    }

    #[tokio::test]
    async fn connect_errors_are_typed() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = BackendAddr::new(&l.local_addr().unwrap().to_string()).unwrap();
        drop(l);
        let pool = UpstreamPool::<HyperConn>::new(Arc::default());
        let Err(unsent) = pool.send(&addr, &Profile::default(), settings(1_000, 8), get(), false, false).await else {
            panic!("connected to a closed port");
        };
        assert_eq!(unsent.kind, ErrorKind::ConnectFailed);
        assert!(unsent.request.is_some(), "nothing was sent, so the request comes back");
    }
}
