//! Autoscaling with the process provider: real instances of the backend
//! emulator started and stopped by Tidegate.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::support::*;

/// Instances run in their own process groups and outlive a killed Tidegate
/// (so a restart can adopt them). Tests stop what their Tidegate started:
/// every process group listed in the provider's state files.
struct Reaper(std::path::PathBuf);

impl Drop for Reaper {
    fn drop(&mut self) {
        let Ok(dir) = std::fs::read_dir(self.0.join("instances")) else { return };
        for entry in dir.flatten() {
            let Ok(text) = std::fs::read_to_string(entry.path()) else { continue };
            let Ok(state) = serde_json::from_str::<Value>(&text) else { continue };
            let mut pids = Vec::new();
            collect_pids(&state, &mut pids);
            // Only emulator instances, by pid (never a process group): a
            // recorded pid may be gone or reused by now.
            for pid in pids.into_iter().filter(|p| *p > 1) {
                let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                if String::from_utf8_lossy(&cmdline).contains("tidegate-emulator") {
                    let _ = std::process::Command::new("kill").args(["-9", &pid.to_string()]).status();
                }
            }
        }
    }
}

fn collect_pids(v: &Value, out: &mut Vec<i64>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v.as_i64()) {
                    ("pid", Some(p)) => out.push(p),
                    _ => collect_pids(v, out),
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|v| collect_pids(v, out)),
        _ => {}
    }
}

fn emulator() -> String {
    bin_dir().join("tidegate-emulator").to_string_lossy().into_owned()
}

/// A service with one static backend and an autoscale block whose instances
/// are emulators on ports from `ports`.
async fn autoscaled(tg: &Tidegate, base: &Backend, ports: &str, command: Value, extra: Value) {
    let mut autoscale = json!({
        "provider": {"kind": "process", "command": command, "ports": ports, "grace_s": 2},
        "min": 1, "max": 3, "target_in_flight": 2, "latency_threshold_ms": 1000,
        "peak_hold_s": 3, "stable_window_s": 4, "panic_window_s": 2,
        "ready": {"path": "/health", "interval_ms": 100, "timeout_s": 10},
        "drain_timeout_s": 10,
    });
    if let (Some(a), Some(e)) = (autoscale.as_object_mut(), extra.as_object()) {
        a.extend(e.clone());
    }
    let spec = json!({
        "policy": {"kind": "least_conn"},
        "autoscale": autoscale,
        "backends": [{"id": "base", "addr": base.addr.to_string()}],
    });
    let (s, v) = tg.api("PUT", "/v1/services/app", Some(spec)).await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = tg.api("PUT", "/v1/routes/app", Some(json!({"service": "app"}))).await;
    assert_eq!(s, 200, "{v}");
}

fn emulator_command(extra: &[&str]) -> Value {
    let mut cmd = vec![emulator(), "--listen".into(), "127.0.0.1:{port}".into(), "--name".into(), "{id}".into()];
    cmd.extend(["--threads", "1"].iter().map(|s| s.to_string()));
    cmd.extend(extra.iter().map(|s| s.to_string()));
    json!(cmd)
}

async fn events(tg: &Tidegate) -> Vec<Value> {
    let (_, v) = tg.api("GET", "/v1/events", None).await;
    v["events"].as_array().cloned().unwrap_or_default()
}

/// Waits (bounded) until an event of `kind` exists; returns it.
async fn wait_event(tg: &Tidegate, kind: &str, secs: u64) -> Value {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline {
        if let Some(e) = events(tg).await.into_iter().find(|e| e["kind"] == kind) {
            return e;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no {kind} event within {secs} s; events: {:?}", events(tg).await);
}

struct Load {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    /// (unix ms, backend) of every answer.
    served: Arc<std::sync::Mutex<Vec<(u64, String)>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

fn load(tg: &Arc<Tidegate>, clients: usize, path: &'static str) -> Load {
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let served = Arc::new(std::sync::Mutex::new(Vec::new()));
    let tasks = (0..clients)
        .map(|_| {
            let (tg, stop, ok, failed, served) = (tg.clone(), stop.clone(), ok.clone(), failed.clone(), served.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    match try_send("GET", &tg.url(path), None, vec![], &[]).await {
                        Ok(r) if r.status == 200 => {
                            ok.fetch_add(1, Ordering::Relaxed);
                            served.lock().expect("lock").push((unix_ms(), served_by(&r)));
                        }
                        other => {
                            eprintln!("failed: {:?}", other.map(|r| (r.status, r.text())));
                            failed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            })
        })
        .collect();
    Load { stop, ok, failed, served, tasks }
}

impl Load {
    /// Whether `backend` has answered one of the requests yet.
    fn has_served(&self, backend: &str) -> bool {
        self.served.lock().expect("lock").iter().any(|(_, b)| b == backend)
    }

    async fn finish(self) -> (u64, u64, Vec<(u64, String)>) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await.expect("client task");
        }
        let served = self.served.lock().expect("lock").clone();
        (self.ok.load(Ordering::Relaxed), self.failed.load(Ordering::Relaxed), served)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_scales_out_after_the_probe_and_scale_in_drains_without_failures() {
    let dir = tempfile::tempdir().unwrap();
    let _reaper = Reaper(dir.path().to_path_buf());
    let tg = Arc::new(Tidegate::start(dir.path()));
    let base = Backend::start("base", &["--slots", "2", "--service-time", "fixed:50ms"]);
    // Instances listen only after 1 s: traffic before the probe passes would fail.
    let cmd = emulator_command(&["--startup-delay", "1s", "--slots", "2", "--service-time", "fixed:50ms"]);
    autoscaled(&tg, &base, "23100-23199", cmd, json!({})).await;

    // Overload: 8 clients against 2 slots.
    let heavy = load(&tg, 8, "/");
    let ready = wait_event(&tg, "ready", 20).await;
    let new_id = ready["instance"].as_str().unwrap().to_string();
    wait_for("the new instance serves", Duration::from_secs(20), async || heavy.has_served(&new_id).then_some(()))
        .await;
    let (ok, failed, served) = heavy.finish().await;
    assert_eq!(failed, 0, "{ok} ok");
    let ready_at = ready["at_unix_ms"].as_u64().unwrap();
    let first = served.iter().find(|(_, b)| *b == new_id).map(|(t, _)| *t);
    let first = first.unwrap_or_else(|| panic!("{new_id} never served"));
    // Allow for the clocks of two processes read a few ms apart.
    assert!(first + 50 >= ready_at, "served at {first}, ready at {ready_at}");
    let started = events(&tg).await.into_iter().find(|e| e["kind"] == "started" && e["instance"] == new_id.as_str());
    assert!(started.is_some(), "a started event precedes ready");
    let (_, config) = tg.api("GET", "/v1/config", None).await;
    let backends = config["services"]["app"]["backends"].as_array().unwrap().clone();
    assert!(backends.iter().any(|b| b["id"] == new_id.as_str() && b["autoscaled"] == true), "{backends:?}");

    // Light load with long requests: after the hold, instances are drained
    // and stopped, and not one request fails, in flight during the drain or not.
    let light = load(&tg, 2, "/?delay_ms=700");
    wait_event(&tg, "stopped", 30).await;
    let (ok, failed, _) = light.finish().await;
    assert_eq!(failed, 0, "{ok} ok during scale-in");
    let kinds: Vec<String> = events(&tg).await.iter().map(|e| e["kind"].as_str().unwrap_or("").to_string()).collect();
    assert!(kinds.contains(&"scale_in".to_string()) && kinds.contains(&"draining".to_string()), "{kinds:?}");
    let (_, status) = tg.api("GET", "/v1/status", None).await;
    assert!(status["services"]["app"]["scaling"]["last_decision"].is_object(), "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_instance_is_replaced_and_a_failing_command_gets_no_traffic() {
    let dir = tempfile::tempdir().unwrap();
    let _reaper = Reaper(dir.path().to_path_buf());
    let tg = Arc::new(Tidegate::start(dir.path()));
    let base = Backend::start("base", &[]);
    // Pinned at 2: one instance besides the static backend.
    autoscaled(&tg, &base, "23200-23299", emulator_command(&[]), json!({"pinned": 2})).await;
    let first = wait_event(&tg, "ready", 20).await;
    let id = first["instance"].as_str().unwrap().to_string();
    let state = dir.path().join("instances").join("app.instances.json");
    let text = std::fs::read_to_string(&state).unwrap_or_else(|e| panic!("{}: {e}", state.display()));
    let pid = serde_json::from_str::<Value>(&text).unwrap().to_string();
    let pid = pid.split("\"pid\":").nth(1).and_then(|s| s.split(|c: char| !c.is_ascii_digit()).find(|s| !s.is_empty()));
    let pid = pid.expect("a pid in the state file").to_string();
    // The instance got a clean environment: its port, but no secret of Tidegate's.
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    let environ = String::from_utf8_lossy(&environ);
    assert!(environ.split('\0').any(|v| v.starts_with("TIDEGATE_PORT=")), "{environ}");
    assert!(!environ.contains("TIDEGATE_ADMIN_TOKEN") && !environ.contains(TOKEN), "the child sees the token");
    std::process::Command::new("kill").args(["-9", &pid]).status().unwrap();
    wait_event(&tg, "died", 10).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let ready: Vec<Value> = events(&tg).await.into_iter().filter(|e| e["kind"] == "ready").collect();
        if ready.iter().any(|e| e["instance"] != id.as_str()) {
            break;
        }
        assert!(Instant::now() < deadline, "no replacement for {id}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A command that cannot start: start failures, and no traffic to it.
    let spec = json!(["/nonexistent/program", "{port}"]);
    autoscaled(&tg, &base, "23300-23399", spec, json!({"pinned": 2})).await;
    wait_event(&tg, "start_failed", 20).await;
    for _ in 0..20 {
        let r = get(&tg.url("/")).await;
        assert_eq!((r.status, served_by(&r).as_str()), (200, "base"));
    }
    let (_, config) = tg.api("GET", "/v1/config", None).await;
    let backends = config["services"]["app"]["backends"].as_array().unwrap().clone();
    assert!(!backends.iter().any(|b| b["addr"].as_str().is_some_and(|a| a.contains(":233"))), "{backends:?}");
}

/// The files of the instances under `data/instances` whose name starts
/// with `prefix`, with their sizes.
fn output_files(dir: &std::path::Path, prefix: &str) -> Vec<(String, u64)> {
    let Ok(entries) = std::fs::read_dir(dir.join("instances")) else { return Vec::new() };
    let mut files: Vec<(String, u64)> = entries
        .flatten()
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.metadata().map_or(0, |m| m.len())))
        .filter(|(name, _)| name.starts_with(prefix))
        .collect();
    files.sort();
    files
}

/// The finding: an autoscaled instance's output file grew without
/// bound (100 MB printed, 500 MB written in 100 s) and was never removed.
/// Now each instance has its current file and one rotated copy, each about
/// 4 MiB at most, and both go when the instance is stopped (its current
/// file kept as the service's `.last.log`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_output_is_rotated_and_removed_when_it_stops() {
    let dir = tempfile::tempdir().unwrap();
    let _reaper = Reaper(dir.path().to_path_buf());
    let tg = Arc::new(Tidegate::start(dir.path()));
    let base = Backend::start("base", &[]);
    // An emulator preceded by a printer: 2.5 MB/s for 40 s at most (so a
    // run of the old code cannot fill the disk), in the instance's group.
    let emulator = emulator_command(&[]);
    let emulator: Vec<&str> = emulator.as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    let script = format!(
        "i=0; while [ $i -lt 400 ]; do head -c 262144 /dev/zero | tr '\\0' x; sleep 0.1; i=$((i+1)); done & exec {}",
        emulator.join(" ")
    );
    autoscaled(&tg, &base, "23400-23499", json!(["sh", "-c", script]), json!({"pinned": 2})).await;
    let ready = wait_event(&tg, "ready", 20).await;
    let id = ready["instance"].as_str().unwrap().to_string();
    let log = format!("app-{id}.log");
    let rotated = format!("{log}.1");
    // Rotated within seconds, and never more than two files of about 4 MiB
    // (checked four times a second: at 2.5 MB/s, 1 MB of slack is plenty).
    let limit = 5 * 1024 * 1024;
    wait_for("the output is rotated", Duration::from_secs(30), async || {
        let files = output_files(dir.path(), &log);
        assert!(files.len() <= 2 && files.iter().all(|(_, len)| *len <= limit), "{files:?}");
        files.iter().any(|(name, _)| *name == rotated).then_some(())
    })
    .await;
    let began = Instant::now();
    while began.elapsed() < Duration::from_secs(3) {
        let files = output_files(dir.path(), &log);
        assert!(files.len() <= 2 && files.iter().all(|(_, len)| *len <= limit), "{files:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Scaled in: drained, stopped, and its files go.
    let (s, v) = tg.api("POST", "/v1/services/app/autoscale", Some(json!({"pinned": 1}))).await;
    assert!(s == 200, "{s} {v}");
    wait_for("the instance is stopped", Duration::from_secs(30), async || {
        events(&tg).await.into_iter().any(|e| e["kind"] == "stopped" && e["instance"] == id.as_str()).then_some(())
    })
    .await;
    assert_eq!(output_files(dir.path(), &log), vec![], "the stopped instance's files are left");
    let last = output_files(dir.path(), "app.last.log");
    assert!(last.len() == 1 && last[0].1 <= limit, "{last:?}");
}

/// The finding: while starts backed off after failures, the same
/// scale-out event was recorded every second. Now the repeats are counted
/// and carried by the next event recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scale_out_events_are_coalesced_while_starts_back_off() {
    let dir = tempfile::tempdir().unwrap();
    let _reaper = Reaper(dir.path().to_path_buf());
    let tg = Tidegate::start(dir.path());
    let base = Backend::start("base", &[]);
    autoscaled(&tg, &base, "23500-23599", json!(["/nonexistent/program", "{port}"]), json!({"pinned": 2})).await;
    // Three failures: back-offs of 2 s and 4 s in between.
    let all = wait_for("three start failures", Duration::from_secs(40), async || {
        let all = events(&tg).await;
        (all.iter().filter(|e| e["kind"] == "start_failed").count() >= 3).then_some(all)
    })
    .await;
    let failures = all.iter().filter(|e| e["kind"] == "start_failed").count();
    let scale_outs: Vec<&Value> = all.iter().filter(|e| e["kind"] == "scale_out").collect();
    // One to start, and per failure one when the back-off begins and one
    // when it ends (the old code: one a second, 9 or more by now).
    assert!(
        scale_outs.len() <= 2 * failures + 1,
        "{} scale-outs for {failures} failures: {scale_outs:#?}",
        scale_outs.len()
    );
    assert!(
        scale_outs.iter().any(|e| e["repeats"].as_u64().is_some_and(|n| n >= 1)),
        "no event carries its repeats: {scale_outs:#?}"
    );
    // No output file is left per failed start: only the last one is kept.
    let files = output_files(dir.path(), "app");
    let names: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["app.last.log"], "{files:?}");
}
