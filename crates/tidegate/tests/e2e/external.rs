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
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tidegate"));
    cmd.args(["distributor", "--listen", "127.0.0.1:0"])
        .args(["--backend", &a.addr.to_string(), "--backend", &b.addr.to_string()])
        .env("TIDEGATE_LOG", "warn")
        .stdout(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut line).unwrap();
    let addr = line.trim().strip_prefix("distributor listening on ").expect(&line).to_string();
    let backends = json!([{"id": "a", "addr": a.addr.to_string()}, {"id": "b", "addr": b.addr.to_string()}]);

    put_external(&tg, &addr, "round_robin", backends.clone()).await;
    let mut seen = BTreeMap::<String, usize>::new();
    for _ in 0..20 {
        *seen.entry(served_by(&get(&tg.url("/")).await)).or_default() += 1;
    }
    assert_eq!(seen.get("a"), Some(&10), "{seen:?}");
    assert_eq!(seen.get("b"), Some(&10), "{seen:?}");

    put_external(&tg, &addr, "session", backends).await;
    for sid in ["alice", "bob", "carol"] {
        let cookie = format!("sid={sid}");
        let first = served_by(&send("GET", &tg.url("/"), None, vec![], &[("cookie", &cookie)]).await);
        for _ in 0..5 {
            let r = send("GET", &tg.url("/"), None, vec![], &[("cookie", &cookie)]).await;
            assert_eq!(served_by(&r), first, "session {sid} sticks");
        }
    }
    let _ = child.kill();
    let _ = child.wait();
}
