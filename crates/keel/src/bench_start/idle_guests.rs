//! `keel bench start --idle-guests N`: what the server spends on guests
//! that do nothing. After the start rounds, N more VMs of the test guest
//! are started on the same `keel serve` (real QEMU), the bench waits until
//! every one is Running and ready, leaves the server alone for a settle
//! time and then reads its CPU time (`/proc/PID/stat`: the Keel process's
//! own threads, not the QEMU processes, which run in sessions of their
//! own) over a window. Ready guests should cost next to nothing: the
//! console watch ends at the readiness text, and what is left is the slow
//! resync and the heartbeat.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::Value;

use super::{Cli, READY_TEXT};
use crate::bench_scale::idle::{self, IdleFigures};
use crate::bench_scale::Api;

/// The figures of one idle-guests run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct IdleGuestsFigures {
    pub guests: usize,
    /// From the first create until every guest was ready.
    pub all_ready_s: f64,
    pub idle: IdleFigures,
}

/// The VMs' names: apart from the rounds' VM.
fn name(i: usize) -> String {
    format!("idle-{i}")
}

pub fn run(
    cli: &Cli,
    api: &Api,
    serve_pid: u32,
    guests: usize,
    settle: Duration,
    window: Duration,
    timeout: Duration,
) -> anyhow::Result<IdleGuestsFigures> {
    let readiness = format!("console:{READY_TEXT}");
    let started = Instant::now();
    for i in 0..guests {
        cli.run(
            &[
                "vm",
                "create",
                &name(i),
                "--memory",
                "128",
                "--readiness",
                &readiness,
            ],
            timeout,
        )
        .with_context(|| format!("creating {}", name(i)))?;
    }
    let deadline = started + timeout;
    loop {
        let list: Value = serde_json::from_str(&api.get_text("/api/v1/vms")?)?;
        let ready = list["items"]
            .as_array()
            .context("the VM list has no items")?
            .iter()
            .filter(|i| {
                i["vm"]["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("idle-"))
                    && i["vm"]["status"]["instance"]["readiness"]["ready_at"].is_u64()
                    && i["vm"]["status"]["phase"] == "Running"
            })
            .count();
        if ready == guests {
            break;
        }
        if Instant::now() >= deadline {
            bail!("{ready} of {guests} idle guests ready within {timeout:?}");
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    let all_ready_s = started.elapsed().as_secs_f64();
    println!("idle guests: {guests} ready after {all_ready_s:.0} s");
    let idle = idle::measure(serve_pid, settle, window)?;
    Ok(IdleGuestsFigures {
        guests,
        all_ready_s,
        idle,
    })
}

/// Stops and deletes the guests (without waiting for each).
pub fn remove(cli: &Cli, guests: usize, timeout: Duration) {
    for i in 0..guests {
        let _ = cli.run(&["vm", "delete", &name(i)], timeout);
    }
}
