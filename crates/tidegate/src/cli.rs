//! Command-line arguments.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// Tidegate: an elastic reverse proxy whose routes and pools change at runtime.
#[derive(Parser, Debug)]
#[command(name = "tidegate", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run the proxy and its admin API.
    Serve(Box<ServeArgs>),
    /// Replace the running instance of a data directory with a new binary,
    /// dropping nothing: starts `BINARY serve <the running instance's
    /// arguments> --takeover`, which takes its listening sockets, store and
    /// learned state over, and returns once it serves (the old one drains
    /// and exits). With systemd: `ExecReload=` (see docs/operations.md).
    Upgrade(UpgradeArgs),
    /// Talk to a running Tidegate through its admin API.
    Ctl(CtlArgs),
    /// Check a configuration file (YAML or JSON) without a server: exit
    /// status 0 when it is valid, else 1 with each error at the file's line
    /// and column.
    Validate {
        /// The file (`-` for standard input).
        file: PathBuf,
    },
    /// Print a shell completion script (`tidegate completions bash >
    /// /etc/bash_completion.d/tidegate`).
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Print the manual pages (roff; `tidegate man | man -l -`), or write
    /// one file per command with `--out DIR`.
    Man(crate::man::ManArgs),
    /// Run a demo on loopback: backends of different capacities, an
    /// autoscaled service and gentle traffic, to watch in the dashboard.
    #[cfg(feature = "demo")]
    Demo(DemoArgs),
    /// Run Tidegate's backend emulator (the demo's backends; service
    /// slots, a bounded queue, service-time distributions).
    #[cfg(feature = "demo")]
    #[command(hide = true)]
    Emulate(tidegate_emulator::Args),
    /// Print the JSON Schema of configuration files (for editors: `tidegate
    /// schema > tidegate.schema.json`; the same as docs/config.schema.json).
    Schema,
    /// Manage configuration stores.
    #[command(subcommand)]
    Store(StoreCommand),
    /// Run the reference external distributor (paper S4): answers proxies'
    /// UDP queries with a backend.
    Distributor(tidegate_distributor::ServeOptions),
}

/// `tidegate upgrade`.
#[derive(Debug, clap::Args)]
pub struct UpgradeArgs {
    /// The running instance's data directory (its `serve --data-dir`).
    #[arg(long, env = "TIDEGATE_DATA_DIR", default_value = "./tidegate-data")]
    pub data_dir: PathBuf,
    /// The new binary (default: this one, the binary running `tidegate
    /// upgrade`).
    #[arg(long)]
    pub binary: Option<PathBuf>,
    /// How long the new process may take to serve before it is stopped
    /// (the running instance then keeps serving).
    #[arg(long, default_value_t = 120, value_parser = seconds())]
    pub timeout_s: u64,
}

/// `tidegate demo`.
#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Where clients connect (port 0: a free one).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// The admin API and the dashboard (`/ui/`; port 0: a free one).
    #[arg(long, default_value = "127.0.0.1:9900")]
    pub admin: SocketAddr,
    /// Data directory (default: a new directory under the system's
    /// temporary directory).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Requests per second sent to `/shop` (its backends hold about 350).
    #[arg(long, default_value_t = 100)]
    pub rate: u32,
    /// Ports for the autoscaled instances, `FROM-TO`.
    #[arg(long, default_value = "20100-20199")]
    pub ports: String,
}

/// `tidegate store ...`.
#[derive(Subcommand, Debug)]
pub enum StoreCommand {
    /// Copy the configuration of an embedded store (a stopped Tidegate's
    /// data directory) into an empty etcd prefix, at the same revision, to
    /// move to cluster mode.
    Copy {
        /// The data directory of the embedded store.
        #[arg(long)]
        from: PathBuf,
        /// The etcd store: etcd://HOST:PORT[,HOST:PORT...]/PREFIX.
        #[arg(long)]
        to: tidegate_store::EtcdUrl,
        #[command(flatten)]
        etcd: EtcdArgs,
    },
}

/// How to reach etcd in cluster mode: TLS and authentication.
#[derive(Args, Debug, Clone, Default)]
pub struct EtcdArgs {
    /// CA certificate (PEM) that signs the etcd members' certificates;
    /// given, Tidegate speaks TLS to etcd.
    #[arg(long, env = "TIDEGATE_ETCD_CA")]
    pub etcd_ca: Option<PathBuf>,
    /// Client certificate (PEM) for etcd members that require one (with `--etcd-key`).
    #[arg(long, env = "TIDEGATE_ETCD_CERT", requires_all = ["etcd_ca", "etcd_key"])]
    pub etcd_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(long, env = "TIDEGATE_ETCD_KEY", requires = "etcd_cert")]
    pub etcd_key: Option<PathBuf>,
    /// etcd user, when etcd has authentication enabled; the password comes
    /// from TIDEGATE_ETCD_PASSWORD or `--etcd-password-file`.
    #[arg(long, env = "TIDEGATE_ETCD_USER")]
    pub etcd_user: Option<String>,
    /// A file holding the etcd user's password.
    #[arg(long, env = "TIDEGATE_ETCD_PASSWORD_FILE", requires = "etcd_user")]
    pub etcd_password_file: Option<PathBuf>,
}

/// What `serve --config` does with its file.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConfigMode {
    /// Applied once, to an empty store.
    Seed,
    /// The desired state, applied on every start and on SIGHUP.
    Sync,
}

/// Thread model of the data plane.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuntimeArg {
    /// One current-thread runtime and SO_REUSEPORT listener per worker.
    PerCore,
    /// One multi-thread runtime shared by all workers.
    MultiThread,
}

/// `tidegate ctl cert put --client-auth`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClientAuthArg {
    /// A client certificate the CAs signed is required.
    Required,
    /// A client may send none.
    Optional,
}

/// Which code serves HTTP/1.1 clients.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Http1Arg {
    /// Tidegate's own HTTP/1.1 path (httparse-based); HTTP/2 goes to hyper.
    Native,
    /// hyper's HTTP/1.1 server and client.
    Hyper,
}

/// Every flag can also be given as an environment variable, named after it:
/// `--drain-timeout-s` is `TIDEGATE_DRAIN_TIMEOUT_S` (a flag wins over its
/// variable).
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Address the proxy listens on for plain HTTP (default 127.0.0.1:8080,
    /// or none when only --listen-tls is given).
    #[arg(long, env = "TIDEGATE_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Address the proxy listens on for HTTPS (TLS 1.2 and 1.3, ALPN h2 and
    /// http/1.1); certificates come from the configuration
    /// (`/v1/certificates`, `ctl cert put`).
    #[arg(long, env = "TIDEGATE_LISTEN_TLS")]
    pub listen_tls: Option<SocketAddr>,
    /// Serves HTTP/3 (QUIC) on UDP at `--listen-tls`'s address too, with
    /// the same certificates, routes and limits; responses over TCP on that
    /// listener then carry `Alt-Svc: h3=":PORT"` (docs/http3.md).
    #[arg(long, env = "TIDEGATE_HTTP3", requires = "listen_tls")]
    pub http3: bool,
    /// From this many QUIC handshakes in progress on a worker, a new
    /// client whose address is not validated gets a Retry first (address
    /// validation against handshake floods from forged addresses; 0:
    /// always).
    #[arg(long, default_value_t = 64, env = "TIDEGATE_HTTP3_RETRY_ABOVE")]
    pub http3_retry_above: usize,
    /// The max age of the `Alt-Svc` advertisement of HTTP/3, seconds (0:
    /// not advertised).
    #[arg(long, default_value_t = 86_400, env = "TIDEGATE_ALT_SVC_MAX_AGE_S")]
    pub alt_svc_max_age_s: u64,
    /// An extra address serving only `GET /metrics`, with no token, for
    /// Prometheus and other scrapers (default: none; metrics stay on the
    /// admin API, behind the token).
    #[arg(long, env = "TIDEGATE_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// Address of the admin API (keep it on loopback or a private network).
    #[arg(long, env = "TIDEGATE_ADMIN", default_value = "127.0.0.1:9900")]
    pub admin: SocketAddr,
    /// Bytes of encoded events one `/v1/watch` stream may have waiting for
    /// its connection (history pages are read to fit it too), 64 KiB to
    /// 1 GiB; a stream whose connection takes nothing meanwhile is cut
    /// after --watch-stall-timeout-s.
    #[arg(long, env = "TIDEGATE_WATCH_QUEUE_BYTES", default_value_t = 8 * 1024 * 1024,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(65_536..=1 << 30))]
    pub watch_queue_bytes: usize,
    /// Most `/v1/watch` streams replaying history (`?from=` below the
    /// current revision) at once; more get 503 with `Retry-After`.
    #[arg(long, env = "TIDEGATE_WATCH_MAX_REPLAYS", default_value_t = 8,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=10_000))]
    pub watch_max_replays: usize,
    /// Seconds a `/v1/watch` stream with a full queue may go without its
    /// connection taking anything before it is cut (its last event:
    /// `lagged`, with the revision to resume from).
    #[arg(long, env = "TIDEGATE_WATCH_STALL_TIMEOUT_S", default_value_t = 30, value_parser = seconds())]
    pub watch_stall_timeout_s: u64,
    /// Directory for the store and the generated admin token.
    #[arg(long, env = "TIDEGATE_DATA_DIR", default_value = "./tidegate-data")]
    pub data_dir: PathBuf,
    /// Configuration file (YAML or JSON): a declarative document or a change
    /// set; what is done with it is `--config-mode`.
    #[arg(long, env = "TIDEGATE_CONFIG")]
    pub config: Option<PathBuf>,
    /// `seed`: the file is applied only when the store is empty (the first
    /// start). `sync`: the file (a declarative document) is the desired
    /// state, applied as one change set on every start and on SIGHUP,
    /// deleting what it leaves out; the changes are logged.
    #[arg(long, env = "TIDEGATE_CONFIG_MODE", value_enum, default_value = "seed", requires = "config")]
    pub config_mode: ConfigMode,
    /// Configuration store: the embedded default (in --data-dir), or
    /// cluster mode, etcd://HOST:PORT[,HOST:PORT...]/PREFIX[?history=N]:
    /// every instance given the same prefix serves the same configuration
    /// (docs/cluster.md).
    #[arg(long, env = "TIDEGATE_STORE")]
    pub store: Option<tidegate_store::EtcdUrl>,
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// This instance's name in cluster mode, as the others list it in
    /// `/v1/status` (default: HOSTNAME:ADMIN-PORT).
    #[arg(long, env = "TIDEGATE_INSTANCE_NAME")]
    pub instance_name: Option<String>,
    /// Data-plane worker threads (default: one per core).
    #[arg(long, env = "TIDEGATE_WORKERS")]
    pub workers: Option<usize>,
    /// Data-plane thread model.
    #[arg(long, env = "TIDEGATE_RUNTIME", value_enum, default_value = "per-core")]
    pub runtime: RuntimeArg,
    /// HTTP/1.1 engine: Tidegate's own (the default) or hyper's.
    #[arg(long, env = "TIDEGATE_HTTP1", value_enum, default_value = "native")]
    pub http1: Http1Arg,
    /// Seconds a client may take to send each request head after its
    /// first, which is also how long a keep-alive connection (or an HTTP/2
    /// connection with no request in progress) may stay idle.
    #[arg(long, env = "TIDEGATE_HEADER_TIMEOUT_S", default_value_t = 30, value_parser = seconds())]
    pub header_timeout_s: u64,
    /// Seconds a new connection has to send its first complete request head.
    #[arg(long, env = "TIDEGATE_FIRST_REQUEST_TIMEOUT_S", default_value_t = 10, value_parser = seconds())]
    pub first_request_timeout_s: u64,
    /// Seconds allowed between two pieces of a request body.
    #[arg(long, env = "TIDEGATE_BODY_TIMEOUT_S", default_value_t = 30, value_parser = seconds())]
    pub body_timeout_s: u64,
    /// Seconds allowed for a whole request body.
    #[arg(long, env = "TIDEGATE_BODY_TOTAL_TIMEOUT_S", default_value_t = 600, value_parser = seconds())]
    pub body_total_timeout_s: u64,
    /// Seconds a write to a client may stay blocked (a client not reading).
    #[arg(long, env = "TIDEGATE_WRITE_TIMEOUT_S", default_value_t = 60, value_parser = seconds())]
    pub write_timeout_s: u64,
    /// Seconds an upgraded (WebSocket) tunnel may carry no byte before it is closed.
    #[arg(long, env = "TIDEGATE_TUNNEL_IDLE_TIMEOUT_S", default_value_t = 300, value_parser = seconds())]
    pub tunnel_idle_timeout_s: u64,
    /// Most client connections open at once; beyond it accepting pauses.
    #[arg(long, env = "TIDEGATE_MAX_CONNECTIONS", default_value_t = 10_000)]
    pub max_connections: usize,
    /// Largest request head in bytes (request line and headers), 8 KiB to
    /// 1 MiB; larger gets 431.
    #[arg(long, env = "TIDEGATE_MAX_HEADER_BYTES", default_value_t = 65_536,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(8_192..=1_048_576))]
    pub max_header_bytes: usize,
    /// Most request headers; more gets 431.
    #[arg(long, env = "TIDEGATE_MAX_HEADERS", default_value_t = 100)]
    pub max_headers: usize,
    /// Most concurrent streams per HTTP/2 client connection.
    #[arg(long, env = "TIDEGATE_H2_MAX_STREAMS", default_value_t = 100)]
    pub h2_max_streams: u32,
    /// Bytes of a request body read before a backend is chosen: a body up
    /// to this size is read whole (a slow client then holds no backend, and
    /// the body can be retried), a larger one has this much read first and
    /// then streams. 0 reads nothing ahead. gRPC bodies always stream.
    #[arg(long, env = "TIDEGATE_REQUEST_BUFFER_BYTES", default_value_t = 1_048_576)]
    pub request_buffer_bytes: usize,
    /// Memory all workers together may hold in request bodies read ahead;
    /// when it is spent, bodies stream at once (under the minimum pace).
    #[arg(long, env = "TIDEGATE_REQUEST_BUFFER_TOTAL_BYTES", default_value_t = 268_435_456)]
    pub request_buffer_total_bytes: usize,
    /// Bytes per second a request body streamed to a backend must carry on
    /// average over each `--min-upload-rate-window-s`, or it is cut with
    /// 408 and its backend freed. 0 turns the check off.
    #[arg(long, env = "TIDEGATE_MIN_UPLOAD_RATE", default_value_t = 1024)]
    pub min_upload_rate: u64,
    /// The window, in seconds, over which `--min-upload-rate` is averaged.
    #[arg(long, env = "TIDEGATE_MIN_UPLOAD_RATE_WINDOW_S", default_value_t = 10, value_parser = seconds())]
    pub min_upload_rate_window_s: u64,
    /// Most connections open at once from one client address (IPv6: one
    /// /64); more are closed at once. 0: no cap.
    #[arg(long, env = "TIDEGATE_MAX_CONNECTIONS_PER_CLIENT", default_value_t = 0)]
    pub max_connections_per_client: usize,
    /// Most requests at once from one client address (IPv6: one /64), over
    /// all its connections, waiting for a backend or being answered, until
    /// each answer's head (not while a body is read ahead); more get 429
    /// with `Retry-After`. 0: no cap.
    #[arg(long, env = "TIDEGATE_MAX_REQUESTS_PER_CLIENT", default_value_t = 0)]
    pub max_requests_per_client: usize,
    /// Requests per second one client address (IPv6: one /64) may send to
    /// services, on average over all its connections (a token bucket per
    /// address, at most 65,536 addresses tracked); more get 429 with
    /// `Retry-After: 1` before a backend is chosen. Bounds a flood that the
    /// backend answers at once, which a cap on requests in progress does
    /// not. 0: no limit.
    #[arg(long, env = "TIDEGATE_MAX_REQUEST_RATE_PER_CLIENT", default_value_t = 0)]
    pub max_request_rate_per_client: u32,
    /// Requests one client address may send at once above its
    /// --max-request-rate-per-client (its bucket's size). 0: one second's
    /// worth of its rate.
    #[arg(long, env = "TIDEGATE_REQUEST_BURST_PER_CLIENT", default_value_t = 0)]
    pub request_burst_per_client: u32,
    /// Milliseconds a request refused for --max-request-rate-per-client
    /// waits before its 429 is written (at most 1,000, its `Retry-After`):
    /// a client that sends its next request as soon as it has an answer
    /// then waits on its connections instead of spending the proxy's CPU
    /// on refusals (HAProxy's tarpit). 0: answered at once.
    #[arg(long, env = "TIDEGATE_REQUEST_RATE_TARPIT_MS", default_value_t = 0,
          value_parser = clap::builder::RangedU64ValueParser::<u64>::new().range(0..=1000))]
    pub request_rate_tarpit_ms: u64,
    /// Comma-separated IPs or CIDR blocks of trusted proxies in front of
    /// Tidegate, whose X-Forwarded-For, Forwarded and X-Real-IP are kept.
    /// Default: none; those headers from any other peer are replaced.
    #[arg(long, env = "TIDEGATE_TRUSTED_PROXIES", default_value = "")]
    pub trusted_proxies: tidegate_proxy::TrustedProxies,
    /// Comma-separated IPs or CIDR blocks of TCP load balancers in front of
    /// Tidegate that send the PROXY protocol (version 1 or 2; HAProxy's
    /// `send-proxy`, an AWS NLB's proxy protocol v2): their connections, on
    /// both listeners, must start with its header, read within
    /// --first-request-timeout-s, and the client it names is the client for
    /// routing, rules, caps, logs and X-Forwarded-For. From any other
    /// address a header is refused. Default: none.
    #[arg(long, env = "TIDEGATE_PROXY_PROTOCOL_FROM", default_value = "")]
    pub proxy_protocol_from: tidegate_proxy::TrustedProxies,
    /// The DNS server services' `dns` pools are resolved with, `IP:PORT`
    /// (UDP, and TCP for long answers). Default: the servers and search
    /// domains of /etc/resolv.conf.
    #[arg(long, env = "TIDEGATE_RESOLVER")]
    pub resolver: Option<std::net::SocketAddr>,
    /// Seconds open connections may take to finish at shutdown.
    #[arg(long, env = "TIDEGATE_DRAIN_TIMEOUT_S", default_value_t = 10, value_parser = seconds())]
    pub drain_timeout_s: u64,
    /// Take over from the instance serving the same --data-dir (an
    /// upgrade with no connection dropped): receive its listening sockets
    /// (proxy, TLS, admin, metrics; every per-core one) over
    /// `DATA_DIR/takeover.sock`, open the embedded store once its writer has
    /// committed and closed it, serve, and let it drain and exit. Give the
    /// same flags as the running instance. Fails (non-zero, naming the step)
    /// when there is no such instance or it refuses; the running one then
    /// keeps serving. See docs/operations.md, "Upgrading without dropping
    /// connections".
    #[arg(long)]
    pub takeover: bool,
    /// A path the proxy answers itself on its listeners, before routing,
    /// for load balancers' health checks: `GET`/`HEAD` get 200 `ok`, and
    /// 503 `draining` on keep-alive connections once shutdown has begun.
    /// Default: none (every path is routed).
    #[arg(long, env = "TIDEGATE_HEALTH_PATH")]
    pub health_path: Option<String>,
    /// Application log format on standard error: readable `text`, or `json`
    /// (one object per line).
    #[arg(long, env = "TIDEGATE_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// Write one line per request to this file (appended to, created mode
    /// 0640), or to standard output with `-` (default: no access log).
    /// `SIGUSR1` reopens the file, for log rotation.
    #[arg(long, env = "TIDEGATE_ACCESS_LOG", value_name = "PATH|-")]
    pub access_log: Option<PathBuf>,
    /// The access log's lines: `json` (one object per line, every field
    /// named) or `combined` (Apache's and nginx's format).
    #[arg(long, env = "TIDEGATE_ACCESS_LOG_FORMAT", value_enum, default_value = "json")]
    pub access_log_format: AccessLogFormat,
    /// Export traces of requests (OpenTelemetry spans: the request, each
    /// attempt to a backend and its wait in the queue) to this OTLP/HTTP
    /// receiver, in protobuf: `http://HOST:4318/v1/traces` (a URL with no
    /// path gets `/v1/traces`). Backends then get a W3C `traceparent` naming
    /// the proxy's span. Plain `http://` (a collector agent beside the
    /// proxy). Default: no tracing; `traceparent` passes through untouched.
    #[arg(long, env = "TIDEGATE_OTLP_ENDPOINT", value_name = "URL")]
    pub otlp_endpoint: Option<String>,
    /// With --otlp-endpoint: the share (0 to 1) of new traces recorded, for
    /// requests that arrive without a `traceparent` (decided on the trace
    /// id, as OpenTelemetry's TraceIdRatioBased sampler). A request whose
    /// `traceparent` says sampled is always recorded, one that says not
    /// sampled never.
    #[arg(long, env = "TIDEGATE_TRACE_SAMPLE_RATIO", default_value_t = 0.01, value_parser = ratio)]
    pub trace_sample_ratio: f64,
    /// With --otlp-endpoint: the `service.name` of the spans' resource.
    #[arg(long, env = "TIDEGATE_TRACE_SERVICE_NAME", default_value = "tidegate")]
    pub trace_service_name: String,
}

/// How access-log lines are written.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum AccessLogFormat {
    /// One JSON object per line.
    Json,
    /// The combined log format.
    Combined,
}

/// How application logs are written.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    /// Readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

#[derive(Args, Debug)]
pub struct CtlArgs {
    /// Admin API address.
    #[arg(long, env = "TIDEGATE_ADMIN", default_value = "127.0.0.1:9900")]
    pub admin: SocketAddr,
    /// Admin token (default: TIDEGATE_ADMIN_TOKEN, else DATA_DIR/admin-token).
    #[arg(long, env = "TIDEGATE_ADMIN_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Data directory to read the admin token from.
    #[arg(long, default_value = "./tidegate-data")]
    pub data_dir: PathBuf,
    /// How answers are printed: `table` (lists as aligned columns, other
    /// answers as YAML), `json` (the API's own) or `yaml`. Default: `table`
    /// on a terminal, `json` otherwise.
    #[arg(short = 'o', long = "output", value_enum, global = true)]
    pub output: Option<crate::output::Output>,
    #[command(subcommand)]
    pub command: CtlCommand,
}

#[derive(Subcommand, Debug)]
pub enum CtlCommand {
    /// Apply a batch atomically: a change set (`ops`) or a declarative file
    /// (`services`, `routes`), YAML or JSON.
    Apply {
        /// The file (`-` for standard input).
        #[arg(short = 'f', long = "file")]
        file: PathBuf,
        /// Apply only if the configuration is at this revision.
        #[arg(long, conflicts_with = "prune")]
        if_revision: Option<u64>,
        /// Make the configuration equal to the file (a declarative
        /// document): also delete the services, routes and certificates it
        /// leaves out, in the same atomic change set.
        #[arg(long)]
        prune: bool,
    },
    /// Show what `apply --prune` would change: objects created (+),
    /// updated (~, with the fields) and deleted (-). Applies nothing.
    Diff {
        /// The file (`-` for standard input).
        #[arg(short = 'f', long = "file")]
        file: PathBuf,
    },
    /// Print the whole configuration with its revision.
    Config,
    /// Print live status: per backend in flight, latency, failures.
    Status,
    /// Print Prometheus metrics.
    Metrics,
    /// Stream applied change sets (from a revision, else from now).
    Watch {
        /// Start after this revision.
        #[arg(long)]
        from: Option<u64>,
    },
    /// Print the autoscaler's recent events.
    Events {
        /// Only events after this sequence number.
        #[arg(long, default_value_t = 0)]
        after: u64,
    },
    /// Override a service's autoscaling: pin the instance count, or pause.
    Scale {
        /// The service.
        service: String,
        /// Keep exactly this many instances.
        #[arg(long, conflicts_with = "unpin")]
        pin: Option<u32>,
        /// Let the autoscaler decide the count again.
        #[arg(long)]
        unpin: bool,
        /// Make no scaling decisions.
        #[arg(long, conflicts_with = "resume")]
        pause: bool,
        /// Resume scaling decisions.
        #[arg(long)]
        resume: bool,
    },
    /// Services.
    #[command(subcommand)]
    Service(ServiceCommand),
    /// Backends of a service.
    #[command(subcommand)]
    Backend(BackendCommand),
    /// Routes.
    #[command(subcommand)]
    Route(RouteCommand),
    /// Traffic rule sets (docs/rules.md), run by the routes that name them.
    #[command(subcommand)]
    Rules(RulesCommand),
    /// Named listeners (docs/api.md "Listeners"), beside the default ones.
    #[command(subcommand)]
    Listener(ListenerCommand),
    /// TLS certificates of the HTTPS listener.
    #[command(subcommand)]
    Cert(CertCommand),
}

#[derive(Subcommand, Debug)]
pub enum RulesCommand {
    /// List rule sets: their steps' kinds (password hashes never shown).
    List,
    /// Show one rule set and the routes that run it.
    Get { name: String },
    /// Create or replace a rule set from a YAML/JSON file
    /// (`steps: [...]`).
    Put {
        name: String,
        /// The rule set as a YAML/JSON file.
        #[arg(short = 'f', long = "file")]
        file: PathBuf,
    },
    /// Delete a rule set (refused while a route runs it).
    Delete { name: String },
}

#[derive(Subcommand, Debug)]
pub enum ListenerCommand {
    /// List named listeners: address, TLS, PROXY protocol.
    List,
    /// Show one listener: its spec, the routes bound to it, its state.
    Get { name: String },
    /// Create or replace a listener (its socket opens when the change
    /// applies; a changed one reopens and its connections finish).
    Put {
        name: String,
        /// The spec as a YAML/JSON file; otherwise built from the flags.
        #[arg(short = 'f', long = "file", conflicts_with_all = ["addr", "tls", "proxy_protocol_from"])]
        file: Option<PathBuf>,
        /// `IP:PORT` to listen on.
        #[arg(long)]
        addr: Option<String>,
        /// Terminate TLS with the configuration's certificates.
        #[arg(long)]
        tls: bool,
        /// Networks whose connections start with a PROXY protocol header
        /// (comma-separated CIDRs); none: no PROXY protocol.
        #[arg(long, value_delimiter = ',')]
        proxy_protocol_from: Vec<String>,
    },
    /// Delete a listener (refused while a route is bound to it).
    Delete { name: String },
}

#[derive(Subcommand, Debug)]
pub enum CertCommand {
    /// List certificates: names served, issuer, validity (never the key).
    List,
    /// Show one certificate.
    Get { name: String },
    /// Create or replace a certificate from PEM files.
    Put {
        name: String,
        /// The certificate chain (PEM; the server's certificate first).
        #[arg(long)]
        cert: PathBuf,
        /// Its private key (PEM). Without it, the certificate keeps the key
        /// it has (a chain renewed for the same key).
        #[arg(long)]
        key: Option<PathBuf>,
        /// Serve it to clients that send no SNI name or an unknown one.
        #[arg(long)]
        default: bool,
        /// Ask the clients of its handshakes for a certificate signed by
        /// one of these CAs (PEM); see --client-auth.
        #[arg(long)]
        client_ca: Option<PathBuf>,
        /// With --client-ca: `required` (no handshake without a client
        /// certificate the CAs signed) or `optional` (a client may send
        /// none; routes with `client_cert.required` refuse it with 403).
        #[arg(long, value_enum, default_value = "required", requires = "client_ca")]
        client_auth: ClientAuthArg,
        /// With --client-ca: revocation lists of those CAs (PEM), one for
        /// each CA that signs client certificates.
        #[arg(long, requires = "client_ca")]
        client_crl: Option<PathBuf>,
    },
    /// Have a certificate obtained and renewed by ACME (Let's Encrypt or
    /// another CA): a managed certificate for these hosts.
    Acme {
        name: String,
        /// A DNS name to cover; repeat for more (`*.example.com` with
        /// `--challenge dns-01` only).
        #[arg(long = "host", required = true)]
        hosts: Vec<String>,
        /// The CA's ACME directory URL (default: Let's Encrypt's production
        /// directory).
        #[arg(long, default_value = "https://acme-v02.api.letsencrypt.org/directory")]
        directory: String,
        /// http-01 (port 80), tls-alpn-01 (port 443) or dns-01 (with
        /// --dns-hook).
        #[arg(long, default_value = "http-01")]
        challenge: String,
        /// The account's contact, such as mailto:ops@example.com.
        #[arg(long)]
        contact: Option<String>,
        /// With dns-01: the command that sets and removes the TXT record
        /// (called with `set|clear NAME VALUE` after its own arguments).
        #[arg(long = "dns-hook", num_args = 1.., value_delimiter = ' ')]
        dns_hook: Vec<String>,
        /// A CA certificate file (PEM) to trust for the directory's HTTPS
        /// (a private CA or a test server).
        #[arg(long = "directory-ca")]
        directory_ca: Option<PathBuf>,
        /// Serve it to clients that send no SNI name or an unknown one.
        #[arg(long)]
        default: bool,
    },
    /// Renew a managed (ACME) certificate now; the one served stays until
    /// the new one is issued.
    Renew { name: String },
    /// Delete a certificate.
    Delete { name: String },
}

#[derive(Subcommand, Debug)]
pub enum ServiceCommand {
    /// List services.
    List,
    /// Show one service.
    Get { name: String },
    /// Create or replace a service.
    Put {
        name: String,
        /// The spec as a YAML/JSON file; otherwise built from the flags.
        #[arg(short = 'f', long = "file", conflicts_with_all = ["policy", "backend"])]
        file: Option<PathBuf>,
        /// Policy kind (round_robin, random, least_conn).
        #[arg(long)]
        policy: Option<String>,
        /// A backend as ID=HOST:PORT[@WEIGHT]; repeat for more.
        #[arg(long = "backend")]
        backend: Vec<String>,
    },
    /// Delete a service (its routes must be gone).
    Delete { name: String },
}

#[derive(Subcommand, Debug)]
pub enum BackendCommand {
    /// Show one backend.
    Get { service: String, id: String },
    /// Create or replace a backend.
    Put {
        service: String,
        id: String,
        /// HOST:PORT.
        #[arg(long)]
        addr: String,
        /// Relative weight.
        #[arg(long, default_value_t = 1)]
        weight: u32,
        /// Use only when no primary backend is available.
        #[arg(long)]
        backup: bool,
        /// Most requests in flight to it at once.
        #[arg(long)]
        max_conns: Option<u32>,
    },
    /// Change some fields of an existing backend, keeping the others
    /// (`PATCH`: a weight, a limit, backup or not, without restating the
    /// rest).
    Set {
        service: String,
        id: String,
        /// HOST:PORT.
        #[arg(long)]
        addr: Option<String>,
        /// Relative weight (0 sends it nothing new: a drain).
        #[arg(long)]
        weight: Option<u32>,
        /// Use only when no primary backend is available (`true` or `false`).
        #[arg(long)]
        backup: Option<bool>,
        /// Most requests in flight to it at once.
        #[arg(long, conflicts_with = "no_max_conns")]
        max_conns: Option<u32>,
        /// Remove its `max_conns` limit.
        #[arg(long)]
        no_max_conns: bool,
    },
    /// Delete a backend.
    Delete { service: String, id: String },
}

#[derive(Subcommand, Debug)]
pub enum RouteCommand {
    /// List routes.
    List,
    /// Show one route.
    Get { name: String },
    /// Create or replace a route.
    Put {
        name: String,
        /// The spec as a YAML/JSON file; otherwise built from the flags.
        #[arg(short = 'f', long = "file", conflicts_with_all = ["service", "host", "path_prefix", "path", "priority"])]
        file: Option<PathBuf>,
        /// Target service.
        #[arg(long)]
        service: Option<String>,
        /// Host (exact, or *.domain).
        #[arg(long)]
        host: Option<String>,
        /// Segment-wise path prefix.
        #[arg(long)]
        path_prefix: Option<String>,
        /// Exact path.
        #[arg(long)]
        path: Option<String>,
        /// Higher wins over more specific (default 0).
        #[arg(long)]
        priority: Option<i32>,
        /// Rule sets the route runs, in order (comma-separated names).
        #[arg(long, value_delimiter = ',')]
        rules: Vec<String>,
    },
    /// Delete a route.
    Delete { name: String },
}

/// Seconds for a timeout flag: 1 s to 7 days (a startup error outside:
/// zero would close everything at once, and a huge value overflows the
/// clock it is added to).
/// A number from 0 to 1.
fn ratio(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
        Ok(_) => Err("must be from 0 to 1".into()),
        Err(e) => Err(e.to_string()),
    }
}

fn seconds() -> clap::builder::RangedU64ValueParser<u64> {
    clap::builder::RangedU64ValueParser::new().range(1..=7 * 86_400)
}
