//! A node's controllers running as a tokio task of their own, and the two
//! ways they end: a plain stop, or a planned restart that freezes the node.
//! Either way the heartbeat, and with it the fence lease, goes on until the
//! last reconcile under way has finished ([`super::run_controllers`]): one
//! may take longer than the lease (a first start hashing a large image, a
//! disk delete, an offline snapshot), and the guests must not be fenced
//! while their agent is still there.

use std::sync::Arc;
use std::time::Duration;

use keel_api::{Clock, Millis, Mono};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::{run_vm_controller_with, RuntimeConfig};
use crate::error_chain::error_chain;
use crate::node_lease::HEARTBEAT_INTERVAL_MS;
use crate::vm_controller::{HeartbeatError, VmController};

#[derive(Debug, thiserror::Error)]
pub enum StopError {
    #[error("the node's controller task failed")]
    Task(#[source] tokio::task::JoinError),
    #[error("cannot freeze node {node} for the restart; its guests will be fenced when its lease lapses")]
    Freeze {
        node: String,
        #[source]
        source: HeartbeatError,
    },
}

/// The VM, snapshot and migration controllers of one node with its
/// housekeeping, running until stopped.
pub struct RunningControllers {
    vms: Arc<VmController>,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl RunningControllers {
    /// Registers the node (a heartbeat with the driver's facts, which also
    /// grants the first fence lease: under a keeper no guest starts, or
    /// stays, without one), then runs its controllers until stopped.
    pub async fn start(
        vms: Arc<VmController>,
        clock: Arc<dyn Clock>,
        cfg: RuntimeConfig,
    ) -> Result<Self, HeartbeatError> {
        vms.renew_lease().await?;
        let (stop, stop_rx) = watch::channel(false);
        let task = tokio::spawn(run_vm_controller_with(vms.clone(), clock, cfg, stop_rx));
        Ok(Self { vms, stop, task })
    }

    pub fn controller(&self) -> &Arc<VmController> {
        &self.vms
    }

    /// Starts no new reconcile and returns once those under way have
    /// finished; the guests keep running, to be re-adopted.
    pub async fn shutdown(self) -> Result<(), StopError> {
        let _ = self.stop.send(true);
        self.task.await.map_err(StopError::Task)
    }

    /// A planned restart: [`Self::shutdown`], with the node frozen for
    /// `freeze_ms` (see [`VmController::freeze_for_restart`]), so its
    /// guests keep running and nothing of it is taken over until the agent
    /// is back or the freeze is over. The freeze is written first, before
    /// anything waits, and again at the exit. Returns the freeze's end on
    /// this agent's monotonic clock.
    pub async fn freeze_and_shutdown(
        self,
        freeze_ms: Millis,
        reason: &str,
    ) -> Result<Mono, StopError> {
        let node = &self.vms.config().node;
        let _ = self.stop.send(true);
        // Before anything waits: should the work in flight outlast the
        // process (a service manager's stop timeout kills it), the node is
        // frozen and the fence lease reaches to the freeze's end.
        // Bounded as a heartbeat is: a store that does not answer must not
        // keep the agent from stopping.
        let first = tokio::time::timeout(
            Duration::from_millis(HEARTBEAT_INTERVAL_MS),
            self.vms.freeze_for_restart(freeze_ms, reason),
        );
        let failed = match first.await {
            Ok(Ok(_)) => None,
            Ok(Err(err)) => Some(error_chain(&err)),
            Err(_) => Some("timed out".to_string()),
        };
        if let Some(err) = failed {
            tracing::warn!(%node, %err,
                "cannot freeze the node before the reconciles under way end; trying again at the exit");
        }
        self.task.await.map_err(StopError::Task)?;
        // Counted again from the exit, so the restart has its whole
        // window however long the work in flight took.
        self.vms
            .freeze_for_restart(freeze_ms, reason)
            .await
            .map_err(|source| StopError::Freeze {
                node: node.clone(),
                source,
            })
    }

    /// Ends the controllers at once, as if the process were killed.
    pub fn abort(self) {
        self.task.abort();
    }
}
