//! HTTP/2 to backends (`"upstream": {"protocol": "http2"}`): each worker
//! keeps one multiplexed connection per backend and profile, shared by all
//! its requests to that backend (over TLS with ALPN `h2`, or cleartext with
//! prior knowledge). Bodies stream both ways with flow control, and
//! trailers pass through, so gRPC works end to end.
//!
//! The in-flight accounting is the attempt loop's, as for HTTP/1.1: a
//! request holds its slot until its response body ends, whichever
//! connection carries it.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use http::header::{self, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, Response, Uri, Version};
use hyper::body::Incoming;
use hyper::client::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tidegate_balance::Backend;
use tidegate_model::{BackendAddr, UpstreamProtocol};
use tidegate_upstream::Profile;

use crate::error::ErrorKind;
use crate::hyper_conn::{connect, Unsent};
use crate::upbody::UpBody;
use crate::upstream_error::classify_upstream;
use tidegate_upstream::pool::ConnSettings;

/// The sending half of a shared HTTP/2 connection.
type Sender = http2::SendRequest<UpBody>;

/// How often an HTTP/2 connection pings its backend to find out it died.
const KEEP_ALIVE: Duration = Duration::from_secs(20);

/// A worker's HTTP/2 connections, by profile key and backend address.
#[derive(Default)]
pub(crate) struct H2Pool {
    conns: Mutex<HashMap<u64, HashMap<BackendAddr, Sender, foldhash::fast::RandomState>, foldhash::fast::RandomState>>,
}

impl H2Pool {
    /// The live connection to `addr`, or a new one (always new when
    /// `fresh`); `bool`: whether it was shared already.
    async fn sender(
        &self,
        addr: &BackendAddr,
        profile: &Profile,
        cs: ConnSettings,
        fresh: bool,
    ) -> Result<(Sender, bool), ErrorKind> {
        if !fresh {
            let found = self.conns.lock().ok().and_then(|m| m.get(&cs.profile)?.get(addr).cloned());
            if let Some(s) = found.filter(|s| !s.is_closed()) {
                return Ok((s, true));
            }
        }
        let stream = connect(addr, profile, cs, UpstreamProtocol::Http2).await?;
        if profile.is_tls() && !stream.negotiated_h2() {
            tracing::debug!(backend = %addr, "the backend did not agree to HTTP/2 (ALPN h2)");
            return Err(ErrorKind::UpstreamTls);
        }
        let (sender, conn) = http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .keep_alive_interval(KEEP_ALIVE)
            .keep_alive_timeout(KEEP_ALIVE)
            .adaptive_window(true)
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|e| {
                tracing::debug!(backend = %addr, error = %e, "HTTP/2 handshake failed");
                ErrorKind::UpstreamClosed
            })?;
        let backend = addr.clone();
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(%backend, error = %e, "HTTP/2 connection ended");
            }
        });
        if let Ok(mut m) = self.conns.lock() {
            m.entry(cs.profile).or_default().insert(addr.clone(), sender.clone());
        }
        Ok((sender, false))
    }

    /// Sends `req` and waits for the response head. A shared connection
    /// that turns out closed (the backend went away or sent GOAWAY) before
    /// the request was handed to it is replaced by a new one at once.
    pub(crate) async fn send(
        &self,
        backend: &Backend,
        profile: &Profile,
        cs: ConnSettings,
        mut req: Request<UpBody>,
        fresh: bool,
    ) -> Result<Response<Incoming>, Unsent> {
        let mut fresh = fresh;
        loop {
            let (mut sender, shared) = match self.sender(&backend.addr, profile, cs, fresh).await {
                Ok(s) => s,
                Err(kind) => return Err(Unsent { kind, request: Some(req) }),
            };
            if sender.ready().await.is_err() {
                if shared {
                    fresh = true;
                    continue;
                }
                return Err(Unsent { kind: ErrorKind::UpstreamClosed, request: Some(req) });
            }
            match sender.try_send_request(req).await {
                Ok(resp) => return Ok(resp),
                Err(mut e) => match e.take_message() {
                    Some(unsent) if shared => {
                        req = unsent;
                        fresh = true;
                    }
                    request => return Err(Unsent { kind: classify_h2(e.error(), shared), request }),
                },
            }
        }
    }
}

/// Classifies a failed HTTP/2 exchange. A stream the backend refused
/// (`REFUSED_STREAM`) or left out of its GOAWAY (a backend closing the
/// connection after its request limit, or shutting down, names the last
/// stream it processes) was not processed (RFC 9113, section 8.7), so it
/// may go again on a new connection (the retry rules of a stale keep-alive
/// connection apply).
fn classify_h2(err: &hyper::Error, shared: bool) -> ErrorKind {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(err);
    while let Some(e) = source {
        if let Some(h2) = e.downcast_ref::<h2::Error>() {
            let refused = h2.reason() == Some(h2::Reason::REFUSED_STREAM);
            if refused || (h2.is_go_away() && h2.is_remote()) {
                return ErrorKind::StaleConnection;
            }
        }
        source = e.source();
    }
    classify_upstream(err, shared)
}

/// The request as an HTTP/2 backend gets it: an absolute URI (the
/// `:scheme` and `:authority` pseudo-headers) instead of `Host`, and
/// `te: trailers` when the client asked for trailers (gRPC does; every
/// other hop-by-hop field is gone already).
pub(crate) fn request(
    parts: &http::request::Parts,
    backend: &Backend,
    scheme: &'static str,
    path_and_query: &PathAndQuery,
    te_trailers: bool,
    body: UpBody,
) -> Result<Request<UpBody>, ErrorKind> {
    let host = parts.headers.get(header::HOST).map(HeaderValue::as_bytes);
    let authority = match host {
        Some(h) => Authority::try_from(h).map_err(|_| ErrorKind::InvalidHost)?,
        None => Authority::try_from(backend.authority.as_str()).map_err(|_| ErrorKind::BadRequest)?,
    };
    let scheme = if scheme == "https" { Scheme::HTTPS } else { Scheme::HTTP };
    let uri = Uri::builder()
        .scheme(scheme)
        .authority(authority)
        .path_and_query(path_and_query.clone())
        .build()
        .map_err(|_| ErrorKind::BadRequest)?;
    let mut req = Request::new(body);
    *req.method_mut() = parts.method.clone();
    *req.uri_mut() = uri;
    *req.version_mut() = Version::HTTP_2;
    let headers = req.headers_mut();
    *headers = parts.headers.clone();
    headers.remove(header::HOST);
    if te_trailers {
        headers.insert(header::TE, HeaderValue::from_static("trailers"));
    }
    Ok(req)
}

/// Whether a `TE` field asks for trailers.
pub(crate) fn wants_trailers(te: &[u8]) -> bool {
    te.split(|b| *b == b',').any(|t| t.trim_ascii().eq_ignore_ascii_case(b"trailers"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn te_trailers_is_recognised_among_others() {
        assert!(wants_trailers(b"trailers"));
        assert!(wants_trailers(b"gzip, Trailers"));
        assert!(!wants_trailers(b"gzip"));
        assert!(!wants_trailers(b""));
    }
}
