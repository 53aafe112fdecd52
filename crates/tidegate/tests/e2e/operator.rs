//! What operators configure around the proxy: a health-check path on the
//! proxy's own listeners, JSON application logs, and `serve` flags given as
//! environment variables.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use serde_json::Value;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_health_path_is_answered_before_routing_and_flags_read_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    // The flag as an environment variable (`env` execs Tidegate with it).
    let tg = Tidegate::start_wrapped(dir.path(), &["env", "TIDEGATE_HEALTH_PATH=/lb-check"], &[]);
    let r = get(&tg.url("/lb-check")).await;
    assert_eq!((r.status, r.text().as_str()), (200, "ok\n"), "answered with no route at all");
    assert_eq!(send("HEAD", &tg.url("/lb-check"), None, Vec::new(), &[]).await.status, 200);
    assert_eq!(get(&tg.url("/lb-check/x")).await.status, 404, "only the path itself");
    assert_eq!(send("POST", &tg.url("/lb-check"), None, Vec::new(), &[]).await.status, 404, "only reads");
    // HTTP/2 clients (through hyper) get the same answer.
    let tcp = tokio::net::TcpStream::connect(tg.proxy).await.unwrap();
    let (mut h2, conn) =
        hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), hyper_util::rt::TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(conn);
    let req = http::Request::get(format!("http://{}/lb-check", tg.proxy))
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .unwrap();
    assert_eq!(h2.send_request(req).await.unwrap().status(), 200);

    // A route for the same path does not take it over.
    let b = Backend::start("b", &[]);
    route_to(&tg, "web", &[&b], "round_robin").await;
    assert_eq!(get(&tg.url("/lb-check")).await.text(), "ok\n");
    assert_eq!(served_by(&get(&tg.url("/other")).await), "b");

    // A bad path is refused at start.
    let out = Command::new(env!("CARGO_BIN_EXE_tidegate"))
        .args(["serve", "--health-path", "no-slash", "--data-dir"])
        .arg(dir.path().join("other"))
        .env("TIDEGATE_ADMIN_TOKEN", TOKEN)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--health-path"), "{out:?}");
}

#[test]
fn application_logs_can_be_json_lines() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_tidegate"))
        .args(["serve", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--log-format", "json", "--data-dir"])
        .arg(dir.path())
        .env("TIDEGATE_ADMIN_TOKEN", TOKEN)
        .env("TIDEGATE_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut ready = String::new();
    stdout.read_line(&mut ready).unwrap();
    assert!(ready.starts_with("tidegate ready"), "{ready}");
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut found = None;
    for _ in 0..20 {
        let mut line = String::new();
        if stderr.read_line(&mut line).unwrap() == 0 {
            break;
        }
        let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        if v["fields"]["message"] == "tidegate ready" {
            found = Some(v);
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    let v = found.expect("the ready line is logged as JSON");
    assert_eq!(v["level"], "INFO", "{v}");
    assert!(v["timestamp"].is_string() && v["fields"]["admin"].is_string(), "{v}");
}

#[test]
fn completions_and_the_manual_come_from_the_command_definitions() {
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_tidegate")).args(args).output().unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let bash = run(&["completions", "bash"]);
    assert!(bash.contains("--health-path") && bash.contains("--config-mode") && bash.contains("validate"), "bash");
    assert!(run(&["completions", "zsh"]).contains("#compdef tidegate"));
    let man = run(&["man"]);
    // Titles in capitals, as Debian's man pages have them.
    assert!(man.contains(".TH TIDEGATE 1") && man.contains(".TH TIDEGATE-SERVE 1"), "one page per command");
    assert!(man.contains("health\\-path"), "flags are documented");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_can_be_scraped_without_the_token_on_their_own_listener() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_tidegate"))
        .args(["serve", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
        .arg("--data-dir")
        .arg(dir.path())
        .env("TIDEGATE_ADMIN_TOKEN", TOKEN)
        .env("TIDEGATE_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut ready = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut ready).unwrap();
    let field = |name: &str| ready.split_whitespace().find_map(|w| w.strip_prefix(name)).map(str::to_string);
    let metrics = field("metrics=").unwrap_or_else(|| panic!("no metrics= in {ready:?}"));
    let admin = field("admin=").unwrap();
    let r = get(&format!("http://{metrics}/metrics")).await;
    assert_eq!(r.status, 200, "no token needed: {}", r.text());
    assert!(r.text().contains("tidegate_config_revision 0"), "{}", r.text());
    assert_eq!(get(&format!("http://{metrics}/v1/config")).await.status, 404, "metrics only");
    assert_eq!(get(&format!("http://{metrics}/metrics?x=1")).await.status, 400);
    assert_eq!(get(&format!("http://{admin}/metrics")).await.status, 401, "the admin API still wants the token");
    let _ = child.kill();
    let _ = child.wait();
}

/// The shipped systemd unit stays valid (checked by `systemd-analyze
/// verify` where systemd is installed, against the built binary).
#[test]
fn the_systemd_unit_verifies() {
    let Ok(which) = Command::new("systemd-analyze").arg("--version").output() else {
        eprintln!("systemd-analyze is not installed: skipped");
        return;
    };
    assert!(which.status.success());
    let unit =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../packaging/tidegate.service")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tidegate.service");
    std::fs::write(&path, unit.replace("/usr/local/bin/tidegate", env!("CARGO_BIN_EXE_tidegate"))).unwrap();
    let out = Command::new("systemd-analyze").arg("verify").arg(&path).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.stderr.is_empty(), "warnings: {}", String::from_utf8_lossy(&out.stderr));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_reaches_its_backend_with_a_request_id() {
    let dir = tempfile::tempdir().unwrap();
    let b = Backend::start("ids", &[]);
    for engine in ["native", "hyper"] {
        let tg = Tidegate::start_with(&dir.path().join(engine), &["--http1", engine]);
        route_to(&tg, "web", &[&b], "round_robin").await;
        let id_of = |r: &Reply| {
            let doc: Value = serde_json::from_slice(&r.body).expect("the echo's JSON");
            doc["headers"]["x-request-id"].as_str().map(str::to_string)
        };
        let first = id_of(&get(&tg.url("/echo")).await).expect("an id was added");
        let second = id_of(&get(&tg.url("/echo")).await).expect("an id was added");
        assert!(first.len() == 32 && first.bytes().all(|c| c.is_ascii_hexdigit()), "{engine}: {first}");
        assert_ne!(first, second, "{engine}: one per request");
        let given = send("GET", &tg.url("/echo"), None, Vec::new(), &[("x-request-id", "from-the-client")]).await;
        assert_eq!(id_of(&given).as_deref(), Some("from-the-client"), "{engine}: the client's id is kept");
    }
}
