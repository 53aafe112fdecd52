//! TLS and HTTP/2 to backends: an HTTPS backend behind a private CA, a
//! backend whose certificate is not trusted (a clear 502), health checks
//! that go the way requests go, and gRPC (unary and server streaming, with
//! trailers) through the proxy over HTTP/2, with and without TLS.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::*;
use crate::tls::Ca;

/// An emulator serving TLS with a certificate for 127.0.0.1 from `ca`.
fn tls_backend(dir: &std::path::Path, name: &str, ca: &Ca) -> Backend {
    tls_backend_with(dir, name, ca, &[])
}

/// `tls_backend` with more emulator flags.
fn tls_backend_with(dir: &std::path::Path, name: &str, ca: &Ca, extra: &[&str]) -> Backend {
    let leaf = ca.leaf(&["127.0.0.1"]);
    let (cert, key) = (dir.join(format!("{name}.crt")), dir.join(format!("{name}.key")));
    std::fs::write(&cert, &leaf.cert_pem).expect("write the certificate");
    std::fs::write(&key, &leaf.key_pem).expect("write the key");
    let mut args = vec!["--tls-cert", cert.to_str().expect("a path"), "--tls-key", key.to_str().expect("a path")];
    args.extend_from_slice(extra);
    Backend::start(name, &args)
}

/// A service over one backend, routed by host name.
async fn service(tg: &Tidegate, name: &str, backend: &Backend, upstream: Value, extra: Value) {
    let mut spec = json!({ "backends": [{ "id": "b0", "addr": backend.addr.to_string() }], "upstream": upstream });
    if let (Some(s), Some(e)) = (spec.as_object_mut(), extra.as_object()) {
        s.extend(e.clone());
    }
    let (s, v) = tg.api("PUT", &format!("/v1/services/{name}"), Some(spec)).await;
    assert_eq!(s, 200, "{v}");
    let route = json!({ "match": { "host": format!("{name}.test") }, "service": name });
    let (s, v) = tg.api("PUT", &format!("/v1/routes/{name}"), Some(route)).await;
    assert_eq!(s, 200, "{v}");
}

async fn get_host(tg: &Tidegate, host: &str, path: &str) -> Reply {
    send("GET", &tg.url(path), None, Vec::new(), &[("host", host)]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_backends_are_verified_against_the_service_ca() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let tg = Tidegate::start(dir.path());
    let (ca, other_ca) = (Ca::new(), Ca::new());
    let backend = tls_backend(dir.path(), "secure-backend", &ca);

    service(&tg, "secure", &backend, json!({ "tls": { "ca_pem": ca.pem() } }), json!({})).await;
    let retries = json!({ "retries": 0 });
    service(&tg, "wrong", &backend, json!({ "tls": { "ca_pem": other_ca.pem() } }), retries.clone()).await;
    service(&tg, "misnamed", &backend, json!({ "tls": { "ca_pem": ca.pem(), "sni": "elsewhere.example" } }), retries)
        .await;
    service(&tg, "unverified", &backend, json!({ "tls": { "verify": false } }), json!({})).await;

    for _ in 0..3 {
        let r = get_host(&tg, "secure.test", "/").await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(served_by(&r), "secure-backend");
    }
    let echo = get_host(&tg, "secure.test", "/echo").await;
    let doc: Value = serde_json::from_slice(&echo.body).expect("the echo's JSON");
    assert_eq!(doc["headers"]["host"], "secure.test", "{doc}");
    assert_eq!(doc["headers"]["x-forwarded-proto"], "http", "{doc}");
    // One pooled TLS connection carried them all (the proxy has 2 workers,
    // so at most 2).
    let stats = get_host(&tg, "secure.test", "/_emulator/stats").await;
    let stats: Value = serde_json::from_slice(&stats.body).expect("the stats' JSON");
    assert!(stats["connections_open"].as_u64().is_some_and(|n| (1..=2).contains(&n)), "{stats}");

    for host in ["wrong.test", "misnamed.test"] {
        let r = get_host(&tg, host, "/").await;
        assert_eq!(r.status, 502, "{host}: {}", r.text());
        assert!(r.text().contains("TLS handshake with the backend failed"), "{host}: {}", r.text());
    }
    let metrics = send("GET", &tg.admin_url("/metrics"), Some(TOKEN), Vec::new(), &[]).await.text();
    assert!(metrics.contains("upstream_tls"), "the failure is counted by its cause");

    let r = get_host(&tg, "unverified.test", "/").await;
    assert_eq!(r.status, 200, "verify false encrypts without checking: {}", r.text());

    // HTTP/2 clients reach an HTTPS backend too (through the bridge).
    let (status, _, body, _) = h2_call(tg.proxy, "secure.test", "/", Bytes::new(), "text/plain").await;
    assert_eq!(status, 200);
    assert_eq!(body, Bytes::from("secure-backend\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_certificates_open_backends_that_require_them_and_their_key_is_never_shown() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let tg = Tidegate::start(dir.path());
    let (ca, clients, strangers) = (Ca::new(), Ca::new(), Ca::new());
    let client_ca = dir.path().join("clients.crt");
    std::fs::write(&client_ca, clients.pem()).expect("write the client CA");
    let backend =
        tls_backend_with(dir.path(), "mutual-backend", &ca, &["--tls-client-ca", client_ca.to_str().unwrap()]);
    let identity = |leaf: &crate::tls::Leaf| json!({ "ca_pem": ca.pem(), "client_cert_pem": leaf.cert_pem, "client_key_pem": leaf.key_pem });
    let client = clients.leaf(&["tidegate.test"]);
    let no_retry = json!({ "retries": 0 });

    // Without a certificate, or with one the backend does not trust: refused.
    service(&tg, "anonymous", &backend, json!({ "tls": { "ca_pem": ca.pem() } }), no_retry.clone()).await;
    let stranger = strangers.leaf(&["tidegate.test"]);
    service(&tg, "stranger", &backend, json!({ "tls": identity(&stranger) }), no_retry.clone()).await;
    for host in ["anonymous.test", "stranger.test"] {
        let r = get_host(&tg, host, "/").await;
        assert_eq!(r.status, 502, "{host}: {}", r.text());
    }

    // With its certificate, over HTTP/1.1 and HTTP/2: served.
    service(&tg, "mutual", &backend, json!({ "tls": identity(&client) }), json!({})).await;
    service(&tg, "mutual2", &backend, json!({ "tls": identity(&client), "protocol": "http2" }), json!({})).await;
    for host in ["mutual.test", "mutual2.test"] {
        let r = get_host(&tg, host, "/").await;
        assert_eq!(r.status, 200, "{host}: {}", r.text());
        assert_eq!(served_by(&r), "mutual-backend");
    }

    // Read APIs show the certificate, never the key.
    let (s, read) = tg.api("GET", "/v1/services/mutual", None).await;
    assert_eq!(s, 200, "{read}");
    let tls = &read["spec"]["upstream"]["tls"];
    assert_eq!(tls["client_key_pem"], "(redacted)", "{read}");
    assert_eq!(tls["client_cert_pem"], client.cert_pem.as_str(), "{read}");
    for path in ["/v1/config", "/v1/services", "/v1/services/mutual"] {
        let r = send("GET", &tg.admin_url(path), Some(TOKEN), Vec::new(), &[]).await;
        assert!(!r.text().contains("PRIVATE KEY"), "{path} shows the key: {}", r.text());
    }
    let watched = read_event(
        tg.admin,
        format!("GET /v1/watch?from=0 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n").as_bytes(),
        "client_cert_pem",
    );
    assert!(watched.contains("client_cert_pem"), "the watch stream shows the change: {watched}");
    assert!(!watched.contains("PRIVATE KEY"), "the watch stream shows the key: {watched}");

    // Put back as read, with another change: the key is kept.
    let mut spec = read["spec"].clone();
    spec["retries"] = json!(1);
    let (s, v) = tg.api("PUT", "/v1/services/mutual", Some(spec.clone())).await;
    assert_eq!(s, 200, "{v}");
    let r = get_host(&tg, "mutual.test", "/").await;
    assert_eq!(r.status, 200, "the kept key still opens the backend: {}", r.text());

    // A new certificate with the old key kept: refused, the field named,
    // and nothing changed.
    spec["upstream"]["tls"]["client_cert_pem"] = json!(clients.leaf(&["other.test"]).cert_pem);
    let (s, v) = tg.api("PUT", "/v1/services/mutual", Some(spec)).await;
    assert_eq!(s, 409, "{v}");
    assert!(v.to_string().contains("upstream.tls.client_key_pem"), "{v}");
    let r = get_host(&tg, "mutual.test", "/").await;
    assert_eq!(r.status, 200, "{}", r.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prequal_probes_reach_tls_backends_as_requests_do() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let tg = Tidegate::start(dir.path());
    let (ca, clients) = (Ca::new(), Ca::new());
    let client_ca = dir.path().join("clients.crt");
    std::fs::write(&client_ca, clients.pem()).expect("write the client CA");
    let backend =
        tls_backend_with(dir.path(), "probed-backend", &ca, &["--tls-client-ca", client_ca.to_str().unwrap()]);
    let client = clients.leaf(&["tidegate.test"]);
    let tls = json!({ "ca_pem": ca.pem(), "client_cert_pem": client.cert_pem, "client_key_pem": client.key_pem });
    // Probes of a path the emulator counts as served, one per request.
    let policy = json!({ "kind": "prequal", "probe_path": "/probe", "probes_per_request_pct": 100 });
    service(&tg, "probed", &backend, json!({ "tls": tls }), json!({ "policy": policy })).await;
    for _ in 0..50 {
        let r = get_host(&tg, "probed.test", "/").await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    // The emulator counts the 50 requests and every probe that got through
    // TLS with the client certificate.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let stats = get_host(&tg, "probed.test", "/_emulator/stats").await;
        let stats: Value = serde_json::from_slice(&stats.body).expect("the stats' JSON");
        let served = stats["served"].as_u64().unwrap_or(0);
        if served >= 60 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "probes did not reach the backend: {stats}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_upstream_tls_settings_are_refused_with_the_field_named() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let tg = Tidegate::start(dir.path());
    let b = Backend::start("b", &[]);
    let ca = Ca::new();
    let (leaf, other) = (ca.leaf(&["tidegate.test"]), ca.leaf(&["tidegate.test"]));
    let cases = [
        (json!({ "tls": { "ca_pem": "not a certificate" } }), "upstream.tls.ca_pem"),
        (json!({ "tls": { "sni": "bad name!" } }), "upstream.tls.sni"),
        (json!({ "tls": { "verify": false, "ca_pem": Ca::new().pem() } }), "upstream.tls.ca_pem"),
        (json!({ "protocol": "http3" }), "protocol"),
        (json!({ "tls": { "verify": "yes" } }), "verify"),
        (json!({ "tls": { "client_cert_pem": leaf.cert_pem } }), "upstream.tls.client_key_pem"),
        (json!({ "tls": { "client_key_pem": leaf.key_pem } }), "upstream.tls.client_cert_pem"),
        (
            json!({ "tls": { "client_cert_pem": leaf.cert_pem, "client_key_pem": other.key_pem } }),
            "upstream.tls.client_key_pem",
        ),
        (json!({ "tls": { "client_cert_pem": "no", "client_key_pem": leaf.key_pem } }), "upstream.tls.client_cert_pem"),
    ];
    for (upstream, field) in cases {
        let spec = json!({ "backends": [{ "id": "b0", "addr": b.addr.to_string() }], "upstream": upstream });
        let (s, v) = tg.api("PUT", "/v1/services/bad", Some(spec)).await;
        assert_eq!(s, 400, "{upstream}: {v}");
        assert!(v.to_string().contains(field), "{upstream}: the error names {field}: {v}");
    }
    // The placeholder of a key, where there is no key to keep.
    let upstream = json!({ "tls": { "client_cert_pem": leaf.cert_pem, "client_key_pem": "(redacted)" } });
    let spec = json!({ "backends": [{ "id": "b0", "addr": b.addr.to_string() }], "upstream": upstream });
    let (s, v) = tg.api("PUT", "/v1/services/bad", Some(spec)).await;
    assert_eq!(s, 409, "{v}");
    assert!(v.to_string().contains("upstream.tls.client_key_pem"), "{v}");
    let (s, _) = tg.api("GET", "/v1/services/bad", None).await;
    assert_eq!(s, 404, "nothing was applied");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_checks_reach_backends_as_requests_do() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let tg = Tidegate::start(dir.path());
    let (ca, other_ca) = (Ca::new(), Ca::new());
    let backend = tls_backend(dir.path(), "checked", &ca);
    let check = json!({ "health": { "active": { "path": "/health", "interval_ms": 100, "timeout_ms": 100, "rise": 1, "fall": 1 } } });
    service(&tg, "good", &backend, json!({ "tls": { "ca_pem": ca.pem() }, "protocol": "http2" }), check.clone()).await;
    service(&tg, "bad", &backend, json!({ "tls": { "ca_pem": other_ca.pem() } }), check).await;
    let health = |status: &Value, service: &str| status["services"][service]["backends"][0]["health"].clone();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (_, status) = tg.api("GET", "/v1/status", None).await;
        if health(&status, "good") == "up" && health(&status, "bad") == "down" {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "probes did not settle: {status}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_passes_through_over_http2_with_trailers() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let tg = Tidegate::start(dir.path());
    let ca = Ca::new();
    let tls = tls_backend(dir.path(), "grpc-tls", &ca);
    let cleartext = Backend::start("grpc-h2c", &[]);
    service(&tg, "grpctls", &tls, json!({ "protocol": "http2", "tls": { "ca_pem": ca.pem() } }), json!({})).await;
    service(&tg, "grpch2c", &cleartext, json!({ "protocol": "http2" }), json!({})).await;

    for (host, name) in [("grpctls.test", "grpc-tls"), ("grpch2c.test", "grpc-h2c")] {
        let (status, headers, body, trailers) =
            h2_call(tg.proxy, host, "/tidegate.test.Echo/Unary", grpc_frame(b"hello"), "application/grpc").await;
        assert_eq!(status, 200, "{host}");
        assert_eq!(headers.get("x-backend").map(|v| v.as_bytes()), Some(name.as_bytes()));
        assert_eq!(grpc_messages(body), vec![Bytes::from("hello")], "{host}");
        let trailers = trailers.unwrap_or_else(|| panic!("{host}: trailers came through"));
        assert_eq!(trailers["grpc-status"], "0", "{host}");

        let (status, _, body, trailers) =
            h2_call(tg.proxy, host, "/tidegate.test.Echo/ServerStream", grpc_frame(b"3"), "application/grpc").await;
        assert_eq!(status, 200, "{host}");
        let want: Vec<Bytes> = (1..=3).map(|i| Bytes::from(format!("reply {i} of 3"))).collect();
        assert_eq!(grpc_messages(body), want, "{host}");
        let trailers = trailers.unwrap_or_else(|| panic!("{host}: trailers came through"));
        assert_eq!(trailers["grpc-status"], "0");
        assert_eq!(trailers["x-stream-count"], "3");

        let (_, _, _, trailers) =
            h2_call(tg.proxy, host, "/tidegate.test.Echo/Missing", grpc_frame(b""), "application/grpc").await;
        assert_eq!(trailers.expect("trailers")["grpc-status"], "12", "an error status arrives in the trailers");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http1_clients_reach_http2_backends_with_bodies_of_any_size() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let tg = Tidegate::start(dir.path());
    let b = Backend::start("h2-backend", &[]);
    service(&tg, "h2", &b, json!({ "protocol": "http2" }), json!({})).await;

    // Small (buffered), large by length and chunked (both streamed).
    let big = vec![b'x'; 300_000];
    let cases: [(&str, Vec<u8>, usize); 3] = [
        ("content-length: 5\r\n", b"hello".to_vec(), 5),
        ("content-length: 300000\r\n", big.clone(), big.len()),
        ("transfer-encoding: chunked\r\n", chunked(&big, 7_000), big.len()),
    ];
    let mut s = tokio::net::TcpStream::connect(tg.proxy).await.expect("connect");
    for (framing, body, want) in cases {
        let head = format!("POST /echo HTTP/1.1\r\nhost: h2.test\r\n{framing}\r\n");
        s.write_all(head.as_bytes()).await.expect("write the head");
        s.write_all(&body).await.expect("write the body");
        let (head, body) = read_response(&mut s).await;
        assert!(head.starts_with("http/1.1 200"), "{head}");
        let doc: Value = serde_json::from_slice(&body).expect("the echo's JSON");
        assert_eq!(doc["version"], "HTTP/2.0", "{doc}");
        assert_eq!(doc["body_bytes"], want, "{framing}: {doc}");
        assert_eq!(doc["headers"]["x-forwarded-for"], "127.0.0.1", "{doc}");
    }
}

/// `body` in chunks of `size`, chunked.
fn chunked(body: &[u8], size: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for piece in body.chunks(size) {
        out.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
        out.extend_from_slice(piece);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"0\r\n\r\n");
    out
}

/// Reads one response framed by Content-Length or chunked; the head and
/// the (de-chunked) body.
async fn read_response(s: &mut tokio::net::TcpStream) -> (String, Vec<u8>) {
    let mut got = BytesMut::new();
    let mut buf = [0u8; 65536];
    loop {
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await.expect("a reply").expect("read");
        assert!(n > 0, "closed early: {:?}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
        let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") else { continue };
        let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
        let rest = &got[end + 4..];
        if let Some(len) = head.lines().find_map(|l| l.strip_prefix("content-length: ")) {
            let len: usize = len.trim().parse().expect("a length");
            if rest.len() >= len {
                return (head, rest[..len].to_vec());
            }
        } else if head.contains("transfer-encoding: chunked") {
            if let Some(body) = dechunk(rest) {
                return (head, body);
            }
        }
    }
}

fn dechunk(mut data: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end = data.windows(2).position(|w| w == b"\r\n")?;
        let size = usize::from_str_radix(std::str::from_utf8(&data[..line_end]).ok()?.trim(), 16).ok()?;
        data = &data[line_end + 2..];
        if size == 0 {
            return data.starts_with(b"\r\n").then_some(out);
        }
        out.extend_from_slice(data.get(..size)?);
        data = data.get(size + 2..)?;
    }
}

fn grpc_frame(message: &[u8]) -> Bytes {
    let mut out = BytesMut::new();
    out.extend_from_slice(&[0]);
    out.extend_from_slice(&(message.len() as u32).to_be_bytes());
    out.extend_from_slice(message);
    out.freeze()
}

fn grpc_messages(mut body: Bytes) -> Vec<Bytes> {
    let mut out = Vec::new();
    while body.len() >= 5 {
        let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
        body.advance(5);
        out.push(body.split_to(len.min(body.len())));
    }
    out
}

/// One HTTP/2 (prior knowledge) POST to the proxy: the status, headers,
/// body and trailers.
async fn h2_call(
    proxy: SocketAddr,
    host: &str,
    path: &str,
    body: Bytes,
    content_type: &str,
) -> (u16, http::HeaderMap, Bytes, Option<http::HeaderMap>) {
    let tcp = tokio::net::TcpStream::connect(proxy).await.expect("connect");
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp)).await.expect("h2 handshake");
    tokio::spawn(conn);
    let req = http::Request::post(format!("http://{host}{path}"))
        .header("content-type", content_type)
        .header("te", "trailers")
        .body(Full::new(body))
        .expect("a request");
    let resp = tokio::time::timeout(Duration::from_secs(10), sender.send_request(req))
        .await
        .expect("an answer in time")
        .expect("an answer");
    let (parts, body) = resp.into_parts();
    let collected = tokio::time::timeout(Duration::from_secs(10), body.collect())
        .await
        .expect("the body in time")
        .expect("the body");
    let trailers = collected.trailers().cloned();
    (parts.status.as_u16(), parts.headers, collected.to_bytes(), trailers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrades_on_an_http2_service_go_over_http1_with_tls() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let tg = Tidegate::start(dir.path());
    let ca = Ca::new();
    let b = tls_backend(dir.path(), "ws-tls", &ca);
    service(&tg, "ws", &b, json!({ "protocol": "http2", "tls": { "ca_pem": ca.pem() } }), json!({})).await;
    let mut s = tokio::net::TcpStream::connect(tg.proxy).await.expect("connect");
    s.write_all(b"GET /upgrade HTTP/1.1\r\nhost: ws.test\r\nconnection: upgrade\r\nupgrade: echo\r\n\r\n")
        .await
        .expect("write");
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let byte = tokio::time::timeout(Duration::from_secs(5), s.read_u8()).await.expect("a reply").expect("read");
        head.push(byte);
    }
    let head = String::from_utf8_lossy(&head);
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    s.write_all(b"ping over the tunnel").await.expect("write");
    let mut buf = [0u8; 20];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut buf)).await.expect("the echo").expect("read");
    assert_eq!(&buf, b"ping over the tunnel");
}
