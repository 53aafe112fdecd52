//! `GET /v1/watch?from=REV`: applied change sets as server-sent events.
//!
//! Each event's `id` is its revision, so a client that reconnects with
//! `Last-Event-ID` (as a browser's `EventSource` does by itself) resumes
//! after the last change set it got, whatever `from` its URL says.
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
    headers: axum::http::HeaderMap,
    query: Result<Query<WatchQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(q) = query.map_err(|e| ApiError::bad_field("query", e.body_text()))?;
    let current = state.control.config().revision;
    let from = start_from(q.from, last_event_id(&headers)?, current);
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

/// The `Last-Event-ID` a reconnecting client sends: the revision of the
/// last change set it got.
fn last_event_id(headers: &axum::http::HeaderMap) -> Result<Option<u64>, ApiError> {
    let Some(value) = headers.get("last-event-id") else { return Ok(None) };
    let id = value.to_str().ok().map(str::trim).filter(|v| !v.is_empty());
    match id.map(str::parse::<u64>) {
        None => Ok(None),
        Some(Ok(revision)) => Ok(Some(revision)),
        Some(Err(_)) => Err(ApiError::bad_field("header.last-event-id", "must be a revision (a whole number)")),
    }
}

/// The revision to stream after: the later of `from` and the last event
/// the client got; the current revision when neither is given.
fn start_from(from: Option<u64>, last_event: Option<u64>, current: u64) -> u64 {
    match (from, last_event) {
        (Some(f), Some(l)) => f.max(l),
        (Some(r), None) | (None, Some(r)) => r,
        (None, None) => current,
    }
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

    #[test]
    fn a_reconnecting_client_resumes_after_its_last_event() {
        assert_eq!(start_from(None, None, 9), 9, "new changes only");
        assert_eq!(start_from(Some(0), None, 9), 0);
        assert_eq!(start_from(None, Some(4), 9), 4);
        assert_eq!(start_from(Some(0), Some(4), 9), 4, "the URL's from is where it began, not where it is");
        assert_eq!(start_from(Some(6), Some(4), 9), 6);
    }
}
