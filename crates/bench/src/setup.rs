//! `setup`: the service under test, its catch-all route, and an optional
//! preload of `pre-{i}` services and routes sent as large change sets.

use std::time::{Duration, Instant};

use anyhow::ensure;
use http::StatusCode;
use serde::Serialize;
use serde_json::{json, Value};

use crate::cli::{SetupArgs, Target};
use crate::client::{self, Http};
use crate::report::{self, Counts, Latency, Summary};

/// Highest number of backends per preloaded service (ports 10000..=65535).
const MAX_BACKENDS_PER_SERVICE: u64 = 55_536;

/// Highest number of preloaded services or routes.
const MAX_PRELOAD: u64 = 10_000_000;

/// The JSON printed by `setup`.
#[derive(Debug, Serialize)]
pub struct SetupReport {
    scenario: &'static str,
    service: String,
    backend: String,
    catch_all_route: Option<String>,
    revision: Option<u64>,
    preload: Option<PreloadReport>,
}

/// The preload part of the report.
#[derive(Debug, Serialize)]
pub struct PreloadReport {
    services: u64,
    backends_per_service: u64,
    routes: u64,
    ops: u64,
    ops_ok: u64,
    batches: u64,
    batch_ops: u64,
    elapsed_s: f64,
    ops_per_s: f64,
    batch_latency_us: Summary,
    last_revision: Option<u64>,
    errors: Counts,
    first_error: Option<String>,
}

/// Runs `setup`.
pub async fn run(target: &Target, args: &SetupArgs) -> anyhow::Result<SetupReport> {
    client::require_loopback("backend", args.backend)?;
    ensure!(
        args.preload_routes <= args.preload_services,
        "--preload-routes ({}) cannot exceed --preload-services ({}): route i points at pre-i",
        args.preload_routes,
        args.preload_services
    );
    ensure!(args.preload_services <= MAX_PRELOAD, "--preload-services is limited to {MAX_PRELOAD}");
    ensure!(
        args.preload_services == 0 || (1..=MAX_BACKENDS_PER_SERVICE).contains(&args.backends_per_service),
        "--backends-per-service must be within 1..={MAX_BACKENDS_PER_SERVICE}"
    );
    ensure!(args.batch_ops > 0, "--batch-ops must be positive");

    // Preload change sets can be large: give them a generous timeout.
    let timeout = Duration::from_millis(target.timeout_ms).max(Duration::from_secs(60));
    let admin = Http::new(target.admin, Some(client::token(target)?), timeout)?;

    let service_body = json!({ "backends": [{ "id": "a", "addr": args.backend.to_string() }] });
    let reply = admin.put_json(&format!("/v1/services/{}", args.service), &service_body).await;
    let mut revision = revision_of(&client::expect_ok("PUT service", reply)?.body);

    let catch_all_route = if args.no_catch_all {
        None
    } else {
        let name = format!("{}-all", args.service);
        let body = json!({ "match": { "path_prefix": "/" }, "service": args.service });
        let reply = admin.put_json(&format!("/v1/routes/{name}"), &body).await;
        revision = revision_of(&client::expect_ok("PUT catch-all route", reply)?.body);
        Some(name)
    };

    let preload = if args.preload_services > 0 { Some(preload(&admin, args).await) } else { None };
    if let Some(r) = preload.as_ref().and_then(|p| p.last_revision) {
        revision = Some(r);
    }

    Ok(SetupReport {
        scenario: "setup",
        service: args.service.clone(),
        backend: args.backend.to_string(),
        catch_all_route,
        revision,
        preload,
    })
}

/// Sends the preload in change sets of `batch_ops` operations, one after
/// the other (services first, so every route's service exists).
async fn preload(admin: &Http, args: &SetupArgs) -> PreloadReport {
    let total = args.preload_services + args.preload_routes;
    let mut latency = Latency::new();
    let mut errors = Counts::default();
    let mut first_error = None;
    let mut ops_ok = 0;
    let mut batches = 0;
    let mut last_revision = None;
    let start = Instant::now();
    let mut next = 0;
    while next < total {
        let end = (next + args.batch_ops).min(total);
        let ops: Vec<Value> =
            (next..end).map(|k| preload_op(k, args.preload_services, args.backends_per_service)).collect();
        let body = json!({ "ops": ops });
        let sent = Instant::now();
        let reply = admin.post_json("/v1/changes", &body).await;
        latency.record(sent.elapsed());
        batches += 1;
        match reply {
            Ok(r) if r.status == StatusCode::OK => {
                ops_ok += end - next;
                last_revision = revision_of(&r.body).or(last_revision);
            }
            Ok(r) => {
                errors.bump(format!("admin_status_{}", r.status.as_u16()));
                first_error.get_or_insert_with(|| {
                    format!(
                        "ops {next}..{end}: HTTP {}: {}",
                        r.status.as_u16(),
                        String::from_utf8_lossy(&r.body).trim()
                    )
                });
            }
            Err(f) => {
                errors.bump(format!("admin_{}", f.label()));
                first_error.get_or_insert_with(|| format!("ops {next}..{end}: {}", f.label()));
            }
        }
        next = end;
    }
    let elapsed = start.elapsed();
    PreloadReport {
        services: args.preload_services,
        backends_per_service: args.backends_per_service,
        routes: args.preload_routes,
        ops: total,
        ops_ok,
        batches,
        batch_ops: args.batch_ops,
        elapsed_s: report::seconds(elapsed),
        ops_per_s: report::per_second(ops_ok, elapsed),
        batch_latency_us: latency.summary(),
        last_revision,
        errors,
        first_error,
    }
}

/// Operation `k` of the preload: `put_service pre-k` for `k < services`,
/// then `put_route pre-(k - services)`.
fn preload_op(k: u64, services: u64, backends_per_service: u64) -> Value {
    if k < services {
        let backends: Vec<Value> = (0..backends_per_service)
            .map(|j| json!({ "id": format!("b{j}"), "addr": format!("127.0.0.2:{}", 10_000 + j) }))
            .collect();
        json!({ "op": "put_service", "name": format!("pre-{k}"), "spec": { "backends": backends } })
    } else {
        let i = k - services;
        json!({
            "op": "put_route",
            "name": format!("pre-{i}"),
            "spec": { "match": { "path_prefix": format!("/pre/{i}") }, "service": format!("pre-{i}") },
        })
    }
}

/// The `revision` field of an admin answer.
fn revision_of(body: &[u8]) -> Option<u64> {
    serde_json::from_slice::<Value>(body).ok()?.get("revision")?.as_u64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preload_puts_services_then_routes_to_them() {
        let op = preload_op(1, 3, 2);
        assert_eq!(op["op"], "put_service");
        assert_eq!(op["name"], "pre-1");
        assert_eq!(op["spec"]["backends"][1]["addr"], "127.0.0.2:10001");
        assert_eq!(op["spec"]["backends"][1]["id"], "b1");
        let op = preload_op(4, 3, 2);
        assert_eq!(op["op"], "put_route");
        assert_eq!(op["name"], "pre-1");
        assert_eq!(op["spec"]["match"]["path_prefix"], "/pre/1");
        assert_eq!(op["spec"]["service"], "pre-1");
    }

    #[test]
    fn revision_is_read_from_admin_answers() {
        assert_eq!(revision_of(br#"{"revision":42,"ops":3}"#), Some(42));
        assert_eq!(revision_of(b"not json"), None);
    }
}
