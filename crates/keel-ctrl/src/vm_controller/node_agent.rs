//! The node agent's own duties, beside reconciling VMs: the heartbeat
//! (this node's record and its lease), the freeze of a planned restart,
//! recording a drain complete, and self-fencing when the lease cannot be
//! renewed. (Taking over lost nodes' VMs is the cluster controller's.)

use crate::error_chain::error_chain;
use crate::events::report_undecodable;
use crate::fence::Fence;
use crate::keys::{node_key, VMS_PREFIX};
use crate::node_lease::{LeaseHolder, LeasePlan};
use keel_api::{Millis, Mono, Node, NodeFreeze, VirtualMachine};
use keel_store::StoreError;

use super::VmController;
use crate::error::HeartbeatError;

impl VmController {
    /// Writes this node's heartbeat (creating its record on first call).
    /// The heartbeat reads nothing but this node's own record and does
    /// nothing else: no other record, however broken, and no store slow to
    /// list the others, can keep it from being renewed.
    pub async fn heartbeat(
        &self,
        facts: Option<&keel_hv::NodeFacts>,
    ) -> Result<(), HeartbeatError> {
        self.heartbeat_planned(facts).await.map(|_| ())
    }

    /// [`Self::heartbeat`], returning how the local lease is to be renewed.
    async fn heartbeat_planned(
        &self,
        facts: Option<&keel_hv::NodeFacts>,
    ) -> Result<LeasePlan, HeartbeatError> {
        let sent_at = self.clock.mono();
        let node = self
            .update_own_record(|node, now| {
                node.status.last_heartbeat = now;
                node.status.disk_home = Some(self.cfg.disk_home());
                if let Some(facts) = facts {
                    node.status.accelerator = facts.accelerator;
                    node.status.hypervisor = Some(facts.hypervisor.clone());
                    node.status.migration = facts.migration.clone();
                    node.status.storage_id = facts.storage_id.clone();
                    node.status.hardware = facts.hardware.clone();
                    node.status.capacity = facts.host.map(|h| self.cfg.capacity.offered(h));
                }
            })
            .await?;
        Ok(self
            .lease
            .heartbeat_ok(sent_at, node.freeze.as_ref(), &self.cfg))
    }

    /// Changes this node's own record (creating it if absent) by
    /// compare-and-swap, refusing if another incarnation holds the name.
    /// Returns the record as written. It writes on the record as this
    /// agent last wrote it, and reads the store only when that is not
    /// known or someone else has written since (the write conflicts): so a
    /// heartbeat is one round trip (`node_lease::own_record`).
    async fn update_own_record(
        &self,
        mut change: impl FnMut(&mut Node, Millis),
    ) -> Result<Node, HeartbeatError> {
        let key = node_key(&self.cfg.node);
        loop {
            let now = self.clock.now_ms();
            let current = match self.own_record.known() {
                Some(known) => Some(known),
                None => self.store.get::<Node>(&key).await?,
            };
            let revision = current.as_ref().map(|e| e.revision);
            let mut node = current.map_or_else(|| Node::new(&self.cfg.node), |e| e.value);
            // A record remembered here was written by this incarnation: a
            // foreign one is only ever found by a read.
            if let (Some(ours), Some(theirs)) = (&self.cfg.incarnation, &node.status.incarnation) {
                if ours != theirs {
                    return Err(HeartbeatError::Superseded {
                        node: self.cfg.node.clone(),
                        theirs: theirs.clone(),
                        ours: ours.clone(),
                    });
                }
            }
            if self.cfg.incarnation.is_some() {
                node.status.incarnation = self.cfg.incarnation.clone();
            }
            change(&mut node, now);
            let result = match revision {
                Some(revision) => self.store.update(&key, &node, revision).await,
                None => self.store.create(&key, &node).await,
            };
            match result {
                Ok(revision) => {
                    self.own_record.remember(node.clone(), revision);
                    return Ok(node);
                }
                Err(StoreError::Conflict { .. }) => {
                    self.own_record.forget();
                    continue;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// A planned restart: freezes this node for `wanted_ms` (longer if a
    /// freeze in force ends later), so the cluster takes over none of its
    /// VMs meanwhile, and extends the local fence lease to the freeze's
    /// end, so the guests keep running without the agent and are fenced
    /// if it has not returned by then. Written together with a heartbeat.
    /// Returns the freeze's end on this agent's monotonic clock.
    pub async fn freeze_for_restart(
        &self,
        wanted_ms: Millis,
        reason: &str,
    ) -> Result<Mono, HeartbeatError> {
        let sent_at = self.clock.mono();
        let requested_at = self.clock.now_ms();
        let node = self
            .update_own_record(|node, now| {
                let duration_ms =
                    self.lease
                        .own_freeze_ms(sent_at, wanted_ms, node.freeze.as_ref());
                node.freeze = Some(NodeFreeze {
                    requested_at,
                    duration_ms,
                    reason: reason.to_string(),
                });
                node.status.last_heartbeat = now;
            })
            .await?;
        let freeze = node.freeze.expect("written above");
        let end = self.lease.froze(sent_at, &freeze);
        let left = end.since(self.clock.mono());
        self.hv
            .renew_fence(std::time::Duration::from_millis(left))
            .await
            .map_err(HeartbeatError::Fence)?;
        tracing::warn!(node = %self.cfg.node, duration_ms = freeze.duration_ms, reason,
            "node frozen: its guests keep running until the agent returns, and are fenced at the freeze's end");
        Ok(end)
    }

    /// Removes the freeze `key` from this node's record (not a newer one).
    async fn clear_freeze(&self, key: (Millis, Millis)) -> Result<(), HeartbeatError> {
        let mut cleared = false;
        self.update_own_record(|node, _| {
            if node.freeze.as_ref().is_some_and(|f| f.key() == key) {
                node.freeze = None;
                cleared = true;
            }
        })
        .await?;
        if cleared {
            tracing::info!(node = %self.cfg.node, "freeze ended: the agent is back, or the freeze is over");
        }
        Ok(())
    }

    /// Records this node's drain as complete if no VM is left on it. A VM
    /// record that cannot be decoded might be one of this node's: the
    /// drain stays open until it is repaired or removed. One of the
    /// chores: it lists every VM, which may take longer than a heartbeat
    /// may.
    async fn complete_drain(&self) -> Result<(), StoreError> {
        let key = node_key(&self.cfg.node);
        let own = self.store.get::<Node>(&key).await?;
        if own.is_none_or(|node| node.value.draining().is_none()) {
            return Ok(());
        }
        let vms = self
            .store
            .list_with_skipped::<VirtualMachine>(VMS_PREFIX)
            .await?;
        if let Some(bad) = vms.skipped.first() {
            tracing::warn!(node = %self.cfg.node, key = %bad.key,
                "drain not recorded complete: a VM record cannot be decoded");
            return Ok(());
        }
        let me = Some(self.cfg.node.as_str());
        if vms.entries.iter().any(|(_, v)| v.value.owner_node() == me) {
            return Ok(());
        }
        loop {
            let Some(current) = self.store.get::<Node>(&key).await? else {
                return Ok(());
            };
            let mut node = current.value;
            let Some(drain) = node.drain.as_mut().filter(|d| d.completed_at.is_none()) else {
                return Ok(());
            };
            drain.completed_at = Some(self.clock.now_ms());
            match self.store.update(&key, &node, current.revision).await {
                Ok(_) => {
                    tracing::info!(node = %self.cfg.node, "drain complete: no VM left on the node");
                    return Ok(());
                }
                Err(StoreError::Conflict { .. }) => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// Writes the heartbeat and, once it reached the store, renews the
    /// node's local fence lease (which the QEMU driver's keepers enforce
    /// even if this process dies) with what is left of `self_fence_ms`,
    /// counted from before the write was sent.
    ///
    /// Under a freeze the lease reaches to the freeze's end. A freeze that
    /// is over, or that this agent finds on its first heartbeat (it is
    /// back), is removed from the record, and only after the lease was cut
    /// back to the normal window: the cluster then counts the normal lease
    /// again, and the guests must not outlive it.
    pub async fn heartbeat_and_renew(
        &self,
        facts: Option<&keel_hv::NodeFacts>,
    ) -> Result<(), HeartbeatError> {
        let plan = self.heartbeat_planned(facts).await?;
        let left = plan.renew_until.since(self.clock.mono());
        if let Err(err) = self
            .hv
            .renew_fence(std::time::Duration::from_millis(left))
            .await
        {
            // The guests will be fenced when the lease lapses: loud, but
            // nothing else to do than try again at the next heartbeat.
            tracing::error!(node = %self.cfg.node, err = %crate::error_chain(&err), "cannot renew the local fence lease");
            return Ok(());
        }
        if let Some(key) = plan.clear_freeze {
            if let Err(err) = self.clear_freeze(key).await {
                tracing::warn!(node = %self.cfg.node, err = %error_chain(&err), "cannot clear the node's freeze; trying again at the next heartbeat");
            }
        }
        Ok(())
    }

    /// [`Self::heartbeat_and_renew`] with the driver's current facts.
    pub async fn renew_lease(&self) -> Result<(), HeartbeatError> {
        let facts = self.hv.facts().await;
        self.heartbeat_and_renew(Some(&facts)).await
    }

    /// Whether this agent must end its guests now, its last good heartbeat
    /// having been at `last_ok` (see [`NodeLease::self_fence_due`]).
    pub fn self_fence_due(&self, last_ok: Mono) -> bool {
        self.lease
            .self_fence_due(last_ok, self.clock.mono(), &self.cfg)
    }

    /// Recording a drain of this node complete, ending stray domains.
    /// (Taking over the VMs of lost nodes is the cluster controller's.)
    pub async fn chores(&self) {
        if let Err(err) = self.complete_drain().await {
            tracing::warn!(node = %self.cfg.node, err = %error_chain(&err), "cannot check whether the drain is complete");
        }
        if let Err(err) = self.collect_garbage().await {
            tracing::warn!(err = %error_chain(&err), "garbage collection failed");
        }
        report_undecodable(&self.store, self.clock.now_ms(), Fence::Cas).await;
    }

    /// This agent cannot renew its lease: before it runs out and another
    /// node starts these VMs, end every fenced domain here. The unfenced
    /// ones no other node may start keep running, to be taken up again.
    pub async fn self_fence(&self) {
        let listing = match self.hv.list().await {
            Ok(listing) => listing,
            Err(err) => {
                tracing::error!(node = %self.cfg.node, err = %crate::error_chain(&err), "self-fence: cannot list domains");
                return;
            }
        };
        // A domain whose state nobody could read may be running: it is
        // ended too. All at once, so one slow kill delays no other.
        let mut kills = tokio::task::JoinSet::new();
        for instance in listing.fenced_instances() {
            tracing::error!(node = %self.cfg.node, instance,
                "self-fence: lease not renewed, ending instance");
            let (hv, instance) = (self.hv.clone(), instance.to_string());
            kills.spawn(async move {
                if let Err(err) = hv.kill(&instance).await {
                    tracing::error!(instance, err = %crate::error_chain(&err), "self-fence: kill failed");
                }
            });
        }
        kills.join_all().await;
    }
}

/// The heartbeat loop's view of the controller (`node_lease::heartbeat`).
impl LeaseHolder for VmController {
    type Error = HeartbeatError;

    fn node(&self) -> &str {
        &self.cfg.node
    }

    async fn renew_lease(&self) -> Result<(), HeartbeatError> {
        VmController::renew_lease(self).await
    }

    fn self_fence_due(&self, last_ok: Mono) -> bool {
        VmController::self_fence_due(self, last_ok)
    }

    async fn self_fence(&self) {
        VmController::self_fence(self).await
    }
}
