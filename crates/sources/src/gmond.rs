//! Ganglia `gmond` XML dumps, read just far enough to get each host's CPU,
//! memory and network metrics.
//!
//! gmond answers a TCP connection with one document: a DTD, then
//! `<GANGLIA_XML>`, optional `<GRID>`/`<CLUSTER>` wrappers, and per host
//! `<HOST NAME=".." IP=".." TN=".." TMAX="..">` holding
//! `<METRIC NAME=".." VAL=".." .../>` elements. Only start and end tags and
//! their attributes matter here, so this is a small tag scanner rather than
//! a full XML parser. Documents are ISO-8859-1, so bytes map to chars one to
//! one.

/// One `<HOST>` of a dump, with the metrics the load sources use.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GmondHost {
    /// The `NAME` attribute (a host name).
    pub name: String,
    /// The `IP` attribute.
    pub ip: String,
    /// `TN`: seconds since gmond last heard from the host.
    pub tn: Option<f64>,
    /// `TMAX`: the longest expected gap between reports, seconds.
    pub tmax: Option<f64>,
    /// `cpu_idle`, percent.
    pub cpu_idle: Option<f64>,
    /// `mem_total`, KB.
    pub mem_total: Option<f64>,
    /// `mem_free`, KB.
    pub mem_free: Option<f64>,
    /// `mem_cached`, KB.
    pub mem_cached: Option<f64>,
    /// `mem_buffers`, KB.
    pub mem_buffers: Option<f64>,
    /// `bytes_in`, bytes/s.
    pub bytes_in: Option<f64>,
    /// `bytes_out`, bytes/s.
    pub bytes_out: Option<f64>,
}

impl GmondHost {
    /// Whether gmond still considers the host up: heard from within four
    /// `TMAX` (gmetad's rule). Hosts without the attributes count as up.
    pub fn is_up(&self) -> bool {
        match (self.tn, self.tmax) {
            (Some(tn), Some(tmax)) if tmax > 0.0 => tn <= 4.0 * tmax,
            _ => true,
        }
    }

    fn set_metric(&mut self, name: &str, val: &str) {
        let slot = match name {
            "cpu_idle" => &mut self.cpu_idle,
            "mem_total" => &mut self.mem_total,
            "mem_free" => &mut self.mem_free,
            "mem_cached" => &mut self.mem_cached,
            "mem_buffers" => &mut self.mem_buffers,
            "bytes_in" => &mut self.bytes_in,
            "bytes_out" => &mut self.bytes_out,
            _ => return,
        };
        *slot = val.trim().parse().ok().filter(|v: &f64| v.is_finite());
    }
}

/// Most hosts read from one dump; the rest is ignored. A real cluster has
/// far fewer, and each host read costs memory, so a hostile dump of
/// millions of tiny hosts stays small.
pub const MAX_HOSTS: usize = 10_000;

/// The hosts of a dump, in document order, at most [`MAX_HOSTS`].
/// Malformed parts are skipped; a truncated document yields the hosts seen
/// so far.
pub fn parse(xml: &[u8]) -> Vec<GmondHost> {
    let mut hosts = Vec::new();
    let mut current: Option<GmondHost> = None;
    let mut tags = Tags { xml, pos: 0 };
    while let Some(tag) = tags.next_tag() {
        if hosts.len() >= MAX_HOSTS {
            current = None;
            break;
        }
        match tag {
            Tag::Start { name: "HOST", attrs } => {
                hosts.extend(current.take());
                let mut host = GmondHost::default();
                for (k, v) in Attrs(attrs) {
                    match k {
                        "NAME" => host.name = v,
                        "IP" => host.ip = v,
                        "TN" => host.tn = v.parse().ok(),
                        "TMAX" => host.tmax = v.parse().ok(),
                        _ => {}
                    }
                }
                current = Some(host);
            }
            Tag::Start { name: "METRIC", attrs } => {
                if let Some(host) = current.as_mut() {
                    let (mut name, mut val) = (None, None);
                    for (k, v) in Attrs(attrs) {
                        match k {
                            "NAME" => name = Some(v),
                            "VAL" => val = Some(v),
                            _ => {}
                        }
                    }
                    if let (Some(name), Some(val)) = (name, val) {
                        host.set_metric(&name, &val);
                    }
                }
            }
            Tag::End("HOST") => hosts.extend(current.take()),
            _ => {}
        }
    }
    hosts.extend(current);
    hosts
}

enum Tag<'a> {
    Start { name: &'a str, attrs: &'a [u8] },
    End(&'a str),
    Other,
}

struct Tags<'a> {
    xml: &'a [u8],
    pos: usize,
}

impl<'a> Tags<'a> {
    fn find(&self, from: usize, needle: &[u8]) -> Option<usize> {
        self.xml.get(from..)?.windows(needle.len()).position(|w| w == needle).map(|i| from + i)
    }

    fn next_tag(&mut self) -> Option<Tag<'a>> {
        let open = self.pos + self.xml.get(self.pos..)?.iter().position(|&b| b == b'<')?;
        let body = &self.xml[open + 1..];
        // Comments, CDATA, processing instructions and declarations (the
        // DTD's `<!ELEMENT ...>` lines each end at their own `>`).
        let skip_to = |this: &Self, end: &[u8]| this.find(open + 1, end).map(|i| i + end.len());
        if body.starts_with(b"!--") {
            self.pos = skip_to(self, b"-->")?;
            return Some(Tag::Other);
        }
        if body.starts_with(b"![CDATA[") {
            self.pos = skip_to(self, b"]]>")?;
            return Some(Tag::Other);
        }
        if body.starts_with(b"?") {
            self.pos = skip_to(self, b"?>")?;
            return Some(Tag::Other);
        }
        if body.starts_with(b"!") {
            self.pos = skip_to(self, b">")?;
            return Some(Tag::Other);
        }
        let end = open + 1 + tag_end(body)?;
        self.pos = end + 1;
        let inner = &self.xml[open + 1..end];
        if let Some(name) = inner.strip_prefix(b"/") {
            return Some(Tag::End(std::str::from_utf8(name.trim_ascii()).unwrap_or("")));
        }
        let inner = inner.strip_suffix(b"/").unwrap_or(inner);
        let name_len = inner.iter().position(|b| b.is_ascii_whitespace()).unwrap_or(inner.len());
        let name = std::str::from_utf8(&inner[..name_len]).unwrap_or("");
        Some(Tag::Start { name, attrs: &inner[name_len..] })
    }
}

/// Index of the `>` that closes a tag, skipping quoted attribute values.
fn tag_end(body: &[u8]) -> Option<usize> {
    let mut quote = None;
    for (i, &b) in body.iter().enumerate() {
        match (quote, b) {
            (None, b'"' | b'\'') => quote = Some(b),
            (Some(q), _) if q == b => quote = None,
            (None, b'>') => return Some(i),
            _ => {}
        }
    }
    None
}

/// Iterates `KEY="value"` attributes, values decoded.
struct Attrs<'a>(&'a [u8]);

impl<'a> Iterator for Attrs<'a> {
    type Item = (&'a str, String);

    fn next(&mut self) -> Option<Self::Item> {
        let s = self.0.trim_ascii_start();
        let eq = s.iter().position(|&b| b == b'=')?;
        let key = std::str::from_utf8(s[..eq].trim_ascii()).unwrap_or("");
        let rest = s[eq + 1..].trim_ascii_start();
        let (&q, rest) = rest.split_first().filter(|(q, _)| matches!(q, b'"' | b'\''))?;
        let close = rest.iter().position(|&b| b == q)?;
        self.0 = &rest[close + 1..];
        Some((key, decode(&rest[..close])))
    }
}

/// Latin-1 bytes to a string, with XML's predefined and numeric entities.
fn decode(raw: &[u8]) -> String {
    let text: String = raw.iter().map(|&b| char::from(b)).collect();
    if !text.contains('&') {
        return text;
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text.as_str();
    while let Some(amp) = rest.find('&') {
        out.push_str(&rest[..amp]);
        let after = &rest[amp + 1..];
        let entity = after.find(';').filter(|&i| i <= 10).map(|i| (&after[..i], &after[i + 1..]));
        let decoded = entity.and_then(|(name, tail)| {
            let c = match name {
                "amp" => Some('&'),
                "lt" => Some('<'),
                "gt" => Some('>'),
                "quot" => Some('"'),
                "apos" => Some('\''),
                _ => name
                    .strip_prefix("#x")
                    .map(|h| u32::from_str_radix(h, 16))
                    .or_else(|| name.strip_prefix('#').map(str::parse))
                    .and_then(Result::ok)
                    .and_then(char::from_u32),
            };
            c.map(|c| (c, tail))
        });
        match decoded {
            Some((c, tail)) => {
                out.push(c);
                rest = tail;
            }
            None => {
                out.push('&');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const RECORDED: &[u8] = include_bytes!("../testdata/gmond-localhost.xml");

    #[test]
    fn a_recorded_gmond_dump_has_one_host_with_its_metrics() {
        let hosts = parse(RECORDED);
        assert_eq!(hosts.len(), 1, "the DTD's HOST declarations are not hosts: {hosts:?}");
        let h = &hosts[0];
        assert_eq!((h.name.as_str(), h.ip.as_str()), ("localhost", "127.0.0.1"));
        assert_eq!((h.tn, h.tmax), (Some(5.0), Some(20.0)));
        assert!(h.is_up());
        assert_eq!(h.cpu_idle, Some(50.2));
        assert_eq!((h.mem_total, h.mem_free), (Some(24684084.0), Some(22264880.0)));
        assert_eq!((h.mem_cached, h.mem_buffers), (Some(2075184.0), Some(20676.0)));
        assert_eq!((h.bytes_in, h.bytes_out), (Some(0.07), Some(0.0)));
    }

    #[test]
    fn several_hosts_entities_quotes_and_truncation() {
        let xml = br#"<?xml version="1.0" encoding="ISO-8859-1"?>
<!-- <HOST NAME="comment"> -->
<GANGLIA_XML><GRID NAME="g"><CLUSTER NAME="c">
<HOSTS UP="2" DOWN="0" SOURCE="gmetad"/>
<HOST NAME="a&amp;b" IP='10.0.0.1' TN="100" TMAX="20">
<METRIC NAME="cpu_idle" VAL="25" TYPE="float" UNITS="%" DESC="a > b"/>
<METRIC NAME="os_name" VAL="Linux"/>
</HOST>
<HOST NAME="web-2" IP="10.0.0.2"><METRIC NAME="bytes_in" VAL="&#49;2&#x33;" TYPE="float"></METRIC>
<METRIC NAME="bytes_out" VAL="oops"/></HOST>
<HOST NAME="cut" IP="10.0.0.3"><METRIC NAME="cpu_idle" VAL="90"/><METRIC NAME="mem_fr"#;
        let hosts = parse(xml);
        let names: Vec<&str> = hosts.iter().map(|h| h.name.as_str()).collect();
        assert_eq!(names, ["a&b", "web-2", "cut"]);
        assert_eq!(hosts[0].ip, "10.0.0.1");
        assert_eq!(hosts[0].cpu_idle, Some(25.0));
        assert!(!hosts[0].is_up(), "TN 100 > 4 x TMAX 20");
        assert_eq!((hosts[1].bytes_in, hosts[1].bytes_out), (Some(123.0), None));
        assert!(hosts[1].is_up());
        assert_eq!(hosts[2].cpu_idle, Some(90.0));
        assert!(parse(b"").is_empty());
        assert!(parse(b"not xml at all <<<>").is_empty());
    }

    #[test]
    fn entities_decode_and_unknown_ones_stay() {
        assert_eq!(decode(b"&lt;&gt;&quot;&apos;&#65;&#x42; &bogus; & x"), "<>\"'AB &bogus; & x");
        assert_eq!(decode(b"caf\xe9"), "caf\u{e9}");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(500))]

        /// Arbitrary bytes and XML-shaped noise: no panic, and no host
        /// without a name or address appears from nothing.
        #[test]
        fn any_dump_parses_without_panic(
            noise in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..2000),
            shaped in "(<HOST( NAME=\"[a-z]{0,4}\"| IP='[0-9.]{0,8}'| TN=\"[0-9x]{0,3}\"){0,3}/?>|<METRIC NAME=\"(cpu_idle|mem_free|bytes_in)\" VAL=\"[0-9.&#;x]{0,6}\"/?>|</HOST>|&[a-z#0-9]{0,5};|<!--|-->|<[^>]{0,8}>){0,40}",
        ) {
            let _ = parse(&noise);
            let _ = parse(shaped.as_bytes());
        }
    }

    #[test]
    fn a_dump_of_countless_hosts_reads_at_most_max_hosts() {
        let dump: String = (0..MAX_HOSTS + 500).map(|i| format!(r#"<HOST NAME="h{i}" IP="10.0.0.1"/>"#)).collect();
        let hosts = parse(dump.as_bytes());
        assert_eq!(hosts.len(), MAX_HOSTS);
        assert_eq!(hosts[0].name, "h0");
    }
}
