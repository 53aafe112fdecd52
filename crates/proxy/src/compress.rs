//! Response compression, the `compress` rule step: the choice made once a
//! response's head is known ([`choose`]), a body that compresses as it
//! streams for the answers the proxy hands to hyper or writes from an
//! `http::Response` ([`CompressedBody`]), and a writer that compresses what
//! the native engine relays from a backend ([`Compressing`]).
//!
//! Both flush the encoder when the data at hand is written (a read from
//! the backend, a frame of a body): a streamed response (server-sent
//! events, a long poll) reaches the client as it comes, at the cost of a
//! few bytes per flush; a body that arrives at once is one piece.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::header::{self, HeaderMap};
use http::Response;
use http_body::{Body, Frame, SizeHint};
use tidegate_model::rules::Algorithm;
use tidegate_rules::compress::Compressor;
use tidegate_rules::response::compression_head;
use tidegate_rules::ResponsePlan;
use tokio::io::{AsyncWrite, AsyncWriteExt};

use crate::body::{BoxError, ProxyBody};

/// The fields a compressed response's head edits ([`compression_head`]).
pub(crate) const HEAD_FIELDS: [&str; 5] = ["vary", "content-encoding", "content-length", "accept-ranges", "etag"];

/// How a response is compressed, decided from its head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Choice {
    /// Not a response the step compresses (its type, its size, already
    /// encoded or ranged, its status): left as it is.
    Untouched,
    /// One it would compress: its head gets `Vary: Accept-Encoding`, and
    /// with a coding the client accepts, the compression's own edits
    /// ([`compression_head`]); without one, it goes as it is.
    Compressible(Option<Algorithm>),
}

/// Decides for a response of `status` with `headers` (and its body's
/// length, when known) to a request that accepted `accept_encoding`.
pub(crate) fn choose(
    plan: &ResponsePlan,
    accept_encoding: Option<&[u8]>,
    status: u16,
    headers: &HeaderMap,
    length: Option<u64>,
) -> Choice {
    let content_type = headers.get(header::CONTENT_TYPE).map(|v| v.as_bytes());
    let length = length.or_else(|| headers.get(header::CONTENT_LENGTH)?.to_str().ok()?.parse().ok());
    let encoded_or_ranged =
        headers.contains_key(header::CONTENT_ENCODING) || headers.contains_key(header::CONTENT_RANGE);
    if !plan.compressible(status, content_type, length, encoded_or_ranged) {
        return Choice::Untouched;
    }
    Choice::Compressible(plan.compression(accept_encoding, status, content_type, length, encoded_or_ranged))
}

/// Compresses `resp` as `plan` says for a request that accepted
/// `accept_encoding` (`to_head`: it was a `HEAD`, whose answer gets the
/// head's edits and has no body to compress).
pub(crate) fn response(
    resp: Response<ProxyBody>,
    plan: &ResponsePlan,
    accept_encoding: Option<&[u8]>,
    to_head: bool,
) -> Response<ProxyBody> {
    if plan.compress.is_none() {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    let length = body.size_hint().exact();
    let body = match choose(plan, accept_encoding, parts.status.as_u16(), &parts.headers, length) {
        Choice::Untouched => body,
        Choice::Compressible(coding) => {
            compression_head(&mut parts.headers, coding);
            match coding.map(Compressor::new) {
                Some(Ok(encoder)) if !to_head => ProxyBody::Compressed(Box::new(CompressedBody::new(body, encoder))),
                // (An encoder that cannot start: the answer goes as it is,
                // with the head of a compressed one; never seen with the
                // built-in levels.)
                _ => body,
            }
        }
    };
    Response::from_parts(parts, body)
}

/// A body compressed as it streams.
#[derive(Debug)]
pub struct CompressedBody {
    inner: ProxyBody,
    encoder: Option<Compressor>,
    trailers: Option<HeaderMap>,
}

impl CompressedBody {
    fn new(inner: ProxyBody, encoder: Compressor) -> CompressedBody {
        CompressedBody { inner, encoder: Some(encoder), trailers: None }
    }
}

impl Body for CompressedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let mut out = Vec::new();
        loop {
            let Some(encoder) = this.encoder.as_mut() else {
                // Ended: the trailers, if the backend sent some, then done.
                return Poll::Ready(this.trailers.take().map(|t| Ok(Frame::trailers(t))));
            };
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => encoder.push(&data, &mut out)?,
                    Err(frame) => this.trailers = frame.into_trailers().ok(),
                },
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
                Poll::Ready(None) => {
                    if let Some(encoder) = this.encoder.take() {
                        encoder.finish(&mut out)?;
                    }
                    return Poll::Ready(Some(Ok(Frame::data(Bytes::from(out)))));
                }
                // Nothing more for now: what was read goes out.
                Poll::Pending if out.is_empty() => return Poll::Pending,
                Poll::Pending => {
                    encoder.flush(&mut out)?;
                    return Poll::Ready(Some(Ok(Frame::data(Bytes::from(out)))));
                }
            }
            if out.len() >= FRAME {
                return Poll::Ready(Some(Ok(Frame::data(Bytes::from(out)))));
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.encoder.is_none() && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

/// Compressed bytes gathered before a frame is handed on.
const FRAME: usize = 64 * 1024;

/// A writer that compresses what is written to it and writes it on to
/// `inner` after the response's head, chunked (`chunked`: an HTTP/1.1
/// client) or as it is (until the connection closes, for HTTP/1.0). Each
/// write is compressed and flushed at once, and goes out in one write with
/// what is still pending (the head, before the first);
/// [`Compressing::finish`] ends the stream. The native engine's relay
/// writes a backend's body through it.
pub(crate) struct Compressing<'a, W> {
    inner: &'a mut W,
    encoder: Option<Compressor>,
    chunked: bool,
    /// Compressed bytes (in their chunk) not yet written to `inner`.
    pending: Vec<u8>,
    written: usize,
}

impl<'a, W: AsyncWrite + Unpin> Compressing<'a, W> {
    /// A writer whose stream follows `head` (the response head, written
    /// with the first compressed bytes).
    pub(crate) fn new(inner: &'a mut W, encoder: Compressor, chunked: bool, head: &[u8]) -> Compressing<'a, W> {
        Compressing { inner, encoder: Some(encoder), chunked, pending: head.to_vec(), written: 0 }
    }

    /// Frames `data` (compressed bytes) into `pending`.
    fn frame(&mut self, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        if self.chunked {
            let mut line = [0u8; 18];
            self.pending.extend_from_slice(tidegate_h1::chunk_size_line(data.len(), &mut line));
            self.pending.extend_from_slice(data);
            self.pending.extend_from_slice(b"\r\n");
        } else {
            self.pending.extend_from_slice(data);
        }
    }

    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.written < self.pending.len() {
            let n = ready!(Pin::new(&mut *self.inner).poll_write(cx, &self.pending[self.written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
        }
        self.pending.clear();
        self.written = 0;
        Poll::Ready(Ok(()))
    }

    /// Compresses `last` (the rest of the body, maybe none), ends the
    /// compressed stream (and the chunked body) and writes what is
    /// pending: a body given whole here goes out with its head in one
    /// write.
    pub(crate) async fn finish(mut self, last: &[u8]) -> io::Result<()> {
        let mut out = Vec::new();
        if let Some(mut encoder) = self.encoder.take() {
            encoder.push(last, &mut out).map_err(io::Error::other)?;
            encoder.finish(&mut out).map_err(io::Error::other)?;
        }
        self.frame(&out);
        if self.chunked {
            self.pending.extend_from_slice(tidegate_h1::CHUNKED_END);
        }
        std::future::poll_fn(|cx| self.poll_drain(cx)).await?;
        self.inner.flush().await
    }
}

impl<W: AsyncWrite + Unpin> AsyncWrite for Compressing<'_, W> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        // What an earlier write left pending goes out before more is
        // taken, once it is a frame's worth (the head alone is not).
        if this.pending.len() - this.written >= FRAME {
            ready!(this.poll_drain(cx))?;
        }
        let Some(encoder) = this.encoder.as_mut() else {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        };
        let mut out = Vec::new();
        encoder.push(buf, &mut out).map_err(io::Error::other)?;
        encoder.flush(&mut out).map_err(io::Error::other)?;
        this.frame(&out);
        // Taken: it is written by the next call (or `finish`).
        let _ = this.poll_drain(cx)?;
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut *this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut *this.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use std::io::Read;

    fn plan() -> ResponsePlan {
        let spec: tidegate_model::rules::Compress =
            serde_json::from_value(serde_json::json!({ "algorithms": ["gzip"], "min_bytes": 10 })).unwrap();
        ResponsePlan { compress: Some(std::sync::Arc::new(spec)) }
    }

    fn json_head() -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        h
    }

    fn gunzip(bytes: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(bytes).read_to_end(&mut out).expect("a gzip stream");
        out
    }

    #[test]
    fn the_choice_reads_the_head() {
        let p = plan();
        let h = json_head();
        assert_eq!(choose(&p, Some(b"gzip"), 200, &h, Some(100)), Choice::Compressible(Some(Algorithm::Gzip)));
        assert_eq!(choose(&p, Some(b"br"), 200, &h, Some(100)), Choice::Compressible(None));
        assert_eq!(choose(&p, Some(b"gzip"), 200, &h, Some(5)), Choice::Untouched, "too small");
        assert_eq!(choose(&p, Some(b"gzip"), 206, &h, Some(100)), Choice::Untouched, "a range");
        let mut encoded = json_head();
        encoded.insert(header::CONTENT_ENCODING, HeaderValue::from_static("br"));
        assert_eq!(choose(&p, Some(b"gzip"), 200, &encoded, None), Choice::Untouched, "already encoded");
        let mut image = HeaderMap::new();
        image.insert(header::CONTENT_TYPE, HeaderValue::from_static("image/png"));
        assert_eq!(choose(&p, Some(b"gzip"), 200, &image, None), Choice::Untouched, "not a compressible type");
    }

    #[tokio::test]
    async fn a_body_compresses_as_it_streams_and_decodes_to_what_was_sent() {
        use http_body_util::BodyExt;
        let text: Vec<u8> = (0..50_000).map(|i| b"abcdefgh{}[],:\"0123"[i % 19]).collect();
        let mut resp = Response::new(ProxyBody::text(text.clone()));
        *resp.headers_mut() = json_head();
        let resp = response(resp, &plan(), Some(b"gzip, br"), false);
        assert_eq!(resp.headers()[header::CONTENT_ENCODING], "gzip");
        assert_eq!(resp.headers()[header::VARY], "Accept-Encoding");
        let body = resp.into_body().collect().await.expect("a body").to_bytes();
        assert!(body.len() < text.len() / 4, "{} bytes", body.len());
        assert_eq!(gunzip(&body), text);
        // To a HEAD: the head's edits, no body compressed.
        let mut head = Response::new(ProxyBody::text(text.clone()));
        *head.headers_mut() = json_head();
        let head = response(head, &plan(), Some(b"gzip"), true);
        assert!(matches!(head.body(), ProxyBody::Full(_)));
        assert_eq!(head.headers()[header::CONTENT_ENCODING], "gzip");
    }

    #[tokio::test]
    async fn the_writer_chunks_what_it_compresses_and_ends_the_body() {
        let mut sink: Vec<u8> = Vec::new();
        let mut w = Compressing::new(&mut sink, Compressor::new(Algorithm::Gzip).unwrap(), true, b"HEAD\r\n\r\n");
        w.write_all(b"hello ").await.unwrap();
        w.write_all(b"world").await.unwrap();
        w.finish(b", again").await.unwrap();
        // The head, then the body: dechunk what was written.
        let mut body = Vec::new();
        let mut rest = sink.strip_prefix(b"HEAD\r\n\r\n").expect("the head first");
        loop {
            let line_end = rest.windows(2).position(|w| w == b"\r\n").expect("a size line");
            let size = usize::from_str_radix(std::str::from_utf8(&rest[..line_end]).unwrap(), 16).unwrap();
            rest = &rest[line_end + 2..];
            if size == 0 {
                assert_eq!(rest, b"\r\n");
                break;
            }
            body.extend_from_slice(&rest[..size]);
            rest = &rest[size + 2..];
        }
        assert_eq!(gunzip(&body), b"hello world, again");
    }
}
