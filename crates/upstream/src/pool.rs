//! Upstream connection pools, owned by the worker.
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

use hyper::client::conn::http1;
use tidegate_model::BackendAddr;

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
pub struct ConnSettings {
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
    /// The client connection new connections are opened for, when the
    /// service sends the PROXY protocol (their header names it); `None`
    /// otherwise. Such connections go to that client connection's own
    /// pool, never the worker's.
    pub origin: Option<crate::Origin>,
}

/// A connection the pool can hold while it is idle.
pub trait Reusable: Send + 'static {
    /// Whether the backend closed it (or it can no longer carry a request).
    fn is_closed(&mut self) -> bool;
}

impl<C: Reusable> Reusable for Box<C> {
    fn is_closed(&mut self) -> bool {
        (**self).is_closed()
    }
}

impl<B: Send + 'static> Reusable for http1::SendRequest<B> {
    fn is_closed(&mut self) -> bool {
        http1::SendRequest::is_closed(self)
    }
}

/// Counts the connections a pool opens (the worker's metrics).
pub trait OpenCounter: Send + Sync {
    /// One more connection was opened.
    fn opened(&self);
}

/// A worker's idle upstream connections, by backend address.
pub struct UpstreamPool<C> {
    inner: Arc<Inner<C>>,
}

impl<C> std::fmt::Debug for UpstreamPool<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamPool").finish_non_exhaustive()
    }
}

impl<C> UpstreamPool<C> {
    /// A worker's pool, counting the connections it opens in `counters`.
    pub fn new(counters: Arc<dyn OpenCounter>) -> Self {
        UpstreamPool::with_grace(SURPLUS_GRACE, counters)
    }

    /// An empty pool of its own that counts the connections it opens where
    /// this one does: one client connection's, for connections that may
    /// carry its requests only (they close when it is dropped).
    pub fn private(&self) -> Self {
        let mut pool = UpstreamPool::with_grace(self.inner.grace, self.inner.counters.clone());
        if let Some(inner) = Arc::get_mut(&mut pool.inner) {
            inner.private = true;
        }
        pool
    }

    /// A pool keeping connections past `max_idle` for `grace`.
    pub fn with_grace(grace: Duration, counters: Arc<dyn OpenCounter>) -> Self {
        let sweeper = AtomicBool::new(false);
        UpstreamPool { inner: Arc::new(Inner { idle: Mutex::default(), sweeper, grace, counters, private: false }) }
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
    counters: Arc<dyn OpenCounter>,
    /// One client connection's pool ([`UpstreamPool::private`]).
    private: bool,
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
pub struct Conn<C> {
    /// The connection.
    pub conn: C,
    /// Whether it served a request before this one.
    pub reused: bool,
    addr: BackendAddr,
    /// What `release` needs of the settings (not the origin: a
    /// connection is smaller than its settings).
    keep: Keep,
    pool: Weak<Inner<C>>,
}

/// How a connection given back is kept.
#[derive(Debug, Clone, Copy)]
struct Keep {
    idle: Duration,
    max_idle: usize,
    profile: u64,
    /// It names no client (no PROXY protocol header): any request may
    /// reuse it. One that names a client goes back only to a client
    /// connection's own pool.
    shareable: bool,
}

impl From<ConnSettings> for Keep {
    fn from(s: ConnSettings) -> Keep {
        Keep { idle: s.idle, max_idle: s.max_idle, profile: s.profile, shareable: s.origin.is_none() }
    }
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
    pub fn release(mut self) {
        if self.keep.max_idle == 0 || self.conn.is_closed() {
            return;
        }
        let Some(inner) = self.pool.upgrade() else {
            return;
        };
        if !self.keep.shareable && !inner.private {
            return;
        }
        let now = Instant::now();
        if let Ok(mut map) = inner.idle.lock() {
            let list = map.entry(self.keep.profile).or_default().entry(self.addr).or_default();
            // The least recently used are at the front: expire them here
            // (the sweeper finds those behind a live one).
            while list.front_mut().is_some_and(|c| !c.usable(now)) {
                list.pop_front();
            }
            let keep = match list.len() < self.keep.max_idle {
                true => self.keep.idle,
                false => self.keep.idle.min(inner.grace),
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

impl<C: Reusable> UpstreamPool<C> {
    /// How many idle connections of `profile` to `addr` the pool holds.
    pub fn idle(&self, profile: u64, addr: &BackendAddr) -> usize {
        let Ok(map) = self.inner.idle.lock() else { return 0 };
        map.get(&profile).and_then(|m| m.get(addr)).map_or(0, VecDeque::len)
    }

    /// The most recently used live idle connection to `addr`, if any.
    pub fn checkout(&self, addr: &BackendAddr, settings: ConnSettings) -> Option<Conn<C>> {
        let now = Instant::now();
        let mut map = self.inner.idle.lock().ok()?;
        let list = map.get_mut(&settings.profile)?.get_mut(addr)?;
        while let Some(mut idle) = list.pop_back() {
            if idle.usable(now) {
                return Some(Conn {
                    conn: idle.conn,
                    reused: true,
                    addr: addr.clone(),
                    keep: settings.into(),
                    pool: Arc::downgrade(&self.inner),
                });
            }
        }
        None
    }

    /// Wraps a connection just opened to `addr`, and counts it.
    pub fn fresh(&self, conn: C, addr: &BackendAddr, settings: ConnSettings) -> Conn<C> {
        self.inner.counters.opened();
        Conn { conn, reused: false, addr: addr.clone(), keep: settings.into(), pool: Arc::downgrade(&self.inner) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// A connection that is closed when its flag says so.
    struct Fake {
        id: usize,
        closed: Arc<AtomicBool>,
    }

    impl Reusable for Fake {
        fn is_closed(&mut self) -> bool {
            self.closed.load(Relaxed)
        }
    }

    #[derive(Default)]
    struct Opened(AtomicUsize);

    impl OpenCounter for Opened {
        fn opened(&self) {
            self.0.fetch_add(1, Relaxed);
        }
    }

    fn settings(max_idle: usize, profile: u64) -> ConnSettings {
        ConnSettings { connect: Duration::from_secs(1), idle: Duration::from_secs(60), max_idle, profile, origin: None }
    }

    fn fake(id: usize) -> (Fake, Arc<AtomicBool>) {
        let closed = Arc::new(AtomicBool::new(false));
        (Fake { id, closed: closed.clone() }, closed)
    }

    #[tokio::test]
    async fn the_connection_given_back_last_is_taken_first_and_opened_ones_are_counted() {
        let opened = Arc::new(Opened::default());
        let pool = UpstreamPool::new(opened.clone());
        let addr = BackendAddr::new("127.0.0.1:1").unwrap();
        let s = settings(8, 0);
        assert!(pool.checkout(&addr, s).is_none());
        let (a, b) = (pool.fresh(fake(1).0, &addr, s), pool.fresh(fake(2).0, &addr, s));
        assert!(!a.reused);
        a.release();
        b.release();
        assert_eq!(pool.idle(0, &addr), 2);
        let taken = pool.checkout(&addr, s).unwrap();
        assert_eq!((taken.conn.id, taken.reused), (2, true));
        assert_eq!(opened.0.load(Relaxed), 2);
    }

    #[tokio::test]
    async fn a_connection_that_names_a_client_goes_back_only_to_a_private_pool() {
        let shared = UpstreamPool::new(Arc::new(Opened::default()));
        let private = shared.private();
        let addr = BackendAddr::new("127.0.0.1:1").unwrap();
        let origin =
            crate::Origin { client: "192.0.2.1:5".parse().unwrap(), local: "198.51.100.1:80".parse().unwrap() };
        let named = ConnSettings { origin: Some(origin), ..settings(8, 0) };
        shared.fresh(fake(1).0, &addr, named).release();
        assert_eq!(shared.idle(0, &addr), 0, "never kept where another client could take it");
        private.fresh(fake(2).0, &addr, named).release();
        assert_eq!(private.idle(0, &addr), 1);
    }

    #[tokio::test]
    async fn closed_connections_and_other_profiles_are_never_handed_out() {
        let pool = UpstreamPool::new(Arc::new(Opened::default()));
        let addr = BackendAddr::new("127.0.0.1:1").unwrap();
        let (conn, closed) = fake(1);
        pool.fresh(conn, &addr, settings(8, 0)).release();
        assert!(pool.checkout(&addr, settings(8, 7)).is_none(), "another profile's connections do not mix");
        closed.store(true, Relaxed);
        assert!(pool.checkout(&addr, settings(8, 0)).is_none(), "the backend closed it");
        // A closed connection is not taken back either, nor any when the
        // service keeps none idle.
        let (conn, closed) = fake(2);
        closed.store(true, Relaxed);
        pool.fresh(conn, &addr, settings(8, 0)).release();
        pool.fresh(fake(3).0, &addr, settings(0, 0)).release();
        assert_eq!(pool.idle(0, &addr), 0);
    }
}
