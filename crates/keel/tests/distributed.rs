//! Distributed mode against a real etcd: two control planes (`keel serve
//! --store etcd://…`) and two sim node agents (`keel agent`) in one
//! process, each with its own tasks. Killing one aborts its tasks: nothing
//! is revoked, its leader lease (if any) runs out on its own.
//!
//! The etcd is at `KEEL_ETCD_ENDPOINT` (default `http://127.0.0.1:2379`);
//! start one with `scripts/start-etcd`. `KEEL_SKIP_ETCD_TESTS=1` skips
//! these tests. Every test uses its own etcd namespace.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use keel::agent::{self, AgentConfig, RunningAgent};
use keel::args::HypervisorKind;
use keel::cli::server_trust::ServerTrust;
use keel::distributed::StoreSpec;
use keel::serve::{self, RunningServer, ServeConfig};
use keel_api::{Clock, EvictionWindows, Node, Phase, SystemClock, VirtualMachine, VmSpec};
use keel_ctrl::keys::{node_key, vm_key};
use keel_ctrl::{ElectionConfig, LeaderElection, LifecycleConfig};
use keel_hv::qemu::tls;
use keel_hv::sim::{SimConfig, SimFabric, SimHypervisor};
use keel_store::etcd::{EtcdOptions, EtcdStore};
use keel_store::{StoreError, TypedStore};

/// How long any one wait may take.
const DEADLINE: Duration = Duration::from_secs(20);
const SAMPLE: Duration = Duration::from_millis(25);

fn endpoint() -> String {
    std::env::var("KEEL_ETCD_ENDPOINT").unwrap_or_else(|_| "http://127.0.0.1:2379".into())
}

fn skipped() -> bool {
    let skip = std::env::var("KEEL_SKIP_ETCD_TESTS").is_ok_and(|v| v == "1");
    if skip {
        eprintln!("KEEL_SKIP_ETCD_TESTS=1: not running the distributed tests");
    }
    skip
}

fn unique_namespace(what: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!(
        "/keel-test/distributed-{what}-{}-{nanos}-{n}",
        std::process::id()
    )
}

fn sim() -> SimConfig {
    SimConfig {
        boot_ms: 100,
        // Long enough to kill the leader while a stop is in flight.
        graceful_shutdown_ms: 1_500,
        migration_ms: 500,
        ..SimConfig::default()
    }
}

fn lifecycle() -> LifecycleConfig {
    LifecycleConfig {
        stop_backoff_initial_ms: 200,
        stop_backoff_max_ms: 400,
        kill_recheck_ms: 100,
        retry_ms: 100,
        start_backoff_initial_ms: 100,
        start_backoff_max_ms: 400,
        boot_settle_ms: 200,
        poll_ms: 100,
        ..LifecycleConfig::default()
    }
}

/// etcd's shortest lease is 2 s.
fn election() -> ElectionConfig {
    ElectionConfig {
        ttl_ms: 2_000,
        safety_margin_ms: 500,
        retry_ms: 100,
    }
}

struct Cluster {
    spec: StoreSpec,
    store: TypedStore,
    fabric: SimFabric,
    dir: tempfile::TempDir,
    planes: BTreeMap<String, RunningServer>,
    agents: BTreeMap<String, RunningAgent>,
    /// Every node's driver, kept after its agent is gone: its guests live on.
    nodes: BTreeMap<String, SimHypervisor>,
}

impl Cluster {
    async fn new(test: &str) -> Option<Self> {
        if skipped() {
            return None;
        }
        let endpoint = endpoint();
        let namespace = unique_namespace(test);
        let options = EtcdOptions {
            request_timeout: Duration::from_secs(3),
            ..EtcdOptions::default()
        };
        let store =
            match EtcdStore::connect_with(std::slice::from_ref(&endpoint), &namespace, options)
                .await
            {
                Ok(store) => store,
                Err(e) => panic!(
                    "etcd at {endpoint} is not reachable ({e}).\n\
                 Start one with `scripts/start-etcd` (or point KEEL_ETCD_ENDPOINT at one), \
                 or set KEEL_SKIP_ETCD_TESTS=1 to skip the etcd tests."
                ),
            };
        let host = endpoint.trim_start_matches("http://");
        let spec: StoreSpec = format!("etcd://{host}{namespace}").parse().unwrap();
        Some(Self {
            spec,
            // Written as every Keel process writes the cluster's store:
            // with each VM record's per-node copies, which agents watch.
            store: TypedStore::new(keel::distributed::with_node_copies(Arc::new(store))),
            fabric: SimFabric::default(),
            dir: tempfile::tempdir().unwrap(),
            planes: BTreeMap::new(),
            agents: BTreeMap::new(),
            nodes: BTreeMap::new(),
        })
    }

    async fn control_plane(&mut self, name: &str) {
        let mut cfg = ServeConfig::new(
            self.dir.path().join(name),
            "127.0.0.1:0".parse().unwrap(),
            HypervisorKind::Sim,
            name.into(),
        );
        cfg.store = self.spec.clone();
        // The shared test etcd keeps its whole history (scripts/start-etcd).
        cfg.etcd_compaction = None;
        cfg.election = election();
        cfg.lifecycle = lifecycle();
        let server = serve::start(cfg).await.expect("control plane starts");
        self.planes.insert(name.into(), server);
    }

    async fn agent(&mut self, node: &str) {
        self.agent_listening(node, None).await
    }

    /// An agent that serves its node's consoles on `listen`, if given.
    async fn agent_listening(&mut self, node: &str, listen: Option<std::net::SocketAddr>) {
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let seed = self.nodes.len() as u64 + 1;
        let hv = SimHypervisor::join(clock, seed, sim(), &self.fabric, node);
        let mut cfg = AgentConfig::new(
            self.spec.clone(),
            self.dir.path().join(node),
            node.into(),
            HypervisorKind::Sim,
        );
        cfg.lifecycle = lifecycle();
        // The sim nodes share one fabric: their disks are shared storage.
        cfg.disk_dir = Some(self.dir.path().join("shared-disks"));
        cfg.listen = listen;
        let agent = agent::start_with_hypervisor(cfg, Arc::new(hv.clone()))
            .await
            .expect("agent starts");
        self.agents.insert(node.into(), agent);
        self.nodes.insert(node.into(), hv);
    }

    fn election(&self, plane: &str) -> Arc<LeaderElection> {
        self.planes[plane].election().expect("etcd mode").clone()
    }

    /// Waits until exactly one control plane leads; returns it.
    async fn leader(&self) -> String {
        wait_for("a leader", || async {
            let leaders: Vec<&String> = self
                .planes
                .iter()
                .filter(|(_, p)| p.election().unwrap().is_leader())
                .map(|(name, _)| name)
                .collect();
            assert!(leaders.len() <= 1, "two leaders: {leaders:?}");
            leaders.first().map(|n| n.to_string())
        })
        .await
    }

    /// Kills a control plane: its tasks end, its lease is not revoked.
    fn kill_plane(&mut self, name: &str) {
        self.planes.remove(name).expect("running").abort();
    }

    fn vm_spec(&self) -> VmSpec {
        VmSpec {
            memory_mib: 64,
            disks: vec![],
            stop_grace_period_s: 30,
            ..keel_testkit::spec::vm_spec()
        }
    }

    async fn create_vm(&self, name: &str) {
        let vm = VirtualMachine::new(name, self.vm_spec());
        self.store.create(&vm_key(name), &vm).await.unwrap();
    }

    async fn vm(&self, name: &str) -> VirtualMachine {
        self.read::<VirtualMachine>(&vm_key(name))
            .await
            .unwrap_or_else(|| panic!("VM {name} has no record"))
    }

    /// The record at `key`, the test's own read: an etcd slow to answer on
    /// a loaded machine (Unavailable) is asked again, within a bound, since
    /// what the test checks is the cluster, not its own reads.
    async fn read<T: serde::de::DeserializeOwned>(&self, key: &str) -> Option<T> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match self.store.get::<T>(key).await {
                Ok(entry) => return entry.map(|e| e.value),
                Err(StoreError::Unavailable { .. }) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("read {key}: {e}"),
            }
        }
    }

    async fn update<T, F>(&self, key: &str, f: F)
    where
        T: serde::Serialize + serde::de::DeserializeOwned,
        F: Fn(&mut T),
    {
        loop {
            let e = self.store.get::<T>(key).await.unwrap().unwrap();
            let mut value = e.value;
            f(&mut value);
            match self.store.update(key, &value, e.revision).await {
                Ok(_) => return,
                Err(StoreError::Conflict { .. }) => continue,
                Err(e) => panic!("update {key}: {e}"),
            }
        }
    }

    /// Waits until `vm` runs; returns its node and instance.
    async fn running(&self, vm: &str) -> (String, String) {
        wait_for(&format!("{vm} running"), || async {
            let v = self.vm(vm).await;
            let inst = v.status.instance.as_ref()?;
            (v.status.phase == Phase::Running && self.executing(vm).len() == 1)
                .then(|| (inst.node.clone(), inst.id.clone()))
        })
        .await
    }

    /// `(node, instance)` of every executing instance of `vm`.
    fn executing(&self, vm: &str) -> Vec<(String, String)> {
        self.nodes
            .iter()
            .flat_map(|(node, hv)| {
                hv.executing_instances(vm)
                    .into_iter()
                    .map(move |i| (node.clone(), i))
            })
            .collect()
    }

    /// No VM ever has two live instances, and no driver saw a violation.
    fn check_one_instance(&self, vms: &[&str]) {
        for vm in vms {
            let live: Vec<(String, String)> = self
                .nodes
                .iter()
                .flat_map(|(node, hv)| {
                    hv.live_instances(vm)
                        .into_iter()
                        .map(move |i| (node.clone(), i))
                })
                .collect();
            let executing = self.executing(vm);
            assert!(
                executing.len() <= 1,
                "VM {vm} executes twice: {executing:?}"
            );
            // A migration target waits (live, not executing) beside its
            // source, and after the handover both may wait at once: the
            // source paused for good, the target paused until the success
            // is recorded. Anything else live twice is a second instance.
            assert!(
                live.len() <= 2,
                "VM {vm} has too many live instances: {live:?}"
            );
        }
        for (node, hv) in &self.nodes {
            assert!(
                hv.violations().is_empty(),
                "node {node}: {:?}",
                hv.violations()
            );
        }
    }

    async fn shutdown(mut self) {
        for (_, plane) in std::mem::take(&mut self.planes) {
            plane.shutdown().await.unwrap();
        }
        for (_, agent) in std::mem::take(&mut self.agents) {
            agent.shutdown().await.unwrap();
        }
    }
}

/// Polls `f` until it yields a value, or panics after [`DEADLINE`].
async fn wait_for<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(start.elapsed() < DEADLINE, "no {what} within {DEADLINE:?}");
        tokio::time::sleep(SAMPLE).await;
    }
}

/// Trusting cp1's and cp2's own certificates.
fn both_planes_trust(c: &Cluster) -> ServerTrust {
    let pins = ["cp1", "cp2"]
        .map(|plane| {
            let path = keel::api_tls::self_signed_cert_path(&c.dir.path().join(plane));
            let fp = keel::cli::server_trust::cert_file_fingerprint(&path).unwrap();
            (fp, keel::cli::server_trust::PinSource::DataDir(path))
        })
        .to_vec();
    let (a, b) = (&pins[0].0, &pins[1].0);
    assert_ne!(a, b, "two control planes share one key");
    ServerTrust::pinned(pins)
}

fn other(planes: [&str; 2], leader: &str) -> String {
    planes
        .into_iter()
        .find(|p| *p != leader)
        .unwrap()
        .to_string()
}

/// (c) A leader is paused (its tasks stop, its lease is not renewed) until
/// its lease has expired and the other control plane leads: the store
/// refuses its guarded writes, and once it runs again it follows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deposed_leader_cannot_write() {
    let started = Instant::now();
    let Some(mut c) = Cluster::new("deposed").await else {
        return;
    };
    c.control_plane("cp1").await;
    c.control_plane("cp2").await;
    let leader = c.leader().await;
    let election = c.election(&leader);
    let guard = election.guard().expect("the leader has a guard");
    c.store
        .create_guarded("/probe", &"leader", &guard)
        .await
        .expect("the leader writes");
    c.kill_plane(&leader);
    let next = c.leader().await;
    assert_ne!(next, leader);
    assert!(
        !election.is_leader(),
        "the paused leader knows its term ran out"
    );
    let probe = c.store.get::<String>("/probe").await.unwrap().unwrap();
    match c
        .store
        .update_guarded("/probe", &"deposed", probe.revision, &guard)
        .await
    {
        Err(StoreError::GuardLost { guard: key }) => assert_eq!(key, guard.key),
        other => panic!("a deposed leader's write: expected GuardLost, got {other:?}"),
    }
    match c.store.create_guarded("/probe2", &"deposed", &guard).await {
        Err(StoreError::GuardLost { .. }) => {}
        other => panic!("expected GuardLost, got {other:?}"),
    }
    assert_eq!(
        c.store
            .get::<String>("/probe")
            .await
            .unwrap()
            .unwrap()
            .value,
        "leader",
        "nothing changed"
    );
    assert!(c.store.get::<String>("/probe2").await.unwrap().is_none());
    // The paused process resumes: its lease is gone, it follows.
    assert!(!election.step().await.unwrap());
    let record = election.leader().await.unwrap().unwrap();
    assert!(record.id.starts_with(&format!("{next}@")), "{record:?}");
    c.shutdown().await;
    eprintln!("a_deposed_leader_cannot_write: {:?}", started.elapsed());
}

/// (d) The leader dies; the other control plane takes over and places a
/// VM created after the change. Both control planes accept one token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placement_continues_after_a_leader_change() {
    let started = Instant::now();
    let Some(mut c) = Cluster::new("placement").await else {
        return;
    };
    c.control_plane("cp1").await;
    c.control_plane("cp2").await;
    // Each control plane's token file is an admin token every control
    // plane accepts, and the store holds only their hashes.
    let (cp1, cp2) = (
        format!("https://{}", c.planes["cp1"].addr()),
        format!("https://{}", c.planes["cp2"].addr()),
    );
    // Each control plane presents its own certificate: the store holds
    // no key to share (a reader of etcd could stand in for the API).
    let trust = both_planes_trust(&c);
    let (t1, t2) = (
        c.planes["cp1"].token().to_string(),
        c.planes["cp2"].token().to_string(),
    );
    let (status, _, _) = get_as(&trust, format!("{cp2}/api/v1/vms"), Some(t1.clone())).await;
    assert_eq!(status, 200, "cp2 accepts cp1's token");
    let (all, _) = c.store.raw().list("/").await.unwrap();
    for entry in all {
        let text = String::from_utf8_lossy(&entry.value);
        assert!(
            !text.contains(&t1) && !text.contains(&t2),
            "{} holds a token in clear",
            entry.key
        );
        assert!(
            !text.contains("PRIVATE KEY"),
            "{} holds a private key",
            entry.key
        );
    }
    // A token made on cp1 works on cp2, and its revocation on cp1 counts
    // on cp2 within a second.
    let (status, body) = send_as(
        &trust,
        "POST",
        format!("{cp1}/api/v1/tokens"),
        &t1,
        Some(serde_json::json!({"name": "ci", "role": "viewer"})),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    let created: serde_json::Value = serde_json::from_str(&body).unwrap();
    let (id, viewer) = (
        created["token"]["id"].as_str().unwrap().to_string(),
        created["secret"].as_str().unwrap().to_string(),
    );
    let (status, _, _) = get_as(&trust, format!("{cp2}/api/v1/vms"), Some(viewer.clone())).await;
    assert_eq!(status, 200, "cp2 accepts a token made on cp1");
    let (status, body) = send_as(
        &trust,
        "DELETE",
        format!("{cp1}/api/v1/tokens/{id}"),
        &t1,
        None,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let revoked_at = Instant::now();
    loop {
        let (status, _, body) =
            get_as(&trust, format!("{cp2}/api/v1/vms"), Some(viewer.clone())).await;
        if status == 401 {
            assert!(body.contains("token revoked"), "{body}");
            break;
        }
        assert!(
            revoked_at.elapsed() < Duration::from_secs(1),
            "cp2 still accepts a token revoked on cp1: {status}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    c.agent("n1").await;
    c.agent("n2").await;
    let leader = c.leader().await;
    c.create_vm("first").await;
    c.running("first").await;

    c.kill_plane(&leader);
    let next = c.leader().await;
    assert_eq!(next, other(["cp1", "cp2"], &leader));
    // Created through the surviving control plane's API.
    let server = &c.planes[&next];
    let (base, token) = (
        format!("https://{}", server.addr()),
        server.token().to_string(),
    );
    let trust = ServerTrust::of_data_dir(&c.dir.path().join(&next)).unwrap();
    let status = tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = trust.agent(
            ureq::Agent::config_builder()
                .http_status_as_error(false)
                .proxy(None)
                .build(),
        );
        let body = serde_json::json!({
            "name": "second",
            "spec": {"cpus": 1, "memory_mib": 64, "run_policy": "AlwaysOnUnlessStoppedManually"},
        });
        agent
            .post(format!("{base}/api/v1/vms"))
            .header("Authorization", format!("Bearer {token}"))
            .header("Content-Type", "application/json")
            .send(body.to_string())
            .map(|r| r.status().as_u16())
            .unwrap()
    })
    .await
    .unwrap();
    assert_eq!(status, 201);
    let (node, _) = c.running("second").await;
    let (first_node, _) = c.running("first").await;
    assert_ne!(node, first_node, "placed on the emptier node");
    c.check_one_instance(&["first", "second"]);
    c.shutdown().await;
    eprintln!(
        "placement_continues_after_a_leader_change: {:?}",
        started.elapsed()
    );
}

/// (a) The leader is killed while a restart is in flight (requested, the
/// old instance stopping): the restart completes, there is never more than
/// one live instance, and the record is intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_survives_the_leader_dying() {
    let started = Instant::now();
    let Some(mut c) = Cluster::new("restart").await else {
        return;
    };
    c.control_plane("cp1").await;
    c.control_plane("cp2").await;
    c.agent("n1").await;
    c.agent("n2").await;
    let leader = c.leader().await;
    c.create_vm("web").await;
    let (node, old) = c.running("web").await;
    let before = c.vm("web").await;

    c.update(&vm_key("web"), |vm: &mut VirtualMachine| {
        vm.request_restart().unwrap();
    })
    .await;
    wait_for("the old instance stopping", || async {
        c.check_one_instance(&["web"]);
        let vm = c.vm("web").await;
        (vm.status.phase == Phase::Stopping).then_some(())
    })
    .await;
    assert!(
        !c.executing("web").is_empty(),
        "the old instance still runs"
    );
    c.kill_plane(&leader);

    let (new_node, new) = wait_for("the restart to complete", || async {
        c.check_one_instance(&["web"]);
        let vm = c.vm("web").await;
        let inst = vm.status.instance.as_ref()?;
        (inst.id != old && vm.status.phase == Phase::Running && c.executing("web").len() == 1)
            .then(|| (inst.node.clone(), inst.id.clone()))
    })
    .await;
    assert_eq!(new_node, node, "a restart stays on its node");
    let vm = c.vm("web").await;
    assert_eq!(c.executing("web"), [(new_node, new)]);
    assert_eq!(vm.name, "web");
    assert_eq!(
        vm.spec.restart_generation,
        before.spec.restart_generation + 1
    );
    assert_eq!(
        vm.status.observed_restart_generation,
        vm.spec.restart_generation
    );
    assert_eq!(
        (
            vm.spec.cpus,
            vm.spec.memory_mib,
            vm.spec.run_policy,
            vm.spec.power
        ),
        (
            before.spec.cpus,
            before.spec.memory_mib,
            before.spec.run_policy,
            before.spec.power
        )
    );
    let exit = vm.status.last_exit.expect("the old instance's exit");
    assert_eq!(exit.instance, old);
    assert!(exit.requested, "{exit:?}");
    c.leader().await;
    c.check_one_instance(&["web"]);
    c.shutdown().await;
    eprintln!(
        "a_restart_survives_the_leader_dying: {:?}",
        started.elapsed()
    );
}

/// (b) Node n1 runs two VMs and is drained; the leader is killed during
/// the drain. The drain completes and both VMs run on n2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_survives_the_leader_dying() {
    let started = Instant::now();
    let Some(mut c) = Cluster::new("drain").await else {
        return;
    };
    c.control_plane("cp1").await;
    c.control_plane("cp2").await;
    c.agent("n1").await;
    let leader = c.leader().await;
    for vm in ["one", "two"] {
        c.create_vm(vm).await;
    }
    for vm in ["one", "two"] {
        assert_eq!(c.running(vm).await.0, "n1");
    }
    c.agent("n2").await;
    let windows = EvictionWindows {
        submit_ms: 10_000,
        migrate_ms: 10_000,
        fallback_ms: 10_000,
    };
    let now = SystemClock.now_ms();
    c.update(&node_key("n1"), |n: &mut Node| {
        n.request_drain(now, windows)
    })
    .await;
    wait_for("an eviction under way", || async {
        c.check_one_instance(&["one", "two"]);
        let mut evicting = false;
        for vm in ["one", "two"] {
            evicting |= c.vm(vm).await.status.eviction.is_some();
        }
        evicting.then_some(())
    })
    .await;
    c.kill_plane(&leader);

    wait_for("the drain to complete", || async {
        c.check_one_instance(&["one", "two"]);
        let n1 = c.read::<Node>(&node_key("n1")).await?;
        let done = n1.drain.as_ref().is_some_and(|d| d.completed_at.is_some());
        let mut on_n2 = true;
        for vm in ["one", "two"] {
            let v = c.vm(vm).await;
            on_n2 &= v.status.phase == Phase::Running
                && v.owner_node() == Some("n2")
                && c.executing(vm).iter().all(|(node, _)| node == "n2");
        }
        (done && on_n2).then_some(())
    })
    .await;
    for vm in ["one", "two"] {
        assert_eq!(c.running(vm).await.0, "n2");
    }
    let n1 = c
        .store
        .get::<Node>(&node_key("n1"))
        .await
        .unwrap()
        .unwrap()
        .value;
    assert!(n1.cordoned && n1.cordoned_by_keel, "{n1:?}");
    c.leader().await;
    c.shutdown().await;
    eprintln!("a_drain_survives_the_leader_dying: {:?}", started.elapsed());
}

/// Two agents claim one node name (two hosts, two data dirs): the second is
/// refused while the first heartbeats, and a restart of the first (same
/// data dir, same incarnation) is welcome at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_agent_with_the_same_node_name_is_refused() {
    let Some(mut c) = Cluster::new("same-name").await else {
        return;
    };
    c.agent("n1").await;
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let hv = SimHypervisor::join(clock, 99, sim(), &SimFabric::default(), "n1");
    let mut impostor = AgentConfig::new(
        c.spec.clone(),
        c.dir.path().join("other-host"),
        "n1".into(),
        HypervisorKind::Sim,
    );
    impostor.lifecycle = lifecycle();
    let t = Instant::now();
    let err = match agent::start_with_hypervisor(impostor, Arc::new(hv)).await {
        Ok(_) => panic!("a second agent for n1 started"),
        Err(e) => format!("{e:#}"),
    };
    assert!(err.contains("in use by another live agent"), "{err}");
    assert!(t.elapsed() < DEADLINE, "took {:?}", t.elapsed());
    let incarnation = c.store.get::<Node>(&node_key("n1")).await.unwrap().unwrap();
    let first = std::fs::read_to_string(c.dir.path().join("n1/incarnation")).unwrap();
    assert_eq!(
        incarnation.value.status.incarnation.as_deref(),
        Some(first.trim()),
        "the record still names the first agent"
    );

    // The first agent restarts on its own data dir: no wait, same name.
    c.agents.remove("n1").unwrap().shutdown().await.unwrap();
    let t = Instant::now();
    c.agent("n1").await;
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
}

/// A request with a bearer token and an optional JSON body: status, body.
async fn send_as(
    trust: &ServerTrust,
    method: &'static str,
    url: String,
    token: &str,
    body: Option<serde_json::Value>,
) -> (u16, String) {
    let token = token.to_string();
    let trust = trust.clone();
    tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = trust.agent(
            ureq::Agent::config_builder()
                .http_status_as_error(false)
                .proxy(None)
                .timeout_global(Some(Duration::from_secs(10)))
                .build(),
        );
        let req = ureq::http::Request::builder()
            .method(method)
            .uri(url)
            .header("Authorization", format!("Bearer {token}"))
            .header("Content-Type", "application/json")
            .body(body.map(|b| b.to_string()).unwrap_or_default())
            .unwrap();
        let mut resp = agent.run(req).unwrap();
        let status = resp.status().as_u16();
        (status, resp.body_mut().read_to_string().unwrap_or_default())
    })
    .await
    .unwrap()
}

/// Rewrites a node record's console URL, as whoever can write the store
/// could.
async fn set_agent_url(store: &TypedStore, node: &str, url: &str) {
    loop {
        let entry = store.get::<Node>(&node_key(node)).await.unwrap().unwrap();
        let mut record = entry.value;
        record.status.agent_url = Some(url.to_string());
        if store
            .update(&node_key(node), &record, entry.revision)
            .await
            .is_ok()
        {
            return;
        }
    }
}

/// A GET with an optional bearer token: status, `X-Keel-Instance`, body.
async fn get_as(
    trust: &ServerTrust,
    url: String,
    token: Option<String>,
) -> (u16, Option<String>, String) {
    let trust = if url.starts_with("https://") {
        trust.clone()
    } else {
        ServerTrust::PlainHttp
    };
    tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = trust.agent(
            ureq::Agent::config_builder()
                .http_status_as_error(false)
                .timeout_global(Some(Duration::from_secs(10)))
                .build(),
        );
        let mut req = agent.get(&url);
        if let Some(t) = &token {
            req = req.header("Authorization", &format!("Bearer {t}"));
        }
        let mut resp = req.call().unwrap();
        let instance = resp
            .headers()
            .get("x-keel-instance")
            .map(|v| v.to_str().unwrap().to_string());
        let body = resp.body_mut().read_to_string().unwrap();
        (resp.status().as_u16(), instance, body)
    })
    .await
    .unwrap()
}

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn console_ws(trust: &ServerTrust, base: &str, vm: &str, token: &str) -> Result<Ws, u16> {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    use tokio_tungstenite::tungstenite::{http::HeaderValue, Error};
    let url = format!(
        "{}/api/v1/vms/{vm}/console",
        base.replace("https://", "wss://")
    );
    let mut req = url.into_client_request().unwrap();
    req.headers_mut().insert(
        "authorization",
        HeaderValue::from_str(&format!("Bearer {token}")).unwrap(),
    );
    let connector = trust
        .client_config()
        .map(tokio_tungstenite::Connector::Rustls);
    match tokio_tungstenite::connect_async_tls_with_config(req, None, false, connector).await {
        Ok((ws, _)) => Ok(ws),
        Err(Error::Http(resp)) => Err(resp.status().as_u16()),
        Err(e) => panic!("console of {vm}: {e}"),
    }
}

/// The refusal (status and body) of a graphical console session.
async fn vnc_refusal(trust: &ServerTrust, base: &str, vm: &str, token: &str) -> (u16, String) {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    use tokio_tungstenite::tungstenite::{http::HeaderValue, Error};
    let url = format!("{}/api/v1/vms/{vm}/vnc", base.replace("https://", "wss://"));
    let mut req = url.into_client_request().unwrap();
    req.headers_mut().insert(
        "authorization",
        HeaderValue::from_str(&format!("Bearer {token}")).unwrap(),
    );
    let connector = trust
        .client_config()
        .map(tokio_tungstenite::Connector::Rustls);
    match tokio_tungstenite::connect_async_tls_with_config(req, None, false, connector).await {
        Ok(_) => panic!("the graphical console of {vm} opened"),
        Err(Error::Http(resp)) => (
            resp.status().as_u16(),
            String::from_utf8_lossy(resp.body().as_deref().unwrap_or_default()).into_owned(),
        ),
        Err(e) => panic!("graphical console of {vm}: {e}"),
    }
}

/// `vm logs` and `vm console` of a VM on a `keel agent` node, asked of a
/// control plane that runs no guests: passed on to the node's agent (which
/// serves them on `--console-listen`, published on its node record) over
/// mutual TLS on the cluster CA, the user's token left behind; the agent's own answers (the log, a 409 while a session lasts)
/// come back as they are. An agent without `--console-listen` serves no consoles:
/// 501 naming the node's field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consoles_on_agent_nodes_are_reached_through_the_control_plane() {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    let Some(mut c) = Cluster::new("console-proxy").await else {
        return;
    };
    // The cluster CA: a control plane's certificate for cp, a node's for
    // n1, whose agent serves consoles over mutual TLS.
    let ca = c.dir.path().join("ca");
    tls::init_ca(&ca).unwrap();
    tls::issue_control_plane(&ca, "cp", &c.dir.path().join("cp").join(tls::CREDS_DIR), 1).unwrap();
    tls::issue(&ca, "n1", &c.dir.path().join("n1").join(tls::CREDS_DIR)).unwrap();
    c.control_plane("cp").await;
    c.agent_listening("n1", Some("127.0.0.1:0".parse().unwrap()))
        .await;
    c.agent_listening("n2", None).await;
    let agent_url = c.agents["n1"].console_url().unwrap().to_string();
    assert!(agent_url.starts_with("https://"), "{agent_url}");
    wait_for("n1's console URL on its record", || async {
        let node = c.read::<Node>(&node_key("n1")).await?;
        (node.status.agent_url.as_deref() == Some(agent_url.as_str())).then_some(())
    })
    .await;
    for (vm, node) in [("web", "n1"), ("quiet", "n2")] {
        let mut v = VirtualMachine::new(
            vm,
            VmSpec {
                cpus: 1,
                memory_mib: 64,
                node: Some(node.into()),
                readiness: keel_api::Readiness::Console("KEEL-GUEST-READY".into()),
                ..c.vm_spec()
            },
        );
        v.spec.stop_grace_period_s = 30;
        v.spec.boot.graphics = Some(keel_api::Graphics::Vnc);
        c.store.create(&vm_key(vm), &v).await.unwrap();
    }
    let (node, instance) = c.running("web").await;
    assert_eq!(node, "n1");
    c.running("quiet").await;
    let cp = format!("https://{}", c.planes["cp"].addr());
    let trust = ServerTrust::of_data_dir(&c.dir.path().join("cp")).unwrap();
    let token = c.planes["cp"].token().to_string();

    // The log, through the control plane.
    let (status, inst, body) = get_as(
        &trust,
        format!("{cp}/api/v1/vms/web/console/log?tail=1"),
        Some(token.clone()),
    )
    .await;
    assert_eq!(
        (status, inst.as_deref()),
        (200, Some(instance.as_str())),
        "{body}"
    );
    assert_eq!(body, "KEEL-GUEST-READY boot_id=sim\n");
    // The control plane checks the user's token; the agent admits only a
    // control plane's certificate: n1's own (a node's, of the same CA)
    // is refused, even with the admin token.
    let (status, _, _) = get_as(&trust, format!("{cp}/api/v1/vms/web/console/log"), None).await;
    assert_eq!(status, 401);
    let as_node =
        keel::agent_link::client_trust(&c.dir.path().join("n1").join(tls::CREDS_DIR), "n1")
            .unwrap();
    let (status, _, body) = get_as(
        &as_node,
        format!("{agent_url}/api/v1/vms/web/console/log"),
        Some(token.clone()),
    )
    .await;
    assert_eq!(
        status, 403,
        "a node's certificate is no control plane's: {body}"
    );
    let as_plane =
        keel::agent_link::client_trust(&c.dir.path().join("cp").join(tls::CREDS_DIR), "n1")
            .unwrap();
    let (status, _, body) = get_as(
        &as_plane,
        format!("{agent_url}/api/v1/vms/web/console/log?tail=1"),
        None,
    )
    .await;
    assert_eq!(status, 200, "a control plane needs no user token: {body}");
    // The agent serves consoles and its VMs' figures, nothing else.
    let (status, _, _) = get_as(&as_plane, format!("{agent_url}/api/v1/vms"), None).await;
    assert_eq!(status, 404);
    // The control plane's /metrics has the figures of n1's VM, asked of
    // n1's agent over the same link; n2's agent has no port to ask. A
    // node's certificate does not get them from the agent.
    let (status, _, metrics) = get_as(&trust, format!("{cp}/metrics"), Some(token.clone())).await;
    assert_eq!(status, 200, "{metrics}");
    assert!(
        metrics.contains(&format!(
            "keel_vm_vcpus{{vm=\"web\",node=\"n1\",instance=\"{instance}\"}} 1"
        )),
        "{metrics}"
    );
    assert!(
        metrics.contains("keel_agent_vm_figures_up{node=\"n1\"} 1"),
        "{metrics}"
    );
    assert!(!metrics.contains("vm=\"quiet\""), "{metrics}");
    let (status, _, _) = get_as(&as_node, format!("{agent_url}/api/v1/vm-stats"), None).await;
    assert_eq!(status, 403);
    // `keel vm top`'s route, asked for the cluster, has the same rows with
    // their node (and the sim guest's balloon figures); without asking,
    // only the control plane's own node's, which runs no guests.
    let (status, _, page) = get_as(
        &trust,
        format!("{cp}/api/v1/vm-stats?cluster=true"),
        Some(token.clone()),
    )
    .await;
    assert_eq!(status, 200, "{page}");
    let page: serde_json::Value = serde_json::from_str(&page).unwrap();
    let vms = page["vms"].as_array().unwrap();
    assert_eq!(vms.len(), 1, "{page}");
    assert_eq!(
        (&vms[0]["vm"], &vms[0]["node"], &vms[0]["instance"]),
        (
            &serde_json::json!("web"),
            &serde_json::json!("n1"),
            &serde_json::json!(instance)
        ),
        "{page}"
    );
    assert!(
        vms[0]["guest_memory"]["total_bytes"].as_u64() > Some(0),
        "{page}"
    );
    assert_eq!(
        page["agents"],
        serde_json::json!([{"node": "n1", "answered": true}]),
        "{page}"
    );
    let (status, _, own) =
        get_as(&trust, format!("{cp}/api/v1/vm-stats"), Some(token.clone())).await;
    assert_eq!(status, 200, "{own}");
    let own: serde_json::Value = serde_json::from_str(&own).unwrap();
    assert_eq!(own["vms"], serde_json::json!([]), "{own}");
    assert!(own.get("agents").is_none(), "{own}");

    // An interactive session through the control plane.
    let mut ws = console_ws(&trust, &cp, "web", &token).await.unwrap();
    assert_eq!(
        console_ws(&trust, &cp, "web", &token).await.unwrap_err(),
        409,
        "one session at a time, as the agent says"
    );
    assert_eq!(
        console_ws(&trust, &cp, "web", "wrong").await.unwrap_err(),
        401
    );
    ws.send(Message::binary(b"uname -a\n".to_vec()))
        .await
        .unwrap();
    let mut seen = String::new();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !seen.contains("sim: uname -a") {
        match tokio::time::timeout_at(deadline, ws.next()).await {
            Ok(Some(Ok(Message::Binary(b)))) => seen.push_str(&String::from_utf8_lossy(&b)),
            Ok(Some(Ok(_))) => {}
            other => panic!("session ended before the answer ({other:?}): {seen:?}"),
        }
    }
    ws.close(None).await.unwrap();
    drop(ws);
    let (_, _, body) = get_as(
        &trust,
        format!("{cp}/api/v1/vms/web/console/log"),
        Some(token.clone()),
    )
    .await;
    assert!(body.contains("sim: uname -a"), "{body}");
    // Detached: the agent's slot is free again.
    wait_for("the console slot to be free", || async {
        console_ws(&trust, &cp, "web", &token).await.ok().map(drop)
    })
    .await;

    // The CLI, as a user runs it against the control plane.
    let cli = |args: &'static [&'static str], stdin: &'static [u8]| {
        let data_dir = c.dir.path().join("cp");
        let server = cp.clone();
        tokio::task::spawn_blocking(move || {
            use std::io::Write;
            use std::process::{Command, Stdio};
            let mut child = Command::new(env!("CARGO_BIN_EXE_keel"))
                .args(args)
                .env("KEEL_SERVER", &server)
                .env("KEEL_DATA_DIR", &data_dir)
                .env_remove("KEEL_TOKEN")
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("run keel");
            child.stdin.take().unwrap().write_all(stdin).unwrap();
            child.wait_with_output().unwrap()
        })
    };
    let out = cli(&["vm", "logs", "web"], b"").await.unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("sim: uname -a"));
    let out = cli(&["vm", "console", "web"], b"echo hi\n").await.unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("sim: echo hi"),
        "{out:?}"
    );

    // The graphical console is passed on too: the sim agent's own answer
    // (it has no display) comes back, not a refusal of the control plane.
    let (status, body) = vnc_refusal(&trust, &cp, "web", &token).await;
    assert_eq!(status, 409, "{body}");
    assert!(
        body.contains("attach graphical console failed: not supported by this driver"),
        "{body}"
    );

    // A node record rewritten to send consoles elsewhere: a plain URL gets
    // nothing at all, an https one a TLS handshake the control plane
    // refuses (the listener's certificate cannot name n1), and the user's
    // token reaches neither.
    for scheme in ["http", "https"] {
        let rogue = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let rogue_url = format!("{scheme}://{}", rogue.local_addr().unwrap());
        let caught = std::thread::spawn(move || {
            use std::io::{Read, Write};
            rogue.set_nonblocking(false).unwrap();
            let mut got = Vec::new();
            // One connection at most, read until the peer gives up.
            if let Ok((mut conn, _)) = rogue.accept() {
                conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                let mut buf = [0u8; 4096];
                while let Ok(n @ 1..) = conn.read(&mut buf) {
                    got.extend_from_slice(&buf[..n]);
                    let _ = conn.write_all(b"\x15\x03\x03\x00\x02\x02\x28");
                }
            }
            got
        });
        set_agent_url(&c.store, "n1", &rogue_url).await;
        let (status, _, body) = get_as(
            &trust,
            format!("{cp}/api/v1/vms/web/console/log"),
            Some(token.clone()),
        )
        .await;
        assert_eq!(status, 502, "{scheme}: {body}");
        if scheme == "http" {
            let err: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(err["field"], "status.agent_url", "{body}");
            // Nothing connected: unblock the accept ourselves.
            drop(std::net::TcpStream::connect(
                rogue_url.trim_start_matches("http://"),
            ));
        }
        let got = caught.join().unwrap();
        assert!(
            !String::from_utf8_lossy(&got).contains(&token),
            "{scheme}: the user's token reached the rewritten URL"
        );
        if scheme == "https" {
            assert_eq!(got.first(), Some(&0x16), "a TLS ClientHello, nothing else");
        }
    }
    set_agent_url(&c.store, "n1", &agent_url).await;

    // n2's agent serves no consoles.
    let (status, _, body) = get_as(
        &trust,
        format!("{cp}/api/v1/vms/quiet/console/log"),
        Some(token.clone()),
    )
    .await;
    assert_eq!(status, 501, "{body}");
    let err: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(err["field"], "status.instance.node", "{body}");
    assert!(err["error"].as_str().unwrap().contains("n2"), "{body}");
    let (status, body) = vnc_refusal(&trust, &cp, "quiet", &token).await;
    assert_eq!(status, 501, "{body}");
    assert!(body.contains("status.instance.node"), "{body}");
    c.check_one_instance(&["web", "quiet"]);
    c.shutdown().await;
}

/// `keel vm migrate NAME --to NODE --wait` through the CLI, against a
/// control plane and two sim agents on etcd: the VM moves live (same
/// guest, no stop), the CLI prints the outcome, transport and downtime,
/// `keel vm get` shows it, and a second request to where it runs is
/// refused naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keel_vm_migrate_moves_a_vm_between_agents() {
    let Some(mut c) = Cluster::new("vm-migrate").await else {
        return;
    };
    c.control_plane("cp").await;
    c.agent("n1").await;
    c.agent("n2").await;
    c.create_vm("web").await;
    let (from, _) = c.running("web").await;
    let to = if from == "n1" { "n2" } else { "n1" };
    let cp = format!("https://{}", c.planes["cp"].addr());
    let data_dir = c.dir.path().join("cp");
    let token = c.planes["cp"].token().to_string();
    let keel = move |args: Vec<String>| {
        let (cp, token, data_dir) = (cp.clone(), token.clone(), data_dir.clone());
        tokio::task::spawn_blocking(move || {
            std::process::Command::new(env!("CARGO_BIN_EXE_keel"))
                .args(&args)
                .env("KEEL_SERVER", cp)
                .env("KEEL_TOKEN", token)
                // The control plane's certificate, pinned from its data dir.
                .env("KEEL_DATA_DIR", data_dir)
                .env("KEEL_CONFIG", "")
                .output()
                .expect("run keel")
        })
    };
    let args = |s: &str| s.split(' ').map(String::from).collect::<Vec<_>>();
    let out = keel(args(&format!(
        "vm migrate web --to {to} --wait --timeout 60"
    )))
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("migration Succeeded"), "{stdout}");
    assert!(stdout.contains(&format!("from {from} to {to}")), "{stdout}");
    assert!(stdout.contains("transport "), "{stdout}");
    assert!(stdout.contains("downtime "), "{stdout}");
    // Not a terminal: no progress line drawn over itself (a script's
    // stderr stays plain lines).
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !stderr.contains('\r') && !stderr.contains('\x1b') && !stderr.contains(" sent, "),
        "{stderr:?}"
    );
    eprintln!("{stdout}");
    let vm = c.vm("web").await;
    assert_eq!(vm.status.instance.as_ref().unwrap().node, to);
    assert!(
        vm.status.last_exit.is_none(),
        "migrated, not restarted: {vm:?}"
    );
    // The target resumes once the record names it.
    let (node, _) = c.running("web").await;
    assert_eq!(node, to);
    let out = keel(args("vm get web")).await.unwrap();
    let shown = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(shown.contains("succeeded: migrated from node"), "{shown}");
    let out = keel(args(&format!("vm migrate web --to {to}")))
        .await
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(err.contains(&format!("already runs on node {to}")), "{err}");
    c.shutdown().await;
}
