//! Tidegate's data-plane snapshot.
//!
//! A [`Snapshot`] is everything the proxy needs to serve a request, frozen at
//! one configuration revision: the route table and, per service, its
//! settings and a ready-to-use selector. The writer builds the next snapshot
//! from the current one and the [`Delta`] of a commit, so the cost follows the
//! size of the change, not of the configuration; the proxy reads the current
//! one with a single atomic load.

use std::cmp::Ordering;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use imbl::ordmap::DiffItem;
use imbl::OrdMap;
use tidegate_balance::limit::LimitParams;
use tidegate_balance::{Backend, BackendStats, ServiceSelector};
use tidegate_metrics::LazyHistogram;
use tidegate_model::{
    BackendId, BackendSpec, ConfigState, Delta, RetryBudget, RouteName, ServiceName, ServiceSettings, ServiceSpec,
};
use tidegate_router::Router;

/// A persistent map hashed with foldhash: every request looks names up
/// here, and SipHash (imbl's default) costs several times more per short
/// key. The keys are configured, not sent by clients.
type HashMap<K, V> = imbl::GenericHashMap<K, V, foldhash::fast::RandomState, imbl::shared_ptr::DefaultSharedPtr>;
pub use tidegate_router::{RequestView, RouteStats};

/// A route as the data plane finds it: its spec, its counters, and
/// attached to it the compiled rule chain it runs, if any (found with the
/// route, without a second lookup by name).
pub type Entry = tidegate_router::Entry<Option<Arc<tidegate_rules::Chain>>>;

mod listeners;
mod memory;
mod published;
mod queue;
mod tls;
pub use listeners::{ListenerBoard, ListenerState};
pub use memory::{Memory, Recalled, RememberedBackend, ServiceMemory};
pub use published::{Changes, Publications};
pub use queue::{client_key, Joined, WaitQueue, Waiter};
pub use tls::{Certificates, Served};

/// Live counters of a service, shared across snapshots like backend stats.
#[derive(Debug, Default)]
pub struct ServiceLive {
    /// Retries in flight (for the retry budget).
    pub retries_in_flight: AtomicU64,
    /// Retries refused by the budget.
    pub retries_refused: AtomicU64,
    /// Requests waiting for room under a backend's limit (`max_conns` or
    /// learned), in turns between client addresses and oldest first within
    /// one; woken when a request to a limited backend finishes.
    pub queue: WaitQueue,
    /// How long requests that had to queue waited.
    pub queue_wait: LazyHistogram,
}

impl ServiceLive {
    /// Takes a retry token if the budget allows: retries in flight stay at
    /// most `percent` of the service's requests in flight (`in_flight`,
    /// summed from its backends by the caller: only a retry pays for it),
    /// or `min_concurrent`.
    pub fn try_retry(&self, budget: &RetryBudget, in_flight: u64) -> bool {
        let allowed = (in_flight * u64::from(budget.percent.get()) / 100).max(u64::from(budget.min_concurrent));
        let taken = self.retries_in_flight.fetch_update(Relaxed, Relaxed, |r| (r < allowed).then_some(r + 1)).is_ok();
        if !taken {
            self.retries_refused.fetch_add(1, Relaxed);
        }
        taken
    }

    /// Returns a retry token.
    pub fn retry_done(&self) {
        self.retries_in_flight.fetch_sub(1, Relaxed);
    }
}

/// One service, ready for traffic.
#[derive(Debug)]
pub struct ServiceRuntime {
    /// The service's name.
    pub name: ServiceName,
    /// Policy, timeouts, retries.
    pub settings: ServiceSettings,
    /// Picks a backend per request.
    pub selector: ServiceSelector,
    /// Live counters, carried over from the previous snapshot.
    pub live: Arc<ServiceLive>,
    /// How its backends are reached (TLS, HTTP version), compiled once.
    pub upstream: tidegate_upstream::Profile,
    /// The backends' specs it was built from, in id order like the
    /// selector's list (it shares its structure with the configuration):
    /// the next build compares against it to touch only what changed.
    backend_specs: OrdMap<BackendId, BackendSpec>,
}

impl ServiceRuntime {
    /// Builds a service, carrying over the live statistics of `previous`'s
    /// backends that kept their id and address, and keeping as they are
    /// those whose spec did not change either.
    pub fn build(name: ServiceName, spec: &ServiceSpec, previous: Option<&ServiceRuntime>) -> ServiceRuntime {
        let learning = limit_params(&spec.settings);
        // Unchanged limit settings: only the backends whose spec changed
        // need building.
        let same_limits = previous.filter(|p| limit_params(&p.settings) == learning);
        let backends = same_limits
            .and_then(|p| p.changed_backends(spec, learning))
            .unwrap_or_else(|| merged_backends(spec, previous, learning));
        let upstream = match previous.filter(|p| p.settings.upstream == spec.settings.upstream) {
            Some(p) => p.upstream.clone(),
            None => tidegate_upstream::Profile::build(&spec.settings.upstream).unwrap_or_else(|e| {
                // Validation refuses such settings before they are stored.
                tracing::error!(service = %name, error = %e, "upstream settings do not compile; no connections");
                tidegate_upstream::Profile::refusing(e.to_string())
            }),
        };
        ServiceRuntime {
            name,
            settings: spec.settings.clone(),
            selector: ServiceSelector::new(&spec.settings.policy, backends),
            live: previous.map(|p| p.live.clone()).unwrap_or_default(),
            upstream,
            backend_specs: spec.backends.clone(),
        }
    }

    /// This service's backends with `spec`'s changes applied, found by
    /// comparing the two maps of specs: the parts they share are skipped,
    /// so a change to one backend of thousands compares a few dozen
    /// entries, and every unchanged backend is kept as it is. Only valid
    /// when the limit settings did not change. `None` if the list and the
    /// specs it was built from disagree (a bug): the caller then merges.
    fn changed_backends(&self, spec: &ServiceSpec, learning: Option<LimitParams>) -> Option<Vec<Arc<Backend>>> {
        let old = self.selector.backends();
        let mut out = Vec::with_capacity(spec.backends.len());
        // `old[next..]` is what has not been copied or replaced yet.
        let mut next = 0;
        for change in self.backend_specs.diff(&spec.backends) {
            let id = match change {
                DiffItem::Add(id, _) | DiffItem::Remove(id, _) | DiffItem::Update { new: (id, _), .. } => id,
            };
            let at = next + old[next..].partition_point(|o| &o.id < id);
            out.extend_from_slice(&old[next..at]);
            next = at;
            let here = old.get(at).filter(|o| &o.id == id);
            match change {
                DiffItem::Add(_, b) if here.is_none() => out.push(backend(id, b, None, learning)),
                DiffItem::Update { new: (_, b), .. } => {
                    let o = here?;
                    out.push(backend(id, b, (o.addr == b.addr).then(|| o.stats.clone()), learning));
                    next += 1;
                }
                DiffItem::Remove(..) => {
                    here?;
                    next += 1;
                }
                DiffItem::Add(..) => return None,
            }
        }
        out.extend_from_slice(&old[next..]);
        (out.len() == spec.backends.len()).then_some(out)
    }
}

/// `spec`'s backends, all built anew, carrying over the statistics of
/// `previous`'s that kept their id and address: for the first build and
/// when the limit settings changed (every backend's limit must follow).
/// Both lists are in id order: one merge pass, so it costs O(backends),
/// not O(backends²).
fn merged_backends(
    spec: &ServiceSpec,
    previous: Option<&ServiceRuntime>,
    learning: Option<LimitParams>,
) -> Vec<Arc<Backend>> {
    let mut old = previous.map(|p| p.selector.backends()).unwrap_or_default().iter().peekable();
    spec.backends
        .iter()
        .map(|(id, b)| {
            // One comparison of ids per step: they are strings.
            let same_id = loop {
                match old.peek().map(|o| o.id.cmp(id)) {
                    Some(Ordering::Less) => _ = old.next(),
                    Some(Ordering::Equal) => break old.next(),
                    Some(Ordering::Greater) | None => break None,
                }
            };
            backend(id, b, same_id.filter(|o| o.addr == b.addr).map(|o| o.stats.clone()), learning)
        })
        .collect()
}

/// A backend of the data plane, its limit set to follow `learning`.
fn backend(
    id: &BackendId,
    spec: &BackendSpec,
    stats: Option<Arc<BackendStats>>,
    learning: Option<LimitParams>,
) -> Arc<Backend> {
    let backend = Backend::new(id.clone(), spec, stats);
    backend.stats.learn_limit(learning);
    Arc::new(backend)
}

/// How a service's backends learn their limit, if they do.
fn limit_params(settings: &ServiceSettings) -> Option<LimitParams> {
    settings.learns_limits().then(|| LimitParams::from(&settings.concurrency))
}

/// Everything the data plane needs, at one revision. Immutable.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    revision: u64,
    /// The routes, each with its compiled rule chain (rebuilt when the
    /// route or one of its rule sets changes, and so its limiter state
    /// starts afresh then).
    router: Router<Option<Arc<tidegate_rules::Chain>>>,
    services: HashMap<ServiceName, Arc<ServiceRuntime>>,
    /// The services whose policy has dynamic weights to refresh (a few,
    /// usually), so the background pass need not visit every service.
    refreshing: HashMap<ServiceName, Arc<ServiceRuntime>>,
    certificates: Arc<Certificates>,
    /// The named listeners (the data plane binds and closes them as they
    /// come and go).
    listeners: imbl::OrdMap<tidegate_model::ListenerName, Arc<tidegate_model::ListenerSpec>>,
}

impl Snapshot {
    /// The empty snapshot at revision 0.
    pub fn empty() -> Snapshot {
        Snapshot::default()
    }

    /// Builds a snapshot of a whole configuration (at startup).
    pub fn from_state(state: &ConfigState, revision: u64) -> Snapshot {
        let delta = Delta {
            services: state.services().keys().cloned().collect(),
            routes: state.routes().keys().cloned().collect(),
            certificates: state.certificates().keys().cloned().collect(),
            rules: state.rules().keys().cloned().collect(),
            listeners: state.listeners().keys().cloned().collect(),
        };
        Snapshot::empty().next(state, &delta, revision)
    }

    /// The snapshot after a commit: `state` is the new configuration and
    /// `delta` what changed since `self`. Only the changed services and routes
    /// are rebuilt.
    pub fn next(&self, state: &ConfigState, delta: &Delta, revision: u64) -> Snapshot {
        let mut next = self.clone();
        next.revision = revision;
        for name in &delta.services {
            next.refreshing.remove(name);
            match state.service(name.as_str()) {
                Some(spec) => {
                    let prev = self.services.get(name).map(|s| &**s);
                    let rt = Arc::new(ServiceRuntime::build(name.clone(), spec, prev));
                    if rt.selector.refreshes() {
                        next.refreshing.insert(name.clone(), rt.clone());
                    }
                    next.services.insert(name.clone(), rt);
                }
                None => {
                    next.services.remove(name);
                }
            }
        }
        if !delta.certificates.is_empty() {
            next.certificates = Arc::new(Certificates::build(state));
        }
        next.rebuild_routes(state, delta);
        if !delta.listeners.is_empty() {
            next.listeners = state.listeners().clone();
        }
        next
    }

    /// The named listeners.
    pub fn listeners(&self) -> &imbl::OrdMap<tidegate_model::ListenerName, Arc<tidegate_model::ListenerSpec>> {
        &self.listeners
    }

    /// Puts in the router the routes `delta` touched, directly or through
    /// a rule set they run, each with its rule chain compiled; removes
    /// those gone.
    fn rebuild_routes(&mut self, state: &ConfigState, delta: &Delta) {
        let mut routes: Vec<RouteName> = delta.routes.iter().cloned().collect();
        for set in &delta.rules {
            routes.extend(state.rule_set_users(set.as_str()).into_iter().flatten().cloned());
        }
        routes.sort_unstable();
        routes.dedup();
        for name in routes {
            let Some(spec) = state.route(name.as_str()) else {
                self.router.remove(&name);
                continue;
            };
            let chain = (!spec.rules.is_empty()).then(|| {
                let sets: Vec<_> =
                    spec.rules.iter().filter_map(|n| Some((n.clone(), state.rule_set(n.as_str())?.clone()))).collect();
                Arc::new(tidegate_rules::Chain::compile(name.as_str(), &sets))
            });
            self.router.insert_with(name, spec.clone(), chain);
        }
    }

    /// The compiled rule chain of the route `name`, if it runs rule sets.
    pub fn rules(&self, route: &str) -> Option<&Arc<tidegate_rules::Chain>> {
        self.router.get(route)?.attached.as_ref()
    }

    /// The TLS certificates, indexed for SNI.
    pub fn certificates(&self) -> &Arc<Certificates> {
        &self.certificates
    }

    /// The configuration revision this snapshot shows.
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// The route for a request.
    pub fn route(&self, req: &RequestView<'_>) -> Option<&Entry> {
        self.router.lookup(req)
    }

    /// A service by name.
    pub fn service(&self, name: &str) -> Option<&Arc<ServiceRuntime>> {
        self.services.get(name)
    }

    /// All services (unordered).
    pub fn services(&self) -> impl Iterator<Item = &Arc<ServiceRuntime>> {
        self.services.values()
    }

    /// The services whose selector has dynamic weights to refresh
    /// ([`ServiceSelector::refresh`]), unordered.
    pub fn refreshing(&self) -> impl Iterator<Item = &Arc<ServiceRuntime>> {
        self.refreshing.values()
    }

    /// All routes (unordered).
    pub fn routes(&self) -> impl Iterator<Item = &Entry> {
        self.router.entries()
    }

    /// Number of routes.
    pub fn route_count(&self) -> usize {
        self.router.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderMap, Method};
    use tidegate_model::parse_change_set;

    fn apply(state: &ConfigState, rev: u64, text: &str) -> (ConfigState, Delta) {
        state.apply(&parse_change_set(text.as_bytes()).unwrap(), rev).unwrap()
    }

    #[test]
    fn only_services_with_dynamic_weights_are_listed_for_refresh() {
        let refreshing = |snap: &Snapshot| {
            let mut names: Vec<String> = snap.refreshing().map(|s| s.name.to_string()).collect();
            names.sort();
            names
        };
        let (s1, d1) = apply(
            &ConfigState::default(),
            0,
            r#"{"ops":[
                {"op":"put_service","name":"fb","spec":{"policy":{"kind":"dynamic_feedback"},"backends":[{"id":"a","addr":"127.0.0.1:1"}]}},
                {"op":"put_service","name":"orca","spec":{"policy":{"kind":"orca_wrr"},"backends":[{"id":"a","addr":"127.0.0.1:2"}]}},
                {"op":"put_service","name":"rr","spec":{"backends":[{"id":"a","addr":"127.0.0.1:3"}]}}]}"#,
        );
        let snap1 = Snapshot::empty().next(&s1, &d1, 1);
        assert_eq!(refreshing(&snap1), ["fb", "orca"]);
        assert_eq!(snap1.services().count(), 3);
        // A policy change moves a service in or out; a deleted one leaves.
        let (s2, d2) = apply(
            &s1,
            1,
            r#"{"ops":[
                {"op":"put_service","name":"fb","spec":{"policy":{"kind":"round_robin"},"backends":[{"id":"a","addr":"127.0.0.1:1"}]}},
                {"op":"put_service","name":"rr","spec":{"policy":{"kind":"dynamic_feedback"},"backends":[{"id":"a","addr":"127.0.0.1:3"}]}},
                {"op":"delete_service","name":"orca"}]}"#,
        );
        let snap2 = snap1.next(&s2, &d2, 2);
        assert_eq!(refreshing(&snap2), ["rr"]);
        assert!(Arc::ptr_eq(snap2.refreshing().next().unwrap(), snap2.service("rr").unwrap()));
        // The earlier snapshot is untouched.
        assert_eq!(refreshing(&snap1), ["fb", "orca"]);
    }

    #[test]
    fn routes_carry_their_rule_chains_rebuilt_when_a_set_changes() {
        let (s1, d1) = apply(
            &ConfigState::default(),
            0,
            r#"{"ops":[
            {"op":"put_service","name":"a","spec":{}},
            {"op":"put_rules","name":"strip","spec":{"steps":[]}},
            {"op":"put_route","name":"r","spec":{"match":{"path_prefix":"/a"},"service":"a","rules":["strip"]}},
            {"op":"put_route","name":"plain","spec":{"match":{"path_prefix":"/b"},"service":"a"}}]}"#,
        );
        let snap1 = Snapshot::empty().next(&s1, &d1, 1);
        let chain1 = snap1.rules("r").expect("the route's chain").clone();
        assert!(snap1.rules("plain").is_none());
        // A change of the rule set alone rebuilds the chain of its route.
        let (s2, d2) = apply(&s1, 1, r#"{"ops":[{"op":"put_rules","name":"strip","spec":{"steps":[]}}]}"#);
        let snap2 = snap1.next(&s2, &d2, 2);
        assert!(!Arc::ptr_eq(&chain1, snap2.rules("r").unwrap()));
        // A route that stops running rules loses its chain.
        let (s3, d3) = apply(
            &s2,
            2,
            r#"{"ops":[{"op":"put_route","name":"r","spec":{"service":"a"}},{"op":"delete_rules","name":"strip"}]}"#,
        );
        assert!(snap2.next(&s3, &d3, 3).rules("r").is_none());
    }

    #[test]
    fn incremental_snapshots_match_full_builds_and_keep_stats() {
        let (s1, _) = apply(
            &ConfigState::default(),
            0,
            r#"{"ops":[
            {"op":"put_service","name":"a","spec":{"backends":[{"id":"x","addr":"127.0.0.1:1"},{"id":"y","addr":"127.0.0.1:2"}]}},
            {"op":"put_service","name":"b","spec":{}},
            {"op":"put_route","name":"r","spec":{"match":{"path_prefix":"/a"},"service":"a"}}]}"#,
        );
        let snap1 = Snapshot::from_state(&s1, 1);
        let stats_x = snap1.service("a").unwrap().selector.backends()[0].stats.clone();
        let stats_y = snap1.service("a").unwrap().selector.backends()[1].stats.clone();
        let untouched = snap1.service("b").unwrap().clone();

        let (s2, d2) = apply(
            &s1,
            1,
            r#"{"ops":[
            {"op":"put_backend","service":"a","id":"y","spec":{"addr":"127.0.0.1:3"}},
            {"op":"put_backend","service":"a","id":"z","spec":{"addr":"127.0.0.1:4"}}]}"#,
        );
        let snap2 = snap1.next(&s2, &d2, 2);
        assert_eq!(snap2.revision(), 2);
        let a = snap2.service("a").unwrap();
        assert_eq!(a.selector.backends().len(), 3);
        assert!(Arc::ptr_eq(&a.selector.backends()[0].stats, &stats_x), "same addr keeps stats");
        assert!(Arc::ptr_eq(&a.live, &snap1.service("a").unwrap().live), "service counters survive");
        assert!(!Arc::ptr_eq(&a.selector.backends()[1].stats, &stats_y), "new addr starts fresh");
        assert!(Arc::ptr_eq(snap2.service("b").unwrap(), &untouched), "other services are not rebuilt");
        assert_eq!(snap1.service("a").unwrap().selector.backends().len(), 2, "old snapshot intact");

        let full = Snapshot::from_state(&s2, 2);
        assert_eq!(full.services().count(), snap2.services().count());
        let headers = HeaderMap::new();
        let view = RequestView {
            host: "",
            path: "/a/1",
            method: &Method::GET,
            headers: &headers,
            query: None,
            listener: None,
        };
        assert_eq!(snap2.route(&view).unwrap().name.as_str(), "r");
        assert!(full.route(&view).is_some());
    }

    /// (id, address, weight, statistics) of each backend of service `a`.
    fn backends_of(snap: &Snapshot) -> Vec<(String, String, u32, *const BackendStats)> {
        let a = snap.service("a").unwrap();
        let list = a.selector.backends();
        list.iter().map(|b| (b.id.to_string(), b.addr.to_string(), b.weight, Arc::as_ptr(&b.stats))).collect()
    }

    #[test]
    fn rebuilding_from_the_changed_specs_matches_a_merge_of_all_of_them() {
        let many: Vec<String> =
            (0..300).map(|i| format!(r#"{{"id":"b{i:03}","addr":"127.0.0.1:{}"}}"#, 1000 + i)).collect();
        let text =
            format!(r#"{{"ops":[{{"op":"put_service","name":"a","spec":{{"backends":[{}]}}}}]}}"#, many.join(","));
        let (mut state, _) = apply(&ConfigState::default(), 0, &text);
        let mut snap = Snapshot::from_state(&state, 1);
        let steps = [
            r#"{"op":"put_backend","service":"a","id":"b150","spec":{"addr":"127.0.0.1:1150","weight":7}}"#,
            r#"{"op":"put_backend","service":"a","id":"b151","spec":{"addr":"127.0.0.1:9999"}}"#,
            r#"{"op":"delete_backend","service":"a","id":"b000"}"#,
            r#"{"op":"delete_backend","service":"a","id":"b299"}"#,
            r#"{"op":"put_backend","service":"a","id":"a-first","spec":{"addr":"127.0.0.1:2"}}"#,
            r#"{"op":"put_backend","service":"a","id":"b150x","spec":{"addr":"127.0.0.1:3"}}"#,
            r#"{"op":"put_backend","service":"a","id":"z-last","spec":{"addr":"127.0.0.1:4"}}"#,
            r#"{"op":"put_backend","service":"a","id":"b010","spec":{"addr":"127.0.0.1:1010"}}"#,
        ];
        for (n, op) in steps.iter().enumerate() {
            let rev = n as u64 + 1;
            let before = snap.service("a").unwrap().clone();
            let (next_state, delta) = apply(&state, rev, &format!(r#"{{"ops":[{op}]}}"#));
            let spec = next_state.service("a").unwrap();
            let learning = limit_params(&spec.settings);
            assert!(before.changed_backends(spec, learning).is_some(), "step {n} took the fast path");
            let next = snap.next(&next_state, &delta, rev + 1);

            let merged = merged_backends(spec, Some(&before), learning);
            let merged: Vec<_> = merged
                .iter()
                .map(|b| (b.id.to_string(), b.addr.to_string(), b.weight, Arc::as_ptr(&b.stats)))
                .collect();
            let got = backends_of(&next);
            assert_eq!(
                got.iter().map(|b| (&b.0, &b.1, b.2)).collect::<Vec<_>>(),
                merged.iter().map(|b| (&b.0, &b.1, b.2)).collect::<Vec<_>>(),
                "step {n}"
            );
            let kept: std::collections::HashMap<_, _> =
                before.selector.backends().iter().map(|b| (b.id.to_string(), b)).collect();
            for b in next.service("a").unwrap().selector.backends() {
                if let Some(old) = kept.get(b.id.as_str()) {
                    let same_spec = old.is_built_from(spec.backends.get(&b.id).unwrap());
                    assert_eq!(Arc::ptr_eq(b, old), same_spec, "step {n}: {} kept only if unchanged", b.id);
                    assert_eq!(Arc::ptr_eq(&b.stats, &old.stats), old.addr == b.addr, "step {n}: {}", b.id);
                }
            }
            (state, snap) = (next_state, next);
        }
        assert_eq!(backends_of(&snap).len(), 300 - 2 + 3);
    }

    #[test]
    fn a_rebuild_keeps_unchanged_backends_and_rebuilds_changed_ones() {
        let (s1, _) = apply(
            &ConfigState::default(),
            0,
            r#"{"ops":[{"op":"put_service","name":"a","spec":{"backends":[
            {"id":"x","addr":"127.0.0.1:1"},{"id":"y","addr":"127.0.0.1:2"}]}}]}"#,
        );
        let snap1 = Snapshot::from_state(&s1, 1);
        let old = snap1.service("a").unwrap().selector.backends().to_vec();

        let (s2, d2) = apply(
            &s1,
            1,
            r#"{"ops":[{"op":"put_backend","service":"a","id":"y","spec":{"addr":"127.0.0.1:2","weight":5}}]}"#,
        );
        let snap2 = snap1.next(&s2, &d2, 2);
        let new = snap2.service("a").unwrap().selector.backends();
        assert!(Arc::ptr_eq(&new[0], &old[0]), "x did not change: kept as it is");
        assert!(!Arc::ptr_eq(&new[1], &old[1]), "y's weight changed: rebuilt");
        assert_eq!(new[1].weight, 5);
        assert!(Arc::ptr_eq(&new[1].stats, &old[1].stats), "same address keeps its statistics");

        // Learning turned off: every backend is rebuilt so its limit follows.
        let (s3, d3) = apply(
            &s2,
            2,
            r#"{"ops":[{"op":"put_service","name":"a","spec":{"concurrency":{"learn":false},"backends":[
            {"id":"x","addr":"127.0.0.1:1"},{"id":"y","addr":"127.0.0.1:2","weight":5}]}}]}"#,
        );
        let snap3 = snap2.next(&s3, &d3, 3);
        let last = snap3.service("a").unwrap().selector.backends();
        assert!(!Arc::ptr_eq(&last[0], &new[0]) && !Arc::ptr_eq(&last[1], &new[1]));
        assert!(!last[0].stats.learns_limit(), "the new settings reached the kept statistics");
    }
}

#[cfg(test)]
mod budget_tests {
    use super::*;

    #[test]
    fn the_retry_budget_scales_with_traffic() {
        let live = ServiceLive::default();
        let budget =
            RetryBudget { percent: tidegate_model::Percent::new(20).expect("a percentage"), min_concurrent: 2 };
        assert!(live.try_retry(&budget, 0) && live.try_retry(&budget, 0));
        assert!(!live.try_retry(&budget, 0), "min_concurrent when idle");
        let more = (0..30).filter(|_| live.try_retry(&budget, 100)).count();
        assert_eq!(more, 18, "20% of 100 in flight, 2 already taken");
        live.retry_done();
        assert!(live.try_retry(&budget, 100));
        assert_eq!(live.retries_refused.load(Relaxed), 13);
    }
}
