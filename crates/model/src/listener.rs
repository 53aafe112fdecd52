//! Named listeners: more addresses the proxy serves on besides its
//! default ones (`--listen`, `--listen-tls`), each plain or TLS, with or
//! without the PROXY protocol, and the routes bound to it
//! (`PUT /v1/listeners/{name}`; a route's `"listeners"`).

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::invalid::Invalid;
use crate::rules::Cidr;

/// The name a route uses for the default listeners (`--listen` and
/// `--listen-tls`); no listener may take it.
pub const DEFAULT_LISTENERS: &str = "default";

/// Most networks a listener's PROXY protocol trusts.
const MAX_TRUSTED: usize = 256;

/// One named listener.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "ListenerWire", into = "ListenerWire")]
pub struct ListenerSpec {
    /// Where it listens: `IP:PORT` (a port from 1 to 65535).
    pub addr: SocketAddr,
    /// It terminates TLS, with the configuration's certificates (chosen
    /// by SNI, as on `--listen-tls`).
    pub tls: bool,
    /// Its connections come from TCP load balancers that send the PROXY
    /// protocol: from these networks a connection must start with its
    /// header, and a header from anywhere else closes the connection.
    /// `None`: no PROXY protocol (`--proxy-protocol-from` does not apply
    /// to named listeners).
    pub proxy_protocol: Option<Vec<Cidr>>,
}

/// The JSON form of a listener.
#[derive(Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "ListenerSpec")]
struct ListenerWire {
    /// `IP:PORT` to listen on (`127.0.0.1:8081`, `[::]:8443`).
    addr: String,
    /// TLS with the configuration's certificates. Default false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    tls: bool,
    /// `{"trusted": ["10.0.0.0/8", ...]}`: the balancers that send the
    /// PROXY protocol (v1 or v2) to this listener.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    proxy_protocol: Option<ProxyProtocolWire>,
}

#[derive(Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct ProxyProtocolWire {
    /// The networks of the balancers (1 to 256 in CIDR form).
    trusted: Vec<Cidr>,
}

impl TryFrom<ListenerWire> for ListenerSpec {
    type Error = Invalid;
    fn try_from(w: ListenerWire) -> Result<ListenerSpec, Invalid> {
        let addr: SocketAddr = w.addr.parse().map_err(|_| {
            Invalid::malformed("addr", format!("{:?}", w.addr), "must be IP:PORT (a name is not resolved)")
        })?;
        if addr.port() == 0 {
            return Err(Invalid::range("addr", "a port from 1 to 65535", 0));
        }
        let proxy_protocol = match w.proxy_protocol {
            None => None,
            Some(p) if p.trusted.is_empty() => {
                return Err(Invalid::rule("proxy_protocol.trusted", "names no network: list the balancers' networks"))
            }
            Some(p) if p.trusted.len() > MAX_TRUSTED => {
                return Err(Invalid::too_large(
                    "proxy_protocol.trusted",
                    format!("{MAX_TRUSTED} networks"),
                    Some(p.trusted.len().to_string()),
                ))
            }
            Some(p) => Some(p.trusted),
        };
        Ok(ListenerSpec { addr, tls: w.tls, proxy_protocol })
    }
}

impl From<ListenerSpec> for ListenerWire {
    fn from(s: ListenerSpec) -> ListenerWire {
        ListenerWire {
            addr: s.addr.to_string(),
            tls: s.tls,
            proxy_protocol: s.proxy_protocol.map(|trusted| ProxyProtocolWire { trusted }),
        }
    }
}

impl ListenerSpec {
    /// Whether connections from `ip` must start with a PROXY protocol
    /// header.
    pub fn trusts(&self, ip: std::net::IpAddr) -> bool {
        self.proxy_protocol.as_ref().is_some_and(|nets| nets.iter().any(|n| n.contains(ip)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<ListenerSpec, String> {
        crate::parse_json::<ListenerSpec>(json.as_bytes()).map_err(|e| e.to_string())
    }

    #[test]
    fn a_listener_is_read_and_written_back() {
        let l = parse(r#"{"addr":"127.0.0.1:8081","tls":true,"proxy_protocol":{"trusted":["10.0.0.0/8"]}}"#).unwrap();
        assert_eq!(l.addr, "127.0.0.1:8081".parse().unwrap());
        assert!(l.tls && l.trusts("10.1.2.3".parse().unwrap()) && !l.trusts("192.0.2.1".parse().unwrap()));
        let back = serde_json::to_string(&l).unwrap();
        assert_eq!(back, r#"{"addr":"127.0.0.1:8081","tls":true,"proxy_protocol":{"trusted":["10.0.0.0/8"]}}"#);
        let plain = parse(r#"{"addr":"[::1]:9000"}"#).unwrap();
        assert!(!plain.tls && plain.proxy_protocol.is_none() && !plain.trusts("::1".parse().unwrap()));
    }

    #[test]
    fn bad_listeners_name_the_field() {
        for (json, field) in [
            (r#"{"addr":"localhost:80"}"#, "addr"),
            (r#"{"addr":"127.0.0.1:0"}"#, "addr"),
            (r#"{"addr":"127.0.0.1"}"#, "addr"),
            (r#"{"addr":"127.0.0.1:80","proxy_protocol":{"trusted":[]}}"#, "proxy_protocol.trusted"),
            (r#"{"addr":"127.0.0.1:80","proxy_protocol":{"trusted":["10.0.0.1/40"]}}"#, "proxy_protocol.trusted[0]"),
            (r#"{"addr":"127.0.0.1:80","tls":"yes"}"#, "tls"),
            (r#"{"addr":"127.0.0.1:80","other":1}"#, "other"),
        ] {
            let e = parse(json).unwrap_err();
            assert!(e.contains(field), "{json}: {e}");
        }
    }
}
