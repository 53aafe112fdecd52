//! Cluster mode: the configuration in etcd, shared by every Tidegate that
//! points at the same prefix.
//!
//! Layout under the prefix (values are the same JSON the embedded store keeps):
//!
//! | key | value |
//! |---|---|
//! | `rev` | the newest revision, in decimal |
//! | `services/NAME` | the service's settings |
//! | `backends/SERVICE/ID` | one backend |
//! | `routes/NAME`, `certificates/NAME` | one route, one certificate |
//! | `log/REVISION` (20 digits) | the change set that made that revision |
//! | `instances/NAME` | a live instance's record, under its lease |
//! | `leaders/ROLE` | the name of the instance that leads ROLE (one service's autoscaling), under its lease |
//!
//! A group of change sets is one transaction: the objects it changed, its
//! log entries and the new `rev`, guarded by `rev` still holding the
//! revision the group was built on. Every instance watches `rev` and reads
//! the log entries it has not applied; revisions are Tidegate's own, one
//! per change set, the same on every instance.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tidegate_etcd::{prefix_end, Client, ClientOptions, Compare, Credentials, EtcdError, EventKind, TlsOptions, TxnOp};
use tidegate_model::{
    BackendId, CertName, CertificateSpec, ChangeSet, ConfigState, Op, RouteName, RouteSpec, ServiceName,
    ServiceSettings, ServiceSpec,
};

use crate::{
    AppliedChange, Commit, CommitCost, Follow, InstanceRecord, Loaded, Store, StoreError, StoreStatus, LOG_RETAIN,
};

/// Where the configuration lives in etcd: `etcd://HOST:PORT[,HOST:PORT...]/PREFIX[?history=N]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdUrl {
    /// The members' client addresses.
    pub endpoints: Vec<String>,
    /// The key prefix, ending in `/`.
    pub prefix: String,
    /// How many change sets the log keeps for watchers to catch up from.
    pub history: u64,
    /// The most operations one transaction may carry: etcd's
    /// `--max-txn-ops` (128 unless raised on every member).
    pub max_txn_ops: usize,
}

/// etcd's default `--max-txn-ops`.
const ETCD_MAX_TXN_OPS: usize = 128;
/// What Tidegate puts in one transaction, in bytes: below etcd's default
/// `--max-request-bytes` (1.5 MiB), with room for the request's framing.
const MAX_TXN_BYTES: usize = 1 << 20;
/// Room for one private key kept from the stored certificate, base64
/// encoded in the transaction (an RSA-4096 key in PEM is about 3.3 KiB).
const KEPT_KEY_BYTES: usize = 6 * 1024;

impl std::str::FromStr for EtcdUrl {
    type Err = String;

    fn from_str(s: &str) -> Result<EtcdUrl, String> {
        let rest = s.strip_prefix("etcd://").ok_or_else(|| {
            format!("{s:?}: a store URL starts with etcd:// (etcd://HOST:PORT[,HOST:PORT...]/PREFIX)")
        })?;
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (hosts, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let mut endpoints = Vec::new();
        for host in hosts.split(',') {
            let (h, port) = host.rsplit_once(':').ok_or_else(|| format!("{host:?}: an etcd member is HOST:PORT"))?;
            if h.is_empty() || port.parse::<u16>().map_or(true, |p| p == 0) {
                return Err(format!("{host:?}: an etcd member is HOST:PORT"));
            }
            endpoints.push(host.to_string());
        }
        let prefix = prefix.trim_matches('/');
        if prefix.is_empty() {
            return Err(format!("{s:?}: name a key prefix after the members, as in etcd://127.0.0.1:2379/tidegate"));
        }
        if prefix.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(format!("{prefix:?}: the key prefix may not contain spaces or control characters"));
        }
        let mut history = LOG_RETAIN;
        let mut max_txn_ops = ETCD_MAX_TXN_OPS;
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("max_txn_ops", n)) => {
                    max_txn_ops = n
                        .parse()
                        .ok()
                        .filter(|n| *n >= 8)
                        .ok_or_else(|| format!("max_txn_ops={n}: etcd's --max-txn-ops, at least 8"))?;
                }
                Some(("history", n)) => {
                    history = n
                        .parse()
                        .ok()
                        .filter(|n| *n >= 1)
                        .ok_or_else(|| format!("history={n}: a number of change sets, at least 1"))?;
                }
                _ => return Err(format!("{pair:?}: unknown store option (known: history=N, max_txn_ops=N)")),
            }
        }
        Ok(EtcdUrl { endpoints, prefix: format!("{prefix}/"), history, max_txn_ops })
    }
}

impl std::fmt::Display for EtcdUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "etcd://{}/{}", self.endpoints.join(","), self.prefix.trim_end_matches('/'))?;
        let mut sep = '?';
        if self.history != LOG_RETAIN {
            write!(f, "{sep}history={}", self.history)?;
            sep = '&';
        }
        if self.max_txn_ops != ETCD_MAX_TXN_OPS {
            write!(f, "{sep}max_txn_ops={}", self.max_txn_ops)?;
        }
        Ok(())
    }
}

/// TLS and user settings for etcd, from the command line.
#[derive(Debug, Clone, Default)]
pub struct EtcdAccess {
    /// TLS to the members.
    pub tls: Option<TlsOptions>,
    /// A user, when etcd has authentication enabled.
    pub credentials: Option<Credentials>,
}

/// The configuration in etcd.
pub struct EtcdStore {
    runtime: tokio::runtime::Runtime,
    client: Client,
    url: EtcdUrl,
    live: Arc<Live>,
}

/// What the follower learns, shared with status readers.
#[derive(Default)]
struct Live {
    connected: AtomicBool,
    latest: AtomicU64,
    last_error: Mutex<Option<String>>,
    instances: Mutex<Vec<InstanceRecord>>,
    announced: Mutex<Option<(String, String)>>,
    /// Roles asked for, and whether this instance holds each.
    roles: Mutex<BTreeMap<String, bool>>,
    /// The instance's lease and until when it is surely alive at etcd.
    lease: Mutex<Option<(i64, Instant)>>,
    /// Change sets the watch brought that the writer has not taken yet.
    received: Mutex<BTreeMap<u64, AppliedChange>>,
}

/// The most change sets kept from the watch for the writer; beyond it they
/// are dropped and read from etcd when needed.
const MAX_RECEIVED: usize = 65_536;

impl Live {
    /// Keeps `change` for the writer, which has applied up to `applied`
    /// (what it has applied is dropped: its own commits come back too).
    fn keep(&self, change: AppliedChange, applied: u64) {
        if let Ok(mut received) = self.received.lock() {
            if received.first_key_value().is_some_and(|(r, _)| *r <= applied) {
                let newer = received.split_off(&(applied + 1));
                *received = newer;
            }
            if received.len() < MAX_RECEIVED {
                received.insert(change.revision, change);
            }
        }
    }

    /// Up to `limit` change sets from `after + 1` on, if the watch brought
    /// them all, without a gap; forgets those at or below `after`.
    fn take(&self, after: u64, limit: usize) -> Option<Vec<AppliedChange>> {
        let mut received = self.received.lock().ok()?;
        let newer = received.split_off(&(after + 1));
        *received = newer;
        let latest = self.latest.load(Relaxed);
        let mut out = Vec::new();
        for (expected, (revision, change)) in (after + 1..).zip(received.iter()) {
            if *revision != expected || out.len() == limit {
                break;
            }
            out.push(change.clone());
        }
        let complete = out.len() == limit || out.last().map_or(after, |c| c.revision) >= latest;
        (complete && !out.is_empty()).then_some(out)
    }

    /// The lease, while it is surely still alive at etcd.
    fn valid_lease(&self) -> Option<i64> {
        let lease = *self.lease.lock().ok()?;
        lease.filter(|(_, until)| Instant::now() < *until).map(|(id, _)| id)
    }
}

impl Live {
    fn failed(&self, e: &dyn std::fmt::Display) {
        self.connected.store(false, Relaxed);
        if let Ok(mut last) = self.last_error.lock() {
            *last = Some(e.to_string());
        }
    }

    fn ok(&self) {
        self.connected.store(true, Relaxed);
        if let Ok(mut last) = self.last_error.lock() {
            *last = None;
        }
    }
}

fn unavailable(e: EtcdError) -> StoreError {
    match e {
        EtcdError::Refused { message, .. }
            if message.contains("too many operations") || message.contains("request is too large") =>
        {
            StoreError::TooLarge(format!(
                "etcd refused the transaction: {message}; raise --max-txn-ops / --max-request-bytes on every etcd member, or send smaller change sets"
            ))
        }
        EtcdError::Refused { .. } | EtcdError::Protocol(_) | EtcdError::Config(_) => StoreError::Backend(e.to_string()),
        EtcdError::Unavailable(m) => StoreError::Unavailable(m),
    }
}

fn corrupt<E: std::fmt::Display>(e: E) -> StoreError {
    StoreError::Corrupt(e.to_string())
}

fn json<T: serde::Serialize>(v: &T) -> Result<Vec<u8>, StoreError> {
    serde_json::to_vec(v).map_err(corrupt)
}

impl EtcdStore {
    /// Connects to the cluster and checks it answers.
    pub fn open(url: EtcdUrl, access: EtcdAccess) -> Result<EtcdStore, StoreError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("tidegate-etcd")
            .enable_all()
            .build()
            .map_err(|e| StoreError::Backend(format!("cannot start the etcd client's thread: {e}")))?;
        let mut options = ClientOptions::new(url.endpoints.clone());
        options.tls = access.tls;
        options.credentials = access.credentials;
        let client = Client::new(options).map_err(unavailable)?;
        let store = EtcdStore { runtime, client, url, live: Arc::default() };
        // Fail at start, with the reason, rather than at the first change.
        let (_, rev) = store.runtime.block_on(store.read_rev()).map_err(|e| match e {
            StoreError::Unavailable(m) => StoreError::Unavailable(format!("{}: {m}", store.location())),
            other => other,
        })?;
        store.live.latest.store(rev, Relaxed);
        store.live.ok();
        Ok(store)
    }

    fn location(&self) -> String {
        self.url.to_string()
    }

    fn key(&self, rest: &str) -> Vec<u8> {
        format!("{}{rest}", self.url.prefix).into_bytes()
    }

    fn log_key(&self, revision: u64) -> Vec<u8> {
        self.key(&format!("log/{revision:020}"))
    }

    /// The etcd revision and Tidegate's newest revision.
    async fn read_rev(&self) -> Result<(i64, u64), StoreError> {
        read_rev(&self.client, &self.key("rev")).await
    }

    /// Replaces whatever is under the prefix with `state` at `revision`,
    /// with no history (`tidegate store copy`). Refuses a prefix that
    /// already holds a configuration.
    pub fn import(&self, state: &ConfigState, revision: u64) -> Result<(), StoreError> {
        let empty = ConfigState::default();
        let mut ops = vec![TxnOp::Put { key: self.key("rev"), value: revision.to_string().into_bytes(), lease: 0 }];
        let all: Vec<_> = state.services().keys().map(|n| Op::DeleteService { name: n.clone() }).collect();
        self.object_writes(&all, &empty, state, &mut ops)?;
        let routes: Vec<_> = state.routes().keys().map(|n| Op::DeleteRoute { name: n.clone() }).collect();
        self.object_writes(&routes, &empty, state, &mut ops)?;
        let certs: Vec<_> = state.certificates().keys().map(|n| Op::DeleteCertificate { name: n.clone() }).collect();
        self.object_writes(&certs, &empty, state, &mut ops)?;
        let guard = [Compare::Absent(self.key("rev"))];
        let outcome = self.runtime.block_on(self.client.txn(&guard, &ops)).map_err(unavailable)?;
        if !outcome.succeeded {
            return Err(StoreError::Backend(format!(
                "{} already holds a configuration; copy into an empty prefix",
                self.location()
            )));
        }
        Ok(())
    }

    /// The writes that make the objects `ops` touched equal to `after`.
    fn object_writes<'a>(
        &self,
        ops: impl IntoIterator<Item = &'a Op>,
        before: &ConfigState,
        after: &ConfigState,
        out: &mut Vec<TxnOp>,
    ) -> Result<(), StoreError> {
        // Key -> new value (None: delete), so a key touched twice is written
        // once; a service deleted for good takes its backends in one range.
        let mut writes: BTreeMap<Vec<u8>, Option<Vec<u8>>> = BTreeMap::new();
        let mut gone = std::collections::BTreeSet::new();
        for op in ops {
            match op {
                Op::PutService { name, .. } | Op::DeleteService { name } => {
                    let old = before.services().get(name);
                    let new = after.services().get(name);
                    let key = self.key(&format!("services/{name}"));
                    writes.insert(key, new.map(|s| json(&s.settings)).transpose()?);
                    if new.is_none() {
                        gone.insert(self.key(&format!("backends/{name}/")));
                        continue;
                    }
                    let backend = |id: &BackendId| self.key(&format!("backends/{name}/{id}"));
                    if let Some(old) = old {
                        for id in old.backends.keys() {
                            if new.is_none_or(|n| !n.backends.contains_key(id)) {
                                writes.insert(backend(id), None);
                            }
                        }
                    }
                    if let Some(new) = new {
                        for (id, spec) in &new.backends {
                            if old.and_then(|o| o.backends.get(id)) != Some(spec) {
                                writes.insert(backend(id), Some(json(spec)?));
                            }
                        }
                    }
                }
                Op::PutBackend { service, id, .. } | Op::DeleteBackend { service, id } => {
                    let spec = after.services().get(service).and_then(|s| s.backends.get(id));
                    writes.insert(self.key(&format!("backends/{service}/{id}")), spec.map(json).transpose()?);
                }
                Op::PutRoute { name, .. } | Op::DeleteRoute { name } => {
                    let spec = after.routes().get(name);
                    writes.insert(self.key(&format!("routes/{name}")), spec.map(|s| json(&**s)).transpose()?);
                }
                Op::PutCertificate { name, .. } | Op::DeleteCertificate { name } => {
                    let spec = after.certificates().get(name);
                    writes.insert(self.key(&format!("certificates/{name}")), spec.map(|s| json(&**s)).transpose()?);
                }
            }
        }
        // A backend of a service that is gone is in its range already.
        writes.retain(|key, _| !gone.iter().any(|g| key.starts_with(g)));
        out.extend(gone.into_iter().map(|from| {
            let to = prefix_end(&from);
            TxnOp::DeleteRange(from, to)
        }));
        out.extend(writes.into_iter().map(|(key, value)| match value {
            Some(value) => TxnOp::Put { key, value, lease: 0 },
            None => TxnOp::Delete(key),
        }));
        Ok(())
    }
}

async fn read_rev(client: &Client, key: &[u8]) -> Result<(i64, u64), StoreError> {
    let (etcd_rev, kv) = client.get(key).await.map_err(unavailable)?;
    let rev = match kv {
        None => 0,
        Some(kv) => std::str::from_utf8(&kv.value).ok().and_then(|v| v.parse().ok()).ok_or_else(|| {
            StoreError::Corrupt(format!("the revision key holds {:?}", String::from_utf8_lossy(&kv.value)))
        })?,
    };
    Ok((etcd_rev, rev))
}

impl Store for EtcdStore {
    fn load(&self) -> Result<Loaded, StoreError> {
        self.runtime.block_on(async {
            // Everything at one etcd revision: the whole prefix is one range.
            let prefix = self.url.prefix.as_bytes();
            let range = self.client.range(prefix, Some(&prefix_end(prefix))).await.map_err(unavailable)?;
            let mut revision = 0;
            let mut services: BTreeMap<String, ServiceSpec> = BTreeMap::new();
            let mut routes = Vec::new();
            let mut certificates = Vec::new();
            let mut backends = Vec::new();
            for kv in &range.kvs {
                let key = std::str::from_utf8(&kv.key[prefix.len()..]).map_err(corrupt)?;
                let (kind, name) = key.split_once('/').unwrap_or((key, ""));
                match kind {
                    "rev" => {
                        revision = std::str::from_utf8(&kv.value).ok().and_then(|v| v.parse().ok()).unwrap_or(0);
                    }
                    "services" => {
                        let settings: ServiceSettings = serde_json::from_slice(&kv.value).map_err(corrupt)?;
                        services.insert(name.to_string(), ServiceSpec { settings, backends: Default::default() });
                    }
                    "backends" => backends.push((name, &kv.value)),
                    "routes" => {
                        let spec: RouteSpec = serde_json::from_slice(&kv.value).map_err(corrupt)?;
                        routes.push(Op::PutRoute { name: RouteName::new(name).map_err(corrupt)?, spec });
                    }
                    "certificates" => {
                        // An expired certificate still loads (see the embedded store).
                        let spec: CertificateSpec = serde_json::from_slice(&kv.value).map_err(corrupt)?;
                        certificates.push(Op::PutCertificate {
                            name: CertName::new(name).map_err(corrupt)?,
                            spec: Box::new(spec.into()),
                        });
                    }
                    _ => {} // log entries, instance records
                }
            }
            for (name, value) in backends {
                let (service, id) = name.split_once('/').ok_or_else(|| corrupt(format!("backend key {name:?}")))?;
                // A backend whose service is gone cannot be written; skip it
                // rather than refuse to start.
                if let Some(spec) = services.get_mut(service) {
                    spec.backends
                        .insert(BackendId::new(id).map_err(corrupt)?, serde_json::from_slice(value).map_err(corrupt)?);
                }
            }
            let mut ops = Vec::with_capacity(services.len() + routes.len() + certificates.len());
            for (name, spec) in services {
                ops.push(Op::PutService { name: ServiceName::new(&name).map_err(corrupt)?, spec: Box::new(spec) });
            }
            ops.extend(routes);
            ops.extend(certificates);
            let (state, _) = ConfigState::default().apply(&ChangeSet { if_revision: None, ops }, 0).map_err(corrupt)?;
            self.live.latest.fetch_max(revision, Relaxed);
            Ok(Loaded { state, revision })
        })
    }

    fn commit(&self, commit: &Commit<'_>) -> Result<(), StoreError> {
        let Some(last) = commit.changes.last() else {
            return Ok(());
        };
        let rev_key = self.key("rev");
        let guard = if commit.base == 0 {
            Compare::Absent(rev_key.clone())
        } else {
            Compare::ValueIs(rev_key.clone(), commit.base.to_string().into_bytes())
        };
        let all_ops = commit.changes.iter().flat_map(|c| &c.change.ops);
        let mut ops = Vec::with_capacity(commit.changes.len() * 2 + 2);
        self.object_writes(all_ops, commit.before, commit.after, &mut ops)?;
        for c in commit.changes {
            ops.push(TxnOp::Put { key: self.log_key(c.revision), value: json(c)?, lease: 0 });
        }
        ops.push(TxnOp::Put { key: rev_key, value: last.revision.to_string().into_bytes(), lease: 0 });
        // Trim the log now and then (every 64 revisions), not on every commit.
        let history = self.url.history;
        if last.revision > history && last.revision / 64 != commit.base / 64 {
            ops.push(TxnOp::DeleteRange(self.log_key(0), self.log_key(last.revision - history + 1)));
        }
        // A failed commit says nothing about the watch, which is what
        // `connected` (and readiness) reports: it breaks by itself when
        // etcd is gone.
        let outcome = self.runtime.block_on(self.client.txn(&[guard], &ops)).map_err(unavailable)?;
        if !outcome.succeeded {
            return Err(StoreError::Conflict { base: commit.base });
        }
        self.live.latest.fetch_max(last.revision, Relaxed);
        Ok(())
    }

    fn commit_cost(&self, change: &ChangeSet, state: &ConfigState) -> CommitCost {
        let backends = |name: &ServiceName| state.services().get(name).map_or(0, |s| s.backends.len());
        let writes: usize = change
            .ops
            .iter()
            .map(|op| match op {
                Op::PutService { name, spec } => 1 + backends(name) + spec.backends.len(),
                Op::DeleteService { .. } => 2,
                _ => 1,
            })
            .sum();
        // The objects and the log entry, base64-encoded, plus keys and
        // framing. A certificate that keeps its key is written with that
        // key, which the change set does not carry (a PEM key is at most a
        // few KiB).
        let size = serde_json::to_vec(change).map_or(0, |v| v.len());
        let kept_keys =
            change.ops.iter().filter(|op| matches!(op, Op::PutCertificate { spec, .. } if spec.keeps_key())).count();
        CommitCost { ops: writes + 1, bytes: size * 3 + 128 * (writes + 1) + KEPT_KEY_BYTES * kept_keys }
    }

    fn max_commit_cost(&self) -> CommitCost {
        // Room for the revision key and the log trim.
        CommitCost { ops: self.url.max_txn_ops.saturating_sub(2), bytes: MAX_TXN_BYTES }
    }

    fn changes_since(&self, after: u64, limit: usize) -> Result<Vec<AppliedChange>, StoreError> {
        if let Some(changes) = self.live.take(after, limit) {
            return Ok(changes);
        }
        self.runtime.block_on(async {
            let from = self.log_key(after + 1);
            let end = prefix_end(&self.key("log/"));
            let range = self.client.range_limited(&from, &end, limit).await.map_err(unavailable)?;
            let mut out = Vec::with_capacity(range.kvs.len());
            for (expected, kv) in (after + 1..).zip(&range.kvs) {
                let change: AppliedChange = serde_json::from_slice(&kv.value).map_err(corrupt)?;
                if change.revision != expected {
                    return Err(StoreError::Compacted { oldest: change.revision });
                }
                out.push(change);
            }
            if out.is_empty() {
                // No log after `after`: up to date, unless the revision moved
                // on without a log (trimmed, or an imported configuration).
                let (_, revision) = self.read_rev().await?;
                if revision > after {
                    return Err(StoreError::Compacted { oldest: revision + 1 });
                }
            }
            Ok(out)
        })
    }

    fn follow(&self, hooks: Follow) {
        let hooks = Arc::new(hooks);
        let client = self.client.clone();
        let live = self.live.clone();
        let rev_key = self.key("rev");
        let log_prefix = self.key("log/");
        self.runtime.spawn(follow_log(client.clone(), rev_key, log_prefix, live.clone(), hooks.clone()));
        let instances = self.key("instances/");
        let leaders = self.key("leaders/");
        self.runtime.spawn(heartbeat(client, instances, leaders, live, hooks));
    }

    fn latest_revision(&self) -> u64 {
        self.live.latest.load(Relaxed)
    }

    fn status(&self) -> StoreStatus {
        StoreStatus {
            kind: "etcd",
            location: self.location(),
            connected: self.live.connected.load(Relaxed),
            latest_revision: self.live.latest.load(Relaxed),
            last_error: self.live.last_error.lock().ok().and_then(|e| e.clone()),
            instances: self.live.instances.lock().map(|i| i.clone()).unwrap_or_default(),
        }
    }

    fn announce(&self, name: String, admin: String) {
        if let Ok(mut a) = self.live.announced.lock() {
            *a = Some((name, admin));
        }
    }

    fn name(&self) -> Option<String> {
        self.live.announced.lock().ok().and_then(|a| a.as_ref().map(|(name, _)| name.clone()))
    }

    fn campaign(&self, role: &str) {
        if let Ok(mut roles) = self.live.roles.lock() {
            roles.entry(role.to_string()).or_insert(false);
        }
    }

    fn leads(&self, role: &str) -> bool {
        let held = self.live.roles.lock().ok().and_then(|r| r.get(role).copied()).unwrap_or(false);
        held && self.live.valid_lease().is_some()
    }

    fn resign(&self, role: &str) {
        let held = self.live.roles.lock().ok().and_then(|mut r| r.remove(role)).unwrap_or(false);
        if held {
            let key = self.key(&format!("leaders/{role}"));
            let client = self.client.clone();
            self.runtime.spawn(async move {
                let _ = client.delete(&key).await;
            });
        }
    }

    fn retire(&self) {
        let lease = self.live.lease.lock().ok().and_then(|mut l| l.take());
        if let Some((id, _)) = lease {
            let client = self.client.clone();
            let revoke = async move { tokio::time::timeout(Duration::from_secs(1), client.lease_revoke(id)).await };
            let _ = self.runtime.block_on(revoke);
        }
    }
}

/// Follows the log for as long as the process lives: reads `rev`, wakes
/// the writer (which catches up from what it has applied), then watches the
/// log from there, keeping the change sets it brings for the writer (so
/// following another instance costs no read). After any break it starts
/// again (backing off to 2 s).
async fn follow_log(client: Client, rev_key: Vec<u8>, log_prefix: Vec<u8>, live: Arc<Live>, hooks: Arc<Follow>) {
    let mut backoff = Duration::from_millis(100);
    let log_end = prefix_end(&log_prefix);
    loop {
        match read_rev(&client, &rev_key).await {
            Ok((etcd_rev, rev)) => {
                live.latest.fetch_max(rev, Relaxed);
                (hooks.wake)();
                match client.watch(&log_prefix, Some(&log_end), etcd_rev + 1).await {
                    Ok(mut watch) => {
                        live.ok();
                        backoff = Duration::from_millis(100);
                        loop {
                            match watch.next().await {
                                Ok(Some(message)) => {
                                    let applied = (hooks.applied)();
                                    let mut newest = 0;
                                    for event in message.events.iter().filter(|e| e.kind == EventKind::Put) {
                                        // A change set this instance has not applied yet; a
                                        // value that does not decode is read again later.
                                        let Ok(change) = serde_json::from_slice::<AppliedChange>(&event.kv.value)
                                        else {
                                            continue;
                                        };
                                        newest = newest.max(change.revision);
                                        if change.revision > applied {
                                            live.keep(change, applied);
                                        }
                                    }
                                    if newest > 0 {
                                        live.latest.fetch_max(newest, Relaxed);
                                        (hooks.wake)();
                                    }
                                    if message.canceled {
                                        live.failed(&format!("etcd ended the watch: {}", message.cancel_reason));
                                        break;
                                    }
                                }
                                Ok(None) => {
                                    live.failed(&"the watch connection closed");
                                    break;
                                }
                                Err(e) => {
                                    live.failed(&e);
                                    break;
                                }
                            }
                        }
                    }
                    Err(e) => live.failed(&e),
                }
            }
            Err(e) => live.failed(&e),
        }
        if let Ok(mut received) = live.received.lock() {
            received.clear();
        }
        if !live.connected.load(Relaxed) {
            tracing::warn!(error = ?live.last_error.lock().ok().and_then(|e| e.clone()), "etcd unreachable; serving the last configuration");
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// How long an instance's lease lives without renewal: its record and its
/// roles outlive it by at most this much.
const LEASE_TTL: Duration = Duration::from_secs(5);

/// Keeps this instance's lease (renewed every second), its record and its
/// roles, and reads the others' records.
async fn heartbeat(client: Client, prefix: Vec<u8>, leaders: Vec<u8>, live: Arc<Live>, hooks: Arc<Follow>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let announced = live.announced.lock().ok().and_then(|a| a.clone());
        if let Some((name, admin)) = announced {
            let sent = Instant::now();
            let current = live.lease.lock().ok().and_then(|l| l.map(|(id, _)| id));
            let lease = match current {
                None => client.lease_grant(LEASE_TTL).await.ok(),
                Some(id) => match client.lease_keep_alive(id).await {
                    Ok(true) => Some(id),
                    // Expired: every role it held is gone with it.
                    Ok(false) => None,
                    // Unknown: it stays valid until its time runs out.
                    Err(_) => continue,
                },
            };
            // Counted from before the request: etcd's clock started no earlier.
            let until = sent + LEASE_TTL - Duration::from_secs(1);
            if let Ok(mut l) = live.lease.lock() {
                *l = lease.map(|id| (id, until));
            }
            let Some(lease) = lease else {
                if let Ok(mut roles) = live.roles.lock() {
                    roles.values_mut().for_each(|held| *held = false);
                }
                continue;
            };
            let record = InstanceRecord {
                name: name.clone(),
                admin,
                applied_revision: (hooks.applied)(),
                in_flight: (hooks.in_flight)(),
            };
            let mut key = prefix.clone();
            key.extend_from_slice(name.as_bytes());
            if let Ok(value) = serde_json::to_vec(&record) {
                let _ = client.put(&key, &value, lease).await;
            }
            campaign(&client, &leaders, &name, lease, &live).await;
        }
        if let Ok(range) = client.range(&prefix, Some(&prefix_end(&prefix))).await {
            let records = range.kvs.iter().filter_map(|kv| serde_json::from_slice(&kv.value).ok()).collect();
            if let Ok(mut instances) = live.instances.lock() {
                *instances = records;
            }
        }
    }
}

/// Takes every role asked for that no one holds, under `lease`.
async fn campaign(client: &Client, leaders: &[u8], name: &str, lease: i64, live: &Live) {
    let wanted: Vec<String> = match live.roles.lock() {
        Ok(roles) => roles.iter().filter(|(_, held)| !**held).map(|(r, _)| r.clone()).collect(),
        Err(_) => return,
    };
    for role in wanted {
        let mut key = leaders.to_vec();
        key.extend_from_slice(role.as_bytes());
        let take = TxnOp::Put { key: key.clone(), value: name.as_bytes().to_vec(), lease };
        let held = match client.txn(&[Compare::Absent(key.clone())], &[take]).await {
            Ok(outcome) if outcome.succeeded => true,
            // Held already: by this very lease (an answer lost in transit)?
            Ok(_) => matches!(client.get(&key).await, Ok((_, Some(kv))) if kv.lease == lease),
            Err(_) => false,
        };
        if held {
            tracing::info!(role, "this instance now leads");
        }
        if let Ok(mut roles) = live.roles.lock() {
            if let Some(h) = roles.get_mut(&role) {
                *h = held;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn change(revision: u64) -> AppliedChange {
        AppliedChange { revision, change: ChangeSet { if_revision: None, ops: Vec::new() } }
    }

    fn revisions(changes: Option<Vec<AppliedChange>>) -> Vec<u64> {
        changes.unwrap_or_default().iter().map(|c| c.revision).collect()
    }

    #[test]
    fn change_sets_from_the_watch_are_taken_only_without_a_gap() {
        let live = Live::default();
        live.latest.store(5, Relaxed);
        for r in [2, 3, 5] {
            live.keep(change(r), 1);
        }
        assert!(live.take(1, 10).is_none(), "4 is missing: read it from etcd");
        live.keep(change(4), 1);
        assert_eq!(revisions(live.take(1, 10)), [2, 3, 4, 5]);
        assert_eq!(revisions(live.take(3, 1)), [4], "the limit holds");
        assert!(live.take(5, 10).is_none(), "nothing newer");
        // What the writer has applied (its own commits among them) is dropped.
        live.latest.store(9, Relaxed);
        for r in [6, 7, 8, 9] {
            live.keep(change(r), 7);
        }
        assert_eq!(live.received.lock().map(|r| r.len()).unwrap_or(0), 2);
        assert_eq!(revisions(live.take(7, 10)), [8, 9]);
    }

    #[test]
    fn store_urls_parse_or_say_what_is_wrong() {
        let u: EtcdUrl =
            "etcd://127.0.0.1:2379,127.0.0.1:22379/tidegate/prod?history=50&max_txn_ops=4096".parse().expect("parses");
        assert_eq!(u.max_txn_ops, 4096);
        assert_eq!(u.to_string(), "etcd://127.0.0.1:2379,127.0.0.1:22379/tidegate/prod?history=50&max_txn_ops=4096");
        assert_eq!(u.endpoints, ["127.0.0.1:2379", "127.0.0.1:22379"]);
        assert_eq!(u.prefix, "tidegate/prod/");
        assert_eq!(u.history, 50);
        let d: EtcdUrl = "etcd://etcd-0:2379/tg".parse().expect("parses");
        assert_eq!(d.history, LOG_RETAIN);
        for bad in [
            "http://127.0.0.1:2379/tg",
            "etcd://127.0.0.1:2379",
            "etcd://127.0.0.1/tg",
            "etcd://127.0.0.1:0/tg",
            "etcd://127.0.0.1:2379/tg?history=0",
            "etcd://127.0.0.1:2379/tg?ttl=3",
            "etcd://127.0.0.1:2379/tg?max_txn_ops=2",
        ] {
            assert!(bad.parse::<EtcdUrl>().is_err(), "{bad}");
        }
    }
}
