//! TLS termination: the settings of each handshake are chosen from the
//! current snapshot once its client hello is read, so a certificate or a
//! `client_auth` put through the API is served from the next handshake
//! on, with no restart, and established connections keep theirs. ALPN `h2`
//! and `http/1.1`, TLS 1.2 and 1.3, and session resumption by tickets and
//! by a session cache.
//!
//! A handshake whose certificate has a `client_auth` gets a server
//! configuration that asks for (`optional`) or demands (`required`) a
//! client certificate signed by its CA bundle. Those configurations are
//! built on first use and kept per setting (mode, CA bundle, revocation
//! lists), each with its own session cache and ticket keys: a session
//! made under one setting never resumes under another (a resumed session
//! skips the client's certificate, and would skip a new requirement with
//! it).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tidegate_model::{ClientAuth, ClientCertificate};
use tidegate_snapshot::Snapshot;

/// Picks the certificate for a client hello from the live snapshot: by SNI
/// name (exact, then `*.` wildcard), else the default certificate. With
/// none, the handshake fails with an alert.
#[derive(Debug)]
struct SniResolver {
    snapshots: Arc<ArcSwap<Snapshot>>,
}

impl ResolvesServerCert for SniResolver {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let snapshot = self.snapshots.load();
        // An ACME TLS-ALPN-01 validation offers `acme-tls/1` alone (RFC
        // 8737): it gets the validation certificate of the order waiting
        // for that name, or no handshake at all.
        if hello.alpn().is_some_and(|mut offered| offered.any(|p| p == ACME_TLS_ALPN)) {
            return snapshot.certificates().tls_alpn01(hello.server_name());
        }
        let found = snapshot.certificates().resolve(hello.server_name());
        if found.is_none() {
            tracing::debug!(sni = ?hello.server_name(), "no certificate for this name and no default");
        }
        found
    }
}

/// The ALPN protocol of ACME TLS-ALPN-01 validations (RFC 8737).
pub(crate) const ACME_TLS_ALPN: &[u8] = b"acme-tls/1";

/// Session tickets and cached sessions a worker keeps for resumption.
const SESSION_CACHE: usize = 4096;

/// A client certificate verified during a connection's handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifiedClient {
    /// What it says of itself, as the headers to backends carry it.
    pub cert: ClientCertificate,
    /// [`ClientAuth::ca_id`] of the setting that verified it: a route that
    /// requires a certificate takes it only when the certificate serving
    /// the request's host trusts the same CAs.
    pub ca_id: [u8; 32],
}

/// What a handshake is served with.
struct Chosen {
    config: Arc<rustls::ServerConfig>,
    /// The setting that verifies the client's certificate, if any.
    client_auth: Option<Arc<ClientAuth>>,
}

/// Certificates issued during a handshake for a server name nobody
/// configured (on-demand TLS): the binary gives the data plane the ACME
/// manager's side of it.
pub trait OnDemandTls: Send + Sync + std::fmt::Debug {
    /// Obtains a certificate for `name` (lowercase, no trailing dot) if its
    /// templates allow it; resolves once one is in the live snapshot
    /// (true), or when the name is refused or the time bounded by the
    /// implementation runs out (false).
    fn obtain(&self, name: String) -> std::pin::Pin<Box<dyn std::future::Future<Output = bool> + Send>>;
}

/// The TLS listener's handshakes: shared by every worker.
pub(crate) struct TlsFront {
    snapshots: Arc<ArcSwap<Snapshot>>,
    /// On-demand issuance, when the binary gives it.
    on_demand: Option<Arc<dyn OnDemandTls>>,
    /// The configuration of handshakes that ask for no client certificate.
    plain: Arc<rustls::ServerConfig>,
    /// The configurations that verify client certificates, by setting
    /// (mode, CA bundle, revocation lists); built on first use, dropped
    /// once no certificate has that setting.
    verifying: Mutex<HashMap<Setting, Arc<rustls::ServerConfig>>>,
}

/// A client certificate setting as configurations are kept: its mode,
/// CAs and revocation lists ([`ClientAuth::id`]).
type Setting = [u8; 32];

impl TlsFront {
    /// The TLS front of the listener, on the live snapshot.
    pub(crate) fn new(
        snapshots: Arc<ArcSwap<Snapshot>>,
        on_demand: Option<Arc<dyn OnDemandTls>>,
    ) -> std::io::Result<TlsFront> {
        let plain = server_config(&snapshots, None)?;
        Ok(TlsFront { snapshots, on_demand, plain, verifying: Mutex::new(HashMap::new()) })
    }

    /// Runs the handshake of a client connection: reads its hello, chooses
    /// its settings ([`TlsFront::choose`]), and completes it. Also gives
    /// the client certificate it verified, if any.
    pub(crate) async fn accept<IO>(
        &self,
        io: IO,
    ) -> std::io::Result<(tokio_rustls::server::TlsStream<IO>, Option<Arc<VerifiedClient>>)>
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        let start = tokio_rustls::LazyConfigAcceptor::new(rustls::server::Acceptor::default(), io).await?;
        if let Some(on_demand) = &self.on_demand {
            // A name no certificate serves, with an on-demand template:
            // the handshake waits for the certificate (bounded), an ACME
            // validation (acme-tls/1) never does.
            let hello = start.client_hello();
            let validation = hello.alpn().is_some_and(|mut offered| offered.any(|p| p == ACME_TLS_ALPN));
            let wanted = hello
                .server_name()
                .filter(|name| !validation && self.snapshots.load().certificates().wants_on_demand(name))
                .map(|name| name.trim_end_matches('.').to_ascii_lowercase());
            if let Some(name) = wanted {
                on_demand.obtain(name).await;
            }
        }
        let chosen = self.choose(&start.client_hello())?;
        let stream = start.into_stream(chosen.config).await?;
        let verified = match (chosen.client_auth, stream.get_ref().1.peer_certificates()) {
            (Some(auth), Some([leaf, ..])) => {
                ClientCertificate::read(leaf).map(|cert| Arc::new(VerifiedClient { cert, ca_id: *auth.ca_id() }))
            }
            _ => None,
        };
        Ok((stream, verified))
    }

    /// Chooses a handshake's settings from its client hello: the
    /// certificate its SNI name selects (exact, wildcard, else the
    /// default: [`tidegate_snapshot::Certificates::select`]) decides
    /// whether a client certificate is asked for, and which CAs sign it.
    /// An ACME TLS-ALPN-01 validation (ALPN `acme-tls/1`) is never asked
    /// for one: the CA's validator has none. The one place where a hello
    /// is read before the handshake goes on.
    fn choose(&self, hello: &ClientHello<'_>) -> std::io::Result<Chosen> {
        if hello.alpn().is_some_and(|mut offered| offered.any(|p| p == ACME_TLS_ALPN)) {
            return Ok(Chosen { config: self.plain.clone(), client_auth: None });
        }
        let snapshot = self.snapshots.load();
        let client_auth = snapshot.certificates().select(hello.server_name()).and_then(|s| s.client_auth.clone());
        let Some(auth) = client_auth else {
            return Ok(Chosen { config: self.plain.clone(), client_auth: None });
        };
        let key = *auth.id();
        let mut verifying = self.verifying.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(config) = verifying.get(&key) {
            return Ok(Chosen { config: config.clone(), client_auth: Some(auth) });
        }
        // A new setting: forget those no certificate has any more.
        let live: Vec<_> = snapshot.certificates().client_auths().map(|a| *a.id()).collect();
        verifying.retain(|k, _| live.contains(k));
        let config = server_config(&self.snapshots, Some(&auth))?;
        verifying.insert(key, config.clone());
        Ok(Chosen { config, client_auth: Some(auth) })
    }
}

/// The certificates of the live snapshot, chosen by SNI: the TLS
/// listener's and HTTP/3's.
pub(crate) fn resolver(snapshots: &Arc<ArcSwap<Snapshot>>) -> Arc<dyn rustls::server::ResolvesServerCert> {
    Arc::new(SniResolver { snapshots: snapshots.clone() })
}

/// A server configuration of the TLS listener, verifying client
/// certificates by `client_auth` when given.
fn server_config(
    snapshots: &Arc<ArcSwap<Snapshot>>,
    client_auth: Option<&ClientAuth>,
) -> std::io::Result<Arc<rustls::ServerConfig>> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(std::io::Error::other)?;
    let builder = match client_auth {
        Some(auth) => builder.with_client_cert_verifier(auth.verifier().clone()),
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_cert_resolver(resolver(snapshots));
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec(), ACME_TLS_ALPN.to_vec()];
    config.session_storage = rustls::server::ServerSessionMemoryCache::new(SESSION_CACHE);
    config.ticketer = rustls::crypto::ring::Ticketer::new().map_err(std::io::Error::other)?;
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    use tidegate_model::{parse_change_set, ConfigState};

    /// A CA: its certificate and key.
    fn ca(name: &str) -> (rcgen::Certificate, rcgen::KeyPair, rcgen::CertificateParams) {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        (params.self_signed(&key).unwrap(), key, params)
    }

    /// The CA as the signer of certificates.
    fn issuer(
        ca: &(rcgen::Certificate, rcgen::KeyPair, rcgen::CertificateParams),
    ) -> rcgen::Issuer<'_, &rcgen::KeyPair> {
        rcgen::Issuer::from_params(&ca.2, &ca.1)
    }

    /// The snapshot of one certificate for `m.example` signed by `server`,
    /// asking for client certificates of `clients` when given.
    fn snapshot(
        server: &(rcgen::Certificate, rcgen::KeyPair, rcgen::CertificateParams),
        clients: Option<&rcgen::Certificate>,
    ) -> Snapshot {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["m.example".to_string()])
            .unwrap()
            .signed_by(&key, &issuer(server))
            .unwrap();
        let mut spec = serde_json::json!({ "cert_pem": cert.pem(), "key_pem": key.serialize_pem() });
        if let Some(ca) = clients {
            spec["client_auth"] = serde_json::json!({ "ca_pem": ca.pem() });
        }
        let ops = serde_json::json!({ "ops": [{ "op": "put_certificate", "name": "m", "spec": spec }] });
        let (state, _) =
            ConfigState::default().apply(&parse_change_set(ops.to_string().as_bytes()).unwrap(), 1).unwrap();
        Snapshot::from_state(&state, 1)
    }

    /// One handshake over an in-memory pipe: what the server side made of
    /// it.
    async fn handshake(
        front: &TlsFront,
        server_ca: &rcgen::Certificate,
        id: Option<(&rcgen::Certificate, &rcgen::KeyPair)>,
    ) -> std::io::Result<Option<Arc<VerifiedClient>>> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(server_ca.der().clone()).unwrap();
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots);
        let config = match id {
            Some((cert, key)) => builder
                .with_client_auth_cert(
                    vec![CertificateDer::from(cert.der().to_vec())],
                    PrivateKeyDer::try_from(key.serialize_der()).unwrap(),
                )
                .unwrap(),
            None => builder.with_no_client_auth(),
        };
        let (client_io, server_io) = tokio::io::duplex(64 * 1024);
        let client = async move {
            let name = ServerName::try_from("m.example").unwrap();
            let mut s = tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, client_io).await?;
            // TLS 1.3: the server reads the client's certificate after the
            // client's handshake is done; wait for its verdict.
            use tokio::io::AsyncReadExt;
            let mut byte = [0u8; 1];
            let _ = s.read(&mut byte).await;
            Ok::<_, std::io::Error>(())
        };
        let server = async {
            let accepted = front.accept(server_io).await;
            accepted.map(|(stream, verified)| {
                drop(stream);
                verified
            })
        };
        let (_, verified) = tokio::join!(client, server);
        verified
    }

    #[tokio::test]
    async fn client_certificates_are_verified_by_a_configuration_kept_per_setting() {
        let (server, trusted, other) = (ca("Server CA"), ca("Clients A"), ca("Clients B"));
        let snapshots = Arc::new(ArcSwap::from_pointee(snapshot(&server, Some(&trusted.0))));
        let front = TlsFront::new(snapshots.clone(), None).unwrap();
        let client_key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(rcgen::DnType::CommonName, "alice");
        let alice = params.signed_by(&client_key, &issuer(&trusted)).unwrap();

        let verified = handshake(&front, &server.0, Some((&alice, &client_key))).await.expect("verified");
        let verified = verified.expect("the facts of the certificate");
        assert_eq!(verified.cert.subject, "CN=alice");
        let setting = snapshots.load().certificates().select(Some("m.example")).unwrap().client_auth.clone().unwrap();
        assert_eq!(&verified.ca_id, setting.ca_id());
        assert!(handshake(&front, &server.0, None).await.is_err(), "required: none, no handshake");
        let kept =
            |front: &TlsFront| front.verifying.lock().unwrap().iter().map(|(k, c)| (*k, c.clone())).collect::<Vec<_>>();
        let first = kept(&front);
        assert_eq!(first.len(), 1);
        handshake(&front, &server.0, Some((&alice, &client_key))).await.expect("again");
        let again = kept(&front);
        assert!(Arc::ptr_eq(&first[0].1, &again[0].1), "one configuration for the setting, not one per handshake");

        // Another setting: the one no certificate has any more is dropped.
        snapshots.store(Arc::new(snapshot(&server, Some(&other.0))));
        assert!(handshake(&front, &server.0, Some((&alice, &client_key))).await.is_err(), "another CA");
        let now = kept(&front);
        assert_eq!(now.len(), 1);
        assert_ne!(now[0].0, first[0].0);
        // None asked: the plain configuration, no facts.
        snapshots.store(Arc::new(snapshot(&server, None)));
        assert_eq!(handshake(&front, &server.0, Some((&alice, &client_key))).await.expect("served"), None);
    }
}
