//! `sequential`: one request at a time over one keep-alive connection
//! (paper S4's overhead test): the next GET leaves when the previous answer
//! is complete, or at its planned time with `--rate`. Run it against a
//! backend directly and through each proxy; the differences of the means
//! and medians are what each proxy adds.
//!
//! With `--target` (repeated) the requests go to several paths in turn (in
//! a new random order every round), so each is measured in the same
//! moments: on a shared machine, noise that comes and goes then lands on
//! every path alike instead of on whichever ran at the time.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use serde::Serialize;

use crate::cli::{SequentialArgs, Target};
use crate::client::Http;
use crate::report::Counts;

/// Requests one run may send at most (per target).
const MAX_REQUESTS: u64 = 10_000_000;

/// Most targets one run measures in turn.
const MAX_TARGETS: usize = 16;

/// The JSON printed by `sequential` with one target.
#[derive(Debug, Serialize)]
pub struct SequentialReport {
    scenario: &'static str,
    /// The target's name (`proxy` for `--proxy`).
    name: String,
    target: String,
    path: String,
    /// Requests per second to this target; 0: back to back.
    rate: f64,
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

/// The JSON printed by `sequential` with `--target`: one report per target,
/// measured in turn over the same seconds.
#[derive(Debug, Serialize)]
pub struct InterleavedReport {
    scenario: &'static str,
    rate: f64,
    /// Requests that left more than one interval after their planned time
    /// (the previous answer took that long).
    late: u64,
    elapsed_s: f64,
    targets: Vec<SequentialReport>,
}

/// What `sequential` prints.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum Report {
    One(SequentialReport),
    Interleaved(InterleavedReport),
}

/// One path being measured.
struct Probe {
    name: String,
    addr: SocketAddr,
    path: String,
    http: Http,
    samples: Vec<f64>,
    errors: Counts,
}

impl Probe {
    fn new(name: &str, addr: SocketAddr, path: &str, timeout: Duration, requests: u64) -> anyhow::Result<Probe> {
        ensure!(path.starts_with('/'), "target {name}: the path must start with '/'");
        Ok(Probe {
            name: name.to_owned(),
            addr,
            path: path.to_owned(),
            http: Http::new(addr, None, timeout)?,
            samples: Vec::with_capacity(usize::try_from(requests).unwrap_or(0)),
            errors: Counts::default(),
        })
    }

    /// Sends one GET; a measured one adds its time or its failure.
    async fn once(&mut self, measured: bool, expect_backend: Option<&str>) {
        let sent = Instant::now();
        let reply = self.http.get(&self.path).await;
        let took = sent.elapsed().as_secs_f64() * 1e6;
        let failure = match reply {
            Ok(r) if !r.status.is_success() => Some(format!("status_{}", r.status.as_u16())),
            Ok(r) => match expect_backend {
                Some(want) if r.backend.as_deref() != Some(want) => Some("wrong_backend".to_owned()),
                _ => None,
            },
            Err(f) => Some(f.label().to_owned()),
        };
        match (failure, measured) {
            (None, true) => self.samples.push(took),
            (None, false) => {}
            (Some(f), true) => self.errors.bump(f),
            (Some(f), false) => self.errors.bump(format!("warmup_{f}")),
        }
    }

    fn report(mut self, args: &SequentialArgs, elapsed: Duration) -> SequentialReport {
        let ok = self.samples.len() as u64;
        let stats = Stats::of(&mut self.samples);
        SequentialReport {
            scenario: "sequential",
            name: self.name,
            target: self.addr.to_string(),
            path: self.path,
            rate: args.rate,
            requests: args.requests,
            warmup: args.warmup,
            ok,
            failed: args.requests - ok,
            errors: self.errors,
            mean_us: round1(stats.mean),
            stddev_us: round1(stats.stddev),
            min_us: round1(stats.min),
            p50_us: round1(stats.quantile(0.50)),
            p90_us: round1(stats.quantile(0.90)),
            p99_us: round1(stats.quantile(0.99)),
            max_us: round1(stats.max),
            elapsed_s: crate::report::seconds(elapsed),
        }
    }
}

/// Parses `NAME=HOST:PORT[/PATH]` (the path defaults to `default_path`).
fn parse_target(text: &str, default_path: &str) -> anyhow::Result<(String, SocketAddr, String)> {
    let Some((name, rest)) = text.split_once('=') else {
        bail!("--target {text:?}: expected NAME=HOST:PORT[/PATH]");
    };
    ensure!(!name.is_empty(), "--target {text:?}: the name is empty");
    let (addr, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, default_path),
    };
    let addr = addr.parse().with_context(|| format!("--target {text:?}: {addr:?} is not HOST:PORT"))?;
    Ok((name.to_owned(), addr, path.to_owned()))
}

/// Runs `sequential` against `--proxy`, or against every `--target` in turn.
pub async fn run(target: &Target, args: &SequentialArgs) -> anyhow::Result<Report> {
    ensure!((1..=MAX_REQUESTS).contains(&args.requests), "--requests must be within 1..={MAX_REQUESTS}");
    ensure!(args.warmup <= MAX_REQUESTS, "--warmup is limited to {MAX_REQUESTS}");
    ensure!(args.rate.is_finite() && args.rate >= 0.0, "--rate must be 0 or a positive number");
    ensure!(args.targets.len() <= MAX_TARGETS, "at most {MAX_TARGETS} --target");
    let timeout = Duration::from_millis(target.timeout_ms);
    let mut probes = Vec::new();
    for text in &args.targets {
        let (name, addr, path) = parse_target(text, &args.path)?;
        ensure!(probes.iter().all(|p: &Probe| p.name != name), "--target {name} is given twice");
        probes.push(Probe::new(&name, addr, &path, timeout, args.requests)?);
    }
    let one = probes.is_empty();
    if one {
        probes.push(Probe::new("proxy", target.proxy, &args.path, timeout, args.requests)?);
    }
    let expect = args.expect_backend.as_deref();
    for _ in 0..args.warmup {
        for p in &mut probes {
            p.once(false, expect).await;
        }
    }
    // Each round sends one request to every probe, in a new random order,
    // so that no path always follows the same one (whose request just
    // warmed the caches it shares); with `--rate`, request i leaves at i
    // intervals from the start.
    let interval = (args.rate > 0.0).then(|| Duration::from_secs_f64(1.0 / (args.rate * probes.len() as f64)));
    let started = Instant::now();
    let mut late = 0;
    let mut planned = started;
    let mut order: Vec<usize> = (0..probes.len()).collect();
    for _ in 0..args.requests {
        fastrand::shuffle(&mut order);
        for &i in &order {
            let p = &mut probes[i];
            if let Some(interval) = interval {
                let now = Instant::now();
                if now > planned + interval {
                    late += 1;
                }
                tokio::time::sleep_until(planned.into()).await;
                planned += interval;
            }
            p.once(true, expect).await;
        }
    }
    let elapsed = started.elapsed();
    let mut reports = probes.into_iter().map(|p| p.report(args, elapsed));
    if one {
        return Ok(Report::One(reports.next().expect("one probe")));
    }
    Ok(Report::Interleaved(InterleavedReport {
        scenario: "sequential",
        rate: args.rate,
        late,
        elapsed_s: crate::report::seconds(elapsed),
        targets: reports.collect(),
    }))
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
    fn targets_parse_with_and_without_a_path() {
        let (name, addr, path) = parse_target("nginx=127.0.0.1:8080/rr", "/").unwrap();
        assert_eq!((name.as_str(), addr.port(), path.as_str()), ("nginx", 8080, "/rr"));
        let (_, _, path) = parse_target("direct=127.0.0.1:9", "/x").unwrap();
        assert_eq!(path, "/x");
        for bad in ["127.0.0.1:80", "=127.0.0.1:80", "a=localhost:80", "a=127.0.0.1"] {
            assert!(parse_target(bad, "/").is_err(), "{bad}");
        }
    }

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
