//! Simulated guest figures: plausible, and a pure function of each
//! domain's spec and of how long it has run on the injected clock, so
//! tests and the benchmark see the same numbers at every run.

use keel_api::Millis;

use super::{SimDomain, SimHypervisor};
use crate::vm_stats::{DiskStats, DomainStats, GuestMemory, NicStats};

const MIB: u64 = 1 << 20;
/// Each vCPU is this busy.
const CPU_SHARE: f64 = 0.05;
/// What a guest's process holds beyond its memory: QEMU itself.
const PROCESS_OVERHEAD: u64 = 48 * MIB;

impl SimHypervisor {
    /// The figures of every domain whose process runs (exited ones have
    /// none; hung ones answer nothing, as a hung QMP would not).
    pub(super) fn stats_now(&self) -> Vec<DomainStats> {
        let now = self.clock.now_ms();
        let s = self.lock();
        s.domains
            .iter()
            .filter(|(instance, d)| !d.state.is_exited() && !s.hung.contains(*instance))
            .map(|(_, d)| figures(d, now))
            .collect()
    }
}

fn figures(d: &SimDomain, now: Millis) -> DomainStats {
    let ran_ms = now.saturating_sub(d.started_at);
    let cpus = f64::from(d.spec.cpus.max(1));
    // The guest touches half its memory.
    let rss = d.spec.memory_mib.saturating_mul(MIB) / 2 + PROCESS_OVERHEAD;
    let disks = d
        .spec
        .disks
        .iter()
        .map(|disk| {
            let read_bytes = ran_ms.saturating_mul(64 * 1024) / 1000;
            let write_bytes = ran_ms.saturating_mul(16 * 1024) / 1000;
            DiskStats {
                disk: disk.name.clone(),
                read_bytes,
                write_bytes,
                read_ops: read_bytes / 4096,
                write_ops: write_bytes / 4096,
                // 200 µs a read, 1 ms a write.
                read_time_ns: read_bytes / 4096 * 200_000,
                write_time_ns: write_bytes / 4096 * 1_000_000,
            }
        })
        .collect();
    let receive_bytes = ran_ms.saturating_mul(2048) / 1000;
    let transmit_bytes = ran_ms.saturating_mul(1024) / 1000;
    DomainStats {
        instance: d.spec.instance.clone(),
        vm: d.spec.vm.clone(),
        cpu_seconds: Some(ran_ms as f64 / 1000.0 * CPU_SHARE * cpus),
        rss_bytes: Some(rss),
        disks,
        nics: vec![NicStats {
            nic: "net0".into(),
            receive_bytes,
            transmit_bytes,
            receive_packets: receive_bytes / 512,
            transmit_packets: transmit_bytes / 512,
        }],
        guest_memory: d.spec.balloon.then(|| guest_memory(d.spec.memory_mib, now)),
    }
}

/// What a guest with a balloon driver reports: its kernel keeps a little
/// of the memory for itself, uses a quarter, and could free half of what
/// it uses (caches).
fn guest_memory(memory_mib: u64, now: Millis) -> GuestMemory {
    let total = memory_mib.saturating_mul(MIB) / 100 * 97;
    let free = total / 4 * 3;
    GuestMemory {
        total_bytes: Some(total),
        free_bytes: Some(free),
        available_bytes: Some(free + (total - free) / 2),
        // Polled every 10 s, as the QEMU driver asks.
        reported_at: Some(now / 10_000 * 10),
    }
}
