//! Learned concurrency limits: how many requests in flight a backend holds
//! before it queues or sheds, learned from what the proxy sees of it.
//!
//! The estimator is pure: it is fed one [`Sample`] per finished attempt
//! and answers with a limit. It works on windows of at least
//! [`MIN_WINDOW_SAMPLES`] answered requests (and at least one no-load
//! latency long):
//!
//! - **Slow start**: from `initial`, the limit doubles per window of
//!   [`SLOW_START_SAMPLES`] answers (twice that for the first) until the first window that is not
//!   calm; the baseline meanwhile is the mean of the answers to requests
//!   that were alone in flight (the first window's, from a limit of 1):
//!   a short window right after a doubling holds the answers that came
//!   back first, the short ones, and would read low.
//! - **No-load latency** (the baseline): an average of the calm windows'
//!   mean latency (and of the slow start's), so it settles at the latency
//!   of a backend that is not queueing; it moves down faster from a window
//!   far below it.
//! - **Outliers**: an answer counts for at most eight no-load latencies
//!   plus `min_rise` in its window's mean, so that one late answer (the proxy
//!   busy elsewhere for a moment) does not read as queueing.
//! - **Queued**: a window whose mean latency exceeds the baseline by more
//!   than the tolerance (and by more than `min_rise`, 5 ms by default: a
//!   rise the proxy's own scheduling can cause on a busy machine) lowers the limit in proportion,
//!   between 10 % and 50 % at a time, and remembers the level as a
//!   ceiling.
//! - **Calm**: a window within the tolerance, in which demand reached the
//!   limit, raises it: by a quarter while the rise is under half the
//!   tolerance, else by one. Growth stops below a remembered ceiling, except for one
//!   probe every [`PROBE_AFTER`] calm windows or 2 s (so a backend that
//!   gained capacity is found again, and a noisy window does not hold the
//!   limit down for long).
//! - **Shed or timed out** (503, 429, a response or connect timeout): the
//!   limit drops below the concurrency at which it happened, at most once
//!   per hold time (the requests already sent meet the same fate).
//! - **Alone**: a window whose requests never overlapped (concurrency 1)
//!   cannot show queueing that this proxy caused; slower than the baseline
//!   allows, it means the baseline is wrong (learned from a few lucky
//!   answers of a backend with variable service times): the window's mean
//!   becomes the baseline and the remembered ceiling is forgotten; when it
//!   was off by more than twice the tolerance, slow start begins again.
//! - **A flat curve**: when the cuts since the latency was last within
//!   the tolerance have halved the limit and the latency has not come
//!   down by a quarter, the rise is not queueing at this backend (the
//!   proxy itself is busy, or other clients load the backend): the
//!   baseline is reset to the current latency instead of starving it.
//!   Judged against where the cuts began, not window to window, so that
//!   the noise of real answers cannot hide a flat curve.

use std::time::Duration;

use tidegate_model::ConcurrencySpec;

/// Fewest answered requests in a window.
pub const MIN_WINDOW_SAMPLES: u32 = 32;
/// Fewest answered requests in a window of the slow start.
pub const SLOW_START_SAMPLES: u32 = 8;

/// An answer counts for at most this many no-load latencies (plus
/// `min_rise`) in its window's mean.
const CLIP_FACTOR: f64 = 8.0;
/// Calm windows below a ceiling before one probe above it.
pub const PROBE_AFTER: u32 = 8;
/// Cuts that brought the limit to this share of where they began...
const FLAT_CUT: f64 = 0.5;
/// ...and left the latency above this share of what it was then: a flat
/// curve (queueing at the backend would have come down about as much as
/// the limit did).
const FLAT_LATENCY: f64 = 0.75;
/// How fast the baseline follows calm windows, and windows far below it.
const BASELINE_RATE: f64 = 0.1;
/// A remembered ceiling is probed above after this long (ns) even without
/// [`PROBE_AFTER`] calm windows: at small limits a window lasts long, and
/// a ceiling set by a noisy window must not hold the limit down for long.
const CEILING_TTL_NS: u64 = 2_000_000_000;
const BASELINE_FAST: f64 = 0.3;

/// The estimator's parameters (a service's `concurrency` settings).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LimitParams {
    /// Latency may reach this multiple of the no-load latency (e.g. 1.5).
    pub tolerance: f64,
    /// The starting limit.
    pub initial: f64,
    /// The lowest limit.
    pub min: f64,
    /// The highest limit.
    pub max: f64,
    /// A latency rise smaller than this (ns) is never taken for queueing:
    /// on a busy machine the proxy's own scheduling adds that much to the
    /// time it takes to read an answer.
    pub min_rise_ns: f64,
}

impl From<&ConcurrencySpec> for LimitParams {
    fn from(spec: &ConcurrencySpec) -> LimitParams {
        LimitParams {
            tolerance: f64::from(spec.latency_tolerance_pct) / 100.0,
            initial: f64::from(spec.initial),
            min: f64::from(spec.min),
            max: f64::from(spec.max),
            min_rise_ns: spec.min_rise_us as f64 * 1e3,
        }
    }
}

/// What one finished attempt tells the estimator.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    /// When it finished, ns on the [`crate::clock`].
    pub now_ns: u64,
    /// Time from the start of the attempt to the response head.
    pub latency_ns: u64,
    /// Requests in flight to the backend when it started, itself included.
    pub concurrency: u64,
    /// The backend shed it (503, 429) or did not answer in time.
    pub congested: bool,
}

#[derive(Debug, Default, Clone, Copy)]
struct Window {
    start_ns: u64,
    samples: u32,
    sum_ns: f64,
    max_concurrency: u64,
    sum_concurrency: u64,
    /// The answers of requests that were alone in flight (concurrency 1).
    alone_sum_ns: f64,
    alone_samples: u32,
}

/// A learned limit and what it was learned from.
#[derive(Debug, Clone)]
pub struct LimitEstimator {
    params: LimitParams,
    pub(crate) limit: f64,
    /// No-load latency, ns (0 until the first window).
    pub(crate) baseline_ns: f64,
    window: Window,
    /// Congestion signals are ignored until then (ns).
    hold_until_ns: u64,
    /// The lowest limit level found queued, while remembered, and since when (ns).
    pub(crate) ceiling: Option<f64>,
    pub(crate) ceiling_since_ns: u64,
    calm_below_ceiling: u32,
    /// Since the latency was last within the tolerance: the limit before
    /// the first cut, and that window's mean latency.
    cuts_from: Option<(f64, f64)>,
    /// Until the first window that is not calm: the limit doubles per
    /// (short) window, and the baseline is the mean of every answer so far.
    pub(crate) slow_start: Option<(f64, u32)>,
}

/// What the estimator decided about a closed window (for tests and logs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Latency within half the tolerance: the limit may grow by a quarter.
    Calm,
    /// Between half and the whole tolerance: the limit may grow by one.
    Near,
    /// Above the tolerance: the limit was lowered.
    Queued,
    /// Queued, but lowering the limit did not help: the baseline was reset.
    Rebaselined,
}

impl LimitEstimator {
    /// A fresh estimator at `params.initial`.
    pub fn new(params: LimitParams) -> LimitEstimator {
        LimitEstimator {
            params,
            limit: params.initial.clamp(params.min, params.max),
            baseline_ns: 0.0,
            window: Window::default(),
            hold_until_ns: 0,
            ceiling: None,
            ceiling_since_ns: 0,
            calm_below_ceiling: 0,
            cuts_from: None,
            slow_start: Some((0.0, 0)),
        }
    }

    /// Changes the parameters, keeping what was learned (within the new bounds).
    pub fn set_params(&mut self, params: LimitParams) {
        self.params = params;
        self.limit = self.limit.clamp(params.min, params.max);
    }

    /// The parameters in use.
    pub fn params(&self) -> LimitParams {
        self.params
    }

    /// The limit: a new request may start while fewer are in flight.
    pub fn limit(&self) -> u64 {
        self.limit.floor().max(1.0) as u64
    }

    /// The learned no-load latency, once one window closed.
    pub fn baseline(&self) -> Option<Duration> {
        (self.baseline_ns > 0.0).then(|| Duration::from_nanos(self.baseline_ns as u64))
    }

    /// Takes one sample; returns the verdict when it closed a window.
    pub fn observe(&mut self, s: Sample) -> Option<Verdict> {
        if s.congested {
            self.congested(s);
            return None;
        }
        let w = &mut self.window;
        if w.samples == 0 {
            w.start_ns = s.now_ns.saturating_sub(s.latency_ns);
        }
        w.samples += 1;
        // A single late answer (the proxy's own thread busy elsewhere for a
        // moment) must not read as queueing: each answer counts for at most
        // eight no-load latencies (plus `min_rise`). Queueing at the
        // backend delays every answer, and still shows.
        let clip =
            if self.baseline_ns > 0.0 { self.baseline_ns * CLIP_FACTOR + self.params.min_rise_ns } else { f64::MAX };
        let latency = (s.latency_ns as f64).min(clip);
        w.sum_ns += latency;
        if s.concurrency <= 1 {
            w.alone_sum_ns += latency;
            w.alone_samples += 1;
        }
        w.max_concurrency = w.max_concurrency.max(s.concurrency);
        w.sum_concurrency += s.concurrency;
        let need = match self.slow_start {
            // The first window sets the baseline: twice the answers, so
            // that a few lucky ones of a backend with variable service times
            // do not set it low (the mean of 8 exponential times is under
            // 0.65 of theirs 17 % of the time, of 16 7 %).
            Some((_, 0)) => 2 * SLOW_START_SAMPLES,
            Some(_) => SLOW_START_SAMPLES,
            None => MIN_WINDOW_SAMPLES,
        };
        let need = need.max(self.limit as u32);
        if w.samples < need || (s.now_ns.saturating_sub(w.start_ns) as f64) < self.baseline_ns {
            return None;
        }
        let window = std::mem::take(&mut self.window);
        Some(self.close(window, s.now_ns))
    }

    fn congested(&mut self, s: Sample) {
        if s.now_ns < self.hold_until_ns {
            return;
        }
        let p = self.params;
        let level = (s.concurrency as f64).max(1.0);
        self.limit = (self.limit.min(level - 1.0) * 0.9).clamp(p.min, p.max);
        self.remember_ceiling(level, s.now_ns);
        self.slow_start = None;
        // The requests sent before this one meet the same fate: one cut for
        // all of them. Hold for about one answer's time.
        let hold = (self.baseline_ns * p.tolerance).max(s.latency_ns as f64).max(1e6);
        self.hold_until_ns = s.now_ns + hold as u64;
        self.window = Window::default();
    }

    fn close(&mut self, w: Window, now_ns: u64) -> Verdict {
        let p = self.params;
        let mean = w.sum_ns / f64::from(w.samples);
        if self.baseline_ns == 0.0 {
            self.baseline_ns = mean;
        }
        let allowed = (self.baseline_ns * (p.tolerance - 1.0)).max(p.min_rise_ns);
        let excess = mean - self.baseline_ns;
        // Requests alone, but for the odd one that raced another past the
        // limit (two workers admitting at once).
        let alone = w.sum_concurrency as f64 <= 1.25 * f64::from(w.samples);
        if alone && excess > allowed {
            return self.alone(w);
        }
        if let Some((sum, n)) = self.slow_start {
            if excess <= allowed / 2.0 {
                // The baseline comes from requests that were alone: a short
                // window right after the limit doubled holds the answers
                // that came back first, the short ones, and would set it
                // low. Without any (an initial limit above 1), the first
                // window's answers.
                let (sum, n) = match (w.alone_samples, n) {
                    (0, 0) => (w.sum_ns, w.samples),
                    (0, _) => (sum, n),
                    (k, _) => (sum + w.alone_sum_ns, n + k),
                };
                self.baseline_ns = sum / f64::from(n);
                self.slow_start = Some((sum, n));
                if w.max_concurrency as f64 >= self.limit.floor() {
                    self.limit = (self.limit * 2.0).clamp(p.min, p.max);
                }
                return Verdict::Calm;
            }
            self.slow_start = None;
        }
        if excess > allowed {
            return self.queued(mean, now_ns);
        }
        self.cuts_from = None;
        let saturated = w.max_concurrency as f64 >= self.limit.floor();
        if excess > allowed / 2.0 {
            if saturated {
                self.grow(1.0, now_ns);
            }
            return Verdict::Near;
        }
        // Only calm windows move the baseline (near ones may be queueing
        // already): an average of them, so that the noise of one window
        // (a third of the mean for 32 exponential service times) neither
        // drags it down nor reads as queueing. Far below it, it was learned
        // while queued: catch up faster.
        let rate = if mean < self.baseline_ns * 0.75 { BASELINE_FAST } else { BASELINE_RATE };
        self.baseline_ns += rate * (mean - self.baseline_ns);
        if saturated {
            self.grow((self.limit * 0.25).max(1.0), now_ns);
        }
        Verdict::Calm
    }

    /// A window whose requests did not overlap, yet slower than the
    /// baseline allows: they cannot have queued behind each other at the
    /// backend, so the window measures the no-load latency itself, and the
    /// baseline was learned from a few lucky answers (or other clients now
    /// load the backend). Take the window's mean as the baseline and forget
    /// the ceiling, instead of cutting a limit that cannot go lower while
    /// requests wait in the proxy; far off, start slowly again.
    fn alone(&mut self, w: Window) -> Verdict {
        let mean = w.sum_ns / f64::from(w.samples);
        // Far off (more than twice the tolerance): the baseline was wrong,
        // and so was every verdict drawn from it; find the level again from
        // slow start. Near it, this window may be the noisy one: grow as
        // usual from here.
        if mean > self.baseline_ns * (1.0 + 2.0 * (self.params.tolerance - 1.0)) {
            self.slow_start = Some((w.alone_sum_ns, w.alone_samples));
        }
        self.baseline_ns = mean;
        self.cuts_from = None;
        self.ceiling = None;
        self.calm_below_ceiling = 0;
        Verdict::Rebaselined
    }

    /// Remembers that `level` was too many.
    fn remember_ceiling(&mut self, level: f64, now_ns: u64) {
        self.ceiling = Some(self.ceiling.map_or(level, |c| c.min(level)));
        self.ceiling_since_ns = now_ns;
        self.calm_below_ceiling = 0;
    }

    fn queued(&mut self, mean: f64, now_ns: u64) -> Verdict {
        let p = self.params;
        let (from_limit, from_mean) = *self.cuts_from.get_or_insert((self.limit, mean));
        if self.limit <= from_limit * FLAT_CUT && mean >= from_mean * FLAT_LATENCY {
            // Lowering the limit did not lower the latency: not our queue.
            self.baseline_ns = mean;
            self.cuts_from = None;
            self.ceiling = None;
            return Verdict::Rebaselined;
        }
        let level = self.limit.floor().max(p.min + 1.0);
        self.remember_ceiling(level, now_ns);
        let factor = (self.baseline_ns * p.tolerance / mean).clamp(0.5, 0.9);
        self.limit = (self.limit * factor).clamp(p.min, p.max);
        Verdict::Queued
    }

    fn grow(&mut self, step: f64, now_ns: u64) {
        let p = self.params;
        let mut next = self.limit + step;
        if let Some(ceiling) = self.ceiling {
            if next.floor() >= ceiling {
                let old = now_ns.saturating_sub(self.ceiling_since_ns) >= CEILING_TTL_NS;
                if self.calm_below_ceiling >= PROBE_AFTER || old {
                    // Probe above the ceiling; it is found again if still there.
                    self.ceiling = None;
                    self.calm_below_ceiling = 0;
                    next = next.min(ceiling + 0.5);
                } else {
                    self.calm_below_ceiling += 1;
                    next = next.min(ceiling - 0.5).max(self.limit);
                }
            }
        }
        self.limit = next.clamp(p.min, p.max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> LimitParams {
        LimitParams { tolerance: 1.5, initial: 1.0, min: 1.0, max: 1000.0, min_rise_ns: 1e6 }
    }

    /// A backend with `slots` servers of a fixed `service_ms`, kept busy
    /// with `limit` requests in flight (the proxy's limit): each window's
    /// latency is the queueing model's mean, `service * max(1, L/slots)`.
    struct Backend {
        slots: f64,
        service_ns: f64,
        /// Sheds (503) beyond slots + queue.
        queue: f64,
    }

    impl Backend {
        /// Feeds `windows` windows' worth of samples at the estimator's
        /// current limit; returns the limits seen after each window.
        fn drive(&self, est: &mut LimitEstimator, now: &mut u64, windows: usize) -> Vec<u64> {
            let mut seen = Vec::new();
            let mut closed = 0;
            while closed < windows {
                let l = est.limit() as f64;
                let latency = self.service_ns * (l / self.slots).max(1.0);
                *now += (latency / l) as u64;
                let congested = l > self.slots + self.queue;
                let s = Sample { now_ns: *now, latency_ns: latency as u64, concurrency: l as u64, congested };
                if est.observe(s).is_some() || congested {
                    closed += 1;
                    seen.push(est.limit());
                }
            }
            seen
        }
    }

    fn median(mut v: Vec<u64>) -> u64 {
        v.sort_unstable();
        v[v.len() / 2]
    }

    #[test]
    fn converges_up_on_a_fast_backend() {
        let b = Backend { slots: 64.0, service_ns: 20e6, queue: 1000.0 };
        let mut est = LimitEstimator::new(params());
        let mut now = 0;
        let seen = b.drive(&mut est, &mut now, 60);
        let settled = median(seen[40..].to_vec());
        assert!((64..=100).contains(&settled), "limit {settled}, history {seen:?}");
        assert!(est.baseline().unwrap() >= Duration::from_millis(19), "{:?}", est.baseline());
    }

    #[test]
    fn settles_within_half_again_of_the_true_slots() {
        for slots in [1.0, 2.0, 4.0, 8.0] {
            let b = Backend { slots, service_ns: 20e6, queue: 4.0 };
            let mut est = LimitEstimator::new(params());
            let mut now = 0;
            let seen = b.drive(&mut est, &mut now, 80);
            let settled = median(seen[30..].to_vec()) as f64;
            assert!(settled >= slots / 1.5 && settled <= slots * 1.5, "slots {slots}: limit {settled}, {seen:?}");
        }
    }

    #[test]
    fn settles_near_the_true_slots_with_exponential_service_times() {
        // Each answer's latency is exponential around the queueing model's
        // mean: the noise of a real backend of exponential jobs.
        let mut rng = fastrand::Rng::with_seed(7);
        for slots in [1.0, 2.0, 4.0, 8.0] {
            let mut est = LimitEstimator::new(params());
            let mut now = 0u64;
            let mut seen = Vec::new();
            while seen.len() < 200 {
                let l = est.limit() as f64;
                let mean = 20e6 * (l / slots).max(1.0);
                let latency = -mean * (1.0 - rng.f64()).ln();
                now += (mean / l) as u64;
                let s = Sample { now_ns: now, latency_ns: latency as u64, concurrency: l as u64, congested: false };
                if est.observe(s).is_some() {
                    seen.push(est.limit());
                }
            }
            let settled = median(seen[50..].to_vec()) as f64;
            assert!(settled >= slots / 1.5 && settled <= slots * 1.5, "slots {slots}: limit {settled}, {seen:?}");
            let low = seen[50..].iter().filter(|&&l| (l as f64) < slots).count();
            assert!(low * 4 < seen.len() - 50, "slots {slots}: below the slots {low} times: {seen:?}");
        }
    }

    #[test]
    fn comes_down_on_a_shedding_backend() {
        // Learned with the backend at 16 slots, then it drops to 2 and sheds
        // past 2 queued: the limit follows.
        let mut est = LimitEstimator::new(params());
        let mut now = 0;
        Backend { slots: 16.0, service_ns: 10e6, queue: 2.0 }.drive(&mut est, &mut now, 40);
        assert!(est.limit() >= 12, "{}", est.limit());
        let seen = Backend { slots: 2.0, service_ns: 10e6, queue: 2.0 }.drive(&mut est, &mut now, 200);
        assert!(est.limit() <= 3, "{seen:?}");
    }

    #[test]
    fn recovers_after_the_backend_recovers() {
        let mut est = LimitEstimator::new(params());
        let mut now = 0;
        Backend { slots: 2.0, service_ns: 10e6, queue: 1.0 }.drive(&mut est, &mut now, 40);
        assert!(est.limit() <= 3);
        let seen = Backend { slots: 12.0, service_ns: 10e6, queue: 1.0 }.drive(&mut est, &mut now, 120);
        let settled = median(seen[80..].to_vec());
        assert!((8..=18).contains(&settled), "{seen:?}");
    }

    #[test]
    fn never_goes_below_the_minimum() {
        let mut est = LimitEstimator::new(params());
        for i in 0..1000u64 {
            est.observe(Sample { now_ns: i * 100_000_000, latency_ns: 50_000_000, concurrency: 1, congested: true });
            assert!(est.limit() >= 1);
        }
        let mut est = LimitEstimator::new(LimitParams { min: 3.0, initial: 5.0, ..params() });
        for i in 0..1000u64 {
            est.observe(Sample { now_ns: i * 1_000_000_000, latency_ns: 10_000_000, concurrency: 50, congested: true });
        }
        assert_eq!(est.limit(), 3);
    }

    #[test]
    fn a_flat_curve_resets_the_baseline_instead_of_starving_the_backend() {
        // Latency jumps from 0.1 ms to 5 ms whatever the limit: the proxy,
        // not the backend, is slow. The limit dips, then recovers.
        let mut est = LimitEstimator::new(LimitParams { initial: 100.0, ..params() });
        let mut now = 0u64;
        let mut feed = |est: &mut LimitEstimator, latency_ns: u64, n: usize| {
            let mut verdicts = Vec::new();
            for _ in 0..n {
                now += 10_000;
                let s = Sample { now_ns: now, latency_ns, concurrency: est.limit(), congested: false };
                verdicts.extend(est.observe(s));
            }
            verdicts
        };
        feed(&mut est, 100_000, 2_000);
        let before = est.limit();
        let verdicts = feed(&mut est, 5_000_000, 20_000);
        assert!(verdicts.contains(&Verdict::Rebaselined), "{verdicts:?}");
        assert!(est.limit() >= before / 2, "limit {} fell from {before}", est.limit());
    }

    #[test]
    fn a_noisy_flat_curve_does_not_starve_the_backend_either() {
        // As above, but each answer's latency is exponential around 5 ms
        // (whatever the limit): window means wander by a fifth, so no
        // three queued windows in a row look alike. Cutting the limit
        // never lowers the latency, and the limit must not spiral down.
        let mut rng = fastrand::Rng::with_seed(11);
        let mut est = LimitEstimator::new(LimitParams { initial: 100.0, ..params() });
        let mut now = 0u64;
        let mut feed = |est: &mut LimitEstimator, mean_ns: f64, n: usize| {
            let mut lowest = u64::MAX;
            for _ in 0..n {
                now += 10_000;
                let latency_ns = (-mean_ns * (1.0 - rng.f64()).ln()) as u64;
                let s = Sample { now_ns: now, latency_ns, concurrency: est.limit(), congested: false };
                est.observe(s);
                lowest = lowest.min(est.limit());
            }
            lowest
        };
        feed(&mut est, 100_000.0, 2_000);
        let before = est.limit();
        let lowest = feed(&mut est, 5_000_000.0, 40_000);
        assert!(lowest >= before / 4, "limit fell to {lowest} from {before}");
        assert!(est.limit() >= before / 2, "limit {} from {before}", est.limit());
    }

    #[test]
    fn small_rises_are_not_queueing() {
        // 50 µs → 600 µs: under min_rise (1 ms here), so never queued; the limit grows.
        let mut est = LimitEstimator::new(params());
        for i in 0..10_000u64 {
            let latency_ns = if i < 500 { 50_000 } else { 600_000 };
            let v = est.observe(Sample { now_ns: i * 20_000, latency_ns, concurrency: est.limit(), congested: false });
            assert!(!matches!(v, Some(Verdict::Queued | Verdict::Rebaselined)), "at {i}");
        }
        assert!(est.limit() > 100, "{}", est.limit());
    }

    #[test]
    fn one_late_answer_per_window_is_not_queueing() {
        // 1 ms answers with one 200 ms straggler every 32: unclipped, each
        // window's mean would be 7 ms, far past the 1 ms allowed rise.
        let mut est = LimitEstimator::new(params());
        for i in 0..10_000u64 {
            let latency_ns = if i % 32 == 31 { 200_000_000 } else { 1_000_000 };
            let v =
                est.observe(Sample { now_ns: i * 1_000_000, latency_ns, concurrency: est.limit(), congested: false });
            assert!(!matches!(v, Some(Verdict::Queued | Verdict::Rebaselined)), "at {i}");
        }
        assert!(est.limit() > 100, "{}", est.limit());
    }

    #[test]
    fn queueing_that_delays_every_answer_still_shows_through_the_clip() {
        // A backend whose every answer goes from 1 ms to 30 ms (far past
        // the clip of 8 no-load latencies + 1 ms) is still seen queueing.
        let mut est = LimitEstimator::new(LimitParams { initial: 64.0, ..params() });
        let mut now = 0;
        for _ in 0..500 {
            now += 1_000_000;
            est.observe(Sample { now_ns: now, latency_ns: 1_000_000, concurrency: 64, congested: false });
        }
        let before = est.limit();
        let mut queued = false;
        for _ in 0..500 {
            now += 1_000_000;
            let v = est.observe(Sample { now_ns: now, latency_ns: 30_000_000, concurrency: 64, congested: false });
            queued |= matches!(v, Some(Verdict::Queued));
        }
        assert!(queued && est.limit() < before, "limit {before} -> {}", est.limit());
    }

    #[test]
    fn a_lucky_first_window_does_not_starve_the_backend() {
        // A backend of 4 slots and 20 ms jobs whose first 16 answers came
        // back in 5 ms: the baseline starts far too low, and at concurrency
        // 1 every window looks queued. The first window at concurrency 1
        // corrects it, and slow start finds the slots within a second.
        let mut est = LimitEstimator::new(params());
        let mut now = 0u64;
        let mut seen = Vec::new();
        for i in 0..400u64 {
            let l = est.limit();
            let latency = if i < 16 { 5e6 } else { 20e6 * (l as f64 / 4.0).max(1.0) };
            now += (latency / l as f64) as u64;
            let s = Sample { now_ns: now, latency_ns: latency as u64, concurrency: l, congested: false };
            if let Some(v) = est.observe(s) {
                seen.push((v, est.limit(), now / 1_000_000));
            }
            if now > 1_500_000_000 {
                break;
            }
        }
        assert!(seen.iter().any(|(v, _, _)| *v == Verdict::Rebaselined), "{seen:?}");
        assert!(est.limit() >= 3, "limit {} after 1.5 s: {seen:?}", est.limit());
        assert!(est.baseline().unwrap() >= Duration::from_millis(15), "{:?}", est.baseline());
    }

    #[test]
    fn one_burst_of_sheds_cuts_the_limit_once() {
        let mut est = LimitEstimator::new(LimitParams { initial: 40.0, ..params() });
        for i in 0..30u64 {
            est.observe(Sample { now_ns: 1_000_000 + i, latency_ns: 200_000, concurrency: 40, congested: true });
        }
        assert_eq!(est.limit(), 35, "39 * 0.9, once");
    }
}
