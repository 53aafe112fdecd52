//! `/upgrade`: a protocol-upgrade test aid that echoes bytes back.
//!
//! A request with `Connection: upgrade` and `Upgrade: echo` is answered
//! `101 Switching Protocols`; afterwards every byte received on the upgraded
//! connection is written back until the peer closes its side.

use http::header::{CONNECTION, UPGRADE};
use http::{HeaderMap, HeaderValue, Request, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::app::{text, Resp};

/// Protocol name accepted in the `Upgrade` header.
pub const PROTOCOL: &str = "echo";

/// True if any comma-separated token of header `name` equals `token` (ASCII case-insensitive).
fn has_token(headers: &HeaderMap, name: &http::HeaderName, token: &str) -> bool {
    headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

/// True if the request asks to upgrade to the echo protocol.
pub fn wants_echo(headers: &HeaderMap) -> bool {
    has_token(headers, &CONNECTION, "upgrade") && has_token(headers, &UPGRADE, PROTOCOL)
}

/// Answers `/upgrade`: 101 and an echo task, or 400 without the right headers.
pub fn respond(req: Request<Incoming>) -> Resp {
    if !wants_echo(req.headers()) {
        return text(StatusCode::BAD_REQUEST, "expected Connection: upgrade and Upgrade: echo\n");
    }
    tokio::spawn(async move {
        if let Ok(upgraded) = hyper::upgrade::on(req).await {
            // Errors only mean the peer went away.
            let _ = echo_until_eof(TokioIo::new(upgraded)).await;
        }
    });
    let mut resp = text(StatusCode::SWITCHING_PROTOCOLS, "");
    let headers = resp.headers_mut();
    headers.remove(http::header::CONTENT_TYPE);
    headers.insert(UPGRADE, HeaderValue::from_static(PROTOCOL));
    headers.insert(CONNECTION, HeaderValue::from_static("upgrade"));
    resp
}

/// Writes back everything read from `io` until EOF, then shuts down the write side.
pub async fn echo_until_eof<T>(mut io: T) -> std::io::Result<()>
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = io.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        io.write_all(&buf[..n]).await?;
        io.flush().await?;
    }
    io.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upgrade_headers_are_recognised() {
        let mut headers = HeaderMap::new();
        headers.insert(CONNECTION, HeaderValue::from_static("keep-alive, Upgrade"));
        headers.insert(UPGRADE, HeaderValue::from_static("ECHO"));
        assert!(wants_echo(&headers));
        headers.insert(UPGRADE, HeaderValue::from_static("websocket"));
        assert!(!wants_echo(&headers));
        headers.remove(CONNECTION);
        headers.insert(UPGRADE, HeaderValue::from_static("echo"));
        assert!(!wants_echo(&headers));
    }

    #[tokio::test]
    async fn echo_copies_until_eof() {
        let (mut client, server) = tokio::io::duplex(64);
        let task = tokio::spawn(echo_until_eof(server));
        client.write_all(b"ping").await.expect("write");
        let mut got = [0u8; 4];
        client.read_exact(&mut got).await.expect("read");
        assert_eq!(&got, b"ping");
        client.shutdown().await.expect("shutdown");
        let mut rest = Vec::new();
        client.read_to_end(&mut rest).await.expect("eof");
        assert!(rest.is_empty());
        task.await.expect("join").expect("echo ok");
    }
}
