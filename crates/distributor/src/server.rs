//! The reference distributor: answers queries on one UDP socket with the
//! backend its named policy picks.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UdpSocket;
use tokio::task::AbortHandle;

use crate::metrics::{scrape_loop, scrape_plan, MetricsUrl};
use crate::policies::{LoadTable, Policies};
use crate::protocol::{decode_query, encode_answer, ProtocolError, MAX_DATAGRAM};

/// The policy names the reference distributor knows.
pub const POLICIES: [&str; 3] = ["round_robin", "least_cpu", "session"];

/// Consecutive receive errors after which [`Server::run`] gives up.
const MAX_CONSECUTIVE_ERRORS: u32 = 100;

/// Options of the reference distributor (`tidegate distributor ...`).
#[derive(clap::Args, Debug, Clone, PartialEq, Eq)]
pub struct ServeOptions {
    /// UDP address to answer queries on (10010 is the paper's port).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:10010")]
    pub listen: SocketAddr,
    /// A backend the policies choose from, IP:PORT (repeat for each backend).
    #[arg(long = "backend", value_name = "ADDR", required = true)]
    pub backends: Vec<SocketAddr>,
    /// Scrape node_exporter at http://BACKEND_IP:PORT/metrics for least_cpu
    /// (without it and without --metrics-url, least_cpu is round robin).
    #[arg(long, value_name = "PORT")]
    pub node_exporter_port: Option<u16>,
    /// Scrape this node_exporter page for this backend's host instead
    /// (repeatable), e.g. 127.0.0.1:9001=http://127.0.0.1:9100/metrics.
    #[arg(long = "metrics-url", value_name = "ADDR=URL")]
    pub metrics_urls: Vec<MetricsUrl>,
    /// How often host metrics are scraped, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 1000)]
    pub metrics_interval_ms: u64,
    /// The cookie whose value the session policy hashes.
    #[arg(long, value_name = "NAME", default_value = "sid")]
    pub session_cookie: String,
}

impl ServeOptions {
    /// Options with the defaults of the command line: `listen` and `backends`
    /// given, no metrics sources, scrapes every second, cookie `sid`.
    pub fn new(listen: SocketAddr, backends: Vec<SocketAddr>) -> Self {
        ServeOptions {
            listen,
            backends,
            node_exporter_port: None,
            metrics_urls: Vec::new(),
            metrics_interval_ms: 1000,
            session_cookie: "sid".into(),
        }
    }
}

/// Totals since a server was bound.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerStats {
    /// Well-formed queries received.
    pub queries: u64,
    /// Answers naming a backend.
    pub answers: u64,
    /// Error answers (unknown policy, unsupported version).
    pub errors: u64,
    /// Datagrams ignored: not a query, or larger than the protocol allows.
    pub malformed: u64,
}

#[derive(Debug, Default)]
struct Counters {
    queries: AtomicU64,
    answers: AtomicU64,
    errors: AtomicU64,
    malformed: AtomicU64,
}

/// A bound reference distributor; its metrics scrapers run from [`Server::bind`]
/// until it is dropped.
#[derive(Debug)]
pub struct Server {
    socket: UdpSocket,
    policies: Policies,
    counters: Counters,
    scrapers: Vec<AbortHandle>,
}

impl Drop for Server {
    fn drop(&mut self) {
        for s in &self.scrapers {
            s.abort();
        }
    }
}

fn invalid(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, message)
}

impl Server {
    /// Checks `opts`, binds the UDP socket and starts the metrics scrapers
    /// (on the current tokio runtime).
    pub async fn bind(opts: ServeOptions) -> io::Result<Server> {
        if opts.backends.is_empty() {
            return Err(invalid("at least one --backend is required".into()));
        }
        if opts.session_cookie.is_empty() {
            return Err(invalid("--session-cookie must not be empty".into()));
        }
        if opts.metrics_interval_ms == 0 {
            return Err(invalid("--metrics-interval-ms must be at least 1".into()));
        }
        let plan = scrape_plan(&opts.backends, opts.node_exporter_port, &opts.metrics_urls)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let socket = UdpSocket::bind(opts.listen).await?;
        let load = Arc::new(LoadTable::new(opts.backends.len()));
        let interval = Duration::from_millis(opts.metrics_interval_ms);
        let client = tidegate_scrape::client();
        let mut scrapers = Vec::with_capacity(plan.len());
        for (url, indices) in plan {
            let url = url.parse().map_err(|e| invalid(format!("metrics URL {url}: {e}")))?;
            let task = scrape_loop(client.clone(), url, indices, load.clone(), interval);
            scrapers.push(tokio::spawn(task).abort_handle());
        }
        let policies = Policies::new(opts.backends, load, opts.session_cookie);
        Ok(Server { socket, policies, counters: Counters::default(), scrapers })
    }

    /// The address the server answers on.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.socket.local_addr()
    }

    /// Totals since the server was bound.
    pub fn stats(&self) -> ServerStats {
        let c = &self.counters;
        ServerStats {
            queries: c.queries.load(Relaxed),
            answers: c.answers.load(Relaxed),
            errors: c.errors.load(Relaxed),
            malformed: c.malformed.load(Relaxed),
        }
    }

    /// Answers queries until the socket fails repeatedly (then the last error).
    /// Malformed datagrams are counted and ignored; a failed send is dropped
    /// (the proxy retries). Several tasks may run it at once on a
    /// multi-thread runtime to answer on several threads.
    pub async fn run(&self) -> io::Result<()> {
        let mut buf = vec![0u8; MAX_DATAGRAM + 1];
        let mut answer = Vec::with_capacity(128);
        let mut errors = 0;
        loop {
            let (n, from) = match self.socket.recv_from(&mut buf).await {
                Ok(received) => received,
                Err(e) => {
                    errors += 1;
                    if errors >= MAX_CONSECUTIVE_ERRORS {
                        return Err(e);
                    }
                    tracing::debug!(error = %e, "distributor: receive failed");
                    tokio::task::yield_now().await;
                    continue;
                }
            };
            errors = 0;
            if self.handle(&buf[..n], &mut answer) {
                if let Err(e) = self.socket.send_to(&answer, from).await {
                    tracing::debug!(%from, error = %e, "distributor: answer not sent");
                }
            }
        }
    }

    /// Decides one datagram; `true` with the answer in `out`, `false` to ignore it.
    fn handle(&self, datagram: &[u8], out: &mut Vec<u8>) -> bool {
        let c = &self.counters;
        if datagram.len() > MAX_DATAGRAM {
            c.malformed.fetch_add(1, Relaxed);
            return false;
        }
        match decode_query(datagram) {
            Ok(q) => {
                c.queries.fetch_add(1, Relaxed);
                match self.policies.decide(&q) {
                    Ok(backend) => {
                        c.answers.fetch_add(1, Relaxed);
                        encode_answer(q.id, Ok(backend), out);
                    }
                    Err(e) => {
                        c.errors.fetch_add(1, Relaxed);
                        encode_answer(q.id, Err(&e.to_string()), out);
                    }
                }
                true
            }
            Err(ProtocolError::Version { version, id }) => {
                c.errors.fetch_add(1, Relaxed);
                encode_answer(id, Err(&format!("unsupported protocol version {version}")), out);
                true
            }
            Err(_) => {
                c.malformed.fetch_add(1, Relaxed);
                false
            }
        }
    }
}

/// Runs the reference distributor: binds, prints `distributor listening on
/// ADDR` on stdout, then answers queries (see [`Server::run`]).
pub async fn serve(opts: ServeOptions) -> io::Result<()> {
    let server = Server::bind(opts).await?;
    let addr = server.local_addr()?;
    {
        use std::io::Write;
        let mut stdout = io::stdout().lock();
        writeln!(stdout, "distributor listening on {addr}")?;
        stdout.flush()?;
    }
    server.run().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{decode_answer, Query};
    use crate::DistributorClient;
    use clap::Parser;
    use http::HeaderMap;

    fn addr(s: &str) -> SocketAddr {
        s.parse().expect("addr")
    }

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        opts: ServeOptions,
    }

    #[test]
    fn command_line_parses_into_options() {
        let cli = Cli::try_parse_from([
            "distributor",
            "--listen",
            "127.0.0.1:7000",
            "--backend",
            "127.0.0.1:9001",
            "--backend",
            "127.0.0.1:9002",
            "--node-exporter-port",
            "9100",
            "--metrics-interval-ms",
            "250",
            "--metrics-url",
            "127.0.0.1:9002=http://127.0.0.1:9101/metrics",
            "--session-cookie",
            "JSESSIONID",
        ])
        .expect("parse");
        let o = cli.opts;
        assert_eq!(o.listen, addr("127.0.0.1:7000"));
        assert_eq!(o.backends, [addr("127.0.0.1:9001"), addr("127.0.0.1:9002")]);
        assert_eq!((o.node_exporter_port, o.metrics_interval_ms), (Some(9100), 250));
        assert_eq!(o.metrics_urls.len(), 1);
        assert_eq!(o.session_cookie, "JSESSIONID");

        let d = Cli::try_parse_from(["distributor", "--backend", "127.0.0.1:9001"]).expect("defaults").opts;
        assert_eq!(d, ServeOptions::new(addr("127.0.0.1:10010"), vec![addr("127.0.0.1:9001")]));
        assert!(Cli::try_parse_from(["distributor"]).is_err(), "a backend is required");
    }

    async fn bound(backends: &[&str]) -> Server {
        let opts = ServeOptions::new(addr("127.0.0.1:0"), backends.iter().map(|b| addr(b)).collect());
        Server::bind(opts).await.expect("bind")
    }

    #[tokio::test]
    async fn bind_rejects_bad_options() {
        let mut o = ServeOptions::new(addr("127.0.0.1:0"), vec![]);
        assert!(Server::bind(o.clone()).await.is_err());
        o.backends = vec![addr("127.0.0.1:9001")];
        o.metrics_urls = vec!["127.0.0.1:9999=http://127.0.0.1:9100/metrics".parse().expect("url")];
        assert!(Server::bind(o).await.is_err(), "override for a backend that is not configured");
    }

    #[tokio::test]
    async fn malformed_datagrams_are_counted_and_ignored() {
        let server = bound(&["127.0.0.1:9001"]).await;
        let mut out = Vec::new();
        let oversized = vec![b' '; MAX_DATAGRAM + 1];
        for bad in [&b"garbage"[..], b"{}", b"{\"v\":1,\"id\":1}", b"\xc3\x28", &oversized] {
            assert!(!server.handle(bad, &mut out), "{bad:?}");
        }
        assert_eq!(server.stats().malformed, 5);

        let v2 = br#"{"v":2,"id":77}"#;
        assert!(server.handle(v2, &mut out));
        let a = decode_answer(&out).expect("answer");
        assert_eq!(a.id, 77);
        assert!(a.result.is_err());

        let ok = br#"{"v":1,"id":78,"policy":"round_robin","client":"1.2.3.4:5","method":"GET","path":"/"}"#;
        assert!(server.handle(ok, &mut out));
        assert_eq!(decode_answer(&out).expect("answer").result, Ok(addr("127.0.0.1:9001")));
        let st = server.stats();
        assert_eq!((st.queries, st.answers, st.errors, st.malformed), (1, 1, 1, 5));
    }

    #[tokio::test]
    async fn client_and_server_over_udp() {
        let server = Arc::new(bound(&["127.0.0.1:9001", "127.0.0.1:9002"]).await);
        let target = server.local_addr().expect("addr");
        let running = tokio::spawn({
            let server = server.clone();
            async move { server.run().await }
        });
        // Garbage first: the server must survive it.
        let raw = UdpSocket::bind("127.0.0.1:0").await.expect("bind");
        raw.send_to(b"\x00\x01not json", target).await.expect("send");

        let client = DistributorClient::new();
        let mut headers = HeaderMap::new();
        headers.insert("cookie", "sid=abc".parse().expect("value"));
        let mut q = Query {
            policy: "round_robin",
            client: addr("192.0.2.1:5555"),
            method: "GET",
            path: "/",
            host: Some("shop.example"),
            headers: &headers,
        };
        let timeout = Duration::from_secs(5);
        let a = client.query(target, &q, timeout, 3).await.expect("answer");
        let b = client.query(target, &q, timeout, 3).await.expect("answer");
        assert_ne!(a, b, "round robin alternates");

        q.policy = "session";
        let s = client.query(target, &q, timeout, 3).await.expect("answer");
        for _ in 0..20 {
            assert_eq!(client.query(target, &q, timeout, 3).await, Some(s));
        }

        q.policy = "least_io";
        let start = std::time::Instant::now();
        assert_eq!(client.query(target, &q, timeout, 3).await, None);
        assert!(start.elapsed() < timeout, "an error answer fails at once, without retries");

        let st = server.stats();
        assert_eq!((st.queries, st.errors, st.malformed), (24, 1, 1));
        running.abort();
    }
}
