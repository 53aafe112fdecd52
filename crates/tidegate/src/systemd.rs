//! systemd's two protocols for a service: readiness notification
//! (`sd_notify`: `READY=1`, `MAINPID=`, `STOPPING=1` to `$NOTIFY_SOCKET`)
//! and socket activation (`LISTEN_PID`, `LISTEN_FDS`, `LISTEN_FDNAMES`:
//! listening sockets systemd opened and keeps across restarts).
//!
//! Both are plain environment and datagram protocols, so they work with
//! anything that speaks them (systemd-socket-activate, s6, a container
//! runtime), and cost nothing without them.

use std::net::{SocketAddr, TcpListener};

use anyhow::{bail, Context};
use tidegate_takeover::Kind;

use crate::cli::ServeArgs;
use crate::takeover::Received;

/// Sends `state` (newline-separated `KEY=VALUE` assignments) to the
/// service manager, if one listens (`$NOTIFY_SOCKET`); a manager that does
/// not is not an error worth more than a debug line.
pub fn notify(state: &str) {
    let Some(socket) = std::env::var_os("NOTIFY_SOCKET") else { return };
    if let Err(e) = send(&socket, state) {
        tracing::debug!(error = %e, socket = ?socket, "cannot notify the service manager");
    }
}

fn send(socket: &std::ffi::OsStr, state: &str) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::net::UnixDatagram;
    let sender = UnixDatagram::unbound()?;
    match socket.as_bytes() {
        // An abstract socket: `@name`.
        [b'@', name @ ..] => {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
            sender.send_to_addr(state.as_bytes(), &addr)?;
        }
        _ => {
            sender.send_to(state.as_bytes(), socket)?;
        }
    }
    Ok(())
}

/// The listening sockets systemd passed (socket activation), sorted by
/// use: by name (`FileDescriptorName=proxy`, `proxy_tls`, `admin`,
/// `metrics`), or for an unnamed one by its address matched against the
/// flags. `None` when this process was not socket-activated. A proxy
/// socket alone serves every worker (each accepts from it).
pub fn activated(args: &ServeArgs, workers: usize) -> anyhow::Result<Option<Received>> {
    let names: Vec<String> =
        std::env::var("LISTEN_FDNAMES").map(|n| n.split(':').map(str::to_string).collect()).unwrap_or_default();
    // Reads LISTEN_PID and LISTEN_FDS (only if LISTEN_PID is this
    // process) and removes them, so that no child takes them for its own.
    let mut fds = listenfd::ListenFd::from_env();
    if fds.len() == 0 {
        return Ok(None);
    }
    let mut received = Received::default();
    for i in 0..fds.len() {
        let socket = fds
            .take_tcp_listener(i)
            .with_context(|| format!("socket activation: descriptor {} is not a listening TCP socket", i + 3))?
            .with_context(|| format!("socket activation: descriptor {} was already taken", i + 3))?;
        let addr = socket.local_addr().context("socket activation: a socket's address")?;
        let name = names.get(i).map(String::as_str).unwrap_or("");
        let kind = kind_of(name, addr, args)?;
        tracing::info!(kind = %kind, %addr, "listening on a socket from the service manager");
        match kind {
            Kind::Proxy => received.plain.push(socket),
            Kind::ProxyTls => received.tls.push(socket),
            Kind::Admin => received.admin = Some(socket),
            Kind::Metrics => received.metrics = Some(socket),
            Kind::Named => received.named.push(socket),
        }
    }
    for set in [&mut received.plain, &mut received.tls] {
        widen(set, workers)?;
    }
    Ok(Some(received))
}

/// What a passed socket is for: its name says, else its address matches
/// one flag's.
fn kind_of(name: &str, addr: SocketAddr, args: &ServeArgs) -> anyhow::Result<Kind> {
    let named = match name {
        "proxy" => Some(Kind::Proxy),
        "proxy_tls" => Some(Kind::ProxyTls),
        "admin" => Some(Kind::Admin),
        "metrics" => Some(Kind::Metrics),
        "named" => Some(Kind::Named),
        _ => None,
    };
    if let Some(kind) = named {
        return Ok(kind);
    }
    let flags = [
        (Kind::Proxy, args.listen),
        (Kind::ProxyTls, args.listen_tls),
        (Kind::Admin, Some(args.admin)),
        (Kind::Metrics, args.metrics_listen),
    ];
    let matching = flags.iter().find(|(_, flag)| flag.is_some_and(|f| f.ip() == addr.ip() && f.port() == addr.port()));
    match matching {
        Some((kind, _)) => Ok(*kind),
        None => bail!(
            "socket activation: the socket on {addr} (name {name:?}) matches no listener flag; name it \
             (FileDescriptorName=proxy, proxy_tls, admin or metrics) or give its address to --listen, \
             --listen-tls, --admin or --metrics-listen"
        ),
    }
}

/// One socket per worker: a single passed socket is shared (each worker
/// accepts from its own copy of the descriptor).
fn widen(set: &mut Vec<TcpListener>, workers: usize) -> anyhow::Result<()> {
    if set.len() == 1 {
        for _ in 1..workers {
            let copy = set[0].try_clone().context("socket activation: sharing a socket between workers")?;
            set.push(copy);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn serve_args(flags: &[&str]) -> ServeArgs {
        let mut argv = vec!["tidegate", "serve"];
        argv.extend_from_slice(flags);
        match crate::cli::Cli::parse_from(argv).command {
            crate::cli::Command::Serve(args) => *args,
            _ => unreachable!("serve"),
        }
    }

    #[test]
    fn a_socket_is_known_by_its_name_or_else_by_its_address() {
        let args = serve_args(&["--listen", "127.0.0.1:8080", "--admin", "127.0.0.1:9900"]);
        let at = |s: &str| s.parse::<SocketAddr>().expect("addr");
        assert_eq!(kind_of("admin", at("127.0.0.1:8080"), &args).expect("named"), Kind::Admin);
        assert_eq!(kind_of("", at("127.0.0.1:8080"), &args).expect("by address"), Kind::Proxy);
        assert_eq!(kind_of("unknown", at("127.0.0.1:9900"), &args).expect("by address"), Kind::Admin);
        let e = kind_of("web", at("127.0.0.1:1234"), &args).expect_err("no match");
        assert!(e.to_string().contains("127.0.0.1:1234") && e.to_string().contains("FileDescriptorName"), "{e}");
    }

    #[test]
    fn a_notification_reaches_a_listening_manager_on_a_path_or_an_abstract_name() {
        use std::os::unix::net::UnixDatagram;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("notify");
        let manager = UnixDatagram::bind(&path).expect("bind");
        send(path.as_os_str(), "READY=1").expect("sent");
        let mut buf = [0u8; 64];
        let n = manager.recv(&mut buf).expect("received");
        assert_eq!(&buf[..n], b"READY=1");

        use std::os::linux::net::SocketAddrExt;
        let name = format!("tidegate-test-{}", std::process::id());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).expect("name");
        let manager = UnixDatagram::bind_addr(&addr).expect("bind");
        send(std::ffi::OsStr::new(&format!("@{name}")), "STOPPING=1").expect("sent");
        let n = manager.recv(&mut buf).expect("received");
        assert_eq!(&buf[..n], b"STOPPING=1");
    }
}
