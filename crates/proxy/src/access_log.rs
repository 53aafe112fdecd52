//! The access log: one line per request, as JSON or in the combined log
//! format, written by a thread of its own.
//!
//! A request hands its [`Line`] to a bounded channel and goes on: it never
//! waits for the disk. When the channel is full (the disk or the terminal
//! cannot keep up), the line is dropped and counted
//! (`tidegate_access_log_lines_total{result="dropped"}`). While lines keep
//! coming, the writer takes them in batches every [`BATCH_PAUSE`] and
//! sleeps in between, so that no request pays for waking it (a system
//! call on the request's thread, and a context switch); when idle it
//! waits for the next line. `tail -f` sees a line within that pause. It
//! reopens its file when asked ([`AccessLog::reopen`], on `SIGUSR1`), for
//! log rotation.
//!
//! What a client sent (method, host, target, `User-Agent`, `Referer`,
//! `X-Request-Id`) is written escaped in both formats: quotes, backslashes,
//! control characters (C0, DEL, C1) and the Unicode characters that change
//! how a line reads or splits it (bidirectional overrides and isolates,
//! zero-width characters, line and paragraph separators, the byte order
//! mark: [`hidden`]). A client cannot start a new line, hide or reorder
//! text in a terminal or an editor, or forge a field.

use std::fmt::Write as _;
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tidegate_model::{BackendAddr, BackendId, RouteName, ServiceName};

/// Lines that may wait for the writer before new ones are dropped.
const CAPACITY: usize = 16 * 1024;
/// While lines keep coming, the writer sleeps this long between batches.
const BATCH_PAUSE: Duration = Duration::from_millis(10);
/// After this long without a line, the writer blocks until the next one
/// (or until the idle tick, which also serves a reopen).
const IDLE_AFTER: Duration = Duration::from_millis(100);
const IDLE_TICK: Duration = Duration::from_millis(250);

/// How a line looks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// One JSON object per line, every field named.
    Json,
    /// Apache's and nginx's combined log format.
    Combined,
}

/// Where lines go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// Standard output.
    Stdout,
    /// A file, appended to (created with mode 0640).
    File(PathBuf),
}

/// One answered request.
#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    /// When the response was written (or the exchange ended).
    pub end: SystemTime,
    /// From the request head to the end of the response.
    pub duration: Duration,
    /// The client's address.
    pub client: SocketAddr,
    /// The method.
    pub method: String,
    /// The host asked for (`Host`, or the authority of an absolute target).
    pub host: String,
    /// The request target: path and query.
    pub target: String,
    /// `HTTP/1.0`, `HTTP/1.1` or `HTTP/2.0`.
    pub protocol: &'static str,
    /// The status sent to the client.
    pub status: u16,
    /// Bytes read from the client for this request (head and body).
    pub bytes_in: u64,
    /// Bytes written to the client for this request (head and body).
    pub bytes_out: u64,
    /// The route that matched, if one did.
    pub route: Option<RouteName>,
    /// The service it went to.
    pub service: Option<ServiceName>,
    /// The backend that answered last (its id and address).
    pub backend: Option<(BackendId, BackendAddr)>,
    /// Attempts made upstream (0: answered by the proxy itself).
    pub attempts: u32,
    /// Why the proxy answered itself, if it did
    /// ([`ErrorKind::name`](crate::ErrorKind::name)).
    pub error: Option<&'static str>,
    /// The rule step that answered the request (`set[step] kind`: a
    /// redirect, a refusal, a challenge, a rate limit), or the steps that
    /// changed it, comma-separated.
    pub rule: Option<String>,
    /// The request's `X-Request-Id` (the client's, or the generated one).
    pub request_id: Option<String>,
    /// The request's trace id (32 hex digits: the client's `traceparent`'s,
    /// or a new one), when tracing is on.
    pub trace_id: Option<String>,
    /// `User-Agent`, if sent.
    pub user_agent: Option<String>,
    /// `Referer`, if sent.
    pub referer: Option<String>,
    /// The subject of the client certificate the connection's TLS
    /// handshake verified, if any (as `X-Client-Cert-Subject` carries it).
    pub client_cert: Option<String>,
}

/// The access log's sending end, shared by every worker.
#[derive(Debug)]
pub struct AccessLog {
    tx: SyncSender<Line>,
    counts: Arc<Counts>,
}

#[derive(Debug, Default)]
struct Counts {
    written: AtomicU64,
    dropped: AtomicU64,
    failed_writes: AtomicU64,
    reopen: AtomicBool,
}

impl AccessLog {
    /// Opens the target and starts the writer thread.
    pub fn start(target: Target, format: Format) -> std::io::Result<AccessLog> {
        let out = open(&target)?;
        let (tx, rx) = sync_channel(CAPACITY);
        let counts = Arc::new(Counts::default());
        let writer = Writer { rx, out, target, format, counts: counts.clone(), text: String::new() };
        std::thread::Builder::new().name("tidegate-access-log".into()).spawn(move || writer.run())?;
        Ok(AccessLog { tx, counts })
    }

    /// Queues a line; drops it (counted) if the writer is behind.
    pub fn send(&self, line: Line) {
        match self.tx.try_send(line) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.counts.dropped.fetch_add(1, Relaxed);
            }
        }
    }

    /// Reopens the file before the next line (after a rotation moved it).
    pub fn reopen(&self) {
        self.counts.reopen.store(true, Relaxed);
    }

    /// Lines written so far.
    pub fn written(&self) -> u64 {
        self.counts.written.load(Relaxed)
    }

    /// Lines dropped because the writer was behind.
    pub fn dropped(&self) -> u64 {
        self.counts.dropped.load(Relaxed)
    }

    /// Writes (or reopens) that failed.
    pub fn failed_writes(&self) -> u64 {
        self.counts.failed_writes.load(Relaxed)
    }
}

type Out = std::io::BufWriter<Box<dyn std::io::Write + Send>>;

fn open(target: &Target) -> std::io::Result<Out> {
    let w: Box<dyn std::io::Write + Send> = match target {
        Target::Stdout => Box::new(std::io::stdout()),
        Target::File(path) => Box::new(open_file(path)?),
    };
    Ok(std::io::BufWriter::with_capacity(64 * 1024, w))
}

fn open_file(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new().create(true).append(true).mode(0o640).open(path)
}

struct Writer {
    rx: Receiver<Line>,
    out: Out,
    target: Target,
    format: Format,
    counts: Arc<Counts>,
    text: String,
}

impl Writer {
    fn run(mut self) {
        let mut last_line = Instant::now();
        let mut unflushed = false;
        loop {
            self.follow_rotation();
            // Everything queued now, then one flush.
            let disconnected = loop {
                match self.rx.try_recv() {
                    Ok(line) => {
                        self.write(&line);
                        unflushed = true;
                        last_line = Instant::now();
                    }
                    Err(TryRecvError::Empty) => break false,
                    Err(TryRecvError::Disconnected) => break true,
                }
            };
            if unflushed && self.out.flush().is_err() {
                self.counts.failed_writes.fetch_add(1, Relaxed);
            }
            unflushed = false;
            if disconnected {
                return;
            }
            if last_line.elapsed() < IDLE_AFTER {
                // Busy: sleep instead of being woken by every line.
                std::thread::sleep(BATCH_PAUSE);
                continue;
            }
            // Idle: wait for the next line (the one that wakes this thread).
            match self.rx.recv_timeout(IDLE_TICK) {
                Ok(line) => {
                    self.write(&line);
                    unflushed = true;
                    last_line = Instant::now();
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    let _ = self.out.flush();
                    return;
                }
            }
        }
    }

    /// Reopens the file if a rotation was signalled: checked before every
    /// line, so a line sent after the signal goes to the new file even
    /// when it is the one that wakes this thread.
    fn follow_rotation(&mut self) {
        if self.counts.reopen.load(Relaxed) && self.counts.reopen.swap(false, Relaxed) {
            self.reopen();
        }
    }

    fn write(&mut self, line: &Line) {
        self.follow_rotation();
        self.text.clear();
        format_line(&mut self.text, line, self.format);
        match self.out.write_all(self.text.as_bytes()) {
            Ok(()) => self.counts.written.fetch_add(1, Relaxed),
            Err(_) => self.counts.failed_writes.fetch_add(1, Relaxed),
        };
    }

    fn reopen(&mut self) {
        let _ = self.out.flush();
        match open(&self.target) {
            Ok(out) => self.out = out,
            Err(e) => {
                self.counts.failed_writes.fetch_add(1, Relaxed);
                tracing::error!(error = %e, "access log: reopening failed; still writing to the old file");
            }
        }
    }
}

/// Appends `line`, formatted, with its newline.
pub fn format_line(out: &mut String, line: &Line, format: Format) {
    match format {
        Format::Json => json_line(out, line),
        Format::Combined => combined_line(out, line),
    }
    out.push('\n');
}

fn json_line(out: &mut String, l: &Line) {
    let start = l.end.checked_sub(l.duration).unwrap_or(l.end);
    out.push_str("{\"time\":\"");
    rfc3339(out, start);
    let _ = write!(out, "\",\"client\":\"{}\",\"method\":", l.client);
    json_str(out, &l.method);
    out.push_str(",\"host\":");
    json_str(out, &l.host);
    out.push_str(",\"path\":");
    json_str(out, &l.target);
    // Milliseconds with three decimals, in integers (no float formatting).
    let us = l.duration.as_micros();
    let _ = write!(
        out,
        ",\"protocol\":\"{}\",\"status\":{},\"bytes_in\":{},\"bytes_out\":{},\"duration_ms\":{}.{:03}",
        l.protocol,
        l.status,
        l.bytes_in,
        l.bytes_out,
        us / 1000,
        us % 1000
    );
    let opt = |out: &mut String, key: &str, v: Option<&str>| {
        let _ = write!(out, ",\"{key}\":");
        match v {
            Some(s) => json_str(out, s),
            None => out.push_str("null"),
        }
    };
    opt(out, "route", l.route.as_ref().map(RouteName::as_str));
    opt(out, "service", l.service.as_ref().map(ServiceName::as_str));
    opt(out, "backend", l.backend.as_ref().map(|b| b.0.as_str()));
    opt(out, "backend_addr", l.backend.as_ref().map(|b| b.1.as_str()));
    let _ = write!(out, ",\"attempts\":{}", l.attempts);
    opt(out, "error", l.error);
    opt(out, "rule", l.rule.as_deref());
    opt(out, "request_id", l.request_id.as_deref());
    opt(out, "trace_id", l.trace_id.as_deref());
    opt(out, "user_agent", l.user_agent.as_deref());
    opt(out, "referer", l.referer.as_deref());
    opt(out, "client_cert", l.client_cert.as_deref());
    out.push('}');
}

/// `IP - - [10/Oct/2000:13:55:36 +0000] "GET /a HTTP/1.1" 200 2326 "referer" "agent"`.
fn combined_line(out: &mut String, l: &Line) {
    let _ = write!(out, "{} - - [", l.client.ip());
    clf_time(out, l.end);
    out.push_str("] \"");
    clf_escaped(out, &l.method);
    out.push(' ');
    clf_escaped(out, &l.target);
    let _ = write!(out, " {}\" {} {} \"", l.protocol, l.status, l.bytes_out);
    clf_escaped(out, l.referer.as_deref().unwrap_or("-"));
    out.push_str("\" \"");
    clf_escaped(out, l.user_agent.as_deref().unwrap_or("-"));
    out.push('"');
}

/// Whether `c` is written escaped: a control character (C0, DEL, C1), or
/// a character that is invisible or changes how the text around it reads
/// or breaks: the soft hyphen, the Arabic letter mark, the Mongolian vowel
/// separator, zero-width spaces and joiners, the direction marks,
/// embeddings, overrides and isolates (U+202E can make `gpj.exe` read
/// `exe.jpg`), the line and paragraph separators (U+2028, U+2029: new
/// lines to many readers), invisible operators, deprecated format
/// characters, the byte order mark, interlinear annotations and tag
/// characters.
fn hidden(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{ad}'
                | '\u{61c}'
                | '\u{180e}'
                | '\u{200b}'..='\u{200f}'
                | '\u{2028}'..='\u{202e}'
                | '\u{2060}'..='\u{206f}'
                | '\u{feff}'
                | '\u{fff9}'..='\u{fffb}'
                | '\u{e0000}'..='\u{e007f}'
        )
}

/// Whether `s` may be written as it is: printable ASCII with no quote or
/// backslash, the common case (anything else takes the slow path).
fn plain_text(s: &str) -> bool {
    s.bytes().all(|b| (0x20..0x7f).contains(&b) && b != b'"' && b != b'\\')
}

/// A JSON string literal (RFC 8259 escapes); the characters [`hidden`]
/// picks are escaped too (`\u202e`; beyond the BMP, as a surrogate pair).
fn json_str(out: &mut String, s: &str) {
    out.push('"');
    if plain_text(s) {
        out.push_str(s);
        out.push('"');
        return;
    }
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if hidden(c) => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{u:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Text inside the combined format's quotes: quotes, backslashes, and
/// the characters [`hidden`] picks escaped byte by byte as `\xHH` (as
/// nginx escapes), so a line stays one line and reads as it is.
fn clf_escaped(out: &mut String, s: &str) {
    if plain_text(s) {
        out.push_str(s);
        return;
    }
    for c in s.chars() {
        if c == '"' || c == '\\' || hidden(c) {
            let mut bytes = [0u8; 4];
            for b in c.encode_utf8(&mut bytes).bytes() {
                let _ = write!(out, "\\x{b:02X}");
            }
        } else {
            out.push(c);
        }
    }
}

/// Civil date (year, month, day) of a day count since 1970-01-01
/// (Howard Hinnant's algorithm).
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

/// Seconds, day fields and milliseconds of a time, in UTC.
fn split_time(t: SystemTime) -> ((i64, u32, u32), u64, u32) {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    (civil((secs / 86_400) as i64), secs % 86_400, d.subsec_millis())
}

/// `2026-11-25T13:40:00.123Z`.
fn rfc3339(out: &mut String, t: SystemTime) {
    let ((y, m, d), s, ms) = split_time(t);
    let _ = write!(out, "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{ms:03}Z", s / 3600, s / 60 % 60, s % 60);
}

/// `25/Nov/2026:13:40:00 +0000`.
fn clf_time(out: &mut String, t: SystemTime) {
    const MONTHS: [&str; 12] = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];
    let ((y, m, d), s, _) = split_time(t);
    let month = MONTHS[(m as usize).clamp(1, 12) - 1];
    let _ = write!(out, "{d:02}/{month}/{y:04}:{:02}:{:02}:{:02} +0000", s / 3600, s / 60 % 60, s % 60);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line() -> Line {
        Line {
            // 2026-11-25T13:40:00.250Z
            end: UNIX_EPOCH + Duration::from_millis(1_795_614_000_250),
            duration: Duration::from_micros(1_500),
            client: "127.0.0.1:40000".parse().unwrap(),
            method: "GET".into(),
            host: "shop.example".into(),
            target: "/cart?id=\"7\"".into(),
            protocol: "HTTP/1.1",
            status: 200,
            bytes_in: 78,
            bytes_out: 140,
            route: Some(RouteName::new("shop").unwrap()),
            service: Some(ServiceName::new("web").unwrap()),
            backend: Some((BackendId::new("a").unwrap(), BackendAddr::new("127.0.0.1:9001").unwrap())),
            attempts: 1,
            error: None,
            rule: None,
            request_id: Some("abc".into()),
            trace_id: None,
            user_agent: Some("curl/8.0\n".into()),
            referer: None,
            client_cert: Some("CN=alice,O=Shop\\, Inc.".into()),
        }
    }

    #[test]
    fn json_lines_name_every_field_and_escape_strings() {
        let mut out = String::new();
        format_line(&mut out, &line(), Format::Json);
        assert!(out.ends_with("}\n") && out.lines().count() == 1, "{out}");
        assert_eq!(
            out.trim_end(),
            r#"{"time":"2026-11-25T13:40:00.248Z","client":"127.0.0.1:40000","method":"GET","host":"shop.example","path":"/cart?id=\"7\"","protocol":"HTTP/1.1","status":200,"bytes_in":78,"bytes_out":140,"duration_ms":1.500,"route":"shop","service":"web","backend":"a","backend_addr":"127.0.0.1:9001","attempts":1,"error":null,"rule":null,"request_id":"abc","trace_id":null,"user_agent":"curl/8.0\n","referer":null,"client_cert":"CN=alice,O=Shop\\, Inc."}"#
        );
    }

    #[test]
    fn combined_lines_follow_the_common_format() {
        let mut out = String::new();
        format_line(&mut out, &line(), Format::Combined);
        assert_eq!(
            out,
            "127.0.0.1 - - [25/Nov/2026:13:40:00 +0000] \"GET /cart?id=\\x227\\x22 HTTP/1.1\" 200 140 \"-\" \"curl/8.0\\x0A\"\n"
        );
    }

    /// What a client may put in a field to fool a reader of the log.
    const HOSTILE: [(char, &str, &str); 12] = [
        ('\u{202e}', "\\u202e", "\\xE2\\x80\\xAE"),
        ('\u{2028}', "\\u2028", "\\xE2\\x80\\xA8"),
        ('\u{2029}', "\\u2029", "\\xE2\\x80\\xA9"),
        ('\u{9b}', "\\u009b", "\\xC2\\x9B"),
        ('\u{85}', "\\u0085", "\\xC2\\x85"),
        ('\u{200b}', "\\u200b", "\\xE2\\x80\\x8B"),
        ('\u{200f}', "\\u200f", "\\xE2\\x80\\x8F"),
        ('\u{2066}', "\\u2066", "\\xE2\\x81\\xA6"),
        ('\u{2069}', "\\u2069", "\\xE2\\x81\\xA9"),
        ('\u{feff}', "\\ufeff", "\\xEF\\xBB\\xBF"),
        ('\u{7f}', "\\u007f", "\\x7F"),
        ('\u{e0041}', "\\udb40\\udc41", "\\xF3\\xA0\\x81\\x81"),
    ];

    #[test]
    fn format_and_control_characters_are_escaped_in_both_formats() {
        for (c, json, clf) in HOSTILE {
            let text = format!("a{c}b");
            let mut out = String::new();
            json_str(&mut out, &text);
            assert_eq!(out, format!("\"a{json}b\""), "{c:?}");
            let parsed: String = serde_json::from_str(&out).unwrap();
            assert_eq!(parsed, text, "the JSON still says what was sent");
            let mut out = String::new();
            clf_escaped(&mut out, &text);
            assert_eq!(out, format!("a{clf}b"), "{c:?}");
        }
        // Everything else passes as it is, in both.
        for ok in ["caf\u{e9}", "\u{65e5}\u{672c}", "a b~", "\u{1f600}", "\u{fffd}"] {
            let mut out = String::new();
            json_str(&mut out, ok);
            assert_eq!(out, format!("\"{ok}\""));
            let mut out = String::new();
            clf_escaped(&mut out, ok);
            assert_eq!(out, ok);
        }
        let mut out = String::new();
        clf_escaped(&mut out, "a\tb\0\x1b[31m");
        assert_eq!(out, "a\\x09b\\x00\\x1B[31m");
    }

    #[test]
    fn no_hostile_character_survives_a_whole_line() {
        let mut l = line();
        let all: String = HOSTILE.iter().map(|(c, _, _)| *c).chain(['\n', '\r', '\0', '"']).collect();
        l.method = all.clone();
        l.host = all.clone();
        l.target = format!("/{all}");
        l.request_id = Some(all.clone());
        l.user_agent = Some(all.clone());
        l.referer = Some(all);
        for format in [Format::Json, Format::Combined] {
            let mut out = String::new();
            format_line(&mut out, &l, format);
            let body = out.strip_suffix('\n').unwrap();
            assert!(body.chars().all(|c| !hidden(c) && c != '\n'), "{format:?}: {body:?}");
        }
    }

    #[test]
    fn dates_are_civil_dates() {
        assert_eq!(civil(0), (1970, 1, 1));
        assert_eq!(civil(-1), (1969, 12, 31));
        assert_eq!(civil(19_782), (2024, 2, 29));
        assert_eq!(civil(20_516), (2026, 3, 4));
    }

    #[test]
    fn lines_reach_the_file_and_a_rotation_is_followed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("access.log");
        let log = AccessLog::start(Target::File(path.clone()), Format::Json).unwrap();
        log.send(line());
        let wait = |n: u64| {
            for _ in 0..200 {
                if log.written() >= n {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            panic!("{} lines written, wanted {n}", log.written());
        };
        wait(1);
        std::fs::rename(&path, dir.path().join("access.log.1")).unwrap();
        // The writer is waiting for lines: the one that wakes it already
        // goes to the new file.
        std::thread::sleep(IDLE_AFTER + Duration::from_millis(50));
        log.reopen();
        log.send(line());
        wait(2);
        std::thread::sleep(Duration::from_millis(50));
        let old = std::fs::read_to_string(dir.path().join("access.log.1")).unwrap();
        let new = std::fs::read_to_string(&path).unwrap();
        assert_eq!((old.lines().count(), new.lines().count()), (1, 1), "old {old:?} new {new:?}");
        assert_eq!(log.dropped(), 0);
    }
}
