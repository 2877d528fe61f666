//! The qemu driver: one `qemu-system-x86_64` process per instance, driven
//! over QMP, with everything Keel knows about an instance kept in files under
//! `data_dir/instances/<instance>/` (see [`layout`]), so a restarted Keel
//! re-adopts running guests and still tells how finished ones ended.
//!
//! QEMU runs in its own session: it outlives `keel serve` restarts, and a
//! Ctrl-C aimed at Keel's terminal does not reach the guests.
//!
//! QMP is spoken by a small client of our own ([`qmp`]), not the `qapi`
//! crate; the reasons are at the top of that module.
//!
//! Snapshots are qcow2 internal snapshots ([`snapshot`]); live migration
//! moves memory and device state only ([`migration`]), so the disks must be
//! on storage both nodes share (`QemuConfig::disk_dir`).
//!
//! The driver itself, by topic: [`config`] (what it is told), [`registry`]
//! (finding and adopting instances), [`listing`] (all domains, or one VM's,
//! each looked at on its own), [`disks`] (images a start needs),
//! [`launch`] (spawning QEMU and rolling back a failed start) and
//! [`hypervisor`] (the trait). This file holds the driver's state and its
//! construction.

mod accel;
mod accel_choice;
mod balloon;
pub mod bare;
mod blocking;
pub mod boot;
pub mod cdrom;
mod clone_disk;
pub mod cloud_init;
mod config;
mod console;
pub mod console_log;
pub mod console_watch;
mod disks;
pub mod guest_agent;
mod hardware_catalog;
mod hot_unplug;
mod hotplug;
mod hypervisor;
pub mod keeper;
mod launch;
mod layout;
mod linked_clone;
mod listing;
mod live_monitor;
mod migration;
mod monitor;
pub mod network;
mod online_resize;
mod opts;
pub mod passt;
mod proc;
mod qmp;
mod qmp_events;
mod query_block;
mod registry;
mod reset;
mod reset_count;
pub mod secure_boot;
mod snapshot;
mod stats;
pub mod tls;
pub mod tpm;
mod vm_export;
mod vnc;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};

use keel_api::{validate_name, Accelerator};

pub use accel::{
    forced as forced_accelerator, probe_kvm, AccelChoice, AccelParseError, AccelVerdict,
    KvmUnavailable, ACCEL_ENV,
};
pub use config::{QemuConfig, QemuInitError};
pub use layout::{default_runtime_dir, ExitRecord};
pub use qmp::{QmpClient, QmpError, QmpEvent, ShutdownEvent, StatusInfo};

use launch::{spawn_qemu, tail};
use layout::Layout;
use monitor::Domain;

use crate::HvError;

/// Cheap to clone; clones share the instances. Dropping the last clone stops
/// the monitors but leaves every QEMU running, for the next driver to adopt.
#[derive(Clone)]
pub struct QemuDriver {
    inner: Arc<Inner>,
}

struct Inner {
    config: QemuConfig,
    layout: Layout,
    /// Read without waiting for facts; waited for by whatever launches.
    accel: accel::Settling,
    qemu_version: String,
    /// The machine types and CPU models this QEMU provides.
    catalog: hardware_catalog::Catalog,
    /// The disk dir's identity (see [`disks::storage_identity`]).
    storage_id: String,
    /// Disks are opened `cache=none` (see [`disks::direct_io`]).
    direct_io: bool,
    /// Instances this driver has looked at. The directory is the truth; this
    /// holds the monitors and the in-memory phase.
    domains: Mutex<BTreeMap<String, Arc<Domain>>>,
    /// One per VM ever touched (a few bytes each): serializes what changes
    /// a VM's disks or who writes them (snapshot, restore, delete snapshot,
    /// starting a migration), so e.g. a snapshot never pauses a guest that
    /// has just started handing over to another node.
    vm_locks: Mutex<BTreeMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Where monitors announce exits and QMP events (see
    /// `Hypervisor::domain_events`).
    events: tokio::sync::broadcast::Sender<crate::DomainEvent>,
    /// The node's local lease, read by the keepers.
    lease: keeper::FenceLease,
    /// One attached console session per instance.
    console_slots: crate::guest_info::ConsoleSlots,
    /// How far each readiness pattern has been looked for in each console log.
    console_scans: Mutex<BTreeMap<(String, String), crate::guest_info::LogScan>>,
    /// The console watches (`console_watch`), per instance and text.
    console_watches: Mutex<BTreeMap<(String, String), console_watch::WatchState>>,
    /// One guest-agent conversation at a time per instance.
    agent_locks: Mutex<BTreeMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Image files, checked against their records before use.
    images: crate::images::ImageStore,
}

impl Drop for Inner {
    fn drop(&mut self) {
        for domain in self.domains.get_mut().expect("domains lock").values() {
            domain.detach();
        }
    }
}

impl QemuDriver {
    /// Checks QEMU runs, starts settling the accelerator (probing KVM in
    /// the background under `Auto`) and re-adopts the instances found in
    /// the data dir.
    pub async fn new(config: QemuConfig) -> Result<QemuDriver, QemuInitError> {
        let data_dir_err = |reason: String| QemuInitError::DataDir {
            path: config.data_dir.clone(),
            reason,
        };
        std::fs::create_dir_all(&config.data_dir).map_err(|e| data_dir_err(e.to_string()))?;
        // Absolute, so the paths in QEMU's command line (and the identity
        // marker derived from them) do not depend on anyone's cwd.
        let root = config
            .data_dir
            .canonicalize()
            .map_err(|e| data_dir_err(e.to_string()))?;
        if root.to_str().is_none() {
            return Err(data_dir_err("path is not UTF-8".into()));
        }
        let runtime = runtime_dir(config.runtime_dir.clone())?;
        std::fs::create_dir_all(root.join("instances"))
            .map_err(|e| data_dir_err(format!("instances: {e}")))?;
        let disks = match &config.disk_dir {
            Some(dir) => {
                let disk_dir_err = |reason: String| QemuInitError::DiskDir {
                    path: dir.clone(),
                    reason,
                };
                std::fs::create_dir_all(dir).map_err(|e| disk_dir_err(e.to_string()))?;
                // Absolute for the same reason as the data dir; with shared
                // storage it must also be the same path on every node.
                dir.canonicalize()
                    .map_err(|e| disk_dir_err(e.to_string()))?
            }
            None => {
                let dir = root.join("disks");
                std::fs::create_dir_all(&dir)
                    .map_err(|e| data_dir_err(format!("{}: {e}", dir.display())))?;
                dir
            }
        };
        if let Some(address) = config.migration_address {
            if address.is_unspecified() || address.is_multicast() {
                // The address is also what sources are told to connect to.
                return Err(QemuInitError::MigrationAddress {
                    address,
                    reason: "must be a unicast address other nodes can reach".into(),
                });
            }
            if config
                .migration_ports
                .as_ref()
                .is_some_and(|r| r.is_empty() || *r.start() == 0)
            {
                return Err(QemuInitError::MigrationAddress {
                    address,
                    reason: "the port range must be non-empty, within 1-65535".into(),
                });
            }
        }
        let mut config = config;
        if let Some(dir) = &config.migration_tls {
            tls::check_creds(dir).map_err(QemuInitError::MigrationTls)?;
            // Absolute (QEMU resolves it in its own cwd) and UTF-8 (it
            // travels in QMP's JSON).
            let dir = dir.canonicalize().map_err(|source| {
                QemuInitError::MigrationTls(tls::TlsError::Io {
                    path: dir.clone(),
                    source,
                })
            })?;
            if dir.to_str().is_none() {
                return Err(QemuInitError::MigrationTls(tls::TlsError::Invalid {
                    path: dir,
                    reason: "path is not UTF-8".into(),
                }));
            }
            config.migration_tls = Some(dir);
        } else if let Some(address) = config.migration_address {
            tracing::warn!(
                %address,
                "INSECURE MIGRATION: incoming live migrations listen on plain TCP; guest memory \
                 crosses the network unencrypted and any host that reaches the port can send a \
                 guest. Use migration TLS credentials (keel cluster issue-cert)"
            );
        }
        let storage_id = disks::storage_identity(&disks).map_err(|e| QemuInitError::DiskDir {
            path: disks.clone(),
            reason: format!("storage identity: {e}"),
        })?;
        let direct_io = config.disk_dir.is_some() && disks::direct_io(&disks);
        let layout = Layout {
            root: root.clone(),
            disks,
            runtime,
        };
        let images = crate::images::ImageStore::open(
            &config
                .image_dir
                .clone()
                .unwrap_or_else(|| root.join("images")),
            &config.qemu_img,
            config.storage_timeout,
        )
        .map_err(QemuInitError::ImageDir)?;
        let qemu_version = qemu_version(&config.qemu_binary).await?;
        let catalog =
            hardware_catalog::Catalog::probe(&config.qemu_binary, &config.machine).await?;
        let accel = accel::Settling::start(
            config.clone(),
            root.join(".kvm-probe"),
            layout.runtime.clone(),
        );
        tracing::info!(
            accelerator = %accel
                .now()
                .map_or_else(|| "probing".into(), |v| format!("{:?}", v.accelerator)),
            qemu = %qemu_version,
            data_dir = %root.display(),
            "qemu driver ready"
        );
        config.data_dir = root;
        let lease = open_fence_lease(&layout)?;
        let driver = QemuDriver {
            inner: Arc::new(Inner {
                config,
                layout,
                accel,
                qemu_version,
                catalog,
                storage_id,
                direct_io,
                domains: Mutex::new(BTreeMap::new()),
                vm_locks: Mutex::new(BTreeMap::new()),
                events: tokio::sync::broadcast::channel(256).0,
                lease,
                console_slots: Default::default(),
                console_scans: Mutex::new(BTreeMap::new()),
                console_watches: Mutex::new(BTreeMap::new()),
                agent_locks: Mutex::new(BTreeMap::new()),
                images,
            }),
        };
        driver.adopt_all();
        console_log::keep_bounded(
            Arc::downgrade(&driver.inner),
            driver.inner.config.console_log_check,
        );
        Ok(driver)
    }

    /// The guest's serial console (ttyS0), where the ready marker appears.
    /// An invalid name yields a path that cannot exist inside the data dir.
    pub fn console_log(&self, instance: &str) -> PathBuf {
        self.paths_or_nowhere(instance).console
    }

    /// The guest command channel (ttyS1); see [`crate::guest::GuestChannel`].
    pub fn command_socket(&self, instance: &str) -> PathBuf {
        self.launched_paths(instance).cmd
    }

    /// The guest agent's channel (virtio-serial `org.qemu.guest_agent.0`).
    pub fn agent_socket(&self, instance: &str) -> PathBuf {
        self.launched_paths(instance).qga
    }

    /// The QMP socket of a launched instance.
    pub fn qmp_socket(&self, instance: &str) -> PathBuf {
        self.launched_paths(instance).qmp
    }

    /// The instance directory.
    pub fn instance_dir(&self, instance: &str) -> PathBuf {
        self.paths_or_nowhere(instance).dir
    }

    /// QEMU's pid while the process is (believed) alive.
    pub fn pid(&self, instance: &str) -> Option<u32> {
        validate_name("instance", instance).ok()?;
        if let Some(domain) = self.lock().get(instance) {
            return domain.pid();
        }
        self.inner.layout.new_instance(instance).read_pid()
    }

    /// The accelerator guests run under, once settled (see [`accel`]).
    pub async fn accelerator(&self) -> Accelerator {
        self.inner.accel.verdict().await.accelerator
    }

    /// The node's local lease, which this driver's keepers enforce.
    pub fn fence_lease(&self) -> &keeper::FenceLease {
        &self.inner.lease
    }
}

/// The node's fence lease, held open for renewals: in the runtime dir
/// (tmpfs as root), in a dir named after the data dir, so that a stalled
/// data disk holds no renewal up and drivers of two data dirs on one host
/// keep separate leases. A lease file in the data dir is what keepers of an
/// older Keel read: while it exists it is renewed too (see
/// [`keeper::FenceLease::mirrored_to`]).
fn open_fence_lease(layout: &Layout) -> Result<keeper::FenceLease, QemuInitError> {
    use std::os::unix::fs::DirBuilderExt;
    let dir = layout::socket_dir_for(&layout.runtime, &layout.root);
    let path = dir.join(keeper::LEASE_FILE);
    let err = |reason: String| QemuInitError::RuntimeDir {
        path: path.clone(),
        reason: format!("open the fence lease: {reason}"),
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .map_err(|e| err(e.to_string()))?;
    let lease = keeper::FenceLease::held_open(&path).map_err(|e| err(e.to_string()))?;
    let legacy = layout.root.join(keeper::LEASE_FILE);
    Ok(if legacy.exists() {
        lease.mirrored_to(legacy)
    } else {
        lease
    })
}

/// The configured runtime dir, or the default; created private, absolute,
/// and short enough for every socket below it.
fn runtime_dir(configured: Option<PathBuf>) -> Result<PathBuf, QemuInitError> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    let dir = configured.unwrap_or_else(default_runtime_dir);
    let err = |reason: String| QemuInitError::RuntimeDir {
        path: dir.clone(),
        reason,
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .map_err(|e| err(e.to_string()))?;
    let dir = dir.canonicalize().map_err(|e| err(e.to_string()))?;
    let meta = std::fs::metadata(&dir).map_err(|e| err(e.to_string()))?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    // Under /tmp someone else could have made it first and would then see,
    // or replace, our sockets.
    if meta.uid() != uid {
        return Err(err(format!(
            "owned by uid {}, not by this user ({uid})",
            meta.uid()
        )));
    }
    if meta.permissions().mode() & 0o077 != 0 {
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| err(format!("make private: {e}")))?;
    }
    if dir.to_str().is_none() {
        return Err(err("path is not UTF-8".into()));
    }
    if dir.as_os_str().len() + layout::SOCKET_SUFFIX_LEN > layout::MAX_SOCKET_PATH {
        return Err(err(format!(
            "path too long: sockets below it would exceed {} bytes; choose a shorter one",
            layout::MAX_SOCKET_PATH
        )));
    }
    Ok(dir)
}

fn not_found(instance: &str) -> HvError {
    HvError::NotFound {
        instance: instance.to_string(),
    }
}

fn unavailable(instance: &str, op: &'static str, reason: String) -> HvError {
    HvError::Unavailable {
        instance: instance.to_string(),
        op,
        reason,
        source: None,
    }
}

async fn qemu_version(binary: &Path) -> Result<String, QemuInitError> {
    let missing = |reason: String| QemuInitError::QemuMissing {
        binary: binary.to_path_buf(),
        reason,
    };
    let out = tokio::process::Command::new(binary)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|e| missing(e.to_string()))?;
    if !out.status.success() {
        return Err(missing(format!("--version exited with {}", out.status)));
    }
    // "QEMU emulator version 7.2.22 (Debian ...)" -> "qemu 7.2.22"
    let text = String::from_utf8_lossy(&out.stdout);
    let version = text
        .split_whitespace()
        .skip_while(|w| *w != "version")
        .nth(1)
        .unwrap_or("unknown");
    Ok(format!("qemu {version}"))
}
