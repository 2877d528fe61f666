//! Choosing and building a node's hypervisor driver, and where its images
//! and shared disks are. Shared by `keel serve` and `keel agent`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use keel_api::Clock;
use keel_hv::qemu::keeper::KeeperCommand;
use keel_hv::qemu::{AccelChoice, QemuConfig, QemuDriver};
use keel_hv::sim::{SimConfig, SimHypervisor};
use keel_hv::Hypervisor;

use crate::args::HypervisorKind;

/// What a node's hypervisor driver is built from.
#[derive(Debug, Clone)]
pub struct HypervisorOptions {
    pub kind: HypervisorKind,
    /// The qemu driver keeps its instances in `<data_dir>/node`.
    pub data_dir: PathBuf,
    /// Where the qemu driver keeps disks; default `<data_dir>/node/disks`.
    pub disk_dir: Option<PathBuf>,
    /// Where the qemu driver keeps sockets; default: its own choice.
    pub runtime_dir: Option<PathBuf>,
    /// The cap on each instance's console log.
    pub console_log_max_bytes: u64,
    /// No disk is created below this much free space (0: no floor).
    pub min_free_disk_bytes: u64,
    /// The image store VMs boot from (see [`image_dir`]).
    pub image_dir: PathBuf,
    /// Run each QEMU under this fence keeper (cluster nodes); see
    /// `keel_hv::qemu::keeper`.
    pub keeper: Option<KeeperCommand>,
    /// Used only by the sim driver.
    pub sim: SimConfig,
    pub guest_dir: Option<PathBuf>,
    pub accel: AccelChoice,
    /// How incoming migrations travel (see [`crate::migration_setup`]);
    /// default: a Unix socket.
    pub migration: crate::migration_setup::MigrationSettings,
}

/// The one place a hypervisor driver is chosen (for `keel serve` and
/// `keel agent`). Async, so a driver can probe the host.
pub async fn make_hypervisor(
    cfg: &HypervisorOptions,
    clock: Arc<dyn Clock>,
) -> anyhow::Result<Arc<dyn Hypervisor>> {
    match cfg.kind {
        HypervisorKind::Qemu => {
            let mut config = QemuConfig::new(cfg.data_dir.join("node"));
            config.disk_dir = cfg.disk_dir.clone();
            config.runtime_dir = cfg.runtime_dir.clone();
            config.console_log_max_bytes = cfg.console_log_max_bytes;
            config.min_free_disk_bytes = cfg.min_free_disk_bytes;
            config.image_dir = Some(cfg.image_dir.clone());
            config.keeper = cfg.keeper.clone();
            if let Some(dir) = &cfg.guest_dir {
                // QEMU runs with its own working directory in mind: absolute paths only.
                let dir = dir
                    .canonicalize()
                    .with_context(|| format!("guest dir {}", dir.display()))?;
                config = config.with_test_guest(&dir);
            }
            config.accel = cfg.accel;
            if let Some(listen) = &cfg.migration.listen {
                config.migration_address = Some(listen.address);
                config.migration_ports = Some(listen.ports.clone());
            }
            config.migration_tls = cfg.migration.tls.clone();
            let driver = QemuDriver::new(config)
                .await
                .context("starting the qemu driver")?;
            let facts = driver.facts().await;
            tracing::info!(accelerator = %accelerator_text(facts.accelerator), note = %facts.accelerator_note, "qemu driver ready");
            Ok(Arc::new(driver))
        }
        HypervisorKind::Sim => {
            let seed = clock.now_ms();
            Ok(Arc::new(SimHypervisor::new(clock, seed, cfg.sim.clone())))
        }
    }
}

/// `--guest-dir`, else `./target/guest` if `scripts/build-test-guest` has
/// built it there (a checkout running its own binary).
pub fn guest_dir_or_built(configured: Option<PathBuf>) -> Option<PathBuf> {
    configured.or_else(|| {
        let built = PathBuf::from("target/guest");
        built.join("vmlinuz").is_file().then_some(built)
    })
}

/// For logs: the accelerator, or `probing` while the driver settles it.
pub fn accelerator_text(accelerator: Option<keel_api::Accelerator>) -> String {
    accelerator.map_or_else(|| "probing".into(), |a| format!("{a:?}"))
}

/// The image store's directory: `--image-dir`, else `<data_dir>/images`.
pub fn image_dir(data_dir: &Path, configured: Option<&Path>) -> PathBuf {
    configured.map_or_else(|| data_dir.join("images"), Path::to_path_buf)
}

/// `--disk-dir` names storage the nodes share (mounted at the same path on
/// each); without it disks are node-local. The path as the driver uses it.
pub fn shared_disk_dir(disk_dir: Option<&Path>) -> anyhow::Result<Option<String>> {
    disk_dir
        .map(|dir| {
            std::fs::create_dir_all(dir)
                .and_then(|()| dir.canonicalize())
                .with_context(|| format!("disk dir {}", dir.display()))
                .map(|d| d.to_string_lossy().into_owned())
        })
        .transpose()
}
