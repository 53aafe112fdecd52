//! `tidegate serve --takeover`: a new process takes a running one's
//! listening sockets and embedded store over; the old one drains and exits.
//! Clients checking every answer see no failure, the configuration carries
//! over, a failed hand-over leaves the old process serving, and changes
//! racing the hand-over are applied exactly once.

use std::net::SocketAddr;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use serde_json::{json, Value};
use tokio::sync::watch;

use crate::support::*;

/// Most requests one client task sends, so the load stays bounded.
const MAX_REQUESTS: u64 = 50_000;

/// What the clients saw.
#[derive(Default)]
struct Counts {
    ok: AtomicU64,
    /// Requests sent again on a new connection because the server had
    /// closed their kept-alive one between requests (a draining server
    /// does) as they were sent, with no byte of an answer (HTTP/1.1 lets a
    /// client repeat an idempotent request then, RFC 9112 9.3.1, as
    /// browsers do).
    resent: AtomicU64,
    failures: Mutex<Vec<String>>,
}

impl Counts {
    fn fail(&self, what: String) {
        self.failures.lock().expect("lock").push(what);
    }

    fn failures(&self) -> Vec<String> {
        self.failures.lock().expect("lock").clone()
    }

    /// Fails the test if any request failed (a request resent after an
    /// idle close is not a failure), showing the first ten.
    fn assert_none_failed(&self) {
        let failures = self.failures();
        assert!(
            failures.is_empty(),
            "{} failed of {} (resent after an idle close: {}): {:?}",
            failures.len(),
            self.ok.load(Relaxed) + failures.len() as u64,
            self.resent.load(Relaxed),
            &failures[..failures.len().min(10)]
        );
    }
}

/// One answer checked: 200 from the backend emulator `b`, whole body.
async fn check(resp: http::Response<hyper::body::Incoming>) -> Result<(), String> {
    let status = resp.status().as_u16();
    let backend = resp.headers().get("x-backend").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let body = resp.into_body().collect().await.map_err(|e| format!("reading the body: {e}"))?;
    if status != 200 || backend != "b" {
        return Err(format!("status {status} from {backend:?}: {:?}", String::from_utf8_lossy(&body.to_bytes())));
    }
    Ok(())
}

fn request(addr: SocketAddr, path: &str, close: bool) -> http::Request<Empty<Bytes>> {
    let mut req = http::Request::get(format!("http://{addr}{path}")).header("host", addr.to_string());
    if close {
        req = req.header("connection", "close");
    }
    req.body(Empty::new()).expect("request")
}

async fn connect(addr: SocketAddr) -> Result<hyper::client::conn::http1::SendRequest<Empty<Bytes>>, String> {
    let stream = tokio::net::TcpStream::connect(addr).await.map_err(|e| format!("connect: {e}"))?;
    let (sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    tokio::spawn(conn);
    Ok(sender)
}

/// Sends requests one after the other on a kept-alive connection until
/// `stop`, opening a new one when the server closes it.
async fn keep_alive_client(addr: SocketAddr, stop: watch::Receiver<bool>, counts: Arc<Counts>) {
    let mut sender = None;
    let mut sent = 0;
    while !*stop.borrow() && sent < MAX_REQUESTS {
        let (s, reused) = match sender.take() {
            Some(s) => (s, true),
            None => match connect(addr).await {
                Ok(s) => (s, false),
                Err(e) => {
                    counts.fail(e);
                    continue;
                }
            },
        };
        let mut s = s;
        if s.ready().await.is_err() {
            // Closed by the server between requests: not a failure.
            continue;
        }
        sent += 1;
        match s.send_request(request(addr, "/keep-alive", false)).await {
            Ok(resp) => match check(resp).await {
                Ok(()) => {
                    counts.ok.fetch_add(1, Relaxed);
                    sender = Some(s);
                }
                Err(e) => counts.fail(format!("keep-alive: {e}")),
            },
            Err(e) if reused && unanswered(&e) => {
                counts.resent.fetch_add(1, Relaxed);
            }
            Err(e) => counts.fail(format!("keep-alive request: {e:?}")),
        }
    }
}

/// The kept-alive connection was closed (or reset, when the request
/// reached a socket already closed) before any byte of an answer.
fn unanswered(e: &hyper::Error) -> bool {
    let reset = std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<std::io::Error>())
        .is_some_and(|io| matches!(io.kind(), std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe));
    e.is_incomplete_message() || e.is_canceled() || reset
}

/// Sends each request on a new connection until `stop`.
async fn new_connection_client(addr: SocketAddr, stop: watch::Receiver<bool>, counts: Arc<Counts>) {
    let mut sent = 0;
    while !*stop.borrow() && sent < MAX_REQUESTS {
        sent += 1;
        let outcome = async {
            let mut s = connect(addr).await?;
            let resp = s.send_request(request(addr, "/new", true)).await.map_err(|e| format!("request: {e:?}"))?;
            check(resp).await
        }
        .await;
        match outcome {
            Ok(()) => {
                counts.ok.fetch_add(1, Relaxed);
            }
            Err(e) => counts.fail(format!("new connection: {e}")),
        }
    }
}

/// Waits, off the runtime, for `tg` to exit by itself.
async fn exits(mut tg: Tidegate, within: Duration) -> std::process::ExitStatus {
    tokio::task::spawn_blocking(move || tg.wait_exit(within))
        .await
        .expect("join")
        .unwrap_or_else(|| panic!("the old process did not exit within {within:?}"))
}

/// Waits until the clients have `n` more answers than `from`.
async fn answers_grow(counts: &Counts, n: u64) {
    let from = counts.ok.load(Relaxed);
    wait_for(&format!("{n} more answers"), Duration::from_secs(20), async || {
        (counts.ok.load(Relaxed) >= from + n).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_under_load_drops_nothing_and_keeps_the_configuration() {
    under_load(&[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_under_load_drops_nothing_with_the_hyper_engine() {
    under_load(&["--http1", "hyper"]).await;
}

/// A hand-over while clients keep sending, on the old and new processes
/// started with `flags`.
async fn under_load(flags: &[&str]) {
    let backend = Backend::start("b", &[]);
    let dir = tempfile::tempdir().expect("tempdir");
    let old = Tidegate::start_with(dir.path(), flags);
    route_to(&old, "web", &[&backend], "round_robin").await;
    let (_, before) = old.api("GET", "/v1/config", None).await;

    let counts = Arc::new(Counts::default());
    let (stop_tx, stop) = watch::channel(false);
    let clients: Vec<_> = (0..2)
        .map(|_| tokio::spawn(keep_alive_client(old.proxy, stop.clone(), counts.clone())))
        .chain(std::iter::once(tokio::spawn(new_connection_client(old.proxy, stop.clone(), counts.clone()))))
        .collect();
    answers_grow(&counts, 50).await;

    let new = Tidegate::start_with(dir.path(), &[flags, &["--takeover"]].concat());
    assert_eq!(new.proxy, old.proxy, "the same socket, not a new one");
    assert_eq!(new.admin, old.admin);
    let status = exits(old, Duration::from_secs(30)).await;
    assert!(status.success(), "the old process exits by itself, cleanly: {status}");
    // Served by the new process alone now.
    answers_grow(&counts, 50).await;
    let _ = stop_tx.send(true);
    for c in clients {
        c.await.expect("client");
    }
    eprintln!(
        "takeover under load {flags:?}: {} answers, {} requests resent after an idle keep-alive close, {} failed",
        counts.ok.load(Relaxed),
        counts.resent.load(Relaxed),
        counts.failures().len()
    );
    counts.assert_none_failed();

    // The configuration carried over whole, and changes are live.
    let (s, after) = new.api("GET", "/v1/config", None).await;
    assert_eq!(s, 200);
    assert_eq!(after, before, "the configuration is the same after the hand-over");
    let (s, v) = new
        .api("PUT", "/v1/routes/later", Some(json!({ "match": { "path_prefix": "/later" }, "service": "web" })))
        .await;
    assert_eq!(s, 200, "{v}");
    let r = get(&new.url("/later/x")).await;
    assert_eq!((r.status, served_by(&r)), (200, "b".to_string()));
    let (_, status) = new.api("GET", "/v1/status", None).await;
    assert_eq!(status["routes"], 2, "{status}");
}

fn tidegate(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tidegate"))
        .args(args)
        .env("TIDEGATE_ADMIN_TOKEN", TOKEN)
        .env("TIDEGATE_LOG", "warn")
        .output()
        .expect("run tidegate")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_takeover_leaves_the_old_process_serving_and_writing() {
    // No instance to take over.
    let empty = tempfile::tempdir().expect("tempdir");
    let dir = empty.path().to_str().expect("utf-8");
    let out =
        tidegate(&["serve", "--data-dir", dir, "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--takeover"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("no running instance to take over"), "{stderr}");

    let backend = Backend::start("b", &[]);
    let data = tempfile::tempdir().expect("tempdir");
    let old = Tidegate::start(data.path());
    route_to(&old, "web", &[&backend], "round_robin").await;
    let dir = data.path().to_str().expect("utf-8");
    // A flag the binary does not know: refused before anything is asked.
    let out = tidegate(&["serve", "--data-dir", dir, "--takeover", "--no-such-flag"]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    // Flags that do not match the running instance: it has closed its
    // store for the hand-over by then, and must take it back.
    let out =
        tidegate(&["serve", "--data-dir", dir, "--listen-tls", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--takeover"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("proxy listener") && stderr.contains("keeps serving"), "{stderr}");

    let mut old = old;
    assert!(old.wait_exit(Duration::ZERO).is_none(), "the old process still runs");
    let r = get(&old.url("/")).await;
    assert_eq!((r.status, served_by(&r)), (200, "b".to_string()));
    written_again(&old, "/v1/services/other").await;
    // And a later hand-over still works.
    let new = Tidegate::start_with(data.path(), &["--takeover"]);
    assert_eq!(new.proxy, old.proxy);
    // Gone first, so the admin address answers from the new process alone.
    assert!(exits(old, Duration::from_secs(30)).await.success());
    let (_, services) = new.api("GET", "/v1/services", None).await;
    assert!(services.to_string().contains("other"), "{services}");
}

/// One change sent on a new connection (so it reaches whichever process
/// accepts it), again after a 503 with `Retry-After`; its revision.
async fn put_backend_until_answered(admin: SocketAddr, i: u32, refused: &AtomicU64) -> u64 {
    let url = format!("http://{admin}/v1/services/churn/backends/b{i}");
    let body = json!({ "addr": format!("127.0.0.1:{}", 20_000 + i) }).to_string().into_bytes();
    for _ in 0..200 {
        // A connection the old process accepted just before its admin API
        // stopped is closed unanswered (nothing applied): sent again.
        let Ok(r) = try_send("PUT", &url, Some(TOKEN), body.clone(), &[("connection", "close")]).await else {
            refused.fetch_add(1, Relaxed);
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        match r.status {
            200 => {
                let v: Value = serde_json::from_slice(&r.body).expect("json");
                return v["revision"].as_u64().expect("revision");
            }
            503 => {
                assert!(r.headers.contains_key("retry-after"), "a 503 says when to retry: {}", r.text());
                refused.fetch_add(1, Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            s => panic!("change {i}: {s} {}", r.text()),
        }
    }
    panic!("change {i} was refused 200 times")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_racing_a_takeover_are_each_applied_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let old = Tidegate::start(dir.path());
    let (s, v) = old.api("PUT", "/v1/services/churn", Some(json!({}))).await;
    assert_eq!(s, 200, "{v}");
    let base = v["revision"].as_u64().expect("revision");
    let admin = old.admin;
    let refused = Arc::new(AtomicU64::new(0));
    let sent = Arc::new(AtomicU64::new(0));
    let (stop_tx, stop) = watch::channel(false);
    let writer = {
        let (refused, sent) = (refused.clone(), sent.clone());
        tokio::spawn(async move {
            let mut revisions = Vec::new();
            let mut i = 0;
            while !*stop.borrow() && i < 2_000 {
                revisions.push(put_backend_until_answered(admin, i, &refused).await);
                sent.fetch_add(1, Relaxed);
                i += 1;
            }
            revisions
        })
    };
    wait_for("a first changes applied", Duration::from_secs(10), async || (sent.load(Relaxed) >= 20).then_some(()))
        .await;
    let new = Tidegate::start_with(dir.path(), &["--takeover"]);
    let status = exits(old, Duration::from_secs(30)).await;
    assert!(status.success(), "{status}");
    let from = sent.load(Relaxed);
    wait_for("changes applied by the new process", Duration::from_secs(10), async || {
        (sent.load(Relaxed) >= from + 20).then_some(())
    })
    .await;
    let _ = stop_tx.send(true);
    let revisions = writer.await.expect("writer");
    let n = revisions.len() as u64;
    // Each answered change has its own revision, in order, with no gap:
    // none applied twice, none lost.
    let expected: Vec<u64> = (base + 1..=base + n).collect();
    assert_eq!(revisions, expected, "refused and retried: {}", refused.load(Relaxed));
    let (_, status) = new.api("GET", "/v1/status", None).await;
    assert_eq!(status["revision"].as_u64(), Some(base + n), "{status}");
    let (_, service) = new.api("GET", "/v1/services/churn", None).await;
    assert_eq!(service["spec"]["backends"].as_array().map(Vec::len), Some(n as usize), "{service}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_by_another_user_is_refused() {
    // Switching users needs root (as CI runs); elsewhere there is no other
    // user to be.
    let root = Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.starts_with(b"0\n"));
    if !root || Command::new("setpriv").arg("--version").output().is_err() {
        eprintln!("skipped: needs root and setpriv to run a process as another user");
        return;
    }
    let backend = Backend::start("b", &[]);
    let data = tempfile::tempdir().expect("tempdir");
    let old = Tidegate::start(data.path());
    route_to(&old, "web", &[&backend], "round_robin").await;
    // Let another user reach the socket at all: its mode (0600) is the
    // first barrier, the peer's uid the second, tested here.
    use std::os::unix::fs::PermissionsExt;
    let socket = data.path().join("takeover.sock");
    assert_eq!(std::fs::metadata(&socket).expect("takeover.sock").permissions().mode() & 0o777, 0o600);
    std::fs::set_permissions(data.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666)).expect("chmod");
    let out = Command::new("setpriv")
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
        .arg(env!("CARGO_BIN_EXE_tidegate"))
        .args(["serve", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--takeover", "--data-dir"])
        .arg(data.path())
        .env("TIDEGATE_ADMIN_TOKEN", TOKEN)
        .output()
        .expect("run setpriv");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("only for processes of the same user"), "{stderr}");
    let r = get(&old.url("/")).await;
    assert_eq!((r.status, served_by(&r)), (200, "b".to_string()), "the old process still serves");
    let (s, v) = old.api("PUT", "/v1/services/other", Some(json!({}))).await;
    assert_eq!(s, 200, "and still writes: {v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_listener_moves_tls_and_metrics_included() {
    let flags = ["--listen-tls", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"];
    let dir = tempfile::tempdir().expect("tempdir");
    let old = Tidegate::start_with(dir.path(), &flags);
    let new = Tidegate::start_with(dir.path(), &[&flags[..], &["--takeover"]].concat());
    assert_eq!((new.proxy, new.proxy_tls, new.admin), (old.proxy, old.proxy_tls, old.admin));
    assert!(exits(old, Duration::from_secs(30)).await.success());
    // The TLS socket still takes connections, from the new process.
    let tls = new.proxy_tls.expect("a TLS listener");
    tokio::net::TcpStream::connect(tls).await.expect("the TLS socket accepts");
    // Without --metrics-listen, the new process is refused: the running
    // one has a listener it would not serve.
    let newer = tidegate(&[
        "serve",
        "--data-dir",
        dir.path().to_str().expect("utf-8"),
        "--listen",
        "127.0.0.1:0",
        "--listen-tls",
        "127.0.0.1:0",
        "--admin",
        "127.0.0.1:0",
        "--takeover",
    ]);
    let stderr = String::from_utf8_lossy(&newer.stderr);
    assert!(!newer.status.success());
    assert!(stderr.contains("metrics listener"), "{stderr}");
    written_again(&new, "/v1/services/after").await;
}

/// A named listener (`/v1/listeners`) moves with the others: its socket is
/// handed over, not bound again, so clients sending requests to it all
/// through the hand-over (kept-alive and a connection per request, as
/// `under_load` does for the default listener) see none fail (a new
/// process binding it itself would find the address in use until the old
/// one exits, and refuse connections meanwhile).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_listener_moves_without_a_failed_request() {
    let dir = tempfile::tempdir().expect("tempdir");
    let old = Tidegate::start(dir.path());
    let b = Backend::start("b", &[]);
    let addr: SocketAddr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr")
    };
    let changes = json!({ "ops": [
        { "op": "put_service", "name": "side", "spec": { "backends": [{ "id": "b0", "addr": b.addr.to_string() }] } },
        { "op": "put_listener", "name": "side", "spec": { "addr": addr.to_string() } },
        { "op": "put_route", "name": "side", "spec": {
            "match": { "path_prefix": "/" }, "service": "side", "listeners": ["side"] } },
    ]});
    let (s, v) = old.api("POST", "/v1/changes", Some(changes)).await;
    assert_eq!(s, 200, "{v}");
    let url = format!("http://{addr}/");
    wait_for("the named listener serves", Duration::from_secs(10), async || {
        try_send("GET", &url, None, Vec::new(), &[]).await.ok().filter(|r| r.status == 200)
    })
    .await;
    let counts = Arc::new(Counts::default());
    let (stop_tx, stop) = watch::channel(false);
    let clients = [
        tokio::spawn(keep_alive_client(addr, stop.clone(), counts.clone())),
        tokio::spawn(new_connection_client(addr, stop.clone(), counts.clone())),
    ];
    answers_grow(&counts, 50).await;
    let new = Tidegate::start_with(dir.path(), &["--takeover"]);
    assert!(exits(old, Duration::from_secs(30)).await.success());
    answers_grow(&counts, 50).await;
    let _ = stop_tx.send(true);
    for c in clients {
        c.await.expect("client");
    }
    counts.assert_none_failed();
    let (_, status) = new.api("GET", "/v1/status", None).await;
    assert_eq!(status["listeners"]["side"]["state"], "listening", "{status}");
}

/// Waits until `tg`, whose successor was refused, writes its store again:
/// it takes the store back once it read the refusal, which may come after
/// the refused process exited, and a change meanwhile gets 503 with
/// Retry-After. Puts an empty service at `path`.
async fn written_again(tg: &Tidegate, path: &str) {
    wait_for("the running process writes its store again", Duration::from_secs(20), async || {
        let (s, v) = tg.api("PUT", path, Some(json!({}))).await;
        match s {
            200 => Some(()),
            503 => None,
            _ => panic!("{s} {v}"),
        }
    })
    .await;
}

/// Every service's backends as `/v1/status` shows them, by
/// `service/id`: what the proxy learned about each (health, ejections,
/// learned limit, no-load latency).
async fn learned(tg: &Tidegate) -> Vec<(String, Value)> {
    let (_, status) = tg.api("GET", "/v1/status", None).await;
    let mut seen = Vec::new();
    for (service, state) in status["services"].as_object().cloned().unwrap_or_default() {
        for b in state["backends"].as_array().cloned().unwrap_or_default() {
            let id = format!("{service}/{}", b["id"].as_str().unwrap_or(""));
            let learned = json!({
                "health": b["health"], "ejections": b["ejections"], "concurrency_limit": b["concurrency_limit"],
                "no_load_latency_ms": b["no_load_latency_ms"], "latency_ewma_ms": b["latency_ewma_ms"],
            });
            seen.push((id, learned));
        }
    }
    seen.sort_by(|a, b| a.0.cmp(&b.0));
    seen
}

/// What the old process learned about its backends reads the same in the
/// new one: a learned concurrency limit and latency, an ejection (ten
/// minutes long) and a backend the active check found down. A new process
/// that started blank would show the limit at 1, nothing ejected and
/// every backend unchecked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_was_learned_about_the_backends_carries_over() {
    let data = tempfile::tempdir().expect("tempdir");
    let old = Arc::new(Tidegate::start(data.path()));
    let fast = Backend::start("fast", &["--service-time", "fixed:10ms"]);
    let flaky = Backend::start("flaky", &[]);
    let dead = Backend::start("dead", &[]);
    // web: passive checks only, so that flaky is ejected by a request
    // (an active check would find it down first).
    let web = json!({
        "policy": {"kind": "least_conn"},
        "concurrency": {"learn": true},
        "backends": [{"id": "fast", "addr": fast.addr.to_string()}, {"id": "flaky", "addr": flaky.addr.to_string()}],
        "health": {"passive": {"consecutive_failures": 1, "base_ejection_ms": 600_000, "max_ejection_ms": 600_000,
                               "max_ejected_percent": 100}},
    });
    let probed = json!({
        "backends": [{"id": "dead", "addr": dead.addr.to_string()}],
        "health": {"active": {"path": "/health", "interval_ms": 200, "timeout_ms": 200, "rise": 1, "fall": 1}},
    });
    for (path, body) in
        [("/v1/services/web", web), ("/v1/services/probed", probed), ("/v1/routes/web", json!({"service": "web"}))]
    {
        let (s, v) = old.api("PUT", path, Some(body)).await;
        assert_eq!(s, 200, "{path}: {v}");
    }
    let health_is = |tg: Arc<Tidegate>, id: &'static str, want: &'static str| async move {
        let now = learned(&tg).await;
        now.iter().any(|(i, v)| i == id && v["health"] == want).then_some(())
    };
    let _dead = dead.kill();
    wait_for("probed/dead is down", Duration::from_secs(20), async || {
        health_is(old.clone(), "probed/dead", "down").await
    })
    .await;
    // The passive check ejects flaky at its first failed request.
    let _flaky = flaky.kill();
    wait_for("web/flaky is ejected", Duration::from_secs(20), async || {
        let _ = get(&old.url("/")).await;
        health_is(old.clone(), "web/flaky", "ejected").await
    })
    .await;
    // Eight clients keep fast busy until its learned limit has grown.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let clients: Vec<_> = (0..8)
        .map(|_| {
            let (old, stop) = (old.clone(), stop.clone());
            tokio::spawn(async move {
                for _ in 0..MAX_REQUESTS {
                    if stop.load(Relaxed) {
                        break;
                    }
                    let _ = try_send("GET", &old.url("/"), None, vec![], &[]).await;
                }
            })
        })
        .collect();
    wait_for("web/fast's learned limit grows past 2", Duration::from_secs(30), async || {
        let now = learned(&old).await;
        now.iter().any(|(i, v)| i == "web/fast" && v["concurrency_limit"].as_u64().unwrap_or(0) > 2).then_some(())
    })
    .await;
    stop.store(true, Relaxed);
    for c in clients {
        c.await.expect("client");
    }
    // A client has its answer a moment before the proxy has recorded the
    // exchange: the state the new process must show is the settled one.
    let before = wait_for("the learned state settles", Duration::from_secs(20), async || {
        let first = learned(&old).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        (learned(&old).await == first).then_some(first)
    })
    .await;
    let fast = &before.iter().find(|(i, _)| i == "web/fast").expect("fast").1;
    assert!(fast["no_load_latency_ms"].as_f64().is_some(), "{fast}");

    let new = Tidegate::start_with(data.path(), &["--takeover"]);
    let old = Arc::into_inner(old).expect("the clients are done");
    assert!(exits(old, Duration::from_secs(30)).await.success());
    let after = learned(&new).await;
    assert_eq!(after, before, "what the new process knows of the backends");
}

/// During the overlap the new process shows the old one's drain: in
/// `/v1/status` (`predecessor`: its pid, `draining`, the connections it
/// still has open) and in `/metrics`; once the old one finished its last
/// request (held by a backend until the test lets it answer), `exited`
/// with no connection cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_new_process_shows_the_old_ones_drain() {
    use std::io::{Read, Write};
    // A backend that answers its one request when told to.
    let held = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let held_addr = held.local_addr().expect("addr");
    let (answer_tx, answer_rx) = std::sync::mpsc::channel::<()>();
    let backend = std::thread::spawn(move || {
        let (mut conn, _) = held.accept().expect("accept");
        let mut buf = [0u8; 4096];
        let _ = conn.read(&mut buf).expect("read the request");
        answer_rx.recv().expect("told to answer");
        conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\nConnection: close\r\n\r\nheld").expect("answer");
    });
    let data = tempfile::tempdir().expect("tempdir");
    let old = Tidegate::start(data.path());
    let spec = json!({"backends": [{"id": "held", "addr": held_addr.to_string()}], "retries": 0,
                      "concurrency": {"learn": false}});
    let (s, v) = old.api("PUT", "/v1/services/web", Some(spec)).await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = old.api("PUT", "/v1/routes/web", Some(json!({"service": "web"}))).await;
    assert_eq!(s, 200, "{v}");
    let url = old.url("/slow");
    let request = tokio::spawn(async move { get(&url).await });
    in_flight_reaches(&old, 1, "the held request").await;

    let new = Tidegate::start_with(data.path(), &["--takeover"]);
    let status = wait_for("the old process reports its open connection", Duration::from_secs(20), async || {
        // A connection the old process's admin API accepted just before
        // the hand-over stopped it is closed unanswered (docs/operations.md,
        // "The overlap"): asked again, the new process answers.
        let r = try_send("GET", &new.admin_url("/v1/status"), Some(TOKEN), vec![], &[]).await.ok()?;
        let status: Value = serde_json::from_slice(&r.body).ok()?;
        let p = &status["predecessor"];
        (p["state"] == "draining" && p["connections"].as_u64() >= Some(1)).then(|| p.clone())
    })
    .await;
    assert_eq!(status["pid"].as_u64(), Some(u64::from(old.pid())), "{status}");
    let metrics = wait_for("the new process's metrics", Duration::from_secs(20), async || {
        try_send("GET", &new.admin_url("/metrics"), Some(TOKEN), vec![], &[]).await.ok().map(|r| r.text())
    })
    .await;
    assert!(metrics.contains("tidegate_predecessor_draining 1"), "{metrics}");

    answer_tx.send(()).expect("answer");
    let r = request.await.expect("join");
    assert_eq!((r.status, r.text()), (200, "held".to_string()));
    backend.join().expect("backend");
    assert!(exits(old, Duration::from_secs(30)).await.success());
    // The new process learns of the exit from its own watch of the old one.
    let p = wait_for("the predecessor shown as exited", Duration::from_secs(20), async || {
        let (_, status) = new.api("GET", "/v1/status", None).await;
        (status["predecessor"]["state"] == "exited").then(|| status["predecessor"].clone())
    })
    .await;
    assert_eq!((p["connections"].as_u64(), p["cut"].as_u64()), (Some(0), Some(0)), "{p}");
}

/// Sends `request` on `conn` and reads one whole answer (its head, and a
/// body of its `Content-Length`); `None` if the connection ended first.
fn exchange_on(conn: &mut std::net::TcpStream, request: &str) -> Option<String> {
    use std::io::{Read, Write};
    conn.write_all(request.as_bytes()).ok()?;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if got.len() >= end + 4 + length {
                return Some(String::from_utf8_lossy(&got[..end + 4 + length]).into_owned());
            }
        }
        match conn.read(&mut buf) {
            Ok(0) | Err(_) => return None,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// Once the proxy stops (a hand-over, SIGTERM), a kept-alive connection
/// waiting for its next request is not closed under a request already on
/// its way: that request is answered, with `Connection: close` (a client
/// may not send a `POST` that crossed a close again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_on_an_idle_keep_alive_connection_is_answered_during_the_drain() {
    let data = tempfile::tempdir().expect("tempdir");
    let mut tg = Tidegate::start_with(data.path(), &["--health-path", "/healthz"]);
    let backend = Backend::start("b", &[]);
    route_to(&tg, "web", &[&backend], "round_robin").await;
    let request = |path: &str| format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n");
    let connect = || {
        let c = std::net::TcpStream::connect(tg.proxy).expect("connect");
        c.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
        c
    };
    let (mut idle, mut probe) = (connect(), connect());
    let first = exchange_on(&mut idle, &request("/")).expect("an answer");
    assert!(first.starts_with("HTTP/1.1 200") && !first.to_ascii_lowercase().contains("connection: close"), "{first}");
    tg.terminate();
    // The probe's connection says when the stop is in effect: its health
    // check answers 503 (with Connection: close) from then on.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let answer = exchange_on(&mut probe, &request("/healthz")).expect("the probe is answered");
        if answer.starts_with("HTTP/1.1 503") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the stop never showed: {answer}");
    }
    let answer = exchange_on(&mut idle, &request("/")).expect("the idle connection's next request is answered");
    let lower = answer.to_ascii_lowercase();
    assert!(answer.starts_with("HTTP/1.1 200") && lower.contains("connection: close"), "{answer}");
    let exited = tokio::task::spawn_blocking(move || tg.wait_exit(Duration::from_secs(30))).await.expect("join");
    assert!(exited.is_some_and(|s| s.success()), "{exited:?}");
}
