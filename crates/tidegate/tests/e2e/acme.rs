//! Managed certificates against a real ACME server on loopback: Debian's
//! `pebble` (its test CA) with `pebble-challtestsrv` as its DNS, both
//! started here. Pebble validates HTTP-01 on Tidegate's plain port and
//! TLS-ALPN-01 on its TLS port, and DNS-01 through the TXT records the
//! certificate's hook sets in challtestsrv.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::*;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// Pebble and its DNS, killed on drop.
pub(crate) struct Pebble {
    children: Vec<Child>,
    /// The ACME directory URL.
    directory: String,
    /// The CA Pebble's own HTTPS is signed by (for `directory_ca_pem`).
    https_ca_pem: String,
    management: SocketAddr,
    /// challtestsrv's management API (DNS records).
    dns_management: SocketAddr,
    /// `https_ca_pem`'s file (for curl).
    https_ca_file: std::path::PathBuf,
    /// Where Pebble logs every request it handles.
    log: std::path::PathBuf,
}

impl Drop for Pebble {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Pebble {
    /// Starts challtestsrv (answering every name with 127.0.0.1) and Pebble,
    /// validating HTTP-01 at `http_port` and TLS-ALPN-01 at `tls_port`.
    pub(crate) async fn start(dir: &Path, http_port: u16, tls_port: u16) -> Pebble {
        Pebble::start_issuing_for(dir, http_port, tls_port, None).await
    }

    /// [`Pebble::start`], issuing certificates valid for `validity_s`
    /// seconds when given (Pebble's default is five years).
    pub(crate) async fn start_issuing_for(
        dir: &Path,
        http_port: u16,
        tls_port: u16,
        validity_s: Option<u64>,
    ) -> Pebble {
        // Pebble's own HTTPS: a CA and a certificate for 127.0.0.1.
        let ca_key = rcgen::KeyPair::generate().expect("key");
        let mut ca_params = rcgen::CertificateParams::new(Vec::new()).expect("params");
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params.distinguished_name.push(rcgen::DnType::CommonName, "pebble https test CA");
        let ca_cert = ca_params.self_signed(&ca_key).expect("CA");
        let issuer = rcgen::Issuer::from_params(&ca_params, &ca_key);
        let key = rcgen::KeyPair::generate().expect("key");
        let params =
            rcgen::CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()]).expect("params");
        let cert = params.signed_by(&key, &issuer).expect("cert");
        std::fs::write(dir.join("pebble-cert.pem"), cert.pem()).expect("write");
        std::fs::write(dir.join("pebble-key.pem"), key.serialize_pem()).expect("write");
        std::fs::write(dir.join("pebble-ca.pem"), ca_cert.pem()).expect("write");
        let (listen, management, dns, dns_management) = (free_port(), free_port(), free_port(), free_port());
        let config = json!({"pebble": {
            "listenAddress": format!("127.0.0.1:{listen}"),
            "managementListenAddress": format!("127.0.0.1:{management}"),
            "certificate": dir.join("pebble-cert.pem"),
            "privateKey": dir.join("pebble-key.pem"),
            "httpPort": http_port,
            "tlsPort": tls_port,
            "ocspResponderURL": "",
            "externalAccountBindingRequired": false,
        }});
        let mut config = config;
        if let Some(v) = validity_s {
            config["pebble"]["certificateValidityPeriod"] = json!(v);
        }
        std::fs::write(dir.join("pebble.json"), config.to_string()).expect("write");
        let quiet = |c: &mut Command| {
            c.stdout(Stdio::null()).stderr(Stdio::null());
        };
        let mut chall = Command::new("pebble-challtestsrv");
        chall.args(["-defaultIPv4", "127.0.0.1", "-defaultIPv6", "", "-http01", "", "-https01", "", "-tlsalpn01", ""]);
        chall.arg("-dns01").arg(format!("127.0.0.1:{dns}"));
        chall.arg("-management").arg(format!("127.0.0.1:{dns_management}"));
        quiet(&mut chall);
        let chall = chall.spawn().expect("pebble-challtestsrv (apt-get install pebble)");
        let mut pebble = Command::new("pebble");
        pebble.arg("-config").arg(dir.join("pebble.json")).arg("-dnsserver").arg(format!("127.0.0.1:{dns}"));
        pebble.env("PEBBLE_VA_NOSLEEP", "1").env("PEBBLE_WFE_NONCEREJECT", "0").env("PEBBLE_AUTHZREUSE", "0");
        let log = std::fs::File::create(dir.join("pebble.log")).expect("pebble's log");
        pebble.stdout(log.try_clone().expect("log")).stderr(log);
        let pebble = pebble.spawn().expect("pebble (apt-get install pebble)");
        let p = Pebble {
            children: vec![chall, pebble],
            directory: format!("https://127.0.0.1:{listen}/dir"),
            https_ca_pem: ca_cert.pem(),
            management: format!("127.0.0.1:{management}").parse().expect("addr"),
            dns_management: format!("127.0.0.1:{dns_management}").parse().expect("addr"),
            https_ca_file: dir.join("pebble-ca.pem"),
            log: dir.join("pebble.log"),
        };
        for port in [listen, management, dns_management] {
            wait_for("pebble and challtestsrv listen", Duration::from_secs(20), async || {
                TcpStream::connect(("127.0.0.1", port)).await.ok().map(|_| ())
            })
            .await;
        }
        p
    }

    /// Orders placed at Pebble so far (its log names each request).
    pub(crate) fn orders(&self) -> usize {
        std::fs::read_to_string(&self.log).unwrap_or_default().matches("POST /order-plz").count()
    }

    /// challtestsrv's management API (DNS records).
    pub(crate) fn dns_management(&self) -> SocketAddr {
        self.dns_management
    }

    /// The root Pebble issues from (made at its start).
    pub(crate) fn root(&self) -> CertificateDer<'static> {
        let out = Command::new("curl")
            .args(["-sf", "--cacert"])
            .arg(&self.https_ca_file)
            .arg(format!("https://127.0.0.1:{}/roots/0", self.management.port()))
            .output()
            .expect("curl");
        assert!(out.status.success(), "fetching Pebble's root: {out:?}");
        let pem = String::from_utf8(out.stdout).expect("PEM");
        rustls::pki_types::pem::PemObject::from_pem_slice(pem.as_bytes()).expect("a root certificate")
    }

    /// An `acme` block for `hosts` with `challenge`.
    pub(crate) fn acme(&self, hosts: &[&str], challenge: &str) -> Value {
        json!({ "hosts": hosts, "directory": self.directory, "challenge": challenge,
            "contact": "mailto:ops@example.com", "directory_ca_pem": self.https_ca_pem })
    }
}

/// A TLS handshake to `addr` for `sni`, verified against `root`; then a
/// GET of `/` whose status line is returned.
pub(crate) async fn get_verified(
    addr: SocketAddr,
    sni: &str,
    root: &CertificateDer<'static>,
) -> std::io::Result<String> {
    get_verified_within(addr, sni, root, Duration::from_secs(5)).await
}

/// [`get_verified`] with a handshake that may take `within`.
async fn get_verified_within(
    addr: SocketAddr,
    sni: &str,
    root: &CertificateDer<'static>,
    within: Duration,
) -> std::io::Result<String> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(root.clone()).map_err(std::io::Error::other)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(std::io::Error::other)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = TcpStream::connect(addr).await?;
    let name = ServerName::try_from(sni.to_string()).map_err(std::io::Error::other)?;
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let mut tls = tokio::time::timeout(within, connector.connect(name, tcp))
        .await
        .map_err(|_| std::io::Error::other("handshake timed out"))??;
    let req = format!("GET / HTTP/1.1\r\nhost: {sni}\r\nconnection: close\r\n\r\n");
    tls.write_all(req.as_bytes()).await?;
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), tls.read_to_end(&mut got))
        .await
        .map_err(|_| std::io::Error::other("no answer"))??;
    Ok(String::from_utf8_lossy(&got).lines().next().unwrap_or_default().to_string())
}

/// The served certificate's DER for `sni` (no verification).
async fn served_der(tg: &Tidegate, sni: &str, root: &CertificateDer<'static>) -> Option<Vec<u8>> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(root.clone()).ok()?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .ok()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = TcpStream::connect(tg.proxy_tls?).await.ok()?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from(sni.to_string()).ok()?, tcp)
        .await
        .ok()?;
    Some(tls.get_ref().1.peer_certificates()?.first()?.to_vec())
}

/// A Tidegate with a TLS listener and a route to a backend, and Pebble
/// validating through its listeners.
async fn setup() -> (tempfile::TempDir, Tidegate, SocketAddr, Backend, Pebble) {
    setup_issuing_for(None).await
}

/// [`setup`] with Pebble issuing certificates valid for `validity_s`.
async fn setup_issuing_for(validity_s: Option<u64>) -> (tempfile::TempDir, Tidegate, SocketAddr, Backend, Pebble) {
    let dir = tempfile::tempdir().expect("tempdir");
    let tg = Tidegate::start_with(&dir.path().join("tg"), &["--listen-tls", "127.0.0.1:0"]);
    let tls = tg.proxy_tls.expect("a TLS listener");
    let backend = Backend::start("acme-backend", &[]);
    route_to(&tg, "web", &[&backend], "round_robin").await;
    let pebble = Pebble::start_issuing_for(dir.path(), tg.proxy.port(), tls.port(), validity_s).await;
    (dir, tg, tls, backend, pebble)
}

/// A client making verified HTTPS requests to `sni` in a loop, each on a
/// new handshake, counting those answered 200 and those that failed.
struct Handshakes {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Handshakes {
    fn start(tls: SocketAddr, sni: &'static str, root: &CertificateDer<'static>) -> Handshakes {
        let stop = Arc::new(AtomicBool::new(false));
        let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let task = {
            let (stop, ok, failed, root) = (stop.clone(), ok.clone(), failed.clone(), root.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    match get_verified(tls, sni, &root).await {
                        Ok(line) if line == "HTTP/1.1 200 OK" => ok.fetch_add(1, Ordering::Relaxed),
                        other => {
                            eprintln!("handshake during renewal: {other:?}");
                            failed.fetch_add(1, Ordering::Relaxed)
                        }
                    };
                }
            })
        };
        Handshakes { stop, ok, failed, task }
    }

    /// Waits for a few more successful handshakes, stops, and asserts that
    /// none failed.
    async fn finish_with_none_failed(self, during: &str) {
        let seen = self.ok.load(Ordering::Relaxed);
        wait_for("more handshakes after the renewal", Duration::from_secs(10), async || {
            (self.ok.load(Ordering::Relaxed) > seen + 5).then_some(())
        })
        .await;
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.expect("the handshake loop");
        let (ok, failed) = (self.ok.load(Ordering::Relaxed), self.failed.load(Ordering::Relaxed));
        assert_eq!(failed, 0, "handshakes failed during {during} ({ok} succeeded)");
    }
}

/// Polls the certificate's view until its ACME status is `status`.
pub(crate) async fn acme_status(tg: &Tidegate, name: &str, status: &str) -> Value {
    wait_for(&format!("certificate {name} is {status}"), Duration::from_secs(90), async || {
        let (_, v) = tg.api("GET", &format!("/v1/certificates/{name}"), None).await;
        (v["certificate"]["acme"]["status"] == status).then_some(v)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_are_issued_through_http01_and_tls_alpn01_served_by_sni_and_renewed_without_a_failed_handshake() {
    let (dir, tg, tls, _backend, pebble) = setup().await;

    // HTTP-01, answered by the plain listener before routing.
    let (s, v) =
        tg.api("PUT", "/v1/certificates/shop", Some(json!({ "acme": pebble.acme(&["shop.test"], "http-01") }))).await;
    assert_eq!(s, 200, "{v}");
    let v = acme_status(&tg, "shop", "valid").await;
    let shown = v.to_string();
    assert!(!shown.contains("PRIVATE KEY") && v["certificate"]["names"] == json!(["shop.test"]), "{v}");
    assert_eq!(v["certificate"]["acme"]["orders"], 1, "{v}");
    assert!(v["certificate"]["acme"]["renew_at"].as_i64() > Some(0), "{v}");
    let root = pebble.root();
    assert_eq!(get_verified(tls, "shop.test", &root).await.unwrap(), "HTTP/1.1 200 OK");
    // The CA is asked for its renewal information about the new
    // certificate; Debian's Pebble (2.4) keeps none, which is recorded so
    // that it is not asked again.
    wait_for("the CA's renewal information is asked", Duration::from_secs(30), async || {
        let (_, v) = tg.api("GET", "/v1/certificates/shop", None).await;
        (v["certificate"]["acme"]["renewal_info"] == json!({"kind": "not_offered"})).then_some(())
    })
    .await;

    // TLS-ALPN-01, answered by the TLS listener's resolver.
    let (s, v) = tg
        .api("PUT", "/v1/certificates/alpn", Some(json!({ "acme": pebble.acme(&["alpn.test"], "tls-alpn-01") })))
        .await;
    assert_eq!(s, 200, "{v}");
    acme_status(&tg, "alpn", "valid").await;
    assert_eq!(get_verified(tls, "alpn.test", &root).await.unwrap(), "HTTP/1.1 200 OK");

    // No read API shows a key or the account; the export gives the acme block alone.
    let (_, config) = tg.api("GET", "/v1/config", None).await;
    let text = config.to_string();
    assert!(!text.contains("PRIVATE KEY") && !text.contains("acme_state"), "{text}");
    assert_eq!(config["certificates"]["shop"]["acme"]["hosts"], json!(["shop.test"]), "{config}");
    // A user cannot write the manager's state.
    let forged = json!({"ops": [{"op": "acme_state", "name": "shop", "state": {}}]});
    let (s, v) = tg.api("POST", "/v1/changes", Some(forged)).await;
    assert_eq!((s, v["error"]["field"].as_str()), (400, Some("ops[0].op")), "{v}");

    // A forced renewal while a client keeps shaking hands: none fails.
    let before = served_der(&tg, "shop.test", &root).await.expect("served");
    let client = Handshakes::start(tls, "shop.test", &root);
    let out = tg.ctl(&["cert", "renew", "shop"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    wait_for("the renewed certificate is served", Duration::from_secs(90), async || {
        served_der(&tg, "shop.test", &root).await.filter(|d| *d != before).map(|_| ())
    })
    .await;
    client.finish_with_none_failed("the forced renewal").await;
    let (_, v) = tg.api("GET", "/v1/certificates/shop", None).await;
    assert_eq!(v["certificate"]["acme"]["orders"], 2, "{v}");
    assert_eq!(pebble.orders(), 3, "Pebble saw the two of shop and the one of alpn");
    assert_eq!(v["certificate"]["acme"]["renewal_requested"], false, "{v}");
    let out = tg.ctl(&["cert", "list", "-o", "table"]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("ACME") && table.contains("valid") && table.contains("shop.test"), "{table}");

    // A host the CA cannot reach: the order fails, the error is shown,
    // and a back-off holds the next one.
    let add_a = json!({"host": "unreachable.test.", "addresses": ["127.0.0.2"]});
    let out = Command::new("curl")
        .args(["-sf", "-d", &add_a.to_string()])
        .arg(format!("http://{}/add-a", pebble.dns_management))
        .output()
        .expect("curl");
    assert!(out.status.success(), "{out:?}");
    let (s, v) = tg
        .api("PUT", "/v1/certificates/bad", Some(json!({ "acme": pebble.acme(&["unreachable.test"], "http-01") })))
        .await;
    assert_eq!(s, 200, "{v}");
    let v = acme_status(&tg, "bad", "failing").await;
    let acme = &v["certificate"]["acme"];
    assert!(acme["last_error"].as_str().is_some_and(|e| e.contains("unreachable.test")), "{v}");
    assert!(acme["retry_at"].as_i64() > Some(0) && acme["failures"] == 1, "{v}");

    // The event log (and the dashboard) tells each order, issuance and
    // failure.
    let kinds_of = async |name: &str| -> Vec<String> {
        let (_, v) = tg.api("GET", "/v1/events", None).await;
        v["events"]
            .as_array()
            .expect("events")
            .iter()
            .filter(|e| e["certificate"] == name)
            .map(|e| e["kind"].as_str().unwrap_or("").to_string())
            .collect()
    };
    let shop = kinds_of("shop").await;
    let count = |k: &str| shop.iter().filter(|x| *x == k).count();
    assert_eq!((count("certificate_ordering"), count("certificate_issued")), (2, 2), "{shop:?}");
    wait_for("the failure is in the event log", Duration::from_secs(10), async || {
        kinds_of("bad").await.contains(&"certificate_failed".to_string()).then_some(())
    })
    .await;

    // Issued certificates are durable: a restart serves them with no new order.
    drop(tg);
    let tg = Tidegate::start_with(&dir.path().join("tg"), &["--listen-tls", "127.0.0.1:0"]);
    let tls = tg.proxy_tls.expect("a TLS listener");
    assert!(get_verified(tls, "shop.test", &root).await.unwrap().starts_with("HTTP/1.1 "), "served after a restart");
    let (_, v) = tg.api("GET", "/v1/certificates/shop", None).await;
    assert_eq!(
        (v["certificate"]["acme"]["status"].as_str(), v["certificate"]["acme"]["orders"].as_u64()),
        (Some("valid"), Some(2)),
        "{v}"
    );
}

/// Renewal by time: Pebble issues certificates valid for 16 s and the
/// certificate renews after half of that; a client shaking hands all along
/// sees the new one served with no failed handshake, and nobody asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_renews_by_itself_when_its_time_comes_without_a_failed_handshake() {
    let (_dir, tg, tls, _backend, pebble) = setup_issuing_for(Some(16)).await;
    let mut acme = pebble.acme(&["soon.test"], "tls-alpn-01");
    acme["renew_after"] = json!(0.5);
    let (s, v) = tg.api("PUT", "/v1/certificates/soon", Some(json!({ "acme": acme }))).await;
    assert_eq!(s, 200, "{v}");
    let v = acme_status(&tg, "soon", "valid").await;
    let issued = std::time::Instant::now();
    let acme = &v["certificate"]["acme"];
    let (renew_at, not_after) = (acme["renew_at"].as_i64().unwrap(), v["certificate"]["not_after"].as_i64());
    assert!(not_after.is_some_and(|t| renew_at < t), "renews before it expires: {v}");
    let root = pebble.root();
    let before = served_der(&tg, "soon.test", &root).await.expect("served");
    let client = Handshakes::start(tls, "soon.test", &root);
    wait_for("the certificate renewed by time is served", Duration::from_secs(60), async || {
        served_der(&tg, "soon.test", &root).await.filter(|d| *d != before).map(|_| ())
    })
    .await;
    client.finish_with_none_failed("the renewal by time").await;
    let (_, v) = tg.api("GET", "/v1/certificates/soon", None).await;
    let acme = &v["certificate"]["acme"];
    // Renewed when half its life is over, not again and again: one order
    // per 8 s at most since the first (a margin for the rounding of
    // seconds and the jitter).
    let most = 2 + issued.elapsed().as_secs() / 6;
    assert!(acme["orders"].as_u64().is_some_and(|n| (2..=most).contains(&n)), "at most {most} orders: {v}");
    assert_eq!((acme["renewal_requested"].as_bool(), acme["failures"].as_u64()), (Some(false), Some(0)), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wildcard_is_issued_through_dns01_with_a_hook() {
    let (dir, tg, tls, _backend, pebble) = setup().await;
    // The hook talks to challtestsrv's management API, as a DNS provider's would.
    let hook = dir.path().join("dns-hook");
    let log = dir.path().join("dns-hook.log");
    let script = format!(
        "#!/bin/sh\necho \"$@\" >> {log}\ncase \"$1\" in\n  set) curl -sf -d \"{{\\\"host\\\":\\\"$2\\\",\\\"value\\\":\\\"$3\\\"}}\" http://{m}/set-txt ;;\n  clear) curl -sf -d \"{{\\\"host\\\":\\\"$2\\\"}}\" http://{m}/clear-txt ;;\nesac\n",
        log = log.display(),
        m = pebble.dns_management
    );
    std::fs::write(&hook, script).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&hook, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut acme = pebble.acme(&["*.wild.test"], "dns-01");
    acme["dns_hook"] = json!({ "command": [hook] });
    let (s, v) = tg.api("PUT", "/v1/certificates/wild", Some(json!({ "acme": acme }))).await;
    assert_eq!(s, 200, "{v}");
    let v = acme_status(&tg, "wild", "valid").await;
    assert_eq!(v["certificate"]["names"], json!(["*.wild.test"]), "{v}");
    let root = pebble.root();
    assert_eq!(get_verified(tls, "anything.wild.test", &root).await.unwrap(), "HTTP/1.1 200 OK");
    let calls = std::fs::read_to_string(&log).unwrap();
    assert!(
        calls.contains("set _acme-challenge.wild.test. ") && calls.contains("clear _acme-challenge.wild.test. "),
        "{calls}"
    );
    // A wildcard needs dns-01: refused with the field at fault.
    let (s, v) =
        tg.api("PUT", "/v1/certificates/w2", Some(json!({ "acme": pebble.acme(&["*.other.test"], "http-01") }))).await;
    assert_eq!((s, v["error"]["field"].as_str()), (400, Some("spec.acme.hosts[0]")), "{v}");
}

/// An `ask` endpoint: 200 for names starting with `allowed`, 403 for any
/// other; counts the questions per name.
async fn ask_server() -> (SocketAddr, Arc<std::sync::Mutex<std::collections::HashMap<String, u32>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let seen = Arc::new(std::sync::Mutex::new(std::collections::HashMap::new()));
    let counts = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let counts = counts.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 2048];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let text = String::from_utf8_lossy(&head).to_string();
                let domain = text.split_once("domain=").map_or("", |(_, r)| r.split([' ', '&']).next().unwrap_or(""));
                *counts.lock().expect("counts").entry(domain.to_string()).or_insert(0) += 1;
                let status = if domain.starts_with("allowed") { "200 OK" } else { "403 Forbidden" };
                let answer = format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
                let _ = conn.write_all(answer.as_bytes()).await;
            });
        }
    });
    (addr, seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_demand_issues_for_an_allowed_name_in_its_first_handshake_and_a_flood_of_refused_names_orders_nothing() {
    let (_dir, tg, tls, _backend, pebble) = setup().await;
    let (ask, asked) = ask_server().await;
    let mut acme = pebble.acme(&[], "tls-alpn-01");
    acme["on_demand"] = json!({ "ask": format!("http://{ask}/check") });
    let (s, v) = tg.api("PUT", "/v1/certificates/customers", Some(json!({ "acme": acme }))).await;
    assert_eq!(s, 200, "{v}");
    let (_, v) = tg.api("GET", "/v1/certificates/customers", None).await;
    assert_eq!(v["certificate"]["acme"]["status"], "on_demand", "{v}");

    // A flood of made-up names the ask endpoint refuses, while a normal
    // client keeps being served: no order, one question per name.
    let normal = Requests::start(tg.url("/"));
    let root = pebble.root();
    let mut flood = Vec::new();
    for worker in 0..20 {
        let root = root.clone();
        flood.push(tokio::spawn(async move {
            let mut refused = 0;
            for i in 0..50 {
                let name = format!("r{worker}x{i}.test");
                if get_verified(tls, &name, &root).await.is_err() {
                    refused += 1;
                }
            }
            refused
        }));
    }
    let mut refused = 0;
    for f in flood {
        refused += f.await.unwrap();
    }
    assert_eq!(refused, 1000, "no handshake for a refused name succeeds");
    // The same names again: answered from the kept answers.
    for i in 0..20 {
        assert!(get_verified(tls, &format!("r0x{i}.test"), &root).await.is_err());
    }
    let (ok, failed) = normal.stop().await;
    assert_eq!(failed, 0, "the normal client failed ({ok} served)");
    {
        let asked = asked.lock().unwrap();
        assert_eq!(asked.len(), 1000, "every name was asked about");
        assert!(asked.values().all(|n| *n == 1), "a name asked about twice: {:?}", asked.iter().find(|(_, n)| **n > 1));
    }
    assert_eq!(pebble.orders(), 0, "a refused name costs no order");
    let (_, v) = tg.api("GET", "/v1/certificates", None).await;
    assert_eq!(v["certificates"].as_object().map(|c| c.len()), Some(1), "{v}");

    // An allowed name: its first handshake completes with a valid certificate.
    let line =
        get_verified_within(tls, "allowed1.test", &root, Duration::from_secs(30)).await.expect("issued on demand");
    assert_eq!(line, "HTTP/1.1 200 OK");
    assert_eq!(pebble.orders(), 1);
    let v = acme_status(&tg, "customers.allowed1.test", "valid").await;
    assert_eq!(v["certificate"]["names"], json!(["allowed1.test"]), "{v}");
    assert_eq!(asked.lock().unwrap().get("allowed1.test"), Some(&1));
}
