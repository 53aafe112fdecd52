//! Listeners and runtimes: thread-per-core (a current-thread runtime per
//! worker, `SO_REUSEPORT` listeners) or one multi-thread runtime.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tidegate_snapshot::Snapshot;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch, Semaphore};

use crate::conn::{ConnHold, Peer};
use crate::handler::Proxy;
use crate::hyper_server::HyperServer;
use crate::limits::{Limits, TimedIo};
use crate::metrics::ProxyMetrics;

/// How the data plane uses threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RuntimeMode {
    /// One current-thread tokio runtime per worker, each with its own
    /// `SO_REUSEPORT` listener and upstream pools: no work stealing, no
    /// cross-thread wakeups. The default (faster here; see docs/benchmarks.md).
    #[default]
    PerCore,
    /// One multi-thread tokio runtime with `workers` threads and one listener.
    MultiThread,
}

/// Which code serves HTTP/1.1 clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Http1Engine {
    /// Tidegate's own HTTP/1.1 path on `httparse` (see the `native`
    /// module); HTTP/2 clients are handed to hyper. The default.
    #[default]
    Native,
    /// hyper's HTTP/1.1 server.
    Hyper,
}

/// Data-plane settings.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Where clients connect in plain HTTP (none: no plain listener).
    pub listen: Option<SocketAddr>,
    /// Where clients connect over TLS (none: no TLS listener). Certificates
    /// come from the configuration (`/v1/certificates`).
    pub listen_tls: Option<SocketAddr>,
    /// Worker threads (S2: one per core).
    pub workers: usize,
    /// Thread-per-core or multi-thread.
    pub mode: RuntimeMode,
    /// Which code serves HTTP/1.1.
    pub http1: Http1Engine,
    /// Client-side limits and timeouts.
    pub limits: Limits,
    /// On shutdown, how long open connections may take to finish.
    pub drain_timeout: Duration,
    /// A path the proxy answers itself on its listeners, before routing,
    /// for load balancers' health checks (`GET`/`HEAD`: 200 `ok`, 503
    /// `draining` once the proxy is stopping).
    pub health_path: Option<String>,
    /// Where a line per request goes, if anywhere.
    pub access_log: Option<Arc<crate::AccessLog>>,
    /// Certificates issued during the handshake for names nobody
    /// configured (on-demand TLS), when the binary gives it.
    pub on_demand: Option<Arc<dyn crate::tls::OnDemandTls>>,
    /// Traces of requests, exported over OTLP, when they are on.
    pub tracing: Option<crate::Tracing>,
    /// The published snapshots' announcements: with them, the data plane
    /// opens and closes the configuration's named listeners as they come
    /// and go (`None`: only the default listeners are served).
    pub listener_changes: Option<tidegate_snapshot::Changes>,
    /// Where the named listeners' state is reported.
    pub listener_board: tidegate_snapshot::ListenerBoard,
    /// The named listeners' sockets, handed over and offered at a
    /// takeover.
    pub named_sockets: crate::named::NamedSockets,
    /// HTTP/3 on the TLS listener's address over UDP, when on
    /// (`--http3`).
    pub http3: Option<crate::Http3>,
}

/// Listening sockets made elsewhere for the data plane to serve on: the
/// ones a running instance handed over (`tidegate serve --takeover`).
/// Several sockets of one kind are the `SO_REUSEPORT` group of a per-core
/// instance; every one is served (each has its own accept queue).
#[derive(Debug, Default)]
pub struct Listeners {
    /// Plain HTTP listeners, all bound to one address.
    pub plain: Vec<std::net::TcpListener>,
    /// TLS listeners, all bound to one address.
    pub tls: Vec<std::net::TcpListener>,
}

/// One listening socket of the data plane, for handing it over.
#[derive(Debug, Clone, Copy)]
pub struct ListeningSocket<'a> {
    /// It terminates TLS.
    pub tls: bool,
    /// The address it is bound to.
    pub addr: SocketAddr,
    /// Its descriptor.
    pub fd: std::os::fd::BorrowedFd<'a>,
}

/// The running data plane.
pub struct ServerHandle {
    local_addr: Option<SocketAddr>,
    tls_addr: Option<SocketAddr>,
    stop: watch::Sender<bool>,
    threads: Vec<std::thread::JoinHandle<()>>,
    /// A duplicate of every listening socket (the workers own the others),
    /// to hand them over; `(tls, socket)`.
    sockets: Vec<(bool, std::net::TcpListener)>,
    /// Counts the client connections open.
    open: OpenConnections,
    /// Connections still open when the drain timeout ended the drain (the
    /// most any worker saw).
    cut: Arc<std::sync::atomic::AtomicU64>,
}

/// Counts the client connections open (of all workers), for reports on a
/// drain.
#[derive(Clone)]
pub struct OpenConnections {
    slots: Arc<Semaphore>,
    max: usize,
}

impl OpenConnections {
    /// Client connections open now.
    pub fn count(&self) -> u64 {
        self.max.saturating_sub(self.slots.available_permits()) as u64
    }
}

impl ServerHandle {
    /// The address of the plain HTTP listener, if any.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.local_addr
    }

    /// The address of the TLS listener, if any.
    pub fn tls_addr(&self) -> Option<SocketAddr> {
        self.tls_addr
    }

    /// Every listening socket (all of a per-core group), for handing them
    /// over to a new process.
    pub fn sockets(&self) -> Vec<ListeningSocket<'_>> {
        use std::os::fd::AsFd;
        self.sockets
            .iter()
            .filter_map(|(tls, l)| {
                let addr = l.local_addr().ok()?;
                Some(ListeningSocket { tls: *tls, addr, fd: l.as_fd() })
            })
            .collect()
    }

    /// Counts the client connections open, during a drain too.
    pub fn open_connections(&self) -> OpenConnections {
        self.open.clone()
    }

    /// Stops accepting, lets open connections finish (bounded by the drain
    /// timeout), and waits for the workers. Blocking. The listening sockets
    /// close as the workers stop accepting, unless another process holds
    /// them too (after a hand-over), which then goes on accepting from the
    /// same queues. Returns the connections the drain timeout cut.
    pub fn shutdown(mut self) -> u64 {
        self.sockets.clear();
        let _ = self.stop.send(true);
        for t in self.threads {
            let _ = t.join();
        }
        self.cut.load(std::sync::atomic::Ordering::Relaxed)
    }
}

pub(crate) fn bind(addr: SocketAddr, reuse_port: bool) -> std::io::Result<std::net::TcpListener> {
    let socket = socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::STREAM, None)?;
    socket.set_reuse_address(true)?;
    if reuse_port {
        socket.set_reuse_port(true)?;
    }
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(4096)?;
    Ok(socket.into())
}

/// Binds `addr` once per worker (with `SO_REUSEPORT`) in per-core mode,
/// once otherwise. Returns the listeners and the address bound.
pub(crate) fn bind_all(
    addr: SocketAddr,
    per_core: bool,
    workers: usize,
) -> std::io::Result<(Vec<std::net::TcpListener>, SocketAddr)> {
    // SO_REUSEPORT would let a second instance share the port silently: a
    // probe bound without it fails with "address in use" if anyone listens.
    let listen = if per_core {
        let probe = bind(addr, false)?;
        let addr = probe.local_addr()?;
        drop(probe);
        addr
    } else {
        addr
    };
    let first = bind(listen, per_core)?;
    let local = first.local_addr()?;
    let mut listeners = vec![first];
    if per_core {
        for _ in 1..workers {
            listeners.push(bind(local, true)?);
        }
    }
    Ok((listeners, local))
}

/// A per-core worker runs a task woken by another thread (a request
/// waiting in a service's queue, woken when a request of another worker
/// freed room) at least once every this many tasks. tokio's default for
/// its single-threaded scheduler, 31, serves such tasks only that rarely
/// while the worker has work of its own: under a flood of 5,000
/// connections, requests woken across workers waited past the queue's
/// 1 s timeout and were answered 503 while the backends had room.
const REMOTE_TASK_INTERVAL: u32 = 4;

/// Starts the data plane. Binds before returning, so errors such as an
/// address in use are reported here.
pub fn serve(
    opts: ServerOptions,
    snapshots: Arc<ArcSwap<Snapshot>>,
    metrics: Arc<ProxyMetrics>,
) -> std::io::Result<ServerHandle> {
    let per_core = opts.mode == RuntimeMode::PerCore;
    let workers = opts.workers.max(1);
    let plain = match opts.listen {
        Some(addr) => bind_all(addr, per_core, workers)?.0,
        None => Vec::new(),
    };
    let tls = match opts.listen_tls {
        Some(addr) => bind_all(addr, per_core, workers)?.0,
        None => Vec::new(),
    };
    serve_on(opts, Listeners { plain, tls }, snapshots, metrics)
}

/// Starts the data plane on listening sockets made elsewhere (handed over
/// by a running instance); `opts.listen` and `opts.listen_tls` are not
/// bound. In per-core mode the sockets are shared out among the workers
/// (a worker may serve several; with fewer sockets than workers, only as
/// many workers run as there are sockets of the larger kind).
pub fn serve_on(
    opts: ServerOptions,
    listeners: Listeners,
    snapshots: Arc<ArcSwap<Snapshot>>,
    metrics: Arc<ProxyMetrics>,
) -> std::io::Result<ServerHandle> {
    let workers = opts.workers.max(1);
    if let Some(log) = &opts.access_log {
        metrics.set_access_log(log.clone());
    }
    if let Some(t) = &opts.tracing {
        metrics.set_tracing(t.exporter.clone());
    }
    let limits = Arc::new(opts.limits.clone());
    // One body buffer budget and one set of per-client counters for all
    // workers.
    let admission = Arc::new(crate::admission::Admission::new(&opts.limits));
    metrics.set_buffers(admission.buffers.clone());
    // One connection budget for the listeners, shared by their workers.
    let max_slots = opts.limits.max_connections.clamp(1, Semaphore::MAX_PERMITS);
    let slots = Arc::new(Semaphore::new(max_slots));
    let open = OpenConnections { slots: slots.clone(), max: max_slots };
    let cut = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (stop, stop_rx) = watch::channel(false);
    let mut threads = Vec::new();
    let per_core = opts.mode == RuntimeMode::PerCore;
    let Listeners { plain, tls } = listeners;
    let mut sockets = Vec::new();
    for (is_tls, set) in [(false, &plain), (true, &tls)] {
        for l in set {
            l.set_nonblocking(true)?;
            sockets.push((is_tls, l.try_clone()?));
        }
    }
    let address = |set: &[std::net::TcpListener]| set.first().map(|l| l.local_addr()).transpose();
    let (local_addr, tls_addr) = (address(&plain)?, address(&tls)?);
    if local_addr.is_none() && tls_addr.is_none() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "no listener: give --listen or --listen-tls",
        ));
    }
    let acceptor = match tls_addr {
        Some(_) => Some(Arc::new(crate::tls::TlsFront::new(snapshots.clone(), opts.on_demand.clone())?)),
        None => None,
    };
    let https_port = tls_addr.map(|a| a.port());
    // HTTP/3: one UDP socket per worker on the TLS listener's address.
    let quic = match (&opts.http3, tls_addr) {
        (Some(settings), Some(addr)) => {
            let counters = Arc::new(crate::h3::QuicCounters::default());
            metrics.set_quic(counters.clone());
            Some((settings.clone(), addr, crate::h3::server_config(&snapshots, &opts.limits)?, counters))
        }
        _ => None,
    };
    let runs = if per_core { workers.min(plain.len().max(tls.len())) } else { 1 };
    if per_core && runs < workers {
        tracing::info!(workers, sockets = runs, "fewer listening sockets than workers: one worker per socket");
    }
    // Worker i serves sockets i, i + runs, i + 2 runs, ...
    let share = |set: Vec<std::net::TcpListener>| {
        let mut shares: Vec<Vec<std::net::TcpListener>> = (0..runs).map(|_| Vec::new()).collect();
        for (i, l) in set.into_iter().enumerate() {
            shares[i % runs].push(l);
        }
        shares
    };
    let (mut plain, mut tls) = (share(plain).into_iter(), share(tls).into_iter());
    let mut named_workers = Vec::new();
    for i in 0..runs {
        // Sockets and timers only: no signal or child-process driver to
        // poll each time a worker parks.
        let runtime = if per_core {
            tokio::runtime::Builder::new_current_thread()
                .global_queue_interval(REMOTE_TASK_INTERVAL)
                .enable_io()
                .enable_time()
                .build()?
        } else {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(workers)
                .thread_name("tidegate-proxy")
                .enable_io()
                .enable_time()
                .build()?
        };
        let mut proxy = Proxy::new(snapshots.clone(), &metrics, limits.clone(), https_port);
        proxy.set_health_path(opts.health_path.as_deref());
        proxy.share_admission(admission.clone());
        proxy.set_access_log(opts.access_log.clone());
        proxy.set_tracing(opts.tracing.clone());
        if let Some((settings, addr, ..)) = quic.as_ref().filter(|q| q.0.alt_svc_max_age_s > 0) {
            proxy.set_alt_svc(addr.port(), settings.alt_svc_max_age_s);
        }
        let proxy = Arc::new(proxy);
        let endpoint = match &quic {
            Some((settings, addr, config, counters)) => Some(crate::h3::Endpoint {
                socket: crate::h3::bind_udp(*addr, true)?,
                config: config.clone(),
                proxy: proxy.clone(),
                limits: limits.clone(),
                settings: settings.clone(),
                slots: slots.clone(),
                counters: counters.clone(),
                stop: stop_rx.clone(),
                drain: opts.drain_timeout,
            }),
            None => None,
        };
        // Named listeners' accept loops on this worker hold a sender; at
        // shutdown the worker waits for them as for its own.
        let (named_alive, mut named_done) = mpsc::channel::<()>(1);
        named_workers.push(crate::named::Worker {
            handle: runtime.handle().clone(),
            proxy: proxy.clone(),
            alive: named_alive,
        });
        let (plain_listeners, tls_listeners) = (plain.next().unwrap_or_default(), tls.next().unwrap_or_default());
        let (stop_rx, opts, acceptor) = (stop_rx.clone(), opts.clone(), acceptor.clone());
        let (open, cut) = (open.clone(), cut.clone());
        let thread = std::thread::Builder::new().name(format!("tidegate-worker-{i}")).spawn(move || {
            runtime.block_on(async move {
                let hyper = HyperServer::new(&opts.limits);
                let run = |listener: std::net::TcpListener, tls: Option<Arc<crate::tls::TlsFront>>| {
                    let (proxy, stop_rx, hyper) = (proxy.clone(), stop_rx.clone(), hyper.clone());
                    let (opts, slots) = (&opts, Slots { open: open.clone(), cut: cut.clone() });
                    async move {
                        match TcpListener::from_std(listener) {
                            Ok(l) => accept_loop(l, tls, proxy, stop_rx, opts, slots, hyper, Bound::default()).await,
                            Err(e) => tracing::error!(error = %e, "cannot register the listener"),
                        }
                    }
                };
                let loops = plain_listeners
                    .into_iter()
                    .map(|l| run(l, None))
                    .chain(tls_listeners.into_iter().map(|l| run(l, acceptor.clone())));
                let quic = async {
                    if let Some(endpoint) = endpoint {
                        endpoint.run().await;
                    }
                };
                futures_util::future::join(futures_util::future::join_all(loops), quic).await;
                // The named listeners' loops drain on the same stop.
                let _ = tokio::time::timeout(opts.drain_timeout + Duration::from_secs(1), named_done.recv()).await;
            });
        })?;
        threads.push(thread);
    }
    if let (Some(changes), Some(first)) = (opts.listener_changes.clone(), named_workers.first()) {
        let handle = first.handle.clone();
        let manager = crate::named::Manager {
            workers: named_workers,
            per_core,
            snapshots,
            board: opts.listener_board.clone(),
            sockets: opts.named_sockets.clone(),
            opts,
            slots: Slots { open: open.clone(), cut: cut.clone() },
            tls: acceptor,
            stop: stop_rx,
        };
        handle.spawn(manager.run(changes));
    }
    Ok(ServerHandle { local_addr, tls_addr, stop, threads, sockets, open, cut })
}

/// Which listener an accept loop serves: a default one (all `None`), or a
/// named one, with the balancers its PROXY protocol trusts and the signal
/// that closes it.
#[derive(Debug, Clone, Default)]
pub(crate) struct Bound {
    /// The named listener's name (its connections match only the routes
    /// bound to it).
    pub name: Option<Arc<str>>,
    /// The networks whose connections must start with a PROXY protocol
    /// header (`None`: `--proxy-protocol-from`, the default listeners').
    pub balancers: Option<Arc<[tidegate_model::rules::Cidr]>>,
    /// Set when the listener is removed from the configuration.
    pub closed: Option<watch::Receiver<bool>>,
}

/// Waits until `closed` is set (or its sender is gone); never for `None`.
async fn until_closed(closed: &mut Option<watch::Receiver<bool>>) {
    match closed {
        None => std::future::pending().await,
        Some(rx) => {
            let _ = rx.wait_for(|c| *c).await;
        }
    }
}

/// The listeners' connection slots (shared by the workers), and what an
/// accept loop reports of its drain.
#[derive(Clone)]
pub(crate) struct Slots {
    open: OpenConnections,
    /// The connections open when the drain timed out (the most seen).
    cut: Arc<std::sync::atomic::AtomicU64>,
}

/// One worker's accept loop: takes a connection slot, accepts, and spawns
/// the connection's task; on stop, stops accepting and waits (at most the
/// drain timeout) for its connections to finish.
/// `tls`: the listener terminates TLS with these handshakes.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn accept_loop(
    listener: TcpListener,
    tls: Option<Arc<crate::tls::TlsFront>>,
    proxy: Arc<Proxy>,
    mut stop: watch::Receiver<bool>,
    opts: &ServerOptions,
    slots: Slots,
    hyper: HyperServer,
    bound: Bound,
) {
    let limits = &opts.limits;
    let Bound { name: listener_name, balancers, mut closed } = bound;
    // A named listener's connections are told to finish when it is
    // removed, as at shutdown.
    let own_stop = closed.as_ref().map(|_| watch::channel(false));
    let conn_stop = own_stop.as_ref().map_or_else(|| stop.clone(), |(_, rx)| rx.clone());
    let mut removed = false;
    let bound = listener.local_addr().unwrap_or(SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), 0));
    let port = bound.port();
    // Every connection holds a clone (in its `ConnHold`, which a tunnel
    // keeps too); `recv` returns None once all are gone.
    let (alive_tx, mut alive_rx) = mpsc::channel::<()>(1);
    let mut accept_errors = AcceptErrors::default();
    loop {
        let permit = tokio::select! {
            p = slots.open.slots.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
            _ = stop.changed() => break,
            () = until_closed(&mut closed) => {
                removed = true;
                break;
            }
        };
        tokio::select! {
            accepted = listener.accept() => {
                let (mut stream, peer) = match accepted {
                    Ok(x) => x,
                    Err(e) => {
                        // Out of file descriptors and the like: back off a little.
                        accept_errors.record(&e);
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                // A connection from a balancer that sends the PROXY
                // protocol is admitted once its header names the client.
                // `admitted`: None until then.
                let balanced = match &balancers {
                    None => limits.proxy_protocol_from.contains(peer.ip()),
                    Some(nets) => nets.iter().any(|n| n.contains(peer.ip())),
                };
                let admitted = match balanced {
                    true => None,
                    false => match admit(&proxy, peer) {
                        Ok(per_client) => Some(per_client),
                        Err(_) => continue,
                    },
                };
                let _ = stream.set_nodelay(true);
                proxy.metrics().connection();
                let hold = Arc::new(ConnHold::new(permit, alive_tx.clone()));
                let (proxy, stop, limits, hyper) = (proxy.clone(), conn_stop.clone(), limits.clone(), hyper.clone());
                let engine = opts.http1;
                let (tls, listener_name) = (tls.clone(), listener_name.clone());
                tokio::spawn(async move {
                    // The address the client reached: the listener's, unless it
                    // is bound to a wildcard address (then one system call).
                    let own = match bound.ip().is_unspecified() {
                        true => stream.local_addr().unwrap_or(bound),
                        false => bound,
                    };
                    let (addr, local, per_client) = match admitted {
                        Some(per_client) => (peer, own, per_client),
                        None => {
                            let Some((addr, local)) = balanced_client(&mut stream, (peer, own), &proxy, &limits).await
                            else {
                                return;
                            };
                            let Ok(per_client) = admit(&proxy, addr) else { return };
                            (addr, local, per_client)
                        }
                    };
                    let mut client = Peer::with_local(addr, local);
                    client.trusted = limits.trusted_proxies.contains(addr.ip());
                    client.conn_slot = Some(hold.clone());
                    client.set_listener(port, tls.is_some());
                    client.listener = listener_name;
                    match tls {
                    None => {
                        serve_http(stream, engine, client, proxy, stop, limits, hyper).await;
                        drop((hold, per_client));
                    }
                    Some(front) => {
                        let handshake = front.accept(stream);
                        let stream = match tokio::time::timeout(limits.first_request_timeout, handshake).await {
                            Ok(Ok((s, verified))) => {
                                client.client_cert = verified;
                                s
                            }
                            Ok(Err(e)) => {
                                tracing::debug!(client = %client.addr, error = %e, "TLS handshake failed");
                                proxy.metrics().tls_handshake(false);
                                return;
                            }
                            Err(_) => {
                                proxy.metrics().tls_handshake(false);
                                return;
                            }
                        };
                        proxy.metrics().tls_handshake(true);
                        // ALPN h2 goes to hyper's HTTP/2 whatever the engine;
                        // an ACME TLS-ALPN-01 validation ends with its
                        // handshake (RFC 8737, section 3).
                        let engine = match stream.get_ref().1.alpn_protocol() {
                            Some(b"h2") => Http1Engine::Hyper,
                            Some(crate::tls::ACME_TLS_ALPN) => return,
                            _ => engine,
                        };
                        serve_http(stream, engine, client, proxy, stop, limits, hyper).await;
                        drop((hold, per_client));
                    }
                    }
                });
            }
            _ = stop.changed() => break,
            () = until_closed(&mut closed) => {
                removed = true;
                break;
            }
        }
    }
    drop(listener);
    if let Some((tx, _)) = &own_stop {
        let _ = tx.send(true);
    }
    if removed {
        // Its connections finish on their own; the data plane goes on.
        return;
    }
    drop(alive_tx);
    if tokio::time::timeout(opts.drain_timeout, alive_rx.recv()).await.is_err() {
        let open = slots.open.count();
        tracing::info!(open, "the drain timeout closes the connections still open");
        slots.cut.fetch_max(open, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The connection's place under `--max-connections-per-client` for the
/// client at `addr` (None when there is no cap); an error when the client
/// is at its cap: the connection is then closed.
fn admit(proxy: &Proxy, addr: SocketAddr) -> Result<Option<crate::admission::ClientHold>, crate::admission::AtCap> {
    proxy.admission().connection(addr.ip()).inspect_err(|cap| {
        tracing::debug!(client = %addr, %cap, "connection refused");
        proxy.metrics().error(crate::ErrorKind::ClientLimit);
    })
}

/// The client a balancer's PROXY protocol header names on `stream`, and
/// the address it connected to (the connection's own, `direct`, for a
/// header that names none); None when the header is missing, malformed or
/// late (within the first request's timeout): the connection is then
/// closed.
async fn balanced_client(
    stream: &mut tokio::net::TcpStream,
    direct: (SocketAddr, SocketAddr),
    proxy: &Proxy,
    limits: &Limits,
) -> Option<(SocketAddr, SocketAddr)> {
    let read = tokio::time::timeout(limits.first_request_timeout, crate::proxy_header::read(stream)).await;
    let peer = direct.0;
    let outcome = match read {
        Ok(Ok(client)) => Ok(client.unwrap_or(direct)),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("no PROXY protocol header within the first request's timeout".to_string()),
    };
    proxy.metrics().proxy_header(outcome.is_ok());
    outcome.map_err(|e| tracing::debug!(balancer = %peer, error = %e, "connection closed")).ok()
}

/// Serves one connection (plain or decrypted) with `engine`.
async fn serve_http<S>(
    stream: S,
    engine: Http1Engine,
    client: Peer,
    proxy: Arc<Proxy>,
    stop: watch::Receiver<bool>,
    limits: Limits,
    hyper: HyperServer,
) where
    S: crate::native::ClientIo,
{
    match engine {
        Http1Engine::Native => crate::native::serve(stream, client, proxy, stop, limits, hyper).await,
        Http1Engine::Hyper => {
            let io = TimedIo::new(stream, limits.write_timeout);
            hyper.serve(io, client, proxy, stop, limits).await;
        }
    }
}

/// Logs accept failures (such as running out of file descriptors) at most
/// once a second, with how many there were.
#[derive(Default)]
struct AcceptErrors {
    since_log: u64,
    last_log: Option<std::time::Instant>,
}

impl AcceptErrors {
    fn record(&mut self, e: &std::io::Error) {
        self.since_log += 1;
        if self.last_log.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
            tracing::warn!(error = %e, count = self.since_log, "accept failed");
            self.since_log = 0;
            self.last_log = Some(std::time::Instant::now());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// Sockets handed over by a per-core instance with more workers than
    /// this one: every socket of the `SO_REUSEPORT` group is served (the
    /// kernel spreads connections over all of them, so one left without an
    /// accept loop would leave its connections waiting), and all are
    /// offered again to the next process.
    #[test]
    fn serve_on_serves_every_socket_of_a_group_larger_than_its_workers() {
        let first = bind(SocketAddr::from(([127, 0, 0, 1], 0)), true).expect("bind");
        let addr = first.local_addr().expect("addr");
        let mut plain = vec![first];
        for _ in 0..2 {
            plain.push(bind(addr, true).expect("bind the group"));
        }
        let snapshots = Arc::new(ArcSwap::from_pointee(Snapshot::from_state(&Default::default(), 0)));
        let opts = ServerOptions {
            listen: None,
            listen_tls: None,
            workers: 2,
            mode: RuntimeMode::PerCore,
            http1: Http1Engine::Native,
            limits: Limits::default(),
            drain_timeout: Duration::from_secs(1),
            health_path: Some("/healthz".into()),
            access_log: None,
            on_demand: None,
            tracing: None,
            listener_changes: None,
            listener_board: Default::default(),
            named_sockets: Default::default(),
            http3: None,
        };
        let handle = serve_on(opts, Listeners { plain, tls: Vec::new() }, snapshots, Arc::new(ProxyMetrics::default()))
            .expect("serves");
        assert_eq!(handle.local_addr(), Some(addr));
        let offered = handle.sockets();
        assert_eq!(offered.len(), 3);
        assert!(offered.iter().all(|s| s.addr == addr && !s.tls));
        // Spread over three sockets, 60 connections miss one of them with
        // a probability of (2/3)^60: each must be answered.
        for i in 0..60 {
            let mut c = std::net::TcpStream::connect(addr).expect("connect");
            c.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
            c.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").expect("write");
            let mut answer = String::new();
            let _ = c.read_to_string(&mut answer);
            assert!(answer.starts_with("HTTP/1.1 200"), "connection {i}: {answer:?}");
        }
        handle.shutdown();
    }
}
