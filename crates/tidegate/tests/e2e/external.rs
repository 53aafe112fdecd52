//! The external distributor policy (paper S4), with the reference
//! distributor (`tidegate distributor`) as a real process.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};

use serde_json::json;

use crate::support::*;

async fn put_external(tg: &Tidegate, addr: &str, policy: &str, backends: serde_json::Value) {
    let spec = json!({
        "policy": {"kind": "external", "addr": addr, "policy": policy, "timeout_ms": 20, "tries": 3},
        "backends": backends,
    });
    let (s, v) = tg.api("PUT", "/v1/services/web", Some(spec)).await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = tg.api("PUT", "/v1/routes/web", Some(json!({"service": "web"}))).await;
    assert_eq!(s, 200, "{v}");
}

/// A reference distributor process, stopped when dropped (also when a
/// test fails).
struct Distributor(std::process::Child);

impl Drop for Distributor {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The reference distributor choosing among `backends` (by `IP:PORT`),
/// and the UDP address it listens on.
fn reference_distributor(backends: &[&Backend]) -> (Distributor, String) {
    reference_distributor_with(backends, &[])
}

/// [`reference_distributor`] with more arguments.
fn reference_distributor_with(backends: &[&Backend], args: &[String]) -> (Distributor, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tidegate"));
    cmd.args(["distributor", "--listen", "127.0.0.1:0"]).env("TIDEGATE_LOG", "warn").stdout(Stdio::piped());
    cmd.args(args);
    for b in backends {
        cmd.args(["--backend", &b.addr.to_string()]);
    }
    let mut child = cmd.spawn().expect("start the reference distributor");
    let mut line = String::new();
    let stdout = child.stdout.take().expect("the distributor's stdout");
    std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line).expect("its first line");
    let addr = line.trim().strip_prefix("distributor listening on ").expect(&line).to_string();
    (Distributor(child), addr)
}

/// Sessions (a cookie) stay on one backend for `rounds` requests each.
async fn sessions_stick(tg: &Tidegate, rounds: usize) -> bool {
    for sid in ["alice", "bob", "carol"] {
        let cookie = format!("sid={sid}");
        let first = served_by(&send("GET", &tg.url("/"), None, vec![], &[("cookie", &cookie)]).await);
        for _ in 0..rounds {
            let r = send("GET", &tg.url("/"), None, vec![], &[("cookie", &cookie)]).await;
            if served_by(&r) != first {
                return false;
            }
        }
    }
    true
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backends_named_by_host_match_the_distributors_addresses() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let (a, b) = (Backend::start("a", &[]), Backend::start("b", &[]));
    let (_distributor, addr) = reference_distributor(&[&a, &b]);
    // The service names them `localhost:PORT`; the distributor answers
    // `127.0.0.1:PORT`. Unmatched answers would leave each request to the
    // local round robin, which alternates and breaks every session.
    let backends = json!([
        {"id": "a", "addr": format!("localhost:{}", a.addr.port())},
        {"id": "b", "addr": format!("localhost:{}", b.addr.port())},
    ]);
    put_external(&tg, &addr, "session", backends).await;
    // The first answers start the lookups (in each worker).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !sessions_stick(&tg, 10).await {
        assert!(std::time::Instant::now() < deadline, "the distributor's answers never matched the named backends");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_distributor_falls_back_to_the_backup() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let a = Backend::start("primary", &[]);
    let spare = Backend::start("spare", &[]);
    // A UDP socket that never answers.
    let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = silent.local_addr().unwrap().to_string();
    let backends = json!([
        {"id": "a", "addr": a.addr.to_string()},
        {"id": "spare", "addr": spare.addr.to_string(), "backup": true},
    ]);
    put_external(&tg, &addr, "least_cpu", backends).await;
    let started = std::time::Instant::now();
    for _ in 0..5 {
        let r = get(&tg.url("/")).await;
        assert_eq!((r.status, served_by(&r).as_str()), (200, "spare"));
    }
    // Three tries of 20 ms each before falling back, per request.
    assert!(started.elapsed() >= std::time::Duration::from_millis(5 * 55));
    let mut buf = [0u8; 9000];
    silent.set_read_timeout(Some(std::time::Duration::from_millis(100))).unwrap();
    let (n, _) = silent.recv_from(&mut buf).expect("the proxy queried the distributor");
    let query: serde_json::Value = serde_json::from_slice(&buf[..n]).unwrap();
    assert_eq!(query["policy"], "least_cpu");
    assert_eq!(query["method"], "GET");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reference_distributor_spreads_and_keeps_sessions() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let a = Backend::start("a", &[]);
    let b = Backend::start("b", &[]);
    let (_distributor, addr) = reference_distributor(&[&a, &b]);
    let backends = json!([{"id": "a", "addr": a.addr.to_string()}, {"id": "b", "addr": b.addr.to_string()}]);

    put_external(&tg, &addr, "round_robin", backends.clone()).await;
    let mut seen = BTreeMap::<String, usize>::new();
    for _ in 0..20 {
        *seen.entry(served_by(&get(&tg.url("/")).await)).or_default() += 1;
    }
    assert_eq!(seen.get("a"), Some(&10), "{seen:?}");
    assert_eq!(seen.get("b"), Some(&10), "{seen:?}");

    put_external(&tg, &addr, "session", backends).await;
    assert!(sessions_stick(&tg, 5).await, "sessions stick");
}

/// A fake node_exporter on 127.0.0.1: scrape `n` answers the page `page(n)`.
async fn fake_exporter(page: fn(u64) -> String) -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let mut n = 0;
        while let Ok((mut conn, _)) = listener.accept().await {
            let mut head = Vec::new();
            let mut buf = [0u8; 2048];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
                match conn.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(k) => head.extend_from_slice(&buf[..k]),
                }
            }
            n += 1;
            let body = page(n);
            let answer = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = conn.write_all(answer.as_bytes()).await;
        }
    });
    addr
}

/// `least_cpu` reads node_exporter pages with the one exposition parser: a
/// `}` inside a label value is part of the value. Host A is 10 % busy, but
/// its idle counter carries a label value with a `}`; the distributor's old
/// parser cut the label set there, dropped the line and saw A 100 % busy,
/// sending everything to B (90 % busy).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_cpu_reads_a_brace_inside_a_label_value() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let a = Backend::start("a", &[]);
    let b = Backend::start("b", &[]);
    let idle_a = fake_exporter(|n| {
        format!(
            "# TYPE node_cpu_seconds_total counter\n\
             node_cpu_seconds_total{{cpu=\"0\",mode=\"idle\",note=\"a}}b, c\"}} {}\n\
             node_cpu_seconds_total{{cpu=\"0\",mode=\"user\"}} {}\n",
            9 * n,
            n
        )
    })
    .await;
    let busy_b = fake_exporter(|n| {
        format!(
            "node_cpu_seconds_total{{cpu=\"0\",mode=\"idle\"}} {}\nnode_cpu_seconds_total{{cpu=\"0\",mode=\"user\"}} {}\n",
            n,
            9 * n
        )
    })
    .await;
    let args = [
        format!("--metrics-url={}=http://{idle_a}/metrics", a.addr),
        format!("--metrics-url={}=http://{busy_b}/metrics", b.addr),
        "--metrics-interval-ms=100".to_string(),
    ];
    let (_distributor, addr) = reference_distributor_with(&[&a, &b], &args);
    let backends = json!([{"id": "a", "addr": a.addr.to_string()}, {"id": "b", "addr": b.addr.to_string()}]);
    put_external(&tg, &addr, "least_cpu", backends).await;
    // Until two scrapes of each page, least_cpu takes turns; then every
    // answer is the idle host's.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut last = Vec::new();
    loop {
        last.push(served_by(&get(&tg.url("/")).await));
        if last.len() > 10 {
            last.remove(0);
        }
        if last.len() == 10 && last.iter().all(|s| s == "a") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "least_cpu never settled on the idle host: {last:?}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}
