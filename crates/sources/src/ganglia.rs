//! The Ganglia poller: one task per gmond address, mapping the hosts of its
//! XML dump onto the backends of the services that use it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tidegate_balance::clock;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::gmond::{self, GmondHost};
use crate::load::HostLoad;
use crate::targets::GangliaTarget;
use crate::throttle::Throttle;
use crate::{expire_all, poll_timeout};

const SOURCE: &str = "ganglia";

/// A dump larger than this is refused (about 4.5 KB per host: a
/// 1,000-host cluster's dump is under 5 MiB). The whole dump is held while
/// it is parsed, so this bounds the memory a hostile gmond can take.
const MAX_DUMP: u64 = 8 << 20;

/// Polls the gmond at `addr` every interval until aborted.
pub(crate) async fn run(addr: SocketAddr, mut target: watch::Receiver<Arc<GangliaTarget>>) {
    let name = addr.to_string();
    let mut throttle = Throttle::default();
    loop {
        let t = target.borrow_and_update().clone();
        let started = Instant::now();
        match fetch(addr, poll_timeout(t.interval)).await {
            Ok(hosts) => {
                apply(&t, &hosts, clock::now_ms());
                throttle.success(SOURCE, &name);
            }
            Err(e) => throttle.failure(SOURCE, &name, &e.to_string()),
        }
        expire_all(t.groups.iter().flat_map(|g| g.backends.iter().map(|b| &b.1)), t.interval);
        tokio::time::sleep_until(started + t.interval).await;
    }
}

/// Why a gmond dump could not be had.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FetchError {
    /// gmond could not be reached.
    #[error("connect: {0}")]
    Connect(#[source] std::io::Error),
    /// The connection failed while the dump was read.
    #[error("read: {0}")]
    Read(#[source] std::io::Error),
    /// The dump is larger than [`MAX_DUMP`].
    #[error("the dump exceeds {MAX_DUMP} bytes")]
    TooLarge,
    /// The dump did not end within the time allowed.
    #[error("no complete dump within {0:?}")]
    TimedOut(Duration),
    /// The dump names no host.
    #[error("the dump has no HOST")]
    NoHost,
}

/// Reads one whole dump (gmond closes the connection after it).
async fn fetch(addr: SocketAddr, timeout: Duration) -> Result<Vec<GmondHost>, FetchError> {
    let read = async {
        let stream = TcpStream::connect(addr).await.map_err(FetchError::Connect)?;
        let mut xml = Vec::new();
        stream.take(MAX_DUMP + 1).read_to_end(&mut xml).await.map_err(FetchError::Read)?;
        if xml.len() as u64 > MAX_DUMP {
            return Err(FetchError::TooLarge);
        }
        Ok(xml)
    };
    let xml = tokio::time::timeout(timeout, read).await.map_err(|_| FetchError::TimedOut(timeout))??;
    let hosts = gmond::parse(&xml);
    if hosts.is_empty() {
        return Err(FetchError::NoHost);
    }
    Ok(hosts)
}

/// Writes each host's load into the backends on it: a backend matches the
/// host whose `IP` or `NAME` (case-insensitive) is its address's host part.
/// A dump with a single host applies to every backend of every service (so
/// that one gmond can stand for a one-machine deployment). Hosts gmond
/// considers down are skipped, which lets their backends' values expire.
pub(crate) fn apply(target: &GangliaTarget, hosts: &[GmondHost], now_ms: u64) {
    let loads: Vec<HostLoad> =
        hosts.iter().map(|h| if h.is_up() { HostLoad::from_gmond(h) } else { HostLoad::default() }).collect();
    let mut index: HashMap<String, usize> = HashMap::with_capacity(hosts.len() * 2);
    for (i, h) in hosts.iter().enumerate() {
        index.entry(h.ip.clone()).or_insert(i);
        index.entry(h.name.to_ascii_lowercase()).or_insert(i);
    }
    for group in &target.groups {
        for (host, sink) in &group.backends {
            let found = if hosts.len() == 1 {
                Some(0)
            } else {
                index.get(host).or_else(|| index.get(&host.to_ascii_lowercase())).copied()
            };
            if let Some(i) = found {
                loads[i].write(&sink.stats.load, sink.link_bytes_per_s, now_ms);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::targets::{GangliaGroup, Sink};
    use tokio::io::AsyncWriteExt;

    /// A gmond at a fresh address that writes `dump` to each of `n`
    /// connections and closes them.
    async fn gmond(dump: &'static [u8], n: usize) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            for _ in 0..n {
                let Ok((mut conn, _)) = listener.accept().await else { return };
                let _ = conn.write_all(dump).await;
            }
        });
        addr
    }

    #[tokio::test]
    async fn fetch_says_why_there_is_no_dump() {
        // Bound and never listening, held to the end: refused, and no
        // listener of a test running beside can take the port.
        let held = tokio::net::TcpSocket::new_v4().unwrap();
        held.bind(([127, 0, 0, 1], 0).into()).unwrap();
        let closed = held.local_addr().unwrap();
        let e = fetch(closed, Duration::from_secs(2)).await.unwrap_err();
        assert!(matches!(e, FetchError::Connect(_)), "{e:?}");
        let empty = gmond(b"<GANGLIA_XML></GANGLIA_XML>", 1).await;
        assert!(matches!(fetch(empty, Duration::from_secs(2)).await, Err(FetchError::NoHost)));
        let one =
            gmond(br#"<GANGLIA_XML><CLUSTER><HOST NAME="a" IP="10.0.0.1"></HOST></CLUSTER></GANGLIA_XML>"#, 1).await;
        assert_eq!(fetch(one, Duration::from_secs(2)).await.unwrap().len(), 1);
    }

    fn sink(link: u64) -> Sink {
        Sink { stats: Arc::default(), link_bytes_per_s: link }
    }

    fn host(name: &str, ip: &str, idle: f64) -> GmondHost {
        GmondHost {
            name: name.into(),
            ip: ip.into(),
            cpu_idle: Some(idle),
            bytes_in: Some(500.0),
            ..Default::default()
        }
    }

    fn target(hosts: &[&str]) -> GangliaTarget {
        let backends = hosts.iter().map(|h| (h.to_string(), sink(1000))).collect();
        GangliaTarget { interval: Duration::from_secs(1), groups: vec![GangliaGroup { backends }] }
    }

    fn cpus(t: &GangliaTarget) -> Vec<f64> {
        t.groups[0].backends.iter().map(|b| b.1.stats.load.cpu.get()).collect()
    }

    #[test]
    fn hosts_map_to_backends_by_ip_or_name() {
        let t = target(&["10.0.0.1", "WEB-2", "10.0.0.9", "down"]);
        let mut dead = host("down", "10.0.0.4", 0.0);
        (dead.tn, dead.tmax) = (Some(500.0), Some(20.0));
        apply(&t, &[host("web-1", "10.0.0.1", 75.0), host("web-2", "10.0.0.2", 50.0), dead], 10);
        let c = cpus(&t);
        assert_eq!(&c[..2], &[0.25, 0.5]);
        assert!(c[2].is_nan(), "no host for 10.0.0.9");
        assert!(c[3].is_nan(), "a host gmond considers down feeds nothing");
        assert_eq!(t.groups[0].backends[0].1.stats.load.network.get(), 0.5);
    }

    #[test]
    fn a_single_host_dump_feeds_every_backend() {
        let t = target(&["127.0.0.1", "other"]);
        apply(&t, &[host("localhost", "192.168.1.1", 90.0)], 10);
        let c = cpus(&t);
        assert!(c.iter().all(|&x| (x - 0.1).abs() < 1e-12), "{c:?}");
    }
}
