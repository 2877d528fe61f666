//! Disk snapshots: qcow2 internal snapshots, the same name on every disk of
//! a VM.
//!
//! Internal rather than external (overlay) snapshots because the snapshot
//! then lives inside the image: it moves, is shared (migration) and is
//! deleted with the disk, adds no files or backing chains to the disk dir,
//! and a restore is `qemu-img snapshot -a` with nothing to rebase.
//!
//! Offline (no live instance of the VM on this node) `qemu-img snapshot`
//! does the work. It takes the image lock, so a QEMU using the image (this
//! host, or another one where the shared storage carries the locks) makes
//! it fail rather than write under a running guest.
//!
//! Live, QEMU owns the images and QMP does it: `stop`, then per disk
//! `blockdev-snapshot-internal-sync` (the disk's `-drive id=diskN`, which is
//! its block backend name), then `cont`. Pausing makes the disks one
//! consistent set: no guest write lands between two disks' snapshots. The
//! guest's vCPUs stop for as long as the metadata updates take
//! (milliseconds); its wall clock then jumps. `cont` is sent whatever
//! happened in between.
//!
//! Consistency under retries: a name counts as taken only when every disk
//! has it. A partial set, left by an attempt that failed midway, is deleted
//! and taken again, never completed: disks snapshotted at different moments
//! do not form a consistent snapshot. An attempt that fails deletes what it
//! created.
//!
//! A guest paused for a snapshot is marked (`snapshot-paused`, written before
//! `stop`, removed after `cont`): if Keel dies in between, the next driver
//! resumes the guest when it adopts the instance.

pub(super) mod uefi_vars;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;

use keel_api::{validate_name, DiskSpec};
use serde_json::json;

use super::migration::{query_migrate, read_outgoing, Stage};
use super::monitor::Domain;
use super::opts::opt_escape;
use super::qmp::{QmpClient, QmpError};
use super::query_block::{BlockInfo, ImageInfo};
use super::{blocking, unavailable, QemuDriver};
use crate::{DomainState, HvError, Hypervisor};
use uefi_vars::VarsStore;

/// A disk as a live QEMU has it: its block backend name and snapshots.
struct Attached {
    device: String,
    image: ImageInfo,
}

/// Image file path -> what QEMU has open there.
fn attached(blocks: Vec<BlockInfo>) -> BTreeMap<PathBuf, Attached> {
    blocks
        .into_iter()
        .filter_map(|b| {
            let device = b.name()?.to_string();
            let inserted = b.inserted?;
            Some((
                PathBuf::from(inserted.file),
                Attached {
                    device,
                    image: inserted.image,
                },
            ))
        })
        .collect()
}

/// How a VM's disks are reached right now.
enum Access {
    /// No instance on this node has them open.
    Offline,
    /// This instance's QEMU has them open and active.
    Live(Arc<Domain>),
}

#[derive(Debug, Clone, Copy)]
enum ImgOp {
    Create,
    Apply,
    Delete,
}

impl ImgOp {
    fn flag(self) -> &'static str {
        match self {
            ImgOp::Create => "-c",
            ImgOp::Apply => "-a",
            ImgOp::Delete => "-d",
        }
    }
}

/// Why a `qemu-img` run failed.
enum ImgError {
    /// Another process (a QEMU, here or on another node) holds the image.
    Locked(String),
    Other(String),
}

impl ImgError {
    fn into_hv(self, vm: &str, op: &'static str, what: String) -> HvError {
        match self {
            // Transient: the holder may be a QEMU that is exiting. The VM
            // stands in for the instance, which is not known here.
            ImgError::Locked(reason) => HvError::Unavailable {
                instance: vm.to_string(),
                op,
                reason: format!("VM {vm}: {what}: image in use by another process: {reason}"),
                source: None,
            },
            ImgError::Other(reason) => HvError::Storage {
                vm: vm.to_string(),
                op,
                reason: format!("{what}: {reason}"),
                source: None,
            },
        }
    }
}

/// A step on snapshot `name`'s copy of `vm`'s UEFI variables failed.
fn uefi_vars_failed(vm: &str, op: &'static str, name: &str, e: std::io::Error) -> HvError {
    HvError::storage_by(vm, op, format!("snapshot {name} of the UEFI variables"), e)
}

fn storage(vm: &str, op: &'static str, reason: String) -> HvError {
    HvError::Storage {
        vm: vm.to_string(),
        op,
        reason,
        source: None,
    }
}

/// Errors from a live QEMU: a refused command is a storage failure (no
/// space, a corrupt image); no answer says nothing, so it is unavailable.
fn qmp_failure(instance: &str, vm: &str, op: &'static str, what: String, e: QmpError) -> HvError {
    match e {
        QmpError::Command { .. } => HvError::storage_by(vm, op, what, e),
        _ => HvError::unavailable_by(instance, op, format!("VM {vm}: {what}"), e),
    }
}

fn validate(vm: &str, disks: &[DiskSpec], name: &str, op: &'static str) -> Result<(), HvError> {
    let invalid = |e: keel_api::ValidationError| HvError::storage_by(vm, op, "", e);
    validate_name("vm", vm).map_err(invalid)?;
    // Also keeps the name from being read as an option by qemu-img.
    validate_name("snapshot", name).map_err(invalid)?;
    for disk in disks {
        validate_name("disk", &disk.name).map_err(invalid)?;
    }
    Ok(())
}

impl QemuDriver {
    /// `qemu-img <args>`, bounded by `storage_timeout`; stdout on success.
    async fn qemu_img(&self, args: &[String]) -> Result<Vec<u8>, ImgError> {
        let config = &self.inner.config;
        let mut cmd = tokio::process::Command::new(&config.qemu_img);
        let run = crate::unprivileged::without_capabilities(&mut cmd)
            .args(args)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output();
        let out = match tokio::time::timeout(config.storage_timeout, run).await {
            Err(_) => {
                return Err(ImgError::Other(format!(
                    "qemu-img {} did not finish within {:?}",
                    args.join(" "),
                    config.storage_timeout
                )))
            }
            Ok(Err(e)) => {
                return Err(ImgError::Other(format!(
                    "run {}: {e}",
                    config.qemu_img.display()
                )))
            }
            Ok(Ok(out)) => out,
        };
        if out.status.success() {
            return Ok(out.stdout);
        }
        let stderr = String::from_utf8_lossy(&out.stderr)
            .trim()
            .replace('\n', " ");
        // qemu-img exits 1 for everything; its lock message is the only
        // way to tell "in use" from a real failure.
        if stderr.contains("Failed to get") && stderr.contains("lock") {
            Err(ImgError::Locked(stderr))
        } else {
            Err(ImgError::Other(format!(
                "qemu-img {} ({}): {stderr}",
                args.join(" "),
                out.status
            )))
        }
    }

    /// The image's snapshots. Takes the image lock like any qemu-img open
    /// (no `-U`): an image in use is reported as such.
    async fn image_info(&self, disk: &Path) -> Result<ImageInfo, ImgError> {
        let out = self
            .qemu_img(&[
                "info".into(),
                "--output=json".into(),
                "-f".into(),
                "qcow2".into(),
                disk.to_string_lossy().into_owned(),
            ])
            .await?;
        serde_json::from_slice(&out)
            .map_err(|e| ImgError::Other(format!("qemu-img info {}: {e}", disk.display())))
    }

    async fn img_snapshot(&self, op: ImgOp, name: &str, disk: &Path) -> Result<(), ImgError> {
        // --image-opts names the format: the image is never probed.
        let image = format!(
            "driver=qcow2,file.driver=file,file.filename={}",
            opt_escape(disk)
        );
        self.qemu_img(&[
            "snapshot".into(),
            "-q".into(),
            "--image-opts".into(),
            op.flag().into(),
            name.into(),
            image,
        ])
        .await
        .map(drop)
    }

    /// Who has the VM's disks open. `instance` is the caller's idea of the
    /// live instance; the node's own list is checked too, so disks are
    /// never changed by qemu-img under a QEMU of this node.
    async fn disk_access(
        &self,
        vm: &str,
        instance: Option<&str>,
        op: &'static str,
    ) -> Result<Access, HvError> {
        if let Some(instance) = instance {
            match self.existing(instance, op) {
                Ok(domain) if domain.vm != vm => {
                    return Err(storage(
                        vm,
                        op,
                        format!("instance {instance} runs VM {}, not {vm}", domain.vm),
                    ))
                }
                Ok(domain) => match domain.state().await? {
                    DomainState::Running | DomainState::Paused => return Ok(Access::Live(domain)),
                    DomainState::Starting => {
                        return Err(unavailable(
                            instance,
                            op,
                            format!("VM {vm}: instance is not running yet"),
                        ))
                    }
                    // Gone since the caller looked: see what else runs.
                    DomainState::Exited(_) => {}
                },
                Err(HvError::NotFound { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        let live: Vec<_> = self
            .domains_of(vm)
            .await?
            .into_iter()
            .filter(|d| !d.state.is_exited())
            .collect();
        let executing: Vec<_> = live
            .iter()
            .filter(|d| matches!(d.state, DomainState::Running | DomainState::Paused))
            .collect();
        match (executing.as_slice(), live.first()) {
            ([one], _) => Ok(Access::Live(self.existing(&one.instance, op)?)),
            ([], None) => Ok(Access::Offline),
            // Only a target waiting for an incoming migration (or a guest
            // still launching): its images are inactive, and the guest's
            // real writer may be a source on another node.
            ([], Some(starting)) => Err(unavailable(
                &starting.instance,
                op,
                format!("VM {vm}: instance is not running yet"),
            )),
            (many, _) => Err(storage(
                vm,
                op,
                format!(
                    "several live instances: {}",
                    many.iter()
                        .map(|d| d.instance.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )),
        }
    }

    pub(super) async fn take_snapshot(
        &self,
        vm: &str,
        disks: &[DiskSpec],
        instance: Option<&str>,
        name: &str,
    ) -> Result<(), HvError> {
        const OP: &str = "snapshot";
        validate(vm, disks, name, OP)?;
        let _vm = self.lock_vm(vm).await;
        match self.disk_access(vm, instance, OP).await? {
            Access::Offline => self.snapshot_offline(vm, disks, name).await,
            Access::Live(domain) => self.snapshot_live(vm, disks, &domain, name).await,
        }
    }

    async fn snapshot_offline(
        &self,
        vm: &str,
        disks: &[DiskSpec],
        name: &str,
    ) -> Result<(), HvError> {
        const OP: &str = "snapshot";
        // A VM that never ran has no images yet; `start` would create them
        // blank, and the snapshot of blank disks is what the VM holds. A
        // disk made from an image is not made here: without the image's
        // verified record that fails, naming it.
        let paths = self
            .ensure_disks(vm, disks, &crate::DiskCreation::all_of(disks), &[], None)
            .await
            .map_err(|e| storage(vm, OP, format!("snapshot {name}: {e}")))?;
        let what = |disk: &DiskSpec| format!("snapshot {name} of disk {}", disk.name);
        let mut has = Vec::with_capacity(paths.len());
        for (disk, path) in disks.iter().zip(&paths) {
            let info = self
                .image_info(path)
                .await
                .map_err(|e| e.into_hv(vm, OP, what(disk)))?;
            has.push(info.has(name));
        }
        if has.iter().all(|h| *h) {
            tracing::debug!(vm, snapshot = name, "snapshot already taken");
            return Ok(());
        }
        for ((disk, path), _) in disks.iter().zip(&paths).zip(&has).filter(|(_, h)| **h) {
            tracing::info!(vm, snapshot = name, disk = %disk.name, "removing a partial snapshot before retaking it");
            self.img_snapshot(ImgOp::Delete, name, path)
                .await
                .map_err(|e| e.into_hv(vm, OP, what(disk)))?;
        }
        let vars = self.uefi_vars(vm);
        let saved = name.to_string();
        vars.step(move |v| v.save(&saved))
            .await
            .map_err(|e| uefi_vars_failed(vm, OP, name, e))?;
        for (i, (disk, path)) in disks.iter().zip(&paths).enumerate() {
            if let Err(e) = self.img_snapshot(ImgOp::Create, name, path).await {
                for undo in &paths[..i] {
                    let _ = self.img_snapshot(ImgOp::Delete, name, undo).await;
                }
                let removed = name.to_string();
                let _ = vars.step(move |v| v.remove(&removed)).await;
                return Err(e.into_hv(vm, OP, what(disk)));
            }
        }
        tracing::info!(
            vm,
            snapshot = name,
            disks = disks.len(),
            "offline snapshot taken"
        );
        Ok(())
    }

    /// Refuses while `domain` is sending itself to another node: pausing and
    /// resuming it could resume a source that already handed over (`cont`
    /// re-activates its images under the target), and its images become
    /// inactive at the switch-over. Called under the VM lock, which
    /// `migrate` also takes, so no migration starts until the caller is done.
    async fn ensure_not_migrating(
        &self,
        domain: &Domain,
        client: &QmpClient,
        op: &'static str,
    ) -> Result<(), HvError> {
        let instance = &domain.instance;
        if read_outgoing(&domain.paths, instance, op)?.is_none() {
            return Ok(());
        }
        let info = query_migrate(client)
            .await
            .map_err(|e| unavailable(instance, op, e.to_string()))?;
        match info.stage() {
            Stage::Idle | Stage::Failed(_) => Ok(()),
            Stage::Active | Stage::Completed => Err(unavailable(
                instance,
                op,
                format!(
                    "VM {}: instance is being migrated to another node",
                    domain.vm
                ),
            )),
        }
    }

    async fn snapshot_live(
        &self,
        vm: &str,
        disks: &[DiskSpec],
        domain: &Domain,
        name: &str,
    ) -> Result<(), HvError> {
        const OP: &str = "snapshot";
        let instance = domain.instance.as_str();
        let client = domain
            .qmp()
            .await
            .map_err(|e| unavailable(instance, OP, e))?;
        let fail = |what: String, e: QmpError| qmp_failure(instance, vm, OP, what, e);
        // An earlier attempt (or Keel) may have died with the guest paused.
        resume_if_left_paused(domain, &client)
            .await
            .map_err(|e| fail(format!("resume after an interrupted snapshot {name}"), e))?;
        self.ensure_not_migrating(domain, &client, OP).await?;

        let blocks = self
            .query_block(&client)
            .await
            .map_err(|e| fail(format!("snapshot {name}: query-block"), e))?;
        let mut devices = Vec::with_capacity(disks.len());
        for disk in disks {
            let path = self.inner.layout.disk(vm, &disk.name);
            let Some(a) = blocks.get(&path) else {
                return Err(storage(
                    vm,
                    OP,
                    format!(
                        "snapshot {name}: disk {} ({}) is not attached to instance {instance}",
                        disk.name,
                        path.display()
                    ),
                ));
            };
            devices.push((disk, a.device.clone(), a.image.has(name)));
        }
        if devices.iter().all(|(_, _, has)| *has) {
            tracing::debug!(vm, snapshot = name, "snapshot already taken");
            return Ok(());
        }

        let status = client
            .query_status()
            .await
            .map_err(|e| fail(format!("snapshot {name}: query-status"), e))?;
        // A guest that is paused already (not by us) stays paused.
        let pause = status.status == "running";
        if pause {
            tokio::fs::write(&domain.paths.snapshot_paused, format!("{name}\n"))
                .await
                .map_err(|e| {
                    unavailable(instance, OP, format!("VM {vm}: write pause marker: {e}"))
                })?;
            if let Err(e) = client.execute("stop", None).await {
                // Not paused (or unknown): resume to be sure, then give up.
                let _ = client.execute("cont", None).await;
                let _ = blocking::remove_file(domain.paths.snapshot_paused.clone()).await;
                return Err(fail(format!("snapshot {name}: stop"), e));
            }
        }
        // With the guest paused, like the disks: one consistent set.
        let vars = self.uefi_vars(vm);
        let saved = name.to_string();
        let vars_saved = vars.step(move |v| v.save(&saved)).await;
        let taken = match &vars_saved {
            Ok(_) => self.snapshot_devices(&client, &devices, name).await,
            Err(_) => Ok(()),
        };
        if taken.is_err() {
            let removed = name.to_string();
            let _ = vars.step(move |v| v.remove(&removed)).await;
        }
        let resumed = if pause {
            client.execute("cont", None).await.map(drop)
        } else {
            Ok(())
        };
        match &resumed {
            Ok(()) => {
                let _ = blocking::remove_file(domain.paths.snapshot_paused.clone()).await;
            }
            // The marker stays: the next snapshot call, or the next driver
            // adopting the instance, resumes it.
            Err(e) => tracing::error!(
                instance,
                vm,
                snapshot = name,
                "guest left paused: cont failed: {e}"
            ),
        }
        if let Err(e) = vars_saved {
            return Err(storage(
                vm,
                OP,
                format!("snapshot {name} of the UEFI variables: {e}"),
            ));
        }
        match (taken, resumed) {
            (Err((disk, e)), _) => Err(fail(format!("snapshot {name} of disk {disk}"), e)),
            (Ok(()), Err(e)) => Err(unavailable(
                instance,
                OP,
                format!("VM {vm}: snapshot {name} taken, but resuming the guest failed: {e}"),
            )),
            (Ok(()), Ok(())) => {
                tracing::info!(
                    vm,
                    instance,
                    snapshot = name,
                    disks = disks.len(),
                    "live snapshot taken"
                );
                Ok(())
            }
        }
    }

    /// With the guest paused: replaces any partial set by a complete one.
    /// On failure deletes what it created; the error names the disk.
    async fn snapshot_devices(
        &self,
        client: &QmpClient,
        devices: &[(&DiskSpec, String, bool)],
        name: &str,
    ) -> Result<(), (String, QmpError)> {
        let timeout = self.inner.config.storage_timeout;
        let args = |device: &str| Some(json!({ "device": device, "name": name }));
        for (disk, device, _) in devices.iter().filter(|(_, _, has)| *has) {
            client
                .execute_within(
                    "blockdev-snapshot-delete-internal-sync",
                    args(device),
                    timeout,
                )
                .await
                .map_err(|e| (disk.name.clone(), e))?;
        }
        for (i, (disk, device, _)) in devices.iter().enumerate() {
            if let Err(e) = client
                .execute_within("blockdev-snapshot-internal-sync", args(device), timeout)
                .await
            {
                for (_, undo, _) in &devices[..i] {
                    let _ = client
                        .execute_within(
                            "blockdev-snapshot-delete-internal-sync",
                            args(undo),
                            timeout,
                        )
                        .await;
                }
                return Err((disk.name.clone(), e));
            }
        }
        Ok(())
    }

    async fn query_block(
        &self,
        client: &QmpClient,
    ) -> Result<BTreeMap<PathBuf, Attached>, QmpError> {
        let value = client.execute("query-block", None).await?;
        let blocks: Vec<BlockInfo> = serde_json::from_value(value)
            .map_err(|e| QmpError::Protocol(format!("query-block result: {e}")))?;
        Ok(attached(blocks))
    }

    pub(super) async fn apply_snapshot(
        &self,
        vm: &str,
        disks: &[DiskSpec],
        name: &str,
    ) -> Result<(), HvError> {
        const OP: &str = "restore";
        validate(vm, disks, name, OP)?;
        let _vm = self.lock_vm(vm).await;
        // Never under a running guest: it would keep its cached view of a
        // disk that changed beneath it.
        let live: Vec<String> = self
            .domains_of(vm)
            .await
            .map_err(|e| {
                storage(
                    vm,
                    OP,
                    format!("snapshot {name}: cannot prove no instance is live: {e}"),
                )
            })?
            .into_iter()
            .filter(|d| !d.state.is_exited())
            .map(|d| d.instance)
            .collect();
        if !live.is_empty() {
            return Err(storage(
                vm,
                OP,
                format!(
                    "snapshot {name}: refusing to restore, instances live: {}",
                    live.join(", ")
                ),
            ));
        }
        // Every disk is checked before any is touched: a snapshot missing
        // on one disk fails the restore with all disks as they were.
        let mut paths = Vec::with_capacity(disks.len());
        for disk in disks {
            let path = self.inner.layout.disk(vm, &disk.name);
            let what = format!("snapshot {name} of disk {}", disk.name);
            if !is_file(&path).await {
                return Err(storage(
                    vm,
                    OP,
                    format!("{what}: disk image {} does not exist", path.display()),
                ));
            }
            if let Some(image) = &disk.image {
                if let Some(gone) = gone_base(&path).await {
                    return Err(storage(
                        vm,
                        OP,
                        format!(
                            "{what}: the disk was made on {}, a file of image {image} that is \
                             gone (the image was deleted); a file imported under that name \
                             since is other content, so the disk is not restored onto it",
                            gone.display()
                        ),
                    ));
                }
            }
            let info = self
                .image_info(&path)
                .await
                .map_err(|e| e.into_hv(vm, OP, what.clone()))?;
            if !info.has(name) {
                return Err(storage(
                    vm,
                    OP,
                    format!("{what}: no such snapshot on this disk"),
                ));
            }
            paths.push((disk, path));
        }
        for (disk, path) in &paths {
            self.img_snapshot(ImgOp::Apply, name, path)
                .await
                .map_err(|e| e.into_hv(vm, OP, format!("snapshot {name} of disk {}", disk.name)))?;
        }
        let restored = name.to_string();
        let vars = self
            .uefi_vars(vm)
            .step(move |v| v.restore(&restored))
            .await
            .map_err(|e| uefi_vars_failed(vm, OP, name, e))?;
        tracing::info!(
            vm,
            snapshot = name,
            disks = disks.len(),
            uefi_vars = vars,
            "disks restored"
        );
        Ok(())
    }

    pub(super) async fn remove_snapshot(
        &self,
        vm: &str,
        disks: &[DiskSpec],
        name: &str,
    ) -> Result<(), HvError> {
        const OP: &str = "delete snapshot";
        validate(vm, disks, name, OP)?;
        let _vm = self.lock_vm(vm).await;
        let live = match self.disk_access(vm, None, OP).await? {
            Access::Offline => None,
            Access::Live(domain) => {
                let client = domain
                    .qmp()
                    .await
                    .map_err(|e| unavailable(&domain.instance, OP, e))?;
                self.ensure_not_migrating(&domain, &client, OP).await?;
                let blocks = self.query_block(&client).await.map_err(|e| {
                    qmp_failure(
                        &domain.instance,
                        vm,
                        OP,
                        format!("snapshot {name}: query-block"),
                        e,
                    )
                })?;
                Some((domain, client, blocks))
            }
        };
        for disk in disks {
            let path = self.inner.layout.disk(vm, &disk.name);
            let what = format!("snapshot {name} of disk {}", disk.name);
            match live
                .as_ref()
                .and_then(|(d, c, blocks)| Some((d, c, blocks.get(&path)?)))
            {
                Some((domain, client, attached)) => {
                    if !attached.image.has(name) {
                        continue;
                    }
                    client
                        .execute_within(
                            "blockdev-snapshot-delete-internal-sync",
                            Some(json!({ "device": attached.device, "name": name })),
                            self.inner.config.storage_timeout,
                        )
                        .await
                        .map_err(|e| qmp_failure(&domain.instance, vm, OP, what, e))?;
                }
                // Offline, or not attached to the live instance.
                None => {
                    if !is_file(&path).await {
                        continue;
                    }
                    let info = self
                        .image_info(&path)
                        .await
                        .map_err(|e| e.into_hv(vm, OP, what.clone()))?;
                    if info.has(name) {
                        self.img_snapshot(ImgOp::Delete, name, &path)
                            .await
                            .map_err(|e| e.into_hv(vm, OP, what))?;
                    }
                }
            }
        }
        let removed = name.to_string();
        self.uefi_vars(vm)
            .step(move |v| v.remove(&removed))
            .await
            .map_err(|e| uefi_vars_failed(vm, OP, name, e))?;
        tracing::info!(
            vm,
            snapshot = name,
            live = live.is_some(),
            "snapshot deleted"
        );
        Ok(())
    }
}

impl QemuDriver {
    fn uefi_vars(&self, vm: &str) -> VarsStore {
        VarsStore::of(&self.inner.layout.vm_disks(vm))
    }
}

impl VarsStore {
    /// One step on the store (copies and fsyncs in the disk dir), on the
    /// blocking pool.
    async fn step<T: Send + 'static>(
        &self,
        step: impl FnOnce(&VarsStore) -> std::io::Result<T> + Send + 'static,
    ) -> std::io::Result<T> {
        let vars = self.clone();
        blocking::unblocked("UEFI variable store", move || step(&vars)).await
    }
}

/// Whether `path` is a file, asked off the async threads (disks may be
/// on shared storage). An error reads as "no".
/// The backing file `disk` names, if it names one that does not exist.
async fn gone_base(disk: &Path) -> Option<PathBuf> {
    let disk = disk.to_path_buf();
    let backing = tokio::task::spawn_blocking(move || crate::qcow2::backing_file(&disk))
        .await
        .ok()?
        .ok()??;
    (!is_file(&backing).await).then_some(backing)
}

async fn is_file(path: &Path) -> bool {
    tokio::fs::metadata(path).await.is_ok_and(|m| m.is_file())
}

/// `cont` for a guest this module paused and did not get to resume.
/// Only a guest still `paused` is resumed: one that is, say, `postmigrate`
/// must never be.
async fn resume_if_left_paused(domain: &Domain, client: &QmpClient) -> Result<(), QmpError> {
    if !is_file(&domain.paths.snapshot_paused).await {
        return Ok(());
    }
    if client.query_status().await?.status == "paused" {
        client.execute("cont", None).await?;
        tracing::warn!(instance = %domain.instance, "resumed a guest an interrupted snapshot left paused");
    }
    let _ = blocking::remove_file(domain.paths.snapshot_paused.clone()).await;
    Ok(())
}

/// On adoption: a previous Keel paused this guest for a snapshot and died
/// before resuming it. Resumed in the background once QMP is connected.
pub(super) fn resume_left_paused(domain: Arc<Domain>) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        match domain.qmp().await {
            Ok(client) => {
                if let Err(e) = resume_if_left_paused(&domain, &client).await {
                    tracing::error!(instance = %domain.instance, "cannot resume guest paused by an interrupted snapshot: {e}");
                }
            }
            Err(e) => tracing::error!(instance = %domain.instance, "cannot resume guest paused by an interrupted snapshot: {e}"),
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_block_maps_files_to_devices_and_snapshots() {
        let blocks: Vec<BlockInfo> = serde_json::from_value(json!([
            {"device": "disk0", "locked": false, "inserted": {
                "file": "/d/web/data.qcow2", "node-name": "#block190", "ro": false,
                "image": {"filename": "/d/web/data.qcow2", "format": "qcow2",
                          "snapshots": [{"name": "s1", "id": "1", "vm-state-size": 0}]}}},
            {"device": "disk1", "inserted": {"file": "/d/web/logs.qcow2", "image": {"format": "qcow2"}}},
            {"device": "cd0", "removable": true}
        ]))
        .unwrap();
        let map = attached(blocks);
        assert_eq!(map.len(), 2);
        let data = &map[Path::new("/d/web/data.qcow2")];
        assert_eq!(data.device, "disk0");
        assert!(data.image.has("s1") && !data.image.has("s2"));
        assert!(!map[Path::new("/d/web/logs.qcow2")].image.has("s1"));
    }

    #[test]
    fn names_that_could_be_options_are_refused() {
        let disks = [DiskSpec {
            name: "data".into(),
            size_mib: 1,
            image: None,
        }];
        assert!(validate("web", &disks, "s1", "snapshot").is_ok());
        for bad in ["-l", "", "S1", "a/b"] {
            let err = validate("web", &disks, bad, "snapshot").unwrap_err();
            assert!(
                matches!(&err, HvError::Storage { vm, .. } if vm == "web"),
                "{err:?}"
            );
        }
    }
}
