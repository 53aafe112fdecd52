use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::fd::AsFd;

use super::*;

fn pair(timeouts: Timeouts) -> (Predecessor, Successor) {
    let (a, b) = UnixStream::pair().expect("socketpair");
    (Predecessor { channel: Channel::new(a, timeouts) }, Successor { channel: Channel::new(b, timeouts) })
}

fn quick() -> Timeouts {
    let t = Duration::from_millis(300);
    Timeouts { step: t, offer: t, ready: t }
}

#[test]
fn a_whole_hand_over_moves_working_sockets() {
    let (mut old, mut new) = pair(Timeouts::default());
    let proxy = TcpListener::bind("127.0.0.1:0").expect("bind");
    let admin = TcpListener::bind("127.0.0.1:0").expect("bind");
    let (proxy_addr, admin_addr) = (proxy.local_addr().expect("addr"), admin.local_addr().expect("addr"));
    let successor = std::thread::spawn(move || {
        let offer = new.request(true, true).expect("offer");
        let learned = new.ready().expect("go");
        assert_eq!(learned, Some(serde_json::json!({"limits": [1, 2]})));
        let mut watching = new.serving().expect("serving");
        let reports = [watching.next(Duration::from_secs(5)), watching.next(Duration::from_secs(5))];
        (offer, reports.map(|r| r.expect("a report")), watching.next(Duration::from_secs(5)))
    });
    assert_eq!(
        old.hello().expect("hello"),
        Request::HandOver(Hello { pid: std::process::id(), store: true, memory: true })
    );
    let listeners = [
        (ListenerInfo { kind: Kind::Proxy, addr: proxy_addr }, proxy.as_fd()),
        (ListenerInfo { kind: Kind::Admin, addr: admin_addr }, admin.as_fd()),
    ];
    old.offer(&listeners, true, Some(7)).expect("offer sent");
    old.ready().expect("ready");
    old.go(Some(serde_json::json!({"limits": [1, 2]}))).expect("go sent");
    old.serving().expect("serving");
    old.draining(3).expect("draining sent");
    old.drained(1).expect("drained sent");
    let (offer, reports, after) = successor.join().expect("successor");
    assert_eq!(reports, [Drain::Draining(3), Drain::Drained { cut: 1 }]);
    assert!(matches!(after, Err(TakeoverError::Closed { step: Step::Drain })), "{after:?}");
    assert_eq!((offer.pid, offer.lease), (std::process::id(), Some(7)));
    assert!(offer.store_released);
    let kinds: Vec<Kind> = offer.listeners.iter().map(|(i, _)| i.kind).collect();
    assert_eq!(kinds, [Kind::Proxy, Kind::Admin]);
    assert_eq!(offer.listeners[0].0.addr, proxy_addr);
    // The received descriptor is the same socket: a connection queued on
    // it before the old copy is closed is accepted through the new one.
    let mut client = std::net::TcpStream::connect(proxy_addr).expect("connect");
    drop(proxy);
    let received: TcpListener = offer.listeners.into_iter().next().expect("proxy").1.into();
    assert_eq!(received.local_addr().expect("addr"), proxy_addr);
    let (mut served, _) = received.accept().expect("accept through the received socket");
    client.write_all(b"ping").expect("write");
    let mut got = [0u8; 4];
    served.read_exact(&mut got).expect("read");
    assert_eq!(&got, b"ping");
}

#[test]
fn another_version_is_refused_with_a_reason() {
    let (mut old, mut new) = pair(quick());
    new.channel
        .send(Step::Hello, &Message::Hello { version: 99, pid: 1, store: false, memory: false }, &[])
        .expect("send");
    let err = old.hello().expect_err("refused");
    assert!(matches!(err, TakeoverError::Version { theirs: 99, ours: PROTOCOL_VERSION }), "{err}");
    let err = new.channel.receive(Step::Offer, Duration::from_secs(1)).expect_err("refusal");
    assert!(err.to_string().contains("not 99"), "{err}");
}

#[test]
fn a_silent_peer_times_out_naming_the_step() {
    let (mut old, _new) = pair(quick());
    let err = old.hello().expect_err("timeout");
    assert!(matches!(err, TakeoverError::Timeout { step: Step::Hello, .. }), "{err}");
    assert!(err.to_string().contains("hello"), "{err}");
}

#[test]
fn a_peer_that_leaves_is_a_closed_step() {
    let (mut old, mut new) = pair(quick());
    let t = std::thread::spawn(move || {
        let _ = new.request(true, false);
        drop(new);
    });
    old.hello().expect("hello");
    old.offer(&[], false, None).expect("offer");
    t.join().expect("thread");
    let err = old.ready().expect_err("closed");
    assert!(matches!(err, TakeoverError::Closed { step: Step::Ready }), "{err}");
}

#[test]
fn a_refusal_reaches_the_successor() {
    let (mut old, mut new) = pair(quick());
    let t = std::thread::spawn(move || new.request(false, false));
    old.hello().expect("hello");
    old.refuse("the running instance uses etcd");
    let err = t.join().expect("thread").expect_err("refused");
    assert!(matches!(err, TakeoverError::Refused { step: Step::Offer, .. }), "{err}");
    assert!(err.to_string().contains("etcd"), "{err}");
}

#[test]
fn garbage_and_oversized_frames_are_protocol_errors() {
    let (mut old, new) = pair(quick());
    let mut raw = new.channel.stream;
    raw.write_all(&4u32.to_be_bytes()).expect("write");
    raw.write_all(b"nope").expect("write");
    assert!(matches!(old.hello(), Err(TakeoverError::Protocol { step: Step::Hello, .. })));
    raw.write_all(&u32::MAX.to_be_bytes()).expect("write");
    let err = old.hello().expect_err("too large");
    assert!(err.to_string().contains("at most"), "{err}");
}

#[test]
fn the_socket_file_is_owner_only_replaces_a_stale_one_and_goes_away() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = socket_path(dir.path());
    // A file left by a process that died.
    drop(UnixListener::bind(&path).expect("stale"));
    let listening = Listening::bind(&path).expect("bind over a stale socket");
    assert_eq!(std::fs::metadata(&path).expect("meta").permissions().mode() & 0o777, 0o600);
    let t = std::thread::spawn({
        let path = path.clone();
        move || Successor::connect(&path, quick()).and_then(|mut s| s.request(false, false))
    });
    let mut old = listening.accept(quick()).expect("same user is accepted");
    assert!(matches!(old.hello().expect("hello"), Request::HandOver(Hello { store: false, .. })));
    old.refuse("test");
    assert!(t.join().expect("thread").is_err());
    let err = Listening::bind(&path).expect_err("a live one is kept");
    assert!(err.to_string().contains("another process"), "{err}");
    drop(listening);
    assert!(!path.exists());
    let err = Successor::connect(&path, quick()).expect_err("nobody");
    assert!(matches!(err, TakeoverError::NoInstance { .. }), "{err}");
}

#[test]
fn a_hello_of_the_first_version_without_memory_reads_as_not_asking() {
    let (mut old, new) = pair(quick());
    let mut raw = new.channel.stream;
    let body = br#"{"type":"hello","version":1,"pid":7,"store":true}"#;
    raw.write_all(&(body.len() as u32).to_be_bytes()).expect("write");
    raw.write_all(body).expect("write");
    assert_eq!(old.hello().expect("hello"), Request::HandOver(Hello { pid: 7, store: true, memory: false }));
}

#[test]
fn a_successor_that_gets_no_learned_state_starts_blank() {
    let (mut old, mut new) = pair(quick());
    let t = std::thread::spawn(move || {
        new.request(true, true).expect("offer");
        new.ready()
    });
    old.hello().expect("hello");
    old.offer(&[], true, None).expect("offer");
    old.ready().expect("ready");
    old.go(None).expect("go");
    assert_eq!(t.join().expect("thread").expect("went"), None);
}

#[test]
fn a_question_is_answered_with_how_the_instance_was_started() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = socket_path(dir.path());
    let listening = Listening::bind(&path).expect("bind");
    let description = Description {
        pid: 42,
        exe: Some("/usr/bin/tidegate".into()),
        cwd: Some("/".into()),
        args: vec!["serve".into(), "--data-dir".into(), "/var/lib/tidegate".into()],
        env: vec![("TIDEGATE_LOG".into(), "info".into())],
    };
    let t = std::thread::spawn({
        let path = path.clone();
        move || describe(&path, quick())
    });
    let mut old = listening.accept(quick()).expect("accepted");
    assert_eq!(old.hello().expect("question"), Request::Describe);
    old.describe(description.clone()).expect("answered");
    assert_eq!(t.join().expect("thread").expect("described"), description);
}
