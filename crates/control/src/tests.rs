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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_submissions_each_get_a_distinct_revision_and_are_live() {
    let dir = tempfile::tempdir().unwrap();
    let control = start(&dir);
    let rev = control.submit(cs(r#"{"ops":[{"op":"put_service","name":"web","spec":{}}]}"#)).await.unwrap();
    assert_eq!(rev, 1);
    let tasks: Vec<_> = (0..200)
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
    assert_eq!(revs, (2..=201).collect::<Vec<_>>());
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

    let mut watch = control.watch(3);
    for want in 4..=6 {
        assert_eq!(watch.recv().await.unwrap().unwrap().revision, want);
    }
    control.submit(put_backend(9)).await.unwrap();
    assert_eq!(watch.recv().await.unwrap().unwrap().revision, 7);
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
    // One at a time, so the writer is idle after each: 600 commits put
    // more than 1,000 pages into SQLite's log, which only the idle-time
    // checkpoint brings back down (its in-commit backstop is at 16,000).
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
