//! Request-target hygiene: one normalized path for routing and forwarding.
//!
//! A proxy that routes on one reading of a path and forwards another lets
//! a client reach what its routes never exposed (`/public/../admin`,
//! `/public/%2e%2e/admin`, Tomcat's `/public/..;/admin`). Tidegate
//! normalizes the path once, before routing, and the backend receives
//! exactly the path that was routed:
//!
//! - percent-encoded unreserved characters (`A-Z a-z 0-9 - . _ ~`) are
//!   decoded (`%2e` is `.`, `%41` is `A`), as RFC 3986 section 6.2.2.2 allows,
//!   and the others get uppercase hex (`%c3%a9` is `%C3%A9`, section 6.2.2.1);
//! - `.` and `..` segments are resolved (section 5.2.4); a `..` above the
//!   root is refused;
//! - runs of `/` are merged into one;
//! - an encoded `/` (`%2F`), `\` (`%5C`) or NUL (`%00`), a raw `\` (which
//!   some servers read as `/`, as they do `%5C`), a segment that is a dot
//!   segment with parameters (`..;x`, `.;x`), a malformed escape, and a path
//!   that does not start with `/` are refused.
//!
//! The query is not touched. The asterisk-form (`OPTIONS *`) passes as is.

use std::borrow::Cow;

/// Why a path was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathError {
    /// The path does not start with `/`.
    NotAbsolute,
    /// A `%` not followed by two hex digits.
    BadEscape,
    /// An encoded `/`, `\` or NUL, which would be read differently by
    /// different servers.
    EncodedSeparator,
    /// A raw `\`, a separator to some servers (Windows, IIS, some
    /// frameworks) and not to others.
    Backslash,
    /// A `..` that would climb above the root.
    AboveRoot,
    /// A dot segment with parameters (`..;`), read as `..` by some servers.
    DotSegmentParameters,
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

fn unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// Whether the path may need work: any `%`, `.` segment, `//` or `;`.
/// Most paths are already normal and are returned borrowed.
/// One pass, a byte at a time: request paths are short, and two `memchr`
/// calls and a scan of byte pairs cost more than this loop on them.
fn is_plain(path: &str) -> bool {
    let b = path.as_bytes();
    if b.first() != Some(&b'/') {
        return false;
    }
    let mut after_slash = false;
    for &c in b {
        match c {
            b'%' | b'\\' => return false,
            b'/' | b'.' if after_slash => return false,
            b'/' => after_slash = true,
            _ => after_slash = false,
        }
    }
    true
}

/// Normalizes a request path (without its query).
pub fn normalize(path: &str) -> Result<Cow<'_, str>, PathError> {
    if path == "*" {
        return Ok(Cow::Borrowed(path));
    }
    if is_plain(path) {
        return Ok(Cow::Borrowed(path));
    }
    if !path.starts_with('/') {
        return Err(PathError::NotAbsolute);
    }
    // Decode unreserved escapes; keep the others as they are.
    let raw = path.as_bytes();
    let mut decoded = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        if raw[i] == b'%' {
            let (Some(h), Some(l)) = (raw.get(i + 1).and_then(|b| hex(*b)), raw.get(i + 2).and_then(|b| hex(*b)))
            else {
                return Err(PathError::BadEscape);
            };
            let c = h * 16 + l;
            if matches!(c, b'/' | b'\\' | 0) {
                return Err(PathError::EncodedSeparator);
            }
            if unreserved(c) {
                decoded.push(c);
            } else {
                // Uppercase hex (section 6.2.2.1), the form routes are written in.
                decoded.extend_from_slice(&[b'%', raw[i + 1].to_ascii_uppercase(), raw[i + 2].to_ascii_uppercase()]);
            }
            i += 3;
        } else if raw[i] == b'\\' {
            return Err(PathError::Backslash);
        } else {
            decoded.push(raw[i]);
            i += 1;
        }
    }
    // Resolve segments. A trailing `/` (or a final dot segment) keeps the
    // path a directory.
    let text = String::from_utf8(decoded).map_err(|_| PathError::BadEscape)?;
    let mut out: Vec<&str> = Vec::new();
    let segments: Vec<&str> = text.split('/').skip(1).collect();
    let last = segments.len().saturating_sub(1);
    let mut trailing_slash = false;
    for (n, seg) in segments.iter().enumerate() {
        let bare = seg.split(';').next().unwrap_or("");
        if (bare == "." || bare == "..") && seg.len() != bare.len() {
            return Err(PathError::DotSegmentParameters);
        }
        match *seg {
            "" => trailing_slash = n == last,
            "." => trailing_slash = n == last,
            ".." => {
                if out.pop().is_none() {
                    return Err(PathError::AboveRoot);
                }
                trailing_slash = n == last;
            }
            s => {
                out.push(s);
                trailing_slash = false;
            }
        }
    }
    let mut normal = String::with_capacity(text.len());
    for s in &out {
        normal.push('/');
        normal.push_str(s);
    }
    if trailing_slash || normal.is_empty() {
        normal.push('/');
    }
    Ok(Cow::Owned(normal))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn examples() {
        let ok = |p: &str| normalize(p).map(|c| c.into_owned());
        assert_eq!(ok("/a/b?").unwrap(), "/a/b?");
        assert_eq!(ok("/").unwrap(), "/");
        assert_eq!(ok("/caf%c3%a9").unwrap(), "/caf%C3%A9");
        assert_eq!(ok("/public/../internal").unwrap(), "/internal");
        assert_eq!(ok("/public/%2e%2e/internal").unwrap(), "/internal");
        assert_eq!(ok("/public/%2E%2E/internal/").unwrap(), "/internal/");
        assert_eq!(ok("//a///b").unwrap(), "/a/b");
        assert_eq!(ok("/a/./b/.").unwrap(), "/a/b/");
        assert_eq!(ok("/a/b/..").unwrap(), "/a/");
        assert_eq!(ok("/%61pi/x%20y").unwrap(), "/api/x%20y");
        assert_eq!(ok("/.well-known/x").unwrap(), "/.well-known/x");
        assert_eq!(ok("/a/.b/..c").unwrap(), "/a/.b/..c");
        assert_eq!(ok("*").unwrap(), "*");
        assert_eq!(ok("/public/%2E%2E%2Finternal"), Err(PathError::EncodedSeparator));
        assert_eq!(ok("/a%5c..%5cb"), Err(PathError::EncodedSeparator));
        assert_eq!(ok("/public\\..\\internal"), Err(PathError::Backslash));
        assert_eq!(ok("/a\\b"), Err(PathError::Backslash));
        assert_eq!(ok("\\a"), Err(PathError::NotAbsolute));
        assert_eq!(ok("/public/..;/internal"), Err(PathError::DotSegmentParameters));
        assert_eq!(ok("/public/..;x=1/internal"), Err(PathError::DotSegmentParameters));
        assert_eq!(ok("/.."), Err(PathError::AboveRoot));
        assert_eq!(ok("/a/../../b"), Err(PathError::AboveRoot));
        assert_eq!(ok("/a%zz"), Err(PathError::BadEscape));
        assert_eq!(ok("/a%2"), Err(PathError::BadEscape));
        assert_eq!(ok("a/b"), Err(PathError::NotAbsolute));
        assert!(matches!(normalize("/plain/path"), Ok(Cow::Borrowed(_))));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Normalizing is idempotent, and a normal path has no dot
        /// segment, no empty segment and no escaped unreserved byte.
        #[test]
        fn normal_paths_are_fixed_points(p in "(/(\\.|\\.\\.|%2[eE]|[a-z]{1,3}|%41|%2[fF]|;|%|%zz|[\\\\])?){0,8}/?") {
            if let Ok(n) = normalize(&p) {
                let n = n.into_owned();
                prop_assert_eq!(normalize(&n).map(|c| c.into_owned()), Ok(n.clone()));
                prop_assert!(n.starts_with('/'));
                prop_assert!(!n.contains("//"), "{}", n);
                prop_assert!(!n.contains('\\'), "{}", n);
                for seg in n.split('/') {
                    prop_assert!(seg != "." && seg != "..", "{}", n);
                }
                prop_assert!(!n.to_ascii_lowercase().contains("%2e"), "{}", n);
            }
        }

        /// No input panics.
        #[test]
        fn arbitrary_input_never_panics(p in "\\PC{0,64}") {
            let _ = normalize(&p);
        }

        /// The one-pass test of a plain path says what its definition
        /// says: absolute, no `%` or backslash, no `//` or `/.`.
        #[test]
        fn the_plain_test_is_its_definition(p in "[/.%\\\\a]{0,12}|\\PC{0,24}") {
            let b = p.as_bytes();
            let defined = b.first() == Some(&b'/')
                && !b.contains(&b'%')
                && !b.contains(&b'\\')
                && !b.windows(2).any(|w| w == b"//" || w == b"/.");
            prop_assert_eq!(is_plain(&p), defined, "{:?}", p);
        }
    }
}
