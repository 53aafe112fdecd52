//! Change sets: atomic batches of operations.

use serde::{Deserialize, Serialize};

use crate::acme::AcmeState;
use crate::certificate::CertificateInput;
use crate::listener::ListenerSpec;
use crate::names::{BackendId, CertName, ListenerName, RouteName, RuleSetName, ServiceName};
use crate::route::RouteSpec;
use crate::rules::RuleSetSpec;
use crate::service::{BackendSpec, ServiceSpec};

/// One operation on the configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// Create or replace a service with all its backends.
    PutService {
        /// The service.
        name: ServiceName,
        /// Its settings and backends.
        spec: Box<ServiceSpec>,
    },
    /// Remove a service; fails while routes still point at it.
    DeleteService {
        /// The service.
        name: ServiceName,
    },
    /// Create or replace one backend of an existing service.
    PutBackend {
        /// The service.
        service: ServiceName,
        /// The backend's id within the service.
        id: BackendId,
        /// Address, weight, backup flag.
        spec: BackendSpec,
    },
    /// Remove one backend of a service.
    DeleteBackend {
        /// The service.
        service: ServiceName,
        /// The backend's id.
        id: BackendId,
    },
    /// Create or replace a route; its service must exist.
    PutRoute {
        /// The route.
        name: RouteName,
        /// Its conditions and target.
        spec: Box<RouteSpec>,
    },
    /// Remove a route.
    DeleteRoute {
        /// The route.
        name: RouteName,
    },
    /// Create or replace a TLS certificate (chain and key, or a chain
    /// that keeps the key the certificate has).
    PutCertificate {
        /// The certificate.
        name: CertName,
        /// Its chain, key and default flag.
        spec: Box<CertificateInput>,
    },
    /// Remove a TLS certificate.
    DeleteCertificate {
        /// The certificate.
        name: CertName,
    },
    /// Ask for a managed certificate to be renewed now (`ctl cert renew`).
    RenewCertificate {
        /// The managed certificate.
        name: CertName,
    },
    /// What the ACME manager learned of a managed certificate (its
    /// account, the certificate issued, challenge answers). Written by
    /// Tidegate only: the admin API refuses it.
    AcmeState {
        /// The managed certificate.
        name: CertName,
        /// Its new state (`renew_requested` is kept from the current one).
        state: Box<AcmeState>,
    },
    /// Create or replace a rule set.
    PutRules {
        /// The rule set.
        name: RuleSetName,
        /// Its steps.
        spec: Box<RuleSetSpec>,
    },
    /// Remove a rule set; fails while routes still run it.
    DeleteRules {
        /// The rule set.
        name: RuleSetName,
    },
    /// Create or replace a named listener.
    PutListener {
        /// The listener (not `default`).
        name: ListenerName,
        /// Its address, TLS and PROXY protocol.
        spec: ListenerSpec,
    },
    /// Remove a named listener; fails while routes are bound to it.
    DeleteListener {
        /// The listener.
        name: ListenerName,
    },
}

// serde's internally tagged enums buffer their content and so lose the path
// of a nested error; this hand-written form keeps it ("spec.backends[0].addr").
impl ChangeSet {
    /// The change set as read APIs (the watch stream) show it: secrets
    /// replaced by [`crate::REDACTED`].
    pub fn redacted(&self) -> std::borrow::Cow<'_, ChangeSet> {
        let hides = |op: &Op| match op {
            Op::PutService { spec, .. } => spec.has_secrets(),
            Op::PutCertificate { .. } | Op::AcmeState { .. } => true,
            Op::PutRules { spec, .. } => spec.has_secrets(),
            _ => false,
        };
        if !self.ops.iter().any(hides) {
            return std::borrow::Cow::Borrowed(self);
        }
        let ops = self
            .ops
            .iter()
            .map(|op| match op {
                Op::PutService { name, spec } => {
                    Op::PutService { name: name.clone(), spec: Box::new(spec.redacted().into_owned()) }
                }
                Op::PutCertificate { name, spec } => {
                    Op::PutCertificate { name: name.clone(), spec: Box::new(spec.redacted()) }
                }
                Op::PutRules { name, spec } => {
                    Op::PutRules { name: name.clone(), spec: Box::new(spec.redacted().into_owned()) }
                }
                Op::AcmeState { name, state } => {
                    Op::AcmeState { name: name.clone(), state: Box::new(state.redacted()) }
                }
                other => other.clone(),
            })
            .collect();
        std::borrow::Cow::Owned(ChangeSet { if_revision: self.if_revision, ops })
    }
}

impl<'de> Deserialize<'de> for Op {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let mut map = serde_json::Map::deserialize(d)?;
        let tag = match map.remove("op") {
            Some(serde_json::Value::String(tag)) => tag,
            Some(_) => return Err(D::Error::custom("op: must be a string")),
            None => return Err(D::Error::custom("missing field `op`")),
        };
        let body = serde_json::Value::Object(map);
        let op = match tag.as_str() {
            "put_service" => sub::<NameSpec<ServiceName, ServiceSpec>>(body)
                .map(|w| Op::PutService { name: w.name, spec: Box::new(w.spec) }),
            "delete_service" => sub::<Named<ServiceName>>(body).map(|w| Op::DeleteService { name: w.name }),
            "put_backend" => {
                sub::<BackendOp>(body).map(|w| Op::PutBackend { service: w.service, id: w.id, spec: w.spec })
            }
            "delete_backend" => sub::<BackendRef>(body).map(|w| Op::DeleteBackend { service: w.service, id: w.id }),
            "put_route" => sub::<NameSpec<RouteName, RouteSpec>>(body)
                .map(|w| Op::PutRoute { name: w.name, spec: Box::new(w.spec) }),
            "delete_route" => sub::<Named<RouteName>>(body).map(|w| Op::DeleteRoute { name: w.name }),
            "put_certificate" => sub::<NameSpec<CertName, CertificateInput>>(body)
                .map(|w| Op::PutCertificate { name: w.name, spec: Box::new(w.spec) }),
            "delete_certificate" => sub::<Named<CertName>>(body).map(|w| Op::DeleteCertificate { name: w.name }),
            "renew_certificate" => sub::<Named<CertName>>(body).map(|w| Op::RenewCertificate { name: w.name }),
            "acme_state" => sub::<NameState>(body).map(|w| Op::AcmeState { name: w.name, state: Box::new(w.state) }),
            "put_rules" => sub::<NameSpec<RuleSetName, RuleSetSpec>>(body)
                .map(|w| Op::PutRules { name: w.name, spec: Box::new(w.spec) }),
            "delete_rules" => sub::<Named<RuleSetName>>(body).map(|w| Op::DeleteRules { name: w.name }),
            "put_listener" => sub::<NameSpec<ListenerName, ListenerSpec>>(body)
                .map(|w| Op::PutListener { name: w.name, spec: w.spec }),
            "delete_listener" => sub::<Named<ListenerName>>(body).map(|w| Op::DeleteListener { name: w.name }),
            other => {
                return Err(D::Error::custom(format!(
                    "op: unknown op {other:?}; expected one of put_service, delete_service, \
                     put_backend, delete_backend, put_route, delete_route, put_certificate, delete_certificate, \
                     renew_certificate, put_rules, delete_rules, put_listener, delete_listener"
                )))
            }
        };
        op.map_err(|e| D::Error::custom(path_message(e)))
    }
}

/// Decodes an op's body, keeping the path of an error (the caller turns
/// it into serde's text, prefixed by the path, with [`path_message`]).
fn sub<T: serde::de::DeserializeOwned>(
    v: serde_json::Value,
) -> Result<T, serde_path_to_error::Error<serde_json::Error>> {
    serde_path_to_error::deserialize(v)
}

/// An op body's decode error as text: `path: message`.
fn path_message(e: serde_path_to_error::Error<serde_json::Error>) -> String {
    let path = e.path().to_string();
    if path == "." {
        e.inner().to_string()
    } else {
        format!("{path}: {}", e.inner())
    }
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct NameSpec<N, S> {
    name: N,
    spec: S,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct NameState {
    name: CertName,
    state: AcmeState,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct Named<N> {
    name: N,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct BackendOp {
    service: ServiceName,
    id: BackendId,
    spec: BackendSpec,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct BackendRef {
    service: ServiceName,
    id: BackendId,
}

/// An atomic batch of operations (`POST /v1/changes`): all apply or none.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ChangeSet {
    /// Apply only if the configuration is at exactly this revision (409 otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub if_revision: Option<u64>,
    /// The operations, applied in order.
    pub ops: Vec<Op>,
}

/// A change set that could not be parsed: the message and the field at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ParseError {
    /// Index of the operation at fault, when the fault is inside `ops`.
    pub op: Option<usize>,
    /// Path of the field at fault, such as `ops[3].spec.backends[1].addr`
    /// (`.` for the document itself).
    pub field: String,
    /// What is wrong.
    pub message: String,
}

impl ParseError {
    /// A refusal of the model's checks (`e.field` below `prefix`), as a
    /// parse error of the document it is in.
    pub fn invalid(op: Option<usize>, prefix: &str, e: crate::Invalid) -> Self {
        let field = e.under(prefix);
        ParseError { op, field: field.field, message: field.reason.to_string() }
    }

    /// Builds an error from a JSON parse failure, keeping the path serde saw.
    pub fn from_path(err: serde_path_to_error::Error<serde_json::Error>) -> Self {
        let field = match err.path().to_string() {
            p if p == "?" => ".".to_string(),
            p => p,
        };
        let (field, message) = fold_field(field, err.inner().to_string());
        // serde_json appends " at line L column C": useful to people, keep it.
        ParseError { op: op_index(&field), field, message }
    }
}

/// Folds the sub-field a validation message starts with
/// (`"backends[1].id: ..."`) into `field` (the path where the value was
/// read; `.` for the whole document), and returns the completed field and
/// the rest of the message.
pub fn fold_field(mut field: String, mut message: String) -> (String, String) {
    while let Some((sub, rest)) = message.split_once(": ") {
        if sub.is_empty() || !sub.chars().all(|c| c.is_ascii_alphanumeric() || "_.[]".contains(c)) {
            break;
        }
        field = match (field.as_str(), sub.starts_with('[')) {
            (".", _) => sub.to_string(),
            (_, true) => format!("{field}{sub}"),
            (_, false) => format!("{field}.{sub}"),
        };
        message = rest.to_string();
    }
    (field, message)
}

fn op_index(field: &str) -> Option<usize> {
    let rest = field.strip_prefix("ops[")?;
    rest.split(']').next()?.parse().ok()
}

/// Parses a JSON object into a `T`, naming the field at fault on error.
pub fn parse_json<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ParseError> {
    // Every document here is an object. serde would also take a struct in
    // its positional form (`[]` as a configuration with nothing in it).
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(ParseError { op: None, field: ".".into(), message: "expected a JSON object".into() });
    }
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(de).map_err(ParseError::from_path)?;
    Ok(value)
}

/// Parses a change set from JSON, naming the op and field at fault on
/// error. This is where changes come in, so a certificate that has already
/// expired is refused here (`ops[N].spec.cert_pem`).
pub fn parse_change_set(bytes: &[u8]) -> Result<ChangeSet, ParseError> {
    let cs: ChangeSet = parse_json(bytes)?;
    check_change_set(&cs)?;
    Ok(cs)
}

/// The checks a change set gets where it comes in, beyond its types: a
/// certificate that has already expired (`ops[N].spec.cert_pem`), or that
/// names no host and is not the default (`ops[N].spec.default`), is refused;
/// so is an `acme_state` op, which only Tidegate's ACME manager writes.
pub fn check_change_set(cs: &ChangeSet) -> Result<(), ParseError> {
    let now = crate::certificate::unix_now();
    for (i, op) in cs.ops.iter().enumerate() {
        if let Op::AcmeState { .. } = op {
            return Err(ParseError {
                op: Some(i),
                field: format!("ops[{i}].op"),
                message: "acme_state is written by Tidegate's ACME manager, not given; put the certificate's \
                          acme block, or renew it with renew_certificate"
                    .into(),
            });
        }
        if let Op::PutCertificate { spec, .. } = op {
            spec.check_incoming(now).map_err(|e| ParseError::invalid(Some(i), &format!("ops[{i}].spec"), e))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_op() {
        let text = r#"{"if_revision":3,"ops":[
            {"op":"put_service","name":"web","spec":{"backends":[{"id":"a","addr":"127.0.0.1:1"}]}},
            {"op":"put_backend","service":"web","id":"b","spec":{"addr":"127.0.0.1:2","weight":2}},
            {"op":"delete_backend","service":"web","id":"a"},
            {"op":"put_route","name":"r","spec":{"match":{"path_prefix":"/"},"service":"web"}},
            {"op":"delete_route","name":"r"},
            {"op":"delete_service","name":"web"}]}"#;
        let cs = parse_change_set(text.as_bytes()).unwrap();
        assert_eq!(cs.if_revision, Some(3));
        assert_eq!(cs.ops.len(), 6);
    }

    #[test]
    fn only_objects_are_documents() {
        for positional in ["[]", " [1]", "\"x\"", "3", "null"] {
            let e = parse_change_set(positional.as_bytes()).unwrap_err();
            assert_eq!(e.message, "expected a JSON object", "{positional}");
        }
    }

    #[test]
    fn errors_name_the_op_and_field() {
        let text = r#"{"ops":[{"op":"delete_route","name":"r"},
            {"op":"put_service","name":"web","spec":{"backends":[{"id":"a","addr":"nope"}]}}]}"#;
        let err = parse_change_set(text.as_bytes()).unwrap_err();
        assert_eq!(err.op, Some(1));
        assert_eq!(err.field, "ops[1].spec.backends[0].addr");
        assert!(err.message.contains("invalid address"), "{}", err.message);

        let text = r#"{"ops":[{"op":"put_service","name":"web","spec":{"backends":[
            {"id":"a","addr":"h:1"},{"id":"a","addr":"h:2"}]}}]}"#;
        let err = parse_change_set(text.as_bytes()).unwrap_err();
        assert_eq!(err.field, "ops[0].spec.backends[1].id", "{err:?}");

        let err = parse_change_set(br#"{"ops":[{"op":"explode"}]}"#).unwrap_err();
        assert_eq!(err.op, Some(0));
        let err = parse_change_set(br#"{"ops":[], "extra": true}"#).unwrap_err();
        assert!(err.message.contains("unknown field"), "{err:?}");
        assert!(parse_change_set(b"{not json").is_err());
    }
}
