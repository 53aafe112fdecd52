use super::*;
use crate::testing::{counts, pool};
use proptest::prelude::*;

#[test]
fn smooth_round_robin_interleaves() {
    // nginx's documented example: weights 5, 1, 1 give a a b a c a a.
    let s = smooth_schedule(&[5, 1, 1]);
    assert_eq!(s, vec![0, 0, 1, 0, 2, 0, 0]);
    assert!(smooth_schedule(&[0, 0]).is_empty());
    assert_eq!(smooth_schedule(&[10_000, 10_000]).len(), 2, "common factors are divided out");
}

#[test]
fn round_robin_skips_rejected_backends() {
    let p = pool(&[1, 1, 1]);
    let sel = RoundRobin.build(p);
    let c = counts(&*sel, 3, 300, &mut |b: &Backend| b.id.as_str() != "b1");
    assert_eq!(c[1], 0);
    assert_eq!(c[0] + c[2], 300);
    assert!(c[0].abs_diff(c[2]) <= 2, "{c:?}");
    assert!(counts(&*sel, 3, 5, &mut |_: &Backend| false).iter().all(|&x| x == 0));
}

#[test]
fn a_retry_takes_no_turn_of_the_rotation() {
    // b0 fails every request it gets; each failure is retried elsewhere.
    // First attempts must still follow the weights, not all land on b0.
    for weights in [vec![1, 1], vec![1, 2, 1], vec![3, 1, 1, 1]] {
        let sel = RoundRobin.build(pool(&weights));
        let headers = http::HeaderMap::new();
        let first = RequestCtx::new(None, "/", &headers);
        let retry = RequestCtx { retry: true, ..first };
        let cycle: u32 = weights.iter().sum();
        let mut firsts = vec![0_u32; weights.len()];
        for _ in 0..cycle * 10 {
            let b = sel.select(&first, &mut |_: &Backend| true).unwrap();
            let i: usize = b.id.as_str()[1..].parse().unwrap();
            firsts[i] += 1;
            if i == 0 {
                let again = sel.select(&retry, &mut |b: &Backend| b.id.as_str() != "b0").unwrap();
                assert_ne!(again.id.as_str(), "b0");
            }
        }
        let expected: Vec<u32> = weights.iter().map(|w| w * 10).collect();
        assert_eq!(firsts, expected, "weights {weights:?}");
    }
}

#[test]
fn an_answered_request_leaves_the_learned_limit_but_not_max_conns() {
    let p = pool(&[1]);
    let b = &p.backends()[0];
    let params = crate::limit::LimitParams { tolerance: 1.5, initial: 1.0, min: 1.0, max: 100.0, min_rise_ns: 1e6 };
    b.stats.learn_limit(Some(params));
    // A stream (or a tunnel) whose head arrived stays in flight.
    let mut stream = b.stats.start();
    assert!(!b.has_room(), "one request in flight fills a learned limit of 1");
    assert!(stream.answered());
    assert!(!stream.answered(), "once only");
    assert_eq!((b.stats.in_flight(), b.stats.answered(), b.stats.awaiting_answer()), (1, 1, 0));
    assert!(b.has_room(), "an answered request takes no place under the learned limit");
    let request = b.stats.start();
    assert!(!b.has_room());
    drop((request, stream));
    assert_eq!((b.stats.in_flight(), b.stats.answered()), (0, 0));
    // Under max_conns, it keeps its place.
    let spec = tidegate_model::BackendSpec {
        addr: tidegate_model::BackendAddr::new("127.0.0.1:1000").unwrap(),
        weight: tidegate_model::Weight::try_from(1).unwrap(),
        backup: false,
        max_conns: Some(tidegate_model::MaxConns::try_from(1).unwrap()),
        autoscaled: false,
        dns: false,
    };
    let capped = Backend::new(tidegate_model::BackendId::new("capped").unwrap(), &spec, None);
    let mut stream = capped.stats.start();
    stream.answered();
    assert!(!capped.has_room(), "max_conns counts answered requests until they end");
}

#[test]
fn zero_weight_backends_get_nothing() {
    for policy in [&RoundRobin as &dyn Policy, &RandomPolicy, &LeastConn] {
        let sel = policy.build(pool(&[0, 3]));
        let c = counts(&*sel, 2, 200, &mut |_: &Backend| true);
        assert_eq!(c, vec![0, 200]);
    }
}

#[test]
fn least_conn_prefers_the_least_loaded_per_weight() {
    let p = pool(&[1, 2]);
    let _busy: Vec<_> = (0..3).map(|_| p.backends()[0].stats.start()).collect();
    let _also: Vec<_> = (0..4).map(|_| p.backends()[1].stats.start()).collect();
    // b0: 3/1, b1: 4/2 -> b1.
    let sel = LeastConn.build(p);
    assert_eq!(counts(&*sel, 2, 10, &mut |_: &Backend| true), vec![0, 10]);
}

proptest! {
    #[test]
    fn round_robin_honours_weights_exactly_per_cycle(weights in proptest::collection::vec(0u32..20, 1..8)) {
        let total: u32 = weights.iter().sum();
        prop_assume!(total > 0);
        let n = weights.len();
        let sel = RoundRobin.build(pool(&weights));
        let g = weights.iter().fold(0u32, |g, &w| gcd(u64::from(g), u64::from(w)) as u32);
        let cycle = (total / g) as usize;
        let c = counts(&*sel, n, cycle * 3, &mut |_: &Backend| true);
        for i in 0..n {
            prop_assert_eq!(c[i] as u32, weights[i] / g * 3);
        }
    }

    #[test]
    fn random_honours_weights_within_tolerance(weights in proptest::collection::vec(1u32..10, 2..5)) {
        let total: u32 = weights.iter().sum();
        let draws = 20_000;
        let sel = RandomPolicy.build(pool(&weights));
        let c = counts(&*sel, weights.len(), draws, &mut |_: &Backend| true);
        for (i, &w) in weights.iter().enumerate() {
            let want = draws as f64 * f64::from(w) / f64::from(total);
            prop_assert!((c[i] as f64 - want).abs() < want * 0.15 + 50.0, "{:?} vs {:?}", c, weights);
        }
    }

    #[test]
    fn no_policy_returns_a_rejected_backend(weights in proptest::collection::vec(0u32..5, 1..6), mask in any::<u8>()) {
        for policy in [&RoundRobin as &dyn Policy, &RandomPolicy, &LeastConn] {
            let sel = policy.build(pool(&weights));
            let mut accept = |b: &Backend| {
                let i: usize = b.id.as_str()[1..].parse().unwrap();
                mask & (1 << i) != 0
            };
            let c = counts(&*sel, weights.len(), 50, &mut accept);
            for (i, &n) in c.iter().enumerate() {
                prop_assert!(n == 0 || (mask & (1 << i) != 0 && weights[i] > 0));
            }
            let any = weights.iter().enumerate().any(|(i, &w)| w > 0 && mask & (1 << i) != 0);
            prop_assert_eq!(c.iter().sum::<usize>() == 50, any);
        }
    }
}
