//! The scrape phase of the single-node runs: once every VM runs, `/metrics`
//! is fetched `SCRAPES` times, each past the guest figures' cache age so
//! every scrape reads the hypervisor afresh, as Prometheus's would at a
//! 15 s interval. Per scrape: wall time, and the serving process's CPU
//! time across the request (an upper bound: what its background work did
//! meanwhile is counted too).

use std::time::{Duration, Instant};

use anyhow::Context;

use super::{percentile, Api};

pub const SCRAPES: usize = 20;
/// Past `keel_hv::stats_cache::DEFAULT_MAX_AGE`.
const SPACING: Duration = Duration::from_millis(1100);

#[derive(Debug, Clone, serde::Serialize)]
pub struct ScrapeFigures {
    pub scrapes: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub cpu_ms_per_scrape: f64,
    /// VMs with per-VM series in the last scrape (`keel_vm_cpu_seconds_total`).
    pub vms_with_series: usize,
    pub bytes: usize,
}

pub fn measure(api: &Api, pid: u32, scrapes: usize) -> anyhow::Result<ScrapeFigures> {
    let mut wall_ms = Vec::with_capacity(scrapes);
    let mut cpu_s = 0.0;
    let mut last = String::new();
    for i in 0..scrapes {
        if i > 0 {
            std::thread::sleep(SPACING);
        }
        let cpu_before = cpu_seconds(pid)?;
        let t = Instant::now();
        last = api.get_text("/metrics")?;
        wall_ms.push(t.elapsed().as_secs_f64() * 1000.0);
        cpu_s += cpu_seconds(pid)? - cpu_before;
    }
    Ok(ScrapeFigures {
        scrapes,
        p50_ms: percentile(&wall_ms, 0.50),
        p99_ms: percentile(&wall_ms, 0.99),
        cpu_ms_per_scrape: cpu_s * 1000.0 / scrapes.max(1) as f64,
        vms_with_series: last
            .lines()
            .filter(|l| l.starts_with("keel_vm_cpu_seconds_total{"))
            .count(),
        bytes: last.len(),
    })
}

/// User and system CPU time of `pid`, all threads, in seconds.
pub(super) fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    let rest = &stat[stat.rfind(')').context("no ')' in stat")? + 1..];
    let mut fields = rest.split_whitespace().skip(11);
    let mut next =
        || -> anyhow::Result<f64> { Ok(fields.next().context("stat too short")?.parse::<f64>()?) };
    let ticks = next()? + next()?;
    // SAFETY: sysconf has no preconditions.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Ok(ticks / per_second)
}
