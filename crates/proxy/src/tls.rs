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
        let found = self.snapshots.load().certificates().resolve(hello.server_name());
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

/// The TLS listener's handshakes: shared by every worker.
pub(crate) struct TlsFront {
    snapshots: Arc<ArcSwap<Snapshot>>,
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
    pub(crate) fn new(snapshots: Arc<ArcSwap<Snapshot>>) -> std::io::Result<TlsFront> {
        let plain = server_config(&snapshots, None)?;
        Ok(TlsFront { snapshots, plain, verifying: Mutex::new(HashMap::new()) })
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
    let mut config = builder.with_cert_resolver(Arc::new(SniResolver { snapshots: snapshots.clone() }));
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    config.session_storage = rustls::server::ServerSessionMemoryCache::new(SESSION_CACHE);
    config.ticketer = rustls::crypto::ring::Ticketer::new().map_err(std::io::Error::other)?;
    Ok(Arc::new(config))
}
