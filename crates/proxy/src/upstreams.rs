//! A worker's way to its backends: its connection pools (hyper's HTTP/1.1
//! for upgrades, the native HTTP/1.1 connections, shared HTTP/2) and its
//! external-distributor client.

use std::sync::Arc;
use std::time::Duration;

use tidegate_balance::{clock, Backend, Headers};
use tidegate_distributor_protocol::{DistributorClient, Query};
use tidegate_model::{ExternalSpec, PolicySpec};
use tidegate_snapshot::ServiceRuntime;

use crate::conn::Peer;
use crate::error::ErrorKind;
use crate::host_addrs::HostAddrs;
use crate::hyper_conn::HyperConn;
use crate::limits::Limits;
use crate::metrics::Counters;
use crate::upstream_error::{connect_kind, read_kind};
use crate::upstream_h2::H2Pool;
use tidegate_h1::HeadLimits;
use tidegate_model::BackendAddr;
use tidegate_upstream::h1;
use tidegate_upstream::pool::{Conn, ConnSettings, UpstreamPool};
use tidegate_upstream::Profile;

/// A worker's way to its backends: its connection pool and its
/// external-distributor client.
pub(crate) struct Upstreams {
    pub(crate) pool: UpstreamPool<HyperConn>,
    /// The native HTTP/1 path's connections.
    pub(crate) native: UpstreamPool<tidegate_upstream::h1::Upstream>,
    /// Shared connections to HTTP/2 backends.
    pub(crate) h2: H2Pool,
    /// Asks external distributors (paper S4); one per worker.
    pub(crate) distributor: DistributorClient,
    /// What host-named backends resolve to, to match distributors'
    /// `IP:PORT` answers.
    pub(crate) host_addrs: HostAddrs,
    /// Client-side limits (body timeouts).
    pub(crate) limits: Arc<Limits>,
}

impl Upstreams {
    /// The client-side limits.
    pub(crate) fn limits(&self) -> &Limits {
        &self.limits
    }

    /// `counters`: the worker's, where its pools count the connections
    /// they open.
    pub(crate) fn new(limits: Arc<Limits>, counters: &Arc<Counters>) -> Upstreams {
        Upstreams {
            pool: UpstreamPool::new(counters.clone()),
            native: UpstreamPool::new(counters.clone()),
            h2: H2Pool::default(),
            distributor: DistributorClient::default(),
            host_addrs: HostAddrs::default(),
            limits,
        }
    }

    /// The native HTTP/1 path's upstream connections.
    pub(crate) fn native_pool(&self) -> &UpstreamPool<tidegate_upstream::h1::Upstream> {
        &self.native
    }
}

/// What `service` asks of its connections.
pub(crate) fn conn_settings(service: &ServiceRuntime) -> ConnSettings {
    let settings = &service.settings;
    ConnSettings {
        connect: Duration::from_millis(settings.timeouts.connect_ms),
        idle: Duration::from_millis(settings.timeouts.idle_ms),
        max_idle: settings.upstream.max_idle as usize,
        profile: service.upstream.key(),
    }
}

/// What an external distributor is told of a request, apart from its
/// headers.
pub(crate) struct Asked<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub host: Option<&'a str>,
}

impl Upstreams {
    /// The first pick of backend selection, before the service's local
    /// policy: a service whose policy is an external distributor asks it
    /// ([`Upstreams::ask_distributor`]); for every other policy, `None`
    /// (the attempt loop's pick decides). Both engines call it the same
    /// way, so the distributor is a hook of selection, not a special case
    /// of either engine.
    pub(crate) async fn first_pick(
        &self,
        service: &ServiceRuntime,
        asked: Asked<'_>,
        headers: &dyn Headers,
        peer: &Peer,
    ) -> Option<Arc<Backend>> {
        match &service.settings.policy {
            PolicySpec::External(spec) => self.ask_distributor(spec, service, asked, headers, peer).await,
            _ => None,
        }
    }

    /// The backend an external distributor names for this request, if it
    /// answers with one of the service's available backends with room; on no
    /// answer, a backup backend (the paper's fallback), else `None` (the
    /// local policy decides).
    async fn ask_distributor(
        &self,
        spec: &ExternalSpec,
        service: &ServiceRuntime,
        asked: Asked<'_>,
        headers: &dyn Headers,
        peer: &Peer,
    ) -> Option<Arc<Backend>> {
        let query = Query {
            policy: &spec.policy,
            client: peer.addr,
            method: asked.method,
            path: asked.path,
            host: asked.host,
            headers,
        };
        let timeout = Duration::from_millis(spec.timeout_ms);
        let answer = self.distributor.query(spec.addr, &query, timeout, spec.tries).await;
        let now = clock::now_ms();
        let usable = |b: &Backend| b.stats.is_available(now) && b.has_room();
        let backends = service.selector.backends();
        match answer {
            Some(addr) => {
                let found = backends
                    .iter()
                    .find(|b| b.socket_addr == Some(addr))
                    .or_else(|| self.host_addrs.backend_at(backends, addr));
                if found.is_none() {
                    tracing::debug!(service = %service.name, %addr, "distributor named a backend outside the pool");
                }
                found.filter(|b| usable(b)).cloned()
            }
            None => backends.iter().filter(|b| b.backup && usable(b)).min_by_key(|b| b.stats.in_flight()).cloned(),
        }
    }
}

/// A native connection to `addr` ([`h1::open`]), failures as kinds.
pub(crate) async fn open_native(
    pool: &UpstreamPool<h1::Upstream>,
    addr: &BackendAddr,
    profile: &Profile,
    cs: ConnSettings,
    fresh: bool,
) -> Result<Conn<h1::Upstream>, ErrorKind> {
    h1::open(pool, addr, profile, cs, fresh).await.map_err(|e| connect_kind(&e))
}

/// Reads a response head from a native connection ([`h1::read_response`]),
/// failures as kinds.
pub(crate) async fn read_native(
    conn: &mut Conn<h1::Upstream>,
    to_head: bool,
    limits: HeadLimits,
) -> Result<(), ErrorKind> {
    h1::read_response(conn, to_head, limits).await.map_err(read_kind)
}
