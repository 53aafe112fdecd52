//! Tidegate's traffic rule engine: what a route's rule sets do to a
//! request and its response, with no IO.
//!
//! [`Chain::compile`] turns the rule sets a route runs into one chain of
//! compiled steps, once per snapshot (regexes, network sets, header names
//! and values, templates and limiter tables are built there, never per
//! request). [`Chain::request`] evaluates the request phase on an
//! engine-neutral [`RequestView`] and returns an [`Outcome`]: let it
//! through with [`Forward`] edits (a new path, still normalized and with
//! no dot segment; header edits, the Host sent upstream; the body limit;
//! the response phase's [`ResponsePlan`]), answer it ([`Answer`]:
//! redirect, refusal, 401 with `WWW-Authenticate`, 429 with
//! `Retry-After`, 413, a CORS preflight), or wait for work the proxy does
//! off the request path ([`Pending`]: a password check on a blocking
//! thread, a forward-auth sub-request) and then [`Chain::resume`].
//!
//! After the response's head, [`ResponsePlan::compression`] chooses the
//! coding and [`response::compression_head`] edits the head; a
//! [`Compressor`] (gzip, brotli, zstd) encodes the body pushed through it
//! (see [`compress`]).
//!
//! Limiter state (token buckets, in-flight counts) lives in the compiled
//! chain: each route that runs a rule set counts on its own, and a chain
//! compiled again (its route or one of its rule sets changed) starts with
//! full buckets. Tables are bounded (see [`bucket`]).

pub mod auth;
pub mod bucket;
pub mod cidr;
pub mod compress;
pub mod path;
pub mod response;

use std::net::IpAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

use http::{HeaderName, HeaderValue, Method};
use smallvec::SmallVec;
use tidegate_model::rules::{self as model, LimitKey, Step};
use tidegate_model::{Headers, RuleSetName, RuleSetSpec};

pub use auth::{AuthAnswer, AuthRequest, PasswordCheck};
pub use bucket::Permit;
pub use compress::{CompressError, Compressor};
pub use response::{HeaderEdit, ResponsePlan};

/// A request as the rules see it, whatever engine holds it.
pub struct RequestView<'a> {
    /// The method.
    pub method: &'a Method,
    /// The routing host (lowercase, without port).
    pub host: &'a str,
    /// The normalized path.
    pub path: &'a str,
    /// The query, without `?`.
    pub query: Option<&'a str>,
    /// The request's header fields.
    pub headers: &'a dyn Headers,
    /// The client's address (behind `--trusted-proxies`, the forwarded one).
    pub client: IpAddr,
    /// Whether the client came over TLS.
    pub tls: bool,
    /// The body's declared length, if any.
    pub content_length: Option<u64>,
}

/// Which step decided or changed something, for logs and metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleRef {
    /// The rule set.
    pub set: RuleSetName,
    /// The step's index in it.
    pub step: usize,
    /// The step's kind (`rate_limit`).
    pub kind: &'static str,
}

/// An answer the proxy gives instead of forwarding.
#[derive(Debug, Clone)]
pub struct Answer {
    /// The status.
    pub status: u16,
    /// Header fields to send.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// A short plain-text body.
    pub body: &'static str,
    /// For a refusal by a forward-auth service: send its body on as the
    /// answer's body (the proxy kept it).
    pub relay_auth_body: bool,
    /// The step that answered.
    pub rule: RuleRef,
}

/// What to do to a request that goes on to the backend.
#[derive(Debug, Default)]
pub struct Forward {
    /// The path to send upstream, if a step changed it:
    /// [`Forward::path`].
    path: NewPath,
    /// The chain's header edits that the edits below point into (the
    /// calling thread's copy, taken with the first such edit).
    edits: Option<Arc<Edits>>,
    /// Request header edits, in order (`host` among them sets the Host
    /// sent upstream): [`Forward::request_edits`].
    request_headers: SmallVec<[EditAt; 4]>,
    /// Response header edits, in order (CORS's among them):
    /// [`Forward::response_edits`].
    response_headers: SmallVec<[EditAt; 4]>,
    /// The edits made for this request (not a step's own).
    made: Vec<HeaderEdit>,
    /// The largest body to take (413 when `Content-Length` says more, and
    /// the stream is cut when it carries more).
    pub max_body: Option<u64>,
    /// The response phase's compression.
    pub response: ResponsePlan,
    /// Held while the request is in flight (concurrency limits).
    pub permits: Vec<Permit>,
    /// The steps that changed the request, by their index in the chain
    /// ([`Chain::changed_rules`] names them): indexes, not names, so that
    /// the request path copies nothing shared between cores.
    pub changed: SmallVec<[u16; 8]>,
}

/// The path a chain left.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
enum NewPath {
    /// No step changed it.
    #[default]
    Same,
    /// The request's own path from this byte on (a stripped prefix: no
    /// copy is made), and its length then.
    Tail(usize, usize),
    /// A path made for the request.
    Made(String),
}

impl NewPath {
    /// `new`, as a tail of `request_path` when it is one (no copy), else
    /// copied.
    fn of(request_path: &str, new: &str) -> NewPath {
        let from = (new.as_ptr() as usize).wrapping_sub(request_path.as_ptr() as usize);
        match request_path.get(from..) {
            Some(tail) if std::ptr::eq(tail, new) => NewPath::Tail(from, new.len()),
            _ => NewPath::Made(new.to_string()),
        }
    }
}

/// Where one of a request's header edits is: a step of the chain (its
/// edit is read in the chain's [`Edits`], never copied per request:
/// cloning a header's name and value would touch reference counts that
/// every core serving the route shares), or one made for the request (a
/// forward-auth answer's field, CORS's, a client certificate's) in
/// [`Forward`]'s own list.
#[derive(Debug, Clone, Copy)]
enum EditAt {
    Step(u16),
    Made(u16),
}

impl Forward {
    /// The path to send upstream, if a step changed it; `request_path` is
    /// the path the chain was given ([`RequestView::path`]).
    pub fn path<'a>(&'a self, request_path: &'a str) -> Option<&'a str> {
        match &self.path {
            NewPath::Same => None,
            // A tail of the path it was taken from; of another path (never
            // given), "/" rather than a wrong slice.
            NewPath::Tail(from, len) => {
                Some(request_path.get(*from..).filter(|t| t.len() == *len && t.starts_with('/')).unwrap_or("/"))
            }
            NewPath::Made(p) => Some(p),
        }
    }

    /// Whether a step changed the path.
    pub fn changes_path(&self) -> bool {
        self.path != NewPath::Same
    }

    /// The request header edits, in order.
    pub fn request_edits(&self) -> impl Iterator<Item = &HeaderEdit> + Clone + '_ {
        self.resolve(&self.request_headers)
    }

    /// The response header edits, in order.
    pub fn response_edits(&self) -> impl Iterator<Item = &HeaderEdit> + Clone + '_ {
        self.resolve(&self.response_headers)
    }

    /// The request header edits as lines ([`Lines`]), when they are the
    /// chain's request header steps' and nothing else.
    pub fn request_lines(&self) -> Option<&Lines> {
        self.lines(&self.request_headers, self.edits.as_deref().and_then(|e| e.request.as_ref()))
    }

    /// The same, of the response header edits.
    pub fn response_lines(&self) -> Option<&Lines> {
        self.lines(&self.response_headers, self.edits.as_deref().and_then(|e| e.response.as_ref()))
    }

    fn lines<'f>(&self, at: &[EditAt], lines: Option<&'f Lines>) -> Option<&'f Lines> {
        lines.filter(|l| {
            at.len() == l.steps.len()
                && at.iter().zip(&l.steps[..]).all(|(a, s)| matches!(a, EditAt::Step(i) if i == s))
        })
    }

    /// Whether any response header edit is to be made.
    pub fn edits_response(&self) -> bool {
        !self.response_headers.is_empty()
    }

    /// Adds a request header edit after those there.
    pub fn add_request_edit(&mut self, edit: HeaderEdit) {
        let at = self.made(edit);
        self.request_headers.push(at);
    }

    /// Adds request header edits after those there, in order.
    pub fn add_request_edits(&mut self, edits: impl IntoIterator<Item = HeaderEdit>) {
        for edit in edits {
            self.add_request_edit(edit);
        }
    }

    /// Adds a response header edit after those there.
    pub fn add_response_edit(&mut self, edit: HeaderEdit) {
        let at = self.made(edit);
        self.response_headers.push(at);
    }

    /// Applies the response header edits to a response's headers.
    pub fn apply_response_headers(&self, headers: &mut http::HeaderMap) {
        for e in self.response_edits() {
            e.apply(headers);
        }
    }

    fn made(&mut self, edit: HeaderEdit) -> EditAt {
        self.made.push(edit);
        EditAt::Made(u16::try_from(self.made.len() - 1).unwrap_or(u16::MAX))
    }

    fn resolve<'f>(&'f self, at: &'f [EditAt]) -> impl Iterator<Item = &'f HeaderEdit> + Clone + 'f {
        at.iter().filter_map(move |a| match *a {
            EditAt::Step(i) => self.edits.as_deref()?.list.get(usize::from(i)),
            EditAt::Made(i) => self.made.get(usize::from(i)),
        })
    }
}

/// Work to do off the request path before the chain goes on.
#[derive(Debug)]
pub enum Work {
    /// Check a password (slow on purpose): run [`PasswordCheck::verify`]
    /// on a blocking thread.
    Password(PasswordCheck),
    /// Ask an auth service: make the sub-request, with its timeout.
    ForwardAuth(AuthRequest),
}

/// A chain waiting for [`Work`]: give the result to [`Chain::resume`]
/// (or [`Chain::auth_failed`] when the auth service did not answer).
#[derive(Debug)]
pub struct Pending {
    /// What to do.
    pub work: Work,
    /// Where the chain stopped, and what it had done.
    pub resume: Resume,
}

/// The state of a chain stopped at a step.
#[derive(Debug)]
pub struct Resume {
    next: usize,
    at: usize,
    rule: RuleRef,
    forward: Box<Forward>,
}

/// What the request phase decided.
#[derive(Debug)]
pub enum Outcome {
    /// Forward it, with these edits (boxed: the engines keep it for the
    /// whole exchange, and it moves through the chain as one pointer).
    Forward(Box<Forward>),
    /// Answer it.
    Answer(Answer),
    /// Do this first, then resume.
    Pending(Pending),
}

/// The result of [`Work`].
#[derive(Debug)]
pub enum WorkResult {
    /// The password check's verdict.
    Password(bool),
    /// The auth service's answer.
    ForwardAuth(AuthAnswer),
}

enum Compiled {
    StripPrefix(model::PathPrefix),
    Rewrite(model::RewritePath),
    /// The index of its edit in the chain's [`Edits`].
    ReqHeader(u16),
    /// The same, of a response header edit.
    RespHeader(u16),
    Redirect(model::Redirect),
    Deny(u16),
    IpAllow(cidr::CidrSet),
    IpDeny(cidr::CidrSet),
    Basic(model::BasicAuth),
    ForwardAuth(model::ForwardAuth),
    /// The key, the buckets, whether the rate is shared among instances.
    Rate(LimitKey, bucket::Buckets, bool),
    Concurrency(LimitKey, Arc<bucket::InFlight>),
    MaxBody(u64),
    Cors(model::Cors),
    Compress(Arc<model::Compress>),
}

struct Slot {
    rule: RuleRef,
    step: Compiled,
}

/// A chain's header edits, in step order. The chain keeps one copy per
/// stripe, each on cache lines of its own: a request holds the copy of
/// its thread, so that the reference count it takes and drops is not
/// passed back and forth between the cores serving the route.
#[derive(Debug)]
#[repr(align(128))]
struct Edits {
    /// Every step's edit, by index.
    list: Vec<HeaderEdit>,
    /// The request header steps' edits as lines, when they can be.
    request: Option<Lines>,
    /// The same, of the response header steps.
    response: Option<Lines>,
}

impl Edits {
    /// The edits `list`; `request` and `response` the indexes of the
    /// request and response header steps' edits in it, in step order.
    fn new(list: Vec<HeaderEdit>, request: &[u16], response: &[u16]) -> Edits {
        let request = Lines::of(&list, request);
        let response = Lines::of(&list, response);
        Edits { list, request, response }
    }
}

/// A chain's header edits of one side (request or response) written out
/// once, when it compiles: each sets or adds a field no other of them
/// names, so that in a head which has none of their fields (the usual
/// case: fields the client or the backend did not send) they are these
/// lines added at its end, one copy. [`Forward::request_lines`] and
/// [`Forward::response_lines`] give them when a request's edits are
/// exactly these.
#[derive(Debug, PartialEq, Eq)]
pub struct Lines {
    /// The edits they stand for, by index in the chain's list, in order.
    steps: Box<[u16]>,
    /// The fields they name (lowercase, as [`HeaderName`]s are).
    names: Box<[HeaderName]>,
    /// `name: value` and CRLF for each edit, in order, then the CRLF of
    /// the empty line that ends a head.
    bytes: Box<[u8]>,
    /// Bit `n % 64` set for a name `n` bytes long: most fields of a head
    /// are told apart from the names by their length alone.
    lengths: u64,
}

impl Lines {
    /// The lines of the edits at `steps` of `list`, if they are all sets
    /// or adds of distinct fields (at least one).
    fn of(list: &[HeaderEdit], steps: &[u16]) -> Option<Lines> {
        let (mut names, mut bytes) = (Vec::new(), Vec::new());
        for &at in steps {
            let (HeaderEdit::Set(n, v) | HeaderEdit::Add(n, v) | HeaderEdit::SetIfAbsent(n, v)) =
                list.get(usize::from(at))?
            else {
                return None;
            };
            if names.contains(n) {
                return None;
            }
            names.push(n.clone());
            for part in [n.as_str().as_bytes(), b": ", v.as_bytes(), b"\r\n"] {
                bytes.extend_from_slice(part);
            }
        }
        bytes.extend_from_slice(b"\r\n");
        let lengths = names.iter().fold(0u64, |m, n| m | 1 << (n.as_str().len() % 64));
        (!names.is_empty()).then(|| Lines { steps: steps.into(), names: names.into(), bytes: bytes.into(), lengths })
    }

    /// Whether `name` (any case) is one of [`Lines::names`]. A name of a
    /// length none of them has is told apart without reading it: `name`
    /// is only called then.
    pub fn names_field<'n>(&self, len: usize, name: impl FnOnce() -> &'n [u8]) -> bool {
        self.lengths >> (len % 64) & 1 == 1 && {
            let name = name();
            self.names.iter().any(|n| n.as_str().as_bytes().eq_ignore_ascii_case(name))
        }
    }

    /// The fields the edits name (lowercase).
    pub fn names(&self) -> impl Iterator<Item = &[u8]> {
        self.names.iter().map(|n| n.as_str().as_bytes())
    }

    /// The lines to add to a head that has none of [`Lines::names`],
    /// followed by the empty line that ends a head: what replaces the
    /// head's own empty line.
    pub fn head_end(&self) -> &[u8] {
        &self.bytes
    }
}

/// Stripes of a chain's counters: each thread adds to its own stripe
/// (threads past this many share), so that the cores serving one route do
/// not pass its counters' cache lines back and forth on every request.
const STRIPES: usize = 4;

/// The stripe of the calling thread (of counters and edits).
fn stripe() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static STRIPE: usize = NEXT.fetch_add(1, Relaxed) % STRIPES;
    }
    STRIPE.with(|s| *s)
}

/// What each step of a chain did: per stripe, two counters per step
/// (answered, changed), each stripe in lines of its own (two stripes never
/// share a cache line, however the allocator places them).
struct Counts {
    stripes: [Box<[Line]>; STRIPES],
}

/// Counters on cache lines of their own (128 bytes: the pair of lines
/// that adjacent-line prefetching moves together).
#[repr(align(128))]
struct Line([AtomicU64; PER_LINE]);

/// Counters on one [`Line`].
const PER_LINE: usize = 16;

impl Counts {
    fn new(steps: usize) -> Counts {
        let lines = (2 * steps).div_ceil(PER_LINE);
        Counts {
            stripes: std::array::from_fn(|_| {
                (0..lines).map(|_| Line(std::array::from_fn(|_| AtomicU64::new(0)))).collect()
            }),
        }
    }

    fn counter(stripe: &[Line], at: usize, changed: bool) -> Option<&AtomicU64> {
        let i = 2 * at + usize::from(changed);
        stripe.get(i / PER_LINE).map(|line| &line.0[i % PER_LINE])
    }

    fn add(&self, at: usize, changed: bool) {
        Counts::add_to(&self.stripes[stripe()], at, changed);
    }

    fn add_to(stripe: &[Line], at: usize, changed: bool) {
        if let Some(c) = Counts::counter(stripe, at, changed) {
            c.fetch_add(1, Relaxed);
        }
    }

    fn sum(&self, at: usize, changed: bool) -> u64 {
        self.stripes.iter().filter_map(|s| Counts::counter(s, at, changed)).map(|c| c.load(Relaxed)).sum()
    }
}

/// What a step of a chain did, since the chain was compiled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepCounts<'a> {
    /// The step.
    pub rule: &'a RuleRef,
    /// Requests it answered (a redirect, a refusal, a challenge, a
    /// rate limit's 429, a CORS preflight, an auth service's answer).
    pub answered: u64,
    /// Requests it changed (their path or request headers).
    pub changed: u64,
}

/// The compiled rule sets of one route, in order.
pub struct Chain {
    route: Arc<str>,
    steps: Vec<Slot>,
    /// The steps' header edits, one copy per stripe.
    edits: [Arc<Edits>; STRIPES],
    /// What each step did.
    counts: Counts,
    /// Live instances sharing `per_instance_share` rates, when set for
    /// this chain alone (0: the process's count, [`set_live_instances`]).
    instances: std::sync::atomic::AtomicU32,
}

impl std::fmt::Debug for Chain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chain").field("route", &self.route).field("steps", &self.steps.len()).finish()
    }
}

/// Compiles a step; its header edit, if any, goes to `edits`.
fn compile_step(step: &Step, edits: &mut Vec<HeaderEdit>) -> Compiled {
    let mut edit = |e: HeaderEdit| {
        edits.push(e);
        u16::try_from(edits.len() - 1).unwrap_or(u16::MAX)
    };
    match step {
        Step::StripPrefix(s) => Compiled::StripPrefix(s.prefix.clone()),
        Step::RewritePath(r) => Compiled::Rewrite(r.clone()),
        Step::SetRequestHeader(h) => Compiled::ReqHeader(edit(HeaderEdit::Set(h.name.0.clone(), h.value.0.clone()))),
        Step::AddRequestHeader(h) => Compiled::ReqHeader(edit(HeaderEdit::Add(h.name.0.clone(), h.value.0.clone()))),
        Step::RemoveRequestHeader(h) => Compiled::ReqHeader(edit(HeaderEdit::Remove(h.name.0.clone()))),
        Step::SetResponseHeader(h) => Compiled::RespHeader(edit(match h.only_if_absent {
            true => HeaderEdit::SetIfAbsent(h.name.0.clone(), h.value.0.clone()),
            false => HeaderEdit::Set(h.name.0.clone(), h.value.0.clone()),
        })),
        Step::AddResponseHeader(h) => Compiled::RespHeader(edit(HeaderEdit::Add(h.name.0.clone(), h.value.0.clone()))),
        Step::RemoveResponseHeader(h) => Compiled::RespHeader(edit(HeaderEdit::Remove(h.name.0.clone()))),
        Step::Redirect(r) => Compiled::Redirect(r.clone()),
        Step::Deny(d) => Compiled::Deny(d.status.get()),
        Step::IpAllow(l) => Compiled::IpAllow(cidr::CidrSet::new(&l.cidrs)),
        Step::IpDeny(l) => Compiled::IpDeny(cidr::CidrSet::new(&l.cidrs)),
        Step::BasicAuth(b) => Compiled::Basic(b.clone()),
        Step::ForwardAuth(f) => Compiled::ForwardAuth(f.clone()),
        Step::RateLimit(r) => Compiled::Rate(
            r.key.clone(),
            bucket::Buckets::new(r.rate_per_s.millis(), r.bucket(), bucket::DEFAULT_KEYS),
            r.per_instance_share,
        ),
        Step::ConcurrencyLimit(c) => {
            Compiled::Concurrency(c.key.clone(), Arc::new(bucket::InFlight::new(c.max.get(), bucket::DEFAULT_KEYS)))
        }
        Step::MaxBodyBytes(m) => Compiled::MaxBody(m.bytes.get()),
        Step::Cors(c) => Compiled::Cors(c.clone()),
        Step::Compress(c) => Compiled::Compress(Arc::new(c.clone())),
    }
}

/// Live instances of the cluster this process belongs to (1 outside
/// cluster mode).
static LIVE_INSTANCES: AtomicU32 = AtomicU32::new(1);

/// Tells every chain of the process how many instances are live (cluster
/// mode, from the instance records in etcd): a `rate_limit` with
/// `per_instance_share` admits its rate divided by it. At least 1.
pub fn set_live_instances(n: u32) {
    LIVE_INSTANCES.store(n.max(1), Relaxed);
}

/// What a limit counts a request by (hashed by the tables, never kept).
#[derive(Hash)]
enum KeyRef<'a> {
    Ip(IpAddr),
    Route,
    Header(Option<&'a [u8]>),
}

fn limit_key<'a>(key: &LimitKey, req: &RequestView<'a>) -> KeyRef<'a> {
    match key {
        LimitKey::ClientIp => KeyRef::Ip(req.client),
        LimitKey::Route => KeyRef::Route,
        LimitKey::Header(h) => KeyRef::Header(req.headers.first(h.as_str())),
    }
}

fn text(status: u16) -> &'static str {
    match status {
        401 => "authentication required\n",
        403 => "forbidden\n",
        413 => "request body too large\n",
        429 => "too many requests\n",
        503 => "the authentication service did not answer\n",
        // A CORS preflight's 204 has no body, nor has a redirect here.
        s if s == 204 || (300..400).contains(&s) => "",
        _ => "refused\n",
    }
}

impl Chain {
    /// Compiles `sets` (the route's rule sets, in its order) for the
    /// route `route`. Values were checked when decoded: this cannot fail.
    pub fn compile(route: &str, sets: &[(RuleSetName, Arc<RuleSetSpec>)]) -> Chain {
        let (mut steps, mut edits) = (Vec::new(), Vec::new());
        for (name, spec) in sets {
            for (i, step) in spec.steps.iter().enumerate() {
                let rule = RuleRef { set: name.clone(), step: i, kind: step.kind() };
                steps.push(Slot { rule, step: compile_step(step, &mut edits) });
            }
        }
        let counts = Counts::new(steps.len());
        let (mut request, mut response) = (Vec::new(), Vec::new());
        for s in &steps {
            match s.step {
                Compiled::ReqHeader(i) => request.push(i),
                Compiled::RespHeader(i) => response.push(i),
                _ => {}
            }
        }
        Chain {
            route: Arc::from(route),
            steps,
            edits: std::array::from_fn(|_| Arc::new(Edits::new(edits.clone(), &request, &response))),
            counts,
            instances: std::sync::atomic::AtomicU32::new(0),
        }
    }

    /// Sets how many instances this chain's shared rates are divided
    /// among, in place of the process's count ([`set_live_instances`]).
    /// At least 1.
    pub fn set_live_instances(&self, n: u32) {
        self.instances.store(n.max(1), std::sync::atomic::Ordering::Relaxed);
    }

    fn live_instances(&self) -> u32 {
        match self.instances.load(Relaxed) {
            0 => LIVE_INSTANCES.load(Relaxed).max(1),
            n => n,
        }
    }

    /// The route it was compiled for.
    pub fn route(&self) -> &str {
        &self.route
    }

    /// What each step did since the chain was compiled, in order (for
    /// metrics: a chain compiled again counts from zero).
    pub fn counts(&self) -> impl Iterator<Item = StepCounts<'_>> {
        self.steps.iter().enumerate().map(|(at, s)| StepCounts {
            rule: &s.rule,
            answered: self.counts.sum(at, false),
            changed: self.counts.sum(at, true),
        })
    }

    /// The steps that changed a request ([`Forward::changed`]), named.
    pub fn changed_rules<'c>(&'c self, fwd: &'c Forward) -> impl Iterator<Item = &'c RuleRef> + 'c {
        fwd.changed.iter().filter_map(|&at| self.steps.get(usize::from(at)).map(|s| &s.rule))
    }

    /// Counts (on the calling thread's `stripe`) that the step at `at`
    /// changed the request, and notes it.
    fn changed(&self, stripe: &[Line], at: usize, fwd: &mut Forward) {
        Counts::add_to(stripe, at, true);
        fwd.changed.push(u16::try_from(at).unwrap_or(u16::MAX));
    }

    /// Whether it has no step (the proxy may skip it).
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }

    /// Runs the request phase from the first step.
    pub fn request(self: &Arc<Self>, req: &RequestView<'_>, now: Instant) -> Outcome {
        self.run(req, now, 0, Box::default())
    }

    /// Goes on after [`Work`], with its result.
    pub fn resume(
        self: &Arc<Self>,
        req: &RequestView<'_>,
        now: Instant,
        resume: Resume,
        result: WorkResult,
    ) -> Outcome {
        let Resume { next, at, rule: _, mut forward } = resume;
        let Some(slot) = self.steps.get(at) else { return Outcome::Forward(forward) };
        match (&slot.step, result) {
            (Compiled::Basic(b), WorkResult::Password(true)) => {
                if !b.forward_authorization {
                    forward.add_request_edit(HeaderEdit::Remove(http::header::AUTHORIZATION));
                }
            }
            (Compiled::Basic(b), _) => return Outcome::Answer(self.unauthorized(at, slot, &b.realm)),
            (Compiled::ForwardAuth(f), WorkResult::ForwardAuth(answer)) => {
                if !(200..300).contains(&answer.status) {
                    let headers = auth::RELAYED
                        .iter()
                        .flat_map(|n| {
                            answer.headers.get_all(*n).iter().map(|v| (HeaderName::from_static(n), v.clone()))
                        })
                        .collect();
                    self.counts.add(at, false);
                    return Outcome::Answer(Answer {
                        status: answer.status,
                        headers,
                        body: "",
                        relay_auth_body: true,
                        rule: slot.rule.clone(),
                    });
                }
                for name in &f.copy_headers {
                    match answer.headers.get(&name.0) {
                        Some(v) => forward.add_request_edit(HeaderEdit::Set(name.0.clone(), v.clone())),
                        // Never let a client supply what the auth service
                        // would have said.
                        None => forward.add_request_edit(HeaderEdit::Remove(name.0.clone())),
                    }
                }
                self.changed(&self.counts.stripes[stripe()], at, &mut forward);
            }
            _ => return Outcome::Answer(self.answer(at, slot, 503, Vec::new())),
        }
        self.run(req, now, next, forward)
    }

    /// The answer when the auth service of the pending step did not answer
    /// (down, refused, timed out): 503, never let through.
    pub fn auth_failed(&self, resume: Resume) -> Answer {
        if resume.at < self.steps.len() {
            self.counts.add(resume.at, false);
        }
        Answer { status: 503, headers: Vec::new(), body: text(503), relay_auth_body: false, rule: resume.rule }
    }

    fn answer(&self, at: usize, slot: &Slot, status: u16, headers: Vec<(HeaderName, HeaderValue)>) -> Answer {
        self.counts.add(at, false);
        Answer { status, headers, body: text(status), relay_auth_body: false, rule: slot.rule.clone() }
    }

    fn unauthorized(&self, at: usize, slot: &Slot, realm: &str) -> Answer {
        self.answer(at, slot, 401, vec![(http::header::WWW_AUTHENTICATE, auth::challenge(realm))])
    }

    /// The chain's edit `index`, for `fwd` (which then holds the copy of
    /// the edits of `stripe`).
    fn refer(&self, stripe: usize, index: u16, fwd: &mut Forward) -> EditAt {
        if fwd.edits.is_none() {
            fwd.edits = Some(Arc::clone(&self.edits[stripe]));
        }
        EditAt::Step(index)
    }

    /// The path as the steps before left it (read only by the steps that
    /// read it).
    fn path<'a>(fwd: &'a Forward, req: &RequestView<'a>) -> &'a str {
        fwd.path(req.path).unwrap_or(req.path)
    }

    fn run(self: &Arc<Self>, req: &RequestView<'_>, now: Instant, from: usize, mut fwd: Box<Forward>) -> Outcome {
        let stripe = stripe();
        let counts = &self.counts.stripes[stripe];
        for (at, slot) in self.steps.iter().enumerate().skip(from) {
            match &slot.step {
                Compiled::StripPrefix(p) => {
                    if let Some(rest) = path::strip_prefix(Chain::path(&fwd, req), p.as_str()) {
                        fwd.path = NewPath::of(req.path, rest);
                        self.changed(counts, at, &mut fwd);
                    }
                }
                Compiled::Rewrite(r) => {
                    let path = Chain::path(&fwd, req);
                    if let Some(caps) = r.regex.0.captures(path) {
                        let parts = self.parts(req, path);
                        match path::checked(path::expand(&r.replacement, &parts, Some(&caps))) {
                            Ok(p) => {
                                fwd.path = NewPath::Made(p);
                                self.changed(counts, at, &mut fwd);
                            }
                            Err(_) => return Outcome::Answer(self.answer(at, slot, 400, Vec::new())),
                        }
                    }
                }
                Compiled::ReqHeader(index) => {
                    let edit = self.refer(stripe, *index, &mut fwd);
                    fwd.request_headers.push(edit);
                    self.changed(counts, at, &mut fwd);
                }
                Compiled::RespHeader(index) => {
                    let edit = self.refer(stripe, *index, &mut fwd);
                    fwd.response_headers.push(edit);
                }
                Compiled::Redirect(r) => {
                    let path = Chain::path(&fwd, req);
                    let caps = match &r.regex {
                        Some(re) => match re.0.captures(path) {
                            Some(c) => Some(c),
                            None => continue,
                        },
                        None => None,
                    };
                    let target = path::expand(&r.location, &self.parts(req, path), caps.as_ref());
                    let Ok(location) = HeaderValue::from_str(&target) else {
                        return Outcome::Answer(self.answer(at, slot, 400, Vec::new()));
                    };
                    return Outcome::Answer(self.answer(
                        at,
                        slot,
                        r.status.get(),
                        vec![(http::header::LOCATION, location)],
                    ));
                }
                Compiled::Deny(status) => return Outcome::Answer(self.answer(at, slot, *status, Vec::new())),
                Compiled::IpAllow(set) if !set.contains(req.client) => {
                    return Outcome::Answer(self.answer(at, slot, 403, Vec::new()))
                }
                Compiled::IpDeny(set) if set.contains(req.client) => {
                    return Outcome::Answer(self.answer(at, slot, 403, Vec::new()))
                }
                Compiled::IpAllow(_) | Compiled::IpDeny(_) => {}
                Compiled::Basic(b) => {
                    return match auth::basic_check(b, req.headers.first("authorization")) {
                        Some(check) => Outcome::Pending(Pending {
                            work: Work::Password(check),
                            resume: Resume { next: at + 1, at, rule: slot.rule.clone(), forward: fwd },
                        }),
                        None => Outcome::Answer(self.unauthorized(at, slot, &b.realm)),
                    };
                }
                Compiled::ForwardAuth(f) => {
                    let call = auth::forward_request(f, req, Chain::path(&fwd, req));
                    return Outcome::Pending(Pending {
                        work: Work::ForwardAuth(call),
                        resume: Resume { next: at + 1, at, rule: slot.rule.clone(), forward: fwd },
                    });
                }
                Compiled::Rate(key, buckets, shared) => {
                    let share = if *shared { self.live_instances() } else { 1 };
                    if let bucket::Admit::No(wait) = buckets.take_share(limit_key(key, req), now, share) {
                        let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
                        let headers = vec![(http::header::RETRY_AFTER, HeaderValue::from(secs.max(1)))];
                        return Outcome::Answer(self.answer(at, slot, 429, headers));
                    }
                }
                Compiled::Concurrency(key, table) => match table.enter(limit_key(key, req)) {
                    Some(permit) => fwd.permits.push(permit),
                    None => {
                        let headers = vec![(http::header::RETRY_AFTER, HeaderValue::from(1u32))];
                        return Outcome::Answer(self.answer(at, slot, 429, headers));
                    }
                },
                Compiled::MaxBody(max) => {
                    if req.content_length.is_some_and(|n| n > *max) {
                        return Outcome::Answer(self.answer(at, slot, 413, Vec::new()));
                    }
                    fwd.max_body = Some(fwd.max_body.map_or(*max, |m| m.min(*max)));
                }
                Compiled::Cors(c) => {
                    let preflight = req.headers.first("access-control-request-method").is_some();
                    match response::cors(c, req.method, req.headers.first("origin"), preflight) {
                        response::CorsVerdict::Preflight(headers) => {
                            return Outcome::Answer(self.answer(at, slot, 204, headers));
                        }
                        response::CorsVerdict::Simple(edits) => {
                            edits.into_iter().for_each(|e| fwd.add_response_edit(e))
                        }
                        response::CorsVerdict::None => {}
                    }
                }
                Compiled::Compress(c) => fwd.response.compress = Some(c.clone()),
            }
        }
        Outcome::Forward(fwd)
    }

    fn parts<'a>(&self, req: &RequestView<'a>, path: &'a str) -> path::Parts<'a> {
        path::Parts { scheme: if req.tls { "https" } else { "http" }, host: req.host, path, query: req.query }
    }
}

#[cfg(test)]
mod tests;
