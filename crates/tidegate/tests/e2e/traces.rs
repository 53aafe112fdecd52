//! Traces in OpenTelemetry's model: W3C trace context read and passed on,
//! the proxy's spans (the request, each attempt) exported over OTLP/HTTP
//! to a receiver that decodes them with the official protobuf definitions
//! (`otlp_receiver.py`, PyPI's `opentelemetry-proto`), and spans dropped
//! and counted when the receiver is gone (issue 40).

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::*;

const CALLER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

/// The test's OTLP receiver, writing the spans it decodes to a file.
struct Receiver {
    child: Child,
    port: u16,
    spans: PathBuf,
}

impl Receiver {
    fn start(dir: &Path) -> Receiver {
        let spans = dir.join("spans.jsonl");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/e2e/otlp_receiver.py");
        let mut cmd = Command::new("python3");
        cmd.arg(script).arg(&spans);
        let (child, line) = spawn_reading_first_line(cmd);
        let port = line
            .strip_prefix("listening on ")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("the receiver said {line:?} (is opentelemetry-proto installed?)"));
        Receiver { child, port, spans }
    }

    /// Every span received so far.
    fn spans(&self) -> Vec<Value> {
        let text = std::fs::read_to_string(&self.spans).unwrap_or_default();
        text.lines().map(|l| serde_json::from_str(l).expect("a JSON line")).collect()
    }

    /// The spans of `trace`, once there are at least `n`.
    async fn trace(&self, trace: &str, n: usize) -> Vec<Value> {
        wait_for(&format!("{n} spans of trace {trace}"), Duration::from_secs(20), async || {
            let all = self.spans();
            if let Some(bad) = all.iter().find(|s| s.get("undecodable").is_some()) {
                panic!("the receiver could not decode an export: {bad}");
            }
            let of: Vec<Value> = all.into_iter().filter(|s| s["trace_id"] == trace).collect();
            (of.len() >= n).then_some(of)
        })
        .await
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `traceparent` a backend got, from its echo.
fn traceparent_of(echo: &Value) -> (String, String, String) {
    let v = echo["headers"]["traceparent"].as_str().unwrap_or_else(|| panic!("no traceparent: {echo}"));
    let parts: Vec<&str> = v.split('-').collect();
    assert_eq!((parts.len(), parts[0]), (4, "00"), "{v}");
    (parts[1].to_string(), parts[2].to_string(), parts[3].to_string())
}

fn attr<'a>(span: &'a Value, key: &str) -> &'a Value {
    &span["attributes"][key]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_an_otlp_receiver_with_the_callers_trace_on_both_engines() {
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start(dir.path());
    let log = dir.path().join("access.log");
    let endpoint = format!("http://127.0.0.1:{}", receiver.port);
    let tg = Tidegate::start_with(
        &dir.path().join("data"),
        &["--otlp-endpoint", &endpoint, "--trace-sample-ratio", "0", "--access-log", log.to_str().unwrap()],
    );
    let b = Backend::start("traced", &[]);
    route_to(&tg, "web", &[&b], "round_robin").await;

    // A caller's sampled trace, over HTTP/1.1 (the native engine): the
    // backend's parent is the proxy's span, the trace is the caller's.
    let caller = format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01");
    let headers = [("traceparent", caller.as_str()), ("tracestate", "vendor=a1")];
    let r = send("GET", &tg.url("/echo"), None, Vec::new(), &headers).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let echo: Value = serde_json::from_slice(&r.body).expect("an echo");
    let (trace, parent, flags) = traceparent_of(&echo);
    assert_eq!((trace.as_str(), flags.as_str()), (CALLER_TRACE, "01"));
    assert_ne!(parent, CALLER_SPAN, "the backend's parent is the proxy's span");
    assert_eq!(echo["headers"]["tracestate"], "vendor=a1", "tracestate goes on with its traceparent");
    let spans = receiver.trace(CALLER_TRACE, 2).await;
    let server = spans.iter().find(|s| s["kind"] == 2).expect("a server span");
    assert_eq!(server["span_id"], parent.as_str(), "{server}");
    assert_eq!(server["parent_span_id"], CALLER_SPAN);
    assert_eq!(server["trace_state"], "vendor=a1");
    assert_eq!(server["name"], "GET web");
    assert_eq!(server["resource"]["service.name"], "tidegate");
    assert_eq!(attr(server, "http.response.status_code"), 200);
    assert_eq!(attr(server, "tidegate.route"), "web");
    assert_eq!(attr(server, "network.protocol.version"), "1.1");
    assert!(server["end"].as_u64() >= server["start"].as_u64(), "{server}");
    let attempt = spans.iter().find(|s| s["kind"] == 3).expect("an attempt span");
    assert_eq!(attempt["parent_span_id"], parent.as_str());
    assert_eq!(attr(attempt, "tidegate.backend"), "b0");
    assert_eq!(attr(attempt, "server.port"), b.addr.port());
    assert!(attr(attempt, "tidegate.time_to_first_byte_us").as_i64() >= Some(0), "{attempt}");
    // The access log names the trace.
    let line = wait_for("the access log's line", Duration::from_secs(10), async || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        text.lines().find(|l| l.contains(CALLER_TRACE)).map(str::to_string)
    })
    .await;
    let line: Value = serde_json::from_str(&line).expect("JSON");
    assert_eq!(line["trace_id"], CALLER_TRACE);

    // No traceparent and a ratio of 0: a new trace, not recorded, and the
    // backend is told so (flags 00); a caller's tracestate without its
    // traceparent is dropped. Then a sampled one over HTTP/2 (hyper's
    // engine): once its spans are in, the unsampled one would be too.
    let r = send("GET", &tg.url("/echo"), None, Vec::new(), &[("tracestate", "orphan=1")]).await;
    let echo: Value = serde_json::from_slice(&r.body).expect("an echo");
    let (unsampled, _, flags) = traceparent_of(&echo);
    assert_eq!(flags, "00");
    assert!(echo["headers"].get("tracestate").is_none(), "{echo}");
    let h2_trace = "0af7651916cd43dd8448eb211c80319c";
    let h2_caller = format!("00-{h2_trace}-b7ad6b7169203331-01");
    let (status, _, body) = h2(tg.proxy, "http://x/echo", &[("traceparent", h2_caller.as_bytes())]).await;
    assert_eq!(status, 200);
    let echo: Value = serde_json::from_slice(&body).expect("an echo");
    assert_eq!(traceparent_of(&echo).0, h2_trace);
    let spans = receiver.trace(h2_trace, 2).await;
    let server = spans.iter().find(|s| s["kind"] == 2).expect("a server span");
    assert_eq!(attr(server, "network.protocol.version"), "2");
    assert!(receiver.spans().iter().all(|s| s["trace_id"] != unsampled.as_str()), "an unsampled trace was exported");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_request_shows_each_attempt_and_spans_are_counted_when_the_receiver_is_gone() {
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start(dir.path());
    let endpoint = format!("http://127.0.0.1:{}/v1/traces", receiver.port);
    let tg =
        Tidegate::start_with(&dir.path().join("data"), &["--otlp-endpoint", &endpoint, "--trace-sample-ratio", "1"]);
    let live = Backend::start("live", &[]);
    // A backend address nothing listens on: its attempts fail to connect.
    let dead = DownPort::new();
    let spec = json!({
        "policy": { "kind": "round_robin" },
        "retries": 2,
        "backends": [
            { "id": "dead", "addr": dead.addr.to_string() },
            { "id": "live", "addr": live.addr.to_string() },
        ],
    });
    let (s, v) = tg.api("PUT", "/v1/services/web", Some(spec)).await;
    assert_eq!(s, 200, "{v}");
    let (s, v) =
        tg.api("PUT", "/v1/routes/web", Some(json!({ "match": { "path_prefix": "/" }, "service": "web" }))).await;
    assert_eq!(s, 200, "{v}");
    // Round robin sends every other first attempt to the dead backend.
    let mut traces = Vec::new();
    for _ in 0..4 {
        let r = get(&tg.url("/echo")).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let echo: Value = serde_json::from_slice(&r.body).expect("an echo");
        traces.push(traceparent_of(&echo).0);
    }
    let mut retried = None;
    for t in &traces {
        let spans = receiver.trace(t, 2).await;
        let mut attempts: Vec<&Value> = spans.iter().filter(|s| s["kind"] == 3).collect();
        attempts.sort_by_key(|s| attr(s, "tidegate.attempt").as_i64());
        if attempts.len() == 2 {
            retried = Some(attempts.into_iter().cloned().collect::<Vec<_>>());
            break;
        }
    }
    let attempts = retried.expect("a request that was retried");
    assert_eq!(attr(&attempts[0], "tidegate.backend"), "dead");
    assert_eq!(attr(&attempts[0], "error.type"), "connect_failed");
    assert_eq!(attempts[0]["status"], 2, "a failed attempt is an error span");
    assert_eq!(attr(&attempts[1], "tidegate.backend"), "live");
    assert_eq!(attr(&attempts[1], "tidegate.retry_cause"), "connect_failed");
    assert_eq!(attr(&attempts[1], "http.response.status_code"), 200);

    // The receiver gone: requests are served as before, their spans are
    // dropped and counted.
    drop(receiver);
    for _ in 0..5 {
        assert_eq!(get(&tg.url("/echo")).await.status, 200);
    }
    wait_for("failed exports counted", Duration::from_secs(30), async || {
        let metrics = send("GET", &tg.admin_url("/metrics"), Some(TOKEN), Vec::new(), &[]).await.text();
        let dropped = metrics
            .lines()
            .find_map(|l| l.strip_prefix(r#"tidegate_trace_spans_total{result="dropped_export_failed"} "#))
            .and_then(|v| v.trim().parse::<f64>().ok())?;
        (dropped >= 5.0).then_some(())
    })
    .await;
}
