//! Word that a new snapshot was published, for the background tasks that
//! follow the configuration (health probes, load sources): they sleep until
//! a snapshot changes instead of looking at a timer's pace, so an idle
//! proxy does not wake to find nothing new.

use tokio::sync::watch;

/// The writer's side: announces each snapshot it publishes.
#[derive(Debug)]
pub struct Publications(watch::Sender<u64>);

/// A follower's side: waits for the next publication. Cheap to clone; each
/// clone keeps its own place.
#[derive(Debug, Clone)]
pub struct Changes(watch::Receiver<u64>);

impl Publications {
    /// A new channel; the snapshot current at the start counts as revision
    /// `revision`, already seen by every follower.
    pub fn new(revision: u64) -> Publications {
        Publications(watch::Sender::new(revision))
    }

    /// Announces the snapshot of `revision`, just stored. Followers that
    /// were busy when several were announced wake once.
    pub fn announce(&self, revision: u64) {
        self.0.send_replace(revision);
    }

    /// A follower that has seen every announcement so far.
    pub fn follow(&self) -> Changes {
        Changes(self.0.subscribe())
    }
}

impl Changes {
    /// Waits until a snapshot is published after the last one this
    /// follower saw, and returns its revision. Once the writer is gone
    /// nothing new can be published, and this waits forever.
    pub async fn next(&mut self) -> u64 {
        if self.0.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
        *self.0.borrow_and_update()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn now_or_never<F: std::future::Future>(f: F) -> Option<F::Output> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        rt.block_on(async { tokio::time::timeout(Duration::from_millis(20), f).await.ok() })
    }

    #[test]
    fn a_follower_wakes_once_for_a_burst_and_sees_the_newest() {
        let publications = Publications::new(7);
        let mut changes = publications.follow();
        assert_eq!(now_or_never(changes.next()), None, "the starting snapshot is already seen");
        publications.announce(8);
        publications.announce(9);
        assert_eq!(now_or_never(changes.next()), Some(9));
        assert_eq!(now_or_never(changes.next()), None);
    }

    #[test]
    fn a_follower_of_a_writer_that_is_gone_waits_instead_of_spinning() {
        let publications = Publications::new(1);
        let mut changes = publications.follow();
        drop(publications);
        assert_eq!(now_or_never(changes.next()), None);
    }
}
