//! A live migration attempt. Created exactly once per attempt (the id is
//! reserved on the VM record first, the record is then created only if
//! absent), and never reused: a new attempt gets a new id.

use serde::{Deserialize, Serialize};

use crate::Millis;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Migration {
    pub id: String,
    pub vm: String,
    pub source_node: String,
    pub source_instance: String,
    pub target_node: String,
    pub target_instance: String,
    pub created_at: Millis,
    #[serde(default)]
    pub status: MigrationStatus,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum MigrationPhase {
    /// Waiting for the target node to start an incoming instance.
    #[default]
    Pending,
    /// The target listens at `target_uri`.
    TargetReady,
    /// The source is sending its state.
    Running,
    Succeeded,
    Failed,
}

impl MigrationPhase {
    pub fn is_final(self) -> bool {
        matches!(self, MigrationPhase::Succeeded | MigrationPhase::Failed)
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MigrationStatus {
    #[serde(default)]
    pub phase: MigrationPhase,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_uri: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Millis>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Millis>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub downtime_ms: Option<Millis>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// When the source node's agent saw the source instance gone before
    /// any outcome: not an outcome itself. The target settles it by its
    /// own state (paused with the whole state: Succeeded; exited: Failed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_gone_at: Option<Millis>,
}
