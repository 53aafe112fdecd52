//! The same request cases against every engine, in-process: the data plane
//! started through the crate's public API ([`tidegate_proxy::serve`]) once
//! per case and engine, with backends on ephemeral ports of 127.0.0.1.
//!
//! Engines: HTTP/1.1 clients of the native engine and of hyper's, and h2c
//! clients (prior knowledge, hyper's client) of a proxy set to either. A
//! case runs on every engine it applies to (cases about HTTP/1.1 framing
//! or raw bytes run on the HTTP/1.1 engines only) and must give the
//! expected [`Observed`] value on each: the status, the fields that matter
//! (response headers, what the backend received, counts) and the body.
//! A difference between engines is either a bug or a documented choice:
//! the case names it in `differs`, with the engine's observed result.

mod support;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use support::*;
use tidegate_proxy::{Http1Engine, Limits};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Who serves the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Engine {
    /// An HTTP/1.1 client of the native engine.
    Native,
    /// An HTTP/1.1 client of hyper's engine.
    Hyper,
    /// An h2c client of a proxy set to the native engine.
    H2Native,
    /// An h2c client of a proxy set to hyper's engine.
    H2Hyper,
}

use Engine::*;

/// Every engine.
const ALL: &[Engine] = &[Native, Hyper, H2Native, H2Hyper];
/// The HTTP/1.1 engines (cases about HTTP/1.1 framing or raw bytes).
const H1: &[Engine] = &[Native, Hyper];

impl Engine {
    fn http1(self) -> Http1Engine {
        match self {
            Native | H2Native => Http1Engine::Native,
            Hyper | H2Hyper => Http1Engine::Hyper,
        }
    }

    /// Sends `req` as this engine's client does.
    async fn send(self, proxy: &Proxy, req: &Req) -> Reply {
        self.send_to(proxy.addr, req).await
    }

    /// Sends `req` to `addr` as this engine's client does.
    async fn send_to(self, addr: std::net::SocketAddr, req: &Req) -> Reply {
        match self {
            Native | Hyper => h1(addr, req).await,
            H2Native | H2Hyper => h2(addr, req).await,
        }
    }

    fn start(self, limits: Limits, changes: serde_json::Value) -> Proxy {
        Proxy::start(self.http1(), limits, changes)
    }
}

/// What a case observed.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Observed {
    status: u16,
    fields: Vec<(&'static str, String)>,
    body: String,
}

/// What a case must observe.
#[derive(Debug, Clone, Copy)]
struct Expect {
    status: u16,
    fields: &'static [(&'static str, &'static str)],
    body: &'static str,
}

impl Expect {
    fn matches(&self, o: &Observed) -> bool {
        o.status == self.status
            && o.body == self.body
            && o.fields.len() == self.fields.len()
            && o.fields.iter().zip(self.fields).all(|((n, v), (en, ev))| n == en && v == ev)
    }
}

/// A body as cases compare it: the text when short, else its length.
fn text(body: &[u8]) -> String {
    if body.len() <= 256 {
        String::from_utf8_lossy(body).into_owned()
    } else {
        format!("<{} bytes>", body.len())
    }
}

/// A large body compared with what was sent.
fn intact(got: &[u8], sent: &[u8]) -> String {
    if got == sent {
        format!("<{} bytes, intact>", got.len())
    } else {
        format!("<{} bytes, not the {} sent>", got.len(), sent.len())
    }
}

fn observed(r: &Reply, fields: Vec<(&'static str, String)>) -> Observed {
    let body = if r.cut { "<cut short>".to_string() } else { text(&r.body) };
    Observed { status: r.status, fields, body }
}

/// What a backend got, one `METHOD uri` per request.
fn requests(b: &HyperBackend) -> String {
    let seen = b.seen();
    if seen.is_empty() {
        return "(none)".into();
    }
    seen.iter().map(|s| format!("{} {}", s.method, s.uri)).collect::<Vec<_>>().join("; ")
}

/// The one request a backend got (a placeholder when it got none or more).
fn one(b: &HyperBackend) -> Seen {
    let mut seen = b.seen();
    if seen.len() == 1 {
        return seen.remove(0);
    }
    Seen {
        method: format!("({} requests)", seen.len()),
        uri: String::new(),
        headers: Default::default(),
        body: Default::default(),
    }
}

/// How the body a backend got was framed.
fn framing(seen: &Seen) -> String {
    format!("content-length {}, transfer-encoding {}", seen.header("content-length"), seen.header("transfer-encoding"))
}

/// A generated request id as tests compare it.
fn id_shape(v: &str) -> String {
    if v.len() == 32 && v.bytes().all(|b| b.is_ascii_hexdigit()) {
        "<32 hex digits>".into()
    } else {
        v.to_string()
    }
}

/// An echo backend behind service `e` (route `/e`), and the proxy.
async fn echo_rig(e: Engine, limits: Limits) -> (HyperBackend, Proxy) {
    let b = HyperBackend::start("b0", Behaviour::Echo).await;
    let p = e.start(limits, config(&[("e", &[b.addr])], vec![]));
    (b, p)
}

/// A raw backend with `script` behind service `r` (route `/r`), and the
/// proxy.
async fn raw_rig(e: Engine, script: Script) -> (RawBackend, Proxy) {
    let b = RawBackend::start(script).await;
    let p = e.start(Limits::default(), config(&[("r", &[b.addr])], vec![]));
    (b, p)
}

// ---------------------------------------------------------------------------
// The cases.

async fn get(e: Engine) -> Observed {
    let (b, p) = echo_rig(e, Limits::default()).await;
    let r = e.send(&p, &Req::new("GET", "/e/hello?x=1")).await;
    p.stop().await;
    observed(
        &r,
        vec![
            ("content-length", r.header("content-length")),
            ("x-backend", r.header("x-backend")),
            ("backend got", requests(&b)),
        ],
    )
}

async fn head(e: Engine) -> Observed {
    let (b, p) = echo_rig(e, Limits::default()).await;
    let r = e.send(&p, &Req::new("HEAD", "/e/hello")).await;
    p.stop().await;
    observed(&r, vec![("content-length", r.header("content-length")), ("backend got", requests(&b))])
}

async fn post_with_length(e: Engine) -> Observed {
    let (b, p) = echo_rig(e, Limits::default()).await;
    let r = e.send(&p, &Req::new("POST", "/e/echo").body("12345")).await;
    p.stop().await;
    let seen = one(&b);
    observed(
        &r,
        vec![
            ("backend got", format!("{} {} {:?}", seen.method, seen.uri, seen.body)),
            ("backend content-length", seen.header("content-length")),
        ],
    )
}

async fn post_chunked(e: Engine) -> Observed {
    let (b, p) = echo_rig(e, Limits::default()).await;
    let raw = b"POST /e/echo HTTP/1.1\r\nhost: app.test\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n\
                3\r\nabc\r\n4;ext=1\r\ndefg\r\n0\r\nx-trailer: t\r\n\r\n";
    let r = h1_raw(p.addr, raw, false).await;
    p.stop().await;
    let seen = one(&b);
    observed(&r, vec![("backend got", format!("{:?}", seen.body)), ("backend framing", framing(&seen))])
}

/// 100 KiB chunked with a 16 KiB read-ahead: streamed, still chunked.
async fn post_chunked_streamed(e: Engine) -> Observed {
    let limits = Limits { request_buffer_bytes: 16 * 1024, ..Limits::default() };
    let (b, p) = echo_rig(e, limits).await;
    let sent: Vec<u8> = (0..100 * 1024).map(|i| (i % 241) as u8).collect();
    let mut raw =
        b"POST /e/echo HTTP/1.1\r\nhost: app.test\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n".to_vec();
    for chunk in sent.chunks(10_000) {
        raw.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
        raw.extend_from_slice(chunk);
        raw.extend_from_slice(b"\r\n");
    }
    raw.extend_from_slice(b"0\r\n\r\n");
    let r = h1_raw(p.addr, &raw, false).await;
    p.stop().await;
    let seen = one(&b);
    let mut o = observed(&r, vec![("backend got", intact(&seen.body, &sent)), ("backend framing", framing(&seen))]);
    o.body = intact(&r.body, &sent);
    o
}

/// 100 KiB: above 64 KiB, within the default read-ahead (buffered whole).
async fn post_large_buffered(e: Engine) -> Observed {
    let (b, p) = echo_rig(e, Limits::default()).await;
    let sent: Vec<u8> = (0..100 * 1024).map(|i| (i % 251) as u8).collect();
    let r = e.send(&p, &Req::new("POST", "/e/echo").body(sent.clone())).await;
    p.stop().await;
    let seen = one(&b);
    let mut o = observed(&r, vec![("backend got", intact(&seen.body, &sent)), ("backend framing", framing(&seen))]);
    o.body = intact(&r.body, &sent);
    o
}

/// 300 KiB with a 16 KiB read-ahead: streamed to the backend.
async fn post_large_streamed(e: Engine) -> Observed {
    let limits = Limits { request_buffer_bytes: 16 * 1024, ..Limits::default() };
    let (b, p) = echo_rig(e, limits).await;
    let sent: Vec<u8> = (0..300 * 1024).map(|i| (i % 253) as u8).collect();
    let r = e.send(&p, &Req::new("POST", "/e/echo").body(sent.clone())).await;
    p.stop().await;
    let seen = one(&b);
    let mut o = observed(&r, vec![("backend got", intact(&seen.body, &sent)), ("backend framing", framing(&seen))]);
    o.body = intact(&r.body, &sent);
    o
}

async fn response_chunked(e: Engine) -> Observed {
    let (_b, p) = raw_rig(e, Script::Framings).await;
    let r = e.send(&p, &Req::new("GET", "/r/chunked")).await;
    p.stop().await;
    observed(&r, vec![])
}

async fn response_until_close(e: Engine) -> Observed {
    let (_b, p) = raw_rig(e, Script::Framings).await;
    let r = e.send(&p, &Req::new("GET", "/r/close")).await;
    p.stop().await;
    observed(&r, vec![])
}

async fn response_large(e: Engine) -> Observed {
    let (_b, p) = raw_rig(e, Script::Framings).await;
    let r = e.send(&p, &Req::new("GET", "/r/big")).await;
    p.stop().await;
    let mut o = observed(&r, vec![("content-length", r.header("content-length"))]);
    o.body = intact(&r.body, &vec![b'x'; BIG]);
    o
}

/// A body by length that arrives in pieces: relayed whole, and the
/// backend's connection kept for the next request.
async fn response_in_pieces(e: Engine) -> Observed {
    let (b, p) = raw_rig(e, Script::Framings).await;
    let first = e.send(&p, &Req::new("GET", "/r/pieces")).await;
    let r = e.send(&p, &Req::new("GET", "/r/pieces")).await;
    p.stop().await;
    let mut o = observed(
        &r,
        vec![
            ("first", intact(&first.body, &vec![b'y'; PIECES])),
            ("backend connections", b.connections.load(Ordering::SeqCst).to_string()),
        ],
    );
    o.body = intact(&r.body, &vec![b'y'; PIECES]);
    o
}

async fn head_of_large_response(e: Engine) -> Observed {
    let (_b, p) = raw_rig(e, Script::Framings).await;
    let r = e.send(&p, &Req::new("HEAD", "/r/big")).await;
    p.stop().await;
    observed(&r, vec![("content-length", r.header("content-length"))])
}

/// A response with both `Content-Length` and chunked: framed by the
/// coding, and the length not passed on.
async fn response_length_and_coding(e: Engine) -> Observed {
    let (_b, p) = raw_rig(e, Script::Framings).await;
    let r = e.send(&p, &Req::new("GET", "/r/both")).await;
    p.stop().await;
    observed(&r, vec![("content-length", r.header("content-length"))])
}

/// A backend's body cut short after its head: the client sees it cut
/// too, never a complete-looking body. (Over HTTP/2 the stream's reset may
/// overtake its head, still queued in the proxy: the client then gets a
/// stream error and no head; either is "cut".)
async fn backend_body_cut(e: Engine) -> Observed {
    let (_b, p) = raw_rig(e, Script::Framings).await;
    let by_length = e.send(&p, &Req::new("GET", "/r/short")).await;
    let chunked = e.send(&p, &Req::new("GET", "/r/shortchunks")).await;
    p.stop().await;
    let verdict = |r: &Reply| {
        if r.cut || r.status == 0 {
            "cut".to_string()
        } else {
            format!("complete: {} {}", r.status, text(&r.body))
        }
    };
    Observed {
        status: 200,
        fields: vec![("by length", verdict(&by_length)), ("chunked", verdict(&chunked))],
        body: String::new(),
    }
}

async fn invalid_response(e: Engine) -> Observed {
    let (_b, p) = raw_rig(e, Script::Framings).await;
    let r = e.send(&p, &Req::new("GET", "/r/garbage")).await;
    p.stop().await;
    observed(&r, vec![])
}

/// A `101` to a request that asked for no upgrade.
async fn unsolicited_switch(e: Engine) -> Observed {
    let (_b, p) = raw_rig(e, Script::Framings).await;
    let r = e.send(&p, &Req::new("GET", "/r/switch")).await;
    p.stop().await;
    observed(&r, vec![])
}

async fn response_timeout(e: Engine) -> Observed {
    let b = RawBackend::start(Script::Framings).await;
    let settings = json!({ "timeouts": { "response_ms": 100 } });
    let p = e.start(Limits::default(), config(&[], service("r", &[b.addr], settings).into()));
    let r = e.send(&p, &Req::new("GET", "/r/silent")).await;
    p.stop().await;
    observed(&r, vec![("backend requests", b.requests.load(Ordering::SeqCst).to_string())])
}

/// The only backend is at its `max_conns` (a request it holds) and the
/// queue takes none: 503 at once.
async fn queue_full(e: Engine) -> Observed {
    let b = RawBackend::start(Script::Framings).await;
    let mut spec = service("r", &[b.addr], json!({ "queue": { "max": 0 } }));
    spec[0]["spec"]["backends"][0]["max_conns"] = json!(1);
    let p = e.start(Limits::default(), config(&[], spec.into()));
    let addr = p.addr;
    let held = tokio::spawn(async move { e.send_to(addr, &Req::new("GET", "/r/silent")).await });
    let requests = b.requests.clone();
    wait_until("the backend holds the first request", || requests.load(Ordering::SeqCst) == 1).await;
    let r = e.send(&p, &Req::new("GET", "/r/x")).await;
    // The backend goes: the held request ends (502), then the proxy.
    drop(b);
    let held = held.await.expect("the held request");
    p.stop().await;
    observed(&r, vec![("held request", held.status.to_string())])
}

async fn no_route(e: Engine) -> Observed {
    let (b, p) = echo_rig(e, Limits::default()).await;
    let r = e.send(&p, &Req::new("GET", "/nowhere")).await;
    p.stop().await;
    observed(&r, vec![("content-type", r.header("content-type")), ("backend got", requests(&b))])
}

async fn backend_down(e: Engine) -> Observed {
    let down = DownPort::new();
    let p = e.start(Limits::default(), config(&[("d", &[down.addr])], vec![]));
    let r = e.send(&p, &Req::new("GET", "/d/x")).await;
    p.stop().await;
    observed(&r, vec![])
}

async fn backend_closes_at_once(e: Engine) -> Observed {
    let (b, p) = raw_rig(e, Script::Refuse).await;
    let r = e.send(&p, &Req::new("GET", "/r/x")).await;
    p.stop().await;
    // One backend: no other to retry on.
    observed(&r, vec![("connections", b.connections.load(Ordering::SeqCst).to_string())])
}

async fn no_backend(e: Engine) -> Observed {
    let p = e.start(Limits::default(), config(&[("n", &[])], vec![]));
    let r = e.send(&p, &Req::new("GET", "/n/x")).await;
    p.stop().await;
    observed(&r, vec![])
}

/// The backend closes a pooled keep-alive connection when the next request
/// arrives on it: the GET goes again on a fresh connection.
async fn stale_pooled_connection(e: Engine) -> Observed {
    let (b, p) = raw_rig(e, Script::CloseSecond).await;
    let first = e.send(&p, &Req::new("GET", "/r/1")).await;
    let second = e.send(&p, &Req::new("GET", "/r/2")).await;
    p.stop().await;
    observed(
        &second,
        vec![
            ("first", format!("{} {}", first.status, text(&first.body))),
            ("backend connections", b.connections.load(Ordering::SeqCst).to_string()),
            ("backend requests", b.requests.load(Ordering::SeqCst).to_string()),
        ],
    )
}

/// The same with a POST: it may have been processed, so it is not sent
/// again.
async fn stale_pooled_connection_post(e: Engine) -> Observed {
    let (b, p) = raw_rig(e, Script::CloseSecond).await;
    let first = e.send(&p, &Req::new("GET", "/r/1")).await;
    let second = e.send(&p, &Req::new("POST", "/r/2").body("data")).await;
    p.stop().await;
    observed(
        &second,
        vec![
            ("first", format!("{} {}", first.status, text(&first.body))),
            ("backend connections", b.connections.load(Ordering::SeqCst).to_string()),
            ("backend requests", b.requests.load(Ordering::SeqCst).to_string()),
        ],
    )
}

/// One backend sheds (503), the other serves: every GET gets 200.
async fn shed_and_retried(e: Engine) -> Observed {
    let shed = HyperBackend::start("shed", Behaviour::Shed).await;
    let good = HyperBackend::start("good", Behaviour::Echo).await;
    let p = e.start(Limits::default(), config(&[("s", &[shed.addr, good.addr])], vec![]));
    let mut answers = Vec::new();
    for i in 0..4 {
        let r = e.send(&p, &Req::new("GET", &format!("/s/{i}"))).await;
        answers.push(format!("{} {}", r.status, r.header("x-backend")));
    }
    p.stop().await;
    Observed {
        status: 200,
        fields: vec![
            ("answers", answers.join(", ")),
            ("shedding backend asked", (!shed.seen().is_empty()).to_string()),
            ("serving backend asked", good.seen().len().to_string()),
        ],
        body: String::new(),
    }
}

/// Every backend sheds: the client gets the backend's 503.
async fn shed_everywhere(e: Engine) -> Observed {
    let shed = HyperBackend::start("shed", Behaviour::Shed).await;
    let p = e.start(Limits::default(), config(&[("s", &[shed.addr])], vec![]));
    let r = e.send(&p, &Req::new("GET", "/s/x")).await;
    p.stop().await;
    observed(&r, vec![("x-backend", r.header("x-backend")), ("backend got", requests(&shed))])
}

async fn redirect_https(e: Engine) -> Observed {
    let b = HyperBackend::start("b0", Behaviour::Echo).await;
    let route = json!({ "op": "put_route", "name": "secure", "spec": {
        "match": { "path_prefix": "/secure" }, "service": "e", "redirect_https": true } });
    let p = e.start(Limits::default(), config(&[("e", &[b.addr])], vec![route]));
    let r = e.send(&p, &Req::new("GET", "/secure/x?q=1")).await;
    p.stop().await;
    observed(&r, vec![("location", r.header("location")), ("backend got", requests(&b))])
}

async fn static_files(e: Engine) -> Observed {
    let dir = tempfile::tempdir().expect("a temporary directory");
    std::fs::write(dir.path().join("a.txt"), "static hello\n").expect("a file");
    let route = json!({ "op": "put_route", "name": "files", "spec": {
        "match": { "path_prefix": "/files" }, "static": { "root": dir.path() } } });
    let p = e.start(Limits::default(), config(&[], vec![route]));
    let r = e.send(&p, &Req::new("GET", "/files/a.txt")).await;
    let missing = e.send(&p, &Req::new("GET", "/files/missing.txt")).await;
    let escape = e.send(&p, &Req::new("GET", "/files/%2e%2e/%2e%2e/etc/passwd")).await;
    p.stop().await;
    observed(
        &r,
        vec![
            ("content-type", r.header("content-type")),
            ("content-length", r.header("content-length")),
            ("missing", missing.status.to_string()),
            ("escape", escape.status.to_string()),
        ],
    )
}

/// Hop-by-hop request headers (and those `Connection` names) stop at the
/// proxy.
async fn hop_by_hop_request(e: Engine) -> Observed {
    let (b, p) = echo_rig(e, Limits::default()).await;
    let raw = b"GET /e/x HTTP/1.1\r\nhost: app.test\r\nconnection: x-private, keep-alive\r\nx-private: 1\r\n\
                keep-alive: timeout=5\r\nte: trailers\r\nproxy-authorization: Basic eDp5\r\n\
                proxy-connection: keep-alive\r\nupgrade: h2c\r\nx-kept: 1\r\n\r\n";
    let r = h1_raw(p.addr, raw, false).await;
    p.stop().await;
    let seen = one(&b);
    let fields =
        ["connection", "x-private", "keep-alive", "te", "proxy-authorization", "proxy-connection", "upgrade", "x-kept"]
            .into_iter()
            .map(|n| (n, seen.header(n)))
            .collect();
    observed(&r, fields)
}

/// Hop-by-hop response headers stop at the proxy.
async fn hop_by_hop_response(e: Engine) -> Observed {
    let (_b, p) = raw_rig(e, Script::Framings).await;
    let r = e.send(&p, &Req::new("GET", "/r/hop")).await;
    p.stop().await;
    let fields = ["x-secret", "keep-alive", "x-kept"].into_iter().map(|n| (n, r.header(n))).collect();
    observed(&r, fields)
}

/// An untrusted client's forwarding headers are replaced or removed.
async fn forwarding_headers(e: Engine) -> Observed {
    let (b, p) = echo_rig(e, Limits::default()).await;
    let req = Req::new("GET", "/e/x")
        .host("app.test:8080")
        .header("x-forwarded-for", "6.6.6.6")
        .header("forwarded", "for=6.6.6.6")
        .header("x-real-ip", "6.6.6.6")
        .header("x-forwarded-proto", "https")
        .header("x-forwarded-host", "evil.test");
    let r = e.send(&p, &req).await;
    let port = p.addr.port().to_string();
    p.stop().await;
    let seen = one(&b);
    let fields = ["host", "x-forwarded-for", "forwarded", "x-real-ip", "x-forwarded-proto", "x-forwarded-host"]
        .into_iter()
        .map(|n| (n, seen.header(n)))
        .chain([("x-forwarded-port", seen.header("x-forwarded-port").replace(&port, "<proxy port>"))])
        .collect();
    observed(&r, fields)
}

/// A trusted proxy's forwarding headers are kept, and appended to.
async fn forwarding_headers_trusted(e: Engine) -> Observed {
    let limits = Limits { trusted_proxies: "127.0.0.0/8".parse().expect("a block"), ..Limits::default() };
    let (b, p) = echo_rig(e, limits).await;
    let req = Req::new("GET", "/e/x")
        .header("x-forwarded-for", "198.51.100.7")
        .header("forwarded", "for=198.51.100.7")
        .header("x-real-ip", "198.51.100.7");
    let r = e.send(&p, &req).await;
    p.stop().await;
    let seen = one(&b);
    let fields = ["x-forwarded-for", "forwarded", "x-real-ip"].into_iter().map(|n| (n, seen.header(n))).collect();
    observed(&r, fields)
}

async fn request_id_kept(e: Engine) -> Observed {
    let (b, p) = echo_rig(e, Limits::default()).await;
    let r = e.send(&p, &Req::new("GET", "/e/x").header("x-request-id", "req-42")).await;
    p.stop().await;
    observed(&r, vec![("backend got", one(&b).header("x-request-id")), ("client got", r.header("x-request-id"))])
}

/// None sent, an unacceptable one, or two: the backend gets one new id
/// in place (the client's answer carries none: the id is for the logs of
/// the proxy and the backends).
async fn request_id_generated(e: Engine) -> Observed {
    let (b, p) = echo_rig(e, Limits::default()).await;
    let none = e.send(&p, &Req::new("GET", "/e/1")).await;
    let bad = e.send(&p, &Req::new("GET", "/e/2").header("x-request-id", "bad id \"quoted\"")).await;
    let two = e.send(&p, &Req::new("GET", "/e/3").header("x-request-id", "a").header("x-request-id", "b")).await;
    p.stop().await;
    let ids: Vec<String> = b.seen().iter().map(|s| s.header("x-request-id")).collect();
    let distinct: std::collections::HashSet<_> = ids.iter().collect();
    observed(
        &none,
        vec![
            ("backend got", ids.iter().map(|i| id_shape(i)).collect::<Vec<_>>().join(", ")),
            ("distinct ids", distinct.len().to_string()),
            ("client got", [&none, &bad, &two].iter().map(|r| r.header("x-request-id")).collect::<Vec<_>>().join(", ")),
        ],
    )
}

/// Routes match the host lowercase, without its port and one trailing dot
/// (`app.test..` keeps one: no route matches it).
async fn host_forms(e: Engine) -> Observed {
    let b = HyperBackend::start("b0", Behaviour::Echo).await;
    let route = json!({ "op": "put_route", "name": "h", "spec": {
        "match": { "host": "app.test", "path_prefix": "/h" }, "service": "e" } });
    let p = e.start(Limits::default(), config(&[("e", &[b.addr])], vec![route]));
    let mut statuses = Vec::new();
    for host in ["app.test", "APP.Test", "app.test.", "app.test:8080", "app.test.:8080", "other.test", "app.test.."] {
        let r = e.send(&p, &Req::new("GET", "/h/x").host(host)).await;
        statuses.push(format!("{host} {}", r.status));
    }
    p.stop().await;
    Observed { status: 200, fields: vec![("answers", statuses.join(", "))], body: String::new() }
}

/// Dot segments are resolved before routing.
async fn dot_segments(e: Engine) -> Observed {
    let (b, p) = echo_rig(e, Limits::default()).await;
    let r = e.send(&p, &Req::new("GET", "/e/a/../b/./c?q=..")).await;
    let out = e.send(&p, &Req::new("GET", "/e/../x")).await;
    p.stop().await;
    observed(&r, vec![("backend got", requests(&b)), ("/e/../x", out.status.to_string())])
}

async fn fragment_refused(e: Engine) -> Observed {
    let (b, p) = echo_rig(e, Limits::default()).await;
    let r = h1_raw(p.addr, b"GET /e/a#frag HTTP/1.1\r\nhost: app.test\r\nconnection: close\r\n\r\n", false).await;
    p.stop().await;
    observed(&r, vec![("backend got", requests(&b))])
}

/// A head of `size` bytes of one field, against `--max-header-bytes` of
/// 16 KiB (it is at least 8 KiB, the least hyper's read buffer takes).
async fn head_of(e: Engine, size: usize) -> Observed {
    let limits = Limits { max_header_bytes: 16 * 1024, ..Limits::default() };
    let (b, p) = echo_rig(e, limits).await;
    let r = e.send(&p, &Req::new("GET", "/e/x").header("x-big", &"a".repeat(size))).await;
    p.stop().await;
    observed(&r, vec![("backend got", requests(&b))])
}

/// Over the limit, within what hyper's parsers read past it.
async fn head_too_large(e: Engine) -> Observed {
    head_of(e, 20_000).await
}

/// Over twice the limit: past what hyper's parsers read.
async fn head_far_too_large(e: Engine) -> Observed {
    head_of(e, 40_000).await
}

/// A head of `count` fields against `--max-headers` of 20.
async fn headers_of(e: Engine, count: usize) -> Observed {
    let limits = Limits { max_headers: 20, ..Limits::default() };
    let (b, p) = echo_rig(e, limits).await;
    let names: Vec<&'static str> = (0..count).map(|i| &*format!("x-h{i}").leak()).collect();
    let mut req = Req::new("GET", "/e/x");
    for n in names {
        req = req.header(n, "1");
    }
    let r = e.send(&p, &req).await;
    p.stop().await;
    observed(&r, vec![("backend got", requests(&b))])
}

/// Over the limit, within what hyper's parser reads past it.
async fn too_many_headers(e: Engine) -> Observed {
    headers_of(e, 30).await
}

/// Over twice the limit: past what hyper's HTTP/1 parser reads.
async fn far_too_many_headers(e: Engine) -> Observed {
    headers_of(e, 50).await
}

async fn expect_continue(e: Engine) -> Observed {
    let (b, p) = echo_rig(e, Limits::default()).await;
    let mut s = connect(p.addr).await;
    let head = b"POST /e/echo HTTP/1.1\r\nhost: app.test\r\nexpect: 100-continue\r\ncontent-length: 5\r\nconnection: close\r\n\r\n";
    s.write_all(head).await.expect("the head is written");
    let mut buf = Vec::new();
    let interim = read_reply(&mut s, &mut buf, false).await;
    let r = if interim.status == 100 {
        s.write_all(b"12345").await.expect("the body is written");
        read_reply(&mut s, &mut buf, false).await
    } else {
        interim.clone()
    };
    drop(s);
    p.stop().await;
    let seen = one(&b);
    observed(&r, vec![("interim", interim.status.to_string()), ("backend expect", seen.header("expect"))])
}

async fn http10_client(e: Engine) -> Observed {
    let (_b, p) = raw_rig(e, Script::Framings).await;
    let mut s = connect(p.addr).await;
    s.write_all(b"GET /r/chunked HTTP/1.0\r\nhost: app.test\r\n\r\n").await.expect("written");
    let r = read_reply(&mut s, &mut Vec::new(), false).await;
    let closed = closed(&mut s).await;
    drop(s);
    p.stop().await;
    observed(
        &r,
        vec![
            ("version", r.version.clone()),
            ("transfer-encoding", r.header("transfer-encoding")),
            ("closed after", closed.to_string()),
        ],
    )
}

/// An HTTP/1.0 client asking for keep-alive gets its second request
/// answered on the same connection.
async fn http10_keep_alive(e: Engine) -> Observed {
    let (b, p) = echo_rig(e, Limits::default()).await;
    let mut s = connect(p.addr).await;
    let mut buf = Vec::new();
    s.write_all(b"GET /e/1 HTTP/1.0\r\nhost: app.test\r\nconnection: keep-alive\r\n\r\n").await.expect("written");
    let first = read_reply(&mut s, &mut buf, false).await;
    let second = match s.write_all(b"GET /e/2 HTTP/1.0\r\nhost: app.test\r\n\r\n").await {
        Ok(()) => read_reply(&mut s, &mut buf, false).await,
        Err(_) => Reply::default(),
    };
    drop(s);
    p.stop().await;
    observed(
        &first,
        vec![
            ("connection", first.header("connection")),
            ("second", format!("{} {}", second.status, text(&second.body))),
            ("backend got", requests(&b)),
        ],
    )
}

/// Request lines ended by a bare LF.
async fn bare_lf(e: Engine) -> Observed {
    let (b, p) = echo_rig(e, Limits::default()).await;
    let r = h1_raw(p.addr, b"GET /e/lf HTTP/1.1\nhost: app.test\nconnection: close\n\n", false).await;
    p.stop().await;
    observed(&r, vec![("backend got", requests(&b))])
}

/// A header folded over two lines (obsolete line folding).
async fn obs_fold(e: Engine) -> Observed {
    let (b, p) = echo_rig(e, Limits::default()).await;
    let raw = b"GET /e/fold HTTP/1.1\r\nhost: app.test\r\nx-folded: one\r\n two\r\nconnection: close\r\n\r\n";
    let r = h1_raw(p.addr, raw, false).await;
    p.stop().await;
    let folded = b.seen().first().map_or("-".into(), |s| s.header("x-folded"));
    observed(&r, vec![("backend got", requests(&b)), ("backend x-folded", folded)])
}

/// An absolute-form target: its authority wins over `Host`.
async fn absolute_form(e: Engine) -> Observed {
    let (b, p) = echo_rig(e, Limits::default()).await;
    let raw = b"GET http://app.test/e/abs?q=1 HTTP/1.1\r\nhost: other.test\r\nconnection: close\r\n\r\n";
    let r = h1_raw(p.addr, raw, false).await;
    p.stop().await;
    let host = b.seen().first().map_or("-".into(), |s| s.header("host"));
    observed(&r, vec![("backend got", requests(&b)), ("backend host", host)])
}

/// Paths that cannot be normalized safely: 400, nothing forwarded.
async fn refused_paths(e: Engine) -> Observed {
    let (b, p) = echo_rig(e, Limits::default()).await;
    let mut answers = Vec::new();
    for path in ["/e/a%2Fb", "/e/a%00", "/e/a%5Cb", "/e/..;/x", "/e/../../x", "/e/%zz"] {
        let r = e.send(&p, &Req::new("GET", path)).await;
        answers.push(format!("{path} {}", r.status));
    }
    p.stop().await;
    Observed {
        status: 200,
        fields: vec![("answers", answers.join(", ")), ("backend got", requests(&b))],
        body: String::new(),
    }
}

/// A raw backslash in an HTTP/1.1 target.
async fn backslash_path(e: Engine) -> Observed {
    let (b, p) = echo_rig(e, Limits::default()).await;
    let r = h1_raw(p.addr, b"GET /e/a\\b HTTP/1.1\r\nhost: app.test\r\nconnection: close\r\n\r\n", false).await;
    p.stop().await;
    observed(&r, vec![("backend got", requests(&b))])
}

/// A request coding other than plain chunked.
async fn request_coding_not_chunked(e: Engine) -> Observed {
    let (b, p) = echo_rig(e, Limits::default()).await;
    let raw =
        b"POST /e/echo HTTP/1.1\r\nhost: app.test\r\ntransfer-encoding: gzip, chunked\r\nconnection: close\r\n\r\n\
                3\r\nabc\r\n0\r\n\r\n";
    let r = h1_raw(p.addr, raw, false).await;
    p.stop().await;
    observed(&r, vec![("backend got", requests(&b))])
}

/// A chunked request body with a malformed chunk size.
async fn chunked_malformed(e: Engine) -> Observed {
    let (b, p) = echo_rig(e, Limits::default()).await;
    let raw = b"POST /e/echo HTTP/1.1\r\nhost: app.test\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n\
                zz\r\nabc\r\n0\r\n\r\n";
    let r = h1_raw(p.addr, raw, false).await;
    p.stop().await;
    observed(&r, vec![("backend got", requests(&b))])
}

/// A backend's `103 Early Hints` before its answer: what the client sees.
async fn early_hints(e: Engine) -> Observed {
    let (_b, p) = raw_rig(e, Script::Framings).await;
    let mut s = connect(p.addr).await;
    s.write_all(b"GET /r/early HTTP/1.1\r\nhost: app.test\r\nconnection: close\r\n\r\n").await.expect("written");
    let mut buf = Vec::new();
    let mut interim = Vec::new();
    let r = loop {
        let r = read_reply(&mut s, &mut buf, false).await;
        if !(100..200).contains(&r.status) {
            break r;
        }
        interim.push(format!("{} link {}", r.status, r.header("link")));
    };
    drop(s);
    p.stop().await;
    observed(&r, vec![("interim", if interim.is_empty() { "-".into() } else { interim.join(", ") })])
}

async fn websocket_upgrade(e: Engine) -> Observed {
    let (b, p) = echo_rig(e, Limits::default()).await;
    let mut s = connect(p.addr).await;
    let head = b"GET /e/ws HTTP/1.1\r\nhost: app.test\r\nconnection: upgrade\r\nupgrade: websocket\r\n\
                 sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n";
    s.write_all(head).await.expect("the head is written");
    let mut buf = Vec::new();
    let r = read_reply(&mut s, &mut buf, false).await;
    let mut echoed = Vec::new();
    if r.status == 101 {
        for word in [&b"ping"[..], b"and pong"] {
            s.write_all(word).await.expect("written");
            let mut got = std::mem::take(&mut buf);
            while got.len() < word.len() {
                let mut chunk = [0u8; 64];
                match tokio::time::timeout(DEADLINE, s.read(&mut chunk)).await {
                    Ok(Ok(n)) if n > 0 => got.extend_from_slice(&chunk[..n]),
                    _ => break,
                }
            }
            echoed.push(String::from_utf8_lossy(&got).into_owned());
        }
    }
    drop(s);
    p.stop().await;
    let seen = one(&b);
    observed(
        &r,
        vec![
            ("upgrade", r.header("upgrade")),
            ("backend upgrade", seen.header("upgrade")),
            ("echoed", echoed.join(" / ")),
        ],
    )
}

/// A body streamed to the backend (above a 1 KiB read-ahead) slower than
/// the minimum pace is cut with 408 once a short window has passed.
async fn slow_body(e: Engine) -> Observed {
    let limits = Limits {
        request_buffer_bytes: 1024,
        min_upload_rate: 1_000_000,
        upload_rate_window: Duration::from_millis(100),
        ..Limits::default()
    };
    let (b, p) = echo_rig(e, limits).await;
    // 4 KiB of 100,000, then nothing: the proxy must answer by itself.
    let r = match e {
        Native | Hyper => {
            let mut s = connect(p.addr).await;
            let head = b"POST /e/echo HTTP/1.1\r\nhost: app.test\r\ncontent-length: 100000\r\n\r\n";
            s.write_all(head).await.expect("written");
            s.write_all(&[b'z'; 4096]).await.expect("written");
            read_reply(&mut s, &mut Vec::new(), false).await
        }
        H2Native | H2Hyper => {
            let req = Req::new("POST", "/e/echo");
            h2_with_body(p.addr, &req, 100_000, Stalling(Some(bytes::Bytes::from_static(&[b'z'; 4096])))).await
        }
    };
    p.stop().await;
    // The backend never got a whole body.
    let bodies: Vec<_> = b.seen().iter().map(|s| s.body.len()).filter(|n| *n == 100_000).collect();
    observed(&r, vec![("whole bodies at the backend", bodies.len().to_string())])
}

/// Two requests pipelined on one client connection, the second closing it.
async fn client_keep_alive(e: Engine) -> Observed {
    let (b, p) = echo_rig(e, Limits::default()).await;
    let mut s = connect(p.addr).await;
    let two =
        b"GET /e/1 HTTP/1.1\r\nhost: app.test\r\n\r\nGET /e/2 HTTP/1.1\r\nhost: app.test\r\nconnection: close\r\n\r\n";
    s.write_all(two).await.expect("written");
    let mut buf = Vec::new();
    let first = read_reply(&mut s, &mut buf, false).await;
    let second = read_reply(&mut s, &mut buf, false).await;
    let closed = buf.is_empty() && closed(&mut s).await;
    drop(s);
    p.stop().await;
    observed(
        &second,
        vec![
            ("first", format!("{} {}", first.status, text(&first.body))),
            ("backend got", requests(&b)),
            ("closed after", closed.to_string()),
        ],
    )
}

/// Both `Content-Length` and `Transfer-Encoding`: refused (a smuggling
/// vector), and the connection closed after the answer.
async fn framing_conflict(e: Engine) -> Observed {
    let (b, p) = echo_rig(e, Limits::default()).await;
    let mut s = connect(p.addr).await;
    let raw = b"POST /e/echo HTTP/1.1\r\nhost: app.test\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n\
                0\r\n\r\n";
    s.write_all(raw).await.expect("written");
    let mut buf = Vec::new();
    let r = read_reply(&mut s, &mut buf, false).await;
    let closed = buf.is_empty() && closed(&mut s).await;
    drop(s);
    p.stop().await;
    observed(&r, vec![("backend got", requests(&b)), ("closed after", closed.to_string())])
}

/// No `Host`, or two: refused.
async fn host_missing_or_twice(e: Engine) -> Observed {
    let (b, p) = echo_rig(e, Limits::default()).await;
    let none = h1_raw(p.addr, b"GET /e/x HTTP/1.1\r\nconnection: close\r\n\r\n", false).await;
    let two =
        h1_raw(p.addr, b"GET /e/x HTTP/1.1\r\nhost: a.test\r\nhost: b.test\r\nconnection: close\r\n\r\n", false).await;
    p.stop().await;
    observed(&none, vec![("two hosts", format!("{} {}", two.status, text(&two.body))), ("backend got", requests(&b))])
}

/// `Expect: 100-continue` with a body above the read-ahead (streamed).
async fn expect_continue_streamed(e: Engine) -> Observed {
    let (b, p) = echo_rig(e, Limits { request_buffer_bytes: 1024, ..Limits::default() }).await;
    let sent: Vec<u8> = (0..8192).map(|i| (i % 239) as u8).collect();
    let mut s = connect(p.addr).await;
    let head = b"POST /e/echo HTTP/1.1\r\nhost: app.test\r\nexpect: 100-continue\r\ncontent-length: 8192\r\nconnection: close\r\n\r\n";
    s.write_all(head).await.expect("the head is written");
    let mut buf = Vec::new();
    let interim = read_reply(&mut s, &mut buf, false).await;
    let r = if interim.status == 100 {
        s.write_all(&sent).await.expect("the body is written");
        read_reply(&mut s, &mut buf, false).await
    } else {
        interim.clone()
    };
    drop(s);
    p.stop().await;
    let seen = one(&b);
    let mut o = observed(
        &r,
        vec![
            ("interim", interim.status.to_string()),
            ("backend expect", seen.header("expect")),
            ("backend got", intact(&seen.body, &sent)),
        ],
    );
    o.body = intact(&r.body, &sent);
    o
}

// ---------------------------------------------------------------------------
// The table.

type Run = fn(Engine) -> Pin<Box<dyn Future<Output = Observed> + Send>>;

struct Case {
    name: &'static str,
    /// The engines it runs on.
    on: &'static [Engine],
    run: Run,
    /// What every engine must observe...
    expect: Expect,
    /// ...but these, which observe this instead (a known difference, to be
    /// fixed or documented).
    differs: &'static [(Engine, Expect)],
}

impl Case {
    fn expected(&self, e: Engine) -> &Expect {
        self.differs.iter().find(|(d, _)| *d == e).map_or(&self.expect, |(_, x)| x)
    }
}

/// The proxy's answer to a head over its limits.
const HEAD_431: Expect =
    Expect { status: 431, fields: &[("backend got", "(none)")], body: "431 the request head is too large\n" };

/// hyper's own answer to a head over its limits.
const HEAD_431_EMPTY: Expect = Expect { status: 431, fields: &[("backend got", "(none)")], body: "" };

const fn ok(fields: &'static [(&'static str, &'static str)], body: &'static str) -> Expect {
    Expect { status: 200, fields, body }
}

// ---------------------------------------------------------------------------
// Traffic rules (docs/rules.md), on every engine.

/// A bcrypt hash (cost 4) of `s3cret`.
const HASH: &str = "$2b$04$/uaF/uaF/uaF/uaF/uaF/uK7.eFDTHWTk03S8wqeyk9ZLEdfjGgEC";

/// The operations that put rule set `set` of `steps` and a route
/// `/{set}` to service `e` that runs it.
fn ruled(set: &str, steps: serde_json::Value) -> Vec<serde_json::Value> {
    vec![
        json!({ "op": "put_rules", "name": set, "spec": { "steps": steps } }),
        json!({ "op": "put_route", "name": set, "spec": {
            "match": { "path_prefix": format!("/{set}") }, "service": "e", "rules": [set] } }),
    ]
}

/// An echo backend behind service `e`, and a proxy whose route `/{set}`
/// runs `steps`.
async fn rules_rig(e: Engine, set: &str, steps: serde_json::Value) -> (HyperBackend, Proxy) {
    let b = HyperBackend::start("b0", Behaviour::Echo).await;
    let p = e.start(Limits::default(), config(&[("e", &[b.addr])], ruled(set, steps)));
    (b, p)
}

/// A path prefix stripped, request headers set, added and removed (the
/// Host sent upstream among them), response headers set, added, removed.
async fn rules_edit(e: Engine) -> Observed {
    let steps = json!([
        { "kind": "strip_prefix", "prefix": "/api" },
        { "kind": "set_request_header", "name": "X-A", "value": "1" },
        { "kind": "remove_request_header", "name": "X-B" },
        { "kind": "add_request_header", "name": "X-C", "value": "2" },
        { "kind": "set_request_header", "name": "Host", "value": "backend.internal" },
        { "kind": "set_response_header", "name": "Strict-Transport-Security", "value": "max-age=63072000" },
        { "kind": "remove_response_header", "name": "X-Backend" },
        { "kind": "add_response_header", "name": "X-D", "value": "4" },
    ]);
    let (b, p) = rules_rig(e, "api", steps).await;
    let req = Req::new("GET", "/api/hello?x=1").header("x-a", "0").header("x-b", "gone").header("x-c", "1");
    let r = e.send(&p, &req).await;
    p.stop().await;
    let seen = one(&b);
    let mut fields = vec![("backend got", format!("{} {}", seen.method, seen.uri))];
    fields.extend(["x-a", "x-b", "x-c", "host", "x-forwarded-host"].into_iter().map(|n| (n, seen.header(n))));
    fields.extend(["strict-transport-security", "x-backend", "x-d"].into_iter().map(|n| (n, r.header(n))));
    observed(&r, fields)
}

/// A regular-expression rewrite with a capture; a rewrite that would
/// climb out with `..` is refused.
async fn rules_rewrite(e: Engine) -> Observed {
    let steps = json!([{ "kind": "rewrite_path", "regex": "^/old/(.*)$", "replacement": "/new/$1" }]);
    let (b, p) = rules_rig(e, "old", steps).await;
    let r = e.send(&p, &Req::new("GET", "/old/a/b?q=1")).await;
    p.stop().await;
    observed(&r, vec![("backend got", requests(&b))])
}

/// A redirect built from the request's parts; the backend is not asked.
async fn rules_redirect(e: Engine) -> Observed {
    let steps = json!([{ "kind": "redirect", "status": 301, "location": "https://example.com{uri}" }]);
    let (b, p) = rules_rig(e, "moved", steps).await;
    let r = e.send(&p, &Req::new("GET", "/moved/x?y=1")).await;
    p.stop().await;
    observed(&r, vec![("location", r.header("location")), ("backend got", requests(&b))])
}

/// `deny`, and the client's address against allow and deny lists.
async fn rules_access(e: Engine) -> Observed {
    let b = HyperBackend::start("b0", Behaviour::Echo).await;
    let mut ops = ruled("denied", json!([{ "kind": "deny", "status": 404 }]));
    ops.extend(ruled("outside", json!([{ "kind": "ip_allow", "cidrs": ["10.0.0.0/8"] }])));
    ops.extend(ruled("inside", json!([{ "kind": "ip_allow", "cidrs": ["127.0.0.0/8"] }])));
    ops.extend(ruled("blocked", json!([{ "kind": "ip_deny", "cidrs": ["127.0.0.1"] }])));
    let p = e.start(Limits::default(), config(&[("e", &[b.addr])], ops));
    let mut fields = Vec::new();
    for path in ["/denied", "/outside", "/inside", "/blocked"] {
        let r = e.send(&p, &Req::new("GET", path)).await;
        fields.push((path.trim_start_matches('/').to_string(), format!("{} {}", r.status, text(&r.body).trim_end())));
    }
    p.stop().await;
    let fields = fields.into_iter().map(|(n, v)| (&*n.leak(), v)).chain([("backend got", requests(&b))]).collect();
    Observed { status: 200, fields, body: String::new() }
}

/// Basic auth: no credentials, a wrong password and an unknown user get
/// the challenge; the right ones go through, without `Authorization`.
async fn rules_basic_auth(e: Engine) -> Observed {
    let steps = json!([{ "kind": "basic_auth", "realm": "admin", "users": [{ "name": "ops", "hash": HASH }] }]);
    let (b, p) = rules_rig(e, "admin", steps).await;
    let basic = |cred: &str| format!("Basic {}", base64(cred));
    let none = e.send(&p, &Req::new("GET", "/admin/x")).await;
    let wrong = e.send(&p, &Req::new("GET", "/admin/x").header("authorization", &basic("ops:wrong"))).await;
    let unknown = e.send(&p, &Req::new("GET", "/admin/x").header("authorization", &basic("eve:s3cret"))).await;
    let right = e.send(&p, &Req::new("GET", "/admin/x").header("authorization", &basic("ops:s3cret"))).await;
    p.stop().await;
    let seen = one(&b);
    observed(
        &right,
        vec![
            ("none", format!("{} {}", none.status, none.header("www-authenticate"))),
            ("wrong", wrong.status.to_string()),
            ("unknown", unknown.status.to_string()),
            ("backend got", format!("{} {}", seen.method, seen.uri)),
            ("backend authorization", seen.header("authorization")),
        ],
    )
}

/// Standard base64 of `s` (for `Authorization: Basic`).
fn base64(s: &str) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in s.as_bytes().chunks(3) {
        let n = chunk.iter().enumerate().fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            out.push(if i <= chunk.len() { A[(n >> (18 - 6 * i) & 63) as usize] as char } else { '=' });
        }
    }
    out
}

/// A rate limit of one request per 1,000 s with a burst of 2: two go
/// through, the third gets 429 with `Retry-After`.
async fn rules_rate_limit(e: Engine) -> Observed {
    let steps = json!([{ "kind": "rate_limit", "key": "client_ip", "rate_per_s": 0.001, "burst": 2 }]);
    let (b, p) = rules_rig(e, "limited", steps).await;
    let mut statuses = Vec::new();
    let mut last = None;
    for _ in 0..3 {
        let r = e.send(&p, &Req::new("GET", "/limited/x")).await;
        statuses.push(r.status.to_string());
        last = Some(r);
    }
    p.stop().await;
    let last = last.expect("three requests");
    let retry = last.header("retry-after").parse::<u64>().map_or("-".into(), |s| (s > 900).to_string());
    observed(
        &last,
        vec![
            ("statuses", statuses.join(" ")),
            ("retry-after over 900 s", retry),
            ("backend got", b.seen().len().to_string()),
        ],
    )
}

/// CORS: a preflight from an allowed origin is answered by the proxy; a
/// request from it gets `Access-Control-Allow-Origin`; another origin gets
/// no CORS header.
async fn rules_cors(e: Engine) -> Observed {
    let steps = json!([{ "kind": "cors", "allow_origins": ["https://app.example"], "max_age_s": 60 }]);
    let (b, p) = rules_rig(e, "cors", steps).await;
    let preflight = Req::new("OPTIONS", "/cors/x")
        .header("origin", "https://app.example")
        .header("access-control-request-method", "POST");
    let pre = e.send(&p, &preflight).await;
    let simple = e.send(&p, &Req::new("GET", "/cors/x").header("origin", "https://app.example")).await;
    let other = e.send(&p, &Req::new("GET", "/cors/x").header("origin", "https://evil.example")).await;
    p.stop().await;
    observed(
        &pre,
        vec![
            ("allow-origin", pre.header("access-control-allow-origin")),
            ("allow-methods", pre.header("access-control-allow-methods")),
            ("max-age", pre.header("access-control-max-age")),
            ("simple", format!("{} {}", simple.status, simple.header("access-control-allow-origin"))),
            ("other", format!("{} {}", other.status, other.header("access-control-allow-origin"))),
            ("backend got", requests(&b)),
        ],
    )
}

/// A static route runs its rules too: response headers on its files, and
/// a refusal before any file is read.
async fn rules_static(e: Engine) -> Observed {
    let dir = tempfile::tempdir().expect("a temporary directory");
    std::fs::write(dir.path().join("a.txt"), "static hello\n").expect("a file");
    let ops = vec![
        json!({ "op": "put_rules", "name": "files", "spec": { "steps": [
            { "kind": "set_response_header", "name": "Cache-Control", "value": "max-age=60" },
            { "kind": "ip_deny", "cidrs": ["10.0.0.0/8"] }] } }),
        json!({ "op": "put_rules", "name": "closed", "spec": { "steps": [{ "kind": "deny" }] } }),
        json!({ "op": "put_route", "name": "files", "spec": {
            "match": { "path_prefix": "/files" }, "static": { "root": dir.path() }, "rules": ["files"] } }),
        json!({ "op": "put_route", "name": "closed", "spec": {
            "match": { "path_prefix": "/closed" }, "static": { "root": dir.path() }, "rules": ["closed"] } }),
    ];
    let p = e.start(Limits::default(), config(&[], ops));
    let r = e.send(&p, &Req::new("GET", "/files/a.txt")).await;
    let closed = e.send(&p, &Req::new("GET", "/closed/a.txt")).await;
    p.stop().await;
    observed(&r, vec![("cache-control", r.header("cache-control")), ("closed", closed.status.to_string())])
}

/// An auth service on 127.0.0.1: `Authorization: good` gets 200 with
/// `X-User: alice`; anything else 401 with `WWW-Authenticate: Bearer` and
/// a body. It keeps the `X-Forwarded-Uri` of each request it got.
async fn auth_service() -> (std::net::SocketAddr, Arc<std::sync::Mutex<Vec<String>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("an address");
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let record = record.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
                let field = |name: &str| {
                    head.lines().find_map(|l| l.strip_prefix(name)).map(|v| v.trim().to_string()).unwrap_or_default()
                };
                record.lock().expect("not poisoned").push(field("x-forwarded-uri:"));
                let answer: &[u8] = if field("authorization:") == "good" {
                    b"HTTP/1.1 200 OK\r\nx-user: alice\r\ncontent-length: 0\r\n\r\n"
                } else {
                    b"HTTP/1.1 401 Unauthorized\r\nwww-authenticate: Bearer\r\ncontent-type: text/plain\r\n\
                      content-length: 7\r\n\r\ngo away"
                };
                let _ = stream.write_all(answer).await;
            });
        }
    });
    (addr, seen)
}

/// Forward auth: the service's refusal reaches the client with its body;
/// its 2xx lets the request through with the header it named (a client's
/// own value of it never reaches the backend); a service that is down
/// refuses the request (503), never lets it through.
async fn rules_forward_auth(e: Engine) -> Observed {
    let b = HyperBackend::start("b0", Behaviour::Echo).await;
    let (auth, asked) = auth_service().await;
    // Held to the end: a released port could be a listener of a case
    // running beside this one by the time the rule connects to it.
    let down = DownPort::new();
    let mut ops = ruled(
        "fa",
        json!([{ "kind": "forward_auth", "url": format!("http://{auth}/check"), "copy_headers": ["X-User"] }]),
    );
    ops.extend(ruled("fadown", json!([{ "kind": "forward_auth", "url": format!("http://{}/check", down.addr) }])));
    let p = e.start(Limits::default(), config(&[("e", &[b.addr])], ops));
    let refused = e.send(&p, &Req::new("GET", "/fa/x")).await;
    let allowed =
        e.send(&p, &Req::new("GET", "/fa/x?q=1").header("authorization", "good").header("x-user", "mallory")).await;
    let spoofed = e.send(&p, &Req::new("GET", "/fa/y").header("x-user", "mallory")).await;
    let unreachable = e.send(&p, &Req::new("GET", "/fadown/x").header("authorization", "good")).await;
    p.stop().await;
    let seen = one(&b);
    let asked = asked.lock().expect("not poisoned").join(" ");
    observed(
        &allowed,
        vec![
            ("refused", format!("{} {} {}", refused.status, refused.header("www-authenticate"), text(&refused.body))),
            ("spoofed", spoofed.status.to_string()),
            ("down", format!("{} {}", unreachable.status, text(&unreachable.body).trim_end())),
            ("backend got", format!("{} {}", seen.method, seen.uri)),
            ("backend x-user", seen.header("x-user")),
            ("auth service asked for", asked),
        ],
    )
}

/// Decodes `body` as `coding` says, and tells whether it is `sent`.
fn decoded(coding: &str, body: &[u8], sent: &[u8]) -> String {
    use std::io::Read;
    let mut out = Vec::new();
    let read = match coding {
        "gzip" => flate2::read::GzDecoder::new(body).read_to_end(&mut out).map(|_| ()),
        "br" => brotli::Decompressor::new(body, 4096).read_to_end(&mut out).map(|_| ()),
        "zstd" => zstd::stream::read::Decoder::new(body).and_then(|mut d| d.read_to_end(&mut out)).map(|_| ()),
        "-" => {
            out = body.to_vec();
            Ok(())
        }
        other => return format!("unknown coding {other}"),
    };
    match read {
        Ok(()) => intact(&out, sent),
        Err(e) => format!("undecodable: {e}"),
    }
}

/// Compression: each coding the client prefers, decoded byte-exact; none
/// accepted, the body as it is, with `Vary`; a type not listed, untouched.
async fn rules_compress(e: Engine) -> Observed {
    let steps = json!([{ "kind": "compress", "algorithms": ["zstd", "br", "gzip"] }]);
    let (_b, p) = rules_rig(e, "zip", steps).await;
    let sent: Vec<u8> = (0..20 * 1024)
        .map(|i| b"{\"id\": 12345, \"name\": \"tidegate\", \"tags\": [\"a\", \"b\"]},\n"[i % 52])
        .collect();
    let mut fields = Vec::new();
    for accept in ["gzip", "br;q=0.9, gzip;q=0.5", "zstd, br, gzip", "identity"] {
        let req = Req::new("POST", "/zip/x")
            .header("x-content-type", "application/json")
            .header("accept-encoding", accept)
            .body(sent.clone());
        let r = e.send(&p, &req).await;
        let coding = r.header("content-encoding");
        let shape = format!(
            "{} {coding} vary={} length={} {}",
            r.status,
            r.header("vary"),
            if r.header("content-length") == "-" { "-" } else { "set" },
            decoded(&coding, &r.body, &sent)
        );
        fields.push((accept, shape));
    }
    // Larger than the native engine gathers whole: compressed as it streams.
    let large: Vec<u8> = sent.iter().copied().cycle().take(100 * 1024).collect();
    let req = Req::new("POST", "/zip/x")
        .header("x-content-type", "application/json")
        .header("accept-encoding", "gzip")
        .body(large.clone());
    let r = e.send(&p, &req).await;
    fields.push(("gzip, 100 KiB", format!("{} {}", r.status, decoded(&r.header("content-encoding"), &r.body, &large))));
    let png = Req::new("POST", "/zip/x").header("x-content-type", "image/png").header("accept-encoding", "gzip");
    let r = e.send(&p, &png.body(sent.clone())).await;
    p.stop().await;
    fields.push(("image/png", format!("{} {} vary={}", r.status, r.header("content-encoding"), r.header("vary"))));
    Observed { status: 200, fields, body: String::new() }
}

/// `max_body_bytes`: a declared length over the limit is refused before
/// anything is read; one within goes through.
async fn rules_max_body(e: Engine) -> Observed {
    let (b, p) = rules_rig(e, "small", json!([{ "kind": "max_body_bytes", "bytes": 1000 }])).await;
    let over = e.send(&p, &Req::new("POST", "/small/x").body(vec![b'a'; 2000])).await;
    let within = e.send(&p, &Req::new("POST", "/small/x").body(vec![b'a'; 1000])).await;
    p.stop().await;
    observed(
        &over,
        vec![
            ("within", format!("{} {}", within.status, text(&within.body))),
            ("backend got", b.seen().len().to_string()),
        ],
    )
}

/// `max_body_bytes` on a chunked body, counted as it comes: read ahead
/// whole, or streamed to the backend (no read-ahead): refused with 413
/// either way, and the connection closed.
async fn rules_max_body_chunked(e: Engine) -> Observed {
    let chunked = |n: usize| {
        let mut raw = b"POST /small/x HTTP/1.1\r\nhost: app.test\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
        for _ in 0..n {
            raw.extend_from_slice(b"64\r\n");
            raw.extend_from_slice(&[b'a'; 100]);
            raw.extend_from_slice(b"\r\n");
        }
        raw.extend_from_slice(b"0\r\n\r\n");
        raw
    };
    let mut fields = Vec::new();
    for (read_ahead, buffer) in [("read ahead", 64 * 1024), ("streamed", 0)] {
        let b = HyperBackend::start("b0", Behaviour::Echo).await;
        let limits = Limits { request_buffer_bytes: buffer, ..Limits::default() };
        let ops = ruled("small", json!([{ "kind": "max_body_bytes", "bytes": 1000 }]));
        let p = e.start(limits, config(&[("e", &[b.addr])], ops));
        let within = h1_raw(p.addr, &chunked(10), false).await;
        let over = h1_raw(p.addr, &chunked(11), false).await;
        p.stop().await;
        fields.push((
            read_ahead,
            format!("{} {} then {} {}", within.status, text(&within.body), over.status, text(&over.body).trim_end()),
        ));
    }
    Observed { status: 200, fields, body: String::new() }
}

/// A concurrency limit of one per route: a request answered on a
/// keep-alive connection that stays open holds no place, so a request on
/// another connection goes through.
async fn rules_concurrency_limit(e: Engine) -> Observed {
    let steps = json!([{ "kind": "concurrency_limit", "key": "route", "max": 1 }]);
    let (b, p) = rules_rig(e, "one", steps).await;
    let mut idle = connect(p.addr).await;
    idle.write_all(b"GET /one/a HTTP/1.1\r\nhost: app.test\r\n\r\n").await.expect("written");
    let first = read_reply(&mut idle, &mut Vec::new(), false).await;
    let other = e.send(&p, &Req::new("GET", "/one/b")).await;
    p.stop().await;
    drop(idle);
    observed(&other, vec![("first", first.status.to_string()), ("backend got", requests(&b))])
}

fn cases() -> Vec<Case> {
    macro_rules! case {
        ($name:ident, $on:expr, $expect:expr) => {
            case!($name, $on, $expect, &[])
        };
        ($name:ident, $on:expr, $expect:expr, $differs:expr) => {
            Case {
                name: stringify!($name),
                on: $on,
                run: |e| Box::pin($name(e)),
                expect: $expect,
                differs: {
                    const DIFFERS: &[(Engine, Expect)] = $differs;
                    DIFFERS
                },
            }
        };
    }
    vec![
        case!(
            get,
            ALL,
            ok(&[("content-length", "5"), ("x-backend", "b0"), ("backend got", "GET /e/hello?x=1")], "hello")
        ),
        case!(head, ALL, ok(&[("content-length", "5"), ("backend got", "HEAD /e/hello")], "")),
        case!(
            post_with_length,
            ALL,
            ok(&[("backend got", "POST /e/echo b\"12345\""), ("backend content-length", "5")], "12345")
        ),
        case!(
            post_chunked,
            H1,
            ok(
                &[("backend got", "b\"abcdefg\""), ("backend framing", "content-length 7, transfer-encoding -")],
                "abcdefg"
            )
        ),
        case!(
            post_chunked_streamed,
            H1,
            ok(
                &[
                    ("backend got", "<102400 bytes, intact>"),
                    ("backend framing", "content-length -, transfer-encoding chunked")
                ],
                "<102400 bytes, intact>"
            )
        ),
        case!(
            post_large_buffered,
            ALL,
            ok(
                &[
                    ("backend got", "<102400 bytes, intact>"),
                    ("backend framing", "content-length 102400, transfer-encoding -")
                ],
                "<102400 bytes, intact>"
            )
        ),
        case!(
            post_large_streamed,
            ALL,
            ok(
                &[
                    ("backend got", "<307200 bytes, intact>"),
                    ("backend framing", "content-length 307200, transfer-encoding -")
                ],
                "<307200 bytes, intact>"
            )
        ),
        case!(response_chunked, ALL, ok(&[], "hello, world")),
        case!(response_until_close, ALL, ok(&[], "until close")),
        case!(response_large, ALL, ok(&[("content-length", "1048576")], "<1048576 bytes, intact>")),
        case!(
            response_in_pieces,
            ALL,
            ok(&[("first", "<40960 bytes, intact>"), ("backend connections", "1")], "<40960 bytes, intact>")
        ),
        case!(head_of_large_response, ALL, ok(&[("content-length", "1048576")], "")),
        case!(response_length_and_coding, ALL, ok(&[("content-length", "-")], "hello")),
        case!(backend_body_cut, ALL, ok(&[("by length", "cut"), ("chunked", "cut")], "")),
        case!(
            invalid_response,
            ALL,
            Expect { status: 502, fields: &[], body: "502 the backend sent an invalid response\n" }
        ),
        case!(
            unsolicited_switch,
            ALL,
            Expect { status: 502, fields: &[], body: "502 the backend sent an invalid response\n" }
        ),
        case!(
            response_timeout,
            ALL,
            Expect {
                status: 504,
                fields: &[("backend requests", "1")],
                body: "504 the backend did not answer in time\n"
            }
        ),
        case!(
            queue_full,
            ALL,
            Expect {
                status: 503,
                fields: &[("held request", "502")],
                body: "503 every backend is at its connection limit and the queue is full\n"
            }
        ),
        case!(
            no_route,
            ALL,
            Expect {
                status: 404,
                fields: &[("content-type", "text/plain; charset=utf-8"), ("backend got", "(none)")],
                body: "404 no route matches this request\n"
            }
        ),
        case!(backend_down, ALL, Expect { status: 502, fields: &[], body: "502 could not connect to a backend\n" }),
        case!(
            backend_closes_at_once,
            ALL,
            Expect { status: 502, fields: &[("connections", "1")], body: "502 the backend closed the connection\n" }
        ),
        case!(
            no_backend,
            ALL,
            Expect { status: 503, fields: &[], body: "503 no backend available for this service\n" }
        ),
        case!(
            stale_pooled_connection,
            ALL,
            ok(&[("first", "200 fine"), ("backend connections", "2"), ("backend requests", "3")], "fine")
        ),
        case!(
            stale_pooled_connection_post,
            ALL,
            Expect {
                status: 502,
                fields: &[("first", "200 fine"), ("backend connections", "1"), ("backend requests", "2")],
                body: "502 the backend closed the connection\n"
            }
        ),
        case!(
            shed_and_retried,
            ALL,
            ok(
                &[
                    ("answers", "200 good, 200 good, 200 good, 200 good"),
                    ("shedding backend asked", "true"),
                    ("serving backend asked", "4")
                ],
                ""
            )
        ),
        case!(
            shed_everywhere,
            ALL,
            Expect { status: 503, fields: &[("x-backend", "shed"), ("backend got", "GET /s/x")], body: "busy\n" }
        ),
        case!(
            redirect_https,
            ALL,
            Expect {
                status: 308,
                fields: &[("location", "https://app.test/secure/x?q=1"), ("backend got", "(none)")],
                body: "308 this route is served over HTTPS\n"
            }
        ),
        case!(
            static_files,
            ALL,
            ok(
                &[("content-type", "text/plain"), ("content-length", "13"), ("missing", "404"), ("escape", "400")],
                "static hello\n"
            )
        ),
        case!(
            hop_by_hop_request,
            H1,
            ok(
                &[
                    ("connection", "-"),
                    ("x-private", "-"),
                    ("keep-alive", "-"),
                    ("te", "-"),
                    ("proxy-authorization", "-"),
                    ("proxy-connection", "-"),
                    ("upgrade", "-"),
                    ("x-kept", "1")
                ],
                "hello"
            )
        ),
        case!(hop_by_hop_response, ALL, ok(&[("x-secret", "-"), ("keep-alive", "-"), ("x-kept", "1")], "ok")),
        case!(
            forwarding_headers,
            ALL,
            ok(
                &[
                    ("host", "app.test:8080"),
                    ("x-forwarded-for", "127.0.0.1"),
                    ("forwarded", "-"),
                    ("x-real-ip", "-"),
                    ("x-forwarded-proto", "http"),
                    ("x-forwarded-host", "app.test:8080"),
                    ("x-forwarded-port", "<proxy port>")
                ],
                "hello"
            )
        ),
        case!(
            forwarding_headers_trusted,
            ALL,
            ok(
                &[
                    ("x-forwarded-for", "198.51.100.7, 127.0.0.1"),
                    ("forwarded", "for=198.51.100.7"),
                    ("x-real-ip", "198.51.100.7")
                ],
                "hello"
            )
        ),
        case!(request_id_kept, ALL, ok(&[("backend got", "req-42"), ("client got", "-")], "hello")),
        case!(
            request_id_generated,
            ALL,
            ok(
                &[
                    ("backend got", "<32 hex digits>, <32 hex digits>, <32 hex digits>"),
                    ("distinct ids", "3"),
                    ("client got", "-, -, -")
                ],
                "hello"
            )
        ),
        case!(
            host_forms,
            ALL,
            ok(
                &[(
                    "answers",
                    "app.test 200, APP.Test 200, app.test. 200, app.test:8080 200, app.test.:8080 200, \
                     other.test 404, app.test.. 404"
                )],
                ""
            )
        ),
        case!(dot_segments, ALL, ok(&[("backend got", "GET /e/b/c?q=.."), ("/e/../x", "404")], "hello")),
        // Documented (docs/security.md, "One path"): hyper's parser drops
        // the fragment before the proxy sees the target, and the path
        // before it is routed and forwarded.
        case!(
            fragment_refused,
            H1,
            Expect { status: 400, fields: &[("backend got", "(none)")], body: "400 the request path is invalid\n" },
            &[(Hyper, ok(&[("backend got", "GET /e/a")], "hello"))]
        ),
        // hyper's parsers read heads up to twice the proxy's limits, and
        // the handler refuses one over them with the proxy's answer.
        case!(head_too_large, ALL, HEAD_431),
        case!(too_many_headers, ALL, HEAD_431),
        // Documented (docs/operations.md, "HTTP/1.1 engines" and the error
        // table): past twice the limits, hyper answers itself, before the
        // proxy sees the request, with an empty 431: over HTTP/1.1 on the
        // hyper engine (size and count), over HTTP/2 on both (size; an
        // HTTP/2 head is bounded in bytes only, so its count is always the
        // handler's).
        case!(
            head_far_too_large,
            ALL,
            HEAD_431,
            &[(Hyper, HEAD_431_EMPTY), (H2Native, HEAD_431_EMPTY), (H2Hyper, HEAD_431_EMPTY)]
        ),
        case!(far_too_many_headers, ALL, HEAD_431, &[(Hyper, HEAD_431_EMPTY)]),
        // Both engines answer `100 Continue` themselves and so never
        // forward the expectation (RFC 9110, section 10.1.1).
        case!(expect_continue, H1, ok(&[("interim", "100"), ("backend expect", "-")], "12345")),
        // Documented (docs/operations.md, "HTTP/1.1 engines"; both allowed
        // by RFC 9110 section 2.5, which recommends the server's own
        // version): the native engine answers an HTTP/1.0 request with an
        // `HTTP/1.1` status line, as nginx does; hyper writes `HTTP/1.0`
        // for an HTTP/1.0 peer and has no setting for it.
        case!(
            http10_client,
            H1,
            ok(&[("version", "HTTP/1.1"), ("transfer-encoding", "-"), ("closed after", "true")], "hello, world"),
            &[(
                Hyper,
                ok(&[("version", "HTTP/1.0"), ("transfer-encoding", "-"), ("closed after", "true")], "hello, world")
            )]
        ),
        case!(
            http10_keep_alive,
            H1,
            ok(
                &[("connection", "keep-alive"), ("second", "200 hello"), ("backend got", "GET /e/1; GET /e/2")],
                "hello"
            )
        ),
        case!(bare_lf, H1, ok(&[("backend got", "GET /e/lf")], "hello")),
        // Documented (docs/operations.md, "HTTP/1.1 engines" and the error
        // table): hyper refuses obsolete line folding with an empty 400 of
        // its own, written before the proxy sees the request (hyper's only
        // setting here, `ignore_invalid_headers`, would drop the line and
        // forward the rest, which is worse).
        case!(
            obs_fold,
            H1,
            Expect {
                status: 400,
                fields: &[("backend got", "(none)"), ("backend x-folded", "-")],
                body: "400 the request is malformed\n"
            },
            &[(
                Hyper,
                Expect { status: 400, fields: &[("backend got", "(none)"), ("backend x-folded", "-")], body: "" }
            )]
        ),
        case!(absolute_form, H1, ok(&[("backend got", "GET /e/abs?q=1"), ("backend host", "app.test")], "hello")),
        case!(
            refused_paths,
            ALL,
            Expect {
                status: 200,
                fields: &[
                    ("answers", "/e/a%2Fb 400, /e/a%00 400, /e/a%5Cb 400, /e/..;/x 400, /e/../../x 400, /e/%zz 400"),
                    ("backend got", "(none)")
                ],
                body: ""
            }
        ),
        case!(
            backslash_path,
            H1,
            Expect { status: 400, fields: &[("backend got", "(none)")], body: "400 the request path is invalid\n" }
        ),
        // Documented (docs/fuzzing.md, "Stricter than hyper"): hyper reads
        // `gzip, chunked` as chunked and the proxy forwards the decoded body.
        case!(
            request_coding_not_chunked,
            H1,
            Expect {
                status: 501,
                fields: &[("backend got", "(none)")],
                body: "501 only the chunked transfer coding is supported\n"
            },
            &[(Hyper, ok(&[("backend got", "POST /e/echo")], "abc"))]
        ),
        case!(
            chunked_malformed,
            H1,
            Expect {
                status: 400,
                fields: &[("backend got", "(none)")],
                body: "400 the request body is malformed or incomplete\n"
            }
        ),
        case!(early_hints, H1, ok(&[("interim", "-")], "ok")),
        case!(
            websocket_upgrade,
            H1,
            Expect {
                status: 101,
                fields: &[("upgrade", "websocket"), ("backend upgrade", "websocket"), ("echoed", "ping / and pong")],
                body: ""
            }
        ),
        case!(
            slow_body,
            ALL,
            Expect {
                status: 408,
                fields: &[("whole bodies at the backend", "0")],
                body: "408 the request body arrived too slowly\n"
            }
        ),
        case!(
            client_keep_alive,
            H1,
            ok(&[("first", "200 hello"), ("backend got", "GET /e/1; GET /e/2"), ("closed after", "true")], "hello")
        ),
        // Documented (docs/fuzzing.md, "Stricter than hyper"): hyper frames
        // the body by the coding, serves it, and closes the connection.
        case!(
            framing_conflict,
            H1,
            Expect {
                status: 400,
                fields: &[("backend got", "(none)"), ("closed after", "true")],
                body: "400 the request has both Transfer-Encoding and Content-Length\n"
            },
            &[(Hyper, ok(&[("backend got", "POST /e/echo"), ("closed after", "true")], "hello"))]
        ),
        case!(
            host_missing_or_twice,
            H1,
            Expect {
                status: 400,
                fields: &[
                    ("two hosts", "400 400 the request needs exactly one valid host\n"),
                    ("backend got", "(none)")
                ],
                body: "400 the request needs exactly one valid host\n"
            }
        ),
        case!(
            rules_edit,
            ALL,
            ok(
                &[
                    ("backend got", "GET /hello?x=1"),
                    ("x-a", "1"),
                    ("x-b", "-"),
                    ("x-c", "1, 2"),
                    ("host", "backend.internal"),
                    ("x-forwarded-host", "app.test"),
                    ("strict-transport-security", "max-age=63072000"),
                    ("x-backend", "-"),
                    ("x-d", "4"),
                ],
                "hello"
            )
        ),
        case!(rules_rewrite, ALL, ok(&[("backend got", "GET /new/a/b?q=1")], "hello")),
        case!(
            rules_redirect,
            ALL,
            Expect {
                status: 301,
                fields: &[("location", "https://example.com/moved/x?y=1"), ("backend got", "(none)")],
                body: ""
            }
        ),
        case!(
            rules_access,
            ALL,
            Expect {
                status: 200,
                fields: &[
                    ("denied", "404 refused"),
                    ("outside", "403 forbidden"),
                    ("inside", "200 hello"),
                    ("blocked", "403 forbidden"),
                    ("backend got", "GET /inside")
                ],
                body: ""
            }
        ),
        case!(
            rules_basic_auth,
            ALL,
            ok(
                &[
                    ("none", "401 Basic realm=\"admin\", charset=\"UTF-8\""),
                    ("wrong", "401"),
                    ("unknown", "401"),
                    ("backend got", "GET /admin/x"),
                    ("backend authorization", "-")
                ],
                "hello"
            )
        ),
        case!(
            rules_rate_limit,
            ALL,
            Expect {
                status: 429,
                fields: &[("statuses", "200 200 429"), ("retry-after over 900 s", "true"), ("backend got", "2")],
                body: "too many requests\n"
            }
        ),
        case!(
            rules_cors,
            ALL,
            Expect {
                status: 204,
                fields: &[
                    ("allow-origin", "https://app.example"),
                    ("allow-methods", "GET, HEAD, POST"),
                    ("max-age", "60"),
                    ("simple", "200 https://app.example"),
                    ("other", "200 -"),
                    ("backend got", "GET /cors/x; GET /cors/x")
                ],
                body: ""
            }
        ),
        case!(
            rules_forward_auth,
            ALL,
            ok(
                &[
                    ("refused", "401 Bearer go away"),
                    ("spoofed", "401"),
                    ("down", "503 the authentication service did not answer"),
                    ("backend got", "GET /fa/x?q=1"),
                    ("backend x-user", "alice"),
                    ("auth service asked for", "/fa/x /fa/x?q=1 /fa/y")
                ],
                "hello"
            )
        ),
        case!(
            rules_compress,
            ALL,
            Expect {
                status: 200,
                fields: &[
                    ("gzip", "200 gzip vary=Accept-Encoding length=- <20480 bytes, intact>"),
                    ("br;q=0.9, gzip;q=0.5", "200 br vary=Accept-Encoding length=- <20480 bytes, intact>"),
                    ("zstd, br, gzip", "200 zstd vary=Accept-Encoding length=- <20480 bytes, intact>"),
                    ("identity", "200 - vary=Accept-Encoding length=set <20480 bytes, intact>"),
                    ("gzip, 100 KiB", "200 <102400 bytes, intact>"),
                    ("image/png", "200 - vary=-")
                ],
                body: ""
            }
        ),
        case!(
            rules_max_body,
            ALL,
            Expect {
                status: 413,
                fields: &[("within", "200 <1000 bytes>"), ("backend got", "1")],
                body: "request body too large\n"
            }
        ),
        case!(
            rules_max_body_chunked,
            H1,
            Expect {
                status: 200,
                fields: &[
                    ("read ahead", "200 <1000 bytes> then 413 413 the request body is larger than this route takes"),
                    ("streamed", "200 <1000 bytes> then 413 413 the request body is larger than this route takes")
                ],
                body: ""
            }
        ),
        case!(
            rules_concurrency_limit,
            ALL,
            ok(&[("first", "200"), ("backend got", "GET /one/a; GET /one/b")], "hello")
        ),
        case!(rules_static, ALL, ok(&[("cache-control", "max-age=60"), ("closed", "403")], "static hello\n")),
        case!(
            expect_continue_streamed,
            H1,
            ok(
                &[("interim", "100"), ("backend expect", "-"), ("backend got", "<8192 bytes, intact>")],
                "<8192 bytes, intact>"
            )
        ),
    ]
}

/// Runs every case on every engine it applies to, a few at a time (each
/// has its own proxy and backends), and reports every mismatch at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_case_on_every_engine() {
    let cases = Arc::new(cases());
    let names: std::collections::HashSet<_> = cases.iter().map(|c| c.name).collect();
    assert_eq!(names.len(), cases.len(), "case names are unique");
    let slots = Arc::new(tokio::sync::Semaphore::new(6));
    let mut runs = tokio::task::JoinSet::new();
    // `TIDEGATE_CASE=name` runs the cases whose name contains `name`.
    let only = std::env::var("TIDEGATE_CASE").unwrap_or_default();
    for (i, case) in cases.iter().enumerate().filter(|(_, c)| c.name.contains(only.as_str())) {
        for &engine in case.on {
            let (slots, run) = (slots.clone(), case.run);
            runs.spawn(async move {
                let _slot = slots.acquire_owned().await.expect("open");
                // Its own task: a panic is reported as the case's result.
                let observed = match tokio::time::timeout(Duration::from_secs(30), tokio::spawn(run(engine))).await {
                    Ok(Ok(o)) => o,
                    Ok(Err(e)) => {
                        Observed { status: 0, fields: vec![("panicked", e.to_string())], body: String::new() }
                    }
                    Err(_) => Observed { status: 0, fields: vec![("timed out", "30 s".into())], body: String::new() },
                };
                (i, engine, observed)
            });
        }
    }
    let mut mismatches = Vec::new();
    let mut count = 0;
    while let Some(done) = runs.join_next().await {
        let (i, engine, observed) = done.expect("a run task");
        count += 1;
        let case = &cases[i];
        let expected = case.expected(engine);
        if !expected.matches(&observed) {
            mismatches.push(format!("{} on {engine:?}:\n  expected {expected:?}\n  observed {observed:?}", case.name));
        }
    }
    mismatches.sort();
    assert!(count > 0, "no case matches TIDEGATE_CASE={only:?}");
    eprintln!("{count} runs");
    assert!(mismatches.is_empty(), "{} of {count} runs differ:\n{}", mismatches.len(), mismatches.join("\n"));
}
