//! Policies whose weights come from load signals, recomputed in the
//! background (`Selector::refresh`): dynamic feedback (paper S3) and ORCA
//! weighted round robin.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use tidegate_model::{FeedbackFormula, FeedbackSpec, Gammas, OrcaSpec};

use crate::policies::RoundRobinSelector;
use crate::{Backend, Policy, Pool, RequestCtx, Selector};

/// One backend's load parameters as availabilities in (0, 1]; `None` when
/// unknown (treated as neutral).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Signals {
    /// R1: service rate relative to the fastest backend.
    pub rate: Option<f64>,
    /// R2: 1 - CPU utilization.
    pub cpu: Option<f64>,
    /// R3: 1 - memory utilization.
    pub memory: Option<f64>,
    /// R4: 1 - network utilization.
    pub network: Option<f64>,
    /// R5: fastest latency / this latency.
    pub time: Option<f64>,
    /// Q: requests queued at (in flight to) the backend.
    pub queue: f64,
    /// alpha: the configured weight.
    pub alpha: f64,
}

/// Reads one load parameter from a backend's signals.
type Param = fn(&Signals) -> Option<f64>;

/// The S3 capacity of each backend, beta = alpha x R_all with
/// R_all = prod R_i^gamma_i over the parameters that some backend reports;
/// `None` when no backend reports any (fall back to configured weights).
pub fn capacities(signals: &[Signals], gamma: &Gammas) -> Option<Vec<f64>> {
    // Exponents count only for parameters some backend reports, renormalized
    // to sum to 1: a parameter nobody measures must not flatten the others.
    let reported = |f: fn(&Signals) -> Option<f64>| signals.iter().any(|s| f(s).is_some());
    let parts: [(f64, Param); 5] = [
        (gamma.rate, |s| s.rate),
        (gamma.cpu, |s| s.cpu),
        (gamma.memory, |s| s.memory),
        (gamma.network, |s| s.network),
        (gamma.time, |s| s.time),
    ];
    let used: Vec<(f64, Param)> = parts.into_iter().filter(|(g, f)| *g > 0.0 && reported(*f)).collect();
    let total: f64 = used.iter().map(|(g, _)| g).sum();
    if total <= 0.0 {
        return None;
    }
    Some(
        signals
            .iter()
            .map(|s| {
                let r_all: f64 =
                    used.iter().map(|(g, f)| f(s).unwrap_or(1.0).clamp(0.05, 1.0).powf(g / total)).product();
                s.alpha * r_all
            })
            .collect(),
    )
}

/// The S3 weight of a backend of capacity `beta` with `queue` requests in
/// flight. `spare`: w = beta / (1 + Q), traffic follows spare capacity.
/// `paper`: w = Q / (1 + Q) x beta as printed, which equals the M/M/1
/// utilization times the capacity and so sends more to busier backends.
pub fn feedback_weight(beta: f64, queue: f64, formula: FeedbackFormula) -> f64 {
    match formula {
        FeedbackFormula::Spare => beta / (1.0 + queue),
        FeedbackFormula::Paper => beta * queue / (1.0 + queue),
    }
}

/// Both steps at once, for a set of signals (their `queue` included).
pub fn feedback_weights(signals: &[Signals], gamma: &Gammas, formula: FeedbackFormula) -> Option<Vec<f64>> {
    let w: Vec<f64> = capacities(signals, gamma)?
        .iter()
        .zip(signals)
        .map(|(beta, s)| feedback_weight(*beta, s.queue, formula))
        .collect();
    (w.iter().sum::<f64>() > 0.0).then_some(w)
}

/// Dynamic feedback (paper S3).
#[derive(Debug, Clone)]
pub struct DynamicFeedback(pub FeedbackSpec);

#[derive(Debug, Default)]
struct Sampler {
    last_ms: u64,
    requests: Vec<u64>,
}

#[derive(Debug)]
struct FeedbackSelector {
    pool: Arc<Pool>,
    spec: FeedbackSpec,
    /// Capacities (beta) from the last refresh, or empty to use the fallback.
    /// The queue factor is applied live at each selection: sampling queues
    /// only at refresh time makes every proxy flood whichever backend
    /// happened to be idle at that instant.
    table: ArcSwap<Vec<f64>>,
    fallback: RoundRobinSelector,
    sampler: Mutex<Sampler>,
    /// Consecutive selections that found no accepted backend by weight.
    misses: AtomicU64,
}

impl Policy for DynamicFeedback {
    fn build(&self, pool: Arc<Pool>) -> Arc<dyn Selector> {
        let weights: Vec<u32> = pool.backends().iter().map(|b| b.weight).collect();
        Arc::new(FeedbackSelector {
            fallback: RoundRobinSelector::new(pool.clone(), &weights),
            pool,
            spec: self.0.clone(),
            table: ArcSwap::from_pointee(Vec::new()),
            sampler: Mutex::new(Sampler::default()),
            misses: AtomicU64::new(0),
        })
    }
}

/// After this many consecutive misses, selection uses weighted round robin
/// until the next refresh (the paper's fallback).
const MAX_MISSES: u64 = 8;

impl FeedbackSelector {
    fn signals(&self, sampler: &mut Sampler, now_ms: u64) -> Vec<Signals> {
        let backends = self.pool.backends();
        let dt = now_ms.saturating_sub(sampler.last_ms).max(1) as f64 / 1e3;
        sampler.requests.resize(backends.len(), 0);
        let rates: Vec<f64> = backends
            .iter()
            .zip(sampler.requests.iter_mut())
            .map(|(b, last)| {
                let now = b.stats.requests();
                let done = now.saturating_sub(std::mem::replace(last, now)) as f64;
                // Completions per second per unit of concurrency: by Little's
                // law close to the service rate, whatever share it was sent.
                done / dt / (b.stats.in_flight() as f64).max(1.0)
            })
            .collect();
        let max_rate = rates.iter().cloned().fold(0.0, f64::max);
        let latencies: Vec<Option<f64>> =
            backends.iter().map(|b| b.stats.latency_ewma().map(|d| d.as_secs_f64())).collect();
        let min_latency = latencies.iter().flatten().cloned().fold(f64::INFINITY, f64::min);
        let util = |x: f64| (!x.is_nan()).then(|| 1.0 - x.clamp(0.0, 1.0));
        backends
            .iter()
            .zip(rates)
            .zip(latencies)
            .map(|((b, rate), latency)| Signals {
                rate: (max_rate > 0.0 && rate > 0.0).then(|| rate / max_rate),
                cpu: util(b.stats.load.cpu.get()),
                memory: util(b.stats.load.memory.get()),
                network: util(b.stats.load.network.get()),
                time: latency.map(|l| min_latency / l),
                queue: b.stats.in_flight() as f64,
                alpha: f64::from(b.weight),
            })
            .collect()
    }
}

impl FeedbackSelector {
    /// Live weights: each capacity times the queue factor of now.
    fn live_weights(&self, capacities: &[f64]) -> Vec<f64> {
        capacities
            .iter()
            .zip(self.pool.backends())
            .map(|(beta, b)| feedback_weight(*beta, b.stats.in_flight() as f64, self.spec.formula))
            .collect()
    }
}

impl Selector for FeedbackSelector {
    fn select(&self, ctx: &RequestCtx<'_>, accept: &mut dyn FnMut(&Backend) -> bool) -> Option<Arc<Backend>> {
        let capacities = self.table.load();
        if !capacities.is_empty() && self.misses.load(Relaxed) < MAX_MISSES {
            let weights = self.live_weights(&capacities);
            let total: f64 = weights.iter().sum();
            if total > 0.0 {
                for _ in 0..3 {
                    let mut r = fastrand::f64() * total;
                    let i = weights.iter().position(|w| {
                        r -= w;
                        r < 0.0
                    });
                    let b = &self.pool.backends()[i.unwrap_or(weights.len() - 1)];
                    if b.weight > 0 && accept(b) {
                        self.misses.store(0, Relaxed);
                        return Some(b.clone());
                    }
                }
                self.misses.fetch_add(1, Relaxed);
            }
        }
        self.fallback.select(ctx, accept)
    }

    fn refreshes(&self) -> bool {
        true
    }

    fn refresh(&self, now_ms: u64) {
        let Ok(mut sampler) = self.sampler.try_lock() else {
            return;
        };
        if sampler.last_ms != 0 && now_ms.saturating_sub(sampler.last_ms) < self.spec.interval_ms {
            return;
        }
        let first = sampler.last_ms == 0;
        let signals = self.signals(&mut sampler, now_ms);
        sampler.last_ms = now_ms;
        if first {
            return; // rates need two samples
        }
        let table = capacities(&signals, &self.spec.gamma).unwrap_or_default();
        self.table.store(Arc::new(table));
        self.misses.store(0, Relaxed);
    }

    fn weights(&self) -> Option<Vec<f64>> {
        let capacities = self.table.load();
        (!capacities.is_empty()).then(|| self.live_weights(&capacities))
    }
}

/// ORCA weighted round robin: weight = qps / (cpu + eps / qps x penalty),
/// from reports that are past the blackout and not expired; backends
/// without usable reports get the mean weight.
#[derive(Debug, Clone)]
pub struct OrcaWrr(pub OrcaSpec);

#[derive(Debug)]
struct OrcaSelector {
    pool: Arc<Pool>,
    spec: OrcaSpec,
    current: ArcSwap<RoundRobinSelector>,
    weights: ArcSwap<Vec<f64>>,
    last_ms: AtomicU64,
}

impl Policy for OrcaWrr {
    fn build(&self, pool: Arc<Pool>) -> Arc<dyn Selector> {
        let weights: Vec<u32> = pool.backends().iter().map(|b| b.weight).collect();
        Arc::new(OrcaSelector {
            current: ArcSwap::from_pointee(RoundRobinSelector::new(pool.clone(), &weights)),
            pool,
            spec: self.0.clone(),
            weights: ArcSwap::from_pointee(Vec::new()),
            last_ms: AtomicU64::new(0),
        })
    }
}

/// The ORCA weight of one backend at `now_ms`, if its reports are usable.
pub fn orca_weight(b: &Backend, spec: &OrcaSpec, now_ms: u64) -> Option<f64> {
    let l = &b.stats.load;
    let (first, last) = (l.first_ms.load(Relaxed), l.last_ms.load(Relaxed));
    if first == 0 || now_ms.saturating_sub(first) < spec.blackout_ms || now_ms.saturating_sub(last) > spec.expiry_ms {
        return None;
    }
    let (qps, cpu) = (l.qps.get(), l.cpu.get());
    if !(qps > 0.0 && cpu > 0.0) {
        return None;
    }
    let eps = if l.eps.get().is_nan() { 0.0 } else { l.eps.get() };
    let penalty = f64::from(spec.error_penalty_pct) / 100.0;
    Some(qps / (cpu + eps / qps * penalty))
}

impl Selector for OrcaSelector {
    fn select(&self, ctx: &RequestCtx<'_>, accept: &mut dyn FnMut(&Backend) -> bool) -> Option<Arc<Backend>> {
        self.current.load().select(ctx, accept)
    }

    fn refreshes(&self) -> bool {
        true
    }

    fn refresh(&self, now_ms: u64) {
        // gRPC recomputes weights about once a second.
        if now_ms.saturating_sub(self.last_ms.load(Relaxed)) < 1_000 {
            return;
        }
        self.last_ms.store(now_ms, Relaxed);
        let raw: Vec<Option<f64>> = self.pool.backends().iter().map(|b| orca_weight(b, &self.spec, now_ms)).collect();
        let known: Vec<f64> = raw.iter().flatten().copied().collect();
        if known.is_empty() {
            return;
        }
        let mean = known.iter().sum::<f64>() / known.len() as f64;
        let w: Vec<f64> = raw.iter().map(|x| x.unwrap_or(mean)).collect();
        let max = w.iter().cloned().fold(0.0, f64::max);
        let ints: Vec<u32> = w.iter().map(|x| ((x / max * 1000.0).round() as u32).max(1)).collect();
        self.current.store(Arc::new(RoundRobinSelector::new(self.pool.clone(), &ints)));
        self.weights.store(Arc::new(w));
    }

    fn weights(&self) -> Option<Vec<f64>> {
        let w = self.weights.load();
        (!w.is_empty()).then(|| w.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{counts, pool};

    fn busy(queue: f64) -> Signals {
        Signals { queue, alpha: 1.0, time: Some(1.0), ..Signals::default() }
    }

    /// The caution in DESIGN.md: with equal capacities, the paper's formula
    /// sends more traffic to the busier backend, the spare form to the idler.
    #[test]
    fn the_paper_formula_favours_busy_backends_and_the_spare_form_does_not() {
        let signals = [busy(9.0), busy(1.0)];
        let g = Gammas::default();
        let paper = feedback_weights(&signals, &g, FeedbackFormula::Paper).unwrap();
        let spare = feedback_weights(&signals, &g, FeedbackFormula::Spare).unwrap();
        assert!(paper[0] > paper[1], "paper: {paper:?}");
        assert!(spare[0] < spare[1], "spare: {spare:?}");
        // An idle backend gets nothing under the paper's formula.
        let idle = feedback_weights(&[busy(0.0), busy(3.0)], &g, FeedbackFormula::Paper).unwrap();
        assert_eq!(idle[0], 0.0);
    }

    #[test]
    fn higher_capacity_signals_get_more_weight() {
        let g = Gammas::default();
        let fast = Signals { rate: Some(1.0), cpu: Some(0.8), time: Some(1.0), alpha: 1.0, ..Default::default() };
        let slow = Signals { rate: Some(0.25), cpu: Some(0.2), time: Some(0.25), alpha: 1.0, ..Default::default() };
        let w = feedback_weights(&[fast, slow], &g, FeedbackFormula::Spare).unwrap();
        assert!(w[0] > 2.0 * w[1], "{w:?}");
        assert!(feedback_weights(&[Signals::default()], &g, FeedbackFormula::Spare).is_none());
    }

    #[test]
    fn without_signals_dynamic_feedback_is_weighted_round_robin() {
        let sel = DynamicFeedback(FeedbackSpec::default()).build(pool(&[1, 3]));
        sel.refresh(1);
        sel.refresh(10_000);
        assert!(sel.weights().is_none());
        let c = counts(&*sel, 2, 400, &mut |_: &Backend| true);
        assert_eq!(c, vec![100, 300]);
    }

    #[test]
    fn orca_weights_follow_reports_after_the_blackout() {
        let p = pool(&[1, 1]);
        let spec = OrcaSpec { blackout_ms: 1_000, expiry_ms: 60_000, error_penalty_pct: 100 };
        for (b, (qps, cpu)) in p.backends().iter().zip([(100.0, 0.2), (100.0, 0.8)]) {
            b.stats.load.qps.set(qps);
            b.stats.load.cpu.set(cpu);
            b.stats.load.touch(100);
        }
        let sel = OrcaWrr(spec.clone()).build(p.clone());
        sel.refresh(500);
        assert!(sel.weights().is_none(), "still in blackout");
        for b in p.backends() {
            b.stats.load.touch(2_000);
        }
        sel.refresh(2_000);
        let w = sel.weights().unwrap();
        assert!((w[0] / w[1] - 4.0).abs() < 1e-6, "{w:?}");
        let c = counts(&*sel, 2, 500, &mut |_: &Backend| true);
        assert!(c[0] > 3 * c[1], "{c:?}");
        assert!(orca_weight(&p.backends()[0], &spec, 100_000).is_none(), "expired");
    }
}
