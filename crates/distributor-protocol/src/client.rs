//! The client a proxy worker uses to ask a distributor for a backend.
//!
//! All queries of one client share one UDP socket per kind of target (IPv4
//! or IPv6, loopback or not), bound lazily on first use. Each socket has one
//! background task that reads answers and hands each to the query waiting
//! for its id through a oneshot channel; answers for ids nobody waits for
//! (late answers to queries that timed out) are dropped. A query removes its
//! own entry when it ends for any reason, including cancellation.

use std::collections::HashMap;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::net::UdpSocket;
use tokio::sync::{oneshot, OnceCell};
use tokio::task::AbortHandle;

use crate::protocol::{decode_answer, encode_query, Query, MAX_DATAGRAM};

/// Asks distributors which backend should serve a request.
///
/// Create one per proxy worker and share it by reference among that worker's
/// requests. Sockets and their receive tasks are created on the runtime of
/// the first query that needs them and end when the client is dropped.
#[derive(Debug)]
pub struct DistributorClient {
    /// Indexed by [`slot_index`]: IPv4 loopback, IPv4, IPv6 loopback, IPv6.
    slots: [OnceCell<Slot>; 4],
    next_id: AtomicU64,
    counters: Arc<Counters>,
}

/// Totals since a client was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClientStats {
    /// Datagrams sent (each try counts).
    pub sent: u64,
    /// Answers naming a backend.
    pub answers: u64,
    /// Answers carrying an error (the query then fails without more tries).
    pub error_answers: u64,
    /// Tries that timed out.
    pub timeouts: u64,
    /// Datagrams received that matched no waiting query: late answers to
    /// timed-out tries, answers from the wrong address, or malformed ones.
    pub stale: u64,
    /// Failures to bind or send (counted as failed tries, without waiting).
    pub io_errors: u64,
}

#[derive(Debug, Default)]
struct Counters {
    sent: AtomicU64,
    answers: AtomicU64,
    error_answers: AtomicU64,
    timeouts: AtomicU64,
    stale: AtomicU64,
    io_errors: AtomicU64,
}

/// One socket and the task reading its answers.
#[derive(Debug)]
struct Slot {
    shared: Arc<Shared>,
    receiver: AbortHandle,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.receiver.abort();
    }
}

#[derive(Debug)]
struct Shared {
    socket: UdpSocket,
    pending: Mutex<HashMap<u64, Waiter>>,
    counters: Arc<Counters>,
}

/// A query waiting for its answer.
#[derive(Debug)]
struct Waiter {
    /// Only the queried address may answer.
    from: SocketAddr,
    /// `Some(backend)`, or `None` for an error answer.
    tx: oneshot::Sender<Option<SocketAddr>>,
}

impl Shared {
    fn pending(&self) -> MutexGuard<'_, HashMap<u64, Waiter>> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Removes a query's map entry when the try ends, however it ends.
struct Registration<'a> {
    shared: &'a Shared,
    id: u64,
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        self.shared.pending().remove(&self.id);
    }
}

fn slot_index(target: SocketAddr) -> usize {
    usize::from(target.is_ipv6()) * 2 + usize::from(!target.ip().is_loopback())
}

fn bind_address(index: usize) -> SocketAddr {
    match index {
        0 => (Ipv4Addr::LOCALHOST, 0).into(),
        1 => (Ipv4Addr::UNSPECIFIED, 0).into(),
        2 => (Ipv6Addr::LOCALHOST, 0).into(),
        _ => (Ipv6Addr::UNSPECIFIED, 0).into(),
    }
}

impl Default for DistributorClient {
    fn default() -> Self {
        Self::new()
    }
}

impl DistributorClient {
    /// A client with no socket yet (bound on first query). Query ids start at
    /// a random value below 2^52 (exact in any JSON parser) and count up.
    pub fn new() -> Self {
        DistributorClient {
            slots: Default::default(),
            next_id: AtomicU64::new(fastrand::u64(..1 << 52)),
            counters: Arc::default(),
        }
    }

    /// Asks the distributor at `target` which backend should serve `q`.
    ///
    /// Sends the query and waits up to `timeout` for the answer with its id;
    /// on no answer, sends it again with a new id, up to `tries` datagrams in
    /// all (at least one). So this returns within about `tries * timeout`.
    /// `None` when no try was answered, when the distributor answered with
    /// an error, or when the query cannot be encoded: the caller falls back.
    pub async fn query(&self, target: SocketAddr, q: &Query<'_>, timeout: Duration, tries: u32) -> Option<SocketAddr> {
        let shared = match self.slot(target).await {
            Ok(slot) => &slot.shared,
            Err(e) => {
                self.counters.io_errors.fetch_add(1, Relaxed);
                tracing::debug!(%target, error = %e, "distributor client: cannot bind a UDP socket");
                return None;
            }
        };
        let mut buf = Vec::with_capacity(512);
        for _ in 0..tries.max(1) {
            let id = self.next_id.fetch_add(1, Relaxed);
            if let Err(e) = encode_query(id, q, &mut buf) {
                tracing::debug!(error = %e, "distributor client: query not sent");
                return None;
            }
            let (tx, rx) = oneshot::channel();
            // Registered before sending, so that even an immediate answer finds it.
            shared.pending().insert(id, Waiter { from: target, tx });
            let _registration = Registration { shared, id };
            if let Err(e) = shared.socket.send_to(&buf, target).await {
                self.counters.io_errors.fetch_add(1, Relaxed);
                tracing::debug!(%target, error = %e, "distributor client: send failed");
                continue;
            }
            self.counters.sent.fetch_add(1, Relaxed);
            match tokio::time::timeout(timeout, rx).await {
                Ok(Ok(Some(backend))) => {
                    self.counters.answers.fetch_add(1, Relaxed);
                    return Some(backend);
                }
                Ok(Ok(None)) => {
                    self.counters.error_answers.fetch_add(1, Relaxed);
                    return None;
                }
                // Timed out, or the receive task is gone (client dropping).
                Ok(Err(_)) | Err(_) => {
                    self.counters.timeouts.fetch_add(1, Relaxed);
                }
            }
        }
        None
    }

    /// Totals since the client was created.
    pub fn stats(&self) -> ClientStats {
        let c = &self.counters;
        ClientStats {
            sent: c.sent.load(Relaxed),
            answers: c.answers.load(Relaxed),
            error_answers: c.error_answers.load(Relaxed),
            timeouts: c.timeouts.load(Relaxed),
            stale: c.stale.load(Relaxed),
            io_errors: c.io_errors.load(Relaxed),
        }
    }

    async fn slot(&self, target: SocketAddr) -> std::io::Result<&Slot> {
        let index = slot_index(target);
        self.slots[index]
            .get_or_try_init(|| async {
                let socket = UdpSocket::bind(bind_address(index)).await?;
                let shared =
                    Arc::new(Shared { socket, pending: Mutex::new(HashMap::new()), counters: self.counters.clone() });
                let receiver = tokio::spawn(receive(shared.clone())).abort_handle();
                Ok(Slot { shared, receiver })
            })
            .await
    }

    /// Queries waiting for an answer, over all sockets.
    #[cfg(test)]
    fn pending_len(&self) -> usize {
        self.slots.iter().filter_map(OnceCell::get).map(|s| s.shared.pending().len()).sum()
    }
}

/// Reads answers and dispatches each to the query waiting for its id.
async fn receive(shared: Arc<Shared>) {
    let mut buf = vec![0u8; MAX_DATAGRAM + 1];
    let mut errors = 0u32;
    loop {
        let (n, from) = match shared.socket.recv_from(&mut buf).await {
            Ok(received) => received,
            Err(e) => {
                // Transient on UDP (e.g. an ICMP error reported late): keep
                // reading, but never spin on an error that persists.
                tracing::debug!(error = %e, "distributor client: receive failed");
                errors = errors.saturating_add(1);
                if errors > 16 {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                } else {
                    tokio::task::yield_now().await;
                }
                continue;
            }
        };
        errors = 0;
        let delivered = n <= MAX_DATAGRAM
            && decode_answer(&buf[..n]).is_ok_and(|answer| {
                let waiter = {
                    let mut pending = shared.pending();
                    match pending.get(&answer.id) {
                        Some(w) if w.from == from => pending.remove(&answer.id),
                        _ => None,
                    }
                };
                // The receiver may have just timed out: then the answer is stale.
                waiter.is_some_and(|w| w.tx.send(answer.result.ok()).is_ok())
            });
        if !delivered {
            shared.counters.stale.fetch_add(1, Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{decode_query, encode_answer};
    use http::HeaderMap;
    use std::time::Instant;

    fn addr(s: &str) -> SocketAddr {
        s.parse().expect("addr")
    }

    async fn test_server() -> (UdpSocket, SocketAddr) {
        let s = UdpSocket::bind("127.0.0.1:0").await.expect("bind");
        let a = s.local_addr().expect("addr");
        (s, a)
    }

    /// Receives one query; returns its id and path and who sent it.
    async fn recv_query(s: &UdpSocket) -> (u64, String, SocketAddr) {
        let mut buf = vec![0u8; MAX_DATAGRAM + 1];
        let (n, from) = s.recv_from(&mut buf).await.expect("recv");
        let q = decode_query(&buf[..n]).expect("a valid query");
        (q.id, q.path.to_string(), from)
    }

    async fn answer(s: &UdpSocket, to: SocketAddr, id: u64, backend: SocketAddr) {
        let mut out = Vec::new();
        encode_answer(id, Ok(backend), &mut out);
        s.send_to(&out, to).await.expect("send");
    }

    fn query<'a>(headers: &'a HeaderMap, path: &'a str) -> Query<'a> {
        Query { policy: "round_robin", client: addr("10.0.0.1:4000"), method: "GET", path, host: None, headers }
    }

    #[tokio::test]
    async fn answered_query_returns_the_backend() {
        let (server, target) = test_server().await;
        let client = DistributorClient::new();
        let headers = HeaderMap::new();
        let q = query(&headers, "/a");
        let serve = async {
            let (id, path, from) = recv_query(&server).await;
            assert_eq!(path, "/a");
            assert!(from.ip().is_loopback(), "loopback targets use a loopback socket");
            answer(&server, from, id, addr("127.0.0.1:9001")).await;
        };
        let (got, ()) = tokio::join!(client.query(target, &q, Duration::from_secs(5), 3), serve);
        assert_eq!(got, Some(addr("127.0.0.1:9001")));
        assert_eq!(client.pending_len(), 0);
        let st = client.stats();
        assert_eq!((st.sent, st.answers, st.timeouts), (1, 1, 0));
    }

    #[tokio::test]
    async fn error_answer_fails_at_once() {
        let (server, target) = test_server().await;
        let client = DistributorClient::new();
        let headers = HeaderMap::new();
        let q = query(&headers, "/");
        let serve = async {
            let (id, _, from) = recv_query(&server).await;
            let mut out = Vec::new();
            encode_answer(id, Err("unknown policy"), &mut out);
            server.send_to(&out, from).await.expect("send");
        };
        let (got, ()) = tokio::join!(client.query(target, &q, Duration::from_secs(5), 3), serve);
        assert_eq!(got, None);
        assert_eq!((client.stats().sent, client.stats().error_answers), (1, 1));
    }

    #[tokio::test]
    async fn no_answer_gives_up_after_all_tries_within_the_bound() {
        let (server, target) = test_server().await;
        let client = DistributorClient::new();
        let headers = HeaderMap::new();
        let q = query(&headers, "/");
        let timeout = Duration::from_millis(40);
        let start = Instant::now();
        let got = client.query(target, &q, timeout, 3).await;
        let elapsed = start.elapsed();
        assert_eq!(got, None);
        assert!(elapsed >= timeout * 3, "{elapsed:?}");
        assert!(elapsed < timeout * 3 + Duration::from_secs(2), "{elapsed:?}");
        // Three datagrams, three distinct ids, nothing left in the map.
        let mut ids = Vec::new();
        for _ in 0..3 {
            ids.push(recv_query(&server).await.0);
        }
        ids.dedup();
        assert_eq!(ids.len(), 3);
        assert_eq!(client.pending_len(), 0);
        assert_eq!((client.stats().sent, client.stats().timeouts), (3, 3));
    }

    #[tokio::test]
    async fn late_answer_to_an_old_id_is_ignored() {
        let (server, target) = test_server().await;
        let client = DistributorClient::new();
        let headers = HeaderMap::new();
        let q = query(&headers, "/");
        let serve = async {
            let (first, _, from) = recv_query(&server).await; // let it time out
            let (second, _, _) = recv_query(&server).await;
            answer(&server, from, first, addr("127.0.0.1:1111")).await; // stale
            answer(&server, from, second, addr("127.0.0.1:2222")).await;
        };
        // A second a try: the first runs out, the second must not even on a
        // busy machine.
        let (got, ()) = tokio::join!(client.query(target, &q, Duration::from_secs(1), 3), serve);
        assert_eq!(got, Some(addr("127.0.0.1:2222")));
        let st = client.stats();
        assert_eq!((st.sent, st.timeouts, st.answers), (2, 1, 1));
        // The stale answer may still be in flight when the good one arrives
        // (both were sent back to back); give it a moment.
        for _ in 0..100 {
            if client.stats().stale == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(client.stats().stale, 1);
        assert_eq!(client.pending_len(), 0);
    }

    #[tokio::test]
    async fn answers_from_another_address_are_ignored() {
        let (server, target) = test_server().await;
        let (intruder, _) = test_server().await;
        let client = DistributorClient::new();
        let headers = HeaderMap::new();
        let q = query(&headers, "/");
        let serve = async {
            let (id, _, from) = recv_query(&server).await;
            answer(&intruder, from, id, addr("127.0.0.1:6666")).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
            answer(&server, from, id, addr("127.0.0.1:7777")).await;
        };
        let (got, ()) = tokio::join!(client.query(target, &q, Duration::from_secs(5), 1), serve);
        assert_eq!(got, Some(addr("127.0.0.1:7777")));
        assert_eq!(client.stats().stale, 1);
    }

    #[tokio::test]
    async fn concurrent_queries_each_get_their_own_answer() {
        const N: usize = 100;
        let (server, target) = test_server().await;
        let client = Arc::new(DistributorClient::new());
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..N {
            let client = client.clone();
            tasks.spawn(async move {
                let headers = HeaderMap::new();
                let path = format!("/{i}");
                let q = query(&headers, &path);
                (i, client.query(target, &q, Duration::from_secs(10), 1).await)
            });
        }
        // Collect every query first, then answer in reverse order: each answer
        // names a backend derived from the query's own path.
        let mut queries = Vec::new();
        for _ in 0..N {
            queries.push(recv_query(&server).await);
        }
        for (id, path, from) in queries.into_iter().rev() {
            let i: u16 = path[1..].parse().expect("index");
            answer(&server, from, id, SocketAddr::from(([127, 0, 0, 1], 10_000 + i))).await;
        }
        let mut seen = 0;
        while let Some(done) = tasks.join_next().await {
            let (i, got) = done.expect("task");
            assert_eq!(got, Some(SocketAddr::from(([127, 0, 0, 1], 10_000 + i as u16))), "query {i}");
            seen += 1;
        }
        assert_eq!(seen, N);
        assert_eq!(client.pending_len(), 0);
        assert_eq!(client.stats().answers, N as u64);
    }

    #[tokio::test]
    async fn a_cancelled_query_leaves_no_entry() {
        let (_server, target) = test_server().await;
        let client = DistributorClient::new();
        let headers = HeaderMap::new();
        let q = query(&headers, "/");
        let cancelled =
            tokio::time::timeout(Duration::from_millis(30), client.query(target, &q, Duration::from_secs(60), 3)).await;
        assert!(cancelled.is_err());
        assert_eq!(client.pending_len(), 0);
    }

    #[test]
    fn socket_kinds_follow_the_target() {
        assert_eq!(slot_index(addr("127.0.0.1:1")), 0);
        assert_eq!(slot_index(addr("10.1.2.3:1")), 1);
        assert_eq!(slot_index(addr("[::1]:1")), 2);
        assert_eq!(slot_index(addr("[2001:db8::1]:1")), 3);
        assert!(bind_address(0).ip().is_loopback() && bind_address(1).ip().is_unspecified());
    }
}
