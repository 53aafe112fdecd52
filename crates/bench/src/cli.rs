//! Command-line options.

use std::net::SocketAddr;

use clap::{Args, Parser, Subcommand};

/// Options of the `tidegate-bench` binary.
#[derive(Debug, Parser)]
#[command(
    name = "tidegate-bench",
    version,
    about = "Benchmark driver for an already running Tidegate; prints one JSON object"
)]
pub struct Cli {
    /// Where Tidegate runs and how to talk to it.
    #[command(flatten)]
    pub target: Target,

    /// The scenario to run.
    #[command(subcommand)]
    pub command: Command,
}

/// The Tidegate instance under test (loopback addresses only).
#[derive(Debug, Clone, Args)]
pub struct Target {
    /// Admin API address.
    #[arg(long, global = true, default_value = "127.0.0.1:9900")]
    pub admin: SocketAddr,

    /// Proxy (data plane) address.
    #[arg(long, global = true, default_value = "127.0.0.1:8080")]
    pub proxy: SocketAddr,

    /// Admin bearer token.
    #[arg(long, global = true, env = "TIDEGATE_ADMIN_TOKEN", hide_env_values = true)]
    pub token: Option<String>,

    /// Per-request timeout in milliseconds (admin and proxy requests).
    #[arg(long, global = true, default_value_t = 5000)]
    pub timeout_ms: u64,

    /// Runtime worker threads of the driver itself (0 = one per core).
    #[arg(long, global = true, default_value_t = 1)]
    pub threads: usize,
}

/// The scenarios.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create the service, its catch-all route, and optionally a preload.
    Setup(SetupArgs),
    /// Open-loop route churn: time until each new route answers on the proxy.
    Churn(ChurnArgs),
    /// Closed-loop admin saturation with concurrent keep-alive clients.
    Saturate(SaturateArgs),
    /// Open-loop GET load against the proxy.
    Traffic(TrafficArgs),
    /// A closed loop of concurrent users against any proxy (paper S3).
    Users(UsersArgs),
    /// Open-loop GETs whose rate follows steps (paper S1's peak); any proxy.
    Ramp(RampArgs),
    /// One GET at a time over one keep-alive connection (paper S4's overhead); any target.
    Sequential(SequentialArgs),
    /// The disk's floor for a durable change: open-loop 4 KiB writes and
    /// `fdatasync`s through one group-committing thread, no Tidegate.
    DiskFloor(DiskFloorArgs),
    /// Serve as the minimal hyper proxy (the library ceiling of the
    /// throughput benchmark) until killed.
    MinimalProxy(MinimalProxyArgs),
    /// HTTP/3 load against `--proxy` (its UDP port) on quinn and h3: busy
    /// streams over a few connections, or handshakes per second.
    H3(H3Args),
}

/// Options of `h3`.
#[derive(Debug, Clone, Args)]
pub struct H3Args {
    /// QUIC connections (with `--handshakes`: loops opening one after
    /// another).
    #[arg(long, default_value_t = 8)]
    pub connections: usize,
    /// Request streams kept busy on each connection.
    #[arg(long, default_value_t = 8)]
    pub streams: usize,
    /// How long to run, seconds.
    #[arg(long, default_value_t = 8.0)]
    pub duration_s: f64,
    /// Path to GET.
    #[arg(long, default_value = "/")]
    pub path: String,
    /// The server name (SNI and `:authority`).
    #[arg(long)]
    pub server_name: String,
    /// The certificate authority (PEM) that signs the server's certificate.
    #[arg(long)]
    pub ca: std::path::PathBuf,
    /// Measure handshakes: each loop opens a connection, sends one GET,
    /// and closes it, over and over.
    #[arg(long)]
    pub handshakes: bool,
}

/// Options of the minimal hyper proxy.
#[derive(Debug, Args)]
pub struct MinimalProxyArgs {
    /// Where it listens.
    #[arg(long)]
    pub listen: SocketAddr,
    /// The one upstream it forwards to.
    #[arg(long)]
    pub upstream: SocketAddr,
    /// Worker threads, each with its own listener.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// How it is written: `hyper` (the library ceiling), or a raw
    /// HTTP/1.1 relay on `epoll` (tokio) or `uring` (monoio on io_uring),
    /// issue 42's io_uring experiment.
    #[arg(long, value_enum, default_value_t = MinimalEngine::Hyper)]
    pub engine: MinimalEngine,
}

/// The engines of `minimal-proxy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum MinimalEngine {
    /// hyper's HTTP/1 server and client.
    Hyper,
    /// A raw relay on tokio (epoll).
    Epoll,
    /// The same relay on monoio (io_uring).
    Uring,
}

/// Options of `ramp`.
#[derive(Debug, Args)]
pub struct RampArgs {
    /// The timetable: `RATE:SECONDS[,RATE:SECONDS...]` (requests per second
    /// during each step, back to back; a rate of 0 is a pause).
    #[arg(long)]
    pub steps: String,
    /// Path to GET.
    #[arg(long, default_value = "/")]
    pub path: String,
    /// Poisson arrivals (exponential gaps) instead of evenly spaced ones.
    #[arg(long)]
    pub poisson: bool,
    /// Seed of the Poisson arrivals.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Timeline bin width, seconds.
    #[arg(long, default_value_t = 1.0)]
    pub bin_s: f64,
    /// Write one CSV line per request here
    /// (`due_unix_ms,done_unix_ms,latency_us,outcome,backend`).
    #[arg(long)]
    pub log: Option<std::path::PathBuf>,
    /// Requests in flight at most; beyond it a request is skipped and counted.
    #[arg(long, default_value_t = 10_000)]
    pub max_in_flight: usize,

    /// Client addresses to send from, in turn (each with its own
    /// keep-alive connections): `--source-from` and the addresses after
    /// it. A proxy's per-client caps and fair queueing then see that many
    /// users, not one. 1 with the default `--source-from`: the system
    /// chooses (as for any client).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub sources: u32,

    /// The first client address (loopback, 127.0.0.0/8; the target must
    /// be IPv4 loopback too when it is set or `--sources` is above 1).
    #[arg(long, default_value = "127.0.0.1")]
    pub source_from: std::net::Ipv4Addr,
}

/// Options of `sequential`.
#[derive(Debug, Args)]
pub struct SequentialArgs {
    /// Measured requests.
    #[arg(long, default_value_t = 2000)]
    pub requests: u64,
    /// Requests sent first and not measured.
    #[arg(long, default_value_t = 100)]
    pub warmup: u64,
    /// Path to GET.
    #[arg(long, default_value = "/")]
    pub path: String,
    /// Count a 2xx whose `x-backend` differs from this as an error.
    #[arg(long)]
    pub expect_backend: Option<String>,
    /// Requests per second to each target: request i leaves at i / (rate x
    /// targets) seconds, or when the previous answer is in if that is later.
    /// 0 sends each request as soon as the previous answer is in.
    #[arg(long, default_value_t = 0.0)]
    pub rate: f64,
    /// Measure several paths in the same moments, `NAME=HOST:PORT[/PATH]`
    /// (repeated; `--path` when no path is given): the requests go to the
    /// targets in turn, in a new random order every round, one keep-alive
    /// connection each, so every target is measured under the same
    /// conditions. `--proxy` is not used then.
    #[arg(long = "target")]
    pub targets: Vec<String>,
}

/// Options of `users`.
#[derive(Debug, Args)]
pub struct UsersArgs {
    /// Concurrent users.
    #[arg(long, default_value_t = 500)]
    pub users: usize,
    /// How long to run, seconds.
    #[arg(long, default_value_t = 10.0)]
    pub duration_s: f64,
    /// Path to request.
    #[arg(long, default_value = "/")]
    pub path: String,
    /// Mean pause between a user's answer and its next request, ms
    /// (exponentially distributed; users start spread over one mean).
    #[arg(long, default_value_t = 0)]
    pub think_ms: u64,
}

/// Options of `setup`.
#[derive(Debug, Args)]
pub struct SetupArgs {
    /// Service to create (replaced if it exists).
    #[arg(long, default_value = "web")]
    pub service: String,

    /// Its single backend (`id` "a"), a loopback `IP:PORT`.
    #[arg(long)]
    pub backend: SocketAddr,

    /// Do not create the catch-all route `/` to the service.
    #[arg(long)]
    pub no_catch_all: bool,

    /// Extra services `pre-{i}` to preload.
    #[arg(long, default_value_t = 0)]
    pub preload_services: u64,

    /// Backends per preloaded service (127.0.0.2:{10000+j}, never contacted).
    #[arg(long, default_value_t = 1)]
    pub backends_per_service: u64,

    /// Routes `/pre/{i}` (path prefix) to `pre-{i}`; at most --preload-services.
    #[arg(long, default_value_t = 0)]
    pub preload_routes: u64,

    /// Operations per `POST /v1/changes` during the preload.
    #[arg(long, default_value_t = 5000)]
    pub batch_ops: u64,
}

/// Options of `disk-floor`.
#[derive(Debug, Args)]
pub struct DiskFloorArgs {
    /// Durable writes per second (open loop).
    #[arg(long)]
    pub rate: f64,

    /// Length of the sending window in seconds.
    #[arg(long)]
    pub duration_s: f64,

    /// Directory of the file written (on the filesystem of Tidegate's data
    /// directory, to compare with it); the file is removed afterwards.
    #[arg(long)]
    pub dir: std::path::PathBuf,
}

/// Options of `churn`.
#[derive(Debug, Args)]
pub struct ChurnArgs {
    /// Changes per second (open loop).
    #[arg(long)]
    pub rate: f64,

    /// Length of the sending window in seconds.
    #[arg(long)]
    pub duration_s: f64,

    /// Service the new routes point at; must exist.
    #[arg(long, default_value = "web")]
    pub service: String,

    /// Run tag in route names and paths (`churn-{tag}-{i}`, `/churn/{tag}/{i}`);
    /// defaults to the start time in milliseconds so runs never collide.
    /// Pass an empty string for the bare `churn-{i}` / `/churn/{i}` names.
    #[arg(long)]
    pub tag: Option<String>,

    /// Count a proxy answer as effective only if its `x-backend` header
    /// (set by tidegate-emulator) equals this; needed when a catch-all route
    /// would otherwise answer 200 before the new route is live.
    #[arg(long)]
    pub expect_backend: Option<String>,

    /// Changes in flight at most; beyond it a change is skipped and counted.
    #[arg(long, default_value_t = 10_000)]
    pub max_in_flight: usize,

    /// Other instances' proxies (cluster mode; repeatable): a change is
    /// effective once `--proxy` and every one of these serves it, and
    /// `time_to_effective_us` runs until the last one does.
    #[arg(long)]
    pub also_proxy: Vec<std::net::SocketAddr>,
}

/// Options of `saturate`.
#[derive(Debug, Args)]
pub struct SaturateArgs {
    /// Concurrent keep-alive clients, each in a closed loop.
    #[arg(long)]
    pub clients: usize,

    /// Length of the run in seconds.
    #[arg(long)]
    pub duration_s: f64,

    /// Operations per change set: 1 = `PUT .../backends/{id}`, more = `POST /v1/changes`.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,

    /// Service whose backends are written; must exist.
    #[arg(long, default_value = "web")]
    pub service: String,

    /// Address written into every `sat-*` backend (loopback).
    #[arg(long, default_value = "127.0.0.2:10000")]
    pub addr: SocketAddr,

    /// Weight of every `sat-*` backend. With the default 1, traffic routed
    /// to the service is balanced onto `--addr` too (502s if nothing listens
    /// there); 0 keeps them configured but drained.
    #[arg(long, default_value_t = 1)]
    pub weight: u32,

    /// Change sets per client at most.
    #[arg(long, default_value_t = 10_000_000)]
    pub max_per_client: u64,
}

/// Options of `traffic`.
#[derive(Debug, Args)]
pub struct TrafficArgs {
    /// Requests per second (open loop).
    #[arg(long)]
    pub rate: f64,

    /// Length of the sending window in seconds.
    #[arg(long)]
    pub duration_s: f64,

    /// Path to GET on the proxy.
    #[arg(long, default_value = "/")]
    pub path: String,

    /// Count a 200 whose `x-backend` differs from this as an error.
    #[arg(long)]
    pub expect_backend: Option<String>,

    /// Requests in flight at most; beyond it a request is skipped and counted.
    #[arg(long, default_value_t = 10_000)]
    pub max_in_flight: usize,

    /// Client addresses to send from, in turn (each with its own
    /// keep-alive connections): `--source-from` and the addresses after
    /// it. A proxy's per-client caps and fair queueing then see that many
    /// users, not one. 1 with the default `--source-from`: the system
    /// chooses (as for any client).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub sources: u32,

    /// The first client address (loopback, 127.0.0.0/8; the target must
    /// be IPv4 loopback too when it is set or `--sources` is above 1).
    #[arg(long, default_value = "127.0.0.1")]
    pub source_from: std::net::Ipv4Addr,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn global_target_flags_go_after_the_subcommand() {
        let cli = Cli::try_parse_from([
            "tidegate-bench",
            "churn",
            "--rate",
            "100",
            "--duration-s",
            "2",
            "--admin",
            "127.0.0.1:1",
            "--proxy",
            "127.0.0.1:2",
            "--token",
            "t",
        ])
        .unwrap();
        assert_eq!(cli.target.admin.port(), 1);
        assert_eq!(cli.target.proxy.port(), 2);
        assert_eq!(cli.target.token.as_deref(), Some("t"));
        assert!(matches!(cli.command, Command::Churn(ref c) if c.service == "web"));
    }
}
