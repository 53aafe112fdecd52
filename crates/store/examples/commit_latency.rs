//! Commit latency of each embedded store on this disk, beside the disk's
//! own floor (a 4 KiB write and `fdatasync`), in the same run.
//!
//! ```sh
//! cargo run --release -p tidegate-store --example commit_latency -- [DIR] [COMMITS] [ROUNDS] [PRELOAD]
//! ```
//!
//! PRELOAD (default 0) services of 10 backends each, with a route each, are
//! committed first in one change set (the churn benchmark's loaded suite
//! uses 10,000).
//!
//! Each round commits COMMITS single-op change sets (one `put_backend`,
//! one at a time, as an idle writer does, with its housekeeping untimed
//! between them) to a fresh redb store and a fresh SQLite store,
//! alternating which goes first, and times the same number of raw
//! `fdatasync`s; it prints p50 / p99 / max per round and their medians.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use tidegate_model::{parse_change_set, ConfigState};
use tidegate_store::{AppliedChange, Commit, RedbStore, SqliteStore, Store};

fn change(rev: u64) -> AppliedChange {
    let text = if rev == 1 {
        r#"{"ops":[{"op":"put_service","name":"web","spec":{"backends":[{"id":"a","addr":"127.0.0.1:1"}]}}]}"#
            .to_string()
    } else {
        format!(
            r#"{{"ops":[{{"op":"put_backend","service":"web","id":"n{}","spec":{{"addr":"127.0.0.1:{}"}}}}]}}"#,
            rev % 500,
            1000 + rev % 60_000
        )
    };
    AppliedChange { revision: rev, change: parse_change_set(text.as_bytes()).expect("valid") }
}

/// Sorted latencies in ms: p50, p99, max.
fn summary(mut ms: Vec<f64>) -> [f64; 3] {
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| ms[((ms.len() as f64 * q) as usize).min(ms.len() - 1)];
    [at(0.50), at(0.99), ms[ms.len() - 1]]
}

/// One change set with `n` services of 10 backends and a route each.
fn preload(n: usize) -> AppliedChange {
    let ops: Vec<String> = (0..n)
        .flat_map(|i| {
            let backends: Vec<String> =
                (0..10).map(|b| format!(r#"{{"id":"b{b}","addr":"10.{}.{}.{b}:80"}}"#, i / 250, i % 250)).collect();
            [
                format!(r#"{{"op":"put_service","name":"s{i}","spec":{{"backends":[{}]}}}}"#, backends.join(",")),
                format!(r#"{{"op":"put_route","name":"r{i}","spec":{{"match":{{"host":"s{i}.example"}},"service":"s{i}"}}}}"#),
            ]
        })
        .collect();
    let text = format!(r#"{{"ops":[{}]}}"#, ops.join(","));
    AppliedChange { revision: 0, change: parse_change_set(text.as_bytes()).expect("valid") }
}

/// Commits one change set on top of `state`, as the writer does.
fn commit(store: &dyn Store, state: &mut ConfigState, c: AppliedChange) {
    let (after, _) = state.apply(&c.change, c.revision - 1).expect("applies");
    let changes = [c];
    store
        .commit(&Commit { base: changes[0].revision - 1, changes: &changes, before: state, after: &after })
        .expect("commit");
    *state = after;
}

fn time_store(store: &dyn Store, commits: u64, preloaded: &Option<AppliedChange>) -> Vec<f64> {
    let mut state = ConfigState::default();
    let offset = match preloaded {
        Some(p) => {
            let mut p = p.clone();
            p.revision = 1;
            commit(store, &mut state, p);
            1
        }
        None => 0,
    };
    (1..=commits)
        .map(|rev| {
            let c = AppliedChange { revision: rev + offset, ..change(rev) };
            let t = Instant::now();
            commit(store, &mut state, c);
            let ms = t.elapsed().as_secs_f64() * 1e3;
            // The writer's housekeeping between groups, untimed.
            store.maintain();
            ms
        })
        .collect()
}

fn time_fdatasync(path: &Path, commits: u64) -> Vec<f64> {
    let mut f = std::fs::File::create(path).expect("create");
    let block = [7u8; 4096];
    (0..commits)
        .map(|_| {
            let t = Instant::now();
            f.write_all(&block).expect("write");
            f.sync_data().expect("fdatasync");
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dir = PathBuf::from(args.get(1).cloned().unwrap_or_else(|| ".".into()));
    let commits: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(2000);
    let rounds: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(3);
    let preloaded = match args.get(4).and_then(|s| s.parse::<usize>().ok()).unwrap_or(0) {
        0 => None,
        n => Some(preload(n)),
    };
    let work = dir.join(format!("commit-latency-{}", std::process::id()));
    std::fs::create_dir_all(&work).expect("work dir");
    let mut results: Vec<(&str, Vec<[f64; 3]>)> =
        vec![("fdatasync 4 KiB", vec![]), ("redb", vec![]), ("sqlite WAL FULL", vec![])];
    for round in 0..rounds {
        let order: [usize; 3] = if round % 2 == 0 { [0, 1, 2] } else { [2, 1, 0] };
        for i in order {
            let base = work.join(format!("r{round}-{i}"));
            let ms = match i {
                0 => time_fdatasync(&base, commits),
                1 => time_store(&RedbStore::open(&base.with_extension("redb")).expect("redb"), commits, &preloaded),
                _ => {
                    time_store(&SqliteStore::open(&base.with_extension("sqlite")).expect("sqlite"), commits, &preloaded)
                }
            };
            let s = summary(ms);
            println!("round {round} {:16} p50 {:.3} ms  p99 {:.3} ms  max {:.3} ms", results[i].0, s[0], s[1], s[2]);
            results[i].1.push(s);
        }
    }
    println!("medians over {rounds} rounds of {commits} single-op commits in {}:", dir.display());
    for (name, rows) in &results {
        let med = |k: usize| {
            let mut v: Vec<f64> = rows.iter().map(|r| r[k]).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        println!("  {name:16} p50 {:.3} ms  p99 {:.3} ms  max {:.3} ms", med(0), med(1), med(2));
    }
    let _ = std::fs::remove_dir_all(&work);
}
