//! A live migration the user asked for (`keel vm migrate`): the request is
//! kept on the VM record, so it survives restarts, and carried out by the
//! VM's agent through the same eviction path and `Migration` records a
//! drain uses. Unlike a drain nothing forces the VM off: a failed attempt
//! leaves it running on its node, with the reason in the outcome.

use serde::{Deserialize, Serialize};

use crate::{Millis, Phase, ValidationError, VirtualMachine};

/// What the user asked for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrateOutcome {
    pub requested_at: Millis,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration: Option<String>,
    pub succeeded: bool,
    pub message: String,
}

impl VirtualMachine {
    /// The user's migration request still to be carried out, if any.
    pub fn pending_migration(&self) -> Option<&MigrateRequest> {
        let req = self.migrate.as_ref()?;
        let handled = self
            .status
            .migrate_outcome
            .as_ref()
            .is_some_and(|o| o.requested_at == req.requested_at);
        let here = self.status.instance.as_ref().map(|i| i.node.as_str());
        (!handled && here == Some(req.from_node.as_str())).then_some(req)
    }

    /// Records a request to move the running instance (to node `to`, or
    /// wherever the scheduler says). Refused, naming the field, unless the
    /// VM runs and nothing else moves or stops it. (Whether its node is
    /// being drained, and whether `to` can take it, the caller checks
    /// against the node records.)
    pub fn request_migration(
        &mut self,
        to: Option<&str>,
        now: Millis,
    ) -> Result<(), ValidationError> {
        let refuse = |field: &str, why: String| Err(ValidationError::new(field, why));
        if self.deletion_requested_at.is_some() {
            return refuse(
                "deletion_requested_at",
                format!("VM {} is being deleted", self.name),
            );
        }
        if let Some(r) = &self.restore {
            return refuse(
                "restore",
                format!(
                    "VM {} is being restored from snapshot {}",
                    self.name, r.snapshot
                ),
            );
        }
        let node = match &self.status.instance {
            Some(inst) if self.status.phase == Phase::Running && self.wants_running() => {
                inst.node.clone()
            }
            _ => {
                return refuse(
                    "status.phase",
                    format!(
                        "VM {} is {:?}, not Running: only a running VM migrates",
                        self.name, self.status.phase
                    ),
                )
            }
        };
        if let Some(to) = to {
            crate::validate_name("to", to)?;
            if to == node {
                return refuse("to", format!("VM {} already runs on node {to}", self.name));
            }
        }
        if let Some(pending) = self.pending_migration() {
            return refuse(
                "migrate",
                format!(
                    "VM {} is already being migrated (requested at {})",
                    self.name, pending.requested_at
                ),
            );
        }
        self.migrate = Some(MigrateRequest {
            requested_at: now,
            from_node: node,
            to: to.map(str::to_string),
        });
        self.generation += 1;
        Ok(())
    }
}
