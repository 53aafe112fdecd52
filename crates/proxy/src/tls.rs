//! TLS termination: a rustls server configuration whose certificate is
//! chosen per handshake from the current snapshot (so a certificate put
//! through the API is served from the next handshake on, with no restart,
//! and established connections keep theirs), with ALPN `h2` and
//! `http/1.1`, TLS 1.2 and 1.3, and session resumption by tickets and by a
//! session cache.

use std::sync::Arc;

use arc_swap::ArcSwap;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
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

/// The server configuration of the TLS listener.
pub(crate) fn server_config(snapshots: Arc<ArcSwap<Snapshot>>) -> std::io::Result<Arc<rustls::ServerConfig>> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(std::io::Error::other)?
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(SniResolver { snapshots }));
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec(), ACME_TLS_ALPN.to_vec()];
    config.session_storage = rustls::server::ServerSessionMemoryCache::new(SESSION_CACHE);
    config.ticketer = rustls::crypto::ring::Ticketer::new().map_err(std::io::Error::other)?;
    Ok(Arc::new(config))
}
