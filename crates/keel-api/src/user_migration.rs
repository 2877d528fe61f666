//! A live migration the user asked for (`keel vm migrate`): the request is
//! kept on the VM record, so it survives restarts, and carried out by the
//! VM's agent through the same eviction path and `Migration` records a
//! drain uses. Unlike a drain nothing forces the VM off: a failed attempt
//! leaves it running on its node, with the reason in the outcome.
//! (`VirtualMachine::request_migration` and `pending_migration` record
//! and read them.)

use serde::{Deserialize, Serialize};

use crate::Millis;

/// What the user asked for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct MigrateRequest {
    pub requested_at: Millis,
    /// The node the VM ran on when asked: once it runs elsewhere (a drain
    /// moved it meanwhile, say) the request is moot.
    pub from_node: String,
    /// The target the user named; `None`: the scheduler's best candidate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
}

/// How the request with `requested_at` ended (on the VM's status). Its
/// presence marks that request as handled, so it is never repeated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct MigrateOutcome {
    pub requested_at: Millis,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration: Option<String>,
    pub succeeded: bool,
    pub message: String,
}
