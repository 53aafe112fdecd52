//! Configuration files: YAML or JSON (JSON is YAML), either a change set
//! (`ops`) or a declarative document of the whole configuration
//! (`services`, `routes`, `certificates`).
//!
//! Files are deserialized straight into the model's types, so every error
//! names the file's own line and column and the path of the field at fault
//! (`web.yaml:7:15: services.web.backends[0].addr: ...`).

use std::fmt;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use tidegate_model::{check_change_set, ChangeSet, Document};

/// What a configuration file holds.
#[derive(Debug)]
pub enum ConfigFile {
    /// A change set: operations applied in order.
    Changes(ChangeSet),
    /// The desired state of the whole configuration.
    Document(Document),
}

/// A file that cannot be used, with where and why.
#[derive(Debug)]
pub struct FileError {
    path: PathBuf,
    /// 1-based line and column, when the parser knows them.
    at: Option<(usize, usize)>,
    /// The field at fault (`services.web.policy`), if any.
    field: String,
    message: String,
}

impl fmt::Display for FileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.path.display())?;
        if let Some((line, column)) = self.at {
            write!(f, ":{line}:{column}")?;
        }
        if !self.field.is_empty() && self.field != "." {
            write!(f, ": {}", self.field)?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for FileError {}

impl FileError {
    fn new(path: &Path, message: impl Into<String>) -> FileError {
        FileError { path: path.to_path_buf(), at: None, field: String::new(), message: message.into() }
    }
}

/// Reads a file, or standard input for `-`.
fn read_text(path: &Path) -> Result<String, FileError> {
    let read =
        if path == Path::new("-") { std::io::read_to_string(std::io::stdin()) } else { std::fs::read_to_string(path) };
    read.map_err(|e| FileError::new(path, format!("cannot read: {e}")))
}

/// Deserializes `text` as a `T`, naming the line, column and field path
/// of an error.
fn parse<T: DeserializeOwned>(path: &Path, text: &str) -> Result<T, FileError> {
    let de = serde_norway::Deserializer::from_str(text);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let field = e.path().to_string();
        let inner = e.into_inner();
        let at = inner.location().map(|l| (l.line(), l.column()));
        // The parser's message leads with its own path and ends with the
        // position: both are shown once, apart.
        let message = inner.to_string();
        let message = match message.rsplit_once(" at line ") {
            Some((m, _)) if at.is_some() => m.to_string(),
            _ => message,
        };
        let message = match message.split_once(": ") {
            Some((path, rest)) if !path.is_empty() && !path.contains(' ') => rest.to_string(),
            _ => message,
        };
        FileError { path: path.to_path_buf(), at, field, message }
    })
}

/// Reads one spec (a service, a route) from a file, checked.
pub fn read_spec<T: DeserializeOwned>(path: &Path) -> Result<T, FileError> {
    parse(path, &read_text(path)?)
}

/// Reads and checks a configuration file: a change set when it has `ops`,
/// else a document (which must hold together: every route's service in
/// it).
pub fn read(path: &Path) -> Result<ConfigFile, FileError> {
    let text = read_text(path)?;
    // Which kind it is: a first, untyped pass (syntax errors show here).
    let top: serde_norway::Value = parse(path, &text)?;
    let has_ops = match &top {
        serde_norway::Value::Mapping(m) => m.contains_key("ops"),
        serde_norway::Value::Null => false,
        _ => {
            return Err(FileError::new(
                path,
                "the file must hold a mapping: `ops`, or `services`, `routes` and `certificates`",
            ))
        }
    };
    if has_ops {
        let cs: ChangeSet = parse(path, &text)?;
        check_change_set(&cs).map_err(|e| FileError {
            path: path.to_path_buf(),
            at: None,
            field: e.field,
            message: e.message,
        })?;
        return Ok(ConfigFile::Changes(cs));
    }
    let doc: Document = if top == serde_norway::Value::Null { Document::default() } else { parse(path, &text)? };
    doc.check().map_err(|e| FileError { path: path.to_path_buf(), at: None, field: e.field, message: e.message })?;
    Ok(ConfigFile::Document(doc))
}

impl ConfigFile {
    /// As a change set: a document's objects become put operations
    /// (services and certificates before the routes that name them);
    /// nothing is deleted.
    pub fn into_change_set(self) -> ChangeSet {
        match self {
            ConfigFile::Changes(cs) => cs,
            ConfigFile::Document(doc) => ChangeSet { if_revision: None, ops: doc.put_ops() },
        }
    }

    /// One line saying what the file holds.
    pub fn summary(&self) -> String {
        match self {
            ConfigFile::Changes(cs) => format!("a change set of {} operation(s)", cs.ops.len()),
            ConfigFile::Document(d) => {
                let mut s = format!(
                    "{} service(s), {} route(s), {} certificate(s)",
                    d.services.len(),
                    d.routes.len(),
                    d.certificates.len()
                );
                let kept = d.kept_fields();
                if !kept.is_empty() {
                    let (verb, it) = if kept.len() == 1 { ("is", "it keeps") } else { ("are", "each keeps") };
                    s.push_str(&format!(
                        "; {} {verb} \"(redacted)\": {it} the value the configuration it is applied to \
                         has, and is refused where there is none",
                        kept.join(", ")
                    ));
                }
                s
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidegate_model::Op;

    fn file(text: &str) -> (tempfile::NamedTempFile, PathBuf) {
        let mut f = tempfile::Builder::new().suffix(".yaml").tempfile().unwrap();
        std::io::Write::write_all(&mut f, text.as_bytes()).unwrap();
        let p = f.path().to_path_buf();
        (f, p)
    }

    #[test]
    fn documents_become_put_ops_with_services_first() {
        let (_f, p) =
            file("routes:\n  r:\n    service: web\nservices:\n  web:\n    backends: [{id: a, addr: '127.0.0.1:1'}]\n");
        let cs = read(&p).unwrap().into_change_set();
        assert_eq!(cs.ops.len(), 2);
        assert!(matches!(cs.ops[0], Op::PutService { .. }));
        assert!(matches!(cs.ops[1], Op::PutRoute { .. }));
    }

    #[test]
    fn errors_name_the_line_column_and_field_of_the_file() {
        let (_f, p) = file("services:\n  web:\n    backends:\n      - id: a\n        addr: 'not an address'\n");
        let e = read(&p).unwrap_err().to_string();
        assert!(e.contains(":4:9:"), "the position of the bad backend: {e}");
        assert!(e.ends_with(": invalid address \"not an address\": expected HOST:PORT"), "{e}");
        assert!(e.contains("services.web.backends[0].addr"), "{e}");

        let (_f, p) = file("services:\n  web:\n    polcy: {kind: random}\n");
        let e = read(&p).unwrap_err().to_string();
        assert!(e.contains(":3:") && e.contains("polcy"), "{e}");

        let (_f, p) = file("routes:\n  r:\n    service: missing\n");
        let e = read(&p).unwrap_err().to_string();
        assert!(e.contains("missing"), "a route to a service the file lacks: {e}");

        let (_f, p) = file("services: [1, 2\n");
        assert!(read(&p).unwrap_err().at.is_some(), "syntax errors have a position");
    }

    #[test]
    fn change_sets_and_json_are_read_too() {
        let (_f, p) = file(r#"{"ops": [{"op": "delete_route", "name": "r"}], "if_revision": 3}"#);
        let ConfigFile::Changes(cs) = read(&p).unwrap() else { panic!("a change set") };
        assert_eq!(cs.if_revision, Some(3));
    }
}
