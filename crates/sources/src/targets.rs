//! What to poll, derived from a snapshot: one `node_exporter` target per
//! distinct (backend host, port) and one Ganglia target per gmond address,
//! each with the backends it feeds.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tidegate_balance::BackendStats;
use tidegate_snapshot::Snapshot;

/// A backend fed by a source, with the link capacity of its service.
#[derive(Debug, Clone)]
pub(crate) struct Sink {
    pub stats: Arc<BackendStats>,
    pub link_bytes_per_s: u64,
}

/// A `node_exporter` to scrape and the backends on its host.
#[derive(Debug)]
pub(crate) struct NodeTarget {
    /// The shortest interval any service asks for.
    pub interval: Duration,
    pub sinks: Vec<Sink>,
}

/// The backends of one service fed by a gmond.
#[derive(Debug)]
pub(crate) struct GangliaGroup {
    /// Each backend with its host (brackets of IPv6 literals removed).
    pub backends: Vec<(String, Sink)>,
}

/// A gmond to poll and the services it feeds.
#[derive(Debug)]
pub(crate) struct GangliaTarget {
    pub interval: Duration,
    pub groups: Vec<GangliaGroup>,
}

/// `host:port` of a `node_exporter`; the host as written in the backends'
/// addresses (lower-cased), IPv6 literals in brackets.
pub(crate) type NodeKey = (String, u16);

/// Every source target of a snapshot.
#[derive(Debug, Default)]
pub(crate) struct Targets {
    pub node: HashMap<NodeKey, NodeTarget>,
    pub ganglia: HashMap<SocketAddr, GangliaTarget>,
}

/// The host part of `host:port`.
pub(crate) fn host_of(addr: &str) -> &str {
    addr.rsplit_once(':').map_or(addr, |(host, _)| host)
}

impl Targets {
    /// The targets of every service that configures a source.
    pub fn of(snapshot: &Snapshot) -> Targets {
        let mut t = Targets::default();
        for service in snapshot.services() {
            let sources = &service.settings.load_metrics;
            let backends = service.selector.backends();
            if let Some(ne) = &sources.node_exporter {
                let interval = Duration::from_millis(ne.interval_ms.max(1));
                for b in backends {
                    let key = (host_of(b.addr.as_str()).to_ascii_lowercase(), ne.port);
                    let target = t.node.entry(key).or_insert_with(|| NodeTarget { interval, sinks: Vec::new() });
                    target.interval = target.interval.min(interval);
                    target.sinks.push(Sink { stats: b.stats.clone(), link_bytes_per_s: ne.link_bytes_per_s });
                }
            }
            if let Some(g) = sources.ganglia.as_ref().filter(|_| !backends.is_empty()) {
                let interval = Duration::from_millis(g.interval_ms.max(1));
                let target = t.ganglia.entry(g.addr).or_insert_with(|| GangliaTarget { interval, groups: Vec::new() });
                target.interval = target.interval.min(interval);
                let backends = backends
                    .iter()
                    .map(|b| {
                        let host = host_of(b.addr.as_str()).trim_start_matches('[').trim_end_matches(']');
                        (host.to_string(), Sink { stats: b.stats.clone(), link_bytes_per_s: g.link_bytes_per_s })
                    })
                    .collect();
                target.groups.push(GangliaGroup { backends });
            }
        }
        t
    }

    /// Every backend some target feeds, keyed by the stats' address.
    pub fn fed(&self) -> HashMap<usize, Arc<BackendStats>> {
        let node = self.node.values().flat_map(|t| t.sinks.iter());
        let ganglia = self.ganglia.values().flat_map(|t| t.groups.iter().flat_map(|g| g.backends.iter().map(|b| &b.1)));
        node.chain(ganglia).map(|s| (Arc::as_ptr(&s.stats) as usize, s.stats.clone())).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::snapshot_of;

    #[test]
    fn hosts_are_deduplicated_across_services_and_backends() {
        let snap = snapshot_of(
            r#"{"ops":[
            {"op":"put_service","name":"a","spec":{
                "load_metrics":{"node_exporter":{"port":9100,"interval_ms":1000,"link_bytes_per_s":10}},
                "backends":[{"id":"x","addr":"127.0.0.1:1"},{"id":"y","addr":"127.0.0.1:2"},
                            {"id":"z","addr":"[::1]:3"},{"id":"w","addr":"Web.internal:4"}]}},
            {"op":"put_service","name":"b","spec":{
                "load_metrics":{"node_exporter":{"port":9100,"interval_ms":200},
                                "ganglia":{"addr":"127.0.0.1:8649"}},
                "backends":[{"id":"x","addr":"127.0.0.1:5"},{"id":"y","addr":"[::1]:6"}]}},
            {"op":"put_service","name":"c","spec":{"backends":[{"id":"x","addr":"127.0.0.1:7"}]}},
            {"op":"put_service","name":"d","spec":{"load_metrics":{"ganglia":{"addr":"127.0.0.1:8649"}}}}
            ]}"#,
        );
        let t = Targets::of(&snap);
        let mut keys: Vec<_> = t.node.keys().cloned().collect();
        keys.sort();
        let want = [("127.0.0.1", 9100), ("[::1]", 9100), ("web.internal", 9100)];
        assert_eq!(keys, want.map(|(h, p)| (h.to_string(), p)));
        let local = &t.node[&("127.0.0.1".to_string(), 9100)];
        assert_eq!(local.sinks.len(), 3);
        assert_eq!(local.interval, Duration::from_millis(200), "the shortest interval wins");
        let links: Vec<u64> = local.sinks.iter().map(|s| s.link_bytes_per_s).collect();
        assert!(links.contains(&10) && links.contains(&125_000_000), "{links:?}");
        let g = &t.ganglia[&"127.0.0.1:8649".parse().unwrap()];
        assert_eq!(g.groups.len(), 1, "a service without backends adds nothing");
        let hosts: Vec<&str> = g.groups[0].backends.iter().map(|b| b.0.as_str()).collect();
        assert_eq!(hosts, ["127.0.0.1", "::1"]);
        assert_eq!(t.fed().len(), 6, "every backend of a and b, once");
    }
}
