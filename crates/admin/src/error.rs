//! API errors: a status and a JSON body naming what is wrong.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use tidegate_control::SubmitError;
use tidegate_model::{ChangeErrorKind, ParseError};

/// An error answer: `{"error": {"message", "op"?, "field"?}, "status"}`.
#[derive(Debug, Serialize)]
pub struct ApiError {
    #[serde(skip)]
    status: StatusCode,
    message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    op: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    field: Option<String>,
    /// Seconds after which the request may be sent again (`Retry-After`).
    #[serde(skip)]
    retry_after: Option<u64>,
}

#[derive(Serialize)]
struct Envelope<'a> {
    error: &'a ApiError,
    status: u16,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into(), op: None, field: None, retry_after: None }
    }

    /// 500: a bug (an answer that did not serialize).
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    /// 404.
    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, message)
    }

    /// 409 with no field at fault.
    pub fn conflict(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::CONFLICT, message)
    }

    /// 503 with no field at fault.
    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, message)
    }

    /// 405.
    pub fn method_not_allowed() -> ApiError {
        ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "this endpoint does not take that method")
    }

    /// 413.
    pub fn too_large() -> ApiError {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("request body over the limit of {} bytes; split the batch", crate::BODY_LIMIT),
        )
    }

    /// 401.
    pub fn unauthorized() -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, "missing or wrong admin token; send `Authorization: Bearer <token>`")
    }

    /// 400 naming a field.
    pub fn bad_field(field: &str, message: impl Into<String>) -> ApiError {
        let mut e = ApiError::new(StatusCode::BAD_REQUEST, message);
        e.field = Some(field.to_string());
        e
    }

    /// 400 from a body that did not parse; `prefix` locates the body within
    /// the equivalent change set (such as `ops[0].spec`).
    pub fn parse(e: ParseError, prefix: Option<&str>) -> ApiError {
        let field = match prefix {
            Some(p) if e.field == "." => p.to_string(),
            Some(p) => format!("{p}.{}", e.field),
            None => e.field,
        };
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: e.message,
            op: e.op,
            field: Some(field),
            retry_after: None,
        }
    }

    /// 413, 400 or 415 for a body that could not be read.
    pub fn body(rejection: axum::extract::rejection::BytesRejection) -> ApiError {
        ApiError::new(rejection.status(), rejection.body_text())
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> ApiError {
        match e {
            SubmitError::Rejected(c) => ApiError {
                status: match c.kind {
                    ChangeErrorKind::NotFound => StatusCode::NOT_FOUND,
                    ChangeErrorKind::Conflict => StatusCode::CONFLICT,
                },
                message: c.message,
                op: c.op,
                field: c.field,
                retry_after: None,
            },
            SubmitError::Store(m) | SubmitError::Unavailable(m) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, m),
            SubmitError::TooLarge(m) => ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, m),
            SubmitError::HandedOver => {
                let mut e = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, SubmitError::HandedOver.to_string());
                e.retry_after = Some(1);
                e
            }
            SubmitError::Closed => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "the configuration writer stopped before answering (shutting down, or it failed: see the logs)",
            ),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = Json(Envelope { error: &self, status: self.status.as_u16() });
        let mut response = (self.status, body).into_response();
        if let Some(secs) = self.retry_after {
            response.headers_mut().insert(axum::http::header::RETRY_AFTER, axum::http::HeaderValue::from(secs));
        }
        response
    }
}
