//! Request hygiene (issue 35): what a request names is exactly what is
//! routed, forwarded and logged, on both HTTP/1.1 engines (`--http1
//! native`, the default, and `--http1 hyper`) and over HTTP/2: fragments
//! and raw backslashes in the target, `Host` ports, a trailing dot on the
//! host, `X-Request-Id`, characters that would fool a reader of the access
//! log, and the cause a framing refusal gives.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::*;

const ENGINES: [&str; 2] = ["native", "hyper"];

/// A proxy with four services: `/public` and `/internal` (by path),
/// `app.example` (by host), `/h2` (a backend spoken to over HTTP/2).
struct Site {
    tg: Tidegate,
    _backends: Vec<Backend>,
}

async fn site(data_dir: &Path, engine: &str, extra: &[&str]) -> Site {
    let mut args = vec!["--http1", engine];
    args.extend_from_slice(extra);
    let tg = Tidegate::start_with(data_dir, &args);
    let mut backends = Vec::new();
    for (name, m, upstream) in [
        ("public", json!({ "path_prefix": "/public" }), json!({})),
        ("internal", json!({ "path_prefix": "/internal" }), json!({})),
        ("app", json!({ "host": "app.example", "path_prefix": "/" }), json!({})),
        ("h2", json!({ "path_prefix": "/h2" }), json!({ "protocol": "http2" })),
    ] {
        let b = Backend::start(name, &[]);
        let spec = json!({ "backends": [{ "id": "b0", "addr": b.addr.to_string() }], "upstream": upstream });
        let (s, v) = tg.api("PUT", &format!("/v1/services/{name}"), Some(spec)).await;
        assert_eq!(s, 200, "{v}");
        let (s, v) = tg.api("PUT", &format!("/v1/routes/{name}"), Some(json!({ "match": m, "service": name }))).await;
        assert_eq!(s, 200, "{v}");
        backends.push(b);
    }
    Site { tg, _backends: backends }
}

/// One HTTP/1.1 request, sent raw (`head` without its final empty line),
/// on a connection of its own.
fn ask(proxy: SocketAddr, head: &str) -> String {
    raw_exchange(proxy, format!("{head}\r\nconnection: close\r\n\r\n").as_bytes(), Duration::from_secs(5))
}

/// The backend's echo in a raw reply.
fn echo_of(reply: &str) -> Value {
    let body = reply.split("\r\n\r\n").nth(1).unwrap_or_else(|| panic!("no body in {reply:?}"));
    serde_json::from_str(body).unwrap_or_else(|_| panic!("not an echo: {reply:?}"))
}

/// The access log's lines, once it has at least `n`.
async fn log_lines(path: &Path, n: usize) -> Vec<String> {
    wait_for(&format!("{} has {n} lines", path.display()), Duration::from_secs(10), async || {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let lines: Vec<String> = text.lines().map(str::to_string).collect();
        (lines.len() >= n).then_some(lines)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fragment_or_a_backslash_in_the_target_never_reaches_another_route() {
    for engine in ENGINES {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let s = site(dir.path(), engine, &[]).await;
        let proxy = s.tg.proxy;
        // A fragment is not part of a request target (RFC 9112, section
        // 3.2). The native engine refuses it; hyper's parser drops it
        // before the proxy sees the target, so the path routed and the
        // path forwarded are still the same one.
        for (target, before) in [
            ("/public/echo#/../../internal/echo", "/public/echo"),
            ("/public/echo?x#/../../internal", "/public/echo?x"),
        ] {
            let reply = ask(proxy, &format!("GET {target} HTTP/1.1\r\nhost: a.example"));
            assert!(!reply.contains("x-backend: internal"), "{engine} {target}: {reply:?}");
            if engine == "native" {
                assert!(reply.starts_with("HTTP/1.1 400"), "{engine} {target}: {reply:?}");
            } else {
                assert!(reply.contains("x-backend: public"), "{engine} {target}: {reply:?}");
                assert_eq!(echo_of(&reply)["path"], before, "{engine} {target}");
            }
        }
        // A raw `\` is refused as `%5C` is: some backends read it as `/`.
        for target in ["/public\\..\\internal/echo", "/public/a\\b/echo", "/public/%5C/echo"] {
            let reply = ask(proxy, &format!("GET {target} HTTP/1.1\r\nhost: a.example"));
            assert!(reply.starts_with("HTTP/1.1 400"), "{engine} {target}: {reply:?}");
        }
        let (status, _, body) = h2(proxy, &format!("http://{proxy}/public\\..\\internal/echo"), &[]).await;
        assert_eq!(status, 400, "{engine} over HTTP/2: {body:?}");
        // What is fine still passes.
        let reply = ask(proxy, "GET /public/a/echo?q=%5C HTTP/1.1\r\nhost: a.example");
        assert!(reply.contains("x-backend: public"), "{engine}: {reply:?}");
        assert_eq!(echo_of(&reply)["path"], "/public/a/echo?q=%5C", "{engine}");
        let (_, stats) = s.tg.api("GET", "/v1/status", None).await;
        assert_eq!(stats["services"]["internal"]["backends"][0]["requests"], 0, "{engine}: {stats}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_port_must_be_digits_from_1_to_65535() {
    for engine in ENGINES {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let s = site(dir.path(), engine, &[]).await;
        let proxy = s.tg.proxy;
        for host in
            ["app.example:abc", "app.example:99999", "app.example:65536", "app.example:0", "app.example:", ":", ":80"]
        {
            let reply = ask(proxy, &format!("GET /echo HTTP/1.1\r\nhost: {host}"));
            assert!(reply.starts_with("HTTP/1.1 400"), "{engine} Host {host:?}: {reply:?}");
            // An absolute-form target's authority is checked the same way.
            let reply = ask(proxy, &format!("GET http://{host}/echo HTTP/1.1\r\nhost: app.example"));
            assert!(reply.starts_with("HTTP/1.1 400"), "{engine} target authority {host:?}: {reply:?}");
        }
        for authority in ["app.example:abc", "app.example:99999", "app.example:0"] {
            let (status, _, body) = h2(proxy, &format!("http://{authority}/echo"), &[]).await;
            assert_eq!(status, 400, "{engine} :authority {authority:?}: {body:?}");
        }
        for host in ["app.example", "app.example:8080", "app.example:65535", "APP.example:1"] {
            let reply = ask(proxy, &format!("GET /echo HTTP/1.1\r\nhost: {host}"));
            assert!(reply.contains("x-backend: app"), "{engine} Host {host:?}: {reply:?}");
        }
        let (status, headers, _) = h2(proxy, "http://app.example:8080/echo", &[]).await;
        assert_eq!((status, headers.get("x-backend").map(|v| v.as_bytes())), (200, Some(&b"app"[..])), "{engine}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_with_a_trailing_dot_is_routed_as_the_host() {
    for engine in ENGINES {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let s = site(dir.path(), engine, &[]).await;
        let proxy = s.tg.proxy;
        for host in ["app.example.", "App.Example.:8080"] {
            let reply = ask(proxy, &format!("GET /echo HTTP/1.1\r\nhost: {host}"));
            assert!(reply.contains("x-backend: app"), "{engine} Host {host:?}: {reply:?}");
            // The backend gets the host the client named.
            assert_eq!(echo_of(&reply)["headers"]["host"], host, "{engine}");
        }
        let reply = ask(proxy, "GET http://app.example./echo HTTP/1.1\r\nhost: x");
        assert!(reply.contains("x-backend: app"), "{engine} absolute form: {reply:?}");
        let (status, headers, _) = h2(proxy, "http://app.example./echo", &[]).await;
        assert_eq!((status, headers.get("x-backend").map(|v| v.as_bytes())), (200, Some(&b"app"[..])), "{engine}");
        // One dot only: `app.example..` is not a name of that host.
        let reply = ask(proxy, "GET /echo HTTP/1.1\r\nhost: app.example..");
        assert!(!reply.contains("x-backend: app"), "{engine}: {reply:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trailing_dot_picks_the_same_certificate_and_route_over_tls() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let s = site(dir.path(), "native", &["--listen-tls", "127.0.0.1:0"]).await;
    let ca = crate::tls::Ca::new();
    let (app, fallback) = (ca.leaf(&["app.example"]), ca.leaf(&["fallback.example"]));
    for (name, leaf, default) in [("app", &app, false), ("fallback", &fallback, true)] {
        let spec = json!({ "cert_pem": leaf.cert_pem, "key_pem": leaf.key_pem, "default": default });
        let (st, v) = s.tg.api("PUT", &format!("/v1/certificates/{name}"), Some(spec)).await;
        assert_eq!(st, 200, "{v}");
    }
    let tls = s.tg.proxy_tls.expect("a TLS listener");
    let mut conn = crate::tls::connect(&ca, tls, Some("app.example."), &[b"http/1.1"]).await.expect("a handshake");
    assert_eq!(crate::tls::served(&conn), app.der, "app.example's certificate");
    let reply = crate::tls::exchange(&mut conn, "/echo", "app.example.").await;
    assert!(reply.contains("x-backend: app"), "{reply:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backend_and_the_access_log_see_one_request_id() {
    let long = "x".repeat(129);
    let max = "y".repeat(128);
    // What the client sends, and whether it is kept.
    let cases: Vec<(Vec<&[u8]>, bool)> = vec![
        (vec![b"req-7"], true),
        (vec![max.as_bytes()], true),
        (vec![b"0f8fad5b-d9cb-469f-a165-70867728950e:span/1+x="], true),
        (vec![b"first", b"second"], false),
        (vec![long.as_bytes()], false),
        (vec![b"a<script>"], false),
        (vec![b"a\"b c"], false),
        (vec!["\u{202e}txt.exe".as_bytes()], false),
        (vec![], false),
    ];
    for engine in ENGINES {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let log = dir.path().join("access.log");
        let s = site(&dir.path().join("data"), engine, &["--access-log", log.to_str().expect("a path")]).await;
        let proxy = s.tg.proxy;
        let mut expected = Vec::new();
        for (n, (ids, kept)) in cases.iter().enumerate() {
            for (via, prefix) in [("h1", "/public"), ("h1-to-h2", "/h2"), ("h2", "/public")] {
                let target = format!("{prefix}/echo?case={n}&via={via}");
                let backend_saw = if via == "h2" {
                    let headers: Vec<(&str, &[u8])> = ids.iter().map(|id| ("x-request-id", *id)).collect();
                    let (status, _, body) = h2(proxy, &format!("http://{proxy}{target}"), &headers).await;
                    assert_eq!(status, 200, "{engine} {target}");
                    let echo: Value = serde_json::from_slice(&body).expect("an echo");
                    echo["headers"]["x-request-id"].as_str().unwrap_or("").to_string()
                } else {
                    let mut raw =
                        format!("GET {target} HTTP/1.1\r\nhost: a.example\r\nconnection: close\r\n").into_bytes();
                    for id in ids {
                        raw.extend_from_slice(b"x-request-id: ");
                        raw.extend_from_slice(id);
                        raw.extend_from_slice(b"\r\n");
                    }
                    raw.extend_from_slice(b"\r\n");
                    let reply = raw_exchange(proxy, &raw, Duration::from_secs(5));
                    assert!(reply.starts_with("HTTP/1.1 200"), "{engine} {target}: {reply:?}");
                    echo_of(&reply)["headers"]["x-request-id"].as_str().unwrap_or("").to_string()
                };
                let what = format!("{engine} {target} sent {ids:?}");
                if *kept {
                    assert_eq!(backend_saw.as_bytes(), ids[0], "{what}");
                } else {
                    // One new id, in place of everything the client sent.
                    assert_eq!(backend_saw.len(), 32, "{what}: {backend_saw:?}");
                    assert!(backend_saw.bytes().all(|b| b.is_ascii_hexdigit()), "{what}: {backend_saw:?}");
                }
                expected.push((target, backend_saw));
            }
        }
        let lines = log_lines(&log, expected.len()).await;
        for (target, id) in &expected {
            let line: Value = lines
                .iter()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .find(|l| l["path"] == target.as_str())
                .unwrap_or_else(|| panic!("{engine}: no line for {target} in {lines:?}"));
            assert_eq!(line["request_id"], id.as_str(), "{engine} {target}: the log and the backend agree");
        }
    }
}

/// What a client may send to fool a reader of the log: the character and
/// its escaped forms in the JSON and combined formats.
const HOSTILE: [(&str, &str, &str); 10] = [
    ("\u{202e}", "\\u202e", "\\xE2\\x80\\xAE"),
    ("\u{2028}", "\\u2028", "\\xE2\\x80\\xA8"),
    ("\u{2029}", "\\u2029", "\\xE2\\x80\\xA9"),
    ("\u{9b}", "\\u009b", "\\xC2\\x9B"),
    ("\u{200b}", "\\u200b", "\\xE2\\x80\\x8B"),
    ("\u{200e}", "\\u200e", "\\xE2\\x80\\x8E"),
    ("\u{2066}", "\\u2066", "\\xE2\\x81\\xA6"),
    ("\u{2069}", "\\u2069", "\\xE2\\x81\\xA9"),
    ("\u{feff}", "\\ufeff", "\\xEF\\xBB\\xBF"),
    ("\t", "\\t", "\\x09"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn format_and_control_characters_are_escaped_in_both_log_formats() {
    for engine in ENGINES {
        for format in ["json", "combined"] {
            let dir = tempfile::tempdir().expect("a temporary directory");
            let log: PathBuf = dir.path().join("access.log");
            let args = ["--access-log", log.to_str().expect("a path"), "--access-log-format", format];
            let s = site(&dir.path().join("data"), engine, &args).await;
            for (n, (c, _, _)) in HOSTILE.iter().enumerate() {
                let head = format!(
                    "GET /public/echo?n={n} HTTP/1.1\r\nhost: a.example\r\nuser-agent: ua{c}x\r\n\
                     referer: http://r.example/{c}x\r\nconnection: close\r\n\r\n"
                );
                let reply = raw_exchange(s.tg.proxy, head.as_bytes(), Duration::from_secs(5));
                assert!(reply.starts_with("HTTP/1.1 200"), "{engine} {format} {c:?}: {reply:?}");
            }
            let text = log_lines(&log, HOSTILE.len()).await.join("\n");
            for (c, json_escape, clf_escape) in HOSTILE {
                assert!(!text.contains(c), "{engine} {format}: {c:?} written raw: {text}");
                let escaped = if format == "json" { json_escape } else { clf_escape };
                assert!(text.contains(&format!("ua{escaped}x")), "{engine} {format}: {c:?} not as {escaped}: {text}");
            }
            if format == "json" {
                // Each line is still JSON, and says what was sent.
                let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).expect("a JSON line")).collect();
                for (n, (c, _, _)) in HOSTILE.iter().enumerate() {
                    let path = format!("/public/echo?n={n}");
                    let line = lines.iter().find(|l| l["path"] == path.as_str()).expect("a line for each request");
                    assert_eq!(line["user_agent"], format!("ua{c}x"), "{engine}");
                    assert_eq!(line["referer"], format!("http://r.example/{c}x"), "{engine}");
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_framing_refusal_names_its_cause() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let tg = Tidegate::start(dir.path());
    let b = Backend::start("target", &[]);
    route_to(&tg, "web", &[&b], "round_robin").await;
    for (fields, version, cause) in [
        ("content-length: 4\r\ntransfer-encoding: chunked", "1.1", "both Transfer-Encoding and Content-Length"),
        ("content-length: 4\r\ncontent-length: 40", "1.1", "differing Content-Length values"),
        ("content-length: 4, 5", "1.1", "differing Content-Length values"),
        ("content-length: four", "1.1", "Content-Length is not a valid length"),
        ("content-length: -4", "1.1", "Content-Length is not a valid length"),
        ("transfer-encoding: chunked, chunked", "1.1", "lists chunked more than once"),
        ("transfer-encoding: chunked, gzip", "1.1", "does not end with chunked"),
        ("transfer-encoding: ,", "1.1", "Transfer-Encoding is empty"),
        ("transfer-encoding: chunked", "1.0", "an HTTP/1.0 request cannot have a Transfer-Encoding"),
    ] {
        let reply = ask(tg.proxy, &format!("POST /upload HTTP/{version}\r\nhost: x\r\n{fields}"));
        assert!(reply.starts_with("HTTP/1.1 400"), "{fields:?}: {reply:?}");
        assert!(reply.contains(cause), "{fields:?}: {reply:?}");
        if !cause.starts_with("both") {
            assert!(!reply.contains("both"), "{fields:?}: {reply:?}");
        }
    }
    let (_, stats) = tg.api("GET", "/v1/status", None).await;
    assert_eq!(stats["services"]["web"]["backends"][0]["requests"], 0, "{stats}");
}
