//! hyper's HTTP/1.1 client connections in the worker's pool
//! ([`tidegate_upstream::pool`]): used for upgrades (WebSocket), whose
//! socket hyper hands over after a `101`. Opening and sending, with
//! failures as [`ErrorKind`]s.

use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper::Response;
use hyper_util::rt::TokioIo;
use tidegate_model::{BackendAddr, UpstreamProtocol};
use tidegate_upstream::pool::{Conn, ConnSettings, OpenCounter, UpstreamPool};
use tidegate_upstream::{Profile, Stream};

use crate::error::ErrorKind;
use crate::metrics::Counters;
use crate::upbody::UpBody;
use crate::upstream_error::classify_upstream;

impl OpenCounter for Counters {
    fn opened(&self) {
        self.upstream_opened();
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

/// Opens a connection to `addr` as `profile` says (TCP, then TLS if
/// asked), within the connect timeout, to speak `protocol` on.
pub(crate) async fn connect(
    addr: &BackendAddr,
    profile: &Profile,
    settings: ConnSettings,
    protocol: UpstreamProtocol,
) -> Result<Stream, ErrorKind> {
    profile
        .connect_for(addr, settings.connect, protocol, settings.origin)
        .await
        .map_err(|e| crate::upstream_error::connect_kind(&e))
}

/// Opens a new connection to `addr`; `upgrades` keeps the socket usable
/// after a `101 Switching Protocols`.
pub(crate) async fn open_hyper(
    pool: &UpstreamPool<HyperConn>,
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
    Ok(pool.fresh(sender, addr, settings))
}

/// Sending over a pool of hyper's connections.
pub(crate) trait HyperPool {
    /// Sends `req` to `addr` and waits for the response head.
    async fn send(
        &self,
        addr: &BackendAddr,
        profile: &Profile,
        settings: ConnSettings,
        req: http::Request<UpBody>,
        fresh: bool,
        upgrade: bool,
    ) -> Result<Sent, Unsent>;
}

impl HyperPool for UpstreamPool<HyperConn> {
    /// Sends `req` to `addr` and waits for the response head. Uses a pooled
    /// connection unless `fresh` or `upgrade`; a pooled connection that
    /// turns out closed before the request was written is replaced by a new
    /// one at once (nothing was sent, so this is always safe). An upgrade
    /// gets a connection of its own, never pooled.
    async fn send(
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
                None => match open_hyper(self, addr, profile, settings, upgrade).await {
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
    use std::sync::atomic::Ordering::Relaxed;
    use std::sync::Arc;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    fn settings(idle_ms: u64, max_idle: usize) -> ConnSettings {
        ConnSettings {
            connect: Duration::from_secs(1),
            idle: Duration::from_millis(idle_ms),
            max_idle,
            profile: 0,
            origin: None,
        }
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
        let pool = UpstreamPool::<HyperConn>::new(Arc::<Counters>::default());
        let s = settings(60_000, 8);
        assert!(!exchange(&pool, &addr, s).await.unwrap());
        assert!(exchange(&pool, &addr, s).await.unwrap());
        assert!(exchange(&pool, &addr, s).await.unwrap());
        assert_eq!(accepted.load(Relaxed), 1);
    }

    #[tokio::test]
    async fn a_connection_the_backend_closed_is_not_used() {
        let (addr, accepted) = backend(1).await;
        let pool = UpstreamPool::<HyperConn>::new(Arc::<Counters>::default());
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
        pool.idle(0, addr)
    }

    /// Waits (10 s at most) until `addr` has `n` idle connections.
    async fn idle_becomes(pool: &UpstreamPool<HyperConn>, addr: &BackendAddr, n: usize, what: &str) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while idle(pool, addr) != n {
            assert!(tokio::time::Instant::now() < deadline, "{what}: still {} idle", idle(pool, addr));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test]
    async fn idle_connections_expire() {
        let (addr, _) = backend(usize::MAX).await;
        let pool = UpstreamPool::<HyperConn>::new(Arc::<Counters>::default());
        burst(&pool, &addr, settings(50, 8), 3).await;
        assert_eq!(idle(&pool, &addr), 3);
        idle_becomes(&pool, &addr, 0, "the sweeper closes expired connections").await;
    }

    #[tokio::test]
    async fn past_max_idle_a_burst_keeps_its_connections_for_the_grace_only() {
        let (addr, accepted) = backend(usize::MAX).await;
        let counters = Arc::<Counters>::default();
        // A grace long enough for the second burst on a busy machine.
        let pool = UpstreamPool::<HyperConn>::with_grace(Duration::from_secs(3), counters.clone());
        let s = settings(60_000, 2);
        burst(&pool, &addr, s, 5).await;
        assert_eq!(idle(&pool, &addr), 5, "the surplus is not closed at once");
        // The next burst within the grace reuses them all.
        burst(&pool, &addr, s, 5).await;
        assert_eq!(accepted.load(Relaxed), 5);
        assert_eq!(counters.upstream_opened_total(), 5, "the worker counts what it opens");
        // After the grace, the sweeper leaves max_idle of them.
        idle_becomes(&pool, &addr, 2, "the surplus closed after the grace").await;
        burst(&pool, &addr, s, 3).await;
        assert_eq!(accepted.load(Relaxed), 6, "two reused, one new");
    }

    #[tokio::test]
    async fn max_idle_zero_keeps_nothing() {
        let (addr, accepted) = backend(usize::MAX).await;
        let pool = UpstreamPool::<HyperConn>::new(Arc::<Counters>::default());
        let s = settings(60_000, 0);
        burst(&pool, &addr, s, 2).await;
        assert_eq!(idle(&pool, &addr), 0);
        burst(&pool, &addr, s, 1).await;
        assert_eq!(accepted.load(Relaxed), 3);
    }

    #[tokio::test]
    async fn connect_errors_are_typed() {
        // Bound and never listening, held to the end: refused, and no
        // listener of a test running beside can take the port.
        let held = tokio::net::TcpSocket::new_v4().unwrap();
        held.bind(([127, 0, 0, 1], 0).into()).unwrap();
        let addr = BackendAddr::new(&held.local_addr().unwrap().to_string()).unwrap();
        let pool = UpstreamPool::<HyperConn>::new(Arc::<Counters>::default());
        let Err(unsent) = pool.send(&addr, &Profile::default(), settings(1_000, 8), get(), false, false).await else {
            panic!("connected to a closed port");
        };
        assert_eq!(unsent.kind, ErrorKind::ConnectFailed);
        assert!(unsent.request.is_some(), "nothing was sent, so the request comes back");
    }
}
