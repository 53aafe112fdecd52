//! The HTTPS client instant-acme talks to the CA with: one HTTP/1.1
//! exchange per connection over rustls (ring, as the rest of Tidegate),
//! trusting the Mozilla roots (webpki-roots) and, for a private CA or a
//! test server, the certificates of the `acme` block's `directory_ca_pem`.
//! ACME is a handful of requests per order, so nothing is pooled; every
//! exchange is bounded in time and size.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full, Limited};
use instant_acme::{BodyWrapper, BytesResponse, HttpClient};
use rustls::pki_types::{CertificateDer, ServerName};

/// Longest a request (connect, handshake, exchange) may take.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(30);
/// Largest answer read (a certificate chain is a few KiB).
const MAX_BODY: usize = 1 << 20;

/// An HTTPS client for one directory's CA.
pub(crate) struct Client {
    tls: tokio_rustls::TlsConnector,
}

impl Client {
    /// A client trusting the Mozilla roots and `extra` CA certificates.
    pub(crate) fn new(extra: Option<&[CertificateDer<'static>]>) -> Result<Client, rustls::Error> {
        let mut roots = rustls::RootCertStore { roots: webpki_roots::TLS_SERVER_ROOTS.to_vec() };
        for cert in extra.unwrap_or_default() {
            roots.add(cert.clone())?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Client { tls: tokio_rustls::TlsConnector::from(Arc::new(config)) })
    }
}

/// Why an exchange failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ExchangeError {
    /// The URL cannot be reached over HTTPS.
    #[error("{0} is not an https:// URL with a host")]
    Url(String),
    /// Connecting, the handshake or the exchange failed.
    #[error("{url}: {source}")]
    Io {
        /// The URL asked.
        url: String,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// HTTP failed.
    #[error("{url}: {source}")]
    Http {
        /// The URL asked.
        url: String,
        /// What failed.
        #[source]
        source: hyper::Error,
    },
    /// The answer was larger than [`MAX_BODY`] or its body failed.
    #[error("{0}: the answer's body failed or is larger than 1 MiB")]
    Body(String),
    /// No answer within [`EXCHANGE_TIMEOUT`].
    #[error("{0}: no answer within 30 s")]
    Timeout(String),
}

impl Client {
    async fn exchange(&self, req: Request<BodyWrapper<Bytes>>) -> Result<BytesResponse, ExchangeError> {
        let url = req.uri().to_string();
        let uri = req.uri().clone();
        let (Some("https"), Some(host)) = (uri.scheme_str(), uri.host()) else {
            return Err(ExchangeError::Url(url));
        };
        let host = host.trim_start_matches('[').trim_end_matches(']').to_string();
        let port = uri.port_u16().unwrap_or(443);
        let io = |source| ExchangeError::Io { url: url.clone(), source };
        let tcp = tokio::net::TcpStream::connect((host.as_str(), port)).await.map_err(io)?;
        let _ = tcp.set_nodelay(true);
        let name = ServerName::try_from(host.clone()).map_err(|_| ExchangeError::Url(url.clone()))?;
        let tls = self.tls.connect(name, tcp).await.map_err(io)?;
        let (mut send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
            .await
            .map_err(|source| ExchangeError::Http { url: url.clone(), source })?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let (mut parts, body) = req.into_parts();
        let body = body.collect().await.map(|c| c.to_bytes()).unwrap_or_default();
        // An origin-form target and the Host field, as HTTP/1.1 wants them.
        parts.uri = uri.path_and_query().map_or("/", |p| p.as_str()).parse().unwrap_or_default();
        if let Some(authority) = uri.authority() {
            if let Ok(v) = http::HeaderValue::from_str(authority.as_str()) {
                parts.headers.insert(http::header::HOST, v);
            }
        }
        let resp = send
            .send_request(Request::from_parts(parts, Full::new(body)))
            .await
            .map_err(|source| ExchangeError::Http { url: url.clone(), source })?;
        let (parts, body) = resp.into_parts();
        let body = Limited::new(body, MAX_BODY).collect().await.map_err(|_| ExchangeError::Body(url.clone()))?;
        Ok(BytesResponse { parts, body: Box::new(body.to_bytes()) })
    }
}

impl HttpClient for Client {
    fn request(
        &self,
        req: Request<BodyWrapper<Bytes>>,
    ) -> Pin<Box<dyn Future<Output = Result<BytesResponse, instant_acme::Error>> + Send>> {
        let this = Client { tls: self.tls.clone() };
        Box::pin(async move {
            let url = req.uri().to_string();
            match tokio::time::timeout(EXCHANGE_TIMEOUT, this.exchange(req)).await {
                Ok(Ok(resp)) => Ok(resp),
                Ok(Err(e)) => Err(instant_acme::Error::Other(Box::new(e))),
                Err(_) => Err(instant_acme::Error::Other(Box::new(ExchangeError::Timeout(url)))),
            }
        })
    }
}
