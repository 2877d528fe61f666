//! What a start is told about the VM's TPM (`spec.tpm`): its version and
//! whether this start may make its state. The controller decides the
//! latter from the VM's record (`VmStatus::tpm_used_since`), as it decides
//! which disks may be made: once an instance has run with the TPM, its
//! state must exist, and a start that does not find it fails naming it,
//! never with a blank TPM in its place (a disk key sealed to the old one
//! would be lost, and the guest would not say why).

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TpmUse {
    pub version: keel_api::TpmVersion,
    /// No instance has run with it yet: a missing state may be made.
    pub may_create: bool,
}
