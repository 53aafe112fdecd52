//! A small etcd v3 client for Tidegate's cluster mode.
//!
//! It speaks etcd's JSON gateway (`POST /v3/kv/range`, `/v3/kv/txn`,
//! `/v3/watch`, `/v3/lease/*`, `/v3/auth/authenticate`), which every etcd
//! member of version 3.4 or later serves on its client port, over hyper's
//! HTTP/1.1 client, with rustls for TLS and client certificates. The gRPC
//! clients need `protoc` and a second HTTP stack at build time; this needs
//! neither, and covers what Tidegate uses: consistent ranges, transactions
//! guarded by compares, watches, leases, and user authentication.
//!
//! Members are tried in turn: a request goes to the member that answered
//! last, and moves on to the next when that one cannot be reached. A request
//! that may have reached etcd is never sent twice: a transaction whose
//! answer was lost fails with [`EtcdError::Unavailable`] and the caller
//! decides (its outcome is unknown).

mod wire;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde::de::DeserializeOwned;
use serde_json::json;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use wire::{b64, AuthWire, ErrorWire, KeepAliveWire, LeaseWire, LineDecoder, RangeWire, TxnWire};
pub use wire::{Event, EventKind, KeyValue, WatchResponse};

/// Why a request failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EtcdError {
    /// No member could be reached, or the cluster cannot serve (no leader,
    /// no quorum, a timeout). The request may or may not have taken effect.
    #[error("etcd is unavailable: {0}")]
    Unavailable(String),
    /// etcd refused the request.
    #[error("etcd refused the request: {message} (code {code})")]
    Refused {
        /// The gRPC status code.
        code: i64,
        /// etcd's message.
        message: String,
    },
    /// etcd answered something this client does not understand.
    #[error("unexpected answer from etcd: {0}")]
    Protocol(String),
    /// The client's own settings are wrong (a certificate that does not parse, ...).
    #[error("{0}")]
    Config(String),
}

/// Why a connection to one member could not be opened.
#[derive(Debug, thiserror::Error)]
enum ConnectError {
    /// TCP did not connect within the connect timeout.
    #[error("connect timed out")]
    TimedOut,
    /// TCP failed (refused, unreachable, ...).
    #[error("{0}")]
    Tcp(#[source] std::io::Error),
    /// The endpoint's host is not a name TLS can check.
    #[error("{host}: {source}")]
    ServerName {
        /// The host.
        host: String,
        /// Why it is not a server name.
        source: rustls::pki_types::InvalidDnsNameError,
    },
    /// The TLS handshake did not end within the connect timeout.
    #[error("TLS handshake timed out")]
    TlsTimedOut,
    /// The TLS handshake failed.
    #[error("TLS handshake: {0}")]
    Tls(#[source] std::io::Error),
    /// The HTTP/1.1 handshake failed.
    #[error("{0}")]
    Http(#[source] hyper::Error),
}

/// TLS to the members.
#[derive(Debug, Clone, Default)]
pub struct TlsOptions {
    /// CA certificates (PEM) that sign the members' certificates.
    pub ca_pem: String,
    /// A client certificate chain (PEM), for members that ask for one.
    pub cert_pem: Option<String>,
    /// The client certificate's private key (PEM).
    pub key_pem: Option<String>,
}

/// A user for etcd's authentication.
#[derive(Debug, Clone)]
pub struct Credentials {
    /// The user name.
    pub user: String,
    /// Its password.
    pub password: String,
}

/// How to reach the cluster.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// The members' client addresses, `host:port`.
    pub endpoints: Vec<String>,
    /// TLS settings; plain HTTP without them.
    pub tls: Option<TlsOptions>,
    /// A user, when etcd has authentication enabled.
    pub credentials: Option<Credentials>,
    /// The longest a connection attempt to one member may take.
    pub connect_timeout: Duration,
    /// The longest a request may take, from sending to the whole answer.
    pub request_timeout: Duration,
}

impl ClientOptions {
    /// Plain HTTP to `endpoints`, with default timeouts (1 s to connect, 5 s per request).
    pub fn new(endpoints: Vec<String>) -> ClientOptions {
        ClientOptions {
            endpoints,
            tls: None,
            credentials: None,
            connect_timeout: Duration::from_secs(1),
            request_timeout: Duration::from_secs(5),
        }
    }
}

/// A comparison a transaction is guarded by.
#[derive(Debug, Clone)]
pub enum Compare {
    /// The key exists and holds exactly this value.
    ValueIs(Vec<u8>, Vec<u8>),
    /// The key does not exist.
    Absent(Vec<u8>),
}

/// One write of a transaction.
#[derive(Debug, Clone)]
pub enum TxnOp {
    /// Sets a key, attached to a lease when the id is not 0.
    Put {
        /// The key.
        key: Vec<u8>,
        /// Its value.
        value: Vec<u8>,
        /// A lease id, or 0.
        lease: i64,
    },
    /// Deletes one key.
    Delete(Vec<u8>),
    /// Deletes the keys in `[from, to)`.
    DeleteRange(Vec<u8>, Vec<u8>),
}

/// The outcome of a transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxnOutcome {
    /// The compares held and the writes were made.
    pub succeeded: bool,
    /// The etcd revision after the transaction.
    pub revision: i64,
}

/// Keys read at one revision.
#[derive(Debug, Clone, Default)]
pub struct Range {
    /// The etcd revision the keys were read at.
    pub revision: i64,
    /// The keys, in key order.
    pub kvs: Vec<KeyValue>,
}

/// The end of the range of every key that starts with `prefix`.
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Every byte was 0xff: the range runs to the end of the key space.
    vec![0]
}

type Sender = http1::SendRequest<Full<Bytes>>;

/// A client of one etcd cluster. Cheap to clone; needs a tokio runtime.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

struct Inner {
    options: ClientOptions,
    tls: Option<tokio_rustls::TlsConnector>,
    /// The member requests go to first.
    current: AtomicUsize,
    /// Idle connections, with the member each one goes to.
    idle: Mutex<Vec<(usize, Sender)>>,
    /// The authentication token, once there is one.
    token: Mutex<Option<String>>,
}

/// The most idle connections kept.
const MAX_IDLE: usize = 8;

trait Io: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}

impl Client {
    /// A client for the cluster; connects lazily, on the first request.
    pub fn new(options: ClientOptions) -> Result<Client, EtcdError> {
        if options.endpoints.is_empty() {
            return Err(EtcdError::Config("no etcd endpoint given".into()));
        }
        let tls = options.tls.as_ref().map(tls_connector).transpose()?;
        Ok(Client {
            inner: Arc::new(Inner {
                options,
                tls,
                current: AtomicUsize::new(0),
                idle: Mutex::new(Vec::new()),
                token: Mutex::new(None),
            }),
        })
    }

    /// The members this client knows.
    pub fn endpoints(&self) -> &[String] {
        &self.inner.options.endpoints
    }

    /// Reads every key in `[key, range_end)` (or just `key` without an
    /// end) at one revision, in pages, so a large prefix is never one
    /// huge answer.
    pub async fn range(&self, key: &[u8], range_end: Option<&[u8]>) -> Result<Range, EtcdError> {
        const PAGE: i64 = 5_000;
        let mut out = Range::default();
        let mut from = key.to_vec();
        loop {
            let mut body = json!({ "key": b64(&from), "limit": PAGE });
            if let Some(end) = range_end {
                body["range_end"] = json!(b64(end));
            }
            if out.revision > 0 {
                body["revision"] = json!(out.revision);
            }
            let page: RangeWire = self.call("/v3/kv/range", &body, true).await?;
            out.revision = page.header.revision;
            let more = page.more;
            let last = page.kvs.last().map(|kv| kv.key.clone());
            out.kvs.extend(page.kvs);
            match (more, last, range_end) {
                (true, Some(mut last), Some(_)) => {
                    last.push(0);
                    from = last;
                }
                _ => return Ok(out),
            }
        }
    }

    /// Reads at most `limit` keys of `[key, range_end)`, in key order.
    pub async fn range_limited(&self, key: &[u8], range_end: &[u8], limit: usize) -> Result<Range, EtcdError> {
        let body = json!({ "key": b64(key), "range_end": b64(range_end), "limit": limit });
        let page: RangeWire = self.call("/v3/kv/range", &body, true).await?;
        Ok(Range { revision: page.header.revision, kvs: page.kvs })
    }

    /// The last key of `[key, range_end)` in key order, as the store was at
    /// etcd revision `revision` (0: now).
    pub async fn last_in_range(
        &self,
        key: &[u8],
        range_end: &[u8],
        revision: i64,
    ) -> Result<Option<KeyValue>, EtcdError> {
        let mut body = json!({
            "key": b64(key), "range_end": b64(range_end), "limit": 1,
            "sort_order": "DESCEND", "sort_target": "KEY",
        });
        if revision > 0 {
            body["revision"] = json!(revision);
        }
        let page: RangeWire = self.call("/v3/kv/range", &body, true).await?;
        Ok(page.kvs.into_iter().next())
    }

    /// Reads one key.
    pub async fn get(&self, key: &[u8]) -> Result<(i64, Option<KeyValue>), EtcdError> {
        let r = self.range(key, None).await?;
        Ok((r.revision, r.kvs.into_iter().next()))
    }

    /// Runs `success` if every compare holds; nothing otherwise.
    pub async fn txn(&self, compare: &[Compare], success: &[TxnOp]) -> Result<TxnOutcome, EtcdError> {
        let compare: Vec<_> = compare
            .iter()
            .map(|c| match c {
                Compare::ValueIs(k, v) => json!({"key": b64(k), "result": "EQUAL", "target": "VALUE", "value": b64(v)}),
                Compare::Absent(k) => {
                    json!({"key": b64(k), "result": "EQUAL", "target": "CREATE", "create_revision": 0})
                }
            })
            .collect();
        let success: Vec<_> = success
            .iter()
            .map(|op| match op {
                TxnOp::Put { key, value, lease } => {
                    json!({"request_put": {"key": b64(key), "value": b64(value), "lease": lease}})
                }
                TxnOp::Delete(k) => json!({"request_delete_range": {"key": b64(k)}}),
                TxnOp::DeleteRange(from, to) => {
                    json!({"request_delete_range": {"key": b64(from), "range_end": b64(to)}})
                }
            })
            .collect();
        let body = json!({ "compare": compare, "success": success });
        let r: TxnWire = self.call("/v3/kv/txn", &body, false).await?;
        Ok(TxnOutcome { succeeded: r.succeeded, revision: r.header.revision })
    }

    /// Sets one key (attached to `lease` unless it is 0).
    pub async fn put(&self, key: &[u8], value: &[u8], lease: i64) -> Result<i64, EtcdError> {
        let op = TxnOp::Put { key: key.to_vec(), value: value.to_vec(), lease };
        Ok(self.txn(&[], &[op]).await?.revision)
    }

    /// Deletes one key.
    pub async fn delete(&self, key: &[u8]) -> Result<i64, EtcdError> {
        Ok(self.txn(&[], &[TxnOp::Delete(key.to_vec())]).await?.revision)
    }

    /// Grants a lease of `ttl` seconds; its id.
    pub async fn lease_grant(&self, ttl: Duration) -> Result<i64, EtcdError> {
        let r: LeaseWire = self.call("/v3/lease/grant", &json!({ "TTL": ttl.as_secs().max(1) }), false).await?;
        if !r.error.is_empty() {
            return Err(EtcdError::Refused { code: 0, message: r.error });
        }
        Ok(r.id)
    }

    /// Renews a lease; false when it has already expired.
    pub async fn lease_keep_alive(&self, id: i64) -> Result<bool, EtcdError> {
        let r: KeepAliveWire = self.call("/v3/lease/keepalive", &json!({ "ID": id }), true).await?;
        Ok(r.result.ttl > 0)
    }

    /// Ends a lease now: the keys attached to it are deleted.
    pub async fn lease_revoke(&self, id: i64) -> Result<(), EtcdError> {
        let _: serde_json::Value = self.call("/v3/lease/revoke", &json!({ "ID": id }), true).await?;
        Ok(())
    }

    /// Watches `[key, range_end)` from etcd revision `start` on (0: from
    /// now). The watch has its own connection, for as long as it lives.
    /// A watch ends (with an error) when its member loses the cluster's
    /// leader, so a member cut off from the others cannot hold it silently.
    pub async fn watch(&self, key: &[u8], range_end: Option<&[u8]>, start: i64) -> Result<Watch, EtcdError> {
        let mut body = json!({"create_request": {"key": b64(key), "start_revision": start}});
        if let Some(end) = range_end {
            body["create_request"]["range_end"] = json!(b64(end));
        }
        if self.inner.options.credentials.is_some() {
            self.authenticate().await?;
        }
        let n = self.inner.options.endpoints.len();
        let first = self.inner.current.load(Ordering::Relaxed);
        let mut last_error = String::from("no member could be reached");
        for i in 0..n {
            let member = (first + i) % n;
            let endpoint = &self.inner.options.endpoints[member];
            let mut sender = match self.connect(member).await {
                Ok(s) => s,
                Err(e) => {
                    last_error = format!("{endpoint}: {e}");
                    continue;
                }
            };
            let mut request = self.request("/v3/watch", &body)?;
            // etcd's require-leader flag, as gRPC metadata through the gateway.
            request.headers_mut().insert("grpc-metadata-hasleader", http::HeaderValue::from_static("true"));
            match tokio::time::timeout(self.inner.options.request_timeout, sender.send_request(request)).await {
                Ok(Ok(response)) if response.status().is_success() => {
                    self.inner.current.store(member, Ordering::Relaxed);
                    return Ok(Watch {
                        body: response.into_body(),
                        decoder: LineDecoder::default(),
                        ready: Vec::new(),
                    });
                }
                Ok(Ok(response)) => return Err(error_of(response).await),
                Ok(Err(e)) => last_error = format!("{endpoint}: {e}"),
                Err(_) => last_error = format!("{endpoint}: no answer in time"),
            }
        }
        Err(EtcdError::Unavailable(last_error))
    }

    /// POSTs `body` to `path` and decodes the answer. `idempotent` calls
    /// are retried on another member when the connection fails.
    async fn call<T: DeserializeOwned>(
        &self,
        path: &str,
        body: &serde_json::Value,
        idempotent: bool,
    ) -> Result<T, EtcdError> {
        let mut reauthenticated = false;
        loop {
            match self.call_once(path, body, idempotent).await {
                Err(EtcdError::Refused { message, .. })
                    if !reauthenticated
                        && self.inner.options.credentials.is_some()
                        && (message.contains("invalid auth token") || message.contains("user name is empty")) =>
                {
                    // The token expired (or there was none yet): get one and go again.
                    reauthenticated = true;
                    self.authenticate().await?;
                }
                other => return other,
            }
        }
    }

    async fn call_once<T: DeserializeOwned>(
        &self,
        path: &str,
        body: &serde_json::Value,
        idempotent: bool,
    ) -> Result<T, EtcdError> {
        if self.inner.options.credentials.is_some() && self.token().is_none() && path != "/v3/auth/authenticate" {
            self.authenticate().await?;
        }
        let timeout = self.inner.options.request_timeout;
        let mut attempts = 0;
        loop {
            attempts += 1;
            let (member, mut sender) = self.connection().await?;
            let request = self.request(path, body)?;
            let mut unsent = false;
            let exchange = async {
                let response = sender.send_request(request).await.map_err(|e| {
                    // Canceled: the connection closed before the request was written.
                    unsent = e.is_canceled();
                    EtcdError::Unavailable(e.to_string())
                })?;
                let ok = response.status().is_success();
                if !ok {
                    return Err(error_of(response).await);
                }
                let bytes = response.into_body().collect().await.map_err(|e| EtcdError::Unavailable(e.to_string()))?;
                Ok(bytes.to_bytes())
            };
            match tokio::time::timeout(timeout, exchange).await {
                Ok(Ok(bytes)) => {
                    self.release(member, sender);
                    return serde_json::from_slice(&bytes).map_err(|e| EtcdError::Protocol(format!("{path}: {e}")));
                }
                Ok(Err(EtcdError::Unavailable(e))) => {
                    // The connection broke. A reused one may have been
                    // closed by the member while idle: a read is safe to
                    // repeat, a write only when it cannot have been sent.
                    self.skip(member);
                    let retry = idempotent || unsent;
                    if !retry || attempts > self.inner.options.endpoints.len() {
                        return Err(EtcdError::Unavailable(format!("{}: {e}", self.inner.options.endpoints[member])));
                    }
                }
                Ok(Err(e)) => {
                    self.release(member, sender);
                    return Err(e);
                }
                Err(_) => {
                    self.skip(member);
                    return Err(EtcdError::Unavailable(format!(
                        "{}: no answer within {} ms",
                        self.inner.options.endpoints[member],
                        timeout.as_millis()
                    )));
                }
            }
        }
    }

    fn request(&self, path: &str, body: &serde_json::Value) -> Result<http::Request<Full<Bytes>>, EtcdError> {
        let mut builder = http::Request::post(path)
            .header(http::header::HOST, "etcd")
            .header(http::header::CONTENT_TYPE, "application/json");
        if let Some(token) = self.token() {
            builder = builder.header(http::header::AUTHORIZATION, token);
        }
        let body = serde_json::to_vec(body).map_err(|e| EtcdError::Protocol(e.to_string()))?;
        builder.body(Full::new(Bytes::from(body))).map_err(|e| EtcdError::Protocol(e.to_string()))
    }

    fn token(&self) -> Option<String> {
        self.inner.token.lock().ok().and_then(|t| t.clone())
    }

    async fn authenticate(&self) -> Result<(), EtcdError> {
        let Some(c) = &self.inner.options.credentials else {
            return Ok(());
        };
        let body = json!({ "name": c.user, "password": c.password });
        let r: AuthWire = Box::pin(self.call_once("/v3/auth/authenticate", &body, true)).await?;
        if let Ok(mut t) = self.inner.token.lock() {
            *t = Some(r.token);
        }
        Ok(())
    }

    /// An idle connection, or a new one to the first member that answers.
    async fn connection(&self) -> Result<(usize, Sender), EtcdError> {
        loop {
            let idle = self.inner.idle.lock().ok().and_then(|mut idle| idle.pop());
            match idle {
                Some((member, sender)) if !sender.is_closed() => return Ok((member, sender)),
                Some(_) => continue,
                None => break,
            }
        }
        let mut last_error = String::from("no member could be reached");
        let n = self.inner.options.endpoints.len();
        let first = self.inner.current.load(Ordering::Relaxed);
        for i in 0..n {
            let member = (first + i) % n;
            match self.connect(member).await {
                Ok(sender) => {
                    self.inner.current.store(member, Ordering::Relaxed);
                    return Ok((member, sender));
                }
                Err(e) => last_error = format!("{}: {e}", self.inner.options.endpoints[member]),
            }
        }
        Err(EtcdError::Unavailable(last_error))
    }

    async fn connect(&self, member: usize) -> Result<Sender, ConnectError> {
        let endpoint = &self.inner.options.endpoints[member];
        let tcp = tokio::time::timeout(self.inner.options.connect_timeout, TcpStream::connect(endpoint.as_str()))
            .await
            .map_err(|_| ConnectError::TimedOut)?
            .map_err(ConnectError::Tcp)?;
        let _ = tcp.set_nodelay(true);
        let io: Box<dyn Io> = match &self.inner.tls {
            None => Box::new(tcp),
            Some(tls) => {
                let host = endpoint.rsplit_once(':').map_or(endpoint.as_str(), |(h, _)| h);
                let host = host.trim_start_matches('[').trim_end_matches(']');
                let name = ServerName::try_from(host.to_string())
                    .map_err(|source| ConnectError::ServerName { host: host.to_string(), source })?;
                let stream = tokio::time::timeout(self.inner.options.connect_timeout, tls.connect(name, tcp))
                    .await
                    .map_err(|_| ConnectError::TlsTimedOut)?
                    .map_err(ConnectError::Tls)?;
                Box::new(stream)
            }
        };
        let (sender, connection) = http1::handshake(TokioIo::new(io)).await.map_err(ConnectError::Http)?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(sender)
    }

    fn release(&self, member: usize, sender: Sender) {
        if let Ok(mut idle) = self.inner.idle.lock() {
            if idle.len() < MAX_IDLE && !sender.is_closed() {
                idle.push((member, sender));
            }
        }
    }

    /// Moves on from a member that failed, and forgets its idle connections.
    fn skip(&self, member: usize) {
        let n = self.inner.options.endpoints.len();
        let _ = self.inner.current.compare_exchange(member, (member + 1) % n, Ordering::Relaxed, Ordering::Relaxed);
        if let Ok(mut idle) = self.inner.idle.lock() {
            idle.retain(|(m, _)| *m != member);
        }
    }
}

/// The error an unsuccessful HTTP answer carries.
async fn error_of(response: http::Response<hyper::body::Incoming>) -> EtcdError {
    let status = response.status();
    let body = response.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    match serde_json::from_slice::<ErrorWire>(&body) {
        Ok(e) if e.code != 0 || !e.message.is_empty() || !e.error.is_empty() => e.into_error(),
        _ if status.is_server_error() => EtcdError::Unavailable(format!("HTTP {status}")),
        _ => EtcdError::Protocol(format!("HTTP {status}: {}", String::from_utf8_lossy(&body))),
    }
}

fn tls_connector(tls: &TlsOptions) -> Result<tokio_rustls::TlsConnector, EtcdError> {
    let bad = |what: &str, e: &dyn std::fmt::Display| EtcdError::Config(format!("etcd TLS {what}: {e}"));
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(tls.ca_pem.as_bytes()) {
        roots.add(cert.map_err(|e| bad("CA", &e))?).map_err(|e| bad("CA", &e))?;
    }
    if roots.is_empty() {
        return Err(EtcdError::Config("etcd TLS CA: no certificate in the PEM".into()));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|e| bad("settings", &e))?
        .with_root_certificates(roots);
    let config = match (&tls.cert_pem, &tls.key_pem) {
        (Some(cert), Some(key)) => {
            let chain = CertificateDer::pem_slice_iter(cert.as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| bad("client certificate", &e))?;
            let key = PrivateKeyDer::from_pem_slice(key.as_bytes()).map_err(|e| bad("client key", &e))?;
            builder.with_client_auth_cert(chain, key).map_err(|e| bad("client certificate", &e))?
        }
        (None, None) => builder.with_no_client_auth(),
        _ => {
            return Err(EtcdError::Config(
                "etcd TLS: a client certificate needs its key, and a key its certificate".into(),
            ))
        }
    };
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

/// A live watch: messages in order, until the member or the network ends it.
pub struct Watch {
    body: hyper::body::Incoming,
    decoder: LineDecoder,
    ready: Vec<WatchResponse>,
}

impl Watch {
    /// The next message; `Ok(None)` when the stream ended.
    pub async fn next(&mut self) -> Result<Option<WatchResponse>, EtcdError> {
        loop {
            if !self.ready.is_empty() {
                return Ok(Some(self.ready.remove(0)));
            }
            match self.body.frame().await {
                None => return Ok(None),
                Some(Err(e)) => return Err(EtcdError::Unavailable(format!("the watch broke: {e}"))),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.ready = self.decoder.push(&data)?;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_ends_at_the_next_key() {
        assert_eq!(prefix_end(b"tg/"), b"tg0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
    }

    #[test]
    fn bad_settings_are_refused_at_once() {
        assert!(matches!(Client::new(ClientOptions::new(vec![])), Err(EtcdError::Config(_))));
        let mut o = ClientOptions::new(vec!["127.0.0.1:2379".into()]);
        o.tls = Some(TlsOptions { ca_pem: "not a pem".into(), ..Default::default() });
        assert!(matches!(Client::new(o), Err(EtcdError::Config(m)) if m.contains("CA")));
    }

    #[tokio::test]
    async fn a_member_that_cannot_be_reached_says_why() {
        // Bound, never listening, held to the end: connecting is refused,
        // and no listener of a test running beside can take the port.
        let held = tokio::net::TcpSocket::new_v4().unwrap();
        held.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let closed = held.local_addr().unwrap();
        let client = Client::new(ClientOptions::new(vec![closed.to_string()])).unwrap();
        let e = client.connect(0).await.map(|_| ()).unwrap_err();
        assert!(matches!(&e, ConnectError::Tcp(io) if io.kind() == std::io::ErrorKind::ConnectionRefused), "{e:?}");
        // Every member failed: the request says etcd is unavailable, naming the member.
        match client.connection().await.map(|_| ()) {
            Err(EtcdError::Unavailable(m)) => assert!(m.starts_with(&closed.to_string()), "{m}"),
            other => panic!("{other:?}"),
        }
    }
}
