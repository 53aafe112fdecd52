//! A service's queue of requests waiting for room under its backends'
//! limits (`max_conns` or a learned limit): fair between clients, first
//! come, first served within one.
//!
//! **Fair between clients.** Each client address (IPv6 by /64: the caller
//! passes the key) has its own line, and clients with requests waiting
//! take turns ([`line`]): one address that sends many requests gets one
//! turn in each round, not the whole queue. When the queue is full, a
//! newcomer whose client holds at least two fewer places than the client
//! holding the most takes that client's newest place: the displaced
//! request gets the answer the newcomer would have had (queue full), and
//! is counted ([`WaitQueue::displaced`]). With one client, this is a plain
//! first-come, first-served queue.
//!
//! **Turns kept.** tokio's `Notify` wakes its waiters in order, but a
//! woken waiter that finds no room (another request took it, or a limit
//! was cut) can only wait again at the back, so under steady pressure the
//! head of the queue keeps moving to the back and the oldest requests wait
//! longest. Here a woken waiter that finds no room goes back to the
//! *front*, keeping its turn, a woken waiter counts as waiting until it
//! settles (so that a newcomer does not take the room meant for it), and a
//! release that finds nobody waiting costs one atomic load.

mod line;

use std::net::{IpAddr, Ipv6Addr};
use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use line::{Handle, Line};

/// The waiting requests of one service, in turns between clients.
#[derive(Debug, Default)]
pub struct WaitQueue {
    /// How many are in `line`; read without the lock by releases.
    len: AtomicUsize,
    /// Waiters woken (taken out of `line`) that have not yet taken room
    /// or gone back in.
    woken: AtomicUsize,
    /// Clients with requests in `line`.
    clients: AtomicUsize,
    /// Requests that lost their place to another client's newcomer.
    displaced: AtomicU64,
    line: Mutex<Line<IpAddr, Arc<Waiter>>>,
}

/// One request's place in a [`WaitQueue`].
#[derive(Debug)]
pub struct Waiter {
    wake: Notify,
    /// The client it is queued for.
    client: IpAddr,
    /// Woken by the queue and not settled yet.
    woken: AtomicBool,
    /// Its place went to another client's request: it is answered as if
    /// the queue had been full.
    displaced: AtomicBool,
    /// Its place while in line ([`Handle::to_bits`]); written under the
    /// queue's lock.
    place: AtomicU64,
    /// Its order of arrival among its client's requests, kept when it goes
    /// back in line.
    seq: AtomicU64,
}

/// Where a newcomer stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Joined {
    /// In line, the next to be woken.
    First,
    /// In line, behind others.
    Behind,
    /// Refused: the queue is full for its client.
    Full,
}

impl Waiter {
    /// A waiter for a request of `client` (its key: the address, IPv6 by
    /// /64; [`Waiter::UNKNOWN_CLIENT`] when there is none).
    pub fn new(client: IpAddr) -> Waiter {
        Waiter {
            wake: Notify::new(),
            client,
            woken: AtomicBool::new(false),
            displaced: AtomicBool::new(false),
            place: AtomicU64::new(Handle::NONE_BITS),
            seq: AtomicU64::new(0),
        }
    }

    /// The key of requests with no client address (all share one line).
    pub const UNKNOWN_CLIENT: IpAddr = IpAddr::V6(Ipv6Addr::UNSPECIFIED);

    /// Resolves once the queue woke this waiter (at once if it already
    /// did), or gave its place to another client ([`Waiter::displaced`]).
    pub async fn woken(&self) {
        self.wake.notified().await;
    }

    /// Whether its place went to another client's request (it will not be
    /// woken for room).
    pub fn displaced(&self) -> bool {
        self.displaced.load(SeqCst)
    }
}

impl WaitQueue {
    /// Requests waiting now.
    pub fn len(&self) -> usize {
        self.len.load(SeqCst)
    }

    /// Whether nobody waits, woken waiters that have not settled included.
    pub fn is_empty(&self) -> bool {
        self.len() == 0 && self.woken.load(SeqCst) == 0
    }

    /// Clients with requests waiting now.
    pub fn clients(&self) -> usize {
        self.clients.load(Relaxed)
    }

    /// Requests that lost their place to another client's newcomer, since
    /// the service was created.
    pub fn displaced(&self) -> u64 {
        self.displaced.load(Relaxed)
    }

    /// Whether `waiter` is the next to be woken.
    pub fn is_front(&self, waiter: &Arc<Waiter>) -> bool {
        let Ok(line) = self.line.lock() else { return false };
        line.front().is_some_and(|h| h.to_bits() == waiter.place.load(Relaxed))
    }

    /// A woken waiter took room, went back in line, or left: it no longer
    /// counts as woken.
    pub fn settle(&self, waiter: &Waiter) {
        if waiter.woken.swap(false, SeqCst) {
            self.woken.fetch_sub(1, SeqCst);
        }
    }

    /// Queues `waiter` behind its client's other requests, unless `max`
    /// already wait; when they do, it may take the newest place of the
    /// client holding the most (see the module's doc).
    pub fn push_back(&self, waiter: &Arc<Waiter>, max: usize) -> Joined {
        let Ok(mut line) = self.line.lock() else { return Joined::Full };
        let joined = match line.push_back(waiter.client, waiter.clone(), max) {
            Ok(joined) => joined,
            Err(_) => return Joined::Full,
        };
        waiter.place.store(joined.handle.to_bits(), Relaxed);
        waiter.seq.store(joined.seq, Relaxed);
        if let Some(out) = &joined.displaced {
            out.place.store(Handle::NONE_BITS, Relaxed);
            out.displaced.store(true, SeqCst);
        }
        self.publish(&line);
        drop(line);
        if let Some(out) = joined.displaced {
            self.displaced.fetch_add(1, Relaxed);
            out.wake.notify_one();
        }
        // Pairs with the fence in `wake_one`: either the releaser sees this
        // waiter, or the caller's next look for room sees the release.
        fence(SeqCst);
        if joined.first {
            Joined::First
        } else {
            Joined::Behind
        }
    }

    /// Puts a woken waiter that found no room back in line as the next to
    /// be woken: it keeps its turn (and its order among its client's
    /// requests). A displaced waiter stays out.
    pub fn push_front(&self, waiter: &Arc<Waiter>) {
        self.settle(waiter);
        if waiter.displaced() {
            return;
        }
        if let Ok(mut line) = self.line.lock() {
            if let Some(h) = line.requeue(waiter.client, waiter.clone(), waiter.seq.load(Relaxed)) {
                waiter.place.store(h.to_bits(), Relaxed);
            }
            self.publish(&line);
        }
        fence(SeqCst);
    }

    /// Takes `waiter` out of the queue: `Some(first)` (whether it was the
    /// next to be woken) if it was in line, `None` if not (woken, or
    /// displaced, already).
    pub fn remove(&self, waiter: &Arc<Waiter>) -> Option<bool> {
        let mut line = self.line.lock().ok()?;
        let handle = Handle::from_bits(waiter.place.swap(Handle::NONE_BITS, Relaxed))?;
        let (_, first) = line.remove(handle)?;
        self.publish(&line);
        Some(first)
    }

    /// `waiter`'s request is done waiting (it took a backend's room when
    /// `took_room`, timed out or went away): it leaves the queue, and
    /// passes the turn on when it took room, was the next to be woken, or
    /// had been woken, so that whoever is first always re-examines the
    /// backends.
    pub fn leave(&self, waiter: &Arc<Waiter>, took_room: bool) {
        let place = self.remove(waiter);
        self.settle(waiter);
        let pass_on = match place {
            Some(first) => first,
            None => !waiter.displaced(),
        };
        if took_room || pass_on {
            self.wake_one();
        }
    }

    /// Wakes the next request in turn, if any: called when room may have
    /// been made (a request to a limited backend finished).
    pub fn wake_one(&self) {
        // Pairs with the fence in `push_back`: the room freed before this
        // call is seen by a waiter that this load misses.
        fence(SeqCst);
        if self.len.load(SeqCst) == 0 {
            return;
        }
        let next = match self.line.lock() {
            Ok(mut line) => {
                let w = line.pop();
                self.publish(&line);
                if let Some(w) = &w {
                    w.place.store(Handle::NONE_BITS, Relaxed);
                    w.woken.store(true, SeqCst);
                    self.woken.fetch_add(1, SeqCst);
                }
                w
            }
            Err(_) => None,
        };
        if let Some(w) = next {
            w.wake.notify_one();
        }
    }

    /// Publishes the line's counts for lock-free readers (under its lock).
    fn publish(&self, line: &Line<IpAddr, Arc<Waiter>>) {
        self.len.store(line.len(), SeqCst);
        self.clients.store(line.clients(), Relaxed);
    }
}

/// The key a client is counted under, by the wait queue's fairness and by
/// the proxy's per-client caps: its address, an IPv4-mapped IPv6 address
/// as IPv4, and IPv6 by its /64 (one subscriber's usual share).
pub fn client_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & !((1u128 << 64) - 1))),
        },
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;

    use super::*;

    fn waiters(client: &str, n: usize) -> Vec<Arc<Waiter>> {
        let ip: IpAddr = client.parse().unwrap();
        (0..n).map(|_| Arc::new(Waiter::new(ip))).collect()
    }

    /// Which of `ws` have been woken (a woken waiter's future is ready).
    fn woken(ws: &[Arc<Waiter>]) -> Vec<bool> {
        ws.iter()
            .map(|w| {
                let fut = std::pin::pin!(w.woken());
                let waker = std::task::Waker::noop();
                fut.poll(&mut std::task::Context::from_waker(waker)).is_ready()
            })
            .collect()
    }

    #[test]
    fn wakes_in_arrival_order_and_a_requeued_waiter_keeps_its_turn() {
        let q = WaitQueue::default();
        let ws = waiters("192.0.2.1", 3);
        for w in &ws {
            assert_ne!(q.push_back(w, 10), Joined::Full);
        }
        assert_eq!((q.len(), q.clients()), (3, 1));
        q.wake_one();
        assert_eq!(woken(&ws), [true, false, false]);
        // The first found no room: it goes back to the front, not behind
        // the others, so the next release wakes it again.
        assert!(!q.is_empty(), "the woken one still counts until it settles");
        q.push_front(&ws[0]);
        assert!(q.is_front(&ws[0]));
        q.wake_one();
        assert_eq!(woken(&ws), [true, false, false]);
        q.wake_one();
        q.wake_one();
        assert_eq!(woken(&ws), [false, true, true]);
        assert_eq!((q.len(), q.clients()), (0, 0));
        for w in &ws {
            q.settle(w);
        }
        assert!(q.is_empty());
        q.wake_one(); // nobody waits: nothing happens
    }

    #[test]
    fn the_queue_is_bounded_and_a_leaver_gives_up_its_place() {
        let q = WaitQueue::default();
        let ws = waiters("192.0.2.1", 3);
        assert_eq!(q.push_back(&ws[0], 2), Joined::First);
        assert_eq!(q.push_back(&ws[1], 2), Joined::Behind);
        assert_eq!(q.push_back(&ws[2], 2), Joined::Full, "full, one client: nobody to displace");
        assert!(q.is_front(&ws[0]));
        assert_eq!(q.remove(&ws[0]), Some(true));
        assert_eq!(q.remove(&ws[0]), None, "already gone");
        assert!(q.is_front(&ws[1]));
        q.wake_one();
        assert_eq!(woken(&ws), [false, true, false]);
        assert_eq!(q.remove(&ws[1]), None, "woken: out of the line");
        assert_eq!(q.len(), 0);
    }

    #[test]
    fn a_wake_before_the_waiter_listens_is_not_lost() {
        let q = WaitQueue::default();
        let w = Arc::new(Waiter::new(Waiter::UNKNOWN_CLIENT));
        assert_eq!(q.push_back(&w, 1), Joined::First);
        q.wake_one();
        assert_eq!(woken(std::slice::from_ref(&w)), [true]);
    }

    #[test]
    fn a_flooding_client_cannot_keep_another_out_or_behind_it() {
        let q = WaitQueue::default();
        let flood = waiters("192.0.2.9", 4);
        let polite = waiters("192.0.2.1", 2);
        for w in &flood {
            assert_ne!(q.push_back(w, 4), Joined::Full);
        }
        // Full: the polite client's request takes the flood's newest place;
        // the displaced request is told (it resolves, marked displaced).
        assert_eq!(q.push_back(&polite[0], 4), Joined::Behind);
        assert_eq!(woken(&flood), [false, false, false, true]);
        assert!(flood[3].displaced() && !flood[2].displaced());
        assert_eq!((q.displaced(), q.len(), q.clients()), (1, 4, 2));
        // Leaving, the displaced one passes no turn on and is not counted
        // as woken; put back, it stays out.
        q.push_front(&flood[3]);
        q.leave(&flood[3], false);
        assert_eq!(woken(&polite), [false, false]);
        assert_eq!(q.len(), 4);
        // Turns: the flood's oldest, then the polite one.
        q.wake_one();
        assert_eq!(woken(&flood[..3]), [true, false, false]);
        q.wake_one();
        assert_eq!(woken(&polite), [true, false]);
        // The woken polite request took room: leaving passes the turn on.
        q.leave(&polite[0], true);
        assert_eq!(woken(&flood[..3]), [false, true, false]);
        // A waiter that times out in line leaves without waking anyone.
        q.leave(&flood[2], false);
        assert_eq!(woken(&flood), [false, false, false, false]);
        assert_eq!((q.len(), q.clients()), (0, 0));
        q.settle(&flood[0]);
        q.settle(&flood[1]);
        assert!(q.is_empty());
    }

    #[test]
    fn the_first_in_line_leaving_passes_the_turn_on() {
        let q = WaitQueue::default();
        let a = waiters("192.0.2.1", 1);
        let b = waiters("2001:db8::1", 1);
        q.push_back(&a[0], 10);
        q.push_back(&b[0], 10);
        q.leave(&a[0], false);
        assert_eq!(woken(&b), [true]);
    }
}
