//! Listeners and runtimes: thread-per-core (a current-thread runtime per
//! worker, `SO_REUSEPORT` listeners) or one multi-thread runtime.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tidegate_snapshot::Snapshot;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::forward::Peer;
use crate::handler::Proxy;
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

/// Data-plane settings.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Where clients connect.
    pub listen: SocketAddr,
    /// Worker threads (S2: one per core).
    pub workers: usize,
    /// Thread-per-core or multi-thread.
    pub mode: RuntimeMode,
    /// How long a client may take to send request headers.
    pub header_read_timeout: Duration,
    /// On shutdown, how long open connections may take to finish.
    pub drain_timeout: Duration,
}

/// The running data plane.
pub struct ServerHandle {
    local_addr: SocketAddr,
    stop: watch::Sender<bool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl ServerHandle {
    /// The address the proxy listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops accepting, lets open connections finish (bounded by the drain
    /// timeout), and waits for the workers. Blocking.
    pub fn shutdown(self) {
        let _ = self.stop.send(true);
        for t in self.threads {
            let _ = t.join();
        }
    }
}

fn bind(addr: SocketAddr, reuse_port: bool) -> std::io::Result<std::net::TcpListener> {
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

/// Starts the data plane. Binds before returning, so errors such as an
/// address in use are reported here.
pub fn serve(
    opts: ServerOptions,
    snapshots: Arc<ArcSwap<Snapshot>>,
    metrics: Arc<ProxyMetrics>,
) -> std::io::Result<ServerHandle> {
    let workers = opts.workers.max(1);
    let (stop, stop_rx) = watch::channel(false);
    let mut threads = Vec::new();
    let per_core = opts.mode == RuntimeMode::PerCore;
    // SO_REUSEPORT would let a second instance share the port silently: a
    // probe bound without it fails with "address in use" if anyone listens.
    let listen = if per_core {
        let probe = bind(opts.listen, false)?;
        let addr = probe.local_addr()?;
        drop(probe);
        addr
    } else {
        opts.listen
    };
    let first = bind(listen, per_core)?;
    let local_addr = first.local_addr()?;
    let mut listeners = vec![first];
    if per_core {
        for _ in 1..workers {
            listeners.push(bind(local_addr, true)?);
        }
    }
    for (i, listener) in listeners.into_iter().enumerate() {
        let runtime = if per_core {
            tokio::runtime::Builder::new_current_thread().enable_all().build()?
        } else {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(workers)
                .thread_name("tidegate-proxy")
                .enable_all()
                .build()?
        };
        let proxy = Arc::new(Proxy::new(snapshots.clone(), &metrics));
        let stop_rx = stop_rx.clone();
        let opts = opts.clone();
        let thread = std::thread::Builder::new().name(format!("tidegate-worker-{i}")).spawn(move || {
            runtime.block_on(async move {
                match TcpListener::from_std(listener) {
                    Ok(l) => accept_loop(l, proxy, stop_rx, &opts).await,
                    Err(e) => tracing::error!(error = %e, "cannot register the listener"),
                }
            });
        })?;
        threads.push(thread);
    }
    Ok(ServerHandle { local_addr, stop, threads })
}

async fn accept_loop(listener: TcpListener, proxy: Arc<Proxy>, mut stop: watch::Receiver<bool>, opts: &ServerOptions) {
    let graceful = GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(opts.header_read_timeout).keep_alive(true);
    builder.http2().timer(TokioTimer::new());
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(x) => x,
                    Err(e) => {
                        // Out of file descriptors and the like: back off a little.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                proxy.metrics().connection();
                let proxy = proxy.clone();
                let peer = Arc::new(Peer::new(peer));
                let service = service_fn(move |req| {
                    let proxy = proxy.clone();
                    let peer = peer.clone();
                    async move { Ok::<_, Infallible>(proxy.handle(req, &peer).await) }
                });
                let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service).into_owned();
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    let _ = conn.await;
                });
            }
            _ = stop.changed() => break,
        }
    }
    drop(listener);
    let _ = tokio::time::timeout(opts.drain_timeout, graceful.shutdown()).await;
}
