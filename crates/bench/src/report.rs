//! Latency histograms, error counts and their JSON shape.

use std::collections::BTreeMap;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

/// Highest latency recorded exactly: one hour, in microseconds; larger
/// values are clamped to it.
const HIGHEST_US: u64 = 3_600_000_000;

/// A latency histogram in microseconds (3 significant digits).
pub struct Latency {
    hist: Histogram<u64>,
}

impl Default for Latency {
    fn default() -> Self {
        Latency::new()
    }
}

impl Latency {
    /// An empty histogram.
    pub fn new() -> Latency {
        // Constant, valid bounds: this cannot fail.
        let hist = Histogram::new_with_bounds(1, HIGHEST_US, 3).expect("valid histogram bounds");
        Latency { hist }
    }

    /// Records one duration (at least 1 us, at most one hour).
    pub fn record(&mut self, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        self.hist.saturating_record(us.clamp(1, HIGHEST_US));
    }

    /// Adds every value of `other`.
    pub fn merge(&mut self, other: &Latency) {
        // Same bounds on both sides, so adding cannot fail; if it ever did,
        // the loss would show up as a lower count.
        let _ = self.hist.add(&other.hist);
    }

    /// Values recorded.
    #[cfg(test)]
    pub fn count(&self) -> u64 {
        self.hist.len()
    }

    /// The percentiles, max and mean.
    pub fn summary(&self) -> Summary {
        if self.hist.is_empty() {
            return Summary::default();
        }
        Summary {
            count: self.hist.len(),
            p50: self.hist.value_at_quantile(0.50),
            p90: self.hist.value_at_quantile(0.90),
            p99: self.hist.value_at_quantile(0.99),
            p999: self.hist.value_at_quantile(0.999),
            max: self.hist.max(),
            mean: (self.hist.mean() * 10.0).round() / 10.0,
        }
    }
}

/// Latency summary in microseconds.
#[derive(Debug, Default, Clone, PartialEq, Serialize)]
pub struct Summary {
    /// Values recorded.
    pub count: u64,
    /// Median.
    pub p50: u64,
    /// 90th percentile.
    pub p90: u64,
    /// 99th percentile.
    pub p99: u64,
    /// 99.9th percentile.
    pub p999: u64,
    /// Largest value.
    pub max: u64,
    /// Mean, rounded to 0.1 us.
    pub mean: f64,
}

/// Counts by label (`admin_status_503`, `proxy_timeout`, ...).
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Counts(BTreeMap<String, u64>);

impl Counts {
    /// Adds one to `label`.
    pub fn bump(&mut self, label: impl Into<String>) {
        *self.0.entry(label.into()).or_default() += 1;
    }

    /// Adds every count of `other`.
    pub fn merge(&mut self, other: &Counts) {
        for (k, v) in &other.0 {
            *self.0.entry(k.clone()).or_default() += v;
        }
    }

    /// Sum of all counts.
    pub fn total(&self) -> u64 {
        self.0.values().sum()
    }
}

/// Events per second, rounded to 0.1; 0 for an empty window.
pub fn per_second(events: u64, window: Duration) -> f64 {
    let secs = window.as_secs_f64();
    if secs <= 0.0 {
        return 0.0;
    }
    (events as f64 / secs * 10.0).round() / 10.0
}

/// Seconds rounded to the millisecond, for the JSON.
pub fn seconds(d: Duration) -> f64 {
    (d.as_secs_f64() * 1000.0).round() / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_histogram_summarises_to_zeros() {
        assert_eq!(Latency::new().summary(), Summary::default());
    }

    #[test]
    fn percentiles_of_one_to_a_thousand_microseconds() {
        let mut lat = Latency::new();
        for us in 1..=1000 {
            lat.record(Duration::from_micros(us));
        }
        let s = lat.summary();
        assert_eq!(s.count, 1000);
        assert_eq!(s.p50, 500);
        assert_eq!(s.p90, 900);
        assert_eq!(s.p99, 990);
        assert_eq!(s.p999, 999);
        assert_eq!(s.max, 1000);
        assert!((s.mean - 500.5).abs() < 0.2, "{}", s.mean);
    }

    #[test]
    fn outliers_are_clamped_not_dropped() {
        let mut lat = Latency::new();
        lat.record(Duration::ZERO);
        lat.record(Duration::from_secs(10 * 3600));
        let s = lat.summary();
        assert_eq!(s.count, 2);
        assert!(s.max >= HIGHEST_US);
    }

    #[test]
    fn merge_adds_values_and_counts() {
        let mut a = Latency::new();
        let mut b = Latency::new();
        a.record(Duration::from_micros(10));
        b.record(Duration::from_micros(20));
        a.merge(&b);
        assert_eq!(a.count(), 2);
        let mut c = Counts::default();
        c.bump("x");
        let mut d = Counts::default();
        d.bump("x");
        d.bump("y");
        c.merge(&d);
        assert_eq!(c.total(), 3);
        assert_eq!(serde_json::to_string(&c).unwrap(), r#"{"x":2,"y":1}"#);
    }

    #[test]
    fn rates_round_and_tolerate_empty_windows() {
        assert_eq!(per_second(150, Duration::from_secs(2)), 75.0);
        assert_eq!(per_second(1, Duration::ZERO), 0.0);
        assert_eq!(per_second(1, Duration::from_secs(3)), 0.3);
    }
}
