//! The open-loop schedule: event `i` is due at `start + i / rate`.

use std::time::Duration;

use anyhow::{bail, ensure};

/// Events one run may schedule at most (bounds memory and time).
pub const MAX_EVENTS: u64 = 50_000_000;

/// Longest sending window accepted, in seconds (one day).
pub const MAX_DURATION_S: f64 = 86_400.0;

/// A fixed-rate schedule of `count` events.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Plan {
    /// Events per second.
    pub rate: f64,
    /// Events in the run: `floor(rate * duration)`.
    pub count: u64,
}

impl Plan {
    /// The schedule for `rate` events per second during `duration_s` seconds.
    pub fn new(rate: f64, duration_s: f64) -> anyhow::Result<Plan> {
        ensure!(rate.is_finite() && rate > 0.0, "rate must be a positive number, got {rate}");
        run_length(duration_s)?;
        let events = (rate * duration_s).floor();
        if events > MAX_EVENTS as f64 {
            bail!("{events} events is more than the {MAX_EVENTS} one run may schedule");
        }
        let count = events as u64;
        ensure!(count > 0, "rate x duration schedules no event");
        Ok(Plan { rate, count })
    }

    /// When event `i` is due, relative to the start.
    pub fn offset(&self, i: u64) -> Duration {
        Duration::from_secs_f64(i as f64 / self.rate)
    }
}

/// A positive, finite duration in seconds, bounded by [`MAX_DURATION_S`].
pub fn run_length(duration_s: f64) -> anyhow::Result<Duration> {
    ensure!(
        duration_s.is_finite() && duration_s > 0.0 && duration_s <= MAX_DURATION_S,
        "duration must be within (0, {MAX_DURATION_S}] seconds, got {duration_s}"
    );
    Ok(Duration::from_secs_f64(duration_s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_are_evenly_spaced_from_zero() {
        let plan = Plan::new(200.0, 3.0).unwrap();
        assert_eq!(plan.count, 600);
        assert_eq!(plan.offset(0), Duration::ZERO);
        assert_eq!(plan.offset(1), Duration::from_millis(5));
        assert_eq!(plan.offset(200), Duration::from_secs(1));
        assert_eq!(plan.offset(599), Duration::from_millis(2995));
    }

    #[test]
    fn fractional_rates_and_durations_round_down() {
        let plan = Plan::new(2.5, 1.9).unwrap();
        assert_eq!(plan.count, 4);
        assert_eq!(plan.offset(3), Duration::from_millis(1200));
    }

    #[test]
    fn offsets_do_not_drift_over_long_runs() {
        let plan = Plan::new(3.0, 3600.0).unwrap();
        let last = plan.offset(plan.count - 1);
        let expected = Duration::from_secs_f64((plan.count - 1) as f64 / 3.0);
        assert!(last.abs_diff(expected) < Duration::from_micros(1));
    }

    #[test]
    fn nonsense_is_refused() {
        assert!(Plan::new(0.0, 1.0).is_err());
        assert!(Plan::new(-1.0, 1.0).is_err());
        assert!(Plan::new(f64::NAN, 1.0).is_err());
        assert!(Plan::new(10.0, 0.0).is_err());
        assert!(Plan::new(10.0, f64::INFINITY).is_err());
        assert!(Plan::new(0.5, 1.0).is_err(), "no event in the window");
        assert!(Plan::new(1e9, 1000.0).is_err(), "too many events");
        assert!(run_length(0.0).is_err());
        assert_eq!(run_length(1.5).unwrap(), Duration::from_millis(1500));
    }
}
