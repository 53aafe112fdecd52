//! Crash safety: what was acknowledged survives `kill -9`.

use serde_json::json;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_then_restart_restores_every_acknowledged_change() {
    let dir = tempfile::tempdir().unwrap();
    let b = Backend::start("durable", &[]);
    let tg = Tidegate::start(dir.path());
    route_to(&tg, "web", &[&b], "round_robin").await;
    // Many concurrent single changes, so several group commits carry many each.
    let mut tasks = Vec::new();
    let tg = std::sync::Arc::new(tg);
    for i in 0..300 {
        let tg = tg.clone();
        tasks.push(tokio::spawn(async move {
            let body = json!({"addr": format!("127.0.0.1:{}", 20000 + i)});
            tg.api("PUT", &format!("/v1/services/web/backends/n{i}"), Some(body)).await
        }));
    }
    let mut acked = 0;
    for t in tasks {
        let (s, _) = t.await.unwrap();
        assert_eq!(s, 200);
        acked += 1;
    }
    let tg = std::sync::Arc::into_inner(tg).expect("sole owner");
    let data = tg.data_dir.clone();
    tg.kill9();

    let tg = Tidegate::start(&data);
    let (_, config) = tg.api("GET", "/v1/config", None).await;
    assert_eq!(config["revision"], 2 + acked);
    assert_eq!(config["services"]["web"]["backends"].as_array().unwrap().len(), 301);
    // Routes are live again, and the emulator's backend b0 still serves.
    let (s, _) = tg.api("DELETE", "/v1/services/web", None).await;
    assert_eq!(s, 409, "the route still uses it");
    let r = get(&tg.url("/")).await;
    assert!(r.status == 200 || r.status == 502, "{}", r.status);
}
