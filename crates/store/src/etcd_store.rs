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
//! | `routes/NAME`, `certificates/NAME`, `rules/NAME`, `listeners/NAME` | one route, one certificate, one rule set, one listener |
//! | `log/REVISION` (20 digits) | the change set that made that revision |
//! | `instances/NAME` | a live instance's record, under its lease |
//! | `leaders/ROLE` | the name of the instance that leads ROLE (one service's autoscaling), under its lease |
//!
//! A group of change sets is one transaction: the objects it changed, its
//! log entries and the new `rev`, guarded by `rev` still holding the
//! revision the group was built on and by each of its log keys being
//! absent (no instance ever overwrites a log entry). Every instance
//! watches the prefix and reads the log entries it has not applied;
//! revisions are Tidegate's own, one per change set, the same on every
//! instance.
//!
//! Store faults. Every Tidegate commit writes `rev`, so every object it
//! writes has the etcd `mod_revision` of a transaction that also wrote
//! `rev` and a log entry. What breaks that was written by something else,
//! and is a fault ([`FaultKind`]), found the same way by every instance: a
//! running one sees it on the watch (a write or delete of an object at an
//! etcd revision without `rev`), a starting one in the keys' revisions
//! (an object whose `mod_revision` is newer than the oldest log entry's and
//! belongs to no log entry). `rev` behind the newest log entry, `rev`
//! missing beside a log, and log entries that do not decode are faults of
//! the history. While there is a fault, `/readyz` answers 503, status and
//! metrics name the key, and writes are refused with it (an object's fault
//! lets through a write that names the object, which puts it back); a
//! starting instance refuses to start.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tidegate_etcd::{
    prefix_end, Client, ClientOptions, Compare, Credentials, EtcdError, Event, EventKind, KeyValue, TlsOptions, TxnOp,
};
use tidegate_model::{
    BackendId, CertName, CertificateInput, CertificateSpec, ChangeSet, ConfigState, ListenerName, ListenerSpec, Op,
    RouteName, RouteSpec, RuleSetName, RuleSetSpec, ServiceName, ServiceSettings, ServiceSpec,
};

use crate::{
    AppliedChange, Commit, CommitCost, FaultKind, Follow, InstanceRecord, Loaded, ObjectError, Store, StoreError,
    StoreFault, StoreStatus, LOG_RETAIN, MAX_FAULTS,
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

// A clap value parser (`--store`, `copy-store`'s target): its error is
// printed as it is, so it stays text.
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
    /// Keys at fault (full keys), at most [`MAX_FAULTS`].
    faults: Mutex<BTreeMap<String, FaultKind>>,
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
    /// Records a fault (logged once, when it is new or changes).
    fn fault(&self, key: String, kind: FaultKind) {
        let Ok(mut faults) = self.faults.lock() else { return };
        if faults.get(&key) == Some(&kind) || (faults.len() >= MAX_FAULTS && !faults.contains_key(&key)) {
            return;
        }
        tracing::error!(key = %key, fault = %kind, "store fault: the configuration store holds what Tidegate did not write; writes are refused until it is repaired (docs/cluster.md, \"Store faults\")");
        faults.insert(key, kind);
    }

    /// Forgets the fault of `key`, if any (it was repaired).
    fn clear(&self, key: &str) {
        let Ok(mut faults) = self.faults.lock() else { return };
        if let Some(kind) = faults.remove(key) {
            tracing::info!(key = %key, was = %kind, "store fault repaired");
        }
    }

    /// The faults, in key order.
    fn faults(&self) -> Vec<StoreFault> {
        let Ok(faults) = self.faults.lock() else { return Vec::new() };
        faults.iter().map(|(key, kind)| StoreFault { key: key.clone(), kind: kind.clone() }).collect()
    }

    /// Makes the revision key's fault what `history` found.
    fn history(&self, rev_key: &str, history: &History) {
        match &history.rev_fault {
            Some(kind) => self.fault(rev_key.to_string(), kind.clone()),
            None => self.clear(rev_key),
        }
        if let Some((key, kind)) = &history.log_fault {
            self.fault(key.clone(), kind.clone());
        }
    }

    /// Makes the faults those `load` found, keeping deletes seen on the
    /// watch (a deleted key leaves nothing for `load` to find).
    fn loaded(&self, found: &[StoreFault]) {
        if let Ok(mut faults) = self.faults.lock() {
            faults.retain(|_, kind| matches!(kind, FaultKind::DeletedOutside { .. }));
        }
        for f in found {
            self.fault(f.key.clone(), f.kind.clone());
        }
    }

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

fn text(key: &[u8]) -> String {
    String::from_utf8_lossy(key).into_owned()
}

/// The revision a log key's last part (20 digits) names.
fn log_number(rest: &[u8]) -> Option<u64> {
    if rest.len() != 20 || !rest.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(rest).ok()?.parse().ok()
}

/// Decodes the log entry `kv` whose key names revision `number`.
fn log_entry(kv: &KeyValue, number: u64) -> Result<AppliedChange, FaultKind> {
    let change: AppliedChange =
        tidegate_model::parse_json(&kv.value).map_err(|e| FaultKind::LogUndecodable { error: e.to_string() })?;
    if change.revision != number {
        return Err(FaultKind::LogMisnumbered { expected: number, found: change.revision });
    }
    if kv.version > 1 {
        return Err(FaultKind::LogOverwritten { version: kv.version });
    }
    Ok(change)
}

/// The kinds of keys that hold the configuration's objects.
const OBJECT_KINDS: [&[u8]; 6] = [b"services", b"backends", b"routes", b"certificates", b"rules", b"listeners"];

/// What the revision key and the newest log entry say, read at one etcd
/// revision.
#[derive(Debug, Default)]
struct History {
    /// The etcd revision they were read at.
    etcd_rev: i64,
    /// Tidegate's revision (0 when the key is missing or invalid).
    rev: u64,
    /// What is wrong with the revision key, if anything.
    rev_fault: Option<FaultKind>,
    /// A newest log entry whose key names no revision.
    log_fault: Option<(String, FaultKind)>,
}

/// Reads `rev` and the newest log key under `prefix`, at one etcd
/// revision, and says whether they agree.
async fn check_history(client: &Client, prefix: &[u8]) -> Result<History, StoreError> {
    let rev_key = [prefix, b"rev"].concat();
    let log_prefix = [prefix, b"log/"].concat();
    let (etcd_rev, kv) = client.get(&rev_key).await.map_err(unavailable)?;
    let newest = client.last_in_range(&log_prefix, &prefix_end(&log_prefix), etcd_rev).await.map_err(unavailable)?;
    let mut history = History { etcd_rev, ..History::default() };
    let newest_log = match newest {
        None => None,
        Some(kv) => match log_number(&kv.key[log_prefix.len()..]) {
            Some(n) => Some(n),
            None => {
                let error = "its key does not end in a 20-digit revision".to_string();
                history.log_fault = Some((text(&kv.key), FaultKind::LogUndecodable { error }));
                None
            }
        },
    };
    match kv {
        None => {
            history.rev_fault = newest_log.map(|newest_log| FaultKind::RevMissing { newest_log });
        }
        Some(kv) => match std::str::from_utf8(&kv.value).ok().and_then(|v| v.parse::<u64>().ok()) {
            None => history.rev_fault = Some(FaultKind::RevInvalid { value: text(&kv.value) }),
            Some(rev) => {
                history.rev = rev;
                history.rev_fault =
                    newest_log.filter(|n| *n > rev).map(|newest_log| FaultKind::RevBehindLog { rev, newest_log });
            }
        },
    }
    Ok(history)
}

/// What one watch message says: the change sets it brings and the faults
/// it shows or repairs, in order.
#[derive(Debug, Default, PartialEq)]
struct Seen {
    changes: Vec<AppliedChange>,
    /// `(key, Some(fault))`: a fault; `(key, None)`: the key was repaired.
    faults: Vec<(String, Option<FaultKind>)>,
    /// `rev` or the log changed other than by a commit: read them again.
    recheck: bool,
}

/// Reads the events of one watch message on the whole prefix. A Tidegate
/// commit writes `rev` and its log entries at one etcd revision, with the
/// objects it changes: an object written or deleted at an etcd revision
/// where `rev` was not written, or a log entry written where no commit was,
/// was written by something else.
fn observe(prefix: &[u8], events: &[Event]) -> Seen {
    let rev_key = [prefix, b"rev"].concat();
    let commits: std::collections::BTreeSet<i64> =
        events.iter().filter(|e| e.kind == EventKind::Put && e.kv.key == rev_key).map(|e| e.kv.mod_revision).collect();
    let logged: std::collections::BTreeSet<i64> = events
        .iter()
        .filter(|e| e.kind == EventKind::Put && e.kv.key.starts_with(&[prefix, b"log/"].concat()))
        .map(|e| e.kv.mod_revision)
        .collect();
    let mut seen = Seen::default();
    for e in events {
        let Some(rest) = e.kv.key.strip_prefix(prefix) else { continue };
        let at = e.kv.mod_revision;
        let in_commit = commits.contains(&at);
        let key = text(&e.kv.key);
        let (kind, name) = match rest.iter().position(|b| *b == b'/') {
            Some(i) => (&rest[..i], &rest[i + 1..]),
            None => (rest, &rest[rest.len()..]),
        };
        match (kind, e.kind) {
            // A commit writes it with its log entries; anything else is
            // checked against the log.
            (b"rev", what) => seen.recheck |= !(in_commit && logged.contains(&at) && what == EventKind::Put),
            (b"log", EventKind::Put) => {
                let entry = match log_number(name) {
                    None => {
                        Err(FaultKind::LogUndecodable { error: "its key does not end in a 20-digit revision".into() })
                    }
                    Some(n) => log_entry(&e.kv, n),
                };
                match entry {
                    Ok(change) if in_commit => seen.changes.push(change),
                    Ok(_) => {
                        seen.faults.push((key, Some(FaultKind::WrittenOutside { at })));
                        seen.recheck = true;
                    }
                    Err(fault) => {
                        seen.faults.push((key, Some(fault)));
                        seen.recheck = true;
                    }
                }
            }
            (b"log", EventKind::Delete) => {
                // Trimmed by a commit, or removed by an operator: either
                // way not at fault any more; the newest may have changed.
                seen.faults.push((key, None));
                if !in_commit {
                    seen.recheck = true;
                }
            }
            (kind, what) if OBJECT_KINDS.contains(&kind) => {
                // A value that does not decode is named with its field,
                // however it was written (the data plane follows the log,
                // which decodes the same way, and never takes it).
                let invalid = (what == EventKind::Put)
                    .then(|| object_error(kind, name, &e.kv.value))
                    .flatten()
                    .map(|error| FaultKind::ObjectInvalid { error });
                let fault = match (in_commit, what) {
                    _ if invalid.is_some() => invalid,
                    (true, _) => None,
                    (false, EventKind::Put) => Some(FaultKind::WrittenOutside { at }),
                    (false, EventKind::Delete) => Some(FaultKind::DeletedOutside { at }),
                };
                seen.faults.push((key, fault));
            }
            _ => {} // instance records and leaders
        }
    }
    seen
}

/// Why the object value stored under `kind/name` does not decode, naming
/// the field (or the name) at fault; `None` when it decodes. The same
/// decode as every other door: the model's validated `Deserialize`.
fn object_error(kind: &[u8], name: &[u8], value: &[u8]) -> Option<ObjectError> {
    let Ok(name) = std::str::from_utf8(name) else {
        return Some(ObjectError::Key(NAME_NOT_UTF8));
    };
    fn decodes<T: serde::de::DeserializeOwned>(value: &[u8]) -> Result<(), ObjectError> {
        tidegate_model::parse_json::<T>(value).map(drop).map_err(ObjectError::from)
    }
    let result = match kind {
        b"services" => {
            ServiceName::new(name).map_err(ObjectError::from).and_then(|_| decodes::<ServiceSettings>(value))
        }
        b"backends" => match name.split_once('/') {
            None => Err(ObjectError::Key(BACKEND_KEY)),
            Some((service, id)) => ServiceName::new(service)
                .map(drop)
                .and_then(|()| BackendId::new(id).map(drop))
                .map_err(ObjectError::from)
                .and_then(|()| decodes::<tidegate_model::BackendSpec>(value)),
        },
        b"routes" => RouteName::new(name).map_err(ObjectError::from).and_then(|_| decodes::<RouteSpec>(value)),
        b"rules" => RuleSetName::new(name).map_err(ObjectError::from).and_then(|_| decodes::<RuleSetSpec>(value)),
        b"listeners" => ListenerName::new(name).map_err(ObjectError::from).and_then(|_| decodes::<ListenerSpec>(value)),
        _ => CertName::new(name).map_err(ObjectError::from).and_then(|_| decodes::<CertificateSpec>(value)),
    };
    result.err()
}

/// A fault for an object that does not decode.
fn invalid(e: impl Into<ObjectError>) -> FaultKind {
    FaultKind::ObjectInvalid { error: e.into() }
}

/// An object whose key's name is not UTF-8.
const NAME_NOT_UTF8: &str = "its name is not UTF-8";
/// A backend whose key is not `backends/SERVICE/ID`.
const BACKEND_KEY: &str = "a backend key is backends/SERVICE/ID";

/// Whether `ops` name the object stored at `rest` (a key without the
/// prefix): a write through Tidegate that names an object at fault puts it
/// back.
fn names_object<'a>(ops: impl IntoIterator<Item = &'a Op>, rest: &str) -> bool {
    ops.into_iter().any(|op| match op {
        Op::PutService { name, .. } | Op::DeleteService { name } => {
            rest == format!("services/{name}") || rest.starts_with(&format!("backends/{name}/"))
        }
        Op::PutBackend { service, id, .. } | Op::DeleteBackend { service, id } => {
            rest == format!("backends/{service}/{id}")
        }
        Op::PutRoute { name, .. } | Op::DeleteRoute { name } => rest == format!("routes/{name}"),
        Op::PutCertificate { name, .. }
        | Op::DeleteCertificate { name }
        | Op::RenewCertificate { name }
        | Op::AcmeState { name, .. } => rest == format!("certificates/{name}"),
        Op::PutRules { name, .. } | Op::DeleteRules { name } => rest == format!("rules/{name}"),
        Op::PutListener { name, .. } | Op::DeleteListener { name } => rest == format!("listeners/{name}"),
    })
}

/// What the object stored at `rest` must hold for the configuration to be
/// `after` (`None`: no key), or `Err` for a key that names no object.
fn object_value(rest: &str, after: &ConfigState) -> Result<Option<Vec<u8>>, StoreError> {
    let (kind, name) = rest.split_once('/').unwrap_or((rest, ""));
    match kind {
        "services" => after.service(name).map(|s| json(&s.settings)).transpose(),
        "backends" => {
            let (service, id) = name.split_once('/').unwrap_or((name, ""));
            let id = BackendId::new(id).map_err(corrupt)?;
            after.service(service).and_then(|s| s.backends.get(&id)).map(json).transpose()
        }
        "routes" => after.route(name).map(|r| json(&**r)).transpose(),
        "certificates" => {
            let name = CertName::new(name).map_err(corrupt)?;
            after.certificates().get(&name).map(|c| json(&**c)).transpose()
        }
        "rules" => after.rule_set(name).map(|r| json(&**r)).transpose(),
        "listeners" => after.listener(name).map(|l| json(&**l)).transpose(),
        _ => Err(corrupt(format!("{rest:?} names no object"))),
    }
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
        let prefix = store.url.prefix.clone().into_bytes();
        let history = store.runtime.block_on(check_history(&store.client, &prefix)).map_err(|e| match e {
            StoreError::Unavailable(m) => StoreError::Unavailable(format!("{}: {m}", store.location())),
            other => other,
        })?;
        store.live.history(&text(&store.key("rev")), &history);
        store.live.latest.store(history.rev, Relaxed);
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

    /// Refuses a commit while the store is at fault, unless every fault is
    /// an object's that the commit names (it puts them back): their keys,
    /// without the prefix, to write from the configuration after it.
    fn repairs(&self, commit: &Commit<'_>) -> Result<Vec<String>, StoreError> {
        let mut repairs = Vec::new();
        for fault in self.live.faults() {
            let rest = fault.key.strip_prefix(&self.url.prefix).unwrap_or(&fault.key);
            let ops = commit.changes.iter().flat_map(|c| &c.change.ops);
            if fault.kind.is_history() || !names_object(ops, rest) {
                return Err(StoreError::Fault(fault));
            }
            repairs.push(rest.to_string());
        }
        Ok(repairs)
    }

    /// Replaces whatever is under the prefix with `state` at `revision`,
    /// with no history (`tidegate store copy`). Refuses a prefix that
    /// already holds a configuration.
    pub fn import(&self, state: &ConfigState, revision: u64) -> Result<(), StoreError> {
        let empty = ConfigState::default();
        let mut ops = vec![TxnOp::Put { key: self.key("rev"), value: revision.to_string().into_bytes(), lease: 0 }];
        let all: Vec<_> = state.services().keys().map(|n| Op::DeleteService { name: n.clone() }).collect();
        self.object_writes(&all, &empty, state, &[], &mut ops)?;
        let routes: Vec<_> = state.routes().keys().map(|n| Op::DeleteRoute { name: n.clone() }).collect();
        self.object_writes(&routes, &empty, state, &[], &mut ops)?;
        let certs: Vec<_> = state.certificates().keys().map(|n| Op::DeleteCertificate { name: n.clone() }).collect();
        self.object_writes(&certs, &empty, state, &[], &mut ops)?;
        let rules: Vec<_> = state.rules().keys().map(|n| Op::DeleteRules { name: n.clone() }).collect();
        self.object_writes(&rules, &empty, state, &[], &mut ops)?;
        let listeners: Vec<_> = state.listeners().keys().map(|n| Op::DeleteListener { name: n.clone() }).collect();
        self.object_writes(&listeners, &empty, state, &[], &mut ops)?;
        let guard = [Compare::Absent(self.key("rev"))];
        let outcome = self.runtime.block_on(self.client.txn(&guard, &ops)).map_err(unavailable)?;
        if !outcome.succeeded {
            return Err(StoreError::NotEmpty { location: self.location() });
        }
        Ok(())
    }

    /// The writes that make the objects `ops` touched equal to `after`,
    /// and the keys `repair` (without the prefix) too.
    fn object_writes<'a>(
        &self,
        ops: impl IntoIterator<Item = &'a Op>,
        before: &ConfigState,
        after: &ConfigState,
        repair: &[String],
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
                Op::PutCertificate { name, .. }
                | Op::DeleteCertificate { name }
                | Op::RenewCertificate { name }
                | Op::AcmeState { name, .. } => {
                    let spec = after.certificates().get(name);
                    writes.insert(self.key(&format!("certificates/{name}")), spec.map(|s| json(&**s)).transpose()?);
                }
                // As the configuration holds it: a hash given as the
                // placeholder is the one kept.
                Op::PutRules { name, .. } | Op::DeleteRules { name } => {
                    let spec = after.rules().get(name);
                    writes.insert(self.key(&format!("rules/{name}")), spec.map(|s| json(&**s)).transpose()?);
                }
                Op::PutListener { name, .. } | Op::DeleteListener { name } => {
                    let spec = after.listeners().get(name);
                    writes.insert(self.key(&format!("listeners/{name}")), spec.map(|s| json(&**s)).transpose()?);
                }
            }
        }
        for rest in repair {
            writes.insert(self.key(rest), object_value(rest, after)?);
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
            StoreError::Fault(StoreFault { key: text(key), kind: FaultKind::RevInvalid { value: text(&kv.value) } })
        })?,
    };
    Ok((etcd_rev, rev))
}

impl Store for EtcdStore {
    fn load(&self) -> Result<Loaded, StoreError> {
        let range = self.runtime.block_on(async {
            // Everything at one etcd revision: the whole prefix is one range.
            let prefix = self.url.prefix.as_bytes();
            self.client.range(prefix, Some(&prefix_end(prefix))).await.map_err(unavailable)
        })?;
        let (loaded, faults) = check_load(self.url.prefix.as_bytes(), &range.kvs);
        self.live.loaded(&faults);
        if let Some(first) = faults.into_iter().next() {
            return Err(StoreError::Fault(first));
        }
        self.live.latest.fetch_max(loaded.revision, Relaxed);
        Ok(loaded)
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
        let repairs = self.repairs(commit)?;
        let all_ops = commit.changes.iter().flat_map(|c| &c.change.ops);
        let mut ops = Vec::with_capacity(commit.changes.len() * 2 + 2);
        self.object_writes(all_ops, commit.before, commit.after, &repairs, &mut ops)?;
        // No log entry is ever overwritten: each is created, or nothing is.
        let mut guards = vec![guard];
        for c in commit.changes {
            guards.push(Compare::Absent(self.log_key(c.revision)));
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
        let outcome = self.runtime.block_on(self.client.txn(&guards, &ops)).map_err(unavailable)?;
        if !outcome.succeeded {
            // Another instance committed first, or `rev` and the log
            // disagree (a log key above `rev` exists): only the first is
            // worth building again.
            let prefix = self.url.prefix.as_bytes();
            let history = self.runtime.block_on(check_history(&self.client, prefix))?;
            let rev_key = text(&self.key("rev"));
            self.live.history(&rev_key, &history);
            if let Some(kind) = history.rev_fault {
                return Err(StoreError::Fault(StoreFault { key: rev_key, kind }));
            }
            return Err(StoreError::Conflict { base: commit.base });
        }
        for rest in &repairs {
            self.live.clear(&text(&self.key(rest)));
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
        let kept_keys = change
            .ops
            .iter()
            .filter(|op| match op {
                Op::PutCertificate { spec, .. } => spec.keeps_key(),
                Op::PutRules { spec, .. } => !spec.kept_hashes().is_empty(),
                _ => false,
            })
            .count();
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
            let log_prefix = self.key("log/");
            for (expected, kv) in (after + 1..).zip(&range.kvs) {
                let fault = |kind: FaultKind| {
                    let fault = StoreFault { key: text(&kv.key), kind };
                    self.live.fault(fault.key.clone(), fault.kind.clone());
                    StoreError::Fault(fault)
                };
                let number = log_number(&kv.key[log_prefix.len().min(kv.key.len())..]).ok_or_else(|| {
                    fault(FaultKind::LogUndecodable { error: "its key does not end in a 20-digit revision".into() })
                })?;
                if number != expected {
                    // Trimmed: the history asked for is gone.
                    return Err(StoreError::Compacted { oldest: number });
                }
                out.push(log_entry(kv, number).map_err(fault)?);
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
        let prefix = self.url.prefix.clone().into_bytes();
        self.runtime.spawn(follow_log(client.clone(), prefix, live.clone(), hooks.clone()));
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
            faults: self.live.faults(),
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

    fn lease(&self) -> Option<i64> {
        self.live.valid_lease()
    }

    fn adopt_lease(&self, id: i64) {
        // Not valid until this process renewed it (the heartbeat's first
        // keep-alive, within a second): until then it leads nothing.
        if let Ok(mut l) = self.live.lease.lock() {
            *l = Some((id, Instant::now()));
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

/// Follows the store for as long as the process lives: checks `rev`
/// against the log, wakes the writer (which catches up from what it has
/// applied), then watches the whole prefix from there, keeping the change
/// sets it brings for the writer (so following another instance costs no
/// read) and noting faults ([`observe`]). After any break it starts again
/// (backing off to 2 s), from where the watch left off when etcd still has
/// it, so nothing written meanwhile goes unseen.
async fn follow_log(client: Client, prefix: Vec<u8>, live: Arc<Live>, hooks: Arc<Follow>) {
    let mut backoff = Duration::from_millis(100);
    let end = prefix_end(&prefix);
    let rev_key = text(&[&prefix[..], b"rev"].concat());
    // The etcd revision the next watch starts from, once one has run.
    let mut resume: Option<i64> = None;
    loop {
        match check_history(&client, &prefix).await {
            Ok(history) => {
                live.history(&rev_key, &history);
                live.latest.fetch_max(history.rev, Relaxed);
                (hooks.wake)();
                let start = resume.unwrap_or(history.etcd_rev + 1);
                match client.watch(&prefix, Some(&end), start).await {
                    Ok(mut watch) => {
                        live.ok();
                        backoff = Duration::from_millis(100);
                        resume = Some(start);
                        loop {
                            match watch.next().await {
                                Ok(Some(message)) => {
                                    if message.compact_revision > 0 {
                                        // etcd no longer has where the watch
                                        // was to start: start from now.
                                        resume = None;
                                    } else if let Some(last) = message.events.iter().map(|e| e.kv.mod_revision).max() {
                                        // Every event of a revision comes in
                                        // one message: the next is newer.
                                        resume = Some(last + 1);
                                    }
                                    let seen = observe(&prefix, &message.events);
                                    let applied = (hooks.applied)();
                                    let mut newest = 0;
                                    for change in seen.changes {
                                        newest = newest.max(change.revision);
                                        if change.revision > applied {
                                            live.keep(change, applied);
                                        }
                                    }
                                    for (key, fault) in seen.faults {
                                        match fault {
                                            Some(kind) => live.fault(key, kind),
                                            None => live.clear(&key),
                                        }
                                    }
                                    if seen.recheck {
                                        match check_history(&client, &prefix).await {
                                            Ok(history) => live.history(&rev_key, &history),
                                            Err(e) => {
                                                live.failed(&e);
                                                break;
                                            }
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

/// Reads the configuration from the keys of the whole prefix (read at one
/// etcd revision), with every fault they show (see [`observe`] for how a
/// write from elsewhere is told from a commit's).
fn check_load(prefix: &[u8], kvs: &[KeyValue]) -> (Loaded, Vec<StoreFault>) {
    let mut faults = Vec::new();
    let mut fault = |key: &[u8], kind: FaultKind| {
        if faults.len() < MAX_FAULTS {
            faults.push(StoreFault { key: text(key), kind });
        }
    };
    let mut rev_kv = None;
    let mut log_mods = std::collections::BTreeSet::new();
    let mut newest_log: Option<u64> = None;
    let mut objects = Vec::new();
    for kv in kvs {
        let Some(rest) = kv.key.strip_prefix(prefix) else { continue };
        let (kind, name) = match rest.iter().position(|b| *b == b'/') {
            Some(i) => (&rest[..i], &rest[i + 1..]),
            None => (rest, &rest[rest.len()..]),
        };
        match kind {
            b"rev" => rev_kv = Some(kv),
            b"log" => match log_number(name) {
                None => {
                    let error = "its key does not end in a 20-digit revision".into();
                    fault(&kv.key, FaultKind::LogUndecodable { error })
                }
                Some(n) => {
                    log_mods.insert(kv.mod_revision);
                    newest_log = newest_log.max(Some(n));
                    if let Err(kind) = log_entry(kv, n) {
                        fault(&kv.key, kind);
                    }
                }
            },
            kind if OBJECT_KINDS.contains(&kind) => objects.push((kind, name, kv)),
            _ => {} // instance records, leaders
        }
    }
    let rev_key = [prefix, b"rev"].concat();
    let revision = match rev_kv {
        None => {
            if let Some(newest_log) = newest_log {
                fault(&rev_key, FaultKind::RevMissing { newest_log });
            }
            0
        }
        Some(kv) => match std::str::from_utf8(&kv.value).ok().and_then(|v| v.parse::<u64>().ok()) {
            None => {
                fault(&rev_key, FaultKind::RevInvalid { value: text(&kv.value) });
                0
            }
            Some(rev) => {
                if let Some(newest_log) = newest_log.filter(|n| *n > rev) {
                    fault(&rev_key, FaultKind::RevBehindLog { rev, newest_log });
                }
                rev
            }
        },
    };
    // The etcd revisions of Tidegate's commits still known: the log's and
    // the last one's (which wrote `rev`). An object last written at another
    // revision after the oldest of them was written by something else;
    // older than that, the history no longer tells.
    let rev_mod = rev_kv.map(|kv| kv.mod_revision);
    let floor = log_mods.first().copied().or(rev_mod);
    let mut services: BTreeMap<String, ServiceSpec> = BTreeMap::new();
    let mut keys: BTreeMap<String, &[u8]> = BTreeMap::new();
    let mut routes = Vec::new();
    let mut certificates = Vec::new();
    let mut rules = Vec::new();
    let mut listeners = Vec::new();
    let mut backends = Vec::new();
    for (kind, name, kv) in objects {
        let at = kv.mod_revision;
        if !log_mods.contains(&at) && rev_mod != Some(at) && floor.is_none_or(|f| at > f) {
            // Named by its field when it does not even validate.
            let kind = match object_error(kind, name, &kv.value) {
                Some(error) => FaultKind::ObjectInvalid { error },
                None => FaultKind::WrittenOutside { at },
            };
            fault(&kv.key, kind);
            continue;
        }
        let Ok(name) = std::str::from_utf8(name) else {
            fault(&kv.key, FaultKind::ObjectInvalid { error: ObjectError::Key(NAME_NOT_UTF8) });
            continue;
        };
        match kind {
            b"services" => match tidegate_model::parse_json::<ServiceSettings>(&kv.value) {
                Ok(settings) => {
                    services.insert(name.to_string(), ServiceSpec { settings, backends: Default::default() });
                    keys.insert(format!("s/{name}"), &kv.key);
                }
                Err(e) => fault(&kv.key, invalid(e)),
            },
            b"backends" => backends.push((name, kv)),
            b"routes" => match tidegate_model::parse_json::<RouteSpec>(&kv.value).map_err(invalid).and_then(|spec| {
                Ok(Op::PutRoute { name: RouteName::new(name).map_err(invalid)?, spec: Box::new(spec) })
            }) {
                Ok(op) => {
                    routes.push(op);
                    keys.insert(format!("r/{name}"), &kv.key);
                }
                Err(kind) => fault(&kv.key, kind),
            },
            b"rules" => {
                match tidegate_model::parse_json::<RuleSetSpec>(&kv.value).map_err(invalid).and_then(|spec| {
                    Ok(Op::PutRules { name: RuleSetName::new(name).map_err(invalid)?, spec: Box::new(spec) })
                }) {
                    Ok(op) => {
                        rules.push(op);
                        keys.insert(format!("u/{name}"), &kv.key);
                    }
                    Err(kind) => fault(&kv.key, kind),
                }
            }
            b"listeners" => {
                match tidegate_model::parse_json::<ListenerSpec>(&kv.value)
                    .map_err(invalid)
                    .and_then(|spec| Ok(Op::PutListener { name: ListenerName::new(name).map_err(invalid)?, spec }))
                {
                    Ok(op) => {
                        listeners.push(op);
                        keys.insert(format!("l/{name}"), &kv.key);
                    }
                    Err(kind) => fault(&kv.key, kind),
                }
            }
            _ => {
                // An expired certificate still loads (see the embedded store).
                let op = tidegate_model::parse_json::<CertificateSpec>(&kv.value).map_err(invalid).and_then(|spec| {
                    let name = CertName::new(name).map_err(invalid)?;
                    Ok(Op::PutCertificate { name, spec: Box::new(CertificateInput::Whole(spec)) })
                });
                match op {
                    Ok(op) => {
                        certificates.push(op);
                        keys.insert(format!("c/{name}"), &kv.key);
                    }
                    Err(kind) => fault(&kv.key, kind),
                }
            }
        }
    }
    for (name, kv) in backends {
        let Some((service, id)) = name.split_once('/') else {
            fault(&kv.key, FaultKind::ObjectInvalid { error: ObjectError::Key(BACKEND_KEY) });
            continue;
        };
        // A backend whose service is gone cannot be written; skip it
        // rather than refuse to start.
        if let Some(spec) = services.get_mut(service) {
            let backend = BackendId::new(id)
                .map_err(ObjectError::from)
                .and_then(|id| tidegate_model::parse_json(&kv.value).map(|b| (id, b)).map_err(ObjectError::from));
            match backend {
                Ok((id, b)) => {
                    spec.backends.insert(id, b);
                }
                Err(error) => fault(&kv.key, FaultKind::ObjectInvalid { error }),
            }
        }
    }
    let mut ops = Vec::with_capacity(services.len() + routes.len() + certificates.len());
    let mut op_keys = Vec::with_capacity(ops.capacity());
    for (name, spec) in services {
        let key = keys.get(&format!("s/{name}")).copied().unwrap_or(prefix);
        match ServiceName::new(&name) {
            Ok(name) => {
                ops.push(Op::PutService { name, spec: Box::new(spec) });
                op_keys.push(key);
            }
            Err(e) => fault(key, FaultKind::ObjectInvalid { error: e.into() }),
        }
    }
    // Rule sets and listeners before the routes that use them.
    for op in rules.into_iter().chain(listeners).chain(routes).chain(certificates) {
        let key = match &op {
            Op::PutRules { name, .. } => keys.get(&format!("u/{name}")),
            Op::PutListener { name, .. } => keys.get(&format!("l/{name}")),
            Op::PutRoute { name, .. } => keys.get(&format!("r/{name}")),
            Op::PutCertificate { name, .. } => keys.get(&format!("c/{name}")),
            _ => None,
        };
        op_keys.push(key.copied().unwrap_or(prefix));
        ops.push(op);
    }
    let state = match ConfigState::default().apply(&ChangeSet { if_revision: None, ops }, 0) {
        Ok((state, _)) => state,
        Err(e) => {
            let key = e.op.and_then(|i| op_keys.get(i)).copied().unwrap_or(prefix);
            fault(key, FaultKind::ObjectInvalid { error: ObjectError::conflict(&e) });
            ConfigState::default()
        }
    };
    (Loaded { state, revision }, faults)
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
            let records: Vec<InstanceRecord> =
                range.kvs.iter().filter_map(|kv| serde_json::from_slice(&kv.value).ok()).collect();
            (hooks.instances)(records.len());
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

    fn kv(key: &str, value: &str, mod_revision: i64) -> KeyValue {
        KeyValue {
            key: key.as_bytes().to_vec(),
            value: value.as_bytes().to_vec(),
            mod_revision,
            create_revision: mod_revision,
            version: 1,
            lease: 0,
        }
    }

    fn put(key: &str, value: &str, at: i64) -> Event {
        Event { kind: EventKind::Put, kv: kv(key, value, at) }
    }

    fn log(revision: u64, at: i64) -> KeyValue {
        let change = serde_json::to_string(&change(revision)).unwrap();
        kv(&format!("tg/log/{revision:020}"), &change, at)
    }

    fn kinds(faults: &[StoreFault]) -> Vec<(String, &'static str)> {
        faults.iter().map(|f| (f.key.clone(), f.kind.code())).collect()
    }

    /// A store as Tidegate leaves it: service `s` and route `r` written by
    /// revision 1 (etcd revision 10), backend `s/a` by revision 2 (11).
    fn committed() -> Vec<KeyValue> {
        vec![
            kv("tg/backends/s/a", r#"{"addr":"127.0.0.1:1"}"#, 11),
            kv("tg/instances/x", "{}", 30),
            log(1, 10),
            log(2, 11),
            kv("tg/rev", "2", 11),
            kv("tg/routes/r", r#"{"match":{"path_prefix":"/"},"service":"s"}"#, 10),
            kv("tg/services/s", "{}", 10),
        ]
    }

    #[test]
    fn rule_sets_load_before_the_routes_that_run_them_and_are_checked() {
        let mut kvs = committed();
        // An empty set (a route may run one).
        kvs.push(kv("tg/rules/api", r#"{"steps":[]}"#, 10));
        kvs.retain(|kv| kv.key != b"tg/routes/r");
        kvs.push(kv("tg/routes/r", r#"{"match":{"path_prefix":"/"},"service":"s","rules":["api"]}"#, 10));
        let (loaded, faults) = check_load(b"tg/", &kvs);
        assert!(faults.is_empty(), "{faults:?}");
        assert!(loaded.state.rule_set("api").is_some());
        let mut bad = committed();
        bad.push(kv("tg/rules/api", r#"{"steps":[{"kind":"rewrite_path","regex":"(","replacement":"/"}]}"#, 10));
        let (_, faults) = check_load(b"tg/", &bad);
        assert_eq!(kinds(&faults), vec![("tg/rules/api".to_string(), "object_invalid")]);
        assert!(faults[0].to_string().contains("steps[0].regex"), "{}", faults[0]);
    }

    #[test]
    fn a_store_as_tidegate_left_it_loads_without_faults() {
        let (loaded, faults) = check_load(b"tg/", &committed());
        assert!(faults.is_empty(), "{faults:?}");
        assert_eq!(loaded.revision, 2);
        assert_eq!(loaded.state.service("s").map(|s| s.backends.len()), Some(1));
        assert!(loaded.state.route("r").is_some());
    }

    #[test]
    fn states_tidegate_never_leaves_are_faults_naming_the_key() {
        let with = |change: &dyn Fn(&mut Vec<KeyValue>)| {
            let mut kvs = committed();
            change(&mut kvs);
            kvs.sort_by(|a, b| a.key.cmp(&b.key));
            kinds(&check_load(b"tg/", &kvs).1)
        };
        fn rev(v: &'static str) -> impl Fn(&mut Vec<KeyValue>) {
            move |kvs| kvs.iter_mut().filter(|k| k.key == b"tg/rev").for_each(|k| k.value = v.as_bytes().to_vec())
        }
        assert_eq!(with(&rev("1")), [("tg/rev".to_string(), "rev_behind_log")]);
        assert_eq!(with(&rev("two")), [("tg/rev".to_string(), "rev_invalid")]);
        assert_eq!(with(&|kvs| kvs.retain(|k| k.key != b"tg/rev")), [("tg/rev".to_string(), "rev_missing")]);
        assert_eq!(with(&rev("9")), [], "ahead of the log is an import's state");
        let log_key = "tg/log/00000000000000000002".to_string();
        let broken = |kvs: &mut Vec<KeyValue>| {
            kvs.iter_mut()
                .filter(|k| k.key.starts_with(b"tg/log/00000000000000000002"))
                .for_each(|k| k.value = b"{oops".to_vec())
        };
        assert_eq!(with(&broken), [(log_key.clone(), "log_undecodable")]);
        let renumbered = |kvs: &mut Vec<KeyValue>| {
            kvs.iter_mut()
                .filter(|k| k.key == b"tg/log/00000000000000000002")
                .for_each(|k| *k = KeyValue { key: k.key.clone(), ..log(5, 11) })
        };
        assert_eq!(with(&renumbered), [(log_key.clone(), "log_misnumbered")]);
        let overwritten = |kvs: &mut Vec<KeyValue>| {
            kvs.iter_mut().filter(|k| k.key == b"tg/log/00000000000000000002").for_each(|k| k.version = 2)
        };
        assert_eq!(with(&overwritten), [(log_key, "log_overwritten")]);
        // Edited in etcd: a newer etcd revision than any commit.
        let edited = |kvs: &mut Vec<KeyValue>| {
            kvs.iter_mut().filter(|k| k.key == b"tg/backends/s/a").for_each(|k| {
                k.value = br#"{"addr":"10.0.0.9:1"}"#.to_vec();
                k.mod_revision = 12
            })
        };
        assert_eq!(with(&edited), [("tg/backends/s/a".to_string(), "written_outside")]);
        // Edited between two commits: no log entry at its etcd revision.
        let between = |kvs: &mut Vec<KeyValue>| {
            kvs.iter_mut().filter(|k| k.key == b"tg/routes/r").for_each(|k| k.mod_revision = 10);
            kvs.iter_mut().filter(|k| k.key == b"tg/services/s").for_each(|k| k.mod_revision = 10);
            kvs.iter_mut().filter(|k| k.key == b"tg/backends/s/a").for_each(|k| k.mod_revision = 11);
            kvs.push(kv("tg/routes/x", r#"{"match":{"path_prefix":"/x"},"service":"s"}"#, 9));
            kvs.iter_mut().filter(|k| k.key == b"tg/routes/x").for_each(|k| k.mod_revision = 10);
            kvs.push(kv("tg/routes/y", r#"{"match":{"path_prefix":"/y"},"service":"s"}"#, 10));
            kvs.iter_mut().filter(|k| k.key == b"tg/routes/y").for_each(|k| k.mod_revision = 10);
        };
        assert_eq!(with(&between), [], "written by the commits");
        let undecodable = |kvs: &mut Vec<KeyValue>| {
            kvs.iter_mut().filter(|k| k.key == b"tg/services/s").for_each(|k| k.value = b"\"oops\"".to_vec())
        };
        let found = with(&undecodable);
        assert_eq!(found[0], ("tg/services/s".to_string(), "object_invalid"), "{found:?}");
        // The route to the service that did not load is named too.
        assert!(found.contains(&("tg/routes/r".to_string(), "object_invalid")), "{found:?}");
    }

    #[test]
    fn the_watch_tells_commits_from_writes_made_elsewhere() {
        let commit = [
            put("tg/backends/s/b", r#"{"addr":"127.0.0.1:2"}"#, 20),
            put("tg/log/00000000000000000003", &serde_json::to_string(&change(3)).unwrap(), 20),
            put("tg/rev", "3", 20),
        ];
        let seen = observe(b"tg/", &commit);
        assert_eq!(seen.changes.len(), 1);
        assert_eq!(seen.faults, [("tg/backends/s/b".to_string(), None)], "a commit repairs what it writes");
        assert!(!seen.recheck);

        let elsewhere = [
            put("tg/routes/r", r#"{"match":{"path_prefix":"/"},"service":"s"}"#, 21),
            Event { kind: EventKind::Delete, kv: kv("tg/services/t", "", 22) },
            put("tg/instances/x", "{}", 23),
        ];
        let seen = observe(b"tg/", &elsewhere);
        assert_eq!(
            seen.faults,
            [
                ("tg/routes/r".to_string(), Some(FaultKind::WrittenOutside { at: 21 })),
                ("tg/services/t".to_string(), Some(FaultKind::DeletedOutside { at: 22 })),
            ]
        );
        assert!(!seen.recheck);

        // `rev` set by hand, a log entry that is not a change set: checked again.
        assert!(observe(b"tg/", &[put("tg/rev", "1", 24)]).recheck);
        let seen = observe(b"tg/", &[put("tg/log/00000000000000000004", "garbage", 25)]);
        assert!(seen.recheck);
        assert_eq!(seen.faults[0].1.as_ref().map(FaultKind::code), Some("log_undecodable"));
        assert!(seen.changes.is_empty());
    }

    /// A value that does not validate, written under the prefix by anyone
    /// (with a commit's `rev` or without), is a fault naming its key and
    /// field, found by the same decode on the watch as at load.
    #[test]
    fn invalid_objects_are_faults_naming_the_key_and_field() {
        let cases = [
            ("tg/services/s", r#"{"timeouts":{"connect_ms":0}}"#, "timeouts.connect_ms"),
            ("tg/services/s", r#"{"retries":11}"#, "retries"),
            ("tg/backends/s/a", r#"{"addr":"nope"}"#, "addr"),
            ("tg/backends/s/a", r#"{"addr":"127.0.0.1:1","weight":10001}"#, "weight"),
            ("tg/routes/r", r#"{"match":{"path_prefix":"api"},"service":"s"}"#, "match.path_prefix"),
        ];
        for (key, value, field) in cases {
            for in_commit in [false, true] {
                let mut events = vec![put(key, value, 30)];
                if in_commit {
                    events.push(put("tg/log/00000000000000000003", &serde_json::to_string(&change(3)).unwrap(), 30));
                    events.push(put("tg/rev", "3", 30));
                }
                let seen = observe(b"tg/", &events);
                let fault = seen.faults.iter().find(|(k, _)| k == key).and_then(|(_, f)| f.clone());
                match fault {
                    Some(FaultKind::ObjectInvalid { error }) => {
                        assert_eq!(error.field(), Some(field), "{key} {value}: {error}");
                        assert!(error.to_string().starts_with(&format!("{field}: ")), "{key} {value}: {error}")
                    }
                    other => panic!("{key} {value}: {other:?}"),
                }
            }
            // At load: the same fault, and the instance does not start.
            let mut kvs = committed();
            kvs.retain(|k| k.key != key.as_bytes());
            kvs.push(kv(key, value, 10));
            kvs.sort_by(|a, b| a.key.cmp(&b.key));
            let (_, faults) = check_load(b"tg/", &kvs);
            let first = faults.iter().find(|f| f.key == key).unwrap_or_else(|| panic!("{key}: {faults:?}"));
            assert_eq!(first.kind.code(), "object_invalid");
            assert!(first.to_string().contains(&format!("{key}: the stored object is invalid: {field}: ")), "{first}");
        }
        // A forged commit (`rev` and a log entry) whose change set does not
        // validate: the change set is refused, naming its field.
        let forged = r#"{"revision":3,"change":{"ops":[{"op":"put_service","name":"s","spec":{"retries":11}}]}}"#;
        let seen = observe(b"tg/", &[put("tg/log/00000000000000000003", forged, 31), put("tg/rev", "3", 31)]);
        assert!(seen.changes.is_empty(), "never applied");
        match &seen.faults[..] {
            [(key, Some(FaultKind::LogUndecodable { error }))] => {
                assert_eq!(key, "tg/log/00000000000000000003");
                assert!(error.starts_with("change.ops[0].spec.retries: must be 0..=10"), "{error}");
            }
            other => panic!("{other:?}"),
        }
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
