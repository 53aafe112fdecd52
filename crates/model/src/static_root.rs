//! Which directories a static route may serve from.
//!
//! The rules on a path as written ([`written_root_refusal`]) and on a real
//! path ([`real_root_refusal`]) are pure; [`check_static_root`] resolves a
//! root on the filesystem (links and all) and applies them. The API checks
//! a root when a route is written; the proxy checks it again on every
//! request, since the directory may be replaced by a link later.

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// System directories that are never a static root, nor is anything below
/// them: configuration and credentials (`/etc`, `/root`), kernel and process
/// views (`/proc`, `/sys`, `/dev`, `/run`), and the boot files.
pub const SYSTEM_TREES: &[&str] = &["/etc", "/proc", "/sys", "/dev", "/run", "/root", "/boot"];

/// Directories that are never a static root themselves (a directory below
/// one may be, such as `/var/www` or `/usr/share/doc`): the filesystem
/// root, the programs and libraries, `/var` and `/home` (which hold every
/// service's and user's files), and the shared temporary directories.
pub const SYSTEM_DIRS: &[&str] =
    &["/", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr", "/var", "/home", "/tmp", "/var/tmp"];

/// Why a static root is refused.
#[derive(Debug, thiserror::Error)]
pub enum StaticRootError {
    /// The root does not resolve (it does not exist, or a link in it is
    /// broken or unreadable).
    #[error("static.root: {root:?} cannot be resolved: {source}")]
    Unresolved {
        /// The root as written.
        root: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The root resolves to something that is not a directory.
    #[error("static.root: {root:?} is not a directory (it resolves to {real:?})")]
    NotADirectory {
        /// The root as written.
        root: PathBuf,
        /// Where it leads.
        real: PathBuf,
    },
    /// The root resolves to a place no static route may serve.
    #[error("static.root: {root:?} resolves to {real:?}: {why}")]
    Refused {
        /// The root as written.
        root: PathBuf,
        /// Where it leads.
        real: PathBuf,
        /// Which rule refuses it.
        why: String,
    },
}

/// Why a root as written is refused, if it is: it must be absolute, with no
/// `.` or `..` segment, and not name a system directory (see
/// [`real_root_refusal`]). Links are not followed here.
pub fn written_root_refusal(root: &Path) -> Option<String> {
    if !root.is_absolute() {
        return Some("must be an absolute path".into());
    }
    let bytes = root.as_os_str().as_bytes();
    if bytes.split(|b| *b == b'/').any(|seg| seg == b"." || seg == b"..") {
        return Some("must not contain `.` or `..` segments; name the directory itself".into());
    }
    if bytes.contains(&0) {
        return Some("must not contain NUL".into());
    }
    // Repeated and trailing slashes are harmless; compare without them.
    let clean: PathBuf = root.components().collect();
    real_root_refusal(&clean, &[])
}

/// Why a root's real path (absolute, links resolved) is refused, if it is:
/// a system directory ([`SYSTEM_TREES`] and below, [`SYSTEM_DIRS`]
/// themselves), or one of `private` (the data directory), a directory
/// inside one, or a parent of one.
pub fn real_root_refusal(real: &Path, private: &[PathBuf]) -> Option<String> {
    if let Some(tree) = SYSTEM_TREES.iter().find(|t| real.starts_with(t)) {
        return Some(format!("{tree} and what is below it are never served"));
    }
    if SYSTEM_DIRS.iter().any(|d| real == Path::new(d)) {
        return Some(if real == Path::new("/") {
            "the filesystem root cannot be served; name a directory".to_string()
        } else {
            format!("{} is a system directory; name a directory below it", real.display())
        });
    }
    if let Some(dir) = private.iter().find(|d| real.starts_with(d) || d.starts_with(real)) {
        return Some(format!(
            "the data directory {} holds the admin token and the store: a static root may neither be it, lie in it \
             nor contain it",
            dir.display()
        ));
    }
    None
}

/// Resolves `root` (links and all) and checks that it is a directory a
/// static route may serve; returns its real path. `private` are the real
/// paths of the directories never served (the data directory).
pub fn check_static_root(root: &Path, private: &[PathBuf]) -> Result<PathBuf, StaticRootError> {
    if let Some(why) = written_root_refusal(root) {
        return Err(StaticRootError::Refused { root: root.into(), real: root.into(), why });
    }
    let real =
        std::fs::canonicalize(root).map_err(|source| StaticRootError::Unresolved { root: root.into(), source })?;
    if let Some(why) = real_root_refusal(&real, private) {
        return Err(StaticRootError::Refused { root: root.into(), real, why });
    }
    let meta = std::fs::metadata(&real).map_err(|source| StaticRootError::Unresolved { root: root.into(), source })?;
    if !meta.is_dir() {
        return Err(StaticRootError::NotADirectory { root: root.into(), real });
    }
    Ok(real)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roots_as_written() {
        for ok in ["/srv/www", "/var/www", "/usr/share/doc", "/home/ann/site", "/srv/www/", "//srv//www", "/tmp/x"] {
            assert_eq!(written_root_refusal(Path::new(ok)), None, "{ok}");
        }
        for bad in [
            "relative",
            "/",
            "//",
            "/srv/../",
            "/srv/www/../../etc",
            "/srv/./www",
            "/srv/www/.",
            "/etc",
            "/etc/ssl",
            "/proc/self/root",
            "/proc/1/cwd",
            "/sys",
            "/dev/shm",
            "/run/secrets",
            "/root",
            "/boot",
            "/usr",
            "/usr/",
            "/bin",
            "/lib64",
            "/var",
            "/home",
            "/tmp",
        ] {
            assert!(written_root_refusal(Path::new(bad)).is_some(), "{bad}");
        }
    }

    #[test]
    fn the_data_directory_its_contents_and_its_parents_are_refused() {
        let private = [PathBuf::from("/srv/tidegate/data")];
        for bad in ["/srv/tidegate/data", "/srv/tidegate/data/instances", "/srv/tidegate", "/srv"] {
            let why = real_root_refusal(Path::new(bad), &private).unwrap_or_default();
            assert!(why.contains("data directory"), "{bad}: {why}");
        }
        for ok in ["/srv/www", "/srv/tidegate/www", "/srv/tidegate/dat"] {
            assert_eq!(real_root_refusal(Path::new(ok), &private), None, "{ok}");
        }
    }

    #[test]
    fn links_are_resolved_before_the_rules() {
        let dir = tempfile_dir();
        let www = dir.join("www");
        std::fs::create_dir_all(&www).unwrap();
        std::fs::write(dir.join("file"), "x").unwrap();
        let up = dir.join("up");
        let _ = std::fs::remove_file(&up);
        std::os::unix::fs::symlink("/", &up).unwrap();
        let etc = dir.join("etc");
        let _ = std::fs::remove_file(&etc);
        std::os::unix::fs::symlink("/etc", &etc).unwrap();
        assert_eq!(check_static_root(&www, &[]).unwrap(), std::fs::canonicalize(&www).unwrap());
        for bad in [&up, &etc] {
            assert!(matches!(check_static_root(bad, &[]), Err(StaticRootError::Refused { .. })), "{bad:?}");
        }
        assert!(matches!(check_static_root(&dir.join("file"), &[]), Err(StaticRootError::NotADirectory { .. })));
        assert!(matches!(check_static_root(&dir.join("missing"), &[]), Err(StaticRootError::Unresolved { .. })));
        let real = std::fs::canonicalize(&dir).unwrap();
        let e = check_static_root(&www, &[real.join("www")]).unwrap_err().to_string();
        assert!(e.starts_with("static.root: ") && e.contains("data directory"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A fresh directory of this test's own under the system's temporary
    /// directory (the model crate has no tempfile dependency).
    fn tempfile_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tidegate-static-root-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
