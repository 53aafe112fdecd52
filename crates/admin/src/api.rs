//! The admin API's answers, as types: the handlers build them, and the
//! OpenAPI document takes its schemas from them ([`crate::openapi`]), so
//! the two cannot drift apart.

use std::borrow::Cow;
use std::collections::BTreeMap;

use axum::response::{IntoResponse, Response};
use axum::Json;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use tidegate_autoscale::{Event, ScalingStatus};
use tidegate_model::{
    AcmeStatus, BackendSpec, CertificateInfo, CertificateSpec, Change, ListenerSpec, Managed, RouteSpec, RuleSetSpec,
    ServiceSpec,
};

/// An answer as JSON with its keys in alphabetical order at every level
/// (as the examples in docs/api.md show them), whatever the order of the
/// type's fields.
pub struct Sorted<T>(pub T);

impl<T: Serialize> IntoResponse for Sorted<T> {
    fn into_response(self) -> Response {
        match serde_json::to_value(&self.0) {
            Ok(v) => Json(v).into_response(),
            Err(e) => crate::ApiError::internal(e.to_string()).into_response(),
        }
    }
}

/// A write's answer: the revision at which it is durable and live.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct Written {
    /// The configuration's revision once the write is durable and live.
    pub revision: u64,
}

/// `POST /v1/changes`'s answer.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct ChangesApplied {
    /// With `dry_run`: `true`, and nothing was applied.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dry_run: bool,
    /// The new revision (with `dry_run`: the current one, unchanged).
    pub revision: u64,
    /// Operations in the change set.
    pub ops: usize,
}

/// `PUT /v1/config`'s answer: what changed (or, with `dry_run`, would).
#[derive(Debug, Serialize, JsonSchema)]
pub struct ConfigApplied {
    /// With `dry_run`, or when nothing had to change: nothing was applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dry_run: Option<bool>,
    /// The new revision (unchanged when nothing was applied).
    pub revision: u64,
    /// The objects created, replaced and deleted.
    pub changes: Vec<Change>,
}

/// One service, read back (secrets replaced by `<redacted>`).
#[derive(Debug, Serialize, JsonSchema)]
pub struct ServiceRead<'a> {
    /// The revision read.
    pub revision: u64,
    /// The service.
    pub spec: Cow<'a, ServiceSpec>,
}

/// Every service, by name.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ServicesRead<'a> {
    /// The revision read.
    pub revision: u64,
    /// Services by name (secrets replaced by `<redacted>`).
    pub services: BTreeMap<&'a str, Cow<'a, ServiceSpec>>,
}

/// One backend, read back.
#[derive(Debug, Serialize, JsonSchema)]
pub struct BackendRead<'a> {
    /// The revision read.
    pub revision: u64,
    /// The backend.
    pub spec: &'a BackendSpec,
}

/// One route, read back.
#[derive(Debug, Serialize, JsonSchema)]
pub struct RouteRead<'a> {
    /// The revision read.
    pub revision: u64,
    /// The route.
    pub spec: &'a RouteSpec,
}

/// Every route, by name.
#[derive(Debug, Serialize, JsonSchema)]
pub struct RoutesRead<'a> {
    /// The revision read.
    pub revision: u64,
    /// Routes by name.
    pub routes: BTreeMap<&'a str, &'a RouteSpec>,
}

/// One rule set, read back (password hashes as `(redacted)`).
#[derive(Debug, Serialize, JsonSchema)]
pub struct RuleSetRead<'a> {
    /// The revision read.
    pub revision: u64,
    /// The rule set.
    pub spec: Cow<'a, RuleSetSpec>,
    /// The routes that run it.
    pub used_by: Vec<&'a str>,
}

/// Every rule set, by name (password hashes as `(redacted)`).
#[derive(Debug, Serialize, JsonSchema)]
pub struct RuleSetsRead<'a> {
    /// The revision read.
    pub revision: u64,
    /// Rule sets by name.
    pub rules: BTreeMap<&'a str, Cow<'a, RuleSetSpec>>,
}

/// A certificate as the read APIs show it: never its key.
#[derive(Debug, Serialize, JsonSchema)]
pub struct CertificateView<'a> {
    /// What the certificate served says (names, subject, issuer,
    /// validity); absent while a managed certificate has none yet.
    #[serde(flatten)]
    pub info: Option<&'a CertificateInfo>,
    /// Served to clients with no (or an unknown) SNI name.
    pub default: bool,
    /// What its handshakes ask of clients' certificates (the CA bundle
    /// and the mode), when it asks for them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_auth: Option<&'a tidegate_model::ClientAuth>,
    /// A managed certificate's ACME settings and where it stands.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub acme: Option<AcmeView<'a>>,
}

/// A managed certificate as the read APIs show it: never the account's
/// or the certificate's key.
#[derive(Debug, Serialize, JsonSchema)]
pub struct AcmeView<'a> {
    /// The names it is for.
    pub hosts: &'a [String],
    /// The CA's directory URL.
    pub directory: &'a str,
    /// `http-01`, `tls-alpn-01` or `dns-01`.
    pub challenge: &'static str,
    /// `pending`, `ordering`, `valid`, `renewing`, `failing`, or
    /// `on_demand` for a template.
    pub status: AcmeStatus,
    /// When the next renewal is due (Unix seconds), once one is issued:
    /// after `renew_after` of the lifetime, or earlier when the CA's
    /// renewal information says so.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub renew_at: Option<i64>,
    /// What the CA's renewal information (ARI, RFC 9773) said of the
    /// certificate served: `not_offered`, its suggested `window` (`start`,
    /// `end`, the `renew_at` picked in it, `next_check`), or `unanswered`
    /// (`next_check`); absent until asked.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub renewal_info: Option<tidegate_model::RenewalInfo>,
    /// When the certificate served was issued (Unix seconds).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub issued_at: Option<i64>,
    /// Orders placed with the CA.
    pub orders: u64,
    /// Failed orders in a row.
    pub failures: u32,
    /// Why the last order failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<&'a str>,
    /// No new order before this time (Unix seconds), after a failure.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_at: Option<i64>,
    /// A renewal was asked for (`ctl cert renew`) and is not done yet.
    pub renewal_requested: bool,
    /// An on-demand template's settings (its `ask` URL and patterns).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub on_demand: Option<&'a tidegate_model::OnDemand>,
}

impl<'a> AcmeView<'a> {
    /// The view of a managed certificate.
    pub fn of(m: &'a Managed) -> AcmeView<'a> {
        let s = &m.state;
        let positive = |t: i64| (t > 0).then_some(t);
        AcmeView {
            hosts: m.acme.hosts(),
            directory: m.acme.directory(),
            challenge: m.acme.challenge().as_str(),
            status: m.status(),
            renew_at: positive(s.renewal_due_at()),
            renewal_info: s.renewal_info,
            issued_at: positive(s.issued_at),
            orders: s.orders,
            failures: s.failures,
            last_error: s.last_error.as_deref(),
            retry_at: positive(s.retry_at).filter(|_| s.failures > 0),
            renewal_requested: s.renew_requested > s.renewed,
            on_demand: m.acme.on_demand(),
        }
    }
}

/// One certificate, read back.
#[derive(Debug, Serialize, JsonSchema)]
pub struct CertificateRead<'a> {
    /// The revision read.
    pub revision: u64,
    /// The certificate.
    pub certificate: CertificateView<'a>,
}

/// Every certificate, by name.
#[derive(Debug, Serialize, JsonSchema)]
pub struct CertificatesRead<'a> {
    /// The revision read.
    pub revision: u64,
    /// Certificates by name.
    pub certificates: BTreeMap<&'a str, CertificateView<'a>>,
}

/// The whole configuration (`GET /v1/config`): a declarative document,
/// which `PUT /v1/config` takes back as it is.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ConfigRead<'a> {
    /// The revision read.
    pub revision: u64,
    /// Services by name (secrets replaced by `<redacted>`).
    pub services: BTreeMap<&'a str, Cow<'a, ServiceSpec>>,
    /// Routes by name.
    pub routes: BTreeMap<&'a str, &'a RouteSpec>,
    /// Certificates by name, as a document gives them: the chain,
    /// `default`, and the key as `(redacted)` (applied back, it keeps the
    /// key). Names and validity: `GET /v1/certificates`.
    pub certificates: BTreeMap<&'a str, CertificateSpec>,
    /// Rule sets by name (password hashes as `(redacted)`; applied back,
    /// each keeps its user's hash).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub rules: BTreeMap<&'a str, Cow<'a, RuleSetSpec>>,
    /// Named listeners by name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub listeners: BTreeMap<&'a str, &'a ListenerSpec>,
}

/// `GET /healthz`.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct Alive {
    /// Always `ok`.
    pub status: String,
}

/// `GET /readyz`.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct Readiness {
    /// `ready`, or `store unavailable` or `store fault` (with 503).
    pub status: String,
    /// The revision applied.
    pub revision: u64,
    /// Why the store is unavailable, or the key at fault and what is wrong.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `GET /v1/events`.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Events {
    /// The autoscaler's decisions and actions, oldest first.
    pub events: Vec<Event>,
}

/// An error: what is wrong, and where.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
    /// The HTTP status, again.
    pub status: u16,
}

/// What is wrong.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct ErrorDetail {
    /// A sentence saying what is wrong.
    pub message: String,
    /// The index of the failing operation in a change set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub op: Option<usize>,
    /// The field at fault (`spec.backends[0].addr`, `query.from`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

/// `GET /v1/status`: live state.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Status {
    /// The revision live in the data plane.
    pub revision: u64,
    /// The configuration store.
    pub store: StoreState,
    /// Routes configured.
    pub routes: usize,
    /// Services by name.
    pub services: BTreeMap<String, ServiceState>,
    /// Certificates that expire within 14 days (or have expired), soonest first.
    pub certificates_expiring: Vec<Expiring>,
    /// Managed (ACME) certificates by name: where each stands.
    pub managed_certificates: BTreeMap<String, ManagedState>,
    /// The rule steps each route runs (routes without rules are left
    /// out), in order, with what each did since the route's chain was
    /// compiled.
    pub rules: BTreeMap<String, Vec<RuleStepState>>,
    /// The configuration file (`serve --config`), when there is one.
    pub config_file: Option<ConfigFileState>,
    /// The instance this one took over (`serve --takeover`, `tidegate
    /// upgrade`), while it drains and after.
    pub predecessor: Option<PredecessorState>,
    /// The named listeners, by name, as this instance serves them.
    pub listeners: BTreeMap<String, ListenerStatus>,
    /// QUIC (HTTP/3) connections open on this instance; absent when HTTP/3
    /// is off.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quic_connections_open: Option<u64>,
}

/// A named listener as this instance serves it.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct ListenerStatus {
    /// `IP:PORT`.
    pub addr: String,
    /// It terminates TLS.
    pub tls: bool,
    /// It reads the PROXY protocol from its trusted networks.
    pub proxy_protocol: bool,
    /// `listening`, or `failed` (its socket could not be opened; tried
    /// again every 5 s).
    pub state: String,
    /// Why it failed.
    pub error: Option<String>,
    /// Since when (Unix time, milliseconds).
    pub since_ms: u64,
}

impl From<tidegate_snapshot::ListenerState> for ListenerStatus {
    fn from(s: tidegate_snapshot::ListenerState) -> ListenerStatus {
        ListenerStatus {
            addr: s.addr.to_string(),
            tls: s.tls,
            proxy_protocol: s.proxy_protocol,
            state: if s.error.is_none() { "listening" } else { "failed" }.to_string(),
            error: s.error,
            since_ms: s.since_ms,
        }
    }
}

/// One named listener, read back.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ListenerRead<'a> {
    /// The revision read.
    pub revision: u64,
    /// The listener.
    pub spec: &'a ListenerSpec,
    /// The routes bound to it.
    pub used_by: Vec<&'a str>,
    /// How this instance serves it (absent until the data plane took the
    /// revision that added it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<ListenerStatus>,
}

/// Every named listener, by name.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ListenersRead<'a> {
    /// The revision read.
    pub revision: u64,
    /// Listeners by name.
    pub listeners: BTreeMap<&'a str, &'a ListenerSpec>,
}

/// A managed certificate as `/v1/status` shows it.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct ManagedState {
    /// The names it is for.
    pub hosts: Vec<String>,
    /// `pending`, `ordering`, `valid`, `renewing` or `failing`.
    pub status: AcmeStatus,
    /// The issuer of the certificate served, once one is.
    pub issuer: Option<String>,
    /// End of validity of the certificate served (Unix seconds).
    pub not_after: Option<i64>,
    /// When its renewal is due (Unix seconds).
    pub renew_at: Option<i64>,
    /// Orders placed with the CA.
    pub orders: u64,
    /// Why the last order failed, while it is failing.
    pub last_error: Option<String>,
}

/// The instance this one took over, as `/v1/status` shows it.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct PredecessorState {
    /// Its process id (0 if it did not say: a binary of the first
    /// hand-over protocol).
    pub pid: u32,
    /// `draining` (it finishes its connections), `exited` (it said it is
    /// done), or `gone` (it stopped reporting without saying so: a binary
    /// of the first hand-over protocol, or it died).
    pub state: String,
    /// Client connections it still has open (while draining; what it
    /// last reported otherwise).
    pub connections: u64,
    /// Connections its drain timeout closed (once exited).
    pub cut: Option<u64>,
    /// Milliseconds from this instance serving to the predecessor's last
    /// report.
    pub drain_ms: u64,
}

/// One step of a route's rules, as `/v1/status` shows it.
#[derive(Debug, Serialize, JsonSchema)]
pub struct RuleStepState {
    /// The rule set.
    pub rule_set: String,
    /// The step's index in the set.
    pub step: usize,
    /// The step's kind.
    pub kind: String,
    /// Requests it answered (redirect, refusal, challenge, 429, preflight).
    pub answered: u64,
    /// Requests it changed (path, request headers).
    pub changed: u64,
}

/// The configuration store, as `/v1/status` shows it.
#[derive(Debug, Serialize, JsonSchema)]
pub struct StoreState {
    /// `sqlite`, `redb` or `etcd`.
    pub kind: String,
    /// Where it is (a path, or etcd's endpoints and prefix).
    pub location: String,
    /// Whether it answers (cluster mode: the etcd watch is live).
    pub connected: bool,
    /// The newest revision the store holds.
    pub latest_revision: u64,
    /// Revisions the store holds that this instance has not applied.
    pub lag: u64,
    /// The last error talking to the store.
    pub last_error: Option<String>,
    /// Instances sharing the store (cluster mode).
    pub instances: Vec<InstanceState>,
    /// Keys in a state Tidegate never leaves them in (cluster mode; see
    /// docs/cluster.md, "Store faults"): while there is one, `/readyz`
    /// answers 503 and writes are refused.
    pub faults: Vec<StoreFaultState>,
}

/// A key of the store at fault.
#[derive(Debug, Serialize, JsonSchema)]
pub struct StoreFaultState {
    /// The key, in full.
    pub key: String,
    /// What kind of fault: `rev_invalid`, `rev_missing`, `rev_behind_log`,
    /// `log_undecodable`, `log_misnumbered`, `log_overwritten`,
    /// `object_invalid`, `written_outside` or `deleted_outside`.
    pub kind: String,
    /// What is wrong, in words.
    pub message: String,
}

/// What `serve --config FILE` last did with its file, as `/v1/status`
/// shows it.
#[derive(Debug, Clone, Default, Serialize, JsonSchema)]
pub struct ConfigFileState {
    /// The file.
    pub path: String,
    /// `seed` or `sync`.
    pub mode: String,
    /// Whether the last reading of the file (at start, or on `SIGHUP`)
    /// was applied (or found nothing to change).
    pub ok: bool,
    /// The revision the file was last applied at (or found in sync with).
    pub applied_revision: Option<u64>,
    /// Why the last reading was refused; the configuration it would have
    /// changed stayed as it was.
    pub last_error: Option<String>,
    /// Readings refused since the start.
    pub failures: u64,
}

/// One instance sharing the store.
#[derive(Debug, Serialize, JsonSchema)]
pub struct InstanceState {
    /// Its name.
    pub name: String,
    /// Its admin address.
    pub admin: String,
    /// The revision it applied.
    pub applied_revision: u64,
    /// Revisions behind the store.
    pub lag: u64,
}

/// A certificate close to its end.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Expiring {
    /// The certificate's name.
    pub name: String,
    /// The names it serves.
    pub names: Vec<String>,
    /// End of validity, seconds since the Unix epoch.
    pub not_after: i64,
    /// Whether that is past.
    pub expired: bool,
}

/// One service's live state.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ServiceState {
    /// The balancing policy.
    pub policy: tidegate_model::PolicySpec,
    /// Requests in flight to its backends.
    pub in_flight: u64,
    /// Requests waiting for a backend under its limit.
    pub queued: u64,
    /// Client addresses (IPv6: /64) with requests waiting; the queue takes
    /// them in turns.
    pub queued_clients: u64,
    /// Requests that lost their place in the full queue to a request of a
    /// client holding fewer places (answered `503` queue full).
    pub queue_displaced: u64,
    /// Whether its backends' concurrency limits are learned.
    pub learns_limits: bool,
    /// Retries in flight (under the retry budget).
    pub retries_in_flight: u64,
    /// Retries the budget refused.
    pub retries_refused: u64,
    /// Its backends, in id order.
    pub backends: Vec<BackendState>,
    /// Its autoscaling, when it has an `autoscale` block.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scaling: Option<ScalingStatus>,
    /// Its pool from DNS, when it has a `dns` block and this instance
    /// resolves it: the name, the addresses of the last answer and when it
    /// came, the TTL, the next resolution, and the error while resolving
    /// fails (the last good set keeps serving).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns: Option<tidegate_dns::DnsStatus>,
}

/// One backend's live state.
#[derive(Debug, Serialize, JsonSchema)]
pub struct BackendState {
    /// Its id.
    pub id: String,
    /// Its address.
    pub addr: String,
    /// Its configured weight.
    pub weight: u32,
    /// The weight a dynamic policy computed for it (primaries only).
    pub effective_weight: Option<f64>,
    /// A backup: used only when no primary can be.
    pub backup: bool,
    /// Resolved from the service's `dns` name.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dns: bool,
    /// `up`, `down` (active checks fail), `ejected` (passive health) or
    /// `unchecked` (no active checks).
    pub health: String,
    /// Whether it takes traffic now.
    pub available: bool,
    /// Time left in its ejection, ms.
    pub ejected_for_ms: u64,
    /// Ejections in its current streak.
    pub ejections: u32,
    /// Its share of slow start's ramp (1: full).
    pub slow_start_factor: f64,
    /// Attempts in flight.
    pub in_flight: u64,
    /// Attempts ended.
    pub requests: u64,
    /// Of which failed.
    pub failures: u64,
    /// Latency EWMA to the response head, ms.
    pub latency_ewma_ms: Option<f64>,
    /// The learned concurrency limit (`null` when not learned).
    pub concurrency_limit: Option<u64>,
    /// The learned no-load latency, ms.
    pub no_load_latency_ms: Option<f64>,
    /// What the backend or its host reports.
    pub load: LoadState,
}

/// Load reports (`null`: not reported).
#[derive(Debug, Serialize, JsonSchema)]
pub struct LoadState {
    /// CPU utilization, 0..1.
    pub cpu: Option<f64>,
    /// Memory utilization, 0..1.
    pub memory: Option<f64>,
    /// Network utilization, 0..1.
    pub network: Option<f64>,
    /// Requests per second it reports.
    pub qps: Option<f64>,
    /// Age of the last report, ms.
    pub age_ms: Option<u64>,
}

/// `POST /v1/services/{name}/autoscale`: the operator's overrides of one
/// service's autoscaling (a field left out is left as it is).
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AutoscaleOverride {
    /// Stop (true) or resume (false) scaling decisions.
    #[serde(default)]
    pub paused: Option<bool>,
    /// Keep exactly this many instances (within min..=max); `null` lets
    /// the autoscaler decide again.
    #[serde(default, deserialize_with = "present")]
    #[schemars(with = "Option<u32>")]
    pub pinned: Option<Option<u32>>,
}

/// Distinguishes `"pinned": null` (unpin) from a missing field (no change).
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Option<u32>>, D::Error> {
    Option::<u32>::deserialize(d).map(Some)
}
