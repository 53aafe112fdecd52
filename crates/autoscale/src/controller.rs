//! The IO loop around [`decide`](crate::decide::decide): one task per
//! autoscaled service, ticking every second.
//!
//! Each tick: notice instances that died; sample the service's live
//! statistics; decide; then act on the difference between the desired and
//! the current count: restore a draining instance or start new ones (they
//! become backends, `autoscaled: true`, only once their readiness probe
//! passes), or drain one instance (weight 0: no new requests) and remove it
//! when its requests are done or the drain timeout passes. Configuration
//! changes go through the writer like any other change set.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use tidegate_balance::clock;
use tidegate_control::Control;
use tidegate_control::SubmitError;
use tidegate_model::{
    ActiveCheck, AutoscaleSpec, BackendAddr, BackendId, BackendSpec, ChangeSet, CheckKind, NameError, Op, ProviderSpec,
    ServiceName, Weight,
};
use tidegate_snapshot::ServiceRuntime;
use tokio::task::JoinHandle;

use crate::decide::{decide, Counts, Decision, History, Params, Reason, Sample};
use crate::{provider_for, Coalescer, EventKind, Events, Instance, Provider, ProviderError, StartRequest};

/// One instance's phase as the autoscaler tracks it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Started, readiness probe not passed yet; no traffic.
    Starting,
    /// A backend taking traffic.
    Ready,
    /// Weight 0: finishing its requests before it is stopped.
    Draining,
}

/// What `/v1/status` shows of a service's scaling.
#[derive(Debug, Clone, Default, Serialize, schemars::JsonSchema)]
pub struct ScalingStatus {
    /// The count the autoscaler works toward.
    pub desired: u32,
    /// Instances by phase.
    pub counts: Counts,
    /// In panic mode (no scale-in).
    pub panic: bool,
    /// Operator overrides.
    pub paused: bool,
    /// Operator overrides.
    pub pinned: Option<u32>,
    /// The latest decision.
    pub last_decision: Option<Decision>,
    /// The instances the autoscaler owns, by id: address and phase.
    pub instances: BTreeMap<String, (String, Phase)>,
}

/// Shared view of every autoscaled service's status.
pub type StatusBoard = Arc<Mutex<BTreeMap<String, ScalingStatus>>>;

struct Tracked {
    instance: Instance,
    phase: Phase,
    /// When the phase began (ms on [`clock`]).
    since_ms: u64,
    /// The start-and-probe task, while starting: the ready instance, or why not.
    starting: Option<JoinHandle<Result<Instance, StartError>>>,
}

/// Why a new instance did not become a backend.
#[derive(Debug, thiserror::Error)]
enum StartError {
    /// The provider did not start it.
    #[error("start failed: {0}")]
    Provider(#[from] ProviderError),
    /// It gave an address that is not one.
    #[error("{0}")]
    Address(#[from] NameError),
    /// It did not pass its readiness probe in time (it was stopped).
    #[error("not ready after {timeout_s} s: {last}")]
    NotReady {
        /// The time allowed, s.
        timeout_s: u64,
        /// What the last probe said.
        last: String,
    },
    /// The configuration refused it as a backend (it was stopped).
    #[error(transparent)]
    Refused(#[from] SubmitError),
    /// The start task ended without an answer (it panicked or was cancelled).
    #[error(transparent)]
    Task(#[from] tokio::task::JoinError),
}

struct Scaler {
    name: ServiceName,
    control: Control,
    events: Arc<Events>,
    provider: Arc<dyn Provider>,
    provider_spec: ProviderSpec,
    instances: BTreeMap<String, Tracked>,
    history: History,
    /// Start failures in a row, and no new start before this time.
    failures: u32,
    retry_at_ms: u64,
    /// Scale-out decisions repeated while starts back off: counted, not
    /// recorded every second.
    scale_outs: Coalescer,
    board: StatusBoard,
    /// In-flight readings taken every [`SAMPLE`] since the last decision
    /// (sum, count): a decision uses their mean, not one instant's value.
    in_flight_acc: (f64, u32),
}

/// Time between decisions.
const TICK: Duration = Duration::from_secs(1);
/// Time between in-flight readings, averaged into each decision's sample.
const SAMPLE: Duration = Duration::from_millis(100);

/// The cluster-wide role of scaling one service.
fn role(service: &ServiceName) -> String {
    format!("autoscale/{service}")
}

/// Runs the autoscaler until aborted: a supervisor that keeps one scaler
/// task per service with an `autoscale` block.
///
/// In cluster mode only the instance that leads a service's role (an etcd
/// lease) runs its scaler; when it loses the role its scaler is stopped
/// without touching the instances, and the new leader adopts them.
pub fn spawn(control: Control, events: Arc<Events>, state_dir: PathBuf, board: StatusBoard) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut scalers: BTreeMap<ServiceName, (ProviderSpec, JoinHandle<()>)> = BTreeMap::new();
        let mut campaigns = tidegate_control::Campaigns::new(role);
        let mut tick = tokio::time::interval(TICK);
        loop {
            tick.tick().await;
            let config = control.config();
            let wanted: BTreeMap<ServiceName, ProviderSpec> = config
                .state
                .services()
                .iter()
                .filter_map(|(n, s)| s.settings.autoscale.as_ref().map(|a| (n.clone(), a.provider.clone())))
                .collect();
            campaigns.follow(&control, wanted.keys());
            // A scaler whose service or provider changed ends by itself;
            // forget finished ones so they can be started afresh. One whose
            // instance no longer leads is stopped here.
            scalers.retain(|name, (spec, task)| {
                if !control.leads(&role(name)) {
                    task.abort();
                    events.record(
                        name.as_str(),
                        EventKind::Follower,
                        None,
                        "another instance leads this service's scaling".into(),
                        None,
                    );
                    return false;
                }
                !task.is_finished() && wanted.get(name) == Some(spec)
            });
            for (name, spec) in wanted {
                if scalers.contains_key(&name) || !control.leads(&role(&name)) {
                    continue;
                }
                if campaigns.contains(&name) && control.store_status().kind != "embedded" {
                    events.record(
                        name.as_str(),
                        EventKind::Leader,
                        None,
                        "this instance leads the service's scaling".into(),
                        None,
                    );
                }
                let provider = provider_for(&spec, name.as_str(), &state_dir);
                let scaler = Scaler {
                    name: name.clone(),
                    control: control.clone(),
                    events: events.clone(),
                    provider,
                    provider_spec: spec.clone(),
                    instances: BTreeMap::new(),
                    history: History::default(),
                    failures: 0,
                    retry_at_ms: 0,
                    scale_outs: Coalescer::default(),
                    board: board.clone(),
                    in_flight_acc: (0.0, 0),
                };
                scalers.insert(name, (spec, tokio::spawn(scaler.run())));
            }
            if let Ok(mut b) = board.lock() {
                b.retain(|name, _| scalers.keys().any(|n| n.as_str() == name));
            }
        }
    })
}

impl Scaler {
    async fn run(mut self) {
        self.adopt().await;
        let mut tick = tokio::time::interval(SAMPLE);
        let per_decision = (TICK.as_millis() / SAMPLE.as_millis()) as u32;
        let mut n = 0u32;
        loop {
            tick.tick().await;
            let Some(spec) = self.spec() else {
                self.shutdown().await;
                return;
            };
            if let Some(rt) = self.runtime() {
                let (sample, _) = self.observe(&rt);
                self.in_flight_acc.0 += sample.in_flight;
                self.in_flight_acc.1 += 1;
            }
            n += 1;
            if n.is_multiple_of(per_decision) {
                self.tick(&spec).await;
            }
        }
    }

    /// The current autoscale block, if the service still has this provider.
    fn spec(&self) -> Option<AutoscaleSpec> {
        let config = self.control.config();
        let a = config.state.service(self.name.as_str())?.settings.autoscale.clone()?;
        (a.provider == self.provider_spec).then_some(a)
    }

    fn runtime(&self) -> Option<Arc<ServiceRuntime>> {
        self.control.snapshots().load().service(self.name.as_str()).cloned()
    }

    async fn tick(&mut self, spec: &AutoscaleSpec) {
        self.reap_starting().await;
        self.notice_deaths().await;
        self.finish_drains(spec).await;
        let Some(rt) = self.runtime() else { return };
        let (mut sample, counts) = self.observe(&rt);
        let (sum, readings) = std::mem::take(&mut self.in_flight_acc);
        if readings > 0 {
            sample.in_flight = sum / f64::from(readings);
        }
        let p = Params::from(spec);
        let d = decide(&p, &mut self.history, sample, counts);
        let current = counts.current();
        if d.desired > current {
            self.scale_out(spec, d, d.desired - current).await;
        } else {
            if let Some((detail, n)) = self.scale_outs.settle() {
                self.repeated_scale_out(detail, n);
            }
            if d.desired < current && d.reason != Reason::Paused {
                self.scale_in(d, &rt).await;
            }
        }
        self.publish(spec, d);
    }

    /// Ready = serving primaries (static ones included); their requests in
    /// flight and mean latency are the signals.
    fn observe(&self, rt: &ServiceRuntime) -> (Sample, Counts) {
        let now = clock::now_ms();
        let serving: Vec<_> = rt.selector.primaries().filter(|b| b.weight > 0 && b.stats.is_available(now)).collect();
        // In cluster mode, the other instances' requests to the service too.
        let in_flight: f64 = serving.iter().map(|b| b.stats.in_flight() as f64).sum::<f64>()
            + self.control.peers_in_flight(self.name.as_str());
        let latencies: Vec<f64> =
            serving.iter().filter_map(|b| b.stats.latency_ewma()).map(|d| d.as_secs_f64() * 1e3).collect();
        let latency_ms = (!latencies.is_empty()).then(|| latencies.iter().sum::<f64>() / latencies.len() as f64);
        let count = |phase| self.instances.values().filter(|t| t.phase == phase).count() as u32;
        let counts =
            Counts { ready: serving.len() as u32, starting: count(Phase::Starting), draining: count(Phase::Draining) };
        (Sample { at_ms: now, in_flight, latency_ms }, counts)
    }

    async fn scale_out(&mut self, spec: &AutoscaleSpec, d: Decision, mut k: u32) {
        let now = clock::now_ms();
        let backing_off = now < self.retry_at_ms;
        let detail = format!("{} -> {}", d.desired - k, d.desired);
        let noted = self.scale_outs.note(&detail, backing_off);
        if let Some((earlier, n)) = noted.summary {
            self.repeated_scale_out(earlier, n);
        }
        if let Some(repeats) = noted.record {
            let detail = if backing_off {
                format!(
                    "{detail}; starts back off after failures for {} s more (the same decision meanwhile is counted, \
                     not repeated)",
                    (self.retry_at_ms - now).div_ceil(1_000)
                )
            } else if repeats > 0 {
                format!("{detail} (taken {repeats} more times during the start back-off)")
            } else {
                detail
            };
            self.events.record_repeated(self.name.as_str(), EventKind::ScaleOut, None, detail, Some(d), repeats);
        }
        // Load came back during a drain: that instance serves again first.
        let draining: Vec<String> =
            self.instances.iter().filter(|(_, t)| t.phase == Phase::Draining).map(|(id, _)| id.clone()).collect();
        for id in draining.into_iter().take(k as usize) {
            if self.put_backend(&id, 1).await {
                if let Some(t) = self.instances.get_mut(&id) {
                    t.phase = Phase::Ready;
                }
                self.event(EventKind::Restored, Some(&id), "load returned during the drain".into(), None);
                k -= 1;
            }
        }
        if clock::now_ms() < self.retry_at_ms {
            return; // backing off after failed starts
        }
        for _ in 0..k {
            self.start_one(spec);
        }
    }

    fn start_one(&mut self, spec: &AutoscaleSpec) {
        let id = format!("{}-{:06x}", self.name, fastrand::u32(..0x100_0000));
        let provider = self.provider.clone();
        let control = self.control.clone();
        let events = self.events.clone();
        let (service, ready) = (self.name.clone(), spec.ready.clone());
        // Readiness probes reach the instance as requests will.
        let upstream = self.runtime().map(|r| r.upstream.clone()).unwrap_or_default();
        let req = StartRequest { service: service.to_string(), id: id.clone() };
        let placeholder = Instance { id: id.clone(), addr: String::new(), handle: None };
        let task_id = id.clone();
        let task = tokio::spawn(async move {
            let instance = match provider.start(req).await {
                Ok(instance) => instance,
                Err(e) => {
                    if e.may_have_started() {
                        // It may run although the start failed: stop that
                        // id, so nothing runs unknown to the autoscaler.
                        let unknown = Instance { id: task_id.clone(), addr: String::new(), handle: None };
                        if let Err(stop) = provider.stop(&unknown).await {
                            tracing::warn!(service = %service, id = %task_id, error = %stop, "cleanup after a failed start failed");
                        }
                    }
                    return Err(e.into());
                }
            };
            events.record(service.as_str(), EventKind::Started, Some(&task_id), format!("at {}", instance.addr), None);
            let outcome = wait_ready(&instance, &ready, &upstream).await;
            match outcome {
                Ok(()) => {
                    let added = match backend_op(&service, &instance, 1) {
                        Ok(op) => control
                            .submit(ChangeSet { if_revision: None, ops: vec![op] })
                            .await
                            .map(|_| ())
                            .map_err(StartError::from),
                        Err(e) => Err(StartError::from(e)),
                    };
                    if let Err(e) = added {
                        let _ = provider.stop(&instance).await;
                        return Err(e);
                    }
                    let detail = format!("serving at {}", instance.addr);
                    events.record(service.as_str(), EventKind::Ready, Some(&task_id), detail, None);
                    Ok(instance)
                }
                Err(e) => {
                    let _ = provider.stop(&instance).await;
                    Err(e)
                }
            }
        });
        self.instances.insert(
            id,
            Tracked { instance: placeholder, phase: Phase::Starting, since_ms: clock::now_ms(), starting: Some(task) },
        );
    }

    /// Collects finished start tasks: ready instances, or failures (backoff).
    async fn reap_starting(&mut self) {
        let done: Vec<String> = self
            .instances
            .iter()
            .filter(|(_, t)| t.starting.as_ref().is_some_and(JoinHandle::is_finished))
            .map(|(id, _)| id.clone())
            .collect();
        for id in done {
            let Some(mut t) = self.instances.remove(&id) else { continue };
            let result = match t.starting.take() {
                Some(task) => task.await.unwrap_or_else(|e| Err(e.into())),
                None => continue,
            };
            match result {
                Ok(instance) => {
                    t.instance = instance;
                    t.phase = Phase::Ready;
                    t.since_ms = clock::now_ms();
                    self.failures = 0;
                    self.instances.insert(id, t);
                }
                Err(e) => {
                    self.failures += 1;
                    let backoff = 1_000u64 << self.failures.min(6);
                    self.retry_at_ms = clock::now_ms() + backoff;
                    self.event(
                        EventKind::StartFailed,
                        Some(&id),
                        format!("{e}; next try in {} s", backoff / 1_000),
                        None,
                    );
                }
            }
        }
    }

    /// Instances that exited are removed from the configuration at once.
    async fn notice_deaths(&mut self) {
        let mut dead = Vec::new();
        for (id, t) in &self.instances {
            if t.phase != Phase::Starting && self.provider.alive(&t.instance).await == Some(false) {
                dead.push(id.clone());
            }
        }
        for id in dead {
            let Some(t) = self.instances.remove(&id) else { continue };
            self.delete_backend(&id).await;
            // Clean up what is left of it (its process group, its record).
            let provider = self.provider.clone();
            tokio::spawn(async move { provider.stop(&t.instance).await });
            self.event(EventKind::Died, Some(&id), "the instance exited; it will be replaced if needed".into(), None);
        }
    }

    /// Picks the ready autoscaled instance with the fewest requests in
    /// flight and drains it.
    async fn scale_in(&mut self, d: Decision, rt: &ServiceRuntime) {
        if self.instances.values().any(|t| t.phase == Phase::Draining) {
            return; // one at a time
        }
        let in_flight =
            |id: &str| rt.selector.backends().iter().find(|b| b.id.as_str() == id).map_or(0, |b| b.stats.in_flight());
        let victim = self
            .instances
            .iter()
            .filter(|(_, t)| t.phase == Phase::Ready)
            .min_by_key(|(id, _)| in_flight(id))
            .map(|(id, _)| id.clone());
        let Some(id) = victim else { return };
        self.event(EventKind::ScaleIn, Some(&id), format!("{} -> {}", d.desired + 1, d.desired), Some(d));
        if self.put_backend(&id, 0).await {
            if let Some(t) = self.instances.get_mut(&id) {
                t.phase = Phase::Draining;
                t.since_ms = clock::now_ms();
            }
            self.event(EventKind::Draining, Some(&id), "no new requests; waiting for in-flight ones".into(), None);
        }
    }

    /// Stops drained instances: no request in flight, or the timeout passed.
    async fn finish_drains(&mut self, spec: &AutoscaleSpec) {
        let Some(rt) = self.runtime() else { return };
        let now = clock::now_ms();
        let finished: Vec<String> = self
            .instances
            .iter()
            .filter(|(_, t)| t.phase == Phase::Draining)
            .filter(|(id, t)| {
                let idle = rt
                    .selector
                    .backends()
                    .iter()
                    .find(|b| b.id.as_str() == id.as_str())
                    .is_none_or(|b| b.stats.in_flight() == 0);
                // Give the weight change a moment to reach every request path.
                (idle && now - t.since_ms >= 500) || now - t.since_ms >= spec.drain_timeout_s * 1_000
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in finished {
            let Some(t) = self.instances.remove(&id) else { continue };
            self.delete_backend(&id).await;
            // Stopping may take the provider's grace period: not on the tick.
            let (provider, events, service) = (self.provider.clone(), self.events.clone(), self.name.clone());
            let drained_ms = now - t.since_ms;
            tokio::spawn(async move {
                let detail = match provider.stop(&t.instance).await {
                    Ok(()) => format!("drained in {drained_ms} ms and stopped"),
                    Err(e) => format!("drained; stopping failed: {e}"),
                };
                events.record(service.as_str(), EventKind::Stopped, Some(&id), detail, None);
            });
        }
    }

    /// Takes over instances from before a restart: those the provider
    /// lists and the configuration knows become ready again; strays are
    /// stopped; autoscaled backends without an instance are removed.
    async fn adopt(&mut self) {
        let listed = self.provider.list().await.unwrap_or_default();
        let config = self.control.config();
        let owned: BTreeMap<String, BackendSpec> = config
            .state
            .service(self.name.as_str())
            .map(|s| {
                s.backends.iter().filter(|(_, b)| b.autoscaled).map(|(id, b)| (id.to_string(), b.clone())).collect()
            })
            .unwrap_or_default();
        for inst in listed {
            if owned.contains_key(&inst.id) {
                let phase = if owned[&inst.id].weight.get() == 0 { Phase::Draining } else { Phase::Ready };
                self.event(EventKind::Adopted, Some(&inst.id), format!("running at {}", inst.addr), None);
                let id = inst.id.clone();
                self.instances.insert(id, Tracked { instance: inst, phase, since_ms: clock::now_ms(), starting: None });
            } else {
                let _ = self.provider.stop(&inst).await;
                self.event(EventKind::Stopped, Some(&inst.id), "left over from before a restart".into(), None);
            }
        }
        for (id, b) in owned {
            if !self.instances.contains_key(&id) {
                if matches!(self.provider_spec, ProviderSpec::Process { .. }) {
                    self.delete_backend(&id).await;
                } else {
                    // Providers that cannot list: trust the configuration.
                    let inst = Instance { id: id.clone(), addr: b.addr.to_string(), handle: None };
                    self.instances.insert(
                        id,
                        Tracked { instance: inst, phase: Phase::Ready, since_ms: clock::now_ms(), starting: None },
                    );
                }
            }
        }
    }

    /// The autoscale block is gone: stop everything this scaler owns.
    async fn shutdown(&mut self) {
        for (id, mut t) in std::mem::take(&mut self.instances) {
            if let Some(task) = t.starting.take() {
                task.abort();
                if let Ok(list) = self.provider.list().await {
                    if let Some(i) = list.into_iter().find(|i| i.id == id) {
                        t.instance = i;
                    }
                }
            }
            self.delete_backend(&id).await;
            let _ = self.provider.stop(&t.instance).await;
            self.event(EventKind::Stopped, Some(&id), "autoscaling was turned off for the service".into(), None);
        }
    }

    async fn put_backend(&self, id: &str, weight: u32) -> bool {
        let Some(t) = self.instances.get(id) else { return false };
        let Ok(op) = backend_op(&self.name, &t.instance, weight) else { return false };
        self.submit(op).await
    }

    async fn delete_backend(&self, id: &str) {
        let Ok(id) = BackendId::new(id) else { return };
        if self.control.config().state.service(self.name.as_str()).is_some_and(|s| s.backends.contains_key(&id)) {
            self.submit(Op::DeleteBackend { service: self.name.clone(), id }).await;
        }
    }

    async fn submit(&self, op: Op) -> bool {
        match self.control.submit(ChangeSet { if_revision: None, ops: vec![op] }).await {
            Ok(_) => true,
            Err(e) => {
                tracing::warn!(service = %self.name, error = %e, "autoscaler change refused");
                false
            }
        }
    }

    /// A scale-out decision taken `n` times during a back-off without being
    /// recorded, and not taken since.
    fn repeated_scale_out(&self, detail: String, n: u64) {
        let detail = format!("{detail}: taken {n} more times during the start back-off");
        self.events.record_repeated(self.name.as_str(), EventKind::ScaleOut, None, detail, None, n);
    }

    fn event(&self, kind: EventKind, instance: Option<&str>, detail: String, d: Option<Decision>) {
        self.events.record(self.name.as_str(), kind, instance, detail, d);
    }

    fn publish(&self, spec: &AutoscaleSpec, d: Decision) {
        let status = ScalingStatus {
            desired: d.desired,
            counts: self.runtime().map(|rt| self.observe(&rt).1).unwrap_or_default(),
            panic: d.panic,
            paused: spec.paused,
            pinned: spec.pinned,
            last_decision: Some(d),
            instances: self.instances.iter().map(|(id, t)| (id.clone(), (t.instance.addr.clone(), t.phase))).collect(),
        };
        if let Ok(mut b) = self.board.lock() {
            b.insert(self.name.to_string(), status);
        }
    }
}

/// A put_backend op for an instance, marked as the autoscaler's; `Err`
/// when its id or address is not one a backend can have.
fn backend_op(service: &ServiceName, instance: &Instance, weight: u32) -> Result<Op, NameError> {
    Ok(Op::PutBackend {
        service: service.clone(),
        id: BackendId::new(&instance.id)?,
        spec: BackendSpec {
            addr: BackendAddr::new(&instance.addr)?,
            // 0 (draining) or 1: both are weights.
            weight: Weight::try_from(weight).unwrap_or_default(),
            backup: false,
            max_conns: None,
            autoscaled: true,
            dns: false,
        },
    })
}

/// Probes a new instance until it is ready (S1's probe request).
async fn wait_ready(
    instance: &Instance,
    ready: &tidegate_model::ReadySpec,
    upstream: &tidegate_upstream::Profile,
) -> Result<(), StartError> {
    let addr = BackendAddr::new(&instance.addr)?;
    let check = ActiveCheck {
        kind: CheckKind::Http,
        path: ready.path.clone(),
        expect_status: Vec::new(),
        interval_ms: ready.interval_ms,
        timeout_ms: ready.interval_ms.clamp(100, 2_000),
        rise: 1,
        fall: 1,
    };
    let client = tidegate_health::ProbeClient::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(ready.timeout_s);
    let mut last = String::from("no probe answered");
    while tokio::time::Instant::now() < deadline {
        let verdict = tidegate_health::probe(&client, &addr, upstream, &check).await;
        if verdict.passed {
            return Ok(());
        }
        last = verdict.detail;
        tokio::time::sleep(Duration::from_millis(ready.interval_ms)).await;
    }
    Err(StartError::NotReady { timeout_s: ready.timeout_s, last })
}
