//! `keel bench scale` on a few VMs: the benchmark runs end to end (SQLite
//! and an etcd cluster of its own) and reports every figure. Its speed is
//! for the benchmark to print, not for this test to judge.

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
        }
    }
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
