use std::time::{Duration, Instant};

use super::*;
use tidegate_model::parse_change_set;
use tidegate_store::RedbStore;

fn cs(text: &str) -> ChangeSet {
    parse_change_set(text.as_bytes()).unwrap()
}

fn start(dir: &tempfile::TempDir) -> Control {
    let store = RedbStore::open(&dir.path().join("c.redb")).unwrap();
    Control::start(Arc::new(store)).unwrap()
}

fn put_backend(i: usize) -> ChangeSet {
    cs(&format!(
        r#"{{"ops":[{{"op":"put_backend","service":"web","id":"b{i}","spec":{{"addr":"127.0.0.1:{}"}}}}]}}"#,
        1000 + i
    ))
}

/// Submits `n` backend puts from as many tasks at once; their revisions, sorted.
async fn submit_together(control: &Control, n: usize) -> Vec<u64> {
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let c = control.clone();
            tokio::spawn(async move { c.submit(put_backend(i)).await.unwrap() })
        })
        .collect();
    let mut revs = Vec::new();
    for t in tasks {
        revs.push(t.await.unwrap());
    }
    revs.sort();
    revs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_submissions_each_get_a_distinct_revision_and_are_live() {
    let dir = tempfile::tempdir().unwrap();
    let control = start(&dir);
    let rev = control.submit(cs(r#"{"ops":[{"op":"put_service","name":"web","spec":{}}]}"#)).await.unwrap();
    assert_eq!(rev, 1);
    assert_eq!(submit_together(&control, 200).await, (2..=201).collect::<Vec<_>>());
    let snap = control.snapshots().load_full();
    assert_eq!(snap.revision(), 201);
    assert_eq!(snap.service("web").unwrap().selector.backends().len(), 200);
    let commits = control.metrics().commits.load(Relaxed);
    assert!(commits <= 201, "{commits}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_change_set_fails_alone() {
    let dir = tempfile::tempdir().unwrap();
    let control = start(&dir);
    let good = control.clone();
    let bad = control.clone();
    let (a, b) = tokio::join!(
        good.submit(cs(r#"{"ops":[{"op":"put_service","name":"web","spec":{}}]}"#)),
        bad.submit(cs(r#"{"ops":[{"op":"put_service","name":"x","spec":{}},{"op":"delete_route","name":"nope"}]}"#)),
    );
    assert!(a.is_ok());
    assert!(matches!(b, Err(SubmitError::Rejected(_))));
    let view = control.config();
    assert!(view.state.service("web").is_some());
    assert!(view.state.service("x").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_changes_survive_a_restart_and_replay_to_watchers() {
    let dir = tempfile::tempdir().unwrap();
    {
        let control = start(&dir);
        control.submit(cs(r#"{"ops":[{"op":"put_service","name":"web","spec":{}}]}"#)).await.unwrap();
        for i in 0..5 {
            control.submit(put_backend(i)).await.unwrap();
        }
    }
    // The writer thread of the first instance may still hold the file; wait for it.
    let control = loop {
        match RedbStore::open(&dir.path().join("c.redb")) {
            Ok(store) => break Control::start(Arc::new(store)).unwrap(),
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
        }
    };
    assert_eq!(control.config().revision, 6);
    assert_eq!(control.snapshots().load().service("web").unwrap().selector.backends().len(), 5);

    let mut watch = control.watch(&Watchers::default(), 3, revision_only).unwrap();
    for want in 4..=6 {
        assert_eq!(watch.next().await, Some(WatchItem::Event(want.to_string())));
    }
    control.submit(put_backend(9)).await.unwrap();
    assert_eq!(watch.next().await, Some(WatchItem::Event("7".into())));
}

fn revision_only(c: &AppliedChange) -> String {
    c.revision.to_string()
}

/// Events of about 1 KiB each: the revision, padded.
fn padded(c: &AppliedChange) -> String {
    format!("{:<1024}", c.revision)
}

/// A store with `n` change sets after the service.
async fn history(dir: &tempfile::TempDir, n: usize) -> Control {
    let control = start(dir);
    control.submit(cs(r#"{"ops":[{"op":"put_service","name":"web","spec":{}}]}"#)).await.unwrap();
    for i in 0..n {
        control.submit(put_backend(i)).await.unwrap();
    }
    control
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_that_does_not_read_holds_its_budget_then_is_cut() {
    let dir = tempfile::tempdir().unwrap();
    let control = history(&dir, 300).await;
    let limits = WatchLimits { queue_bytes: 16 * 1024, max_replays: 8, stall: Duration::from_millis(300) };
    let watchers = Watchers::new(limits);
    let mut watch = control.watch(&watchers, 0, padded).unwrap();
    // Read three, then stop reading: the queue fills to its budget and no further.
    for want in 1..=3 {
        assert_eq!(
            watch.next().await.map(|i| matches!(i, WatchItem::Event(t) if t.trim() == want.to_string())),
            Some(true)
        );
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while watchers.stats().cut.load(Relaxed) == 0 {
        assert!(watch.queued_bytes() <= 16 * 1024, "{}", watch.queued_bytes());
        assert!(Instant::now() < deadline, "never cut");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // What was queued is dropped: the stream ends at once, naming the
    // last revision taken.
    assert_eq!(watchers.stats().queued_bytes.load(Relaxed), 0);
    match watch.next().await {
        Some(WatchItem::End(WatchError::Lagged { resume_from, cause })) => {
            assert_eq!(resume_from, 3);
            assert!(cause.contains("took nothing"), "{cause}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(watch.next().await, None);
    assert_eq!(watchers.stats().replays.load(Relaxed), 0, "the replay slot is free again");
    drop(watch);
    assert_eq!(watchers.stats().streams.load(Relaxed), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_beyond_the_limit_are_refused_until_one_ends() {
    let dir = tempfile::tempdir().unwrap();
    let control = history(&dir, 50).await;
    let limits = WatchLimits { queue_bytes: 4 * 1024, max_replays: 2, stall: Duration::from_secs(60) };
    let watchers = Watchers::new(limits);
    let a = control.watch(&watchers, 0, padded).unwrap();
    let mut b = control.watch(&watchers, 10, padded).unwrap();
    assert!(matches!(control.watch(&watchers, 0, padded), Err(WatchError::Busy { replays: 2 })));
    assert_eq!(watchers.stats().refused.load(Relaxed), 1);
    // Watching from the current revision replays nothing: always allowed.
    let live = control.watch(&watchers, control.config().revision, padded).unwrap();
    assert_eq!(watchers.stats().streams.load(Relaxed), 3);
    drop(a);
    // A replay that caught up frees its slot too.
    for want in 11..=51 {
        match b.next().await {
            Some(WatchItem::Event(t)) => assert_eq!(t.trim(), want.to_string()),
            other => panic!("{other:?}"),
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while watchers.stats().replays.load(Relaxed) != 0 {
        assert!(Instant::now() < deadline, "replay slots still held");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let c = control.watch(&watchers, 0, padded).unwrap();
    let d = control.watch(&watchers, 0, padded).unwrap();
    drop((b, c, d, live));
    assert_eq!(watchers.stats().streams.load(Relaxed), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_larger_than_the_budget_still_passes_alone() {
    let dir = tempfile::tempdir().unwrap();
    let control = history(&dir, 3).await;
    let limits = WatchLimits { queue_bytes: 100, max_replays: 1, stall: Duration::from_secs(60) };
    let watchers = Watchers::new(limits);
    let mut watch = control.watch(&watchers, 0, padded).unwrap();
    for want in 1..=4 {
        match watch.next().await {
            Some(WatchItem::Event(t)) => assert_eq!(t.trim(), want.to_string()),
            other => panic!("{other:?}"),
        }
    }
    control.submit(put_backend(7)).await.unwrap();
    assert!(matches!(watch.next().await, Some(WatchItem::Event(t)) if t.trim() == "5"));
}

/// A store that panics in its first `commit`, then works.
struct PanicsOnce {
    inner: RedbStore,
    panicked: std::sync::atomic::AtomicBool,
}

impl tidegate_store::Store for PanicsOnce {
    fn load(&self) -> Result<tidegate_store::Loaded, StoreError> {
        self.inner.load()
    }

    fn commit(&self, commit: &tidegate_store::Commit<'_>) -> Result<(), StoreError> {
        if !self.panicked.swap(true, Relaxed) {
            panic!("injected writer panic");
        }
        self.inner.commit(commit)
    }

    fn status(&self) -> tidegate_store::StoreStatus {
        self.inner.status()
    }

    fn changes_since(&self, after: u64, limit: usize) -> Result<Vec<AppliedChange>, StoreError> {
        self.inner.changes_since(after, limit)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_writer_fails_its_group_and_carries_on() {
    let dir = tempfile::tempdir().unwrap();
    let inner = RedbStore::open(&dir.path().join("c.redb")).unwrap();
    let control = Control::start(Arc::new(PanicsOnce { inner, panicked: Default::default() })).unwrap();
    let first = control.submit(cs(r#"{"ops":[{"op":"put_service","name":"web","spec":{}}]}"#)).await;
    assert!(matches!(first, Err(SubmitError::Closed)), "{first:?}");
    // The writer is back, at the revision the store holds.
    let rev = control.submit(cs(r#"{"ops":[{"op":"put_service","name":"web","spec":{}}]}"#)).await.unwrap();
    assert_eq!(rev, 1);
    assert_eq!(control.metrics().panics.load(Relaxed), 1);
    assert_eq!(control.snapshots().load_full().revision(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_is_maintained_between_groups_not_inside_commits() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(tidegate_store::SqliteStore::open(&dir.path().join("c.sqlite")).unwrap());
    let control = Control::start(store.clone()).unwrap();
    control.submit(cs(r#"{"ops":[{"op":"put_service","name":"web","spec":{}}]}"#)).await.unwrap();
    // One at a time, so each is committed alone (by its submitter or by an
    // idle writer): 600 commits put more than 1,000 pages into SQLite's
    // log, which only the writer's checkpoint between groups brings back
    // down (its in-commit backstop is at 16,000).
    let mut most = 0;
    for i in 0..600 {
        control.submit(put_backend(i)).await.unwrap();
        most = most.max(store.wal_pages());
    }
    assert!(most >= 900, "the log grew to {most} pages only: the test proves nothing");
    // The checkpoint runs after the answer: give it a moment.
    for _ in 0..100 {
        if store.wal_pages() < most {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(store.wal_pages() < 1_000, "{} pages in the log", store.wal_pages());
}

/// Starts a writer on the embedded store, which commits locally.
fn start_sqlite(dir: &tempfile::TempDir) -> Control {
    let store = tidegate_store::SqliteStore::open(&dir.path().join("c.sqlite")).unwrap();
    Control::start(Arc::new(store)).unwrap()
}

/// Forgets how long the last commit took, so a slow disk under the test
/// cannot turn commits by submitters off.
fn forget_slow_commits(control: &Control) {
    control.shared.last_commit_nanos.store(0, Relaxed);
}

/// Waits until the writer gives its turn back: it keeps it a moment after
/// answering (housekeeping).
async fn turn_given_back(control: &Control) {
    while control.shared.turn.try_lock().is_err() {
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}

#[tokio::test]
async fn a_lone_change_set_is_committed_by_its_submitter() {
    let dir = tempfile::tempdir().unwrap();
    let control = start_sqlite(&dir);
    forget_slow_commits(&control);
    control.submit(cs(r#"{"ops":[{"op":"put_service","name":"web","spec":{}}]}"#)).await.unwrap();
    for i in 0..5 {
        forget_slow_commits(&control);
        let rev = control.submit(put_backend(i)).await.unwrap();
        // Live as soon as it is answered.
        assert_eq!(control.snapshots().load().revision(), rev);
    }
    let m = control.metrics();
    assert_eq!(m.commits_by_submitter.load(Relaxed), 6);
    assert_eq!(m.commits.load(Relaxed), 6);
    assert_eq!(control.snapshots().load().service("web").unwrap().selector.backends().len(), 5);
}

#[tokio::test]
async fn change_sets_submitted_together_still_go_to_the_writer_as_groups() {
    let dir = tempfile::tempdir().unwrap();
    let control = start_sqlite(&dir);
    control.submit(cs(r#"{"ops":[{"op":"put_service","name":"web","spec":{}}]}"#)).await.unwrap();
    forget_slow_commits(&control);
    let before = control.metrics().commits_by_submitter.load(Relaxed);
    // Fifty tasks ready at once on this one thread, as the admin API's
    // connections are: the first yields, the others queue meanwhile.
    assert_eq!(submit_together(&control, 50).await, (2..=51).collect::<Vec<_>>());
    let m = control.metrics();
    assert!(m.commits_by_submitter.load(Relaxed) - before <= 1, "{m:?}");
    assert!(m.commits.load(Relaxed) <= 26, "one commit per change set: no group formed ({m:?})");
}

#[tokio::test]
async fn after_a_slow_commit_changes_go_to_the_writer_thread() {
    let dir = tempfile::tempdir().unwrap();
    let control = start_sqlite(&dir);
    control.shared.last_commit_nanos.store(SLOW_COMMIT_NANOS + 1, Relaxed);
    control.submit(cs(r#"{"ops":[{"op":"put_service","name":"web","spec":{}}]}"#)).await.unwrap();
    assert_eq!(control.metrics().commits_by_submitter.load(Relaxed), 0);
    assert_eq!(control.metrics().commits.load(Relaxed), 1);
    turn_given_back(&control).await;
    forget_slow_commits(&control);
    control.submit(put_backend(1)).await.unwrap();
    assert_eq!(control.metrics().commits_by_submitter.load(Relaxed), 1);
}

#[tokio::test]
async fn a_cancelled_submission_gives_up_its_claim_and_commits_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let control = start_sqlite(&dir);
    forget_slow_commits(&control);
    let put = cs(r#"{"ops":[{"op":"put_service","name":"web","spec":{}}]}"#);
    // Polled once (it yields after claiming the commit), then dropped.
    let mut submission = Box::pin(control.submit(put.clone()));
    let polled =
        std::future::poll_fn(|cx| std::task::Poll::Ready(std::future::Future::poll(submission.as_mut(), cx))).await;
    assert!(polled.is_pending(), "{polled:?}");
    drop(submission);
    assert!(!control.shared.candidate.load(Relaxed));
    assert_eq!(control.config().revision, 0);
    assert_eq!(control.submit(put).await.unwrap(), 1);
    assert_eq!(control.metrics().commits_by_submitter.load(Relaxed), 1);
}

/// Commits locally, and panics in its first `commit`.
struct PanicsOnceHere(PanicsOnce);

impl tidegate_store::Store for PanicsOnceHere {
    fn load(&self) -> Result<tidegate_store::Loaded, StoreError> {
        self.0.load()
    }

    fn commit(&self, commit: &tidegate_store::Commit<'_>) -> Result<(), StoreError> {
        self.0.commit(commit)
    }

    fn commits_locally(&self) -> bool {
        true
    }

    fn status(&self) -> tidegate_store::StoreStatus {
        self.0.status()
    }

    fn changes_since(&self, after: u64, limit: usize) -> Result<Vec<AppliedChange>, StoreError> {
        self.0.changes_since(after, limit)
    }
}

#[tokio::test]
async fn a_panic_in_a_submitters_commit_fails_it_and_the_next_one_works() {
    let dir = tempfile::tempdir().unwrap();
    let inner = RedbStore::open(&dir.path().join("c.redb")).unwrap();
    let store = PanicsOnceHere(PanicsOnce { inner, panicked: Default::default() });
    let control = Control::start(Arc::new(store)).unwrap();
    let put = cs(r#"{"ops":[{"op":"put_service","name":"web","spec":{}}]}"#);
    forget_slow_commits(&control);
    let first = control.submit(put.clone()).await;
    assert!(matches!(first, Err(SubmitError::Closed)), "{first:?}");
    assert_eq!(control.metrics().panics.load(Relaxed), 1);
    forget_slow_commits(&control);
    assert_eq!(control.submit(put).await.unwrap(), 1);
    assert_eq!(control.snapshots().load_full().revision(), 1);
    assert_eq!(control.metrics().commits_by_submitter.load(Relaxed), 1);
}

#[tokio::test]
async fn no_commit_by_a_submitter_while_an_answer_from_the_writer_waits_to_be_taken() {
    let dir = tempfile::tempdir().unwrap();
    let control = start_sqlite(&dir);
    // The first submission goes to the writer thread (the last commit
    // "was slow").
    control.shared.last_commit_nanos.store(SLOW_COMMIT_NANOS + 1, Relaxed);
    let first = {
        let c = control.clone();
        tokio::spawn(async move { c.submit(cs(r#"{"ops":[{"op":"put_service","name":"web","spec":{}}]}"#)).await })
    };
    tokio::task::yield_now().await;
    // Block this runtime's only thread until the writer has committed and
    // answered: the first task cannot take its answer meanwhile.
    let waited = std::time::Instant::now();
    while control.metrics().commits.load(Relaxed) < 1 {
        assert!(waited.elapsed() < std::time::Duration::from_secs(10), "the writer never committed");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    std::thread::sleep(std::time::Duration::from_millis(20));
    forget_slow_commits(&control);
    // Committing here would hold that answer back: it goes to the writer.
    control.submit(put_backend(1)).await.unwrap();
    assert_eq!(first.await.unwrap().unwrap(), 1);
    assert_eq!(control.metrics().commits_by_submitter.load(Relaxed), 0);
    // Both returned: alone again.
    turn_given_back(&control).await;
    forget_slow_commits(&control);
    control.submit(put_backend(2)).await.unwrap();
    assert_eq!(control.metrics().commits_by_submitter.load(Relaxed), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn followers_of_snapshots_wake_for_each_publication_and_not_otherwise() {
    let dir = tempfile::tempdir().unwrap();
    let control = start(&dir);
    let mut changes = control.snapshot_changes();
    let quiet = tokio::time::timeout(std::time::Duration::from_millis(50), changes.next()).await;
    assert!(quiet.is_err(), "nothing was published yet: {quiet:?}");
    let rev = control.submit(cs(r#"{"ops":[{"op":"put_service","name":"web","spec":{}}]}"#)).await.unwrap();
    assert_eq!(changes.next().await, rev);
    assert_eq!(control.snapshots().load().revision(), rev, "word comes after the snapshot is live");
    // A refused change set publishes nothing.
    assert!(control.submit(cs(r#"{"ops":[{"op":"delete_route","name":"nope"}]}"#)).await.is_err());
    let quiet = tokio::time::timeout(std::time::Duration::from_millis(50), changes.next()).await;
    assert!(quiet.is_err(), "a refused change set woke a follower: {quiet:?}");
}

/// The hand-over of the embedded store (`serve --takeover`): change sets
/// queued before it are committed and answered, later ones are refused as
/// retryable, the store is free for another opener meanwhile, and taking
/// it back reloads what that opener committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_over_commits_what_is_queued_refuses_the_rest_and_can_be_taken_back() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.sqlite");
    let control = Control::start(Arc::new(tidegate_store::SqliteStore::open(&path).unwrap())).unwrap();
    control.submit(cs(r#"{"ops":[{"op":"put_service","name":"web","spec":{}}]}"#)).await.unwrap();
    // Submissions racing the hand-over: each is applied once or refused.
    let racing: Vec<_> = (0..50)
        .map(|i| {
            let c = control.clone();
            tokio::spawn(async move { c.submit(put_backend(i)).await })
        })
        .collect();
    let c = control.clone();
    let released = tokio::task::spawn_blocking(move || c.hand_over()).await.unwrap().unwrap();
    assert!(released, "an embedded store is handed over");
    let mut applied = 0;
    for t in racing {
        match t.await.unwrap() {
            Ok(_) => applied += 1,
            Err(SubmitError::HandedOver) => {}
            Err(e) => panic!("neither applied nor refused as handed over: {e}"),
        }
    }
    assert_eq!(control.config().revision, 1 + applied);
    assert!(matches!(control.submit(put_backend(99)).await, Err(SubmitError::HandedOver)));
    // Another process may open the store now, and sees every answered change.
    {
        let other = tidegate_store::SqliteStore::open(&path).unwrap();
        let loaded = other.load().unwrap();
        assert_eq!(loaded.revision, 1 + applied);
        let next = Control::start(Arc::new(other)).unwrap();
        next.submit(put_backend(100)).await.unwrap();
    }
    // The other writer's thread lets go of the store when it sees its
    // last handle gone: retry until the lock is free (bounded).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let c = control.clone();
        match tokio::task::spawn_blocking(move || c.take_back()).await.unwrap() {
            Ok(()) => break,
            Err(e) if Instant::now() < deadline => {
                assert!(e.to_string().contains("another Tidegate"), "{e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(e) => panic!("the store was not taken back: {e}"),
        }
    }
    assert_eq!(control.config().revision, 2 + applied, "what the other process committed is reloaded");
    assert_eq!(control.submit(put_backend(101)).await.unwrap(), 3 + applied);
}
