//! Choosing between KVM and TCG.
//!
//! `/dev/kvm` existing does not mean KVM works: nested virtualization can
//! hang a guest or fail late. So `Auto` boots the test guest under KVM once
//! and uses KVM only if it reaches the ready marker within the probe
//! timeout. A guest that hangs under KVM usually does so before its kernel
//! prints a line, so the probe asks the kernel to print at once and gives
//! up after [`QemuConfig::probe_banner_timeout`] of silence instead of
//! waiting the whole timeout.
//!
//! The driver settles the accelerator in the background ([`Settling`]):
//! its API is usable at once, and only a start waits for the verdict. The
//! outcome and the reason are reported in `NodeFacts`, so an operator can
//! see why a node emulates; `keel doctor` runs the same probe.

use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use keel_api::Accelerator;
use tokio::sync::watch;

use super::layout::{self, InstancePaths, LaunchPlan};
use super::proc;
use super::{spawn_qemu, tail, QemuConfig};
use crate::guest;

pub use super::accel_choice::{AccelChoice, AccelParseError, ACCEL_ENV};

/// What the kernel prints first (`Linux version 6.1.0 …`): once it is on
/// the console, the guest runs under KVM and only its boot can still fail.
const KERNEL_BANNER: &str = "Linux version";

/// The accelerator settled on, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccelVerdict {
    pub accelerator: Accelerator,
    /// For humans: what forced it, or what the KVM probe found.
    pub note: String,
}

/// Why the probe does not trust KVM; each says what was seen.
#[derive(Debug, thiserror::Error)]
pub enum KvmUnavailable {
    #[error("/dev/kvm not present")]
    Missing,
    #[error("/dev/kvm not usable")]
    NotUsable(#[source] io::Error),
    #[error("no default test guest configured to probe kvm with")]
    NoGuest,
    #[error("kvm probe: {}", path.display())]
    Scratch {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("kvm probe could not start qemu")]
    Spawn(#[source] io::Error),
    #[error("kvm probe failed: qemu exited ({status}): {log}")]
    QemuExited { status: String, log: String },
    #[error(
        "kvm probe: the kernel printed nothing within {} under KVM (nested virtualisation \
         without working acceleration?)",
        fmt_duration(*after)
    )]
    Silent { after: Duration },
    #[error(
        "kvm probe: the kernel started under KVM but the test guest printed no {} within {}",
        guest::READY_MARKER,
        fmt_duration(*after)
    )]
    NotReady { after: Duration },
}

/// Settles the accelerator; under `Auto` this boots the probe guest.
/// `scratch` holds the probe guest's files, `runtime` its sockets' dir.
pub async fn choose(config: &QemuConfig, scratch: &Path, runtime: &Path) -> AccelVerdict {
    match config.accel {
        AccelChoice::Auto => AccelVerdict::of_probe(&probe_kvm(config, scratch, runtime).await),
        forced_choice => forced(forced_choice),
    }
}

impl AccelVerdict {
    /// What `Auto` makes of a probe's outcome: one wording for the
    /// driver's facts and `keel doctor`'s report, so the two agree.
    pub fn of_probe(outcome: &Result<Duration, KvmUnavailable>) -> Self {
        match outcome {
            Ok(booted_in) => AccelVerdict {
                accelerator: Accelerator::Kvm,
                note: format!(
                    "kvm probe booted the test guest in {}",
                    fmt_duration(*booted_in)
                ),
            },
            Err(why) => AccelVerdict {
                accelerator: Accelerator::Tcg,
                note: format!("{}; using tcg", crate::cause::with_causes(why)),
            },
        }
    }
}

/// The verdict of [`choose`], reached in the background: `QemuDriver::new`
/// must not take as long as a probe boot, since `keel serve` answers no
/// request until it has a driver.
#[derive(Debug, Clone)]
pub(super) struct Settling(watch::Receiver<Option<AccelVerdict>>);

impl Settling {
    /// Probes (when there is something to probe) on a task of its own.
    pub(super) fn start(config: QemuConfig, scratch: PathBuf, runtime: PathBuf) -> Self {
        if config.accel != AccelChoice::Auto {
            let (_, rx) = watch::channel(Some(forced(config.accel)));
            return Self(rx);
        }
        let (tx, rx) = watch::channel(None);
        tokio::spawn(async move {
            let verdict = choose(&config, &scratch, &runtime).await;
            tracing::info!(accelerator = ?verdict.accelerator, note = %verdict.note, "accelerator settled");
            let _ = tx.send(Some(verdict));
        });
        Self(rx)
    }

    /// The verdict if it is in; `None` while the probe runs.
    pub(super) fn now(&self) -> Option<AccelVerdict> {
        self.0.borrow().clone()
    }

    /// Waits for the verdict; the probe's own timeouts bound the wait.
    pub(super) async fn verdict(&self) -> AccelVerdict {
        let mut rx = self.0.clone();
        let settled = rx
            .wait_for(Option::is_some)
            .await
            .ok()
            .and_then(|v| v.clone());
        // Only a probe task that panicked or was cancelled (the runtime
        // shutting down) ends without a verdict; TCG runs anywhere.
        settled.unwrap_or_else(|| AccelVerdict {
            accelerator: Accelerator::Tcg,
            note: "kvm probe ended without a verdict; using tcg".into(),
        })
    }
}

/// What a configured `kvm` or `tcg` means; no probe is run.
pub fn forced(choice: AccelChoice) -> AccelVerdict {
    let accelerator = match choice {
        AccelChoice::Kvm => Accelerator::Kvm,
        AccelChoice::Tcg | AccelChoice::Auto => Accelerator::Tcg,
    };
    AccelVerdict {
        accelerator,
        note: format!("{choice} forced by configuration"),
    }
}

/// `Ok(how long the boot took)` if KVM booted the test guest to its ready
/// marker. Leaves nothing running and nothing in `scratch`.
pub async fn probe_kvm(
    config: &QemuConfig,
    scratch: &Path,
    runtime: &Path,
) -> Result<Duration, KvmUnavailable> {
    let kvm = Path::new("/dev/kvm");
    if !kvm.exists() {
        return Err(KvmUnavailable::Missing);
    }
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(kvm)
        .map_err(KvmUnavailable::NotUsable)?;
    let Some(kernel) = config.default_kernel.clone() else {
        return Err(KvmUnavailable::NoGuest);
    };
    let paths = InstancePaths::new(
        scratch.to_path_buf(),
        layout::socket_dir_for(runtime, scratch),
    );
    // A Keel stopped mid-probe leaves its probe guest running (a healthy one
    // never exits by itself) and its scratch directory behind.
    let marker = paths.qmp_chardev_arg();
    for _ in 0..3 {
        let Some(pid) = proc::find_instance_process(&marker) else {
            break;
        };
        let Ok(fd) = proc::PidFd::open_verified(pid, &marker) else {
            continue;
        };
        tracing::info!(pid, "killing a KVM probe left by an earlier Keel");
        if fd.signal(libc::SIGKILL).is_ok() {
            let _ = tokio::time::timeout(Duration::from_secs(5), fd.exited()).await;
        }
    }
    let _ = std::fs::remove_dir_all(scratch);
    std::fs::create_dir_all(scratch)
        .and_then(|()| paths.prepare_sockets())
        .map_err(|source| KvmUnavailable::Scratch {
            path: scratch.to_path_buf(),
            source,
        })?;
    let plan = LaunchPlan {
        instance: "kvm-probe".into(),
        paths: paths.clone(),
        accelerator: Accelerator::Kvm,
        machine: config.machine.clone(),
        // What the probe asks of KVM: the host's CPU, which nested KVM
        // may refuse where a baseline model would pass.
        cpu_model: None,
        cpus: 1,
        memory_mib: 128,
        boot: super::boot::BootPlan::Kernel {
            kernel,
            initrd: config.default_initrd.clone(),
            cmdline: probe_cmdline(&config.default_cmdline),
            uefi: None,
        },
        disks: vec![],
        incoming: false,
        nic: None,
        seed: None,
        direct_io: false,
        tpm: None,
        hotplug_ports: 0,
        plugged: vec![],
        graphics: None,
        balloon: false,
    };
    let began = Instant::now();
    let outcome = match spawn_qemu(&config.qemu_binary, &plan) {
        Err(e) => Err(KvmUnavailable::Spawn(e)),
        Ok(child) => {
            let mut guest = ProbeGuest(child);
            let result = tokio::select! {
                booted = watch_console(&paths.console, config.probe_banner_timeout, config.probe_timeout) =>
                    booted.map(|()| began.elapsed()),
                status = guest.0.wait() => Err(KvmUnavailable::QemuExited {
                    status: status.map(|s| s.to_string()).unwrap_or_else(|e| e.to_string()),
                    log: tail(&paths.qemu_log).await,
                }),
            };
            // The probe guest has served its purpose either way.
            let _ = guest.0.start_kill();
            let _ = guest.0.wait().await;
            result
        }
    };
    let _ = std::fs::remove_dir_all(scratch);
    let _ = paths.remove_sockets();
    outcome
}

/// Kills the probe guest if the probe is dropped before it ends (a driver
/// dropped with its runtime): QEMU runs in a session of its own and would
/// otherwise stay until the next Keel cleans up.
struct ProbeGuest(tokio::process::Child);

impl Drop for ProbeGuest {
    fn drop(&mut self) {
        let _ = self.0.start_kill();
    }
}

/// The guests' command line with the kernel talking from its first line:
/// `quiet` would hold the banner back until the guest is nearly ready, and
/// `earlyprintk` prints before the real console is set up.
fn probe_cmdline(cmdline: &str) -> String {
    let mut words: Vec<&str> = cmdline
        .split_whitespace()
        .filter(|w| *w != "quiet" && !w.starts_with("loglevel="))
        .collect();
    if !words.iter().any(|w| w.starts_with("earlyprintk=")) {
        words.push("earlyprintk=serial,ttyS0,115200");
    }
    words.join(" ")
}

/// Waits for the kernel banner on `console` for at most `banner_within`,
/// then for the ready marker until `ready_within` (both from now).
async fn watch_console(
    console: &Path,
    banner_within: Duration,
    ready_within: Duration,
) -> Result<(), KvmUnavailable> {
    let began = Instant::now();
    let banner_within = banner_within.min(ready_within);
    loop {
        if let Ok(bytes) = tokio::fs::read(console).await {
            if memchr_str(&bytes, KERNEL_BANNER) {
                break;
            }
        }
        let waited = began.elapsed();
        if waited >= banner_within {
            return Err(KvmUnavailable::Silent {
                after: banner_within,
            });
        }
        tokio::time::sleep((banner_within - waited).min(Duration::from_millis(50))).await;
    }
    let left = ready_within.saturating_sub(began.elapsed());
    guest::wait_ready(console, left)
        .await
        .map(drop)
        .map_err(|_| KvmUnavailable::NotReady {
            after: ready_within,
        })
}

fn memchr_str(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}

/// `1ms`, `20s`, `1.5s`: for notes humans read.
pub fn fmt_duration(d: Duration) -> String {
    if d < Duration::from_secs(1) {
        format!("{}ms", d.as_millis())
    } else if d.subsec_millis() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{:.1}s", d.as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_choices() {
        assert_eq!("TCG".parse::<AccelChoice>().unwrap(), AccelChoice::Tcg);
        assert_eq!("kvm".parse::<AccelChoice>().unwrap(), AccelChoice::Kvm);
        assert_eq!("auto".parse::<AccelChoice>().unwrap(), AccelChoice::Auto);
        assert!("xen".parse::<AccelChoice>().is_err());
    }

    #[test]
    fn durations_read_well() {
        assert_eq!(fmt_duration(Duration::from_millis(1)), "1ms");
        assert_eq!(fmt_duration(Duration::from_secs(20)), "20s");
        assert_eq!(fmt_duration(Duration::from_millis(1500)), "1.5s");
    }

    #[test]
    fn the_probe_kernel_prints_from_its_first_line() {
        assert_eq!(
            probe_cmdline("console=ttyS0 panic=-1 quiet"),
            "console=ttyS0 panic=-1 earlyprintk=serial,ttyS0,115200"
        );
        assert_eq!(
            probe_cmdline("console=ttyS0 loglevel=3 earlyprintk=vga"),
            "console=ttyS0 earlyprintk=vga"
        );
    }

    /// What this project's nested-KVM host does: SeaBIOS prints, the
    /// kernel never does.
    const SEABIOS_ONLY: &str =
        "SeaBIOS (version 1.16.2)\nBooting from ROM...\nProbing EDD ... ok\n";

    #[tokio::test]
    async fn a_silent_kernel_fails_the_probe_long_before_its_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let console = dir.path().join("console.log");
        std::fs::write(&console, SEABIOS_ONLY).unwrap();
        let began = Instant::now();
        let err = watch_console(
            &console,
            Duration::from_millis(300),
            Duration::from_secs(30),
        )
        .await
        .unwrap_err();
        assert!(
            began.elapsed() < Duration::from_secs(5),
            "{:?}",
            began.elapsed()
        );
        assert!(matches!(err, KvmUnavailable::Silent { .. }), "{err:?}");
        assert_eq!(
            format!("{}; using tcg", crate::cause::with_causes(&err)),
            "kvm probe: the kernel printed nothing within 300ms under KVM (nested \
             virtualisation without working acceleration?); using tcg"
        );
    }

    #[tokio::test]
    async fn a_kernel_that_speaks_gets_the_whole_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let console = dir.path().join("console.log");
        std::fs::write(&console, SEABIOS_ONLY).unwrap();
        let late = {
            let console = console.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let banner = format!("{SEABIOS_ONLY}[    0.000000] Linux version 6.1.0\n");
                std::fs::write(&console, &banner).unwrap();
                // Well past the banner window: the ready marker still counts.
                tokio::time::sleep(Duration::from_millis(800)).await;
                std::fs::write(&console, format!("{banner}KEEL-GUEST-READY boot_id=b1\n")).unwrap();
            })
        };
        watch_console(
            &console,
            Duration::from_millis(400),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
        late.await.unwrap();

        // A banner but no marker: the full timeout, and a reason that says
        // the kernel did start.
        let began = Instant::now();
        let err = watch_console(
            &console_with_banner_only(&dir),
            Duration::from_millis(100),
            Duration::from_millis(600),
        )
        .await
        .unwrap_err();
        assert!(began.elapsed() >= Duration::from_millis(600));
        assert!(matches!(err, KvmUnavailable::NotReady { .. }), "{err:?}");
        assert!(err.to_string().contains("within 600ms"), "{err}");
    }

    fn console_with_banner_only(dir: &tempfile::TempDir) -> PathBuf {
        let console = dir.path().join("banner-only.log");
        std::fs::write(&console, "Linux version 6.1.0\n").unwrap();
        console
    }

    #[tokio::test]
    async fn a_forced_accelerator_is_there_at_once() {
        let mut config = QemuConfig::new("/nonexistent");
        config.accel = AccelChoice::Tcg;
        let settling = Settling::start(config, "/nonexistent/p".into(), "/nonexistent/r".into());
        assert_eq!(settling.now().unwrap().accelerator, Accelerator::Tcg);
        assert_eq!(settling.verdict().await.note, "tcg forced by configuration");
    }

    #[tokio::test]
    async fn auto_settles_in_the_background() {
        let dir = tempfile::tempdir().unwrap();
        // No guest to probe with: the probe fails at once, on any host.
        let config = QemuConfig::new(dir.path());
        let settling = Settling::start(config, dir.path().join("p"), dir.path().join("r"));
        assert_eq!(settling.now(), None, "start must not wait for the probe");
        let verdict = settling.verdict().await;
        assert_eq!(verdict.accelerator, Accelerator::Tcg);
        assert!(verdict.note.ends_with("; using tcg"), "{}", verdict.note);
        assert_eq!(settling.now(), Some(verdict));
    }
}
