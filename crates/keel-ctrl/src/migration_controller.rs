//! Carries a migration record through its phases. The target node's agent
//! starts the incoming instance; the source node's agent sends the state,
//! watches progress, and cancels when the VM's eviction no longer wants
//! this migration. The phase only moves forward (compare-and-swap), and a
//! migration that completes despite a cancel is recorded as Succeeded: the
//! eviction honours it.

use std::sync::Arc;

use keel_api::{Clock, EvictionPhase, Migration, MigrationPhase, Millis, VirtualMachine};
use keel_hv::{DomainSpec, DomainState, Hypervisor, MigrationProgress};
use keel_store::{StoreError, TypedStore};

use crate::keys::{migration_key, vm_key};
use crate::observe::{LifecycleObserver, NoObserver};
use crate::vm_decide::LifecycleConfig;

pub struct MigrationController {
    store: TypedStore,
    hv: Arc<dyn Hypervisor>,
    clock: Arc<dyn Clock>,
    cfg: LifecycleConfig,
    observer: Arc<dyn LifecycleObserver>,
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
        }
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
        if m.status.phase.is_final() || (m.source_node != me && m.target_node != me) {
            return Ok(None);
        }
        let vm = self
            .store
            .get::<VirtualMachine>(&vm_key(vm_name))
            .await?
            .map(|e| e.value);
        // Still wanted: the VM's eviction names it and has not given up, and
        // nobody asked for the VM to stop, restart or go away meanwhile.
        let wanted = vm.as_ref().is_some_and(|vm| {
            vm.status.eviction.as_ref().is_some_and(|e| {
                e.migration.as_deref() == Some(id) && e.phase != EvictionPhase::Fallback
            }) && vm.status.instance.as_ref().map(|i| i.id.as_str())
                == Some(m.source_instance.as_str())
                && vm.wants_running()
                && !vm.restart_pending()
        });
        let poll = Some(now + 500);
        match m.status.phase {
            MigrationPhase::Pending if m.target_node == me => {
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
                let spec = DomainSpec {
                    vm: vm.name.clone(),
                    instance: m.target_instance.clone(),
                    cpus: vm.spec.cpus,
                    memory_mib: vm.spec.memory_mib,
                    disks: vm.spec.disks.clone(),
                    boot: vm.spec.boot.clone(),
                    // The source's disks, on storage both nodes share.
                    create_disks: false,
                };
                match self.hv.prepare_incoming(&spec).await {
                    Ok(uri) => {
                        m.status.phase = MigrationPhase::TargetReady;
                        m.status.target_uri = Some(uri);
                        self.write(&key, &m, entry.revision, now).await
                    }
                    Err(err) => {
                        let why = format!("target could not start: {err}");
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
            MigrationPhase::TargetReady if m.source_node == me => {
                let uri = m.status.target_uri.clone().unwrap_or_default();
                let progress = self.hv.migration_status(&m.source_instance).await;
                let started = matches!(
                    progress,
                    Ok(MigrationProgress::Active { .. } | MigrationProgress::Completed { .. })
                );
                if !started {
                    let params = keel_hv::MigrationParams::from_tuning(&m.tuning);
                    if let Err(err) = self
                        .hv
                        .migrate_tuned(&m.source_instance, &uri, &params)
                        .await
                    {
                        let why = format!("could not start sending to {uri}: {err}");
                        return self.fail(&key, m, entry.revision, &why, now).await;
                    }
                }
                m.status.phase = MigrationPhase::Running;
                m.status.started_at = Some(now);
                self.write(&key, &m, entry.revision, now)
                    .await
                    .map(|_| poll)
            }
            MigrationPhase::Running if m.source_node == me => {
                match self.hv.migration_status(&m.source_instance).await {
                    Ok(MigrationProgress::Completed { downtime_ms, .. }) => {
                        m.status.phase = MigrationPhase::Succeeded;
                        m.status.finished_at = Some(now);
                        m.status.downtime_ms = downtime_ms;
                        tracing::info!(vm = vm_name, migration = id, "migration succeeded");
                        let seconds = now.saturating_sub(m.created_at) as f64 / 1000.0;
                        self.observer.migration_finished(true, seconds);
                        self.write(&key, &m, entry.revision, now).await
                    }
                    Ok(MigrationProgress::Failed { reason }) => {
                        self.fail(&key, m, entry.revision, &reason, now).await
                    }
                    Ok(MigrationProgress::None) => {
                        self.fail(&key, m, entry.revision, "source reports no migration", now)
                            .await
                    }
                    Ok(MigrationProgress::Active {
                        transferred_bytes, ..
                    }) => {
                        let memory_mib = vm.as_ref().map_or(0, |vm| vm.spec.memory_mib);
                        let check = check_progress(&m, memory_mib, transferred_bytes, now);
                        if !wanted || check.is_err() {
                            if let Err(err) = self.hv.cancel_migration(&m.source_instance).await {
                                tracing::warn!(vm = vm_name, migration = id, %err, "cancel failed");
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
                                self.write(&key, &m, entry.revision, now)
                                    .await
                                    .map(|_| poll)
                            }
                            _ => Ok(poll),
                        }
                    }
                    Err(err) if err.is_not_found() => {
                        self.fail(&key, m, entry.revision, "source instance is gone", now)
                            .await
                    }
                    Err(err) => {
                        tracing::warn!(vm = vm_name, migration = id, %err, "migration status unknown");
                        Ok(Some(now + self.cfg.retry_ms))
                    }
                }
            }
            // The target knows best whether the handover happened: its
            // guest runs only once the whole state has arrived. This also
            // settles a migration whose source node was lost mid-way.
            MigrationPhase::TargetReady | MigrationPhase::Running if m.target_node == me => {
                match self.hv.info(&m.target_instance).await {
                    Ok(info) if info.state == DomainState::Running => {
                        m.status.phase = MigrationPhase::Succeeded;
                        m.status.finished_at = Some(now);
                        tracing::info!(
                            vm = vm_name,
                            migration = id,
                            "migration succeeded (target runs)"
                        );
                        let seconds = now.saturating_sub(m.created_at) as f64 / 1000.0;
                        self.observer.migration_finished(true, seconds);
                        self.write(&key, &m, entry.revision, now).await
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
                    _ => Ok(Some(now + 500)),
                }
            }
            // Waiting for the other side.
            _ => Ok(Some(now + self.cfg.poll_ms)),
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
