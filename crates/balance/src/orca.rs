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
    /// `named_metrics.rif`: requests in flight at the backend (Prequal).
    pub rif: Option<f64>,
    /// `named_metrics.latency_ms`: the backend's latency estimate (Prequal).
    pub latency_ms: Option<f64>,
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
            "named_metrics.rif" => r.rif = Some(v),
            "named_metrics.latency_ms" => r.latency_ms = Some(v),
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
            if let (true, Some(named)) = (k == "named_metrics", v.as_object()) {
                for (name, v) in named {
                    if let Some(v) = v.as_f64() {
                        set(&format!("named_metrics.{name}"), v);
                    }
                }
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

impl OrcaReport {
    /// The report as a Prequal probe answer: requests in flight, and the
    /// latency in ms when the backend gave one.
    pub fn probe(&self) -> Option<(f64, Option<f64>)> {
        self.rif.map(|rif| (rif, self.latency_ms))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_and_json_forms() {
        let r = parse("TEXT cpu_utilization=0.3, rps_fractional=10.5, eps=0.2, named_metrics.x=1").unwrap();
        assert_eq!(r.probe(), None);
        assert_eq!((r.cpu, r.qps, r.eps, r.memory), (Some(0.3), Some(10.5), Some(0.2), None));
        let r = parse(r#"JSON {"cpu_utilization": 0.7, "mem_utilization": 0.1, "rps_fractional": 3}"#).unwrap();
        assert_eq!((r.cpu, r.memory, r.qps), (Some(0.7), Some(0.1), Some(3.0)));
        let r = parse("TEXT named_metrics.rif=4, named_metrics.latency_ms=12.5").unwrap();
        assert_eq!(r.probe(), Some((4.0, Some(12.5))));
        let r = parse(r#"JSON {"named_metrics": {"rif": 2}}"#).unwrap();
        assert_eq!(r.probe(), Some((2.0, None)));
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
                for x in [r.cpu, r.memory, r.qps, r.eps, r.rif, r.latency_ms].into_iter().flatten() {
                    proptest::prop_assert!(x.is_finite() && x >= 0.0, "{x} from {v:?}");
                }
            }
        }
    }
}
