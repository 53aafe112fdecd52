//! Services: a pool of backends, a balancing policy and timeouts.

use std::fmt;

use imbl::OrdMap;
use serde::de::{self, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::names::{BackendAddr, BackendId};

/// A backend's share of traffic relative to its peers. `0` sends it nothing
/// (an operator's way to drain it) while keeping it configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "u32", into = "u32")]
pub struct Weight(u32);

impl Weight {
    /// The largest weight accepted.
    pub const MAX: u32 = 10_000;

    /// The weight as a number.
    pub fn get(self) -> u32 {
        self.0
    }
}

impl Default for Weight {
    fn default() -> Self {
        Weight(1)
    }
}

impl TryFrom<u32> for Weight {
    type Error = String;
    fn try_from(w: u32) -> Result<Self, String> {
        if w > Self::MAX {
            return Err(format!("weight {w} is above the maximum {}", Self::MAX));
        }
        Ok(Weight(w))
    }
}

impl From<Weight> for u32 {
    fn from(w: Weight) -> u32 {
        w.0
    }
}

/// One backend of a service, as configured (`PUT /v1/services/{s}/backends/{id}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendSpec {
    /// Where the backend listens, `host:port`.
    pub addr: BackendAddr,
    /// Relative share of traffic (0..=10000, default 1).
    #[serde(default)]
    pub weight: Weight,
    /// A backup backend receives traffic only when no primary backend can take it.
    #[serde(default)]
    pub backup: bool,
}

/// How a service picks a backend for each request.
///
/// Selected by `"kind"`; each kind documents its own parameters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum PolicySpec {
    /// Smooth weighted round robin (nginx's algorithm): each backend gets its
    /// weight's share, interleaved rather than in bursts. The default.
    RoundRobin {},
    /// Weighted random choice.
    Random {},
    /// The backend with the fewest requests in flight relative to its weight.
    LeastConn {},
}

impl Default for PolicySpec {
    fn default() -> Self {
        PolicySpec::RoundRobin {}
    }
}

/// Upstream timeouts of a service, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Timeouts {
    /// Time allowed to open a TCP connection to a backend (default 2000).
    /// A connect failure or timeout is retried on another backend.
    pub connect_ms: u64,
    /// Time allowed from sending the request until the response headers
    /// arrive (default 60000). On expiry the client gets 504.
    pub response_ms: u64,
    /// How long an idle pooled upstream connection is kept (default 90000).
    pub idle_ms: u64,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            connect_ms: 2_000,
            response_ms: 60_000,
            idle_ms: 90_000,
        }
    }
}

/// Everything about a service except its backends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceSettings {
    /// The balancing policy (default `{"kind": "round_robin"}`).
    #[serde(default)]
    pub policy: PolicySpec,
    /// Upstream timeouts.
    #[serde(default)]
    pub timeouts: Timeouts,
    /// How many times a failed request may be tried again on another backend
    /// (default 2). Connect failures are always retryable; other failures
    /// only for idempotent methods with a replayable body.
    #[serde(default = "default_retries")]
    pub retries: u32,
}

fn default_retries() -> u32 {
    2
}

impl Default for ServiceSettings {
    fn default() -> Self {
        ServiceSettings {
            policy: PolicySpec::default(),
            timeouts: Timeouts::default(),
            retries: default_retries(),
        }
    }
}

impl ServiceSettings {
    fn validate(&self) -> Result<(), String> {
        let t = &self.timeouts;
        const DAY_MS: u64 = 86_400_000;
        for (field, v) in [
            ("timeouts.connect_ms", t.connect_ms),
            ("timeouts.response_ms", t.response_ms),
            ("timeouts.idle_ms", t.idle_ms),
        ] {
            if v == 0 || v > DAY_MS {
                return Err(format!("{field}: must be 1..={DAY_MS}, got {v}"));
            }
        }
        if self.retries > 10 {
            return Err(format!("retries: must be 0..=10, got {}", self.retries));
        }
        Ok(())
    }
}

/// A service: settings plus its backends keyed by id (`PUT /v1/services/{name}`).
///
/// On the wire the backends are a list of `{"id", "addr", "weight", "backup"}`;
/// duplicate ids are rejected.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ServiceSpec {
    /// Policy, timeouts, retries.
    pub settings: ServiceSettings,
    /// The pool, ordered by id.
    pub backends: OrdMap<BackendId, BackendSpec>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename = "ServiceSpec")]
struct ServiceWire {
    #[serde(default)]
    policy: PolicySpec,
    #[serde(default)]
    timeouts: Timeouts,
    #[serde(default = "default_retries")]
    retries: u32,
    #[serde(default)]
    backends: BackendList,
}

/// A backend as listed inside a service.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ListedBackend {
    id: BackendId,
    addr: BackendAddr,
    #[serde(default)]
    weight: Weight,
    #[serde(default)]
    backup: bool,
}

#[derive(Default)]
struct BackendList(OrdMap<BackendId, BackendSpec>);

impl<'de> Deserialize<'de> for BackendList {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = BackendList;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list of backends")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<BackendList, A::Error> {
                let mut map = OrdMap::new();
                let mut index = 0usize;
                while let Some(b) = seq.next_element::<ListedBackend>()? {
                    if map.contains_key(&b.id) {
                        return Err(de::Error::custom(format!(
                            "[{index}].id: duplicate backend id {:?}",
                            b.id.as_str()
                        )));
                    }
                    let spec = BackendSpec {
                        addr: b.addr,
                        weight: b.weight,
                        backup: b.backup,
                    };
                    map.insert(b.id, spec);
                    index += 1;
                }
                Ok(BackendList(map))
            }
        }
        d.deserialize_seq(V)
    }
}

impl Serialize for BackendList {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(|(id, b)| ListedBackend {
            id: id.clone(),
            addr: b.addr.clone(),
            weight: b.weight,
            backup: b.backup,
        }))
    }
}

impl<'de> Deserialize<'de> for ServiceSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let w = ServiceWire::deserialize(d)?;
        let settings = ServiceSettings {
            policy: w.policy,
            timeouts: w.timeouts,
            retries: w.retries,
        };
        settings.validate().map_err(de::Error::custom)?;
        Ok(ServiceSpec {
            settings,
            backends: w.backends.0,
        })
    }
}

impl Serialize for ServiceSpec {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        ServiceWire {
            policy: self.settings.policy.clone(),
            timeouts: self.settings.timeouts,
            retries: self.settings.retries,
            backends: BackendList(self.backends.clone()),
        }
        .serialize(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_minimal_service_gets_defaults() {
        let s: ServiceSpec =
            serde_json::from_str(r#"{"backends":[{"id":"a","addr":"127.0.0.1:9001"}]}"#).unwrap();
        assert_eq!(s.settings.policy, PolicySpec::RoundRobin {});
        assert_eq!(s.backends.len(), 1);
        let b = s.backends.values().next().unwrap();
        assert_eq!(b.weight.get(), 1);
        assert!(!b.backup);
    }

    #[test]
    fn duplicate_ids_unknown_fields_and_bad_values_are_rejected() {
        let dup =
            r#"{"backends":[{"id":"a","addr":"127.0.0.1:1"},{"id":"a","addr":"127.0.0.1:2"}]}"#;
        let err = serde_json::from_str::<ServiceSpec>(dup)
            .unwrap_err()
            .to_string();
        assert!(err.contains("[1].id: duplicate"), "{err}");
        assert!(serde_json::from_str::<ServiceSpec>(r#"{"bogus":1}"#).is_err());
        assert!(serde_json::from_str::<ServiceSpec>(r#"{"policy":{"kind":"nope"}}"#).is_err());
        assert!(
            serde_json::from_str::<ServiceSpec>(r#"{"policy":{"kind":"random","x":1}}"#).is_err()
        );
        assert!(serde_json::from_str::<ServiceSpec>(r#"{"timeouts":{"connect_ms":0}}"#).is_err());
        let heavy = r#"{"backends":[{"id":"a","addr":"127.0.0.1:1","weight":10001}]}"#;
        assert!(serde_json::from_str::<ServiceSpec>(heavy).is_err());
    }

    #[test]
    fn a_service_round_trips_through_json() {
        let text = r#"{"policy":{"kind":"least_conn"},"backends":[{"id":"b","addr":"h:1","weight":3,"backup":true}]}"#;
        let s: ServiceSpec = serde_json::from_str(text).unwrap();
        let again: ServiceSpec = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert_eq!(s, again);
    }
}
