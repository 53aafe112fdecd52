//! Why a value is refused: the field at fault and a typed reason.
//!
//! Every check of the model (the `validate()` of a service's settings, the
//! wire conversions of routes, certificates and ranged numbers, the checks
//! of a certificate coming in) returns an [`Invalid`]. Code that reports a
//! refusal reads its [`Invalid::field`] to name the field (the admin API's
//! `field`, a change set's `ops[N].spec...`) and shows the reason; nothing
//! parses the text back. Where serde decodes a value, the error becomes
//! text (serde's errors carry only a message): that is the edge, and
//! [`crate::ParseError`] takes the field back from the decode's path.

use std::fmt;

/// A value the model refuses: which field, and why.
///
/// Shown as `field: reason` (`timeouts.connect_ms: must be 1..=86400000,
/// got 0`), or the reason alone for a value refused as a whole.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct Invalid {
    /// Path of the field at fault from the value checked, such as
    /// `timeouts.connect_ms` or `upstream.tls.ca_pem`; empty when the
    /// value is refused as a whole (a ranged number decoded on its own,
    /// whose field the decode's path names).
    pub field: String,
    /// Why it is refused.
    pub reason: Reason,
}

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.field.is_empty() {
            true => write!(f, "{}", self.reason),
            false => write!(f, "{}: {}", self.field, self.reason),
        }
    }
}

impl Invalid {
    /// `field` is refused for `reason`.
    pub fn new(field: impl Into<String>, reason: Reason) -> Invalid {
        Invalid { field: field.into(), reason }
    }

    /// `field` is outside `range` (as the docs write it: `1..=1000`,
    /// `above 0`), `value` being the one given.
    pub fn range(field: impl Into<String>, range: impl Into<String>, value: impl fmt::Display) -> Invalid {
        Invalid::new(field, Reason::OutOfRange { name: None, range: range.into(), value: Some(value.to_string()) })
    }

    /// `field` is outside `range`; the value is not repeated.
    pub fn range_only(field: impl Into<String>, range: impl Into<String>) -> Invalid {
        Invalid::new(field, Reason::OutOfRange { name: None, range: range.into(), value: None })
    }

    /// `field` is above `max`, `value` being the one given (`None`: not
    /// repeated).
    pub fn too_large(field: impl Into<String>, max: impl Into<String>, value: Option<String>) -> Invalid {
        Invalid::new(field, Reason::TooLarge { max: max.into(), value })
    }

    /// `field` holds `value` (as shown, quoted for text), which is not of
    /// the form it must have: `expected` says it of the value.
    pub fn malformed(field: impl Into<String>, value: impl Into<String>, expected: impl Into<String>) -> Invalid {
        Invalid::new(field, Reason::Malformed { value: Some(value.into()), expected: expected.into() })
    }

    /// `field` is not of the form it must have, the value not shown (a
    /// PEM block, a key).
    pub fn unreadable(field: impl Into<String>, expected: impl Into<String>) -> Invalid {
        Invalid::new(field, Reason::Malformed { value: None, expected: expected.into() })
    }

    /// `field` contradicts the field `with`, as `message` says.
    pub fn conflict(field: impl Into<String>, with: impl Into<String>, message: impl Into<String>) -> Invalid {
        Invalid::new(field, Reason::Conflict { with: with.into(), message: message.into() })
    }

    /// `field` breaks a rule that spans several settings, stated in words.
    pub fn rule(field: impl Into<String>, message: impl Into<String>) -> Invalid {
        Invalid::new(field, Reason::Rule(message.into()))
    }

    /// The same refusal, its field seen from a value holding this one
    /// under `prefix` (`upstream.tls` + `ca_pem`).
    pub fn under(mut self, prefix: &str) -> Invalid {
        self.field = match (prefix.is_empty(), self.field.is_empty()) {
            (true, _) => self.field,
            (false, true) => prefix.to_string(),
            (false, false) => format!("{prefix}.{}", self.field),
        };
        self
    }
}

/// Why a field is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Reason {
    /// A number outside the values it may take: `must be {range}, got
    /// {value}`.
    #[error("{}must be {range}{}", named(.name), got(.value))]
    OutOfRange {
        /// The number's name, when the message says it (`max_conns must
        /// be ...`): a number decoded on its own, whose field the path
        /// of the decode may not reach.
        name: Option<&'static str>,
        /// The values it may take, as the docs write them (`1..=86400000`,
        /// `within min..=max`, `above 0`).
        range: String,
        /// The value given, when the message repeats it.
        value: Option<String>,
    },
    /// A number above its maximum: `at most {max}, got {value}`.
    #[error("at most {max}{}", got(.value))]
    TooLarge {
        /// The maximum, as the docs write it.
        max: String,
        /// The value given, when the message repeats it.
        value: Option<String>,
    },
    /// A value not of the form it must have: `{value} {expected}`.
    #[error("{}{expected}", shown(.value))]
    Malformed {
        /// The value as given (text quoted), when the message shows it.
        value: Option<String>,
        /// What it must be, said of it (`must start with '/'`, `is not an
        /// HTTP method`, `not a PEM private key (...)`).
        expected: String,
    },
    /// A field given without the one it needs: `required with {with}`.
    #[error("required with {with}")]
    Requires {
        /// The field that needs it.
        with: String,
    },
    /// A field that contradicts another one.
    #[error("{message}")]
    Conflict {
        /// The other field.
        with: String,
        /// What is wrong, in words.
        message: String,
    },
    /// A private key that does not match its certificate.
    #[error("the key does not match the certificate")]
    KeyMismatch,
    /// A certificate whose validity ended before now.
    #[error("the certificate expired at {not_after} (Unix time)")]
    Expired {
        /// End of validity, seconds since the Unix epoch.
        not_after: i64,
    },
    /// The key kept from the configuration (given as the placeholder)
    /// is refused for the reason inside.
    #[error("the key kept from the current certificate: {0}")]
    KeptKey(Box<Reason>),
    /// A rule spanning several settings, stated in words.
    #[error("{0}")]
    Rule(String),
}

fn got(value: &Option<String>) -> String {
    value.as_ref().map_or_else(String::new, |v| format!(", got {v}"))
}

fn named(name: &Option<&'static str>) -> String {
    name.map_or_else(String::new, |n| format!("{n} "))
}

fn shown(value: &Option<String>) -> String {
    value.as_ref().map_or_else(String::new, |v| format!("{v} "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shown_as_field_then_reason() {
        assert_eq!(Invalid::range("retries", "0..=10", 11).to_string(), "retries: must be 0..=10, got 11");
        assert_eq!(Invalid::range_only("", "0..=100").to_string(), "must be 0..=100");
        assert_eq!(Invalid::too_large("a.b", "3600", Some("4000".into())).to_string(), "a.b: at most 3600, got 4000");
        assert_eq!(
            Invalid::malformed("match.path", "\"x\"", "must start with '/'").to_string(),
            "match.path: \"x\" must start with '/'"
        );
        assert_eq!(Invalid::unreadable("key_pem", "not PEM").to_string(), "key_pem: not PEM");
        assert_eq!(
            Invalid::new("client_key_pem", Reason::Requires { with: "client_cert_pem".into() }).to_string(),
            "client_key_pem: required with client_cert_pem"
        );
    }

    #[test]
    fn under_prefixes_the_field() {
        let e = Invalid::unreadable("ca_pem", "no CERTIFICATE block found").under("upstream.tls");
        assert_eq!(e.field, "upstream.tls.ca_pem");
        assert_eq!(Invalid::range("", "0..=1", 2).under("gamma").field, "gamma");
        assert_eq!(Invalid::range("x", "0..=1", 2).under("").field, "x");
    }
}
