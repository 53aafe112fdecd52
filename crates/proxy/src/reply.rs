//! The answers the proxy writes itself, on every engine: short plain-text
//! responses for errors and refusals, health checks and redirects.

use http::header::{self, HeaderValue};
use http::{Response, StatusCode};

use crate::body::ProxyBody;
use crate::error::ErrorKind;
use crate::pipeline::Local;

/// The response a client gets for a request that failed with `kind`.
pub(crate) fn error(kind: ErrorKind) -> Response<ProxyBody> {
    let (status, text) = kind.answer();
    let mut resp = plain(status, text);
    if kind.client_over_its_share() {
        resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    resp
}

/// The answer to a request head over `--max-header-bytes` or
/// `--max-headers`, on either engine.
pub(crate) fn head_too_large() -> Response<ProxyBody> {
    plain(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE, "431 the request head is too large\n")
}

/// A plain-text response.
pub(crate) fn plain(status: StatusCode, text: &'static str) -> Response<ProxyBody> {
    let mut resp = Response::new(ProxyBody::text(text));
    *resp.status_mut() = status;
    resp.headers_mut().insert(header::CONTENT_TYPE, header::HeaderValue::from_static("text/plain; charset=utf-8"));
    resp
}

/// The answer to a `CONNECT` request: `405 Method Not Allowed`. The proxy
/// opens no tunnels to arbitrary hosts, and a backend's 2xx to `CONNECT`
/// would start a tunnel that a response framed as usual cannot describe
/// (RFC 9110, section 9.3.6; nginx refuses it too).
pub(crate) fn refuse_connect() -> Response<ProxyBody> {
    let mut resp = plain(StatusCode::METHOD_NOT_ALLOWED, "405 CONNECT is not supported here\n");
    resp.headers_mut().insert(header::ALLOW, HeaderValue::from_static("GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS"));
    resp
}

/// The answer of a `redirect_https` route to a request that came over
/// plain HTTP: `308 Permanent Redirect` (the method and body are kept by
/// the client) to `location` ([`crate::pipeline`] builds it).
pub(crate) fn https_redirect(location: HeaderValue) -> Response<ProxyBody> {
    let mut resp = plain(StatusCode::PERMANENT_REDIRECT, "308 this route is served over HTTPS\n");
    resp.headers_mut().insert(header::LOCATION, location);
    resp
}

/// The response to a local answer of the pipeline; a refusal counted as an
/// error is the `Err`.
pub(crate) fn local_response(answer: Local) -> Result<Response<ProxyBody>, ErrorKind> {
    Ok(match answer {
        Local::Health { draining: false } => plain(StatusCode::OK, "ok\n"),
        Local::Health { draining: true } => plain(StatusCode::SERVICE_UNAVAILABLE, "draining\n"),
        Local::ConnectRefused => refuse_connect(),
        Local::AcmeChallenge(key_authorization) => {
            let mut resp = Response::new(ProxyBody::text(bytes::Bytes::copy_from_slice(key_authorization.as_bytes())));
            resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
            resp
        }
        Local::ClientCertRequired => {
            plain(StatusCode::FORBIDDEN, "403 this route requires a verified client certificate\n")
        }
        Local::HeadTooLarge => head_too_large(),
        Local::HttpsRedirect(location) => https_redirect(location),
        Local::Rule(answer) => rule_answer(&answer.answer, answer.body),
        Local::Error(kind) => return Err(kind),
    })
}

/// The answer of a rule step: its status, its fields (`Location`,
/// `WWW-Authenticate`, `Retry-After`, CORS's) and a short text, or the
/// body an auth service refused with (`relayed`, with its own fields).
fn rule_answer(answer: &tidegate_rules::Answer, relayed: Option<bytes::Bytes>) -> Response<ProxyBody> {
    let status = StatusCode::from_u16(answer.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let bodiless = status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED;
    let mut resp = if let Some(body) = relayed.filter(|_| !bodiless) {
        let mut resp = Response::new(ProxyBody::text(body));
        *resp.status_mut() = status;
        resp
    } else if answer.body.is_empty() || bodiless {
        let mut resp = Response::new(ProxyBody::empty());
        *resp.status_mut() = status;
        resp
    } else {
        plain(status, answer.body)
    };
    for (name, value) in &answer.headers {
        resp.headers_mut().append(name.clone(), value.clone());
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_local_answer_has_its_status_and_fields() {
        let status = |l| local_response(l).map(|r| r.status().as_u16());
        assert_eq!(status(Local::Health { draining: false }), Ok(200));
        assert_eq!(status(Local::Health { draining: true }), Ok(503));
        assert_eq!(status(Local::HeadTooLarge), Ok(431));
        assert_eq!(status(Local::Error(ErrorKind::NoRoute)), Err(ErrorKind::NoRoute));
        let connect = local_response(Local::ConnectRefused).unwrap();
        assert_eq!(connect.status(), StatusCode::METHOD_NOT_ALLOWED);
        assert!(connect.headers().contains_key(header::ALLOW));
        let to = HeaderValue::from_static("https://a.example/x");
        let redirect = local_response(Local::HttpsRedirect(to.clone())).unwrap();
        assert_eq!(redirect.status(), StatusCode::PERMANENT_REDIRECT);
        assert_eq!(redirect.headers()[header::LOCATION], to);
    }

    #[test]
    fn error_answers_are_plain_text_and_a_client_over_its_cap_may_retry() {
        let resp = error(ErrorKind::ClientLimit);
        assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(resp.headers()[header::RETRY_AFTER], "1");
        assert_eq!(resp.headers()[header::CONTENT_TYPE], "text/plain; charset=utf-8");
        assert_eq!(error(ErrorKind::ClientRate).headers()[header::RETRY_AFTER], "1");
        assert!(!error(ErrorKind::NoBackend).headers().contains_key(header::RETRY_AFTER));
    }
}
