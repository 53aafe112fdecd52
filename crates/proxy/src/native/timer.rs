//! One timer per connection for every deadline it has (first request,
//! idle gap, body pieces), re-armed lazily: moving a deadline later costs
//! nothing until the timer fires, so a keep-alive connection pays for one
//! timer reset per timeout period, not one per request.

use std::future::Future;
use std::pin::Pin;

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
    pub(crate) async fn run<F: Future>(&mut self, deadline: Instant, fut: F) -> Option<F::Output> {
        if self.sleep.deadline() > deadline {
            self.sleep.as_mut().reset(deadline);
        }
        let mut fut = std::pin::pin!(fut);
        loop {
            tokio::select! {
                biased;
                out = &mut fut => return Some(out),
                () = self.sleep.as_mut() => {
                    if Instant::now() >= deadline {
                        // Parked far away until the next deadline is set.
                        self.sleep.as_mut().reset(far_future());
                        return None;
                    }
                    // It fired for an older, earlier deadline.
                    self.sleep.as_mut().reset(deadline);
                }
            }
        }
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
