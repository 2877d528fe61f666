use serde::{Deserialize, Serialize};

use crate::{Millis, Phase};

/// A recorded state change of a VM, kept in the store under
/// `/events/<vm>/<revision, zero-padded>` so they list in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Event {
    pub at: Millis,
    pub vm: String,
    pub from: Phase,
    pub to: Phase,
    pub reason: String,
}
