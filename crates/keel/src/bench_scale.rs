//! `keel bench scale`: how the control plane copes with many VMs.
//!
//! Everything runs as real Keel processes of this very binary on the sim
//! driver (no guests, so the figures are the control plane's own): one
//! `keel serve` on SQLite, and, with etcd, a private etcd member, several
//! control planes and several `keel agent`s. Clients create the VMs over
//! the HTTP API from threads of this process, as users would.
//!
//! Figures, per scenario:
//! - create rate (VMs/s over the whole create phase) and the API's p50/p99
//!   latency for those creates, while the controllers place and start the
//!   VMs meanwhile;
//! - all Running: from just before the first create until the store holds
//!   every VM Running (counted from the VM watch stream, i.e. from the
//!   store itself: `phase_watch`);
//! - restart all: from just before the first restart request until every
//!   VM runs a new instance for it (`observed_restart_generation`);
//! - CPU per VM until all Running, of each kind of process and of the
//!   bench's own clients ([`cpu_share`]);
//! - etcd run: the same store writes made by this process alone on a
//!   fresh etcd, the run's anchor on this machine ([`etcd_floor`]): as
//!   fast as they go, and with the creates at the target's pace, what etcd
//!   alone answers a create in and leaves of the machine at that pace;
//! - peak RSS of each kind of Keel process (`VmHWM`), and the store's size
//!   on disk (SQLite files, or etcd's backend file);
//! - single node: `/metrics` with every VM's series, its scrape time
//!   (p50, p99) and CPU per scrape ([`scrape`]);
//! - single node: the server's idle CPU (% of one core) once every VM runs
//!   and nothing changes ([`idle`]).

mod cpu_share;
mod etcd_floor;
pub(crate) mod idle;
mod phase_watch;
mod scrape;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use serde_json::Value;

#[derive(Debug, Args)]
pub struct ScaleArgs {
    /// VM counts for the single-node (SQLite) runs, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1000,10000")]
    pub vms: Vec<usize>,
    /// VM count for the etcd cluster run; 0 skips it.
    #[arg(long, default_value_t = 10_000)]
    pub etcd_vms: usize,
    /// Control planes of the etcd cluster run.
    #[arg(long, default_value_t = 3)]
    pub control_planes: usize,
    /// Sim agents (nodes) of the etcd cluster run.
    #[arg(long, default_value_t = 10)]
    pub agents: usize,
    /// Concurrent API clients.
    #[arg(long, default_value_t = 8)]
    pub clients: usize,
    /// Creates per second the clients ask at, together, on a steady
    /// schedule (as users arriving at that rate would); 0: each client
    /// asks again as soon as it is answered.
    #[arg(long, default_value_t = 0.0)]
    pub create_pace: f64,
    /// Longest wait for one phase (all Running, restart all), seconds.
    #[arg(long, default_value_t = 900)]
    pub timeout_s: u64,
    /// VM count for the mixed run on SQLite: VMs of several sizes over
    /// --nodes simulated nodes of several sizes, placed by fit, with every
    /// node's allocation sampled against its capacity; 0 skips it.
    #[arg(long, default_value_t = 10_000)]
    pub mixed_vms: usize,
    /// Simulated nodes of the mixed run (`keel serve --sim-nodes`).
    #[arg(long, default_value_t = 50)]
    pub nodes: usize,
    /// Where the runs keep their data (default: a fresh directory under
    /// the system temp dir, removed afterwards).
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
    /// `/metrics` scrapes of each single-node run, once every VM runs
    /// (about a second apart, so each reads the guests afresh).
    #[arg(long, default_value_t = scrape::SCRAPES)]
    pub scrapes: usize,
    /// Seconds each single-node run leaves the server alone (every VM
    /// running, nothing asked) before measuring its idle CPU: past the
    /// boots' settle time and a whole resync period, so every VM's slow
    /// look is in its steady rhythm.
    #[arg(long, default_value_t = 70)]
    pub idle_settle_s: u64,
    /// Seconds over which the idle CPU is measured; 0 skips it.
    #[arg(long, default_value_t = 30)]
    pub idle_s: u64,
    /// The etcd binary of the cluster run.
    #[arg(long, default_value = "etcd")]
    pub etcd_bin: PathBuf,
    /// Creates per second of the etcd run's second anchor, etcd alone at
    /// a steady pace (default: 10,000 VMs in 15 s); 0 skips it.
    #[arg(long, default_value_t = 667.0)]
    pub floor_pace: f64,
}

/// How the clients ask.
#[derive(Debug, Clone, Copy)]
struct Load {
    clients: usize,
    /// Requests per second of all clients together, on a schedule; None:
    /// back to back.
    pace_per_s: Option<f64>,
}

impl ScaleArgs {
    fn create_load(&self) -> Load {
        Load {
            clients: self.clients,
            pace_per_s: (self.create_pace > 0.0).then_some(self.create_pace),
        }
    }
}

/// One scenario's figures.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ScaleReport {
    pub store: String,
    pub control_planes: usize,
    pub nodes: usize,
    pub vms: usize,
    pub clients: usize,
    /// The creates' pace (`--create-pace`); None: back to back.
    pub create_pace_per_s: Option<f64>,
    pub create_per_s: f64,
    pub create_p50_ms: f64,
    pub create_p99_ms: f64,
    /// None: not all Running before the timeout (`running_at_timeout` say how many were).
    pub all_running_s: Option<f64>,
    pub running_at_timeout: usize,
    pub restart_all_s: Option<f64>,
    pub restarted_at_timeout: usize,
    /// CPU of each kind of process (and `bench`, this process) from the
    /// first create until all ran, in ms per VM; empty on a timeout.
    pub cpu_ms_per_vm: BTreeMap<String, f64>,
    pub peak_rss_mib: BTreeMap<String, f64>,
    pub store_bytes: u64,
    /// The mixed run's samples of every node's allocation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capacity: Option<CapacitySamples>,
    /// The single-node runs' `/metrics` scrapes with every VM running.
    pub scrape: Option<scrape::ScrapeFigures>,
    /// The single-node runs' idle CPU with every VM running.
    pub idle: Option<idle::IdleFigures>,
    /// The etcd run's writes made by this process alone on a fresh etcd,
    /// as fast as they go.
    pub store_floor: Option<etcd_floor::StoreFloor>,
    /// The same with the creates at `--floor-pace`.
    pub store_floor_paced: Option<etcd_floor::StoreFloor>,
}

/// What the mixed run saw of the nodes' allocations while the VMs were
/// placed, started and restarted: never one over its capacity.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct CapacitySamples {
    /// Looks at every node's allocation (`GET /api/v1/nodes`).
    pub samples: usize,
    /// Node-samples whose allocated CPUs or memory exceeded the capacity.
    pub over_capacity: usize,
    /// The fullest any node was seen, as a share of its capacity.
    pub max_cpu_share: f64,
    pub max_memory_share: f64,
}

pub fn main(args: ScaleArgs) -> anyhow::Result<()> {
    if args.clients == 0 {
        bail!("--clients must be at least 1");
    }
    if args.vms.contains(&0) {
        bail!("--vms: every count must be at least 1");
    }
    if args.etcd_vms > 0 && (args.control_planes == 0 || args.agents == 0) {
        bail!(
            "--control-planes and --agents must be at least 1 for the etcd run (or --etcd-vms 0)"
        );
    }
    let (root, remove_root) = match &args.work_dir {
        Some(dir) => (dir.clone(), false),
        None => (
            std::env::temp_dir().join(format!("keel-bench-scale-{}", std::process::id())),
            true,
        ),
    };
    std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    println!("keel bench scale on {}", machine());
    println!(
        "keel {} ({} build)",
        env!("CARGO_PKG_VERSION"),
        build_kind()
    );
    let timeout = Duration::from_secs(args.timeout_s);
    let mut reports = Vec::new();
    for (i, &n) in args.vms.iter().enumerate() {
        let dir = root.join(format!("sqlite-{n}-{i}"));
        let report = sqlite_run(&dir, n, &args, timeout)
            .with_context(|| format!("the SQLite run with {n} VMs"))?;
        print_report(&report);
        reports.push(report);
    }
    if args.mixed_vms > 0 {
        let dir = root.join(format!("mixed-{}", args.mixed_vms));
        let report = mixed_run(&dir, &args, timeout).with_context(|| {
            format!(
                "the mixed run with {} VMs on {} nodes",
                args.mixed_vms, args.nodes
            )
        })?;
        print_report(&report);
        reports.push(report);
    }
    if args.etcd_vms > 0 {
        let dir = root.join(format!("etcd-{}", args.etcd_vms));
        let report = etcd_run(&dir, &args, timeout)
            .with_context(|| format!("the etcd run with {} VMs", args.etcd_vms))?;
        print_report(&report);
        reports.push(report);
    }
    println!("{}", serde_json::to_string(&reports)?);
    if remove_root {
        let _ = std::fs::remove_dir_all(&root);
    }
    Ok(())
}

/// The bench's clients all use the server's own token, at rates far past
/// the per-token limit (`--max-requests-per-token`), which would answer
/// most of them 429: the bench measures the control plane, not that limit.
const UNLIMITED_REQUESTS: &str = "1000000";
/// Connections the bench's agent keeps open, at least one per client.
const MAX_CLIENT_CONNECTIONS: usize = 256;

fn sqlite_run(
    dir: &Path,
    vms: usize,
    args: &ScaleArgs,
    timeout: Duration,
) -> anyhow::Result<ScaleReport> {
    let data = dir.join("serve");
    let mut procs = Procs::default();
    let serve = spawn_sim_serve(&mut procs, &data, &[])?;
    let api = Api::connect(&procs, serve, &data)?;
    let mut report = drive(
        &procs,
        std::slice::from_ref(&api),
        vms,
        args.create_load(),
        timeout,
        &small_vm,
    )?;
    let pid = procs.children[serve].1.id();
    report.scrape = Some(scrape::measure(&api, pid, args.scrapes.max(1))?);
    if args.idle_s > 0 {
        report.idle = Some(idle::measure(
            pid,
            Duration::from_secs(args.idle_settle_s),
            Duration::from_secs(args.idle_s),
        )?);
        procs.check_alive(serve)?;
    }
    report.store = "sqlite".into();
    report.control_planes = 1;
    report.nodes = 1;
    report.peak_rss_mib = procs.peak_rss_mib();
    report.store_bytes = files_bytes(&data, "keel.db");
    Ok(report)
}

/// A private single-member etcd with its data in `dir`: its client URL
/// and its place in `procs`.
fn spawn_etcd(procs: &mut Procs, dir: &Path, args: &ScaleArgs) -> anyhow::Result<(String, usize)> {
    std::fs::create_dir_all(dir)?;
    let client_port = free_port()?;
    let peer_port = free_port()?;
    let etcd_data = dir.join("etcd");
    let client_url = format!("http://127.0.0.1:{client_port}");
    let peer_url = format!("http://127.0.0.1:{peer_port}");
    let etcd = procs.spawn_program(
        "etcd",
        &args.etcd_bin,
        &dir.join("etcd.log"),
        &[
            "--name",
            "bench",
            "--data-dir",
            &etcd_data.to_string_lossy(),
            "--listen-client-urls",
            &client_url,
            "--advertise-client-urls",
            &client_url,
            "--listen-peer-urls",
            &peer_url,
            "--initial-advertise-peer-urls",
            &peer_url,
            "--initial-cluster",
            &format!("bench={peer_url}"),
            "--quota-backend-bytes",
            &(8u64 << 30).to_string(),
        ],
    )?;
    wait_etcd(&client_url)?;
    Ok((client_url, etcd))
}

fn etcd_run(dir: &Path, args: &ScaleArgs, timeout: Duration) -> anyhow::Result<ScaleReport> {
    std::fs::create_dir_all(dir)?;
    let floor = store_floor(dir, args, None)?;
    let floor_paced = if args.floor_pace > 0.0 {
        Some(store_floor(dir, args, Some(args.floor_pace))?)
    } else {
        None
    };
    let mut procs = Procs::default();
    let (client_url, _) = spawn_etcd(&mut procs, dir, args)?;
    // Its own throwaway etcd on loopback: plain is acceptable here.
    let store = format!(
        "etcd://{}/keel-bench",
        client_url.trim_start_matches("http://")
    );
    let mut apis = Vec::new();
    for i in 0..args.control_planes {
        let data = dir.join(format!("cp{i}"));
        std::fs::create_dir_all(&data)?;
        let cp = procs.spawn(
            "control plane",
            &data.join("serve.log"),
            &[
                "serve",
                "--store",
                &store,
                "--insecure-store",
                "--listen",
                "127.0.0.1:0",
                "--node",
                &format!("cp{i}"),
                "--data-dir",
                &data.to_string_lossy(),
                "--max-requests-per-token",
                UNLIMITED_REQUESTS,
            ],
        )?;
        apis.push(Api::connect(&procs, cp, &data)?);
    }
    for i in 0..args.agents {
        let data = dir.join(format!("agent{i}"));
        std::fs::create_dir_all(&data)?;
        procs.spawn(
            "agent",
            &data.join("agent.log"),
            &[
                "agent",
                "--store",
                &store,
                "--insecure-store",
                "--hypervisor",
                "sim",
                "--node",
                &format!("node{i}"),
                "--restart-freeze",
                "0s",
                "--data-dir",
                &data.to_string_lossy(),
            ],
        )?;
    }
    wait_nodes(&apis[0], args.agents, Duration::from_secs(60))?;
    let mut report = drive(
        &procs,
        &apis,
        args.etcd_vms,
        args.create_load(),
        timeout,
        &small_vm,
    )?;
    report.store = "etcd".into();
    report.control_planes = args.control_planes;
    report.nodes = args.agents;
    report.peak_rss_mib = procs.peak_rss_mib();
    report.store_bytes = files_bytes(&dir.join("etcd/member/snap"), "db");
    report.store_floor = Some(floor);
    report.store_floor_paced = floor_paced;
    Ok(report)
}

/// The etcd run's VMs' writes made by this process on an etcd of their
/// own, gone before the cluster's starts.
fn store_floor(
    dir: &Path,
    args: &ScaleArgs,
    pace_per_s: Option<f64>,
) -> anyhow::Result<etcd_floor::StoreFloor> {
    let floor_dir = dir.join("store-floor");
    let floor = {
        // Its etcd is killed with `procs` at the block's end, before its
        // directory goes.
        let mut procs = Procs::default();
        let (url, etcd) = spawn_etcd(&mut procs, &floor_dir, args)?;
        etcd_floor::measure(
            &url,
            procs.pid(etcd),
            args.etcd_vms,
            args.clients,
            args.agents,
            pace_per_s,
        )
        .context("the store floor")?
    };
    let _ = std::fs::remove_dir_all(&floor_dir);
    Ok(floor)
}

/// A `keel serve` on SQLite and the sim driver in `data`, node `bench`,
/// with `extra` flags: the single-node and the mixed runs' server.
fn spawn_sim_serve(procs: &mut Procs, data: &Path, extra: &[&str]) -> anyhow::Result<usize> {
    std::fs::create_dir_all(data)?;
    let data_dir = data.to_string_lossy();
    let mut args = vec![
        "serve",
        "--hypervisor",
        "sim",
        "--listen",
        "127.0.0.1:0",
        "--node",
        "bench",
        "--data-dir",
        &data_dir,
        "--max-requests-per-token",
        UNLIMITED_REQUESTS,
    ];
    args.extend_from_slice(extra);
    procs.spawn("serve", &data.join("serve.log"), &args)
}

/// The hosts of the mixed run's nodes, taken in turn: 16,000 vCPUs (at
/// the default overcommit of 4) and about 16 TiB over 50 nodes.
const MIXED_HOSTS: &str = "32:128G,64:256G,96:384G,128:512G";

/// The mixed run: `keel serve` on SQLite with `--nodes` simulated nodes
/// of [`MIXED_HOSTS`], VMs of [`mixed_vm`]'s sizes (about four fifths of
/// the CPUs offered), and a sampler that looks at every node's
/// allocation all along.
fn mixed_run(dir: &Path, args: &ScaleArgs, timeout: Duration) -> anyhow::Result<ScaleReport> {
    let data = dir.join("serve");
    let mut procs = Procs::default();
    let nodes = args.nodes.to_string();
    let serve = spawn_sim_serve(
        &mut procs,
        &data,
        &["--sim-nodes", &nodes, "--sim-node-hosts", MIXED_HOSTS],
    )?;
    let api = Api::connect(&procs, serve, &data)?;
    wait_nodes(&api, args.nodes, Duration::from_secs(60))?;
    let done = std::sync::atomic::AtomicBool::new(false);
    let (report, capacity) = std::thread::scope(|scope| {
        let sampler = scope.spawn(|| sample_capacity(&api, &done));
        let report = drive(
            &procs,
            std::slice::from_ref(&api),
            args.mixed_vms,
            args.create_load(),
            timeout,
            &mixed_vm,
        );
        done.store(true, Ordering::Relaxed);
        let capacity = sampler
            .join()
            .unwrap_or_else(|_| bail!("the sampler panicked"));
        (report, capacity)
    });
    let mut report = report?;
    report.capacity = Some(capacity?);
    report.store = "sqlite, mixed sizes".into();
    report.control_planes = 1;
    report.nodes = args.nodes;
    report.peak_rss_mib = procs.peak_rss_mib();
    report.store_bytes = files_bytes(&data, "keel.db");
    Ok(report)
}

/// Looks at every node's allocation against its capacity until `done`.
fn sample_capacity(
    api: &Api,
    done: &std::sync::atomic::AtomicBool,
) -> anyhow::Result<CapacitySamples> {
    let mut seen = CapacitySamples::default();
    while !done.load(Ordering::Relaxed) {
        let nodes: Value = serde_json::from_str(&api.get_text("/api/v1/nodes")?)?;
        for item in nodes["items"].as_array().into_iter().flatten() {
            let cap = &item["node"]["status"]["capacity"];
            let used = &item["allocated"];
            let share = |field: &str| {
                let offered = cap[field].as_f64().unwrap_or(0.0);
                let taken = used[field].as_f64().unwrap_or(0.0);
                if offered > 0.0 {
                    taken / offered
                } else {
                    0.0
                }
            };
            let (cpu, memory) = (share("cpus"), share("memory_mib"));
            seen.samples += 1;
            if cpu > 1.0 || memory > 1.0 {
                seen.over_capacity += 1;
            }
            seen.max_cpu_share = seen.max_cpu_share.max(cpu);
            seen.max_memory_share = seen.max_memory_share.max(memory);
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    Ok(seen)
}

/// The VM of the single-node and etcd runs: one size for all.
fn small_vm(_: usize) -> Value {
    serde_json::json!({"cpus": 1, "memory_mib": 64, "run_policy": "AlwaysOnUnlessStoppedManually"})
}

/// The mixed run's VM `i`: 1, 1, 2 or 1 CPUs and 256 MiB to 1 GiB.
fn mixed_vm(i: usize) -> Value {
    let cpus = [1, 1, 2, 1][i % 4];
    let memory_mib = [256, 512, 1024, 512][(i / 4) % 4];
    serde_json::json!({"cpus": cpus, "memory_mib": memory_mib, "run_policy": "AlwaysOnUnlessStoppedManually"})
}

/// Creates `vms` VMs of `spec`'s sizes through `apis` (clients spread
/// over them), waits for all to run, restarts all, waits for that.
fn drive(
    procs: &Procs,
    apis: &[Api],
    vms: usize,
    load: Load,
    timeout: Duration,
    spec: &(dyn Fn(usize) -> Value + Sync),
) -> anyhow::Result<ScaleReport> {
    let names: Vec<String> = (0..vms).map(|i| format!("vm-{i:05}")).collect();
    let phases = phase_watch::PhaseWatch::follow(apis[0].stream("/api/v1/vms?watch=true")?);
    let cpu_before = cpu_share::CpuMark::now(procs.kinds_and_pids())?;
    let started = Instant::now();
    let latencies = fan_out(apis, &names, load, |api, name| {
        let index = name
            .trim_start_matches("vm-")
            .parse()
            .context("a VM name of the run")?;
        let body = serde_json::json!({"name": name, "spec": spec(index)});
        api.post("/api/v1/vms", &body.to_string())
    })?;
    let create_s = started.elapsed().as_secs_f64();
    let (all_running_s, running_at_timeout) =
        wait_until(started, timeout, || phases.running().map(|n| (n >= vms, n)))?;
    let cpu_ms_per_vm = match all_running_s {
        Some(_) => {
            cpu_share::CpuMark::now(procs.kinds_and_pids())?.ms_per_vm_since(&cpu_before, vms)
        }
        None => BTreeMap::new(),
    };
    let restart_started = Instant::now();
    let back_to_back = Load {
        pace_per_s: None,
        ..load
    };
    fan_out(apis, &names, back_to_back, |api, name| {
        api.post(&format!("/api/v1/vms/{name}/restart"), "")
    })?;
    let (restart_all_s, restarted_at_timeout) = wait_until(restart_started, timeout, || {
        phases.restarted().map(|n| (n >= vms, n))
    })?;
    Ok(ScaleReport {
        store: String::new(),
        control_planes: 0,
        nodes: 0,
        vms,
        clients: load.clients,
        create_pace_per_s: load.pace_per_s,
        create_per_s: vms as f64 / create_s.max(1e-9),
        create_p50_ms: percentile(&latencies, 0.50),
        create_p99_ms: percentile(&latencies, 0.99),
        all_running_s,
        running_at_timeout,
        restart_all_s,
        restarted_at_timeout,
        cpu_ms_per_vm,
        peak_rss_mib: BTreeMap::new(),
        store_bytes: 0,
        capacity: None,
        scrape: None,
        idle: None,
        store_floor: None,
        store_floor_paced: None,
    })
}

/// Runs `request` once per name on `load.clients` threads, at its pace if
/// it has one; each request's latency in ms, from asking to the answer.
/// Any refused request fails the run: the figures would lie.
fn fan_out(
    apis: &[Api],
    names: &[String],
    load: Load,
    request: impl Fn(&Api, &str) -> anyhow::Result<()> + Sync,
) -> anyhow::Result<Vec<f64>> {
    let next = AtomicUsize::new(0);
    let first = Instant::now();
    let results: Vec<anyhow::Result<Vec<f64>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..load.clients)
            .map(|c| {
                let (next, request) = (&next, &request);
                let api = &apis[c % apis.len()];
                scope.spawn(move || -> anyhow::Result<Vec<f64>> {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(name) = names.get(i) else {
                            return Ok(mine);
                        };
                        if let Some(pace) = load.pace_per_s {
                            // Request i is due i/pace after the first:
                            // never sooner, later only if every client is
                            // still waiting on an answer.
                            let due = first + Duration::from_secs_f64(i as f64 / pace);
                            std::thread::sleep(due.saturating_duration_since(Instant::now()));
                        }
                        let t = Instant::now();
                        request(api, name)?;
                        mine.push(t.elapsed().as_secs_f64() * 1000.0);
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| bail!("a client thread panicked"))
            })
            .collect()
    });
    let mut all = Vec::with_capacity(names.len());
    for r in results {
        all.extend(r?);
    }
    Ok(all)
}

/// Polls `done` until it says so or `timeout` passes: the seconds it took
/// since `since` (None on timeout) and the last count.
fn wait_until(
    since: Instant,
    timeout: Duration,
    mut done: impl FnMut() -> anyhow::Result<(bool, usize)>,
) -> anyhow::Result<(Option<f64>, usize)> {
    loop {
        let (finished, count) = done()?;
        if finished {
            return Ok((Some(since.elapsed().as_secs_f64()), count));
        }
        if since.elapsed() > timeout {
            return Ok((None, count));
        }
        // The counts are kept by the watch stream's reader; a look costs
        // nothing, so the figure is known to within this pause.
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn wait_nodes(api: &Api, count: usize, timeout: Duration) -> anyhow::Result<()> {
    let since = Instant::now();
    let (done, seen) = wait_until(since, timeout, || {
        let nodes: Value = serde_json::from_str(&api.get_text("/api/v1/nodes")?)?;
        let n = nodes["items"].as_array().map_or(0, Vec::len);
        Ok((n >= count, n))
    })?;
    match done {
        Some(_) => Ok(()),
        None => bail!("only {seen} of {count} agents registered within {timeout:?}"),
    }
}

fn wait_etcd(url: &str) -> anyhow::Result<()> {
    let agent = http_agent(&crate::cli::server_trust::ServerTrust::PlainHttp);
    let since = Instant::now();
    while since.elapsed() < Duration::from_secs(30) {
        if let Ok(mut r) = agent.get(format!("{url}/health")).call() {
            if r.status() == 200 && r.body_mut().read_to_string()?.contains("true") {
                return Ok(());
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    bail!("the bench's etcd at {url} did not become healthy in 30 s")
}

fn percentile(samples: &[f64], q: f64) -> f64 {
    if samples.is_empty() {
        return 0.0;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((sorted.len() as f64) * q).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn print_report(r: &ScaleReport) {
    let secs = |s: Option<f64>, at: usize| match s {
        Some(s) => format!("{s:.1} s"),
        None => format!("timed out ({at} of {})", r.vms),
    };
    let rss = r
        .peak_rss_mib
        .iter()
        .map(|(kind, mib)| format!("{kind} {mib:.0} MiB"))
        .collect::<Vec<_>>()
        .join(", ");
    println!(
        "{store}: {vms} VMs, {cps} control plane(s), {nodes} node(s), {clients} clients\n  \
         create: {rate:.0} VMs/s{paced}, API p50 {p50:.1} ms, p99 {p99:.1} ms\n  \
         all Running: {running}\n  restart all: {restart}\n  \
         peak RSS: {rss}\n  store size: {size:.1} MiB",
        store = r.store,
        vms = r.vms,
        cps = r.control_planes,
        nodes = r.nodes,
        clients = r.clients,
        rate = r.create_per_s,
        paced = r
            .create_pace_per_s
            .map(|p| format!(" (asked at {p:.0}/s)"))
            .unwrap_or_default(),
        p50 = r.create_p50_ms,
        p99 = r.create_p99_ms,
        running = secs(r.all_running_s, r.running_at_timeout),
        restart = secs(r.restart_all_s, r.restarted_at_timeout),
        size = r.store_bytes as f64 / (1024.0 * 1024.0),
    );
    if !r.cpu_ms_per_vm.is_empty() {
        println!(
            "  CPU until all Running: {}",
            cpu_share::describe(&r.cpu_ms_per_vm)
        );
    }
    if let Some(f) = &r.store_floor {
        let times = r
            .all_running_s
            .map(|s| format!("; all Running took {:.2}× that", s / f.seconds.max(1e-9)))
            .unwrap_or_default();
        println!(
            "  etcd alone: the same writes ({txns} transactions, {puts} puts, {events} watch \
             events) straight from this process to a fresh etcd: {secs:.1} s, a create's \
             transaction p50 {p50:.1} ms, p99 {p99:.1} ms, etcd {cpu:.2} ms CPU per VM{times}",
            p50 = f.create_p50_ms,
            p99 = f.create_p99_ms,
            txns = f.transactions,
            puts = f.puts,
            events = f.watch_events,
            secs = f.seconds,
            cpu = f.etcd_cpu_ms_per_vm,
        );
    }
    if let Some((f, pace)) = r
        .store_floor_paced
        .as_ref()
        .and_then(|f| Some((f, f.pace_per_s?)))
    {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        // The machine's CPU time per VM at this pace, less etcd's.
        let left = 1000.0 * cpus as f64 / pace - f.etcd_cpu_ms_per_vm;
        let rest: f64 = r
            .cpu_ms_per_vm
            .iter()
            .filter(|(kind, _)| kind.as_str() != "etcd")
            .map(|(_, ms)| ms)
            .sum();
        println!(
            "  etcd alone at {pace:.0} creates/s: answered {rate:.0}/s, a create's \
             transaction p50 {p50:.1} ms, p99 {p99:.1} ms; etcd {cpu:.2} ms CPU per VM, \
             leaving {left:.2} ms per VM of {cpus} CPUs to the rest at that pace (this \
             run's other processes took {rest:.2})",
            rate = f.create_per_s,
            p50 = f.create_p50_ms,
            p99 = f.create_p99_ms,
            cpu = f.etcd_cpu_ms_per_vm,
        );
    }
    if let Some(c) = &r.capacity {
        println!(
            "  capacity: {over} of {samples} node samples over capacity; fullest node CPU {cpu:.0}%, memory {mem:.0}%",
            over = c.over_capacity,
            samples = c.samples,
            cpu = c.max_cpu_share * 100.0,
            mem = c.max_memory_share * 100.0,
        );
    }
    if let Some(s) = &r.scrape {
        println!(
            "  /metrics with {with} VMs' series ({kib:.0} KiB): {n} scrapes, p50 {p50:.1} ms, \
             p99 {p99:.1} ms, CPU {cpu:.1} ms per scrape",
            with = s.vms_with_series,
            kib = s.bytes as f64 / 1024.0,
            n = s.scrapes,
            p50 = s.p50_ms,
            p99 = s.p99_ms,
            cpu = s.cpu_ms_per_scrape,
        );
    }
    if let Some(i) = &r.idle {
        println!(
            "  idle: {cpu:.2}% of a core over {window:.0} s with every VM running and nothing changing \
             ({settle:.0} s after the last request)",
            cpu = i.cpu_percent_of_core,
            window = i.window_s,
            settle = i.settle_s,
        );
    }
}

/// The API of one control plane: its address and token.
pub(crate) struct Api {
    base: String,
    authorization: String,
    agent: ureq::Agent,
}

impl Api {
    /// Waits for the process's log to say where it serves, then reads the
    /// token it wrote.
    pub(crate) fn connect(procs: &Procs, index: usize, data: &Path) -> anyhow::Result<Api> {
        let since = Instant::now();
        loop {
            let log = procs.log(index);
            if let Some(addr) = log.split("serving addr=").nth(1) {
                let addr = addr.split_whitespace().next().unwrap_or_default();
                let token = std::fs::read_to_string(data.join("token"))
                    .with_context(|| format!("reading {}/token", data.display()))?;
                // Trusts the certificate the server made in its data dir.
                let trust = crate::cli::server_trust::ServerTrust::of_data_dir(data)?;
                return Ok(Api {
                    base: format!("https://{addr}"),
                    authorization: format!("Bearer {}", token.trim()),
                    agent: http_agent(&trust),
                });
            }
            procs.check_alive(index)?;
            if since.elapsed() > Duration::from_secs(60) {
                bail!("the server did not serve within 60 s:\n{log}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn post(&self, path: &str, body: &str) -> anyhow::Result<()> {
        let mut resp = self
            .agent
            .post(format!("{}{path}", self.base))
            .header("Authorization", &self.authorization)
            .header("Content-Type", "application/json")
            .send(body)
            .with_context(|| format!("POST {path}"))?;
        let status = resp.status().as_u16();
        // Read to the end, also on success: only then does the connection
        // go back to the pool. Left unread, each request made a TLS
        // handshake of its own (a sixth of the server's CPU at 10,000).
        let text = resp.body_mut().read_to_string().unwrap_or_default();
        if !(200..300).contains(&status) {
            bail!("POST {path}: HTTP {status}: {text}");
        }
        Ok(())
    }

    /// The body of a response that goes on for the whole run (a watch),
    /// without the requests' time limit.
    fn stream(&self, path: &str) -> anyhow::Result<impl std::io::Read + Send + 'static> {
        let resp = self
            .agent
            .get(format!("{}{path}", self.base))
            .header("Authorization", &self.authorization)
            .config()
            .timeout_global(None)
            .build()
            .call()
            .with_context(|| format!("GET {path}"))?;
        let status = resp.status().as_u16();
        if status != 200 {
            bail!("GET {path}: HTTP {status}");
        }
        Ok(resp.into_body().into_reader())
    }

    pub(crate) fn get_text(&self, path: &str) -> anyhow::Result<String> {
        let mut resp = self
            .agent
            .get(format!("{}{path}", self.base))
            .header("Authorization", &self.authorization)
            .call()
            .with_context(|| format!("GET {path}"))?;
        let status = resp.status().as_u16();
        let text = resp
            .body_mut()
            .with_config()
            .limit(1 << 30)
            .read_to_string()?;
        if status != 200 {
            bail!("GET {path}: HTTP {status}: {text}");
        }
        Ok(text)
    }
}

fn http_agent(trust: &crate::cli::server_trust::ServerTrust) -> ureq::Agent {
    trust.agent(
        ureq::Agent::config_builder()
            .http_status_as_error(false)
            .proxy(None)
            // Every client thread keeps its connection.
            .max_idle_connections(MAX_CLIENT_CONNECTIONS)
            .max_idle_connections_per_host(MAX_CLIENT_CONNECTIONS)
            .timeout_global(Some(Duration::from_secs(60)))
            .build(),
    )
}

/// The bench's child processes, killed when it ends.
#[derive(Default)]
pub(crate) struct Procs {
    children: Vec<(String, Child, PathBuf)>,
    /// `RUST_LOG` of the processes spawned from now on (default `info`).
    pub(crate) log_filter: Option<&'static str>,
}

impl Procs {
    pub(crate) fn spawn(&mut self, kind: &str, log: &Path, args: &[&str]) -> anyhow::Result<usize> {
        let exe = std::env::current_exe().context("locating this keel binary")?;
        self.spawn_program(kind, &exe, log, args)
    }

    fn spawn_program(
        &mut self,
        kind: &str,
        program: &Path,
        log: &Path,
        args: &[&str],
    ) -> anyhow::Result<usize> {
        let out = std::fs::File::create(log)?;
        let child = Command::new(program)
            .args(args)
            .env("RUST_LOG", self.log_filter.unwrap_or("info"))
            .env_remove("KEEL_CONFIG")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("starting {}", program.display()))?;
        self.children
            .push((kind.to_string(), child, log.to_path_buf()));
        Ok(self.children.len() - 1)
    }

    pub(crate) fn log(&self, index: usize) -> String {
        let Some((_, _, path)) = self.children.get(index) else {
            return String::new();
        };
        let Ok(file) = std::fs::File::open(path) else {
            return String::new();
        };
        BufReader::new(file)
            .lines()
            .map_while(Result::ok)
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Each process still known, by its kind.
    pub(crate) fn kinds_and_pids(&self) -> impl Iterator<Item = (&str, u32)> {
        self.children
            .iter()
            .map(|(kind, child, _)| (kind.as_str(), child.id()))
    }

    pub(crate) fn pid(&self, index: usize) -> u32 {
        self.children[index].1.id()
    }

    pub(crate) fn check_alive(&self, index: usize) -> anyhow::Result<()> {
        let pid = self.children[index].1.id();
        if !Path::new(&format!("/proc/{pid}")).exists() || is_zombie(pid) {
            bail!("{} exited:\n{}", self.children[index].0, self.log(index));
        }
        Ok(())
    }

    /// The largest peak RSS per kind of process.
    fn peak_rss_mib(&self) -> BTreeMap<String, f64> {
        let mut peaks = BTreeMap::new();
        for (kind, child, _) in &self.children {
            if let Some(kib) = vm_hwm_kib(child.id()) {
                let mib = kib as f64 / 1024.0;
                let entry = peaks.entry(kind.clone()).or_insert(0.0f64);
                *entry = entry.max(mib);
            }
        }
        peaks
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        for (_, child, _) in self.children.iter_mut().rev() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn vm_hwm_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
        .unwrap_or(true)
}

/// The total size of the files in `dir` whose names start with `prefix`
/// (a database and its journal).
fn files_bytes(dir: &Path, prefix: &str) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// CPU model, CPUs, memory and kernel: the figures mean nothing without.
pub fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        .unwrap_or_else(|| "unknown CPU".into());
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse::<f64>().ok())
        })
        .map_or(0.0, |kib| kib / (1024.0 * 1024.0));
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!(
        "{model}, {cpus} CPUs, {mem_gib:.0} GiB, Linux {}",
        kernel.trim()
    )
}

pub(crate) fn build_kind() -> &'static str {
    if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    }
}
