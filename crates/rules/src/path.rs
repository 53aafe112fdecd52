//! Path rewriting and templates, keeping the path normalized.

use tidegate_model::normalize::normalize;
use tidegate_model::rules::{Part, Template, Var};

/// The parts of a request a template can name.
#[derive(Debug, Clone, Copy)]
pub struct Parts<'a> {
    /// `http` or `https`.
    pub scheme: &'a str,
    /// The host, without port.
    pub host: &'a str,
    /// The (current) normalized path.
    pub path: &'a str,
    /// The query, without `?`.
    pub query: Option<&'a str>,
}

/// Expands `t` with the request's `parts` and the regex's `caps`.
pub fn expand(t: &Template, parts: &Parts<'_>, caps: Option<&regex::Captures<'_>>) -> String {
    let mut out = String::new();
    for p in t.parts() {
        match p {
            Part::Literal(s) => out.push_str(s),
            Part::Var(Var::Scheme) => out.push_str(parts.scheme),
            Part::Var(Var::Host) => out.push_str(parts.host),
            Part::Var(Var::Path) => out.push_str(parts.path),
            Part::Var(Var::Query) => out.push_str(parts.query.unwrap_or("")),
            Part::Var(Var::Uri) => {
                out.push_str(parts.path);
                if let Some(q) = parts.query {
                    out.push('?');
                    out.push_str(q);
                }
            }
            Part::Capture(n) => {
                if let Some(m) = caps.and_then(|c| c.get(*n)) {
                    out.push_str(m.as_str());
                }
            }
        }
    }
    out
}

/// `path` without `prefix` (segment-wise), or `None` when it does not
/// start with it. What is left of a normalized path is normalized.
pub fn strip_prefix<'a>(path: &'a str, prefix: &str) -> Option<&'a str> {
    match path.strip_prefix(prefix) {
        Some("") => Some("/"),
        Some(rest) if rest.starts_with('/') => Some(rest),
        _ => None,
    }
}

/// Why a rewritten path is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadPath {
    /// It has a `.` or `..` segment, which would move out of where the
    /// rule put it: refused rather than resolved.
    DotSegment,
    /// It is not a path a request may carry (an encoded `/`, a bad escape).
    Invalid,
}

/// The rewritten path as sent upstream: normalized, with no dot segment.
pub fn checked(raw: String) -> Result<String, BadPath> {
    let dot = raw.split(['?', '#']).next().unwrap_or("").split('/').any(|s| {
        let s = s.to_ascii_lowercase();
        matches!(s.as_str(), "." | ".." | "%2e" | ".%2e" | "%2e." | "%2e%2e")
    });
    if dot {
        return Err(BadPath::DotSegment);
    }
    if raw.contains(['?', '#']) || !raw.starts_with('/') {
        return Err(BadPath::Invalid);
    }
    match normalize(&raw) {
        Ok(n) => Ok(n.into_owned()),
        Err(_) => Err(BadPath::Invalid),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn prefixes_strip_by_segment() {
        assert_eq!(strip_prefix("/api/x", "/api"), Some("/x"));
        assert_eq!(strip_prefix("/api", "/api"), Some("/"));
        assert_eq!(strip_prefix("/apix", "/api"), None);
    }

    #[test]
    fn dot_segments_are_refused_not_resolved() {
        assert_eq!(checked("/a/../b".into()), Err(BadPath::DotSegment));
        assert_eq!(checked("/a/%2E%2e/b".into()), Err(BadPath::DotSegment));
        assert_eq!(checked("/a/%2Fb".into()), Err(BadPath::Invalid));
        assert_eq!(checked("/a/%41".into()).unwrap(), "/a/A");
    }

    fn rewrite(path: &str, regex: &str, replacement: &str) -> Option<Result<String, BadPath>> {
        let re = regex::Regex::new(regex).unwrap();
        let groups = re.captures_len() - 1;
        let t = Template::parse("replacement", replacement, false, Some(groups)).ok()?;
        let caps = re.captures(path)?;
        let parts = Parts { scheme: "http", host: "h", path, query: None };
        Some(checked(expand(&t, &parts, Some(&caps))))
    }

    fn segment() -> impl Strategy<Value = String> {
        prop_oneof!["[a-z0-9._~-]{1,6}", Just(".".to_string()), Just("..".to_string()), Just("%2e".to_string())]
    }

    proptest! {
        /// Whatever a rewrite makes of a normalized path, what goes
        /// upstream is normalized and has no dot segment: nothing climbs
        /// out of where the rule put it.
        #[test]
        fn a_rewritten_path_stays_normalized_and_never_climbs(
            segs in proptest::collection::vec("[a-z0-9._~-]{1,6}", 0..5),
            pre in proptest::collection::vec(segment(), 0..3),
            post in proptest::collection::vec(segment(), 0..3),
        ) {
            let path = format!("/{}", segs.join("/"));
            let Ok(path) = normalize(&path).map(|p| p.into_owned()) else { return Ok(()) };
            let replacement = format!("/{}$1{}", pre.join("/"), post.iter().map(|s| format!("/{s}")).collect::<String>());
            for regex in ["^/(.*)$", "^(.*)$", "^/([^/]*)", "(.)"] {
                if let Some(Ok(out)) = rewrite(&path, regex, &replacement) {
                    prop_assert_eq!(normalize(&out).map(|n| n.into_owned()), Ok(out.clone()));
                    prop_assert!(!out.split('/').any(|s| s == "." || s == ".."), "{}", out);
                }
            }
        }

        /// Stripping a prefix from a normalized path leaves it normalized.
        #[test]
        fn a_stripped_path_stays_normalized(segs in proptest::collection::vec("[a-z0-9._~-]{1,6}", 1..5), n in 1usize..4) {
            let Ok(path) = normalize(&format!("/{}", segs.join("/"))).map(|p| p.into_owned()) else { return Ok(()) };
            let cut: Vec<&str> = path.split('/').skip(1).take(n).collect();
            let prefix = format!("/{}", cut.join("/"));
            if let Some(rest) = strip_prefix(&path, &prefix) {
                prop_assert_eq!(normalize(rest).map(|n| n.into_owned()), Ok(rest.to_string()));
            }
        }
    }
}
