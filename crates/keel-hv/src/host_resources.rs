//! The CPUs and memory of the host this process runs on, as a node's
//! capacity is worked out from (`keel_api::capacity`): the CPUs this
//! process may run on (affinity and cgroup quotas count, as
//! `available_parallelism` reads them) and `MemTotal` of `/proc/meminfo`.

use keel_api::HostResources;

/// This host's, or `None` where it cannot be read.
pub fn this_host() -> Option<HostResources> {
    let cpus = std::thread::available_parallelism().ok()?.get();
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    Some(HostResources {
        cpus: u32::try_from(cpus).unwrap_or(u32::MAX),
        memory_mib: mem_total_mib(&meminfo)?,
    })
}

/// `MemTotal` of a `/proc/meminfo` text, in MiB.
fn mem_total_mib(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let mut words = line.split_whitespace().skip(1);
    let kib: u64 = words.next()?.parse().ok()?;
    (words.next() == Some("kB")).then_some(kib / 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_total_is_read_in_mib() {
        let text = "MemTotal:       24568124 kB\nMemFree:         1000 kB\n";
        assert_eq!(mem_total_mib(text), Some(23992));
        assert_eq!(mem_total_mib("MemFree: 1 kB\n"), None);
        assert_eq!(mem_total_mib("MemTotal: 12 MB\n"), None);
        let here = this_host().expect("Linux has /proc/meminfo");
        assert!(here.cpus >= 1 && here.memory_mib > 0, "{here:?}");
    }
}
