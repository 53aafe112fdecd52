//! Pools from DNS: a service's `dns` block names a DNS name whose A, AAAA
//! or SRV records are its backends (the `tidegate-dns` crate resolves
//! them and writes the backends through the change log, marked `dns`).

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::invalid::Invalid;
use crate::names::BackendId;

/// Which records make the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum DnsRecord {
    /// IPv4 addresses, each a backend at `port`.
    A,
    /// IPv6 addresses, each a backend at `port`.
    Aaaa,
    /// Service records (`_http._tcp.app.internal`): each target's
    /// addresses at the record's port; the records of the lowest priority
    /// are the primary backends and the others backups; the record's
    /// weight is the backend's (at most 10,000, at least 1).
    Srv,
}

/// A service's pool from DNS (`"dns": {...}` in the service's body).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DnsPool {
    /// The name to resolve (`app.internal`, `_http._tcp.app.internal`);
    /// a trailing dot makes it absolute, otherwise resolv.conf's search
    /// domains apply. At most 253 characters of letters, digits, `-` and
    /// `_`, in dot-separated labels.
    pub name: String,
    /// `a`, `aaaa` or `srv`.
    pub record: DnsRecord,
    /// The backends' port, for `a` and `aaaa` (1..=65535); SRV records
    /// carry their own, so it is refused with `srv`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// Least seconds between two resolutions, whatever the records' TTL
    /// (1..=3600, default 1).
    #[serde(default = "default_min_ttl")]
    pub min_ttl_s: u32,
    /// Most seconds between two resolutions, whatever the records' TTL
    /// (at least `min_ttl_s`, at most 86,400; default 300).
    #[serde(default = "default_max_ttl")]
    pub max_ttl_s: u32,
}

fn default_min_ttl() -> u32 {
    1
}

fn default_max_ttl() -> u32 {
    300
}

impl DnsPool {
    /// Checks the fields; errors name `dns.FIELD`.
    pub(crate) fn validate(&self) -> Result<(), Invalid> {
        let name = self.name.strip_suffix('.').unwrap_or(&self.name);
        let label_ok = |l: &str| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        };
        if name.is_empty() || name.len() > 253 || !name.split('.').all(label_ok) {
            return Err(Invalid::malformed("dns.name", format!("{:?}", self.name), "is not a DNS name"));
        }
        match (self.record, self.port) {
            (DnsRecord::A | DnsRecord::Aaaa, None) => {
                return Err(Invalid::rule("dns.port", "is required with `a` and `aaaa` records"));
            }
            (DnsRecord::A | DnsRecord::Aaaa, Some(0)) => return Err(Invalid::range("dns.port", "1..=65535", 0)),
            (DnsRecord::Srv, Some(_)) => {
                return Err(Invalid::rule("dns.port", "is not given with `srv` records: they carry their ports"));
            }
            _ => {}
        }
        if !(1..=3600).contains(&self.min_ttl_s) {
            return Err(Invalid::range("dns.min_ttl_s", "1..=3600", self.min_ttl_s));
        }
        if self.max_ttl_s < self.min_ttl_s || self.max_ttl_s > 86_400 {
            return Err(Invalid::range("dns.max_ttl_s", format!("{}..=86400", self.min_ttl_s), self.max_ttl_s));
        }
        Ok(())
    }
}

/// The id of the backend a DNS pool makes for `addr`: `dns-IP-PORT`, with
/// an IPv6 address's colons as underscores (`dns-2001_db8__1-8080`). The
/// same address always gets the same id, so what the proxy learned about
/// it (health, in-flight count, learned limit, latency) carries over from
/// one resolution to the next. (None cannot happen: an IP address and a
/// port make a valid id.)
pub fn backend_id(addr: SocketAddr) -> Option<BackendId> {
    let ip = addr.ip().to_string().replace(':', "_");
    BackendId::new(&format!("dns-{ip}-{}", addr.port())).ok()
}

/// Whether two pools resolve the same records (their TTL bounds aside).
fn same_records(a: &DnsPool, b: &DnsPool) -> bool {
    a.name.trim_end_matches('.').eq_ignore_ascii_case(b.name.trim_end_matches('.'))
        && a.record == b.record
        && a.port == b.port
}

/// A service put again (through the API or a configuration file) keeps
/// the backends resolved for it while its `dns` block names the same
/// records, unless the new spec lists a backend of the same id: they are
/// the resolver's, which a user's document does not list.
pub(crate) fn keep_resolved(previous: &crate::ServiceSpec, spec: &mut crate::ServiceSpec) {
    let (Some(old), Some(new)) = (&previous.settings.dns, &spec.settings.dns) else { return };
    if !same_records(old, new) {
        return;
    }
    for (id, b) in previous.backends.iter().filter(|(_, b)| b.dns) {
        if !spec.backends.contains_key(id) {
            spec.backends.insert(id.clone(), b.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(v: serde_json::Value) -> Result<DnsPool, Invalid> {
        let p: DnsPool = serde_json::from_value(v).expect("decodes");
        p.validate().map(|()| p)
    }

    #[test]
    fn a_pool_needs_a_name_and_a_port_only_for_address_records() {
        let p = pool(serde_json::json!({"name": "app.internal", "record": "a", "port": 8080})).unwrap();
        assert_eq!((p.min_ttl_s, p.max_ttl_s), (1, 300));
        pool(serde_json::json!({"name": "_http._tcp.app.internal.", "record": "srv"})).unwrap();
        let field = |v| pool(v).unwrap_err().field;
        assert_eq!(field(serde_json::json!({"name": "app.internal", "record": "aaaa"})), "dns.port");
        assert_eq!(field(serde_json::json!({"name": "_x._tcp.a", "record": "srv", "port": 80})), "dns.port");
        assert_eq!(field(serde_json::json!({"name": "bad name", "record": "a", "port": 1})), "dns.name");
        assert_eq!(field(serde_json::json!({"name": "a..b", "record": "a", "port": 1})), "dns.name");
        assert_eq!(field(serde_json::json!({"name": "-a.b", "record": "a", "port": 1})), "dns.name");
        let ttl = serde_json::json!({"name": "a.b", "record": "a", "port": 1, "min_ttl_s": 10, "max_ttl_s": 5});
        assert_eq!(field(ttl), "dns.max_ttl_s");
        let ttl = serde_json::json!({"name": "a.b", "record": "a", "port": 1, "min_ttl_s": 0});
        assert_eq!(field(ttl), "dns.min_ttl_s");
    }

    #[test]
    fn an_address_always_gets_the_same_valid_id() {
        assert_eq!(backend_id("10.0.0.5:8080".parse().unwrap()).unwrap().as_str(), "dns-10.0.0.5-8080");
        assert_eq!(backend_id("[2001:db8::1]:80".parse().unwrap()).unwrap().as_str(), "dns-2001_db8__1-80");
    }
}
