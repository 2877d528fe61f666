//! What a decision returns: the next step of a VM and the hypervisor call
//! it asks for. Executors apply steps; decisions only build them.

use keel_api::{Migration, Millis, VirtualMachine};

/// A hypervisor call the executor makes.
#[derive(Debug, Clone, PartialEq)]
pub enum HvAction {
    Start,
    Shutdown(String),
    /// Ask the guest agent to power off (for guests that ignore ACPI).
    GuestShutdown(String),
    /// Ask the guest agent to reboot the guest (a reset of the instance);
    /// if the agent cannot be asked, reset it through the hypervisor.
    GuestReboot(String),
    /// Reset the guest through the hypervisor (`system_reset`).
    Reset(String),
    /// Plug a disk of the spec into the running instance, on a root port
    /// (made first if it is missing and its record allows it).
    AttachDisk {
        instance: String,
        disk: String,
        port: u32,
        /// Whether the disk may be made if missing: its record, as read
        /// before this step, allows it (`disk_record::makeable`).
        create: bool,
    },
    /// Unplug a plugged disk from the running instance: ask the guest to
    /// let go of it (again), close it once the device is gone. As the
    /// action of an `ActThenPersist`, its record is stored only once the
    /// disk is gone.
    DetachDisk {
        instance: String,
        disk: String,
    },
    /// Grow a disk under the running instance (online resize).
    GrowDisk {
        instance: String,
        disk: String,
        size_mib: u64,
    },
    Kill(String),
    Cleanup(String),
    DeleteDisks,
    /// Put the disks (of the VM record being written) back to this snapshot.
    RestoreDisks(String),
    /// Create this migration record if it does not exist yet (store only).
    CreateMigration(Box<Migration>),
}

#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Nothing to change; look again at `requeue_at`.
    Wait { requeue_at: Millis },
    /// Store `vm` (compare-and-swap on the revision read), then call `then`.
    Persist {
        vm: Box<VirtualMachine>,
        then: Option<HvAction>,
        requeue_at: Millis,
    },
    /// Call `action` first; store `vm` only if it succeeded (or said NotFound).
    ActThenPersist {
        action: HvAction,
        vm: Box<VirtualMachine>,
        requeue_at: Millis,
    },
    /// Delete the VM's disks, then the record: the VM is gone for good.
    DeleteRecord,
}

impl Step {
    /// A `Persist` of a record equal to `old` with nothing to do after is
    /// a wait.
    pub fn unless_unchanged(self, old: &VirtualMachine) -> Step {
        match self {
            Step::Persist {
                vm,
                then: None,
                requeue_at,
            } if *vm == *old => Step::Wait { requeue_at },
            other => other,
        }
    }
}

pub(crate) fn persist_if_changed(
    old: &VirtualMachine,
    new: VirtualMachine,
    then: Option<HvAction>,
    requeue_at: Millis,
) -> Step {
    if *old == new && then.is_none() {
        Step::Wait { requeue_at }
    } else {
        Step::Persist {
            vm: Box::new(new),
            then,
            requeue_at,
        }
    }
}

/// `initial * 2^attempt`, capped.
pub fn backoff(initial: Millis, max: Millis, attempt: u32) -> Millis {
    initial.saturating_mul(1u64 << attempt.min(30)).min(max)
}
