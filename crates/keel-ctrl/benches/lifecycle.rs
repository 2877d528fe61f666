//! Lifecycle latency of real QEMU guests under the real controller runtime.
//!
//! `cargo bench -p keel-ctrl --bench lifecycle` (runs: env `KEEL_BENCH_N`,
//! default 5; guest: `bash scripts/build-test-guest`, or `KEEL_GUEST_DIR`).
//!
//! The setup is the one of `tests/qemu/mod.rs`: a temp data dir, the QEMU
//! driver forced to TCG, an SQLite store, and `run_vm_controller` with the
//! default `LifecycleConfig` (what `keel serve` uses: first stop re-check
//! 1 s after the power button, then 2, 4, … s). The user acts as the API
//! does: read the record, modify it, compare-and-swap it back. Each run
//! creates a fresh VM (1 vCPU, 256 MiB, one 64 MiB disk, `Manual` policy,
//! 30 s grace), then restarts it, then stops it.
//!
//! All instants are wall-clock milliseconds (`SystemTime`), because the one
//! instant Keel records, `status.stop.requested_at`, is wall-clock ms as
//! taken by the controller's `SystemClock` just before it persists the stop
//! schedule and sends the ACPI power-down (QMP `system_powerdown`). A
//! helper thread samples, every 2 ms:
//! - `/proc` for a new `qemu-system` process whose command line names this
//!   bench's temp dir and `guest=<vm>-…` ("QEMU started": the first sample
//!   that shows the exec'd command line; processes that existed before the
//!   request are ignored, so the old QEMU of a restart never counts);
//! - the new instance's console log, reading only the bytes appended since
//!   the last sample, for `KEEL-GUEST-READY` ("ready");
//! - `/proc/<pid>/stat` of the old QEMU ("process gone": no entry, or a
//!   zombie, i.e. the process has exited).
//!
//! The async side polls the VM record every 5 ms for `status.stop` (to read
//! `requested_at`) and, for stop, for the phase `Stopped`. Sampling error
//! is a few ms per instant; `requested_at` is truncated to the ms.
//!
//! The figures (t0 = just before the user's compare-and-swap write; for
//! create, just before the record is created):
//! 1. create → ready = ready − t0.
//!    guest = ready − QEMU started (QEMU's own start-up, firmware, kernel,
//!    init up to the marker: all hypervisor/guest time).
//! 2. stop → gone = gone − t0.
//!    guest = gone − stop.requested_at (the guest's ACPI power-off and
//!    QEMU's exit).
//! 3. restart → ready = new instance's ready − t0.
//!    guest = (old gone − stop.requested_at) + (new ready − new QEMU
//!    started): the old guest's power-off plus the new guest's boot.
//! 4. keel overhead = total − guest, per run (then median/min/max over the
//!    runs). It is everything Keel itself adds:
//!    - create: record write, the controller's watch wake-up and reconcile,
//!      listing the node's domains, recording the instance, creating the
//!      disk (qemu-img), staging the instance dir and spawning QEMU;
//!    - stop: record write → watch → reconcile → `info` → persist the stop
//!      schedule → power button (request → `requested_at`);
//!    - restart: the same up to the power button, plus the gap between the
//!      old QEMU exiting and the new one being spawned. Nothing tells the
//!      controller that QEMU exited: it looks again only at the stop
//!      schedule's re-checks, the first 1 s after the press. The test
//!      guest powers off in ~40 ms, yet the restart still waits until that
//!      re-check (~0.96 s more) before Keel notices, cleans up, records the
//!      new instance and starts it. That wait is Keel's, and it dominates
//!      the restart overhead.
//!
//!    The breakdown under the table shows these parts separately, and also
//!    stop → record `Stopped`: when the record (and so `keel vm get`) says
//!    the VM stopped, which waits for the same re-check.
//!
//! Every QEMU whose command line names the bench's temp dir is killed at the
//! end, also on a panic or Ctrl-C (the `Reaper` guard).

use std::collections::HashSet;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use keel_api::{
    Clock, Phase, RunPolicy, StopReason, SystemClock, ValidationError, VirtualMachine, VmSpec,
};
use keel_ctrl::keys::vm_key;
use keel_ctrl::{
    run_control_plane, run_vm_controller, ClusterController, LifecycleConfig, VmController,
};
use keel_hv::guest::READY_MARKER;
use keel_hv::qemu::{AccelChoice, QemuConfig, QemuDriver};
use keel_store::sqlite::SqliteStore;
use keel_store::{StoreError, TypedStore};
use tokio::sync::watch;

/// Sampling interval of `/proc` and the console log.
const SAMPLE: Duration = Duration::from_millis(2);
/// Polling interval of the VM record.
const RECORD_POLL: Duration = Duration::from_millis(5);
/// Longest any one operation may take before the bench gives up.
const OP_TIMEOUT: Duration = Duration::from_secs(90);

type Res<T> = Result<T, String>;

/// Set when the bench ends early (error, panic, Ctrl-C): samplers give up,
/// so shutting the runtime down does not wait for their timeouts.
static ABORT: AtomicBool = AtomicBool::new(false);

/// The tokio runtime, shut down without waiting for sampler threads.
struct Runtime(Option<tokio::runtime::Runtime>);

impl Drop for Runtime {
    fn drop(&mut self) {
        ABORT.store(true, Ordering::SeqCst);
        if let Some(rt) = self.0.take() {
            rt.shutdown_timeout(Duration::from_secs(2));
        }
    }
}

fn main() {
    // `cargo bench` passes `--bench`; a `cargo test --benches` build runs
    // the binary without it, and real guests are too slow for that.
    if !std::env::args().any(|a| a == "--bench") {
        println!(
            "lifecycle: real-QEMU benchmark; run `cargo bench -p keel-ctrl --bench lifecycle`"
        );
        return;
    }
    let code = match run() {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("lifecycle bench failed: {e}");
            1
        }
    };
    std::process::exit(code);
}

fn run() -> Res<()> {
    let runs: usize = match std::env::var("KEEL_BENCH_N") {
        Ok(v) => v
            .parse()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| format!("KEEL_BENCH_N={v:?}: expected a positive integer"))?,
        Err(_) => 5,
    };
    let guest = guest_dir()?;
    let dir = tempfile::Builder::new()
        .prefix("kb")
        .tempdir()
        .map_err(|e| format!("temp dir: {e}"))?;
    let data_dir = dir
        .path()
        .canonicalize()
        .map_err(|e| format!("temp dir: {e}"))?;
    // Declared before the runtime, so it is dropped after it: the
    // controller is gone before the QEMUs are killed.
    let _reaper = Reaper {
        needle: data_dir.to_string_lossy().into_owned(),
        _dir: dir,
    };
    let rt = Runtime(Some(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| format!("tokio runtime: {e}"))?,
    ));
    rt.0.as_ref().expect("set above").block_on(async {
        tokio::select! {
            r = bench(runs, &guest, &data_dir) => r,
            _ = tokio::signal::ctrl_c() => Err("interrupted".to_string()),
        }
    })
}

fn guest_dir() -> Res<PathBuf> {
    keel_testkit::guest::locate()
}

fn wall_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1000.0)
        .unwrap_or(0.0)
}

// ---------------------------------------------------------------- /proc

/// The NUL-separated argument vector of `pid`; `None` if it is gone, a
/// zombie (empty cmdline) or still inside execve.
fn cmdline(pid: i32) -> Option<Vec<String>> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    if raw.is_empty() {
        return None;
    }
    Some(
        raw.split(|b| *b == 0)
            .filter(|s| !s.is_empty())
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .collect(),
    )
}

/// Exists in /proc and is not a zombie.
fn is_alive(pid: i32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    match stat
        .rfind(')')
        .and_then(|i| stat[i + 1..].split_whitespace().next())
    {
        Some(state) => !matches!(state, "Z" | "X" | "x"),
        None => false,
    }
}

fn all_pids() -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return vec![];
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .collect()
}

fn is_qemu_of(args: &[String], needle: &str) -> bool {
    args.first().is_some_and(|a| a.contains("qemu-system"))
        && args.iter().any(|a| a.contains(needle))
}

/// The instance id in QEMU's `-name guest=<instance>` argument.
fn instance_of(args: &[String]) -> Option<String> {
    args.iter().find_map(|a| {
        let rest = a.strip_prefix("guest=")?;
        Some(rest.split(',').next().unwrap_or(rest).to_string())
    })
}

/// Kills every QEMU whose command line names the bench's temp dir, then
/// lets the temp dir go.
struct Reaper {
    needle: String,
    _dir: tempfile::TempDir,
}

impl Drop for Reaper {
    fn drop(&mut self) {
        let pids: Vec<i32> = all_pids()
            .into_iter()
            .filter(|p| cmdline(*p).is_some_and(|a| is_qemu_of(&a, &self.needle)))
            .collect();
        for pid in &pids {
            // SAFETY: kill(2) of a QEMU whose command line names our temp dir.
            unsafe { libc::kill(*pid, libc::SIGKILL) };
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while pids.iter().any(|p| is_alive(*p)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        if !pids.is_empty() {
            eprintln!(
                "lifecycle: killed {} QEMU process(es) of the bench",
                pids.len()
            );
        }
    }
}

// ---------------------------------------------------------- the sampler

/// What the sampler thread looks for.
struct Sampler {
    /// Part of every command line of this bench's QEMUs (the temp dir).
    needle: String,
    /// New QEMU: an instance of this VM (`guest=<vm>-…`), then its marker.
    new_of_vm: Option<String>,
    /// Old QEMU, to see it gone.
    old_pid: Option<i32>,
    /// Processes that existed before the request; never the new QEMU.
    before: HashSet<i32>,
    driver: QemuDriver,
}

#[derive(Debug, Default)]
struct Seen {
    old_gone: Option<f64>,
    new: Option<NewQemu>,
}

#[derive(Debug, Clone)]
struct NewQemu {
    pid: i32,
    instance: String,
    started: f64,
    ready: Option<f64>,
}

impl Sampler {
    /// Takes the snapshot of existing processes: call before the request.
    fn new(
        driver: &QemuDriver,
        needle: &str,
        new_of_vm: Option<&str>,
        old_pid: Option<i32>,
    ) -> Self {
        Sampler {
            needle: needle.to_string(),
            new_of_vm: new_of_vm.map(str::to_string),
            old_pid,
            before: all_pids().into_iter().collect(),
            driver: driver.clone(),
        }
    }

    fn run(self) -> Res<Seen> {
        let deadline = Instant::now() + OP_TIMEOUT;
        let mut seen = Seen::default();
        let mut console: Option<(PathBuf, Option<File>, Vec<u8>)> = None;
        loop {
            let now = wall_ms();
            if let (Some(pid), None) = (self.old_pid, seen.old_gone) {
                if !is_alive(pid) {
                    seen.old_gone = Some(now);
                }
            }
            if let (Some(vm), None) = (&self.new_of_vm, &seen.new) {
                let prefix = format!("{vm}-");
                let found = all_pids()
                    .into_iter()
                    .filter(|p| !self.before.contains(p))
                    .find_map(|p| {
                        let args = cmdline(p)?;
                        let inst = instance_of(&args)?;
                        (is_qemu_of(&args, &self.needle) && inst.starts_with(&prefix))
                            .then_some((p, inst))
                    });
                if let Some((pid, instance)) = found {
                    if let Some(old) = seen.old_gone.is_none().then_some(self.old_pid).flatten() {
                        if is_alive(old) {
                            return Err(format!(
                                "new QEMU {instance} (pid {pid}) started while the old one \
                                 (pid {old}) still runs"
                            ));
                        }
                    }
                    console = Some((self.driver.console_log(&instance), None, Vec::new()));
                    seen.new = Some(NewQemu {
                        pid,
                        instance,
                        started: now,
                        ready: None,
                    });
                }
            }
            if let (Some(new), Some((path, file, buf))) = (seen.new.as_mut(), console.as_mut()) {
                if file.is_none() {
                    *file = File::open(&*path).ok();
                }
                if let Some(f) = file.as_mut() {
                    // Only what was appended since the last sample: a read
                    // at end of file returns whatever the file grew by.
                    let from = buf.len().saturating_sub(READY_MARKER.len());
                    let _ = f.read_to_end(buf);
                    if buf[from..]
                        .windows(READY_MARKER.len())
                        .any(|w| w == READY_MARKER.as_bytes())
                    {
                        new.ready = Some(wall_ms());
                    } else if !is_alive(new.pid) {
                        return Err(format!(
                            "QEMU of {} (pid {}) exited before its guest was ready; console:\n{}",
                            new.instance,
                            new.pid,
                            String::from_utf8_lossy(&buf[buf.len().saturating_sub(2000)..])
                        ));
                    }
                }
            }
            let old_done = self.old_pid.is_none() || seen.old_gone.is_some();
            let new_done =
                self.new_of_vm.is_none() || seen.new.as_ref().is_some_and(|n| n.ready.is_some());
            if old_done && new_done {
                return Ok(seen);
            }
            if ABORT.load(Ordering::SeqCst) {
                return Err("aborted".into());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "not done within {OP_TIMEOUT:?}: waiting for {}{}; seen so far: {seen:?}",
                    if old_done {
                        ""
                    } else {
                        "the old QEMU to exit "
                    },
                    if new_done {
                        ""
                    } else {
                        "a new QEMU and its ready marker"
                    },
                ));
            }
            std::thread::sleep(SAMPLE);
        }
    }
}

// -------------------------------------------------------------- the bench

struct Bench {
    driver: QemuDriver,
    store: TypedStore,
    needle: String,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
    control: tokio::task::JoinHandle<()>,
}

impl Drop for Bench {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        self.task.abort();
        self.control.abort();
    }
}

impl Bench {
    async fn new(guest: &Path, data_dir: &Path) -> Res<Bench> {
        let mut config = QemuConfig::new(data_dir.join("node")).with_test_guest(guest);
        config.accel = AccelChoice::Tcg;
        let driver = QemuDriver::new(config)
            .await
            .map_err(|e| format!("QEMU driver: {e}"))?;
        let store = TypedStore::new(Arc::new(
            SqliteStore::open(data_dir.join("keel.db")).map_err(|e| format!("SQLite: {e}"))?,
        ));
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        // As `keel serve` runs it: the default lifecycle tunables.
        let cfg = LifecycleConfig {
            node: "local".into(),
            ..Default::default()
        };
        let ctrl = Arc::new(VmController::new(
            store.clone(),
            Arc::new(driver.clone()),
            clock.clone(),
            cfg.clone(),
        ));
        // As `keel serve` on SQLite: the sole cluster controller places.
        let cluster = Arc::new(ClusterController::sole(store.clone(), clock.clone(), cfg));
        ctrl.heartbeat(None)
            .await
            .map_err(|e| format!("node heartbeat: {e}"))?;
        let (stop, stop_rx) = watch::channel(false);
        let control = tokio::spawn(run_control_plane(cluster, stop_rx.clone()));
        let task = tokio::spawn(run_vm_controller(ctrl, clock, stop_rx));
        Ok(Bench {
            driver,
            store,
            needle: data_dir.to_string_lossy().into_owned(),
            stop,
            task,
            control,
        })
    }

    fn spec() -> VmSpec {
        VmSpec {
            memory_mib: 256,
            disks: vec![keel_testkit::spec::disk("data", 64)],
            run_policy: RunPolicy::Manual,
            stop_grace_period_s: 30,
            ..keel_testkit::spec::vm_spec()
        }
    }

    async fn vm(&self, name: &str) -> Res<VirtualMachine> {
        self.store
            .get::<VirtualMachine>(&vm_key(name))
            .await
            .map_err(|e| format!("read VM {name}: {e}"))?
            .map(|e| e.value)
            .ok_or_else(|| format!("VM record {name} missing"))
    }

    /// A user request, as the API makes it: read, modify, compare-and-swap.
    async fn user(
        &self,
        name: &str,
        op: impl Fn(&mut VirtualMachine) -> Result<(), ValidationError>,
    ) -> Res<()> {
        loop {
            let e = self
                .store
                .get::<VirtualMachine>(&vm_key(name))
                .await
                .map_err(|e| format!("read VM {name}: {e}"))?
                .ok_or_else(|| format!("VM record {name} missing"))?;
            let mut vm = e.value;
            op(&mut vm).map_err(|e| format!("request on VM {name}: {e}"))?;
            match self.store.update(&vm_key(name), &vm, e.revision).await {
                Ok(_) => return Ok(()),
                Err(StoreError::Conflict { .. }) => continue,
                Err(e) => return Err(format!("write VM {name}: {e}")),
            }
        }
    }

    /// Polls the record until the stop schedule shows up; its `requested_at`.
    /// `instance` is the one being stopped.
    async fn stop_requested_at(&self, name: &str, instance: &str, reason: StopReason) -> Res<f64> {
        let deadline = Instant::now() + OP_TIMEOUT;
        loop {
            let vm = self.vm(name).await?;
            if let Some(stop) = &vm.status.stop {
                if stop.reason != reason {
                    return Err(format!(
                        "VM {name}: stop for {:?}, expected {reason:?}",
                        stop.reason
                    ));
                }
                return Ok(stop.requested_at as f64);
            }
            if vm.status.instance.as_ref().map(|i| i.id.as_str()) != Some(instance) {
                return Err(format!(
                    "VM {name}: the stop of {instance} finished before the bench saw its \
                     schedule: {vm:?}"
                ));
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "VM {name}: no stop schedule within {OP_TIMEOUT:?}: {vm:?}"
                ));
            }
            tokio::time::sleep(RECORD_POLL).await;
        }
    }

    /// Polls the record until it says `Stopped` with no instance.
    async fn stopped_recorded(&self, name: &str) -> Res<f64> {
        let deadline = Instant::now() + OP_TIMEOUT;
        loop {
            let vm = self.vm(name).await?;
            if vm.status.phase == Phase::Stopped && vm.status.instance.is_none() {
                return Ok(wall_ms());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "VM {name}: not Stopped within {OP_TIMEOUT:?}: {vm:?}"
                ));
            }
            tokio::time::sleep(RECORD_POLL).await;
        }
    }

    fn sampler(&self, new_of_vm: Option<&str>, old_pid: Option<i32>) -> Sampler {
        Sampler::new(&self.driver, &self.needle, new_of_vm, old_pid)
    }
}

/// Starts sampling now (before the request is made).
fn sample(sampler: Sampler) -> impl std::future::Future<Output = Res<Seen>> {
    let thread = tokio::task::spawn_blocking(move || sampler.run());
    async move { thread.await.map_err(|e| format!("sampler thread: {e}"))? }
}

/// One run: create → ready, restart → ready, stop → gone.
async fn one_run(b: &Bench, name: &str, stats: &mut Stats) -> Res<()> {
    // 1. create → ready.
    let sampler = b.sampler(Some(name), None);
    let watching = sample(sampler);
    let t0 = wall_ms();
    b.store
        .create(&vm_key(name), &VirtualMachine::new(name, Bench::spec()))
        .await
        .map_err(|e| format!("create VM {name}: {e}"))?;
    let seen = watching.await?;
    let new = seen.new.expect("sampler returns only when done");
    let ready = new.ready.expect("sampler returns only when done");
    stats.add("create.total", ready - t0);
    stats.add("create.guest", ready - new.started);
    stats.add("create.overhead", new.started - t0);

    // 2. restart → ready.
    let old = new;
    let sampler = b.sampler(Some(name), Some(old.pid));
    let watching = sample(sampler);
    let t0 = wall_ms();
    b.user(name, VirtualMachine::request_restart).await?;
    let (pressed, seen) = tokio::join!(
        b.stop_requested_at(name, &old.instance, StopReason::Restart),
        watching
    );
    let (pressed, seen) = (pressed?, seen?);
    let old_gone = seen.old_gone.expect("sampler returns only when done");
    let new = seen.new.expect("sampler returns only when done");
    let ready = new.ready.expect("sampler returns only when done");
    if new.instance == old.instance {
        return Err(format!("restart of {name} kept instance {}", old.instance));
    }
    let total = ready - t0;
    let guest = (old_gone - pressed) + (ready - new.started);
    stats.add("restart.total", total);
    stats.add("restart.guest", guest);
    stats.add("restart.overhead", total - guest);
    stats.add("restart.press", pressed - t0);
    stats.add("restart.poweroff", old_gone - pressed);
    stats.add("restart.gap", new.started - old_gone);
    stats.add("restart.boot", ready - new.started);

    // 3. stop → gone.
    let sampler = b.sampler(None, Some(new.pid));
    let watching = sample(sampler);
    let t0 = wall_ms();
    b.user(name, VirtualMachine::request_stop).await?;
    let recorded = async {
        let pressed = b
            .stop_requested_at(name, &new.instance, StopReason::User)
            .await?;
        Ok::<_, String>((pressed, b.stopped_recorded(name).await?))
    };
    let (recorded, seen) = tokio::join!(recorded, watching);
    let ((pressed, stopped), seen) = (recorded?, seen?);
    let gone = seen.old_gone.expect("sampler returns only when done");
    stats.add("stop.total", gone - t0);
    stats.add("stop.guest", gone - pressed);
    stats.add("stop.overhead", pressed - t0);
    stats.add("stop.recorded", stopped - t0);

    eprintln!(
        "  {name}: create→ready {:.3} s, restart→ready {:.3} s, stop→gone {:.3} s",
        stats.last("create.total") / 1000.0,
        stats.last("restart.total") / 1000.0,
        stats.last("stop.total") / 1000.0,
    );
    Ok(())
}

async fn bench(runs: usize, guest: &Path, data_dir: &Path) -> Res<()> {
    let b = Bench::new(guest, data_dir).await?;
    eprintln!(
        "lifecycle: {runs} run(s), QEMU {:?}, 1 vCPU / 256 MiB test guest, SQLite store, data dir {}",
        b.driver.accelerator().await,
        data_dir.display()
    );
    let mut stats = Stats::default();
    for i in 0..runs {
        one_run(&b, &format!("bench-{i}"), &mut stats).await?;
    }
    print_report(runs, &stats);
    Ok(())
}

// -------------------------------------------------------------- report

#[derive(Default)]
struct Stats(Vec<(&'static str, Vec<f64>)>);

impl Stats {
    fn add(&mut self, key: &'static str, ms: f64) {
        match self.0.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push(ms),
            None => self.0.push((key, vec![ms])),
        }
    }

    fn get(&self, key: &str) -> Vec<f64> {
        let mut v = self
            .0
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        v.sort_by(f64::total_cmp);
        v
    }

    fn last(&self, key: &str) -> f64 {
        self.0
            .iter()
            .find(|(k, _)| *k == key)
            .and_then(|(_, v)| v.last().copied())
            .unwrap_or(f64::NAN)
    }

    fn median(&self, key: &str) -> f64 {
        let v = self.get(key);
        match v.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => v[n / 2],
            n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        }
    }

    /// `median 3.120 s (min 3.010, max 3.300)`
    fn summary(&self, key: &str) -> String {
        let v = self.get(key);
        format!(
            "median {:6.3} s (min {:6.3}, max {:6.3})",
            self.median(key) / 1000.0,
            v.first().copied().unwrap_or(f64::NAN) / 1000.0,
            v.last().copied().unwrap_or(f64::NAN) / 1000.0,
        )
    }
}

fn print_report(runs: usize, s: &Stats) {
    println!();
    println!("Keel lifecycle, real QEMU (TCG) under run_vm_controller, N = {runs}");
    println!("guest = hypervisor-side time; keel overhead = total - guest, per run");
    println!();
    println!(
        "{:<14} {:<41} {:<16} keel overhead",
        "operation", "total", "guest"
    );
    for (label, op) in [
        ("create→ready", "create"),
        ("stop→gone", "stop"),
        ("restart→ready", "restart"),
    ] {
        println!(
            "{label:<14} {:<41} median {:6.3} s  {}",
            s.summary(&format!("{op}.total")),
            s.median(&format!("{op}.guest")) / 1000.0,
            s.summary(&format!("{op}.overhead")),
        );
    }
    println!();
    println!("breakdown:");
    for (label, tag, key) in [
        ("create:  request → QEMU started", "keel", "create.overhead"),
        ("create:  QEMU started → ready", "guest", "create.guest"),
        ("stop:    request → power button", "keel", "stop.overhead"),
        ("stop:    power button → QEMU gone", "guest", "stop.guest"),
        ("stop:    request → record Stopped", "", "stop.recorded"),
        ("restart: request → power button", "keel", "restart.press"),
        (
            "restart: power button → old QEMU gone",
            "guest",
            "restart.poweroff",
        ),
        (
            "restart: old QEMU gone → new QEMU started",
            "keel",
            "restart.gap",
        ),
        ("restart: new QEMU started → ready", "guest", "restart.boot"),
    ] {
        println!("  {label:<42} {tag:<6} {}", s.summary(key));
    }
}
