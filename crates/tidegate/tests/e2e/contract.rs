//! The admin API against its own OpenAPI document, checked by a
//! property-based tester (schemathesis, from PyPI; `scripts/test` installs
//! it): about 5,000 generated requests, valid and invalid, against a live
//! instance. No 5xx; every status, content type, header and body as the
//! document says; the token enforced; deleted objects gone.
//!
//! Two of schemathesis' checks are left out, for reasons the document
//! cannot express: `positive_data_acceptance` (some valid-looking inputs
//! are refused by rules across fields: `min` above `max`, an expired
//! certificate, a route to a missing service) and
//! `negative_data_rejection` (serde reads an object given as an array of
//! its fields in order, which the document does not list).

use std::process::Command;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_keeps_its_openapi_contract() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(&dir.path().join("data"));
    let doc = get(&tg.admin_url("/v1/openapi.json")).await;
    assert_eq!(doc.status, 200);
    let url = tg.admin_url("/v1/openapi.json");
    let out = tokio::task::spawn_blocking(move || {
        Command::new("schemathesis")
            .current_dir(dir.path())
            .args(["run", &url, "--checks", "all", "--exclude-checks"])
            .arg("positive_data_acceptance,negative_data_rejection")
            .args(["--exclude-path", "/v1/watch", "--max-examples", "30", "--seed", "7", "--no-color"])
            .args(["--generation-database", "none", "--request-timeout", "20"])
            .arg("--header")
            .arg(format!("Authorization: Bearer {TOKEN}"))
            .output()
            .expect("schemathesis (pip install schemathesis; scripts/test installs it)")
    })
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "schemathesis found failures:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("Tested: 34"), "{text}");
}
