//! The embedded store on SQLite, in WAL mode with `synchronous=FULL`: a
//! commit appends its pages to the write-ahead log and syncs that one file
//! once, with `fdatasync` (the build sets `HAVE_FDATASYNC` through
//! `LIBSQLITE3_FLAGS` in `.cargo/config.toml`), which is as close to the
//! disk's own sync time as a crash-safe store gets (see
//! docs/benchmarks.md, "commit path").
//!
//! A commit writes the change sets to the `log` table only: one page of
//! the write-ahead log for a small change, where writing the tables too
//! took two and, whenever a table's page split, four or five (each page is
//! one more block for the sync). The tables (`services`, `backends`,
//! `routes`, `certificates`) catch up later, in one transaction for many
//! change sets, when the writer has nothing queued ([`Store::maintain`]);
//! `meta.applied` is the revision they hold. Until then the writes they
//! need wait in memory, and `load` replays the logged change sets after
//! `meta.applied` onto the tables (so nothing acknowledged depends on
//! them). A change set whose writes are large goes to the tables in its
//! own commit, and so does everything waiting once that exceeds
//! [`PENDING_MAX_BYTES`].
//!
//! The log is copied into the database file (a checkpoint) when the writer
//! has nothing queued, not inside the commit that happens to cross
//! SQLite's threshold: a checkpoint writes every page the log changed and
//! syncs the database file, several times one commit's cost.

use std::path::Path;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use rusqlite::wal::CheckpointMode;
use rusqlite::{params, Connection, OpenFlags, OptionalExtension, Transaction};
use tidegate_model::{
    BackendId, CertName, CertificateSpec, ChangeSet, ConfigState, Op, RouteName, RouteSpec, ServiceName,
    ServiceSettings, ServiceSpec,
};

use crate::{AppliedChange, Commit, Loaded, Store, StoreError, StoreStatus, LOG_RETAIN};

const SCHEMA: &str = "
    CREATE TABLE IF NOT EXISTS services (name TEXT PRIMARY KEY, settings BLOB NOT NULL) WITHOUT ROWID;
    CREATE TABLE IF NOT EXISTS backends (
        service TEXT NOT NULL, id TEXT NOT NULL, spec BLOB NOT NULL, PRIMARY KEY (service, id)) WITHOUT ROWID;
    CREATE TABLE IF NOT EXISTS routes (name TEXT PRIMARY KEY, spec BLOB NOT NULL) WITHOUT ROWID;
    CREATE TABLE IF NOT EXISTS certificates (name TEXT PRIMARY KEY, spec BLOB NOT NULL) WITHOUT ROWID;
    CREATE TABLE IF NOT EXISTS log (revision INTEGER PRIMARY KEY, change BLOB NOT NULL);
    CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID;
";

/// Pages in the write-ahead log from which [`Store::maintain`] copies it
/// into the database (SQLite's own default threshold, 4 MiB).
const CHECKPOINT_PAGES: i32 = 1_000;

/// Pages from which a commit checkpoints the log itself, when the writer
/// has had no idle moment to do it (64 MiB): bounds the log's size and the
/// time a restart spends reading it.
const BACKSTOP_PAGES: i32 = 16_000;

/// The log keeps between `LOG_RETAIN` and `LOG_RETAIN + TRIM_EVERY - 1`
/// change sets (and every one the tables have not caught up with).
const TRIM_EVERY: u64 = 64;

/// Bytes of table writes waiting in memory from which [`Store::maintain`]
/// brings the tables up to date (about 100 route changes): a catch-up
/// holds the connection, so it stays short; at 256 KiB one took 1.4-3.1 ms,
/// and at 2,000 changes/s about one change in a hundred waited for one.
const PENDING_SOFT_BYTES: usize = 32 * 1024;

/// Bytes of table writes waiting in memory beyond which a commit writes
/// them to the tables itself (a writer with no idle moment, or one change
/// set this large).
const PENDING_MAX_BYTES: usize = 1024 * 1024;

/// The embedded default store: one SQLite database in the data directory,
/// opened by one process at a time.
pub struct SqliteStore {
    inner: Mutex<Inner>,
    path: std::path::PathBuf,
    /// Pages in the write-ahead log since the last checkpoint.
    wal_pages: Arc<AtomicI32>,
    /// Bytes of the table writes in [`Inner::pending`].
    pending_bytes: AtomicUsize,
}

/// The connection and what the tables still lack.
struct Inner {
    conn: Connection,
    /// The revision the tables hold (`meta.applied`): every change set
    /// after it is in the log, and its table writes are in `pending`.
    applied: u64,
    /// The newest committed revision.
    committed: u64,
    /// Whether `meta.applied` is on disk: without it, a restart would take
    /// the tables for complete, so commits write them until it is.
    marked: bool,
    /// The table writes of the change sets after `applied`, in order.
    pending: Vec<Row>,
}

/// One table write a committed change set implies.
#[derive(Debug)]
enum Row {
    /// A service's settings and its whole list of backends.
    Service {
        name: String,
        settings: Vec<u8>,
        backends: Vec<(String, Vec<u8>)>,
    },
    DeleteService {
        name: String,
    },
    Backend {
        service: String,
        id: String,
        spec: Vec<u8>,
    },
    DeleteBackend {
        service: String,
        id: String,
    },
    Route {
        name: String,
        spec: Vec<u8>,
    },
    DeleteRoute {
        name: String,
    },
    Certificate {
        name: String,
        spec: Vec<u8>,
    },
    DeleteCertificate {
        name: String,
    },
}

impl Row {
    /// About what it holds in memory.
    fn bytes(&self) -> usize {
        let text = match self {
            Row::Service { name, settings, backends } => {
                name.len() + settings.len() + backends.iter().map(|(id, b)| id.len() + b.len()).sum::<usize>()
            }
            Row::DeleteService { name } | Row::DeleteRoute { name } | Row::DeleteCertificate { name } => name.len(),
            Row::Backend { service, id, spec } => service.len() + id.len() + spec.len(),
            Row::DeleteBackend { service, id } => service.len() + id.len(),
            Row::Route { name, spec } | Row::Certificate { name, spec } => name.len() + spec.len(),
        };
        text + std::mem::size_of::<Row>()
    }
}

fn err<E: std::fmt::Display>(e: E) -> StoreError {
    StoreError::Backend(e.to_string())
}

fn corrupt<E: std::fmt::Display>(e: E) -> StoreError {
    StoreError::Corrupt(e.to_string())
}

fn json<T: serde::Serialize>(v: &T) -> Result<Vec<u8>, StoreError> {
    serde_json::to_vec(v).map_err(corrupt)
}

impl SqliteStore {
    /// Opens (creating if needed) the database `path` and takes its lock:
    /// a second process opening the same file gets an error, not a share.
    pub fn open(path: &Path) -> Result<SqliteStore, StoreError> {
        let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let opening = |e: rusqlite::Error| {
            let busy = matches!(
                e.sqlite_error_code(),
                Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
            );
            let hint = if busy { " (is another Tidegate using this data directory?)" } else { "" };
            StoreError::Backend(format!("{}: {e}{hint}", path.display()))
        };
        let mut conn = Connection::open_with_flags(path, flags).map_err(opening)?;
        // Exclusive locking keeps the lock from the first write on; the
        // empty immediate transaction below takes it now. In this mode the
        // WAL index lives in heap memory, not a shared-memory file.
        conn.pragma_update(None, "locking_mode", "EXCLUSIVE").map_err(opening)?;
        conn.pragma_update(None, "journal_mode", "WAL").map_err(opening)?;
        conn.pragma_update(None, "synchronous", "FULL").map_err(opening)?;
        conn.execute_batch("BEGIN IMMEDIATE; COMMIT;").map_err(opening)?;
        conn.execute_batch(SCHEMA).map_err(opening)?;
        // This hook replaces SQLite's automatic checkpoint (which runs
        // inside the commit that crosses 1,000 pages) with ours.
        let wal_pages = Arc::new(AtomicI32::new(0));
        let pages = wal_pages.clone();
        conn.wal_hook(Some(move |wal: &mut rusqlite::hooks::Wal, n: i32| {
            if n >= BACKSTOP_PAGES {
                // The commit has happened: an error here must not fail it.
                checkpointed(&pages, n, wal.checkpoint_v2(CheckpointMode::PASSIVE));
            } else {
                pages.store(n, Relaxed);
            }
            Ok(())
        }))
        .map_err(opening)?;
        // A database from before the tables could lag has no marker: its
        // tables hold everything logged. Until the marker is on disk (a
        // full disk may refuse it now), commits write the tables too.
        let committed = revision(&conn)?;
        let marker = conn
            .query_row("SELECT value FROM meta WHERE key = 'applied'", [], |r| r.get::<_, i64>(0))
            .optional()
            .map_err(opening)?;
        let (applied, marked) = match marker {
            Some(v) => (v.max(0) as u64, true),
            None => {
                let put = "INSERT INTO meta (key, value) VALUES ('applied', ?1)";
                (committed, conn.execute(put, params![committed as i64]).is_ok())
            }
        };
        let inner = Inner { conn, applied, committed, marked, pending: Vec::new() };
        Ok(SqliteStore {
            inner: Mutex::new(inner),
            path: path.to_path_buf(),
            wal_pages,
            pending_bytes: AtomicUsize::new(0),
        })
    }

    /// Pages in the write-ahead log since the last checkpoint.
    pub fn wal_pages(&self) -> i32 {
        self.wal_pages.load(Relaxed)
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Inner>, StoreError> {
        self.inner.lock().map_err(|_| StoreError::Backend("the store's connection was poisoned by a panic".into()))
    }

    /// Writes the table writes waiting in memory, and moves `meta.applied`
    /// to the newest revision, in one transaction.
    fn catch_up_tables(&self, inner: &mut Inner) -> Result<(), StoreError> {
        if inner.applied == inner.committed && inner.pending.is_empty() {
            return Ok(());
        }
        let txn = inner.conn.transaction().map_err(err)?;
        for row in &inner.pending {
            write_row(&txn, row)?;
        }
        set_applied(&txn, inner.committed)?;
        txn.commit().map_err(err)?;
        inner.pending.clear();
        inner.applied = inner.committed;
        inner.marked = true;
        self.pending_bytes.store(0, Relaxed);
        Ok(())
    }

    /// Replaces everything with `state` at `revision`, with an empty change
    /// log (used once, to take over a configuration from another store).
    pub fn import(&self, state: &ConfigState, revision: u64) -> Result<(), StoreError> {
        let ops = state
            .services()
            .iter()
            .map(|(name, spec)| Op::PutService { name: name.clone(), spec: Box::new(ServiceSpec::clone(spec)) })
            .chain(
                state
                    .routes()
                    .iter()
                    .map(|(name, spec)| Op::PutRoute { name: name.clone(), spec: RouteSpec::clone(spec) }),
            )
            .collect::<Vec<_>>();
        let whole = Commit { base: 0, changes: &[], before: state, after: state };
        let rows = rows_of(ops.iter(), &whole)?;
        let mut inner = self.lock()?;
        let txn = inner.conn.transaction().map_err(err)?;
        txn.execute_batch(
            "DELETE FROM services; DELETE FROM backends; DELETE FROM routes; DELETE FROM certificates; DELETE FROM log;",
        )
            .map_err(err)?;
        for row in &rows {
            write_row(&txn, row)?;
        }
        txn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('revision', ?1)", params![revision as i64])
            .map_err(err)?;
        set_applied(&txn, revision)?;
        txn.commit().map_err(err)?;
        (inner.applied, inner.committed, inner.marked) = (revision, revision, true);
        inner.pending.clear();
        self.pending_bytes.store(0, Relaxed);
        Ok(())
    }
}

/// Records a checkpoint's outcome in the page count: an empty log, or
/// the `pages` it still holds (and a warning) when it failed.
fn checkpointed(count: &AtomicI32, pages: i32, outcome: rusqlite::Result<(i32, i32)>) {
    match outcome {
        Ok(_) => count.store(0, Relaxed),
        Err(e) => {
            count.store(pages, Relaxed);
            tracing::warn!(error = %e, "cannot checkpoint the store's write-ahead log");
        }
    }
}

/// The newest revision: the log's last entry, or the imported
/// configuration's (the `meta` row) when nothing was logged after it.
/// Databases written before the log alone carried it also have the row,
/// never ahead of the log.
fn revision(conn: &Connection) -> Result<u64, StoreError> {
    let newest: i64 = conn
        .query_row(
            "SELECT MAX(COALESCE((SELECT value FROM meta WHERE key = 'revision'), 0),
                        COALESCE((SELECT MAX(revision) FROM log), 0))",
            [],
            |r| r.get(0),
        )
        .map_err(err)?;
    Ok(newest.max(0) as u64)
}

/// Records in `meta` the revision the tables hold.
fn set_applied(txn: &Transaction<'_>, revision: u64) -> Result<(), StoreError> {
    txn.prepare_cached("INSERT OR REPLACE INTO meta (key, value) VALUES ('applied', ?1)")
        .and_then(|mut s| s.execute(params![revision as i64]))
        .map(drop)
        .map_err(err)
}

/// The table writes of `ops`, all of `commit` (a service or certificate is
/// written as it is after the whole commit).
fn rows_of<'o>(ops: impl Iterator<Item = &'o Op>, commit: &Commit<'_>) -> Result<Vec<Row>, StoreError> {
    let mut rows = Vec::new();
    for op in ops {
        rows.push(match op {
            Op::PutService { name, .. } => {
                let Some(spec) = commit.service_after(name) else { continue };
                let mut backends = Vec::with_capacity(spec.backends.len());
                for (id, b) in &spec.backends {
                    backends.push((id.as_str().to_owned(), json(b)?));
                }
                Row::Service { name: name.as_str().to_owned(), settings: json(&spec.settings)?, backends }
            }
            Op::DeleteService { name } => Row::DeleteService { name: name.as_str().to_owned() },
            Op::PutBackend { service, id, spec } => {
                Row::Backend { service: service.as_str().to_owned(), id: id.as_str().to_owned(), spec: json(spec)? }
            }
            Op::DeleteBackend { service, id } => {
                Row::DeleteBackend { service: service.as_str().to_owned(), id: id.as_str().to_owned() }
            }
            Op::PutRoute { name, spec } => Row::Route { name: name.as_str().to_owned(), spec: json(spec)? },
            Op::DeleteRoute { name } => Row::DeleteRoute { name: name.as_str().to_owned() },
            Op::PutCertificate { name, .. } => {
                let Some(spec) = commit.certificate_after(name) else { continue };
                Row::Certificate { name: name.as_str().to_owned(), spec: json(spec)? }
            }
            Op::DeleteCertificate { name } => Row::DeleteCertificate { name: name.as_str().to_owned() },
        });
    }
    Ok(rows)
}

/// Writes one row into an open transaction.
fn write_row(txn: &Transaction<'_>, row: &Row) -> Result<(), StoreError> {
    let run = |sql: &str, p: &[&dyn rusqlite::ToSql]| txn.prepare_cached(sql).and_then(|mut s| s.execute(p));
    match row {
        Row::Service { name, settings, backends } => {
            run("INSERT OR REPLACE INTO services (name, settings) VALUES (?1, ?2)", &[name, settings]).map_err(err)?;
            run("DELETE FROM backends WHERE service = ?1", &[name]).map_err(err)?;
            for (id, b) in backends {
                run("INSERT INTO backends (service, id, spec) VALUES (?1, ?2, ?3)", &[name, id, b]).map_err(err)?;
            }
        }
        Row::DeleteService { name } => {
            run("DELETE FROM services WHERE name = ?1", &[name]).map_err(err)?;
            run("DELETE FROM backends WHERE service = ?1", &[name]).map_err(err)?;
        }
        Row::Backend { service, id, spec } => {
            run("INSERT OR REPLACE INTO backends (service, id, spec) VALUES (?1, ?2, ?3)", &[service, id, spec])
                .map_err(err)?;
        }
        Row::DeleteBackend { service, id } => {
            run("DELETE FROM backends WHERE service = ?1 AND id = ?2", &[service, id]).map_err(err)?;
        }
        Row::Route { name, spec } => {
            run("INSERT OR REPLACE INTO routes (name, spec) VALUES (?1, ?2)", &[name, spec]).map_err(err)?;
        }
        Row::DeleteRoute { name } => {
            run("DELETE FROM routes WHERE name = ?1", &[name]).map_err(err)?;
        }
        Row::Certificate { name, spec } => {
            run("INSERT OR REPLACE INTO certificates (name, spec) VALUES (?1, ?2)", &[name, spec]).map_err(err)?;
        }
        Row::DeleteCertificate { name } => {
            run("DELETE FROM certificates WHERE name = ?1", &[name]).map_err(err)?;
        }
    }
    Ok(())
}

/// The configuration the tables hold. It is rebuilt through the model's
/// own apply, so a stored configuration passes the same checks as a
/// submitted one.
fn read_tables(conn: &Connection) -> Result<ConfigState, StoreError> {
    let mut ops = Vec::new();
    let mut services = conn.prepare("SELECT name, settings FROM services ORDER BY name").map_err(err)?;
    let mut backends = conn.prepare("SELECT id, spec FROM backends WHERE service = ?1 ORDER BY id").map_err(err)?;
    let rows = services.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, Vec<u8>>(1)?))).map_err(err)?;
    for row in rows {
        let (name, settings) = row.map_err(err)?;
        let settings: ServiceSettings = serde_json::from_slice(&settings).map_err(corrupt)?;
        let mut spec = ServiceSpec { settings, backends: Default::default() };
        let list =
            backends.query_map([&name], |r| Ok((r.get::<_, String>(0)?, r.get::<_, Vec<u8>>(1)?))).map_err(err)?;
        for b in list {
            let (id, value) = b.map_err(err)?;
            spec.backends
                .insert(BackendId::new(&id).map_err(corrupt)?, serde_json::from_slice(&value).map_err(corrupt)?);
        }
        ops.push(Op::PutService { name: ServiceName::new(&name).map_err(corrupt)?, spec: Box::new(spec) });
    }
    let mut routes = conn.prepare("SELECT name, spec FROM routes ORDER BY name").map_err(err)?;
    let rows = routes.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, Vec<u8>>(1)?))).map_err(err)?;
    for row in rows {
        let (name, spec) = row.map_err(err)?;
        let spec: RouteSpec = serde_json::from_slice(&spec).map_err(corrupt)?;
        ops.push(Op::PutRoute { name: RouteName::new(&name).map_err(corrupt)?, spec });
    }
    let mut certificates = conn.prepare("SELECT name, spec FROM certificates ORDER BY name").map_err(err)?;
    let rows = certificates.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, Vec<u8>>(1)?))).map_err(err)?;
    for row in rows {
        let (name, spec) = row.map_err(err)?;
        // Decoding checks the pair again. A certificate that expired
        // while stored still loads: refusing it would stop the proxy
        // from starting (status and metrics report the expiry).
        let spec: CertificateSpec = serde_json::from_slice(&spec).map_err(corrupt)?;
        ops.push(Op::PutCertificate { name: CertName::new(&name).map_err(corrupt)?, spec: Box::new(spec.into()) });
    }
    let all = ChangeSet { if_revision: None, ops };
    let (state, _) = ConfigState::default().apply(&all, 0).map_err(corrupt)?;
    Ok(state)
}

/// The logged change sets after `revision`, in order.
fn logged_after(conn: &Connection, revision: u64) -> Result<Vec<AppliedChange>, StoreError> {
    let mut stmt = conn.prepare("SELECT change FROM log WHERE revision > ?1 ORDER BY revision").map_err(err)?;
    let rows = stmt.query_map(params![revision as i64], |r| r.get::<_, Vec<u8>>(0)).map_err(err)?;
    let mut out = Vec::new();
    for row in rows {
        out.push(serde_json::from_slice(&row.map_err(err)?).map_err(corrupt)?);
    }
    Ok(out)
}

impl Store for SqliteStore {
    fn load(&self) -> Result<Loaded, StoreError> {
        let mut guard = self.lock()?;
        let inner = &mut *guard;
        let mut state = read_tables(&inner.conn)?;
        // The change sets the tables lack, replayed through the model's
        // apply as they were first applied, then written to the tables.
        let replay = logged_after(&inner.conn, inner.applied)?;
        let mut rows = Vec::new();
        for (expected, c) in (inner.applied + 1..).zip(&replay) {
            if c.revision != expected {
                return Err(StoreError::Corrupt(format!(
                    "the log lacks revision {expected}, which the tables (at {}) need",
                    inner.applied
                )));
            }
            let (after, _) = state.apply(&c.change, c.revision - 1).map_err(corrupt)?;
            let one = Commit { base: c.revision - 1, changes: std::slice::from_ref(c), before: &state, after: &after };
            rows.extend(rows_of(c.change.ops.iter(), &one)?);
            state = after;
        }
        if let Some(last) = replay.last() {
            self.pending_bytes.store(rows.iter().map(Row::bytes).sum(), Relaxed);
            inner.pending = rows;
            inner.committed = inner.committed.max(last.revision);
            // A start on a full disk still serves what is logged; the
            // tables catch up in a later `maintain`.
            if let Err(e) = self.catch_up_tables(inner) {
                tracing::warn!(error = %e, "cannot bring the store's tables up to date; the log still holds every change");
            }
        }
        let revision = revision(&inner.conn)?;
        Ok(Loaded { state, revision })
    }

    fn commit(&self, commit: &Commit<'_>) -> Result<(), StoreError> {
        let changes = commit.changes;
        let Some(last) = changes.last() else {
            return Ok(());
        };
        let rows = rows_of(changes.iter().flat_map(|c| &c.change.ops), commit)?;
        let bytes: usize = rows.iter().map(Row::bytes).sum();
        let mut guard = self.lock()?;
        let inner = &mut *guard;
        // Small change sets go to the log alone; the tables catch up in
        // `maintain`, or here once too much waits.
        let direct = !inner.marked || self.pending_bytes.load(Relaxed) + bytes > PENDING_MAX_BYTES;
        let txn = inner.conn.transaction().map_err(err)?;
        if direct {
            for row in inner.pending.iter().chain(&rows) {
                write_row(&txn, row)?;
            }
            set_applied(&txn, last.revision)?;
        }
        {
            let mut log =
                txn.prepare_cached("INSERT OR REPLACE INTO log (revision, change) VALUES (?1, ?2)").map_err(err)?;
            for c in changes {
                log.execute(params![c.revision as i64, json(c)?]).map_err(err)?;
            }
        }
        // The oldest entries go once every TRIM_EVERY revisions, not one
        // per commit: a delete at the log's other end is one more page to
        // sync. The newest revision is the log's last entry (see
        // `revision`), so no separate counter is written either. Entries
        // the tables still lack stay.
        let applied = if direct { last.revision } else { inner.applied };
        let cutoff = last.revision.saturating_sub(LOG_RETAIN).min(applied);
        if cutoff > 0 && last.revision / TRIM_EVERY != commit.base / TRIM_EVERY {
            txn.prepare_cached("DELETE FROM log WHERE revision <= ?1")
                .and_then(|mut s| s.execute(params![cutoff as i64]))
                .map_err(err)?;
        }
        txn.commit().map_err(err)?;
        inner.committed = last.revision;
        if direct {
            inner.pending.clear();
            inner.applied = last.revision;
            inner.marked = true;
            self.pending_bytes.store(0, Relaxed);
        } else {
            inner.pending.extend(rows);
            self.pending_bytes.fetch_add(bytes, Relaxed);
        }
        Ok(())
    }

    fn maintenance_due(&self) -> bool {
        self.wal_pages() >= CHECKPOINT_PAGES || self.pending_bytes.load(Relaxed) >= PENDING_SOFT_BYTES
    }

    fn commits_locally(&self) -> bool {
        true
    }

    fn maintain(&self) {
        if !self.maintenance_due() {
            return;
        }
        let Ok(mut inner) = self.lock() else { return };
        // The tables first, so that the checkpoint copies their pages too.
        if let Err(e) = self.catch_up_tables(&mut inner) {
            tracing::warn!(error = %e, "cannot bring the store's tables up to date; the log still holds every change");
        }
        if self.wal_pages() >= CHECKPOINT_PAGES {
            // One connection, no readers: a passive checkpoint copies the
            // whole log, and the next commit writes it again from its start.
            let outcome = inner.conn.wal_checkpoint_v2(Some("main"), CheckpointMode::PASSIVE);
            checkpointed(&self.wal_pages, self.wal_pages(), outcome);
        }
    }

    fn status(&self) -> StoreStatus {
        StoreStatus::embedded(&self.path)
    }

    fn changes_since(&self, after: u64, limit: usize) -> Result<Vec<AppliedChange>, StoreError> {
        let inner = self.lock()?;
        let conn = &inner.conn;
        let mut stmt = conn
            .prepare_cached("SELECT revision, change FROM log WHERE revision > ?1 ORDER BY revision LIMIT ?2")
            .map_err(err)?;
        let rows = stmt
            .query_map(params![after as i64, limit as i64], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, Vec<u8>>(1)?)))
            .map_err(err)?;
        let mut out = Vec::new();
        for (expected, row) in (after + 1..).zip(rows) {
            let (rev, value) = row.map_err(err)?;
            if rev as u64 != expected {
                return Err(StoreError::Compacted { oldest: rev as u64 });
            }
            out.push(serde_json::from_slice(&value).map_err(corrupt)?);
        }
        if out.is_empty() {
            // Nothing logged after `after`: up to date, unless the revision
            // moved on without a log (an imported configuration).
            let revision = revision(conn)?;
            if revision > after {
                return Err(StoreError::Compacted { oldest: revision + 1 });
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shared_suite_passes() {
        crate::suite::run(|p| SqliteStore::open(&p.with_extension("sqlite")));
    }

    /// Commits the change sets `texts`, at the next revisions, in one
    /// commit on top of `state`.
    fn commit_group(store: &SqliteStore, state: &mut ConfigState, revision: &mut u64, texts: &[String]) {
        let base = *revision;
        let changes: Vec<AppliedChange> =
            texts.iter().zip(base + 1..).map(|(text, rev)| crate::suite::applied(rev, text)).collect();
        let mut after = state.clone();
        for c in &changes {
            after = after.apply(&c.change, c.revision - 1).unwrap().0;
        }
        store.commit(&Commit { base, changes: &changes, before: state, after: &after }).unwrap();
        (*state, *revision) = (after, base + changes.len() as u64);
    }

    /// Commits change set `text` at the next revision on top of `state`.
    fn commit_next(store: &SqliteStore, state: &mut ConfigState, revision: &mut u64, text: &str) {
        commit_group(store, state, revision, &[text.to_string()]);
    }

    /// A new store at `path` holding one service, `s`, at revision 1.
    fn with_service(path: &Path) -> (SqliteStore, ConfigState, u64) {
        let store = SqliteStore::open(path).unwrap();
        let (mut state, mut revision) = (ConfigState::default(), 0);
        commit_next(&store, &mut state, &mut revision, r#"{"ops":[{"op":"put_service","name":"s","spec":{}}]}"#);
        (store, state, revision)
    }

    #[test]
    fn the_log_is_checkpointed_when_the_writer_is_idle_not_inside_a_commit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.sqlite");
        let (store, mut state, mut revision) = with_service(&path);
        let mut pages = store.wal_pages();
        while pages < CHECKPOINT_PAGES + 100 {
            let text = format!(
                r#"{{"ops":[{{"op":"put_route","name":"r{revision}","spec":{{"match":{{"path_prefix":"/{revision}/"}},"service":"s"}}}}]}}"#
            );
            commit_next(&store, &mut state, &mut revision, &text);
            assert!(store.wal_pages() > pages, "no commit checkpoints below the backstop");
            pages = store.wal_pages();
        }
        store.maintain();
        assert_eq!(store.wal_pages(), 0);
        // The log starts again from its beginning, and nothing was lost.
        commit_next(&store, &mut state, &mut revision, r#"{"ops":[{"op":"delete_route","name":"r1"}]}"#);
        assert!((1..20).contains(&store.wal_pages()), "{}", store.wal_pages());
        drop(store);
        let again = SqliteStore::open(&path).unwrap().load().unwrap();
        assert_eq!(again.revision, revision);
        assert_eq!(again.state.routes(), state.routes());
    }

    #[test]
    fn a_writer_with_no_idle_moment_still_bounds_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(&dir.path().join("c.sqlite")).unwrap();
        let (mut state, mut revision) = (ConfigState::default(), 0);
        let mut checkpointed = false;
        for i in 0..1_500 {
            // 15-45 pages each (the log's entry, and the tables' rows
            // when too many wait): a few hundred commits cross the backstop.
            let backends: Vec<String> =
                (0..1000).map(|b| format!(r#"{{"id":"b{b}","addr":"10.0.{}.{}:80"}}"#, b / 250, b % 250)).collect();
            let text = format!(
                r#"{{"ops":[{{"op":"put_service","name":"s{i}","spec":{{"backends":[{}]}}}}]}}"#,
                backends.join(",")
            );
            let before = store.wal_pages();
            commit_next(&store, &mut state, &mut revision, &text);
            assert!(store.wal_pages() < BACKSTOP_PAGES);
            checkpointed |= store.wal_pages() < before;
            if checkpointed {
                break;
            }
        }
        assert!(checkpointed, "the log reached {} pages without a checkpoint", store.wal_pages());
    }

    #[test]
    fn the_log_is_trimmed_in_steps_and_the_revision_is_its_last_entry() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.sqlite");
        let (store, mut state, mut revision) = with_service(&path);
        // Groups of 10 change sets, as a busy writer commits them.
        let logged = |store: &SqliteStore| -> u64 {
            store.lock().unwrap().conn.query_row("SELECT COUNT(*) FROM log", [], |r| r.get::<_, i64>(0)).unwrap() as u64
        };
        while revision < LOG_RETAIN + 300 {
            let group: Vec<String> = (1..=10)
                .map(|k| {
                    format!(
                        r#"{{"ops":[{{"op":"put_backend","service":"s","id":"b","spec":{{"addr":"127.0.0.1:{}"}}}}]}}"#,
                        1000 + k
                    )
                })
                .collect();
            commit_group(&store, &mut state, &mut revision, &group);
            let kept = logged(&store);
            assert!(kept >= LOG_RETAIN.min(revision), "{kept} kept at revision {revision}");
            assert!(kept < LOG_RETAIN + TRIM_EVERY, "{kept} kept at revision {revision}");
            assert_eq!(store.load().unwrap().revision, revision);
        }
        drop(store);
        assert_eq!(SqliteStore::open(&path).unwrap().load().unwrap().revision, revision);
    }

    /// The revision `meta.applied` says the tables hold.
    fn marker(store: &SqliteStore) -> u64 {
        let inner = store.lock().unwrap();
        inner.conn.query_row("SELECT value FROM meta WHERE key = 'applied'", [], |r| r.get::<_, i64>(0)).unwrap() as u64
    }

    /// Small change sets of every kind, one at a time.
    fn churn(store: &SqliteStore, state: &mut ConfigState, revision: &mut u64) {
        for i in 0..40 {
            let text = format!(
                r#"{{"ops":[{{"op":"put_route","name":"r{i}","spec":{{"match":{{"path_prefix":"/{i}/"}},"service":"s"}}}}]}}"#
            );
            commit_next(store, state, revision, &text);
        }
        for text in [
            r#"{"ops":[{"op":"put_backend","service":"s","id":"b","spec":{"addr":"127.0.0.1:9"}}]}"#,
            r#"{"ops":[{"op":"delete_route","name":"r3"}]}"#,
            r#"{"ops":[{"op":"put_service","name":"t","spec":{"backends":[{"id":"x","addr":"127.0.0.1:8"}]}}]}"#,
            r#"{"ops":[{"op":"put_backend","service":"t","id":"y","spec":{"addr":"127.0.0.1:7"}}]}"#,
            r#"{"ops":[{"op":"delete_backend","service":"t","id":"x"}]}"#,
            r#"{"ops":[{"op":"put_route","name":"r3","spec":{"match":{"path_prefix":"/again/"},"service":"t"}}]}"#,
            r#"{"ops":[{"op":"delete_route","name":"r3"},{"op":"delete_service","name":"t"}]}"#,
        ] {
            commit_next(store, state, revision, text);
        }
    }

    fn assert_holds(loaded: &Loaded, state: &ConfigState, revision: u64) {
        assert_eq!(loaded.revision, revision);
        assert_eq!(loaded.state.services(), state.services());
        assert_eq!(loaded.state.routes(), state.routes());
    }

    /// Ends `store` (its table writes still in memory are lost, as with
    /// `kill -9`), opens `path` again and checks it holds `state`.
    fn reopened_holds(store: SqliteStore, path: &Path, state: &ConfigState, revision: u64) -> SqliteStore {
        drop(store);
        let store = SqliteStore::open(path).unwrap();
        assert_holds(&store.load().unwrap(), state, revision);
        store
    }

    /// Committed change sets whose table writes were still in memory
    /// when the process ended (as with `kill -9`) are replayed from the
    /// log at the next start, and written to the tables then.
    #[test]
    fn changes_survive_an_end_before_the_tables_catch_up() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.sqlite");
        let (store, mut state, mut revision) = with_service(&path);
        churn(&store, &mut state, &mut revision);
        assert!(store.pending_bytes.load(Relaxed) > 0);
        assert_eq!(marker(&store), 0, "the tables caught up without maintenance");
        let store = reopened_holds(store, &path, &state, revision);
        assert_eq!(marker(&store), revision, "the replayed change sets were not written to the tables");
        assert_eq!(read_tables(&store.lock().unwrap().conn).unwrap().routes(), state.routes());
        // And the next start reads them from the tables alone.
        reopened_holds(store, &path, &state, revision);
    }

    #[test]
    fn the_tables_catch_up_when_the_writer_is_idle() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.sqlite");
        let (store, mut state, mut revision) = with_service(&path);
        churn(&store, &mut state, &mut revision);
        store.maintain();
        assert_eq!(marker(&store), 0, "maintenance ran before anything was due");
        while !store.maintenance_due() {
            churn(&store, &mut state, &mut revision);
        }
        store.maintain();
        assert_eq!((store.pending_bytes.load(Relaxed), marker(&store)), (0, revision));
        let tables = read_tables(&store.lock().unwrap().conn).unwrap();
        assert_eq!((tables.services(), tables.routes()), (state.services(), state.routes()));
    }

    /// A writer that is never idle: once too much waits, a commit writes
    /// it to the tables itself.
    #[test]
    fn a_busy_writer_bounds_what_waits_in_memory() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.sqlite");
        let (store, mut state, mut revision) = with_service(&path);
        let backends: Vec<String> =
            (0..1000).map(|b| format!(r#"{{"id":"b{b}","addr":"10.0.0.1:{}"}}"#, b + 1)).collect();
        let mut flushed = false;
        for i in 0..100 {
            let text = format!(
                r#"{{"ops":[{{"op":"put_service","name":"s{i}","spec":{{"backends":[{}]}}}}]}}"#,
                backends.join(",")
            );
            commit_next(&store, &mut state, &mut revision, &text);
            assert!(store.pending_bytes.load(Relaxed) <= PENDING_MAX_BYTES);
            if marker(&store) == revision {
                flushed = true;
                break;
            }
        }
        assert!(flushed, "{} bytes wait", store.pending_bytes.load(Relaxed));
        reopened_holds(store, &path, &state, revision);
    }

    /// A database written before the tables could lag has no marker: its
    /// tables hold everything logged, and nothing is replayed twice.
    #[test]
    fn a_database_without_the_marker_is_read_from_its_tables() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.sqlite");
        let (store, mut state, mut revision) = with_service(&path);
        churn(&store, &mut state, &mut revision);
        {
            let mut inner = store.lock().unwrap();
            store.catch_up_tables(&mut inner).unwrap();
            inner.conn.execute("DELETE FROM meta WHERE key = 'applied'", []).unwrap();
        }
        let store = reopened_holds(store, &path, &state, revision);
        assert_eq!(marker(&store), revision);
    }

    #[test]
    fn a_second_opener_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.sqlite");
        let _first = SqliteStore::open(&path).unwrap();
        let second = SqliteStore::open(&path);
        assert!(matches!(&second, Err(StoreError::Backend(m)) if m.contains("another Tidegate")), "{:?}", second.err());
    }

    #[test]
    fn an_import_takes_over_a_configuration_with_no_history() {
        let dir = tempfile::tempdir().unwrap();
        let old = crate::RedbStore::open(&dir.path().join("c.redb")).unwrap();
        for c in crate::suite::changes() {
            crate::suite::commit(&old, std::slice::from_ref(&c)).unwrap();
        }
        let loaded = old.load().unwrap();
        let new = SqliteStore::open(&dir.path().join("c.sqlite")).unwrap();
        new.import(&loaded.state, loaded.revision).unwrap();
        let again = new.load().unwrap();
        assert_eq!(again.revision, 3);
        assert_eq!(again.state.services(), loaded.state.services());
        assert_eq!(again.state.routes(), loaded.state.routes());
        // Watchers behind the import must reload: the history is gone.
        assert!(matches!(new.changes_since(1, 10), Err(StoreError::Compacted { oldest: 4 })));
        assert!(new.changes_since(3, 10).unwrap().is_empty());
    }
}
