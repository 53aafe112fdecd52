//! What one client may take of the proxy and its backends.
//!
//! - **Request bodies are read before a backend is chosen**, up to
//!   [`Limits::request_buffer_bytes`], out of a memory budget shared by all
//!   workers ([`BufferBudget`]): a client that sends its body slowly holds
//!   a connection to the proxy, not a backend's concurrency slot, queue
//!   place or connection (nginx's request buffering). The backend then
//!   gets the body at memory speed, and the learned concurrency limit
//!   sees the backend's time, not the client's.
//! - **A body streamed to a backend must keep a minimum pace** ([`Pace`]):
//!   bodies larger than the buffer, or read when the budget is spent, hold
//!   a backend while they arrive, so a body that sends fewer than
//!   [`Limits::min_upload_rate`] bytes per second over a window of
//!   [`Limits::upload_rate_window`] is cut with `408` and frees its slot.
//! - **Per-client caps** ([`PerClient`]): connections and requests in
//!   progress per client address (IPv6 by /64), so that one address cannot
//!   take a service's capacity. Off by default: clients behind one NAT or
//!   proxy share an address.
//! - **A per-client request rate** ([`Limits::max_request_rate_per_client`]):
//!   a token bucket per client address, in a table of bounded size
//!   (`tidegate_rules::bucket`, the `rate_limit` rule's). A client whose
//!   requests the backend answers at once never has many in progress, so
//!   the caps above do not bound it; its rate does. Off by default.
//!
//! The decisions ([`Pace`], and [`client_key`] in tidegate-snapshot) are pure; the counters are
//! atomics and sharded maps.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tidegate_rules::bucket::{self, Admit, Buckets};
use tidegate_snapshot::client_key;
use tokio::time::Instant;

use crate::limits::Limits;

/// What the proxy shares between its workers to admit clients.
#[derive(Debug)]
pub(crate) struct Admission {
    /// Memory for request bodies read before a backend is chosen.
    pub buffers: Arc<BufferBudget>,
    /// Per-client counters, when a cap is set.
    pub clients: Option<Arc<PerClient>>,
    /// Per-client token buckets, when a rate is set.
    rates: Option<Buckets>,
    /// How long a refusal for the rate waits before it is answered.
    tarpit: Duration,
}

impl Admission {
    /// The admission state for `limits`.
    pub(crate) fn new(limits: &Limits) -> Admission {
        let caps = (limits.max_connections_per_client, limits.max_requests_per_client);
        Admission {
            buffers: Arc::new(BufferBudget::new(limits.request_buffer_total_bytes)),
            clients: (caps != (0, 0)).then(|| Arc::new(PerClient::new(caps.0, caps.1))),
            rates: (limits.max_request_rate_per_client > 0).then(|| {
                let rate = limits.max_request_rate_per_client;
                let burst = match limits.request_burst_per_client {
                    0 => rate,
                    b => b,
                };
                Buckets::new(u64::from(rate) * 1000, burst, bucket::DEFAULT_KEYS)
            }),
            tarpit: limits.request_rate_tarpit.min(Duration::from_secs(1)),
        }
    }

    /// Counts a request in progress from `ip`, as [`Admission::request`];
    /// a refusal for the client's rate comes after the tarpit's wait.
    pub(crate) async fn admit_request(&self, ip: IpAddr) -> Result<Option<ClientHold>, crate::ErrorKind> {
        match self.request(ip) {
            Ok(hold) => Ok(hold),
            Err(AtCap::Rate) if !self.tarpit.is_zero() => {
                tokio::time::sleep(self.tarpit).await;
                Err(crate::ErrorKind::ClientRate)
            }
            Err(cap) => Err(cap.kind()),
        }
    }

    /// Counts a new connection from `ip` (`None`: no cap is set); `Err`
    /// when the client is at its cap (the connection is then closed at once).
    pub(crate) fn connection(&self, ip: IpAddr) -> Result<Option<ClientHold>, AtCap> {
        match &self.clients {
            None => Ok(None),
            Some(c) => c.take(ip, Kind::Connection).map(Some),
        }
    }

    /// Counts a request in progress from `ip` (`None`: no cap is set);
    /// `Err` when the client is at its cap or over its rate (answered
    /// `429`).
    pub(crate) fn request(&self, ip: IpAddr) -> Result<Option<ClientHold>, AtCap> {
        if let Some(rates) = &self.rates {
            if let Admit::No(_) = rates.take(client_key(ip), std::time::Instant::now()) {
                return Err(AtCap::Rate);
            }
        }
        match &self.clients {
            None => Ok(None),
            Some(c) => c.take(ip, Kind::Request).map(Some),
        }
    }
}

/// A memory budget for buffered request bodies, shared by all workers.
#[derive(Debug)]
pub(crate) struct BufferBudget {
    used: AtomicUsize,
    max: usize,
}

impl BufferBudget {
    pub(crate) fn new(max: usize) -> BufferBudget {
        BufferBudget { used: AtomicUsize::new(0), max }
    }

    /// Takes `bytes` of the budget, or `None` when that would exceed it
    /// (the body then streams, under the minimum pace).
    pub(crate) fn reserve(self: &Arc<Self>, bytes: usize) -> Option<Reserved> {
        let mut used = self.used.load(Relaxed);
        loop {
            let after = used.checked_add(bytes).filter(|a| *a <= self.max)?;
            match self.used.compare_exchange_weak(used, after, Relaxed, Relaxed) {
                Ok(_) => return Some(Reserved { budget: self.clone(), bytes }),
                Err(now) => used = now,
            }
        }
    }

    /// Bytes reserved now.
    pub(crate) fn used(&self) -> usize {
        self.used.load(Relaxed)
    }
}

/// A part of the [`BufferBudget`], given back when dropped.
#[derive(Debug)]
pub(crate) struct Reserved {
    budget: Arc<BufferBudget>,
    bytes: usize,
}

impl Drop for Reserved {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Relaxed);
    }
}

/// A client is at one of its caps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum AtCap {
    #[error("the client has {0} connections open, its cap")]
    Connections(usize),
    #[error("the client has {0} requests in progress, its cap")]
    Requests(usize),
    #[error("the client sends requests faster than its rate")]
    Rate,
}

impl AtCap {
    /// How a request refused for this is counted and answered.
    pub(crate) fn kind(self) -> crate::ErrorKind {
        match self {
            AtCap::Rate => crate::ErrorKind::ClientRate,
            AtCap::Connections(_) | AtCap::Requests(_) => crate::ErrorKind::ClientLimit,
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Connection,
    Request,
}

#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    connections: u32,
    requests: u32,
}

/// Shards of the per-client map: two workers rarely contend for one.
const SHARDS: usize = 16;

/// Connections and requests in progress per client, against their caps
/// (0: no cap). Only clients with something in progress have an entry, so
/// its memory is bounded by the connections the proxy holds.
#[derive(Debug)]
pub(crate) struct PerClient {
    shards: [Mutex<HashMap<IpAddr, Counts>>; SHARDS],
    max_connections: usize,
    max_requests: usize,
}

impl PerClient {
    fn new(max_connections: usize, max_requests: usize) -> PerClient {
        PerClient { shards: std::array::from_fn(|_| Mutex::default()), max_connections, max_requests }
    }

    fn shard(&self, key: &IpAddr) -> &Mutex<HashMap<IpAddr, Counts>> {
        use std::hash::BuildHasher;
        let h = foldhash::fast::FixedState::with_seed(0x7469_6465).hash_one(key);
        &self.shards[(h as usize) % SHARDS]
    }

    fn take(self: &Arc<Self>, ip: IpAddr, kind: Kind) -> Result<ClientHold, AtCap> {
        let key = client_key(ip);
        let mut map = self.shard(&key).lock().unwrap_or_else(|e| e.into_inner());
        let counts = map.entry(key).or_default();
        match kind {
            Kind::Connection if self.max_connections > 0 && counts.connections as usize >= self.max_connections => {
                let n = counts.connections as usize;
                forget_if_empty(&mut map, key);
                return Err(AtCap::Connections(n));
            }
            Kind::Request if self.max_requests > 0 && counts.requests as usize >= self.max_requests => {
                let n = counts.requests as usize;
                forget_if_empty(&mut map, key);
                return Err(AtCap::Requests(n));
            }
            Kind::Connection => counts.connections += 1,
            Kind::Request => counts.requests += 1,
        }
        Ok(ClientHold { clients: self.clone(), key, kind })
    }

    /// Clients with something in progress (entries in the map).
    #[cfg(test)]
    fn tracked(&self) -> usize {
        self.shards.iter().map(|s| s.lock().map_or(0, |m| m.len())).sum()
    }
}

fn forget_if_empty(map: &mut HashMap<IpAddr, Counts>, key: IpAddr) {
    if map.get(&key).is_some_and(|c| c.connections == 0 && c.requests == 0) {
        map.remove(&key);
    }
}

/// A connection or request counted against its client's cap until dropped.
#[derive(Debug)]
pub(crate) struct ClientHold {
    clients: Arc<PerClient>,
    key: IpAddr,
    kind: Kind,
}

impl Drop for ClientHold {
    fn drop(&mut self) {
        let mut map = self.clients.shard(&self.key).lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = map.get_mut(&self.key) {
            match self.kind {
                Kind::Connection => c.connections = c.connections.saturating_sub(1),
                Kind::Request => c.requests = c.requests.saturating_sub(1),
            }
        }
        forget_if_empty(&mut map, self.key);
    }
}

/// The minimum pace of a request body streamed to a backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MinRate {
    /// Bytes per second, on average over each window.
    pub bytes_per_s: u64,
    /// The window.
    pub window: Duration,
}

impl MinRate {
    /// The minimum pace `limits` set, if any.
    pub(crate) fn of(limits: &Limits) -> Option<MinRate> {
        (limits.min_upload_rate > 0 && !limits.upload_rate_window.is_zero())
            .then_some(MinRate { bytes_per_s: limits.min_upload_rate, window: limits.upload_rate_window })
    }

    /// Bytes a window must carry.
    fn per_window(self) -> u64 {
        (u128::from(self.bytes_per_s) * self.window.as_millis() / 1000).try_into().unwrap_or(u64::MAX)
    }
}

/// The body broke its minimum pace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the request body arrived at {got} bytes in {window:?}, under the minimum of {need}")]
pub(crate) struct TooSlow {
    pub got: u64,
    pub need: u64,
    pub window: Duration,
}

/// Checks a streamed body's pace, window by window: each window from the
/// first byte asked for must carry at least the minimum. Pure: the caller
/// says what arrived and when.
#[derive(Debug, Clone)]
pub(crate) struct Pace {
    rate: MinRate,
    /// The current window's start and the bytes it carried; `None` until
    /// the body is first read (a request waiting in the queue is not late).
    window: Option<(Instant, u64)>,
}

impl Pace {
    pub(crate) fn new(rate: MinRate) -> Pace {
        Pace { rate, window: None }
    }

    /// Whether the first window has started.
    pub(crate) fn started(&self) -> bool {
        self.window.is_some()
    }

    /// When the current window ends (the next check), starting the first
    /// window at `now` if none has started.
    pub(crate) fn deadline(&mut self, now: Instant) -> Instant {
        let (start, _) = *self.window.get_or_insert((now, 0));
        start + self.rate.window
    }

    /// `n` bytes arrived at `now`; checks every window that ended by then.
    pub(crate) fn arrived(&mut self, n: usize, now: Instant) -> Result<(), TooSlow> {
        let (_, bytes) = self.window.get_or_insert((now, 0));
        *bytes = bytes.saturating_add(n as u64);
        self.check(now)
    }

    /// Checks the window, if it ended by `now`; a new one starts then.
    pub(crate) fn check(&mut self, now: Instant) -> Result<(), TooSlow> {
        let (start, bytes) = *self.window.get_or_insert((now, 0));
        if now < start + self.rate.window {
            return Ok(());
        }
        let need = self.rate.per_window();
        if bytes < need {
            return Err(TooSlow { got: bytes, need, window: self.rate.window });
        }
        self.window = Some((now, 0));
        Ok(())
    }
}

/// Whether a request's body is a stream whose parts the backend must see
/// as they come (gRPC's streaming calls): never held back to be buffered.
pub(crate) fn is_streaming_protocol(content_type: Option<&[u8]>) -> bool {
    content_type.is_some_and(|ct| ct.len() >= 16 && ct[..16].eq_ignore_ascii_case(b"application/grpc"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_is_shared_and_given_back() {
        let b = Arc::new(BufferBudget::new(100));
        let r1 = b.reserve(60).expect("room");
        assert!(b.reserve(50).is_none(), "over the budget");
        let r2 = b.reserve(40).expect("exactly the rest");
        assert_eq!(b.used(), 100);
        drop(r1);
        assert_eq!(b.used(), 40);
        drop(r2);
        assert_eq!(b.used(), 0);
        assert!(b.reserve(usize::MAX).is_none(), "no overflow");
    }

    #[test]
    fn clients_are_keyed_by_address_and_ipv6_by_64() {
        let v4: IpAddr = "192.0.2.7".parse().unwrap();
        let mapped: IpAddr = "::ffff:192.0.2.7".parse().unwrap();
        assert_eq!(client_key(mapped), v4);
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:bbbb::9".parse().unwrap();
        let c: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(client_key(a), client_key(b));
        assert_ne!(client_key(a), client_key(c));
    }

    #[test]
    fn caps_count_per_client_and_forget_idle_clients() {
        let limits = Limits { max_connections_per_client: 2, max_requests_per_client: 1, ..Limits::default() };
        let adm = Admission::new(&limits);
        let (a, b): (IpAddr, IpAddr) = ("192.0.2.1".parse().unwrap(), "192.0.2.2".parse().unwrap());
        let c1 = adm.connection(a).unwrap();
        let c2 = adm.connection(a).unwrap();
        assert_eq!(adm.connection(a).unwrap_err(), AtCap::Connections(2));
        let other = adm.connection(b).unwrap();
        let r1 = adm.request(a).unwrap();
        assert_eq!(adm.request(a).unwrap_err(), AtCap::Requests(1));
        drop(r1);
        let r2 = adm.request(a).unwrap();
        let clients = adm.clients.clone().unwrap();
        assert_eq!(clients.tracked(), 2);
        drop((c1, c2, r2, other));
        assert_eq!(clients.tracked(), 0, "nothing in progress, nothing kept");
    }

    #[test]
    fn a_client_over_its_rate_is_refused_and_others_are_not() {
        let limits = Limits { max_request_rate_per_client: 2, request_burst_per_client: 3, ..Limits::default() };
        let adm = Admission::new(&limits);
        let (a, b): (IpAddr, IpAddr) = ("192.0.2.1".parse().unwrap(), "192.0.2.2".parse().unwrap());
        for _ in 0..3 {
            assert!(adm.request(a).is_ok(), "within the burst");
        }
        assert_eq!(adm.request(a).unwrap_err(), AtCap::Rate);
        assert_eq!(AtCap::Rate.kind(), crate::ErrorKind::ClientRate);
        assert!(adm.request(b).is_ok(), "another address has its own bucket");
        // One /64 is one client.
        let (v6a, v6b): (IpAddr, IpAddr) = ("2001:db8::1".parse().unwrap(), "2001:db8::2".parse().unwrap());
        for _ in 0..3 {
            assert!(adm.request(v6a).is_ok());
        }
        assert_eq!(adm.request(v6b).unwrap_err(), AtCap::Rate);
    }

    #[tokio::test(start_paused = true)]
    async fn a_refusal_for_the_rate_waits_out_its_tarpit_and_other_refusals_do_not() {
        let limits = Limits {
            max_request_rate_per_client: 1,
            max_requests_per_client: 1,
            request_rate_tarpit: Duration::from_millis(700),
            ..Limits::default()
        };
        let adm = Admission::new(&limits);
        let (a, b): (IpAddr, IpAddr) = ("192.0.2.1".parse().unwrap(), "192.0.2.2".parse().unwrap());
        let _held = adm.admit_request(a).await.expect("the first");
        let t0 = Instant::now();
        assert_eq!(adm.admit_request(a).await.unwrap_err(), crate::ErrorKind::ClientRate);
        assert_eq!(t0.elapsed(), Duration::from_millis(700), "the refusal waited its tarpit");
        // Over the cap on requests in progress (not the rate): at once.
        let caps = Admission::new(&Limits { max_request_rate_per_client: 0, ..limits.clone() });
        let _other = caps.admit_request(b).await.expect("b's first");
        let t1 = Instant::now();
        assert_eq!(caps.admit_request(b).await.unwrap_err(), crate::ErrorKind::ClientLimit);
        assert_eq!(t1.elapsed(), Duration::ZERO);
        // The tarpit is at most the Retry-After.
        let long = Admission::new(&Limits { request_rate_tarpit: Duration::from_secs(9), ..limits });
        assert_eq!(long.tarpit, Duration::from_secs(1));
    }

    #[test]
    fn the_burst_defaults_to_one_seconds_worth() {
        let adm = Admission::new(&Limits { max_request_rate_per_client: 5, ..Limits::default() });
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        assert_eq!((0..10).filter(|_| adm.request(a).is_ok()).count(), 5);
    }

    #[test]
    fn no_caps_no_counting() {
        let adm = Admission::new(&Limits::default());
        assert!(adm.clients.is_none() && adm.rates.is_none());
        assert!(adm.request("192.0.2.1".parse().unwrap()).unwrap().is_none());
    }

    #[test]
    fn a_body_must_keep_its_pace_window_by_window() {
        let rate = MinRate { bytes_per_s: 100, window: Duration::from_secs(10) };
        let t0 = Instant::now();
        let mut pace = Pace::new(rate);
        assert_eq!(pace.deadline(t0), t0 + Duration::from_secs(10));
        // 1,000 bytes in the first window: enough.
        pace.arrived(600, t0 + Duration::from_secs(3)).unwrap();
        pace.arrived(400, t0 + Duration::from_secs(9)).unwrap();
        pace.check(t0 + Duration::from_secs(10)).unwrap();
        // The second window starts at the check; 999 bytes is too few.
        pace.arrived(999, t0 + Duration::from_secs(15)).unwrap();
        let err = pace.check(t0 + Duration::from_secs(20)).unwrap_err();
        assert_eq!((err.got, err.need), (999, 1000));
    }

    #[test]
    fn a_silent_body_fails_at_the_end_of_its_window() {
        let rate = MinRate { bytes_per_s: 1, window: Duration::from_secs(5) };
        let t0 = Instant::now();
        let mut pace = Pace::new(rate);
        let end = pace.deadline(t0);
        pace.check(end - Duration::from_millis(1)).unwrap();
        assert!(pace.check(end).is_err());
    }

    #[test]
    fn streaming_protocols_are_recognised() {
        assert!(is_streaming_protocol(Some(b"application/grpc")));
        assert!(is_streaming_protocol(Some(b"Application/GRPC+proto")));
        assert!(!is_streaming_protocol(Some(b"application/json")));
        assert!(!is_streaming_protocol(None));
    }
}
