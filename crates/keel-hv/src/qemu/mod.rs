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

mod accel;
pub mod boot;
pub mod cloud_init;
mod console;
pub mod guest_agent;
pub mod keeper;
mod layout;
mod migration;
mod monitor;
pub mod network;
mod proc;
mod qmp;
mod snapshot;

use std::collections::BTreeMap;
use std::io;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use keel_api::{validate_name, Accelerator, Clock, SystemClock};

pub use accel::{AccelChoice, AccelParseError, ACCEL_ENV};
pub use layout::{default_runtime_dir, ExitRecord};
pub use qmp::{QmpClient, QmpError, QmpEvent, ShutdownEvent, StatusInfo};

use layout::{
    read_json, rename_noreplace, write_json_atomic, InstancePaths, LaunchPlan, LaunchRecord, Layout,
};
use monitor::{Domain, Phase, ProcessWatch};
use proc::PidFd;

use crate::{
    DomainInfo, DomainSpec, DomainState, HvError, Hypervisor, MigrationProgress, NodeFacts,
};

#[derive(Debug, Clone)]
pub struct QemuConfig {
    /// Holds `instances/` and, unless `disk_dir` is set, `disks/`. Created
    /// if missing.
    pub data_dir: PathBuf,
    /// Where VM disks live (`<disk_dir>/<vm>/<disk>.qcow2`); `None` means
    /// `data_dir/disks`. Live migration between nodes requires this to be
    /// shared storage mounted at the same path on every node: only memory
    /// and device state travel, both QEMUs open the same image files. On a
    /// network filesystem the page cache of the two hosts is not coherent,
    /// so there the images also need `cache=none` (not yet configurable);
    /// on one host (tests) the shared page cache makes `writeback` safe.
    pub disk_dir: Option<PathBuf>,
    /// Where instances' sockets live (short paths: `sun_path` holds 107
    /// bytes); `None` means [`default_runtime_dir`]. Created 0700 if missing.
    pub runtime_dir: Option<PathBuf>,
    /// Address incoming migrations listen on (a TCP port the kernel picks)
    /// and that is handed to the source, so it must be this node's address
    /// as other nodes reach it. `None`: a Unix socket in the instance
    /// directory, which only a source on the same host can reach. The
    /// stream is neither authenticated nor encrypted: use a private
    /// migration network.
    pub migration_address: Option<IpAddr>,
    /// Bandwidth cap for outgoing migrations in bytes/s (QEMU's
    /// `max-bandwidth`); `None` keeps QEMU's default (128 MiB/s).
    pub migration_max_bandwidth: Option<u64>,
    /// Bounds each `qemu-img` run and each QMP snapshot command.
    pub storage_timeout: Duration,
    pub qemu_binary: PathBuf,
    pub qemu_img: PathBuf,
    /// Used when a spec's boot section leaves the kernel unset, and by the
    /// KVM probe.
    pub default_kernel: Option<PathBuf>,
    pub default_initrd: Option<PathBuf>,
    pub default_cmdline: String,
    /// The image store VMs' images come from; `None` means
    /// `data_dir/images`. In a cluster: storage shared with the control
    /// planes that import, at the same path on every node.
    pub image_dir: Option<PathBuf>,
    /// OVMF's code (read-only) and the template each UEFI VM's own
    /// variable store is copied from (Debian's `ovmf` package).
    pub ovmf_code: PathBuf,
    pub ovmf_vars: PathBuf,
    pub accel: AccelChoice,
    /// How long the KVM probe guest may take to print its ready marker.
    pub probe_timeout: Duration,
    /// `q35` or `pc`.
    pub machine: String,
    /// Bounds every QMP command and handshake.
    pub qmp_timeout: Duration,
    /// How long `start` waits for a new QEMU's QMP to answer.
    pub launch_timeout: Duration,
    /// Bounds each guest-agent conversation (connect, sync, one command):
    /// a silent or hung agent costs at most this.
    pub agent_timeout: Duration,
    /// Bounds a filesystem freeze or thaw (the guest flushes first).
    pub freeze_timeout: Duration,
    /// Run each QEMU under a fence keeper ([`keeper`]) that kills it when
    /// the node's local lease (`data_dir/fence-lease`, renewed through
    /// [`Hypervisor::renew_fence`]) lapses. For cluster nodes, where another
    /// node may start the VM once this one's lease has run out; `None` (one
    /// host, nobody else can start it) lets guests outlive Keel for good.
    pub keeper: Option<keeper::KeeperCommand>,
}

impl QemuConfig {
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            data_dir: data_dir.into(),
            disk_dir: None,
            runtime_dir: None,
            migration_address: None,
            migration_max_bandwidth: None,
            storage_timeout: Duration::from_secs(60),
            qemu_binary: "qemu-system-x86_64".into(),
            qemu_img: "qemu-img".into(),
            default_kernel: None,
            default_initrd: None,
            default_cmdline: "console=ttyS0 panic=-1 quiet".into(),
            image_dir: None,
            ovmf_code: "/usr/share/OVMF/OVMF_CODE_4M.fd".into(),
            ovmf_vars: "/usr/share/OVMF/OVMF_VARS_4M.fd".into(),
            accel: AccelChoice::Auto,
            probe_timeout: Duration::from_secs(20),
            machine: "q35".into(),
            qmp_timeout: Duration::from_secs(5),
            launch_timeout: Duration::from_secs(30),
            agent_timeout: Duration::from_secs(2),
            freeze_timeout: Duration::from_secs(10),
            keeper: None,
        }
    }

    /// Sets the default kernel and initrd to the test guest built by
    /// `scripts/build-test-guest` in `dir` (`vmlinuz`, `initramfs.cpio.gz`).
    pub fn with_test_guest(mut self, dir: &Path) -> Self {
        self.default_kernel = Some(dir.join("vmlinuz"));
        self.default_initrd = Some(dir.join("initramfs.cpio.gz"));
        self
    }
}

#[derive(Debug, thiserror::Error)]
pub enum QemuInitError {
    #[error("qemu driver data dir {path}: {reason}")]
    DataDir { path: PathBuf, reason: String },
    #[error("qemu driver disk dir {path}: {reason}")]
    DiskDir { path: PathBuf, reason: String },
    #[error("qemu driver: {0}")]
    ImageDir(crate::images::ImageError),
    #[error("qemu driver runtime dir {path}: {reason}")]
    RuntimeDir { path: PathBuf, reason: String },
    #[error("{binary} does not run ({reason}); install qemu-system-x86 (scripts/setup)")]
    QemuMissing { binary: PathBuf, reason: String },
    #[error("qemu driver migration address {address}: {reason}")]
    MigrationAddress { address: IpAddr, reason: String },
}

/// Cheap to clone; clones share the instances. Dropping the last clone stops
/// the monitors but leaves every QEMU running, for the next driver to adopt.
#[derive(Clone)]
pub struct QemuDriver {
    inner: Arc<Inner>,
}

struct Inner {
    config: QemuConfig,
    layout: Layout,
    accelerator: Accelerator,
    accelerator_note: String,
    qemu_version: String,
    /// Instances this driver has looked at. The directory is the truth; this
    /// holds the monitors and the in-memory phase.
    domains: Mutex<BTreeMap<String, Arc<Domain>>>,
    /// One per VM ever touched (a few bytes each): serializes what changes
    /// a VM's disks or who writes them (snapshot, restore, delete snapshot,
    /// starting a migration), so e.g. a snapshot never pauses a guest that
    /// has just started handing over to another node.
    vm_locks: Mutex<BTreeMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Where monitors announce exits (see `Hypervisor::exit_events`).
    exits: tokio::sync::broadcast::Sender<crate::DomainExit>,
    /// The node's local lease, read by the keepers.
    lease: keeper::FenceLease,
    /// One attached console session per instance.
    console_slots: crate::guest_info::ConsoleSlots,
    /// How far each readiness pattern has been looked for in each console log.
    console_scans: Mutex<BTreeMap<(String, String), crate::guest_info::LogScan>>,
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
    /// Checks QEMU runs, settles the accelerator (probing KVM under `Auto`)
    /// and re-adopts the instances found in the data dir.
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
        }
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
        let (accelerator, accelerator_note) =
            accel::choose(&config, &root.join(".kvm-probe"), &layout.runtime).await;
        tracing::info!(
            accelerator = ?accelerator,
            note = %accelerator_note,
            qemu = %qemu_version,
            data_dir = %root.display(),
            "qemu driver ready"
        );
        let mut config = config;
        config.data_dir = root;
        let lease = keeper::FenceLease::new(layout.root.join(keeper::LEASE_FILE));
        let driver = QemuDriver {
            inner: Arc::new(Inner {
                config,
                layout,
                accelerator,
                accelerator_note,
                qemu_version,
                domains: Mutex::new(BTreeMap::new()),
                vm_locks: Mutex::new(BTreeMap::new()),
                exits: tokio::sync::broadcast::channel(256).0,
                lease,
                console_slots: Default::default(),
                console_scans: Mutex::new(BTreeMap::new()),
                agent_locks: Mutex::new(BTreeMap::new()),
                images,
            }),
        };
        driver.adopt_all();
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

    /// Paths as the instance's record has them (sockets included); for an
    /// instance not launched (or not readable) the paths of a new launch.
    fn launched_paths(&self, instance: &str) -> InstancePaths {
        match self.existing(instance, "paths") {
            Ok(domain) => domain.paths.clone(),
            Err(_) => self.paths_or_nowhere(instance),
        }
    }

    /// Where disk `disk` of `vm` is (or would be) stored.
    pub fn disk_path(&self, vm: &str, disk: &str) -> PathBuf {
        match (validate_name("vm", vm), validate_name("disk", disk)) {
            (Ok(()), Ok(())) => self.inner.layout.disk(vm, disk),
            _ => self.inner.layout.disks_dir().join(".invalid-name"),
        }
    }

    /// QEMU's pid while the process is (believed) alive.
    pub fn pid(&self, instance: &str) -> Option<u32> {
        validate_name("instance", instance).ok()?;
        if let Some(domain) = self.lock().get(instance) {
            return domain.pid();
        }
        self.inner.layout.new_instance(instance).read_pid()
    }

    pub fn accelerator(&self) -> Accelerator {
        self.inner.accelerator
    }

    fn paths_or_nowhere(&self, instance: &str) -> InstancePaths {
        match validate_name("instance", instance) {
            Ok(()) => self.inner.layout.new_instance(instance),
            // '.'-prefixed names are never instances (validate_name forbids
            // them), so this directory is never created.
            Err(_) => {
                let nowhere = self.inner.layout.instances_dir().join(".invalid-name");
                InstancePaths::new(nowhere.clone(), nowhere)
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Arc<Domain>>> {
        self.inner.domains.lock().expect("domains lock")
    }

    /// Serializes disk-changing work on one VM; see `Inner::vm_locks`.
    async fn lock_vm(&self, vm: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = self
            .inner
            .vm_locks
            .lock()
            .expect("vm locks")
            .entry(vm.to_string())
            .or_default()
            .clone();
        lock.lock_owned().await
    }

    /// Startup scan: every instance directory becomes a domain; live QEMUs
    /// get a monitor, dead ones an exit record.
    fn adopt_all(&self) {
        let dir = self.inner.layout.instances_dir();
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(".staging-") {
                // A start interrupted before it claimed its directory; no
                // QEMU was spawned from it.
                let _ = std::fs::remove_dir_all(entry.path());
                continue;
            }
            if validate_name("instance", &name).is_err() {
                tracing::warn!(path = %entry.path().display(), "ignoring unexpected entry in instances dir");
                continue;
            }
            match self.domain(&name, "adopt") {
                Ok(d) => {
                    tracing::info!(instance = %name, phase = ?d.phase(), "re-adopted instance")
                }
                Err(e) => tracing::warn!("cannot adopt instance {name}: {e}"),
            }
        }
    }

    /// The domain for an existing instance directory, loading it from disk
    /// (and attaching a monitor to a live QEMU) the first time it is seen.
    fn domain(&self, instance: &str, op: &'static str) -> Result<Arc<Domain>, HvError> {
        // Held across the load so two callers cannot adopt the same QEMU
        // twice; the load does no blocking beyond small file reads.
        let mut domains = self.lock();
        if let Some(d) = domains.get(instance) {
            return Ok(d.clone());
        }
        let spec_path = self.inner.layout.new_instance(instance).spec;
        let record: LaunchRecord = match read_json(&spec_path) {
            Ok(Some(r)) => r,
            Ok(None) => {
                return Err(unavailable(
                    instance,
                    op,
                    format!("{} is missing", spec_path.display()),
                ))
            }
            Err(e) => return Err(unavailable(instance, op, e.to_string())),
        };
        let paths = self.inner.layout.launched(instance, &record);
        let exit = read_json::<ExitRecord>(&paths.exit)
            .map_err(|e| unavailable(instance, op, e.to_string()))?;
        let domain = Domain::new(
            instance.to_string(),
            record.spec.vm.clone(),
            record.started_at,
            paths,
            self.inner.config.qmp_timeout,
            Phase::Launching { pid: None },
            self.inner.exits.clone(),
        );
        match exit {
            Some(rec) => domain.set_phase(Phase::Exited(rec)),
            None => {
                let marker = &domain.marker;
                let pid = domain
                    .paths
                    .read_pid()
                    .filter(|pid| proc::is_instance_process(*pid, marker))
                    .or_else(|| proc::find_instance_process(marker));
                match pid.map(|pid| PidFd::open_verified(pid, marker)) {
                    Some(Ok(fd)) => {
                        domain.set_phase(Phase::Live { pid: fd.pid() });
                        domain.spawn_monitor(ProcessWatch::PidFd(fd), None);
                        if domain.paths.snapshot_paused.exists() {
                            snapshot::resume_left_paused(domain.clone());
                        }
                        if domain.paths.fs_frozen.exists() {
                            console::thaw_left_frozen(self.clone(), instance.to_string());
                        }
                    }
                    // Gone while we looked, or never found: it exited while
                    // no Keel was watching.
                    Some(Err(_)) | None => {
                        domain.finish(None, "adoption: process not found");
                    }
                }
            }
        }
        domains.insert(instance.to_string(), domain.clone());
        Ok(domain)
    }

    /// Resolves `instance` to its domain, or `NotFound` when its directory
    /// does not exist (never started, or cleaned up).
    fn existing(&self, instance: &str, op: &'static str) -> Result<Arc<Domain>, HvError> {
        if validate_name("instance", instance).is_err() {
            // No directory can have this name, so it was never started.
            return Err(not_found(instance));
        }
        let dir = self.inner.layout.instance_dir(instance);
        match std::fs::symlink_metadata(&dir) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let known = self.lock().get(instance).cloned();
                return match known {
                    Some(d) if d.process_alive() => Err(unavailable(
                        instance,
                        op,
                        format!(
                            "instance dir vanished while QEMU pid {:?} still runs",
                            d.pid()
                        ),
                    )),
                    Some(d) if matches!(d.phase(), Phase::Launching { .. }) => {
                        // `start` has reserved the name but not yet claimed
                        // the directory.
                        Err(not_found(instance))
                    }
                    _ if self.identity_still_runs(instance).is_some() => Err(unavailable(
                        instance,
                        op,
                        format!(
                            "instance dir {} is missing, but a QEMU with this instance's \
                             identity still runs",
                            dir.display()
                        ),
                    )),
                    _ => {
                        self.lock().remove(instance);
                        Err(not_found(instance))
                    }
                };
            }
            Err(e) => return Err(unavailable(instance, op, format!("{}: {e}", dir.display()))),
        }
        self.domain(instance, op)
    }

    /// A live QEMU started for `instance` from this data dir, found by its
    /// `-pidfile` argument (which names the instance dir, whatever the
    /// socket dir was): "gone" must be observed, not concluded from a
    /// directory that went missing.
    fn identity_still_runs(&self, instance: &str) -> Option<u32> {
        let pidfile = self.inner.layout.new_instance(instance).pidfile;
        proc::find_instance_process(&pidfile.to_string_lossy())
    }

    fn info_of(&self, domain: &Domain, state: DomainState) -> DomainInfo {
        DomainInfo {
            instance: domain.instance.clone(),
            vm: domain.vm.clone(),
            state,
            pid: if state.is_exited() {
                None
            } else {
                domain.pid()
            },
            started_at: domain.started_at,
        }
    }

    /// Creates missing qcow2 images if `create`; existing ones are left as
    /// they are. Without `create` a missing image fails, naming it: the VM
    /// has run on its disks, and a blank one must never take their place.
    /// Returns the image paths in `disks` order, or why not.
    async fn ensure_disks(
        &self,
        vm: &str,
        disks: &[keel_api::DiskSpec],
        create: bool,
        images: &[(keel_api::Image, PathBuf)],
    ) -> Result<Vec<PathBuf>, String> {
        let vm_dir = self.inner.layout.vm_disks(vm);
        tokio::fs::create_dir_all(&vm_dir)
            .await
            .map_err(|e| format!("{}: {e}", vm_dir.display()))?;
        let mut paths = Vec::new();
        for disk in disks {
            let path = self.inner.layout.disk(vm, &disk.name);
            if !create && !path.exists() {
                return Err(format!(
                    "disk {} of VM {vm} is missing at {}: the VM has run on its disks, so no \
                     blank one is made in its place (wrong node, or shared storage not mounted?)",
                    disk.name,
                    path.display()
                ));
            }
            if !path.exists() {
                // Built under a temporary name and moved into place, so a
                // crash never leaves a half-written image that looks ready.
                let tmp = vm_dir.join(format!(".{}.{}.tmp", disk.name, std::process::id()));
                let mut cmd = tokio::process::Command::new(&self.inner.config.qemu_img);
                cmd.args(["create", "-q", "-f", "qcow2"]);
                if let Some(name) = &disk.image {
                    // The VM's own overlay on the verified image: the image
                    // is never written, the overlay holds every change.
                    let (image, path) =
                        images
                            .iter()
                            .find(|(i, _)| &i.name == name)
                            .ok_or_else(|| {
                                format!(
                                    "disk {} of VM {vm} is made from image {name} at the VM's \
                                 first start, which has not happened yet",
                                    disk.name
                                )
                            })?;
                    cmd.args(["-F", image.format.as_str(), "-b"]).arg(path);
                }
                let out = cmd
                    .arg(&tmp)
                    .arg(format!("{}M", disk.size_mib))
                    .stdin(Stdio::null())
                    .output()
                    .await
                    .map_err(|e| format!("run {}: {e}", self.inner.config.qemu_img.display()))?;
                if !out.status.success() {
                    let _ = std::fs::remove_file(&tmp);
                    return Err(format!(
                        "qemu-img create {} ({}): {}",
                        path.display(),
                        out.status,
                        String::from_utf8_lossy(&out.stderr).trim()
                    ));
                }
                match rename_noreplace(&tmp, &path) {
                    Ok(()) => {}
                    // Another start created it meanwhile; theirs is as good.
                    Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                        let _ = std::fs::remove_file(&tmp);
                    }
                    Err(e) => return Err(format!("{}: {e}", path.display())),
                }
            }
            paths.push(path);
        }
        Ok(paths)
    }

    fn plan(
        &self,
        spec: &DomainSpec,
        disks: Vec<PathBuf>,
        images: &[(keel_api::Image, PathBuf)],
    ) -> Result<LaunchPlan, HvError> {
        let failed = |reason: String| HvError::Failed {
            instance: spec.instance.clone(),
            op: "start",
            reason,
        };
        let config = &self.inner.config;
        let nic = Some(
            network::NicPlan::new(&spec.vm, &spec.instance, &spec.network)
                .map_err(|e| failed(e.to_string()))?,
        );
        let seed = spec
            .cloud_init
            .as_ref()
            .map(|_| self.inner.layout.new_instance(&spec.instance).seed);
        let defaults = boot::BootDefaults {
            kernel: config.default_kernel.as_deref(),
            initrd: config.default_initrd.as_deref(),
            cmdline: &config.default_cmdline,
            ovmf_code: &config.ovmf_code,
        };
        let vars = self.inner.layout.vm_disks(&spec.vm).join(boot::UEFI_VARS);
        let boot = boot::plan(spec, images, &defaults, &vars).map_err(failed)?;
        Ok(LaunchPlan {
            instance: spec.instance.clone(),
            paths: self.inner.layout.new_instance(&spec.instance),
            accelerator: self.inner.accelerator,
            machine: config.machine.clone(),
            cpus: spec.cpus,
            memory_mib: spec.memory_mib,
            boot,
            disks,
            incoming: false,
            nic,
            seed,
        })
    }

    /// The VM's own UEFI variable store beside its disks, copied from
    /// OVMF's template when missing (first UEFI start). An incoming target
    /// uses the source's and never makes one.
    fn ensure_uefi_vars(&self, spec: &DomainSpec, incoming: bool) -> Result<(), String> {
        if spec.boot.firmware != Some(keel_api::Firmware::Uefi) {
            return Ok(());
        }
        let vm_dir = self.inner.layout.vm_disks(&spec.vm);
        let vars = vm_dir.join(boot::UEFI_VARS);
        if vars.is_file() {
            return Ok(());
        }
        if incoming {
            return Err(format!(
                "UEFI variable store of VM {} not found at {}: live migration needs the disk \
                 dir on storage shared with the source node",
                spec.vm,
                vars.display()
            ));
        }
        let template = &self.inner.config.ovmf_vars;
        let tmp = vm_dir.join(format!(".{}.{}.tmp", boot::UEFI_VARS, std::process::id()));
        std::fs::create_dir_all(&vm_dir)
            .and_then(|()| std::fs::copy(template, &tmp))
            .and_then(|_| std::fs::File::open(&tmp)?.sync_all())
            .map_err(|e| {
                let _ = std::fs::remove_file(&tmp);
                format!(
                    "copy UEFI variable store template {} (Debian's ovmf package): {e}",
                    template.display()
                )
            })?;
        match rename_noreplace(&tmp, &vars) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                let _ = std::fs::remove_file(&tmp);
                Ok(())
            }
            Err(e) => Err(format!("{}: {e}", vars.display())),
        }
    }

    /// The images of an incoming migration's target: they must exist, since
    /// the source is running on them. A missing one means the disk dir is
    /// not the storage the source uses; creating a blank image would hand
    /// the guest an empty disk.
    fn existing_disks(&self, spec: &DomainSpec) -> Result<Vec<PathBuf>, HvError> {
        spec.disks
            .iter()
            .map(|disk| {
                let path = self.inner.layout.disk(&spec.vm, &disk.name);
                if path.is_file() {
                    Ok(path)
                } else {
                    Err(HvError::Failed {
                        instance: spec.instance.clone(),
                        op: "prepare incoming migration",
                        reason: format!(
                            "disk {} of VM {} not found at {}: live migration needs the \
                             disk dir on storage shared with the source node",
                            disk.name,
                            spec.vm,
                            path.display()
                        ),
                    })
                }
            })
            .collect()
    }

    /// Everything in `start` after the name is reserved. On error the caller
    /// removes the reservation; this removes what it created on disk.
    /// `incoming`: start waiting for a live migration instead of booting;
    /// returns the URI the target listens on.
    async fn launch(
        &self,
        spec: &DomainSpec,
        domain: &Arc<Domain>,
        incoming: bool,
    ) -> Result<Option<String>, HvError> {
        let instance = &spec.instance;
        let op = if incoming {
            "prepare incoming migration"
        } else {
            "start"
        };
        let failed = |reason: String| HvError::Failed {
            instance: instance.clone(),
            op,
            reason,
        };
        // Before anything is created: a missing or changed image fails the
        // start with the reason, and nothing else boots in its place.
        let images = boot::verified_images(&self.inner.images, spec)
            .await
            .map_err(&failed)?;
        let disks = if incoming {
            self.existing_disks(spec)?
        } else {
            self.ensure_disks(&spec.vm, &spec.disks, spec.create_disks, &images)
                .await
                .map_err(&failed)?
        };
        self.ensure_uefi_vars(spec, incoming).map_err(&failed)?;
        let mut plan = self.plan(spec, disks, &images)?;
        plan.incoming = incoming;
        let args = plan.args();
        let record = LaunchRecord {
            spec: spec.clone(),
            started_at: domain.started_at,
            accelerator: plan.accelerator,
            argv: std::iter::once(self.inner.config.qemu_binary.to_string_lossy().into_owned())
                .chain(args.iter().cloned())
                .collect(),
            socket_dir: Some(plan.paths.sockets.clone()),
        };
        // The directory appears complete with its spec.json, or not at all.
        let staging = self
            .inner
            .layout
            .instances_dir()
            .join(format!(".staging-{instance}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&staging);
        let staged = InstancePaths::new(staging.clone(), staging.clone());
        let prepared = std::fs::create_dir(&staging)
            .and_then(|()| plan.paths.prepare_sockets())
            .and_then(|()| match &spec.cloud_init {
                Some(ci) => cloud_init::Seed::render(&spec.vm, ci).write_image(&staged.seed),
                None => Ok(()),
            })
            .and_then(|()| write_json_atomic(&staged.spec, &record));
        if let Err(e) = prepared {
            let _ = std::fs::remove_dir_all(&staging);
            let _ = plan.paths.remove_sockets();
            return Err(failed(format!("{}: {e}", staging.display())));
        }
        if let Err(e) = rename_noreplace(&staging, &plan.paths.dir)
            .and_then(|()| layout::sync_dir(&self.inner.layout.instances_dir()))
        {
            let _ = std::fs::remove_dir_all(&staging);
            // The socket dir is not removed here: it may be the live
            // instance's that owns the directory we lost the race for.
            return Err(match e.kind() {
                io::ErrorKind::AlreadyExists | io::ErrorKind::DirectoryNotEmpty => {
                    HvError::AlreadyExists {
                        instance: instance.clone(),
                    }
                }
                _ => failed(format!("{}: {e}", plan.paths.dir.display())),
            });
        }

        let remove_dir = || {
            if let Err(e) = network::release(instance) {
                tracing::warn!(instance = %instance, error = %e, "failed start: tap not removed");
            }
            let _ = std::fs::remove_dir_all(&plan.paths.dir);
            let _ = plan.paths.remove_sockets();
        };
        // After the directory is ours: a tap made for a start that lost the
        // race for it would belong to nobody.
        if let Some(nic) = &plan.nic {
            if let Err(e) = nic.prepare() {
                remove_dir();
                return Err(failed(e.to_string()));
            }
        }
        let keeper = self.inner.config.keeper.as_ref();
        let spawned = match keeper {
            Some(k) => spawn_keeper(k, &self.inner.lease, &plan),
            None => spawn_qemu(&self.inner.config.qemu_binary, &plan),
        };
        let mut child = match spawned {
            Ok(child) => child,
            Err(e) => {
                remove_dir();
                return Err(failed(format!(
                    "spawn {}: {e}",
                    keeper
                        .map_or(&self.inner.config.qemu_binary, |k| &k.program)
                        .display()
                )));
            }
        };
        let child_pid = child.id().unwrap_or(0);
        // Under a keeper, QEMU's pid is known only once it wrote its pid
        // file; until then a kill must wait (the keeper's pid is not QEMU's).
        if keeper.is_none() {
            domain.set_phase(Phase::Launching {
                pid: Some(child_pid),
            });
        }
        tracing::info!(instance = %instance, pid = child_pid, keeper = keeper.is_some(), accel = ?plan.accelerator, "QEMU spawned");

        let ready = match self.await_qmp(&plan.paths, &mut child).await {
            // Before the monitor takes the connection, so that a target that
            // cannot listen is rolled back like a failed start.
            Ok(connected) if incoming => self
                .listen_incoming(&plan.paths, &connected.0)
                .await
                .map(|uri| (connected, Some(uri))),
            Ok(connected) => Ok((connected, None)),
            Err(reason) => Err(reason),
        };
        let ready = match ready {
            Ok((connected, uri)) if keeper.is_some() => {
                match self.kept_qemu(domain, &plan.paths).await {
                    Ok(fd) => Ok((connected, uri, Some(fd))),
                    Err(reason) => Err(reason),
                }
            }
            Ok((connected, uri)) => Ok((connected, uri, None)),
            Err(reason) => Err(reason),
        };
        match ready {
            Ok((connected, uri, kept)) => {
                let (pid, watch) = match kept {
                    Some(fd) => {
                        // The keeper is reaped when it exits (after QEMU),
                        // so no zombie stays; QEMU is watched by pidfd.
                        tokio::spawn(async move {
                            let _ = child.wait().await;
                        });
                        (fd.pid(), ProcessWatch::PidFd(fd))
                    }
                    None => (child_pid, ProcessWatch::Child(child)),
                };
                domain.set_phase(Phase::Live { pid });
                domain.spawn_monitor(watch, Some(connected));
                Ok(uri)
            }
            Err(reason) => {
                // Leave nothing running and nothing behind: a failed start
                // is a start that never happened (`NotFound`). A keeper's
                // death takes its QEMU along (PDEATHSIG), but not at once:
                // wait for QEMU itself too.
                let qemu = keeper.and(
                    plan.paths
                        .read_pid()
                        .or_else(|| proc::find_instance_process(&domain.marker)),
                );
                let _ = child.start_kill();
                let _ = child.wait().await;
                if let Some(Ok(fd)) = qemu.map(|pid| PidFd::open_verified(pid, &domain.marker)) {
                    let _ = fd.signal(libc::SIGKILL);
                    let _ = tokio::time::timeout(Duration::from_secs(10), fd.exited()).await;
                }
                let log = tail(&plan.paths.qemu_log);
                remove_dir();
                Err(failed(format!("{reason}; qemu log: {log}")))
            }
        }
    }

    /// `start` and `prepare_incoming`: validates, reserves the name and
    /// launches. `Some(uri)` for an incoming target.
    async fn start_domain(
        &self,
        spec: &DomainSpec,
        incoming: bool,
    ) -> Result<Option<String>, HvError> {
        let instance = &spec.instance;
        let op = if incoming {
            "prepare incoming migration"
        } else {
            "start"
        };
        let invalid = |reason: String| HvError::Failed {
            instance: instance.clone(),
            op,
            reason,
        };
        validate_name("instance", instance).map_err(|e| invalid(e.to_string()))?;
        validate_name("vm", &spec.vm).map_err(|e| invalid(e.to_string()))?;
        for (i, disk) in spec.disks.iter().enumerate() {
            validate_name(&format!("disks[{i}].name"), &disk.name)
                .map_err(|e| invalid(e.to_string()))?;
            if spec.disks[..i].iter().any(|d| d.name == disk.name) {
                return Err(invalid(format!("disk {:?} listed twice", disk.name)));
            }
        }
        if spec.cpus == 0 || spec.memory_mib < keel_api::MIN_MEMORY_MIB {
            return Err(invalid(format!(
                "cpus {} / memory {} MiB out of range",
                spec.cpus, spec.memory_mib
            )));
        }

        // Reserve the name in memory first (the directory is claimed later,
        // atomically): a concurrent start of the same instance fails here.
        let domain = {
            let mut domains = self.lock();
            if domains.contains_key(instance) || self.inner.layout.instance_dir(instance).exists() {
                return Err(HvError::AlreadyExists {
                    instance: instance.clone(),
                });
            }
            let domain = Domain::new(
                instance.clone(),
                spec.vm.clone(),
                SystemClock.now_ms(),
                self.inner.layout.new_instance(instance),
                self.inner.config.qmp_timeout,
                Phase::Launching { pid: None },
                self.inner.exits.clone(),
            );
            domains.insert(instance.clone(), domain.clone());
            domain
        };
        // Launched from a task of its own: if the caller gives up waiting
        // (its future is dropped), the launch still either completes, with a
        // monitor attached, or is rolled back. Never a half-started domain.
        let driver = self.clone();
        let spec = spec.clone();
        let task = tokio::spawn(async move {
            let result = driver.launch(&spec, &domain, incoming).await;
            if result.is_err() {
                let mut domains = driver.lock();
                if domains
                    .get(&spec.instance)
                    .is_some_and(|d| Arc::ptr_eq(d, &domain))
                {
                    domains.remove(&spec.instance);
                }
            }
            result
        });
        task.await.unwrap_or_else(|e| {
            Err(HvError::Failed {
                instance: instance.clone(),
                op,
                reason: format!("launch task failed: {e}"),
            })
        })
    }

    /// The QEMU a keeper started, once its QMP answered: its pid from the
    /// pid file, verified by its identity marker.
    async fn kept_qemu(&self, domain: &Domain, paths: &InstancePaths) -> Result<PidFd, String> {
        let deadline = Instant::now() + self.inner.config.launch_timeout;
        loop {
            if let Some(pid) = paths.read_pid() {
                if let Ok(fd) = PidFd::open_verified(pid, &domain.marker) {
                    return Ok(fd);
                }
            }
            if Instant::now() >= deadline {
                return Err("QEMU under the keeper answered QMP but wrote no pid file".into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The node's local lease, which this driver's keepers enforce.
    pub fn fence_lease(&self) -> &keeper::FenceLease {
        &self.inner.lease
    }

    /// Waits for the new QEMU's QMP greeting, or its early death.
    async fn await_qmp(
        &self,
        paths: &InstancePaths,
        child: &mut tokio::process::Child,
    ) -> Result<(QmpClient, tokio::sync::mpsc::UnboundedReceiver<QmpEvent>), String> {
        let config = &self.inner.config;
        let deadline = Instant::now() + config.launch_timeout;
        let mut last_error = String::from("no attempt");
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!("qemu exited during start ({status})"));
            }
            if paths.qmp.exists() {
                match QmpClient::connect(&paths.qmp, config.qmp_timeout).await {
                    Ok(connected) => return Ok(connected),
                    Err(e) => last_error = e.to_string(),
                }
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "QMP did not answer within {:?} ({last_error})",
                    config.launch_timeout
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits (bounded) for the monitor to record an exit that has happened
    /// or is about to. Used after kill so `info` right after sees `Exited`.
    async fn settle(&self, domain: &Domain, timeout: Duration) {
        if domain.wait_exited(timeout).await.is_none() && !domain.process_alive() {
            domain.finish(None, "driver: process gone, no monitor record");
        }
    }
}

#[async_trait]
impl Hypervisor for QemuDriver {
    async fn facts(&self) -> NodeFacts {
        NodeFacts {
            hypervisor: self.inner.qemu_version.clone(),
            accelerator: self.inner.accelerator,
            accelerator_note: self.inner.accelerator_note.clone(),
        }
    }

    async fn renew_fence(&self, valid_for: Duration) -> Result<(), HvError> {
        if self.inner.config.keeper.is_none() {
            return Ok(());
        }
        self.inner
            .lease
            .renew(valid_for)
            .map_err(|e| HvError::Fence {
                reason: format!("renew {}: {e}", self.inner.lease.path().display()),
            })
    }

    fn exit_events(&self) -> Option<tokio::sync::broadcast::Receiver<crate::DomainExit>> {
        Some(self.inner.exits.subscribe())
    }

    async fn start(&self, spec: &DomainSpec) -> Result<(), HvError> {
        self.start_domain(spec, false).await.map(drop)
    }

    async fn prepare_incoming(&self, spec: &DomainSpec) -> Result<String, HvError> {
        let uri = self.start_domain(spec, true).await?;
        uri.ok_or_else(|| HvError::Failed {
            instance: spec.instance.clone(),
            op: "prepare incoming migration",
            reason: "no listening URI was set up".into(),
        })
    }

    async fn migrate_tuned(
        &self,
        instance: &str,
        uri: &str,
        params: &crate::MigrationParams,
    ) -> Result<(), HvError> {
        self.migrate_out(instance, uri, params).await
    }

    async fn migration_status(&self, instance: &str) -> Result<MigrationProgress, HvError> {
        self.outgoing_status(instance).await
    }

    async fn cancel_migration(&self, instance: &str) -> Result<(), HvError> {
        self.cancel_outgoing(instance).await
    }

    async fn resume_incoming(&self, instance: &str) -> Result<(), HvError> {
        self.resume_arrived(instance).await
    }

    async fn snapshot_disks(
        &self,
        vm: &str,
        disks: &[keel_api::DiskSpec],
        instance: Option<&str>,
        name: &str,
    ) -> Result<(), HvError> {
        self.take_snapshot(vm, disks, instance, name).await
    }

    async fn restore_disks(
        &self,
        vm: &str,
        disks: &[keel_api::DiskSpec],
        name: &str,
    ) -> Result<(), HvError> {
        self.apply_snapshot(vm, disks, name).await
    }

    async fn delete_snapshot(
        &self,
        vm: &str,
        disks: &[keel_api::DiskSpec],
        name: &str,
    ) -> Result<(), HvError> {
        self.remove_snapshot(vm, disks, name).await
    }

    async fn console_tail(
        &self,
        instance: &str,
        max_bytes: u64,
    ) -> Result<(Vec<u8>, u64), HvError> {
        self.read_console_log(instance, max_bytes).await
    }

    async fn console_contains(&self, instance: &str, text: &str) -> Result<bool, HvError> {
        self.scan_console(instance, text).await
    }

    async fn open_console(&self, instance: &str) -> Result<crate::ConsoleStream, HvError> {
        self.attach_console(instance).await
    }

    async fn guest_info(&self, instance: &str) -> Result<crate::GuestInfo, HvError> {
        self.agent_info(instance).await
    }

    async fn fs_freeze(&self, instance: &str) -> Result<u32, HvError> {
        self.agent_freeze(instance).await
    }

    async fn fs_thaw(&self, instance: &str) -> Result<u32, HvError> {
        self.agent_thaw(instance).await
    }

    async fn guest_shutdown(&self, instance: &str) -> Result<(), HvError> {
        self.agent_shutdown(instance).await
    }

    async fn shutdown(&self, instance: &str) -> Result<(), HvError> {
        let domain = self.existing(instance, "shutdown")?;
        let pid = match domain.phase() {
            Phase::Exited(_) => return Ok(()),
            Phase::Launching { .. } => {
                return Err(unavailable(
                    instance,
                    "shutdown",
                    "QEMU is still launching".into(),
                ))
            }
            Phase::Live { pid } => pid,
        };
        let failure = match domain.qmp().await {
            Ok(client) => match client.system_powerdown().await {
                Ok(()) => return Ok(()),
                Err(e) => e.to_string(),
            },
            Err(e) => e,
        };
        // A domain that exited meanwhile needs no power-down.
        domain
            .state_without_qmp(pid, "shutdown", failure)
            .await
            .map(drop)
    }

    async fn kill(&self, instance: &str) -> Result<(), HvError> {
        let domain = self.existing(instance, "kill")?;
        let pid = match domain.phase() {
            Phase::Exited(_) => return Ok(()),
            Phase::Launching { pid: None } => {
                return Err(unavailable(
                    instance,
                    "kill",
                    "QEMU is being spawned".into(),
                ))
            }
            Phase::Launching { pid: Some(pid) } | Phase::Live { pid } => pid,
        };
        // Recorded before the signal: whoever sees the exit (this monitor, or
        // a later Keel's scan) attributes it to us.
        let marker = format!("{}\n", SystemClock.now_ms());
        std::fs::write(&domain.paths.kill_marker, marker)
            .map_err(|e| unavailable(instance, "kill", format!("write kill marker: {e}")))?;
        match PidFd::open_verified(pid, &domain.marker) {
            Ok(fd) => {
                fd.signal(libc::SIGKILL).map_err(|e| HvError::Failed {
                    instance: instance.to_string(),
                    op: "kill",
                    reason: format!("SIGKILL pid {pid}: {e}"),
                })?;
                tracing::info!(instance, pid, "sent SIGKILL");
            }
            // ESRCH or a cmdline mismatch: our QEMU is already gone.
            Err(e) => tracing::debug!(instance, pid, "kill: process already gone: {e}"),
        }
        self.settle(&domain, Duration::from_secs(5)).await;
        Ok(())
    }

    async fn info(&self, instance: &str) -> Result<DomainInfo, HvError> {
        let domain = self.existing(instance, "info")?;
        let state = domain.state().await?;
        Ok(self.info_of(&domain, state))
    }

    async fn list(&self) -> Result<Vec<DomainInfo>, HvError> {
        let dir = self.inner.layout.instances_dir();
        let entries = std::fs::read_dir(&dir).map_err(|e| HvError::Unavailable {
            instance: "*".into(),
            op: "list",
            reason: format!("{}: {e}", dir.display()),
        })?;
        let mut names: Vec<String> = entries
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| validate_name("instance", n).is_ok())
            .collect();
        names.sort();
        let mut out = Vec::with_capacity(names.len());
        for name in names {
            match self.info(&name).await {
                Ok(info) => out.push(info),
                // Cleaned up between the directory read and the lookup.
                Err(HvError::NotFound { .. }) => {}
                // A domain whose state is unknown makes the whole listing
                // unknown: callers use it to prove a VM has no live instance.
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    async fn cleanup(&self, instance: &str) -> Result<(), HvError> {
        let domain = self.existing(instance, "cleanup")?;
        let state = match domain.phase() {
            Phase::Exited(_) => None,
            Phase::Launching { .. } => Some(DomainState::Starting),
            Phase::Live { .. } => match domain.state().await {
                Ok(DomainState::Exited(_)) => None,
                Ok(state) => Some(state),
                // Alive, just not answering: certainly not exited.
                Err(HvError::Unavailable { .. }) => Some(DomainState::Running),
                Err(e) => return Err(e),
            },
        };
        if let Some(state) = state {
            return Err(HvError::StillRunning {
                instance: instance.to_string(),
                state,
            });
        }
        // The tap first: if it cannot go, the instance stays known and the
        // next cleanup tries again.
        if let Err(e) = network::release(instance) {
            return Err(HvError::Failed {
                instance: instance.to_string(),
                op: "cleanup",
                reason: e.to_string(),
            });
        }
        let removed = domain.paths.remove_sockets().and_then(|()| {
            match std::fs::remove_dir_all(&domain.paths.dir) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            }
        });
        if let Err(e) = removed {
            return Err(HvError::Failed {
                instance: instance.to_string(),
                op: "cleanup",
                reason: format!("remove {}: {e}", domain.paths.dir.display()),
            });
        }
        self.lock().remove(instance);
        self.forget_guest(instance);
        tracing::info!(instance, "cleaned up");
        Ok(())
    }

    async fn delete_disks(&self, vm: &str) -> Result<(), HvError> {
        let storage = |reason: String| HvError::Storage {
            vm: vm.to_string(),
            op: "delete_disks",
            reason,
        };
        validate_name("vm", vm).map_err(|e| storage(e.to_string()))?;
        let _vm = self.lock_vm(vm).await;
        // Refuse rather than pull disks from under a running guest.
        let live: Vec<String> = self
            .list()
            .await
            .map_err(|e| storage(format!("cannot prove no instance is live: {e}")))?
            .into_iter()
            .filter(|d| d.vm == vm && !d.state.is_exited())
            .map(|d| d.instance)
            .collect();
        if !live.is_empty() {
            return Err(storage(format!(
                "instances still live: {}",
                live.join(", ")
            )));
        }
        let dir = self.inner.layout.vm_disks(vm);
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(storage(format!("remove {}: {e}", dir.display()))),
        }
    }
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
    }
}

/// Spawns QEMU from an argument vector (no shell) in a new session, with
/// stdout/stderr appended to `qemu.log`. The caller owns the child.
fn spawn_qemu(binary: &Path, plan: &LaunchPlan) -> io::Result<tokio::process::Child> {
    let mut cmd = tokio::process::Command::new(binary);
    cmd.args(plan.args());
    spawn_in_own_session(cmd, plan)
}

/// Spawns a fence keeper for the instance (which then starts QEMU from the
/// instance's `spec.json`), like [`spawn_qemu`]: its output and QEMU's go
/// to `qemu.log`. The caller owns the keeper child.
fn spawn_keeper(
    keeper: &keeper::KeeperCommand,
    lease: &keeper::FenceLease,
    plan: &LaunchPlan,
) -> io::Result<tokio::process::Child> {
    let mut cmd = tokio::process::Command::new(&keeper.program);
    cmd.args(&keeper.args)
        .arg("--instance-dir")
        .arg(&plan.paths.dir)
        .arg("--lease")
        .arg(lease.path());
    spawn_in_own_session(cmd, plan)
}

/// Runs `cmd` in the instance dir, output appended to `qemu.log`, in a new
/// session and process group of its own: no controlling terminal, so
/// neither a Ctrl-C nor a hangup aimed at Keel reaches it, and it outlives
/// this process.
fn spawn_in_own_session(
    mut cmd: tokio::process::Command,
    plan: &LaunchPlan,
) -> io::Result<tokio::process::Child> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&plan.paths.qemu_log)?;
    cmd.current_dir(&plan.paths.dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .kill_on_drop(false);
    // SAFETY: setsid is async-signal-safe and touches no memory of ours.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.spawn()
}

/// The last lines of a log, on one line, for error messages.
fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let start = lines.len().saturating_sub(5);
    let joined = lines[start..].join(" | ");
    if joined.is_empty() {
        "(empty)".into()
    } else {
        joined
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
