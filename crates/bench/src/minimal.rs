//! The least a hyper proxy can do, as the library ceiling of the
//! throughput benchmark: one current-thread runtime per worker with its own
//! `SO_REUSEPORT` listener, `hyper::server::conn::http1` towards clients,
//! and one `hyper::client::conn::http1` connection to the one upstream per
//! client connection. No routing, balancing, limits, header rewriting or
//! metrics. Runs until killed.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context as _;
use hyper::body::Incoming;
use hyper::client::conn::http1 as client;
use hyper::server::conn::http1 as server;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;

use crate::cli::MinimalProxyArgs;

/// Serves until the process is killed.
pub fn run(args: &MinimalProxyArgs) -> anyhow::Result<()> {
    let mut threads = Vec::new();
    for _ in 0..args.workers.max(1) {
        let listener = bind(args.listen).with_context(|| format!("binding {}", args.listen))?;
        let upstream = args.upstream;
        threads.push(std::thread::spawn(move || -> anyhow::Result<()> {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            rt.block_on(async move {
                let listener = TcpListener::from_std(listener)?;
                loop {
                    let (stream, _) = listener.accept().await?;
                    let _ = stream.set_nodelay(true);
                    tokio::spawn(serve(stream, upstream));
                }
            })
        }));
    }
    for t in threads {
        t.join().map_err(|_| anyhow::anyhow!("a worker panicked"))??;
    }
    Ok(())
}

pub(crate) fn bind(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let socket = socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::STREAM, None)?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(4096)?;
    Ok(socket.into())
}

type Upstream = Arc<Mutex<Option<client::SendRequest<Incoming>>>>;

async fn serve(stream: TcpStream, upstream: SocketAddr) {
    let conn: Upstream = Arc::default();
    let service = service_fn(move |req: Request<Incoming>| {
        let conn = conn.clone();
        async move { forward(&conn, upstream, req).await }
    });
    let _ = server::Builder::new().serve_connection(TokioIo::new(stream), service).await;
}

async fn forward(conn: &Upstream, upstream: SocketAddr, req: Request<Incoming>) -> anyhow::Result<Response<Incoming>> {
    let mut held = conn.lock().await;
    if held.as_ref().is_none_or(|s| s.is_closed()) {
        let stream = TcpStream::connect(upstream).await?;
        stream.set_nodelay(true)?;
        let (sender, connection) = client::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(connection);
        *held = Some(sender);
    }
    let sender = held.as_mut().context("no upstream connection")?;
    sender.ready().await?;
    let (mut parts, body) = req.into_parts();
    parts.uri = parts.uri.path_and_query().map_or_else(|| "/".parse(), |pq| pq.as_str().parse())?;
    Ok(sender.send_request(Request::from_parts(parts, body)).await?)
}
