//! Temporary: round-trip latency of client + reference server on loopback.
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tidegate_distributor::{DistributorClient, Query, ServeOptions, Server};

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mut opts = ServeOptions::new(
        "127.0.0.1:0".parse().unwrap(),
        vec!["127.0.0.1:9001".parse().unwrap(), "127.0.0.2:9002".parse().unwrap()],
    );
    if let Some(p) = args.get(1) {
        opts.node_exporter_port = Some(p.parse().unwrap());
        opts.metrics_interval_ms = 500;
    }
    let server = std::sync::Arc::new(Server::bind(opts).await.unwrap());
    let target: SocketAddr = server.local_addr().unwrap();
    let s2 = server.clone();
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async move { s2.run().await.unwrap() });
    });
    let client = DistributorClient::new();
    let mut headers = http::HeaderMap::new();
    headers.insert("host", "shop.example".parse().unwrap());
    headers.insert("cookie", "sid=abc; x=1".parse().unwrap());
    headers.insert("user-agent", "curl/8.0".parse().unwrap());
    headers.insert("accept", "*/*".parse().unwrap());
    let q = Query {
        policy: "session",
        client: "192.0.2.1:5555".parse().unwrap(),
        method: "GET",
        path: "/index.php?route=product",
        host: None,
        headers: &headers,
    };
    for _ in 0..1000 {
        client.query(target, &q, Duration::from_millis(20), 3).await;
    }
    let n = 20000;
    let start = Instant::now();
    let mut ok = 0;
    for _ in 0..n {
        if client.query(target, &q, Duration::from_millis(20), 3).await.is_some() {
            ok += 1;
        }
    }
    let el = start.elapsed();
    println!("sequential: {ok}/{n} answered, mean {:.1} us", el.as_secs_f64() * 1e6 / n as f64);
    let mut buf = Vec::new();
    let start = Instant::now();
    for i in 0..n {
        tidegate_distributor::protocol::encode_query(i, &q, &mut buf).unwrap();
    }
    println!("encode: {:.0} ns, {} bytes", start.elapsed().as_secs_f64() * 1e9 / n as f64, buf.len());
    let client = std::rc::Rc::new(client);
    let start = Instant::now();
    let set = tokio::task::LocalSet::new();
    let total = 64 * 500;
    set.run_until(async {
        let mut hs = Vec::new();
        for _ in 0..64 {
            let c = client.clone();
            let h = headers.clone();
            hs.push(tokio::task::spawn_local(async move {
                let q = Query {
                    policy: "round_robin",
                    client: "192.0.2.1:5555".parse().unwrap(),
                    method: "GET",
                    path: "/",
                    host: None,
                    headers: &h,
                };
                let mut ok = 0;
                for _ in 0..500 {
                    if c.query(target, &q, Duration::from_millis(50), 3).await.is_some() {
                        ok += 1
                    }
                }
                ok
            }));
        }
        let mut ok = 0;
        for h in hs {
            ok += h.await.unwrap();
        }
        println!("64 concurrent: {ok}/{total}, {:.0} queries/s", total as f64 / start.elapsed().as_secs_f64());
    })
    .await;
    println!("client {:?}\nserver {:?}", client.stats(), server.stats());
    if args.len() > 1 {
        let q = Query { policy: "least_cpu", ..q };
        for _ in 0..4 {
            tokio::time::sleep(Duration::from_millis(600)).await;
            println!("least_cpu -> {:?}", client.query(target, &q, Duration::from_millis(20), 3).await);
        }
    }
}
