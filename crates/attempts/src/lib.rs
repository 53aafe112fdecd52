//! The attempts of one request: pick a backend, send, and decide what
//! follows a failure, until a backend answers or [`decide`] says to stop.
//!
//! The loop is the same whatever carries the request (hyper, or the
//! native HTTP/1 path); what one attempt does on the wire is the
//! [`Exchange`]'s. Passive health, the backend slot (in flight,
//! `max_conns`), the response timeout, ORCA reports, shed answers (a 503
//! another backend may improve on) and the retry budget are handled here,
//! once.

//!
//! The crate does no IO: an [`Exchange`] carries each attempt on the wire
//! (the proxy's engines implement it), and the loop only picks, waits,
//! times and decides, so the unit tests drive every retry and shedding
//! path with a scripted exchange.

pub mod error;
pub mod pick;
pub mod retry;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tidegate_balance::{clock, orca, record_outcome, Backend, Outcome, RequestCtx};
use tidegate_model::PolicySpec;
use tidegate_snapshot::{ServiceLive, ServiceRuntime};
use tokio::time::Instant;

pub use crate::error::{ErrorKind, FramingError, Retry, Source};
use crate::pick::{pick_or_wait, Queue, Slot};
use crate::retry::{decide, Decision, Failure, Progress};

/// One request as its carrier sends it to backends.
pub trait Exchange {
    /// A backend's answer: the response head, and what its body arrives on.
    type Answer;

    /// What the request allows retries to do.
    fn request(&self) -> crate::retry::Request;

    /// Whether the request can be sent (again): a streamed body that an
    /// attempt started to send is gone.
    fn sendable(&self) -> bool;

    /// Sends the request to `backend` (on a new connection when `fresh`)
    /// and waits for the response head, until `deadline` (the service's
    /// response timeout; past it, [`ErrorKind::ResponseTimeout`]).
    fn send(
        &mut self,
        backend: &Arc<Backend>,
        service: &ServiceRuntime,
        fresh: bool,
        deadline: Instant,
    ) -> impl Future<Output = Result<Self::Answer, ErrorKind>>;

    /// The answer's status code.
    fn status(answer: &Self::Answer) -> u16;

    /// The answer's ORCA load report header value, if any.
    fn orca(answer: &Self::Answer) -> Option<&[u8]>;

    /// When the last attempt finished streaming the client's body, if it
    /// streamed one: the backend's own time starts there, not while the
    /// client was still sending.
    fn body_sent(&self) -> Option<Instant> {
        None
    }
}

/// A backend's answer with the slot it holds (in flight until the
/// exchange ends).
pub struct Answered<A> {
    /// What the exchange got back.
    pub answer: A,
    /// The backend's slot, released when the exchange ends.
    pub slot: Slot,
}

/// What the attempts of one request did, for its access-log line.
#[derive(Debug, Default)]
pub struct Trace {
    /// Attempts sent (retries included: those beyond the first are
    /// counted in `tidegate_retries_total` when the request is finished).
    pub attempts: u32,
    /// The backend of the last attempt.
    pub backend: Option<Arc<Backend>>,
    /// Each attempt, when the request is traced (`Some`, empty, before the
    /// attempts run); `None`: not recorded.
    pub record: Option<Vec<AttemptRecord>>,
}

/// One attempt as a trace records it.
#[derive(Debug, Clone)]
pub struct AttemptRecord {
    /// The backend it went to.
    pub backend: Arc<Backend>,
    /// When it started waiting for room in the service's queue, if it had
    /// to wait.
    pub queued_at: Option<Instant>,
    /// When it was sent.
    pub sent: Instant,
    /// When the backend's answer head came, or the attempt failed.
    pub ended: Instant,
    /// The backend's status, or why the attempt failed.
    pub result: Result<u16, ErrorKind>,
    /// Sent on a new connection after a kept-alive one was found closed.
    pub fresh: bool,
}

/// How one attempt ended, as passive health sees it: `None` when the
/// backend is not to blame (the client broke the exchange, or a pooled
/// connection raced its idle close).
fn outcome_of(result: &Result<u16, ErrorKind>) -> Option<Outcome> {
    match result {
        Ok(status) => Some(match status {
            429 | 503 => Outcome::Overloaded,
            s if *s >= 500 => Outcome::Failure,
            _ => Outcome::Success,
        }),
        Err(ErrorKind::ConnectTimeout | ErrorKind::ResponseTimeout) => Some(Outcome::TimedOut),
        Err(kind) if kind.blames_backend() => Some(Outcome::Failure),
        Err(_) => None,
    }
}

/// Runs the attempts of one request against `service`. `first`: a backend
/// chosen before the policy (an external distributor's answer). Returns the
/// first answer that is not a shed 503; if every attempt fails, the last
/// shed 503, else the last error.
pub async fn run<E: Exchange>(
    service: &ServiceRuntime,
    ex: &mut E,
    ctx: &RequestCtx<'_>,
    mut first: Option<Arc<Backend>>,
    trace: &mut Trace,
) -> Result<Answered<E::Answer>, ErrorKind> {
    let settings = &service.settings;
    let reads_orca =
        settings.load_metrics.orca || matches!(settings.policy, PolicySpec::OrcaWrr(_) | PolicySpec::Prequal(_));
    let mut tried: smallvec::SmallVec<[Arc<Backend>; 2]> = smallvec::SmallVec::new();
    let mut queue = Queue::new(settings.queue.timeout_ms);
    let mut progress = Progress { retries: 0, max_retries: settings.retries, fresh_retries: 0 };
    let mut _retry_token = None;
    // What the client gets when no attempt succeeds.
    let mut last = ErrorKind::NoBackend;
    let mut shed: Option<Answered<E::Answer>> = None;
    let mut same_backend: Option<Arc<Backend>> = None;
    loop {
        let fresh = same_backend.is_some();
        // One clock read for the pick and the attempt (its latency and its
        // deadline), and a traced request's queue wait; read again below
        // when the pick waited in the queue.
        let mut now = Instant::now();
        let asked = trace.record.is_some().then_some(now);
        let backend = match same_backend.take() {
            Some(b) => b,
            None => {
                let picked = match first.take() {
                    Some(b) => Some(b),
                    None => {
                        let at = clock::ms_at(now.into_std());
                        let picked = pick_or_wait(service, ctx, &tried, &mut queue, at).await?;
                        if queue.waiting.is_some() {
                            now = Instant::now();
                        }
                        picked
                    }
                };
                let Some(b) = picked else { break };
                tried.push(b.clone());
                b
            }
        };
        if !ex.sendable() {
            break;
        }
        trace.attempts += 1;
        let slot = Slot::take(&backend, service, now.into_std());
        // The slot is taken: leaving the queue now passes the turn on.
        let waited = queue.waiting.take().is_some();
        let (result, slot) = attempt(service, ex, &backend, fresh, slot, now).await;
        if let Some(record) = &mut trace.record {
            let queued_at = asked.filter(|_| waited);
            let result = match &result {
                Ok(answer) => Ok(E::status(answer)),
                Err(kind) => Err(*kind),
            };
            record.push(AttemptRecord {
                backend: backend.clone(),
                queued_at,
                sent: now,
                ended: Instant::now(),
                result,
                fresh,
            });
        }
        let failure = match result {
            Ok(answer) => {
                if reads_orca {
                    read_orca(E::orca(&answer), &backend);
                }
                if E::status(&answer) != 503 {
                    trace.backend = Some(backend);
                    return Ok(Answered { answer, slot });
                }
                // The backend shed the request: another one may take it;
                // if none can, the client gets this 503. The backend is
                // done with it: its place goes back now, not when the
                // request ends.
                let mut slot = slot;
                slot.release();
                shed = Some(Answered { answer, slot });
                Failure::Shed
            }
            Err(kind) => {
                tracing::debug!(backend = %backend.addr, error = kind.name(), "upstream attempt failed");
                last = kind;
                Failure::Error(kind)
            }
        };
        match decide(failure, ex.request(), progress) {
            Decision::GiveUp => break,
            Decision::SameBackendFreshConnection => {
                progress.fresh_retries += 1;
                same_backend = Some(backend);
            }
            Decision::OtherBackend { budgeted } => {
                if budgeted {
                    // The budget bounds the extra work retries put on
                    // backends; a request that reached none costs none.
                    let in_flight = service.selector.backends().iter().map(|b| b.stats.in_flight()).sum();
                    if !service.live.try_retry(&settings.retry_budget, in_flight) {
                        break;
                    }
                    _retry_token = Some(RetryToken(&service.live));
                }
                progress.retries += 1;
            }
        }
    }
    trace.backend = tried.pop();
    shed.ok_or(last)
}

/// One attempt against one backend (whose `slot` the caller took at
/// `started`), within the service's response timeout.
/// Records the outcome for passive health when the backend is to blame.
async fn attempt<E: Exchange>(
    service: &ServiceRuntime,
    ex: &mut E,
    backend: &Arc<Backend>,
    fresh: bool,
    mut slot: Slot,
    started: Instant,
) -> (Result<E::Answer, ErrorKind>, Slot) {
    let settings = &service.settings;
    let deadline = started + Duration::from_millis(settings.timeouts.response_ms);
    let result = ex.send(backend, service, fresh, deadline).await;
    if let Some(sent) = ex.body_sent() {
        // The latency the learned limit and the policies read is the
        // backend's: from the end of a streamed body, not the client's
        // upload time.
        slot.rebase(sent.into_std());
    }
    if result.is_ok() {
        slot.answered();
    }
    let seen = result.as_ref().map(E::status).map_err(|k| *k);
    if let Some(outcome) = outcome_of(&seen) {
        slot.record(outcome);
        let pool = service.selector.backends();
        if record_outcome(backend, outcome, clock::now_ms, &settings.health.passive, pool) {
            tracing::warn!(service = %service.name, backend = %backend.id, addr = %backend.addr, "backend ejected after consecutive failures");
        }
    }
    (result, slot)
}

/// Stores an ORCA load report carried by a response (a Prequal probe
/// answer too, when it reports requests in flight).
fn read_orca(header: Option<&[u8]>, backend: &Backend) {
    let report = header.and_then(|v| std::str::from_utf8(v).ok()).and_then(orca::parse);
    if let Some(r) = report {
        let now = clock::now_ms();
        r.apply(&backend.stats.load, now);
        if let Some((rif, latency_ms)) = r.probe() {
            let own = || backend.stats.latency_ewma().map_or(0.0, |d| d.as_secs_f64() * 1e3);
            backend.stats.probe.store(rif, latency_ms.unwrap_or_else(own), now);
        }
    }
}

/// A retry admitted by the service's retry budget, returned when dropped.
struct RetryToken<'a>(&'a ServiceLive);

impl Drop for RetryToken<'_> {
    fn drop(&mut self) {
        self.0.retry_done();
    }
}

/// Whether a request with this method may be sent twice (RFC 9110,
/// section 9.2.2).
pub fn is_idempotent(method: &[u8]) -> bool {
    matches!(method, b"GET" | b"HEAD" | b"OPTIONS" | b"TRACE" | b"PUT" | b"DELETE")
}

#[cfg(test)]
mod tests;
