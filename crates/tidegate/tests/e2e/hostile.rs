//! Hostile clients: silent and slow connections, oversized heads,
//! smuggling attempts, path and host confusion, and headers a client must
//! not be able to pass to a backend. Every test keeps normal traffic
//! flowing next to the attack.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::support::*;

/// Starts Tidegate with short client timeouts.
fn strict(dir: &std::path::Path, extra: &[&str]) -> Tidegate {
    let mut args = extra.to_vec();
    for (flag, value) in [("--first-request-timeout-s", "1"), ("--header-timeout-s", "2"), ("--body-timeout-s", "1")] {
        if !extra.contains(&flag) {
            args.extend([flag, value]);
        }
    }
    Tidegate::start_with(dir, &args)
}

/// Whether the proxy closed `s` (EOF or reset) within `within`, reading
/// whatever it sent first.
fn closed_by_peer(s: &mut TcpStream, within: Duration) -> bool {
    s.set_read_timeout(Some(within)).expect("set a read timeout");
    let mut buf = [0u8; 1024];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return false
            }
            Err(_) => return true,
        }
    }
}

/// The backend's echo of a request sent raw.
fn echoed(reply: &str) -> Value {
    let body = reply.split("\r\n\r\n").nth(1).unwrap_or_else(|| panic!("no body in {reply:?}"));
    serde_json::from_str(body).unwrap_or_else(|_| panic!("not an echo: {reply:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_slow_and_half_open_connections_are_closed_while_traffic_flows() {
    let dir = tempfile::tempdir().unwrap();
    let tg = strict(dir.path(), &[]);
    let b = Backend::start("calm", &[]);
    route_to(&tg, "web", &[&b], "round_robin").await;
    let mut silent: Vec<TcpStream> = (0..20).map(|_| TcpStream::connect(tg.proxy).unwrap()).collect();
    let mut half_preface = TcpStream::connect(tg.proxy).unwrap();
    half_preface.write_all(b"PRI * HTTP/2.0\r\n").unwrap();
    let mut full_preface = TcpStream::connect(tg.proxy).unwrap();
    full_preface.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").unwrap();
    let mut slow_head = TcpStream::connect(tg.proxy).unwrap();
    slow_head.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n").unwrap();
    let started = Instant::now();
    for _ in 0..10 {
        assert_eq!(get(&tg.url("/")).await.status, 200);
    }
    let limit = Duration::from_secs(4);
    for s in silent.iter_mut().chain([&mut half_preface, &mut full_preface, &mut slow_head]) {
        assert!(closed_by_peer(s, limit.saturating_sub(started.elapsed())), "still open after {:?}", started.elapsed());
    }
    // A kept-alive connection that goes quiet is closed too.
    let mut idle = TcpStream::connect(tg.proxy).unwrap();
    idle.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n").unwrap();
    assert!(closed_by_peer(&mut idle, Duration::from_secs(5)), "idle keep-alive connection stayed open");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_body_gets_408_and_blames_no_backend() {
    let dir = tempfile::tempdir().unwrap();
    let tg = strict(dir.path(), &[]);
    let b = Backend::start("patient", &[]);
    route_to(&tg, "web", &[&b], "round_robin").await;
    for head in [
        "POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n0123456789",
        "POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\na\r\n0123456789\r\n",
    ] {
        let reply = raw_exchange(tg.proxy, head.as_bytes(), Duration::from_secs(5));
        assert!(reply.starts_with("HTTP/1.1 408"), "{head:?}: {reply:?}");
    }
    let (_, status) = tg.api("GET", "/v1/status", None).await;
    assert_eq!(status["services"]["web"]["backends"][0]["failures"], 0, "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eleven_hundred_held_connections_do_not_stop_new_requests() {
    let dir = tempfile::tempdir().unwrap();
    // Started with the common soft limit of 1,024 descriptors.
    let tg = Tidegate::start_wrapped(dir.path(), &["prlimit", "--nofile=1024:"], &[]);
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", tg.pid())).unwrap();
    let files =
        limits.lines().find(|l| l.starts_with("Max open files")).unwrap().split_whitespace().collect::<Vec<_>>();
    assert_eq!(files[3], files[4], "the soft limit was raised to the hard one: {files:?}");
    let b = Backend::start("busy", &[]);
    route_to(&tg, "web", &[&b], "round_robin").await;
    // More than 1,024 descriptors: accepted, and they simply wait.
    let held: Vec<TcpStream> = (0..1_100).map(|_| TcpStream::connect(tg.proxy).expect("connect")).collect();
    for _ in 0..20 {
        assert_eq!(get(&tg.url("/")).await.status, 200);
    }
    let (s, _) = tg.api("GET", "/v1/status", None).await;
    assert_eq!(s, 200, "the admin API stays up");
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_connections_beyond_the_cap_wait_and_new_requests_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let tg = strict(dir.path(), &["--max-connections", "50", "--first-request-timeout-s", "2"]);
    let b = Backend::start("busy", &[]);
    route_to(&tg, "web", &[&b], "round_robin").await;
    // 300 connections that never send a byte: the first 50 hold every
    // slot until their first-request timeout, the rest wait in the backlog.
    let held: Vec<TcpStream> = (0..300).filter_map(|_| TcpStream::connect(tg.proxy).ok()).collect();
    assert!(held.len() > 250, "connect failed early: {}", held.len());
    let r = tokio::time::timeout(Duration::from_secs(20), get(&tg.url("/"))).await;
    assert_eq!(r.expect("served within 20 s").status, 200);
    // The admin API is a listener of its own and stays up throughout.
    let (s, _) = tg.api("GET", "/v1/status", None).await;
    assert_eq!(s, 200);
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smuggling_and_oversized_heads_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let b = Backend::start("target", &[]);
    route_to(&tg, "web", &[&b], "round_robin").await;
    let wait = Duration::from_secs(5);
    let cl_te = "POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nhost: x\r\n\r\n";
    let reply = raw_exchange(tg.proxy, cl_te.as_bytes(), wait);
    // Refused and closed (RFC 9112 section 6.1 allows framing by the
    // encoding alone; refusing is the safe reading): the smuggled request
    // is never read.
    assert_eq!(reply.matches("HTTP/1.1 ").count(), 1, "CL+TE smuggled a second request: {reply:?}");
    assert!(reply.starts_with("HTTP/1.1 400"), "{reply:?}");
    assert!(reply.contains("connection: close"), "{reply:?}");
    let dup_cl = "POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\ncontent-length: 40\r\n\r\nabcd";
    let reply = raw_exchange(tg.proxy, dup_cl.as_bytes(), wait);
    assert!(reply.starts_with("HTTP/1.1 400"), "duplicate CL: {reply:?}");
    let big = format!("GET / HTTP/1.1\r\nhost: x\r\nx-big: {}\r\n\r\n", "a".repeat(100 * 1024));
    let reply = raw_exchange(tg.proxy, big.as_bytes(), wait);
    assert!(reply.starts_with("HTTP/1.1 431"), "100 KiB of headers: {:?}", &reply[..reply.len().min(80)]);
    let many: String = (0..10_000).map(|i| format!("x-h{i}: 1\r\n")).collect();
    let reply = raw_exchange(tg.proxy, format!("GET / HTTP/1.1\r\nhost: x\r\n{many}\r\n").as_bytes(), wait);
    assert!(reply.starts_with("HTTP/1.1 431"), "10,000 headers: {:?}", &reply[..reply.len().min(80)]);
    let (_, stats) = tg.api("GET", "/v1/status", None).await;
    // None of them reached the backend.
    assert_eq!(stats["services"]["web"]["backends"][0]["requests"], 0, "{stats}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backend_receives_exactly_the_path_and_host_that_were_routed() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let public = Backend::start("public", &[]);
    let internal = Backend::start("internal", &[]);
    let other = Backend::start("b-host", &[]);
    for (name, b) in [("public", &public), ("internal", &internal), ("other", &other)] {
        let spec = json!({ "backends": [{ "id": "b0", "addr": b.addr.to_string() }] });
        assert_eq!(tg.api("PUT", &format!("/v1/services/{name}"), Some(spec)).await.0, 200);
    }
    for (name, m) in [
        ("public", json!({ "path_prefix": "/public" })),
        ("internal", json!({ "path_prefix": "/internal" })),
        ("other", json!({ "host": "b.example", "path_prefix": "/" })),
    ] {
        let route = json!({ "match": m, "service": name });
        assert_eq!(tg.api("PUT", &format!("/v1/routes/{name}"), Some(route)).await.0, 200);
    }
    let wait = Duration::from_secs(5);
    let ask = |target: &str, host: &str| {
        raw_exchange(
            tg.proxy,
            format!("GET {target} HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n").as_bytes(),
            wait,
        )
    };
    for target in [
        "/public/../internal/echo",
        "/public/%2e%2e/internal/echo",
        "/public/%2E%2E//internal/./echo",
        "//internal///echo",
    ] {
        let reply = ask(target, "a.example");
        assert!(reply.contains("x-backend: internal"), "{target}: {reply:?}");
        assert_eq!(echoed(&reply)["path"], "/internal/echo", "{target}");
    }
    for target in ["/public/..;/internal/echo", "/public/%2e%2e%2finternal/echo", "/../internal/echo"] {
        let reply = ask(target, "a.example");
        assert!(reply.starts_with("HTTP/1.1 400"), "{target}: {reply:?}");
    }
    // Absolute-form wins over Host, and becomes the Host the backend sees.
    let reply = ask("http://b.example/x/echo", "a.example");
    assert!(reply.contains("x-backend: b-host"), "{reply:?}");
    assert_eq!(echoed(&reply)["headers"]["host"], "b.example");
    // Two Host headers, or none in HTTP/1.1: refused.
    let reply = raw_exchange(tg.proxy, b"GET /public/echo HTTP/1.1\r\nhost: a\r\nhost: b.example\r\n\r\n", wait);
    assert!(reply.starts_with("HTTP/1.1 400"), "{reply:?}");
    let reply = raw_exchange(tg.proxy, b"GET /public/echo HTTP/1.1\r\nconnection: close\r\n\r\n", wait);
    assert!(reply.starts_with("HTTP/1.1 400"), "{reply:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_and_hop_by_hop_headers_never_reach_the_backend() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let b = Backend::start("echo", &[]);
    route_to(&tg, "web", &[&b], "round_robin").await;
    let head =
        "GET /echo HTTP/1.1\r\nhost: x\r\nproxy-authorization: Basic c2VjcmV0\r\nconnection: close, x-secret\r\n\
                x-secret: 1\r\nforwarded: for=203.0.113.9\r\nx-real-ip: 203.0.113.9\r\nx-forwarded-for: 203.0.113.9\r\n\
                upgrade: h2c\r\nx_forwarded_for: 6.6.6.6\r\nx_real_ip: 6.6.6.6\r\n\r\n";
    let reply = raw_exchange(tg.proxy, head.as_bytes(), Duration::from_secs(5));
    let h = &echoed(&reply)["headers"];
    for name in ["proxy-authorization", "x-secret", "forwarded", "x-real-ip", "upgrade", "x_forwarded_for", "x_real_ip"]
    {
        assert!(h.get(name).is_none(), "{name} reached the backend: {h}");
    }
    // h2c is never offered to a backend, not even in a list.
    let listed = "GET /echo HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: websocket, h2c\r\n\
                  http2-settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n";
    let reply = raw_exchange(tg.proxy, listed.as_bytes(), Duration::from_secs(5));
    let h = &echoed(&reply)["headers"];
    assert!(h.get("upgrade").is_none() && h.get("connection").is_none(), "{h}");
    assert_eq!(h["x-forwarded-for"], "127.0.0.1", "an untrusted client's X-Forwarded-For is replaced");

    // Behind a trusted proxy the chain is kept.
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start_with(dir.path(), &["--trusted-proxies", "127.0.0.0/8"]);
    route_to(&tg, "web", &[&b], "round_robin").await;
    let reply = raw_exchange(tg.proxy, head.as_bytes(), Duration::from_secs(5));
    let h = &echoed(&reply)["headers"];
    assert_eq!(h["x-forwarded-for"], "203.0.113.9, 127.0.0.1");
    assert_eq!(h["x-real-ip"], "203.0.113.9");
    assert!(h.get("proxy-authorization").is_none());
}

/// Opens a tunnel through the proxy (`/upgrade` on the emulator echoes);
/// returns the socket, or the status line when the upgrade was refused.
fn open_tunnel(proxy: std::net::SocketAddr) -> Result<TcpStream, String> {
    let mut s = TcpStream::connect(proxy).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("set a read timeout");
    s.write_all(b"GET /upgrade HTTP/1.1\r\nHost: x\r\nConnection: upgrade\r\nUpgrade: echo\r\n\r\n").expect("write");
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        s.read_exact(&mut byte).map_err(|e| format!("reading the head: {e}"))?;
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    if head.starts_with("HTTP/1.1 101") {
        Ok(s)
    } else {
        Err(head.lines().next().unwrap_or("").to_string())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnels_hold_their_backend_slot_and_close_when_idle() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start_with(dir.path(), &["--tunnel-idle-timeout-s", "1"]);
    let b = Backend::start("ws", &[]);
    // No queue: a request for a full backend is refused at once.
    let spec =
        json!({ "queue": { "max": 0 }, "backends": [{ "id": "b0", "addr": b.addr.to_string(), "max_conns": 1 }] });
    assert_eq!(tg.api("PUT", "/v1/services/web", Some(spec)).await.0, 200);
    let route = json!({ "match": { "path_prefix": "/" }, "service": "web" });
    assert_eq!(tg.api("PUT", "/v1/routes/web", Some(route)).await.0, 200);
    let proxy = tg.proxy;
    tokio::task::spawn_blocking(move || {
        let mut first = open_tunnel(proxy).expect("the first tunnel opens");
        first.write_all(b"ping").unwrap();
        let mut buf = [0u8; 4];
        first.read_exact(&mut buf).unwrap();
        // The tunnel holds the backend's only slot: a second one is refused.
        let second = open_tunnel(proxy);
        assert!(second.as_ref().is_err_and(|s| s.contains("503")), "{:?}", second.map(|_| ()));
        // Quiet for longer than the idle timeout: closed, and the slot is free.
        assert!(closed_by_peer(&mut first, Duration::from_secs(8)), "idle tunnel stayed open");
        // The client sees the close before the proxy has surely given the
        // slot back: a tunnel opens again within a few tries.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while let Err(e) = open_tunnel(proxy) {
            assert!(std::time::Instant::now() < deadline, "the slot was not given back: {e}");
            std::thread::sleep(Duration::from_millis(50));
        }
    })
    .await
    .unwrap();
}

/// With the default settings (round robin learning each backend's
/// concurrency limit, which starts at 1), requests already answered take
/// no place under the learned limit: open WebSocket tunnels, and a
/// response whose body is still streaming, do not queue the requests next
/// to them. Either engine.
#[test]
fn answered_streams_and_tunnels_do_not_hold_places_under_the_learned_limit() {
    for engine in ["native", "hyper"] {
        let dir = tempfile::tempdir().unwrap();
        let tg = Tidegate::start_with(dir.path(), &["--http1", engine]);
        let b = Backend::start("b", &[]);
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(route_to(&tg, "web", &[&b], "round_robin"));
        let tunnels: Vec<TcpStream> = (0..3).map(|_| open_tunnel(tg.proxy).expect("a tunnel opens")).collect();
        rt.block_on(async {
            for _ in 0..10 {
                let r = get(&tg.url("/x")).await;
                assert_eq!(r.status, 200, "{engine}: {}", r.text());
            }
            // The last answer's slot is given back just after its bytes
            // are written, so the count may lag the client for a moment.
            in_flight_reaches(&tg, 3, &format!("{engine}: the three tunnels alone are in flight")).await;
        });
        drop(tunnels);

        // A body dripping for 3 s (one byte every 100 ms), then requests
        // beside it; the queue would refuse them after its 1 s timeout.
        let slow = Backend::start("slow", &["--faults"]);
        rt.block_on(route_to(&tg, "web", &[&slow], "round_robin"));
        let mut stream = TcpStream::connect(tg.proxy).unwrap();
        stream.write_all(b"GET /_fault/drip HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut first = [0u8; 12];
        stream.read_exact(&mut first).unwrap();
        assert_eq!(&first, b"HTTP/1.1 200", "{engine}");
        rt.block_on(async {
            for _ in 0..5 {
                let r = get(&tg.url("/x")).await;
                assert_eq!(r.status, 200, "{engine}: beside a streaming body: {}", r.text());
            }
        });
        drop(stream);
    }
}

/// `SIGTERM`, with either HTTP/1 engine: no new connection is taken, a
/// request in flight gets its answer, an upgraded connection keeps working
/// while the proxy drains, and the process exits 0 once the drain timeout
/// is over (the tunnel held it that long), closing the tunnel.
#[test]
fn a_stopping_proxy_drains_requests_and_tunnels_then_exits() {
    for engine in ["native", "hyper"] {
        let dir = tempfile::tempdir().unwrap();
        let mut tg = Tidegate::start_with(dir.path(), &["--http1", engine, "--drain-timeout-s", "10"]);
        let b = Backend::start("b", &[]);
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(route_to(&tg, "web", &[&b], "round_robin"));
        let mut tunnel = open_tunnel(tg.proxy).expect("the tunnel opens");
        let echo = |t: &mut TcpStream| {
            t.write_all(b"ping").map_err(|e| e.to_string())?;
            let mut buf = [0u8; 4];
            t.read_exact(&mut buf).map_err(|e| e.to_string())?;
            Ok::<_, String>(buf)
        };
        assert_eq!(echo(&mut tunnel), Ok(*b"ping"), "{engine}");
        let url = tg.url("/?delay_ms=1000");
        let slow = std::thread::spawn(move || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async { try_send("GET", &url, None, Vec::new(), &[]).await.map(|r| r.status) })
        });
        // The tunnel and the slow request are both in flight.
        rt.block_on(in_flight_reaches(&tg, 2, "the slow request reaches the backend"));
        let stopped = Instant::now();
        tg.terminate();
        // The listeners close once the signal has gone through the admin
        // server and the control plane; the slow request is still in flight.
        let closed = Instant::now() + Duration::from_secs(8);
        while TcpStream::connect(tg.proxy).is_ok() {
            assert!(Instant::now() < closed, "{engine}: new connections still accepted 8 s after SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(echo(&mut tunnel), Ok(*b"ping"), "{engine}: the tunnel stopped working while draining");
        assert_eq!(slow.join().unwrap(), Ok(200), "{engine}: the request in flight");
        assert_eq!(tg.wait_exit(Duration::from_millis(500)), None, "{engine}: exited with a tunnel open");
        let status = tg.wait_exit(Duration::from_secs(20)).expect("exits after the drain timeout");
        assert!(status.success(), "{engine}: {status:?}");
        // The drain's 10 s, less the signal's way to the drain.
        assert!(stopped.elapsed() >= Duration::from_secs(9), "{engine}: exited after {:?}", stopped.elapsed());
        assert!(closed_by_peer(&mut tunnel, Duration::from_secs(2)), "{engine}: the tunnel outlived the process");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_messages_are_refused_and_pipelined_requests_answered_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let b = Backend::start("strict", &[]);
    route_to(&tg, "web", &[&b], "round_robin").await;
    let proxy = tg.proxy;
    tokio::task::spawn_blocking(move || {
        let wait = Duration::from_secs(5);
        // Obsolete line folding: refused, the connection closed.
        let reply = raw_exchange(proxy, b"GET /echo HTTP/1.1\r\nhost: x\r\nx-a: 1\r\n folded\r\n\r\n", wait);
        assert!(reply.starts_with("HTTP/1.1 400") && reply.contains("connection: close"), "{reply:?}");
        // Bare LF in the head: read, and rewritten with CRLF for the backend.
        let reply = raw_exchange(proxy, b"GET /echo HTTP/1.1\nhost: x\nconnection: close\n\n", wait);
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply:?}");
        // Chunk framing: a bare LF, a size over 16 hex digits, or a trailer
        // line that is not a field line (found by the fuzz campaign: it
        // was read and dropped, where hyper refuses it) is a 400.
        for body in [
            "5\nhello\r\n0\r\n\r\n",
            "10000000000000000\r\nx\r\n0\r\n\r\n",
            "5\r\nhelloXX0\r\n\r\n",
            "0\r\na\r\n0\r\n\r\n",
            "0\r\nx-t: 1\r\n folded\r\n\r\n",
            "0\r\nGET /smuggled HTTP/1.1\r\n\r\n",
        ] {
            let req = format!("POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n{body}");
            let reply = raw_exchange(proxy, req.as_bytes(), wait);
            assert!(reply.starts_with("HTTP/1.1 400"), "{body:?}: {reply:?}");
            assert_eq!(reply.matches("HTTP/1.1 ").count(), 1, "{body:?}: {reply:?}");
        }
        // A transfer coding other than chunked: 501.
        let reply =
            raw_exchange(proxy, b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip\r\n\r\nabc", wait);
        assert!(reply.starts_with("HTTP/1.1 501"), "{reply:?}");
        // CONNECT opens no tunnel: 405.
        let reply = raw_exchange(proxy, b"CONNECT /x HTTP/1.1\r\nhost: x\r\n\r\n", wait);
        assert!(reply.starts_with("HTTP/1.1 405"), "{reply:?}");
        // HTTP/1.1 needs a valid Host even when the target names the host.
        for head in ["GET http://a.example/echo HTTP/1.1\r\n\r\n", "GET http://a.example/echo HTTP/1.1\r\nhost: x@y\r\n\r\n"] {
            let reply = raw_exchange(proxy, head.as_bytes(), wait);
            assert!(reply.starts_with("HTTP/1.1 400"), "{head:?}: {reply:?}");
        }
        // An HTTP/1.0 client that keeps its connection is told so, also by
        // the proxy's own answers, and the connection serves on.
        let two = b"GET /health-of-nothing HTTP/1.0\r\nconnection: keep-alive\r\nhost: none.example\r\n\r\n\
                    GET /echo HTTP/1.0\r\nhost: x\r\n\r\n";
        let reply = raw_exchange(proxy, two, wait);
        let first = reply.split("\r\n\r\n").next().unwrap_or("");
        assert!(first.contains("connection: keep-alive"), "{reply:?}");
        assert_eq!(reply.matches("HTTP/1.1 ").count(), 2, "{reply:?}");
        // Pipelined requests are answered one after the other, in order.
        let two = b"GET /first/echo HTTP/1.1\r\nhost: x\r\n\r\nGET /second/echo HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n";
        let reply = raw_exchange(proxy, two, wait);
        assert_eq!(reply.matches("HTTP/1.1 200").count(), 2, "{reply:?}");
        let (first, second) = (reply.find("/first/echo"), reply.find("/second/echo"));
        assert!(first.is_some() && first < second, "{reply:?}");
    })
    .await
    .unwrap();
    let (_, stats) = tg.api("GET", "/v1/status", None).await;
    assert_eq!(
        stats["services"]["web"]["backends"][0]["failures"], 0,
        "a client's bad framing blames no backend: {stats}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_client_that_cancels_most_of_its_requests_is_told_to_go_away() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let b = Backend::start("slow", &["--service-time", "fixed:2000ms"]);
    route_to(&tg, "web", &[&b], "round_robin").await;
    let tcp = tokio::net::TcpStream::connect(tg.proxy).await.expect("connect");
    let (h2, conn) =
        hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), hyper_util::rt::TokioIo::new(tcp))
            .await
            .expect("h2 handshake");
    let conn = tokio::spawn(conn);
    // Rapid reset, slowed down: batches of streams (under the 100-stream
    // limit), each cancelled (RST_STREAM) 100 ms after it was sent.
    let url = format!("http://{}/", tg.proxy);
    let mut cancelled = 0;
    for _ in 0..6 {
        let mut batch = Vec::new();
        for _ in 0..50 {
            let (mut h2, url) = (h2.clone(), url.clone());
            batch.push(tokio::spawn(async move {
                let req = http::Request::get(url).body(http_body_util::Empty::<bytes::Bytes>::new()).expect("request");
                tokio::time::timeout(Duration::from_millis(100), h2.send_request(req)).await.is_err()
            }));
        }
        for t in batch {
            cancelled += usize::from(t.await.unwrap_or(false));
        }
    }
    assert!(cancelled > 100, "only {cancelled} requests were cancelled");
    let ended = tokio::time::timeout(Duration::from_secs(5), conn).await;
    assert!(ended.is_ok(), "the connection is still open after {cancelled} cancelled requests");
    // Other clients are served.
    assert_eq!(get(&tg.url("/")).await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_sent_before_the_body_was_read_closes_without_a_reset() {
    let dir = tempfile::tempdir().unwrap();
    // No route: the proxy answers 404 without reading the body, and closes.
    let tg = Tidegate::start(dir.path());
    let proxy = tg.proxy;
    tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(proxy).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(5))).expect("set a read timeout");
        s.write_all(b"POST /nowhere HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000\r\n\r\n").expect("write the head");
        s.write_all(&[b'x'; 1000]).expect("write part of the body");
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        while !String::from_utf8_lossy(&got).contains("no route") {
            let n = s.read(&mut buf).expect("read the answer");
            assert!(n > 0, "closed before the answer: {:?}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&buf[..n]);
        }
        assert!(got.starts_with(b"HTTP/1.1 404"), "{:?}", String::from_utf8_lossy(&got));
        // The client still sends its body; the proxy reads it away for a
        // while instead of resetting the connection (a reset can make the
        // client's stack drop an answer it has not read yet).
        std::thread::sleep(Duration::from_millis(200));
        for i in 0..20 {
            s.write_all(&[b'x'; 10_000]).unwrap_or_else(|e| panic!("write {i} after the answer: {e}"));
            std::thread::sleep(Duration::from_millis(10));
        }
        s.shutdown(std::net::Shutdown::Write).expect("shutdown");
        assert_eq!(s.read(&mut buf).map_err(|e| e.kind()), Ok(0), "a clean close");
    })
    .await
    .unwrap();
}
