//! Live status and Prometheus metrics.

use std::fmt::Write;
use std::sync::atomic::Ordering::Relaxed;

use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;
use axum::Json;
use serde_json::{json, Value};
use tidegate_balance::{clock, ActiveState};
use tidegate_snapshot::ServiceRuntime;

use crate::AdminState;

fn service_status(s: &ServiceRuntime) -> Value {
    let now = clock::now_ms();
    let dynamic = s.selector.weights();
    let mut primary_index = 0;
    let backends: Vec<Value> = s
        .selector
        .backends()
        .iter()
        .map(|b| {
            let v = b.stats.view();
            // Dynamic weights are reported for primaries, in id order.
            let effective = if b.backup {
                None
            } else {
                primary_index += 1;
                dynamic.as_ref().and_then(|w| w.get(primary_index - 1).copied())
            };
            let health = match v.active {
                _ if v.ejected_for_ms > 0 => "ejected",
                ActiveState::Down => "down",
                ActiveState::Up => "up",
                ActiveState::Unchecked => "unchecked",
            };
            let load = &b.stats.load;
            let num = |x: f64| (!x.is_nan()).then_some(x);
            json!({
                "id": b.id,
                "addr": b.addr,
                "weight": b.weight,
                "effective_weight": effective,
                "backup": b.backup,
                "health": health,
                "available": b.stats.is_available(now),
                "ejected_for_ms": v.ejected_for_ms,
                "ejections": v.ejections,
                "slow_start_factor": b.stats.slow_start_factor(now, s.settings.health.slow_start_ms),
                "in_flight": v.in_flight,
                "requests": v.requests,
                "failures": v.failures,
                "latency_ewma_ms": v.latency_ewma_ms,
                "concurrency_limit": v.learned_limit,
                "no_load_latency_ms": v.no_load_latency_ms,
                "load": {
                    "cpu": num(load.cpu.get()),
                    "memory": num(load.memory.get()),
                    "network": num(load.network.get()),
                    "qps": num(load.qps.get()),
                    "age_ms": (load.last_ms.load(Relaxed) > 0).then(|| now.saturating_sub(load.last_ms.load(Relaxed))),
                },
            })
        })
        .collect();
    json!({
        "policy": s.settings.policy,
        "in_flight": s.selector.backends().iter().map(|b| b.stats.in_flight()).sum::<u64>(),
        "queued": s.live.queue.len(),
        "learns_limits": s.settings.learns_limits(),
        "retries_in_flight": s.live.retries_in_flight.load(Relaxed),
        "retries_refused": s.live.retries_refused.load(Relaxed),
        "backends": backends,
    })
}

pub(crate) async fn get_status(State(state): State<AdminState>) -> Json<Value> {
    let snapshot = state.control.snapshots().load_full();
    let scaling = state.scaling.lock().map(|b| b.clone()).unwrap_or_default();
    let mut services: Vec<(&str, Value)> = snapshot.services().map(|s| (s.name.as_str(), service_status(s))).collect();
    services.sort_by(|a, b| a.0.cmp(b.0));
    let services: serde_json::Map<String, Value> = services
        .into_iter()
        .map(|(k, mut v)| {
            if let (Some(s), Some(obj)) = (scaling.get(k), v.as_object_mut()) {
                obj.insert("scaling".into(), serde_json::to_value(s).unwrap_or(Value::Null));
            }
            (k.to_string(), v)
        })
        .collect();
    let store = state.control.store_status();
    let applied = snapshot.revision();
    let lag = store.latest_revision.saturating_sub(applied);
    let instances: Vec<Value> = store
        .instances
        .iter()
        .map(|i| {
            json!({ "name": i.name, "admin": i.admin, "applied_revision": i.applied_revision,
                          "lag": store.latest_revision.saturating_sub(i.applied_revision) })
        })
        .collect();
    Json(json!({
        "revision": applied,
        "store": {
            "kind": store.kind, "location": store.location, "connected": store.connected,
            "latest_revision": store.latest_revision, "lag": lag, "last_error": store.last_error,
            "instances": instances,
        },
        "routes": snapshot.route_count(),
        "services": services,
        "certificates_expiring": expiring(&snapshot, tidegate_model::unix_now()),
    }))
}

/// Within this many seconds of its end, a certificate is listed in
/// `/v1/status` as expiring (14 days).
const EXPIRY_WARNING_S: i64 = 14 * 86_400;

/// Certificates that expire within [`EXPIRY_WARNING_S`] of `now` (or have
/// expired), soonest first.
fn expiring(snapshot: &tidegate_snapshot::Snapshot, now: i64) -> Vec<Value> {
    let mut soon: Vec<_> =
        snapshot.certificates().all().iter().filter(|(_, info)| info.not_after - now < EXPIRY_WARNING_S).collect();
    soon.sort_by_key(|(_, info)| info.not_after);
    soon.into_iter()
        .map(|(name, info)| {
            json!({ "name": name.as_str(), "names": info.names, "not_after": info.not_after,
                    "expired": info.not_after < now })
        })
        .collect()
}

pub(crate) async fn get_metrics(State(state): State<AdminState>) -> impl IntoResponse {
    let mut out = String::new();
    let m = state.control.metrics();
    let snapshot = state.control.snapshots().load_full();
    let store = state.control.store_status();
    for (name, help, v) in [
        ("tidegate_config_revision", "Revision of the live configuration.", snapshot.revision()),
        (
            "tidegate_store_connected",
            "1 while the configuration store answers (cluster mode: the etcd watch is live).",
            u64::from(store.connected),
        ),
        (
            "tidegate_store_lag_revisions",
            "Revisions the store holds that this instance has not applied yet.",
            store.latest_revision.saturating_sub(snapshot.revision()),
        ),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
    }
    for (name, help, v) in [
        ("tidegate_config_commits_total", "Durable configuration commits.", m.commits.load(Relaxed)),
        ("tidegate_config_change_sets_total", "Change sets applied.", m.change_sets.load(Relaxed)),
        ("tidegate_config_rejected_total", "Change sets rejected.", m.rejected.load(Relaxed)),
        ("tidegate_config_ops_total", "Operations applied.", m.ops.load(Relaxed)),
        (
            "tidegate_config_writer_panics_total",
            "Panics of the configuration writer it recovered from by reloading the store.",
            m.panics.load(Relaxed),
        ),
        (
            "tidegate_config_remote_change_sets_total",
            "Change sets applied that other instances committed (cluster mode).",
            m.remote_change_sets.load(Relaxed),
        ),
        (
            "tidegate_config_conflicts_total",
            "Commits refused because another instance committed first (each is retried after catching up).",
            m.conflicts.load(Relaxed),
        ),
        (
            "tidegate_config_reloads_total",
            "Whole reloads of the configuration from the store.",
            m.reloads.load(Relaxed),
        ),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
    }
    for (name, help, nanos) in [
        ("tidegate_config_commit_seconds_total", "Time spent in durable commits.", &m.commit_nanos),
        ("tidegate_config_apply_seconds_total", "Time from dequeue to publication.", &m.apply_nanos),
    ] {
        let secs = nanos.load(Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {secs}");
    }
    let certs = snapshot.certificates().all();
    if !certs.is_empty() {
        let name = "tidegate_certificate_not_after_seconds";
        let _ = writeln!(out, "# HELP {name} End of validity of each TLS certificate (Unix time).");
        let _ = writeln!(out, "# TYPE {name} gauge");
        for (cert, info) in certs {
            let _ = writeln!(out, "{name}{{name=\"{cert}\"}} {}", info.not_after);
        }
    }
    (state.extra_metrics)(&mut out);
    state.events.render(&mut out);
    render_backends(&mut out, &snapshot);
    ([(CONTENT_TYPE, "text/plain; version=0.0.4")], out)
}

/// Per-backend series, each metric's samples grouped under its HELP and TYPE.
fn render_backends(out: &mut String, snapshot: &tidegate_snapshot::Snapshot) {
    type Pick = fn(&tidegate_balance::StatsView) -> Option<f64>;
    let metrics: [(&str, &str, &str, Pick); 5] = [
        ("tidegate_backend_in_flight", "gauge", "Requests in flight per backend.", |v| Some(v.in_flight as f64)),
        ("tidegate_backend_requests_total", "counter", "Requests finished per backend.", |v| Some(v.requests as f64)),
        ("tidegate_backend_failures_total", "counter", "Failed requests per backend.", |v| Some(v.failures as f64)),
        (
            "tidegate_backend_concurrency_limit",
            "gauge",
            "Learned limit on requests in flight per backend (services that learn limits).",
            |v| v.learned_limit.map(|l| l as f64),
        ),
        (
            "tidegate_backend_no_load_latency_seconds",
            "gauge",
            "Learned no-load latency per backend (services that learn limits).",
            |v| v.no_load_latency_ms.map(|ms| ms / 1e3),
        ),
    ];
    let views: Vec<(String, tidegate_balance::StatsView)> = snapshot
        .services()
        .flat_map(|s| {
            s.selector.backends().iter().map(move |b| {
                let labels = format!("service=\"{}\",backend=\"{}\"", s.name, b.id);
                (labels, b.stats.view())
            })
        })
        .collect();
    for (name, kind, help, value) in metrics {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (labels, v) in &views {
            if let Some(x) = value(v) {
                let _ = writeln!(out, "{name}{{{labels}}} {x}");
            }
        }
    }
    let name = "tidegate_service_queued";
    let _ = writeln!(out, "# HELP {name} Requests waiting for a backend under its limit, per service.");
    let _ = writeln!(out, "# TYPE {name} gauge");
    for s in snapshot.services() {
        let _ = writeln!(out, "{name}{{service=\"{}\"}} {}", s.name, s.live.queue.len());
    }
}
