//! Latency-aware policies: least time (the papers' "fair") and power of two
//! choices on peak-EWMA latency.

use std::sync::Arc;

use crate::policies::cheapest;
use crate::{clock, Backend, Policy, Pool, RequestCtx, Selector};

/// Cost of a backend that has requests pending but no latency sample yet:
/// high, so a new backend gets one request at a time until it answers.
const UNSAMPLED_PENDING_NS: f64 = 1e12;

/// Expected cost of one more request: latency x (in flight + 1) / weight.
fn cost(latency_ns: f64, b: &Backend) -> f64 {
    let pending = b.stats.in_flight() as f64;
    let latency = if latency_ns > 0.0 {
        latency_ns
    } else if pending > 0.0 {
        UNSAMPLED_PENDING_NS
    } else {
        0.0
    };
    latency * (pending + 1.0) / f64::from(b.weight.max(1))
}

/// Least time: the lowest latency EWMA x (in flight + 1) / weight among all
/// accepted backends (an O(n) scan per request).
#[derive(Debug, Clone, Copy)]
pub struct LeastTime;

#[derive(Debug)]
struct LeastTimeSelector {
    pool: Arc<Pool>,
}

impl Policy for LeastTime {
    fn build(&self, pool: Arc<Pool>) -> Arc<dyn Selector> {
        Arc::new(LeastTimeSelector { pool })
    }
}

impl Selector for LeastTimeSelector {
    fn select(&self, _: &RequestCtx<'_>, accept: &mut dyn FnMut(&Backend) -> bool) -> Option<Arc<Backend>> {
        cheapest(&self.pool, accept, |b| cost(b.stats.latency_ewma().map_or(0.0, |d| d.as_nanos() as f64), b))
    }
}

/// Power of two choices on peak-EWMA latency: two distinct random accepted
/// backends, the one with the lower latency x (in flight + 1) / weight wins.
/// O(1) per request, and it reacts to a slowing backend within a request.
#[derive(Debug, Clone, Copy)]
pub struct P2cEwma {
    /// Time constant of the latency decay, ns.
    pub decay_ns: f64,
}

#[derive(Debug)]
struct P2cSelector {
    pool: Arc<Pool>,
    decay_ns: f64,
}

impl Policy for P2cEwma {
    fn build(&self, pool: Arc<Pool>) -> Arc<dyn Selector> {
        Arc::new(P2cSelector { pool, decay_ns: self.decay_ns })
    }
}

impl P2cSelector {
    /// A random accepted backend other than `not`, trying a few random
    /// picks, then a scan from a random start.
    fn pick(&self, not: Option<usize>, accept: &mut dyn FnMut(&Backend) -> bool) -> Option<usize> {
        let n = self.pool.len();
        let ok = |i: usize, accept: &mut dyn FnMut(&Backend) -> bool| {
            let b = &self.pool.backends()[i];
            Some(i) != not && b.weight > 0 && accept(b)
        };
        for _ in 0..3 {
            let i = fastrand::usize(..n);
            if ok(i, accept) {
                return Some(i);
            }
        }
        let start = fastrand::usize(..n);
        (0..n).map(|k| (start + k) % n).find(|&i| ok(i, accept))
    }
}

impl Selector for P2cSelector {
    fn select(&self, _: &RequestCtx<'_>, accept: &mut dyn FnMut(&Backend) -> bool) -> Option<Arc<Backend>> {
        if self.pool.is_empty() {
            return None;
        }
        let a = self.pick(None, accept)?;
        let Some(b) = self.pick(Some(a), accept) else {
            return Some(self.pool.backends()[a].clone());
        };
        let now = clock::now_ns();
        let cost_of = |i: usize| {
            let be = &self.pool.backends()[i];
            cost(be.stats.peak_ewma_ns(now, self.decay_ns), be)
        };
        let winner = if cost_of(b) < cost_of(a) { b } else { a };
        Some(self.pool.backends()[winner].clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{counts, pool};
    use crate::Outcome;
    use std::time::Duration;

    /// Gives backend `i` a latency history of `ms`: requests started that
    /// long ago and answered now (a real sleep could overshoot on a busy
    /// machine and invert two histories).
    fn teach(p: &Pool, i: usize, ms: u64) {
        for _ in 0..5 {
            let started = std::time::Instant::now().checked_sub(Duration::from_millis(ms)).expect("a past instant");
            let mut g = p.backends()[i].stats.start_at(started);
            g.record(Outcome::Success);
        }
    }

    #[test]
    fn latency_aware_policies_prefer_the_fast_backend() {
        let p = pool(&[1, 1, 1]);
        teach(&p, 0, 1);
        teach(&p, 1, 12);
        teach(&p, 2, 12);
        for policy in [&LeastTime as &dyn Policy, &P2cEwma { decay_ns: 10e9 }] {
            let sel = policy.build(p.clone());
            let c = counts(&*sel, 3, 300, &mut |_: &Backend| true);
            assert!(c[0] > c[1] + c[2], "{c:?}");
        }
    }

    #[test]
    fn p2c_never_picks_a_rejected_backend_and_handles_tiny_pools() {
        let p = pool(&[1, 1, 1, 1]);
        let sel = P2cEwma { decay_ns: 1e9 }.build(p);
        let c = counts(&*sel, 4, 400, &mut |b: &Backend| b.id.as_str() != "b2");
        assert_eq!(c[2], 0);
        assert_eq!(c.iter().sum::<usize>(), 400);
        let one = P2cEwma { decay_ns: 1e9 }.build(pool(&[1]));
        assert_eq!(counts(&*one, 1, 5, &mut |_: &Backend| true), vec![5]);
    }

    #[test]
    fn a_busy_backend_loses_to_an_idle_one_of_equal_latency() {
        let p = pool(&[1, 1]);
        teach(&p, 0, 2);
        teach(&p, 1, 2);
        let _busy: Vec<_> = (0..10).map(|_| p.backends()[0].stats.start()).collect();
        let sel = LeastTime.build(p.clone());
        assert_eq!(counts(&*sel, 2, 20, &mut |_: &Backend| true), vec![0, 20]);
        let sel = P2cEwma { decay_ns: 10e9 }.build(p);
        assert_eq!(counts(&*sel, 2, 20, &mut |_: &Backend| true), vec![0, 20]);
    }
}
