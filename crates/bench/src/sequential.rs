//! `sequential`: one request at a time over one keep-alive connection
//! (paper S4's overhead test): the next GET leaves when the previous answer
//! is complete. Run it against a backend directly and through each proxy;
//! the differences of the means and medians are what each proxy adds.

use std::time::{Duration, Instant};

use anyhow::ensure;
use serde::Serialize;

use crate::cli::{SequentialArgs, Target};
use crate::client::Http;
use crate::report::Counts;

/// Requests one run may send at most.
const MAX_REQUESTS: u64 = 10_000_000;

/// The JSON printed by `sequential`.
#[derive(Debug, Serialize)]
pub struct SequentialReport {
    scenario: &'static str,
    target: String,
    path: String,
    /// Measured requests (after the warm-up).
    requests: u64,
    warmup: u64,
    /// 2xx answers (from the expected backend, if one was given).
    ok: u64,
    failed: u64,
    errors: Counts,
    /// Statistics of the successful requests, microseconds (0.1 us).
    mean_us: f64,
    stddev_us: f64,
    min_us: f64,
    p50_us: f64,
    p90_us: f64,
    p99_us: f64,
    max_us: f64,
    elapsed_s: f64,
}

/// Runs `sequential` against `--proxy`.
pub async fn run(target: &Target, args: &SequentialArgs) -> anyhow::Result<SequentialReport> {
    ensure!(args.path.starts_with('/'), "--path must start with '/'");
    ensure!((1..=MAX_REQUESTS).contains(&args.requests), "--requests must be within 1..={MAX_REQUESTS}");
    ensure!(args.warmup <= MAX_REQUESTS, "--warmup is limited to {MAX_REQUESTS}");
    let http = Http::new(target.proxy, None, Duration::from_millis(target.timeout_ms))?;
    let mut errors = Counts::default();
    for _ in 0..args.warmup {
        if let Err(f) = http.get(&args.path).await {
            errors.bump(format!("warmup_{}", f.label()));
        }
    }
    let started = Instant::now();
    let mut samples: Vec<f64> = Vec::with_capacity(usize::try_from(args.requests).unwrap_or(0));
    for _ in 0..args.requests {
        let sent = Instant::now();
        let reply = http.get(&args.path).await;
        let took = sent.elapsed().as_secs_f64() * 1e6;
        match reply {
            Ok(r) if !r.status.is_success() => errors.bump(format!("status_{}", r.status.as_u16())),
            Ok(r) => match &args.expect_backend {
                Some(want) if r.backend.as_deref() != Some(want.as_str()) => errors.bump("wrong_backend"),
                _ => samples.push(took),
            },
            Err(f) => errors.bump(f.label()),
        }
    }
    let elapsed = started.elapsed();
    let ok = samples.len() as u64;
    let stats = Stats::of(&mut samples);
    Ok(SequentialReport {
        scenario: "sequential",
        target: target.proxy.to_string(),
        path: args.path.clone(),
        requests: args.requests,
        warmup: args.warmup,
        ok,
        failed: args.requests - ok,
        errors,
        mean_us: round1(stats.mean),
        stddev_us: round1(stats.stddev),
        min_us: round1(stats.min),
        p50_us: round1(stats.quantile(0.50)),
        p90_us: round1(stats.quantile(0.90)),
        p99_us: round1(stats.quantile(0.99)),
        max_us: round1(stats.max),
        elapsed_s: crate::report::seconds(elapsed),
    })
}

fn round1(v: f64) -> f64 {
    (v * 10.0).round() / 10.0
}

/// Exact statistics of a sample (sorted in place).
struct Stats<'a> {
    sorted: &'a [f64],
    mean: f64,
    stddev: f64,
    min: f64,
    max: f64,
}

impl<'a> Stats<'a> {
    fn of(samples: &'a mut [f64]) -> Stats<'a> {
        samples.sort_by(f64::total_cmp);
        let n = samples.len() as f64;
        if samples.is_empty() {
            return Stats { sorted: samples, mean: 0.0, stddev: 0.0, min: 0.0, max: 0.0 };
        }
        let mean = samples.iter().sum::<f64>() / n;
        // Sample standard deviation (n - 1), as a spreadsheet's STDEV.
        let var =
            if samples.len() > 1 { samples.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0) } else { 0.0 };
        let (min, max) = (samples[0], samples[samples.len() - 1]);
        Stats { sorted: samples, mean, stddev: var.sqrt(), min, max }
    }

    /// Nearest-rank quantile.
    fn quantile(&self, q: f64) -> f64 {
        if self.sorted.is_empty() {
            return 0.0;
        }
        let rank = (q * self.sorted.len() as f64).ceil() as usize;
        self.sorted[rank.clamp(1, self.sorted.len()) - 1]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statistics_of_a_known_sample() {
        let mut xs: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        let s = Stats::of(&mut xs);
        assert_eq!((s.min, s.max), (1.0, 100.0));
        assert!((s.mean - 50.5).abs() < 1e-9);
        assert!((s.stddev - 29.011_491).abs() < 1e-5, "{}", s.stddev);
        assert_eq!((s.quantile(0.5), s.quantile(0.99), s.quantile(1.0)), (50.0, 99.0, 100.0));
        let mut empty: Vec<f64> = Vec::new();
        let e = Stats::of(&mut empty);
        assert_eq!((e.mean, e.quantile(0.5)), (0.0, 0.0));
    }
}
