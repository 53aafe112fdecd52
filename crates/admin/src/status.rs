//! Live status: `/v1/status`.

use std::sync::atomic::Ordering::Relaxed;

use axum::extract::State;
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
