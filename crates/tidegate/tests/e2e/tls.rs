//! TLS termination: certificates generated at run time (a private CA and
//! leaf certificates from rcgen), a verifying rustls client, and the real
//! binary with `--listen-tls`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

use crate::support::*;

/// A private certificate authority.
pub(crate) struct Ca {
    cert: rcgen::Certificate,
    key: rcgen::KeyPair,
    params: rcgen::CertificateParams,
}

/// A leaf certificate: its PEM chain, key and DER.
pub(crate) struct Leaf {
    pub(crate) cert_pem: String,
    pub(crate) key_pem: String,
    pub(crate) der: CertificateDer<'static>,
}

impl Ca {
    pub(crate) fn new() -> Ca {
        let key = rcgen::KeyPair::generate().expect("a CA key");
        let mut params = rcgen::CertificateParams::new(Vec::new()).expect("CA params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::CommonName, "Tidegate test CA");
        let cert = params.self_signed(&key).expect("the CA certificate");
        Ca { cert, key, params }
    }

    /// The CA as the signer of certificates.
    fn issuer(&self) -> rcgen::Issuer<'_, &rcgen::KeyPair> {
        rcgen::Issuer::from_params(&self.params, &self.key)
    }

    /// The CA certificate, PEM.
    pub(crate) fn pem(&self) -> String {
        self.cert.pem()
    }

    pub(crate) fn leaf(&self, names: &[&str]) -> Leaf {
        let key = rcgen::KeyPair::generate().expect("a key");
        let params =
            rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).expect("params");
        let cert = params.signed_by(&key, &self.issuer()).expect("a signed certificate");
        Leaf { cert_pem: cert.pem(), key_pem: key.serialize_pem(), der: cert.der().clone() }
    }

    fn client(&self, alpn: &[&[u8]]) -> tokio_rustls::TlsConnector {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.cert.der().clone()).expect("the CA as a root");
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("protocol versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        tokio_rustls::TlsConnector::from(Arc::new(config))
    }
}

async fn put_cert(tg: &Tidegate, name: &str, leaf: &Leaf, default: bool) -> (u16, serde_json::Value) {
    let spec = json!({ "cert_pem": leaf.cert_pem, "key_pem": leaf.key_pem, "default": default });
    tg.api("PUT", &format!("/v1/certificates/{name}"), Some(spec)).await
}

/// Connects with TLS, verifying the chain against the CA and the name:
/// `sni` a DNS name, or `None` to connect by IP (no SNI is sent).
pub(crate) async fn connect(
    ca: &Ca,
    addr: SocketAddr,
    sni: Option<&str>,
    alpn: &[&[u8]],
) -> std::io::Result<TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await?;
    let name = match sni {
        Some(n) => ServerName::try_from(n.to_string()).expect("a DNS name"),
        None => ServerName::IpAddress(addr.ip().into()),
    };
    tokio::time::timeout(Duration::from_secs(5), ca.client(alpn).connect(name, tcp))
        .await
        .map_err(|_| std::io::Error::other("handshake timed out"))?
}

/// Sends one HTTP/1.1 request on `s` and reads its response (the body
/// framed by Content-Length).
pub(crate) async fn exchange(s: &mut TlsStream<TcpStream>, path: &str, host: &str) -> String {
    let req = format!("GET {path} HTTP/1.1\r\nhost: {host}\r\n\r\n");
    s.write_all(req.as_bytes()).await.expect("write");
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await.expect("a reply").expect("read");
        assert!(n > 0, "closed before a full response: {:?}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&got).to_string();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let len = head
                .lines()
                .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length: ").map(|v| v.trim().to_string()))
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(0);
            if body.len() >= len {
                return text;
            }
        }
    }
}

pub(crate) fn served(s: &TlsStream<TcpStream>) -> CertificateDer<'static> {
    s.get_ref().1.peer_certificates().and_then(|c| c.first()).expect("a certificate").clone().into_owned()
}

async fn start_tls(dir: &std::path::Path) -> (Tidegate, Backend, SocketAddr) {
    let tg = Tidegate::start_with(dir, &["--listen-tls", "127.0.0.1:0"]);
    let b = Backend::start("tls-backend", &[]);
    route_to(&tg, "web", &[&b], "round_robin").await;
    let tls = tg.proxy_tls.expect("a TLS listener");
    (tg, b, tls)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_name_gets_its_certificate_and_unknown_names_fail_cleanly() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let (tg, _b, tls) = start_tls(dir.path()).await;
    let ca = Ca::new();
    let (a, b) = (ca.leaf(&["a.example"]), ca.leaf(&["*.b.example"]));
    assert_eq!(put_cert(&tg, "a", &a, false).await.0, 200);
    assert_eq!(put_cert(&tg, "b", &b, false).await.0, 200);

    let mut s = connect(&ca, tls, Some("a.example"), &[b"http/1.1"]).await.expect("a.example verifies");
    assert_eq!(served(&s), a.der);
    let reply = exchange(&mut s, "/echo", "a.example").await;
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    let echo: serde_json::Value = serde_json::from_str(reply.split_once("\r\n\r\n").expect("a body").1).expect("echo");
    assert_eq!(echo["headers"]["x-forwarded-proto"], "https");
    assert_eq!(echo["headers"]["x-forwarded-port"], tls.port().to_string());

    let s = connect(&ca, tls, Some("www.b.example"), &[]).await.expect("the wildcard verifies");
    assert_eq!(served(&s), b.der);
    assert!(connect(&ca, tls, Some("unknown.example"), &[]).await.is_err(), "no certificate, no default");
    assert!(connect(&ca, tls, None, &[]).await.is_err(), "no SNI, no default");

    // A default certificate takes clients without SNI (and unknown names).
    let fallback = ca.leaf(&["127.0.0.1", "unknown.example"]);
    assert_eq!(put_cert(&tg, "fallback", &fallback, true).await.0, 200);
    let mut s = connect(&ca, tls, None, &[]).await.expect("no SNI gets the default");
    assert_eq!(served(&s), fallback.der);
    assert!(exchange(&mut s, "/", "x").await.starts_with("HTTP/1.1 200"));
    let s = connect(&ca, tls, Some("unknown.example"), &[]).await.expect("an unknown name gets the default");
    assert_eq!(served(&s), fallback.der);

    let metrics = send("GET", &tg.admin_url("/metrics"), Some(TOKEN), Vec::new(), &[]).await.text();
    let failed = metrics
        .lines()
        .find_map(|l| l.strip_prefix("tidegate_tls_handshakes_total{result=\"failed\"} "))
        .and_then(|v| v.parse::<u64>().ok());
    assert!(failed >= Some(2), "{metrics}");
    assert!(metrics.contains("tidegate_certificate_not_after_seconds{name=\"a\"}"), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_certificate_serves_the_next_handshake_and_open_connections_keep_working() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let (tg, _b, tls) = start_tls(dir.path()).await;
    let ca = Ca::new();
    let old = ca.leaf(&["a.example"]);
    assert_eq!(put_cert(&tg, "a", &old, false).await.0, 200);
    let mut open = connect(&ca, tls, Some("a.example"), &[]).await.expect("handshake");
    assert!(exchange(&mut open, "/", "a.example").await.starts_with("HTTP/1.1 200"));

    let new = ca.leaf(&["a.example"]);
    assert_eq!(put_cert(&tg, "a", &new, false).await.0, 200);
    let fresh = connect(&ca, tls, Some("a.example"), &[]).await.expect("handshake after the change");
    assert_eq!(served(&fresh), new.der, "the next handshake sees the new certificate");
    assert_eq!(served(&open), old.der);
    assert!(exchange(&mut open, "/", "a.example").await.starts_with("HTTP/1.1 200"), "the open connection goes on");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_is_negotiated_by_alpn() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let (tg, _b, tls) = start_tls(dir.path()).await;
    let ca = Ca::new();
    assert_eq!(put_cert(&tg, "a", &ca.leaf(&["a.example"]), false).await.0, 200);
    let s = connect(&ca, tls, Some("a.example"), &[b"h2", b"http/1.1"]).await.expect("handshake");
    assert_eq!(s.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), hyper_util::rt::TokioIo::new(s))
            .await
            .expect("an HTTP/2 connection");
    tokio::spawn(conn);
    let req = http::Request::builder()
        .uri("https://a.example/echo")
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .expect("a request");
    let resp = sender.send_request(req).await.expect("a response");
    assert_eq!((resp.status().as_u16(), resp.version()), (200, http::Version::HTTP_2));
    let body = http_body_util::BodyExt::collect(resp.into_body()).await.expect("a body").to_bytes();
    let echo: serde_json::Value = serde_json::from_slice(&body).expect("echo");
    assert_eq!(echo["headers"]["x-forwarded-proto"], "https");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_pairs_are_refused_keys_never_read_back_and_certificates_survive_a_restart() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let (tg, _b, _) = start_tls(dir.path()).await;
    let ca = Ca::new();
    let (good, other) = (ca.leaf(&["a.example"]), ca.leaf(&["a.example"]));
    let mismatched = json!({ "cert_pem": good.cert_pem, "key_pem": other.key_pem });
    let (s, v) = tg.api("PUT", "/v1/certificates/a", Some(mismatched.clone())).await;
    assert_eq!((s, v["error"]["field"].as_str()), (400, Some("spec.key_pem")), "{v}");
    let change = json!({ "ops": [{ "op": "put_certificate", "name": "a", "spec": mismatched }] });
    let (s, v) = tg.api("POST", "/v1/changes", Some(change)).await;
    assert_eq!((s, v["error"]["field"].as_str()), (400, Some("ops[0].spec.key_pem")), "{v}");
    let (s, v) = tg.api("PUT", "/v1/certificates/a", Some(json!({ "cert_pem": "garbage", "key_pem": "x" }))).await;
    assert_eq!((s, v["error"]["field"].as_str()), (400, Some("spec.cert_pem")), "{v}");
    // A certificate for an IP address alone names no DNS host: no SNI name
    // selects it, so it must be the default.
    let ip_only = {
        let key = rcgen::KeyPair::generate().expect("a key");
        let mut params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).expect("params");
        params.distinguished_name = rcgen::DistinguishedName::new();
        let cert = params.signed_by(&key, &ca.issuer()).expect("a signed certificate");
        Leaf { cert_pem: cert.pem(), key_pem: key.serialize_pem(), der: cert.der().clone() }
    };
    let (s, v) = put_cert(&tg, "a", &ip_only, false).await;
    assert_eq!((s, v["error"]["field"].as_str()), (400, Some("spec.default")), "{v}");
    let spec = json!({ "cert_pem": ip_only.cert_pem, "key_pem": ip_only.key_pem });
    let change = json!({ "ops": [{ "op": "put_certificate", "name": "a", "spec": spec }] });
    let (s, v) = tg.api("POST", "/v1/changes", Some(change)).await;
    assert_eq!((s, v["error"]["field"].as_str()), (400, Some("ops[0].spec.default")), "{v}");
    assert_eq!(tg.api("GET", "/v1/certificates/a", None).await.0, 404, "nothing applied");

    assert_eq!(put_cert(&tg, "a", &good, false).await.0, 200);
    let (s, v) = tg.api("GET", "/v1/certificates/a", None).await;
    assert_eq!((s, &v["certificate"]["names"]), (200, &json!(["a.example"])), "{v}");
    for path in ["/v1/certificates/a", "/v1/certificates", "/v1/config"] {
        let (_, v) = tg.api("GET", path, None).await;
        assert!(!v.to_string().contains("PRIVATE KEY"), "{path} shows a key: {v}");
    }
    let admin = tg.admin;
    let watched = tokio::task::spawn_blocking(move || {
        let req = format!("GET /v1/watch?from=0 HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {TOKEN}\r\n\r\n");
        read_event(admin, req.as_bytes(), "put_certificate")
    })
    .await
    .expect("the watch stream");
    assert!(watched.contains("put_certificate"), "{watched}");
    assert!(!watched.contains("PRIVATE KEY"), "the watch stream shows a key: {watched}");

    tg.kill9();
    let tg = Tidegate::start_with(dir.path(), &["--listen-tls", "127.0.0.1:0"]);
    assert_eq!(tg.api("GET", "/v1/certificates/a", None).await.0, 200, "the certificate survived kill -9");
    let s = connect(&ca, tg.proxy_tls.expect("a TLS listener"), Some("a.example"), &[]).await.expect("handshake");
    assert_eq!(served(&s), good.der);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redirect_https_routes_answer_308_on_the_plain_listener() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let (tg, b, tls) = start_tls(dir.path()).await;
    let spec = json!({ "backends": [{ "id": "b0", "addr": b.addr.to_string() }] });
    assert_eq!(tg.api("PUT", "/v1/services/secure", Some(spec)).await.0, 200);
    let route = json!({ "match": { "path_prefix": "/secure" }, "service": "secure", "redirect_https": true });
    assert_eq!(tg.api("PUT", "/v1/routes/secure", Some(route)).await.0, 200);
    let r = send("GET", &tg.url("/secure/x?y=1"), None, Vec::new(), &[("host", "Shop.Example:8080")]).await;
    assert_eq!(r.status, 308);
    let location = r.headers.get("location").and_then(|v| v.to_str().ok()).unwrap_or("");
    assert_eq!(location, format!("https://shop.example:{}/secure/x?y=1", tls.port()));
    let ca = Ca::new();
    assert_eq!(put_cert(&tg, "shop", &ca.leaf(&["shop.example"]), false).await.0, 200);
    let mut s = connect(&ca, tls, Some("shop.example"), &[]).await.expect("handshake");
    assert!(exchange(&mut s, "/secure/x", "shop.example").await.starts_with("HTTP/1.1 200"), "served over HTTPS");
}
