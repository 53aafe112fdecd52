//! Open-loop schedules: a fixed rate ([`Plan`], event `i` due at
//! `start + i / rate`) and a timetable of steps ([`Timetable`], each step a
//! rate for some seconds, evenly spaced or Poisson).

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

/// When each event of an open-loop run is due.
pub trait Schedule: Send + 'static {
    /// Events in the run.
    fn count(&self) -> u64;
    /// When event `i` (< `count`) is due, relative to the start.
    fn offset(&self, i: u64) -> Duration;
}

impl Schedule for Plan {
    fn count(&self) -> u64 {
        self.count
    }
    fn offset(&self, i: u64) -> Duration {
        Plan::offset(self, i)
    }
}

/// Events a timetable may hold at most (its offsets live in memory).
pub const MAX_TIMETABLE_EVENTS: u64 = 5_000_000;

/// One step of a timetable: `rate` events per second for `duration_s`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Step {
    /// Events per second (0 = a pause).
    pub rate: f64,
    /// Length of the step, seconds.
    pub duration_s: f64,
}

/// Parses `RATE:SECONDS[,RATE:SECONDS...]`.
pub fn parse_steps(text: &str) -> anyhow::Result<Vec<Step>> {
    let mut steps = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((rate, secs)) = part.split_once(':') else {
            bail!("step {part:?} is not RATE:SECONDS");
        };
        let rate: f64 = rate.trim().parse().map_err(|_| anyhow::anyhow!("step {part:?}: bad rate"))?;
        let duration_s: f64 = secs.trim().parse().map_err(|_| anyhow::anyhow!("step {part:?}: bad seconds"))?;
        ensure!(rate.is_finite() && rate >= 0.0, "step {part:?}: the rate must be 0 or more");
        run_length(duration_s)?;
        steps.push(Step { rate, duration_s });
    }
    ensure!(!steps.is_empty(), "no step given");
    let total: f64 = steps.iter().map(|s| s.duration_s).sum();
    ensure!(total <= MAX_DURATION_S, "the steps last {total} s, more than {MAX_DURATION_S}");
    Ok(steps)
}

/// A precomputed schedule of steps.
#[derive(Debug, Clone)]
pub struct Timetable {
    offsets: Vec<Duration>,
    /// Index of the first event of each step (`first[k] ..first[k+1]`).
    first: Vec<u64>,
    /// Start of each step, relative to the run's start.
    starts: Vec<Duration>,
}

impl Timetable {
    /// Evenly spaced events within each step, or Poisson arrivals
    /// (exponential gaps, from `seed`) when `poisson` is set.
    pub fn new(steps: &[Step], poisson: bool, seed: u64) -> anyhow::Result<Timetable> {
        let expected: f64 = steps.iter().map(|s| s.rate * s.duration_s).sum();
        ensure!(
            expected <= MAX_TIMETABLE_EVENTS as f64,
            "{expected} events is more than the {MAX_TIMETABLE_EVENTS} a timetable may hold"
        );
        let mut rng = fastrand::Rng::with_seed(seed);
        let (mut offsets, mut first, mut starts) = (Vec::new(), Vec::new(), Vec::new());
        let mut start = 0.0_f64;
        for step in steps {
            first.push(offsets.len() as u64);
            starts.push(Duration::from_secs_f64(start));
            let end = start + step.duration_s;
            if step.rate > 0.0 {
                if poisson {
                    let mut t = start;
                    loop {
                        t += -(1.0 - rng.f64()).ln() / step.rate;
                        if t >= end || offsets.len() as u64 >= MAX_TIMETABLE_EVENTS {
                            break;
                        }
                        offsets.push(Duration::from_secs_f64(t));
                    }
                } else {
                    let n = (step.rate * step.duration_s).floor() as u64;
                    for k in 0..n {
                        offsets.push(Duration::from_secs_f64(start + k as f64 / step.rate));
                    }
                }
            }
            start = end;
        }
        ensure!(!offsets.is_empty(), "the steps schedule no event");
        Ok(Timetable { offsets, first, starts })
    }

    /// The step event `i` belongs to.
    pub fn step_of(&self, i: u64) -> usize {
        self.first.partition_point(|&f| f <= i).saturating_sub(1)
    }

    /// When step `k` starts, relative to the run's start.
    pub fn step_start(&self, k: usize) -> Duration {
        self.starts.get(k).copied().unwrap_or_default()
    }

    /// Events in step `k`.
    pub fn step_count(&self, k: usize) -> u64 {
        let end = self.first.get(k + 1).copied().unwrap_or(self.offsets.len() as u64);
        end - self.first.get(k).copied().unwrap_or(end)
    }
}

impl Schedule for Timetable {
    fn count(&self) -> u64 {
        self.offsets.len() as u64
    }
    fn offset(&self, i: u64) -> Duration {
        usize::try_from(i).ok().and_then(|i| self.offsets.get(i)).copied().unwrap_or_default()
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
    fn steps_parse_and_lay_out_back_to_back() {
        let steps = parse_steps("10:1, 0:0.5,20:1").unwrap();
        assert_eq!(steps.len(), 3);
        let t = Timetable::new(&steps, false, 1).unwrap();
        assert_eq!(t.count(), 30);
        assert_eq!(t.offset(0), Duration::ZERO);
        assert_eq!(t.offset(10), Duration::from_millis(1500));
        assert_eq!(t.offset(11), Duration::from_millis(1550));
        assert_eq!((t.step_of(9), t.step_of(10), t.step_of(29)), (0, 2, 2));
        assert_eq!((t.step_count(0), t.step_count(1), t.step_count(2)), (10, 0, 20));
        assert_eq!(t.step_start(2), Duration::from_millis(1500));
        assert!(parse_steps("10").is_err());
        assert!(parse_steps("-1:1").is_err());
        assert!(parse_steps("").is_err());
        assert!(Timetable::new(&parse_steps("0:1").unwrap(), false, 1).is_err());
    }

    #[test]
    fn poisson_arrivals_are_ordered_and_near_the_rate() {
        let t = Timetable::new(&parse_steps("1000:2,500:2").unwrap(), true, 7).unwrap();
        let n = t.count();
        assert!((2700..3300).contains(&n), "{n}");
        assert!((1..n).all(|i| t.offset(i) >= t.offset(i - 1)));
        assert!(t.offset(n - 1) < Duration::from_secs(4));
        let first_step = t.step_count(0);
        assert!((1800..2200).contains(&first_step), "{first_step}");
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
