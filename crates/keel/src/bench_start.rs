//! `keel bench start`: what Keel adds to a start.
//!
//! One `keel serve` of this very binary on real QEMU runs a VM of the test
//! guest (ready once its console prints [`READY_TEXT`]). Rounds interleave
//! two starts of it:
//! - Keel: `keel vm start --wait` (this binary, as a user runs it) until
//!   it exits with the VM Running and ready, then `keel vm stop --wait`;
//! - bare: the argument vector Keel's driver recorded for the instance it
//!   just ran (its launch record), spawned by hand ([`keel_hv::qemu::bare`]:
//!   passt, QEMU, the QMP handshake, `cont` if paused) until the console
//!   log it writes shows the same text (found as Keel's driver finds it:
//!   woken by each change to the log, [`bare::console_shows`]), then
//!   killed.
//!
//! Keel/bare of the medians is what Keel adds. Each Keel start is also cut
//! into its phases ([`phases`]) from the marks the server logs.
//!
//! With `--idle-guests N`, the same server then runs N guests until all
//! are ready and its own CPU is measured while they idle ([`idle_guests`]).

mod idle_guests;
mod phases;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use keel_hv::qemu::bare::{self, RecordedLaunch};
use serde_json::Value;

use crate::bench_scale::{build_kind, machine, Api, Procs};

/// What the test guest prints on its console once it is up (its contract,
/// scripts/build-test-guest).
pub const READY_TEXT: &str = "KEEL-GUEST-READY";

/// The VM the bench starts.
const VM: &str = "bench";

#[derive(Debug, Args)]
pub struct StartArgs {
    /// Rounds; each starts the VM once through Keel and once bare (in
    /// turn first), after one warm-up start that is not counted.
    #[arg(long, default_value_t = 8)]
    pub rounds: usize,
    /// The test guest (vmlinuz, initramfs.cpio.gz from
    /// scripts/build-test-guest); default ./target/guest.
    #[arg(long, env = "KEEL_GUEST_DIR")]
    pub guest: Option<PathBuf>,
    /// The accelerator `keel serve` is given (auto, kvm or tcg).
    #[arg(long, default_value = "auto")]
    pub accel: String,
    /// Where the run keeps its data (default: a fresh directory under the
    /// system temp dir, removed afterwards).
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
    /// Longest wait for one start or stop, seconds.
    #[arg(long, default_value_t = 120)]
    pub timeout_s: u64,
    /// After the rounds, run this many more guests of the test guest on
    /// the same server until all are ready, and measure the server's own
    /// CPU while they idle; 0 skips it.
    #[arg(long, default_value_t = 0)]
    pub idle_guests: usize,
    /// Seconds the server is left alone once every idle guest is ready,
    /// before its CPU is measured.
    #[arg(long, default_value_t = 15)]
    pub idle_settle_s: u64,
    /// Seconds over which the idle server's CPU is measured.
    #[arg(long, default_value_t = 30)]
    pub idle_s: u64,
}

/// The run's figures (the last line of the output, as JSON).
#[derive(Debug, Clone, serde::Serialize)]
pub struct StartReport {
    pub machine: String,
    pub build: String,
    pub accelerator: String,
    pub rounds: usize,
    pub keel_start_ms: Vec<f64>,
    pub bare_start_ms: Vec<f64>,
    pub keel_stop_ms: Vec<f64>,
    pub keel_median_ms: f64,
    pub bare_median_ms: f64,
    /// Keel's median start→ready over bare's.
    pub ratio: f64,
    /// A Keel instance's command line and that of the bare start made
    /// from its record, each as the running process had it
    /// (`/proc/PID/cmdline`).
    pub keel_argv: Vec<String>,
    pub bare_argv: Vec<String>,
    /// The directories bare's vector has in place of the instance's.
    pub moved_dirs: Vec<(String, String)>,
    pub phases: Vec<phases::PhaseFigure>,
    /// The server's CPU with `--idle-guests` guests ready and idle.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idle_guests: Option<idle_guests::IdleGuestsFigures>,
}

pub fn main(args: StartArgs) -> anyhow::Result<()> {
    if args.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let guest = args
        .guest
        .clone()
        .unwrap_or_else(|| PathBuf::from("target/guest"));
    for file in ["vmlinuz", "initramfs.cpio.gz"] {
        if !guest.join(file).is_file() {
            bail!(
                "--guest: {} not found (scripts/build-test-guest builds the test guest)",
                guest.join(file).display()
            );
        }
    }
    let guest = guest
        .canonicalize()
        .with_context(|| format!("--guest {}", guest.display()))?;
    let (root, remove_root) = match &args.work_dir {
        Some(dir) => (dir.clone(), false),
        None => (
            std::env::temp_dir().join(format!("keel-bench-start-{}", std::process::id())),
            true,
        ),
    };
    std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    let root = root.canonicalize()?;
    println!("keel bench start on {}", machine());
    println!(
        "keel {} ({} build)",
        env!("CARGO_PKG_VERSION"),
        build_kind()
    );
    let report = run(&root, &guest, &args);
    if remove_root {
        let _ = std::fs::remove_dir_all(&root);
    }
    let report = report?;
    print_report(&report);
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

fn run(root: &Path, guest: &Path, args: &StartArgs) -> anyhow::Result<StartReport> {
    let timeout = Duration::from_secs(args.timeout_s);
    let data = root.join("serve");
    let runtime = root.join("run");
    std::fs::create_dir_all(&data)?;
    std::fs::create_dir_all(&runtime)?;
    let instances = data.join("node").join("instances");
    // Declared before the server: dropped after it, so no start is under
    // way when the guests are killed.
    let _guests = GuestReaper {
        instances: instances.clone(),
    };
    let mut procs = Procs::default();
    procs.log_filter = Some(phases::LOG_FILTER);
    // The idle guests share the server's node with the bench's VM: room
    // for them all on a small host (each takes 1 vCPU; the default
    // offers a few per host CPU).
    let cpu_overcommit = (args.idle_guests + 1).max(4).to_string();
    let serve = procs.spawn(
        "serve",
        &data.join("serve.log"),
        &[
            "serve",
            "--cpu-overcommit",
            &cpu_overcommit,
            "--hypervisor",
            "qemu",
            "--listen",
            "127.0.0.1:0",
            "--node",
            "bench",
            "--data-dir",
            &data.to_string_lossy(),
            "--runtime-dir",
            &runtime.to_string_lossy(),
            "--guest-dir",
            &guest.to_string_lossy(),
            "--accel",
            &args.accel,
        ],
    )?;
    let api = Api::connect(&procs, serve, &data)?;
    let cli = Cli { data: data.clone() };
    let readiness = format!("console:{READY_TEXT}");
    cli.run(
        &[
            "vm",
            "create",
            VM,
            "--memory",
            "128",
            "--disk",
            "data:16",
            "--readiness",
            &readiness,
            "--stopped",
        ],
        timeout,
    )?;
    let bare_dir = root.join("bare");
    let bare_sockets = runtime.join("bare");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;

    // The warm-up: the first start makes the VM's disk and warms caches.
    let warm_up =
        keel_round(&cli, &api, &instances, timeout).context("the warm-up start through Keel")?;

    let mut keel_start = Vec::new();
    let mut keel_stop = Vec::new();
    let mut bare_start = Vec::new();
    let mut starts = Vec::new();
    // The latest Keel instance's record and command line, which the next
    // bare start runs; and the last pair compared.
    let mut last = (warm_up.launch, warm_up.argv);
    let mut compared = None;
    for round in 0..args.rounds {
        let keel_first = round % 2 == 0;
        for keel_turn in [keel_first, !keel_first] {
            if keel_turn {
                let r = keel_round(&cli, &api, &instances, timeout)
                    .with_context(|| format!("round {}: the start through Keel", round + 1))?;
                println!(
                    "round {}: keel start→ready {:.0} ms, stop {:.0} ms",
                    round + 1,
                    r.start_ms,
                    r.stop_ms
                );
                keel_start.push(r.start_ms);
                keel_stop.push(r.stop_ms);
                starts.push(r.marks);
                last = (r.launch, r.argv);
            } else {
                let (launch, keel_argv) = &last;
                let argv = launch.argv_in(&bare_dir, &bare_sockets);
                let (ms, bare_argv) =
                    bare_round(&rt, launch, &argv, &bare_dir, &bare_sockets, timeout)
                        .with_context(|| format!("round {}: the bare start", round + 1))?;
                println!("round {}: bare start→ready {ms:.0} ms", round + 1);
                bare_start.push(ms);
                compared = Some((launch.clone(), keel_argv.clone(), bare_argv));
            }
        }
    }
    procs.check_alive(serve)?;
    let idle_guests = if args.idle_guests > 0 {
        let figures = idle_guests::run(
            &cli,
            &api,
            procs.pid(serve),
            args.idle_guests,
            Duration::from_secs(args.idle_settle_s),
            Duration::from_secs(args.idle_s),
            timeout.max(Duration::from_secs(30 * args.idle_guests as u64)),
        );
        idle_guests::remove(&cli, args.idle_guests, timeout);
        procs.check_alive(serve)?;
        Some(figures?)
    } else {
        None
    };
    let (launch, keel_argv, bare_argv) = compared.expect("at least one bare round ran");
    let keel_median_ms = median(&keel_start);
    let bare_median_ms = median(&bare_start);
    let accelerator = keel_argv
        .iter()
        .skip_while(|a| *a != "-accel")
        .nth(1)
        .cloned()
        .unwrap_or_default();
    Ok(StartReport {
        machine: machine(),
        build: build_kind().into(),
        accelerator,
        rounds: args.rounds,
        keel_median_ms,
        bare_median_ms,
        ratio: keel_median_ms / bare_median_ms,
        phases: phases::figures(VM, &starts, &procs.log(serve), keel_median_ms),
        keel_start_ms: keel_start,
        bare_start_ms: bare_start,
        keel_stop_ms: keel_stop,
        keel_argv,
        bare_argv,
        moved_dirs: vec![
            (
                launch.instance_dir.to_string_lossy().into_owned(),
                bare_dir.to_string_lossy().into_owned(),
            ),
            (
                launch.socket_dir.to_string_lossy().into_owned(),
                bare_sockets.to_string_lossy().into_owned(),
            ),
        ],
        idle_guests,
    })
}

/// Kills the guests the bench's server left running when the bench ends
/// early (a failed round): QEMU runs in a session of its own and outlives
/// its `keel serve`, as it should outside a bench. Each is found by its
/// instance's pid file and killed only if its command line names that
/// instance's directory.
struct GuestReaper {
    instances: PathBuf,
}

impl Drop for GuestReaper {
    fn drop(&mut self) {
        let Ok(entries) = std::fs::read_dir(&self.instances) else {
            return;
        };
        for dir in entries.flatten().map(|e| e.path()) {
            let Some(pid) = std::fs::read_to_string(dir.join("qemu.pid"))
                .ok()
                .and_then(|p| p.trim().parse::<i32>().ok())
            else {
                continue;
            };
            let named = std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&*dir.to_string_lossy()));
            if named {
                // SAFETY: kill(2) has no memory preconditions; the process
                // was just seen running this instance.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }
}

/// This binary as the CLI, against the bench's server.
struct Cli {
    data: PathBuf,
}

impl Cli {
    fn run(&self, args: &[&str], timeout: Duration) -> anyhow::Result<()> {
        let exe = std::env::current_exe().context("locating this keel binary")?;
        let mut child = Command::new(exe)
            .args(args)
            .env("KEEL_DATA_DIR", &self.data)
            .env("KEEL_SERVER", self.server()?)
            .env("KEEL_CONFIG", "")
            .env_remove("KEEL_TOKEN")
            .env_remove("KEEL_TOKEN_FILE")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        let deadline = Instant::now() + timeout + Duration::from_secs(30);
        loop {
            if let Some(status) = child.try_wait()? {
                if status.success() {
                    return Ok(());
                }
                let mut err = String::new();
                if let Some(mut e) = child.stderr.take() {
                    use std::io::Read;
                    let _ = e.read_to_string(&mut err);
                }
                bail!("keel {}: {status}: {err}", args.join(" "));
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                bail!("keel {}: no answer within {timeout:?}", args.join(" "));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// The address the server logged.
    fn server(&self) -> anyhow::Result<String> {
        let log = std::fs::read_to_string(self.data.join("serve.log"))?;
        let addr = log
            .split("serving addr=")
            .nth(1)
            .and_then(|a| a.split_whitespace().next())
            .context("the server's address is not in its log")?;
        Ok(format!("https://{addr}"))
    }
}

struct KeelRound {
    start_ms: f64,
    stop_ms: f64,
    launch: RecordedLaunch,
    /// The running QEMU's command line.
    argv: Vec<String>,
    marks: phases::StartMarks,
}

/// One start through Keel until ready, then its stop.
fn keel_round(
    cli: &Cli,
    api: &Api,
    instances: &Path,
    timeout: Duration,
) -> anyhow::Result<KeelRound> {
    let secs = timeout.as_secs().to_string();
    let observer = phases::ConsoleObserver::watch(instances, READY_TEXT);
    let requested = phases::now_us();
    let started = Instant::now();
    cli.run(&["vm", "start", VM, "--wait", "--timeout", &secs], timeout)?;
    let start_ms = started.elapsed().as_secs_f64() * 1e3;
    let returned = phases::now_us();
    let dir = last_instance_dir(api, instances)?;
    let launch = RecordedLaunch::read(&dir)
        .with_context(|| format!("the launch record in {}", dir.display()))?;
    let pid = std::fs::read_to_string(dir.join("qemu.pid"))
        .with_context(|| format!("{}/qemu.pid", dir.display()))?;
    let argv = cmdline(pid.trim().parse().context("qemu.pid")?)?;
    if argv != launch.argv {
        bail!(
            "Keel's QEMU runs another command line than its record says:\n{argv:?}\n{:?}",
            launch.argv
        );
    }
    let console_ready = observer.finish();
    let stopping = Instant::now();
    cli.run(&["vm", "stop", VM, "--wait", "--timeout", &secs], timeout)?;
    let stop_ms = stopping.elapsed().as_secs_f64() * 1e3;
    Ok(KeelRound {
        start_ms,
        stop_ms,
        launch,
        argv,
        marks: phases::StartMarks {
            requested_us: requested,
            console_ready_us: console_ready,
            returned_us: returned,
        },
    })
}

/// The directory of the VM's current instance.
fn last_instance_dir(api: &Api, instances: &Path) -> anyhow::Result<PathBuf> {
    let vm: Value = serde_json::from_str(&api.get_text(&format!("/api/v1/vms/{VM}"))?)?;
    let id = vm["vm"]["status"]["instance"]["id"]
        .as_str()
        .context("the VM has no instance")?;
    Ok(instances.join(id))
}

/// A running process's command line.
fn cmdline(pid: u32) -> anyhow::Result<Vec<String>> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline"))
        .with_context(|| format!("the command line of process {pid}"))?;
    Ok(raw
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect::<Vec<_>>()
        .split_last()
        .map(|(_, args)| args.to_vec())
        .unwrap_or_default())
}

/// One bare start of `argv` until its console shows [`READY_TEXT`], then
/// its kill: the start's milliseconds and the command line it ran.
fn bare_round(
    rt: &tokio::runtime::Runtime,
    launch: &RecordedLaunch,
    argv: &[String],
    dir: &Path,
    sockets: &Path,
    timeout: Duration,
) -> anyhow::Result<(f64, Vec<String>)> {
    use std::os::unix::fs::DirBuilderExt;
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(sockets);
    std::fs::create_dir_all(dir)?;
    std::fs::DirBuilder::new().mode(0o700).create(sockets)?;
    let console = dir.join("console.log");
    let mut changes = {
        let _in_runtime = rt.enter();
        keel_hv::qemu::console_watch::ConsoleChanges::watch(&console)
            .context("watching the bare console log")?
    };
    let started = Instant::now();
    let mut qemu = rt
        .block_on(bare::start(
            argv,
            dir,
            &sockets.join("qmp.sock"),
            launch.user_net.as_deref(),
            Path::new("passt"),
            timeout,
        ))
        .map_err(|e| anyhow::anyhow!("{e}; qemu log: {}", qemu_log(dir)))?;
    let ran = cmdline(qemu.child.id().context("the bare QEMU's pid")?)?;
    let left = timeout.saturating_sub(started.elapsed());
    let ready = rt.block_on(async {
        tokio::select! {
            shown = tokio::time::timeout(
                left,
                bare::console_shows(&mut changes, &console, READY_TEXT),
            ) => match shown {
                Ok(Ok(())) => Ok(started.elapsed()),
                Ok(Err(e)) => Err(anyhow::anyhow!("watching the bare console log: {e}")),
                Err(_) => Err(anyhow::anyhow!(
                    "the bare guest printed no {READY_TEXT} within {timeout:?}"
                )),
            },
            status = qemu.child.wait() => Err(anyhow::anyhow!(
                "bare QEMU exited ({}): {}",
                status.map(|s| s.to_string()).unwrap_or_else(|e| e.to_string()),
                qemu_log(dir)
            )),
        }
    })?;
    rt.block_on(async {
        let _ = qemu.child.start_kill();
        let _ = qemu.child.wait().await;
    });
    drop(qemu);
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(sockets);
    Ok((ready.as_secs_f64() * 1e3, ran))
}

fn qemu_log(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("qemu.log")).unwrap_or_default()
}

/// The middle of the samples (the mean of the two middle ones for an
/// even count).
pub fn median(samples: &[f64]) -> f64 {
    if samples.is_empty() {
        return 0.0;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    if sorted.len().is_multiple_of(2) {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    } else {
        sorted[mid]
    }
}

fn spread(samples: &[f64]) -> (f64, f64) {
    let min = samples.iter().copied().fold(f64::INFINITY, f64::min);
    let max = samples.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (min, max)
}

fn print_report(r: &StartReport) {
    let (kmin, kmax) = spread(&r.keel_start_ms);
    let (bmin, bmax) = spread(&r.bare_start_ms);
    let (smin, smax) = spread(&r.keel_stop_ms);
    println!(
        "start→ready over {} rounds ({} build, accelerator {}):",
        r.rounds, r.build, r.accelerator
    );
    println!(
        "  keel  median {:.0} ms (min {kmin:.0}, max {kmax:.0})",
        r.keel_median_ms
    );
    println!(
        "  bare  median {:.0} ms (min {bmin:.0}, max {bmax:.0}), Keel's own QEMU command line",
        r.bare_median_ms
    );
    println!("  Keel/bare {:.3}", r.ratio);
    println!(
        "  keel stop median {:.0} ms (min {smin:.0}, max {smax:.0})",
        median(&r.keel_stop_ms)
    );
    phases::print(&r.phases);
    if let Some(g) = &r.idle_guests {
        println!(
            "  idle: keel serve used {cpu:.2}% of a core over {window:.0} s with {n} real guests \
             ready and idle ({settle:.0} s after the last was ready, {ready:.0} s to get all ready; \
             QEMU's own CPU not counted)",
            cpu = g.idle.cpu_percent_of_core,
            window = g.idle.window_s,
            n = g.guests,
            settle = g.idle.settle_s,
            ready = g.all_ready_s,
        );
    }
}
