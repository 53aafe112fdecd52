//! Request routing: normal service, health, echo, upgrade and the control API.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;

use crate::app::{json, query_param, text, AppState, Resp};
use crate::upgrade;

/// Prefix of the control API.
pub const CONTROL_PREFIX: &str = "/_emulator/";

/// What a request asks for.
enum Route {
    Serve,
    Health,
    Echo,
    Upgrade,
    Control(String),
}

fn classify(state: &AppState, path: &str) -> Route {
    if let Some(rest) = path.strip_prefix(CONTROL_PREFIX) {
        return Route::Control(rest.to_owned());
    }
    if path == state.health_path {
        return Route::Health;
    }
    match path {
        "/upgrade" => Route::Upgrade,
        p if p.ends_with("/echo") => Route::Echo,
        _ => Route::Serve,
    }
}

/// Answers one request; never fails (errors become HTTP statuses).
pub async fn handle(state: Arc<AppState>, req: Request<Incoming>) -> Result<Resp, Infallible> {
    let mut resp = match classify(&state, req.uri().path()) {
        // `serve` decorates while it still holds its slot.
        Route::Serve => return Ok(serve(&state, req).await),
        Route::Health => health(&state),
        Route::Echo => echo(req).await,
        Route::Upgrade => upgrade::respond(req),
        Route::Control(rest) => control(&state, &rest, &req),
    };
    state.decorate(&mut resp);
    Ok(resp)
}

/// A normal request: take a slot, hold it for the service time, answer 200.
async fn serve(state: &AppState, req: Request<Incoming>) -> Resp {
    let forced =
        query_param(req.uri().query(), "delay_ms").and_then(|v| v.parse::<u64>().ok()).map(Duration::from_millis);
    drain(req.into_body()).await;
    let arrived = std::time::Instant::now();
    let Ok(slot) = state.admission.acquire().await else {
        state.rejected.fetch_add(1, Ordering::Relaxed);
        let mut resp = text(StatusCode::SERVICE_UNAVAILABLE, "queue full\n");
        state.decorate(&mut resp);
        return resp;
    };
    let service = forced.unwrap_or_else(|| state.service.sample(&mut fastrand::Rng::new()));
    if !service.is_zero() {
        tokio::time::sleep(service).await;
    }
    state.served.fetch_add(1, Ordering::Relaxed);
    state.completions.record();
    state.record_latency(arrived.elapsed());
    let mut resp = text(StatusCode::OK, state.body.clone());
    state.decorate(&mut resp);
    drop(slot);
    resp
}

fn health(state: &AppState) -> Resp {
    if state.healthy.load(Ordering::Relaxed) {
        text(StatusCode::OK, "ok")
    } else {
        text(StatusCode::SERVICE_UNAVAILABLE, "down")
    }
}

/// Reads and discards a request body; returns its length.
async fn drain(mut body: Incoming) -> u64 {
    let mut len = 0;
    while let Some(Ok(frame)) = body.frame().await {
        if let Some(data) = frame.data_ref() {
            len += data.len() as u64;
        }
    }
    len
}

/// Describes the request: method, path+query, authority (absolute-form or h2),
/// version, headers and body length.
async fn echo(req: Request<Incoming>) -> Resp {
    let (parts, body) = req.into_parts();
    let path = parts.uri.path_and_query().map_or_else(|| parts.uri.path().to_owned(), |pq| pq.as_str().to_owned());
    let body_bytes = drain(body).await;
    let doc = serde_json::json!({
        "method": parts.method.as_str(),
        "path": path,
        "authority": parts.uri.authority().map(|a| a.as_str()),
        "version": format!("{:?}", parts.version),
        "headers": header_map(&parts.headers),
        "body_bytes": body_bytes,
    });
    json(StatusCode::OK, &doc)
}

/// Header name → all its values joined by ", ".
fn header_map(headers: &HeaderMap) -> BTreeMap<String, String> {
    headers
        .keys()
        .map(|name| {
            let values: Vec<String> =
                headers.get_all(name).iter().map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned()).collect();
            (name.as_str().to_owned(), values.join(", "))
        })
        .collect()
}

/// The control API under `/_emulator/`; never takes a slot.
fn control(state: &AppState, rest: &str, req: &Request<Incoming>) -> Resp {
    let query = req.uri().query();
    match (req.method(), rest) {
        (&Method::GET, "stats") => json(StatusCode::OK, &state.stats()),
        (&Method::POST, "slots") => set_slots(state, query_param(query, "n")),
        (&Method::POST, "health") => set_health(state, query_param(query, "up")),
        (_, "stats" | "slots" | "health") => text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n"),
        _ => text(StatusCode::NOT_FOUND, "unknown control endpoint\n"),
    }
}

fn set_slots(state: &AppState, n: Option<&str>) -> Resp {
    match n.and_then(|v| v.parse::<usize>().ok()) {
        Some(n) => {
            state.admission.set_slots(n);
            json(StatusCode::OK, &state.stats())
        }
        None => text(StatusCode::BAD_REQUEST, "expected ?n=<slots>\n"),
    }
}

fn set_health(state: &AppState, up: Option<&str>) -> Resp {
    let up = match up {
        Some("true" | "1") => true,
        Some("false" | "0") => false,
        _ => return text(StatusCode::BAD_REQUEST, "expected ?up=true|false\n"),
    };
    state.healthy.store(up, Ordering::Relaxed);
    json(StatusCode::OK, &serde_json::json!({ "healthy": up }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn headers_with_repeats_are_joined() {
        let mut headers = HeaderMap::new();
        headers.append("x-multi", HeaderValue::from_static("a"));
        headers.append("x-multi", HeaderValue::from_static("b"));
        headers.insert("x-one", HeaderValue::from_static("1"));
        let map = header_map(&headers);
        assert_eq!(map["x-multi"], "a, b");
        assert_eq!(map["x-one"], "1");
    }

    #[test]
    fn routes_are_classified() {
        let state = AppState::new(&crate::Args::default()).expect("state");
        assert!(matches!(classify(&state, "/"), Route::Serve));
        assert!(matches!(classify(&state, "/health"), Route::Health));
        assert!(matches!(classify(&state, "/echo"), Route::Echo));
        assert!(matches!(classify(&state, "/upgrade"), Route::Upgrade));
        assert!(matches!(classify(&state, "/_emulator/stats"), Route::Control(r) if r == "stats"));
    }
}
