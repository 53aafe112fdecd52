//! The OpenAPI 3.1 document of the admin API (`GET /v1/openapi.json`).
//!
//! Paths come from [`ENDPOINTS`], the table beside the router (a test
//! checks that the two list the same routes); every body's schema is
//! generated from the Rust type the handler reads or writes (the model's
//! types and [`crate::api`]), by schemars, as JSON Schema 2020-12 (which
//! OpenAPI 3.1 uses as is). Nothing in it is written by hand but the
//! sentences.

use schemars::generate::SchemaSettings;
use schemars::{JsonSchema, Schema, SchemaGenerator};
use serde_json::{json, Map, Value};
use tidegate_model::{
    BackendSpec, CertificateSpec, ChangeSet, Document, ListenerSpec, RouteSpec, RuleSetSpec, ServiceSpec,
};

use crate::api;

/// A body's schema, from its type.
type SchemaFn = fn(&mut SchemaGenerator) -> Schema;

fn of<T: JsonSchema>(g: &mut SchemaGenerator) -> Schema {
    g.subschema_for::<T>()
}

/// What a response carries.
#[derive(Clone, Copy)]
enum Body {
    /// JSON of this type.
    Json(SchemaFn),
    /// Another content type, described in words.
    Other(&'static str),
}

/// One operation of the API.
struct Endpoint {
    method: &'static str,
    path: &'static str,
    summary: &'static str,
    /// Needs the bearer token.
    auth: bool,
    /// Query parameters: name, JSON type, description.
    query: &'static [(&'static str, &'static str, &'static str)],
    request: Option<SchemaFn>,
    ok: (u16, &'static str, Body),
    /// Failures it can answer with (besides 400 for a query it does not
    /// take and 401 for a missing token, which every authenticated one has).
    errors: &'static [u16],
}

/// The failures of a write: bad input, a missing object, a conflict (a
/// stale `if_revision`, a route still pointing at a service), a body too
/// large, a store that cannot commit.
const WRITE: &[u16] = &[404, 409, 413, 503];
const DRY_RUN: (&str, &str, &str) =
    ("dry_run", "boolean", "Check the change against the current configuration, apply nothing.");

/// Every operation, in the order the document lists them.
const ENDPOINTS: &[Endpoint] = &[
    Endpoint { method: "get", path: "/healthz", summary: "The process answers (no token).", auth: false, query: &[], request: None, ok: (200, "Alive.", Body::Json(of::<api::Alive>)), errors: &[400] },
    Endpoint { method: "get", path: "/readyz", summary: "The store is open, the configuration loaded, the listeners bound; in cluster mode the etcd watch is live and the store has no fault (no token).", auth: false, query: &[], request: None, ok: (200, "Ready.", Body::Json(of::<api::Readiness>)), errors: &[400, 503] },
    Endpoint { method: "get", path: "/v1/openapi.json", summary: "This document (no token).", auth: false, query: &[], request: None, ok: (200, "The OpenAPI 3.1 document.", Body::Other("application/json")), errors: &[400] },
    Endpoint { method: "get", path: "/v1/services", summary: "Every service, by name.", auth: true, query: &[], request: None, ok: (200, "The services.", Body::Json(of::<api::ServicesRead<'static>>)), errors: &[] },
    Endpoint { method: "get", path: "/v1/services/{name}", summary: "One service.", auth: true, query: &[], request: None, ok: (200, "The service.", Body::Json(of::<api::ServiceRead<'static>>)), errors: &[404] },
    Endpoint { method: "put", path: "/v1/services/{name}", summary: "Create or replace a service with all its backends.", auth: true, query: &[], request: Some(of::<ServiceSpec>), ok: (200, "Durable and live.", Body::Json(of::<api::Written>)), errors: WRITE },
    Endpoint { method: "delete", path: "/v1/services/{name}", summary: "Delete a service (refused while routes point at it).", auth: true, query: &[], request: None, ok: (200, "Durable and live.", Body::Json(of::<api::Written>)), errors: WRITE },
    Endpoint { method: "get", path: "/v1/services/{name}/backends/{id}", summary: "One backend of a service.", auth: true, query: &[], request: None, ok: (200, "The backend.", Body::Json(of::<api::BackendRead<'static>>)), errors: &[404] },
    Endpoint { method: "put", path: "/v1/services/{name}/backends/{id}", summary: "Create or replace one backend of an existing service.", auth: true, query: &[], request: Some(of::<BackendSpec>), ok: (200, "Durable and live.", Body::Json(of::<api::Written>)), errors: WRITE },
    Endpoint { method: "patch", path: "/v1/services/{name}/backends/{id}", summary: "Change only the fields named in the body (a JSON merge patch, RFC 7386: `null` resets a field to its default) of an existing backend; the other fields are kept.", auth: true, query: &[], request: Some(of::<serde_json::Map<String, Value>>), ok: (200, "Durable and live.", Body::Json(of::<api::Written>)), errors: WRITE },
    Endpoint { method: "delete", path: "/v1/services/{name}/backends/{id}", summary: "Delete one backend.", auth: true, query: &[], request: None, ok: (200, "Durable and live.", Body::Json(of::<api::Written>)), errors: WRITE },
    Endpoint { method: "post", path: "/v1/services/{name}/autoscale", summary: "Pause, resume or pin a service's autoscaling.", auth: true, query: &[], request: Some(of::<api::AutoscaleOverride>), ok: (200, "Durable and live.", Body::Json(of::<api::Written>)), errors: WRITE },
    Endpoint { method: "get", path: "/v1/routes", summary: "Every route, by name.", auth: true, query: &[], request: None, ok: (200, "The routes.", Body::Json(of::<api::RoutesRead<'static>>)), errors: &[] },
    Endpoint { method: "get", path: "/v1/routes/{name}", summary: "One route.", auth: true, query: &[], request: None, ok: (200, "The route.", Body::Json(of::<api::RouteRead<'static>>)), errors: &[404] },
    Endpoint { method: "put", path: "/v1/routes/{name}", summary: "Create or replace a route (its service must exist).", auth: true, query: &[], request: Some(of::<RouteSpec>), ok: (200, "Durable and live.", Body::Json(of::<api::Written>)), errors: WRITE },
    Endpoint { method: "delete", path: "/v1/routes/{name}", summary: "Delete a route.", auth: true, query: &[], request: None, ok: (200, "Durable and live.", Body::Json(of::<api::Written>)), errors: WRITE },
    Endpoint { method: "get", path: "/v1/rules", summary: "Every rule set, by name (password hashes as `(redacted)`).", auth: true, query: &[], request: None, ok: (200, "The rule sets.", Body::Json(of::<api::RuleSetsRead<'static>>)), errors: &[] },
    Endpoint { method: "get", path: "/v1/rules/{name}", summary: "One rule set (password hashes as `(redacted)`) and the routes that run it.", auth: true, query: &[], request: None, ok: (200, "The rule set.", Body::Json(of::<api::RuleSetRead<'static>>)), errors: &[404] },
    Endpoint { method: "put", path: "/v1/rules/{name}", summary: "Create or replace a rule set (`{\"steps\": [...]}`; a hash given as `(redacted)` keeps the user's current one).", auth: true, query: &[], request: Some(of::<RuleSetSpec>), ok: (200, "Durable and live.", Body::Json(of::<api::Written>)), errors: WRITE },
    Endpoint { method: "delete", path: "/v1/rules/{name}", summary: "Delete a rule set (refused while a route runs it, naming the route).", auth: true, query: &[], request: None, ok: (200, "Durable and live.", Body::Json(of::<api::Written>)), errors: WRITE },
    Endpoint { method: "get", path: "/v1/listeners", summary: "Every named listener, by name.", auth: true, query: &[], request: None, ok: (200, "The listeners.", Body::Json(of::<api::ListenersRead<'static>>)), errors: &[] },
    Endpoint { method: "get", path: "/v1/listeners/{name}", summary: "One named listener, the routes bound to it, and how this instance serves it.", auth: true, query: &[], request: None, ok: (200, "The listener.", Body::Json(of::<api::ListenerRead<'static>>)), errors: &[404] },
    Endpoint { method: "put", path: "/v1/listeners/{name}", summary: "Create or replace a named listener (`{\"addr\": \"127.0.0.1:8081\", \"tls\": false, \"proxy_protocol\": {\"trusted\": [...]}}`); the data plane opens it at once.", auth: true, query: &[], request: Some(of::<ListenerSpec>), ok: (200, "Durable and live.", Body::Json(of::<api::Written>)), errors: WRITE },
    Endpoint { method: "delete", path: "/v1/listeners/{name}", summary: "Delete a named listener (refused while a route is bound to it, naming the route); its socket closes, its open connections finish.", auth: true, query: &[], request: None, ok: (200, "Durable and live.", Body::Json(of::<api::Written>)), errors: WRITE },
    Endpoint { method: "get", path: "/v1/certificates", summary: "Every TLS certificate (never its key).", auth: true, query: &[], request: None, ok: (200, "The certificates.", Body::Json(of::<api::CertificatesRead<'static>>)), errors: &[] },
    Endpoint { method: "get", path: "/v1/certificates/{name}", summary: "One TLS certificate (never its key).", auth: true, query: &[], request: None, ok: (200, "The certificate.", Body::Json(of::<api::CertificateRead<'static>>)), errors: &[404] },
    Endpoint { method: "post", path: "/v1/certificates/{name}/renew", summary: "Renew a managed (ACME) certificate now; the one served stays until the new one is issued.", auth: true, query: &[], request: None, ok: (200, "Durable and live: the instance that orders it starts within a second.", Body::Json(of::<api::Written>)), errors: WRITE },
    Endpoint { method: "put", path: "/v1/certificates/{name}", summary: "Create or replace a TLS certificate: a chain and key, or an acme block (a managed certificate Tidegate obtains and renews).", auth: true, query: &[], request: Some(of::<CertificateSpec>), ok: (200, "Durable and live.", Body::Json(of::<api::Written>)), errors: WRITE },
    Endpoint { method: "delete", path: "/v1/certificates/{name}", summary: "Delete a TLS certificate.", auth: true, query: &[], request: None, ok: (200, "Durable and live.", Body::Json(of::<api::Written>)), errors: WRITE },
    Endpoint { method: "post", path: "/v1/changes", summary: "Apply a change set atomically: all of it, or nothing (with `if_revision`, only at that revision).", auth: true, query: &[DRY_RUN], request: Some(of::<ChangeSet>), ok: (200, "Durable and live (or, with dry_run, valid).", Body::Json(of::<api::ChangesApplied>)), errors: WRITE },
    Endpoint { method: "get", path: "/v1/config", summary: "The whole configuration, as a declarative document.", auth: true, query: &[], request: None, ok: (200, "The configuration.", Body::Json(of::<api::ConfigRead<'static>>)), errors: &[] },
    Endpoint { method: "put", path: "/v1/config", summary: "Make the configuration equal to a document, in one change set.", auth: true, query: &[DRY_RUN], request: Some(of::<Document>), ok: (200, "What changed (or, with dry_run, would).", Body::Json(of::<api::ConfigApplied>)), errors: WRITE },
    Endpoint { method: "get", path: "/v1/status", summary: "Live state: every service and backend (health, in flight, latency, limits, scaling) and the store.", auth: true, query: &[], request: None, ok: (200, "The state.", Body::Json(of::<api::Status>)), errors: &[] },
    Endpoint { method: "get", path: "/v1/events", summary: "The autoscaler's recent decisions and actions.", auth: true, query: &[("after", "integer", "Only events with a higher sequence number.")], request: None, ok: (200, "The events.", Body::Json(of::<api::Events>)), errors: &[] },
    Endpoint { method: "get", path: "/v1/watch", summary: "Applied change sets as server-sent events (`event: change`, `data: {\"revision\", \"change\"}`), then live ones; ends only with a last `event: lagged` (`data: {\"error\", \"resume_from\"}`) when the client falls behind, or `event: error`. 503 with Retry-After when too many streams replay history at once. Each change event's `id` is its revision: a client reconnecting with `Last-Event-ID` resumes after it.", auth: true, query: &[("from", "integer", "Send the change sets after this revision first (default: the current one: only new changes).")], request: None, ok: (200, "An event stream.", Body::Other("text/event-stream")), errors: &[400, 503] },
    Endpoint { method: "get", path: "/metrics", summary: "Metrics, in the OpenMetrics text format.", auth: true, query: &[], request: None, ok: (200, "The metrics.", Body::Other("application/openmetrics-text; version=1.0.0; charset=utf-8")), errors: &[] },
];

/// Why each failure status happens.
fn failure(status: u16) -> &'static str {
    match status {
        400 => "The request is malformed: the message says why, `field` where.",
        401 => "The token is missing or wrong.",
        404 => "No such object.",
        409 => "A conflict: a stale `if_revision`, or an object still in use.",
        413 => "The body or the change set is too large.",
        503 => "The store cannot commit now (cluster mode: etcd is unreachable).",
        _ => "Failed.",
    }
}

/// The path parameters of `path`, in order.
fn path_params(path: &str) -> Vec<&str> {
    path.split('/').filter_map(|seg| seg.strip_prefix('{')?.strip_suffix('}')).collect()
}

fn operation(e: &Endpoint, g: &mut SchemaGenerator) -> Value {
    let name = json!({"type": "string", "pattern": "^[A-Za-z0-9._-]{1,128}$"});
    let mut params: Vec<Value> = path_params(e.path)
        .into_iter()
        .map(|p| json!({"name": p, "in": "path", "required": true, "schema": name.clone()}))
        .collect();
    params.extend(
        e.query.iter().map(|(n, t, d)| json!({"name": n, "in": "query", "required": false, "description": d, "schema": {"type": t, "minimum": if *t == "integer" { Some(0) } else { None }}})),
    );
    for p in &mut params {
        // A `minimum` of null is not a schema keyword.
        if let Some(schema) = p.pointer_mut("/schema").and_then(Value::as_object_mut) {
            schema.retain(|_, v| !v.is_null());
        }
    }
    let mut responses = Map::new();
    let (status, description, body) = e.ok;
    let content = match body {
        Body::Json(schema) => json!({"application/json": {"schema": schema(g)}}),
        Body::Other(ct) => json!({ct: {"schema": {"type": "string"}}}),
    };
    responses.insert(status.to_string(), json!({"description": description, "content": content}));
    let error_schema = g.subschema_for::<api::ErrorBody>();
    let mut errors: Vec<u16> = e.errors.to_vec();
    if e.auth {
        errors.extend([400, 401]);
    }
    if e.request.is_some() {
        errors.push(400);
    }
    errors.sort_unstable();
    errors.dedup();
    for s in errors {
        let content = if s == 503 && e.path == "/readyz" {
            json!({"application/json": {"schema": g.subschema_for::<api::Readiness>()}})
        } else {
            json!({"application/json": {"schema": error_schema.clone()}})
        };
        responses.insert(s.to_string(), json!({"description": failure(s), "content": content}));
    }
    let mut op = json!({
        "summary": e.summary,
        "operationId": format!("{}{}", e.method, e.path.replace(['/', '{', '}', '.'], "_")),
        "parameters": params,
        "responses": responses,
    });
    if let Some(schema) = e.request {
        op["requestBody"] = json!({"required": true, "content": {"application/json": {"schema": schema(g)}}});
    }
    if !e.auth {
        op["security"] = json!([]);
    }
    op
}

/// The whole document.
pub fn document() -> Value {
    let mut g =
        SchemaSettings::draft2020_12().with(|s| s.definitions_path = "/components/schemas".into()).into_generator();
    let mut paths = Map::new();
    for e in ENDPOINTS {
        let op = operation(e, &mut g);
        let item = paths.entry(e.path.to_string()).or_insert_with(|| json!({}));
        item[e.method] = op;
    }
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "Tidegate admin API",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Routes, services, backends and certificates of a Tidegate proxy, changed at runtime. \
                Every write answers once the change is durable and live. See docs/api.md.",
        },
        "paths": paths,
        "components": {
            "schemas": g.take_definitions(true),
            "securitySchemes": {"token": {"type": "http", "scheme": "bearer", "description": "The admin token (DATA_DIR/admin-token or TIDEGATE_ADMIN_TOKEN)."}},
        },
        "security": [{"token": []}],
    })
}

/// Every `(method, path)` the document lists, for the test against the router.
#[cfg(test)]
pub(crate) fn operations() -> impl Iterator<Item = (&'static str, &'static str)> {
    ENDPOINTS.iter().map(|e| (e.method, e.path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reference_resolves_and_every_schema_has_a_type_or_a_composition() {
        let doc = document();
        let schemas = doc["components"]["schemas"].as_object().expect("schemas");
        assert!(schemas.contains_key("ServiceSpec") && schemas.contains_key("ErrorBody"), "{:?}", schemas.keys());
        let text = doc.to_string();
        for r in text.split("\"$ref\":\"").skip(1) {
            let target = &r[..r.find('"').expect("a closing quote")];
            let name = target.strip_prefix("#/components/schemas/").unwrap_or_else(|| panic!("{target}"));
            assert!(schemas.contains_key(name), "dangling {target}");
        }
    }

    #[test]
    fn path_parameters_are_read_from_the_path() {
        assert_eq!(path_params("/v1/services/{name}/backends/{id}"), ["name", "id"]);
        assert!(path_params("/v1/status").is_empty());
    }
}
