//! Per-request handling: snapshot, route, dispatch.

use std::sync::Arc;

use arc_swap::ArcSwap;
use http::{Request, Response};
use hyper::body::Incoming;
use tidegate_model::RouteAction;
use tidegate_snapshot::RequestView;
use tidegate_snapshot::Snapshot;

use crate::access_log::AccessLog;
use crate::admission::Admission;
use crate::attempts::Trace;
use crate::body::ProxyBody;
use crate::error::ErrorKind;
use crate::forward::{Peer, Upstreams};
use crate::hygiene;
use crate::limits::Limits;
use crate::metrics::{Counters, ProxyMetrics};
use crate::observe::{describe, Finish, Seen};
use crate::static_files;

/// The request handler. One per worker (or one shared, in the multi-thread
/// runtime); holds the upstream connection pools.
pub struct Proxy {
    snapshots: Arc<ArcSwap<Snapshot>>,
    upstreams: Upstreams,
    metrics: Arc<Counters>,
    /// The TLS listener's port, where `redirect_https` routes send clients.
    https_port: Option<u16>,
    /// The path answered by the proxy itself for health checks, if any.
    health_path: Option<Box<str>>,
    /// Where each request's line goes, if anywhere.
    access_log: Option<Arc<AccessLog>>,
    /// The body buffer budget and per-client caps, shared by the workers.
    admission: Arc<Admission>,
}

impl Proxy {
    /// A handler reading snapshots from `snapshots`.
    /// `https_port`: the TLS listener's port, if there is one.
    pub fn new(
        snapshots: Arc<ArcSwap<Snapshot>>,
        metrics: &ProxyMetrics,
        limits: Arc<Limits>,
        https_port: Option<u16>,
    ) -> Proxy {
        let metrics = metrics.worker();
        let admission = Arc::new(Admission::new(&limits));
        Proxy {
            snapshots,
            admission,
            upstreams: Upstreams::new(limits, &metrics),
            metrics,
            https_port,
            health_path: None,
            access_log: None,
        }
    }

    /// Shares one body buffer budget and one set of per-client counters
    /// with the other workers.
    pub(crate) fn share_admission(&mut self, admission: Arc<Admission>) {
        self.admission = admission;
    }

    /// The body buffer budget and per-client caps.
    pub(crate) fn admission(&self) -> &Arc<Admission> {
        &self.admission
    }

    /// Writes a line per request to `log`.
    pub fn set_access_log(&mut self, log: Option<Arc<AccessLog>>) {
        self.access_log = log;
    }

    /// The access log, when it is on.
    pub(crate) fn access_log(&self) -> Option<&Arc<AccessLog>> {
        self.access_log.as_ref()
    }

    /// Answers `path` itself, before routing, for load balancers' health
    /// checks.
    pub fn set_health_path(&mut self, path: Option<&str>) {
        self.health_path = path.map(Into::into);
    }

    /// The answer to a health check, if `path` is the health path and the
    /// method reads: 200 `ok`, or 503 `draining` when `stopping`.
    pub(crate) fn health_answer(
        &self,
        method: &http::Method,
        path: &str,
        stopping: bool,
    ) -> Option<Response<ProxyBody>> {
        if self.health_path.as_deref() != Some(path) || !matches!(*method, http::Method::GET | http::Method::HEAD) {
            return None;
        }
        Some(match stopping {
            false => crate::error::plain(http::StatusCode::OK, "ok\n"),
            true => crate::error::plain(http::StatusCode::SERVICE_UNAVAILABLE, "draining\n"),
        })
    }

    /// The TLS listener's port, if there is one.
    pub(crate) fn https_port(&self) -> Option<u16> {
        self.https_port
    }

    /// The current snapshot.
    pub(crate) fn snapshot(&self) -> Arc<Snapshot> {
        self.snapshots.load_full()
    }

    /// The worker's way to its backends.
    pub(crate) fn upstreams(&self) -> &Upstreams {
        &self.upstreams
    }

    /// The counters this handler updates.
    pub(crate) fn metrics(&self) -> &Arc<Counters> {
        &self.metrics
    }

    /// Serves one request. Its duration (and access-log line) is taken
    /// when the response body ends.
    pub async fn handle(&self, mut req: Request<Incoming>, client: &Peer) -> Response<ProxyBody> {
        let line = self.access_log.is_some().then(|| describe(&mut req, client));
        // Counted and logged when dropped: with the response body, or here
        // if the client goes away first (hyper drops this future).
        let mut finish = Finish {
            seen: Seen::new(tokio::time::Instant::now()),
            line,
            counters: self.metrics.clone(),
            log: self.access_log.clone(),
            bytes_out: 0,
        };
        let resp = match self.dispatch(req, client, &mut finish.seen).await {
            Ok(resp) => resp,
            Err(e) => {
                finish.seen.error = Some(e);
                self.metrics.error(e);
                e.response()
            }
        };
        self.metrics.response(resp.status());
        finish.seen.status = resp.status().as_u16();
        resp.map(|body| ProxyBody::observed(body, finish))
    }

    async fn dispatch(
        &self,
        mut req: Request<Incoming>,
        client: &Peer,
        seen: &mut Seen,
    ) -> Result<Response<ProxyBody>, ErrorKind> {
        if req.method() == http::Method::CONNECT {
            return Ok(hygiene::refuse_connect());
        }
        // The HTTP/1 parsers count headers; an HTTP/2 header list is only
        // bounded in bytes, so count here.
        if req.headers().len() > self.upstreams.limits().max_headers {
            return Ok(crate::error::head_too_large());
        }
        hygiene::sanitize(&mut req)?;
        if let Some(resp) = self.health_answer(req.method(), req.uri().path(), false) {
            return Ok(resp);
        }
        let snapshot = self.snapshots.load_full();
        let host = hygiene::request_routing_host(&req);
        let view = RequestView { host: &host, path: req.uri().path(), method: req.method(), headers: req.headers() };
        let route = snapshot.route(&view).ok_or(ErrorKind::NoRoute)?;
        seen.routed(route, self.access_log.is_some());
        if route.spec.redirect_https && !client.https {
            let pq = req.uri().path_and_query().map_or("/", |pq| pq.as_str());
            return hygiene::https_redirect(&host, self.https_port, pq);
        }
        match &route.spec.action {
            RouteAction::Static(dir) => Ok(static_files::serve(dir, &route.spec.matches.path, &req).await),
            RouteAction::Service(name) => {
                let service = snapshot.service(name.as_str()).ok_or(ErrorKind::NoBackend)?.clone();
                drop(snapshot);
                let mut trace = Trace::default();
                let forwarded = self.upstreams.forward(&service, req, client, &self.admission, &mut trace).await;
                seen.traced(trace);
                forwarded
            }
        }
    }
}
