//! Picking a backend for an attempt, and waiting in the service's bounded
//! queue while every backend is at its limit (`max_conns` or the learned
//! concurrency limit; HAProxy's maxconn queue).

use std::sync::Arc;
use std::time::Duration;

use tidegate_balance::{clock, Backend, InFlight, Outcome, RequestCtx};
use tidegate_metrics::LazyHistogram;
use tidegate_snapshot::{Joined, ServiceLive, ServiceRuntime, WaitQueue, Waiter};

use crate::error::ErrorKind;

/// What a pick found.
pub(crate) enum Pick {
    /// A backend to try.
    Backend(Arc<Backend>),
    /// Available backends exist, but all are at their `max_conns`.
    Full,
    /// No untried backend at all.
    Nothing,
}

/// Picks a backend not tried yet for this request: preferably one that is
/// available (active checks pass, not ejected) with room under its
/// `max_conns`, admitted by slow start's ramp; else any available one with
/// room. If available backends exist but are all full, that is `Full`. When
/// no backend is available at all, any untried one with room is tried
/// (panic mode: health data may be wrong, an attempt costs less than a
/// certain 503).
pub(crate) fn pick(service: &ServiceRuntime, ctx: &RequestCtx<'_>, tried: &[Arc<Backend>], now: u64) -> Pick {
    let ctx = &RequestCtx { retry: !tried.is_empty(), ..*ctx };
    let untried = |b: &Backend| !tried.iter().any(|t| std::ptr::eq(&**t, b));
    let available = |b: &Backend| untried(b) && b.stats.is_available(now);
    let ramp = service.settings.health.slow_start_ms;
    let sel = &service.selector;
    if ramp > 0 {
        // A primary held back by its ramp must not hand its turn to a backup.
        let primary_open = sel.primaries().any(|b| b.weight > 0 && available(b) && b.has_room());
        let mut ramped = |b: &Backend| {
            available(b)
                && b.has_room()
                && (!b.backup || !primary_open)
                && fastrand::f64() < b.stats.slow_start_factor(now, ramp)
        };
        if let Some(b) = sel.select(ctx, &mut ramped) {
            return Pick::Backend(b);
        }
    }
    if let Some(b) = sel.select(ctx, &mut |b: &Backend| available(b) && b.has_room()) {
        return Pick::Backend(b);
    }
    if sel.backends().iter().any(|b| b.weight > 0 && available(b) && !b.has_room()) {
        return Pick::Full;
    }
    match sel.select(ctx, &mut |b: &Backend| untried(b) && b.has_room()) {
        Some(b) => Pick::Backend(b),
        None if sel.backends().iter().any(|b| b.weight > 0 && untried(b) && !b.has_room()) => Pick::Full,
        None => Pick::Nothing,
    }
}

/// A request's place in its service's queue.
pub(crate) struct Queue<'a> {
    timeout: Duration,
    deadline: Option<tokio::time::Instant>,
    pub(crate) waiting: Option<Waiting<'a>>,
}

impl Queue<'_> {
    pub(crate) fn new(timeout_ms: u64) -> Self {
        Queue { timeout: Duration::from_millis(timeout_ms), deadline: None, waiting: None }
    }
}

/// A request in its service's [`WaitQueue`]. Dropped (after the request
/// took a backend's slot, timed out or went away), it leaves the queue and
/// passes the turn on: to the next in line when it was first or had been
/// woken, so that whoever is first always re-examines the backends. The
/// caller drops it only once the picked backend's slot is taken, so the
/// next one sees that slot in use.
pub(crate) struct Waiting<'a> {
    queue: &'a WaitQueue,
    waiter: Arc<Waiter>,
    took_room: bool,
    /// Where the time spent waiting is counted, and since when.
    waits: &'a LazyHistogram,
    since: std::time::Instant,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.queue.leave(&self.waiter, self.took_room);
        self.waits.observe(self.since.elapsed());
    }
}

/// How often the first in line looks for room by itself: room can appear
/// without a release that wakes the queue (a backend added or back up, a
/// limit raised, requests of unlimited backends ending after a limit was
/// set), and then waiting must not last until the queue timeout.
const RECHECK: Duration = Duration::from_millis(50);

/// Picks a backend, waiting in the service's bounded queue while every
/// available backend is at its limit (HAProxy's maxconn queue). `now_ms`:
/// the caller's reading of [`clock::now_ms`].
///
/// The queue is fair between client addresses (they take turns; a full
/// queue gives a greedy client's newest place to a newcomer of a client
/// holding fewer) and first come, first served within one: while requests
/// wait, a new one queues instead of taking the room a release just made
/// for the one whose turn it is, and a woken request that finds no room
/// after all keeps its turn at the front. Letting newcomers barge in made the
/// tail of a saturated service's latency several times longer than its
/// median. A picked request keeps its place (`queue.waiting`) until the
/// caller has taken the backend's slot.
pub(crate) async fn pick_or_wait<'a>(
    service: &'a ServiceRuntime,
    ctx: &RequestCtx<'_>,
    tried: &[Arc<Backend>],
    queue: &mut Queue<'a>,
    now_ms: u64,
) -> Result<Option<Arc<Backend>>, ErrorKind> {
    let waiters = &service.live.queue;
    // The caller's clock reading serves the first pick; a pick after a
    // wait reads the clock again.
    let mut at = Some(now_ms);
    // A first attempt that finds others waiting joins them (a retry has
    // waited its turn already).
    let mut behind_others = tried.is_empty() && !waiters.is_empty();
    // Out of the queue (woken, or looking again by itself) since the last pick.
    let mut out = false;
    loop {
        if !std::mem::take(&mut behind_others) {
            match pick(service, ctx, tried, at.take().unwrap_or_else(clock::now_ms)) {
                Pick::Backend(b) => {
                    if let Some(w) = &mut queue.waiting {
                        w.took_room = true;
                    }
                    return Ok(Some(b));
                }
                Pick::Nothing => return Ok(None),
                Pick::Full => {}
            }
        }
        match &queue.waiting {
            None => {
                let client = ctx.client.map_or(Waiter::UNKNOWN_CLIENT, |a| tidegate_snapshot::client_key(a.ip()));
                let waiter = Arc::new(Waiter::new(client));
                let max = service.settings.queue.max as usize;
                let joined = waiters.push_back(&waiter, max);
                if joined == Joined::Full {
                    return Err(ErrorKind::QueueFull);
                }
                let (waits, since) = (&service.live.queue_wait, std::time::Instant::now());
                queue.waiting = Some(Waiting { queue: waiters, waiter, took_room: false, waits, since });
                if joined == Joined::First {
                    // First in line: room freed between the pick and
                    // joining the queue woke nobody; look once more.
                    continue;
                }
            }
            Some(w) if std::mem::take(&mut out) => {
                // No room after all (a retry took it, a limit came down):
                // back to the front, keeping the turn, and one more look
                // for room freed meanwhile.
                waiters.push_front(&w.waiter);
                continue;
            }
            Some(_) => {}
        }
        let Some(w) = &queue.waiting else { continue };
        let deadline = *queue.deadline.get_or_insert_with(|| tokio::time::Instant::now() + queue.timeout);
        let first = waiters.is_front(&w.waiter);
        let until = if first { deadline.min(tokio::time::Instant::now() + RECHECK) } else { deadline };
        let woken = tokio::time::timeout_at(until, w.waiter.woken()).await;
        if w.waiter.displaced() {
            // Its place went to another client's request: answered as if
            // the queue had been full when it came.
            return Err(ErrorKind::QueueFull);
        }
        match woken {
            Ok(()) => out = true,
            Err(_) if until < deadline => {
                // Look again, out of the queue meanwhile (a release wakes
                // the next one instead, who looks too).
                waiters.remove(&w.waiter);
                out = true;
            }
            Err(_) => return Err(ErrorKind::QueueTimeout),
        }
    }
}

/// One attempt's hold on a backend: counted in flight until dropped. For a
/// backend with a limit, each place it gives back wakes one queued
/// request: its place under the learned limit when the answer's head
/// arrives, its place under `max_conns` when it is dropped.
#[derive(Debug)]
pub struct Slot {
    guard: Option<InFlight>,
    live: Option<Arc<ServiceLive>>,
    /// The backend has `max_conns`: dropping the slot frees a place.
    capped: bool,
    /// The learned limit's place was given back when the head arrived.
    answered: bool,
}

impl Slot {
    /// Counts a request in flight to `backend` of `service`, from `now`.
    pub(crate) fn take(backend: &Backend, service: &ServiceRuntime, now: std::time::Instant) -> Slot {
        let limited = backend.is_limited();
        Slot {
            guard: Some(backend.stats.start_at(now)),
            live: limited.then(|| service.live.clone()),
            capped: backend.max_conns.is_some(),
            answered: false,
        }
    }

    /// The request's latency counts from `at` (after its body was sent).
    pub(crate) fn rebase(&mut self, at: std::time::Instant) {
        if let Some(g) = &mut self.guard {
            g.rebase(at);
        }
    }

    pub(crate) fn record(&mut self, outcome: Outcome) {
        if let Some(g) = &mut self.guard {
            g.record(outcome);
        }
    }

    /// The response head arrived: the request keeps its place under
    /// `max_conns` until its body or tunnel ends, but leaves the learned
    /// limit's, so a queued request may take it.
    pub(crate) fn answered(&mut self) {
        if let Some(g) = &mut self.guard {
            self.answered = g.answered();
        }
        if let (true, Some(live)) = (self.answered, &self.live) {
            live.queue.wake_one();
        }
    }

    /// Gives the backend back now, before the answer is dropped: a shed
    /// answer (503) is kept only in case no other backend answers better,
    /// and its backend is done with the request. Nothing is held after.
    pub(crate) fn release(&mut self) {
        // Free the slot first, so the woken request finds room.
        drop(self.guard.take());
        // Nothing to wake for when the learned limit's place went back
        // with the head and no `max_conns` place is freed now: a woken
        // request would find no room and wait again.
        if let (true, Some(live)) = (self.capped || !self.answered, self.live.take()) {
            live.queue.wake_one();
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.release();
    }
}
