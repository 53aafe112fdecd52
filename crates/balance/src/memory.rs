//! What a backend's statistics have learned, in a form that outlives the
//! process: a new binary taking over (`serve --takeover`) receives it with
//! the listening sockets and balances from its first request as the old
//! one did, instead of learning every limit again by queueing and failing
//! requests, and sending traffic to backends the old process knew were
//! down or ejected.
//!
//! Times travel as offsets from the sender's clock reading (the two
//! processes' [`clock`](crate::clock)s have different origins), and every
//! value is checked when it is read: a memory that does not make sense
//! (a non-finite latency, a limit out of the service's bounds) is not
//! applied, in part or whole, and never panics.

use std::sync::atomic::Ordering::Relaxed;

use serde::{Deserialize, Serialize};

use crate::limit::{LimitEstimator, LimitParams};
use crate::stats::{ActiveState, BackendStats};

/// A backend's learned state. Counters of requests and failures are not
/// part of it: they are the process's own (Prometheus sees a restart).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BackendMemory {
    /// The latency EWMA, ns (0 = no sample yet).
    pub latency_ewma_ns: f64,
    /// The peak-EWMA latency, ns, and how long before the reading it was
    /// last updated.
    pub peak_ewma_ns: f64,
    /// Age of the peak EWMA's last update, ns.
    pub peak_age_ns: u64,
    /// The active health check's verdict and its current streaks.
    pub active: Active,
    /// Consecutive passing probes.
    pub probe_passes: u32,
    /// Consecutive failing probes.
    pub probe_fails: u32,
    /// Consecutive failed requests (passive check).
    pub consecutive_failures: u32,
    /// Recent ejections in a row (the next one's length doubles per).
    pub ejections: u32,
    /// Ejections since the backend appeared.
    pub ejections_total: u64,
    /// When the current (or last) ejection ends, ms from the reading
    /// (negative: in the past); `None` if it was never ejected.
    pub ejected_until_ms: Option<i64>,
    /// Since when it is available (slow start), ms from the reading.
    pub available_since_ms: i64,
    /// The learned concurrency limit, if one is learned.
    pub limit: Option<LimitMemory>,
}

/// [`ActiveState`] on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Active {
    /// No active check, or no result yet.
    Unchecked,
    /// Passing.
    Up,
    /// Failing.
    Down,
}

impl From<ActiveState> for Active {
    fn from(s: ActiveState) -> Active {
        match s {
            ActiveState::Unchecked => Active::Unchecked,
            ActiveState::Up => Active::Up,
            ActiveState::Down => Active::Down,
        }
    }
}

impl From<Active> for ActiveState {
    fn from(s: Active) -> ActiveState {
        match s {
            Active::Unchecked => ActiveState::Unchecked,
            Active::Up => ActiveState::Up,
            Active::Down => ActiveState::Down,
        }
    }
}

/// What a learned-limit estimator knows: its limit, the no-load latency,
/// the level found queued, and whether it is still in slow start. The
/// window being filled is not carried (a new one starts).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LimitMemory {
    /// The limit (fractional: it grows by quarters and ones).
    pub limit: f64,
    /// The no-load latency, ns (0 = not learned yet).
    pub baseline_ns: f64,
    /// The lowest level found queued, while remembered, and its age (ns).
    pub ceiling: Option<(f64, u64)>,
    /// In slow start: the sum (ns) and count of the answers of requests
    /// that were alone in flight so far.
    pub slow_start: Option<(f64, u32)>,
}

/// Why a memory was not applied.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct MemoryError {
    /// The field at fault.
    pub field: &'static str,
    /// What is wrong with it.
    pub reason: &'static str,
}

fn finite_nonnegative(field: &'static str, v: f64) -> Result<f64, MemoryError> {
    match v.is_finite() && v >= 0.0 {
        true => Ok(v),
        false => Err(MemoryError { field, reason: "not a finite, non-negative number" }),
    }
}

/// `now + offset`, at least 0 (a time before this process's clock began).
fn shifted(now: u64, offset: i64) -> u64 {
    now.saturating_add_signed(offset)
}

/// `at - now` as a signed offset.
fn offset(at: u64, now: u64) -> i64 {
    let diff = i128::from(at) - i128::from(now);
    diff.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64
}

impl LimitEstimator {
    /// What this estimator has learned, read at `now_ns`.
    pub fn memory(&self, now_ns: u64) -> LimitMemory {
        LimitMemory {
            limit: self.limit,
            baseline_ns: self.baseline_ns,
            ceiling: self.ceiling.map(|c| (c, now_ns.saturating_sub(self.ceiling_since_ns))),
            slow_start: self.slow_start,
        }
    }

    /// An estimator with `params` that goes on from `memory`, at `now_ns`.
    /// The limit is kept within the parameters' bounds (they may have
    /// changed); a memory with a value that is not a finite, non-negative
    /// number is refused.
    pub fn resume(params: LimitParams, memory: &LimitMemory, now_ns: u64) -> Result<LimitEstimator, MemoryError> {
        let limit = finite_nonnegative("limit.limit", memory.limit)?;
        let baseline_ns = finite_nonnegative("limit.baseline_ns", memory.baseline_ns)?;
        if let Some((c, _)) = memory.ceiling {
            finite_nonnegative("limit.ceiling", c)?;
        }
        if let Some((sum, _)) = memory.slow_start {
            finite_nonnegative("limit.slow_start", sum)?;
        }
        let mut est = LimitEstimator::new(params);
        est.limit = limit.clamp(params.min, params.max);
        est.baseline_ns = baseline_ns;
        est.ceiling = memory.ceiling.map(|(c, _)| c);
        est.ceiling_since_ns = memory.ceiling.map_or(0, |(_, age)| now_ns.saturating_sub(age));
        est.slow_start = memory.slow_start;
        Ok(est)
    }
}

impl BackendStats {
    /// What this backend's statistics have learned, read at `now_ms` and
    /// `now_ns` on the [`clock`](crate::clock).
    pub fn memory(&self, now_ms: u64, now_ns: u64) -> BackendMemory {
        let ejected_until = self.ejected_until_ms.load(Relaxed);
        BackendMemory {
            latency_ewma_ns: self.latency_ewma.get(),
            peak_ewma_ns: self.peak_ewma.get(),
            peak_age_ns: now_ns.saturating_sub(self.peak_stamp_ns.load(Relaxed)),
            active: self.active_state().into(),
            probe_passes: self.probe_passes.load(Relaxed),
            probe_fails: self.probe_fails.load(Relaxed),
            consecutive_failures: self.consecutive_failures.load(Relaxed),
            ejections: self.ejections.load(Relaxed),
            ejections_total: self.ejections_total.load(Relaxed),
            ejected_until_ms: (ejected_until > 0).then(|| offset(ejected_until, now_ms)),
            available_since_ms: offset(self.available_since_ms.load(Relaxed), now_ms),
            limit: self.learner().as_ref().map(|l| l.memory(now_ns)),
        }
    }

    /// Takes `memory` over, at `now_ms` and `now_ns`: what the old process
    /// learned about this backend. The learned limit is taken only if this
    /// backend learns one (with this process's parameters). Nothing is
    /// changed when a value does not make sense.
    pub fn recall(&self, memory: &BackendMemory, now_ms: u64, now_ns: u64) -> Result<(), MemoryError> {
        let latency = finite_nonnegative("latency_ewma_ns", memory.latency_ewma_ns)?;
        let peak = finite_nonnegative("peak_ewma_ns", memory.peak_ewma_ns)?;
        let mut learner = self.learner();
        let resumed = match (learner.as_ref(), &memory.limit) {
            (Some(l), Some(m)) => Some(LimitEstimator::resume(l.params(), m, now_ns)?),
            _ => None,
        };
        self.latency_ewma.set(latency);
        self.peak_ewma.set(peak);
        self.peak_stamp_ns.store(now_ns.saturating_sub(memory.peak_age_ns), Relaxed);
        self.active.store(ActiveState::from(memory.active) as u8, Relaxed);
        self.probe_passes.store(memory.probe_passes, Relaxed);
        self.probe_fails.store(memory.probe_fails, Relaxed);
        self.consecutive_failures.store(memory.consecutive_failures, Relaxed);
        self.ejections.store(memory.ejections, Relaxed);
        self.ejections_total.store(memory.ejections_total, Relaxed);
        // An ejection that ended before this clock began still counts as
        // one that ended (1 ms, not 0 = never).
        let until = memory.ejected_until_ms.map_or(0, |o| shifted(now_ms, o).max(1));
        self.ejected_until_ms.store(until, Relaxed);
        self.available_since_ms.store(shifted(now_ms, memory.available_since_ms), Relaxed);
        if let Some(resumed) = resumed {
            self.set_limit(resumed.limit());
            *learner = Some(resumed);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::Sample;
    use crate::Outcome;
    use std::time::Duration;

    fn params() -> LimitParams {
        LimitParams { tolerance: 1.5, initial: 1.0, min: 1.0, max: 1000.0, min_rise_ns: 1e6 }
    }

    /// A backend whose limit was learned, one ejection and a failed probe:
    /// a second backend that recalls its memory reads the same.
    #[test]
    fn a_backend_that_recalls_another_ones_memory_reads_the_same() {
        let old = BackendStats::default();
        old.learn_limit(Some(params()));
        let mut now_ns = 1_000_000_000;
        for i in 0..200u64 {
            now_ns += 1_000_000;
            old.record(Outcome::Success, Duration::from_millis(2), 1 + i % 4, now_ns);
        }
        old.record_probe(false, 1, 1, 5_000);
        old.ejected_until_ms.store(9_000, Relaxed);
        old.ejections.store(2, Relaxed);
        old.ejections_total.store(3, Relaxed);
        let memory = old.memory(5_000, now_ns);
        assert!(memory.limit.is_some());
        assert_eq!(memory.ejected_until_ms, Some(4_000));

        // Another process: its clock reads something else.
        let new = BackendStats::default();
        new.learn_limit(Some(params()));
        let json = serde_json::to_string(&memory).expect("encodes");
        let read: BackendMemory = serde_json::from_str(&json).expect("decodes");
        new.recall(&read, 100_000, 7_000_000_000).expect("applies");
        let (a, b) = (old.view(), new.view());
        assert_eq!(b.learned_limit, a.learned_limit);
        assert_eq!(b.no_load_latency_ms, a.no_load_latency_ms);
        assert_eq!(b.latency_ewma_ms, a.latency_ewma_ms);
        assert_eq!(new.active_state(), ActiveState::Down);
        assert_eq!((b.ejections, b.ejections_total), (2, 3));
        assert!(new.is_ejected(103_999) && !new.is_ejected(104_000));
        assert_eq!(new.memory(100_000, 7_000_000_000), memory);
    }

    #[test]
    fn a_memory_that_makes_no_sense_changes_nothing() {
        let stats = BackendStats::default();
        stats.learn_limit(Some(params()));
        let mut memory = stats.memory(10, 10);
        memory.latency_ewma_ns = f64::NAN;
        memory.ejections_total = 7;
        let e = stats.recall(&memory, 10, 10).expect_err("refused");
        assert_eq!(e.field, "latency_ewma_ns");
        assert_eq!(stats.view().ejections_total, 0);

        let mut memory = stats.memory(10, 10);
        if let Some(l) = memory.limit.as_mut() {
            l.limit = f64::INFINITY;
        }
        memory.ejections_total = 7;
        let e = stats.recall(&memory, 10, 10).expect_err("refused");
        assert_eq!(e.field, "limit.limit");
        assert_eq!(stats.view().ejections_total, 0);
    }

    #[test]
    fn a_remembered_limit_is_kept_within_the_new_bounds() {
        let mut est = LimitEstimator::new(params());
        let mut now = 0;
        for _ in 0..400 {
            now += 1_000_000;
            est.observe(Sample { now_ns: now, latency_ns: 1_000_000, concurrency: est.limit(), congested: false });
        }
        assert!(est.limit() > 8, "learned {}", est.limit());
        let narrow = LimitParams { max: 4.0, ..params() };
        let resumed = LimitEstimator::resume(narrow, &est.memory(now), 0).expect("resumes");
        assert_eq!(resumed.limit(), 4);
        assert_eq!(resumed.baseline(), est.baseline());
    }

    #[test]
    fn a_limit_is_recalled_only_by_a_backend_that_learns_one() {
        let old = BackendStats::default();
        old.learn_limit(Some(params()));
        let memory = old.memory(0, 0);
        let new = BackendStats::default();
        new.recall(&memory, 0, 0).expect("applies");
        assert!(!new.learns_limit());
        assert_eq!(new.learned_limit(), u64::MAX);
    }
}
