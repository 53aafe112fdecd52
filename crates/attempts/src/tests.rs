//! The attempt loop driven in-process by a scripted [`Exchange`]: every
//! retry and shedding path, without sockets.

use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use http::HeaderMap;
use tidegate_balance::{Backend, RequestCtx};
use tidegate_model::{
    BackendAddr, BackendId, BackendSpec, MaxConns, Percent, QueueSpec, RetryBudget, ServiceName, ServiceSettings,
    ServiceSpec, Weight,
};
use tidegate_snapshot::ServiceRuntime;
use tokio::time::Instant;

use super::{run, Answered, Exchange, Trace};
use crate::error::ErrorKind::{self, *};
use crate::retry::{Request, MAX_FRESH_RETRIES};

const GET: Request = Request { idempotent: true, replayable: true };
const POST: Request = Request { idempotent: false, replayable: true };

/// What one attempt does.
#[derive(Debug, Clone, Copy)]
enum Step {
    /// The backend answers with this status.
    Answer(u16),
    /// The attempt fails with this error.
    Fail(ErrorKind),
}

/// One attempt as the loop made it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Call {
    backend: String,
    fresh: bool,
}

/// An exchange that plays a script: the n-th attempt, whatever its
/// backend, gets the n-th step; attempts beyond the script answer 200.
struct Scripted {
    request: Request,
    script: VecDeque<Step>,
    calls: Vec<Call>,
    /// The deadline each attempt was given, and when it was sent.
    deadlines: Vec<(Instant, Instant)>,
}

impl Scripted {
    fn new(request: Request, script: &[Step]) -> Scripted {
        Scripted { request, script: script.iter().copied().collect(), calls: Vec::new(), deadlines: Vec::new() }
    }

    fn backends(&self) -> Vec<&str> {
        self.calls.iter().map(|c| c.backend.as_str()).collect()
    }
}

impl Exchange for Scripted {
    type Answer = u16;

    fn request(&self) -> Request {
        self.request
    }

    fn sendable(&self) -> bool {
        true
    }

    async fn send(
        &mut self,
        backend: &Arc<Backend>,
        _service: &ServiceRuntime,
        fresh: bool,
        deadline: Instant,
    ) -> Result<u16, ErrorKind> {
        self.calls.push(Call { backend: backend.id.as_str().to_owned(), fresh });
        self.deadlines.push((Instant::now(), deadline));
        // An attempt is in flight while it is sent.
        assert!(backend.stats.in_flight() >= 1, "attempt sent without a slot");
        match self.script.pop_front().unwrap_or(Step::Answer(200)) {
            Step::Answer(status) => Ok(status),
            Step::Fail(kind) => Err(kind),
        }
    }

    fn status(answer: &u16) -> u16 {
        *answer
    }

    fn orca(_: &u16) -> Option<&[u8]> {
        None
    }
}

/// A service of `n` backends `b0..`, round robin, where one blamed
/// failure ejects a backend (so "passive health unchanged" is visible).
fn service(n: usize, edit: impl FnOnce(&mut ServiceSettings, &mut BackendSpec)) -> ServiceRuntime {
    let mut settings = ServiceSettings::default();
    settings.health.passive.consecutive_failures = 1;
    settings.health.passive.max_ejected_percent = Percent::new(100).expect("a percentage");
    let mut template = BackendSpec {
        addr: BackendAddr::new("127.0.0.1:1").unwrap(),
        weight: Weight::try_from(1).unwrap(),
        backup: false,
        max_conns: None,
        autoscaled: false,
        dns: false,
    };
    edit(&mut settings, &mut template);
    let backends = (0..n)
        .map(|i| {
            let spec = BackendSpec { addr: BackendAddr::new(&format!("127.0.0.1:{}", 1000 + i)).unwrap(), ..template };
            (BackendId::new(&format!("b{i}")).unwrap(), spec)
        })
        .collect();
    ServiceRuntime::build(ServiceName::new("svc").unwrap(), &ServiceSpec { settings, backends }, None)
}

fn backend(service: &ServiceRuntime, id: &str) -> Arc<Backend> {
    service.selector.backends().iter().find(|b| b.id.as_str() == id).cloned().unwrap()
}

/// Blamed failures counted by passive health (each one ejects).
fn ejections(service: &ServiceRuntime, id: &str) -> u64 {
    backend(service, id).stats.view().ejections_total
}

fn failures(service: &ServiceRuntime, id: &str) -> u64 {
    backend(service, id).stats.view().failures
}

async fn go(
    service: &ServiceRuntime,
    ex: &mut Scripted,
    first: Option<Arc<Backend>>,
) -> (Result<Answered<u16>, ErrorKind>, Trace) {
    let headers = HeaderMap::new();
    let ctx = RequestCtx::new(None, "/", &headers);
    let mut trace = Trace::default();
    let result = run(service, ex, &ctx, first, &mut trace).await;
    (result, trace)
}

fn status(result: &Result<Answered<u16>, ErrorKind>) -> Result<u16, ErrorKind> {
    result.as_ref().map(|a| a.answer).map_err(|k| *k)
}

#[tokio::test]
async fn a_connect_failure_is_retried_on_another_backend_even_for_a_post_and_without_budget() {
    // No retry budget at all: a request that reached no backend retries
    // for free.
    let svc = service(2, |s, _| {
        s.retry_budget = RetryBudget { percent: Percent::new(0).expect("a percentage"), min_concurrent: 0 }
    });
    let mut ex = Scripted::new(POST, &[Step::Fail(ConnectFailed)]);
    let (result, trace) = go(&svc, &mut ex, None).await;
    assert_eq!(status(&result), Ok(200));
    let tried = ex.backends();
    assert_eq!(tried.len(), 2);
    assert_ne!(tried[0], tried[1], "the retry goes to another backend");
    assert!(ex.calls.iter().all(|c| !c.fresh));
    assert_eq!(trace.attempts, 2);
    assert_eq!(trace.backend.as_ref().unwrap().id.as_str(), tried[1]);
    // The refused connection blames its backend, the answer clears the other.
    assert_eq!(ejections(&svc, tried[0]), 1);
    assert_eq!(ejections(&svc, tried[1]), 0);
    assert_eq!(svc.live.retries_refused.load(Relaxed), 0);
}

#[tokio::test]
async fn a_request_sent_and_broken_off_is_retried_only_when_idempotent() {
    let svc = service(2, |_, _| {});
    let mut post = Scripted::new(POST, &[Step::Fail(UpstreamClosed)]);
    let (result, trace) = go(&svc, &mut post, None).await;
    assert_eq!(status(&result), Err(UpstreamClosed));
    assert_eq!(post.calls.len(), 1, "a POST the backend may have processed is not repeated");
    assert_eq!(trace.attempts, 1);
    assert_eq!(ejections(&svc, post.backends()[0]), 1);

    let svc = service(2, |_, _| {});
    let mut get = Scripted::new(GET, &[Step::Fail(UpstreamClosed)]);
    let (result, trace) = go(&svc, &mut get, None).await;
    assert_eq!(status(&result), Ok(200));
    let tried = get.backends();
    assert_eq!(tried.len(), 2);
    assert_ne!(tried[0], tried[1]);
    assert_eq!(trace.attempts, 2);
    // The budgeted retry's token went back when the request ended.
    assert_eq!(svc.live.retries_in_flight.load(Relaxed), 0);
}

#[tokio::test]
async fn an_invalid_response_is_retried_like_a_close() {
    let svc = service(2, |_, _| {});
    let mut get = Scripted::new(GET, &[Step::Fail(InvalidResponse)]);
    let (result, _) = go(&svc, &mut get, None).await;
    assert_eq!(status(&result), Ok(200));
    assert_eq!(get.calls.len(), 2);
    let mut post = Scripted::new(POST, &[Step::Fail(InvalidResponse)]);
    let (result, _) = go(&svc, &mut post, None).await;
    assert_eq!(status(&result), Err(InvalidResponse));
    assert_eq!(post.calls.len(), 1);
}

#[tokio::test]
async fn a_stale_connection_is_retried_on_the_same_backend_on_a_fresh_connection() {
    let svc = service(2, |_, _| {});
    let mut ex = Scripted::new(GET, &[Step::Fail(StaleConnection)]);
    let (result, trace) = go(&svc, &mut ex, None).await;
    assert_eq!(status(&result), Ok(200));
    let b = ex.calls[0].backend.clone();
    assert_eq!(ex.calls, vec![Call { backend: b.clone(), fresh: false }, Call { backend: b.clone(), fresh: true }]);
    assert_eq!(trace.attempts, 2);
    // The keep-alive race is not the backend's fault.
    assert_eq!(ejections(&svc, &b), 0);
    assert_eq!(failures(&svc, &b), 0);
}

#[tokio::test]
async fn fresh_connection_retries_are_bounded_then_another_backend_is_tried() {
    assert_eq!(MAX_FRESH_RETRIES, 1);
    let svc = service(2, |_, _| {});
    let mut ex = Scripted::new(GET, &[Step::Fail(StaleConnection), Step::Fail(StaleConnection)]);
    let (result, _) = go(&svc, &mut ex, None).await;
    assert_eq!(status(&result), Ok(200));
    let b = ex.calls[0].backend.clone();
    assert_eq!(ex.calls.len(), 3);
    assert_eq!(ex.calls[1], Call { backend: b.clone(), fresh: true });
    assert_ne!(ex.calls[2].backend, b, "a second stale connection moves on");
    assert!(!ex.calls[2].fresh);

    // Without retries to other backends, the second stale connection is final.
    let svc = service(2, |s, _| s.retries = 0);
    let script = [Step::Fail(StaleConnection), Step::Fail(StaleConnection), Step::Fail(StaleConnection)];
    let mut ex = Scripted::new(GET, &script);
    let (result, trace) = go(&svc, &mut ex, None).await;
    assert_eq!(status(&result), Err(StaleConnection));
    assert_eq!(ex.calls.len(), 2);
    assert_eq!(trace.attempts, 2);
    assert!(ex.calls[1].fresh);
}

#[tokio::test]
async fn a_stale_connection_is_not_retried_for_a_post() {
    let svc = service(2, |_, _| {});
    let mut ex = Scripted::new(POST, &[Step::Fail(StaleConnection)]);
    let (result, _) = go(&svc, &mut ex, None).await;
    assert_eq!(status(&result), Err(StaleConnection));
    assert_eq!(ex.calls.len(), 1);
}

#[tokio::test]
async fn a_shed_answer_is_tried_elsewhere() {
    let svc = service(2, |_, _| {});
    let mut ex = Scripted::new(GET, &[Step::Answer(503)]);
    let (result, trace) = go(&svc, &mut ex, None).await;
    assert_eq!(status(&result), Ok(200));
    let tried = ex.backends();
    assert_eq!(tried.len(), 2);
    assert_ne!(tried[0], tried[1]);
    assert_eq!(trace.backend.as_ref().unwrap().id.as_str(), tried[1]);
    // Shedding is not breakage.
    assert_eq!(ejections(&svc, tried[0]), 0);
}

#[tokio::test]
async fn the_last_shed_answer_is_returned_when_no_backend_does_better() {
    let svc = service(3, |_, _| {});
    let mut ex = Scripted::new(GET, &[Step::Answer(503), Step::Fail(ConnectFailed), Step::Answer(503)]);
    let (result, trace) = go(&svc, &mut ex, None).await;
    // A 503 from a backend beats the connect error that came between.
    let answered = result.unwrap();
    assert_eq!(answered.answer, 503);
    assert_eq!(ex.calls.len(), 3);
    assert_eq!(trace.attempts, 3);
    // Every backend is done with the request: the kept 503 holds no slot.
    for b in svc.selector.backends() {
        assert_eq!(b.stats.in_flight(), 0, "{}", b.id.as_str());
    }
    drop(answered);

    // A shed POST is not repeated: its 503 goes to the client.
    let mut post = Scripted::new(POST, &[Step::Answer(503)]);
    let (result, _) = go(&svc, &mut post, None).await;
    assert_eq!(status(&result), Ok(503));
    assert_eq!(post.calls.len(), 1);
}

#[tokio::test]
async fn an_exhausted_retry_budget_stops_retries() {
    let svc = service(2, |s, _| {
        s.retry_budget = RetryBudget { percent: Percent::new(0).expect("a percentage"), min_concurrent: 0 }
    });
    let mut ex = Scripted::new(GET, &[Step::Fail(UpstreamClosed)]);
    let (result, trace) = go(&svc, &mut ex, None).await;
    assert_eq!(status(&result), Err(UpstreamClosed));
    assert_eq!(ex.calls.len(), 1);
    assert_eq!(trace.attempts, 1);
    assert_eq!(svc.live.retries_refused.load(Relaxed), 1);

    // The same for a shed answer: the 503 is returned.
    let mut ex = Scripted::new(GET, &[Step::Answer(503)]);
    let (result, _) = go(&svc, &mut ex, None).await;
    assert_eq!(status(&result), Ok(503));
    assert_eq!(ex.calls.len(), 1);
    assert_eq!(svc.live.retries_refused.load(Relaxed), 2);

    // Retries already in flight take the budget's room.
    let svc = service(2, |s, _| {
        s.retry_budget = RetryBudget { percent: Percent::new(0).expect("a percentage"), min_concurrent: 1 }
    });
    svc.live.retries_in_flight.store(1, Relaxed);
    let mut ex = Scripted::new(GET, &[Step::Fail(UpstreamClosed)]);
    let (result, _) = go(&svc, &mut ex, None).await;
    assert_eq!(status(&result), Err(UpstreamClosed));
    assert_eq!(ex.calls.len(), 1);
    svc.live.retries_in_flight.store(0, Relaxed);
    let mut ex = Scripted::new(GET, &[Step::Fail(UpstreamClosed)]);
    let (result, _) = go(&svc, &mut ex, None).await;
    assert_eq!(status(&result), Ok(200));
    assert_eq!(ex.calls.len(), 2);
    assert_eq!(svc.live.retries_in_flight.load(Relaxed), 0, "the token went back");
}

#[tokio::test]
async fn retries_stop_at_the_services_limit() {
    let svc = service(4, |s, _| s.retries = 2);
    let script = [Step::Fail(ConnectFailed); 4];
    let mut ex = Scripted::new(GET, &script);
    let (result, trace) = go(&svc, &mut ex, None).await;
    assert_eq!(status(&result), Err(ConnectFailed));
    assert_eq!(ex.calls.len(), 3);
    assert_eq!(trace.attempts, 3);
    let mut tried = ex.backends();
    tried.sort();
    tried.dedup();
    assert_eq!(tried.len(), 3, "each attempt on a backend not tried yet");
}

#[tokio::test]
async fn every_backend_failing_returns_the_last_error() {
    let svc = service(2, |s, _| s.retries = 5);
    let mut ex = Scripted::new(GET, &[Step::Fail(UpstreamClosed), Step::Fail(ConnectFailed)]);
    let (result, trace) = go(&svc, &mut ex, None).await;
    // Two backends, each tried once: then nothing is left to try.
    assert_eq!(status(&result), Err(ConnectFailed));
    assert_eq!(ex.calls.len(), 2);
    assert_eq!(trace.backend.as_ref().unwrap().id.as_str(), ex.calls[1].backend);

    let empty = service(0, |_, _| {});
    let mut ex = Scripted::new(GET, &[]);
    let (result, trace) = go(&empty, &mut ex, None).await;
    assert_eq!(status(&result), Err(NoBackend));
    assert!(ex.calls.is_empty());
    assert_eq!(trace.attempts, 0);
}

#[tokio::test]
async fn the_distributors_pick_is_tried_first_and_not_again() {
    for id in ["b0", "b1", "b2"] {
        let svc = service(3, |_, _| {});
        let first = backend(&svc, id);
        let mut ex = Scripted::new(GET, &[]);
        let (result, trace) = go(&svc, &mut ex, Some(first)).await;
        assert_eq!(status(&result), Ok(200));
        assert_eq!(ex.backends(), vec![id]);
        assert_eq!(trace.backend.as_ref().unwrap().id.as_str(), id);

        // Failing, it counts as tried: the retry goes to another backend.
        let mut ex = Scripted::new(GET, &[Step::Fail(ConnectFailed), Step::Fail(ConnectFailed)]);
        let (result, _) = go(&svc, &mut ex, Some(backend(&svc, id))).await;
        assert_eq!(status(&result), Ok(200));
        let tried = ex.backends();
        assert_eq!(tried[0], id);
        assert_eq!(tried.len(), 3);
        assert!(!tried[1..].contains(&id), "{tried:?}");
        assert_ne!(tried[1], tried[2]);
    }
}

#[tokio::test]
async fn client_failures_never_blame_a_backend() {
    for kind in [ClientBody, ClientTimeout] {
        let svc = service(2, |_, _| {});
        let mut ex = Scripted::new(GET, &[Step::Fail(kind)]);
        let (result, trace) = go(&svc, &mut ex, None).await;
        assert_eq!(status(&result), Err(kind));
        assert_eq!(ex.calls.len(), 1, "{kind:?} is not retried");
        assert_eq!(trace.attempts, 1);
        for b in svc.selector.backends() {
            let view = b.stats.view();
            assert_eq!(view.failures, 0, "{kind:?}");
            assert_eq!(view.ejections_total, 0, "{kind:?}");
            assert_eq!(view.in_flight, 0);
        }
    }
}

#[tokio::test]
async fn a_response_timeout_is_final_and_blames_the_backend() {
    let svc = service(2, |s, _| s.timeouts.response_ms = 1234);
    let mut ex = Scripted::new(GET, &[Step::Fail(ResponseTimeout)]);
    let (result, trace) = go(&svc, &mut ex, None).await;
    assert_eq!(status(&result), Err(ResponseTimeout));
    assert_eq!(ex.calls.len(), 1);
    assert_eq!(trace.attempts, 1);
    let b = ex.calls[0].backend.clone();
    assert_eq!(failures(&svc, &b), 1);
    assert_eq!(ejections(&svc, &b), 1);
    // The attempt was given the service's response timeout.
    let (sent, deadline) = ex.deadlines[0];
    let given = deadline.duration_since(sent).as_millis();
    assert!((1200..=1234).contains(&given), "{given}");
}

#[tokio::test]
async fn server_errors_other_than_503_are_answers_not_retries() {
    let svc = service(2, |_, _| {});
    let mut ex = Scripted::new(GET, &[Step::Answer(502)]);
    let (result, _) = go(&svc, &mut ex, None).await;
    assert_eq!(status(&result), Ok(502));
    assert_eq!(ex.calls.len(), 1);
    // A 5xx answer counts against the backend's passive health.
    assert_eq!(ejections(&svc, ex.backends()[0]), 1);
    // A 429 is shedding: returned as it is, never blamed.
    let svc = service(2, |_, _| {});
    let mut ex = Scripted::new(GET, &[Step::Answer(429)]);
    let (result, _) = go(&svc, &mut ex, None).await;
    assert_eq!(status(&result), Ok(429));
    assert_eq!(ejections(&svc, ex.backends()[0]), 0);
}

#[tokio::test]
async fn the_answer_holds_its_backends_slot_until_dropped() {
    let svc = service(1, |s, b| {
        b.max_conns = Some(MaxConns::try_from(1).unwrap());
        s.queue = QueueSpec { max: 0, ..QueueSpec::default() };
    });
    let b0 = backend(&svc, "b0");
    let mut ex = Scripted::new(GET, &[]);
    let (held, _) = go(&svc, &mut ex, None).await;
    let held = held.unwrap();
    assert_eq!(b0.stats.in_flight(), 1);
    // The only backend is at its `max_conns` and the queue is off.
    let mut other = Scripted::new(GET, &[]);
    let (result, _) = go(&svc, &mut other, None).await;
    assert_eq!(status(&result), Err(QueueFull));
    assert!(other.calls.is_empty());
    drop(held);
    assert_eq!(b0.stats.in_flight(), 0);
    let (result, _) = go(&svc, &mut other, None).await;
    assert_eq!(status(&result), Ok(200));
}

#[tokio::test]
async fn a_queued_request_takes_the_slot_a_finished_one_gives_back() {
    let svc = Arc::new(service(1, |s, b| {
        b.max_conns = Some(MaxConns::try_from(1).unwrap());
        s.queue = QueueSpec { max: 10, timeout_ms: 10_000 };
    }));
    let mut ex = Scripted::new(GET, &[]);
    let (held, _) = go(&svc, &mut ex, None).await;
    let held = held.unwrap();
    let waiting = {
        let svc = svc.clone();
        tokio::spawn(async move {
            let mut ex = Scripted::new(GET, &[]);
            let (result, _) = go(&svc, &mut ex, None).await;
            (status(&result), ex.calls.len())
        })
    };
    // Poll until the second request is in the queue.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while svc.live.queue.is_empty() {
        assert!(std::time::Instant::now() < deadline, "the request never queued");
        tokio::task::yield_now().await;
    }
    drop(held);
    assert_eq!(waiting.await.unwrap(), (Ok(200), 1));
    assert!(svc.live.queue.is_empty());
}

#[tokio::test]
async fn a_service_without_a_learned_limit_or_cap_never_queues() {
    // With no backend limited, a held answer does not stop the next request.
    let svc = service(1, |s, _| s.concurrency.learn = Some(false));
    let mut ex = Scripted::new(GET, &[]);
    let (held, _) = go(&svc, &mut ex, None).await;
    let _held = held.unwrap();
    let (again, _) = go(&svc, &mut ex, None).await;
    assert_eq!(status(&again), Ok(200));
    assert_eq!(backend(&svc, "b0").stats.in_flight(), 2);
}
