//! The embedded store on SQLite, in WAL mode with `synchronous=FULL`: a
//! commit appends its pages to the write-ahead log and syncs that one file
//! once, with `fdatasync` (the build sets `HAVE_FDATASYNC` through
//! `LIBSQLITE3_FLAGS` in `.cargo/config.toml`), which is as close to the
//! disk's own sync time as a crash-safe store gets (see
//! docs/benchmarks.md, "commit path").
//!
//! The log is copied into the database file (a checkpoint) when the writer
//! has nothing queued ([`Store::maintain`]), not inside the commit that
//! happens to cross SQLite's threshold: a checkpoint writes every page the
//! log changed and syncs the database file, several times one commit's cost.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::atomic::{AtomicI32, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use rusqlite::wal::CheckpointMode;
use rusqlite::{params, Connection, OpenFlags, Transaction};
use tidegate_model::{
    BackendId, CertName, CertificateInput, CertificateSpec, ConfigState, ListenerName, ListenerSpec, Op, RouteName,
    RouteSpec, RuleSetName, RuleSetSpec, ServiceName, ServiceSettings, ServiceSpec,
};

use crate::{
    decode_object, invalid_object, rebuild, AppliedChange, Commit, Loaded, Store, StoreError, StoreStatus, LOG_RETAIN,
};

/// Each object's row carries `sum`, a checksum of its table, key and value
/// ([`row_sum`]), checked when the configuration is loaded: a row changed
/// outside Tidegate, or a bit flipped on disk, is refused rather than
/// loaded with a changed address.
const SCHEMA: &str = "
    CREATE TABLE IF NOT EXISTS services (name TEXT PRIMARY KEY, settings BLOB NOT NULL, sum INTEGER) WITHOUT ROWID;
    CREATE TABLE IF NOT EXISTS backends (
        service TEXT NOT NULL, id TEXT NOT NULL, spec BLOB NOT NULL, sum INTEGER, PRIMARY KEY (service, id))
        WITHOUT ROWID;
    CREATE TABLE IF NOT EXISTS routes (name TEXT PRIMARY KEY, spec BLOB NOT NULL, sum INTEGER) WITHOUT ROWID;
    CREATE TABLE IF NOT EXISTS certificates (name TEXT PRIMARY KEY, spec BLOB NOT NULL, sum INTEGER) WITHOUT ROWID;
    CREATE TABLE IF NOT EXISTS rules (name TEXT PRIMARY KEY, spec BLOB NOT NULL, sum INTEGER) WITHOUT ROWID;
    CREATE TABLE IF NOT EXISTS listeners (name TEXT PRIMARY KEY, spec BLOB NOT NULL, sum INTEGER) WITHOUT ROWID;
    CREATE TABLE IF NOT EXISTS log (revision INTEGER PRIMARY KEY, change BLOB NOT NULL);
    CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID;
";

/// The tables every database this store ever created has; one without
/// them was not written by Tidegate, or lost its tables (see
/// [`check_schema`]). `certificates`, `rules` and `listeners` came later:
/// an older database gets them on open.
const CORE_TABLES: [&str; 5] = ["services", "backends", "routes", "log", "meta"];

/// Pages in the write-ahead log from which [`Store::maintain`] copies it
/// into the database (SQLite's own default threshold, 4 MiB).
const CHECKPOINT_PAGES: i32 = 1_000;

/// Pages from which a commit checkpoints the log itself, when the writer
/// has had no idle moment to do it (64 MiB): bounds the log's size and the
/// time a restart spends reading it.
const BACKSTOP_PAGES: i32 = 16_000;

/// The log keeps between `LOG_RETAIN` and `LOG_RETAIN + TRIM_EVERY - 1`
/// change sets.
const TRIM_EVERY: u64 = 64;

/// The embedded default store: one SQLite database in the data directory,
/// opened by one process at a time.
pub struct SqliteStore {
    /// None while the store is handed over to another process
    /// ([`Store::release`]).
    conn: Mutex<Option<Connection>>,
    path: std::path::PathBuf,
    /// Pages in the write-ahead log since the last checkpoint.
    wal_pages: Arc<AtomicI32>,
}

/// The open connection, locked (see [`SqliteStore::lock`]).
struct ConnGuard<'a>(std::sync::MutexGuard<'a, Option<Connection>>);

impl std::ops::Deref for ConnGuard<'_> {
    type Target = Connection;
    fn deref(&self) -> &Connection {
        // `lock` hands out a guard only over an open connection.
        self.0.as_ref().unwrap_or_else(|| unreachable!("a guard over a released store"))
    }
}

impl std::ops::DerefMut for ConnGuard<'_> {
    fn deref_mut(&mut self) -> &mut Connection {
        self.0.as_mut().unwrap_or_else(|| unreachable!("a guard over a released store"))
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
    /// Opens the database `path` and takes its lock: a second process
    /// opening the same file gets an error, not a share.
    ///
    /// Where there is no file, a new database is made (mode 0600) under a
    /// temporary name with its tables, and renamed into place: so a file at
    /// `path` always had the tables, and one that has none of them (an
    /// empty file, or a database whose tables were dropped) is refused with
    /// [`StoreError::NoSchema`] rather than served as an empty
    /// configuration whose revisions start again at 1.
    pub fn open(path: &Path) -> Result<SqliteStore, StoreError> {
        let wal_pages = Arc::new(AtomicI32::new(0));
        let conn = connect(path, wal_pages.clone())?;
        Ok(SqliteStore { conn: Mutex::new(Some(conn)), path: path.to_path_buf(), wal_pages })
    }

    /// Pages in the write-ahead log since the last checkpoint.
    pub fn wal_pages(&self) -> i32 {
        self.wal_pages.load(Relaxed)
    }

    fn lock(&self) -> Result<ConnGuard<'_>, StoreError> {
        let guard = self
            .conn
            .lock()
            .map_err(|_| StoreError::Backend("the store's connection was poisoned by a panic".into()))?;
        match guard.is_some() {
            true => Ok(ConnGuard(guard)),
            false => Err(StoreError::Released { path: self.path.display().to_string() }),
        }
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
                    .rules()
                    .iter()
                    .map(|(name, spec)| Op::PutRules { name: name.clone(), spec: Box::new(RuleSetSpec::clone(spec)) }),
            )
            .chain(
                state
                    .listeners()
                    .iter()
                    .map(|(name, spec)| Op::PutListener { name: name.clone(), spec: ListenerSpec::clone(spec) }),
            )
            .chain(
                state
                    .routes()
                    .iter()
                    .map(|(name, spec)| Op::PutRoute { name: name.clone(), spec: Box::new(RouteSpec::clone(spec)) }),
            )
            .collect::<Vec<_>>();
        let mut conn = self.lock()?;
        let txn = conn.transaction().map_err(err)?;
        txn.execute_batch(
            "DELETE FROM services; DELETE FROM backends; DELETE FROM routes; DELETE FROM certificates; DELETE FROM rules; \
             DELETE FROM listeners; DELETE FROM log;",
        )
            .map_err(err)?;
        let whole = Commit { base: 0, changes: &[], before: state, after: state };
        for op in &ops {
            write_op(&txn, op, &whole)?;
        }
        txn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('revision', ?1)", params![revision as i64])
            .map_err(err)?;
        txn.commit().map_err(err)
    }
}

/// The object tables: name, key columns (joined by `/` in a row's key),
/// value column.
const OBJECT_TABLES: [(&str, &str, &str); 6] = [
    ("services", "name", "settings"),
    ("backends", "service || '/' || id", "spec"),
    ("routes", "name", "spec"),
    ("certificates", "name", "spec"),
    ("rules", "name", "spec"),
    ("listeners", "name", "spec"),
];

/// The checksum of one object's row: FNV-1a (64 bits) over its table, key
/// and value. Not a defence against someone who means harm (anyone who may
/// write the file may write a matching sum), but any change of one byte,
/// a flipped bit among them, changes it.
fn row_sum(table: &str, key: &str, value: &[u8]) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in table.bytes().chain([0]).chain(key.bytes()).chain([0]).chain(value.iter().copied()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h as i64
}

/// Gives every object row its checksum: a database from before checksums
/// gets the column, and rows without one (written before, or by an older
/// Tidegate since) get theirs.
fn add_sums(conn: &mut Connection) -> rusqlite::Result<()> {
    let txn = conn.transaction()?;
    for (table, key, value) in OBJECT_TABLES {
        let has_sum = txn
            .prepare(&format!("PRAGMA table_info({table})"))?
            .query_map([], |r| r.get::<_, String>(1))?
            .collect::<Result<Vec<_>, _>>()?
            .iter()
            .any(|c| c == "sum");
        if !has_sum {
            txn.execute_batch(&format!("ALTER TABLE {table} ADD COLUMN sum INTEGER"))?;
        }
        let rows = txn
            .prepare(&format!("SELECT {key}, {value} FROM {table} WHERE sum IS NULL"))?
            .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, Vec<u8>>(1)?)))?
            .collect::<Result<Vec<_>, _>>()?;
        for (k, v) in rows {
            txn.execute(&format!("UPDATE {table} SET sum = ?1 WHERE {key} = ?2"), params![row_sum(table, &k, &v), k])?;
        }
    }
    txn.commit()
}

/// Makes a new database at `path`: its tables are made under a temporary
/// name (mode 0600), which is then renamed into place and the directory
/// synced, so a crash leaves either no file or a whole one.
fn create(path: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::OpenOptionsExt;
    let fail = |what: &str, e: &dyn std::fmt::Display| StoreError::Backend(format!("{what} {}: {e}", path.display()));
    let mut name = path.as_os_str().to_owned();
    name.push(".new");
    let temp = std::path::PathBuf::from(name);
    // A leftover of a crash while creating: it never was the store.
    let _ = std::fs::remove_file(&temp);
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&temp)
        .map_err(|e| fail("creating", &e))?;
    let made = Connection::open(&temp).and_then(|conn| {
        conn.execute_batch(SCHEMA)?;
        conn.close().map_err(|(_, e)| e)
    });
    made.map_err(|e| fail("creating", &e))?;
    std::fs::File::open(&temp).and_then(|f| f.sync_all()).map_err(|e| fail("syncing", &e))?;
    std::fs::rename(&temp, path).map_err(|e| fail("creating", &e))?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|e| fail("syncing the directory of", &e))?;
    }
    Ok(())
}

/// Refuses a database without the store's tables: an existing file always
/// had them (see [`SqliteStore::open`]), so one that lacks them is empty or
/// damaged, and serving it would serve an empty configuration.
fn check_schema(tables: &BTreeSet<String>, path: &Path) -> Result<(), StoreError> {
    let missing: Vec<&str> = CORE_TABLES.iter().copied().filter(|t| !tables.contains(*t)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    let bytes = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    let what = if missing.len() == CORE_TABLES.len() {
        if bytes == 0 {
            "is an empty file (0 bytes), not a Tidegate store".to_string()
        } else {
            "holds none of the store's tables".to_string()
        }
    } else {
        format!("lacks the table(s) {}", missing.join(", "))
    };
    Err(StoreError::NoSchema { path: path.display().to_string(), what })
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

/// Writes one op of `commit` into an open transaction.
fn write_op(txn: &Transaction<'_>, op: &Op, commit: &Commit<'_>) -> Result<(), StoreError> {
    let run = |sql: &str, p: &[&dyn rusqlite::ToSql]| txn.prepare_cached(sql).and_then(|mut s| s.execute(p));
    match op {
        Op::PutService { name, .. } => {
            let Some(spec) = commit.service_after(name) else { return Ok(()) };
            let value = json(&spec.settings)?;
            run(
                "INSERT OR REPLACE INTO services (name, settings, sum) VALUES (?1, ?2, ?3)",
                &[&name.as_str(), &value, &row_sum("services", name.as_str(), &value)],
            )
            .map_err(err)?;
            run("DELETE FROM backends WHERE service = ?1", &[&name.as_str()]).map_err(err)?;
            for (id, b) in &spec.backends {
                let value = json(b)?;
                let sum = row_sum("backends", &format!("{name}/{id}"), &value);
                run(
                    "INSERT INTO backends (service, id, spec, sum) VALUES (?1, ?2, ?3, ?4)",
                    &[&name.as_str(), &id.as_str(), &value, &sum],
                )
                .map_err(err)?;
            }
        }
        Op::DeleteService { name } => {
            run("DELETE FROM services WHERE name = ?1", &[&name.as_str()]).map_err(err)?;
            run("DELETE FROM backends WHERE service = ?1", &[&name.as_str()]).map_err(err)?;
        }
        Op::PutBackend { service, id, spec } => {
            let value = json(spec)?;
            let sum = row_sum("backends", &format!("{service}/{id}"), &value);
            run(
                "INSERT OR REPLACE INTO backends (service, id, spec, sum) VALUES (?1, ?2, ?3, ?4)",
                &[&service.as_str(), &id.as_str(), &value, &sum],
            )
            .map_err(err)?;
        }
        Op::DeleteBackend { service, id } => {
            run("DELETE FROM backends WHERE service = ?1 AND id = ?2", &[&service.as_str(), &id.as_str()])
                .map_err(err)?;
        }
        Op::PutRoute { name, spec } => {
            let value = json(spec)?;
            let sum = row_sum("routes", name.as_str(), &value);
            run("INSERT OR REPLACE INTO routes (name, spec, sum) VALUES (?1, ?2, ?3)", &[&name.as_str(), &value, &sum])
                .map_err(err)?;
        }
        Op::DeleteRoute { name } => {
            run("DELETE FROM routes WHERE name = ?1", &[&name.as_str()]).map_err(err)?;
        }
        Op::PutCertificate { name, .. } | Op::RenewCertificate { name } | Op::AcmeState { name, .. } => {
            let Some(spec) = commit.certificate_after(name) else { return Ok(()) };
            let value = json(spec)?;
            let sum = row_sum("certificates", name.as_str(), &value);
            run(
                "INSERT OR REPLACE INTO certificates (name, spec, sum) VALUES (?1, ?2, ?3)",
                &[&name.as_str(), &value, &sum],
            )
            .map_err(err)?;
        }
        Op::DeleteCertificate { name } => {
            run("DELETE FROM certificates WHERE name = ?1", &[&name.as_str()]).map_err(err)?;
        }
        Op::PutRules { name, .. } => {
            // As the configuration holds it: a hash given as the
            // placeholder is the one kept.
            let Some(spec) = commit.rules_after(name) else { return Ok(()) };
            let value = json(spec)?;
            let sum = row_sum("rules", name.as_str(), &value);
            run("INSERT OR REPLACE INTO rules (name, spec, sum) VALUES (?1, ?2, ?3)", &[&name.as_str(), &value, &sum])
                .map_err(err)?;
        }
        Op::DeleteRules { name } => {
            run("DELETE FROM rules WHERE name = ?1", &[&name.as_str()]).map_err(err)?;
        }
        Op::PutListener { name, spec } => {
            let value = json(spec)?;
            let sum = row_sum("listeners", name.as_str(), &value);
            run(
                "INSERT OR REPLACE INTO listeners (name, spec, sum) VALUES (?1, ?2, ?3)",
                &[&name.as_str(), &value, &sum],
            )
            .map_err(err)?;
        }
        Op::DeleteListener { name } => {
            run("DELETE FROM listeners WHERE name = ?1", &[&name.as_str()]).map_err(err)?;
        }
    }
    Ok(())
}

/// Opens the database `path` and takes its lock (see [`SqliteStore::open`]);
/// the checkpoint hook counts the log's pages in `wal_pages`.
fn connect(path: &Path, wal_pages: Arc<AtomicI32>) -> Result<Connection, StoreError> {
    match std::fs::symlink_metadata(path) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => create(path)?,
        Err(e) => return Err(StoreError::Backend(format!("{}: {e}", path.display()))),
    }
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let opening = |e: rusqlite::Error| {
        let busy = matches!(
            e.sqlite_error_code(),
            Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
        );
        match busy {
            true => StoreError::Locked { path: path.display().to_string(), detail: e.to_string() },
            false => StoreError::Backend(format!("{}: {e}", path.display())),
        }
    };
    let mut conn = Connection::open_with_flags(path, flags).map_err(opening)?;
    // Exclusive locking keeps the lock from the first write on; the
    // empty immediate transaction below takes it now. In this mode the
    // WAL index lives in heap memory, not a shared-memory file.
    conn.pragma_update(None, "locking_mode", "EXCLUSIVE").map_err(opening)?;
    // Before anything is written to it (setting WAL mode writes a header).
    let tables = conn
        .prepare("SELECT name FROM sqlite_master WHERE type = 'table'")
        .and_then(|mut stmt| stmt.query_map([], |r| r.get::<_, String>(0))?.collect::<Result<BTreeSet<String>, _>>())
        .map_err(opening)?;
    check_schema(&tables, path)?;
    conn.pragma_update(None, "journal_mode", "WAL").map_err(opening)?;
    conn.pragma_update(None, "synchronous", "FULL").map_err(opening)?;
    conn.execute_batch("BEGIN IMMEDIATE; COMMIT;").map_err(opening)?;
    conn.execute_batch(SCHEMA).map_err(opening)?;
    add_sums(&mut conn).map_err(opening)?;
    // This hook replaces SQLite's automatic checkpoint (which runs
    // inside the commit that crosses 1,000 pages) with ours.
    let pages = wal_pages;
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
    Ok(conn)
}

impl Store for SqliteStore {
    fn release(&self) -> Result<bool, StoreError> {
        let mut guard = self
            .conn
            .lock()
            .map_err(|_| StoreError::Backend("the store's connection was poisoned by a panic".into()))?;
        if let Some(conn) = guard.take() {
            // Closing checkpoints the write-ahead log and drops the lock.
            if let Err((conn, e)) = conn.close() {
                *guard = Some(conn);
                return Err(StoreError::Backend(format!("{}: closing it: {e}", self.path.display())));
            }
        }
        Ok(true)
    }

    fn reacquire(&self) -> Result<(), StoreError> {
        let mut guard = self
            .conn
            .lock()
            .map_err(|_| StoreError::Backend("the store's connection was poisoned by a panic".into()))?;
        if guard.is_none() {
            *guard = Some(connect(&self.path, self.wal_pages.clone())?);
        }
        Ok(())
    }

    fn load(&self) -> Result<Loaded, StoreError> {
        let conn = self.lock()?;
        let revision = revision(&conn)?;
        // Each object decodes through the model's one validated decode, as
        // a submitted one does, and the whole is rebuilt through the
        // model's own apply: a row that does not validate (written by
        // something other than Tidegate) is refused, naming its key and
        // field, and the instance does not start on it.
        let mut ops = Vec::new();
        let mut keys = Vec::new();
        // Each row as (key, value), its checksum checked.
        type Row = (String, Vec<u8>, Option<i64>);
        let row = |r: &rusqlite::Row<'_>| -> rusqlite::Result<Row> { Ok((r.get(0)?, r.get(1)?, r.get(2)?)) };
        let checked = |table: &'static str, key: String, value: Vec<u8>, sum: Option<i64>| {
            // A row without a sum was written by an older Tidegate since the
            // store was opened; it gets one at the next open.
            if sum.is_some_and(|sum| sum != row_sum(table, &key, &value)) {
                return Err(StoreError::Damaged { path: self.path.display().to_string(), table, key });
            }
            Ok(value)
        };
        let mut services = conn.prepare("SELECT name, settings, sum FROM services ORDER BY name").map_err(err)?;
        let mut backends =
            conn.prepare("SELECT id, spec, sum FROM backends WHERE service = ?1 ORDER BY id").map_err(err)?;
        for r in services.query_map([], row).map_err(err)? {
            let (name, settings, sum) = r.map_err(err)?;
            let key = format!("services/{name}");
            let settings = checked("services", name.clone(), settings, sum)?;
            let settings: ServiceSettings = decode_object(&key, &settings)?;
            let mut spec = ServiceSpec { settings, backends: Default::default() };
            for b in backends.query_map([&name], row).map_err(err)? {
                let (id, value, sum) = b.map_err(err)?;
                let backend_key = format!("backends/{name}/{id}");
                let value = checked("backends", format!("{name}/{id}"), value, sum)?;
                let id = BackendId::new(&id).map_err(|e| invalid_object(&backend_key, e))?;
                spec.backends.insert(id, decode_object(&backend_key, &value)?);
            }
            let name = ServiceName::new(&name).map_err(|e| invalid_object(&key, e))?;
            ops.push(Op::PutService { name, spec: Box::new(spec) });
            keys.push(key);
        }
        // Rule sets before the routes that run them.
        let mut rules = conn.prepare("SELECT name, spec, sum FROM rules ORDER BY name").map_err(err)?;
        for r in rules.query_map([], row).map_err(err)? {
            let (name, spec, sum) = r.map_err(err)?;
            let key = format!("rules/{name}");
            let spec = checked("rules", name.clone(), spec, sum)?;
            let spec: RuleSetSpec = decode_object(&key, &spec)?;
            let name = RuleSetName::new(&name).map_err(|e| invalid_object(&key, e))?;
            ops.push(Op::PutRules { name, spec: Box::new(spec) });
            keys.push(key);
        }
        // Listeners before the routes bound to them.
        let mut listeners = conn.prepare("SELECT name, spec, sum FROM listeners ORDER BY name").map_err(err)?;
        for r in listeners.query_map([], row).map_err(err)? {
            let (name, spec, sum) = r.map_err(err)?;
            let key = format!("listeners/{name}");
            let spec = checked("listeners", name.clone(), spec, sum)?;
            let spec: ListenerSpec = decode_object(&key, &spec)?;
            let name = ListenerName::new(&name).map_err(|e| invalid_object(&key, e))?;
            ops.push(Op::PutListener { name, spec });
            keys.push(key);
        }
        let mut routes = conn.prepare("SELECT name, spec, sum FROM routes ORDER BY name").map_err(err)?;
        for r in routes.query_map([], row).map_err(err)? {
            let (name, spec, sum) = r.map_err(err)?;
            let key = format!("routes/{name}");
            let spec = checked("routes", name.clone(), spec, sum)?;
            let spec: RouteSpec = decode_object(&key, &spec)?;
            ops.push(Op::PutRoute {
                name: RouteName::new(&name).map_err(|e| invalid_object(&key, e))?,
                spec: Box::new(spec),
            });
            keys.push(key);
        }
        let mut certificates = conn.prepare("SELECT name, spec, sum FROM certificates ORDER BY name").map_err(err)?;
        for r in certificates.query_map([], row).map_err(err)? {
            let (name, spec, sum) = r.map_err(err)?;
            let key = format!("certificates/{name}");
            let spec = checked("certificates", name.clone(), spec, sum)?;
            // Decoding checks the pair again. A certificate that expired
            // while stored still loads: refusing it would stop the proxy
            // from starting (status and metrics report the expiry).
            let spec: CertificateSpec = decode_object(&key, &spec)?;
            let name = CertName::new(&name).map_err(|e| invalid_object(&key, e))?;
            ops.push(Op::PutCertificate { name, spec: Box::new(CertificateInput::Whole(spec)) });
            keys.push(key);
        }
        let state = rebuild(ops, &keys)?;
        Ok(Loaded { state, revision })
    }

    fn commit(&self, commit: &Commit<'_>) -> Result<(), StoreError> {
        let changes = commit.changes;
        let Some(last) = changes.last() else {
            return Ok(());
        };
        let mut conn = self.lock()?;
        let txn = conn.transaction().map_err(err)?;
        for op in changes.iter().flat_map(|c| &c.change.ops) {
            write_op(&txn, op, commit)?;
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
        // `revision`), so no separate counter is written either.
        let cutoff = last.revision.saturating_sub(LOG_RETAIN);
        if cutoff > 0 && last.revision / TRIM_EVERY != commit.base / TRIM_EVERY {
            txn.prepare_cached("DELETE FROM log WHERE revision <= ?1")
                .and_then(|mut s| s.execute(params![cutoff as i64]))
                .map_err(err)?;
        }
        txn.commit().map_err(err)
    }

    fn maintenance_due(&self) -> bool {
        self.wal_pages() >= CHECKPOINT_PAGES
    }

    fn commits_locally(&self) -> bool {
        true
    }

    fn maintain(&self) {
        if self.wal_pages() < CHECKPOINT_PAGES {
            return;
        }
        let Ok(conn) = self.lock() else { return };
        // One connection, no readers: a passive checkpoint copies the whole
        // log, and the next commit writes it again from its start.
        checkpointed(&self.wal_pages, self.wal_pages(), conn.wal_checkpoint_v2(Some("main"), CheckpointMode::PASSIVE));
    }

    fn status(&self) -> StoreStatus {
        StoreStatus::embedded(&self.path)
    }

    fn changes_since(&self, after: u64, limit: usize) -> Result<Vec<AppliedChange>, StoreError> {
        let conn = self.lock()?;
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
            let revision = revision(&conn)?;
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
        crate::suite::rule_sets_survive_reopening(|p| SqliteStore::open(&p.with_extension("sqlite")));
        crate::suite::listeners_survive_reopening(|p| SqliteStore::open(&p.with_extension("sqlite")));
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
        for i in 0..450 {
            // About 45 pages each: 450 commits cross the backstop.
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
            store.lock().unwrap().query_row("SELECT COUNT(*) FROM log", [], |r| r.get::<_, i64>(0)).unwrap() as u64
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

    #[test]
    fn an_existing_file_without_the_tables_is_refused_and_a_new_one_is_made_whole() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.sqlite");
        drop(with_service(&path));
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        assert!(!dir.path().join("c.sqlite.new").exists());

        let empty = dir.path().join("empty.sqlite");
        std::fs::write(&empty, b"").unwrap();
        let e = SqliteStore::open(&empty).err().expect("refused");
        assert!(matches!(&e, StoreError::NoSchema { what, .. } if what.contains("0 bytes")), "{e}");
        assert!(e.to_string().contains("empty.sqlite"), "{e}");
        assert_eq!(std::fs::metadata(&empty).unwrap().len(), 0, "left as it was");

        // Tables dropped behind Tidegate's back.
        {
            let conn = Connection::open(&path).unwrap();
            conn.execute_batch("PRAGMA journal_mode=DELETE; DROP TABLE routes; DROP TABLE log;").unwrap();
        }
        let e = SqliteStore::open(&path).err().expect("refused");
        assert!(e.to_string().contains("lacks the table(s) routes, log"), "{e}");
        {
            let conn = Connection::open(&path).unwrap();
            conn.execute_batch("DROP TABLE services; DROP TABLE backends; DROP TABLE meta; DROP TABLE certificates;")
                .unwrap();
        }
        let e = SqliteStore::open(&path).err().expect("refused");
        assert!(e.to_string().contains("holds none of the store's tables"), "{e}");
    }

    #[test]
    fn a_row_changed_behind_tidegate_is_refused_by_its_checksum() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.sqlite");
        {
            let (store, mut state, mut revision) = with_service(&path);
            let put = r#"{"ops":[{"op":"put_backend","service":"s","id":"a","spec":{"addr":"10.0.0.1:80"}}]}"#;
            commit_next(&store, &mut state, &mut revision, put);
            assert_eq!(store.load().unwrap().revision, 2);
        }
        // One bit of the address flipped ('1' is 0x31, '0' is 0x30).
        let conn = Connection::open(&path).unwrap();
        let flipped = br#"{"addr":"10.0.0.0:80"}"#.to_vec();
        conn.execute("UPDATE backends SET spec = ?1 WHERE id = 'a'", params![flipped]).unwrap();
        drop(conn);
        let e = SqliteStore::open(&path).unwrap().load().expect_err("refused");
        assert!(matches!(&e, StoreError::Damaged { table: "backends", key, .. } if key == "s/a"), "{e}");
        assert!(e.to_string().contains("c.sqlite: the backends row \"s/a\" does not match its checksum"), "{e}");
    }

    /// A row that does not validate (here written with its checksum, as by
    /// an older Tidegate or a tool) is refused at load, naming its key and
    /// field: the instance does not start on it.
    #[test]
    fn a_row_that_does_not_validate_is_refused_naming_its_key_and_field() {
        let cases = [
            ("services", "s", r#"{"timeouts":{"connect_ms":0}}"#, "services/s", "timeouts.connect_ms"),
            ("backends", "s/a", r#"{"addr":"nope"}"#, "backends/s/a", "addr"),
            ("backends", "s/a", r#"{"addr":"127.0.0.1:1","weight":10001}"#, "backends/s/a", "weight"),
            ("routes", "r", r#"{"match":{"path_prefix":"api"},"service":"s"}"#, "routes/r", "match.path_prefix"),
            ("routes", "r", r#"{"match":{"path_prefix":"/"},"service":"none"}"#, "routes/r", "service"),
        ];
        for (table, key, value, named, field) in cases {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("c.sqlite");
            drop(with_service(&path));
            let conn = Connection::open(&path).unwrap();
            let sum = row_sum(table, key, value.as_bytes());
            match table {
                "services" => conn.execute(
                    "UPDATE services SET settings = ?1, sum = ?2 WHERE name = ?3",
                    params![value.as_bytes(), sum, key],
                ),
                "backends" => conn.execute(
                    "INSERT INTO backends (service, id, spec, sum) VALUES ('s', 'a', ?1, ?2)",
                    params![value.as_bytes(), sum],
                ),
                _ => conn.execute(
                    "INSERT INTO routes (name, spec, sum) VALUES (?1, ?2, ?3)",
                    params![key, value.as_bytes(), sum],
                ),
            }
            .unwrap();
            drop(conn);
            let e = SqliteStore::open(&path).unwrap().load().expect_err("refused");
            assert!(
                matches!(&e, StoreError::Invalid { key, error } if key == named && error.field() == Some(field)),
                "{value}: {e}"
            );
            assert!(e.to_string().contains(&format!("{named} is invalid: {field}: ")), "{e}");
            assert!(e.to_string().contains("does not start"), "{e}");
        }
    }

    #[test]
    fn a_database_from_before_checksums_gets_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.sqlite");
        {
            let conn = Connection::open(&path).unwrap();
            conn.execute_batch(
                "CREATE TABLE services (name TEXT PRIMARY KEY, settings BLOB NOT NULL) WITHOUT ROWID;
                 CREATE TABLE backends (service TEXT NOT NULL, id TEXT NOT NULL, spec BLOB NOT NULL,
                     PRIMARY KEY (service, id)) WITHOUT ROWID;
                 CREATE TABLE routes (name TEXT PRIMARY KEY, spec BLOB NOT NULL) WITHOUT ROWID;
                 CREATE TABLE log (revision INTEGER PRIMARY KEY, change BLOB NOT NULL);
                 CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID;
                 INSERT INTO services VALUES ('s', X'7B7D');
                 INSERT INTO backends VALUES ('s', 'a', CAST('{\"addr\":\"10.0.0.1:80\"}' AS BLOB));
                 INSERT INTO meta VALUES ('revision', 4);",
            )
            .unwrap();
        }
        let store = SqliteStore::open(&path).unwrap();
        let loaded = store.load().unwrap();
        assert_eq!(loaded.revision, 4);
        assert_eq!(loaded.state.service("s").map(|s| s.backends.len()), Some(1));
        let unsummed: i64 = store
            .lock()
            .unwrap()
            .query_row("SELECT COUNT(*) FROM backends WHERE sum IS NULL", [], |r| r.get(0))
            .unwrap();
        assert_eq!(unsummed, 0);
    }

    #[test]
    fn a_database_from_before_certificates_gets_their_table() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.sqlite");
        drop(with_service(&path));
        Connection::open(&path).unwrap().execute_batch("DROP TABLE certificates;").unwrap();
        let loaded = SqliteStore::open(&path).unwrap().load().unwrap();
        assert_eq!(loaded.revision, 1);
    }

    #[test]
    fn a_second_opener_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.sqlite");
        let _first = SqliteStore::open(&path).unwrap();
        let second = SqliteStore::open(&path);
        assert!(matches!(&second, Err(StoreError::Locked { .. })), "{:?}", second.err());
        assert!(second.err().is_some_and(|e| e.to_string().contains("another Tidegate")));
    }

    #[test]
    fn a_released_store_lets_another_process_in_and_can_be_taken_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.sqlite");
        let (first, _, _) = with_service(&path);
        assert!(first.release().unwrap(), "an embedded store has something to hand over");
        assert!(matches!(first.load(), Err(StoreError::Released { .. })));
        assert!(first.load().unwrap_err().to_string().contains("handed over"));
        // The lock is free: another opener gets it, and sees the data.
        let second = SqliteStore::open(&path).unwrap();
        assert_eq!(second.load().unwrap().revision, 1);
        assert!(matches!(first.reacquire(), Err(StoreError::Locked { .. })));
        drop(second);
        first.reacquire().unwrap();
        assert_eq!(first.load().unwrap().revision, 1);
        assert!(matches!(SqliteStore::open(&path), Err(StoreError::Locked { .. })), "locked again");
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
