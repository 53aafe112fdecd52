//! Picking a backend for an attempt, and waiting in the service's bounded
//! queue while every backend is at its limit (`max_conns` or the learned
//! concurrency limit; HAProxy's maxconn queue).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use tidegate_balance::{clock, Backend, InFlight, Outcome, RequestCtx};
use tidegate_snapshot::{ServiceLive, ServiceRuntime};

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

/// Counts a request in `queued` while it waits.
pub(crate) struct Waiting<'a>(&'a ServiceLive);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.queued.fetch_sub(1, Relaxed);
    }
}

/// Picks a backend, waiting in the service's bounded queue while every
/// available backend is at its limit (HAProxy's maxconn queue).
///
/// The queue is first come, first served: while requests wait, a new one
/// queues behind them instead of taking the room a release just made for
/// the longest-waiting one (tokio's `Notify` wakes waiters in order).
/// Letting newcomers barge in made the tail of a saturated service's
/// latency several times longer than its median.
pub(crate) async fn pick_or_wait<'a>(
    service: &'a ServiceRuntime,
    ctx: &RequestCtx<'_>,
    tried: &[Arc<Backend>],
    queue: &mut Queue<'a>,
) -> Result<Option<Arc<Backend>>, ErrorKind> {
    let live = &*service.live;
    // A first attempt that finds others waiting joins them (a retry has
    // waited its turn already).
    let mut behind_others = tried.is_empty() && live.queued.load(Relaxed) > 0;
    loop {
        if !std::mem::take(&mut behind_others) {
            match pick(service, ctx, tried, clock::now_ms()) {
                Pick::Backend(b) => {
                    if queue.waiting.is_some() {
                        // Pass the turn on: there may be room for the next
                        // one too (a limit that grew, several releases at
                        // once); if not, it waits again.
                        live.freed.notify_one();
                    }
                    return Ok(Some(b));
                }
                Pick::Nothing => return Ok(None),
                Pick::Full => {}
            }
        }
        if queue.waiting.is_none() {
            let max = u64::from(service.settings.queue.max);
            if live.queued.fetch_add(1, Relaxed) >= max {
                live.queued.fetch_sub(1, Relaxed);
                return Err(ErrorKind::QueueFull);
            }
            queue.waiting = Some(Waiting(live));
        }
        let deadline = *queue.deadline.get_or_insert_with(|| tokio::time::Instant::now() + queue.timeout);
        // A slot freed between the pick and here left a permit: no lost wake-up.
        if tokio::time::timeout_at(deadline, live.freed.notified()).await.is_err() {
            return Err(ErrorKind::QueueTimeout);
        }
    }
}

/// One attempt's hold on a backend: counted in flight until dropped; for a
/// backend with a limit, dropping it also wakes a queued request.
#[derive(Debug)]
pub struct Slot {
    guard: Option<InFlight>,
    live: Option<Arc<ServiceLive>>,
}

impl Slot {
    /// Counts a request in flight to `backend` of `service`.
    pub(crate) fn take(backend: &Backend, service: &ServiceRuntime) -> Slot {
        let limited = backend.is_limited();
        Slot { guard: Some(backend.stats.start()), live: limited.then(|| service.live.clone()) }
    }

    pub(crate) fn record(&mut self, outcome: Outcome) {
        if let Some(g) = &mut self.guard {
            g.record(outcome);
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        // Free the slot first, so the woken request finds room.
        drop(self.guard.take());
        if let Some(live) = &self.live {
            live.freed.notify_one();
        }
    }
}
