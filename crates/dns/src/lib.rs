//! Pools from DNS: a service with a `dns` block (`{"name":
//! "app.internal", "record": "a" | "aaaa" | "srv", "port": 8080}`) takes
//! its backends from the name's records, re-resolved when their TTL runs
//! out (within the block's `min_ttl_s` and `max_ttl_s`).
//!
//! The resolver (hickory-resolver: a well-kept stub resolver that reads
//! `/etc/resolv.conf`, or the one server of `serve --resolver`) answers;
//! [`plan`] turns the answer into `put_backend` and `delete_backend` ops
//! on backends marked `dns`, written through the change log like any
//! change. So a resolved pool is durable, every instance of a cluster
//! serves the same one (in cluster mode one instance resolves each
//! service: the role `dns/SERVICE`, an etcd lease), a backend keeps its id
//! (`dns-IP-PORT`) and with it what the proxy learned about it across
//! resolutions, and an address that goes is removed like any removed
//! backend (requests in progress finish). When the server fails, answers
//! SERVFAIL or names nothing, the last good set keeps serving (fail
//! static) and the status says why.

pub mod plan;

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use hickory_resolver::config::{NameServerConfigGroup, ResolverConfig, ResolverOpts};
use hickory_resolver::name_server::TokioConnectionProvider;
use hickory_resolver::TokioResolver;
use tidegate_control::{Campaigns, Control};
use tidegate_model::dns::{DnsPool, DnsRecord};
use tidegate_model::{ChangeSet, ServiceName};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::plan::{Found, SrvTarget};

/// Where a service's pool from DNS stands, as `/v1/status` shows it.
#[derive(Debug, Clone, Default, serde::Serialize, schemars::JsonSchema)]
pub struct DnsStatus {
    /// The name resolved.
    pub name: String,
    /// `a`, `aaaa` or `srv`.
    pub record: String,
    /// When the last resolution that answered was made (ms since the Unix
    /// epoch).
    pub resolved_at_unix_ms: Option<u64>,
    /// The addresses it named (`IP:PORT`).
    pub addresses: Vec<String>,
    /// The smallest TTL of its records, seconds.
    pub ttl_s: Option<u64>,
    /// When the next resolution is due (ms since the Unix epoch).
    pub next_at_unix_ms: Option<u64>,
    /// Why the last resolution failed, while it does: the last good set
    /// keeps serving.
    pub error: Option<String>,
    /// Resolutions made since the start (failed ones included).
    pub resolutions: u64,
    /// Failed resolutions since the start.
    pub failures: u64,
}

/// Every DNS pool's status by service (this instance's view: in cluster
/// mode the instance that resolves a service fills it).
pub type DnsBoard = Arc<Mutex<BTreeMap<String, DnsStatus>>>;

/// Why resolving failed.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// The resolver could not be set up from `/etc/resolv.conf`.
    #[error("reading the system's resolver configuration: {0}")]
    System(String),
    /// The lookup failed (no answer, SERVFAIL, refused, a timeout).
    #[error("{0}")]
    Lookup(String),
    /// The server answered, and named nothing usable.
    #[error("no records")]
    NoRecords,
}

/// A resolver for the pools: the system's (`/etc/resolv.conf`) or the
/// one server at `server` (UDP, and TCP for long answers).
pub fn resolver(server: Option<SocketAddr>) -> Result<TokioResolver, ResolveError> {
    let mut builder = match server {
        Some(addr) => {
            let servers = NameServerConfigGroup::from_ips_clear(&[addr.ip()], addr.port(), true);
            TokioResolver::builder_with_config(
                ResolverConfig::from_parts(None, vec![], servers),
                TokioConnectionProvider::default(),
            )
        }
        None => TokioResolver::builder_tokio().map_err(|e| ResolveError::System(e.to_string()))?,
    };
    let opts: &mut ResolverOpts = builder.options_mut();
    // Tidegate keeps the answers itself and asks again at their TTL: the
    // resolver's own cache would answer from memory instead.
    opts.cache_size = 0;
    opts.timeout = Duration::from_secs(2);
    opts.attempts = 2;
    Ok(builder.build())
}

/// Resolves `pool`: the backends its records name and the smallest TTL.
pub async fn resolve(resolver: &TokioResolver, pool: &DnsPool) -> Result<(Vec<Found>, Duration), ResolveError> {
    let now = std::time::Instant::now();
    let ttl = |valid_until: std::time::Instant| valid_until.saturating_duration_since(now);
    let lookup_error = |e: hickory_resolver::ResolveError| {
        if e.is_no_records_found() {
            ResolveError::NoRecords
        } else {
            ResolveError::Lookup(e.to_string())
        }
    };
    let name = pool.name.as_str();
    let (found, ttl) = match pool.record {
        DnsRecord::A => {
            let answer = resolver.ipv4_lookup(name).await.map_err(lookup_error)?;
            let ips: Vec<IpAddr> = answer.iter().map(|a| IpAddr::V4(a.0)).collect();
            (plan::from_addresses(&ips, pool.port.unwrap_or(0)), ttl(answer.as_lookup().valid_until()))
        }
        DnsRecord::Aaaa => {
            let answer = resolver.ipv6_lookup(name).await.map_err(lookup_error)?;
            let ips: Vec<IpAddr> = answer.iter().map(|a| IpAddr::V6(a.0)).collect();
            (plan::from_addresses(&ips, pool.port.unwrap_or(0)), ttl(answer.as_lookup().valid_until()))
        }
        DnsRecord::Srv => {
            let answer = resolver.srv_lookup(name).await.map_err(lookup_error)?;
            let mut shortest = ttl(answer.as_lookup().valid_until());
            let mut records = Vec::new();
            for srv in answer.iter() {
                let target = srv.target().to_utf8();
                // The target's addresses: both families, as the server
                // gives them (a target may have either or both).
                let mut ips = Vec::new();
                if let Ok(v4) = resolver.ipv4_lookup(target.as_str()).await {
                    shortest = shortest.min(ttl(v4.as_lookup().valid_until()));
                    ips.extend(v4.iter().map(|a| IpAddr::V4(a.0)));
                }
                if let Ok(v6) = resolver.ipv6_lookup(target.as_str()).await {
                    shortest = shortest.min(ttl(v6.as_lookup().valid_until()));
                    ips.extend(v6.iter().map(|a| IpAddr::V6(a.0)));
                }
                records.push(SrvTarget { priority: srv.priority(), weight: srv.weight(), port: srv.port(), ips });
            }
            (plan::from_srv(&records), shortest)
        }
    };
    if found.is_empty() {
        return Err(ResolveError::NoRecords);
    }
    Ok((found, ttl))
}

/// The cluster-wide role of resolving one service's pool.
fn role(service: &ServiceName) -> String {
    format!("dns/{service}")
}

/// Time between looks at the services' pools.
const TICK: Duration = Duration::from_millis(250);

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// One service's schedule.
struct Schedule {
    pool: DnsPool,
    next: Instant,
    /// The resolution under way; it returns the time until the next.
    task: Option<JoinHandle<Duration>>,
}

/// Runs the pools until aborted: resolves each service's `dns` block when
/// due (on the instance that leads its role), writes what changed, and
/// removes the resolved backends of a service whose block is gone.
pub fn spawn(control: Control, resolver: TokioResolver, board: DnsBoard) -> JoinHandle<()> {
    let resolver = Arc::new(resolver);
    tokio::spawn(async move {
        let mut campaigns = Campaigns::new(role);
        let mut schedules: BTreeMap<ServiceName, Schedule> = BTreeMap::new();
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let config = control.config();
            let services = config.state.services();
            // Services that have a block, or resolved backends left over.
            let pooled: Vec<&ServiceName> = services
                .iter()
                .filter(|(_, s)| s.settings.dns.is_some() || s.backends.values().any(|b| b.dns))
                .map(|(n, _)| n)
                .collect();
            campaigns.follow(&control, pooled.iter().copied());
            // A schedule lasts while its block is unchanged and this
            // instance resolves the service.
            schedules.retain(|name, s| {
                let keep = services.get(name).and_then(|spec| spec.settings.dns.as_ref()) == Some(&s.pool)
                    && control.leads(&role(name));
                if let Some(task) = s.task.as_ref().filter(|_| !keep) {
                    task.abort();
                }
                keep
            });
            for s in schedules.values_mut() {
                if let Some(task) = s.task.take_if(|t| t.is_finished()) {
                    let wait = task.await.unwrap_or(Duration::from_secs(5));
                    s.next = Instant::now() + wait;
                }
            }
            if let Ok(mut b) = board.lock() {
                b.retain(|name, _| {
                    ServiceName::new(name).is_ok_and(|n| services.get(&n).is_some_and(|s| s.settings.dns.is_some()))
                });
            }
            let now = Instant::now();
            for name in pooled {
                if !control.leads(&role(name)) {
                    continue;
                }
                let Some(spec) = services.get(name) else { continue };
                let Some(pool) = spec.settings.dns.clone() else {
                    // The block is gone: its backends go too.
                    let ops = plan::remove_all(name, spec);
                    if !ops.is_empty() {
                        submit(&control, name, ops).await;
                    }
                    continue;
                };
                let s = schedules.entry(name.clone()).or_insert_with(|| Schedule { pool, next: now, task: None });
                if s.task.is_some() || now < s.next {
                    continue;
                }
                let (control, resolver, board, name, pool) =
                    (control.clone(), resolver.clone(), board.clone(), name.clone(), s.pool.clone());
                s.task =
                    Some(tokio::spawn(
                        async move { resolve_and_write(&control, &resolver, &board, &name, &pool).await },
                    ));
            }
        }
    })
}

/// Resolves one pool, writes what changed, records the status; returns
/// the time until the next resolution.
async fn resolve_and_write(
    control: &Control,
    resolver: &TokioResolver,
    board: &DnsBoard,
    name: &ServiceName,
    pool: &DnsPool,
) -> Duration {
    let outcome = resolve(resolver, pool).await;
    let wait = match &outcome {
        Ok((found, ttl)) => {
            let ops = control.config().state.services().get(name).map(|spec| plan::ops(name, spec, found));
            if let Some(ops) = ops.filter(|o| !o.is_empty()) {
                tracing::info!(service = %name, dns = %pool.name, changes = ops.len(), "DNS pool changed");
                submit(control, name, ops).await;
            }
            plan::next_resolution(pool, *ttl)
        }
        Err(e) => {
            tracing::warn!(service = %name, dns = %pool.name, error = %e, "DNS resolution failed; the last good set keeps serving");
            plan::retry_after_failure(pool)
        }
    };
    if let Ok(mut b) = board.lock() {
        let s = b.entry(name.to_string()).or_default();
        s.name = pool.name.clone();
        s.record = format!("{:?}", pool.record).to_ascii_lowercase();
        s.resolutions += 1;
        s.next_at_unix_ms = Some(unix_ms(SystemTime::now() + wait));
        match outcome {
            Ok((found, ttl)) => {
                s.resolved_at_unix_ms = Some(unix_ms(SystemTime::now()));
                s.addresses = found.iter().map(|f| f.addr.to_string()).collect();
                s.ttl_s = Some(ttl.as_secs());
                s.error = None;
            }
            Err(e) => {
                s.failures += 1;
                s.error = Some(e.to_string());
            }
        }
    }
    wait
}

async fn submit(control: &Control, name: &ServiceName, ops: Vec<tidegate_model::Op>) {
    if let Err(e) = control.submit(ChangeSet { if_revision: None, ops }).await {
        tracing::warn!(service = %name, error = %e, "DNS pool change refused");
    }
}
