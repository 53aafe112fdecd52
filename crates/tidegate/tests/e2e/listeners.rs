//! Named listeners (issue 40): added, changed and removed at runtime
//! through the API, each with the routes bound to it, plain, TLS or
//! behind the PROXY protocol, while requests on the default listener go
//! on without one failing.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::*;

/// A loopback port nothing listens on now.
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

/// One GET on a connection of its own: the status and the `x-backend`
/// that answered (`None` when the connection was refused or closed).
fn get_on(addr: SocketAddr, path: &str, prefix: &[u8]) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    s.write_all(prefix).ok()?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes()).ok()?;
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let status = out.split(' ').nth(1)?.parse().ok()?;
    let backend = out
        .lines()
        .find_map(|l| l.to_ascii_lowercase().strip_prefix("x-backend: ").map(str::to_string))
        .unwrap_or_default();
    Some((status, backend))
}

async fn listener_status(tg: &Tidegate, name: &str) -> Value {
    let (_, status) = tg.api("GET", "/v1/status", None).await;
    status["listeners"][name].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listeners_come_and_go_at_runtime_with_their_own_routes_and_drop_nothing_elsewhere() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let public = Backend::start("public", &[]);
    let internal = Backend::start("internal", &[]);
    for (name, b) in [("pub", &public), ("int", &internal)] {
        let spec = json!({ "backends": [{ "id": "b0", "addr": b.addr.to_string() }] });
        let (s, v) = tg.api("PUT", &format!("/v1/services/{name}"), Some(spec)).await;
        assert_eq!(s, 200, "{v}");
    }
    let (s, v) =
        tg.api("PUT", "/v1/routes/pub", Some(json!({ "match": { "path_prefix": "/" }, "service": "pub" }))).await;
    assert_eq!(s, 200, "{v}");
    // A route bound to a listener that does not exist is refused.
    let internal_route = json!({ "match": { "path_prefix": "/" }, "service": "int", "listeners": ["internal"] });
    let (s, v) = tg.api("PUT", "/v1/routes/int", Some(internal_route.clone())).await;
    assert_eq!((s, v["error"]["field"].as_str()), (404, Some("ops[0].spec.listeners[0]")), "{v}");

    // Requests on the default listener all along.
    let load = Requests::start(tg.url("/"));
    load.more(20, "requests on the default listener").await;

    // A plain listener, and the route bound to it.
    let port = free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let out = tg.ctl(&["listener", "put", "internal", "--addr", &addr.to_string()]);
    assert!(out.status.success(), "ctl listener put: {}", String::from_utf8_lossy(&out.stderr));
    let out = tg.ctl(&["-o", "table", "listener", "list"]);
    let table = String::from_utf8_lossy(&out.stdout);
    let row = table.lines().find(|l| l.starts_with("internal")).unwrap_or_default();
    assert!(row.contains(&addr.to_string()) && row.contains(" no "), "ctl listener list:\n{table}");
    let (s, v) = tg.api("PUT", "/v1/routes/int", Some(internal_route)).await;
    assert_eq!(s, 200, "{v}");
    let answer = wait_for("the new listener serves its route", Duration::from_secs(10), async || {
        get_on(addr, "/", b"").filter(|(status, _)| *status == 200)
    })
    .await;
    assert_eq!(answer.1, "internal", "the named listener's request took its own route");
    // The default listener keeps its route; the named one has only its own.
    assert_eq!(served_by(&get(&tg.url("/")).await), "public");
    let status = listener_status(&tg, "internal").await;
    assert_eq!((status["state"].as_str(), status["addr"].as_str()), (Some("listening"), Some(&*addr.to_string())));
    let (s, read) = tg.api("GET", "/v1/listeners/internal", None).await;
    assert_eq!(s, 200, "{read}");
    assert_eq!(read["used_by"], json!(["int"]));
    // Bound, it cannot be deleted.
    let (s, v) = tg.api("DELETE", "/v1/listeners/internal", None).await;
    assert_eq!(s, 409, "{v}");
    assert!(v["error"]["message"].as_str().unwrap_or("").contains("int"), "{v}");

    // Moved behind the PROXY protocol from loopback: the client is the
    // one the header names, and a connection without it is closed.
    let spec = json!({ "addr": addr.to_string(), "proxy_protocol": { "trusted": ["127.0.0.0/8"] } });
    let (s, v) = tg.api("PUT", "/v1/listeners/internal", Some(spec)).await;
    assert_eq!(s, 200, "{v}");
    let header = b"PROXY TCP4 192.0.2.7 127.0.0.1 40000 80\r\n";
    wait_for("the listener reads the PROXY protocol", Duration::from_secs(10), async || {
        get_on(addr, "/", header).filter(|(status, _)| *status == 200)
    })
    .await;
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(header).unwrap();
    s.write_all(b"GET /echo HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    assert!(out.to_ascii_lowercase().contains("192.0.2.7"), "the backend did not see the named client: {out}");
    assert_eq!(get_on(addr, "/", b"").map(|(s, _)| s), None, "a connection without a header was served");

    // Unbound and deleted: its port closes; the default listener goes on.
    let (s, v) = tg.api("DELETE", "/v1/routes/int", None).await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = tg.api("DELETE", "/v1/listeners/internal", None).await;
    assert_eq!(s, 200, "{v}");
    wait_for("the listener's port closes", Duration::from_secs(10), async || {
        TcpStream::connect(addr).is_err().then_some(())
    })
    .await;
    assert!(listener_status(&tg, "internal").await.is_null());
    load.more(20, "requests on the default listener after").await;
    let (ok, failed) = load.stop().await;
    assert_eq!(failed, 0, "{failed} requests on the default listener failed ({ok} answered)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_listener_serves_the_configured_certificates_and_a_busy_address_is_retried() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let b = Backend::start("secure", &[]);
    let ca = crate::tls::Ca::new();
    let leaf = ca.leaf(&["app.example"]);
    let cert = json!({ "cert_pem": leaf.cert_pem, "key_pem": leaf.key_pem, "default": true });
    let (s, v) = tg.api("PUT", "/v1/certificates/app", Some(cert)).await;
    assert_eq!(s, 200, "{v}");
    let spec = json!({ "backends": [{ "id": "b0", "addr": b.addr.to_string() }] });
    let (s, v) = tg.api("PUT", "/v1/services/web", Some(spec)).await;
    assert_eq!(s, 200, "{v}");

    // The address is taken by someone else first: reported, tried again.
    let holder = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = holder.local_addr().unwrap();
    let changes = json!({ "ops": [
        { "op": "put_listener", "name": "secure", "spec": { "addr": addr.to_string(), "tls": true } },
        { "op": "put_route", "name": "web", "spec": {
            "match": { "path_prefix": "/" }, "service": "web", "listeners": ["secure"] } },
    ]});
    let (s, v) = tg.api("POST", "/v1/changes", Some(changes)).await;
    assert_eq!(s, 200, "{v}");
    let failed = wait_for("the listener's failure is reported", Duration::from_secs(10), async || {
        let st = listener_status(&tg, "secure").await;
        (st["state"] == "failed").then_some(st)
    })
    .await;
    assert!(failed["error"].as_str().is_some_and(|e| !e.is_empty()), "{failed}");
    drop(holder);
    wait_for("the listener opens once the address is free", Duration::from_secs(20), async || {
        (listener_status(&tg, "secure").await["state"] == "listening").then_some(())
    })
    .await;
    let mut tls = crate::tls::connect(&ca, addr, Some("app.example"), &[]).await.expect("a verified handshake");
    let reply = crate::tls::exchange(&mut tls, "/echo", "app.example").await;
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(reply.to_ascii_lowercase().contains("\"x-forwarded-proto\":\"https\""), "{reply}");
    // The default listener has no route for it.
    assert_eq!(get(&tg.url("/")).await.status, 404);
}
