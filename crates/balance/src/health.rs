//! Backend availability: active check state, passive outlier ejection and
//! slow start. Decisions are pure functions of the counters and the time;
//! the counters are atomics so the data plane never locks.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use tidegate_model::PassiveCheck;

use crate::stats::{ActiveState, BackendStats};
use crate::{Backend, Outcome};

impl BackendStats {
    /// Whether the backend may take a request now: not down by active
    /// checks, not ejected.
    pub fn is_available(&self, now_ms: u64) -> bool {
        self.active_state() != ActiveState::Down && self.ejected_until_ms.load(Relaxed) <= now_ms
    }

    /// Whether the backend is ejected at `now_ms`.
    pub fn is_ejected(&self, now_ms: u64) -> bool {
        self.ejected_until_ms.load(Relaxed) > now_ms
    }

    /// Share of its normal traffic a backend should take during slow start:
    /// from 0.1 when it became available up to 1.0 after `window_ms`.
    pub fn slow_start_factor(&self, now_ms: u64, window_ms: u64) -> f64 {
        if window_ms == 0 {
            return 1.0;
        }
        let since = self.available_since_ms.load(Relaxed);
        let age = now_ms.saturating_sub(since) as f64;
        (age / window_ms as f64).clamp(0.1, 1.0)
    }

    /// Records an active probe result; `rise`/`fall` consecutive results
    /// change the state. Returns the new state.
    pub fn record_probe(&self, passed: bool, rise: u32, fall: u32, now_ms: u64) -> ActiveState {
        let (streak, other) =
            if passed { (&self.probe_passes, &self.probe_fails) } else { (&self.probe_fails, &self.probe_passes) };
        other.store(0, Relaxed);
        let n = streak.fetch_add(1, Relaxed).saturating_add(1);
        let state = self.active_state();
        let next = match (state, passed) {
            (ActiveState::Down, true) if n >= rise => ActiveState::Up,
            (ActiveState::Unchecked, true) => ActiveState::Up,
            (ActiveState::Up | ActiveState::Unchecked, false) if n >= fall => ActiveState::Down,
            (s, _) => s,
        };
        if next != state {
            if next == ActiveState::Up && state == ActiveState::Down {
                self.available_since_ms.store(now_ms, Relaxed);
            }
            self.active.store(next as u8, Relaxed);
        }
        next
    }
}

/// Applies a request outcome to passive outlier detection. `pool` is every
/// backend of the service, to bound the ejected share. `now_ms` reads the
/// time on [`clock`](crate::clock), only when a failure is counted (the
/// common success path does not read the clock). Returns true when this
/// outcome ejected the backend.
pub fn record_outcome(
    backend: &Backend,
    outcome: Outcome,
    now_ms: impl FnOnce() -> u64,
    passive: &PassiveCheck,
    pool: &[Arc<Backend>],
) -> bool {
    let s = &backend.stats;
    match outcome {
        Outcome::Success => {
            // Read first: a store on every success would pull the line
            // away from the other workers' caches for nothing.
            if s.consecutive_failures.load(Relaxed) != 0 {
                s.consecutive_failures.store(0, Relaxed);
            }
            return false;
        }
        // Shedding load is not breakage: ejecting an overloaded backend
        // would only pile its share onto the others.
        Outcome::Overloaded => return false,
        Outcome::Failure | Outcome::TimedOut => {}
    }
    let n = s.consecutive_failures.fetch_add(1, Relaxed).saturating_add(1);
    let now_ms = now_ms();
    if passive.consecutive_failures == 0 || n < passive.consecutive_failures || s.is_ejected(now_ms) {
        return false;
    }
    let ejected = pool.iter().filter(|b| b.stats.is_ejected(now_ms)).count();
    let allowed = pool.len() * passive.max_ejected_percent.get() as usize / 100;
    if ejected + 1 > allowed {
        return false;
    }
    let until = now_ms + ejection_ms(s, now_ms, passive);
    s.ejections_total.fetch_add(1, Relaxed);
    s.ejected_until_ms.store(until, Relaxed);
    s.available_since_ms.store(until, Relaxed);
    s.consecutive_failures.store(0, Relaxed);
    true
}

/// The next ejection's length: doubled per recent ejection, capped; the
/// multiplier resets once a backend stayed in for `max_ejection_ms`.
fn ejection_ms(s: &BackendStats, now_ms: u64, p: &PassiveCheck) -> u64 {
    let last_end = s.ejected_until_ms.load(Relaxed);
    let streak = if last_end > 0 && now_ms.saturating_sub(last_end) < p.max_ejection_ms {
        s.ejections.fetch_add(1, Relaxed).saturating_add(1)
    } else {
        s.ejections.store(1, Relaxed);
        1
    };
    let factor = 1u64 << (streak - 1).min(20);
    p.base_ejection_ms.saturating_mul(factor).min(p.max_ejection_ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidegate_model::{BackendAddr, BackendId, BackendSpec, Weight};

    fn pool(n: usize) -> Vec<Arc<Backend>> {
        (0..n)
            .map(|i| {
                let spec = BackendSpec {
                    addr: BackendAddr::new(&format!("127.0.0.1:{}", 1000 + i)).unwrap(),
                    weight: Weight::default(),
                    backup: false,
                    max_conns: None,
                    autoscaled: false,
                    dns: false,
                };
                Arc::new(Backend::new(BackendId::new(&format!("b{i}")).unwrap(), &spec, None))
            })
            .collect()
    }

    fn passive() -> PassiveCheck {
        PassiveCheck {
            consecutive_failures: 3,
            base_ejection_ms: 1_000,
            max_ejection_ms: 8_000,
            max_ejected_percent: tidegate_model::Percent::new(50).expect("a percentage"),
        }
    }

    #[test]
    fn consecutive_failures_eject_with_growing_backoff() {
        let p = pool(4);
        let b = &p[0];
        let fail = |now| record_outcome(b, Outcome::Failure, || now, &passive(), &p);
        assert!(!fail(0) && !fail(0));
        assert!(fail(0), "third failure ejects");
        assert!(!b.stats.is_available(500));
        assert!(b.stats.is_available(1_000), "back after the base ejection");
        // Failing again soon after doubles the ejection.
        assert!(!fail(1_100) && !fail(1_100) && fail(1_100));
        assert!(!b.stats.is_available(2_900));
        assert!(b.stats.is_available(3_100));
        // Shed requests (503) neither count nor reset.
        assert!(!fail(4_000) && !fail(4_000));
        assert!(!record_outcome(b, Outcome::Overloaded, || 4_000, &passive(), &p));
        assert!(fail(4_000), "503s do not interrupt the streak either");
        // A success resets the count of consecutive failures.
        let b = &p[1];
        let fail = |now| record_outcome(b, Outcome::Failure, || now, &passive(), &p);
        assert!(!fail(4_000) && !fail(4_000));
        record_outcome(b, Outcome::Success, || 4_000, &passive(), &p);
        assert!(!fail(4_000));
    }

    #[test]
    fn at_most_the_configured_share_is_ejected() {
        let p = pool(4);
        let mut ejected = 0;
        for b in &p {
            for _ in 0..3 {
                if record_outcome(b, Outcome::Failure, || 0, &passive(), &p) {
                    ejected += 1;
                }
            }
        }
        assert_eq!(ejected, 2, "50% of 4");
        assert_eq!(p.iter().filter(|b| b.stats.is_available(10)).count(), 2);
    }

    #[test]
    fn probes_rise_and_fall() {
        let p = pool(1);
        let s = &p[0].stats;
        assert_eq!(s.record_probe(false, 2, 2, 0), ActiveState::Unchecked);
        assert_eq!(s.record_probe(false, 2, 2, 0), ActiveState::Down);
        assert!(!s.is_available(0));
        assert_eq!(s.record_probe(true, 2, 2, 10), ActiveState::Down);
        assert_eq!(s.record_probe(true, 2, 2, 20), ActiveState::Up);
        assert!(s.is_available(20));
        assert!((s.slow_start_factor(20, 1000) - 0.1).abs() < 1e-9);
        assert!((s.slow_start_factor(520, 1000) - 0.5).abs() < 1e-9);
        assert_eq!(s.slow_start_factor(5_000, 1000), 1.0);
    }
}
