//! `tidegate-emulator`: a dev-only backend emulator for Tidegate's end-to-end
//! tests and benchmarks.
//!
//! It runs as a real HTTP/1.1 (and h2c) backend on loopback and models
//! capacity: a number of concurrent service slots, a bounded wait queue (503
//! `queue full` beyond it) and a service-time distribution (`fixed`, `exp`,
//! `lognormal`). Every response carries `x-backend: NAME`; with `--orca` it
//! also carries an ORCA `endpoint-load-metrics` report.
//!
//! Paths:
//! - any path: a normal request (takes a slot; `?delay_ms=N` forces the service time);
//! - the health path (`/health`): `ok`, or 503 once set down;
//! - `/echo` (or any path ending in `/echo`): JSON description of the
//!   request (method, path, headers);
//! - `/upgrade` with `Upgrade: echo`: 101, then echoes bytes back;
//! - a gRPC call (`content-type: application/grpc`): see [`grpc`];
//! - `GET /_emulator/stats`, `POST /_emulator/slots?n=N`,
//!   `POST /_emulator/health?up=true|false`: the control API.
//!
//! With `--faults` it is instead a misbehaving raw HTTP/1.1 backend
//! ([`faults`]): truncated bodies, conflicting framing, garbage, and
//! keep-alive connections closed after `--idle-close`.
//!
//! With `--tls-cert` and `--tls-key` it serves TLS (ALPN `h2`, `http/1.1`),
//! and with `--tls-client-ca` it requires client certificates (mutual TLS).
//!
//! The binary prints `listening on ADDR` once bound; tests parse that line.

pub mod admission;
pub mod app;
pub mod cli;
pub mod dist;
pub mod faults;
pub mod grpc;
pub mod handler;
pub mod rate;
pub mod server;
pub mod upgrade;

#[cfg(test)]
mod tests;

pub use cli::Args;
pub use dist::{parse_duration, ServiceTime};
pub use server::{run, Emulator};
