//! From raw host metrics to the utilizations (0..=1) that policies read.

use tidegate_balance::LoadReport;

use crate::gmond::GmondHost;
use tidegate_scrape::{cpu_busy, NodeSample};

/// A host's load as measured by one source. `None` means not measured this
/// time (the backend's previous value is then left as it is).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct HostLoad {
    /// CPU utilization, 0..=1.
    pub cpu: Option<f64>,
    /// Memory utilization, 0..=1.
    pub memory: Option<f64>,
    /// Network traffic, bytes/s (turned into a utilization per link
    /// capacity by [`HostLoad::write`]).
    pub net_bytes_per_s: Option<f64>,
}

impl HostLoad {
    /// The load between two `node_exporter` scrapes `dt_s` seconds apart:
    /// CPU is 1 - idle time / total time over all CPUs and modes, memory
    /// 1 - available / total (from `cur` alone), network the byte counters'
    /// growth per second. Counter resets and a change of the devices
    /// counted give `None` for the affected value.
    pub fn from_node(prev: Option<&NodeSample>, cur: &NodeSample, dt_s: f64) -> HostLoad {
        let memory = match (cur.mem_available, cur.mem_total) {
            (Some(avail), Some(total)) if total > 0.0 => Some(utilization(1.0 - avail / total)),
            _ => None,
        };
        let Some(prev) = prev else {
            return HostLoad { memory, ..HostLoad::default() };
        };
        let cpu = cpu_busy(prev, cur);
        let net_bytes_per_s = match (prev.net, cur.net) {
            (Some(a), Some(b)) if a.loopback == b.loopback && b.bytes >= a.bytes && dt_s > 0.0 => {
                Some((b.bytes - a.bytes) / dt_s)
            }
            _ => None,
        };
        HostLoad { cpu, memory, net_bytes_per_s }
    }

    /// The load a gmond reports for a host: CPU 1 - `cpu_idle` / 100, memory
    /// 1 - (`mem_free` + `mem_cached` + `mem_buffers`) / `mem_total`,
    /// network `bytes_in` + `bytes_out` (gmond already reports rates).
    pub fn from_gmond(host: &GmondHost) -> HostLoad {
        let cpu = host.cpu_idle.map(|idle| utilization(1.0 - idle / 100.0));
        let memory = match (host.mem_free, host.mem_total) {
            (Some(free), Some(total)) if total > 0.0 => {
                let reclaimable = free + host.mem_cached.unwrap_or(0.0) + host.mem_buffers.unwrap_or(0.0);
                Some(utilization(1.0 - reclaimable / total))
            }
            _ => None,
        };
        let net_bytes_per_s = match (host.bytes_in, host.bytes_out) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0.0).max(0.0) + b.unwrap_or(0.0).max(0.0)),
        };
        HostLoad { cpu, memory, net_bytes_per_s }
    }

    /// Whether nothing was measured.
    pub fn is_empty(&self) -> bool {
        *self == HostLoad::default()
    }

    /// Network utilization of a link of `link_bytes_per_s`, capped at 1;
    /// `None` without a measurement or a link capacity.
    pub fn network(&self, link_bytes_per_s: u64) -> Option<f64> {
        let bps = self.net_bytes_per_s?;
        (link_bytes_per_s > 0).then(|| utilization(bps / link_bytes_per_s as f64))
    }

    /// Stores the measured values into a backend's load report and marks it
    /// fresh at `now_ms`; values not measured are left alone. Does nothing
    /// when nothing was measured.
    pub fn write(&self, load: &LoadReport, link_bytes_per_s: u64, now_ms: u64) {
        if self.is_empty() {
            return;
        }
        for (slot, v) in
            [(&load.cpu, self.cpu), (&load.memory, self.memory), (&load.network, self.network(link_bytes_per_s))]
        {
            if let Some(v) = v {
                slot.set(v);
            }
        }
        load.touch(now_ms);
    }
}

/// Inputs are finite (the parsers drop the rest), so this only clamps.
fn utilization(x: f64) -> f64 {
    x.clamp(0.0, 1.0)
}

/// Resets CPU, memory and network to unknown (NaN) when the last report is
/// older than `max_age_ms`, so that policies stop trusting stale values.
/// Returns whether it did.
pub fn expire(load: &LoadReport, now_ms: u64, max_age_ms: u64) -> bool {
    let last = load.last_ms.load(std::sync::atomic::Ordering::Relaxed);
    if now_ms.saturating_sub(last) <= max_age_ms {
        return false;
    }
    forget(load);
    true
}

/// Sets CPU, memory and network to unknown (NaN).
pub fn forget(load: &LoadReport) {
    for slot in [&load.cpu, &load.memory, &load.network] {
        slot.set(f64::NAN);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidegate_scrape::NetCounters;

    const SCRAPE_1: &str = include_str!("../../scrape/testdata/node-exporter-1.txt");
    const SCRAPE_2: &str = include_str!("../../scrape/testdata/node-exporter-2.txt");

    fn close(a: Option<f64>, b: f64) -> bool {
        a.is_some_and(|a| (a - b).abs() < 1e-9)
    }

    #[test]
    fn two_recorded_scrapes_give_utilizations() {
        let (a, b) = (NodeSample::parse(SCRAPE_1), NodeSample::parse(SCRAPE_2));
        let first = HostLoad::from_node(None, &a, 0.0);
        assert_eq!((first.cpu, first.net_bytes_per_s), (None, None), "rates need two scrapes");
        assert!(close(first.memory, 1.0 - 2.4846876672e10 / 2.5276502016e10));
        let load = HostLoad::from_node(Some(&a), &b, 2.0);
        // Between the recordings: idle grew by 2 s on each CPU, busy modes
        // by the rest.
        let total = b.cpu_total_s.unwrap() - a.cpu_total_s.unwrap();
        let idle = b.cpu_idle_s - a.cpu_idle_s;
        assert!((idle - 4.0).abs() < 1e-6, "{idle}");
        assert!(close(load.cpu, 1.0 - idle / total), "{load:?}");
        assert!(load.cpu.unwrap() > 0.0 && load.cpu.unwrap() < 1.0);
        let net = b.net.unwrap().bytes - a.net.unwrap().bytes;
        assert!(close(load.net_bytes_per_s, net / 2.0));
    }

    #[test]
    fn counter_resets_and_device_changes_are_unknown() {
        let s = |cpu: f64, idle: f64, net: f64, loopback: bool| NodeSample {
            cpu_total_s: Some(cpu),
            cpu_idle_s: idle,
            net: Some(NetCounters { bytes: net, loopback }),
            ..NodeSample::default()
        };
        let l = HostLoad::from_node(Some(&s(100.0, 50.0, 1000.0, false)), &s(110.0, 52.5, 3000.0, false), 2.0);
        assert_eq!((l.cpu, l.memory, l.net_bytes_per_s), (Some(0.75), None, Some(1000.0)));
        let reset = HostLoad::from_node(Some(&s(100.0, 50.0, 1000.0, false)), &s(5.0, 1.0, 10.0, false), 2.0);
        assert_eq!((reset.cpu, reset.net_bytes_per_s), (None, None));
        let moved = HostLoad::from_node(Some(&s(100.0, 50.0, 1000.0, true)), &s(110.0, 50.0, 5000.0, false), 2.0);
        assert_eq!((moved.cpu, moved.net_bytes_per_s), (Some(1.0), None));
    }

    #[test]
    fn gmond_metrics_become_utilizations() {
        let hosts = crate::gmond::parse(include_bytes!("../testdata/gmond-localhost.xml"));
        let l = HostLoad::from_gmond(&hosts[0]);
        assert!(close(l.cpu, 1.0 - 0.502));
        assert!(close(l.memory, 1.0 - (22264880.0 + 2075184.0 + 20676.0) / 24684084.0));
        assert!(close(l.net_bytes_per_s, 0.07));
        let empty = HostLoad::from_gmond(&GmondHost { mem_free: Some(1.0), ..GmondHost::default() });
        assert!(empty.is_empty());
    }

    #[test]
    fn writing_caps_network_and_expiry_resets_to_unknown() {
        let load = LoadReport::default();
        let l = HostLoad { cpu: Some(0.5), memory: None, net_bytes_per_s: Some(3000.0) };
        l.write(&load, 1000, 10);
        assert_eq!((load.cpu.get(), load.network.get()), (0.5, 1.0));
        assert!(load.memory.get().is_nan(), "not measured, left unknown");
        assert_eq!(l.network(0), None);
        assert_eq!(l.network(6000), Some(0.5));
        assert!(!expire(&load, 40, 30));
        assert_eq!(load.cpu.get(), 0.5);
        assert!(expire(&load, 41, 30));
        assert!(load.cpu.get().is_nan() && load.network.get().is_nan());
        HostLoad::default().write(&load, 1000, 100);
        assert!(expire(&load, 100, 30), "an empty measurement does not refresh");
    }
}
