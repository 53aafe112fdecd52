//! Starting processes and talking HTTP to them.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

pub const TOKEN: &str = "e2e-secret-token-0123456789abcdef0123";

/// A loopback port that refuses connections: bound, never listening, and
/// kept bound while this lives, so that no listener of a test running
/// beside can take it (a released port could be given to the next bind).
pub struct DownPort {
    _socket: tokio::net::TcpSocket,
    /// The port's address.
    pub addr: SocketAddr,
}

impl DownPort {
    /// Binds one.
    pub fn new() -> DownPort {
        DownPort::at(SocketAddr::from(([127, 0, 0, 1], 0)))
    }

    /// Binds `addr`, the port of a backend just stopped (its connections'
    /// `TIME_WAIT` do not stand in the way).
    pub fn at(addr: SocketAddr) -> DownPort {
        let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
        socket.set_reuseaddr(true).expect("SO_REUSEADDR");
        socket.bind(addr).unwrap_or_else(|e| panic!("{addr} taken by another test as soon as it was free: {e}"));
        let addr = socket.local_addr().expect("local address");
        DownPort { _socket: socket, addr }
    }
}

/// Where the workspace's binaries are (the emulator among them).
pub fn bin_dir() -> PathBuf {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_tidegate"));
    exe.parent().expect("binary has a directory").to_path_buf()
}

/// Spawns `cmd`, reads its first stdout line, and kills it on drop.
pub fn spawn_reading_first_line(mut cmd: Command) -> (Child, String) {
    cmd.stdout(Stdio::piped()).stderr(Stdio::inherit());
    let mut child = cmd.spawn().expect("spawn");
    let stdout = child.stdout.take().expect("stdout");
    let mut reader = BufReader::new(stdout);
    let mut line = String::new();
    reader.read_line(&mut line).expect("read first line");
    // Keep draining stdout so the child never blocks on a full pipe.
    std::thread::spawn(move || for _ in reader.lines() {});
    (child, line.trim().to_string())
}

/// A running Tidegate.
pub struct Tidegate {
    child: Child,
    pub proxy: SocketAddr,
    /// The TLS listener, when started with `--listen-tls`.
    pub proxy_tls: Option<SocketAddr>,
    pub admin: SocketAddr,
    pub data_dir: PathBuf,
}

impl Tidegate {
    pub fn start(data_dir: &Path) -> Tidegate {
        Self::start_with(data_dir, &[])
    }

    pub fn start_with(data_dir: &Path, extra: &[&str]) -> Tidegate {
        Self::start_wrapped(data_dir, &[], extra)
    }

    /// Starts Tidegate through `wrapper` (a program that execs its
    /// arguments, such as `prlimit --nofile=1024:`), if any.
    pub fn start_wrapped(data_dir: &Path, wrapper: &[&str], extra: &[&str]) -> Tidegate {
        Self::start_with_env(data_dir, wrapper, extra, &[])
    }

    /// [`Tidegate::start_wrapped`] with more environment variables.
    pub fn start_with_env(data_dir: &Path, wrapper: &[&str], extra: &[&str], env: &[(&str, &str)]) -> Tidegate {
        let mut cmd = match wrapper.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(env!("CARGO_BIN_EXE_tidegate"));
                c
            }
            None => Command::new(env!("CARGO_BIN_EXE_tidegate")),
        };
        cmd.args(["serve", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--workers", "2"])
            .arg("--data-dir")
            .arg(data_dir)
            .args(extra)
            .env("TIDEGATE_ADMIN_TOKEN", TOKEN)
            .env("TIDEGATE_LOG", "warn")
            .envs(env.iter().copied());
        let (child, line) = spawn_reading_first_line(cmd);
        // "tidegate ready proxy=ADDR admin=ADDR revision=N"
        let field = |name: &str| -> SocketAddr {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(name))
                .unwrap_or_else(|| panic!("no {name} in {line:?}"))
                .parse()
                .expect("address")
        };
        let proxy_tls = line.contains("proxy_tls=").then(|| field("proxy_tls="));
        Tidegate { proxy: field("proxy="), proxy_tls, admin: field("admin="), child, data_dir: data_dir.to_path_buf() }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGTERM: the proxy stops accepting and drains.
    pub fn terminate(&self) {
        let status = Command::new("kill").args(["-TERM", &self.pid().to_string()]).status().expect("run kill");
        assert!(status.success(), "kill -TERM failed");
    }

    /// Waits at most `limit` for the process to exit; its status, or
    /// `None` while it still runs.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let until = std::time::Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            if std::time::Instant::now() >= until {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the process with SIGKILL, no chance to flush anything.
    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.proxy)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.admin)
    }

    /// An admin request with the token; returns status and JSON.
    pub async fn api(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let body = body.map(|v| v.to_string()).unwrap_or_default();
        let r = send(method, &self.admin_url(path), Some(TOKEN), body.into_bytes(), &[]).await;
        let value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
        (r.status, value)
    }

    /// Runs `tidegate ctl` against this instance.
    pub fn ctl(&self, args: &[&str]) -> std::process::Output {
        Command::new(env!("CARGO_BIN_EXE_tidegate"))
            .arg("ctl")
            .arg("--admin")
            .arg(self.admin.to_string())
            .args(args)
            .env("TIDEGATE_ADMIN_TOKEN", TOKEN)
            .output()
            .expect("run ctl")
    }
}

impl Drop for Tidegate {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A backend emulator process.
pub struct Backend {
    child: Child,
    pub addr: SocketAddr,
}

impl Backend {
    pub fn start(name: &str, extra: &[&str]) -> Backend {
        let mut cmd = Command::new(bin_dir().join("tidegate-emulator"));
        if !extra.contains(&"--listen") {
            cmd.args(["--listen", "127.0.0.1:0"]);
        }
        cmd.args(["--threads", "1", "--name", name]).args(extra);
        let (child, line) = spawn_reading_first_line(cmd);
        let addr = line
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected emulator line {line:?} (build it with `cargo build --workspace`)"))
            .parse()
            .expect("address");
        Backend { child, addr }
    }

    /// Stops the backend; what it returns keeps its port refusing
    /// connections while held (released, the port could be a listener of a
    /// test running beside; drop it to start a backend on the port again).
    #[must_use = "the port is free for anyone once this is dropped"]
    pub fn kill(mut self) -> DownPort {
        let _ = self.child.kill();
        let _ = self.child.wait();
        DownPort::at(self.addr)
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub struct Reply {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

thread_local! {
    static CLIENT: Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).pool_idle_timeout(Duration::from_secs(5)).build_http();
}

pub async fn send(method: &str, url: &str, token: Option<&str>, body: Vec<u8>, headers: &[(&str, &str)]) -> Reply {
    try_send(method, url, token, body, headers).await.unwrap_or_else(|e| panic!("{method} {url}: {e}"))
}

pub async fn try_send(
    method: &str,
    url: &str,
    token: Option<&str>,
    body: Vec<u8>,
    headers: &[(&str, &str)],
) -> Result<Reply, String> {
    let mut req = http::Request::builder().method(method).uri(url);
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(Bytes::from(body))).map_err(|e| e.to_string())?;
    let client = CLIENT.with(|c| c.clone());
    let resp = tokio::time::timeout(Duration::from_secs(20), client.request(req))
        .await
        .map_err(|_| "timed out".to_string())?
        .map_err(|e| format!("{e:?}"))?;
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
    Ok(Reply { status, headers, body })
}

pub async fn get(url: &str) -> Reply {
    send("GET", url, None, Vec::new(), &[]).await
}

/// A service over these backends plus a catch-all route to it.
pub async fn route_to(tg: &Tidegate, service: &str, backends: &[&Backend], policy: &str) {
    let list: Vec<Value> = backends
        .iter()
        .enumerate()
        .map(|(i, b)| serde_json::json!({ "id": format!("b{i}"), "addr": b.addr.to_string() }))
        .collect();
    let (s, v) = tg
        .api(
            "PUT",
            &format!("/v1/services/{service}"),
            Some(serde_json::json!({ "policy": { "kind": policy }, "backends": list })),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = tg
        .api(
            "PUT",
            &format!("/v1/routes/{service}"),
            Some(serde_json::json!({ "match": { "path_prefix": "/" }, "service": service })),
        )
        .await;
    assert_eq!(s, 200, "{v}");
}

/// Polls `check` every 100 ms until it returns a value, at most `within`.
pub async fn wait_for<T>(what: &str, within: Duration, mut check: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out after {within:?} waiting until {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Polls `/v1/status` until service `web` passes `check` (5 s at most).
/// Counts are updated just after a client sees its answer, so a test reads
/// them this way rather than once.
pub async fn web_status_until(tg: &Tidegate, what: &str, check: impl Fn(&Value) -> bool) {
    wait_for(what, Duration::from_secs(5), async || {
        let (_, status) = tg.api("GET", "/v1/status", None).await;
        check(&status["services"]["web"]).then_some(())
    })
    .await;
}

/// Polls until `web`'s first backend has `n` requests in flight.
pub async fn in_flight_reaches(tg: &Tidegate, n: u64, what: &str) {
    web_status_until(tg, what, |web| web["backends"][0]["in_flight"].as_u64() == Some(n)).await;
}

/// Polls a backend emulator's own stats until it serves `n` requests at once.
pub async fn emulator_in_flight_reaches(b: &Backend, n: u64) {
    let url = format!("http://{}/_emulator/stats", b.addr);
    wait_for(&format!("{} has {n} requests in flight", b.addr), Duration::from_secs(5), async || {
        let stats: Value = serde_json::from_str(&get(&url).await.text()).ok()?;
        (stats["in_flight"].as_u64() == Some(n)).then_some(())
    })
    .await;
}

/// Which backend answered (the emulator's `x-backend` header).
pub fn served_by(r: &Reply) -> String {
    r.headers.get("x-backend").and_then(|v| v.to_str().ok()).unwrap_or("").to_string()
}

/// Sends raw bytes on a new connection and reads until the peer closes or
/// `wait` passes. Returns what came back.
pub fn raw_exchange(addr: SocketAddr, bytes: &[u8], wait: Duration) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(wait)).expect("timeout");
    s.write_all(bytes).expect("write");
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n) = s.read(&mut buf) {
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Sends raw bytes on a new connection (a watch stream's request) and
/// reads until the event that holds `marker` is whole (the blank line
/// after it), the peer closes, or 20 s pass. Returns what came back.
pub fn read_event(addr: SocketAddr, bytes: &[u8], marker: &str) -> String {
    use std::io::{Read, Write};
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.write_all(bytes).expect("write");
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let whole = |out: &[u8]| {
        let text = String::from_utf8_lossy(out);
        text.find(marker).is_some_and(|at| text[at..].contains("\n\n"))
    };
    while !whole(&out) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        s.set_read_timeout(Some(left)).expect("timeout");
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A client sending GETs to a URL one after another until stopped,
/// counting the answers 200 and the rest (errors included).
pub struct Requests {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    ok: std::sync::Arc<std::sync::atomic::AtomicU64>,
    failed: std::sync::Arc<std::sync::atomic::AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Requests {
    pub fn start(url: String) -> Requests {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
        use std::sync::Arc;
        let stop = Arc::new(AtomicBool::new(false));
        let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let task = {
            let (stop, ok, failed) = (stop.clone(), ok.clone(), failed.clone());
            tokio::spawn(async move {
                while !stop.load(Relaxed) {
                    match try_send("GET", &url, None, Vec::new(), &[]).await {
                        Ok(r) if r.status == 200 => ok.fetch_add(1, Relaxed),
                        other => {
                            eprintln!("request to {url} failed: {:?}", other.map(|r| r.status));
                            failed.fetch_add(1, Relaxed)
                        }
                    };
                }
            })
        };
        Requests { stop, ok, failed, task }
    }

    /// Waits until `n` more requests than now were answered 200.
    pub async fn more(&self, n: u64, what: &str) {
        let seen = self.ok.load(std::sync::atomic::Ordering::Relaxed);
        wait_for(what, Duration::from_secs(10), async || {
            (self.ok.load(std::sync::atomic::Ordering::Relaxed) > seen + n).then_some(())
        })
        .await;
    }

    /// Stops, and gives (answered 200, the rest).
    pub async fn stop(self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        self.stop.store(true, Relaxed);
        self.task.await.expect("the request loop");
        (self.ok.load(Relaxed), self.failed.load(Relaxed))
    }
}

/// One HTTP/2 request (prior knowledge) on a connection of its own:
/// status, headers and body.
pub async fn h2(proxy: SocketAddr, uri: &str, headers: &[(&str, &[u8])]) -> (u16, http::HeaderMap, Bytes) {
    let tcp = tokio::net::TcpStream::connect(proxy).await.expect("connect");
    let (mut client, conn) =
        hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), hyper_util::rt::TokioIo::new(tcp))
            .await
            .expect("h2 handshake");
    tokio::spawn(conn);
    let mut req = http::Request::get(uri);
    for (name, value) in headers {
        req = req.header(*name, http::HeaderValue::from_bytes(value).expect("a header value"));
    }
    let req = req.body(http_body_util::Empty::<Bytes>::new()).expect("a request");
    let resp = tokio::time::timeout(Duration::from_secs(10), client.send_request(req))
        .await
        .expect("an answer in time")
        .expect("a response");
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.expect("the body").to_bytes();
    (parts.status.as_u16(), parts.headers, body)
}
