//! Pools from DNS against a real DNS server on loopback: Debian's
//! `dnsmasq`, started here on its own port with its own hosts file (A
//! records, changed and reloaded with SIGHUP) and SRV records; Tidegate
//! resolves through it (`--resolver`), alone and as two instances of a
//! cluster on a real etcd.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use crate::support::*;

/// dnsmasq, killed on drop.
struct Dnsmasq {
    child: Option<Child>,
    port: u16,
}

impl Dnsmasq {
    /// Answers from `hosts` (re-read on SIGHUP) and `extra` options, with
    /// a TTL of 1 s.
    async fn start(dir: &Path, hosts: &Path, extra: &[String]) -> Dnsmasq {
        // dnsmasq listens on UDP and TCP, on a port chosen here: another
        // test may take it in between, and dnsmasq then exits at once; it
        // is started again on another port.
        for _ in 0..5 {
            let port = loop {
                let udp = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
                let port = udp.local_addr().expect("addr").port();
                if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                    break port;
                }
            };
            let mut cmd = Command::new("dnsmasq");
            cmd.args([
                "--keep-in-foreground",
                "--conf-file=/dev/null",
                "--no-resolv",
                "--no-hosts",
                "--bind-interfaces",
            ])
            .args(["--listen-address=127.0.0.1", "--local-ttl=1", "--user=root", "--log-facility=-"])
            .arg(format!("--port={port}"))
            .arg(format!("--addn-hosts={}", hosts.display()))
            .arg(format!("--pid-file={}", dir.join("dnsmasq.pid").display()))
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
            let mut child = cmd.spawn().expect("dnsmasq (apt-get install dnsmasq-base)");
            let up = wait_for("dnsmasq listens or exits", Duration::from_secs(20), async || {
                if let Ok(Some(_)) = child.try_wait() {
                    return Some(false);
                }
                tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok().map(|_| true)
            })
            .await;
            if up {
                return Dnsmasq { child: Some(child), port };
            }
        }
        panic!("dnsmasq did not start on any of five free ports");
    }

    /// Makes it read its hosts file again.
    fn reload(&self) {
        let pid = self.child.as_ref().expect("running").id();
        let ok = Command::new("kill").args(["-HUP", &pid.to_string()]).status().expect("kill").success();
        assert!(ok, "SIGHUP to dnsmasq");
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Dnsmasq {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The service's backends as `/v1/status` shows them: (id, addr, backup,
/// dns, requests).
async fn backends(tg: &Tidegate, service: &str) -> Vec<(String, String, bool, bool, u64)> {
    let (_, status) = tg.api("GET", "/v1/status", None).await;
    status["services"][service]["backends"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|b| {
            (
                b["id"].as_str().unwrap_or("").to_string(),
                b["addr"].as_str().unwrap_or("").to_string(),
                b["backup"].as_bool().unwrap_or(false),
                b["dns"].as_bool().unwrap_or(false),
                b["requests"].as_u64().unwrap_or(0),
            )
        })
        .collect()
}

async fn addrs_become(tg: &Tidegate, service: &str, want: &[String]) {
    let want: BTreeSet<String> = want.iter().cloned().collect();
    wait_for(&format!("{service}'s pool is {want:?}"), Duration::from_secs(30), async || {
        let got: BTreeSet<String> = backends(tg, service).await.into_iter().map(|b| b.1).collect();
        (got == want).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_follows_a_and_srv_records_drops_nothing_and_keeps_its_set_when_the_server_fails() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A records: three emulators on one port, at 127.0.0.1, .2 and .3.
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
    let listen = |ip: &str| format!("{ip}:{port}");
    let a: Vec<Backend> = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
        .iter()
        .enumerate()
        .map(|(i, ip)| Backend::start(&format!("a{}", i + 1), &["--listen", &listen(ip)]))
        .collect();
    // SRV records: two emulators, priority 10 (weight 5) and 20.
    let (s1, s2) = (Backend::start("s1", &[]), Backend::start("s2", &[]));
    let hosts = dir.path().join("hosts");
    std::fs::write(&hosts, "127.0.0.1 app.test\n127.0.0.2 app.test\n").expect("write");
    let srv = vec![
        format!("--srv-host=_http._tcp.app.test,t1.app.test,{},10,5", s1.addr.port()),
        format!("--srv-host=_http._tcp.app.test,t2.app.test,{},20,1", s2.addr.port()),
        "--host-record=t1.app.test,127.0.0.1".to_string(),
        "--host-record=t2.app.test,127.0.0.1".to_string(),
    ];
    let mut dns = Dnsmasq::start(dir.path(), &hosts, &srv).await;
    let resolver = format!("127.0.0.1:{}", dns.port);
    let tg = Arc::new(Tidegate::start_with(&dir.path().join("tg"), &["--resolver", &resolver]));

    let pool = json!({"dns": {"name": "app.test.", "record": "a", "port": port, "min_ttl_s": 1, "max_ttl_s": 2}});
    let (s, v) = tg.api("PUT", "/v1/services/web", Some(pool.clone())).await;
    assert_eq!(s, 200, "{v}");
    let route = json!({"match": {"path_prefix": "/"}, "service": "web"});
    let (s, v) = tg.api("PUT", "/v1/routes/web", Some(route)).await;
    assert_eq!(s, 200, "{v}");
    addrs_become(&tg, "web", &[listen("127.0.0.1"), listen("127.0.0.2")]).await;
    let pool_now = backends(&tg, "web").await;
    assert!(pool_now.iter().all(|b| b.3 && b.0 == format!("dns-{}", b.1.replace(':', "-"))), "{pool_now:?}");
    let (_, status) = tg.api("GET", "/v1/status", None).await;
    let d = &status["services"]["web"]["dns"];
    assert_eq!((d["name"].as_str(), d["error"].is_null()), (Some("app.test."), true), "{status}");

    // Load all along: not one request may fail.
    let load = Requests::start(tg.url("/"));
    load.more(50, "requests flow").await;
    let before_change = backends(&tg, "web").await;
    let requests_of =
        |set: &[(String, String, bool, bool, u64)], addr: &str| set.iter().find(|b| b.1 == addr).map_or(0, |b| b.4);

    // 127.0.0.1 goes, 127.0.0.3 comes: followed, and 127.0.0.2 keeps its
    // identity (its request count goes on from where it was).
    std::fs::write(&hosts, "127.0.0.2 app.test\n127.0.0.3 app.test\n").expect("write");
    dns.reload();
    addrs_become(&tg, "web", &[listen("127.0.0.2"), listen("127.0.0.3")]).await;
    load.more(50, "requests reach the new set").await;
    let after_change = backends(&tg, "web").await;
    assert!(
        requests_of(&after_change, &listen("127.0.0.2")) >= requests_of(&before_change, &listen("127.0.0.2")),
        "the address kept its statistics: {before_change:?} then {after_change:?}"
    );

    // The SRV pool: priorities are tiers, weights kept.
    let srv_pool = json!({"dns": {"name": "_http._tcp.app.test.", "record": "srv", "min_ttl_s": 1, "max_ttl_s": 2}});
    let (s, v) = tg.api("PUT", "/v1/services/srv", Some(srv_pool)).await;
    assert_eq!(s, 200, "{v}");
    addrs_become(&tg, "srv", &[s1.addr.to_string(), s2.addr.to_string()]).await;
    let (_, status) = tg.api("GET", "/v1/status", None).await;
    let shown: Vec<(String, u64, bool)> = status["services"]["srv"]["backends"]
        .as_array()
        .expect("backends")
        .iter()
        .map(|b| (b["addr"].as_str().unwrap_or("").to_string(), b["weight"].as_u64().unwrap_or(0), b["backup"] == true))
        .collect();
    assert!(
        shown.contains(&(s1.addr.to_string(), 5, false)) && shown.contains(&(s2.addr.to_string(), 1, true)),
        "{shown:?}"
    );

    // A PUT of the service that keeps its block keeps the resolved pool.
    let (s, v) = tg.api("PUT", "/v1/services/web", Some(pool)).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(backends(&tg, "web").await.len(), 2, "the resolved backends stay through a PUT");

    // The server stops: the last good set keeps serving, and status says why.
    dns.stop();
    wait_for("the failure shows", Duration::from_secs(30), async || {
        let (_, status) = tg.api("GET", "/v1/status", None).await;
        status["services"]["web"]["dns"]["error"].as_str().map(|_| ())
    })
    .await;
    load.more(50, "requests go on without DNS").await;
    let addrs: BTreeSet<String> = backends(&tg, "web").await.into_iter().map(|b| b.1).collect();
    assert_eq!(addrs, [listen("127.0.0.2"), listen("127.0.0.3")].into_iter().collect::<BTreeSet<_>>());
    let (ok, failed) = load.stop().await;
    assert_eq!(failed, 0, "requests failed while the pool changed ({ok} succeeded)");
    let metrics = send("GET", &tg.admin_url("/metrics"), Some(TOKEN), vec![], &[]).await.text();
    for line in ["tidegate_dns_stale{service=\"web\"} 1", "tidegate_dns_addresses{service=\"srv\"} 2"] {
        assert!(metrics.contains(line), "{line} in {metrics}");
    }

    // A bad block is refused with the field at fault.
    let bad = json!({"dns": {"name": "app.test", "record": "a"}});
    let (s, v) = tg.api("PUT", "/v1/services/bad", Some(bad)).await;
    assert_eq!((s, v["error"]["field"].as_str()), (400, Some("spec.dns.port")), "{v}");
    drop(a);
}

/// This instance's count of resolutions of `service`'s name (0 when it
/// does not resolve it).
async fn resolutions(tg: &Tidegate, service: &str) -> u64 {
    let (_, status) = tg.api("GET", "/v1/status", None).await;
    status["services"][service]["dns"]["resolutions"].as_u64().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_cluster_one_instance_resolves_every_instance_serves_the_set_and_another_takes_over() {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
    let listen = |ip: &str| format!("{ip}:{port}");
    let _backends: Vec<Backend> = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
        .iter()
        .enumerate()
        .map(|(i, ip)| Backend::start(&format!("c{}", i + 1), &["--listen", &listen(ip)]))
        .collect();
    let hosts = dir.path().join("hosts");
    std::fs::write(&hosts, "127.0.0.1 app.test\n127.0.0.2 app.test\n").expect("write");
    let dns = Dnsmasq::start(dir.path(), &hosts, &[]).await;
    let resolver = format!("127.0.0.1:{}", dns.port);
    let etcd = crate::cluster::Etcd::start(1);
    let store = etcd.url(&[0], "tg");
    let (a, _da) = crate::cluster::instance(&store, &["--instance-name", "a", "--resolver", &resolver]);
    let (b, _db) = crate::cluster::instance(&store, &["--instance-name", "b", "--resolver", &resolver]);

    let pool = json!({"dns": {"name": "app.test.", "record": "a", "port": port, "min_ttl_s": 1, "max_ttl_s": 2}});
    let (s, v) = a.api("PUT", "/v1/services/web", Some(pool)).await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = a.api("PUT", "/v1/routes/web", Some(json!({"match": {"path_prefix": "/"}, "service": "web"}))).await;
    assert_eq!(s, 200, "{v}");
    let first = [listen("127.0.0.1"), listen("127.0.0.2")];
    for tg in [&a, &b] {
        addrs_become(tg, "web", &first).await;
        assert_eq!(get(&tg.url("/")).await.status, 200);
    }

    // One instance resolves (the role's lease), for both: after several
    // of its resolutions the other has made none.
    let a_resolves = wait_for("one instance resolves", Duration::from_secs(20), async || {
        match (resolutions(&a, "web").await, resolutions(&b, "web").await) {
            (n, 0) if n >= 3 => Some(true),
            (0, n) if n >= 3 => Some(false),
            (x, y) if x > 0 && y > 0 => panic!("both instances resolve: {x} and {y}"),
            _ => None,
        }
    })
    .await;

    // A record set changed at the server reaches both.
    std::fs::write(&hosts, "127.0.0.2 app.test\n127.0.0.3 app.test\n").expect("write");
    dns.reload();
    let second = [listen("127.0.0.2"), listen("127.0.0.3")];
    for tg in [&a, &b] {
        addrs_become(tg, "web", &second).await;
    }

    // The resolving instance dies: the other takes the role over (its
    // lease runs out) and follows the next change alone.
    let (resolving, other) = if a_resolves { (a, b) } else { (b, a) };
    assert_eq!(resolutions(&other, "web").await, 0, "the other instance does not resolve");
    resolving.kill9();
    std::fs::write(&hosts, "127.0.0.1 app.test\n127.0.0.3 app.test\n").expect("write");
    dns.reload();
    addrs_become(&other, "web", &[listen("127.0.0.1"), listen("127.0.0.3")]).await;
    assert!(resolutions(&other, "web").await > 0, "the survivor resolves now");
    assert_eq!(get(&other.url("/")).await.status, 200);
}
