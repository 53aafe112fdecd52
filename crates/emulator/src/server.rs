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
use crate::grpc::GrpcBody;
use crate::handler::handle;

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::{Either, Full};

/// A connection the emulator serves: TCP, or TLS over it.
trait Connection {
    /// Turns Nagle's algorithm off.
    fn no_delay(&self);
}

impl Connection for TcpStream {
    fn no_delay(&self) {
        let _ = self.set_nodelay(true);
    }
}

impl Connection for tokio_rustls::server::TlsStream<TcpStream> {
    fn no_delay(&self) {} // set on the TCP stream before the handshake
}

/// Longest time shutdown waits for in-flight requests.
pub const DRAIN_LIMIT: Duration = Duration::from_secs(30);

/// A bound emulator, ready to serve.
pub struct Emulator {
    listener: TcpListener,
    state: Arc<AppState>,
    tls: Option<tokio_rustls::TlsAcceptor>,
}

impl std::fmt::Debug for Emulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Emulator").field("listener", &self.listener).field("tls", &self.tls.is_some()).finish()
    }
}

impl Emulator {
    /// Validates the options and binds the listening socket.
    pub async fn bind(args: &Args) -> io::Result<Self> {
        let state = AppState::new(args)?;
        let tls = match (&args.tls_cert, &args.tls_key) {
            (Some(cert), Some(key)) => Some(tls_acceptor(cert, key, args.tls_client_ca.as_deref())?),
            _ => None,
        };
        let listener = TcpListener::bind(args.listen).await?;
        Ok(Self { listener, state, tls })
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
                        let (state, builder, stop, alive) = (Arc::clone(&self.state), builder.clone(), stop_rx.clone(), alive_tx.clone());
                        match self.tls.clone() {
                            None => drop(tokio::spawn(serve_conn(stream, state, builder, stop, alive))),
                            Some(acceptor) => drop(tokio::spawn(async move {
                                let _ = stream.set_nodelay(true);
                                if let Ok(tls) = acceptor.accept(stream).await {
                                    serve_conn(tls, state, builder, stop, alive).await;
                                }
                            })),
                        }
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

/// A TLS acceptor for `--tls-cert` and `--tls-key`, requiring client
/// certificates from `client_ca` when given.
fn tls_acceptor(
    cert: &std::path::Path,
    key: &std::path::Path,
    client_ca: Option<&std::path::Path>,
) -> io::Result<tokio_rustls::TlsAcceptor> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let invalid = |e: String| io::Error::new(io::ErrorKind::InvalidInput, e);
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| invalid(format!("--tls-cert: {e}")))?;
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| invalid(format!("--tls-key: {e}")))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid(e.to_string()))?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(path) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in CertificateDer::pem_file_iter(path).map_err(|e| invalid(format!("--tls-client-ca: {e}")))? {
                roots
                    .add(c.map_err(|e| invalid(format!("--tls-client-ca: {e}")))?)
                    .map_err(|e| invalid(format!("--tls-client-ca: {e}")))?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| invalid(format!("--tls-client-ca: {e}")))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_single_cert(chain, key).map_err(|e| invalid(format!("--tls-cert/--tls-key: {e}")))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

/// Answers a request: a gRPC call, or anything else.
async fn dispatch(
    state: Arc<AppState>,
    req: http::Request<hyper::body::Incoming>,
) -> Result<http::Response<Either<Full<Bytes>, GrpcBody>>, Infallible> {
    if crate::grpc::is_grpc(&req) {
        return Ok(crate::grpc::handle(state, req).await.map(Either::Right));
    }
    let resp = handle(state, req).await?;
    Ok(resp.map(Either::Left))
}

/// Serves one connection (HTTP/1.1 or h2c, in TLS or not), closing it
/// gracefully on stop.
async fn serve_conn<S>(
    stream: S,
    state: Arc<AppState>,
    builder: Builder<TokioExecutor>,
    mut stop: watch::Receiver<bool>,
    _alive: mpsc::Sender<()>,
) where
    S: Connection + tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    stream.no_delay();
    let _open = OpenConnection::new(Arc::clone(&state));
    let service = service_fn(move |req| dispatch(Arc::clone(&state), req));
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
