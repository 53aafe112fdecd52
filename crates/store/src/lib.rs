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

mod redb_store;
mod sqlite_store;
#[cfg(test)]
mod suite;

use tidegate_model::{ChangeSet, ConfigState};

pub use redb_store::RedbStore;
pub use sqlite_store::SqliteStore;

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
    /// The database failed (I/O, corruption, ...).
    #[error("storage error: {0}")]
    Backend(String),
    /// Stored data could not be decoded.
    #[error("stored configuration is invalid: {0}")]
    Corrupt(String),
    /// The requested history is no longer retained.
    #[error("change history before revision {oldest} is no longer kept")]
    Compacted {
        /// The oldest revision still replayable.
        oldest: u64,
    },
}

/// Durable storage of the configuration and its recent history.
///
/// Calls are blocking; the writer calls `commit` from its own thread.
pub trait Store: Send + Sync + 'static {
    /// Reads the whole configuration.
    fn load(&self) -> Result<Loaded, StoreError>;

    /// Persists applied change sets, in order, in one durable transaction.
    /// The state after them must equal what the writer applied in memory.
    fn commit(&self, changes: &[AppliedChange]) -> Result<(), StoreError>;

    /// Change sets with revisions above `after`, oldest first, at most `limit`.
    /// [`StoreError::Compacted`] when some of them are no longer kept.
    fn changes_since(&self, after: u64, limit: usize) -> Result<Vec<AppliedChange>, StoreError>;
}
