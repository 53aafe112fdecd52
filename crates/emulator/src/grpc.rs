//! A gRPC service on the wire (HTTP/2, length-prefixed messages, status in
//! trailers), so tests can check that gRPC passes through the proxy. Two
//! methods, with raw bytes as messages:
//!
//! - `/tidegate.test.Echo/Unary`: answers each request message with the
//!   same bytes;
//! - `/tidegate.test.Echo/ServerStream`: the request message is a count N
//!   in ASCII; answers N messages `reply i of N` about 20 ms apart, then
//!   the trailers `grpc-status: 0` and `x-stream-count: N`.
//!
//! Any other method gets the trailers-only answer `grpc-status: 12`
//! (unimplemented). Every answer carries `x-backend: NAME`.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http::header::CONTENT_TYPE;
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::sync::mpsc;

use crate::app::{AppState, X_BACKEND};

/// Whether a request is a gRPC call.
pub fn is_grpc<B>(req: &Request<B>) -> bool {
    req.headers().get(CONTENT_TYPE).is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// A gRPC response body: messages, then trailers, as a task sends them.
#[derive(Debug)]
pub struct GrpcBody(mpsc::Receiver<Frame<Bytes>>);

impl Body for GrpcBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.0.poll_recv(cx).map(|f| f.map(Ok))
    }
}

/// Frames one message: a zero compression flag, the length, the bytes.
pub fn frame(message: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(5 + message.len());
    out.put_u8(0);
    out.put_u32(message.len() as u32);
    out.put_slice(message);
    out.freeze()
}

/// Splits a body into its messages; `None` if it is not whole frames.
pub fn messages(mut body: &[u8]) -> Option<Vec<Bytes>> {
    let mut out = Vec::new();
    while !body.is_empty() {
        let len = u32::from_be_bytes(body.get(1..5)?.try_into().ok()?) as usize;
        out.push(Bytes::copy_from_slice(body.get(5..5 + len)?));
        body = &body[5 + len..];
    }
    Some(out)
}

fn trailers(status: u32, extra: Option<(&'static str, String)>) -> HeaderMap {
    let mut t = HeaderMap::new();
    t.insert("grpc-status", HeaderValue::from(status));
    if let Some((name, value)) = extra {
        if let Ok(v) = HeaderValue::from_str(&value) {
            t.insert(name, v);
        }
    }
    t
}

/// Answers one gRPC call.
pub async fn handle(state: Arc<AppState>, req: Request<Incoming>) -> Response<GrpcBody> {
    let path = req.uri().path().to_owned();
    let body = req.into_body().collect().await.map(|c| c.to_bytes()).unwrap_or_default();
    let (tx, rx) = mpsc::channel(16);
    let mut resp = Response::new(GrpcBody(rx));
    resp.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    resp.headers_mut().insert(X_BACKEND, state.name_header.clone());
    let Some(requests) = messages(&body) else {
        let _ = tx.try_send(Frame::trailers(trailers(13, Some(("grpc-message", "malformed frames".into())))));
        return resp;
    };
    match path.as_str() {
        "/tidegate.test.Echo/Unary" => {
            for m in &requests {
                let _ = tx.try_send(Frame::data(frame(m)));
            }
            let _ = tx.try_send(Frame::trailers(trailers(0, None)));
        }
        "/tidegate.test.Echo/ServerStream" => {
            let n: u32 = requests.first().and_then(|m| std::str::from_utf8(m).ok()?.parse().ok()).unwrap_or(0);
            tokio::spawn(async move {
                for i in 1..=n {
                    let message = format!("reply {i} of {n}");
                    if tx.send(Frame::data(frame(message.as_bytes()))).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                let _ = tx.send(Frame::trailers(trailers(0, Some(("x-stream-count", n.to_string()))))).await;
            });
        }
        _ => {
            let _ = tx.try_send(Frame::trailers(trailers(12, None)));
        }
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_split_back_into_messages() {
        let mut body = BytesMut::new();
        body.extend_from_slice(&frame(b"one"));
        body.extend_from_slice(&frame(b""));
        body.extend_from_slice(&frame(b"three"));
        let got = messages(&body).unwrap();
        assert_eq!(got, vec![Bytes::from("one"), Bytes::new(), Bytes::from("three")]);
        assert!(messages(&body[..body.len() - 1]).is_none());
    }
}
