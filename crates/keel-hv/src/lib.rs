//! The [`Hypervisor`] trait: what Keel needs from whatever runs guests on a
//! node, and its drivers.
//!
//! Contract every driver keeps (the controllers depend on it):
//! - A domain is known by its instance id from `start` until `cleanup`,
//!   including after it exited. Stopping or killing never forgets it.
//! - `HvError::NotFound` means the domain is absent: never started, or
//!   cleaned up. Any other failure to look it up is `Unavailable`, which
//!   says nothing about whether it runs.
//! - `shutdown` asks the guest to power off (ACPI) and returns at once.

// Production code handles its errors; `unwrap` is for tests (which
// compile this crate with cfg(test)), `expect` states an invariant.
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod cause;
pub mod disk_creation;
pub mod domain_event;
pub mod free_space;
pub mod guest;
pub mod guest_info;
pub mod host_resources;
pub mod image_refs;
pub mod images;
pub mod ownership;
pub mod qcow2;
pub mod qemu;
pub mod sim;
pub mod start_marks;
pub mod stats_cache;
pub mod tpm_use;
pub mod unprivileged;
pub mod vm_stats;

pub use cause::Cause;
pub use disk_creation::DiskCreation;
pub use domain_event::{DomainEvent, DomainEventKind};
pub use guest_info::{AgentState, ConsoleStream, GuestInfo, GuestIp, QuiesceOutcome};
pub use tpm_use::TpmUse;

use async_trait::async_trait;
use keel_api::{Accelerator, Millis};
use serde::{Deserialize, Serialize};

/// What to run. Disk paths are resolved by the driver inside its data dir.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DomainSpec {
    pub vm: String,
    /// Unique per start, `<vm>-<seq>`.
    pub instance: String,
    pub cpus: u32,
    pub memory_mib: u64,
    pub disks: Vec<keel_api::DiskSpec>,
    pub boot: keel_api::BootSpec,
    /// Which missing disks may be made (those no instance has run on).
    /// A missing disk it does not allow fails the start, with the path in
    /// the reason: never a blank disk in place of the VM's own.
    #[serde(default)]
    pub create_disks: DiskCreation,
    /// The NIC. The controller always sends the VM's MAC; a launch record
    /// from before NICs decodes to user mode without one (the driver then
    /// uses the MAC derived from the VM name, as the controller would).
    #[serde(default)]
    pub network: keel_api::NetworkSpec,
    /// A cloud-init seed is built from this at every start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud_init: Option<keel_api::CloudInitSpec>,
    /// The store's records of the images the spec names (disk images,
    /// boot kernel and initrd), as the controller read them: the driver
    /// checks each file against its record's checksum before using it. An
    /// image the spec names but this list lacks fails the start.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub images: Vec<keel_api::Image>,
    /// Whether the instance runs under the node's fence lease (the
    /// controller's `Instance::fenced`): a driver that fences kills it
    /// when the lease lapses, and self-fencing ends it. An unfenced one
    /// has no lease to lapse and outlives its agent. Launch records from
    /// before: fenced.
    #[serde(default = "fenced_default")]
    pub fenced: bool,
    /// The machine type and CPU model the VM runs as (its recorded
    /// `status.hardware`). `None` (launch records from before, VMs with
    /// none recorded yet): the driver's configured machine and its
    /// accelerator's CPU, as before hardware was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hardware: Option<keel_api::VmHardware>,
    /// Spare PCIe root ports to launch with, for disks plugged later
    /// (`Instance::hotplug_ports`). 0 on launch records from before.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub hotplug_ports: u32,
    /// Disks of `disks` that sit on a root port rather than on the root
    /// complex: a migration target's, whose source had them plugged.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub plugged: Vec<keel_api::PluggedDisk>,
    /// A clone's source (`VmStatus::clone_from`): a disk it names that
    /// `create_disks` allows is made as a copy of the source VM's disk at
    /// the snapshot, never blank; one that cannot be copied fails the
    /// start, naming it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clone_from: Option<keel_api::CloneSource>,
    /// The firmware recorded with the VM's first instance
    /// (`VmStatus::firmware`): a start whose `boot.firmware` names another
    /// is refused, with the reason. `None`: nothing recorded yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recorded_firmware: Option<keel_api::Firmware>,
    /// The VM's TPM (`spec.tpm`), and whether this start may make its state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpm: Option<TpmUse>,
    /// A memory balloon device (`Instance::balloon`), through which the
    /// guest's driver reports its view of its memory. `false` on launch
    /// records from before.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub balloon: bool,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A disk to plug into a running instance (`Hypervisor::attach_disk`).
#[derive(Debug, Clone, PartialEq)]
pub struct DiskPlug {
    pub vm: String,
    pub instance: String,
    pub disk: keel_api::DiskSpec,
    /// The root port it goes on.
    pub port: u32,
    /// Whether the disk may be made if it is missing (never made, or made
    /// on this home and never used); otherwise a missing one fails.
    pub create: bool,
}

/// Where an unplug stands (`Hypervisor::detach_disk`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiskDetach {
    /// The guest was asked to let go of the disk and has not yet: the
    /// device is still there (a guest grants an unplug once it released
    /// the device, which takes it a moment, or forever if it ignores
    /// PCIe hot-unplug).
    Pending,
    /// The device is gone and the disk closed (every write the guest made
    /// to it is on the file): the instance no longer has it.
    Gone,
}

/// Launch records written before `fenced` existed: every guest of a
/// cluster node ran under the fence then.
fn fenced_default() -> bool {
    true
}

impl DomainSpec {
    /// A domain of `vm` with no disks, the default boot, network and no
    /// images: a guest nothing is asked of but to exist.
    pub fn bare(vm: &str, instance: &str, cpus: u32, memory_mib: u64) -> Self {
        Self {
            vm: vm.into(),
            instance: instance.into(),
            cpus,
            memory_mib,
            disks: vec![],
            boot: Default::default(),
            create_disks: DiskCreation::none(),
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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DomainState {
    /// The process exists, the guest is not yet running (booting firmware, incoming migration).
    Starting,
    Running,
    Paused,
    /// The process is gone; the domain is remembered until `cleanup`.
    Exited(ExitCause),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExitCause {
    /// The guest powered off (by itself or after an ACPI request).
    Poweroff,
    Crashed,
    Killed,
}

impl DomainState {
    pub fn is_exited(&self) -> bool {
        matches!(self, DomainState::Exited(_))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DomainInfo {
    pub instance: String,
    pub vm: String,
    pub state: DomainState,
    pub pid: Option<u32>,
    pub started_at: Millis,
    /// Launched under the fence lease (see [`DomainSpec::fenced`]).
    pub fenced: bool,
    /// Resets of the guest inside this domain since it started (its own
    /// reboots and [`Hypervisor::reset`]s): a reboot keeps the domain, so
    /// this count is how a controller learns of one.
    #[serde(default)]
    pub resets: u32,
}

/// Every domain a node knows, each on its own: one whose state could not
/// be read is listed apart with its reason, and never counts as absent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DomainListing {
    /// The domains whose state was read, exited ones included.
    pub domains: Vec<DomainInfo>,
    /// The domains that exist but could not be looked at (a hung QMP, an
    /// unreadable launch record): they may be running.
    pub unknown: Vec<UnknownDomain>,
}

/// A domain that exists, in a state nobody could read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownDomain {
    pub instance: String,
    /// `None` when not even its VM is known (its launch record is unreadable).
    pub vm: Option<String>,
    pub error: HvError,
    /// Launched under the fence lease; `true` when not even that is known
    /// (it may be, so self-fencing must end it).
    pub fenced: bool,
}

impl DomainListing {
    /// The domains of `vm`, or the error of the first domain that is, or may
    /// be, one of `vm`'s and could not be read: unknown is never absent.
    pub fn of_vm(self, vm: &str) -> Result<Vec<DomainInfo>, HvError> {
        if let Some(u) = self
            .unknown
            .into_iter()
            .find(|u| u.vm.as_deref().is_none_or(|v| v == vm))
        {
            return Err(u.error);
        }
        Ok(self.domains.into_iter().filter(|d| d.vm == vm).collect())
    }

    /// No domain at all, known or unknown.
    pub fn is_empty(&self) -> bool {
        self.domains.is_empty() && self.unknown.is_empty()
    }

    /// Every instance that is not known to have exited, unknown ones
    /// included: what a node that must end all its guests (self-fencing)
    /// kills.
    pub fn instances(&self) -> impl Iterator<Item = &str> {
        self.domains
            .iter()
            .filter(|d| !d.state.is_exited())
            .map(|d| d.instance.as_str())
            .chain(self.unknown.iter().map(|u| u.instance.as_str()))
    }

    /// [`Self::instances`] launched under the fence lease (or not known
    /// not to be): what self-fencing ends. An unfenced guest could not be
    /// started anywhere else, so killing it would only cost downtime.
    pub fn fenced_instances(&self) -> impl Iterator<Item = &str> {
        self.domains
            .iter()
            .filter(|d| !d.state.is_exited() && d.fenced)
            .map(|d| d.instance.as_str())
            .chain(
                self.unknown
                    .iter()
                    .filter(|u| u.fenced)
                    .map(|u| u.instance.as_str()),
            )
    }
}

/// Instances of a VM are named `<vm>-<suffix>` (the controller's
/// `<vm>-<seq>`); drivers refuse any other name, so the domains of one VM
/// are found by name without looking at anyone else's.
pub fn instance_prefix(vm: &str) -> String {
    format!("{vm}-")
}

/// Refuses a spec whose instance is not named after its VM (see
/// [`instance_prefix`]).
pub fn check_instance_name(spec: &DomainSpec, op: &'static str) -> Result<(), HvError> {
    match spec.instance.strip_prefix(&instance_prefix(&spec.vm)) {
        Some(suffix) if !suffix.is_empty() => Ok(()),
        _ => Err(HvError::Failed {
            instance: spec.instance.clone(),
            op,
            reason: format!(
                "instance names of VM {} must start with {:?}",
                spec.vm,
                instance_prefix(&spec.vm)
            ),
            source: None,
        }),
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeFacts {
    pub hypervisor: String,
    /// `None` while the driver is still settling it (probing KVM).
    pub accelerator: Option<Accelerator>,
    /// Why this accelerator was chosen (e.g. the KVM probe's outcome), or
    /// what is being done to choose it.
    pub accelerator_note: String,
    /// How this node receives live migrations, advertised on its record.
    pub migration: Option<keel_api::MigrationEndpoint>,
    /// The identity of the storage its disks are on: nodes with the same
    /// one see the same images.
    pub storage_id: Option<String>,
    /// The machine types and CPU models the node provides; `None`: the
    /// driver cannot tell (nothing is then judged by it).
    pub hardware: Option<keel_api::HostHardware>,
    /// The host's CPUs and memory, from which the node's capacity is
    /// worked out; `None`: the driver cannot tell (no capacity is judged).
    pub host: Option<keel_api::HostResources>,
}

/// How an outgoing migration is run (pre-copy only).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrationParams {
    /// Bytes/s; `None`: the driver's default.
    pub max_bandwidth: Option<u64>,
    /// Throttle the guest's CPUs so a busy guest converges.
    pub auto_converge: bool,
    /// The longest pause at switch-over; `None`: the driver's default.
    pub downtime_limit_ms: Option<u64>,
    /// Over TLS: the name the target's certificate must carry (its node's
    /// name); `None`: the host in the URI.
    pub tls_peer: Option<String>,
}

/// How an incoming live migration is received.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IncomingParams {
    /// Over TLS: the only node whose certificate a source may present
    /// (the migration record's source node); `None`: any node of the CA.
    pub tls_peer: Option<String>,
}

impl MigrationParams {
    pub fn from_tuning(t: &keel_api::MigrationTuning) -> Self {
        Self {
            max_bandwidth: t.bandwidth_mib_s.map(|m| m.saturating_mul(1 << 20)),
            auto_converge: t.auto_converge,
            downtime_limit_ms: t.downtime_limit_ms,
            tls_peer: None,
        }
    }
}

/// What the source side of a live migration reports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MigrationProgress {
    /// No migration was started from this instance.
    None,
    Active {
        transferred_bytes: u64,
        total_bytes: u64,
        /// What the source still has to send (dirtied pages included),
        /// for a progress display and its ETA; `transferred + remaining`
        /// may exceed `total` as pages are sent again.
        #[serde(default)]
        remaining_bytes: u64,
    },
    Completed {
        total_ms: u64,
        downtime_ms: Option<u64>,
    },
    Failed {
        reason: String,
    },
    /// The source instance is gone (exited, or forgotten) before any
    /// outcome was seen: whether it handed over is not known here. Only the
    /// target's state can tell; never read this as a failure.
    Unknown {
        reason: String,
    },
}

/// Every variant names the domain (instance id) it is about. `reason`
/// says what the cause does not (which file, which command), or is the
/// whole of it where the cause is only text; `source` is the error that
/// made it fail, when there is one: print the chain
/// (`keel_ctrl::error_chain`) to read all of it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HvError {
    #[error("domain {instance} not found")]
    NotFound { instance: String },
    #[error(
        "domain {instance}: hypervisor unavailable during {op}{}",
        then(reason)
    )]
    Unavailable {
        instance: String,
        op: &'static str,
        reason: String,
        #[source]
        source: Option<Cause>,
    },
    #[error("domain {instance} already exists")]
    AlreadyExists { instance: String },
    #[error("domain {instance}: cleanup refused, it has not exited (state {state:?})")]
    StillRunning {
        instance: String,
        state: DomainState,
    },
    #[error("VM {vm}: {op} failed{}", then(reason))]
    Storage {
        vm: String,
        op: &'static str,
        reason: String,
        #[source]
        source: Option<Cause>,
    },
    #[error("domain {instance}: {op} failed{}", then(reason))]
    Failed {
        instance: String,
        op: &'static str,
        reason: String,
        #[source]
        source: Option<Cause>,
    },
    /// The node's local fence lease could not be renewed.
    #[error("fence lease{}", then(reason))]
    Fence {
        reason: String,
        #[source]
        source: Option<Cause>,
    },
}

/// `": reason"`, or nothing when the cause says it all.
fn then(reason: &str) -> String {
    if reason.is_empty() {
        String::new()
    } else {
        format!(": {reason}")
    }
}

impl HvError {
    /// `op` on `instance` failed because of `cause`; `context` says what
    /// the cause does not (which file, which process), or is empty.
    pub fn failed_by(
        instance: impl Into<String>,
        op: &'static str,
        context: impl Into<String>,
        cause: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        HvError::Failed {
            instance: instance.into(),
            op,
            reason: context.into(),
            source: Some(Cause::new(cause)),
        }
    }

    /// The hypervisor could not be asked about `instance` because of `cause`.
    pub fn unavailable_by(
        instance: impl Into<String>,
        op: &'static str,
        context: impl Into<String>,
        cause: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        HvError::Unavailable {
            instance: instance.into(),
            op,
            reason: context.into(),
            source: Some(Cause::new(cause)),
        }
    }

    /// `op` on the disks of `vm` failed because of `cause`.
    pub fn storage_by(
        vm: impl Into<String>,
        op: &'static str,
        context: impl Into<String>,
        cause: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        HvError::Storage {
            vm: vm.into(),
            op,
            reason: context.into(),
            source: Some(Cause::new(cause)),
        }
    }

    pub fn is_not_found(&self) -> bool {
        matches!(self, HvError::NotFound { .. })
    }
}

#[async_trait]
pub trait Hypervisor: Send + Sync + 'static {
    async fn facts(&self) -> NodeFacts;

    /// Exits and monitor events as they happen ([`DomainEvent`]), for
    /// drivers that see them (`None`: only by looking). A missed or lagged
    /// event costs latency, never correctness: controllers still re-check
    /// on their (slow) resync schedule.
    fn domain_events(&self) -> Option<tokio::sync::broadcast::Receiver<DomainEvent>> {
        None
    }

    /// Extends the node's local fence lease to `valid_for` from now. Called
    /// after each heartbeat that reached the store, with what is left of the
    /// self-fence window counted from before it was sent. A driver that
    /// fences (the QEMU driver under keepers) ends every guest once the
    /// lease lapses, even if this process is dead; others ignore it.
    async fn renew_fence(&self, valid_for: std::time::Duration) -> Result<(), HvError> {
        let _ = valid_for;
        Ok(())
    }

    /// Creates the VM's disks if missing and launches the domain.
    async fn start(&self, spec: &DomainSpec) -> Result<(), HvError>;

    /// Asks the guest to power off (ACPI power button). Returns at once.
    async fn shutdown(&self, instance: &str) -> Result<(), HvError>;

    /// Ends the domain now (SIGKILL / QMP quit). The record stays until `cleanup`.
    async fn kill(&self, instance: &str) -> Result<(), HvError>;

    async fn info(&self, instance: &str) -> Result<DomainInfo, HvError>;

    /// Every domain this node knows, exited ones included, each on its own:
    /// a domain whose state cannot be read is in `unknown`, with its reason.
    /// Fails only when the node's domains cannot be enumerated at all.
    async fn list(&self) -> Result<DomainListing, HvError>;

    /// The domains of one VM, exited ones included. Fails if one of them
    /// (or one that may be one of them) cannot be read; other VMs' domains
    /// neither delay nor fail it in drivers that override this default.
    async fn domains_of(&self, vm: &str) -> Result<Vec<DomainInfo>, HvError> {
        self.list().await?.of_vm(vm)
    }

    /// Forgets an exited domain and removes its runtime files. Refuses a
    /// domain that has not exited; `NotFound` if already forgotten.
    async fn cleanup(&self, instance: &str) -> Result<(), HvError>;

    /// Deletes a VM's disks. Only called once no instance of it exists.
    async fn delete_disks(&self, vm: &str) -> Result<(), HvError>;

    /// Takes snapshot `name` of every disk of `vm`, consistently: a running
    /// `instance` is paused while it is taken and resumed after. Taking a
    /// snapshot that already exists is a success (retries are safe).
    async fn snapshot_disks(
        &self,
        vm: &str,
        disks: &[keel_api::DiskSpec],
        instance: Option<&str>,
        name: &str,
    ) -> Result<(), HvError> {
        let _ = (disks, instance);
        Err(unsupported(vm, "snapshot", name))
    }

    /// Puts every disk of `vm` back to snapshot `name`. Only called once no
    /// instance of the VM exists; repeating it gives the same disks.
    async fn restore_disks(
        &self,
        vm: &str,
        disks: &[keel_api::DiskSpec],
        name: &str,
    ) -> Result<(), HvError> {
        let _ = disks;
        Err(unsupported(vm, "restore", name))
    }

    /// Starts an instance that waits for an incoming live migration and
    /// returns the URI the source is to send to. It reports `Starting`
    /// while the state arrives and `Paused` once all of it has; its guest
    /// runs only after [`Hypervisor::resume_incoming`], which Keel calls
    /// once the migration's success is recorded (as libvirt does): a target
    /// never runs beside a source that did not hand over.
    async fn prepare_incoming(&self, spec: &DomainSpec) -> Result<String, HvError> {
        self.prepare_incoming_from(spec, &IncomingParams::default())
            .await
    }

    /// [`Hypervisor::prepare_incoming`], admitting only the source
    /// `params` names: what a driver that migrates implements.
    async fn prepare_incoming_from(
        &self,
        spec: &DomainSpec,
        params: &IncomingParams,
    ) -> Result<String, HvError> {
        let _ = params;
        Err(unsupported_migration(
            &spec.instance,
            "prepare incoming migration",
        ))
    }

    /// Starts sending running `instance` to `uri` with the default
    /// tuning; returns once under way.
    async fn migrate(&self, instance: &str, uri: &str) -> Result<(), HvError> {
        self.migrate_tuned(instance, uri, &MigrationParams::default())
            .await
    }

    /// [`Hypervisor::migrate`], tuned: what a driver that migrates
    /// implements.
    async fn migrate_tuned(
        &self,
        instance: &str,
        uri: &str,
        params: &MigrationParams,
    ) -> Result<(), HvError> {
        let _ = (uri, params);
        Err(unsupported_migration(instance, "migrate"))
    }

    async fn migration_status(&self, instance: &str) -> Result<MigrationProgress, HvError> {
        Err(unsupported_migration(instance, "query migration"))
    }

    /// Lets the guest of an incoming instance whose state has fully
    /// arrived (`Paused`) run. Running already is a success; an instance
    /// still receiving, or gone, is an error.
    async fn resume_incoming(&self, instance: &str) -> Result<(), HvError> {
        Err(unsupported_migration(instance, "resume incoming migration"))
    }

    /// Asks an active migration to stop; the source keeps running. A
    /// migration that completes anyway is reported as completed.
    async fn cancel_migration(&self, instance: &str) -> Result<(), HvError> {
        Err(unsupported_migration(instance, "cancel migration"))
    }

    /// The last `max_bytes` of the instance's serial console log (ttyS0),
    /// and the log's total length.
    async fn console_tail(
        &self,
        instance: &str,
        max_bytes: u64,
    ) -> Result<(Vec<u8>, u64), HvError> {
        let _ = max_bytes;
        Err(unsupported_guest(instance, "read console log"))
    }

    /// Whether the console log of `instance` contains `text` (on any line,
    /// from the start of the instance). Drivers scan incrementally, so a
    /// repeated probe costs only what was written since the last one.
    async fn console_contains(&self, instance: &str, text: &str) -> Result<bool, HvError> {
        let _ = text;
        Err(unsupported_guest(instance, "scan console log"))
    }

    /// Watches the console of `instance` for `text` in the guest's current
    /// boot: once it shows, calls `shown` and then announces
    /// [`DomainEventKind::ConsoleShowed`], so readiness by console is seen
    /// at once rather than at the next probe. Returns at once; a second
    /// call while a watch for the same text runs (or after it showed in
    /// this boot) does nothing. A hint only, as every domain event: the
    /// probe (`console_contains`) stays the truth. Drivers whose console
    /// changes only when looked at (the sim's is a function of its clock)
    /// keep this default, which watches nothing.
    fn watch_console(&self, instance: &str, text: &str, shown: Box<dyn FnOnce() + Send>) {
        let _ = (instance, text, shown);
    }

    /// Attaches to the serial console: bytes written go to the guest's
    /// ttyS0, bytes read are what it prints. One session at a time: a
    /// second attach fails (`Failed`, naming the session in use) until the
    /// first stream is dropped.
    async fn open_console(&self, instance: &str) -> Result<ConsoleStream, HvError> {
        Err(unsupported_guest(instance, "attach console"))
    }

    /// Connects to the graphical console's VNC server (the raw RFB stream)
    /// of an instance started with `spec.boot.graphics`. Drivers without
    /// a display (the sim) refuse it.
    async fn open_vnc(&self, instance: &str) -> Result<ConsoleStream, HvError> {
        Err(unsupported_guest(instance, "attach graphical console"))
    }

    /// Asks the guest agent what it knows (bounded in time: a silent or
    /// absent agent is `AgentState::Silent`, never a hang). Errors only
    /// when the instance itself cannot be looked at.
    async fn guest_info(&self, instance: &str) -> Result<GuestInfo, HvError> {
        Err(unsupported_guest(instance, "query guest agent"))
    }

    /// Freezes the guest's filesystems through its agent (bounded). Returns
    /// how many were frozen. Whatever it returns, the caller thaws after.
    async fn fs_freeze(&self, instance: &str) -> Result<u32, HvError> {
        Err(unsupported_guest(instance, "freeze filesystems"))
    }

    /// Thaws the guest's filesystems (bounded); thawing a guest that is
    /// not frozen is a success.
    async fn fs_thaw(&self, instance: &str) -> Result<u32, HvError> {
        Err(unsupported_guest(instance, "thaw filesystems"))
    }

    /// Asks the guest agent to power the guest off (`guest-shutdown`): for
    /// guests that ignore the ACPI power button. Returns once the agent
    /// took the request (or the call timed out), not when the guest is off.
    async fn guest_shutdown(&self, instance: &str) -> Result<(), HvError> {
        Err(unsupported_guest(
            instance,
            "shut down through the guest agent",
        ))
    }

    /// Asks the guest agent to reboot the guest (`guest-shutdown`, mode
    /// `reboot`). Returns once the agent took the request (or the call
    /// timed out), not when the guest has reset: the reset shows in
    /// [`DomainInfo::resets`].
    async fn guest_reboot(&self, instance: &str) -> Result<(), HvError> {
        Err(unsupported_guest(
            instance,
            "reboot through the guest agent",
        ))
    }

    /// Resets the guest now, as a reset button does (QMP `system_reset`),
    /// inside the same domain. Counted in [`DomainInfo::resets`].
    async fn reset(&self, instance: &str) -> Result<(), HvError> {
        Err(unsupported_guest(instance, "reset"))
    }

    /// Plugs a disk into a running instance: makes it if it is missing and
    /// allowed, then attaches it on its root port. Attaching one already
    /// attached (by its file) does nothing, so a repeat after a lost
    /// answer is safe.
    async fn attach_disk(&self, plug: &DiskPlug) -> Result<(), HvError> {
        Err(unsupported_guest(&plug.instance, "plug a disk in"))
    }

    /// Unplugs plugged disk `disk` of `vm` from its running instance: asks
    /// the guest to let go of it (again, if the guest let an earlier ask
    /// lapse) while the device is there, and closes the disk once it is
    /// gone. Repeated until it answers `Gone`; a disk the instance does
    /// not have is `Gone`.
    async fn detach_disk(
        &self,
        vm: &str,
        instance: &str,
        disk: &str,
    ) -> Result<DiskDetach, HvError> {
        let _ = (vm, disk);
        Err(unsupported_guest(instance, "unplug a disk"))
    }

    /// Grows disk `disk` of `vm` to `size_mib` under its running instance
    /// `instance`, which the guest sees as a capacity change. A disk
    /// already that large (or larger) is left as it is: never a shrink.
    async fn grow_disk(
        &self,
        vm: &str,
        instance: &str,
        disk: &str,
        size_mib: u64,
    ) -> Result<(), HvError> {
        let _ = (vm, disk, size_mib);
        Err(unsupported_guest(instance, "grow a disk online"))
    }

    /// Writes each of `disks` of `vm` as snapshot `snapshot` holds them
    /// into `dir` (`keel vm export`), as files that stand alone: one per
    /// disk, named [`keel_api::vm_export::disk_file`], and the UEFI
    /// variable store the snapshot kept, if any
    /// ([`keel_api::vm_export::UEFI_VARS_FILE`]). The VM may run meanwhile:
    /// a snapshot does not change. Returns the names written, in order.
    async fn export_disks(
        &self,
        vm: &str,
        disks: &[keel_api::DiskSpec],
        snapshot: &str,
        dir: &std::path::Path,
    ) -> Result<Vec<String>, HvError> {
        let _ = (disks, dir);
        Err(unsupported(vm, "export", snapshot))
    }

    /// Makes the files of an export in `dir` (named as
    /// [`Hypervisor::export_disks`] names them) the disks of `vm`, which
    /// has none: each is checked to be a disk this driver runs (never one
    /// that names another file of the host) and moved into place; an
    /// existing disk is never replaced. On failure none stays.
    async fn import_disks(
        &self,
        vm: &str,
        disks: &[keel_api::DiskSpec],
        dir: &std::path::Path,
    ) -> Result<(), HvError> {
        let _ = (disks, dir);
        Err(HvError::Storage {
            vm: vm.to_string(),
            op: "import",
            reason: "not supported by this driver".into(),
            source: None,
        })
    }

    /// What each running domain uses (CPU time, memory, disk and network
    /// counters), each domain's read bounded in time: one that cannot be
    /// read is reported with what could be, or left out. Read through
    /// [`stats_cache::StatsCache`], which bounds and shares the reads. A
    /// driver that cannot tell reports no domains.
    async fn stats_all(&self) -> Result<Vec<vm_stats::DomainStats>, HvError> {
        Ok(Vec::new())
    }

    /// Removes snapshot `name` from the disks of `vm`; absent is success.
    async fn delete_snapshot(
        &self,
        vm: &str,
        disks: &[keel_api::DiskSpec],
        name: &str,
    ) -> Result<(), HvError> {
        let _ = disks;
        Err(unsupported(vm, "delete snapshot", name))
    }
}

fn unsupported_migration(instance: &str, op: &'static str) -> HvError {
    HvError::Failed {
        instance: instance.to_string(),
        op,
        reason: "live migration not supported by this driver".into(),
        source: None,
    }
}

fn unsupported_guest(instance: &str, op: &'static str) -> HvError {
    HvError::Failed {
        instance: instance.to_string(),
        op,
        reason: "not supported by this driver".into(),
        source: None,
    }
}

fn unsupported(vm: &str, op: &'static str, snapshot: &str) -> HvError {
    HvError::Storage {
        vm: vm.to_string(),
        op,
        reason: format!("snapshot {snapshot}: not supported by this driver"),
        source: None,
    }
}

#[cfg(test)]
mod tests {
    /// The cause stays an error of its own: the message names what it
    /// lacks, the chain carries the whole of it, and a caller can still
    /// tell what it was.
    #[test]
    fn a_failure_keeps_its_cause_as_its_source() {
        let gone = std::io::Error::from_raw_os_error(libc::ESRCH);
        let err = HvError::failed_by("web-1", "kill", "SIGKILL pid 7", gone);
        assert_eq!(err.to_string(), "domain web-1: kill failed: SIGKILL pid 7");
        let source = std::error::Error::source(&err).expect("a source");
        let io = source.downcast_ref::<crate::Cause>().map(|c| c.get());
        let io = io.and_then(|e| e.downcast_ref::<std::io::Error>());
        assert_eq!(io.and_then(|e| e.raw_os_error()), Some(libc::ESRCH));
        let text = crate::cause::with_causes(&err);
        assert!(
            text.starts_with("domain web-1: kill failed: SIGKILL pid 7: No such process"),
            "{text}"
        );
        // Text alone reads as before.
        let plain = HvError::Failed {
            instance: "web-1".into(),
            op: "start",
            reason: "no disks".into(),
            source: None,
        };
        assert_eq!(
            crate::cause::with_causes(&plain),
            "domain web-1: start failed: no disks"
        );
    }

    use super::*;

    fn domain(vm: &str, instance: &str, state: DomainState) -> DomainInfo {
        DomainInfo {
            instance: instance.into(),
            vm: vm.into(),
            state,
            pid: None,
            started_at: 0,
            fenced: true,
            resets: 0,
        }
    }

    fn unknown(vm: Option<&str>, instance: &str) -> UnknownDomain {
        UnknownDomain {
            instance: instance.into(),
            vm: vm.map(Into::into),
            fenced: true,
            error: HvError::Unavailable {
                instance: instance.into(),
                op: "list",
                reason: "QMP timed out".into(),
                source: None,
            },
        }
    }

    #[test]
    fn a_vms_domains_fail_only_on_an_unknown_one_that_may_be_its() {
        let listing = DomainListing {
            domains: vec![
                domain("web", "web-1", DomainState::Running),
                domain("db", "db-1", DomainState::Running),
            ],
            unknown: vec![unknown(Some("db"), "db-2")],
        };
        let web = listing.clone().of_vm("web").unwrap();
        assert_eq!(web, [domain("web", "web-1", DomainState::Running)]);
        let err = listing.clone().of_vm("db").unwrap_err();
        assert!(matches!(err, HvError::Unavailable { instance, .. } if instance == "db-2"));
        // Whose it is nobody knows: it may be anyone's.
        let mut anyones = listing;
        anyones.unknown.push(unknown(None, "web-9"));
        assert!(anyones.of_vm("web").is_err());
    }

    #[test]
    fn fencing_covers_unknown_domains_and_skips_exited_ones() {
        let listing = DomainListing {
            domains: vec![
                domain("web", "web-1", DomainState::Running),
                domain("web", "web-0", DomainState::Exited(ExitCause::Killed)),
            ],
            unknown: vec![unknown(None, "db-2")],
        };
        let fenced: Vec<&str> = listing.instances().collect();
        assert_eq!(fenced, ["web-1", "db-2"]);
    }

    #[test]
    fn instance_names_must_carry_their_vms_prefix() {
        let spec = |vm: &str, instance: &str| DomainSpec::bare(vm, instance, 1, 64);
        assert!(check_instance_name(&spec("web", "web-1"), "start").is_ok());
        assert!(check_instance_name(&spec("web", "web-1-1"), "start").is_ok());
        for bad in ["web", "web-", "db-1", "webx-1"] {
            let err = check_instance_name(&spec("web", bad), "start").unwrap_err();
            assert!(matches!(err, HvError::Failed { .. }), "{bad}: {err:?}");
        }
    }
}
