//! The figures of the running guests (`Hypervisor::stats_all`): CPU time
//! and resident memory of each QEMU process from `/proc`, disk counters
//! from QMP `query-blockstats` over the monitor's existing connection (no
//! new socket per read), and, for a bridged NIC, the tap's counters from
//! `/sys/class/net`. A user-mode NIC (slirp) has no counters QEMU reports,
//! so it has none here.
//!
//! Each domain is read on its own, several at once, each bounded: a
//! guest whose monitor hangs reports its `/proc` figures only.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{self, StreamExt};
use serde::Deserialize;

use super::monitor::{Domain, Phase};
use super::query_block::BlockInfo;
use super::QemuDriver;
use crate::vm_stats::{DiskStats, DomainStats, GuestMemory, NicStats};

/// How long one domain's monitor may take to answer both queries.
const QMP_BOUND: Duration = Duration::from_secs(1);
/// How many domains are read at once.
const READS_AT_ONCE: usize = 32;

impl QemuDriver {
    pub(super) async fn stats_of_live(&self) -> Vec<DomainStats> {
        let live: Vec<(Arc<Domain>, u32)> = self
            .lock()
            .values()
            .filter_map(|d| match d.phase() {
                Phase::Live { pid } => Some((d.clone(), pid)),
                Phase::Launching { .. } | Phase::Exited(_) => None,
            })
            .collect();
        stream::iter(live)
            .map(|(domain, pid)| self.domain_stats(domain, pid))
            .buffer_unordered(READS_AT_ONCE)
            .collect()
            .await
    }

    async fn domain_stats(&self, domain: Arc<Domain>, pid: u32) -> DomainStats {
        let disk_dir = self.inner.layout.vm_disks(&domain.vm);
        let (disks, guest_memory) = tokio::join!(
            tokio::time::timeout(QMP_BOUND, disk_stats(&domain, &disk_dir)),
            tokio::time::timeout(QMP_BOUND, guest_memory(&domain)),
        );
        let disks = match disks {
            Ok(Ok(disks)) => disks,
            Ok(Err(reason)) => {
                tracing::debug!(instance = %domain.instance, %reason, "no disk figures");
                Vec::new()
            }
            Err(_) => {
                tracing::debug!(instance = %domain.instance, "no disk figures: QMP is slow");
                Vec::new()
            }
        };
        // Only instances launched with a balloon device have the figures;
        // asking the others costs one answer naming the missing device.
        let guest_memory = match guest_memory {
            Ok(Ok(memory)) => memory,
            Ok(Err(reason)) => {
                tracing::trace!(instance = %domain.instance, %reason, "no guest memory figures");
                None
            }
            Err(_) => None,
        };
        let (cpu_seconds, rss_bytes) = process_figures(pid);
        DomainStats {
            instance: domain.instance.clone(),
            vm: domain.vm.clone(),
            cpu_seconds,
            rss_bytes,
            disks,
            nics: tap_stats(&super::network::tap_name(&domain.instance))
                .into_iter()
                .collect(),
            guest_memory,
        }
    }
}

async fn guest_memory(domain: &Domain) -> Result<Option<GuestMemory>, String> {
    let qmp = domain.qmp().await?;
    super::balloon::guest_memory(&qmp, QMP_BOUND).await
}

/// One entry of `query-blockstats`, of the fields read here.
#[derive(Debug, Deserialize)]
struct BlockStatsEntry {
    #[serde(default)]
    device: String,
    #[serde(default, rename = "node-name")]
    node_name: String,
    stats: BlockCounters,
}

#[derive(Debug, Deserialize)]
struct BlockCounters {
    rd_bytes: u64,
    wr_bytes: u64,
    rd_operations: u64,
    wr_operations: u64,
    #[serde(default)]
    rd_total_time_ns: u64,
    #[serde(default)]
    wr_total_time_ns: u64,
}

impl BlockStatsEntry {
    /// The name `query-block` gives the same disk ([`BlockInfo::name`]).
    fn name(&self) -> &str {
        if self.device.is_empty() {
            &self.node_name
        } else {
            &self.device
        }
    }
}

/// The counters of the VM's own disks (those in its disk dir, named as in
/// its spec); the cloud-init seed and firmware files are left out.
async fn disk_stats(domain: &Domain, disk_dir: &Path) -> Result<Vec<DiskStats>, String> {
    let qmp = domain.qmp().await?;
    let blocks: Vec<BlockInfo> = query(&qmp, "query-block").await?;
    let counters: Vec<BlockStatsEntry> = query(&qmp, "query-blockstats").await?;
    Ok(disks_of(&blocks, &counters, disk_dir))
}

async fn query<T: serde::de::DeserializeOwned>(
    qmp: &super::QmpClient,
    command: &str,
) -> Result<T, String> {
    let value = qmp
        .execute_within(command, None, QMP_BOUND)
        .await
        .map_err(|e| e.to_string())?;
    serde_json::from_value(value).map_err(|e| format!("{command} result: {e}"))
}

fn disks_of(blocks: &[BlockInfo], counters: &[BlockStatsEntry], disk_dir: &Path) -> Vec<DiskStats> {
    let mut disks: Vec<DiskStats> = blocks
        .iter()
        .filter_map(|block| {
            let file = Path::new(&block.inserted.as_ref()?.file);
            if file.parent() != Some(disk_dir) || file.extension()? != "qcow2" {
                return None;
            }
            let disk = file.file_stem()?.to_str()?.to_string();
            let name = block.name()?;
            let c = &counters.iter().find(|c| c.name() == name)?.stats;
            Some(DiskStats {
                disk,
                read_bytes: c.rd_bytes,
                write_bytes: c.wr_bytes,
                read_ops: c.rd_operations,
                write_ops: c.wr_operations,
                read_time_ns: c.rd_total_time_ns,
                write_time_ns: c.wr_total_time_ns,
            })
        })
        .collect();
    disks.sort_by(|a, b| a.disk.cmp(&b.disk));
    disks
}

/// CPU seconds (user + system, all threads) and resident bytes of `pid`.
fn process_figures(pid: u32) -> (Option<f64>, Option<u64>) {
    let cpu = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| cpu_ticks(&stat))
        .map(|ticks| ticks as f64 / clock_ticks_per_second());
    let rss = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| rss_bytes(&status));
    (cpu, rss)
}

/// `utime + stime` of a `/proc/PID/stat` line, in clock ticks.
fn cpu_ticks(stat: &str) -> Option<u64> {
    // The command name is in parentheses and may hold spaces; the fields
    // after the last ')' start at the state (field 3).
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// `VmRSS` of a `/proc/PID/status`, in bytes.
fn rss_bytes(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

fn clock_ticks_per_second() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks > 0 {
        ticks as f64
    } else {
        100.0
    }
}

/// A bridged instance's tap counters, turned to the guest's side (what the
/// tap transmits, the guest receives); `None` without a tap.
fn tap_stats(tap: &str) -> Option<NicStats> {
    let dir = Path::new("/sys/class/net").join(tap).join("statistics");
    let read = |name: &str| -> Option<u64> {
        std::fs::read_to_string(dir.join(name))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    Some(NicStats {
        nic: "net0".into(),
        receive_bytes: read("tx_bytes")?,
        transmit_bytes: read("rx_bytes")?,
        receive_packets: read("tx_packets")?,
        transmit_packets: read("rx_packets")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn cpu_and_memory_are_read_from_proc_lines() {
        // A command name with a space and a parenthesis.
        let stat = "4242 (qemu (x) 86) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 5 0";
        assert_eq!(cpu_ticks(stat), Some(300));
        let status = "Name:\tqemu\nVmPeak:\t 9 kB\nVmRSS:\t  123456 kB\nThreads:\t5\n";
        assert_eq!(rss_bytes(status), Some(123456 * 1024));
        assert_eq!(rss_bytes("Name:\tx\n"), None);
    }

    #[test]
    fn only_the_vms_own_disks_are_counted_by_their_spec_names() {
        let blocks: Vec<BlockInfo> = serde_json::from_value(json!([
            {"device": "disk0", "inserted": {"file": "/d/web/root.qcow2", "node-name": "#b1"}},
            {"device": "disk1", "inserted": {"file": "/run/i/web-1/seed.iso", "node-name": "#b2"}},
            {"device": "", "inserted": {"file": "/d/web/logs.qcow2", "node-name": "plugged-logs"}},
            {"device": "cd0"},
        ]))
        .unwrap();
        let counters: Vec<BlockStatsEntry> = serde_json::from_value(json!([
            {"device": "disk0", "stats": {"rd_bytes": 10, "wr_bytes": 20, "rd_operations": 1,
                "wr_operations": 2, "rd_total_time_ns": 5, "wr_total_time_ns": 7}},
            {"device": "disk1", "stats": {"rd_bytes": 99, "wr_bytes": 0, "rd_operations": 9,
                "wr_operations": 0}},
            {"device": "", "node-name": "plugged-logs", "stats": {"rd_bytes": 1, "wr_bytes": 4096,
                "rd_operations": 1, "wr_operations": 1}},
        ]))
        .unwrap();
        let disks = disks_of(&blocks, &counters, Path::new("/d/web"));
        let names: Vec<&str> = disks.iter().map(|d| d.disk.as_str()).collect();
        assert_eq!(names, ["logs", "root"]);
        assert_eq!(disks[1].write_bytes, 20);
        assert_eq!(disks[1].write_time_ns, 7);
        assert_eq!(disks[0].write_ops, 1);
    }
}
