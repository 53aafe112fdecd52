//! The external distributor's protocol (paper S4): what a proxy needs to
//! ask a distributor which backend serves a request, and nothing of the
//! reference server (`tidegate-distributor`), which builds on this crate.
//!
//! - [`protocol`]: the wire format, one UTF-8 JSON object per UDP datagram
//!   (at most [`MAX_DATAGRAM`] bytes), documented in `docs/distributor.md`;
//!   both sides encode and decode with it.
//! - [`DistributorClient`]: what a proxy worker calls per request. One UDP
//!   socket per address family and scope, shared by all concurrent queries;
//!   a background task dispatches answers to their queries by id. A query
//!   is retried with a fresh id on timeout, up to a number of tries, and
//!   yields `None` when no answer came, so the caller can fall back.

mod client;
pub mod protocol;

pub use client::{ClientStats, DistributorClient};
pub use protocol::{Answer, ProtocolError, Query, WireQuery, MAX_DATAGRAM, VERSION};
