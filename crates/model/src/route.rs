//! Routes: which requests go where.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use http::{HeaderName, HeaderValue, Method};
use serde::{Deserialize, Serialize};

use crate::invalid::Invalid;
use crate::names::{RuleSetName, ServiceName};

/// The most rule sets a route may run.
pub const MAX_ROUTE_RULES: usize = 16;

/// Which host a route matches.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum HostPattern {
    /// Any host (no `host` given).
    Any,
    /// Exactly this host, lowercase, without port.
    Exact(Arc<str>),
    /// `*.example.com`: any host ending in `.example.com` (stored as the
    /// suffix `.example.com`); does not match `example.com` itself.
    Wildcard(Arc<str>),
}

/// Which paths a route matches.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum PathPattern {
    /// Segment-wise prefix: `/api` matches `/api`, `/api/` and `/api/x`, not
    /// `/apix`. Stored without a trailing slash (except `/`, which matches all).
    Prefix(Arc<str>),
    /// Exactly this path (the query string is ignored).
    Exact(Arc<str>),
}

/// One header a request must carry, with exactly this value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderMatch {
    /// The header's name (lowercase).
    pub name: HeaderName,
    /// The value it must have.
    pub value: HeaderValue,
}

/// A header a request must carry with a value a regular expression matches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderRegex {
    /// The header's name (lowercase).
    pub name: HeaderName,
    /// Matched against each value (one matching is enough; a value that is
    /// not UTF-8 never matches). Unanchored: write `^...$` for the whole.
    pub regex: crate::rules::PathRegex,
}

/// A query parameter a request must carry: with exactly this value (after
/// form decoding: `%XX` escapes and `+` as a space), or any value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueryMatch {
    /// The parameter's name, as decoded.
    pub name: String,
    /// The value it must have, as decoded; `None`: present with any value.
    pub value: Option<String>,
}

/// The longest query parameter name or value a route may match on, bytes.
pub const MAX_QUERY_MATCH: usize = 1024;

/// The conditions of a route. All given conditions must hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteMatch {
    /// Host condition.
    pub host: HostPattern,
    /// Path condition.
    pub path: PathPattern,
    /// Allowed methods; empty means any.
    pub methods: Vec<Method>,
    /// Required headers.
    pub headers: Vec<HeaderMatch>,
    /// Headers that must be present, whatever their value.
    pub header_present: Vec<HeaderName>,
    /// Headers that must have a value the regex matches.
    pub header_regex: Vec<HeaderRegex>,
    /// Query parameters that must be there (`query`: with a value;
    /// `query_present`: with any).
    pub query: Vec<QueryMatch>,
}

impl RouteMatch {
    /// How many method, header and query conditions it has (more is more
    /// specific).
    pub fn conditions(&self) -> usize {
        usize::from(!self.methods.is_empty())
            + self.headers.len()
            + self.header_present.len()
            + self.header_regex.len()
            + self.query.len()
    }
}

/// A static directory served by the proxy itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StaticDir {
    /// The directory. The request path, less the route's path prefix, is
    /// looked up below it; paths that would leave it are refused. It must
    /// be absolute, with no `.` or `..` segment, and its real path (links
    /// resolved) a directory that is neither a system directory nor the
    /// data directory, inside it or above it (docs/security.md).
    pub root: PathBuf,
    /// The file served for a directory (default `index.html`).
    #[serde(default = "default_index")]
    pub index: String,
}

fn default_index() -> String {
    "index.html".to_string()
}

/// What a matched request is given to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteAction {
    /// Proxy to a service's backends.
    Service(ServiceName),
    /// Serve files from a directory.
    Static(StaticDir),
}

/// A route (`PUT /v1/routes/{name}`).
///
/// Among the routes that match a request, the winner is the one with the
/// highest `priority`; then the most specific host (exact, then the longest
/// wildcard, then any); then the most specific path (exact, then the longest
/// prefix); then the most method and header conditions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "RouteWire", into = "RouteWire")]
pub struct RouteSpec {
    /// The conditions.
    pub matches: RouteMatch,
    /// Where matched requests go.
    pub action: RouteAction,
    /// Higher wins over more specific (default 0).
    pub priority: i32,
    /// Requests that arrive over plain HTTP get `308 Permanent Redirect` to
    /// the same URL over HTTPS (on the TLS listener) instead of being
    /// served. Default false.
    pub redirect_https: bool,
    /// The rule sets its requests run through, in order (`"rules":
    /// ["name", ...]`, at most 16, each once); each must exist.
    pub rules: Vec<RuleSetName>,
    /// What it asks of the client's TLS certificate (`"client_cert":
    /// {"required": true, "forward_headers": true}`); nothing by default.
    pub client_cert: crate::ClientCertPolicy,
    /// The listeners whose requests it matches (`"listeners": ["name",
    /// ...]`, at most 16, each once; `default` is the default listeners,
    /// `--listen` and `--listen-tls`). Empty (the default): the default
    /// listeners only.
    pub listeners: Vec<crate::ListenerName>,
}

impl RouteSpec {
    /// Whether requests that arrived on `listener` (`None`: a default
    /// listener) can match it.
    pub fn serves(&self, listener: Option<&str>) -> bool {
        match listener {
            None => self.listeners.is_empty() || self.listeners.iter().any(|l| l.as_str() == crate::DEFAULT_LISTENERS),
            Some(name) => self.listeners.iter().any(|l| l.as_str() == name),
        }
    }

    /// The service this route sends traffic to, if it proxies.
    pub fn service(&self) -> Option<&ServiceName> {
        match &self.action {
            RouteAction::Service(s) => Some(s),
            RouteAction::Static(_) => None,
        }
    }
}

/// The JSON form of a route.
#[derive(Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, rename = "RouteSpec")]
struct RouteWire {
    /// Conditions.
    #[serde(rename = "match", default)]
    matches: MatchWire,
    /// Target service (exactly one of `service` and `static`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    service: Option<ServiceName>,
    /// Target directory (exactly one of `service` and `static`).
    #[serde(rename = "static", default, skip_serializing_if = "Option::is_none")]
    static_dir: Option<StaticDir>,
    #[serde(default)]
    priority: i32,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    redirect_https: bool,
    /// Rule sets run in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    rules: Vec<RuleSetName>,
    /// What the route asks of the client's TLS certificate: `required`
    /// (else 403), `forward_headers` (its subject and fingerprint to the
    /// backend).
    #[serde(default, skip_serializing_if = "crate::ClientCertPolicy::is_default")]
    client_cert: crate::ClientCertPolicy,
    /// The listeners it is bound to (`default`: `--listen` and
    /// `--listen-tls`); none: the default listeners.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    listeners: Vec<crate::ListenerName>,
}

#[derive(Clone, Default, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct MatchWire {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    host: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    path_prefix: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    path: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    methods: Vec<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    headers: BTreeMap<String, String>,
    /// Headers that must be present, whatever their value.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    header_present: Vec<String>,
    /// `{"name": "regex"}`: each header must have a value the regex
    /// (`regex` crate syntax, unanchored) matches.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    header_regex: BTreeMap<String, String>,
    /// `{"name": "value"}`: each query parameter must be there with this
    /// value (compared after form decoding: `%XX` and `+`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    query: BTreeMap<String, String>,
    /// Query parameters that must be there, whatever their value.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    query_present: Vec<String>,
}

/// Refuses a condition on a header only the proxy sets: the client
/// certificate headers ([`crate::CLIENT_CERT_HEADER_PREFIX`]), which a
/// client's request may carry (they are removed before it is forwarded,
/// not before it is routed), so a route matching them would believe the
/// client.
fn proxy_set(field: &str, name: HeaderName) -> Result<HeaderName, Invalid> {
    if name.as_str().starts_with(crate::CLIENT_CERT_HEADER_PREFIX) {
        return Err(Invalid::malformed(
            field,
            format!("{:?}", name.as_str()),
            "is a header only the proxy sets (client certificates); require a verified certificate with \
             `client_cert.required` instead",
        ));
    }
    Ok(name)
}

fn parse_host(h: &str) -> Result<HostPattern, Invalid> {
    let h = h.to_ascii_lowercase();
    let (wild, rest) = match h.strip_prefix("*.") {
        Some(rest) => (true, rest),
        None => (false, h.as_str()),
    };
    let label_ok = |l: &str| !l.is_empty() && l.len() <= 63 && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
    if rest.is_empty() || rest.len() > 253 || !rest.split('.').all(label_ok) {
        return Err(Invalid::malformed("match.host", format!("{h:?}"), "is not a host name or a `*.domain` wildcard"));
    }
    Ok(if wild { HostPattern::Wildcard(Arc::from(format!(".{rest}"))) } else { HostPattern::Exact(Arc::from(rest)) })
}

pub(crate) fn check_path(field: &str, p: &str) -> Result<(), Invalid> {
    let bad = |expected: String| Invalid::malformed(field, format!("{p:?}"), expected);
    if !p.starts_with('/') {
        return Err(bad("must start with '/'".into()));
    }
    if p.contains(['?', '#']) || p.chars().any(|c| c.is_ascii_control() || c == ' ') {
        return Err(bad("must be a plain path (no query, fragment, spaces)".into()));
    }
    // Routes match the normalized path (as clients send it, percent-
    // encoded): a route is written in that form, or it could never match.
    if !p.is_ascii() {
        return Err(bad("must be ASCII: percent-encode other characters (UTF-8, uppercase hex)".into()));
    }
    match crate::normalize::normalize(p) {
        Ok(n) if n == p => {}
        Ok(n) => {
            return Err(bad(format!(
                "must be written as requests are normalized, {n:?} (an unreserved character as \
                 itself, other escapes in uppercase hex, no dot segments or repeated slashes)"
            )))
        }
        Err(crate::normalize::PathError::EncodedSeparator) => {
            return Err(bad("encodes '/', '\\' or NUL, which requests may not carry".into()));
        }
        Err(crate::normalize::PathError::Backslash) => {
            return Err(bad("has a raw '\\', which requests may not carry (some servers read it as '/')".into()));
        }
        Err(e) => return Err(bad(format!("is not a path a request can have ({e:?})"))),
    }
    Ok(())
}

impl TryFrom<RouteWire> for RouteSpec {
    type Error = Invalid;
    fn try_from(w: RouteWire) -> Result<Self, Invalid> {
        let m = w.matches;
        let host = match m.host.as_deref() {
            None => HostPattern::Any,
            Some(h) => parse_host(h)?,
        };
        let path = match (m.path_prefix, m.path) {
            (Some(_), Some(_)) => {
                return Err(Invalid::conflict("match", "match.path", "give `path_prefix` or `path`, not both"))
            }
            (None, Some(p)) => {
                check_path("match.path", &p)?;
                PathPattern::Exact(Arc::from(p))
            }
            (prefix, None) => {
                let p = prefix.unwrap_or_else(|| "/".to_string());
                check_path("match.path_prefix", &p)?;
                let trimmed = p.trim_end_matches('/');
                PathPattern::Prefix(Arc::from(if trimmed.is_empty() { "/" } else { trimmed }))
            }
        };
        let mut methods = Vec::new();
        for (i, name) in m.methods.iter().enumerate() {
            let method = Method::from_bytes(name.to_ascii_uppercase().as_bytes()).map_err(|_| {
                Invalid::malformed(format!("match.methods[{i}]"), format!("{name:?}"), "is not an HTTP method")
            })?;
            if !methods.contains(&method) {
                methods.push(method);
            }
        }
        let mut headers = Vec::new();
        for (name, value) in &m.headers {
            let hn = HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| Invalid::malformed("match.headers", format!("{name:?}"), "is not a header name"))
                .and_then(|hn| proxy_set("match.headers", hn))?;
            let hv = HeaderValue::from_str(value).map_err(|_| {
                Invalid::malformed(format!("match.headers.{name}"), format!("{value:?}"), "is not a header value")
            })?;
            headers.push(HeaderMatch { name: hn, value: hv });
        }
        let header_name = |field: String, name: &str| {
            HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| Invalid::malformed(field.clone(), format!("{name:?}"), "is not a header name"))
                .and_then(|hn| proxy_set(&field, hn))
        };
        let mut header_present = Vec::new();
        for (i, name) in m.header_present.iter().enumerate() {
            let hn = header_name(format!("match.header_present[{i}]"), name)?;
            if !header_present.contains(&hn) {
                header_present.push(hn);
            }
        }
        let mut header_regex = Vec::new();
        for (name, regex) in &m.header_regex {
            let hn = header_name("match.header_regex".to_string(), name)?;
            let regex = crate::rules::PathRegex::try_from(regex.clone())
                .map_err(|e| e.under(&format!("match.header_regex.{name}")))?;
            header_regex.push(HeaderRegex { name: hn, regex });
        }
        let mut query = Vec::new();
        let checked = |field: String, text: &str| {
            if text.is_empty() || text.len() > MAX_QUERY_MATCH {
                return Err(Invalid::malformed(field, format!("{text:?}"), "must be 1 to 1024 bytes"));
            }
            Ok(text.to_string())
        };
        for (name, value) in &m.query {
            let name = checked("match.query".to_string(), name)?;
            let value = if value.len() > MAX_QUERY_MATCH {
                return Err(Invalid::malformed(
                    format!("match.query.{name}"),
                    "(too long)",
                    "must be at most 1024 bytes",
                ));
            } else {
                value.clone()
            };
            query.push(QueryMatch { name, value: Some(value) });
        }
        for (i, name) in m.query_present.iter().enumerate() {
            let name = checked(format!("match.query_present[{i}]"), name)?;
            if !query.iter().any(|q| q.name == name && q.value.is_none()) {
                query.push(QueryMatch { name, value: None });
            }
        }
        let action = match (w.service, w.static_dir) {
            (Some(s), None) => RouteAction::Service(s),
            (None, Some(d)) => {
                // Only the path as written here: where it leads is checked
                // against the filesystem by the API and by the proxy
                // (`check_static_root`).
                if let Some(why) = crate::static_root::written_root_refusal(&d.root) {
                    return Err(Invalid::unreadable("static.root", why));
                }
                if d.index.is_empty() || d.index.contains(['/', '\\']) || d.index == ".." {
                    return Err(Invalid::unreadable("static.index", "must be a plain file name"));
                }
                RouteAction::Static(d)
            }
            _ => return Err(Invalid::conflict("", "static", "a route needs exactly one of `service` and `static`")),
        };
        if w.rules.len() > MAX_ROUTE_RULES {
            return Err(Invalid::too_large(
                "rules",
                format!("{MAX_ROUTE_RULES} rule sets"),
                Some(w.rules.len().to_string()),
            ));
        }
        for (i, r) in w.rules.iter().enumerate() {
            if w.rules[..i].contains(r) {
                return Err(Invalid::rule(format!("rules[{i}]"), format!("rule set {r:?} is listed twice")));
            }
        }
        if w.listeners.len() > MAX_ROUTE_RULES {
            return Err(Invalid::too_large(
                "listeners",
                format!("{MAX_ROUTE_RULES} listeners"),
                Some(w.listeners.len().to_string()),
            ));
        }
        for (i, l) in w.listeners.iter().enumerate() {
            if w.listeners[..i].contains(l) {
                return Err(Invalid::rule(format!("listeners[{i}]"), format!("listener {l:?} is listed twice")));
            }
        }
        Ok(RouteSpec {
            matches: RouteMatch { host, path, methods, headers, header_present, header_regex, query },
            action,
            priority: w.priority,
            redirect_https: w.redirect_https,
            rules: w.rules,
            client_cert: w.client_cert,
            listeners: w.listeners,
        })
    }
}

impl From<RouteSpec> for RouteWire {
    fn from(r: RouteSpec) -> RouteWire {
        let m = r.matches;
        let host = match m.host {
            HostPattern::Any => None,
            HostPattern::Exact(h) => Some(h.to_string()),
            HostPattern::Wildcard(s) => Some(format!("*{s}")),
        };
        let (path_prefix, path) = match m.path {
            PathPattern::Prefix(p) => (Some(p.to_string()), None),
            PathPattern::Exact(p) => (None, Some(p.to_string())),
        };
        let headers = m
            .headers
            .iter()
            .map(|h| {
                let v = String::from_utf8_lossy(h.value.as_bytes()).into_owned();
                (h.name.to_string(), v)
            })
            .collect();
        let (service, static_dir) = match r.action {
            RouteAction::Service(s) => (Some(s), None),
            RouteAction::Static(d) => (None, Some(d)),
        };
        RouteWire {
            matches: MatchWire {
                host,
                path_prefix,
                path,
                methods: m.methods.iter().map(|m| m.to_string()).collect(),
                headers,
                header_present: m.header_present.iter().map(|h| h.as_str().to_string()).collect(),
                header_regex: m
                    .header_regex
                    .iter()
                    .map(|h| (h.name.to_string(), h.regex.0.as_str().to_string()))
                    .collect(),
                query: m.query.iter().filter_map(|q| Some((q.name.clone(), q.value.clone()?))).collect(),
                query_present: m.query.iter().filter(|q| q.value.is_none()).map(|q| q.name.clone()).collect(),
            },
            service,
            static_dir,
            priority: r.priority,
            redirect_https: r.redirect_https,
            rules: r.rules,
            client_cert: r.client_cert,
            listeners: r.listeners,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Reason;

    fn parse(s: &str) -> Result<RouteSpec, serde_json::Error> {
        serde_json::from_str(s)
    }

    #[test]
    fn query_conditions_decode_and_read_back() {
        let r = parse(r#"{"match":{"query":{"v":"2"},"query_present":["debug","debug"]},"service":"w"}"#).unwrap();
        assert_eq!(r.matches.conditions(), 2);
        let back = serde_json::to_value(&r).unwrap();
        assert_eq!(back["match"]["query"], serde_json::json!({"v": "2"}));
        assert_eq!(back["match"]["query_present"], serde_json::json!(["debug"]));
        let e = parse(r#"{"match":{"query_present":[""]},"service":"w"}"#).unwrap_err().to_string();
        assert!(e.contains("match.query_present[0]"), "{e}");
    }

    #[test]
    fn client_cert_reads_back_and_its_headers_are_not_conditions() {
        let r = parse(r#"{"service":"w","client_cert":{"required":true,"forward_headers":true}}"#).unwrap();
        assert!(r.client_cert.required && r.client_cert.forward_headers);
        let back = serde_json::to_value(&r).unwrap();
        assert_eq!(back["client_cert"], serde_json::json!({"required": true, "forward_headers": true}));
        let plain = serde_json::to_value(parse(r#"{"service":"w"}"#).unwrap()).unwrap();
        assert!(plain.get("client_cert").is_none(), "{plain}");
        for doc in [
            r#"{"match":{"headers":{"X-Client-Cert-Subject":"CN=a"}},"service":"w"}"#,
            r#"{"match":{"header_present":["x-client-cert-fingerprint"]},"service":"w"}"#,
            r#"{"match":{"header_regex":{"x-client-cert-subject":"a"}},"service":"w"}"#,
        ] {
            let e = parse(doc).unwrap_err().to_string();
            assert!(e.contains("is a header only the proxy sets"), "{doc}: {e}");
        }
        assert!(parse(r#"{"service":"w","client_cert":{"require":true}}"#).is_err());
    }

    #[test]
    fn routes_are_normalized() {
        let r = parse(r#"{"match":{"host":"API.Example.com","path_prefix":"/api/"},"service":"web"}"#).unwrap();
        assert_eq!(r.matches.host, HostPattern::Exact(Arc::from("api.example.com")));
        assert_eq!(r.matches.path, PathPattern::Prefix(Arc::from("/api")));
        let r = parse(r#"{"match":{"host":"*.example.com"},"service":"web"}"#).unwrap();
        assert_eq!(r.matches.host, HostPattern::Wildcard(Arc::from(".example.com")));
        assert_eq!(r.matches.path, PathPattern::Prefix(Arc::from("/")));
    }

    #[test]
    fn bad_routes_name_the_field() {
        let cases = [
            (r#"{"match":{"path_prefix":"api"},"service":"w"}"#, "match.path_prefix"),
            (r#"{"match":{"host":"a b"},"service":"w"}"#, "match.host"),
            (r#"{"match":{"methods":["G T"]},"service":"w"}"#, "match.methods[0]"),
            (r#"{"service":"w","static":{"root":"/x"}}"#, "exactly one"),
            (r#"{"static":{"root":"rel"}}"#, "static.root"),
            (r#"{"static":{"root":"/"}}"#, "static.root"),
            (r#"{"static":{"root":"/srv/../"}}"#, "static.root"),
            (r#"{"static":{"root":"/proc/self/root"}}"#, "static.root"),
            (r#"{"static":{"root":"/etc"}}"#, "static.root"),
            (r#"{"match":{"path_prefix":"/café"},"service":"w"}"#, "ASCII"),
            (r#"{"match":{"path_prefix":"/a%2Fb"},"service":"w"}"#, "encodes"),
            (r#"{"match":{"path_prefix":"/a\\b"},"service":"w"}"#, "raw '\\'"),
            (r#"{"match":{"path":"/caf%c3%a9"},"service":"w"}"#, "uppercase"),
            (r#"{"match":{"path":"/%41"},"service":"w"}"#, "as itself"),
            (r#"{"service":"w","extra":1}"#, "unknown field"),
        ];
        for (text, want) in cases {
            let err = parse(text).unwrap_err().to_string();
            assert!(err.contains(want), "{text}: {err}");
        }
    }

    #[test]
    fn refusals_name_the_field_and_kind() {
        let wire = |text: &str| serde_json::from_str::<RouteWire>(text).unwrap();
        let e = RouteSpec::try_from(wire(r#"{"match":{"path":"x"},"service":"w"}"#)).unwrap_err();
        assert_eq!(e.field, "match.path");
        assert!(matches!(&e.reason, Reason::Malformed { value: Some(v), .. } if v == "\"x\""), "{e:?}");
        let e = RouteSpec::try_from(wire(r#"{"match":{"path":"/a","path_prefix":"/b"},"service":"w"}"#)).unwrap_err();
        assert!(matches!(&e.reason, Reason::Conflict { with, .. } if with == "match.path"), "{e:?}");
        let e = RouteSpec::try_from(wire(r#"{"match":{"methods":["GET","G T"]},"service":"w"}"#)).unwrap_err();
        assert_eq!(e.field, "match.methods[1]");
    }

    #[test]
    fn header_presence_and_regex_conditions_decode_and_name_the_field() {
        let r =
            parse(r#"{"match":{"header_present":["X-Debug"],"header_regex":{"User-Agent":"(?i)curl"}},"service":"w"}"#)
                .unwrap();
        assert_eq!(r.matches.header_present, vec![HeaderName::from_static("x-debug")]);
        assert_eq!(r.matches.conditions(), 2);
        let e = parse(r#"{"match":{"header_regex":{"x":"("}},"service":"w"}"#).unwrap_err();
        assert!(e.to_string().contains("match.header_regex.x"), "{e}");
        let e = parse(r#"{"match":{"header_present":["a b"]},"service":"w"}"#).unwrap_err();
        assert!(e.to_string().contains("match.header_present[0]"), "{e}");
    }

    #[test]
    fn a_route_round_trips_through_json() {
        let text = r#"{"match":{"host":"*.a.com","path":"/x","methods":["GET"],"headers":{"x-canary":"1"},"header_present":["x-a"],"header_regex":{"x-b":"^v[0-9]+$"}},"service":"w","priority":5,"rules":[]}"#;
        let r = parse(text).unwrap();
        let again = parse(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(r, again);
    }
}
