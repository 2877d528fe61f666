use serde::{Deserialize, Serialize};

use crate::{Millis, Phase};

/// A recorded state change of a VM, kept in the store under
/// `/events/<vm>/<revision written from, zero-padded>-<n>` (the `n`th
/// event of that write) so they list in order; an event about an
/// undecodable record under `/events/<vm>/<its revision>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Event {
    pub at: Millis,
    pub vm: String,
    pub from: Phase,
    pub to: Phase,
    pub reason: String,
    /// The stored record this event is about when it is not the VM's
    /// phase change: a record that cannot be decoded, say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
}
