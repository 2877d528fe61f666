//! Fencing with real processes: an etcd of this test's own (so it can be
//! stopped), a control plane and three node agents, each a `keel` process,
//! with real QEMU guests (TCG). Node n1 keeps its disks to itself; n2 and
//! n3 share a disk dir, as hosts on one NFS export would.
//!
//! Only what could run elsewhere is fenced:
//! - (a) `kill -9` of n1's agent, whose VM `halocal` is on node-local
//!   disks: its QEMU is never killed (the process table is sampled every
//!   100 ms), the VM keeps its instance through the node's lease with the
//!   reason on its record, and the restarted agent re-adopts the same
//!   QEMU (same pid, same instance id), the disk record written before;
//! - (c) at the same time, `kill -9` of the agent running `hashared` (HA
//!   on by default on shared disks): its keeper kills the QEMU within the
//!   fence lease, the VM is started on the other shared node, never two;
//! - (b) a 60 s outage of the store (SIGSTOP of etcd): `halocal`'s QEMU is
//!   never killed, and afterwards it is one instance, Running, same pid.
//!
//! Needs `etcd`, QEMU and the test guest; `KEEL_SKIP_ETCD_TESTS=1` or
//! `KEEL_SKIP_QEMU_TESTS=1` skip it.

mod procs;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use procs::{
    all_logs, cli, guest_channel, processes_naming, qemus_of, serving_url, spawn_control_plane,
    vm_json, wait_nodes, wait_running, wait_vm, Keel, Workdir,
};
use serde_json::Value;

/// A single-member etcd on free loopback ports, its data under `dir`.
fn spawn_etcd(dir: &str) -> (Keel, String) {
    let free_port = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    };
    let (client, peer) = (
        format!("http://127.0.0.1:{}", free_port()),
        format!("http://127.0.0.1:{}", free_port()),
    );
    let etcd = Keel::spawn_with(
        "etcd",
        std::process::Command::new("etcd").args([
            "--name",
            "ha",
            "--data-dir",
            dir,
            "--listen-client-urls",
            &client,
            "--advertise-client-urls",
            &client,
            "--listen-peer-urls",
            &peer,
            "--initial-advertise-peer-urls",
            &peer,
            "--initial-cluster",
            &format!("ha={peer}"),
        ]),
    );
    (etcd, client)
}

async fn wait_etcd(endpoint: &str, etcd: &Keel) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let host = endpoint.trim_start_matches("http://").to_string();
    while std::net::TcpStream::connect(&host).is_err() {
        assert!(
            Instant::now() < deadline,
            "etcd did not start:\n{}",
            etcd.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The QEMUs of `vm` under `root`: (pid, instance).
fn qemu_pids(root: &std::path::Path, vm: &str) -> Vec<(i32, String)> {
    processes_naming(&root.to_string_lossy())
        .into_iter()
        .filter(|(_, c)| c.starts_with("qemu-system"))
        .filter_map(|(pid, c)| {
            let name = c.split("guest=").nth(1)?.split_whitespace().next()?;
            name.starts_with(&format!("{vm}-"))
                .then(|| (pid, name.to_string()))
        })
        .collect()
}

fn signal(keel: &Keel, sig: i32) {
    // SAFETY: kill(2) on the etcd this test spawned.
    assert_eq!(unsafe { libc::kill(keel.child.id() as i32, sig) }, 0);
}

fn instance_of(vm: &Value) -> (String, String) {
    let inst = &vm["status"]["instance"];
    (
        inst["node"].as_str().unwrap_or_default().to_string(),
        inst["id"].as_str().unwrap_or_default().to_string(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_guests_another_node_could_run_are_fenced() {
    if std::process::Command::new("etcd")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("skipped: no etcd binary");
        return;
    }
    let Some(work) = Workdir::start("fencing") else {
        return;
    };
    let started = Instant::now();
    let (root, guest_dir) = (work.root.clone(), work.guest_dir.clone());
    let dir = |name: &str| work.dir(name);
    let (etcd, endpoint) = spawn_etcd(&dir("etcd"));
    wait_etcd(&endpoint, &etcd).await;
    let store = format!(
        "etcd://{}/keel-test/fencing",
        endpoint.trim_start_matches("http://")
    );

    let mut cp = spawn_control_plane(&store, &dir("cp"), &[]);
    let shared = dir("shared");
    let spawn_agent = |node: &str| {
        let mut extra = vec!["--accel", "tcg", "--guest-dir", &guest_dir];
        if node != "n1" {
            extra.extend(["--disk-dir", &shared]);
        }
        procs::spawn_agent(&store, node, &dir(node), &extra)
    };
    let mut agents = vec![spawn_agent("n1")];
    let logs = |cp: &Keel, agents: &[Keel]| all_logs(cp, agents) + "\n" + &etcd.log();
    let server = serving_url(&cp).await;
    wait_nodes(&root, &server, 1, || logs(&cp, &agents)).await;
    let create = |name: &str| {
        let out = cli(
            &root,
            &server,
            &["vm", "create", name, "--memory", "256", "--disk", "data:16"],
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    // Only n1 is up: halocal goes there, on its local disks.
    create("halocal");
    let (node, local) = wait_running(&root, &server, "halocal", || logs(&cp, &agents)).await;
    assert_eq!(node, "n1");
    guest_channel(&root.join("n1"), &local)
        .await
        .put(5, "written before the faults")
        .await
        .unwrap();
    agents.push(spawn_agent("n2"));
    agents.push(spawn_agent("n3"));
    wait_nodes(&root, &server, 3, || logs(&cp, &agents)).await;
    // n2 and n3 have no VM: hashared goes to one of them, on shared disks.
    create("hashared");
    let (owner, _) = wait_running(&root, &server, "hashared", || logs(&cp, &agents)).await;
    let other = if owner == "n2" { "n3" } else { "n2" };
    let vm = vm_json(&root, &server, "halocal").unwrap();
    assert_eq!(vm["status"]["instance"]["fenced"], false, "{vm}");
    let vm = vm_json(&root, &server, "hashared").unwrap();
    assert_eq!(vm["status"]["instance"]["fenced"], true, "{vm}");
    let get = cli(&root, &server, &["vm", "get", "halocal"]);
    let text = String::from_utf8_lossy(&get.stdout);
    assert!(text.contains("off (not fenced)"), "{text}");

    let [(local_pid, _)] = qemu_pids(&root, "halocal")[..] else {
        panic!("not one QEMU of halocal: {:?}", qemu_pids(&root, "halocal"));
    };
    // The process table every 100 ms: halocal's one QEMU never changes,
    // hashared never has two.
    let local_changed = Arc::new(Mutex::new(None::<String>));
    let max_shared = Arc::new(AtomicUsize::new(0));
    let stop_sampling = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (root, changed, max_shared, stop) = (
            root.clone(),
            local_changed.clone(),
            max_shared.clone(),
            stop_sampling.clone(),
        );
        let expected = vec![(local_pid, local.clone())];
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let now = qemu_pids(&root, "halocal");
                if now != expected {
                    changed
                        .lock()
                        .unwrap()
                        .get_or_insert(format!("{now:?} instead of {expected:?}"));
                }
                max_shared.fetch_max(qemus_of(&root, "hashared").len(), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    let local_intact = |when: &str| {
        // Read before panicking: a poisoned lock would fail the sampler too.
        let change = local_changed.lock().unwrap().clone();
        if let Some(change) = change {
            panic!("{when}: halocal's QEMU changed: {change}");
        }
    };

    // (a) and (c): kill -9 of n1's agent and of hashared's.
    let killed_at = Instant::now();
    let index = |name: &str| agents.iter().position(|a| a.name == name).unwrap();
    let (n1, owner_index) = (index("n1"), index(&owner));
    agents[n1].kill9();
    agents[owner_index].kill9();
    let fenced_after = loop {
        if qemus_of(&root, "hashared").is_empty() {
            break killed_at.elapsed();
        }
        assert!(
            killed_at.elapsed() < Duration::from_secs(30),
            "hashared's QEMU still runs 30 s after kill -9 of its agent:\n{}",
            logs(&cp, &agents)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!("(c) hashared's QEMU fenced {fenced_after:?} after kill -9 of {owner}");
    let vm = wait_vm(
        &root,
        &server,
        "hashared",
        "run on the other shared node",
        Duration::from_secs(90),
        |vm| vm["status"]["phase"] == "Running" && instance_of(vm).0 == other,
        || logs(&cp, &agents),
    )
    .await;
    eprintln!(
        "(c) hashared Running on {other} {:?} after the kill: {}",
        killed_at.elapsed(),
        vm["status"]["instance"]["id"]
    );
    // n1 is lost by now (40 s lease): halocal keeps its instance and says why.
    let vm = wait_vm(
        &root,
        &server,
        "halocal",
        "say it waits for its node",
        Duration::from_secs(60),
        |vm| {
            vm["status"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("is not fenced"))
        },
        || logs(&cp, &agents),
    )
    .await;
    assert_eq!(instance_of(&vm), ("n1".to_string(), local.clone()), "{vm}");
    eprintln!(
        "(a) {:?} after kill -9: {}",
        killed_at.elapsed(),
        vm["status"]["message"]
    );
    local_intact("agent n1 dead");
    assert!(!root.join("n2/node/disks/halocal").exists());
    assert!(!root.join("n3/node/disks/halocal").exists());

    agents[n1] = spawn_agent("n1");
    agents[owner_index] = spawn_agent(&owner);
    let vm = wait_vm(
        &root,
        &server,
        "halocal",
        "run again, re-adopted",
        Duration::from_secs(60),
        |vm| vm["status"]["phase"] == "Running" && vm["status"]["message"].is_null(),
        || logs(&cp, &agents),
    )
    .await;
    assert_eq!(instance_of(&vm), ("n1".to_string(), local.clone()), "{vm}");
    let mut ch = guest_channel(&root.join("n1"), &local).await;
    assert_eq!(ch.get(5).await.unwrap(), "written before the faults");
    drop(ch);
    local_intact("agent n1 restarted");
    eprintln!("(a) halocal re-adopted: pid {local_pid}, instance {local}");

    // Not needed for (b): hashared would be fenced (as it should) and boot
    // again, costing the CPU the other guest's checks run on.
    let out = cli(&root, &server, &["vm", "stop", "hashared"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_vm(
        &root,
        &server,
        "hashared",
        "stop",
        Duration::from_secs(60),
        |vm| vm["status"]["phase"] == "Stopped",
        || logs(&cp, &agents),
    )
    .await;

    // (b): the store is gone for 60 s.
    let heartbeat_before = heartbeat_of(&root, &server, "n1");
    assert!(!heartbeat_before.is_null(), "no heartbeat of n1");
    signal(&etcd, libc::SIGSTOP);
    let outage = Instant::now();
    while outage.elapsed() < Duration::from_secs(60) {
        local_intact("etcd stopped");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    signal(&etcd, libc::SIGCONT);
    let back = Instant::now();
    // n1's agent is through to the store again...
    while [Value::Null, heartbeat_before.clone()].contains(&heartbeat_of(&root, &server, "n1")) {
        assert!(
            back.elapsed() < Duration::from_secs(60),
            "n1 does not heartbeat after the outage:\n{}",
            logs(&cp, &agents)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // ...and the VM is one instance, Running, the same QEMU.
    let vm = wait_vm(
        &root,
        &server,
        "halocal",
        "be Running after the outage",
        Duration::from_secs(60),
        |vm| vm["status"]["phase"] == "Running" && vm["status"]["message"].is_null(),
        || logs(&cp, &agents),
    )
    .await;
    assert_eq!(instance_of(&vm), ("n1".to_string(), local.clone()), "{vm}");
    // A few heartbeats more: nothing ends it late.
    tokio::time::sleep(Duration::from_secs(10)).await;
    eprintln!(
        "(b) halocal Running {:?} after etcd came back",
        back.elapsed()
    );

    stop_sampling.store(true, Ordering::Relaxed);
    sampler.join().unwrap();
    local_intact("end");
    let vm = vm_json(&root, &server, "halocal").unwrap();
    assert_eq!(instance_of(&vm), ("n1".to_string(), local.clone()), "{vm}");
    assert_eq!(vm["status"]["instance_seq"], 1, "a new instance: {vm}");
    let max = max_shared.load(Ordering::Relaxed);
    eprintln!("max simultaneous QEMUs of hashared: {max}");
    assert_eq!(max, 1, "two instances of hashared at once");
    eprintln!("took {:?}", started.elapsed());
    cp.kill9();
}

/// Node `node`'s last heartbeat as the API has it (`Null` while the
/// store does not answer).
fn heartbeat_of(root: &std::path::Path, server: &str, node: &str) -> Value {
    let out = cli(root, server, &["node", "list", "-o", "json"]);
    let nodes: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    nodes["items"]
        .as_array()
        .and_then(|items| items.iter().find(|n| n["node"]["name"] == node))
        .map_or(Value::Null, |n| {
            n["node"]["status"]["last_heartbeat"].clone()
        })
}
