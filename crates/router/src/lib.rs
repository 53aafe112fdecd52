//! Tidegate's route table.
//!
//! [`Router`] answers "which route serves this request?" with a number of hash
//! lookups that depends on the request (host labels, path segments), never on
//! how many routes exist: exact hosts and wildcard suffixes are hash keys, and
//! so are exact paths and segment-wise path prefixes. It is a persistent data
//! structure: inserting or removing a route costs O(log n) plus the routes that
//! share its host and path, and leaves older versions intact, so the writer can
//! build the next snapshot's router from the current one without copying it.

use std::cmp::Ordering;
use std::sync::Arc;

use http::Method;
use tidegate_metrics::LazyHistogram;
use tidegate_model::{Headers, HostPattern, PathPattern, RouteName, RouteSpec};

/// A persistent map hashed with foldhash: every request looks names up
/// here, and SipHash (imbl's default) costs several times more per short
/// key. The keys are configured, not sent by clients.
type HashMap<K, V> = imbl::GenericHashMap<K, V, foldhash::fast::RandomState, imbl::shared_ptr::DefaultSharedPtr>;

/// A route as stored in the table, with what its user attached to it
/// (`A`: the snapshot attaches the route's compiled rule chain, so that a
/// request finds it with its route, not by a second lookup).
#[derive(Debug, Clone)]
pub struct Entry<A = ()> {
    /// The route's name.
    pub name: RouteName,
    /// The route.
    pub spec: Arc<RouteSpec>,
    /// Its live counters, shared by every snapshot in which the route
    /// keeps its service.
    pub stats: Arc<RouteStats>,
    /// What was attached to it ([`Router::insert_with`]).
    pub attached: A,
}

/// What the proxy measured of a route's requests.
#[derive(Debug, Default)]
pub struct RouteStats {
    /// Request durations (head received to response written) by status
    /// class, 1xx to 5xx; allocated at a class's first request.
    pub durations: [LazyHistogram; 5],
}

impl RouteStats {
    /// Counts a request answered with `status` after `d`.
    pub fn observe(&self, status: u16, d: std::time::Duration) {
        self.durations[tidegate_metrics::status_class(status)].observe(d);
    }
}

/// The routes at one (host, path) key, best first.
type Bucket<A> = Arc<Vec<Entry<A>>>;

/// The routes of one host pattern, keyed by path.
#[derive(Debug, Clone)]
struct PathTable<A> {
    exact: HashMap<Arc<str>, Bucket<A>>,
    prefix: HashMap<Arc<str>, Bucket<A>>,
    /// The lengths of `exact`'s keys.
    exact_lengths: Lengths,
    /// The lengths of `prefix`'s keys.
    prefix_lengths: Lengths,
    /// How many of its routes have each priority: once a match has the
    /// highest, no shorter prefix can beat it and the probes stop.
    priorities: std::collections::BTreeMap<i32, u32>,
}

impl<A> Default for PathTable<A> {
    fn default() -> Self {
        PathTable {
            exact: HashMap::default(),
            prefix: HashMap::default(),
            exact_lengths: Lengths::default(),
            prefix_lengths: Lengths::default(),
            priorities: std::collections::BTreeMap::new(),
        }
    }
}

/// The lengths of a map's keys (from [`Lengths::LONG`] bytes on, one
/// class): a lookup of a path no key is as long as is skipped. A request
/// for `/a/b/c` probes its prefixes `/a/b/c`, `/a/b`, `/a` and `/`; most
/// are no route's, and a bit test costs less than hashing and looking one
/// up.
#[derive(Debug, Clone, Default)]
struct Lengths {
    /// Bit `n`: some key is in length class `n`.
    bits: u128,
    /// How many keys each class has (a few classes per table).
    counts: std::collections::BTreeMap<u8, u32>,
}

impl Lengths {
    /// Lengths from here on are one class.
    const LONG: usize = 127;

    fn class(len: usize) -> u8 {
        len.min(Lengths::LONG) as u8
    }

    fn add(&mut self, len: usize) {
        let class = Lengths::class(len);
        *self.counts.entry(class).or_insert(0) += 1;
        self.bits |= 1 << class;
    }

    fn remove(&mut self, len: usize) {
        let class = Lengths::class(len);
        if let Some(n) = self.counts.get_mut(&class) {
            *n -= 1;
            if *n == 0 {
                self.counts.remove(&class);
                self.bits &= !(1 << class);
            }
        }
    }

    /// Whether a key may be `len` bytes long.
    fn may(&self, len: usize) -> bool {
        self.bits >> Lengths::class(len) & 1 == 1
    }
}

/// What a request looks like to the router.
#[derive(Debug, Clone, Copy)]
pub struct RequestView<'a> {
    /// The host, lowercase, without port (empty if the request has none).
    pub host: &'a str,
    /// The path, without query.
    pub path: &'a str,
    /// The method.
    pub method: &'a Method,
    /// The headers.
    pub headers: &'a dyn Headers,
    /// The query, without `?` (`None` when the target has none).
    pub query: Option<&'a str>,
    /// The named listener the request came on (`None`: a default
    /// listener); a route matches only on the listeners it is bound to.
    pub listener: Option<&'a str>,
}

/// An immutable, persistent route table; `A` is what each route carries
/// besides its spec and counters ([`Entry::attached`]).
#[derive(Debug, Clone)]
pub struct Router<A = ()> {
    exact_hosts: HashMap<Arc<str>, PathTable<A>>,
    wildcard_hosts: HashMap<Arc<str>, PathTable<A>>,
    any_host: PathTable<A>,
    by_name: HashMap<RouteName, Entry<A>>,
}

impl<A> Default for Router<A> {
    fn default() -> Self {
        Router {
            exact_hosts: HashMap::default(),
            wildcard_hosts: HashMap::default(),
            any_host: PathTable::default(),
            by_name: HashMap::default(),
        }
    }
}

impl<A: Clone + Default> Router<A> {
    /// Inserts or replaces a route, with nothing attached. A replaced
    /// route that keeps its service keeps its statistics.
    pub fn insert(&mut self, name: RouteName, spec: Arc<RouteSpec>) {
        self.insert_with(name, spec, A::default());
    }
}

impl Router {
    /// An empty table, of routes with nothing attached (`default()` for
    /// one that attaches something).
    pub fn new() -> Self {
        Self::default()
    }
}

impl<A: Clone> Router<A> {
    /// Number of routes.
    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    /// True when there are no routes.
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    /// Inserts or replaces a route, with `attached`. A replaced route
    /// that keeps its service keeps its statistics.
    pub fn insert_with(&mut self, name: RouteName, spec: Arc<RouteSpec>, attached: A) {
        let stats = match self.by_name.get(&name) {
            Some(old) if old.spec.service() == spec.service() => old.stats.clone(),
            _ => Arc::default(),
        };
        self.remove(&name);
        let entry = Entry { name: name.clone(), spec: spec.clone(), stats, attached };
        self.table_mut(&spec.matches.host).add(entry.clone());
        self.by_name.insert(name, entry);
    }

    /// Every route, in no particular order.
    pub fn entries(&self) -> impl Iterator<Item = &Entry<A>> {
        self.by_name.values()
    }

    /// A route by name.
    pub fn get(&self, name: &str) -> Option<&Entry<A>> {
        self.by_name.get(name)
    }

    /// Removes a route; returns whether it existed.
    pub fn remove(&mut self, name: &RouteName) -> bool {
        let Some(old) = self.by_name.remove(name) else {
            return false;
        };
        let host = old.spec.matches.host.clone();
        let table = self.table_mut(&host);
        table.drop_route(name, &old.spec);
        let empty = table.exact.is_empty() && table.prefix.is_empty();
        if empty {
            match &host {
                HostPattern::Any => {}
                HostPattern::Exact(h) => {
                    self.exact_hosts.remove(h);
                }
                HostPattern::Wildcard(s) => {
                    self.wildcard_hosts.remove(s);
                }
            }
        }
        true
    }

    fn table_mut(&mut self, host: &HostPattern) -> &mut PathTable<A> {
        match host {
            HostPattern::Any => &mut self.any_host,
            HostPattern::Exact(h) => self.exact_hosts.entry(h.clone()).or_default(),
            HostPattern::Wildcard(s) => self.wildcard_hosts.entry(s.clone()).or_default(),
        }
    }

    /// The best route for a request, if any matches.
    pub fn lookup(&self, req: &RequestView<'_>) -> Option<&Entry<A>> {
        let mut best: Option<(&Entry<A>, Rank)> = None;
        if !req.host.is_empty() {
            if let Some(t) = self.exact_hosts.get(req.host) {
                t.consider(req, u32::MAX, &mut best);
            }
            if !self.wildcard_hosts.is_empty() {
                // Each dot starts a candidate suffix: a.b.example.com tries
                // .b.example.com, .example.com, .com.
                for (i, _) in req.host.match_indices('.') {
                    let suffix = &req.host[i..];
                    if let Some(t) = self.wildcard_hosts.get(suffix) {
                        t.consider(req, suffix.len() as u32, &mut best);
                    }
                }
            }
        }
        self.any_host.consider(req, 0, &mut best);
        best.map(|(e, _)| e)
    }
}

/// How specific a candidate is; the greatest wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Rank {
    priority: i32,
    host: u32,
    /// Exact paths rank above every prefix, then longer prefixes first.
    path: u32,
    conditions: usize,
}

impl Rank {
    fn new(spec: &RouteSpec, host: u32, path: u32) -> Rank {
        Rank { priority: spec.priority, host, path, conditions: spec.matches.conditions() }
    }
}

fn conditions_hold(spec: &RouteSpec, req: &RequestView<'_>) -> bool {
    let m = &spec.matches;
    spec.serves(req.listener)
        && (m.methods.is_empty() || m.methods.contains(req.method))
        && m.headers.iter().all(|h| req.headers.any(h.name.as_str(), &mut |v| v == h.value.as_bytes()))
        && m.header_present.iter().all(|h| req.headers.first(h.as_str()).is_some())
        && m.header_regex.iter().all(|h| {
            req.headers.any(h.name.as_str(), &mut |v| std::str::from_utf8(v).is_ok_and(|v| h.regex.0.is_match(v)))
        })
        && m.query.iter().all(|q| query_has(req.query, &q.name, q.value.as_deref()))
}

/// Whether `query` has a parameter `name` (with `value`, when given),
/// both compared after form decoding (`%XX` escapes, `+` as a space).
fn query_has(query: Option<&str>, name: &str, value: Option<&str>) -> bool {
    let Some(query) = query else { return false };
    query.split('&').any(|pair| {
        let (n, v) = pair.split_once('=').unwrap_or((pair, ""));
        form_decoded_is(n, name) && value.is_none_or(|want| form_decoded_is(v, want))
    })
}

/// Whether `raw`, form-decoded, is `want` (compared as bytes; a `%` not
/// followed by two hex digits stands for itself).
fn form_decoded_is(raw: &str, want: &str) -> bool {
    let (raw, want) = (raw.as_bytes(), want.as_bytes());
    let (mut i, mut j) = (0, 0);
    while i < raw.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        let (byte, used) = match raw[i] {
            b'+' => (b' ', 1),
            b'%' => match (raw.get(i + 1).copied().and_then(hex), raw.get(i + 2).copied().and_then(hex)) {
                (Some(h), Some(l)) => ((h * 16 + l) as u8, 3),
                _ => (b'%', 1),
            },
            b => (b, 1),
        };
        if want.get(j) != Some(&byte) {
            return false;
        }
        i += used;
        j += 1;
    }
    j == want.len()
}

/// Orders a bucket: best first, ties broken by name for determinism.
fn bucket_order<A>(a: &Entry<A>, b: &Entry<A>) -> Ordering {
    let ra = Rank::new(&a.spec, 0, 0);
    let rb = Rank::new(&b.spec, 0, 0);
    rb.cmp(&ra).then_with(|| a.name.cmp(&b.name))
}

impl<A: Clone> PathTable<A> {
    fn map_for(&mut self, path: &PathPattern) -> (&mut HashMap<Arc<str>, Bucket<A>>, &mut Lengths, Arc<str>) {
        match path {
            PathPattern::Exact(p) => (&mut self.exact, &mut self.exact_lengths, p.clone()),
            PathPattern::Prefix(p) => (&mut self.prefix, &mut self.prefix_lengths, p.clone()),
        }
    }

    fn add(&mut self, entry: Entry<A>) {
        *self.priorities.entry(entry.spec.priority).or_insert(0) += 1;
        let (map, lengths, key) = self.map_for(&entry.spec.matches.path);
        if !map.contains_key(&key) {
            lengths.add(key.len());
        }
        let bucket = map.entry(key).or_default();
        let list = Arc::make_mut(bucket);
        list.push(entry);
        list.sort_by(bucket_order);
    }

    fn drop_route(&mut self, name: &RouteName, spec: &RouteSpec) {
        let (map, lengths, key) = self.map_for(&spec.matches.path);
        let mut dropped = false;
        if let Some(bucket) = map.get_mut(&key) {
            let before = bucket.len();
            Arc::make_mut(bucket).retain(|e| &e.name != name);
            dropped = bucket.len() < before;
            if bucket.is_empty() {
                map.remove(&key);
                lengths.remove(key.len());
            }
        }
        if let Some(n) = self.priorities.get_mut(&spec.priority).filter(|_| dropped) {
            *n -= 1;
            if *n == 0 {
                self.priorities.remove(&spec.priority);
            }
        }
    }

    /// Keeps in `best` the best of its current value and this table's
    /// matches (`host_rank`: how specific this table's host pattern is).
    /// Candidates come from the most specific path down: exact, then the
    /// segment-wise prefixes of "/a/b/c" ("/a/b/c", "/a/b", "/a", "/"),
    /// only those as long as some key. Once `best` has this table's highest
    /// priority and a host and path at least as specific as what is left,
    /// nothing left can beat it and the probes stop.
    fn consider<'t>(&'t self, req: &RequestView<'_>, host_rank: u32, best: &mut Option<(&'t Entry<A>, Rank)>) {
        if self.exact.is_empty() && self.prefix.is_empty() {
            return;
        }
        let top = self.priorities.last_key_value().map_or(i32::MIN, |(p, _)| *p);
        // Considers a bucket of routes at `path_rank`; says whether the
        // probes can stop.
        let mut bucket = |bucket: &'t Bucket<A>, path_rank: u32| {
            for entry in bucket.iter() {
                if !conditions_hold(&entry.spec, req) {
                    continue;
                }
                let rank = Rank::new(&entry.spec, host_rank, path_rank);
                if best.as_ref().is_none_or(|(_, b)| rank > *b) {
                    *best = Some((entry, rank));
                }
            }
            best.as_ref().is_some_and(|(_, b)| b.priority >= top && b.host >= host_rank && b.path >= path_rank)
        };
        let path = req.path;
        if self.exact_lengths.may(path.len()) {
            if let Some(b) = self.exact.get(path) {
                if bucket(b, u32::MAX) {
                    return;
                }
            }
        }
        if self.prefix.is_empty() {
            return;
        }
        let may = |len: usize| self.prefix_lengths.may(len);
        let mut probe = |prefix: &str| self.prefix.get(prefix).is_some_and(|b| bucket(b, prefix.len() as u32));
        let trimmed = path.trim_end_matches('/');
        if !trimmed.is_empty() {
            if may(trimmed.len()) && probe(trimmed) {
                return;
            }
            let bytes = trimmed.as_bytes();
            for end in (1..bytes.len()).rev() {
                if may(end) && bytes[end] == b'/' && probe(&trimmed[..end]) {
                    return;
                }
            }
        }
        if may(1) {
            probe("/");
        }
    }
}

#[cfg(test)]
mod tests;
