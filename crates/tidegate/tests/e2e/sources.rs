//! Load sources against the real monitors: Prometheus `node_exporter` and
//! Ganglia `gmond` on loopback ports feed the backends' load, which
//! `/v1/status` shows per backend as `"load": {"cpu", "memory", "network"}`
//! (numbers, or null while unknown).
//!
//! The monitors come from Debian (`prometheus-node-exporter`,
//! `ganglia-monitor`); a test whose monitor is not installed says so and
//! passes.

use std::net::{TcpListener, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::*;

/// A monitor process, killed (by its own handle) when dropped.
struct Monitor(Child);

impl Monitor {
    /// Starts `cmd`; its errors go to the test's stderr.
    fn start(cmd: &mut Command) -> Monitor {
        Monitor(cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::inherit()).spawn().expect("spawn monitor"))
    }

    /// Panics if the process has exited (it failed to start).
    fn assert_running(&mut self, name: &str) {
        if let Ok(Some(status)) = self.0.try_wait() {
            panic!("{name} exited: {status}");
        }
    }

    fn stop(mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The installed binary `name`, looked up in PATH and the sbin directories.
fn binary(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/bin", "/sbin", "/bin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

fn free_tcp_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("free TCP port").port()
}

fn free_udp_port() -> u16 {
    UdpSocket::bind("127.0.0.1:0").and_then(|s| s.local_addr()).expect("free UDP port").port()
}

/// The `load` object of every backend of `service` in `/v1/status`.
async fn loads(tg: &Tidegate, service: &str) -> Vec<Value> {
    let (status, v) = tg.api("GET", "/v1/status", None).await;
    assert_eq!(status, 200, "{v}");
    let backends = v["services"][service]["backends"].as_array().cloned().unwrap_or_default();
    backends.iter().map(|b| b["load"].clone()).collect()
}

/// Whether every field of a `load` object is a number in 0..=1.
fn all_known(load: &Value) -> bool {
    ["cpu", "memory", "network"].iter().all(|k| load[k].as_f64().is_some_and(|x| (0.0..=1.0).contains(&x)))
}

/// Whether every field of a `load` object is null (unknown).
fn all_unknown(load: &Value) -> bool {
    ["cpu", "memory", "network"].iter().all(|k| load[k].is_null())
}

async fn put_service(tg: &Tidegate, name: &str, backends: &[&Backend], load_metrics: Value) {
    let list: Vec<Value> = backends
        .iter()
        .enumerate()
        .map(|(i, b)| json!({ "id": format!("b{i}"), "addr": b.addr.to_string() }))
        .collect();
    let spec = json!({ "policy": { "kind": "dynamic_feedback" }, "load_metrics": load_metrics, "backends": list });
    let (status, v) = tg.api("PUT", &format!("/v1/services/{name}"), Some(spec)).await;
    assert_eq!(status, 200, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_exporter_load_shows_per_backend_and_expires_when_it_stops() {
    let Some(exporter) = binary("prometheus-node-exporter") else {
        eprintln!("skipping: prometheus-node-exporter is not installed (apt-get install -y prometheus-node-exporter)");
        return;
    };
    let port = free_tcp_port();
    // Only the collectors the source reads; `lo` only, so that the loopback
    // rule is used and the scrapes themselves make network traffic.
    let mut monitor = Monitor::start(Command::new(exporter).args([
        &format!("--web.listen-address=127.0.0.1:{port}"),
        "--log.level=error",
        "--collector.disable-defaults",
        "--collector.cpu",
        "--collector.meminfo",
        "--collector.netdev",
        // The default exclusion of `lo` must be cleared to include it.
        "--collector.netdev.device-exclude=",
        "--collector.netdev.device-include=^lo$",
    ]));
    wait_for("node_exporter listens", Duration::from_secs(10), async || {
        monitor.assert_running("prometheus-node-exporter");
        TcpStream::connect(("127.0.0.1", port)).ok()
    })
    .await;

    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let (b0, b1) = (Backend::start("b0", &[]), Backend::start("b1", &[]));
    let source = json!({ "node_exporter": { "port": port, "interval_ms": 200, "link_bytes_per_s": 1_000_000 } });
    put_service(&tg, "web", &[&b0, &b1], source).await;

    let seen = wait_for("both backends show CPU, memory and network", Duration::from_secs(20), async || {
        let l = loads(&tg, "web").await;
        (l.len() == 2 && l.iter().all(all_known)).then_some(l)
    })
    .await;
    for load in &seen {
        assert!(load["memory"].as_f64().unwrap() > 0.0, "a running machine uses memory: {load}");
    }
    wait_for("loopback traffic shows as network load", Duration::from_secs(10), async || {
        loads(&tg, "web").await.iter().all(|l| l["network"].as_f64().is_some_and(|x| x > 0.0)).then_some(())
    })
    .await;

    // Without the exporter the values go stale: unknown after 3 intervals.
    monitor.stop();
    wait_for("stale values are reset to null", Duration::from_secs(10), async || {
        loads(&tg, "web").await.iter().all(all_unknown).then_some(())
    })
    .await;
}

/// `/etc/ganglia/gmond.conf` turned into a foreground, loopback-only gmond:
/// metrics over UDP to itself on `udp`, the XML dump on TCP `tcp`.
fn gmond_conf(stock: &str, udp: u16, tcp: u16) -> Option<String> {
    let mut conf = stock.replace("daemonize = yes", "daemonize = no").replace("setuid = yes", "setuid = no");
    for (block, body) in [
        ("udp_send_channel {", format!("host = 127.0.0.1\n  port = {udp}\n  ttl = 1")),
        ("udp_recv_channel {", format!("bind = 127.0.0.1\n  port = {udp}")),
        ("tcp_accept_channel {", format!("bind = 127.0.0.1\n  port = {tcp}")),
    ] {
        let start = conf.find(block)?;
        let end = start + conf[start..].find('}')?;
        conf.replace_range(start..=end, &format!("{block}\n  {body}\n}}"));
    }
    Some(conf)
}

/// gmond's XML dump, read from its TCP port.
fn gmond_dump(port: u16) -> Option<String> {
    use std::io::Read;
    let mut conn = TcpStream::connect(("127.0.0.1", port)).ok()?;
    conn.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let mut xml = String::new();
    conn.read_to_string(&mut xml).ok()?;
    Some(xml)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ganglia_load_shows_per_backend_and_is_forgotten_when_the_source_is_removed() {
    let (Some(gmond), Ok(stock)) = (binary("gmond"), std::fs::read_to_string("/etc/ganglia/gmond.conf")) else {
        eprintln!("skipping: gmond is not installed (apt-get install -y ganglia-monitor)");
        return;
    };
    let (udp, tcp) = (free_udp_port(), free_tcp_port());
    let dir = tempfile::tempdir().unwrap();
    let conf_path: &Path = &dir.path().join("gmond.conf");
    std::fs::write(conf_path, gmond_conf(&stock, udp, tcp).expect("gmond.conf has the three channels")).unwrap();
    let mut monitor = Monitor::start(Command::new(gmond).arg("-c").arg(conf_path).arg("-f"));
    // gmond hears its own metrics over UDP before it reports them.
    wait_for("gmond reports cpu_idle", Duration::from_secs(30), async || {
        monitor.assert_running("gmond");
        gmond_dump(tcp).filter(|xml| xml.contains("NAME=\"cpu_idle\""))
    })
    .await;

    let tg = Tidegate::start(&dir.path().join("tidegate"));
    let (b0, b1) = (Backend::start("b0", &[]), Backend::start("b1", &[]));
    let source = json!({ "ganglia": { "addr": format!("127.0.0.1:{tcp}"), "interval_ms": 200 } });
    put_service(&tg, "web", &[&b0, &b1], source).await;
    // One host in the dump: both backends get its values.
    wait_for("both backends show the host's CPU, memory and network", Duration::from_secs(20), async || {
        let l = loads(&tg, "web").await;
        let same = ["cpu", "memory", "network"].iter().all(|k| l.iter().all(|b| b[k] == l[0][k]));
        (l.len() == 2 && l.iter().all(all_known) && same).then_some(())
    })
    .await;

    // The same backends without the source: their values are forgotten.
    put_service(&tg, "web", &[&b0, &b1], json!({})).await;
    wait_for("values are reset to null", Duration::from_secs(10), async || {
        loads(&tg, "web").await.iter().all(all_unknown).then_some(())
    })
    .await;
}
