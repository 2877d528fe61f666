//! Starting an instance: validate the spec, reserve the name, claim the
//! instance directory atomically, spawn QEMU (directly or under a fence
//! keeper) in its own session, wait for QMP, and roll everything back if
//! any step fails.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_api::{validate_name, Accelerator, Clock, SystemClock};

use super::layout::{self, rename_noreplace, InstancePaths, LaunchPlan, LaunchRecord, PluggedPath};
use super::monitor::{Domain, Phase, ProcessWatch};
use super::proc::{self, PidFd};
use super::qmp::{QmpClient, QmpEvent};
use super::{blocking, boot, cloud_init, keeper, network, passt, tpm, QemuDriver};
use crate::{DomainSpec, HvError, IncomingParams};

impl QemuDriver {
    fn plan(
        &self,
        accelerator: Accelerator,
        spec: &DomainSpec,
        disks: Vec<PathBuf>,
        images: &[(keel_api::Image, PathBuf)],
    ) -> Result<LaunchPlan, HvError> {
        let failed = |reason: String| HvError::Failed {
            instance: spec.instance.clone(),
            op: "start",
            reason,
            source: None,
        };
        let config = &self.inner.config;
        let nic = Some(
            network::NicPlan::new(&spec.vm, &spec.instance, &spec.network)
                .map_err(|e| HvError::failed_by(&spec.instance, "start", "", e))?,
        );
        let seed = spec
            .cloud_init
            .as_ref()
            .map(|_| self.inner.layout.new_instance(&spec.instance).seed);
        let defaults = boot::BootDefaults {
            kernel: config.default_kernel.as_deref(),
            initrd: config.default_initrd.as_deref(),
            cmdline: &config.default_cmdline,
            ovmf_code: &config.ovmf_code,
            ovmf_code_secure: &config.ovmf_code_secure,
        };
        let vars = self.inner.layout.vm_disks(&spec.vm).join(boot::UEFI_VARS);
        let boot = boot::plan(spec, images, &defaults, &vars).map_err(failed)?;
        // The recorded hardware, or nothing started rather than a guest
        // on other hardware than its own.
        if let Some(hw) = &spec.hardware {
            if let Some(why) = self.inner.catalog.offered(Some(accelerator)).lacks(hw) {
                return Err(failed(format!(
                    "this node cannot run the VM's hardware ({} with CPU {}): {why}",
                    hw.machine, hw.cpu_model
                )));
            }
        }
        let machine = spec
            .hardware
            .as_ref()
            .map_or_else(|| config.machine.clone(), |hw| hw.machine.clone());
        if boot.uefi().is_some_and(|u| u.secure) {
            if let Some(why) = super::secure_boot::machine_refused(&machine) {
                return Err(failed(why));
            }
        }
        // A plugged disk (a migration target's) sits on its root port; the
        // others are on the root complex, in the spec's order.
        let (plugged, disks): (Vec<_>, Vec<_>) = spec
            .disks
            .iter()
            .zip(disks)
            .partition(|(d, _)| spec.plugged.iter().any(|p| p.disk == d.name));
        let plugged = plugged
            .into_iter()
            .map(|(d, path)| PluggedPath {
                disk: d.name.clone(),
                port: spec
                    .plugged
                    .iter()
                    .find(|p| p.disk == d.name)
                    .expect("partitioned by it")
                    .port,
                path,
            })
            .collect();
        let disks = disks.into_iter().map(|(_, path)| path).collect();
        let paths = self.inner.layout.new_instance(&spec.instance);
        let tpm = spec
            .tpm
            .map(|_| tpm::TpmPlan::new(&self.inner.layout.vm_disks(&spec.vm), &paths.sockets));
        Ok(LaunchPlan {
            instance: spec.instance.clone(),
            paths,
            tpm,
            accelerator,
            hotplug_ports: if super::hotplug::is_q35(&machine) {
                spec.hotplug_ports
            } else {
                0
            },
            plugged,
            machine,
            cpu_model: spec.hardware.as_ref().map(|hw| hw.cpu_model.clone()),
            cpus: spec.cpus,
            memory_mib: spec.memory_mib,
            boot,
            disks,
            incoming: false,
            nic,
            seed,
            direct_io: self.inner.direct_io,
            graphics: spec.boot.graphics,
            balloon: spec.balloon,
        })
    }

    /// Everything in `start` after the name is reserved. On error the caller
    /// removes the reservation; this removes what it created on disk.
    /// `incoming`: start waiting for a live migration instead of booting,
    /// from the source it admits; returns the URI the target listens on.
    async fn launch(
        &self,
        spec: &DomainSpec,
        domain: &Arc<Domain>,
        incoming_from: Option<IncomingParams>,
    ) -> Result<Option<String>, HvError> {
        let incoming = incoming_from.is_some();
        let instance = &spec.instance;
        let op = start_op(incoming);
        let failed = |reason: String| HvError::Failed {
            instance: instance.clone(),
            op,
            reason,
            source: None,
        };
        // Before anything is created: a missing or changed image fails the
        // start with the reason, and nothing else boots in its place.
        let images = boot::verified_images(&self.inner.images, spec)
            .await
            .map_err(&failed)?;
        if let Some(why) =
            keel_api::Firmware::change_refused(spec.recorded_firmware, spec.boot.firmware)
        {
            return Err(failed(why));
        }
        if incoming && spec.tpm.is_some() {
            return Err(failed(tpm::migration_refused(&spec.vm)));
        }
        let disks = if incoming {
            self.existing_disks(spec).await?
        } else {
            let paths = self
                .ensure_disks(
                    &spec.vm,
                    &spec.disks,
                    &spec.create_disks,
                    &images,
                    spec.clone_from.as_ref(),
                )
                .await
                .map_err(&failed)?;
            // Not on an incoming target: the source's QEMU holds the files.
            for (disk, path) in spec.disks.iter().zip(&paths) {
                self.grow_to_spec(&spec.vm, disk, path)
                    .await
                    .map_err(&failed)?;
            }
            paths
        };
        self.ensure_uefi_vars(spec, incoming)
            .await
            .map_err(&failed)?;
        crate::start_marks::mark(&spec.vm, "disks_ready");
        let accelerator = self.accelerator().await;
        let mut plan = self.plan(accelerator, spec, disks, &images)?;
        plan.incoming = incoming;
        if let (Some(tpm), Some(wanted)) = (&plan.tpm, spec.tpm) {
            let (setup, tpm, vm) = (
                self.inner.config.swtpm_setup_binary.clone(),
                tpm.clone(),
                spec.vm.clone(),
            );
            blocking::unblocked("the TPM's state", move || {
                Ok(tpm::ensure_state(&setup, &tpm, &vm, wanted.may_create))
            })
            .await
            .unwrap_or_else(|e| Err(e.to_string()))
            .map_err(&failed)?;
        }
        let args = plan.args();
        let record = LaunchRecord {
            spec: spec.clone(),
            started_at: domain.started_at,
            accelerator: plan.accelerator,
            argv: std::iter::once(self.inner.config.qemu_binary.to_string_lossy().into_owned())
                .chain(args.iter().cloned())
                .collect(),
            socket_dir: Some(plan.paths.sockets.clone()),
        };
        // The directory appears complete with its spec.json, or not at all.
        let staging = self
            .inner
            .layout
            .instances_dir()
            .join(format!(".staging-{instance}-{}", std::process::id()));
        // Directories, the seed image, fsyncs: on the blocking pool.
        let seed = spec
            .cloud_init
            .as_ref()
            .map(|ci| cloud_init::Seed::render(&spec.vm, ci));
        let record = layout::json_bytes(&record)
            .map_err(|e| HvError::failed_by(instance.clone(), op, "the launch record", e))?;
        let (dir, paths) = (staging.clone(), plan.paths.clone());
        let prepared = blocking::unblocked("prepare the instance dir", move || {
            let _ = std::fs::remove_dir_all(&dir);
            let staged = InstancePaths::new(dir.clone(), dir.clone());
            let prepared = std::fs::create_dir(&dir)
                .and_then(|()| paths.prepare_sockets())
                .and_then(|()| match &seed {
                    Some(seed) => seed.write_image(&staged.seed),
                    None => Ok(()),
                })
                .and_then(|()| layout::write_bytes_atomic(&staged.spec, &record));
            if prepared.is_err() {
                let _ = std::fs::remove_dir_all(&dir);
                let _ = paths.remove_sockets();
            }
            prepared
        })
        .await;
        if let Err(e) = prepared {
            let context = staging.display().to_string();
            return Err(HvError::failed_by(instance.clone(), op, context, e));
        }
        let (dir, to, instances) = (
            staging.clone(),
            plan.paths.dir.clone(),
            self.inner.layout.instances_dir(),
        );
        let claimed = blocking::unblocked("claim the instance dir", move || {
            let claimed = rename_noreplace(&dir, &to).and_then(|()| layout::sync_dir(&instances));
            if claimed.is_err() {
                let _ = std::fs::remove_dir_all(&dir);
            }
            claimed
        })
        .await;
        if let Err(e) = claimed {
            // The socket dir is not removed here: it may be the live
            // instance's that owns the directory we lost the race for.
            return Err(match e.kind() {
                io::ErrorKind::AlreadyExists | io::ErrorKind::DirectoryNotEmpty => {
                    HvError::AlreadyExists {
                        instance: instance.clone(),
                    }
                }
                _ => {
                    let context = plan.paths.dir.display().to_string();
                    HvError::failed_by(instance.clone(), op, context, e)
                }
            });
        }
        crate::start_marks::mark(&spec.vm, "prepared");

        let remove_dir = || {
            let (instance, paths) = (instance.clone(), plan.paths.clone());
            blocking::unblocked("remove a failed start's files", move || {
                if let Err(e) = network::release(&instance) {
                    tracing::warn!(instance = %instance, error = %e, "failed start: tap not removed");
                }
                if let Err(e) = tpm::await_gone(&paths.dir, &paths.sockets) {
                    tracing::warn!(instance = %instance, error = %e, "failed start: swtpm left");
                }
                let _ = std::fs::remove_dir_all(&paths.dir);
                paths.remove_sockets()
            })
        };
        // After the directory is ours: a tap made for a start that lost the
        // race for it would belong to nobody.
        if let Some(nic) = &plan.nic {
            if let Err(e) = nic.prepare() {
                let _ = remove_dir().await;
                return Err(HvError::failed_by(instance.clone(), op, "", e));
            }
        }
        // The TPM first: QEMU connects to it as it starts.
        if let Some(tpm) = &plan.tpm {
            if let Err(reason) =
                tpm::start(&self.inner.config.swtpm_binary, tpm, &plan.paths.dir).await
            {
                let _ = remove_dir().await;
                return Err(failed(reason));
            }
        }
        // QEMU's end of the user-mode network. Held only until QEMU has it:
        // once QEMU's end closes, passt exits.
        let net = match plan.nic.as_ref().map(|n| &n.backend) {
            Some(network::Backend::User { forwards }) => {
                match passt::start(&self.inner.config.passt_binary, forwards, &plan.paths.dir).await
                {
                    Ok(fd) => Some(fd),
                    Err(reason) => {
                        let _ = remove_dir().await;
                        return Err(failed(reason));
                    }
                }
            }
            _ => None,
        };
        // An unfenced guest is plain QEMU, as on a single host: no keeper
        // whose only job would be to hold a lease that must never lapse.
        // Plain QEMU already outlives the agent (its own session) and is
        // re-adopted by its pid file, the path single-host mode has always
        // taken; the keeper also refuses to start under a lapsed lease,
        // which an unfenced guest must not depend on either.
        let keeper = self.inner.config.keeper.as_ref().filter(|_| spec.fenced);
        let spawned = match keeper {
            Some(k) => spawn_keeper(k, &self.inner.lease, &plan, net.as_ref()),
            None => spawn(
                tokio::process::Command::new(&self.inner.config.qemu_binary),
                &plan,
                net.as_ref(),
            ),
        };
        drop(net);
        let mut child = match spawned {
            Ok(child) => child,
            Err(e) => {
                let _ = remove_dir().await;
                return Err(failed(format!(
                    "spawn {}: {e}",
                    keeper
                        .map_or(&self.inner.config.qemu_binary, |k| &k.program)
                        .display()
                )));
            }
        };
        let child_pid = child.id().unwrap_or(0);
        crate::start_marks::mark(&spec.vm, "spawned");
        // Under a keeper, QEMU's pid is known only once it wrote its pid
        // file; until then a kill must wait (the keeper's pid is not QEMU's).
        if keeper.is_none() {
            domain.set_phase(Phase::Launching {
                pid: Some(child_pid),
            });
        }
        tracing::info!(instance = %instance, pid = child_pid, keeper = keeper.is_some(), accel = ?plan.accelerator, "QEMU spawned");

        let connected = self.await_qmp(&plan.paths, &mut child).await;
        crate::start_marks::mark(&spec.vm, "qmp_connected");
        let ready = match connected {
            // Before the monitor takes the connection, so that a target that
            // cannot listen is rolled back like a failed start.
            Ok(connected) => match &incoming_from {
                Some(from) => self
                    .listen_incoming(&plan.paths, &connected.0, from)
                    .await
                    .map(|uri| (connected, Some(uri))),
                None => Ok((connected, None)),
            },
            Err(reason) => Err(reason),
        };
        let ready = match ready {
            Ok((connected, uri)) if keeper.is_some() => {
                match self.kept_qemu(domain, &plan.paths).await {
                    Ok(fd) => Ok((connected, uri, Some(fd))),
                    Err(reason) => Err(reason),
                }
            }
            Ok((connected, uri)) => Ok((connected, uri, None)),
            Err(reason) => Err(reason),
        };
        match ready {
            Ok((connected, uri, kept)) => {
                let (pid, watch) = match kept {
                    Some(fd) => {
                        // The keeper is reaped when it exits (after QEMU),
                        // so no zombie stays; QEMU is watched by pidfd.
                        tokio::spawn(async move {
                            let _ = child.wait().await;
                        });
                        (fd.pid(), ProcessWatch::PidFd(fd))
                    }
                    None => (child_pid, ProcessWatch::Child(child)),
                };
                domain.set_phase(Phase::Live { pid });
                domain.spawn_monitor(watch, Some(connected));
                Ok(uri)
            }
            Err(reason) => {
                // Leave nothing running and nothing behind: a failed start
                // is a start that never happened (`NotFound`). A keeper's
                // death takes its QEMU along (PDEATHSIG), but not at once:
                // wait for QEMU itself too.
                let qemu = keeper.and(
                    plan.paths
                        .read_pid()
                        .or_else(|| proc::find_instance_process(&domain.marker)),
                );
                let _ = child.start_kill();
                let _ = child.wait().await;
                if let Some(Ok(fd)) = qemu.map(|pid| PidFd::open_verified(pid, &domain.marker)) {
                    let _ = fd.signal(libc::SIGKILL);
                    let _ = tokio::time::timeout(Duration::from_secs(10), fd.exited()).await;
                }
                let log = tail(&plan.paths.qemu_log).await;
                let _ = remove_dir().await;
                Err(failed(format!("{reason}; qemu log: {log}")))
            }
        }
    }

    /// `start` and `prepare_incoming`: validates, reserves the name and
    /// launches. `Some(uri)` for an incoming target.
    pub(super) async fn start_domain(
        &self,
        spec: &DomainSpec,
        incoming_from: Option<IncomingParams>,
    ) -> Result<Option<String>, HvError> {
        let incoming = incoming_from.is_some();
        let instance = &spec.instance;
        let op = start_op(incoming);
        let invalid = |reason: String| HvError::Failed {
            instance: instance.clone(),
            op,
            reason,
            source: None,
        };
        let invalid_name = |e| HvError::failed_by(instance.clone(), op, "", e);
        validate_name("instance", instance).map_err(invalid_name)?;
        validate_name("vm", &spec.vm).map_err(invalid_name)?;
        // Its VM's domains are found by this name (see `listing`).
        crate::check_instance_name(spec, op)?;
        for (i, disk) in spec.disks.iter().enumerate() {
            validate_name(&format!("disks[{i}].name"), &disk.name).map_err(invalid_name)?;
            if spec.disks[..i].iter().any(|d| d.name == disk.name) {
                return Err(invalid(format!("disk {:?} listed twice", disk.name)));
            }
        }
        if spec.cpus == 0 || spec.memory_mib < keel_api::MIN_MEMORY_MIB {
            return Err(invalid(format!(
                "cpus {} / memory {} MiB out of range",
                spec.cpus, spec.memory_mib
            )));
        }

        // Reserve the name in memory first (the directory is claimed later,
        // atomically): a concurrent start of the same instance fails here.
        let domain = {
            let mut domains = self.lock();
            if domains.contains_key(instance) || self.inner.layout.instance_dir(instance).exists() {
                return Err(HvError::AlreadyExists {
                    instance: instance.clone(),
                });
            }
            let domain = Domain::new(
                instance.clone(),
                spec,
                SystemClock.now_ms(),
                self.inner.layout.new_instance(instance),
                self.inner.config.qmp_timeout,
                Phase::Launching { pid: None },
                self.inner.events.clone(),
            );
            domains.insert(instance.clone(), domain.clone());
            domain
        };
        // Launched from a task of its own: if the caller gives up waiting
        // (its future is dropped), the launch still either completes, with a
        // monitor attached, or is rolled back. Never a half-started domain.
        let driver = self.clone();
        let spec = spec.clone();
        let task = tokio::spawn(async move {
            let result = driver.launch(&spec, &domain, incoming_from).await;
            if result.is_err() {
                let mut domains = driver.lock();
                if domains
                    .get(&spec.instance)
                    .is_some_and(|d| Arc::ptr_eq(d, &domain))
                {
                    domains.remove(&spec.instance);
                }
            }
            result
        });
        task.await.unwrap_or_else(|e| {
            Err(HvError::failed_by(
                instance.clone(),
                op,
                "launch task failed",
                e,
            ))
        })
    }

    /// The QEMU a keeper started, once its QMP answered: its pid from the
    /// pid file, verified by its identity marker.
    async fn kept_qemu(&self, domain: &Domain, paths: &InstancePaths) -> Result<PidFd, String> {
        let deadline = Instant::now() + self.inner.config.launch_timeout;
        loop {
            if let Some(pid) = paths.read_pid() {
                if let Ok(fd) = PidFd::open_verified(pid, &domain.marker) {
                    return Ok(fd);
                }
            }
            if Instant::now() >= deadline {
                return Err("QEMU under the keeper answered QMP but wrote no pid file".into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits for the new QEMU's QMP greeting, or its early death.
    async fn await_qmp(
        &self,
        paths: &InstancePaths,
        child: &mut tokio::process::Child,
    ) -> Result<(QmpClient, tokio::sync::mpsc::UnboundedReceiver<QmpEvent>), String> {
        let config = &self.inner.config;
        let deadline = Instant::now() + config.launch_timeout;
        let mut last_error = String::from("no attempt");
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!("qemu exited during start ({status})"));
            }
            if paths.qmp.exists() {
                match QmpClient::connect(&paths.qmp, config.qmp_timeout).await {
                    Ok(connected) => return Ok(connected),
                    Err(e) => last_error = e.to_string(),
                }
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "QMP did not answer within {:?} ({last_error})",
                    config.launch_timeout
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Spawns QEMU from an argument vector (no shell) in a new session, with
/// stdout/stderr appended to `qemu.log`. The caller owns the child.
pub(super) fn spawn_qemu(binary: &Path, plan: &LaunchPlan) -> io::Result<tokio::process::Child> {
    spawn(tokio::process::Command::new(binary), plan, None)
}

/// QEMU with its arguments, `net` (QEMU's end of passt's socket, if any) at
/// [`passt::QEMU_NET_FD`].
fn spawn(
    mut cmd: tokio::process::Command,
    plan: &LaunchPlan,
    net: Option<&OwnedFd>,
) -> io::Result<tokio::process::Child> {
    cmd.args(plan.args());
    spawn_in_own_session(cmd, &plan.paths.dir, &plan.paths.qemu_log, net)
}

/// Spawns a fence keeper for the instance (which then starts QEMU from the
/// instance's `spec.json`), like [`spawn_qemu`]: its output and QEMU's go
/// to `qemu.log`. The keeper keeps `net` where QEMU, its child, expects it.
/// The caller owns the keeper child.
fn spawn_keeper(
    keeper: &keeper::KeeperCommand,
    lease: &keeper::FenceLease,
    plan: &LaunchPlan,
    net: Option<&OwnedFd>,
) -> io::Result<tokio::process::Child> {
    let mut cmd = tokio::process::Command::new(&keeper.program);
    cmd.args(&keeper.args)
        .arg("--instance-dir")
        .arg(&plan.paths.dir)
        .arg("--lease")
        .arg(lease.path());
    spawn_in_own_session(cmd, &plan.paths.dir, &plan.paths.qemu_log, net)
}

/// Runs `cmd` in `dir` (the instance dir), output appended to `log`
/// (`qemu.log`), in a new session and process group of its own: no
/// controlling terminal, so neither a Ctrl-C nor a hangup aimed at Keel
/// reaches it. Without any capability ([`crate::unprivileged`]): a keeper
/// passes none on to its QEMU. Whether it outlives this process is the
/// caller's `kill_on_drop` (tokio's default: it does).
pub(super) fn spawn_in_own_session(
    mut cmd: tokio::process::Command,
    dir: &Path,
    log: &Path,
    net: Option<&OwnedFd>,
) -> io::Result<tokio::process::Child> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?;
    cmd.current_dir(dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    let net = net.map(|fd| fd.as_raw_fd());
    // SAFETY: setsid, dup2, fcntl, prctl and capset are async-signal-safe
    // and touch no memory of ours.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setsid() < 0 {
                return Err(io::Error::last_os_error());
            }
            if let Some(fd) = net {
                passt::inherit_as(fd, passt::QEMU_NET_FD)?;
            }
            crate::unprivileged::drop_capabilities_in_child()
        });
    }
    cmd.spawn()
}

/// The last lines of a log, on one line, for error messages.
pub(super) async fn tail(path: &Path) -> String {
    let text = tokio::fs::read_to_string(path).await.unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let start = lines.len().saturating_sub(5);
    let joined = lines[start..].join(" | ");
    if joined.is_empty() {
        "(empty)".into()
    } else {
        joined
    }
}

/// The operation a start names in its errors: a migration target's start
/// is its preparation.
fn start_op(incoming: bool) -> &'static str {
    if incoming {
        "prepare incoming migration"
    } else {
        "start"
    }
}
