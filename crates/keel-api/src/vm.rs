//! The VirtualMachine resource.
//!
//! A record has four parts, each with one writer:
//! - `spec`: what the user asked for (API writes; the controller writes only
//!   `spec.power`, when a run ends by itself under a policy that keeps it
//!   stopped then: `RunPolicy::run_ends_after`).
//! - `power_intent`: the power state to return to after a restore or any
//!   re-creation of the runtime instance. It sits outside `spec` on purpose:
//!   a wholesale replacement of the spec cannot drop it.
//! - `deletion_requested_at`: set once by the API; the controller deletes the
//!   record only after the instance is observed gone and cleaned up.
//! - `status`: the controller's bookkeeping, including the live instance,
//!   which stays recorded until cleanup (not until stop).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::placement::PlacementRules;
use crate::{
    validate_name, CloudInitSpec, DiskHome, DiskRecord, InstanceReadiness, MacAddr, Millis,
    NetworkSpec, Readiness, ValidationError,
};

pub const DEFAULT_STOP_GRACE_PERIOD_S: u64 = 60;
pub const MAX_STOP_GRACE_PERIOD_S: u64 = 3600;
/// The longest kernel command line a spec may give (one line).
pub const MAX_CMDLINE_BYTES: usize = 1024;
pub const MIN_MEMORY_MIB: u64 = 16;
pub const MAX_MEMORY_MIB: u64 = 1 << 20;
pub const MAX_CPUS: u32 = 256;
pub const MAX_DISKS: usize = 16;
pub const MAX_DISK_SIZE_MIB: u64 = 16 << 20;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct VirtualMachine {
    pub name: String,
    /// Tells this VM from an earlier or later one of the same name: set
    /// when it is created, never changed, never reused. Migration ids
    /// include it, and a migration is adopted only by the VM it was made
    /// for. Empty on records written before uids existed.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub uid: String,
    /// Bumped by every spec change, so the controller can tell which spec
    /// its status describes (`status.observed_generation`).
    #[serde(default)]
    pub generation: u64,
    pub spec: VmSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power_intent: Option<PowerIntent>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deletion_requested_at: Option<Millis>,
    /// A restore the user asked for and the controller has not finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore: Option<RestoreRequest>,
    /// The user's last `keel vm migrate` (handled once `status.migrate_outcome` names it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migrate: Option<crate::MigrateRequest>,
    /// Bumped by each `keel vm reboot`; the controller resets the running
    /// guest once for every bump it has not yet observed
    /// (`status.observed_reboot_generation`). Not part of the spec: a
    /// reboot changes nothing the user configured.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub reboot_generation: u64,
    #[serde(default)]
    pub status: VmStatus,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RestoreRequest {
    pub snapshot: String,
    pub requested_at: Millis,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct VmSpec {
    pub cpus: u32,
    pub memory_mib: u64,
    #[serde(default)]
    pub disks: Vec<DiskSpec>,
    #[serde(default)]
    pub boot: BootSpec,
    #[serde(default)]
    #[schema(inline)]
    pub run_policy: RunPolicy,
    /// The power state the user last asked for. Every policy but AlwaysOn
    /// and AlwaysOff follows it (`RunPolicy::follows_power`).
    #[serde(default)]
    pub power: PowerState,
    /// Bumped by each restart request; the controller restarts the instance
    /// once for every bump it has not yet observed.
    #[serde(default)]
    pub restart_generation: u64,
    #[serde(default = "default_grace")]
    pub stop_grace_period_s: u64,
    /// Node the VM must run on; `None` lets Keel place it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// When the guest counts as up (`status.instance.readiness`). Records
    /// stored before this field existed mean `none` (ready once running);
    /// the API's default for new VMs is `agent`.
    #[serde(default = "Readiness::legacy")]
    pub readiness: Readiness,
    /// The VM's NIC. Records from before NICs existed decode to user-mode
    /// networking with the MAC derived from the name ([`VirtualMachine::mac`]).
    #[serde(default)]
    pub network: NetworkSpec,
    /// A cloud-init NoCloud seed for the guest, when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud_init: Option<CloudInitSpec>,
    /// High availability: whether the cluster may start the VM on another
    /// node when its node is lost, and so must fence (kill) it there first.
    /// `None`: on where the disk home is shared, off where it is
    /// node-local ([`VmSpec::ha_on`]). Only an instance on shared disks is
    /// ever fenced ([`VmSpec::fenced_on`]): one nobody else could take over
    /// keeps running through its agent's death and store outages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ha: Option<bool>,
    /// The guest's CPU model: a QEMU model name, or `host` for passthrough
    /// (fastest, but migrates only between identical CPUs under KVM).
    /// `None`: the migratable default ([`crate::hardware::DEFAULT_CPU_MODEL`])
    /// at the first start, kept after (`status.hardware`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_model: Option<String>,
    /// Node labels it requires and the groups it is kept apart from or
    /// together with ([`crate::placement`]).
    #[serde(default, skip_serializing_if = "PlacementRules::is_empty")]
    pub placement: PlacementRules,
    /// An emulated TPM whose state is kept with the disks ([`crate::tpm`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpm: Option<crate::TpmSpec>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

fn is_zero_u64(n: &u64) -> bool {
    *n == 0
}

fn default_grace() -> u64 {
    DEFAULT_STOP_GRACE_PERIOD_S
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DiskSpec {
    pub name: String,
    pub size_mib: u64,
    /// A disk image of the image store this disk starts as: created once,
    /// at the first start, as the VM's own qcow2 overlay on it. Fixed for
    /// the disk's life (the overlay depends on the image), and the image
    /// cannot be deleted while a VM names it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
}

/// The name `keel vm create --image` gives the root disk it adds.
pub const ROOT_DISK: &str = "root";

/// How the VM boots. With `kernel` set: direct kernel boot of that kernel
/// image (and `initrd` image) from the image store, never a host path.
/// Without it, a VM whose first disk comes from an image, or that names a
/// `firmware`, boots through firmware from its first disk; any other VM
/// boots the node's default (test) guest kernel. A VM with a `cdrom`
/// boots through firmware too ([`crate::cdrom`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct BootSpec {
    /// The name of an image of kind `iso`, attached as a read-only CD-ROM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cdrom: Option<String>,
    /// What firmware tries first when there is a CD-ROM; `None`: the CD-ROM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first: Option<crate::BootDevice>,
    /// A graphical console ([`crate::graphics`]); `None`: the serial one only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub graphics: Option<crate::Graphics>,
    /// The name of an image of kind `kernel`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<String>,
    /// The name of an image of kind `initrd`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initrd: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmdline: Option<String>,
    // `None`: SeaBIOS (QEMU's default BIOS). Not a doc comment: utoipa
    // would wrap the inlined enum with it in an `allOf` that says object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(inline, nullable = false)]
    pub firmware: Option<Firmware>,
}

#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Firmware {
    /// SeaBIOS, which ships with QEMU.
    #[default]
    Bios,
    /// OVMF (EDK II), with a writable variable store of the VM's own.
    Uefi,
    /// OVMF with Secure Boot on: the Secure Boot build of the code, SMM,
    /// and a variable store with Microsoft's keys enrolled. q35 only.
    #[serde(rename = "uefi-secure")]
    UefiSecure,
}

impl Firmware {
    /// Whether it is OVMF, with a variable store of the VM's own.
    pub fn is_uefi(self) -> bool {
        match self {
            Firmware::Bios => false,
            Firmware::Uefi | Firmware::UefiSecure => true,
        }
    }

    /// Why a start asking for `asked` (`spec.boot.firmware`) is refused
    /// for a VM whose first instance was recorded with `recorded`
    /// (`VmStatus::firmware`): its variable store was made for that one,
    /// and a restart must not silently boot other firmware (Secure Boot off,
    /// or a store without its keys). Nothing recorded: no refusal.
    pub fn change_refused(recorded: Option<Firmware>, asked: Option<Firmware>) -> Option<String> {
        let recorded = recorded?;
        let asked = asked.unwrap_or_default();
        (recorded != asked).then(|| {
            format!(
                "spec.boot.firmware is {} but the VM was first started with {}, which its \
                 variable store was made for; the firmware is fixed for the VM's life (set it \
                 back to {}, or create a new VM)",
                asked.name(),
                recorded.name(),
                recorded.name()
            )
        })
    }

    /// The name the API and the CLI use.
    pub fn name(self) -> &'static str {
        match self {
            Firmware::Bios => "bios",
            Firmware::Uefi => "uefi",
            Firmware::UefiSecure => "uefi-secure",
        }
    }
}

impl std::str::FromStr for Firmware {
    type Err = ValidationError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "bios" => Ok(Firmware::Bios),
            "uefi" => Ok(Firmware::Uefi),
            "uefi-secure" => Ok(Firmware::UefiSecure),
            _ => Err(ValidationError::new(
                "spec.boot.firmware",
                format!("{s:?} is not one of bios, uefi, uefi-secure"),
            )),
        }
    }
}

/// An image a spec names, and what for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageUse {
    /// The spec field that names it (`spec.disks[0].image`).
    pub field: String,
    pub name: String,
    pub kind: crate::ImageKind,
}

#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema,
)]
pub enum RunPolicy {
    /// Running whatever happens; a user stop is refused.
    AlwaysOn,
    /// Never running; a user start is refused.
    AlwaysOff,
    /// Does only what the user asks; a guest that stops or crashes stays stopped.
    Manual,
    /// Restarted after a crash or guest power-off, but not after a user stop.
    #[default]
    AlwaysOnUnlessStoppedManually,
    /// Restarted after a failure (a crash, a kill nobody asked for, an
    /// instance that vanished or a node that was lost), not after the guest
    /// powered itself off; a user stop is honoured.
    RerunOnFailure,
    /// Runs once: stays stopped after the run ends, however it ends. Start
    /// and restart requests are refused (the run is over, or still to
    /// come); a stop ends the run.
    Once,
}

impl RunPolicy {
    pub const ALL: [RunPolicy; 6] = [
        RunPolicy::AlwaysOn,
        RunPolicy::AlwaysOff,
        RunPolicy::Manual,
        RunPolicy::AlwaysOnUnlessStoppedManually,
        RunPolicy::RerunOnFailure,
        RunPolicy::Once,
    ];

    /// Whether `spec.power` (the user's last start or stop) decides if the
    /// VM runs; the other policies fix it.
    pub fn follows_power(self) -> bool {
        !matches!(self, RunPolicy::AlwaysOn | RunPolicy::AlwaysOff)
    }

    /// Whether an instance that ran and then ended by itself, in this way,
    /// ends the VM's run: the controller records `spec.power = Stopped`
    /// and starts nothing. A start that never ran is not a run and never
    /// ends one (it is retried with backoff), nor does an exit while a
    /// restore's `Running` intent is still to be fulfilled.
    pub fn run_ends_after(self, exit: ExitKind) -> bool {
        match self {
            RunPolicy::Manual | RunPolicy::Once => true,
            RunPolicy::RerunOnFailure => exit == ExitKind::GuestPoweroff,
            RunPolicy::AlwaysOn
            | RunPolicy::AlwaysOff
            | RunPolicy::AlwaysOnUnlessStoppedManually => false,
        }
    }
}

impl std::str::FromStr for RunPolicy {
    type Err = ValidationError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        RunPolicy::ALL
            .into_iter()
            .find(|p| format!("{p:?}").eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                let names: Vec<String> = RunPolicy::ALL.iter().map(|p| format!("{p:?}")).collect();
                ValidationError::new(
                    "spec.run_policy",
                    format!("{s:?} is not one of {}", names.join(", ")),
                )
            })
    }
}

#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema,
)]
pub enum PowerState {
    #[default]
    Running,
    Stopped,
}

/// The power state a VM must return to once its runtime instance is
/// re-created (snapshot restore, rebuild). Written before the maintenance
/// window starts; converted into `spec.power` and cleared exactly once,
/// after the replacement instance has booted (or, for `Stopped`, at once);
/// dropped earlier by a user's power request that says otherwise.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PowerIntent {
    pub power: PowerState,
    /// Why it was recorded, e.g. `restore snapshot nightly`.
    pub reason: String,
    pub recorded_at: Millis,
}

#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema,
)]
pub enum Phase {
    #[default]
    Pending,
    Starting,
    Running,
    Stopping,
    Stopped,
    /// Not running, waiting for the next start attempt after a failure.
    BackOff,
    Deleting,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct VmStatus {
    #[serde(default)]
    pub phase: Phase,
    /// The spec generation this status was computed from.
    #[serde(default)]
    pub observed_generation: u64,
    /// The runtime instance Keel created and has not yet cleaned up. While
    /// this is `Some`, no other instance of the VM may be started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<Instance>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<StopProgress>,
    #[serde(default)]
    pub observed_restart_generation: u64,
    /// The last `reboot_generation` the controller took up (carried out,
    /// or found nothing running to reboot).
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub observed_reboot_generation: u64,
    /// Sequence number of the last instance created; instance ids are
    /// `<vm>-<seq>`, never reused.
    #[serde(default)]
    pub instance_seq: u64,
    /// Start attempts that ended without a stable boot, for backoff.
    #[serde(default)]
    pub failed_starts: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_start_at: Option<Millis>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_exit: Option<ExitRecord>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The node the next instance starts on, chosen by the scheduler. An
    /// existing instance's node is `instance.node`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// Moving the instance off a draining node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eviction: Option<Eviction>,
    /// Sequence number of the last migration attempt; ids are `<vm>-m<seq>`.
    #[serde(default)]
    pub migration_seq: u64,
    /// Where the VM's disks live: fixed when its first instance is
    /// recorded. Only nodes that see this home may run the VM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_home: Option<DiskHome>,
    /// An instance has run on the VM's disks. Kept for builds from before
    /// per-disk records (`disks`), which create no disk once it is set;
    /// this build goes by `disks`.
    #[serde(default)]
    pub disks_used: bool,
    /// Each disk a start was allowed to make: when, where, and whether an
    /// instance has run on it ([`crate::disk_record`]). `None` on records
    /// from before them ([`VmStatus::disk_records`] reads those safely).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disks: Option<Vec<DiskRecord>>,
    /// The spec fields changed since the current instance started that only
    /// a new instance takes (`cpus`, `memory`, ...): a restart applies them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub restart_required: Vec<String>,
    /// How the user's last migration request ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migrate_outcome: Option<crate::MigrateOutcome>,
    /// The versioned machine type and CPU model, recorded with the VM's
    /// first instance and given to every later one and to every migration
    /// target ([`crate::hardware`]). A spec that names another CPU model
    /// changes it at the next start; the machine type stays.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hardware: Option<crate::VmHardware>,
    /// The firmware (`spec.boot.firmware`, SeaBIOS when unnamed) recorded
    /// with the first instance, like the machine type: the UEFI variable
    /// store was made for it (Secure Boot's has Microsoft's keys enrolled),
    /// so a start with another one is refused, with the reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub firmware: Option<Firmware>,
    /// When an instance was first seen running with the TPM (`spec.tpm`):
    /// from then on its state is the VM's data and must exist wherever
    /// the VM starts; no start may make a blank one instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpm_used_since: Option<Millis>,
    /// The VM this one is a clone of, whose disks at a snapshot its first
    /// start copies (`keel vm clone`). Kept afterwards as its history.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clone_from: Option<crate::CloneSource>,
    /// The node a drain last moved this VM away from, until it is asked
    /// back (`keel node uncordon --return`, [`crate::drain_return`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drained_from: Option<crate::DrainedFrom>,
}

impl VmStatus {
    /// Whether an instance ran on the disks, as a record from before
    /// per-disk records says it: `disks_used`, or for one from before disk
    /// homes were kept (no home), any instance before.
    pub fn legacy_disks_ran(&self) -> bool {
        match self.disk_home {
            Some(_) => self.disks_used,
            None => self.instance_seq > 0,
        }
    }

    /// The disk records as this build reads them ([`crate::disk_record::read`]),
    /// the disks of `spec` on `home` for a record from before them.
    pub fn disk_records(&self, spec: &VmSpec, home: &DiskHome) -> Vec<DiskRecord> {
        crate::disk_record::read(
            self.disks.as_deref(),
            self.legacy_disks_ran(),
            &spec.disk_names(),
            home,
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
pub enum EvictionPhase {
    /// A migration is being set up (target chosen, incoming instance started).
    Submitting,
    /// The source is sending its state to the target.
    Migrating,
    /// Migration gave up: graceful stop here, start elsewhere per run policy.
    Fallback,
}

/// Progress of moving one VM off a draining node. The deadlines are stored
/// so a controller restart resumes the same windows instead of opening new
/// ones; a missing or impossible deadline counts as expired.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Eviction {
    /// The drain (its `requested_at`) this eviction serves: a marker left by
    /// an earlier drain is stale and starts a new attempt.
    pub drain_requested_at: Millis,
    pub phase: EvictionPhase,
    pub started_at: Millis,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub submit_deadline: Option<Millis>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migrate_deadline: Option<Millis>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback_deadline: Option<Millis>,
    /// The migration of the current attempt, reserved before it is created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration: Option<String>,
    /// The instance the reserved migration moves: a reservation made from
    /// an instance that is no longer the VM's (it restarted before the
    /// migration record was created) is void. `None` on records from
    /// before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration_source: Option<String>,
    /// The reserved migration's target instance, minted with the
    /// reservation ([`VirtualMachine::mint_instance_id`]), never derived
    /// again from the counter. `None` on records from before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration_target: Option<String>,
    /// The node the reserved migration goes to: its incoming instance
    /// takes that node's capacity from the reservation on. `None` on
    /// records from before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration_target_node: Option<String>,
    /// Attempts of this eviction that failed, for the backoff between them.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub failed_attempts: u32,
    /// No new attempt before this (backoff after a failed one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_attempt_at: Option<Millis>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// This eviction carries out the user's `migrate` request (whose
    /// `requested_at` is `drain_requested_at`), not a drain: no retries,
    /// no fallback.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub user: bool,
}

impl Eviction {
    /// A new attempt to move the VM off, submitting from `now` until
    /// `submit_deadline`, for the drain (or, `user`, the `keel vm migrate`)
    /// requested at `requested_at`: nothing reserved yet.
    pub fn submitting(
        requested_at: Millis,
        now: Millis,
        submit_deadline: Option<Millis>,
        user: bool,
    ) -> Self {
        Self {
            drain_requested_at: requested_at,
            phase: EvictionPhase::Submitting,
            started_at: now,
            submit_deadline,
            migrate_deadline: None,
            fallback_deadline: None,
            migration: None,
            migration_source: None,
            migration_target: None,
            migration_target_node: None,
            failed_attempts: 0,
            next_attempt_at: None,
            message: None,
            user,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Instance {
    pub id: String,
    pub node: String,
    pub created_at: Millis,
    /// When the hypervisor was first seen reporting it running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running_since: Option<Millis>,
    /// Why the hypervisor's start of this instance failed. The instance
    /// stays recorded until it is observed gone all the same: a failed
    /// call does not prove that nothing runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_error: Option<String>,
    /// Whether the guest is up, and what its agent said; probed on the
    /// instance's node while it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub readiness: Option<InstanceReadiness>,
    /// The live migration that handed the guest over to this instance,
    /// until the instance is first seen running. Its guest never stopped:
    /// while the target waits to be resumed (paused, or still taking in the
    /// last of the state) the VM is Running, not booting again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resuming_after: Option<String>,
    /// What it was started with, of the fields only a start takes. `None`
    /// on instances from before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_with: Option<crate::StartedWith>,
    /// Whether this instance runs under the node's fence lease (killed when
    /// it lapses) and so may be taken over when its node is lost. Decided
    /// once, when the instance is recorded ([`VmSpec::fenced_on`]); a later
    /// change of `spec.ha` applies to the next instance only, since turning
    /// HA on for a running unfenced guest would otherwise let the cluster
    /// start a second one beside it. Records from before: fenced, as every
    /// instance of a cluster node was then.
    #[serde(default = "fenced_before_ha")]
    pub fenced: bool,
    /// Resets of the guest inside this instance (its own reboots and
    /// `keel vm reboot`s), as the hypervisor counted them: a guest that
    /// resets in a loop shows here.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub resets: u32,
    /// When the controller last saw the count grow. Readiness probes from
    /// before it describe the guest before its reboot and are not used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_reset_at: Option<Millis>,
    /// A `keel vm reboot` under way on this instance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reboot: Option<crate::RebootProgress>,
    /// The size (MiB) each disk of this instance has as its guest sees it,
    /// by disk name: the spec's at the start, then grown in place by
    /// online resizes (`keel vm disk resize` of a running VM). Empty on
    /// instances from before it was kept (their disks are not resized
    /// online).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub disk_sizes_mib: BTreeMap<String, u64>,
    /// Spare PCIe root ports it is launched with, for disks plugged while
    /// it runs ([`crate::hotplug`]); a migration target gets the same. 0 on
    /// instances from before (nothing can be plugged into them).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub hotplug_ports: u32,
    /// Disks plugged into it since its start, each on its own port.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub plugged: Vec<crate::PluggedDisk>,
    /// Whether it is launched with a memory balloon device, through which
    /// the guest reports its own view of its memory. Part of the device
    /// set, so a migration target gets exactly what its source had:
    /// `false` on instances from before (and so on their targets).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub balloon: bool,
}

fn fenced_before_ha() -> bool {
    true
}

impl Instance {
    /// A new instance, recorded before the hypervisor is asked to start it.
    /// Fenced unless the caller says otherwise (see [`Instance::fenced`]).
    pub fn new(id: impl Into<String>, node: impl Into<String>, created_at: Millis) -> Self {
        Self {
            id: id.into(),
            node: node.into(),
            created_at,
            running_since: None,
            start_error: None,
            readiness: None,
            resuming_after: None,
            started_with: None,
            fenced: true,
            resets: 0,
            last_reset_at: None,
            reboot: None,
            disk_sizes_mib: BTreeMap::new(),
            hotplug_ports: 0,
            plugged: Vec::new(),
            balloon: false,
        }
    }
}

/// What [`crate::hotplug`] asks of an instance.
impl Instance {
    /// The disks this instance has, by name, in the guest's order: those it
    /// was started with, then those plugged since (also one still being
    /// plugged). `None` for an instance from before `started_with`.
    pub fn disk_names(&self) -> Option<Vec<String>> {
        let started = &self.started_with.as_ref()?.disks;
        Some(
            started
                .iter()
                .cloned()
                .chain(self.plugged.iter().map(|p| p.disk.clone()))
                .collect(),
        )
    }

    /// The disks this instance has attached, by name, in the guest's
    /// order: those it was started with, then the plugs confirmed since (a
    /// plug under way is not attached until its confirmation). `None` for
    /// an instance from before `started_with`.
    pub fn attached_disk_names(&self) -> Option<Vec<String>> {
        let started = &self.started_with.as_ref()?.disks;
        Some(
            started
                .iter()
                .cloned()
                .chain(
                    self.plugged
                        .iter()
                        .filter(|p| p.attached_at.is_some())
                        .map(|p| p.disk.clone()),
                )
                .collect(),
        )
    }

    /// A root port no plugged disk holds, if any is left.
    pub fn free_port(&self) -> Option<u32> {
        (0..self.hotplug_ports).find(|port| self.plugged.iter().all(|p| p.port != *port))
    }

    /// The plug under way (recorded, not yet confirmed), if any.
    pub fn plug_under_way(&self) -> Option<&crate::PluggedDisk> {
        self.plugged.iter().find(|p| p.attached_at.is_none())
    }

    /// The unplug under way (recorded, the guest not yet seen to let go),
    /// if any.
    pub fn unplug_under_way(&self) -> Option<&crate::PluggedDisk> {
        self.plugged
            .iter()
            .find(|p| p.detach_requested_at.is_some())
    }

    /// What is being done to this instance's disks, if anything: a plug or
    /// an unplug recorded and not yet finished. A migration waits for it
    /// (its target is launched with the instance's disks, which are in
    /// flux until then).
    pub fn disk_change_under_way(&self) -> Option<String> {
        if let Some(p) = self.plug_under_way() {
            return Some(format!("the plug of disk {}", p.disk));
        }
        self.unplug_under_way()
            .map(|p| format!("the unplug of disk {}", p.disk))
    }
}

impl DiskHome {
    /// Whether another node could open these disks (and so run the VM).
    pub fn is_shared(&self) -> bool {
        matches!(self, DiskHome::Shared(_))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
pub enum StopReason {
    User,
    Restart,
    Delete,
    Policy,
    Restore,
    Evict,
}

/// A stop in progress: graceful power-down, re-checked with exponential
/// backoff until the grace period ends, then forced. Stored so a controller
/// restart continues the same schedule instead of starting over.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct StopProgress {
    pub reason: StopReason,
    pub requested_at: Millis,
    /// Graceful power-down requests sent so far.
    pub attempts: u32,
    pub next_check_at: Millis,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forced_at: Option<Millis>,
    /// When the guest agent was asked to power off (the fallback for a
    /// guest that ignores the power button, at half the grace period).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_shutdown_at: Option<Millis>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
pub enum ExitKind {
    /// The guest powered itself off (or answered our power-down).
    GuestPoweroff,
    Crashed,
    /// Keel force-killed it after the grace period.
    Killed,
    /// The hypervisor reported it absent (NotFound) without an exit record.
    Vanished,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ExitRecord {
    pub instance: String,
    pub at: Millis,
    pub kind: ExitKind,
    /// Whether Keel had asked it to stop.
    pub requested: bool,
    /// What went wrong, when Keel knows (e.g. the start's error).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl VirtualMachine {
    /// Whether the recorded instance `id` runs fenced; one not recorded
    /// (any more) counts as fenced, the cautious answer. A migration's
    /// target takes its source's answer: the guest moves, its fencing
    /// with it, decided once at the source's start.
    pub fn instance_fenced(&self, id: &str) -> bool {
        self.status
            .instance
            .as_ref()
            .filter(|i| i.id == id)
            .is_none_or(|i| i.fenced)
    }

    pub fn new(name: impl Into<String>, spec: VmSpec) -> Self {
        Self {
            name: name.into(),
            uid: String::new(),
            generation: 1,
            spec,
            power_intent: None,
            deletion_requested_at: None,
            restore: None,
            migrate: None,
            reboot_generation: 0,
            status: VmStatus::default(),
        }
    }

    /// The node responsible for this VM now: where its instance is, or where
    /// the next one is to start.
    pub fn owner_node(&self) -> Option<&str> {
        match &self.status.instance {
            Some(inst) => Some(&inst.node),
            None => self.status.node.as_deref(),
        }
    }

    /// The node a migration of this VM reserved goes to, while it is
    /// reserved: it takes that node's capacity too (`crate::capacity`).
    pub fn incoming_on(&self) -> Option<&str> {
        let ev = self.status.eviction.as_ref()?;
        ev.migration.as_ref()?;
        ev.migration_target_node
            .as_deref()
            .filter(|n| self.allocated_on() != Some(*n))
    }

    /// The node whose capacity this VM takes (`crate::capacity`): its
    /// instance's, or, with none, the node it is placed on if it is to run
    /// there. A stopped VM takes nothing.
    pub fn allocated_on(&self) -> Option<&str> {
        match &self.status.instance {
            Some(inst) => Some(&inst.node),
            None if self.wants_running() => self.status.node.as_deref(),
            None => None,
        }
    }

    /// Whether, by policy and the user's last request, an instance should
    /// be running now (ignoring backoff and pending restarts).
    pub fn wants_running(&self) -> bool {
        if self.deletion_requested_at.is_some() || self.restore.is_some() {
            return false;
        }
        match self.spec.run_policy {
            RunPolicy::AlwaysOn => true,
            RunPolicy::AlwaysOff => false,
            p => {
                debug_assert!(p.follows_power());
                self.spec.power == PowerState::Running
            }
        }
    }

    /// The NIC's MAC: the one in the spec, or for a record from before MACs
    /// were kept, one derived from the name (the same on every node and
    /// every start).
    pub fn mac(&self) -> MacAddr {
        self.spec
            .network
            .mac_addr()
            .unwrap_or_else(|| MacAddr::derived(&self.name))
    }

    /// The NIC as an instance gets it: the spec's, with [`Self::mac`].
    pub fn nic(&self) -> NetworkSpec {
        NetworkSpec {
            mac: Some(self.mac().to_string()),
            ..self.spec.network.clone()
        }
    }

    /// A new instance id, `<name>-<n>`, with the instance counter bumped
    /// here; the caller records both in one write. No id is derived from
    /// the counter anywhere else, so none is ever given out twice: a
    /// migration target once got the id of the instance started after its
    /// reservation, became its own source, and the handed-over source,
    /// bearing the recorded id, was never collected.
    pub fn mint_instance_id(&mut self) -> String {
        self.status.instance_seq += 1;
        format!("{}-{}", self.name, self.status.instance_seq)
    }

    pub fn restart_pending(&self) -> bool {
        self.spec.restart_generation > self.status.observed_restart_generation
    }

    pub fn validate(&self) -> Result<(), ValidationError> {
        crate::name::validate_vm_name("name", &self.name)?;
        self.spec.validate()
    }

    /// The user asks for the VM to run.
    pub fn request_start(&mut self) -> Result<(), ValidationError> {
        self.refuse_if_busy()?;
        if matches!(self.spec.run_policy, RunPolicy::AlwaysOff | RunPolicy::Once) {
            return Err(ValidationError::new(
                "spec.run_policy",
                format!(
                    "VM {} is {:?}; change the run policy to start it",
                    self.name, self.spec.run_policy
                ),
            ));
        }
        self.set_power(PowerState::Running);
        Ok(())
    }

    /// The user asks for the VM to stop (graceful, then forced after the grace period).
    pub fn request_stop(&mut self) -> Result<(), ValidationError> {
        self.refuse_if_busy()?;
        if self.spec.run_policy == RunPolicy::AlwaysOn {
            return Err(ValidationError::new(
                "spec.run_policy",
                format!(
                    "VM {} is AlwaysOn; change the run policy to stop it",
                    self.name
                ),
            ));
        }
        self.set_power(PowerState::Stopped);
        Ok(())
    }

    /// When the guest of the current instance became ready, if it is ready
    /// now: the VM is Running and its guest is up per `spec.readiness`.
    pub fn ready_since(&self) -> Option<Millis> {
        if self.status.phase != Phase::Running {
            return None;
        }
        let inst = self.status.instance.as_ref()?;
        match self.spec.readiness {
            Readiness::None => inst.running_since,
            _ => inst.readiness.as_ref()?.ready_at,
        }
    }

    /// The user asks for a restart: the old instance is stopped and observed
    /// gone before the new one starts.
    pub fn request_restart(&mut self) -> Result<(), ValidationError> {
        self.refuse_if_busy()?;
        if matches!(self.spec.run_policy, RunPolicy::AlwaysOff | RunPolicy::Once) {
            return Err(ValidationError::new(
                "spec.run_policy",
                format!(
                    "VM {} is {:?}; change the run policy to restart it",
                    self.name, self.spec.run_policy
                ),
            ));
        }
        self.spec.power = PowerState::Running;
        self.spec.restart_generation += 1;
        self.generation += 1;
        self.drop_overruled_intent();
        Ok(())
    }

    /// Whether a `keel vm reboot` is still to be taken up by the controller.
    pub fn reboot_pending(&self) -> bool {
        self.reboot_generation > self.status.observed_reboot_generation
    }

    /// The user asks for the running guest to reboot: a reset inside the
    /// same instance, not a new one (that is [`Self::request_restart`]).
    /// Refused, naming the field, unless the VM runs and nothing else stops
    /// or re-creates it.
    pub fn request_reboot(&mut self) -> Result<(), ValidationError> {
        self.refuse_if_busy()?;
        let running = self.status.phase == Phase::Running
            && self.status.instance.is_some()
            && self.status.stop.is_none()
            && self.wants_running();
        if !running || self.restart_pending() {
            return Err(ValidationError::new(
                "status.phase",
                format!(
                    "VM {} is {:?}{}, not Running: only a running guest reboots \
                     (`keel vm start` or `restart` for a new instance)",
                    self.name,
                    self.status.phase,
                    if self.restart_pending() {
                        " with a restart pending"
                    } else {
                        ""
                    }
                ),
            ));
        }
        // Not a spec change: the generation stays (the store's revision
        // guards the write); `--wait` compares the observed counter.
        self.reboot_generation += 1;
        Ok(())
    }

    /// The user asks to restore `snapshot`. The power state the VM has now
    /// is recorded first (unless an earlier, unfinished re-creation already
    /// recorded one: that is still the state from before the maintenance,
    /// as no power request since has overruled it), so the VM comes back
    /// to it whatever the restored spec says.
    pub fn request_restore(&mut self, snapshot: &str, now: Millis) -> Result<(), ValidationError> {
        self.refuse_if_deleting()?;
        validate_name("snapshot", snapshot)?;
        if let Some(pending) = &self.restore {
            return Err(ValidationError::new(
                "restore",
                format!(
                    "VM {} is already being restored from snapshot {}",
                    self.name, pending.snapshot
                ),
            ));
        }
        let power = if self.wants_running() {
            PowerState::Running
        } else {
            PowerState::Stopped
        };
        self.power_intent.get_or_insert(PowerIntent {
            power,
            reason: format!("restore from snapshot {snapshot}"),
            recorded_at: now,
        });
        self.restore = Some(RestoreRequest {
            snapshot: snapshot.to_string(),
            requested_at: now,
        });
        self.generation += 1;
        Ok(())
    }

    /// The power state a restore of this VM ends in: the intent recorded
    /// when it was requested, as the run policy (which a restore keeps)
    /// allows it. The controller ends the restore there, and
    /// `keel restore --wait` waits for it.
    pub fn power_after_restore(&self) -> PowerState {
        let wanted = self
            .power_intent
            .as_ref()
            .map_or(self.spec.power, |i| i.power);
        match self.spec.run_policy {
            RunPolicy::AlwaysOn => PowerState::Running,
            RunPolicy::AlwaysOff => PowerState::Stopped,
            _ => wanted,
        }
    }

    /// Whether a restore is done and the VM is back in `power`: Running
    /// with an instance that has booted (the intent is cleared then), or
    /// Stopped with none.
    pub fn restored_to(&self, power: PowerState) -> bool {
        let s = &self.status;
        self.restore.is_none()
            && self.power_intent.is_none()
            && match power {
                PowerState::Running => s.phase == Phase::Running && s.instance.is_some(),
                PowerState::Stopped => s.phase == Phase::Stopped && s.instance.is_none(),
            }
    }

    /// Replaces the spec as a whole (an update), keeping what must survive
    /// such an overwrite: the power intent and the restart counter.
    pub fn replace_spec(&mut self, mut spec: VmSpec) -> Result<(), ValidationError> {
        self.refuse_if_busy()?;
        spec.validate()?;
        for (i, disk) in spec.disks.iter().enumerate() {
            let before = self.spec.disks.iter().find(|d| d.name == disk.name);
            if let Some(before) = before.filter(|b| b.image != disk.image) {
                return Err(ValidationError::new(
                    format!("spec.disks[{i}].image"),
                    format!(
                        "disk {} was made from image {:?}; a disk's image cannot change \
                         (add a new disk instead)",
                        disk.name, before.image
                    ),
                ));
            }
        }
        spec.restart_generation = spec.restart_generation.max(self.spec.restart_generation);
        spec.inherit_identity(&self.spec, self.mac());
        if spec != self.spec {
            self.spec = spec;
            self.generation += 1;
        }
        self.drop_overruled_intent();
        Ok(())
    }

    fn set_power(&mut self, power: PowerState) {
        if self.spec.power != power {
            self.spec.power = power;
            self.generation += 1;
        }
        self.drop_overruled_intent();
    }

    /// After a user's power request: an intent left by a finished restore
    /// (a `Running` one waits for the new instance to settle) that says
    /// otherwise is void, since the user's latest request is the state to
    /// return to. Kept, a restore requested next took the stale intent
    /// over the user's stop and came back Running. (While a restore is
    /// pending, power requests are refused and the intent stands.)
    fn drop_overruled_intent(&mut self) {
        if self
            .power_intent
            .as_ref()
            .is_some_and(|i| i.power != self.spec.power)
        {
            self.power_intent = None;
        }
    }

    /// The user's migration request still to be carried out, if any.
    pub fn pending_migration(&self) -> Option<&crate::MigrateRequest> {
        let req = self.migrate.as_ref()?;
        let handled = self
            .status
            .migrate_outcome
            .as_ref()
            .is_some_and(|o| o.requested_at == req.requested_at);
        let here = self.status.instance.as_ref().map(|i| i.node.as_str());
        (!handled && here == Some(req.from_node.as_str())).then_some(req)
    }

    /// Records a request to move the running instance (to node `to`, or
    /// wherever the scheduler says). Refused, naming the field, unless the
    /// VM runs and nothing else moves or stops it. (Whether its node is
    /// being drained, and whether `to` can take it, the caller checks
    /// against the node records.)
    pub fn request_migration(
        &mut self,
        to: Option<&str>,
        now: Millis,
    ) -> Result<(), ValidationError> {
        let refuse = |field: &str, why: String| Err(ValidationError::new(field, why));
        if self.deletion_requested_at.is_some() {
            return refuse(
                "deletion_requested_at",
                format!("VM {} is being deleted", self.name),
            );
        }
        if let Some(r) = &self.restore {
            return refuse(
                "restore",
                format!(
                    "VM {} is being restored from snapshot {}",
                    self.name, r.snapshot
                ),
            );
        }
        let node = match &self.status.instance {
            Some(inst) if self.status.phase == Phase::Running && self.wants_running() => {
                inst.node.clone()
            }
            _ => {
                return refuse(
                    "status.phase",
                    format!(
                        "VM {} is {:?}, not Running: only a running VM migrates",
                        self.name, self.status.phase
                    ),
                )
            }
        };
        if let Some(to) = to {
            crate::validate_name("to", to)?;
            if to == node {
                return refuse("to", format!("VM {} already runs on node {to}", self.name));
            }
        }
        if let Some(pending) = self.pending_migration() {
            return refuse(
                "migrate",
                format!(
                    "VM {} is already being migrated (requested at {})",
                    self.name, pending.requested_at
                ),
            );
        }
        self.migrate = Some(crate::MigrateRequest {
            requested_at: now,
            from_node: node,
            to: to.map(str::to_string),
        });
        // Not a spec change: the generation (which `--wait` of power
        // requests compares with the observed one) stays; the store's
        // revision guards the write.
        Ok(())
    }

    fn refuse_if_deleting(&self) -> Result<(), ValidationError> {
        match self.deletion_requested_at {
            Some(_) => Err(ValidationError::new(
                "deletion_requested_at",
                format!("VM {} is being deleted", self.name),
            )),
            None => Ok(()),
        }
    }

    /// Power and spec changes wait for a restore to finish: the restore
    /// decides the power state from the recorded intent.
    pub(crate) fn refuse_if_busy(&self) -> Result<(), ValidationError> {
        self.refuse_if_deleting()?;
        match &self.restore {
            Some(r) => Err(ValidationError::new(
                "restore",
                format!(
                    "VM {} is being restored from snapshot {}; try again when it is done",
                    self.name, r.snapshot
                ),
            )),
            None => Ok(()),
        }
    }
}

impl VmSpec {
    /// What an instance of this spec takes of a node's capacity.
    pub fn demand(&self) -> crate::Demand {
        crate::Demand {
            cpus: u64::from(self.cpus),
            memory_mib: self.memory_mib,
        }
    }
}

impl VmSpec {
    /// The disks' names, in the spec's order.
    pub fn disk_names(&self) -> Vec<&str> {
        self.disks.iter().map(|d| d.name.as_str()).collect()
    }

    /// This spec after a restore from a snapshot taken with `snapshot`: the
    /// snapshot brings back the hardware (cpus, memory, disks, boot), never
    /// the operating decisions (run policy, power, restart counter, stop
    /// grace period, node pin), which stay as they are now. Power is then
    /// set from the recorded intent ([`VirtualMachine::power_after_restore`]).
    pub fn restored_from(&self, snapshot: &VmSpec) -> VmSpec {
        // Destructured without `..`: a new field must be sorted into one
        // of the two groups here.
        let VmSpec {
            cpus,
            memory_mib,
            disks,
            boot,
            run_policy: _,
            power: _,
            restart_generation: _,
            stop_grace_period_s: _,
            node: _,
            readiness,
            // The NIC (its MAC) and the cloud-init identity are the VM's,
            // not its disks' content: a restore keeps today's, so the guest
            // does not come back as a new machine.
            network: _,
            cloud_init: _,
            // HA is an operating decision, like the node pin.
            ha: _,
            // Placement rules, like the node pin.
            placement: _,
            // The TPM's state is not in the snapshot (its disks are): the
            // VM keeps the TPM it has.
            tpm: _,
            cpu_model,
        } = snapshot.clone();
        // Readiness describes the guest on the disks (does it run an
        // agent?), so it comes back with them.
        VmSpec {
            cpus,
            memory_mib,
            disks,
            boot,
            readiness,
            cpu_model,
            ..self.clone()
        }
    }

    pub fn validate(&self) -> Result<(), ValidationError> {
        if self.cpus == 0 || self.cpus > MAX_CPUS {
            return Err(ValidationError::new(
                "spec.cpus",
                format!("{} is out of range 1..={MAX_CPUS}", self.cpus),
            ));
        }
        if !(MIN_MEMORY_MIB..=MAX_MEMORY_MIB).contains(&self.memory_mib) {
            return Err(ValidationError::new(
                "spec.memory_mib",
                format!(
                    "{} is out of range {MIN_MEMORY_MIB}..={MAX_MEMORY_MIB}",
                    self.memory_mib
                ),
            ));
        }
        if let Some(model) = &self.cpu_model {
            crate::hardware::validate_cpu_model(model)?;
        }
        if self.disks.len() > MAX_DISKS {
            return Err(ValidationError::new(
                "spec.disks",
                format!("{} disks; at most {MAX_DISKS}", self.disks.len()),
            ));
        }
        for (i, disk) in self.disks.iter().enumerate() {
            validate_name(&format!("spec.disks[{i}].name"), &disk.name)?;
            if disk.size_mib == 0 || disk.size_mib > MAX_DISK_SIZE_MIB {
                return Err(ValidationError::new(
                    format!("spec.disks[{i}].size_mib"),
                    format!("{} is out of range 1..={MAX_DISK_SIZE_MIB}", disk.size_mib),
                ));
            }
            if self.disks[..i].iter().any(|d| d.name == disk.name) {
                return Err(ValidationError::new(
                    format!("spec.disks[{i}].name"),
                    format!("{:?} is used by another disk", disk.name),
                ));
            }
        }
        for used in self.images() {
            validate_image_ref(&used)?;
        }
        crate::cdrom::validate(
            self.boot.cdrom.as_deref(),
            self.boot.first,
            self.boot.kernel.as_deref(),
        )?;
        if let Some(cmdline) = &self.boot.cmdline {
            if cmdline.len() > MAX_CMDLINE_BYTES || cmdline.contains(['\0', '\n']) {
                return Err(ValidationError::new(
                    "spec.boot.cmdline",
                    format!("must be at most {MAX_CMDLINE_BYTES} bytes on one line"),
                ));
            }
        }
        if !(1..=MAX_STOP_GRACE_PERIOD_S).contains(&self.stop_grace_period_s) {
            return Err(ValidationError::new(
                "spec.stop_grace_period_s",
                format!(
                    "{} is out of range 1..={MAX_STOP_GRACE_PERIOD_S}",
                    self.stop_grace_period_s
                ),
            ));
        }
        if let Some(node) = &self.node {
            validate_name("spec.node", node)?;
        }
        self.readiness.validate()?;
        self.placement.validate()?;
        self.network.validate()?;
        if let Some(cloud_init) = &self.cloud_init {
            cloud_init.validate()?;
        }
        Ok(())
    }

    /// Keeps what a replacement spec leaves out of the VM's identity: the
    /// MAC (`mac`, the VM's current one) and cloud-init's instance-id. Ones
    /// the new spec names explicitly win.
    pub fn inherit_identity(&mut self, old: &VmSpec, mac: MacAddr) {
        self.network.mac.get_or_insert_with(|| mac.to_string());
        if let (Some(new), Some(old)) = (&mut self.cloud_init, &old.cloud_init) {
            if new.instance_id.is_none() {
                new.instance_id.clone_from(&old.instance_id);
            }
        }
    }

    /// This spec as a new VM made from another's disks takes it (a clone,
    /// an import): unless `keep_identity`, a MAC and cloud-init
    /// instance-id of its own from `random` and no published host ports
    /// (the source may still hold them); in power state `power`, pinned to
    /// no node, with no restart asked for.
    pub fn for_new_vm(mut self, power: PowerState, random: [u8; 12], keep_identity: bool) -> Self {
        if !keep_identity {
            self.network.mac = None;
            self.network.publish.clear();
            if let Some(ci) = &mut self.cloud_init {
                ci.instance_id = None;
            }
        }
        self.assign_identity(random);
        self.power = power;
        self.node = None;
        self.restart_generation = 0;
        self
    }

    /// Fills in what a new VM's identity still lacks, from the caller's
    /// randomness (this crate does no I/O): the MAC and, with cloud-init,
    /// the instance-id. A MAC given is kept, in canonical form.
    pub fn assign_identity(&mut self, random: [u8; 12]) {
        let mac = match self.network.mac_addr() {
            Some(given) => given,
            None if self.network.mac.is_some() => return, // invalid: validate names it
            None => MacAddr::from_random([random[0], random[1], random[2], random[3]]),
        };
        self.network.mac = Some(mac.to_string());
        if let Some(ci) = &mut self.cloud_init {
            ci.instance_id.get_or_insert_with(|| {
                let hex: String = random[4..].iter().map(|b| format!("{b:02x}")).collect();
                format!("i-{hex}")
            });
        }
    }
}

/// Boot files and disk images are images of the store, by name: a host
/// path (QEMU runs as root, and would read any file into the guest) is
/// refused, saying how to import the file instead.
fn validate_image_ref(used: &ImageUse) -> Result<(), ValidationError> {
    if used.name.contains('/') {
        return Err(ValidationError::new(
            &used.field,
            format!(
                "{:?} is a host path; name an image of kind {} in the image store \
                 (keel image import NAME FILE --kind {})",
                used.name, used.kind, used.kind
            ),
        ));
    }
    validate_name(&used.field, &used.name)
}

impl VmSpec {
    /// Effective HA on disks at `home`: the user's word, or on exactly
    /// where another node could take the VM over.
    pub fn ha_on(&self, home: &DiskHome) -> bool {
        self.ha.unwrap_or(home.is_shared())
    }

    /// Whether an instance started now on disks at `home` is fenced: HA on
    /// *and* disks another node can see. HA on node-local disks fences
    /// nothing: no node could start the VM in its place, so a kill would
    /// only cost downtime.
    pub fn fenced_on(&self, home: &DiskHome) -> bool {
        self.ha_on(home) && home.is_shared()
    }

    /// Every image the spec names, in disk order, then kernel, initrd and
    /// CD-ROM.
    pub fn images(&self) -> Vec<ImageUse> {
        use crate::ImageKind;
        let disks = self.disks.iter().enumerate().filter_map(|(i, d)| {
            d.image.as_ref().map(|name| ImageUse {
                field: format!("spec.disks[{i}].image"),
                name: name.clone(),
                kind: ImageKind::Disk,
            })
        });
        let boot = [
            ("spec.boot.kernel", &self.boot.kernel, ImageKind::Kernel),
            ("spec.boot.initrd", &self.boot.initrd, ImageKind::Initrd),
            ("spec.boot.cdrom", &self.boot.cdrom, ImageKind::Iso),
        ]
        .into_iter()
        .filter_map(|(field, name, kind)| {
            name.as_ref().map(|name| ImageUse {
                field: field.into(),
                name: name.clone(),
                kind,
            })
        });
        disks.chain(boot).collect()
    }

    /// Whether the VM boots through firmware from its first disk rather
    /// than a kernel handed to QEMU.
    pub fn boots_from_disk(&self) -> bool {
        self.boot.kernel.is_none()
            && (self.boot.firmware.is_some()
                || self.disks.first().is_some_and(|d| d.image.is_some()))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub fn spec() -> VmSpec {
        VmSpec {
            cpus: 1,
            memory_mib: 256,
            disks: vec![DiskSpec {
                name: "data".into(),
                size_mib: 64,
                image: None,
            }],
            boot: BootSpec::default(),
            run_policy: RunPolicy::Manual,
            power: PowerState::Running,
            restart_generation: 0,
            stop_grace_period_s: 60,
            node: None,
            readiness: Readiness::Agent,
            network: NetworkSpec::default(),
            cloud_init: None,
            ha: None,
            cpu_model: None,
            placement: Default::default(),
            tpm: None,
        }
    }

    #[test]
    fn the_recorded_firmware_is_the_only_one_a_start_may_name() {
        assert_eq!(
            "uefi-secure".parse::<Firmware>().unwrap(),
            Firmware::UefiSecure
        );
        assert_eq!(
            serde_json::to_string(&Firmware::UefiSecure).unwrap(),
            r#""uefi-secure""#
        );
        assert!("secure"
            .parse::<Firmware>()
            .unwrap_err()
            .message
            .contains("uefi-secure"));
        assert!(Firmware::UefiSecure.is_uefi() && !Firmware::Bios.is_uefi());
        // Nothing recorded yet: any.
        assert_eq!(Firmware::change_refused(None, Some(Firmware::Uefi)), None);
        let secure = Some(Firmware::UefiSecure);
        assert_eq!(Firmware::change_refused(secure, secure), None);
        let why = Firmware::change_refused(secure, Some(Firmware::Uefi)).unwrap();
        assert!(
            why.contains("spec.boot.firmware is uefi")
                && why.contains("first started with uefi-secure"),
            "{why}"
        );
        // Unnamed is SeaBIOS, as recorded for a VM that named none.
        assert_eq!(Firmware::change_refused(Some(Firmware::Bios), None), None);
        assert!(Firmware::change_refused(Some(Firmware::Bios), secure).is_some());
    }

    #[test]
    fn records_without_readiness_mean_ready_when_running() {
        let json = r#"{"name":"a","spec":{"cpus":1,"memory_mib":64},
            "status":{"phase":"Running","instance":{"id":"a-1","node":"n1","created_at":5,"running_since":6}}}"#;
        let vm: VirtualMachine = serde_json::from_str(json).unwrap();
        assert_eq!(vm.spec.readiness, Readiness::None);
        assert_eq!(vm.ready_since(), Some(6));
        let mut agent = vm.clone();
        agent.spec.readiness = Readiness::Agent;
        assert_eq!(agent.ready_since(), None);
        agent.status.instance.as_mut().unwrap().readiness = Some(InstanceReadiness {
            ready_at: Some(9),
            ..Default::default()
        });
        assert_eq!(agent.ready_since(), Some(9));
        agent.status.phase = Phase::Stopping;
        assert_eq!(agent.ready_since(), None, "a stopping guest is not ready");
    }

    #[test]
    fn validation_names_the_field() {
        let mut s = spec();
        s.memory_mib = 0;
        assert_eq!(s.validate().unwrap_err().field, "spec.memory_mib");
        let mut s = spec();
        s.disks[0].name = "../x".into();
        assert_eq!(s.validate().unwrap_err().field, "spec.disks[0].name");
        let mut s = spec();
        s.boot.kernel = Some("/a,b".into());
        assert_eq!(s.validate().unwrap_err().field, "spec.boot.kernel");
        // Boot files are images of the store, never host paths.
        let mut s = spec();
        s.boot.initrd = Some("/etc/shadow".into());
        let err = s.validate().unwrap_err();
        assert_eq!(err.field, "spec.boot.initrd");
        assert!(err.message.contains("host path"), "{}", err.message);
        let mut s = spec();
        s.boot.kernel = Some("vmlinuz".into());
        s.boot.initrd = Some("initrd".into());
        s.validate().unwrap();
        let mut s = spec();
        s.disks[0].image = Some("Debian".into());
        assert_eq!(s.validate().unwrap_err().field, "spec.disks[0].image");
    }

    #[test]
    fn a_disk_keeps_the_image_it_was_made_from() {
        let mut with_image = spec();
        with_image.disks[0].image = Some("debian".into());
        let mut vm = VirtualMachine::new("a", with_image.clone());
        let mut other = with_image.clone();
        other.disks[0].image = Some("ubuntu".into());
        assert_eq!(
            vm.replace_spec(other).unwrap_err().field,
            "spec.disks[0].image"
        );
        assert_eq!(
            vm.replace_spec(spec()).unwrap_err().field,
            "spec.disks[0].image"
        );
        let mut more = with_image.clone();
        more.cpus = 2;
        vm.replace_spec(more).unwrap();
        assert!(vm.spec.boots_from_disk());
        assert_eq!(vm.spec.images()[0].field, "spec.disks[0].image");
    }

    #[test]
    fn old_records_with_host_paths_still_decode() {
        // Written when boot files were host paths: readable, refused only
        // when validated (and failed by the node at start).
        let json = r#"{"name":"a","spec":{"cpus":1,"memory_mib":64,
            "boot":{"kernel":"/boot/vmlinuz","initrd":"/etc/shadow"}}}"#;
        let vm: VirtualMachine = serde_json::from_str(json).unwrap();
        assert_eq!(vm.spec.boot.initrd.as_deref(), Some("/etc/shadow"));
        assert_eq!(vm.validate().unwrap_err().field, "spec.boot.kernel");
    }

    #[test]
    fn stored_records_tolerate_unknown_fields() {
        // As a newer Keel might write them: new fields at every level.
        let json = r#"{"name":"a","generation":2,"schema_version":9,"new_top":1,
            "spec":{"cpus":1,"memory_mib":64,"new_spec":true,
                "disks":[{"name":"d","size_mib":8,"new_disk":1}],
                "boot":{"kernel":"/k","new_boot":1}},
            "status":{"phase":"Running","new_status":[1],
                "instance":{"id":"a-1","node":"n1","created_at":5,"new_inst":{}}}}"#;
        let vm: VirtualMachine = serde_json::from_str(json).unwrap();
        assert_eq!(vm.spec.disks[0].size_mib, 8);
        assert_eq!(vm.spec.boot.kernel.as_deref(), Some("/k"));
        assert_eq!(vm.status.phase, Phase::Running);
        assert_eq!(vm.owner_node(), Some("n1"));
    }

    #[test]
    fn records_from_before_nics_get_a_mac_from_their_name() {
        let json = r#"{"name":"old","spec":{"cpus":1,"memory_mib":64}}"#;
        let vm: VirtualMachine = serde_json::from_str(json).unwrap();
        assert_eq!(vm.spec.network, NetworkSpec::default());
        assert_eq!(vm.mac(), MacAddr::derived("old"));
        // A spec replaced without a MAC keeps the one the VM had.
        let mut vm2 = vm.clone();
        vm2.replace_spec(spec()).unwrap();
        assert_eq!(vm2.mac(), MacAddr::derived("old"));
        assert_eq!(
            vm2.spec.network.mac,
            Some(MacAddr::derived("old").to_string())
        );
    }

    #[test]
    fn identity_is_assigned_once_and_kept() {
        let mut s = spec();
        s.cloud_init = Some(CloudInitSpec {
            user_data: Some("#cloud-config\n".into()),
            ..Default::default()
        });
        s.assign_identity([7; 12]);
        let mac = s.network.mac.clone().unwrap();
        assert_eq!(mac, "52:54:07:07:07:07");
        assert_eq!(
            s.cloud_init.as_ref().unwrap().instance_id.as_deref(),
            Some("i-0707070707070707")
        );
        let mut vm = VirtualMachine::new("a", s);
        let mut replacement = spec();
        replacement.cloud_init = Some(CloudInitSpec {
            ssh_authorized_keys: vec![],
            user_data: Some("#cloud-config\n".into()),
            instance_id: None,
        });
        vm.replace_spec(replacement).unwrap();
        assert_eq!(vm.spec.network.mac.as_deref(), Some(mac.as_str()));
        assert_eq!(
            vm.spec.cloud_init.as_ref().unwrap().instance_id.as_deref(),
            Some("i-0707070707070707")
        );
        // A MAC the user gives is kept (canonical), not replaced.
        let mut s = spec();
        s.network.mac = Some("52:54:00:AA:BB:CC".into());
        s.assign_identity([9; 12]);
        assert_eq!(s.network.mac.as_deref(), Some("52:54:00:aa:bb:cc"));
    }

    /// A restore's `Running` intent waits for the new instance to settle;
    /// a stop the user asks for meanwhile overrules it (a restore asked for
    /// next must record Stopped), a start or restart agrees with it.
    #[test]
    fn a_power_request_after_a_restore_overrules_its_intent() {
        let intent = || PowerIntent {
            power: PowerState::Running,
            reason: "restore from snapshot s1".into(),
            recorded_at: 1,
        };
        let mut vm = VirtualMachine::new("a", spec());
        vm.spec.run_policy = RunPolicy::Manual;
        vm.power_intent = Some(intent());
        vm.request_start().unwrap();
        vm.request_restart().unwrap();
        assert_eq!(vm.power_intent, Some(intent()));
        vm.request_stop().unwrap();
        assert_eq!(vm.power_intent, None);
        vm.request_restore("s2", 2).unwrap();
        assert_eq!(vm.power_after_restore(), PowerState::Stopped);

        let mut vm = VirtualMachine::new("a", spec());
        vm.spec.run_policy = RunPolicy::Manual;
        vm.power_intent = Some(intent());
        let mut stopped = vm.spec.clone();
        stopped.power = PowerState::Stopped;
        vm.replace_spec(stopped).unwrap();
        assert_eq!(
            vm.power_intent, None,
            "a spec saying Stopped overrules it too"
        );
    }

    #[test]
    fn spec_overwrite_keeps_power_intent_and_restart_counter() {
        let mut vm = VirtualMachine::new("a", spec());
        vm.spec.network.mac = Some(vm.mac().to_string());
        vm.request_restart().unwrap();
        vm.power_intent = Some(PowerIntent {
            power: PowerState::Running,
            reason: "restore".into(),
            recorded_at: 1,
        });
        let gen = vm.generation;
        vm.replace_spec(spec()).unwrap();
        assert!(vm.power_intent.is_some());
        assert_eq!(vm.spec.restart_generation, 1);
        assert_eq!(vm.generation, gen);
    }

    #[test]
    fn restore_takes_hardware_from_the_snapshot_and_keeps_the_decisions() {
        let now = spec();
        let mut snap = spec();
        snap.cpus = 4;
        snap.memory_mib = 512;
        snap.disks.clear();
        snap.boot.cmdline = Some("quiet".into());
        snap.run_policy = RunPolicy::AlwaysOn;
        snap.power = PowerState::Stopped;
        snap.restart_generation = 9;
        snap.stop_grace_period_s = 5;
        snap.node = Some("elsewhere".into());
        snap.network.mac = Some("52:54:00:00:00:09".into());
        let restored = now.restored_from(&snap);
        assert_eq!(
            (
                restored.cpus,
                restored.memory_mib,
                &restored.disks,
                &restored.boot
            ),
            (4, 512, &snap.disks, &snap.boot)
        );
        assert_eq!(restored.network, now.network, "the NIC stays the VM's");
        assert_eq!(
            (
                restored.run_policy,
                restored.power,
                restored.restart_generation,
                restored.stop_grace_period_s,
                &restored.node
            ),
            (
                now.run_policy,
                now.power,
                now.restart_generation,
                now.stop_grace_period_s,
                &now.node
            )
        );
    }

    #[test]
    fn policies_refuse_contradicting_requests() {
        let mut vm = VirtualMachine::new("a", spec());
        vm.spec.run_policy = RunPolicy::AlwaysOn;
        assert_eq!(vm.request_stop().unwrap_err().field, "spec.run_policy");
        vm.spec.run_policy = RunPolicy::AlwaysOff;
        assert!(vm.request_start().is_err());
        assert!(!vm.wants_running());
        vm.spec.run_policy = RunPolicy::Once;
        assert_eq!(vm.request_start().unwrap_err().field, "spec.run_policy");
        assert_eq!(vm.request_restart().unwrap_err().field, "spec.run_policy");
        vm.request_stop().unwrap();
        assert!(!vm.wants_running());
        vm.spec.run_policy = RunPolicy::RerunOnFailure;
        vm.request_start().unwrap();
        assert!(vm.wants_running());
        vm.request_stop().unwrap();
        assert!(!vm.wants_running());
    }

    #[test]
    fn every_policy_parses_by_its_name_in_any_case() {
        for p in RunPolicy::ALL {
            assert_eq!(
                format!("{p:?}")
                    .to_lowercase()
                    .parse::<RunPolicy>()
                    .unwrap(),
                p
            );
            assert_eq!(serde_json::to_value(p).unwrap(), format!("{p:?}"));
        }
        let err = "Sometimes".parse::<RunPolicy>().unwrap_err();
        assert!(
            err.message.contains("RerunOnFailure, Once"),
            "{}",
            err.message
        );
    }

    /// The run-policy table of the README, for exits nobody asked for.
    #[test]
    fn which_exits_end_a_run() {
        use ExitKind::*;
        let table = [
            (RunPolicy::AlwaysOn, [false, false, false, false]),
            (
                RunPolicy::AlwaysOnUnlessStoppedManually,
                [false, false, false, false],
            ),
            (RunPolicy::Manual, [true, true, true, true]),
            (RunPolicy::Once, [true, true, true, true]),
            (RunPolicy::RerunOnFailure, [true, false, false, false]),
        ];
        for (policy, ends) in table {
            for (kind, end) in [GuestPoweroff, Crashed, Killed, Vanished]
                .into_iter()
                .zip(ends)
            {
                assert_eq!(
                    policy.run_ends_after(kind),
                    end,
                    "{policy:?} after {kind:?}"
                );
            }
        }
    }

    #[test]
    fn plugged_disks_follow_the_started_ones_and_take_free_ports() {
        let mut inst = Instance::new("web-1", "a", 0);
        assert_eq!(inst.disk_names(), None);
        inst.started_with = Some(crate::StartedWith {
            generation: 1,
            cpus: 1,
            memory_mib: 64,
            disks: vec!["root".into()],
            boot: String::new(),
            network: String::new(),
            cloud_init: String::new(),
            cpu_model: None,
            tpm: false,
        });
        assert_eq!(inst.free_port(), None, "no ports: nothing to plug into");
        inst.hotplug_ports = 2;
        assert_eq!(inst.free_port(), Some(0));
        inst.plugged.push(crate::PluggedDisk {
            disk: "data".into(),
            port: 0,
            attached_at: None,
            detach_requested_at: None,
        });
        assert_eq!(inst.plug_under_way().map(|p| p.disk.as_str()), Some("data"));
        assert_eq!(
            inst.disk_change_under_way().as_deref(),
            Some("the plug of disk data")
        );
        assert_eq!(
            inst.attached_disk_names().unwrap(),
            ["root"],
            "not yet confirmed"
        );
        assert_eq!(inst.free_port(), Some(1));
        inst.plugged[0].attached_at = Some(5);
        inst.plugged.push(crate::PluggedDisk {
            disk: "logs".into(),
            port: 1,
            attached_at: Some(6),
            detach_requested_at: None,
        });
        assert_eq!(inst.free_port(), None);
        assert_eq!(inst.plug_under_way(), None);
        assert_eq!(inst.disk_change_under_way(), None);
        assert_eq!(inst.disk_names().unwrap(), ["root", "data", "logs"]);
        // Unplugging keeps the disk and its port until the guest let go.
        inst.plugged[0].detach_requested_at = Some(7);
        assert_eq!(
            inst.disk_change_under_way().as_deref(),
            Some("the unplug of disk data")
        );
        assert_eq!(inst.free_port(), None);
        assert_eq!(inst.disk_names().unwrap(), ["root", "data", "logs"]);
    }
}
