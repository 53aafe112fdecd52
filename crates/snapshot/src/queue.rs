//! A service's queue of requests waiting for room under its backends'
//! limits (`max_conns` or a learned limit): first come, first served.
//!
//! tokio's `Notify` wakes its waiters in order, but a woken waiter that
//! finds no room (another request took it, or a limit was cut) can only
//! wait again at the back, so under steady pressure the head of the queue
//! keeps moving to the back and the oldest requests wait longest. Here a
//! woken waiter that finds no room goes back to the *front*, keeping its
//! turn, a woken waiter counts as waiting until it settles (so that a
//! newcomer does not take the room meant for it), and a release that
//! finds nobody waiting costs one atomic load.

use std::collections::VecDeque;
use std::sync::atomic::{fence, AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

/// The waiting requests of one service, oldest first.
#[derive(Debug, Default)]
pub struct WaitQueue {
    /// How many are in `waiters`; read without the lock by releases.
    len: AtomicUsize,
    /// Waiters woken (taken out of `waiters`) that have not yet taken room
    /// or gone back in.
    woken: AtomicUsize,
    waiters: Mutex<VecDeque<Arc<Waiter>>>,
}

/// One request's place in a [`WaitQueue`].
#[derive(Debug, Default)]
pub struct Waiter {
    wake: Notify,
    /// Woken by the queue and not settled yet.
    woken: AtomicBool,
}

impl Waiter {
    /// Resolves once the queue woke this waiter (at once if it already did).
    pub async fn woken(&self) {
        self.wake.notified().await;
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

    /// Whether `waiter` is first in line.
    pub fn is_front(&self, waiter: &Arc<Waiter>) -> bool {
        self.waiters.lock().is_ok_and(|q| q.front().is_some_and(|w| Arc::ptr_eq(w, waiter)))
    }

    /// A woken waiter took room, went back in line, or left: it no longer
    /// counts as woken.
    pub fn settle(&self, waiter: &Waiter) {
        if waiter.woken.swap(false, SeqCst) {
            self.woken.fetch_sub(1, SeqCst);
        }
    }

    /// Queues `waiter` at the back, unless `max` already wait; answers its
    /// place in line (1: first).
    pub fn push_back(&self, waiter: &Arc<Waiter>, max: usize) -> Option<usize> {
        let Ok(mut q) = self.waiters.lock() else { return None };
        if q.len() >= max {
            return None;
        }
        q.push_back(waiter.clone());
        let place = q.len();
        self.len.store(place, SeqCst);
        drop(q);
        // Pairs with the fence in `wake_one`: either the releaser sees this
        // waiter, or the caller's next look for room sees the release.
        fence(SeqCst);
        Some(place)
    }

    /// Puts a woken waiter that found no room back at the front: it keeps
    /// its turn.
    pub fn push_front(&self, waiter: &Arc<Waiter>) {
        self.settle(waiter);
        if let Ok(mut q) = self.waiters.lock() {
            q.push_front(waiter.clone());
            self.len.store(q.len(), SeqCst);
        }
        fence(SeqCst);
    }

    /// Takes `waiter` out of the queue; its place (0: first) if it was in
    /// it, `None` if not (the queue had woken it already).
    pub fn remove(&self, waiter: &Arc<Waiter>) -> Option<usize> {
        let mut q = self.waiters.lock().ok()?;
        // Woken (marked under this lock): out of the line already, no
        // need to look through it.
        if waiter.woken.load(SeqCst) {
            return None;
        }
        let i = q.iter().position(|w| Arc::ptr_eq(w, waiter))?;
        q.remove(i);
        self.len.store(q.len(), SeqCst);
        Some(i)
    }

    /// Wakes the request that has waited longest, if any: called when room
    /// may have been made (a request to a limited backend finished).
    pub fn wake_one(&self) {
        // Pairs with the fence in `push_back`: the room freed before this
        // call is seen by a waiter that this load misses.
        fence(SeqCst);
        if self.len.load(SeqCst) == 0 {
            return;
        }
        let front = match self.waiters.lock() {
            Ok(mut q) => {
                let w = q.pop_front();
                self.len.store(q.len(), SeqCst);
                if let Some(w) = &w {
                    w.woken.store(true, SeqCst);
                    self.woken.fetch_add(1, SeqCst);
                }
                w
            }
            Err(_) => None,
        };
        if let Some(w) = front {
            w.wake.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waiters(n: usize) -> Vec<Arc<Waiter>> {
        (0..n).map(|_| Arc::new(Waiter::default())).collect()
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

    use std::future::Future;

    #[test]
    fn wakes_in_arrival_order_and_a_requeued_waiter_keeps_its_turn() {
        let q = WaitQueue::default();
        let ws = waiters(3);
        for w in &ws {
            assert!(q.push_back(w, 10).is_some());
        }
        assert_eq!(q.len(), 3);
        q.wake_one();
        assert_eq!(woken(&ws), [true, false, false]);
        // The first found no room: it goes back to the front, not behind
        // the others, so the next release wakes it again.
        assert!(!q.is_empty(), "the woken one still counts until it settles");
        q.push_front(&ws[0]);
        q.wake_one();
        assert_eq!(woken(&ws), [true, false, false]);
        q.wake_one();
        q.wake_one();
        assert_eq!(woken(&ws), [false, true, true]);
        assert_eq!(q.len(), 0);
        for w in &ws {
            q.settle(w);
        }
        assert!(q.is_empty());
        q.wake_one(); // nobody waits: nothing happens
    }

    #[test]
    fn the_queue_is_bounded_and_a_leaver_gives_up_its_place() {
        let q = WaitQueue::default();
        let ws = waiters(3);
        assert_eq!(q.push_back(&ws[0], 2), Some(1));
        assert_eq!(q.push_back(&ws[1], 2), Some(2));
        assert_eq!(q.push_back(&ws[2], 2), None, "full");
        assert!(q.is_front(&ws[0]));
        assert_eq!(q.remove(&ws[0]), Some(0));
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
        let w = Arc::new(Waiter::default());
        assert_eq!(q.push_back(&w, 1), Some(1));
        q.wake_one();
        assert_eq!(woken(std::slice::from_ref(&w)), [true]);
    }
}
