//! One test suite that every [`Store`] implementation passes.

use std::path::Path;

use tidegate_model::{parse_change_set, ConfigState};

use crate::{AppliedChange, Commit, Store, StoreError};

pub(crate) fn applied(rev: u64, text: &str) -> AppliedChange {
    AppliedChange { revision: rev, change: parse_change_set(text.as_bytes()).expect("a valid change set") }
}

/// Commits `changes` on top of what `store` holds, as the writer would.
pub(crate) fn commit<S: Store + ?Sized>(store: &S, changes: &[AppliedChange]) -> Result<(), StoreError> {
    let loaded = store.load()?;
    let mut after = loaded.state.clone();
    for c in changes {
        after = after.apply(&c.change, c.revision - 1).map_err(|e| StoreError::Corrupt(e.to_string()))?.0;
    }
    store.commit(&Commit { base: loaded.revision, changes, before: &loaded.state, after: &after })
}

/// Three change sets touching services, backends and routes.
pub(crate) fn changes() -> Vec<AppliedChange> {
    vec![
        applied(
            1,
            r#"{"ops":[
            {"op":"put_service","name":"web","spec":{"policy":{"kind":"least_conn"},"backends":[{"id":"a","addr":"127.0.0.1:1"},{"id":"b","addr":"127.0.0.1:2"}]}},
            {"op":"put_service","name":"web2","spec":{"backends":[{"id":"a","addr":"127.0.0.1:9"}]}},
            {"op":"put_route","name":"r","spec":{"match":{"host":"*.x.com"},"service":"web"}}]}"#,
        ),
        applied(
            2,
            r#"{"ops":[
            {"op":"delete_backend","service":"web","id":"a"},
            {"op":"put_backend","service":"web","id":"c","spec":{"addr":"127.0.0.1:3","weight":5}}]}"#,
        ),
        applied(3, r#"{"ops":[{"op":"put_service","name":"web2","spec":{}}]}"#),
    ]
}

/// Runs every case against stores opened by `open` (each case in a new
/// directory; `open` may be called twice on one path, to reopen).
pub(crate) fn run<S: Store>(open: impl Fn(&Path) -> Result<S, StoreError>) {
    commits_survive_reopening_and_replay(&open);
    an_empty_store_loads_revision_zero(&open);
    an_old_log_is_compacted(&open);
    a_secret_kept_through_its_placeholder_survives_reopening(&open);
}

fn commits_survive_reopening_and_replay<S: Store>(open: &impl Fn(&Path) -> Result<S, StoreError>) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("config");
    let [c1, c2, c3]: [AppliedChange; 3] = changes().try_into().expect("three changes");
    let (want, _) = ConfigState::default().apply(&c1.change, 0).expect("applies");
    let (want, _) = want.apply(&c2.change, 1).expect("applies");
    let (want, _) = want.apply(&c3.change, 2).expect("applies");
    {
        let store = open(&path).expect("opens");
        commit(&store, &[c1.clone(), c2.clone()]).expect("commits");
        commit(&store, std::slice::from_ref(&c3)).expect("commits");
    }
    let store = open(&path).expect("reopens");
    let loaded = store.load().expect("loads");
    assert_eq!(loaded.revision, 3);
    assert_eq!(loaded.state.services(), want.services());
    assert_eq!(loaded.state.routes(), want.routes());
    assert_eq!(store.changes_since(1, 10).expect("replays"), vec![c2, c3.clone()]);
    assert_eq!(store.changes_since(1, 1).expect("replays").len(), 1, "the limit holds");
    assert!(store.changes_since(3, 10).expect("replays").is_empty());
}

fn an_empty_store_loads_revision_zero<S: Store>(open: &impl Fn(&Path) -> Result<S, StoreError>) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let store = open(&dir.path().join("config")).expect("opens");
    let loaded = store.load().expect("loads");
    assert_eq!(loaded.revision, 0);
    assert!(loaded.state.services().is_empty());
    assert!(store.changes_since(0, 10).expect("replays").is_empty());
}

fn an_old_log_is_compacted<S: Store>(open: &impl Fn(&Path) -> Result<S, StoreError>) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let store = open(&dir.path().join("config")).expect("opens");
    let first = &changes()[0];
    commit(&store, std::slice::from_ref(first)).expect("commits");
    // Many single-backend changes: the log keeps only the last LOG_RETAIN.
    let n = crate::LOG_RETAIN + 5;
    let batch: Vec<AppliedChange> = (2..=n + 1)
        .map(|rev| {
            let text = format!(
                r#"{{"ops":[{{"op":"put_backend","service":"web","id":"n","spec":{{"addr":"127.0.0.1:{}"}}}}]}}"#,
                1000 + rev % 50_000
            );
            applied(rev, &text)
        })
        .collect();
    commit(&store, &batch).expect("commits");
    match store.changes_since(1, 10) {
        Err(StoreError::Compacted { oldest }) => assert_eq!(oldest, n + 1 - crate::LOG_RETAIN + 1),
        other => panic!("expected Compacted, got {:?}", other.map(|v| v.len())),
    }
    assert_eq!(store.changes_since(n, 10).expect("replays").len(), 1);
}

/// An exported configuration applied back carries `(redacted)` where a
/// secret was: the state keeps the real one, and so must what is stored.
fn a_secret_kept_through_its_placeholder_survives_reopening<S: Store>(open: &impl Fn(&Path) -> Result<S, StoreError>) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("config");
    let webhook = |secret: &str| {
        format!(
            r#"{{"ops":[{{"op":"put_service","name":"w","spec":{{"autoscale":{{"provider":{{"kind":"webhook","url":"http://127.0.0.1:9/hook","secret":"{secret}"}}}},"backends":[{{"id":"a","addr":"127.0.0.1:{}"}}]}}}}]}}"#,
            if secret == tidegate_model::REDACTED { 2 } else { 1 }
        )
    };
    {
        let store = open(&path).expect("opens");
        commit(&store, &[applied(1, &webhook("s3cret-value"))]).expect("commits");
        commit(&store, &[applied(2, &webhook(tidegate_model::REDACTED))]).expect("commits");
    }
    let loaded = open(&path).expect("reopens").load().expect("loads");
    let service = loaded.state.service("w").expect("the service");
    assert_eq!(service.webhook_secret(), Some("s3cret-value"));
    assert_eq!(service.backends.values().next().map(|b| b.addr.to_string()), Some("127.0.0.1:2".to_string()));
}

/// A rule set and the route that runs it survive reopening; a password
/// hash given back as the placeholder is stored as the one kept. (Not for
/// the redb store, which holds no rule sets.)
pub(crate) fn rule_sets_survive_reopening<S: Store>(open: impl Fn(&Path) -> Result<S, StoreError>) {
    const HASH: &str = "$2b$12$R9h/cIPz0gi.URNNX3kh2OPST9/PgBkqquzi.Ss7KIUgO2t0jWMUW";
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("config");
    let rules = |hash: &str| {
        format!(
            r#"{{"ops":[{{"op":"put_rules","name":"api","spec":{{"steps":[{{"kind":"strip_prefix","prefix":"/api"}},
            {{"kind":"basic_auth","realm":"r","users":[{{"name":"u","hash":"{hash}"}}]}}]}}}}]}}"#
        )
    };
    {
        let store = open(&path).expect("opens");
        commit(&store, &[applied(1, &rules(HASH))]).expect("commits");
        // A route may run an empty set.
        let route = r#"{"ops":[{"op":"put_service","name":"web","spec":{}},
            {"op":"put_rules","name":"open","spec":{"steps":[]}},
            {"op":"put_route","name":"r","spec":{"service":"web","rules":["open"]}}]}"#;
        commit(&store, &[applied(2, route), applied(3, &rules(tidegate_model::REDACTED))]).expect("commits");
    }
    let loaded = open(&path).expect("reopens").load().expect("loads");
    let spec = loaded.state.rule_set("api").expect("the rule set");
    assert!(serde_json::to_string(&**spec).expect("json").contains(HASH));
    assert_eq!(loaded.state.route("r").map(|r| r.rules.len()), Some(1));
    assert_eq!(loaded.state.rule_set_users("open").map(|u| u.len()), Some(1));
    {
        let store = open(&path).expect("reopens");
        let gone = r#"{"ops":[{"op":"delete_route","name":"r"},{"op":"delete_rules","name":"api"},
            {"op":"delete_rules","name":"open"}]}"#;
        commit(&store, &[applied(4, gone)]).expect("commits");
    }
    assert!(open(&path).expect("reopens").load().expect("loads").state.rules().is_empty());
}

/// A listener and the route bound to it survive reopening, and deleting
/// both leaves nothing. (Not for the redb store, which holds no
/// listeners.)
pub(crate) fn listeners_survive_reopening<S: Store>(open: impl Fn(&Path) -> Result<S, StoreError>) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("config");
    {
        let store = open(&path).expect("opens");
        let put = r#"{"ops":[{"op":"put_service","name":"web","spec":{}},
            {"op":"put_listener","name":"internal","spec":{"addr":"127.0.0.1:8081",
              "proxy_protocol":{"trusted":["10.0.0.0/8"]}}},
            {"op":"put_route","name":"r","spec":{"service":"web","listeners":["internal","default"]}}]}"#;
        commit(&store, &[applied(1, put)]).expect("commits");
    }
    let loaded = open(&path).expect("reopens").load().expect("loads");
    let l = loaded.state.listener("internal").expect("the listener");
    assert_eq!(l.addr.to_string(), "127.0.0.1:8081");
    assert!(l.trusts("10.1.1.1".parse().expect("an address")));
    assert_eq!(loaded.state.route("r").map(|r| r.listeners.len()), Some(2));
    {
        let store = open(&path).expect("reopens");
        let gone = r#"{"ops":[{"op":"delete_route","name":"r"},{"op":"delete_listener","name":"internal"}]}"#;
        commit(&store, &[applied(2, gone)]).expect("commits");
    }
    assert!(open(&path).expect("reopens").load().expect("loads").state.listeners().is_empty());
}
