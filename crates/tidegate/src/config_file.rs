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

/// Why a file that Tidegate acts on with its own privileges (`serve
/// --config`) is not trusted: someone other than the user Tidegate runs as
/// (or root) could have written it, and what it says would run as that
/// user (an autoscaler command, for one).
#[derive(Debug, thiserror::Error)]
pub enum Untrusted {
    /// The file or its directory cannot be examined.
    #[error("{}: cannot check it: {source}", path.display())]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Not a regular file (a directory, a device, a pipe).
    #[error("{}: not a regular file", path.display())]
    NotAFile {
        /// The file.
        path: PathBuf,
    },
    /// Owned by another user.
    #[error(
        "{}: owned by uid {owner}; it must belong to the user Tidegate runs as (uid {euid}) or to root",
        path.display()
    )]
    Owner {
        /// The file.
        path: PathBuf,
        /// Its owner.
        owner: u32,
        /// The user Tidegate runs as.
        euid: u32,
    },
    /// Writable by its group or by everyone.
    #[error("{}: mode {mode:04o} lets {who} write it; only its owner may (chmod go-w)", path.display())]
    Writable {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
        /// `its group`, `everyone`, or both.
        who: &'static str,
    },
    /// In a directory anyone may write to, without the sticky bit: anyone
    /// could replace the file, or the link, with their own.
    #[error(
        "{}: {what} in {}, a directory anyone may write to without the sticky bit, so anyone could replace it",
        path.display(),
        dir.display()
    )]
    OpenDirectory {
        /// The file or link.
        path: PathBuf,
        /// `the file` or `the symbolic link`.
        what: &'static str,
        /// The directory.
        dir: PathBuf,
    },
}

/// Checks that the directory holding `path` is not writable by everyone
/// without the sticky bit (as `/tmp` has it: there only a file's owner may
/// replace it).
fn check_directory(path: &Path, what: &'static str) -> Result<(), Untrusted> {
    use std::os::unix::fs::PermissionsExt;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let meta = std::fs::metadata(&dir).map_err(|source| Untrusted::Unreadable { path: dir.clone(), source })?;
    let mode = meta.permissions().mode();
    if mode & 0o002 != 0 && mode & 0o1000 == 0 {
        return Err(Untrusted::OpenDirectory { path: path.to_path_buf(), what, dir });
    }
    Ok(())
}

/// Checks what an open file is: a regular file, owned by `euid` or root,
/// that neither its group nor anyone else may write.
fn check_owner_and_mode(path: &Path, meta: &std::fs::Metadata, euid: u32) -> Result<(), Untrusted> {
    use std::os::unix::fs::MetadataExt;
    if !meta.file_type().is_file() {
        return Err(Untrusted::NotAFile { path: path.to_path_buf() });
    }
    let owner = meta.uid();
    if owner != euid && owner != 0 {
        return Err(Untrusted::Owner { path: path.to_path_buf(), owner, euid });
    }
    let mode = meta.mode() & 0o7777;
    let who = match (mode & 0o020 != 0, mode & 0o002 != 0) {
        (true, true) => "its group and everyone",
        (true, false) => "its group",
        (false, true) => "everyone",
        (false, false) => return Ok(()),
    };
    Err(Untrusted::Writable { path: path.to_path_buf(), mode, who })
}

/// Reads a configuration file that `serve` acts on with its own
/// privileges, after checking it as the admin token file is checked:
///
/// - the file (after following links) is a regular file owned by the user
///   Tidegate runs as, or by root, and neither its group nor others may
///   write it;
/// - its directory is not writable by everyone (unless it has the sticky
///   bit, as `/tmp` does);
/// - a symbolic link is followed only when the directory it sits in passes
///   the same directory check (the target is checked as above).
///
/// What is checked is the file actually opened (its descriptor), so a
/// file swapped in after the check is not read unchecked.
pub fn read_trusted(path: &Path) -> Result<String, Untrusted> {
    read_trusted_as(path, nix::unistd::geteuid().as_raw())
}

fn read_trusted_as(path: &Path, euid: u32) -> Result<String, Untrusted> {
    let unreadable = |source| Untrusted::Unreadable { path: path.to_path_buf(), source };
    let link = std::fs::symlink_metadata(path).map_err(unreadable)?;
    if link.file_type().is_symlink() {
        check_directory(path, "the symbolic link")?;
        let target = std::fs::canonicalize(path).map_err(unreadable)?;
        check_directory(&target, "the file it points to")?;
    } else {
        check_directory(path, "the file")?;
    }
    // Non-blocking, so a pipe put in the file's place cannot hold the
    // open (and the SIGHUP handler) until someone writes to it; it is then
    // refused as not a regular file. Reads of a regular file are unaffected.
    let mut file = {
        use std::os::unix::fs::OpenOptionsExt;
        let nonblocking = nix::fcntl::OFlag::O_NONBLOCK.bits();
        std::fs::OpenOptions::new().read(true).custom_flags(nonblocking).open(path).map_err(unreadable)?
    };
    let meta = file.metadata().map_err(unreadable)?;
    check_owner_and_mode(path, &meta, euid)?;
    let mut text = String::new();
    std::io::Read::read_to_string(&mut file, &mut text).map_err(unreadable)?;
    Ok(text)
}

/// Refuses text that cannot be a whole file: YAML whose last line does not
/// end in a newline, as a file caught while it is written (or cut short)
/// is. Editors and tools end text files with one. JSON (text that starts
/// with `{`) needs no such mark: a cut-off object does not parse.
pub fn check_complete(path: &Path, text: &str) -> Result<(), FileError> {
    if text.trim_start().starts_with('{') || text.is_empty() || text.ends_with('\n') {
        return Ok(());
    }
    Err(FileError::new(
        path,
        "does not end with a newline, so it may be cut off mid-write; write the whole file under another name and rename it into place",
    ))
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
        // A value's own check may name a field inside it (a rule set's
        // `steps[1].location: ...`): folded into the field.
        let (field, message) = tidegate_model::fold_field(field, message);
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
    parse_file(path, &read_text(path)?)
}

/// Parses and checks the text of configuration file `path` (see [`read`]).
pub fn parse_file(path: &Path, text: &str) -> Result<ConfigFile, FileError> {
    let text = text.to_string();
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
                if !d.rules.is_empty() {
                    s.push_str(&format!(", {} rule set(s)", d.rules.len()));
                }
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
    fn a_configuration_file_is_trusted_only_as_the_token_file_is() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.yaml");
        std::fs::write(&path, "services: {}\n").unwrap();
        let mode = |p: &Path, m: u32| std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();
        mode(&path, 0o644);
        assert_eq!(read_trusted(&path).unwrap(), "services: {}\n");
        for (m, who) in [(0o664, "its group"), (0o646, "everyone"), (0o666, "its group and everyone")] {
            mode(&path, m);
            let e = read_trusted(&path).unwrap_err().to_string();
            assert!(e.contains("t.yaml") && e.contains(&format!("{m:04o} lets {who} write it")), "{e}");
        }
        mode(&path, 0o600);
        // Owned by someone else (as root, the test can give it away; it then checks as uid 4242).
        std::os::unix::fs::chown(&path, Some(4343), None).ok();
        let owner = std::fs::metadata(&path).map(|m| std::os::unix::fs::MetadataExt::uid(&m)).unwrap();
        if owner == 4343 {
            let e = read_trusted_as(&path, 4242).unwrap_err().to_string();
            assert!(e.contains("owned by uid 4343") && e.contains("(uid 4242) or to root"), "{e}");
            assert!(read_trusted_as(&path, 4343).is_ok());
            std::os::unix::fs::chown(&path, Some(0), None).unwrap();
        }
        // A directory anyone may write to: refused, unless sticky.
        let open = dir.path().join("open");
        std::fs::create_dir(&open).unwrap();
        let inside = open.join("c.yaml");
        std::fs::write(&inside, "services: {}\n").unwrap();
        mode(&inside, 0o600);
        mode(&open, 0o777);
        let e = read_trusted(&inside).unwrap_err().to_string();
        assert!(e.contains("the file in") && e.contains("without the sticky bit"), "{e}");
        mode(&open, 0o1777);
        assert!(read_trusted(&inside).is_ok());
        // A link is followed where it sits safely and its target passes.
        mode(&open, 0o777);
        let safe_link = dir.path().join("link.yaml");
        std::os::unix::fs::symlink(&path, &safe_link).unwrap();
        assert!(read_trusted(&safe_link).is_ok());
        let to_open = dir.path().join("to-open.yaml");
        std::os::unix::fs::symlink(&inside, &to_open).unwrap();
        let e = read_trusted(&to_open).unwrap_err().to_string();
        assert!(e.contains("the file it points to in"), "{e}");
        let planted = open.join("planted.yaml");
        std::os::unix::fs::symlink(&path, &planted).unwrap();
        let e = read_trusted(&planted).unwrap_err().to_string();
        assert!(e.contains("the symbolic link in"), "{e}");
        mode(&path, 0o666);
        let e = read_trusted(&safe_link).unwrap_err().to_string();
        assert!(e.contains("link.yaml: mode 0666"), "the target is checked, named by the path given: {e}");
        assert!(read_trusted(dir.path()).unwrap_err().to_string().contains("not a regular file"));
        let fifo = dir.path().join("fifo.yaml");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        assert!(read_trusted(&fifo).unwrap_err().to_string().contains("not a regular file"), "refused, not waited on");
    }

    #[test]
    fn yaml_that_stops_mid_line_is_not_a_whole_file() {
        let p = Path::new("c.yaml");
        assert!(check_complete(p, "services:\n  web: {}\n").is_ok());
        assert!(check_complete(p, "").is_ok(), "empty is refused for what it is, elsewhere");
        assert!(check_complete(p, "{\"services\": {}}").is_ok(), "JSON is whole when it parses");
        let e = check_complete(p, "services:\n  web:\n    backends: [{id: a, addr: 127.0.0.1:80").unwrap_err();
        assert!(e.to_string().starts_with("c.yaml: does not end with a newline"), "{e}");
    }

    #[test]
    fn change_sets_and_json_are_read_too() {
        let (_f, p) = file(r#"{"ops": [{"op": "delete_route", "name": "r"}], "if_revision": 3}"#);
        let ConfigFile::Changes(cs) = read(&p).unwrap() else { panic!("a change set") };
        assert_eq!(cs.if_revision, Some(3));
    }
}
