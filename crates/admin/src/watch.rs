//! `GET /v1/watch?from=REV`: applied change sets as server-sent events.
//!
//! Each watcher's queue, its replay of history and the number of replays
//! at once are bounded (see [`tidegate_control::Watchers`]): a replay
//! beyond the limit is answered `503` with `Retry-After`, and a watcher
//! that falls behind gets a last `event: lagged` naming the revision to
//! watch again from, then the stream ends.

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use axum::http::HeaderValue;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;
use tidegate_control::{AppliedChange, WatchError, WatchItem};

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

/// How long a watcher refused for too many replays is asked to wait, s.
const RETRY_AFTER_S: u64 = 1;

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
    let watch = match state.control.watch(&state.watchers, from, change_event) {
        Ok(w) => w,
        Err(e @ WatchError::Busy { .. }) => {
            let mut resp = ApiError::unavailable(e.to_string()).into_response();
            resp.headers_mut().insert(RETRY_AFTER, HeaderValue::from(RETRY_AFTER_S));
            return Ok(resp);
        }
        Err(e) => return Err(ApiError::unavailable(e.to_string())),
    };
    let stream = futures_util::stream::unfold(Some(watch), |watch| async move {
        let mut watch = watch?;
        let event = match tokio::time::timeout(KEEPALIVE, watch.next()).await {
            Err(_) => ": keep-alive\n\n".to_string(),
            Ok(None) => return None,
            Ok(Some(WatchItem::Event(text))) => text,
            Ok(Some(WatchItem::End(e))) => {
                return Some((Ok::<_, std::convert::Infallible>(Bytes::from(end_event(&e))), None));
            }
        };
        Some((Ok(Bytes::from(event)), Some(watch)))
    });
    Ok(([(CONTENT_TYPE, "text/event-stream"), (CACHE_CONTROL, "no-cache")], Body::from_stream(stream)).into_response())
}

/// `event: change`, with the change set's secrets redacted (they never
/// leave through the stream).
fn change_event(change: &AppliedChange) -> String {
    let shown = json!({ "revision": change.revision, "change": change.change.redacted() });
    let data = serde_json::to_string(&shown).unwrap_or_default();
    format!("id: {}\nevent: change\ndata: {data}\n\n", change.revision)
}

/// The stream's last event: `event: lagged` with `resume_from` for a
/// watcher that fell behind, `event: error` otherwise.
fn end_event(e: &WatchError) -> String {
    match e {
        WatchError::Lagged { resume_from, .. } => {
            let data = json!({ "error": e.to_string(), "resume_from": resume_from });
            format!("event: lagged\ndata: {data}\n\n")
        }
        _ => {
            let data = json!({ "error": e.to_string() });
            format!("event: error\ndata: {data}\n\n")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lagged_event_names_the_revision_to_resume_from() {
        let e = WatchError::Lagged { resume_from: 42, cause: "slow".into() };
        let text = end_event(&e);
        let (head, data) = text.split_once("\ndata: ").unwrap();
        assert_eq!(head, "event: lagged");
        assert!(text.ends_with("\n\n"));
        let v: serde_json::Value = serde_json::from_str(data.trim_end()).unwrap();
        assert_eq!(v["resume_from"], 42);
        assert!(v["error"].as_str().unwrap().contains("?from=42"), "{v}");
        let text = end_event(&WatchError::Compacted { oldest: 7 });
        assert!(text.starts_with("event: error\ndata: {"), "{text}");
    }
}
