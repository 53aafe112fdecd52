//! Traffic rules: named rule sets (`PUT /v1/rules/{name}`), each a list of
//! steps a route runs in order (`"rules": ["name", ...]`).
//!
//! A step decodes through its kind's own type (`{"kind": "strip_prefix",
//! "prefix": "/api"}`), unknown fields refused, every value checked as it
//! is read; a refusal names the step and field (`steps[2].regex`). What a
//! step does to a request is the rule engine's (crate `tidegate-rules`);
//! docs/rules.md describes each kind.

mod template;
mod types;

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use crate::invalid::Invalid;
use crate::service::REDACTED;

pub use template::{Part, Template, Var};
pub use types::{
    AuthTimeoutMs, BodyBytes, Burst, Cidr, DenyStatus, FieldName, FieldValue, HashKind, InFlight, LimitKey, MaxAgeS,
    MinBytes, PasswordHash, PathPrefix, PathRegex, Rate, RedirectStatus,
};

/// The most steps a rule set may have.
pub const MAX_STEPS: usize = 64;
/// The most entries of a list inside a step (networks, users, origins, ...).
pub const MAX_LIST: usize = 1024;

/// A rule set (`PUT /v1/rules/{name}`): steps run in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RuleSetSpec {
    /// The steps, 0..=64 of them.
    pub steps: Vec<Step>,
}

/// One step of a rule set, by its `kind`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Step {
    /// Removes a path prefix (`/api/x` becomes `/x`; `/api` becomes `/`).
    StripPrefix(StripPrefix),
    /// Rewrites the path with a regular expression and a replacement.
    RewritePath(RewritePath),
    /// Sets a request header sent upstream, replacing any value (`host`
    /// sets the Host sent upstream).
    SetRequestHeader(HeaderSet),
    /// Adds a request header value, keeping those there.
    AddRequestHeader(HeaderSet),
    /// Removes a request header.
    RemoveRequestHeader(HeaderRemove),
    /// Sets a response header sent to the client.
    SetResponseHeader(ResponseHeaderSet),
    /// Adds a response header value, keeping those there.
    AddResponseHeader(HeaderSet),
    /// Removes a response header.
    RemoveResponseHeader(HeaderRemove),
    /// Answers with a redirect.
    Redirect(Redirect),
    /// Answers with a refusal.
    Deny(Deny),
    /// Refuses (403) clients outside these networks.
    IpAllow(IpList),
    /// Refuses (403) clients inside these networks.
    IpDeny(IpList),
    /// Requires HTTP basic authentication (401 with `WWW-Authenticate`).
    BasicAuth(BasicAuth),
    /// Asks an authentication service (a sub-request) whether to let the
    /// request through.
    ForwardAuth(ForwardAuth),
    /// Token-bucket rate limit (429 with `Retry-After`).
    RateLimit(RateLimit),
    /// At most so many requests at once per key (429).
    ConcurrencyLimit(ConcurrencyLimit),
    /// Refuses request bodies above a size (413).
    MaxBodyBytes(MaxBodyBytes),
    /// Cross-origin resource sharing: answers preflights, adds the headers.
    Cors(Cors),
    /// Compresses responses the client accepts compressed.
    Compress(Compress),
}

/// `strip_prefix`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StripPrefix {
    /// The prefix, segment-wise (`/api` strips `/api/x`, not `/apix`).
    /// Paths without it are left as they are.
    pub prefix: PathPrefix,
}

/// `rewrite_path`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RewritePath {
    /// Matched against the normalized path; paths it does not match are
    /// left as they are.
    pub regex: PathRegex,
    /// The new path: text and `$N` (capture group N), starting with `/`.
    /// The result is normalized; one that is not a path is refused (400).
    #[schemars(with = "String")]
    pub replacement: Template,
}

/// `set_request_header`, `add_request_header`, `add_response_header`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HeaderSet {
    /// The header's name.
    pub name: FieldName,
    /// Its value.
    pub value: FieldValue,
}

/// `remove_request_header`, `remove_response_header`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HeaderRemove {
    /// The header's name.
    pub name: FieldName,
}

/// `set_response_header`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ResponseHeaderSet {
    /// The header's name.
    pub name: FieldName,
    /// Its value.
    pub value: FieldValue,
    /// Set it only when the backend's answer has no such header (default
    /// false: replace).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub only_if_absent: bool,
}

/// `redirect`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Redirect {
    /// 300, 301, 302, 303, 307 or 308 (default 302).
    #[serde(default)]
    pub status: RedirectStatus,
    /// The target: text with `{scheme}`, `{host}`, `{path}`, `{query}`,
    /// `{uri}`, and `$N` when `regex` is given.
    #[schemars(with = "String")]
    pub location: Template,
    /// When given, only paths it matches are redirected; its capture
    /// groups are `$1`... in `location`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub regex: Option<PathRegex>,
}

/// `deny`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Deny {
    /// 400..=599 (default 403).
    #[serde(default)]
    pub status: DenyStatus,
}

/// `ip_allow`, `ip_deny`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct IpList {
    /// Networks in CIDR form, 1..=1024 of them.
    pub cidrs: Vec<Cidr>,
}

/// `basic_auth`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BasicAuth {
    /// The realm shown by browsers (`WWW-Authenticate: Basic realm="..."`).
    pub realm: String,
    /// The users, 1..=1024 of them, names unique.
    pub users: Vec<BasicUser>,
    /// Whether to pass the `Authorization` header on to the backend
    /// (default false: removed).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub forward_authorization: bool,
}

/// A user of `basic_auth`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BasicUser {
    /// The user name (1..=128 bytes, no `:` or control characters).
    pub name: String,
    /// The password's bcrypt or argon2 hash; read APIs show `(redacted)`.
    pub hash: PasswordHash,
}

/// `forward_auth`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ForwardAuth {
    /// The auth service: `http://HOST:PORT/PATH`. It gets a `GET` with the
    /// headers chosen in `request_headers` and `X-Forwarded-Method`,
    /// `-Proto`, `-Host`, `-Uri` and `-For`; a 2xx answer lets the request
    /// through, any other is given to the client as it is.
    pub url: AuthUrl,
    /// Headers of a 2xx answer copied onto the request sent upstream.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub copy_headers: Vec<FieldName>,
    /// Request headers sent to the auth service (default `authorization`
    /// and `cookie`).
    #[serde(default = "default_auth_headers")]
    pub request_headers: Vec<FieldName>,
    /// How long to wait for the answer (default 2000 ms). An auth service
    /// that does not answer in time, or cannot be reached, refuses the
    /// request (503): never let through.
    #[serde(default = "default_auth_timeout")]
    pub timeout_ms: AuthTimeoutMs,
}

fn default_auth_headers() -> Vec<FieldName> {
    ["authorization", "cookie"].map(|n| FieldName(http::HeaderName::from_static(n))).to_vec()
}

fn default_auth_timeout() -> AuthTimeoutMs {
    AuthTimeoutMs::try_from(2000).unwrap_or_else(|_| unreachable!())
}

/// The URL of an auth service: `http://` with a host and port (`:80`
/// when none), a path, maybe a query; no user information.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "String", into = "String")]
pub struct AuthUrl {
    /// The address to connect to, `host:port`.
    pub authority: String,
    /// The path and query to ask for.
    pub path_and_query: String,
}

impl TryFrom<String> for AuthUrl {
    type Error = Invalid;
    fn try_from(s: String) -> Result<Self, Invalid> {
        let bad = |why: &str| Invalid::malformed("", format!("{s:?}"), why.to_string());
        let uri: http::Uri = s.parse().map_err(|_| bad("is not a URL"))?;
        if uri.scheme_str() != Some("http") {
            return Err(bad("must be an http:// URL"));
        }
        let Some(auth) = uri.authority() else { return Err(bad("has no host")) };
        if auth.as_str().contains('@') {
            return Err(bad("must not hold user information"));
        }
        let authority = match auth.port_u16() {
            Some(_) => auth.as_str().to_string(),
            None => format!("{}:80", auth.as_str()),
        };
        let path_and_query = uri.path_and_query().map_or("/", |p| p.as_str()).to_string();
        Ok(AuthUrl { authority, path_and_query })
    }
}

impl From<AuthUrl> for String {
    fn from(u: AuthUrl) -> String {
        format!("http://{}{}", u.authority, u.path_and_query)
    }
}

/// `rate_limit`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RateLimit {
    /// What requests are counted by: `client_ip`, `route`, `header:NAME`.
    pub key: LimitKey,
    /// Requests admitted per second, on average, per key.
    pub rate_per_s: Rate,
    /// How many may come at once beyond the rate (the bucket's size;
    /// default: one second's worth, at least 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<Burst>,
    /// In cluster mode, divide the rate by the number of live instances
    /// (default false: each instance admits the whole rate).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub per_instance_share: bool,
}

impl RateLimit {
    /// The bucket's size: `burst`, or one second's worth (at least 1).
    pub fn bucket(&self) -> u32 {
        match self.burst {
            Some(b) => b.get(),
            None => u32::try_from(self.rate_per_s.millis().div_ceil(1000)).unwrap_or(u32::MAX).max(1),
        }
    }
}

/// `concurrency_limit`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ConcurrencyLimit {
    /// What requests are counted by: `client_ip`, `route`, `header:NAME`.
    pub key: LimitKey,
    /// Requests in flight at once, per key.
    pub max: InFlight,
}

/// `max_body_bytes`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MaxBodyBytes {
    /// The largest request body taken (`Content-Length`, or counted while
    /// it streams); larger ones get 413.
    pub bytes: BodyBytes,
}

/// `cors`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Cors {
    /// Origins allowed (`https://app.example`, with a port when not the
    /// scheme's), or `*` for any; 1..=1024 of them.
    pub allow_origins: Vec<Origin>,
    /// Methods allowed (default GET, HEAD, POST).
    #[serde(default = "default_cors_methods")]
    #[schemars(with = "Vec<String>")]
    pub allow_methods: Vec<MethodName>,
    /// Request headers allowed (default none beyond the safelisted ones).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow_headers: Vec<FieldName>,
    /// Response headers the browser may show to scripts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub expose_headers: Vec<FieldName>,
    /// Allow credentials (cookies, `Authorization`); not with `*`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_credentials: bool,
    /// How long a browser may cache a preflight's answer (default 600 s).
    #[serde(default = "default_max_age")]
    pub max_age_s: MaxAgeS,
}

fn default_cors_methods() -> Vec<MethodName> {
    [http::Method::GET, http::Method::HEAD, http::Method::POST].map(MethodName).to_vec()
}

fn default_max_age() -> MaxAgeS {
    MaxAgeS::try_from(600).unwrap_or_else(|_| unreachable!())
}

/// An HTTP method's name (uppercase).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "String", into = "String")]
pub struct MethodName(#[schemars(with = "String")] pub http::Method);

impl TryFrom<String> for MethodName {
    type Error = Invalid;
    fn try_from(s: String) -> Result<Self, Invalid> {
        http::Method::from_bytes(s.to_ascii_uppercase().as_bytes())
            .map(MethodName)
            .map_err(|_| Invalid::malformed("", format!("{s:?}"), "is not an HTTP method"))
    }
}

impl From<MethodName> for String {
    fn from(m: MethodName) -> String {
        m.0.to_string()
    }
}

/// An origin a browser sends (`scheme://host[:port]`, lowercase), or `*`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "String", into = "String")]
pub struct Origin(String);

impl Origin {
    /// The origin as browsers send it, or `*`.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether it is `*`.
    pub fn is_any(&self) -> bool {
        self.0 == "*"
    }
}

impl TryFrom<String> for Origin {
    type Error = Invalid;
    fn try_from(s: String) -> Result<Self, Invalid> {
        if s == "*" {
            return Ok(Origin(s));
        }
        let lower = s.to_ascii_lowercase();
        let ok = match lower.split_once("://") {
            Some(("http" | "https", rest)) => {
                !rest.is_empty()
                    && rest.len() <= 260
                    && rest.bytes().all(|b| b.is_ascii_alphanumeric() || b".-:[]".contains(&b))
            }
            _ => false,
        };
        match ok {
            true => Ok(Origin(lower)),
            false => Err(Invalid::malformed(
                "",
                format!("{s:?}"),
                "is not an origin (`https://host` or `https://host:port`, no path) or `*`",
            )),
        }
    }
}

impl From<Origin> for String {
    fn from(o: Origin) -> String {
        o.0
    }
}

/// A compression algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// Zstandard (`zstd`).
    Zstd,
    /// Brotli (`br`).
    Br,
    /// gzip (`gzip`).
    Gzip,
}

impl Algorithm {
    /// Its `Content-Encoding` token.
    pub fn token(self) -> &'static str {
        match self {
            Algorithm::Zstd => "zstd",
            Algorithm::Br => "br",
            Algorithm::Gzip => "gzip",
        }
    }
}

/// `compress`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Compress {
    /// The algorithms offered, in the order preferred when the client
    /// accepts several equally (default zstd, br, gzip).
    #[serde(default = "default_algorithms")]
    pub algorithms: Vec<Algorithm>,
    /// Responses smaller than this (by `Content-Length`) are sent as they
    /// are (default 1024).
    #[serde(default = "default_min_bytes")]
    pub min_bytes: MinBytes,
    /// Media types compressed (`text/*` matches any text type; default
    /// text/*, application/json, application/javascript, application/xml,
    /// image/svg+xml).
    #[serde(default = "default_types")]
    pub types: Vec<MediaRange>,
}

fn default_algorithms() -> Vec<Algorithm> {
    vec![Algorithm::Zstd, Algorithm::Br, Algorithm::Gzip]
}

fn default_min_bytes() -> MinBytes {
    MinBytes::try_from(1024).unwrap_or_else(|_| unreachable!())
}

fn default_types() -> Vec<MediaRange> {
    ["text/*", "application/json", "application/javascript", "application/xml", "image/svg+xml"]
        .map(|t| MediaRange(t.to_string()))
        .to_vec()
}

/// A media type (`application/json`) or a range of them (`text/*`),
/// lowercase, without parameters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "String", into = "String")]
pub struct MediaRange(String);

impl MediaRange {
    /// Whether the `Content-Type` value `content_type` is in the range.
    pub fn matches(&self, content_type: &[u8]) -> bool {
        let essence = content_type.split(|b| *b == b';').next().unwrap_or_default();
        let essence = essence.trim_ascii();
        match self.0.strip_suffix("/*") {
            Some(top) => {
                essence.len() > top.len()
                    && essence[..top.len()].eq_ignore_ascii_case(top.as_bytes())
                    && essence[top.len()] == b'/'
            }
            None => essence.eq_ignore_ascii_case(self.0.as_bytes()),
        }
    }
}

impl TryFrom<String> for MediaRange {
    type Error = Invalid;
    fn try_from(s: String) -> Result<Self, Invalid> {
        let token =
            |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_alphanumeric() || b"!#$&-^_.+".contains(&b));
        let ok = match s.split_once('/') {
            Some((top, "*")) => token(top),
            Some((top, sub)) => token(top) && token(sub),
            None => false,
        };
        match ok {
            true => Ok(MediaRange(s.to_ascii_lowercase())),
            false => Err(Invalid::malformed("", format!("{s:?}"), "is not a media type (`type/subtype` or `type/*`)")),
        }
    }
}

impl From<MediaRange> for String {
    fn from(m: MediaRange) -> String {
        m.0
    }
}

// --- decoding -----------------------------------------------------------

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RewriteWire {
    regex: PathRegex,
    replacement: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RedirectWire {
    #[serde(default)]
    status: RedirectStatus,
    location: String,
    #[serde(default)]
    regex: Option<PathRegex>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleSetWire {
    steps: Vec<serde_json::Value>,
}

/// The kinds, as the error for an unknown one lists them.
const KINDS: &str = "strip_prefix, rewrite_path, set_request_header, add_request_header, remove_request_header, \
     set_response_header, add_response_header, remove_response_header, redirect, deny, ip_allow, ip_deny, \
     basic_auth, forward_auth, rate_limit, concurrency_limit, max_body_bytes, cors, compress";

/// Decodes one kind's body, an error as `Invalid` naming the field.
fn body<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> Result<T, Invalid> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let field = if path == "." || path == "?" { String::new() } else { path };
        let message = e.inner().to_string();
        // A value's own check says its reason; serde's own errors (a
        // missing or unknown field, a wrong type) say theirs.
        Invalid::rule(field, message)
    })
}

impl Step {
    /// The step's `kind`, as written in the configuration.
    pub fn kind(&self) -> &'static str {
        match self {
            Step::StripPrefix(_) => "strip_prefix",
            Step::RewritePath(_) => "rewrite_path",
            Step::SetRequestHeader(_) => "set_request_header",
            Step::AddRequestHeader(_) => "add_request_header",
            Step::RemoveRequestHeader(_) => "remove_request_header",
            Step::SetResponseHeader(_) => "set_response_header",
            Step::AddResponseHeader(_) => "add_response_header",
            Step::RemoveResponseHeader(_) => "remove_response_header",
            Step::Redirect(_) => "redirect",
            Step::Deny(_) => "deny",
            Step::IpAllow(_) => "ip_allow",
            Step::IpDeny(_) => "ip_deny",
            Step::BasicAuth(_) => "basic_auth",
            Step::ForwardAuth(_) => "forward_auth",
            Step::RateLimit(_) => "rate_limit",
            Step::ConcurrencyLimit(_) => "concurrency_limit",
            Step::MaxBodyBytes(_) => "max_body_bytes",
            Step::Cors(_) => "cors",
            Step::Compress(_) => "compress",
        }
    }

    /// Decodes one step from its JSON form.
    pub fn from_json(v: serde_json::Value) -> Result<Step, Invalid> {
        let serde_json::Value::Object(mut map) = v else {
            return Err(Invalid::rule("", "a step is a JSON object with a `kind`"));
        };
        let kind = match map.remove("kind") {
            Some(serde_json::Value::String(k)) => k,
            Some(_) => return Err(Invalid::rule("kind", "must be a string")),
            None => return Err(Invalid::rule("kind", format!("missing; one of {KINDS}"))),
        };
        let v = serde_json::Value::Object(map);
        let step = match kind.as_str() {
            "strip_prefix" => Step::StripPrefix(body(v)?),
            "rewrite_path" => {
                let w: RewriteWire = body(v)?;
                let replacement = Template::parse("replacement", &w.replacement, false, Some(w.regex.groups()))?;
                if !replacement.starts_with_literal("/") {
                    return Err(Invalid::malformed(
                        "replacement",
                        format!("{:?}", w.replacement),
                        "must start with '/'",
                    ));
                }
                Step::RewritePath(RewritePath { regex: w.regex, replacement })
            }
            "set_request_header" => Step::SetRequestHeader(body(v)?),
            "add_request_header" => Step::AddRequestHeader(body(v)?),
            "remove_request_header" => Step::RemoveRequestHeader(body(v)?),
            "set_response_header" => Step::SetResponseHeader(body(v)?),
            "add_response_header" => Step::AddResponseHeader(body(v)?),
            "remove_response_header" => Step::RemoveResponseHeader(body(v)?),
            "redirect" => {
                let w: RedirectWire = body(v)?;
                let groups = w.regex.as_ref().map(PathRegex::groups);
                let location = Template::parse("location", &w.location, true, groups)?;
                Step::Redirect(Redirect { status: w.status, location, regex: w.regex })
            }
            "deny" => Step::Deny(body(v)?),
            "ip_allow" => Step::IpAllow(body(v)?),
            "ip_deny" => Step::IpDeny(body(v)?),
            "basic_auth" => Step::BasicAuth(body(v)?),
            "forward_auth" => Step::ForwardAuth(body(v)?),
            "rate_limit" => Step::RateLimit(body(v)?),
            "concurrency_limit" => Step::ConcurrencyLimit(body(v)?),
            "max_body_bytes" => Step::MaxBodyBytes(body(v)?),
            "cors" => Step::Cors(body(v)?),
            "compress" => Step::Compress(body(v)?),
            other => return Err(Invalid::malformed("kind", format!("{other:?}"), format!("is not one of {KINDS}"))),
        };
        step.check()?;
        Ok(step)
    }

    /// The checks across a step's fields.
    fn check(&self) -> Result<(), Invalid> {
        let list = |field: &str, len: usize| match len {
            1..=MAX_LIST => Ok(()),
            n => Err(Invalid::range(field, format!("1..={MAX_LIST} entries"), n)),
        };
        match self {
            Step::IpAllow(l) | Step::IpDeny(l) => list("cidrs", l.cidrs.len()),
            Step::BasicAuth(b) => {
                if b.realm.is_empty()
                    || b.realm.len() > 128
                    || b.realm.bytes().any(|c| c == b'"' || c == b'\\' || !(b' '..=b'~').contains(&c))
                {
                    return Err(Invalid::malformed(
                        "realm",
                        format!("{:?}", b.realm),
                        "must be 1..=128 visible ASCII characters without '\"' or '\\'",
                    ));
                }
                list("users", b.users.len())?;
                for (i, u) in b.users.iter().enumerate() {
                    if u.name.is_empty()
                        || u.name.len() > 128
                        || u.name.bytes().any(|c| c == b':' || c.is_ascii_control())
                    {
                        return Err(Invalid::malformed(
                            format!("users[{i}].name"),
                            format!("{:?}", u.name),
                            "must be 1..=128 bytes without ':' or control characters",
                        ));
                    }
                    if b.users[..i].iter().any(|o| o.name == u.name) {
                        return Err(Invalid::rule(format!("users[{i}].name"), format!("{:?} is listed twice", u.name)));
                    }
                }
                Ok(())
            }
            Step::ForwardAuth(f) => {
                if f.copy_headers.len() > 64 || f.request_headers.len() > 64 {
                    return Err(Invalid::too_large("copy_headers", "64 names", None));
                }
                Ok(())
            }
            Step::Cors(c) => {
                list("allow_origins", c.allow_origins.len())?;
                if c.allow_credentials && c.allow_origins.iter().any(Origin::is_any) {
                    return Err(Invalid::conflict(
                        "allow_credentials",
                        "allow_origins",
                        "browsers refuse credentials with the origin `*`: list the origins",
                    ));
                }
                Ok(())
            }
            Step::Compress(c) => {
                list("algorithms", c.algorithms.len())?;
                for (i, a) in c.algorithms.iter().enumerate() {
                    if c.algorithms[..i].contains(a) {
                        return Err(Invalid::rule(
                            format!("algorithms[{i}]"),
                            format!("{} is listed twice", a.token()),
                        ));
                    }
                }
                list("types", c.types.len())
            }
            _ => Ok(()),
        }
    }
}

impl<'de> Deserialize<'de> for RuleSetSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let wire = RuleSetWire::deserialize(d)?;
        RuleSetSpec::from_steps(wire.steps).map_err(|e| D::Error::custom(e.to_string()))
    }
}

impl RuleSetSpec {
    /// Validates the steps' JSON forms; an error names `steps[N].field`.
    pub fn from_steps(steps: Vec<serde_json::Value>) -> Result<RuleSetSpec, Invalid> {
        if steps.len() > MAX_STEPS {
            return Err(Invalid::too_large("steps", format!("{MAX_STEPS} steps"), Some(steps.len().to_string())));
        }
        let steps = steps
            .into_iter()
            .enumerate()
            .map(|(i, v)| Step::from_json(v).map_err(|e| e.under(&format!("steps[{i}]"))))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(RuleSetSpec { steps })
    }

    fn hashes(&self) -> impl Iterator<Item = (usize, &BasicUser)> {
        self.steps.iter().enumerate().flat_map(|(i, s)| match s {
            Step::BasicAuth(b) => b.users.iter().map(move |u| (i, u)).collect::<Vec<_>>(),
            _ => Vec::new(),
        })
    }

    /// Whether it carries a secret (a password hash), which read APIs hide.
    pub fn has_secrets(&self) -> bool {
        self.hashes().next().is_some()
    }

    /// The rule set as read APIs show it: password hashes replaced by
    /// [`REDACTED`]. Borrowed when there is nothing to hide.
    pub fn redacted(&self) -> Cow<'_, RuleSetSpec> {
        if !self.has_secrets() {
            return Cow::Borrowed(self);
        }
        let mut copy = self.clone();
        for step in &mut copy.steps {
            if let Step::BasicAuth(b) = step {
                for u in &mut b.users {
                    u.hash = PasswordHash::placeholder();
                }
            }
        }
        Cow::Owned(copy)
    }

    /// The fields holding a hash given as [`REDACTED`]
    /// (`steps[N].users[M].hash`), kept where the set is applied.
    pub fn kept_hashes(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (i, step) in self.steps.iter().enumerate() {
            if let Step::BasicAuth(b) = step {
                for (j, u) in b.users.iter().enumerate() {
                    if u.hash.kind() == HashKind::Placeholder {
                        out.push(format!("steps[{i}].users[{j}].hash"));
                    }
                }
            }
        }
        out
    }

    /// A copy with each hash given as [`REDACTED`] replaced by a hash no
    /// password matches: to check a document on its own, where the
    /// configuration that keeps the real hash is not at hand.
    pub fn with_placeholders_filled(&self) -> RuleSetSpec {
        let mut copy = self.clone();
        for step in &mut copy.steps {
            if let Step::BasicAuth(b) = step {
                for u in &mut b.users {
                    if u.hash.kind() == HashKind::Placeholder {
                        u.hash = PasswordHash::unusable();
                    }
                }
            }
        }
        copy
    }

    /// This rule set with each hash given as [`REDACTED`] replaced by the
    /// one the same user has in `previous` (in the same step, else in any
    /// `basic_auth` step); `Err` naming the field when there is none.
    pub fn with_secrets_of(&self, previous: Option<&RuleSetSpec>) -> Result<Cow<'_, RuleSetSpec>, Invalid> {
        if !self.hashes().any(|(_, u)| u.hash.kind() == HashKind::Placeholder) {
            return Ok(Cow::Borrowed(self));
        }
        let mut copy = self.clone();
        for (i, step) in copy.steps.iter_mut().enumerate() {
            let Step::BasicAuth(b) = step else { continue };
            for (j, u) in b.users.iter_mut().enumerate() {
                if u.hash.kind() != HashKind::Placeholder {
                    continue;
                }
                let kept = previous.and_then(|p| {
                    let real =
                        |(_, o): &(usize, &BasicUser)| o.name == u.name && o.hash.kind() != HashKind::Placeholder;
                    let mut all = p.hashes();
                    let same_step = p.hashes().filter(|(k, _)| *k == i).find(real);
                    same_step.or_else(|| all.find(real)).map(|(_, o)| o.hash.clone())
                });
                let Some(hash) = kept else {
                    return Err(Invalid::rule(
                        format!("steps[{i}].users[{j}].hash"),
                        format!(
                            "{REDACTED:?} is the placeholder read APIs show, and user {:?} has no hash to keep; \
                             give the hash",
                            u.name
                        ),
                    ));
                };
                u.hash = hash;
            }
        }
        Ok(Cow::Owned(copy))
    }
}

#[cfg(test)]
mod tests;
