//! The Prometheus text exposition format, read just far enough to pick the
//! `node_exporter` samples the load sources need.

use std::borrow::Cow;

/// One sample line: `name{labels} value [timestamp]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample<'a> {
    /// The metric name.
    pub name: &'a str,
    /// The label set as written, without the braces (escapes kept).
    pub labels: &'a str,
    /// The value (`NaN`, `+Inf` and `-Inf` included).
    pub value: f64,
}

impl<'a> Sample<'a> {
    /// The value of the label `key`, unescaped, if the sample has it.
    pub fn label(&self, key: &str) -> Option<Cow<'a, str>> {
        Labels(self.labels).find(|(k, _)| *k == key).map(|(_, v)| v)
    }
}

/// The samples of an exposition, in order. Comments (`# HELP`, `# TYPE`)
/// and lines that do not parse are skipped.
pub fn samples(text: &str) -> impl Iterator<Item = Sample<'_>> {
    text.lines().filter_map(parse_line)
}

fn parse_line(line: &str) -> Option<Sample<'_>> {
    let line = line.trim_start();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line.find(|c: char| c == '{' || c.is_ascii_whitespace())?;
    let (name, mut rest) = line.split_at(name_end);
    let mut labels = "";
    if let Some(after) = rest.strip_prefix('{') {
        let close = closing_brace(after)?;
        labels = &after[..close];
        rest = &after[close + 1..];
    }
    let value = rest.split_ascii_whitespace().next()?.parse().ok()?;
    Some(Sample { name, labels, value })
}

/// Index of the `}` that ends a label set, skipping quoted values.
fn closing_brace(s: &str) -> Option<usize> {
    let mut quoted = false;
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '}' if !quoted => return Some(i),
            _ => {}
        }
    }
    None
}

/// Iterates `key="value"` pairs of a label set.
struct Labels<'a>(&'a str);

impl<'a> Iterator for Labels<'a> {
    type Item = (&'a str, Cow<'a, str>);

    fn next(&mut self) -> Option<Self::Item> {
        let s = self.0.trim_start_matches(|c: char| c == ',' || c.is_ascii_whitespace());
        let (key, rest) = s.split_once('=')?;
        let rest = rest.trim_start().strip_prefix('"')?;
        let mut escaped = false;
        let end = rest.char_indices().find_map(|(i, c)| match c {
            _ if escaped => {
                escaped = false;
                None
            }
            '\\' => {
                escaped = true;
                None
            }
            '"' => Some(i),
            _ => None,
        })?;
        self.0 = &rest[end + 1..];
        Some((key.trim(), unescape(&rest[..end])))
    }
}

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

/// Network byte counters of a host, summed over the devices that count.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NetCounters {
    /// Received plus transmitted bytes since boot.
    pub bytes: f64,
    /// Whether the sum is over the loopback device `lo` (used only when no
    /// other device shows any traffic, as on a loopback-only test machine).
    pub loopback: bool,
}

/// What one `node_exporter` scrape says about its host.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct NodeSample {
    /// `node_cpu_seconds_total` summed over all CPUs and modes.
    pub cpu_total_s: Option<f64>,
    /// Of which in mode `idle`.
    pub cpu_idle_s: f64,
    /// `node_memory_MemAvailable_bytes`.
    pub mem_available: Option<f64>,
    /// `node_memory_MemTotal_bytes`.
    pub mem_total: Option<f64>,
    /// `node_network_{receive,transmit}_bytes_total` over the non-`lo`
    /// devices, or over `lo` when no other device has any traffic.
    pub net: Option<NetCounters>,
}

impl NodeSample {
    /// Reads the samples out of an exposition.
    pub fn parse(text: &str) -> NodeSample {
        let mut s = NodeSample::default();
        let (mut other, mut other_seen, mut lo, mut lo_seen) = (0.0, false, 0.0, false);
        for sample in samples(text) {
            if !sample.value.is_finite() {
                continue;
            }
            match sample.name {
                "node_cpu_seconds_total" => {
                    *s.cpu_total_s.get_or_insert(0.0) += sample.value;
                    if sample.label("mode").as_deref() == Some("idle") {
                        s.cpu_idle_s += sample.value;
                    }
                }
                "node_memory_MemAvailable_bytes" => s.mem_available = Some(sample.value),
                "node_memory_MemTotal_bytes" => s.mem_total = Some(sample.value),
                "node_network_receive_bytes_total" | "node_network_transmit_bytes_total" => {
                    if sample.label("device").as_deref() == Some("lo") {
                        (lo, lo_seen) = (lo + sample.value, true);
                    } else {
                        (other, other_seen) = (other + sample.value, true);
                    }
                }
                _ => {}
            }
        }
        s.net = if other > 0.0 || (other_seen && !lo_seen) {
            Some(NetCounters { bytes: other, loopback: false })
        } else if lo_seen {
            Some(NetCounters { bytes: lo, loopback: true })
        } else {
            None
        };
        s
    }

    /// Whether the scrape had anything this crate uses.
    pub fn is_empty(&self) -> bool {
        self.cpu_total_s.is_none() && self.mem_total.is_none() && self.net.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RECORDED: &str = include_str!("../testdata/node-exporter-1.txt");

    #[test]
    fn sample_lines_with_labels_escapes_and_special_values() {
        let text = "# HELP x A help line.\n# TYPE x counter\n\
            x 1\n\
            y{a=\"1\",b=\"q\\\"}{,\\\\\\n\"} 2.5e3 1700000000000\n\
            z{} NaN\n  w{a=\"x\",} +Inf\n\
            broken{a=\"1\" 3\nnovalue\n";
        let got: Vec<Sample<'_>> = samples(text).collect();
        assert_eq!(got.len(), 4, "{got:?}");
        assert_eq!((got[0].name, got[0].value), ("x", 1.0));
        assert_eq!((got[1].name, got[1].value), ("y", 2500.0));
        assert_eq!(got[1].label("a").as_deref(), Some("1"));
        assert_eq!(got[1].label("b").as_deref(), Some("q\"}{,\\\n"));
        assert_eq!(got[1].label("c"), None);
        assert!(got[2].value.is_nan());
        assert_eq!((got[3].name, got[3].value), ("w", f64::INFINITY));
        assert_eq!(got[3].label("a").as_deref(), Some("x"));
    }

    #[test]
    fn a_recorded_scrape_gives_cpu_memory_and_network() {
        let s = NodeSample::parse(RECORDED);
        assert_eq!(samples(RECORDED).count(), RECORDED.lines().filter(|l| !l.starts_with('#')).count());
        // Two CPUs, eight modes each, as recorded.
        let total =
            1357.26 + 3.06 + 141.47 + 0.13 + 311.43 + 733.61 + 1224.98 + 24.26 + 139.42 + 0.16 + 338.91 + 822.84;
        assert!((s.cpu_total_s.unwrap() - total).abs() < 1e-6, "{s:?}");
        assert!((s.cpu_idle_s - (1357.26 + 1224.98)).abs() < 1e-6);
        assert_eq!(s.mem_available, Some(2.4846876672e10));
        assert_eq!(s.mem_total, Some(2.5276502016e10));
        // node_exporter excludes lo by default; eth0 has the traffic.
        assert_eq!(s.net, Some(NetCounters { bytes: 1.22198233e8 + 345466.0, loopback: false }));
        assert!(!s.is_empty());
        assert!(NodeSample::parse("# nothing\nother_metric 1\n").is_empty());
    }

    #[test]
    fn loopback_counts_only_when_no_other_device_has_traffic() {
        let lines = |devs: &[(&str, f64)]| {
            devs.iter()
                .map(|(d, v)| {
                    format!("node_network_receive_bytes_total{{device=\"{d}\"}} {v}\nnode_network_transmit_bytes_total{{device=\"{d}\"}} {v}\n")
                })
                .collect::<String>()
        };
        let net = |devs: &[(&str, f64)]| NodeSample::parse(&lines(devs)).net;
        assert_eq!(net(&[("lo", 5.0)]), Some(NetCounters { bytes: 10.0, loopback: true }));
        assert_eq!(net(&[("lo", 5.0), ("ifb0", 0.0)]), Some(NetCounters { bytes: 10.0, loopback: true }));
        assert_eq!(net(&[("lo", 5.0), ("eth0", 1.0)]), Some(NetCounters { bytes: 2.0, loopback: false }));
        assert_eq!(net(&[("eth0", 0.0)]), Some(NetCounters { bytes: 0.0, loopback: false }));
        assert_eq!(net(&[]), None);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(500))]

        /// Arbitrary text and exposition-shaped noise: every sample read
        /// has a name, and nothing panics.
        #[test]
        fn any_text_reads_without_panic(
            noise in "\\PC{0,400}",
            shaped in "([a-z_]{1,8}(\\{([a-z]{1,3}=\"[^\"\\n]{0,5}\",?){0,3}\\})? [-+0-9.eNaInf]{0,8}( [0-9]{0,5})?\n|# [A-Z]{4} [a-z_ ]{0,10}\n){0,30}",
        ) {
            for text in [noise.as_str(), shaped.as_str()] {
                for s in samples(text) {
                    proptest::prop_assert!(!s.name.is_empty());
                }
            }
        }
    }
}
