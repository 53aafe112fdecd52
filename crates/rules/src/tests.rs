use super::*;
use bytes::Bytes;
use std::time::Duration;

fn chain(steps: serde_json::Value) -> Arc<Chain> {
    let spec: RuleSetSpec = serde_json::from_value(serde_json::json!({ "steps": steps })).unwrap();
    Arc::new(Chain::compile("r", &[(RuleSetName::new("set").unwrap(), Arc::new(spec))]))
}

fn view<'a>(path: &'a str, headers: &'a http::HeaderMap, client: &str) -> RequestView<'a> {
    static GET: Method = Method::GET;
    RequestView {
        method: &GET,
        host: "example.com",
        path,
        query: Some("a=1"),
        headers,
        client: client.parse().unwrap(),
        tls: false,
        content_length: None,
    }
}

fn forward(o: Outcome) -> Forward {
    match o {
        Outcome::Forward(f) => *f,
        other => panic!("expected forward, got {other:?}"),
    }
}

fn answer(o: Outcome) -> Answer {
    match o {
        Outcome::Answer(a) => a,
        other => panic!("expected an answer, got {other:?}"),
    }
}

#[test]
fn paths_and_headers_are_edited_in_order() {
    let c = chain(serde_json::json!([
        {"kind": "strip_prefix", "prefix": "/api"},
        {"kind": "rewrite_path", "regex": "^/v1/(.*)$", "replacement": "/v2/$1"},
        {"kind": "set_request_header", "name": "Host", "value": "backend.internal"},
        {"kind": "remove_request_header", "name": "X-Secret"},
        {"kind": "set_response_header", "name": "Strict-Transport-Security", "value": "max-age=1", "only_if_absent": true},
    ]));
    let h = http::HeaderMap::new();
    let f = forward(c.request(&view("/api/v1/users", &h, "10.0.0.1"), Instant::now()));
    assert_eq!(f.path("/api/v1/users"), Some("/v2/users"));
    assert_eq!(c.changed_rules(&f).map(|r| r.step).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
    let mut req = http::HeaderMap::new();
    req.insert("x-secret", HeaderValue::from_static("1"));
    for e in f.request_edits() {
        e.apply(&mut req);
    }
    assert_eq!(req.get("host").unwrap(), "backend.internal");
    assert!(req.get("x-secret").is_none());
    let mut resp = http::HeaderMap::new();
    resp.insert("strict-transport-security", HeaderValue::from_static("kept"));
    f.apply_response_headers(&mut resp);
    assert_eq!(resp.get("strict-transport-security").unwrap(), "kept", "only if the backend did not set it");
}

#[test]
fn a_rewrite_that_would_climb_is_refused() {
    let c = chain(serde_json::json!([{"kind": "rewrite_path", "regex": "^/(.*)a$", "replacement": "/x/$1./y"}]));
    let h = http::HeaderMap::new();
    assert_eq!(answer(c.request(&view("/.a", &h, "10.0.0.1"), Instant::now())).status, 400);
}

#[test]
fn redirects_build_their_target_from_the_request() {
    let c = chain(serde_json::json!([
        {"kind": "redirect", "status": 308, "location": "https://{host}/new/$1?{query}", "regex": "^/old/(.*)$"},
        {"kind": "deny", "status": 404},
    ]));
    let h = http::HeaderMap::new();
    let a = answer(c.request(&view("/old/page", &h, "10.0.0.1"), Instant::now()));
    assert_eq!((a.status, a.headers[0].1.to_str().unwrap()), (308, "https://example.com/new/page?a=1"));
    assert_eq!((a.rule.step, a.rule.kind), (0, "redirect"));
    let a = answer(c.request(&view("/other", &h, "10.0.0.1"), Instant::now()));
    assert_eq!((a.status, a.rule.kind), (404, "deny"), "a redirect whose regex does not match goes on");
}

#[test]
fn client_networks_are_allowed_and_denied() {
    let c = chain(serde_json::json!([
        {"kind": "ip_allow", "cidrs": ["10.0.0.0/8"]},
        {"kind": "ip_deny", "cidrs": ["10.9.0.0/16"]},
    ]));
    let h = http::HeaderMap::new();
    assert!(matches!(c.request(&view("/", &h, "10.1.2.3"), Instant::now()), Outcome::Forward(_)));
    assert_eq!(answer(c.request(&view("/", &h, "192.0.2.1"), Instant::now())).status, 403);
    assert_eq!(answer(c.request(&view("/", &h, "10.9.1.1"), Instant::now())).rule.kind, "ip_deny");
}

#[test]
fn rate_limits_answer_429_with_retry_after() {
    let c = chain(serde_json::json!([{"kind": "rate_limit", "key": "header:X-Key", "rate_per_s": 1, "burst": 2}]));
    let mut h = http::HeaderMap::new();
    h.insert("x-key", HeaderValue::from_static("a"));
    let t = Instant::now();
    for _ in 0..2 {
        assert!(matches!(c.request(&view("/", &h, "10.0.0.1"), t), Outcome::Forward(_)));
    }
    let a = answer(c.request(&view("/", &h, "10.0.0.1"), t));
    assert_eq!(a.status, 429);
    assert_eq!(a.headers[0], (http::header::RETRY_AFTER, HeaderValue::from(1u32)));
    h.insert("x-key", HeaderValue::from_static("b"));
    assert!(matches!(c.request(&view("/", &h, "10.0.0.1"), t), Outcome::Forward(_)), "another key");
}

#[test]
fn a_shared_rate_is_divided_among_live_instances() {
    let c = chain(
        serde_json::json!([{"kind": "rate_limit", "key": "route", "rate_per_s": 10, "burst": 1, "per_instance_share": true}]),
    );
    c.set_live_instances(2);
    let h = http::HeaderMap::new();
    let t = Instant::now();
    assert!(matches!(c.request(&view("/", &h, "10.0.0.1"), t), Outcome::Forward(_)));
    let a = answer(c.request(&view("/", &h, "10.0.0.1"), t + Duration::from_millis(150)));
    assert_eq!(a.status, 429, "5/s each: no token after 150 ms");
    assert!(matches!(c.request(&view("/", &h, "10.0.0.1"), t + Duration::from_millis(200)), Outcome::Forward(_)));
}

#[test]
fn concurrency_limits_hold_permits() {
    let c = chain(serde_json::json!([{"kind": "concurrency_limit", "key": "route", "max": 1}]));
    let h = http::HeaderMap::new();
    let first = forward(c.request(&view("/", &h, "10.0.0.1"), Instant::now()));
    assert_eq!(answer(c.request(&view("/", &h, "10.0.0.2"), Instant::now())).status, 429);
    drop(first);
    assert!(matches!(c.request(&view("/", &h, "10.0.0.2"), Instant::now()), Outcome::Forward(_)));
}

#[test]
fn bodies_are_limited() {
    let c = chain(serde_json::json!([{"kind": "max_body_bytes", "bytes": 10}]));
    let h = http::HeaderMap::new();
    let mut v = view("/", &h, "10.0.0.1");
    v.content_length = Some(11);
    assert_eq!(answer(c.request(&v, Instant::now())).status, 413);
    v.content_length = None;
    assert_eq!(forward(c.request(&v, Instant::now())).max_body, Some(10));
}

#[test]
fn basic_auth_checks_off_the_request_path() {
    let hash = bcrypt::hash_with_salt("pw", 4, [1u8; 16]).unwrap().format_for_version(bcrypt::Version::TwoB);
    let c = chain(serde_json::json!([
        {"kind": "basic_auth", "realm": "admin", "users": [{"name": "u", "hash": hash}]},
        {"kind": "set_request_header", "name": "X-After", "value": "1"},
    ]));
    let none = http::HeaderMap::new();
    let a = answer(c.request(&view("/", &none, "10.0.0.1"), Instant::now()));
    assert_eq!(a.status, 401);
    assert!(a.headers[0].1.to_str().unwrap().contains("realm=\"admin\""));
    let mut h = http::HeaderMap::new();
    h.insert("authorization", HeaderValue::from_static("Basic dTpwdw==")); // u:pw
    let v = view("/", &h, "10.0.0.1");
    let Outcome::Pending(Pending { work: Work::Password(check), resume }) = c.request(&v, Instant::now()) else {
        panic!("a password check first")
    };
    let ok = check.verify();
    assert!(ok);
    let f = forward(c.resume(&v, Instant::now(), resume, WorkResult::Password(ok)));
    let edits: Vec<_> = f.request_edits().collect();
    assert_eq!(*edits[0], HeaderEdit::Remove(http::header::AUTHORIZATION));
    assert_eq!(edits.len(), 2, "the chain went on");
    let Outcome::Pending(p) = c.request(&v, Instant::now()) else { panic!() };
    assert_eq!(answer(c.resume(&v, Instant::now(), p.resume, WorkResult::Password(false))).status, 401);
}

#[test]
fn forward_auth_is_a_described_sub_request_that_fails_closed() {
    let c = chain(serde_json::json!([
        {"kind": "forward_auth", "url": "http://127.0.0.1:9000/check?x=1", "copy_headers": ["X-User"], "timeout_ms": 500},
    ]));
    let mut h = http::HeaderMap::new();
    h.insert("authorization", HeaderValue::from_static("Bearer t"));
    h.insert("x-user", HeaderValue::from_static("forged"));
    let v = view("/p", &h, "10.0.0.1");
    let Outcome::Pending(Pending { work: Work::ForwardAuth(call), resume }) = c.request(&v, Instant::now()) else {
        panic!("a sub-request first")
    };
    assert_eq!((call.authority.as_str(), call.path_and_query.as_str()), ("127.0.0.1:9000", "/check?x=1"));
    assert_eq!(call.timeout, Duration::from_millis(500));
    assert!(call.headers.iter().any(|(n, v)| n == "authorization" && v == "Bearer t"));
    assert!(call.headers.iter().any(|(n, v)| n == "x-forwarded-uri" && v == "/p?a=1"));
    let mut ok = http::HeaderMap::new();
    ok.insert("x-user", HeaderValue::from_static("alice"));
    let f = forward(c.resume(
        &v,
        Instant::now(),
        resume,
        WorkResult::ForwardAuth(AuthAnswer { status: 200, headers: ok, body: Bytes::new() }),
    ));
    assert_eq!(
        f.request_edits().cloned().collect::<Vec<_>>(),
        vec![HeaderEdit::Set(HeaderName::from_static("x-user"), HeaderValue::from_static("alice"))]
    );

    let Outcome::Pending(p) = c.request(&v, Instant::now()) else { panic!() };
    let mut no = http::HeaderMap::new();
    no.insert("www-authenticate", HeaderValue::from_static("Bearer"));
    let a = answer(c.resume(
        &v,
        Instant::now(),
        p.resume,
        WorkResult::ForwardAuth(AuthAnswer { status: 401, headers: no, body: Bytes::from_static(b"who?") }),
    ));
    assert!(a.status == 401 && a.relay_auth_body && a.headers.len() == 1);
    let Outcome::Pending(p) = c.request(&v, Instant::now()) else { panic!() };
    assert_eq!(c.auth_failed(p.resume).status, 503, "down or slow: refused, never let through");
}

#[test]
fn cors_answers_preflights_and_marks_responses() {
    let c = chain(serde_json::json!([
        {"kind": "cors", "allow_origins": ["https://app.example"], "allow_headers": ["X-Token"], "allow_credentials": true},
    ]));
    let mut h = http::HeaderMap::new();
    h.insert("origin", HeaderValue::from_static("https://app.example"));
    h.insert("access-control-request-method", HeaderValue::from_static("PUT"));
    static OPTIONS: Method = Method::OPTIONS;
    let mut v = view("/", &h, "10.0.0.1");
    v.method = &OPTIONS;
    let a = answer(c.request(&v, Instant::now()));
    assert_eq!(a.status, 204);
    assert!(a.headers.iter().any(|(n, v)| n == "access-control-allow-origin" && v == "https://app.example"));
    assert!(a.headers.iter().any(|(n, v)| n == "access-control-allow-headers" && v == "x-token"));
    let f = forward(c.request(&view("/", &h, "10.0.0.1"), Instant::now()));
    let mut resp = http::HeaderMap::new();
    f.apply_response_headers(&mut resp);
    assert_eq!(resp.get("access-control-allow-credentials").unwrap(), "true");
    h.insert("origin", HeaderValue::from_static("https://evil.example"));
    let f = forward(c.request(&view("/", &h, "10.0.0.1"), Instant::now()));
    assert!(!f.edits_response(), "an origin not allowed gets nothing");
}

#[test]
fn each_step_counts_what_it_answered_and_changed() {
    let c = chain(serde_json::json!([
        {"kind": "strip_prefix", "prefix": "/api"},
        {"kind": "ip_deny", "cidrs": ["192.0.2.0/24"]},
    ]));
    let h = http::HeaderMap::new();
    forward(c.request(&view("/api/x", &h, "10.0.0.1"), Instant::now()));
    forward(c.request(&view("/other", &h, "10.0.0.1"), Instant::now()));
    answer(c.request(&view("/api/x", &h, "192.0.2.1"), Instant::now()));
    let counts: Vec<_> = c.counts().map(|s| (s.rule.kind, s.answered, s.changed)).collect();
    assert_eq!(counts, vec![("strip_prefix", 0, 2), ("ip_deny", 1, 0)]);
}

/// Header steps of both sides, in a row and apart: each counts, names and
/// orders its edit as a step of its own.
#[test]
fn header_steps_count_and_edit_each_as_a_step() {
    let c = chain(serde_json::json!([
        {"kind": "set_response_header", "name": "X-R1", "value": "1"},
        {"kind": "set_request_header", "name": "X-A", "value": "1"},
        {"kind": "add_request_header", "name": "X-A", "value": "2"},
        {"kind": "ip_deny", "cidrs": ["192.0.2.0/24"]},
        {"kind": "remove_request_header", "name": "X-B"},
        {"kind": "add_response_header", "name": "X-R2", "value": "2"},
    ]));
    let h = http::HeaderMap::new();
    let f = forward(c.request(&view("/", &h, "10.0.0.1"), Instant::now()));
    forward(c.request(&view("/", &h, "10.0.0.2"), Instant::now()));
    answer(c.request(&view("/", &h, "192.0.2.1"), Instant::now()));
    let counts: Vec<_> = c.counts().map(|s| (s.rule.kind, s.answered, s.changed)).collect();
    assert_eq!(
        counts,
        vec![
            ("set_response_header", 0, 0),
            ("set_request_header", 0, 3),
            ("add_request_header", 0, 3),
            ("ip_deny", 1, 0),
            ("remove_request_header", 0, 2),
            ("add_response_header", 0, 0),
        ]
    );
    assert_eq!(c.changed_rules(&f).map(|r| r.step).collect::<Vec<_>>(), vec![1, 2, 4]);
    let request: Vec<_> = f.request_edits().cloned().collect();
    let n = |s: &'static str| HeaderName::from_static(s);
    assert_eq!(
        request,
        vec![
            HeaderEdit::Set(n("x-a"), HeaderValue::from_static("1")),
            HeaderEdit::Add(n("x-a"), HeaderValue::from_static("2")),
            HeaderEdit::Remove(n("x-b")),
        ]
    );
    let response: Vec<_> = f.response_edits().map(|e| format!("{e:?}")).collect();
    assert_eq!(response.len(), 2);
    assert!(response[0].contains("x-r1") && response[1].contains("x-r2"), "{response:?}");
}

#[test]
fn a_stripped_prefix_leaves_the_request_path_s_tail_and_any_path_after_a_rewrite() {
    let h = http::HeaderMap::new();
    let strip = chain(serde_json::json!([{"kind": "strip_prefix", "prefix": "/api"}]));
    for (path, left) in [("/api/x/y", Some("/x/y")), ("/api", Some("/")), ("/api/", Some("/")), ("/apix", None)] {
        let f = forward(strip.request(&view(path, &h, "10.0.0.1"), Instant::now()));
        assert_eq!(f.path(path), left, "{path}");
        assert_eq!(f.changes_path(), left.is_some(), "{path}");
    }
    // Twice in a row, and after a rewrite (a path made for the request).
    let twice = chain(serde_json::json!([
        {"kind": "strip_prefix", "prefix": "/a"},
        {"kind": "strip_prefix", "prefix": "/b"},
    ]));
    let f = forward(twice.request(&view("/a/b/c", &h, "10.0.0.1"), Instant::now()));
    assert_eq!(f.path("/a/b/c"), Some("/c"));
    let after = chain(serde_json::json!([
        {"kind": "rewrite_path", "regex": "^/old/(.*)$", "replacement": "/new/api/$1"},
        {"kind": "strip_prefix", "prefix": "/new"},
        {"kind": "strip_prefix", "prefix": "/api"},
    ]));
    let f = forward(after.request(&view("/old/v", &h, "10.0.0.1"), Instant::now()));
    assert_eq!(f.path("/old/v"), Some("/v"));
    let f = forward(after.request(&view("/old/", &h, "10.0.0.1"), Instant::now()));
    assert_eq!(f.path("/old/"), Some("/"));
}

#[test]
fn header_steps_of_distinct_fields_are_written_out_once() {
    let c = chain(serde_json::json!([
        {"kind": "set_request_header", "name": "X-A", "value": "1"},
        {"kind": "strip_prefix", "prefix": "/api"},
        {"kind": "add_request_header", "name": "X-B", "value": "2"},
        {"kind": "set_response_header", "name": "Strict-Transport-Security", "value": "max-age=1", "only_if_absent": true},
    ]));
    let h = http::HeaderMap::new();
    let f = forward(c.request(&view("/api/x", &h, "10.0.0.1"), Instant::now()));
    let lines = f.request_lines().expect("two request fields, distinct");
    assert_eq!(lines.head_end(), b"x-a: 1\r\nx-b: 2\r\n\r\n");
    assert_eq!(lines.names().collect::<Vec<_>>(), vec![&b"x-a"[..], b"x-b"]);
    let lines = f.response_lines().expect("one response field");
    assert_eq!(lines.head_end(), b"strict-transport-security: max-age=1\r\n\r\n");

    // A request with an edit of its own besides the steps' has no lines.
    let mut f = forward(c.request(&view("/api/x", &h, "10.0.0.1"), Instant::now()));
    f.add_request_edit(HeaderEdit::Remove(http::header::AUTHORIZATION));
    assert!(f.request_lines().is_none());
    assert!(f.response_lines().is_some(), "the other side keeps its lines");

    // A field named twice, or removed: no lines.
    for steps in [
        serde_json::json!([
            {"kind": "set_request_header", "name": "X-A", "value": "1"},
            {"kind": "add_request_header", "name": "x-a", "value": "2"},
        ]),
        serde_json::json!([
            {"kind": "set_request_header", "name": "X-A", "value": "1"},
            {"kind": "remove_request_header", "name": "X-B"},
        ]),
    ] {
        let c = chain(steps);
        let f = forward(c.request(&view("/", &h, "10.0.0.1"), Instant::now()));
        assert!(f.request_lines().is_none());
        assert_eq!(f.request_edits().count(), 2, "the edits are still there");
    }
    // No header step: no lines, on either side.
    let c = chain(serde_json::json!([{"kind": "strip_prefix", "prefix": "/api"}]));
    let f = forward(c.request(&view("/api/x", &h, "10.0.0.1"), Instant::now()));
    assert!(f.request_lines().is_none() && f.response_lines().is_none());
}
