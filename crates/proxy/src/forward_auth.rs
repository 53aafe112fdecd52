//! The forward-auth client: the sub-request a `forward_auth` step asks the
//! proxy to make ([`tidegate_rules::Work::ForwardAuth`]).
//!
//! [`ask`] connects over plain TCP to the auth service, sends one
//! `GET` with `Connection: close`, and reads the answer with the native
//! engine's codec ([`tidegate_h1`], strict heads on `httparse`): a head of
//! at most [`MAX_HEAD`] bytes and [`MAX_FIELDS`] fields, and for a refusal
//! (any status but 2xx) at most [`MAX_BODY`] bytes of its body, the rest
//! cut. The whole exchange (name resolution, connect, send, read) runs
//! within the step's timeout.
//!
//! Every error fails closed: the caller refuses the request with
//! [`tidegate_rules::Chain::auth_failed`] (503), never lets it through.
//!
//! This version opens a connection per sub-request (`Connection: close`):
//! an auth service on the same host or network answers a connect in well
//! under a millisecond, and a pool kept per authority would add idle
//! expiry, stale-connection retries and a bound per worker for little
//! gain at the rates auth services are asked at. A pool can come later
//! behind the same [`ask`].

use std::io;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};
use tidegate_h1::{ChunkedDecoder, ChunkedError, HeadError, HeadLimits, HeaderKind, ResponseBody, ResponseHead};
use tidegate_rules::{AuthAnswer, AuthRequest};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Largest answer head (status line and fields, interim answers
/// included), bytes.
pub(crate) const MAX_HEAD: usize = 16 * 1024;
/// Most header fields in the answer's head.
pub(crate) const MAX_FIELDS: usize = 100;
/// Most bytes of a refusal's body kept; the rest is cut.
pub(crate) const MAX_BODY: usize = 64 * 1024;
/// Bytes read from the connection at a time.
const READ_CHUNK: usize = 8 * 1024;

/// Why an auth service gave no usable answer. Each names the service's
/// `host:port`; every one means the request is refused (503).
#[derive(Debug, thiserror::Error)]
pub(crate) enum AuthError {
    /// The request cannot be written as HTTP/1.1 (a target or authority
    /// with spaces or control characters; the model never makes one).
    #[error("forward auth {authority}: cannot send {what}")]
    Request {
        /// The auth service, `host:port`.
        authority: String,
        /// What is wrong.
        what: &'static str,
    },
    /// The host name does not resolve, or to no address.
    #[error("forward auth {authority}: cannot resolve the host: {source}")]
    Resolve {
        /// The auth service, `host:port`.
        authority: String,
        /// The resolver's error.
        #[source]
        source: io::Error,
    },
    /// No address of the service accepted a connection.
    #[error("forward auth {authority}: cannot connect: {source}")]
    Connect {
        /// The auth service, `host:port`.
        authority: String,
        /// The last address's error.
        #[source]
        source: io::Error,
    },
    /// Writing the request or reading the answer failed.
    #[error("forward auth {authority}: connection failed: {source}")]
    Io {
        /// The auth service, `host:port`.
        authority: String,
        /// The socket's error.
        #[source]
        source: io::Error,
    },
    /// The service closed the connection before its answer was complete
    /// (in its head, or in a body shorter than it said).
    #[error("forward auth {authority}: the connection closed before the answer was complete")]
    Closed {
        /// The auth service, `host:port`.
        authority: String,
    },
    /// The answer's head is not HTTP/1.x, too large, has too many fields,
    /// or a framing the proxy does not read.
    #[error("forward auth {authority}: malformed answer head: {source}")]
    Head {
        /// The auth service, `host:port`.
        authority: String,
        /// What the codec refused.
        #[source]
        source: HeadError,
    },
    /// A chunked body that breaks the coding's rules.
    #[error("forward auth {authority}: malformed answer body: {source}")]
    Body {
        /// The auth service, `host:port`.
        authority: String,
        /// What the decoder refused.
        #[source]
        source: ChunkedError,
    },
    /// `101 Switching Protocols`, to a request that asked for no upgrade.
    #[error("forward auth {authority}: answered 101 Switching Protocols, which was not asked for")]
    Upgrade {
        /// The auth service, `host:port`.
        authority: String,
    },
    /// No complete answer within the step's timeout.
    #[error("forward auth {authority}: no answer within {} ms", timeout.as_millis())]
    Timeout {
        /// The auth service, `host:port`.
        authority: String,
        /// The step's timeout.
        timeout: Duration,
    },
}

/// Asks the auth service of `req` and reads its answer, all within
/// `req.timeout`. A 2xx answer's body is not read; a refusal's is, up to
/// [`MAX_BODY`] bytes, for the proxy to send on. The answer's headers
/// leave out those of its connection and framing (hop-by-hop fields,
/// `Content-Length`).
pub(crate) async fn ask(req: &AuthRequest) -> Result<AuthAnswer, AuthError> {
    match tokio::time::timeout(req.timeout, exchange(req)).await {
        Ok(answer) => answer,
        Err(_) => Err(AuthError::Timeout { authority: req.authority.clone(), timeout: req.timeout }),
    }
}

async fn exchange(req: &AuthRequest) -> Result<AuthAnswer, AuthError> {
    let authority = req.authority.as_str();
    let head = request_head(req)?;
    let addrs = tokio::net::lookup_host(authority)
        .await
        .map_err(|source| AuthError::Resolve { authority: authority.to_string(), source })?;
    let mut last = io::Error::new(io::ErrorKind::NotFound, "the name has no address");
    let mut conn = None;
    for addr in addrs {
        match TcpStream::connect(addr).await {
            Ok(c) => {
                conn = Some(c);
                break;
            }
            Err(e) => last = e,
        }
    }
    let Some(mut conn) = conn else {
        return Err(AuthError::Connect { authority: authority.to_string(), source: last });
    };
    // Small writes, one round trip: do not wait for Nagle.
    let _ = conn.set_nodelay(true);
    let io_error = |source| AuthError::Io { authority: authority.to_string(), source };
    conn.write_all(&head).await.map_err(io_error)?;
    read_answer(&mut conn, authority).await
}

/// Whether `s` can stand in a request line or field as it is.
fn visible(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_graphic())
}

/// The request's head: `GET`, `Host`, the given fields but those that
/// would change the exchange's framing or connection, `Connection: close`.
fn request_head(req: &AuthRequest) -> Result<Vec<u8>, AuthError> {
    let bad = |what| AuthError::Request { authority: req.authority.clone(), what };
    if !visible(&req.path_and_query) || !req.path_and_query.starts_with('/') {
        return Err(bad("its request target"));
    }
    if !visible(&req.authority) {
        return Err(bad("its host"));
    }
    // The model writes `:80` when the URL names no port; a Host field
    // without the default port is what the URL meant.
    let host = req.authority.strip_suffix(":80").unwrap_or(&req.authority);
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(b"GET ");
    out.extend_from_slice(req.path_and_query.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    out.extend_from_slice(host.as_bytes());
    out.extend_from_slice(b"\r\n");
    for (name, value) in &req.headers {
        let kind = HeaderKind::of(name.as_str().as_bytes());
        if kind.is_hop_by_hop() || matches!(kind, HeaderKind::Host | HeaderKind::ContentLength | HeaderKind::Expect) {
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"connection: close\r\n\r\n");
    Ok(out)
}

/// Reads more bytes into `buf`; `Ok(false)` at the end of the stream.
async fn fill<R: AsyncRead + Unpin>(io: &mut R, buf: &mut Vec<u8>, authority: &str) -> Result<bool, AuthError> {
    let mut chunk = [0u8; READ_CHUNK];
    let n = io.read(&mut chunk).await.map_err(|source| AuthError::Io { authority: authority.to_string(), source })?;
    buf.extend_from_slice(&chunk[..n]);
    Ok(n > 0)
}

/// Reads an answer (interim 1xx answers skipped) from `io`: its head, and
/// for a refusal its body, bounded as the module says.
async fn read_answer<R: AsyncRead + Unpin>(io: &mut R, authority: &str) -> Result<AuthAnswer, AuthError> {
    let closed = || AuthError::Closed { authority: authority.to_string() };
    let malformed = |source| AuthError::Head { authority: authority.to_string(), source };
    let mut buf: Vec<u8> = Vec::with_capacity(READ_CHUNK);
    let mut head = ResponseHead::default();
    // Head bytes already taken by interim answers: they count toward the
    // bound as well.
    let mut skipped = 0;
    loop {
        let limits = HeadLimits { max_bytes: MAX_HEAD - skipped, max_headers: MAX_FIELDS };
        match tidegate_h1::parse_response(&buf, limits, false, &mut head).map_err(malformed)? {
            Some(()) if head.is_interim() => {
                skipped += head.len;
                buf.drain(..head.len);
            }
            Some(()) => break,
            None => {
                if !fill(io, &mut buf, authority).await? {
                    return Err(closed());
                }
            }
        }
    }
    if head.code == 101 {
        return Err(AuthError::Upgrade { authority: authority.to_string() });
    }
    let mut headers = HeaderMap::with_capacity(head.headers.len());
    for field in &head.headers {
        if field.kind.is_hop_by_hop() || field.kind == HeaderKind::ContentLength {
            continue;
        }
        let name = HeaderName::from_bytes(field.name.of(&buf));
        let value = HeaderValue::from_bytes(field.value.of(&buf));
        let (Ok(name), Ok(value)) = (name, value) else {
            return Err(malformed(HeadError::Syntax("a header field the proxy cannot carry")));
        };
        headers.append(name, value);
    }
    let body = if (200..300).contains(&head.code) {
        Bytes::new()
    } else {
        let rest = buf.split_off(head.len);
        read_body(io, head.body, rest, authority).await?
    };
    Ok(AuthAnswer { status: head.code, headers, body })
}

/// Reads a refusal's body, framed by `framing`, starting with `rest` (the
/// bytes read after the head), up to [`MAX_BODY`] bytes.
async fn read_body<R: AsyncRead + Unpin>(
    io: &mut R,
    framing: ResponseBody,
    mut rest: Vec<u8>,
    authority: &str,
) -> Result<Bytes, AuthError> {
    let closed = || AuthError::Closed { authority: authority.to_string() };
    let body = match framing {
        ResponseBody::None => Vec::new(),
        ResponseBody::Length(n) => {
            let want = usize::try_from(n).unwrap_or(usize::MAX).min(MAX_BODY);
            while rest.len() < want {
                if !fill(io, &mut rest, authority).await? {
                    return Err(closed());
                }
            }
            rest.truncate(want);
            rest
        }
        ResponseBody::UntilClose => {
            while rest.len() < MAX_BODY && fill(io, &mut rest, authority).await? {}
            rest.truncate(MAX_BODY);
            rest
        }
        ResponseBody::Chunked => {
            let mut decoder = ChunkedDecoder::default();
            let mut body = Vec::new();
            loop {
                let mut at = 0;
                while at < rest.len() && body.len() < MAX_BODY && !decoder.is_done() {
                    let input = &rest[at..];
                    let step = decoder
                        .decode(input)
                        .map_err(|source| AuthError::Body { authority: authority.to_string(), source })?;
                    if let Some(data) = step.data {
                        let room = MAX_BODY - body.len();
                        let data = input.get(data).unwrap_or_default();
                        body.extend_from_slice(&data[..data.len().min(room)]);
                    }
                    if step.consumed == 0 {
                        break;
                    }
                    at += step.consumed;
                }
                rest.drain(..at);
                if decoder.is_done() || body.len() >= MAX_BODY {
                    break body;
                }
                if !fill(io, &mut rest, authority).await? {
                    return Err(closed());
                }
            }
        }
    };
    Ok(Bytes::from(body))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tokio::net::TcpListener;

    const LONG: Duration = Duration::from_secs(10);

    /// A one-connection server: reads the request head, sends it on the
    /// channel, writes each of `parts` (flushed apart), and closes, or
    /// keeps the connection open without a word when `silent`.
    async fn server(parts: Vec<Vec<u8>>, silent: bool) -> (String, tokio::sync::oneshot::Receiver<String>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let Ok((mut conn, _)) = listener.accept().await else { return };
            let mut seen = Vec::new();
            let mut chunk = [0u8; 4096];
            while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                match conn.read(&mut chunk).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => seen.extend_from_slice(&chunk[..n]),
                }
            }
            let _ = tx.send(String::from_utf8_lossy(&seen).into_owned());
            if silent {
                std::future::pending::<()>().await;
            }
            for p in parts {
                if conn.write_all(&p).await.is_err() || conn.flush().await.is_err() {
                    return;
                }
            }
        });
        (addr, rx)
    }

    fn request(authority: &str, timeout: Duration) -> AuthRequest {
        let h = |n: &'static str, v: &'static str| (HeaderName::from_static(n), HeaderValue::from_static(v));
        AuthRequest {
            authority: authority.to_string(),
            path_and_query: "/check?x=1".to_string(),
            headers: vec![
                h("authorization", "Bearer t"),
                h("connection", "keep-alive"),
                h("transfer-encoding", "chunked"),
                h("x-forwarded-uri", "/p?a=1"),
            ],
            timeout,
        }
    }

    async fn ask_with(parts: &[&[u8]]) -> Result<AuthAnswer, AuthError> {
        let (addr, _seen) = server(parts.iter().map(|p| p.to_vec()).collect(), false).await;
        ask(&request(&addr, LONG)).await
    }

    #[tokio::test]
    async fn an_allowing_answer_carries_its_headers_and_the_request_its_fields() {
        let (addr, seen) =
            server(vec![b"HTTP/1.1 200 OK\r\nX-User: alice\r\nContent-Length: 4\r\n\r\nokay".to_vec()], false).await;
        let answer = ask(&request(&addr, LONG)).await.expect("an answer");
        assert_eq!(answer.status, 200);
        assert_eq!(answer.headers.get("x-user").expect("x-user"), "alice");
        assert!(answer.headers.get("content-length").is_none(), "framing is not an answer header");
        assert!(answer.body.is_empty(), "an allowing answer's body is not read");
        let seen = seen.await.expect("the request head").to_ascii_lowercase();
        assert!(seen.starts_with("get /check?x=1 http/1.1\r\n"), "{seen}");
        assert!(seen.contains(&format!("\r\nhost: {addr}\r\n")), "{seen}");
        assert!(seen.contains("\r\nauthorization: bearer t\r\n"), "{seen}");
        assert!(seen.contains("\r\nx-forwarded-uri: /p?a=1\r\n"), "{seen}");
        assert!(seen.contains("\r\nconnection: close\r\n"), "{seen}");
        assert!(!seen.contains("keep-alive") && !seen.contains("transfer-encoding"), "{seen}");
    }

    #[tokio::test]
    async fn a_refusal_carries_its_challenge_and_body() {
        let answer = ask_with(&[
            b"HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer realm=\"x\"\r\nContent-Length: 11\r\n\r\n",
            b"who are you",
        ])
        .await
        .expect("an answer");
        assert_eq!(answer.status, 401);
        assert_eq!(answer.headers.get("www-authenticate").expect("challenge"), "Bearer realm=\"x\"");
        assert_eq!(&answer.body[..], b"who are you");
    }

    #[tokio::test]
    async fn chunked_and_close_delimited_bodies_are_read() {
        let answer = ask_with(&[
            b"HTTP/1.1 403 Forbidden\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel",
            b"lo\r\n6;ext=1\r\n world\r\n0\r\n",
            b"\r\n",
        ])
        .await
        .expect("an answer");
        assert_eq!((answer.status, &answer.body[..]), (403, &b"hello world"[..]));
        assert!(answer.headers.get("transfer-encoding").is_none());

        let answer =
            ask_with(&[b"HTTP/1.1 302 Found\r\nLocation: /login\r\n\r\ngo ", b"log in"]).await.expect("answer");
        assert_eq!((answer.status, &answer.body[..]), (302, &b"go log in"[..]));
        assert_eq!(answer.headers.get("location").expect("location"), "/login");
    }

    #[tokio::test]
    async fn interim_answers_are_skipped() {
        let answer = ask_with(&[b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\nX-User: bob\r\n\r\n"])
            .await
            .expect("an answer");
        assert_eq!(answer.status, 204);
        assert_eq!(answer.headers.get("x-user").expect("x-user"), "bob");
    }

    #[tokio::test]
    async fn a_long_body_is_cut() {
        let big = vec![b'a'; MAX_BODY + 5000];
        let head = format!("HTTP/1.1 403 Forbidden\r\nContent-Length: {}\r\n\r\n", big.len());
        let answer = ask_with(&[head.as_bytes(), &big]).await.expect("an answer");
        assert_eq!(answer.body.len(), MAX_BODY);
        let answer = ask_with(&[b"HTTP/1.1 403 Forbidden\r\n\r\n", &big]).await.expect("an answer");
        assert_eq!(answer.body.len(), MAX_BODY);
        let mut chunked = b"HTTP/1.1 403 Forbidden\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
        for _ in 0..20 {
            chunked.extend_from_slice(format!("{:x}\r\n", 5000).as_bytes());
            chunked.extend_from_slice(&big[..5000]);
            chunked.extend_from_slice(b"\r\n");
        }
        chunked.extend_from_slice(b"0\r\n\r\n");
        let answer = ask_with(&[&chunked]).await.expect("an answer");
        assert_eq!(answer.body.len(), MAX_BODY);
    }

    #[tokio::test]
    async fn a_silent_service_times_out() {
        let (addr, _seen) = server(Vec::new(), true).await;
        let e = ask(&request(&addr, Duration::from_millis(50))).await.expect_err("no answer");
        assert!(matches!(e, AuthError::Timeout { .. }), "{e:?}");
        assert!(e.to_string().contains(&addr), "{e}");
    }

    #[tokio::test]
    async fn broken_answers_fail() {
        let e = ask_with(&[b"HTTP/1.1 200 OK\r\nX-User: al"]).await.expect_err("closed mid-head");
        assert!(matches!(e, AuthError::Closed { .. }), "{e:?}");
        let e = ask_with(&[b""]).await.expect_err("closed before a word");
        assert!(matches!(e, AuthError::Closed { .. }), "{e:?}");
        let e = ask_with(&[b"HTTP/1.1 401 No\r\nContent-Length: 10\r\n\r\nshort"]).await.expect_err("short body");
        assert!(matches!(e, AuthError::Closed { .. }), "{e:?}");
        let e =
            ask_with(&[b"HTTP/1.1 401 No\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"]).await.expect_err("bad chunk");
        assert!(matches!(e, AuthError::Body { .. }), "{e:?}");
        let e = ask_with(&[b"SMTP ready\r\n\r\n"]).await.expect_err("not HTTP");
        assert!(matches!(e, AuthError::Head { .. }), "{e:?}");
        let e = ask_with(&[b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n"]).await.expect_err("upgrade");
        assert!(matches!(e, AuthError::Upgrade { .. }), "{e:?}");

        let big = format!("HTTP/1.1 200 OK\r\nX-Big: {}\r\n\r\n", "b".repeat(MAX_HEAD));
        let e = ask_with(&[big.as_bytes()]).await.expect_err("oversize head");
        assert!(matches!(e, AuthError::Head { source: HeadError::TooLarge, .. }), "{e:?}");
        let many: String = (0..MAX_FIELDS + 1).map(|i| format!("x-{i}: v\r\n")).collect();
        let e = ask_with(&[format!("HTTP/1.1 200 OK\r\n{many}\r\n").as_bytes()]).await.expect_err("too many fields");
        assert!(matches!(e, AuthError::Head { source: HeadError::TooManyHeaders, .. }), "{e:?}");
        let interims = "HTTP/1.1 100 Continue\r\n\r\n".repeat(MAX_HEAD / 20);
        let e = ask_with(&[interims.as_bytes()]).await.expect_err("endless interim answers");
        assert!(matches!(e, AuthError::Head { source: HeadError::TooLarge, .. }), "{e:?}");
    }

    #[tokio::test]
    async fn an_unreachable_service_fails_to_connect() {
        // A port just freed: nothing listens there.
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        drop(listener);
        let e = ask(&request(&addr, LONG)).await.expect_err("refused");
        assert!(matches!(e, AuthError::Connect { .. }), "{e:?}");
        assert!(e.to_string().contains(&addr), "{e}");

        // `.invalid` never resolves (RFC 6761); a machine whose resolver
        // is unreachable may only time out, which refuses as well.
        let e = ask(&request("no-such-host.invalid:80", LONG)).await.expect_err("no such name");
        assert!(
            matches!(e, AuthError::Resolve { .. } | AuthError::Connect { .. } | AuthError::Timeout { .. }),
            "{e:?}"
        );

        let mut bad = request(&addr, LONG);
        bad.path_and_query = "/a b".into();
        assert!(matches!(ask(&bad).await, Err(AuthError::Request { .. })));
    }

    #[test]
    fn the_host_field_leaves_out_the_default_port() {
        let mut r = request("auth.internal:80", LONG);
        let head = String::from_utf8(request_head(&r).expect("a head")).expect("text");
        assert!(head.contains("\r\nhost: auth.internal\r\n"), "{head}");
        r.authority = "[::1]:9000".into();
        let head = String::from_utf8(request_head(&r).expect("a head")).expect("text");
        assert!(head.contains("\r\nhost: [::1]:9000\r\n"), "{head}");
    }

    fn read_bytes(input: &[u8]) -> Result<AuthAnswer, AuthError> {
        let rt = tokio::runtime::Builder::new_current_thread().build().expect("a runtime");
        let mut io = input;
        rt.block_on(read_answer(&mut io, "auth:80"))
    }

    proptest! {
        /// No bytes a service sends make the reader panic or keep more than
        /// its bounds.
        #[test]
        fn arbitrary_answers_never_panic(input in proptest::collection::vec(any::<u8>(), 0..2000)) {
            if let Ok(a) = read_bytes(&input) {
                prop_assert!(a.body.len() <= MAX_BODY);
            }
        }

        /// A valid refusal, cut or with any byte altered, reads or fails
        /// cleanly.
        #[test]
        fn altered_refusals_never_panic(at in 0usize..120, byte in any::<u8>(), cut in 0usize..120) {
            let mut input = b"HTTP/1.1 401 No\r\nTransfer-Encoding: chunked\r\nX-A: b\r\n\r\n4\r\nabcd\r\n3;e=f\r\nxyz\r\n0\r\nT: v\r\n\r\n".to_vec();
            if at < input.len() {
                input[at] = byte;
            }
            input.truncate(cut.max(1));
            if let Ok(a) = read_bytes(&input) {
                // Altered framing may read the rest until the close.
                prop_assert!(a.body.len() <= input.len());
            }
        }
    }
}
