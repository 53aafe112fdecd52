//! Per-request handling: snapshot, route, dispatch.

use std::sync::Arc;

use arc_swap::ArcSwap;
use http::{Request, Response};
use hyper::body::Incoming;
use tidegate_snapshot::Snapshot;
use tokio::time::Instant;

use crate::access_log::{AccessLog, Line};
use crate::admission::Admission;
use crate::attempts::Trace;
use crate::body::ProxyBody;
use crate::conn::Peer;
use crate::error::ErrorKind;
use crate::hygiene;
use crate::limits::Limits;
use crate::metrics::{Counters, ProxyMetrics};
use crate::observe::{describe, Finish, Seen};
use crate::pipeline::{self, Action, Facts, Local, Settings};
use crate::upstreams::Upstreams;

/// The request handler. One per worker (or one shared, in the multi-thread
/// runtime); holds the upstream connection pools.
pub struct Proxy {
    snapshots: Arc<ArcSwap<Snapshot>>,
    upstreams: Upstreams,
    metrics: Arc<Counters>,
    /// What the request pipeline reads of the worker: the health path and
    /// the TLS listener's port.
    settings: Settings,
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
            settings: Settings { health_path: None, https_port },
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
        self.settings.health_path = path.map(Into::into);
    }

    /// What the request pipeline reads of the worker.
    pub(crate) fn settings(&self) -> &Settings {
        &self.settings
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
                crate::reply::error(e)
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
        // This engine's checks of the head; refused or not, the pipeline
        // decides (it refuses `CONNECT` before reading them).
        let checked = check_head(&mut req, self.upstreams.limits().max_headers);
        let host = hygiene::request_routing_host(&req);
        let facts = Facts {
            host,
            path: req.uri().path(),
            path_and_query: req.uri().path_and_query().map_or("/", |pq| pq.as_str()),
            headers: req.headers(),
            tls: client.https,
            stopping: false,
        };
        let snapshot = self.snapshots.load_full();
        let decision = pipeline::decide(req.method(), checked.map(|()| &facts), &self.settings, &snapshot);
        if let Some(route) = decision.route {
            seen.routed(route, self.access_log.is_some());
        }
        match decision.action {
            Action::Local(answer) => crate::reply::local_response(answer),
            Action::Static { dir, prefix } => {
                Ok(tidegate_static::serve(dir, prefix, &req).await.map(ProxyBody::Static))
            }
            Action::Forward(service) => {
                drop(facts);
                drop(snapshot);
                let mut trace = Trace::default();
                let forwarded = self.upstreams.forward(&service, req, client, &self.admission, &mut trace).await;
                seen.traced(trace);
                forwarded
            }
        }
    }
}

/// The hyper engine's checks of a request head, in place: the header
/// count (the HTTP/1 parsers count headers; an HTTP/2 header list is only
/// bounded in bytes), then [`hygiene::sanitize`].
fn check_head(req: &mut Request<Incoming>, max_headers: usize) -> Result<(), Local> {
    if req.headers().len() > max_headers {
        return Err(Local::HeadTooLarge);
    }
    hygiene::sanitize(req).map_err(Local::Error)
}

impl Proxy {
    /// Counts a request that `ended` (its last byte written) in its route's
    /// histogram and, when the access log is on, sends its line (`describe`
    /// fills in what only the request knows, from the record and `ended`:
    /// the line's duration is the histogram's).
    pub(crate) fn finish(&self, seen: &Seen, ended: Instant, describe: impl FnOnce(&Seen, Instant) -> Line) {
        crate::observe::count(seen, ended, self.metrics());
        if let Some(log) = self.access_log() {
            log.send(describe(seen, ended));
        }
    }
}
