//! Differential fuzzing of the HTTP/1.1 heads and their framing.
//!
//! Each generated message (biased toward the framing rules: duplicate and
//! odd `Content-Length`s, `Transfer-Encoding` lists, obsolete folding,
//! bare LF, whitespace before colons, huge chunk sizes) goes to
//! `tidegate-h1` and to two references:
//!
//! - `httparse` alone (the syntax): whatever the codec accepts, httparse
//!   accepts with the same head length;
//! - hyper's HTTP/1 server (requests) and client (responses), in-process
//!   over an in-memory pipe: when both accept a message they must read the
//!   same body from the same bytes (the framing decision: length, chunked,
//!   until close), and every message only one of them accepts must fall
//!   under a documented difference ([`Difference`], docs/fuzzing.md).
//!
//! Run long: `TIDEGATE_FUZZ_SECS=600 cargo test -p tidegate-h1 --release
//! --test fuzz_heads -- --nocapture` (see docs/fuzzing.md).

#[path = "../../../fuzz/campaign.rs"]
mod support;

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use tidegate_h1::{
    parse_request, parse_response, ChunkedDecoder, FramingError, HeadError, HeadLimits, RequestBody, RequestHead,
    ResponseBody, ResponseHead,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

// ---------------------------------------------------------------------
// Generators
// ---------------------------------------------------------------------

fn content_length() -> impl Strategy<Value = String> {
    prop_oneof![
        (0u32..40).prop_map(|n| n.to_string()),
        Just("0".into()),
        Just("05".into()),
        Just("5, 5".into()),
        Just("5,5".into()),
        Just("5, 6".into()),
        Just("5,".into()),
        Just(",5".into()),
        Just("+5".into()),
        Just("-1".into()),
        Just("".into()),
        Just(" 7 ".into()),
        Just("0x10".into()),
        Just("1_0".into()),
        Just("9999999999999999999".into()),
        Just("18446744073709551615".into()),
        Just("18446744073709551616".into()),
        Just("99999999999999999999999".into()),
        Just("5 5".into()),
        Just("5\t".into()),
    ]
}

fn transfer_encoding() -> impl Strategy<Value = String> {
    let coding = prop_oneof![
        4 => Just("chunked"),
        1 => Just("Chunked"),
        1 => Just("CHUNKED"),
        1 => Just("gzip"),
        1 => Just("identity"),
        1 => Just("deflate"),
        1 => Just("chunked;q=1"),
        1 => Just("xchunked"),
        1 => Just("chunk"),
        1 => Just(""),
    ];
    let sep = prop_oneof![Just(", "), Just(","), Just(" ,"), Just("\t,\t")];
    proptest::collection::vec((coding, sep), 1..4).prop_map(|parts| {
        let mut s = String::new();
        for (i, (c, sep)) in parts.iter().enumerate() {
            if i > 0 {
                s.push_str(sep);
            }
            s.push_str(c);
        }
        s
    })
}

fn name_of(base: &'static str) -> impl Strategy<Value = String> {
    prop_oneof![
        8 => Just(base.to_string()),
        1 => Just(base.to_ascii_uppercase()),
        1 => Just(format!("{base} ")),
        1 => Just(format!("{base}\t")),
        1 => Just(format!(" {base}")),
        1 => Just(base.replace('-', "_")),
        1 => Just(format!("{base}x")),
    ]
}

/// One header field, and the line end after it.
fn field() -> impl Strategy<Value = Vec<u8>> {
    let line = prop_oneof![
        4 => (name_of("content-length"), content_length()),
        4 => (name_of("transfer-encoding"), transfer_encoding()),
        1 => (name_of("host"), prop_oneof![Just("a".to_string()), Just("b.example:80".to_string()), Just("".to_string())]),
        1 => (name_of("connection"), prop_oneof![
            Just("close".to_string()), Just("keep-alive".to_string()), Just("upgrade".to_string()),
            Just("close, transfer-encoding".to_string()), Just("content-length".to_string()),
        ]),
        1 => (name_of("expect"), Just("100-continue".to_string())),
        2 => ("[a-zA-Z0-9!#$%&'*+.^_`|~-]{1,12}", "[ -~\t]{0,24}"),
        1 => ("[ -~]{0,8}", proptest::collection::vec(any::<u8>(), 0..8).prop_map(|v| String::from_utf8_lossy(&v).into_owned())),
    ];
    let sep = prop_oneof![8 => Just(": "), 2 => Just(":"), 1 => Just(" : "), 1 => Just(":\t"), 1 => Just(":  ")];
    let end = prop_oneof![16 => Just("\r\n"), 1 => Just("\n"), 1 => Just("\r\n folded\r\n"), 1 => Just("\r\n\tfolded\r\n"), 1 => Just("\r")];
    (line, sep, end).prop_map(|((name, value), sep, end)| format!("{name}{sep}{value}{end}").into_bytes())
}

/// What follows a head: a body (well formed or not) and maybe more.
fn body() -> impl Strategy<Value = Vec<u8>> {
    let chunk_size = prop_oneof![
        4 => (0usize..12).prop_map(|n| format!("{n:x}")),
        1 => Just("A".to_string()),
        1 => Just("0000000000000003".to_string()),
        1 => Just("00000000000000003".to_string()),
        1 => Just("ffffffffffffffff".to_string()),
        1 => Just("fffffffffffffffff".to_string()),
        1 => Just("-1".to_string()),
        1 => Just("3 ".to_string()),
        1 => Just("3;ext=1".to_string()),
        1 => Just("3 ;ext".to_string()),
        1 => Just("0x3".to_string()),
    ];
    let line_end = prop_oneof![8 => Just("\r\n"), 1 => Just("\n"), 1 => Just("\r")];
    let chunk = (chunk_size, line_end.clone(), "[a-z]{0,12}", line_end.clone())
        .prop_map(|(size, e1, data, e2)| format!("{size}{e1}{data}{e2}"));
    let chunked = (
        proptest::collection::vec(chunk, 0..4),
        prop_oneof![4 => Just("0\r\n\r\n"), 1 => Just("0\r\nx-t: 1\r\n\r\n"), 1 => Just("0\n\n"), 1 => Just("0\r\n"), 1 => Just("")],
    )
        .prop_map(|(chunks, end)| format!("{}{end}", chunks.concat()).into_bytes());
    prop_oneof![
        3 => chunked,
        2 => "[a-z]{0,40}".prop_map(String::into_bytes),
        1 => proptest::collection::vec(any::<u8>(), 0..40),
    ]
}

/// Bytes shown as an escaped string in failures.
#[derive(Clone)]
struct Raw(Vec<u8>);

impl std::fmt::Debug for Raw {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s: String = self.0.iter().flat_map(|b| std::ascii::escape_default(*b)).map(char::from).collect();
        write!(f, "b\"{s}\"")
    }
}

/// A byte-level mutation applied to a whole message, now and then.
#[derive(Debug, Clone)]
enum Mutation {
    None,
    Flip(usize, u8),
    Insert(usize, u8),
    Delete(usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let byte =
        prop_oneof![Just(b'\r'), Just(b'\n'), Just(b' '), Just(b'\t'), Just(b':'), Just(b','), Just(0u8), any::<u8>()];
    prop_oneof![
        8 => Just(Mutation::None),
        1 => (any::<usize>(), byte.clone()).prop_map(|(i, b)| Mutation::Flip(i, b)),
        1 => (any::<usize>(), byte).prop_map(|(i, b)| Mutation::Insert(i, b)),
        1 => any::<usize>().prop_map(Mutation::Delete),
    ]
}

fn mutate(mut raw: Vec<u8>, m: &Mutation) -> Vec<u8> {
    if raw.is_empty() {
        return raw;
    }
    match *m {
        Mutation::None => {}
        Mutation::Flip(i, b) => {
            let i = i % raw.len();
            raw[i] = b;
        }
        Mutation::Insert(i, b) => raw.insert(i % (raw.len() + 1), b),
        Mutation::Delete(i) => {
            raw.remove(i % raw.len());
        }
    }
    raw
}

fn request() -> impl Strategy<Value = (Raw, Raw)> {
    let method =
        prop_oneof![Just("GET"), Just("POST"), Just("PUT"), Just("HEAD"), Just("DELETE"), Just("G T"), Just("")];
    let version = prop_oneof![8 => Just("HTTP/1.1"), 2 => Just("HTTP/1.0"), 1 => Just("HTTP/1.2"), 1 => Just("HTTP/2.0"), 1 => Just("http/1.1")];
    let start_end = prop_oneof![8 => Just("\r\n"), 1 => Just("\n")];
    let head_end = prop_oneof![8 => Just("\r\n"), 1 => Just("\n")];
    (method, version, start_end, proptest::collection::vec(field(), 0..6), head_end, body(), mutation()).prop_map(
        |(method, version, start_end, fields, head_end, body, m)| {
            let mut head = format!("{method} /p {version}{start_end}").into_bytes();
            for f in fields {
                head.extend_from_slice(&f);
            }
            head.extend_from_slice(head_end.as_bytes());
            (Raw(mutate(head, &m)), Raw(body))
        },
    )
}

fn response() -> impl Strategy<Value = (Raw, Raw, bool)> {
    let version = prop_oneof![8 => Just("HTTP/1.1"), 2 => Just("HTTP/1.0"), 1 => Just("HTTP/1.2")];
    let status = prop_oneof![
        4 => Just("200 OK"), 1 => Just("204 No Content"), 1 => Just("304 Not Modified"), 1 => Just("404 Not Found"),
        1 => Just("503 Busy"), 1 => Just("200"), 1 => Just("200 "), 1 => Just("600 Odd"), 1 => Just("099 Low"),
        1 => Just("1000 Long"), 1 => Just("20 Short"),
    ];
    let start_end = prop_oneof![8 => Just("\r\n"), 1 => Just("\n")];
    let head_end = prop_oneof![8 => Just("\r\n"), 1 => Just("\n")];
    (
        version,
        status,
        start_end,
        proptest::collection::vec(field(), 0..6),
        head_end,
        body(),
        mutation(),
        prop::bool::weighted(0.1),
    )
        .prop_map(|(version, status, start_end, fields, head_end, body, m, to_head)| {
            let mut head = format!("{version} {status}{start_end}").into_bytes();
            for f in fields {
                head.extend_from_slice(&f);
            }
            head.extend_from_slice(head_end.as_bytes());
            (Raw(mutate(head, &m)), Raw(body), to_head)
        })
}

// ---------------------------------------------------------------------
// The codec's reading, and the references'
// ---------------------------------------------------------------------

/// A body as read from the bytes after a head, or `Err` when the bytes
/// end before it does or are malformed.
type Read = Result<Vec<u8>, ()>;

fn chunked_payload(input: &[u8]) -> Read {
    let mut d = ChunkedDecoder::default();
    let mut out = Vec::new();
    let mut at = 0;
    loop {
        let step = d.decode(&input[at..]).map_err(|_| ())?;
        if let Some(r) = step.data.clone() {
            out.extend_from_slice(&input[at + r.start..at + r.end]);
        }
        at += step.consumed;
        if step.done {
            return Ok(out);
        }
        if step.consumed == 0 {
            return Err(());
        }
    }
}

/// Whether a chunked body fails on a size of more than 16 hex digits
/// (leading zeros included): a stricter choice, which hyper accepts.
fn long_chunk_size(input: &[u8]) -> bool {
    let mut d = ChunkedDecoder::default();
    let mut at = 0;
    loop {
        match d.decode(&input[at..]) {
            Err(e) => return e.to_string().contains("16 hex digits"),
            Ok(step) if step.done || step.consumed == 0 => return false,
            Ok(step) => at += step.consumed,
        }
    }
}

fn length_payload(input: &[u8], n: u64) -> Read {
    let n = usize::try_from(n).map_err(|_| ())?;
    input.get(..n).map(<[u8]>::to_vec).ok_or(())
}

fn codec_request(raw: &[u8], body: &[u8]) -> Result<Option<(RequestHead, Read)>, HeadError> {
    let mut head = RequestHead::default();
    let mut all = raw.to_vec();
    all.extend_from_slice(body);
    match parse_request(&all, HeadLimits::default(), &mut head)? {
        None => Ok(None),
        Some(()) => {
            let rest = &all[head.len..];
            let read = match head.body {
                RequestBody::Empty => Ok(Vec::new()),
                RequestBody::Length(n) => length_payload(rest, n),
                RequestBody::Chunked => chunked_payload(rest),
            };
            Ok(Some((head, read)))
        }
    }
}

fn codec_response(raw: &[u8], body: &[u8], to_head: bool) -> Result<Option<(ResponseHead, Read)>, HeadError> {
    let mut head = ResponseHead::default();
    let mut all = raw.to_vec();
    all.extend_from_slice(body);
    match parse_response(&all, HeadLimits::default(), to_head, &mut head)? {
        None => Ok(None),
        Some(()) => {
            let rest = &all[head.len..];
            let read = match head.body {
                ResponseBody::None => Ok(Vec::new()),
                ResponseBody::Length(n) => length_payload(rest, n),
                ResponseBody::Chunked => chunked_payload(rest),
                ResponseBody::UntilClose => Ok(rest.to_vec()),
            };
            Ok(Some((head, read)))
        }
    }
}

/// What hyper made of a message: `None` when it refused the head.
type HyperRead = Option<Read>;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime")
}

const PATIENCE: Duration = Duration::from_secs(5);

/// Feeds `raw` + `body` to hyper's HTTP/1 server and then closes the
/// pipe: what did the first request's handler see?
async fn hyper_request(raw: &[u8], body: &[u8]) -> HyperRead {
    let (mut client, server) = tokio::io::duplex(1 << 20);
    let seen: Arc<Mutex<Option<Read>>> = Arc::default();
    let svc = {
        let seen = seen.clone();
        hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
            let seen = seen.clone();
            async move {
                let read = req.into_body().collect().await.map(|b| b.to_bytes().to_vec()).map_err(|_| ());
                let mut seen = seen.lock().expect("not poisoned");
                if seen.is_none() {
                    *seen = Some(read);
                }
                Ok::<_, Infallible>(hyper::Response::new(Empty::<Bytes>::new()))
            }
        })
    };
    let conn = hyper::server::conn::http1::Builder::new()
        // The pipe's write side closes after the request: that must not
        // cancel it.
        .half_close(true)
        .serve_connection(TokioIo::new(server), svc);
    let serving = tokio::spawn(async move {
        let _ = conn.await;
    });
    client.write_all(raw).await.expect("the pipe is open");
    client.write_all(body).await.expect("the pipe is open");
    client.shutdown().await.expect("the pipe is open");
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(PATIENCE, client.read_to_end(&mut answer)).await;
    let _ = tokio::time::timeout(PATIENCE, serving).await;
    let first = seen.lock().expect("not poisoned").take();
    first
}

/// Sends one request through hyper's HTTP/1 client to a peer that answers
/// `raw` + `body` and closes: what body did hyper read?
async fn hyper_response(raw: &[u8], body: &[u8], to_head: bool) -> HyperRead {
    let (client, mut server) = tokio::io::duplex(1 << 20);
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake::<_, Empty<Bytes>>(TokioIo::new(client)).await.ok()?;
    let driving = tokio::spawn(async move {
        let _ = conn.await;
    });
    let answer = [raw, body].concat();
    let peer = tokio::spawn(async move {
        // Read the request head first, then answer and close.
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            match server.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
        let _ = server.write_all(&answer).await;
        let _ = server.shutdown().await;
        // Keep our end open until the client is done reading.
        let _ = server.read_to_end(&mut got).await;
    });
    let method = if to_head { hyper::Method::HEAD } else { hyper::Method::GET };
    let req = hyper::Request::builder()
        .method(method)
        .uri("/")
        .header("host", "a")
        .body(Empty::new())
        .expect("a valid request");
    let result = tokio::time::timeout(PATIENCE, async {
        let resp = sender.send_request(req).await.ok()?;
        let read = resp.into_body().collect().await.map(|b| b.to_bytes().to_vec()).map_err(|_| ());
        Some(read)
    })
    .await
    .unwrap_or(None);
    drop(sender);
    driving.abort();
    peer.abort();
    result
}

// ---------------------------------------------------------------------
// The documented differences
// ---------------------------------------------------------------------

/// A message one side accepts and the other refuses, by design. Each one
/// is listed, with the reason, in docs/fuzzing.md.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Difference {
    /// Requests with both framings: hyper frames by the coding.
    LengthAndCoding,
    /// A transfer coding in an HTTP/1.0 request.
    CodingInHttp10,
    /// Two `Host` fields (hyper does not look).
    DuplicateHost,
    /// `chunked` twice, not last, or an empty coding list: refused here.
    CodingList,
    /// A coding other than plain `chunked` (`gzip, chunked`, `gzip`).
    UnsupportedCoding,
    /// Content-Length lists (`5, 5`) or 19-digit values hyper refuses,
    /// or values it reads differently.
    LengthSyntax,
    /// Responses: a status outside 100-599 (httparse takes any 3 digits).
    StatusRange,
}

fn stricter(e: HeadError) -> Option<Difference> {
    Some(match e {
        HeadError::Framing(FramingError::LengthAndCoding) => Difference::LengthAndCoding,
        HeadError::Framing(FramingError::CodingInHttp10) => Difference::CodingInHttp10,
        HeadError::Framing(FramingError::ChunkedTwice | FramingError::ChunkedNotLast | FramingError::EmptyCoding) => {
            Difference::CodingList
        }
        HeadError::Framing(FramingError::InvalidLength | FramingError::DifferingLengths) => Difference::LengthSyntax,
        HeadError::DuplicateHost => Difference::DuplicateHost,
        HeadError::UnsupportedCoding => Difference::UnsupportedCoding,
        HeadError::Syntax("status code out of range") => Difference::StatusRange,
        _ => return None,
    })
}

/// A message the codec accepts and hyper refuses or frames otherwise, by
/// design: the codec follows RFC 9110 where hyper is stricter or reads a
/// list differently. The proxy writes its own framing fields, so what it
/// forwards carries no such list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lenient {
    /// `Content-Length: 5, 5`: a list of one value repeated, which RFC
    /// 9110 section 8.6 lets a recipient accept as that value; hyper
    /// refuses any list.
    LengthList,
    /// `Transfer-Encoding: chunked, ` (or `, chunked`): empty list
    /// elements, which RFC 9110 section 5.6.1 says to ignore; hyper reads
    /// the last element as the coding, so it does not see `chunked` last.
    EmptyListElement,
    /// A transfer coding in an HTTP/1.0 response: RFC 9112 section 6.1
    /// says to treat its framing as faulty and close the connection after
    /// it, which the codec does (reading it by its coding); hyper refuses
    /// it.
    CodingInHttp10Response,
    /// A request target that is not a URI (`T/p`): the codec leaves the
    /// target to the proxy, which normalizes it before routing and answers
    /// 400 to one that is neither origin-form, absolute-form nor `*`;
    /// hyper refuses it while parsing.
    TargetForm,
}

fn lenient(all: &[u8]) -> Option<Lenient> {
    let mut headers = [httparse::EMPTY_HEADER; 100];
    let mut req = httparse::Request::new(&mut headers);
    let fields = match req.parse(all) {
        Ok(_) => {
            if req.path.is_some_and(|p| p.parse::<hyper::Uri>().is_err()) {
                return Some(Lenient::TargetForm);
            }
            req.headers.to_vec()
        }
        Err(_) => {
            let mut headers = [httparse::EMPTY_HEADER; 100];
            let mut resp = httparse::Response::new(&mut headers);
            resp.parse(all).ok()?;
            resp.headers.to_vec()
        }
    };
    if all.starts_with(b"HTTP/1.0 ") && fields.iter().any(|h| h.name.eq_ignore_ascii_case("transfer-encoding")) {
        return Some(Lenient::CodingInHttp10Response);
    }
    let trim = |v: &[u8]| String::from_utf8_lossy(v).trim_matches([' ', '\t']).to_string();
    for h in &fields {
        if h.name.eq_ignore_ascii_case("content-length") && h.value.contains(&b',') {
            return Some(Lenient::LengthList);
        }
        if h.name.eq_ignore_ascii_case("transfer-encoding") && h.value.split(|b| *b == b',').any(|t| trim(t).is_empty())
        {
            return Some(Lenient::EmptyListElement);
        }
    }
    None
}

fn httparse_request(all: &[u8]) -> Result<httparse::Status<usize>, httparse::Error> {
    let mut headers = [httparse::EMPTY_HEADER; 100];
    httparse::Request::new(&mut headers).parse(all)
}

fn httparse_response(all: &[u8]) -> Result<httparse::Status<usize>, httparse::Error> {
    let mut headers = [httparse::EMPTY_HEADER; 100];
    httparse::Response::new(&mut headers).parse(all)
}

fn check_request(rt: &tokio::runtime::Runtime, raw: &[u8], body: &[u8]) -> Result<(), TestCaseError> {
    let all = [raw, body].concat();
    let codec = codec_request(raw, body);
    // Syntax: the codec accepts nothing httparse refuses, with the same length.
    if let Ok(Some((head, _))) = &codec {
        prop_assert_eq!(httparse_request(&all), Ok(httparse::Status::Complete(head.len)));
    }
    if let Err(HeadError::Syntax(_)) = codec {
        prop_assert!(httparse_request(&all).is_err() || head_incomplete(&all), "refused as syntax, httparse accepts");
    }
    let Ok(Some((head, codec_read))) = codec else {
        if let Err(e) = codec {
            // The codec refused: hyper too, or the difference is documented.
            if let Some(hyper_read) = rt.block_on(hyper_request(raw, body)) {
                prop_assert!(
                    stricter(e).is_some(),
                    "the codec refuses ({e:?}) what hyper accepts (reading {hyper_read:?})"
                );
            }
        }
        return Ok(());
    };
    let hyper = rt.block_on(hyper_request(raw, body));
    same_body(&all, head.len, codec_read, hyper, "request")
}

/// Both read a body: the same one, or both fail to; otherwise the
/// difference must be a documented lenient or stricter choice.
fn same_body(all: &[u8], head_len: usize, codec_read: Read, hyper: HyperRead, what: &str) -> Result<(), TestCaseError> {
    match hyper {
        Some(hyper_read) if codec_read.as_ref().ok() == hyper_read.as_ref().ok() => {}
        Some(Ok(_)) if codec_read.is_err() && long_chunk_size(&all[head_len..]) => {}
        Some(hyper_read) => prop_assert!(
            lenient(all).is_some(),
            "the codec reads {:?}, hyper {:?}",
            codec_read.map(Raw),
            hyper_read.map(Raw)
        ),
        None => prop_assert!(lenient(all).is_some(), "hyper refuses a {} the codec accepts", what),
    }
    Ok(())
}

/// httparse's `Partial` on a buffer with the head's end inside (the codec
/// is fed head and body together, like a socket would).
fn head_incomplete(all: &[u8]) -> bool {
    matches!(httparse_request(all), Ok(httparse::Status::Partial))
}

fn check_response(rt: &tokio::runtime::Runtime, raw: &[u8], body: &[u8], to_head: bool) -> Result<(), TestCaseError> {
    let all = [raw, body].concat();
    let codec = codec_response(raw, body, to_head);
    if let Ok(Some((head, _))) = &codec {
        prop_assert_eq!(httparse_response(&all), Ok(httparse::Status::Complete(head.len)));
        // Interim answers are read past by hyper's client: not comparable.
        if (100..200).contains(&head.code) {
            return Ok(());
        }
    }
    let Ok(Some((head, codec_read))) = codec else {
        if let Err(e) = codec {
            if let Some(hyper_read) = rt.block_on(hyper_response(raw, body, to_head)) {
                prop_assert!(
                    stricter(e).is_some(),
                    "the codec refuses ({e:?}) a response hyper accepts (reading {hyper_read:?})"
                );
            }
        }
        return Ok(());
    };
    let hyper = rt.block_on(hyper_response(raw, body, to_head));
    same_body(&all, head.len, codec_read, hyper, "response")
}

#[test]
fn request_heads_against_httparse_and_hyper() {
    let rt = runtime();
    support::campaign("request_heads", file!(), 256, request(), |(raw, body)| check_request(&rt, &raw.0, &body.0));
}

#[test]
fn response_heads_against_httparse_and_hyper() {
    let rt = runtime();
    support::campaign("response_heads", file!(), 256, response(), |(raw, body, to_head)| {
        check_response(&rt, &raw.0, &body.0, to_head)
    });
}

/// Arbitrary bytes: no panic, and nothing accepted that httparse refuses.
#[test]
fn arbitrary_bytes_as_heads() {
    let bytes = proptest::collection::vec(any::<u8>(), 0..400).prop_map(Raw);
    support::campaign("arbitrary_heads", file!(), 512, bytes, |Raw(input)| {
        let mut req = RequestHead::default();
        if let Ok(Some(())) = parse_request(&input, HeadLimits::default(), &mut req) {
            prop_assert_eq!(httparse_request(&input), Ok(httparse::Status::Complete(req.len)));
        }
        let mut resp = ResponseHead::default();
        if let Ok(Some(())) = parse_response(&input, HeadLimits::default(), false, &mut resp) {
            prop_assert_eq!(httparse_response(&input), Ok(httparse::Status::Complete(resp.len)));
        }
        Ok(())
    });
}

/// Every difference the campaign found, replayed as it was found (the
/// corpus of docs/fuzzing.md): each is checked again, and classified.
#[test]
fn found_differences_stay_as_documented() {
    let rt = runtime();
    let requests: &[(&[u8], &[u8], Option<Lenient>)] = &[
        (b"GET /p HTTP/1.1\r\ncontent-length: 5, 5\r\n\r\n", b"0\r\n\r\n", Some(Lenient::LengthList)),
        (b"G T/p HTTP/1.1\r\n\r\n", b"0\r\n\r\n", Some(Lenient::TargetForm)),
        (b"GET /p HTTP/1.1\r\n\r\n", b"", None),
    ];
    for (raw, body, class) in requests {
        assert_eq!(lenient(&[*raw, *body].concat()), *class, "{:?}", Raw(raw.to_vec()));
        check_request(&rt, raw, body).unwrap();
    }
    let responses: &[(&[u8], &[u8], Option<Lenient>)] = &[
        (
            b"HTTP/1.1 404 Not Found\r\ntransfer-encoding: chunked, \r\n\r\n",
            b"0\r\n\r\n",
            Some(Lenient::EmptyListElement),
        ),
        (
            b"HTTP/1.0 404 Not Found\r\ntransfer-encoding: chunked\r\n\r\n",
            b"0\r\n\r\n",
            Some(Lenient::CodingInHttp10Response),
        ),
    ];
    for (raw, body, class) in responses {
        assert_eq!(lenient(&[*raw, *body].concat()), *class, "{:?}", Raw(raw.to_vec()));
        check_response(&rt, raw, body, false).unwrap();
    }
}

/// The stricter choices of docs/fuzzing.md: the codec refuses each of
/// these and hyper reads a body from it.
#[test]
fn stricter_choices_as_documented() {
    let rt = runtime();
    let chunked: &[u8] = b"3\r\nabc\r\n0\r\n\r\n";
    let requests: &[(&[u8], Difference)] = &[
        (b"POST /p HTTP/1.1\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n", Difference::LengthAndCoding),
        (b"GET /p HTTP/1.1\r\nhost: a\r\nhost: b\r\n\r\n", Difference::DuplicateHost),
        (b"POST /p HTTP/1.1\r\ntransfer-encoding: chunked, chunked\r\n\r\n", Difference::CodingList),
        (b"POST /p HTTP/1.1\r\ntransfer-encoding: gzip, chunked\r\n\r\n", Difference::UnsupportedCoding),
    ];
    for (raw, class) in requests {
        let Err(e) = codec_request(raw, chunked) else { panic!("accepted: {:?}", Raw(raw.to_vec())) };
        assert_eq!(stricter(e), Some(*class));
        assert!(rt.block_on(hyper_request(raw, chunked)).is_some_and(|r| r.is_ok()), "{:?}", Raw(raw.to_vec()));
    }
    let responses: &[(&[u8], Difference)] = &[
        (b"HTTP/1.1 600 Odd\r\ncontent-length: 3\r\n\r\n", Difference::StatusRange),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n", Difference::UnsupportedCoding),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n", Difference::UnsupportedCoding),
    ];
    for (raw, class) in responses {
        let Err(e) = codec_response(raw, chunked, false) else { panic!("accepted: {:?}", Raw(raw.to_vec())) };
        assert_eq!(stricter(e), Some(*class));
        assert!(rt.block_on(hyper_response(raw, chunked, false)).is_some_and(|r| r.is_ok()), "{:?}", Raw(raw.to_vec()));
    }
}
