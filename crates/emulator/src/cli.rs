//! Command-line options.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;

use crate::dist::{parse_duration, ServiceTime};

/// Options of the `tidegate-emulator` binary; also the in-process configuration.
#[derive(Debug, Clone, Parser)]
#[command(name = "tidegate-emulator", version, about = "Backend emulator for Tidegate tests and benchmarks")]
pub struct Args {
    /// Address to listen on; port 0 picks a free port.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,

    /// Backend name, sent in `x-backend` and in the default body.
    #[arg(long, default_value = "emu")]
    pub name: String,

    /// Concurrent service slots (0 = unlimited).
    #[arg(long, default_value_t = 0)]
    pub slots: usize,

    /// Maximum requests waiting for a slot; beyond it requests get 503.
    #[arg(long, default_value_t = 1000)]
    pub queue: usize,

    /// Service time: fixed:D, exp:MEAN or lognormal:MEAN:SIGMA (units us, ms, s).
    #[arg(long, default_value = "fixed:0ms")]
    pub service_time: ServiceTime,

    /// Sleep this long before binding (emulates a slow-starting instance).
    #[arg(long, default_value = "0", value_parser = parse_duration)]
    pub startup_delay: Duration,

    /// Health-check path; answers 200 `ok` without taking a slot.
    #[arg(long, default_value = "/health")]
    pub health_path: String,

    /// Add an ORCA `endpoint-load-metrics` header to responses.
    #[arg(long)]
    pub orca: bool,

    /// Respond with this many bytes instead of the name line.
    #[arg(long)]
    pub body_size: Option<usize>,

    /// Runtime worker threads (0 = one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,

    /// Serve as a misbehaving raw HTTP/1.1 backend instead (see the
    /// `faults` module: truncated bodies, conflicting framing, garbage).
    #[arg(long)]
    pub faults: bool,

    /// With `--faults`: close a keep-alive connection that waits longer
    /// than this for its next request (units us, ms, s).
    #[arg(long, value_parser = parse_duration)]
    pub idle_close: Option<Duration>,

    /// Serve TLS with this certificate chain (PEM; needs `--tls-key`),
    /// offering ALPN `h2` and `http/1.1`.
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<std::path::PathBuf>,

    /// The private key of `--tls-cert` (PEM).
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<std::path::PathBuf>,

    /// With `--tls-cert`: require a client certificate issued by one of
    /// these CAs (PEM) on every connection (mutual TLS): a client without
    /// one fails the handshake.
    #[arg(long, requires = "tls_cert")]
    pub tls_client_ca: Option<std::path::PathBuf>,
}

impl Default for Args {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            name: "emu".to_owned(),
            slots: 0,
            queue: 1000,
            service_time: ServiceTime::default(),
            startup_delay: Duration::ZERO,
            health_path: "/health".to_owned(),
            orca: false,
            body_size: None,
            threads: 0,
            faults: false,
            idle_close: None,
            tls_cert: None,
            tls_key: None,
            tls_client_ca: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_the_parser() {
        let parsed = Args::try_parse_from(["tidegate-emulator"]).expect("parses");
        let default = Args::default();
        assert_eq!(parsed.listen, default.listen);
        assert_eq!(parsed.name, default.name);
        assert_eq!(parsed.queue, default.queue);
        assert_eq!(parsed.service_time, default.service_time);
        assert_eq!(parsed.startup_delay, default.startup_delay);
        assert_eq!(parsed.health_path, default.health_path);
        assert_eq!(parsed.body_size, None);
    }

    #[test]
    fn all_flags_parse() {
        let args = Args::try_parse_from([
            "tidegate-emulator",
            "--listen=127.0.0.1:8081",
            "--name=b2",
            "--slots=4",
            "--queue=8",
            "--service-time=lognormal:5ms:0.5",
            "--startup-delay=1500ms",
            "--health-path=/ready",
            "--orca",
            "--body-size=1024",
        ])
        .expect("parses");
        assert_eq!(args.listen.port(), 8081);
        assert_eq!((args.slots, args.queue), (4, 8));
        assert_eq!(args.startup_delay, Duration::from_millis(1500));
        assert!(args.orca);
        assert_eq!(args.body_size, Some(1024));
        assert!(Args::try_parse_from(["x", "--service-time=bogus"]).is_err());
    }
}
