//! Autoscaling endpoints: the event log and the operator's overrides.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use serde::Deserialize;
use tidegate_control::SubmitError;
use tidegate_model::{parse_json, ChangeSet, Op, ServiceName};

use crate::api::{AutoscaleOverride, Events, Sorted, Written};
use crate::{AdminState, ApiError};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct EventsQuery {
    /// Only events with a higher sequence number.
    #[serde(default)]
    after: u64,
}

/// `GET /v1/events?after=N`: the autoscaler's recent decisions and actions.
pub(crate) async fn get_events(
    State(state): State<AdminState>,
    query: Result<Query<EventsQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Sorted<Events>, ApiError> {
    let Query(q) = query.map_err(|e| ApiError::bad_field("query", e.body_text()))?;
    Ok(Sorted(Events { events: state.events.since(q.after) }))
}

/// `POST /v1/services/{name}/autoscale` with `{"paused": bool}` and/or
/// `{"pinned": N | null}`: changes the service's `autoscale` block (durable,
/// revisioned like any change), keeping everything else, backends included.
pub(crate) async fn post_override(
    State(state): State<AdminState>,
    Path(name): Path<String>,
    bytes: Result<Bytes, BytesRejection>,
) -> Result<Sorted<Written>, ApiError> {
    let name = ServiceName::new(&name).map_err(|e| ApiError::bad_field("path.name", e.to_string()))?;
    let bytes = bytes.map_err(ApiError::body)?;
    let o: AutoscaleOverride = parse_json(&bytes).map_err(|e| ApiError::parse(e, None))?;
    // Read, modify, write with if_revision; retry if something else changed in between.
    for _ in 0..5 {
        let view = state.control.config();
        let Some(spec) = view.state.service(name.as_str()) else {
            return Err(ApiError::not_found(format!("no service {name:?}")));
        };
        let mut spec = (**spec).clone();
        let Some(a) = spec.settings.autoscale.as_mut() else {
            return Err(ApiError::bad_field("path.name", format!("service {name:?} has no autoscale block")));
        };
        if let Some(p) = o.paused {
            a.paused = p;
        }
        if let Some(p) = o.pinned {
            if p.is_some_and(|n| n > a.max || n < a.min) {
                return Err(ApiError::bad_field("pinned", format!("must be within min..=max ({}..={})", a.min, a.max)));
            }
            a.pinned = p;
        }
        let change = ChangeSet {
            if_revision: Some(view.revision),
            ops: vec![Op::PutService { name: name.clone(), spec: Box::new(spec) }],
        };
        match state.control.submit(change).await {
            Ok(revision) => return Ok(Sorted(Written { revision })),
            Err(SubmitError::Rejected(e)) if e.field.as_deref() == Some("if_revision") => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(ApiError::from(SubmitError::Store("the configuration kept changing; try again".into())))
}
