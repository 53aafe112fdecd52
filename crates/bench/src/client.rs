//! A small HTTP/1.1 client over hyper-util's pooled (keep-alive) client.
//!
//! Every request carries a timeout covering the whole exchange (headers and
//! body); failures are values, never panics, so the scenarios can count them.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use anyhow::{bail, Context};
use bytes::Bytes;
use http::header::{AUTHORIZATION, CONTENT_TYPE};
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// An answer: status, `x-backend` header (set by tidegate-emulator), body.
#[derive(Debug)]
pub struct Reply {
    /// Response status.
    pub status: StatusCode,
    /// The `x-backend` header, if any.
    pub backend: Option<String>,
    /// The whole body.
    pub body: Bytes,
}

/// Why a request got no answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// No complete answer within the timeout.
    Timeout,
    /// The connection could not be opened (refused, unreachable).
    Connect,
    /// Reset, closed early, protocol or body error.
    Transport,
}

impl Failure {
    /// A short label for error counts.
    pub fn label(self) -> &'static str {
        match self {
            Failure::Timeout => "timeout",
            Failure::Connect => "connect",
            Failure::Transport => "transport",
        }
    }
}

/// Refuses anything but loopback targets.
pub fn require_loopback(what: &str, addr: SocketAddr) -> anyhow::Result<()> {
    if !addr.ip().is_loopback() {
        bail!("{what} {addr} is not a loopback address; this tool only targets loopback");
    }
    Ok(())
}

/// A pooled keep-alive HTTP/1.1 client to one host.
#[derive(Clone)]
pub struct Http {
    client: Client<HttpConnector, Full<Bytes>>,
    base: String,
    token: Option<String>,
    timeout: Duration,
}

impl Http {
    /// A client for `addr` (which must be loopback), sending
    /// `Authorization: Bearer TOKEN` when a token is given.
    pub fn new(addr: SocketAddr, token: Option<&str>, timeout: Duration) -> anyhow::Result<Http> {
        Http::from_source(addr, token, timeout, None)
    }

    /// The same, its connections bound to the client address `source`
    /// (`None`: the system chooses).
    pub fn from_source(
        addr: SocketAddr,
        token: Option<&str>,
        timeout: Duration,
        source: Option<IpAddr>,
    ) -> anyhow::Result<Http> {
        require_loopback("target", addr)?;
        let mut connector = HttpConnector::new();
        connector.set_local_address(source);
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(timeout));
        let client = Client::builder(TokioExecutor::new()).pool_idle_timeout(Duration::from_secs(30)).build(connector);
        Ok(Http { client, base: format!("http://{addr}"), token: token.map(str::to_owned), timeout })
    }

    /// `GET path`.
    pub async fn get(&self, path: &str) -> Result<Reply, Failure> {
        self.send(Method::GET, path, None).await
    }

    /// `PUT path` with a JSON body.
    pub async fn put_json(&self, path: &str, body: &serde_json::Value) -> Result<Reply, Failure> {
        self.send(Method::PUT, path, Some(body)).await
    }

    /// `POST path` with a JSON body.
    pub async fn post_json(&self, path: &str, body: &serde_json::Value) -> Result<Reply, Failure> {
        self.send(Method::POST, path, Some(body)).await
    }

    async fn send(&self, method: Method, path: &str, json: Option<&serde_json::Value>) -> Result<Reply, Failure> {
        let mut builder = Request::builder().method(method).uri(format!("{}{path}", self.base));
        if let Some(token) = &self.token {
            builder = builder.header(AUTHORIZATION, format!("Bearer {token}"));
        }
        let body = match json {
            Some(value) => {
                builder = builder.header(CONTENT_TYPE, "application/json");
                Bytes::from(serde_json::to_vec(value).map_err(|_| Failure::Transport)?)
            }
            None => Bytes::new(),
        };
        let request = builder.body(Full::new(body)).map_err(|_| Failure::Transport)?;
        let exchange = async {
            let response = self.client.request(request).await.map_err(|e| {
                if e.is_connect() {
                    Failure::Connect
                } else {
                    Failure::Transport
                }
            })?;
            let (parts, body) = response.into_parts();
            let body = body.collect().await.map_err(|_| Failure::Transport)?.to_bytes();
            let backend = parts.headers.get("x-backend").and_then(|v| v.to_str().ok()).map(str::to_owned);
            Ok(Reply { status: parts.status, backend, body })
        };
        match tokio::time::timeout(self.timeout, exchange).await {
            Ok(result) => result,
            Err(_) => Err(Failure::Timeout),
        }
    }
}

/// Checks that an admin call answered 200, for the one-off calls of `setup`
/// and the preconditions of the scenarios.
pub fn expect_ok(what: &str, reply: Result<Reply, Failure>) -> anyhow::Result<Reply> {
    let reply = reply.map_err(|f| anyhow::anyhow!("{what}: {}", f.label()))?;
    if reply.status != StatusCode::OK {
        let body = String::from_utf8_lossy(&reply.body);
        bail!("{what}: HTTP {}: {}", reply.status.as_u16(), body.trim());
    }
    Ok(reply)
}

/// The admin token, required by every scenario that writes.
pub fn token(target: &crate::cli::Target) -> anyhow::Result<&str> {
    target
        .token
        .as_deref()
        .filter(|t| !t.is_empty())
        .context("an admin token is needed: --token or TIDEGATE_ADMIN_TOKEN")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_targets_are_accepted() {
        assert!(require_loopback("x", "127.0.0.1:80".parse().unwrap()).is_ok());
        assert!(require_loopback("x", "127.0.0.2:80".parse().unwrap()).is_ok());
        assert!(require_loopback("x", "[::1]:80".parse().unwrap()).is_ok());
        assert!(require_loopback("x", "10.0.0.1:80".parse().unwrap()).is_err());
    }
}
