//! What backends configured by host name resolve to, for matching an
//! external distributor's answers, which name a backend by `IP:PORT`.
//!
//! Names are looked up off the request path: a request whose answer names
//! an address no name is known to resolve to yet goes to the local policy,
//! as any unmatched answer does, and starts the lookups that let the next
//! requests match. A result is used for [`FRESH_FOR`], then looked up again
//! in the background while the old one still serves.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tidegate_balance::Backend;
use tidegate_model::BackendAddr;

/// How long a lookup's addresses are used before the name is looked up
/// again.
const FRESH_FOR: Duration = Duration::from_secs(30);

/// A lookup that takes longer is given up; the name is tried again after
/// [`FRESH_FOR`].
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);

/// A name not looked up for this long (no longer configured, or its
/// service no longer asks a distributor) is forgotten.
const FORGET_AFTER: Duration = Duration::from_secs(300);

/// The addresses of host-named backends, as last looked up (one per
/// worker, like its other upstream state).
#[derive(Debug, Default)]
pub(crate) struct HostAddrs {
    entries: Arc<Mutex<HashMap<BackendAddr, Entry>>>,
}

#[derive(Debug, Default)]
struct Entry {
    addrs: Vec<SocketAddr>,
    /// When the last lookup ended; `None` before the first.
    looked_up: Option<Instant>,
    /// A lookup is under way.
    pending: bool,
}

impl HostAddrs {
    /// The backend among `backends` configured by a host name that
    /// resolves to `addr`, if one is known to; starts a lookup for each
    /// host name not resolved yet, or resolved too long ago.
    pub(crate) fn backend_at<'a>(&self, backends: &'a [Arc<Backend>], addr: SocketAddr) -> Option<&'a Arc<Backend>> {
        let now = Instant::now();
        let mut entries = self.entries.lock().ok()?;
        let mut found = None;
        for b in backends.iter().filter(|b| b.socket_addr.is_none()) {
            let entry = entries.entry(b.addr.clone()).or_default();
            if found.is_none() && entry.addrs.contains(&addr) {
                found = Some(b);
            }
            let stale = entry.looked_up.is_none_or(|t| now.duration_since(t) >= FRESH_FOR);
            if stale && !entry.pending {
                entry.pending = true;
                self.look_up(b.addr.clone());
            }
        }
        found
    }

    /// Looks `name` up in the background and records what it resolves to
    /// (nothing, when the lookup fails or times out).
    fn look_up(&self, name: BackendAddr) {
        let entries = Arc::downgrade(&self.entries);
        tokio::spawn(async move {
            let addrs = match tokio::time::timeout(LOOKUP_TIMEOUT, tokio::net::lookup_host(name.as_str())).await {
                Ok(Ok(found)) => found.collect(),
                _ => Vec::new(),
            };
            let Some(entries) = entries.upgrade() else { return };
            let Ok(mut entries) = entries.lock() else { return };
            let now = Instant::now();
            entries.retain(|_, e| e.pending || e.looked_up.is_some_and(|t| now.duration_since(t) < FORGET_AFTER));
            entries.insert(name, Entry { addrs, looked_up: Some(now), pending: false });
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidegate_model::{BackendId, BackendSpec};

    fn backend(id: &str, addr: &str) -> Arc<Backend> {
        let spec: BackendSpec = serde_json::from_value(serde_json::json!({ "addr": addr })).unwrap();
        Arc::new(Backend::new(BackendId::new(id).unwrap(), &spec, None))
    }

    #[tokio::test]
    async fn a_name_matches_once_looked_up_and_addresses_are_never_looked_up() {
        let backends = [backend("ip", "127.0.0.9:80"), backend("named", "localhost:8080")];
        let addrs = HostAddrs::default();
        let answer: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        assert!(addrs.backend_at(&backends, answer).is_none(), "not looked up yet: the local policy decides");
        let deadline = Instant::now() + Duration::from_secs(5);
        let found = loop {
            if let Some(b) = addrs.backend_at(&backends, answer) {
                break b.clone();
            }
            assert!(Instant::now() < deadline, "localhost was never resolved");
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        assert_eq!(found.id.as_str(), "named");
        assert!(addrs.backend_at(&backends, "127.0.0.1:9999".parse().unwrap()).is_none(), "the port counts");
        let entries = addrs.entries.lock().unwrap();
        assert_eq!(entries.len(), 1, "only the host name is looked up: {entries:?}");
    }
}
