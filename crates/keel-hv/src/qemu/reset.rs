//! Reboots inside an instance: QEMU runs with `-action reboot=reset`, so a
//! guest's own reboot, an agent's `guest-shutdown` in mode `reboot` and a
//! QMP `system_reset` all reset the guest inside the same process. Each
//! shows as a QMP `RESET` event, counted by the instance's monitor
//! (`reset_count`) and reported as `DomainInfo::resets`.

use super::monitor::Phase;
use super::QemuDriver;
use crate::HvError;

impl QemuDriver {
    /// QMP `system_reset`: the reset button. The monitor counts the reset
    /// from its event, like any other.
    pub(super) async fn system_reset(&self, instance: &str) -> Result<(), HvError> {
        let op = "reset";
        let domain = self.existing(instance, op)?;
        let pid = match domain.phase() {
            Phase::Live { pid } => pid,
            Phase::Launching { .. } => {
                return Err(super::unavailable(
                    instance,
                    op,
                    "QEMU is still launching".into(),
                ))
            }
            Phase::Exited(_) => {
                return Err(HvError::Failed {
                    instance: instance.to_string(),
                    op,
                    reason: "the instance has exited".into(),
                    source: None,
                })
            }
        };
        let failure = match domain.qmp().await {
            Ok(client) => match client.execute("system_reset", None).await {
                Ok(_) => return Ok(()),
                Err(e) => e.to_string(),
            },
            Err(e) => e,
        };
        domain
            .state_without_qmp(pid, op, failure.clone())
            .await
            .and_then(|_| {
                Err(HvError::Failed {
                    instance: instance.to_string(),
                    op,
                    reason: format!("the instance exited before it was reset: {failure}"),
                    source: None,
                })
            })
    }

    pub(super) async fn agent_reboot(&self, instance: &str) -> Result<(), HvError> {
        self.with_agent(instance, "reboot through the guest agent", |s| {
            Box::pin(async move { s.reboot().await })
        })
        .await
    }
}
