//! Token buckets and in-flight counters per key, in tables of bounded size.
//!
//! A table holds at most [`SHARDS`] × its per-shard capacity keys, whatever
//! number of distinct keys arrives: keys are kept as 64-bit hashes (seeded
//! per process), so each entry is a fixed 32 bytes or so. When a shard is
//! full, a new key evicts, among the first [`SAMPLE`] entries of the shard,
//! the bucket that holds the most tokens once refilled: a full bucket is
//! the same as a fresh one, so evicting it forgets nothing; a key that is
//! being limited keeps its (low) bucket unless every sampled one is lower.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Shards of a table (each behind its own lock).
pub const SHARDS: usize = 16;
/// Entries a shard visits to choose one to evict.
pub const SAMPLE: usize = 16;
/// The default number of keys a rate-limit table holds (65,536; about
/// 3 MiB with the map's overhead).
pub const DEFAULT_KEYS: usize = 65_536;

/// One token bucket, in thousandths of a token, refilled until `at`
/// (nanoseconds since its table's origin: a subtraction of two integers
/// per refill, not of two clock readings).
#[derive(Debug, Clone, Copy)]
struct Bucket {
    milli: u64,
    at: u64,
}

/// A rate limit's buckets: `rate` thousandths of a token per second, at
/// most `capacity` thousandths held; a request takes 1000.
#[derive(Debug)]
pub struct Buckets {
    rate: u64,
    capacity: u64,
    per_shard: usize,
    hasher: foldhash::fast::RandomState,
    shards: Vec<Shard>,
    /// The time the buckets' clocks count from.
    origin: Instant,
}

/// One shard of a table, on cache lines of its own (the shards of keys
/// that different cores take are not passed back and forth together).
#[derive(Debug)]
#[repr(align(128))]
struct Shard(Mutex<HashMap<u64, Bucket, Hashed>>);

/// The tables' keys are already 64-bit hashes (foldhash, seeded per
/// process): the maps use them as they are instead of hashing them again.
#[derive(Debug, Clone, Copy, Default)]
struct Hashed;

impl BuildHasher for Hashed {
    type Hasher = HashedKey;
    fn build_hasher(&self) -> HashedKey {
        HashedKey(0)
    }
}

/// The hasher of [`Hashed`]: the key itself.
#[derive(Debug, Default)]
struct HashedKey(u64);

impl std::hash::Hasher for HashedKey {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used (the keys are `u64`); anything else
        // folds in, byte by byte.
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// The shard of a hash: its top bits (the map inside uses the others).
fn shard_of(h: u64) -> usize {
    (h >> 60) as usize % SHARDS
}

/// What a bucket said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Let through (a token taken).
    Yes,
    /// Refused: a token will be there after this long.
    No(Duration),
}

impl Buckets {
    /// Buckets refilled at `rate_milli` thousandths of a token per second,
    /// each holding at most `burst` tokens, for at most `keys` keys.
    pub fn new(rate_milli: u64, burst: u32, keys: usize) -> Buckets {
        let per_shard = keys.div_ceil(SHARDS).max(1);
        Buckets {
            rate: rate_milli.max(1),
            capacity: u64::from(burst.max(1)) * 1000,
            per_shard,
            hasher: foldhash::fast::RandomState::default(),
            shards: (0..SHARDS)
                .map(|_| Shard(Mutex::new(HashMap::with_capacity_and_hasher(per_shard.min(1024), Hashed))))
                .collect(),
            origin: Instant::now(),
        }
    }

    /// `now` on the buckets' clock (0 before the table was made: a
    /// request read before its chain compiled).
    fn clock(&self, now: Instant) -> u64 {
        u64::try_from(now.saturating_duration_since(self.origin).as_nanos()).unwrap_or(u64::MAX)
    }

    fn refill(&self, b: Bucket, now: u64, rate: u64) -> u64 {
        self.refilled(b, now, rate).milli
    }

    /// `b` refilled at `rate` until `now`. Its clock moves only by the time
    /// the thousandths added stand for (the rest of a thousandth's time is
    /// kept for the next refill, so requests that come faster than a
    /// thousandth of a token still refill at the rate), or to `now` when
    /// it is full.
    fn refilled(&self, b: Bucket, now: u64, rate: u64) -> Bucket {
        let since = now.saturating_sub(b.at);
        let room = self.capacity.saturating_sub(b.milli);
        let full = Bucket { milli: self.capacity, at: now.max(b.at) };
        // Full again: the usual case of a generous limit, decided with a
        // multiplication, on 64 bits while the products fit (a refill
        // asked for within seconds of the last, of a bucket with room for
        // a few million tokens), else on 128 (the divisions below cost
        // more on 128 bits).
        if let (Some(gained), Some(needed)) = (since.checked_mul(rate), room.checked_mul(1_000_000_000)) {
            if gained >= needed {
                return full;
            }
        }
        let elapsed = u128::from(since);
        if elapsed.saturating_mul(u128::from(rate)) >= u128::from(room).saturating_mul(1_000_000_000) {
            return full;
        }
        let added = elapsed.saturating_mul(u128::from(rate)) / 1_000_000_000;
        let level = u128::from(b.milli) + added;
        if level >= u128::from(self.capacity) {
            return full;
        }
        let spent = added.saturating_mul(1_000_000_000) / u128::from(rate);
        Bucket { milli: level as u64, at: b.at.saturating_add(u64::try_from(spent).unwrap_or(u64::MAX)) }
    }

    /// Takes a token for `key` at `now`, or says how long until one.
    pub fn take(&self, key: impl Hash, now: Instant) -> Admit {
        self.take_share(key, now, 1)
    }

    /// As [`Buckets::take`], refilled at the rate divided by `share` (the
    /// live instances of a cluster, for a per-instance share; at least 1).
    pub fn take_share(&self, key: impl Hash, now: Instant, share: u32) -> Admit {
        // No division for the usual share of one (a division takes tens
        // of cycles).
        let rate = if share <= 1 { self.rate } else { (self.rate / u64::from(share)).max(1) };
        let now = self.clock(now);
        let h = self.hasher.hash_one(key);
        let shard = &self.shards[shard_of(h)];
        let mut map = match shard.0.lock() {
            Ok(m) => m,
            Err(poisoned) => poisoned.into_inner(),
        };
        if map.len() >= self.per_shard && !map.contains_key(&h) {
            let victim = map.iter().take(SAMPLE).max_by_key(|(_, b)| self.refill(**b, now, rate)).map(|(k, _)| *k);
            if let Some(k) = victim {
                map.remove(&k);
            }
        }
        let bucket = map.entry(h).or_insert(Bucket { milli: self.capacity, at: now });
        let refilled = self.refilled(*bucket, now, rate);
        let level = refilled.milli;
        bucket.at = refilled.at;
        if level >= 1000 {
            bucket.milli = level - 1000;
            Admit::Yes
        } else {
            bucket.milli = level;
            let missing = 1000 - level;
            Admit::No(Duration::from_nanos(missing.saturating_mul(1_000_000_000) / rate))
        }
    }

    /// Keys held now.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.0.lock().map_or(0, |m| m.len())).sum()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The most keys it holds.
    pub fn max_keys(&self) -> usize {
        self.per_shard * SHARDS
    }
}

/// In-flight counts per key, at most `max` per key and `keys` keys.
#[derive(Debug)]
pub struct InFlight {
    max: u32,
    keys: usize,
    hasher: foldhash::fast::RandomState,
    counts: Mutex<HashMap<u64, u32, Hashed>>,
}

impl InFlight {
    /// At most `max` requests at once per key; at most `keys` keys with
    /// requests in flight (more are refused, as if at their limit).
    pub fn new(max: u32, keys: usize) -> InFlight {
        InFlight {
            max,
            keys,
            hasher: foldhash::fast::RandomState::default(),
            counts: Mutex::new(HashMap::with_hasher(Hashed)),
        }
    }

    /// Counts one more request of `key`, or `None` at the limit. The
    /// count goes down when the permit drops.
    pub fn enter(self: &std::sync::Arc<Self>, key: impl Hash) -> Option<Permit> {
        let h = self.hasher.hash_one(key);
        let mut map = match self.counts.lock() {
            Ok(m) => m,
            Err(poisoned) => poisoned.into_inner(),
        };
        if map.len() >= self.keys && !map.contains_key(&h) {
            return None;
        }
        let n = map.entry(h).or_insert(0);
        if *n >= self.max {
            return None;
        }
        *n += 1;
        Some(Permit { table: self.clone(), key: h })
    }

    fn leave(&self, key: u64) {
        let mut map = match self.counts.lock() {
            Ok(m) => m,
            Err(poisoned) => poisoned.into_inner(),
        };
        if let Some(n) = map.get_mut(&key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                map.remove(&key);
            }
        }
    }

    /// Requests in flight for `key`.
    pub fn count(&self, key: impl Hash) -> u32 {
        let h = self.hasher.hash_one(key);
        self.counts.lock().map_or(0, |m| m.get(&h).copied().unwrap_or(0))
    }
}

/// One request counted by a concurrency limit, until dropped.
#[derive(Debug)]
pub struct Permit {
    table: std::sync::Arc<InFlight>,
    key: u64,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.table.leave(self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The 64-bit test of a full bucket decides as the 128-bit one.
        #[test]
        fn the_quick_refill_decides_as_the_exact_one(
            // Mostly where the 64-bit products fit (up to a million tokens
            // a second and a burst of a million), sometimes past them.
            rate in prop_oneof![4 => 1u64..1_000_000_000, 1 => 1u64..u64::MAX / 2],
            burst in prop_oneof![4 => 1u32..1_000_000, 1 => 1u32..u32::MAX],
            milli in any::<u64>(),
            nanos in prop_oneof![4 => 0u64..1_000_000, 2 => 0u64..1_000_000_000, 1 => 0u64..3_000_000_000],
        ) {
            let b = Buckets::new(rate, burst, 1);
            let at = 1_000_000;
            let bucket = Bucket { milli: milli % (b.capacity + 1), at };
            let now = at + nanos;
            let got = b.refilled(bucket, now, b.rate);
            let room = u128::from(b.capacity - bucket.milli);
            let full = u128::from(nanos) * u128::from(b.rate) >= room * 1_000_000_000;
            if full {
                prop_assert_eq!((got.milli, got.at), (b.capacity, now));
            } else {
                prop_assert!(got.milli < b.capacity, "not full: {} of {}", got.milli, b.capacity);
            }
        }
    }

    #[test]
    fn a_bucket_admits_its_burst_then_its_rate() {
        let b = Buckets::new(10_000, 5, 100); // 10/s, burst 5
        let t0 = Instant::now();
        for _ in 0..5 {
            assert_eq!(b.take("k", t0), Admit::Yes);
        }
        let Admit::No(wait) = b.take("k", t0) else { panic!("the burst is spent") };
        assert_eq!(wait, Duration::from_millis(100));
        assert_eq!(b.take("k", t0 + Duration::from_millis(100)), Admit::Yes);
        assert_eq!(b.take("other", t0), Admit::Yes, "keys have their own buckets");
    }

    #[test]
    fn over_ten_seconds_one_key_gets_its_rate() {
        let b = Buckets::new(100_000, 10, 16); // 100/s
        let t0 = Instant::now();
        let admitted = (0..=10_000u64).filter(|i| b.take("k", t0 + Duration::from_millis(*i)) == Admit::Yes).count();
        // 10 s at 100/s, plus the burst it starts with.
        assert!((1000..=1010).contains(&admitted), "{admitted}");
    }

    #[test]
    fn requests_faster_than_a_thousandth_of_a_token_still_refill_at_the_rate() {
        // 5/s: a thousandth of a token every 200 µs; a request every 50 µs
        // for 5 s. Refills that round down must not lose the time they
        // did not count (they did: only the burst of 5 went through).
        let b = Buckets::new(5_000, 5, 16);
        let t0 = Instant::now();
        let admitted =
            (0..=100_000u64).filter(|i| b.take("k", t0 + Duration::from_micros(i * 50)) == Admit::Yes).count();
        assert!((29..=31).contains(&admitted), "the burst and 5 s at 5/s: {admitted}");
    }

    #[test]
    fn a_share_divides_the_rate() {
        let b = Buckets::new(100_000, 1, 16); // 100/s
        let t0 = Instant::now();
        let admitted =
            (0..=1000u64).filter(|i| b.take_share("k", t0 + Duration::from_millis(*i), 4) == Admit::Yes).count();
        assert!((25..=26).contains(&admitted), "a quarter of 100/s over 1 s: {admitted}");
    }

    #[test]
    fn a_key_flood_keeps_the_table_bounded() {
        let b = Buckets::new(1000, 1, 1024);
        let t0 = Instant::now();
        for i in 0..100_000u32 {
            b.take(i, t0);
        }
        assert!(b.len() <= b.max_keys() && b.max_keys() == 1024, "{}", b.len());
    }

    #[test]
    fn permits_count_until_dropped() {
        let t = std::sync::Arc::new(InFlight::new(2, 10));
        let a = t.enter("k").unwrap();
        let _b = t.enter("k").unwrap();
        assert!(t.enter("k").is_none());
        drop(a);
        assert!(t.enter("k").is_some());
        assert_eq!(t.count("k"), 1);
    }

    proptest! {
        /// Over any span, a key is admitted at most burst + rate × span
        /// times; asked every millisecond, at least once per whole number
        /// of milliseconds a token takes (a full bucket of one token keeps
        /// no fraction beyond it).
        #[test]
        fn the_admitted_rate_is_the_configured_rate(rate in 1u64..2000, burst in 1u32..50, ms in 100u64..5000) {
            let b = Buckets::new(rate * 1000, burst, 16);
            let t0 = Instant::now();
            let admitted = (0..=ms).filter(|i| b.take(0u8, t0 + Duration::from_millis(*i)) == Admit::Yes).count() as u64;
            let most = u64::from(burst) + rate * ms / 1000 + 1;
            let least = ms / (1000u64.div_ceil(rate)) + 1;
            prop_assert!(admitted <= most, "{admitted} > {most}");
            prop_assert!(admitted >= least, "{admitted} < {least}");
        }
    }
}
