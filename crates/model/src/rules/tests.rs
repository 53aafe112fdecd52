use super::*;

const BCRYPT: &str = "$2b$12$R9h/cIPz0gi.URNNX3kh2OPST9/PgBkqquzi.Ss7KIUgO2t0jWMUW";

fn parse(text: &str) -> Result<RuleSetSpec, String> {
    crate::parse_json::<RuleSetSpec>(text.as_bytes()).map_err(|e| format!("{}: {}", e.field, e.message))
}

#[test]
fn every_kind_decodes_and_round_trips() {
    let text = format!(
        r#"{{"steps":[
        {{"kind":"strip_prefix","prefix":"/api/"}},
        {{"kind":"rewrite_path","regex":"^/old/(.*)$","replacement":"/new/$1"}},
        {{"kind":"set_request_header","name":"X-A","value":"1"}},
        {{"kind":"add_request_header","name":"X-A","value":"2"}},
        {{"kind":"remove_request_header","name":"X-B"}},
        {{"kind":"set_response_header","name":"Strict-Transport-Security","value":"max-age=63072000","only_if_absent":true}},
        {{"kind":"add_response_header","name":"X-C","value":"3"}},
        {{"kind":"remove_response_header","name":"Server"}},
        {{"kind":"redirect","status":301,"location":"https://example.com{{path}}"}},
        {{"kind":"redirect","location":"/b/$1?{{query}}","regex":"^/a/(.*)$"}},
        {{"kind":"deny","status":451}},
        {{"kind":"ip_allow","cidrs":["10.0.0.0/8","::1"]}},
        {{"kind":"ip_deny","cidrs":["192.0.2.0/24"]}},
        {{"kind":"basic_auth","realm":"r","users":[{{"name":"u","hash":"{BCRYPT}"}}]}},
        {{"kind":"forward_auth","url":"http://127.0.0.1:9000/check","copy_headers":["X-User"]}},
        {{"kind":"rate_limit","key":"header:X-Key","rate_per_s":0.5,"burst":20}},
        {{"kind":"concurrency_limit","key":"client_ip","max":4}},
        {{"kind":"max_body_bytes","bytes":1048576}},
        {{"kind":"cors","allow_origins":["https://App.example"],"allow_credentials":true}},
        {{"kind":"compress","algorithms":["zstd","br","gzip"]}}]}}"#
    );
    let spec = parse(&text).unwrap();
    assert_eq!(spec.steps.len(), 20);
    let json = serde_json::to_string(&spec).unwrap();
    assert_eq!(parse(&json).unwrap(), spec, "{json}");
    assert!(json.contains(r#""prefix":"/api""#) && json.contains("https://app.example"), "{json}");
    let Step::ForwardAuth(f) = &spec.steps[14] else { panic!() };
    assert_eq!(f.url.authority, "127.0.0.1:9000");
    assert_eq!(f.timeout_ms.get(), 2000);
}

#[test]
fn refusals_name_the_step_and_field() {
    let cases = [
        (r#"{"steps":[{"kind":"strip_prefix","prefix":"/"}]}"#, "steps[0].prefix"),
        (r#"{"steps":[{"kind":"deny"},{"kind":"rewrite_path","regex":"(","replacement":"/"}]}"#, "steps[1].regex"),
        (r#"{"steps":[{"kind":"rewrite_path","regex":"^/(a)$","replacement":"/$2"}]}"#, "steps[0].replacement"),
        (r#"{"steps":[{"kind":"rewrite_path","regex":"^/(a)$","replacement":"x$1"}]}"#, "steps[0].replacement"),
        (r#"{"steps":[{"kind":"set_request_header","name":"Content-Length","value":"1"}]}"#, "steps[0].name"),
        (r#"{"steps":[{"kind":"redirect","status":200,"location":"/"}]}"#, "steps[0].status"),
        (r#"{"steps":[{"kind":"redirect","location":"/{nope}"}]}"#, "steps[0].location"),
        (r#"{"steps":[{"kind":"deny","status":200}]}"#, "steps[0].status"),
        (r#"{"steps":[{"kind":"ip_allow","cidrs":["10.0.0.1/8"]}]}"#, "steps[0].cidrs[0]"),
        (r#"{"steps":[{"kind":"ip_allow","cidrs":[]}]}"#, "steps[0].cidrs"),
        (
            r#"{"steps":[{"kind":"basic_auth","realm":"r","users":[{"name":"u","hash":"hunter2"}]}]}"#,
            "steps[0].users[0].hash",
        ),
        (r#"{"steps":[{"kind":"forward_auth","url":"https://a/"}]}"#, "steps[0].url"),
        (r#"{"steps":[{"kind":"rate_limit","key":"ip","rate_per_s":1}]}"#, "steps[0].key"),
        (r#"{"steps":[{"kind":"rate_limit","key":"route","rate_per_s":0}]}"#, "steps[0].rate_per_s"),
        (r#"{"steps":[{"kind":"cors","allow_origins":["*"],"allow_credentials":true}]}"#, "steps[0].allow_credentials"),
        (r#"{"steps":[{"kind":"compress","algorithms":["gzip","gzip"]}]}"#, "steps[0].algorithms[1]"),
        (r#"{"steps":[{"kind":"deny","extra":1}]}"#, "steps[0].extra"),
        (r#"{"steps":[{"kind":"explode"}]}"#, "steps[0].kind"),
        (r#"{"steps":[{"prefix":"/a"}]}"#, "steps[0].kind"),
        (r#"{"steps":[],"extra":1}"#, "extra"),
    ];
    for (text, field) in cases {
        let err = parse(text).unwrap_err();
        assert!(err.starts_with(&format!("{field}:")), "{text}: {err}");
    }
    let err =
        parse(r#"{"steps":[{"kind":"basic_auth","realm":"r","users":[{"name":"u","hash":"hunter2"}]}]}"#).unwrap_err();
    assert!(!err.contains("hunter2"), "a password given by mistake is not repeated: {err}");
}

fn with_hash(hash: &str) -> RuleSetSpec {
    parse(&format!(r#"{{"steps":[{{"kind":"basic_auth","realm":"r","users":[{{"name":"u","hash":"{hash}"}}]}}]}}"#))
        .unwrap()
}

#[test]
fn hashes_are_redacted_and_kept() {
    let spec = with_hash(BCRYPT);
    assert!(spec.has_secrets());
    let shown = serde_json::to_string(&spec.redacted()).unwrap();
    assert!(!shown.contains(BCRYPT) && shown.contains(REDACTED), "{shown}");
    assert!(!format!("{spec:?}").contains(BCRYPT));
    let back = with_hash(REDACTED);
    assert_eq!(back.with_secrets_of(Some(&spec)).unwrap().into_owned(), spec);
    let e = back.with_secrets_of(None).unwrap_err();
    assert_eq!(e.field, "steps[0].users[0].hash");
}

#[test]
fn a_document_carries_rules_before_the_routes_that_run_them() {
    let doc: crate::Document = serde_json::from_value(serde_json::json!({
        "services": {"web": {}},
        "rules": {
            "api": {"steps": [{"kind": "basic_auth", "realm": "r", "users": [{"name": "u", "hash": REDACTED}]}]},
            "open": {"steps": []},
        },
        "routes": {"r": {"service": "web", "rules": ["open"]}},
    }))
    .unwrap();
    doc.check().unwrap();
    assert_eq!(doc.kept_fields(), vec!["rules.api.steps[0].users[0].hash".to_string()]);
    let ops = doc.put_ops();
    let at = |want: &str| ops.iter().position(|op| serde_json::to_value(op).unwrap()["op"] == want).unwrap();
    assert!(at("put_rules") < at("put_route"));
    let bad: crate::Document = serde_json::from_value(serde_json::json!({
        "services": {"web": {}},
        "routes": {"r": {"service": "web", "rules": ["nope"]}},
    }))
    .unwrap();
    assert_eq!(bad.check().unwrap_err().field, "routes.r.rules[0]");
    let e = crate::parse_json::<crate::Document>(
        br#"{"rules": {"api": {"steps": [{"kind": "deny"}, {"kind": "rewrite_path", "regex": "(", "replacement": "/"}]}}}"#,
    )
    .unwrap_err();
    assert_eq!(e.field, "rules.api.steps[1].regex", "{e:?}");
}
