//! A node's flags (`NodeArgs`, flattened into `keel serve` and `keel
//! agent`) turned into its settings, and the one place the node's
//! `LifecycleConfig` is built from them: by `keel serve` alone on SQLite,
//! as a control plane with `--agent`, and by `keel agent`.

use std::path::{Path, PathBuf};

use keel_ctrl::LifecycleConfig;
use keel_hv::qemu::AccelChoice;
use keel_hv::sim::SimConfig;

use crate::args::{HypervisorKind, NodeArgs};

/// What `NodeArgs` say, resolved: the node's name found, sizes in bytes,
/// the capacity policy in the lifecycle config.
#[derive(Debug, Clone)]
pub struct NodeSettings {
    pub node: String,
    pub data_dir: PathBuf,
    pub hypervisor: HypervisorKind,
    pub guest_dir: Option<PathBuf>,
    pub accel: AccelChoice,
    pub disk_dir: Option<PathBuf>,
    pub image_dir: Option<PathBuf>,
    pub runtime_dir: Option<PathBuf>,
    pub console_log_max_bytes: u64,
    pub min_free_disk_bytes: u64,
    pub max_concurrent_reconciles: usize,
    /// Defaults, with the capacity policy of the flags.
    pub lifecycle: LifecycleConfig,
    /// Defaults, with the host the sim driver pretends to be.
    pub sim: SimConfig,
}

impl NodeArgs {
    /// The settings; a capacity flag out of range is an error naming it.
    pub fn resolve(self) -> anyhow::Result<NodeSettings> {
        let node = match self.name {
            Some(node) => node,
            None => crate::host::default_node_name()?,
        };
        let mut lifecycle = LifecycleConfig::default();
        let mut sim = SimConfig::default();
        self.capacity.apply(&mut lifecycle, &mut sim)?;
        Ok(NodeSettings {
            node,
            data_dir: self.data_dir,
            hypervisor: self.hypervisor,
            guest_dir: crate::hypervisor::guest_dir_or_built(self.guest_dir),
            accel: self.accel,
            disk_dir: self.disk_dir,
            image_dir: self.image_dir,
            runtime_dir: self.runtime_dir,
            console_log_max_bytes: self.console_log_max_mib << 20,
            min_free_disk_bytes: self.min_free_disk_mib << 20,
            max_concurrent_reconciles: self.max_concurrent_reconciles,
            lifecycle,
            sim,
        })
    }
}

/// The lifecycle config this node's controllers run with: `base` (the
/// timings and policy configured) for `node`, its disk dir recorded if
/// shared, and the incarnation its name is claimed with (`None` on
/// SQLite, where the locked data dir is the claim). Placement and the
/// takeover of lost nodes' VMs are the cluster controller's.
pub fn node_lifecycle(
    base: &LifecycleConfig,
    node: &str,
    disk_dir: Option<&Path>,
    incarnation: Option<String>,
) -> anyhow::Result<LifecycleConfig> {
    Ok(LifecycleConfig {
        node: node.to_string(),
        shared_disk_dir: crate::hypervisor::shared_disk_dir(disk_dir)?,
        incarnation,
        ..base.clone()
    })
}
