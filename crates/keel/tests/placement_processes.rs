//! Placement by capacity and anti-affinity across real `keel agent`
//! processes running real QEMU guests (TCG): etcd, a control plane, three
//! agents on a disk dir they share. A VM larger than any node's free
//! memory stays Pending with the reason; three members of a required
//! anti-affinity group run on the three agents, one each; and a drain of
//! one member's node, with the other two nodes each holding a member,
//! leaves that member waiting with the reason instead of doubling up.
//!
//! Needs the etcd of `scripts/start-etcd`, QEMU and the test guest;
//! `KEEL_SKIP_ETCD_TESTS=1` or `KEEL_SKIP_QEMU_TESTS=1` skip it.

mod procs;

use std::collections::BTreeSet;
use std::time::Duration;

use procs::{
    all_logs, cli, qemus_of, serving_url, shared_disk_agent_args, spawn_control_plane, wait_nodes,
    wait_running, wait_vm, Keel, Workdir,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_and_anti_affinity_hold_across_real_agents() {
    let Some(work) = Workdir::start("placement") else {
        return;
    };
    let root = work.root.clone();
    let dir = |name: &str| work.dir(name);
    let disks = dir("disks");
    let mut cp = spawn_control_plane(&work.store, &dir("cp"), &[]);
    let agents: Vec<Keel> = ["n1", "n2", "n3"]
        .iter()
        .map(|node| {
            let args =
                shared_disk_agent_args(&work.store, node, &dir(node), &disks, &work.guest_dir);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            Keel::spawn(node, &args)
        })
        .collect();
    let logs = || all_logs(&cp, &agents);
    let server = serving_url(&cp).await;
    wait_nodes(&root, &server, 3, logs).await;
    let create = |args: &[&str]| {
        let out = cli(&root, &server, &[&["vm", "create"], args].concat());
        assert!(
            out.status.success(),
            "create {args:?}: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            logs()
        );
    };

    // Larger than any node offers: it waits, saying what each has free.
    create(&["huge", "--memory", "1048576", "--readiness", "none"]);
    let huge = wait_vm(
        &root,
        &server,
        "huge",
        "say why it waits",
        Duration::from_secs(30),
        |vm| {
            vm["status"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("no node has 1 CPU and 1024 GiB free for VM huge"))
        },
        logs,
    )
    .await;
    assert_eq!(huge["status"]["phase"], "Pending", "{huge}");
    let why = huge["status"]["message"].as_str().unwrap();
    for node in ["n1", "n2", "n3"] {
        assert!(why.contains(&format!("{node} ")), "{why}");
    }
    assert!(qemus_of(&root, "huge").is_empty());

    // Three members of one required group: one on each node.
    for name in ["w1", "w2", "w3"] {
        create(&[
            name,
            "--memory",
            "128",
            "--grace",
            "10",
            "--readiness",
            "none",
            "--anti-affinity",
            "web",
        ]);
    }
    let mut nodes = BTreeSet::new();
    let mut on = std::collections::BTreeMap::new();
    for name in ["w1", "w2", "w3"] {
        let (node, _) = wait_running(&root, &server, name, logs).await;
        on.insert(name, node.clone());
        nodes.insert(node);
    }
    assert_eq!(nodes.len(), 3, "members share a node: {on:?}");

    // Drain w1's node: the two others each hold a member, so w1 has
    // nowhere to go; the drain stops it and it waits with the reason.
    let drained = on["w1"].clone();
    let out = cli(&root, &server, &["node", "drain", &drained]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let w1 = wait_vm(
        &root,
        &server,
        "w1",
        "wait with the reason",
        Duration::from_secs(90),
        |vm| {
            vm["status"]["instance"].is_null()
                && vm["status"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("of anti-affinity group web"))
        },
        logs,
    )
    .await;
    assert_eq!(w1["status"]["phase"], "Pending", "{w1}");
    assert!(qemus_of(&root, "w1").is_empty(), "w1 still runs somewhere");
    for name in ["w2", "w3"] {
        assert_eq!(
            qemus_of(&root, name).len(),
            1,
            "{name} runs once:\n{}",
            logs()
        );
    }
    eprintln!("w1 waits: {}", w1["status"]["message"]);
    cp.kill9();
}
