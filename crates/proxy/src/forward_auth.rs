//! The forward-auth client: the sub-request a `forward_auth` step asks the
//! proxy to make ([`tidegate_rules::Work::ForwardAuth`]).
//!
//! [`ask`] sends one `GET` to the auth service through the small HTTP/1.1
//! client the proxy's other side requests use
//! ([`tidegate_upstream::HttpClient`]: a keep-alive pool
//! shared by the process, so a busy route does not pay a connect per
//! request), and reads the answer: its head, and for a refusal (any status
//! but 2xx) at most [`MAX_BODY`] bytes of its body, the rest cut. The whole
//! exchange runs within the step's timeout.
//!
//! Every error fails closed: the caller refuses the request with
//! [`tidegate_rules::Chain::auth_failed`] (503), never lets it through.

use std::sync::OnceLock;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderName};
use http::{Method, Request};
use http_body_util::{BodyExt, Full};
use tidegate_rules::{AuthAnswer, AuthRequest};
use tidegate_upstream::{HttpClient, HttpError, HttpOptions};

/// Most bytes of a refusal's body kept; the rest is cut.
pub(crate) const MAX_BODY: usize = 64 * 1024;

/// Idle keep-alive connections kept per auth service.
const IDLE_PER_SERVICE: usize = 64;

/// Why an auth service gave no usable answer; every one means the request
/// is refused (503).
#[derive(Debug, thiserror::Error)]
#[error("forward auth to {authority}: {why}")]
pub(crate) struct AuthError {
    /// The auth service, `host:port`.
    authority: String,
    /// What went wrong.
    #[source]
    why: Why,
}

/// What went wrong with a sub-request.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Why {
    /// Building, connecting, sending or reading the head failed.
    #[error(transparent)]
    Http(#[from] HttpError),
    /// Reading a refusal's body failed.
    #[error("reading the answer's body: {0}")]
    Body(#[source] hyper::Error),
    /// An interim or switching answer (1xx) where a final one was due.
    #[error("answered {0}, not a final status")]
    NotFinal(http::StatusCode),
    /// No complete answer within the step's timeout.
    #[error("no answer within {} ms", .0.as_millis())]
    Timeout(Duration),
}

/// The process's client for auth services.
fn client() -> &'static HttpClient {
    static CLIENT: OnceLock<HttpClient> = OnceLock::new();
    CLIENT.get_or_init(|| {
        HttpClient::new(HttpOptions {
            connect_timeout: Duration::from_secs(2),
            idle_per_host: IDLE_PER_SERVICE,
            idle_timeout: Duration::from_secs(30),
        })
    })
}

/// Whether a field of the request is left out of the sub-request: those
/// that frame or manage its own connection, which the client writes, and
/// a client's `X-Client-Cert-*` fields, which only the proxy sets (an auth
/// service must not believe them).
fn left_out(name: &HeaderName) -> bool {
    crate::hygiene::client_cert_field(name.as_str().as_bytes())
        || [
            header::HOST,
            header::CONTENT_LENGTH,
            header::TRANSFER_ENCODING,
            header::CONNECTION,
            header::EXPECT,
            header::TE,
            header::UPGRADE,
        ]
        .contains(name)
        || name.as_str() == "keep-alive"
        || name.as_str() == "proxy-connection"
}

/// Asks the auth service: `GET` its URL with the step's headers, within
/// the step's timeout.
pub(crate) async fn ask(req: &AuthRequest) -> Result<AuthAnswer, AuthError> {
    let failed = |why: Why| {
        let why = match why {
            Why::Http(HttpError::Timeout(t)) => Why::Timeout(t),
            why => why,
        };
        AuthError { authority: req.authority.clone(), why }
    };
    let build = || {
        let mut request =
            Request::builder().method(Method::GET).uri(format!("http://{}{}", req.authority, req.path_and_query));
        if let Some(headers) = request.headers_mut() {
            for (name, value) in req.headers.iter().filter(|(n, _)| !left_out(n)) {
                headers.append(name.clone(), value.clone());
            }
        }
        request.body(Full::new(Bytes::new())).map_err(HttpError::Build)
    };
    let asking = async {
        let answer = match client().head(build()?, req.timeout).await {
            // A kept-alive connection the service closed as the question
            // went out (its idle timeout against ours): the question is a
            // GET, asked once more on a new connection.
            Err(HttpError::Exchange(e)) if !e.is_connect() => client().head(build()?, req.timeout).await?,
            answer => answer?,
        };
        let (head, mut body) = answer.into_parts();
        if head.status.is_informational() {
            return Err(Why::NotFinal(head.status));
        }
        // A 2xx lets the request through: its body is not read (dropping
        // it closes that connection if any of it is left).
        let mut kept = BytesMut::new();
        if !head.status.is_success() {
            while kept.len() < MAX_BODY {
                let Some(frame) = body.frame().await else { break };
                if let Ok(data) = frame.map_err(Why::Body)?.into_data() {
                    kept.extend_from_slice(&data[..data.len().min(MAX_BODY - kept.len())]);
                }
            }
        }
        Ok(AuthAnswer { status: head.status.as_u16(), headers: head.headers, body: kept.freeze() })
    };
    match tokio::time::timeout(req.timeout, asking).await {
        Ok(answer) => answer.map_err(failed),
        Err(_) => Err(failed(Why::Timeout(req.timeout))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// A request head read from `s` (None when the connection ends first).
    async fn read_head(s: &mut tokio::net::TcpStream) -> Option<Vec<u8>> {
        let mut head = Vec::new();
        let mut buf = [0u8; 4096];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return None,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        Some(head)
    }

    /// A service answering each connection's first request with `answer`
    /// (or never, for `None`); the request heads it read come on the
    /// channel.
    async fn service(answer: Option<Vec<u8>>) -> (String, tokio::sync::mpsc::UnboundedReceiver<String>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("an address").to_string();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let (tx, answer) = (tx.clone(), answer.clone());
                tokio::spawn(async move {
                    let Some(head) = read_head(&mut s).await else { return };
                    let _ = tx.send(String::from_utf8_lossy(&head).into_owned());
                    match answer {
                        Some(a) => {
                            let _ = s.write_all(&a).await;
                        }
                        None => std::future::pending::<()>().await,
                    }
                });
            }
        });
        (addr, rx)
    }

    fn request(authority: &str, timeout_ms: u64) -> AuthRequest {
        AuthRequest {
            authority: authority.to_string(),
            path_and_query: "/check?a=1".to_string(),
            headers: vec![
                (header::AUTHORIZATION, HeaderValue::from_static("Bearer t")),
                (header::CONNECTION, HeaderValue::from_static("x-private")),
                (HeaderName::from_static("x-forwarded-uri"), HeaderValue::from_static("/app/x")),
                (HeaderName::from_static("x-client-cert-subject"), HeaderValue::from_static("CN=admin")),
            ],
            timeout: Duration::from_millis(timeout_ms),
        }
    }

    #[tokio::test]
    async fn an_allowing_answer_gives_its_headers_and_the_request_carries_the_chosen_ones() {
        let (addr, mut seen) =
            service(Some(b"HTTP/1.1 200 OK\r\nx-user: alice\r\ncontent-length: 0\r\n\r\n".to_vec())).await;
        let answer = ask(&request(&addr, 5_000)).await.expect("an answer");
        assert_eq!(answer.status, 200);
        assert_eq!(answer.headers["x-user"], "alice");
        let head = seen.recv().await.expect("the request").to_ascii_lowercase();
        assert!(head.starts_with("get /check?a=1 http/1.1\r\n"), "{head}");
        assert!(head.contains("authorization: bearer t") && head.contains("x-forwarded-uri: /app/x"), "{head}");
        assert!(!head.contains("x-private"), "the client's connection fields stay: {head}");
        assert!(!head.contains("x-client-cert"), "a client's certificate fields never reach it: {head}");
    }

    #[tokio::test]
    async fn a_refusal_keeps_its_body_up_to_the_bound() {
        let (addr, _seen) = service(Some(
            b"HTTP/1.1 401 Unauthorized\r\nwww-authenticate: Bearer\r\ncontent-length: 7\r\n\r\ngo away".to_vec(),
        ))
        .await;
        let answer = ask(&request(&addr, 5_000)).await.expect("an answer");
        assert_eq!((answer.status, &answer.body[..]), (401, &b"go away"[..]));
        assert_eq!(answer.headers["www-authenticate"], "Bearer");
        let big = vec![b'x'; MAX_BODY + 1000];
        let mut raw = format!("HTTP/1.1 403 Forbidden\r\ncontent-length: {}\r\n\r\n", big.len()).into_bytes();
        raw.extend_from_slice(&big);
        let (addr, _seen) = service(Some(raw)).await;
        let answer = ask(&request(&addr, 5_000)).await.expect("an answer");
        assert_eq!((answer.status, answer.body.len()), (403, MAX_BODY), "cut at the bound");
    }

    /// A service that answers a connection's first question, then reads
    /// the next one and closes the connection without answering (as a
    /// service does whose idle timeout ends as a question arrives).
    async fn closing_service() -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("an address").to_string();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    for answered in [true, false] {
                        if read_head(&mut s).await.is_none() {
                            return;
                        }
                        if answered {
                            let _ = s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").await;
                        }
                    }
                });
            }
        });
        addr
    }

    #[tokio::test]
    async fn a_question_on_a_kept_connection_the_service_closes_is_asked_again_on_a_new_one() {
        let addr = closing_service().await;
        for _ in 0..3 {
            let answer = ask(&request(&addr, 5_000)).await.expect("an answer, on a new connection if need be");
            assert_eq!(answer.status, 200);
        }
    }

    #[tokio::test]
    async fn no_answer_in_time_a_refused_connection_and_garbage_are_errors() {
        let (silent, _seen) = service(None).await;
        let e = ask(&request(&silent, 200)).await.expect_err("no answer");
        assert!(matches!(e.why, Why::Timeout(_)), "{e}");
        assert!(e.to_string().contains(&silent), "names the service: {e}");
        // Bound and never listening, held to the end: refused, and no
        // listener of a test running beside can take the port.
        let held = tokio::net::TcpSocket::new_v4().expect("a socket");
        held.bind(([127, 0, 0, 1], 0).into()).expect("bind");
        let closed = held.local_addr().expect("an address").to_string();
        let e = ask(&request(&closed, 5_000)).await.expect_err("refused");
        assert!(matches!(e.why, Why::Http(_)), "{e}");
        let (garbage, _seen) = service(Some(b"SSH-2.0-OpenSSH\r\n\r\n".to_vec())).await;
        assert!(ask(&request(&garbage, 5_000)).await.is_err());
        let (switching, _seen) =
            service(Some(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\nconnection: upgrade\r\n\r\n".to_vec()))
                .await;
        assert!(ask(&request(&switching, 5_000)).await.is_err(), "101 is no answer");
    }
}
