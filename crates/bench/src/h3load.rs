//! HTTP/3 load on quinn and h3 as a client (the stack Tidegate serves
//! with, run the same way against every server): `--connections` QUIC
//! connections, each with `--streams` request streams kept busy (a closed
//! loop: a stream sends its next GET when its answer has ended), for
//! `--duration-s`; or, with `--handshakes`, `--connections` loops that
//! each open a connection, send one GET, and close it, again and again.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use bytes::{Buf, Bytes};
use serde::Serialize;

use crate::cli::{H3Args, Target};
use crate::report::{Counts, Latency, Summary};

/// What a run measured.
#[derive(Debug, Serialize)]
pub struct H3Report {
    /// `requests` or `handshakes`.
    pub mode: &'static str,
    pub connections: usize,
    pub streams: usize,
    pub duration_s: f64,
    /// Answers that ended with a 2xx status.
    pub ok: u64,
    /// Per second over the run: requests (or handshakes, each with its one
    /// request).
    pub per_s: f64,
    /// Time to a whole answer (or, with `--handshakes`, to connect and
    /// get one answer), microseconds.
    pub latency_us: Summary,
    /// Failures by kind.
    pub errors: Counts,
}

/// One loop's tally.
#[derive(Default)]
struct Tally {
    ok: u64,
    latency: Latency,
    errors: Counts,
}

/// Runs the load against `target.proxy` (the UDP port HTTP/3 is served
/// on).
pub async fn run(target: &Target, args: &H3Args) -> anyhow::Result<H3Report> {
    let endpoint = client_endpoint(args)?;
    let until = Instant::now() + Duration::from_secs_f64(args.duration_s);
    let started = Instant::now();
    let mut loops = Vec::new();
    for _ in 0..args.connections {
        let (endpoint, args, addr) = (endpoint.clone(), args.clone(), target.proxy);
        loops.push(tokio::spawn(async move {
            if args.handshakes {
                handshakes(&endpoint, addr, &args, until).await
            } else {
                requests(&endpoint, addr, &args, until).await
            }
        }));
    }
    let mut total = Tally::default();
    for l in loops {
        let t = l.await.context("a load loop panicked")?;
        total.ok += t.ok;
        total.latency.merge(&t.latency);
        total.errors.merge(&t.errors);
    }
    let elapsed = started.elapsed().as_secs_f64();
    endpoint.close(0u32.into(), b"done");
    Ok(H3Report {
        mode: if args.handshakes { "handshakes" } else { "requests" },
        connections: args.connections,
        streams: if args.handshakes { 1 } else { args.streams },
        duration_s: (elapsed * 1000.0).round() / 1000.0,
        ok: total.ok,
        per_s: (total.ok as f64 / elapsed * 10.0).round() / 10.0,
        latency_us: total.latency.summary(),
        errors: total.errors,
    })
}

/// A client endpoint trusting `--ca` (PEM), offering ALPN `h3`.
fn client_endpoint(args: &H3Args) -> anyhow::Result<quinn::Endpoint> {
    let pem = std::fs::read(&args.ca).with_context(|| format!("reading {}", args.ca.display()))?;
    let mut roots = rustls::RootCertStore::empty();
    use rustls::pki_types::pem::PemObject;
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(&pem) {
        roots.add(cert.context("a certificate in --ca")?)?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots)
        .with_no_client_auth();
    tls.alpn_protocols = vec![b"h3".to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls)?;
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse()?)?;
    endpoint.set_default_client_config(quinn::ClientConfig::new(Arc::new(crypto)));
    Ok(endpoint)
}

type Sender = h3::client::SendRequest<h3_quinn::OpenStreams, Bytes>;

/// A connection ready for requests (its driver spawned).
async fn connect(
    endpoint: &quinn::Endpoint,
    addr: SocketAddr,
    name: &str,
) -> anyhow::Result<(Sender, quinn::Connection)> {
    let conn = endpoint.connect(addr, name)?.await.context("QUIC handshake")?;
    let (mut driver, sender) =
        h3::client::new(h3_quinn::Connection::new(conn.clone())).await.context("HTTP/3 setup")?;
    tokio::spawn(async move {
        let _ = std::future::poll_fn(|cx| driver.poll_close(cx)).await;
    });
    Ok((sender, conn))
}

/// One GET, its answer read to the end; whether it was a 2xx.
async fn get(sender: &mut Sender, uri: &http::Uri) -> anyhow::Result<bool> {
    let req = http::Request::get(uri.clone()).body(())?;
    let mut stream = sender.send_request(req).await?;
    stream.finish().await?;
    let resp = stream.recv_response().await?;
    while let Some(mut chunk) = stream.recv_data().await? {
        chunk.advance(chunk.remaining());
    }
    Ok(resp.status().is_success())
}

fn uri(args: &H3Args) -> anyhow::Result<http::Uri> {
    Ok(format!("https://{}{}", args.server_name, args.path).parse()?)
}

/// `--streams` closed loops over one connection.
async fn requests(endpoint: &quinn::Endpoint, addr: SocketAddr, args: &H3Args, until: Instant) -> Tally {
    let mut tally = Tally::default();
    let (sender, uri) = match (connect(endpoint, addr, &args.server_name).await, uri(args)) {
        (Ok((s, _)), Ok(u)) => (s, u),
        (Err(e), _) | (_, Err(e)) => {
            tally.errors.bump(format!("connect: {e:#}"));
            return tally;
        }
    };
    let mut streams = Vec::new();
    for _ in 0..args.streams {
        let (mut sender, uri) = (sender.clone(), uri.clone());
        streams.push(tokio::spawn(async move {
            let mut t = Tally::default();
            // At least one request each, however long connecting took.
            loop {
                let start = Instant::now();
                match get(&mut sender, &uri).await {
                    Ok(true) => {
                        t.ok += 1;
                        t.latency.record(start.elapsed());
                    }
                    Ok(false) => t.errors.bump("status"),
                    Err(e) => {
                        t.errors.bump(format!("{e:#}"));
                        break;
                    }
                }
                if Instant::now() >= until {
                    break;
                }
            }
            t
        }));
    }
    for s in streams {
        if let Ok(t) = s.await {
            tally.ok += t.ok;
            tally.latency.merge(&t.latency);
            tally.errors.merge(&t.errors);
        }
    }
    tally
}

/// New connections, one GET each, until the end.
async fn handshakes(endpoint: &quinn::Endpoint, addr: SocketAddr, args: &H3Args, until: Instant) -> Tally {
    let mut tally = Tally::default();
    let Ok(uri) = uri(args) else {
        tally.errors.bump("bad --server-name or --path");
        return tally;
    };
    while Instant::now() < until {
        let start = Instant::now();
        let answered = async {
            let (mut sender, conn) = connect(endpoint, addr, &args.server_name).await?;
            let got = get(&mut sender, &uri).await;
            conn.close(0u32.into(), b"done");
            got
        };
        match answered.await {
            Ok(true) => {
                tally.ok += 1;
                tally.latency.record(start.elapsed());
            }
            Ok(false) => tally.errors.bump("status"),
            Err(e) => tally.errors.bump(format!("{e:#}")),
        }
    }
    tally
}
