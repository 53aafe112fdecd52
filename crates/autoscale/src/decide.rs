//! The scaling decision: signals in, desired instance count out. Pure: no
//! IO, no clock; the caller passes the time. Unit-tested with hand-built
//! inputs below.

use std::collections::VecDeque;

use serde::Serialize;
use tidegate_model::AutoscaleSpec;

/// What the proxy saw of a service during one tick (about a second).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, schemars::JsonSchema)]
pub struct Sample {
    /// When, in ms on the caller's clock.
    pub at_ms: u64,
    /// Requests in flight to the service's serving instances.
    pub in_flight: f64,
    /// Mean response time of the serving instances, if known.
    pub latency_ms: Option<f64>,
}

/// How many instances are in which phase.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct Counts {
    /// Serving traffic (including backends not created by the autoscaler).
    pub ready: u32,
    /// Started, not yet ready.
    pub starting: u32,
    /// Taking no new requests, finishing old ones.
    pub draining: u32,
}

impl Counts {
    /// Instances that serve or will serve.
    pub fn current(&self) -> u32 {
        self.ready + self.starting
    }
}

/// The decision's parameters, from the service's `autoscale` block.
#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    /// Fewest instances.
    pub min: u32,
    /// Most instances.
    pub max: u32,
    /// Requests in flight per instance.
    pub target_in_flight: f64,
    /// Latency over which the service is under pressure.
    pub latency_threshold_ms: f64,
    /// Window for scale-in averages.
    pub stable_ms: u64,
    /// Window for scale-out and panic.
    pub panic_ms: u64,
    /// How long load must stay low before a scale-in.
    pub peak_hold_ms: u64,
    /// Operator: no decisions.
    pub paused: bool,
    /// Operator: exactly this many.
    pub pinned: Option<u32>,
}

impl From<&AutoscaleSpec> for Params {
    fn from(a: &AutoscaleSpec) -> Params {
        Params {
            min: a.min,
            max: a.max,
            target_in_flight: f64::from(a.target_in_flight),
            latency_threshold_ms: a.latency_threshold_ms as f64,
            stable_ms: a.stable_window_s * 1_000,
            panic_ms: a.panic_window_s * 1_000,
            peak_hold_ms: a.peak_hold_s * 1_000,
            paused: a.paused,
            pinned: a.pinned,
        }
    }
}

/// Demand must exceed capacity by this share before scaling out, so noise
/// around the target does not add and remove instances.
const TOLERANCE: f64 = 0.2;

/// What the decision remembers between ticks.
#[derive(Debug, Clone, Default)]
pub struct History {
    samples: VecDeque<Sample>,
    /// The last time load did not fit in one instance fewer.
    last_high_ms: u64,
    /// Panic mode lasts until then.
    panic_until_ms: u64,
}

/// Why the desired count is what it is.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, schemars::JsonSchema)]
#[serde(tag = "why", rename_all = "snake_case")]
pub enum Reason {
    /// Nothing to change.
    Steady,
    /// Demand over the short window exceeds capacity.
    Overload,
    /// Demand reached twice the ready capacity: scale at once.
    Panic,
    /// Response time over the threshold: one more instance.
    Latency,
    /// Load stayed low for the peak hold: one instance fewer.
    LowLoad,
    /// Below `min` (or an instance went missing).
    BelowMin,
    /// The operator pinned the count.
    Pinned,
    /// The operator paused autoscaling.
    Paused,
}

/// A decision with the signal values behind it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, schemars::JsonSchema)]
pub struct Decision {
    /// The instance count to reach.
    pub desired: u32,
    /// Why.
    pub reason: Reason,
    /// In panic mode (no scale-in).
    pub panic: bool,
    /// Instances needed, averaged over the panic window.
    pub demand_short: f64,
    /// Instances needed, averaged over the stable window.
    pub demand_long: f64,
    /// Mean latency over the panic window, if known.
    pub latency_ms: Option<f64>,
}

fn mean(xs: impl Iterator<Item = f64>) -> Option<f64> {
    let (sum, n) = xs.fold((0.0, 0u32), |(s, n), x| (s + x, n + 1));
    (n > 0).then(|| sum / f64::from(n))
}

/// Decides the desired instance count after one more sample.
pub fn decide(p: &Params, h: &mut History, sample: Sample, counts: Counts) -> Decision {
    let now = sample.at_ms;
    h.samples.push_back(sample);
    while h.samples.front().is_some_and(|s| now.saturating_sub(s.at_ms) > p.stable_ms) {
        h.samples.pop_front();
    }
    let current = counts.current();
    let ready = counts.ready.max(1);
    let window = |ms: u64| h.samples.iter().filter(move |s| now.saturating_sub(s.at_ms) <= ms);
    let demand = |s: &Sample| s.in_flight / p.target_in_flight;
    let short = mean(window(p.panic_ms).map(demand)).unwrap_or(0.0);
    let long = mean(window(p.stable_ms).map(demand)).unwrap_or(0.0);
    let latency = mean(window(p.panic_ms).filter_map(|s| s.latency_ms));
    let slow = latency.is_some_and(|l| l > p.latency_threshold_ms) && short > 0.0;

    if short >= 2.0 * f64::from(ready) && short >= 1.0 {
        h.panic_until_ms = now + p.stable_ms;
    }
    let panic = now < h.panic_until_ms;
    // "High" = the load would not fit in one instance fewer. The latest
    // sample counts on its own: one brief peak restarts the hold.
    let peak = short.max(demand(&sample));
    if slow || peak > f64::from(current.saturating_sub(1)) * (1.0 - TOLERANCE) || panic {
        h.last_high_ms = now;
    }
    let decision = |desired: u32, reason| Decision {
        desired,
        reason,
        panic,
        demand_short: short,
        demand_long: long,
        latency_ms: latency,
    };
    if p.paused {
        return decision(current, Reason::Paused);
    }
    if let Some(n) = p.pinned {
        return decision(n, Reason::Pinned);
    }
    let clamp = |n: u32| n.clamp(p.min, p.max);
    if current < p.min {
        return decision(p.min, Reason::BelowMin);
    }
    if panic {
        let want = clamp((short.ceil() as u32).max(current));
        return decision(want, if want > current { Reason::Panic } else { Reason::Steady });
    }
    // While an instance starts, wait for it before asking for more.
    if counts.starting == 0 {
        if short > f64::from(current) * (1.0 + TOLERANCE) {
            let want = clamp(short.ceil() as u32);
            if want > current {
                return decision(want, Reason::Overload);
            }
        }
        if slow && current < p.max {
            return decision(current + 1, Reason::Latency);
        }
    }
    let low_for = now.saturating_sub(h.last_high_ms);
    if current > p.min && low_for >= p.peak_hold_ms && long.ceil() < f64::from(current) {
        return decision(clamp(current - 1), Reason::LowLoad);
    }
    decision(clamp(current), Reason::Steady)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> Params {
        Params {
            min: 1,
            max: 6,
            target_in_flight: 8.0,
            latency_threshold_ms: 50.0,
            stable_ms: 60_000,
            panic_ms: 6_000,
            peak_hold_ms: 300_000,
            paused: false,
            pinned: None,
        }
    }

    fn ready(n: u32) -> Counts {
        Counts { ready: n, starting: 0, draining: 0 }
    }

    fn tick(p: &Params, h: &mut History, t_s: u64, in_flight: f64, latency: f64, c: Counts) -> Decision {
        decide(p, h, Sample { at_ms: t_s * 1_000, in_flight, latency_ms: Some(latency) }, c)
    }

    #[test]
    fn a_ramp_scales_out_step_by_step() {
        let (p, mut h) = (params(), History::default());
        let mut n = 1;
        let mut seen = Vec::new();
        // In flight grows by 1 per second to 40 (5 instances' worth), latency fine.
        for t in 0..40 {
            let d = tick(&p, &mut h, t, t as f64, 10.0, ready(n));
            if d.desired != n {
                assert!(d.desired > n, "{d:?}");
                seen.push((t, d.desired, d.reason));
                n = d.desired;
            }
        }
        assert!(n >= 4, "{seen:?}");
        assert!(seen.iter().all(|(_, _, r)| matches!(r, Reason::Overload | Reason::Panic)), "{seen:?}");
    }

    #[test]
    fn a_spike_panics_and_scales_at_once() {
        let (p, mut h) = (params(), History::default());
        for t in 0..10 {
            tick(&p, &mut h, t, 4.0, 10.0, ready(1));
        }
        // 200 in flight for one second: the 6 s average says 4 instances.
        let d = tick(&p, &mut h, 10, 200.0, 10.0, ready(1));
        assert_eq!((d.reason, d.desired, d.panic), (Reason::Panic, 4, true), "{d:?}");
        let d = tick(&p, &mut h, 11, 200.0, 10.0, ready(1));
        assert!(d.desired >= 6, "a second second of it asks for more: {d:?}");
        // Demand falls at once, but panic forbids scaling in.
        for t in 12..40 {
            let d = tick(&p, &mut h, t, 1.0, 10.0, ready(6));
            assert!(d.desired >= 6, "{d:?}");
        }
    }

    #[test]
    fn noise_around_the_target_changes_nothing() {
        let (p, mut h) = (params(), History::default());
        let mut rng = fastrand::Rng::with_seed(7);
        let mut events = 0;
        let mut n = 3;
        for t in 0..600 {
            let in_flight = 24.0 * (1.0 + (rng.f64() - 0.5) * 0.3); // +-15 %
            let d = tick(&p, &mut h, t, in_flight, 20.0, ready(n));
            if d.desired != n {
                events += 1;
                n = d.desired;
            }
        }
        assert!(events <= 1, "{events} scaling events on noise");
        assert_eq!(n, 3);
    }

    #[test]
    fn scale_in_waits_for_the_peak_hold_and_goes_one_at_a_time() {
        let mut p = params();
        p.peak_hold_ms = 30_000;
        let mut h = History::default();
        for t in 0..10 {
            tick(&p, &mut h, t, 30.0, 10.0, ready(4));
        }
        // Load drops; nothing happens before the hold has passed.
        let mut first_in = None;
        for t in 10..60 {
            let d = tick(&p, &mut h, t, 2.0, 10.0, ready(4));
            if d.desired < 4 {
                first_in = Some((t, d));
                break;
            }
        }
        let (t, d) = first_in.expect("scaled in eventually");
        assert!(t >= 39, "scaled in at {t}s, before the hold");
        assert_eq!((d.desired, d.reason), (3, Reason::LowLoad));
        // A brief peak resets the hold (flapping guard).
        let d = tick(&p, &mut h, t + 1, 30.0, 10.0, ready(3));
        assert!(d.desired >= 3);
        let d = tick(&p, &mut h, t + 2, 2.0, 10.0, ready(3));
        assert_eq!(d.desired, 3, "{d:?}");
    }

    #[test]
    fn latency_over_the_threshold_adds_one_instance() {
        let (p, mut h) = (params(), History::default());
        let d = tick(&p, &mut h, 0, 4.0, 120.0, ready(1));
        assert_eq!((d.desired, d.reason), (2, Reason::Latency));
        // While it starts, no second one.
        let d = tick(&p, &mut h, 1, 4.0, 120.0, Counts { ready: 1, starting: 1, draining: 0 });
        assert_eq!(d.desired, 2);
    }

    #[test]
    fn min_max_pin_and_pause() {
        let mut p = params();
        let mut h = History::default();
        p.min = 2;
        assert_eq!(tick(&p, &mut h, 0, 0.0, 1.0, ready(1)).reason, Reason::BelowMin);
        let d = tick(&p, &mut h, 1, 1_000.0, 1.0, ready(2));
        assert_eq!(d.desired, 6, "max caps even panic");
        p.pinned = Some(3);
        assert_eq!(tick(&p, &mut h, 2, 1_000.0, 1.0, ready(6)).desired, 3);
        p.pinned = None;
        p.paused = true;
        let d = tick(&p, &mut h, 3, 1_000.0, 1.0, ready(2));
        assert_eq!((d.desired, d.reason), (2, Reason::Paused));
    }

    #[test]
    fn a_failed_start_is_asked_again() {
        let (p, mut h) = (params(), History::default());
        let d = tick(&p, &mut h, 0, 30.0, 10.0, ready(1));
        assert!(d.desired > 1);
        // The start failed: nothing is starting, the count is still 1.
        let d = tick(&p, &mut h, 1, 30.0, 10.0, ready(1));
        assert!(d.desired > 1, "{d:?}");
    }
}
