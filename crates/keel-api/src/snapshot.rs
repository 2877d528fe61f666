//! Snapshots of a VM's disks, stored with the spec the VM had when taken.

use serde::{Deserialize, Serialize};

use crate::{validate_name, Millis, ValidationError, VmSpec};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Snapshot {
    pub vm: String,
    pub name: String,
    /// The VM's spec when the snapshot was requested; a restore puts it back.
    pub spec: VmSpec,
    pub requested_at: Millis,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deletion_requested_at: Option<Millis>,
    #[serde(default)]
    pub status: SnapshotStatus,
}

#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema,
)]
pub enum SnapshotPhase {
    #[default]
    Pending,
    Ready,
    Failed,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SnapshotStatus {
    #[serde(default)]
    pub phase: SnapshotPhase,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub taken_at: Option<Millis>,
    /// Whether the guest was running (paused while the snapshot was taken).
    #[serde(default)]
    pub live: bool,
    /// Whether the guest's filesystems were frozen by its agent while the
    /// snapshot was taken (a live snapshot without it is crash-consistent).
    #[serde(default)]
    pub quiesced: bool,
    /// Why a live snapshot was not quiesced, or a thaw that failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quiesce_note: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

impl Snapshot {
    pub fn validate(&self) -> Result<(), ValidationError> {
        validate_name("vm", &self.vm)?;
        validate_name("name", &self.name)?;
        self.spec.validate()
    }
}
