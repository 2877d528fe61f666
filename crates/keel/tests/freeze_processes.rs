//! Planned agent restarts with real processes: etcd, a control plane and
//! two node agents (`keel agent --restart-freeze 20s`), a real QEMU guest
//! (TCG), disks on a directory both nodes share.
//!
//! SIGTERM of the owning agent freezes its node and exits without stopping
//! the guest: the same QEMU process keeps running. An agent started again
//! within the freeze re-adopts it (same pid, same instance, no second
//! QEMU) and ends the freeze. SIGTERM again, and this time the agent does
//! not return: the keeper ends QEMU at the freeze's end, not before, and
//! only after the freeze's end plus the margin does the VM run again, on
//! the other node. The process table is sampled throughout: never two
//! QEMUs of the VM.
//!
//! Needs the etcd of `scripts/start-etcd` (`KEEL_ETCD_ENDPOINT`), QEMU and
//! the test guest; `KEEL_SKIP_ETCD_TESTS=1` or `KEEL_SKIP_QEMU_TESTS=1`
//! skip it.

mod procs;

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use procs::{
    all_logs, cli, processes_naming, qemus_of, serving_url, spawn_control_plane, vm_json,
    wait_nodes, wait_running, Keel, Workdir,
};
use serde_json::Value;

const FREEZE: Duration = Duration::from_secs(20);

/// The pid of the QEMU of `instance` under `root`.
fn qemu_pid(root: &Path, instance: &str) -> Option<i32> {
    processes_naming(&root.to_string_lossy())
        .into_iter()
        .find(|(_, c)| c.starts_with("qemu-system") && c.contains(&format!("guest={instance} ")))
        .map(|(pid, _)| pid)
}

/// SIGTERM, then waits (bounded) for the process to exit; its exit status.
fn sigterm(agent: &mut Keel) -> std::process::ExitStatus {
    // SAFETY: our own child process.
    unsafe { libc::kill(agent.child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = agent.child.try_wait().unwrap() {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "agent did not exit on SIGTERM:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn node_json(root: &Path, server: &str, name: &str) -> Value {
    let out = cli(root, server, &["node", "info", name, "-o", "json"]);
    serde_json::from_slice::<Value>(&out.stdout).unwrap_or(Value::Null)["node"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_freezes_the_node_and_the_agent_readopts_or_the_keeper_fences() {
    let Some(work) = Workdir::start("freeze") else {
        return;
    };
    let (root, store, guest_dir) = (
        work.root.clone(),
        work.store.clone(),
        work.guest_dir.clone(),
    );
    let dir = |name: &str| work.dir(name);
    let disks = dir("disks");

    let cp_dir = dir("cp");
    let mut cp = spawn_control_plane(&store, &cp_dir, &[]);
    let spawn_agent = |node: &str| {
        let extra = [
            "--disk-dir",
            &disks,
            "--accel",
            "tcg",
            "--guest-dir",
            &guest_dir,
            "--restart-freeze",
            "20s",
        ];
        procs::spawn_agent(&store, node, &dir(node), &extra)
    };
    let mut agents = vec![spawn_agent("n1"), spawn_agent("n2")];
    let logs = |cp: &Keel, agents: &[Keel]| all_logs(cp, agents);
    let server = serving_url(&cp).await;
    wait_nodes(&root, &server, 2, || logs(&cp, &agents)).await;
    let out = cli(
        &root,
        &server,
        &[
            "vm", "create", "web", "--memory", "256", "--disk", "data:64", "--policy", "AlwaysOn",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (owner, instance) = wait_running(&root, &server, "web", || logs(&cp, &agents)).await;
    let other = if owner == "n1" { "n2" } else { "n1" };
    let pid = qemu_pid(&root, &instance).expect("QEMU of web");

    let max_seen = Arc::new(AtomicUsize::new(0));
    let stop_sampling = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (root, max_seen, stop) = (root.clone(), max_seen.clone(), stop_sampling.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                max_seen.fetch_max(qemus_of(&root, "web").len(), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    let owner_index = agents.iter().position(|a| a.name == owner).unwrap();

    // 1. SIGTERM, back within the freeze: the same QEMU throughout.
    let t = Instant::now();
    let status = sigterm(&mut agents[owner_index]);
    assert!(status.success(), "{status}:\n{}", agents[owner_index].log());
    eprintln!("agent {owner} exited {:?} after SIGTERM", t.elapsed());
    let freeze = &node_json(&root, &server, &owner)["freeze"];
    assert_eq!(freeze["duration_ms"], 20_000, "{freeze}");
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_eq!(
        qemu_pid(&root, &instance),
        Some(pid),
        "the guest did not keep running"
    );
    agents[owner_index] = spawn_agent(&owner);
    let back = Instant::now();
    let deadline = back + Duration::from_secs(30);
    loop {
        let node = node_json(&root, &server, &owner);
        let vm = vm_json(&root, &server, "web").unwrap_or(Value::Null);
        if node["freeze"].is_null() && vm["status"]["phase"] == "Running" {
            assert_eq!(vm["status"]["instance"]["id"], instance.as_str());
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not re-adopted: {vm}\n{}",
            logs(&cp, &agents)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!(
        "agent {owner} back after {:?} of freeze; freeze cleared {:?} later",
        back - t,
        back.elapsed()
    );
    // Well past the first freeze's end: still the same process.
    tokio::time::sleep(
        (t + FREEZE + Duration::from_secs(10)).saturating_duration_since(Instant::now()),
    )
    .await;
    assert_eq!(
        qemu_pid(&root, &instance),
        Some(pid),
        "the guest was fenced or restarted"
    );
    let vm = vm_json(&root, &server, "web").unwrap();
    assert_eq!(vm["status"]["instance"]["id"], instance.as_str());

    // 2. SIGTERM, and the agent does not return.
    let t = Instant::now();
    let status = sigterm(&mut agents[owner_index]);
    assert!(status.success(), "{status}:\n{}", agents[owner_index].log());
    let fenced_after = loop {
        if qemu_pid(&root, &instance).is_none() {
            break t.elapsed();
        }
        assert!(
            t.elapsed() < FREEZE + Duration::from_secs(10),
            "not fenced after the freeze:\n{}",
            logs(&cp, &agents)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!("QEMU fenced {fenced_after:?} after SIGTERM (freeze {FREEZE:?})");
    assert!(
        fenced_after >= FREEZE - Duration::from_secs(2),
        "fenced before the freeze's end: {fenced_after:?}"
    );
    let deadline = t + Duration::from_secs(150);
    let (node, new_instance) = loop {
        if let Some(vm) = vm_json(&root, &server, "web") {
            let inst = &vm["status"]["instance"];
            if vm["status"]["phase"] == "Running" && inst["id"].as_str() != Some(&instance) {
                break (
                    inst["node"].as_str().unwrap().to_string(),
                    inst["id"].as_str().unwrap().to_string(),
                );
            }
            if !inst.is_null()
                && inst["id"].as_str() != Some(&instance)
                && inst["node"] != owner.as_str()
            {
                // Taken over: at least the freeze and the margin after SIGTERM.
                assert!(
                    t.elapsed() >= FREEZE + Duration::from_secs(18),
                    "taken over {:?} after SIGTERM",
                    t.elapsed()
                );
            }
        }
        assert!(
            Instant::now() < deadline,
            "web did not come back:\n{}",
            logs(&cp, &agents)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    eprintln!(
        "web running again on {node} as {new_instance} {:?} after SIGTERM",
        t.elapsed()
    );
    assert_eq!(node, other);
    stop_sampling.store(true, Ordering::Relaxed);
    sampler.join().unwrap();
    let max = max_seen.load(Ordering::Relaxed);
    eprintln!("max simultaneous QEMUs of web: {max}");
    assert_eq!(max, 1, "two instances of web at once");
    cp.kill9();
}
