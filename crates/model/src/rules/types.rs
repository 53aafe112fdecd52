//! The validated values steps are made of: each decodes from its JSON form
//! through `TryFrom`, so a step holding one is valid.

use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::invalid::Invalid;
use crate::service::REDACTED;

/// Header fields no step may set or remove: they frame the message or
/// the connection, which the proxy owns.
const FRAMING: [&str; 8] =
    ["connection", "content-length", "transfer-encoding", "te", "trailer", "upgrade", "keep-alive", "proxy-connection"];

/// A header field name a step may set or remove (lowercase; not one of the
/// fields that frame the message: `Connection`, `Content-Length`,
/// `Transfer-Encoding`, `TE`, `Trailer`, `Upgrade`, `Keep-Alive`,
/// `Proxy-Connection`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "String", into = "String")]
pub struct FieldName(#[schemars(with = "String")] pub http::HeaderName);

impl TryFrom<String> for FieldName {
    type Error = Invalid;
    fn try_from(s: String) -> Result<Self, Invalid> {
        let name = http::HeaderName::from_bytes(s.as_bytes())
            .map_err(|_| Invalid::malformed("", format!("{s:?}"), "is not a header field name"))?;
        if FRAMING.contains(&name.as_str()) {
            return Err(Invalid::malformed("", format!("{s:?}"), "frames the message, which the proxy owns"));
        }
        Ok(FieldName(name))
    }
}

impl From<FieldName> for String {
    fn from(n: FieldName) -> String {
        n.0.as_str().to_string()
    }
}

/// A header field value (visible ASCII, spaces and tabs; at most 8 KiB).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "String", into = "String")]
pub struct FieldValue(#[schemars(with = "String")] pub http::HeaderValue);

impl TryFrom<String> for FieldValue {
    type Error = Invalid;
    fn try_from(s: String) -> Result<Self, Invalid> {
        if s.len() > 8192 || !s.bytes().all(|b| b == b'\t' || (b' '..=b'~').contains(&b)) {
            return Err(Invalid::malformed(
                "",
                format!("{:?}", s.chars().take(64).collect::<String>()),
                "is not a header value (visible ASCII, spaces and tabs, at most 8192 bytes)",
            ));
        }
        http::HeaderValue::from_str(&s)
            .map(FieldValue)
            .map_err(|_| Invalid::malformed("", format!("{s:?}"), "is not a header value"))
    }
}

impl From<FieldValue> for String {
    fn from(v: FieldValue) -> String {
        String::from_utf8_lossy(v.0.as_bytes()).into_owned()
    }
}

/// The most bytes a regex may have as written.
const MAX_REGEX: usize = 1024;

/// A regular expression over the normalized path, in the syntax of the
/// `regex` crate: matched in time linear in the path, never backtracking.
/// Its compiled size is bounded (1 MiB).
#[derive(Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "String", into = "String")]
pub struct PathRegex(#[schemars(with = "String")] pub regex::Regex);

impl PartialEq for PathRegex {
    fn eq(&self, other: &Self) -> bool {
        self.0.as_str() == other.0.as_str()
    }
}

impl Eq for PathRegex {}

impl fmt::Debug for PathRegex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.0.as_str(), f)
    }
}

impl PathRegex {
    /// How many capture groups it has (`$0`, the whole match, not counted).
    pub fn groups(&self) -> usize {
        self.0.captures_len() - 1
    }
}

impl TryFrom<String> for PathRegex {
    type Error = Invalid;
    fn try_from(s: String) -> Result<Self, Invalid> {
        if s.is_empty() || s.len() > MAX_REGEX {
            return Err(Invalid::range_only("", format!("1 to {MAX_REGEX} bytes long")));
        }
        regex::RegexBuilder::new(&s).size_limit(1 << 20).dfa_size_limit(1 << 20).build().map(PathRegex).map_err(|e| {
            let why = match e {
                regex::Error::Syntax(text) => text.lines().last().unwrap_or("syntax error").trim().to_string(),
                regex::Error::CompiledTooBig(_) => "compiles to more than 1 MiB".to_string(),
                _ => "is not a regular expression".to_string(),
            };
            Invalid::malformed("", format!("{s:?}"), format!("is not a regular expression: {why}"))
        })
    }
}

impl From<PathRegex> for String {
    fn from(r: PathRegex) -> String {
        r.0.as_str().to_string()
    }
}

/// A path prefix: written as requests are normalized, without a trailing
/// `/`, and not `/` itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "String", into = "String")]
pub struct PathPrefix(Arc<str>);

impl PathPrefix {
    /// The prefix.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for PathPrefix {
    type Error = Invalid;
    fn try_from(s: String) -> Result<Self, Invalid> {
        crate::route::check_path("", &s)?;
        let trimmed = s.trim_end_matches('/');
        if trimmed.is_empty() {
            return Err(Invalid::malformed("", format!("{s:?}"), "strips nothing: give a prefix longer than `/`"));
        }
        Ok(PathPrefix(Arc::from(trimmed)))
    }
}

impl From<PathPrefix> for String {
    fn from(p: PathPrefix) -> String {
        p.0.to_string()
    }
}

macro_rules! status_type {
    ($(#[$doc:meta])* $name:ident, $ok:expr, $range:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
        #[serde(try_from = "u16", into = "u16")]
        pub struct $name(u16);

        impl $name {
            /// The status code.
            pub fn get(self) -> u16 {
                self.0
            }
        }

        impl TryFrom<u16> for $name {
            type Error = Invalid;
            fn try_from(v: u16) -> Result<Self, Invalid> {
                let ok: fn(u16) -> bool = $ok;
                match ok(v) {
                    true => Ok($name(v)),
                    false => Err(Invalid::range("", $range, v)),
                }
            }
        }

        impl From<$name> for u16 {
            fn from(s: $name) -> u16 {
                s.0
            }
        }
    };
}

status_type!(
    /// A redirect's status: 300, 301, 302, 303, 307 or 308.
    RedirectStatus,
    |v| matches!(v, 300..=303 | 307 | 308),
    "one of 300, 301, 302, 303, 307, 308"
);
status_type!(
    /// A refusal's status: 400..=599.
    DenyStatus,
    |v| (400..=599).contains(&v),
    "400..=599"
);

impl Default for RedirectStatus {
    fn default() -> Self {
        RedirectStatus(302)
    }
}

impl Default for DenyStatus {
    fn default() -> Self {
        DenyStatus(403)
    }
}

/// A network in CIDR form (`10.0.0.0/8`, `2001:db8::/32`); a bare address
/// is the network of that address alone. Host bits must be zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "String", into = "String")]
pub struct Cidr {
    /// The network's address (host bits zero).
    #[schemars(with = "String")]
    pub addr: IpAddr,
    /// The prefix length: 0..=32 (IPv4), 0..=128 (IPv6).
    pub len: u8,
}

impl Cidr {
    /// Whether `ip` is in the network. An IPv4-mapped IPv6 address
    /// (`::ffff:a.b.c.d`) is taken as the IPv4 address it maps.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => mask32(u32::from(ip), self.len) == u32::from(net),
            (IpAddr::V6(net), IpAddr::V6(ip)) => mask128(u128::from(ip), self.len) == u128::from(net),
            _ => false,
        }
    }
}

fn mask32(v: u32, len: u8) -> u32 {
    match len {
        0 => 0,
        l => v & (u32::MAX << (32 - u32::from(l.min(32)))),
    }
}

fn mask128(v: u128, len: u8) -> u128 {
    match len {
        0 => 0,
        l => v & (u128::MAX << (128 - u32::from(l.min(128)))),
    }
}

impl TryFrom<String> for Cidr {
    type Error = Invalid;
    fn try_from(s: String) -> Result<Self, Invalid> {
        let bad = |why: &str| Invalid::malformed("", format!("{s:?}"), why.to_string());
        let (addr, len) = match s.split_once('/') {
            Some((a, l)) => (a, Some(l)),
            None => (s.as_str(), None),
        };
        let addr: IpAddr = addr.parse().map_err(|_| bad("is not an IP address or network (ADDR/LEN)"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let len = match len {
            None => max,
            Some(l) => match l.parse::<u8>() {
                Ok(n) if n <= max && !l.starts_with('+') => n,
                _ => return Err(bad(&format!("has a prefix length outside 0..={max}"))),
            },
        };
        let masked = match addr {
            IpAddr::V4(a) => IpAddr::V4(mask32(u32::from(a), len).into()),
            IpAddr::V6(a) => IpAddr::V6(mask128(u128::from(a), len).into()),
        };
        if masked != addr {
            return Err(bad(&format!("has host bits set: the network is {masked}/{len}")));
        }
        Ok(Cidr { addr, len })
    }
}

impl From<Cidr> for String {
    fn from(c: Cidr) -> String {
        c.to_string()
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

/// A password hash: bcrypt (`$2a$`, `$2b$`, `$2y$`, cost 4..=31) or
/// argon2 in PHC form (`$argon2id$v=19$m=...,t=...,p=...$SALT$HASH`,
/// also `argon2i` and `argon2d`). Never a password: anything else is
/// refused. Read APIs show [`REDACTED`] in its place; given back as
/// [`REDACTED`], the hash the user has is kept.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "String", into = "String")]
pub struct PasswordHash(String);

impl fmt::Debug for PasswordHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(REDACTED)
    }
}

/// The kind of a [`PasswordHash`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashKind {
    /// bcrypt.
    Bcrypt,
    /// argon2 (i, d or id), PHC string.
    Argon2,
    /// The placeholder [`REDACTED`], to be replaced by the kept hash.
    Placeholder,
}

impl PasswordHash {
    /// The hash as written (PHC or bcrypt's modular crypt form).
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Which algorithm it is for.
    pub fn kind(&self) -> HashKind {
        if self.0 == REDACTED {
            HashKind::Placeholder
        } else if self.0.starts_with("$argon2") {
            HashKind::Argon2
        } else {
            HashKind::Bcrypt
        }
    }

    /// A bcrypt hash of the right form whose salt and digest are all
    /// zero bits: no password is known to match it.
    pub(crate) fn unusable() -> PasswordHash {
        PasswordHash(format!("$2b$04${}", ".".repeat(53)))
    }

    pub(crate) fn placeholder() -> PasswordHash {
        PasswordHash(REDACTED.to_string())
    }
}

fn bcrypt_b64(s: &str) -> bool {
    s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'/')
}

fn phc_b64(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'/')
}

fn is_bcrypt(s: &str) -> bool {
    // $2b$12$ + 22 characters of salt + 31 of hash.
    let Some(rest) = ["$2a$", "$2b$", "$2y$"].iter().find_map(|p| s.strip_prefix(p)) else { return false };
    let Some((cost, body)) = rest.split_once('$') else { return false };
    let cost_ok = cost.len() == 2 && cost.parse::<u8>().is_ok_and(|c| (4..=31).contains(&c));
    cost_ok && body.len() == 53 && bcrypt_b64(body)
}

fn is_argon2(s: &str) -> bool {
    let mut parts = s.split('$');
    let (Some(""), Some(alg), Some(version), Some(params), Some(salt), Some(hash), None) =
        (parts.next(), parts.next(), parts.next(), parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return false;
    };
    let params_ok = params.split(',').all(|kv| {
        kv.split_once('=').is_some_and(|(k, v)| matches!(k, "m" | "t" | "p") && v.parse::<u32>().is_ok_and(|n| n > 0))
    }) && params.split(',').count() == 3;
    matches!(alg, "argon2id" | "argon2i" | "argon2d")
        && matches!(version, "v=19" | "v=16")
        && params_ok
        && phc_b64(salt)
        && phc_b64(hash)
        && hash.len() >= 22
}

impl TryFrom<String> for PasswordHash {
    type Error = Invalid;
    fn try_from(s: String) -> Result<Self, Invalid> {
        if s == REDACTED || is_bcrypt(&s) || is_argon2(&s) {
            return Ok(PasswordHash(s));
        }
        // The value is not repeated: it may be a password given by mistake.
        Err(Invalid::unreadable(
            "",
            "is not a bcrypt hash ($2b$COST$...) or an argon2 PHC string ($argon2id$v=19$m=..,t=..,p=..$SALT$HASH); \
             passwords are never taken in plain text (make one with `htpasswd -nbB USER PASS` or `argon2`)",
        ))
    }
}

impl From<PasswordHash> for String {
    fn from(h: PasswordHash) -> String {
        h.0
    }
}

/// What a rate or concurrency limit counts by.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "String", into = "String")]
pub enum LimitKey {
    /// `client_ip`: the client's address (behind `--trusted-proxies`, the
    /// one they forwarded).
    ClientIp,
    /// `route`: one count for the whole route.
    Route,
    /// `header:NAME`: the value of a request header (requests without it
    /// share one count).
    Header(#[schemars(with = "String")] http::HeaderName),
}

impl TryFrom<String> for LimitKey {
    type Error = Invalid;
    fn try_from(s: String) -> Result<Self, Invalid> {
        match s.as_str() {
            "client_ip" => Ok(LimitKey::ClientIp),
            "route" => Ok(LimitKey::Route),
            other => match other.strip_prefix("header:").map(|n| http::HeaderName::from_bytes(n.as_bytes())) {
                Some(Ok(name)) => Ok(LimitKey::Header(name)),
                _ => {
                    Err(Invalid::malformed("", format!("{s:?}"), "is not a key: `client_ip`, `route` or `header:NAME`"))
                }
            },
        }
    }
}

impl From<LimitKey> for String {
    fn from(k: LimitKey) -> String {
        match k {
            LimitKey::ClientIp => "client_ip".into(),
            LimitKey::Route => "route".into(),
            LimitKey::Header(h) => format!("header:{h}"),
        }
    }
}

/// A rate in requests per second, 0.001..=10000000, kept to the
/// thousandth (`0.5` is one request every two seconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "f64", into = "f64")]
pub struct Rate(u64);

impl Rate {
    /// Thousandths of a request per second.
    pub fn millis(self) -> u64 {
        self.0
    }

    /// Requests per second.
    pub fn per_second(self) -> f64 {
        self.0 as f64 / 1000.0
    }
}

impl TryFrom<f64> for Rate {
    type Error = Invalid;
    fn try_from(v: f64) -> Result<Self, Invalid> {
        if !(0.001..=10_000_000.0).contains(&v) {
            return Err(Invalid::range("", "0.001..=10000000", v));
        }
        Ok(Rate((v * 1000.0).round() as u64))
    }
}

impl From<Rate> for f64 {
    fn from(r: Rate) -> f64 {
        r.per_second()
    }
}

macro_rules! ranged {
    ($(#[$doc:meta])* $name:ident, $int:ty, $min:expr, $max:expr) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, schemars::JsonSchema)]
        #[serde(try_from = "u64", into = "u64")]
        pub struct $name($int);

        impl $name {
            /// The number.
            pub fn get(self) -> $int {
                self.0
            }
        }

        impl TryFrom<u64> for $name {
            type Error = Invalid;
            fn try_from(v: u64) -> Result<Self, Invalid> {
                match <$int>::try_from(v) {
                    Ok(n) if ($min..=$max).contains(&n) => Ok($name(n)),
                    _ => Err(Invalid::range("", format!("{}..={}", $min, $max), v)),
                }
            }
        }

        impl From<$name> for u64 {
            fn from(n: $name) -> u64 {
                n.0.into()
            }
        }
    };
}

ranged!(
    /// A token bucket's size: 1..=1000000 requests.
    Burst,
    u32,
    1,
    1_000_000
);
ranged!(
    /// Requests at once: 1..=1000000.
    InFlight,
    u32,
    1,
    1_000_000
);
ranged!(
    /// A body size in bytes: 0..=1099511627776 (1 TiB).
    BodyBytes,
    u64,
    0,
    1u64 << 40
);
ranged!(
    /// A timeout in milliseconds: 1..=60000.
    AuthTimeoutMs,
    u32,
    1,
    60_000
);
ranged!(
    /// A duration in seconds: 0..=86400.
    MaxAgeS,
    u32,
    0,
    86_400
);
ranged!(
    /// A response size in bytes: 0..=1073741824.
    MinBytes,
    u32,
    0,
    1u32 << 30
);

#[cfg(test)]
mod tests {
    use super::*;

    fn cidr(s: &str) -> Result<Cidr, Invalid> {
        Cidr::try_from(s.to_string())
    }

    #[test]
    fn cidrs_parse_and_match() {
        let net = cidr("10.0.0.0/8").unwrap();
        assert!(net.contains("10.1.2.3".parse().unwrap()));
        assert!(net.contains("::ffff:10.9.9.9".parse().unwrap()));
        assert!(!net.contains("11.0.0.1".parse().unwrap()));
        assert!(cidr("0.0.0.0/0").unwrap().contains("8.8.8.8".parse().unwrap()));
        assert!(cidr("2001:db8::/32").unwrap().contains("2001:db8:1::1".parse().unwrap()));
        assert!(cidr("192.0.2.7").unwrap().contains("192.0.2.7".parse().unwrap()));
        for bad in ["10.0.0.1/8", "10.0.0.0/33", "x/8", "10.0.0.0/+8", "::/129"] {
            assert!(cidr(bad).is_err(), "{bad}");
        }
        assert!(cidr("10.0.0.1/8").unwrap_err().to_string().contains("10.0.0.0/8"));
    }

    #[test]
    fn only_hashes_are_passwords() {
        let ok = [
            "$2b$12$R9h/cIPz0gi.URNNX3kh2OPST9/PgBkqquzi.Ss7KIUgO2t0jWMUW",
            "$argon2id$v=19$m=19456,t=2,p=1$c2FsdHNhbHRzYWx0$u9WbWTmS2UrXJ8lWJhXmbbJyxGH7xgmhDsbkk9KOWDg",
        ];
        for h in ok {
            assert!(PasswordHash::try_from(h.to_string()).is_ok(), "{h}");
        }
        for bad in ["hunter2", "$2b$03$R9h/cIPz0gi.URNNX3kh2OPST9/PgBkqquzi.Ss7KIUgO2t0jWMUW", "$argon2id$v=19$m=1$s$h"]
        {
            let e = PasswordHash::try_from(bad.to_string()).unwrap_err();
            assert!(!e.to_string().contains(bad), "the value is not repeated: {e}");
        }
        assert_eq!(format!("{:?}", PasswordHash::try_from(ok[0].to_string()).unwrap()), REDACTED);
    }

    #[test]
    fn framing_fields_are_the_proxys() {
        assert!(FieldName::try_from("Content-Length".to_string()).is_err());
        assert_eq!(FieldName::try_from("X-A".to_string()).unwrap().0.as_str(), "x-a");
        assert!(FieldValue::try_from("a\nb".to_string()).is_err());
    }

    #[test]
    fn numbers_have_their_ranges() {
        assert!(Rate::try_from(0.0).is_err());
        assert_eq!(Rate::try_from(0.5).unwrap().millis(), 500);
        assert!(Burst::try_from(0).is_err());
        assert!(RedirectStatus::try_from(304).is_err());
        assert!(DenyStatus::try_from(200).is_err());
        assert_eq!(LimitKey::try_from("header:X-Key".to_string()).unwrap(), LimitKey::Header("x-key".parse().unwrap()));
    }
}
