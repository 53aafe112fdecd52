//! Live per-backend state, updated with atomics on the request path and by
//! background tasks (health probes, load sources).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::clock;
use crate::limit::{LimitEstimator, LimitParams, Sample};
use tidegate_metrics::LazyHistogram;

/// A backend's state as seen by active health checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ActiveState {
    /// No active check configured, or no result yet: available.
    Unchecked = 0,
    /// Passing.
    Up = 1,
    /// Failing: takes no traffic.
    Down = 2,
}

/// An f64 in an atomic (NaN means "unknown").
#[derive(Debug)]
pub struct AtomicF64(AtomicU64);

impl AtomicF64 {
    fn new(v: f64) -> AtomicF64 {
        AtomicF64(AtomicU64::new(v.to_bits()))
    }

    /// The value (NaN when unknown).
    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Relaxed))
    }

    /// Sets the value.
    pub fn set(&self, v: f64) {
        self.0.store(v.to_bits(), Relaxed);
    }
}

impl Default for AtomicF64 {
    fn default() -> Self {
        AtomicF64::new(f64::NAN)
    }
}

/// What a backend (or its host) reports about its load, written by the load
/// sources in the background. Utilizations are 0..=1; NaN means unknown.
#[derive(Debug, Default)]
pub struct LoadReport {
    /// CPU utilization.
    pub cpu: AtomicF64,
    /// Memory utilization.
    pub memory: AtomicF64,
    /// Network utilization of the link.
    pub network: AtomicF64,
    /// ORCA requests per second.
    pub qps: AtomicF64,
    /// ORCA errors per second.
    pub eps: AtomicF64,
    /// When the first report arrived (ms on [`clock`]), 0 if never.
    pub first_ms: AtomicU64,
    /// When the latest report arrived.
    pub last_ms: AtomicU64,
}

impl LoadReport {
    /// Marks a report as received now.
    pub fn touch(&self, now_ms: u64) {
        let _ = self.first_ms.compare_exchange(0, now_ms.max(1), Relaxed, Relaxed);
        self.last_ms.store(now_ms.max(1), Relaxed);
    }
}

/// The latest Prequal probe answer of a backend: its requests in flight
/// (RIF) and latency, when it came, and how often it has been used since.
#[derive(Debug, Default)]
pub struct ProbeState {
    rif: AtomicF64,
    latency_ms: AtomicF64,
    at_ms: AtomicU64,
    uses: AtomicU32,
}

impl ProbeState {
    /// Stores a probe answer received at `now_ms`.
    pub fn store(&self, rif: f64, latency_ms: f64, now_ms: u64) {
        self.rif.set(rif);
        self.latency_ms.set(latency_ms);
        self.uses.store(0, Relaxed);
        self.at_ms.store(now_ms.max(1), Relaxed);
    }

    /// `(rif, latency_ms)` of an answer younger than `max_age_ms` and used
    /// fewer than `reuse` times.
    pub fn fresh(&self, now_ms: u64, max_age_ms: u64, reuse: u32) -> Option<(f64, f64)> {
        let at = self.at_ms.load(Relaxed);
        let usable = at > 0 && now_ms.saturating_sub(at) < max_age_ms && self.uses.load(Relaxed) < reuse;
        usable.then(|| (self.rif.get(), self.latency_ms.get()))
    }

    /// Counts a choice made on this answer: one more use, and one more
    /// request in flight than the backend reported.
    pub fn used(&self) {
        self.uses.fetch_add(1, Relaxed);
        self.rif.set(self.rif.get() + 1.0);
    }
}

/// Counters and gauges of one backend. Shared across snapshots by `Arc`.
#[derive(Debug)]
pub struct BackendStats {
    in_flight: AtomicU64,
    /// Of those in flight, the ones whose response head arrived (a body
    /// still streaming, a tunnel): they count against `max_conns`, not
    /// against the learned limit.
    answered: AtomicU64,
    requests: AtomicU64,
    failures: AtomicU64,
    /// Latency EWMA in nanoseconds (0 = no sample yet).
    pub(crate) latency_ewma: AtomicF64,
    /// Peak-EWMA latency (ns) and when it was last updated (ns on [`clock`]).
    pub(crate) peak_ewma: AtomicF64,
    pub(crate) peak_stamp_ns: AtomicU64,
    pub(crate) active: AtomicU8,
    pub(crate) probe_passes: AtomicU32,
    pub(crate) probe_fails: AtomicU32,
    pub(crate) consecutive_failures: AtomicU32,
    pub(crate) ejections: AtomicU32,
    /// Ejections since the backend appeared.
    pub(crate) ejections_total: AtomicU64,
    pub(crate) ejected_until_ms: AtomicU64,
    pub(crate) available_since_ms: AtomicU64,
    /// Load reports from the backend or its host.
    pub load: LoadReport,
    /// The latest Prequal probe answer.
    pub probe: ProbeState,
    /// The learned concurrency limit (`u64::MAX` when not learned), read
    /// on the request path; written by `learner`.
    limit: AtomicU64,
    learning: AtomicBool,
    learner: Mutex<Option<LimitEstimator>>,
    /// Attempt durations (sent to response head), allocated at the first.
    pub attempts: LazyHistogram,
}

impl Default for BackendStats {
    fn default() -> Self {
        BackendStats {
            in_flight: AtomicU64::new(0),
            answered: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            latency_ewma: AtomicF64::new(0.0),
            peak_ewma: AtomicF64::new(0.0),
            peak_stamp_ns: AtomicU64::new(0),
            active: AtomicU8::new(ActiveState::Unchecked as u8),
            probe_passes: AtomicU32::new(0),
            probe_fails: AtomicU32::new(0),
            consecutive_failures: AtomicU32::new(0),
            ejections: AtomicU32::new(0),
            ejections_total: AtomicU64::new(0),
            ejected_until_ms: AtomicU64::new(0),
            available_since_ms: AtomicU64::new(clock::now_ms()),
            load: LoadReport::default(),
            probe: ProbeState::default(),
            limit: AtomicU64::new(u64::MAX),
            learning: AtomicBool::new(false),
            learner: Mutex::new(None),
            attempts: LazyHistogram::default(),
        }
    }
}

/// How an upstream attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A response came back (any status below 500).
    Success,
    /// The backend answered 5xx (but 503), reset, or timed out.
    Failure,
    /// The backend shed the request (503 or 429): counted as a failed
    /// request, but not as a sign of a broken backend.
    Overloaded,
    /// The backend did not accept a connection or answer in time: a
    /// failure, and a sign of overload for the learned limit.
    TimedOut,
}

/// Weight of a new latency sample in the plain EWMA.
const EWMA_ALPHA: f64 = 0.2;

/// The peak-EWMA time constant used when a sample is recorded; policies
/// that read it pass their own (see [`BackendStats::peak_ewma_ns`]).
const PEAK_DECAY_NS: f64 = 10e9;

impl BackendStats {
    /// Marks a request as started now; the guard marks it finished when
    /// dropped.
    pub fn start(self: &Arc<Self>) -> InFlight {
        self.start_at(Instant::now())
    }

    /// Marks a request as started at `started`, a time the caller read
    /// for other uses too.
    pub fn start_at(self: &Arc<Self>, started: Instant) -> InFlight {
        let concurrency = (self.in_flight.fetch_add(1, Relaxed) + 1).saturating_sub(self.answered());
        InFlight { stats: self.clone(), started, concurrency, done: false, answered: false }
    }

    /// Starts, updates or stops learning this backend's concurrency limit.
    /// What was learned is kept across parameter changes (and snapshots).
    pub fn learn_limit(&self, params: Option<LimitParams>) {
        let mut learner = self.learner.lock().unwrap_or_else(|e| e.into_inner());
        match (params, learner.as_mut()) {
            (None, _) => *learner = None,
            (Some(p), Some(l)) if l.params() == p => {}
            (Some(p), Some(l)) => l.set_params(p),
            (Some(p), None) => *learner = Some(LimitEstimator::new(p)),
        }
        let limit = learner.as_ref().map_or(u64::MAX, LimitEstimator::limit);
        self.limit.store(limit, Relaxed);
        self.learning.store(learner.is_some(), Relaxed);
    }

    /// The estimator, locked.
    pub(crate) fn learner(&self) -> std::sync::MutexGuard<'_, Option<LimitEstimator>> {
        self.learner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Publishes a new learned limit to the request path.
    pub(crate) fn set_limit(&self, limit: u64) {
        self.limit.store(limit, Relaxed);
    }

    /// The learned limit on requests in flight (`u64::MAX` when not learned).
    pub fn learned_limit(&self) -> u64 {
        self.limit.load(Relaxed)
    }

    /// Whether a limit is being learned.
    pub fn learns_limit(&self) -> bool {
        self.learning.load(Relaxed)
    }

    /// The learned no-load latency, if learning and known.
    pub fn no_load_latency(&self) -> Option<Duration> {
        self.learner.lock().unwrap_or_else(|e| e.into_inner()).as_ref().and_then(LimitEstimator::baseline)
    }

    fn learn(&self, outcome: Outcome, latency: Duration, concurrency: u64, now_ns: u64) {
        let congested = match outcome {
            Outcome::Success => false,
            Outcome::Overloaded | Outcome::TimedOut => true,
            // An error answer says nothing about capacity.
            Outcome::Failure => return,
        };
        let mut learner = self.learner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(l) = learner.as_mut() {
            let sample = Sample { now_ns, latency_ns: latency.as_nanos() as u64, concurrency, congested };
            l.observe(sample);
            self.limit.store(l.limit(), Relaxed);
        }
    }

    /// Requests in flight now (answered ones whose body or tunnel is
    /// still open included).
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Relaxed)
    }

    /// Requests in flight whose response head arrived (bodies streaming,
    /// tunnels), counted in [`BackendStats::in_flight`] too.
    pub fn answered(&self) -> u64 {
        self.answered.load(Relaxed)
    }

    /// Requests in flight still waiting for their response head: what the
    /// learned limit bounds (it learns from the time to the head).
    pub fn awaiting_answer(&self) -> u64 {
        self.in_flight().saturating_sub(self.answered())
    }

    /// Requests finished so far.
    pub fn requests(&self) -> u64 {
        self.requests.load(Relaxed)
    }

    /// Latency EWMA, if any sample was recorded.
    pub fn latency_ewma(&self) -> Option<Duration> {
        let ns = self.latency_ewma.get();
        (ns > 0.0).then(|| Duration::from_nanos(ns as u64))
    }

    /// The active-check state.
    pub fn active_state(&self) -> ActiveState {
        match self.active.load(Relaxed) {
            1 => ActiveState::Up,
            2 => ActiveState::Down,
            _ => ActiveState::Unchecked,
        }
    }

    /// Peak-EWMA latency in ns at `now_ns`, decayed toward zero since the
    /// last sample with time constant `decay_ns` (so an idle backend slowly
    /// looks cheaper and gets probed again).
    pub fn peak_ewma_ns(&self, now_ns: u64, decay_ns: f64) -> f64 {
        let cost = self.peak_ewma.get();
        let age = now_ns.saturating_sub(self.peak_stamp_ns.load(Relaxed)) as f64;
        cost * (-age / decay_ns).exp()
    }

    /// Takes one finished attempt; `now_ns` is when it finished (on
    /// [`clock`]), read once by the caller.
    pub(crate) fn record(&self, outcome: Outcome, latency: Duration, concurrency: u64, now_ns: u64) {
        if self.learns_limit() {
            self.learn(outcome, latency, concurrency, now_ns);
        }
        self.requests.fetch_add(1, Relaxed);
        if outcome != Outcome::Success {
            self.failures.fetch_add(1, Relaxed);
        }
        self.attempts.observe(latency);
        // (Through u64: the same value, and a conversion to f64 of a few
        // instructions where a u128's is a call.)
        let sample = (u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX) as f64).max(1.0);
        let old = self.latency_ewma.get();
        self.latency_ewma.set(if old > 0.0 { old + EWMA_ALPHA * (sample - old) } else { sample });
        // Peak EWMA: jumps up to a slower sample at once, decays otherwise.
        let age = now_ns.saturating_sub(self.peak_stamp_ns.swap(now_ns, Relaxed)) as f64;
        let cost = self.peak_ewma.get();
        let next = if sample > cost {
            sample
        } else {
            let w = (-age / PEAK_DECAY_NS).exp();
            cost * w + sample * (1.0 - w)
        };
        self.peak_ewma.set(next);
    }

    /// A copy for status pages.
    pub fn view(&self) -> StatsView {
        let now = clock::now_ms();
        StatsView {
            in_flight: self.in_flight(),
            requests: self.requests(),
            failures: self.failures.load(Relaxed),
            latency_ewma_ms: self.latency_ewma().map(|d| d.as_secs_f64() * 1e3),
            active: self.active_state(),
            ejected_for_ms: self.ejected_until_ms.load(Relaxed).saturating_sub(now),
            ejections: self.ejections.load(Relaxed),
            ejections_total: self.ejections_total.load(Relaxed),
            learned_limit: self.learns_limit().then(|| self.learned_limit()),
            no_load_latency_ms: self.no_load_latency().map(|d| d.as_secs_f64() * 1e3),
        }
    }
}

/// A snapshot of a backend's statistics.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StatsView {
    /// Requests in flight.
    pub in_flight: u64,
    /// Requests finished since the backend appeared.
    pub requests: u64,
    /// Of which failed.
    pub failures: u64,
    /// Latency EWMA in milliseconds.
    pub latency_ewma_ms: Option<f64>,
    /// Active-check state.
    pub active: ActiveState,
    /// Remaining ejection time (0 when not ejected).
    pub ejected_for_ms: u64,
    /// Ejections in the current streak.
    pub ejections: u32,
    /// Ejections since the backend appeared.
    pub ejections_total: u64,
    /// The learned concurrency limit, when learned.
    pub learned_limit: Option<u64>,
    /// The learned no-load latency in milliseconds, when learned.
    pub no_load_latency_ms: Option<f64>,
}

/// A request in flight to a backend: counted in flight until dropped (the
/// proxy drops it when the response body ends). [`InFlight::record`] takes
/// the outcome and the latency to the response headers; dropping it without
/// a record counts a request without a latency sample (the client went away).
#[derive(Debug)]
pub struct InFlight {
    stats: Arc<BackendStats>,
    started: Instant,
    /// Requests awaiting their answer when this one started, itself
    /// included.
    concurrency: u64,
    done: bool,
    /// Its response head arrived: counted in `answered` until dropped.
    answered: bool,
}

impl InFlight {
    /// Records the outcome and the latency since the start (once; later
    /// calls are ignored). Reads the clock once, for every use.
    pub fn record(&mut self, outcome: Outcome) {
        if !self.done {
            let now = Instant::now();
            let latency = now.saturating_duration_since(self.started);
            self.stats.record(outcome, latency, self.concurrency, clock::ns_at(now));
            self.done = true;
        }
    }

    /// The request's latency counts from `at` when that is later than its
    /// start (a streamed request body finished at `at`: the client's upload
    /// time is not the backend's).
    pub fn rebase(&mut self, at: Instant) {
        self.started = self.started.max(at);
    }

    /// The response head arrived: the request stays in flight until its
    /// body (or tunnel) ends, but no longer counts against the learned
    /// limit, which is learned from the time to the head (a WebSocket or
    /// an event stream open for hours must not hold a place other requests
    /// need). Nothing is counted for a backend that learns no limit.
    ///
    /// Returns whether this call gave a place under the learned limit back.
    pub fn answered(&mut self) -> bool {
        if self.answered || !self.stats.learns_limit() {
            return false;
        }
        self.answered = true;
        self.stats.answered.fetch_add(1, Relaxed);
        true
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.answered {
            self.stats.answered.fetch_sub(1, Relaxed);
        }
        self.stats.in_flight.fetch_sub(1, Relaxed);
        if !self.done {
            self.stats.requests.fetch_add(1, Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_flight_and_outcomes_are_counted() {
        let s = Arc::new(BackendStats::default());
        let mut a = s.start();
        let mut b = s.start();
        assert_eq!(s.in_flight(), 2);
        a.record(Outcome::Success);
        b.record(Outcome::Failure);
        b.record(Outcome::Success);
        drop((a, b));
        let v = s.view();
        assert_eq!((v.in_flight, v.requests, v.failures), (0, 2, 1));
        assert!(v.latency_ewma_ms.is_some());
        drop(s.start());
        assert_eq!(s.view().requests, 3);
    }

    #[test]
    fn a_learned_limit_is_kept_across_parameter_changes_and_cleared_when_off() {
        let s = Arc::new(BackendStats::default());
        assert_eq!((s.learned_limit(), s.learns_limit()), (u64::MAX, false));
        let params = LimitParams { tolerance: 1.5, initial: 4.0, min: 1.0, max: 100.0, min_rise_ns: 1e6 };
        s.learn_limit(Some(params));
        assert_eq!((s.learned_limit(), s.learns_limit()), (4, true));
        // A shed answer at concurrency 4 cuts the limit: 3 * 0.9.
        s.record(Outcome::Overloaded, Duration::from_millis(1), 4, clock::now_ns());
        assert_eq!(s.learned_limit(), 2);
        // New bounds keep what was learned, clamped.
        s.learn_limit(Some(LimitParams { min: 3.0, ..params }));
        assert_eq!(s.learned_limit(), 3);
        // An error answer (500) says nothing about capacity.
        s.record(Outcome::Failure, Duration::from_millis(1), 50, clock::now_ns());
        assert_eq!(s.learned_limit(), 3);
        s.learn_limit(None);
        assert_eq!((s.learned_limit(), s.learns_limit(), s.view().learned_limit), (u64::MAX, false, None));
    }

    #[test]
    fn peak_ewma_jumps_up_and_decays() {
        let s = BackendStats::default();
        let now = clock::now_ns();
        s.record(Outcome::Success, Duration::from_millis(100), 1, now);
        let peak = s.peak_ewma_ns(now, 1e9);
        assert!(peak > 90e6, "{peak}");
        assert!(s.peak_ewma_ns(now + 2_000_000_000, 1e9) < peak / 5.0);
    }
}
