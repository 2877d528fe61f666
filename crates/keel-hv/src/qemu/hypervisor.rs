//! The [`Hypervisor`] trait for the qemu driver: each operation delegates
//! to the module that owns it, or is short enough to live here.

use std::io;
use std::time::Duration;

use async_trait::async_trait;
use keel_api::{validate_name, Clock, SystemClock};

use super::monitor::Phase;
use super::proc::PidFd;
use super::{blocking, network, passt, unavailable, QemuDriver};
use crate::{
    DomainInfo, DomainSpec, DomainState, HvError, Hypervisor, MigrationProgress, NodeFacts,
};

#[async_trait]
impl Hypervisor for QemuDriver {
    async fn facts(&self) -> NodeFacts {
        let verdict = self.inner.accel.now();
        let verdict_accel = verdict.as_ref().map(|v| v.accelerator);
        NodeFacts {
            hypervisor: self.inner.qemu_version.clone(),
            accelerator: verdict.as_ref().map(|v| v.accelerator),
            accelerator_note: verdict.map_or_else(
                || "probing kvm: the verdict comes within the probe's timeout".into(),
                |v| v.note,
            ),
            migration: Some(self.migration_endpoint()),
            storage_id: Some(self.inner.storage_id.clone()),
            hardware: Some(self.inner.catalog.offered(verdict_accel)),
            host: crate::host_resources::this_host(),
        }
    }

    async fn renew_fence(&self, valid_for: Duration) -> Result<(), HvError> {
        if self.inner.config.keeper.is_none() {
            return Ok(());
        }
        self.inner
            .lease
            .renew(valid_for)
            .map_err(|e| HvError::Fence {
                reason: format!("renew {}", self.inner.lease.path().display()),
                source: Some(crate::Cause::new(e)),
            })
    }

    fn domain_events(&self) -> Option<tokio::sync::broadcast::Receiver<crate::DomainEvent>> {
        Some(self.inner.events.subscribe())
    }

    async fn start(&self, spec: &DomainSpec) -> Result<(), HvError> {
        self.start_domain(spec, None).await.map(drop)
    }

    async fn prepare_incoming_from(
        &self,
        spec: &DomainSpec,
        params: &crate::IncomingParams,
    ) -> Result<String, HvError> {
        let uri = self.start_domain(spec, Some(params.clone())).await?;
        uri.ok_or_else(|| HvError::Failed {
            instance: spec.instance.clone(),
            op: "prepare incoming migration",
            reason: "no listening URI was set up".into(),
            source: None,
        })
    }

    async fn migrate_tuned(
        &self,
        instance: &str,
        uri: &str,
        params: &crate::MigrationParams,
    ) -> Result<(), HvError> {
        self.migrate_out(instance, uri, params).await
    }

    async fn migration_status(&self, instance: &str) -> Result<MigrationProgress, HvError> {
        self.outgoing_status(instance).await
    }

    async fn cancel_migration(&self, instance: &str) -> Result<(), HvError> {
        self.cancel_outgoing(instance).await
    }

    async fn resume_incoming(&self, instance: &str) -> Result<(), HvError> {
        self.resume_arrived(instance).await
    }

    async fn snapshot_disks(
        &self,
        vm: &str,
        disks: &[keel_api::DiskSpec],
        instance: Option<&str>,
        name: &str,
    ) -> Result<(), HvError> {
        self.take_snapshot(vm, disks, instance, name).await
    }

    async fn restore_disks(
        &self,
        vm: &str,
        disks: &[keel_api::DiskSpec],
        name: &str,
    ) -> Result<(), HvError> {
        self.apply_snapshot(vm, disks, name).await
    }

    async fn delete_snapshot(
        &self,
        vm: &str,
        disks: &[keel_api::DiskSpec],
        name: &str,
    ) -> Result<(), HvError> {
        self.remove_snapshot(vm, disks, name).await
    }

    async fn export_disks(
        &self,
        vm: &str,
        disks: &[keel_api::DiskSpec],
        snapshot: &str,
        dir: &std::path::Path,
    ) -> Result<Vec<String>, HvError> {
        self.write_export(vm, disks, snapshot, dir).await
    }

    async fn import_disks(
        &self,
        vm: &str,
        disks: &[keel_api::DiskSpec],
        dir: &std::path::Path,
    ) -> Result<(), HvError> {
        self.take_import(vm, disks, dir).await
    }

    async fn console_tail(
        &self,
        instance: &str,
        max_bytes: u64,
    ) -> Result<(Vec<u8>, u64), HvError> {
        self.read_console_log(instance, max_bytes).await
    }

    async fn console_contains(&self, instance: &str, text: &str) -> Result<bool, HvError> {
        self.scan_console(instance, text).await
    }

    fn watch_console(&self, instance: &str, text: &str, shown: Box<dyn FnOnce() + Send>) {
        self.follow_console(instance, text, shown)
    }

    async fn open_console(&self, instance: &str) -> Result<crate::ConsoleStream, HvError> {
        self.attach_console(instance).await
    }

    async fn open_vnc(&self, instance: &str) -> Result<crate::ConsoleStream, HvError> {
        self.attach_vnc(instance).await
    }

    async fn guest_info(&self, instance: &str) -> Result<crate::GuestInfo, HvError> {
        self.agent_info(instance).await
    }

    async fn fs_freeze(&self, instance: &str) -> Result<u32, HvError> {
        self.agent_freeze(instance).await
    }

    async fn fs_thaw(&self, instance: &str) -> Result<u32, HvError> {
        self.agent_thaw(instance).await
    }

    async fn guest_shutdown(&self, instance: &str) -> Result<(), HvError> {
        self.agent_shutdown(instance).await
    }

    async fn guest_reboot(&self, instance: &str) -> Result<(), HvError> {
        self.agent_reboot(instance).await
    }

    async fn reset(&self, instance: &str) -> Result<(), HvError> {
        self.system_reset(instance).await
    }

    async fn attach_disk(&self, plug: &crate::DiskPlug) -> Result<(), HvError> {
        self.attach_disk_online(plug).await
    }

    async fn detach_disk(
        &self,
        vm: &str,
        instance: &str,
        disk: &str,
    ) -> Result<crate::DiskDetach, HvError> {
        self.detach_disk_online(vm, instance, disk).await
    }

    async fn grow_disk(
        &self,
        vm: &str,
        instance: &str,
        disk: &str,
        size_mib: u64,
    ) -> Result<(), HvError> {
        self.grow_disk_online(vm, instance, disk, size_mib).await
    }

    async fn shutdown(&self, instance: &str) -> Result<(), HvError> {
        let domain = self.existing(instance, "shutdown")?;
        let pid = match domain.phase() {
            Phase::Exited(_) => return Ok(()),
            Phase::Launching { .. } => {
                return Err(unavailable(
                    instance,
                    "shutdown",
                    "QEMU is still launching".into(),
                ))
            }
            Phase::Live { pid } => pid,
        };
        let failure = match domain.qmp().await {
            Ok(client) => match client.system_powerdown().await {
                Ok(()) => return Ok(()),
                Err(e) => e.to_string(),
            },
            Err(e) => e,
        };
        // A domain that exited meanwhile needs no power-down.
        domain
            .state_without_qmp(pid, "shutdown", failure)
            .await
            .map(drop)
    }

    async fn kill(&self, instance: &str) -> Result<(), HvError> {
        let domain = self.existing(instance, "kill")?;
        let pid = match domain.phase() {
            Phase::Exited(_) => return Ok(()),
            Phase::Launching { pid: None } => {
                return Err(unavailable(
                    instance,
                    "kill",
                    "QEMU is being spawned".into(),
                ))
            }
            Phase::Launching { pid: Some(pid) } | Phase::Live { pid } => pid,
        };
        // The signal first, and nothing before it waits on the disk: a
        // self-fence on a node whose data disk stalls must still kill. This
        // monitor attributes the exit to us from memory; the marker, for a
        // later Keel's scan, follows the signal, bounded in time.
        domain.note_kill_requested();
        let signalled: Result<(), HvError> = match PidFd::open_verified(pid, &domain.marker) {
            Ok(fd) => {
                let sent = fd.signal(libc::SIGKILL).map_err(|e| {
                    HvError::failed_by(instance, "kill", format!("SIGKILL pid {pid}"), e)
                });
                if sent.is_ok() {
                    tracing::info!(instance, pid, "sent SIGKILL");
                }
                sent.map(drop)
            }
            // ESRCH or a cmdline mismatch: our QEMU is already gone.
            Err(e) => {
                tracing::debug!(instance, pid, "kill: process already gone: {e}");
                Ok(())
            }
        };
        let marker = format!("{}\n", SystemClock.now_ms());
        let write = tokio::fs::write(&domain.paths.kill_marker, marker);
        match tokio::time::timeout(Duration::from_secs(2), write).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(instance, "kill marker not written: {e}"),
            Err(_) => tracing::warn!(
                instance,
                "kill marker not written: the disk does not answer"
            ),
        }
        signalled?;
        self.settle(&domain, Duration::from_secs(5)).await;
        Ok(())
    }

    async fn info(&self, instance: &str) -> Result<DomainInfo, HvError> {
        let domain = self.existing(instance, "info")?;
        let state = domain.state().await?;
        Ok(self.info_of(&domain, state))
    }

    async fn stats_all(&self) -> Result<Vec<crate::vm_stats::DomainStats>, HvError> {
        Ok(self.stats_of_live().await)
    }

    async fn list(&self) -> Result<crate::DomainListing, HvError> {
        self.list_domains().await
    }

    async fn domains_of(&self, vm: &str) -> Result<Vec<DomainInfo>, HvError> {
        self.domains_of_vm(vm).await
    }

    async fn cleanup(&self, instance: &str) -> Result<(), HvError> {
        let domain = self.existing(instance, "cleanup")?;
        let state = match domain.phase() {
            Phase::Exited(_) => None,
            Phase::Launching { .. } => Some(DomainState::Starting),
            Phase::Live { .. } => match domain.state().await {
                Ok(DomainState::Exited(_)) => None,
                Ok(state) => Some(state),
                // Alive, just not answering: certainly not exited.
                Err(HvError::Unavailable { .. }) => Some(DomainState::Running),
                Err(e) => return Err(e),
            },
        };
        if let Some(state) = state {
            return Err(HvError::StillRunning {
                instance: instance.to_string(),
                state,
            });
        }
        // The network first (passt, whose listeners the next instance needs
        // at once; the tap): if it cannot go, the instance stays known and
        // the next cleanup tries again.
        let dir = domain.paths.dir.clone();
        let passt_gone = blocking::unblocked("wait for passt", move || {
            passt::await_gone(&dir).map_err(io::Error::other)
        })
        .await;
        if let Err(e) = passt_gone {
            return Err(HvError::failed_by(instance, "cleanup", "", e));
        }
        // swtpm too: it holds the lock on the VM's TPM state, which the
        // next instance takes at once.
        let (dir, sockets) = (domain.paths.dir.clone(), domain.paths.sockets.clone());
        let swtpm_gone = blocking::unblocked("wait for swtpm", move || {
            super::tpm::await_gone(&dir, &sockets).map_err(io::Error::other)
        })
        .await;
        if let Err(e) = swtpm_gone {
            return Err(HvError::failed_by(instance, "cleanup", "", e));
        }
        if let Err(e) = network::release(instance) {
            return Err(HvError::failed_by(instance, "cleanup", "", e));
        }
        let paths = domain.paths.clone();
        let removed = blocking::unblocked("cleanup", move || {
            paths.remove_sockets()?;
            match std::fs::remove_dir_all(&paths.dir) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            }
        })
        .await;
        if let Err(e) = removed {
            let context = format!("remove {}", domain.paths.dir.display());
            return Err(HvError::failed_by(instance, "cleanup", context, e));
        }
        self.lock().remove(instance);
        self.forget_guest(instance);
        tracing::info!(instance, "cleaned up");
        Ok(())
    }

    async fn delete_disks(&self, vm: &str) -> Result<(), HvError> {
        let storage = |reason: String| HvError::Storage {
            vm: vm.to_string(),
            op: "delete_disks",
            reason,
            source: None,
        };
        validate_name("vm", vm).map_err(|e| HvError::storage_by(vm, "delete_disks", "", e))?;
        let _vm = self.lock_vm(vm).await;
        // Refuse rather than pull disks from under a running guest.
        let live: Vec<String> = self
            .domains_of(vm)
            .await
            .map_err(|e| {
                HvError::storage_by(vm, "delete_disks", "cannot prove no instance is live", e)
            })?
            .into_iter()
            .filter(|d| !d.state.is_exited())
            .map(|d| d.instance)
            .collect();
        if !live.is_empty() {
            return Err(storage(format!(
                "instances still live: {}",
                live.join(", ")
            )));
        }
        // Whole disk images: can take long, and on shared storage longer.
        let dir = self.inner.layout.vm_disks(vm);
        let listed = dir.clone();
        let disks_dir = self.inner.layout.disks_dir();
        let (overlays, clone_bases) = blocking::unblocked("find the VM's overlays", move || {
            Ok((
                super::disks::overlays_in(&listed),
                super::linked_clone::bases_of(&disks_dir, &listed),
            ))
        })
        .await
        .map_err(|e| {
            HvError::storage_by(vm, "delete_disks", format!("look at {}", dir.display()), e)
        })?;
        blocking::remove_dir_all(dir.clone()).await.map_err(|e| {
            HvError::storage_by(vm, "delete_disks", format!("remove {}", dir.display()), e)
        })?;
        // Only once its overlays are gone: a linked clone's base no clone
        // notes any more goes with its last one.
        let released = vm.to_string();
        if let Err(e) = blocking::unblocked("release linked clones' bases", move || {
            super::linked_clone::release(&released, &clone_bases)
        })
        .await
        {
            tracing::warn!(vm, error = %e, "could not release the bases of the VM's linked-clone disks");
        }
        // Only once the overlays are gone: a note outliving its overlay is
        // dropped by the next image delete that finds it gone.
        let driver = self.clone();
        let forgotten = blocking::unblocked("forget the VM's overlays", move || {
            for (disk, base) in overlays {
                driver.inner.images.forget_overlay(&base, &disk)?;
            }
            Ok(())
        })
        .await;
        if let Err(e) = forgotten {
            tracing::warn!(vm, error = %e, "could not drop the image store's notes of the VM's deleted disks");
        }
        Ok(())
    }
}
