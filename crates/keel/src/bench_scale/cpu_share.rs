//! Where a run's CPU goes on its way to all Running: each kind of
//! process's CPU time (all its threads, from `/proc/PID/stat`) from just
//! before the first create until the store holds every VM Running, per
//! VM, with this bench's own process (its API clients and its watch) as
//! `bench`. Every process of a run shares the machine, so the sum bounds
//! the rate: a machine of N CPUs runs at most N CPU-seconds a second, and
//! 10,000 VMs in 15 s on two CPUs leave 3 ms of CPU per VM for all of
//! them together.

use std::collections::BTreeMap;

use super::scrape::cpu_seconds;

/// The kind this bench's own process is counted as.
pub const BENCH: &str = "bench";

/// CPU seconds so far per kind of process (a kind's processes summed).
#[derive(Debug, Clone, Default)]
pub struct CpuMark(BTreeMap<String, f64>);

impl CpuMark {
    /// Of `processes` (each by its kind and pid) and this one.
    pub fn now<'a>(processes: impl IntoIterator<Item = (&'a str, u32)>) -> anyhow::Result<CpuMark> {
        let mut seconds = BTreeMap::new();
        for (kind, pid) in processes {
            *seconds.entry(kind.to_string()).or_insert(0.0) += cpu_seconds(pid)?;
        }
        seconds.insert(BENCH.to_string(), cpu_seconds(std::process::id())?);
        Ok(CpuMark(seconds))
    }

    /// Milliseconds of CPU per VM of each kind since `earlier`.
    pub fn ms_per_vm_since(&self, earlier: &CpuMark, vms: usize) -> BTreeMap<String, f64> {
        self.0
            .iter()
            .map(|(kind, now)| {
                let before = earlier.0.get(kind).copied().unwrap_or(0.0);
                let ms = 1000.0 * (now - before).max(0.0) / vms.max(1) as f64;
                (kind.clone(), ms)
            })
            .collect()
    }
}

/// `agent 1.20, bench 0.17, control plane 0.75, etcd 1.37 ms per VM (3.49 in all)`.
pub fn describe(ms_per_vm: &BTreeMap<String, f64>) -> String {
    let each = ms_per_vm
        .iter()
        .map(|(kind, ms)| format!("{kind} {ms:.2}"))
        .collect::<Vec<_>>()
        .join(", ");
    let all: f64 = ms_per_vm.values().sum();
    format!("{each} ms per VM ({all:.2} in all)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_is_its_own_share_and_the_sum_is_named() {
        let before = CpuMark(BTreeMap::from([
            ("agent".to_string(), 10.0),
            ("etcd".to_string(), 4.0),
        ]));
        // A kind first seen later counts from zero.
        let after = CpuMark(BTreeMap::from([
            ("agent".to_string(), 22.0),
            ("etcd".to_string(), 17.7),
            (BENCH.to_string(), 1.7),
        ]));
        let shares = after.ms_per_vm_since(&before, 10_000);
        assert_eq!(shares.len(), 3);
        assert!((shares["agent"] - 1.2).abs() < 1e-9, "{shares:?}");
        assert!((shares["etcd"] - 1.37).abs() < 1e-9, "{shares:?}");
        assert!((shares[BENCH] - 0.17).abs() < 1e-9, "{shares:?}");
        assert_eq!(
            describe(&shares),
            "agent 1.20, bench 0.17, etcd 1.37 ms per VM (2.74 in all)"
        );
    }
}
