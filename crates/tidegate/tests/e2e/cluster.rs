//! Cluster mode against real etcd (Debian's `etcd-server`): several
//! Tidegate instances share one configuration through one etcd prefix.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::support::{get, send, try_send, wait_for, Backend, DownPort, Tidegate, TOKEN};

/// A port nobody listens on right now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

struct Member {
    name: String,
    client: u16,
    peer: u16,
    dir: PathBuf,
    child: Option<Child>,
}

/// An etcd cluster of real `etcd` processes on loopback, removed on drop.
pub(crate) struct Etcd {
    members: Vec<Member>,
    initial: String,
    /// Extra flags for every member (TLS).
    extra: Vec<String>,
    /// `http` or `https`.
    scheme: &'static str,
    /// curl's options to reach a member (TLS files).
    curl: Vec<String>,
    _dir: tempfile::TempDir,
}

impl Etcd {
    pub(crate) fn start(n: usize) -> Etcd {
        Self::start_with(n, Vec::new(), "http", Vec::new())
    }

    /// Starts `n` members on free ports. A port taken by another process
    /// between choosing it and etcd binding it makes a member exit; then
    /// the whole cluster starts again on new ports (a few times at most).
    fn start_with(n: usize, extra: Vec<String>, scheme: &'static str, curl: Vec<String>) -> Etcd {
        for _ in 0..3 {
            if let Some(etcd) = Self::try_start(n, extra.clone(), scheme, curl.clone()) {
                return etcd;
            }
        }
        panic!("an etcd cluster of {n} did not become healthy in three tries");
    }

    fn try_start(n: usize, extra: Vec<String>, scheme: &'static str, curl: Vec<String>) -> Option<Etcd> {
        let dir = tempfile::tempdir().expect("tempdir");
        let members: Vec<Member> = (0..n)
            .map(|i| Member {
                name: format!("m{i}"),
                client: free_port(),
                peer: free_port(),
                dir: dir.path().join(format!("m{i}")),
                child: None,
            })
            .collect();
        let initial =
            members.iter().map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer)).collect::<Vec<_>>().join(",");
        let mut etcd = Etcd { members, initial, extra, scheme, curl, _dir: dir };
        for i in 0..n {
            etcd.spawn(i);
        }
        (0..n).all(|i| etcd.wait_healthy(i)).then_some(etcd)
    }

    fn spawn(&mut self, i: usize) {
        let m = &self.members[i];
        let child = Command::new("etcd")
            .args(["--name", &m.name, "--data-dir"])
            .arg(&m.dir)
            .args(["--listen-client-urls", &format!("{}://127.0.0.1:{}", self.scheme, m.client)])
            .args(["--advertise-client-urls", &format!("{}://127.0.0.1:{}", self.scheme, m.client)])
            .args(["--listen-peer-urls", &format!("http://127.0.0.1:{}", m.peer)])
            .args(["--initial-advertise-peer-urls", &format!("http://127.0.0.1:{}", m.peer)])
            .args(["--initial-cluster", &self.initial, "--initial-cluster-state", "new"])
            .args(["--initial-cluster-token", &format!("tidegate-e2e-{}", self.members[0].peer)])
            // Fast elections on loopback; room for a 2,000-op change set.
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
            .args(["--max-txn-ops", "10000", "--max-request-bytes", "10485760"])
            .args(["--logger", "zap", "--log-level", "error"])
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("etcd runs (apt-get install etcd-server)");
        self.members[i].child = Some(child);
    }

    /// Whether member `i` answers healthy within 20 s (false at once if
    /// its process exited).
    fn wait_healthy(&mut self, i: usize) -> bool {
        let url = format!("{}://127.0.0.1:{}/health", self.scheme, self.members[i].client);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(child) = self.members[i].child.as_mut() {
                if child.try_wait().is_ok_and(|status| status.is_some()) {
                    eprintln!("etcd member {i} exited while starting (a port taken?)");
                    return false;
                }
            }
            let ok = std::process::Command::new("curl")
                .args(["-sf", "--max-time", "1", &url])
                .args(&self.curl)
                .output()
                .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("\"true\""));
            if ok {
                return true;
            }
            if Instant::now() >= deadline {
                eprintln!("etcd member {i} did not become healthy in 20 s");
                return false;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts a killed member again, on its data directory.
    fn restart(&mut self, i: usize) {
        self.spawn(i);
    }

    /// The store URL over these members.
    pub(crate) fn url(&self, members: &[usize], prefix: &str) -> String {
        let hosts: Vec<String> = members.iter().map(|&i| format!("127.0.0.1:{}", self.members[i].client)).collect();
        format!("etcd://{}/{prefix}", hosts.join(","))
    }

    /// Which member leads.
    async fn leader(&self) -> usize {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            for (i, m) in self.members.iter().enumerate().filter(|(_, m)| m.child.is_some()) {
                let url = format!("http://127.0.0.1:{}/v3/maintenance/status", m.client);
                if let Ok(r) = try_send("POST", &url, None, b"{}".to_vec(), &[]).await {
                    let v: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
                    if v["leader"].is_string() && v["leader"] == v["header"]["member_id"] {
                        return i;
                    }
                }
            }
            assert!(Instant::now() < deadline, "no etcd leader");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Compacts etcd's history up to its current revision.
    async fn compact(&self, member: usize) {
        let base = format!("http://127.0.0.1:{}", self.members[member].client);
        let r =
            send("POST", &format!("{base}/v3/kv/range"), None, json!({"key": "AA=="}).to_string().into(), &[]).await;
        let v: Value = serde_json::from_slice(&r.body).expect("json");
        let revision = v["header"]["revision"].as_str().expect("revision").to_string();
        let body = json!({ "revision": revision, "physical": true }).to_string();
        let r = send("POST", &format!("{base}/v3/kv/compaction"), None, body.into(), &[]).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}

/// A Tidegate instance in cluster mode.
pub(crate) fn instance(store: &str, extra: &[&str]) -> (Tidegate, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut args = vec!["--store", store];
    args.extend_from_slice(extra);
    (Tidegate::start_with(dir.path(), &args), dir)
}

/// Waits until `tg` has applied `revision`.
async fn converged(tg: &Tidegate, revision: u64) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (_, v) = tg.api("GET", "/v1/config", None).await;
        if v["revision"].as_u64().unwrap_or(0) >= revision {
            return;
        }
        assert!(Instant::now() < deadline, "instance {} stuck at {} (wanted {revision})", tg.admin, v["revision"]);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn service_with_route(tg: &Tidegate, backend: &Backend) -> u64 {
    let (s, v) = tg
        .api("PUT", "/v1/services/web", Some(json!({ "backends": [{ "id": "a", "addr": backend.addr.to_string() }] })))
        .await;
    assert_eq!(s, 200, "{v}");
    let (s, v) =
        tg.api("PUT", "/v1/routes/web", Some(json!({ "match": { "path_prefix": "/" }, "service": "web" }))).await;
    assert_eq!(s, 200, "{v}");
    v["revision"].as_u64().expect("revision")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_serve_what_any_of_them_was_told() {
    let etcd = Etcd::start(3);
    let store = format!("{}?max_txn_ops=10000", etcd.url(&[0, 1, 2], "tg"));
    let (a, _da) = instance(&store, &["--instance-name", "a"]);
    let (b, _db) = instance(&store, &["--instance-name", "b"]);
    let (c, _dc) = instance(&store, &["--instance-name", "c"]);
    let backend = Backend::start("one", &[]);

    // A change through A is live on B and C, each through its own proxy.
    let revision = service_with_route(&a, &backend).await;
    for tg in [&b, &c] {
        converged(tg, revision).await;
        let r = get(&tg.url("/hello")).await;
        assert_eq!((r.status, crate::support::served_by(&r)), (200, "one".to_string()), "{}", r.text());
    }

    // A 2,000-op change set through B is applied whole, at one revision, everywhere.
    let ops: Vec<Value> = (0..2000)
        .map(|i| json!({"op": "put_backend", "service": "web", "id": format!("n{i}"), "spec": {"addr": format!("127.0.0.1:{}", 10000 + i)}}))
        .collect();
    let (s, v) = b.api("POST", "/v1/changes", Some(json!({ "ops": ops }))).await;
    assert_eq!(s, 200, "{v}");
    let batch = v["revision"].as_u64().expect("revision");
    assert_eq!(batch, revision + 1, "one change set, one revision");
    for tg in [&a, &b, &c] {
        converged(tg, batch).await;
        let (_, v) = tg.api("GET", "/v1/services/web", None).await;
        assert_eq!(v["revision"], json!(batch));
        assert_eq!(v["spec"]["backends"].as_array().map(Vec::len), Some(2001), "{}", tg.admin);
    }

    // A change set larger than etcd takes in one transaction is refused
    // with 413 and the setting to raise; nothing is applied, and the
    // instance stays ready.
    let ops: Vec<Value> = (0..10_001)
        .map(|i| json!({"op": "put_backend", "service": "web", "id": format!("big{i}"), "spec": {"addr": "127.0.0.1:9"}}))
        .collect();
    let (s, v) = c.api("POST", "/v1/changes", Some(json!({ "ops": ops }))).await;
    assert_eq!(s, 413, "{v}");
    assert!(v["error"]["message"].as_str().unwrap_or("").contains("--max-txn-ops"), "{v}");
    assert_eq!(get(&c.admin_url("/readyz")).await.status, 200);
    let (_, v) = c.api("GET", "/v1/config", None).await;
    assert_eq!(v["revision"], json!(batch));

    // A stale if_revision is refused by every instance.
    for tg in [&a, &b, &c] {
        let stale = json!({ "if_revision": revision, "ops": [{"op": "delete_backend", "service": "web", "id": "n1"}] });
        let (s, v) = tg.api("POST", "/v1/changes", Some(stale)).await;
        assert_eq!(s, 409, "{v}");
    }

    // Writes through all three at once: every one is acknowledged, and all
    // three end with the same configuration at the same revision.
    let mut writes = Vec::new();
    for (k, tg) in [&a, &b, &c].into_iter().enumerate() {
        for i in 0..40 {
            let url = tg.admin_url(&format!("/v1/services/web/backends/w{k}-{i}"));
            let body = json!({ "addr": format!("127.0.0.1:{}", 20000 + k * 100 + i) }).to_string();
            writes.push(tokio::spawn(async move { send("PUT", &url, Some(TOKEN), body.into(), &[]).await.status }));
        }
    }
    for w in writes {
        assert_eq!(w.await.expect("task"), 200);
    }
    // Each change set got its own revision, and every instance applies them all.
    let last = batch + 120;
    converged(&a, last).await;
    let (_, v) = a.api("GET", "/v1/config", None).await;
    assert_eq!(v["revision"], json!(last), "no revision was taken twice");
    for tg in [&b, &c] {
        converged(tg, last).await;
        let (_, w) = tg.api("GET", "/v1/config", None).await;
        assert_eq!(w, v, "{} differs from a", tg.admin);
    }

    // Each instance lists the others in its status.
    let names = |status: &Value| {
        let mut names: Vec<String> = status["store"]["instances"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|i| i["name"].as_str().unwrap_or("").to_string())
            .collect();
        names.sort();
        names
    };
    // The list comes from each instance's heartbeat (every second).
    let status = wait_for("c lists a, b and c", Duration::from_secs(20), async || {
        let (_, status) = c.api("GET", "/v1/status", None).await;
        (names(&status) == ["a", "b", "c"]).then_some(status)
    })
    .await;
    assert_eq!(status["store"]["kind"], "etcd", "{status}");
    assert_eq!(status["store"]["connected"], true, "{status}");
}

/// Sends requests through every proxy until stopped; counts failures.
fn load(
    proxies: Vec<String>,
    stop: Arc<AtomicBool>,
    failures: Arc<AtomicU64>,
    served: Arc<AtomicU64>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while !stop.load(Relaxed) {
            for url in &proxies {
                match try_send("GET", url, None, Vec::new(), &[]).await {
                    Ok(r) if r.status == 200 => served.fetch_add(1, Relaxed),
                    _ => failures.fetch_add(1, Relaxed),
                };
            }
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_etcd_never_stops_the_proxies() {
    let mut etcd = Etcd::start(3);
    let store = etcd.url(&[0, 1, 2], "tg");
    let (a, _da) = instance(&store, &[]);
    let (b, _db) = instance(&store, &[]);
    let backend = Backend::start("one", &[]);
    let revision = service_with_route(&a, &backend).await;
    converged(&b, revision).await;

    let (stop, failures, served) = (Arc::new(AtomicBool::new(false)), Arc::default(), Arc::default());
    let traffic = load(vec![a.url("/x"), b.url("/x")], stop.clone(), Arc::clone(&failures), Arc::clone(&served));

    // The etcd leader dies: writes continue once the others elect one.
    let leader = etcd.leader().await;
    etcd.kill(leader);
    let deadline = Instant::now() + Duration::from_secs(15);
    let after_leader = loop {
        let (s, v) = b.api("PUT", "/v1/services/web/backends/after-leader", Some(json!({"addr": "127.0.0.1:9"}))).await;
        if s == 200 {
            break v["revision"].as_u64().expect("revision");
        }
        assert_eq!(s, 503, "{v}");
        assert!(Instant::now() < deadline, "no write succeeded after the leader died: {v}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    converged(&a, after_leader).await;

    // Every member stops: the proxies keep serving, writes are refused
    // clearly, readiness and status say why.
    for i in 0..3 {
        etcd.kill(i);
    }
    let (s, v) = a.api("PUT", "/v1/services/web/backends/lost", Some(json!({"addr": "127.0.0.1:9"}))).await;
    assert_eq!(s, 503, "{v}");
    assert!(v["error"]["message"].as_str().unwrap_or("").contains("unavailable"), "{v}");
    // Each instance tells once its watch has seen the connection go.
    wait_for("a's readiness says the store is gone", Duration::from_secs(20), async || {
        (get(&a.admin_url("/readyz")).await.status == 503).then_some(())
    })
    .await;
    wait_for("b's status says the store is gone", Duration::from_secs(20), async || {
        let (_, status) = b.api("GET", "/v1/status", None).await;
        (status["store"]["connected"] == false).then_some(())
    })
    .await;

    // etcd comes back: both instances reconnect, and writes flow again.
    for i in 0..3 {
        etcd.restart(i);
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let back = loop {
        let (s, v) = a.api("PUT", "/v1/services/web/backends/back", Some(json!({"addr": "127.0.0.1:10"}))).await;
        if s == 200 {
            break v["revision"].as_u64().expect("revision");
        }
        assert!(Instant::now() < deadline, "writes did not resume: {v}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    converged(&b, back).await;
    stop.store(true, Relaxed);
    traffic.await.expect("load");
    assert_eq!(failures.load(Relaxed), 0, "proxied requests failed ({} served)", served.load(Relaxed));
    assert!(served.load(Relaxed) > 100, "the load ran");
    let (_, va) = a.api("GET", "/v1/config", None).await;
    let (_, vb) = b.api("GET", "/v1/config", None).await;
    assert_eq!(va, vb);
    let ids: Vec<&str> = va["services"]["web"]["backends"]
        .as_array()
        .expect("backends")
        .iter()
        .filter_map(|b| b["id"].as_str())
        .collect();
    assert_eq!(ids, ["a", "after-leader", "back"], "nothing acknowledged was lost, nothing refused appeared");
    let r = get(&b.admin_url("/readyz")).await;
    assert_eq!(r.status, 200, "{}", r.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_cut_off_past_the_history_reloads_and_converges() {
    let mut etcd = Etcd::start(3);
    // C reaches etcd only through one follower, and keeps a short history
    // (a leader's death is the other test's business).
    let leader = etcd.leader().await;
    let cut = (leader + 1) % 3;
    let others: Vec<usize> = (0..3).filter(|&i| i != cut).collect();
    let (a, _da) = instance(&format!("{}?history=20", etcd.url(&others, "tg")), &[]);
    let (c, _dc) = instance(&format!("{}?history=20", etcd.url(&[cut], "tg")), &[]);
    let backend = Backend::start("one", &[]);
    let revision = service_with_route(&a, &backend).await;
    converged(&c, revision).await;

    etcd.kill(cut);
    // Far more change sets than the history keeps, while C is cut off.
    for i in 0..150 {
        let (s, v) =
            a.api("PUT", &format!("/v1/services/web/backends/n{i}"), Some(json!({"addr": "127.0.0.1:9"}))).await;
        assert_eq!(s, 200, "{v}");
    }
    let (_, s) = a.api("DELETE", "/v1/services/web/backends/n0", None).await;
    let last = s["revision"].as_u64().expect("revision");
    etcd.compact(leader).await;
    // C still serves what it had.
    let r = get(&c.url("/still")).await;
    assert_eq!(r.status, 200);

    etcd.restart(cut);
    converged(&c, last).await;
    let (_, va) = a.api("GET", "/v1/config", None).await;
    let (_, vc) = c.api("GET", "/v1/config", None).await;
    assert_eq!(va, vc);
    let metrics = send("GET", &c.admin_url("/metrics"), Some(TOKEN), Vec::new(), &[]).await.text();
    assert!(
        metrics.lines().any(|l| l.starts_with("tidegate_config_reloads_total ") && !l.ends_with(" 0")),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_instance_loses_no_acknowledged_change() {
    let etcd = Etcd::start(1);
    let store = etcd.url(&[0], "tg");
    let (a, _da) = instance(&store, &[]);
    let (b, _db) = instance(&store, &[]);
    let (s, _) = a.api("PUT", "/v1/services/web", Some(json!({}))).await;
    assert_eq!(s, 200);
    // Writers through A; A is killed in the middle of them.
    let mut writes = Vec::new();
    for i in 0..200 {
        let url = a.admin_url(&format!("/v1/services/web/backends/k{i}"));
        writes.push(tokio::spawn(async move {
            let body = json!({ "addr": "127.0.0.1:9" }).to_string();
            (i, try_send("PUT", &url, Some(TOKEN), body.into(), &[]).await.map(|r| r.status))
        }));
        if i == 100 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    a.kill9();
    let mut acknowledged = Vec::new();
    for w in writes {
        if let (i, Ok(200)) = w.await.expect("task") {
            acknowledged.push(format!("k{i}"));
        }
    }
    // A restarted instance loads whatever reached etcd; B catches up to it.
    let (a2, _da2) = instance(&store, &[]);
    let (_, config) = a2.api("GET", "/v1/config", None).await;
    converged(&b, config["revision"].as_u64().expect("a revision")).await;
    let (_, v) = b.api("GET", "/v1/services/web", None).await;
    let present: Vec<String> = v["spec"]["backends"]
        .as_array()
        .expect("backends")
        .iter()
        .filter_map(|b| b["id"].as_str().map(String::from))
        .collect();
    for id in &acknowledged {
        assert!(present.contains(id), "{id} was acknowledged but is gone");
    }
    // The restarted instance serves the same.
    let (_, v2) = a2.api("GET", "/v1/services/web", None).await;
    assert_eq!(v2, v);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedded_store_moves_into_etcd_and_seeding_happens_once() {
    let etcd = Etcd::start(1);
    // An embedded store with a configuration, then stopped.
    let dir = tempfile::tempdir().expect("tempdir");
    let embedded = Tidegate::start(dir.path());
    let backend = Backend::start("one", &[]);
    let revision = service_with_route(&embedded, &backend).await;
    let (_, before) = embedded.api("GET", "/v1/config", None).await;
    drop(embedded);

    let copy = |to: &str| {
        Command::new(env!("CARGO_BIN_EXE_tidegate"))
            .args(["store", "copy", "--from"])
            .arg(dir.path())
            .args(["--to", to])
            .output()
            .expect("runs")
    };
    let store = etcd.url(&[0], "moved");
    let out = copy(&store);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains(&format!("copied revision {revision}")));
    // Never over a configuration that is there.
    let again = copy(&store);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already holds a configuration"));

    let (moved, _dm) = instance(&store, &[]);
    let (_, after) = moved.api("GET", "/v1/config", None).await;
    assert_eq!(after, before, "the same configuration at the same revision");
    assert_eq!(get(&moved.url("/")).await.status, 200);
    let (s, v) = moved.api("PUT", "/v1/services/web/backends/b", Some(json!({"addr": "127.0.0.1:9"}))).await;
    assert_eq!((s, v["revision"].as_u64()), (200, Some(revision + 1)));

    // Two instances started together with a seed file on an empty prefix
    // seed it once.
    let seed = dir.path().join("seed.json");
    std::fs::write(&seed, r#"{"services": {"s": {"backends": [{"id": "x", "addr": "127.0.0.1:9"}]}}}"#).expect("write");
    let fresh = etcd.url(&[0], "fresh");
    let seed_arg = seed.to_string_lossy().to_string();
    let (x, _dx) = instance(&fresh, &["--config", &seed_arg]);
    let (y, _dy) = instance(&fresh, &["--config", &seed_arg]);
    converged(&y, 1).await;
    for tg in [&x, &y] {
        let (_, v) = tg.api("GET", "/v1/config", None).await;
        assert_eq!(v["revision"], 1, "{v}");
    }
}

#[test]
fn a_bad_store_url_or_an_unreachable_etcd_stops_the_start_with_the_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    let run = |store: &str| {
        Command::new(env!("CARGO_BIN_EXE_tidegate"))
            .args(["serve", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--store", store, "--data-dir"])
            .arg(dir.path())
            .env("TIDEGATE_ADMIN_TOKEN", TOKEN)
            .output()
            .expect("runs")
    };
    let out = run("etcd://127.0.0.1:2379");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("key prefix"), "{}", String::from_utf8_lossy(&out.stderr));
    let down = DownPort::new();
    let out = run(&format!("etcd://{}/tg", down.addr));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unavailable") && err.contains(&down.addr.port().to_string()), "{err}");
}

/// Shell scripts standing in for shared infrastructure: they start backend
/// emulators detached from any Tidegate and keep one record file per
/// instance in `dir`, so every instance (and the test) sees the same ones.
fn command_provider(dir: &std::path::Path) -> Value {
    let emulator = crate::support::bin_dir().join("tidegate-emulator");
    let write = |name: &str, body: String| {
        let path = dir.join(name);
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).expect("write script");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        path.to_string_lossy().into_owned()
    };
    let records = dir.join("records");
    std::fs::create_dir_all(&records).expect("records dir");
    let r = records.to_string_lossy();
    let start = write(
        "start.sh",
        format!(
            "set -e\nid=$1\nport=$(( 0x${{id##*-}} % 4000 + 24000 ))\n{} --listen 127.0.0.1:$port --name $id --threads 1 >/dev/null 2>&1 </dev/null &\necho \"$! 127.0.0.1:$port\" > {r}/$id\necho \"{{\\\"addr\\\": \\\"127.0.0.1:$port\\\"}}\"",
            emulator.display()
        ),
    );
    let stop = write(
        "stop.sh",
        format!("[ -e {r}/$1 ] || exit 0\nkill $(cut -d' ' -f1 {r}/$1) 2>/dev/null || true\nrm -f {r}/$1"),
    );
    let list = write(
        "list.sh",
        format!(
            "first=1\nprintf '['\nfor f in {r}/*; do\n  [ -e \"$f\" ] || continue\n  read pid addr < \"$f\"\n  [ $first = 1 ] || printf ','\n  first=0\n  printf '{{\"id\":\"%s\",\"addr\":\"%s\"}}' \"${{f##*/}}\" \"$addr\"\ndone\nprintf ']'"
        ),
    );
    json!({"kind": "command", "start": [start, "{id}"], "stop": [stop, "{id}"], "list": [list]})
}

/// Stops every instance the scripts started.
struct Records(PathBuf);

impl Records {
    fn count(&self) -> usize {
        std::fs::read_dir(&self.0).map(|d| d.count()).unwrap_or(0)
    }
}

impl Drop for Records {
    fn drop(&mut self) {
        for entry in std::fs::read_dir(&self.0).into_iter().flatten().flatten() {
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            if let Some(pid) = text.split_whitespace().next() {
                let _ = Command::new("kill").args(["-9", pid]).status();
            }
        }
    }
}

async fn event_kinds(tg: &Tidegate) -> Vec<String> {
    let (_, v) = tg.api("GET", "/v1/events", None).await;
    v["events"].as_array().into_iter().flatten().filter_map(|e| e["kind"].as_str().map(String::from)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_instance_scales_a_service_and_another_takes_over_when_it_dies() {
    let etcd = Etcd::start(1);
    let store = etcd.url(&[0], "tg");
    let scripts = tempfile::tempdir().expect("tempdir");
    let provider = command_provider(scripts.path());
    let records = Records(scripts.path().join("records"));
    let (a, _da) = instance(&store, &["--instance-name", "a"]);
    let (b, _db) = instance(&store, &["--instance-name", "b"]);
    let base = Backend::start("base", &[]);
    let spec = json!({
        "policy": {"kind": "least_conn"},
        "autoscale": {"provider": provider, "min": 1, "max": 4, "pinned": 3,
                      "ready": {"path": "/health", "interval_ms": 100, "timeout_s": 10}},
        "backends": [{"id": "base", "addr": base.addr.to_string()}],
    });
    let (s, v) = a.api("PUT", "/v1/services/app", Some(spec)).await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = a.api("PUT", "/v1/routes/app", Some(json!({"service": "app"}))).await;
    assert_eq!(s, 200, "{v}");

    // Exactly one instance scales: two instances started (three backends
    // with the static one), not four.
    let autoscaled = |v: &Value| {
        v["spec"]["backends"].as_array().map_or(0, |b| b.iter().filter(|b| b["autoscaled"] == true).count())
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, v) = b.api("GET", "/v1/services/app", None).await;
        if autoscaled(&v) == 2 {
            break;
        }
        assert!(Instant::now() < deadline, "no two autoscaled backends: {v}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(records.count(), 2, "one leader, one set of instances");
    let (leader, follower) = if event_kinds(&a).await.contains(&"leader".to_string()) { (a, b) } else { (b, a) };
    assert!(!event_kinds(&follower).await.contains(&"leader".to_string()));

    // The leader dies: within its lease's 5 s the other takes over, adopts
    // both instances, and starts none.
    leader.kill9();
    let deadline = Instant::now() + Duration::from_secs(12);
    while !event_kinds(&follower).await.contains(&"leader".to_string()) {
        assert!(Instant::now() < deadline, "no takeover: {:?}", event_kinds(&follower).await);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let adopted = |kinds: &[String]| kinds.iter().filter(|k| *k == "adopted").count();
    let deadline = Instant::now() + Duration::from_secs(20);
    while adopted(&event_kinds(&follower).await) < 2 {
        assert!(Instant::now() < deadline, "the new leader adopted: {:?}", event_kinds(&follower).await);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // What it did not do, a moment after it adopted both.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let kinds = event_kinds(&follower).await;
    assert_eq!(adopted(&kinds), 2, "{kinds:?}");
    assert!(!kinds.contains(&"started".to_string()), "{kinds:?}");
    assert_eq!(records.count(), 2, "no duplicate instances");
    let (_, v) = follower.api("GET", "/v1/services/app", None).await;
    assert_eq!(autoscaled(&v), 2, "{v}");
    assert_eq!(get(&follower.url("/")).await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_with_authentication_takes_a_user_and_refuses_a_wrong_password() {
    let etcd = Etcd::start(1);
    let base = format!("http://127.0.0.1:{}/v3/auth", etcd.members[0].client);
    for (path, body) in [
        ("user/add", json!({"name": "root", "password": "s3cret-pw"})),
        ("role/add", json!({"name": "root"})),
        ("user/grant", json!({"user": "root", "role": "root"})),
        ("enable", json!({})),
    ] {
        let r = send("POST", &format!("{base}/{path}"), None, body.to_string().into(), &[]).await;
        assert_eq!(r.status, 200, "{path}: {}", r.text());
    }
    let store = etcd.url(&[0], "tg");
    let start = |password: &str| {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tidegate"));
        cmd.args(["serve", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--store", &store])
            .args(["--etcd-user", "root", "--data-dir"])
            .arg(dir.path())
            .env("TIDEGATE_ADMIN_TOKEN", TOKEN)
            .env("TIDEGATE_ETCD_PASSWORD", password);
        (cmd, dir)
    };
    let (mut wrong, _d) = start("not-it");
    let out = wrong.output().expect("runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("authentication failed"), "{err}");

    // The right password: writes, and another instance follows them.
    let password = tempfile::NamedTempFile::new().expect("a file");
    std::fs::write(password.path(), "s3cret-pw\n").expect("write");
    let pw = password.path().to_string_lossy().to_string();
    let (a, _da) = instance(&store, &["--etcd-user", "root", "--etcd-password-file", &pw]);
    let (b, _db) = instance(&store, &["--etcd-user", "root", "--etcd-password-file", &pw]);
    let backend = Backend::start("one", &[]);
    let revision = service_with_route(&a, &backend).await;
    converged(&b, revision).await;
    assert_eq!(get(&b.url("/")).await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_over_tls_with_client_certificates() {
    let ca = crate::tls::Ca::new();
    let server = ca.leaf(&["127.0.0.1", "localhost"]);
    let client = ca.leaf(&["tidegate"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let file = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).expect("write");
        p.to_string_lossy().to_string()
    };
    let (ca_pem, server_cert, server_key) =
        (file("ca.pem", &ca.pem()), file("server.pem", &server.cert_pem), file("server.key", &server.key_pem));
    let (client_cert, client_key) = (file("client.pem", &client.cert_pem), file("client.key", &client.key_pem));
    let flags =
        ["--cert-file", &server_cert, "--key-file", &server_key, "--trusted-ca-file", &ca_pem, "--client-cert-auth"];
    let curl = ["--cacert", &ca_pem, "--cert", &client_cert, "--key", &client_key];
    let etcd = Etcd::start_with(
        1,
        flags.iter().map(|s| s.to_string()).collect(),
        "https",
        curl.iter().map(|s| s.to_string()).collect(),
    );
    let store = etcd.url(&[0], "tg");
    let tls = ["--etcd-ca", &ca_pem, "--etcd-cert", &client_cert, "--etcd-key", &client_key];
    let (a, _da) = instance(&store, &tls);
    let (b, _db) = instance(&store, &tls);
    let backend = Backend::start("one", &[]);
    let revision = service_with_route(&a, &backend).await;
    converged(&b, revision).await;
    assert_eq!(get(&b.url("/")).await.status, 200);

    // Without the client certificate, etcd refuses the connection: the start fails and says why.
    let data = tempfile::tempdir().expect("tempdir");
    let out = Command::new(env!("CARGO_BIN_EXE_tidegate"))
        .args(["serve", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--store", &store, "--etcd-ca", &ca_pem])
        .arg("--data-dir")
        .arg(data.path())
        .env("TIDEGATE_ADMIN_TOKEN", TOKEN)
        .output()
        .expect("runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unavailable") || err.contains("certificate"), "{err}");
}

impl Etcd {
    /// Runs `etcdctl` against member `i`; its standard output.
    fn ctl(&self, i: usize, args: &[&str]) -> String {
        let out = Command::new("etcdctl")
            .args(["--endpoints", &format!("127.0.0.1:{}", self.members[i].client)])
            .args(args)
            .env("ETCDCTL_API", "3")
            .output()
            .expect("etcdctl runs (apt-get install etcd-client)");
        assert!(out.status.success(), "etcdctl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

/// Polls `tg`'s `/v1/status` until its store faults name `key` with
/// `kind` (or, with `None`, until it has none); the status.
async fn store_fault(tg: &Tidegate, fault: Option<(&str, &str)>) -> Value {
    crate::support::wait_for(
        &format!("{} reports the store fault {fault:?}", tg.admin),
        Duration::from_secs(15),
        async || {
            let (_, status) = tg.api("GET", "/v1/status", None).await;
            let faults = status["store"]["faults"].as_array().cloned().unwrap_or_default();
            let found = match fault {
                None => faults.is_empty(),
                Some((key, kind)) => faults.iter().any(|f| f["key"] == key && f["kind"] == kind),
            };
            found.then_some(status)
        },
    )
    .await
}

/// Runs `serve` on the store; expects it to refuse to start; its output.
fn start_refused(store: &str) -> String {
    let dir = tempfile::tempdir().expect("tempdir");
    crate::config::serve_fails(dir.path(), &["--store", store])
}

/// Values that do not validate, written straight into etcd by anything with
/// access to it (a service, a backend, a route): every running instance
/// refuses them with a store fault naming the key and the field (status,
/// metrics, `/readyz` 503), the proxy keeps serving the last valid
/// configuration, and a new instance does not start on them, saying why.
/// Before the one validated decode path, a service's settings decoded
/// without their checks (a `connect_ms` of 0 loaded and started).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_values_written_into_etcd_are_refused_naming_key_and_field() {
    let etcd = Etcd::start(1);
    let store = etcd.url(&[0], "tg");
    let (a, _da) = instance(&store, &[]);
    let (b, _db) = instance(&store, &[]);
    let backend = Backend::start("one", &[]);
    let revision = service_with_route(&a, &backend).await;
    converged(&b, revision).await;
    let addr = backend.addr.to_string();
    let cases = [
        ("tg/services/web", json!({"timeouts": {"connect_ms": 0}}), "timeouts.connect_ms: must be 1..=86400000"),
        ("tg/backends/web/a", json!({"addr": "nope"}), "addr: invalid address \"nope\""),
        ("tg/routes/web", json!({"match": {"path_prefix": "api"}, "service": "web"}), "match.path_prefix: \"api\""),
    ];
    for (key, value, field) in cases {
        etcd.ctl(0, &["put", key, &value.to_string()]);
        for tg in [&a, &b] {
            let status = store_fault(tg, Some((key, "object_invalid"))).await;
            let faults = status["store"]["faults"].as_array().cloned().unwrap_or_default();
            let message = faults.iter().find(|f| f["key"] == key).and_then(|f| f["message"].as_str()).unwrap_or("");
            assert!(message.contains(&format!("the stored object is invalid: {field}")), "{key}: {message}");
            let r = get(&tg.admin_url("/readyz")).await;
            assert_eq!(r.status, 503, "{}", r.text());
            let metrics = send("GET", &tg.admin_url("/metrics"), Some(TOKEN), Vec::new(), &[]).await.text();
            let line = format!(r#"tidegate_store_fault{{key="{key}",kind="object_invalid"}} 1"#);
            assert!(metrics.contains(&line) && metrics.contains("tidegate_store_faults 1"), "{metrics}");
            assert_eq!(crate::support::served_by(&get(&tg.url("/")).await), "one", "the last valid configuration");
        }
        let out = start_refused(&store);
        assert!(out.contains("not starting"), "{out}");
        assert!(out.contains(&format!("{key}: the stored object is invalid: {field}")), "{out}");
        // A write through Tidegate that names the object puts it back.
        let (s, v) = match key {
            "tg/services/web" => {
                a.api("PUT", "/v1/services/web", Some(json!({"backends": [{"id": "a", "addr": addr}]}))).await
            }
            "tg/backends/web/a" => a.api("PUT", "/v1/services/web/backends/a", Some(json!({"addr": addr}))).await,
            _ => a.api("PUT", "/v1/routes/web", Some(json!({"match": {"path_prefix": "/"}, "service": "web"}))).await,
        };
        assert_eq!(s, 200, "{v}");
        for tg in [&a, &b] {
            store_fault(tg, None).await;
            assert_eq!(get(&tg.admin_url("/readyz")).await.status, 200);
        }
    }
    let (c, _dc) = instance(&store, &[]);
    assert_eq!(crate::support::served_by(&get(&c.url("/")).await), "one");
}

/// States of etcd that Tidegate never leaves it in (`rev` lowered or
/// deleted, as after restoring part of a snapshot; a log entry that is not
/// a change set; an object edited or deleted with etcdctl) are store faults:
/// every running instance sees them, `/readyz` answers 503, status and
/// metrics name the key, writes are refused with that reason (not "other
/// instances kept changing the configuration first"), no log entry is ever
/// overwritten, and a new instance refuses to start, naming the key. Once
/// repaired, everything is as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_faults_in_etcd_are_named_and_refuse_writes() {
    let etcd = Etcd::start(1);
    let store = etcd.url(&[0], "tg");
    let (a, _da) = instance(&store, &[]);
    let (b, _db) = instance(&store, &[]);
    let backend = Backend::start("one", &[]);
    let revision = service_with_route(&a, &backend).await;
    assert_eq!(revision, 2);
    converged(&b, revision).await;
    let first_log = etcd.ctl(0, &["get", "tg/log/00000000000000000001", "--print-value-only"]);

    // `rev` lowered below the log.
    etcd.ctl(0, &["put", "tg/rev", "1"]);
    for tg in [&a, &b] {
        store_fault(tg, Some(("tg/rev", "rev_behind_log"))).await;
        let r = get(&tg.admin_url("/readyz")).await;
        assert_eq!(r.status, 503, "{}", r.text());
        assert!(r.text().contains("tg/rev") && r.text().contains("store fault"), "{}", r.text());
        let metrics = send("GET", &tg.admin_url("/metrics"), Some(TOKEN), Vec::new(), &[]).await.text();
        assert!(metrics.contains(r#"tidegate_store_fault{key="tg/rev",kind="rev_behind_log"} 1"#), "{metrics}");
        assert!(metrics.contains("tidegate_store_faults 1"), "{metrics}");
    }
    let (s, v) = a.api("PUT", "/v1/services/web/backends/x", Some(json!({"addr": "127.0.0.1:9"}))).await;
    assert_eq!(s, 503, "{v}");
    let message = v["error"]["message"].as_str().unwrap_or("");
    assert!(message.contains("store fault: tg/rev: the revision key says 1"), "{v}");
    assert!(!message.contains("kept changing"), "{v}");
    let out = start_refused(&store);
    assert!(out.contains("tg/rev") && out.contains("the log holds change sets up to revision 2"), "{out}");
    assert_eq!(
        etcd.ctl(0, &["get", "tg/log/00000000000000000001", "--print-value-only"]),
        first_log,
        "no log entry is overwritten"
    );
    assert_eq!(get(&a.url("/")).await.status, 200, "the proxy serves on");

    // Deleted.
    etcd.ctl(0, &["del", "tg/rev"]);
    store_fault(&b, Some(("tg/rev", "rev_missing"))).await;
    let (s, v) = b.api("PUT", "/v1/services/web/backends/x", Some(json!({"addr": "127.0.0.1:9"}))).await;
    assert_eq!(s, 503, "{v}");
    let out = start_refused(&store);
    assert!(out.contains("tg/rev: the revision key is missing"), "{out}");

    // Repaired: ready again everywhere, writes flow.
    etcd.ctl(0, &["put", "tg/rev", "2"]);
    for tg in [&a, &b] {
        store_fault(tg, None).await;
        assert_eq!(get(&tg.admin_url("/readyz")).await.status, 200);
    }
    let (s, v) = a.api("PUT", "/v1/services/web/backends/x", Some(json!({"addr": "127.0.0.1:9"}))).await;
    assert_eq!((s, v["revision"].as_u64()), (200, Some(3)), "{v}");
    converged(&b, 3).await;

    // A log entry that is not a change set, where the next commit goes.
    etcd.ctl(0, &["put", "tg/log/00000000000000000004", "not a change set"]);
    store_fault(&b, Some(("tg/log/00000000000000000004", "log_undecodable"))).await;
    store_fault(&b, Some(("tg/rev", "rev_behind_log"))).await;
    let (s, v) = b.api("PUT", "/v1/services/web/backends/y", Some(json!({"addr": "127.0.0.1:9"}))).await;
    assert_eq!(s, 503, "{v}");
    assert_eq!(
        etcd.ctl(0, &["get", "tg/log/00000000000000000004", "--print-value-only"]).trim(),
        "not a change set",
        "never overwritten"
    );
    etcd.ctl(0, &["del", "tg/log/00000000000000000004"]);
    store_fault(&a, None).await;
    store_fault(&b, None).await;

    // A value edited with etcdctl: every instance sees it the same way and
    // keeps serving what Tidegate wrote; a new instance refuses to start.
    etcd.ctl(0, &["put", "tg/backends/web/a", r#"{"addr":"127.0.0.1:1"}"#]);
    for tg in [&a, &b] {
        store_fault(tg, Some(("tg/backends/web/a", "written_outside"))).await;
        assert_eq!(get(&tg.admin_url("/readyz")).await.status, 503);
        assert_eq!(crate::support::served_by(&get(&tg.url("/")).await), "one", "still what Tidegate wrote");
    }
    let out = start_refused(&store);
    assert!(out.contains("tg/backends/web/a: written at etcd revision"), "{out}");
    // Writes elsewhere are refused; one that names the object puts it back.
    let (s, v) =
        a.api("PUT", "/v1/routes/other", Some(json!({"match": {"path_prefix": "/o"}, "service": "web"}))).await;
    assert_eq!(s, 503, "{v}");
    assert!(v["error"]["message"].as_str().unwrap_or("").contains("tg/backends/web/a"), "{v}");
    let (s, v) = a.api("PUT", "/v1/services/web/backends/a", Some(json!({"addr": backend.addr.to_string()}))).await;
    assert_eq!(s, 200, "{v}");
    for tg in [&a, &b] {
        store_fault(tg, None).await;
        assert_eq!(get(&tg.admin_url("/readyz")).await.status, 200);
    }
    let (c, _dc) = instance(&store, &[]);
    assert_eq!(crate::support::served_by(&get(&c.url("/")).await), "one");

    // Deleted with etcdctl: the running instances see it.
    etcd.ctl(0, &["del", "tg/routes/web"]);
    for tg in [&a, &b, &c] {
        store_fault(tg, Some(("tg/routes/web", "deleted_outside"))).await;
    }
    let (s, v) = c.api("PUT", "/v1/routes/web", Some(json!({"match": {"path_prefix": "/"}, "service": "web"}))).await;
    assert_eq!(s, 200, "{v}");
    for tg in [&a, &b, &c] {
        store_fault(tg, None).await;
    }
}

/// Rule sets are configuration: written through one instance, they reach
/// the others through etcd with their hashes (kept through the
/// placeholder elsewhere), and an instance started later loads them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rule_sets_reach_every_instance_through_etcd() {
    const HASH: &str = "$2b$12$R9h/cIPz0gi.URNNX3kh2OPST9/PgBkqquzi.Ss7KIUgO2t0jWMUW";
    let etcd = Etcd::start(1);
    let store = etcd.url(&[0], "tg");
    let (a, _da) = instance(&store, &["--instance-name", "a"]);
    let (b, _db) = instance(&store, &["--instance-name", "b"]);
    let rules = json!({ "steps": [
        { "kind": "strip_prefix", "prefix": "/api" },
        { "kind": "basic_auth", "realm": "r", "users": [{ "name": "u", "hash": HASH }] },
    ] });
    let (s, v) = a.api("PUT", "/v1/rules/api", Some(rules)).await;
    assert_eq!(s, 200, "{v}");
    // A route may run an empty set.
    let (s, v) = a.api("PUT", "/v1/rules/open", Some(json!({ "steps": [] }))).await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = a
        .api(
            "POST",
            "/v1/changes",
            Some(json!({ "ops": [
            { "op": "put_service", "name": "web", "spec": {} },
            { "op": "put_route", "name": "r", "spec": { "service": "web", "rules": ["open"] } },
        ] })),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    let revision = v["revision"].as_u64().expect("revision");
    converged(&b, revision).await;
    let (s, v) = b.api("GET", "/v1/rules/open", None).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["used_by"], json!(["r"]));
    let (s, v) = b.api("GET", "/v1/rules/api", None).await;
    assert_eq!(s, 200, "{v}");
    assert!(!v.to_string().contains(HASH), "{v}");
    // B holds the real hash: the placeholder written through B keeps it.
    let (s, w) = b.api("PUT", "/v1/rules/api", Some(v["spec"].clone())).await;
    assert_eq!(s, 200, "{w}");
    let (s, w) = b.api("DELETE", "/v1/rules/open", None).await;
    assert_eq!(s, 409, "{w}");
    // An instance started now loads them from etcd.
    let (c, _dc) = instance(&store, &["--instance-name", "c"]);
    let (s, v) = c.api("GET", "/v1/rules/api", None).await;
    assert_eq!(s, 200, "{v}");
    let (s, w) = c.api("PUT", "/v1/rules/api", Some(v["spec"].clone())).await;
    assert_eq!(s, 200, "the hash came through etcd: {w}");

    // A rate shared among the live instances: one request per 500 s for
    // the cluster is one per 1,000 s or more for each of the (2 or 3)
    // instances, so B's wait for its next token is over 600 s once it
    // counts the others' records.
    let shared = json!({ "steps": [
        { "kind": "rate_limit", "key": "route", "rate_per_s": 0.002, "burst": 1, "per_instance_share": true },
    ] });
    let (s, v) = a.api("PUT", "/v1/rules/shared", Some(shared)).await;
    assert_eq!(s, 200, "{v}");
    let route = json!({ "match": { "path_prefix": "/shared" }, "service": "web", "rules": ["shared"] });
    let (s, v) = a.api("PUT", "/v1/routes/shared", Some(route)).await;
    assert_eq!(s, 200, "{v}");
    converged(&b, v["revision"].as_u64().expect("revision")).await;
    let url = format!("http://{}/shared/x", b.proxy);
    wait_for("B divides the rate among the live instances", Duration::from_secs(15), async || {
        let r = get(&url).await;
        let wait: u64 = r.headers.get("retry-after")?.to_str().ok()?.parse().ok()?;
        (r.status == 429 && wait > 600).then_some(())
    })
    .await;
}

/// `serve --takeover` in cluster mode: no store to hand over (etcd is
/// shared); the sockets move, the new process joins the cluster as any
/// instance does, and the old one drains and exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_in_cluster_mode_moves_the_sockets_and_joins() {
    let etcd = Etcd::start(1);
    let store = etcd.url(&[0], "tg");
    let backend = Backend::start("b", &[]);
    let (mut old, dir) = instance(&store, &["--instance-name", "a"]);
    let revision = service_with_route(&old, &backend).await;
    let record = |etcd: &Etcd| instance_record(&etcd.ctl(0, &["get", "--prefix", "", "-w", "fields"]), "instances/a");
    let (lease, _) = wait_for_record(&etcd, record).await;
    let new = Tidegate::start_with(dir.path(), &["--store", &store, "--instance-name", "a", "--takeover"]);
    assert_eq!((new.proxy, new.admin), (old.proxy, old.admin));
    let status = tokio::task::spawn_blocking(move || old.wait_exit(Duration::from_secs(30)))
        .await
        .expect("join")
        .expect("the old process exits by itself");
    assert!(status.success(), "{status}");
    // The new process goes on with the old one's lease: the instance
    // record (and any role it leads) never lapses, and is written again
    // by the new process under the same lease.
    let (_, written) = record(&etcd).expect("the record outlives the old process");
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let now = record(&etcd).expect("the record stays");
        if now.1 > written {
            assert_eq!(now.0, lease, "the same lease");
            break;
        }
        assert!(Instant::now() < deadline, "the new process does not write its record");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    converged(&new, revision).await;
    assert_eq!(get(&new.url("/")).await.status, 200);
    let (s, v) = new.api("PUT", "/v1/services/later", Some(json!({}))).await;
    assert_eq!(s, 200, "the new instance writes to etcd: {v}");
    assert_eq!(v["revision"].as_u64(), Some(revision + 1));
}

/// The lease and modification revision of the key ending in `suffix`, in
/// `etcdctl get -w fields` output.
fn instance_record(fields: &str, suffix: &str) -> Option<(i64, i64)> {
    // Each key's fields come in order: Key, ..., ModRevision, ..., Lease.
    let (mut key, mut modified) = (String::new(), 0i64);
    for line in fields.lines() {
        let Some((name, value)) = line.split_once(" : ") else { continue };
        let value = value.trim().trim_matches('"');
        match name.trim().trim_matches('"') {
            "Key" => key = value.to_string(),
            "ModRevision" => modified = value.parse().unwrap_or(0),
            "Lease" if key.ends_with(suffix) => return Some((value.parse().unwrap_or(0), modified)),
            _ => {}
        }
    }
    None
}

async fn wait_for_record(etcd: &Etcd, record: impl Fn(&Etcd) -> Option<(i64, i64)>) -> (i64, i64) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Some(r) = record(etcd).filter(|(lease, _)| *lease != 0) {
            return r;
        }
        assert!(Instant::now() < deadline, "no instance record in etcd");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Three instances on one etcd share a managed certificate: one order at
/// the CA, whichever instance the CA reaches answers its challenge, all
/// three serve the certificate; and when the instance ordering one dies
/// mid-order, another completes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_instance_orders_each_managed_certificate_and_another_completes_it_when_it_dies() {
    use crate::acme::{acme_status, get_verified, Pebble};
    let etcd = Etcd::start(1);
    let store = etcd.url(&[0], "tg");
    let tls = ["--listen-tls", "127.0.0.1:0"];
    let mut instances: Vec<(Tidegate, tempfile::TempDir)> =
        ["a", "b", "c"].iter().map(|name| instance(&store, &[&tls[..], &["--instance-name", name]].concat())).collect();
    let backend = Backend::start("acme-cluster", &[]);
    let revision = service_with_route(&instances[0].0, &backend).await;
    for (tg, _) in &instances {
        converged(tg, revision).await;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    // The CA validates HTTP-01 through c's plain listener, whichever
    // instance orders.
    let c = &instances[2].0;
    let pebble = Pebble::start(dir.path(), c.proxy.port(), c.proxy_tls.expect("TLS").port()).await;
    let (s, v) = instances[0]
        .0
        .api("PUT", "/v1/certificates/one", Some(json!({ "acme": pebble.acme(&["one.test"], "http-01") })))
        .await;
    assert_eq!(s, 200, "{v}");
    let root = pebble.root();
    for (tg, _) in &instances {
        let v = acme_status(tg, "one", "valid").await;
        assert_eq!(v["certificate"]["acme"]["orders"], 1, "{v}");
        let tls = tg.proxy_tls.expect("TLS");
        assert_eq!(get_verified(tls, "one.test", &root).await.expect("served"), "HTTP/1.1 200 OK");
    }
    assert_eq!(pebble.orders(), 1, "one order at the CA for three instances");

    // DNS-01 through a hook that waits for the test's word: the instance
    // ordering is killed while its hook runs; another takes the role and
    // orders again.
    let hook = dir.path().join("hook");
    let (pids, release) = (dir.path().join("hook-pids"), dir.path().join("release"));
    let script = format!(
        "#!/bin/sh\ncase \"$1\" in\n  set) echo $PPID >> {pids}\n    while [ ! -f {release} ]; do sleep 0.05; done\n    \
         curl -sf -d \"{{\\\"host\\\":\\\"$2\\\",\\\"value\\\":\\\"$3\\\"}}\" http://{m}/set-txt ;;\n  \
         clear) curl -sf -d \"{{\\\"host\\\":\\\"$2\\\"}}\" http://{m}/clear-txt ;;\nesac\n",
        pids = pids.display(),
        release = release.display(),
        m = pebble.dns_management()
    );
    std::fs::write(&hook, script).expect("hook");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&hook, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let mut acme = pebble.acme(&["two.test"], "dns-01");
    acme["dns_hook"] = json!({ "command": [hook] });
    let (s, v) = instances[0].0.api("PUT", "/v1/certificates/two", Some(json!({ "acme": acme }))).await;
    assert_eq!(s, 200, "{v}");
    let read_pids = || -> Vec<u32> {
        std::fs::read_to_string(&pids).unwrap_or_default().lines().filter_map(|l| l.trim().parse().ok()).collect()
    };
    let first =
        wait_for("an instance runs the hook", Duration::from_secs(30), async || read_pids().first().copied()).await;
    let leader = instances.iter().position(|(tg, _)| tg.pid() == first).expect("the hook's parent is an instance");
    let (killed, _dir) = instances.remove(leader);
    killed.kill9();
    std::fs::write(&release, "go").expect("release");
    for (tg, _) in &instances {
        acme_status(tg, "two", "valid").await;
        let tls = tg.proxy_tls.expect("TLS");
        assert_eq!(get_verified(tls, "two.test", &root).await.expect("served"), "HTTP/1.1 200 OK");
    }
    let ran = read_pids();
    assert!(ran.len() >= 2 && ran[1] != first, "another instance ran the order: {ran:?}");
    assert!(instances.iter().any(|(tg, _)| tg.pid() == ran[1]), "{ran:?}");
}
