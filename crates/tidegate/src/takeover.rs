//! `serve --takeover`: the two sides of a hand-over as `serve` runs them,
//! on the protocol of `tidegate-takeover`.
//!
//! The successor ([`take_over`]) receives the sockets and, with an
//! embedded store, opens the store the running instance closed; the
//! running instance ([`Offering`]) listens on `DATA_DIR/takeover.sock` in
//! a thread of its own, and when a successor serves, tells `serve` to stop
//! accepting, drain and exit.

use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tidegate_control::Control;
use tidegate_takeover::{
    Description, Drain, Hello, Kind, ListenerInfo, Listening, Predecessor, Request, Successor, TakeoverError, Timeouts,
};

use crate::cli::ServeArgs;

/// How often a draining predecessor reports its open connections.
pub const DRAIN_REPORTS: Duration = Duration::from_millis(250);

/// A predecessor silent this long is waited for again (it reports every
/// [`DRAIN_REPORTS`]; its channel closing is what ends the wait).
const DRAIN_SILENCE: Duration = Duration::from_secs(5);

/// How long a running instance whose successor failed keeps trying to
/// open its store again (the successor's lock goes when it exits).
const TAKE_BACK_WITHIN: Duration = Duration::from_secs(15);

/// The sockets a successor received, sorted by use.
#[derive(Debug, Default)]
pub struct Received {
    /// The proxy's plain listeners (its `SO_REUSEPORT` group).
    pub plain: Vec<std::net::TcpListener>,
    /// The proxy's TLS listeners.
    pub tls: Vec<std::net::TcpListener>,
    /// The admin API's.
    pub admin: Option<std::net::TcpListener>,
    /// The separate `/metrics` listener's.
    pub metrics: Option<std::net::TcpListener>,
    /// The named listeners' (served again if the configuration still has
    /// them).
    pub named: Vec<std::net::TcpListener>,
}

/// The successor's side, between the store and serving.
pub struct Taking {
    successor: Successor,
    /// The sockets.
    pub received: Received,
    /// The running instance's process id (0 if it did not say).
    pub pid: u32,
    /// Its lease in a shared store (cluster mode), to go on with.
    pub lease: Option<i64>,
}

/// Connects to the instance serving `args.data_dir` and receives its
/// sockets; with an embedded store, the running instance has committed
/// what it had queued and closed the store when this returns. The sockets
/// must match the flags (a listener for each address given).
pub fn take_over(args: &ServeArgs) -> anyhow::Result<Taking> {
    let path = tidegate_takeover::socket_path(&args.data_dir);
    let mut successor = Successor::connect(&path, Timeouts::default()).context("--takeover")?;
    let offer = successor.request(args.store.is_none(), true).context("--takeover")?;
    if args.store.is_none() && !offer.store_released {
        successor.refuse("the new process uses the embedded store, but it was not released");
        bail!("--takeover: the running instance uses another store (etcd?) than this one (the embedded store in {}): give the same --store", args.data_dir.display());
    }
    let (pid, offer_lease) = (offer.pid, offer.lease);
    let mut received = Received::default();
    let mut addrs: Vec<ListenerInfo> = Vec::new();
    for (info, fd) in offer.listeners {
        let socket = std::net::TcpListener::from(fd);
        addrs.push(info);
        match info.kind {
            Kind::Proxy => received.plain.push(socket),
            Kind::ProxyTls => received.tls.push(socket),
            Kind::Admin => received.admin = Some(socket),
            Kind::Metrics => received.metrics = Some(socket),
            Kind::Named => received.named.push(socket),
        }
    }
    tracing::info!(sockets = addrs.len(), "took the running instance's listening sockets over");
    let plain_wanted = args.listen.is_some() || args.listen_tls.is_none();
    let mismatch = [
        (Kind::Proxy, plain_wanted, !received.plain.is_empty(), args.listen),
        (Kind::ProxyTls, args.listen_tls.is_some(), !received.tls.is_empty(), args.listen_tls),
        (Kind::Admin, true, received.admin.is_some(), Some(args.admin)),
        (Kind::Metrics, args.metrics_listen.is_some(), received.metrics.is_some(), args.metrics_listen),
    ]
    .into_iter()
    .find_map(|(kind, wanted, got, flag)| {
        let held = addrs.iter().find(|i| i.kind == kind).map(|i| i.addr);
        match (wanted, got) {
            (true, false) => Some(format!("the running instance has no {kind} listener; this one was asked for one")),
            (false, true) => Some(format!(
                "the running instance has a {kind} listener on {}; give this process the same flag",
                held.map_or_else(String::new, |a| a.to_string())
            )),
            _ => differs(flag, held).map(|(want, have)| {
                format!("the {kind} listener is on {have}, not {want}: give the running instance's address")
            }),
        }
    });
    if let Some(reason) = mismatch {
        successor.refuse(&reason);
        bail!("--takeover: {reason}; the running instance keeps serving");
    }
    Ok(Taking { successor, received, pid, lease: offer_lease })
}

/// A flag's address that differs from the socket's (a port 0 in the flag
/// matches any port).
fn differs(flag: Option<SocketAddr>, held: Option<SocketAddr>) -> Option<(SocketAddr, SocketAddr)> {
    let (want, have) = (flag?, held?);
    let same = want.ip() == have.ip() && (want.port() == 0 || want.port() == have.port());
    (!same).then_some((want, have))
}

impl Taking {
    /// Refuses to go on (the store did not open, say): the running
    /// instance takes its store back and keeps serving.
    pub fn refuse(self, reason: &str) {
        self.successor.refuse(reason);
    }

    /// Says it holds the sockets and the store; returns once told to go,
    /// with what the running instance learned about its backends (`None`
    /// from an instance that does not send it, or sent something this
    /// binary cannot read: it then learns from scratch).
    pub fn ready(&mut self) -> anyhow::Result<Option<tidegate_snapshot::Memory>> {
        let learned = self.successor.ready().context("--takeover")?;
        Ok(learned.and_then(|state| match serde_json::from_value(state) {
            Ok(memory) => Some(memory),
            Err(e) => {
                tracing::warn!(error = %e, "the running instance's learned state does not read; learning from scratch");
                None
            }
        }))
    }

    /// Says it serves: the running instance stops accepting and drains;
    /// its reports on the drain go to `report` (from a thread of their own).
    pub fn serving(self, report: Arc<tidegate_admin::PredecessorReport>) -> anyhow::Result<()> {
        let mut watching = self.successor.serving().context("--takeover: telling the running instance to stop")?;
        std::thread::Builder::new()
            .name("tidegate-predecessor".into())
            .spawn(move || loop {
                match watching.next(DRAIN_SILENCE) {
                    Ok(Drain::Draining(n)) => report.draining(n),
                    Ok(Drain::Drained { cut }) => {
                        report.exited(cut);
                        tracing::info!(cut, "the previous instance finished draining");
                        return;
                    }
                    Err(TakeoverError::Timeout { .. }) => continue,
                    Err(e) => {
                        tracing::info!(error = %e, "the previous instance stopped reporting its drain");
                        report.gone();
                        return;
                    }
                }
            })
            .context("starting the thread that follows the previous instance's drain")?;
        Ok(())
    }
}

/// Every socket an instance listens on, duplicated, for a successor: kept
/// until the instance stops.
#[derive(Clone, Default)]
pub struct Sockets(Arc<Mutex<Vec<(ListenerInfo, OwnedFd)>>>, Arc<Mutex<Option<tidegate_proxy::NamedSockets>>>);

impl Sockets {
    /// Offers the named listeners' sockets too, as they are when a
    /// successor asks.
    pub fn with_named(&self, named: tidegate_proxy::NamedSockets) {
        *self.1.lock().unwrap_or_else(|p| p.into_inner()) = Some(named);
    }

    /// Duplicates of the named listeners' sockets served now.
    fn named(&self) -> Vec<(ListenerInfo, OwnedFd)> {
        let named = self.1.lock().unwrap_or_else(|p| p.into_inner()).clone();
        named.map_or_else(Vec::new, |n| {
            n.offer().into_iter().map(|(addr, fd)| (ListenerInfo { kind: Kind::Named, addr }, fd)).collect()
        })
    }

    /// Keeps a duplicate of `socket` for a successor.
    pub fn add(&self, kind: Kind, addr: SocketAddr, socket: BorrowedFd<'_>) -> anyhow::Result<()> {
        let fd = socket.try_clone_to_owned().with_context(|| format!("duplicating the {kind} listener"))?;
        self.0.lock().unwrap_or_else(|p| p.into_inner()).push((ListenerInfo { kind, addr }, fd));
        Ok(())
    }

    /// Drops the duplicates: at a shutdown, so the sockets close when the
    /// servers stop accepting (connections are then refused, not left to
    /// wait in a queue nobody takes from).
    pub fn clear(&self) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

/// How this process was started: its executable (read now: call this
/// before a package could replace the file), working directory, arguments
/// and the environment a successor needs.
pub fn this_process() -> Description {
    let env = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .filter(|(k, _)| k.starts_with("TIDEGATE_") || k == "NOTIFY_SOCKET")
        .collect();
    // Arguments that are not UTF-8 cannot be described: `tidegate
    // upgrade` then refuses (the description has none).
    let args = std::env::args_os().skip(1).map(|a| a.into_string()).collect::<Result<Vec<_>, _>>().unwrap_or_default();
    Description {
        pid: std::process::id(),
        exe: std::env::current_exe().ok(),
        cwd: std::env::current_dir().ok(),
        args,
        env,
    }
}

/// The successor this instance handed over to, once it serves: the drain
/// is reported to it.
#[derive(Clone, Default)]
pub struct SuccessorLink(Arc<Mutex<Option<Predecessor>>>);

impl SuccessorLink {
    /// Reports the drain to the successor, if there is one, every
    /// [`DRAIN_REPORTS`] while `drain` runs (it returns the connections
    /// the drain timeout cut); then says it is done.
    pub fn report_while(&self, open: tidegate_proxy::OpenConnections, drain: impl FnOnce() -> u64) {
        let Some(mut successor) = self.0.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            drain();
            return;
        };
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let reporter = std::thread::Builder::new().name("tidegate-drain-report".into()).spawn(move || loop {
            if successor.draining(open.count()).is_err() {
                return None;
            }
            match done_rx.recv_timeout(DRAIN_REPORTS) {
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
                _ => return Some(successor),
            }
        });
        let cut = drain();
        drop(done_tx);
        if let Some(successor) = reporter.ok().and_then(|t| t.join().ok()).flatten() {
            let _ = successor.drained(cut);
        }
    }
}

/// The running instance's side: a thread listening for a successor.
pub struct Offering {
    _thread: std::thread::JoinHandle<()>,
    path: PathBuf,
    /// A successor was told to go: the path is its own now.
    gave_path: Arc<AtomicBool>,
}

impl Drop for Offering {
    /// The thread waits in `accept` until the process exits: the socket's
    /// file goes here, unless a successor listens there now.
    fn drop(&mut self) {
        if !self.gave_path.load(Ordering::Acquire) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

impl Offering {
    /// Listens on `DATA_DIR/takeover.sock` for successors; `handed_over`
    /// is set once one serves. `embedded`: the store is this data
    /// directory's own, to close for the successor.
    pub fn start(
        data_dir: &Path,
        control: Control,
        sockets: Sockets,
        embedded: bool,
        description: Description,
        link: SuccessorLink,
        handed_over: tokio::sync::watch::Sender<bool>,
    ) -> anyhow::Result<Offering> {
        let path = tidegate_takeover::socket_path(data_dir);
        let listening = Listening::bind(&path)?;
        let gave_path = Arc::new(AtomicBool::new(false));
        let side = Side {
            path: path.clone(),
            listening: Some(listening),
            control,
            sockets,
            embedded,
            description,
            gave_path: gave_path.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("tidegate-takeover".into())
            .spawn(move || {
                let mut side = side;
                if let Some(successor) = side.serve() {
                    *link.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(successor);
                    let _ = handed_over.send(true);
                }
            })
            .context("starting the takeover thread")?;
        Ok(Offering { _thread: thread, path, gave_path })
    }
}

/// The running instance's state for hand-overs.
struct Side {
    path: PathBuf,
    /// None between the successor's ready and its serving: the successor
    /// listens at the path then.
    listening: Option<Listening>,
    control: Control,
    sockets: Sockets,
    embedded: bool,
    /// How this process was started, for `tidegate upgrade`.
    description: Description,
    /// Set when a successor is told to go (see [`Offering`]'s drop).
    gave_path: Arc<AtomicBool>,
}

impl Side {
    /// Takes successors one at a time until one serves (its end of the
    /// channel, for the drain's reports), or the socket cannot be listened
    /// on any more (`None`).
    fn serve(&mut self) -> Option<Predecessor> {
        loop {
            if self.listening.is_none() {
                self.gave_path.store(false, Ordering::Release);
                match Listening::bind(&self.path) {
                    Ok(l) => self.listening = Some(l),
                    Err(e) => {
                        tracing::error!(error = %e, "cannot listen for a successor any more; `serve --takeover` will fail");
                        return None;
                    }
                }
            }
            let Some(listening) = &self.listening else { continue };
            let peer = match listening.accept(Timeouts::default()) {
                Ok(peer) => peer,
                Err(e @ TakeoverError::ForeignPeer { .. }) => {
                    tracing::warn!(error = %e, "hand-over refused");
                    continue;
                }
                Err(e) => {
                    // Out of descriptors and the like: not in a tight loop.
                    tracing::warn!(error = %e, "accepting a successor failed");
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            let mut peer = peer;
            let hello = match peer.hello() {
                Ok(Request::HandOver(hello)) => hello,
                Ok(Request::Describe) => {
                    if let Err(e) = peer.describe(self.description.clone()) {
                        tracing::warn!(error = %e, "answering `tidegate upgrade` failed");
                    }
                    continue;
                }
                Err(e) => {
                    tracing::error!(error = %e, "hand-over failed; this process keeps serving");
                    continue;
                }
            };
            match self.hand_over(&mut peer, hello) {
                Ok(()) => {
                    tracing::info!("the new process serves: stopping accepting, draining, and exiting");
                    return Some(peer);
                }
                Err(e) => tracing::error!(error = %format!("{e:#}"), "hand-over failed; this process keeps serving"),
            }
        }
    }

    /// One hand-over; on failure this process serves and writes as before.
    fn hand_over(&mut self, peer: &mut Predecessor, hello: Hello) -> anyhow::Result<()> {
        tracing::info!(pid = hello.pid, "a new process asks to take over");
        if hello.store != self.embedded {
            let reason = match self.embedded {
                true => "this instance uses the embedded store of its data directory; give the same --store (none)",
                false => "this instance uses a shared store (etcd); give the same --store",
            };
            peer.refuse(reason);
            bail!("refused process {}: {reason}", hello.pid);
        }
        let released = match self.embedded {
            true => match self.control.hand_over() {
                Ok(released) => released,
                Err(e) => {
                    peer.refuse(&format!("the store could not be closed: {e}"));
                    bail!("closing the store for process {}: {e}", hello.pid);
                }
            },
            false => false,
        };
        let mut went = false;
        let outcome = self.exchange(peer, released, hello.memory, &mut went);
        let Err(e) = outcome else { return Ok(()) };
        if released {
            match self.take_back() {
                Ok(()) => tracing::info!("took the store back"),
                Err(held) if went => {
                    // The successor went and holds the store: it serves.
                    tracing::warn!(error = %held, "the new process holds the store after its go; taking its silence for serving");
                    return Ok(());
                }
                Err(held) => {
                    tracing::error!(error = %held, "cannot open the store again: changes are refused (503) until restart")
                }
            }
        }
        Err(e.into())
    }

    /// The offer, the successor's ready, what this process learned (if
    /// asked for), the go and its serving.
    fn exchange(
        &mut self,
        peer: &mut Predecessor,
        released: bool,
        memory: bool,
        went: &mut bool,
    ) -> Result<(), TakeoverError> {
        {
            let sockets = self.sockets.0.lock().unwrap_or_else(|p| p.into_inner());
            let named = self.sockets.named();
            let offered: Vec<(ListenerInfo, BorrowedFd<'_>)> =
                sockets.iter().chain(named.iter()).map(|(i, fd)| (*i, fd.as_fd())).collect();
            peer.offer(&offered, released, self.control.lease())?;
        }
        peer.ready()?;
        // The successor listens at the path from its go on.
        self.gave_path.store(true, Ordering::Release);
        self.listening = None;
        // Read as late as possible: this process goes on learning until
        // the successor serves.
        let learned = match memory {
            true => {
                let memory = self.control.snapshots().load().memory();
                let backends: usize = memory.services.iter().map(|s| s.backends.len()).sum();
                match serde_json::to_value(memory) {
                    Ok(state) => {
                        tracing::info!(backends, "handing over what was learned about the backends");
                        Some(state)
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "the learned state does not encode; the successor learns from scratch");
                        None
                    }
                }
            }
            false => None,
        };
        peer.go(learned)?;
        *went = true;
        peer.serving()
    }

    /// Opens the store again once the failed successor let go of it.
    fn take_back(&self) -> Result<(), tidegate_control::SubmitError> {
        let deadline = Instant::now() + TAKE_BACK_WITHIN;
        loop {
            match self.control.take_back() {
                Ok(()) => return Ok(()),
                Err(e) if Instant::now() >= deadline => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flag_with_port_0_matches_any_port_of_its_address() {
        let a = |s: &str| s.parse::<SocketAddr>().ok();
        assert_eq!(differs(a("127.0.0.1:0"), a("127.0.0.1:4567")), None);
        assert_eq!(differs(a("127.0.0.1:4567"), a("127.0.0.1:4567")), None);
        assert!(differs(a("127.0.0.1:80"), a("127.0.0.1:4567")).is_some());
        assert!(differs(a("0.0.0.0:0"), a("127.0.0.1:4567")).is_some());
        assert_eq!(differs(None, a("127.0.0.1:4567")), None);
    }
}
