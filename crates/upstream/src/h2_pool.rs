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

use bytes::Bytes;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::client::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tidegate_model::{BackendAddr, UpstreamProtocol};

use crate::pool::ConnSettings;
use crate::{ConnectError, Profile};

/// Why an HTTP/2 exchange failed before a response head.
#[derive(Debug, thiserror::Error)]
pub enum H2Error {
    /// No connection could be opened.
    #[error("connecting: {0}")]
    Connect(#[from] ConnectError),
    /// The backend did not agree to HTTP/2 in the TLS handshake (ALPN).
    #[error("the backend did not agree to HTTP/2 (ALPN h2)")]
    NotH2,
    /// The HTTP/2 handshake failed, or a new connection closed before
    /// taking the request.
    #[error("the HTTP/2 connection failed")]
    Closed,
    /// The backend refused the stream (`REFUSED_STREAM`) or left it out of
    /// its GOAWAY: it was not processed (RFC 9113, section 8.7), so it may
    /// go again on a new connection.
    #[error("the backend did not process the stream")]
    Refused,
    /// The exchange failed; `shared`: on a connection that carried other
    /// requests before.
    #[error("HTTP/2 exchange: {error}")]
    Exchange {
        /// hyper's error (its chain may hold the request body's error).
        error: hyper::Error,
        /// The connection was shared already.
        shared: bool,
    },
}

/// A failed exchange, and the request itself when none of it was handed
/// to a connection, so a streamed body can go elsewhere.
#[derive(Debug)]
pub struct H2Unsent<B> {
    /// Why.
    pub error: H2Error,
    /// The request, when it was not sent.
    pub request: Option<Request<B>>,
}

/// How often an HTTP/2 connection pings its backend to find out it died.
const KEEP_ALIVE: Duration = Duration::from_secs(20);

/// A worker's HTTP/2 connections, by profile key and backend address.
pub struct H2Pool<B> {
    conns: Mutex<HashMap<u64, ByAddr<B>, foldhash::fast::RandomState>>,
}

/// The connections of one profile, by backend address.
type ByAddr<B> = HashMap<BackendAddr, http2::SendRequest<B>, foldhash::fast::RandomState>;

impl<B> Default for H2Pool<B> {
    fn default() -> Self {
        H2Pool { conns: Mutex::default() }
    }
}

impl<B> H2Pool<B>
where
    B: http_body::Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    /// The live connection to `addr`, or a new one (always new when
    /// `fresh`); `bool`: whether it was shared already.
    async fn sender(
        &self,
        addr: &BackendAddr,
        profile: &Profile,
        cs: ConnSettings,
        fresh: bool,
    ) -> Result<(http2::SendRequest<B>, bool), H2Error> {
        if !fresh {
            let found = self.conns.lock().ok().and_then(|m| m.get(&cs.profile)?.get(addr).cloned());
            if let Some(s) = found.filter(|s| !s.is_closed()) {
                return Ok((s, true));
            }
        }
        let stream = profile.connect_for(addr, cs.connect, UpstreamProtocol::Http2, None).await?;
        if profile.is_tls() && !stream.negotiated_h2() {
            tracing::debug!(backend = %addr, "the backend did not agree to HTTP/2 (ALPN h2)");
            return Err(H2Error::NotH2);
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
                H2Error::Closed
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
    pub async fn send(
        &self,
        addr: &BackendAddr,
        profile: &Profile,
        cs: ConnSettings,
        mut req: Request<B>,
        fresh: bool,
    ) -> Result<Response<Incoming>, H2Unsent<B>> {
        let mut fresh = fresh;
        loop {
            let (mut sender, shared) = match self.sender(addr, profile, cs, fresh).await {
                Ok(s) => s,
                Err(error) => return Err(H2Unsent { error, request: Some(req) }),
            };
            if sender.ready().await.is_err() {
                if shared {
                    fresh = true;
                    continue;
                }
                return Err(H2Unsent { error: H2Error::Closed, request: Some(req) });
            }
            match sender.try_send_request(req).await {
                Ok(resp) => return Ok(resp),
                Err(mut e) => match e.take_message() {
                    Some(unsent) if shared => {
                        req = unsent;
                        fresh = true;
                    }
                    request => return Err(H2Unsent { error: classify(e.into_error(), shared), request }),
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
fn classify(err: hyper::Error, shared: bool) -> H2Error {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(&err);
    while let Some(e) = source {
        if let Some(h2) = e.downcast_ref::<h2::Error>() {
            let refused = h2.reason() == Some(h2::Reason::REFUSED_STREAM);
            if refused || (h2.is_go_away() && h2.is_remote()) {
                return H2Error::Refused;
            }
        }
        source = e.source();
    }
    H2Error::Exchange { error: err, shared }
}
