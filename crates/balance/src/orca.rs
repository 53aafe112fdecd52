//! Parsing ORCA `endpoint-load-metrics` response headers (TEXT and JSON).

use crate::stats::LoadReport;

/// The name of the ORCA response header.
pub const ORCA_HEADER: &str = "endpoint-load-metrics";

/// The load a backend reported in one response.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OrcaReport {
    /// `cpu_utilization` (0..1, may exceed 1 on some servers).
    pub cpu: Option<f64>,
    /// `mem_utilization`.
    pub memory: Option<f64>,
    /// `rps_fractional` (or `rps`).
    pub qps: Option<f64>,
    /// `eps`: errors per second.
    pub eps: Option<f64>,
}

/// Parses `TEXT k=v, k=v` or `JSON {...}`; `None` for other forms (the
/// binary form is not supported) or when nothing useful is in it.
pub fn parse(value: &str) -> Option<OrcaReport> {
    let value = value.trim();
    let mut r = OrcaReport::default();
    let mut set = |key: &str, v: f64| {
        if !v.is_finite() || v < 0.0 {
            return;
        }
        match key {
            "cpu_utilization" => r.cpu = Some(v),
            "mem_utilization" => r.memory = Some(v),
            "rps_fractional" | "rps" => r.qps = Some(v),
            "eps" => r.eps = Some(v),
            _ => {}
        }
    };
    if let Some(text) = value.strip_prefix("TEXT ") {
        for pair in text.split(',') {
            if let Some((k, v)) = pair.trim().split_once('=') {
                if let Ok(v) = v.trim().parse::<f64>() {
                    set(k.trim(), v);
                }
            }
        }
    } else if let Some(json) = value.strip_prefix("JSON ") {
        let map: serde_json::Map<String, serde_json::Value> = serde_json::from_str(json).ok()?;
        for (k, v) in &map {
            if let Some(v) = v.as_f64() {
                set(k, v);
            }
        }
    } else {
        return None;
    }
    (r != OrcaReport::default()).then_some(r)
}

impl OrcaReport {
    /// Stores the report into a backend's load state.
    pub fn apply(&self, load: &LoadReport, now_ms: u64) {
        for (slot, v) in
            [(&load.cpu, self.cpu), (&load.memory, self.memory), (&load.qps, self.qps), (&load.eps, self.eps)]
        {
            if let Some(v) = v {
                slot.set(v);
            }
        }
        load.touch(now_ms);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_and_json_forms() {
        let r = parse("TEXT cpu_utilization=0.3, rps_fractional=10.5, eps=0.2, named_metrics.x=1").unwrap();
        assert_eq!((r.cpu, r.qps, r.eps, r.memory), (Some(0.3), Some(10.5), Some(0.2), None));
        let r = parse(r#"JSON {"cpu_utilization": 0.7, "mem_utilization": 0.1, "rps_fractional": 3}"#).unwrap();
        assert_eq!((r.cpu, r.memory, r.qps), (Some(0.7), Some(0.1), Some(3.0)));
        for bad in ["BIN abc", "TEXT nothing", "JSON {", "TEXT cpu_utilization=-1", ""] {
            assert_eq!(parse(bad), None, "{bad}");
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(1000))]

        /// Any header value: no panic, and whatever is read is a finite,
        /// non-negative number.
        #[test]
        fn any_value_parses_or_is_refused(v in "(TEXT |JSON )?\\PC{0,120}|\\{[a-z_:\",.0-9e+-]{0,80}\\}") {
            if let Some(r) = parse(&v) {
                for x in [r.cpu, r.memory, r.qps, r.eps].into_iter().flatten() {
                    proptest::prop_assert!(x.is_finite() && x >= 0.0, "{x} from {v:?}");
                }
            }
        }
    }
}
