//! Slot and queue admission: the emulator's capacity model.
//!
//! A backend has `slots` concurrent service slots (0 means unlimited) and a
//! FIFO queue of at most `max_queue` waiting requests. A request that finds no
//! free slot and a full queue is rejected at once. The slot count can change at
//! runtime; shrinking it lets busy requests finish and simply stops handing out
//! slots until the busy count is below the new limit.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::oneshot;

/// The request was rejected because the wait queue is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueFull;

/// A point-in-time view of the admission state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Load {
    /// Configured slot count (0 = unlimited).
    pub slots: usize,
    /// Slots currently held by requests in service.
    pub busy: usize,
    /// Requests waiting for a slot.
    pub queued: usize,
}

impl Load {
    /// Utilisation in `0..=1`: busy / slots, or busy / 100 when unlimited.
    pub fn utilization(&self) -> f64 {
        let capacity = if self.slots == 0 { 100 } else { self.slots };
        (self.busy as f64 / capacity as f64).min(1.0)
    }
}

/// Admission controller shared by all connections.
#[derive(Debug)]
pub struct Admission {
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    slots: usize,
    max_queue: usize,
    busy: usize,
    next_id: u64,
    waiters: VecDeque<Waiter>,
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    grant: oneshot::Sender<()>,
}

/// Outcome of the synchronous part of [`Admission::acquire`].
enum Entry {
    Granted,
    Full,
    Wait(u64, oneshot::Receiver<()>),
}

impl Inner {
    fn has_free(&self) -> bool {
        self.slots == 0 || self.busy < self.slots
    }

    /// Hands free slots to waiters in FIFO order.
    fn dispatch(&mut self) {
        while self.has_free() {
            let Some(waiter) = self.waiters.pop_front() else {
                break;
            };
            self.busy += 1;
            if waiter.grant.send(()).is_err() {
                self.busy -= 1;
            }
        }
    }

    fn release(&mut self) {
        self.busy = self.busy.saturating_sub(1);
        self.dispatch();
    }

    /// Removes a waiter; returns false if it was already granted a slot.
    fn cancel(&mut self, id: u64) -> bool {
        match self.waiters.iter().position(|w| w.id == id) {
            Some(pos) => {
                self.waiters.remove(pos);
                true
            }
            None => false,
        }
    }

    fn enter(&mut self) -> Entry {
        if self.has_free() && self.waiters.is_empty() {
            self.busy += 1;
            return Entry::Granted;
        }
        if self.waiters.len() >= self.max_queue {
            return Entry::Full;
        }
        let (grant, rx) = oneshot::channel();
        let id = self.next_id;
        self.next_id += 1;
        self.waiters.push_back(Waiter { id, grant });
        Entry::Wait(id, rx)
    }
}

impl Admission {
    /// Creates a controller with `slots` slots (0 = unlimited) and a queue of `max_queue`.
    pub fn new(slots: usize, max_queue: usize) -> Arc<Self> {
        Arc::new(Self { inner: Mutex::new(Inner { slots, max_queue, busy: 0, next_id: 0, waiters: VecDeque::new() }) })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits for a slot, or fails at once if none is free and the queue is full.
    ///
    /// Cancel-safe: dropping the future gives up the queue place (or the slot,
    /// if it was granted in the meantime).
    pub async fn acquire(self: &Arc<Self>) -> Result<Slot, QueueFull> {
        let entry = self.lock().enter();
        let (id, rx) = match entry {
            Entry::Granted => return Ok(Slot(Arc::clone(self))),
            Entry::Full => return Err(QueueFull),
            Entry::Wait(id, rx) => (id, rx),
        };
        let mut guard = WaitGuard { admission: self, id, armed: true };
        let granted = rx.await.is_ok();
        guard.armed = false;
        if granted {
            Ok(Slot(Arc::clone(self)))
        } else {
            Err(QueueFull)
        }
    }

    /// Changes the slot count (0 = unlimited), waking waiters if slots were added.
    pub fn set_slots(&self, slots: usize) {
        let mut inner = self.lock();
        inner.slots = slots;
        inner.dispatch();
    }

    /// Current slot count, busy slots and queue length.
    pub fn load(&self) -> Load {
        let inner = self.lock();
        Load { slots: inner.slots, busy: inner.busy, queued: inner.waiters.len() }
    }
}

/// A held service slot; dropping it frees the slot for the next waiter.
#[derive(Debug)]
pub struct Slot(Arc<Admission>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.lock().release();
    }
}

/// Cleans up a queue place when an `acquire` future is dropped mid-wait.
struct WaitGuard<'a> {
    admission: &'a Admission,
    id: u64,
    armed: bool,
}

impl Drop for WaitGuard<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut inner = self.admission.lock();
        if !inner.cancel(self.id) {
            // A slot was granted after we stopped listening: give it back.
            inner.release();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Poll};

    /// Polls a future once without a runtime-driven wakeup.
    fn poll_once<F: Future>(fut: std::pin::Pin<&mut F>) -> Poll<F::Output> {
        let waker = std::task::Waker::noop();
        fut.poll(&mut Context::from_waker(waker))
    }

    fn load(slots: usize, busy: usize, queued: usize) -> Load {
        Load { slots, busy, queued }
    }

    #[tokio::test]
    async fn unlimited_slots_always_admit() {
        let adm = Admission::new(0, 0);
        let held: Vec<Slot> = futures_all(&adm, 200).await;
        assert_eq!(adm.load(), load(0, 200, 0));
        assert!((adm.load().utilization() - 1.0).abs() < f64::EPSILON);
        drop(held);
        assert_eq!(adm.load(), load(0, 0, 0));
    }

    async fn futures_all(adm: &Arc<Admission>, n: usize) -> Vec<Slot> {
        let mut out = Vec::new();
        for _ in 0..n {
            out.push(adm.acquire().await.expect("admitted"));
        }
        out
    }

    #[tokio::test]
    async fn full_queue_rejects_and_release_hands_over_fifo() {
        let adm = Admission::new(1, 1);
        let first = adm.acquire().await.expect("first admitted");
        let mut second = pin!(adm.acquire());
        assert!(poll_once(second.as_mut()).is_pending());
        assert_eq!(adm.load(), load(1, 1, 1));
        assert_eq!(adm.acquire().await.err(), Some(QueueFull));
        drop(first);
        assert_eq!(adm.load(), load(1, 1, 0));
        let second = second.await.expect("second admitted");
        drop(second);
        assert_eq!(adm.load(), load(1, 0, 0));
    }

    #[tokio::test]
    async fn zero_queue_rejects_when_busy() {
        let adm = Admission::new(1, 0);
        let _held = adm.acquire().await.expect("admitted");
        assert_eq!(adm.acquire().await.err(), Some(QueueFull));
        assert!((adm.load().utilization() - 1.0).abs() < f64::EPSILON);
    }

    #[tokio::test]
    async fn cancelled_waiter_leaves_the_queue() {
        let adm = Admission::new(1, 1);
        let held = adm.acquire().await.expect("admitted");
        {
            let mut waiting = pin!(adm.acquire());
            assert!(poll_once(waiting.as_mut()).is_pending());
            assert_eq!(adm.load().queued, 1);
        }
        assert_eq!(adm.load(), load(1, 1, 0));
        drop(held);
        assert_eq!(adm.load(), load(1, 0, 0));
    }

    #[tokio::test]
    async fn granted_but_dropped_waiter_returns_its_slot() {
        let adm = Admission::new(1, 1);
        let held = adm.acquire().await.expect("admitted");
        {
            let mut waiting = pin!(adm.acquire());
            assert!(poll_once(waiting.as_mut()).is_pending());
            drop(held); // grants the slot to the waiter, which never looks again
            assert_eq!(adm.load(), load(1, 1, 0));
        }
        assert_eq!(adm.load(), load(1, 0, 0));
    }

    #[tokio::test]
    async fn slot_count_changes_at_runtime() {
        let adm = Admission::new(1, 5);
        let a = adm.acquire().await.expect("admitted");
        let mut b = pin!(adm.acquire());
        assert!(poll_once(b.as_mut()).is_pending());
        adm.set_slots(2);
        let b = b.await.expect("admitted after growth");
        assert_eq!(adm.load(), load(2, 2, 0));
        adm.set_slots(1);
        drop(a);
        let mut c = pin!(adm.acquire());
        assert!(poll_once(c.as_mut()).is_pending(), "still at the new limit");
        drop(b);
        let _c = c.await.expect("admitted after shrink drained");
        adm.set_slots(0);
        let _d = adm.acquire().await.expect("unlimited");
        assert_eq!(adm.load(), load(0, 2, 0));
    }
}
