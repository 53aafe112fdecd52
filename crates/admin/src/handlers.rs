//! Resource and change-set endpoints.

use std::borrow::Cow;
use std::collections::BTreeMap;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use tidegate_control::SubmitError;
use tidegate_model::{
    check_static_root, document_paths, in_document, parse_change_set, parse_json, plan, unix_now, BackendId,
    BackendSpec, CertName, CertificateInput, CertificateSpec, ChangeError, ChangeSet, ConfigState, Document,
    ListenerName, ListenerSpec, Op, RouteAction, RouteName, RouteSpec, RuleSetName, RuleSetSpec, ServiceName,
    ServiceSpec,
};

use crate::api::{
    AcmeView, Alive, BackendRead, CertificateRead, CertificateView, CertificatesRead, ChangesApplied, ConfigApplied,
    ConfigRead, ListenerRead, ListenersRead, Readiness, RouteRead, RoutesRead, RuleSetRead, RuleSetsRead, ServiceRead,
    ServicesRead, Sorted, Written,
};
use crate::{AdminState, ApiError};

type Answer<T> = Result<Sorted<T>, ApiError>;

fn service_name(s: &str) -> Result<ServiceName, ApiError> {
    ServiceName::new(s).map_err(|e| ApiError::bad_field("path.name", e.to_string()))
}

fn route_name(s: &str) -> Result<RouteName, ApiError> {
    RouteName::new(s).map_err(|e| ApiError::bad_field("path.name", e.to_string()))
}

fn cert_name(s: &str) -> Result<CertName, ApiError> {
    CertName::new(s).map_err(|e| ApiError::bad_field("path.name", e.to_string()))
}

fn rules_name(s: &str) -> Result<RuleSetName, ApiError> {
    RuleSetName::new(s).map_err(|e| ApiError::bad_field("path.name", e.to_string()))
}

fn listener_name(s: &str) -> Result<ListenerName, ApiError> {
    ListenerName::new(s).map_err(|e| ApiError::bad_field("path.name", e.to_string()))
}

fn backend_id(s: &str) -> Result<BackendId, ApiError> {
    BackendId::new(s).map_err(|e| ApiError::bad_field("path.id", e.to_string()))
}

/// The service and backend a `/v1/services/{name}/backends/{id}` path names.
fn backend_key((service, id): (String, String)) -> Result<(ServiceName, BackendId), ApiError> {
    Ok((service_name(&service)?, backend_id(&id)?))
}

/// Parses a resource body, naming fields as in the equivalent change set.
fn body<T: serde::de::DeserializeOwned>(bytes: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let bytes = bytes.map_err(ApiError::body)?;
    parse_json(&bytes).map_err(|e| ApiError::parse(e, Some("spec")))
}

async fn submit(state: &AdminState, ops: Vec<Op>) -> Answer<Written> {
    let revision = state.control.submit(ChangeSet { if_revision: None, ops }).await?;
    Ok(Sorted(Written { revision }))
}

pub(crate) async fn put_service(
    State(state): State<AdminState>,
    Path(name): Path<String>,
    bytes: Result<Bytes, BytesRejection>,
) -> Answer<Written> {
    let name = service_name(&name)?;
    let spec: ServiceSpec = body(bytes)?;
    submit(&state, vec![Op::PutService { name, spec: Box::new(spec) }]).await
}

pub(crate) async fn delete_service(State(state): State<AdminState>, Path(name): Path<String>) -> Answer<Written> {
    let name = service_name(&name)?;
    submit(&state, vec![Op::DeleteService { name }]).await
}

pub(crate) async fn get_service(State(state): State<AdminState>, Path(name): Path<String>) -> Response {
    let view = state.control.config();
    let Some(spec) = view.state.service(&name) else {
        return ApiError::not_found(format!("no service {name:?}")).into_response();
    };
    Sorted(ServiceRead { revision: view.revision, spec: spec.redacted() }).into_response()
}

pub(crate) async fn list_services(State(state): State<AdminState>) -> Response {
    let view = state.control.config();
    let services: BTreeMap<&str, Cow<'_, ServiceSpec>> =
        view.state.services().iter().map(|(k, v)| (k.as_str(), v.redacted())).collect();
    Sorted(ServicesRead { revision: view.revision, services }).into_response()
}

pub(crate) async fn put_backend(
    State(state): State<AdminState>,
    Path(path): Path<(String, String)>,
    bytes: Result<Bytes, BytesRejection>,
) -> Answer<Written> {
    let (service, id) = backend_key(path)?;
    let spec: BackendSpec = body(bytes)?;
    submit(&state, vec![Op::PutBackend { service, id, spec }]).await
}

/// How many times a patch is read and applied when other changes keep
/// landing between reading the backend and committing it (each round
/// commits at least one of the contending change sets).
const PATCH_ATTEMPTS: u32 = 16;

/// `PATCH`: changes only the fields the body names (a JSON merge patch,
/// RFC 7386: a field set to `null` goes back to its default), keeping the
/// others. The patched backend is committed on the revision it was read
/// at; if another change landed in between, it is read and patched again.
pub(crate) async fn patch_backend(
    State(state): State<AdminState>,
    Path(path): Path<(String, String)>,
    bytes: Result<Bytes, BytesRejection>,
) -> Answer<Written> {
    let (service, id) = backend_key(path)?;
    let serde_json::Value::Object(patch) = body::<serde_json::Value>(bytes)? else {
        return Err(ApiError::bad_field("spec", "a merge patch is a JSON object of the fields to change"));
    };
    let mut attempt = 0;
    loop {
        attempt += 1;
        let view = state.control.config();
        let Some(current) = view.state.service(service.as_str()).and_then(|s| s.backends.get(id.as_str())) else {
            return Err(ApiError::not_found(format!("no backend {:?} in service {:?}", id.as_str(), service.as_str())));
        };
        let mut merged = serde_json::to_value(current).map_err(|e| ApiError::internal(e.to_string()))?;
        merge_patch(&mut merged, &patch);
        let spec: BackendSpec =
            parse_json(merged.to_string().as_bytes()).map_err(|e| ApiError::parse(e, Some("spec")))?;
        let op = Op::PutBackend { service: service.clone(), id: id.clone(), spec };
        match state.control.submit(ChangeSet { if_revision: Some(view.revision), ops: vec![op] }).await {
            Ok(revision) => return Ok(Sorted(Written { revision })),
            Err(SubmitError::Rejected(e)) if e.field.as_deref() == Some("if_revision") => {
                if attempt == PATCH_ATTEMPTS {
                    return Err(ApiError::conflict(format!(
                        "the configuration changed {attempt} times while this patch was applied; try again"
                    )));
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Applies a JSON merge patch (RFC 7386) to `target`: each field of
/// `patch` replaces the target's, objects merge field by field, and `null`
/// removes the field.
fn merge_patch(target: &mut serde_json::Value, patch: &serde_json::Map<String, serde_json::Value>) {
    if !target.is_object() {
        *target = serde_json::Value::Object(serde_json::Map::new());
    }
    let serde_json::Value::Object(fields) = target else { return };
    for (name, value) in patch {
        match value {
            serde_json::Value::Null => {
                fields.remove(name);
            }
            serde_json::Value::Object(inner) => {
                merge_patch(fields.entry(name).or_insert(serde_json::Value::Null), inner)
            }
            other => {
                fields.insert(name.clone(), other.clone());
            }
        }
    }
}

pub(crate) async fn delete_backend(
    State(state): State<AdminState>,
    Path(path): Path<(String, String)>,
) -> Answer<Written> {
    let (service, id) = backend_key(path)?;
    submit(&state, vec![Op::DeleteBackend { service, id }]).await
}

pub(crate) async fn get_backend(
    State(state): State<AdminState>,
    Path((service, id)): Path<(String, String)>,
) -> Response {
    let view = state.control.config();
    let Some(spec) = view.state.service(&service).and_then(|s| s.backends.get(id.as_str())) else {
        return ApiError::not_found(format!("no backend {id:?} in service {service:?}")).into_response();
    };
    Sorted(BackendRead { revision: view.revision, spec }).into_response()
}

pub(crate) async fn put_route(
    State(state): State<AdminState>,
    Path(name): Path<String>,
    bytes: Result<Bytes, BytesRejection>,
) -> Answer<Written> {
    let name = route_name(&name)?;
    let spec: RouteSpec = body(bytes)?;
    let ops = vec![Op::PutRoute { name, spec: Box::new(spec) }];
    check_static_roots(&state, &ops, |_| "spec.static.root".into()).await?;
    submit(&state, ops).await
}

/// Resolves the root of every static route `ops` put and refuses one that
/// no static route may serve (a system directory, the data directory, a
/// link to either; see [`tidegate_model::static_root`]), with a 400 naming
/// the field `field(op index)` gives. The proxy checks the root again on
/// every request.
async fn check_static_roots(state: &AdminState, ops: &[Op], field: impl Fn(usize) -> String) -> Result<(), ApiError> {
    let roots: Vec<(usize, std::path::PathBuf)> = ops
        .iter()
        .enumerate()
        .filter_map(|(i, op)| match op {
            Op::PutRoute { spec, .. } => match &spec.action {
                RouteAction::Static(d) => Some((i, d.root.clone())),
                RouteAction::Service(_) => None,
            },
            _ => None,
        })
        .collect();
    if roots.is_empty() {
        return Ok(());
    }
    let private = state.private_dirs.clone();
    // Resolving may touch a slow filesystem: not on the API's thread.
    let refused = tokio::task::spawn_blocking(move || {
        roots.into_iter().find_map(|(i, root)| check_static_root(&root, &private).err().map(|e| (i, e)))
    })
    .await
    .map_err(|e| ApiError::internal(format!("checking static roots: {e}")))?;
    match refused {
        Some((i, e)) => Err(ApiError::bad_field(&field(i), e.to_string())),
        None => Ok(()),
    }
}

pub(crate) async fn delete_route(State(state): State<AdminState>, Path(name): Path<String>) -> Answer<Written> {
    let name = route_name(&name)?;
    submit(&state, vec![Op::DeleteRoute { name }]).await
}

pub(crate) async fn get_route(State(state): State<AdminState>, Path(name): Path<String>) -> Response {
    let view = state.control.config();
    let Some(spec) = view.state.route(&name) else {
        return ApiError::not_found(format!("no route {name:?}")).into_response();
    };
    Sorted(RouteRead { revision: view.revision, spec }).into_response()
}

pub(crate) async fn list_routes(State(state): State<AdminState>) -> Response {
    let view = state.control.config();
    let routes: BTreeMap<&str, &RouteSpec> = view.state.routes().iter().map(|(k, v)| (k.as_str(), &**v)).collect();
    Sorted(RoutesRead { revision: view.revision, routes }).into_response()
}

pub(crate) async fn put_rules(
    State(state): State<AdminState>,
    Path(name): Path<String>,
    bytes: Result<Bytes, BytesRejection>,
) -> Answer<Written> {
    let name = rules_name(&name)?;
    // A hash given as the placeholder keeps the user's current one.
    let spec: RuleSetSpec = body(bytes)?;
    submit(&state, vec![Op::PutRules { name, spec: Box::new(spec) }]).await
}

pub(crate) async fn delete_rules(State(state): State<AdminState>, Path(name): Path<String>) -> Answer<Written> {
    let name = rules_name(&name)?;
    submit(&state, vec![Op::DeleteRules { name }]).await
}

pub(crate) async fn get_rules(State(state): State<AdminState>, Path(name): Path<String>) -> Response {
    let view = state.control.config();
    let Some(spec) = view.state.rule_set(&name) else {
        return ApiError::not_found(format!("no rule set {name:?}")).into_response();
    };
    let used_by = view.state.rule_set_users(&name).map_or_else(Vec::new, |u| u.iter().map(|r| r.as_str()).collect());
    Sorted(RuleSetRead { revision: view.revision, spec: spec.redacted(), used_by }).into_response()
}

pub(crate) async fn list_rules(State(state): State<AdminState>) -> Response {
    let view = state.control.config();
    let rules = view.state.rules().iter().map(|(k, v)| (k.as_str(), v.redacted())).collect();
    Sorted(RuleSetsRead { revision: view.revision, rules }).into_response()
}

pub(crate) async fn put_listener(
    State(state): State<AdminState>,
    Path(name): Path<String>,
    bytes: Result<Bytes, BytesRejection>,
) -> Answer<Written> {
    let name = listener_name(&name)?;
    let spec: ListenerSpec = body(bytes)?;
    submit(&state, vec![Op::PutListener { name, spec }]).await
}

pub(crate) async fn delete_listener(State(state): State<AdminState>, Path(name): Path<String>) -> Answer<Written> {
    let name = listener_name(&name)?;
    submit(&state, vec![Op::DeleteListener { name }]).await
}

pub(crate) async fn get_listener(State(state): State<AdminState>, Path(name): Path<String>) -> Response {
    let view = state.control.config();
    let Some(spec) = view.state.listener(&name) else {
        return ApiError::not_found(format!("no listener {name:?}")).into_response();
    };
    let used_by = view
        .state
        .routes()
        .iter()
        .filter(|(_, r)| r.listeners.iter().any(|l| l.as_str() == name))
        .map(|(n, _)| n.as_str())
        .collect();
    let status = state.listeners.read().remove(&name).map(Into::into);
    Sorted(ListenerRead { revision: view.revision, spec, used_by, status }).into_response()
}

pub(crate) async fn list_listeners(State(state): State<AdminState>) -> Response {
    let view = state.control.config();
    let listeners = view.state.listeners().iter().map(|(k, v)| (k.as_str(), &**v)).collect();
    Sorted(ListenersRead { revision: view.revision, listeners }).into_response()
}

pub(crate) async fn put_certificate(
    State(state): State<AdminState>,
    Path(name): Path<String>,
    bytes: Result<Bytes, BytesRejection>,
) -> Answer<Written> {
    let name = cert_name(&name)?;
    // A key given as the placeholder keeps the current one (a renewed
    // chain for the same key, or the default flag changed).
    let spec: CertificateInput = body(bytes)?;
    spec.check_incoming(unix_now())
        .map_err(|e| ApiError::parse(tidegate_model::ParseError::invalid(None, "spec", e), None))?;
    submit(&state, vec![Op::PutCertificate { name, spec: Box::new(spec) }]).await
}

pub(crate) async fn delete_certificate(State(state): State<AdminState>, Path(name): Path<String>) -> Answer<Written> {
    let name = cert_name(&name)?;
    submit(&state, vec![Op::DeleteCertificate { name }]).await
}

/// `POST /v1/certificates/{name}/renew`: asks for a managed certificate
/// to be renewed now (the instance that orders it starts within a second;
/// the certificate served stays until the new one is issued).
pub(crate) async fn renew_certificate(State(state): State<AdminState>, Path(name): Path<String>) -> Answer<Written> {
    let name = cert_name(&name)?;
    submit(&state, vec![Op::RenewCertificate { name }]).await
}

/// What the read APIs show of a certificate: never the key.
fn certificate_view(spec: &CertificateSpec) -> CertificateView<'_> {
    CertificateView {
        info: spec.info(),
        default: spec.is_default(),
        client_auth: spec.client_auth(),
        acme: spec.managed().map(AcmeView::of),
    }
}

/// Every certificate as the read APIs show it.
fn certificates_view(state: &ConfigState) -> BTreeMap<&str, CertificateView<'_>> {
    state.certificates().iter().map(|(k, v)| (k.as_str(), certificate_view(v))).collect()
}

pub(crate) async fn get_certificate(State(state): State<AdminState>, Path(name): Path<String>) -> Response {
    let view = state.control.config();
    let Some(spec) = view.state.certificates().get(name.as_str()) else {
        return ApiError::not_found(format!("no certificate {name:?}")).into_response();
    };
    Sorted(CertificateRead { revision: view.revision, certificate: certificate_view(spec) }).into_response()
}

pub(crate) async fn list_certificates(State(state): State<AdminState>) -> Response {
    let view = state.control.config();
    Sorted(CertificatesRead { revision: view.revision, certificates: certificates_view(&view.state) }).into_response()
}

/// `?dry_run=true`: check the change set, apply nothing.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ChangesQuery {
    #[serde(default)]
    dry_run: bool,
}

type ChangesQueryResult = Result<axum::extract::Query<ChangesQuery>, axum::extract::rejection::QueryRejection>;

/// The query and the body of a write, or the 400 for either.
fn query_and_body(
    query: ChangesQueryResult,
    bytes: Result<Bytes, BytesRejection>,
) -> Result<(ChangesQuery, Bytes), ApiError> {
    let axum::extract::Query(query) = query.map_err(|e| ApiError::bad_field("query", e.body_text()))?;
    Ok((query, bytes.map_err(ApiError::body)?))
}

pub(crate) async fn post_changes(
    State(state): State<AdminState>,
    query: ChangesQueryResult,
    bytes: Result<Bytes, BytesRejection>,
) -> Answer<ChangesApplied> {
    let (query, bytes) = query_and_body(query, bytes)?;
    let change = parse_change_set(&bytes).map_err(|e| ApiError::parse(e, None))?;
    check_static_roots(&state, &change.ops, |i| format!("ops[{i}].spec.static.root")).await?;
    let ops = change.ops.len();
    if query.dry_run {
        // The same checks the writer runs, against the configuration as it
        // is now; nothing is queued, stored or published.
        let view = state.control.config();
        view.state.apply(&change, view.revision).map_err(|e| ApiError::from(SubmitError::Rejected(e)))?;
        return Ok(Sorted(ChangesApplied { dry_run: true, revision: view.revision, ops }));
    }
    let revision = state.control.submit(change).await?;
    Ok(Sorted(ChangesApplied { dry_run: false, revision, ops }))
}

/// `PUT /v1/config`: makes the configuration equal to a document
/// (`services`, `routes`, `certificates`) in one change set: what is new
/// is created, what differs is replaced, what the document leaves out is
/// deleted. Objects that are equal are not touched, and a document equal to
/// the configuration changes nothing (no new revision). With
/// `?dry_run=true` the changes are shown and nothing is applied (`ctl
/// diff`). The plan is made against the revision read here and applied
/// only at that revision (409 if another change came in between).
pub(crate) async fn put_config(
    State(state): State<AdminState>,
    query: ChangesQueryResult,
    bytes: Result<Bytes, BytesRejection>,
) -> Answer<ConfigApplied> {
    let (query, bytes) = query_and_body(query, bytes)?;
    let doc: Document = parse_json(&bytes).map_err(|e| ApiError::parse(e, None))?;
    doc.check().map_err(|e| ApiError::parse(e, None))?;
    let view = state.control.config();
    let (ops, changes) = plan(&view.state, &doc);
    // Errors name the document's fields, not the plan's ops.
    let paths = document_paths(&ops);
    check_static_roots(&state, &ops, |i| format!("{}.static.root", paths.get(i).map_or(".", String::as_str))).await?;
    let in_doc = |e: ChangeError| ApiError::from(SubmitError::Rejected(in_document(&paths, e)));
    let change = ChangeSet { if_revision: Some(view.revision), ops };
    if query.dry_run || change.ops.is_empty() {
        // The writer's own checks, against the configuration as it is now.
        view.state.apply(&change, view.revision).map_err(in_doc)?;
        return Ok(Sorted(ConfigApplied { dry_run: Some(query.dry_run), revision: view.revision, changes }));
    }
    let revision = state.control.submit(change).await.map_err(|e| match e {
        SubmitError::Rejected(e) => in_doc(e),
        other => ApiError::from(other),
    })?;
    Ok(Sorted(ConfigApplied { dry_run: None, revision, changes }))
}

/// `GET /healthz`: the process answers. No token.
pub(crate) async fn healthz() -> Sorted<Alive> {
    Sorted(Alive { status: "ok".into() })
}

/// `GET /readyz`: the store is open, the configuration loaded, and the
/// listeners bound (the admin API starts after the proxy's listener); in
/// cluster mode, the watch on etcd is live too, and the store has no fault
/// (503 otherwise: the proxy still serves its last configuration, but
/// changes made elsewhere do not reach it, or the store cannot be trusted).
/// No token.
pub(crate) async fn readyz(State(state): State<AdminState>) -> axum::response::Response {
    use axum::response::IntoResponse;
    let revision = state.control.config().revision;
    let store = state.control.store_status();
    if let Some(fault) = store.faults.first() {
        let error = if store.faults.len() > 1 {
            format!("{fault} (and {} more: see /v1/status)", store.faults.len() - 1)
        } else {
            fault.to_string()
        };
        let body = Readiness { status: "store fault".into(), revision, error: Some(error) };
        (axum::http::StatusCode::SERVICE_UNAVAILABLE, Sorted(body)).into_response()
    } else if store.connected {
        Sorted(Readiness { status: "ready".into(), revision, error: None }).into_response()
    } else {
        let body = Readiness { status: "store unavailable".into(), revision, error: store.last_error };
        (axum::http::StatusCode::SERVICE_UNAVAILABLE, Sorted(body)).into_response()
    }
}

pub(crate) async fn get_config(State(state): State<AdminState>) -> Response {
    let view = state.control.config();
    // Secrets are never read back (see `tidegate_model::REDACTED`).
    let services: BTreeMap<&str, Cow<'_, ServiceSpec>> =
        view.state.services().iter().map(|(k, v)| (k.as_str(), v.redacted())).collect();
    let routes: BTreeMap<&str, &RouteSpec> = view.state.routes().iter().map(|(k, v)| (k.as_str(), &**v)).collect();
    let certificates = view.state.certificates().iter().map(|(k, v)| (k.as_str(), v.redacted())).collect();
    let rules = view.state.rules().iter().map(|(k, v)| (k.as_str(), v.redacted())).collect();
    let listeners = view.state.listeners().iter().map(|(k, v)| (k.as_str(), &**v)).collect();
    Sorted(ConfigRead { revision: view.revision, services, routes, certificates, rules, listeners }).into_response()
}

#[cfg(test)]
mod merge_patch_tests {
    use serde_json::json;

    fn patched(target: serde_json::Value, patch: serde_json::Value) -> serde_json::Value {
        let mut target = target;
        super::merge_patch(&mut target, patch.as_object().unwrap());
        target
    }

    #[test]
    fn named_fields_change_null_removes_and_the_rest_stays() {
        let backend = json!({"addr": "10.0.0.1:80", "weight": 3, "max_conns": 100});
        assert_eq!(
            patched(backend.clone(), json!({"weight": 0})),
            json!({"addr": "10.0.0.1:80", "weight": 0, "max_conns": 100})
        );
        assert_eq!(patched(backend.clone(), json!({"max_conns": null})), json!({"addr": "10.0.0.1:80", "weight": 3}));
        assert_eq!(patched(backend.clone(), json!({})), backend);
        assert_eq!(patched(backend, json!({"backup": true, "gone": null})).get("backup"), Some(&json!(true)));
    }

    #[test]
    fn objects_merge_field_by_field_as_rfc_7386_says() {
        let target = json!({"a": {"b": 1, "c": 2}, "d": [1, 2]});
        let out = patched(target, json!({"a": {"b": null, "e": 3}, "d": [3]}));
        assert_eq!(out, json!({"a": {"c": 2, "e": 3}, "d": [3]}));
        assert_eq!(patched(json!({"a": 1}), json!({"a": {"b": {"c": null}}})), json!({"a": {"b": {}}}));
    }
}
