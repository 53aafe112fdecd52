//! Static directories served by Tidegate's proxy itself: safe paths,
//! content types, conditional requests (ETag, Last-Modified) and single
//! byte ranges. [`serve`] answers an `http::Request` with a
//! [`StaticBody`]; it knows nothing of the proxy's engines, which wrap the
//! body in their own.

use std::io::SeekFrom;
use std::path::{Component, Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::SystemTime;

use bytes::Bytes;
use futures_util::Stream;
use http::{header, HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use tidegate_model::{PathPattern, StaticDir};
use tokio::io::{AsyncReadExt, AsyncSeekExt};
use tokio_util::io::ReaderStream;

/// The error of a file read.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A static route's response body: a short text (an error, a redirect), or
/// a file.
#[derive(Debug)]
pub enum StaticBody {
    /// A short body from memory.
    Text(Full<Bytes>),
    /// A file (or a range of it).
    File(FileBody),
}

impl Body for StaticBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            StaticBody::Text(t) => Pin::new(t).poll_frame(cx).map_err(|never| match never {}),
            StaticBody::File(f) => Pin::new(f).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            StaticBody::Text(t) => t.is_end_stream(),
            StaticBody::File(f) => f.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            StaticBody::Text(t) => t.size_hint(),
            StaticBody::File(f) => f.size_hint(),
        }
    }
}

/// A plain-text response.
fn plain(status: StatusCode, text: &'static str) -> Response<StaticBody> {
    let mut resp = Response::new(StaticBody::Text(Full::new(Bytes::from_static(text.as_bytes()))));
    *resp.status_mut() = status;
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    resp
}

/// A file's bytes (a range of them), streamed.
#[derive(Debug)]
pub struct FileBody {
    stream: Option<ReaderStream<tokio::io::Take<tokio::fs::File>>>,
    remaining: u64,
}

impl Body for FileBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let Some(stream) = self.stream.as_mut() else {
            return Poll::Ready(None);
        };
        match Pin::new(stream).poll_next(cx) {
            Poll::Ready(Some(Ok(chunk))) => {
                self.remaining = self.remaining.saturating_sub(chunk.len() as u64);
                Poll::Ready(Some(Ok(Frame::data(chunk))))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => {
                self.stream = None;
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.stream.is_none() || self.remaining == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.remaining)
    }
}

/// Serves `req` from `dir`; the route's path prefix is removed from the
/// request path first (`/static/a.css` under prefix `/static` is `a.css`).
pub async fn serve<B>(dir: &StaticDir, pattern: &PathPattern, req: &Request<B>) -> Response<StaticBody> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut resp = plain(StatusCode::METHOD_NOT_ALLOWED, "405 only GET and HEAD are allowed here\n");
        resp.headers_mut().insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return resp;
    }
    let path = req.uri().path();
    let rest = match pattern {
        PathPattern::Prefix(p) if p.as_ref() != "/" => path.strip_prefix(p.as_ref()).unwrap_or(path),
        _ => path,
    };
    let Some(relative) = safe_relative(rest) else {
        return plain(StatusCode::BAD_REQUEST, "400 invalid path\n");
    };
    let Some(file) = resolve(&dir.root, &relative, &dir.index).await else {
        return plain(StatusCode::NOT_FOUND, "404 not found\n");
    };
    match file {
        Resolved::Redirect => {
            let mut resp = plain(StatusCode::MOVED_PERMANENTLY, "301 moved\n");
            if let Ok(v) = HeaderValue::from_str(&format!("{path}/")) {
                resp.headers_mut().insert(header::LOCATION, v);
            }
            resp
        }
        Resolved::File(p) => send_file(&p, req.headers(), req.method() == Method::HEAD)
            .await
            .unwrap_or_else(|_| plain(StatusCode::NOT_FOUND, "404 not found\n")),
    }
}

/// Decodes a request path into a relative path with no `..`, `.`, empty
/// (except a trailing slash), NUL or backslash components.
fn safe_relative(path: &str) -> Option<PathBuf> {
    let decoded = percent_decode(path)?;
    if decoded.contains(['\0', '\\']) {
        return None;
    }
    let mut out = PathBuf::new();
    for seg in decoded.split('/').filter(|s| !s.is_empty()) {
        // "." and ".." would climb; other dot-names are hidden files
        // (.env, .git) that a static route should never publish.
        if seg.starts_with('.') {
            return None;
        }
        out.push(seg);
    }
    if out.components().all(|c| matches!(c, Component::Normal(_))) {
        // Keep the trailing slash meaning "directory".
        if decoded.ends_with('/') && !out.as_os_str().is_empty() {
            out.push("");
        }
        Some(out)
    } else {
        None
    }
}

fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3)?;
            let hex = std::str::from_utf8(hex).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

enum Resolved {
    File(PathBuf),
    /// A directory asked for without its trailing slash.
    Redirect,
}

/// Directories no static route serves from, whatever its root: the data
/// directory holds the admin token and the store (with TLS private keys).
static NEVER_SERVED: std::sync::OnceLock<Vec<PathBuf>> = std::sync::OnceLock::new();

/// Keeps every static route out of `dirs` for the life of the process
/// (the first call wins). A route whose root contains one still serves
/// everything else.
pub fn never_serve(dirs: &[&Path]) {
    let _ =
        NEVER_SERVED.set(dirs.iter().map(|d| std::fs::canonicalize(d).unwrap_or_else(|_| d.to_path_buf())).collect());
}

fn never_served(path: &Path) -> bool {
    NEVER_SERVED.get().is_some_and(|dirs| dirs.iter().any(|d| path.starts_with(d)))
}

/// Finds the file, refusing anything that leaves `root` (through symlinks
/// too) or lies in a directory never served.
async fn resolve(root: &Path, relative: &Path, index: &str) -> Option<Resolved> {
    let written = root;
    let root = tokio::fs::canonicalize(root).await.ok()?;
    // Checked when the route was written, and again here: the directory
    // may have been replaced by a link since.
    let private = NEVER_SERVED.get().map_or(&[][..], Vec::as_slice);
    if let Some(why) = tidegate_model::static_root::real_root_refusal(&root, private) {
        refused_root(written, &root, &why);
        return None;
    }
    let wants_dir = relative.as_os_str().to_string_lossy().ends_with('/');
    let full = tokio::fs::canonicalize(root.join(relative)).await.ok()?;
    if !inside(&root, &full) || never_served(&full) {
        return None;
    }
    let meta = tokio::fs::metadata(&full).await.ok()?;
    if meta.is_dir() {
        if !wants_dir && full != root {
            return Some(Resolved::Redirect);
        }
        let index = full.join(index);
        let index = tokio::fs::canonicalize(index).await.ok()?;
        return (inside(&root, &index) && !never_served(&index)).then_some(Resolved::File(index));
    }
    meta.is_file().then_some(Resolved::File(full))
}

/// Logs a static root refused while serving, at most once a minute (every
/// request to it would otherwise log).
fn refused_root(written: &Path, real: &Path, why: &str) {
    static LAST: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let last = LAST.load(std::sync::atomic::Ordering::Relaxed);
    if (last == 0 || now >= last + 60)
        && LAST
            .compare_exchange(last, now, std::sync::atomic::Ordering::Relaxed, std::sync::atomic::Ordering::Relaxed)
            .is_ok()
    {
        tracing::warn!(root = %written.display(), real = %real.display(), reason = why,
            "static route refused: its root leads where no static route may serve; answering 404");
    }
}

/// Whether `target` (canonical: symlinks resolved) is under `root` and
/// reaches no hidden name on the way: a symlink inside the root that
/// points at `.git` or outside the root publishes nothing.
fn inside(root: &Path, target: &Path) -> bool {
    target.strip_prefix(root).is_ok_and(|rest| {
        rest.components().all(|c| matches!(c, Component::Normal(n) if !n.to_string_lossy().starts_with('.')))
    })
}

/// A strong validator from size and modification time.
fn etag(len: u64, modified: SystemTime) -> String {
    let secs = modified.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    format!("\"{len:x}-{secs:x}\"")
}

fn not_modified(headers: &HeaderMap, tag: &str, modified: SystemTime) -> bool {
    if let Some(inm) = headers.get(header::IF_NONE_MATCH).and_then(|v| v.to_str().ok()) {
        return inm.split(',').any(|t| {
            let t = t.trim();
            t == "*" || t.trim_start_matches("W/") == tag
        });
    }
    let since = headers
        .get(header::IF_MODIFIED_SINCE)
        .and_then(|v| v.to_str().ok())
        .and_then(|s| httpdate::parse_http_date(s).ok());
    match since {
        Some(since) => {
            let secs = |t: SystemTime| t.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
            secs(modified) <= secs(since)
        }
        None => false,
    }
}

/// A single byte range `start..=end` within `len`, or why not.
#[derive(Debug, PartialEq, Eq)]
enum RangeAnswer {
    Whole,
    Part(u64, u64),
    Unsatisfiable,
}

fn parse_range(value: &str, len: u64) -> RangeAnswer {
    let Some(spec) = value.trim().strip_prefix("bytes=") else {
        return RangeAnswer::Whole;
    };
    if spec.contains(',') {
        // Multiple ranges: answering with the whole file is allowed.
        return RangeAnswer::Whole;
    }
    let Some((a, b)) = spec.trim().split_once('-') else {
        return RangeAnswer::Whole;
    };
    let (a, b) = (a.trim(), b.trim());
    let range = match (a.parse::<u64>(), b.parse::<u64>()) {
        (Ok(start), Ok(end)) if start <= end => (start, end.min(len.saturating_sub(1))),
        (Ok(start), Err(_)) if b.is_empty() => (start, len.saturating_sub(1)),
        (Err(_), Ok(n)) if a.is_empty() && n > 0 => (len.saturating_sub(n), len.saturating_sub(1)),
        _ => return RangeAnswer::Whole,
    };
    if len == 0 || range.0 >= len {
        RangeAnswer::Unsatisfiable
    } else {
        RangeAnswer::Part(range.0, range.1)
    }
}

async fn send_file(path: &Path, headers: &HeaderMap, head: bool) -> std::io::Result<Response<StaticBody>> {
    let mut file = tokio::fs::File::open(path).await?;
    let meta = file.metadata().await?;
    let len = meta.len();
    let modified = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
    let tag = etag(len, modified);

    let mut resp = Response::new(StaticBody::Text(Full::new(Bytes::new())));
    let h = resp.headers_mut();
    let mime = mime_guess::from_path(path).first_or_octet_stream();
    if let Ok(v) = HeaderValue::from_str(mime.essence_str()) {
        h.insert(header::CONTENT_TYPE, v);
    }
    if let Ok(v) = HeaderValue::from_str(&tag) {
        h.insert(header::ETAG, v);
    }
    if let Ok(v) = HeaderValue::from_str(&httpdate::fmt_http_date(modified)) {
        h.insert(header::LAST_MODIFIED, v);
    }
    h.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));

    if not_modified(headers, &tag, modified) {
        *resp.status_mut() = StatusCode::NOT_MODIFIED;
        return Ok(resp);
    }
    let if_range_ok = headers.get(header::IF_RANGE).and_then(|v| v.to_str().ok()).is_none_or(|v| v == tag);
    let range = match headers.get(header::RANGE).and_then(|v| v.to_str().ok()) {
        Some(r) if if_range_ok => parse_range(r, len),
        _ => RangeAnswer::Whole,
    };
    let (start, count) = match range {
        RangeAnswer::Whole => (0, len),
        RangeAnswer::Part(s, e) => {
            *resp.status_mut() = StatusCode::PARTIAL_CONTENT;
            if let Ok(v) = HeaderValue::from_str(&format!("bytes {s}-{e}/{len}")) {
                resp.headers_mut().insert(header::CONTENT_RANGE, v);
            }
            (s, e - s + 1)
        }
        RangeAnswer::Unsatisfiable => {
            let mut r = plain(StatusCode::RANGE_NOT_SATISFIABLE, "416 range not satisfiable\n");
            if let Ok(v) = HeaderValue::from_str(&format!("bytes */{len}")) {
                r.headers_mut().insert(header::CONTENT_RANGE, v);
            }
            return Ok(r);
        }
    };
    resp.headers_mut().insert(header::CONTENT_LENGTH, HeaderValue::from(count));
    if !head && count > 0 {
        file.seek(SeekFrom::Start(start)).await?;
        *resp.body_mut() = StaticBody::File(FileBody {
            stream: Some(ReaderStream::with_capacity(file.take(count), 64 * 1024)),
            remaining: count,
        });
    }
    Ok(resp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn symlinks_to_hidden_or_outside_places_are_not_served() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("www");
        std::fs::create_dir_all(root.join(".git")).unwrap();
        std::fs::write(root.join(".git/config"), "secret").unwrap();
        std::fs::write(dir.path().join("outside.txt"), "secret").unwrap();
        std::fs::write(root.join("ok.txt"), "fine").unwrap();
        std::os::unix::fs::symlink(root.join(".git"), root.join("repo")).unwrap();
        std::os::unix::fs::symlink(dir.path().join("outside.txt"), root.join("out.txt")).unwrap();
        std::os::unix::fs::symlink(root.join("ok.txt"), root.join("alias.txt")).unwrap();
        let got = |p: &'static str| {
            let root = root.clone();
            async move { resolve(&root, Path::new(p), "index.html").await.is_some() }
        };
        assert!(!got("repo/config").await, "a link to a dot-directory");
        assert!(!got("out.txt").await, "a link outside the root");
        assert!(got("alias.txt").await, "a link to a visible file inside the root is fine");
        assert!(got("ok.txt").await);
    }

    #[tokio::test]
    async fn a_root_swapped_for_a_link_to_a_system_directory_serves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("www");
        std::fs::create_dir(&root).unwrap();
        std::fs::write(root.join("passwd"), "mine").unwrap();
        assert!(resolve(&root, Path::new("passwd"), "index.html").await.is_some());
        std::fs::remove_dir_all(&root).unwrap();
        std::os::unix::fs::symlink("/etc", &root).unwrap();
        assert!(resolve(&root, Path::new("passwd"), "index.html").await.is_none(), "/etc/passwd through a link");
        std::fs::remove_file(&root).unwrap();
        std::os::unix::fs::symlink("/", &root).unwrap();
        assert!(resolve(&root, Path::new("etc/passwd"), "index.html").await.is_none(), "/ through a link");
        assert!(resolve(Path::new("/proc/self/root"), Path::new("etc/passwd"), "index.html").await.is_none());
    }

    #[test]
    fn unsafe_paths_are_refused() {
        assert_eq!(safe_relative("/a/b.css"), Some(PathBuf::from("a/b.css")));
        assert_eq!(safe_relative("/"), Some(PathBuf::new()));
        for bad in ["/../etc/passwd", "/.env", "/a/.git/config", "/a/%2e%2e/x", "/a\\b", "/%00", "/%zz", "/./a"] {
            assert_eq!(safe_relative(bad), None, "{bad}");
        }
    }

    #[test]
    fn ranges() {
        assert_eq!(parse_range("bytes=0-9", 100), RangeAnswer::Part(0, 9));
        assert_eq!(parse_range("bytes=90-", 100), RangeAnswer::Part(90, 99));
        assert_eq!(parse_range("bytes=-10", 100), RangeAnswer::Part(90, 99));
        assert_eq!(parse_range("bytes=50-500", 100), RangeAnswer::Part(50, 99));
        assert_eq!(parse_range("bytes=100-", 100), RangeAnswer::Unsatisfiable);
        assert_eq!(parse_range("bytes=0-1,3-4", 100), RangeAnswer::Whole);
        assert_eq!(parse_range("items=0-1", 100), RangeAnswer::Whole);
        assert_eq!(parse_range("bytes=9-1", 100), RangeAnswer::Whole);
    }

    #[tokio::test]
    async fn serves_files_with_validators_and_ranges() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.txt"), "hello world").unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("sub/index.html"), "<p>hi</p>").unwrap();
        let sd = StaticDir { root: dir.path().to_path_buf(), index: "index.html".into() };
        let prefix = PathPattern::Prefix("/s".into());
        let get = |path: &str, headers: &[(&str, &str)]| {
            let mut b = Request::builder().uri(path);
            for (k, v) in headers {
                b = b.header(*k, *v);
            }
            b.body(()).unwrap()
        };
        let r = serve(&sd, &prefix, &get("/s/a.txt", &[])).await;
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()[header::CONTENT_TYPE], "text/plain");
        let tag = r.headers()[header::ETAG].to_str().unwrap().to_string();
        let body = http_body_util::BodyExt::collect(r.into_body()).await.unwrap().to_bytes();
        assert_eq!(&body[..], b"hello world");

        assert_eq!(serve(&sd, &prefix, &get("/s/a.txt", &[("if-none-match", &tag)])).await.status(), 304);
        let r = serve(&sd, &prefix, &get("/s/a.txt", &[("range", "bytes=6-")])).await;
        assert_eq!(r.status(), 206);
        assert_eq!(r.headers()[header::CONTENT_RANGE], "bytes 6-10/11");
        let body = http_body_util::BodyExt::collect(r.into_body()).await.unwrap().to_bytes();
        assert_eq!(&body[..], b"world");

        assert_eq!(serve(&sd, &prefix, &get("/s/sub", &[])).await.status(), 301);
        assert_eq!(serve(&sd, &prefix, &get("/s/sub/", &[])).await.status(), 200);
        assert_eq!(serve(&sd, &prefix, &get("/s/missing", &[])).await.status(), 404);
        assert_eq!(serve(&sd, &prefix, &get("/s/../x", &[])).await.status(), 400);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(1000))]

        /// A satisfiable range always lies inside the file.
        #[test]
        fn ranges_stay_inside_the_file(v in "(bytes=)?[0-9]{0,6}-?[0-9]{0,6}(,[0-9]{0,3}-[0-9]{0,3})?|\\PC{0,30}", len in 0u64..100_000) {
            if let RangeAnswer::Part(start, end) = parse_range(&v, len) {
                proptest::prop_assert!(start <= end && end < len, "{v:?} over {len} gave {start}..={end}");
            }
        }

        /// Decoded request paths never climb, never name hidden files, and
        /// never carry NUL or backslashes.
        #[test]
        fn safe_paths_are_safe(p in "(/(\\.{1,3}|%2[eEfF]|%5[cC]|%00|[a-z]{1,3}|%[0-9a-fA-F]{2}|%[g-z]{1,2}))*/?") {
            if let Some(rel) = safe_relative(&p) {
                for c in rel.components() {
                    let ok = matches!(c, Component::Normal(n) if !n.to_string_lossy().starts_with('.'));
                    proptest::prop_assert!(ok, "{p:?} gave {rel:?}");
                }
                proptest::prop_assert!(!rel.to_string_lossy().contains(['\\', '\0']));
            }
        }
    }
}
