//! Property tests of the one decode path: every value that decodes is
//! valid, survives a serialize/decode round trip unchanged, and every
//! invalid value is refused, whichever door it comes through (the API, a
//! file and the store all decode with these same `Deserialize` impls).

use proptest::prelude::*;

use crate::{RouteSpec, ServiceSpec};

/// A service body with some fields valid and some not.
fn service_json() -> impl Strategy<Value = (String, bool)> {
    (
        prop::sample::select(vec!["round_robin", "least_conn", "random", "p2c_ewma", "ip_hash", "least_time"]),
        0u32..4,
        0u32..13,
        prop::sample::select(vec![0u64, 1, 2_000, 86_400_001]),
        prop::sample::select(vec![0u32, 256, 100_001]),
        prop::collection::vec(("[a-c]{1,2}", 1u16..3, any::<bool>()), 0..4),
        prop::sample::select(vec!["127.0.0.1", "db.internal", "bad host", "::1"]),
    )
        .prop_map(|(policy, weight, retries, connect, max_idle, backends, host)| {
            let list: Vec<String> = backends
                .iter()
                .map(|(id, port, backup)| {
                    format!(r#"{{"id":"{id}","addr":"{host}:{port}","weight":{weight},"backup":{backup}}}"#)
                })
                .collect();
            let ids: std::collections::HashSet<&String> = backends.iter().map(|b| &b.0).collect();
            let valid = (backends.is_empty() || (host != "bad host" && host != "::1"))
                && ids.len() == backends.len()
                && retries <= 10
                && (1..=86_400_000).contains(&connect)
                && max_idle <= 100_000;
            let text = format!(
                r#"{{"policy":{{"kind":"{policy}"}},"retries":{retries},"timeouts":{{"connect_ms":{connect}}},"upstream":{{"max_idle":{max_idle}}},"backends":[{}]}}"#,
                list.join(",")
            );
            (text, valid)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(600))]

    #[test]
    fn services_decode_only_when_valid_and_round_trip(case in service_json()) {
        let (text, valid) = case;
        match serde_json::from_str::<ServiceSpec>(&text) {
            Ok(spec) => {
                prop_assert!(valid, "decoded an invalid service: {}", text);
                let back = serde_json::to_string(&spec).expect("serializes");
                let again: ServiceSpec = serde_json::from_str(&back).expect("its own output decodes");
                prop_assert_eq!(&spec, &again);
                prop_assert_eq!(back, serde_json::to_string(&again).expect("serializes"));
            }
            Err(e) => prop_assert!(!valid, "refused a valid service: {} ({})", text, e),
        }
    }

    #[test]
    fn routes_round_trip_and_never_panic(
        host in prop::sample::select(vec!["", "a.example", "*.example", "A.Example", "bad host", "*"]),
        path in prop::sample::select(vec!["/", "/api", "/api/", "api", "", "/a b", "/x/*"]),
        exact in any::<bool>(),
        priority in -3i64..3,
    ) {
        let key = if exact { "path" } else { "path_prefix" };
        let text = format!(r#"{{"match":{{"host":"{host}","{key}":"{path}"}},"service":"web","priority":{priority}}}"#);
        if let Ok(route) = serde_json::from_str::<RouteSpec>(&text) {
            let back = serde_json::to_string(&route).expect("serializes");
            let again: RouteSpec = serde_json::from_str(&back).expect("its own output decodes");
            prop_assert_eq!(route, again);
        }
    }
}
