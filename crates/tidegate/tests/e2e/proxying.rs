//! The data plane: routing, balancing, failures, headers, upgrades, static
//! files, and traffic during configuration churn.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use serde_json::json;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_answers_as_soon_as_its_put_is_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let b = Backend::start("one", &[]);
    assert_eq!(get(&tg.url("/")).await.status, 404, "no route yet");
    route_to(&tg, "web", &[&b], "round_robin").await;
    // No sleep: an answer means live.
    let r = get(&tg.url("/hello")).await;
    assert_eq!(r.status, 200);
    assert_eq!(served_by(&r), "one");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_shares_evenly_and_deleted_backends_get_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let bs: Vec<Backend> = (0..3).map(|i| Backend::start(&format!("b{i}"), &[])).collect();
    route_to(&tg, "web", &bs.iter().collect::<Vec<_>>(), "round_robin").await;
    let mut counts: HashMap<String, usize> = HashMap::new();
    for _ in 0..300 {
        *counts.entry(served_by(&get(&tg.url("/")).await)).or_default() += 1;
    }
    for name in ["b0", "b1", "b2"] {
        let n = counts.get(name).copied().unwrap_or(0);
        assert!((95..=105).contains(&n), "{counts:?}");
    }
    let (s, _) = tg.api("DELETE", "/v1/services/web/backends/b1", None).await;
    assert_eq!(s, 200);
    for _ in 0..60 {
        assert_ne!(served_by(&get(&tg.url("/")).await), "b1");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_backend_costs_no_failed_get() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let live = [Backend::start("a", &[]), Backend::start("b", &[])];
    let dead = Backend::start("dead", &[]);
    route_to(&tg, "web", &[&live[0], &dead, &live[1]], "round_robin").await;
    let _dead = dead.kill();
    for _ in 0..90 {
        let r = get(&tg.url("/")).await;
        assert_eq!(r.status, 200);
        assert_ne!(served_by(&r), "dead");
    }
    // With every backend gone the proxy says so.
    drop(live);
    let r = get(&tg.url("/")).await;
    assert_eq!(r.status, 502);
    assert!(r.text().contains("could not connect"), "{}", r.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_errors_are_short_and_say_which() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let r = get(&tg.url("/")).await;
    assert_eq!((r.status, r.text().as_str()), (404, "404 no route matches this request\n"));

    let (s, _) = tg.api("PUT", "/v1/services/empty", Some(json!({}))).await;
    assert_eq!(s, 200);
    let (s, _) = tg.api("PUT", "/v1/routes/empty", Some(json!({"service": "empty"}))).await;
    assert_eq!(s, 200);
    let r = get(&tg.url("/")).await;
    assert_eq!(r.status, 503);

    let slow = Backend::start("slow", &[]);
    let spec = json!({"timeouts": {"response_ms": 200}, "backends": [{"id": "s", "addr": slow.addr.to_string()}]});
    let (s, _) = tg.api("PUT", "/v1/services/empty", Some(spec)).await;
    assert_eq!(s, 200);
    let r = get(&tg.url("/?delay_ms=3000")).await;
    assert_eq!(r.status, 504);
    assert!(r.text().contains("in time"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarding_headers_and_h2c() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let b = Backend::start("one", &[]);
    route_to(&tg, "web", &[&b], "least_conn").await;
    let r = send(
        "GET",
        &tg.url("/echo"),
        None,
        vec![],
        &[("x-forwarded-for", "10.1.1.1"), ("connection", "x-drop"), ("x-drop", "1")],
    )
    .await;
    let echo: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    let h = &echo["headers"];
    // The client is not a trusted proxy: its X-Forwarded-For is replaced.
    assert_eq!(h["x-forwarded-for"], "127.0.0.1");
    assert_eq!(h["x-forwarded-proto"], "http");
    assert_eq!(h["x-forwarded-host"], tg.proxy.to_string());
    assert!(h.get("x-drop").is_none(), "headers named in Connection are hop-by-hop: {h}");

    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(true)
        .build_http::<http_body_util::Empty<bytes::Bytes>>();
    let resp = client.get(tg.url("/h2").parse().unwrap()).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.version(), http::Version::HTTP_2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgraded_connections_pass_through() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let b = Backend::start("ws", &[]);
    route_to(&tg, "web", &[&b], "round_robin").await;
    let proxy = tg.proxy;
    tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(proxy).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
        s.write_all(b"GET /upgrade HTTP/1.1\r\nHost: x\r\nConnection: upgrade\r\nUpgrade: echo\r\n\r\n").unwrap();
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            s.read_exact(&mut byte).unwrap();
            head.push(byte[0]);
        }
        let head = String::from_utf8_lossy(&head);
        assert!(head.starts_with("HTTP/1.1 101"), "{head}");
        s.write_all(b"ping over the tunnel").unwrap();
        let mut buf = [0u8; 20];
        s.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"ping over the tunnel");
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn static_directories_are_served_by_the_proxy() {
    let dir = tempfile::tempdir().unwrap();
    let www = tempfile::tempdir().unwrap();
    std::fs::write(www.path().join("app.css"), "body{}").unwrap();
    std::fs::create_dir(www.path().join("sub")).unwrap();
    let tg = Tidegate::start(dir.path());
    let spec = json!({"match": {"path_prefix": "/static"}, "static": {"root": www.path()}});
    let (s, v) = tg.api("PUT", "/v1/routes/assets", Some(spec)).await;
    assert_eq!(s, 200, "{v}");
    let r = get(&tg.url("/static/app.css")).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.headers["content-type"], "text/css");
    assert_eq!(r.text(), "body{}");
    let r = send("GET", &tg.url("/static/app.css"), None, vec![], &[("range", "bytes=0-3")]).await;
    assert_eq!((r.status, r.text().as_str()), (206, "body"));
    // Normalized before routing: `/etc/passwd` is outside every route, and
    // a climb above the root is refused.
    assert_eq!(get(&tg.url("/static/%2e%2e/etc/passwd")).await.status, 404);
    assert_eq!(get(&tg.url("/static/%2e%2e/%2e%2e/etc/passwd")).await.status, 400);
    // A directory redirect names the normalized path, never a
    // protocol-relative `//host/` one.
    let r = get(&tg.url("//static//sub")).await;
    assert_eq!((r.status, r.headers["location"].to_str().unwrap()), (301, "/static/sub/"));

    // A root that holds the data directory is refused: the admin token and
    // the store never leave through the proxy.
    let parent = tempfile::tempdir().unwrap();
    let data = parent.path().join("data");
    std::fs::write(parent.path().join("public.txt"), "public").unwrap();
    std::fs::create_dir(&data).unwrap();
    // The token file, as a deployment without TIDEGATE_ADMIN_TOKEN has it.
    std::fs::write(data.join("admin-token"), TOKEN).unwrap();
    let tg = Tidegate::start(&data);
    std::fs::create_dir_all(data.join("instances")).unwrap();
    for root in [parent.path().to_path_buf(), data.clone(), data.join("instances")] {
        let spec = json!({"match": {"path_prefix": "/files"}, "static": {"root": root}});
        let (s, v) = tg.api("PUT", "/v1/routes/files", Some(spec)).await;
        assert_eq!((s, v["error"]["field"].as_str()), (400, Some("spec.static.root")), "{root:?}: {v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("data directory"), "{v}");
    }
    for private in ["/files/data/admin-token", "/files/data/config.sqlite", "/files/public.txt"] {
        assert_eq!(get(&tg.url(private)).await.status, 404, "{private}");
    }
    // And the filesystem root is refused as a root.
    let (s, v) = tg.api("PUT", "/v1/routes/all", Some(json!({"static": {"root": "/"}}))).await;
    assert_eq!(s, 400, "{v}");
}

/// The finding: `static.root` accepted a root that climbs back to
/// `/` (through `..`, `/proc/self/root` or a link), and an unauthenticated
/// client read system files through it. Such roots are refused when the
/// route is written, and a root replaced by such a link later serves
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn static_roots_that_lead_to_system_directories_are_refused_and_never_serve() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let files = tempfile::tempdir().unwrap();
    let www = files.path().join("www");
    std::fs::create_dir(&www).unwrap();
    std::fs::write(www.join("index.html"), "hello").unwrap();
    let to_root = files.path().join("to-root");
    std::os::unix::fs::symlink("/", &to_root).unwrap();
    let to_etc = files.path().join("to-etc");
    std::os::unix::fs::symlink("/etc", &to_etc).unwrap();
    let climbing = format!("{}/../../../../../../../..", www.display());
    let roots = [
        climbing.as_str(),
        "/proc/self/root",
        "/proc/1/root",
        "/etc",
        "/usr",
        to_root.to_str().unwrap(),
        to_etc.to_str().unwrap(),
    ];
    for root in roots {
        let spec = json!({"match": {"path_prefix": "/x"}, "static": {"root": root}});
        let (s, v) = tg.api("PUT", "/v1/routes/x", Some(spec)).await;
        assert_eq!(s, 400, "{root}: {v}");
        assert!(v.to_string().contains("static.root"), "{root}: {v}");
        let ops = json!({"ops": [{"op": "put_route", "name": "x", "spec": {"static": {"root": root}}}]});
        let (s, v) = tg.api("POST", "/v1/changes", Some(ops)).await;
        assert_eq!(s, 400, "{root}: {v}");
        for path in ["/x/etc/passwd", "/x/passwd"] {
            let r = get(&tg.url(path)).await;
            assert_ne!(r.status, 200, "{root}: {path} served: {}", r.text());
        }
    }
    let (_, config) = tg.api("GET", "/v1/config", None).await;
    assert_eq!(config["routes"], json!({}), "nothing was written");

    // A good root, later replaced by a link to `/`: checked again when
    // serving, it serves nothing.
    let spec = json!({"match": {"path_prefix": "/site"}, "static": {"root": www}});
    let (s, v) = tg.api("PUT", "/v1/routes/site", Some(spec)).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(get(&tg.url("/site/")).await.text(), "hello");
    std::fs::remove_dir_all(&www).unwrap();
    std::os::unix::fs::symlink("/", &www).unwrap();
    for path in ["/site/etc/passwd", "/site/etc/hostname", "/site/"] {
        let r = get(&tg.url(path)).await;
        assert_eq!(r.status, 404, "{path}: {}", r.text());
    }
}

/// The churn test: clients hammer the proxy while 1,000 changes add
/// and remove backends and change weights; not one request may fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traffic_sees_no_error_during_1000_config_changes() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Arc::new(Tidegate::start(dir.path()));
    let bs: Vec<Backend> = (0..3).map(|i| Backend::start(&format!("b{i}"), &[])).collect();
    route_to(&tg, "web", &[&bs[0], &bs[1]], "round_robin").await;
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut clients = Vec::new();
    for _ in 0..4 {
        let (tg, stop, ok, failed) = (tg.clone(), stop.clone(), ok.clone(), failed.clone());
        clients.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                match try_send("GET", &tg.url("/"), None, vec![], &[]).await {
                    Ok(r) if r.status == 200 => ok.fetch_add(1, Ordering::Relaxed),
                    other => {
                        eprintln!("failed request: {:?}", other.map(|r| (r.status, r.text())));
                        failed.fetch_add(1, Ordering::Relaxed)
                    }
                };
            }
        }));
    }
    let extra = bs[2].addr.to_string();
    for i in 0..1000 {
        let (path, body) = match i % 3 {
            0 => ("/v1/services/web/backends/b2", Some(json!({"addr": extra}))),
            1 => ("/v1/services/web/backends/b0", Some(json!({"addr": bs[0].addr.to_string(), "weight": 1 + i % 7}))),
            _ => ("/v1/services/web/backends/b2", None),
        };
        let method = if body.is_some() { "PUT" } else { "DELETE" };
        let (s, v) = tg.api(method, path, body).await;
        assert_eq!(s, 200, "change {i}: {v}");
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
    }
    let (ok, failed) = (ok.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    assert_eq!(failed, 0, "{failed} failed requests out of {}", ok + failed);
    assert!(ok > 100, "the clients ran ({ok} requests)");
    let (_, config) = tg.api("GET", "/v1/config", None).await;
    assert_eq!(config["revision"], 1002);
}
