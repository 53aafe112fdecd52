//! The policies of the core: smooth weighted round robin, weighted random,
//! weighted least connections.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

use tidegate_model::PolicySpec;

use crate::feedback::{DynamicFeedback, OrcaWrr};
use crate::hashing::{ConsistentHash, HashKey};
use crate::latency::{LeastTime, P2cEwma};
use crate::prequal::Prequal;
use crate::{Backend, Policy, Pool, RequestCtx, Selector};

/// The policy for a configured kind.
pub fn policy_for(spec: &PolicySpec) -> Arc<dyn Policy> {
    match spec {
        PolicySpec::RoundRobin {} | PolicySpec::External(_) => Arc::new(RoundRobin),
        PolicySpec::Random {} => Arc::new(RandomPolicy),
        PolicySpec::LeastConn {} => Arc::new(LeastConn),
        PolicySpec::LeastTime {} => Arc::new(LeastTime),
        PolicySpec::P2cEwma { decay_ms } => Arc::new(P2cEwma { decay_ns: *decay_ms as f64 * 1e6 }),
        PolicySpec::IpHash { balance_factor } => Arc::new(ConsistentHash::new(HashKey::ClientIp, *balance_factor)),
        PolicySpec::UriHash { balance_factor } => Arc::new(ConsistentHash::new(HashKey::Uri, *balance_factor)),
        PolicySpec::HeaderHash { header, balance_factor } => {
            Arc::new(ConsistentHash::new(HashKey::header(header), *balance_factor))
        }
        PolicySpec::CookieHash { cookie, balance_factor } => {
            Arc::new(ConsistentHash::new(HashKey::Cookie(cookie.as_str().to_string()), *balance_factor))
        }
        PolicySpec::DynamicFeedback(spec) => Arc::new(DynamicFeedback(spec.clone())),
        PolicySpec::OrcaWrr(spec) => Arc::new(OrcaWrr(spec.clone())),
        PolicySpec::Prequal(spec) => Arc::new(Prequal(spec.clone())),
    }
}

/// Scans the pool from `start`, wrapping, for the first accepted backend.
pub(crate) fn first_accepted(
    pool: &Pool,
    start: usize,
    accept: &mut dyn FnMut(&Backend) -> bool,
) -> Option<Arc<Backend>> {
    let n = pool.len();
    (0..n).map(|k| &pool.backends()[(start + k) % n]).find(|b| b.weight > 0 && accept(b)).cloned()
}

/// Smooth weighted round robin (nginx's algorithm), lock-free: the sequence
/// the algorithm produces is computed once per pool, and each request takes
/// the next position with one atomic increment.
#[derive(Debug, Clone, Copy)]
pub struct RoundRobin;

/// The longest schedule kept; larger weight sums are scaled down to fit.
const MAX_SCHEDULE: u64 = 1 << 16;

#[derive(Debug)]
pub(crate) struct RoundRobinSelector {
    pool: Arc<Pool>,
    schedule: Vec<u32>,
    next: AtomicUsize,
}

/// The order smooth weighted round robin visits backends in, one cycle.
pub(crate) fn smooth_schedule(weights: &[u32]) -> Vec<u32> {
    let total: u64 = weights.iter().map(|&w| u64::from(w)).sum();
    if total == 0 {
        return Vec::new();
    }
    // Divide out the common factor, then scale down if still too long.
    let g = weights.iter().fold(0u64, |g, &w| gcd(g, u64::from(w)));
    let mut w: Vec<i64> = weights.iter().map(|&x| (u64::from(x) / g) as i64).collect();
    let sum: i64 = w.iter().sum();
    if sum as u64 > MAX_SCHEDULE {
        let scale = MAX_SCHEDULE as f64 / sum as f64;
        for x in w.iter_mut().filter(|x| **x > 0) {
            *x = ((*x as f64 * scale).round() as i64).max(1);
        }
    }
    let total: i64 = w.iter().sum();
    let mut current = vec![0i64; w.len()];
    let mut out = Vec::with_capacity(total as usize);
    for _ in 0..total {
        let mut best = 0;
        for i in 0..w.len() {
            current[i] += w[i];
            if current[i] > current[best] {
                best = i;
            }
        }
        current[best] -= total;
        out.push(best as u32);
    }
    out
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

impl RoundRobinSelector {
    /// A round robin over `pool` with these weights (one per backend).
    pub(crate) fn new(pool: Arc<Pool>, weights: &[u32]) -> RoundRobinSelector {
        // Start at a random place so that many proxies do not move in lockstep.
        let schedule = smooth_schedule(weights);
        let start = fastrand::usize(..schedule.len().max(1));
        RoundRobinSelector { pool, schedule, next: AtomicUsize::new(start) }
    }
}

impl Policy for RoundRobin {
    fn build(&self, pool: Arc<Pool>) -> Arc<dyn Selector> {
        let weights: Vec<u32> = pool.backends().iter().map(|b| b.weight).collect();
        Arc::new(RoundRobinSelector::new(pool, &weights))
    }
}

impl Selector for RoundRobinSelector {
    fn select(&self, ctx: &RequestCtx<'_>, accept: &mut dyn FnMut(&Backend) -> bool) -> Option<Arc<Backend>> {
        if self.schedule.is_empty() {
            return None;
        }
        // A rejected turn is given to whoever comes next in the shared
        // sequence, so skipped backends' shares spread evenly over the rest.
        // A retry walks on from the current turn without taking any.
        // If accepted backends are rare, stop walking and scan.
        let tries = self.schedule.len().min(self.pool.len() * 2);
        let from = if ctx.retry { self.next.load(Relaxed) } else { 0 };
        let mut pos = 0;
        for k in 0..tries {
            pos = if ctx.retry { from.wrapping_add(k) } else { self.next.fetch_add(1, Relaxed) };
            let b = &self.pool.backends()[self.schedule[pos % self.schedule.len()] as usize];
            if accept(b) {
                return Some(b.clone());
            }
        }
        first_accepted(&self.pool, pos, accept)
    }
}

/// Weighted random choice.
#[derive(Debug, Clone, Copy)]
pub struct RandomPolicy;

#[derive(Debug)]
struct RandomSelector {
    pool: Arc<Pool>,
    /// Running sums of weights, for a binary search.
    cumulative: Vec<u64>,
}

impl Policy for RandomPolicy {
    fn build(&self, pool: Arc<Pool>) -> Arc<dyn Selector> {
        let cumulative = pool
            .backends()
            .iter()
            .scan(0u64, |sum, b| {
                *sum += u64::from(b.weight);
                Some(*sum)
            })
            .collect();
        Arc::new(RandomSelector { pool, cumulative })
    }
}

impl Selector for RandomSelector {
    fn select(&self, _: &RequestCtx<'_>, accept: &mut dyn FnMut(&Backend) -> bool) -> Option<Arc<Backend>> {
        let total = *self.cumulative.last()?;
        if total == 0 {
            return None;
        }
        for _ in 0..3 {
            let r = fastrand::u64(..total);
            let i = self.cumulative.partition_point(|&c| c <= r);
            let b = &self.pool.backends()[i];
            if accept(b) {
                return Some(b.clone());
            }
        }
        first_accepted(&self.pool, fastrand::usize(..self.pool.len()), accept)
    }
}

/// Weighted least connections: the fewest requests in flight per unit of
/// weight; ties go to a random one among the tied.
#[derive(Debug, Clone, Copy)]
pub struct LeastConn;

#[derive(Debug)]
struct LeastConnSelector {
    pool: Arc<Pool>,
}

impl Policy for LeastConn {
    fn build(&self, pool: Arc<Pool>) -> Arc<dyn Selector> {
        Arc::new(LeastConnSelector { pool })
    }
}

impl Selector for LeastConnSelector {
    fn select(&self, _: &RequestCtx<'_>, accept: &mut dyn FnMut(&Backend) -> bool) -> Option<Arc<Backend>> {
        cheapest(&self.pool, accept, |b| b.stats.in_flight() as f64 / f64::from(b.weight))
    }
}

/// The accepted backend (weight above 0) with the lowest `cost`, scanning
/// the whole pool from a random start so that ties spread. O(n).
pub(crate) fn cheapest(
    pool: &Pool,
    accept: &mut dyn FnMut(&Backend) -> bool,
    cost: impl Fn(&Backend) -> f64,
) -> Option<Arc<Backend>> {
    let n = pool.len();
    if n == 0 {
        return None;
    }
    let start = fastrand::usize(..n);
    let mut best: Option<(&Arc<Backend>, f64)> = None;
    for k in 0..n {
        let b = &pool.backends()[(start + k) % n];
        if b.weight == 0 || !accept(b) {
            continue;
        }
        let c = cost(b);
        if best.is_none_or(|(_, bc)| c < bc) {
            best = Some((b, c));
        }
    }
    best.map(|(b, _)| b.clone())
}

#[cfg(test)]
mod tests;
