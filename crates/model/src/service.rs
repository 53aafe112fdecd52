//! Services: a pool of backends, a balancing policy and timeouts.

use std::fmt;

use imbl::OrdMap;
use serde::de::{self, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::invalid::{Invalid, Reason};
use crate::names::{BackendAddr, BackendId};

/// A backend's share of traffic relative to its peers. `0` sends it nothing
/// (an operator's way to drain it) while keeping it configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, schemars::JsonSchema)]
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
    type Error = Invalid;
    fn try_from(w: u32) -> Result<Self, Invalid> {
        if w > Self::MAX {
            return Err(named_range("weight", "0..=10000", w));
        }
        Ok(Weight(w))
    }
}

impl From<Weight> for u32 {
    fn from(w: Weight) -> u32 {
        w.0
    }
}

/// A ranged number refused on its own (its field named by the decode's
/// path), its name said in the message too.
fn named_range(name: &'static str, range: &str, value: impl fmt::Display) -> Invalid {
    Invalid::new("", Reason::OutOfRange { name: Some(name), range: range.into(), value: Some(value.to_string()) })
}

/// One backend of a service, as configured (`PUT /v1/services/{s}/backends/{id}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
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
    /// At most this many requests in flight to the backend (HAProxy's
    /// `maxconn`); more wait in the service's queue. Unlimited when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_conns: Option<MaxConns>,
    /// Created and owned by the autoscaler (which may drain and remove it).
    #[serde(default, skip_serializing_if = "is_false")]
    pub autoscaled: bool,
    /// Resolved from the service's `dns` name, and owned by the resolver
    /// (which removes it once the records no longer name it).
    #[serde(default, skip_serializing_if = "is_false")]
    pub dns: bool,
}

fn is_false(b: &bool) -> bool {
    !b
}

fn is_default_concurrency(c: &ConcurrencySpec) -> bool {
    *c == ConcurrencySpec::default()
}

/// A share in percent, 0..=100, checked where it is decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "u32", into = "u32")]
pub struct Percent(u32);

impl Percent {
    /// The percentage, `None` above 100.
    pub const fn new(v: u32) -> Option<Percent> {
        if v <= 100 {
            Some(Percent(v))
        } else {
            None
        }
    }

    /// The percentage.
    pub fn get(self) -> u32 {
        self.0
    }
}

impl TryFrom<u32> for Percent {
    type Error = Invalid;
    fn try_from(v: u32) -> Result<Self, Invalid> {
        Percent::new(v).ok_or_else(|| Invalid::range("", "0..=100", v))
    }
}

impl From<Percent> for u32 {
    fn from(p: Percent) -> u32 {
        p.0
    }
}

impl schemars::JsonSchema for Percent {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Percent".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({"type": "integer", "format": "uint32", "minimum": 0, "maximum": 100})
    }
}

/// A per-backend connection limit, 1..=100000.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "u32", into = "u32")]
pub struct MaxConns(u32);

impl MaxConns {
    /// The limit.
    pub fn get(self) -> u32 {
        self.0
    }
}

impl TryFrom<u32> for MaxConns {
    type Error = Invalid;
    fn try_from(v: u32) -> Result<Self, Invalid> {
        if (1..=100_000).contains(&v) {
            Ok(MaxConns(v))
        } else {
            Err(named_range("max_conns", "1..=100000", v))
        }
    }
}

impl From<MaxConns> for u32 {
    fn from(m: MaxConns) -> u32 {
        m.0
    }
}

/// Requests waiting while every backend is at its limit (`max_conns`, or
/// the learned limit of `concurrency`), HAProxy's `maxconn` queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct QueueSpec {
    /// Most requests waiting at once (default 10000, as many as the
    /// listener's default connection limit; 0: no waiting, answer 503 at
    /// once when every backend is at its limit).
    pub max: u32,
    /// Longest wait, ms (default 1000); then 503.
    pub timeout_ms: u64,
}

impl Default for QueueSpec {
    fn default() -> Self {
        QueueSpec { max: 10_000, timeout_ms: 1_000 }
    }
}

/// Learned concurrency limits: for each backend, a limit on requests in
/// flight that the proxy learns from what it sees (shed answers, timeouts,
/// and latency rising above the backend's no-load latency). Requests beyond
/// every candidate's limit wait in the service's queue (`queue`) instead of
/// being sent to a backend that would shed them. An operator's `max_conns`
/// stays a hard cap above the learned limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ConcurrencySpec {
    /// Learn the limits. Default (absent): on for the default policy and
    /// for `dynamic_feedback` (whose weights alone cannot keep a full
    /// backend from being sent more), off for the others.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub learn: Option<bool>,
    /// How far a backend's latency may rise above its no-load latency
    /// before its limit is lowered, in percent of the no-load latency
    /// (default 150: up to 1.5 times; 110..=1000).
    pub latency_tolerance_pct: u32,
    /// The limit a backend starts with (default 1), before anything is
    /// learned; it grows by a quarter per window of answers while latency
    /// stays flat. Starting low lets the first windows measure the
    /// backend's no-load latency.
    pub initial: u32,
    /// The lowest a learned limit goes (default 1).
    pub min: u32,
    /// The highest a learned limit goes (default 10000).
    pub max: u32,
    /// A latency rise smaller than this, in microseconds, is never taken
    /// for queueing at the backend (default 5000: 5 ms; 0..=10000000). On
    /// a busy machine the proxy's own scheduling adds milliseconds to the
    /// time it takes to read an answer; for backends that answer in
    /// microseconds and queue for real, lower it.
    pub min_rise_us: u64,
}

impl Default for ConcurrencySpec {
    fn default() -> Self {
        ConcurrencySpec { learn: None, latency_tolerance_pct: 150, initial: 1, min: 1, max: 10_000, min_rise_us: 5_000 }
    }
}

impl ConcurrencySpec {
    fn validate(&self) -> Result<(), Invalid> {
        if !(110..=1000).contains(&self.latency_tolerance_pct) {
            return Err(Invalid::range("concurrency.latency_tolerance_pct", "110..=1000", self.latency_tolerance_pct));
        }
        if self.min == 0 || self.max > 100_000 || self.min > self.max {
            return Err(Invalid::rule(
                "concurrency",
                format!("need 1 <= min <= max <= 100000, got min {} and max {}", self.min, self.max),
            ));
        }
        if self.min_rise_us > 10_000_000 {
            return Err(Invalid::range("concurrency.min_rise_us", "0..=10000000", self.min_rise_us));
        }
        if !(self.min..=self.max).contains(&self.initial) {
            return Err(Invalid::range("concurrency.initial", "within min..=max", self.initial));
        }
        Ok(())
    }
}

/// Connections from the proxy to a service's backends.
///
/// Each proxy worker keeps its own idle connections per backend and reuses
/// the most recently used one first (its socket buffers and the backend's
/// caches are warm). An idle connection is closed after `timeouts.idle_ms`
/// (5 s for those past `max_idle`), or at once when the backend closes it. With `"protocol": "http2"` each
/// worker keeps one multiplexed connection per backend instead.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamSpec {
    /// Most idle keep-alive connections kept per backend and per worker
    /// for `timeouts.idle_ms` (default 256, at most 100000; 0 closes every
    /// connection after its response, like HTTP/1.0). More, given back at
    /// a peak, are kept for 5 s only, for the next burst to reuse instead
    /// of opening new ones. Connections in use are not limited by it.
    /// HTTP/1.1 only.
    pub max_idle: u32,
    /// The HTTP version spoken to the backends (default `http1`). `http2`
    /// multiplexes the requests over one connection per backend and worker
    /// and carries trailers (gRPC needs it); without `tls` it is HTTP/2
    /// over cleartext with prior knowledge (h2c). Upgrades (WebSocket)
    /// always go over HTTP/1.1.
    pub protocol: UpstreamProtocol,
    /// TLS to the backends (default: none, plain TCP).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<UpstreamTls>,
    /// Sends the PROXY protocol (`v1` text or `v2` binary) at the start of
    /// every connection to the backends, before TLS if any, naming the
    /// client and the address it connected to (default: none). Backends
    /// behind it see the real client's address at the TCP level (an nginx
    /// `listen ... proxy_protocol`, HAProxy's `accept-proxy`, another
    /// Tidegate's listener). A connection so opened carries one client's
    /// requests only: it is kept idle for that client connection alone and
    /// closed with it. Health checks and probes send a header naming no
    /// client (v1 `UNKNOWN`, v2 `LOCAL`). Not with `protocol: http2`, whose
    /// one connection carries every client's requests.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub proxy_protocol: Option<ProxyProtocolVersion>,
}

impl Default for UpstreamSpec {
    fn default() -> Self {
        UpstreamSpec { max_idle: 256, protocol: UpstreamProtocol::Http1, tls: None, proxy_protocol: None }
    }
}

/// The version of the PROXY protocol sent to a service's backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ProxyProtocolVersion {
    /// Version 1: one text line (`PROXY TCP4 ...`).
    V1,
    /// Version 2: binary.
    V2,
}

/// The HTTP version the proxy speaks to a service's backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum UpstreamProtocol {
    /// HTTP/1.1 with keep-alive: one request at a time per connection.
    #[default]
    Http1,
    /// HTTP/2: many requests at once on one connection, with trailers.
    Http2,
}

/// TLS from the proxy to a service's backends.
// Its `Debug` output (below) never shows the client key.
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UpstreamTls {
    /// The server name sent in the handshake (SNI) and checked against the
    /// backend's certificate (default: the backend's host, a DNS name or an
    /// IP address, as written in its `addr`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sni: Option<String>,
    /// The certificate authorities trusted for the backends, PEM (default:
    /// the Mozilla root program's public CAs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_pem: Option<String>,
    /// Whether the backend's certificate chain and name are checked
    /// (default true). `false` encrypts without authenticating the backend:
    /// anyone on the path can pose as it. For tests only.
    #[serde(default = "yes")]
    pub verify: bool,
    /// A client certificate chain, PEM, presented to backends that ask for
    /// one (mutual TLS); given with `client_key_pem`. Default: none, and a
    /// backend that requires one refuses the connection.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_cert_pem: Option<String>,
    /// The private key of `client_cert_pem`, PEM. Read APIs show
    /// `"(redacted)"`; put back as it is, it keeps the key the service has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_key_pem: Option<String>,
}

fn yes() -> bool {
    true
}

impl fmt::Debug for UpstreamTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpstreamTls")
            .field("sni", &self.sni)
            .field("ca_pem", &self.ca_pem.as_ref().map(|_| "(given)"))
            .field("verify", &self.verify)
            .field("client_cert_pem", &self.client_cert_pem.as_ref().map(|_| "(given)"))
            .field("client_key_pem", &self.client_key_pem.as_ref().map(|_| REDACTED))
            .finish()
    }
}

impl UpstreamTls {
    /// The trusted CAs of `ca_pem`, checked: at least one certificate, and
    /// nothing that is not one.
    pub fn ca_certificates(&self) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>, Invalid> {
        use rustls::pki_types::pem::PemObject;
        const FIELD: &str = "upstream.tls.ca_pem";
        let Some(pem) = &self.ca_pem else {
            return Ok(Vec::new());
        };
        let certs = rustls::pki_types::CertificateDer::pem_slice_iter(pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| Invalid::unreadable(FIELD, format!("not PEM certificates ({e})")))?;
        if certs.is_empty() {
            return Err(Invalid::unreadable(FIELD, "no CERTIFICATE block found"));
        }
        let mut roots = rustls::RootCertStore::empty();
        for (i, c) in certs.iter().enumerate() {
            roots.add(c.clone()).map_err(|e| {
                Invalid::unreadable(FIELD, format!("certificate {i} is not a usable CA certificate ({e})"))
            })?;
        }
        Ok(certs)
    }

    /// The `sni` as a server name, checked.
    pub fn server_name(&self) -> Result<Option<rustls::pki_types::ServerName<'static>>, Invalid> {
        self.sni
            .as_deref()
            .map(|n| {
                rustls::pki_types::ServerName::try_from(n.to_string()).map_err(|_| {
                    Invalid::malformed("upstream.tls.sni", format!("{n:?}"), "is not a DNS name or IP address")
                })
            })
            .transpose()
    }

    /// The client certificate and its key, checked to match; `None`
    /// without one. A key still the placeholder [`REDACTED`] (kept from the
    /// configuration it is applied to) is not checked here: only the chain.
    pub fn client_identity(&self) -> Result<Option<rustls::sign::CertifiedKey>, Invalid> {
        const FIELDS: (&str, &str) = ("upstream.tls.client_cert_pem", "upstream.tls.client_key_pem");
        let requires = |field: &str, with: &str| Invalid::new(field, Reason::Requires { with: with.into() });
        match (&self.client_cert_pem, &self.client_key_pem) {
            (None, None) => Ok(None),
            (Some(_), None) => Err(requires(FIELDS.1, "client_cert_pem")),
            (None, Some(_)) => Err(requires(FIELDS.0, "client_key_pem")),
            (Some(cert), Some(key)) if key == REDACTED => crate::certificate::chain(cert, FIELDS.0).map(|_| None),
            (Some(cert), Some(key)) => crate::certificate::key_pair(cert, key, FIELDS).map(Some),
        }
    }

    fn validate(&self) -> Result<(), Invalid> {
        self.ca_certificates()?;
        self.server_name()?;
        if !self.verify && self.ca_pem.is_some() {
            return Err(Invalid::conflict(
                "upstream.tls.ca_pem",
                "upstream.tls.verify",
                "given with \"verify\": false, where nothing is checked",
            ));
        }
        self.client_identity()?;
        Ok(())
    }
}

/// How a service picks a backend for each request.
///
/// Selected by `"kind"`; each kind documents its own parameters. Every
/// policy only picks among backends that are available (healthy, not
/// ejected, not already tried for this request).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum PolicySpec {
    /// Smooth weighted round robin (nginx's algorithm): each backend gets its
    /// weight's share, interleaved rather than in bursts. The default.
    RoundRobin {},
    /// Weighted random choice.
    Random {},
    /// The backend with the fewest requests in flight relative to its weight.
    LeastConn {},
    /// The papers' "fair": the shortest expected response time, latency
    /// EWMA x (in flight + 1) / weight, over all backends.
    LeastTime {},
    /// Power of two choices on peak-EWMA latency x (in flight + 1) / weight
    /// (Finagle, linkerd): two random backends, the cheaper one wins.
    /// Recommended for backends of unknown or changing capacity.
    P2cEwma {
        /// Time constant of the latency average's decay, ms (default 10000).
        #[serde(default = "default_decay_ms")]
        decay_ms: u64,
    },
    /// Consistent hash of the client IP, with bounded loads.
    IpHash {
        /// No backend takes more than this factor times the average load
        /// (in flight); over it, the key moves to the next backend on the
        /// ring (default 1.25; 1.0..=10.0).
        #[serde(default)]
        balance_factor: BalanceFactor,
    },
    /// Consistent hash of the request path and query, with bounded loads.
    UriHash {
        /// See `ip_hash`.
        #[serde(default)]
        balance_factor: BalanceFactor,
    },
    /// Consistent hash of a request header's value, with bounded loads.
    /// Requests without the header are spread by round robin.
    HeaderHash {
        /// The header's name.
        header: HeaderKey,
        /// See `ip_hash`.
        #[serde(default)]
        balance_factor: BalanceFactor,
    },
    /// Consistent hash of a cookie's value (session affinity that works
    /// behind NAT and several front ends), with bounded loads. Requests
    /// without the cookie are spread by round robin.
    CookieHash {
        /// The cookie's name.
        cookie: HeaderKey,
        /// See `ip_hash`.
        #[serde(default)]
        balance_factor: BalanceFactor,
    },
    /// Dynamic feedback (paper S3): traffic in proportion to each backend's
    /// expected capacity from its load signals, recomputed in the background.
    DynamicFeedback(FeedbackSpec),
    /// Weights from backends' ORCA `endpoint-load-metrics` response headers
    /// (qps / (cpu utilization + error penalty)), as gRPC's weighted round robin.
    OrcaWrr(OrcaSpec),
    /// Prequal (NSDI 2024): asynchronous probes of each backend's requests
    /// in flight and latency; among recently probed backends, the lowest
    /// latency among the cold ones, else the fewest requests in flight.
    Prequal(PrequalSpec),
    /// Ask an external distributor over UDP for each request (paper S4).
    External(ExternalSpec),
}

fn default_decay_ms() -> u64 {
    10_000
}

/// A factor of 1.0 to 10.0 (equality and hashing by value).
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "f64", into = "f64")]
pub struct BalanceFactor(f64);

impl Eq for BalanceFactor {}

impl BalanceFactor {
    /// The factor.
    pub fn get(self) -> f64 {
        self.0
    }
}

impl Default for BalanceFactor {
    fn default() -> Self {
        BalanceFactor(1.25)
    }
}

impl TryFrom<f64> for BalanceFactor {
    type Error = Invalid;
    fn try_from(v: f64) -> Result<Self, Invalid> {
        if (1.0..=10.0).contains(&v) {
            Ok(BalanceFactor(v))
        } else {
            // Named in the text: inside a policy (a tagged enum) the
            // decode's path stops at `policy`.
            Err(named_range("balance_factor", "1.0..=10.0", v))
        }
    }
}

impl From<BalanceFactor> for f64 {
    fn from(b: BalanceFactor) -> f64 {
        b.0
    }
}

/// A header or cookie name: 1..=128 visible ASCII characters, stored lowercase
/// for headers (cookies keep their case).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "String", into = "String")]
pub struct HeaderKey(String);

impl HeaderKey {
    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for HeaderKey {
    type Error = Invalid;
    fn try_from(s: String) -> Result<Self, Invalid> {
        let ok = !s.is_empty()
            && s.len() <= 128
            && s.bytes().all(|b| b.is_ascii_graphic() && !b"()<>@,;:\\\"/[]?={}".contains(&b));
        if ok {
            Ok(HeaderKey(s))
        } else {
            Err(Invalid::malformed("", format!("{s:?}"), "is not a valid header or cookie name"))
        }
    }
}

impl From<HeaderKey> for String {
    fn from(k: HeaderKey) -> String {
        k.0
    }
}

/// Parameters of the dynamic feedback policy (paper S3).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FeedbackSpec {
    /// Exponents of the five load parameters; they must sum to 1.
    #[serde(default)]
    pub gamma: Gammas,
    /// `spare` (default): w = alpha x R_all / (1 + Q), traffic follows spare
    /// capacity. `paper`: w = Q / (1 + Q) x alpha x R_all as printed in the
    /// paper, which in M/M/1 terms is the utilization and so favours busy
    /// backends; kept for reproducing the paper.
    #[serde(default)]
    pub formula: FeedbackFormula,
    /// How often weights are recomputed, ms (default 500).
    #[serde(default = "default_feedback_interval")]
    pub interval_ms: u64,
}

fn default_feedback_interval() -> u64 {
    500
}

impl Default for FeedbackSpec {
    fn default() -> Self {
        FeedbackSpec {
            gamma: Gammas::default(),
            formula: FeedbackFormula::default(),
            interval_ms: default_feedback_interval(),
        }
    }
}

/// Which form of the S3 weight formula to use.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FeedbackFormula {
    /// Traffic follows spare capacity.
    #[default]
    Spare,
    /// The paper's formula as printed.
    Paper,
}

/// Exponents of R1 service rate, R2 CPU, R3 memory, R4 network, R5 response
/// time (each 0..=1, summing to 1; default 0.2 each).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "GammaWire", into = "GammaWire")]
pub struct Gammas {
    /// R1: service rate.
    pub rate: f64,
    /// R2: CPU availability.
    pub cpu: f64,
    /// R3: memory availability.
    pub memory: f64,
    /// R4: network availability.
    pub network: f64,
    /// R5: response time.
    pub time: f64,
}

impl Eq for Gammas {}

impl Default for Gammas {
    fn default() -> Self {
        Gammas { rate: 0.2, cpu: 0.2, memory: 0.2, network: 0.2, time: 0.2 }
    }
}

#[derive(Clone, Copy, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct GammaWire {
    rate: f64,
    cpu: f64,
    memory: f64,
    network: f64,
    time: f64,
}

impl TryFrom<GammaWire> for Gammas {
    type Error = Invalid;
    fn try_from(g: GammaWire) -> Result<Self, Invalid> {
        let all = [g.rate, g.cpu, g.memory, g.network, g.time];
        if all.iter().any(|x| !(0.0..=1.0).contains(x)) {
            return Err(Invalid::rule("gamma", "each exponent must be 0..=1"));
        }
        let sum: f64 = all.iter().sum();
        if (sum - 1.0).abs() > 1e-6 {
            return Err(Invalid::rule("gamma", format!("exponents must sum to 1, they sum to {sum}")));
        }
        Ok(Gammas { rate: g.rate, cpu: g.cpu, memory: g.memory, network: g.network, time: g.time })
    }
}

impl From<Gammas> for GammaWire {
    fn from(g: Gammas) -> GammaWire {
        GammaWire { rate: g.rate, cpu: g.cpu, memory: g.memory, network: g.network, time: g.time }
    }
}

/// Parameters of the ORCA weighted round robin policy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct OrcaSpec {
    /// A backend's reports are used only after it has reported for this
    /// long, ms (default 10000), so one early sample cannot swing traffic.
    #[serde(default = "default_blackout")]
    pub blackout_ms: u64,
    /// Reports older than this are ignored, ms (default 180000); a backend
    /// without fresh reports gets the mean weight.
    #[serde(default = "default_expiry")]
    pub expiry_ms: u64,
    /// Weight of the error rate in the cost, in hundredths (default 100 = 1.0).
    #[serde(default = "default_penalty")]
    pub error_penalty_pct: u32,
}

fn default_blackout() -> u64 {
    10_000
}
fn default_expiry() -> u64 {
    180_000
}
fn default_penalty() -> u32 {
    100
}

/// Parameters of the `prequal` policy.
///
/// A background prober sends `GET probe_path` to randomly chosen backends,
/// about `probes_per_request_pct` / 100 probes per request. A probe answer
/// gives the backend's requests in flight (RIF) and latency: from its ORCA
/// `endpoint-load-metrics` header (`named_metrics.rif`,
/// `named_metrics.latency_ms`) when present, else the proxy's own count of
/// requests in flight to it and the probe's round-trip time. ORCA headers
/// on normal responses count as probes too.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct PrequalSpec {
    /// The path probed (default `/health`).
    pub probe_path: String,
    /// Probes per request, percent (default 100: one per request; 1..=1000).
    pub probes_per_request_pct: u32,
    /// A probe answer is used for at most this many choices (default 3).
    pub reuse: u32,
    /// A probe answer older than this is not used, ms (default 1000).
    pub max_age_ms: u64,
    /// Backends whose RIF is above this quantile of the probed backends'
    /// RIFs are hot, percent (default 80; the paper's range is 60..=90).
    pub hot_quantile_pct: u32,
}

impl Default for PrequalSpec {
    fn default() -> Self {
        PrequalSpec {
            probe_path: "/health".into(),
            probes_per_request_pct: 100,
            reuse: 3,
            max_age_ms: 1_000,
            hot_quantile_pct: 80,
        }
    }
}

impl PrequalSpec {
    fn validate(&self) -> Result<(), Invalid> {
        if !request_path(&self.probe_path) {
            return Err(Invalid::malformed(
                "policy.probe_path",
                format!("{:?}", self.probe_path),
                "must be a path starting with '/'",
            ));
        }
        if !(1..=1000).contains(&self.probes_per_request_pct) {
            return Err(Invalid::range_only("policy.probes_per_request_pct", "1..=1000"));
        }
        if !(1..=100).contains(&self.reuse) {
            return Err(Invalid::range_only("policy.reuse", "1..=100"));
        }
        if !(10..=60_000).contains(&self.max_age_ms) {
            return Err(Invalid::range_only("policy.max_age_ms", "10..=60000"));
        }
        if !(1..=100).contains(&self.hot_quantile_pct) {
            return Err(Invalid::range_only("policy.hot_quantile_pct", "1..=100"));
        }
        Ok(())
    }
}

/// Parameters of the external distributor policy (paper S4).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExternalSpec {
    /// The distributor's UDP address.
    pub addr: std::net::SocketAddr,
    /// The policy name sent with each query (the distributor's choice).
    pub policy: String,
    /// How long to wait for each answer, ms (default 20).
    #[serde(default = "default_external_timeout")]
    pub timeout_ms: u64,
    /// Queries per request before falling back (default 3: the paper's
    /// "two more tries"). Then a backup backend is used, or round robin.
    #[serde(default = "default_external_tries")]
    pub tries: u32,
}

fn default_external_timeout() -> u64 {
    20
}
fn default_external_tries() -> u32 {
    3
}

impl Default for PolicySpec {
    fn default() -> Self {
        PolicySpec::RoundRobin {}
    }
}

/// Upstream timeouts of a service, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
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
        Timeouts { connect_ms: 2_000, response_ms: 60_000, idle_ms: 90_000 }
    }
}

/// Active health checks: the proxy probes each backend on its own.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ActiveCheck {
    /// `http` (default): GET `path`, healthy on an expected status. `tcp`:
    /// healthy when a connection opens.
    #[serde(default)]
    pub kind: CheckKind,
    /// Path of the HTTP probe (default `/`).
    #[serde(default = "default_check_path")]
    pub path: String,
    /// Statuses that count as healthy (default: any 2xx or 3xx).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub expect_status: Vec<u16>,
    /// Time between probes of one backend, ms (default 2000).
    #[serde(default = "default_check_interval")]
    pub interval_ms: u64,
    /// Time a probe may take, ms (default 1000).
    #[serde(default = "default_check_timeout")]
    pub timeout_ms: u64,
    /// Consecutive passing probes that bring a down backend up (default 2).
    #[serde(default = "default_rise")]
    pub rise: u32,
    /// Consecutive failing probes that take a backend down (default 3).
    #[serde(default = "default_fall")]
    pub fall: u32,
}

/// The kind of an active probe.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CheckKind {
    /// An HTTP GET.
    #[default]
    Http,
    /// A TCP connect.
    Tcp,
}

fn default_check_path() -> String {
    "/".into()
}
fn default_check_interval() -> u64 {
    2_000
}
fn default_check_timeout() -> u64 {
    1_000
}
fn default_rise() -> u32 {
    2
}
fn default_fall() -> u32 {
    3
}

/// Passive outlier detection: backends that fail real requests are ejected
/// for a while, longer each time they are ejected again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct PassiveCheck {
    /// Consecutive failures (connect errors, resets, 5xx, timeouts) that
    /// eject a backend (default 5; 0 turns ejection off).
    pub consecutive_failures: u32,
    /// First ejection time, ms (default 5000); doubled for each ejection
    /// that follows soon after the previous one.
    pub base_ejection_ms: u64,
    /// Longest ejection, ms (default 120000).
    pub max_ejection_ms: u64,
    /// At most this share of a service's backends is ejected at once, in
    /// percent (default 50), so ejection cannot empty a pool.
    pub max_ejected_percent: Percent,
}

impl Default for PassiveCheck {
    fn default() -> Self {
        PassiveCheck {
            consecutive_failures: 5,
            base_ejection_ms: 5_000,
            max_ejection_ms: 120_000,
            max_ejected_percent: Percent(50),
        }
    }
}

/// Health of a service's backends.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HealthSpec {
    /// Active probes (off unless given). A backend starts available and
    /// is taken out after `fall` failed probes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active: Option<ActiveCheck>,
    /// Passive outlier detection (on by default).
    #[serde(default)]
    pub passive: PassiveCheck,
    /// New and recovered backends ramp up their share of traffic over this
    /// long, ms (default 0: at once).
    #[serde(default)]
    pub slow_start_ms: u64,
}

/// How many retries may be in flight, relative to requests in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct RetryBudget {
    /// Retries in flight may be at most this percent of the service's
    /// requests in flight (default 20), so retries cannot multiply an outage.
    pub percent: Percent,
    /// ... but at least this many at once (default 3).
    pub min_concurrent: u32,
}

impl Default for RetryBudget {
    fn default() -> Self {
        RetryBudget { percent: Percent(20), min_concurrent: 3 }
    }
}

/// Where backends' load reports come from, besides what the proxy observes.
/// All sources run in the background; policies read the latest values.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LoadSources {
    /// Read ORCA `endpoint-load-metrics` response headers (TEXT or JSON).
    #[serde(default)]
    pub orca: bool,
    /// Scrape Prometheus `node_exporter` on each backend's host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_exporter: Option<NodeExporterSource>,
    /// Read Ganglia `gmond` XML (paper S4's monitor).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ganglia: Option<GangliaSource>,
}

/// A `node_exporter` per backend host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NodeExporterSource {
    /// The exporter's port on each backend's host (default 9100).
    #[serde(default = "default_node_exporter_port")]
    pub port: u16,
    /// Scrape interval, ms (default 1000).
    #[serde(default = "default_source_interval")]
    pub interval_ms: u64,
    /// Link capacity for network utilization, bytes/s (default 125000000 = 1 Gbit/s).
    #[serde(default = "default_link")]
    pub link_bytes_per_s: u64,
}

/// A `gmond` that reports on the backends' hosts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GangliaSource {
    /// The gmond TCP address (its XML port).
    pub addr: std::net::SocketAddr,
    /// Poll interval, ms (default 1000).
    #[serde(default = "default_source_interval")]
    pub interval_ms: u64,
    /// Link capacity for network utilization, bytes/s (default 125000000).
    #[serde(default = "default_link")]
    pub link_bytes_per_s: u64,
}

fn default_node_exporter_port() -> u16 {
    9100
}
fn default_source_interval() -> u64 {
    1_000
}
fn default_link() -> u64 {
    125_000_000
}

/// Autoscaling: Tidegate keeps between `min` and `max` instances of the
/// service, started and stopped through a provider (paper S1).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AutoscaleSpec {
    /// How instances are started and stopped.
    pub provider: ProviderSpec,
    /// Fewest instances (default 1). Backends not created by the
    /// autoscaler count toward it.
    #[serde(default = "default_min")]
    pub min: u32,
    /// Most instances (default 4).
    #[serde(default = "default_max")]
    pub max: u32,
    /// Response time over which the service is under pressure, ms (S1's 50 ms).
    #[serde(default = "default_latency_threshold")]
    pub latency_threshold_ms: u64,
    /// Requests in flight one instance should carry (default 8).
    #[serde(default = "default_target_in_flight")]
    pub target_in_flight: u32,
    /// Load must stay low this long before an instance is removed, s (S1's 300).
    #[serde(default = "default_peak_hold")]
    pub peak_hold_s: u64,
    /// The readiness probe a new instance must pass before it gets traffic.
    #[serde(default)]
    pub ready: ReadySpec,
    /// Longest wait for a draining instance's requests to finish, s (default 30).
    #[serde(default = "default_drain")]
    pub drain_timeout_s: u64,
    /// Window over which demand is averaged for scaling in, s (default 60).
    #[serde(default = "default_stable_window")]
    pub stable_window_s: u64,
    /// Short window: demand at twice the ready capacity over it scales out
    /// at once and forbids scaling in, s (default 6).
    #[serde(default = "default_panic_window")]
    pub panic_window_s: u64,
    /// Operator override: make no scaling decision while true.
    #[serde(default)]
    pub paused: bool,
    /// Operator override: keep exactly this many instances.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pinned: Option<u32>,
}

fn default_min() -> u32 {
    1
}
fn default_max() -> u32 {
    4
}
fn default_latency_threshold() -> u64 {
    50
}
fn default_target_in_flight() -> u32 {
    8
}
fn default_peak_hold() -> u64 {
    300
}
fn default_drain() -> u64 {
    30
}
fn default_stable_window() -> u64 {
    60
}
fn default_panic_window() -> u64 {
    6
}

/// A new instance's readiness probe: GET `path` every `interval_ms` until
/// it answers 2xx/3xx, for at most `timeout_s`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ReadySpec {
    /// Path of the probe (default `/`).
    pub path: String,
    /// Give up (stop the instance, retry later) after this long, s (default 30).
    pub timeout_s: u64,
    /// Time between probes, ms (default 200).
    pub interval_ms: u64,
}

impl Default for ReadySpec {
    fn default() -> Self {
        ReadySpec { path: "/".into(), timeout_s: 30, interval_ms: 200 }
    }
}

/// How the autoscaler starts and stops instances.
// Its `Debug` output (below) never shows the webhook's secret.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum ProviderSpec {
    /// Local processes (the embedded default): `command` with `{port}` and
    /// `{id}` replaced, a port from `ports`, each in its own process group.
    Process {
        /// The program and its arguments.
        command: Vec<String>,
        /// Ports to hand out, `FROM-TO`.
        ports: PortRange,
        /// Seconds between SIGTERM and SIGKILL when stopping (default 10).
        #[serde(default = "default_grace")]
        grace_s: u64,
    },
    /// User scripts that speak JSON on stdout (VMs, Nomad, a cloud CLI...).
    Command {
        /// Starts one instance; argument placeholders `{service}`, `{id}`.
        start: Vec<String>,
        /// Stops one; placeholders `{service}`, `{id}`, `{addr}`.
        stop: Vec<String>,
        /// Lists running instances (optional).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        list: Option<Vec<String>>,
    },
    /// An infrastructure service called over HTTP (paper S1), requests
    /// signed with HMAC-SHA256 of the body.
    Webhook {
        /// Where to POST start and stop requests (http://).
        url: String,
        /// Shared secret for the `X-Tidegate-Signature` header.
        secret: String,
        /// How often to poll an accepted (202) start, ms (default 500).
        #[serde(default = "default_poll")]
        poll_interval_ms: u64,
    },
}

impl fmt::Debug for ProviderSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProviderSpec::Process { command, ports, grace_s } => f
                .debug_struct("Process")
                .field("command", command)
                .field("ports", ports)
                .field("grace_s", grace_s)
                .finish(),
            ProviderSpec::Command { start, stop, list } => {
                f.debug_struct("Command").field("start", start).field("stop", stop).field("list", list).finish()
            }
            ProviderSpec::Webhook { url, secret: _, poll_interval_ms } => f
                .debug_struct("Webhook")
                .field("url", url)
                .field("secret", &REDACTED)
                .field("poll_interval_ms", poll_interval_ms)
                .finish(),
        }
    }
}

fn default_grace() -> u64 {
    10
}
fn default_poll() -> u64 {
    500
}

/// An inclusive range of TCP ports, written `FROM-TO`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "String", into = "String")]
pub struct PortRange {
    /// First port.
    pub from: u16,
    /// Last port.
    pub to: u16,
}

impl TryFrom<String> for PortRange {
    type Error = Invalid;
    fn try_from(s: String) -> Result<Self, Invalid> {
        let bad = || Invalid::malformed("ports", format!("{s:?}"), "is not FROM-TO with 1 <= FROM <= TO <= 65535");
        let (a, b) = s.split_once('-').ok_or_else(bad)?;
        let (from, to) = (a.trim().parse::<u16>().map_err(|_| bad())?, b.trim().parse::<u16>().map_err(|_| bad())?);
        if from == 0 || from > to {
            return Err(bad());
        }
        Ok(PortRange { from, to })
    }
}

impl From<PortRange> for String {
    fn from(r: PortRange) -> String {
        format!("{}-{}", r.from, r.to)
    }
}

/// Whether `path` can be sent as a request's target: it starts with `/`
/// and is a valid path and query (no spaces, control characters or other
/// bytes a request line cannot carry), so a probe that is configured is a
/// probe that can go out.
fn request_path(path: &str) -> bool {
    path.starts_with('/') && http::uri::PathAndQuery::try_from(path).is_ok()
}

impl AutoscaleSpec {
    fn validate(&self) -> Result<(), Invalid> {
        if !(1..=1_000).contains(&self.max) {
            return Err(Invalid::range("autoscale.max", "1..=1000", self.max));
        }
        if self.min > self.max {
            return Err(Invalid::range("autoscale.min", format!("at most max ({})", self.max), self.min));
        }
        if let Some(p) = self.pinned.filter(|p| !(self.min..=self.max).contains(p)) {
            return Err(Invalid::range(
                "autoscale.pinned",
                format!("within min..=max ({}..={})", self.min, self.max),
                p,
            ));
        }
        if self.target_in_flight == 0 {
            return Err(Invalid::range_only("autoscale.target_in_flight", "above 0"));
        }
        if self.latency_threshold_ms == 0 {
            return Err(Invalid::range_only("autoscale.latency_threshold_ms", "above 0"));
        }
        if self.stable_window_s > 3_600 {
            return Err(Invalid::too_large(
                "autoscale.stable_window_s",
                "3600",
                Some(self.stable_window_s.to_string()),
            ));
        }
        if self.panic_window_s == 0 || self.panic_window_s > self.stable_window_s {
            return Err(Invalid::range(
                "autoscale.panic_window_s",
                format!("1..=stable_window_s ({})", self.stable_window_s),
                self.panic_window_s,
            ));
        }
        if self.peak_hold_s > 86_400 {
            return Err(Invalid::too_large("autoscale.peak_hold_s", "86400", Some(self.peak_hold_s.to_string())));
        }
        if self.drain_timeout_s > 3_600 {
            return Err(Invalid::too_large(
                "autoscale.drain_timeout_s",
                "3600",
                Some(self.drain_timeout_s.to_string()),
            ));
        }
        let r = &self.ready;
        if !request_path(&r.path) || r.timeout_s == 0 || r.timeout_s > 3_600 || !(10..=60_000).contains(&r.interval_ms)
        {
            return Err(Invalid::rule(
                "autoscale.ready",
                "need a path starting with '/', 0 < timeout_s <= 3600, interval_ms 10..=60000",
            ));
        }
        match &self.provider {
            ProviderSpec::Process { command, .. } if command.is_empty() || command[0].is_empty() => {
                Err(Invalid::rule("autoscale.provider.command", "needs a program"))
            }
            ProviderSpec::Command { start, stop, .. }
                if start.first().is_none_or(String::is_empty) || stop.first().is_none_or(String::is_empty) =>
            {
                Err(Invalid::rule("autoscale.provider", "`start` and `stop` need a program each"))
            }
            ProviderSpec::Webhook { url, secret, .. }
                if !url.starts_with("http://")
                    || http::Uri::try_from(url.as_str()).ok().and_then(|u| u.host().map(str::is_empty))
                        != Some(false)
                    || secret.is_empty() =>
            {
                Err(Invalid::rule(
                    "autoscale.provider",
                    "webhook needs an http:// url with a host and a non-empty secret",
                ))
            }
            _ => Ok(()),
        }
    }
}

/// What read APIs show instead of a secret. Put back as it is (a
/// configuration exported and applied again), it keeps the secret the
/// service already has.
pub const REDACTED: &str = "(redacted)";

/// A secret a service can carry: read APIs show [`REDACTED`] in its place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Secret {
    /// `autoscale.provider.secret` of a webhook provider.
    WebhookSecret,
    /// `upstream.tls.client_key_pem`.
    ClientKey,
}

impl Secret {
    const ALL: [Secret; 2] = [Secret::WebhookSecret, Secret::ClientKey];

    /// Where it is in a service's spec.
    pub fn field(self) -> &'static str {
        match self {
            Secret::WebhookSecret => "autoscale.provider.secret",
            Secret::ClientKey => "upstream.tls.client_key_pem",
        }
    }
}

impl ServiceSpec {
    /// The webhook secret, if the service autoscales through a webhook.
    pub fn webhook_secret(&self) -> Option<&str> {
        self.secret(Secret::WebhookSecret)
    }

    /// The value of `secret`, if the service has it.
    pub fn secret(&self, secret: Secret) -> Option<&str> {
        match secret {
            Secret::WebhookSecret => match &self.settings.autoscale.as_ref()?.provider {
                ProviderSpec::Webhook { secret, .. } => Some(secret),
                _ => None,
            },
            Secret::ClientKey => self.settings.upstream.tls.as_ref()?.client_key_pem.as_deref(),
        }
    }

    fn secret_mut(&mut self, secret: Secret) -> Option<&mut String> {
        match secret {
            Secret::WebhookSecret => match &mut self.settings.autoscale.as_mut()?.provider {
                ProviderSpec::Webhook { secret, .. } => Some(secret),
                _ => None,
            },
            Secret::ClientKey => self.settings.upstream.tls.as_mut()?.client_key_pem.as_mut(),
        }
    }

    /// Whether it carries any secret (so read APIs must redact it).
    pub fn has_secrets(&self) -> bool {
        Secret::ALL.iter().any(|s| self.secret(*s).is_some())
    }

    /// The secrets given as the placeholder [`REDACTED`]: each keeps the
    /// one the service has where the spec is applied.
    pub fn kept_secrets(&self) -> Vec<Secret> {
        Secret::ALL.into_iter().filter(|s| self.secret(*s) == Some(REDACTED)).collect()
    }

    /// Whether any secret is the placeholder [`REDACTED`].
    pub fn keeps_secret(&self) -> bool {
        !self.kept_secrets().is_empty()
    }

    /// Replaces every secret given as the placeholder with `value`.
    pub fn fill_kept_secrets(&mut self, value: &str) {
        for s in self.kept_secrets() {
            if let Some(v) = self.secret_mut(s) {
                *v = value.to_string();
            }
        }
    }

    /// The spec as read APIs show it: secrets replaced by [`REDACTED`].
    /// Borrowed when there is nothing to hide.
    pub fn redacted(&self) -> std::borrow::Cow<'_, ServiceSpec> {
        if !self.has_secrets() {
            return std::borrow::Cow::Borrowed(self);
        }
        let mut copy = self.clone();
        for s in Secret::ALL {
            if let Some(v) = copy.secret_mut(s) {
                *v = REDACTED.to_string();
            }
        }
        std::borrow::Cow::Owned(copy)
    }

    /// This spec with each [`REDACTED`] secret replaced by `previous`'s
    /// real one; `Err` with the field at fault when it carries the
    /// placeholder and there is none to keep, or when a kept client key
    /// does not match a new client certificate.
    pub fn with_secrets_of(
        &self,
        previous: Option<&ServiceSpec>,
    ) -> Result<std::borrow::Cow<'_, ServiceSpec>, Invalid> {
        let kept = self.kept_secrets();
        if kept.is_empty() {
            return Ok(std::borrow::Cow::Borrowed(self));
        }
        let mut copy = self.clone();
        for s in kept {
            let Some(old) = previous.and_then(|p| p.secret(s)).filter(|v| *v != REDACTED) else {
                return Err(Invalid::rule(
                    s.field(),
                    format!(
                        "{REDACTED:?} is the placeholder read APIs show, and this service has no secret to keep; \
                         give the real one"
                    ),
                ));
            };
            if let Some(v) = copy.secret_mut(s) {
                *v = old.to_string();
            }
        }
        if let Some(tls) = &copy.settings.upstream.tls {
            tls.client_identity().map_err(|e| {
                Invalid::conflict(
                    Secret::ClientKey.field(),
                    "upstream.tls.client_cert_pem",
                    format!("the key kept from the service does not fit client_cert_pem ({e})"),
                )
            })?;
        }
        Ok(std::borrow::Cow::Owned(copy))
    }
}

/// Everything about a service except its backends.
///
/// It decodes in one place, whatever it is read from (the API, a file, a
/// store, the change log): the fields as written here, then
/// the checks across fields; no code can obtain one that did not pass.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, remote = "Self")]
#[schemars(rename = "ServiceSettings")]
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
    /// Retries in flight relative to requests in flight.
    #[serde(default)]
    pub retry_budget: RetryBudget,
    /// Active and passive health checks, slow start.
    #[serde(default)]
    pub health: HealthSpec,
    /// Load reports from backends (ORCA, node_exporter, Ganglia).
    #[serde(default)]
    pub load_metrics: LoadSources,
    /// Waiting for backends at their limits.
    #[serde(default)]
    pub queue: QueueSpec,
    /// Learned per-backend concurrency limits.
    #[serde(default, skip_serializing_if = "is_default_concurrency")]
    pub concurrency: ConcurrencySpec,
    /// Connections to the backends: how many idle ones are kept for reuse.
    #[serde(default)]
    pub upstream: UpstreamSpec,
    /// Autoscaling (off unless given).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscale: Option<AutoscaleSpec>,
    /// Backends from a DNS name's records, followed at their TTL (off
    /// unless given); beside or instead of `backends`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns: Option<crate::dns::DnsPool>,
}

fn default_retries() -> u32 {
    2
}

// The one decode of a service's settings: the derived field decoding
// (`remote = "Self"` makes it the inherent `ServiceSettings::deserialize`),
// then the checks across fields. Everything that decodes settings or a
// service comes through here.
impl<'de> Deserialize<'de> for ServiceSettings {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let settings = ServiceSettings::deserialize(d)?;
        settings.validate().map_err(de::Error::custom)?;
        Ok(settings)
    }
}

impl Serialize for ServiceSettings {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        ServiceSettings::serialize(self, s)
    }
}

impl Default for ServiceSettings {
    fn default() -> Self {
        ServiceSettings {
            policy: PolicySpec::default(),
            timeouts: Timeouts::default(),
            retries: default_retries(),
            retry_budget: RetryBudget::default(),
            health: HealthSpec::default(),
            load_metrics: LoadSources::default(),
            queue: QueueSpec::default(),
            concurrency: ConcurrencySpec::default(),
            upstream: UpstreamSpec::default(),
            autoscale: None,
            dns: None,
        }
    }
}

impl ServiceSettings {
    /// Whether the backends' concurrency limits are learned: as
    /// `concurrency.learn` says, else for the default policy and
    /// `dynamic_feedback`.
    pub fn learns_limits(&self) -> bool {
        let by_default = self.policy == PolicySpec::default() || matches!(self.policy, PolicySpec::DynamicFeedback(_));
        self.concurrency.learn.unwrap_or(by_default)
    }

    fn validate(&self) -> Result<(), Invalid> {
        self.concurrency.validate()?;
        let t = &self.timeouts;
        const DAY_MS: u64 = 86_400_000;
        for (field, v) in [
            ("timeouts.connect_ms", t.connect_ms),
            ("timeouts.response_ms", t.response_ms),
            ("timeouts.idle_ms", t.idle_ms),
        ] {
            if v == 0 || v > DAY_MS {
                return Err(Invalid::range(field, format!("1..={DAY_MS}"), v));
            }
        }
        if self.retries > 10 {
            return Err(Invalid::range("retries", "0..=10", self.retries));
        }
        if let Some(a) = &self.autoscale {
            a.validate()?;
        }
        if let Some(d) = &self.dns {
            d.validate()?;
        }
        if self.queue.max > 1_000_000 {
            return Err(Invalid::range("queue.max", "0..=1000000", self.queue.max));
        }
        if !(1..=DAY_MS).contains(&self.queue.timeout_ms) {
            return Err(Invalid::range("queue.timeout_ms", format!("1..={DAY_MS}"), self.queue.timeout_ms));
        }
        if self.upstream.max_idle > 100_000 {
            return Err(Invalid::range("upstream.max_idle", "0..=100000", self.upstream.max_idle));
        }
        if let Some(tls) = &self.upstream.tls {
            tls.validate()?;
        }
        if self.upstream.proxy_protocol.is_some() && self.upstream.protocol == UpstreamProtocol::Http2 {
            return Err(Invalid::conflict(
                "upstream.proxy_protocol",
                "upstream.protocol",
                "the PROXY protocol names one client per connection; an HTTP/2 connection carries every client's requests",
            ));
        }
        let h = &self.health;
        if let Some(a) = &h.active {
            if !request_path(&a.path) {
                return Err(Invalid::malformed(
                    "health.active.path",
                    format!("{:?}", a.path),
                    "must be a path starting with '/'",
                ));
            }
            for (field, v) in [("interval_ms", a.interval_ms), ("timeout_ms", a.timeout_ms)] {
                if !(10..=DAY_MS).contains(&v) {
                    return Err(Invalid::range(format!("health.active.{field}"), format!("10..={DAY_MS}"), v));
                }
            }
            if a.timeout_ms > a.interval_ms {
                return Err(Invalid::conflict(
                    "health.active.timeout_ms",
                    "health.active.interval_ms",
                    "must not exceed interval_ms",
                ));
            }
            for (field, v) in [("rise", a.rise), ("fall", a.fall)] {
                if !(1..=100).contains(&v) {
                    return Err(Invalid::range(format!("health.active.{field}"), "1..=100", v));
                }
            }
            if let Some(bad) = a.expect_status.iter().find(|s| !(100..=599).contains(*s)) {
                return Err(Invalid::malformed(
                    "health.active.expect_status",
                    bad.to_string(),
                    "is not an HTTP status",
                ));
            }
        }
        let p = &h.passive;
        if p.max_ejection_ms > DAY_MS {
            return Err(Invalid::too_large(
                "health.passive.max_ejection_ms",
                format!("{DAY_MS} (one day)"),
                Some(p.max_ejection_ms.to_string()),
            ));
        }
        if p.base_ejection_ms == 0 || p.base_ejection_ms > p.max_ejection_ms {
            return Err(Invalid::range(
                "health.passive.base_ejection_ms",
                format!("1..=max_ejection_ms ({})", p.max_ejection_ms),
                p.base_ejection_ms,
            ));
        }
        if h.slow_start_ms > DAY_MS {
            return Err(Invalid::too_large("health.slow_start_ms", "one day", None));
        }
        match &self.policy {
            PolicySpec::P2cEwma { decay_ms } if !(1..=DAY_MS).contains(decay_ms) => {
                return Err(Invalid::range_only("policy.decay_ms", format!("1..={DAY_MS}")));
            }
            PolicySpec::DynamicFeedback(f) if !(10..=DAY_MS).contains(&f.interval_ms) => {
                return Err(Invalid::range_only("policy.interval_ms", format!("10..={DAY_MS}")));
            }
            PolicySpec::Prequal(p) => p.validate()?,
            PolicySpec::OrcaWrr(o) => {
                if o.blackout_ms > DAY_MS {
                    return Err(Invalid::range("policy.blackout_ms", format!("0..={DAY_MS}"), o.blackout_ms));
                }
                if !(1..=DAY_MS).contains(&o.expiry_ms) {
                    return Err(Invalid::range("policy.expiry_ms", format!("1..={DAY_MS}"), o.expiry_ms));
                }
            }
            PolicySpec::External(e) => {
                if e.addr.port() == 0 || e.addr.ip().is_unspecified() {
                    return Err(Invalid::malformed("policy.addr", e.addr.to_string(), "is not an address to send to"));
                }
                if !(1..=10_000).contains(&e.timeout_ms) || !(1..=10).contains(&e.tries) {
                    return Err(Invalid::rule("policy", "external needs timeout_ms 1..=10000 and tries 1..=10"));
                }
                if e.policy.is_empty() || e.policy.len() > 64 {
                    return Err(Invalid::rule(
                        "policy.policy",
                        "the distributor policy name must be 1..=64 characters",
                    ));
                }
            }
            _ => {}
        }
        for (field, v) in [
            ("load_metrics.node_exporter.interval_ms", self.load_metrics.node_exporter.as_ref().map(|n| n.interval_ms)),
            ("load_metrics.ganglia.interval_ms", self.load_metrics.ganglia.as_ref().map(|g| g.interval_ms)),
        ] {
            if let Some(v) = v.filter(|v| !(100..=DAY_MS).contains(v)) {
                return Err(Invalid::range(field, format!("100..={DAY_MS}"), v));
            }
        }
        if self.load_metrics.node_exporter.as_ref().is_some_and(|n| n.port == 0) {
            return Err(Invalid::range_only("load_metrics.node_exporter.port", "1..=65535"));
        }
        let links = [
            self.load_metrics.node_exporter.as_ref().map(|n| n.link_bytes_per_s),
            self.load_metrics.ganglia.as_ref().map(|g| g.link_bytes_per_s),
        ];
        if links.iter().flatten().any(|&l| l == 0) {
            return Err(Invalid::rule("load_metrics", "link_bytes_per_s must be above 0"));
        }
        Ok(())
    }
}

/// A service: settings plus its backends keyed by id (`PUT /v1/services/{name}`).
///
/// On the wire it is one object: the fields of [`ServiceSettings`] and
/// `backends`, a list of `{"id", "addr", "weight", "backup", "max_conns"}`;
/// duplicate ids are rejected. It decodes through the one validated path
/// of [`ServiceSettings`], whichever door it comes through.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ServiceSpec {
    /// Policy, timeouts, retries.
    pub settings: ServiceSettings,
    /// The pool, ordered by id.
    pub backends: OrdMap<BackendId, BackendSpec>,
}

/// The entry a map carries besides the fields of the type it decodes as:
/// `backends` beside a service's settings, `id` beside a backend's spec.
struct Split<'a, A, E> {
    inner: A,
    key: &'static str,
    taken: &'a mut Option<E>,
}

impl<'de, A: MapAccess<'de>, E: Deserialize<'de>> MapAccess<'de> for Split<'_, A, E> {
    type Error = A::Error;

    fn next_key_seed<K: de::DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, A::Error> {
        loop {
            let Some(key) = self.inner.next_key::<String>()? else {
                return Ok(None);
            };
            if key != self.key {
                let key: de::value::StringDeserializer<A::Error> = de::IntoDeserializer::into_deserializer(key);
                return seed.deserialize(key).map(Some);
            }
            if self.taken.is_some() {
                return Err(de::Error::duplicate_field(self.key));
            }
            *self.taken = Some(self.inner.next_value()?);
        }
    }

    fn next_value_seed<V: de::DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, A::Error> {
        self.inner.next_value_seed(seed)
    }
}

/// Decodes a map as a `T`, the entry `key` taken out first and decoded as
/// an `E`: one type's fields and one more, with `T`'s own checks (unknown
/// fields, defaults, validation) and the map's field paths intact.
fn split_map<'de, A, E, T>(map: A, key: &'static str) -> Result<(Option<E>, T), A::Error>
where
    A: MapAccess<'de>,
    E: Deserialize<'de>,
    T: Deserialize<'de>,
{
    let mut taken = None;
    let rest = T::deserialize(de::value::MapAccessDeserializer::new(Split { inner: map, key, taken: &mut taken }))?;
    Ok((taken, rest))
}

/// The schema of `T` (an object) with one more property, `key`, of type `E`.
fn schema_with<T: schemars::JsonSchema, E: schemars::JsonSchema>(
    generator: &mut schemars::SchemaGenerator,
    key: &str,
    description: &str,
    required: bool,
    about: &str,
) -> schemars::Schema {
    let mut schema = T::json_schema(generator);
    let mut extra = generator.subschema_for::<E>();
    extra.insert("description".into(), description.into());
    if !required {
        extra.insert("default".into(), serde_json::json!([]));
    }
    schema.insert("description".into(), about.into());
    if let Some(props) = schema.get_mut("properties").and_then(serde_json::Value::as_object_mut) {
        props.insert(key.into(), extra.into());
    }
    if required {
        match schema.get_mut("required").and_then(serde_json::Value::as_array_mut) {
            Some(list) => list.insert(0, key.into()),
            None => {
                schema.insert("required".into(), serde_json::json!([key]));
            }
        }
    }
    schema
}

impl schemars::JsonSchema for ServiceSpec {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "ServiceSpec".into()
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schema_with::<ServiceSettings, Vec<ListedBackend>>(
            generator,
            "backends",
            "The backends: a list of `{\"id\", \"addr\", \"weight\", \"backup\", \"max_conns\"}`, ids unique.",
            false,
            "A service: settings plus its backends keyed by id (`PUT /v1/services/{name}`).\n\nOn the wire the \
             backends are a list of `{\"id\", \"addr\", \"weight\", \"backup\"}`;\nduplicate ids are rejected.",
        )
    }
}

/// A backend as listed inside a service: its id and its [`BackendSpec`].
struct ListedBackend(BackendId, BackendSpec);

impl schemars::JsonSchema for ListedBackend {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "ListedBackend".into()
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schema_with::<BackendSpec, BackendId>(
            generator,
            "id",
            "The backend's id within the service (unique in the list).",
            true,
            "A backend as listed inside a service.",
        )
    }
}

impl<'de> Deserialize<'de> for ListedBackend {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ListedBackend;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a backend: its id, addr and settings")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<ListedBackend, A::Error> {
                match split_map::<A, BackendId, BackendSpec>(map, "id")? {
                    (Some(id), spec) => Ok(ListedBackend(id, spec)),
                    (None, _) => Err(de::Error::missing_field("id")),
                }
            }
        }
        d.deserialize_map(V)
    }
}

#[derive(Serialize)]
struct ListedRef<'a> {
    id: &'a BackendId,
    #[serde(flatten)]
    spec: &'a BackendSpec,
}

struct Backends(OrdMap<BackendId, BackendSpec>);

impl<'de> Deserialize<'de> for Backends {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Backends;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list of backends")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Backends, A::Error> {
                let mut map = OrdMap::new();
                let mut index = 0usize;
                while let Some(ListedBackend(id, spec)) = seq.next_element()? {
                    if map.contains_key(&id) {
                        return Err(de::Error::custom(format!("[{index}].id: duplicate backend id {:?}", id.as_str())));
                    }
                    map.insert(id, spec);
                    index += 1;
                }
                Ok(Backends(map))
            }
        }
        d.deserialize_seq(V)
    }
}

impl<'de> Deserialize<'de> for ServiceSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ServiceSpec;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a service: its settings and backends")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<ServiceSpec, A::Error> {
                // The settings decode (and are validated) as `ServiceSettings`.
                let (backends, settings) = split_map::<A, Backends, ServiceSettings>(map, "backends")?;
                Ok(ServiceSpec { settings, backends: backends.map(|b| b.0).unwrap_or_default() })
            }
        }
        d.deserialize_map(V)
    }
}

impl Serialize for ServiceSpec {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        struct List<'a>(&'a OrdMap<BackendId, BackendSpec>);
        impl Serialize for List<'_> {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_seq(self.0.iter().map(|(id, spec)| ListedRef { id, spec }))
            }
        }
        #[derive(Serialize)]
        struct Out<'a> {
            #[serde(flatten)]
            settings: &'a ServiceSettings,
            backends: List<'a>,
        }
        Out { settings: &self.settings, backends: List(&self.backends) }.serialize(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_paths_must_be_sendable() {
        assert!(request_path("/healthz") && request_path("/h?x=1"));
        for bad in ["healthz", "/a b", "/h\u{1}", "/a`b", "/h\u{7f}"] {
            assert!(!request_path(bad), "{bad:?}");
        }
    }

    #[test]
    fn a_minimal_service_gets_defaults() {
        let s: ServiceSpec = serde_json::from_str(r#"{"backends":[{"id":"a","addr":"127.0.0.1:9001"}]}"#).unwrap();
        assert_eq!(s.settings.policy, PolicySpec::RoundRobin {});
        assert_eq!(s.backends.len(), 1);
        let b = s.backends.values().next().unwrap();
        assert_eq!(b.weight.get(), 1);
        assert!(!b.backup);
    }

    #[test]
    fn duplicate_ids_unknown_fields_and_bad_values_are_rejected() {
        let dup = r#"{"backends":[{"id":"a","addr":"127.0.0.1:1"},{"id":"a","addr":"127.0.0.1:2"}]}"#;
        let err = serde_json::from_str::<ServiceSpec>(dup).unwrap_err().to_string();
        assert!(err.contains("[1].id: duplicate"), "{err}");
        assert!(serde_json::from_str::<ServiceSpec>(r#"{"bogus":1}"#).is_err());
        assert!(serde_json::from_str::<ServiceSpec>(r#"{"policy":{"kind":"nope"}}"#).is_err());
        assert!(serde_json::from_str::<ServiceSpec>(r#"{"policy":{"kind":"random","x":1}}"#).is_err());
        assert!(serde_json::from_str::<ServiceSpec>(r#"{"timeouts":{"connect_ms":0}}"#).is_err());
        let heavy = r#"{"backends":[{"id":"a","addr":"127.0.0.1:1","weight":10001}]}"#;
        assert!(serde_json::from_str::<ServiceSpec>(heavy).is_err());
        for (bad, field) in [
            (r#"{"policy":{"kind":"orca_wrr","blackout_ms":18446744073709551615}}"#, "policy.blackout_ms"),
            (r#"{"policy":{"kind":"orca_wrr","expiry_ms":0}}"#, "policy.expiry_ms"),
            (r#"{"policy":{"kind":"external","addr":"0.0.0.0:0","policy":"round_robin"}}"#, "policy.addr"),
            (r#"{"load_metrics":{"node_exporter":{"port":0}}}"#, "load_metrics.node_exporter.port"),
            (r#"{"queue":{"max":1000001}}"#, "queue.max"),
            (
                r#"{"autoscale":{"min":3,"max":2,"provider":{"kind":"command","start":["a"],"stop":["b"]}}}"#,
                "autoscale.min",
            ),
        ] {
            let err = serde_json::from_str::<ServiceSpec>(bad).unwrap_err().to_string();
            assert!(err.contains(field), "{bad}: {err}");
        }
    }

    /// Settings decode through one validated path however they arrive: on
    /// their own (as the stores keep them), inside a service, from a JSON
    /// value, inside a change set; each refusal names the field.
    #[test]
    fn every_door_decodes_through_the_one_validated_path() {
        let bad = [
            (r#"{"timeouts":{"connect_ms":0}}"#, "timeouts.connect_ms"),
            (r#"{"retries":11}"#, "retries"),
            (r#"{"queue":{"timeout_ms":0}}"#, "queue.timeout_ms"),
            (r#"{"health":{"slow_start_ms":86400001}}"#, "health.slow_start_ms"),
            (r#"{"concurrency":{"latency_tolerance_pct":5}}"#, "concurrency.latency_tolerance_pct"),
            (r#"{"upstream":{"max_idle":100001}}"#, "upstream.max_idle"),
            (r#"{"upstream":{"protocol":"http2","proxy_protocol":"v2"}}"#, "upstream.proxy_protocol"),
        ];
        for (text, field) in bad {
            let settings = crate::parse_json::<ServiceSettings>(text.as_bytes()).unwrap_err();
            assert_eq!(settings.field, field, "{text}: {settings}");
            let err = serde_json::from_str::<ServiceSettings>(text).unwrap_err().to_string();
            assert!(err.starts_with(&format!("{field}: ")), "{text}: {err}");
            let value: serde_json::Value = serde_json::from_str(text).unwrap();
            let err = serde_json::from_value::<ServiceSettings>(value.clone()).unwrap_err().to_string();
            assert!(err.starts_with(&format!("{field}: ")), "{text}: {err}");
            let spec = crate::parse_json::<ServiceSpec>(text.as_bytes()).unwrap_err();
            assert_eq!(spec.field, field, "{text}: {spec}");
            let change = serde_json::json!({"ops": [{"op": "put_service", "name": "web", "spec": value}]});
            let err = crate::parse_change_set(change.to_string().as_bytes()).unwrap_err();
            assert_eq!((err.op, err.field.as_str()), (Some(0), format!("ops[0].spec.{field}").as_str()), "{err}");
        }
        // Ranges that are types name their field through the decode's path.
        for (text, field) in [
            (r#"{"health":{"passive":{"max_ejected_percent":101}}}"#, "health.passive.max_ejected_percent"),
            (r#"{"retry_budget":{"percent":101}}"#, "retry_budget.percent"),
        ] {
            let err = crate::parse_json::<ServiceSpec>(text.as_bytes()).unwrap_err();
            assert_eq!(err.field, field, "{text}: {err}");
            assert!(err.message.starts_with("must be 0..=100, got 101"), "{err}");
        }
        // A backend names its field, listed or on its own.
        let listed = r#"{"backends":[{"id":"a","addr":"h:1"},{"id":"b","addr":"h:2","weight":10001}]}"#;
        assert_eq!(crate::parse_json::<ServiceSpec>(listed.as_bytes()).unwrap_err().field, "backends[1].weight");
        let alone = crate::parse_json::<BackendSpec>(br#"{"addr":"nope"}"#).unwrap_err();
        assert_eq!(alone.field, "addr", "{alone}");
        for (text, want) in [
            (r#"{"backends":[{"addr":"h:1"}]}"#, "missing field `id`"),
            (r#"{"backends":[{"id":"a"}]}"#, "missing field `addr`"),
            (r#"{"backends":[{"id":"a","id":"b","addr":"h:1"}]}"#, "duplicate field `id`"),
            (r#"{"backends":[{"id":"a","addr":"h:1","bogus":1}]}"#, "unknown field `bogus`"),
            (r#"{"backends":[],"backends":[]}"#, "duplicate field `backends`"),
            (r#"{"bogus":1}"#, "unknown field `bogus`"),
        ] {
            let err = crate::parse_json::<ServiceSpec>(text.as_bytes()).unwrap_err().to_string();
            assert!(err.contains(want), "{text}: {err}");
        }
        // What is stored decodes back to itself; a default block is not written.
        let spec: ServiceSpec = serde_json::from_str(r#"{"retries":3,"backends":[{"id":"a","addr":"h:1"}]}"#).unwrap();
        let stored = serde_json::to_string(&spec.settings).unwrap();
        assert!(!stored.contains("backends") && !stored.contains("concurrency"), "{stored}");
        assert_eq!(serde_json::from_str::<ServiceSettings>(&stored).unwrap(), spec.settings);
        assert!(serde_json::from_str::<ServiceSettings>(r#"{"backends":[]}"#).is_err(), "settings carry no backends");
    }

    /// The checks return the field and a typed reason; the text the API
    /// and the stores show is made from them.
    #[test]
    fn refusals_are_typed_with_the_field() {
        let mut s = ServiceSettings::default();
        s.timeouts.connect_ms = 0;
        let e = s.validate().unwrap_err();
        assert_eq!(e.field, "timeouts.connect_ms");
        assert_eq!(e.reason, Reason::OutOfRange { name: None, range: "1..=86400000".into(), value: Some("0".into()) });
        assert_eq!(e.to_string(), "timeouts.connect_ms: must be 1..=86400000, got 0");
        let mut s = ServiceSettings::default();
        s.health.active = Some(ActiveCheck {
            kind: CheckKind::Http,
            path: "/".into(),
            expect_status: vec![],
            interval_ms: 100,
            timeout_ms: 200,
            rise: 1,
            fall: 1,
        });
        let e = s.validate().unwrap_err();
        assert!(matches!(&e.reason, Reason::Conflict { with, .. } if with == "health.active.interval_ms"), "{e:?}");
        assert_eq!(e.to_string(), "health.active.timeout_ms: must not exceed interval_ms");
        let e = Weight::try_from(10_001).unwrap_err();
        assert!(e.field.is_empty() && matches!(e.reason, Reason::OutOfRange { name: Some("weight"), .. }), "{e:?}");
        let tls = UpstreamTls {
            sni: None,
            ca_pem: None,
            verify: true,
            client_cert_pem: None,
            client_key_pem: Some("k".into()),
        };
        let e = tls.client_identity().unwrap_err();
        assert_eq!(e.field, "upstream.tls.client_cert_pem");
        assert_eq!(e.reason, Reason::Requires { with: "client_key_pem".into() });
        // A placeholder with nothing to keep names the secret's field.
        let spec = ServiceSpec {
            settings: ServiceSettings {
                autoscale: Some(AutoscaleSpec {
                    provider: ProviderSpec::Webhook {
                        url: "http://h/".into(),
                        secret: REDACTED.into(),
                        poll_interval_ms: 500,
                    },
                    min: 1,
                    max: 2,
                    latency_threshold_ms: 50,
                    target_in_flight: 8,
                    peak_hold_s: 300,
                    ready: ReadySpec::default(),
                    drain_timeout_s: 30,
                    stable_window_s: 60,
                    panic_window_s: 6,
                    paused: false,
                    pinned: None,
                }),
                ..ServiceSettings::default()
            },
            backends: OrdMap::new(),
        };
        let e = spec.with_secrets_of(None).unwrap_err();
        assert!(matches!((e.field.as_str(), &e.reason), ("autoscale.provider.secret", Reason::Rule(_))), "{e:?}");
    }

    #[test]
    fn a_service_round_trips_through_json() {
        let text = r#"{"policy":{"kind":"least_conn"},"backends":[{"id":"b","addr":"h:1","weight":3,"backup":true}]}"#;
        let s: ServiceSpec = serde_json::from_str(text).unwrap();
        let again: ServiceSpec = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert_eq!(s, again);
    }

    #[test]
    fn learned_limits_default_to_the_default_policy_and_are_validated() {
        let parse = |t: &str| serde_json::from_str::<ServiceSpec>(t);
        assert!(parse("{}").unwrap().settings.learns_limits());
        assert!(!parse(r#"{"policy":{"kind":"random"}}"#).unwrap().settings.learns_limits());
        assert!(parse(r#"{"policy":{"kind":"dynamic_feedback"}}"#).unwrap().settings.learns_limits());
        let on = parse(r#"{"policy":{"kind":"random"},"concurrency":{"learn":true}}"#).unwrap();
        assert!(on.settings.learns_limits());
        assert!(!parse(r#"{"concurrency":{"learn":false}}"#).unwrap().settings.learns_limits());
        // The default block is not written back; a changed one is.
        assert!(!serde_json::to_string(&parse("{}").unwrap()).unwrap().contains("concurrency"));
        let text = serde_json::to_string(&on).unwrap();
        assert!(text.contains(r#""concurrency":{"learn":true"#), "{text}");
        assert_eq!(parse(&text).unwrap(), on);
        for (bad, field) in [
            (r#"{"concurrency":{"latency_tolerance_pct":100}}"#, "latency_tolerance_pct"),
            (r#"{"concurrency":{"min":0}}"#, "min"),
            (r#"{"concurrency":{"min":5,"max":4,"initial":4}}"#, "min"),
            (r#"{"concurrency":{"initial":0}}"#, "initial"),
            (r#"{"concurrency":{"bogus":1}}"#, "bogus"),
        ] {
            let err = parse(bad).unwrap_err().to_string();
            assert!(err.contains(field), "{bad}: {err}");
        }
    }
}
