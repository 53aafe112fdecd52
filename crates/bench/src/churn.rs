//! `churn`: open-loop route creation; for each change, the time from its
//! scheduled send until the proxy serves the new route.
//!
//! Change `i` is `PUT /v1/routes/churn-{tag}-{i}` matching exactly
//! `/churn/{tag}/{i}`. Once the admin API answers 200 the route must be live,
//! so the first proxy GET should already answer 200; if it does not, the GET
//! is retried (every 100 us as asked of tokio, whose timer rounds up to
//! 1 ms) for at most one second and the change counts as needing a retry.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use http::StatusCode;
use serde::Serialize;
use serde_json::json;

use crate::cli::{ChurnArgs, Target};
use crate::client::{self, Failure, Http, Reply};
use crate::open_loop::{self, Sending};
use crate::raw::{self, RawPool};
use crate::report::{Counts, Latency, Summary};
use crate::schedule::Plan;

/// How long a change may take to show up on the proxy after the admin answer.
const EFFECTIVE_WINDOW: Duration = Duration::from_secs(1);
/// Pause between proxy GETs while the route is not live.
const RETRY_EVERY: Duration = Duration::from_micros(100);
/// Proxy GETs per change at most (a second bound besides the window).
const MAX_ATTEMPTS: u32 = 10_001;

/// The JSON printed by `churn`.
#[derive(Debug, Serialize)]
pub struct ChurnReport {
    scenario: &'static str,
    service: String,
    tag: String,
    first_route: String,
    rate: f64,
    duration_s: f64,
    sending: Sending,
    /// Changes the admin API accepted (200).
    changes_ok: u64,
    /// Changes whose route answered 200 on the proxy within the window.
    effective: u64,
    /// Accepted changes whose route never answered 200 within the window.
    never_effective: u64,
    /// Effective changes whose first proxy GET was not yet a 200.
    needed_retry: u64,
    /// Extra proxy GETs over all changes.
    retries_total: u64,
    /// Most extra GETs one change needed.
    max_retries: u32,
    /// What the first, unsuccessful GET of a retried change saw.
    first_miss: Counts,
    /// Scheduled send time until the admin API answered 200.
    admin_us: Summary,
    /// From the moment the change's task began to send it (after the
    /// generator's own scheduling lag, `sending.send_lag_us`, and the wake
    /// of the task) until the admin API answered 200: the server's answer
    /// time as one client sees it.
    admin_from_send_us: Summary,
    /// Scheduled send time until the proxy answered 200 on the new route.
    time_to_effective_us: Summary,
    /// Admin answer until the proxy answered 200 (includes any retries).
    proxy_after_admin_us: Summary,
    errors: Counts,
    error_total: u64,
    /// An unrouted `/churn/{tag}/...` path already answered 200 (a
    /// catch-all route), so a 200 does not prove the new route is live.
    catch_all_detected: bool,
    warnings: Vec<String>,
}

/// What one change produced.
enum Outcome {
    /// The admin API did not answer 200.
    AdminFailed(String),
    /// Accepted, then served by the proxy.
    Effective {
        admin: Duration,
        admin_from_send: Duration,
        effective: Duration,
        after_admin: Duration,
        retries: u32,
        first_miss: Option<String>,
    },
    /// Accepted, but the proxy never served it within the window.
    NeverEffective { admin: Duration, admin_from_send: Duration, last_miss: String },
}

/// Shared by every change task.
struct Ctx {
    /// The admin API, for the changes (the lean client: see `raw`).
    admin: RawPool,
    token: String,
    proxy: Http,
    /// Further instances' proxies that must serve the change too.
    others: Vec<Http>,
    service: String,
    tag: String,
    expect_backend: Option<String>,
}

impl Ctx {
    fn route_name(&self, i: u64) -> String {
        route_name(&self.tag, i)
    }

    fn path(&self, i: u64) -> String {
        route_path(&self.tag, i)
    }

    /// `None` when the reply proves the route is live, else why not.
    fn miss(&self, reply: &Result<Reply, Failure>) -> Option<String> {
        miss_label(reply, self.expect_backend.as_deref())
    }
}

/// Runs `churn`.
pub async fn run(target: &Target, args: &ChurnArgs) -> anyhow::Result<ChurnReport> {
    let plan = Plan::new(args.rate, args.duration_s)?;
    let timeout = Duration::from_millis(target.timeout_ms);
    let admin = Http::new(target.admin, Some(client::token(target)?), timeout)?;
    let proxy = Http::new(target.proxy, None, timeout)?;
    let reply = admin.get(&format!("/v1/services/{}", args.service)).await;
    client::expect_ok("GET service (create it with `setup`)", reply)?;

    let tag = args.tag.clone().unwrap_or_else(default_tag);
    let others = args.also_proxy.iter().map(|a| Http::new(*a, None, timeout)).collect::<Result<Vec<_>, _>>()?;
    let ctx = Arc::new(Ctx {
        admin: RawPool::new(target.admin, timeout),
        token: client::token(target)?.to_owned(),
        proxy,
        others,
        service: args.service.clone(),
        tag,
        expect_backend: args.expect_backend.clone(),
    });

    let mut warnings = Vec::new();
    let probe = ctx.proxy.get(&format!("{}-probe", ctx.path(0))).await;
    let catch_all_detected = ctx.miss(&probe).is_none();
    if catch_all_detected {
        warnings.push(
            "an unrouted churn path already answers 200 (catch-all route?): \
             time_to_effective only shows admin latency plus one GET; \
             route churn to a service with its own backend and pass --expect-backend"
                .to_owned(),
        );
    }

    let mut agg = Aggregate::default();
    let grace = 2 * timeout + EFFECTIVE_WINDOW + Duration::from_secs(1);
    let task_ctx = Arc::clone(&ctx);
    let sending = open_loop::run(
        plan,
        args.max_in_flight,
        grace,
        move |i, at| change(Arc::clone(&task_ctx), i, at),
        |outcome| agg.add(outcome),
    )
    .await?;
    if sending.unfinished > 0 {
        agg.errors.bump("unfinished");
    }
    if agg.needed_retry > 0 {
        warnings.push(format!("{} change(s) were not yet served when the admin API had answered", agg.needed_retry));
    }

    Ok(ChurnReport {
        scenario: "churn",
        service: ctx.service.clone(),
        tag: ctx.tag.clone(),
        first_route: ctx.route_name(0),
        rate: args.rate,
        duration_s: args.duration_s,
        sending,
        changes_ok: agg.changes_ok,
        effective: agg.effective,
        never_effective: agg.never_effective,
        needed_retry: agg.needed_retry,
        retries_total: agg.retries_total,
        max_retries: agg.max_retries,
        first_miss: agg.first_miss,
        admin_us: agg.admin.summary(),
        admin_from_send_us: agg.admin_from_send.summary(),
        time_to_effective_us: agg.effective_lat.summary(),
        proxy_after_admin_us: agg.after_admin.summary(),
        error_total: agg.errors.total(),
        errors: agg.errors,
        catch_all_detected,
        warnings,
    })
}

/// One change: PUT the route, then GET it on the proxy until it answers.
async fn change(ctx: Arc<Ctx>, i: u64, scheduled: Instant) -> Outcome {
    let body = json!({ "match": { "path": ctx.path(i) }, "service": ctx.service }).to_string();
    let path = format!("/v1/routes/{}", ctx.route_name(i));
    let request = raw::request("PUT", &path, ctx.admin.addr(), &ctx.token, body.as_bytes());
    let sent = Instant::now();
    match ctx.admin.send(&request).await {
        Ok(200) => {}
        Ok(status) => return Outcome::AdminFailed(format!("admin_status_{status}")),
        Err(f) => return Outcome::AdminFailed(format!("admin_{}", f.label())),
    }
    let answered = Instant::now();
    let admin = answered - scheduled;
    let admin_from_send = answered - sent;
    let path = ctx.path(i);
    let mut first_miss = None;
    let mut attempts: u32 = 0;
    // The instance that answered first, then every other one.
    for proxy in std::iter::once(&ctx.proxy).chain(&ctx.others) {
        loop {
            attempts += 1;
            let reply = proxy.get(&path).await;
            let Some(miss) = ctx.miss(&reply) else {
                break;
            };
            if answered.elapsed() >= EFFECTIVE_WINDOW || attempts >= MAX_ATTEMPTS {
                return Outcome::NeverEffective { admin, admin_from_send, last_miss: miss };
            }
            first_miss.get_or_insert(miss);
            tokio::time::sleep(RETRY_EVERY).await;
        }
    }
    let now = Instant::now();
    let served = 1 + ctx.others.len() as u32;
    Outcome::Effective {
        admin,
        admin_from_send,
        effective: now - scheduled,
        after_admin: now - answered,
        retries: attempts - served,
        first_miss,
    }
}

/// Totals over all changes.
#[derive(Default)]
struct Aggregate {
    changes_ok: u64,
    effective: u64,
    never_effective: u64,
    needed_retry: u64,
    retries_total: u64,
    max_retries: u32,
    first_miss: Counts,
    admin: Latency,
    admin_from_send: Latency,
    effective_lat: Latency,
    after_admin: Latency,
    errors: Counts,
}

impl Aggregate {
    fn add(&mut self, outcome: Outcome) {
        match outcome {
            Outcome::AdminFailed(label) => self.errors.bump(label),
            Outcome::Effective { admin, admin_from_send, effective, after_admin, retries, first_miss } => {
                self.changes_ok += 1;
                self.effective += 1;
                self.admin.record(admin);
                self.admin_from_send.record(admin_from_send);
                self.effective_lat.record(effective);
                self.after_admin.record(after_admin);
                if retries > 0 {
                    self.needed_retry += 1;
                    self.retries_total += u64::from(retries);
                    self.max_retries = self.max_retries.max(retries);
                }
                if let Some(miss) = first_miss {
                    self.first_miss.bump(miss);
                }
            }
            Outcome::NeverEffective { admin, admin_from_send, last_miss } => {
                self.changes_ok += 1;
                self.never_effective += 1;
                self.admin.record(admin);
                self.admin_from_send.record(admin_from_send);
                self.errors.bump(format!("never_effective_{last_miss}"));
            }
        }
    }
}

/// `None` when `reply` is a 200 from the expected backend (any backend if
/// none is expected), else a short label for what was seen instead.
fn miss_label(reply: &Result<Reply, Failure>, expect_backend: Option<&str>) -> Option<String> {
    match reply {
        Err(f) => Some(f.label().to_owned()),
        Ok(r) if r.status != StatusCode::OK => Some(r.status.as_u16().to_string()),
        Ok(r) => match expect_backend {
            Some(want) if r.backend.as_deref() != Some(want) => Some("wrong_backend".to_owned()),
            _ => None,
        },
    }
}

/// Route name of change `i`.
fn route_name(tag: &str, i: u64) -> String {
    if tag.is_empty() {
        format!("churn-{i}")
    } else {
        format!("churn-{tag}-{i}")
    }
}

/// Exact path of change `i`.
fn route_path(tag: &str, i: u64) -> String {
    if tag.is_empty() {
        format!("/churn/{i}")
    } else {
        format!("/churn/{tag}/{i}")
    }
}

/// The start time in milliseconds since the epoch, so that runs against the
/// same instance create new routes rather than replace live ones.
fn default_tag() -> String {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis().to_string()).unwrap_or_else(|_| "0".to_owned())
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    fn reply(status: u16, backend: Option<&str>) -> Result<Reply, Failure> {
        Ok(Reply {
            status: StatusCode::from_u16(status).unwrap(),
            backend: backend.map(str::to_owned),
            body: Bytes::new(),
        })
    }

    #[test]
    fn names_and_paths_carry_the_tag() {
        assert_eq!(route_name("", 7), "churn-7");
        assert_eq!(route_path("", 7), "/churn/7");
        assert_eq!(route_name("t1", 7), "churn-t1-7");
        assert_eq!(route_path("t1", 7), "/churn/t1/7");
        assert!(default_tag().chars().all(|c| c.is_ascii_digit()));
    }

    #[test]
    fn a_miss_is_anything_but_a_200_from_the_expected_backend() {
        assert_eq!(miss_label(&reply(200, None), None), None);
        assert_eq!(miss_label(&reply(200, Some("x")), Some("x")), None);
        assert_eq!(miss_label(&reply(200, Some("y")), Some("x")).as_deref(), Some("wrong_backend"));
        assert_eq!(miss_label(&reply(200, None), Some("x")).as_deref(), Some("wrong_backend"));
        assert_eq!(miss_label(&reply(404, None), None).as_deref(), Some("404"));
        assert_eq!(miss_label(&Err(Failure::Timeout), None).as_deref(), Some("timeout"));
    }

    #[test]
    fn retried_changes_are_counted_once_with_their_first_miss() {
        let mut agg = Aggregate::default();
        agg.add(Outcome::Effective {
            admin: Duration::from_micros(500),
            admin_from_send: Duration::from_micros(450),
            effective: Duration::from_micros(900),
            after_admin: Duration::from_micros(400),
            retries: 0,
            first_miss: None,
        });
        agg.add(Outcome::Effective {
            admin: Duration::from_micros(500),
            admin_from_send: Duration::from_micros(450),
            effective: Duration::from_millis(3),
            after_admin: Duration::from_millis(2),
            retries: 2,
            first_miss: Some("404".to_owned()),
        });
        agg.add(Outcome::AdminFailed("admin_status_503".to_owned()));
        agg.add(Outcome::NeverEffective {
            admin: Duration::from_micros(500),
            admin_from_send: Duration::from_micros(450),
            last_miss: "404".to_owned(),
        });
        assert_eq!(agg.changes_ok, 3);
        assert_eq!(agg.effective, 2);
        assert_eq!(agg.needed_retry, 1);
        assert_eq!(agg.retries_total, 2);
        assert_eq!(agg.never_effective, 1);
        assert_eq!(agg.errors.total(), 2);
        assert_eq!(agg.admin.count(), 3);
        assert_eq!(agg.effective_lat.count(), 2);
    }
}
