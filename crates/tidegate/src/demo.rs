//! `tidegate demo`: Tidegate with something to look at, on loopback, in one
//! command. Three backends of different capacities behind one service
//! (`/shop`), an autoscaled service (`/api`) whose instances are started
//! and stopped as its load comes and goes, and a gentle traffic generator;
//! the dashboard shows balancing, health and autoscaling within a minute.
//!
//! The backends are Tidegate's own emulator (`tidegate emulate`): service
//! slots, a bounded queue and exponential service times. Everything else is
//! the real `tidegate serve`, configured from a file written here.

use std::net::SocketAddr;
use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::json;
use tidegate_emulator::{Args as EmulatorArgs, Emulator};

use crate::cli::{Cli, Command, DemoArgs};

/// The `/shop` backends: name, service slots (capacity 1:2:4).
const SHOP: [(&str, usize); 3] = [("shop-a", 1), ("shop-b", 2), ("shop-c", 4)];

pub fn run(mut args: DemoArgs) -> anyhow::Result<ExitCode> {
    // Port 0: a free port now, so the traffic and the banner know it.
    args.listen = resolve(args.listen)?;
    args.admin = resolve(args.admin)?;
    let data_dir = match &args.data_dir {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!("tidegate-demo-{}", std::process::id())),
    };
    std::fs::create_dir_all(&data_dir).with_context(|| format!("creating {}", data_dir.display()))?;
    let backends = start_backends()?;
    let config = data_dir.join("demo.json");
    let exe = std::env::current_exe().context("finding this program for the autoscaled instances")?;
    std::fs::write(&config, serde_json::to_vec_pretty(&demo_config(&backends, &exe, &args.ports))?)?;
    let token = crate::serve::admin_token(&data_dir)?;
    let traffic = Traffic::start(args.listen, args.admin, token, args.rate);
    let mut argv = vec!["tidegate".to_string(), "serve".into(), "--listen".into(), args.listen.to_string()];
    argv.extend(["--admin".into(), args.admin.to_string(), "--data-dir".into(), data_dir.display().to_string()]);
    argv.extend(["--config".into(), config.display().to_string()]);
    let serve_args = match <Cli as clap::Parser>::try_parse_from(argv)?.command {
        Command::Serve(a) => a,
        _ => anyhow::bail!("the demo's serve arguments did not parse as serve"),
    };
    let result = crate::serve::run(*serve_args);
    drop(traffic);
    stop_instances(&data_dir.join("instances"));
    result
}

/// `addr`, or with port 0 a port free now.
fn resolve(addr: SocketAddr) -> anyhow::Result<SocketAddr> {
    if addr.port() != 0 {
        return Ok(addr);
    }
    Ok(std::net::TcpListener::bind(addr)?.local_addr()?)
}

/// Starts the `/shop` backends on a runtime of their own; their addresses.
fn start_backends() -> anyhow::Result<Vec<(String, SocketAddr)>> {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    let mut bound = Vec::new();
    for (name, slots) in SHOP {
        let args = emulator_args(name, slots, "exp:20ms");
        let emulator = runtime.block_on(Emulator::bind(&args)).with_context(|| format!("starting backend {name}"))?;
        bound.push((name.to_string(), emulator.local_addr()?, emulator));
    }
    let addrs = bound.iter().map(|(n, a, _)| (n.clone(), *a)).collect();
    std::thread::Builder::new().name("demo-backends".into()).spawn(move || {
        runtime.block_on(async move {
            let serving: Vec<_> =
                bound.into_iter().map(|(_, _, e)| tokio::spawn(e.serve(std::future::pending::<()>()))).collect();
            for s in serving {
                let _ = s.await;
            }
        })
    })?;
    Ok(addrs)
}

fn emulator_args(name: &str, slots: usize, service_time: &str) -> EmulatorArgs {
    let argv = ["emulate", "--name", name, "--slots", &slots.to_string(), "--queue", "50"];
    let mut args = <EmulatorArgs as clap::Parser>::parse_from(argv.iter().chain(&["--service-time", service_time]));
    args.threads = 1;
    args
}

/// The demo's configuration: `/shop` over the three backends (the default
/// policy, active health checks), `/api` autoscaled from one instance.
fn demo_config(backends: &[(String, SocketAddr)], exe: &Path, ports: &str) -> serde_json::Value {
    let shop: Vec<_> = backends.iter().map(|(n, a)| json!({"id": n, "addr": a.to_string()})).collect();
    let instance = [
        exe.display().to_string(),
        "emulate".into(),
        "--listen".into(),
        "127.0.0.1:{port}".into(),
        "--name".into(),
        "api-{port}".into(),
        "--slots".into(),
        "2".into(),
        "--service-time".into(),
        "exp:40ms".into(),
        "--threads".into(),
        "1".into(),
    ];
    json!({
        "services": {
            "shop": {
                "health": {"active": {"path": "/health", "interval_ms": 1000}},
                "backends": shop,
            },
            "api": {
                "health": {"active": {"path": "/health", "interval_ms": 1000}},
                "autoscale": {
                    "provider": {"kind": "process", "command": instance, "ports": ports, "grace_s": 2},
                    "min": 1, "max": 4, "latency_threshold_ms": 50, "target_in_flight": 2,
                    "peak_hold_s": 20, "stable_window_s": 20,
                    "ready": {"path": "/health", "timeout_s": 10}, "drain_timeout_s": 10,
                },
            },
        },
        "routes": {
            "shop": {"match": {"path_prefix": "/shop"}, "service": "shop"},
            "api": {"match": {"path_prefix": "/api"}, "service": "api"},
        },
    })
}

/// Stops the autoscaled instances the demo's provider recorded as running
/// (their process groups), so that none outlives the demo.
fn stop_instances(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let Ok(text) = std::fs::read_to_string(entry.path()) else { continue };
        let Ok(state) = serde_json::from_str::<serde_json::Value>(&text) else { continue };
        let pids = state["instances"].as_array().into_iter().flatten().filter_map(|i| i["pid"].as_i64());
        // A pid of 0 or 1 would signal this process group, or every process.
        for pid in pids.filter(|p| *p > 1) {
            let _ = std::process::Command::new("kill").args(["-TERM", "--", &format!("-{pid}")]).status();
        }
    }
}

/// The traffic generator: steady requests to `/shop`, and to `/api` a
/// calm-peak cycle (30 s at 5/s, 40 s at about twice one instance's
/// capacity) that makes the autoscaler start instances and, after the
/// peak hold, stop them. It prints one line every 10 s.
struct Traffic {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Traffic {
    fn start(listen: SocketAddr, admin: SocketAddr, token: String, rate: u32) -> Traffic {
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let run = move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            runtime.block_on(async move {
                tokio::select! {
                    () = generate(listen, admin, &token, rate) => {}
                    _ = stopped => {}
                }
            });
            anyhow::Ok(())
        };
        let _ = std::thread::Builder::new().name("demo-traffic".into()).spawn(run);
        Traffic { stop: Some(stop) }
    }
}

impl Drop for Traffic {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Empty<Bytes>>;

async fn generate(listen: SocketAddr, admin: SocketAddr, token: &str, rate: u32) {
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    // Wait for the proxy to be ready (the admin API starts after it).
    let ready = format!("http://{admin}/readyz");
    for _ in 0..300 {
        if get(&client, &ready).await == Some(200) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // And for the autoscaler's first `/api` instance.
    for _ in 0..300 {
        if get(&client, &format!("http://{listen}/api/ready")).await == Some(200) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!();
    println!("Tidegate demo: open the dashboard at http://{admin}/ui/#token={token}");
    println!("  proxy      http://{listen}/shop (3 backends, capacity 1:2:4) and http://{listen}/api (autoscaled)");
    println!("  admin API  http://{admin} (token {token})");
    println!("  traffic    {rate} req/s to /shop; /api peaks every 70 s. Ctrl-C stops everything.");
    println!();
    let counts = Arc::new([AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)]);
    let shop =
        tokio::spawn(steady(client.clone(), format!("http://{listen}/shop/item"), move |_| rate, counts.clone(), 0));
    let api_rate = |t: u64| if t % 70 < 30 { 5 } else { 80 };
    let api = tokio::spawn(steady(client.clone(), format!("http://{listen}/api/work"), api_rate, counts.clone(), 1));
    let mut tick = tokio::time::interval(Duration::from_secs(10));
    tick.tick().await;
    loop {
        tick.tick().await;
        let [shop_ok, api_ok, failed] = [0, 1, 2].map(|i| counts[i].swap(0, Relaxed));
        println!("last 10 s: /shop {shop_ok} ok, /api {api_ok} ok, {failed} failed");
        if shop.is_finished() || api.is_finished() {
            return;
        }
    }
}

/// Sends GETs to `url` at `rate(seconds since start)` per second, without
/// waiting for answers (open loop), counting successes in `counts[slot]`
/// and failures in `counts[2]`.
async fn steady(client: HttpClient, url: String, rate: impl Fn(u64) -> u32, counts: Arc<[AtomicU64; 3]>, slot: usize) {
    let start = tokio::time::Instant::now();
    let mut next = start;
    loop {
        let per_s = rate(start.elapsed().as_secs()).max(1);
        next += Duration::from_secs_f64(1.0 / f64::from(per_s));
        tokio::time::sleep_until(next).await;
        let (client, url, counts) = (client.clone(), url.clone(), counts.clone());
        tokio::spawn(async move {
            let ok = get(&client, &url).await == Some(200);
            counts[if ok { slot } else { 2 }].fetch_add(1, Relaxed);
        });
    }
}

/// GETs `url`, reading the body; its status.
async fn get(client: &HttpClient, url: &str) -> Option<u16> {
    let req = http::Request::get(url).body(Empty::new()).ok()?;
    let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req)).await.ok()?.ok()?;
    let status = resp.status().as_u16();
    resp.into_body().collect().await.ok()?;
    Some(status)
}
