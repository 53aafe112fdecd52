//! Tidegate's active health checks.
//!
//! For every service whose settings have `health.active`, each backend gets
//! its own prober: a tokio task that probes the backend every
//! `interval_ms` (an HTTP `GET` or a TCP connect, see [`probe`]) and feeds
//! the result to the backend's live statistics with
//! [`BackendStats::record_probe`](tidegate_balance::BackendStats::record_probe),
//! whose state the data plane filters on. State changes are logged at info
//! level.
//!
//! [`spawn`] keeps the probers in step with the current snapshot: every
//! 250 ms, if the snapshot changed, a [`HealthChecker`] compares the probers
//! the snapshot asks for with the running ones (the pure [`plan`]) and
//! starts and aborts probers accordingly. A prober holds its backend's
//! `Arc<BackendStats>`; since the snapshot builder carries those over for
//! backends that keep their id and address, a backend that survives a
//! configuration change keeps its prober, its counters and its state. A
//! prober is replaced when the backend's address, the service's check or
//! the statistics change.

mod plan;
mod probe;
mod prober;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tidegate_balance::{clock, ActiveState};
use tidegate_snapshot::{Changes, Snapshot};
use tokio::task::JoinHandle;

pub use plan::{plan, Plan, ProbeKey, Target};
pub use probe::{get_via, probe, status_expected, GetError, ProbeClient, Verdict, MAX_PROBE_BODY, PROBE_USER_AGENT};
pub use prober::MAX_START_JITTER;

/// The least time between two passes of [`spawn`]'s task over a new
/// snapshot: a burst of changes (a rolling deploy, a churning API client)
/// costs one pass per this, not one per change.
pub const RECONCILE_EVERY: Duration = Duration::from_millis(250);

/// Starts the health checker on the current tokio runtime: until the
/// returned task is aborted, one prober runs per backend of every service
/// with an active check in the snapshot currently in `snapshots`. The task
/// looks at the snapshot when `changes` says a new one was published (at
/// once after a quiet spell, then at most every [`RECONCILE_EVERY`]), so it
/// never wakes for nothing.
///
/// Aborting the task stops every prober. Must be called from within a
/// tokio runtime; the probers run on the same runtime.
pub fn spawn(snapshots: Arc<ArcSwap<Snapshot>>, mut changes: Changes) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut checker = HealthChecker::new();
        loop {
            checker.reconcile(&snapshots.load_full());
            tokio::time::sleep(RECONCILE_EVERY).await;
            changes.next().await;
        }
    })
}

/// The running probers, and the means to bring them in line with a
/// snapshot. Dropping it aborts every prober.
#[derive(Debug, Default)]
pub struct HealthChecker {
    client: ProbeClient,
    probers: HashMap<ProbeKey, Prober>,
}

#[derive(Debug)]
struct Prober {
    target: Target,
    task: JoinHandle<()>,
}

impl HealthChecker {
    /// A checker with no prober and its own HTTP client.
    pub fn new() -> HealthChecker {
        HealthChecker::default()
    }

    /// Starts and aborts probers so that exactly the ones `snapshot` asks
    /// for run (see [`wanted`]); a prober whose task ended is started again.
    /// Returns what was done. Must be called from within a tokio runtime.
    ///
    /// When a backend loses its active check while down (the check was
    /// removed from its service), nothing would ever probe it up again, so
    /// it is marked up here: without an active check a backend is
    /// available.
    pub fn reconcile(&mut self, snapshot: &Snapshot) -> Plan<ProbeKey> {
        let mut wanted = wanted(snapshot);
        let plan = plan(&wanted, &self.probers, |w, r| r.target.same_as(w) && !r.task.is_finished());
        for key in &plan.stop {
            let Some(old) = self.probers.remove(key) else { continue };
            old.task.abort();
            if !wanted.contains_key(key) {
                release(key, &old.target);
            }
        }
        for key in &plan.start {
            let Some(target) = wanted.remove(key) else { continue };
            let task = tokio::spawn(prober::run(key.clone(), target.clone(), self.client.clone()));
            self.probers.insert(key.clone(), Prober { target, task });
        }
        if !plan.is_empty() {
            tracing::debug!(
                started = plan.start.len(),
                stopped = plan.stop.len(),
                running = self.probers.len(),
                revision = snapshot.revision(),
                "health probers reconciled"
            );
        }
        plan
    }

    /// Number of probers running.
    pub fn len(&self) -> usize {
        self.probers.len()
    }

    /// True when no prober runs.
    pub fn is_empty(&self) -> bool {
        self.probers.is_empty()
    }

    /// The target of a running prober.
    pub fn target(&self, key: &ProbeKey) -> Option<&Target> {
        self.probers.get(key).map(|p| &p.target)
    }
}

impl Drop for HealthChecker {
    fn drop(&mut self) {
        for prober in self.probers.values() {
            prober.task.abort();
        }
    }
}

/// The probers `snapshot` asks for: one per backend (primaries and backups)
/// of every service whose settings have `health.active`.
pub fn wanted(snapshot: &Snapshot) -> HashMap<ProbeKey, Target> {
    let mut out = HashMap::new();
    for service in snapshot.services() {
        let Some(check) = &service.settings.health.active else { continue };
        let check = Arc::new(check.clone());
        for backend in service.selector.backends() {
            let key = ProbeKey { service: service.name.clone(), backend: backend.id.clone() };
            let target = Target { backend: backend.clone(), check: check.clone(), upstream: service.upstream.clone() };
            out.insert(key, target);
        }
    }
    out
}

/// A prober stopped for good: a backend it left down would stay out of
/// rotation with nothing to bring it back, so mark it up.
fn release(key: &ProbeKey, target: &Target) {
    let stats = &target.backend.stats;
    if stats.active_state() == ActiveState::Down {
        stats.record_probe(true, 1, 1, clock::now_ms());
        tracing::info!(
            service = key.service.as_str(),
            backend = key.backend.as_str(),
            addr = target.backend.addr.as_str(),
            reason = "active health check removed",
            "backend up"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probe::tests::closed_port;
    use std::sync::atomic::{AtomicU16, Ordering};
    use std::sync::Mutex;
    use std::time::Instant;
    use tidegate_balance::BackendStats;
    use tidegate_model::{parse_change_set, ConfigState};
    use tidegate_snapshot::Publications;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// A configuration and its snapshots, built the way the writer does.
    struct World {
        state: ConfigState,
        snapshot: Arc<Snapshot>,
        revision: u64,
    }

    impl World {
        fn new() -> World {
            World { state: ConfigState::default(), snapshot: Arc::new(Snapshot::empty()), revision: 0 }
        }

        fn apply(&mut self, ops: &str) -> Arc<Snapshot> {
            let cs = parse_change_set(format!(r#"{{"ops":[{ops}]}}"#).as_bytes()).unwrap();
            let (state, delta) = self.state.apply(&cs, self.revision).unwrap();
            self.revision += 1;
            self.snapshot = Arc::new(self.snapshot.next(&state, &delta, self.revision));
            self.state = state;
            self.snapshot.clone()
        }

        fn stats(&self, service: &str, backend: &str) -> Arc<BackendStats> {
            let s = self.snapshot.service(service).unwrap();
            s.selector.backends().iter().find(|b| b.id.as_str() == backend).unwrap().stats.clone()
        }
    }

    fn key(service: &str, backend: &str) -> ProbeKey {
        ProbeKey {
            service: tidegate_model::ServiceName::new(service).unwrap(),
            backend: tidegate_model::BackendId::new(backend).unwrap(),
        }
    }

    fn sorted(mut p: Plan<ProbeKey>) -> (Vec<ProbeKey>, Vec<ProbeKey>) {
        p.stop.sort();
        p.start.sort();
        (p.stop, p.start)
    }

    /// Polls until the backend's state is `want`, for up to 20 s.
    async fn wait_for(stats: &BackendStats, want: ActiveState) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while stats.active_state() != want {
            assert!(Instant::now() < deadline, "still {:?}, waited for {want:?}", stats.active_state());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test]
    async fn reconcile_follows_the_snapshots() {
        let ((_h1, p1), (_h2, p2), (_h3, p3)) = (closed_port(), closed_port(), closed_port());
        let health = |interval: u32| format!(r#""health":{{"active":{{"kind":"tcp","interval_ms":{interval}}}}}"#);
        let mut world = World::new();
        let mut checker = HealthChecker::new();
        let snap = world.apply(&format!(
            r#"{{"op":"put_service","name":"web","spec":{{{},"backends":[
                {{"id":"a","addr":"{p1}"}},{{"id":"b","addr":"{p2}","backup":true}}]}}}},
               {{"op":"put_service","name":"plain","spec":{{"backends":[{{"id":"c","addr":"{p3}"}}]}}}}"#,
            health(60_000)
        ));
        assert_eq!(sorted(checker.reconcile(&snap)), (vec![], vec![key("web", "a"), key("web", "b")]));
        assert_eq!(checker.len(), 2);
        assert!(checker.reconcile(&snap).is_empty(), "same snapshot, nothing to do");

        // A change that keeps a's id and address keeps its prober.
        let snap = world
            .apply(&format!(r#"{{"op":"put_backend","service":"web","id":"a","spec":{{"addr":"{p1}","weight":5}}}}"#));
        let stats_a = world.stats("web", "a");
        assert!(checker.reconcile(&snap).is_empty(), "a survived the swap");
        assert!(Arc::ptr_eq(&checker.target(&key("web", "a")).unwrap().backend.stats, &stats_a));

        // A new address means new statistics and a new prober; so does a
        // new backend, and a removed one loses its prober.
        let snap = world.apply(&format!(
            r#"{{"op":"put_backend","service":"web","id":"b","spec":{{"addr":"{p3}"}}}},
               {{"op":"put_backend","service":"web","id":"d","spec":{{"addr":"{p1}"}}}},
               {{"op":"delete_backend","service":"web","id":"a"}}"#
        ));
        assert_eq!(
            sorted(checker.reconcile(&snap)),
            (vec![key("web", "a"), key("web", "b")], vec![key("web", "b"), key("web", "d")])
        );
        assert_eq!(checker.target(&key("web", "b")).unwrap().backend.addr.as_str(), p3.as_str());

        // A changed check restarts every prober of the service.
        let snap = world.apply(&format!(
            r#"{{"op":"put_service","name":"web","spec":{{{},"backends":[
                {{"id":"b","addr":"{p3}"}},{{"id":"d","addr":"{p1}"}}]}}}}"#,
            health(30_000)
        ));
        let plan = sorted(checker.reconcile(&snap));
        assert_eq!(plan.0, vec![key("web", "b"), key("web", "d")]);
        assert_eq!(plan.0, plan.1);
        assert_eq!(checker.target(&key("web", "d")).unwrap().check.interval_ms, 30_000);

        // Removing the check stops the probers and releases a down backend.
        let stats_d = world.stats("web", "d");
        stats_d.record_probe(false, 1, 1, clock::now_ms());
        assert_eq!(stats_d.active_state(), ActiveState::Down);
        let snap = world.apply(&format!(
            r#"{{"op":"put_service","name":"web","spec":{{"backends":[{{"id":"b","addr":"{p3}"}},{{"id":"d","addr":"{p1}"}}]}}}}"#
        ));
        assert!(Arc::ptr_eq(&world.stats("web", "d"), &stats_d), "stats carried over");
        assert_eq!(sorted(checker.reconcile(&snap)), (vec![key("web", "b"), key("web", "d")], vec![]));
        assert!(checker.is_empty());
        assert_ne!(stats_d.active_state(), ActiveState::Down);
    }

    /// A tiny HTTP/1.1 server (keep-alive) answering every request with the
    /// status in `status`; it logs each answer's status and request head.
    struct TestServer {
        addr: String,
        status: Arc<AtomicU16>,
        log: Arc<Mutex<Vec<(u16, String)>>>,
        task: JoinHandle<()>,
    }

    impl TestServer {
        async fn start() -> TestServer {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap().to_string();
            let status = Arc::new(AtomicU16::new(200));
            let log = Arc::new(Mutex::new(Vec::new()));
            let (s, l) = (status.clone(), log.clone());
            let task = tokio::spawn(async move {
                while let Ok((conn, _)) = listener.accept().await {
                    tokio::spawn(Self::connection(conn, s.clone(), l.clone()));
                }
            });
            TestServer { addr, status, log, task }
        }

        async fn connection(
            mut conn: tokio::net::TcpStream,
            status: Arc<AtomicU16>,
            log: Arc<Mutex<Vec<(u16, String)>>>,
        ) {
            let mut buf = Vec::new();
            let mut chunk = [0u8; 2048];
            loop {
                while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                    buf.drain(..end + 4);
                    let code = status.load(Ordering::SeqCst);
                    log.lock().unwrap().push((code, head));
                    let response = format!("HTTP/1.1 {code} Test\r\nContent-Length: 5\r\n\r\nhello");
                    if conn.write_all(response.as_bytes()).await.is_err() {
                        return;
                    }
                }
                match conn.read(&mut chunk).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                }
            }
        }

        fn count(&self, code: u16) -> usize {
            self.log.lock().unwrap().iter().filter(|(c, _)| *c == code).count()
        }
    }

    #[tokio::test]
    async fn http_prober_rises_and_falls() {
        let server = TestServer::start().await;
        let mut world = World::new();
        let snap = world.apply(&format!(
            r#"{{"op":"put_service","name":"web","spec":{{
                "health":{{"active":{{"path":"/healthz?deep=1","interval_ms":100,"timeout_ms":100,"rise":2,"fall":3}}}},
                "backends":[{{"id":"a","addr":"{}"}}]}}}}"#,
            server.addr
        ));
        let stats = world.stats("web", "a");
        assert_eq!(stats.active_state(), ActiveState::Unchecked);
        let checker = spawn(Arc::new(ArcSwap::new(snap)), Publications::new(0).follow());

        wait_for(&stats, ActiveState::Up).await;
        let head = server.log.lock().unwrap()[0].1.to_ascii_lowercase();
        assert!(head.starts_with("get /healthz?deep=1 http/1.1\r\n"), "{head}");
        assert!(head.contains(&format!("\r\nhost: {}", server.addr)), "{head}");
        assert!(head.contains("\r\nuser-agent: tidegate-health"), "{head}");

        server.status.store(503, Ordering::SeqCst);
        wait_for(&stats, ActiveState::Down).await;
        assert!(server.count(503) >= 3, "down only after `fall` failures");

        let passes_before = server.count(200);
        server.status.store(204, Ordering::SeqCst);
        wait_for(&stats, ActiveState::Up).await;
        assert!(server.count(204) >= 2, "up only after `rise` passes");
        assert_eq!(server.count(200), passes_before);

        checker.abort();
        server.task.abort();
    }

    #[tokio::test]
    async fn http_prober_honours_expected_statuses() {
        let server = TestServer::start().await;
        server.status.store(418, Ordering::SeqCst);
        let mut world = World::new();
        let snap = world.apply(&format!(
            r#"{{"op":"put_service","name":"tea","spec":{{
                "health":{{"active":{{"expect_status":[418],"interval_ms":100,"timeout_ms":100,"rise":1,"fall":1}}}},
                "backends":[{{"id":"pot","addr":"{}"}}]}}}}"#,
            server.addr
        ));
        let stats = world.stats("tea", "pot");
        let checker = spawn(Arc::new(ArcSwap::new(snap)), Publications::new(0).follow());
        wait_for(&stats, ActiveState::Up).await;
        server.status.store(200, Ordering::SeqCst);
        wait_for(&stats, ActiveState::Down).await;
        checker.abort();
        server.task.abort();
    }

    #[tokio::test]
    async fn tcp_probe_of_a_closed_port_goes_down_and_aborting_stops_probing() {
        let (_held, addr) = closed_port();
        let mut world = World::new();
        let snapshots = Arc::new(ArcSwap::new(world.apply(&format!(
            r#"{{"op":"put_service","name":"db","spec":{{
                "health":{{"active":{{"kind":"tcp","interval_ms":100,"timeout_ms":100,"fall":2}}}},
                "backends":[{{"id":"a","addr":"{addr}"}}]}}}}"#
        ))));
        let stats = world.stats("db", "a");
        let publications = Publications::new(0);
        let checker = spawn(snapshots.clone(), publications.follow());
        wait_for(&stats, ActiveState::Down).await;

        // A new snapshot with the backend moved to a listening port: a new
        // prober with fresh statistics brings it up.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let open = listener.local_addr().unwrap().to_string();
        snapshots.store(
            world.apply(&format!(r#"{{"op":"put_backend","service":"db","id":"a","spec":{{"addr":"{open}"}}}}"#)),
        );
        publications.announce(1);
        let moved = world.stats("db", "a");
        wait_for(&moved, ActiveState::Up).await;

        checker.abort();
        let _ = checker.await;
        // With the task gone, its probers are gone too: closing the port
        // no longer changes anything.
        drop(listener);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(moved.active_state(), ActiveState::Up, "no prober left to see the closed port");
    }
}
