//! Tidegate's admin API: HTTP+JSON, bearer-token authenticated.
//!
//! Resource endpoints (`/v1/services`, `/v1/services/{s}/backends/{id}`,
//! `/v1/routes`) and the atomic change-set endpoint (`POST /v1/changes`) all
//! become change sets for the writer; every write answers `{"revision": N}`
//! only once that revision is durable and live. Reads: `/v1/config`,
//! `/v1/status`, `/v1/watch` (server-sent events), `/metrics` (Prometheus).
//! The dashboard at `/ui/` is a page that reads the same API.
//! Every error is JSON naming what is wrong and, for bodies, the field.

pub mod api;
mod autoscale;
mod error;
mod handlers;
mod metrics;
pub mod openapi;
mod status;
#[cfg(test)]
mod tests;
mod ui;
mod watch;

use std::path::PathBuf;
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::header::{AUTHORIZATION, CONTENT_LENGTH};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::Router;
use tidegate_autoscale::{Events, StatusBoard};
use tidegate_control::{Control, WatchLimits, Watchers};

pub use error::ApiError;
pub use metrics::SharedCollector;
pub use tidegate_metrics::Collector;

/// What the handlers share. Cloned for every request (axum hands each
/// handler its own copy), so it is one reference-counted pointer.
#[derive(Clone)]
pub struct AdminState(Arc<AdminStateInner>);

/// The contents of [`AdminState`].
pub struct AdminStateInner {
    control: Control,
    token: Arc<str>,
    data_plane: SharedCollector,
    events: Arc<Events>,
    scaling: StatusBoard,
    /// The DNS pools' state, by service.
    dns: tidegate_dns::DnsBoard,
    /// The named listeners' state, as the data plane serves them.
    listeners: tidegate_snapshot::ListenerBoard,
    /// The bounds on `/v1/watch` streams, and what they hold.
    watchers: Watchers,
    /// Directories no static route may serve from or above (the data
    /// directory), canonical.
    private_dirs: Arc<[PathBuf]>,
    /// What became of the configuration file, if there is one.
    config_file: Option<Arc<ConfigFileReport>>,
    /// The instance this process took over, if it did.
    predecessor: Option<Arc<PredecessorReport>>,
    /// QUIC connections open now, when HTTP/3 is on.
    quic_open: Option<QuicOpen>,
    /// Everything `/metrics` shows.
    registry: Arc<tidegate_metrics::Registry>,
}

/// What `serve --config FILE` last did with its file, shared between the
/// binary (which reads the file at start and on `SIGHUP`) and `/v1/status`
/// and `/metrics`: a refused file is visible there, not only in the log.
#[derive(Debug, Default)]
pub struct ConfigFileReport {
    state: std::sync::Mutex<api::ConfigFileState>,
}

impl ConfigFileReport {
    /// A report on `path`, read in `mode` (`seed` or `sync`).
    pub fn new(path: &std::path::Path, mode: &str) -> ConfigFileReport {
        let state = api::ConfigFileState { path: path.display().to_string(), mode: mode.into(), ..Default::default() };
        ConfigFileReport { state: std::sync::Mutex::new(state) }
    }

    /// The file was applied at `revision` (or found in sync with it).
    pub fn applied(&self, revision: u64) {
        if let Ok(mut s) = self.state.lock() {
            s.ok = true;
            s.applied_revision = Some(revision);
            s.last_error = None;
        }
    }

    /// The file was refused, for `error`; nothing changed.
    pub fn refused(&self, error: String) {
        if let Ok(mut s) = self.state.lock() {
            s.ok = false;
            s.last_error = Some(error);
            s.failures += 1;
        }
    }

    /// As `/v1/status` shows it.
    pub fn state(&self) -> api::ConfigFileState {
        self.state.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

/// The instance this process took over (`serve --takeover`), as it drains:
/// the binary feeds the reports it receives on the hand-over's channel,
/// `/v1/status` (`predecessor`) and `/metrics` show them, so both
/// processes' states are visible during the overlap.
#[derive(Debug)]
pub struct PredecessorReport {
    since: std::time::Instant,
    state: std::sync::Mutex<api::PredecessorState>,
}

impl PredecessorReport {
    /// The instance with process id `pid` was taken over now.
    pub fn new(pid: u32) -> PredecessorReport {
        let state = api::PredecessorState { pid, state: "draining".into(), connections: 0, cut: None, drain_ms: 0 };
        PredecessorReport { since: std::time::Instant::now(), state: std::sync::Mutex::new(state) }
    }

    fn update(&self, f: impl FnOnce(&mut api::PredecessorState)) {
        if let Ok(mut s) = self.state.lock() {
            f(&mut s);
            s.drain_ms = self.since.elapsed().as_millis() as u64;
        }
    }

    /// It still has `connections` open.
    pub fn draining(&self, connections: u64) {
        self.update(|s| s.connections = connections);
    }

    /// It is done; `cut` connections were closed by its drain timeout.
    pub fn exited(&self, cut: u64) {
        self.update(|s| {
            s.state = "exited".into();
            s.connections = 0;
            s.cut = Some(cut);
        });
    }

    /// It stopped reporting without saying it was done.
    pub fn gone(&self) {
        self.update(|s| s.state = "gone".into());
    }

    /// As `/v1/status` shows it.
    pub fn state(&self) -> Option<api::PredecessorState> {
        self.state.lock().ok().map(|s| s.clone())
    }
}

impl std::ops::Deref for AdminState {
    type Target = AdminStateInner;

    fn deref(&self) -> &AdminStateInner {
        &self.0
    }
}

/// The largest request body accepted: 32 MiB, room for a batch of over
/// 100,000 ops (a small op takes 50 to 300 bytes of JSON).
pub const BODY_LIMIT: usize = 32 * 1024 * 1024;

/// What an [`AdminState`] is made of, before its registry.
struct Parts {
    control: Control,
    token: Arc<str>,
    data_plane: SharedCollector,
    events: Arc<Events>,
    scaling: StatusBoard,
    dns: tidegate_dns::DnsBoard,
    listeners: tidegate_snapshot::ListenerBoard,
    watchers: Watchers,
    private_dirs: Arc<[PathBuf]>,
    config_file: Option<Arc<ConfigFileReport>>,
    predecessor: Option<Arc<PredecessorReport>>,
    quic_open: Option<QuicOpen>,
}

/// Reads how many QUIC connections are open (the data plane's count).
pub type QuicOpen = Arc<dyn Fn() -> u64 + Send + Sync>;

impl AdminState {
    /// State for the API: the configuration handle, the token every request
    /// must present, and the data plane's metrics.
    pub fn new(control: Control, token: &str, data_plane: Arc<dyn Collector>) -> AdminState {
        AdminState::build(Parts {
            control,
            token: Arc::from(token),
            data_plane: SharedCollector(data_plane),
            events: Arc::default(),
            scaling: StatusBoard::default(),
            dns: tidegate_dns::DnsBoard::default(),
            listeners: tidegate_snapshot::ListenerBoard::default(),
            watchers: Watchers::default(),
            private_dirs: Arc::from([]),
            config_file: None,
            predecessor: None,
            quic_open: None,
        })
    }

    /// Shows the QUIC connections open (`/v1/status`), when HTTP/3 is on.
    pub fn with_quic(self, open: QuicOpen) -> AdminState {
        AdminState::build(Parts { quic_open: Some(open), ..self.parts() })
    }

    /// Shows the autoscaler's events and per-service scaling state.
    pub fn with_autoscaler(self, events: Arc<Events>, scaling: StatusBoard) -> AdminState {
        AdminState::build(Parts { events, scaling, ..self.parts() })
    }

    /// Shows the DNS pools' state (`/v1/status`, per service).
    pub fn with_dns(self, dns: tidegate_dns::DnsBoard) -> AdminState {
        AdminState::build(Parts { dns, ..self.parts() })
    }

    /// Shows the named listeners' state (`/v1/status`, `GET
    /// /v1/listeners/{name}`), as the data plane writes it.
    pub fn with_listeners(self, listeners: tidegate_snapshot::ListenerBoard) -> AdminState {
        AdminState::build(Parts { listeners, ..self.parts() })
    }

    /// Bounds `/v1/watch` streams by `limits` (default:
    /// [`WatchLimits::default`]).
    pub fn with_watch_limits(self, limits: WatchLimits) -> AdminState {
        AdminState::build(Parts { watchers: Watchers::new(limits), ..self.parts() })
    }

    /// Refuses static routes whose root is `dir` (the data directory), lies
    /// inside it or contains it.
    pub fn with_private_dir(self, dir: &std::path::Path) -> AdminState {
        let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
        AdminState::build(Parts { private_dirs: Arc::from([dir]), ..self.parts() })
    }

    /// Shows what became of the configuration file (`serve --config`).
    pub fn with_config_file(self, report: Arc<ConfigFileReport>) -> AdminState {
        AdminState::build(Parts { config_file: Some(report), ..self.parts() })
    }

    /// Shows the drain of the instance this process took over.
    pub fn with_predecessor(self, report: Arc<PredecessorReport>) -> AdminState {
        AdminState::build(Parts { predecessor: Some(report), ..self.parts() })
    }

    fn parts(&self) -> Parts {
        let s = &*self.0;
        Parts {
            control: s.control.clone(),
            token: s.token.clone(),
            data_plane: s.data_plane.clone(),
            events: s.events.clone(),
            scaling: s.scaling.clone(),
            dns: s.dns.clone(),
            listeners: s.listeners.clone(),
            watchers: s.watchers.clone(),
            private_dirs: s.private_dirs.clone(),
            config_file: s.config_file.clone(),
            predecessor: s.predecessor.clone(),
            quic_open: s.quic_open.clone(),
        }
    }

    fn build(p: Parts) -> AdminState {
        let mut registry = metrics::registry(&p.control, &p.events, &p.data_plane, &p.watchers, p.config_file.clone());
        if let Some(report) = &p.predecessor {
            registry.register_collector(Box::new(metrics::PredecessorCollector(report.clone())));
        }
        registry.register_collector(Box::new(metrics::DnsCollector(p.dns.clone())));
        let registry = Arc::new(registry);
        AdminState(Arc::new(AdminStateInner {
            control: p.control,
            token: p.token,
            data_plane: p.data_plane,
            events: p.events,
            scaling: p.scaling,
            dns: p.dns,
            listeners: p.listeners,
            watchers: p.watchers,
            private_dirs: p.private_dirs,
            config_file: p.config_file,
            predecessor: p.predecessor,
            quic_open: p.quic_open,
            registry,
        }))
    }
}

/// The admin API's routes.
pub fn router(state: AdminState) -> Router {
    let authed = Router::new()
        .route("/v1/services", get(handlers::list_services))
        .route(
            "/v1/services/{name}",
            put(handlers::put_service).get(handlers::get_service).delete(handlers::delete_service),
        )
        .route(
            "/v1/services/{name}/backends/{id}",
            put(handlers::put_backend)
                .patch(handlers::patch_backend)
                .get(handlers::get_backend)
                .delete(handlers::delete_backend),
        )
        .route("/v1/routes", get(handlers::list_routes))
        .route("/v1/routes/{name}", put(handlers::put_route).get(handlers::get_route).delete(handlers::delete_route))
        .route("/v1/rules", get(handlers::list_rules))
        .route("/v1/rules/{name}", put(handlers::put_rules).get(handlers::get_rules).delete(handlers::delete_rules))
        .route("/v1/listeners", get(handlers::list_listeners))
        .route(
            "/v1/listeners/{name}",
            put(handlers::put_listener).get(handlers::get_listener).delete(handlers::delete_listener),
        )
        .route("/v1/certificates", get(handlers::list_certificates))
        .route(
            "/v1/certificates/{name}",
            put(handlers::put_certificate).get(handlers::get_certificate).delete(handlers::delete_certificate),
        )
        .route("/v1/certificates/{name}/renew", post(handlers::renew_certificate))
        .route("/v1/services/{name}/autoscale", post(autoscale::post_override))
        .route("/v1/events", get(autoscale::get_events))
        .route("/v1/changes", post(handlers::post_changes))
        .route("/v1/config", get(handlers::get_config).put(handlers::put_config))
        .route("/v1/status", get(status::get_status))
        .route("/v1/watch", get(watch::get_watch))
        .route("/metrics", get(metrics::get_metrics))
        .fallback(|| async { ApiError::not_found("no such endpoint") })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() })
        .layer(middleware::from_fn(known_query))
        .layer(middleware::from_fn_with_state(state.clone(), authenticate))
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(state.clone());
    // Probes for load balancers and orchestrators: no token, no data.
    let probes = Router::new()
        .route("/healthz", get(handlers::healthz))
        .route("/readyz", get(handlers::readyz))
        .route("/v1/openapi.json", get(get_openapi))
        .layer(middleware::from_fn(known_query))
        .with_state(state);
    authed.merge(probes).merge(ui::router())
}

/// `GET /v1/openapi.json`: the API's contract (no token: it holds no data).
async fn get_openapi() -> impl IntoResponse {
    static DOC: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    let doc = DOC.get_or_init(|| serde_json::to_vec_pretty(&openapi::document()).unwrap_or_default());
    ([(axum::http::header::CONTENT_TYPE, "application/json")], doc.as_slice())
}

/// `/metrics` alone, with no token: for `--metrics-listen`, where scrapers
/// read metrics without holding the admin token (which can change the
/// configuration). Nothing else is served there.
pub fn metrics_router(state: AdminState) -> Router {
    Router::new()
        .route("/metrics", get(metrics::get_metrics))
        .fallback(|| async { ApiError::not_found("only /metrics is served here") })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() })
        .layer(middleware::from_fn(known_query))
        .with_state(state)
}

/// Rejects requests without `Authorization: Bearer <token>`.
async fn authenticate(State(state): State<AdminState>, req: Request, next: Next) -> Response {
    let presented = req
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        // The scheme's name is case-insensitive (RFC 9110, section 11.1).
        .and_then(|v| v.split_once(' ').filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer")))
        .map_or("", |(_, token)| token.trim_start());
    if !constant_time_eq(presented.as_bytes(), state.token.as_bytes()) {
        return ApiError::unauthorized().into_response();
    }
    // Refuse a body declared too large before reading any of it.
    let declared = req.headers().get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > BODY_LIMIT as u64) {
        return ApiError::too_large().into_response();
    }
    next.run(req).await
}

/// The query parameters an endpoint takes; any other is refused.
fn allowed_query(path: &str) -> &'static [&'static str] {
    match path {
        "/v1/changes" | "/v1/config" => &["dry_run"],
        "/v1/watch" => &["from"],
        "/v1/events" => &["after"],
        _ => &[],
    }
}

/// Refuses a query parameter the endpoint does not take (400 naming it),
/// so a misspelt `dry_rn=true` cannot pass for a real write.
async fn known_query(req: Request, next: Next) -> Response {
    if let Some(query) = req.uri().query() {
        let allowed = allowed_query(req.uri().path());
        let names = query.split('&').filter(|p| !p.is_empty()).map(|p| p.split_once('=').map_or(p, |(k, _)| k));
        if let Some(unknown) = names.into_iter().find(|k| !allowed.contains(k)) {
            let takes = match allowed {
                [] => "this endpoint takes no query parameters".to_string(),
                names => format!("this endpoint takes only {}", names.join(", ")),
            };
            return ApiError::bad_field(&format!("query.{unknown}"), format!("unknown query parameter; {takes}"))
                .into_response();
        }
    }
    next.run(req).await
}

/// Compares without an early exit, so timing does not reveal the prefix.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
