//! What a driver tells the controllers about a domain as it happens: its
//! process exited, or QEMU announced something on its monitor (the guest
//! shut down, paused, resumed, reset, panicked; a disk failed; a
//! migration's status moved on; a device went away).
//!
//! Every event is a hint to look at the domain now rather than at its next
//! scheduled look. The truth stays what `Hypervisor::info` reports, and a
//! missed or lagged event costs latency (the slow resync finds what it
//! announced), never correctness: nothing in fencing or the one-instance
//! rule waits for one.

/// One event about instance `instance` of VM `vm`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DomainEvent {
    pub vm: String,
    pub instance: String,
    pub kind: DomainEventKind,
}

/// What happened. QMP's names in brackets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DomainEventKind {
    /// The domain's process is gone (seen by waiting on it, not by QMP).
    Exited,
    /// QEMU is shutting down (`SHUTDOWN`); `guest`: the guest asked.
    Shutdown { guest: bool },
    /// The guest's CPUs stopped (`STOP`): paused, or a migration's
    /// switch-over.
    Stopped,
    /// The guest's CPUs run again (`RESUME`).
    Resumed,
    /// The guest was reset (`RESET`) and the driver counted it as a
    /// reboot: the instance goes on.
    Reset,
    /// The guest's kernel reported a panic (`GUEST_PANICKED`).
    GuestPanicked,
    /// A disk's I/O failed (`BLOCK_IO_ERROR`); `device` as QEMU names it.
    BlockIoError { device: String },
    /// A migration's status changed (`MIGRATION`), to `status`.
    Migration { status: String },
    /// A device was removed from the guest (`DEVICE_DELETED`).
    DeviceDeleted { device: String },
    /// The console showed a text that was watched for
    /// (`Hypervisor::watch_console`; not a QMP event).
    ConsoleShowed,
}

impl DomainEvent {
    pub fn new(vm: &str, instance: &str, kind: DomainEventKind) -> Self {
        Self {
            vm: vm.to_string(),
            instance: instance.to_string(),
            kind,
        }
    }
}
