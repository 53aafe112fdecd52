//! The standard `process_*` metrics, read from `/proc` at scrape time
//! (Linux; elsewhere they are left out).

use std::fmt::Result;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;

use crate::family::{counter, gauge};

/// Clock ticks per second in `/proc/self/stat` (`USER_HZ`, fixed at 100 by
/// the kernel's user-space interface on every architecture Linux exports
/// it for).
const USER_HZ: f64 = 100.0;

/// CPU time, memory, threads, open files and start time of this process.
#[derive(Debug, Default)]
pub struct ProcessCollector;

/// What one scrape read.
#[derive(Debug, Default, PartialEq)]
struct Reading {
    cpu_s: f64,
    start_s: f64,
    threads: u64,
    resident_bytes: u64,
    virtual_bytes: u64,
    open_fds: u64,
    max_fds: Option<u64>,
}

/// Fields of `/proc/self/stat` after the command name (which may hold
/// spaces and parentheses, so it is cut at the last `)`), numbered as in
/// proc(5) from field 3 on.
fn stat_fields(stat: &str) -> Vec<&str> {
    stat.rsplit_once(')').map(|(_, rest)| rest.split_whitespace().collect()).unwrap_or_default()
}

fn kib(status: &str, key: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with(key))?;
    let n: u64 = line[key.len()..].split_whitespace().next()?.parse().ok()?;
    Some(n * 1024)
}

fn read(stat: &str, status: &str, boot_s: f64, open_fds: u64, limits: &str) -> Reading {
    let f = stat_fields(stat);
    // proc(5): utime is field 14, stime 15, num_threads 20, starttime 22.
    let field = |n: usize| f.get(n - 3).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    let max_fds = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l["Max open files".len()..].split_whitespace().next()?.parse().ok());
    Reading {
        cpu_s: (field(14) + field(15)) / USER_HZ,
        start_s: boot_s + field(22) / USER_HZ,
        threads: field(20) as u64,
        resident_bytes: kib(status, "VmRSS:").unwrap_or(0),
        virtual_bytes: kib(status, "VmSize:").unwrap_or(0),
        open_fds,
        max_fds,
    }
}

fn read_proc() -> Option<Reading> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let boot_s = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime ")?.trim().parse::<f64>().ok())?;
    let fds = std::fs::read_dir("/proc/self/fd").map(|d| d.count() as u64).unwrap_or(0);
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
    Some(read(&stat, &status, boot_s, fds, &limits))
}

impl Collector for ProcessCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> Result {
        let Some(r) = read_proc() else { return Ok(()) };
        counter(&mut enc, "process_cpu_seconds", "User and system CPU time spent, in seconds.", [([], r.cpu_s)])?;
        let gauges: [(&str, &str, f64); 5] = [
            ("process_resident_memory_bytes", "Resident memory size in bytes.", r.resident_bytes as f64),
            ("process_virtual_memory_bytes", "Virtual memory size in bytes.", r.virtual_bytes as f64),
            ("process_open_fds", "Open file descriptors.", r.open_fds as f64),
            ("process_threads", "OS threads.", r.threads as f64),
            ("process_start_time_seconds", "Start time of the process since the Unix epoch, in seconds.", r.start_s),
        ];
        for (name, help, v) in gauges {
            gauge(&mut enc, name, help, [([], v)])?;
        }
        if let Some(max) = r.max_fds {
            gauge(&mut enc, "process_max_fds", "Maximum number of open file descriptors.", [([], max)])?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_proc_files_including_a_command_name_with_spaces() {
        let mut stat = String::from("4242 (tide gate) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 7 0 1000 0 0");
        stat.push_str(" 0 0 0");
        let status = "Name:\ttidegate\nVmSize:\t  100 kB\nVmRSS:\t    20 kB\n";
        let limits = "Limit                     Soft Limit           Hard Limit           Units\n\
                      Max open files            1024                 4096                 files\n";
        let r = read(&stat, status, 1_700_000_000.0, 12, limits);
        assert_eq!(
            r,
            Reading {
                cpu_s: 3.0,
                start_s: 1_700_000_010.0,
                threads: 7,
                resident_bytes: 20 * 1024,
                virtual_bytes: 100 * 1024,
                open_fds: 12,
                max_fds: Some(1024),
            }
        );
    }

    #[test]
    fn this_process_is_read() {
        let r = read_proc().expect("Linux /proc");
        assert!(r.resident_bytes > 0 && r.threads >= 1 && r.open_fds > 0 && r.start_s > 1e9, "{r:?}");
    }
}
