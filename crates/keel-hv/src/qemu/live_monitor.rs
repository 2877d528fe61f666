//! The monitor of a live instance, for the calls that change a running
//! guest's devices (online resize, hot-plug): the instance must be live
//! (not launching, not exited), and QMP's answers are sorted into what
//! QEMU refused (`Failed`, with its reason) and what could not be asked
//! (`Unavailable`: the call may be retried).

use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde_json::Value;

use super::monitor::Phase;
use super::qmp::{QmpClient, QmpError};
use super::{unavailable, QemuDriver};
use crate::HvError;

pub(super) struct LiveMonitor {
    client: Arc<QmpClient>,
    instance: String,
    op: &'static str,
}

impl LiveMonitor {
    pub fn failed(&self, reason: String) -> HvError {
        HvError::Failed {
            instance: self.instance.clone(),
            op: self.op,
            reason,
            source: None,
        }
    }

    fn qmp_error(&self, e: QmpError) -> HvError {
        match e {
            QmpError::Command { .. } => HvError::failed_by(&self.instance, self.op, "", e),
            other => HvError::unavailable_by(&self.instance, self.op, "", other),
        }
    }

    pub async fn execute(&self, command: &str, arguments: Option<Value>) -> Result<Value, HvError> {
        self.client
            .execute(command, arguments)
            .await
            .map_err(|e| self.qmp_error(e))
    }

    /// `command`'s answer, or QEMU's reason when it refused it (for the
    /// callers to which some refusals are an answer, not a failure); what
    /// could not be asked is the error.
    pub async fn try_execute(
        &self,
        command: &str,
        arguments: Option<Value>,
    ) -> Result<Result<Value, String>, HvError> {
        match self.client.execute(command, arguments).await {
            Ok(value) => Ok(Ok(value)),
            Err(QmpError::Command { desc, .. }) => Ok(Err(desc)),
            Err(other) => Err(self.qmp_error(other)),
        }
    }

    /// A query's answer, decoded.
    pub async fn query<T: DeserializeOwned>(&self, command: &str) -> Result<T, HvError> {
        self.query_with(command, None).await
    }

    /// A query's answer to `arguments`, decoded.
    pub async fn query_with<T: DeserializeOwned>(
        &self,
        command: &str,
        arguments: Option<Value>,
    ) -> Result<T, HvError> {
        let value = self.execute(command, arguments).await?;
        serde_json::from_value(value).map_err(|e| {
            HvError::failed_by(&self.instance, self.op, format!("{command} result"), e)
        })
    }
}

impl QemuDriver {
    pub(super) async fn live_monitor(
        &self,
        instance: &str,
        op: &'static str,
    ) -> Result<LiveMonitor, HvError> {
        let domain = self.existing(instance, op)?;
        match domain.phase() {
            Phase::Live { .. } => {}
            Phase::Launching { .. } => {
                return Err(unavailable(instance, op, "QEMU is still launching".into()))
            }
            Phase::Exited(_) => {
                return Err(HvError::Failed {
                    instance: instance.to_string(),
                    op,
                    reason: "the instance has exited".into(),
                    source: None,
                })
            }
        }
        let client = domain
            .qmp()
            .await
            .map_err(|e| unavailable(instance, op, e))?;
        Ok(LiveMonitor {
            client,
            instance: instance.to_string(),
            op,
        })
    }
}
