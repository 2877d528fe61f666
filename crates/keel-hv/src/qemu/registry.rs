//! The driver's registry of instances: the instance directories are the
//! truth, `Inner::domains` holds their monitors and in-memory phase. Here
//! instances are looked up, adopted (at startup, or when first seen) and
//! observed gone.

use std::collections::BTreeMap;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use keel_api::validate_name;

use super::layout::{read_json, ExitRecord, InstancePaths, LaunchRecord};
use super::monitor::{Domain, Phase, ProcessWatch};
use super::proc::{self, PidFd};
use super::{console, not_found, snapshot, unavailable, QemuDriver};
use crate::{DomainInfo, DomainState, HvError};

impl QemuDriver {
    pub(super) fn paths_or_nowhere(&self, instance: &str) -> InstancePaths {
        match validate_name("instance", instance) {
            Ok(()) => self.inner.layout.new_instance(instance),
            // '.'-prefixed names are never instances (validate_name forbids
            // them), so this directory is never created.
            Err(_) => {
                let nowhere = self.inner.layout.instances_dir().join(".invalid-name");
                InstancePaths::new(nowhere.clone(), nowhere)
            }
        }
    }

    /// Paths as the instance's record has them (sockets included); for an
    /// instance not launched (or not readable) the paths of a new launch.
    pub(super) fn launched_paths(&self, instance: &str) -> InstancePaths {
        match self.existing(instance, "paths") {
            Ok(domain) => domain.paths.clone(),
            Err(_) => self.paths_or_nowhere(instance),
        }
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Arc<Domain>>> {
        self.inner.domains.lock().expect("domains lock")
    }

    /// Serializes disk-changing work on one VM; see `Inner::vm_locks`.
    pub(super) async fn lock_vm(&self, vm: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = self
            .inner
            .vm_locks
            .lock()
            .expect("vm locks")
            .entry(vm.to_string())
            .or_default()
            .clone();
        lock.lock_owned().await
    }

    /// Startup scan: every instance directory becomes a domain; live QEMUs
    /// get a monitor, dead ones an exit record.
    pub(super) fn adopt_all(&self) {
        let dir = self.inner.layout.instances_dir();
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(".staging-") {
                // A start interrupted before it claimed its directory; no
                // QEMU was spawned from it.
                let _ = std::fs::remove_dir_all(entry.path());
                continue;
            }
            if validate_name("instance", &name).is_err() {
                tracing::warn!(path = %entry.path().display(), "ignoring unexpected entry in instances dir");
                continue;
            }
            match self.domain(&name, "adopt") {
                Ok(d) => {
                    tracing::info!(instance = %name, phase = ?d.phase(), "re-adopted instance")
                }
                Err(e) => tracing::warn!("cannot adopt instance {name}: {e}"),
            }
        }
    }

    /// The domain for an existing instance directory, loading it from disk
    /// (and attaching a monitor to a live QEMU) the first time it is seen.
    pub(super) fn domain(&self, instance: &str, op: &'static str) -> Result<Arc<Domain>, HvError> {
        // Held across the load so two callers cannot adopt the same QEMU
        // twice; the load does no blocking beyond small file reads.
        let mut domains = self.lock();
        if let Some(d) = domains.get(instance) {
            return Ok(d.clone());
        }
        let spec_path = self.inner.layout.new_instance(instance).spec;
        let record: LaunchRecord = match read_json(&spec_path) {
            Ok(Some(r)) => r,
            Ok(None) => {
                return Err(unavailable(
                    instance,
                    op,
                    format!("{} is missing", spec_path.display()),
                ))
            }
            Err(e) => return Err(HvError::unavailable_by(instance, op, "", e)),
        };
        let paths = self.inner.layout.launched(instance, &record);
        let exit = read_json::<ExitRecord>(&paths.exit)
            .map_err(|e| HvError::unavailable_by(instance, op, "", e))?;
        let domain = Domain::new(
            instance.to_string(),
            &record.spec,
            record.started_at,
            paths,
            self.inner.config.qmp_timeout,
            Phase::Launching { pid: None },
            self.inner.events.clone(),
        );
        match exit {
            Some(rec) => domain.set_phase(Phase::Exited(rec)),
            None => {
                let marker = &domain.marker;
                let pid = domain
                    .paths
                    .read_pid()
                    .filter(|pid| proc::is_instance_process(*pid, marker))
                    .or_else(|| proc::find_instance_process(marker));
                match pid.map(|pid| PidFd::open_verified(pid, marker)) {
                    Some(Ok(fd)) => {
                        domain.set_phase(Phase::Live { pid: fd.pid() });
                        domain.spawn_monitor(ProcessWatch::PidFd(fd), None);
                        if domain.paths.snapshot_paused.exists() {
                            snapshot::resume_left_paused(domain.clone());
                        }
                        if domain.paths.fs_frozen.exists() {
                            console::thaw_left_frozen(self.clone(), instance.to_string());
                        }
                    }
                    // Gone while we looked, or never found: it exited while
                    // no Keel was watching.
                    Some(Err(_)) | None => {
                        domain.finish(None, "adoption: process not found");
                    }
                }
            }
        }
        domains.insert(instance.to_string(), domain.clone());
        Ok(domain)
    }

    /// Resolves `instance` to its domain, or `NotFound` when its directory
    /// does not exist (never started, or cleaned up).
    pub(super) fn existing(
        &self,
        instance: &str,
        op: &'static str,
    ) -> Result<Arc<Domain>, HvError> {
        if validate_name("instance", instance).is_err() {
            // No directory can have this name, so it was never started.
            return Err(not_found(instance));
        }
        let dir = self.inner.layout.instance_dir(instance);
        match std::fs::symlink_metadata(&dir) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let known = self.lock().get(instance).cloned();
                return match known {
                    Some(d) if d.process_alive() => Err(unavailable(
                        instance,
                        op,
                        format!(
                            "instance dir vanished while QEMU pid {:?} still runs",
                            d.pid()
                        ),
                    )),
                    Some(d) if matches!(d.phase(), Phase::Launching { .. }) => {
                        // `start` has reserved the name but not yet claimed
                        // the directory.
                        Err(not_found(instance))
                    }
                    _ if self.identity_still_runs(instance).is_some() => Err(unavailable(
                        instance,
                        op,
                        format!(
                            "instance dir {} is missing, but a QEMU with this instance's \
                             identity still runs",
                            dir.display()
                        ),
                    )),
                    _ => {
                        self.lock().remove(instance);
                        Err(not_found(instance))
                    }
                };
            }
            Err(e) => {
                let context = dir.display().to_string();
                return Err(HvError::unavailable_by(instance, op, context, e));
            }
        }
        self.domain(instance, op)
    }

    /// A live QEMU started for `instance` from this data dir, found by its
    /// `-pidfile` argument (which names the instance dir, whatever the
    /// socket dir was): "gone" must be observed, not concluded from a
    /// directory that went missing.
    pub(super) fn identity_still_runs(&self, instance: &str) -> Option<u32> {
        let pidfile = self.inner.layout.new_instance(instance).pidfile;
        proc::find_instance_process(&pidfile.to_string_lossy())
    }

    pub(super) fn info_of(&self, domain: &Domain, state: DomainState) -> DomainInfo {
        DomainInfo {
            instance: domain.instance.clone(),
            vm: domain.vm.clone(),
            state,
            pid: if state.is_exited() {
                None
            } else {
                domain.pid()
            },
            started_at: domain.started_at,
            fenced: domain.fenced,
            resets: domain.resets().count,
        }
    }

    /// Waits (bounded) for the monitor to record an exit that has happened
    /// or is about to. Used after kill so `info` right after sees `Exited`.
    pub(super) async fn settle(&self, domain: &Domain, timeout: Duration) {
        if domain.wait_exited(timeout).await.is_none() && !domain.process_alive() {
            domain.finish(None, "driver: process gone, no monitor record");
        }
    }
}
