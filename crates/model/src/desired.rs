//! Desired state: a declarative document (services, routes, certificates)
//! and the plan that makes the configuration equal to it.
//!
//! [`plan`] is pure: it compares the current [`ConfigState`] with a
//! [`Document`] and returns the operations of one change set (puts for what
//! is new or different, deletes for what the document leaves out) with a
//! readable list of [`Change`]s. The admin API's `PUT /v1/config`, its dry
//! run (`ctl diff`), `ctl apply --prune` and `serve --config-mode sync` all
//! use it, so they agree on what a file means.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::certificate::CertificateInput;
use crate::change::{ChangeSet, Op, ParseError};
use crate::listener::ListenerSpec;
use crate::names::{CertName, ListenerName, RouteName, RuleSetName, ServiceName};
use crate::route::RouteSpec;
use crate::rules::RuleSetSpec;
use crate::service::ServiceSpec;
use crate::state::{ChangeError, ConfigState};

/// The whole configuration, as a file or `GET /v1/config` shows it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Document {
    /// Ignored: `GET /v1/config` shows it, so its output can be applied
    /// back as it is.
    #[serde(default, skip_serializing)]
    pub revision: Option<u64>,
    /// Services by name.
    #[serde(default)]
    pub services: BTreeMap<ServiceName, ServiceSpec>,
    /// Routes by name.
    #[serde(default)]
    pub routes: BTreeMap<RouteName, RouteSpec>,
    /// TLS certificates by name. A key given as `(redacted)`, as `GET
    /// /v1/config` shows every key, keeps the key the configuration has.
    #[serde(default)]
    pub certificates: BTreeMap<CertName, CertificateInput>,
    /// Rule sets by name (`rules:`). A password hash given as
    /// `(redacted)`, as `GET /v1/config` shows every hash, keeps the hash
    /// the configuration has for that user.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub rules: BTreeMap<RuleSetName, RuleSetSpec>,
    /// Named listeners by name (`listeners:`), besides the default ones.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub listeners: BTreeMap<ListenerName, ListenerSpec>,
    /// States that the document is empty on purpose. `serve --config-mode
    /// sync` refuses a file with no services, routes or certificates (an
    /// empty, comment-only or cut-off file would otherwise delete the whole
    /// configuration) unless it says `empty: true`. A document that says so
    /// and holds anything is refused.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub empty: bool,
}

impl Document {
    /// Checks what the model's types cannot: that no certificate has
    /// expired (as every edge where changes come in does), and that the
    /// document holds together on its own (every route's service is in it,
    /// one default certificate at most), as applying it to an empty
    /// configuration does. What it keeps from the configuration it is
    /// applied to (a webhook secret or a certificate's key given as the
    /// placeholder `(redacted)`, as an export shows them) is checked when
    /// it is applied. An error names the document's field
    /// (`routes.web.service`, `certificates.c.cert_pem`).
    pub fn check(&self) -> Result<ConfigState, ParseError> {
        if self.empty && !self.holds_nothing() {
            return Err(ParseError {
                op: None,
                field: "empty".into(),
                message: format!(
                    "says the document is empty, but it holds {} service(s), {} route(s), {} certificate(s), \
                     {} rule set(s) and {} listener(s)",
                    self.services.len(),
                    self.routes.len(),
                    self.certificates.len(),
                    self.rules.len(),
                    self.listeners.len()
                ),
            });
        }
        let now = crate::certificate::unix_now();
        for (name, spec) in &self.certificates {
            spec.check_incoming(now)
                .map_err(|e| ParseError::invalid(None, &format!("certificates.{}", name.as_str()), e))?;
        }
        // What the document keeps from the configuration it is applied to
        // (a secret or a key given as the placeholder) is checked there.
        let ops = self
            .put_ops()
            .into_iter()
            .filter(|op| !matches!(op, Op::PutCertificate { spec, .. } if spec.keeps_key()))
            .map(|op| match op {
                Op::PutService { name, spec } if spec.keeps_secret() => {
                    let mut spec = *spec;
                    spec.fill_kept_secrets("a secret kept from the configuration");
                    Op::PutService { name, spec: Box::new(spec) }
                }
                Op::PutRules { name, spec } => Op::PutRules { name, spec: Box::new(spec.with_placeholders_filled()) },
                op => op,
            })
            .collect::<Vec<_>>();
        let paths = document_paths(&ops);
        let change = ChangeSet { if_revision: None, ops };
        ConfigState::default().apply(&change, 1).map(|(state, _)| state).map_err(|e| {
            let e = in_document(&paths, e);
            ParseError { op: None, field: e.field.unwrap_or_else(|| ".".to_string()), message: e.message }
        })
    }
}

impl Document {
    /// Whether it has no service, route or certificate.
    pub fn holds_nothing(&self) -> bool {
        self.services.is_empty()
            && self.routes.is_empty()
            && self.certificates.is_empty()
            && self.rules.is_empty()
            && self.listeners.is_empty()
    }

    /// The document's fields that keep a value from the configuration it
    /// is applied to (given as the placeholder `(redacted)`, as an export
    /// shows secrets and keys): applied to a configuration without them,
    /// it is refused there.
    pub fn kept_fields(&self) -> Vec<String> {
        let secrets = self.services.iter().flat_map(|(n, s)| {
            s.kept_secrets().into_iter().map(move |secret| format!("services.{}.{}", n.as_str(), secret.field()))
        });
        let keys = self
            .certificates
            .iter()
            .filter(|(_, c)| c.keeps_key())
            .map(|(n, _)| format!("certificates.{}.key_pem", n.as_str()));
        let hashes = self
            .rules
            .iter()
            .flat_map(|(n, r)| r.kept_hashes().into_iter().map(move |f| format!("rules.{}.{f}", n.as_str())));
        secrets.chain(keys).chain(hashes).collect()
    }

    /// Every object of the document as a put operation: services and
    /// certificates before the routes that name them. Nothing is deleted.
    pub fn put_ops(&self) -> Vec<Op> {
        plan(&ConfigState::default(), self).0
    }
}

/// What a plan does to one object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// It is new.
    Create,
    /// It exists and changes.
    Update,
    /// It is not in the document.
    Delete,
}

/// The kind of object a change is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// A service.
    Service,
    /// A route.
    Route,
    /// A certificate.
    Certificate,
    /// A rule set.
    Rules,
    /// A named listener.
    Listener,
}

/// One object a plan creates, updates or deletes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct Change {
    /// What happens to it.
    pub action: Action,
    /// What it is.
    pub kind: Kind,
    /// Its name.
    pub name: String,
    /// For an update, the paths of the fields that change (values are
    /// never shown: some are secrets).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fields: Vec<String>,
}

impl std::fmt::Display for Change {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sign = match self.action {
            Action::Create => '+',
            Action::Update => '~',
            Action::Delete => '-',
        };
        let kind = match self.kind {
            Kind::Service => "service",
            Kind::Route => "route",
            Kind::Certificate => "certificate",
            Kind::Rules => "rules",
            Kind::Listener => "listener",
        };
        write!(f, "{sign} {kind} {}", self.name)?;
        if !self.fields.is_empty() {
            write!(f, ": {}", self.fields.join(", "))?;
        }
        Ok(())
    }
}

/// The operations that make `current` equal to `desired`, and what they
/// change. Objects equal on both sides are left alone (no operation).
///
/// A document may carry secrets as read APIs show them (an exported
/// configuration): those keep the current secret.
///
/// Backends an autoscaler added (`autoscaled`) are not in any file: a
/// service that keeps its `autoscale` block keeps them, unless the document
/// lists a backend with the same id; so are the backends resolved for a
/// `dns` block, kept while it names the same records.
///
/// Order: services and certificates are put before the routes that may
/// name them, and routes deleted before the services they named.
pub fn plan(current: &ConfigState, desired: &Document) -> (Vec<Op>, Vec<Change>) {
    let mut ops = Vec::new();
    let mut changes = Vec::new();
    let mut put = |kind, name: String, old: Option<serde_json::Value>, new: serde_json::Value| {
        let (action, fields) = match old {
            None => (Action::Create, Vec::new()),
            Some(old) => {
                let mut fields = Vec::new();
                differences(&old, &new, "", &mut fields);
                (Action::Update, fields)
            }
        };
        changes.push(Change { action, kind, name, fields });
    };
    for (name, spec) in &desired.services {
        // A secret shown as the placeholder (an exported configuration)
        // keeps the current one, as applying it would.
        let previous = current.services().get(name).map(|o| &**o);
        let mut spec = spec.with_secrets_of(previous).map_or_else(|_| spec.clone(), std::borrow::Cow::into_owned);
        if let Some(old) = current.services().get(name) {
            if spec.settings.autoscale.is_some() {
                for (id, b) in old.backends.iter().filter(|(_, b)| b.autoscaled) {
                    if !spec.backends.contains_key(id) {
                        spec.backends.insert(id.clone(), b.clone());
                    }
                }
            }
            crate::dns::keep_resolved(old, &mut spec);
            if **old == spec {
                continue;
            }
        }
        let old = current.services().get(name).map(|o| json(&**o));
        put(Kind::Service, name.as_str().to_string(), old, json(&spec));
        ops.push(Op::PutService { name: name.clone(), spec: Box::new(spec) });
    }
    for (name, input) in &desired.certificates {
        let old = current.certificates().get(name);
        // A key given as the placeholder keeps the current one, as applying
        // it would; one that cannot (no current key, or a chain it does not
        // match) goes as given, and applying it says why.
        let resolved = input.resolve(old.map(|o| &**o)).ok();
        if let (Some(old), Some(new)) = (old, &resolved) {
            if **old == *new {
                continue;
            }
        }
        // Keys are never shown: compared, they only name the field.
        let mut shown = resolved.as_ref().map_or_else(|| json(&input.redacted()), |r| json(&r.redacted()));
        if let (Some(old), Some(new)) = (old, &resolved) {
            if !old.same_key(new) {
                shown["key_pem"] = "(redacted, another key)".into();
            }
        }
        put(Kind::Certificate, name.as_str().to_string(), old.map(|o| json(&o.redacted())), shown);
        let spec = resolved.map_or_else(|| input.clone(), CertificateInput::from);
        ops.push(Op::PutCertificate { name: name.clone(), spec: Box::new(spec) });
    }
    for (name, spec) in &desired.rules {
        let previous = current.rules().get(name).map(|o| &**o);
        let spec = spec.with_secrets_of(previous).map_or_else(|_| spec.clone(), std::borrow::Cow::into_owned);
        if previous.is_some_and(|o| *o == spec) {
            continue;
        }
        // Hashes are never shown: compared, they only name the field.
        put(Kind::Rules, name.as_str().to_string(), previous.map(|o| json(&o.redacted())), json(&spec.redacted()));
        ops.push(Op::PutRules { name: name.clone(), spec: Box::new(spec) });
    }
    for (name, spec) in &desired.listeners {
        let old = current.listeners().get(name);
        if old.is_some_and(|o| **o == *spec) {
            continue;
        }
        put(Kind::Listener, name.as_str().to_string(), old.map(|o| json(&**o)), json(spec));
        ops.push(Op::PutListener { name: name.clone(), spec: spec.clone() });
    }
    for (name, spec) in &desired.routes {
        let old = current.routes().get(name);
        if old.is_some_and(|o| **o == *spec) {
            continue;
        }
        put(Kind::Route, name.as_str().to_string(), old.map(|o| json(&**o)), json(spec));
        ops.push(Op::PutRoute { name: name.clone(), spec: Box::new(spec.clone()) });
    }
    let mut delete = |kind, name: &str| {
        changes.push(Change { action: Action::Delete, kind, name: name.to_string(), fields: Vec::new() });
    };
    for name in current.routes().keys().filter(|n| !desired.routes.contains_key(*n)) {
        delete(Kind::Route, name.as_str());
        ops.push(Op::DeleteRoute { name: name.clone() });
    }
    for name in current.listeners().keys().filter(|n| !desired.listeners.contains_key(*n)) {
        delete(Kind::Listener, name.as_str());
        ops.push(Op::DeleteListener { name: name.clone() });
    }
    for name in current.rules().keys().filter(|n| !desired.rules.contains_key(*n)) {
        delete(Kind::Rules, name.as_str());
        ops.push(Op::DeleteRules { name: name.clone() });
    }
    for name in current.services().keys().filter(|n| !desired.services.contains_key(*n)) {
        delete(Kind::Service, name.as_str());
        ops.push(Op::DeleteService { name: name.clone() });
    }
    for name in current.certificates().keys().filter(|n| !desired.certificates.contains_key(*n)) {
        delete(Kind::Certificate, name.as_str());
        ops.push(Op::DeleteCertificate { name: name.clone() });
    }
    (ops, changes)
}

/// Where each op's object sits in a document ([`in_document`]).
pub fn document_paths(ops: &[Op]) -> Vec<String> {
    ops.iter().map(document_path).collect()
}

/// An error applying a document's ops, with the document's field instead
/// of the op's (`certificates.c.key_pem` for `ops[2].spec.key_pem`) and no
/// op index; `paths` are the ops' [`document_paths`]. An error about a
/// delete, which has no place in the document, is left as it is.
pub fn in_document(paths: &[String], e: ChangeError) -> ChangeError {
    let Some((i, path)) = e.op.and_then(|i| Some((i, paths.get(i)?))).filter(|(_, p)| p.as_str() != ".") else {
        return e;
    };
    let inner = e.field.as_deref().and_then(|f| f.strip_prefix(&format!("ops[{i}]."))).unwrap_or("");
    let field = match inner.strip_prefix("spec.").unwrap_or(inner) {
        "" | "spec" | "name" => path.clone(),
        rest => format!("{path}.{rest}"),
    };
    ChangeError { op: None, field: Some(field), ..e }
}

/// Where a put operation's object sits in a document.
fn document_path(op: &Op) -> String {
    match op {
        Op::PutService { name, .. } => format!("services.{}", name.as_str()),
        Op::PutRoute { name, .. } => format!("routes.{}", name.as_str()),
        Op::PutCertificate { name, .. } => format!("certificates.{}", name.as_str()),
        Op::PutRules { name, .. } => format!("rules.{}", name.as_str()),
        Op::PutListener { name, .. } => format!("listeners.{}", name.as_str()),
        _ => ".".to_string(),
    }
}

fn json<T: Serialize>(v: &T) -> serde_json::Value {
    serde_json::to_value(v).unwrap_or(serde_json::Value::Null)
}

/// Collects the paths where `a` and `b` differ (`policy.kind`,
/// `backends[2]`, `backends` when the list's length changes).
fn differences(a: &serde_json::Value, b: &serde_json::Value, path: &str, out: &mut Vec<String>) {
    use serde_json::Value;
    let at = |key: &str| if path.is_empty() { key.to_string() } else { format!("{path}.{key}") };
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            for k in keys {
                match (x.get(k), y.get(k)) {
                    (Some(p), Some(q)) => differences(p, q, &at(k), out),
                    _ => out.push(at(k)),
                }
            }
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            for (i, (p, q)) in x.iter().zip(y).enumerate() {
                differences(p, q, &format!("{path}[{i}]"), out);
            }
        }
        _ if a != b => out.push(if path.is_empty() { ".".to_string() } else { path.to_string() }),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::change::parse_change_set;

    fn doc(json: serde_json::Value) -> Document {
        serde_json::from_value(json).expect("a document")
    }

    #[test]
    fn a_document_says_it_is_empty_only_when_it_is() {
        let empty = doc(serde_json::json!({"empty": true}));
        assert!(empty.empty && empty.holds_nothing());
        assert!(empty.check().is_ok());
        assert!(doc(serde_json::json!({})).holds_nothing());
        assert!(!doc(serde_json::json!({})).empty, "absent means not stated");
        let e = doc(serde_json::json!({"empty": true, "services": {"s": {}}})).check().unwrap_err();
        assert_eq!(e.field, "empty");
        assert!(e.message.contains("1 service(s)"), "{}", e.message);
        // Not written back unless set, so an export is unchanged.
        assert_eq!(
            serde_json::to_value(Document::default()).unwrap(),
            serde_json::json!({"services": {}, "routes": {}, "certificates": {}})
        );
    }

    fn state(json: serde_json::Value) -> ConfigState {
        let (ops, _) = plan(&ConfigState::default(), &doc(json));
        ConfigState::default().apply(&ChangeSet { if_revision: None, ops }, 1).expect("a valid state").0
    }

    fn web(addr: &str) -> serde_json::Value {
        serde_json::json!({ "backends": [{ "id": "a", "addr": addr }] })
    }

    #[test]
    fn equal_objects_need_no_operation_and_the_rest_is_created_updated_or_deleted() {
        let current = state(serde_json::json!({
            "services": { "web": web("127.0.0.1:1"), "old": web("127.0.0.1:2") },
            "routes": { "r": { "service": "web" }, "gone": { "service": "old" } },
        }));
        let desired = doc(serde_json::json!({
            "services": { "web": web("127.0.0.1:9"), "new": web("127.0.0.1:3") },
            "routes": { "r": { "service": "web" } },
        }));
        let (ops, changes) = plan(&current, &desired);
        let shown: Vec<String> = changes.iter().map(ToString::to_string).collect();
        assert_eq!(shown, ["+ service new", "~ service web: backends[0].addr", "- route gone", "- service old"]);
        // The plan applies: the route is deleted before its service.
        let (after, _) = current.apply(&ChangeSet { if_revision: None, ops }, 2).expect("the plan applies");
        let (again, changes) = plan(&after, &desired);
        assert!(again.is_empty() && changes.is_empty(), "applied, the plan is empty: {changes:?}");
    }

    #[test]
    fn autoscaled_backends_are_kept_while_the_service_autoscales() {
        let spec = serde_json::json!({
            "backends": [{ "id": "a", "addr": "127.0.0.1:1" }],
            "autoscale": { "min": 1, "max": 3, "provider": { "kind": "command", "start": ["true"], "stop": ["true"] } },
        });
        let current = state(serde_json::json!({ "services": { "web": spec } }));
        let grown = parse_change_set(
            br#"{"ops":[{"op":"put_backend","service":"web","id":"web-1","spec":{"addr":"127.0.0.1:5","autoscaled":true}}]}"#,
        )
        .expect("a change set");
        let (current, _) = current.apply(&grown, 2).expect("applies");
        let (ops, changes) = plan(&current, &doc(serde_json::json!({ "services": { "web": spec } })));
        assert!(ops.is_empty(), "the autoscaled backend stays: {changes:?}");
    }

    #[test]
    fn a_document_with_an_expired_certificate_is_refused() {
        let mut params = rcgen::CertificateParams::new(vec!["old.example".to_string()]).unwrap();
        params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        let spec = serde_json::json!({ "cert_pem": cert.pem(), "key_pem": key.serialize_pem() });
        let e = doc(serde_json::json!({ "certificates": { "old": spec } })).check().unwrap_err();
        assert_eq!(e.field, "certificates.old.cert_pem", "{e}");
    }

    /// A self-signed certificate for `names` with the key `key`: chain, key.
    fn signed(names: &[&str], key: &rcgen::KeyPair) -> serde_json::Value {
        let params = rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap();
        let cert = params.self_signed(key).unwrap();
        serde_json::json!({ "cert_pem": cert.pem(), "key_pem": key.serialize_pem() })
    }

    #[test]
    fn an_export_applies_back_as_it_is_keeping_secrets_and_keys() {
        let key = rcgen::KeyPair::generate().unwrap();
        let client = signed(&["client.example"], &rcgen::KeyPair::generate().unwrap());
        let hook = serde_json::json!({
            "autoscale": { "provider": { "kind": "webhook", "url": "http://127.0.0.1:9/hook", "secret": "s3cret" } },
            "upstream": { "tls": { "client_cert_pem": client["cert_pem"], "client_key_pem": client["key_pem"] } },
        });
        let current = state(serde_json::json!({
            "services": { "w": hook },
            "certificates": { "c": signed(&["a.example"], &key) },
        }));
        // What GET /v1/config shows: secrets and keys as the placeholder.
        let exported = serde_json::json!({
            "revision": 7,
            "services": { "w": &*current.service("w").unwrap().redacted() },
            "certificates": { "c": current.certificates().values().next().unwrap().redacted() },
        });
        assert!(!exported.to_string().contains("PRIVATE KEY") && !exported.to_string().contains("s3cret"));
        let desired = doc(exported.clone());
        desired.check().expect("an export checks on its own");
        assert_eq!(
            desired.kept_fields(),
            [
                "services.w.autoscale.provider.secret",
                "services.w.upstream.tls.client_key_pem",
                "certificates.c.key_pem"
            ]
        );
        let (ops, changes) = plan(&current, &desired);
        assert!(ops.is_empty(), "nothing to do: {changes:?}");

        // A renewed chain for the same key, with the key as the placeholder.
        let mut renewed = exported;
        let chain = signed(&["a.example", "b.example"], &key)["cert_pem"].clone();
        renewed["certificates"]["c"]["cert_pem"] = chain;
        let (ops, changes) = plan(&current, &doc(renewed));
        let shown: Vec<String> = changes.iter().map(ToString::to_string).collect();
        assert_eq!(shown, ["~ certificate c: cert_pem"]);
        // A new key is named, never shown.
        let fresh = signed(&["a.example"], &rcgen::KeyPair::generate().unwrap());
        let (_, changes) =
            plan(&current, &doc(serde_json::json!({ "services": { "w": hook }, "certificates": { "c": fresh } })));
        let shown: Vec<String> = changes.iter().map(ToString::to_string).collect();
        assert_eq!(shown, ["~ certificate c: cert_pem, key_pem"]);
        let (after, _) = current.apply(&ChangeSet { if_revision: None, ops }, 2).expect("the plan applies");
        let cert = after.certificates().values().next().unwrap();
        assert_eq!(cert.info().unwrap().names, ["a.example", "b.example"]);
        assert_eq!(after.service("w").unwrap().webhook_secret(), Some("s3cret"));
    }

    #[test]
    fn a_placeholder_with_nothing_to_keep_is_refused_where_it_is_applied() {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut cert = signed(&["a.example"], &key);
        cert["key_pem"] = crate::REDACTED.into();
        let desired = doc(serde_json::json!({ "certificates": { "c": cert.clone() } }));
        assert!(desired.check().is_ok(), "the document alone cannot know");
        let (ops, _) = plan(&ConfigState::default(), &desired);
        let e = ConfigState::default().apply(&ChangeSet { if_revision: None, ops }, 1).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("ops[0].spec.key_pem"), "{e:?}");
        // A key kept must match the new chain.
        let current = state(serde_json::json!({ "certificates": { "c": signed(&["a.example"], &key) } }));
        let other = rcgen::KeyPair::generate().unwrap();
        let mut foreign = signed(&["a.example"], &other);
        foreign["key_pem"] = crate::REDACTED.into();
        let (ops, _) = plan(&current, &doc(serde_json::json!({ "certificates": { "c": foreign } })));
        let e = current.apply(&ChangeSet { if_revision: None, ops }, 2).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("ops[0].spec.key_pem"), "{e:?}");
        assert!(e.message.contains("the key kept") && e.message.contains("does not match"), "{}", e.message);
    }

    #[test]
    fn a_document_must_hold_together() {
        let broken = doc(serde_json::json!({ "routes": { "r": { "service": "missing" } } }));
        let e = broken.check().unwrap_err();
        assert_eq!(e.field, "routes.r.service", "{e}");
        assert!(doc(serde_json::json!({ "services": { "web": web("127.0.0.1:1") } })).check().is_ok());
    }
}
