//! `keel bench scale` on a few VMs: the benchmark runs end to end (SQLite
//! and an etcd cluster of its own) and reports every figure. Its speed is
//! for the benchmark to print, not for this test to judge.
//!
//! `keel bench start` for one round on the test guest (real QEMU): both
//! sides start and become ready, bare ran Keel's own command line, and a
//! Keel start is cut into its phases.

use std::process::Command;

use serde_json::Value;

#[test]
fn the_scale_bench_reports_every_figure_for_sqlite_and_etcd() {
    if std::env::var("KEEL_SKIP_ETCD_TESTS").as_deref() == Ok("1") {
        return;
    }
    let work = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args([
            "bench",
            "scale",
            "--vms",
            "30",
            "--etcd-vms",
            "30",
            "--mixed-vms",
            "40",
            "--nodes",
            "3",
            "--control-planes",
            "2",
            "--agents",
            "2",
            "--clients",
            "4",
            "--create-pace",
            "100",
            "--scrapes",
            "2",
            "--idle-settle-s",
            "0",
            "--idle-s",
            "1",
            "--timeout-s",
            "120",
            "--work-dir",
        ])
        .arg(work.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(" CPUs, "),
        "the machine is named:\n{stdout}"
    );
    let reports: Vec<Value> = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(reports.len(), 3, "{stdout}");
    for (r, (store, vms, kinds)) in reports.iter().zip([
        ("sqlite", 30, &["serve"][..]),
        ("sqlite, mixed sizes", 40, &["serve"][..]),
        ("etcd", 30, &["agent", "control plane", "etcd"][..]),
    ]) {
        assert_eq!(r["store"], store, "{r}");
        assert_eq!(r["vms"], vms, "{r}");
        assert!(r["all_running_s"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["restart_all_s"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["create_p99_ms"].as_f64().unwrap() >= r["create_p50_ms"].as_f64().unwrap());
        // The creates were asked on the pace's schedule: never ahead of
        // it, so they took at least 29 of its intervals for 30 VMs.
        assert_eq!(r["create_pace_per_s"], 100.0, "{r}");
        let rate = r["create_per_s"].as_f64().unwrap();
        let most = 100.0 * vms as f64 / (vms - 1) as f64;
        assert!(rate > 0.0 && rate <= most, "{r}");
        assert!(r["store_bytes"].as_u64().unwrap() > 0, "{r}");
        if store == "sqlite" {
            // Every VM's series, on the node that runs them.
            assert_eq!(r["scrape"]["vms_with_series"], 30, "{r}");
            assert!(r["scrape"]["p99_ms"].as_f64().unwrap() > 0.0, "{r}");
            // The idle window was measured and printed.
            assert!(r["idle"]["window_s"].as_f64().unwrap() >= 1.0, "{r}");
            assert!(
                r["idle"]["cpu_percent_of_core"].as_f64().unwrap() >= 0.0,
                "{r}"
            );
            assert!(stdout.contains("% of a core over"), "{stdout}");
        }
        for kind in kinds {
            assert!(
                r["peak_rss_mib"][kind].as_f64().unwrap() > 1.0,
                "{kind}: {r}"
            );
            // Each kind's CPU to all Running is counted, and the bench's own.
            assert!(r["cpu_ms_per_vm"][kind].as_f64().is_some(), "{kind}: {r}");
        }
        assert!(r["cpu_ms_per_vm"]["bench"].as_f64().is_some(), "{r}");
    }
    assert!(stdout.contains("CPU until all Running: "), "{stdout}");
    assert!(stdout.contains("VMs/s (asked at 100/s)"), "{stdout}");
    // The etcd run's anchor: its VMs' writes (three transactions each, and
    // the placements, up to 32 VMs to one) and watches, on a fresh etcd.
    let floor = &reports[2]["store_floor"];
    let transactions = floor["transactions"].as_u64().unwrap();
    assert!((3 * 30 + 1..=4 * 30).contains(&transactions), "{floor}");
    assert_eq!(floor["puts"], 10 * 30, "{floor}");
    assert_eq!(floor["watch_events"], 11 * 30, "{floor}");
    assert!(floor["seconds"].as_f64().unwrap() > 0.0, "{floor}");
    assert!(
        floor["etcd_cpu_ms_per_vm"].as_f64().unwrap() >= 0.0,
        "{floor}"
    );
    assert!(stdout.contains("etcd alone: the same writes"), "{stdout}");
    assert!(reports[0]["store_floor"].is_null(), "{}", reports[0]);
    // The same again with the creates at the target's pace (10,000 VMs in
    // 15 s): never ahead of it, so the 30 creates take at least 29 of its
    // intervals, and each create's answer is timed.
    let paced = &reports[2]["store_floor_paced"];
    assert_eq!(paced["pace_per_s"], 667.0, "{paced}");
    let rate = paced["create_per_s"].as_f64().unwrap();
    assert!(rate > 0.0 && rate <= 667.0 * 30.0 / 29.0, "{paced}");
    assert_eq!(paced["puts"], 10 * 30, "{paced}");
    assert_eq!(paced["watch_events"], 11 * 30, "{paced}");
    for floor in [floor, paced] {
        let p50 = floor["create_p50_ms"].as_f64().unwrap();
        assert!(p50 > 0.0, "{floor}");
        assert!(floor["create_p99_ms"].as_f64().unwrap() >= p50, "{floor}");
    }
    assert!(stdout.contains("etcd alone at 667 creates/s"), "{stdout}");
    assert!(reports[0]["store_floor_paced"].is_null(), "{}", reports[0]);
    // The mixed run's three simulated nodes in one `keel serve` took the
    // VMs, and the sampler saw every node's allocation within its capacity.
    let mixed = &reports[1];
    assert_eq!(mixed["nodes"], 3, "{mixed}");
    let capacity = &mixed["capacity"];
    assert!(capacity["samples"].as_u64().unwrap() >= 3, "{mixed}");
    assert_eq!(capacity["over_capacity"], 0, "{mixed}");
    assert!(capacity["max_cpu_share"].as_f64().unwrap() > 0.0, "{mixed}");
    assert!(stdout.contains("node samples over capacity"), "{stdout}");
}

#[test]
fn the_start_bench_runs_keels_command_line_bare_and_cuts_the_phases() {
    if std::env::var("KEEL_SKIP_QEMU_TESTS").as_deref() == Ok("1") {
        eprintln!("KEEL_SKIP_QEMU_TESTS=1: skipping real-QEMU test");
        return;
    }
    let guest = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/guest");
    let work = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args([
            "bench", "start", "--rounds", "1", "--accel", "tcg", "--guest",
        ])
        .arg(&guest)
        .arg("--work-dir")
        .arg(work.path())
        .args([
            "--idle-guests",
            "2",
            "--idle-settle-s",
            "0",
            "--idle-s",
            "2",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(" CPUs, "),
        "the machine is named:\n{stdout}"
    );
    // The idle run: both guests ready, the server's CPU over the window.
    assert!(
        stdout.contains("with 2 real guests ready and idle"),
        "{stdout}"
    );
    assert!(stdout.contains("Keel/bare "), "{stdout}");
    let r: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(r["accelerator"], "tcg", "{r}");
    for side in ["keel_start_ms", "bare_start_ms", "keel_stop_ms"] {
        let samples = r[side].as_array().unwrap();
        assert_eq!(samples.len(), 1, "{side}: {r}");
        assert!(samples[0].as_f64().unwrap() > 0.0, "{side}: {r}");
    }
    assert!(r["ratio"].as_f64().unwrap() > 0.0, "{r}");
    let idle = &r["idle_guests"];
    assert_eq!(idle["guests"], 2, "{r}");
    assert!(idle["idle"]["window_s"].as_f64().unwrap() >= 2.0, "{r}");
    assert!(
        idle["idle"]["cpu_percent_of_core"].as_f64().unwrap() >= 0.0,
        "{r}"
    );

    // Bare ran Keel's command line, as the two processes had it: the same
    // arguments in the same order, but for the instance's two directories,
    // moved to bare's own.
    let argv = |side: &str| -> Vec<String> {
        r[side]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_string())
            .collect()
    };
    let (keel, bare) = (argv("keel_argv"), argv("bare_argv"));
    assert!(keel.len() > 10 && keel[0].contains("qemu"), "{keel:?}");
    let moved: Vec<(String, String)> = r["moved_dirs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p[0].as_str().unwrap().to_string(),
                p[1].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(moved.len(), 2, "{r}");
    let mapped: Vec<String> = keel
        .iter()
        .map(|a| {
            moved.iter().fold(a.clone(), |a, (from, to)| {
                a.replace(from.as_str(), to.as_str())
            })
        })
        .collect();
    assert_eq!(mapped, bare, "bare's command line is Keel's");
    assert!(
        keel.iter().zip(&bare).filter(|(k, b)| k != b).count() >= 3,
        "the pid file, the logs and the sockets moved: {keel:?}"
    );

    // Each phase of the start was seen, but the ones it does not take.
    let phases = r["phases"].as_array().unwrap();
    for f in phases {
        let name = f["phase"].as_str().unwrap();
        // A VM that keeps its node is not placed again.
        if name == "placement" {
            continue;
        }
        let taken = name != "cont";
        assert_eq!(f["starts"], if taken { 1 } else { 0 }, "{name}: {f}");
        if taken {
            assert!(f["median_ms"].as_f64().unwrap() >= 0.0, "{f}");
        }
    }
    for name in [
        "spawn (passt, QEMU)",
        "QMP handshake",
        "readiness detection",
    ] {
        assert!(
            phases.iter().any(|f| f["phase"] == name),
            "{name} missing: {r}"
        );
    }
    assert!(stdout.contains("phases of a Keel start"), "{stdout}");
}
