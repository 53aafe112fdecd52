//! The admin API and the CLI: auth, atomic batches, revisions, bad input,
//! watch, declarative files.

use serde_json::{json, Value};

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthenticated_requests_get_401_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let body = br#"{"backends":[]}"#.to_vec();
    for token in [None, Some("wrong")] {
        let r = send("PUT", &tg.admin_url("/v1/services/web"), token, body.clone(), &[]).await;
        assert_eq!(r.status, 401);
        assert!(r.text().contains("admin token"));
        assert_eq!(send("GET", &tg.admin_url("/v1/config"), token, vec![], &[]).await.status, 401);
    }
    let (_, config) = tg.api("GET", "/v1/config", None).await;
    assert_eq!(config["revision"], 0);
    assert_eq!(config["services"], json!({}));
}

fn big_batch(n: usize, addr_of: impl Fn(usize) -> String) -> Value {
    let mut ops = vec![json!({"op": "put_service", "name": "big", "spec": {}})];
    for i in 1..n {
        ops.push(json!({"op": "put_backend", "service": "big", "id": format!("b{i}"), "spec": {"addr": addr_of(i)}}));
    }
    json!({ "ops": ops })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_2000_op_batch_applies_whole_or_not_at_all() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let (s, v) = tg.api("POST", "/v1/changes", Some(big_batch(2000, |i| format!("127.0.0.1:{}", 10000 + i)))).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["revision"], 1);
    let (_, svc) = tg.api("GET", "/v1/services/big", None).await;
    assert_eq!(svc["spec"]["backends"].as_array().unwrap().len(), 1999);

    // One invalid op among 2,000: a 400 naming it, nothing applied.
    let bad = big_batch(2000, |i| if i == 1500 { "not-an-address".into() } else { format!("127.0.0.2:{}", 10000 + i) });
    let (s, v) = tg.api("POST", "/v1/changes", Some(bad)).await;
    assert_eq!(s, 400, "{v}");
    assert_eq!(v["error"]["op"], 1500);
    assert_eq!(v["error"]["field"], "ops[1500].spec.addr");
    // One op that fails on the configuration (not its syntax): 404, nothing applied.
    let mut missing = big_batch(2000, |i| format!("127.0.0.3:{}", 10000 + i));
    missing["ops"][1999] = json!({"op": "delete_backend", "service": "big", "id": "nope"});
    let (s, v) = tg.api("POST", "/v1/changes", Some(missing)).await;
    assert_eq!(s, 404, "{v}");
    assert_eq!(v["error"]["op"], 1999);
    let (_, config) = tg.api("GET", "/v1/config", None).await;
    assert_eq!(config["revision"], 1);
    let first = &config["services"]["big"]["backends"][0]["addr"];
    assert!(first.as_str().unwrap().starts_with("127.0.0.1:"), "{first}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_if_revision_gets_409() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let put = |rev: u64| json!({"if_revision": rev, "ops": [{"op": "put_service", "name": "s", "spec": {}}]});
    let (s, v) = tg.api("POST", "/v1/changes", Some(put(0))).await;
    assert_eq!((s, v["revision"].as_u64()), (200, Some(1)));
    let (s, v) = tg.api("POST", "/v1/changes", Some(put(0))).await;
    assert_eq!(s, 409, "{v}");
    assert_eq!(v["error"]["field"], "if_revision");
    let (s, _) = tg.api("POST", "/v1/changes", Some(put(1))).await;
    assert_eq!(s, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_clear_4xx_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let raw = |path: &'static str, method: &'static str, body: &'static str| {
        let url = tg.admin_url(path);
        async move { send(method, &url, Some(TOKEN), body.as_bytes().to_vec(), &[]).await }
    };
    let cases: [(&str, &str, &str, u16, &str); 7] = [
        ("/v1/changes", "POST", "{not json", 400, "."),
        ("/v1/changes", "POST", r#"{"ops":[],"surprise":1}"#, 400, "."),
        (
            "/v1/services/web",
            "PUT",
            r#"{"backends":[{"id":"a","addr":"127.0.0.1:1","colour":"red"}]}"#,
            400,
            "spec.backends[0]",
        ),
        (
            "/v1/services/web",
            "PUT",
            r#"{"backends":[{"id":"a","addr":"127.0.0.1:1"},{"id":"a","addr":"127.0.0.1:2"}]}"#,
            400,
            "spec.backends[1].id",
        ),
        ("/v1/services/web", "PUT", r#"{"backends":[{"id":"a","addr":"300.1.1.1"}]}"#, 400, "spec.backends[0].addr"),
        ("/v1/routes/r", "PUT", r#"{"service":"missing"}"#, 404, "ops[0].spec.service"),
        ("/v1/services/bad%20name", "PUT", "{}", 400, "path.name"),
    ];
    for (path, method, body, status, field) in cases {
        let r = raw(path, method, body).await;
        let v: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
        assert_eq!(r.status, status, "{method} {path} {body}: {v}");
        let got = v["error"]["field"].as_str().unwrap_or("");
        assert!(got.starts_with(field) || field == ".", "{body}: field {got:?}, wanted {field:?}");
        assert!(!v["error"]["message"].as_str().unwrap_or("").is_empty());
    }
    // An oversized body is refused from its Content-Length, before it is
    // read (raw TCP: a client still streaming 33 MiB would see the close).
    let admin = tg.admin;
    let head = tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(admin).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
        let len = 33 * 1024 * 1024;
        write!(
            s,
            "POST /v1/changes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: {len}\r\n\r\n"
        )
        .unwrap();
        s.write_all(&[b' '; 4096]).unwrap();
        let mut buf = [0u8; 12];
        s.read_exact(&mut buf).unwrap();
        String::from_utf8_lossy(&buf).into_owned()
    })
    .await
    .unwrap();
    assert_eq!(head, "HTTP/1.1 413");
    // Still alive, still empty.
    let (s, config) = tg.api("GET", "/v1/config", None).await;
    assert_eq!((s, config["revision"].as_u64()), (200, Some(0)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_streams_applied_change_sets() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let (s, _) = tg.api("PUT", "/v1/services/a", Some(json!({}))).await;
    assert_eq!(s, 200);
    let admin = tg.admin;
    let reader = tokio::task::spawn_blocking(move || {
        use std::io::{BufRead, BufReader, Write};
        let mut s = std::net::TcpStream::connect(admin).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
        write!(s, "GET /v1/watch?from=0 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n").unwrap();
        let mut ids = Vec::new();
        for line in BufReader::new(s).lines() {
            let line = line.unwrap();
            if let Some(id) = line.strip_prefix("id: ") {
                ids.push(id.parse::<u64>().unwrap());
                if ids.len() == 2 {
                    break;
                }
            }
        }
        ids
    });
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let (s, _) = tg.api("PUT", "/v1/services/b", Some(json!({}))).await;
    assert_eq!(s, 200);
    assert_eq!(reader.await.unwrap(), vec![1, 2], "history first, then live");
    let (s, v) = tg.api("GET", "/v1/watch?from=99", None).await;
    assert_eq!(s, 400, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_and_declarative_files_cover_the_same_operations() {
    let dir = tempfile::tempdir().unwrap();
    let b = Backend::start("cli", &[]);
    let file = dir.path().join("initial.yaml");
    std::fs::write(
        &file,
        format!("services:\n  web:\n    backends:\n      - {{id: a, addr: \"{}\"}}\nroutes:\n  web:\n    match: {{path_prefix: /}}\n    service: web\n", b.addr),
    )
    .unwrap();
    let data = dir.path().join("data");
    let tg = Tidegate::start_with(&data, &["--config", file.to_str().unwrap()]);
    assert_eq!(served_by(&get(&tg.url("/")).await), "cli", "--config loads the file into an empty store");

    let ok = |out: std::process::Output| {
        assert!(
            out.status.success(),
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<Value>(&out.stdout).unwrap_or(Value::Null)
    };
    let addr = b.addr.to_string();
    ok(tg.ctl(&["service", "put", "api", "--policy", "least_conn", "--backend", &format!("x={addr}@3")]));
    ok(tg.ctl(&["backend", "put", "api", "y", "--addr", &addr, "--backup"]));
    ok(tg.ctl(&["route", "put", "api", "--service", "api", "--path-prefix", "/api"]));
    let batch = dir.path().join("batch.json");
    std::fs::write(&batch, r#"{"ops":[{"op":"delete_route","name":"api"},{"op":"delete_service","name":"api"}]}"#)
        .unwrap();
    let v = ok(tg.ctl(&["apply", "-f", batch.to_str().unwrap()]));
    assert_eq!(v["revision"], 5);
    let config = ok(tg.ctl(&["config"]));
    assert!(config["services"].get("api").is_none());
    assert!(config["services"].get("web").is_some());
    let failed = tg.ctl(&["backend", "delete", "web", "nope"]);
    assert!(!failed.status.success());
    assert!(String::from_utf8_lossy(&failed.stdout).contains("no backend"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_never_leave_through_read_apis_and_an_export_applies_back() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let secret = "webhook-shared-secret-value";
    let spec =
        json!({"autoscale": {"provider": {"kind": "webhook", "url": "http://127.0.0.1:9/hook", "secret": secret}}});
    let (s, v) = tg.api("PUT", "/v1/services/w", Some(spec)).await;
    assert_eq!(s, 200, "{v}");
    let key = rcgen::KeyPair::generate().unwrap();
    let signed = |names: &[&str]| {
        let params = rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap();
        params.self_signed(&key).unwrap().pem()
    };
    let cert = json!({"cert_pem": signed(&["a.example"]), "key_pem": key.serialize_pem()});
    let (s, v) = tg.api("PUT", "/v1/certificates/c", Some(cert)).await;
    assert_eq!(s, 200, "{v}");
    let r = send("GET", &tg.admin_url("/v1/config"), Some(TOKEN), Vec::new(), &[]).await;
    assert!(!r.text().contains("PRIVATE KEY"), "{}", r.text());
    for path in ["/v1/config", "/v1/services", "/v1/services/w"] {
        let r = send("GET", &tg.admin_url(path), Some(TOKEN), Vec::new(), &[]).await;
        assert!(!r.text().contains(secret), "{path} shows the secret: {}", r.text());
        assert!(r.text().contains("(redacted)"), "{path}: {}", r.text());
    }
    let watched = read_event(
        tg.admin,
        format!("GET /v1/watch?from=0 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n").as_bytes(),
        "put_certificate",
    );
    assert!(watched.contains("put_service") && !watched.contains(secret), "{watched}");
    // The exported configuration applies back as it is.
    let (_, config) = tg.api("GET", "/v1/config", None).await;
    let exported = json!({"ops": [{"op": "put_service", "name": "w", "spec": config["services"]["w"]}]});
    let (s, v) = tg.api("POST", "/v1/changes", Some(exported.clone())).await;
    assert_eq!(s, 200, "{v}");
    // The whole export, as a desired state: nothing to change.
    let (s, v) = tg.api("PUT", "/v1/config", Some(config.clone())).await;
    assert_eq!((s, v["changes"].clone()), (200, json!([])), "{v}");
    // And as a file for `ctl apply` (puts, with the placeholders).
    let file = dir.path().join("backup.json");
    std::fs::write(&file, config.to_string()).unwrap();
    let out = tg.ctl(&["apply", "-f", file.to_str().unwrap()]);
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    // A renewed chain for the same key, the key as the placeholder.
    let renewed = json!({"cert_pem": signed(&["a.example", "b.example"]), "key_pem": "(redacted)", "default": true});
    let (s, v) = tg.api("PUT", "/v1/certificates/c", Some(renewed)).await;
    assert_eq!(s, 200, "{v}");
    let (_, v) = tg.api("GET", "/v1/certificates/c", None).await;
    assert_eq!(
        (v["certificate"]["names"].clone(), v["certificate"]["default"].clone()),
        (json!(["a.example", "b.example"]), json!(true)),
        "{v}"
    );
    // `ctl cert put` without --key does the same.
    let chain = dir.path().join("chain.pem");
    std::fs::write(&chain, signed(&["c.example"])).unwrap();
    let out = tg.ctl(&["cert", "put", "c", "--cert", chain.to_str().unwrap()]);
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let (_, v) = tg.api("GET", "/v1/certificates/c", None).await;
    assert_eq!(
        (v["certificate"]["names"].clone(), v["certificate"]["default"].clone()),
        (json!(["c.example"]), json!(false))
    );
    // What was stored is the secret and key kept, not the placeholders:
    // the store loads after a crash, and the placeholders still have
    // something to keep.
    tg.kill9();
    let tg = Tidegate::start(dir.path());
    let (s, v) = tg.api("POST", "/v1/changes", Some(exported)).await;
    assert_eq!(s, 200, "{v}");
    let (_, now) = tg.api("GET", "/v1/config", None).await;
    let (s, v) = tg.api("PUT", "/v1/config", Some(now.clone())).await;
    assert_eq!((s, v["changes"].clone()), (200, json!([])), "{v}");
    // A placeholder with nothing to keep changes nothing.
    let orphan = json!({"cert_pem": signed(&["a.example"]), "key_pem": "(redacted)"});
    let (s, v) = tg.api("PUT", "/v1/certificates/new", Some(orphan.clone())).await;
    assert_eq!((s, v["error"]["field"].clone()), (409, json!("ops[0].spec.key_pem")), "{v}");
    // In a document, the error names the document's field.
    let mut doc = now.clone();
    doc["certificates"]["new"] = orphan;
    let (s, v) = tg.api("PUT", "/v1/config", Some(doc)).await;
    assert_eq!((s, v["error"]["field"].clone()), (409, json!("certificates.new.key_pem")), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_need_no_token_and_a_dry_run_applies_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    for path in ["/healthz", "/readyz"] {
        let r = send("GET", &tg.admin_url(path), None, Vec::new(), &[]).await;
        assert_eq!(r.status, 200, "{path}: {}", r.text());
    }
    assert_eq!(send("GET", &tg.admin_url("/v1/config"), None, Vec::new(), &[]).await.status, 401);

    let change = json!({"ops": [{"op": "put_service", "name": "web", "spec": {}}]});
    let (s, v) = tg.api("POST", "/v1/changes?dry_run=true", Some(change.clone())).await;
    assert_eq!((s, v["dry_run"].clone(), v["revision"].clone()), (200, json!(true), json!(0)), "{v}");
    let (_, config) = tg.api("GET", "/v1/config", None).await;
    assert_eq!((config["revision"].clone(), config["services"].clone()), (json!(0), json!({})), "nothing applied");
    // A dry run fails exactly as the real change would.
    let bad = json!({"ops": [{"op": "put_route", "name": "r", "spec": {"match": {"path_prefix": "/"}, "service": "nosuch"}}]});
    let (s, v) = tg.api("POST", "/v1/changes?dry_run=true", Some(bad)).await;
    assert_eq!(s, 404, "{v}");
    let (s, _) = tg.api("POST", "/v1/changes?dry_run=maybe", Some(change.clone())).await;
    assert_eq!(s, 400);
    let (s, v) = tg.api("POST", "/v1/changes", Some(change)).await;
    assert_eq!((s, v["revision"].clone()), (200, json!(1)));
    let (_, v) = tg.api("GET", "/readyz", None).await;
    assert_eq!(v["revision"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_query_parameters_are_refused_and_ctl_prints_tables() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let change = json!({"ops": [{"op": "put_service", "name": "web", "spec": {"backends": [{"id": "a", "addr": "127.0.0.1:9"}]}}]});
    let (s, v) = tg.api("POST", "/v1/changes?dry_rn=true", Some(change)).await;
    assert_eq!(s, 400, "{v}");
    assert_eq!(v["error"]["field"], "query.dry_rn", "{v}");
    let (_, config) = tg.api("GET", "/v1/config", None).await;
    assert_eq!(config["revision"], 0, "a misspelt dry run applies nothing");
    for path in ["/v1/services?verbose=1", "/v1/status?x", "/healthz?probe=1", "/v1/watch?frm=0"] {
        let (s, v) = tg.api("GET", path, None).await;
        assert_eq!(s, 400, "{path}: {v}");
    }
    let (s, _) = tg.api("GET", "/v1/events?after=0", None).await;
    assert_eq!(s, 200, "a parameter the endpoint takes");

    let route = json!({"ops": [
        {"op": "put_service", "name": "web", "spec": {"backends": [{"id": "a", "addr": "127.0.0.1:9"}]}},
        {"op": "put_route", "name": "web", "spec": {"match": {"path_prefix": "/"}, "service": "web"}}]});
    assert_eq!(tg.api("POST", "/v1/changes", Some(route)).await.0, 200);
    let out = tg.ctl(&["-o", "table", "status"]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{table}");
    assert!(table.starts_with("revision 1, 1 route(s)\nSERVICE"), "{table}");
    assert!(table.contains("web      round_robin  a        127.0.0.1:9"), "{table}");
    let out = tg.ctl(&["route", "list", "-o", "yaml"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("path_prefix: /"), "{out:?}");
    let out = tg.ctl(&["service", "list"]);
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON when stdout is not a terminal");
    assert!(v["services"]["web"].is_object());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_does_not_stop_the_proxy() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let b = Backend::start("steady", &[]);
    route_to(&tg, "web", &[&b], "round_robin").await;
    let status = std::process::Command::new("kill").args(["-HUP", &tg.pid().to_string()]).status().unwrap();
    assert!(status.success());
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(get(&tg.url("/")).await.status, 200, "still serving after SIGHUP");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_patch_changes_only_the_fields_it_names_and_loses_none_to_concurrent_patches() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let b = Backend::start("patched", &[]);
    let addr = b.addr.to_string();
    let spec = json!({"backends": [{"id": "a", "addr": addr, "weight": 3, "max_conns": 100}]});
    let (s, v) = tg.api("PUT", "/v1/services/web", Some(spec)).await;
    assert_eq!(s, 200, "{v}");
    let backend = |tg: &Tidegate| {
        let tg_admin = tg.admin_url("/v1/services/web/backends/a");
        async move {
            let r = send("GET", &tg_admin, Some(TOKEN), Vec::new(), &[]).await;
            serde_json::from_slice::<Value>(&r.body).unwrap()
        }
    };
    let patch = |body: Value| tg.api("PATCH", "/v1/services/web/backends/a", Some(body));

    // One field changes, the others stay.
    let (s, v) = patch(json!({"weight": 0})).await;
    assert_eq!(s, 200, "{v}");
    let read = backend(&tg).await;
    assert_eq!(read["spec"], json!({"addr": addr, "weight": 0, "max_conns": 100, "backup": false}), "{read}");
    assert_eq!(read["revision"], v["revision"]);
    // `null` takes a field back to its default.
    let (s, v) = patch(json!({"max_conns": null, "backup": true})).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(backend(&tg).await["spec"], json!({"addr": addr, "weight": 0, "backup": true}));

    // Bad input is refused with the field named, and changes nothing.
    let revision = backend(&tg).await["revision"].clone();
    for (body, field) in [
        (json!({"weight": 10_001}), "spec.weight"),
        (json!({"nope": 1}), "spec"),
        (json!({"addr": "no port"}), "spec.addr"),
        (json!([1, 2]), "spec"),
    ] {
        let (s, v) = patch(body.clone()).await;
        assert_eq!(s, 400, "{body}: {v}");
        assert!(v["error"]["field"].as_str().is_some_and(|f| f.starts_with(field)), "{body}: {v}");
    }
    let (s, v) = tg.api("PATCH", "/v1/services/web/backends/zz", Some(json!({"weight": 1}))).await;
    assert_eq!(s, 404, "{v}");
    assert_eq!(backend(&tg).await["revision"], revision, "nothing was applied");

    // Patches of every field at once, with unrelated changes beside them
    // (which move the revision too): each lands, none undoes another. A
    // patch that wrote back what it read without checking the revision
    // would lose all but the last of them.
    let other = format!("localhost:{}", b.addr.port());
    let bodies = [json!({"weight": 42}), json!({"max_conns": 77}), json!({"backup": false}), json!({"addr": other})];
    let requests = bodies
        .iter()
        .map(|body| ("PATCH", tg.admin_url("/v1/services/web/backends/a"), body.to_string()))
        .chain((0..4).map(|i| ("PUT", tg.admin_url(&format!("/v1/services/other-{i}")), "{}".to_string())));
    let tasks: Vec<_> = requests
        .map(|(method, url, body)| {
            tokio::spawn(async move { send(method, &url, Some(TOKEN), body.into_bytes(), &[]).await })
        })
        .collect();
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let spec = backend(&tg).await["spec"].clone();
    assert_eq!(spec, json!({"addr": other, "weight": 42, "max_conns": 77, "backup": false}), "every patch landed");

    // The same through ctl.
    let out = tg.ctl(&["backend", "set", "web", "a", "--weight", "7", "--no-max-conns", "--backup", "true"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(backend(&tg).await["spec"], json!({"addr": other, "weight": 7, "backup": true}));
    let out = tg.ctl(&["backend", "set", "web", "a"]);
    assert!(!out.status.success(), "set with nothing to change is refused");
}

/// A sample of `name` (no labels) in Prometheus text.
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// The resident memory of a process, KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("the process's status");
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).expect("a VmRSS line");
    line.split_whitespace().nth(1).and_then(|n| n.parse().ok()).expect("VmRSS in KiB")
}

/// The issue's finding: watchers that replay history and never read held
/// all of it in memory (500 of them took Tidegate from 39 MiB to 1.18 GiB).
/// Now each holds a bounded queue, replays beyond the limit are refused
/// with 503, and a watcher whose connection takes nothing is cut with a
/// last `event: lagged` naming the revision to resume from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watchers_that_never_read_hold_bounded_memory_and_are_cut_with_a_last_event() {
    use std::io::{Read, Write};
    use std::time::{Duration, Instant};
    let dir = tempfile::tempdir().unwrap();
    let flags = ["--watch-queue-bytes", "65536", "--watch-stall-timeout-s", "2", "--watch-max-replays", "8"];
    let tg = Tidegate::start_with(dir.path(), &flags);
    // About 10 MB of history: 50 change sets of 2,000 backend puts.
    let began = Instant::now();
    let (s, v) = tg.api("PUT", "/v1/services/big", Some(json!({}))).await;
    assert_eq!(s, 200, "{v}");
    for round in 0..50 {
        let ops: Vec<Value> = (0..2000)
            .map(|i| {
                let spec = json!({"addr": format!("127.0.0.1:{}", 10_000 + i), "weight": round + 1});
                json!({"op": "put_backend", "service": "big", "id": format!("b{i}"), "spec": spec})
            })
            .collect();
        let (s, v) = tg.api("POST", "/v1/changes", Some(json!({ "ops": ops }))).await;
        assert_eq!(s, 200, "{v}");
    }
    eprintln!("history written in {:?}", began.elapsed());
    let metrics = async || send("GET", &tg.admin_url("/metrics"), Some(TOKEN), vec![], &[]).await.text();
    let before = rss_kib(tg.pid());

    // 16 watchers replay it all and never read past the status line.
    let admin = tg.admin;
    let opened = tokio::task::spawn_blocking(move || {
        (0..16)
            .map(|_| {
                let mut s = std::net::TcpStream::connect(admin).unwrap();
                write!(s, "GET /v1/watch?from=0 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n").unwrap();
                let mut status = [0u8; 12];
                s.read_exact(&mut status).unwrap();
                (String::from_utf8_lossy(&status).into_owned(), s)
            })
            .collect::<Vec<_>>()
    })
    .await
    .unwrap();
    let statuses: Vec<&str> = opened.iter().map(|(s, _)| s.as_str()).collect();
    let streaming = statuses.iter().filter(|s| **s == "HTTP/1.1 200").count();
    let refused = statuses.iter().filter(|s| **s == "HTTP/1.1 503").count();

    // Their connections fill and stall: every one is cut. Memory stays
    // bounded meanwhile (each holds its 64 KiB budget, or one change set
    // larger than that; 35 to 50 MiB more in all, measured). The old code
    // held every watcher's whole history: with these 16, 35 MiB grew to
    // over 300 MiB in 40 s.
    let mut peak = before;
    wait_for("the stalled watchers are cut", Duration::from_secs(60), async || {
        peak = peak.max(rss_kib(tg.pid()));
        let grown_mib = peak.saturating_sub(before) / 1024;
        assert!(grown_mib < 150, "RSS grew by {grown_mib} MiB with 16 stalled watchers");
        let text = metrics().await;
        let queued = metric(&text, "tidegate_watch_queued_bytes").unwrap_or(f64::MAX);
        assert!(queued <= 8.0 * 512.0 * 1024.0, "{queued} bytes queued");
        (metric(&text, "tidegate_watch_cut_total") == Some(streaming as f64)).then_some(())
    })
    .await;
    // At most 8 replay at once (a slot comes back when one is cut, which
    // takes 2 s: on a slow machine a late watcher may get it).
    assert!(streaming >= 8 && refused >= 1 && streaming + refused == 16, "{statuses:?}");
    let text = metrics().await;
    assert_eq!(metric(&text, "tidegate_watch_refused_total"), Some(refused as f64), "{text}");
    // Cut: what they had queued is dropped (their last event waits for
    // their connections, which take nothing).
    assert_eq!(metric(&text, "tidegate_watch_queued_bytes"), Some(0.0), "{text}");
    assert_eq!(metric(&text, "tidegate_watch_replays"), Some(0.0), "{text}");
    eprintln!("RSS {} MiB before the watchers, {} MiB at most with them", before / 1024, peak / 1024);

    // A cut watcher that reads now gets what was in flight, then the last
    // event naming the last revision it got, and the stream ends.
    let mut opened = opened.into_iter().filter(|(s, _)| s == "HTTP/1.1 200").map(|(_, s)| s);
    let mut stream = opened.next().unwrap();
    drop(opened);
    let text = tokio::task::spawn_blocking(move || {
        stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut got = Vec::new();
        let mut buf = vec![0u8; 1 << 16];
        // Until the chunked body's last chunk after the lagged event.
        while !(got.windows(13).any(|w| w == b"event: lagged") && got.ends_with(b"\r\n0\r\n\r\n")) {
            assert!(Instant::now() < deadline, "no end of stream");
            match stream.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
        String::from_utf8_lossy(&got).into_owned()
    })
    .await
    .unwrap();
    let lagged =
        text.find("event: lagged\ndata: ").unwrap_or_else(|| panic!("no lagged event in {} bytes", text.len()));
    let data = text[lagged + 20..].lines().next().unwrap();
    let data: Value = serde_json::from_str(data).unwrap();
    let last_id = text[..lagged]
        .rmatch_indices("id: ")
        .find_map(|(i, _)| text[i + 4..].split('\n').next()?.parse::<u64>().ok())
        .expect("some change events before the cut");
    assert_eq!(data["resume_from"].as_u64(), Some(last_id), "{data}");
    assert!(data["error"].as_str().unwrap().contains(&format!("?from={last_id}")), "{data}");
    assert!(!text[lagged..].contains("event: change"), "nothing after the last event");
    wait_for("every stream is closed", Duration::from_secs(10), async || {
        (metric(&metrics().await, "tidegate_watch_streams") == Some(0.0)).then_some(())
    })
    .await;
}
