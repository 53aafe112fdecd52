//! One timer per connection for every deadline it has (first request,
//! idle gap, body pieces), re-armed lazily: moving a deadline later costs
//! nothing until the timer fires, so a keep-alive connection pays for one
//! timer reset per timeout period, not one per request.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::time::{Instant, Sleep};

/// A connection's deadline timer.
pub(crate) struct Timer {
    sleep: Pin<Box<Sleep>>,
}

impl Timer {
    /// A timer far in the future.
    pub(crate) fn new() -> Timer {
        Timer { sleep: Box::pin(tokio::time::sleep_until(far_future())) }
    }

    /// Runs `fut` until it completes (`Some`) or `deadline` passes (`None`).
    ///
    /// A future of its own rather than an `async fn`: `fut` stays where
    /// the caller's future put it (an `async fn` would hold it and pin a
    /// second copy of it: a few hundred bytes moved on every read a
    /// connection waits for).
    pub(crate) fn run<F: Future>(&mut self, deadline: Instant, fut: F) -> Run<'_, F> {
        if self.sleep.deadline() > deadline {
            self.sleep.as_mut().reset(deadline);
        }
        Run { sleep: self.sleep.as_mut(), deadline, fut }
    }
}

pin_project_lite::pin_project! {
    /// [`Timer::run`]'s future.
    pub(crate) struct Run<'t, F> {
        sleep: Pin<&'t mut Sleep>,
        deadline: Instant,
        #[pin]
        fut: F,
    }
}

impl<F: Future> Future for Run<'_, F> {
    type Output = Option<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(out) = this.fut.poll(cx) {
            return Poll::Ready(Some(out));
        }
        while this.sleep.as_mut().poll(cx).is_ready() {
            if Instant::now() >= *this.deadline {
                // Parked far away until the next deadline is set.
                this.sleep.as_mut().reset(far_future());
                return Poll::Ready(None);
            }
            // It fired for an older, earlier deadline.
            this.sleep.as_mut().reset(*this.deadline);
        }
        Poll::Pending
    }
}

fn far_future() -> Instant {
    Instant::now() + std::time::Duration::from_secs(86_400 * 365)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn later_deadlines_are_honoured_and_earlier_ones_fire() {
        let mut t = Timer::new();
        let start = Instant::now();
        let done = t.run(start + Duration::from_secs(1), async { 7 }).await;
        assert_eq!(done, Some(7));
        // A later deadline after an earlier one: the timer fires at the old
        // one, re-arms, and the future still gets its whole time.
        let slow = tokio::time::sleep(Duration::from_secs(5));
        assert_eq!(t.run(start + Duration::from_secs(10), slow).await, Some(()));
        let never = std::future::pending::<()>();
        assert_eq!(t.run(Instant::now() + Duration::from_secs(2), never).await, None);
        assert!(Instant::now() >= start + Duration::from_secs(7));
    }
}
