//! The PROXY protocol, versions 1 and 2 (HAProxy's specification,
//! "The PROXY protocol", 2020 revision): a TCP load balancer in front of
//! Tidegate (an AWS NLB, HAProxy in TCP mode) puts one header before the
//! connection's own bytes, telling the address of the client it accepted.
//! Without it every request would appear to come from the balancer.
//!
//! [`parse`] reads a header from the bytes received so far: pure, no IO.
//! The caller reads only what [`Parsed::Header`] says the header took, so
//! the client's first bytes after it stay unread. [`encode`] writes one,
//! for a proxy that tells its own backends whom it relays.
//!
//! - Version 1 is text: `PROXY TCP4 192.0.2.1 198.51.100.2 56324 443\r\n`
//!   (or `TCP6`, or `UNKNOWN` with anything up to the line's end), 107
//!   bytes at most.
//! - Version 2 is binary: a 12-byte signature, a version and command byte,
//!   an address family byte, a 2-byte length, then the addresses and
//!   optional TLVs (ignored here). Command `LOCAL` (the balancer's own
//!   health check) and families other than TCP over IPv4 or IPv6 carry no
//!   client to use.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// Version 1's longest header, `\r\n` included.
pub const MAX_V1: usize = 107;

/// Version 2's signature.
pub const V2_SIGNATURE: [u8; 12] = *b"\r\n\r\n\0\r\nQUIT\n";

/// The longest version 2 header accepted: the fixed 16 bytes and 2 KiB of
/// addresses and TLVs (a balancer's TLVs, such as AWS's endpoint id or an
/// SSL summary, take a few hundred bytes; the format allows 64 KiB).
pub const MAX_V2: usize = 16 + 2048;

const V1_PREFIX: &[u8] = b"PROXY ";

/// What a header says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Header {
    /// The balancer relays a client: its address and the one it connected
    /// to.
    Proxied {
        /// The client's address.
        source: SocketAddr,
        /// The address the client connected to (the balancer's).
        destination: SocketAddr,
    },
    /// No client to tell: version 2's `LOCAL` command (the balancer's own
    /// connection, a health check), version 1's `UNKNOWN`, or an address
    /// family other than TCP over IPv4 or IPv6. The connection's own peer
    /// address stands.
    Local,
}

/// The outcome of [`parse`] on the bytes received so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parsed {
    /// A whole header, `len` bytes long.
    Header {
        /// What it says.
        header: Header,
        /// How many bytes it took.
        len: usize,
    },
    /// A header's beginning: every byte so far belongs to it (none of the
    /// client's own), and more are needed.
    Incomplete,
}

/// Why the bytes are not a PROXY protocol header.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// They start with neither version's signature.
    #[error("no PROXY protocol header")]
    NotProxy,
    /// A version 1 line longer than 107 bytes, or a version 2 header
    /// longer than [`MAX_V2`].
    #[error("PROXY protocol header too long")]
    TooLong,
    /// A version 1 line that does not follow the format.
    #[error("malformed PROXY protocol v1 header: {0}")]
    V1(&'static str),
    /// A version 2 header that does not follow the format.
    #[error("malformed PROXY protocol v2 header: {0}")]
    V2(&'static str),
}

/// Which version of the protocol to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Version {
    /// Text, one line.
    V1,
    /// Binary.
    V2,
}

/// Writes `header` in `version`, to go before a connection's own bytes.
///
/// Both addresses of a header share one family: when one is IPv4 and the
/// other IPv6, the IPv4 one is written as an IPv4-mapped IPv6 address (an
/// IPv4-mapped address given with an IPv4 one is written as IPv4 first).
/// [`Header::Local`] is version 1's `UNKNOWN` and version 2's `LOCAL`
/// command: the connection is the proxy's own (a health check).
pub fn encode(version: Version, header: &Header) -> Vec<u8> {
    let (source, destination) = match *header {
        Header::Local => return local(version),
        Header::Proxied { source, destination } => one_family(source, destination),
    };
    match version {
        Version::V1 => {
            let family = if source.is_ipv4() { "TCP4" } else { "TCP6" };
            let (s, d) = (source.ip(), destination.ip());
            let (sp, dp) = (source.port(), destination.port());
            format!("PROXY {family} {s} {d} {sp} {dp}\r\n").into_bytes()
        }
        Version::V2 => {
            let mut out = V2_SIGNATURE.to_vec();
            out.push(0x21); // version 2, PROXY
            let addrs = match (source.ip(), destination.ip()) {
                (IpAddr::V4(s), IpAddr::V4(d)) => {
                    out.push(0x11);
                    [s.octets().as_slice(), &d.octets()].concat()
                }
                (s, d) => {
                    out.push(0x21);
                    [v6(s).octets().as_slice(), &v6(d).octets()].concat()
                }
            };
            out.extend_from_slice(&(addrs.len() as u16 + 4).to_be_bytes());
            out.extend_from_slice(&addrs);
            out.extend_from_slice(&source.port().to_be_bytes());
            out.extend_from_slice(&destination.port().to_be_bytes());
            out
        }
    }
}

/// A header that names no client.
fn local(version: Version) -> Vec<u8> {
    match version {
        Version::V1 => b"PROXY UNKNOWN\r\n".to_vec(),
        Version::V2 => {
            let mut out = V2_SIGNATURE.to_vec();
            out.extend_from_slice(&[0x20, 0x00, 0x00, 0x00]); // version 2, LOCAL, no address
            out
        }
    }
}

/// The two addresses in one family: IPv4 when both are (or map to) IPv4,
/// else both IPv6.
fn one_family(source: SocketAddr, destination: SocketAddr) -> (SocketAddr, SocketAddr) {
    let unmapped = |a: SocketAddr| match a.ip() {
        IpAddr::V6(ip) => ip.to_ipv4_mapped().map_or(a, |v4| SocketAddr::new(IpAddr::V4(v4), a.port())),
        IpAddr::V4(_) => a,
    };
    let (s, d) = (unmapped(source), unmapped(destination));
    if s.is_ipv4() == d.is_ipv4() {
        return (s, d);
    }
    let mapped = |a: SocketAddr| SocketAddr::new(IpAddr::V6(v6(a.ip())), a.port());
    (mapped(s), mapped(d))
}

fn v6(ip: IpAddr) -> Ipv6Addr {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    }
}

/// Reads a PROXY protocol header (either version) from the start of `buf`.
pub fn parse(buf: &[u8]) -> Result<Parsed, Error> {
    if is_prefix_of(buf, &V2_SIGNATURE) {
        return if buf.len() < V2_SIGNATURE.len() { Ok(Parsed::Incomplete) } else { parse_v2(buf) };
    }
    if is_prefix_of(buf, V1_PREFIX) {
        return if buf.len() < V1_PREFIX.len() { Ok(Parsed::Incomplete) } else { parse_v1(buf) };
    }
    Err(Error::NotProxy)
}

/// Whether `buf` and `signature` agree on their common length.
fn is_prefix_of(buf: &[u8], signature: &[u8]) -> bool {
    let n = buf.len().min(signature.len());
    buf[..n] == signature[..n]
}

fn parse_v1(buf: &[u8]) -> Result<Parsed, Error> {
    let window = &buf[..buf.len().min(MAX_V1)];
    let Some(cr) = window.iter().position(|&b| b == b'\r') else {
        return if buf.len() >= MAX_V1 { Err(Error::TooLong) } else { Ok(Parsed::Incomplete) };
    };
    match window.get(cr + 1) {
        None if buf.len() < MAX_V1 => return Ok(Parsed::Incomplete),
        Some(b'\n') => {}
        _ => return Err(Error::V1("a line must end with \\r\\n")),
    }
    let line = std::str::from_utf8(&buf[V1_PREFIX.len()..cr]).map_err(|_| Error::V1("not ASCII"))?;
    let len = cr + 2;
    let mut fields = line.split(' ');
    let header = match fields.next() {
        Some("UNKNOWN") => Header::Local,
        Some(family @ ("TCP4" | "TCP6")) => {
            let v6 = family == "TCP6";
            let mut next = |what| fields.next().ok_or(Error::V1(what));
            let (src, dst) = (next("no source address")?, next("no destination address")?);
            let (sport, dport) = (next("no source port")?, next("no destination port")?);
            if fields.next().is_some() {
                return Err(Error::V1("more than six fields"));
            }
            let ip = |s: &str| -> Result<IpAddr, Error> {
                let ip: IpAddr = s.parse().map_err(|_| Error::V1("an address does not parse"))?;
                if ip.is_ipv6() != v6 {
                    return Err(Error::V1("an address of the other family"));
                }
                Ok(ip)
            };
            let port = |s: &str| -> Result<u16, Error> {
                // Decimal, no sign and no leading zero (the specification's
                // wording), so that one port has one spelling.
                if s.is_empty() || (s.len() > 1 && s.starts_with('0')) || !s.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(Error::V1("a port is not a number in 0..=65535"));
                }
                s.parse().map_err(|_| Error::V1("a port is not a number in 0..=65535"))
            };
            Header::Proxied {
                source: SocketAddr::new(ip(src)?, port(sport)?),
                destination: SocketAddr::new(ip(dst)?, port(dport)?),
            }
        }
        _ => return Err(Error::V1("the protocol is not TCP4, TCP6 or UNKNOWN")),
    };
    Ok(Parsed::Header { header, len })
}

fn parse_v2(buf: &[u8]) -> Result<Parsed, Error> {
    if buf.len() < 16 {
        // The version byte can already be checked.
        if let Some(&vc) = buf.get(12) {
            if vc >> 4 != 2 {
                return Err(Error::V2("version is not 2"));
            }
        }
        return Ok(Parsed::Incomplete);
    }
    let (ver_cmd, family) = (buf[12], buf[13]);
    if ver_cmd >> 4 != 2 {
        return Err(Error::V2("version is not 2"));
    }
    let len = 16 + usize::from(u16::from_be_bytes([buf[14], buf[15]]));
    if len > MAX_V2 {
        return Err(Error::TooLong);
    }
    if buf.len() < len {
        return Ok(Parsed::Incomplete);
    }
    let body = &buf[16..len];
    let header = match ver_cmd & 0x0f {
        0x0 => Header::Local,
        0x1 => match family {
            // TCP over IPv4: two addresses, two ports.
            0x11 => {
                let a = body.get(..12).ok_or(Error::V2("IPv4 addresses cut short"))?;
                let ip = |at: usize| IpAddr::V4(Ipv4Addr::new(a[at], a[at + 1], a[at + 2], a[at + 3]));
                let port = |at: usize| u16::from_be_bytes([a[at], a[at + 1]]);
                Header::Proxied {
                    source: SocketAddr::new(ip(0), port(8)),
                    destination: SocketAddr::new(ip(4), port(10)),
                }
            }
            // TCP over IPv6.
            0x21 => {
                let a = body.get(..36).ok_or(Error::V2("IPv6 addresses cut short"))?;
                let ip = |at: usize| {
                    let mut octets = [0u8; 16];
                    octets.copy_from_slice(&a[at..at + 16]);
                    IpAddr::V6(Ipv6Addr::from(octets))
                };
                let port = |at: usize| u16::from_be_bytes([a[at], a[at + 1]]);
                Header::Proxied {
                    source: SocketAddr::new(ip(0), port(32)),
                    destination: SocketAddr::new(ip(16), port(34)),
                }
            }
            // Unspecified, UDP or UNIX sockets: nothing to use.
            0x00 | 0x12 | 0x22 | 0x31 | 0x32 => Header::Local,
            _ => return Err(Error::V2("unknown address family")),
        },
        _ => return Err(Error::V2("unknown command")),
    };
    Ok(Parsed::Header { header, len })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn done(buf: &[u8]) -> (Header, usize) {
        match parse(buf) {
            Ok(Parsed::Header { header, len }) => (header, len),
            other => panic!("{other:?} for {buf:?}"),
        }
    }

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn version_1_tells_the_client_and_leaves_its_bytes() {
        let line = b"PROXY TCP4 192.0.2.1 198.51.100.2 56324 443\r\nGET / HTTP/1.1\r\n";
        let (header, len) = done(line);
        assert_eq!(header, Header::Proxied { source: addr("192.0.2.1:56324"), destination: addr("198.51.100.2:443") });
        assert_eq!(&line[len..], b"GET / HTTP/1.1\r\n");
        let (header, _) = done(b"PROXY TCP6 2001:db8::1 2001:db8::2 65535 0\r\n");
        assert_eq!(
            header,
            Header::Proxied { source: addr("[2001:db8::1]:65535"), destination: addr("[2001:db8::2]:0") }
        );
        assert_eq!(done(b"PROXY UNKNOWN\r\n"), (Header::Local, 15));
        assert_eq!(done(b"PROXY UNKNOWN ffff::1 ffff::2 1 2\r\nx").0, Header::Local);
    }

    #[test]
    fn version_1_refuses_what_the_format_does_not_allow() {
        for bad in [
            &b"PROXY TCP4 192.0.2.1 198.51.100.2 56324\r\n"[..],
            b"PROXY TCP4 192.0.2.1 198.51.100.2 56324 443 7\r\n",
            b"PROXY TCP4 2001:db8::1 198.51.100.2 1 2\r\n",
            b"PROXY TCP6 192.0.2.1 198.51.100.2 1 2\r\n",
            b"PROXY TCP4 192.0.2.1 198.51.100.2 65536 2\r\n",
            b"PROXY TCP4 192.0.2.1 198.51.100.2 +1 2\r\n",
            b"PROXY TCP4 192.0.2.1 198.51.100.2 01 2\r\n",
            b"PROXY UDP4 192.0.2.1 198.51.100.2 1 2\r\n",
            b"PROXY TCP4 192.0.2.1 198.51.100.2 1 2\rX",
            b"PROXY TCP4  192.0.2.1 198.51.100.2 1 2\r\n",
        ] {
            assert!(matches!(parse(bad), Err(Error::V1(_))), "{:?}", String::from_utf8_lossy(bad));
        }
        let mut long = b"PROXY UNKNOWN ".to_vec();
        long.resize(200, b'a');
        assert_eq!(parse(&long), Err(Error::TooLong));
    }

    #[test]
    fn anything_else_is_not_a_header_and_a_beginning_asks_for_more() {
        assert_eq!(parse(b"GET / HTTP/1.1\r\n"), Err(Error::NotProxy));
        assert_eq!(parse(b"\x16\x03\x01"), Err(Error::NotProxy), "a TLS client hello");
        assert_eq!(parse(b"PROXZ"), Err(Error::NotProxy));
        for partial in [&b""[..], b"P", b"PROXY", b"PROXY TCP4 192.0.2.1", b"PROXY UNKNOWN\r", b"\r\n\r\n\0\r\nQU"] {
            assert_eq!(parse(partial), Ok(Parsed::Incomplete), "{partial:?}");
        }
    }

    fn v2(cmd: u8, family: u8, body: &[u8]) -> Vec<u8> {
        let mut h = V2_SIGNATURE.to_vec();
        h.push(0x20 | cmd);
        h.push(family);
        h.extend_from_slice(&(body.len() as u16).to_be_bytes());
        h.extend_from_slice(body);
        h
    }

    #[test]
    fn version_2_tells_the_client_skips_tlvs_and_knows_local() {
        let mut body = vec![192, 0, 2, 1, 198, 51, 100, 2];
        body.extend_from_slice(&56324u16.to_be_bytes());
        body.extend_from_slice(&443u16.to_be_bytes());
        body.extend_from_slice(&[0x04, 0x00, 0x03, b'a', b'b', b'c']); // a NOOP TLV
        let mut h = v2(1, 0x11, &body);
        let header_len = h.len();
        h.extend_from_slice(b"\x16\x03\x01");
        let (header, len) = done(&h);
        assert_eq!(header, Header::Proxied { source: addr("192.0.2.1:56324"), destination: addr("198.51.100.2:443") });
        assert_eq!(len, header_len);
        let mut body6 = Vec::new();
        body6.extend_from_slice(&"2001:db8::1".parse::<Ipv6Addr>().unwrap().octets());
        body6.extend_from_slice(&"2001:db8::2".parse::<Ipv6Addr>().unwrap().octets());
        body6.extend_from_slice(&[0, 80, 1, 187]);
        assert_eq!(
            done(&v2(1, 0x21, &body6)).0,
            Header::Proxied { source: addr("[2001:db8::1]:80"), destination: addr("[2001:db8::2]:443") }
        );
        assert_eq!(done(&v2(0, 0x00, b"")), (Header::Local, 16));
        assert_eq!(done(&v2(1, 0x31, &[0; 216])).0, Header::Local, "UNIX sockets tell nothing usable");
        // Cut anywhere, it asks for more.
        for cut in 0..h.len().min(header_len) {
            assert_eq!(parse(&h[..cut]), Ok(Parsed::Incomplete), "cut at {cut}");
        }
    }

    #[test]
    fn version_2_refuses_what_the_format_does_not_allow() {
        let mut wrong_version = v2(1, 0x11, &[0; 12]);
        wrong_version[12] = 0x11;
        assert_eq!(parse(&wrong_version), Err(Error::V2("version is not 2")));
        assert_eq!(parse(&wrong_version[..13]), Err(Error::V2("version is not 2")));
        assert_eq!(parse(&v2(2, 0x11, &[0; 12])), Err(Error::V2("unknown command")));
        assert_eq!(parse(&v2(1, 0x41, &[0; 12])), Err(Error::V2("unknown address family")));
        assert_eq!(parse(&v2(1, 0x11, &[0; 8])), Err(Error::V2("IPv4 addresses cut short")));
        assert_eq!(parse(&v2(1, 0x21, &[0; 12])), Err(Error::V2("IPv6 addresses cut short")));
        assert_eq!(parse(&v2(1, 0x11, &[0; 3000])), Err(Error::TooLong));
    }

    #[test]
    fn an_encoded_header_parses_back_to_what_it_says_in_both_versions() {
        let cases = [
            (addr("192.0.2.1:56324"), addr("198.51.100.2:443")),
            (addr("[2001:db8::1]:1"), addr("[2001:db8::2]:65535")),
        ];
        for version in [Version::V1, Version::V2] {
            for (source, destination) in cases {
                let header = Header::Proxied { source, destination };
                let mut bytes = encode(version, &header);
                let len = bytes.len();
                bytes.extend_from_slice(b"GET / HTTP/1.1\r\n");
                assert_eq!(done(&bytes), (header, len), "{version:?}");
            }
            assert_eq!(done(&encode(version, &Header::Local)).0, Header::Local);
        }
        assert_eq!(encode(Version::V1, &Header::Local), b"PROXY UNKNOWN\r\n");
        assert_eq!(
            encode(
                Version::V1,
                &Header::Proxied { source: addr("192.0.2.1:56324"), destination: addr("198.51.100.2:443") }
            ),
            b"PROXY TCP4 192.0.2.1 198.51.100.2 56324 443\r\n"
        );
    }

    #[test]
    fn addresses_of_two_families_are_written_in_one() {
        // An IPv4 client on a dual-stack socket: mapped, written as IPv4.
        let header = Header::Proxied { source: addr("[::ffff:192.0.2.1]:5"), destination: addr("198.51.100.2:443") };
        assert_eq!(encode(Version::V1, &header), b"PROXY TCP4 192.0.2.1 198.51.100.2 5 443\r\n");
        // An IPv4 client of an IPv6 address: both written as IPv6.
        let header = Header::Proxied { source: addr("192.0.2.1:5"), destination: addr("[2001:db8::2]:443") };
        let want = Header::Proxied { source: addr("[::ffff:192.0.2.1]:5"), destination: addr("[2001:db8::2]:443") };
        for version in [Version::V1, Version::V2] {
            assert_eq!(done(&encode(version, &header)).0, want, "{version:?}");
        }
    }

    proptest::proptest! {
        /// No input panics, and a header never claims more bytes than
        /// were given.
        #[test]
        fn any_bytes_are_parsed_without_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..300),
                                              v2_start in proptest::bool::ANY) {
            let mut input = if v2_start { V2_SIGNATURE.to_vec() } else { b"PROXY ".to_vec() };
            input.extend_from_slice(&bytes);
            for buf in [&input[..], &bytes[..]] {
                if let Ok(Parsed::Header { len, .. }) = parse(buf) {
                    proptest::prop_assert!(len <= buf.len());
                }
            }
        }
    }
}
