//! In-process end-to-end tests over real loopback TCP.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::{Args, Emulator};

/// A running in-process emulator.
struct Running {
    addr: SocketAddr,
    stop: oneshot::Sender<()>,
    task: JoinHandle<std::io::Result<()>>,
}

async fn start(flags: &[&str]) -> Running {
    let argv = std::iter::once("tidegate-emulator").chain(flags.iter().copied());
    let args = Args::try_parse_from(argv).expect("flags parse");
    let emulator = Emulator::bind(&args).await.expect("bind");
    let addr = emulator.local_addr().expect("addr");
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(emulator.serve(async {
        let _ = stopped.await;
    }));
    Running { addr, stop, task }
}

/// A parsed HTTP/1.1 response.
struct Reply {
    status: u16,
    head: String,
    body: String,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().skip(1).find_map(|line| {
            let (k, v) = line.split_once(':')?;
            k.eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }
}

/// Sends one request with `Connection: close` and reads the whole reply.
async fn send(addr: SocketAddr, method: &str, target: &str, extra: &str) -> Reply {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let req =
        format!("{method} {target} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n{extra}Content-Length: 0\r\n\r\n");
    stream.write_all(req.as_bytes()).await.expect("write");
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.expect("read");
    let raw = String::from_utf8(raw).expect("utf8 reply");
    let (head, body) = raw.split_once("\r\n\r\n").expect("complete reply");
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).expect("status");
    Reply { status, head: head.to_owned(), body: body.to_owned() }
}

async fn stats(addr: SocketAddr) -> serde_json::Value {
    let reply = send(addr, "GET", "/_emulator/stats", "").await;
    assert_eq!(reply.status, 200);
    serde_json::from_str(&reply.body).expect("stats json")
}

/// Polls stats until `in_flight` reaches `n` (bounded).
async fn wait_in_flight(addr: SocketAddr, n: u64) {
    for _ in 0..200 {
        if stats(addr).await["in_flight"] == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("in_flight never reached {n}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_rejects_and_echoes() {
    let emu = start(&["--name", "b1", "--slots", "1", "--queue", "0", "--orca"]).await;
    let ok = send(emu.addr, "GET", "/", "").await;
    assert_eq!(ok.status, 200);
    assert_eq!(ok.header("x-backend"), Some("b1"));
    assert_eq!(ok.body, "b1\n");
    let orca = ok.header("endpoint-load-metrics").expect("orca header");
    assert!(orca.starts_with("TEXT cpu_utilization=1.000, rps_fractional="), "{orca}");

    let addr = emu.addr;
    let long = tokio::spawn(async move { send(addr, "GET", "/slow?delay_ms=400", "").await });
    wait_in_flight(addr, 1).await;
    let busy = send(addr, "GET", "/", "").await;
    assert_eq!(busy.status, 503);
    assert_eq!(busy.body, "queue full\n");
    assert_eq!(busy.header("x-backend"), Some("b1"));
    // Health and control never take a slot.
    assert_eq!(send(addr, "GET", "/health", "").await.body, "ok");

    let echo = send(addr, "POST", "/echo?x=1", "X-Forwarded-For: 10.0.0.1\r\nX-Multi: a\r\nX-Multi: b\r\n").await;
    let doc: serde_json::Value = serde_json::from_str(&echo.body).expect("echo json");
    assert_eq!(doc["method"], "POST");
    assert_eq!(doc["path"], "/echo?x=1");
    assert_eq!(doc["headers"]["x-forwarded-for"], "10.0.0.1");
    assert_eq!(doc["headers"]["x-multi"], "a, b");

    assert_eq!(long.await.expect("join").status, 200);
    let s = stats(addr).await;
    assert_eq!((s["served"].as_u64(), s["rejected"].as_u64()), (Some(2), Some(1)));
    assert_eq!((s["slots"].as_u64(), s["queued"].as_u64()), (Some(1), Some(0)));
    let _ = emu.stop.send(());
    emu.task.await.expect("join").expect("serve ok");
}

#[tokio::test]
async fn control_api_changes_slots_and_health() {
    let emu = start(&["--health-path", "/ready"]).await;
    let grown = send(emu.addr, "POST", "/_emulator/slots?n=3", "").await;
    assert_eq!(grown.status, 200);
    assert_eq!(stats(emu.addr).await["slots"], 3);
    assert_eq!(send(emu.addr, "POST", "/_emulator/slots", "").await.status, 400);
    assert_eq!(send(emu.addr, "GET", "/_emulator/slots?n=1", "").await.status, 405);
    assert_eq!(send(emu.addr, "GET", "/_emulator/nope", "").await.status, 404);

    assert_eq!(send(emu.addr, "GET", "/ready", "").await.status, 200);
    let down = send(emu.addr, "POST", "/_emulator/health?up=false", "").await;
    assert_eq!(down.status, 200);
    assert_eq!(send(emu.addr, "GET", "/ready", "").await.status, 503);
    send(emu.addr, "POST", "/_emulator/health?up=true", "").await;
    assert_eq!(send(emu.addr, "GET", "/ready", "").await.status, 200);
    let _ = emu.stop.send(());
    emu.task.await.expect("join").expect("serve ok");
}

#[tokio::test]
async fn upgrade_echoes_bytes() {
    let emu = start(&[]).await;
    let mut stream = TcpStream::connect(emu.addr).await.expect("connect");
    let req = "GET /upgrade HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n";
    stream.write_all(req.as_bytes()).await.expect("write");
    let head = read_head(&mut stream).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    assert!(head.to_ascii_lowercase().contains("upgrade: echo"), "{head}");
    stream.write_all(b"hello").await.expect("write");
    let mut got = [0u8; 5];
    stream.read_exact(&mut got).await.expect("echo");
    assert_eq!(&got, b"hello");
    stream.shutdown().await.expect("half close");
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).await.expect("eof");
    assert!(rest.is_empty());
    let plain = send(emu.addr, "GET", "/upgrade", "").await;
    assert_eq!(plain.status, 400);
    let _ = emu.stop.send(());
}

/// Reads up to the end of a response head, byte by byte.
async fn read_head(stream: &mut TcpStream) -> String {
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let byte = stream.read_u8().await.expect("head byte");
        head.push(byte);
    }
    String::from_utf8(head).expect("utf8 head")
}

#[tokio::test]
async fn shutdown_waits_for_in_flight_requests() {
    let emu = start(&[]).await;
    let addr = emu.addr;
    let long = tokio::spawn(async move { send(addr, "GET", "/?delay_ms=200", "").await });
    wait_in_flight(addr, 1).await;
    let _ = emu.stop.send(());
    emu.task.await.expect("join").expect("serve ok");
    assert_eq!(long.await.expect("join").status, 200);
    assert!(TcpStream::connect(addr).await.is_err(), "listener closed");
}
