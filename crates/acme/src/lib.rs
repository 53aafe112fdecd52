//! Tidegate's ACME manager: obtains and renews the managed certificates of
//! the configuration (RFC 8555) with instant-acme, a well-kept client that
//! tests itself against Pebble.
//!
//! A managed certificate is configuration (`PUT /v1/certificates/{name}`
//! with an `acme` block); what the manager learns is written back through
//! the change log as `acme_state` ops ([`tidegate_model::AcmeState`]):
//! the account, the answers every instance gives to the CA's challenges
//! (HTTP-01 by the plain listener, TLS-ALPN-01 by the TLS listener), and
//! the issued chain and key, served by SNI from the next handshake on
//! every instance. Nothing is reloaded.
//!
//! - [`plan`]: when an order is due (none yet, hosts changed, renewal
//!   time, a user's request) and the back-off after a failure; pure.
//! - [`order`]: one order, from the account to the chain.
//! - [`on_demand`]: certificates for server names nobody configured,
//!   issued during their first handshake when a template allows them.
//! - [`events`]: what happened to each certificate (ordered, issued,
//!   failed), read from the configuration's changes on every instance.
//! - [`spawn`]: the loop that runs them. In cluster mode each managed
//!   certificate is a role (`acme/NAME`, an etcd lease): one instance
//!   orders it, and another takes over when that one dies.

mod client;
pub mod events;
mod hook;
pub mod on_demand;
pub mod order;
pub mod plan;

pub use on_demand::OnDemandIssuer;

use std::collections::BTreeMap;
use std::time::Duration;

use tidegate_control::{Campaigns, Control};
use tidegate_model::{unix_now, CertName};
use tokio::task::JoinHandle;

/// Orders under way at once, at most (a CA limits new orders per account).
pub const MAX_ORDERS: usize = 4;

/// Time between looks at the managed certificates.
const TICK: Duration = Duration::from_secs(1);

/// The cluster-wide role of ordering one managed certificate.
fn role(name: &CertName) -> String {
    format!("acme/{name}")
}

/// Runs the ACME manager until aborted; `wake` makes it look at once
/// (an on-demand certificate was just asked for).
pub fn spawn(control: Control, wake: std::sync::Arc<tokio::sync::Notify>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut orders: BTreeMap<CertName, JoinHandle<()>> = BTreeMap::new();
        let mut campaigns = Campaigns::new(role);
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = wake.notified() => {}
            }
            let config = control.config();
            let managed = config.state.certificates().iter().filter(|(_, c)| c.managed().is_some()).map(|(n, _)| n);
            campaigns.follow(&control, managed);
            // An order whose instance no longer leads its certificate is
            // stopped; the new leader orders again.
            orders.retain(|name, task| {
                if !control.leads(&role(name)) {
                    task.abort();
                    return false;
                }
                !task.is_finished()
            });
            let now = unix_now();
            for (name, spec) in config.state.certificates() {
                let Some(m) = spec.managed() else { continue };
                if orders.len() >= MAX_ORDERS || orders.contains_key(name) || !control.leads(&role(name)) {
                    continue;
                }
                let (control, name2) = (control.clone(), name.clone());
                let task = match plan::due(m, now) {
                    plan::Due::Now(why) => tokio::spawn(async move {
                        let _ = order::run(&control, &name2, why).await;
                    }),
                    plan::Due::AskRenewalInfo => tokio::spawn(async move {
                        let _ = order::ask_renewal_info(&control, &name2).await;
                    }),
                    plan::Due::At(_) => continue,
                };
                orders.insert(name.clone(), task);
            }
        }
    })
}
