//! Where a cloned VM's disks come from (`keel vm clone`): the disks of
//! another VM as a snapshot of them holds them. Recorded on the clone when
//! it is created and read by its first start, which makes each of these
//! disks as a copy (never blank): a disk the copy cannot be made from
//! (the source VM, its disk or the snapshot gone) fails the start, naming
//! it.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CloneSource {
    /// The VM cloned, and its uid (a VM deleted and created again under
    /// the name is another VM).
    pub vm: String,
    pub vm_uid: String,
    /// The snapshot of `vm`'s disks the copies are made from: one
    /// consistent moment of all of them, also of a running guest.
    pub snapshot: String,
    /// The disks copied, by name (the snapshot's). A disk the clone gains
    /// later is made blank, as for any VM.
    pub disks: Vec<String>,
    /// Linked (`keel vm clone --linked`): each disk is an overlay on a
    /// frozen copy of the source's at the snapshot, shared by every linked
    /// clone of that snapshot and never written, instead of a full copy.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub linked: bool,
}
