//! `saturate`: closed-loop admin writes from concurrent keep-alive clients,
//! to find how many change sets (and operations) per second the write path
//! sustains.
//!
//! Client `c` writes backend ids `sat-{c}-{n}` of one service, cycling over
//! 50 ids (or `batch` ids when batches are larger), always with the same
//! address and weight (`--weight`): with `batch` = 1 through `PUT /v1/services/{s}/backends/{id}`,
//! otherwise as one `POST /v1/changes` of `batch` `put_backend` operations.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::ensure;
use serde::Serialize;
use serde_json::{json, Value};

use crate::cli::{SaturateArgs, Target};
use crate::client::{self, Http};
use crate::raw::{self, RawConn};
use crate::report::{self, Counts, Latency, Summary};
use crate::schedule;

/// Backend ids each client cycles over (at least).
const IDS_PER_CLIENT: u64 = 50;
/// Clients at most.
const MAX_CLIENTS: usize = 10_000;
/// Operations per change set at most.
const MAX_BATCH: usize = 100_000;

/// The JSON printed by `saturate`.
#[derive(Debug, Serialize)]
pub struct SaturateReport {
    scenario: &'static str,
    service: String,
    clients: usize,
    batch: usize,
    weight: u32,
    duration_s: f64,
    elapsed_s: f64,
    /// Change sets answered 200.
    change_sets: u64,
    /// Operations in those change sets.
    ops: u64,
    change_sets_per_s: f64,
    ops_per_s: f64,
    /// Send until answer, over every answered change set.
    latency_us: Summary,
    errors: Counts,
    error_total: u64,
}

/// Runs `saturate`.
pub async fn run(target: &Target, args: &SaturateArgs) -> anyhow::Result<SaturateReport> {
    ensure!((1..=MAX_CLIENTS).contains(&args.clients), "--clients must be within 1..={MAX_CLIENTS}");
    ensure!((1..=MAX_BATCH).contains(&args.batch), "--batch must be within 1..={MAX_BATCH}");
    client::require_loopback("--addr", args.addr)?;
    let length = schedule::run_length(args.duration_s)?;
    let timeout = Duration::from_millis(target.timeout_ms);
    let token = client::token(target)?;
    let probe = Http::new(target.admin, Some(token), timeout)?;
    let reply = probe.get(&format!("/v1/services/{}", args.service)).await;
    client::expect_ok("GET service (create it with `setup`)", reply)?;

    let start = Instant::now();
    let deadline = start + length;
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..args.clients {
        // Each client keeps its own connection alive.
        let conn = RawConn::new(target.admin, timeout);
        let writer = Writer {
            service: args.service.clone(),
            client: c,
            batch: args.batch,
            addr: args.addr,
            weight: args.weight,
            admin: target.admin,
            token: token.to_owned(),
        };
        let max = args.max_per_client;
        tasks.spawn(async move { writer.run(conn, deadline, max).await });
    }
    let mut total = ClientTotals::default();
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(t) => total.merge(&t),
            Err(_) => total.errors.bump("client_task_failed"),
        }
    }
    let elapsed = start.elapsed();
    let ops = total.ok * args.batch as u64;
    Ok(SaturateReport {
        scenario: "saturate",
        service: args.service.clone(),
        clients: args.clients,
        batch: args.batch,
        weight: args.weight,
        duration_s: args.duration_s,
        elapsed_s: report::seconds(elapsed),
        change_sets: total.ok,
        ops,
        change_sets_per_s: report::per_second(total.ok, elapsed),
        ops_per_s: report::per_second(ops, elapsed),
        latency_us: total.latency.summary(),
        error_total: total.errors.total(),
        errors: total.errors,
    })
}

/// What one client writes.
struct Writer {
    service: String,
    client: usize,
    batch: usize,
    addr: SocketAddr,
    weight: u32,
    /// The admin API it writes to, and its token.
    admin: SocketAddr,
    token: String,
}

/// One client's results.
#[derive(Default)]
struct ClientTotals {
    ok: u64,
    latency: Latency,
    errors: Counts,
}

impl ClientTotals {
    fn merge(&mut self, other: &ClientTotals) {
        self.ok += other.ok;
        self.latency.merge(&other.latency);
        self.errors.merge(&other.errors);
    }
}

impl Writer {
    /// The closed loop: one change set at a time until `deadline` or `max`.
    async fn run(&self, mut conn: RawConn, deadline: Instant, max: u64) -> ClientTotals {
        let mut totals = ClientTotals::default();
        let mut k: u64 = 0;
        let spec = json!({ "addr": self.addr.to_string(), "weight": self.weight }).to_string();
        while k < max && Instant::now() < deadline {
            // Built before the clock starts, as a prepared request would be.
            let request = if self.batch == 1 {
                let id = backend_id(self.client, k, 1, 0);
                let path = format!("/v1/services/{}/backends/{id}", self.service);
                raw::request("PUT", &path, self.admin, &self.token, spec.as_bytes())
            } else {
                let body = self.change_set(k).to_string();
                raw::request("POST", "/v1/changes", self.admin, &self.token, body.as_bytes())
            };
            let sent = Instant::now();
            match conn.send(&request).await {
                Ok(200) => {
                    totals.ok += 1;
                    totals.latency.record(sent.elapsed());
                }
                Ok(status) => {
                    totals.latency.record(sent.elapsed());
                    totals.errors.bump(format!("admin_status_{status}"));
                }
                Err(f) => {
                    totals.errors.bump(format!("admin_{}", f.label()));
                    // Do not spin on a refused connection.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
            k += 1;
        }
        totals
    }

    /// Change set `k`: `batch` distinct `put_backend` operations.
    fn change_set(&self, k: u64) -> Value {
        let ops: Vec<Value> = (0..self.batch as u64)
            .map(|j| {
                json!({
                    "op": "put_backend",
                    "service": self.service,
                    "id": backend_id(self.client, k, self.batch as u64, j),
                    "spec": { "addr": self.addr.to_string(), "weight": self.weight },
                })
            })
            .collect();
        json!({ "ops": ops })
    }
}

/// Id of operation `j` of change set `k` of `client`: the ids cycle over
/// `max(50, batch)` values so that one change set never repeats an id.
fn backend_id(client: usize, k: u64, batch: u64, j: u64) -> String {
    let cycle = IDS_PER_CLIENT.max(batch);
    format!("sat-{client}-{}", (k * batch + j) % cycle)
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn single_writes_cycle_over_fifty_ids() {
        assert_eq!(backend_id(3, 0, 1, 0), "sat-3-0");
        assert_eq!(backend_id(3, 49, 1, 0), "sat-3-49");
        assert_eq!(backend_id(3, 50, 1, 0), "sat-3-0");
    }

    #[test]
    fn a_batch_never_repeats_an_id() {
        for batch in [2u64, 7, 50, 64, 200] {
            for k in 0..5 {
                let ids: HashSet<String> = (0..batch).map(|j| backend_id(0, k, batch, j)).collect();
                assert_eq!(ids.len() as u64, batch, "batch {batch}, k {k}");
            }
        }
    }

    #[test]
    fn change_sets_hold_put_backend_ops() {
        let w = Writer {
            service: "web".to_owned(),
            client: 1,
            batch: 3,
            addr: "127.0.0.2:10000".parse().unwrap(),
            weight: 0,
            admin: "127.0.0.1:9901".parse().unwrap(),
            token: "t".to_owned(),
        };
        let set = w.change_set(1);
        let ops = set["ops"].as_array().unwrap();
        assert_eq!(ops.len(), 3);
        assert_eq!(ops[0]["op"], "put_backend");
        assert_eq!(ops[0]["id"], "sat-1-3");
        assert_eq!(ops[2]["spec"]["addr"], "127.0.0.2:10000");
        assert_eq!(ops[2]["spec"]["weight"], 0);
    }
}
