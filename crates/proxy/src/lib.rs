//! Tidegate's data plane: the listeners, the two HTTP/1.1 engines (the
//! native one on [`tidegate_h1`], the default, and hyper's) and HTTP/2,
//! request hygiene, limits and observation.
//!
//! Each request reads the current [`Snapshot`](tidegate_snapshot::Snapshot)
//! with one atomic load; one request pipeline (`pipeline::decide`, the
//! same for every engine, with no IO) decides whether the proxy answers
//! itself, serves a static directory ([`tidegate_static`]) or forwards to
//! a service; forwarding runs the attempt loop of [`tidegate_attempts`]
//! (retries decided by a pure function of a typed error, [`retry::decide`],
//! [`ErrorKind`]) over the worker's own connections, kept in
//! [`tidegate_upstream`]'s pools. Proxy semantics live here: forwarding
//! headers, hop-by-hop stripping, timeouts, WebSocket (HTTP/1.1 upgrade)
//! pass-through, and short plain-text 4xx / 5xx answers that say what went
//! wrong. docs/architecture.md draws the modules' layers.
//!
//! The proxy never changes configuration; it only reads snapshots.

pub mod access_log;
// The attempt machinery (error kinds, retries, picking, the attempt loop)
// is the `tidegate-attempts` crate; its modules keep their paths here.
use tidegate_attempts as attempts;
use tidegate_attempts::pick;
pub use tidegate_attempts::{error, retry};
mod admission;
mod body;
mod compress;
mod conn;
mod forward;
mod forward_auth;
mod h3;
mod handler;
mod headers;
mod host_addrs;
mod hygiene;
mod hyper_conn;
mod hyper_server;
mod limits;
mod metrics;
mod named;
mod native;
mod observe;
mod pipeline;
mod prepared;
mod proxy_header;
mod reply;
mod rules_work;
mod server;
mod tls;
mod traces;
mod tunnel;
mod upbody;
mod upstream_error;
mod upstream_h2;
mod upstreams;

pub use access_log::AccessLog;
pub use body::ProxyBody;
pub use conn::Peer;
pub use error::{ErrorKind, Source};
pub use h3::{Http3, QuicCounters};
pub use handler::Proxy;
pub use limits::{Limits, TrustedProxies};
pub use metrics::{DataPlaneCollector, ProxyMetrics};
pub use named::NamedSockets;
pub use server::{
    serve, serve_on, Http1Engine, Listeners, ListeningSocket, OpenConnections, RuntimeMode, ServerHandle, ServerOptions,
};
/// Request-path normalization (in the model, where route paths are checked
/// against the same rules).
pub use tidegate_model::normalize;
pub use tidegate_static::never_serve;
pub use tls::{OnDemandTls, VerifiedClient};
pub use traces::Tracing;
pub use upbody::Inbound;
