//! Fencing with real processes: etcd, a control plane and two node agents,
//! each a `keel` process, with a real QEMU guest (TCG) and disk directories
//! of their own, as on two hosts without shared storage.
//!
//! `kill -9` of the agent that runs the VM: its keeper ends the orphaned
//! QEMU once the agent's local lease lapses (within 30 s), the cluster
//! takes the VM over only after the node's lease (40 s), and the other node
//! boots nothing, on blank disks or otherwise, since the VM's disks are on
//! the dead node. The process table is sampled throughout: never two QEMUs
//! of the VM. When the agent is back the VM runs there again, on its own
//! disks, with the record written before.
//!
//! Needs the etcd of `scripts/start-etcd` (`KEEL_ETCD_ENDPOINT`), QEMU and
//! the test guest; `KEEL_SKIP_ETCD_TESTS=1` or `KEEL_SKIP_QEMU_TESTS=1`
//! skip it.

mod procs;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use procs::{
    all_logs, cli, guest_channel, qemus_of, serving_url, spawn_control_plane, vm_json, wait_nodes,
    wait_running, Keel, Workdir,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_the_owning_agent_never_leaves_two_instances_or_blank_disks() {
    let Some(work) = Workdir::start("fencing") else {
        return;
    };
    let (root, store, guest_dir) = (
        work.root.clone(),
        work.store.clone(),
        work.guest_dir.clone(),
    );
    let dir = |name: &str| work.dir(name);

    let cp_dir = dir("cp");
    let mut cp = spawn_control_plane(&store, &cp_dir, &[]);
    let spawn_agent = |node: &str| {
        let extra = ["--accel", "tcg", "--guest-dir", &guest_dir];
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

    // Running, and the guest up: write a record to its disk.
    let (owner, instance) = wait_running(&root, &server, "web", || logs(&cp, &agents)).await;
    let other = if owner == "n1" { "n2" } else { "n1" };
    guest_channel(&root.join(&owner), &instance)
        .await
        .put(5, "written before the fault")
        .await
        .unwrap();

    // The process table, sampled throughout.
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

    let killed_at = Instant::now();
    let owner_index = agents.iter().position(|a| a.name == owner).unwrap();
    agents[owner_index].kill9();
    let fenced_after = loop {
        if qemus_of(&root, "web").is_empty() {
            break killed_at.elapsed();
        }
        assert!(
            killed_at.elapsed() < Duration::from_secs(30),
            "the orphaned QEMU still runs 30 s after kill -9 of its agent:\n{}",
            logs(&cp, &agents)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!("orphaned QEMU fenced {fenced_after:?} after kill -9 of agent {owner}");

    // Past the node's lease: the control plane has taken the VM over, and
    // the other node has booted nothing and made no disks for it.
    let deadline = Instant::now() + Duration::from_secs(90);
    let vm = loop {
        let vm = vm_json(&root, &server, "web").unwrap();
        let message = vm["status"]["message"].as_str().unwrap_or_default();
        if vm["status"]["instance"].is_null() && message.contains("where its disks are") {
            break vm;
        }
        assert!(
            Instant::now() < deadline,
            "not taken over: {vm}\n{}",
            logs(&cp, &agents)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    eprintln!(
        "taken over after {:?}: {}",
        killed_at.elapsed(),
        vm["status"]["message"]
    );
    if let Ok(path) = std::env::var("KEEL_TEST_LOG_FILE") {
        std::fs::write(path, cp.log()).unwrap();
    }
    // A little longer: nothing may start on the other node meanwhile.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(qemus_of(&root, "web").is_empty(), "a second instance runs");
    let other_disks = root.join(other).join("node/disks/web");
    assert!(
        !other_disks.exists(),
        "{other} made disks for web: {}",
        other_disks.display()
    );

    // The agent is back: the VM runs on its own disks again.
    agents[owner_index] = spawn_agent(&owner);
    let deadline = Instant::now() + Duration::from_secs(120);
    let (node, instance) = loop {
        if let Some(vm) = vm_json(&root, &server, "web") {
            let inst = &vm["status"]["instance"];
            if vm["status"]["phase"] == "Running" && inst["id"].as_str() != Some(&instance) {
                break (
                    inst["node"].as_str().unwrap().to_string(),
                    inst["id"].as_str().unwrap().to_string(),
                );
            }
        }
        assert!(
            Instant::now() < deadline,
            "web did not come back:\n{}",
            logs(&cp, &agents)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert_eq!(node, owner, "ran elsewhere than where its disks are");
    let mut ch = guest_channel(&root.join(&owner), &instance).await;
    assert_eq!(ch.get(5).await.unwrap(), "written before the fault");

    stop_sampling.store(true, Ordering::Relaxed);
    sampler.join().unwrap();
    let max = max_seen.load(Ordering::Relaxed);
    eprintln!("max simultaneous QEMUs of web: {max}");
    assert_eq!(max, 1, "two instances of web at once");
    cp.kill9();
}
