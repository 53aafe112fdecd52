//! `users`: a closed loop of concurrent users (paper S3's "500 concurrent
//! users"): each user sends a GET, waits for the answer (and an optional
//! think time), and sends the next, for the whole duration. Reports the
//! failure rate, latency percentiles and each backend's share (by the
//! emulator's `x-backend` header). Works against any proxy: Tidegate,
//! nginx or HAProxy.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::ensure;
use serde::Serialize;

use crate::cli::{Target, UsersArgs};
use crate::client::Http;
use crate::report::{per_second, Counts, Latency, Summary};

/// The JSON printed by `users`.
#[derive(Debug, Serialize)]
pub struct UsersReport {
    scenario: &'static str,
    users: usize,
    duration_s: f64,
    requests: u64,
    ok: u64,
    failed: u64,
    /// Failed / all, in percent.
    failure_pct: f64,
    requests_per_s: f64,
    /// Latency of successful requests.
    latency_us: Summary,
    /// Answers by status (and transport failures by kind).
    outcomes: Counts,
    /// Successful answers by backend.
    share: Counts,
}

struct UserResult {
    latency: Latency,
    outcomes: Counts,
    share: Counts,
    ok: u64,
    failed: u64,
}

/// Runs `users`.
pub async fn run(target: &Target, args: &UsersArgs) -> anyhow::Result<UsersReport> {
    ensure!(args.users > 0 && args.users <= 10_000, "--users must be 1..=10000");
    ensure!(args.duration_s > 0.0 && args.duration_s <= 3600.0, "--duration-s must be in (0, 3600]");
    let proxy = Arc::new(Http::new(target.proxy, None, Duration::from_millis(target.timeout_ms))?);
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(args.duration_s);
    let think = Duration::from_millis(args.think_ms);
    let mut tasks = Vec::with_capacity(args.users);
    for _ in 0..args.users {
        let proxy = Arc::clone(&proxy);
        let path = args.path.clone();
        tasks.push(tokio::spawn(async move { user(&proxy, &path, deadline, think).await }));
    }
    let (mut latency, mut outcomes, mut share) = (Latency::new(), Counts::default(), Counts::default());
    let (mut ok, mut failed) = (0, 0);
    for t in tasks {
        let r = t.await?;
        latency.merge(&r.latency);
        outcomes.merge(&r.outcomes);
        share.merge(&r.share);
        ok += r.ok;
        failed += r.failed;
    }
    let requests = ok + failed;
    let elapsed = started.elapsed();
    Ok(UsersReport {
        scenario: "users",
        users: args.users,
        duration_s: args.duration_s,
        requests,
        ok,
        failed,
        failure_pct: if requests == 0 { 0.0 } else { failed as f64 * 100.0 / requests as f64 },
        requests_per_s: per_second(requests, elapsed),
        latency_us: latency.summary(),
        outcomes,
        share,
    })
}

/// Think times are exponential with the given mean, and users start at
/// uniformly spread times within one think time: with fixed think times,
/// users that start together stay together and hit the backends in waves.
async fn user(proxy: &Http, path: &str, deadline: Instant, think: Duration) -> UserResult {
    let mut r =
        UserResult { latency: Latency::new(), outcomes: Counts::default(), share: Counts::default(), ok: 0, failed: 0 };
    let mut rng = fastrand::Rng::new();
    if !think.is_zero() {
        tokio::time::sleep(think.mul_f64(rng.f64())).await;
    }
    while Instant::now() < deadline {
        let sent = Instant::now();
        match proxy.get(path).await {
            Ok(reply) if reply.status.is_success() => {
                r.latency.record(sent.elapsed());
                r.ok += 1;
                r.outcomes.bump(reply.status.as_str());
                r.share.bump(reply.backend.unwrap_or_else(|| "?".to_string()));
            }
            Ok(reply) => {
                r.failed += 1;
                r.outcomes.bump(reply.status.as_str());
            }
            Err(f) => {
                r.failed += 1;
                r.outcomes.bump(f.label());
                // A refused connection fails at once; do not spin on it.
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        if !think.is_zero() {
            // Exponential: -ln(U) x mean, capped at 10 means.
            let factor = (-(1.0 - rng.f64()).ln()).min(10.0);
            tokio::time::sleep(think.mul_f64(factor)).await;
        }
    }
    r
}
