//! Traffic rule sets (`/v1/rules`, `put_rules` / `delete_rules`, a
//! route's `rules`, the file's `rules:` section, `ctl rules`): validated
//! with the field named, refused while a route runs them, password hashes
//! never read back, durable across a restart; and applied to traffic by
//! the real binary on both HTTP/1.1 engines, a change live for the next
//! request, the access log naming the step; compression decoded by real
//! clients.

use serde_json::{json, Value};

use crate::support::*;

const HASH: &str = "$2b$12$R9h/cIPz0gi.URNNX3kh2OPST9/PgBkqquzi.Ss7KIUgO2t0jWMUW";

fn api_rules() -> Value {
    json!({ "steps": [
        { "kind": "strip_prefix", "prefix": "/api" },
        { "kind": "set_request_header", "name": "X-A", "value": "1" },
        { "kind": "set_response_header", "name": "Strict-Transport-Security", "value": "max-age=63072000" },
        { "kind": "ip_allow", "cidrs": ["127.0.0.0/8"] },
        { "kind": "rate_limit", "key": "client_ip", "rate_per_s": 100, "burst": 20 },
        { "kind": "basic_auth", "realm": "r", "users": [{ "name": "u", "hash": HASH }] },
    ] })
}

fn text(out: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rule_sets_are_written_read_refused_and_redacted() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let (s, v) = tg.api("PUT", "/v1/services/web", Some(json!({}))).await;
    assert_eq!(s, 200, "{v}");

    // A route naming a rule set that does not exist is refused.
    let route = json!({ "match": { "path_prefix": "/api" }, "service": "web", "rules": ["api"] });
    let (s, v) = tg.api("PUT", "/v1/routes/r", Some(route.clone())).await;
    assert_eq!(s, 404, "{v}");
    assert!(v.to_string().contains("rules[0]"), "names the field: {v}");

    // An invalid step is refused, naming the step and its field.
    let bad = json!({ "steps": [{ "kind": "deny" }, { "kind": "rewrite_path", "regex": "(", "replacement": "/" }] });
    let (s, v) = tg.api("PUT", "/v1/rules/api", Some(bad)).await;
    assert_eq!(s, 400, "{v}");
    assert_eq!(v["error"]["field"], "spec.steps[1].regex", "{v}");
    let plain =
        json!({ "steps": [{ "kind": "basic_auth", "realm": "r", "users": [{ "name": "u", "hash": "hunter2" }] }] });
    let (s, v) = tg.api("PUT", "/v1/rules/api", Some(plain)).await;
    assert_eq!(s, 400, "{v}");
    assert_eq!(v["error"]["field"], "spec.steps[0].users[0].hash", "{v}");
    assert!(!v.to_string().contains("hunter2"), "a password is not repeated: {v}");

    let (s, v) = tg.api("PUT", "/v1/rules/api", Some(api_rules())).await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = tg.api("PUT", "/v1/rules/open", Some(json!({ "steps": [] }))).await;
    assert_eq!(s, 200, "{v}");
    let open = json!({ "match": { "path_prefix": "/api" }, "service": "web", "rules": ["open", "api"] });
    let (s, v) = tg.api("PUT", "/v1/routes/r", Some(open)).await;
    assert_eq!(s, 200, "{v}");
    // Read back: the steps, the route that runs a set, never the hash.
    let (s, v) = tg.api("GET", "/v1/rules/api", None).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["spec"]["steps"].as_array().map(Vec::len), Some(6), "{v}");
    assert_eq!(v["used_by"], json!(["r"]));
    assert_eq!(v["spec"]["steps"][5]["users"][0]["hash"], "(redacted)");
    let (_, v) = tg.api("GET", "/v1/rules/open", None).await;
    assert_eq!(v["used_by"], json!(["r"]));
    for path in ["/v1/rules", "/v1/rules/api", "/v1/config"] {
        let (_, v) = tg.api("GET", path, None).await;
        assert!(!v.to_string().contains(HASH), "{path} shows no hash: {v}");
        assert!(v.to_string().contains("strip_prefix"), "{path} shows the rules: {v}");
    }
    let (_, v) = tg.api("GET", "/v1/routes/r", None).await;
    assert_eq!(v["spec"]["rules"], json!(["open", "api"]));

    // The placeholder given back keeps the hash (an export applied back).
    let (_, exported) = tg.api("GET", "/v1/rules/api", None).await;
    let (s, v) = tg.api("PUT", "/v1/rules/api", Some(exported["spec"].clone())).await;
    assert_eq!(s, 200, "{v}");

    // Deleting a rule set a route runs is refused, naming the route.
    let (s, v) = tg.api("DELETE", "/v1/rules/open", None).await;
    assert_eq!(s, 409, "{v}");
    assert!(v["error"]["message"].as_str().unwrap_or_default().contains("(r)"), "names the route: {v}");

    // ctl: a table of rule sets, and the route's column.
    let out = tg.ctl(&["-o", "table", "rules", "list"]);
    assert!(out.status.success(), "{}", text(&out));
    let shown = text(&out);
    assert!(shown.contains("RULES") && shown.contains("api") && shown.contains("strip_prefix,"), "{shown}");
    assert!(!shown.contains(HASH));
    let out = tg.ctl(&["-o", "table", "route", "list"]);
    assert!(text(&out).contains("RULES") && text(&out).contains("open"), "{}", text(&out));

    // In one change set, the route stops running it and it goes.
    let (s, v) = tg
        .api(
            "POST",
            "/v1/changes",
            Some(json!({ "ops": [
                { "op": "put_route", "name": "r", "spec": { "match": { "path_prefix": "/api" }, "service": "web" } },
                { "op": "delete_rules", "name": "open" },
                { "op": "delete_rules", "name": "api" },
            ] })),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    for set in ["api", "open"] {
        let (s, _) = tg.api("GET", &format!("/v1/rules/{set}"), None).await;
        assert_eq!(s, 404);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rule_sets_survive_a_restart_with_their_hashes_and_reach_watchers_redacted() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let (s, v) = tg.api("PUT", "/v1/rules/api", Some(api_rules())).await;
    assert_eq!(s, 200, "{v}");
    let (_, v) = tg.api("PUT", "/v1/services/web", Some(json!({}))).await;
    let revision = v["revision"].as_u64().unwrap_or_default();
    let (s, v) = tg.api("PUT", "/v1/rules/open", Some(json!({ "steps": [] }))).await;
    assert_eq!(s, 200, "{v}");
    let route = json!({ "service": "web", "rules": ["open"] });
    let (s, v) = tg.api("PUT", "/v1/routes/r", Some(route)).await;
    assert_eq!(s, 200, "{v}");

    // The watch replays the change sets, the hash redacted.
    let admin = tg.admin;
    let watched = tokio::task::spawn_blocking(move || {
        use std::io::{BufRead, BufReader, Write};
        let mut s = std::net::TcpStream::connect(admin).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
        write!(s, "GET /v1/watch?from=0 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n").unwrap();
        BufReader::new(s).lines().map_while(Result::ok).find(|line| line.contains("put_rules"))
    })
    .await
    .unwrap()
    .expect("the watch shows the put_rules change set");
    assert!(!watched.contains(HASH) && watched.contains("(redacted)"), "{watched}");
    let _ = revision;

    tg.kill9();
    let tg = Tidegate::start(dir.path());
    let (s, v) = tg.api("GET", "/v1/rules/open", None).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["used_by"], json!(["r"]));
    let (s, v) = tg.api("GET", "/v1/rules/api", None).await;
    assert_eq!(s, 200, "{v}");
    // The hash survived: the placeholder still finds it to keep.
    let (s, v) = tg.api("PUT", "/v1/rules/api", Some(v["spec"].clone())).await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = tg.api("DELETE", "/v1/rules/open", None).await;
    assert_eq!(s, 409, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_files_rules_section_is_checked_and_applied() {
    let dir = tempfile::tempdir().unwrap();
    let validate = |p: &std::path::Path| {
        std::process::Command::new(env!("CARGO_BIN_EXE_tidegate")).arg("validate").arg(p).output().expect("validate")
    };
    let file = dir.path().join("tidegate.yaml");
    let good = format!(
        "services:\n  web: {{}}\nrules:\n  api:\n    steps:\n      - {{kind: strip_prefix, prefix: /api}}\n      \
         - {{kind: basic_auth, realm: r, users: [{{name: u, hash: '{HASH}'}}]}}\n  open:\n    steps: []\n\
         routes:\n  r: {{service: web, rules: [open]}}\n"
    );
    std::fs::write(&file, &good).unwrap();
    let out = validate(&file);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("2 rule set(s)"), "{}", text(&out));

    let bad = dir.path().join("bad.yaml");
    std::fs::write(
        &bad,
        "rules:\n  api:\n    steps:\n      - {kind: deny}\n      - {kind: redirect, location: '/{nope}'}\n",
    )
    .unwrap();
    let out = validate(&bad);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("rules.api.steps[1].location"), "{}", text(&out));

    let f = file.to_str().unwrap().to_string();
    let tg = Tidegate::start_with(&dir.path().join("data"), &["--config", &f, "--config-mode", "sync"]);
    let (s, v) = tg.api("GET", "/v1/rules/open", None).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["used_by"], json!(["r"]));
    let (_, config) = tg.api("GET", "/v1/config", None).await;
    assert!(!config.to_string().contains(HASH), "{config}");
    assert_eq!(config["rules"]["api"]["steps"][0]["prefix"], "/api");
}

/// A bcrypt hash (cost 4, quick to check in a debug build) of `s3cret`.
const QUICK_HASH: &str = "$2b$04$/uaF/uaF/uaF/uaF/uaF/uK7.eFDTHWTk03S8wqeyk9ZLEdfjGgEC";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_apply_to_traffic_on_both_engines_and_a_change_is_live_for_the_next_request() {
    let backend = Backend::start("web", &[]);
    for engine in ["native", "hyper"] {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("access.log");
        let args = ["--http1", engine, "--access-log", log.to_str().unwrap()];
        let tg = Tidegate::start_with(&dir.path().join("data"), &args);
        let spec = json!({ "backends": [{ "id": "b0", "addr": backend.addr.to_string() }] });
        let (s, v) = tg.api("PUT", "/v1/services/web", Some(spec)).await;
        assert_eq!(s, 200, "{v}");
        let steps = json!({ "steps": [
            { "kind": "strip_prefix", "prefix": "/api" },
            { "kind": "set_request_header", "name": "X-A", "value": "1" },
            { "kind": "set_response_header", "name": "Strict-Transport-Security", "value": "max-age=63072000" },
            { "kind": "ip_allow", "cidrs": ["127.0.0.0/8"] },
            { "kind": "rate_limit", "key": "client_ip", "rate_per_s": 10000, "burst": 10000 },
            { "kind": "basic_auth", "realm": "api", "users": [{ "name": "u", "hash": QUICK_HASH }] },
        ] });
        let (s, v) = tg.api("PUT", "/v1/rules/api", Some(steps.clone())).await;
        assert_eq!(s, 200, "{v}");
        let route = json!({ "match": { "path_prefix": "/api" }, "service": "web", "rules": ["api"] });
        let (s, v) = tg.api("PUT", "/v1/routes/api", Some(route)).await;
        assert_eq!(s, 200, "{v}");
        let url = format!("http://{}/api/echo?x=1", tg.proxy);

        let challenged = get(&url).await;
        assert_eq!(challenged.status, 401, "{engine}: {}", challenged.text());
        assert_eq!(challenged.headers["www-authenticate"], "Basic realm=\"api\", charset=\"UTF-8\"", "{engine}");
        // "u:s3cret"
        let auth = [("authorization", "Basic dTpzM2NyZXQ=")];
        let through = send("GET", &url, None, Vec::new(), &auth).await;
        assert_eq!(through.status, 200, "{engine}: {}", through.text());
        assert_eq!(through.headers["strict-transport-security"], "max-age=63072000", "{engine}");
        let echo: Value = serde_json::from_slice(&through.body).expect("the backend's echo");
        assert_eq!(echo["path"], "/echo?x=1", "{engine}: the prefix is stripped, the query kept");
        assert_eq!(echo["headers"]["x-a"], "1", "{engine}");
        assert!(echo["headers"].get("authorization").is_none(), "{engine}: credentials stay at the proxy: {echo}");

        // A change that adds a step is live for the next request.
        let mut denied = steps.clone();
        denied["steps"].as_array_mut().unwrap().insert(0, json!({ "kind": "deny", "status": 451 }));
        let (s, v) = tg.api("PUT", "/v1/rules/api", Some(denied)).await;
        assert_eq!(s, 200, "{v}");
        let refused = send("GET", &url, None, Vec::new(), &auth).await;
        assert_eq!(refused.status, 451, "{engine}: {}", refused.text());

        // The access log names the step that answered, and never a hash
        // or the credentials.
        let lines = wait_for("three rule lines in the access log", std::time::Duration::from_secs(10), async || {
            let text = std::fs::read_to_string(&log).ok()?;
            (text.lines().filter(|l| l.contains("/api/echo")).count() >= 3).then_some(text)
        })
        .await;
        assert!(lines.contains("\"status\":401") && lines.contains("\"rule\":\"api[5] basic_auth\""), "{lines}");
        assert!(lines.contains("\"rule\":\"api[0] strip_prefix,api[1] set_request_header\""), "{lines}");
        assert!(lines.contains("\"status\":451") && lines.contains("\"rule\":\"api[0] deny\""), "{lines}");
        assert!(!lines.contains(QUICK_HASH) && !lines.contains("dTpzM2NyZXQ"), "{lines}");
        // Metrics count what each step did, since the chain was compiled
        // (the deny's change compiled it again).
        let metrics = send("GET", &tg.admin_url("/metrics"), Some(TOKEN), Vec::new(), &[]).await.text();
        let denied =
            r#"tidegate_rule_steps_total{route="api",rule_set="api",step="0",kind="deny",outcome="answered"} 1"#;
        assert!(metrics.contains(denied), "{engine}: {metrics}");
        // So does /v1/status, and `ctl status` shows them.
        let (_, status) = tg.api("GET", "/v1/status", None).await;
        assert_eq!(status["rules"]["api"][0]["kind"], "deny", "{status}");
        assert_eq!(status["rules"]["api"][0]["answered"], 1, "{status}");
        assert_eq!(status["rules"]["api"].as_array().map(Vec::len), Some(7), "{status}");
        let out = tg.ctl(&["-o", "table", "status"]);
        let shown = text(&out);
        assert!(shown.contains("ANSWERED") && shown.contains("api[6]") && shown.contains("basic_auth"), "{shown}");
    }
}

/// Runs `program` with `args` and returns its standard output (it must
/// succeed).
fn output_of(program: &str, args: &[&str]) -> Vec<u8> {
    let out = std::process::Command::new(program).args(args).output().unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(out.status.success(), "{program} {args:?}: {}", text(&out));
    out.stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compressed_responses_round_trip_through_curl_and_python_on_both_engines() {
    let backend = Backend::start("web", &["--body-size", "20480"]);
    // Python's gzip module decodes what urllib fetched.
    const PYTHON: &str = "import gzip, sys, urllib.request\n\
        r = urllib.request.urlopen(urllib.request.Request(sys.argv[1], headers={'Accept-Encoding': 'gzip'}))\n\
        assert r.headers['Content-Encoding'] == 'gzip', r.headers\n\
        sys.stdout.buffer.write(gzip.decompress(r.read()))";
    for engine in ["native", "hyper"] {
        let dir = tempfile::tempdir().unwrap();
        let tg = Tidegate::start_with(&dir.path().join("data"), &["--http1", engine]);
        let spec = json!({ "backends": [{ "id": "b0", "addr": backend.addr.to_string() }] });
        let (s, v) = tg.api("PUT", "/v1/services/web", Some(spec)).await;
        assert_eq!(s, 200, "{v}");
        let steps = json!({ "steps": [{ "kind": "compress", "algorithms": ["zstd", "br", "gzip"] }] });
        let (s, v) = tg.api("PUT", "/v1/rules/zip", Some(steps)).await;
        assert_eq!(s, 200, "{v}");
        let route = json!({ "match": { "path_prefix": "/" }, "service": "web", "rules": ["zip"] });
        let (s, v) = tg.api("PUT", "/v1/routes/web", Some(route)).await;
        assert_eq!(s, 200, "{v}");
        let url = format!("http://{}/data", tg.proxy);

        // A client that asks for no coding gets the backend's bytes.
        let plain = get(&url).await;
        assert_eq!(plain.status, 200, "{engine}");
        assert!(plain.headers.get("content-encoding").is_none(), "{engine}");
        assert_eq!(plain.headers["vary"], "Accept-Encoding", "{engine}");
        assert_eq!(plain.body.len(), 20480, "{engine}");

        for (coding, http2) in [("gzip", false), ("br", false), ("zstd", false), ("gzip", true)] {
            let accept = format!("Accept-Encoding: {coding}");
            let mut args = vec!["-sS", "--compressed", "-H", &accept, "-D", "/dev/stderr", &url];
            if http2 {
                args.insert(0, "--http2-prior-knowledge");
            }
            let out = std::process::Command::new("curl").args(&args).output().expect("curl");
            assert!(out.status.success(), "{engine} {coding}: {}", text(&out));
            let head = String::from_utf8_lossy(&out.stderr).to_ascii_lowercase();
            assert!(head.contains(&format!("content-encoding: {coding}")), "{engine} {coding}: {head}");
            assert!(!head.contains("content-length"), "{engine} {coding}: a compressed body streams: {head}");
            assert!(out.stdout == plain.body, "{engine} {coding} (HTTP/2: {http2}): decodes to the backend's bytes");
        }
        let decoded = output_of("python3", &["-c", PYTHON, &url]);
        assert!(decoded == plain.body, "{engine}: Python's gzip decodes to the backend's bytes");
    }
}
