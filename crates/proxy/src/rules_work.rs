//! The work a route's rules leave for off the request path
//! ([`tidegate_rules::Work`]): password checks, on a blocking thread, and
//! forward-auth sub-requests. [`crate::pipeline::settle`] runs a chain's
//! pending steps with [`run`].

use http::Method;
use tidegate_rules::{Forward, Work, WorkResult};
use tokio::sync::Semaphore;

use crate::pipeline::{self, Facts, Local, Ruled, Settings};

/// Password checks running at once, across the process. bcrypt and argon2
/// are slow on purpose (tens of milliseconds each): a flood of attempts
/// waits here, in turn, instead of taking every core from the requests
/// the proxy forwards.
const CONCURRENT_CHECKS: usize = 4;

static CHECKS: Semaphore = Semaphore::const_new(CONCURRENT_CHECKS);

/// Settles a request's rules ([`pipeline::settle`] doing its work with
/// [`run`]): at once when nothing waits; else in a future of its own on
/// the heap (a password check's or a sub-request's state is large, and
/// rare: the request's own future stays small).
pub(crate) async fn settle(
    ruled: Ruled,
    facts: &Facts<'_>,
    method: &Method,
    settings: &Settings,
) -> Result<Option<Box<Forward>>, Local> {
    match ruled {
        Ruled::None => Ok(None),
        Ruled::Forward(edits) => Ok(Some(edits)),
        pending => Box::pin(pipeline::settle(pending, facts, method, settings, run)).await,
    }
}

/// Does `work`; `None` when it could not be done (the caller refuses the
/// request: an auth step never lets a request through on an error).
pub(crate) async fn run(work: Work) -> Option<WorkResult> {
    match work {
        Work::Password(check) => {
            let _turn = CHECKS.acquire().await.ok()?;
            let verdict = tokio::task::spawn_blocking(move || check.verify()).await.ok()?;
            Some(WorkResult::Password(verdict))
        }
        Work::ForwardAuth(call) => match crate::forward_auth::ask(&call).await {
            Ok(answer) => Some(WorkResult::ForwardAuth(answer)),
            Err(e) => {
                tracing::debug!(error = %e, "forward auth: no answer; the request is refused");
                None
            }
        },
    }
}
