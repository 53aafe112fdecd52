//! Crash safety: what was acknowledged survives `kill -9`.

use serde_json::json;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_then_restart_restores_every_acknowledged_change() {
    let dir = tempfile::tempdir().unwrap();
    let b = Backend::start("durable", &[]);
    let tg = Tidegate::start(dir.path());
    route_to(&tg, "web", &[&b], "round_robin").await;
    // Many concurrent single changes, so several group commits carry many each.
    let mut tasks = Vec::new();
    let tg = std::sync::Arc::new(tg);
    for i in 0..300 {
        let tg = tg.clone();
        tasks.push(tokio::spawn(async move {
            let body = json!({"addr": format!("127.0.0.1:{}", 20000 + i)});
            tg.api("PUT", &format!("/v1/services/web/backends/n{i}"), Some(body)).await
        }));
    }
    let mut acked = 0;
    for t in tasks {
        let (s, _) = t.await.unwrap();
        assert_eq!(s, 200);
        acked += 1;
    }
    let tg = std::sync::Arc::into_inner(tg).expect("sole owner");
    let data = tg.data_dir.clone();
    tg.kill9();

    let tg = Tidegate::start(&data);
    let (_, config) = tg.api("GET", "/v1/config", None).await;
    assert_eq!(config["revision"], 2 + acked);
    assert_eq!(config["services"]["web"]["backends"].as_array().unwrap().len(), 301);
    // Routes are live again, and the emulator's backend b0 still serves.
    let (s, _) = tg.api("DELETE", "/v1/services/web", None).await;
    assert_eq!(s, 409, "the route still uses it");
    let r = get(&tg.url("/")).await;
    assert!(r.status == 200 || r.status == 502, "{}", r.status);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redb_data_directory_is_taken_over_once() {
    use tidegate_store::{AppliedChange, Commit, RedbStore, Store};
    let dir = tempfile::tempdir().unwrap();
    {
        // What an older Tidegate left: a redb store at revision 7.
        let old = RedbStore::open(&dir.path().join("config.redb")).unwrap();
        let text = r#"{"ops":[
            {"op":"put_service","name":"legacy","spec":{"backends":[{"id":"a","addr":"127.0.0.1:9"}]}},
            {"op":"put_route","name":"legacy","spec":{"match":{"path_prefix":"/old"},"service":"legacy"}}]}"#;
        let change = tidegate_model::parse_change_set(text.as_bytes()).unwrap();
        let (after, _) = tidegate_model::ConfigState::default().apply(&change, 6).unwrap();
        let changes = [AppliedChange { revision: 7, change }];
        let before = tidegate_model::ConfigState::default();
        old.commit(&Commit { base: 6, changes: &changes, before: &before, after: &after }).unwrap();
    }
    let tg = Tidegate::start(dir.path());
    let (_, config) = tg.api("GET", "/v1/config", None).await;
    assert_eq!(config["revision"], 7, "{config}");
    assert!(config["services"]["legacy"].is_object(), "{config}");
    assert!(dir.path().join("config.redb.imported").exists());
    assert!(!dir.path().join("config.redb").exists());
    // A change after the takeover continues the revision sequence, and
    // survives a restart.
    let (s, v) = tg.api("PUT", "/v1/services/legacy/backends/b", Some(json!({"addr": "127.0.0.1:10"}))).await;
    assert_eq!((s, v["revision"].clone()), (200, json!(8)));
    tg.kill9();
    let tg = Tidegate::start(dir.path());
    let (_, config) = tg.api("GET", "/v1/config", None).await;
    assert_eq!(config["revision"], 8);
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(dir.path().join("config.sqlite")).unwrap().permissions(),
    );
    assert_eq!(mode & 0o777, 0o600, "the store holds secrets (webhook keys): owner only");
}

/// A small tmpfs mounted for one test, unmounted when dropped.
struct SmallDisk(std::path::PathBuf);

impl SmallDisk {
    fn mount(size: &str) -> Option<SmallDisk> {
        let dir = tempfile::tempdir().ok()?.keep();
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&dir)
            .status()
            .is_ok_and(|s| s.success());
        ok.then_some(SmallDisk(dir))
    }

    /// Fills the disk to the last byte.
    fn fill(&self) {
        let _ = std::process::Command::new("dd")
            .args(["if=/dev/zero", "bs=64k"])
            .arg(format!("of={}", self.0.join("filler").display()))
            .stderr(std::process::Stdio::null())
            .status();
    }

    fn free(&self) {
        let _ = std::fs::remove_file(self.0.join("filler"));
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

async fn put(tg: &Tidegate, n: u32) -> (u16, serde_json::Value) {
    let body = json!({"backends": [{"id": "a", "addr": "127.0.0.1:9"}]});
    tg.api("PUT", &format!("/v1/services/s{n}"), Some(body)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_refuses_writes_and_they_resume_when_it_is_freed() {
    let Some(disk) = SmallDisk::mount("3m") else {
        eprintln!("skipped: cannot mount a tmpfs here (needs root)");
        return;
    };
    let data = disk.0.join("data");
    let tg = Tidegate::start(&data);
    assert_eq!(put(&tg, 1).await.0, 200);
    disk.fill();
    for n in 2..5 {
        let (s, v) = put(&tg, n).await;
        assert_eq!(s, 503, "{v}");
        assert!(v.to_string().contains("full"), "the error says why: {v}");
    }
    disk.free();
    let (s, v) = put(&tg, 5).await;
    assert_eq!((s, v["revision"].clone()), (200, json!(2)), "writes resume without a restart");
    tg.kill9();
    // Starting on a full disk still serves the last configuration.
    disk.fill();
    let tg = Tidegate::start(&data);
    let (_, config) = tg.api("GET", "/v1/config", None).await;
    assert_eq!(config["revision"], 2);
    assert_eq!(put(&tg, 6).await.0, 503);
    disk.free();
    assert_eq!(put(&tg, 7).await.0, 200);
    drop(tg);
}

/// An existing `config.sqlite` that is empty (0 bytes) or lost its tables
/// is refused at start, naming the file, rather than served as an empty
/// configuration whose revisions start again at 1; a new data directory
/// still starts empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_or_tableless_store_file_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let b = Backend::start("kept", &[]);
    let mut tg = Tidegate::start(&data);
    let (_, config) = tg.api("GET", "/v1/config", None).await;
    assert_eq!(config["revision"], 0, "a new data directory starts empty");
    route_to(&tg, "web", &[&b], "round_robin").await;
    tg.terminate();
    assert!(tg.wait_exit(std::time::Duration::from_secs(20)).is_some(), "stopped");
    let store = data.join("config.sqlite");
    let wal = data.join("config.sqlite-wal");
    let saved = std::fs::read(&store).unwrap();
    let saved_wal = std::fs::read(&wal).ok();
    let restore = || {
        std::fs::write(&store, &saved).unwrap();
        if let Some(w) = &saved_wal {
            std::fs::write(&wal, w).unwrap();
        }
    };

    std::fs::write(&store, b"").unwrap();
    let _ = std::fs::remove_file(&wal);
    let out = crate::config::serve_fails(&data, &[]);
    assert!(out.contains("config.sqlite is an empty file (0 bytes)"), "{out}");
    assert!(out.contains("refusing to serve it as an empty configuration"), "{out}");
    assert_eq!(std::fs::metadata(&store).unwrap().len(), 0, "left as found");

    // Tables dropped behind its back.
    restore();
    let dropped = std::process::Command::new("sqlite3")
        .arg(&store)
        .arg("DROP TABLE services; DROP TABLE backends; DROP TABLE routes;")
        .status()
        .expect("sqlite3 runs (apt-get install sqlite3)");
    assert!(dropped.success());
    let out = crate::config::serve_fails(&data, &[]);
    assert!(out.contains("config.sqlite lacks the table(s) services, backends, routes"), "{out}");

    // The file as it was starts as it was.
    restore();
    let tg = Tidegate::start(&data);
    assert_eq!(served_by(&get(&tg.url("/")).await), "kept");
}

/// A data directory (under `dir`) whose store holds service `web` over one
/// backend, written by a Tidegate that has exited since (the database is
/// edited only once the process let it go).
async fn stored_web_service(dir: &std::path::Path) -> (Backend, std::path::PathBuf) {
    let data = dir.join("data");
    let b = Backend::start("kept", &[]);
    let mut tg = Tidegate::start(&data);
    route_to(&tg, "web", &[&b], "round_robin").await;
    tg.terminate();
    assert!(tg.wait_exit(std::time::Duration::from_secs(20)).is_some(), "stopped");
    (b, data)
}

/// Runs one statement of the `sqlite3` shell on `store`.
fn sqlite3(store: &std::path::Path, sql: &str) {
    let out = std::process::Command::new("sqlite3")
        .arg(store)
        .arg(sql)
        .output()
        .expect("sqlite3 runs (apt-get install sqlite3)");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// A single bit flipped in a stored backend's address (the disk, or an
/// edit of the file) is refused at start, naming the row, rather than
/// loaded with a changed address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_bit_in_a_stored_row_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (b, data) = stored_web_service(dir.path()).await;
    let store = data.join("config.sqlite");
    // Everything into the database file itself (the -wal log's frames carry
    // their own checksums; the database's pages do not).
    sqlite3(&store, "PRAGMA wal_checkpoint(TRUNCATE);");
    let mut bytes = std::fs::read(&store).unwrap();
    let addr = b.addr.to_string().into_bytes();
    // Wherever it is (the backend's row, and the change log's copy).
    let found: Vec<usize> =
        (0..bytes.len().saturating_sub(addr.len())).filter(|&i| bytes[i..i + addr.len()] == addr[..]).collect();
    assert!(!found.is_empty(), "the address is in the file");
    for at in found {
        bytes[at + addr.len() - 1] ^= 1; // the port's last digit, one bit off
    }
    std::fs::write(&store, &bytes).unwrap();
    let out = crate::config::serve_fails(&data, &[]);
    assert!(out.contains("config.sqlite: the backends row \"web/b0\" does not match its checksum"), "{out}");
}

/// A stored service whose settings do not validate (a row without a
/// checksum, as a Tidegate from before checksums left it, edited) is
/// refused at start, naming its key and field: the instance does not start
/// on it. Before the one validated decode path, a service's settings were
/// decoded without their checks and such a row loaded and served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_service_that_does_not_validate_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let (_b, data) = stored_web_service(dir.path()).await;
    let store = data.join("config.sqlite");
    sqlite3(
        &store,
        r#"UPDATE services SET settings = CAST('{"timeouts":{"connect_ms":0}}' AS BLOB), sum = NULL WHERE name = 'web';"#,
    );
    let out = crate::config::serve_fails(&data, &[]);
    assert!(out.contains("not starting"), "{out}");
    assert!(
        out.contains("the stored object services/web is invalid: timeouts.connect_ms: must be 1..=86400000"),
        "{out}"
    );
}
