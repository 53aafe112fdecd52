//! Prequal (Wydrowski et al., NSDI 2024): choose by probed requests in
//! flight (RIF) and latency, not by load.
//!
//! Probes are sent in the background (the `tidegate-sources` prober, or
//! ORCA headers on normal responses) and land in each backend's
//! [`ProbeState`](crate::stats::ProbeState). Per request, the backends
//! with a usable probe answer (younger than `max_age_ms`, used fewer than
//! `reuse` times) form the pool, and the hot-cold rule picks from it:
//!
//! - a backend is **hot** when its RIF is above the `hot_quantile_pct`
//!   quantile of the pool's RIFs, **cold** otherwise;
//! - among cold backends, the lowest latency wins; when all are hot, the
//!   lowest RIF wins.
//!
//! The chosen answer's RIF is raised by one (the request just sent) and its
//! use counted. With fewer than two usable answers (no traffic yet, or the
//! prober is behind) the choice falls back to two random backends, the one
//! with fewer requests in flight per unit of weight winning.

use std::sync::Arc;

use tidegate_model::PrequalSpec;

use crate::{clock, Backend, Policy, Pool, RequestCtx, Selector};

/// The `prequal` policy.
#[derive(Debug, Clone)]
pub struct Prequal(pub PrequalSpec);

#[derive(Debug)]
struct PrequalSelector {
    pool: Arc<Pool>,
    spec: PrequalSpec,
}

impl Policy for Prequal {
    fn build(&self, pool: Arc<Pool>) -> Arc<dyn Selector> {
        Arc::new(PrequalSelector { pool, spec: self.0.clone() })
    }
}

/// One usable probe answer: the backend's index, RIF and latency.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Probed {
    /// Index in the pool.
    pub index: usize,
    /// Requests in flight the backend reported (plus those sent since).
    pub rif: f64,
    /// Its latency, ms.
    pub latency_ms: f64,
}

/// The hot-cold rule: the index of the chosen answer in `pool`, `None`
/// when it is empty. Pure, for tests.
pub fn hot_cold(pool: &[Probed], hot_quantile: f64) -> Option<usize> {
    if pool.is_empty() {
        return None;
    }
    let mut rifs: smallvec::SmallVec<[f64; 16]> = pool.iter().map(|p| p.rif).collect();
    rifs.sort_by(f64::total_cmp);
    // The quantile, interpolated between neighbours, so that in a small
    // pool the busiest backend is hot as soon as it is busier than the rest.
    let pos = hot_quantile.clamp(0.0, 1.0) * (rifs.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    let threshold = rifs[lo] + (rifs[hi] - rifs[lo]) * (pos - lo as f64);
    let by = |key: fn(&Probed) -> f64| move |a: &(usize, &Probed), b: &(usize, &Probed)| key(a.1).total_cmp(&key(b.1));
    let cold = pool.iter().enumerate().filter(|(_, p)| p.rif <= threshold).min_by(by(|p| p.latency_ms));
    cold.or_else(|| pool.iter().enumerate().min_by(by(|p| p.rif))).map(|(i, _)| i)
}

impl Selector for PrequalSelector {
    fn select(&self, _: &RequestCtx<'_>, accept: &mut dyn FnMut(&Backend) -> bool) -> Option<Arc<Backend>> {
        let now = clock::now_ms();
        let spec = &self.spec;
        let backends = self.pool.backends();
        let mut probed: smallvec::SmallVec<[Probed; 16]> = smallvec::SmallVec::new();
        for (index, b) in backends.iter().enumerate() {
            if b.weight == 0 {
                continue;
            }
            if let Some((rif, latency_ms)) = b.stats.probe.fresh(now, spec.max_age_ms, spec.reuse) {
                if accept(b) {
                    probed.push(Probed { index, rif, latency_ms });
                }
            }
        }
        if probed.len() >= 2 {
            let chosen = hot_cold(&probed, f64::from(spec.hot_quantile_pct) / 100.0)?;
            let b = &backends[probed[chosen].index];
            b.stats.probe.used();
            return Some(b.clone());
        }
        two_choices(&self.pool, accept)
    }
}

/// Two random accepted backends; fewer requests in flight per unit of
/// weight wins.
fn two_choices(pool: &Pool, accept: &mut dyn FnMut(&Backend) -> bool) -> Option<Arc<Backend>> {
    let n = pool.len();
    if n == 0 {
        return None;
    }
    let load = |b: &Backend| b.stats.in_flight() as f64 / f64::from(b.weight.max(1));
    let mut best: Option<&Arc<Backend>> = None;
    let mut seen = 0;
    let start = fastrand::usize(..n);
    let step = if n > 1 { 1 + fastrand::usize(..n - 1) } else { 1 };
    // Walk the pool in a random order until two accepted ones are found.
    for k in 0..n {
        let b = &pool.backends()[(start + k * step) % n];
        if b.weight == 0 || !accept(b) {
            continue;
        }
        if best.is_none_or(|x| load(b) < load(x)) {
            best = Some(b);
        }
        seen += 1;
        if seen == 2 {
            break;
        }
    }
    best.cloned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(index: usize, rif: f64, latency_ms: f64) -> Probed {
        Probed { index, rif, latency_ms }
    }

    #[test]
    fn the_fastest_cold_backend_wins() {
        // RIFs 1, 2, 3, 9: the 0.75 quantile is 4.5, so the one with 9 is
        // hot, even though it reports the lowest latency.
        let pool = [p(0, 1.0, 30.0), p(1, 2.0, 10.0), p(2, 3.0, 20.0), p(3, 9.0, 1.0)];
        assert_eq!(hot_cold(&pool, 0.75), Some(1));
    }

    #[test]
    fn when_all_are_hot_the_fewest_in_flight_wins() {
        // Quantile 0: only the lowest RIF is under the threshold, so it is
        // the only cold one; it wins whatever its latency.
        let pool = [p(0, 5.0, 1.0), p(1, 2.0, 50.0), p(2, 7.0, 2.0)];
        assert_eq!(hot_cold(&pool, 0.0), Some(1));
        assert_eq!(hot_cold(&[], 0.8), None);
    }

    #[test]
    fn in_a_small_pool_the_busiest_is_hot() {
        // Three backends at the 0.8 quantile (2.6 here): the one with 3 in
        // flight is hot although it is the fastest.
        let pool = [p(0, 1.0, 30.0), p(1, 2.0, 20.0), p(2, 3.0, 10.0)];
        assert_eq!(hot_cold(&pool, 0.8), Some(1));
    }

    #[test]
    fn a_single_backend_is_chosen() {
        assert_eq!(hot_cold(&[p(4, 100.0, 100.0)], 0.8), Some(0));
    }

    #[test]
    fn probes_steer_the_choice_and_are_used_up() {
        let pool = crate::testing::pool(&[1, 1, 1]);
        let sel = Prequal(PrequalSpec { reuse: 2, ..PrequalSpec::default() }).build(pool.clone());
        let now = clock::now_ms();
        // Backend 2 is fast and idle; 0 and 1 are slow.
        pool.backends()[0].stats.probe.store(1.0, 50.0, now);
        pool.backends()[1].stats.probe.store(1.0, 40.0, now);
        pool.backends()[2].stats.probe.store(0.0, 5.0, now);
        let headers = http::HeaderMap::new();
        let ctx = RequestCtx::new(None, "/", &headers);
        let chosen: Vec<_> = (0..2).map(|_| sel.select(&ctx, &mut |_| true).unwrap().id.to_string()).collect();
        assert_eq!(chosen, [pool.backends()[2].id.to_string(), pool.backends()[2].id.to_string()]);
        // Its answer is used up (reuse 2): the next goes to the faster of the others.
        let next = sel.select(&ctx, &mut |_| true).unwrap();
        assert_eq!(next.id, pool.backends()[1].id);
        // A rejected backend is never chosen.
        let avoided = sel.select(&ctx, &mut |b| b.id != pool.backends()[1].id).unwrap();
        assert_ne!(avoided.id, pool.backends()[1].id);
    }

    #[test]
    fn without_probes_two_random_choices_prefer_the_idle_one() {
        let pool = crate::testing::pool(&[1, 1]);
        let sel = Prequal(PrequalSpec::default()).build(pool.clone());
        let _busy = pool.backends()[0].stats.start();
        let headers = http::HeaderMap::new();
        let ctx = RequestCtx::new(None, "/", &headers);
        for _ in 0..20 {
            assert_eq!(sel.select(&ctx, &mut |_| true).unwrap().id, pool.backends()[1].id);
        }
    }
}
