//! Tidegate's load balancing.
//!
//! A [`Pool`] is the set of backends of one service, as of one snapshot. A
//! [`Policy`] builds a [`Selector`] from a pool once, off the hot path; the
//! selector then picks a backend per request without taking a lock. The
//! caller passes an `accept` filter (healthy, not tried yet, ...) so that
//! every policy honours the same exclusions.
//!
//! Live statistics ([`BackendStats`]) are shared by `Arc` and survive
//! snapshot swaps: the snapshot builder hands the previous pool's stats to
//! the next pool for backends that did not change address.

pub mod clock;
mod feedback;
mod hashing;
mod health;
mod latency;
pub mod limit;
mod memory;
pub mod orca;
mod policies;
mod prequal;
mod stats;
#[cfg(test)]
mod testing;

use std::net::SocketAddr;
use std::sync::Arc;

use http::uri::Authority;
use tidegate_model::{BackendAddr, BackendId, BackendSpec, PolicySpec};

pub use feedback::{capacities, feedback_weight, feedback_weights, orca_weight, DynamicFeedback, OrcaWrr, Signals};
pub use hashing::{hash_bytes, ConsistentHash, HashKey};
pub use health::record_outcome;
pub use latency::{LeastTime, P2cEwma};
pub use memory::{Active, BackendMemory, LimitMemory, MemoryError};
pub use policies::{policy_for, LeastConn, RandomPolicy, RoundRobin};
pub use prequal::{hot_cold, Prequal, Probed};
pub use stats::{ActiveState, AtomicF64, BackendStats, InFlight, LoadReport, Outcome, ProbeState, StatsView};
pub use tidegate_model::Headers;

/// A backend as the data plane sees it.
#[derive(Debug)]
pub struct Backend {
    /// Its id within the service.
    pub id: BackendId,
    /// Its address.
    pub addr: BackendAddr,
    /// The address as a URI authority, parsed once.
    pub authority: Authority,
    /// The address as a socket address, parsed once; `None` for a host
    /// name (resolved when connecting).
    pub socket_addr: Option<std::net::SocketAddr>,
    /// Relative share of traffic.
    pub weight: u32,
    /// Backups take traffic only when no primary can.
    pub backup: bool,
    /// Most requests in flight at once, if limited.
    pub max_conns: Option<u64>,
    /// Live statistics, shared across snapshots.
    pub stats: Arc<BackendStats>,
}

impl Backend {
    /// Whether the backend is below its limits (always, when neither
    /// applies): `max_conns` on everything in flight, and the learned
    /// concurrency limit on the requests still awaiting their answer.
    pub fn has_room(&self) -> bool {
        self.stats.in_flight() < self.max_conns.unwrap_or(u64::MAX)
            && self.stats.awaiting_answer() < self.stats.learned_limit()
    }

    /// Whether requests may have to wait for this backend: it has
    /// `max_conns` or a learned limit.
    pub fn is_limited(&self) -> bool {
        self.max_conns.is_some() || self.stats.learns_limit()
    }

    /// Whether this backend is what `spec` describes: a rebuild of its
    /// service may then keep it as it is.
    pub fn is_built_from(&self, spec: &BackendSpec) -> bool {
        self.addr == spec.addr
            && self.weight == spec.weight.get()
            && self.backup == spec.backup
            && self.max_conns == spec.max_conns.map(|m| u64::from(m.get()))
    }

    /// Builds a backend from its spec, reusing `stats` when given.
    pub fn new(id: BackendId, spec: &BackendSpec, stats: Option<Arc<BackendStats>>) -> Backend {
        // A validated BackendAddr is always a valid authority; fall back to a
        // placeholder that cannot connect rather than panic.
        let authority =
            Authority::try_from(spec.addr.as_str()).unwrap_or_else(|_| Authority::from_static("invalid.invalid:1"));
        Backend {
            id,
            addr: spec.addr.clone(),
            authority,
            socket_addr: spec.addr.as_str().parse().ok(),
            weight: spec.weight.get(),
            backup: spec.backup,
            max_conns: spec.max_conns.map(|m| u64::from(m.get())),
            stats: stats.unwrap_or_default(),
        }
    }
}

/// The backends of one service (primaries or backups), in id order.
#[derive(Debug, Default)]
pub struct Pool {
    backends: Vec<Arc<Backend>>,
}

impl Pool {
    /// A pool of these backends.
    pub fn new(backends: Vec<Arc<Backend>>) -> Pool {
        Pool { backends }
    }

    /// The backends.
    pub fn backends(&self) -> &[Arc<Backend>] {
        &self.backends
    }

    /// Number of backends.
    pub fn len(&self) -> usize {
        self.backends.len()
    }

    /// True when the pool has no backend.
    pub fn is_empty(&self) -> bool {
        self.backends.is_empty()
    }
}

/// What a policy may look at to choose a backend.
#[derive(Debug, Clone, Copy)]
pub struct RequestCtx<'a> {
    /// The client's address.
    pub client: Option<SocketAddr>,
    /// The request path (with query).
    pub path: &'a str,
    /// The request headers.
    pub headers: &'a dyn Headers,
    /// The pick is for a retry: a backend already failed this request.
    /// Round robin then takes no turn of its shared rotation, so that the
    /// next requests' first attempts keep their own turns (else, with one
    /// dead backend of two, every first attempt would land on it until it
    /// is ejected).
    pub retry: bool,
}

impl<'a> RequestCtx<'a> {
    /// A first attempt's context.
    pub fn new(client: Option<SocketAddr>, path: &'a str, headers: &'a dyn Headers) -> RequestCtx<'a> {
        RequestCtx { client, path, headers, retry: false }
    }
}

/// Builds selectors for pools. One value per configured policy kind.
pub trait Policy: Send + Sync {
    /// Builds a selector over `pool`. Called off the hot path, on every
    /// change of the pool.
    fn build(&self, pool: Arc<Pool>) -> Arc<dyn Selector>;
}

/// Picks a backend for a request. Must not block.
pub trait Selector: Send + Sync + std::fmt::Debug {
    /// The chosen backend among those `accept` allows, or `None` when it
    /// allows none.
    fn select(&self, ctx: &RequestCtx<'_>, accept: &mut dyn FnMut(&Backend) -> bool) -> Option<Arc<Backend>>;

    /// Recomputes weights from load signals; called in the background about
    /// every 100 ms, only when [`Selector::refreshes`] says so.
    fn refresh(&self, _now_ms: u64) {}

    /// Whether [`Selector::refresh`] does anything (policies with dynamic
    /// weights): the background pass visits only those services.
    fn refreshes(&self) -> bool {
        false
    }

    /// The dynamic weights in effect, one per backend, if the policy has them.
    fn weights(&self) -> Option<Vec<f64>> {
        None
    }
}

/// A service's selection: primaries first; backups only when no primary is accepted.
#[derive(Debug)]
pub struct ServiceSelector {
    primary: Arc<dyn Selector>,
    backup: Option<Arc<dyn Selector>>,
    primaries_len: usize,
    /// Every backend; also the primaries' pool when there is no backup.
    all: Arc<Pool>,
}

impl ServiceSelector {
    /// Splits `backends` into primaries and backups and builds a selector for each.
    pub fn new(policy: &PolicySpec, backends: Vec<Arc<Backend>>) -> ServiceSelector {
        let policy = policy_for(policy);
        let all = Arc::new(Pool::new(backends));
        if !all.backends().iter().any(|b| b.backup) {
            // The usual case: no second list to build (and drop) per change.
            return ServiceSelector { primary: policy.build(all.clone()), backup: None, primaries_len: all.len(), all };
        }
        let (backups, primaries): (Vec<_>, Vec<_>) = all.backends().iter().cloned().partition(|b| b.backup);
        let backup = Some(policy.build(Arc::new(Pool::new(backups))));
        let primaries_len = primaries.len();
        ServiceSelector { primary: policy.build(Arc::new(Pool::new(primaries))), backup, primaries_len, all }
    }

    /// Whether [`ServiceSelector::refresh`] does anything.
    pub fn refreshes(&self) -> bool {
        self.primary.refreshes() || self.backup.as_ref().is_some_and(|b| b.refreshes())
    }

    /// Recomputes dynamic weights (see [`Selector::refresh`]).
    pub fn refresh(&self, now_ms: u64) {
        self.primary.refresh(now_ms);
        if let Some(b) = &self.backup {
            b.refresh(now_ms);
        }
    }

    /// Dynamic weights of the primaries, in the order of [`Self::primaries`].
    pub fn weights(&self) -> Option<Vec<f64>> {
        self.primary.weights()
    }

    /// The primary backends, in id order.
    pub fn primaries(&self) -> impl Iterator<Item = &Arc<Backend>> {
        self.all.backends().iter().filter(|b| !b.backup).take(self.primaries_len)
    }

    /// Every backend, primaries and backups, in id order.
    pub fn backends(&self) -> &[Arc<Backend>] {
        self.all.backends()
    }

    /// Picks a backend: a primary when one is accepted, else a backup.
    pub fn select(&self, ctx: &RequestCtx<'_>, accept: &mut dyn FnMut(&Backend) -> bool) -> Option<Arc<Backend>> {
        self.primary.select(ctx, accept).or_else(|| self.backup.as_ref().and_then(|b| b.select(ctx, accept)))
    }
}
