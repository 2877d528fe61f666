//! The idle phase of the single-node runs: once every VM runs and nothing
//! changes (no request, no guest doing anything), how much of a core the
//! server still spends. Observation is event-driven, with only a slow,
//! jittered resync per VM, so an idle host should cost next to nothing.
//! Read from `/proc/PID/stat` (user + system time of all its threads)
//! across a quiet window that begins after a settle time, so the last
//! boots' settle checks and first readiness answers are behind it.

use std::time::{Duration, Instant};

use super::scrape::cpu_seconds;

#[derive(Debug, Clone, serde::Serialize)]
pub struct IdleFigures {
    /// How long the process was left alone before the window.
    pub settle_s: f64,
    /// The measured window.
    pub window_s: f64,
    /// CPU time over the window, as a percentage of one core.
    pub cpu_percent_of_core: f64,
}

pub fn measure(pid: u32, settle: Duration, window: Duration) -> anyhow::Result<IdleFigures> {
    std::thread::sleep(settle);
    let cpu_before = cpu_seconds(pid)?;
    let started = Instant::now();
    std::thread::sleep(window);
    let cpu = cpu_seconds(pid)? - cpu_before;
    let wall = started.elapsed().as_secs_f64();
    Ok(IdleFigures {
        settle_s: settle.as_secs_f64(),
        window_s: wall,
        cpu_percent_of_core: 100.0 * cpu / wall.max(1e-9),
    })
}
