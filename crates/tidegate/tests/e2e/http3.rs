//! HTTP/3 on the TLS listener's port (`serve --http3`), driven by a QUIC
//! implementation from outside the project: aioquic (PyPI), through
//! `h3_client.py`. Every request goes over one QUIC connection, each on
//! its own stream, at once.

use std::path::Path;
use std::process::Command;

use serde_json::{json, Value};

use crate::support::*;

/// A self-signed certificate for `name`: (certificate PEM, key PEM).
fn certificate(name: &str) -> (String, String) {
    let key = rcgen::KeyPair::generate().expect("key");
    let cert = rcgen::CertificateParams::new(vec![name.to_string()]).expect("params").self_signed(&key).expect("cert");
    (cert.pem(), key.serialize_pem())
}

/// Runs the aioquic client against `addr` for `name`, trusting `ca`; its
/// JSON output.
fn h3(addr: std::net::SocketAddr, name: &str, ca: &Path, requests: Value) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/e2e/h3_client.py");
    let out = Command::new("python3")
        .arg(script)
        .arg(addr.to_string())
        .arg(name)
        .arg(ca)
        .arg(requests.to_string())
        .output()
        .expect("python3 (pip install aioquic)");
    assert!(out.status.success(), "the HTTP/3 client failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

/// A Tidegate serving HTTP/3 for `h3.test` with a backend behind it.
struct Served {
    tg: Tidegate,
    /// The TLS listener's address (UDP for HTTP/3).
    tls: std::net::SocketAddr,
    _backend: Backend,
    /// A file holding the certificate, for the clients.
    ca: std::path::PathBuf,
}

/// Starts Tidegate with `args` in `dir`, a backend routed to, and a
/// self-signed certificate for `h3.test`.
async fn served(dir: &Path, args: &[&str]) -> Served {
    let tg = Tidegate::start_with(&dir.join("tg"), args);
    let tls = tg.proxy_tls.expect("a TLS listener");
    let backend = Backend::start("h3-backend", &[]);
    route_to(&tg, "web", &[&backend], "round_robin").await;
    let (cert, key) = certificate("h3.test");
    let (s, v) = tg.api("PUT", "/v1/certificates/h3", Some(json!({"cert_pem": cert, "key_pem": key}))).await;
    assert_eq!(s, 200, "{v}");
    let ca = dir.join("ca.pem");
    std::fs::write(&ca, &cert).expect("write");
    Served { tg, tls, _backend: backend, ca }
}

/// A child process, killed on drop.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn header<'a>(answer: &'a Value, name: &str) -> Option<&'a str> {
    answer["headers"].as_array()?.iter().find(|h| h[0] == name).and_then(|h| h[1].as_str())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http3_serves_the_routes_with_the_live_certificates_and_tcp_advertises_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("access.log");
    let args = ["--listen-tls", "127.0.0.1:0", "--http3", "--access-log", log.to_str().expect("a path")];
    let Served { tg, tls, _backend, ca } = served(dir.path(), &args).await;

    // GET and POST with a body, and many streams at once.
    let body = "x".repeat(100 * 1024);
    let out = h3(
        tls,
        "h3.test",
        &ca,
        json!([
            {"method": "GET", "path": "/echo?q=1"},
            {"method": "POST", "path": "/echo", "body": body, "headers": [["content-type", "text/plain"]]},
            {"method": "GET", "path": "/", "repeat": 50},
            // Past the 1 MiB read ahead: the rest streams to the backend
            // under the length it was told.
            {"method": "POST", "path": "/echo", "body": "w", "body_times": 2_097_152,
             "headers": [["content-length", "2097152"]]},
        ]),
    );
    let answers = out["answers"].as_array().expect("answers");
    assert_eq!(answers.len(), 53);
    let large: Value = serde_json::from_str(answers[52]["body"].as_str().unwrap_or("")).unwrap_or(Value::Null);
    assert_eq!((answers[52]["status"].as_u64(), large["body_bytes"].as_u64()), (Some(200), Some(2_097_152)), "{large}");
    let echo: Value = serde_json::from_str(answers[0]["body"].as_str().expect("a body")).expect("the echo");
    assert_eq!(answers[0]["status"], 200, "{out}");
    assert_eq!(echo["path"], "/echo?q=1");
    assert_eq!(echo["headers"]["x-forwarded-proto"], "https", "{echo}");
    assert_eq!(echo["headers"]["host"], "h3.test", "{echo}");
    let posted: Value = serde_json::from_str(answers[1]["body"].as_str().expect("a body")).expect("the echo");
    assert_eq!(
        (answers[1]["status"].as_u64(), posted["body_bytes"].as_u64()),
        (Some(200), Some(100 * 1024)),
        "{posted}"
    );
    assert!(answers[2..52].iter().all(|a| a["status"] == 200 && a["reset"] == false), "{out}");
    // No connection-specific field, and no advertisement of itself.
    assert!(header(&answers[0], "connection").is_none() && header(&answers[0], "alt-svc").is_none(), "{out}");

    // A streamed answer (a 1 MiB static file), and a body longer than
    // its content-length refused before the backend sees it.
    let www = tempfile::tempdir().expect("tempdir");
    std::fs::write(www.path().join("big.bin"), "z".repeat(1 << 20)).expect("write");
    let spec = json!({"match": {"host": "h3.test", "path_prefix": "/files"}, "static": {"root": www.path()}});
    let (s, v) = tg.api("PUT", "/v1/routes/files", Some(spec)).await;
    assert_eq!(s, 200, "{v}");
    let out = h3(
        tls,
        "h3.test",
        &ca,
        json!([
            {"path": "/files/big.bin"},
            {"method": "POST", "path": "/echo", "body": "0123456789abcdef", "headers": [["content-length", "8"]]},
        ]),
    );
    let file = &out["answers"][0];
    assert_eq!((file["status"].as_u64(), file["body"].as_str().map(str::len)), (Some(200), Some(1 << 20)));
    assert_eq!(out["answers"][1]["status"], 400, "{}", out["answers"][1]);

    // A request head over the limit is refused; the connection serves on.
    let big: Vec<Value> = (0..40).map(|i| json!([format!("x-big-{i}"), "y".repeat(2000)])).collect();
    let out = h3(tls, "h3.test", &ca, json!([{"path": "/", "headers": big}, {"path": "/echo"}]));
    assert_eq!(out["answers"][0]["status"], 431, "{out}");
    assert_eq!(out["answers"][1]["status"], 200, "{out}");

    // The certificate changed at runtime serves the next handshake.
    let (cert2, key2) = certificate("h3.test");
    let (s, v) = tg.api("PUT", "/v1/certificates/h3", Some(json!({"cert_pem": cert2, "key_pem": key2}))).await;
    assert_eq!(s, 200, "{v}");
    let ca2 = dir.path().join("ca2.pem");
    std::fs::write(&ca2, &cert2).expect("write");
    let out = h3(tls, "h3.test", &ca2, json!([{"path": "/echo"}]));
    assert_eq!(out["answers"][0]["status"], 200, "{out}");

    // TCP on the TLS listener advertises it; the plain listener does not.
    let over_tls = tls_get(tls, "h3.test", &cert2, "/echo").await;
    let port = tls.port();
    assert!(over_tls.contains(&format!("alt-svc: h3=\":{port}\"; ma=86400")), "{over_tls}");
    let plain = get(&tg.url("/echo")).await;
    assert!(plain.headers.get("alt-svc").is_none(), "{:?}", plain.headers);

    // Metrics, status and the access log's protocol.
    let metrics = send("GET", &tg.admin_url("/metrics"), Some(TOKEN), vec![], &[]).await.text();
    let accepted = metrics
        .lines()
        .find_map(|l| l.strip_prefix("tidegate_quic_connections_total "))
        .and_then(|v| v.parse::<f64>().ok());
    assert!(accepted >= Some(3.0), "{metrics}");
    let (_, status) = tg.api("GET", "/v1/status", None).await;
    assert!(status["quic_connections_open"].is_u64(), "{status}");
    let lines = wait_for("HTTP/3 in the access log", std::time::Duration::from_secs(10), async || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        text.lines().any(|l| l.contains("\"protocol\":\"HTTP/3\"")).then_some(text)
    })
    .await;
    assert!(lines.lines().filter(|l| l.contains("\"protocol\":\"HTTP/3\"")).count() >= 53, "{lines}");
}

/// One GET over TLS (TCP) to `addr` for `name`, trusting `cert`: the whole
/// answer, lowercased.
async fn tls_get(addr: std::net::SocketAddr, name: &str, cert: &str, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut roots = rustls::RootCertStore::empty();
    use rustls::pki_types::pem::PemObject;
    for c in rustls::pki_types::CertificateDer::pem_slice_iter(cert.as_bytes()) {
        roots.add(c.expect("a certificate")).expect("root");
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let server = rustls::pki_types::ServerName::try_from(name.to_string()).expect("name");
    let mut stream =
        tokio_rustls::TlsConnector::from(std::sync::Arc::new(config)).connect(server, tcp).await.expect("TLS");
    let req = format!("GET {path} HTTP/1.1\r\nhost: {name}\r\nconnection: close\r\n\r\n");
    stream.write_all(req.as_bytes()).await.expect("write");
    let mut out = Vec::new();
    let _ = tokio::time::timeout(std::time::Duration::from_secs(10), stream.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).to_lowercase()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_a_handshake_flood_clients_prove_their_address_with_a_retry() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Retry from 8 handshakes in progress on a worker; one connection per
    // client address.
    let args =
        ["--listen-tls", "127.0.0.1:0", "--http3", "--http3-retry-above", "8", "--max-connections-per-client", "1"];
    let Served { tg, tls, _backend, ca } = served(dir.path(), &args).await;
    let metric = async |name: &str| {
        let metrics = send("GET", &tg.admin_url("/metrics"), Some(TOKEN), vec![], &[]).await.text();
        metrics.lines().find_map(|l| l.strip_prefix(&format!("{name} "))?.parse::<f64>().ok()).unwrap_or(0.0)
    };

    // Quiet: a client is served without a Retry.
    let out = h3(tls, "h3.test", &ca, json!([{"path": "/echo"}]));
    assert_eq!((out["answers"][0]["status"].as_u64(), out["retry"].as_bool()), (Some(200), Some(false)), "{out}");

    // A flood: 40 handshakes started from as many ports and never
    // answered, held open (each until the handshake timeout).
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/e2e/h3_client.py");
    let flood = Command::new("python3")
        .arg(script)
        .args(["--half-open", &tls.to_string(), "h3.test", "40", "30"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("python3");
    let _flood = Killed(flood);
    // Each worker takes 8 of them; the rest, past the threshold, get a
    // Retry they never answer.
    wait_for("both workers' handshakes at the threshold", std::time::Duration::from_secs(10), async || {
        (metric("tidegate_quic_handshakes_in_progress").await >= 16.0).then_some(())
    })
    .await;
    wait_for("the rest of the flood sent a Retry", std::time::Duration::from_secs(10), async || {
        (metric("tidegate_quic_retries_total").await >= 20.0).then_some(())
    })
    .await;
    // A new client must prove its address first, and is served.
    let out = h3(tls, "h3.test", &ca, json!([{"path": "/echo"}]));
    assert_eq!(out["answers"][0]["status"], 200, "{out}");
    assert_eq!(out["retry"], true, "the client went through a Retry: {out}");

    // A second connection from the same address while one is open is
    // refused (`--max-connections-per-client 1`); the first one serves.
    // (Once the client above has gone: its connection's close is seen.)
    wait_for("the first client's connection ends", std::time::Duration::from_secs(40), async || {
        let (_, status) = tg.api("GET", "/v1/status", None).await;
        (status["quic_connections_open"] == 0).then_some(())
    })
    .await;
    let out = Command::new(bin_dir().join("tidegate-bench"))
        .args(["--proxy", &tls.to_string(), "h3", "--connections", "2", "--streams", "1", "--duration-s", "1"])
        .args(["--server-name", "h3.test", "--ca"])
        .arg(&ca)
        .output()
        .expect("tidegate-bench (cargo build --workspace)");
    let report: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {out:?}"));
    assert!(report["ok"].as_u64() > Some(0), "{report}");
    let refused: u64 = report["errors"].as_object().map_or(0, |e| e.values().filter_map(Value::as_u64).sum());
    assert_eq!(refused, 1, "one connection closed at the cap: {report}");
    assert!(report.to_string().contains("H3_EXCESSIVE_LOAD"), "closed with H3_EXCESSIVE_LOAD: {report}");
    let metrics = send("GET", &tg.admin_url("/metrics"), Some(TOKEN), vec![], &[]).await.text();
    assert!(metrics.contains("tidegate_quic_refused_total 1"), "{metrics}");
}
