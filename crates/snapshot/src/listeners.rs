//! What the data plane made of the named listeners: for each, whether its
//! socket is open or why it could not be, shared between the data plane
//! (which writes it) and the admin API (`/v1/status`, `GET
//! /v1/listeners`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

/// One named listener as this instance serves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerState {
    /// The address it listens on.
    pub addr: SocketAddr,
    /// It terminates TLS.
    pub tls: bool,
    /// It reads the PROXY protocol from some peers.
    pub proxy_protocol: bool,
    /// `None`: listening; else why its socket could not be opened (the
    /// address in use, no permission): tried again every few seconds.
    pub error: Option<String>,
    /// When it started listening or last failed, in milliseconds since the
    /// Unix epoch.
    pub since_ms: u64,
}

/// The named listeners' states, by name.
#[derive(Debug, Clone, Default)]
pub struct ListenerBoard(Arc<Mutex<BTreeMap<String, ListenerState>>>);

impl ListenerBoard {
    /// Records `name`'s state.
    pub fn set(&self, name: &str, state: ListenerState) {
        if let Ok(mut b) = self.0.lock() {
            b.insert(name.to_string(), state);
        }
    }

    /// Forgets `name` (it was removed).
    pub fn remove(&self, name: &str) {
        if let Ok(mut b) = self.0.lock() {
            b.remove(name);
        }
    }

    /// Every listener's state.
    pub fn read(&self) -> BTreeMap<String, ListenerState> {
        self.0.lock().map(|b| b.clone()).unwrap_or_default()
    }
}
