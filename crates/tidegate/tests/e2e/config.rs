//! Configuration as code: a declarative file as the desired state
//! (`PUT /v1/config`, `ctl diff`, `ctl apply --prune`), checked offline
//! (`tidegate validate`, errors at the file's line and column), and kept in
//! sync by the server (`serve --config FILE --config-mode sync`, SIGHUP).

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::*;

fn document(backends: &[(&str, &Backend)], routes: &[(&str, &str)]) -> String {
    let mut out = String::from("services:\n");
    for (name, b) in backends {
        out.push_str(&format!("  {name}:\n    backends:\n      - {{id: a, addr: \"{}\"}}\n", b.addr));
    }
    out.push_str("routes:\n");
    for (name, prefix) in routes {
        out.push_str(&format!("  {name}:\n    match: {{path_prefix: {prefix}}}\n    service: {name}\n"));
    }
    out
}

fn text(out: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_document_is_the_desired_state_and_a_dry_run_shows_the_plan() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let (a, b) = (Backend::start("a", &[]), Backend::start("b", &[]));
    let put = |name: &str, backend: &Backend| json!({ "op": "put_service", "name": name, "spec": { "backends": [{ "id": "a", "addr": backend.addr.to_string() }] } });
    let route = |name: &str| json!({ "op": "put_route", "name": name, "spec": { "match": { "path_prefix": format!("/{name}") }, "service": name } });
    let (s, v) = tg
        .api(
            "POST",
            "/v1/changes",
            Some(json!({ "ops": [put("keep", &a), put("old", &a), route("keep"), route("old")] })),
        )
        .await;
    assert_eq!(s, 200, "{v}");

    // `keep` moves to backend b, `old` goes, `new` comes.
    let desired = json!({
        "services": {
            "keep": { "backends": [{ "id": "a", "addr": b.addr.to_string() }] },
            "new": { "backends": [{ "id": "a", "addr": a.addr.to_string() }] },
        },
        "routes": {
            "keep": { "match": { "path_prefix": "/keep" }, "service": "keep" },
            "new": { "match": { "path_prefix": "/new" }, "service": "new" },
        },
    });
    let (s, v) = tg.api("PUT", "/v1/config?dry_run=true", Some(desired.clone())).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["dry_run"], true);
    let shown: Vec<String> = v["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| format!("{} {} {} {}", c["action"], c["kind"], c["name"], c["fields"]).replace('"', ""))
        .collect();
    assert_eq!(
        shown,
        [
            "update service keep [backends[0].addr]",
            "create service new null",
            "create route new null",
            "delete route old null",
            "delete service old null"
        ],
        "{v}"
    );
    let (_, config) = tg.api("GET", "/v1/config", None).await;
    assert_eq!(config["revision"], 1, "a dry run applies nothing");

    let (s, v) = tg.api("PUT", "/v1/config", Some(desired.clone())).await;
    assert_eq!((s, v["revision"].clone()), (200, json!(2)), "one atomic change set: {v}");
    assert_eq!(served_by(&get(&tg.url("/keep")).await), "b");
    assert_eq!(get(&tg.url("/old")).await.status, 404);
    let (s, v) = tg.api("PUT", "/v1/config", Some(desired)).await;
    assert_eq!((s, v["revision"].clone(), v["changes"].clone()), (200, json!(2), json!([])), "nothing left to do: {v}");

    // A document that does not hold together changes nothing.
    let broken = json!({ "routes": { "r": { "service": "missing" } } });
    let (s, v) = tg.api("PUT", "/v1/config", Some(broken)).await;
    assert_eq!(s, 400, "{v}");
    let (s, v) = tg.api("PUT", "/v1/config", Some(json!({ "servces": {} }))).await;
    assert_eq!(s, 400, "{v}");
    assert!(v.to_string().contains("servces"), "the unknown field is named: {v}");
    let (_, config) = tg.api("GET", "/v1/config", None).await;
    assert_eq!(config["revision"], 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctl_diff_and_apply_prune_follow_a_yaml_file() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(&dir.path().join("data"));
    let (a, b) = (Backend::start("a", &[]), Backend::start("b", &[]));
    let file = dir.path().join("tidegate.yaml");
    std::fs::write(&file, document(&[("web", &a), ("api", &b)], &[("web", "/"), ("api", "/api")])).unwrap();
    let f = file.to_str().unwrap();

    let out = tg.ctl(&["diff", "-f", f]);
    assert!(out.status.success(), "{}", text(&out));
    let shown = text(&out);
    assert!(shown.contains("+ service web") && shown.contains("+ route api"), "{shown}");
    assert!(shown.contains("nothing applied"), "{shown}");
    let out = tg.ctl(&["apply", "-f", f, "--prune"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(served_by(&get(&tg.url("/api/x")).await), "b");

    std::fs::write(&file, document(&[("web", &b)], &[("web", "/")])).unwrap();
    let shown = text(&tg.ctl(&["diff", "-f", f]));
    assert!(shown.contains("~ service web: backends[0].addr"), "{shown}");
    assert!(shown.contains("- route api") && shown.contains("- service api"), "{shown}");
    assert!(tg.ctl(&["apply", "-f", f, "--prune"]).status.success());
    assert_eq!(served_by(&get(&tg.url("/")).await), "b");
    assert_eq!(get(&tg.url("/api/x")).await.status, 200, "`/` now catches it: the api route is gone");
    let (_, config) = tg.api("GET", "/v1/config", None).await;
    assert!(config["services"].get("api").is_none(), "{config}");
    assert!(text(&tg.ctl(&["diff", "-f", f])).contains("no changes"));

    // A change set cannot be the desired state.
    let ops = dir.path().join("ops.json");
    std::fs::write(&ops, r#"{"ops": []}"#).unwrap();
    let out = tg.ctl(&["apply", "-f", ops.to_str().unwrap(), "--prune"]);
    assert!(!out.status.success() && text(&out).contains("declarative document"), "{}", text(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validate_names_the_line_column_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let validate = |p: &Path| {
        std::process::Command::new(env!("CARGO_BIN_EXE_tidegate")).arg("validate").arg(p).output().expect("validate")
    };
    let good = dir.path().join("good.yaml");
    std::fs::write(
        &good,
        "services:\n  web:\n    backends: [{id: a, addr: '127.0.0.1:1'}]\nroutes:\n  web: {service: web}\n",
    )
    .unwrap();
    let out = validate(&good);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("1 service(s), 1 route(s)"), "{}", text(&out));

    for example in ["tidegate.yaml", "batch.yaml"] {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples").join(example);
        let out = validate(&path);
        assert!(out.status.success(), "the shipped example {example} is valid: {}", text(&out));
    }

    let cases = [
        (
            "services:\n  web:\n    backends:\n      - id: a\n        addr: 'no port'\n",
            ":4:9:",
            "services.web.backends[0].addr",
        ),
        ("services:\n  web:\n    timeouts: {connect_ms: 0}\n", ":", "timeouts.connect_ms"),
        ("services:\n  web:\n    polcy: {kind: random}\n", ":3:", "polcy"),
        ("routes:\n  r: {service: nowhere}\n", "", "nowhere"),
        ("services: [unclosed\n", ":", "bad.yaml"),
    ];
    for (content, at, field) in cases {
        let bad = dir.path().join("bad.yaml");
        std::fs::write(&bad, content).unwrap();
        let out = validate(&bad);
        let shown = text(&out);
        assert_eq!(out.status.code(), Some(1), "{content}: {shown}");
        assert!(shown.contains(&format!("bad.yaml{at}")), "{content}: the position: {shown}");
        assert!(shown.contains(field), "{content}: {field} named: {shown}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_mode_applies_the_file_at_start_and_on_sighup() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (Backend::start("a", &[]), Backend::start("b", &[]));
    let file = dir.path().join("tidegate.yaml");
    std::fs::write(&file, document(&[("web", &a)], &[("web", "/")])).unwrap();
    let f = file.to_str().unwrap().to_string();
    let data = dir.path().join("data");
    let tg = Tidegate::start_with(&data, &["--config", &f, "--config-mode", "sync"]);
    assert_eq!(served_by(&get(&tg.url("/")).await), "a");

    let hup = |tg: &Tidegate| {
        let status = std::process::Command::new("kill").args(["-HUP", &tg.pid().to_string()]).status().unwrap();
        assert!(status.success());
    };
    std::fs::write(&file, document(&[("web", &b)], &[("web", "/")])).unwrap();
    hup(&tg);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while served_by(&get(&tg.url("/")).await) != "b" {
        assert!(tokio::time::Instant::now() < deadline, "SIGHUP applied the file");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (_, config) = tg.api("GET", "/v1/config", None).await;
    let revision = config["revision"].clone();

    // A broken file on SIGHUP changes nothing and stops nothing.
    std::fs::write(&file, "services: [oops\n").unwrap();
    hup(&tg);
    refused_times(&tg, 1).await;
    assert_eq!(served_by(&get(&tg.url("/")).await), "b", "still serving the last good configuration");
    let (_, config) = tg.api("GET", "/v1/config", None).await;
    assert_eq!(config["revision"], revision);

    // Unlike `seed`, a restart applies the file to a store that has data.
    std::fs::write(&file, document(&[("web", &a)], &[("web", "/")])).unwrap();
    tg.kill9();
    let tg = Tidegate::start_with(&data, &["--config", &f, "--config-mode", "sync"]);
    assert_eq!(served_by(&get(&tg.url("/")).await), "a");
    let (_, config) = tg.api("GET", "/v1/config", None).await;
    assert!(config["revision"].as_u64() > revision.as_u64(), "{config}");
    let _: Value = config;
}

/// A seed file (`--config`) applied to an empty store whose certificate
/// keeps a key there is none of: refused at start, named by the file's
/// field, though the file checks on its own (an export looks like that).
#[test]
fn a_seed_that_keeps_a_key_it_does_not_have_is_refused_by_its_field() {
    let dir = tempfile::tempdir().unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["a.example".to_string()]).unwrap().self_signed(&key).unwrap();
    let file = dir.path().join("seed.json");
    let doc = json!({ "certificates": { "c": { "cert_pem": cert.pem(), "key_pem": "(redacted)" } } });
    std::fs::write(&file, doc.to_string()).unwrap();
    let validate =
        std::process::Command::new(env!("CARGO_BIN_EXE_tidegate")).arg("validate").arg(&file).output().unwrap();
    assert!(validate.status.success(), "{}", text(&validate));
    assert!(text(&validate).contains("certificates.c.key_pem is \"(redacted)\""), "{}", text(&validate));
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_tidegate"))
        .args(["serve", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--config"])
        .arg(&file)
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .env("TIDEGATE_ADMIN_TOKEN", TOKEN)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("serve kept running with a seed it cannot apply");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success());
    assert!(text(&out).contains("certificates.c.key_pem"), "{}", text(&out));
}

/// `tidegate schema` prints the JSON Schema of configuration files; the
/// copy in docs/ (which the examples point editors at) is that output.
#[test]
fn the_config_file_schema_in_docs_is_current() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tidegate")).arg("schema").output().unwrap();
    assert!(out.status.success());
    let docs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/config.schema.json");
    let committed = std::fs::read(&docs).unwrap();
    assert!(
        out.stdout == committed,
        "docs/config.schema.json is stale: run `tidegate schema > docs/config.schema.json`"
    );
    let schema: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(schema["$schema"], "https://json-schema.org/draft/2020-12/schema");
}

/// Runs `tidegate serve` on `data_dir` with `extra` and expects it to stop
/// by itself (within 20 s) with a failure; its output.
pub(crate) fn serve_fails(data_dir: &Path, extra: &[&str]) -> String {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_tidegate"))
        .args(["serve", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--data-dir"])
        .arg(data_dir)
        .args(extra)
        .env("TIDEGATE_ADMIN_TOKEN", TOKEN)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("serve runs");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while child.try_wait().expect("try_wait").is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("its output");
            panic!("serve {extra:?} kept running: {}", text(&out));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().expect("its output");
    assert!(!out.status.success(), "serve {extra:?} exited with success: {}", text(&out));
    text(&out)
}

fn hangup(tg: &Tidegate) {
    let status = std::process::Command::new("kill").args(["-HUP", &tg.pid().to_string()]).status().expect("kill runs");
    assert!(status.success());
}

fn chmod(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

/// Waits until `/v1/status` shows the configuration file refused `n`
/// times in all; the status's `config_file`.
async fn refused_times(tg: &Tidegate, n: u64) -> Value {
    wait_for(&format!("the file was refused {n} times"), Duration::from_secs(10), async || {
        let (_, status) = tg.api("GET", "/v1/status", None).await;
        (status["config_file"]["failures"].as_u64() == Some(n)).then(|| status["config_file"].clone())
    })
    .await
}

/// A configuration file runs with Tidegate's privileges (an autoscaler
/// command in it runs as that user), so one that someone else could have
/// written is refused as the admin token file is: at start (the process
/// exits, naming the file and why) and on SIGHUP (the running configuration
/// stays, and status and metrics say why).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configuration_file_others_may_write_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (Backend::start("a", &[]), Backend::start("b", &[]));
    let file = dir.path().join("tidegate.yaml");
    std::fs::write(&file, document(&[("web", &a)], &[("web", "/")])).unwrap();
    let f = file.to_str().unwrap().to_string();
    let data = dir.path().join("data");

    for mode in ["sync", "seed"] {
        chmod(&file, 0o666);
        let out = serve_fails(&data, &["--config", &f, "--config-mode", mode]);
        assert!(out.contains("tidegate.yaml: mode 0666 lets its group and everyone write it"), "{mode}: {out}");
        chmod(&file, 0o620);
        let out = serve_fails(&data, &["--config", &f, "--config-mode", mode]);
        assert!(out.contains("tidegate.yaml: mode 0620 lets its group write it"), "{mode}: {out}");
    }
    // In a directory anyone may write to (without the sticky bit), the file
    // or a link to it could be replaced by anyone.
    let open = dir.path().join("open");
    std::fs::create_dir(&open).unwrap();
    chmod(&open, 0o777);
    let planted = open.join("tidegate.yaml");
    std::os::unix::fs::symlink(&file, &planted).unwrap();
    chmod(&file, 0o644);
    let out = serve_fails(&data, &["--config", planted.to_str().unwrap(), "--config-mode", "sync"]);
    assert!(out.contains("the symbolic link in") && out.contains("without the sticky bit"), "{out}");

    // A file that passes starts; made writable by others, it is refused on
    // SIGHUP, and the proxy goes on with what it had.
    let tg = Tidegate::start_with(&data, &["--config", &f, "--config-mode", "sync"]);
    assert_eq!(served_by(&get(&tg.url("/")).await), "a");
    let (_, status) = tg.api("GET", "/v1/status", None).await;
    assert_eq!(status["config_file"]["ok"], true, "{status}");
    std::fs::write(&file, document(&[("web", &b)], &[("web", "/")])).unwrap();
    chmod(&file, 0o646);
    hangup(&tg);
    let report = refused_times(&tg, 1).await;
    assert_eq!(report["ok"], false, "{report}");
    let why = report["last_error"].as_str().unwrap_or("");
    assert!(why.contains("tidegate.yaml: mode 0646 lets everyone write it"), "{report}");
    assert_eq!(served_by(&get(&tg.url("/")).await), "a", "the running configuration stays");
    let metrics = send("GET", &tg.admin_url("/metrics"), Some(TOKEN), Vec::new(), &[]).await.text();
    assert!(metrics.contains("tidegate_config_file_ok 0"), "{metrics}");
    assert!(metrics.contains("tidegate_config_file_refused_total 1"), "{metrics}");

    // Fixed, it applies again.
    chmod(&file, 0o644);
    hangup(&tg);
    wait_for("the fixed file applies", Duration::from_secs(10), async || {
        (served_by(&get(&tg.url("/")).await) == "b").then_some(())
    })
    .await;
    // The report follows the apply (the data plane may show it first).
    wait_for("the status reports the file applied", Duration::from_secs(10), async || {
        let (_, status) = tg.api("GET", "/v1/status", None).await;
        (status["config_file"]["ok"] == true).then_some(())
    })
    .await;
}

/// With `--config-mode sync`, a file that says nothing (empty, comments
/// only, `{}`, no objects) or is cut off mid-write would delete every
/// service and route: it is refused, on SIGHUP and at start, unless it says
/// `empty: true`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_file_that_would_delete_everything_must_say_so() {
    let dir = tempfile::tempdir().unwrap();
    let a = Backend::start("a", &[]);
    let file = dir.path().join("tidegate.yaml");
    // Services last, so a cut in the last address still parses.
    let whole = format!(
        "routes:\n  web:\n    match: {{path_prefix: /}}\n    service: web\nservices:\n  web:\n    backends:\n      - id: a\n        addr: {}\n",
        a.addr
    );
    std::fs::write(&file, &whole).unwrap();
    let f = file.to_str().unwrap().to_string();
    let data = dir.path().join("data");
    let tg = Tidegate::start_with(&data, &["--config", &f, "--config-mode", "sync"]);
    assert_eq!(served_by(&get(&tg.url("/")).await), "a");
    let (_, config) = tg.api("GET", "/v1/config", None).await;
    let revision = config["revision"].clone();

    let cut = whole[..whole.len() - 2].to_string();
    let lies = [
        ("", "holds no services, routes or certificates"),
        ("# nothing here yet\n", "holds no services, routes or certificates"),
        ("{}", "holds no services, routes or certificates"),
        ("services: {}\nroutes: {}\n", "say so with `empty: true`"),
        (cut.as_str(), "does not end with a newline"),
    ];
    for (n, (content, why)) in lies.iter().enumerate() {
        std::fs::write(&file, content).unwrap();
        hangup(&tg);
        let report = refused_times(&tg, n as u64 + 1).await;
        let error = report["last_error"].as_str().unwrap_or("");
        assert!(error.contains("tidegate.yaml") && error.contains(why), "{content:?}: {report}");
        assert_eq!(served_by(&get(&tg.url("/")).await), "a", "{content:?}: the configuration stays");
        let (_, config) = tg.api("GET", "/v1/config", None).await;
        assert_eq!(config["revision"], revision, "{content:?}");
    }
    // At start too.
    drop(tg);
    std::fs::write(&file, "# emptied by mistake\n").unwrap();
    let out = serve_fails(&data, &["--config", &f, "--config-mode", "sync"]);
    assert!(out.contains("tidegate.yaml: holds no services, routes or certificates"), "{out}");

    // Said on purpose, it empties the configuration.
    std::fs::write(&file, &whole).unwrap();
    let tg = Tidegate::start_with(&data, &["--config", &f, "--config-mode", "sync"]);
    assert_eq!(served_by(&get(&tg.url("/")).await), "a");
    std::fs::write(&file, "# nothing is served from here on purpose\nempty: true\n").unwrap();
    hangup(&tg);
    wait_for("the empty file applies", Duration::from_secs(10), async || {
        (get(&tg.url("/")).await.status == 404).then_some(())
    })
    .await;
    let (_, config) = tg.api("GET", "/v1/config", None).await;
    assert_eq!(config["services"], json!({}), "{config}");
}
