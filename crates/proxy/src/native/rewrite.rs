//! The heads the native path writes: a client's request rewritten for its
//! backend, and a backend's response rewritten for the client. Pure: bytes
//! in, bytes out, unit-tested without sockets. The rules are those of the
//! hyper path (`crate::headers`): hop-by-hop fields and the fields the
//! `Connection` header names are dropped, forwarding fields are set (kept
//! and appended to only from trusted proxies), and framing fields are
//! written from the framing the proxy actually uses.

use smallvec::SmallVec;
use tidegate_h1::{connection_has, Header, HeaderKind, RequestHead, ResponseHead};
use tidegate_rules::HeaderEdit;

use crate::conn::Peer;

/// How a body is framed on the connection a head is written to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Framing {
    /// No body, or none announced (a response to `HEAD`, 204, 304).
    None,
    /// `Content-Length: n`.
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
    /// Until the connection closes (responses to HTTP/1.0 clients only).
    UntilClose,
}

/// What the proxy adds to a request for its backend.
#[derive(Clone, Copy)]
pub(crate) struct Forwarding<'a> {
    /// The host the request named (or the backend's own authority).
    pub host: &'a str,
    /// Whether the request named a host (else `X-Forwarded-Host` is not set).
    pub named_host: bool,
    /// The client (its address, its listener's scheme and port).
    pub peer: &'a Peer,
    /// The `Upgrade` value of an upgrade the proxy passes on.
    pub upgrade: Option<&'a [u8]>,
    /// The body's framing towards the backend.
    pub body: Framing,
    /// The `X-Request-Id` to send: the client's when it is kept
    /// ([`crate::headers::client_request_id`]), else a new one. The
    /// client's own fields are never copied.
    pub request_id: &'a [u8],
    /// The route's rules, whose request header edits are made last (after
    /// the proxy's own fields: a rule may set `Host` or `X-Forwarded-For`).
    pub edits: Option<&'a tidegate_rules::Forward>,
    /// The trace context the backend gets, when tracing is on: the
    /// client's `traceparent` is replaced, its `tracestate` kept only with
    /// its own `traceparent`.
    pub trace: Option<&'a Upstream>,
}

/// The trace context a backend gets.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Upstream {
    /// The `traceparent` naming the proxy's span.
    pub traceparent: [u8; tidegate_trace::TRACEPARENT_LEN],
    /// Whether the client's `tracestate` goes on.
    pub tracestate: bool,
}

impl Upstream {
    /// Whether the client's field `name` is left out for this context.
    fn replaces(&self, name: &[u8]) -> bool {
        name.eq_ignore_ascii_case(b"traceparent") || (!self.tracestate && name.eq_ignore_ascii_case(b"tracestate"))
    }

    /// Sets the context in a header map (the HTTP/2 upstream).
    pub(crate) fn set(&self, h: &mut http::HeaderMap) {
        if !self.tracestate {
            h.remove("tracestate");
        }
        if let Ok(v) = http::HeaderValue::from_bytes(&self.traceparent) {
            h.insert("traceparent", v);
        }
    }
}

/// Whether `h` is dropped when a message is forwarded: hop-by-hop, or
/// named by a `Connection` field (`has_connection`: one is present).
fn dropped(buf: &[u8], headers: &[Header], h: &Header, has_connection: bool) -> bool {
    h.kind.is_hop_by_hop()
        || (has_connection
            && h.kind == HeaderKind::Other
            && std::str::from_utf8(h.name.of(buf)).is_ok_and(|n| connection_has(buf, headers, n)))
}

/// Whether a field of a backend's response reaches the client as sent:
/// not hop-by-hop, not named in `Connection`, and never its
/// `Content-Length` (the proxy writes its own, [`announced_length`]).
pub(crate) fn forwards_response_field(buf: &[u8], resp: &ResponseHead, h: &Header) -> bool {
    h.kind != HeaderKind::ContentLength && !dropped(buf, &resp.headers, h, resp.connection.present)
}

/// The `Content-Length` a forwarded response announces: the length that
/// frames its body towards the client, or for a bodiless answer to `HEAD`
/// and a 304 the backend's (checked) one. Never on a 1xx or 204 (RFC 9110,
/// section 8.6).
pub(crate) fn announced_length(resp: &ResponseHead, framing: Framing) -> Option<u64> {
    match framing {
        Framing::Length(n) => Some(n),
        Framing::None if resp.code >= 200 && resp.code != 204 => resp.length,
        _ => None,
    }
}

/// Writes one `name: value` line.
pub(crate) fn field(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// Writes a field of the head parsed from `buf` as [`field`] would: its
/// line copied in one piece when it came in that very form (the usual
/// case), else name and value.
pub(crate) fn copy_field(out: &mut Vec<u8>, buf: &[u8], h: &Header) {
    match h.line(buf) {
        Some(line) => out.extend_from_slice(line),
        None => field(out, h.name.of(buf), h.value.of(buf)),
    }
}

/// Writes the field that announces `framing`, if any.
pub(crate) fn framing_fields(out: &mut Vec<u8>, framing: Framing) {
    match framing {
        Framing::Length(n) => {
            let mut digits = itoa::Buffer::new();
            field(out, b"content-length", digits.format(n).as_bytes());
        }
        Framing::Chunked => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
        Framing::None | Framing::UntilClose => {}
    }
}

/// Writes the request head for a backend into `out` (cleared first):
/// `target` is the normalized path with the original query.
pub(crate) fn request_head(out: &mut Vec<u8>, buf: &[u8], head: &RequestHead, target: &str, f: &Forwarding<'_>) {
    out.clear();
    out.extend_from_slice(head.method.of(buf));
    out.push(b' ');
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    out.extend_from_slice(f.host.as_bytes());
    out.extend_from_slice(b"\r\n");
    let headers = &head.headers;
    let has_connection = head.connection.present;
    let trusted = f.peer.trusted;
    let mut prior_xff: Option<&[u8]> = None;
    for h in headers {
        let other = h.kind == HeaderKind::Other;
        let refused = other && !crate::hygiene::forwards_request_field(h.name.of(buf));
        let traced = other && f.trace.is_some_and(|t| t.replaces(h.name.of(buf)));
        if refused || traced || dropped(buf, headers, h, has_connection) {
            continue;
        }
        match h.kind {
            // Written below from what the proxy knows.
            HeaderKind::Host
            | HeaderKind::ContentLength
            | HeaderKind::Expect
            | HeaderKind::XForwardedProto
            | HeaderKind::XForwardedHost
            | HeaderKind::XForwardedPort
            | HeaderKind::XRequestId => continue,
            HeaderKind::XForwardedFor => {
                if trusted && prior_xff.is_none() {
                    prior_xff = Some(h.value.of(buf));
                }
                continue;
            }
            HeaderKind::Forwarded | HeaderKind::XRealIp if !trusted => continue,
            _ => copy_field(out, buf, h),
        }
    }
    out.extend_from_slice(b"x-forwarded-for: ");
    if let Some(prior) = prior_xff {
        out.extend_from_slice(prior);
        out.extend_from_slice(b", ");
    }
    out.extend_from_slice(f.peer.ip_header.as_bytes());
    out.extend_from_slice(b"\r\nx-forwarded-proto: ");
    out.extend_from_slice(f.peer.scheme().as_bytes());
    out.extend_from_slice(b"\r\nx-forwarded-port: ");
    out.extend_from_slice(f.peer.port_header.as_bytes());
    out.extend_from_slice(b"\r\n");
    if f.named_host {
        field(out, b"x-forwarded-host", f.host.as_bytes());
    }
    field(out, b"x-request-id", f.request_id);
    if let Some(t) = f.trace {
        field(out, b"traceparent", &t.traceparent);
    }
    framing_fields(out, f.body);
    if let Some(u) = f.upgrade {
        field(out, b"upgrade", u);
        out.extend_from_slice(b"connection: upgrade\r\n");
    }
    out.extend_from_slice(b"\r\n");
    if let Some(edits) = f.edits {
        let lines = fitting(edits.request_lines(), request_field_written, buf, headers);
        edit_head(out, lines, edits.request_edits(), |name| {
            request_field_written(name) || has_field(buf, headers, name)
        });
    }
}

/// Whether one of `headers` (of a head parsed from `buf`) is named `name`,
/// in any case. Lengths are compared first, without reading the buffer.
fn has_field(buf: &[u8], headers: &[Header], name: &[u8]) -> bool {
    headers.iter().any(|h| h.name.len() == name.len() && h.name.of(buf).eq_ignore_ascii_case(name))
}

/// `lines`, if the head they go into can have none of their fields: none
/// is one the head's writer writes of its own (`written`), nor one of
/// `headers` (those it copies, of a head parsed from `buf`).
pub(crate) fn fitting<'l>(
    lines: Option<&'l tidegate_rules::Lines>,
    written: impl Fn(&[u8]) -> bool,
    buf: &[u8],
    headers: &[Header],
) -> Option<&'l tidegate_rules::Lines> {
    lines.filter(|l| !l.names().any(written) && !any_field_of(l, buf, headers))
}

/// Whether one of `headers` (of a head parsed from `buf`) is named by
/// `lines`.
fn any_field_of(lines: &tidegate_rules::Lines, buf: &[u8], headers: &[Header]) -> bool {
    headers.iter().any(|h| lines.names_field(h.name.len(), || h.name.of(buf)))
}

/// Whether [`request_head`] may write the field `name` (lowercase) of
/// its own, besides those it copies from the client's head.
fn request_field_written(name: &[u8]) -> bool {
    matches!(
        name,
        b"host"
            | b"x-forwarded-for"
            | b"x-forwarded-proto"
            | b"x-forwarded-port"
            | b"x-forwarded-host"
            | b"x-request-id"
            | b"traceparent"
            | b"content-length"
            | b"transfer-encoding"
            | b"upgrade"
            | b"connection"
    )
}

/// Whether the field `name` (lowercase) may be in a response head written
/// by [`response_head`] from `resp` (and `extra`, a line added to it).
pub(crate) fn response_may_have(buf: &[u8], resp: &ResponseHead, extra: Option<&[u8]>, name: &[u8]) -> bool {
    response_field_written(extra, name) || has_field(buf, &resp.headers, name)
}

/// Whether [`response_head`] may write the field `name` (lowercase) of
/// its own, or `extra` (a line added to the head) is one.
pub(crate) fn response_field_written(extra: Option<&[u8]>, name: &[u8]) -> bool {
    matches!(name, b"content-length" | b"transfer-encoding" | b"connection")
        || extra.is_some_and(|line| line.get(..name.len()).is_some_and(|n| n.eq_ignore_ascii_case(name)))
}

/// The field an edit is about.
fn edited(edit: &HeaderEdit) -> &http::HeaderName {
    match edit {
        HeaderEdit::Set(n, _) | HeaderEdit::SetIfAbsent(n, _) | HeaderEdit::Add(n, _) | HeaderEdit::Remove(n) => n,
    }
}

/// Makes a rule's header `edits`, in order, to the complete head written
/// in `out` (its start line, its fields, the empty line), in one pass and
/// without a header map: a field an edit names keeps its lines where they
/// are unless a `Set` or `Remove` replaced them, and the values the edits
/// add are written at the end of the head. Framing fields are never named
/// (the model refuses them in a rule).
///
/// `may_have(name)` (a lowercase name) says whether the head may have the
/// field: the writer of the head knows, from the fields it wrote, without
/// reading the head again. The head is scanned for the fields it may have
/// only; one it cannot have is taken as absent (so `may_have` must never
/// say no for a field the head has; a yes for one it lacks only costs the
/// scan).
///
/// `lines`: the same edits written out when the chain compiled
/// ([`tidegate_rules::Lines`]), given only when the head has none of
/// their fields (the caller knows, as `may_have` does): they are added
/// in one copy.
pub(crate) fn edit_head<'e, I>(
    out: &mut Vec<u8>,
    lines: Option<&tidegate_rules::Lines>,
    edits: I,
    may_have: impl Fn(&[u8]) -> bool,
) where
    I: IntoIterator<Item = &'e HeaderEdit>,
    I::IntoIter: Clone,
{
    if let Some(lines) = lines {
        if out.ends_with(b"\r\n\r\n") {
            out.truncate(out.len() - 2);
            out.extend_from_slice(lines.head_end());
            return;
        }
    }
    let edits = edits.into_iter();
    if edits.clone().next().is_none() {
        return;
    }
    // The usual case: each edit sets or adds a field the head cannot have,
    // and names a field no other edit names: the fields are appended in
    // place, before the empty line.
    let appended = |at: usize, e: &HeaderEdit| {
        matches!(e, HeaderEdit::Set(..) | HeaderEdit::Add(..))
            && !may_have(edited(e).as_str().as_bytes())
            && edits.clone().take(at).all(|before| edited(before) != edited(e))
    };
    if edits.clone().enumerate().all(|(at, e)| appended(at, e)) && out.ends_with(b"\r\n\r\n") {
        out.truncate(out.len() - 2);
        for e in edits {
            if let HeaderEdit::Set(n, v) | HeaderEdit::Add(n, v) = e {
                field(out, n.as_str().as_bytes(), v.as_bytes());
            }
        }
        out.extend_from_slice(b"\r\n");
        return;
    }
    let same = |n: &http::HeaderName, line_name: &[u8]| n.as_str().as_bytes().eq_ignore_ascii_case(line_name);
    // Per field the edits name: whether the head has it, whether its
    // lines stay, and the values the edits add after them. On the stack
    // for the usual few edits.
    struct Named<'e> {
        name: &'e http::HeaderName,
        may: bool,
        in_head: bool,
        keep: bool,
        has: bool,
        added: SmallVec<[&'e http::HeaderValue; 1]>,
    }
    // The fields the edits name, in order of first mention, and in one
    // pass over the head's lines which of them it has.
    let mut named: SmallVec<[Named<'_>; 4]> = SmallVec::new();
    for edit in edits.clone() {
        let name = edited(edit);
        if !named.iter().any(|n| n.name == name) {
            let may = may_have(name.as_str().as_bytes());
            named.push(Named { name, may, in_head: false, keep: true, has: false, added: SmallVec::new() });
        }
    }
    if named.iter().any(|n| n.may) {
        for (line_name, _) in head_fields(out) {
            for n in named.iter_mut().filter(|n| n.may && !n.in_head) {
                n.in_head = same(n.name, line_name);
            }
        }
    }
    for n in named.iter_mut() {
        n.has = n.in_head;
    }
    for edit in edits {
        let name = edited(edit);
        let Some(at) = named.iter().position(|n| n.name == name) else { continue };
        let n = &mut named[at];
        match edit {
            HeaderEdit::Set(_, v) => {
                (n.keep, n.has) = (false, true);
                n.added.clear();
                n.added.push(v);
            }
            HeaderEdit::Add(_, v) => {
                n.has = true;
                n.added.push(v);
            }
            HeaderEdit::SetIfAbsent(_, v) if !n.has => {
                n.has = true;
                n.added.push(v);
            }
            HeaderEdit::SetIfAbsent(..) => {}
            HeaderEdit::Remove(_) => {
                (n.keep, n.has) = (false, false);
                n.added.clear();
            }
        }
    }
    if named.iter().all(|n| n.keep || !n.in_head) && out.ends_with(b"\r\n\r\n") {
        // No line of the head goes (the usual case: fields the backend
        // did not send): the values are appended in place, before the
        // empty line, without copying the head.
        out.truncate(out.len() - 2);
    } else {
        let head = std::mem::take(out);
        out.reserve(head.len() + 64 * named.len());
        let start = head.iter().position(|b| *b == b'\n').map_or(head.len(), |i| i + 1);
        out.extend_from_slice(&head[..start]);
        for (name, line) in head_fields(&head) {
            if named.iter().all(|n| n.keep || !same(n.name, name)) {
                out.extend_from_slice(line);
                out.extend_from_slice(b"\r\n");
            }
        }
    }
    for n in &named {
        for v in &n.added {
            field(out, n.name.as_str().as_bytes(), v.as_bytes());
        }
    }
    out.extend_from_slice(b"\r\n");
}

/// The fields of a complete head (after its start line, before the empty
/// line): each line's name and the whole line (without its CRLF). Lines
/// are found with `memchr` (a head is scanned a few bytes at a time, not
/// one).
fn head_fields(head: &[u8]) -> impl Iterator<Item = (&[u8], &[u8])> {
    let mut at = memchr::memchr(b'\n', head).map_or(head.len(), |i| i + 1);
    std::iter::from_fn(move || loop {
        let rest = head.get(at..).filter(|r| !r.is_empty())?;
        let end = memchr::memchr(b'\n', rest).unwrap_or(rest.len());
        at += end + 1;
        let line = &rest[..end];
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.is_empty() {
            at = head.len();
            return None;
        }
        if let Some(colon) = memchr::memchr(b':', line) {
            return Some((&line[..colon], line));
        }
    })
}

/// Edits the fields of the head written in `out` that `named` selects:
/// they are taken out into a map, `edit` changes it, and what it leaves
/// is written at the end of the head.
pub(crate) fn edit_fields(out: &mut Vec<u8>, named: impl Fn(&[u8]) -> bool, edit: impl FnOnce(&mut http::HeaderMap)) {
    let head = std::mem::take(out);
    let mut lines = head.split(|b| *b == b'\n').map(|l| l.strip_suffix(b"\r").unwrap_or(l));
    let mut fields = http::HeaderMap::new();
    if let Some(start) = lines.next() {
        out.extend_from_slice(start);
        out.extend_from_slice(b"\r\n");
    }
    for line in lines.take_while(|l| !l.is_empty()) {
        let Some(colon) = line.iter().position(|b| *b == b':') else { continue };
        let (name, value) = (&line[..colon], line[colon + 1..].trim_ascii());
        if !named(name) {
            out.extend_from_slice(line);
            out.extend_from_slice(b"\r\n");
        } else if let (Ok(n), Ok(v)) = (http::HeaderName::from_bytes(name), http::HeaderValue::from_bytes(value)) {
            fields.append(n, v);
        }
    }
    edit(&mut fields);
    for (name, value) in &fields {
        field(out, name.as_str().as_bytes(), value.as_bytes());
    }
    out.extend_from_slice(b"\r\n");
}

/// Writes the response head for the client into `out` (cleared first).
/// `close`: the proxy closes the client connection after this response;
/// `keep_alive_10`: an HTTP/1.0 client asked to keep it open and it stays.
pub(crate) fn response_head(
    out: &mut Vec<u8>,
    buf: &[u8],
    resp: &ResponseHead,
    framing: Framing,
    close: bool,
    keep_alive_10: bool,
) {
    out.clear();
    status_line(out, resp.code, resp.reason.of(buf));
    let upgrade = resp.code == 101;
    for h in &resp.headers {
        if (upgrade && h.kind == HeaderKind::Upgrade) || forwards_response_field(buf, resp, h) {
            copy_field(out, buf, h);
        }
    }
    match announced_length(resp, framing) {
        Some(n) => framing_fields(out, Framing::Length(n)),
        None => framing_fields(out, framing),
    }
    if upgrade {
        out.extend_from_slice(b"connection: upgrade\r\n");
    } else if close {
        out.extend_from_slice(b"connection: close\r\n");
    } else if keep_alive_10 {
        out.extend_from_slice(b"connection: keep-alive\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

/// Adds `line` (`name: value\r\n`) to the head written in `out`, before
/// its empty line.
pub(crate) fn add_line(out: &mut Vec<u8>, line: &[u8]) {
    let end = out.len().saturating_sub(2);
    out.splice(end..end, line.iter().copied());
}

/// Writes `HTTP/1.1 CODE REASON\r\n`; an empty reason becomes the
/// standard one.
pub(crate) fn status_line(out: &mut Vec<u8>, code: u16, reason: &[u8]) {
    out.extend_from_slice(b"HTTP/1.1 ");
    let mut digits = itoa::Buffer::new();
    out.extend_from_slice(digits.format(code).as_bytes());
    out.push(b' ');
    if reason.is_empty() {
        let standard = http::StatusCode::from_u16(code).ok().and_then(|s| s.canonical_reason()).unwrap_or("");
        out.extend_from_slice(standard.as_bytes());
    } else {
        out.extend_from_slice(reason);
    }
    out.extend_from_slice(b"\r\n");
}

/// Writes the head of a response the proxy makes itself (an error, a
/// static file): its status, its fields, the framing and `Connection`
/// (`close`, or `keep-alive` to an HTTP/1.0 client whose connection stays
/// open: `minor` is the request's HTTP/1 minor version). An answer to
/// `HEAD` (`framing` is `None`) keeps its `Content-Length`.
pub(crate) fn local_head(
    out: &mut Vec<u8>,
    status: http::StatusCode,
    headers: &http::HeaderMap,
    framing: Framing,
    close: bool,
    minor: u8,
) {
    out.clear();
    status_line(out, status.as_u16(), status.canonical_reason().unwrap_or("").as_bytes());
    for (name, value) in headers {
        let framing_field = *name == http::header::CONTENT_LENGTH || *name == http::header::TRANSFER_ENCODING;
        if framing_field && (framing != Framing::None || *name == http::header::TRANSFER_ENCODING) {
            continue;
        }
        field(out, name.as_str().as_bytes(), value.as_bytes());
    }
    framing_fields(out, framing);
    if close {
        out.extend_from_slice(b"connection: close\r\n");
    } else if minor == 0 {
        out.extend_from_slice(b"connection: keep-alive\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidegate_h1::{parse_request, parse_response, HeadLimits};

    fn rewrite(raw: &str, trusted: bool, body: Framing) -> String {
        rewrite_with_id(raw, trusted, body, b"id-1")
    }

    fn rewrite_with_id(raw: &str, trusted: bool, body: Framing, request_id: &[u8]) -> String {
        rewrite_traced(raw, trusted, body, request_id, None)
    }

    fn rewrite_traced(raw: &str, trusted: bool, body: Framing, request_id: &[u8], trace: Option<&Upstream>) -> String {
        let mut head = RequestHead::default();
        parse_request(raw.as_bytes(), HeadLimits::default(), &mut head).unwrap().unwrap();
        let mut peer = Peer::new("192.0.2.9:5000".parse().unwrap());
        peer.trusted = trusted;
        peer.set_listener(8080, false);
        let f = Forwarding {
            host: "h.example",
            named_host: true,
            peer: &peer,
            upgrade: None,
            body,
            request_id,
            edits: None,
            trace,
        };
        let mut out = Vec::new();
        request_head(&mut out, raw.as_bytes(), &head, "/p?q", &f);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn the_request_id_is_sent_once_and_the_clients_fields_never_copied() {
        let id = crate::headers::new_request_id();
        assert!(id.iter().all(u8::is_ascii_hexdigit));
        assert_ne!(id, crate::headers::new_request_id(), "a new one each time");
        let added = rewrite_with_id("GET / HTTP/1.1\r\nHost: h\r\n\r\n", false, Framing::None, &id);
        let line = format!("x-request-id: {}\r\n", std::str::from_utf8(&id).unwrap());
        assert!(added.contains(&line), "{added}");
        // Two client ids: the backend gets the one the caller chose, once.
        let raw = "GET / HTTP/1.1\r\nHost: h\r\nX-Request-Id: abc\r\nx-request-id: def\r\n\r\n";
        let out = rewrite_with_id(raw, false, Framing::None, &id);
        assert_eq!(out.to_ascii_lowercase().matches("x-request-id:").count(), 1, "{out}");
        assert!(out.contains(&line), "{out}");
        let kept =
            rewrite_with_id("GET / HTTP/1.1\r\nHost: h\r\nX-Request-Id: abc\r\n\r\n", false, Framing::None, b"abc");
        assert_eq!(kept.to_ascii_lowercase().matches("x-request-id: abc\r\n").count(), 1, "{kept}");
    }

    #[test]
    fn with_tracing_the_backend_gets_the_proxys_traceparent_and_tracestate_only_with_the_callers() {
        let ours = *b"00-4bf92f3577b34da6a3ce929d0e0e4736-1111111111111111-01";
        let raw =
            "GET / HTTP/1.1\r\nHost: h\r\nTraceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\r\n\
                   TraceState: a=1\r\n\r\n";
        let kept = Upstream { traceparent: ours, tracestate: true };
        let out = rewrite_traced(raw, false, Framing::None, b"id", Some(&kept)).to_ascii_lowercase();
        assert_eq!(out.matches("traceparent:").count(), 1, "{out}");
        assert!(out.contains("traceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-1111111111111111-01\r\n"), "{out}");
        assert!(out.contains("tracestate: a=1\r\n"), "{out}");
        let dropped = Upstream { traceparent: ours, tracestate: false };
        let out = rewrite_traced(raw, false, Framing::None, b"id", Some(&dropped)).to_ascii_lowercase();
        assert!(!out.contains("tracestate"), "{out}");
        // Tracing off: both pass as any field.
        let out = rewrite(raw, false, Framing::None).to_ascii_lowercase();
        assert!(out.contains("00f067aa0ba902b7") && out.contains("tracestate: a=1"), "{out}");
        let mut map = http::HeaderMap::new();
        map.insert("tracestate", http::HeaderValue::from_static("x=1"));
        map.insert("traceparent", http::HeaderValue::from_static("junk"));
        dropped.set(&mut map);
        assert_eq!(map.get("traceparent").unwrap().as_bytes(), &ours[..]);
        assert!(map.get("tracestate").is_none());
    }

    #[test]
    fn requests_lose_hop_by_hop_and_untrusted_forwarding_fields() {
        let raw = "POST /x/../p?q HTTP/1.1\r\nHost: H.example\r\nConnection: close, X-Secret\r\nX-Secret: 1\r\n\
                   Proxy-Authorization: Basic Zm9v\r\nTE: trailers\r\nX-Forwarded-For: 203.0.113.9\r\n\
                   X-Real-IP: 203.0.113.9\r\nForwarded: for=x\r\nTransfer-Encoding: chunked\r\nX-Kept: yes\r\n\
                   X_Forwarded_For: 6.6.6.6\r\nX_Real_IP: 6.6.6.6\r\n\r\n";
        let out = rewrite(raw, false, Framing::Chunked);
        assert_eq!(
            out,
            "POST /p?q HTTP/1.1\r\nhost: h.example\r\nX-Kept: yes\r\nx-forwarded-for: 192.0.2.9\r\n\
             x-forwarded-proto: http\r\nx-forwarded-port: 8080\r\nx-forwarded-host: h.example\r\n\
             x-request-id: id-1\r\ntransfer-encoding: chunked\r\n\r\n"
        );
        let trusted = rewrite(raw, true, Framing::Length(5));
        assert!(trusted.contains("x-forwarded-for: 203.0.113.9, 192.0.2.9\r\n"), "{trusted}");
        assert!(trusted.contains("X-Real-IP: 203.0.113.9\r\n") && trusted.contains("content-length: 5\r\n"));
        assert!(!trusted.contains("Proxy-Authorization"));
    }

    fn respond(raw: &str, framing: Framing, close: bool) -> String {
        let mut head = ResponseHead::default();
        parse_response(raw.as_bytes(), HeadLimits::default(), false, &mut head).unwrap().unwrap();
        let mut out = Vec::new();
        response_head(&mut out, raw.as_bytes(), &head, framing, close, false);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn responses_are_reframed_and_lose_hop_by_hop_fields() {
        let both =
            "HTTP/1.1 200 OK\r\nContent-Length: 9\r\nTransfer-Encoding: chunked\r\nKeep-Alive: 5\r\nX-A: 1\r\n\r\n";
        assert_eq!(
            respond(both, Framing::Chunked, false),
            "HTTP/1.1 200 OK\r\nX-A: 1\r\ntransfer-encoding: chunked\r\n\r\n"
        );
        // The length is the proxy's own field, one value, written once.
        let doubled = "HTTP/1.1 200 OK\r\nContent-Length: 2, 02\r\nContent-Length: 2\r\nX-A: 1\r\n\r\n";
        assert_eq!(
            respond(doubled, Framing::Length(2), false),
            "HTTP/1.1 200 OK\r\nX-A: 1\r\ncontent-length: 2\r\n\r\n"
        );
        // A 204 announces no length; an answer to HEAD keeps the backend's.
        let no_content = "HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n";
        assert_eq!(respond(no_content, Framing::None, false), "HTTP/1.1 204 No Content\r\n\r\n");
        let mut head = ResponseHead::default();
        let to_head = "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n";
        parse_response(to_head.as_bytes(), HeadLimits::default(), true, &mut head).unwrap().unwrap();
        let mut out = Vec::new();
        response_head(&mut out, to_head.as_bytes(), &head, Framing::None, false, false);
        assert_eq!(String::from_utf8(out).unwrap(), "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n");
        let plain = "HTTP/1.1 404 \r\ncontent-length: 2\r\n\r\n";
        assert_eq!(
            respond(plain, Framing::Length(2), true),
            "HTTP/1.1 404 Not Found\r\ncontent-length: 2\r\nconnection: close\r\n\r\n"
        );
        let upgrade = "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n";
        assert_eq!(
            respond(upgrade, Framing::None, false),
            "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nconnection: upgrade\r\n\r\n"
        );
    }

    #[test]
    fn edits_apply_in_order_to_a_written_head() {
        use http::{HeaderName, HeaderValue};
        let n = |s: &'static str| HeaderName::from_static(s);
        let v = |s: &'static str| HeaderValue::from_static(s);
        let mut out =
            b"GET /p HTTP/1.1\r\nhost: a\r\nx-a: 1\r\nX-B: 2\r\nx-a: 3\r\nx-keep: k\r\ncontent-length: 0\r\n\r\n"
                .to_vec();
        let edits = [
            HeaderEdit::Add(n("x-a"), v("4")),
            HeaderEdit::Remove(n("x-b")),
            HeaderEdit::Set(n("host"), v("backend.internal")),
            HeaderEdit::SetIfAbsent(n("x-keep"), v("no")),
            HeaderEdit::SetIfAbsent(n("x-new"), v("yes")),
        ];
        edit_head(&mut out, None, &edits, |_| true);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "GET /p HTTP/1.1\r\nx-a: 1\r\nx-a: 3\r\nx-keep: k\r\ncontent-length: 0\r\nx-a: 4\r\n\
             host: backend.internal\r\nx-new: yes\r\n\r\n"
        );
        // Set after Add, Remove then Add, SetIfAbsent after Remove.
        let mut out = b"HTTP/1.1 200 OK\r\nx: 1\r\ny: 2\r\nz: 3\r\n\r\n".to_vec();
        let edits = [
            HeaderEdit::Add(n("x"), v("a")),
            HeaderEdit::Set(n("x"), v("b")),
            HeaderEdit::Remove(n("y")),
            HeaderEdit::Add(n("y"), v("c")),
            HeaderEdit::Remove(n("z")),
            HeaderEdit::SetIfAbsent(n("z"), v("d")),
        ];
        edit_head(&mut out, None, &edits, |_| true);
        assert_eq!(String::from_utf8(out).unwrap(), "HTTP/1.1 200 OK\r\nx: b\r\ny: c\r\nz: d\r\n\r\n");
        let mut same = b"HTTP/1.1 200 OK\r\nx: 1\r\n\r\n".to_vec();
        edit_head(&mut same, None, &[] as &[HeaderEdit], |_| true);
        assert_eq!(same, b"HTTP/1.1 200 OK\r\nx: 1\r\n\r\n");
        // No line goes (new fields, an Add, a SetIfAbsent of a field the
        // head has): appended in place, the head not copied.
        let mut out = Vec::with_capacity(256);
        out.extend_from_slice(b"HTTP/1.1 200 OK\r\nx: 1\r\n\r\n");
        let at = out.as_ptr();
        let edits = [
            HeaderEdit::Add(n("x"), v("2")),
            HeaderEdit::Set(n("strict-transport-security"), v("max-age=1")),
            HeaderEdit::SetIfAbsent(n("x"), v("no")),
        ];
        edit_head(&mut out, None, &edits, |name| name == b"x");
        assert_eq!(
            String::from_utf8(out.clone()).unwrap(),
            "HTTP/1.1 200 OK\r\nx: 1\r\nx: 2\r\nstrict-transport-security: max-age=1\r\n\r\n"
        );
        assert_eq!(out.as_ptr(), at, "edited in place");
        // Fields the head cannot have, set or added, once each or not:
        // the same head whether the writer's word is taken or the head
        // scanned.
        let head = b"HTTP/1.1 200 OK\r\nx: 1\r\n\r\n".to_vec();
        let once = [HeaderEdit::Set(n("a"), v("1")), HeaderEdit::Add(n("b"), v("2"))];
        let twice = [HeaderEdit::Set(n("a"), v("1")), HeaderEdit::Add(n("b"), v("2")), HeaderEdit::Set(n("a"), v("3"))];
        for edits in [&once[..], &twice[..]] {
            let (mut known, mut scanned) = (head.clone(), head.clone());
            edit_head(&mut known, None, edits, |name| name == b"x");
            edit_head(&mut scanned, None, edits, |_| true);
            assert_eq!(String::from_utf8_lossy(&known), String::from_utf8_lossy(&scanned));
        }
    }

    /// A field copied in one piece is the field written name by value.
    #[test]
    fn a_copied_field_is_the_field_written() {
        let raw = "GET / HTTP/1.1\r\nHost: a\r\nX-A:b\r\nX-B: c \r\nX-C:\td\r\nX-D: \r\nX-E: e f\r\n\r\n";
        let mut head = RequestHead::default();
        tidegate_h1::parse_request(raw.as_bytes(), HeadLimits::default(), &mut head).unwrap().unwrap();
        for h in &head.headers {
            let (mut copied, mut written) = (Vec::new(), Vec::new());
            copy_field(&mut copied, raw.as_bytes(), h);
            field(&mut written, h.name.of(raw.as_bytes()), h.value.of(raw.as_bytes()));
            assert_eq!(String::from_utf8_lossy(&copied), String::from_utf8_lossy(&written));
        }
    }

    /// A chain's header steps written out when it compiled edit a head as
    /// the steps one by one do, whether the head has their fields or not.
    #[test]
    fn a_chains_lines_edit_a_head_as_its_steps_do() {
        let spec: tidegate_model::RuleSetSpec = serde_json::from_value(serde_json::json!({"steps": [
            {"kind": "set_request_header", "name": "X-A", "value": "1"},
            {"kind": "add_request_header", "name": "X-B", "value": "2"},
            {"kind": "set_response_header", "name": "Strict-Transport-Security", "value": "max-age=1",
             "only_if_absent": true},
        ]}))
        .unwrap();
        let name = tidegate_model::RuleSetName::new("s").unwrap();
        let chain = std::sync::Arc::new(tidegate_rules::Chain::compile("r", &[(name, std::sync::Arc::new(spec))]));
        let headers = http::HeaderMap::new();
        let view = tidegate_rules::RequestView {
            method: &http::Method::GET,
            host: "h",
            path: "/",
            query: None,
            headers: &headers,
            client: std::net::Ipv4Addr::LOCALHOST.into(),
            tls: false,
            content_length: None,
        };
        let tidegate_rules::Outcome::Forward(f) = chain.request(&view, std::time::Instant::now()) else {
            panic!("forwarded")
        };
        let (req, resp) = (f.request_lines().expect("request lines"), f.response_lines().expect("response lines"));
        // The lines are given when the head has none of their fields, as
        // the writer tells by the fields' lengths first; either way the
        // head comes out as the steps one by one make it.
        fn same_either_way<'e>(
            lines: &tidegate_rules::Lines,
            edits: impl Iterator<Item = &'e HeaderEdit> + Clone,
            head: &str,
            headers: &[Header],
        ) {
            let scan = |name: &[u8]| head_fields(head.as_bytes()).any(|(n, _)| n.eq_ignore_ascii_case(name));
            let named = any_field_of(lines, head.as_bytes(), headers);
            assert_eq!(named, lines.names().any(scan), "{head}");
            let (mut fast, mut slow) = (head.as_bytes().to_vec(), head.as_bytes().to_vec());
            edit_head(&mut fast, Some(lines).filter(|_| !named), edits.clone(), scan);
            edit_head(&mut slow, None, edits, scan);
            assert_eq!(String::from_utf8_lossy(&fast), String::from_utf8_lossy(&slow), "{head}");
        }
        for head in [
            "GET / HTTP/1.1\r\nhost: a\r\n\r\n",
            "GET / HTTP/1.1\r\nhost: a\r\nX-A: 0\r\nx-b: 0\r\n\r\n",
            "GET / HTTP/1.1\r\nx-b: 0\r\n\r\n",
        ] {
            let mut parsed = RequestHead::default();
            parse_request(head.as_bytes(), HeadLimits::default(), &mut parsed).unwrap().unwrap();
            same_either_way(req, f.request_edits(), head, &parsed.headers);
        }
        for head in ["HTTP/1.1 200 OK\r\nx: 1\r\n\r\n", "HTTP/1.1 200 OK\r\nStrict-Transport-Security: kept\r\n\r\n"] {
            let mut parsed = ResponseHead::default();
            parse_response(head.as_bytes(), HeadLimits::default(), false, &mut parsed).unwrap().unwrap();
            same_either_way(resp, f.response_edits(), head, &parsed.headers);
        }
        let mut out = b"HTTP/1.1 200 OK\r\n\r\n".to_vec();
        edit_head(&mut out, Some(resp), f.response_edits(), |_| false);
        assert_eq!(out, b"HTTP/1.1 200 OK\r\nstrict-transport-security: max-age=1\r\n\r\n");
    }

    /// Every field a written request head has, named by a `Set`, a
    /// `Remove` or a `SetIfAbsent` of the rules: the head edited as its
    /// writer says it may have them equals the head edited after scanning
    /// it for every field (the writer never says no for a field it wrote).
    #[test]
    fn the_writers_knowledge_of_its_head_never_misses_a_field() {
        use http::{HeaderName, HeaderValue};
        let raws = [
            "GET /a HTTP/1.1\r\nHost: h\r\nX-Kept: 1\r\nx-forwarded-for: 203.0.113.1\r\nUser-Agent: u\r\n\r\n",
            "POST /b HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\nTraceparent: t\r\nX-Request-Id: r\r\n\r\n",
            "GET /c HTTP/1.1\r\nHost: h\r\nConnection: X-Drop\r\nX-Drop: 1\r\nAccept: */*\r\n\r\n",
        ];
        let mut peer = Peer::new("192.0.2.9:5000".parse().unwrap());
        peer.set_listener(8080, false);
        let trace = Upstream { traceparent: [b'0'; tidegate_trace::TRACEPARENT_LEN], tracestate: false };
        for raw in raws {
            let mut head = RequestHead::default();
            parse_request(raw.as_bytes(), HeadLimits::default(), &mut head).unwrap().unwrap();
            let f = Forwarding {
                host: "h.example",
                named_host: true,
                peer: &peer,
                upgrade: Some(b"websocket"),
                body: Framing::Length(3),
                request_id: b"id",
                edits: None,
                trace: Some(&trace),
            };
            let mut plain = Vec::new();
            request_head(&mut plain, raw.as_bytes(), &head, "/p", &f);
            let names: Vec<String> = head_fields(&plain)
                .map(|(n, _)| String::from_utf8_lossy(n).to_ascii_lowercase())
                .chain(["x-absent".to_string()])
                .collect();
            for kind in 0..3 {
                let mut edits = tidegate_rules::Forward::default();
                for n in &names {
                    let name = HeaderName::from_bytes(n.as_bytes()).unwrap();
                    edits.add_request_edit(match kind {
                        0 => HeaderEdit::Set(name, HeaderValue::from_static("s")),
                        1 => HeaderEdit::Remove(name),
                        _ => HeaderEdit::SetIfAbsent(name, HeaderValue::from_static("a")),
                    });
                }
                let mut known = Vec::new();
                request_head(&mut known, raw.as_bytes(), &head, "/p", &Forwarding { edits: Some(&edits), ..f });
                let mut scanned = plain.clone();
                edit_head(&mut scanned, None, edits.request_edits(), |_| true);
                assert_eq!(String::from_utf8_lossy(&known), String::from_utf8_lossy(&scanned), "{raw} {kind}");
            }
        }
        // The same for a response head, with a line added to it.
        let raw = "HTTP/1.1 200 OK\r\nServer: s\r\nContent-Length: 2\r\nKeep-Alive: 5\r\nX-A: 1\r\n\r\n";
        let mut resp = ResponseHead::default();
        parse_response(raw.as_bytes(), HeadLimits::default(), false, &mut resp).unwrap().unwrap();
        let mut plain = Vec::new();
        response_head(&mut plain, raw.as_bytes(), &resp, Framing::Chunked, true, false);
        let extra = b"alt-svc: h3=\":443\"\r\n";
        add_line(&mut plain, extra);
        let names: Vec<String> =
            head_fields(&plain).map(|(n, _)| String::from_utf8_lossy(n).to_ascii_lowercase()).collect();
        assert!(names.contains(&"alt-svc".to_string()) && names.contains(&"transfer-encoding".to_string()));
        for n in &names {
            let mut edits = tidegate_rules::Forward::default();
            edits.add_response_edit(HeaderEdit::Remove(HeaderName::from_bytes(n.as_bytes()).unwrap()));
            let mut known = plain.clone();
            edit_head(&mut known, None, edits.response_edits(), |name| {
                response_may_have(raw.as_bytes(), &resp, Some(extra), name)
            });
            assert!(!String::from_utf8_lossy(&known).to_ascii_lowercase().contains(&format!("\r\n{n}:")), "{n}");
        }
    }
}
