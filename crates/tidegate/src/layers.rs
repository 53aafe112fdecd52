//! The crate layers that docs/architecture.md draws, checked against what
//! `cargo metadata` says the crates depend on: every workspace crate has a
//! row, its row lists exactly the Tidegate crates it depends on, and each
//! of those stands above it (no crate reaches down the list).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

/// The workspace's root.
fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `cargo metadata` of the workspace (without its dependencies' packages).
fn metadata() -> serde_json::Value {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--no-deps", "--offline"])
        .current_dir(root())
        .output()
        .expect("cargo metadata runs");
    assert!(out.status.success(), "cargo metadata: {}", String::from_utf8_lossy(&out.stderr));
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("cargo metadata's JSON");
    meta
}

/// Each workspace crate's normal dependencies among the workspace crates
/// (short names: `tidegate-model` is `model`).
fn from_metadata() -> BTreeMap<String, BTreeSet<String>> {
    let meta = metadata();
    let short = |name: &str| name.strip_prefix("tidegate-").unwrap_or(name).to_string();
    let mut crates = BTreeMap::new();
    for p in meta["packages"].as_array().expect("packages") {
        let name = p["name"].as_str().expect("a name");
        let deps = p["dependencies"]
            .as_array()
            .expect("dependencies")
            .iter()
            .filter(|d| d["kind"].is_null())
            .filter_map(|d| d["name"].as_str())
            .filter(|d| *d == "tidegate" || d.starts_with("tidegate-"))
            .map(short)
            .collect();
        crates.insert(short(name), deps);
    }
    crates
}

/// The rows of the crate table, in order: each crate's short name and the
/// crates its last column names.
fn from_doc() -> Vec<(String, BTreeSet<String>)> {
    let doc = std::fs::read_to_string(root().join("docs/architecture.md")).expect("docs/architecture.md");
    let table = doc.split("| crate | role | depends on |").nth(1).expect("the crate table");
    table
        .lines()
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|line| {
            let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
            let name = cells[0].trim_matches('`');
            let name = name.strip_prefix("tidegate-").unwrap_or(name).to_string();
            let deps = cells.last().expect("a last column");
            let deps = deps.split(',').map(str::trim).filter(|d| !d.is_empty() && *d != "—").map(String::from);
            (name, deps.collect())
        })
        .collect()
}

#[test]
fn the_crate_table_in_the_architecture_doc_is_what_cargo_builds() {
    let real = from_metadata();
    let doc = from_doc();
    let listed: BTreeSet<&String> = doc.iter().map(|(n, _)| n).collect();
    let built: BTreeSet<&String> = real.keys().collect();
    assert_eq!(listed, built, "docs/architecture.md lists other crates than the workspace has");
    let mut above = BTreeSet::new();
    for (name, deps) in &doc {
        assert_eq!(deps, &real[name], "{name}'s dependencies in docs/architecture.md are not cargo's");
        let below: Vec<&String> = deps.iter().filter(|d| !above.contains(*d)).collect();
        assert!(below.is_empty(), "{name} depends on {below:?}, which stand below it in the table");
        above.insert(name.clone());
    }
}

#[test]
fn the_data_plane_never_depends_on_the_control_plane() {
    let real = from_metadata();
    for (data_plane, forbidden) in [("proxy", ["admin", "autoscale", "control", "distributor", "store"])] {
        for f in forbidden {
            assert!(!real[data_plane].contains(f), "{data_plane} depends on {f}");
        }
    }
}

/// Each workspace crate's normal dependencies (any crate), with the
/// features each declares.
fn all_dependencies() -> BTreeMap<String, BTreeMap<String, BTreeSet<String>>> {
    let meta = metadata();
    let mut crates = BTreeMap::new();
    for p in meta["packages"].as_array().expect("packages") {
        let name = p["name"].as_str().expect("a name").to_string();
        let mut deps = BTreeMap::new();
        for d in p["dependencies"].as_array().expect("dependencies").iter().filter(|d| d["kind"].is_null()) {
            let features = d["features"].as_array().into_iter().flatten().filter_map(|f| f.as_str()).map(String::from);
            deps.entry(d["name"].as_str().expect("a name").to_string()).or_insert_with(BTreeSet::new).extend(features);
        }
        crates.insert(name, deps);
    }
    crates
}

/// The attempt machinery does no IO: no HTTP stack, no TLS, no sockets, no
/// upstream connections, and tokio for its clock only. (Its dependencies
/// may use more: the snapshot holds each service's upstream profile.)
#[test]
fn the_attempt_machinery_does_no_io() {
    let all = all_dependencies();
    let deps = &all["tidegate-attempts"];
    for forbidden in
        ["hyper", "hyper-util", "h2", "socket2", "rustls", "tokio-rustls", "tidegate-upstream", "tidegate-proxy"]
    {
        assert!(!deps.contains_key(forbidden), "tidegate-attempts depends on {forbidden}");
    }
    let tokio = deps.get("tokio").map(|f| f.iter().map(String::as_str).collect::<Vec<_>>()).unwrap_or_default();
    for io in ["net", "fs", "io-util", "process", "full"] {
        assert!(!tokio.contains(&io), "tidegate-attempts asks tokio for `{io}`");
    }
}
