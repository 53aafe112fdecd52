//! A sliding one-second completion-rate estimate.
//!
//! Completions are counted in whole-second buckets; the rate is the current
//! bucket plus the previous bucket weighted by the part of it still inside the
//! one-second window ending now.

use std::sync::{Mutex, PoisonError};
use std::time::Instant;

/// Counts events and estimates their recent rate per second.
#[derive(Debug)]
pub struct RateMeter {
    origin: Instant,
    window: Mutex<Window>,
}

#[derive(Debug, Default)]
struct Window {
    second: u64,
    current: u64,
    previous: u64,
}

impl Window {
    /// Moves the window forward to `second`, dropping buckets that fell out.
    fn roll(&mut self, second: u64) {
        if second <= self.second {
            return;
        }
        self.previous = if second == self.second + 1 { self.current } else { 0 };
        self.current = 0;
        self.second = second;
    }
}

impl Default for RateMeter {
    fn default() -> Self {
        Self::new()
    }
}

impl RateMeter {
    /// Creates an empty meter.
    pub fn new() -> Self {
        Self::starting_at(Instant::now())
    }

    fn starting_at(origin: Instant) -> Self {
        Self { origin, window: Mutex::new(Window::default()) }
    }

    /// Records one event now.
    pub fn record(&self) {
        self.record_at(Instant::now());
    }

    /// Events per second over the last second.
    pub fn rate(&self) -> f64 {
        self.rate_at(Instant::now())
    }

    fn record_at(&self, now: Instant) {
        let second = now.saturating_duration_since(self.origin).as_secs();
        let mut window = self.window.lock().unwrap_or_else(PoisonError::into_inner);
        window.roll(second);
        window.current += 1;
    }

    fn rate_at(&self, now: Instant) -> f64 {
        let elapsed = now.saturating_duration_since(self.origin);
        let fraction = f64::from(elapsed.subsec_nanos()) / 1e9;
        let mut window = self.window.lock().unwrap_or_else(PoisonError::into_inner);
        window.roll(elapsed.as_secs());
        window.previous as f64 * (1.0 - fraction) + window.current as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn at(origin: Instant, ms: u64) -> Instant {
        origin + Duration::from_millis(ms)
    }

    #[test]
    fn rate_counts_recent_events() {
        let t0 = Instant::now();
        let meter = RateMeter::starting_at(t0);
        assert!(meter.rate_at(t0).abs() < 1e-9);
        for ms in (0..1000).step_by(10) {
            meter.record_at(at(t0, ms));
        }
        assert!((meter.rate_at(at(t0, 999)) - 100.0).abs() < 1e-6);
        // Halfway through the next second, half of the previous bucket counts.
        assert!((meter.rate_at(at(t0, 1500)) - 50.0).abs() < 1e-6);
        meter.record_at(at(t0, 1600));
        assert!((meter.rate_at(at(t0, 1750)) - 26.0).abs() < 1e-6);
    }

    #[test]
    fn old_events_expire() {
        let t0 = Instant::now();
        let meter = RateMeter::starting_at(t0);
        meter.record_at(at(t0, 100));
        assert!(meter.rate_at(at(t0, 3000)).abs() < 1e-9);
        meter.record_at(at(t0, 3100));
        assert!((meter.rate_at(at(t0, 3200)) - 1.0).abs() < 1e-9);
    }
}
