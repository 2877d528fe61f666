//! Helpers shared by the real-QEMU tests (`tests/qemu_*.rs`) and the
//! migration benchmark (`benches/migration.rs`, which includes this file by
//! path). Each user compiles its own copy and uses only part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use keel_api::{BootSpec, DiskSpec};
use keel_hv::guest::GuestChannel;
use keel_hv::qemu::{AccelChoice, QemuConfig, QemuDriver};
use keel_hv::{DomainSpec, DomainState, Hypervisor};

/// Generous for TCG on a loaded 2-core machine; the guest boots in ~3 s.
pub const BOOT: Duration = Duration::from_secs(60);
pub const STOP: Duration = Duration::from_secs(30);

pub use keel_testkit::guest::dir as guest_dir;
pub use keel_testkit::procs::KillGuard;

/// The test configuration: the test guest, always TCG, so results do not
/// depend on the host's KVM.
pub fn tcg_config(data_dir: &Path, guest: &Path) -> QemuConfig {
    let mut config = QemuConfig::new(data_dir).with_test_guest(guest);
    config.accel = AccelChoice::Tcg;
    config
}

/// One driver on its own temporary data dir.
pub struct Fixture {
    // Dropped in this order: driver, then the guard kills, then the dir goes.
    pub driver: Option<QemuDriver>,
    _guard: KillGuard,
    pub dir: tempfile::TempDir,
    pub guest: PathBuf,
}

impl Fixture {
    pub async fn new() -> Option<Fixture> {
        Self::with(|c| c).await
    }

    pub async fn with(tweak: impl FnOnce(QemuConfig) -> QemuConfig) -> Option<Fixture> {
        let guest = guest_dir()?;
        let dir = tempfile::tempdir().unwrap();
        let data_dir = dir.path().canonicalize().unwrap();
        let guard = KillGuard {
            data_dir: data_dir.clone(),
        };
        let config = tweak(tcg_config(&data_dir, &guest));
        let driver = QemuDriver::new(config).await.unwrap();
        Some(Fixture {
            driver: Some(driver),
            _guard: guard,
            dir,
            guest,
        })
    }

    pub fn hv(&self) -> &QemuDriver {
        self.driver.as_ref().expect("driver open")
    }

    /// Drops the driver (monitors stop, QEMUs keep running) and builds a new
    /// one on the same data dir, as after a Keel restart.
    pub async fn reopen(&mut self) {
        drop(self.driver.take());
        let config = tcg_config(self.dir.path(), &self.guest);
        self.driver = Some(QemuDriver::new(config).await.unwrap());
    }

    pub async fn boot(&self, vm: &str, instance: &str) -> GuestChannel {
        boot(self.hv(), &spec(vm, instance)).await
    }

    pub async fn wait_for(
        &self,
        instance: &str,
        timeout: Duration,
        done: impl Fn(&DomainState) -> bool,
    ) -> DomainState {
        wait_for(self.hv(), instance, timeout, done).await
    }
}

/// Several drivers ("nodes") on one host: each its own data dir under one
/// temporary root, all sharing `root/disks` as the disk dir, as nodes
/// sharing storage would.
pub struct Cluster {
    // The nodes the test builds are dropped before this: guard, then dir.
    _guard: KillGuard,
    pub dir: tempfile::TempDir,
    pub guest: PathBuf,
    pub disks: PathBuf,
}

impl Cluster {
    pub fn new() -> Option<Cluster> {
        let guest = guest_dir()?;
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        Some(Cluster {
            _guard: KillGuard {
                data_dir: root.clone(),
            },
            disks: root.join("disks"),
            dir,
            guest,
        })
    }

    pub fn config(&self, node: &str) -> QemuConfig {
        let mut config = tcg_config(&self.dir.path().join(node), &self.guest);
        config.disk_dir = Some(self.disks.clone());
        config
    }

    pub async fn node(&self, node: &str) -> QemuDriver {
        self.node_with(node, |c| c).await
    }

    pub async fn node_with(
        &self,
        node: &str,
        tweak: impl FnOnce(QemuConfig) -> QemuConfig,
    ) -> QemuDriver {
        QemuDriver::new(tweak(self.config(node))).await.unwrap()
    }
}

pub fn spec(vm: &str, instance: &str) -> DomainSpec {
    DomainSpec {
        vm: vm.into(),
        instance: instance.into(),
        cpus: 1,
        memory_mib: 256,
        disks: vec![DiskSpec {
            name: "data".into(),
            size_mib: 64,
            image: None,
        }],
        boot: BootSpec::default(),
        create_disks: keel_hv::DiskCreation::Only(vec!["data".into()]),
        network: Default::default(),
        cloud_init: None,
        fenced: true,
        images: vec![],
        hardware: None,
        hotplug_ports: 0,
        plugged: Vec::new(),
        clone_from: None,
        recorded_firmware: None,
        tpm: None,
        balloon: false,
    }
}

/// Starts `spec` and returns the guest's command channel, synced.
pub async fn boot(hv: &QemuDriver, spec: &DomainSpec) -> GuestChannel {
    let instance = spec.instance.as_str();
    let t = Instant::now();
    hv.start(spec).await.unwrap();
    let started = t.elapsed();
    GuestChannel::wait_ready(&hv.console_log(instance), BOOT)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "{e}\nconsole:\n{}",
                std::fs::read_to_string(hv.console_log(instance)).unwrap_or_default()
            )
        });
    eprintln!(
        "{instance}: start returned in {started:?}, guest ready after {:?}",
        t.elapsed()
    );
    let mut ch = GuestChannel::connect(hv.command_socket(instance))
        .await
        .unwrap();
    ch.sync(BOOT).await.unwrap();
    ch
}

/// Polls `info` until `done` holds; no fixed sleeps.
pub async fn wait_for(
    hv: &QemuDriver,
    instance: &str,
    timeout: Duration,
    done: impl Fn(&DomainState) -> bool,
) -> DomainState {
    let deadline = Instant::now() + timeout;
    loop {
        let state = match hv.info(instance).await {
            Ok(info) => info.state,
            // A QEMU that is exiting closes QMP before its process is
            // gone: the driver says it cannot tell (never "gone"), and a
            // later look sees the exit.
            Err(keel_hv::HvError::Unavailable { .. }) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            Err(e) => panic!("info {instance}: {e}"),
        };
        if done(&state) || Instant::now() >= deadline {
            return state;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Powers the guest off and forgets the instance.
pub async fn stop_and_cleanup(hv: &QemuDriver, instance: &str) {
    hv.shutdown(instance).await.unwrap();
    let state = wait_for(hv, instance, STOP, DomainState::is_exited).await;
    assert!(state.is_exited(), "{instance} did not power off: {state:?}");
    hv.cleanup(instance).await.unwrap();
}

pub fn pid_alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            let state = s.rsplit(')').next().unwrap_or("").split_whitespace().next();
            !matches!(state, Some("Z") | Some("X"))
        })
        .unwrap_or(false)
}

/// Snapshot names in an image, read without taking its lock (`-U`), so it
/// also works while a QEMU has the image open.
pub fn image_snapshots(image: &Path) -> Vec<String> {
    let out = std::process::Command::new("qemu-img")
        .args(["info", "-U", "--output=json", "-f", "qcow2"])
        .arg(image)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "qemu-img info {}: {}",
        image.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    info["snapshots"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s["name"].as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}
