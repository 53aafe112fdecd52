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
    let (state, dir) = state();
    (router(state), dir)
}

/// The state behind [`app`].
fn state() -> (AdminState, tempfile::TempDir) {
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
    (AdminState::new(control, TOKEN, Arc::new(Nothing)), dir)
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

async fn open_watch(app: &Router, from: u64) -> axum::response::Response {
    let req = Request::get(format!("/v1/watch?from={from}")).header("authorization", format!("Bearer {TOKEN}"));
    app.clone().oneshot(req.body(Body::empty()).unwrap()).await.unwrap()
}

#[tokio::test]
async fn replays_beyond_the_limit_get_503_with_retry_after() {
    let (state, _dir) = state();
    let limits = tidegate_control::WatchLimits {
        queue_bytes: 64 * 1024,
        max_replays: 1,
        stall: std::time::Duration::from_secs(60),
    };
    let app = router(state.with_watch_limits(limits));
    for i in 0..3 {
        let (status, _) = call(&app, "PUT", &format!("/v1/services/s{i}"), Some(json!({})), true).await;
        assert_eq!(status, StatusCode::OK);
    }
    // Held open, unread: it keeps its replay slot.
    let first = open_watch(&app, 0).await;
    assert_eq!(first.status(), StatusCode::OK);
    let second = open_watch(&app, 1).await;
    assert_eq!(second.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(second.headers()["retry-after"], "1");
    let body = axum::body::to_bytes(second.into_body(), 1 << 20).await.unwrap();
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert!(body["error"]["message"].as_str().unwrap().contains("replay history"), "{body}");
    // Watching only new changes replays nothing: never refused.
    assert_eq!(open_watch(&app, 3).await.status(), StatusCode::OK);
    let (_, metrics) = (StatusCode::OK, metrics_text(&app).await);
    assert!(metrics.contains("tidegate_watch_refused_total 1"), "{metrics}");
    assert!(metrics.contains("tidegate_watch_replays 1"), "{metrics}");
    drop(first);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while open_watch(&app, 0).await.status() != StatusCode::OK {
        assert!(std::time::Instant::now() < deadline, "the slot never came back");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_watch_resumes_after_its_last_event_id() {
    let (app, _dir) = app();
    for i in 0..3 {
        let (status, _) = call(&app, "PUT", &format!("/v1/services/s{i}"), Some(json!({})), true).await;
        assert_eq!(status, StatusCode::OK);
    }
    let watch = |last: &'static str| {
        let app = app.clone();
        async move {
            let req = Request::get("/v1/watch?from=0")
                .header("authorization", format!("Bearer {TOKEN}"))
                .header("last-event-id", last);
            app.oneshot(req.body(Body::empty()).unwrap()).await.unwrap()
        }
    };
    // Revisions 1 to 3 exist; a client that got 2 is sent 3 first.
    let resp = watch("2").await;
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body().into_data_stream();
    let first = futures_util::StreamExt::next(&mut body).await.unwrap().unwrap();
    let text = String::from_utf8_lossy(&first);
    assert!(text.starts_with("id: 3\n"), "{text}");
    let bad = watch("two").await;
    assert_eq!(bad.status(), StatusCode::BAD_REQUEST);
    let body: Value = serde_json::from_slice(&axum::body::to_bytes(bad.into_body(), 1 << 20).await.unwrap()).unwrap();
    assert_eq!(body["error"]["field"], "header.last-event-id", "{body}");
}

async fn metrics_text(app: &Router) -> String {
    let req = Request::get("/metrics").header("authorization", format!("Bearer {TOKEN}"));
    let res = app.clone().oneshot(req.body(Body::empty()).unwrap()).await.unwrap();
    String::from_utf8(axum::body::to_bytes(res.into_body(), 1 << 24).await.unwrap().to_vec()).unwrap()
}

#[tokio::test]
async fn static_roots_that_lead_to_system_or_private_directories_are_refused() {
    let (state, dir) = state();
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let app = router(state.with_private_dir(&data));
    let www = dir.path().join("www");
    std::fs::create_dir(&www).unwrap();
    let up = dir.path().join("up");
    std::os::unix::fs::symlink("/", &up).unwrap();
    let route = |root: &std::path::Path| json!({"static": {"root": root}});
    let (status, body) = call(&app, "PUT", "/v1/routes/ok", Some(route(&www)), true).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    for (root, why) in [
        (up.clone(), "filesystem root"),
        (data.clone(), "data directory"),
        (dir.path().to_path_buf(), "data directory"),
        (dir.path().join("missing"), "cannot be resolved"),
    ] {
        let (status, body) = call(&app, "PUT", "/v1/routes/bad", Some(route(&root)), true).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{root:?}: {body}");
        assert_eq!(body["error"]["field"], "spec.static.root", "{body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.starts_with("static.root: ") && message.contains(why), "{message}");
    }
    let ops = json!({"ops": [{"op": "put_route", "name": "ok2", "spec": route(&www)},
                             {"op": "put_route", "name": "bad", "spec": route(&up)}]});
    let (status, body) = call(&app, "POST", "/v1/changes?dry_run=true", Some(ops), true).await;
    assert_eq!((status, body["error"]["field"].as_str()), (StatusCode::BAD_REQUEST, Some("ops[1].spec.static.root")));
    let doc = json!({"routes": {"ok": route(&www), "bad": route(&up)}});
    let (status, body) = call(&app, "PUT", "/v1/config", Some(doc), true).await;
    assert_eq!((status, body["error"]["field"].as_str()), (StatusCode::BAD_REQUEST, Some("routes.bad.static.root")));
    let (_, config) = call(&app, "GET", "/v1/config", None, true).await;
    assert_eq!(config["routes"].as_object().map(|r| r.len()), Some(1), "{config}");
}
