//! The embedded store, on redb.

use std::path::Path;

use redb::{Database, Durability, ReadableDatabase, ReadableTable, TableDefinition, TableHandle};
use tidegate_model::{Op, RouteSpec, ServiceSettings, ServiceSpec};

use crate::{
    decode_object, invalid_object, rebuild, AppliedChange, Commit, Loaded, Store, StoreError, StoreStatus, LOG_RETAIN,
};

/// Service settings (without backends), by service name.
const SERVICES: TableDefinition<&str, &[u8]> = TableDefinition::new("services");
/// Backends, keyed `service \0 id`, so a service's backends are one key range
/// and changing one backend writes one key.
const BACKENDS: TableDefinition<&str, &[u8]> = TableDefinition::new("backends");
/// Routes, by name.
const ROUTES: TableDefinition<&str, &[u8]> = TableDefinition::new("routes");
/// Applied change sets by revision, for watchers that reconnect.
const LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("log");
/// `revision`: the revision of the stored configuration.
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");

/// The resource tables of one write transaction.
struct Tables<'txn> {
    services: redb::Table<'txn, &'static str, &'static [u8]>,
    backends: redb::Table<'txn, &'static str, &'static [u8]>,
    routes: redb::Table<'txn, &'static str, &'static [u8]>,
}

/// The embedded default store: one redb file in the data directory.
pub struct RedbStore {
    db: Database,
    path: std::path::PathBuf,
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

fn backend_key(service: &str, id: &str) -> String {
    format!("{service}\0{id}")
}

impl RedbStore {
    /// Opens (creating if needed) the store file `path`.
    pub fn open(path: &Path) -> Result<RedbStore, StoreError> {
        let db = Database::create(path).map_err(err)?;
        let txn = db.begin_write().map_err(err)?;
        for t in [SERVICES, BACKENDS, ROUTES] {
            txn.open_table(t).map_err(err)?;
        }
        txn.open_table(LOG).map_err(err)?;
        txn.open_table(META).map_err(err)?;
        txn.commit().map_err(err)?;
        Ok(RedbStore { db, path: path.to_path_buf() })
    }

    /// Opens an existing store file `path` (to import it), refusing one
    /// that is empty or lacks the store's tables with
    /// [`StoreError::NoSchema`]: a data directory's `config.redb` that
    /// lost its contents must not be imported as an empty configuration.
    pub fn open_existing(path: &Path) -> Result<RedbStore, StoreError> {
        let no_schema = |what: String| StoreError::NoSchema { path: path.display().to_string(), what };
        let bytes = std::fs::metadata(path).map_err(|e| StoreError::Backend(format!("{}: {e}", path.display())))?.len();
        if bytes == 0 {
            return Err(no_schema("is an empty file (0 bytes), not a Tidegate store".into()));
        }
        let db = Database::open(path).map_err(|e| StoreError::Backend(format!("{}: {e}", path.display())))?;
        {
            let txn = db.begin_read().map_err(err)?;
            let mut missing = Vec::new();
            for t in [SERVICES, BACKENDS, ROUTES] {
                if txn.open_table(t).is_err() {
                    missing.push(t.name().to_string());
                }
            }
            if txn.open_table(LOG).is_err() {
                missing.push("log".into());
            }
            if txn.open_table(META).is_err() {
                missing.push("meta".into());
            }
            if !missing.is_empty() {
                return Err(no_schema(format!("lacks the table(s) {}", missing.join(", "))));
            }
        }
        Ok(RedbStore { db, path: path.to_path_buf() })
    }

    /// Writes one op of `commit` into the tables of an open transaction.
    fn write_op(tables: &mut Tables<'_>, op: &Op, commit: &Commit<'_>) -> Result<(), StoreError> {
        let Tables { services, backends, routes } = tables;
        let drop_backends = |backends: &mut redb::Table<&str, &[u8]>, service: &str| {
            let (lo, hi) = (format!("{service}\0"), format!("{service}\u{1}"));
            backends.retain_in(lo.as_str()..hi.as_str(), |_, _| false).map_err(err)
        };
        match op {
            Op::PutService { name, .. } => {
                let Some(spec) = commit.service_after(name) else { return Ok(()) };
                services.insert(name.as_str(), json(&spec.settings)?.as_slice()).map_err(err)?;
                drop_backends(backends, name.as_str())?;
                for (id, b) in &spec.backends {
                    let key = backend_key(name.as_str(), id.as_str());
                    backends.insert(key.as_str(), json(b)?.as_slice()).map_err(err)?;
                }
            }
            Op::DeleteService { name } => {
                services.remove(name.as_str()).map_err(err)?;
                drop_backends(backends, name.as_str())?;
            }
            Op::PutBackend { service, id, spec } => {
                let key = backend_key(service.as_str(), id.as_str());
                backends.insert(key.as_str(), json(spec)?.as_slice()).map_err(err)?;
            }
            Op::DeleteBackend { service, id } => {
                let key = backend_key(service.as_str(), id.as_str());
                backends.remove(key.as_str()).map_err(err)?;
            }
            Op::PutRoute { name, spec } => {
                routes.insert(name.as_str(), json(spec)?.as_slice()).map_err(err)?;
            }
            Op::DeleteRoute { name } => {
                routes.remove(name.as_str()).map_err(err)?;
            }
            // Older data directories had no certificates; this store is
            // kept to read them once, not to take new kinds of objects.
            Op::PutCertificate { .. }
            | Op::DeleteCertificate { .. }
            | Op::RenewCertificate { .. }
            | Op::AcmeState { .. } => {
                return Err(StoreError::Unsupported("the redb store does not hold certificates; use the SQLite store"));
            }
            Op::PutRules { .. } | Op::DeleteRules { .. } => {
                return Err(StoreError::Backend("the redb store does not hold rule sets; use the SQLite store".into()));
            }
            Op::PutListener { .. } | Op::DeleteListener { .. } => {
                return Err(StoreError::Unsupported("the redb store does not hold listeners; use the SQLite store"));
            }
        }
        Ok(())
    }
}

impl Store for RedbStore {
    fn load(&self) -> Result<Loaded, StoreError> {
        let txn = self.db.begin_read().map_err(err)?;
        let revision = txn.open_table(META).map_err(err)?.get("revision").map_err(err)?.map_or(0, |v| v.value());
        // Each object decodes through the model's one validated decode, as
        // a submitted one does, and the whole is rebuilt through the
        // model's own apply: a value that does not validate is refused,
        // naming its key and field, and the instance does not start on it.
        let mut ops = Vec::new();
        let mut keys = Vec::new();
        let backends = txn.open_table(BACKENDS).map_err(err)?;
        for row in txn.open_table(SERVICES).map_err(err)?.iter().map_err(err)? {
            let (name, settings) = row.map_err(err)?;
            let name = name.value().to_string();
            let key = format!("services/{name}");
            let settings: ServiceSettings = decode_object(&key, settings.value())?;
            let mut spec = ServiceSpec { settings, backends: Default::default() };
            let (lo, hi) = (format!("{name}\0"), format!("{name}\u{1}"));
            for b in backends.range(lo.as_str()..hi.as_str()).map_err(err)? {
                let (k, value) = b.map_err(err)?;
                let id = k.value().split_once('\0').map(|(_, id)| id).unwrap_or_default();
                let backend_key = format!("backends/{name}/{id}");
                let id = tidegate_model::BackendId::new(id).map_err(|e| invalid_object(&backend_key, e))?;
                spec.backends.insert(id, decode_object(&backend_key, value.value())?);
            }
            let name = tidegate_model::ServiceName::new(&name).map_err(|e| invalid_object(&key, e))?;
            ops.push(Op::PutService { name, spec: Box::new(spec) });
            keys.push(key);
        }
        for row in txn.open_table(ROUTES).map_err(err)?.iter().map_err(err)? {
            let (name, spec) = row.map_err(err)?;
            let key = format!("routes/{}", name.value());
            let name = tidegate_model::RouteName::new(name.value()).map_err(|e| invalid_object(&key, e))?;
            let spec: RouteSpec = decode_object(&key, spec.value())?;
            ops.push(Op::PutRoute { name, spec: Box::new(spec) });
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
        let mut txn = self.db.begin_write().map_err(err)?;
        txn.set_durability(Durability::Immediate).map_err(err)?;
        {
            let mut tables = Tables {
                services: txn.open_table(SERVICES).map_err(err)?,
                backends: txn.open_table(BACKENDS).map_err(err)?,
                routes: txn.open_table(ROUTES).map_err(err)?,
            };
            for op in changes.iter().flat_map(|c| &c.change.ops) {
                Self::write_op(&mut tables, op, commit)?;
            }
        }
        {
            let mut log = txn.open_table(LOG).map_err(err)?;
            for c in changes {
                log.insert(c.revision, json(c)?.as_slice()).map_err(err)?;
            }
            let cutoff = last.revision.saturating_sub(LOG_RETAIN);
            if cutoff > 0 {
                log.retain_in(..=cutoff, |_, _| false).map_err(err)?;
            }
            let mut meta = txn.open_table(META).map_err(err)?;
            meta.insert("revision", last.revision).map_err(err)?;
        }
        txn.commit().map_err(err)
    }

    fn commits_locally(&self) -> bool {
        true
    }

    fn status(&self) -> StoreStatus {
        StoreStatus::embedded(&self.path)
    }

    fn changes_since(&self, after: u64, limit: usize) -> Result<Vec<AppliedChange>, StoreError> {
        let txn = self.db.begin_read().map_err(err)?;
        let log = txn.open_table(LOG).map_err(err)?;
        let mut out = Vec::new();
        let rows = log.range(after + 1..).map_err(err)?.take(limit);
        for (expected, row) in (after + 1..).zip(rows) {
            let (rev, value) = row.map_err(err)?;
            if rev.value() != expected {
                return Err(StoreError::Compacted { oldest: rev.value() });
            }
            out.push(serde_json::from_slice(value.value()).map_err(corrupt)?);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_to_import_must_be_a_whole_store() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.redb");
        std::fs::write(&path, b"").unwrap();
        let e = RedbStore::open_existing(&path).err().expect("refused");
        assert!(matches!(&e, StoreError::NoSchema { what, .. } if what.contains("0 bytes")), "{e}");
        std::fs::remove_file(&path).unwrap();
        drop(RedbStore::open(&path).unwrap());
        assert_eq!(RedbStore::open_existing(&path).unwrap().load().unwrap().revision, 0);
        // A redb file without the store's tables.
        let other = dir.path().join("other.redb");
        drop(Database::create(&other).unwrap());
        let e = RedbStore::open_existing(&other).err().expect("refused");
        assert!(e.to_string().contains("lacks the table(s) services, backends, routes, log, meta"), "{e}");
    }

    #[test]
    fn the_shared_suite_passes() {
        crate::suite::run(|p| RedbStore::open(&p.with_extension("redb")));
    }
}
