//! The mark a drain leaves on a VM it moved off a node
//! (`VmStatus::drained_from`); `drain_return` asks such VMs back.

use serde::{Deserialize, Serialize};

use crate::Millis;

/// The node a drain moved a VM away from, and which drain.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DrainedFrom {
    pub node: String,
    /// The drain's `requested_at`.
    pub drain_requested_at: Millis,
}
