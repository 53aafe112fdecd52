//! The supervisor against a fake exporter and a fake gmond on loopback.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tidegate_model::{parse_change_set, ConfigState};
use tidegate_snapshot::{Publications, Snapshot};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// A snapshot of the configuration `ops` (a change-set JSON) builds.
pub(crate) fn snapshot_of(ops: &str) -> Snapshot {
    Config::new(ops).snapshots.load_full().as_ref().clone()
}

/// A configuration that changes, published like the writer does.
struct Config {
    state: ConfigState,
    revision: u64,
    snapshots: Arc<ArcSwap<Snapshot>>,
    publications: Publications,
}

impl Config {
    fn new(ops: &str) -> Config {
        let mut c = Config {
            state: ConfigState::default(),
            revision: 0,
            snapshots: Arc::default(),
            publications: Publications::new(0),
        };
        c.apply(ops);
        c
    }

    fn apply(&mut self, ops: &str) {
        let change = parse_change_set(ops.as_bytes()).expect("change set");
        let (state, delta) = self.state.apply(&change, self.revision).expect("valid change");
        self.revision += 1;
        let next = self.snapshots.load().next(&state, &delta, self.revision);
        self.snapshots.store(Arc::new(next));
        self.publications.announce(self.revision);
        self.state = state;
    }

    fn load(&self, service: &str, backend: usize) -> (f64, f64, f64) {
        let snap = self.snapshots.load_full();
        let b = &snap.service(service).expect("service").selector.backends()[backend];
        let l = &b.stats.load;
        (l.cpu.get(), l.memory.get(), l.network.get())
    }
}

/// Serves node_exporter-like text whose CPU counters grow 1 s idle and 3 s
/// user per scrape (75 % busy), memory 75 % used, `lo` only. Counts scrapes.
async fn fake_exporter() -> (SocketAddr, Arc<AtomicU64>, JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let hits = Arc::new(AtomicU64::new(0));
    let counter = hits.clone();
    let server = tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let n = counter.fetch_add(1, SeqCst) + 1;
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(k) => head.extend_from_slice(&buf[..k]),
                    }
                }
                let body = format!(
                    "# TYPE node_cpu_seconds_total counter\n\
                     node_cpu_seconds_total{{cpu=\"0\",mode=\"idle\"}} {n}\n\
                     node_cpu_seconds_total{{cpu=\"0\",mode=\"user\"}} {}\n\
                     node_memory_MemAvailable_bytes 25\nnode_memory_MemTotal_bytes 100\n\
                     node_network_receive_bytes_total{{device=\"lo\"}} {}\n\
                     node_network_transmit_bytes_total{{device=\"lo\"}} 0\n",
                    3 * n,
                    1000 * n
                );
                let reply = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(reply.as_bytes()).await;
            });
        }
    });
    (addr, hits, server)
}

/// Answers every connection with `xml` and closes it, like gmond.
async fn fake_gmond(xml: &'static [u8]) -> (SocketAddr, JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let _ = conn.write_all(xml).await;
        }
    });
    (addr, server)
}

async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn node_service(name: &str, port: u16, addrs: &[&str]) -> String {
    let backends: Vec<String> =
        addrs.iter().enumerate().map(|(i, a)| format!(r#"{{"id":"b{i}","addr":"{a}"}}"#)).collect();
    format!(
        r#"{{"op":"put_service","name":"{name}","spec":{{
            "load_metrics":{{"node_exporter":{{"port":{port},"interval_ms":100,"link_bytes_per_s":1000000}}}},
            "backends":[{}]}}}}"#,
        backends.join(",")
    )
}

#[tokio::test]
async fn node_exporter_feeds_every_backend_on_its_host_from_one_scrape_loop() {
    let (exporter, hits, server) = fake_exporter().await;
    let p = exporter.port();
    let a = node_service("a", p, &["127.0.0.1:1", "127.0.0.1:2"]);
    let b = node_service("b", p, &["127.0.0.1:3"]);
    let config = Config::new(&format!(r#"{{"ops":[{a},{b}]}}"#));
    let sources = super::spawn(config.snapshots.clone(), config.publications.follow());

    let all = [("a", 0), ("a", 1), ("b", 0)];
    eventually("every backend has CPU, memory and network", || {
        all.iter().all(|&(s, i)| {
            let (cpu, mem, net) = config.load(s, i);
            !cpu.is_nan() && !mem.is_nan() && !net.is_nan()
        })
    })
    .await;
    for (s, i) in all {
        let (cpu, mem, net) = config.load(s, i);
        assert!((cpu - 0.75).abs() < 1e-9, "{s}/{i}: cpu {cpu}");
        assert!((mem - 0.75).abs() < 1e-9, "{s}/{i}: memory {mem}");
        assert!(net > 0.0 && net <= 1.0, "{s}/{i}: network {net}");
    }
    // One loop for the host, not one per service or backend: ten scrapes
    // take about a second at 100 ms (a loop per backend would take a
    // fraction of it; a stalled machine only makes it longer).
    let (before, began) = (hits.load(SeqCst), std::time::Instant::now());
    eventually("ten more scrapes", || hits.load(SeqCst) - before >= 10).await;
    let (scrapes, took) = (hits.load(SeqCst) - before, began.elapsed());
    let most = took.as_millis() as u64 / 100 + 3;
    assert!(scrapes <= most, "{scrapes} scrapes in {took:?}, one loop makes at most {most}");

    // The exporter goes away: after three intervals the values are unknown.
    server.abort();
    eventually("stale values are reset", || all.iter().all(|&(s, i)| config.load(s, i).0.is_nan())).await;
    sources.abort();
}

#[tokio::test]
async fn a_service_that_drops_its_source_forgets_the_values() {
    let (exporter, _hits, _server) = fake_exporter().await;
    let p = exporter.port();
    let a = node_service("a", p, &["127.0.0.1:1"]);
    let b = node_service("b", p, &["127.0.0.1:2"]);
    let mut config = Config::new(&format!(r#"{{"ops":[{a},{b}]}}"#));
    let sources = super::spawn(config.snapshots.clone(), config.publications.follow());
    eventually("values arrive", || !config.load("a", 0).0.is_nan() && !config.load("b", 0).0.is_nan()).await;

    // Same backend (so the same stats), no load_metrics any more.
    config.apply(r#"{"ops":[{"op":"put_service","name":"a","spec":{"backends":[{"id":"b0","addr":"127.0.0.1:1"}]}}]}"#);
    eventually("a's values are forgotten", || config.load("a", 0).1.is_nan()).await;
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(config.load("a", 0).1.is_nan(), "nothing writes a's backend any more");
        assert_eq!(config.load("b", 0).1, 0.75, "b keeps its source");
    }
    sources.abort();
}

#[tokio::test]
async fn ganglia_feeds_backends_from_a_recorded_gmond_dump() {
    let (gmond, server) = fake_gmond(include_bytes!("../testdata/gmond-localhost.xml")).await;
    let config = Config::new(&format!(
        r#"{{"ops":[{{"op":"put_service","name":"g","spec":{{
            "load_metrics":{{"ganglia":{{"addr":"{gmond}","interval_ms":100,"link_bytes_per_s":7}}}},
            "backends":[{{"id":"x","addr":"127.0.0.1:1"}},{{"id":"y","addr":"localhost:2"}}]}}}}]}}"#
    ));
    let sources = super::spawn(config.snapshots.clone(), config.publications.follow());
    eventually("values arrive", || !config.load("g", 0).0.is_nan() && !config.load("g", 1).0.is_nan()).await;
    for i in 0..2 {
        let (cpu, mem, net) = config.load("g", i);
        assert!((cpu - 0.498).abs() < 1e-9, "{cpu}");
        assert!((mem - (1.0 - (22264880.0 + 2075184.0 + 20676.0) / 24684084.0)).abs() < 1e-9, "{mem}");
        assert!((net - 0.01).abs() < 1e-9, "0.07 B/s over a 7 B/s link: {net}");
    }
    server.abort();
    eventually("stale values are reset", || config.load("g", 0).0.is_nan()).await;
    sources.abort();
}

#[tokio::test]
async fn the_refresher_recomputes_dynamic_weights() {
    let config = Config::new(
        r#"{"ops":[{"op":"put_service","name":"f","spec":{
            "policy":{"kind":"dynamic_feedback","interval_ms":50},
            "backends":[{"id":"busy","addr":"127.0.0.1:1"},{"id":"idle","addr":"127.0.0.1:2"}]}}]}"#,
    );
    let snap = config.snapshots.load_full();
    let service = snap.service("f").expect("service");
    service.selector.backends()[0].stats.load.cpu.set(0.9);
    service.selector.backends()[1].stats.load.cpu.set(0.1);
    assert!(service.selector.weights().is_none());
    let sources = super::spawn(config.snapshots.clone(), config.publications.follow());
    eventually("weights are computed", || service.selector.weights().is_some()).await;
    let w = service.selector.weights().expect("weights");
    assert!(w[1] > 1.3 * w[0], "the idle backend weighs more: {w:?}");
    sources.abort();
}

#[tokio::test]
async fn a_source_added_to_an_idle_configuration_starts() {
    // No source and no refreshing policy: the task sleeps until a change.
    let mut config = Config::new(r#"{"ops":[{"op":"put_service","name":"a","spec":{}}]}"#);
    let sources = super::spawn(config.snapshots.clone(), config.publications.follow());
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (exporter, hits, _server) = fake_exporter().await;
    let a = node_service("a", exporter.port(), &["127.0.0.1:1"]);
    config.apply(&format!(r#"{{"ops":[{a}]}}"#));
    eventually("values arrive", || !config.load("a", 0).0.is_nan()).await;
    assert!(hits.load(SeqCst) > 0);
    sources.abort();
}
