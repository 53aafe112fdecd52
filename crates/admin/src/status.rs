//! Live status: `/v1/status`.

use std::sync::atomic::Ordering::Relaxed;

use axum::extract::State;
use tidegate_balance::{clock, ActiveState};
use tidegate_snapshot::ServiceRuntime;

use crate::api::{
    BackendState, Expiring, InstanceState, LoadState, ManagedState, RuleStepState, ServiceState, Sorted, Status,
    StoreFaultState, StoreState,
};
use crate::AdminState;

/// The dynamic weight in effect for each backend of `s`, in the order of
/// its backends: `None` for backups and for policies without dynamic
/// weights (the selector reports them for primaries, in id order).
pub(crate) fn effective_weights(s: &ServiceRuntime) -> Vec<Option<f64>> {
    let dynamic = s.selector.weights();
    let mut primaries = dynamic.iter().flatten().copied();
    s.selector.backends().iter().map(|b| if b.backup { None } else { primaries.next() }).collect()
}

fn service_status(s: &ServiceRuntime) -> ServiceState {
    let now = clock::now_ms();
    let backends = s
        .selector
        .backends()
        .iter()
        .zip(effective_weights(s))
        .map(|(b, effective)| {
            let v = b.stats.view();
            let health = match v.active {
                _ if v.ejected_for_ms > 0 => "ejected",
                ActiveState::Down => "down",
                ActiveState::Up => "up",
                ActiveState::Unchecked => "unchecked",
            };
            let load = &b.stats.load;
            let num = |x: f64| (!x.is_nan()).then_some(x);
            let last = load.last_ms.load(Relaxed);
            BackendState {
                id: b.id.as_str().to_string(),
                addr: b.addr.to_string(),
                weight: b.weight,
                effective_weight: effective,
                backup: b.backup,
                dns: false,
                health: health.to_string(),
                available: b.stats.is_available(now),
                ejected_for_ms: v.ejected_for_ms,
                ejections: v.ejections,
                slow_start_factor: b.stats.slow_start_factor(now, s.settings.health.slow_start_ms),
                in_flight: v.in_flight,
                requests: v.requests,
                failures: v.failures,
                latency_ewma_ms: v.latency_ewma_ms,
                concurrency_limit: v.learned_limit,
                no_load_latency_ms: v.no_load_latency_ms,
                load: LoadState {
                    cpu: num(load.cpu.get()),
                    memory: num(load.memory.get()),
                    network: num(load.network.get()),
                    qps: num(load.qps.get()),
                    age_ms: (last > 0).then(|| now.saturating_sub(last)),
                },
            }
        })
        .collect();
    ServiceState {
        policy: s.settings.policy.clone(),
        in_flight: s.selector.backends().iter().map(|b| b.stats.in_flight()).sum::<u64>(),
        queued: s.live.queue.len() as u64,
        queued_clients: s.live.queue.clients() as u64,
        queue_displaced: s.live.queue.displaced(),
        learns_limits: s.settings.learns_limits(),
        retries_in_flight: s.live.retries_in_flight.load(Relaxed),
        retries_refused: s.live.retries_refused.load(Relaxed),
        backends,
        scaling: None,
        dns: None,
    }
}

pub(crate) async fn get_status(State(state): State<AdminState>) -> Sorted<Status> {
    let snapshot = state.control.snapshots().load_full();
    let mut scaling = state.scaling.lock().map(|b| b.clone()).unwrap_or_default();
    let mut dns = state.dns.lock().map(|b| b.clone()).unwrap_or_default();
    let config = state.control.config();
    let services = snapshot
        .services()
        .map(|s| {
            let mut v = service_status(s);
            v.scaling = scaling.remove(s.name.as_str());
            v.dns = dns.remove(s.name.as_str());
            if let Some(spec) = config.state.services().get(&s.name) {
                for b in &mut v.backends {
                    b.dns = tidegate_model::BackendId::new(&b.id)
                        .ok()
                        .and_then(|id| spec.backends.get(&id).map(|spec| spec.dns))
                        .unwrap_or(false);
                }
            }
            (s.name.as_str().to_string(), v)
        })
        .collect();
    let store = state.control.store_status();
    let applied = snapshot.revision();
    let instances = store
        .instances
        .iter()
        .map(|i| InstanceState {
            name: i.name.clone(),
            admin: i.admin.clone(),
            applied_revision: i.applied_revision,
            lag: store.latest_revision.saturating_sub(i.applied_revision),
        })
        .collect();
    Sorted(Status {
        revision: applied,
        store: StoreState {
            kind: store.kind.to_string(),
            location: store.location.clone(),
            connected: store.connected,
            latest_revision: store.latest_revision,
            lag: store.latest_revision.saturating_sub(applied),
            last_error: store.last_error.clone(),
            instances,
            faults: store
                .faults
                .iter()
                .map(|f| StoreFaultState {
                    key: f.key.clone(),
                    kind: f.kind.code().into(),
                    message: f.kind.to_string(),
                })
                .collect(),
        },
        routes: snapshot.route_count(),
        services,
        certificates_expiring: expiring(&snapshot, tidegate_model::unix_now()),
        managed_certificates: managed(&state.control.config().state),
        rules: rule_steps(&snapshot),
        config_file: state.config_file.as_ref().map(|f| f.state()),
        predecessor: state.predecessor.as_ref().and_then(|p| p.state()),
        listeners: state.listeners.read().into_iter().map(|(k, v)| (k, v.into())).collect(),
        quic_connections_open: state.quic_open.as_ref().map(|open| open()),
    })
}

/// Each route's rule steps and what they did.
fn rule_steps(snapshot: &tidegate_snapshot::Snapshot) -> std::collections::BTreeMap<String, Vec<RuleStepState>> {
    snapshot
        .routes()
        .filter_map(|route| {
            let chain = route.attached.as_ref()?;
            let steps = chain
                .counts()
                .map(|c| RuleStepState {
                    rule_set: c.rule.set.as_str().to_string(),
                    step: c.rule.step,
                    kind: c.rule.kind.to_string(),
                    answered: c.answered,
                    changed: c.changed,
                })
                .collect();
            Some((route.name.as_str().to_string(), steps))
        })
        .collect()
}

/// Every managed certificate and where it stands.
fn managed(config: &tidegate_model::ConfigState) -> std::collections::BTreeMap<String, ManagedState> {
    let positive = |t: i64| (t > 0).then_some(t);
    config
        .certificates()
        .iter()
        .filter_map(|(name, spec)| {
            let m = spec.managed()?;
            let info = spec.info();
            Some((
                name.as_str().to_string(),
                ManagedState {
                    hosts: m.acme.hosts().to_vec(),
                    status: m.status(),
                    issuer: info.map(|i| i.issuer.clone()),
                    not_after: info.map(|i| i.not_after),
                    renew_at: positive(m.state.renewal_due_at()),
                    orders: m.state.orders,
                    last_error: m.state.last_error.clone().filter(|_| m.state.failures > 0),
                },
            ))
        })
        .collect()
}

/// Within this many seconds of its end, a certificate is listed in
/// `/v1/status` as expiring (14 days).
const EXPIRY_WARNING_S: i64 = 14 * 86_400;

/// Certificates that expire within [`EXPIRY_WARNING_S`] of `now` (or have
/// expired), soonest first.
fn expiring(snapshot: &tidegate_snapshot::Snapshot, now: i64) -> Vec<Expiring> {
    let mut soon: Vec<_> =
        snapshot.certificates().all().iter().filter(|(_, info)| info.not_after - now < EXPIRY_WARNING_S).collect();
    soon.sort_by_key(|(_, info)| info.not_after);
    soon.into_iter()
        .map(|(name, info)| Expiring {
            name: name.as_str().to_string(),
            names: info.names.clone(),
            not_after: info.not_after,
            expired: info.not_after < now,
        })
        .collect()
}
