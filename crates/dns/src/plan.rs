//! What a resolution means for a service's pool: the backends its records
//! name, the operations that bring the pool to them, and when to resolve
//! again. Pure: no IO, no clock.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use tidegate_model::dns::{backend_id, DnsPool};
use tidegate_model::{BackendAddr, BackendSpec, Op, ServiceName, ServiceSpec, Weight};

/// A backend the records name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Found {
    /// Its address.
    pub addr: SocketAddr,
    /// Its weight (1..=10,000).
    pub weight: u32,
    /// Whether it is a backup (an SRV record of a higher priority value
    /// than the lowest).
    pub backup: bool,
}

/// One SRV record with its target's addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SrvTarget {
    /// Lower is preferred.
    pub priority: u16,
    /// Share among the records of one priority.
    pub weight: u16,
    /// The port the target serves on.
    pub port: u16,
    /// The target's addresses.
    pub ips: Vec<IpAddr>,
}

/// The backends of A or AAAA records: every address at `port`, weight 1.
pub fn from_addresses(ips: &[IpAddr], port: u16) -> Vec<Found> {
    let mut found: Vec<Found> =
        ips.iter().map(|ip| Found { addr: SocketAddr::new(*ip, port), weight: 1, backup: false }).collect();
    found.sort();
    found.dedup_by_key(|f| f.addr);
    found
}

/// The backends of SRV records (RFC 2782): each target's addresses at the
/// record's port; the lowest priority's records are primary, the others
/// backups; the record's weight is the backend's, at least 1 (a weight-0
/// record is still used, rarely) and at most 10,000. An address named by
/// two records keeps the preferred one (lower priority, then higher
/// weight). Records whose target has no address, or whose port is 0 ("no
/// service here"), make no backend.
pub fn from_srv(records: &[SrvTarget]) -> Vec<Found> {
    let Some(best) = records.iter().filter(|r| r.port != 0 && !r.ips.is_empty()).map(|r| r.priority).min() else {
        return Vec::new();
    };
    let mut ranked: Vec<(u16, std::cmp::Reverse<u32>, Found)> = Vec::new();
    for r in records.iter().filter(|r| r.port != 0) {
        let weight = u32::from(r.weight).clamp(1, 10_000);
        for ip in &r.ips {
            let found = Found { addr: SocketAddr::new(*ip, r.port), weight, backup: r.priority != best };
            ranked.push((r.priority, std::cmp::Reverse(weight), found));
        }
    }
    ranked.sort();
    let mut found: Vec<Found> = Vec::new();
    for (_, _, f) in ranked {
        if !found.iter().any(|g| g.addr == f.addr) {
            found.push(f);
        }
    }
    found.sort();
    found
}

/// The operations that make `current`'s backends from DNS exactly `found`:
/// a backend put for each address new or changed (weight, backup), one
/// deleted for each address the records no longer name. Backends a user
/// or the autoscaler put are never touched, even at the same address.
pub fn ops(service: &ServiceName, current: &ServiceSpec, found: &[Found]) -> Vec<Op> {
    let mut ops = Vec::new();
    let mut wanted = std::collections::BTreeSet::new();
    for f in found {
        let Some(id) = backend_id(f.addr) else { continue };
        let Ok(addr) = BackendAddr::new(&f.addr.to_string()) else { continue };
        wanted.insert(id.clone());
        let spec = BackendSpec {
            addr,
            weight: Weight::try_from(f.weight).unwrap_or_default(),
            backup: f.backup,
            max_conns: None,
            autoscaled: false,
            dns: true,
        };
        match current.backends.get(&id) {
            // Someone else's backend of the same id: left alone.
            Some(b) if !b.dns => continue,
            // Unchanged (a user may have set max_conns on it: kept).
            Some(b) if b.addr == spec.addr && b.weight == spec.weight && b.backup == spec.backup => continue,
            Some(b) => {
                let spec = BackendSpec { max_conns: b.max_conns, ..spec };
                ops.push(Op::PutBackend { service: service.clone(), id, spec });
            }
            None => ops.push(Op::PutBackend { service: service.clone(), id, spec }),
        }
    }
    for (id, b) in current.backends.iter() {
        if b.dns && !wanted.contains(id) {
            ops.push(Op::DeleteBackend { service: service.clone(), id: id.clone() });
        }
    }
    ops
}

/// The operations that remove every backend from DNS of a service whose
/// `dns` block is gone.
pub fn remove_all(service: &ServiceName, current: &ServiceSpec) -> Vec<Op> {
    ops(service, current, &[])
}

/// How long until the next resolution, after records whose smallest TTL
/// is `ttl`: the TTL within the pool's bounds.
pub fn next_resolution(pool: &DnsPool, ttl: Duration) -> Duration {
    ttl.clamp(Duration::from_secs(pool.min_ttl_s.into()), Duration::from_secs(pool.max_ttl_s.into()))
}

/// How long until trying again after a failed resolution (the server
/// unreachable, SERVFAIL, no records): 5 s within the pool's bounds. The
/// backends resolved before keep serving meanwhile.
pub fn retry_after_failure(pool: &DnsPool) -> Duration {
    next_resolution(pool, Duration::from_secs(5))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidegate_model::BackendId;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn service(backends: serde_json::Value) -> ServiceSpec {
        let v = serde_json::json!({"backends": backends, "dns": {"name": "app.internal", "record": "a", "port": 80}});
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn address_records_are_backends_at_the_port() {
        let found = from_addresses(&[ip("10.0.0.2"), ip("10.0.0.1"), ip("10.0.0.2")], 8080);
        assert_eq!(found.iter().map(|f| f.addr.to_string()).collect::<Vec<_>>(), ["10.0.0.1:8080", "10.0.0.2:8080"]);
        assert!(found.iter().all(|f| f.weight == 1 && !f.backup));
    }

    #[test]
    fn srv_priorities_are_tiers_and_weights_are_kept_within_bounds() {
        let records = [
            SrvTarget { priority: 10, weight: 60, port: 8080, ips: vec![ip("10.0.0.1")] },
            SrvTarget { priority: 10, weight: 0, port: 8081, ips: vec![ip("10.0.0.2"), ip("10.0.0.3")] },
            SrvTarget { priority: 20, weight: 65535, port: 9000, ips: vec![ip("10.0.0.9")] },
            SrvTarget { priority: 5, weight: 1, port: 0, ips: vec![ip("10.0.0.7")] },
            SrvTarget { priority: 1, weight: 1, port: 80, ips: vec![] },
        ];
        let found = from_srv(&records);
        let shown: Vec<(String, u32, bool)> = found.iter().map(|f| (f.addr.to_string(), f.weight, f.backup)).collect();
        assert_eq!(
            shown,
            [
                ("10.0.0.1:8080".to_string(), 60, false),
                ("10.0.0.2:8081".to_string(), 1, false),
                ("10.0.0.3:8081".to_string(), 1, false),
                ("10.0.0.9:9000".to_string(), 10_000, true),
            ]
        );
        // The same address in two records keeps the preferred record.
        let twice = [
            SrvTarget { priority: 20, weight: 5, port: 80, ips: vec![ip("10.0.0.1")] },
            SrvTarget { priority: 10, weight: 1, port: 80, ips: vec![ip("10.0.0.1")] },
        ];
        assert_eq!(from_srv(&twice), vec![Found { addr: "10.0.0.1:80".parse().unwrap(), weight: 1, backup: false }]);
        assert_eq!(from_srv(&[]), vec![]);
    }

    #[test]
    fn the_pool_follows_the_records_and_leaves_other_backends_alone() {
        let name = ServiceName::new("web").unwrap();
        let current = service(serde_json::json!([
            {"id": "dns-10.0.0.1-80", "addr": "10.0.0.1:80", "dns": true, "max_conns": 7},
            {"id": "dns-10.0.0.2-80", "addr": "10.0.0.2:80", "dns": true},
            {"id": "mine", "addr": "10.0.0.3:80"},
            {"id": "dns-10.0.0.4-80", "addr": "10.0.0.4:80"},
        ]));
        let found = from_addresses(&[ip("10.0.0.1"), ip("10.0.0.3"), ip("10.0.0.4")], 80);
        let changes = ops(&name, &current, &found);
        let shown: Vec<String> = changes
            .iter()
            .map(|op| match op {
                Op::PutBackend { id, spec, .. } => format!("put {id} {} dns={}", spec.addr.as_str(), spec.dns),
                Op::DeleteBackend { id, .. } => format!("delete {id}"),
                _ => unreachable!(),
            })
            .collect();
        // 10.0.0.1 unchanged; 10.0.0.3 new (the user's "mine" is another
        // id); 10.0.0.4's id is a user's backend: left; 10.0.0.2 gone.
        assert_eq!(shown, ["put dns-10.0.0.3-80 10.0.0.3:80 dns=true", "delete dns-10.0.0.2-80"]);
        let removed = remove_all(&name, &current);
        assert_eq!(removed.len(), 2, "only the resolver's own: {removed:?}");
        // A changed weight keeps a user's max_conns on the backend.
        let heavier = [Found { addr: "10.0.0.1:80".parse().unwrap(), weight: 5, backup: false }];
        let ops = ops(&name, &current, &heavier);
        let id = BackendId::new("dns-10.0.0.1-80").unwrap();
        assert!(
            ops.iter().any(|op| matches!(op, Op::PutBackend { id: i, spec, .. }
            if *i == id && spec.max_conns.map(|m| m.get()) == Some(7) && spec.weight.get() == 5)),
            "{ops:?}"
        );
    }

    #[test]
    fn resolutions_follow_the_ttl_within_the_pools_bounds() {
        let pool: DnsPool = serde_json::from_value(
            serde_json::json!({"name": "a.b", "record": "a", "port": 1, "min_ttl_s": 2, "max_ttl_s": 60}),
        )
        .unwrap();
        assert_eq!(next_resolution(&pool, Duration::from_secs(0)), Duration::from_secs(2));
        assert_eq!(next_resolution(&pool, Duration::from_secs(30)), Duration::from_secs(30));
        assert_eq!(next_resolution(&pool, Duration::from_secs(3600)), Duration::from_secs(60));
        assert_eq!(retry_after_failure(&pool), Duration::from_secs(5));
    }
}
