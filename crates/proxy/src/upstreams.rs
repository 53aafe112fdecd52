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
use tidegate_upstream::{Origin, Profile};

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

/// What `service` asks of its connections, shared by every client
/// (HTTP/2 backends: a service that sends the PROXY protocol does not
/// speak it).
pub(crate) fn conn_settings(service: &ServiceRuntime) -> ConnSettings {
    let settings = &service.settings;
    ConnSettings {
        connect: Duration::from_millis(settings.timeouts.connect_ms),
        idle: Duration::from_millis(settings.timeouts.idle_ms),
        max_idle: settings.upstream.max_idle as usize,
        profile: service.upstream.key(),
        origin: None,
    }
}

/// What `service` asks of the connections that carry `peer`'s requests:
/// for a service that sends the PROXY protocol, its header names `peer`.
pub(crate) fn client_settings(service: &ServiceRuntime, peer: &Peer) -> ConnSettings {
    let origin = service.upstream.sends_proxy_protocol().then_some(Origin { client: peer.addr, local: peer.local() });
    ConnSettings { origin, ..conn_settings(service) }
}

/// Where `peer`'s request to `service` finds a native connection, and on
/// what terms: the worker's pool, or, for a service that sends the PROXY
/// protocol (each connection names one client), the client connection's
/// own pool, which no other client's request sees.
pub(crate) fn native_pool<'a>(
    worker: &'a UpstreamPool<h1::Upstream>,
    service: &ServiceRuntime,
    peer: &'a Peer,
) -> (&'a UpstreamPool<h1::Upstream>, ConnSettings) {
    let settings = client_settings(service, peer);
    match settings.origin {
        None => (worker, settings),
        Some(_) => (peer.own.upstream.get_or_init(|| worker.private()), settings),
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

#[cfg(test)]
mod tests {
    use super::*;
    use tidegate_model::{ServiceName, ServiceSpec};
    use tidegate_upstream::h1::NativeConn;
    use tidegate_upstream::Stream;
    use tokio::io::AsyncReadExt;

    fn service(upstream: &str) -> ServiceRuntime {
        let text = format!(r#"{{"backends":[{{"id":"a","addr":"127.0.0.1:1"}}],"upstream":{upstream}}}"#);
        let spec = tidegate_model::parse_json::<ServiceSpec>(text.as_bytes()).unwrap();
        ServiceRuntime::build(ServiceName::new("web").unwrap(), &spec, None)
    }

    /// A connection whose PROXY protocol header names one client stays
    /// with that client's connection, out of the worker's pool, and closes
    /// when the client connection ends; other services share the worker's.
    #[tokio::test]
    async fn connections_that_name_a_client_stay_with_it_and_close_with_it() {
        let worker = UpstreamPool::<h1::Upstream>::new(Arc::<Counters>::default());
        let peer = Peer::with_local("192.0.2.9:5000".parse().unwrap(), "198.51.100.1:80".parse().unwrap());
        let (shared, sends) = (service("{}"), service(r#"{"proxy_protocol":"v2"}"#));

        let (pool, cs) = native_pool(&worker, &shared, &peer);
        assert!(std::ptr::eq(pool, &worker) && cs.origin.is_none());
        let (pool, cs) = native_pool(&worker, &sends, &peer);
        assert!(!std::ptr::eq(pool, &worker), "the client connection's own pool");
        let origin = Origin { client: peer.addr, local: peer.local() };
        assert_eq!(cs.origin, Some(origin));
        let other = Peer::new("192.0.2.10:5000".parse().unwrap());
        assert!(!std::ptr::eq(native_pool(&worker, &sends, &other).0, pool), "another client's is another");

        // An idle connection given back waits in the client's pool only.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = BackendAddr::new(&listener.local_addr().unwrap().to_string()).unwrap();
        let (tcp, accepted) =
            tokio::join!(tokio::net::TcpStream::connect(listener.local_addr().unwrap()), listener.accept());
        let (mut backend, _) = accepted.unwrap();
        pool.fresh(NativeConn::new(Stream::Plain(tcp.unwrap())), &addr, cs).release();
        assert_eq!(pool.idle(cs.profile, &addr), 1);
        assert_eq!(worker.idle(cs.profile, &addr), 0, "never in the worker's pool");
        // The client connection ends: its backend connection closes.
        drop(peer);
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(10), backend.read(&mut byte)).await;
        assert_eq!(read.expect("closed in time").expect("a clean close"), 0);
    }
}
