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

use std::sync::Arc;

use keel_api::{Clock, EvictionPhase, Migration, MigrationPhase, Millis, Node, VirtualMachine};
use keel_hv::{DomainState, Hypervisor, MigrationProgress};
use keel_store::{StoreError, TypedStore};

use crate::config::LifecycleConfig;
use crate::keys::{migration_key, node_key, vm_key};
use crate::node_lease::liveness::{ClockReading, Liveness};
use crate::observe::{LifecycleObserver, NoObserver};

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
        let key = migration_key(vm_name, id);
        let Some(entry) = self.store.get::<Migration>(&key).await? else {
            return Ok(None);
        };
        let mut m = entry.value;
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
        if m.status.phase == MigrationPhase::Succeeded {
            if m.target_node != me {
                return Ok(None);
            }
            return Ok(self.resume_target(&m, vm.as_ref(), now).await);
        }
        // Still wanted: the VM's eviction names it and has not given up, and
        // nobody asked for the VM to stop, restart or go away meanwhile.
        // (The VM, not an earlier one of the same name, from its current
        // instance.)
        let wanted = vm.as_ref().is_some_and(|vm| {
            vm.status.eviction.as_ref().is_some_and(|e| {
                e.migration.as_deref() == Some(id) && e.phase != EvictionPhase::Fallback
            }) && m.is_from(vm)
                && vm.wants_running()
                && !vm.restart_pending()
        });
        let poll = Some(now + 500);
        match m.status.phase {
            MigrationPhase::Pending if m.target_node == me => {
                if self.node_lost(&m.source_node).await? {
                    let why = format!(
                        "source node {} lost before the migration started",
                        m.source_node
                    );
                    return self.fail(&key, m, entry.revision, &why, now).await;
                }
                let Some(vm) = vm.filter(|_| wanted) else {
                    return self
                        .fail(
                            &key,
                            m,
                            entry.revision,
                            "no longer wanted before the target started",
                            now,
                        )
                        .await;
                };
                if self
                    .lease
                    .as_ref()
                    .is_some_and(|l| !l.fresh(self.clock.mono(), &self.cfg))
                {
                    tracing::warn!(
                        vm = vm_name,
                        migration = id,
                        "not starting the incoming instance: this node's lease is stale"
                    );
                    return Ok(Some(now + self.cfg.retry_ms));
                }
                // The hard check, made by the node that starts the
                // instance, against every start and incoming instance it
                // knows of (its own among them): a reservation chosen from
                // an older view never overcommits this node.
                let domains = match &self.vm_index {
                    Some(_) => self.hv.list().await.map(|l| l.domains).unwrap_or_default(),
                    None => Vec::new(),
                };
                let no_room = self.vm_index.as_ref().and_then(|index| {
                    let node = index.node(me).flatten()?;
                    index
                        .read(|vms| {
                            let extra = crate::schedule::unaccounted(&domains, me, |name| {
                                vms.get(name).map(|v| &v.vm)
                            });
                            crate::schedule::room_on(&vm, &node, vms.load(), &extra).err()
                        })
                        .flatten()
                });
                if let Some(why) = no_room {
                    let why = format!("no room on the target: {why}");
                    return self.fail(&key, m, entry.revision, &why, now).await;
                }
                let images = crate::images::records_for(&self.store, &vm.spec).await?;
                let spec = crate::domain_spec::for_instance(
                    &vm,
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
                        m.status.phase = MigrationPhase::TargetReady;
                        m.status.target_uri = Some(uri);
                        self.write(&key, &m, entry.revision, now).await
                    }
                    Err(err) => {
                        let why = format!("target could not start: {}", crate::error_chain(&err));
                        self.fail(&key, m, entry.revision, &why, now).await
                    }
                }
            }
            MigrationPhase::Pending | MigrationPhase::TargetReady
                if m.source_node == me && !wanted =>
            {
                self.fail(&key, m, entry.revision, "cancelled before it was sent", now)
                    .await
            }
            // Never started: given up at its deadline, so the VM is not
            // held by a migration that will not happen (a target that never
            // got ready, a handoff cut short).
            MigrationPhase::Pending | MigrationPhase::TargetReady
                if m.source_node == me && now >= m.start_deadline() =>
            {
                let why = format!(
                    "not started by its deadline ({}s after it was created)",
                    m.start_deadline().saturating_sub(m.created_at) / 1000
                );
                self.fail(&key, m, entry.revision, &why, now).await
            }
            MigrationPhase::TargetReady if m.source_node == me => {
                let uri = m.status.target_uri.clone().unwrap_or_default();
                let progress = self.hv.migration_status(&m.source_instance).await;
                // Unknown: the source is gone after it may have sent
                // everything; the Running phase settles that by the target.
                let started = matches!(
                    progress,
                    Ok(MigrationProgress::Active { .. }
                        | MigrationProgress::Completed { .. }
                        | MigrationProgress::Unknown { .. })
                );
                if !started {
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
                        return self.fail(&key, m, entry.revision, &why, now).await;
                    }
                }
                m.status.phase = MigrationPhase::Running;
                m.status.started_at = Some(now);
                let memory_mib = vm.as_ref().map_or(0, |vm| vm.spec.memory_mib);
                m.status.running_deadline = Some(m.running_deadline_from(now, memory_mib));
                self.write(&key, &m, entry.revision, now)
                    .await
                    .map(|_| poll)
            }
            MigrationPhase::Running if m.source_node == me => {
                let memory_mib = vm.as_ref().map_or(0, |vm| vm.spec.memory_mib);
                let progress = self.hv.migration_status(&m.source_instance).await;
                if let Some(why) = overdue(&m, &progress, wanted, memory_mib, now) {
                    // The source may not answer a cancel either: tried
                    // once, but the record does not wait for it. Failed is
                    // safe whatever the source does next, since a target
                    // runs only after a recorded success, and the source
                    // stays the VM's one instance.
                    if let Err(err) = self.hv.cancel_migration(&m.source_instance).await {
                        tracing::warn!(vm = vm_name, migration = id, err = %crate::error_chain(&err), "cancel failed");
                    }
                    return self.fail(&key, m, entry.revision, &why, now).await;
                }
                match progress {
                    Ok(MigrationProgress::Completed { downtime_ms, .. }) => {
                        m.status.downtime_ms = downtime_ms;
                        self.succeed(&key, m, entry.revision, "source handed over", now)
                            .await
                    }
                    Ok(MigrationProgress::Failed { reason }) => {
                        self.fail(&key, m, entry.revision, &reason, now).await
                    }
                    Ok(MigrationProgress::None) => {
                        self.fail(&key, m, entry.revision, "source reports no migration", now)
                            .await
                    }
                    Ok(MigrationProgress::Active {
                        transferred_bytes,
                        total_bytes,
                        remaining_bytes,
                    }) => {
                        let check = check_progress(&m, memory_mib, transferred_bytes, now);
                        if !wanted || check.is_err() {
                            if let Err(err) = self.hv.cancel_migration(&m.source_instance).await {
                                tracing::warn!(vm = vm_name, migration = id, err = %crate::error_chain(&err), "cancel failed");
                            }
                        }
                        // Recorded, so the reason outlives this controller;
                        // the migration is Failed only once the source says
                        // it stopped (a cancel may come too late).
                        match check {
                            Err(why) if m.status.message.is_none() => {
                                tracing::info!(
                                    vm = vm_name,
                                    migration = id,
                                    why,
                                    "cancelling migration"
                                );
                                m.status.message = Some(format!("cancelling: {why}"));
                                self.write(&key, &m, entry.revision, now)
                                    .await
                                    .map(|_| poll)
                            }
                            Ok(Some(progress)) => {
                                m.status.progress_bytes = Some(progress);
                                m.status.progress_at = Some(now);
                                m.status.progress_total_bytes = Some(total_bytes);
                                m.status.progress_remaining_bytes = Some(remaining_bytes);
                                self.write(&key, &m, entry.revision, now)
                                    .await
                                    .map(|_| poll)
                            }
                            _ => Ok(poll),
                        }
                    }
                    // Gone before an outcome was seen: not a failure. The
                    // target settles it by its state; only if it cannot
                    // (its node is lost, so it never ran) is it a failure.
                    Ok(MigrationProgress::Unknown { reason }) => {
                        self.source_gone(&key, m, entry.revision, &reason, now)
                            .await
                    }
                    Err(err) if err.is_not_found() => {
                        let reason = format!("source instance {} is gone", m.source_instance);
                        self.source_gone(&key, m, entry.revision, &reason, now)
                            .await
                    }
                    Err(err) => {
                        tracing::warn!(vm = vm_name, migration = id, err = %crate::error_chain(&err), "migration status unknown");
                        let retry = now + self.cfg.retry_ms;
                        Ok(Some(retry.min(m.running_deadline(memory_mib).max(now + 1))))
                    }
                }
            }
            // The target knows best whether the handover happened: its
            // guest runs only once the whole state has arrived. This also
            // settles a migration whose source node was lost mid-way.
            MigrationPhase::TargetReady | MigrationPhase::Running if m.target_node == me => {
                match self.hv.info(&m.target_instance).await {
                    // Only a target started by a Keel that let targets run
                    // on arrival: the handover happened.
                    Ok(info) if info.state == DomainState::Running => {
                        self.succeed(&key, m, entry.revision, "target runs", now)
                            .await
                    }
                    // The whole state is here, and the target waits. While
                    // the source lives, its outcome decides; once it is
                    // gone (seen gone by its agent, or its node lost and so
                    // fenced) nothing else can run the guest.
                    Ok(info) if info.state == DomainState::Paused => {
                        if m.status.source_gone_at.is_some()
                            || self.node_lost(&m.source_node).await?
                        {
                            self.succeed(
                                &key,
                                m,
                                entry.revision,
                                "the target holds the whole state and the source is gone",
                                now,
                            )
                            .await
                        } else {
                            Ok(poll)
                        }
                    }
                    Ok(info) if info.state.is_exited() => {
                        self.fail(
                            &key,
                            m,
                            entry.revision,
                            "target ended before the handover",
                            now,
                        )
                        .await
                    }
                    Err(err) if err.is_not_found() => {
                        self.fail(&key, m, entry.revision, "target instance is gone", now)
                            .await
                    }
                    // Still waiting for the state, and the source's node is
                    // lost (fenced): the rest will never come, and this
                    // target never ran.
                    Ok(_) if self.node_lost(&m.source_node).await? => {
                        // Ended first: a waiting target must never be
                        // taken for the VM's instance once the VM moves on.
                        match self.hv.kill(&m.target_instance).await {
                            Ok(()) => {}
                            Err(err) if err.is_not_found() => {}
                            Err(err) => {
                                tracing::warn!(vm = vm_name, migration = id, err = %crate::error_chain(&err), "cannot end the waiting target");
                                return Ok(Some(now + self.cfg.retry_ms));
                            }
                        }
                        let why = format!(
                            "source node {} lost before the whole state arrived",
                            m.source_node
                        );
                        self.fail(&key, m, entry.revision, &why, now).await
                    }
                    _ => Ok(Some(now + 500)),
                }
            }
            // Waiting for the other side.
            _ => Ok(Some(now + self.cfg.poll_ms)),
        }
    }

    /// Records the success; the target resumes only once it sees it.
    async fn succeed(
        &self,
        key: &str,
        mut m: Migration,
        revision: u64,
        how: &str,
        now: Millis,
    ) -> Result<Option<Millis>, StoreError> {
        tracing::info!(vm = %m.vm, migration = %m.id, how, "migration succeeded");
        let seconds = now.saturating_sub(m.created_at) as f64 / 1000.0;
        self.observer.migration_finished(true, seconds);
        m.status.phase = MigrationPhase::Succeeded;
        m.status.finished_at = Some(now);
        self.write(key, &m, revision, now).await
    }

    /// The source instance is gone without an outcome. If the target's node
    /// is lost too, the target never ran (it runs only after a recorded
    /// success) and is fenced: a failure. Otherwise the fact is recorded
    /// for the target to settle.
    async fn source_gone(
        &self,
        key: &str,
        mut m: Migration,
        revision: u64,
        reason: &str,
        now: Millis,
    ) -> Result<Option<Millis>, StoreError> {
        if self.node_lost(&m.target_node).await? {
            let why = format!("{reason}, and target node {} is lost", m.target_node);
            return self.fail(key, m, revision, &why, now).await;
        }
        if m.status.source_gone_at.is_some() {
            return Ok(Some(now + self.cfg.poll_ms));
        }
        tracing::warn!(vm = %m.vm, migration = %m.id, reason, "source gone before the outcome; the target settles it");
        m.status.source_gone_at = Some(now);
        m.status.message = Some(format!("{reason}; the target's state settles it"));
        self.write(key, &m, revision, now).await
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

    /// The target of a recorded success: it runs once the VM record names
    /// it too (the handover is on the VM as well). While the record still
    /// names the source, the handover is being written; if it names
    /// neither, the VM moved on and garbage collection ends this target.
    async fn resume_target(
        &self,
        m: &Migration,
        vm: Option<&VirtualMachine>,
        now: Millis,
    ) -> Option<Millis> {
        let poll = Some(now + 500);
        match vm.and_then(|v| v.status.instance.as_ref()) {
            Some(i) if i.id == m.target_instance => {}
            Some(i) if i.id == m.source_instance => return poll,
            _ => return None,
        }
        match self.hv.info(&m.target_instance).await {
            Ok(info) if info.state == DomainState::Paused => {
                match self.hv.resume_incoming(&m.target_instance).await {
                    Ok(()) => {
                        tracing::info!(vm = %m.vm, migration = %m.id, instance = %m.target_instance, "target resumed");
                        None
                    }
                    Err(err) => {
                        tracing::warn!(vm = %m.vm, migration = %m.id, err = %crate::error_chain(&err), "resuming the target failed");
                        Some(now + self.cfg.retry_ms)
                    }
                }
            }
            Ok(info) if info.state == DomainState::Starting => poll,
            // Running already, or gone (the VM controller sees to that).
            Ok(_) => None,
            Err(err) if err.is_not_found() => None,
            Err(_) => Some(now + self.cfg.retry_ms),
        }
    }

    async fn fail(
        &self,
        key: &str,
        mut m: Migration,
        revision: u64,
        why: &str,
        now: Millis,
    ) -> Result<Option<Millis>, StoreError> {
        tracing::info!(vm = %m.vm, migration = %m.id, why, "migration failed");
        let seconds = now.saturating_sub(m.created_at) as f64 / 1000.0;
        self.observer.migration_finished(false, seconds);
        m.status.phase = MigrationPhase::Failed;
        m.status.finished_at = Some(now);
        m.status.message = Some(match m.status.message.as_deref() {
            // Cancelled for a timeout: that is the reason.
            Some(cancelling) if cancelling.starts_with("cancelling: ") => {
                format!("{} ({why})", &cancelling["cancelling: ".len()..])
            }
            _ => why.to_string(),
        });
        self.write(key, &m, revision, now).await
    }

    async fn write(
        &self,
        key: &str,
        m: &Migration,
        revision: u64,
        now: Millis,
    ) -> Result<Option<Millis>, StoreError> {
        match self.store.update(key, m, revision).await {
            Ok(_) => Ok(Some(now)),
            Err(StoreError::Conflict { .. }) => Ok(Some(now)),
            Err(e) => Err(e),
        }
    }
}

/// Why a migration sending from this node's source must be failed now
/// without waiting for the source to report it stopped, or `None`. A
/// completed one never is (a migration that succeeds late is still taken),
/// nor one whose source is gone (the target's state settles it).
///
/// - Past its running deadline, whatever the source says: a cancel that
///   never takes, or a source that never answers, holds the VM no longer.
/// - The source does not answer and nobody wants the migration any more
///   (the VM is to stop, restart or go): it could not be cancelled anyway,
///   and the stop the user asked for waits on it.
/// - The source does not answer and nothing new was seen sent for the
///   progress timeout: the progress timeout, without the source's word.
pub(crate) fn overdue(
    m: &Migration,
    progress: &Result<MigrationProgress, keel_hv::HvError>,
    wanted: bool,
    memory_mib: u64,
    now: Millis,
) -> Option<String> {
    let unanswered = match progress {
        Ok(MigrationProgress::Completed { .. } | MigrationProgress::Unknown { .. }) => return None,
        Err(err) if err.is_not_found() => return None,
        Err(err) => Some(err),
        Ok(_) => None,
    };
    let deadline = m.running_deadline(memory_mib);
    let started = m.status.started_at.unwrap_or(m.created_at);
    let last_word = unanswered.map_or_else(String::new, |err| {
        format!("; the source: {}", crate::error_chain(err))
    });
    if now >= deadline {
        return Some(format!(
            "not finished by its deadline ({}s after it began sending){last_word}",
            deadline.saturating_sub(started) / 1000
        ));
    }
    let err = crate::error_chain(unanswered?);
    if !wanted {
        return Some(format!(
            "no longer wanted, and the source does not answer to cancel it: {err}"
        ));
    }
    let last_at = m.status.progress_at.unwrap_or(started);
    let timeout_ms = m.tuning.progress_timeout_s.saturating_mul(1000);
    (now.saturating_sub(last_at) >= timeout_ms).then(|| {
        format!(
            "no progress seen for {}s: the source does not answer: {err}",
            m.tuning.progress_timeout_s
        )
    })
}

/// Progress is recorded at most this often (the progress timeout is
/// measured from the last recorded progress).
const PROGRESS_RECORD_MS: Millis = 5_000;

/// A migration under way, `transferred` bytes sent so far, against its
/// tuning: `Err(why)` when it must be cancelled (it ran past its
/// completion timeout for `memory_mib` of guest memory, or sent nothing
/// new for the progress timeout); `Ok(Some(bytes))` when new progress is
/// to be recorded; `Ok(None)` otherwise.
pub(crate) fn check_progress(
    m: &Migration,
    memory_mib: u64,
    transferred: u64,
    now: Millis,
) -> Result<Option<u64>, String> {
    let t = &m.tuning;
    let started = m.status.started_at.unwrap_or(m.created_at);
    let limit = t.completion_timeout_ms(memory_mib);
    if now.saturating_sub(started) >= limit {
        return Err(format!(
            "not completed within {}s ({}s per GiB of {memory_mib} MiB)",
            limit / 1000,
            t.completion_timeout_per_gib_s
        ));
    }
    let last_at = m.status.progress_at.unwrap_or(started);
    let grew = transferred > m.status.progress_bytes.unwrap_or(0);
    if grew {
        let due = m.status.progress_at.is_none() || now >= last_at + PROGRESS_RECORD_MS;
        return Ok(due.then_some(transferred));
    }
    if now.saturating_sub(last_at) >= t.progress_timeout_s * 1000 {
        return Err(format!(
            "no progress for {}s ({} bytes sent)",
            t.progress_timeout_s, transferred
        ));
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_api::{MigrationStatus, MigrationTuning};

    #[test]
    fn completion_and_progress_timeouts() {
        let t0 = 1_000_000;
        let m = |progress: Option<(u64, Millis)>| Migration {
            id: "vm-m1".into(),
            vm_uid: String::new(),
            vm: "vm".into(),
            source_node: "a".into(),
            source_instance: "vm-1".into(),
            target_node: "b".into(),
            target_instance: "vm-2".into(),
            created_at: t0 - 1_000,
            tuning: MigrationTuning::default(),
            status: MigrationStatus {
                phase: MigrationPhase::Running,
                started_at: Some(t0),
                progress_bytes: progress.map(|p| p.0),
                progress_at: progress.map(|p| p.1),
                ..Default::default()
            },
        };
        // (recorded progress, memory MiB, bytes sent, now) → outcome
        let cases = [
            (None, 2048, 10, t0 + 1_000, Ok(Some(10))),
            (Some((10, t0 + 1_000)), 2048, 20, t0 + 3_000, Ok(None)),
            (Some((10, t0 + 1_000)), 2048, 20, t0 + 6_000, Ok(Some(20))),
            (Some((10, t0 + 1_000)), 2048, 10, t0 + 150_999, Ok(None)),
            (
                Some((10, t0 + 1_000)),
                2048,
                10,
                t0 + 151_000,
                Err("no progress for 150s"),
            ),
            (
                Some((10, t0 + 290_000)),
                2048,
                20,
                t0 + 299_999,
                Ok(Some(20)),
            ),
            (
                Some((10, t0 + 290_000)),
                2048,
                20,
                t0 + 300_000,
                Err("not completed within 300s"),
            ),
            (
                Some((10, t0 + 140_000)),
                512,
                20,
                t0 + 150_000,
                Err("not completed within 150s"),
            ),
        ];
        for (progress, memory, sent, now, expected) in cases {
            let got = check_progress(&m(progress), memory, sent, now);
            match (&got, &expected) {
                (Ok(a), Ok(b)) => assert_eq!(a, b, "{progress:?} {sent} at +{}", now - t0),
                (Err(why), Err(start)) => assert!(why.starts_with(start), "{why}"),
                _ => panic!("{progress:?} {sent} at +{}: {got:?}", now - t0),
            }
        }
    }
}
