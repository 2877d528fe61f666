//! Choosing between KVM and TCG.
//!
//! `/dev/kvm` existing does not mean KVM works: nested virtualization can
//! hang a guest or fail late. So `Auto` boots the test guest under KVM once,
//! when the driver is built, and uses KVM only if it reaches the ready marker
//! within the probe timeout. The outcome and the reason are reported in
//! `NodeFacts`, so an operator can see why a node emulates.

use std::path::Path;
use std::time::{Duration, Instant};

use keel_api::Accelerator;

use super::layout::{self, InstancePaths, LaunchPlan};
use super::proc;
use super::{spawn_qemu, tail, QemuConfig};
use crate::guest;

pub use super::accel_choice::{AccelChoice, AccelParseError, ACCEL_ENV};

/// Settles the accelerator for the driver's lifetime; returns it and why.
/// `scratch` holds the probe guest's files, `runtime` its sockets' dir.
pub(super) async fn choose(
    config: &QemuConfig,
    scratch: &Path,
    runtime: &Path,
) -> (Accelerator, String) {
    match config.accel {
        AccelChoice::Kvm => (Accelerator::Kvm, "kvm forced by configuration".into()),
        AccelChoice::Tcg => (Accelerator::Tcg, "tcg forced by configuration".into()),
        AccelChoice::Auto => match probe_kvm(config, scratch, runtime).await {
            Ok(note) => (Accelerator::Kvm, note),
            Err(why) => (Accelerator::Tcg, format!("{why}; using tcg")),
        },
    }
}

/// `Ok(note)` if KVM booted the test guest; `Err(reason)` otherwise.
async fn probe_kvm(config: &QemuConfig, scratch: &Path, runtime: &Path) -> Result<String, String> {
    let kvm = Path::new("/dev/kvm");
    if !kvm.exists() {
        return Err("/dev/kvm not present".into());
    }
    if let Err(e) = std::fs::OpenOptions::new().read(true).write(true).open(kvm) {
        return Err(format!("/dev/kvm not usable: {e}"));
    }
    let Some(kernel) = config.default_kernel.clone() else {
        return Err("no default test guest configured to probe kvm with".into());
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
        .map_err(|e| format!("kvm probe: {}: {e}", scratch.display()))?;
    let plan = LaunchPlan {
        instance: "kvm-probe".into(),
        paths: paths.clone(),
        accelerator: Accelerator::Kvm,
        machine: config.machine.clone(),
        cpus: 1,
        memory_mib: 128,
        boot: super::boot::BootPlan::Kernel {
            kernel,
            initrd: config.default_initrd.clone(),
            cmdline: config.default_cmdline.clone(),
            uefi: None,
        },
        disks: vec![],
        incoming: false,
        nic: None,
        seed: None,
        direct_io: false,
    };
    let began = Instant::now();
    let outcome = match spawn_qemu(&config.qemu_binary, &plan) {
        Err(e) => Err(format!("kvm probe could not start qemu: {e}")),
        Ok(mut child) => {
            let timeout = config.probe_timeout;
            let result = tokio::select! {
                ready = guest::wait_ready(&paths.console, timeout) => match ready {
                    Ok(_) => Ok(format!("kvm probe booted the test guest in {}", fmt_duration(began.elapsed()))),
                    Err(_) => Err(format!("kvm probe timed out after {}", fmt_duration(timeout))),
                },
                status = child.wait() => Err(format!(
                    "kvm probe failed: qemu exited ({}): {}",
                    status.map(|s| s.to_string()).unwrap_or_else(|e| e.to_string()),
                    tail(&paths.qemu_log).await,
                )),
            };
            // The probe guest has served its purpose either way.
            let _ = child.start_kill();
            let _ = child.wait().await;
            result
        }
    };
    let _ = std::fs::remove_dir_all(scratch);
    let _ = paths.remove_sockets();
    outcome
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
}
