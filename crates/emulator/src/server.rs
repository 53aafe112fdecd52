//! Listener, connection handling, graceful shutdown and the `run` entry point.

use std::future::Future;
use std::io::{self, Write};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};

use crate::app::AppState;
use crate::cli::Args;
use crate::handler::handle;

/// Longest time shutdown waits for in-flight requests.
pub const DRAIN_LIMIT: Duration = Duration::from_secs(30);

/// A bound emulator, ready to serve.
#[derive(Debug)]
pub struct Emulator {
    listener: TcpListener,
    state: Arc<AppState>,
}

impl Emulator {
    /// Validates the options and binds the listening socket.
    pub async fn bind(args: &Args) -> io::Result<Self> {
        let state = AppState::new(args)?;
        let listener = TcpListener::bind(args.listen).await?;
        Ok(Self { listener, state })
    }

    /// The bound address (with the real port when `--listen` used port 0).
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Shared state, for in-process inspection.
    pub fn state(&self) -> Arc<AppState> {
        Arc::clone(&self.state)
    }

    /// Serves until `shutdown` completes, then stops accepting and waits for
    /// open connections to finish their requests (at most [`DRAIN_LIMIT`]).
    pub async fn serve<F>(self, shutdown: F) -> io::Result<()>
    where
        F: Future<Output = ()>,
    {
        let (stop_tx, stop_rx) = watch::channel(false);
        // Every connection task holds a clone; `recv` returns None once all are gone.
        let (alive_tx, mut alive_rx) = mpsc::channel::<()>(1);
        let builder = Builder::new(TokioExecutor::new());
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                accepted = self.listener.accept() => match accepted {
                    Ok((stream, _)) => {
                        let conn = serve_conn(stream, Arc::clone(&self.state), builder.clone(), stop_rx.clone(), alive_tx.clone());
                        tokio::spawn(conn);
                    }
                    // Out of descriptors and similar: back off instead of spinning.
                    Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                },
            }
        }
        drop(self.listener);
        let _ = stop_tx.send(true);
        drop(alive_tx);
        let _ = tokio::time::timeout(DRAIN_LIMIT, alive_rx.recv()).await;
        Ok(())
    }
}

/// Serves one connection (HTTP/1.1 or h2c), closing it gracefully on stop.
async fn serve_conn(
    stream: TcpStream,
    state: Arc<AppState>,
    builder: Builder<TokioExecutor>,
    mut stop: watch::Receiver<bool>,
    _alive: mpsc::Sender<()>,
) {
    let _ = stream.set_nodelay(true);
    let _open = OpenConnection::new(Arc::clone(&state));
    let service = service_fn(move |req| handle(Arc::clone(&state), req));
    let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
    tokio::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => return,
        _ = stop.wait_for(|stopped| *stopped) => {}
    }
    conn.as_mut().graceful_shutdown();
    let _ = conn.await;
}

/// Counts a connection in `connections_open` while it lives.
struct OpenConnection(Arc<AppState>);

impl OpenConnection {
    fn new(state: Arc<AppState>) -> Self {
        state.connections_open.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        OpenConnection(state)
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.connections_open.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Runs the emulator as the binary does: optional startup delay, bind, print
/// `listening on ADDR` on stdout, serve until SIGTERM or SIGINT, then drain.
pub async fn run(args: Args) -> io::Result<()> {
    let signal = shutdown_signal()?;
    tokio::pin!(signal);
    if !args.startup_delay.is_zero() {
        tokio::select! {
            () = tokio::time::sleep(args.startup_delay) => {}
            () = &mut signal => return Ok(()),
        }
    }
    if args.faults {
        let listener = TcpListener::bind(args.listen).await?;
        let addr = listener.local_addr()?;
        let mut out = io::stdout().lock();
        writeln!(out, "listening on {addr}")?;
        out.flush()?;
        drop(out);
        let stats = Arc::new(crate::faults::FaultStats::default());
        tokio::select! {
            () = crate::faults::serve(listener, args.name.clone(), args.idle_close, stats) => {}
            () = &mut signal => {}
        }
        return Ok(());
    }
    let emulator = Emulator::bind(&args).await?;
    let addr = emulator.local_addr()?;
    let mut out = io::stdout().lock();
    writeln!(out, "listening on {addr}")?;
    out.flush()?;
    drop(out);
    emulator.serve(signal).await
}

/// Registers the signal handlers now and resolves when one fires.
#[cfg(unix)]
fn shutdown_signal() -> io::Result<impl Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}

/// Resolves on Ctrl-C.
#[cfg(not(unix))]
fn shutdown_signal() -> io::Result<impl Future<Output = ()>> {
    Ok(async {
        let _ = tokio::signal::ctrl_c().await;
    })
}
