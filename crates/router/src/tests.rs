use super::*;
use http::HeaderMap;
use http::HeaderValue;
use proptest::prelude::*;

fn route(json: &str) -> Arc<RouteSpec> {
    Arc::new(serde_json::from_str(json).unwrap())
}

fn name(s: &str) -> RouteName {
    RouteName::new(s).unwrap()
}

fn find<'r>(r: &'r Router, host: &str, path: &str) -> Option<&'r str> {
    find_with(r, host, path, &Method::GET, &HeaderMap::new())
}

fn find_with<'r>(r: &'r Router, host: &str, path: &str, method: &Method, headers: &HeaderMap) -> Option<&'r str> {
    let view = RequestView { host, path, method, headers, query: None, listener: None };
    r.lookup(&view).map(|e| e.name.as_str())
}

fn table() -> Router {
    let mut r = Router::new();
    r.insert(name("root"), route(r#"{"service":"s"}"#));
    r.insert(name("api"), route(r#"{"match":{"path_prefix":"/api"},"service":"s"}"#));
    r.insert(name("api-v2"), route(r#"{"match":{"path_prefix":"/api/v2/"},"service":"s"}"#));
    r.insert(name("health"), route(r#"{"match":{"path":"/api/health"},"service":"s"}"#));
    r.insert(name("host"), route(r#"{"match":{"host":"shop.example.com"},"service":"s"}"#));
    r.insert(name("wild"), route(r#"{"match":{"host":"*.example.com","path_prefix":"/api"},"service":"s"}"#));
    r
}

#[test]
fn longest_segment_prefix_wins() {
    let r = table();
    assert_eq!(find(&r, "", "/"), Some("root"));
    assert_eq!(find(&r, "", "/apix"), Some("root"));
    assert_eq!(find(&r, "", "/api"), Some("api"));
    assert_eq!(find(&r, "", "/api/"), Some("api"));
    assert_eq!(find(&r, "", "/api/v2"), Some("api-v2"));
    assert_eq!(find(&r, "", "/api/v2/users/7"), Some("api-v2"));
    assert_eq!(find(&r, "", "/api/health"), Some("health"));
    assert_eq!(find(&r, "", "/api/health/x"), Some("api"));
}

#[test]
fn hosts_rank_exact_then_wildcard_then_any() {
    let r = table();
    assert_eq!(find(&r, "shop.example.com", "/api/x"), Some("host"));
    assert_eq!(find(&r, "a.b.example.com", "/api/x"), Some("wild"));
    assert_eq!(find(&r, "a.b.example.com", "/other"), Some("root"));
    assert_eq!(find(&r, "example.com", "/api/x"), Some("api"));
}

#[test]
fn priority_beats_specificity() {
    let mut r = table();
    r.insert(name("maint"), route(r#"{"match":{"path_prefix":"/"},"service":"s","priority":10}"#));
    assert_eq!(find(&r, "shop.example.com", "/api/health"), Some("maint"));
    assert!(r.remove(&name("maint")));
    assert_eq!(find(&r, "", "/api/health"), Some("health"));
}

#[test]
fn methods_and_headers_filter() {
    let mut r = Router::new();
    r.insert(name("any"), route(r#"{"match":{"path_prefix":"/x"},"service":"s"}"#));
    r.insert(name("post"), route(r#"{"match":{"path_prefix":"/x","methods":["POST"]},"service":"s"}"#));
    r.insert(name("canary"), route(r#"{"match":{"path_prefix":"/x","headers":{"x-canary":"1"}},"service":"s"}"#));
    let mut h = HeaderMap::new();
    assert_eq!(find_with(&r, "", "/x", &Method::GET, &h), Some("any"));
    assert_eq!(find_with(&r, "", "/x", &Method::POST, &h), Some("post"));
    h.insert("x-canary", HeaderValue::from_static("1"));
    assert_eq!(find_with(&r, "", "/x", &Method::GET, &h), Some("canary"));
}

#[test]
fn header_presence_and_regex_filter() {
    let mut r = Router::new();
    r.insert(name("any"), route(r#"{"match":{"path_prefix":"/x"},"service":"s"}"#));
    r.insert(name("debug"), route(r#"{"match":{"path_prefix":"/x","header_present":["x-debug"]},"service":"s"}"#));
    r.insert(
        name("v2"),
        route(r#"{"match":{"path_prefix":"/x","header_regex":{"accept":"^application/vnd\\.v2"}},"service":"s"}"#),
    );
    let mut h = HeaderMap::new();
    h.insert("accept", HeaderValue::from_static("application/json"));
    assert_eq!(find_with(&r, "", "/x", &Method::GET, &h), Some("any"));
    h.append("accept", HeaderValue::from_static("application/vnd.v2+json"));
    assert_eq!(find_with(&r, "", "/x", &Method::GET, &h), Some("v2"), "one value matching is enough");
    let mut h = HeaderMap::new();
    h.insert("x-debug", HeaderValue::from_static(""));
    assert_eq!(find_with(&r, "", "/x", &Method::GET, &h), Some("debug"), "present, even empty");
}

#[test]
fn replacing_and_removing_routes() {
    let mut r = table();
    let before = r.clone();
    r.insert(name("api"), route(r#"{"match":{"path_prefix":"/other"},"service":"s"}"#));
    assert_eq!(find(&r, "", "/api/x"), Some("root"));
    assert_eq!(find(&r, "", "/other"), Some("api"));
    assert_eq!(find(&before, "", "/api/x"), Some("api"), "older versions are untouched");
    assert!(r.remove(&name("host")));
    assert!(!r.remove(&name("host")));
    assert_eq!(find(&r, "shop.example.com", "/z"), Some("root"));
    assert_eq!(r.len(), 5);
}

/// A reference matcher: scan every route and keep the best by the documented rules.
fn reference(routes: &[(String, String)], path: &str) -> Option<String> {
    routes
        .iter()
        .filter(|(_, p)| {
            let p = p.trim_end_matches('/');
            p.is_empty() || path == p || path.starts_with(&format!("{p}/"))
        })
        .max_by_key(|(n, p)| (p.trim_end_matches('/').len(), std::cmp::Reverse(n.clone())))
        .map(|(n, _)| n.clone())
}

proptest! {
    #[test]
    fn prefix_matching_agrees_with_a_linear_scan(
        prefixes in proptest::collection::vec("(/[ab]{1,2}){0,3}", 1..12),
        path in "(/[ab]{1,2}){0,4}/?",
    ) {
        let mut r = Router::new();
        let mut routes = Vec::new();
        for (i, p) in prefixes.iter().enumerate() {
            let p = if p.is_empty() { "/".to_string() } else { p.clone() };
            let n = format!("r{i:02}");
            r.insert(name(&n), route(&format!(r#"{{"match":{{"path_prefix":"{p}"}},"service":"s"}}"#)));
            routes.push((n, p));
        }
        let path = if path.is_empty() { "/".to_string() } else { path };
        let got = find(&r, "", &path).map(str::to_string);
        let want = reference(&routes, path.trim_end_matches('/'));
        prop_assert_eq!(got, want);
    }
}

proptest! {
    /// Routes added and removed again (exact paths, prefixes, some longer
    /// than the lengths counted one by one): a lookup finds what a scan of
    /// the routes left finds.
    #[test]
    fn lookups_agree_with_a_scan_after_removals(
        routes in proptest::collection::vec(("(/[ab]{1,2}){0,3}|/a{120,130}(/b)?", any::<bool>(), any::<bool>()), 1..12),
        path in "(/[ab]{1,2}){0,4}/?|/a{120,130}(/b)?",
    ) {
        let mut r = Router::new();
        for (i, (p, exact, _)) in routes.iter().enumerate() {
            let p = if p.is_empty() { "/" } else { p.as_str() };
            let field = if *exact { "path" } else { "path_prefix" };
            r.insert(name(&format!("r{i:02}")), route(&format!(r#"{{"match":{{"{field}":"{p}"}},"service":"s"}}"#)));
        }
        let mut kept = Vec::new();
        for (i, (p, exact, remove)) in routes.iter().enumerate() {
            let n = format!("r{i:02}");
            if *remove {
                prop_assert!(r.remove(&name(&n)));
            } else {
                kept.push((n, if p.is_empty() { "/".to_string() } else { p.clone() }, *exact));
            }
        }
        let path = if path.is_empty() { "/".to_string() } else { path };
        let got = find(&r, "", &path).map(str::to_string);
        let exact = kept.iter().filter(|(_, p, e)| *e && *p == path).map(|(n, _, _)| n.clone()).min();
        let prefixes: Vec<(String, String)> = kept.iter().filter(|(_, _, e)| !e).map(|(n, p, _)| (n.clone(), p.clone())).collect();
        let want = exact.or_else(|| reference(&prefixes, path.trim_end_matches('/')));
        prop_assert_eq!(got, want);
    }
}

proptest! {
    /// Any host and path, against a table with every kind of route: a
    /// lookup answers or not, and never panics.
    #[test]
    fn any_request_looks_up_without_panic(host in "\\PC{0,40}", path in "\\PC{0,60}") {
        let r = table();
        let _ = find(&r, &host, &path);
        let _ = find(&r, &host.to_ascii_lowercase(), &format!("/{path}"));
    }
}

#[test]
fn query_conditions_match_decoded_parameters() {
    let mut r = Router::new();
    r.insert(name("plain"), route(r#"{"match":{"path_prefix":"/x"},"service":"s"}"#));
    r.insert(name("v2"), route(r#"{"match":{"path_prefix":"/x","query":{"version":"2 beta"}},"service":"s"}"#));
    r.insert(name("debug"), route(r#"{"match":{"path_prefix":"/x","query_present":["debug"]},"service":"s"}"#));
    let find_q = |query: Option<&str>| {
        let headers = HeaderMap::new();
        let view = RequestView { host: "", path: "/x", method: &Method::GET, headers: &headers, query, listener: None };
        r.lookup(&view).map(|e| e.name.to_string())
    };
    assert_eq!(find_q(None).as_deref(), Some("plain"));
    assert_eq!(find_q(Some("version=2+beta")).as_deref(), Some("v2"));
    assert_eq!(find_q(Some("a=1&version=2%20beta")).as_deref(), Some("v2"));
    assert_eq!(find_q(Some("version=2")).as_deref(), Some("plain"), "another value");
    assert_eq!(find_q(Some("versionx=2+beta")).as_deref(), Some("plain"), "another name");
    assert_eq!(find_q(Some("debug")).as_deref(), Some("debug"));
    assert_eq!(find_q(Some("x=1&debug=")).as_deref(), Some("debug"));
    assert_eq!(find_q(Some("%64ebug=1")).as_deref(), Some("debug"), "names are decoded too");
}

#[test]
fn form_decoding_compares_bytes() {
    assert!(form_decoded_is("a%2Bb+c", "a+b c"));
    assert!(form_decoded_is("100%", "100%"), "a lone % stands for itself");
    assert!(form_decoded_is("%zz", "%zz"));
    assert!(!form_decoded_is("ab", "abc") && !form_decoded_is("abc", "ab"));
    assert!(form_decoded_is("", ""));
}

proptest! {
    /// Routes of several priorities, host patterns and conditions, on
    /// exact paths and prefixes, some removed again: a lookup (whose
    /// probes stop once nothing left can beat the best so far) finds the
    /// best of a scan that ranks every matching route.
    #[test]
    fn lookups_agree_with_a_ranked_scan(
        routes in proptest::collection::vec(
            ("(/[ab]{1,2}){0,3}", any::<bool>(), -1i32..3, 0usize..3, any::<bool>(), any::<bool>()), 1..14),
        path in "(/[ab]{1,2}){0,4}/?",
        host in "[ab]\\.example\\.com",
        post in any::<bool>(),
    ) {
        let hosts = ["", r#""host":"a.example.com","#, r#""host":"*.example.com","#];
        let mut r = Router::new();
        for (i, (p, exact, priority, h, get_only, _)) in routes.iter().enumerate() {
            let p = if p.is_empty() { "/" } else { p.as_str() };
            let field = if *exact { "path" } else { "path_prefix" };
            let methods = if *get_only { r#","methods":["GET"]"# } else { "" };
            r.insert(name(&format!("r{i:02}")), route(&format!(
                r#"{{"match":{{{}"{field}":"{p}"{methods}}},"priority":{priority},"service":"s"}}"#, hosts[*h])));
        }
        for (i, (.., remove)) in routes.iter().enumerate() {
            if *remove {
                let n = format!("r{i:02}");
                prop_assert!(r.remove(&name(&n)));
            }
        }
        let path = if path.is_empty() { "/".to_string() } else { path };
        let method = if post { Method::POST } else { Method::GET };
        let got = find_with(&r, &host, &path, &method, &HeaderMap::new()).map(str::to_string);
        let trimmed = path.trim_end_matches('/');
        let want = routes
            .iter()
            .enumerate()
            .filter(|(_, (.., get_only, remove))| !(*remove || (*get_only && post)))
            .filter_map(|(i, (p, exact, priority, h, get_only, _))| {
                let p = if p.is_empty() { "/" } else { p.as_str() };
                let host_rank = match h {
                    0 => 0,
                    1 if host == "a.example.com" => u32::MAX,
                    2 => ".example.com".len() as u32,
                    _ => return None,
                };
                let key = p.trim_end_matches('/');
                let path_rank = match exact {
                    true if p == path => u32::MAX,
                    true => return None,
                    false if key.is_empty() => 1,
                    false if trimmed == key || trimmed.starts_with(&format!("{key}/")) => key.len() as u32,
                    false => return None,
                };
                let rank = (*priority, host_rank, path_rank, usize::from(*get_only));
                Some((rank, std::cmp::Reverse(format!("r{i:02}"))))
            })
            .max()
            .map(|(_, std::cmp::Reverse(n))| n);
        prop_assert_eq!(got, want);
    }
}
