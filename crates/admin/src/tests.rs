//! The API through `tower::ServiceExt::oneshot`: no sockets, a real store
//! in a temporary directory.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use serde_json::{json, Value};
use tower::ServiceExt;

use crate::{openapi, router, AdminState};

const TOKEN: &str = "unit-test-token-0123456789abcdef0123456789";

/// A router over a fresh store; the directory lives as long as the router.
fn app() -> (Router, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let store = tidegate_store::SqliteStore::open(&dir.path().join("config.sqlite")).unwrap();
    let control = tidegate_control::Control::start(Arc::new(store)).unwrap();
    #[derive(Debug)]
    struct Nothing;
    impl crate::Collector for Nothing {
        fn encode(&self, _: tidegate_metrics::DescriptorEncoder<'_>) -> std::fmt::Result {
            Ok(())
        }
    }
    (router(AdminState::new(control, TOKEN, Arc::new(Nothing))), dir)
}

async fn call(app: &Router, method: &str, path: &str, body: Option<Value>, token: bool) -> (StatusCode, Value) {
    let mut req = Request::builder().method(method).uri(path);
    if token {
        req = req.header("authorization", format!("Bearer {TOKEN}"));
    }
    let body = body.map_or_else(Body::empty, |b| Body::from(b.to_string()));
    let res = app.clone().oneshot(req.body(body).unwrap()).await.unwrap();
    let status = res.status();
    let bytes = axum::body::to_bytes(res.into_body(), 1 << 24).await.unwrap();
    (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

#[tokio::test]
async fn every_documented_operation_is_routed() {
    let (app, _dir) = app();
    for (method, path) in openapi::operations() {
        let concrete = path.replace("{name}", "web").replace("{id}", "a");
        if path == "/v1/watch" {
            // A stream that never ends: only its status.
            let req = Request::get(path).header("authorization", format!("Bearer {TOKEN}"));
            let res = app.clone().oneshot(req.body(Body::empty()).unwrap()).await.unwrap();
            assert_eq!(res.status(), StatusCode::OK);
            continue;
        }
        let (status, body) = call(&app, &method.to_uppercase(), &concrete, None, true).await;
        let fallback = body["error"]["message"].as_str().is_some_and(|m| m.contains("no such endpoint"));
        assert!(!fallback && status != StatusCode::METHOD_NOT_ALLOWED, "{method} {path}: {status} {body}");
    }
}

#[tokio::test]
async fn the_document_is_served_without_a_token() {
    let (app, _dir) = app();
    let (status, doc) = call(&app, "GET", "/v1/openapi.json", None, false).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(doc["openapi"], "3.1.0");
    assert!(doc["paths"]["/v1/changes"]["post"]["requestBody"].is_object(), "{doc}");
}

#[tokio::test]
async fn writes_answer_once_live_and_reads_show_them() {
    let (app, _dir) = app();
    let spec = json!({"backends": [{"id": "a", "addr": "127.0.0.1:9001"}]});
    let (status, body) = call(&app, "PUT", "/v1/services/web", Some(spec), true).await;
    assert_eq!((status, body["revision"].as_u64()), (StatusCode::OK, Some(1)), "{body}");
    let (status, body) = call(&app, "GET", "/v1/services/web", None, true).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["spec"]["backends"][0]["addr"], "127.0.0.1:9001", "{body}");
    let (_, status_body) = call(&app, "GET", "/v1/status", None, true).await;
    assert_eq!(status_body["services"]["web"]["backends"][0]["id"], "a", "{status_body}");
}

#[tokio::test]
async fn bad_input_names_the_field_and_changes_nothing() {
    let (app, _dir) = app();
    let spec = json!({"backends": [{"id": "a", "addr": "not an address"}]});
    let (status, body) = call(&app, "PUT", "/v1/services/web", Some(spec), true).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["error"]["field"], "spec.backends[0].addr", "{body}");
    let (status, _) = call(&app, "GET", "/v1/services/web", None, true).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, body) = call(&app, "POST", "/v1/changes?dry_rn=true", Some(json!({"ops": []})), true).await;
    assert_eq!((status, body["error"]["field"].as_str()), (StatusCode::BAD_REQUEST, Some("query.dry_rn")));
    let (status, _) = call(&app, "GET", "/v1/config", None, false).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    // A struct's positional form is no document: `[]` would be a
    // configuration with nothing in it.
    let (status, body) = call(&app, "PUT", "/v1/config?dry_run=true", Some(json!([])), true).await;
    assert_eq!((status, body["error"]["message"].as_str()), (StatusCode::BAD_REQUEST, Some("expected a JSON object")));
}

#[tokio::test]
async fn the_bearer_scheme_is_case_insensitive_and_the_token_is_not() {
    let (app, _dir) = app();
    let get = |auth: String| {
        let app = app.clone();
        async move {
            let req = Request::get("/v1/config").header("authorization", auth);
            app.oneshot(req.body(Body::empty()).unwrap()).await.unwrap().status()
        }
    };
    assert_eq!(get(format!("bearer {TOKEN}")).await, StatusCode::OK);
    assert_eq!(get(format!("BEARER {TOKEN}")).await, StatusCode::OK);
    assert_eq!(get(format!("Bearer {}", TOKEN.to_uppercase())).await, StatusCode::UNAUTHORIZED);
    assert_eq!(get(format!("Basic {TOKEN}")).await, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn a_dry_run_applies_nothing() {
    let (app, _dir) = app();
    let ops = json!({"ops": [{"op": "put_service", "name": "web", "spec": {}}]});
    let (status, body) = call(&app, "POST", "/v1/changes?dry_run=true", Some(ops), true).await;
    assert_eq!((status, body["dry_run"].as_bool(), body["revision"].as_u64()), (StatusCode::OK, Some(true), Some(0)));
    let (_, config) = call(&app, "GET", "/v1/config", None, true).await;
    assert_eq!((config["revision"].as_u64(), config["services"].as_object().map(|m| m.len())), (Some(0), Some(0)));
}
