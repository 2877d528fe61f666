//! Live-migration figures for the qemu driver: boots the test guest on one
//! driver and migrates it back and forth between two drivers ("nodes": own
//! data dirs, shared disk dir) on this host, then prints per-run and median
//! figures.
//!
//! `cargo bench -p keel-hv --bench migration`
//! `KEEL_BENCH_N` migrations (default 3), `KEEL_BENCH_MEMORY_MIB` guest
//! memory (default 256). Runs under TCG like the tests, over the default
//! Unix-socket transport, with QEMU's default bandwidth cap (128 MiB/s) and
//! downtime limit (300 ms).
//!
//! Reported per migration: `wall` from `migrate` returning to this program
//! seeing `Completed` (polled every 20 ms), and QEMU's own `total-time` and
//! `downtime` (guest paused for the switch-over) from `query-migrate`.
//! Each run also checks the guest kept running (same boot id, ticks on).

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::{boot, spec, wait_for, Cluster, BOOT, STOP};
use keel_hv::guest::GuestChannel;
use keel_hv::{DomainSpec, DomainState, Hypervisor, MigrationProgress};

struct Sample {
    wall_ms: u64,
    total_ms: u64,
    downtime_ms: Option<u64>,
}

fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number")),
        Err(_) => default,
    }
}

fn median(mut v: Vec<u64>) -> Option<u64> {
    v.sort_unstable();
    match v.len() {
        0 => None,
        n if n % 2 == 1 => Some(v[n / 2]),
        n => Some((v[n / 2 - 1] + v[n / 2]) / 2),
    }
}

fn main() {
    let n = env_u64("KEEL_BENCH_N", 3).max(1);
    let memory_mib = env_u64("KEEL_BENCH_MEMORY_MIB", 256);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(run(n, memory_mib));
}

async fn run(n: u64, memory_mib: u64) {
    let Some(cluster) = Cluster::new() else {
        return;
    };
    let nodes = [cluster.node("a").await, cluster.node("b").await];
    let facts = nodes[0].facts().await;
    println!(
        "migration bench: {n} migrations, guest {memory_mib} MiB / 1 vCPU, {} ({:?}), unix socket",
        facts.hypervisor,
        nodes[0].accelerator().await
    );

    let mut source = DomainSpec {
        memory_mib,
        ..spec("bench", "bench-0")
    };
    let mut ch = boot(&nodes[0], &source).await;
    let boot_id = ch.ticks().await.expect("ticks").boot_id;
    let mut samples = Vec::new();
    for i in 0..n as usize {
        let (from, to) = (&nodes[i % 2], &nodes[(i + 1) % 2]);
        let target = DomainSpec {
            instance: format!("bench-{}", i + 1),
            ..source.clone()
        };
        let before = ch.ticks().await.expect("ticks");
        let uri = to
            .prepare_incoming(&target)
            .await
            .expect("prepare_incoming");
        let t = Instant::now();
        from.migrate(&source.instance, &uri).await.expect("migrate");
        let deadline = t + Duration::from_secs(120);
        let (total_ms, downtime_ms) = loop {
            match from
                .migration_status(&source.instance)
                .await
                .expect("status")
            {
                MigrationProgress::Completed {
                    total_ms,
                    downtime_ms,
                } => break (total_ms, downtime_ms),
                MigrationProgress::Active { .. } => {}
                other => panic!("migration {}: {other:?}", i + 1),
            }
            assert!(Instant::now() < deadline, "migration {} too slow", i + 1);
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let wall_ms = t.elapsed().as_millis() as u64;
        assert!(total_ms > 0, "completed without QEMU's figures");

        // Targets wait paused until told to run (Keel: once recorded).
        wait_for(to, &target.instance, STOP, |s| *s == DomainState::Paused).await;
        to.resume_incoming(&target.instance)
            .await
            .expect("resume target");
        let state = wait_for(to, &target.instance, STOP, |s| *s == DomainState::Running).await;
        assert_eq!(state, DomainState::Running);
        ch = GuestChannel::connect(to.command_socket(&target.instance))
            .await
            .expect("target channel");
        ch.sync(BOOT).await.expect("target guest answers");
        let after = ch.ticks().await.expect("ticks");
        assert_eq!(after.boot_id, boot_id, "the guest rebooted");
        assert!(after.ticks >= before.ticks, "ticks went back");
        from.kill(&source.instance).await.expect("kill source");
        from.cleanup(&source.instance)
            .await
            .expect("cleanup source");

        println!(
            "  #{:<2} {} -> {}: wall {wall_ms:>5} ms, QEMU total {total_ms:>5} ms, downtime {:>4} ms",
            i + 1,
            source.instance,
            target.instance,
            downtime_ms.map_or("?".to_string(), |d| d.to_string()),
        );
        samples.push(Sample {
            wall_ms,
            total_ms,
            downtime_ms,
        });
        source = target;
    }
    let fmt = |v: Option<u64>| v.map_or("?".to_string(), |v| format!("{v} ms"));
    println!(
        "median over {n}: wall {}, total {}, downtime {}",
        fmt(median(samples.iter().map(|s| s.wall_ms).collect())),
        fmt(median(samples.iter().map(|s| s.total_ms).collect())),
        fmt(median(
            samples.iter().filter_map(|s| s.downtime_ms).collect()
        )),
    );
    let last = &nodes[n as usize % 2];
    last.kill(&source.instance).await.expect("kill");
    last.cleanup(&source.instance).await.expect("cleanup");
}
