//! How the proxy reaches a service's backends.
//!
//! A service's `upstream` settings compile once, when the service is built
//! into a snapshot, into a [`Profile`]: plain TCP or TLS (with the trusted
//! CAs, the server name, the client certificate if any and the ALPN list
//! already in a rustls client configuration), and the HTTP version to
//! speak. The request path, the
//! health prober and anything else that talks to backends open connections
//! through [`Profile::connect`], so they agree on how a backend is reached.
//! Connections opened under different profiles are never mixed:
//! [`Profile::key`] tells pools apart. A profile that sends the PROXY
//! protocol writes its header first on every connection: naming the
//! request's client ([`Origin`]) on the request path, no client on the
//! prober's.
//!
//! The small HTTP clients that are not requests to a service's backends
//! (node_exporter scrapes, plain Prequal probes, the reference
//! distributor's scrapes, the autoscaler's webhook) share one helper,
//! [`HttpClient`], bounded in time and answer size with typed errors; and
//! [`ErrorChain`] prints any error with its causes.
//!
//! A worker keeps its idle keep-alive connections in a [`pool::UpstreamPool`]
//! per connection type (last in, first out, per backend address and
//! profile, with idle expiry and a grace for a burst's surplus).

pub mod buffers;
mod error_chain;
pub mod h1;
pub mod h2_pool;
mod http_client;
pub mod pool;

pub use error_chain::ErrorChain;
pub use http_client::{parse_http_url, HttpClient, HttpError, HttpOptions};

use std::hash::{Hash, Hasher};
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use tidegate_model::{BackendAddr, Invalid, ProxyProtocolVersion, UpstreamProtocol, UpstreamSpec, UpstreamTls};
use tidegate_proxy_protocol as proxy_protocol;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

/// Why a service's `upstream` settings do not compile.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    /// A setting the model's validation refuses (a CA that is not one, a
    /// bad server name, a client key that does not fit), naming the field.
    #[error(transparent)]
    Invalid(#[from] Invalid),
    /// rustls refused the TLS configuration built from `field`.
    #[error("{field}: {source}")]
    Tls {
        /// The setting at fault (`upstream.tls`, `upstream.tls.ca_pem`).
        field: &'static str,
        /// What rustls said.
        source: rustls::Error,
    },
}

/// How a service's backends are reached, compiled from its `upstream`
/// settings.
#[derive(Clone)]
pub struct Profile {
    protocol: UpstreamProtocol,
    tls: Option<TlsClient>,
    /// The PROXY protocol version written first on every connection.
    proxy_protocol: Option<proxy_protocol::Version>,
    key: u64,
    /// Settings that did not compile: every connect fails with this.
    refused: Option<Arc<str>>,
}

#[derive(Clone)]
struct TlsClient {
    /// Offers ALPN `http/1.1` (HTTP/1.1 services, and upgrades on any).
    http1: TlsConnector,
    /// Offers ALPN `h2`.
    http2: TlsConnector,
    /// The configured server name; else the backend's host.
    sni: Option<ServerName<'static>>,
}

impl std::fmt::Debug for Profile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Profile")
            .field("protocol", &self.protocol)
            .field("tls", &self.tls.is_some())
            .field("proxy_protocol", &self.proxy_protocol)
            .field("key", &self.key)
            .finish()
    }
}

impl Default for Profile {
    /// Plain HTTP/1.1 over TCP.
    fn default() -> Self {
        Profile { protocol: UpstreamProtocol::Http1, tls: None, proxy_protocol: None, key: 0, refused: None }
    }
}

/// The client connection a backend connection is opened for, as a PROXY
/// protocol header names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Origin {
    /// The client's address.
    pub client: SocketAddr,
    /// The address the client connected to.
    pub local: SocketAddr,
}

impl Profile {
    /// Compiles a service's `upstream` settings. Fails only on settings the
    /// model's validation refuses (a CA that is not one, a bad name).
    pub fn build(spec: &UpstreamSpec) -> Result<Profile, ProfileError> {
        let proxy_protocol = spec.proxy_protocol.map(|v| match v {
            ProxyProtocolVersion::V1 => proxy_protocol::Version::V1,
            ProxyProtocolVersion::V2 => proxy_protocol::Version::V2,
        });
        let plain = |key| Profile { protocol: spec.protocol, tls: None, proxy_protocol, key, refused: None };
        let mut hasher = std::hash::DefaultHasher::new();
        (spec.protocol, &spec.tls, spec.proxy_protocol).hash(&mut hasher);
        // 0 and 1 are the plain profiles without the PROXY protocol.
        let key = hasher.finish() | 2;
        let Some(tls) = &spec.tls else {
            return Ok(match (proxy_protocol, spec.protocol) {
                (Some(_), _) => plain(key),
                (None, UpstreamProtocol::Http1) => plain(0),
                (None, UpstreamProtocol::Http2) => plain(1),
            });
        };
        let mut config = client_config(tls)?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let http1 = TlsConnector::from(Arc::new(config.clone()));
        config.alpn_protocols = vec![b"h2".to_vec()];
        let http2 = TlsConnector::from(Arc::new(config));
        let client = TlsClient { http1, http2, sni: tls.server_name()? };
        Ok(Profile { protocol: spec.protocol, tls: Some(client), proxy_protocol, key, refused: None })
    }

    /// A profile for settings that did not compile: it opens no connection
    /// (never falls back to plain TCP where TLS was asked for).
    pub fn refusing(reason: String) -> Profile {
        Profile {
            protocol: UpstreamProtocol::Http1,
            tls: None,
            proxy_protocol: None,
            key: u64::MAX,
            refused: Some(reason.into()),
        }
    }

    /// The HTTP version spoken to the backends.
    pub fn protocol(&self) -> UpstreamProtocol {
        self.protocol
    }

    /// Whether connections start with a PROXY protocol header: then each
    /// carries one client connection's requests only.
    pub fn sends_proxy_protocol(&self) -> bool {
        self.proxy_protocol.is_some()
    }

    /// Whether this is plain HTTP/1.1 over TCP, the default (no TLS, no
    /// PROXY protocol).
    pub fn is_plain_http1(&self) -> bool {
        self.key == 0
    }

    /// Whether connections are TLS.
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// `https` or `http`: the scheme of requests to the backends.
    pub fn scheme(&self) -> &'static str {
        if self.is_tls() {
            "https"
        } else {
            "http"
        }
    }

    /// Equal for profiles that open interchangeable connections; pools keep
    /// connections of different keys apart.
    pub fn key(&self) -> u64 {
        self.key
    }

    /// Opens a connection of the proxy's own to `addr` (a health check, a
    /// probe) for the service's HTTP version (TCP, a PROXY protocol header
    /// naming no client if the service sends it, then the TLS handshake if
    /// any), all within `timeout`.
    pub async fn connect(&self, addr: &BackendAddr, timeout: Duration) -> Result<Stream, ConnectError> {
        self.connect_for(addr, timeout, self.protocol, None).await
    }

    /// Opens a connection to `addr` to speak `protocol` on (over TLS, the
    /// ALPN offer says which): HTTP/1.1 for upgrades, which HTTP/2 does not
    /// carry, whatever the service speaks. A service that sends the PROXY
    /// protocol names `origin` in its header (none when `None`).
    pub async fn connect_for(
        &self,
        addr: &BackendAddr,
        timeout: Duration,
        protocol: UpstreamProtocol,
        origin: Option<Origin>,
    ) -> Result<Stream, ConnectError> {
        if let Some(reason) = &self.refused {
            return Err(ConnectError::Tls(io::Error::new(io::ErrorKind::InvalidInput, reason.to_string())));
        }
        let opening = async {
            let mut tcp = open_tcp(addr).await.map_err(ConnectError::Failed)?;
            if let Some(version) = self.proxy_protocol {
                let header = match origin {
                    Some(o) => proxy_protocol::Header::Proxied { source: o.client, destination: o.local },
                    None => proxy_protocol::Header::Local,
                };
                tcp.write_all(&proxy_protocol::encode(version, &header)).await.map_err(ConnectError::Failed)?;
            }
            let Some(tls) = &self.tls else {
                return Ok(Stream::Plain(tcp));
            };
            let name = match &tls.sni {
                Some(n) => n.clone(),
                None => server_name_of(addr)?,
            };
            let connector = match protocol {
                UpstreamProtocol::Http1 => &tls.http1,
                UpstreamProtocol::Http2 => &tls.http2,
            };
            // Boxed: the handshake's state is large, and inline it would
            // grow every connect's future, plain ones included.
            match Box::pin(connector.connect(name, tcp)).await {
                Ok(s) => Ok(Stream::Tls(Box::new(s))),
                Err(e) => Err(ConnectError::Tls(e)),
            }
        };
        match tokio::time::timeout(timeout, opening).await {
            Ok(Ok(s)) => Ok(s),
            Ok(Err(e)) => {
                tracing::debug!(backend = %addr, error = %e, "connect failed");
                Err(e)
            }
            Err(_) => Err(ConnectError::TimedOut),
        }
    }
}

/// Why a connection to a backend could not be opened.
#[derive(Debug)]
pub enum ConnectError {
    /// The TCP connection was refused or failed.
    Failed(io::Error),
    /// TCP and TLS were not done within the connect timeout.
    TimedOut,
    /// The TLS handshake failed: the certificate was not trusted or does
    /// not name the backend, or the backend does not speak TLS.
    Tls(io::Error),
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnectError::Failed(e) => write!(f, "connect failed: {e}"),
            ConnectError::TimedOut => f.write_str("connect timed out"),
            ConnectError::Tls(e) => write!(f, "TLS handshake failed: {e}"),
        }
    }
}

impl std::error::Error for ConnectError {}

/// The name a backend is checked against by default: its host as written
/// in its address.
fn server_name_of(addr: &BackendAddr) -> Result<ServerName<'static>, ConnectError> {
    let host = match addr.as_str().parse::<SocketAddr>() {
        Ok(sa) => return Ok(ServerName::IpAddress(sa.ip().into())),
        Err(_) => addr.as_str().rsplit_once(':').map_or(addr.as_str(), |(h, _)| h),
    };
    ServerName::try_from(host.to_string()).map_err(|_| {
        ConnectError::Tls(io::Error::new(io::ErrorKind::InvalidInput, format!("{host:?} is not a server name")))
    })
}

/// The Mozilla root program's CAs, loaded once.
fn public_roots() -> &'static rustls::RootCertStore {
    static ROOTS: OnceLock<rustls::RootCertStore> = OnceLock::new();
    ROOTS.get_or_init(|| rustls::RootCertStore { roots: webpki_roots::TLS_SERVER_ROOTS.to_vec() })
}

fn client_config(tls: &UpstreamTls) -> Result<rustls::ClientConfig, ProfileError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|source| ProfileError::Tls { field: "upstream.tls", source })?;
    let verifying = if !tls.verify {
        builder.dangerous().with_custom_certificate_verifier(Arc::new(NoVerification(provider)))
    } else if tls.ca_pem.is_some() {
        let mut roots = rustls::RootCertStore::empty();
        for c in tls.ca_certificates()? {
            roots.add(c).map_err(|source| ProfileError::Tls { field: "upstream.tls.ca_pem", source })?;
        }
        builder.with_root_certificates(roots)
    } else {
        builder.with_root_certificates(public_roots().clone())
    };
    // A key still the placeholder was never resolved (the model resolves
    // it when the change is applied): refused, never sent without it.
    if tls.client_key_pem.as_deref() == Some(tidegate_model::REDACTED) {
        return Err(Invalid::unreadable("upstream.tls.client_key_pem", "the placeholder, not a key").into());
    }
    Ok(match tls.client_identity()? {
        Some(identity) => verifying.with_client_cert_resolver(Arc::new(ClientIdentity(Arc::new(identity)))),
        None => verifying.with_no_client_auth(),
    })
}

/// The client certificate of `upstream.tls`, presented to every backend
/// that asks for one.
#[derive(Debug)]
struct ClientIdentity(Arc<rustls::sign::CertifiedKey>);

impl rustls::client::ResolvesClientCert for ClientIdentity {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _schemes: &[SignatureScheme],
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(self.0.clone())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// `"verify": false`: any certificate is accepted, but the handshake's
/// signatures are still checked (the session is encrypted to whoever holds
/// the presented certificate's key).
#[derive(Debug)]
struct NoVerification(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for NoVerification {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// Opens a TCP connection (directly to an IP address, or after resolving a
/// host name) with Nagle off and TCP keep-alive on.
pub async fn open_tcp(addr: &BackendAddr) -> io::Result<TcpStream> {
    let stream = match addr.as_str().parse::<SocketAddr>() {
        Ok(sa) => TcpStream::connect(sa).await?,
        Err(_) => TcpStream::connect(addr.as_str()).await?,
    };
    stream.set_nodelay(true)?;
    let keepalive = socket2::TcpKeepalive::new().with_time(Duration::from_secs(60));
    socket2::SockRef::from(&stream).set_tcp_keepalive(&keepalive)?;
    Ok(stream)
}

/// A connection to a backend: plain TCP or TLS over it.
#[derive(Debug)]
pub enum Stream {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS over TCP.
    Tls(Box<TlsStream<TcpStream>>),
}

impl Stream {
    /// The TCP connection underneath.
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(s) => s.get_ref().0,
        }
    }

    /// Whether an idle keep-alive connection was closed by the backend (or
    /// broke the protocol): an idle connection has nothing to say, so
    /// anything to read (bytes, the end of the stream, an error) means it
    /// is done. A plain connection answers from the readiness the reactor
    /// already has, with no system call and no waker registered, when it
    /// says not readable (`try_read`); when it says readable, the read
    /// confirms it (the readiness stays set after a read that filled its
    /// buffer, even when that read took the last bytes). A TLS connection
    /// may also receive messages that are not data (TLS 1.3 session
    /// tickets, key updates): when its socket is readable, the records are
    /// read and only data, an alert or the end of the stream count.
    pub fn closed_while_idle(&mut self) -> bool {
        match self {
            // (Bytes read here would be a protocol error anyway: the
            // connection is dropped.)
            Stream::Plain(s) => !matches!(s.try_read(&mut [0u8; 1]), Err(e) if e.kind() == io::ErrorKind::WouldBlock),
            Stream::Tls(s) => {
                let mut cx = Context::from_waker(std::task::Waker::noop());
                if s.get_ref().0.poll_read_ready(&mut cx).is_pending() {
                    return false;
                }
                let mut byte = [0u8; 1];
                let mut buf = ReadBuf::new(&mut byte);
                !Pin::new(s.as_mut()).poll_read(&mut cx, &mut buf).is_pending()
            }
        }
    }

    /// Waits until reading may find something (bytes, the end of the
    /// stream, an error), so that a connection waiting for an answer needs
    /// no read buffer meanwhile. A TLS stream answers at once: it may hold
    /// decrypted bytes that the socket no longer shows.
    ///
    /// Waits in the socket's read waker slot (`poll_read_ready`, the slot a
    /// read uses), not in `TcpStream::readable`'s list of waiters: one
    /// task owns the connection, and the list costs a lock to join and
    /// another to leave on every answer.
    pub async fn readable(&self) -> io::Result<()> {
        match self {
            Stream::Plain(s) => std::future::poll_fn(|cx| s.poll_read_ready(cx)).await,
            Stream::Tls(_) => Ok(()),
        }
    }

    /// Whether the backend chose HTTP/2 by ALPN.
    pub fn negotiated_h2(&self) -> bool {
        match self {
            Stream::Plain(_) => false,
            Stream::Tls(s) => s.get_ref().1.alpn_protocol() == Some(b"h2"),
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Tls(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Plain(s) => s.is_write_vectored(),
            Stream::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(json: &str) -> UpstreamSpec {
        serde_json::from_str(json).expect("an upstream spec")
    }

    #[test]
    fn profiles_that_open_different_connections_have_different_keys() {
        let plain = Profile::build(&UpstreamSpec::default()).unwrap();
        let h2c = Profile::build(&spec(r#"{"protocol":"http2"}"#)).unwrap();
        let tls = Profile::build(&spec(r#"{"tls":{}}"#)).unwrap();
        let tls_h2 = Profile::build(&spec(r#"{"tls":{},"protocol":"http2"}"#)).unwrap();
        let tls_named = Profile::build(&spec(r#"{"tls":{"sni":"api.internal"}}"#)).unwrap();
        let keys = [plain.key(), h2c.key(), tls.key(), tls_h2.key(), tls_named.key()];
        for (i, a) in keys.iter().enumerate() {
            for b in &keys[i + 1..] {
                assert_ne!(a, b);
            }
        }
        assert_eq!(Profile::build(&spec(r#"{"tls":{}}"#)).unwrap().key(), tls.key(), "stable across builds");
        assert_eq!(plain.scheme(), "http");
        assert_eq!(tls.scheme(), "https");
    }

    #[test]
    fn a_client_certificate_compiles_in_and_a_placeholder_key_never_does() {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["client.test".to_string()]).unwrap().self_signed(&key).unwrap();
        let tls = |key_pem: &str| {
            let json = serde_json::json!({"tls": {"client_cert_pem": cert.pem(), "client_key_pem": key_pem}});
            spec(&json.to_string())
        };
        let mutual = Profile::build(&tls(&key.serialize_pem())).unwrap();
        let anonymous = Profile::build(&spec(r#"{"tls":{}}"#)).unwrap();
        assert_ne!(mutual.key(), anonymous.key(), "pools keep their connections apart");
        // The model resolves the placeholder before anything is compiled;
        // one that slips through opens no connection rather than go without.
        let e = Profile::build(&tls(tidegate_model::REDACTED)).err().unwrap();
        assert!(matches!(&e, ProfileError::Invalid(i) if i.field == "upstream.tls.client_key_pem"), "{e:?}");
        assert_eq!(e.to_string(), "upstream.tls.client_key_pem: the placeholder, not a key");
    }

    #[tokio::test]
    async fn an_idle_connection_drained_by_a_full_read_is_not_taken_for_closed() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut conn = Stream::Plain(TcpStream::connect(l.local_addr().unwrap()).await.unwrap());
        let (mut backend, _) = l.accept().await.unwrap();
        backend.write_all(b"0123456789").await.unwrap();
        // A read whose buffer the answer fills exactly: the reactor still
        // takes the socket for readable.
        conn.readable().await.unwrap();
        let Stream::Plain(s) = &mut conn else { unreachable!() };
        let mut answer = [0u8; 10];
        s.read_exact(&mut answer).await.unwrap();
        assert!(!conn.closed_while_idle(), "drained, still open");
        backend.write_all(b"x").await.unwrap();
        conn.readable().await.unwrap();
        assert!(conn.closed_while_idle(), "bytes while idle");
        let mut conn = Stream::Plain(TcpStream::connect(l.local_addr().unwrap()).await.unwrap());
        drop(l.accept().await.unwrap());
        conn.readable().await.unwrap();
        assert!(conn.closed_while_idle(), "closed by the backend");
    }

    #[test]
    fn default_server_names_come_from_the_address() {
        let ip = server_name_of(&BackendAddr::new("127.0.0.1:8443").unwrap()).unwrap();
        assert!(matches!(ip, ServerName::IpAddress(_)));
        let dns = server_name_of(&BackendAddr::new("api.internal:8443").unwrap()).unwrap();
        assert_eq!(dns.to_str(), "api.internal");
    }

    #[tokio::test]
    async fn a_refused_connection_and_a_failed_handshake_are_told_apart() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = BackendAddr::new(&l.local_addr().unwrap().to_string()).unwrap();
        // A listener that speaks no TLS: it closes what it accepts.
        let server = std::thread::spawn(move || {
            if let Ok((s, _)) = l.accept() {
                drop(s);
            }
        });
        let tls = Profile::build(&spec(r#"{"tls":{}}"#)).unwrap();
        let e = tls.connect(&addr, Duration::from_secs(5)).await.unwrap_err();
        assert!(matches!(e, ConnectError::Tls(_)), "{e}");
        server.join().unwrap();
        // A refusal: a port bound and never listening, held to the end (the
        // listener's port, released, could be another test's by now).
        let held = tokio::net::TcpSocket::new_v4().unwrap();
        held.bind(([127, 0, 0, 1], 0).into()).unwrap();
        let addr = BackendAddr::new(&held.local_addr().unwrap().to_string()).unwrap();
        let e = Profile::default().connect(&addr, Duration::from_secs(5)).await.unwrap_err();
        assert!(matches!(e, ConnectError::Failed(_)), "{e}");
    }
}
