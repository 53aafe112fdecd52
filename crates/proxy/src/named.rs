//! Named listeners (`PUT /v1/listeners/{name}`): opened and closed at
//! runtime as the configuration changes, each served by the same accept
//! loop, limits and engines as the default listeners, on every worker.
//!
//! One task per data plane follows the published snapshots. A listener
//! that appears is bound (once per worker with `SO_REUSEPORT` in per-core
//! mode) and an accept loop starts on each worker; one that goes away, or
//! changes, stops accepting at once and its open connections are told to
//! finish (as at shutdown: `Connection: close` after the request in
//! progress, GOAWAY for HTTP/2); other listeners are not touched. A socket
//! that cannot be opened (the address in use) is reported on the board and
//! tried again every [`RETRY`].

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tidegate_model::{ListenerName, ListenerSpec};
use tidegate_snapshot::{Changes, ListenerBoard, ListenerState, Snapshot};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

use crate::handler::Proxy;
use crate::hyper_server::HyperServer;
use crate::server::{accept_loop, Bound, ServerOptions, Slots};
use crate::tls::TlsFront;

/// The named listeners' sockets, for a hand-over to a new process
/// (`serve --takeover`): the old process offers duplicates of the sockets
/// it serves, the new one serves the ones it received instead of binding
/// (the same kernel sockets: nothing in their queues is lost).
#[derive(Debug, Clone, Default)]
pub struct NamedSockets(Arc<std::sync::Mutex<NamedInner>>);

#[derive(Debug, Default)]
struct NamedInner {
    /// Duplicates of the sockets served, by address.
    serving: std::collections::BTreeMap<SocketAddr, Vec<std::os::fd::OwnedFd>>,
    /// Sockets received from the previous process, not claimed yet.
    inherited: HashMap<SocketAddr, Vec<std::net::TcpListener>>,
}

impl NamedSockets {
    fn lock(&self) -> std::sync::MutexGuard<'_, NamedInner> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sockets a previous process handed over; each is served when the
    /// configuration names a listener on its address, and closed if none
    /// does.
    pub fn inherit(&self, sockets: Vec<std::net::TcpListener>) {
        let mut inner = self.lock();
        for s in sockets {
            if let Ok(addr) = s.local_addr() {
                inner.inherited.entry(addr).or_default().push(s);
            }
        }
    }

    /// Duplicates of every socket served now, with its address, to offer
    /// a successor.
    pub fn offer(&self) -> Vec<(SocketAddr, std::os::fd::OwnedFd)> {
        let inner = self.lock();
        inner
            .serving
            .iter()
            .flat_map(|(addr, fds)| fds.iter().filter_map(move |fd| Some((*addr, fd.try_clone().ok()?))))
            .collect()
    }

    fn take_inherited(&self, addr: SocketAddr) -> Option<Vec<std::net::TcpListener>> {
        self.lock().inherited.remove(&addr).filter(|s| !s.is_empty())
    }

    fn drop_unclaimed(&self) {
        self.lock().inherited.clear();
    }

    fn serving(&self, addr: SocketAddr, sockets: &[std::net::TcpListener]) {
        use std::os::fd::AsFd;
        let fds = sockets.iter().filter_map(|s| s.as_fd().try_clone_to_owned().ok()).collect();
        self.lock().serving.insert(addr, fds);
    }

    fn closed(&self, addr: SocketAddr) {
        self.lock().serving.remove(&addr);
    }
}

/// How often a listener whose socket could not be opened is tried again.
pub(crate) const RETRY: Duration = Duration::from_secs(5);

/// One worker, as the manager starts accept loops on it.
pub(crate) struct Worker {
    /// Its runtime.
    pub handle: tokio::runtime::Handle,
    /// Its request handler.
    pub proxy: Arc<Proxy>,
    /// Held by each named accept loop running on it: the worker waits for
    /// them at shutdown.
    pub alive: mpsc::Sender<()>,
}

/// What the manager needs of the data plane.
pub(crate) struct Manager {
    pub workers: Vec<Worker>,
    pub per_core: bool,
    pub snapshots: Arc<ArcSwap<Snapshot>>,
    pub opts: ServerOptions,
    pub slots: Slots,
    /// The default TLS listener's handshakes, if there is one (named TLS
    /// listeners share them; made on first need otherwise).
    pub tls: Option<Arc<TlsFront>>,
    pub board: ListenerBoard,
    /// Their sockets, for a hand-over.
    pub sockets: NamedSockets,
    /// The data plane's stop.
    pub stop: watch::Receiver<bool>,
}

/// A listener being served, or failing to be.
struct Running {
    spec: Arc<ListenerSpec>,
    /// Set to stop its accept loops and tell its connections to finish;
    /// `None` while its socket could not be opened.
    close: Option<watch::Sender<bool>>,
}

impl Manager {
    /// Follows the snapshots until the data plane stops.
    pub(crate) async fn run(mut self, mut changes: Changes) {
        let mut running: HashMap<ListenerName, Running> = HashMap::new();
        let mut first = true;
        loop {
            let snapshot = self.snapshots.load_full();
            self.reconcile(&snapshot, &mut running);
            if std::mem::take(&mut first) {
                // What a previous process handed over for listeners the
                // configuration no longer has.
                self.sockets.drop_unclaimed();
            }
            let failing = running.values().any(|r| r.close.is_none());
            tokio::select! {
                _ = changes.next() => {}
                () = tokio::time::sleep(RETRY), if failing => {}
                _ = self.stop.changed() => break,
            }
        }
        // The accept loops see the data plane's stop themselves.
        for (name, _) in running.drain() {
            self.board.remove(name.as_str());
        }
    }

    fn reconcile(&mut self, snapshot: &Snapshot, running: &mut HashMap<ListenerName, Running>) {
        let wanted = snapshot.listeners();
        running.retain(|name, r| {
            let keep = wanted.get(name).is_some_and(|spec| **spec == *r.spec);
            if !keep {
                if let Some(close) = &r.close {
                    let _ = close.send(true);
                }
                self.board.remove(name.as_str());
                self.sockets.closed(r.spec.addr);
                tracing::info!(listener = %name, addr = %r.spec.addr, "listener closed");
            }
            keep
        });
        for (name, spec) in wanted {
            if running.get(name).is_some_and(|r| r.close.is_some()) {
                continue;
            }
            let close = match self.open(name, spec) {
                Ok(close) => {
                    tracing::info!(listener = %name, addr = %spec.addr, tls = spec.tls, "listening");
                    self.report(name, spec, None);
                    Some(close)
                }
                Err(e) => {
                    let first = !running.contains_key(name);
                    if first {
                        tracing::warn!(listener = %name, addr = %spec.addr, error = %e, "cannot listen; trying again");
                    }
                    self.report(name, spec, Some(e.to_string()));
                    None
                }
            };
            running.insert(name.clone(), Running { spec: spec.clone(), close });
        }
    }

    fn report(&self, name: &ListenerName, spec: &ListenerSpec, error: Option<String>) {
        let since_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let state = ListenerState {
            addr: spec.addr,
            tls: spec.tls,
            proxy_protocol: spec.proxy_protocol.is_some(),
            error,
            since_ms,
        };
        self.board.set(name.as_str(), state);
    }

    /// Binds `spec` and starts its accept loops; the sender closes it.
    fn open(&mut self, name: &ListenerName, spec: &Arc<ListenerSpec>) -> std::io::Result<watch::Sender<bool>> {
        let tls = match spec.tls {
            false => None,
            true => Some(match &self.tls {
                Some(front) => front.clone(),
                None => {
                    let front = Arc::new(TlsFront::new(self.snapshots.clone(), self.opts.on_demand.clone())?);
                    self.tls = Some(front.clone());
                    front
                }
            }),
        };
        let sockets = match self.sockets.take_inherited(spec.addr) {
            Some(inherited) => {
                for s in &inherited {
                    s.set_nonblocking(true)?;
                }
                inherited
            }
            None => bind_named(spec.addr, self.per_core, self.workers.len())?,
        };
        self.sockets.serving(spec.addr, &sockets);
        let (close, closed) = watch::channel(false);
        let bound = Bound {
            name: Some(Arc::from(name.as_str())),
            // `--proxy-protocol-from` is the default listeners'.
            balancers: Some(Arc::from(spec.proxy_protocol.clone().unwrap_or_default())),
            closed: Some(closed),
        };
        for (socket, worker) in sockets.into_iter().zip(self.workers.iter().cycle()) {
            let (proxy, stop, opts) = (worker.proxy.clone(), self.stop.clone(), self.opts.clone());
            let (slots, tls, bound, alive) = (self.slots.clone(), tls.clone(), bound.clone(), worker.alive.clone());
            worker.handle.spawn(async move {
                let hyper = HyperServer::new(&opts.limits);
                match TcpListener::from_std(socket) {
                    Ok(l) => accept_loop(l, tls, proxy, stop, &opts, slots, hyper, bound).await,
                    Err(e) => tracing::error!(error = %e, "cannot register the listener"),
                }
                drop(alive);
            });
        }
        Ok(close)
    }
}

/// Binds a named listener's sockets: once per worker with `SO_REUSEPORT`
/// in per-core mode (after a probe without it, so that an address another
/// process holds fails), once otherwise.
fn bind_named(addr: SocketAddr, per_core: bool, workers: usize) -> std::io::Result<Vec<std::net::TcpListener>> {
    Ok(crate::server::bind_all(addr, per_core, workers)?.0)
}
