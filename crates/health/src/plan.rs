//! The pure part of reconciliation: which probers to stop and which to start
//! so that the running ones match the wanted ones.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Arc;

use tidegate_balance::Backend;
use tidegate_model::{ActiveCheck, BackendId, ServiceName};
use tidegate_upstream::Profile;

/// Identifies a prober: there is at most one per backend of a checked service.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProbeKey {
    /// The service whose settings ask for the check.
    pub service: ServiceName,
    /// The backend's id within that service.
    pub backend: BackendId,
}

/// What a prober probes (the backend's address, with the service's check)
/// and whose state it updates (the backend's live statistics).
#[derive(Debug, Clone)]
pub struct Target {
    /// The backend as of the snapshot the prober was started from. Only its
    /// address and its statistics are used; both stay the same for the
    /// prober's whole life.
    pub backend: Arc<Backend>,
    /// The service's active check.
    pub check: Arc<ActiveCheck>,
    /// How the service reaches its backends (TLS, HTTP version): probes go
    /// the same way as requests.
    pub upstream: Profile,
}

impl Target {
    /// Whether a prober started for `self` may go on running for `other`:
    /// same address, same check, and the same live statistics (the snapshot
    /// builder carries them over for backends that keep their id and
    /// address; fresh statistics need a fresh prober).
    pub fn same_as(&self, other: &Target) -> bool {
        self.backend.addr == other.backend.addr
            && Arc::ptr_eq(&self.backend.stats, &other.backend.stats)
            && (Arc::ptr_eq(&self.check, &other.check) || *self.check == *other.check)
            && self.upstream.key() == other.upstream.key()
    }
}

/// The changes that bring the running probers in line with the wanted ones.
///
/// A key whose prober must be replaced (its address, check or statistics
/// changed) is in both lists: stop the old prober, then start the new one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan<K> {
    /// Probers to abort.
    pub stop: Vec<K>,
    /// Probers to start.
    pub start: Vec<K>,
}

impl<K> Plan<K> {
    /// True when nothing has to change.
    pub fn is_empty(&self) -> bool {
        self.stop.is_empty() && self.start.is_empty()
    }
}

impl<K> Default for Plan<K> {
    fn default() -> Self {
        Plan { stop: Vec::new(), start: Vec::new() }
    }
}

/// The set difference between `wanted` and `running` probers.
///
/// `same(w, r)` says whether the running prober `r` already does what `w`
/// asks for; when it does not, the key is stopped and started again. A
/// running key that is not wanted is stopped; a wanted key that is not
/// running is started. O(wanted + running); the order of each list is
/// unspecified.
pub fn plan<K, W, R>(wanted: &HashMap<K, W>, running: &HashMap<K, R>, same: impl Fn(&W, &R) -> bool) -> Plan<K>
where
    K: Eq + Hash + Clone,
{
    let mut plan = Plan::default();
    for (key, r) in running {
        match wanted.get(key) {
            Some(w) if same(w, r) => {}
            Some(_) => {
                plan.stop.push(key.clone());
                plan.start.push(key.clone());
            }
            None => plan.stop.push(key.clone()),
        }
    }
    plan.start.extend(wanted.keys().filter(|k| !running.contains_key(*k)).cloned());
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(entries: &[(&'static str, u32)]) -> HashMap<&'static str, u32> {
        entries.iter().copied().collect()
    }

    fn sorted(mut p: Plan<&'static str>) -> Plan<&'static str> {
        p.stop.sort_unstable();
        p.start.sort_unstable();
        p
    }

    #[test]
    fn nothing_to_do_when_wanted_matches_running() {
        let m = map(&[("a", 1), ("b", 2)]);
        assert!(plan(&m, &m, |w, r| w == r).is_empty());
        let empty = HashMap::<&str, u32>::new();
        assert!(plan(&empty, &empty, |w, r| w == r).is_empty());
    }

    #[test]
    fn new_entries_start_vanished_ones_stop_changed_ones_restart() {
        let running = map(&[("kept", 1), ("gone", 2), ("changed", 3)]);
        let wanted = map(&[("kept", 1), ("changed", 4), ("new", 5)]);
        let p = sorted(plan(&wanted, &running, |w, r| w == r));
        assert_eq!(p.stop, vec!["changed", "gone"]);
        assert_eq!(p.start, vec!["changed", "new"]);
    }

    #[test]
    fn everything_starts_from_nothing_and_stops_to_nothing() {
        let some = map(&[("a", 1), ("b", 2)]);
        let none = HashMap::new();
        let up = sorted(plan(&some, &none, |w: &u32, r: &u32| w == r));
        assert_eq!((up.stop, up.start), (vec![], vec!["a", "b"]));
        let down = sorted(plan(&none, &some, |w: &u32, r: &u32| w == r));
        assert_eq!((down.stop, down.start), (vec!["a", "b"], vec![]));
    }

    #[test]
    fn the_predicate_decides_what_counts_as_unchanged() {
        // Running values may be of another type (a prober with its task);
        // here a running entry only has to be at least what is wanted.
        let running: HashMap<&str, (u32, bool)> = [("a", (5, true)), ("b", (1, true)), ("c", (9, false))].into();
        let wanted = map(&[("a", 3), ("b", 3), ("c", 3)]);
        let p = sorted(plan(&wanted, &running, |w, r| r.1 && r.0 >= *w));
        assert_eq!(p.stop, vec!["b", "c"]);
        assert_eq!(p.start, vec!["b", "c"]);
    }
}
