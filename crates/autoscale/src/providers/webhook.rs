//! The `webhook` provider: an infrastructure service over HTTP, as in paper
//! S1 where a web service on the cloud controller starts and shuts down
//! virtual machines for the middleware.
//!
//! Every request carries `X-Tidegate-Timestamp: <unix seconds>` and
//! `X-Tidegate-Signature: sha256=<hex>`, the HMAC-SHA256, keyed with the
//! shared secret, of `TIMESTAMP "\n" METHOD "\n" PATH_AND_QUERY "\n" BODY`
//! (the exact body, empty for a GET). A receiver recomputes it and refuses
//! a timestamp more than [`REPLAY_WINDOW`] away from its own clock, so a
//! captured request cannot be replayed later, nor sent to another path or
//! with another method. [`signature`] computes it and [`verify_signature`]
//! checks it, for services written in Rust.
//!
//! - start: `POST url` `{"action": "start", "service": S, "id": I}`. The
//!   service answers `200 {"addr": "host:port", "handle": ...}` (handle
//!   optional), or `202 {"poll": URL}` (absolute `http://` or a path on the
//!   same server) when starting takes a while; the provider then GETs that
//!   URL every `poll_interval_ms` until it answers 200 with the address.
//!   `202` means still starting; any other status fails the start;
//!   connection errors while polling are retried. The whole start is
//!   bounded by [`START_TIMEOUT`].
//! - stop: `POST url` `{"action": "stop", "service", "id", "addr", "handle"}`
//!   (handle `null` when there is none); any 2xx is success.
//! - list: `POST url` `{"action": "list", "service"}`; `200` with
//!   `[{"id", "addr", "handle"?}]`, or `404` when listing is not supported
//!   (no instances known).
//! - `alive` cannot tell: `None`.
//!
//! Only `http://` URLs; every request is bounded by [`REQUEST_TIMEOUT`] and
//! answers are read up to 1 MiB.

use std::time::Duration;

use bytes::Bytes;
use hmac::{Hmac, Mac};
use http::header::{CONTENT_TYPE, USER_AGENT};
use http::{Method, Request, StatusCode, Uri};
use http_body_util::Full;
use serde::Deserialize;
use serde_json::json;
use sha2::Sha256;
use tidegate_upstream::{parse_http_url, HttpClient, HttpError, HttpOptions};
use tokio::time::Instant;

use super::{first_line, parse_list, parse_started};
use crate::provider::{BoxFuture, Instance, Provider, ProviderError, ProviderErrorKind, StartRequest};

/// The header that carries the signature.
pub const SIGNATURE_HEADER: &str = "x-tidegate-signature";

/// The header that carries the signing time, in Unix seconds.
pub const TIMESTAMP_HEADER: &str = "x-tidegate-timestamp";

/// How far a request's timestamp may be from the receiver's clock.
pub const REPLAY_WINDOW: Duration = Duration::from_secs(300);

/// The longest a start may take, polling included.
pub const START_TIMEOUT: Duration = Duration::from_secs(120);

/// The longest one request may take.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Answers are read up to this size.
const MAX_ANSWER: usize = 1024 * 1024;

/// What is signed: who asked what, when.
#[derive(Debug, Clone, Copy)]
pub struct Signed<'a> {
    /// Unix seconds when the request was signed.
    pub timestamp: u64,
    /// The request method (`POST`, `GET`).
    pub method: &'a str,
    /// The request's path and query, as sent.
    pub path: &'a str,
    /// The exact body.
    pub body: &'a [u8],
}

fn mac(secret: &[u8], m: &Signed<'_>) -> Option<Hmac<Sha256>> {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).ok()?;
    mac.update(format!("{}\n{}\n{}\n", m.timestamp, m.method, m.path).as_bytes());
    mac.update(m.body);
    Some(mac)
}

/// `sha256=<hex HMAC-SHA256 of the signed message keyed with secret>`.
pub fn signature(secret: &[u8], m: &Signed<'_>) -> String {
    // HMAC takes keys of any length: `mac` cannot fail.
    mac(secret, m).map_or_else(String::new, |mac| format!("sha256={}", hex::encode(mac.finalize().into_bytes())))
}

/// Whether `header` is the signature of `m` with `secret` (compared in
/// constant time) and `m`'s timestamp is within [`REPLAY_WINDOW`] of
/// `now_unix`.
pub fn verify_signature(secret: &[u8], m: &Signed<'_>, header: &str, now_unix: u64) -> bool {
    if m.timestamp.abs_diff(now_unix) > REPLAY_WINDOW.as_secs() {
        return false;
    }
    let Some(Ok(expected)) = header.trim().strip_prefix("sha256=").map(hex::decode) else {
        return false;
    };
    mac(secret, m).is_some_and(|mac| mac.verify_slice(&expected).is_ok())
}

/// The current Unix time in seconds.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// An infrastructure service over HTTP.
pub struct WebhookProvider {
    service: String,
    url: String,
    secret: Vec<u8>,
    poll_interval: Duration,
    start_timeout: Duration,
    client: HttpClient,
}

impl WebhookProvider {
    /// A provider for `service` calling `url` (http://) with requests signed
    /// with `secret`, polling pending starts every `poll_interval_ms`
    /// (clamped to 10 ms..60 s). Needs no runtime to be built.
    pub fn new(service: &str, url: &str, secret: &str, poll_interval_ms: u64) -> Self {
        let client = HttpClient::new(HttpOptions {
            connect_timeout: REQUEST_TIMEOUT,
            idle_per_host: 2,
            idle_timeout: Duration::from_secs(5),
        });
        WebhookProvider {
            service: service.to_string(),
            url: url.to_string(),
            secret: secret.as_bytes().to_vec(),
            poll_interval: Duration::from_millis(poll_interval_ms.clamp(10, 60_000)),
            start_timeout: START_TIMEOUT,
            client,
        }
    }

    fn err(&self, kind: ProviderErrorKind) -> ProviderError {
        ProviderError::new(format!("webhook for {}", self.service), kind)
    }

    /// Sends one signed request; answers its status and body. Bounded by
    /// [`REQUEST_TIMEOUT`] and by `deadline`.
    async fn send(
        &self,
        method: Method,
        uri: &Uri,
        body: Bytes,
        deadline: Instant,
    ) -> Result<(StatusCode, Bytes), ProviderErrorKind> {
        let timestamp = unix_now();
        let path = uri.path_and_query().map_or("/", |p| p.as_str());
        let signed = Signed { timestamp, method: method.as_str(), path, body: &body };
        let mut request = Request::builder()
            .method(method.clone())
            .uri(uri.clone())
            .header(TIMESTAMP_HEADER, timestamp)
            .header(SIGNATURE_HEADER, signature(&self.secret, &signed))
            .header(USER_AGENT, "tidegate-autoscale");
        if method == Method::POST {
            request = request.header(CONTENT_TYPE, "application/json");
        }
        let failed =
            |source| ProviderErrorKind::Http { method: method.clone(), uri: uri.to_string(), source: Box::new(source) };
        let request = request.body(Full::new(body)).map_err(|e| failed(HttpError::Build(e)))?;
        let limit = REQUEST_TIMEOUT.min(deadline.saturating_duration_since(Instant::now()));
        let answer = self.client.send(request, limit, MAX_ANSWER).await.map_err(failed)?;
        Ok((answer.status(), answer.into_body()))
    }

    /// POSTs a JSON action to the configured URL.
    async fn post(&self, action: serde_json::Value, deadline: Instant) -> Result<(StatusCode, Bytes), ProviderError> {
        let uri = parse_http_url(&self.url).map_err(|e| self.err(ProviderErrorKind::Url(e)))?;
        self.send(Method::POST, &uri, Bytes::from(action.to_string()), deadline).await.map_err(|e| self.err(e))
    }

    async fn start_instance(&self, req: &StartRequest) -> Result<Instance, ProviderError> {
        let deadline = Instant::now() + self.start_timeout;
        let action = json!({"action": "start", "service": self.service, "id": req.id});
        let (status, body) = self.post(action, deadline).await?;
        match status {
            StatusCode::OK | StatusCode::CREATED => self.started(&req.id, &body),
            StatusCode::ACCEPTED => {
                #[derive(Deserialize)]
                struct Accepted {
                    poll: String,
                }
                let accepted: Accepted =
                    serde_json::from_slice(&body).map_err(|e| self.err(ProviderErrorKind::NoPollUrl(e)))?;
                let poll = self.poll_uri(&accepted.poll).map_err(|e| self.err(ProviderErrorKind::Url(e)))?;
                self.poll(&req.id, &poll, deadline).await
            }
            other => Err(self.err(self::status("start".into(), other, &body))),
        }
    }

    /// GETs `uri` until it answers 200 with the address.
    async fn poll(&self, id: &str, uri: &Uri, deadline: Instant) -> Result<Instance, ProviderError> {
        let mut last = String::from("no answer yet");
        loop {
            let now = Instant::now();
            if now + self.poll_interval >= deadline {
                let (id, after) = (id.to_string(), self.start_timeout);
                return Err(self.err(ProviderErrorKind::NotStartedInTime { id, after, last }));
            }
            tokio::time::sleep(self.poll_interval).await;
            match self.send(Method::GET, uri, Bytes::new(), deadline).await {
                Ok((StatusCode::OK, body)) => return self.started(id, &body),
                Ok((StatusCode::ACCEPTED, _)) => last = "still starting".into(),
                Ok((other, body)) => return Err(self.err(status(format!("polling {uri}"), other, &body))),
                Err(e) => last = e.to_string(),
            }
        }
    }

    fn started(&self, id: &str, body: &[u8]) -> Result<Instance, ProviderError> {
        parse_started(id, body)
            .map_err(|error| self.err(ProviderErrorKind::BadAnswer { what: "bad start answer", error }))
    }

    /// The URL to poll: absolute `http://`, or a path on the webhook's server.
    fn poll_uri(&self, poll: &str) -> Result<Uri, HttpError> {
        if poll.starts_with('/') {
            let base = parse_http_url(&self.url)?;
            let authority = base.authority().map(|a| a.as_str()).unwrap_or_default();
            return parse_http_url(&format!("http://{authority}{poll}"));
        }
        parse_http_url(poll)
    }
}

/// A webhook's answer `status` to `what`, not a success.
fn status(what: String, status: StatusCode, body: &[u8]) -> ProviderErrorKind {
    ProviderErrorKind::Status { what, status, body: first_line(body) }
}

impl Provider for WebhookProvider {
    fn start(&self, req: StartRequest) -> BoxFuture<'_, Result<Instance, ProviderError>> {
        Box::pin(async move { self.start_instance(&req).await })
    }

    fn stop<'a>(&'a self, instance: &'a Instance) -> BoxFuture<'a, Result<(), ProviderError>> {
        Box::pin(async move {
            let action = json!({
                "action": "stop", "service": self.service, "id": instance.id,
                "addr": instance.addr, "handle": instance.handle,
            });
            let (status, body) = self.post(action, Instant::now() + REQUEST_TIMEOUT).await?;
            if status.is_success() {
                Ok(())
            } else {
                Err(self.err(self::status(format!("stop of {}", instance.id), status, &body)))
            }
        })
    }

    fn list(&self) -> BoxFuture<'_, Result<Vec<Instance>, ProviderError>> {
        Box::pin(async move {
            let action = json!({"action": "list", "service": self.service});
            let (status, body) = self.post(action, Instant::now() + REQUEST_TIMEOUT).await?;
            match status {
                StatusCode::OK => parse_list(&body)
                    .map_err(|error| self.err(ProviderErrorKind::BadAnswer { what: "bad list answer", error })),
                StatusCode::NOT_FOUND => Ok(Vec::new()),
                other => Err(self.err(self::status("list".into(), other, &body))),
            }
        })
    }

    fn alive<'a>(&'a self, _instance: &'a Instance) -> BoxFuture<'a, Option<bool>> {
        Box::pin(async { None })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::convert::Infallible;
    use std::net::SocketAddr;
    use std::sync::{Arc, Mutex};

    use http_body_util::BodyExt;
    use hyper::body::Incoming;
    use hyper::server::conn::http1;
    use hyper::service::service_fn;
    use hyper::Response;
    use hyper_util::rt::TokioIo;
    use serde_json::Value;

    const SECRET: &str = "s3cret";

    /// What the test infrastructure service saw.
    #[derive(Default)]
    struct Seen {
        actions: Vec<Value>,
        polls: HashMap<String, u32>,
    }

    fn reply(status: u16, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
        let mut response = Response::new(Full::new(body.into()));
        *response.status_mut() = StatusCode::from_u16(status).unwrap();
        response
    }

    /// An infrastructure service: checks every signature (401 when wrong);
    /// starts answer 202 and a poll path that answers 202 once, then 200;
    /// `/nolist` does not support listing; `/fail/...` polls answer 500.
    async fn handle(req: Request<Incoming>, seen: Arc<Mutex<Seen>>) -> Result<Response<Full<Bytes>>, Infallible> {
        let (method, path) = (req.method().clone(), req.uri().path().to_string());
        let signature = req.headers().get(SIGNATURE_HEADER).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
        let timestamp = req.headers().get(TIMESTAMP_HEADER).and_then(|v| v.to_str().ok()?.parse().ok()).unwrap_or(0);
        let path_and_query = req.uri().path_and_query().map_or("/", |p| p.as_str()).to_string();
        let json_body = req.headers().get(CONTENT_TYPE).is_some_and(|v| v == "application/json");
        let body = req.into_body().collect().await.unwrap().to_bytes();
        let signed = Signed { timestamp, method: method.as_str(), path: &path_and_query, body: &body };
        if !verify_signature(SECRET.as_bytes(), &signed, &signature, unix_now()) {
            return Ok(reply(401, "bad signature"));
        }
        if method == Method::GET {
            let id = path.rsplit('/').next().unwrap_or("").to_string();
            if path.starts_with("/fail/") {
                return Ok(reply(500, "boom\nmore"));
            }
            let mut seen = seen.lock().unwrap();
            let polls = seen.polls.entry(id.clone()).or_default();
            *polls += 1;
            if *polls < 2 || id == "never" {
                return Ok(reply(202, "{}"));
            }
            return Ok(reply(200, format!(r#"{{"addr": "10.1.1.1:8080", "handle": "vm-{id}"}}"#)));
        }
        assert!(json_body, "POST without a JSON content type");
        let action: Value = serde_json::from_slice(&body).unwrap();
        seen.lock().unwrap().actions.push(action.clone());
        let id = action["id"].as_str().unwrap_or("");
        Ok(match action["action"].as_str() {
            Some("start") if id == "direct" => reply(200, r#"{"addr": "10.1.1.2:80"}"#),
            Some("start") if id == "broken" => reply(202, format!(r#"{{"poll": "http://{}/fail/x"}}"#, "127.0.0.1:1")),
            Some("start") if id == "failing" => reply(202, r#"{"poll": "/fail/x"}"#),
            Some("start") => reply(202, format!(r#"{{"poll": "/poll/{id}"}}"#)),
            Some("stop") => reply(204, ""),
            Some("list") if path == "/nolist" => reply(404, "not here"),
            Some("list") => reply(200, r#"[{"id": "a", "addr": "10.1.1.1:8080", "handle": "vm-a"}]"#),
            _ => reply(400, "unknown action"),
        })
    }

    async fn server() -> (SocketAddr, Arc<Mutex<Seen>>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Seen::default()));
        let shared = seen.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let seen = shared.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req| handle(req, seen.clone()));
                    let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
                });
            }
        });
        (addr, seen)
    }

    fn req(id: &str) -> StartRequest {
        StartRequest { service: "web".into(), id: id.into() }
    }

    #[test]
    fn signatures_cover_time_method_path_and_body() {
        let body = b"The quick brown fox jumps over the lazy dog";
        let m = Signed { timestamp: 1_700_000_000, method: "POST", path: "/hook", body };
        // HMAC-SHA256 of "1700000000\nPOST\n/hook\n" + body, keyed "key".
        let mut reference = Hmac::<Sha256>::new_from_slice(b"key").unwrap();
        reference.update(b"1700000000\nPOST\n/hook\nThe quick brown fox jumps over the lazy dog");
        let expected = format!("sha256={}", hex::encode(reference.finalize().into_bytes()));
        assert_eq!(signature(b"key", &m), expected);
        let now = m.timestamp + 10;
        assert!(verify_signature(b"key", &m, &expected, now));
        assert!(verify_signature(b"key", &m, &format!(" {expected}\n"), now));
        assert!(!verify_signature(b"kee", &m, &expected, now));
        for other in [
            Signed { body: b"The quick brown fox jumps over the lazy cat", ..m },
            Signed { method: "GET", ..m },
            Signed { path: "/other", ..m },
            Signed { timestamp: m.timestamp + 1, ..m },
        ] {
            assert!(!verify_signature(b"key", &other, &expected, now), "{other:?}");
        }
        // A captured request replayed after the window is refused.
        assert!(!verify_signature(b"key", &m, &expected, m.timestamp + REPLAY_WINDOW.as_secs() + 1));
        assert!(!verify_signature(b"key", &m, &expected, m.timestamp - REPLAY_WINDOW.as_secs() - 1));
        for bad in [&expected[7..], "sha256=zz", "sha256=", ""] {
            assert!(!verify_signature(b"key", &m, bad, now), "{bad:?}");
        }
    }

    #[tokio::test]
    async fn start_polls_until_the_instance_is_up() {
        let (addr, seen) = server().await;
        let p = WebhookProvider::new("web", &format!("http://{addr}/hook"), SECRET, 10);
        let i = p.start(req("i1")).await.unwrap();
        assert_eq!(i, Instance { id: "i1".into(), addr: "10.1.1.1:8080".into(), handle: Some("vm-i1".into()) });
        assert_eq!(seen.lock().unwrap().polls["i1"], 2);
        let direct = p.start(req("direct")).await.unwrap();
        assert_eq!((direct.addr.as_str(), direct.handle), ("10.1.1.2:80", None));
        p.stop(&i).await.unwrap();
        let listed = p.list().await.unwrap();
        assert_eq!(
            listed,
            vec![Instance { id: "a".into(), addr: "10.1.1.1:8080".into(), handle: Some("vm-a".into()) }]
        );
        let actions = seen.lock().unwrap().actions.clone();
        assert_eq!(actions[0], json!({"action": "start", "service": "web", "id": "i1"}));
        assert_eq!(
            actions[2],
            json!({"action": "stop", "service": "web", "id": "i1", "addr": "10.1.1.1:8080", "handle": "vm-i1"})
        );
        assert_eq!(actions[3], json!({"action": "list", "service": "web"}));
        let no_list = WebhookProvider::new("web", &format!("http://{addr}/nolist"), SECRET, 10);
        assert!(no_list.list().await.unwrap().is_empty());
        assert_eq!(p.alive(&i).await, None);
    }

    #[tokio::test]
    async fn failures_are_errors() {
        let (addr, _) = server().await;
        let url = format!("http://{addr}/hook");
        let wrong = WebhookProvider::new("web", &url, "not the secret", 10);
        let e = wrong.start(req("i1")).await.unwrap_err();
        assert!(matches!(&e.kind, ProviderErrorKind::Status { status, .. } if *status == StatusCode::UNAUTHORIZED));
        assert!(!e.may_have_started(), "a refusal started nothing");
        let e = e.to_string();
        assert!(e.contains("401") && e.contains("bad signature"), "{e}");
        let p = WebhookProvider::new("web", &url, SECRET, 10);
        let e = p.start(req("failing")).await.unwrap_err().to_string();
        assert!(e.contains("500") && e.contains("boom") && !e.contains("more"), "{e}");

        let mut slow = WebhookProvider::new("web", &url, SECRET, 10);
        slow.start_timeout = Duration::from_millis(300);
        let e = slow.start(req("never")).await.unwrap_err();
        assert!(matches!(&e.kind, ProviderErrorKind::NotStartedInTime { id, .. } if id == "never"), "{e:?}");
        assert!(e.may_have_started(), "an accepted start may still come up");
        assert!(e.to_string().contains("not started within"), "{e}");
        // A poll URL nobody answers is retried until the deadline.
        let e = slow.start(req("broken")).await.unwrap_err().to_string();
        assert!(e.contains("not started within"), "{e}");

        let down = WebhookProvider::new("web", "http://127.0.0.1:1/hook", SECRET, 10);
        let e = down.start(req("i1")).await.unwrap_err();
        assert!(matches!(e.kind, ProviderErrorKind::Http { .. }) && !e.may_have_started(), "{e:?}");
        let instance = Instance { id: "i1".into(), addr: "h:1".into(), handle: None };
        assert!(down.stop(&instance).await.is_err());
        assert!(down.list().await.is_err());
        for url in ["https://127.0.0.1/hook", "not a url", "/relative", ""] {
            let bad = WebhookProvider::new("web", url, SECRET, 10);
            let e = bad.start(req("i1")).await.unwrap_err();
            assert!(matches!(e.kind, ProviderErrorKind::Url(_)), "{url}: {e:?}");
            assert!(e.to_string().contains("URL"), "{url}");
        }
    }
}
