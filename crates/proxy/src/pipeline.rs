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
//! 3. the health path, answered before routing;
//! 4. the route, from the snapshot;
//! 5. the route's request rules: today `redirect_https`; issue 37's rules
//!    (redirects, rewrites, header edits, access control, rate limits,
//!    auth) are further steps here, each either answering locally or
//!    editing what is forwarded;
//! 6. the route's action: a static directory, or a service of the
//!    snapshot.
//!
//! Response rules apply to the answer afterwards, in the engines' common
//! reply path.

use std::borrow::Cow;
use std::sync::Arc;

use http::header::HeaderValue;
use http::Method;
use tidegate_model::{Headers, PathPattern, RouteAction, StaticDir};
use tidegate_snapshot::{Entry, RequestView, ServiceRuntime, Snapshot};

use crate::error::ErrorKind;

/// What the engine knows of a request, read its own way (the method is
/// read apart: it is known even of a head the engine refuses).
pub(crate) struct Facts<'a> {
    /// The host routes match: lowercase, without its port or one trailing
    /// dot (empty for an HTTP/1.0 request that names none).
    pub host: Cow<'a, str>,
    /// The normalized path, without the query.
    pub path: &'a str,
    /// What the backend receives: the normalized path and the query.
    pub path_and_query: &'a str,
    /// The request's header fields.
    pub headers: &'a dyn Headers,
    /// The client came over TLS.
    pub tls: bool,
    /// The worker is stopping (health checks answer `draining`).
    pub stopping: bool,
}

/// The worker's settings the pipeline reads.
#[derive(Debug, Clone, Default)]
pub(crate) struct Settings {
    /// The path answered by the proxy itself for health checks, if any.
    pub health_path: Option<Box<str>>,
    /// The TLS listener's port, where `redirect_https` routes send clients.
    pub https_port: Option<u16>,
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
    /// `431`: more header fields than `--max-headers`, or a head larger
    /// than `--max-header-bytes`.
    HeadTooLarge,
    /// `308` to the same URL over HTTPS, at `Location`.
    HttpsRedirect(HeaderValue),
    /// A refusal counted as an error (metrics, access log): the request is
    /// invalid, no route matches it, or its service is gone.
    Error(ErrorKind),
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
/// the route's statistics), if one did, and the action.
#[derive(Debug)]
pub(crate) struct Decision<'s> {
    /// The matched route.
    pub route: Option<&'s Entry>,
    /// What to do.
    pub action: Action<'s>,
}

impl Decision<'_> {
    fn local(answer: Local) -> Decision<'static> {
        Decision { route: None, action: Action::Local(answer) }
    }
}

/// Decides what to do with a request of `method` whose facts are `facts`
/// (or the reason the engine refused its head). Pure: no IO, no clock.
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
    if settings.health_path.as_deref() == Some(facts.path) && matches!(*method, Method::GET | Method::HEAD) {
        return Decision::local(Local::Health { draining: facts.stopping });
    }
    let view = RequestView { host: &facts.host, path: facts.path, method, headers: facts.headers };
    let Some(route) = snapshot.route(&view) else {
        return Decision::local(Local::Error(ErrorKind::NoRoute));
    };
    let decided = |action| Decision { route: Some(route), action };
    // The route's request rules (issue 37's rules go here, in order).
    if route.spec.redirect_https && !facts.tls {
        let to = https_location(&facts.host, settings.https_port, facts.path_and_query);
        return decided(Action::Local(to.map_or_else(Local::Error, Local::HttpsRedirect)));
    }
    decided(match &route.spec.action {
        RouteAction::Static(dir) => Action::Static { dir, prefix: &route.spec.matches.path },
        RouteAction::Service(name) => match snapshot.service(name.as_str()) {
            Some(service) => Action::Forward(service.clone()),
            None => Action::Local(Local::Error(ErrorKind::NoBackend)),
        },
    })
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
        method: Method,
        host: &'static str,
        path: &'static str,
        pq: &'static str,
        headers: HeaderMap,
        tls: bool,
        stopping: bool,
    }

    fn req(method: Method, host: &'static str, path: &'static str) -> Req {
        Req { method, host, path, pq: path, headers: HeaderMap::new(), tls: false, stopping: false }
    }

    impl Req {
        fn facts(&self) -> Facts<'_> {
            Facts {
                host: Cow::Borrowed(self.host),
                path: self.path,
                path_and_query: self.pq,
                headers: &self.headers,
                tls: self.tls,
                stopping: self.stopping,
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
        let settings = Settings { health_path: Some("/healthz".into()), https_port: None };
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
        let on = |port| Settings { health_path: None, https_port: port };
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
}
