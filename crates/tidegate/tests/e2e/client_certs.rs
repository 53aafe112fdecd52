//! Client certificates at the front door (mutual TLS): a certificate's
//! `client_auth` (a CA bundle and a mode) and a route's `client_cert`
//! (required, forward_headers), against the real binary, with client
//! certificates generated at run time by rcgen and a real backend that
//! echoes the headers it gets.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::*;
use crate::tls::{Ca, Leaf};

/// A private CA that signs client certificates.
struct ClientCa {
    cert: rcgen::Certificate,
    key: rcgen::KeyPair,
    params: rcgen::CertificateParams,
}

/// A client certificate: its DER and key, and its subject as the proxy
/// passes it on.
struct ClientId {
    der: CertificateDer<'static>,
    key_der: Vec<u8>,
}

impl ClientCa {
    fn new(name: &str) -> ClientCa {
        let key = rcgen::KeyPair::generate().expect("a CA key");
        let mut params = rcgen::CertificateParams::new(Vec::new()).expect("CA params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        let cert = params.self_signed(&key).expect("the CA certificate");
        ClientCa { cert, key, params }
    }

    fn pem(&self) -> String {
        self.cert.pem()
    }

    /// The CA as the signer of certificates and revocation lists.
    fn issuer(&self) -> rcgen::Issuer<'_, &rcgen::KeyPair> {
        rcgen::Issuer::from_params(&self.params, &self.key)
    }

    /// A client certificate with this common name.
    fn client(&self, cn: &str) -> ClientId {
        self.client_numbered(cn, None)
    }

    /// A client certificate with this common name and serial number.
    fn client_numbered(&self, cn: &str, serial: Option<u64>) -> ClientId {
        let key = rcgen::KeyPair::generate().expect("a key");
        let mut params = rcgen::CertificateParams::new(Vec::new()).expect("params");
        params.serial_number = serial.map(rcgen::SerialNumber::from);
        params.distinguished_name.push(rcgen::DnType::CommonName, cn);
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params.signed_by(&key, &self.issuer()).expect("a signed certificate");
        ClientId { der: cert.der().clone(), key_der: key.serialize_der() }
    }
}

impl ClientCa {
    /// The CA's revocation list (PEM), revoking these serial numbers.
    fn crl(&self, revoked: &[u64]) -> String {
        let params = rcgen::CertificateRevocationListParams {
            this_update: rcgen::date_time_ymd(2024, 1, 1),
            next_update: rcgen::date_time_ymd(2099, 1, 1),
            crl_number: rcgen::SerialNumber::from(1u64),
            issuing_distribution_point: None,
            revoked_certs: revoked
                .iter()
                .map(|n| rcgen::RevokedCertParams {
                    serial_number: rcgen::SerialNumber::from(*n),
                    revocation_time: rcgen::date_time_ymd(2024, 1, 1),
                    reason_code: Some(rcgen::RevocationReason::KeyCompromise),
                    invalidity_date: None,
                })
                .collect(),
            key_identifier_method: rcgen::KeyIdMethod::Sha256,
        };
        params.signed_by(&self.issuer()).expect("a CRL").pem().expect("PEM")
    }
}

impl ClientId {
    /// SHA-256 of the certificate, lowercase hex, as the proxy computes it.
    fn fingerprint(&self) -> String {
        let suite = rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256.tls13().expect("a TLS 1.3 suite");
        suite.common.hash_provider.hash(self.der.as_ref()).as_ref().iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// A client's TLS settings: the server verified against `server_ca`,
/// `id` presented when given, ALPN `h2` or `http/1.1`. Sessions are kept
/// for resumption by the connections made with the same settings.
fn client_config(server_ca: &Ca, id: Option<&ClientId>, h2: bool) -> Result<Arc<rustls::ClientConfig>, String> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(root_of(server_ca)).map_err(|e| e.to_string())?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots);
    let mut config = match id {
        Some(id) => builder
            .with_client_auth_cert(vec![id.der.clone()], PrivateKeyDer::try_from(id.key_der.clone()).expect("a key"))
            .map_err(|e| e.to_string())?,
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = if h2 { vec![b"h2".to_vec()] } else { vec![b"http/1.1".to_vec()] };
    Ok(Arc::new(config))
}

/// Connects to the TLS listener with `sni`, verifying the server against
/// `server_ca`, presenting `id` when given; then the request on HTTP/1.1
/// (or HTTP/2 when `h2`) with `headers`. `Err` when the handshake or the
/// exchange fails: with TLS 1.3 the server refuses a client certificate
/// after the client thinks the handshake is done, so a refusal may only
/// show when the answer is read.
async fn request(
    server_ca: &Ca,
    tls: SocketAddr,
    sni: &str,
    id: Option<&ClientId>,
    h2: bool,
    path: &str,
    headers: &[(&str, &str)],
) -> Result<(u16, Value), String> {
    let config = client_config(server_ca, id, h2)?;
    request_with(config, tls, sni, h2, path, headers).await.map(|(status, body, _)| (status, body))
}

/// [`request`] with these client settings; also says whether the
/// handshake was a resumption.
async fn request_with(
    config: Arc<rustls::ClientConfig>,
    tls: SocketAddr,
    sni: &str,
    h2: bool,
    path: &str,
    headers: &[(&str, &str)],
) -> Result<(u16, Value, bool), String> {
    let connector = tokio_rustls::TlsConnector::from(config);
    let tcp = TcpStream::connect(tls).await.map_err(|e| e.to_string())?;
    let name = ServerName::try_from(sni.to_string()).expect("a DNS name");
    let exchange = async move {
        let mut s = connector.connect(name, tcp).await.map_err(|e| format!("handshake: {e}"))?;
        let resumed = s.get_ref().1.handshake_kind() == Some(rustls::HandshakeKind::Resumed);
        if h2 {
            let (mut sender, conn) = hyper::client::conn::http2::handshake(
                hyper_util::rt::TokioExecutor::new(),
                hyper_util::rt::TokioIo::new(s),
            )
            .await
            .map_err(|e| format!("h2: {e}"))?;
            tokio::spawn(conn);
            let mut req = http::Request::builder().uri(format!("https://{sni}{path}"));
            for (n, v) in headers {
                req = req.header(*n, *v);
            }
            let req = req.body(http_body_util::Empty::<bytes::Bytes>::new()).expect("a request");
            let resp = sender.send_request(req).await.map_err(|e| format!("h2 request: {e}"))?;
            let status = resp.status().as_u16();
            let body = http_body_util::BodyExt::collect(resp.into_body()).await.map_err(|e| e.to_string())?;
            return Ok((status, serde_json::from_slice(&body.to_bytes()).unwrap_or(Value::Null), resumed));
        }
        let mut req = format!("GET {path} HTTP/1.1\r\nhost: {sni}\r\nconnection: close\r\n");
        for (n, v) in headers {
            req.push_str(&format!("{n}: {v}\r\n"));
        }
        req.push_str("\r\n");
        s.write_all(req.as_bytes()).await.map_err(|e| format!("write: {e}"))?;
        let mut got = Vec::new();
        s.read_to_end(&mut got).await.map_err(|e| format!("read: {e}"))?;
        let text = String::from_utf8_lossy(&got).to_string();
        let (head, body) = text.split_once("\r\n\r\n").ok_or_else(|| format!("no response: {text:?}"))?;
        let status = head.get(9..12).and_then(|s| s.parse().ok()).ok_or_else(|| format!("no status: {head:?}"))?;
        Ok((status, serde_json::from_str(body).unwrap_or(Value::Null), resumed))
    };
    tokio::time::timeout(Duration::from_secs(5), exchange).await.map_err(|_| "timed out".to_string())?
}

/// The certificate of the CA that signs the server's, as a client's root.
fn root_of(ca: &Ca) -> CertificateDer<'static> {
    use rustls::pki_types::pem::PemObject;
    CertificateDer::from_pem_slice(ca.pem().as_bytes()).expect("the CA certificate")
}

async fn put_cert(tg: &Tidegate, name: &str, leaf: &Leaf, client_auth: Option<Value>) -> (u16, Value) {
    let mut spec = json!({ "cert_pem": leaf.cert_pem, "key_pem": leaf.key_pem });
    if let Some(auth) = client_auth {
        spec["client_auth"] = auth;
    }
    tg.api("PUT", &format!("/v1/certificates/{name}"), Some(spec)).await
}

/// Tidegate with a TLS listener (`extra` flags too), an echoing backend,
/// and routes: `open` (`/open`, asks nothing), `strict` (`/strict`,
/// requires a verified certificate and forwards its headers).
async fn start(dir: &std::path::Path, extra: &[&str]) -> (Tidegate, Backend, SocketAddr) {
    let mut args = vec!["--listen-tls", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    let tg = Tidegate::start_with(dir, &args);
    let b = Backend::start("mtls-backend", &[]);
    route_to(&tg, "web", &[&b], "round_robin").await;
    for (name, spec) in [
        ("open", json!({ "match": { "path_prefix": "/open" }, "service": "web" })),
        (
            "strict",
            json!({ "match": { "path_prefix": "/strict" }, "service": "web",
                    "client_cert": { "required": true, "forward_headers": true } }),
        ),
    ] {
        let (s, v) = tg.api("PUT", &format!("/v1/routes/{name}"), Some(spec)).await;
        assert_eq!(s, 200, "{v}");
    }
    let tls = tg.proxy_tls.expect("a TLS listener");
    (tg, b, tls)
}

const SPOOFED: [(&str, &str); 2] =
    [("X-Client-Cert-Subject", "CN=admin"), ("x-client-cert-fingerprint", "0000000000000000")];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn required_client_auth_takes_only_certificates_of_its_ca_and_changes_live() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let (tg, _b, tls) = start(dir.path(), &[]).await;
    let (server_ca, trusted, other) = (Ca::new(), ClientCa::new("Trusted clients"), ClientCa::new("Other clients"));
    let leaf = server_ca.leaf(&["m.example"]);
    let good = trusted.client("alice");
    let stranger = other.client("mallory");

    // No client_auth yet: any client is served, and spoofed headers never
    // reach the backend.
    assert_eq!(put_cert(&tg, "m", &leaf, None).await.0, 200);
    let (status, echo) =
        request(&server_ca, tls, "m.example", None, false, "/open/echo", &SPOOFED).await.expect("served");
    assert_eq!(status, 200, "{echo}");
    assert!(echo["headers"].get("x-client-cert-subject").is_none(), "{echo}");
    assert!(echo["headers"].get("x-client-cert-fingerprint").is_none(), "{echo}");

    // Required, live from the next handshake.
    let auth = json!({ "ca_pem": trusted.pem(), "mode": "required" });
    let (s, v) = put_cert(&tg, "m", &leaf, Some(auth.clone())).await;
    assert_eq!(s, 200, "{v}");
    let refused = request(&server_ca, tls, "m.example", None, false, "/open/echo", &[]).await;
    assert!(refused.is_err(), "no certificate, no exchange: {refused:?}");
    let refused = request(&server_ca, tls, "m.example", Some(&stranger), false, "/open/echo", &[]).await;
    assert!(refused.is_err(), "another CA's certificate fails the handshake: {refused:?}");
    let (status, echo) = request(&server_ca, tls, "m.example", Some(&good), false, "/strict/echo", &SPOOFED)
        .await
        .expect("the CA's certificate is served");
    assert_eq!(status, 200, "{echo}");
    assert_eq!(echo["headers"]["x-client-cert-subject"], "CN=alice", "{echo}");
    assert_eq!(echo["headers"]["x-client-cert-fingerprint"], good.fingerprint(), "{echo}");
    // A route that does not forward them passes none, spoofed or not.
    let (status, echo) =
        request(&server_ca, tls, "m.example", Some(&good), false, "/open/echo", &SPOOFED).await.expect("served");
    assert_eq!(status, 200, "{echo}");
    assert!(echo["headers"].get("x-client-cert-subject").is_none(), "{echo}");

    // The API shows the setting (the CA is not a secret).
    let (s, shown) = tg.api("GET", "/v1/certificates/m", None).await;
    assert_eq!(s, 200, "{shown}");
    let auth_shown = shown.pointer("/certificate/client_auth").cloned();
    assert_eq!(auth_shown, Some(json!({ "ca_pem": trusted.pem(), "mode": "required" })), "{shown}");

    // Another CA, live: the old clients are refused, the new ones served.
    let auth = json!({ "ca_pem": other.pem() });
    assert_eq!(put_cert(&tg, "m", &leaf, Some(auth)).await.0, 200);
    assert!(request(&server_ca, tls, "m.example", Some(&good), false, "/open/echo", &[]).await.is_err());
    let (status, echo) = request(&server_ca, tls, "m.example", Some(&stranger), false, "/strict/echo", &[])
        .await
        .expect("the new CA's client");
    assert_eq!((status, &echo["headers"]["x-client-cert-subject"]), (200, &json!("CN=mallory")), "{echo}");

    // Off again: served without a certificate; the route still requires one.
    assert_eq!(put_cert(&tg, "m", &leaf, None).await.0, 200);
    let (status, _) = request(&server_ca, tls, "m.example", None, false, "/open/echo", &[]).await.expect("served");
    assert_eq!(status, 200);
    let (status, _) = request(&server_ca, tls, "m.example", None, false, "/strict/echo", &[]).await.expect("served");
    assert_eq!(status, 403);

    // A bad bundle is refused naming the field.
    let (s, v) = put_cert(&tg, "m", &leaf, Some(json!({ "ca_pem": "not a certificate" }))).await;
    assert_eq!((s, &v["error"]["field"]), (400, &json!("spec.client_auth.ca_pem")), "{v}");

    // `ctl cert put --client-ca --client-auth --client-crl`, and `ctl cert list` shows
    // the mode; the setting survives an export applied back unchanged.
    let files = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).expect("a file");
        path.to_str().expect("a path").to_string()
    };
    let (cert, key, ca) =
        (files("m.pem", &leaf.cert_pem), files("m.key", &leaf.key_pem), files("ca.pem", &trusted.pem()));
    let crl_text = trusted.crl(&[]);
    let crl = files("ca.crl", &crl_text);
    let put = ["cert", "put", "m", "--cert", &cert, "--key", &key, "--client-ca", &ca, "--client-auth", "optional"];
    let out = tg.ctl(&[&put[..], &["--client-crl", &crl]].concat());
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let out = tg.ctl(&["cert", "list", "-o", "table"]);
    let listed = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        listed.contains("CLIENT AUTH") && listed.lines().any(|l| l.starts_with("m ") && l.contains(" optional ")),
        "{listed}"
    );
    let (status, _) = request(&server_ca, tls, "m.example", None, false, "/open/echo", &[]).await.expect("optional");
    assert_eq!(status, 200);
    let (_, config) = tg.api("GET", "/v1/config", None).await;
    assert_eq!(config["certificates"]["m"]["client_auth"]["mode"], "optional", "{config}");
    assert_eq!(config["certificates"]["m"]["client_auth"]["crl_pem"], crl_text, "{config}");
    let (s, v) = tg.api("PUT", "/v1/config", Some(config)).await;
    assert_eq!((s, v["changes"].clone()), (200, json!([])), "{v}");
}

/// Optional client_auth: clients without a certificate are served, but a
/// route that requires one answers 403, on every engine.
async fn optional_client_auth_leaves_the_choice_to_routes(extra: &[&str]) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let log = dir.path().join("access.log");
    let args = [extra, &["--access-log", log.to_str().expect("a path")]].concat();
    let (tg, _b, tls) = start(dir.path(), &args).await;
    let (server_ca, trusted, other) = (Ca::new(), ClientCa::new("Trusted clients"), ClientCa::new("Other clients"));
    let leaf = server_ca.leaf(&["o.example"]);
    let (s, v) = put_cert(&tg, "o", &leaf, Some(json!({ "ca_pem": trusted.pem(), "mode": "optional" }))).await;
    assert_eq!(s, 200, "{v}");
    let good = trusted.client("bob");
    for h2 in [false, true] {
        let (status, echo) =
            request(&server_ca, tls, "o.example", None, h2, "/open/echo", &SPOOFED).await.expect("served");
        assert_eq!(status, 200, "h2 {h2}: {echo}");
        assert!(echo["headers"].get("x-client-cert-subject").is_none(), "h2 {h2}: {echo}");
        let (status, _) =
            request(&server_ca, tls, "o.example", None, h2, "/strict/echo", &SPOOFED).await.expect("answered");
        assert_eq!(status, 403, "h2 {h2}: a route that requires a certificate");
        let (status, echo) =
            request(&server_ca, tls, "o.example", Some(&good), h2, "/strict/echo", &SPOOFED).await.expect("served");
        assert_eq!(status, 200, "h2 {h2}: {echo}");
        assert_eq!(echo["headers"]["x-client-cert-subject"], "CN=bob", "h2 {h2}: {echo}");
        assert_eq!(echo["headers"]["x-client-cert-fingerprint"], good.fingerprint(), "h2 {h2}: {echo}");
        let refused = request(&server_ca, tls, "o.example", Some(&other.client("eve")), h2, "/open/echo", &[]).await;
        assert!(refused.is_err(), "h2 {h2}: a certificate sent must verify: {refused:?}");
    }
    // A certificate verified for another server name does not satisfy a
    // route whose host's certificate trusts other CAs (SNI one name,
    // Host another).
    let plain = server_ca.leaf(&["p.example"]);
    assert_eq!(put_cert(&tg, "p", &plain, None).await.0, 200);
    let cross = cross_host(&server_ca, tls, &good, "p.example").await;
    assert!(cross.starts_with("HTTP/1.1 403"), "{cross}");

    // The access log names the verified subject, on both protocols.
    let logged = wait_for("the access log has the requests", Duration::from_secs(5), async || {
        let text = std::fs::read_to_string(&log).ok()?;
        let lines: Vec<Value> = text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
        let strict: Vec<(String, u64, Value)> = lines
            .iter()
            .filter(|l| l["path"] == "/strict/echo" && l["host"] != "p.example")
            .map(|l| {
                (
                    l["protocol"].as_str().unwrap_or("").to_string(),
                    l["status"].as_u64().unwrap_or(0),
                    l["client_cert"].clone(),
                )
            })
            .collect();
        (strict.len() >= 4).then_some(strict)
    })
    .await;
    for protocol in ["HTTP/1.1", "HTTP/2.0"] {
        assert!(logged.contains(&(protocol.to_string(), 200, json!("CN=bob"))), "{protocol}: {logged:?}");
        assert!(logged.contains(&(protocol.to_string(), 403, Value::Null)), "{protocol}: {logged:?}");
    }
}

/// Handshakes for `o.example` with `id`, then asks for `/strict/echo` of
/// `host`: the raw response.
async fn cross_host(server_ca: &Ca, tls: SocketAddr, id: &ClientId, host: &str) -> String {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(root_of(server_ca)).expect("root");
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_client_auth_cert(vec![id.der.clone()], PrivateKeyDer::try_from(id.key_der.clone()).expect("a key"))
        .expect("a client certificate");
    let tcp = TcpStream::connect(tls).await.expect("connect");
    let name = ServerName::try_from("o.example").expect("a name");
    let mut s = tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, tcp).await.expect("handshake");
    let req = format!("GET /strict/echo HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.expect("write");
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut got)).await.expect("an answer").expect("read");
    String::from_utf8_lossy(&got).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn optional_client_auth_leaves_the_choice_to_routes_native() {
    optional_client_auth_leaves_the_choice_to_routes(&[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn optional_client_auth_leaves_the_choice_to_routes_hyper() {
    optional_client_auth_leaves_the_choice_to_routes(&["--http1", "hyper"]).await;
}

/// A resumed session keeps the client certificate it was made with (the
/// route still takes it, its headers still reach the backend), and a
/// session made before the setting changed is not resumed under the new
/// one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumed_sessions_keep_their_client_certificate_and_never_skip_a_new_setting() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let (tg, _b, tls) = start(dir.path(), &[]).await;
    let (server_ca, trusted) = (Ca::new(), ClientCa::new("Trusted clients"));
    let leaf = server_ca.leaf(&["r.example"]);
    let optional = json!({ "ca_pem": trusted.pem(), "mode": "optional" });
    assert_eq!(put_cert(&tg, "r", &leaf, Some(optional)).await.0, 200);
    let good = trusted.client("carol");
    for h2 in [false, true] {
        let config = client_config(&server_ca, Some(&good), h2).expect("client settings");
        let (status, _, resumed) =
            request_with(config.clone(), tls, "r.example", h2, "/strict/echo", &[]).await.expect("served");
        assert_eq!((status, resumed), (200, false), "h2 {h2}");
        let (status, echo, resumed) =
            request_with(config.clone(), tls, "r.example", h2, "/strict/echo", &[]).await.expect("served");
        assert!(resumed, "h2 {h2}: the second connection resumes");
        assert_eq!(status, 200, "h2 {h2}: {echo}");
        assert_eq!(echo["headers"]["x-client-cert-fingerprint"], good.fingerprint(), "h2 {h2}: {echo}");
    }
    // Sessions made without a certificate under `optional` do not resume
    // once the certificate demands one.
    let anonymous = client_config(&server_ca, None, false).expect("client settings");
    let (status, _, _) =
        request_with(anonymous.clone(), tls, "r.example", false, "/open/echo", &[]).await.expect("served");
    assert_eq!(status, 200);
    let required = json!({ "ca_pem": trusted.pem(), "mode": "required" });
    assert_eq!(put_cert(&tg, "r", &leaf, Some(required)).await.0, 200);
    let refused = request_with(anonymous, tls, "r.example", false, "/open/echo", &[]).await;
    assert!(refused.is_err(), "no resumption around the new requirement: {refused:?}");
}

/// A revocation list added to a setting refuses the certificates it
/// revokes from the next handshake (sessions made before it do not
/// resume past it); others of the CA are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_client_certificate_is_refused_from_the_next_handshake() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let (tg, _b, tls) = start(dir.path(), &[]).await;
    let (server_ca, trusted) = (Ca::new(), ClientCa::new("Trusted clients"));
    let leaf = server_ca.leaf(&["v.example"]);
    let (revoked, kept) = (trusted.client_numbered("dave", Some(7)), trusted.client_numbered("erin", Some(8)));
    assert_eq!(put_cert(&tg, "v", &leaf, Some(json!({ "ca_pem": trusted.pem() }))).await.0, 200);
    let dave = client_config(&server_ca, Some(&revoked), false).expect("client settings");
    let (status, _, _) = request_with(dave.clone(), tls, "v.example", false, "/open/echo", &[]).await.expect("served");
    assert_eq!(status, 200, "not revoked yet");

    let crl = trusted.crl(&[7]);
    let auth = json!({ "ca_pem": trusted.pem(), "crl_pem": crl });
    let (s, v) = put_cert(&tg, "v", &leaf, Some(auth)).await;
    assert_eq!(s, 200, "{v}");
    let refused = request_with(dave, tls, "v.example", false, "/open/echo", &[]).await;
    assert!(refused.is_err(), "revoked, and its session does not resume: {refused:?}");
    let (status, echo) =
        request(&server_ca, tls, "v.example", Some(&kept), false, "/strict/echo", &[]).await.expect("served");
    assert_eq!((status, &echo["headers"]["x-client-cert-subject"]), (200, &json!("CN=erin")), "{echo}");
    let (_, shown) = tg.api("GET", "/v1/certificates/v", None).await;
    assert_eq!(shown["certificate"]["client_auth"]["crl_pem"], crl, "{shown}");
    let (s, v) = put_cert(&tg, "v", &leaf, Some(json!({ "ca_pem": trusted.pem(), "crl_pem": "nothing" }))).await;
    assert_eq!((s, &v["error"]["field"]), (400, &json!("spec.client_auth.crl_pem")), "{v}");
}
