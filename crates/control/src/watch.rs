//! The watch feed: applied change sets from a revision on, replayed from the
//! store's log and then followed live.

use std::sync::Arc;

use tidegate_store::{AppliedChange, StoreError};
use tokio::sync::{broadcast, mpsc};

use crate::Control;

/// Why a watch ended or could not start.
#[derive(Debug, Clone, thiserror::Error)]
pub enum WatchError {
    /// The requested revision is older than the kept history.
    #[error("history before revision {oldest} is no longer kept; read /v1/config and watch from its revision")]
    Compacted {
        /// The oldest revision that can be replayed.
        oldest: u64,
    },
    /// The watcher fell too far behind the live feed.
    #[error("watcher fell behind; read /v1/config and watch again from its revision")]
    Lagged,
    /// The store failed.
    #[error("{0}")]
    Store(String),
}

/// Replayed history is read in pages of this many change sets.
const PAGE: usize = 1_000;

impl Control {
    /// Streams every change set with a revision above `after`, then live ones,
    /// in revision order. The stream ends with an error item if the watcher
    /// falls behind; it ends silently when the receiver is dropped.
    pub fn watch(&self, after: u64) -> mpsc::Receiver<Result<Arc<AppliedChange>, WatchError>> {
        let (tx, rx) = mpsc::channel(256);
        // Subscribe before reading history, so nothing falls in between.
        let live = self.shared.feed.subscribe();
        let store = self.shared.store.clone();
        tokio::spawn(async move {
            let mut last = after;
            loop {
                let store = store.clone();
                let page = tokio::task::spawn_blocking(move || store.changes_since(last, PAGE)).await;
                let page = match page {
                    Ok(Ok(p)) => p,
                    Ok(Err(StoreError::Compacted { oldest })) => {
                        let _ = tx.send(Err(WatchError::Compacted { oldest })).await;
                        return;
                    }
                    Ok(Err(e)) => {
                        let _ = tx.send(Err(WatchError::Store(e.to_string()))).await;
                        return;
                    }
                    Err(e) => {
                        let _ = tx.send(Err(WatchError::Store(e.to_string()))).await;
                        return;
                    }
                };
                let full = page.len() == PAGE;
                for change in page {
                    last = change.revision;
                    if tx.send(Ok(Arc::new(change))).await.is_err() {
                        return;
                    }
                }
                if !full {
                    break;
                }
            }
            follow(live, last, tx).await;
        });
        rx
    }
}

async fn follow(
    mut live: broadcast::Receiver<Arc<AppliedChange>>,
    mut last: u64,
    tx: mpsc::Sender<Result<Arc<AppliedChange>, WatchError>>,
) {
    loop {
        tokio::select! {
            item = live.recv() => match item {
                Ok(change) if change.revision <= last => {}
                Ok(change) => {
                    last = change.revision;
                    if tx.send(Ok(change)).await.is_err() {
                        return;
                    }
                }
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    let _ = tx.send(Err(WatchError::Lagged)).await;
                    return;
                }
                Err(broadcast::error::RecvError::Closed) => return,
            },
            () = tx.closed() => return,
        }
    }
}
