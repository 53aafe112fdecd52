//! The reference distributor's named policies, and the load table they read.
//!
//! A decision never waits: `least_cpu` reads the last utilization the
//! background scrapers wrote into the [`LoadTable`] (one atomic per backend).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

use tidegate_balance::hash_bytes;

use crate::protocol::WireQuery;

/// Backends whose CPU utilization is within this much (a fraction, so two
/// percentage points) of the lowest count as tied; ties take turns. Host
/// metrics are seconds old, so closer differences are noise.
pub(crate) const CPU_TIE_BAND: f64 = 0.02;

/// Last known CPU utilization (0.0..=1.0) per backend, `None` when unknown.
#[derive(Debug)]
pub(crate) struct LoadTable {
    /// `f64` bits; NaN means unknown.
    cpu: Vec<AtomicU64>,
}

impl LoadTable {
    pub(crate) fn new(backends: usize) -> Self {
        LoadTable { cpu: (0..backends).map(|_| AtomicU64::new(f64::NAN.to_bits())).collect() }
    }

    /// Records backend `i`'s utilization (`None`: unknown).
    pub(crate) fn set(&self, i: usize, cpu: Option<f64>) {
        if let Some(slot) = self.cpu.get(i) {
            slot.store(cpu.unwrap_or(f64::NAN).to_bits(), Relaxed);
        }
    }

    /// Backend `i`'s last known utilization.
    pub(crate) fn get(&self, i: usize) -> Option<f64> {
        let v = f64::from_bits(self.cpu.get(i)?.load(Relaxed));
        (!v.is_nan()).then_some(v)
    }
}

/// Why a query got no backend: answered to the proxy as its error text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum DecideError {
    /// The query names a policy this distributor does not have.
    #[error("unknown policy {0:?} (known: {known})", known = crate::POLICIES.join(", "))]
    UnknownPolicy(String),
}

/// The backends and the state of every policy.
#[derive(Debug)]
pub(crate) struct Policies {
    backends: Vec<SocketAddr>,
    /// Per backend, the hash of its address text, for rendezvous hashing:
    /// independent of the order of `--backend` flags.
    keys: Vec<u64>,
    next: AtomicUsize,
    load: Arc<LoadTable>,
    session_cookie: String,
}

impl Policies {
    /// `backends` must not be empty.
    pub(crate) fn new(backends: Vec<SocketAddr>, load: Arc<LoadTable>, session_cookie: String) -> Self {
        let keys = backends.iter().map(|b| hash_bytes(b.to_string().as_bytes())).collect();
        Policies { backends, keys, next: AtomicUsize::new(0), load, session_cookie }
    }

    /// Runs the query's policy: the backend, or why there is none.
    pub(crate) fn decide(&self, q: &WireQuery<'_>) -> Result<SocketAddr, DecideError> {
        match q.policy.as_str() {
            "round_robin" => Ok(self.round_robin()),
            "least_cpu" => Ok(self.least_cpu()),
            "session" => Ok(self.session(q)),
            other => Err(DecideError::UnknownPolicy(other.to_string())),
        }
    }

    fn turn(&self) -> usize {
        self.next.fetch_add(1, Relaxed)
    }

    fn round_robin(&self) -> SocketAddr {
        self.backends[self.turn() % self.backends.len()]
    }

    /// The backend on the least busy host; backends within [`CPU_TIE_BAND`]
    /// of the lowest take turns; all unknown: round robin.
    fn least_cpu(&self) -> SocketAddr {
        let n = self.backends.len();
        let min = (0..n).filter_map(|i| self.load.get(i)).fold(f64::INFINITY, f64::min);
        if !min.is_finite() {
            return self.round_robin();
        }
        let tied = |i: &usize| self.load.get(*i).is_some_and(|c| c <= min + CPU_TIE_BAND);
        let count = (0..n).filter(tied).count();
        let pick = self.turn() % count.max(1);
        (0..n).filter(tied).nth(pick).map_or_else(|| self.round_robin(), |i| self.backends[i])
    }

    /// Rendezvous hashing of the session cookie's value: every distributor
    /// with the same backends maps a session to the same backend, and adding
    /// or removing a backend moves only the sessions it gains or loses. No
    /// cookie (or an empty one): round robin.
    fn session(&self, q: &WireQuery<'_>) -> SocketAddr {
        let Some(value) = find_cookie(q, &self.session_cookie) else {
            return self.round_robin();
        };
        let key = hash_bytes(value.as_bytes());
        let mut pair = [0u8; 16];
        pair[..8].copy_from_slice(&key.to_le_bytes());
        let mut best = (0, 0u64);
        for (i, k) in self.keys.iter().enumerate() {
            pair[8..].copy_from_slice(&k.to_le_bytes());
            let score = hash_bytes(&pair);
            if i == 0 || score > best.1 {
                best = (i, score);
            }
        }
        self.backends[best.0]
    }
}

/// The first non-empty value of cookie `name` in the query's `cookie` headers.
fn find_cookie<'q>(q: &'q WireQuery<'_>, name: &str) -> Option<&'q str> {
    q.header_values("cookie").flat_map(|h| h.split(';')).find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        let v = v.trim().trim_matches('"');
        (k.trim() == name && !v.is_empty()).then_some(v)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::decode_query;
    use std::collections::HashMap;

    fn backends(n: u16) -> Vec<SocketAddr> {
        (0..n).map(|i| SocketAddr::from(([127, 0, 0, 1], 9001 + i))).collect()
    }

    fn policies(n: u16) -> Policies {
        let b = backends(n);
        let load = Arc::new(LoadTable::new(b.len()));
        Policies::new(b, load, "sid".into())
    }

    fn datagram(policy: &str, cookie: Option<&str>) -> Vec<u8> {
        let headers = match cookie {
            Some(c) => serde_json::json!([["host", "a"], ["cookie", c]]),
            None => serde_json::json!([["host", "a"]]),
        };
        serde_json::to_vec(&serde_json::json!({
            "v": 1, "id": 1, "policy": policy, "client": "1.2.3.4:5", "method": "GET", "path": "/", "headers": headers,
        }))
        .expect("json")
    }

    fn decide(p: &Policies, policy: &str, cookie: Option<&str>) -> Result<SocketAddr, DecideError> {
        let d = datagram(policy, cookie);
        p.decide(&decode_query(&d).expect("query"))
    }

    #[test]
    fn round_robin_cycles_in_order() {
        let p = policies(3);
        let got: Vec<_> = (0..7).map(|_| decide(&p, "round_robin", None).expect("ok").port()).collect();
        assert_eq!(got, [9001, 9002, 9003, 9001, 9002, 9003, 9001]);
    }

    #[test]
    fn unknown_policy_is_an_error() {
        let e = decide(&policies(2), "least_io", None).expect_err("unknown");
        assert_eq!(e, DecideError::UnknownPolicy("least_io".into()));
        let e = e.to_string();
        assert!(e.contains("least_io") && e.contains("round_robin"), "{e}");
    }

    #[test]
    fn session_sticks_to_one_backend_per_cookie() {
        let p = policies(5);
        let mut owners = HashMap::new();
        for s in 0..200 {
            let cookie = format!("theme=dark; sid=session-{s}; lang=en");
            let first = decide(&p, "session", Some(&cookie)).expect("ok");
            for _ in 0..20 {
                assert_eq!(decide(&p, "session", Some(&cookie)).expect("ok"), first, "{cookie}");
            }
            *owners.entry(first).or_insert(0) += 1;
        }
        // Sessions spread over every backend, roughly evenly.
        assert_eq!(owners.len(), 5, "{owners:?}");
        assert!(owners.values().all(|&n| n > 15), "{owners:?}");
    }

    #[test]
    fn session_mapping_ignores_backend_order_and_moves_little() {
        let b = backends(4);
        let mut reversed = b.clone();
        reversed.reverse();
        let fewer = b[..3].to_vec();
        let load = Arc::new(LoadTable::new(4));
        let p = Policies::new(b.clone(), load.clone(), "sid".into());
        let r = Policies::new(reversed, load.clone(), "sid".into());
        let f = Policies::new(fewer, load, "sid".into());
        for s in 0..200 {
            let c = format!("sid={s}");
            let owner = decide(&p, "session", Some(&c)).expect("ok");
            assert_eq!(decide(&r, "session", Some(&c)).expect("ok"), owner);
            // Removing the fourth backend moves only its own sessions.
            if owner != b[3] {
                assert_eq!(decide(&f, "session", Some(&c)).expect("ok"), owner);
            }
        }
    }

    #[test]
    fn session_cookie_name_is_configurable_and_absence_means_round_robin() {
        let b = backends(3);
        let p = Policies::new(b, Arc::new(LoadTable::new(3)), "JSESSIONID".into());
        let c = "sid=1; JSESSIONID=abc";
        let first = decide(&p, "session", Some(c)).expect("ok");
        assert!((0..10).all(|_| decide(&p, "session", Some(c)).expect("ok") == first));
        // Only `sid`, or an empty value: not a session, so round robin.
        for cookie in [Some("sid=1"), Some("JSESSIONID="), None] {
            let got: Vec<_> = (0..3).map(|_| decide(&p, "session", cookie).expect("ok")).collect();
            assert_eq!(got.iter().collect::<std::collections::HashSet<_>>().len(), 3, "{cookie:?}");
        }
    }

    #[test]
    fn cookie_parsing_handles_spaces_quotes_and_several_headers() {
        let d = br#"{"v":1,"id":1,"policy":"session","client":"1.2.3.4:5","method":"GET","path":"/",
            "headers":[["cookie","a=1"],["Cookie"," sid = \"xyz\" ; b=2"]]}"#;
        let q = decode_query(d).expect("query");
        assert_eq!(find_cookie(&q, "sid"), Some("xyz"));
        assert_eq!(find_cookie(&q, "b"), Some("2"));
        assert_eq!(find_cookie(&q, "c"), None);
    }

    #[test]
    fn least_cpu_picks_the_lowest_known_utilization() {
        let p = policies(4);
        p.load.set(0, Some(0.50));
        p.load.set(1, Some(0.10));
        p.load.set(2, Some(0.90));
        p.load.set(3, None);
        for _ in 0..10 {
            assert_eq!(decide(&p, "least_cpu", None).expect("ok").port(), 9002);
        }
        // A host that becomes idler takes over.
        p.load.set(2, Some(0.01));
        assert_eq!(decide(&p, "least_cpu", None).expect("ok").port(), 9003);
    }

    #[test]
    fn least_cpu_ties_take_turns_and_unknown_means_round_robin() {
        let p = policies(3);
        let got: Vec<_> = (0..3).map(|_| decide(&p, "least_cpu", None).expect("ok").port()).collect();
        assert_eq!(got.iter().collect::<std::collections::HashSet<_>>().len(), 3, "all unknown: {got:?}");

        p.load.set(0, Some(0.300));
        p.load.set(1, Some(0.800));
        p.load.set(2, Some(0.305));
        let mut count = HashMap::new();
        for _ in 0..100 {
            *count.entry(decide(&p, "least_cpu", None).expect("ok").port()).or_insert(0) += 1;
        }
        assert_eq!(count.get(&9001), Some(&50), "{count:?}");
        assert_eq!(count.get(&9003), Some(&50), "{count:?}");
    }
}
