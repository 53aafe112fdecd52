//! The Prometheus text exposition format (version 0.0.4), line by line:
//! `name{label="value",...} value [timestamp]`, `#` comments (`# HELP`,
//! `# TYPE`) and blank lines.
//!
//! A sample line is read whole or not at all: a metric or label name that
//! is not one, an unterminated label value, a value that is not a number or
//! a timestamp that is not an integer makes the line skipped, never a
//! sample with some other meaning. Label values may hold any text, `}`,
//! `,`, `=` and escaped quotes included (`\\`, `\"` and `\n` are the
//! escapes); values may be `NaN`, `+Inf` and `-Inf`.

use std::borrow::Cow;

/// One sample line: `name{labels} value [timestamp]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample<'a> {
    /// The metric name.
    pub name: &'a str,
    /// The label set as written, without the braces (escapes kept); every
    /// pair in it is well formed.
    pub labels: &'a str,
    /// The value (`NaN`, `+Inf` and `-Inf` included).
    pub value: f64,
    /// The timestamp, in milliseconds since the Unix epoch, if written.
    pub timestamp_ms: Option<i64>,
}

impl<'a> Sample<'a> {
    /// The value of the label `key`, unescaped, if the sample has it.
    pub fn label(&self, key: &str) -> Option<Cow<'a, str>> {
        self.label_pairs().find(|(k, _)| *k == key).map(|(_, v)| v)
    }

    /// The labels, in order: name and unescaped value.
    pub fn label_pairs(&self) -> impl Iterator<Item = (&'a str, Cow<'a, str>)> {
        let mut rest = self.labels;
        std::iter::from_fn(move || {
            let (name, raw, after) = label_pair(rest.trim_start_matches([' ', '\t', ',']))?;
            rest = after;
            Some((name, unescape(raw)))
        })
    }
}

/// The samples of an exposition, in order. Comments, blank lines and lines
/// that do not parse are skipped.
pub fn samples(text: &str) -> impl Iterator<Item = Sample<'_>> {
    text.lines().filter_map(parse_line)
}

/// Reads one line; `None` for a comment, a blank line or a line that is not
/// a well-formed sample.
pub fn parse_line(line: &str) -> Option<Sample<'_>> {
    let line = line.trim_start_matches([' ', '\t']);
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line.find(|c: char| !is_name_char(c, true)).unwrap_or(line.len());
    let (name, rest) = line.split_at(name_end);
    if !is_metric_name(name) {
        return None;
    }
    // The value follows blanks, or directly the label set's `}`.
    let (labels, rest) = match rest.strip_prefix('{') {
        Some(after) => {
            let len = label_set_len(after)?;
            (&after[..len], &after[len + 1..])
        }
        None if rest.starts_with([' ', '\t']) => ("", rest),
        None => return None,
    };
    let mut fields = rest.split([' ', '\t']).filter(|f| !f.is_empty());
    let value = parse_value(fields.next()?)?;
    let timestamp_ms = match fields.next() {
        Some(t) => Some(t.parse::<i64>().ok()?),
        None => None,
    };
    if fields.next().is_some() {
        return None;
    }
    Some(Sample { name, labels, value, timestamp_ms })
}

/// A sample value: a float as Go's `strconv.ParseFloat` writes them, or
/// `NaN`, `+Inf`, `-Inf`.
fn parse_value(s: &str) -> Option<f64> {
    match s {
        "NaN" => Some(f64::NAN),
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        // Rust also reads `inf`, `infinity` and `nan` in any case: refuse
        // the spellings the format does not have.
        _ if s.bytes().any(|b| b.is_ascii_alphabetic() && b != b'e' && b != b'E') => None,
        _ => s.parse().ok(),
    }
}

fn is_name_char(c: char, colon: bool) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || (colon && c == ':')
}

fn is_metric_name(s: &str) -> bool {
    s.chars().next().is_some_and(|c| !c.is_ascii_digit()) && s.chars().all(|c| is_name_char(c, true))
}

fn is_label_name(s: &str) -> bool {
    s.chars().next().is_some_and(|c| !c.is_ascii_digit()) && s.chars().all(|c| is_name_char(c, false))
}

/// The length of a label set up to (not including) its closing `}`, if
/// every pair in it is well formed: `name="value"` separated by commas,
/// with blanks around them and one trailing comma allowed.
fn label_set_len(s: &str) -> Option<usize> {
    let mut rest = s;
    loop {
        let trimmed = rest.trim_start_matches([' ', '\t']);
        if let Some(after) = trimmed.strip_prefix('}') {
            return Some(s.len() - after.len() - 1);
        }
        let (_, _, after) = label_pair(trimmed)?;
        let after = after.trim_start_matches([' ', '\t']);
        rest = match after.strip_prefix(',') {
            Some(next) => next,
            None if after.starts_with('}') => after,
            None => return None,
        };
    }
}

/// The `name="value"` pair that `s` starts with: its name, its raw
/// (escaped) value and what follows the closing quote.
fn label_pair(s: &str) -> Option<(&str, &str, &str)> {
    let name_end = s.find(|c: char| !is_name_char(c, false))?;
    let (name, rest) = s.split_at(name_end);
    if !is_label_name(name) {
        return None;
    }
    let rest = rest.trim_start_matches([' ', '\t']).strip_prefix('=')?;
    let rest = rest.trim_start_matches([' ', '\t']).strip_prefix('"')?;
    let mut escaped = false;
    for (i, c) in rest.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '"' => return Some((name, &rest[..i], &rest[i + 1..])),
            _ => {}
        }
    }
    None
}

/// A label value with its escapes (`\\`, `\"`, `\n`) resolved; any other
/// escaped character stands for itself.
fn unescape(raw: &str) -> Cow<'_, str> {
    if !raw.contains('\\') {
        return Cow::Borrowed(raw);
    }
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some(other) => out.push(other),
            None => out.push('\\'),
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn sample_lines_with_labels_escapes_special_values_and_timestamps() {
        let text = "# HELP x A help line.\n# TYPE x counter\n\
            x 1\n\
            y{a=\"1\",b=\"q\\\"}{,\\\\\\n\"} 2.5e3 1700000000000\n\
            z{} NaN\n  w{a=\"x\",} +Inf\n\
            v{ a = \"}\" , b=\"=,\" }-Inf\n\
            \n\
            broken{a=\"1\" 3\nnovalue\n";
        let got: Vec<Sample<'_>> = samples(text).collect();
        assert_eq!(got.len(), 5, "{got:?}");
        assert_eq!((got[0].name, got[0].value, got[0].timestamp_ms), ("x", 1.0, None));
        assert_eq!((got[1].name, got[1].value, got[1].timestamp_ms), ("y", 2500.0, Some(1_700_000_000_000)));
        assert_eq!(got[1].label("a").as_deref(), Some("1"));
        assert_eq!(got[1].label("b").as_deref(), Some("q\"}{,\\\n"));
        assert_eq!(got[1].label("c"), None);
        assert!(got[2].value.is_nan());
        assert_eq!((got[3].name, got[3].value), ("w", f64::INFINITY));
        assert_eq!(got[3].label("a").as_deref(), Some("x"));
        assert_eq!((got[4].name, got[4].value), ("v", f64::NEG_INFINITY));
        let pairs: Vec<_> = got[4].label_pairs().map(|(k, v)| (k, v.into_owned())).collect();
        assert_eq!(pairs, [("a", "}".to_string()), ("b", "=,".to_string())]);
    }

    /// The case of the old distributor parser, which cut the label set at
    /// the first `}`: a `}` inside a value neither ends the set nor hides
    /// the `mode` label after it.
    #[test]
    fn a_brace_inside_a_label_value_does_not_end_the_label_set() {
        let s = parse_line("node_cpu_seconds_total{note=\"a}b\",mode=\"idle\"} 7").expect("sample");
        assert_eq!((s.name, s.value), ("node_cpu_seconds_total", 7.0));
        assert_eq!(s.label("mode").as_deref(), Some("idle"));
        assert_eq!(s.label("note").as_deref(), Some("a}b"));
    }

    #[test]
    fn malformed_lines_are_skipped_whole() {
        for line in [
            "1abc 1",
            "a-b 1",
            "x{a=1} 1",
            "x{a=\"1\" b=\"2\"} 1",
            "x{1a=\"1\"} 1",
            "x{a=\"1\"",
            "x{a=\"1} 1",
            "x{,} 1",
            "x{a=\"1\",,} 1",
            "x 1 2 3",
            "x 1 1.5",
            "x one",
            "x inf",
            "x nan",
            "x Infinity",
            "x",
            "x{}",
            "{a=\"1\"} 1",
            "# x 1",
        ] {
            assert_eq!(parse_line(line), None, "{line:?}");
        }
        assert_eq!(parse_line("x{}1").map(|s| s.value), Some(1.0));
        assert_eq!(parse_line("a:b_c\t-1.5e-3\t-12").map(|s| (s.value, s.timestamp_ms)), Some((-1.5e-3, Some(-12))));
    }

    /// Writes a label value as the format escapes it.
    fn escape(v: &str) -> String {
        v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(500))]

        /// Arbitrary text and exposition-shaped noise: nothing panics, and
        /// every sample read has a valid name and well-formed labels.
        #[test]
        fn any_text_reads_without_panic(
            noise in "\\PC{0,400}",
            shaped in "([a-z_]{1,8}(\\{([a-z]{1,3}=\"[^\"\\n]{0,5}\",?){0,3}\\})? [-+0-9.eNaInf]{0,8}( [0-9]{0,5})?\n|# [A-Z]{4} [a-z_ ]{0,10}\n){0,30}",
        ) {
            for text in [noise.as_str(), shaped.as_str()] {
                for s in samples(text) {
                    prop_assert!(is_metric_name(s.name));
                    prop_assert!(s.label_pairs().all(|(k, _)| is_label_name(k)));
                }
            }
        }

        /// Any sample written in the format, labels with any text in their
        /// values (quotes, backslashes, newlines, braces, commas), reads
        /// back as written.
        #[test]
        fn written_samples_read_back(
            name in "[a-zA-Z_:][a-zA-Z0-9_:]{0,12}",
            labels in proptest::collection::vec(("[a-zA-Z_][a-zA-Z0-9_]{0,6}", "[ -~\\n{}\",=\\\\é]{0,12}"), 0..4),
            value in prop_oneof![any::<f64>(), Just(f64::NAN), Just(f64::INFINITY), Just(f64::NEG_INFINITY)],
            timestamp in proptest::option::of(any::<i64>()),
            trailing_comma in any::<bool>(),
        ) {
            let value_text = if value.is_nan() {
                "NaN".to_string()
            } else if value.is_infinite() {
                if value > 0.0 { "+Inf".to_string() } else { "-Inf".to_string() }
            } else {
                format!("{value:?}")
            };
            let set: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{}\"", escape(v))).collect();
            let mut line = name.clone();
            if !set.is_empty() || trailing_comma {
                let comma = if trailing_comma && !set.is_empty() { "," } else { "" };
                line.push_str(&format!("{{{}{comma}}}", set.join(",")));
            }
            line.push(' ');
            line.push_str(&value_text);
            if let Some(t) = timestamp {
                line.push_str(&format!(" {t}"));
            }
            let s = parse_line(&line);
            prop_assert!(s.is_some(), "{line:?}");
            let s = s.unwrap_or(Sample { name: "", labels: "", value: 0.0, timestamp_ms: None });
            prop_assert_eq!(s.name, name.as_str());
            prop_assert!(s.value == value || (s.value.is_nan() && value.is_nan()), "{} != {}", s.value, value);
            prop_assert_eq!(s.timestamp_ms, timestamp);
            let got: Vec<(String, String)> = s.label_pairs().map(|(k, v)| (k.to_string(), v.into_owned())).collect();
            prop_assert_eq!(got, labels);
        }
    }
}
