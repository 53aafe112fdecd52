//! The retry decision: pure, unit-tested without sockets.
//!
//! After each failed attempt the forwarding loop asks [`decide`] what to do
//! next. It reads only the typed failure and facts about the request, never
//! a socket; the retry budget (the one piece of shared state) is consulted
//! by the caller only when the decision says a retry would cost one.

use crate::error::{ErrorKind, Retry};

/// How an attempt failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The attempt ended in an error.
    Error(ErrorKind),
    /// The backend shed the request (it answered 503): it did not process
    /// it, but it did receive it.
    Shed,
}

/// What the request allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// The method is idempotent (GET, HEAD, OPTIONS, TRACE, PUT, DELETE).
    pub idempotent: bool,
    /// The body can be sent again (it was empty or buffered).
    pub replayable: bool,
}

/// Where the request stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Retries on other backends made so far.
    pub retries: u32,
    /// The service's `retries`.
    pub max_retries: u32,
    /// Retries on a fresh connection to the same backend made so far.
    pub fresh_retries: u32,
}

/// What to do after a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Try the same backend again on a new connection. Costs the backend
    /// nothing it did not already refuse, so it needs no budget.
    SameBackendFreshConnection,
    /// Try another backend. `budgeted`: the retry adds load a backend may
    /// already have seen, so the service's retry budget must allow it; a
    /// request that never reached a backend retries for free.
    OtherBackend {
        /// Whether the retry budget must admit it.
        budgeted: bool,
    },
    /// Stop and answer the client with this failure.
    GiveUp,
}

/// At most this many fresh-connection retries per request: one stale
/// connection is the keep-alive race; two in a row is a backend problem.
pub const MAX_FRESH_RETRIES: u32 = 1;

/// Decides what follows a failed attempt.
pub fn decide(failure: Failure, req: Request, progress: Progress) -> Decision {
    let retry = match failure {
        // A shed request was received but not processed; only requests
        // that may safely be repeated go elsewhere.
        Failure::Shed => Retry::IfIdempotent,
        Failure::Error(kind) => kind.retry(),
    };
    let other = |budgeted: bool| {
        if progress.retries < progress.max_retries {
            Decision::OtherBackend { budgeted }
        } else {
            Decision::GiveUp
        }
    };
    match retry {
        Retry::Never => Decision::GiveUp,
        // A connect failure sent nothing, so even a streamed body is intact.
        Retry::Unsent => other(false),
        Retry::IfIdempotent if req.idempotent && req.replayable => other(true),
        Retry::IfIdempotent => Decision::GiveUp,
        Retry::FreshConnection if req.idempotent && req.replayable && progress.fresh_retries < MAX_FRESH_RETRIES => {
            Decision::SameBackendFreshConnection
        }
        // A second stale connection, or a request that must not be
        // repeated: treat it as the backend closing on us.
        Retry::FreshConnection if req.idempotent && req.replayable => other(true),
        Retry::FreshConnection => Decision::GiveUp,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ErrorKind::*;

    const GET: Request = Request { idempotent: true, replayable: true };
    const POST: Request = Request { idempotent: false, replayable: true };
    const STREAMED_PUT: Request = Request { idempotent: true, replayable: false };

    fn first(max_retries: u32) -> Progress {
        Progress { retries: 0, max_retries, fresh_retries: 0 }
    }

    #[test]
    fn connect_failures_go_anywhere_for_free() {
        for req in [GET, POST, STREAMED_PUT] {
            assert_eq!(
                decide(Failure::Error(ConnectFailed), req, first(2)),
                Decision::OtherBackend { budgeted: false }
            );
            assert_eq!(
                decide(Failure::Error(ConnectTimeout), req, first(2)),
                Decision::OtherBackend { budgeted: false }
            );
        }
    }

    #[test]
    fn failures_after_sending_retry_only_idempotent_replayable_requests() {
        for kind in [UpstreamClosed, InvalidResponse] {
            assert_eq!(decide(Failure::Error(kind), GET, first(2)), Decision::OtherBackend { budgeted: true });
            assert_eq!(decide(Failure::Error(kind), POST, first(2)), Decision::GiveUp);
            assert_eq!(decide(Failure::Error(kind), STREAMED_PUT, first(2)), Decision::GiveUp);
        }
        assert_eq!(decide(Failure::Shed, GET, first(2)), Decision::OtherBackend { budgeted: true });
        assert_eq!(decide(Failure::Shed, POST, first(2)), Decision::GiveUp);
    }

    #[test]
    fn timeouts_and_local_or_client_failures_are_final() {
        for kind in [ResponseTimeout, ClientBody, BadRequest, NoRoute, NoBackend, QueueFull, QueueTimeout] {
            assert_eq!(decide(Failure::Error(kind), GET, first(2)), Decision::GiveUp, "{kind:?}");
        }
    }

    #[test]
    fn retries_stop_at_the_limit() {
        let done = Progress { retries: 2, max_retries: 2, fresh_retries: 0 };
        assert_eq!(decide(Failure::Error(ConnectFailed), GET, done), Decision::GiveUp);
        assert_eq!(decide(Failure::Shed, GET, done), Decision::GiveUp);
        assert_eq!(decide(Failure::Error(ConnectFailed), GET, first(0)), Decision::GiveUp);
    }

    #[test]
    fn a_stale_connection_is_retried_once_on_the_same_backend() {
        assert_eq!(decide(Failure::Error(StaleConnection), GET, first(0)), Decision::SameBackendFreshConnection);
        let again = Progress { retries: 0, max_retries: 2, fresh_retries: 1 };
        assert_eq!(decide(Failure::Error(StaleConnection), GET, again), Decision::OtherBackend { budgeted: true });
        let exhausted = Progress { retries: 0, max_retries: 0, fresh_retries: 1 };
        assert_eq!(decide(Failure::Error(StaleConnection), GET, exhausted), Decision::GiveUp);
        // A POST may have been processed before the close: never repeated.
        assert_eq!(decide(Failure::Error(StaleConnection), POST, first(2)), Decision::GiveUp);
    }
}
