//! Templates: a redirect's `location` and a rewrite's `replacement`.

use std::fmt;

use crate::invalid::Invalid;

/// A part of the request a template can name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Var {
    /// `{scheme}`: `http` or `https`, as the client reached the proxy.
    Scheme,
    /// `{host}`: the request's host, without port.
    Host,
    /// `{path}`: the normalized path (after the steps before this one).
    Path,
    /// `{query}`: the query string without `?` (empty when none).
    Query,
    /// `{uri}`: the path, then `?` and the query when there is one.
    Uri,
}

impl Var {
    fn parse(name: &str) -> Option<Var> {
        Some(match name {
            "scheme" => Var::Scheme,
            "host" => Var::Host,
            "path" => Var::Path,
            "query" => Var::Query,
            "uri" => Var::Uri,
            _ => return None,
        })
    }
}

/// One piece of a template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    /// Text copied as it is.
    Literal(String),
    /// A part of the request.
    Var(Var),
    /// The text of a capture group of the step's regex (`$1`; `$0` is the
    /// whole match).
    Capture(usize),
}

/// A parsed template: `{scheme}`, `{host}`, `{path}`, `{query}` and
/// `{uri}` name parts of the request (where allowed), `$N` capture group
/// `N` of the step's regex, `$$` a `$`. Anything else is text.
#[derive(Clone, PartialEq, Eq)]
pub struct Template {
    source: String,
    parts: Vec<Part>,
}

impl fmt::Debug for Template {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.source, f)
    }
}

impl fmt::Display for Template {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)
    }
}

/// The longest template accepted.
const MAX_TEMPLATE: usize = 2048;

impl Template {
    /// Parses `source`. `vars`: whether `{name}` placeholders are allowed;
    /// `groups`: how many capture groups the step's regex has (`None`: no
    /// regex, so no `$N`). `field` names it in errors.
    pub fn parse(field: &str, source: &str, vars: bool, groups: Option<usize>) -> Result<Template, Invalid> {
        let bad = |why: String| Invalid::malformed(field, format!("{source:?}"), why);
        if source.is_empty() || source.len() > MAX_TEMPLATE {
            return Err(bad(format!("must be 1 to {MAX_TEMPLATE} bytes long")));
        }
        if source.bytes().any(|b| b.is_ascii_control() || b == b' ') {
            return Err(bad("must not hold spaces or control characters".into()));
        }
        let mut parts = Vec::new();
        let mut text = String::new();
        let mut rest = source;
        while let Some(c) = rest.chars().next() {
            match c {
                '$' => {
                    let digits: String = rest[1..].chars().take_while(char::is_ascii_digit).collect();
                    if rest[1..].starts_with('$') {
                        text.push('$');
                        rest = &rest[2..];
                        continue;
                    }
                    if digits.is_empty() {
                        return Err(bad("has a '$' that is neither `$N` (a capture group) nor `$$`".into()));
                    }
                    let n: usize = digits.parse().map_err(|_| bad(format!("${digits} is no capture group")))?;
                    match groups {
                        None => return Err(bad(format!("uses ${n}, but the step has no `regex`"))),
                        Some(g) if n > g => {
                            return Err(bad(format!("uses ${n}, but the regex has {g} capture group(s)")));
                        }
                        Some(_) => {}
                    }
                    flush(&mut text, &mut parts);
                    parts.push(Part::Capture(n));
                    rest = &rest[1 + digits.len()..];
                }
                '{' if vars => {
                    let Some(end) = rest.find('}') else {
                        return Err(bad("has a '{' without its '}'".into()));
                    };
                    let name = &rest[1..end];
                    let var = Var::parse(name).ok_or_else(|| {
                        bad(format!("names {{{name}}}; known are {{scheme}} {{host}} {{path}} {{query}} {{uri}}"))
                    })?;
                    flush(&mut text, &mut parts);
                    parts.push(Part::Var(var));
                    rest = &rest[end + 1..];
                }
                c => {
                    text.push(c);
                    rest = &rest[c.len_utf8()..];
                }
            }
        }
        flush(&mut text, &mut parts);
        Ok(Template { source: source.to_string(), parts })
    }

    /// The template as written.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// Its pieces, in order.
    pub fn parts(&self) -> &[Part] {
        &self.parts
    }

    /// Whether it starts with literal text that starts with `prefix`.
    pub fn starts_with_literal(&self, prefix: &str) -> bool {
        matches!(self.parts.first(), Some(Part::Literal(t)) if t.starts_with(prefix))
    }
}

fn flush(text: &mut String, parts: &mut Vec<Part>) {
    if !text.is_empty() {
        parts.push(Part::Literal(std::mem::take(text)));
    }
}

impl serde::Serialize for Template {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.source)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_vars_captures_and_text() {
        let t = Template::parse("location", "https://{host}/new/$1?$$x", true, Some(1)).unwrap();
        assert_eq!(
            t.parts(),
            &[
                Part::Literal("https://".into()),
                Part::Var(Var::Host),
                Part::Literal("/new/".into()),
                Part::Capture(1),
                Part::Literal("?$x".into()),
            ]
        );
    }

    #[test]
    fn refusals_name_the_field() {
        for (src, vars, groups, want) in [
            ("/x/{nope}", true, None, "names {nope}"),
            ("/x/{path", true, None, "without its '}'"),
            ("/x/$2", false, Some(1), "1 capture group"),
            ("/x/$1", true, None, "no `regex`"),
            ("/x/$a", true, Some(1), "neither"),
            ("/a b", true, None, "spaces"),
            ("", true, None, "1 to"),
        ] {
            let e = Template::parse("location", src, vars, groups).unwrap_err();
            assert_eq!(e.field, "location");
            assert!(e.to_string().contains(want), "{src}: {e}");
        }
        // Without vars, braces are text.
        assert_eq!(Template::parse("r", "/{x}", false, None).unwrap().parts(), &[Part::Literal("/{x}".into())]);
    }
}
