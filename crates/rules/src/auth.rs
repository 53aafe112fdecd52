//! Basic auth (password checks, done off the request thread) and forward
//! auth (a sub-request the proxy makes).

use std::time::Duration;

use base64::Engine;
use http::{HeaderName, HeaderValue};
use tidegate_model::rules::{BasicAuth, ForwardAuth, HashKind, PasswordHash};

/// A password to check against a user's hash: bcrypt or argon2, slow on
/// purpose (tens to hundreds of milliseconds): the proxy runs
/// [`PasswordCheck::verify`] on a blocking thread.
pub struct PasswordCheck {
    pub(crate) password: Vec<u8>,
    /// The user's hash; for an unknown user, a hash of the same kind that
    /// no password matches, so the answer takes as long.
    pub(crate) hash: PasswordHash,
    pub(crate) known: bool,
}

impl std::fmt::Debug for PasswordCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PasswordCheck").finish_non_exhaustive()
    }
}

impl PasswordCheck {
    /// Whether the password matches (constant time in the hash compare,
    /// as both crates do it); false for an unknown user.
    pub fn verify(&self) -> bool {
        let ok = match self.hash.kind() {
            HashKind::Bcrypt => bcrypt::verify(&self.password, self.hash.expose()).unwrap_or(false),
            HashKind::Argon2 => {
                use argon2::PasswordVerifier;
                match argon2::PasswordHash::new(self.hash.expose()) {
                    Ok(parsed) => argon2::Argon2::default().verify_password(&self.password, &parsed).is_ok(),
                    Err(_) => false,
                }
            }
            HashKind::Placeholder => false,
        };
        ok && self.known
    }
}

/// A bcrypt hash of cost 10 that matches no password known: checked for
/// an unknown user, so the answer does not tell which users exist.
const DECOY: &str = "$2b$10$abcdefghijklmnopqrstuu5Uy.fJXoQq1xD1Ygcj8N3OCUKvEJyMC";

/// The credentials of a request, checked against the step's users.
pub(crate) fn basic_check(step: &BasicAuth, authorization: Option<&[u8]>) -> Option<PasswordCheck> {
    let value = authorization?;
    let (scheme, rest) = split_scheme(value)?;
    if !scheme.eq_ignore_ascii_case(b"basic") {
        return None;
    }
    let decoded = base64::engine::general_purpose::STANDARD.decode(rest.trim_ascii()).ok()?;
    let colon = decoded.iter().position(|b| *b == b':')?;
    let (user, password) = (&decoded[..colon], &decoded[colon + 1..]);
    let found = step.users.iter().find(|u| u.name.as_bytes() == user);
    let decoy = || PasswordHash::try_from(DECOY.to_string()).ok();
    let hash = match found {
        Some(u) => u.hash.clone(),
        None => decoy()?,
    };
    Some(PasswordCheck { password: password.to_vec(), hash, known: found.is_some() })
}

fn split_scheme(v: &[u8]) -> Option<(&[u8], &[u8])> {
    let sp = v.iter().position(|b| *b == b' ')?;
    Some((&v[..sp], &v[sp + 1..]))
}

/// The `WWW-Authenticate` value of a realm.
pub(crate) fn challenge(realm: &str) -> HeaderValue {
    HeaderValue::from_str(&format!("Basic realm=\"{realm}\", charset=\"UTF-8\""))
        .unwrap_or_else(|_| HeaderValue::from_static("Basic"))
}

/// The sub-request of a `forward_auth` step, for the proxy to make: `GET`
/// to `authority` (`host:port`) for `path_and_query`, with `headers`,
/// within `timeout`. No answer in time, or none at all, refuses the
/// request ([`crate::Chain::auth_failed`]): never let through.
#[derive(Debug, Clone)]
pub struct AuthRequest {
    /// `host:port` to connect to.
    pub authority: String,
    /// The request target.
    pub path_and_query: String,
    /// Header fields to send: the chosen request headers, then
    /// `X-Forwarded-Method`, `-Proto`, `-Host`, `-Uri` and `-For`.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// How long to wait for the answer's head.
    pub timeout: Duration,
}

/// The answer of an auth service, as the proxy read it.
#[derive(Debug, Clone)]
pub struct AuthAnswer {
    /// Its status.
    pub status: u16,
    /// Its header fields (those of its connection and framing left out).
    pub headers: http::HeaderMap,
    /// Its body, for a refusal (empty for a 2xx, which is not read): the
    /// answer's body when [`crate::Answer::relay_auth_body`] says so.
    pub body: bytes::Bytes,
}

/// Answer headers given to the client when the auth service refuses.
pub(crate) const RELAYED: [&str; 4] = ["www-authenticate", "location", "set-cookie", "content-type"];

pub(crate) fn forward_request(step: &ForwardAuth, req: &crate::RequestView<'_>, path: &str) -> AuthRequest {
    let mut headers = Vec::new();
    for name in &step.request_headers {
        req.headers.each(&mut |n, v| {
            if n.eq_ignore_ascii_case(name.0.as_str()) {
                if let Ok(v) = HeaderValue::from_bytes(v) {
                    headers.push((name.0.clone(), v));
                }
            }
        });
    }
    let uri = match req.query {
        Some(q) => format!("{path}?{q}"),
        None => path.to_string(),
    };
    let fwd = [
        ("x-forwarded-method", req.method.as_str().to_string()),
        ("x-forwarded-proto", if req.tls { "https" } else { "http" }.to_string()),
        ("x-forwarded-host", req.host.to_string()),
        ("x-forwarded-uri", uri),
        ("x-forwarded-for", req.client.to_string()),
    ];
    for (n, v) in fwd {
        if let Ok(v) = HeaderValue::from_str(&v) {
            headers.push((HeaderName::from_static(n), v));
        }
    }
    AuthRequest {
        authority: step.url.authority.clone(),
        path_and_query: step.url.path_and_query.clone(),
        headers,
        timeout: Duration::from_millis(u64::from(step.timeout_ms.get())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(hash: &str) -> BasicAuth {
        serde_json::from_value(serde_json::json!({"realm": "r", "users": [{"name": "u", "hash": hash}]})).unwrap()
    }

    fn basic(user_pass: &str) -> Vec<u8> {
        format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(user_pass)).into_bytes()
    }

    #[test]
    fn bcrypt_and_argon2_hashes_check_passwords() {
        let bcrypt_hash =
            bcrypt::hash_with_salt("s3cret", 4, [7u8; 16]).unwrap().format_for_version(bcrypt::Version::TwoB);
        let s = step(&bcrypt_hash);
        assert!(basic_check(&s, Some(&basic("u:s3cret"))).unwrap().verify());
        assert!(!basic_check(&s, Some(&basic("u:wrong"))).unwrap().verify());
        assert!(!basic_check(&s, Some(&basic("nobody:s3cret"))).unwrap().verify());
        assert!(basic_check(&s, Some(b"Bearer x")).is_none());
        assert!(basic_check(&s, Some(b"Basic !!!")).is_none());
        assert!(basic_check(&s, None).is_none());

        use argon2::PasswordHasher;
        let salt = argon2::password_hash::SaltString::encode_b64(b"saltsaltsalt").unwrap();
        let a = argon2::Argon2::default().hash_password(b"s3cret", &salt).unwrap().to_string();
        let s = step(&a);
        assert!(basic_check(&s, Some(&basic("u:s3cret"))).unwrap().verify());
        assert!(!basic_check(&s, Some(&basic("u:s3cre"))).unwrap().verify());
    }

    #[test]
    fn the_decoy_is_a_hash() {
        assert!(PasswordHash::try_from(DECOY.to_string()).is_ok());
    }
}
