//! The providers. Each kind lives in its own module:
//!
//! - [`process`]: local processes from a command template, one port each
//!   (the embedded default);
//! - [`command`]: user scripts that start, stop and list instances and
//!   answer in JSON on stdout;
//! - [`webhook`]: an infrastructure service called over HTTP with signed
//!   JSON requests (paper S1's "infrastructure web service").
//!
//! This module also holds what they share: argument templates, the JSON
//! answers of scripts and webhooks, and file-name hygiene.

pub mod command;
pub mod process;
mod state;
mod unix;
pub mod webhook;

use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;
use serde_json::Value;
use tidegate_model::ProviderSpec;

use crate::provider::{Instance, Provider};

pub use command::CommandProvider;
pub use process::ProcessProvider;
pub use unix::SignalError;
pub use webhook::WebhookProvider;

/// Environment variables a started program inherits from Tidegate; all
/// others (the admin token among them) are withheld. The provider then
/// adds its own `TIDEGATE_*` variables (port, id, service, ...).
pub const INHERITED_ENV: [&str; 8] = ["PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TZ", "TMPDIR"];

/// Gives `command` a clean environment: only [`INHERITED_ENV`] from
/// Tidegate's own.
pub(crate) fn clean_env(command: &mut tokio::process::Command) {
    command.env_clear();
    for name in INHERITED_ENV {
        if let Some(value) = std::env::var_os(name) {
            command.env(name, value);
        }
    }
}

/// Builds the provider for a spec. Never fails: a spec that cannot work
/// (no program, a bad URL) makes every call of the provider fail instead.
pub fn build(spec: &ProviderSpec, service: &str, state_dir: &Path) -> Arc<dyn Provider> {
    match spec {
        ProviderSpec::Process { command, ports, grace_s } => {
            Arc::new(ProcessProvider::new(service, command.clone(), *ports, *grace_s, state_dir))
        }
        ProviderSpec::Command { start, stop, list } => {
            Arc::new(CommandProvider::new(service, start.clone(), stop.clone(), list.clone()))
        }
        ProviderSpec::Webhook { url, secret, poll_interval_ms } => {
            Arc::new(WebhookProvider::new(service, url, secret, *poll_interval_ms))
        }
    }
}

/// Replaces each `{name}` of `template` whose name is in `vars` by its
/// value, in one pass (values are never themselves expanded); any other
/// braces stay as they are.
pub(crate) fn fill(template: &str, vars: &[(&str, &str)]) -> String {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let from_brace = &rest[open..];
        let known = from_brace.find('}').and_then(|close| {
            let name = &from_brace[1..close];
            vars.iter().find(|(key, _)| *key == name).map(|(_, value)| (close, *value))
        });
        match known {
            Some((close, value)) => {
                out.push_str(value);
                rest = &from_brace[close + 1..];
            }
            None => {
                out.push('{');
                rest = &from_brace[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// `s` made safe as part of a file name: anything but ASCII letters,
/// digits, `.`, `_` and `-` becomes `_`, and it never is `.`, `..` or empty.
pub(crate) fn file_part(s: &str) -> String {
    let clean: String =
        s.chars().map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') { c } else { '_' }).collect();
    if clean.is_empty() || clean.chars().all(|c| c == '.') {
        "_".repeat(clean.len().max(1))
    } else {
        clean
    }
}

/// The first non-blank line of some output, trimmed and at most 300
/// characters long; `(no output)` when there is none.
pub(crate) fn first_line(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    match text.lines().map(str::trim).find(|l| !l.is_empty()) {
        Some(line) => line.chars().take(300).collect(),
        None => "(no output)".into(),
    }
}

/// Whether `addr` looks like `host:port` with a port from 1 to 65535.
pub(crate) fn valid_addr(addr: &str) -> bool {
    match addr.rsplit_once(':') {
        Some((host, port)) => !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0),
        None => false,
    }
}

/// What is wrong with a script's or a webhook's answer.
#[derive(Debug, thiserror::Error)]
pub enum AnswerError {
    /// Not the JSON expected.
    #[error("expected {expected}: {source}")]
    Json {
        /// The shape expected.
        expected: &'static str,
        /// The parser's error.
        source: serde_json::Error,
    },
    /// `"handle"` is neither a string nor a number.
    #[error("\"handle\" must be a string, got {0}")]
    Handle(Value),
    /// `"addr"` is not `host:port`.
    #[error("\"addr\" must be host:port, got {0:?}")]
    Addr(String),
    /// A listed instance without an id or with a bad address.
    #[error("bad instance {id:?} at {addr:?}: need an id and host:port")]
    Listed {
        /// Its id.
        id: String,
        /// Its address.
        addr: String,
    },
}

impl AnswerError {
    /// The field at fault (`.` for the answer as a whole).
    pub fn field(&self) -> &'static str {
        match self {
            AnswerError::Json { .. } => ".",
            AnswerError::Handle(_) => "handle",
            AnswerError::Addr(_) => "addr",
            AnswerError::Listed { id, .. } if id.is_empty() => "id",
            AnswerError::Listed { .. } => "addr",
        }
    }
}

/// A provider's handle as JSON: a string, or a number kept as its text.
fn handle_of(value: Option<Value>) -> Result<Option<String>, AnswerError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(Value::Number(n)) => Ok(Some(n.to_string())),
        Some(other) => Err(AnswerError::Handle(other)),
    }
}

/// The answer to a start: `{"addr": "host:port", "handle": "..."}`, the
/// handle optional; other fields are ignored.
pub(crate) fn parse_started(id: &str, bytes: &[u8]) -> Result<Instance, AnswerError> {
    #[derive(Deserialize)]
    struct Started {
        addr: String,
        #[serde(default)]
        handle: Option<Value>,
    }
    let started: Started =
        serde_json::from_slice(bytes).map_err(|source| AnswerError::Json { expected: "{\"addr\": ...}", source })?;
    if !valid_addr(&started.addr) {
        return Err(AnswerError::Addr(started.addr));
    }
    Ok(Instance { id: id.to_string(), addr: started.addr, handle: handle_of(started.handle)? })
}

/// The answer to a list: `[{"id": ..., "addr": "host:port", "handle": ...}]`.
pub(crate) fn parse_list(bytes: &[u8]) -> Result<Vec<Instance>, AnswerError> {
    #[derive(Deserialize)]
    struct Listed {
        id: String,
        addr: String,
        #[serde(default)]
        handle: Option<Value>,
    }
    let listed: Vec<Listed> = serde_json::from_slice(bytes)
        .map_err(|source| AnswerError::Json { expected: "[{\"id\": ..., \"addr\": ...}]", source })?;
    listed
        .into_iter()
        .map(|l| {
            if l.id.is_empty() || !valid_addr(&l.addr) {
                return Err(AnswerError::Listed { id: l.id, addr: l.addr });
            }
            Ok(Instance { id: l.id, addr: l.addr, handle: handle_of(l.handle)? })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidegate_model::PortRange;

    #[test]
    fn fill_replaces_known_names_once() {
        let vars = [("port", "8000"), ("id", "{port}"), ("service", "web")];
        assert_eq!(fill("--port={port}", &vars), "--port=8000");
        assert_eq!(fill("{service}-{id}", &vars), "web-{port}");
        assert_eq!(fill("{unknown} {port", &vars), "{unknown} {port");
        assert_eq!(fill("{{port}}", &vars), "{8000}");
        assert_eq!(fill("é{id}ü{", &vars), "é{port}ü{");
        assert_eq!(fill("", &vars), "");
    }

    #[test]
    fn file_parts_stay_in_their_directory() {
        assert_eq!(file_part("web-1.a_b"), "web-1.a_b");
        assert_eq!(file_part("../etc/passwd"), ".._etc_passwd");
        assert_eq!(file_part(".."), "__");
        assert_eq!(file_part(""), "_");
        assert_eq!(file_part("a b/ç"), "a_b__");
    }

    #[test]
    fn answers_are_parsed_strictly_enough() {
        let i = parse_started("x", br#"{"addr": "10.0.0.1:80", "handle": 42, "extra": true}"#).unwrap();
        assert_eq!(i, Instance { id: "x".into(), addr: "10.0.0.1:80".into(), handle: Some("42".into()) });
        let i = parse_started("x", br#"{"addr": "[::1]:8080"}"#).unwrap();
        assert_eq!(i.handle, None);
        let field = |r: Result<Instance, AnswerError>| r.unwrap_err().field();
        assert_eq!(field(parse_started("x", br#"{"addr": "nohost"}"#)), "addr");
        assert_eq!(field(parse_started("x", br#"{"addr": "h:0"}"#)), "addr");
        assert_eq!(field(parse_started("x", br#"{"addr": "h:1", "handle": [1]}"#)), "handle");
        assert!(matches!(parse_started("x", b"not json"), Err(AnswerError::Json { .. })));
        let e = parse_started("x", br#"{"addr": "h:0"}"#).unwrap_err().to_string();
        assert_eq!(e, r#""addr" must be host:port, got "h:0""#);
        let l = parse_list(br#"[{"id": "a", "addr": "h:1"}, {"id": "b", "addr": "h:2", "handle": "vm"}]"#).unwrap();
        assert_eq!(l.len(), 2);
        assert_eq!(l[1].handle.as_deref(), Some("vm"));
        assert_eq!(parse_list(br#"[{"id": "", "addr": "h:1"}]"#).unwrap_err().field(), "id");
        assert!(parse_list(br#"{"id": "a"}"#).is_err());
        assert_eq!(first_line(b"\n  \n  first \nsecond"), "first");
        assert_eq!(first_line(b""), "(no output)");
    }

    #[tokio::test]
    async fn build_picks_the_kind() {
        let dir = tempfile::tempdir().unwrap();
        let specs = [
            ProviderSpec::Process { command: vec!["true".into()], ports: PortRange { from: 1, to: 2 }, grace_s: 1 },
            ProviderSpec::Command { start: vec!["true".into()], stop: vec!["true".into()], list: None },
            ProviderSpec::Webhook { url: "http://127.0.0.1:1/".into(), secret: "s".into(), poll_interval_ms: 10 },
        ];
        for spec in &specs {
            let provider = build(spec, "svc", dir.path());
            assert!(provider.list().await.is_ok_and(|l| l.is_empty()) || matches!(spec, ProviderSpec::Webhook { .. }));
        }
    }
}
