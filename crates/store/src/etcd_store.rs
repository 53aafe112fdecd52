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
//!
//! A group of change sets is one transaction: the objects it changed, its
//! log entries and the new `rev`, guarded by `rev` still holding the
//! revision the group was built on. Every instance watches `rev` and reads
//! the log entries it has not applied; revisions are Tidegate's own, one
//! per change set, the same on every instance.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tidegate_etcd::{prefix_end, Client, ClientOptions, Compare, Credentials, EtcdError, TlsOptions, TxnOp};
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
    fn object_writes(
        &self,
        ops: &[Op],
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
                            spec: Box::new(spec),
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
        let all_ops: Vec<Op> = commit.changes.iter().flat_map(|c| c.change.ops.iter().cloned()).collect();
        let mut ops = Vec::with_capacity(all_ops.len() + commit.changes.len() + 2);
        self.object_writes(&all_ops, commit.before, commit.after, &mut ops)?;
        for c in commit.changes {
            ops.push(TxnOp::Put { key: self.log_key(c.revision), value: json(c)?, lease: 0 });
        }
        ops.push(TxnOp::Put { key: rev_key, value: last.revision.to_string().into_bytes(), lease: 0 });
        // Trim the log now and then (every 64 revisions), not on every commit.
        let history = self.url.history;
        if last.revision > history && last.revision / 64 != commit.base / 64 {
            ops.push(TxnOp::DeleteRange(self.log_key(0), self.log_key(last.revision - history + 1)));
        }
        let outcome = self.runtime.block_on(self.client.txn(&[guard], &ops)).map_err(|e| {
            self.live.failed(&e);
            unavailable(e)
        })?;
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
        // The objects and the log entry, base64-encoded, plus keys and framing.
        let size = serde_json::to_vec(change).map_or(0, |v| v.len());
        CommitCost { ops: writes + 1, bytes: size * 3 + 128 * (writes + 1) }
    }

    fn max_commit_cost(&self) -> CommitCost {
        // Room for the revision key and the log trim.
        CommitCost { ops: self.url.max_txn_ops.saturating_sub(2), bytes: MAX_TXN_BYTES }
    }

    fn changes_since(&self, after: u64, limit: usize) -> Result<Vec<AppliedChange>, StoreError> {
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
        self.runtime.spawn(watch_revisions(client.clone(), rev_key, live.clone(), hooks.clone()));
        let instances = self.key("instances/");
        self.runtime.spawn(heartbeat(client, instances, live, hooks));
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
}

/// Follows `rev` for as long as the process lives: reads it, wakes the
/// writer, watches it from there; after any break, starts again (backing
/// off to 2 s), so a reconnected instance catches up from the revision it
/// has applied.
async fn watch_revisions(client: Client, rev_key: Vec<u8>, live: Arc<Live>, hooks: Arc<Follow>) {
    let mut backoff = Duration::from_millis(100);
    loop {
        match read_rev(&client, &rev_key).await {
            Ok((etcd_rev, rev)) => {
                live.latest.fetch_max(rev, Relaxed);
                (hooks.wake)();
                match client.watch(&rev_key, None, etcd_rev + 1).await {
                    Ok(mut watch) => {
                        live.ok();
                        backoff = Duration::from_millis(100);
                        loop {
                            match watch.next().await {
                                Ok(Some(message)) => {
                                    for event in &message.events {
                                        let rev =
                                            std::str::from_utf8(&event.kv.value).ok().and_then(|v| v.parse().ok());
                                        if let Some(rev) = rev {
                                            live.latest.fetch_max(rev, Relaxed);
                                        }
                                    }
                                    if !message.events.is_empty() {
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
        if !live.connected.load(Relaxed) {
            tracing::warn!(error = ?live.last_error.lock().ok().and_then(|e| e.clone()), "etcd unreachable; serving the last configuration");
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// Keeps this instance's record (under a 5 s lease) and reads the others'.
async fn heartbeat(client: Client, prefix: Vec<u8>, live: Arc<Live>, hooks: Arc<Follow>) {
    let mut lease = 0;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let announced = live.announced.lock().ok().and_then(|a| a.clone());
        if let Some((name, admin)) = announced {
            if lease == 0 {
                lease = client.lease_grant(Duration::from_secs(5)).await.unwrap_or(0);
            } else if !client.lease_keep_alive(lease).await.unwrap_or(false) {
                lease = 0;
                continue;
            }
            if lease != 0 {
                let record = InstanceRecord { name: name.clone(), admin, applied_revision: (hooks.applied)() };
                let mut key = prefix.clone();
                key.extend_from_slice(name.as_bytes());
                if let Ok(value) = serde_json::to_vec(&record) {
                    let _ = client.put(&key, &value, lease).await;
                }
            }
        }
        if let Ok(range) = client.range(&prefix, Some(&prefix_end(&prefix))).await {
            let records = range.kvs.iter().filter_map(|kv| serde_json::from_slice(&kv.value).ok()).collect();
            if let Ok(mut instances) = live.instances.lock() {
                *instances = records;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
