//! The HTTPS client instant-acme talks to the CA with: one HTTP/1.1
//! exchange per connection over rustls (ring, as the rest of Tidegate),
//! trusting the Mozilla roots (webpki-roots) and, for a private CA or a
//! test server, the certificates of the `acme` block's `directory_ca_pem`.
//! ACME is a handful of requests per order, so nothing is pooled; every
//! exchange is bounded in time and size.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

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
    hint: RetryHint,
}

/// The time the CA's last error answer (a rate limit, an outage: 429 or
/// 503, RFC 8555 section 6.6) asked the client to wait for, from its
/// `Retry-After`. instant-acme reports the error but not the header; the
/// client the ACME manager gives it notes it here, so that the next order
/// waits at least that long.
#[derive(Clone, Default)]
pub(crate) struct RetryHint(Arc<Mutex<Option<SystemTime>>>);

impl RetryHint {
    /// Seconds still to wait from now, if the CA asked for a wait.
    pub(crate) fn seconds(&self) -> Option<u64> {
        let until = (*self.0.lock().unwrap_or_else(|e| e.into_inner()))?;
        Some(until.duration_since(SystemTime::now()).map_or(0, |d| d.as_secs()))
    }

    fn note(&self, status: http::StatusCode, headers: &http::HeaderMap) {
        if !(status.is_client_error() || status.is_server_error()) {
            return;
        }
        let Some(until) = headers
            .get(http::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| retry_after(v, SystemTime::now()))
        else {
            return;
        };
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(until);
    }
}

/// A `Retry-After` value (RFC 9110 section 10.2.3: seconds, or an HTTP
/// date) as the time it names, from `now`.
fn retry_after(value: &str, now: SystemTime) -> Option<SystemTime> {
    let value = value.trim();
    match value.parse::<u64>() {
        Ok(seconds) => now.checked_add(Duration::from_secs(seconds)),
        Err(_) => httpdate::parse_http_date(value).ok(),
    }
}

impl Client {
    /// A client trusting the Mozilla roots and `extra` CA certificates,
    /// noting the CA's `Retry-After` on errors in `hint`.
    pub(crate) fn new(extra: Option<&[CertificateDer<'static>]>, hint: RetryHint) -> Result<Client, rustls::Error> {
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
        Ok(Client { tls: tokio_rustls::TlsConnector::from(Arc::new(config)), hint })
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
        self.hint.note(parts.status, &parts.headers);
        let body = Limited::new(body, MAX_BODY).collect().await.map_err(|_| ExchangeError::Body(url.clone()))?;
        Ok(BytesResponse { parts, body: Box::new(body.to_bytes()) })
    }
}

impl HttpClient for Client {
    fn request(
        &self,
        req: Request<BodyWrapper<Bytes>>,
    ) -> Pin<Box<dyn Future<Output = Result<BytesResponse, instant_acme::Error>> + Send>> {
        let this = Client { tls: self.tls.clone(), hint: self.hint.clone() };
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_takes_seconds_or_a_date() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        assert_eq!(retry_after("120", now), Some(now + Duration::from_secs(120)));
        assert_eq!(retry_after(" 0 ", now), Some(now));
        let date = retry_after("Sun, 06 Nov 1994 08:49:37 GMT", now).unwrap();
        assert_eq!(date.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs(), 784_111_777);
        assert_eq!(retry_after("soon", now), None);
        assert_eq!(retry_after("-5", now), None);
    }

    /// The real client against a CA on loopback that answers 429 with a
    /// `Retry-After`, as Let's Encrypt does at a rate limit.
    #[tokio::test]
    async fn a_cas_retry_after_on_an_error_answer_is_noted() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap().self_signed(&key).unwrap();
        let der = cert.der().clone();
        let key_der = rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let server = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![der.clone()], key_der)
            .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            let mut tls = acceptor.accept(tcp).await.unwrap();
            let mut head = Vec::new();
            let mut buf = [0u8; 1024];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = tls.read(&mut buf).await.unwrap();
                assert!(n > 0, "the request ended early");
                head.extend_from_slice(&buf[..n]);
            }
            let body = r#"{"type":"urn:ietf:params:acme:error:rateLimited","detail":"too many orders"}"#;
            let answer = format!(
                "HTTP/1.1 429 Too Many Requests\r\nretry-after: 120\r\ncontent-type: application/problem+json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            tls.write_all(answer.as_bytes()).await.unwrap();
            tls.shutdown().await.unwrap();
        });
        let hint = RetryHint::default();
        let client = Client::new(Some(&[der]), hint.clone()).unwrap();
        let req =
            Request::get(format!("https://127.0.0.1:{port}/acme/new-order")).body(BodyWrapper::default()).unwrap();
        let resp = client.request(req).await.unwrap();
        assert_eq!(resp.parts.status, http::StatusCode::TOO_MANY_REQUESTS);
        assert!(hint.seconds().is_some_and(|s| (110..=120).contains(&s)), "{:?}", hint.seconds());
    }

    #[test]
    fn only_error_answers_set_the_hint() {
        let hint = RetryHint::default();
        let mut headers = http::HeaderMap::new();
        headers.insert(http::header::RETRY_AFTER, http::HeaderValue::from_static("3600"));
        hint.note(http::StatusCode::OK, &headers);
        assert_eq!(hint.seconds(), None, "a poll's Retry-After is not a back-off");
        hint.note(http::StatusCode::TOO_MANY_REQUESTS, &headers);
        assert!(hint.seconds().is_some_and(|s| (3_590..=3_600).contains(&s)), "{:?}", hint.seconds());
        hint.note(http::StatusCode::SERVICE_UNAVAILABLE, &http::HeaderMap::new());
        assert!(hint.seconds().is_some(), "an error without the header keeps the last one");
    }
}
