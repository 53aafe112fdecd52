//! `tidegate serve`: store, writer, data plane and admin API.

use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use tidegate_admin::AdminState;
use tidegate_control::Control;
use tidegate_proxy::access_log::{self, AccessLog};
use tidegate_proxy::{Http1Engine, Limits, ProxyMetrics, RuntimeMode, ServerOptions};
use tidegate_store::{EtcdAccess, EtcdCredentials, EtcdStore, EtcdTls, EtcdUrl, RedbStore, SqliteStore, Store};

use crate::cli::{AccessLogFormat, ConfigMode, EtcdArgs, Http1Arg, LogFormat, RuntimeArg, ServeArgs};
use crate::config_file;

/// `info`, but rustls only at `error`: its warnings describe what a client
/// sent (an IP address as the server name, for one, which every client that
/// connects by address sends), one line per handshake, so any client could
/// fill the log with them.
pub const DEFAULT_LOG_FILTER: &str = "info,rustls=error";

/// The filter for a `TIDEGATE_LOG` value: the value, with rustls held at
/// `error` unless the value names rustls itself; the default when unset.
fn log_filter(value: Option<&str>) -> String {
    match value.map(str::trim) {
        None | Some("") => DEFAULT_LOG_FILTER.to_string(),
        Some(v) if v.contains("rustls") => v.to_string(),
        Some(v) => format!("{v},rustls=error"),
    }
}

/// Application logs on standard error, filtered by `TIDEGATE_LOG` (default
/// [`DEFAULT_LOG_FILTER`]): readable text, in colour only on a terminal, or
/// one JSON object per line with `TIDEGATE_LOG_FORMAT=json` (or
/// `--log-format json`).
pub fn init_logs(json: bool) {
    let value = std::env::var("TIDEGATE_LOG").ok();
    let filter = tracing_subscriber::EnvFilter::try_new(log_filter(value.as_deref()))
        .unwrap_or_else(|_| DEFAULT_LOG_FILTER.into());
    let logs = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if json {
        logs.json().with_current_span(false).init();
    } else {
        logs.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())).init();
    }
}

pub fn run(args: ServeArgs) -> anyhow::Result<ExitCode> {
    // First: the executable's path must be read before a package upgrade
    // can replace the file.
    let description = crate::takeover::this_process();
    init_logs(args.log_format == LogFormat::Json);
    if let Some(p) = &args.health_path {
        if !p.starts_with('/') || p.contains(['?', '#', ' ']) {
            bail!("--health-path {p:?}: must be a path starting with '/', with no query");
        }
    }
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("creating data directory {}", args.data_dir.display()))?;
    tidegate_proxy::never_serve(&[&args.data_dir]);

    // Every client connection and every backend connection is a
    // descriptor: take all the system allows (the soft limit is often 1024).
    // Each proxied request also holds a backend connection, so the cap on
    // client connections is at most half of it (less a reserve for the
    // store, the admin API and health probes).
    let fd_limit = match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(n) => n,
        Err(e) => {
            tracing::warn!(error = %e, "cannot raise the descriptor limit");
            1024
        }
    };
    let fd_cap = usize::try_from(fd_limit.saturating_sub(256) / 2).unwrap_or(usize::MAX).max(16);
    if fd_cap < args.max_connections {
        tracing::info!(fd_limit, max_connections = fd_cap, "--max-connections lowered to fit the descriptor limit");
    }
    let workers = args.workers.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    // Sockets from the service manager (socket activation): read before
    // any thread starts (it removes the variables that name them).
    let activated = crate::systemd::activated(&args, workers)?;
    let metrics = Arc::new(ProxyMetrics::default());
    let access_log = match &args.access_log {
        None => None,
        Some(path) => {
            let target = match path.to_str() {
                Some("-") => access_log::Target::Stdout,
                _ => access_log::Target::File(path.clone()),
            };
            let format = match args.access_log_format {
                AccessLogFormat::Json => access_log::Format::Json,
                AccessLogFormat::Combined => access_log::Format::Combined,
            };
            let log = AccessLog::start(target, format)
                .with_context(|| format!("--access-log {}: cannot open it", path.display()))?;
            Some(Arc::new(log))
        }
    };
    let tracing = match &args.otlp_endpoint {
        None => None,
        Some(url) => Some(start_tracing(url, &args).with_context(|| format!("--otlp-endpoint {url}"))?),
    };
    // With --takeover, the running instance's sockets first: it closes the
    // embedded store before handing them over. Everything that may fail
    // on its own (flags, the access log) was checked before asking.
    let mut taking = match args.takeover {
        true => Some(crate::takeover::take_over(&args)?),
        false => None,
    };
    let opened = (|| {
        // The store locks the data directory; only then may the token be written.
        let store: Arc<dyn Store> = match &args.store {
            None => Arc::new(open_store(&args.data_dir)?),
            Some(url) => {
                let store = EtcdStore::open(url.clone(), etcd_access(&args.etcd)?)
                    .with_context(|| format!("connecting to the configuration store {}", url))?;
                Arc::new(store)
            }
        };
        let token = admin_token(&args.data_dir)?;
        let control = Control::start(store).context("not starting: loading the configuration from the store")?;
        anyhow::Ok((token, control))
    })();
    let (token, control) = match (opened, taking.take()) {
        (Ok(opened), None) => opened,
        (Ok(opened), Some(mut t)) => {
            // The running instance goes on accepting until this one serves.
            let learned = t.ready()?;
            if let Some(memory) = learned {
                recall(&opened.1, &memory);
            }
            // Cluster mode: the same membership, so the roles it leads
            // (autoscaling) stay with no election in between.
            if let Some(lease) = t.lease {
                opened.1.adopt_lease(lease);
            }
            taking = Some(t);
            opened
        }
        (Err(e), Some(t)) => {
            t.refuse(&format!("{e:#}"));
            return Err(e.context("--takeover: the running instance keeps serving"));
        }
        (Err(e), None) => return Err(e),
    };
    let mut received = match (taking.as_mut(), activated) {
        (Some(t), activated) => {
            if activated.is_some() {
                tracing::warn!("--takeover: the service manager's sockets are not used, the running instance's are");
            }
            Some(std::mem::take(&mut t.received))
        }
        (None, activated) => activated,
    };
    let sockets = crate::takeover::Sockets::default();
    // The ACME manager's wake-up, shared with on-demand issuance.
    let acme_wake = Arc::new(tokio::sync::Notify::new());
    let on_demand = tidegate_acme::OnDemandIssuer::new(control.clone(), acme_wake.clone());
    // The named listeners' state, written by the data plane, read by the
    // admin API.
    let listener_board = tidegate_snapshot::ListenerBoard::default();
    let options = ServerOptions {
        listen: match (args.listen, args.listen_tls) {
            (None, None) => Some(SocketAddr::from(([127, 0, 0, 1], 8080))),
            (plain, _) => plain,
        },
        listen_tls: args.listen_tls,
        workers,
        mode: match args.runtime {
            RuntimeArg::PerCore => RuntimeMode::PerCore,
            RuntimeArg::MultiThread => RuntimeMode::MultiThread,
        },
        http1: match args.http1 {
            Http1Arg::Native => Http1Engine::Native,
            Http1Arg::Hyper => Http1Engine::Hyper,
        },
        limits: limits(&args, fd_cap),
        drain_timeout: Duration::from_secs(args.drain_timeout_s),
        health_path: args.health_path.clone(),
        access_log: access_log.clone(),
        on_demand: Some(Arc::new(OnDemand(Arc::new(on_demand)))),
        tracing,
        listener_changes: Some(control.snapshot_changes()),
        listener_board: listener_board.clone(),
        named_sockets: tidegate_proxy::NamedSockets::default(),
        http3: args.http3.then_some(tidegate_proxy::Http3 {
            retry_above: args.http3_retry_above,
            alt_svc_max_age_s: args.alt_svc_max_age_s,
        }),
    };
    if let Some(r) = received.as_mut() {
        options.named_sockets.inherit(std::mem::take(&mut r.named));
    }
    sockets.with_named(options.named_sockets.clone());
    let proxy = match received.as_mut().filter(|r| !r.plain.is_empty() || !r.tls.is_empty()) {
        Some(r) => {
            let listeners =
                tidegate_proxy::Listeners { plain: std::mem::take(&mut r.plain), tls: std::mem::take(&mut r.tls) };
            tidegate_proxy::serve_on(options, listeners, control.snapshots(), metrics.clone())
        }
        None => tidegate_proxy::serve(options, control.snapshots(), metrics.clone()),
    }
    .with_context(|| match (args.listen, args.listen_tls) {
        (Some(a), Some(t)) => format!("listening on {a} and {t}"),
        (None, Some(t)) => format!("listening on {t}"),
        (Some(a), None) => format!("listening on {a}"),
        (None, None) => "listening on 127.0.0.1:8080".to_string(),
    })?;
    for l in proxy.sockets() {
        let kind = if l.tls { tidegate_takeover::Kind::ProxyTls } else { tidegate_takeover::Kind::Proxy };
        sockets.add(kind, l.addr, l.fd)?;
    }

    let events = Arc::new(tidegate_autoscale::Events::default());
    let scaling = tidegate_autoscale::StatusBoard::default();
    let dns = tidegate_dns::DnsBoard::default();
    let pools = Pools { resolver: args.resolver, board: dns.clone() };
    let background = Background::start(
        &control,
        events.clone(),
        args.data_dir.join("instances"),
        scaling.clone(),
        acme_wake,
        pools,
    )?;

    // The admin API and the writer's submitters share one small runtime,
    // apart from the data plane, so configuration stays responsive under load.
    // Once a successor serves: where this process reports its drain.
    let link = crate::takeover::SuccessorLink::default();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let result = runtime.block_on(async {
        let report = args.config.as_ref().map(|path| {
            let mode = match args.config_mode {
                ConfigMode::Seed => "seed",
                ConfigMode::Sync => "sync",
            };
            Arc::new(tidegate_admin::ConfigFileReport::new(path, mode))
        });
        let sync = match (&args.config, args.config_mode, &report) {
            (Some(path), ConfigMode::Seed, _) => {
                load_initial_config(&control, path).await?;
                if let Some(report) = &report {
                    report.applied(control.config().revision);
                }
                None
            }
            (Some(path), ConfigMode::Sync, Some(report)) => {
                // At start, a file that cannot be applied stops the start:
                // serving a configuration the operator did not ask for
                // would be worse.
                let revision = sync_config(&control, path).await?;
                report.applied(revision);
                Some((path.clone(), report.clone()))
            }
            _ => None,
        };
        // Handlers are in place before the ready line: SIGHUP's default
        // action would end the process.
        use tokio::signal::unix::{signal, SignalKind};
        let term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
        let int = signal(SignalKind::interrupt()).context("SIGINT handler")?;
        let hup = signal(SignalKind::hangup()).context("SIGHUP handler")?;
        let _hangups = tokio::spawn(on_hangup(hup, control.clone(), sync));
        let usr1 = signal(SignalKind::user_defined1()).context("SIGUSR1 handler")?;
        let _reopens = tokio::spawn(on_usr1(usr1, access_log.clone()));
        let usr2 = signal(SignalKind::user_defined2()).context("SIGUSR2 handler")?;
        let _upgrades = tokio::spawn(on_usr2(usr2, args.data_dir.clone(), description.exe.clone()));
        let listener = match received.as_mut().and_then(|r| r.admin.take()) {
            Some(l) => inherited(l).context("the admin API's socket")?,
            None => tokio::net::TcpListener::bind(args.admin)
                .await
                .with_context(|| format!("admin API on {}", args.admin))?,
        };
        let admin_addr = listener.local_addr()?;
        sockets.add(tidegate_takeover::Kind::Admin, admin_addr, std::os::fd::AsFd::as_fd(&listener))?;
        if args.store.is_some() {
            let name = args.instance_name.clone().unwrap_or_else(|| format!("{}:{}", hostname(), admin_addr.port()));
            control.announce(name, admin_addr.to_string());
        }
        let data_plane = Arc::new(metrics.collector(control.snapshots()));
        let watch_limits = tidegate_control::WatchLimits {
            queue_bytes: args.watch_queue_bytes,
            max_replays: args.watch_max_replays,
            stall: Duration::from_secs(args.watch_stall_timeout_s),
        };
        let mut state = AdminState::new(control.clone(), &token, data_plane)
            .with_autoscaler(events, scaling)
            .with_dns(dns)
            .with_listeners(listener_board.clone())
            .with_watch_limits(watch_limits)
            .with_private_dir(&args.data_dir);
        if let Some(report) = report {
            state = state.with_config_file(report);
        }
        if args.http3 {
            let metrics = metrics.clone();
            state = state.with_quic(Arc::new(move || metrics.quic_open().unwrap_or(0)));
        }
        let predecessor = taking.as_ref().map(|t| Arc::new(tidegate_admin::PredecessorReport::new(t.pid)));
        if let Some(report) = &predecessor {
            state = state.with_predecessor(report.clone());
        }
        // One machine-readable line for scripts and tests: `proxy=`,
        // `proxy_tls=` and `metrics=` for the listeners there are.
        let mut listeners = String::new();
        if let Some(a) = proxy.local_addr() {
            listeners.push_str(&format!("proxy={a} "));
        }
        if let Some(a) = proxy.tls_addr() {
            listeners.push_str(&format!("proxy_tls={a} "));
        }
        let _metrics = match args.metrics_listen {
            Some(addr) => {
                let l = match received.as_mut().and_then(|r| r.metrics.take()) {
                    Some(l) => inherited(l).context("the metrics listener's socket")?,
                    None => tokio::net::TcpListener::bind(addr)
                        .await
                        .with_context(|| format!("--metrics-listen on {addr}"))?,
                };
                let bound = l.local_addr()?;
                sockets.add(tidegate_takeover::Kind::Metrics, bound, std::os::fd::AsFd::as_fd(&l))?;
                listeners.push_str(&format!("metrics={bound} "));
                let app = tidegate_admin::metrics_router(state.clone());
                Some(tokio::spawn(async move { axum::serve(l, app).await }))
            }
            None => None,
        };
        // A successor of this process finds it from now on; the one this
        // process took over from stops accepting.
        let (handed_tx, mut handed_over) = tokio::sync::watch::channel(false);
        let handed_over_end = handed_over.clone();
        // Not fatal: in cluster mode two instances may share a data
        // directory (only the first can be taken over then).
        let embedded = args.store.is_none();
        let _offering = match crate::takeover::Offering::start(
            &args.data_dir,
            control.clone(),
            sockets.clone(),
            embedded,
            description.clone(),
            link.clone(),
            handed_tx,
        ) {
                Ok(offering) => Some(offering),
                Err(e) => {
                    tracing::warn!(error = %format!("{e:#}"), "this instance cannot be taken over (`serve --takeover`)");
                    None
                }
            };
        if let (Some(t), Some(report)) = (taking.take(), predecessor) {
            t.serving(report)?;
            tracing::info!("took over: the previous instance drains and exits");
        }
        tracing::info!(listeners = %listeners.trim_end(), admin = %admin_addr, revision = control.config().revision, workers, "tidegate ready");
        println!("tidegate ready {listeners}admin={} revision={}", admin_addr, control.config().revision);
        let _ = std::io::stdout().flush();
        // After a hand-over, this process is the service's main process.
        crate::systemd::notify(&format!("READY=1\nMAINPID={}\nSTATUS=serving", std::process::id()));
        let (stopping_tx, stopping) = tokio::sync::watch::channel(false);
        let server = axum::serve(listener, tidegate_admin::router(state)).with_graceful_shutdown(async move {
            tokio::select! {
                _ = shutdown_signal(term, int) => {}
                _ = handed_over.wait_for(|h| *h) => {}
            }
            let _ = stopping_tx.send(true);
        });
        // Watch streams never end by themselves: give open admin requests a
        // moment after the signal, then stop regardless.
        let mut stopping = stopping;
        tokio::select! {
            result = server => result?,
            _ = async {
                let _ = stopping.wait_for(|s| *s).await;
                tokio::time::sleep(Duration::from_secs(2)).await;
            } => {}
        }
        let handed_over = *handed_over_end.borrow();
        anyhow::Ok(handed_over)
    });
    let handed_over = result?;
    if !handed_over {
        // (After a hand-over the successor is the main process: nothing
        // to say.)
        crate::systemd::notify("STOPPING=1\nSTATUS=draining");
        // In cluster mode, leave at once: this instance's record and roles
        // go now, not when its lease lapses. After a hand-over the
        // successor announced itself under the same name: leave that be.
        control.retire();
    }
    // Probes, load sources and the autoscaler stop before the drain: after
    // a hand-over, the successor's act on the same backends and instances.
    drop(background);
    // The sockets close as the workers stop accepting, unless a successor
    // holds them.
    sockets.clear();
    tracing::info!("shutting down: draining client connections");
    let open = proxy.open_connections();
    link.report_while(open, || proxy.shutdown());
    Ok(ExitCode::SUCCESS)
}

/// Gives the first snapshot's backends what the instance taken over had
/// learned about them (the statistics are shared with later snapshots).
fn recall(control: &Control, memory: &tidegate_snapshot::Memory) {
    let recalled = control.snapshots().load().recall(memory);
    for (service, backend, e) in &recalled.refused {
        tracing::warn!(service, backend, error = %e, "the learned state of a backend does not make sense; it learns from scratch");
    }
    tracing::info!(
        backends = recalled.backends,
        unknown = recalled.unknown,
        refused = recalled.refused.len(),
        "took over what the previous instance learned about its backends"
    );
}

/// On-demand TLS for the data plane: the ACME manager's issuer behind the
/// proxy's trait (the proxy does not depend on the ACME crate).
#[derive(Debug)]
struct OnDemand(Arc<tidegate_acme::OnDemandIssuer>);

impl tidegate_proxy::OnDemandTls for OnDemand {
    fn obtain(&self, name: String) -> std::pin::Pin<Box<dyn std::future::Future<Output = bool> + Send>> {
        let issuer = self.0.clone();
        Box::pin(async move { issuer.obtain(name).await })
    }
}

/// The background work that follows the configuration: active health
/// probes, load sources, the refresh of policies' dynamic weights, the
/// autoscaler and the ACME manager. It runs on a runtime and a thread of its own, never on the
/// admin API's: after a change, its passes over every service take about
/// 0.5-0.8 ms each with 10,000 services, and on a shared runtime every
/// admin answer ready meanwhile waited for them (docs/benchmarks.md,
/// churn). The runtime stops when this is dropped.
/// What the DNS pools need: the server given with `--resolver` (else
/// the system's), and where their state is shown.
struct Pools {
    resolver: Option<std::net::SocketAddr>,
    board: tidegate_dns::DnsBoard,
}

struct Background {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Background {
    fn start(
        control: &Control,
        events: Arc<tidegate_autoscale::Events>,
        instances: std::path::PathBuf,
        scaling: tidegate_autoscale::StatusBoard,
        acme_wake: Arc<tokio::sync::Notify>,
        pools: Pools,
    ) -> anyhow::Result<Background> {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        {
            // Tasks spawned here wait for the thread below to run them.
            let _in = runtime.enter();
            tidegate_health::spawn(control.snapshots(), control.snapshot_changes());
            tidegate_sources::spawn(control.snapshots(), control.snapshot_changes());
            let certificate_events = events.clone();
            tidegate_autoscale::spawn(control.clone(), events, instances, scaling);
            tidegate_acme::spawn(control.clone(), acme_wake);
            // Without a resolver (no /etc/resolv.conf and no --resolver)
            // the proxy still serves; DNS pools keep the backends they had.
            match tidegate_dns::resolver(pools.resolver) {
                Ok(resolver) => drop(tidegate_dns::spawn(control.clone(), resolver, pools.board)),
                Err(e) => tracing::error!(error = %e, "no DNS resolver: services' `dns` pools are not resolved"),
            }
            tidegate_acme::events::follow(control.clone(), move |e| {
                use tidegate_acme::events::Happened;
                use tidegate_autoscale::EventKind;
                let kind = match e.what {
                    Happened::Ordering => EventKind::CertificateOrdering,
                    Happened::Issued => EventKind::CertificateIssued,
                    Happened::Failed => EventKind::CertificateFailed,
                    Happened::RenewalMoved => EventKind::CertificateRenewalMoved,
                };
                certificate_events.record_certificate(e.name.as_str(), kind, e.detail);
            });
        }
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("tidegate-background".into())
            .spawn(move || {
                runtime.block_on(async {
                    let _ = stopped.await;
                })
            })
            .context("starting the background thread")?;
        Ok(Background { stop: Some(stop), thread: Some(thread) })
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn load_initial_config(control: &Control, path: &Path) -> anyhow::Result<()> {
    let revision = control.config().revision;
    if revision > 0 {
        tracing::warn!(
            file = %path.display(),
            revision,
            "--config ignored: the store already holds a configuration; use `tidegate ctl apply -f` to change it"
        );
        return Ok(());
    }
    let file = read_config_file(path)?;
    let document = matches!(file, config_file::ConfigFile::Document(_));
    let mut change = file.into_change_set();
    // Only onto an empty store: in cluster mode, instances starting
    // together seed it once.
    change.if_revision = Some(0);
    let ops = change.ops.len();
    // A refused op of a document is named by the document's field.
    let paths = if document { tidegate_model::document_paths(&change.ops) } else { Vec::new() };
    let revision = match control.submit(change).await {
        Ok(r) => r,
        Err(tidegate_control::SubmitError::Rejected(e))
            if e.kind == tidegate_model::ChangeErrorKind::Conflict && control.config().revision > 0 =>
        {
            tracing::info!(file = %path.display(), "--config ignored: another instance seeded the store first");
            return Ok(());
        }
        Err(tidegate_control::SubmitError::Rejected(e)) if document => return Err(refused_in_file(path, &paths, e)),
        Err(e) => bail!("{}: {e}", path.display()),
    };
    tracing::info!(file = %path.display(), ops, revision, "initial configuration applied");
    Ok(())
}

/// A change set made from a declarative file that the configuration
/// refused, named by the file's field (`certificates.c.key_pem`), not the
/// op's index; `paths` are its ops' `document_paths`.
fn refused_in_file(path: &Path, paths: &[String], e: tidegate_model::ChangeError) -> anyhow::Error {
    let e = tidegate_model::in_document(paths, e);
    anyhow::anyhow!("{}: {}: {}", path.display(), e.field.as_deref().unwrap_or("."), e.message)
}

/// Reads `serve --config FILE`: checked as the admin token file is (the
/// owner, no group or world write, where links point; see
/// [`config_file::read_trusted`]), then parsed.
fn read_config_file(path: &Path) -> anyhow::Result<config_file::ConfigFile> {
    let text = config_file::read_trusted(path)?;
    Ok(config_file::parse_file(path, &text)?)
}

/// `--config-mode sync`: makes the configuration equal to the file (a
/// declarative document) in one change set, logging each change; the
/// revision the configuration is at after it.
///
/// A file that would delete everything without saying so is refused: an
/// empty or comment-only file, `{}`, or a document with no services,
/// routes or certificates, unless it says `empty: true`; so is YAML that
/// does not end in a newline (a file caught mid-write).
async fn sync_config(control: &Control, path: &Path) -> anyhow::Result<u64> {
    let text = config_file::read_trusted(path)?;
    config_file::check_complete(path, &text)?;
    let doc = match config_file::parse_file(path, &text)? {
        config_file::ConfigFile::Document(doc) => doc,
        config_file::ConfigFile::Changes(_) => {
            bail!("{}: --config-mode sync needs a declarative document (`services`, `routes`, `certificates`), not a change set", path.display())
        }
    };
    if doc.holds_nothing() && !doc.empty {
        bail!(
            "{}: holds no services, routes or certificates (an empty, comment-only or cut-off file?): applying it would delete the whole configuration; if that is what you want, say so with `empty: true`",
            path.display()
        );
    }
    let view = control.config();
    let (ops, changes) = tidegate_model::plan(&view.state, &doc);
    if ops.is_empty() {
        tracing::info!(file = %path.display(), revision = view.revision, "configuration file in sync: no changes");
        return Ok(view.revision);
    }
    let paths = tidegate_model::document_paths(&ops);
    let change = tidegate_model::ChangeSet { if_revision: Some(view.revision), ops };
    let revision = control.submit(change).await.map_err(|e| match e {
        tidegate_control::SubmitError::Rejected(e) => refused_in_file(path, &paths, e),
        other => anyhow::anyhow!("{}: {other}", path.display()),
    })?;
    for c in &changes {
        tracing::info!(file = %path.display(), revision, "{c}");
    }
    tracing::info!(file = %path.display(), revision, changes = changes.len(), "configuration file applied");
    Ok(revision)
}

/// SIGHUP (a terminal closing, or an operator used to `nginx -s reload`)
/// never stops the proxy. With `--config-mode sync` (`sync` is the file
/// and its report) it applies the configuration file again: a file that
/// is not trusted, does not parse, would delete everything without saying
/// so, or does not apply is logged, shown in `/v1/status` and `/metrics`,
/// and changes nothing; the proxy goes on serving what it has. Otherwise
/// it is logged and ignored.
async fn on_hangup(
    mut hup: tokio::signal::unix::Signal,
    control: Control,
    sync: Option<(std::path::PathBuf, Arc<tidegate_admin::ConfigFileReport>)>,
) {
    while hup.recv().await.is_some() {
        let Some((path, report)) = &sync else {
            tracing::info!("SIGHUP ignored: change the configuration with the admin API (`tidegate ctl apply -f FILE`), or run with --config FILE --config-mode sync");
            continue;
        };
        tracing::info!(file = %path.display(), "SIGHUP: applying the configuration file");
        match sync_config(&control, path).await {
            Ok(revision) => report.applied(revision),
            Err(e) => {
                tracing::error!("configuration file not applied, nothing changed: {e:#}");
                report.refused(format!("{e:#}"));
            }
        }
    }
}

/// SIGUSR1 reopens the access log's file (after logrotate moved it), as
/// nginx does; without an access log it is logged and ignored.
async fn on_usr1(mut usr1: tokio::signal::unix::Signal, log: Option<Arc<AccessLog>>) {
    while usr1.recv().await.is_some() {
        match &log {
            Some(log) => {
                tracing::info!("SIGUSR1: reopening the access log");
                log.reopen();
            }
            None => tracing::info!("SIGUSR1 ignored: no --access-log"),
        }
    }
}

/// A listening socket received from the instance this one took over from,
/// for tokio.
fn inherited(socket: std::net::TcpListener) -> std::io::Result<tokio::net::TcpListener> {
    socket.set_nonblocking(true)?;
    tokio::net::TcpListener::from_std(socket)
}

/// On each SIGUSR2: the binary upgrade, as `tidegate upgrade` does it,
/// with the executable this process was started from (a package upgrade
/// put the new binary at that path): a new process takes this one over,
/// and this one drains and exits. A failure is logged; this process
/// keeps serving.
async fn on_usr2(mut usr2: tokio::signal::unix::Signal, data_dir: std::path::PathBuf, exe: Option<std::path::PathBuf>) {
    while usr2.recv().await.is_some() {
        tracing::info!("SIGUSR2: upgrading to the binary at this process's path");
        let (data_dir, exe) = (data_dir.clone(), exe.clone());
        let outcome =
            tokio::task::spawn_blocking(move || crate::upgrade::upgrade(&data_dir, exe, Duration::from_secs(120)))
                .await;
        match outcome {
            Ok(Ok(u)) => tracing::info!(
                new_pid = u.new_pid,
                binary = %u.binary.display(),
                took_ms = u.took.as_millis() as u64,
                "SIGUSR2: the new process serves; this one drains and exits"
            ),
            Ok(Err(e)) => {
                tracing::error!(error = %format!("{e:#}"), "SIGUSR2: the upgrade failed; this process keeps serving")
            }
            Err(e) => tracing::error!(error = %e, "SIGUSR2: the upgrade did not run"),
        }
    }
}

/// Resolves on SIGTERM or SIGINT.
async fn shutdown_signal(mut term: tokio::signal::unix::Signal, mut int: tokio::signal::unix::Signal) {
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

/// The admin token: `TIDEGATE_ADMIN_TOKEN`, else `DIR/admin-token`, created
/// with 32 random bytes and mode 0600 on first start.
pub(crate) fn admin_token(dir: &Path) -> anyhow::Result<String> {
    if let Ok(t) = std::env::var("TIDEGATE_ADMIN_TOKEN") {
        let t = t.trim();
        check_token(t).map_err(|why| anyhow::anyhow!("TIDEGATE_ADMIN_TOKEN {why}"))?;
        return Ok(t.to_string());
    }
    let path = dir.join("admin-token");
    match std::fs::symlink_metadata(&path) {
        Ok(meta) => {
            use std::os::unix::fs::PermissionsExt;
            if meta.file_type().is_symlink() {
                bail!(
                    "{} is a symbolic link; refusing to follow it (replace it with the token file itself)",
                    path.display()
                );
            }
            let mode = meta.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                bail!("{} has mode {mode:04o}; it must be readable by its owner only (chmod 600 it)", path.display());
            }
            let t = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
            let t = t.trim();
            check_token(t).map_err(|why| anyhow::anyhow!("{}: the token {why}", path.display()))?;
            return Ok(t.to_string());
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    }
    let token = new_token().context("drawing the admin token from the system's random source")?;
    use std::os::unix::fs::OpenOptionsExt;
    // create_new: O_EXCL, so nothing that appeared meanwhile (a symlink
    // planted by someone else) is followed or overwritten.
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("writing {}", path.display()))?;
    writeln!(f, "{token}")?;
    f.sync_all()?;
    tracing::info!(path = %path.display(), "generated the admin token");
    Ok(token)
}

/// Shortest admin token accepted, in bytes.
const MIN_TOKEN_BYTES: usize = 32;

/// Why a token is refused, if it is.
/// Random bytes in a generated admin token (64 hex digits).
const GENERATED_TOKEN_BYTES: usize = 32;

/// A new admin token: [`GENERATED_TOKEN_BYTES`] bytes from the operating
/// system's random source (`getrandom(2)`), hex-encoded.
fn new_token() -> Result<String, getrandom::Error> {
    let mut bytes = [0u8; GENERATED_TOKEN_BYTES];
    getrandom::getrandom(&mut bytes)?;
    Ok(hex::encode(bytes))
}

/// Why an admin token is refused; shown after the token's source
/// (`TIDEGATE_ADMIN_TOKEN is set but empty`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum TokenError {
    /// Given, but empty.
    #[error("is set but empty")]
    Empty,
    /// Shorter than [`MIN_TOKEN_BYTES`].
    #[error("is {0} bytes long; it must be at least {MIN_TOKEN_BYTES} (for example `openssl rand -hex 32`)")]
    TooShort(usize),
    /// Holds a space or a control character.
    #[error("must not contain spaces or control characters")]
    BadCharacter,
}

fn check_token(t: &str) -> Result<(), TokenError> {
    if t.is_empty() {
        return Err(TokenError::Empty);
    }
    if t.len() < MIN_TOKEN_BYTES {
        return Err(TokenError::TooShort(t.len()));
    }
    if t.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(TokenError::BadCharacter);
    }
    Ok(())
}

/// The data plane's client-side limits from the command line (timeouts of
/// at least one second, connections within `fd_cap`).
fn limits(args: &ServeArgs, fd_cap: usize) -> Limits {
    let secs = |s: u64| Duration::from_secs(s.max(1));
    Limits {
        first_request_timeout: secs(args.first_request_timeout_s),
        idle_timeout: secs(args.header_timeout_s),
        body_read_timeout: secs(args.body_timeout_s),
        body_total_timeout: secs(args.body_total_timeout_s),
        write_timeout: secs(args.write_timeout_s),
        tunnel_idle_timeout: secs(args.tunnel_idle_timeout_s),
        max_connections: args.max_connections.min(fd_cap).max(1),
        max_header_bytes: args.max_header_bytes,
        max_headers: args.max_headers.max(16),
        h2_max_streams: args.h2_max_streams.max(1),
        trusted_proxies: args.trusted_proxies.clone(),
        proxy_protocol_from: args.proxy_protocol_from.clone(),
        request_buffer_bytes: args.request_buffer_bytes,
        request_buffer_total_bytes: args.request_buffer_total_bytes,
        min_upload_rate: args.min_upload_rate,
        upload_rate_window: secs(args.min_upload_rate_window_s),
        max_connections_per_client: args.max_connections_per_client,
        max_requests_per_client: args.max_requests_per_client,
        max_request_rate_per_client: args.max_request_rate_per_client,
        request_burst_per_client: args.request_burst_per_client,
        request_rate_tarpit: Duration::from_millis(args.request_rate_tarpit_ms),
    }
}

/// Tracing to the OTLP receiver at `url`: its exporter started.
fn start_tracing(url: &str, args: &ServeArgs) -> anyhow::Result<tidegate_proxy::Tracing> {
    let mut endpoint = tidegate_upstream::parse_http_url(url)?;
    if endpoint.path() == "/" {
        // A collector's base URL: its traces path.
        endpoint = format!("{}v1/traces", url.trim_end_matches('/').to_owned() + "/").parse()?;
    }
    let mut options = tidegate_trace::ExportOptions::new(endpoint);
    options.resource = vec![
        ("service.name", tidegate_trace::Value::text(&args.trace_service_name)),
        ("service.version", tidegate_trace::Value::from(env!("CARGO_PKG_VERSION"))),
    ];
    let exporter = tidegate_trace::Exporter::start(options).context("starting the span exporter")?;
    Ok(tidegate_proxy::Tracing { sampler: tidegate_trace::Sampler::ratio(args.trace_sample_ratio), exporter })
}

/// The TLS and user settings for etcd, read from their files.
fn etcd_access(args: &EtcdArgs) -> anyhow::Result<EtcdAccess> {
    let read = |p: &Path| std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()));
    let tls = match &args.etcd_ca {
        None => None,
        Some(ca) => Some(EtcdTls {
            ca_pem: read(ca)?,
            cert_pem: args.etcd_cert.as_deref().map(read).transpose()?,
            key_pem: args.etcd_key.as_deref().map(read).transpose()?,
        }),
    };
    let credentials = match &args.etcd_user {
        None => None,
        Some(user) => {
            let password = match (&args.etcd_password_file, std::env::var("TIDEGATE_ETCD_PASSWORD")) {
                (Some(file), _) => read(file)?.trim_end_matches(['\n', '\r']).to_string(),
                (None, Ok(p)) => p,
                (None, Err(_)) => {
                    bail!("--etcd-user {user}: give the password in TIDEGATE_ETCD_PASSWORD or --etcd-password-file")
                }
            };
            Some(EtcdCredentials { user: user.clone(), password })
        }
    };
    Ok(EtcdAccess { tls, credentials })
}

/// The machine's name, for the default instance name.
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "tidegate".into())
}

/// `tidegate store copy --from DIR --to etcd://...`: an embedded store's
/// configuration into an empty etcd prefix, at the same revision.
pub fn copy_store(from: &Path, to: EtcdUrl, etcd: &EtcdArgs) -> anyhow::Result<ExitCode> {
    let path = from.join("config.sqlite");
    if !path.exists() {
        bail!("{}: no embedded store there (config.sqlite is missing)", from.display());
    }
    // Opening takes the store's lock: a running Tidegate keeps it.
    let source = SqliteStore::open(&path)
        .with_context(|| format!("opening {} (stop the Tidegate using it first)", path.display()))?;
    let loaded = source.load().with_context(|| format!("reading {}", path.display()))?;
    let target = EtcdStore::open(to.clone(), etcd_access(etcd)?).context("connecting to etcd")?;
    target.import(&loaded.state, loaded.revision).context("copying into etcd")?;
    println!(
        "copied revision {} ({} services, {} routes, {} certificates) into {}",
        loaded.revision,
        loaded.state.services().len(),
        loaded.state.routes().len(),
        loaded.state.certificates().len(),
        to
    );
    Ok(ExitCode::SUCCESS)
}

/// Opens the embedded store, `DIR/config.sqlite` (created mode 0600). A
/// data directory from before SQLite, with `config.redb` and no SQLite
/// configuration yet, is taken over once: its configuration and revision
/// are imported and the old file is renamed `config.redb.imported` (kept
/// as a backup). An import that fails leaves the old file in place, and is
/// tried again at the next start.
fn open_store(dir: &Path) -> anyhow::Result<SqliteStore> {
    let path = dir.join("config.sqlite");
    // A new data directory gets a new database (mode 0600); an existing
    // file that is empty or has no tables is refused (`NoSchema`).
    let store = SqliteStore::open(&path).with_context(|| format!("opening the store {}", path.display()))?;
    let old = dir.join("config.redb");
    if old.exists() {
        let current = store.load().with_context(|| format!("reading {}", path.display()))?;
        if current.revision > 0 {
            tracing::warn!(ignored = %old.display(), "both config.sqlite and config.redb exist; config.sqlite is used");
            return Ok(store);
        }
        let loaded = RedbStore::open_existing(&old)
            .and_then(|r| r.load())
            .with_context(|| format!("reading {} to import it", old.display()))?;
        store
            .import(&loaded.state, loaded.revision)
            .with_context(|| format!("importing {} into {}", old.display(), path.display()))?;
        let backup = dir.join("config.redb.imported");
        std::fs::rename(&old, &backup).with_context(|| format!("renaming {}", old.display()))?;
        tracing::info!(revision = loaded.revision, backup = %backup.display(), "configuration imported from redb into SQLite");
    }
    Ok(store)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_tokens_are_64_hex_digits_and_differ() {
        let (a, b) = (new_token().expect("token"), new_token().expect("token"));
        assert_eq!(a.len(), 2 * GENERATED_TOKEN_BYTES);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()), "{a}");
        assert!(GENERATED_TOKEN_BYTES >= MIN_TOKEN_BYTES && check_token(&a).is_ok());
        assert_ne!(a, b);
    }

    #[test]
    fn short_or_odd_tokens_are_refused() {
        assert_eq!(check_token(""), Err(TokenError::Empty));
        assert!(check_token("x").unwrap_err().to_string().contains("1 bytes long"));
        assert_eq!(check_token(&"a".repeat(31)), Err(TokenError::TooShort(31)));
        assert!(check_token(&"a".repeat(32)).is_ok());
        assert_eq!(check_token(&format!("{} b", "a".repeat(32))), Err(TokenError::BadCharacter));
    }

    #[test]
    fn the_token_file_is_owner_only_and_never_a_link() {
        use std::os::unix::fs::PermissionsExt;
        std::env::remove_var("TIDEGATE_ADMIN_TOKEN");
        let dir = tempfile::tempdir().unwrap();
        let token = admin_token(dir.path()).unwrap();
        assert_eq!(token.len(), 64);
        let path = dir.path().join("admin-token");
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(admin_token(dir.path()).unwrap(), token, "read back, not regenerated");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(admin_token(dir.path()).unwrap_err().to_string().contains("mode 0644"));
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink(dir.path().join("elsewhere"), &path).unwrap();
        assert!(admin_token(dir.path()).unwrap_err().to_string().contains("symbolic link"));
    }

    #[test]
    fn a_filter_given_holds_rustls_at_error_unless_it_names_it() {
        assert_eq!(log_filter(None), DEFAULT_LOG_FILTER);
        assert_eq!(log_filter(Some(" ")), DEFAULT_LOG_FILTER);
        assert_eq!(log_filter(Some("warn")), "warn,rustls=error");
        assert_eq!(log_filter(Some("debug,rustls=debug")), "debug,rustls=debug");
    }

    #[test]
    fn the_default_filter_keeps_info_and_drops_what_clients_make_rustls_warn_about() {
        use std::sync::{Arc, Mutex};
        let lines = Arc::new(Mutex::new(Vec::<u8>::new()));
        let sink = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(DEFAULT_LOG_FILTER))
            .with_writer(move || Sink(sink.clone()))
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            tracing::info!(target: "tidegate::serve", "kept");
            tracing::warn!(target: "rustls::msgs::handshake", "dropped: a client's IP address as SNI");
            tracing::error!(target: "rustls::conn", "kept too");
        });
        let text = String::from_utf8(lines.lock().unwrap().clone()).unwrap();
        assert!(text.contains("kept") && text.contains("kept too"), "{text}");
        assert!(!text.contains("dropped"), "{text}");

        struct Sink(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Sink {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(buf);
                Ok(buf.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
    }
}
