//! The process provider's state file, `{state_dir}/{service}.instances.json`:
//! the instances it started, so that after a restart they can be adopted
//! or stopped. Written atomically (temporary file, fsync, rename); every
//! read-modify-write holds one process-wide lock, so two providers of the
//! same service (an old and a rebuilt one) never lose each other's records.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use super::file_part;

/// Serialises read-modify-write cycles of state files in this process.
static STATE_LOCK: Mutex<()> = Mutex::new(());

/// One started instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Record {
    /// The autoscaler's id.
    pub id: String,
    /// `127.0.0.1:{port}`.
    pub addr: String,
    /// The port it was given.
    pub port: u16,
    /// Its pid, which is also its process group id.
    pub pid: i32,
    /// Its start time from `/proc`, to recognise it after pid reuse.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<u64>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct StateFile {
    #[serde(default)]
    service: String,
    #[serde(default)]
    instances: Vec<Record>,
}

/// Why the state file could not be written.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// A file operation on `path` failed.
    #[error("{doing} {}: {source}", .path.display())]
    Io {
        /// What was being done: `creating the directory of`, `writing`, ...
        doing: &'static str,
        /// The state file.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// The records could not be encoded.
    #[error("encoding the instances: {0}")]
    Encode(#[source] serde_json::Error),
}

/// One service's state file.
#[derive(Debug, Clone)]
pub(crate) struct StateStore {
    path: PathBuf,
    service: String,
}

impl StateStore {
    pub fn new(dir: &Path, service: &str) -> StateStore {
        StateStore { path: dir.join(format!("{}.instances.json", file_part(service))), service: service.to_string() }
    }

    /// The records; none when the file is missing or unreadable (the
    /// latter logged).
    pub fn load(&self) -> Vec<Record> {
        let _guard = STATE_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        self.read()
    }

    /// Applies `change` to the records and writes them back; returns them.
    pub fn update(&self, change: impl FnOnce(&mut Vec<Record>)) -> Result<Vec<Record>, StateError> {
        let _guard = STATE_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let mut records = self.read();
        change(&mut records);
        self.write(&records)?;
        Ok(records)
    }

    fn read(&self) -> Vec<Record> {
        let bytes = match fs::read(&self.path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
            Err(e) => {
                tracing::warn!(path = %self.path.display(), error = %e, "cannot read the instances file");
                return Vec::new();
            }
        };
        match serde_json::from_slice::<StateFile>(&bytes) {
            Ok(file) => file.instances,
            Err(e) => {
                tracing::warn!(path = %self.path.display(), error = %e, "ignoring a corrupt instances file");
                Vec::new()
            }
        }
    }

    fn write(&self, records: &[Record]) -> Result<(), StateError> {
        let fail =
            |doing: &'static str, source: std::io::Error| StateError::Io { doing, path: self.path.clone(), source };
        if let Some(dir) = self.path.parent() {
            fs::create_dir_all(dir).map_err(|e| fail("creating the directory of", e))?;
        }
        let file = StateFile { service: self.service.clone(), instances: records.to_vec() };
        let json = serde_json::to_vec_pretty(&file).map_err(StateError::Encode)?;
        let mut tmp_name = self.path.clone().into_os_string();
        tmp_name.push(".tmp");
        let tmp = PathBuf::from(tmp_name);
        let mut out = fs::File::create(&tmp).map_err(|e| fail("creating a temporary file for", e))?;
        out.write_all(&json).and_then(|()| out.sync_all()).map_err(|e| fail("writing", e))?;
        fs::rename(&tmp, &self.path).map_err(|e| fail("replacing", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str, port: u16) -> Record {
        Record { id: id.into(), addr: format!("127.0.0.1:{port}"), port, pid: 4242, start_time: Some(7) }
    }

    #[test]
    fn records_round_trip_through_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::new(dir.path(), "web");
        assert!(store.load().is_empty());
        store.update(|r| r.push(record("a", 1))).unwrap();
        store.update(|r| r.push(record("b", 2))).unwrap();
        // Another store on the same directory (a restart) sees them.
        let again = StateStore::new(dir.path(), "web");
        assert_eq!(again.load(), vec![record("a", 1), record("b", 2)]);
        again.update(|r| r.retain(|x| x.id != "a")).unwrap();
        assert_eq!(store.load(), vec![record("b", 2)]);
        assert!(dir.path().join("web.instances.json").exists());
        assert!(!dir.path().join("web.instances.json.tmp").exists());
        // Another service has its own file.
        assert!(StateStore::new(dir.path(), "api").load().is_empty());
    }

    #[test]
    fn a_corrupt_file_reads_as_empty_and_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("web.instances.json"), b"{not json").unwrap();
        let store = StateStore::new(dir.path(), "web");
        assert!(store.load().is_empty());
        store.update(|r| r.push(record("a", 1))).unwrap();
        assert_eq!(store.load(), vec![record("a", 1)]);
    }

    #[test]
    fn a_write_that_fails_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        // The state directory is a file: nothing can be created in it.
        let blocked = dir.path().join("blocked");
        std::fs::write(&blocked, b"").unwrap();
        let store = StateStore::new(&blocked, "web");
        match store.update(|r| r.push(record("a", 1))) {
            Err(StateError::Io { path, .. }) => assert_eq!(path, blocked.join("web.instances.json")),
            other => panic!("{other:?}"),
        }
    }
}
