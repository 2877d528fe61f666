//! A reboot of the running instance's guest: a reset inside the same
//! instance (same id, same process), never a new one. `keel vm restart`
//! is the other thing: a new instance after the old one is observed gone.
//!
//! The user's request is durable as a counter on the record
//! (`VirtualMachine::reboot_generation`, like `spec.restart_generation`):
//! the controller takes each bump once, recording the progress on the
//! instance before it asks anything of the guest, so a controller restart
//! in between neither loses the request nor carries it out twice.

use serde::{Deserialize, Serialize};

use crate::Millis;

/// A reboot the controller has asked of the guest and not yet seen done.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RebootProgress {
    /// The `reboot_generation` this reboot carries out.
    pub generation: u64,
    pub requested_at: Millis,
    /// The instance's reset count when it was asked: one more is the reboot.
    pub resets_before: u32,
    /// When the guest is reset by the hypervisor (`system_reset`) if it has
    /// not rebooted by itself (asked through its agent) by then.
    pub fallback_at: Millis,
    /// When the hypervisor was told to reset the guest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reset_sent_at: Option<Millis>,
}

/// How long after a `system_reset` the controller waits to see the reset
/// before it gives the reboot up as done (a driver that lost the event,
/// say): a reboot request never holds the VM for longer.
pub const RESET_SEEN_WITHIN_MS: Millis = 10_000;
