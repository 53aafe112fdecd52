//! Balancing and health with real emulated backends: heterogeneous capacity,
//! failures under load, ejection and recovery, active checks, backups.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::support::*;

/// Results of a closed loop of concurrent users.
#[derive(Debug)]
struct LoadResult {
    ok: usize,
    failed: usize,
    p99_ms: f64,
}

/// `users` clients, each sending GETs back to back for `secs`.
async fn closed_loop(tg: &Arc<Tidegate>, users: usize, secs: f64) -> LoadResult {
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for _ in 0..users {
        let tg = tg.clone();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut failed = 0;
            while Instant::now() < deadline {
                let t = Instant::now();
                match try_send("GET", &tg.url("/"), None, vec![], &[]).await {
                    Ok(r) if r.status == 200 => lat.push(t.elapsed().as_secs_f64() * 1e3),
                    _ => failed += 1,
                }
            }
            (lat, failed)
        }));
    }
    let (mut all, mut failed) = (Vec::new(), 0);
    for t in tasks {
        let (lat, f) = t.await.expect("user task");
        all.extend(lat);
        failed += f;
    }
    all.sort_by(f64::total_cmp);
    let p99 = all.get(all.len() * 99 / 100).copied().unwrap_or(f64::INFINITY);
    LoadResult { ok: all.len(), failed, p99_ms: p99 }
}

fn service(backends: &[(&str, &Backend)], policy: Value, extra: Value) -> Value {
    let list: Vec<Value> = backends.iter().map(|(id, b)| json!({"id": id, "addr": b.addr.to_string()})).collect();
    let mut spec = json!({"policy": policy, "backends": list});
    if let (Some(s), Some(e)) = (spec.as_object_mut(), extra.as_object()) {
        s.extend(e.clone());
    }
    spec
}

async fn put(tg: &Tidegate, spec: Value) {
    let (s, v) = tg.api("PUT", "/v1/services/web", Some(spec)).await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = tg.api("PUT", "/v1/routes/web", Some(json!({"service": "web"}))).await;
    assert_eq!(s, 200, "{v}");
}

/// Paper S3's setting, scaled down: capacities 1:2:4 (service slots of a
/// 20 ms job, short queues that answer 503 when full), a closed loop of
/// users. Latency-aware policies must fail no more than round robin, and
/// either fail less or have a lower p99, without being told the capacities.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latency_aware_policies_beat_round_robin_on_heterogeneous_backends() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Arc::new(Tidegate::start(dir.path()));
    let common = ["--service-time", "fixed:20ms", "--queue", "6"];
    let b1 = Backend::start("c1", &[&["--slots", "1"], &common[..]].concat());
    let b2 = Backend::start("c2", &[&["--slots", "2"], &common[..]].concat());
    let b4 = Backend::start("c4", &[&["--slots", "4"], &common[..]].concat());
    let pool = [("c1", &b1), ("c2", &b2), ("c4", &b4)];
    // Passive ejection (and learned limits) would hide round robin's
    // overload: measure the policies alone.
    let no_ejection = json!({
        "health": {"passive": {"consecutive_failures": 0}}, "retries": 0, "concurrency": {"learn": false},
    });
    let mut results = Vec::new();
    for policy in ["round_robin", "p2c_ewma", "least_time", "dynamic_feedback"] {
        put(&tg, service(&pool, json!({"kind": policy}), no_ejection.clone())).await;
        closed_loop(&tg, 14, 0.7).await; // warm up latency estimates
        let r = closed_loop(&tg, 14, 2.5).await;
        eprintln!("{policy}: {r:?}");
        results.push((policy, r));
    }
    let rr = &results[0].1;
    assert!(rr.failed > 0 || rr.p99_ms > 100.0, "round robin should overload the small backend: {rr:?}");
    for (policy, r) in &results[1..] {
        assert!(r.ok > 0, "{policy} served nothing");
        assert!(r.failed <= rr.failed, "{policy} failed {} vs round robin {}", r.failed, rr.failed);
        // A failed request is worse than any latency: fewer failures is
        // the better outcome whatever the p99 of the answers that
        // succeeded (round robin's 503s come back at once and leave its
        // slowest answers fewer); with as many failures, the p99 decides.
        assert!(
            r.failed < rr.failed || r.p99_ms < rr.p99_ms,
            "{policy} failed {} (round robin {}) with p99 {:.1} ms vs round robin {:.1} ms",
            r.failed,
            rr.failed,
            r.p99_ms,
            rr.p99_ms
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_killed_under_load_costs_no_failed_get() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Arc::new(Tidegate::start(dir.path()));
    let a = Backend::start("a", &["--service-time", "fixed:5ms"]);
    let b = Backend::start("b", &["--service-time", "fixed:5ms"]);
    let victim = Backend::start("victim", &["--service-time", "fixed:5ms"]);
    put(&tg, service(&[("a", &a), ("b", &b), ("victim", &victim)], json!({"kind": "round_robin"}), json!({}))).await;
    let stop = Arc::new(AtomicBool::new(false));
    let failed = Arc::new(AtomicU64::new(0));
    let ok = Arc::new(AtomicU64::new(0));
    let mut clients = Vec::new();
    for _ in 0..6 {
        let (tg, stop, failed, ok) = (tg.clone(), stop.clone(), failed.clone(), ok.clone());
        clients.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                match try_send("GET", &tg.url("/"), None, vec![], &[]).await {
                    Ok(r) if r.status == 200 => ok.fetch_add(1, Ordering::Relaxed),
                    other => {
                        eprintln!("failed: {:?}", other.map(|r| (r.status, r.text())));
                        failed.fetch_add(1, Ordering::Relaxed)
                    }
                };
            }
        }));
    }
    let served = |n: u64| {
        let ok = ok.clone();
        async move {
            wait_for("requests served", Duration::from_secs(20), async || {
                (ok.load(Ordering::Relaxed) >= n).then_some(())
            })
            .await
        }
    };
    served(50).await;
    let _victim = victim.kill();
    health_becomes(&tg, "victim", "ejected").await;
    // And the load goes on without it for a while.
    served(ok.load(Ordering::Relaxed) + 50).await;
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
    }
    assert_eq!(failed.load(Ordering::Relaxed), 0, "ok: {}", ok.load(Ordering::Relaxed));
    let (_, status) = tg.api("GET", "/v1/status", None).await;
    let victim = &status["services"]["web"]["backends"][2];
    assert_eq!(victim["health"], "ejected", "{victim}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ejected_backend_returns_after_its_backoff() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let a = Backend::start("a", &[]);
    let flaky = Backend::start("flaky", &[]);
    let port = flaky.addr;
    let passive = json!({"health": {"passive": {"consecutive_failures": 2, "base_ejection_ms": 400}}});
    put(&tg, service(&[("a", &a), ("flaky", &flaky)], json!({"kind": "round_robin"}), passive)).await;
    let down = flaky.kill();
    for _ in 0..10 {
        assert_eq!(get(&tg.url("/")).await.status, 200);
    }
    health_becomes(&tg, "flaky", "ejected").await;
    // It comes back on the same address; after the backoff it serves again.
    drop(down);
    let _back = Backend::start("flaky", &["--listen", &port.to_string()]);
    wait_for("the recovered backend serves a request", Duration::from_secs(5), async || {
        (served_by(&get(&tg.url("/")).await) == "flaky").then_some(())
    })
    .await;
    let mut served = 0;
    for _ in 0..20 {
        if served_by(&get(&tg.url("/")).await) == "flaky" {
            served += 1;
        }
    }
    assert!(served >= 5, "the recovered backend served {served} of 20");
}

/// A failed first attempt retried elsewhere takes no turn of the round
/// robin: with one dead backend of two (never ejected here), it still gets
/// only its half of the first attempts, not every one of them. Requests
/// whose bodies are too large to replay are retried after a failed
/// connect too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_leave_the_round_robin_to_first_attempts() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let live = Backend::start("live", &[]);
    let dead = Backend::start("dead", &[]);
    let no_ejection = json!({"health": {"passive": {"consecutive_failures": 0}}});
    put(&tg, service(&[("dead", &dead), ("live", &live)], json!({"kind": "round_robin"}), no_ejection)).await;
    let _dead = dead.kill();
    for _ in 0..20 {
        let r = get(&tg.url("/")).await;
        assert_eq!((r.status, served_by(&r)), (200, "live".to_string()));
    }
    let (_, status) = tg.api("GET", "/v1/status", None).await;
    let backends = &status["services"]["web"]["backends"];
    assert_eq!(backends[0]["id"], "dead");
    assert_eq!(backends[0]["ejections"], 0, "{backends}");
    // 20 requests, first attempts alternating: 10 on each, 10 retries.
    assert_eq!(backends[0]["requests"], 10, "{backends}");
    assert_eq!(backends[1]["requests"], 20, "{backends}");
    // A body too large to keep for a replay is still retried after a
    // failed connect: nothing of it was sent yet.
    for _ in 0..4 {
        let r = send("POST", &tg.url("/upload"), None, vec![b'x'; 256 * 1024], &[]).await;
        assert_eq!((r.status, served_by(&r)), (200, "live".to_string()), "{}", r.text());
    }
}

/// A backend that sheds a request (503) is done with it: while the
/// request is retried on another backend (and the 503 kept in case none
/// answers better), the shedding backend no longer counts it in flight nor
/// against its `max_conns`. Either HTTP/1 engine.
#[test]
fn a_shed_request_gives_its_backend_back_while_it_is_retried() {
    for engine in ["native", "hyper"] {
        let dir = tempfile::tempdir().unwrap();
        let tg = Tidegate::start_with(dir.path(), &["--http1", engine]);
        // One slot, no queue, 3 s per request: once busy, it sheds the
        // requests that follow at once.
        let full = Backend::start("full", &["--slots", "1", "--queue", "0", "--service-time", "fixed:3s"]);
        let slow = Backend::start("slow", &["--service-time", "fixed:1500ms"]);
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let spec = json!({
                "policy": {"kind": "round_robin"},
                "concurrency": {"learn": false},
                "health": {"passive": {"consecutive_failures": 0}},
                "backends": [
                    {"id": "full", "addr": full.addr.to_string(), "max_conns": 1},
                    {"id": "slow", "addr": slow.addr.to_string()},
                ],
            });
            put(&tg, spec).await;
            let direct = format!("http://{}/", full.addr);
            let busy = tokio::spawn(async move { get(&direct).await.status });
            emulator_in_flight_reaches(&full, 1).await;
            // Round robin sends one of the two to `full` first.
            let both: Vec<_> = ["/a", "/b"]
                .map(|path| {
                    let url = tg.url(path);
                    tokio::spawn(async move {
                        let r = get(&url).await;
                        (r.status, served_by(&r))
                    })
                })
                .into();
            // Both are at `slow` for 1.5 s once the shed one is retried.
            web_status_until(&tg, &format!("{engine}: `full` has none in flight, `slow` both"), |web| {
                let in_flight = |id: &str| backend(web, id).map(|b| b["in_flight"].clone());
                in_flight("full") == Some(json!(0)) && in_flight("slow") == Some(json!(2))
            })
            .await;
            assert_eq!(shed_by(&full).await, 1, "{engine}: one request went to `full` first");
            for r in both {
                assert_eq!(r.await.unwrap(), (200, "slow".to_string()), "{engine}");
            }
            assert_eq!(busy.await.unwrap(), 200);
        });
    }
}

/// Tidegate with service `web` over primaries `a` and `b` and backup
/// `spare` (round robin, this `health`), and the three emulators.
async fn with_a_backup(dir: &std::path::Path, health: Value) -> (Tidegate, [Backend; 3]) {
    let tg = Tidegate::start(dir);
    let backends = ["a", "b", "spare"].map(|name| Backend::start(name, &[]));
    let spec = json!({
        "policy": {"kind": "round_robin"},
        "health": health,
        "backends": [
            {"id": "a", "addr": backends[0].addr.to_string()},
            {"id": "b", "addr": backends[1].addr.to_string()},
            {"id": "spare", "addr": backends[2].addr.to_string(), "backup": true},
        ],
    });
    put(&tg, spec).await;
    (tg, backends)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn active_checks_take_backends_out_and_back_and_backups_wait_their_turn() {
    let dir = tempfile::tempdir().unwrap();
    let health = json!({"active": {"path": "/health", "interval_ms": 60, "timeout_ms": 60, "rise": 1, "fall": 2}});
    let (tg, [a, b, _spare]) = with_a_backup(dir.path(), health).await;
    let who = |tg: &Tidegate| {
        let url = tg.url("/");
        async move {
            let mut seen = std::collections::BTreeMap::<String, usize>::new();
            for _ in 0..30 {
                *seen.entry(served_by(&get(&url).await)).or_default() += 1;
            }
            seen
        }
    };
    let seen = who(&tg).await;
    assert!(!seen.contains_key("spare"), "backups idle while primaries serve: {seen:?}");
    // Take b's health down: it leaves rotation.
    let r = send("POST", &format!("http://{}/_emulator/health?up=false", b.addr), None, vec![], &[]).await;
    assert_eq!(r.status, 200);
    health_becomes(&tg, "b", "down").await;
    let seen = who(&tg).await;
    assert_eq!(seen.get("a"), Some(&30), "{seen:?}");
    // Both primaries down: the backup serves.
    send("POST", &format!("http://{}/_emulator/health?up=false", a.addr), None, vec![], &[]).await;
    health_becomes(&tg, "a", "down").await;
    assert_eq!(who(&tg).await.get("spare"), Some(&30));
    // b recovers and takes over again.
    send("POST", &format!("http://{}/_emulator/health?up=true", b.addr), None, vec![], &[]).await;
    health_becomes(&tg, "b", "up").await;
    assert_eq!(who(&tg).await.get("b"), Some(&30));
}

/// Primaries ramping up in slow start keep their backup idle; a service
/// whose every backend has weight 0 says it has no backend, at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_start_keeps_backups_idle_and_weight_zero_means_no_backend() {
    let dir = tempfile::tempdir().unwrap();
    let (tg, [a, b, _spare]) = with_a_backup(dir.path(), json!({"slow_start_ms": 60000})).await;
    let mut seen = std::collections::BTreeMap::<String, usize>::new();
    for _ in 0..100 {
        let r = get(&tg.url("/")).await;
        assert_eq!(r.status, 200, "{}", r.text());
        *seen.entry(served_by(&r)).or_default() += 1;
    }
    assert!(!seen.contains_key("spare"), "the backup served while primaries ramp up: {seen:?}");
    // A request that waited in the queue would take its 30 s timeout.
    let drained = json!({
        "policy": {"kind": "round_robin"},
        "queue": {"timeout_ms": 30000},
        "backends": [
            {"id": "a", "addr": a.addr.to_string(), "weight": 0},
            {"id": "b", "addr": b.addr.to_string(), "weight": 0},
        ],
    });
    put(&tg, drained).await;
    let started = Instant::now();
    let r = get(&tg.url("/")).await;
    assert_eq!((r.status, r.text().trim()), (503, "503 no backend available for this service"));
    assert!(started.elapsed() < Duration::from_secs(10), "it waited in the queue: {:?}", started.elapsed());
}

/// Backend `id` in service `web`'s part of `/v1/status`.
fn backend<'a>(web: &'a Value, id: &str) -> Option<&'a Value> {
    web["backends"].as_array()?.iter().find(|b| b["id"] == id)
}

/// Polls `/v1/status` until backend `id` of `web` has this health (5 s at most).
async fn health_becomes(tg: &Tidegate, id: &str, health: &str) {
    let what = format!("backend {id} becomes {health}");
    web_status_until(tg, &what, |web| backend(web, id).is_some_and(|b| b["health"] == health)).await;
}

/// HAProxy's maxconn: requests over a backend's limit wait in a bounded
/// queue, then either get a slot or a clear 503.
///
/// The request holding the slot takes `HOLD_MS`, long enough that the
/// test's own steps (reading `/v1/status` until the queue holds what it
/// should, then sending the next request) finish well before it on a
/// loaded two-core machine; with 300 ms the slot was sometimes free again
/// by the time the request meant to find it busy arrived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_limits_queue_requests_and_bound_the_queue() {
    const HOLD_MS: u64 = 2500;
    let dir = tempfile::tempdir().unwrap();
    let tg = Arc::new(Tidegate::start(dir.path()));
    let b = Backend::start("one", &[]);
    let spec = json!({
        "queue": {"max": 1, "timeout_ms": 30_000},
        "backends": [{"id": "one", "addr": b.addr.to_string(), "max_conns": 1}],
    });
    put(&tg, spec).await;
    let send = |tg: Arc<Tidegate>, path: String| tokio::spawn(async move { get(&tg.url(&path)).await });
    let hold = || format!("/?delay_ms={HOLD_MS}");
    let first = send(tg.clone(), hold());
    in_flight_reaches(&tg, 1, "the first request holds the slot").await;
    let second = send(tg.clone(), "/".to_string()); // waits in the queue
    web_status_until(&tg, "the second request waits in the queue", |web| web["queued"] == 1).await;
    let third = get(&tg.url("/")).await; // queue full
    assert_eq!(third.status, 503);
    assert!(third.text().contains("queue is full"), "{}", third.text());
    assert_eq!(first.await.unwrap().status, 200);
    let second = second.await.unwrap();
    assert_eq!(second.status, 200, "the queued request got the freed slot");
    // A wait longer than the queue timeout ends in 503 too.
    let spec = json!({
        "queue": {"max": 5, "timeout_ms": 100},
        "backends": [{"id": "one", "addr": b.addr.to_string(), "max_conns": 1}],
    });
    put(&tg, spec).await;
    let busy = send(tg.clone(), hold());
    in_flight_reaches(&tg, 1, "the slow request holds the slot").await;
    let r = get(&tg.url("/")).await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(r.text().contains("queue timeout") || r.text().contains("within the queue timeout"), "{}", r.text());
    assert_eq!(busy.await.unwrap().status, 200);
}

/// Each backend's learned concurrency limit, by id.
async fn learned_limits(tg: &Tidegate) -> Vec<(String, u64)> {
    let (_, status) = tg.api("GET", "/v1/status", None).await;
    let backends = status["services"]["web"]["backends"].as_array().cloned().unwrap_or_default();
    backends
        .iter()
        .map(|b| (b["id"].as_str().unwrap_or("").to_string(), b["concurrency_limit"].as_u64().unwrap_or(0)))
        .collect()
}

/// The median of each backend's learned limit over `samples` reads of
/// `/v1/status`, 200 ms apart.
async fn median_limits(tg: &Tidegate, samples: usize) -> Vec<(String, u64)> {
    let mut seen: Vec<(String, Vec<u64>)> = Vec::new();
    for _ in 0..samples {
        for (id, limit) in learned_limits(tg).await {
            match seen.iter_mut().find(|(i, _)| *i == id) {
                Some((_, v)) => v.push(limit),
                None => seen.push((id, vec![limit])),
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    seen.into_iter()
        .map(|(id, mut v)| {
            v.sort_unstable();
            (id, v[v.len() / 2])
        })
        .collect()
}

/// Requests a backend emulator shed (503, queue full) so far.
async fn shed_by(b: &Backend) -> u64 {
    let reply = get(&format!("http://{}/_emulator/stats", b.addr)).await;
    let stats: Value = serde_json::from_str(&reply.text()).expect("the emulator's stats are JSON");
    stats["rejected"].as_u64().expect("a rejected count")
}

/// Issue 12: a service on the default policy learns each backend's
/// concurrency limit, without being told any capacity. Capacities 1:2:4
/// with small backend queues and twice as many users as slots: the
/// learned limits come within a factor of 2 of the true slots, the
/// excess waits in the proxy's queue (backends shed under 1%), and
/// nothing fails; when one backend's capacity halves mid-run, its limit
/// comes down, and what it sheds meanwhile is retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn learned_limits_find_each_backends_capacity_and_nothing_fails() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Arc::new(Tidegate::start(dir.path()));
    let common = ["--service-time", "fixed:20ms", "--queue", "4"];
    let b1 = Backend::start("c1", &[&["--slots", "1"], &common[..]].concat());
    let b2 = Backend::start("c2", &[&["--slots", "2"], &common[..]].concat());
    let b4 = Backend::start("c4", &[&["--slots", "4"], &common[..]].concat());
    let pool = [("c1", &b1), ("c2", &b2), ("c4", &b4)];
    // No policy: the default, which learns limits. Passive ejection is
    // off: when c4's capacity halves, the requests already sent to it are
    // shed, and on two cores shared with the other tests five in a row
    // (the default threshold) once ejected it, which left the learner
    // without samples for the rest of the test.
    let list: Vec<Value> = pool.iter().map(|(id, b)| json!({"id": id, "addr": b.addr.to_string()})).collect();
    put(&tg, json!({"backends": list, "health": {"passive": {"consecutive_failures": 0}}})).await;
    let (_, status) = tg.api("GET", "/v1/status", None).await;
    assert_eq!(status["services"]["web"]["learns_limits"], true, "{status}");

    let load = tokio::spawn({
        let tg = tg.clone();
        async move { closed_loop(&tg, 14, 17.0).await }
    });
    tokio::time::sleep(Duration::from_secs(4)).await;
    let limits = median_limits(&tg, 10).await;
    // Within a factor of 2 of the true slots, in their order (how close,
    // on a quiet machine, is the heterogeneous benchmark's to measure: a
    // median of 7 for 4 slots was read here with the e2e tests sharing two
    // cores). The claim that matters, no backend queue overflowing, is
    // the shed bound below.
    for ((id, limit), slots) in limits.iter().zip([1.0, 2.0, 4.0]) {
        let l = *limit as f64;
        assert!(l >= slots / 2.0 && l <= slots * 2.0, "{id}: learned {limit} for {slots} slots ({limits:?})");
    }
    assert!(limits.windows(2).all(|w| w[0].1 <= w[1].1), "limits in the order of the slots: {limits:?}");
    // The steady state: with limits learned, the excess waited in the
    // proxy's queue, not in the backends' (whose queues of 4 overflow
    // into sheds). Read before the halving, whose transient sheds are
    // expected (retried, so nothing fails) and depend on how fast the
    // learner reacts on two busy cores.
    let shed_before = shed_by(&b1).await + shed_by(&b2).await + shed_by(&b4).await;
    let (_, status) = tg.api("GET", "/v1/status", None).await;
    let served_before: u64 = status["services"]["web"]["backends"]
        .as_array()
        .map(|list| list.iter().map(|b| b["requests"].as_u64().unwrap_or(0)).sum())
        .unwrap_or(0);
    assert!(served_before > 500, "{status}");
    assert!(
        (shed_before as f64) < 0.01 * served_before as f64,
        "backends shed {shed_before} of {served_before} requests before the halving"
    );
    // c4 loses half its slots: its limit comes down while the load goes
    // on. How fast, and how far, is for the heterogeneous benchmark to
    // measure on a quiet machine. Here the e2e tests share two cores: when
    // the proxy itself is slow, a rise that cuts do not bring down reads
    // as not queueing at the backend (the estimator's flat-curve rule),
    // and the limit may stay or climb back. A median over seconds once
    // stayed at 5 in CI, and a run of reads once stayed at 4 (from 6)
    // for 9 s. What this test checks is that the learner reacts: within
    // 9 s (read every 100 ms) the limit reads below what it learned for 4
    // slots, and at most 4 (twice the 2 slots left).
    let before = limits.iter().find(|(id, _)| id == "c4").map_or(0, |(_, l)| *l);
    let halved = send("POST", &format!("http://{}/_emulator/slots?n=2", b4.addr), None, vec![], &[]).await;
    assert_eq!(halved.status, 200);
    let deadline = Instant::now() + Duration::from_secs(9);
    let mut read = Vec::new();
    let came_down = |l: u64| l < before && l <= 4;
    let after = loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = learned_limits(&tg).await;
        let c4 = now.iter().find(|(id, _)| id == "c4").map_or(u64::MAX, |(_, l)| *l);
        read.push(c4);
        if came_down(c4) || Instant::now() >= deadline {
            break now;
        }
    };
    assert!(
        read.last().is_some_and(|l| came_down(*l)),
        "c4's limit never came down from {before} after its slots went 4 -> 2: {read:?}"
    );
    let r = load.await.unwrap();
    eprintln!("learned {limits:?}, after halving {after:?}, load {r:?}");
    assert_eq!(r.failed, 0, "{r:?}");
    assert!(r.ok > 2_000, "{r:?}");
}

/// Issue 12: the `prequal` policy probes the backends (here the emulators'
/// health path, which reports requests in flight and latency in an ORCA
/// header) and sends little to a backend that is ten times slower, with
/// nothing failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prequal_probes_steer_requests_away_from_a_slow_backend() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Arc::new(Tidegate::start(dir.path()));
    let fast = ["--slots", "4", "--service-time", "fixed:5ms", "--orca"];
    let a = Backend::start("fast-a", &fast);
    let b = Backend::start("fast-b", &fast);
    let slow = Backend::start("slow", &["--slots", "4", "--service-time", "fixed:50ms", "--orca"]);
    let pool = [("fast-a", &a), ("fast-b", &b), ("slow", &slow)];
    let policy = json!({"kind": "prequal", "probe_path": "/health", "max_age_ms": 500});
    put(&tg, service(&pool, policy, json!({}))).await;
    let r = closed_loop(&tg, 6, 3.0).await;
    assert_eq!(r.failed, 0, "{r:?}");
    let (_, status) = tg.api("GET", "/v1/status", None).await;
    let requests: Vec<u64> = status["services"]["web"]["backends"]
        .as_array()
        .expect("backends")
        .iter()
        .map(|b| b["requests"].as_u64().unwrap_or(0))
        .collect();
    let total: u64 = requests.iter().sum();
    eprintln!("prequal: {r:?}, requests per backend {requests:?}");
    assert!(total > 500, "{requests:?}");
    assert!(requests[2] * 10 < total, "the slow backend got {} of {total}", requests[2]);
}

/// A limit set on a busy service: the requests already in flight were
/// taken without a limit, so their ends wake no one; the first in line
/// still looks for room by itself, and the queue drains when they end
/// instead of timing out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_set_on_a_busy_service_does_not_stall_its_queue() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Arc::new(Tidegate::start(dir.path()));
    let b = Backend::start("b", &[]);
    let addr = b.addr.to_string();
    let spec = json!({"concurrency": {"learn": false}, "queue": {"timeout_ms": 3000},
                      "backends": [{"id": "b", "addr": addr}]});
    put(&tg, spec).await;
    let slow: Vec<_> = (0..10)
        .map(|_| {
            let tg = tg.clone();
            tokio::spawn(async move { get(&tg.url("/?delay_ms=600")).await.status })
        })
        .collect();
    in_flight_reaches(&tg, 10, "the ten slow requests are in flight").await;
    let (s, v) = tg.api("PUT", "/v1/services/web/backends/b", Some(json!({"addr": addr, "max_conns": 1}))).await;
    assert_eq!(s, 200, "{v}");
    let waiting: Vec<_> = (0..5)
        .map(|_| {
            let tg = tg.clone();
            tokio::spawn(async move { get(&tg.url("/?delay_ms=10")).await.status })
        })
        .collect();
    // A stalled queue answers 503 after its 3 s: each gets its 200.
    for w in waiting {
        assert_eq!(w.await.unwrap(), 200, "a queued request timed out");
    }
    for s in slow {
        assert_eq!(s.await.unwrap(), 200);
    }
}
