//! Tidegate's external distributor (paper S4).
//!
//! A service with policy `{"kind": "external", "addr": ..., "policy": ...}`
//! asks an external process, the *distributor*, which backend should serve
//! each request. This crate holds the three parts of that conversation:
//!
//! - [`protocol`]: the wire format, one UTF-8 JSON object per UDP datagram
//!   (at most [`MAX_DATAGRAM`] bytes), documented in `docs/distributor.md`.
//! - [`DistributorClient`]: what a proxy worker calls per request. One UDP
//!   socket per address family and scope, shared by all concurrent queries;
//!   a background task dispatches answers to their queries by id. A query
//!   is retried with a fresh id on timeout, up to a number of tries, and
//!   yields `None` when no answer came, so the caller can fall back.
//! - [`serve`] / [`Server`]: a reference distributor with named policies
//!   (`round_robin`, `least_cpu` from node_exporter scrapes, `session` by a
//!   cookie), whose options ([`ServeOptions`]) derive clap arguments so the
//!   `tidegate` binary can expose it as a subcommand.

mod client;
mod metrics;
mod policies;
pub mod protocol;
mod server;

pub use client::{ClientStats, DistributorClient};
pub use metrics::MetricsUrl;
pub use protocol::{Answer, ProtocolError, Query, WireQuery, MAX_DATAGRAM, VERSION};
pub use server::{serve, ServeOptions, Server, ServerStats, POLICIES};
