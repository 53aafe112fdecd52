//! Rate-limited logging of a target's failures: a source that fails every
//! interval must not flood the log.

use std::time::{Duration, Instant};

/// At most one warning per target this often.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// Failure log state of one target.
#[derive(Debug, Default)]
pub(crate) struct Throttle {
    failing: bool,
    last_warn: Option<Instant>,
    suppressed: u64,
}

impl Throttle {
    /// Records a failed poll; warns on the first one and then at most once
    /// per [`WARN_EVERY`], counting the ones in between.
    pub fn failure(&mut self, source: &'static str, target: &str, error: &str) {
        self.failing = true;
        let now = Instant::now();
        if self.last_warn.is_some_and(|t| now.duration_since(t) < WARN_EVERY) {
            self.suppressed += 1;
            return;
        }
        tracing::warn!(
            source,
            target,
            error,
            failures_since_last_warning = self.suppressed,
            "load source failing; last values are kept until they expire"
        );
        self.last_warn = Some(now);
        self.suppressed = 0;
    }

    /// Records a successful poll (logs the recovery at debug level).
    pub fn success(&mut self, source: &'static str, target: &str) {
        if std::mem::take(&mut self.failing) {
            tracing::debug!(source, target, "load source recovered");
        }
    }

    #[cfg(test)]
    fn suppressed(&self) -> u64 {
        self.suppressed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_failures_are_counted_not_logged() {
        let mut t = Throttle::default();
        t.failure("node_exporter", "h:1", "refused");
        t.failure("node_exporter", "h:1", "refused");
        t.success("node_exporter", "h:1");
        t.failure("node_exporter", "h:1", "refused");
        assert_eq!(t.suppressed(), 2, "a recovery does not re-arm the warning");
    }
}
