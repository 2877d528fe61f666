//! Wall clocks that step, in real processes: an etcd of the test's own, a
//! control plane and two node agents, each a `keel` process with a wall
//! clock of its own (libfaketime, `procs::faketime`; monotonic clocks left
//! alone, checked first), two real QEMU test guests (TCG) on a disk dir
//! both nodes share, so a wrong takeover would really start a VM elsewhere.
//!
//! With every agent healthy:
//! 1. The control plane's wall clock jumps +90 s, and so does one agent's:
//!    for the next 60 s (more than the 40 s node lease) nothing moves. A
//!    VM created just before the step and one just after make the leader
//!    look at the nodes across it within one heartbeat period.
//! 2. The other agent's node is frozen (`keel node freeze --for 40s`) and
//!    its wall clock jumps -90 s during the freeze: the fence lease its
//!    keeper enforces never reaches past the freeze's end as observers
//!    count it (counted here from before the request), and once the freeze
//!    is over the agent clears it and the lease is the normal 20 s again.
//!
//! Throughout, the process table is sampled every 100 ms and every VM must
//! keep its instance and its QEMU process: no node lost, no VM moved,
//! restarted or fenced, no phase change recorded. Prints the suite's
//! nemesis line. Needs etcd, QEMU, the test guest and libfaketime;
//! `KEEL_SKIP_ETCD_TESTS=1` or `KEEL_SKIP_QEMU_TESTS=1` skip it.

mod procs;

use keel_testkit::private_etcd::PrivateEtcd;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keel_api::clock::boottime_ms;
use procs::faketime::{self, WallClock};
use procs::{
    cli, processes_naming, qemus_of, serving_url, vm_json, wait_nodes, wait_vm, Keel, Workdir,
};
use serde_json::Value;

const VMS: [&str; 2] = ["clkstep0", "clkstep1"];
/// Longer than the node lease (40 s): a step judged as silence would have
/// cost the node its VMs by then.
const WATCH_AFTER_STEP: Duration = Duration::from_secs(60);
const FREEZE_S: u64 = 40;
const SELF_FENCE_MS: u64 = 20_000;

/// The test binary run as the child of `faketime::verify`.
#[test]
fn faketime_probe() {
    faketime::probe();
}

fn qemu_pid(root: &Path, instance: &str) -> Option<i32> {
    processes_naming(&root.to_string_lossy())
        .into_iter()
        .find(|(_, c)| c.starts_with("qemu-system") && c.contains(&format!("guest={instance} ")))
        .map(|(pid, _)| pid)
}

/// The lease file the keeper of `instance` enforces (from its command line).
fn lease_file(root: &Path, instance: &str) -> PathBuf {
    let keeper = processes_naming(&root.to_string_lossy())
        .into_iter()
        .find(|(_, c)| c.contains(" keeper ") && c.contains(&format!("/{instance} ")))
        .unwrap_or_else(|| panic!("no keeper of {instance}"));
    let lease = keeper
        .1
        .split("--lease ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("keeper without --lease: {}", keeper.1));
    PathBuf::from(lease)
}

/// The deadline (`CLOCK_BOOTTIME` ms) in a lease file.
fn lease_deadline(file: &Path) -> u64 {
    let text = std::fs::read_to_string(file).unwrap();
    let record: Value = serde_json::from_str(text.trim()).unwrap();
    record["valid_until_boottime_ms"].as_u64().unwrap()
}

fn events_of(root: &Path, server: &str, vm: &str) -> usize {
    let out = cli(root, server, &["events", vm, "-o", "json"]);
    let list: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    list["items"].as_array().map_or(0, Vec::len)
}

fn node_freeze(root: &Path, server: &str, node: &str) -> Value {
    let out = cli(root, server, &["node", "info", node, "-o", "json"]);
    serde_json::from_slice::<Value>(&out.stdout).unwrap_or(Value::Null)["node"]["freeze"].clone()
}

/// Where each VM ran when the faults began.
#[derive(Debug, Clone)]
struct Placement {
    node: String,
    instance: String,
    pid: i32,
    events: usize,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wall_clock_steps_move_no_vm_and_fence_no_guest() {
    let Some(mut work) = Workdir::start("clocksteps") else {
        return;
    };
    if !faketime::available() {
        eprintln!(
            "SKIPPED: {} missing (apt-get install libfaketime; scripts/setup does)",
            faketime::LIBRARY
        );
        return;
    }
    if Command::new("etcd").arg("--version").output().is_err() {
        eprintln!("SKIPPED: no etcd (apt-get install etcd-server etcd-client)");
        return;
    }
    let began = Instant::now();
    faketime::verify(&work.root, "faketime_probe");
    let etcd = PrivateEtcd::start_in(&work.root.join("etcd"));
    work.store = format!("etcd://127.0.0.1:{}/keel-test/clocksteps", etcd.port());
    let (root, store, guest_dir) = (
        work.root.clone(),
        work.store.clone(),
        work.guest_dir.clone(),
    );
    let dir = |name: &str| work.dir(name);
    let disks = dir("disks");
    let keel = env!("CARGO_BIN_EXE_keel");

    let clocks: BTreeMap<&str, WallClock> = ["cp", "n1", "n2"]
        .into_iter()
        .map(|who| (who, WallClock::new(root.join(format!("clock-{who}")))))
        .collect();
    let cp = Keel::spawn_with(
        "cp",
        clocks["cp"].apply(
            Command::new(keel)
                .arg("serve")
                .args(procs::store_flags(&store))
                .args([
                    "--listen",
                    "127.0.0.1:0",
                    "--node",
                    "cp",
                    "--data-dir",
                    &dir("cp"),
                ]),
        ),
    );
    let agents: Vec<Keel> = ["n1", "n2"]
        .into_iter()
        .map(|node| {
            Keel::spawn_with(
                node,
                clocks[node].apply(Command::new(keel).args(procs::shared_disk_agent_args(
                    &store,
                    node,
                    &dir(node),
                    &disks,
                    &guest_dir,
                ))),
            )
        })
        .collect();
    let logs = || procs::all_logs(&cp, &agents);
    let server = serving_url(&cp).await;
    wait_nodes(&root, &server, 2, logs).await;
    for vm in VMS {
        let out = cli(
            &root,
            &server,
            &[
                "vm", "create", vm, "--memory", "128", "--disk", "data:16", "--policy", "AlwaysOn",
            ],
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut placed: BTreeMap<&str, Placement> = BTreeMap::new();
    for vm in VMS {
        let (node, instance) = procs::wait_running(&root, &server, vm, logs).await;
        let pid = qemu_pid(&root, &instance).unwrap_or_else(|| panic!("no QEMU of {instance}"));
        let events = events_of(&root, &server, vm);
        placed.insert(
            vm,
            Placement {
                node,
                instance,
                pid,
                events,
            },
        );
    }
    eprintln!(
        "clock steps: cluster up in {:?}: {placed:?}",
        began.elapsed()
    );
    // The agent frozen in 2 runs the first VM; the one stepped forward in 1
    // is the other node (with the second VM, if placement spread them).
    let frozen = placed[VMS[0]].node.clone();
    let forward = if frozen == "n1" { "n2" } else { "n1" };

    let max_seen: Arc<Mutex<BTreeMap<String, usize>>> = Arc::default();
    let stop_sampling = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (root, max_seen, stop) = (root.clone(), max_seen.clone(), stop_sampling.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                for vm in VMS {
                    let n = qemus_of(&root, vm).len();
                    let mut max = max_seen.lock().unwrap();
                    let seen = max.entry(vm.to_string()).or_default();
                    *seen = (*seen).max(n);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    // Every VM where it was, as it was, its QEMU the same process.
    let unmoved = |when: &str| {
        for (vm, was) in &placed {
            let now = vm_json(&root, &server, vm);
            let inst = now.as_ref().map(|v| &v["status"]["instance"]);
            let same = now
                .as_ref()
                .is_some_and(|v| v["status"]["phase"] == "Running")
                && inst.is_some_and(|i| i["id"] == was.instance.as_str())
                && inst.is_some_and(|i| i["node"] == was.node.as_str())
                && qemu_pid(&root, &was.instance) == Some(was.pid);
            assert!(
                same,
                "{when}: {vm} moved, restarted or was fenced (was {was:?}; \
                 QEMU now {:?}): {now:?}\n{}",
                qemu_pid(&root, &was.instance),
                logs()
            );
        }
    };
    let mut faults = 0;

    // 1. The control plane and one agent jump 90 s forward. A VM created
    // just before and one just after (stopped: nothing to boot) make the
    // leader look at the nodes twice within a heartbeat period, across the
    // step: a node's heartbeat seen unchanged then is 90 s of silence to a
    // leader that counts it on its wall clock.
    let create_stopped = |vm: &str| {
        let out = cli(&root, &server, &["vm", "create", vm, "--stopped"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    create_stopped("clkstep-before");
    wait_vm(
        &root,
        &server,
        "clkstep-before",
        "be placed",
        Duration::from_secs(10),
        |vm| !vm["status"]["node"].is_null(),
        logs,
    )
    .await;
    clocks["cp"].step(90);
    clocks[forward].step(90);
    faults += 2;
    let stepped = Instant::now();
    create_stopped("clkstep-after");
    eprintln!("clock steps: cp and {forward} +90 s");
    while stepped.elapsed() < WATCH_AFTER_STEP {
        unmoved(&format!(
            "after the control plane and {forward} stepped +90 s"
        ));
        tokio::time::sleep(Duration::from_secs(1)).await;
    }

    // 2. A freeze, and the frozen agent's clock jumps back 90 s.
    let instance = placed[VMS[0]].instance.clone();
    let lease = lease_file(&root, &instance);
    let requested = boottime_ms();
    let out = cli(
        &root,
        &server,
        &["node", "freeze", &frozen, "--for", &format!("{FREEZE_S}s")],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The freeze was written before the API answered, so no observer saw
    // it before then: none counts its end before this, and the lease must
    // never reach past it. (The agent counts from its last heartbeat before
    // the write, which may come after the request was sent.)
    let answered = boottime_ms();
    let observers_end = answered + FREEZE_S * 1000;
    let honoured = Instant::now();
    while lease_deadline(&lease) < boottime_ms() + SELF_FENCE_MS + 5_000 {
        assert!(
            honoured.elapsed() < Duration::from_secs(15),
            "{frozen} never extended its lease for the freeze\n{}",
            logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    clocks[&*frozen].step(-90);
    faults += 1;
    eprintln!(
        "clock steps: {frozen} frozen for {FREEZE_S} s (the API answered in {} ms), its lease \
         extended {:?} after; then its clock -90 s",
        answered - requested,
        honoured.elapsed()
    );
    let mut longest = 0;
    let cleared = loop {
        // Each heartbeat renews the normal window too (observers count 40 s
        // of silence from it); beyond both, the lease would outlive the
        // observers' count.
        let deadline = lease_deadline(&lease);
        longest = longest.max(deadline);
        let allowed = observers_end.max(boottime_ms() + SELF_FENCE_MS);
        assert!(
            deadline <= allowed + 500,
            "the fence lease reaches {} ms past the freeze's end as observers count it \
             (the wall clock stepped back must not stretch it)\n{}",
            deadline as i64 - allowed as i64,
            logs()
        );
        unmoved("during the freeze, its agent's clock stepped -90 s");
        if node_freeze(&root, &server, &frozen).is_null() {
            break boottime_ms();
        }
        assert!(
            boottime_ms() < observers_end + 30_000,
            "the freeze was never cleared\n{}",
            logs()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    eprintln!(
        "clock steps: freeze cleared {} ms after its end as observers count it; the lease \
         reached at most {} ms after the API answered",
        cleared as i64 - observers_end as i64,
        longest as i64 - answered as i64
    );
    // Back to the normal lease (the next heartbeat renews it), and still
    // nothing moves for a while after.
    let after = Instant::now();
    while after.elapsed() < Duration::from_secs(10) {
        assert!(
            lease_deadline(&lease) <= boottime_ms() + SELF_FENCE_MS + 500,
            "the lease still reaches past the normal window after the freeze\n{}",
            logs()
        );
        unmoved("after the freeze");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    stop_sampling.store(true, Ordering::Relaxed);
    sampler.join().unwrap();
    let max = max_seen.lock().unwrap().clone();
    let worst = max.values().copied().max().unwrap_or(0);
    let converged = VMS
        .iter()
        .filter(|vm| {
            let recorded = vm_json(&root, &server, vm)
                .and_then(|v| v["status"]["instance"]["id"].as_str().map(String::from));
            recorded.is_some_and(|id| qemus_of(&root, vm) == [id])
        })
        .count();
    let lost = ["clkstep-before", "clkstep-after"]
        .iter()
        .chain(VMS.iter())
        .filter(|vm| vm_json(&root, &server, vm).is_none())
        .count();
    // Nothing had to be fenced: every guest killed or restarted counts.
    let killed = placed
        .values()
        .filter(|was| qemu_pid(&root, &was.instance) != Some(was.pid))
        .count();
    let new_events: Vec<String> = placed
        .iter()
        .filter(|(vm, was)| events_of(&root, &server, vm) != was.events)
        .map(|(vm, _)| vm.to_string())
        .collect();
    eprintln!(
        "nemesis clock-step: faults {faults}, most instances of one VM at once {worst}, \
         VMs converged {converged}/{}, records lost {lost}, guests killed nobody had to fence \
         {killed}",
        VMS.len()
    );
    eprintln!("clock steps: {:?} in all", began.elapsed());
    let fenced: Vec<String> = ["n1", "n2"]
        .iter()
        .flat_map(|node| std::fs::read_dir(root.join(node).join("node/instances")).ok())
        .flatten()
        .flatten()
        .filter(|e| e.path().join("fenced.json").exists())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    let all = logs();
    assert!(fenced.is_empty(), "keepers fenced {fenced:?}\n{all}");
    for (who, line) in [("cp", "node lease expired"), ("an agent", "self-fence")] {
        assert!(
            !all.contains(line),
            "{who} logged \"{line}\" with every agent healthy\n{all}"
        );
    }
    assert!(worst <= 1, "a VM ran twice at once: {max:?}\n{all}");
    assert_eq!(converged, VMS.len(), "not converged\n{all}");
    assert_eq!(lost, 0, "records lost\n{all}");
    assert_eq!(killed, 0, "guests killed nobody had to fence\n{all}");
    assert!(
        new_events.is_empty(),
        "phase changes recorded for {new_events:?}\n{all}"
    );
    drop(etcd);
}
