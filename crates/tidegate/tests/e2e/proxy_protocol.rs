//! The PROXY protocol from a TCP load balancer in front: Debian's HAProxy
//! in TCP mode (`send-proxy` for version 1 to the plain listener,
//! `send-proxy-v2` to the TLS listener), connecting from 127.0.0.2, the
//! one address `--proxy-protocol-from` trusts; clients connect to it from
//! 127.0.0.3, and that is the address Tidegate must tell the backend and
//! the access log.
//!
//! And the PROXY protocol sent to a service's backends: Debian's HAProxy
//! in HTTP mode with `accept-proxy` as the backend, answering every
//! request with the client and destination addresses the header named.

use std::net::{IpAddr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::*;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// HAProxy, killed on drop.
struct Haproxy(Child);

impl Haproxy {
    /// Runs HAProxy on `config` (written into `dir`) until it listens on
    /// every one of `ports`.
    async fn start(dir: &std::path::Path, config: &str, ports: &[u16]) -> Haproxy {
        let file = dir.join("haproxy.cfg");
        std::fs::write(&file, config).expect("write");
        let child = Command::new("haproxy")
            .arg("-f")
            .arg(&file)
            .arg("-db")
            .stdout(Stdio::null())
            .spawn()
            .expect("haproxy (apt-get install haproxy)");
        let haproxy = Haproxy(child);
        for &port in ports {
            wait_for("haproxy listens", Duration::from_secs(20), async || {
                TcpStream::connect(("127.0.0.1", port)).await.ok().map(|_| ())
            })
            .await;
        }
        haproxy
    }
}

impl Drop for Haproxy {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A connection to `to` from the local address `from`.
async fn connect_from(from: IpAddr, to: SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.bind(SocketAddr::new(from, 0)).expect("bind the client's address");
    socket.connect(to).await.expect("connect")
}

/// Sends `request` on `stream` and reads until the peer closes (or 10 s).
async fn exchange<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(mut stream: S, request: &[u8]) -> String {
    stream.write_all(request).await.expect("write");
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// The `x-forwarded-for` the emulator's echo saw, from a whole answer.
fn forwarded_for(answer: &str) -> String {
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    let echo: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {answer}"));
    echo["headers"]["x-forwarded-for"].as_str().unwrap_or("").to_string()
}

const ECHO: &[u8] = b"GET /echo HTTP/1.1\r\nhost: pp.test\r\nconnection: close\r\n\r\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_balancer_in_tcp_mode_tells_the_real_client_over_v1_and_v2_and_a_header_from_elsewhere_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("access.log");
    let args = [
        "--listen-tls",
        "127.0.0.1:0",
        "--proxy-protocol-from",
        "127.0.0.2",
        "--access-log",
        log.to_str().expect("a path"),
    ];
    let tg = Tidegate::start_with(&dir.path().join("tg"), &args);
    let tls = tg.proxy_tls.expect("a TLS listener");
    let backend = Backend::start("pp-backend", &[]);
    route_to(&tg, "web", &[&backend], "round_robin").await;
    // A certificate for pp.test, trusted by the test's client.
    let key = rcgen::KeyPair::generate().expect("key");
    let cert =
        rcgen::CertificateParams::new(vec!["pp.test".to_string()]).expect("params").self_signed(&key).expect("cert");
    let put = json!({"cert_pem": cert.pem(), "key_pem": key.serialize_pem()});
    let (s, v) = tg.api("PUT", "/v1/certificates/pp", Some(put)).await;
    assert_eq!(s, 200, "{v}");

    let (plain_front, tls_front) = (free_port(), free_port());
    let config = format!(
        "global\n  maxconn 200\ndefaults\n  mode tcp\n  timeout connect 5s\n  timeout client 30s\n  timeout server 30s\n\
         frontend plain\n  bind 127.0.0.1:{plain_front}\n  default_backend tg_plain\n\
         backend tg_plain\n  server tg {plain} send-proxy source 127.0.0.2\n\
         frontend tls\n  bind 127.0.0.1:{tls_front}\n  default_backend tg_tls\n\
         backend tg_tls\n  server tg {tls} send-proxy-v2 source 127.0.0.2\n",
        plain = tg.proxy,
    );
    let _haproxy = Haproxy::start(dir.path(), &config, &[plain_front, tls_front]).await;
    let client: IpAddr = "127.0.0.3".parse().expect("ip");

    // Version 1 to the plain listener: the backend sees the client.
    let via = connect_from(client, SocketAddr::from(([127, 0, 0, 1], plain_front))).await;
    assert_eq!(forwarded_for(&exchange(via, ECHO).await), "127.0.0.3");

    // Version 2 before a TLS handshake.
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.der().clone()).expect("root");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    let via = connect_from(client, SocketAddr::from(([127, 0, 0, 1], tls_front))).await;
    let name = rustls::pki_types::ServerName::try_from("pp.test").expect("name");
    let tls_stream =
        tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, via).await.expect("TLS through HAProxy");
    assert_eq!(forwarded_for(&exchange(tls_stream, ECHO).await), "127.0.0.3");

    // The access log names the client, not the balancer.
    let lines = wait_for("two access-log lines", Duration::from_secs(10), async || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        (text.lines().filter(|l| l.contains("/echo")).count() >= 2).then_some(text)
    })
    .await;
    for line in lines.lines().filter(|l| l.contains("/echo")) {
        let entry: Value = serde_json::from_str(line).expect("a JSON line");
        assert!(entry["client"].as_str().is_some_and(|c| c.starts_with("127.0.0.3:")), "{line}");
    }

    // A header from an address not trusted: refused, never believed.
    let spoofed = [&b"PROXY TCP4 6.6.6.6 127.0.0.1 4242 80\r\n"[..], ECHO].concat();
    let direct = connect_from("127.0.0.1".parse().expect("ip"), tg.proxy).await;
    let answer = exchange(direct, &spoofed).await;
    assert!(!answer.contains("6.6.6.6") && !answer.starts_with("HTTP/1.1 200"), "{answer}");
    // The trusted balancer's address without a header: closed unanswered.
    let bare = connect_from("127.0.0.2".parse().expect("ip"), tg.proxy).await;
    assert_eq!(exchange(bare, ECHO).await, "", "a connection from the balancer must start with the header");
    let metrics = send("GET", &tg.admin_url("/metrics"), Some(TOKEN), vec![], &[]).await.text();
    let count = |result: &str| {
        let prefix = format!("tidegate_proxy_protocol_headers_total{{result=\"{result}\"}} ");
        metrics.lines().find_map(|l| l.strip_prefix(prefix.as_str())).and_then(|v| v.parse::<f64>().ok())
    };
    // (The probes that waited for HAProxy to listen were relayed too.)
    assert!(count("ok") >= Some(2.0) && count("failed") == Some(1.0), "{metrics}");
}

/// One answer read off a kept-alive HTTP/1.1 connection (a
/// `content-length` body), its body.
async fn keep_alive_exchange(stream: &mut TcpStream, request: &[u8]) -> String {
    stream.write_all(request).await.expect("write");
    let mut got = Vec::new();
    let mut byte = [0u8; 1024];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let text = String::from_utf8_lossy(&got).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let len = head
                .lines()
                .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().to_string()))
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or_else(|| panic!("no content-length: {text}"));
            if body.len() >= len {
                assert!(head.starts_with("HTTP/1.1 200"), "{text}");
                return body.to_string();
            }
        }
        let n =
            tokio::time::timeout_at(deadline, stream.read(&mut byte)).await.expect("an answer in time").expect("read");
        assert!(n > 0, "closed before the answer: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&byte[..n]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_tells_its_backends_each_client_over_v1_and_v2_on_connections_of_that_client_only() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tg = Tidegate::start(&dir.path().join("tg"));
    // The backend: HAProxy reading the header (`accept-proxy`: a
    // connection without one is refused) and answering with what it named.
    let (v1_port, v2_port) = (free_port(), free_port());
    let answer =
        r#"http-request return status 200 content-type text/plain lf-string "%[src]:%[src_port] %[dst]:%[dst_port]""#;
    let config = format!(
        "global\n  maxconn 200\ndefaults\n  mode http\n  timeout connect 5s\n  timeout client 30s\n  timeout server 30s\n\
         frontend v1\n  bind 127.0.0.1:{v1_port} accept-proxy\n  {answer}\n\
         frontend v2\n  bind 127.0.0.1:{v2_port} accept-proxy\n  {answer}\n"
    );
    let _haproxy = Haproxy::start(dir.path(), &config, &[v1_port, v2_port]).await;
    // Health checks through the header that names no client.
    // Generous timeouts: one slow check on a busy machine must not take
    // the backend down mid-test.
    let health = json!({"active": {"path": "/health", "interval_ms": 500, "timeout_ms": 500, "rise": 1, "fall": 3}});
    for (version, port) in [("v1", v1_port), ("v2", v2_port)] {
        let spec = json!({
            "backends": [{"id": "hap", "addr": format!("127.0.0.1:{port}")}],
            "upstream": {"proxy_protocol": version},
            "health": health,
        });
        let (s, v) = tg.api("PUT", &format!("/v1/services/pp{version}"), Some(spec)).await;
        assert_eq!(s, 200, "{v}");
        let route = json!({"match": {"host": format!("{version}.test")}, "service": format!("pp{version}")});
        let (s, v) = tg.api("PUT", &format!("/v1/routes/pp{version}"), Some(route)).await;
        assert_eq!(s, 200, "{v}");
    }
    let (s, v) = tg.api("GET", "/v1/services/ppv2", None).await;
    assert_eq!((s, &v["spec"]["upstream"]["proxy_protocol"]), (200, &json!("v2")), "{v}");
    wait_for("health checks with a LOCAL/UNKNOWN header pass", Duration::from_secs(10), async || {
        let (_, status) = tg.api("GET", "/v1/status", None).await;
        let up = |s: &str| status["services"][s]["backends"][0]["health"] == "up";
        (up("ppv1") && up("ppv2")).then_some(())
    })
    .await;

    // Six clients on kept-alive connections, in turn: each answer names
    // the client that asked. Over two workers, at least two of them share
    // a worker; a connection pooled for the worker would carry one's
    // request with the other's header.
    for version in ["v1", "v2"] {
        let mut clients = Vec::new();
        for i in 3..9u8 {
            let ip = IpAddr::from([127, 0, 0, i]);
            clients.push((ip, connect_from(ip, tg.proxy).await));
        }
        for round in 0..3 {
            for (ip, stream) in &mut clients {
                let local = stream.local_addr().expect("addr");
                let req = format!("GET /r{round} HTTP/1.1\r\nhost: {version}.test\r\n\r\n");
                let body = keep_alive_exchange(stream, req.as_bytes()).await;
                let want = format!("{}:{} {}", ip, local.port(), tg.proxy);
                assert_eq!(body, want, "{version}, round {round}");
            }
        }
    }
    // HTTP/2 (h2c) streams of one connection share its connections.
    let ip = IpAddr::from([127, 0, 0, 9]);
    let tcp = connect_from(ip, tg.proxy).await;
    let local = tcp.local_addr().expect("addr");
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp)).await.expect("h2 handshake");
    tokio::spawn(conn);
    for _ in 0..3 {
        let req = http::Request::get("http://v2.test/h2").body(Full::new(Bytes::new())).expect("a request");
        let resp = sender.send_request(req).await.expect("an answer");
        assert_eq!(resp.status(), 200);
        let body = resp.into_body().collect().await.expect("the body").to_bytes();
        assert_eq!(String::from_utf8_lossy(&body), format!("{ip}:{} {}", local.port(), tg.proxy));
    }

    // HTTP/2 to the backends cannot carry it: refused, the field named.
    let spec = json!({"backends": [{"id": "a", "addr": "127.0.0.1:1"}], "upstream": {"proxy_protocol": "v1", "protocol": "http2"}});
    let (s, v) = tg.api("PUT", "/v1/services/pph2", Some(spec)).await;
    assert_eq!(s, 400, "{v}");
    assert!(v.to_string().contains("upstream.proxy_protocol"), "{v}");
}
