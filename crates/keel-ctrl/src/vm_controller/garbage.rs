//! Garbage collection on this node: domains no VM record or migration in
//! flight accounts for, and the migration records that are done.

use crate::keys::{migration_key, migrations_of_prefix, vm_key, MIGRATIONS_PREFIX};
use keel_api::{Migration, MigrationPhase, VirtualMachine};
use keel_store::StoreError;

use super::VmController;
use crate::error::ReconcileError;

impl VmController {
    /// Ends domains on this node that no VM record (and no migration in
    /// flight) accounts for: the source of a finished migration, the target
    /// of an abandoned one, instances of VMs now owned elsewhere. Killing an
    /// extra instance is always safe; the recorded one is never touched.
    pub async fn collect_garbage(&self) -> Result<(), ReconcileError> {
        self.end_stray_domains().await?;
        self.collect_migrations().await
    }

    /// Deletes final migration records beyond the last few of each VM this
    /// node owns (`migrations_to_collect`), and every final one of a VM
    /// whose record is gone. Each delete is a compare-and-swap on the
    /// revision read, so a record that changed meanwhile stays.
    async fn collect_migrations(&self) -> Result<(), ReconcileError> {
        let store_err = |source| ReconcileError::Store {
            vm: String::new(),
            source,
        };
        let (all, _) = self
            .store
            .list::<Migration>(MIGRATIONS_PREFIX)
            .await
            .map_err(store_err)?;
        let mut by_vm: std::collections::BTreeMap<&str, Vec<&keel_store::TypedEntry<Migration>>> =
            Default::default();
        for (_, entry) in &all {
            by_vm
                .entry(entry.value.vm.as_str())
                .or_default()
                .push(entry);
        }
        for (name, entries) in by_vm {
            let record = self
                .store
                .get::<VirtualMachine>(&vm_key(name))
                .await
                .map_err(store_err)?
                .map(|e| e.value);
            if record
                .as_ref()
                .is_some_and(|vm| vm.owner_node() != Some(self.cfg.node.as_str()))
            {
                continue;
            }
            let migrations: Vec<Migration> = entries.iter().map(|e| e.value.clone()).collect();
            for id in crate::evict_decide::migrations_to_collect(record.as_ref(), &migrations) {
                let Some(entry) = entries.iter().find(|e| e.value.id == id) else {
                    continue;
                };
                match self
                    .store
                    .delete(&migration_key(name, &id), entry.revision)
                    .await
                {
                    Ok(_) | Err(StoreError::Conflict { .. }) => {}
                    Err(source) => return Err(store_err(source)),
                }
            }
        }
        Ok(())
    }

    async fn end_stray_domains(&self) -> Result<(), ReconcileError> {
        let listing = match self.hv.list().await {
            Ok(listing) => listing,
            Err(err) => {
                tracing::debug!(err = %crate::error_chain(&err), "garbage collection: cannot list domains");
                return Ok(());
            }
        };
        // A domain nobody can read is neither ended nor cleaned up: it may
        // be the recorded instance, or one mid-handover. The others go on.
        for u in &listing.unknown {
            tracing::debug!(instance = %u.instance, err = %u.error,
                "garbage collection: domain state unknown, left alone");
        }
        for d in listing.domains {
            // The recorded instance, as the index has it: the usual case,
            // answered without a read per domain on every pass. Anything
            // else is read afresh before a domain is ended.
            let recorded_here = self.vm_index.read(|index| {
                index
                    .get(&d.vm)
                    .and_then(|v| v.vm.status.instance.as_ref())
                    .is_some_and(|inst| inst.id == d.instance)
            });
            if recorded_here == Some(true) {
                continue;
            }
            let store_err = |source| ReconcileError::Store {
                vm: d.vm.clone(),
                source,
            };
            let record = self
                .store
                .get::<VirtualMachine>(&vm_key(&d.vm))
                .await
                .map_err(store_err)?
                .map(|e| e.value);
            let owner_adopts = match &record {
                Some(vm) => match &vm.status.instance {
                    Some(inst) if inst.id == d.instance => continue,
                    Some(_) => false,
                    // The owner adopts or cleans up its own untracked domains.
                    None => {
                        vm.owner_node() == Some(self.cfg.node.as_str()) || vm.owner_node().is_none()
                    }
                },
                None => false,
            };
            let migrations = self
                .store
                .list_with_skipped::<Migration>(&migrations_of_prefix(&d.vm))
                .await
                .map_err(store_err)?;
            // ...but not the target of a failed migration, which never got
            // the guest: the owner neither adopts it nor starts beside it.
            let failed_target = migrations.entries.iter().any(|(_, m)| {
                m.value.target_instance == d.instance
                    && m.value.status.phase == MigrationPhase::Failed
            });
            if owner_adopts && !failed_target {
                continue;
            }
            // An undecodable migration may be the one this domain serves.
            if !migrations.skipped.is_empty() {
                continue;
            }
            let migrations = migrations.entries;
            let recorded = record
                .as_ref()
                .and_then(|vm| vm.status.instance.as_ref())
                .map(|i| i.id.as_str());
            let in_flight = migrations.iter().any(|(_, m)| {
                let m = &m.value;
                let involved = m.target_instance == d.instance || m.source_instance == d.instance;
                // A succeeded migration whose VM record still names the
                // source is mid-handover: the target is about to be recorded.
                let handing_over = m.status.phase == MigrationPhase::Succeeded
                    && recorded == Some(m.source_instance.as_str());
                involved && (!m.status.phase.is_final() || handing_over)
            });
            if in_flight {
                continue;
            }
            let result = if d.state.is_exited() {
                self.hv.cleanup(&d.instance).await
            } else {
                tracing::info!(vm = %d.vm, instance = %d.instance, "ending unaccounted domain");
                self.hv.kill(&d.instance).await
            };
            if let Err(err) = result {
                if !err.is_not_found() {
                    tracing::warn!(vm = %d.vm, instance = %d.instance, err = %crate::error_chain(&err), "garbage collection");
                }
            }
        }
        Ok(())
    }
}
