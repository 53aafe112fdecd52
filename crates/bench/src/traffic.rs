//! `traffic`: open-loop GETs against the proxy; latency from each request's
//! scheduled send time, and every answer that is not a 200 counted. Run it
//! next to `churn` or `saturate` to see what live traffic suffers.

use std::sync::Arc;
use std::time::Duration;

use anyhow::ensure;
use http::StatusCode;
use serde::Serialize;

use crate::cli::{Target, TrafficArgs};
use crate::client::{Failure, Http, Reply};
use crate::open_loop::{self, Sending};
use crate::report::{Counts, Latency, Summary};
use crate::schedule::Plan;

/// The JSON printed by `traffic`.
#[derive(Debug, Serialize)]
pub struct TrafficReport {
    scenario: &'static str,
    path: String,
    rate: f64,
    duration_s: f64,
    sending: Sending,
    /// Requests answered 200 (by the expected backend, if one was given).
    ok: u64,
    /// Requests answered with another status.
    non_200: u64,
    /// Answers by status code.
    statuses: Counts,
    /// Scheduled send time until the answer, over every answered request.
    latency_us: Summary,
    /// The same, over the 200s only.
    ok_latency_us: Summary,
    /// Requests that got no answer, or a 200 from another backend.
    errors: Counts,
    error_total: u64,
}

/// Runs `traffic`.
pub async fn run(target: &Target, args: &TrafficArgs) -> anyhow::Result<TrafficReport> {
    ensure!(args.path.starts_with('/'), "--path must start with '/'");
    let plan = Plan::new(args.rate, args.duration_s)?;
    let timeout = Duration::from_millis(target.timeout_ms);
    let proxy = Arc::new(Http::new(target.proxy, None, timeout)?);
    let path: Arc<str> = Arc::from(args.path.as_str());

    let mut agg = Aggregate::new(args.expect_backend.clone());
    let sending = open_loop::run(
        plan,
        args.max_in_flight,
        timeout + Duration::from_secs(1),
        move |_, at| {
            let proxy = Arc::clone(&proxy);
            let path = Arc::clone(&path);
            async move {
                let reply = proxy.get(&path).await;
                (reply, at.elapsed())
            }
        },
        |(reply, latency)| agg.add(&reply, latency),
    )
    .await?;
    if sending.unfinished > 0 {
        agg.errors.bump("unfinished");
    }
    Ok(TrafficReport {
        scenario: "traffic",
        path: args.path.clone(),
        rate: args.rate,
        duration_s: args.duration_s,
        sending,
        ok: agg.ok,
        non_200: agg.non_200,
        statuses: agg.statuses,
        latency_us: agg.latency.summary(),
        ok_latency_us: agg.ok_latency.summary(),
        error_total: agg.errors.total(),
        errors: agg.errors,
    })
}

/// Totals over all requests.
struct Aggregate {
    expect_backend: Option<String>,
    ok: u64,
    non_200: u64,
    statuses: Counts,
    latency: Latency,
    ok_latency: Latency,
    errors: Counts,
}

impl Aggregate {
    fn new(expect_backend: Option<String>) -> Aggregate {
        Aggregate {
            expect_backend,
            ok: 0,
            non_200: 0,
            statuses: Counts::default(),
            latency: Latency::new(),
            ok_latency: Latency::new(),
            errors: Counts::default(),
        }
    }

    fn add(&mut self, reply: &Result<Reply, Failure>, latency: Duration) {
        let r = match reply {
            Ok(r) => r,
            Err(f) => {
                self.errors.bump(f.label());
                return;
            }
        };
        self.latency.record(latency);
        self.statuses.bump(r.status.as_u16().to_string());
        if r.status != StatusCode::OK {
            self.non_200 += 1;
            return;
        }
        match &self.expect_backend {
            Some(want) if r.backend.as_deref() != Some(want.as_str()) => {
                self.errors.bump("wrong_backend");
            }
            _ => {
                self.ok += 1;
                self.ok_latency.record(latency);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    fn reply(status: u16, backend: &str) -> Result<Reply, Failure> {
        Ok(Reply {
            status: StatusCode::from_u16(status).unwrap(),
            backend: Some(backend.to_owned()),
            body: Bytes::new(),
        })
    }

    #[test]
    fn answers_are_sorted_into_ok_non_200_and_errors() {
        let mut agg = Aggregate::new(Some("a".to_owned()));
        let d = Duration::from_micros(300);
        agg.add(&reply(200, "a"), d);
        agg.add(&reply(200, "b"), d);
        agg.add(&reply(502, "a"), d);
        agg.add(&Err(Failure::Transport), d);
        assert_eq!(agg.ok, 1);
        assert_eq!(agg.non_200, 1);
        assert_eq!(agg.errors.total(), 2);
        assert_eq!(agg.latency.count(), 3);
        assert_eq!(agg.ok_latency.count(), 1);
        assert_eq!(serde_json::to_string(&agg.statuses).unwrap(), r#"{"200":2,"502":1}"#);
    }
}
