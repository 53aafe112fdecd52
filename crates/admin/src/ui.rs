//! The dashboard at `/ui/`: one page, its script and its style sheet,
//! compiled into the binary (no CDN, nothing fetched from elsewhere). The
//! page itself holds no data and needs no token; its script asks for the
//! token (or takes it from the URL fragment `#token=...`) and reads the
//! same API as everyone else.

use axum::http::header::{CACHE_CONTROL, CONTENT_SECURITY_POLICY, CONTENT_TYPE, LOCATION, REFERRER_POLICY};
use axum::http::{HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

const INDEX: &str = include_str!("ui/index.html");
const SCRIPT: &str = include_str!("ui/app.js");
const STYLE: &str = include_str!("ui/style.css");

/// Only this origin's script, style and API; no framing, no inline code.
const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
                      img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (CONTENT_TYPE, content_type),
            (CACHE_CONTROL, "no-cache"),
            (CONTENT_SECURITY_POLICY, POLICY),
            (REFERRER_POLICY, "no-referrer"),
            (HeaderName::from_static("x-content-type-options"), "nosniff"),
            (HeaderName::from_static("x-frame-options"), "DENY"),
        ],
        body,
    )
        .into_response()
}

/// The dashboard's routes (no token needed: they serve no data).
pub(crate) fn router<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route("/ui", get(|| async { (StatusCode::PERMANENT_REDIRECT, [(LOCATION, "/ui/")]) }))
        .route("/ui/", get(|| async { asset("text/html; charset=utf-8", INDEX) }))
        .route("/ui/app.js", get(|| async { asset("text/javascript; charset=utf-8", SCRIPT) }))
        .route("/ui/style.css", get(|| async { asset("text/css; charset=utf-8", STYLE) }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use tower::ServiceExt;

    async fn fetch(path: &str) -> (StatusCode, String, String) {
        let app: Router = router();
        let res = app.oneshot(Request::get(path).body(Body::empty()).unwrap()).await.unwrap();
        let status = res.status();
        let ct = res.headers().get(CONTENT_TYPE).map(|v| v.to_str().unwrap().to_string()).unwrap_or_default();
        let body = axum::body::to_bytes(res.into_body(), 1 << 20).await.unwrap();
        (status, ct, String::from_utf8(body.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn the_page_and_its_assets_are_served_without_a_token() {
        let (status, ct, body) = fetch("/ui/").await;
        assert_eq!(status, StatusCode::OK);
        assert!(ct.starts_with("text/html"), "{ct}");
        assert!(body.contains(r#"<script src="app.js" defer>"#), "{body}");
        let (status, ct, body) = fetch("/ui/app.js").await;
        assert_eq!((status, ct.starts_with("text/javascript")), (StatusCode::OK, true));
        assert!(body.contains("/v1/status"));
        assert_eq!(fetch("/ui/style.css").await.0, StatusCode::OK);
        assert_eq!(fetch("/ui").await.0, StatusCode::PERMANENT_REDIRECT);
    }

    #[test]
    fn the_page_loads_nothing_from_elsewhere() {
        for text in [INDEX, SCRIPT, STYLE] {
            assert!(!text.contains("http://") || text.contains("http://www.w3.org/2000/svg"), "an external address");
            assert!(!text.contains("https://"), "an external address");
        }
        // Values from the API are written as text, never parsed as markup.
        assert!(!SCRIPT.contains("innerHTML"));
    }
}
