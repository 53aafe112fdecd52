//! `ramp`: open-loop GETs whose rate follows a timetable of steps (paper
//! S1's peak: a ramp past one instance's capacity and back). Latency runs
//! from each request's scheduled send time. Reports each step, a timeline
//! in bins, and when each backend (the emulator's `x-backend`) first
//! answered, in Unix milliseconds so it can be lined up with Tidegate's
//! autoscaling events; `--log` writes one CSV line per request.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{ensure, Context};
use serde::Serialize;

use crate::cli::{RampArgs, Target};
use crate::client::{Failure, Http, Reply};
use crate::open_loop::{self, Sending};
use crate::report::{Counts, Latency, Summary};
use crate::schedule::{self, Schedule, Step, Timetable};

/// Timeline bins at most.
const MAX_BINS: f64 = 100_000.0;

/// The JSON printed by `ramp`.
#[derive(Debug, Serialize)]
pub struct RampReport {
    scenario: &'static str,
    path: String,
    poisson: bool,
    /// When the schedule started (event 0 was due), ms since the Unix epoch.
    start_unix_ms: u64,
    sending: Sending,
    /// Over the whole run.
    total: Part,
    /// One entry per step, in order.
    steps: Vec<StepReport>,
    /// Requests by scheduled time, in bins of `bin_s` seconds.
    bin_s: f64,
    timeline: Vec<Bin>,
    /// When each backend's first 2xx answer arrived, ms since the Unix epoch.
    first_served_unix_ms: BTreeMap<String, u64>,
}

/// A step of the timetable and what its requests saw.
#[derive(Debug, Serialize)]
pub struct StepReport {
    rate: f64,
    duration_s: f64,
    /// Start relative to the run's start, seconds.
    start_s: f64,
    start_unix_ms: u64,
    #[serde(flatten)]
    part: Part,
}

/// What a set of requests saw.
#[derive(Debug, Default, Serialize)]
pub struct Part {
    /// Requests scheduled.
    planned: u64,
    /// Requests that got an answer or failed (not skipped, not unfinished).
    finished: u64,
    /// 2xx answers.
    ok: u64,
    /// Non-2xx answers and transport failures.
    failed: u64,
    /// Requests with no outcome: skipped at the in-flight cap, or still
    /// unanswered when the run ended (count them as failures too).
    missing: u64,
    /// Scheduled send until a 2xx answer.
    latency_us: Summary,
    /// Answers by status, failures by kind.
    outcomes: Counts,
    /// 2xx answers by backend.
    share: Counts,
}

/// One bin of the timeline.
#[derive(Debug, Serialize)]
pub struct Bin {
    /// Bin start relative to the run's start, seconds.
    t_s: f64,
    sent: u64,
    ok: u64,
    failed: u64,
    p50_us: u64,
    p99_us: u64,
    max_us: u64,
    share: Counts,
}

/// One finished request.
struct Record {
    i: u64,
    /// Scheduled time relative to the run's base instant.
    due: Duration,
    /// Scheduled time until the answer (or the failure).
    latency: Duration,
    outcome: Result<u16, Failure>,
    backend: Option<String>,
}

/// Aggregates for one part.
#[derive(Default)]
struct Acc {
    planned: u64,
    finished: u64,
    ok: u64,
    failed: u64,
    latency: Latency,
    outcomes: Counts,
    share: Counts,
}

impl Acc {
    fn add(&mut self, r: &Record) {
        self.finished += 1;
        match &r.outcome {
            Ok(status) if (200..300).contains(status) => {
                self.ok += 1;
                self.latency.record(r.latency);
                self.outcomes.bump(status.to_string());
                self.share.bump(r.backend.clone().unwrap_or_else(|| "?".to_owned()));
            }
            Ok(status) => {
                self.failed += 1;
                self.outcomes.bump(status.to_string());
            }
            Err(f) => {
                self.failed += 1;
                self.outcomes.bump(f.label());
            }
        }
    }

    fn part(self) -> Part {
        Part {
            planned: self.planned,
            finished: self.finished,
            ok: self.ok,
            failed: self.failed,
            missing: self.planned.saturating_sub(self.finished),
            latency_us: self.latency.summary(),
            outcomes: self.outcomes,
            share: self.share,
        }
    }
}

/// Runs `ramp`.
pub async fn run(target: &Target, args: &RampArgs) -> anyhow::Result<RampReport> {
    ensure!(args.path.starts_with('/'), "--path must start with '/'");
    ensure!(args.bin_s.is_finite() && args.bin_s > 0.0, "--bin-s must be positive");
    let steps: Vec<Step> = schedule::parse_steps(&args.steps)?;
    let total_s: f64 = steps.iter().map(|s| s.duration_s).sum();
    ensure!(total_s / args.bin_s <= MAX_BINS, "--bin-s is too small for {total_s} s");
    let table = Timetable::new(&steps, args.poisson, args.seed)?;
    let timeout = Duration::from_millis(target.timeout_ms);
    let proxy = Arc::new(Http::new(target.proxy, None, timeout)?);
    let path: Arc<str> = Arc::from(args.path.as_str());

    // Scheduled instants map to wall-clock time through this pair.
    let base = Instant::now();
    let base_unix = SystemTime::now().duration_since(UNIX_EPOCH).context("clock before 1970")?;
    let mut records: Vec<Record> = Vec::with_capacity(usize::try_from(table.count()).unwrap_or(0));
    let sending = open_loop::run(
        table.clone(),
        args.max_in_flight,
        timeout + Duration::from_secs(1),
        move |i, at| {
            let proxy = Arc::clone(&proxy);
            let path = Arc::clone(&path);
            async move {
                let reply: Result<Reply, Failure> = proxy.get(&path).await;
                let latency = at.elapsed();
                let due = at.saturating_duration_since(base);
                match reply {
                    Ok(r) => Record { i, due, latency, outcome: Ok(r.status.as_u16()), backend: r.backend },
                    Err(f) => Record { i, due, latency, outcome: Err(f), backend: None },
                }
            }
        },
        |r| records.push(r),
    )
    .await?;
    records.sort_by_key(|r| r.i);
    // The schedule's start: event 0 is due at its offset (zero) from it.
    let start = records.first().map(|r| r.due.saturating_sub(table.offset(r.i))).unwrap_or_default();
    let unix_ms = |d: Duration| u64::try_from((base_unix + d).as_millis()).unwrap_or(u64::MAX);

    if let Some(log) = &args.log {
        write_log(log, &records, &unix_ms).with_context(|| format!("writing {}", log.display()))?;
    }

    let mut total = Acc { planned: table.count(), ..Acc::default() };
    let mut per_step: Vec<Acc> =
        (0..steps.len()).map(|k| Acc { planned: table.step_count(k), ..Acc::default() }).collect();
    let bins = (total_s / args.bin_s).ceil() as usize;
    let mut timeline: Vec<(Acc, u64)> = (0..bins.max(1)).map(|_| (Acc::default(), 0)).collect();
    let mut first_served: BTreeMap<String, u64> = BTreeMap::new();
    for r in &records {
        total.add(r);
        if let Some(acc) = per_step.get_mut(table.step_of(r.i)) {
            acc.add(r);
        }
        let bin = ((table.offset(r.i).as_secs_f64() / args.bin_s) as usize).min(timeline.len() - 1);
        if let Some((acc, sent)) = timeline.get_mut(bin) {
            acc.add(r);
            *sent += 1;
        }
        if let (Ok(200..=299), Some(b)) = (&r.outcome, &r.backend) {
            let done = unix_ms(r.due + r.latency);
            let slot = first_served.entry(b.clone()).or_insert(done);
            *slot = (*slot).min(done);
        }
    }
    let steps_report = steps
        .iter()
        .zip(per_step)
        .enumerate()
        .map(|(k, (s, acc))| {
            let offset = table.step_start(k);
            StepReport {
                rate: s.rate,
                duration_s: s.duration_s,
                start_s: offset.as_secs_f64(),
                start_unix_ms: unix_ms(start + offset),
                part: acc.part(),
            }
        })
        .collect();
    let timeline = timeline
        .into_iter()
        .enumerate()
        .map(|(k, (acc, sent))| {
            let lat = acc.latency.summary();
            Bin {
                t_s: (k as f64 * args.bin_s * 1000.0).round() / 1000.0,
                sent,
                ok: acc.ok,
                failed: acc.failed,
                p50_us: lat.p50,
                p99_us: lat.p99,
                max_us: lat.max,
                share: acc.share,
            }
        })
        .collect();
    Ok(RampReport {
        scenario: "ramp",
        path: args.path.clone(),
        poisson: args.poisson,
        start_unix_ms: unix_ms(start),
        sending,
        total: total.part(),
        steps: steps_report,
        bin_s: args.bin_s,
        timeline,
        first_served_unix_ms: first_served,
    })
}

/// One CSV line per finished request:
/// `due_unix_ms,done_unix_ms,latency_us,outcome,backend`.
fn write_log(path: &std::path::Path, records: &[Record], unix_ms: &impl Fn(Duration) -> u64) -> std::io::Result<()> {
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    writeln!(out, "due_unix_ms,done_unix_ms,latency_us,outcome,backend")?;
    for r in records {
        let outcome = match &r.outcome {
            Ok(status) => status.to_string(),
            Err(f) => f.label().to_owned(),
        };
        writeln!(
            out,
            "{},{},{},{},{}",
            unix_ms(r.due),
            unix_ms(r.due + r.latency),
            r.latency.as_micros(),
            outcome,
            r.backend.as_deref().unwrap_or("").replace(',', ";")
        )?;
    }
    out.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(status: Result<u16, Failure>, backend: Option<&str>) -> Record {
        Record {
            i: 0,
            due: Duration::ZERO,
            latency: Duration::from_millis(2),
            outcome: status,
            backend: backend.map(str::to_owned),
        }
    }

    #[test]
    fn parts_count_2xx_as_ok_and_everything_else_as_failed() {
        let mut acc = Acc { planned: 4, ..Acc::default() };
        acc.add(&record(Ok(200), Some("a")));
        acc.add(&record(Ok(204), None));
        acc.add(&record(Ok(503), Some("a")));
        acc.add(&record(Err(Failure::Timeout), None));
        let part = acc.part();
        assert_eq!((part.planned, part.finished, part.ok, part.failed), (4, 4, 2, 2));
        assert_eq!(part.latency_us.count, 2);
        assert_eq!(serde_json::to_string(&part.share).unwrap(), r#"{"?":1,"a":1}"#);
        assert_eq!(serde_json::to_string(&part.outcomes).unwrap(), r#"{"200":1,"204":1,"503":1,"timeout":1}"#);
    }
}
