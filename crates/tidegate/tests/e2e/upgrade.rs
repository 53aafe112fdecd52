//! `tidegate upgrade` and systemd's protocols: the upgrade starts the new
//! binary with the running instance's flags and environment and returns
//! once it serves; a new binary that fails leaves the old one serving;
//! the service manager hears the new main process (`MAINPID=`); and a
//! socket-activated Tidegate serves a connection that waited in the
//! manager's socket before it started.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::*;

/// Runs `tidegate upgrade` with its output in files (the new process
/// inherits them and outlives the command); its status, standard output
/// and error.
fn upgrade(data_dir: &Path, extra: &[&str]) -> (std::process::ExitStatus, String, String) {
    let out_dir = tempfile::tempdir().expect("tempdir");
    let (out, err) = (out_dir.path().join("out"), out_dir.path().join("err"));
    let status = Command::new(env!("CARGO_BIN_EXE_tidegate"))
        .arg("upgrade")
        .arg("--data-dir")
        .arg(data_dir)
        .args(extra)
        .stdout(std::fs::File::create(&out).expect("out"))
        .stderr(std::fs::File::create(&err).expect("err"))
        .status()
        .expect("run tidegate upgrade");
    let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
    (status, read(&out), read(&err))
}

/// Whether process `pid` has exited (gone, or a zombie nobody reaped).
fn gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('Z')),
    }
}

async fn until_gone(pid: u32) {
    wait_for(&format!("process {pid} exits"), Duration::from_secs(30), async || gone(pid).then_some(())).await;
}

/// A process this test did not spawn itself (the upgrade did): stopped by
/// its pid, and waited for.
async fn stop(pid: u32) {
    let _ = Command::new("kill").args(["-TERM", &pid.to_string()]).status();
    until_gone(pid).await;
}

/// The next notification the service manager's socket received.
fn next_notification(manager: &UnixDatagram) -> String {
    let mut buf = [0u8; 512];
    let n = manager.recv(&mut buf).expect("a notification within the timeout");
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

fn main_pid(notification: &str) -> u32 {
    notification
        .lines()
        .find_map(|l| l.strip_prefix("MAINPID="))
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no MAINPID in {notification:?}"))
}

/// The systemd `ExecReload=tidegate upgrade` path, minus systemd: the
/// running instance was started with `NOTIFY_SOCKET` and a token in its
/// environment; the new process gets both, says it is the main process
/// now, serves the same configuration on the same sockets, and the old
/// one exits without telling the manager it stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_starts_the_new_binary_with_the_same_flags_and_returns_once_it_serves() {
    let dir = tempfile::tempdir().expect("tempdir");
    let notify = dir.path().join("notify");
    let manager = UnixDatagram::bind(&notify).expect("bind the manager's socket");
    manager.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
    let data = dir.path().join("data");
    let notify_env = notify.to_str().expect("utf-8");
    let mut old = Tidegate::start_with_env(&data, &[], &[], &[("NOTIFY_SOCKET", notify_env)]);
    let first = next_notification(&manager);
    assert!(first.contains("READY=1"), "{first}");
    assert_eq!(main_pid(&first), old.pid());
    let backend = Backend::start("b", &[]);
    route_to(&old, "web", &[&backend], "round_robin").await;

    let proxy = old.proxy;
    let (status, out, err) = upgrade(&data, &[]);
    assert!(status.success(), "stdout {out:?}, stderr {err:?}");
    let line = out.lines().find(|l| l.starts_with("upgraded:")).unwrap_or_else(|| panic!("{out:?}"));
    let new_pid: u32 = line
        .split("-> ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no new pid in {line:?}"));
    assert!(line.contains(&format!("pid {} ->", old.pid())), "{line}");
    let second = next_notification(&manager);
    assert!(second.contains("READY=1"), "{second}");
    assert_eq!(main_pid(&second), new_pid, "the new process says it is the main process");
    // The old one drains and exits by itself.
    let exited = tokio::task::spawn_blocking(move || old.wait_exit(Duration::from_secs(30))).await.expect("join");
    assert!(exited.is_some_and(|s| s.success()), "{exited:?}");
    manager.set_nonblocking(true).expect("nonblocking");
    let mut buf = [0u8; 512];
    let after = manager.recv(&mut buf).map(|n| String::from_utf8_lossy(&buf[..n]).into_owned());
    assert!(after.is_err(), "the old process told the manager something after the hand-over: {after:?}");

    // The same sockets, the same configuration, and the token from the
    // old process's environment.
    let r = get(&format!("http://{proxy}/")).await;
    assert_eq!((r.status, served_by(&r)), (200, "b".to_string()));
    stop(new_pid).await;
}

/// A new binary that fails before serving (here `/bin/false`) leaves the
/// old instance serving, and the command says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_upgrade_leaves_the_running_instance_serving() {
    let data = tempfile::tempdir().expect("tempdir");
    let mut old = Tidegate::start(data.path());
    let backend = Backend::start("b", &[]);
    route_to(&old, "web", &[&backend], "round_robin").await;
    let (status, out, err) = upgrade(data.path(), &["--binary", "/bin/false"]);
    assert!(!status.success(), "stdout {out:?}");
    assert!(err.contains("exited") && err.contains(&format!("(pid {}) keeps serving", old.pid())), "{err}");
    assert!(old.wait_exit(Duration::ZERO).is_none(), "the old process still runs");
    let r = get(&old.url("/")).await;
    assert_eq!((r.status, served_by(&r)), (200, "b".to_string()));
    // Nothing serves another data directory.
    let empty = tempfile::tempdir().expect("tempdir");
    let (status, _, err) = upgrade(empty.path(), &[]);
    assert!(!status.success());
    assert!(err.contains("no running instance"), "{err}");
}

/// Socket activation through systemd's own `systemd-socket-activate`: it
/// listens, starts Tidegate at the first connection with the socket
/// (named `proxy`), and that connection, which waited in the socket's
/// queue while Tidegate started, is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_socket_activated_instance_serves_the_connection_that_woke_it() {
    let activate = ["/usr/bin/systemd-socket-activate", "/bin/systemd-socket-activate"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("systemd-socket-activate (Debian's systemd package; scripts/test installs it)");
    let data = tempfile::tempdir().expect("tempdir");
    // A free port: systemd-socket-activate takes an address, not port 0.
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
    let listen = format!("127.0.0.1:{port}");
    let mut child = Command::new(activate)
        .args(["--listen", &listen, "--fdname=proxy"])
        .arg(env!("CARGO_BIN_EXE_tidegate"))
        .args(["serve", "--admin", "127.0.0.1:0", "--workers", "2", "--data-dir"])
        .arg(data.path())
        .env("TIDEGATE_ADMIN_TOKEN", TOKEN)
        .env("TIDEGATE_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn systemd-socket-activate");
    // Wait until it listens (it starts Tidegate at the first connection).
    let started = Instant::now();
    let mut client = loop {
        match std::net::TcpStream::connect(&listen) {
            Ok(c) => break c,
            Err(_) if started.elapsed() < Duration::from_secs(20) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => panic!("systemd-socket-activate does not listen on {listen}: {e}"),
        }
    };
    client.write_all(b"GET /healthz-none HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").expect("write");
    client.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    let mut answer = String::new();
    client.read_to_string(&mut answer).expect("an answer");
    assert!(answer.starts_with("HTTP/1.1 404"), "{answer:?}");
    let mut ready = String::new();
    BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut ready).expect("ready line");
    assert!(ready.contains(&format!("proxy={listen}")), "{ready:?}");
    let _ = child.kill();
    let _ = child.wait();
}

/// The processes whose command line serves `data_dir`.
fn serving(data_dir: &Path) -> Vec<u32> {
    let dir = data_dir.to_string_lossy().into_owned();
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
        if args.contains(&dir.as_bytes()) && args.contains(&&b"serve"[..]) && !gone(pid) {
            pids.push(pid);
        }
    }
    pids
}

/// `SIGUSR2` is the upgrade from inside (nginx's signal): the running
/// process starts the binary it was started from with its own flags and
/// `--takeover`, which serves the same sockets and configuration; the old
/// one exits by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigusr2_replaces_the_process_with_the_binary_at_its_path() {
    let data = tempfile::tempdir().expect("tempdir");
    let mut old = Tidegate::start(data.path());
    let backend = Backend::start("b", &[]);
    route_to(&old, "web", &[&backend], "round_robin").await;
    let (old_pid, proxy) = (old.pid(), old.proxy);
    let status = Command::new("kill").args(["-USR2", &old_pid.to_string()]).status().expect("kill");
    assert!(status.success());
    let exited = tokio::task::spawn_blocking(move || old.wait_exit(Duration::from_secs(30))).await.expect("join");
    assert!(exited.is_some_and(|s| s.success()), "the old process exits by itself: {exited:?}");
    let r = get(&format!("http://{proxy}/")).await;
    assert_eq!((r.status, served_by(&r)), (200, "b".to_string()));
    let pids = serving(data.path());
    assert_eq!(pids.len(), 1, "one process serves the data directory: {pids:?}");
    assert_ne!(pids[0], old_pid);
    stop(pids[0]).await;
}
