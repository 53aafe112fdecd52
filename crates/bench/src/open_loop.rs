//! The open-loop driver: starts event `i` at its scheduled time whatever
//! the earlier events are doing, so a slow answer never delays the next
//! send (no coordinated omission).
//!
//! Timing runs on a dedicated OS thread that sleeps with the OS timer
//! (tens of microseconds of slack) instead of tokio's millisecond timer
//! wheel; each event runs as its own task on the runtime. Its measurement
//! starts from the scheduled time, which the task receives.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::{mpsc, oneshot};

use crate::report::{self, Latency, Summary};
use crate::schedule::Schedule;

/// How the sending went, independent of what was sent.
#[derive(Debug, Serialize)]
pub struct Sending {
    /// Events in the schedule.
    pub planned: u64,
    /// Events started.
    pub sent: u64,
    /// Events not started because `max_in_flight` were still running.
    pub skipped_in_flight_cap: u64,
    /// Events started whose result never came back before the grace period ended.
    pub unfinished: u64,
    /// Events started per second over the actual sending window.
    pub achieved_rate: f64,
    /// From start until the last event was started, in seconds.
    pub send_window_s: f64,
    /// How late each event started versus its schedule (generator precision).
    pub send_lag_us: Summary,
}

/// What the scheduler thread reports back.
struct Scheduled {
    sent: u64,
    skipped: u64,
    lag: Latency,
    window: Duration,
}

/// Runs `plan`: for each event, calls `start_one(i, scheduled_at)` on the
/// timing thread and spawns the future it returns; `done` receives every
/// result. Waits at most `grace` after the last start for stragglers.
pub async fn run<T, F, Fut>(
    plan: impl Schedule,
    max_in_flight: usize,
    grace: Duration,
    start_one: F,
    mut done: impl FnMut(T),
) -> anyhow::Result<Sending>
where
    T: Send + 'static,
    F: Fn(u64, Instant) -> Fut + Send + 'static,
    Fut: Future<Output = T> + Send + 'static,
{
    let planned = plan.count();
    let handle = tokio::runtime::Handle::current();
    let (results_tx, mut results) = mpsc::unbounded_channel::<T>();
    let (stats_tx, mut stats_rx) = oneshot::channel::<Scheduled>();
    let in_flight = Arc::new(AtomicUsize::new(0));
    let max_in_flight = max_in_flight.max(1);

    let counter = Arc::clone(&in_flight);
    std::thread::Builder::new().name("bench-schedule".to_owned()).spawn(move || {
        // `start_one` may build runtime objects (timers) right away.
        let _runtime = handle.enter();
        let start = Instant::now();
        let mut sched = Scheduled { sent: 0, skipped: 0, lag: Latency::new(), window: Duration::ZERO };
        for i in 0..plan.count() {
            let at = start + plan.offset(i);
            sleep_until(at);
            if counter.load(Ordering::Acquire) >= max_in_flight {
                sched.skipped += 1;
                continue;
            }
            counter.fetch_add(1, Ordering::AcqRel);
            let fut = start_one(i, at);
            let tx = results_tx.clone();
            let counter = Arc::clone(&counter);
            handle.spawn(async move {
                let value = fut.await;
                counter.fetch_sub(1, Ordering::AcqRel);
                let _ = tx.send(value);
            });
            sched.lag.record(Instant::now().saturating_duration_since(at));
            sched.sent += 1;
        }
        sched.window = start.elapsed();
        let _ = stats_tx.send(sched);
    })?;

    let mut scheduled: Option<Scheduled> = None;
    let mut deadline: Option<tokio::time::Instant> = None;
    loop {
        let grace_over = async move {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            value = results.recv() => match value {
                Some(value) => done(value),
                None => break,
            },
            stats = &mut stats_rx, if scheduled.is_none() => {
                let stats = stats.map_err(|_| anyhow::anyhow!("the scheduling thread died"))?;
                scheduled = Some(stats);
                deadline = Some(tokio::time::Instant::now() + grace);
            },
            () = grace_over => break,
        }
    }
    // `results` only closes once the scheduler dropped its sender, after
    // sending its stats; a break on the grace deadline comes after them too.
    let sched = match scheduled {
        Some(s) => s,
        None => stats_rx.await.map_err(|_| anyhow::anyhow!("the scheduling thread died"))?,
    };
    Ok(Sending {
        planned,
        sent: sched.sent,
        skipped_in_flight_cap: sched.skipped,
        unfinished: in_flight.load(Ordering::Acquire) as u64,
        achieved_rate: report::per_second(sched.sent, sched.window),
        send_window_s: report::seconds(sched.window),
        send_lag_us: sched.lag.summary(),
    })
}

/// Sleeps the current OS thread until `at` (already past: returns at once).
fn sleep_until(at: Instant) {
    loop {
        let now = Instant::now();
        if now >= at {
            return;
        }
        std::thread::sleep(at - now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::Plan;

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn slow_events_do_not_delay_later_ones() {
        // Every event takes 300 ms; at 100/s they overlap heavily, yet all
        // start on time and all results come back.
        let plan = Plan::new(100.0, 0.2).unwrap();
        let mut got = Vec::new();
        let sending = run(
            plan,
            1000,
            Duration::from_secs(2),
            |i, at| async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                (i, at)
            },
            |v| got.push(v),
        )
        .await
        .unwrap();
        assert_eq!(sending.sent, 20);
        assert_eq!(sending.unfinished, 0);
        assert_eq!(got.len(), 20);
        assert!(sending.send_window_s < 0.29, "{}", sending.send_window_s);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn the_in_flight_cap_skips_instead_of_waiting() {
        let plan = Plan::new(100.0, 0.1).unwrap();
        let sending =
            run(plan, 3, Duration::from_secs(2), |_, _| tokio::time::sleep(Duration::from_millis(500)), |()| {})
                .await
                .unwrap();
        assert_eq!(sending.sent, 3);
        assert_eq!(sending.skipped_in_flight_cap, 7);
    }
}
