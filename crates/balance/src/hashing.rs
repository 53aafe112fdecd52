//! Consistent hashing with bounded loads: `ip_hash`, `uri_hash`,
//! `header_hash`, `cookie_hash`.
//!
//! Each backend owns points on a ring (100 per unit of weight); a request's
//! key hashes to a point and goes to the owner of the next point clockwise.
//! Adding or removing one of n backends moves only about 1/n of the keys.
//! Bounded loads (Mirrokni et al.): a backend already carrying more than
//! `balance_factor` x the average in-flight load is skipped, and the key
//! walks on to the next backend on the ring, so hot keys cannot overload one
//! backend.

use std::sync::Arc;

use http::header::{HeaderName, COOKIE};
use tidegate_model::{BalanceFactor, HeaderKey};

use crate::policies::{first_accepted, RoundRobinSelector};
use crate::{Backend, Policy, Pool, RequestCtx, Selector};

/// What a request is hashed on.
#[derive(Debug, Clone)]
pub enum HashKey {
    /// The client's IP address.
    ClientIp,
    /// The path and query.
    Uri,
    /// A header's value.
    Header(HeaderName),
    /// A cookie's value.
    Cookie(String),
}

impl HashKey {
    /// A header key; a name that is not a valid header name never matches.
    pub fn header(name: &HeaderKey) -> HashKey {
        match HeaderName::from_bytes(name.as_str().to_ascii_lowercase().as_bytes()) {
            Ok(h) => HashKey::Header(h),
            Err(_) => HashKey::Cookie(String::new()),
        }
    }

    fn hash(&self, ctx: &RequestCtx<'_>) -> Option<u64> {
        match self {
            HashKey::ClientIp => ctx.client.map(|a| match a.ip() {
                std::net::IpAddr::V4(v4) => hash_bytes(&v4.octets()),
                std::net::IpAddr::V6(v6) => hash_bytes(&v6.octets()),
            }),
            HashKey::Uri => Some(hash_bytes(ctx.path.as_bytes())),
            HashKey::Header(h) => ctx.headers.first(h.as_str()).map(hash_bytes),
            HashKey::Cookie(name) if name.is_empty() => None,
            HashKey::Cookie(name) => {
                let mut found = None;
                ctx.headers.any(COOKIE.as_str(), &mut |v| {
                    let Ok(v) = std::str::from_utf8(v) else { return false };
                    found = v.split(';').find_map(|pair| {
                        let (k, v) = pair.trim().split_once('=')?;
                        (k == name).then(|| hash_bytes(v.as_bytes()))
                    });
                    found.is_some()
                });
                found
            }
        }
    }
}

/// FNV-1a with a final avalanche (splitmix64): stable across processes and
/// versions, so several proxies map the same key to the same backend.
pub fn hash_bytes(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// Ring points per unit of weight.
const POINTS_PER_WEIGHT: u32 = 100;
/// Cap on the ring size; large pools get fewer points per backend (each at
/// least one, so the ring holds at most this plus one per backend).
const MAX_POINTS: u64 = 200_000;

/// A consistent-hashing policy.
#[derive(Debug, Clone)]
pub struct ConsistentHash {
    key: HashKey,
    balance: f64,
}

impl ConsistentHash {
    /// Hash on `key`, bounding loads by `balance`.
    pub fn new(key: HashKey, balance: BalanceFactor) -> ConsistentHash {
        ConsistentHash { key, balance: balance.get() }
    }
}

#[derive(Debug)]
struct HashSelector {
    pool: Arc<Pool>,
    key: HashKey,
    balance: f64,
    /// (point, backend index), sorted by point.
    ring: Vec<(u64, u32)>,
    /// For requests without a key.
    fallback: RoundRobinSelector,
}

/// The ring of a pool: points derived from backend ids (not positions), so
/// a backend keeps its points when others come and go.
fn build_ring(pool: &Pool) -> Vec<(u64, u32)> {
    let total: u64 = pool.backends().iter().map(|b| u64::from(b.weight)).sum();
    let per_weight = MAX_POINTS.checked_div(total).map_or(0, |p| p.min(u64::from(POINTS_PER_WEIGHT)));
    // Past MAX_POINTS units of weight, a backend's share of the cap (a
    // weight of 10,000 on 500 backends would otherwise be 5 million points).
    let points = |weight: u64| match per_weight {
        0 => (weight * MAX_POINTS / total.max(1)).max(u64::from(weight > 0)),
        n => weight * n,
    };
    let mut ring = Vec::new();
    for (i, b) in pool.backends().iter().enumerate() {
        for p in 0..points(u64::from(b.weight)) {
            let label = format!("{}#{p}", b.id);
            ring.push((hash_bytes(label.as_bytes()), i as u32));
        }
    }
    ring.sort_unstable();
    ring
}

impl Policy for ConsistentHash {
    fn build(&self, pool: Arc<Pool>) -> Arc<dyn Selector> {
        let weights: Vec<u32> = pool.backends().iter().map(|b| b.weight).collect();
        Arc::new(HashSelector {
            ring: build_ring(&pool),
            fallback: RoundRobinSelector::new(pool.clone(), &weights),
            pool,
            key: self.key.clone(),
            balance: self.balance,
        })
    }
}

impl Selector for HashSelector {
    fn select(&self, ctx: &RequestCtx<'_>, accept: &mut dyn FnMut(&Backend) -> bool) -> Option<Arc<Backend>> {
        let Some(hash) = self.key.hash(ctx) else {
            return self.fallback.select(ctx, accept);
        };
        if self.ring.is_empty() {
            return None;
        }
        let backends = self.pool.backends();
        let total: u64 = backends.iter().map(|b| b.stats.in_flight()).sum();
        // Each backend may carry up to balance x the average, counting this request.
        let limit = (self.balance * (total + 1) as f64 / backends.len() as f64).ceil() as u64;
        let start = self.ring.partition_point(|&(p, _)| p < hash);
        let mut first_ok: Option<usize> = None;
        let mut seen = vec![false; backends.len()];
        let mut distinct = 0;
        for k in 0..self.ring.len() {
            let i = self.ring[(start + k) % self.ring.len()].1 as usize;
            if std::mem::replace(&mut seen[i], true) {
                continue;
            }
            distinct += 1;
            let b = &backends[i];
            if accept(b) {
                if b.stats.in_flight() < limit {
                    return Some(b.clone());
                }
                first_ok.get_or_insert(i);
            }
            if distinct == backends.len() {
                break;
            }
        }
        // Everyone is over the bound: take the key's own choice anyway.
        first_ok.map(|i| backends[i].clone()).or_else(|| first_accepted(&self.pool, 0, accept))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::pool;
    use http::HeaderMap;

    fn pick(sel: &dyn Selector, key: &str) -> String {
        let headers = HeaderMap::new();
        let ctx = RequestCtx::new(None, key, &headers);
        sel.select(&ctx, &mut |_: &Backend| true).unwrap().id.to_string()
    }

    #[test]
    fn the_ring_stays_within_its_cap_whatever_the_weights() {
        let heavy = pool(&[10_000; 500]);
        let ring = build_ring(&heavy);
        assert!(ring.len() as u64 <= MAX_POINTS + 500, "{} points", ring.len());
        assert!(ring.len() as u64 >= MAX_POINTS / 2, "{} points", ring.len());
        // Small pools keep their 100 points per unit of weight.
        assert_eq!(build_ring(&pool(&[1, 2])).len(), 300);
    }

    #[test]
    fn the_same_key_goes_to_the_same_backend() {
        let sel = ConsistentHash::new(HashKey::Uri, BalanceFactor::default()).build(pool(&[1, 1, 1]));
        for k in 0..50 {
            let key = format!("/k{k}");
            assert_eq!(pick(&*sel, &key), pick(&*sel, &key));
        }
    }

    #[test]
    fn removing_a_backend_moves_only_its_keys() {
        let before = ConsistentHash::new(HashKey::Uri, BalanceFactor::default()).build(pool(&[1; 5]));
        // The same backends minus b4 (ids, not positions, place the points).
        let four = pool(&[1; 5]);
        let kept: Vec<_> = four.backends()[..4].to_vec();
        let after = ConsistentHash::new(HashKey::Uri, BalanceFactor::default()).build(Arc::new(Pool::new(kept)));
        let keys = 4_000;
        let mut moved = 0;
        let mut owned_by_b4 = 0;
        for k in 0..keys {
            let key = format!("/key/{k}");
            let (a, b) = (pick(&*before, &key), pick(&*after, &key));
            if a == "b4" {
                owned_by_b4 += 1;
            } else if a != b {
                moved += 1;
            }
        }
        assert_eq!(moved, 0, "keys of the remaining backends stay put");
        let share = owned_by_b4 as f64 / keys as f64;
        assert!((0.12..0.28).contains(&share), "b4 owned {share} of keys, about 1/5 expected");
    }

    #[test]
    fn bounded_loads_hold_for_a_hot_key() {
        let p = pool(&[1, 1, 1, 1]);
        let sel = ConsistentHash::new(HashKey::Uri, BalanceFactor::try_from(1.25).unwrap()).build(p.clone());
        let headers = HeaderMap::new();
        let ctx = RequestCtx::new(None, "/hot", &headers);
        // 40 concurrent requests for one key: held open, so loads accumulate.
        let mut held = Vec::new();
        for _ in 0..40 {
            let b = sel.select(&ctx, &mut |_: &Backend| true).unwrap();
            held.push(b.stats.start());
        }
        let max = p.backends().iter().map(|b| b.stats.in_flight()).max().unwrap();
        // Average is 10; the bound is ceil(1.25 x (total+1) / 4) <= 13.
        assert!(max <= 13, "max in flight {max}");
    }

    #[test]
    fn cookie_and_header_keys() {
        let sel = ConsistentHash::new(HashKey::Cookie("sid".into()), BalanceFactor::default()).build(pool(&[1, 1, 1]));
        let mut headers = HeaderMap::new();
        headers.insert(COOKIE, "theme=dark; sid=abc123".parse().unwrap());
        let ctx = RequestCtx::new(None, "/", &headers);
        let first = sel.select(&ctx, &mut |_: &Backend| true).unwrap().id.clone();
        for _ in 0..20 {
            assert_eq!(sel.select(&ctx, &mut |_: &Backend| true).unwrap().id, first);
        }
        // No cookie: spread by round robin.
        let empty = HeaderMap::new();
        let ctx = RequestCtx::new(None, "/", &empty);
        let mut seen = std::collections::HashSet::new();
        for _ in 0..6 {
            seen.insert(sel.select(&ctx, &mut |_: &Backend| true).unwrap().id.clone());
        }
        assert_eq!(seen.len(), 3);
    }
}
