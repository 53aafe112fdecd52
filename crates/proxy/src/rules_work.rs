//! The work a route's rules leave for off the request path
//! ([`tidegate_rules::Work`]): password checks, on a blocking thread, and
//! forward-auth sub-requests. [`crate::pipeline::settle`] runs a chain's
//! pending steps with [`run`].

use tidegate_rules::{Work, WorkResult};
use tokio::sync::Semaphore;

/// Password checks running at once, across the process. bcrypt and argon2
/// are slow on purpose (tens of milliseconds each): a flood of attempts
/// waits here, in turn, instead of taking every core from the requests
/// the proxy forwards.
const CONCURRENT_CHECKS: usize = 4;

static CHECKS: Semaphore = Semaphore::const_new(CONCURRENT_CHECKS);

/// Does `work`; `None` when it could not be done (the caller refuses the
/// request: an auth step never lets a request through on an error).
pub(crate) async fn run(work: Work) -> Option<WorkResult> {
    match work {
        Work::Password(check) => {
            let _turn = CHECKS.acquire().await.ok()?;
            let verdict = tokio::task::spawn_blocking(move || check.verify()).await.ok()?;
            Some(WorkResult::Password(verdict))
        }
        Work::ForwardAuth(_) => None,
    }
}
