//! The whole configuration as persistent maps, and how change sets apply to it.

use std::sync::Arc;

use imbl::{OrdMap, OrdSet};

use crate::certificate::CertificateSpec;
use crate::change::{ChangeSet, Op};
use crate::listener::{ListenerSpec, DEFAULT_LISTENERS};
use crate::names::{BackendId, CertName, ListenerName, RouteName, RuleSetName, ServiceName};
use crate::route::RouteSpec;
use crate::rules::RuleSetSpec;
use crate::service::ServiceSpec;

/// What kind of failure a change set met.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChangeErrorKind {
    /// The op refers to something that does not exist (404).
    NotFound,
    /// The op contradicts the current configuration (409), such as deleting a
    /// service that routes still use, or a stale `if_revision`.
    Conflict,
}

/// Why a change set was refused. Nothing of it was applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ChangeError {
    /// The kind of failure.
    pub kind: ChangeErrorKind,
    /// Index of the op at fault (none for a revision mismatch).
    pub op: Option<usize>,
    /// The field at fault, such as `ops[2].service`.
    pub field: Option<String>,
    /// What is wrong.
    pub message: String,
}

impl ChangeError {
    fn at(kind: ChangeErrorKind, op: usize, field: &str, message: String) -> Self {
        ChangeError { kind, op: Some(op), field: Some(format!("ops[{op}].{field}")), message }
    }
}

/// What a change set touched, for incremental rebuilds and persistence.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Delta {
    /// Services whose spec or backends changed (or that were deleted).
    pub services: OrdSet<ServiceName>,
    /// Routes that were put or deleted.
    pub routes: OrdSet<RouteName>,
    /// Certificates that were put or deleted.
    pub certificates: OrdSet<CertName>,
    /// Rule sets that were put or deleted.
    pub rules: OrdSet<RuleSetName>,
    /// Listeners that were put or deleted.
    pub listeners: OrdSet<ListenerName>,
}

impl Delta {
    /// Adds everything `other` touched.
    pub fn merge(&mut self, other: Delta) {
        self.services.extend(other.services);
        self.routes.extend(other.routes);
        self.certificates.extend(other.certificates);
        self.rules.extend(other.rules);
        self.listeners.extend(other.listeners);
    }

    /// True when nothing was touched.
    pub fn is_empty(&self) -> bool {
        self.services.is_empty()
            && self.routes.is_empty()
            && self.certificates.is_empty()
            && self.rules.is_empty()
            && self.listeners.is_empty()
    }
}

/// The configuration: services, routes, certificates and rule sets.
/// Cloning is O(1).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConfigState {
    services: OrdMap<ServiceName, Arc<ServiceSpec>>,
    routes: OrdMap<RouteName, Arc<RouteSpec>>,
    certificates: OrdMap<CertName, Arc<CertificateSpec>>,
    rules: OrdMap<RuleSetName, Arc<RuleSetSpec>>,
    listeners: OrdMap<ListenerName, Arc<ListenerSpec>>,
    /// Reverse index: which routes point at each service.
    users: OrdMap<ServiceName, OrdSet<RouteName>>,
    /// Reverse index: which routes run each rule set.
    rule_users: OrdMap<RuleSetName, OrdSet<RouteName>>,
    /// Reverse index: which routes are bound to each listener.
    listener_users: OrdMap<ListenerName, OrdSet<RouteName>>,
}

impl ConfigState {
    /// All services, by name.
    pub fn services(&self) -> &OrdMap<ServiceName, Arc<ServiceSpec>> {
        &self.services
    }

    /// All routes, by name.
    pub fn routes(&self) -> &OrdMap<RouteName, Arc<RouteSpec>> {
        &self.routes
    }

    /// All TLS certificates, by name.
    pub fn certificates(&self) -> &OrdMap<CertName, Arc<CertificateSpec>> {
        &self.certificates
    }

    /// The managed certificate `name`, for op `i` (NotFound, or Conflict
    /// when it is an uploaded one).
    fn managed_certificate(&self, i: usize, name: &CertName) -> Result<Arc<CertificateSpec>, ChangeError> {
        let Some(current) = self.certificates.get(name) else {
            return Err(ChangeError::at(ChangeErrorKind::NotFound, i, "name", format!("no certificate {name:?}")));
        };
        if current.managed().is_none() {
            return Err(ChangeError::at(
                ChangeErrorKind::Conflict,
                i,
                "name",
                format!("certificate {name:?} is uploaded, not managed by ACME: put a new chain to renew it"),
            ));
        }
        Ok(current.clone())
    }

    /// All rule sets, by name.
    pub fn rules(&self) -> &OrdMap<RuleSetName, Arc<RuleSetSpec>> {
        &self.rules
    }

    /// One rule set.
    pub fn rule_set(&self, name: &str) -> Option<&Arc<RuleSetSpec>> {
        self.rules.get(name)
    }

    /// The routes that run the rule set `name`.
    pub fn rule_set_users(&self, name: &str) -> Option<&OrdSet<RouteName>> {
        self.rule_users.get(name)
    }

    /// All named listeners, by name.
    pub fn listeners(&self) -> &OrdMap<ListenerName, Arc<ListenerSpec>> {
        &self.listeners
    }

    /// One named listener.
    pub fn listener(&self, name: &str) -> Option<&Arc<ListenerSpec>> {
        self.listeners.get(name)
    }

    /// One service.
    pub fn service(&self, name: &str) -> Option<&Arc<ServiceSpec>> {
        self.services.get(name)
    }

    /// One route.
    pub fn route(&self, name: &str) -> Option<&Arc<RouteSpec>> {
        self.routes.get(name)
    }

    /// Applies a change set, returning the new state and what it touched.
    /// On error `self` is unchanged and nothing of the change set applies.
    /// `revision` is the current revision, checked against `if_revision`.
    pub fn apply(&self, cs: &ChangeSet, revision: u64) -> Result<(ConfigState, Delta), ChangeError> {
        if let Some(expected) = cs.if_revision {
            if expected != revision {
                return Err(ChangeError {
                    kind: ChangeErrorKind::Conflict,
                    op: None,
                    field: Some("if_revision".to_string()),
                    message: format!("if_revision is {expected} but the configuration is at revision {revision}"),
                });
            }
        }
        let mut next = self.clone();
        let mut delta = Delta::default();
        for (i, op) in cs.ops.iter().enumerate() {
            next.apply_op(i, op, &mut delta)?;
        }
        Ok((next, delta))
    }

    fn apply_op(&mut self, i: usize, op: &Op, delta: &mut Delta) -> Result<(), ChangeError> {
        use ChangeErrorKind::{Conflict, NotFound};
        match op {
            Op::PutService { name, spec } => {
                let previous = self.services.get(name).map(|p| &**p);
                let mut spec = spec
                    .with_secrets_of(previous)
                    .map_err(|e| ChangeError::at(Conflict, i, &format!("spec.{}", e.field), e.reason.to_string()))?
                    .into_owned();
                if let Some(previous) = previous {
                    crate::dns::keep_resolved(previous, &mut spec);
                }
                self.services.insert(name.clone(), Arc::new(spec));
                delta.services.insert(name.clone());
            }
            Op::DeleteService { name } => {
                still_used(i, self.users.get(name), |n, list| {
                    format!("service {name:?} is still used by {n} route(s) ({list}); delete or move them first")
                })?;
                if self.services.remove(name).is_none() {
                    return Err(ChangeError::at(NotFound, i, "name", format!("no service {name:?}")));
                }
                delta.services.insert(name.clone());
            }
            Op::PutBackend { service, id, spec } => {
                let svc = self.service_mut(i, service)?;
                svc.backends.insert(id.clone(), spec.clone());
                delta.services.insert(service.clone());
            }
            Op::DeleteBackend { service, id } => {
                let svc = self.service_mut(i, service)?;
                if svc.backends.remove(id).is_none() {
                    return Err(no_backend(i, service, id));
                }
                delta.services.insert(service.clone());
            }
            Op::PutRoute { name, spec } => {
                if let Some(target) = spec.service() {
                    if !self.services.contains_key(target) {
                        return Err(ChangeError::at(
                            NotFound,
                            i,
                            "spec.service",
                            format!("route {name:?} points at service {target:?}, which does not exist"),
                        ));
                    }
                }
                if let Some((k, set)) = spec.rules.iter().enumerate().find(|(_, set)| !self.rules.contains_key(*set)) {
                    return Err(ChangeError::at(
                        NotFound,
                        i,
                        &format!("spec.rules[{k}]"),
                        format!("route {name:?} runs rule set {set:?}, which does not exist"),
                    ));
                }
                let unknown = spec
                    .listeners
                    .iter()
                    .enumerate()
                    .find(|(_, l)| l.as_str() != DEFAULT_LISTENERS && !self.listeners.contains_key(*l));
                if let Some((k, l)) = unknown {
                    return Err(ChangeError::at(
                        NotFound,
                        i,
                        &format!("spec.listeners[{k}]"),
                        format!("route {name:?} is bound to listener {l:?}, which does not exist"),
                    ));
                }
                let old = self.routes.insert(name.clone(), Arc::new(RouteSpec::clone(spec)));
                self.unlink(name, old.as_deref());
                for l in spec.listeners.iter().filter(|l| l.as_str() != DEFAULT_LISTENERS) {
                    self.listener_users.entry(l.clone()).or_default().insert(name.clone());
                }
                if let Some(target) = spec.service() {
                    self.users.entry(target.clone()).or_default().insert(name.clone());
                }
                for set in &spec.rules {
                    self.rule_users.entry(set.clone()).or_default().insert(name.clone());
                }
                delta.routes.insert(name.clone());
            }
            Op::DeleteRoute { name } => {
                let Some(old) = self.routes.remove(name) else {
                    return Err(ChangeError::at(NotFound, i, "name", format!("no route {name:?}")));
                };
                self.unlink(name, Some(&old));
                delta.routes.insert(name.clone());
            }
            Op::PutCertificate { name, spec } => {
                let previous = self.certificates.get(name).map(|c| &**c);
                let spec = spec
                    .resolve(previous)
                    .map_err(|e| ChangeError::at(Conflict, i, &format!("spec.{}", e.field), e.reason.to_string()))?;
                if spec.is_default() {
                    if let Some((other, _)) = self.certificates.iter().find(|(n, c)| *n != name && c.is_default()) {
                        return Err(ChangeError::at(
                            Conflict,
                            i,
                            "spec.default",
                            format!("certificate {other:?} is already the default; unmark or delete it first"),
                        ));
                    }
                }
                self.certificates.insert(name.clone(), Arc::new(spec));
                delta.certificates.insert(name.clone());
            }
            Op::DeleteCertificate { name } => {
                if self.certificates.remove(name).is_none() {
                    return Err(ChangeError::at(NotFound, i, "name", format!("no certificate {name:?}")));
                }
                delta.certificates.insert(name.clone());
            }
            Op::RenewCertificate { name } => {
                let current = self.managed_certificate(i, name)?;
                let mut state = current.managed().map(|m| m.state.clone()).unwrap_or_default();
                state.renew_requested += 1;
                let next = current.with_state(state).unwrap_or_else(|| (*current).clone());
                self.certificates.insert(name.clone(), Arc::new(next));
                delta.certificates.insert(name.clone());
            }
            Op::AcmeState { name, state } => {
                let current = self.managed_certificate(i, name)?;
                let mut state = (**state).clone();
                // Only users raise it (renew_certificate): a manager's
                // write made before a request does not undo it.
                state.renew_requested = current.managed().map_or(0, |m| m.state.renew_requested);
                let next = current.with_state(state).unwrap_or_else(|| (*current).clone());
                self.certificates.insert(name.clone(), Arc::new(next));
                delta.certificates.insert(name.clone());
            }
            Op::PutRules { name, spec } => {
                let previous = self.rules.get(name).map(|r| &**r);
                let spec = spec
                    .with_secrets_of(previous)
                    .map_err(|e| ChangeError::at(Conflict, i, &format!("spec.{}", e.field), e.reason.to_string()))?
                    .into_owned();
                self.rules.insert(name.clone(), Arc::new(spec));
                delta.rules.insert(name.clone());
            }
            Op::DeleteRules { name } => {
                still_used(i, self.rule_users.get(name), |n, list| {
                    format!("rule set {name:?} is still run by {n} route(s) ({list}); remove it from them first")
                })?;
                if self.rules.remove(name).is_none() {
                    return Err(ChangeError::at(NotFound, i, "name", format!("no rule set {name:?}")));
                }
                delta.rules.insert(name.clone());
            }
            Op::PutListener { name, spec } => {
                if name.as_str() == DEFAULT_LISTENERS {
                    return Err(ChangeError::at(
                        Conflict,
                        i,
                        "name",
                        format!("{DEFAULT_LISTENERS:?} names the default listeners (--listen, --listen-tls)"),
                    ));
                }
                if let Some((other, _)) = self.listeners.iter().find(|(n, l)| *n != name && l.addr == spec.addr) {
                    return Err(ChangeError::at(
                        Conflict,
                        i,
                        "spec.addr",
                        format!("listener {other:?} already listens on {}", spec.addr),
                    ));
                }
                self.listeners.insert(name.clone(), Arc::new(spec.clone()));
                delta.listeners.insert(name.clone());
            }
            Op::DeleteListener { name } => {
                still_used(i, self.listener_users.get(name), |n, list| {
                    format!(
                        "listener {name:?} still has {n} route(s) bound to it ({list}); unbind or delete them first"
                    )
                })?;
                if self.listeners.remove(name).is_none() {
                    return Err(ChangeError::at(NotFound, i, "name", format!("no listener {name:?}")));
                }
                delta.listeners.insert(name.clone());
            }
        }
        Ok(())
    }
}

/// Refuses op `i` (a delete) while `users` holds routes: `message` says so
/// from their number and the first five, comma-separated.
fn still_used(
    i: usize,
    users: Option<&OrdSet<RouteName>>,
    message: impl FnOnce(usize, String) -> String,
) -> Result<(), ChangeError> {
    match users.filter(|u| !u.is_empty()) {
        None => Ok(()),
        Some(users) => {
            let list: Vec<&str> = users.iter().take(5).map(|r| r.as_str()).collect();
            Err(ChangeError::at(ChangeErrorKind::Conflict, i, "name", message(users.len(), list.join(", "))))
        }
    }
}

impl ConfigState {
    fn service_mut(&mut self, i: usize, name: &ServiceName) -> Result<&mut ServiceSpec, ChangeError> {
        match self.services.get_mut(name) {
            Some(arc) => Ok(Arc::make_mut(arc)),
            None => Err(ChangeError::at(ChangeErrorKind::NotFound, i, "service", format!("no service {name:?}"))),
        }
    }

    fn unlink(&mut self, route: &RouteName, old: Option<&RouteSpec>) {
        for l in old.map_or(&[][..], |o| &o.listeners[..]) {
            if let Some(users) = self.listener_users.get_mut(l) {
                users.remove(route);
                if users.is_empty() {
                    self.listener_users.remove(l);
                }
            }
        }
        for set in old.map_or(&[][..], |o| &o.rules[..]) {
            if let Some(users) = self.rule_users.get_mut(set) {
                users.remove(route);
                if users.is_empty() {
                    self.rule_users.remove(set);
                }
            }
        }
        if let Some(target) = old.and_then(RouteSpec::service) {
            if let Some(set) = self.users.get_mut(target) {
                set.remove(route);
                if set.is_empty() {
                    self.users.remove(target);
                }
            }
        }
    }
}

fn no_backend(i: usize, service: &ServiceName, id: &BackendId) -> ChangeError {
    ChangeError::at(ChangeErrorKind::NotFound, i, "id", format!("service {service:?} has no backend {id:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::change::parse_change_set;

    fn cs(text: &str) -> ChangeSet {
        parse_change_set(text.as_bytes()).unwrap()
    }

    fn web() -> ChangeSet {
        cs(r#"{"ops":[
            {"op":"put_service","name":"web","spec":{"backends":[{"id":"a","addr":"127.0.0.1:1"}]}},
            {"op":"put_route","name":"r","spec":{"service":"web"}}]}"#)
    }

    #[test]
    fn applies_in_order_and_reports_the_delta() {
        let (s, delta) = ConfigState::default().apply(&web(), 0).unwrap();
        assert_eq!(s.services().len(), 1);
        assert_eq!(s.routes().len(), 1);
        assert!(delta.services.contains("web") && delta.routes.contains("r"));
    }

    #[test]
    fn a_failing_op_applies_nothing() {
        let base = ConfigState::default();
        let bad = cs(r#"{"ops":[
            {"op":"put_service","name":"web","spec":{}},
            {"op":"put_route","name":"r","spec":{"service":"missing"}}]}"#);
        let err = base.apply(&bad, 0).unwrap_err();
        assert_eq!(err.op, Some(1));
        assert_eq!(err.field.as_deref(), Some("ops[1].spec.service"));
        assert_eq!(err.kind, ChangeErrorKind::NotFound);
        assert!(base.services().is_empty());
    }

    #[test]
    fn services_in_use_cannot_be_deleted() {
        let (s, _) = ConfigState::default().apply(&web(), 0).unwrap();
        let err = s.apply(&cs(r#"{"ops":[{"op":"delete_service","name":"web"}]}"#), 1).unwrap_err();
        assert_eq!(err.kind, ChangeErrorKind::Conflict);
        let ok = cs(r#"{"ops":[{"op":"delete_route","name":"r"},{"op":"delete_service","name":"web"}]}"#);
        let (s, _) = s.apply(&ok, 1).unwrap();
        assert!(s.services().is_empty() && s.routes().is_empty());
    }

    #[test]
    fn moving_a_route_updates_the_reverse_index() {
        let (s, _) = ConfigState::default().apply(&web(), 0).unwrap();
        let mv = cs(r#"{"ops":[{"op":"put_service","name":"api","spec":{}},
            {"op":"put_route","name":"r","spec":{"service":"api"}},
            {"op":"delete_service","name":"web"}]}"#);
        let (s, _) = s.apply(&mv, 1).unwrap();
        assert!(s.service("web").is_none());
    }

    #[test]
    fn rule_sets_are_checked_like_services() {
        let (s, _) = ConfigState::default().apply(&web(), 0).unwrap();
        let missing = cs(r#"{"ops":[{"op":"put_route","name":"r","spec":{"service":"web","rules":["hsts"]}}]}"#);
        let e = s.apply(&missing, 1).unwrap_err();
        assert_eq!((e.kind, e.field.as_deref()), (ChangeErrorKind::NotFound, Some("ops[0].spec.rules[0]")));
        let put = cs(r#"{"ops":[{"op":"put_rules","name":"hsts","spec":{"steps":[{"kind":"set_response_header",
                "name":"strict-transport-security","value":"max-age=600"}]}},
            {"op":"put_route","name":"r","spec":{"service":"web","rules":["hsts"]}}]}"#);
        let (s, delta) = s.apply(&put, 1).unwrap();
        assert!(delta.rules.contains("hsts") && s.rule_set("hsts").is_some());
        let e = s.apply(&cs(r#"{"ops":[{"op":"delete_rules","name":"hsts"}]}"#), 2).unwrap_err();
        assert_eq!(e.kind, ChangeErrorKind::Conflict);
        assert!(e.message.contains("(r)"), "names the route: {}", e.message);
        let unuse = cs(r#"{"ops":[{"op":"put_route","name":"r","spec":{"service":"web"}},
            {"op":"delete_rules","name":"hsts"}]}"#);
        let (s, _) = s.apply(&unuse, 2).unwrap();
        assert!(s.rules().is_empty());
        let e = s.apply(&cs(r#"{"ops":[{"op":"delete_rules","name":"hsts"}]}"#), 3).unwrap_err();
        assert_eq!(e.kind, ChangeErrorKind::NotFound);
    }

    #[test]
    fn stale_revisions_conflict() {
        let mut c = web();
        c.if_revision = Some(7);
        let err = ConfigState::default().apply(&c, 6).unwrap_err();
        assert_eq!(err.kind, ChangeErrorKind::Conflict);
        assert!(ConfigState::default().apply(&c, 7).is_ok());
    }

    #[test]
    fn backend_ops_need_their_service_and_backend() {
        let (s, _) = ConfigState::default().apply(&web(), 0).unwrap();
        let put = cs(r#"{"ops":[{"op":"put_backend","service":"web","id":"b","spec":{"addr":"h:2"}}]}"#);
        let (s2, _) = s.apply(&put, 1).unwrap();
        assert_eq!(s2.service("web").unwrap().backends.len(), 2);
        assert_eq!(s.service("web").unwrap().backends.len(), 1, "old state untouched");
        let del = cs(r#"{"ops":[{"op":"delete_backend","service":"web","id":"zz"}]}"#);
        assert_eq!(s2.apply(&del, 2).unwrap_err().kind, ChangeErrorKind::NotFound);
        let nosvc = cs(r#"{"ops":[{"op":"put_backend","service":"x","id":"b","spec":{"addr":"h:2"}}]}"#);
        assert_eq!(s2.apply(&nosvc, 2).unwrap_err().field.as_deref(), Some("ops[0].service"));
    }

    fn webhook_service(secret: &str) -> ChangeSet {
        cs(&format!(
            r#"{{"ops":[{{"op":"put_service","name":"w","spec":{{"autoscale":{{"provider":{{"kind":"webhook","url":"http://127.0.0.1:9/hook","secret":"{secret}"}}}}}}}}]}}"#
        ))
    }

    #[test]
    fn secrets_are_redacted_for_reading_and_kept_when_the_placeholder_comes_back() {
        let (state, _) = ConfigState::default().apply(&webhook_service("s3cret-value"), 0).unwrap();
        let spec = state.service("w").unwrap();
        assert_eq!(spec.webhook_secret(), Some("s3cret-value"));
        let shown = serde_json::to_string(&spec.redacted()).unwrap();
        assert!(!shown.contains("s3cret-value") && shown.contains(crate::REDACTED), "{shown}");
        let watched = serde_json::to_string(&webhook_service("s3cret-value").redacted()).unwrap();
        assert!(!watched.contains("s3cret-value"), "{watched}");
        // An export applied back keeps the real secret.
        let (state, _) = state.apply(&webhook_service(crate::REDACTED), 1).unwrap();
        assert_eq!(state.service("w").unwrap().webhook_secret(), Some("s3cret-value"));
        // A new secret replaces it.
        let (state, _) = state.apply(&webhook_service("rotated"), 2).unwrap();
        assert_eq!(state.service("w").unwrap().webhook_secret(), Some("rotated"));
        // The placeholder with nothing to keep is refused, naming the field.
        let e = ConfigState::default().apply(&webhook_service(crate::REDACTED), 0).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("ops[0].spec.autoscale.provider.secret"), "{e:?}");
    }

    /// A service whose backends get `cert` and `key` (PEM) as its client
    /// certificate, and a webhook secret.
    fn mutual_service(cert: &str, key: &str) -> ChangeSet {
        let spec = serde_json::json!({
            "upstream": {"tls": {"client_cert_pem": cert, "client_key_pem": key}},
            "autoscale": {"provider": {"kind": "webhook", "url": "http://127.0.0.1:9/hook", "secret": "s3cret-value"}},
        });
        cs(&serde_json::json!({"ops": [{"op": "put_service", "name": "m", "spec": spec}]}).to_string())
    }

    #[test]
    fn a_client_key_is_redacted_kept_and_checked_against_a_new_certificate() {
        let pair = |name: &str| {
            let key = rcgen::KeyPair::generate().unwrap();
            let cert = rcgen::CertificateParams::new(vec![name.to_string()]).unwrap().self_signed(&key).unwrap();
            (cert.pem(), key.serialize_pem())
        };
        let ((cert, key), (other_cert, _)) = (pair("a.test"), pair("b.test"));
        let (state, _) = ConfigState::default().apply(&mutual_service(&cert, &key), 0).unwrap();
        let spec = state.service("m").unwrap();
        assert_eq!(spec.secret(crate::Secret::ClientKey), Some(key.as_str()));
        let shown = serde_json::to_string(&spec.redacted()).unwrap();
        assert!(!shown.contains("PRIVATE KEY") && !shown.contains("s3cret-value"), "{shown}");
        let logged = format!("{spec:?} {:?}", mutual_service(&cert, &key));
        assert!(!logged.contains("PRIVATE KEY") && !logged.contains("s3cret-value"), "Debug shows a secret: {logged}");
        assert!(shown.contains("CERTIFICATE"), "the certificate is shown: {shown}");
        // Applied back as read: both secrets kept.
        let (state, _) = state.apply(&mutual_service(&cert, crate::REDACTED), 1).unwrap();
        let spec = state.service("m").unwrap();
        assert_eq!(spec.secret(crate::Secret::ClientKey), Some(key.as_str()));
        assert_eq!(spec.webhook_secret(), Some("s3cret-value"));
        // The kept key with another certificate: refused, naming the key.
        let e = state.apply(&mutual_service(&other_cert, crate::REDACTED), 2).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("ops[0].spec.upstream.tls.client_key_pem"), "{e:?}");
        assert!(e.message.contains("does not match"), "{e:?}");
        // Nothing to keep: refused, naming the key.
        let e = ConfigState::default().apply(&mutual_service(&cert, crate::REDACTED), 0).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("ops[0].spec.upstream.tls.client_key_pem"), "{e:?}");
    }

    #[test]
    fn routes_bind_to_listeners_that_exist_and_a_bound_listener_stays() {
        let s = ConfigState::default();
        let missing = cs(r#"{"ops":[{"op":"put_service","name":"web","spec":{}},
            {"op":"put_route","name":"r","spec":{"service":"web","listeners":["internal"]}}]}"#);
        let e = s.apply(&missing, 0).unwrap_err();
        assert_eq!((e.kind, e.field.as_deref()), (ChangeErrorKind::NotFound, Some("ops[1].spec.listeners[0]")));
        let put = cs(r#"{"ops":[{"op":"put_service","name":"web","spec":{}},
            {"op":"put_listener","name":"internal","spec":{"addr":"127.0.0.1:8081"}},
            {"op":"put_route","name":"r","spec":{"service":"web","listeners":["internal","default"]}}]}"#);
        let (s, delta) = s.apply(&put, 0).unwrap();
        assert!(delta.listeners.contains("internal") && s.listener("internal").is_some());
        let route = s.route("r").unwrap();
        assert!(route.serves(Some("internal")) && route.serves(None) && !route.serves(Some("other")));
        // Deleting a listener a route is bound to is refused, naming it.
        let e = s.apply(&cs(r#"{"ops":[{"op":"delete_listener","name":"internal"}]}"#), 1).unwrap_err();
        assert_eq!(e.kind, ChangeErrorKind::Conflict);
        assert!(e.message.contains("(r)"), "{e:?}");
        // Another listener on the same address, and `default` as a name.
        let twice = cs(r#"{"ops":[{"op":"put_listener","name":"copy","spec":{"addr":"127.0.0.1:8081"}}]}"#);
        assert_eq!(s.apply(&twice, 1).unwrap_err().field.as_deref(), Some("ops[0].spec.addr"));
        let default = cs(r#"{"ops":[{"op":"put_listener","name":"default","spec":{"addr":"127.0.0.1:9"}}]}"#);
        assert_eq!(s.apply(&default, 1).unwrap_err().field.as_deref(), Some("ops[0].name"));
        // Rebound to the default listeners only, the route lets it go.
        let unbind = cs(r#"{"ops":[{"op":"put_route","name":"r","spec":{"service":"web"}},
            {"op":"delete_listener","name":"internal"}]}"#);
        let (s, _) = s.apply(&unbind, 1).unwrap();
        assert!(s.listeners().is_empty());
        assert!(s.route("r").unwrap().serves(None) && !s.route("r").unwrap().serves(Some("internal")));
    }
}
