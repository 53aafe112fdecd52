//! Issue 13: metrics on one prometheus-client registry, the access log,
//! and the dashboard.

use std::time::Duration;

use serde_json::Value;

use crate::support::*;

/// `/metrics` as text (OpenMetrics).
async fn scrape(tg: &Tidegate) -> String {
    let r = send("GET", &tg.admin_url("/metrics"), Some(TOKEN), Vec::new(), &[]).await;
    assert_eq!(r.status, 200);
    let ct = r.headers.get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("");
    assert!(ct.starts_with("application/openmetrics-text"), "{ct}");
    r.text()
}

/// `/metrics` once `done` holds for it. A request's duration and class are
/// counted just after its last byte is written, so a client can see its
/// answer before the count moves.
async fn scrape_until(tg: &Tidegate, what: &str, done: impl Fn(&str) -> bool) -> String {
    let mut text = String::new();
    wait_for(what, Duration::from_secs(5), async || {
        text = scrape(tg).await;
        done(&text).then_some(())
    })
    .await;
    text
}

/// The value of the sample line that starts with `prefix` (name and labels).
fn sample(text: &str, prefix: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(prefix)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_histograms_and_backend_metrics_are_exported() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let a = Backend::start("a", &[]);
    route_to(&tg, "web", &[&a], "round_robin").await;
    for _ in 0..20 {
        assert_eq!(get(&tg.url("/x")).await.status, 200);
    }
    let labels = r#"{service="web",route="web",class="2xx""#;
    let count = |t: &str| sample(t, &format!("tidegate_request_duration_seconds_count{labels}}}"));
    let text = scrape_until(&tg, "20 requests are counted", |t| count(t) == Some(20.0)).await;
    let inf = r#"tidegate_request_duration_seconds_bucket{le="+Inf",service="web",route="web",class="2xx"}"#;
    assert_eq!(sample(&text, inf), Some(20.0), "{text}");
    assert!(text.contains("# TYPE tidegate_request_duration_seconds histogram"), "{text}");
    let backend = r#"{service="web",backend="b0"}"#;
    assert_eq!(sample(&text, &format!("tidegate_upstream_attempt_duration_seconds_count{backend}")), Some(20.0));
    assert_eq!(sample(&text, &format!("tidegate_backend_up{backend}")), Some(1.0));
    assert_eq!(sample(&text, &format!("tidegate_backend_requests_total{backend}")), Some(20.0));
    assert_eq!(sample(&text, r#"tidegate_responses_total{class="2xx"}"#), Some(20.0));
    // Sequential requests reuse the upstream connection: at most one per
    // worker (2) was opened for the 20.
    let opened = sample(&text, "tidegate_upstream_connections_opened_total");
    assert!(opened.is_some_and(|n| (1.0..=2.0).contains(&n)), "{opened:?}");
    assert!(sample(&text, "tidegate_config_commit_duration_seconds_count").is_some_and(|n| n >= 2.0), "{text}");
    assert!(sample(&text, "process_resident_memory_bytes").is_some_and(|b| b > 1e6), "{text}");
    assert!(text.lines().any(|l| l.starts_with("tidegate_build_info{version=")), "{text}");
    assert_eq!(text.lines().last(), Some("# EOF"));

    // More requests: the counts grow; a request no route matches is
    // counted under route "".
    let (s, _) = tg.api("DELETE", "/v1/routes/web", None).await;
    assert_eq!(s, 200);
    assert_eq!(get(&tg.url("/x")).await.status, 404);
    let unrouted = r#"tidegate_request_duration_seconds_count{service="",route="",class="4xx"}"#;
    let text = scrape_until(&tg, "the unrouted request is counted", |t| sample(t, unrouted) == Some(1.0)).await;
    assert_eq!(count(&text), None, "a deleted route's series goes with it");
}

/// Load reports and dynamic weights are metrics too, not only in
/// `/v1/status`: an `orca_wrr` service over backends that report ORCA
/// load on every response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_reports_and_dynamic_weights_are_exported() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let a = Backend::start("a", &["--orca"]);
    let b = Backend::start("b", &["--orca"]);
    let spec = serde_json::json!({
        "policy": {"kind": "orca_wrr", "blackout_ms": 0},
        "load_metrics": {"orca": true},
        "backends": [{"id": "a", "addr": a.addr.to_string()}, {"id": "b", "addr": b.addr.to_string()}],
    });
    let (s, v) = tg.api("PUT", "/v1/services/web", Some(spec)).await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = tg.api("PUT", "/v1/routes/web", Some(serde_json::json!({"service": "web"}))).await;
    assert_eq!(s, 200, "{v}");
    // Weights come from the background pass (about every 100 ms) over
    // reports that arrived with responses.
    // A pass may weigh the backends after one report (the other gets the
    // mean), so traffic goes on until both have reported too.
    let mut status = Value::Null;
    let mut text = String::new();
    for _ in 0..100 {
        assert_eq!(get(&tg.url("/x")).await.status, 200);
        status = tg.api("GET", "/v1/status", None).await.1;
        text = scrape(&tg).await;
        let reported = |id: &str| {
            sample(&text, &format!(r#"tidegate_backend_cpu_utilization_ratio{{service="web",backend="{id}"}}"#))
                .is_some()
        };
        let weighed = status["services"]["web"]["backends"][1]["effective_weight"].is_number();
        if weighed && reported("a") && reported("b") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    for (i, id) in ["a", "b"].iter().enumerate() {
        let labels = format!(r#"{{service="web",backend="{id}"}}"#);
        let cpu = sample(&text, &format!("tidegate_backend_cpu_utilization_ratio{labels}"));
        assert!(cpu.is_some_and(|c| (0.0..=1.0).contains(&c)), "{id}: {cpu:?}\n{text}");
        let rps = sample(&text, &format!("tidegate_backend_reported_requests_per_second{labels}"));
        assert!(rps.is_some_and(|r| r >= 0.0), "{id}: {rps:?}");
        let age = sample(&text, &format!("tidegate_backend_load_report_age_seconds{labels}"));
        assert!(age.is_some_and(|a| a >= 0.0), "{id}: {age:?}");
        // A weight in both, as /v1/status shows it (the refresh pass may
        // move it between the two reads).
        let weight = sample(&text, &format!("tidegate_backend_effective_weight{labels}"));
        let shown = status["services"]["web"]["backends"][i]["effective_weight"].as_f64();
        assert!(weight.is_some() && shown.is_some(), "{id}: {weight:?} / {shown:?}");
        // No network report from ORCA: no sample.
        assert_eq!(sample(&text, &format!("tidegate_backend_network_utilization_ratio{labels}")), None);
    }
    assert_eq!(sample(&text, r#"tidegate_service_retries_in_flight{service="web"}"#), Some(0.0), "{text}");
}

/// Reads the access log until it has `n` lines.
async fn lines(path: &std::path::Path, n: usize) -> Vec<String> {
    for _ in 0..100 {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let lines: Vec<String> = text.lines().map(str::to_string).collect();
        if lines.len() >= n {
            return lines;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{} has fewer than {n} lines", path.display());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_log_lines_are_json_with_every_field_and_follow_a_rotation() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("access.log");
    let log_arg = log.to_str().unwrap();
    let tg = Tidegate::start_with(&dir.path().join("data"), &["--access-log", log_arg]);
    let a = Backend::start("a", &[]);
    route_to(&tg, "web", &[&a], "round_robin").await;
    let r = send("GET", &tg.url("/hello?x=1"), None, Vec::new(), &[("x-request-id", "req-42"), ("user-agent", "e2e")])
        .await;
    assert_eq!(r.status, 200);
    let r = send("POST", &tg.url("/post"), None, b"0123456789".to_vec(), &[]).await;
    assert_eq!(r.status, 200);
    let lines = lines(&log, 2).await;
    let first: Value = serde_json::from_str(&lines[0]).expect("a JSON line");
    assert_eq!(first["method"], "GET");
    assert_eq!(first["path"], "/hello?x=1");
    assert_eq!(first["status"], 200);
    assert_eq!(first["route"], "web");
    assert_eq!(first["service"], "web");
    assert_eq!(first["backend"], "b0");
    assert_eq!(first["backend_addr"], a.addr.to_string());
    assert_eq!(first["attempts"], 1);
    assert_eq!(first["request_id"], "req-42");
    assert_eq!(first["user_agent"], "e2e");
    assert_eq!(first["protocol"], "HTTP/1.1");
    assert!(first["client"].as_str().unwrap().starts_with("127.0.0.1:"), "{first}");
    assert!(first["bytes_in"].as_u64().unwrap() > 30 && first["bytes_out"].as_u64().unwrap() > 30, "{first}");
    assert!(first["duration_ms"].as_f64().unwrap() > 0.0, "{first}");
    assert!(first["time"].as_str().unwrap().ends_with('Z'), "{first}");
    assert!(first["error"].is_null());
    let second: Value = serde_json::from_str(&lines[1]).unwrap();
    assert_eq!(second["method"], "POST");
    assert_eq!(second["request_id"].as_str().map(str::len), Some(32), "a generated id: {second}");
    let first_in = first["bytes_in"].as_u64().unwrap();
    assert!(second["bytes_in"].as_u64().unwrap() >= 10 + 30, "the body counts: {second} (GET: {first_in})");

    // A request no backend can take: the proxy's own answer, with why.
    let (s, _) = tg.api("PUT", "/v1/services/web/backends/b0", Some(serde_json::json!({"addr": "127.0.0.1:1"}))).await;
    assert_eq!(s, 200);
    assert_eq!(get(&tg.url("/down")).await.status, 502);
    let lines3 = self::lines(&log, 3).await;
    let third: Value = serde_json::from_str(&lines3[2]).unwrap();
    assert_eq!((third["status"].as_u64(), third["error"].as_str()), (Some(502), Some("connect_failed")), "{third}");

    // Rotation: the file is moved, SIGUSR1 reopens it.
    std::fs::rename(&log, dir.path().join("access.log.1")).unwrap();
    let kill = std::process::Command::new("kill").args(["-USR1", &tg.pid().to_string()]).status().unwrap();
    assert!(kill.success());
    // The writer has reopened once the file is there again (its idle tick
    // follows a rotation when no line comes).
    wait_for("access.log reopened after SIGUSR1", Duration::from_secs(10), async || log.exists().then_some(())).await;
    assert_eq!(get(&tg.url("/after")).await.status, 502);
    let fresh = self::lines(&log, 1).await;
    assert!(fresh[0].contains("\"/after\""), "{fresh:?}");
    assert_eq!(std::fs::read_to_string(dir.path().join("access.log.1")).unwrap().lines().count(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_log_in_the_combined_format() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("access.log");
    let tg = Tidegate::start_with(
        &dir.path().join("data"),
        &["--access-log", log.to_str().unwrap(), "--access-log-format", "combined"],
    );
    let a = Backend::start("a", &[]);
    route_to(&tg, "web", &[&a], "round_robin").await;
    let r =
        send("GET", &tg.url("/c"), None, Vec::new(), &[("referer", "http://r.example/"), ("user-agent", "ua")]).await;
    assert_eq!(r.status, 200);
    let line = &lines(&log, 1).await[0];
    assert!(line.starts_with("127.0.0.1 - - ["), "{line}");
    assert!(line.contains("] \"GET /c HTTP/1.1\" 200 "), "{line}");
    assert!(line.ends_with(" \"http://r.example/\" \"ua\""), "{line}");
}

/// A headless Chromium driven through chromedriver's WebDriver API (plain
/// HTTP+JSON), killed on drop.
struct Browser {
    driver: std::process::Child,
    base: String,
    session: String,
    _profile: tempfile::TempDir,
}

impl Browser {
    /// Starts chromedriver and a headless session, or says why not.
    async fn start() -> Browser {
        let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port();
        let driver = std::process::Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("chromedriver (Debian: chromium-driver; scripts/test installs it)");
        let base = format!("http://127.0.0.1:{port}");
        for _ in 0..100 {
            if try_send("GET", &format!("{base}/status"), None, Vec::new(), &[]).await.is_ok_and(|r| r.status == 200) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let profile = tempfile::tempdir().expect("a profile directory");
        let args = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--window-size=1280,1000",
        ];
        let mut args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        args.push(format!("--user-data-dir={}", profile.path().display()));
        let caps = serde_json::json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": "/usr/bin/chromium", "args": args},
        }}});
        let r = send("POST", &format!("{base}/session"), None, caps.to_string().into_bytes(), &[]).await;
        let v: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
        let session =
            v["value"]["sessionId"].as_str().unwrap_or_else(|| panic!("no session: {}", r.text())).to_string();
        Browser { driver, base, session, _profile: profile }
    }

    async fn call(&self, method: &str, path: &str, body: Value) -> Value {
        let url = format!("{}/session/{}{path}", self.base, self.session);
        let body = if body.is_null() { Vec::new() } else { body.to_string().into_bytes() };
        let r = send(method, &url, None, body, &[]).await;
        let v: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
        assert_eq!(r.status, 200, "{method} {path}: {v}");
        v["value"].clone()
    }

    async fn open(&self, url: &str) {
        self.call("POST", "/url", serde_json::json!({ "url": url })).await;
    }

    /// Runs `script` in the page and returns its value.
    async fn eval(&self, script: &str) -> Value {
        self.call("POST", "/execute/sync", serde_json::json!({ "script": script, "args": [] })).await
    }

    async fn screenshot(&self) -> Vec<u8> {
        let v = self.call("GET", "/screenshot", Value::Null).await;
        base64_decode(v.as_str().expect("base64 PNG"))
    }
}

impl Drop for Browser {
    /// Ends the session first, which closes Chromium: killing chromedriver
    /// alone would leave the browser running, orphaned.
    fn drop(&mut self) {
        let _ = end_session(&self.base, &self.session);
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

/// `DELETE /session/{id}`, blocking (for `Drop`), waiting for the answer.
fn end_session(base: &str, session: &str) -> std::io::Result<()> {
    use std::io::{Read, Write};
    let host = base.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(host)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "DELETE /session/{session} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")?;
    let mut answer = Vec::new();
    s.read_to_end(&mut answer)?;
    Ok(())
}

fn base64_decode(s: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        _ => 63,
    };
    let digits: Vec<u8> = s.bytes().filter(|c| c.is_ascii_alphanumeric() || *c == b'+' || *c == b'/').collect();
    let mut out = Vec::with_capacity(digits.len() * 3 / 4);
    for chunk in digits.chunks(4) {
        let n = chunk.iter().enumerate().fold(0u32, |n, (i, c)| n | u32::from(value(*c)) << (18 - 6 * i));
        out.extend_from_slice(&n.to_be_bytes()[1..chunk.len()]);
    }
    out
}

/// The dashboard in a real browser: the page loads without the token,
/// takes it from the URL fragment, and shows the backends, their health
/// and live charts, the routes and the changes. `TIDEGATE_SCREENSHOT=FILE`
/// keeps a picture of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_backends_live_in_a_browser() {
    let dir = tempfile::tempdir().unwrap();
    let tg = std::sync::Arc::new(Tidegate::start(dir.path()));
    let a = Backend::start("a", &["--service-time", "fixed:2ms"]);
    let b = Backend::start("b", &["--service-time", "fixed:5ms"]);
    route_to(&tg, "web", &[&a, &b], "least_time").await;
    // Active checks, and a third backend nothing listens on.
    let spec = serde_json::json!({
        "policy": {"kind": "least_time"},
        "health": {"active": {"interval_ms": 200, "timeout_ms": 200, "rise": 1, "fall": 1}},
        "backends": [{"id": "b0", "addr": a.addr.to_string()}, {"id": "b1", "addr": b.addr.to_string()},
                     {"id": "b2", "addr": "127.0.0.1:1"}],
    });
    let (s, v) = tg.api("PUT", "/v1/services/web", Some(spec)).await;
    assert_eq!(s, 200, "{v}");
    // The route runs a rule set: the routes table names it and its steps.
    let hsts = serde_json::json!({ "steps": [
        { "kind": "set_response_header", "name": "Strict-Transport-Security", "value": "max-age=600" },
    ] });
    let (s, v) = tg.api("PUT", "/v1/rules/hsts", Some(hsts)).await;
    assert_eq!(s, 200, "{v}");
    let route = serde_json::json!({ "match": { "path_prefix": "/" }, "service": "web", "rules": ["hsts"] });
    let (s, v) = tg.api("PUT", "/v1/routes/web", Some(route)).await;
    assert_eq!(s, 200, "{v}");
    // A named listener: the listeners table shows it and its socket's state.
    let internal = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let (s, v) =
        tg.api("PUT", "/v1/listeners/internal", Some(serde_json::json!({ "addr": internal.to_string() }))).await;
    assert_eq!(s, 200, "{v}");
    let traffic = tokio::spawn({
        let tg = tg.clone();
        async move {
            for _ in 0..600 {
                let _ = try_send("GET", &tg.url("/"), None, Vec::new(), &[]).await;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    });
    let page = get(&tg.admin_url("/ui/")).await;
    assert_eq!(page.status, 200, "no token needed for the page");
    let browser = Browser::start().await;
    browser.open(&format!("{}#token={TOKEN}", tg.admin_url("/ui/"))).await;
    let probe = r#"return {
        text: document.body.innerText,
        backends: [...document.querySelectorAll('tr[data-backend]')].map(r => r.dataset.backend),
        health: [...document.querySelectorAll('.health')].map(e => e.textContent),
        points: Math.max(0, ...[...document.querySelectorAll('svg.chart')].map(s => +s.dataset.points)),
        routes: document.querySelectorAll('tr[data-route]').length,
        rules: [...document.querySelectorAll('tr[data-route] td.rules')].map(e => e.textContent),
        route_listeners: [...document.querySelectorAll('tr[data-route] td.listeners')].map(e => e.textContent),
        listeners: [...document.querySelectorAll('tr[data-listener]')].map(r => [...r.cells].map(c => c.textContent)),
        changes: document.querySelectorAll('#changes li').length,
        hash: location.hash,
    };"#;
    let mut seen = Value::Null;
    for _ in 0..60 {
        seen = browser.eval(probe).await;
        let healthy = seen["health"] == serde_json::json!(["up", "up", "down"]);
        let listening = seen["listeners"][0][5] == "listening";
        if healthy
            && listening
            && seen["points"].as_u64().unwrap_or(0) >= 3
            && seen["changes"].as_u64().unwrap_or(0) >= 3
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(seen["backends"], serde_json::json!(["b0", "b1", "b2"]), "{seen}");
    assert_eq!(seen["health"], serde_json::json!(["up", "up", "down"]), "{seen}");
    assert!(seen["points"].as_u64().unwrap_or(0) >= 3, "the charts update live: {seen}");
    assert_eq!(seen["routes"], 1, "{seen}");
    assert_eq!(seen["rules"], serde_json::json!(["hsts (set_response_header)"]), "{seen}");
    assert_eq!(seen["route_listeners"], serde_json::json!(["default"]), "{seen}");
    let row = serde_json::json!([["internal", internal.to_string(), "no", "–", "–", "listening"]]);
    assert_eq!(seen["listeners"], row, "{seen}");
    assert!(seen["changes"].as_u64().unwrap_or(0) >= 3, "the service and route change sets: {seen}");
    assert_eq!(seen["hash"], "", "the token leaves the address bar: {seen}");
    assert!(seen["text"].as_str().unwrap_or("").contains("least_time"), "{seen}");
    if let Ok(path) = std::env::var("TIDEGATE_SCREENSHOT") {
        std::fs::write(path, browser.screenshot().await).unwrap();
    }
    traffic.abort();
}

/// `tidegate demo`: backends, an autoscaled service and traffic in one
/// command; within seconds the shop's three backends are up and serving,
/// the autoscaler has started and readied an `/api` instance, and Ctrl-C
/// stops everything, the instances included. With `TIDEGATE_SCREENSHOT_DEMO`
/// set, the dashboard of the running demo is kept as a picture (the one in
/// docs/ comes from here, after about a minute: the first `/api` peak).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_runs_backends_autoscaling_and_traffic_and_stops_them() {
    use std::io::{BufRead, BufReader};
    let dir = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_tidegate"))
        .args(["demo", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--ports", "21100-21199"])
        .arg("--data-dir")
        .arg(dir.path())
        .env("TIDEGATE_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = lines.next().unwrap().unwrap();
    let admin = ready.split_whitespace().find_map(|w| w.strip_prefix("admin=")).expect("admin=").to_string();
    std::thread::spawn(move || for _ in lines {});
    let token = std::fs::read_to_string(dir.path().join("admin-token")).unwrap().trim().to_string();
    let status = || async {
        let r = send("GET", &format!("http://{admin}/v1/status"), Some(&token), Vec::new(), &[]).await;
        serde_json::from_slice::<Value>(&r.body).unwrap_or(Value::Null)
    };
    let mut seen = Value::Null;
    for _ in 0..120 {
        seen = status().await;
        let shop = seen["services"]["shop"]["backends"].as_array().cloned().unwrap_or_default();
        let up = shop.iter().filter(|b| b["health"] == "up" && b["requests"].as_u64() > Some(10)).count();
        let api = seen["services"]["api"]["backends"].as_array().map_or(0, |b| b.len());
        if up == 3 && api >= 1 && seen["services"]["api"]["scaling"]["counts"]["ready"].as_u64() >= Some(1) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let shop = seen["services"]["shop"]["backends"].as_array().cloned().unwrap_or_default();
    assert_eq!(shop.iter().filter(|b| b["health"] == "up").count(), 3, "{seen}");
    assert!(seen["services"]["api"]["scaling"]["counts"]["ready"].as_u64() >= Some(1), "{seen}");
    if let Ok(path) = std::env::var("TIDEGATE_SCREENSHOT_DEMO") {
        let browser = Browser::start().await;
        browser.open(&format!("http://{admin}/ui/#token={token}")).await;
        tokio::time::sleep(Duration::from_secs(55)).await;
        std::fs::write(path, browser.screenshot().await).unwrap();
    }
    let state = dir.path().join("instances/api.instances.json");
    let pids: Vec<i64> = serde_json::from_str::<Value>(&std::fs::read_to_string(&state).unwrap()).unwrap()["instances"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|i| i["pid"].as_i64())
        .collect();
    assert!(!pids.is_empty());
    let int = std::process::Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(int.success());
    let exited = tokio::task::spawn_blocking(move || child.wait()).await.unwrap().unwrap();
    assert!(exited.success(), "{exited:?}");
    // Gone, or a zombie waiting for init to reap it (its parent exited).
    let alive = |pid: i64| {
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .is_ok_and(|s| s.lines().any(|l| l.starts_with("State:") && !l.contains("Z (zombie)")))
    };
    for _ in 0..40 {
        if !pids.iter().any(|p| alive(*p)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for pid in pids {
        assert!(!alive(pid), "instance {pid} outlived the demo");
    }
}
