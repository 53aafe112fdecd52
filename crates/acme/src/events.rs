//! What happened to the managed certificates, for the event log and the
//! dashboard: read from the configuration's changes (the `acme_state` ops
//! the ordering instance writes), so that every instance of a cluster
//! reports the same events, not only the one that orders.

use std::sync::Arc;

use tidegate_control::Control;
use tidegate_model::{AcmeState, CertName, CertificateSpec, ConfigState};
use tokio::task::JoinHandle;

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Happened {
    /// An order was placed with the CA.
    Ordering,
    /// A certificate was issued, and is served from the next handshake.
    Issued,
    /// An order failed; the certificate served before, if any, still is.
    Failed,
    /// The CA's renewal information brought the renewal forward.
    RenewalMoved,
}

/// One event of one managed certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertificateEvent {
    /// The certificate.
    pub name: CertName,
    /// What happened.
    pub what: Happened,
    /// For people: the order's number, the new certificate's expiry and
    /// renewal, or the error and the next try.
    pub detail: String,
}

/// The events between two configurations: for each managed certificate
/// whose state changed, what the change says happened.
pub fn between(before: &ConfigState, after: &ConfigState) -> Vec<CertificateEvent> {
    let mut out = Vec::new();
    for (name, spec) in after.certificates() {
        let old = before.certificates().get(name);
        if old.is_some_and(|o| Arc::ptr_eq(o, spec)) {
            continue;
        }
        let Some(new) = spec.managed() else { continue };
        let old = old.and_then(|o| o.managed()).map(|m| &m.state);
        for (what, detail) in changes(old, &new.state, spec) {
            out.push(CertificateEvent { name: name.clone(), what, detail });
        }
    }
    out
}

/// What one certificate's state change says happened.
fn changes(old: Option<&AcmeState>, new: &AcmeState, spec: &CertificateSpec) -> Vec<(Happened, String)> {
    let default = AcmeState::default();
    let old = old.unwrap_or(&default);
    let mut out = Vec::new();
    // Counted, not read from `ordering_since`: a follower woken once for
    // several changes still tells every order.
    for n in old.orders.saturating_add(1)..=new.orders {
        out.push((Happened::Ordering, format!("order {n} placed")));
    }
    if new.issued != old.issued {
        if let Some(info) = spec.info() {
            out.push((
                Happened::Issued,
                format!(
                    "issued by {} for {}: valid until {}, renewal at {}",
                    info.issuer,
                    info.names.join(", "),
                    info.not_after,
                    new.renewal_due_at()
                ),
            ));
        }
    }
    if new.failures > old.failures {
        let error = new.last_error.as_deref().unwrap_or("unknown error");
        out.push((Happened::Failed, format!("failure {}: {error}; next try at {}", new.failures, new.retry_at)));
    }
    if new.issued == old.issued && new.renewal_due_at() < old.renewal_due_at() && new.renewal_due_at() < new.renew_at {
        out.push((
            Happened::RenewalMoved,
            format!("the CA's renewal information moved it to {}", new.renewal_due_at()),
        ));
    }
    out
}

/// Follows the configuration and gives each certificate event to `sink`,
/// until aborted.
pub fn follow(control: Control, sink: impl Fn(CertificateEvent) + Send + 'static) -> JoinHandle<()> {
    let mut changes = control.snapshot_changes();
    tokio::spawn(async move {
        let mut last = control.config();
        loop {
            changes.next().await;
            let now = control.config();
            for event in between(&last.state, &now.state) {
                sink(event);
            }
            last = now;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidegate_model::{CertificateInput, ChangeSet, KeyedChain, Op};

    fn apply(cs: ConfigState, ops: Vec<Op>) -> ConfigState {
        cs.apply(&ChangeSet { if_revision: None, ops }, 1).unwrap().0
    }

    fn set(name: &CertName, state: AcmeState) -> Op {
        Op::AcmeState { name: name.clone(), state: Box::new(state) }
    }

    #[test]
    fn an_order_its_certificate_and_a_failure_are_told_once_each() {
        let name = CertName::new("shop").unwrap();
        let acme = serde_json::json!({"hosts": ["shop.example"], "directory": "https://ca.example/dir",
            "challenge": "http-01"});
        let input: CertificateInput = serde_json::from_value(serde_json::json!({ "acme": acme })).unwrap();
        let empty = ConfigState::default();
        let put = apply(empty.clone(), vec![Op::PutCertificate { name: name.clone(), spec: Box::new(input) }]);
        assert_eq!(between(&empty, &put), vec![], "a new certificate has done nothing yet");
        assert_eq!(between(&put, &put), vec![]);

        let mut state = put.certificates().get(&name).unwrap().managed().unwrap().state.clone();
        state.ordering_since = 100;
        state.orders = 1;
        let ordering = apply(put.clone(), vec![set(&name, state.clone())]);
        let events = between(&put, &ordering);
        assert_eq!(events.iter().map(|e| e.what).collect::<Vec<_>>(), vec![Happened::Ordering]);
        assert_eq!(events[0].detail, "order 1 placed");

        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["shop.example".to_string()]).unwrap().self_signed(&key).unwrap();
        state.issued = Some(KeyedChain::new(cert.pem(), key.serialize_pem()).unwrap());
        state.ordering_since = 0;
        state.renew_at = 5_000;
        let issued = apply(ordering.clone(), vec![set(&name, state.clone())]);
        let events = between(&ordering, &issued);
        assert_eq!(events.iter().map(|e| e.what).collect::<Vec<_>>(), vec![Happened::Issued]);
        assert!(
            events[0].detail.contains("shop.example") && events[0].detail.ends_with("renewal at 5000"),
            "{events:?}"
        );

        state.renewal_info =
            Some(tidegate_model::RenewalInfo::Window { start: 10, end: 20, renew_at: 15, next_check: 50 });
        let moved = apply(issued.clone(), vec![set(&name, state.clone())]);
        assert_eq!(between(&issued, &moved).iter().map(|e| e.what).collect::<Vec<_>>(), vec![Happened::RenewalMoved]);

        state.failures = 1;
        state.last_error = Some("the CA refused the order: shop.example: connection refused".into());
        state.retry_at = 160;
        let failed = apply(moved.clone(), vec![set(&name, state)]);
        let events = between(&moved, &failed);
        assert_eq!(events.iter().map(|e| e.what).collect::<Vec<_>>(), vec![Happened::Failed]);
        assert!(events[0].detail.starts_with("failure 1: the CA refused") && events[0].detail.ends_with("at 160"));
    }
}
