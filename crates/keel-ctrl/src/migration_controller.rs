//! Carries a migration record through its phases. The target node's agent
//! starts the incoming instance; the source node's agent sends the state,
//! watches progress, and cancels when the VM's eviction no longer wants
//! this migration. The phase only moves forward (compare-and-swap), and a
//! migration that completes despite a cancel is recorded as Succeeded: the
//! eviction honours it.
//!
//! The target waits paused once the state has arrived and is resumed only
//! after Succeeded is recorded and the VM record names it (as libvirt's
//! confirm step): a target never runs beside a source that did not hand
//! over. The source's outcome decides while it lives. A source gone before
//! any outcome was seen is recorded as such (`source_gone_at`), never as a
//! failure: the target settles it by its state, Succeeded if it holds the
//! whole state, Failed if it ended.
//!
//! What to do is decided in `migration_decide`; this file reads what the
//! decision asks for and carries out the step it returns.

use std::sync::Arc;

use keel_api::{Clock, Migration, MigrationPhase, Millis, Node, VirtualMachine};
use keel_hv::Hypervisor;
use keel_store::{StoreError, TypedStore};

use crate::config::LifecycleConfig;
use crate::keys::{migration_key, node_key, vm_key};
use crate::migration_decide::{decide, failed, Look, MigrationStep, Seen};
use crate::node_lease::liveness::{ClockReading, Liveness};
use crate::observe::{LifecycleObserver, NoObserver};
use crate::requeue::Requeue;

pub struct MigrationController {
    store: TypedStore,
    hv: Arc<dyn Hypervisor>,
    clock: Arc<dyn Clock>,
    cfg: LifecycleConfig,
    observer: Arc<dyn LifecycleObserver>,
    /// Source nodes' heartbeats as seen here, on this controller's clock.
    liveness: std::sync::Mutex<Liveness>,
    /// This node's own lease, shared with its VM controller: no incoming
    /// instance is started while it is stale.
    lease: Option<Arc<crate::node_lease::NodeLease>>,
    /// Every VM and node record, as the VM controller's runtime keeps
    /// them: what an incoming instance must fit beside.
    vm_index: Option<Arc<crate::vm_index::ClusterReflector>>,
}

impl MigrationController {
    pub fn new(
        store: TypedStore,
        hv: Arc<dyn Hypervisor>,
        clock: Arc<dyn Clock>,
        cfg: LifecycleConfig,
    ) -> Self {
        Self {
            store,
            hv,
            clock,
            cfg,
            observer: Arc::new(NoObserver),
            liveness: Default::default(),
            lease: None,
            vm_index: None,
        }
    }

    pub fn config(&self) -> &crate::LifecycleConfig {
        &self.cfg
    }

    /// Checks each incoming instance against this node's capacity in
    /// `index` before starting it.
    pub fn with_index(mut self, index: Arc<crate::vm_index::ClusterReflector>) -> Self {
        self.vm_index = Some(index);
        self
    }

    pub fn with_lease(mut self, lease: Arc<crate::node_lease::NodeLease>) -> Self {
        self.lease = Some(lease);
        self
    }

    pub fn with_observer(mut self, observer: Arc<dyn LifecycleObserver>) -> Self {
        self.observer = observer;
        self
    }

    /// One look at one migration; when to look again (`None`: nothing left
    /// for this node to do).
    pub async fn reconcile(&self, vm_name: &str, id: &str) -> Result<Option<Millis>, StoreError> {
        Ok(self.reconcile_why(vm_name, id).await?.map(|next| next.at))
    }

    /// As [`Self::reconcile`], with why it looks again.
    pub async fn reconcile_why(
        &self,
        vm_name: &str,
        id: &str,
    ) -> Result<Option<Requeue>, StoreError> {
        let key = migration_key(vm_name, id);
        let Some(entry) = self.store.get::<Migration>(&key).await? else {
            return Ok(None);
        };
        let m = entry.value;
        let now = self.clock.now_ms();
        let me = self.cfg.node.as_str();
        if m.status.phase == MigrationPhase::Failed || (m.source_node != me && m.target_node != me)
        {
            return Ok(None);
        }
        let vm = self
            .store
            .get::<VirtualMachine>(&vm_key(vm_name))
            .await?
            .map(|e| e.value);
        let mut seen = Seen::default();
        loop {
            match decide(&m, vm.as_ref(), me, &seen, now, &self.cfg) {
                MigrationStep::Look(look) => self.look(look, &m, vm.as_ref(), &mut seen).await?,
                step => {
                    let wrote = Written {
                        key: &key,
                        revision: entry.revision,
                        now,
                    };
                    let why = step.why();
                    let next = self.take(step, &m, vm.as_ref(), wrote).await?;
                    return Ok(next.map(|at| Requeue::at(at, why)));
                }
            }
        }
    }

    /// Reads what the decision asked for into `seen`.
    async fn look(
        &self,
        look: Look,
        m: &Migration,
        vm: Option<&VirtualMachine>,
        seen: &mut Seen,
    ) -> Result<(), StoreError> {
        match look {
            Look::SourceNodeLost => {
                seen.source_node_lost = Some(self.node_lost(&m.source_node).await?)
            }
            Look::TargetNodeLost => {
                seen.target_node_lost = Some(self.node_lost(&m.target_node).await?)
            }
            Look::OwnLease => {
                seen.own_lease_fresh = Some(
                    self.lease
                        .as_ref()
                        .is_none_or(|l| l.fresh(self.clock.mono(), &self.cfg)),
                )
            }
            Look::Room => seen.room = Some(self.room_for(vm).await),
            Look::SourceProgress => {
                seen.source_progress = Some(self.hv.migration_status(&m.source_instance).await)
            }
            Look::TargetState => {
                seen.target_state = Some(self.hv.info(&m.target_instance).await.map(|i| i.state))
            }
        }
        Ok(())
    }

    /// Whether the incoming instance of `vm` fits on this node beside
    /// every start and incoming instance it knows of (its own among them).
    async fn room_for(&self, vm: Option<&VirtualMachine>) -> Result<(), String> {
        let (Some(index), Some(vm)) = (&self.vm_index, vm) else {
            return Ok(());
        };
        let me = self.cfg.node.as_str();
        let domains = self.hv.list().await.map(|l| l.domains).unwrap_or_default();
        let Some(node) = index.node(me).flatten() else {
            return Ok(());
        };
        match crate::own_records::no_room_on(index, &self.store, vm, &node, &domains).await {
            Some(why) => Err(why),
            None => Ok(()),
        }
    }

    /// Carries out `step` for `m` as read at `wrote.revision`.
    async fn take(
        &self,
        step: MigrationStep,
        m: &Migration,
        vm: Option<&VirtualMachine>,
        wrote: Written<'_>,
    ) -> Result<Option<Millis>, StoreError> {
        let now = wrote.now;
        match step {
            MigrationStep::Look(look) => unreachable!("looked at {look:?} before taking a step"),
            MigrationStep::Forget => Ok(None),
            MigrationStep::Wait { requeue_at, why } => {
                tracing::trace!(vm = %m.vm, migration = %m.id, why, "migration waits");
                Ok(Some(requeue_at))
            }
            MigrationStep::Retry { requeue_at, why } => {
                tracing::warn!(vm = %m.vm, migration = %m.id, why, "migration retries");
                Ok(Some(requeue_at))
            }
            MigrationStep::Record {
                m: next,
                requeue_at,
            } => {
                if next.status.message != m.status.message {
                    if let Some(message) = &next.status.message {
                        tracing::info!(vm = %m.vm, migration = %m.id, message, "migration noted");
                    }
                }
                self.write(&wrote, &next).await.map(|_| Some(requeue_at))
            }
            MigrationStep::Finish { m: done, why } => self.finish(&wrote, &done, &why).await,
            MigrationStep::StartIncoming => {
                let Some(vm) = vm else {
                    unreachable!("an incoming instance is started only for a wanted VM");
                };
                let images = crate::images::records_for(&self.store, &vm.spec).await?;
                let spec = crate::domain_spec::for_instance(
                    vm,
                    crate::domain_spec::Launch::IncomingFrom {
                        target_instance: &m.target_instance,
                        source_instance: &m.source_instance,
                    },
                    images,
                );
                // Over TLS only the source node the record names may send.
                let from = keel_hv::IncomingParams {
                    tls_peer: Some(m.source_node.clone()),
                };
                match self.hv.prepare_incoming_from(&spec, &from).await {
                    Ok(uri) => {
                        let mut ready = m.clone();
                        ready.status.phase = MigrationPhase::TargetReady;
                        ready.status.target_uri = Some(uri);
                        self.write(&wrote, &ready).await
                    }
                    Err(err) => {
                        let why = format!("target could not start: {}", crate::error_chain(&err));
                        self.finish(&wrote, &failed(m, &why, now), &why).await
                    }
                }
            }
            MigrationStep::Send {
                uri,
                send,
                running,
                requeue_at,
            } => {
                if send {
                    let params = keel_hv::MigrationParams {
                        // Over TLS the target's certificate must name it.
                        tls_peer: Some(m.target_node.clone()),
                        ..keel_hv::MigrationParams::from_tuning(&m.tuning)
                    };
                    if let Err(err) = self
                        .hv
                        .migrate_tuned(&m.source_instance, &uri, &params)
                        .await
                    {
                        let why = format!(
                            "could not start sending to {uri}: {}",
                            crate::error_chain(&err)
                        );
                        return self.finish(&wrote, &failed(m, &why, now), &why).await;
                    }
                }
                self.write(&wrote, &running).await.map(|_| Some(requeue_at))
            }
            MigrationStep::CancelThen(then) => {
                if let Err(err) = self.hv.cancel_migration(&m.source_instance).await {
                    tracing::warn!(vm = %m.vm, migration = %m.id, err = %crate::error_chain(&err), "cancel failed");
                }
                Box::pin(self.take(*then, m, vm, wrote)).await
            }
            MigrationStep::EndTargetThen { then, retry_at } => {
                match self.hv.kill(&m.target_instance).await {
                    Ok(()) => {}
                    Err(err) if err.is_not_found() => {}
                    Err(err) => {
                        tracing::warn!(vm = %m.vm, migration = %m.id, err = %crate::error_chain(&err), "cannot end the waiting target");
                        return Ok(Some(retry_at));
                    }
                }
                Box::pin(self.take(*then, m, vm, wrote)).await
            }
            MigrationStep::ResumeTarget { retry_at } => {
                match self.hv.resume_incoming(&m.target_instance).await {
                    Ok(()) => {
                        tracing::info!(vm = %m.vm, migration = %m.id, instance = %m.target_instance, "target resumed");
                        Ok(None)
                    }
                    Err(err) => {
                        tracing::warn!(vm = %m.vm, migration = %m.id, err = %crate::error_chain(&err), "resuming the target failed");
                        Ok(Some(retry_at))
                    }
                }
            }
        }
    }

    /// Whether `node`'s lease has run out: it has fenced itself (or is
    /// down), so nothing of it runs. A node without a record counts as not
    /// lost: nothing is known.
    async fn node_lost(&self, node: &str) -> Result<bool, StoreError> {
        let Some(entry) = self.store.get::<Node>(&node_key(node)).await? else {
            return Ok(false);
        };
        let now = ClockReading::now(&*self.clock);
        let mut liveness = self.liveness.lock().expect("liveness lock");
        liveness.observe_node(&entry.value, 0, now);
        Ok(liveness.is_lost(node, now.mono, &self.cfg))
    }

    /// Stores the final record `done`; the target resumes only once it
    /// sees a success.
    async fn finish(
        &self,
        wrote: &Written<'_>,
        done: &Migration,
        why: &str,
    ) -> Result<Option<Millis>, StoreError> {
        let succeeded = done.status.phase == MigrationPhase::Succeeded;
        if succeeded {
            tracing::info!(vm = %done.vm, migration = %done.id, how = why, "migration succeeded");
        } else {
            tracing::info!(vm = %done.vm, migration = %done.id, why, "migration failed");
        }
        let seconds = wrote.now.saturating_sub(done.created_at) as f64 / 1000.0;
        self.observer.migration_finished(succeeded, seconds);
        self.write(wrote, done).await
    }

    /// Stores `m` over the revision read; lost races are looked at again
    /// at once.
    async fn write(
        &self,
        wrote: &Written<'_>,
        m: &Migration,
    ) -> Result<Option<Millis>, StoreError> {
        match self.store.update(wrote.key, m, wrote.revision).await {
            Ok(_) => Ok(Some(wrote.now)),
            Err(StoreError::Conflict { .. }) => Ok(Some(wrote.now)),
            Err(e) => Err(e),
        }
    }
}

/// Where a step's record goes: the key and revision it was read at, and
/// the look's time.
struct Written<'a> {
    key: &'a str,
    revision: u64,
    now: Millis,
}
