//! `traffic`: open-loop GETs against the proxy; latency from each request's
//! scheduled send time, and every answer that is not a 200 counted. Run it
//! next to `churn` or `saturate` to see what live traffic suffers.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, ensure};
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
    /// The client addresses requests were sent from, in turn (empty: the
    /// system's choice).
    sources: Vec<String>,
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
    let sources = source_addrs(args.source_from, args.sources, target.proxy)?;
    let proxies = match &sources {
        None => vec![Http::new(target.proxy, None, timeout)?],
        Some(ips) => ips
            .iter()
            .map(|ip| Http::from_source(target.proxy, None, timeout, Some((*ip).into())))
            .collect::<Result<_, _>>()?,
    };
    let proxies = Arc::new(proxies);
    let path: Arc<str> = Arc::from(args.path.as_str());

    let mut agg = Aggregate::new(args.expect_backend.clone());
    let sending = open_loop::run(
        plan,
        args.max_in_flight,
        timeout + Duration::from_secs(1),
        move |i, at| {
            // Request i from client address i modulo their count.
            let proxy = proxies[(i % proxies.len() as u64) as usize].clone();
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
        sources: sources.map_or_else(Vec::new, |ips| ips.iter().map(ToString::to_string).collect()),
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

/// The client addresses `--sources` and `--source-from` name: `n`
/// consecutive addresses from `first`, all loopback, to an IPv4 loopback
/// `target`; `None` for one address left to the system (the defaults).
fn source_addrs(first: Ipv4Addr, n: u32, target: SocketAddr) -> anyhow::Result<Option<Vec<Ipv4Addr>>> {
    if n == 1 && first == Ipv4Addr::LOCALHOST {
        return Ok(None);
    }
    ensure!(target.is_ipv4(), "--sources and --source-from need an IPv4 target, not {target}");
    // 127.0.0.0 and 127.255.255.255 are not hosts' addresses.
    let host = |ip: Ipv4Addr| ip.is_loopback() && ip.octets()[1..] != [0, 0, 0] && ip.octets()[1..] != [255; 3];
    let start = u32::from(first);
    let last = start.checked_add(n - 1).map(Ipv4Addr::from);
    let Some(last) = last.filter(|l| host(first) && host(*l)) else {
        bail!("--source-from {first} with --sources {n} leaves the host addresses of 127.0.0.0/8");
    };
    Ok(Some((start..=u32::from(last)).map(Ipv4Addr::from).collect()))
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
    fn sources_are_consecutive_loopback_addresses() {
        let v4: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        let from = |ip: &str| ip.parse::<Ipv4Addr>().unwrap();
        assert_eq!(source_addrs(Ipv4Addr::LOCALHOST, 1, v4).unwrap(), None, "the defaults: the system chooses");
        let ips = source_addrs(from("127.0.1.254"), 3, v4).unwrap().unwrap();
        assert_eq!(ips, [from("127.0.1.254"), from("127.0.1.255"), from("127.0.2.0")]);
        assert_eq!(source_addrs(from("127.0.0.9"), 1, v4).unwrap(), Some(vec![from("127.0.0.9")]));
        assert!(source_addrs(from("127.255.255.250"), 6, v4).is_err(), "reaches the broadcast address");
        assert!(source_addrs(from("127.0.0.0"), 2, v4).is_err());
        assert!(source_addrs(from("10.0.0.1"), 2, v4).is_err(), "not loopback");
        assert!(source_addrs(Ipv4Addr::LOCALHOST, 2, "[::1]:80".parse().unwrap()).is_err(), "IPv6 target");
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
