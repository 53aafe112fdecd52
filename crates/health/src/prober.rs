//! The loop of one prober: probe one backend forever, feed the results to
//! its live statistics, log the state changes.

use std::time::Duration;

use tidegate_balance::{clock, ActiveState};
use tokio::time::MissedTickBehavior;

use crate::plan::{ProbeKey, Target};
use crate::probe::{probe, ProbeClient, Verdict};

/// The first probe waits a random time below this (or below the interval,
/// when shorter), so that probers started together do not probe in lockstep.
pub const MAX_START_JITTER: Duration = Duration::from_millis(1_000);

/// Probes `target` every `check.interval_ms` until the task is aborted.
pub(crate) async fn run(key: ProbeKey, target: Target, client: ProbeClient) {
    let check = &*target.check;
    let interval = Duration::from_millis(check.interval_ms.max(1));
    let spread = interval.min(MAX_START_JITTER).as_millis() as u64;
    tokio::time::sleep(Duration::from_millis(fastrand::u64(0..spread.max(1)))).await;
    let mut ticks = tokio::time::interval(interval);
    // A probe slower than the interval delays the next one rather than
    // causing a burst.
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let verdict = probe(&client, &target.backend.addr, &target.upstream, check).await;
        let stats = &target.backend.stats;
        let before = stats.active_state();
        let after = stats.record_probe(verdict.passed, check.rise, check.fall, clock::now_ms());
        log_result(&key, &target, before, after, &verdict);
    }
}

fn log_result(key: &ProbeKey, target: &Target, before: ActiveState, after: ActiveState, verdict: &Verdict) {
    let (service, backend, addr, reason) =
        (key.service.as_str(), key.backend.as_str(), target.backend.addr.as_str(), verdict.detail.as_str());
    match (before, after) {
        (_, ActiveState::Down) if before != ActiveState::Down => {
            tracing::info!(service, backend, addr, reason, "backend down: active health check failed");
        }
        (ActiveState::Down, ActiveState::Up) => {
            tracing::info!(service, backend, addr, reason, "backend up: active health check passed");
        }
        (ActiveState::Unchecked, ActiveState::Up) => {
            // The normal start: not worth an info line per backend.
            tracing::debug!(service, backend, addr, reason, "backend up: first active health check passed");
        }
        _ if !verdict.passed => {
            tracing::debug!(service, backend, addr, reason, state = ?after, "active health check failed");
        }
        _ => {}
    }
}
