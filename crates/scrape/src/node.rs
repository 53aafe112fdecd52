//! What a `node_exporter` page says about its host: CPU time, memory and
//! network byte counters.

use crate::text::samples;

/// Network byte counters of a host, summed over the devices that count.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NetCounters {
    /// Received plus transmitted bytes since boot.
    pub bytes: f64,
    /// Whether the sum is over the loopback device `lo` (used only when no
    /// other device shows any traffic, as on a loopback-only test machine).
    pub loopback: bool,
}

/// What one `node_exporter` scrape says about its host.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct NodeSample {
    /// `node_cpu_seconds_total` summed over all CPUs and modes.
    pub cpu_total_s: Option<f64>,
    /// Of which in mode `idle`.
    pub cpu_idle_s: f64,
    /// `node_memory_MemAvailable_bytes`.
    pub mem_available: Option<f64>,
    /// `node_memory_MemTotal_bytes`.
    pub mem_total: Option<f64>,
    /// `node_network_{receive,transmit}_bytes_total` over the non-`lo`
    /// devices, or over `lo` when no other device has any traffic.
    pub net: Option<NetCounters>,
}

impl NodeSample {
    /// Reads the samples out of an exposition.
    pub fn parse(text: &str) -> NodeSample {
        let mut s = NodeSample::default();
        let (mut other, mut other_seen, mut lo, mut lo_seen) = (0.0, false, 0.0, false);
        for sample in samples(text) {
            if !sample.value.is_finite() {
                continue;
            }
            match sample.name {
                "node_cpu_seconds_total" => {
                    *s.cpu_total_s.get_or_insert(0.0) += sample.value;
                    if sample.label("mode").as_deref() == Some("idle") {
                        s.cpu_idle_s += sample.value;
                    }
                }
                "node_memory_MemAvailable_bytes" => s.mem_available = Some(sample.value),
                "node_memory_MemTotal_bytes" => s.mem_total = Some(sample.value),
                "node_network_receive_bytes_total" | "node_network_transmit_bytes_total" => {
                    if sample.label("device").as_deref() == Some("lo") {
                        (lo, lo_seen) = (lo + sample.value, true);
                    } else {
                        (other, other_seen) = (other + sample.value, true);
                    }
                }
                _ => {}
            }
        }
        s.net = if other > 0.0 || (other_seen && !lo_seen) {
            Some(NetCounters { bytes: other, loopback: false })
        } else if lo_seen {
            Some(NetCounters { bytes: lo, loopback: true })
        } else {
            None
        };
        s
    }

    /// Whether the scrape had anything this crate uses.
    pub fn is_empty(&self) -> bool {
        self.cpu_total_s.is_none() && self.mem_total.is_none() && self.net.is_none()
    }
}

/// The share of CPU time that was not idle between two scrapes of one host
/// (0..=1): `1 - Δidle / Δtotal` over all CPUs and modes. `None` without
/// CPU samples in either, without progress, or across a counter reset.
pub fn cpu_busy(prev: &NodeSample, cur: &NodeSample) -> Option<f64> {
    let total = cur.cpu_total_s? - prev.cpu_total_s?;
    let idle = cur.cpu_idle_s - prev.cpu_idle_s;
    (total > 0.0 && idle >= 0.0).then(|| (1.0 - idle / total).clamp(0.0, 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::samples;

    const RECORDED: &str = include_str!("../testdata/node-exporter-1.txt");

    #[test]
    fn a_recorded_scrape_gives_cpu_memory_and_network() {
        let s = NodeSample::parse(RECORDED);
        assert_eq!(samples(RECORDED).count(), RECORDED.lines().filter(|l| !l.starts_with('#')).count());
        // Two CPUs, eight modes each, as recorded.
        let total =
            1357.26 + 3.06 + 141.47 + 0.13 + 311.43 + 733.61 + 1224.98 + 24.26 + 139.42 + 0.16 + 338.91 + 822.84;
        assert!((s.cpu_total_s.unwrap() - total).abs() < 1e-6, "{s:?}");
        assert!((s.cpu_idle_s - (1357.26 + 1224.98)).abs() < 1e-6);
        assert_eq!(s.mem_available, Some(2.4846876672e10));
        assert_eq!(s.mem_total, Some(2.5276502016e10));
        // node_exporter excludes lo by default; eth0 has the traffic.
        assert_eq!(s.net, Some(NetCounters { bytes: 1.22198233e8 + 345466.0, loopback: false }));
        assert!(!s.is_empty());
        assert!(NodeSample::parse("# nothing\nother_metric 1\n").is_empty());
    }

    #[test]
    fn loopback_counts_only_when_no_other_device_has_traffic() {
        let lines = |devs: &[(&str, f64)]| {
            devs.iter()
                .map(|(d, v)| {
                    format!("node_network_receive_bytes_total{{device=\"{d}\"}} {v}\nnode_network_transmit_bytes_total{{device=\"{d}\"}} {v}\n")
                })
                .collect::<String>()
        };
        let net = |devs: &[(&str, f64)]| NodeSample::parse(&lines(devs)).net;
        assert_eq!(net(&[("lo", 5.0)]), Some(NetCounters { bytes: 10.0, loopback: true }));
        assert_eq!(net(&[("lo", 5.0), ("ifb0", 0.0)]), Some(NetCounters { bytes: 10.0, loopback: true }));
        assert_eq!(net(&[("lo", 5.0), ("eth0", 1.0)]), Some(NetCounters { bytes: 2.0, loopback: false }));
        assert_eq!(net(&[("eth0", 0.0)]), Some(NetCounters { bytes: 0.0, loopback: false }));
        assert_eq!(net(&[]), None);
    }

    #[test]
    fn cpu_busy_is_the_non_idle_share_and_unknown_across_resets() {
        let s =
            |total: f64, idle: f64| NodeSample { cpu_total_s: Some(total), cpu_idle_s: idle, ..NodeSample::default() };
        let u = cpu_busy(&s(240.0, 200.0), &s(260.0, 215.0)).expect("progress");
        assert!((u - 0.25).abs() < 1e-9, "{u}");
        assert_eq!(cpu_busy(&s(260.0, 215.0), &s(240.0, 200.0)), None, "a reset is unknown, not negative");
        assert_eq!(cpu_busy(&s(240.0, 200.0), &s(240.0, 200.0)), None, "no progress");
        assert_eq!(cpu_busy(&NodeSample::default(), &s(1.0, 0.0)), None);
        // A label value holding `}` does not hide the mode (the old
        // distributor parser cut the label set at the first `}`).
        let page = "node_cpu_seconds_total{cpu=\"0\",note=\"}\",mode=\"idle\"} 10\n\
                    node_cpu_seconds_total{cpu=\"0\",mode=\"user\"} 30\n";
        let n = NodeSample::parse(page);
        assert_eq!((n.cpu_total_s, n.cpu_idle_s), (Some(40.0), 10.0));
    }
}
