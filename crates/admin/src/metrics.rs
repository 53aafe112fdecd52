//! `/metrics`: one prometheus-client registry, read at scrape time from
//! the live state (the writer's counters, the snapshot's services and
//! backends, the autoscaler's events, the data plane's own collector and
//! the process).

use std::fmt;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;
use tidegate_autoscale::Events;
use tidegate_balance::{clock, ActiveState, StatsView};
use tidegate_control::{Control, Watchers};
use tidegate_metrics::{counter, gauge, histogram, info, Collector, DescriptorEncoder, ProcessCollector, Registry};

use crate::AdminState;

/// A collector shared with its owner (the data plane's, built by the
/// binary).
#[derive(Clone)]
pub struct SharedCollector(pub Arc<dyn Collector>);

impl fmt::Debug for SharedCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SharedCollector")
    }
}

impl Collector for SharedCollector {
    fn encode(&self, enc: DescriptorEncoder<'_>) -> fmt::Result {
        self.0.encode(enc)
    }
}

/// The registry behind `/metrics`.
pub(crate) fn registry(
    control: &Control,
    events: &Arc<Events>,
    data_plane: &SharedCollector,
    watchers: &Watchers,
    config_file: Option<Arc<crate::ConfigFileReport>>,
) -> Registry {
    let mut r = Registry::default();
    r.register_collector(Box::new(Build));
    r.register_collector(Box::new(ConfigCollector(control.clone(), config_file)));
    r.register_collector(Box::new(WatchCollector(watchers.clone())));
    r.register_collector(Box::new(ServicesCollector(control.clone())));
    r.register_collector(Box::new(EventsCollector(events.clone())));
    r.register_collector(Box::new(data_plane.clone()));
    r.register_collector(Box::new(ProcessCollector));
    r
}

pub(crate) async fn get_metrics(State(state): State<AdminState>) -> impl IntoResponse {
    ([(CONTENT_TYPE, tidegate_metrics::CONTENT_TYPE)], tidegate_metrics::encode(&state.registry))
}

/// `tidegate_build_info{version}`.
#[derive(Debug)]
struct Build;

impl Collector for Build {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> fmt::Result {
        let labels = [("version", env!("CARGO_PKG_VERSION"))];
        info(&mut enc, "tidegate_build", "Tidegate's version (the value is always 1).", &labels)
    }
}

/// The `/v1/watch` streams.
#[derive(Debug)]
struct WatchCollector(Watchers);

impl Collector for WatchCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> fmt::Result {
        let s = self.0.stats();
        let gauges = [
            ("tidegate_watch_streams", "Open /v1/watch streams.", &s.streams),
            ("tidegate_watch_replays", "Of those, the ones replaying history now.", &s.replays),
            (
                "tidegate_watch_queued_bytes",
                "Encoded events queued for watchers' connections (all watchers), bytes.",
                &s.queued_bytes,
            ),
        ];
        for (name, help, v) in gauges {
            gauge(&mut enc, name, help, [([], v.load(Relaxed))])?;
        }
        let counters = [
            ("tidegate_watch_cut", "Watchers cut for falling behind (their last event: lagged).", &s.cut),
            ("tidegate_watch_refused", "Watches refused with 503: too many replays of history at once.", &s.refused),
        ];
        for (name, help, c) in counters {
            counter(&mut enc, name, help, [([], c.load(Relaxed))])?;
        }
        Ok(())
    }
}

/// The instance this process took over, while it drains and after.
pub(crate) struct PredecessorCollector(pub(crate) Arc<crate::PredecessorReport>);

impl fmt::Debug for PredecessorCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PredecessorCollector")
    }
}

impl Collector for PredecessorCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> fmt::Result {
        let Some(state) = self.0.state() else { return Ok(()) };
        let help = "1 while the instance this one took over (serve --takeover) drains its connections, 0 once it exited or went silent.";
        gauge(&mut enc, "tidegate_predecessor_draining", help, [([], u64::from(state.state == "draining"))])?;
        let help = "Client connections the instance this one took over still has open.";
        gauge(&mut enc, "tidegate_predecessor_connections", help, [([], state.connections)])?;
        Ok(())
    }
}

/// The pools from DNS this instance resolves.
#[derive(Debug)]
pub(crate) struct DnsCollector(pub(crate) tidegate_dns::DnsBoard);

impl Collector for DnsCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> fmt::Result {
        let board = self.0.lock().map(|b| b.clone()).unwrap_or_default();
        let help = "Resolutions of each service's DNS pool (its `dns` block), by result (failed: the last good set kept serving).";
        let results = board.iter().flat_map(|(service, s)| {
            [
                ([("service", service.as_str()), ("result", "ok")], s.resolutions.saturating_sub(s.failures)),
                ([("service", service.as_str()), ("result", "failed")], s.failures),
            ]
        });
        counter(&mut enc, "tidegate_dns_resolutions", help, results)?;
        let help = "Addresses of each service's DNS pool in its last answer.";
        let addresses = board.iter().map(|(service, s)| ([("service", service.as_str())], s.addresses.len() as u64));
        gauge(&mut enc, "tidegate_dns_addresses", help, addresses)?;
        let help = "1 while the last resolution of a service's DNS pool failed (the pool is the last good answer's).";
        let stale = board.iter().map(|(service, s)| ([("service", service.as_str())], u64::from(s.error.is_some())));
        gauge(&mut enc, "tidegate_dns_stale", help, stale)
    }
}

/// The writer and the store.
struct ConfigCollector(Control, Option<Arc<crate::ConfigFileReport>>);

impl fmt::Debug for ConfigCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ConfigCollector")
    }
}

impl Collector for ConfigCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> fmt::Result {
        let control = &self.0;
        let m = control.metrics();
        let revision = control.snapshots().load().revision();
        let store = control.store_status();
        let gauges = [
            ("tidegate_config_revision", "Revision of the live configuration.", revision),
            (
                "tidegate_store_connected",
                "1 while the configuration store answers (cluster mode: the etcd watch is live).",
                u64::from(store.connected),
            ),
            (
                "tidegate_store_lag_revisions",
                "Revisions the store holds that this instance has not applied yet.",
                store.latest_revision.saturating_sub(revision),
            ),
        ];
        for (name, help, v) in gauges {
            gauge(&mut enc, name, help, [([], v)])?;
        }
        let help = "Keys of the configuration store in a state Tidegate never leaves them in (docs/cluster.md, \"Store faults\"); while above 0, /readyz answers 503 and writes are refused.";
        gauge(&mut enc, "tidegate_store_faults", help, [([], store.faults.len() as u64)])?;
        if !store.faults.is_empty() {
            let help = "1 for each key of the store at fault, by key and kind of fault.";
            let samples = store.faults.iter().map(|f| ([("key", f.key.as_str()), ("kind", f.kind.code())], 1u64));
            gauge(&mut enc, "tidegate_store_fault", help, samples)?;
        }
        if let Some(file) = &self.1 {
            let state = file.state();
            let help = "1 when the last reading of the configuration file (--config, at start or on SIGHUP) was applied, 0 when it was refused.";
            gauge(&mut enc, "tidegate_config_file_ok", help, [([], u64::from(state.ok))])?;
            let help = "Readings of the configuration file refused (nothing changed).";
            counter(&mut enc, "tidegate_config_file_refused", help, [([], state.failures)])?;
        }
        let counters = [
            ("tidegate_config_commits", "Durable configuration commits.", &m.commits),
            (
                "tidegate_config_commits_by_submitter",
                "Of those, commits of a lone change set made on its submitter's thread, without the writer thread.",
                &m.commits_by_submitter,
            ),
            ("tidegate_config_change_sets", "Change sets applied.", &m.change_sets),
            ("tidegate_config_rejected", "Change sets rejected.", &m.rejected),
            ("tidegate_config_ops", "Operations applied.", &m.ops),
            (
                "tidegate_config_writer_panics",
                "Panics of the configuration writer it recovered from by reloading the store.",
                &m.panics,
            ),
            (
                "tidegate_config_remote_change_sets",
                "Change sets applied that other instances committed (cluster mode).",
                &m.remote_change_sets,
            ),
            (
                "tidegate_config_conflicts",
                "Commits refused because another instance committed first (each is retried after catching up).",
                &m.conflicts,
            ),
            ("tidegate_config_reloads", "Whole reloads of the configuration from the store.", &m.reloads),
        ];
        for (name, help, c) in counters {
            counter(&mut enc, name, help, [([], c.load(Relaxed))])?;
        }
        let seconds = [
            ("tidegate_config_commit_seconds", "Time spent in durable commits.", &m.commit_nanos),
            ("tidegate_config_apply_seconds", "Time from dequeue to publication.", &m.apply_nanos),
        ];
        for (name, help, nanos) in seconds {
            counter(&mut enc, name, help, [([], nanos.load(Relaxed) as f64 / 1e9)])?;
        }
        let help = "Durable commits of the configuration store, by duration.";
        histogram(&mut enc, "tidegate_config_commit_duration_seconds", help, [([], m.commit_seconds.snapshot())])?;
        let help = "Groups of change sets from dequeue to publication (validated, committed, live), by duration.";
        histogram(&mut enc, "tidegate_config_apply_duration_seconds", help, [([], m.apply_seconds.snapshot())])?;
        let snapshot = control.snapshots().load_full();
        let certs = snapshot.certificates().all();
        let help = "End of validity of each TLS certificate (Unix time).";
        let samples = certs.iter().map(|(name, c)| ([("name", name.as_str())], c.not_after));
        gauge(&mut enc, "tidegate_certificate_not_after_seconds", help, samples)?;
        // Managed certificates, from the configuration every instance shares.
        let config = control.config();
        let managed: Vec<_> =
            config.state.certificates().iter().filter_map(|(n, c)| c.managed().map(|m| (n.as_str(), m))).collect();
        let help = "Orders placed with the CA for each managed (ACME) certificate.";
        counter(
            &mut enc,
            "tidegate_acme_orders_total",
            help,
            managed.iter().map(|(n, m)| ([("name", *n)], m.state.orders as f64)),
        )?;
        let help = "Failed orders in a row of each managed certificate (0 once one is issued).";
        gauge(
            &mut enc,
            "tidegate_acme_failures",
            help,
            managed.iter().map(|(n, m)| ([("name", *n)], i64::from(m.state.failures))),
        )?;
        let help = "When each managed certificate is due for renewal, the CA's renewal information considered (Unix time; 0 before its first issuance).";
        gauge(
            &mut enc,
            "tidegate_acme_renew_at_seconds",
            help,
            managed.iter().map(|(n, m)| ([("name", *n)], m.state.renewal_due_at())),
        )?;
        let help = "1 when a managed certificate serves a certificate for exactly its hosts.";
        let valid = managed.iter().map(|(n, m)| ([("name", *n)], i64::from(m.covers_hosts())));
        gauge(&mut enc, "tidegate_acme_valid", help, valid)
    }
}

/// Services and their backends, from the current snapshot.
struct ServicesCollector(Control);

impl fmt::Debug for ServicesCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ServicesCollector")
    }
}

/// One backend as the collector reads it.
struct Row<'a> {
    service: &'a str,
    backend: &'a str,
    view: StatsView,
    available: bool,
    draining: bool,
    effective_weight: Option<f64>,
    stats: &'a tidegate_balance::BackendStats,
}

/// A load report's value, when one was reported.
fn reported(x: &tidegate_balance::AtomicF64) -> Option<f64> {
    Some(x.get()).filter(|v| !v.is_nan())
}

impl Row<'_> {
    fn labels(&self) -> [(&str, &str); 2] {
        [("service", self.service), ("backend", self.backend)]
    }
}

type Pick = fn(&Row<'_>) -> Option<f64>;
type Count = fn(&StatsView) -> u64;

impl Collector for ServicesCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> fmt::Result {
        let snapshot = self.0.snapshots().load_full();
        let now = clock::now_ms();
        let mut services: Vec<_> = snapshot.services().collect();
        services.sort_by(|a, b| a.name.cmp(&b.name));
        let rows: Vec<Row<'_>> = services
            .iter()
            .flat_map(|s| {
                s.selector.backends().iter().zip(crate::status::effective_weights(s)).map(move |(b, effective)| Row {
                    service: s.name.as_str(),
                    backend: b.id.as_str(),
                    view: b.stats.view(),
                    available: b.stats.is_available(now),
                    draining: b.weight == 0,
                    effective_weight: effective,
                    stats: &b.stats,
                })
            })
            .collect();
        let gauges: [(&str, &str, Pick); 13] = [
            ("tidegate_backend_in_flight", "Requests in flight per backend.", |r| Some(r.view.in_flight as f64)),
            (
                "tidegate_backend_up",
                "1 when the backend takes traffic (active checks pass or are off, not ejected), else 0.",
                |r| Some(f64::from(u8::from(r.available))),
            ),
            ("tidegate_backend_ejected", "1 while passive health has the backend ejected.", |r| {
                Some(f64::from(u8::from(r.view.ejected_for_ms > 0)))
            }),
            ("tidegate_backend_down", "1 while active health checks fail.", |r| {
                Some(f64::from(u8::from(r.view.active == ActiveState::Down)))
            }),
            ("tidegate_backend_draining", "1 while the backend has weight 0 (draining: no new requests).", |r| {
                Some(f64::from(u8::from(r.draining)))
            }),
            (
                "tidegate_backend_concurrency_limit",
                "Learned limit on requests awaiting their response head, per backend (services that learn limits).",
                |r| r.view.learned_limit.map(|l| l as f64),
            ),
            (
                "tidegate_backend_no_load_latency_seconds",
                "Learned no-load latency per backend (services that learn limits).",
                |r| r.view.no_load_latency_ms.map(|ms| ms / 1e3),
            ),
            (
                "tidegate_backend_effective_weight",
                "Dynamic weight in effect per backend (dynamic_feedback, orca_wrr).",
                |r| r.effective_weight,
            ),
            ("tidegate_backend_cpu_utilization_ratio", "CPU utilization the load sources report, 0..1.", |r| {
                reported(&r.stats.load.cpu)
            }),
            ("tidegate_backend_memory_utilization_ratio", "Memory utilization the load sources report, 0..1.", |r| {
                reported(&r.stats.load.memory)
            }),
            ("tidegate_backend_network_utilization_ratio", "Network utilization the load sources report, 0..1.", |r| {
                reported(&r.stats.load.network)
            }),
            ("tidegate_backend_reported_requests_per_second", "Requests per second the backend reports (ORCA).", |r| {
                reported(&r.stats.load.qps)
            }),
            ("tidegate_backend_load_report_age_seconds", "Age of the backend's last load report.", |r| {
                let last = r.stats.load.last_ms.load(Relaxed);
                (last > 0).then(|| clock::now_ms().saturating_sub(last) as f64 / 1e3)
            }),
        ];
        for (name, help, pick) in gauges {
            gauge(&mut enc, name, help, rows.iter().filter_map(|r| pick(r).map(|v| (r.labels(), v))))?;
        }
        let counters: [(&str, &str, Count); 3] = [
            ("tidegate_backend_requests", "Requests finished per backend.", |v| v.requests),
            ("tidegate_backend_failures", "Failed requests per backend.", |v| v.failures),
            ("tidegate_backend_ejections", "Passive-health ejections per backend.", |v| v.ejections_total),
        ];
        for (name, help, pick) in counters {
            counter(&mut enc, name, help, rows.iter().map(|r| (r.labels(), pick(&r.view))))?;
        }
        let help = "Attempts per backend, from sending the request to the response head, by duration.";
        let attempts = rows.iter().filter_map(|r| r.stats.attempts.snapshot().map(|h| (r.labels(), h)));
        histogram(&mut enc, "tidegate_upstream_attempt_duration_seconds", help, attempts)?;
        let per_service = |f: fn(&tidegate_snapshot::ServiceRuntime) -> u64| {
            services.iter().map(move |s| ([("service", s.name.as_str())], f(s))).collect::<Vec<_>>()
        };
        let help = "Requests waiting for a backend under its limit, per service.";
        gauge(&mut enc, "tidegate_service_queued", help, per_service(|s| s.live.queue.len() as u64))?;
        let help = "Client addresses (IPv6: /64) with requests waiting in the service's queue.";
        gauge(&mut enc, "tidegate_service_queued_clients", help, per_service(|s| s.live.queue.clients() as u64))?;
        let help = "Requests that lost their place in the service's full queue to a client holding fewer places.";
        counter(&mut enc, "tidegate_service_queue_displaced", help, per_service(|s| s.live.queue.displaced()))?;
        let help = "Requests in flight to the service's backends.";
        let in_flight =
            |s: &tidegate_snapshot::ServiceRuntime| s.selector.backends().iter().map(|b| b.stats.in_flight()).sum();
        gauge(&mut enc, "tidegate_service_in_flight", help, per_service(in_flight))?;
        let help = "Retries in flight to the service's backends (what its retry budget bounds).";
        gauge(
            &mut enc,
            "tidegate_service_retries_in_flight",
            help,
            per_service(|s| s.live.retries_in_flight.load(Relaxed)),
        )?;
        let help = "Retries refused by the service's retry budget.";
        counter(
            &mut enc,
            "tidegate_service_retries_refused",
            help,
            per_service(|s| s.live.retries_refused.load(Relaxed)),
        )?;
        let help = "Time requests that had to queue spent waiting for a backend, per service.";
        let waits =
            services.iter().filter_map(|s| s.live.queue_wait.snapshot().map(|h| ([("service", s.name.as_str())], h)));
        histogram(&mut enc, "tidegate_service_queue_wait_seconds", help, waits)
    }
}

/// The autoscaler's decisions and actions.
struct EventsCollector(Arc<Events>);

impl fmt::Debug for EventsCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("EventsCollector")
    }
}

impl Collector for EventsCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> fmt::Result {
        let counts = self.0.counts();
        let samples = counts.iter().map(|((service, kind), n)| ([("service", service.as_str()), ("kind", *kind)], *n));
        counter(&mut enc, "tidegate_autoscale_events", "Autoscaling decisions and actions.", samples)
    }
}
