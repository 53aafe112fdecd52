//! The fuzz campaign's runner: proptest, as ordinary `cargo test`.
//!
//! - `TIDEGATE_FUZZ_CASES=N`: cases per round (default: the target's own,
//!   small enough for CI);
//! - `TIDEGATE_FUZZ_SECS=S`: keep running rounds of fresh random cases
//!   until `S` seconds have passed (the long runs of docs/fuzzing.md).
//!
//! A failing input is shrunk and its seed saved beside the test file
//! (`*.regressions`, committed): every later run replays it first.

#![allow(dead_code)]

use std::fmt::Debug;
use std::time::{Duration, Instant};

use proptest::strategy::Strategy;
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError, TestRunner};

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// Runs `test` on inputs from `strategy` (see the module docs for the
/// environment). `source` is the test file (`file!()`), whose
/// `.regressions` file holds the seeds of past failures.
pub fn campaign<S>(
    name: &str,
    source: &'static str,
    default_cases: u32,
    strategy: S,
    test: impl Fn(S::Value) -> Result<(), TestCaseError>,
) where
    S: Strategy,
    S::Value: Debug,
{
    let cases = env_u64("TIDEGATE_FUZZ_CASES").map_or(default_cases, |n| n.clamp(1, u64::from(u32::MAX)) as u32);
    let deadline = env_u64("TIDEGATE_FUZZ_SECS").map(|s| Instant::now() + Duration::from_secs(s));
    let started = Instant::now();
    let mut total = 0u64;
    loop {
        let config = Config {
            cases,
            source_file: Some(source),
            failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("regressions"))),
            max_shrink_iters: 100_000,
            ..Config::default()
        };
        let mut runner = TestRunner::new(config);
        if let Err(e) = runner.run(&strategy, &test) {
            panic!("{name}: {e}");
        }
        total += u64::from(cases);
        if deadline.is_none_or(|d| Instant::now() >= d) {
            break;
        }
    }
    eprintln!("fuzz {name}: {total} cases in {:.1}s", started.elapsed().as_secs_f64());
}
