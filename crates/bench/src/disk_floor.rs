//! `disk-floor`: the least a durable change can cost on this disk, driven
//! like `churn` drives Tidegate, to read `churn`'s answer times against.
//!
//! Each event hands a request to one writer thread over a channel and
//! waits for its answer, as a change reaches Tidegate's writer. The thread
//! takes every request queued (a group commit), overwrites one 4 KiB block
//! of a file written in full beforehand (so a write never extends the file
//! or allocates a block, as SQLite's reused log does), calls `fdatasync`,
//! and answers the group. What `churn` adds on top of this floor is
//! Tidegate's own: HTTP on loopback, JSON, validation, SQLite's pages, the
//! apply and the publication.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use tokio::sync::{mpsc, oneshot};

use crate::cli::DiskFloorArgs;
use crate::open_loop::{self, Sending};
use crate::report::{Counts, Latency, Summary};
use crate::schedule::Plan;

/// One durable write: what a single change costs the disk at least.
const BLOCK: usize = 4096;
/// The file the writes cycle over, written in full before the run.
const FILE_BYTES: u64 = 8 << 20;
/// How long an answer may take before it counts as unfinished.
const GRACE: Duration = Duration::from_secs(5);

/// The JSON printed by `disk-floor`.
#[derive(Debug, Serialize)]
pub struct DiskFloorReport {
    scenario: &'static str,
    /// The file written (removed after the run).
    file: PathBuf,
    rate: f64,
    duration_s: f64,
    sending: Sending,
    /// From the moment an event's task handed its request to the writer
    /// until the answer came back: comparable to `churn`'s
    /// `admin_from_send_us`.
    from_send_us: Summary,
    /// One `pwrite` of 4 KiB and one `fdatasync`, as the writer timed them.
    sync_us: Summary,
    /// Groups written (one sync each); fewer than events when requests
    /// queued behind a slow sync.
    groups: u64,
    errors: Counts,
    error_total: u64,
}

/// A request to the writer: answered with the sync's outcome.
type Request = oneshot::Sender<Result<(), String>>;

/// Runs `disk-floor`.
pub async fn run(args: &DiskFloorArgs) -> anyhow::Result<DiskFloorReport> {
    let plan = Plan::new(args.rate, args.duration_s)?;
    let path = args.dir.join(format!("tidegate-disk-floor-{}.bin", std::process::id()));
    let file = prepare(&path).with_context(|| format!("cannot prepare {}", path.display()))?;
    let (tx, rx) = mpsc::unbounded_channel::<Request>();
    let writer =
        std::thread::Builder::new().name("disk-floor-writer".to_owned()).spawn(move || write_groups(file, rx))?;

    let tx = Arc::new(tx);
    let mut from_send = Latency::new();
    let mut errors = Counts::default();
    let sending = open_loop::run(
        plan,
        usize::MAX,
        GRACE,
        move |_, _| {
            let tx = Arc::clone(&tx);
            async move {
                let (answer, answered) = oneshot::channel();
                let sent = Instant::now();
                if tx.send(answer).is_err() {
                    return Err("writer_gone".to_owned());
                }
                match answered.await {
                    Ok(Ok(())) => Ok(sent.elapsed()),
                    Ok(Err(e)) => Err(e),
                    Err(_) => Err("writer_gone".to_owned()),
                }
            }
        },
        |outcome| match outcome {
            Ok(d) => from_send.record(d),
            Err(e) => errors.bump(&e),
        },
    )
    .await?;
    if sending.unfinished > 0 {
        errors.bump("unfinished");
    }
    // Every sender is gone once the run ends, so the writer's loop ends.
    let (sync, groups) = match writer.join() {
        Ok(done) => done,
        Err(_) => anyhow::bail!("the disk-floor writer panicked"),
    };
    let _ = std::fs::remove_file(&path);
    Ok(DiskFloorReport {
        scenario: "disk-floor",
        file: path,
        rate: args.rate,
        duration_s: args.duration_s,
        sending,
        from_send_us: from_send.summary(),
        sync_us: sync.summary(),
        groups,
        error_total: errors.total(),
        errors,
    })
}

/// Creates the file at its full size, with its blocks written and synced.
fn prepare(path: &Path) -> std::io::Result<File> {
    let mut file = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(path)?;
    let chunk = vec![0x5a_u8; 1 << 20];
    for _ in 0..FILE_BYTES / chunk.len() as u64 {
        file.write_all(&chunk)?;
    }
    file.sync_all()?;
    Ok(file)
}

/// The writer thread: one block and one sync per group of queued
/// requests; returns the syncs' times and the number of groups.
fn write_groups(file: File, mut rx: mpsc::UnboundedReceiver<Request>) -> (Latency, u64) {
    let mut sync = Latency::new();
    let mut groups = 0_u64;
    let mut block = [0_u8; BLOCK];
    let mut group: Vec<Request> = Vec::new();
    while let Some(first) = rx.blocking_recv() {
        group.push(first);
        while let Ok(more) = rx.try_recv() {
            group.push(more);
        }
        // A new content for each write, at the next block of the file.
        block[..8].copy_from_slice(&groups.to_le_bytes());
        let offset = (groups * BLOCK as u64) % FILE_BYTES;
        let started = Instant::now();
        let outcome =
            file.write_all_at(&block, offset).and_then(|()| file.sync_data()).map_err(|e| format!("io_{:?}", e.kind()));
        sync.record(started.elapsed());
        groups += 1;
        for answer in group.drain(..) {
            let _ = answer.send(outcome.clone());
        }
    }
    (sync, groups)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_is_answered_once_its_block_is_synced() {
        let dir = std::env::temp_dir().join(format!("tidegate-disk-floor-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f.bin");
        let file = prepare(&path).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), FILE_BYTES);
        let (tx, rx) = mpsc::unbounded_channel();
        let answers: Vec<_> = (0..3)
            .map(|_| {
                let (a, b) = oneshot::channel();
                tx.send(a).unwrap();
                b
            })
            .collect();
        drop(tx);
        let (sync, groups) = write_groups(file, rx);
        // All three were queued before the writer started: one group.
        assert_eq!(groups, 1);
        assert_eq!(sync.count(), 1);
        for a in answers {
            assert_eq!(a.blocking_recv().unwrap(), Ok(()));
        }
        let written = std::fs::read(&path).unwrap();
        assert_eq!(written[..8], 0_u64.to_le_bytes());
        assert_eq!(written[8], 0, "the first block was overwritten");
        assert_eq!(written[BLOCK], 0x5a, "the next block was not");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
