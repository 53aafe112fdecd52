//! The hand-over of a running Tidegate's listening sockets to its successor
//! (`tidegate serve ... --takeover`): the messages and their IO on a Unix
//! socket, with nothing of the proxy in it.
//!
//! The running instance listens on `DATA_DIR/takeover.sock` (mode 0600,
//! removed when it stops listening: [`Listening`]). A successor connects
//! ([`Successor::connect`]); the running one checks with `SO_PEERCRED` that
//! the peer runs as the same user ([`Listening::accept`]) and then the two
//! speak, each message one frame (a 4-byte big-endian length and a JSON
//! object):
//!
//! ```text
//! successor                          running instance
//!   Hello {version, pid, store, memory} ──►
//!                                    (its writer commits what is queued
//!                                     and closes the embedded store)
//!                               ◄──  Offer {version, listeners, store_released}
//!                                     + one descriptor per listener (SCM_RIGHTS)
//!   (opens the store)
//!   Ready ──────────────────────►
//!                               ◄──  Learned {state}   (if the hello asked for it:
//!                                     what it learned about its backends)
//!                               ◄──  Go          (the running one will not resume)
//!   (serves on the sockets)
//!   Serving ────────────────────►    (stops accepting, drains)
//!                               ◄──  Draining {connections}   (every quarter second)
//!                               ◄──  Drained     (then it exits)
//! ```
//!
//! Either side may send `Refuse {reason}` instead of its next message.
//!
//! A client that only asks (`tidegate upgrade`, before it starts the new
//! process) sends `Describe` instead of a hello and receives `Described`:
//! the running instance's process id, executable, working directory,
//! arguments and `TIDEGATE_*` and `NOTIFY_SOCKET` environment; nothing is
//! handed over.
//!
//! Fields added since version 1 of the protocol are optional (a missing
//! one reads as its default, an unknown one is ignored), so binaries of
//! either side of a change can hand over to each other.
//! Every read and write has a timeout ([`Timeouts`]): a step that does not
//! happen in time fails with [`TakeoverError::Timeout`] naming it.
//!
//! The listening sockets are the same kernel sockets in both processes (the
//! descriptors are duplicated, not the sockets), so a connection waiting in
//! an accept queue during the hand-over is accepted by one process or the
//! other, never reset.

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::net::SocketAddr;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage};
use serde::{Deserialize, Serialize};

/// The protocol's version; both sides must speak the same one.
pub const PROTOCOL_VERSION: u32 = 1;

/// The socket's file name in the data directory.
pub const SOCKET_NAME: &str = "takeover.sock";

/// The most descriptors one hand-over carries (Linux's limit for one
/// `SCM_RIGHTS` message is 253).
pub const MAX_LISTENERS: usize = 253;

/// The longest frame accepted, in bytes, but for a `Learned`.
const MAX_FRAME: usize = 64 * 1024;

/// The longest `Learned` frame accepted, in bytes (about 400 per backend:
/// a million backends).
const MAX_LEARNED_FRAME: usize = 512 * 1024 * 1024;

/// Where the instance serving `data_dir` listens for a successor.
pub fn socket_path(data_dir: &Path) -> PathBuf {
    data_dir.join(SOCKET_NAME)
}

/// What a listening socket is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// The proxy's plain HTTP listener (one per worker with `SO_REUSEPORT`).
    Proxy,
    /// The proxy's TLS listener (one per worker with `SO_REUSEPORT`).
    ProxyTls,
    /// The admin API.
    Admin,
    /// The separate `/metrics` listener.
    Metrics,
    /// A named listener of the configuration (`/v1/listeners`), known by
    /// its address (all of its per-core group).
    Named,
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Kind::Proxy => "proxy",
            Kind::ProxyTls => "proxy_tls",
            Kind::Admin => "admin",
            Kind::Metrics => "metrics",
            Kind::Named => "named",
        })
    }
}

/// One listening socket as the offer describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListenerInfo {
    /// What it is for.
    pub kind: Kind,
    /// The address it is bound to.
    pub addr: SocketAddr,
}

/// How the running instance was started, for `tidegate upgrade` to
/// start its successor the same way.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Description {
    /// Its process id.
    pub pid: u32,
    /// The executable it was started from (as read when it started).
    pub exe: Option<PathBuf>,
    /// Its working directory (relative paths in its arguments are
    /// relative to it).
    pub cwd: Option<PathBuf>,
    /// Its arguments after the program name.
    pub args: Vec<String>,
    /// The environment a successor needs to run as it does: the
    /// `TIDEGATE_*` variables and systemd's `NOTIFY_SOCKET`.
    pub env: Vec<(String, String)>,
}

/// The messages of the hand-over.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Message {
    /// Successor → running: asks for the sockets.
    Hello {
        /// [`PROTOCOL_VERSION`] of the successor.
        version: u32,
        /// The successor's process id, for the logs.
        pid: u32,
        /// The successor uses the embedded store of the same data
        /// directory, so the running instance must close it first.
        store: bool,
        /// The successor takes what the running instance learned about
        /// its backends (a `Learned` before the go).
        #[serde(default)]
        memory: bool,
    },
    /// Running → successor: the sockets, one descriptor per entry of
    /// `listeners`, in that order, attached to this frame.
    Offer {
        /// [`PROTOCOL_VERSION`] of the running instance.
        version: u32,
        /// What each descriptor is.
        listeners: Vec<ListenerInfo>,
        /// The embedded store was closed and may be opened now.
        store_released: bool,
        /// The running instance's process id.
        #[serde(default)]
        pid: u32,
        /// With a shared store (etcd): the lease its instance record and
        /// roles live under, for the successor to go on with.
        #[serde(default)]
        lease: Option<i64>,
    },
    /// Successor → running: it holds the sockets and the store, and will
    /// serve once told to go.
    Ready,
    /// Running → successor, between the successor's ready and the go,
    /// if its hello asked: what the running instance learned (opaque
    /// here; `serve` puts its backends' statistics in it).
    Learned {
        /// The state.
        state: serde_json::Value,
    },
    /// Running → successor: go; the running instance will not take the
    /// store back.
    Go,
    /// Client → running: who are you and how were you started?
    Describe,
    /// Running → client: the answer to `Describe`.
    Described(Description),
    /// Successor → running: it serves; the running instance stops
    /// accepting, drains and exits.
    Serving,
    /// Running → successor, after its serving: the connections it still
    /// has open while it drains.
    Draining {
        /// Client connections still open.
        connections: u64,
    },
    /// Running → successor: every connection is closed (or was cut at
    /// the drain timeout); it exits now.
    Drained {
        /// Connections that were still open when the drain timeout cut them.
        cut: u64,
    },
    /// Either side: the hand-over stops here, for this reason.
    Refuse {
        /// Why.
        reason: String,
    },
}

impl Message {
    fn name(&self) -> &'static str {
        match self {
            Message::Hello { .. } => "hello",
            Message::Offer { .. } => "offer",
            Message::Ready => "ready",
            Message::Learned { .. } => "learned",
            Message::Go => "go",
            Message::Describe => "describe",
            Message::Draining { .. } => "draining",
            Message::Drained { .. } => "drained",
            Message::Described(_) => "described",
            Message::Serving => "serving",
            Message::Refuse { .. } => "refuse",
        }
    }
}

/// The steps of the hand-over, to name the one that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Connecting to the running instance.
    Connect,
    /// Waiting for the successor's hello.
    Hello,
    /// Waiting for the running instance's offer (it first commits queued
    /// changes and closes the store).
    Offer,
    /// Waiting for the successor to open the store and be ready.
    Ready,
    /// Waiting for the running instance's go.
    Go,
    /// Waiting for the successor to serve.
    Serving,
    /// Asking the running instance how it was started.
    Describe,
    /// The instance taken over reporting its drain.
    Drain,
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Step::Connect => "connecting to the running instance",
            Step::Hello => "waiting for the successor's hello",
            Step::Offer => "waiting for the running instance's sockets",
            Step::Ready => "waiting for the successor to be ready",
            Step::Go => "waiting for the running instance's go",
            Step::Serving => "waiting for the successor to serve",
            Step::Describe => "asking the running instance how it was started",
            Step::Drain => "following the drain of the instance taken over",
        })
    }
}

/// Why a hand-over failed.
#[derive(Debug, thiserror::Error)]
pub enum TakeoverError {
    /// Nothing listens on the socket: no instance serves this data
    /// directory (or one from before `--takeover` existed).
    #[error("no running instance to take over: nothing answers on {path}: {error}")]
    NoInstance {
        /// The socket's path.
        path: PathBuf,
        /// The connect error.
        error: std::io::Error,
    },
    /// A step did not happen within its timeout.
    #[error("{step}: no answer within {after:?}")]
    Timeout {
        /// The step.
        step: Step,
        /// Its timeout.
        after: Duration,
    },
    /// The peer closed the connection during a step.
    #[error("{step}: the other process closed the connection")]
    Closed {
        /// The step.
        step: Step,
    },
    /// Reading or writing failed.
    #[error("{step}: {error}")]
    Io {
        /// The step.
        step: Step,
        /// The error.
        error: std::io::Error,
    },
    /// The peer runs as another user.
    #[error("refused a hand-over to process {pid} of uid {uid}: only uid {own} may take this instance over")]
    ForeignPeer {
        /// The peer's uid.
        uid: u32,
        /// The peer's process id.
        pid: i32,
        /// This process's uid.
        own: u32,
    },
    /// The peer sent something the protocol does not allow here.
    #[error("{step}: unexpected message: {detail}")]
    Protocol {
        /// The step.
        step: Step,
        /// What was wrong.
        detail: String,
    },
    /// The peer refused the hand-over.
    #[error("{step}: the other process refused: {reason}")]
    Refused {
        /// The step.
        step: Step,
        /// Its reason.
        reason: String,
    },
    /// The two sides speak different versions of the protocol.
    #[error("the running instance speaks version {theirs} of the hand-over protocol, this binary version {ours}")]
    Version {
        /// The peer's version.
        theirs: u32,
        /// This side's version.
        ours: u32,
    },
    /// The socket file could not be made.
    #[error("listening on {path}: {error}")]
    Listen {
        /// The socket's path.
        path: PathBuf,
        /// The error.
        error: std::io::Error,
    },
}

/// How long each step may take.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// Each write, and short reads (a hello, a go, a serving).
    pub step: Duration,
    /// The running instance's offer: it commits the changes queued first.
    pub offer: Duration,
    /// The successor's ready: it opens the store and loads the
    /// configuration first.
    pub ready: Duration,
}

impl Default for Timeouts {
    fn default() -> Timeouts {
        Timeouts { step: Duration::from_secs(10), offer: Duration::from_secs(30), ready: Duration::from_secs(60) }
    }
}

/// A connection of the hand-over, from either side.
#[derive(Debug)]
struct Channel {
    stream: UnixStream,
    timeouts: Timeouts,
}

fn io_error(step: Step, after: Duration, e: std::io::Error) -> TakeoverError {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => TakeoverError::Timeout { step, after },
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::BrokenPipe
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::ConnectionAborted => TakeoverError::Closed { step },
        _ => TakeoverError::Io { step, error: e },
    }
}

impl Channel {
    fn new(stream: UnixStream, timeouts: Timeouts) -> Channel {
        Channel { stream, timeouts }
    }

    /// Sends `message` with `fds` attached to its first byte.
    fn send(&mut self, step: Step, message: &Message, fds: &[BorrowedFd<'_>]) -> Result<(), TakeoverError> {
        let after = self.timeouts.step;
        let body = serde_json::to_vec(message)
            .map_err(|e| TakeoverError::Protocol { step, detail: format!("cannot encode {}: {e}", message.name()) })?;
        let max = if matches!(message, Message::Learned { .. }) { MAX_LEARNED_FRAME } else { MAX_FRAME };
        let len = u32::try_from(body.len())
            .ok()
            .filter(|&n| n as usize <= max)
            .ok_or_else(|| TakeoverError::Protocol { step, detail: format!("{} is too large", message.name()) })?;
        let mut frame = len.to_be_bytes().to_vec();
        frame.extend_from_slice(&body);
        self.stream.set_write_timeout(Some(after)).map_err(|e| io_error(step, after, e))?;
        let mut sent = 0;
        if !fds.is_empty() {
            if fds.len() > MAX_LISTENERS {
                return Err(TakeoverError::Protocol {
                    step,
                    detail: format!("{} sockets to hand over; at most {MAX_LISTENERS} fit", fds.len()),
                });
            }
            let mut space = vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(fds.len()))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            if !control.push(SendAncillaryMessage::ScmRights(fds)) {
                return Err(TakeoverError::Protocol { step, detail: "the descriptors do not fit the buffer".into() });
            }
            sent = rustix::net::sendmsg(
                &self.stream,
                &[IoSlice::new(&frame)],
                &mut control,
                rustix::net::SendFlags::NOSIGNAL,
            )
            .map_err(|e| io_error(step, after, e.into()))?;
        }
        self.stream.write_all(&frame[sent..]).map_err(|e| io_error(step, after, e))
    }

    /// Receives one message and the descriptors attached to it, waiting at
    /// most `after`.
    fn receive(&mut self, step: Step, after: Duration) -> Result<(Message, Vec<OwnedFd>), TakeoverError> {
        self.receive_up_to(step, after, MAX_FRAME)
    }

    /// [`Channel::receive`] of a frame of at most `max` bytes.
    fn receive_up_to(
        &mut self,
        step: Step,
        after: Duration,
        max: usize,
    ) -> Result<(Message, Vec<OwnedFd>), TakeoverError> {
        self.stream.set_read_timeout(Some(after)).map_err(|e| io_error(step, after, e))?;
        let mut head = [0u8; 4];
        let mut space = vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_LISTENERS))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let got = rustix::net::recvmsg(
            &self.stream,
            &mut [IoSliceMut::new(&mut head)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        )
        .map_err(|e| io_error(step, after, e.into()))?;
        if got.bytes == 0 {
            return Err(TakeoverError::Closed { step });
        }
        let mut fds = Vec::new();
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = message {
                fds.extend(received);
            }
        }
        if got.flags.contains(rustix::net::ReturnFlags::CTRUNC) {
            return Err(TakeoverError::Protocol { step, detail: "more descriptors than the protocol allows".into() });
        }
        self.stream.read_exact(&mut head[got.bytes..]).map_err(|e| io_error(step, after, e))?;
        let len = u32::from_be_bytes(head) as usize;
        if len > max {
            return Err(TakeoverError::Protocol { step, detail: format!("a frame of {len} bytes; at most {max}") });
        }
        let mut body = vec![0u8; len];
        self.stream.read_exact(&mut body).map_err(|e| io_error(step, after, e))?;
        let message: Message = serde_json::from_slice(&body)
            .map_err(|e| TakeoverError::Protocol { step, detail: format!("not a message of the protocol: {e}") })?;
        if let Message::Refuse { reason } = message {
            return Err(TakeoverError::Refused { step, reason });
        }
        Ok((message, fds))
    }

    /// Receives a message that carries no descriptors.
    fn expect(&mut self, step: Step, after: Duration, name: &str) -> Result<Message, TakeoverError> {
        let (message, fds) = self.receive(step, after)?;
        if message.name() != name {
            return Err(TakeoverError::Protocol {
                step,
                detail: format!("{} where {name} was expected", message.name()),
            });
        }
        if !fds.is_empty() {
            return Err(TakeoverError::Protocol {
                step,
                detail: format!("{} descriptors attached to {name}", fds.len()),
            });
        }
        Ok(message)
    }

    fn refuse(&mut self, step: Step, reason: &str) {
        let _ = self.send(step, &Message::Refuse { reason: reason.to_string() }, &[]);
    }
}

/// The running instance's socket for successors: `DATA_DIR/takeover.sock`,
/// mode 0600, removed when this is dropped.
#[derive(Debug)]
pub struct Listening {
    listener: UnixListener,
    path: PathBuf,
}

impl Listening {
    /// Listens on `path`. A file left there by a process that is gone is
    /// replaced; one that a live process answers on is not.
    pub fn bind(path: &Path) -> Result<Listening, TakeoverError> {
        let failed = |error| TakeoverError::Listen { path: path.to_path_buf(), error };
        let listener = match UnixListener::bind(path) {
            Ok(l) => l,
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
                if UnixStream::connect(path).is_ok() {
                    return Err(failed(std::io::Error::new(
                        std::io::ErrorKind::AddrInUse,
                        "another process listens there (another instance serving this data directory?)",
                    )));
                }
                std::fs::remove_file(path).map_err(failed)?;
                UnixListener::bind(path).map_err(failed)?
            }
            Err(e) => return Err(failed(e)),
        };
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(failed)?;
        Ok(Listening { listener, path: path.to_path_buf() })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Waits for the next successor. A peer of another user is refused
    /// (told why, and the error says who it was).
    pub fn accept(&self, timeouts: Timeouts) -> Result<Predecessor, TakeoverError> {
        let (stream, _) = self.listener.accept().map_err(|e| TakeoverError::Io { step: Step::Hello, error: e })?;
        let peer = rustix::net::sockopt::socket_peercred(&stream)
            .map_err(|e| TakeoverError::Io { step: Step::Hello, error: e.into() })?;
        let own = rustix::process::getuid().as_raw();
        let mut channel = Channel::new(stream, timeouts);
        if peer.uid.as_raw() != own {
            // Its hello is read first (bounded by the step's timeout): a
            // socket closed with unread data would reset the connection,
            // and the peer would not learn why.
            let after = channel.timeouts.step;
            let _ = channel.receive(Step::Hello, after);
            channel.refuse(Step::Hello, "the hand-over is only for processes of the same user");
            return Err(TakeoverError::ForeignPeer {
                uid: peer.uid.as_raw(),
                pid: peer.pid.as_raw_nonzero().get(),
                own,
            });
        }
        Ok(Predecessor { channel })
    }
}

impl Drop for Listening {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The successor's hello, as the running instance reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// The successor's process id.
    pub pid: u32,
    /// It uses the embedded store of this data directory.
    pub store: bool,
    /// It takes what this instance learned (send it with [`Predecessor::go`]).
    pub memory: bool,
}

/// What a peer of the running instance asks for first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// A successor: the hand-over begins.
    HandOver(Hello),
    /// How this instance was started ([`Predecessor::describe`]).
    Describe,
}

/// The running instance's side of one hand-over.
#[derive(Debug)]
pub struct Predecessor {
    channel: Channel,
}

impl Predecessor {
    /// Reads the peer's first message: a successor's hello (another
    /// protocol version is refused) or a question.
    pub fn hello(&mut self) -> Result<Request, TakeoverError> {
        let after = self.channel.timeouts.step;
        let (message, fds) = self.channel.receive(Step::Hello, after)?;
        if !fds.is_empty() {
            return Err(TakeoverError::Protocol {
                step: Step::Hello,
                detail: format!("{} descriptors attached to {}", fds.len(), message.name()),
            });
        }
        match message {
            Message::Describe => Ok(Request::Describe),
            Message::Hello { version, pid, store, memory } if version == PROTOCOL_VERSION => {
                Ok(Request::HandOver(Hello { pid, store, memory }))
            }
            Message::Hello { version, .. } => {
                self.channel.refuse(
                    Step::Hello,
                    &format!(
                        "this instance speaks version {PROTOCOL_VERSION} of the hand-over protocol, not {version}"
                    ),
                );
                Err(TakeoverError::Version { theirs: version, ours: PROTOCOL_VERSION })
            }
            other => Err(TakeoverError::Protocol { step: Step::Hello, detail: other.name().into() }),
        }
    }

    /// Refuses the hand-over, telling the successor why.
    pub fn refuse(&mut self, reason: &str) {
        self.channel.refuse(Step::Offer, reason);
    }

    /// Sends the sockets (duplicates of the descriptors: this process
    /// keeps its own until it drops them), whether the store was closed,
    /// and the lease of a shared store's membership.
    pub fn offer(
        &mut self,
        listeners: &[(ListenerInfo, BorrowedFd<'_>)],
        store_released: bool,
        lease: Option<i64>,
    ) -> Result<(), TakeoverError> {
        let message = Message::Offer {
            version: PROTOCOL_VERSION,
            pid: std::process::id(),
            lease,
            listeners: listeners.iter().map(|(info, _)| *info).collect(),
            store_released,
        };
        let fds: Vec<BorrowedFd<'_>> = listeners.iter().map(|(_, fd)| *fd).collect();
        self.channel.send(Step::Offer, &message, &fds)
    }

    /// Waits for the successor to hold the sockets and the store.
    pub fn ready(&mut self) -> Result<(), TakeoverError> {
        let after = self.channel.timeouts.ready;
        self.channel.expect(Step::Ready, after, "ready").map(drop)
    }

    /// Answers a [`Request::Describe`].
    pub fn describe(mut self, description: Description) -> Result<(), TakeoverError> {
        self.channel.send(Step::Describe, &Message::Described(description), &[])
    }

    /// Tells the successor to serve, after what this instance learned if
    /// given (only when the hello asked for it). From here the running
    /// instance does not take the store back unless the successor is gone.
    pub fn go(&mut self, learned: Option<serde_json::Value>) -> Result<(), TakeoverError> {
        if let Some(state) = learned {
            self.channel.send(Step::Go, &Message::Learned { state }, &[])?;
        }
        self.channel.send(Step::Go, &Message::Go, &[])
    }

    /// Waits for the successor to serve.
    pub fn serving(&mut self) -> Result<(), TakeoverError> {
        let after = self.channel.timeouts.ready;
        self.channel.expect(Step::Serving, after, "serving").map(drop)
    }

    /// Tells the successor how many connections are still open here.
    pub fn draining(&mut self, connections: u64) -> Result<(), TakeoverError> {
        self.channel.send(Step::Drain, &Message::Draining { connections }, &[])
    }

    /// Tells the successor this process is done (`cut`: connections the
    /// drain timeout closed).
    pub fn drained(mut self, cut: u64) -> Result<(), TakeoverError> {
        self.channel.send(Step::Drain, &Message::Drained { cut }, &[])
    }
}

/// What the instance taken over says while it drains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drain {
    /// This many client connections are still open.
    Draining(u64),
    /// It is done and exits; `cut` connections were closed by the drain
    /// timeout.
    Drained {
        /// Connections the drain timeout closed.
        cut: u64,
    },
}

/// The successor's end of the channel after it serves: the instance taken
/// over reports its drain here.
#[derive(Debug)]
pub struct Watching {
    channel: Channel,
}

impl Watching {
    /// The next report, waiting at most `after`. The channel closing
    /// without a `Drained` (a predecessor of the first protocol version,
    /// or one that died) is [`TakeoverError::Closed`].
    pub fn next(&mut self, after: Duration) -> Result<Drain, TakeoverError> {
        match self.channel.receive(Step::Drain, after)? {
            (Message::Draining { connections }, fds) if fds.is_empty() => Ok(Drain::Draining(connections)),
            (Message::Drained { cut }, fds) if fds.is_empty() => Ok(Drain::Drained { cut }),
            (other, _) => Err(TakeoverError::Protocol {
                step: Step::Drain,
                detail: format!("{} where draining or drained was expected", other.name()),
            }),
        }
    }
}

/// Asks the instance listening on `path` how it was started (its
/// process id, executable, arguments): nothing is handed over.
pub fn describe(path: &Path, timeouts: Timeouts) -> Result<Description, TakeoverError> {
    let stream =
        UnixStream::connect(path).map_err(|error| TakeoverError::NoInstance { path: path.to_path_buf(), error })?;
    let mut channel = Channel::new(stream, timeouts);
    channel.send(Step::Describe, &Message::Describe, &[])?;
    match channel.expect(Step::Describe, timeouts.step, "described")? {
        Message::Described(d) => Ok(d),
        other => Err(TakeoverError::Protocol { step: Step::Describe, detail: other.name().into() }),
    }
}

/// The sockets received, each with what it is.
#[derive(Debug)]
pub struct Offer {
    /// The listening sockets, as the running instance described them.
    pub listeners: Vec<(ListenerInfo, OwnedFd)>,
    /// The embedded store was closed and may be opened now.
    pub store_released: bool,
    /// The running instance's process id (0 from one of the first
    /// protocol version).
    pub pid: u32,
    /// The lease of its membership of a shared store, to go on with.
    pub lease: Option<i64>,
}

/// The successor's side of one hand-over.
#[derive(Debug)]
pub struct Successor {
    channel: Channel,
}

impl Successor {
    /// Connects to the instance listening on `path`.
    pub fn connect(path: &Path, timeouts: Timeouts) -> Result<Successor, TakeoverError> {
        let stream =
            UnixStream::connect(path).map_err(|error| TakeoverError::NoInstance { path: path.to_path_buf(), error })?;
        Ok(Successor { channel: Channel::new(stream, timeouts) })
    }

    /// Says hello and receives the sockets. `store`: this process uses the
    /// embedded store of the same data directory; `memory`: it takes what
    /// the running instance learned (with the go: [`Successor::ready`]).
    pub fn request(&mut self, store: bool, memory: bool) -> Result<Offer, TakeoverError> {
        let hello = Message::Hello { version: PROTOCOL_VERSION, pid: std::process::id(), store, memory };
        self.channel.send(Step::Hello, &hello, &[])?;
        let after = self.channel.timeouts.offer;
        let (message, fds) = self.channel.receive(Step::Offer, after)?;
        let Message::Offer { version, listeners, store_released, pid, lease } = message else {
            return Err(TakeoverError::Protocol {
                step: Step::Offer,
                detail: format!("{} where offer was expected", message.name()),
            });
        };
        if version != PROTOCOL_VERSION {
            return Err(TakeoverError::Version { theirs: version, ours: PROTOCOL_VERSION });
        }
        if fds.len() != listeners.len() {
            return Err(TakeoverError::Protocol {
                step: Step::Offer,
                detail: format!("{} descriptors for {} listeners", fds.len(), listeners.len()),
            });
        }
        Ok(Offer { listeners: listeners.into_iter().zip(fds).collect(), store_released, pid, lease })
    }

    /// Refuses to go on, telling the running instance why (it keeps
    /// serving, and takes its store back).
    pub fn refuse(mut self, reason: &str) {
        self.channel.refuse(Step::Ready, reason);
    }

    /// Says it holds the sockets and the store, and waits for the go;
    /// returns what the running instance learned, if it sent it.
    pub fn ready(&mut self) -> Result<Option<serde_json::Value>, TakeoverError> {
        self.channel.send(Step::Ready, &Message::Ready, &[])?;
        let after = self.channel.timeouts.step;
        let (message, fds) = self.channel.receive_up_to(Step::Go, after, MAX_LEARNED_FRAME)?;
        let learned = match message {
            Message::Learned { state } if fds.is_empty() => Some(state),
            Message::Go if fds.is_empty() => return Ok(None),
            other => {
                return Err(TakeoverError::Protocol {
                    step: Step::Go,
                    detail: format!("{} where learned or go was expected", other.name()),
                })
            }
        };
        self.channel.expect(Step::Go, after, "go")?;
        Ok(learned)
    }

    /// Says it serves: the running instance stops accepting and drains,
    /// and reports its drain on the channel returned.
    pub fn serving(mut self) -> Result<Watching, TakeoverError> {
        self.channel.send(Step::Serving, &Message::Serving, &[])?;
        Ok(Watching { channel: self.channel })
    }
}

#[cfg(test)]
mod tests;
