//! Tidegate's data plane.
//!
//! A hyper 1.x server (HTTP/1.1 and h2c) whose handler reads the current
//! [`Snapshot`](tidegate_snapshot::Snapshot) with one atomic load per
//! request, matches a route, and either serves a static directory or
//! forwards to a backend picked by the service's selector, through a pooled
//! keep-alive hyper-util client. Proxy semantics live here: forwarding
//! headers, hop-by-hop stripping, timeouts, retries on another backend,
//! WebSocket (HTTP/1.1 upgrade) pass-through, and short plain-text 502 / 503 /
//! 504 answers that say what went wrong.
//!
//! The proxy never changes configuration; it only reads snapshots.

mod body;
mod errors;
mod forward;
mod handler;
mod metrics;
mod server;
mod static_files;

pub use body::ProxyBody;
pub use forward::Peer;
pub use handler::Proxy;
pub use metrics::ProxyMetrics;
pub use server::{serve, RuntimeMode, ServerHandle, ServerOptions};
