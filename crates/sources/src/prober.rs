//! The Prequal prober: one task per service on the `prequal` policy,
//! sending `GET probe_path` to randomly chosen backends at a rate that
//! follows the service's traffic (`probes_per_request_pct` probes per 100
//! requests), and storing each answer in the backend's
//! [`ProbeState`](tidegate_balance::ProbeState).
//!
//! An answer's requests in flight (RIF) and latency come from its ORCA
//! `endpoint-load-metrics` header (`named_metrics.rif`,
//! `named_metrics.latency_ms`); a backend that does not report them is
//! described by the proxy's own count of requests in flight to it and by
//! its latency average (else the probe's round trip). Probes go as the
//! service's requests do: plain HTTP/1.1 over a shared keep-alive pool, or,
//! for a service with `upstream.tls` or HTTP/2, on a connection of their
//! own opened by the service's upstream profile (its CAs, server name and
//! client certificate). A failed or late probe stores nothing, so the
//! backend drops out of the probed pool until it answers again.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, Request, Uri};
use http_body_util::{BodyExt, Full, Limited};
use tidegate_balance::{clock, orca, Backend};
use tidegate_health::get_via;
use tidegate_model::{PolicySpec, PrequalSpec};
use tidegate_snapshot::ServiceRuntime;
use tidegate_upstream::{HttpClient, HttpOptions, Profile};
use tokio::sync::watch;
use tokio::time::{Instant, MissedTickBehavior};

/// How often the prober looks at the traffic and sends what it owes.
pub const PROBE_TICK: Duration = Duration::from_millis(5);
/// Most probes sent per tick.
const MAX_PER_TICK: usize = 16;
/// A probe answer's body is read up to this size and discarded.
const MAX_PROBE_BODY: usize = 64 * 1024;

/// The client the probes share: a few idle connections per backend.
pub(crate) type ProbeClient = HttpClient;

pub(crate) fn client() -> ProbeClient {
    HttpClient::new(HttpOptions { connect_timeout: Duration::from_secs(1), idle_per_host: 8, ..HttpOptions::default() })
}

/// How many probes the traffic since the last tick asks for, carrying
/// the fraction over (`owed`) and never more than `backends` or
/// [`MAX_PER_TICK`]. Pure, for tests.
pub fn probes_due(owed: &mut f64, new_requests: u64, per_request_pct: u32, backends: usize) -> usize {
    *owed += new_requests as f64 * f64::from(per_request_pct) / 100.0;
    let n = (owed.floor() as usize).min(backends).min(MAX_PER_TICK);
    *owed = (*owed - n as f64).min(MAX_PER_TICK as f64);
    n
}

/// A service to probe (its backends and policy), as of the latest snapshot.
#[derive(Debug)]
pub(crate) struct ProbeTarget(pub Arc<ServiceRuntime>);

/// Probes the service's backends until aborted; the service (and so its
/// backends and policy) comes from `target`.
pub(crate) async fn run(client: ProbeClient, mut target: watch::Receiver<Arc<ProbeTarget>>) {
    let mut tick = tokio::time::interval(PROBE_TICK);
    tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
    let mut last_requests: Option<u64> = None;
    let mut owed = 0.0;
    loop {
        tick.tick().await;
        let service = target.borrow_and_update().0.clone();
        let PolicySpec::Prequal(spec) = &service.settings.policy else {
            continue;
        };
        let backends = service.selector.backends();
        let requests: u64 = backends.iter().map(|b| b.stats.requests() + b.stats.in_flight()).sum();
        let new = requests.saturating_sub(last_requests.unwrap_or(requests));
        last_requests = Some(requests);
        let n = probes_due(&mut owed, new, spec.probes_per_request_pct, backends.len());
        for i in sample(backends.len(), n) {
            tokio::spawn(probe(client.clone(), backends[i].clone(), service.upstream.clone(), spec.clone()));
        }
    }
}

/// `n` distinct indices below `len`, at random.
fn sample(len: usize, n: usize) -> Vec<usize> {
    let mut all: Vec<usize> = (0..len).collect();
    for i in 0..n.min(len) {
        let j = i + fastrand::usize(..len - i);
        all.swap(i, j);
    }
    all.truncate(n.min(len));
    all
}

/// The `User-Agent` of Prequal's probes.
const PROBER_USER_AGENT: &str = "tidegate-prober";

/// One probe; stores the answer, if one comes within `max_age_ms`.
async fn probe(client: ProbeClient, backend: Arc<Backend>, upstream: Profile, spec: PrequalSpec) {
    let started = Instant::now();
    let limit = Duration::from_millis(spec.max_age_ms);
    let exchange = async {
        let response = if upstream.is_plain_http1() {
            let uri = format!("http://{}{}", backend.authority, spec.probe_path).parse::<Uri>().ok()?;
            let request =
                Request::get(uri).header(header::USER_AGENT, PROBER_USER_AGENT).body(Full::new(Bytes::new())).ok()?;
            client.head(request, limit).await.ok()?
        } else {
            get_via(&backend.addr, &upstream, &spec.probe_path, PROBER_USER_AGENT, limit).await.ok()?
        };
        let report = response
            .headers()
            .get(orca::ORCA_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(orca::parse)
            .and_then(|r| r.probe());
        // Read the (small) body so the connection can be reused.
        let _ = Limited::new(response.into_body(), MAX_PROBE_BODY).collect().await;
        Some(report)
    };
    let Ok(Some(report)) = tokio::time::timeout(limit, exchange).await else {
        return;
    };
    let round_trip_ms = started.elapsed().as_secs_f64() * 1e3;
    let own_latency_ms = || backend.stats.latency_ewma().map_or(round_trip_ms, |d| d.as_secs_f64() * 1e3);
    let (rif, latency_ms) = match report {
        Some((rif, latency)) => (rif, latency.unwrap_or_else(own_latency_ms)),
        None => (backend.stats.in_flight() as f64, own_latency_ms()),
    };
    backend.stats.probe.store(rif, latency_ms, clock::now_ms());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probes_follow_the_traffic_and_carry_fractions() {
        let mut owed = 0.0;
        assert_eq!(probes_due(&mut owed, 0, 100, 5), 0);
        assert_eq!(probes_due(&mut owed, 3, 100, 5), 3);
        // 50 %: one request owes half a probe, the second one completes it.
        assert_eq!(probes_due(&mut owed, 1, 50, 5), 0);
        assert_eq!(probes_due(&mut owed, 1, 50, 5), 1);
        // Never more than the backends, nor a backlog beyond one tick's worth.
        assert_eq!(probes_due(&mut owed, 1_000, 100, 4), 4);
        assert!(owed <= MAX_PER_TICK as f64);
    }

    #[test]
    fn samples_are_distinct_and_in_range() {
        for _ in 0..100 {
            let mut s = sample(10, 4);
            s.sort_unstable();
            s.dedup();
            assert_eq!(s.len(), 4);
            assert!(s.iter().all(|&i| i < 10));
        }
        assert_eq!(sample(2, 5).len(), 2);
        assert!(sample(0, 3).is_empty());
    }
}
