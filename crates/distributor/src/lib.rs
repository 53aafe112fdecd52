//! Tidegate's reference distributor (paper S4).
//!
//! A service with policy `{"kind": "external", "addr": ..., "policy": ...}`
//! asks an external process, the *distributor*, which backend should serve
//! each request. The wire format and the client a proxy uses live in
//! `tidegate-distributor-protocol` (re-exported here), so that a proxy
//! depends on the protocol alone; this crate adds the other side:
//!
//! - [`serve`] / [`Server`]: a reference distributor with named policies
//!   (`round_robin`, `least_cpu` from node_exporter scrapes, `session` by a
//!   cookie), whose options ([`ServeOptions`]) derive clap arguments so the
//!   `tidegate` binary can expose it as a subcommand.

mod metrics;
mod policies;
mod server;

pub use metrics::MetricsUrl;
pub use server::{serve, ServeOptions, Server, ServerStats, POLICIES};
pub use tidegate_distributor_protocol::{
    protocol, Answer, ClientStats, DistributorClient, ProtocolError, Query, WireQuery, MAX_DATAGRAM, VERSION,
};
