//! Validated names and addresses.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// Why a name or an address was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct NameError(String);

const MAX_NAME_LEN: usize = 128;

fn check_name(kind: &str, s: &str) -> Result<(), NameError> {
    if s.is_empty() || s.len() > MAX_NAME_LEN {
        return Err(NameError(format!("{kind} must be 1 to {MAX_NAME_LEN} characters long")));
    }
    if s.chars().all(|c| c == '.') {
        return Err(NameError(format!("{kind} {s:?} must not consist of dots only")));
    }
    if let Some(c) = s.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))) {
        return Err(NameError(format!(
            "{kind} {s:?} contains {c:?}; allowed are ASCII letters, digits, '-', '_' and '.'"
        )));
    }
    Ok(())
}

macro_rules! name_type {
    ($(#[$doc:meta])* $name:ident, $kind:literal) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, schemars::JsonSchema)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(Arc<str>);

        impl $name {
            /// Validates `s` (1..=128 characters of `[A-Za-z0-9._-]`).
            pub fn new(s: &str) -> Result<Self, NameError> {
                check_name($kind, s)?;
                Ok(Self(Arc::from(s)))
            }

            /// The name as a string slice.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl TryFrom<String> for $name {
            type Error = NameError;
            fn try_from(s: String) -> Result<Self, NameError> {
                Self::new(&s)
            }
        }

        impl From<$name> for String {
            fn from(n: $name) -> String {
                n.0.to_string()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&*self.0, f)
            }
        }

        impl std::borrow::Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }
    };
}

name_type!(
    /// The name of a service (a pool of backends).
    ServiceName,
    "service name"
);
name_type!(
    /// The name of a route.
    RouteName,
    "route name"
);
name_type!(
    /// The name of a TLS certificate.
    CertName,
    "certificate name"
);
name_type!(
    /// The name of a rule set (`PUT /v1/rules/{name}`).
    RuleSetName,
    "rule set name"
);
name_type!(
    /// The name of a listener (`PUT /v1/listeners/{name}`); `default`
    /// stands for the default listeners in a route's `listeners`.
    ListenerName,
    "listener name"
);
name_type!(
    /// The id of a backend, unique within its service.
    BackendId,
    "backend id"
);

/// A backend address: `IP:PORT`, `[IPv6]:PORT` or `HOSTNAME:PORT`.
///
/// Always has a port; a hostname is resolved when the proxy connects.
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "String", into = "String")]
pub struct BackendAddr(Arc<str>);

impl BackendAddr {
    /// Validates an address of the form `host:port`.
    pub fn new(s: &str) -> Result<Self, NameError> {
        let bad = |why: &str| NameError(format!("invalid address {s:?}: {why}"));
        if let Ok(a) = s.parse::<std::net::SocketAddr>() {
            return match a.port() {
                0 => Err(bad("port must be 1..65535")),
                _ => Ok(Self(Arc::from(s))),
            };
        }
        let (host, port) = s.rsplit_once(':').ok_or_else(|| bad("expected HOST:PORT"))?;
        match port.parse::<u16>() {
            Ok(0) | Err(_) => return Err(bad("port must be 1..65535")),
            Ok(_) => {}
        }
        if host.is_empty() || host.len() > 253 {
            return Err(bad("host must be 1 to 253 characters"));
        }
        let label_ok = |l: &str| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        };
        // A last label of digits only is no DNS name: resolvers read
        // `2130706433` or `1.2.3` as IPv4 addresses in shorthand.
        let numeric = host.rsplit('.').next().is_some_and(|l| l.bytes().all(|b| b.is_ascii_digit()));
        if !host.split('.').all(label_ok) || numeric {
            return Err(bad("host is neither an IP address nor a DNS name"));
        }
        Ok(Self(Arc::from(s)))
    }

    /// The address as written, `host:port`.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for BackendAddr {
    type Error = NameError;
    fn try_from(s: String) -> Result<Self, NameError> {
        Self::new(&s)
    }
}

impl From<BackendAddr> for String {
    fn from(a: BackendAddr) -> String {
        a.0.to_string()
    }
}

impl fmt::Display for BackendAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for BackendAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_accept_the_allowed_alphabet_only() {
        assert!(ServiceName::new("web-1.prod_a").is_ok());
        assert!(ServiceName::new("").is_err());
        assert!(ServiceName::new("a/b").is_err());
        assert!(ServiceName::new("..").is_err());
        assert!(ServiceName::new(&"x".repeat(129)).is_err());
    }

    #[test]
    fn addresses_need_a_host_and_a_port() {
        for ok in ["127.0.0.1:80", "[::1]:8080", "backend.internal:9000", "localhost:1", "1a.example:80", "web1:80"] {
            assert!(BackendAddr::new(ok).is_ok(), "{ok}");
        }
        for bad in [
            "127.0.0.1",
            "host:0",
            "host:70000",
            ":80",
            "a b:80",
            "-x.com:80",
            "http://x:80",
            "127.0.0.1:0",
            "2130706433:80",
            "1.2.3:80",
            "123:80",
        ] {
            assert!(BackendAddr::new(bad).is_err(), "{bad}");
        }
    }
}
