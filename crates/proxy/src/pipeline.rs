//! The request pipeline: what the proxy does with a request, decided once
//! for both HTTP/1.1 engines and HTTP/2.
//!
//! An engine reads a request its own way (hyper's `http::Request`, or the
//! native engine's spans of a parsed head) and computes its [`Facts`]:
//! the method, the routing host, the normalized path, the path and query
//! the backend gets, the headers (through [`Headers`]), and whether the
//! client came over TLS. [`decide`] turns the facts, the configuration
//! [`Snapshot`] and the worker's [`Settings`] into a [`Decision`], with no
//! IO: answer locally (a health check, a redirect, a refusal), serve a
//! static directory, or forward to a service. The engine then carries the
//! decision out with its own IO (framing, bodies, the attempt loop).
//!
//! The steps, in order (docs/architecture.md, "The request pipeline"):
//!
//! 1. the method alone: `CONNECT` is refused (before the target is read,
//!    since its authority-form target names no path);
//! 2. the engine's own checks of the head (its facts, or why there are
//!    none: a malformed host, path or framing, too many headers);
//! 3. the health path and ACME HTTP-01 challenges, answered before
//!    routing;
//! 4. the route, from the snapshot;
//! 5. `redirect_https`, then the route's `client_cert` (403 without a
//!    client certificate its host's CAs verified, when required; the
//!    certificate's subject and fingerprint as request header edits, when
//!    forwarded), then the route's rule sets ([`tidegate_rules`]):
//!    each step either answers (a redirect, a refusal, a challenge, a
//!    rate limit's 429) or edits what is forwarded (the path, request
//!    headers) and what is answered (response headers); a step that needs
//!    work off the request path (a password check, a forward-auth
//!    sub-request) leaves the rules [`Ruled::Pending`], and the engine
//!    settles them ([`crate::rules_work::settle`]) before it goes on;
//! 6. the route's action: a static directory, or a service of the
//!    snapshot.
//!
//! The response plan the rules leave ([`tidegate_rules::ResponsePlan`])
//! is applied by the engines to the answer's head.

use std::borrow::Cow;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::header::HeaderValue;
use http::Method;
use tidegate_model::{Headers, PathPattern, RouteAction, StaticDir};
use tidegate_rules::{Chain, Outcome};
use tidegate_snapshot::{Entry, RequestView, ServiceRuntime, Snapshot};

use crate::error::ErrorKind;
use crate::limits::TrustedProxies;
use crate::tls::VerifiedClient;

/// The field that passes a verified client certificate's subject on.
static CLIENT_CERT_SUBJECT: http::HeaderName =
    http::HeaderName::from_static(tidegate_model::CLIENT_CERT_SUBJECT_HEADER);
/// The field that passes a verified client certificate's fingerprint on.
static CLIENT_CERT_FINGERPRINT: http::HeaderName =
    http::HeaderName::from_static(tidegate_model::CLIENT_CERT_FINGERPRINT_HEADER);

/// What the engine knows of a request, read its own way (the method is
/// read apart: it is known even of a head the engine refuses).
pub(crate) struct Facts<'a> {
    /// The host routes match: lowercase, without its port or one trailing
    /// dot (empty for an HTTP/1.0 request that names none).
    pub host: Cow<'a, str>,
    /// The target: the normalized path, and the query as the engine
    /// split it.
    pub target: Asked<'a>,
    /// When the request's head was read (rate limits refill to it).
    pub received: Instant,
    /// The request's header fields.
    pub headers: &'a dyn Headers,
    /// The client came over TLS.
    pub tls: bool,
    /// The worker is stopping (health checks answer `draining`).
    pub stopping: bool,
    /// The address of the connection's peer (the client, or a proxy in
    /// front of it: see [`Facts::client`]).
    pub peer: IpAddr,
    /// The body's declared length (`Content-Length`), if any.
    pub content_length: Option<u64>,
    /// The client certificate the connection's TLS handshake verified.
    pub client_cert: Option<&'a VerifiedClient>,
    /// The named listener the connection came on (`None`: a default one).
    pub listener: Option<&'a str>,
}

impl Facts<'_> {
    /// The client's address as rules see it: the peer's, or behind peers
    /// of `--trusted-proxies`, the last address of `X-Forwarded-For` that
    /// is not itself a trusted proxy (read right to left: the entries to
    /// its left were written by whoever sent them, and are not believed).
    #[inline]
    pub(crate) fn client(&self, trusted: &TrustedProxies) -> IpAddr {
        if trusted.is_empty() || !trusted.contains(self.peer) {
            return self.peer;
        }
        self.forwarded_client(trusted)
    }

    /// [`Facts::client`] when the peer is a trusted proxy (out of line:
    /// the direct case stays a test where it is called).
    fn forwarded_client(&self, trusted: &TrustedProxies) -> IpAddr {
        let mut client = self.peer;
        let mut fields: Vec<Vec<u8>> = Vec::new();
        self.headers.any("x-forwarded-for", &mut |v| {
            fields.push(v.to_vec());
            false
        });
        for hop in fields.iter().rev().flat_map(|v| v.rsplit(|b| *b == b',')) {
            let Some(ip) = std::str::from_utf8(hop).ok().and_then(|t| t.trim().parse::<IpAddr>().ok()) else {
                // Unreadable: stop at the last address believed.
                break;
            };
            client = ip;
            if !trusted.contains(ip) {
                break;
            }
        }
        client
    }

    /// The request as the rule engine reads it (a struct of references,
    /// built once per request: inlined, not returned through memory).
    #[inline]
    fn rules_view<'a>(&'a self, method: &'a Method, settings: &Settings) -> tidegate_rules::RequestView<'a> {
        tidegate_rules::RequestView {
            method,
            host: &self.host,
            path: self.target.path,
            query: self.target.query,
            headers: self.headers,
            client: self.client(&settings.trusted_proxies),
            tls: self.tls,
            content_length: self.content_length,
        }
    }
}

/// The worker's settings the pipeline reads.
#[derive(Debug, Clone, Default)]
pub(crate) struct Settings {
    /// The path answered by the proxy itself for health checks, if any.
    pub health_path: Option<Box<str>>,
    /// The TLS listener's port, where `redirect_https` routes send clients.
    pub https_port: Option<u16>,
    /// The peers whose `X-Forwarded-For` names the client rules see.
    pub trusted_proxies: TrustedProxies,
}

/// An answer the proxy gives itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Local {
    /// The health path: `200 ok`, or `503 draining` while stopping.
    Health {
        /// The worker is stopping.
        draining: bool,
    },
    /// `405` to `CONNECT`: the proxy opens no tunnels.
    ConnectRefused,
    /// `200` with this key authorization: the answer to an ACME HTTP-01
    /// challenge of a managed certificate's order.
    AcmeChallenge(Arc<str>),
    /// `403`: the route requires a verified client certificate
    /// (`client_cert.required`) and the connection has none its host's
    /// certificate accepts.
    ClientCertRequired,
    /// `431`: more header fields than `--max-headers`, or a head larger
    /// than `--max-header-bytes`.
    HeadTooLarge,
    /// `308` to the same URL over HTTPS, at `Location`.
    HttpsRedirect(HeaderValue),
    /// A refusal counted as an error (metrics, access log): the request is
    /// invalid, no route matches it, or its service is gone.
    Error(ErrorKind),
    /// The answer of a rule step (a redirect, a refusal, a challenge, a
    /// rate limit, a CORS preflight).
    Rule(RuleAnswer),
}

/// A rule step's answer ([`tidegate_rules::Answer`]); two are equal when
/// the same step gave the same status.
#[derive(Debug, Clone)]
pub(crate) struct RuleAnswer {
    /// The answer.
    pub answer: Box<tidegate_rules::Answer>,
    /// The body of an auth service's refusal, sent on as the answer's
    /// ([`tidegate_rules::Answer::relay_auth_body`]).
    pub body: Option<Bytes>,
}

impl PartialEq for RuleAnswer {
    fn eq(&self, other: &RuleAnswer) -> bool {
        self.answer.status == other.answer.status && self.answer.rule == other.answer.rule
    }
}

impl Eq for RuleAnswer {}

impl From<tidegate_rules::Answer> for Local {
    fn from(answer: tidegate_rules::Answer) -> Local {
        Local::Rule(RuleAnswer { answer: Box::new(answer), body: None })
    }
}

/// What the route's rules left to do for a request that goes on.
#[derive(Debug, Default)]
pub(crate) enum Ruled {
    /// The route runs no rules.
    #[default]
    None,
    /// Edits to make: the path and request headers sent upstream, and the
    /// response plan.
    Forward(Box<tidegate_rules::Forward>),
    /// Work to do first ([`crate::rules_work::settle`]), then the chain
    /// goes on; the request header edits of the route's `client_cert`
    /// follow the chain's.
    Pending(Arc<Chain>, Box<tidegate_rules::Pending>, Vec<tidegate_rules::HeaderEdit>),
}

impl From<ErrorKind> for Local {
    fn from(kind: ErrorKind) -> Local {
        Local::Error(kind)
    }
}

/// What to do with a request.
#[derive(Debug)]
pub(crate) enum Action<'s> {
    /// Answer it locally.
    Local(Local),
    /// Serve a file of `dir`: the request path less the route's `prefix`.
    Static { dir: &'s StaticDir, prefix: &'s PathPattern },
    /// Forward it to a backend of this service.
    Forward(Arc<ServiceRuntime>),
}

/// The pipeline's decision: the route that matched (for the access log and
/// the route's statistics), if one did, the action, and for a request
/// that is served (forwarded or from a static directory) what its route's
/// rules left to do.
#[derive(Debug)]
pub(crate) struct Decision<'s> {
    /// The matched route.
    pub route: Option<&'s Entry>,
    /// What to do.
    pub action: Action<'s>,
    /// The rules' edits, or their pending work.
    pub rules: Ruled,
}

impl Decision<'_> {
    fn local(answer: Local) -> Decision<'static> {
        Decision { route: None, action: Action::Local(answer), rules: Ruled::None }
    }
}

/// Where ACME HTTP-01 challenges are asked (RFC 8555, section 8.3).
const ACME_CHALLENGE_PATH: &str = "/.well-known/acme-challenge/";

/// Decides what to do with a request of `method` whose facts are `facts`
/// (or the reason the engine refused its head). No IO; the clock is read
/// only for a route that runs rules (rate limits count time).
pub(crate) fn decide<'s>(
    method: &Method,
    facts: Result<&Facts<'_>, Local>,
    settings: &Settings,
    snapshot: &'s Snapshot,
) -> Decision<'s> {
    if *method == Method::CONNECT {
        return Decision::local(Local::ConnectRefused);
    }
    let facts = match facts {
        Ok(f) => f,
        Err(refused) => return Decision::local(refused),
    };
    if settings.health_path.as_deref() == Some(facts.target.path) && matches!(*method, Method::GET | Method::HEAD) {
        return Decision::local(Local::Health { draining: facts.stopping });
    }
    // An ACME HTTP-01 challenge of a managed certificate's order, before
    // routing (the CA asks for any host's path, whatever the routes). A
    // token no order waits for goes on to the routes: a backend may run
    // its own ACME client.
    if let Some(token) = facts.target.path.strip_prefix(ACME_CHALLENGE_PATH) {
        if let Some(answer) = snapshot.certificates().http01(token).filter(|_| *method == Method::GET) {
            return Decision::local(Local::AcmeChallenge(answer.clone()));
        }
    }
    let view = RequestView {
        host: &facts.host,
        path: facts.target.path,
        method,
        headers: facts.headers,
        query: facts.target.query,
        listener: facts.listener,
    };
    let Some(route) = snapshot.route(&view) else {
        return Decision::local(Local::Error(ErrorKind::NoRoute));
    };
    let decided = |action| Decision { route: Some(route), action, rules: Ruled::None };
    if route.spec.redirect_https && !facts.tls {
        let to = https_location(&facts.host, settings.https_port, facts.target.path_and_query);
        return decided(Action::Local(to.map_or_else(Local::Error, Local::HttpsRedirect)));
    }
    // The route's client certificate: required (else 403), and passed
    // on (a route that asks nothing pays one test).
    let mut cert_edits = Vec::new();
    let policy = route.spec.client_cert;
    if !policy.is_default() {
        let cert = accepted_client_cert(facts, snapshot);
        if policy.required && cert.is_none() {
            return decided(Action::Local(Local::ClientCertRequired));
        }
        if let (true, Some(cert)) = (policy.forward_headers, cert) {
            cert_edits.push(tidegate_rules::HeaderEdit::Set(CLIENT_CERT_SUBJECT.clone(), cert.cert.subject.clone()));
            cert_edits
                .push(tidegate_rules::HeaderEdit::Set(CLIENT_CERT_FINGERPRINT.clone(), cert.cert.fingerprint.clone()));
        }
    }
    // The route's rule sets, in order, compiled and found with the route.
    let rules = match &route.attached {
        Some(chain) => match chain.request(&facts.rules_view(method, settings), facts.received) {
            Outcome::Forward(mut edits) => {
                if !cert_edits.is_empty() {
                    edits.add_request_edits(cert_edits);
                }
                Ruled::Forward(edits)
            }
            Outcome::Answer(answer) => return decided(Action::Local(answer.into())),
            Outcome::Pending(work) => Ruled::Pending(chain.clone(), Box::new(work), cert_edits),
        },
        _ if cert_edits.is_empty() => Ruled::None,
        _ => {
            let mut edits = tidegate_rules::Forward::default();
            edits.add_request_edits(cert_edits);
            Ruled::Forward(Box::new(edits))
        }
    };
    let action = match &route.spec.action {
        RouteAction::Static(dir) => Action::Static { dir, prefix: &route.spec.matches.path },
        RouteAction::Service(name) => match snapshot.service(name.as_str()) {
            Some(service) => Action::Forward(service.clone()),
            None => Action::Local(Local::Error(ErrorKind::NoBackend)),
        },
    };
    Decision { route: Some(route), action, rules }
}

/// Settles the rules' pending work, if any: the rules' edits for a
/// request that goes on (`None`: the route runs no rules), or the answer a
/// step gave. The work itself ([`tidegate_rules::Work`]) is `work`'s: the
/// engines pass [`crate::rules_work::run`]; tests pass their own.
pub(crate) async fn settle<F, W>(
    ruled: Ruled,
    facts: &Facts<'_>,
    method: &Method,
    settings: &Settings,
    mut work: W,
) -> Result<Option<Box<tidegate_rules::Forward>>, Local>
where
    W: FnMut(tidegate_rules::Work) -> F,
    F: std::future::Future<Output = Option<tidegate_rules::WorkResult>>,
{
    let (chain, mut pending, mut cert_edits) = match ruled {
        Ruled::None => return Ok(None),
        Ruled::Forward(edits) => return Ok(Some(edits)),
        Ruled::Pending(chain, pending, cert_edits) => (chain, *pending, cert_edits),
    };
    let view = facts.rules_view(method, settings);
    loop {
        let tidegate_rules::Pending { work: todo, resume } = pending;
        let Some(result) = work(todo).await else {
            // The work could not be done (the auth service did not answer):
            // refused, never let through.
            return Err(chain.auth_failed(resume).into());
        };
        // An auth service's refusal is given to the client with its body.
        let auth_body = match &result {
            tidegate_rules::WorkResult::ForwardAuth(a) => Some(a.body.clone()),
            tidegate_rules::WorkResult::Password(_) => None,
        };
        match chain.resume(&view, Instant::now(), resume, result) {
            Outcome::Forward(mut edits) => {
                edits.add_request_edits(cert_edits.drain(..));
                return Ok(Some(edits));
            }
            Outcome::Answer(answer) => {
                let body = auth_body.filter(|_| answer.relay_auth_body);
                return Err(Local::Rule(RuleAnswer { answer: Box::new(answer), body }));
            }
            Outcome::Pending(next) => pending = next,
        }
    }
}

/// A request's target, as the engine read it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Asked<'a> {
    /// The normalized path, without the query (the one the rules were
    /// given).
    pub path: &'a str,
    /// The query, without `?`.
    pub query: Option<&'a str>,
    /// What the backend receives: the two together.
    pub path_and_query: &'a str,
}

impl<'a> Asked<'a> {
    /// The target of an `http` request's path and query.
    pub(crate) fn of(pq: &'a http::uri::PathAndQuery) -> Asked<'a> {
        Asked { path: pq.path(), query: pq.query(), path_and_query: pq.as_str() }
    }

    /// The target of an `http` request's URI (`/` when it names none).
    pub(crate) fn of_uri(uri: &'a http::Uri) -> Asked<'a> {
        uri.path_and_query().map_or(Asked { path: "/", query: None, path_and_query: "/" }, Asked::of)
    }
}

/// What the backend (or the static file server) is asked for: the path
/// the rules left (`edits`), with the request's query, or the request's
/// own path and query.
pub(crate) fn upstream_target<'a>(edits: Option<&'a tidegate_rules::Forward>, asked: Asked<'a>) -> Cow<'a, str> {
    match edits.and_then(|e| e.path(asked.path)) {
        None => Cow::Borrowed(asked.path_and_query),
        Some(path) => match asked.query {
            Some(query) => Cow::Owned(format!("{path}?{query}")),
            None => Cow::Borrowed(path),
        },
    }
}

/// The connection's verified client certificate, if the certificate that
/// serves the request's host (the one its name as an SNI name selects)
/// verifies client certificates with the same CAs: a certificate verified
/// for another server name (a client may send one name in its SNI and
/// another in `Host`) is not taken.
fn accepted_client_cert<'f>(facts: &Facts<'f>, snapshot: &Snapshot) -> Option<&'f VerifiedClient> {
    let cert = facts.client_cert?;
    let host = Some(facts.host.as_ref()).filter(|h| !h.is_empty());
    let served = snapshot.certificates().select(host)?;
    served.client_auth.as_ref().filter(|auth| auth.ca_id() == &cert.ca_id).map(|_| cert)
}

/// Where a `redirect_https` route sends a request that came over plain
/// HTTP: the same host (`host`: lowercase, without its port) on the TLS
/// listener's port (omitted when it is 443, or unknown), with the same path
/// and query. A request that names no host cannot be redirected.
fn https_location(host: &str, https_port: Option<u16>, path_and_query: &str) -> Result<HeaderValue, ErrorKind> {
    if host.is_empty() {
        return Err(ErrorKind::InvalidHost);
    }
    let location = match https_port {
        Some(p) if p != 443 => format!("https://{host}:{p}{path_and_query}"),
        _ => format!("https://{host}{path_and_query}"),
    };
    HeaderValue::from_str(&location).map_err(|_| ErrorKind::InvalidPath)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderMap;
    use tidegate_model::{parse_change_set, ConfigState, Delta, ServiceName};

    /// A snapshot of `ops` (a change set's operations, as JSON).
    fn snapshot(ops: &str) -> Snapshot {
        let cs = parse_change_set(format!(r#"{{"ops":[{ops}]}}"#).as_bytes()).unwrap();
        let (state, _) = ConfigState::default().apply(&cs, 1).unwrap();
        Snapshot::from_state(&state, 1)
    }

    const WEB: &str = r#"{"op":"put_service","name":"web","spec":{"backends":[{"id":"a","addr":"127.0.0.1:1"}]}},
        {"op":"put_route","name":"api","spec":{"match":{"path_prefix":"/api"},"service":"web"}},
        {"op":"put_route","name":"secure","spec":{"match":{"host":"secure.example"},"service":"web","redirect_https":true}}"#;

    struct Req {
        peer: IpAddr,
        method: Method,
        host: &'static str,
        path: &'static str,
        pq: &'static str,
        headers: HeaderMap,
        tls: bool,
        stopping: bool,
        client_cert: Option<VerifiedClient>,
    }

    fn req(method: Method, host: &'static str, path: &'static str) -> Req {
        Req {
            peer: [127, 0, 0, 1].into(),
            method,
            host,
            path,
            pq: path,
            headers: HeaderMap::new(),
            tls: false,
            stopping: false,
            client_cert: None,
        }
    }

    impl Req {
        fn facts(&self) -> Facts<'_> {
            Facts {
                host: Cow::Borrowed(self.host),
                target: Asked {
                    path: self.path,
                    path_and_query: self.pq,
                    query: self.pq.split_once('?').map(|(_, q)| q),
                },
                received: Instant::now(),
                headers: &self.headers,
                tls: self.tls,
                stopping: self.stopping,
                peer: self.peer,
                content_length: None,
                client_cert: self.client_cert.as_ref(),
                listener: None,
            }
        }

        fn decide<'s>(&self, settings: &Settings, snap: &'s Snapshot) -> Decision<'s> {
            decide(&self.method, Ok(&self.facts()), settings, snap)
        }
    }

    fn local<'d>(d: &'d Decision<'_>) -> Option<&'d Local> {
        match &d.action {
            Action::Local(l) => Some(l),
            _ => None,
        }
    }

    fn route_name(d: &Decision<'_>) -> Option<String> {
        d.route.map(|r| r.name.to_string())
    }

    #[test]
    fn connect_is_refused_before_anything_else_is_read() {
        let snap = snapshot(WEB);
        let settings = Settings::default();
        let d = decide(&Method::CONNECT, Err(Local::Error(ErrorKind::InvalidPath)), &settings, &snap);
        assert_eq!(local(&d), Some(&Local::ConnectRefused));
        let mut r = req(Method::CONNECT, "a.example", "/api");
        r.headers.insert("x", HeaderValue::from_static("1"));
        assert_eq!(local(&r.decide(&settings, &snap)), Some(&Local::ConnectRefused));
    }

    #[test]
    fn a_refused_head_is_answered_as_the_engine_said() {
        let snap = snapshot(WEB);
        let settings = Settings::default();
        for refused in [Local::HeadTooLarge, Local::Error(ErrorKind::InvalidHost)] {
            let d = decide(&Method::GET, Err(refused.clone()), &settings, &snap);
            assert_eq!(local(&d), Some(&refused));
            assert!(d.route.is_none());
        }
    }

    #[test]
    fn the_health_path_answers_reads_before_routing() {
        // No route at all: the health path still answers.
        let snap = Snapshot::empty();
        let settings = Settings { health_path: Some("/healthz".into()), ..Settings::default() };
        let d = req(Method::GET, "", "/healthz").decide(&settings, &snap);
        assert_eq!(local(&d), Some(&Local::Health { draining: false }));
        let mut stopping = req(Method::HEAD, "a", "/healthz");
        stopping.stopping = true;
        assert_eq!(local(&stopping.decide(&settings, &snap)), Some(&Local::Health { draining: true }));
        // Another method, or another path, is routed as usual.
        let d = req(Method::POST, "a", "/healthz").decide(&settings, &snap);
        assert_eq!(local(&d), Some(&Local::Error(ErrorKind::NoRoute)));
        let d = req(Method::GET, "a", "/healthz/x").decide(&settings, &snap);
        assert_eq!(local(&d), Some(&Local::Error(ErrorKind::NoRoute)));
        // Without a health path, nothing is answered locally.
        let d = req(Method::GET, "a", "/healthz").decide(&Settings::default(), &snap);
        assert_eq!(local(&d), Some(&Local::Error(ErrorKind::NoRoute)));
    }

    #[test]
    fn a_request_no_route_matches_is_refused() {
        let snap = snapshot(WEB);
        let d = req(Method::GET, "a.example", "/other").decide(&Settings::default(), &snap);
        assert_eq!(local(&d), Some(&Local::Error(ErrorKind::NoRoute)));
        assert!(d.route.is_none());
    }

    #[test]
    fn a_service_route_forwards_to_the_snapshot_service() {
        let snap = snapshot(WEB);
        let d = req(Method::POST, "a.example", "/api/x").decide(&Settings::default(), &snap);
        assert_eq!(route_name(&d).as_deref(), Some("api"));
        match d.action {
            Action::Forward(service) => assert!(Arc::ptr_eq(&service, snap.service("web").unwrap())),
            other => panic!("forwarded, not {other:?}"),
        }
    }

    #[test]
    fn a_route_whose_service_is_gone_has_no_backend() {
        let snap = snapshot(WEB);
        // The next snapshot drops the service and keeps the route (as a
        // snapshot built between two steps of a change could).
        let mut delta = Delta::default();
        delta.services.insert(ServiceName::new("web").unwrap());
        let gone = snap.next(&ConfigState::default(), &delta, 2);
        let d = req(Method::GET, "a.example", "/api").decide(&Settings::default(), &gone);
        assert_eq!(route_name(&d).as_deref(), Some("api"));
        assert_eq!(local(&d), Some(&Local::Error(ErrorKind::NoBackend)));
    }

    #[test]
    fn redirect_https_sends_plain_http_to_the_tls_port() {
        let snap = snapshot(WEB);
        let mut r = req(Method::POST, "secure.example", "/a");
        r.pq = "/a?q=1";
        let on = |port| Settings { https_port: port, ..Settings::default() };
        let d = r.decide(&on(Some(8443)), &snap);
        assert_eq!(route_name(&d).as_deref(), Some("secure"));
        let location = |d: &Decision<'_>| match local(d) {
            Some(Local::HttpsRedirect(to)) => to.to_str().unwrap().to_string(),
            other => panic!("a redirect, not {other:?}"),
        };
        assert_eq!(location(&d), "https://secure.example:8443/a?q=1");
        assert_eq!(location(&r.decide(&on(Some(443)), &snap)), "https://secure.example/a?q=1");
        assert_eq!(location(&r.decide(&on(None), &snap)), "https://secure.example/a?q=1");
        // Over TLS, the route forwards.
        r.tls = true;
        assert!(matches!(r.decide(&on(Some(8443)), &snap).action, Action::Forward(_)));
    }

    #[test]
    fn https_locations_keep_host_path_and_query() {
        let loc = |host, port, pq| https_location(host, port, pq).map(|v| v.to_str().unwrap().to_string());
        assert_eq!(loc("a.example", Some(8443), "/x?y=1"), Ok("https://a.example:8443/x?y=1".to_string()));
        assert_eq!(loc("a.example", Some(443), "/"), Ok("https://a.example/".to_string()));
        assert_eq!(loc("a.example", None, "/"), Ok("https://a.example/".to_string()));
        assert_eq!(loc("", Some(443), "/"), Err(ErrorKind::InvalidHost));
    }

    #[test]
    fn a_redirect_needs_a_host_and_a_valid_location() {
        // A catch-all route that redirects: a request without a host (HTTP/1.0)
        // cannot be redirected.
        let snap = snapshot(
            r#"{"op":"put_service","name":"web","spec":{}},
            {"op":"put_route","name":"all","spec":{"service":"web","redirect_https":true}}"#,
        );
        let d = req(Method::GET, "", "/").decide(&Settings::default(), &snap);
        assert_eq!(local(&d), Some(&Local::Error(ErrorKind::InvalidHost)));
        assert_eq!(route_name(&d).as_deref(), Some("all"));
        let mut r = req(Method::GET, "a.example", "/");
        r.pq = "/\u{7f}";
        assert_eq!(local(&r.decide(&Settings::default(), &snap)), Some(&Local::Error(ErrorKind::InvalidPath)));
    }

    #[test]
    fn a_static_route_serves_its_directory() {
        let dir = tempfile::tempdir().unwrap();
        let root = serde_json::to_string(dir.path().to_str().unwrap()).unwrap();
        let snap = snapshot(&format!(
            r#"{{"op":"put_route","name":"files","spec":{{"match":{{"path_prefix":"/files"}},"static":{{"root":{root}}}}}}}"#
        ));
        let d = req(Method::GET, "a.example", "/files/x.txt").decide(&Settings::default(), &snap);
        assert_eq!(route_name(&d).as_deref(), Some("files"));
        match d.action {
            Action::Static { dir: served, prefix } => {
                assert_eq!(served.root, dir.path());
                assert_eq!(prefix, &snap.routes().next().unwrap().spec.matches.path);
            }
            other => panic!("static, not {other:?}"),
        }
    }

    #[test]
    fn routes_read_the_method_and_headers_of_the_facts() {
        let snap = snapshot(
            r#"{"op":"put_service","name":"web","spec":{}},
            {"op":"put_route","name":"beta","spec":{"match":{"headers":{"x-beta":"1"}},"service":"web"}}"#,
        );
        let mut r = req(Method::GET, "a.example", "/");
        assert_eq!(local(&r.decide(&Settings::default(), &snap)), Some(&Local::Error(ErrorKind::NoRoute)));
        r.headers.insert("x-beta", HeaderValue::from_static("1"));
        assert_eq!(route_name(&r.decide(&Settings::default(), &snap)).as_deref(), Some("beta"));
    }

    const RULED: &str = r#"{"op":"put_service","name":"web","spec":{}},
        {"op":"put_rules","name":"api","spec":{"steps":[
            {"kind":"strip_prefix","prefix":"/api"},
            {"kind":"set_request_header","name":"x-a","value":"1"},
            {"kind":"ip_deny","cidrs":["192.0.2.0/24"]}]}},
        {"op":"put_rules","name":"auth","spec":{"steps":[{"kind":"basic_auth","realm":"r",
            "users":[{"name":"u","hash":"$2b$04$/uaF/uaF/uaF/uaF/uaF/uK7.eFDTHWTk03S8wqeyk9ZLEdfjGgEC"}]}]}},
        {"op":"put_route","name":"api","spec":{"match":{"path_prefix":"/api"},"service":"web","rules":["api"]}},
        {"op":"put_route","name":"admin","spec":{"match":{"path_prefix":"/admin"},"service":"web","rules":["auth"]}}"#;

    #[test]
    fn a_route_s_rules_edit_what_is_forwarded() {
        let snap = snapshot(RULED);
        let mut r = req(Method::GET, "a.example", "/api/x");
        r.pq = "/api/x?q=1";
        let d = r.decide(&Settings::default(), &snap);
        assert!(matches!(d.action, Action::Forward(_)));
        let Ruled::Forward(edits) = d.rules else { panic!("edits, not {:?}", d.rules) };
        assert_eq!(edits.path(r.path), Some("/x"));
        assert_eq!(edits.request_edits().count(), 1);
        assert_eq!(upstream_target(Some(&edits), r.facts().target), "/x?q=1");
        assert_eq!(upstream_target(None, r.facts().target), "/api/x?q=1");
        r.pq = r.path;
        assert_eq!(upstream_target(Some(&edits), r.facts().target), "/x");
        // A route without rules leaves nothing to do.
        let plain = snapshot(WEB);
        assert!(matches!(req(Method::GET, "a", "/api").decide(&Settings::default(), &plain).rules, Ruled::None));
    }

    #[test]
    fn a_rule_s_answer_is_the_route_s_local_answer() {
        let snap = snapshot(RULED);
        let mut r = req(Method::GET, "a.example", "/api/x");
        r.peer = [192, 0, 2, 7].into();
        let d = r.decide(&Settings::default(), &snap);
        assert_eq!(route_name(&d).as_deref(), Some("api"));
        match local(&d) {
            Some(Local::Rule(a)) => assert_eq!((a.answer.status, a.answer.rule.kind), (403, "ip_deny")),
            other => panic!("a rule's answer, not {other:?}"),
        }
    }

    #[test]
    fn the_client_behind_trusted_proxies_is_the_last_untrusted_hop() {
        let trusted: TrustedProxies = "10.0.0.0/8".parse().unwrap();
        let mut r = req(Method::GET, "a", "/");
        r.peer = [10, 0, 0, 1].into();
        r.headers.append("x-forwarded-for", HeaderValue::from_static("6.6.6.6, 198.51.100.7"));
        r.headers.append("x-forwarded-for", HeaderValue::from_static("10.0.0.9"));
        assert_eq!(r.facts().client(&trusted), IpAddr::from([198, 51, 100, 7]));
        // Without trust, or from an untrusted peer, the peer is the client.
        assert_eq!(r.facts().client(&TrustedProxies::default()), IpAddr::from([10, 0, 0, 1]));
        r.peer = [203, 0, 113, 1].into();
        assert_eq!(r.facts().client(&trusted), IpAddr::from([203, 0, 113, 1]));
        // An unreadable hop stops the walk at the last address believed.
        r.peer = [10, 0, 0, 1].into();
        r.headers.insert("x-forwarded-for", HeaderValue::from_static("6.6.6.6, junk, 10.0.0.2"));
        assert_eq!(r.facts().client(&trusted), IpAddr::from([10, 0, 0, 2]));
    }

    #[tokio::test]
    async fn pending_work_is_settled_and_a_failure_refuses() {
        let snap = snapshot(RULED);
        let settings = Settings::default();
        let mut r = req(Method::GET, "a.example", "/admin");
        // "u:s3cret"
        r.headers.insert("authorization", HeaderValue::from_static("Basic dTpzM2NyZXQ="));
        let facts = r.facts();
        let pending = || decide(&Method::GET, Ok(&facts), &settings, &snap).rules;
        assert!(matches!(pending(), Ruled::Pending(..)));
        let run = |work| async move { crate::rules_work::run(work).await };
        let settled = settle(pending(), &facts, &Method::GET, &settings, run).await;
        assert!(matches!(settled, Ok(Some(_))), "the right password goes through");
        let failed = settle(pending(), &facts, &Method::GET, &settings, |_| async { None }).await;
        match failed {
            Err(Local::Rule(a)) => assert_eq!(a.answer.status, 503),
            other => panic!("refused, not {other:?}"),
        }
        r.headers.insert("authorization", HeaderValue::from_static("Basic dTp3cm9uZw=="));
        let facts = r.facts();
        let wrong = decide(&Method::GET, Ok(&facts), &settings, &snap).rules;
        match settle(wrong, &facts, &Method::GET, &settings, run).await {
            Err(Local::Rule(a)) => assert_eq!(a.answer.status, 401),
            other => panic!("a challenge, not {other:?}"),
        }
    }

    /// A CA certificate, PEM.
    fn ca_pem(name: &str) -> String {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        params.self_signed(&key).unwrap().pem()
    }

    /// A `put_certificate` op for `host`, asking for client certificates
    /// signed by `ca` when given.
    fn cert_op(name: &str, host: &str, ca: Option<&str>) -> String {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec![host.to_string()]).unwrap().self_signed(&key).unwrap();
        let mut spec = serde_json::json!({ "cert_pem": cert.pem(), "key_pem": key.serialize_pem() });
        if let Some(ca) = ca {
            spec["client_auth"] = serde_json::json!({ "ca_pem": ca, "mode": "optional" });
        }
        serde_json::json!({ "op": "put_certificate", "name": name, "spec": spec }).to_string()
    }

    #[test]
    fn a_route_requiring_a_client_certificate_takes_one_its_host_s_cas_verified() {
        let (a, b) = (ca_pem("CA A"), ca_pem("CA B"));
        let snap = snapshot(&format!(
            r#"{}, {}, {}, {{"op":"put_service","name":"web","spec":{{}}}},
            {{"op":"put_route","name":"m","spec":{{"match":{{"host":"m.example"}},"service":"web",
                "client_cert":{{"required":true,"forward_headers":true}}}}}},
            {{"op":"put_route","name":"fwd","spec":{{"match":{{"host":"o.example"}},"service":"web",
                "client_cert":{{"forward_headers":true}}}}}},
            {{"op":"put_route","name":"plain","spec":{{"match":{{"host":"plain.example"}},"service":"web",
                "client_cert":{{"required":true}}}}}}"#,
            cert_op("m", "m.example", Some(&a)),
            cert_op("o", "o.example", Some(&b)),
            cert_op("p", "plain.example", None),
        ));
        let ca_id =
            |host: &str| *snap.certificates().select(Some(host)).and_then(|s| s.client_auth.as_ref()).unwrap().ca_id();
        let verified = |ca_id: [u8; 32]| VerifiedClient {
            cert: tidegate_model::ClientCertificate {
                subject: HeaderValue::from_static("CN=client"),
                fingerprint: HeaderValue::from_static("ab12"),
            },
            ca_id,
        };
        let settings = Settings::default();
        let mut r = req(Method::GET, "m.example", "/");
        r.tls = true;
        assert_eq!(local(&r.decide(&settings, &snap)), Some(&Local::ClientCertRequired), "none: 403");
        r.client_cert = Some(verified(ca_id("o.example")));
        assert_eq!(local(&r.decide(&settings, &snap)), Some(&Local::ClientCertRequired), "another host's CA: 403");
        r.client_cert = Some(verified(ca_id("m.example")));
        let d = r.decide(&settings, &snap);
        assert!(matches!(d.action, Action::Forward(_)), "{:?}", d.action);
        let Ruled::Forward(edits) = d.rules else { panic!("the headers, not {:?}", d.rules) };
        let set: Vec<_> = edits
            .request_edits()
            .map(|e| match e {
                tidegate_rules::HeaderEdit::Set(n, v) => (n.as_str().to_string(), v.clone()),
                other => panic!("set, not {other:?}"),
            })
            .collect();
        assert_eq!(
            set,
            vec![
                ("x-client-cert-subject".to_string(), HeaderValue::from_static("CN=client")),
                ("x-client-cert-fingerprint".to_string(), HeaderValue::from_static("ab12")),
            ]
        );
        // Forwarded without being required; never one of another host's CAs.
        r.host = "o.example";
        assert!(matches!(r.decide(&settings, &snap).rules, Ruled::None), "verified for m, not for o");
        r.client_cert = Some(verified(ca_id("o.example")));
        assert!(matches!(r.decide(&settings, &snap).rules, Ruled::Forward(_)));
        r.client_cert = None;
        assert!(matches!(r.decide(&settings, &snap).action, Action::Forward(_)), "optional: served");
        // A host whose certificate verifies none takes none.
        r.host = "plain.example";
        r.client_cert = Some(verified(ca_id("m.example")));
        assert_eq!(local(&r.decide(&settings, &snap)), Some(&Local::ClientCertRequired));
    }

    #[tokio::test]
    async fn forwarded_client_certificate_headers_follow_the_rules_settled_work() {
        let a = ca_pem("CA A");
        let snap = snapshot(&format!(
            r#"{}, {{"op":"put_service","name":"web","spec":{{}}}},
            {{"op":"put_rules","name":"auth","spec":{{"steps":[{{"kind":"basic_auth","realm":"r",
                "users":[{{"name":"u","hash":"$2b$04$/uaF/uaF/uaF/uaF/uaF/uK7.eFDTHWTk03S8wqeyk9ZLEdfjGgEC"}}]}},
                {{"kind":"set_request_header","name":"x-a","value":"1"}}]}}}},
            {{"op":"put_route","name":"m","spec":{{"match":{{"host":"m.example"}},"service":"web","rules":["auth"],
                "client_cert":{{"required":true,"forward_headers":true}}}}}}"#,
            cert_op("m", "m.example", Some(&a)),
        ));
        let ca_id =
            *snap.certificates().select(Some("m.example")).and_then(|s| s.client_auth.as_ref()).unwrap().ca_id();
        let mut r = req(Method::GET, "m.example", "/");
        r.client_cert = Some(VerifiedClient {
            cert: tidegate_model::ClientCertificate {
                subject: HeaderValue::from_static("CN=client"),
                fingerprint: HeaderValue::from_static("ab12"),
            },
            ca_id,
        });
        // "u:s3cret"
        r.headers.insert("authorization", HeaderValue::from_static("Basic dTpzM2NyZXQ="));
        let settings = Settings::default();
        let facts = r.facts();
        let ruled = decide(&Method::GET, Ok(&facts), &settings, &snap).rules;
        assert!(matches!(ruled, Ruled::Pending(..)), "{ruled:?}");
        let run = |work| async move { crate::rules_work::run(work).await };
        let edits = settle(ruled, &facts, &Method::GET, &settings, run).await.expect("let through").expect("edits");
        let names: Vec<String> = edits
            .request_edits()
            .map(|e| match e {
                tidegate_rules::HeaderEdit::Set(n, _) => format!("set {n}"),
                tidegate_rules::HeaderEdit::Remove(n) => format!("remove {n}"),
                other => panic!("set or remove, not {other:?}"),
            })
            .collect();
        assert_eq!(
            names,
            ["remove authorization", "set x-a", "set x-client-cert-subject", "set x-client-cert-fingerprint"],
            "the proxy's last"
        );
    }
}
