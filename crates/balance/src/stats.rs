//! Live per-backend statistics, updated with atomics on the request path.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// Counters and gauges of one backend. Shared across snapshots by `Arc`.
#[derive(Debug, Default)]
pub struct BackendStats {
    in_flight: AtomicU64,
    requests: AtomicU64,
    failures: AtomicU64,
    /// Latency EWMA in nanoseconds, as f64 bits (0 = no sample yet).
    latency_ewma: AtomicU64,
}

/// How an upstream attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A response came back (any status below 500).
    Success,
    /// The backend answered 5xx, reset, or timed out.
    Failure,
}

/// Weight of a new latency sample in the EWMA.
const EWMA_ALPHA: f64 = 0.2;

impl BackendStats {
    /// Marks a request as started; the guard marks it finished when dropped
    /// or when [`InFlight::finish`] records its outcome.
    pub fn start(self: &std::sync::Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Relaxed);
        InFlight {
            stats: self.clone(),
            started: Instant::now(),
            done: false,
        }
    }

    /// Requests in flight now.
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Relaxed)
    }

    /// Latency EWMA, if any sample was recorded.
    pub fn latency_ewma(&self) -> Option<Duration> {
        let ns = f64::from_bits(self.latency_ewma.load(Relaxed));
        (ns > 0.0).then(|| Duration::from_nanos(ns as u64))
    }

    fn record(&self, outcome: Outcome, latency: Duration) {
        self.requests.fetch_add(1, Relaxed);
        if outcome == Outcome::Failure {
            self.failures.fetch_add(1, Relaxed);
        }
        let sample = latency.as_nanos() as f64;
        let _ = self.latency_ewma.fetch_update(Relaxed, Relaxed, |bits| {
            let old = f64::from_bits(bits);
            let new = if old > 0.0 {
                old + EWMA_ALPHA * (sample - old)
            } else {
                sample.max(1.0)
            };
            Some(new.to_bits())
        });
    }

    /// A consistent-enough copy for status pages.
    pub fn view(&self) -> StatsView {
        StatsView {
            in_flight: self.in_flight(),
            requests: self.requests.load(Relaxed),
            failures: self.failures.load(Relaxed),
            latency_ewma_ms: self.latency_ewma().map(|d| d.as_secs_f64() * 1e3),
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
}

/// A request in flight to a backend: counted in flight until dropped (the
/// proxy drops it when the response body ends). [`InFlight::record`] takes
/// the outcome and the latency to the response headers; dropping it without
/// a record counts a request without a latency sample (the client went away).
#[derive(Debug)]
pub struct InFlight {
    stats: std::sync::Arc<BackendStats>,
    started: Instant,
    done: bool,
}

impl InFlight {
    /// Records the outcome and the latency since the start (once; later
    /// calls are ignored).
    pub fn record(&mut self, outcome: Outcome) {
        if !self.done {
            self.stats.record(outcome, self.started.elapsed());
            self.done = true;
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.stats.in_flight.fetch_sub(1, Relaxed);
        if !self.done {
            self.stats.requests.fetch_add(1, Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

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
}
