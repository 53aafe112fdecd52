//! Read access to a request's header fields, whatever holds them.

/// A request's header fields as routing and balancing read them: hyper's
/// [`http::HeaderMap`], or spans into the native HTTP/1 path's read buffer.
/// Names are compared ASCII case-insensitively; pass them lowercase.
pub trait Headers: Sync {
    /// The first value of the field `name`.
    fn first(&self, name: &str) -> Option<&[u8]>;
    /// Whether some value of the field `name` satisfies `f` (values are
    /// visited in order, until `f` returns `true`).
    fn any(&self, name: &str, f: &mut dyn FnMut(&[u8]) -> bool) -> bool;
    /// Visits every field, in order.
    fn each(&self, f: &mut dyn FnMut(&str, &[u8]));
}

impl std::fmt::Debug for dyn Headers + '_ {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut list = f.debug_list();
        self.each(&mut |name, value| {
            list.entry(&(name, String::from_utf8_lossy(value)));
        });
        list.finish()
    }
}

impl Headers for http::HeaderMap {
    fn first(&self, name: &str) -> Option<&[u8]> {
        self.get(name).map(http::HeaderValue::as_bytes)
    }

    fn any(&self, name: &str, f: &mut dyn FnMut(&[u8]) -> bool) -> bool {
        self.get_all(name).iter().any(|v| f(v.as_bytes()))
    }

    fn each(&self, f: &mut dyn FnMut(&str, &[u8])) {
        for (name, value) in self {
            f(name.as_str(), value.as_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_map_reads_as_headers() {
        let mut h = http::HeaderMap::new();
        h.append("cookie", "a=1".parse().unwrap());
        h.append("cookie", "b=2".parse().unwrap());
        let h: &dyn Headers = &h;
        assert_eq!(h.first("cookie"), Some(&b"a=1"[..]));
        assert!(h.any("cookie", &mut |v| v == b"b=2"));
        assert!(!h.any("x", &mut |_| true));
        let mut n = 0;
        h.each(&mut |_, _| n += 1);
        assert_eq!(n, 2);
    }
}
