//! `GET /v1/watch?from=REV`: applied change sets as server-sent events.

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;

use crate::{AdminState, ApiError};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct WatchQuery {
    /// Stream change sets with revisions above this one (default: the
    /// current revision, so only new changes).
    from: Option<u64>,
}

/// How often an idle stream sends a comment, so proxies keep it open.
const KEEPALIVE: Duration = Duration::from_secs(15);

pub(crate) async fn get_watch(
    State(state): State<AdminState>,
    query: Result<Query<WatchQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(q) = query.map_err(|e| ApiError::bad_field("query", e.body_text()))?;
    let current = state.control.config().revision;
    let from = q.from.unwrap_or(current);
    if from > current {
        return Err(ApiError::bad_field(
            "query.from",
            format!("revision {from} is in the future (current is {current})"),
        ));
    }
    let rx = state.control.watch(from);
    let stream = futures_util::stream::unfold(Some(rx), |rx| async move {
        let mut rx = rx?;
        let event = match tokio::time::timeout(KEEPALIVE, rx.recv()).await {
            Err(_) => ": keep-alive\n\n".to_string(),
            Ok(None) => return None,
            Ok(Some(Ok(change))) => {
                // Secrets never leave through the stream.
                let shown = json!({ "revision": change.revision, "change": change.change.redacted() });
                let data = serde_json::to_string(&shown).unwrap_or_default();
                format!("id: {}\nevent: change\ndata: {data}\n\n", change.revision)
            }
            Ok(Some(Err(e))) => {
                let data = json!({ "error": e.to_string() });
                let text = format!("event: error\ndata: {data}\n\n");
                return Some((Ok::<_, std::convert::Infallible>(Bytes::from(text)), None));
            }
        };
        Some((Ok(Bytes::from(event)), Some(rx)))
    });
    Ok(([(CONTENT_TYPE, "text/event-stream"), (CACHE_CONTROL, "no-cache")], Body::from_stream(stream)).into_response())
}
