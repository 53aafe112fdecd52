//! A histogram the request path can write without a lock.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;

/// Upper bounds of the buckets, in seconds: from 0.5 ms (a proxied request
/// on loopback) to 10 s, about three per decade.
pub const BOUNDS_S: [f64; 14] = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

const BOUNDS_NS: [u64; 14] = {
    let mut ns = [0u64; 14];
    let mut i = 0;
    while i < ns.len() {
        ns[i] = (BOUNDS_S[i] * 1e9) as u64;
        i += 1;
    }
    ns
};

/// Durations counted in fixed buckets ([`BOUNDS_S`] and +Inf), with their
/// sum. Observing is two relaxed atomic additions.
#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [AtomicU64; BOUNDS_S.len() + 1],
    sum_ns: AtomicU64,
}

/// What a [`Histogram`] held when read.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HistogramSnapshot {
    /// Observations per bucket (not cumulative), the last one above every bound.
    pub buckets: [u64; BOUNDS_S.len() + 1],
    /// Sum of the observations, in seconds.
    pub sum_s: f64,
}

impl HistogramSnapshot {
    /// Number of observations.
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    /// Adds another snapshot's observations to this one.
    pub fn add(&mut self, other: &HistogramSnapshot) {
        for (a, b) in self.buckets.iter_mut().zip(&other.buckets) {
            *a += b;
        }
        self.sum_s += other.sum_s;
    }
}

/// A duration in nanoseconds, saturated.
fn nanos(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Histogram {
    /// Counts one duration.
    pub fn observe(&self, d: std::time::Duration) {
        self.observe_ns(nanos(d));
    }

    /// Counts one duration, in nanoseconds.
    pub fn observe_ns(&self, ns: u64) {
        let i = BOUNDS_NS.partition_point(|&bound| bound < ns);
        self.buckets[i].fetch_add(1, Relaxed);
        self.sum_ns.fetch_add(ns, Relaxed);
    }

    /// Reads the counts (each bucket on its own: a scrape during writes may
    /// be off by the observations in progress).
    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut s = HistogramSnapshot::default();
        for (to, from) in s.buckets.iter_mut().zip(&self.buckets) {
            *to = from.load(Relaxed);
        }
        s.sum_s = self.sum_ns.load(Relaxed) as f64 / 1e9;
        s
    }
}

/// A [`Histogram`] allocated at its first observation: series that never
/// see traffic (most of 10,000 routes, say) cost one pointer.
#[derive(Debug, Default)]
pub struct LazyHistogram(OnceLock<Box<Histogram>>);

impl LazyHistogram {
    /// Counts one duration.
    pub fn observe(&self, d: std::time::Duration) {
        self.observe_ns(nanos(d));
    }

    /// Counts one duration, in nanoseconds.
    pub fn observe_ns(&self, ns: u64) {
        self.0.get_or_init(Box::default).observe_ns(ns);
    }

    /// The counts, if anything was observed.
    pub fn snapshot(&self) -> Option<HistogramSnapshot> {
        self.0.get().map(|h| h.snapshot())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_land_in_the_first_bucket_whose_bound_holds_them() {
        let h = Histogram::default();
        h.observe_ns(1); // <= 0.5 ms
        h.observe_ns(500_000); // exactly 0.5 ms: that bucket (le is inclusive)
        h.observe_ns(500_001); // just above: the 1 ms bucket
        h.observe_ns(20_000_000_000); // 20 s: +Inf
        let s = h.snapshot();
        assert_eq!(s.buckets[0], 2);
        assert_eq!(s.buckets[1], 1);
        assert_eq!(s.buckets[BOUNDS_S.len()], 1);
        assert_eq!(s.count(), 4);
        assert!((s.sum_s - 20.001_000_002).abs() < 1e-9, "{}", s.sum_s);
    }

    #[test]
    fn a_lazy_histogram_exists_only_once_observed() {
        let h = LazyHistogram::default();
        assert_eq!(h.snapshot(), None);
        h.observe_ns(2_000_000);
        assert_eq!(h.snapshot().map(|s| s.buckets[2]), Some(1));
    }
}
