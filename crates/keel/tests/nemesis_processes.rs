//! The nemesis suite: faults a real cluster has, one after another on one
//! cluster of real processes (a control plane and three node agents, each
//! a `keel` process, with three real QEMU test guests on a disk directory
//! the nodes share). Every process reaches etcd only through a TCP proxy
//! of its own (`procs::tcp_proxy`) that the test controls.
//!
//! - `store-latency`: every proxy delays each chunk both ways by a seeded
//!   time of up to 1.5 s. Nothing is fenced, nothing moves.
//! - `black-hole`: one agent's proxy holds every byte without closing
//!   anything. Its guests are fenced, and only then started on the other
//!   nodes; after the heal one QEMU per VM, and what a guest wrote to its
//!   disk before is there.
//! - `hung-monitor-stop`: a VM's QEMU is SIGSTOPped (its monitor answers
//!   nothing) and the VM stopped: the QEMU is killed by pid when the grace
//!   period ends.
//! - `hung-monitor-migration`: a VM's QEMU is SIGSTOPped while a drain's
//!   live migration of it is sending: the migration fails at its recorded
//!   deadline, the drain's fallback stop kills the QEMU by pid, and the
//!   VM runs on another node.
//! - `stalled-disk`: one agent's data dir (a FUSE mount, `procs::stall_fs`)
//!   hangs while its heartbeat goes on: nothing is killed, nothing moves.
//! - `stalled-disk-cut-off`: that stall and a black hole at once: the
//!   guests are fenced all the same, then run elsewhere.
//!
//! The process table is sampled every 100 ms throughout. After each
//! nemesis everything is healed, the cluster must converge, and one line
//! is printed: `nemesis <name>: faults <n>, most instances of one VM at
//! once <k>, VMs converged <a>/<b>, records lost <r>, guests killed nobody
//! had to fence <g>` (k ≤ 1, a = b, r = 0, g = 0 asserted). A guest
//! "nobody had to fence" is a QEMU that disappeared while its node was
//! not cut off and nobody had asked its VM to stop or move.
//!
//! `KEEL_NEMESIS_SEED=<n>` replays a run's choices (which agent, which VM,
//! the delays; the rng is drawn in the nemeses' order, so replay a seed
//! with the same `KEEL_NEMESIS_ONLY`, a comma list of names that runs just
//! those). Needs etcd (`KEEL_ETCD_ENDPOINT`, else the one of
//! `scripts/start-etcd`), QEMU and the test guest. `scripts/test` runs it
//! with the workspace's ignored tests; by hand: `cargo test -p keel --test
//! nemesis_processes -- --ignored --nocapture`.

mod procs;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use procs::member::{env_u64, free_port, members_logs, Member};
use procs::stall_fs::StallableDir;
use procs::tcp_proxy::{ProxyMode, TcpProxy};
use procs::{cli, processes_naming, qemus_of, vm_json, Workdir};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::Value;

const VMS: [&str; 3] = ["nem0", "nem1", "nem2"];
const AGENTS: [&str; 3] = ["n1", "n2", "n3"];
/// The VMs' stop grace period: a hung QEMU is killed when it ends.
const GRACE_S: u64 = 10;
/// Bounds every wait for the cluster to settle.
const CONVERGE: Duration = Duration::from_secs(120);

/// One QEMU seen in the process table.
#[derive(Clone, Debug)]
struct Qemu {
    vm: String,
    instance: String,
    node: String,
    /// Started as a migration's target (`-incoming`).
    incoming: bool,
}

/// What the sampler has seen since the last [`Watch::take`].
#[derive(Default)]
struct Tally {
    most_at_once: usize,
    /// QEMUs gone while their node was cut off or their VM asked to stop
    /// or move.
    needed_kills: usize,
    needless_kills: Vec<String>,
}

/// The sampler's view and what the test tells it is expected.
#[derive(Default)]
struct Watch {
    tally: Mutex<Tally>,
    /// Nodes under a nemesis that is meant to end their guests.
    excused_nodes: Mutex<BTreeSet<String>>,
    /// VMs asked to stop or to move.
    excused_vms: Mutex<BTreeSet<String>>,
    /// VMs in a live migration: a target started `-incoming` is not an
    /// instance of its own until the migration is over.
    migrating: Mutex<BTreeSet<String>>,
    stop: AtomicBool,
}

impl Watch {
    fn take(&self) -> Tally {
        std::mem::take(&mut *self.tally.lock().unwrap())
    }

    fn excuse_node(&self, node: &str, on: bool) {
        toggle(&self.excused_nodes, node, on);
    }

    fn excuse_vm(&self, vm: &str, on: bool) {
        toggle(&self.excused_vms, vm, on);
    }
}

fn toggle(set: &Mutex<BTreeSet<String>>, item: &str, on: bool) {
    let mut set = set.lock().unwrap();
    if on {
        set.insert(item.to_string());
    } else {
        set.remove(item);
    }
}

/// The QEMUs of this test, by pid.
fn qemus(root: &Path) -> BTreeMap<i32, Qemu> {
    let root = root.to_string_lossy().into_owned();
    processes_naming(&root)
        .into_iter()
        .filter(|(_, c)| c.starts_with("qemu-system"))
        .filter_map(|(pid, c)| {
            let instance = c.split("guest=").nth(1)?.split_whitespace().next()?;
            let vm = VMS
                .iter()
                .find(|vm| instance.starts_with(&format!("{vm}-")))?;
            let node = AGENTS
                .iter()
                .find(|n| c.contains(&format!("{root}/{n}/")))
                .map_or("?", |n| n);
            Some((
                pid,
                Qemu {
                    vm: vm.to_string(),
                    instance: instance.to_string(),
                    node: node.to_string(),
                    incoming: c.split_whitespace().any(|a| a == "-incoming"),
                },
            ))
        })
        .collect()
}

fn sample_forever(root: PathBuf, watch: Arc<Watch>) {
    let mut before = qemus(&root);
    while !watch.stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(100));
        let now = qemus(&root);
        let migrating = watch.migrating.lock().unwrap().clone();
        let mut tally = watch.tally.lock().unwrap();
        for vm in VMS {
            let at_once = now
                .values()
                .filter(|q| q.vm == vm && !(q.incoming && migrating.contains(vm)))
                .count();
            tally.most_at_once = tally.most_at_once.max(at_once);
        }
        let excused_nodes = watch.excused_nodes.lock().unwrap().clone();
        let excused_vms = watch.excused_vms.lock().unwrap().clone();
        for (pid, q) in &before {
            if now.contains_key(pid) {
                continue;
            }
            if excused_nodes.contains(&q.node) || excused_vms.contains(&q.vm) {
                tally.needed_kills += 1;
            } else {
                tally
                    .needless_kills
                    .push(format!("{} (pid {pid}) on {}", q.instance, q.node));
            }
        }
        drop(tally);
        before = now;
    }
}

/// Alive and not a zombie (a killed child its keeper has not reaped yet is
/// gone).
fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().next())
            .is_some_and(|state| !matches!(state, "Z" | "X" | "x"))
    })
}

fn signal(pid: i32, sig: libc::c_int) {
    // SAFETY: kill(2) of a QEMU of this test (its command line names the
    // test's own directory).
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill {pid}");
}

struct Cluster {
    root: PathBuf,
    server: String,
    members: Vec<Member>,
    /// Each member's way to etcd, by member name.
    proxies: BTreeMap<String, TcpProxy>,
    /// Each agent's data dir, on a disk that can stall; empty (and why)
    /// where that cannot be had.
    stalls: Result<BTreeMap<String, StallableDir>, String>,
    watch: Arc<Watch>,
    rng: ChaCha8Rng,
}

/// What one nemesis did, for its line.
struct Outcome {
    faults: usize,
}

impl Cluster {
    fn logs(&self) -> String {
        members_logs(&self.members)
    }

    fn cli_ok(&self, args: &[&str]) -> String {
        let out = cli(&self.root, &self.server, args);
        assert!(
            out.status.success(),
            "keel {args:?}: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            self.logs()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn vm(&self, name: &str) -> Option<Value> {
        vm_json(&self.root, &self.server, name)
    }

    /// The VM's recorded (node, instance), if it runs.
    fn placement(&self, name: &str) -> Option<(String, String)> {
        let vm = self.vm(name)?;
        let inst = &vm["status"]["instance"];
        (vm["status"]["phase"] == "Running").then(|| {
            (
                inst["node"].as_str().unwrap_or_default().to_string(),
                inst["id"].as_str().unwrap_or_default().to_string(),
            )
        })
    }

    /// VMs Running with exactly their recorded instance's QEMU.
    fn converged(&self) -> usize {
        VMS.iter()
            .filter(|vm| {
                self.placement(vm)
                    .is_some_and(|(_, id)| qemus_of(&self.root, vm) == [id])
            })
            .count()
    }

    async fn wait_converged(&self, within: Duration) -> usize {
        let deadline = Instant::now() + within;
        loop {
            let done = self.converged();
            if done == VMS.len() || Instant::now() >= deadline {
                return done;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    async fn wait_for(&self, what: &str, within: Duration, mut done: impl FnMut(&Self) -> bool) {
        let deadline = Instant::now() + within;
        while !done(self) {
            // Two instances end the test at once, whatever it waits for.
            let most = self.watch.tally.lock().unwrap().most_at_once;
            assert!(
                most <= 1,
                "a VM ran twice at once ({most} QEMUs) while waiting for: {what}\n{}\n{}",
                self.vms_text(),
                self.logs()
            );
            assert!(
                Instant::now() < deadline,
                "not within {within:?}: {what}\n{}\n{}",
                self.vms_text(),
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn vms_text(&self) -> String {
        VMS.iter()
            .map(|vm| format!("{vm}: {:?}", self.vm(vm)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn records_present(&self) -> usize {
        let out = cli(&self.root, &self.server, &["vm", "list", "-o", "json"]);
        let list: Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        list["items"].as_array().map_or(0, Vec::len)
    }

    /// Heals, converges, prints the nemesis's line and asserts it.
    async fn finish(&self, name: &str, outcome: Outcome) {
        for proxy in self.proxies.values() {
            proxy.set(ProxyMode::Forward);
        }
        let converged = self.wait_converged(CONVERGE).await;
        let tally = self.watch.take();
        let lost = VMS.len() - self.records_present().min(VMS.len());
        println!(
            "nemesis {name}: faults {}, most instances of one VM at once {}, VMs converged {converged}/{}, \
             records lost {lost}, guests killed nobody had to fence {}",
            outcome.faults,
            tally.most_at_once,
            VMS.len(),
            tally.needless_kills.len()
        );
        println!(
            "nemesis {name}: guests ended as the nemesis required (fenced, or stopped as asked) {}",
            tally.needed_kills
        );
        let detail = || format!("{}\n{}", self.vms_text(), self.logs());
        assert!(
            tally.most_at_once <= 1,
            "{name}: a VM ran twice at once\n{}",
            detail()
        );
        assert_eq!(lost, 0, "{name}: records lost\n{}", detail());
        assert_eq!(converged, VMS.len(), "{name}: not converged\n{}", detail());
        assert!(
            tally.needless_kills.is_empty(),
            "{name}: guests killed nobody had to fence: {:?}\n{}",
            tally.needless_kills,
            detail()
        );
    }

    /// Where each VM runs now (node, instance).
    fn placements(&self) -> BTreeMap<String, (String, String)> {
        VMS.iter()
            .filter_map(|vm| Some((vm.to_string(), self.placement(vm)?)))
            .collect()
    }
}

/// Every proxy delays each chunk, both ways, by a seeded time well below
/// the lease: nothing may be fenced or moved.
async fn store_latency(c: &mut Cluster) {
    let before = c.placements();
    let min = Duration::from_millis(c.rng.gen_range(200..=400));
    let max = Duration::from_millis(c.rng.gen_range(900..=1500));
    let window = Duration::from_secs(env_u64("KEEL_NEMESIS_LATENCY_SECONDS", 30));
    eprintln!("nemesis store-latency: {min:?}..{max:?} per chunk, every process, for {window:?}");
    for proxy in c.proxies.values() {
        proxy.set(ProxyMode::Delay { min, max });
    }
    tokio::time::sleep(window).await;
    let faults = c.proxies.len();
    for proxy in c.proxies.values() {
        proxy.set(ProxyMode::Forward);
    }
    c.finish("store-latency", Outcome { faults }).await;
    assert_eq!(
        c.placements(),
        before,
        "store latency moved or restarted a VM\n{}",
        c.logs()
    );
}

/// A node that runs a VM, chosen by the seed.
fn busy_node(c: &mut Cluster) -> String {
    let placed = c.placements();
    let busy: Vec<&str> = AGENTS
        .into_iter()
        .filter(|n| placed.values().any(|(node, _)| node == n))
        .collect();
    busy[c.rng.gen_range(0..busy.len())].to_string()
}

/// One agent is cut off from etcd, alive (and with `stalled`, its data
/// disk hangs too): its guests are fenced, then run elsewhere, and their
/// disks are intact.
async fn black_hole(c: &mut Cluster, name: &str, stalled: bool) {
    let placed = c.placements();
    let node = busy_node(c);
    let victims: Vec<(String, String)> = placed
        .iter()
        .filter(|(_, (n, _))| *n == node)
        .map(|(vm, (_, id))| (vm.clone(), id.clone()))
        .collect();
    let token = format!("nemesis-{}", c.rng.gen::<u32>());
    for (_, instance) in &victims {
        let mut guest = procs::guest_channel(&c.root.join(&node), instance).await;
        guest.put(1, &token).await.unwrap();
    }
    eprintln!("nemesis {name}: cutting {node} (runs {victims:?}) off etcd");
    c.watch.excuse_node(&node, true);
    let cut_at = Instant::now();
    if stalled {
        c.stalls.as_ref().unwrap()[&node].stall();
    }
    c.proxies[&node].set(ProxyMode::BlackHole);
    c.wait_for(
        "the cut-off node's guests fenced",
        Duration::from_secs(60),
        |c| qemus(&c.root).values().all(|q| q.node != node),
    )
    .await;
    let fenced_after = cut_at.elapsed();
    c.wait_for(
        "the cut-off node's VMs running elsewhere",
        Duration::from_secs(120),
        |c| {
            victims.iter().all(|(vm, _)| {
                c.placement(vm)
                    .is_some_and(|(n, id)| n != node && qemus_of(&c.root, vm) == [id])
            })
        },
    )
    .await;
    let moved_after = cut_at.elapsed();
    eprintln!(
        "nemesis {name}: {node}'s guests fenced after {fenced_after:?}, running elsewhere after {moved_after:?}"
    );
    c.proxies[&node].set(ProxyMode::Forward);
    if stalled {
        c.stalls.as_ref().unwrap()[&node].resume();
    }
    // Back, the agent must end nothing and start nothing of the VMs it
    // lost: its node stays excused only until the cluster has converged.
    let converged = c.wait_converged(CONVERGE).await;
    c.watch.excuse_node(&node, false);
    assert_eq!(
        converged,
        VMS.len(),
        "not converged after the heal\n{}",
        c.logs()
    );
    for (vm, _) in &victims {
        let (now_on, instance) = c.placement(vm).unwrap();
        let mut guest = procs::guest_channel(&c.root.join(&now_on), &instance).await;
        assert_eq!(
            guest.get(1).await.unwrap(),
            token,
            "{vm}'s disk lost what its guest wrote before the cut"
        );
    }
    let faults = if stalled { 2 } else { 1 };
    c.finish(name, Outcome { faults }).await;
}

/// One agent's data disk stalls while its heartbeat goes on: nothing is
/// killed, nothing moves.
async fn stalled_disk(c: &mut Cluster) {
    let before = c.placements();
    let node = busy_node(c);
    let window = Duration::from_secs(env_u64("KEEL_NEMESIS_STALL_SECONDS", 30));
    eprintln!("nemesis stalled-disk: {node}'s data disk stalls for {window:?}");
    let stall = &c.stalls.as_ref().unwrap()[&node];
    stall.stall();
    tokio::time::sleep(window).await;
    stall.resume();
    c.finish("stalled-disk", Outcome { faults: 1 }).await;
    assert_eq!(
        c.placements(),
        before,
        "a stalled data disk moved or restarted a VM\n{}",
        c.logs()
    );
}

/// A VM's QEMU stops answering its monitor, and the VM is stopped: the
/// QEMU is killed by pid when the grace period ends.
async fn hung_monitor_stop(c: &mut Cluster) {
    let vm = VMS[c.rng.gen_range(0..VMS.len())];
    let (_, instance) = c.placement(vm).expect("running");
    let pid = *qemus(&c.root)
        .iter()
        .find(|(_, q)| q.instance == instance)
        .expect("its QEMU")
        .0;
    c.watch.excuse_vm(vm, true);
    signal(pid, libc::SIGSTOP);
    let asked = Instant::now();
    c.cli_ok(&["vm", "stop", vm]);
    c.wait_for(
        "the hung QEMU killed",
        Duration::from_secs(GRACE_S + 30),
        |_| !alive(pid),
    )
    .await;
    let killed_after = asked.elapsed();
    eprintln!("nemesis hung-monitor-stop: {instance}'s QEMU (SIGSTOPped) killed {killed_after:?} after vm stop");
    assert!(
        killed_after >= Duration::from_secs(GRACE_S - 1),
        "killed before the grace period ended: {killed_after:?}"
    );
    c.wait_for("stopped", Duration::from_secs(30), |c| {
        c.vm(vm).is_some_and(|v| v["status"]["phase"] == "Stopped")
    })
    .await;
    c.cli_ok(&["vm", "start", vm]);
    let converged = c.wait_converged(CONVERGE).await;
    c.watch.excuse_vm(vm, false);
    assert_eq!(converged, VMS.len(), "not converged\n{}", c.logs());
    c.finish("hung-monitor-stop", Outcome { faults: 1 }).await;
}

fn migrations_of(c: &Cluster, vm: &str) -> Vec<Value> {
    let out = cli(&c.root, &c.server, &["migration", "list", vm, "-o", "json"]);
    let list: Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    list["items"]
        .as_array()
        .map(|items| items.iter().map(|i| i["migration"].clone()).collect())
        .unwrap_or_default()
}

/// A VM's QEMU stops answering while a drain's migration of it sends:
/// the migration ends at its deadline, the drain's stop kills the QEMU by
/// pid, and the VM runs elsewhere.
async fn hung_monitor_migration(c: &mut Cluster) {
    let vm = VMS[c.rng.gen_range(0..VMS.len())];
    let (node, instance) = c.placement(vm).expect("running");
    let pid = *qemus(&c.root)
        .iter()
        .find(|(_, q)| q.instance == instance)
        .expect("its QEMU")
        .0;
    let on_node: Vec<String> = c
        .placements()
        .into_iter()
        .filter(|(_, (n, _))| *n == node)
        .map(|(vm, _)| vm)
        .collect();
    for other in &on_node {
        c.watch.excuse_vm(other, true);
        toggle(&c.watch.migrating, other, true);
    }
    let known: BTreeSet<String> = migrations_of(c, vm)
        .iter()
        .filter_map(|m| m["id"].as_str().map(String::from))
        .collect();
    // A slow stream (1 MiB/s) keeps the migration sending when the
    // monitor hangs; short timeouts make its recorded deadline 12 s, and
    // short windows bring the drain's fallback stop soon after.
    c.cli_ok(&[
        "node",
        "drain",
        &node,
        "--bandwidth",
        "1",
        "--completion-timeout-per-gib",
        "8",
        "--progress-timeout",
        "4",
        "--submit-window",
        "30s",
        "--migrate-window",
        "30s",
        "--fallback-window",
        "30s",
    ]);
    let mut migration = String::new();
    c.wait_for("the migration sending", Duration::from_secs(60), |c| {
        let running = migrations_of(c, vm).into_iter().find(|m| {
            m["status"]["phase"] == "Running"
                && m["id"].as_str().is_some_and(|id| !known.contains(id))
        });
        if let Some(m) = running {
            migration = m["id"].as_str().unwrap().to_string();
        }
        !migration.is_empty()
    })
    .await;
    signal(pid, libc::SIGSTOP);
    let hung = Instant::now();
    eprintln!(
        "nemesis hung-monitor-migration: {instance}'s QEMU SIGSTOPped while {migration} sends"
    );
    let mut ended = Value::Null;
    c.wait_for("the migration ended", Duration::from_secs(60), |c| {
        ended = migrations_of(c, vm)
            .into_iter()
            .find(|m| m["id"] == migration.as_str())
            .unwrap_or_default();
        ended["status"]["phase"] == "Failed" || ended["status"]["phase"] == "Succeeded"
    })
    .await;
    let ended_after = hung.elapsed();
    assert_eq!(
        ended["status"]["phase"], "Failed",
        "a migration whose source hung: {ended}"
    );
    c.wait_for("the hung source killed", Duration::from_secs(60), |_| {
        !alive(pid)
    })
    .await;
    let killed_after = hung.elapsed();
    eprintln!(
        "nemesis hung-monitor-migration: {migration} failed {ended_after:?} after the hang ({}), \
         the source killed after {killed_after:?}",
        ended["status"]["message"]
    );
    c.wait_for("the VM running elsewhere", CONVERGE, |c| {
        c.placement(vm)
            .is_some_and(|(n, id)| n != node && qemus_of(&c.root, vm) == [id])
    })
    .await;
    c.cli_ok(&["node", "uncordon", &node]);
    let converged = c.wait_converged(CONVERGE).await;
    for other in &on_node {
        c.watch.excuse_vm(other, false);
        toggle(&c.watch.migrating, other, false);
    }
    assert_eq!(converged, VMS.len(), "not converged\n{}", c.logs());
    c.finish("hung-monitor-migration", Outcome { faults: 1 })
        .await;
}

fn etcd_addr() -> SocketAddr {
    let endpoint =
        std::env::var("KEEL_ETCD_ENDPOINT").unwrap_or_else(|_| "http://127.0.0.1:2379".into());
    let host = endpoint.trim_start_matches("http://").trim_end_matches('/');
    host.to_socket_addrs().unwrap().next().unwrap()
}

// Ignored by a plain `cargo test` (minutes long); `scripts/test` runs it
// with the ignored tests, and nextest prints its figures even on a pass
// (`.config/nextest.toml`). By hand: `-- --ignored --nocapture`.
#[ignore = "minutes long: scripts/test runs it with the ignored tests"]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nemeses_never_run_a_vm_twice_kill_a_guest_for_nothing_or_lose_a_record() {
    let Some(work) = Workdir::start("nemesis") else {
        return;
    };
    let seed = env_u64("KEEL_NEMESIS_SEED", rand::random::<u16>() as u64);
    eprintln!("nemesis suite: seed {seed} (replay with KEEL_NEMESIS_SEED={seed})");
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let began = Instant::now();

    let root = work.root.clone();
    let etcd = etcd_addr();
    // The store spec with this test's namespace, its host replaced by
    // each member's own proxy.
    let namespace = work
        .store
        .trim_start_matches("etcd://")
        .split_once('/')
        .unwrap()
        .1
        .to_string();
    let mut proxies = BTreeMap::new();
    let mut members = Vec::new();
    let cp_addr = format!("127.0.0.1:{}", free_port());
    let stalls: Result<BTreeMap<String, StallableDir>, String> = AGENTS
        .iter()
        .map(|n| Ok((n.to_string(), StallableDir::mount(&root.join(n))?)))
        .collect();
    for name in std::iter::once("cp").chain(AGENTS) {
        let proxy = TcpProxy::start(etcd, rng.gen());
        let store = format!("etcd://{}/{namespace}", proxy.addr);
        proxies.insert(name.to_string(), proxy);
        let data_dir = work.dir(name);
        let args: Vec<String> = if name == "cp" {
            std::iter::once("serve".to_string())
                .chain(procs::store_flags(&store))
                .chain(
                    [
                        "--listen",
                        &cp_addr,
                        "--node",
                        "cp",
                        "--data-dir",
                        &data_dir,
                    ]
                    .into_iter()
                    .map(String::from),
                )
                .collect()
        } else {
            procs::shared_disk_agent_args(
                &store,
                name,
                &data_dir,
                &work.dir("disks"),
                &work.guest_dir,
            )
        };
        let mut member = Member::new(name, args);
        member.start();
        members.push(member);
    }
    let watch = Arc::new(Watch::default());
    let mut c = Cluster {
        root: root.clone(),
        server: format!("https://{cp_addr}"),
        members,
        proxies,
        stalls,
        watch: watch.clone(),
        rng,
    };
    procs::wait_nodes(&root, &c.server, AGENTS.len(), || c.logs()).await;
    for vm in VMS {
        c.cli_ok(&[
            "vm",
            "create",
            vm,
            "--memory",
            "128",
            "--disk",
            "data:16",
            "--grace",
            &GRACE_S.to_string(),
        ]);
    }
    let converged = c.wait_converged(CONVERGE).await;
    assert_eq!(converged, VMS.len(), "VMs never all ran\n{}", c.logs());
    eprintln!("nemesis suite: cluster up after {:?}", began.elapsed());

    let sampler = {
        let (root, watch) = (root.clone(), watch.clone());
        std::thread::spawn(move || sample_forever(root, watch))
    };
    let timed =
        |name: &str, since: Instant| eprintln!("nemesis {name}: took {:?}", since.elapsed());
    // `KEEL_NEMESIS_ONLY=black-hole,...` runs just those, to replay one.
    let only = std::env::var("KEEL_NEMESIS_ONLY").unwrap_or_default();
    let wanted = |name: &str| only.is_empty() || only.split(',').any(|n| n.trim() == name);
    if wanted("store-latency") {
        let at = Instant::now();
        store_latency(&mut c).await;
        timed("store-latency", at);
    }
    if wanted("black-hole") {
        let at = Instant::now();
        black_hole(&mut c, "black-hole", false).await;
        timed("black-hole", at);
    }
    for name in ["stalled-disk", "stalled-disk-cut-off"] {
        if !wanted(name) {
            continue;
        }
        if let Err(why) = &c.stalls {
            eprintln!("nemesis {name}: skipped, no disk that can stall here: {why}");
            continue;
        }
        let at = Instant::now();
        if name == "stalled-disk" {
            stalled_disk(&mut c).await;
        } else {
            black_hole(&mut c, name, true).await;
        }
        timed(name, at);
    }
    if wanted("hung-monitor-stop") {
        let at = Instant::now();
        hung_monitor_stop(&mut c).await;
        timed("hung-monitor-stop", at);
    }
    if wanted("hung-monitor-migration") {
        let at = Instant::now();
        hung_monitor_migration(&mut c).await;
        timed("hung-monitor-migration", at);
    }
    watch.stop.store(true, Ordering::Relaxed);
    sampler.join().unwrap();
    eprintln!("nemesis suite: seed {seed}, {:?} in all", began.elapsed());
}
