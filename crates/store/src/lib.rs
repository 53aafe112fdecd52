//! Tidegate's durable configuration store.
//!
//! [`Store`] is the seam between the writer and durable storage: load the
//! configuration at startup, commit a group of applied change sets in one
//! durable transaction, and replay recent change sets to watchers.
//! [`SqliteStore`] is the embedded default, on SQLite in WAL mode with
//! `synchronous=FULL` (one sync of the write-ahead log per commit);
//! [`RedbStore`], on redb, was the default before and is still read to
//! take over an existing data directory. With both, a commit returns only
//! once it is on disk, so an acknowledged change survives `kill -9` and
//! power loss.
//!
//! [`EtcdStore`] is cluster mode: the configuration lives in etcd, shared by
//! every Tidegate pointed at the same prefix. A commit is one etcd
//! transaction guarded by the revision the writer built it on, so two
//! instances never both build on one revision; [`Store::follow`] tells the
//! writer when another instance moved the revision on.

mod etcd_store;
mod redb_store;
mod sqlite_store;
#[cfg(test)]
mod suite;

use tidegate_model::{
    CertName, CertificateSpec, ChangeSet, ConfigState, RuleSetName, RuleSetSpec, ServiceName, ServiceSpec,
};

pub use etcd_store::{EtcdAccess, EtcdStore, EtcdUrl};
pub use redb_store::RedbStore;
pub use sqlite_store::SqliteStore;
pub use tidegate_etcd::{Credentials as EtcdCredentials, TlsOptions as EtcdTls};

/// How many change sets the log keeps for replay.
pub(crate) const LOG_RETAIN: u64 = 10_000;

/// A change set as applied, with the revision it produced.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AppliedChange {
    /// The revision this change set produced.
    pub revision: u64,
    /// The change set (as submitted).
    pub change: ChangeSet,
}

/// The configuration as stored.
#[derive(Debug, Clone, Default)]
pub struct Loaded {
    /// The configuration.
    pub state: ConfigState,
    /// Its revision (0 for an empty store).
    pub revision: u64,
}

/// Errors of a store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database failed (I/O, corruption, ...): the engine's own
    /// message, which no caller acts on beyond showing it.
    #[error("storage error: {0}")]
    Backend(String),
    /// The database file is locked by another process: another Tidegate
    /// uses the data directory.
    #[error("storage error: {path}: {detail} (is another Tidegate using this data directory?)")]
    Locked {
        /// The database file.
        path: String,
        /// What the database said.
        detail: String,
    },
    /// The embedded store was closed to hand it over to a new process
    /// (`tidegate serve --takeover`); that process writes it now.
    #[error("storage error: {path} was handed over to a new Tidegate process, which writes it now; try again")]
    Released {
        /// The database file.
        path: String,
    },
    /// The store does not keep this kind of object (the redb store and
    /// certificates).
    #[error("storage error: {0}")]
    Unsupported(&'static str),
    /// A copy's target already holds a configuration.
    #[error("storage error: {location} already holds a configuration; copy into an empty prefix")]
    NotEmpty {
        /// The target store.
        location: String,
    },
    /// An existing database file that is not a store: empty, or without
    /// the store's tables. Refused at start rather than served as an empty
    /// configuration.
    #[error(
        "{path} {what}: refusing to serve it as an empty configuration (restore it from a backup; to start empty on purpose, move it and its -wal file away)"
    )]
    NoSchema {
        /// The file.
        path: String,
        /// What is wrong with it.
        what: String,
    },
    /// A row of the embedded store whose checksum does not match it: it
    /// was changed outside Tidegate, or damaged on disk.
    #[error(
        "{path}: the {table} row {key:?} does not match its checksum: it was changed outside Tidegate or damaged on disk (restore the file from a backup)"
    )]
    Damaged {
        /// The database file.
        path: String,
        /// The table.
        table: &'static str,
        /// The row's key (`SERVICE/ID` for a backend).
        key: String,
    },
    /// Stored data could not be decoded.
    #[error("stored configuration is invalid: {0}")]
    Corrupt(String),
    /// A stored object that does not decode through the model's validated
    /// path, or does not fit the rest of the configuration: the instance
    /// does not start on it.
    #[error(
        "the stored object {key} is invalid: {error}; Tidegate does not start on a configuration that does not validate (restore the store from a backup)"
    )]
    Invalid {
        /// The object's key, `services/NAME`, `backends/SERVICE/ID`,
        /// `routes/NAME`, `certificates/NAME` or `rules/NAME`.
        key: String,
        /// What is wrong with it, naming the field at fault.
        error: ObjectError,
    },
    /// Another instance committed first: the revision the group was built
    /// on is no longer the newest. Nothing was written.
    #[error("another instance changed the configuration first (the newest revision is no longer {base})")]
    Conflict {
        /// The revision the refused group was built on.
        base: u64,
    },
    /// The store cannot be reached (shared stores). Nothing is known to be
    /// written: the outcome of the last commit may be unknown.
    #[error("the configuration store is unavailable: {0}")]
    Unavailable(String),
    /// The store holds a state Tidegate never writes (cluster mode: a key
    /// changed in etcd by something else). Nothing was written.
    #[error(
        "store fault: {0}; Tidegate did not write this and builds nothing on it until it is repaired (see docs/cluster.md, \"Store faults\")"
    )]
    Fault(StoreFault),
    /// The store refuses a commit this large.
    #[error("{0}")]
    TooLarge(String),
    /// The requested history is no longer retained.
    #[error("change history before revision {oldest} is no longer kept")]
    Compacted {
        /// The oldest revision still replayable.
        oldest: u64,
    },
}

/// A key of a shared store in a state Tidegate never leaves it in: the
/// store cannot be trusted until an operator repairs it (docs/cluster.md,
/// "Store faults"). While there is one, `/readyz` answers 503, `/v1/status`
/// and `/metrics` name the key, and writes are refused with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {kind}")]
pub struct StoreFault {
    /// The key at fault, in full (etcd: with its prefix).
    pub key: String,
    /// What is wrong with it.
    pub kind: FaultKind,
}

impl serde::Serialize for StoreFault {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut st = s.serialize_struct("StoreFault", 3)?;
        st.serialize_field("key", &self.key)?;
        st.serialize_field("kind", self.kind.code())?;
        st.serialize_field("message", &self.kind.to_string())?;
        st.end()
    }
}

/// Why a stored object (a service, backend, route or certificate) is
/// refused: its key, its value, or how it fits the rest.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ObjectError {
    /// The name in its key is not a valid name.
    #[error(transparent)]
    Name(#[from] tidegate_model::NameError),
    /// Its key is not one Tidegate writes.
    #[error("{0}")]
    Key(&'static str),
    /// Its value does not decode through the model's validated path.
    #[error(transparent)]
    Decode(#[from] tidegate_model::ParseError),
    /// It does not fit the rest of the configuration (a route whose
    /// service is missing, two default certificates).
    #[error("{}{message}", .field.as_ref().map(|f| format!("{f}: ")).unwrap_or_default())]
    Conflict {
        /// The field at fault, as a field of the object (`service`).
        field: Option<String>,
        /// What is wrong.
        message: String,
    },
}

impl ObjectError {
    /// The field of the object at fault, when one is.
    pub fn field(&self) -> Option<&str> {
        match self {
            ObjectError::Decode(e) => Some(e.field.as_str()),
            ObjectError::Conflict { field, .. } => field.as_deref(),
            ObjectError::Name(_) | ObjectError::Key(_) => None,
        }
    }

    /// A change set's refusal (`ops[N].spec.FIELD`) as the refusal of the
    /// object the op stands for.
    pub(crate) fn conflict(e: &tidegate_model::ChangeError) -> ObjectError {
        ObjectError::Conflict { field: e.field.as_deref().map(|f| op_field(f).to_string()), message: e.message.clone() }
    }
}

/// What is wrong with a key at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FaultKind {
    /// The revision key does not hold a revision.
    #[error("the revision key holds {value:?}, not a revision")]
    RevInvalid {
        /// What it holds.
        value: String,
    },
    /// The revision key is gone while the log holds change sets.
    #[error("the revision key is missing, but the log holds change sets up to revision {newest_log}")]
    RevMissing {
        /// The newest revision in the log.
        newest_log: u64,
    },
    /// The revision key is lower than the newest change set in the log
    /// (as after restoring an older etcd snapshot of part of the keys).
    #[error("the revision key says {rev}, but the log holds change sets up to revision {newest_log}")]
    RevBehindLog {
        /// What the revision key says.
        rev: u64,
        /// The newest revision in the log.
        newest_log: u64,
    },
    /// A log entry that is not a change set.
    #[error("the log entry does not decode: {error}")]
    LogUndecodable {
        /// Why.
        error: String,
    },
    /// A log entry whose change set has another revision than its key.
    #[error("the log entry holds revision {found}, not the {expected} its key says")]
    LogMisnumbered {
        /// The revision its key says.
        expected: u64,
        /// The revision it holds.
        found: u64,
    },
    /// A log entry written more than once (Tidegate writes each once).
    #[error("the log entry was written {version} times; Tidegate writes each log entry once")]
    LogOverwritten {
        /// How many times it was written.
        version: i64,
    },
    /// An object (service, backend, route, certificate) that does not
    /// decode, or does not fit the rest of the configuration.
    #[error("the stored object is invalid: {error}")]
    ObjectInvalid {
        /// Why.
        error: ObjectError,
    },
    /// An object written where Tidegate committed nothing: changed in etcd
    /// directly.
    #[error("written at etcd revision {at}, where Tidegate committed nothing: it was changed outside Tidegate")]
    WrittenOutside {
        /// The etcd revision of the write.
        at: i64,
    },
    /// An object deleted where Tidegate committed nothing.
    #[error("deleted at etcd revision {at}, where Tidegate committed nothing: it was deleted outside Tidegate")]
    DeletedOutside {
        /// The etcd revision of the delete.
        at: i64,
    },
}

impl FaultKind {
    /// A short name for the kind, for `/v1/status` and the `kind` label
    /// of `tidegate_store_fault`.
    pub fn code(&self) -> &'static str {
        match self {
            FaultKind::RevInvalid { .. } => "rev_invalid",
            FaultKind::RevMissing { .. } => "rev_missing",
            FaultKind::RevBehindLog { .. } => "rev_behind_log",
            FaultKind::LogUndecodable { .. } => "log_undecodable",
            FaultKind::LogMisnumbered { .. } => "log_misnumbered",
            FaultKind::LogOverwritten { .. } => "log_overwritten",
            FaultKind::ObjectInvalid { .. } => "object_invalid",
            FaultKind::WrittenOutside { .. } => "written_outside",
            FaultKind::DeletedOutside { .. } => "deleted_outside",
        }
    }

    /// A fault of the revision or the log: no commit can be built safely
    /// on it, so every write is refused until it is repaired. The others
    /// concern one object, which a write through Tidegate that names it
    /// puts back.
    pub fn is_history(&self) -> bool {
        !matches!(
            self,
            FaultKind::ObjectInvalid { .. } | FaultKind::WrittenOutside { .. } | FaultKind::DeletedOutside { .. }
        )
    }
}

/// One group of applied change sets to persist, with the configuration
/// before and after them (a store that keeps one record per object writes
/// exactly the objects that changed).
#[derive(Debug, Clone, Copy)]
pub struct Commit<'a> {
    /// The revision the group was built on: the newest one before it.
    pub base: u64,
    /// The change sets, in order, with revisions `base + 1 ..`.
    pub changes: &'a [AppliedChange],
    /// The configuration at `base`.
    pub before: &'a ConfigState,
    /// The configuration after the group.
    pub after: &'a ConfigState,
}

/// What a store writes for a put: the object as the configuration after
/// the group holds it, not as the op gave it. A secret or a key given as
/// the placeholder `(redacted)` is there the one kept. `None` when a later
/// op of the group deleted the object (that op's delete follows).
impl Commit<'_> {
    /// The service a `put_service` op named.
    pub fn service_after(&self, name: &ServiceName) -> Option<&ServiceSpec> {
        self.after.services().get(name).map(|s| &**s)
    }

    /// The certificate a `put_certificate` op named.
    pub fn certificate_after(&self, name: &CertName) -> Option<&CertificateSpec> {
        self.after.certificates().get(name).map(|c| &**c)
    }

    /// The rule set a `put_rules` op named.
    pub fn rules_after(&self, name: &RuleSetName) -> Option<&RuleSetSpec> {
        self.after.rules().get(name).map(|r| &**r)
    }
}

/// What one commit carries, for stores that bound it (etcd refuses a
/// transaction of more than `--max-txn-ops` operations or
/// `--max-request-bytes` bytes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommitCost {
    /// Writes (keys put or deleted).
    pub ops: usize,
    /// Bytes on the wire, roughly.
    pub bytes: usize,
}

impl CommitCost {
    /// Both together.
    pub fn plus(self, other: CommitCost) -> CommitCost {
        CommitCost { ops: self.ops + other.ops, bytes: self.bytes + other.bytes }
    }

    /// True when neither exceeds `max`'s.
    pub fn within(self, max: CommitCost) -> bool {
        self.ops <= max.ops && self.bytes <= max.bytes
    }
}

/// How the store is doing, for `/v1/status` and `/readyz`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StoreStatus {
    /// `embedded` or `etcd`.
    pub kind: &'static str,
    /// Where it is: a file, or etcd's members and prefix.
    pub location: String,
    /// The store answers (a shared store: the watch is live).
    pub connected: bool,
    /// The newest revision the store is known to hold (a shared store: as
    /// last seen from the watch).
    pub latest_revision: u64,
    /// The last error, while not connected.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// The other instances sharing the store, and how far each has applied.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub instances: Vec<InstanceRecord>,
    /// Keys in a state Tidegate never leaves them in (at most
    /// [`MAX_FAULTS`]); while there is one, the store is not trusted.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub faults: Vec<StoreFault>,
}

/// The most faults a store keeps track of (and `/v1/status` and
/// `/metrics` list); beyond them, more are not recorded.
pub const MAX_FAULTS: usize = 100;

impl StoreStatus {
    /// An embedded store at `path`: always there, no one else.
    pub fn embedded(path: &std::path::Path) -> StoreStatus {
        StoreStatus {
            kind: "embedded",
            location: path.display().to_string(),
            connected: true,
            latest_revision: 0,
            last_error: None,
            instances: Vec::new(),
            faults: Vec::new(),
        }
    }
}

/// What an instance in cluster mode says about itself, refreshed every
/// second under a lease (so a dead instance's record disappears).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct InstanceRecord {
    /// The instance's name (`--instance-name`).
    pub name: String,
    /// Its admin API address.
    pub admin: String,
    /// The revision it has applied.
    pub applied_revision: u64,
    /// Requests in flight through this instance, per autoscaled service:
    /// the leader of a service's autoscaling adds the others' to its own.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub in_flight: std::collections::BTreeMap<String, u64>,
}

/// Hooks the writer gives a shared store to follow changes made elsewhere.
pub struct Follow {
    /// Called (from the store's own thread) whenever the store learns of a
    /// newer revision; the writer then catches up with `changes_since`.
    pub wake: Box<dyn Fn() + Send + Sync>,
    /// The revision this instance has applied, for its instance record.
    pub applied: Box<dyn Fn() -> u64 + Send + Sync>,
    /// Requests in flight here per autoscaled service, for its instance record.
    pub in_flight: Box<dyn Fn() -> std::collections::BTreeMap<String, u64> + Send + Sync>,
    /// Told how many instances are live (their records), each time the
    /// store reads them.
    pub instances: Box<dyn Fn(usize) + Send + Sync>,
}

/// Durable storage of the configuration and its recent history.
///
/// Calls are blocking; the writer calls `commit` from its own thread.
pub trait Store: Send + Sync + 'static {
    /// Reads the whole configuration.
    fn load(&self) -> Result<Loaded, StoreError>;

    /// Persists a group of applied change sets in one durable transaction.
    /// The state after them must equal what the writer applied in memory.
    /// A shared store refuses it with [`StoreError::Conflict`] when its
    /// newest revision is no longer `commit.base`.
    fn commit(&self, commit: &Commit<'_>) -> Result<(), StoreError>;

    /// Housekeeping the store would otherwise do inside a commit (SQLite's
    /// checkpoint of its write-ahead log). The writer calls it when nothing
    /// waits to be committed, so no submitter's answer carries it. Errors
    /// are the store's to log: a commit that follows still works.
    fn maintain(&self) {}

    /// Whether [`Store::maintain`] has work to do now.
    fn maintenance_due(&self) -> bool {
        false
    }

    /// Whether a commit is local and short (an embedded database's write
    /// and sync, not a round trip to other machines): a lone change set
    /// may then be committed on its submitter's thread.
    fn commits_locally(&self) -> bool {
        false
    }

    /// What committing `change` on top of `state` costs (an upper bound),
    /// for a store that bounds one commit; the writer splits a group so
    /// each commit stays within [`Store::max_commit_cost`].
    fn commit_cost(&self, _change: &ChangeSet, _state: &ConfigState) -> CommitCost {
        CommitCost::default()
    }

    /// The most one commit may carry (unbounded by default). One change
    /// set that alone costs more is still tried, and may be refused with
    /// [`StoreError::TooLarge`].
    fn max_commit_cost(&self) -> CommitCost {
        CommitCost { ops: usize::MAX, bytes: usize::MAX }
    }

    /// Change sets with revisions above `after`, oldest first, at most `limit`.
    /// [`StoreError::Compacted`] when some of them are no longer kept.
    fn changes_since(&self, after: u64, limit: usize) -> Result<Vec<AppliedChange>, StoreError>;

    /// Starts following changes committed by other instances (shared
    /// stores only; an embedded store has no one else to follow).
    fn follow(&self, _hooks: Follow) {}

    /// The newest revision the store is known to hold; ahead of the
    /// writer's only when another instance committed.
    fn latest_revision(&self) -> u64 {
        0
    }

    /// How the store is doing.
    fn status(&self) -> StoreStatus;

    /// Announces this instance to the others (shared stores only).
    fn announce(&self, _name: String, _admin: String) {}

    /// The name this instance announced, if any.
    fn name(&self) -> Option<String> {
        None
    }

    /// Asks to lead `role` (a shared store: one instance at a time holds a
    /// role, under a lease that lapses when the holder dies). Keeps asking
    /// until [`Store::resign`].
    fn campaign(&self, _role: &str) {}

    /// Whether this instance leads `role` now. With an embedded store there
    /// is no one else: always.
    fn leads(&self, _role: &str) -> bool {
        true
    }

    /// Stops asking for `role`, and gives it up if held.
    fn resign(&self, _role: &str) {}

    /// Ends this instance's membership now (at shutdown): its record and
    /// its roles go at once rather than when the lease lapses.
    fn retire(&self) {}

    /// The lease this instance's record and roles live under in a shared
    /// store, while it is surely alive: a successor process adopts it
    /// (`serve --takeover`).
    fn lease(&self) -> Option<i64> {
        None
    }

    /// Goes on with a predecessor's lease (see [`Store::lease`]): its
    /// record and the roles it leads stay with no gap, renewed by this
    /// process from now on. A lease that lapsed meanwhile is replaced by a
    /// new one, as at a start.
    fn adopt_lease(&self, _id: i64) {}

    /// Closes the store for a new process of this data directory to open
    /// (`serve --takeover`), releasing its lock. Returns whether there was
    /// anything to hand over: false for a store shared by several
    /// instances (etcd), which every process opens on its own. Until
    /// [`Store::reacquire`], every read or commit fails with
    /// [`StoreError::Released`].
    fn release(&self) -> Result<bool, StoreError> {
        Ok(false)
    }

    /// Opens a released store again (the hand-over failed and the new
    /// process is gone). Nothing to do for a store that was not released.
    fn reacquire(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

/// Decodes the stored object `key` through the model's one validated
/// decode (the same as the API's, a file's and the change log's): a value
/// that does not validate is refused, naming the key and the field.
pub(crate) fn decode_object<T: serde::de::DeserializeOwned>(key: &str, value: &[u8]) -> Result<T, StoreError> {
    tidegate_model::parse_json(value).map_err(|e| invalid_object(key, e))
}

/// The error for the stored object `key`.
pub(crate) fn invalid_object(key: &str, error: impl Into<ObjectError>) -> StoreError {
    StoreError::Invalid { key: key.to_string(), error: error.into() }
}

/// Rebuilds the configuration from the stored objects, put by `ops` (one
/// per object, its key in `keys`), through the model's own apply: the
/// checks across objects (a route's service exists) a submitted change set
/// gets. A failure names the key of the object at fault.
pub(crate) fn rebuild(ops: Vec<tidegate_model::Op>, keys: &[String]) -> Result<ConfigState, StoreError> {
    let all = ChangeSet { if_revision: None, ops };
    ConfigState::default().apply(&all, 0).map(|(state, _)| state).map_err(|e| {
        let key = e.op.and_then(|i| keys.get(i)).map_or("(the configuration)", String::as_str);
        invalid_object(key, ObjectError::conflict(&e))
    })
}

/// The field of an object's op (`ops[N].spec.service`) as a field of the
/// stored object (`service`): its key names the op and its spec.
pub(crate) fn op_field(field: &str) -> &str {
    let rest = field.split_once("].").map_or(field, |(_, rest)| rest);
    rest.strip_prefix("spec.").unwrap_or(rest)
}
