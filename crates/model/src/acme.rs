//! Certificates Tidegate obtains and renews itself through ACME (RFC 8555).
//!
//! A managed certificate is a certificate object with an `acme` block
//! ([`AcmeSpec`]: the hosts, the CA's directory, the challenge) instead of
//! a chain and a key. What the ACME manager learns (the account, the
//! issued chain and key, the challenge answers every instance must give,
//! renewal and failure bookkeeping) is its [`AcmeState`], written back
//! through the configuration's own change log (`acme_state` ops), so it is
//! durable, shared by every instance of a cluster, and live on each at
//! the next handshake.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::certificate::{chain, KeyedChain};
use crate::invalid::Invalid;

/// How the CA checks that Tidegate answers for a host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
pub enum ChallengeKind {
    /// The CA fetches `http://HOST/.well-known/acme-challenge/TOKEN`; the
    /// proxy's plain listener answers it before routing. Needs port 80.
    #[serde(rename = "http-01")]
    Http01,
    /// The CA opens TLS to `HOST:443` offering ALPN `acme-tls/1`; the TLS
    /// listener answers with a validation certificate. Needs port 443.
    #[serde(rename = "tls-alpn-01")]
    TlsAlpn01,
    /// The CA looks up a TXT record at `_acme-challenge.HOST`, which the
    /// `dns_hook` sets and removes. The only kind that can issue wildcards.
    #[serde(rename = "dns-01")]
    Dns01,
}

impl ChallengeKind {
    /// The name RFC 8555 and the configuration use (`http-01`).
    pub fn as_str(self) -> &'static str {
        match self {
            ChallengeKind::Http01 => "http-01",
            ChallengeKind::TlsAlpn01 => "tls-alpn-01",
            ChallengeKind::Dns01 => "dns-01",
        }
    }
}

/// The command that sets and removes a DNS-01 TXT record.
///
/// Tidegate runs `command[0]` with `command[1..]` followed by three
/// arguments: `set` or `clear`, the record's name
/// (`_acme-challenge.shop.example.`, fully qualified) and its value. Exit
/// status 0 means done; anything else fails the order (and is shown as its
/// last error).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DnsHook {
    /// The program and its first arguments. The program is an absolute
    /// path, or a name looked up in `PATH`.
    pub command: Vec<String>,
    /// Seconds to wait after `set` succeeded before asking the CA to look
    /// (DNS providers take time to publish a record everywhere). 0..=3600,
    /// default 0.
    #[serde(default)]
    pub wait_s: u32,
    /// Seconds the command may run before it is killed and the order
    /// fails. 1..=600, default 60.
    #[serde(default = "default_hook_timeout")]
    pub timeout_s: u32,
}

fn default_hook_timeout() -> u32 {
    60
}

/// On-demand issuance: a certificate for a server name nobody configured,
/// obtained during the first handshake that asks for it, when the name is
/// allowed. Every name issued becomes a managed certificate of its own
/// (named `TEMPLATE.NAME`), renewed like the others.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct OnDemand {
    /// `http://` URL asked before issuing for a name: `GET URL?domain=NAME`
    /// answering 200 allows it, anything else (or no answer within 5 s)
    /// refuses it. Answers are kept 10 minutes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ask: Option<String>,
    /// Names allowed without asking: `shop.example` or `*.customers.example`
    /// (one label). With `ask` as well, a name must match a pattern and be
    /// allowed by the URL.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub patterns: Vec<String>,
    /// Most certificates this template may issue (1..=100000, default
    /// 1000).
    #[serde(default = "default_on_demand_max")]
    pub max_certificates: u32,
}

fn default_on_demand_max() -> u32 {
    1000
}

impl OnDemand {
    /// Whether `name` (lowercase, no trailing dot) matches a pattern (true
    /// when there are none: then the `ask` URL alone decides).
    pub fn matches(&self, name: &str) -> bool {
        self.patterns.is_empty()
            || self.patterns.iter().any(|p| match p.strip_prefix('*') {
                Some(suffix) => {
                    name.len() > suffix.len()
                        && name.ends_with(suffix)
                        && !name[..name.len() - suffix.len()].contains('.')
                }
                None => p == name,
            })
    }
}

/// The `acme` block of a managed certificate (`PUT
/// /v1/certificates/{name}` with `{"acme": {...}}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "AcmeWire", into = "AcmeWire")]
#[schemars(with = "AcmeWire")]
pub struct AcmeSpec {
    wire: AcmeWire,
    /// `directory_ca_pem`'s certificates, when given.
    directory_ca: Option<Arc<Vec<rustls::pki_types::CertificateDer<'static>>>>,
}

impl Eq for AcmeSpec {}

/// The `acme` block as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct AcmeWire {
    /// The DNS names the certificate is for (1..=100), lowercase on read;
    /// `*.example.com` only with the `dns-01` challenge. IP addresses are
    /// refused.
    hosts: Vec<String>,
    /// The CA's ACME directory URL, `https://`: Let's Encrypt's is
    /// `https://acme-v02.api.letsencrypt.org/directory` (staging:
    /// `https://acme-staging-v02.api.letsencrypt.org/directory`).
    directory: String,
    /// `http-01`, `tls-alpn-01` or `dns-01`.
    challenge: ChallengeKind,
    /// Where the CA may write about the account (`mailto:ops@example.com`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    contact: Option<String>,
    /// CA certificates (PEM) to trust for the directory's own HTTPS, for a
    /// private CA or a test server; by default the Mozilla roots
    /// (webpki-roots) are trusted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    directory_ca_pem: Option<String>,
    /// When to renew, as a fraction of the certificate's lifetime: 0.1..=0.95,
    /// default 2/3 (a 90-day certificate renews 30 days before it
    /// expires). Each certificate gets a little jitter, and a CA's renewal
    /// information (RFC 9773), when it offers it, can bring the time
    /// earlier.
    #[serde(default = "default_renew_after")]
    renew_after: f64,
    /// With `dns-01`: the command that sets and removes the TXT record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    dns_hook: Option<DnsHook>,
    /// Issue for server names during their first handshake (a template:
    /// `hosts` stays empty). See docs/tls.md, "On-demand TLS".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    on_demand: Option<OnDemand>,
}

fn default_renew_after() -> f64 {
    2.0 / 3.0
}

/// Most hosts one managed certificate may name (Let's Encrypt's limit).
pub const MAX_HOSTS: usize = 100;

impl AcmeSpec {
    /// The names the certificate is for, lowercase.
    pub fn hosts(&self) -> &[String] {
        &self.wire.hosts
    }

    /// The directory URL.
    pub fn directory(&self) -> &str {
        &self.wire.directory
    }

    /// The challenge kind.
    pub fn challenge(&self) -> ChallengeKind {
        self.wire.challenge
    }

    /// The account's contact, when given.
    pub fn contact(&self) -> Option<&str> {
        self.wire.contact.as_deref()
    }

    /// Extra CA certificates to trust for the directory's HTTPS.
    pub fn directory_ca(&self) -> Option<&[rustls::pki_types::CertificateDer<'static>]> {
        self.directory_ca.as_deref().map(Vec::as_slice)
    }

    /// The fraction of the lifetime after which to renew.
    pub fn renew_after(&self) -> f64 {
        self.wire.renew_after
    }

    /// The DNS-01 hook (always there with `dns-01`, never otherwise).
    pub fn dns_hook(&self) -> Option<&DnsHook> {
        self.wire.dns_hook.as_ref()
    }

    /// The on-demand settings of a template.
    pub fn on_demand(&self) -> Option<&OnDemand> {
        self.wire.on_demand.as_ref()
    }

    /// The `acme` block of the certificate a template issues for `host`:
    /// the template's, for that host alone.
    pub fn for_host(&self, host: &str) -> Result<AcmeSpec, Invalid> {
        let wire = AcmeWire { hosts: vec![host.to_string()], on_demand: None, ..self.wire.clone() };
        AcmeSpec::try_from(wire)
    }
}

impl From<AcmeSpec> for AcmeWire {
    fn from(s: AcmeSpec) -> Self {
        s.wire
    }
}

impl TryFrom<AcmeWire> for AcmeSpec {
    type Error = Invalid;

    fn try_from(mut w: AcmeWire) -> Result<Self, Invalid> {
        match &w.on_demand {
            Some(_) if !w.hosts.is_empty() => {
                return Err(Invalid::conflict(
                    "hosts",
                    "on_demand",
                    "an on-demand template names no hosts: each name comes from a handshake",
                ))
            }
            Some(od) => check_on_demand(od, w.challenge)?,
            None if w.hosts.is_empty() || w.hosts.len() > MAX_HOSTS => {
                return Err(Invalid::range("hosts", format!("1..={MAX_HOSTS} names"), w.hosts.len()));
            }
            None => {}
        }
        for (i, h) in w.hosts.iter_mut().enumerate() {
            *h = h.to_ascii_lowercase();
            check_host(&format!("hosts[{i}]"), h, w.challenge)?;
        }
        let mut seen = std::collections::BTreeSet::new();
        for (i, h) in w.hosts.iter().enumerate() {
            if !seen.insert(h.as_str()) {
                return Err(Invalid::rule(format!("hosts[{i}]"), format!("{h:?} is named twice")));
            }
        }
        let uri: http::Uri = w
            .directory
            .parse()
            .map_err(|_| Invalid::malformed("directory", format!("{:?}", w.directory), "is not a URL"))?;
        if uri.scheme_str() != Some("https") || uri.host().is_none_or(str::is_empty) {
            return Err(Invalid::malformed(
                "directory",
                format!("{:?}", w.directory),
                "is not an https:// URL (RFC 8555 requires HTTPS)",
            ));
        }
        if let Some(contact) = &w.contact {
            let address = contact.strip_prefix("mailto:").unwrap_or("");
            if !address.contains('@') || address.chars().any(|c| c.is_whitespace() || c.is_control() || c == ',') {
                return Err(Invalid::malformed(
                    "contact",
                    format!("{contact:?}"),
                    "is not one mailto: address (mailto:ops@example.com)",
                ));
            }
        }
        let directory_ca = match &w.directory_ca_pem {
            Some(pem) => Some(Arc::new(chain(pem, "directory_ca_pem")?)),
            None => None,
        };
        if !(0.1..=0.95).contains(&w.renew_after) {
            return Err(Invalid::range("renew_after", "0.1..=0.95", w.renew_after));
        }
        match (w.challenge, &w.dns_hook) {
            (ChallengeKind::Dns01, None) => {
                return Err(Invalid::rule(
                    "dns_hook",
                    "the dns-01 challenge needs a dns_hook: the command that sets and removes the TXT record",
                ))
            }
            (ChallengeKind::Dns01, Some(hook)) => check_hook(hook)?,
            (kind, Some(_)) => {
                return Err(Invalid::conflict(
                    "dns_hook",
                    "challenge",
                    format!("a dns_hook is only run by the dns-01 challenge, not {}", kind.as_str()),
                ))
            }
            (_, None) => {}
        }
        Ok(AcmeSpec { wire: w, directory_ca })
    }
}

/// A host a CA can issue for with `kind`: a DNS name of letters, digits
/// and hyphens (a `*.` wildcard only with DNS-01), not an IP address.
fn check_host(field: &str, h: &str, kind: ChallengeKind) -> Result<(), Invalid> {
    let (wild, rest) = match h.strip_prefix("*.") {
        Some(rest) => (true, rest),
        None => (false, h),
    };
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if rest.is_empty() || rest.len() > 253 || !rest.split('.').all(label_ok) {
        return Err(Invalid::malformed(field, format!("{h:?}"), "is not a DNS name (or a `*.domain` wildcard)"));
    }
    if rest.parse::<std::net::Ipv4Addr>().is_ok()
        || rest.rsplit('.').next().is_some_and(|l| l.chars().all(|c| c.is_ascii_digit()))
    {
        return Err(Invalid::malformed(
            field,
            format!("{h:?}"),
            "is an IP address; ACME certificates here are for DNS names",
        ));
    }
    if !rest.contains('.') {
        return Err(Invalid::malformed(field, format!("{h:?}"), "is not a fully qualified name (no dot)"));
    }
    if wild && kind != ChallengeKind::Dns01 {
        return Err(Invalid::conflict(
            field,
            "challenge",
            format!("a wildcard can only be validated through dns-01, not {}", kind.as_str()),
        ));
    }
    Ok(())
}

/// Whether a CA can issue for `name` on demand: a lowercase DNS name of at
/// least two labels, not an IP address, no wildcard (the checks a managed
/// certificate's `hosts` get).
pub fn issuable(name: &str) -> bool {
    !name.bytes().any(|b| b.is_ascii_uppercase()) && check_host("", name, ChallengeKind::Http01).is_ok()
}

fn check_on_demand(od: &OnDemand, kind: ChallengeKind) -> Result<(), Invalid> {
    if od.ask.is_none() && od.patterns.is_empty() {
        return Err(Invalid::rule(
            "on_demand",
            "give an ask URL or patterns (or both): issuing for any name a client sends would let anyone \
             exhaust the CA's rate limits",
        ));
    }
    if let Some(ask) = &od.ask {
        let ok = ask.parse::<http::Uri>().is_ok_and(|u| u.scheme_str() == Some("http") && u.authority().is_some());
        if !ok || ask.contains('?') {
            return Err(Invalid::malformed(
                "on_demand.ask",
                format!("{ask:?}"),
                "is not an http://host[:port]/path URL without a query (Tidegate adds ?domain=NAME)",
            ));
        }
    }
    for (i, p) in od.patterns.iter().enumerate() {
        if p != &p.to_ascii_lowercase() {
            return Err(Invalid::malformed(format!("on_demand.patterns[{i}]"), format!("{p:?}"), "is not lowercase"));
        }
        check_host(&format!("on_demand.patterns[{i}]"), p, ChallengeKind::Dns01)?;
    }
    if !(1..=100_000).contains(&od.max_certificates) {
        return Err(Invalid::range("on_demand.max_certificates", "1..=100000", od.max_certificates));
    }
    if kind == ChallengeKind::Dns01 {
        return Err(Invalid::conflict(
            "on_demand",
            "challenge",
            "on-demand certificates are validated during a handshake: use http-01 or tls-alpn-01",
        ));
    }
    Ok(())
}

fn check_hook(hook: &DnsHook) -> Result<(), Invalid> {
    match hook.command.first() {
        None => return Err(Invalid::rule("dns_hook.command", "must name a program")),
        Some(p) if p.is_empty() || p.contains('\0') => {
            return Err(Invalid::malformed("dns_hook.command[0]", format!("{p:?}"), "is not a program"))
        }
        Some(_) => {}
    }
    if let Some(i) = hook.command.iter().position(|a| a.contains('\0')) {
        return Err(Invalid::malformed(format!("dns_hook.command[{i}]"), "…", "contains a NUL byte"));
    }
    if hook.wait_s > 3600 {
        return Err(Invalid::range("dns_hook.wait_s", "0..=3600", hook.wait_s));
    }
    if !(1..=600).contains(&hook.timeout_s) {
        return Err(Invalid::range("dns_hook.timeout_s", "1..=600", hook.timeout_s));
    }
    Ok(())
}

/// Where a managed certificate stands, as status and `ctl cert list` show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum AcmeStatus {
    /// No certificate for its hosts yet, and no order under way.
    Pending,
    /// The first order is under way.
    Ordering,
    /// A certificate for its hosts is served.
    Valid,
    /// A certificate is served and its renewal is under way.
    Renewing,
    /// The last order failed; another follows after `retry_at`. A
    /// certificate issued before, if any, is still served.
    Failing,
    /// An on-demand template: it issues certificates of its own for the
    /// names handshakes ask for.
    OnDemand,
}

impl crate::certificate::Managed {
    /// Whether the certificate served covers exactly the hosts asked for.
    pub fn covers_hosts(&self) -> bool {
        self.state.issued.as_ref().is_some_and(|c| {
            let mut want: Vec<&str> = self.acme.hosts().iter().map(String::as_str).collect();
            want.sort_unstable();
            c.info().names.iter().map(String::as_str).eq(want)
        })
    }

    /// Where it stands.
    pub fn status(&self) -> AcmeStatus {
        if self.acme.on_demand().is_some() {
            return AcmeStatus::OnDemand;
        }
        let s = &self.state;
        match (s.ordering_since > 0, s.issued.is_some(), s.failures > 0) {
            (true, true, _) => AcmeStatus::Renewing,
            (true, false, _) => AcmeStatus::Ordering,
            (false, _, true) => AcmeStatus::Failing,
            (false, true, false) if self.covers_hosts() => AcmeStatus::Valid,
            (false, _, false) => AcmeStatus::Pending,
        }
    }
}

/// What the ACME manager keeps of a managed certificate: written by
/// Tidegate (`acme_state` ops), never given by users. Read APIs show it
/// with its secrets (the account key, the issued key) replaced by
/// [`crate::REDACTED`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AcmeState {
    /// The ACME account the orders are placed with.
    pub account: Option<AcmeAccount>,
    /// The certificate issued last (served by SNI for its names).
    pub issued: Option<KeyedChain>,
    /// Answers to the challenges of the order in progress: every instance
    /// gives them, so the CA may reach any.
    pub challenges: Vec<ChallengeAnswer>,
    /// Renewals asked for (`ctl cert renew`, `POST
    /// /v1/certificates/{name}/renew`): a counter only users raise.
    pub renew_requested: u64,
    /// The value of `renew_requested` the last issuance answered.
    pub renewed: u64,
    /// When the issued certificate is due for renewal (Unix seconds; 0:
    /// none issued).
    pub renew_at: i64,
    /// When the last certificate was issued (Unix seconds; 0: never).
    pub issued_at: i64,
    /// Orders placed with the CA so far.
    pub orders: u64,
    /// Failed orders in a row (reset by an issuance).
    pub failures: u32,
    /// No new order before this time (Unix seconds), after a failure.
    pub retry_at: i64,
    /// Why the last order failed, when it did.
    pub last_error: Option<String>,
    /// Since when an order is under way (Unix seconds; 0: none).
    pub ordering_since: i64,
    /// What the CA's renewal information said of the certificate served
    /// (None: not asked yet about this one).
    pub renewal_info: Option<RenewalInfo>,
    /// Serialized with the secrets replaced (read APIs).
    redact: bool,
}

impl AcmeState {
    /// When the certificate served is to be renewed (Unix seconds): its own
    /// time (`renew_at`), or the time picked in the window the CA suggests
    /// (RFC 9773) when that is earlier.
    pub fn renewal_due_at(&self) -> i64 {
        match &self.renewal_info {
            Some(RenewalInfo::Window { renew_at, .. }) => self.renew_at.min(*renew_at),
            _ => self.renew_at,
        }
    }
}

/// What a CA's ACME Renewal Information (ARI, RFC 9773) said of the
/// certificate served. A CA uses it to ask for earlier renewals (a
/// certificate about to be revoked, an incident), and to spread renewals
/// over time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum RenewalInfo {
    /// The CA offers none: not asked again until the next certificate.
    NotOffered,
    /// The CA's suggested window, and when to ask again.
    Window {
        /// Start of the suggested window (Unix seconds).
        start: i64,
        /// End of the suggested window (Unix seconds).
        end: i64,
        /// The time picked at random in it (now, when it has begun).
        renew_at: i64,
        /// When to ask again (the CA's `Retry-After`, within a minute and a
        /// day).
        next_check: i64,
    },
    /// The last question failed (the CA unreachable, a bad answer).
    Unanswered {
        /// When to ask again.
        next_check: i64,
    },
}

impl RenewalInfo {
    /// When to ask the CA again, if ever.
    pub fn next_check(&self) -> Option<i64> {
        match self {
            RenewalInfo::NotOffered => None,
            RenewalInfo::Window { next_check, .. } | RenewalInfo::Unanswered { next_check } => Some(*next_check),
        }
    }

    /// Whether the CA offers renewal information (as far as is known).
    pub fn offered(&self) -> bool {
        !matches!(self, RenewalInfo::NotOffered)
    }
}

/// An ACME account: the directory it lives at and its credentials
/// (instant-acme's `AccountCredentials`, JSON; secret).
#[derive(Clone, PartialEq, Eq)]
pub struct AcmeAccount {
    /// The directory URL the account was created at.
    pub directory: String,
    /// The credentials (id and private key), JSON.
    pub credentials: String,
}

impl std::fmt::Debug for AcmeAccount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AcmeAccount").field("directory", &self.directory).finish_non_exhaustive()
    }
}

/// The answer to one challenge, as every instance gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChallengeAnswer {
    /// Answer `GET /.well-known/acme-challenge/{token}` with
    /// `key_authorization`.
    Http01 {
        /// The challenge's token (the last path segment).
        token: String,
        /// The body of the answer.
        key_authorization: String,
    },
    /// Answer a handshake for `host` offering ALPN `acme-tls/1` with this
    /// validation certificate.
    TlsAlpn01 {
        /// The host being validated.
        host: String,
        /// The self-signed validation certificate and its key.
        certificate: KeyedChain,
    },
    /// A TXT record the hook set (kept to remove it after the order).
    Dns01 {
        /// The record's name (`_acme-challenge.shop.example.`).
        record: String,
        /// Its value.
        value: String,
    },
}

/// The stored form of [`AcmeState`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct AcmeStateWire {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    account: Option<AccountWire>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cert_pem: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    key_pem: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    challenges: Vec<AnswerWire>,
    #[serde(default)]
    renew_requested: u64,
    #[serde(default)]
    renewed: u64,
    #[serde(default)]
    renew_at: i64,
    #[serde(default)]
    issued_at: i64,
    #[serde(default)]
    orders: u64,
    #[serde(default)]
    failures: u32,
    #[serde(default)]
    retry_at: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    last_error: Option<String>,
    #[serde(default)]
    ordering_since: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    renewal_info: Option<RenewalInfo>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct AccountWire {
    directory: String,
    credentials: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(tag = "kind", deny_unknown_fields)]
enum AnswerWire {
    #[serde(rename = "http-01")]
    Http01 { token: String, key_authorization: String },
    #[serde(rename = "tls-alpn-01")]
    TlsAlpn01 { host: String, cert_pem: String, key_pem: String },
    #[serde(rename = "dns-01")]
    Dns01 { record: String, value: String },
}

impl AcmeState {
    /// The state as read APIs show it: serialized with the account's
    /// credentials and every private key replaced by [`crate::REDACTED`].
    pub fn redacted(&self) -> AcmeState {
        AcmeState { redact: true, ..self.clone() }
    }

    /// The stored form; `redact` replaces the secrets with
    /// [`crate::REDACTED`] (read APIs).
    pub(crate) fn to_wire(&self, redact: bool) -> AcmeStateWire {
        let secret = |s: &str| if redact { crate::REDACTED.to_string() } else { s.to_string() };
        AcmeStateWire {
            account: self
                .account
                .as_ref()
                .map(|a| AccountWire { directory: a.directory.clone(), credentials: secret(&a.credentials) }),
            cert_pem: self.issued.as_ref().map(|c| c.cert_pem().to_string()),
            key_pem: self.issued.as_ref().map(|c| secret(c.key_pem())),
            challenges: self
                .challenges
                .iter()
                .map(|c| match c {
                    ChallengeAnswer::Http01 { token, key_authorization } => {
                        AnswerWire::Http01 { token: token.clone(), key_authorization: key_authorization.clone() }
                    }
                    ChallengeAnswer::TlsAlpn01 { host, certificate } => AnswerWire::TlsAlpn01 {
                        host: host.clone(),
                        cert_pem: certificate.cert_pem().to_string(),
                        key_pem: secret(certificate.key_pem()),
                    },
                    ChallengeAnswer::Dns01 { record, value } => {
                        AnswerWire::Dns01 { record: record.clone(), value: value.clone() }
                    }
                })
                .collect(),
            renew_requested: self.renew_requested,
            renewed: self.renewed,
            renew_at: self.renew_at,
            issued_at: self.issued_at,
            orders: self.orders,
            failures: self.failures,
            retry_at: self.retry_at,
            last_error: self.last_error.clone(),
            ordering_since: self.ordering_since,
            renewal_info: self.renewal_info,
        }
    }
}

impl TryFrom<AcmeStateWire> for AcmeState {
    type Error = Invalid;

    fn try_from(w: AcmeStateWire) -> Result<Self, Invalid> {
        let issued = match (w.cert_pem, w.key_pem) {
            (Some(cert), Some(key)) => Some(
                KeyedChain::new(cert, key)
                    .map_err(|e| Invalid { field: format!("acme_state.{}", e.field), reason: e.reason })?,
            ),
            (None, None) => None,
            (Some(_), None) => return Err(Invalid::rule("acme_state.key_pem", "the issued chain has no key")),
            (None, Some(_)) => return Err(Invalid::rule("acme_state.cert_pem", "the issued key has no chain")),
        };
        let mut challenges = Vec::with_capacity(w.challenges.len());
        for (i, a) in w.challenges.into_iter().enumerate() {
            challenges.push(match a {
                AnswerWire::Http01 { token, key_authorization } => {
                    let safe = |s: &str| s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
                    if token.is_empty() || !safe(&token) || !safe(&key_authorization) {
                        return Err(Invalid::malformed(
                            format!("acme_state.challenges[{i}].token"),
                            format!("{token:?}"),
                            "is not a base64url token",
                        ));
                    }
                    ChallengeAnswer::Http01 { token, key_authorization }
                }
                AnswerWire::TlsAlpn01 { host, cert_pem, key_pem } => {
                    let certificate = KeyedChain::validation(cert_pem, key_pem).map_err(|e| Invalid {
                        field: format!("acme_state.challenges[{i}].{}", e.field),
                        reason: e.reason,
                    })?;
                    ChallengeAnswer::TlsAlpn01 { host: host.to_ascii_lowercase(), certificate }
                }
                AnswerWire::Dns01 { record, value } => ChallengeAnswer::Dns01 { record, value },
            });
        }
        Ok(AcmeState {
            account: w.account.map(|a| AcmeAccount { directory: a.directory, credentials: a.credentials }),
            issued,
            challenges,
            renew_requested: w.renew_requested,
            renewed: w.renewed,
            renew_at: w.renew_at,
            issued_at: w.issued_at,
            orders: w.orders,
            failures: w.failures,
            retry_at: w.retry_at,
            last_error: w.last_error,
            ordering_since: w.ordering_since,
            renewal_info: w.renewal_info,
            redact: false,
        })
    }
}

impl Serialize for AcmeState {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.to_wire(self.redact).serialize(s)
    }
}

impl<'de> Deserialize<'de> for AcmeState {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        AcmeState::try_from(AcmeStateWire::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

impl schemars::JsonSchema for AcmeState {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "AcmeState".into()
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        AcmeStateWire::json_schema(generator)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(v: serde_json::Value) -> Result<AcmeSpec, crate::ParseError> {
        crate::parse_json::<AcmeSpec>(v.to_string().as_bytes())
    }

    const DIR: &str = "https://acme.example/dir";

    #[test]
    fn a_valid_block_decodes_with_its_defaults() {
        let s = spec(serde_json::json!({"hosts": ["Shop.Example"], "directory": DIR, "challenge": "http-01",
            "contact": "mailto:ops@example.com"}))
        .unwrap();
        assert_eq!(s.hosts(), ["shop.example"]);
        assert_eq!(s.challenge(), ChallengeKind::Http01);
        assert!((s.renew_after() - 2.0 / 3.0).abs() < 1e-9);
        assert!(s.dns_hook().is_none() && s.directory_ca().is_none());
        let back: AcmeSpec = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn bad_blocks_name_the_field() {
        let cases = [
            (serde_json::json!({"hosts": [], "directory": DIR, "challenge": "http-01"}), "hosts"),
            (serde_json::json!({"hosts": ["a b.example"], "directory": DIR, "challenge": "http-01"}), "hosts[0]"),
            (serde_json::json!({"hosts": ["10.0.0.1"], "directory": DIR, "challenge": "http-01"}), "hosts[0]"),
            (serde_json::json!({"hosts": ["localhost"], "directory": DIR, "challenge": "http-01"}), "hosts[0]"),
            (serde_json::json!({"hosts": ["*.a.example"], "directory": DIR, "challenge": "http-01"}), "hosts[0]"),
            (
                serde_json::json!({"hosts": ["a.example", "A.example"], "directory": DIR, "challenge": "http-01"}),
                "hosts[1]",
            ),
            (
                serde_json::json!({"hosts": ["a.example"], "directory": "http://x/dir", "challenge": "http-01"}),
                "directory",
            ),
            (serde_json::json!({"hosts": ["a.example"], "directory": DIR, "challenge": "dns-01"}), "dns_hook"),
            (
                serde_json::json!({"hosts": ["a.example"], "directory": DIR, "challenge": "http-01",
                    "dns_hook": {"command": ["/bin/true"]}}),
                "dns_hook",
            ),
            (
                serde_json::json!({"hosts": ["a.example"], "directory": DIR, "challenge": "http-01", "contact": "ops@x"}),
                "contact",
            ),
            (
                serde_json::json!({"hosts": ["a.example"], "directory": DIR, "challenge": "http-01", "renew_after": 1.0}),
                "renew_after",
            ),
            (
                serde_json::json!({"hosts": ["a.example"], "directory": DIR, "challenge": "http-01", "directory_ca_pem": "x"}),
                "directory_ca_pem",
            ),
            (
                serde_json::json!({"hosts": ["*.a.example"], "directory": DIR, "challenge": "dns-01",
                    "dns_hook": {"command": []}}),
                "dns_hook.command",
            ),
        ];
        for (v, field) in cases {
            let e = spec(v.clone()).unwrap_err();
            assert_eq!(e.field, field, "{v}: {e}");
        }
        let wild = spec(serde_json::json!({"hosts": ["*.a.example", "a.example"], "directory": DIR,
            "challenge": "dns-01", "dns_hook": {"command": ["/usr/local/bin/dns", "zone1"], "wait_s": 5}}))
        .unwrap();
        assert_eq!(wild.dns_hook().unwrap().timeout_s, 60);
    }

    #[test]
    fn on_demand_templates_are_checked_and_match_their_patterns() {
        let template = |od: serde_json::Value, hosts: serde_json::Value, challenge: &str| {
            spec(serde_json::json!({"hosts": hosts, "directory": DIR, "challenge": challenge, "on_demand": od}))
        };
        let ok = template(
            serde_json::json!({"patterns": ["*.customers.example", "shop.example"]}),
            serde_json::json!([]),
            "tls-alpn-01",
        )
        .unwrap();
        let od = ok.on_demand().unwrap();
        assert_eq!(od.max_certificates, 1000);
        assert!(od.matches("a.customers.example") && od.matches("shop.example"));
        assert!(!od.matches("a.b.customers.example") && !od.matches("customers.example") && !od.matches("x.example"));
        let child = ok.for_host("a.customers.example").unwrap();
        assert_eq!((child.hosts(), child.on_demand()), (&["a.customers.example".to_string()][..], None));
        let cases = [
            (serde_json::json!({"patterns": ["a.example"]}), serde_json::json!(["a.example"]), "http-01", "hosts"),
            (serde_json::json!({}), serde_json::json!([]), "http-01", "on_demand"),
            (serde_json::json!({"ask": "https://x/ok"}), serde_json::json!([]), "http-01", "on_demand.ask"),
            (serde_json::json!({"ask": "http://x/ok?a=1"}), serde_json::json!([]), "http-01", "on_demand.ask"),
            (
                serde_json::json!({"patterns": ["*.a.b.example", "A.example"]}),
                serde_json::json!([]),
                "http-01",
                "on_demand.patterns[1]",
            ),
            (
                serde_json::json!({"ask": "http://x/ok", "max_certificates": 0}),
                serde_json::json!([]),
                "http-01",
                "on_demand.max_certificates",
            ),
        ];
        for (od, hosts, challenge, field) in cases {
            let e = template(od.clone(), hosts, challenge).unwrap_err();
            assert_eq!(e.field, field, "{od}: {e}");
        }
        let e = spec(serde_json::json!({"hosts": [], "directory": DIR, "challenge": "dns-01",
            "dns_hook": {"command": ["/bin/true"]}, "on_demand": {"ask": "http://x/ok"}}))
        .unwrap_err();
        assert_eq!(e.field, "on_demand", "{e}");
    }

    #[test]
    fn state_round_trips_and_redacts_its_secrets() {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["a.example".to_string()]).unwrap().self_signed(&key).unwrap();
        let state = AcmeState {
            account: Some(AcmeAccount { directory: DIR.into(), credentials: "{\"id\":\"x\"}".into() }),
            issued: Some(KeyedChain::new(cert.pem(), key.serialize_pem()).unwrap()),
            challenges: vec![ChallengeAnswer::Http01 {
                token: "tok_1".into(),
                key_authorization: "tok_1.thumb".into(),
            }],
            renew_requested: 2,
            orders: 3,
            ..AcmeState::default()
        };
        let json = serde_json::to_string(&state).unwrap();
        let back: AcmeState = serde_json::from_str(&json).unwrap();
        assert_eq!(back, state);
        let shown = serde_json::to_string(&state.to_wire(true)).unwrap();
        assert!(!shown.contains("PRIVATE") && !shown.contains("\"id\""), "{shown}");
        assert!(shown.contains("CERTIFICATE") && shown.contains("tok_1.thumb"), "{shown}");
        let bad = serde_json::json!({"challenges": [{"kind": "http-01", "token": "../x", "key_authorization": "k"}]});
        assert!(serde_json::from_value::<AcmeState>(bad).is_err());
    }
}
