//! A deterministic, in-memory hypervisor for simulation tests of the
//! controllers. Guests boot, power off and crash on the injected clock; a
//! seeded RNG decides which faults hit which call, so a failing seed replays
//! exactly. It also keeps score: starting a second live instance of a VM is
//! recorded as a violation at the moment it happens.
//!
//! This driver never replaces the end-to-end tests against real QEMU.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;
use keel_api::{Accelerator, Clock, Millis};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

mod disk_change;
mod hot_unplug;
pub use hot_unplug::RELEASE_MS as UNPLUG_RELEASE_MS;
mod hotplug;
mod online_resize;
mod reset;
mod stats;
mod table;
mod vm_export;

use table::{DomainTable, NextChange};

use crate::{
    check_instance_name, instance_prefix, DomainEvent, DomainEventKind, DomainInfo, DomainListing,
    DomainSpec, DomainState, ExitCause, HvError, Hypervisor, MigrationProgress, NodeFacts,
    UnknownDomain,
};

#[derive(Debug, Clone)]
pub struct SimConfig {
    /// From `start` until the guest runs.
    pub boot_ms: Millis,
    /// From an ACPI power-down request until the guest has powered off.
    pub graceful_shutdown_ms: Millis,
    /// From `migrate` until the target runs.
    pub migration_ms: Millis,
    /// From boot until the guest agent answers (every sim guest has one,
    /// unless [`SimHypervisor::silence_agent`] is used).
    pub agent_ready_ms: Millis,
    pub faults: SimFaults,
    /// What every guest's agent answers instead of the sim's own: the raw
    /// `return` values of `guest-network-get-interfaces` and
    /// `guest-get-host-name`, read by the QEMU driver's parser (tests of
    /// guests that lie, or attack).
    pub agent_answers: Option<SimAgentAnswers>,
    /// The host the node reports (its capacity follows from it); `None`:
    /// none, so placement judges no capacity.
    pub host: Option<keel_api::HostResources>,
}

#[derive(Debug, Clone)]
pub struct SimAgentAnswers {
    pub interfaces: serde_json::Value,
    pub host_name: serde_json::Value,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            boot_ms: 2_000,
            graceful_shutdown_ms: 3_000,
            migration_ms: 5_000,
            agent_ready_ms: 0,
            faults: SimFaults::default(),
            agent_answers: None,
            host: None,
        }
    }
}

/// Probabilities are per call (0.0 = never).
#[derive(Debug, Clone, Default)]
pub struct SimFaults {
    /// `info`, `list` and `domains_of` fail with `Unavailable`.
    pub lookup_unavailable: f64,
    /// `start`, `shutdown`, `kill`, `cleanup` fail with `Unavailable` without acting.
    pub op_unavailable: f64,
    /// Just before a `shutdown` or `kill`, the domain crashes and its record is
    /// dropped, so the call sees `NotFound` although the lookup before it saw
    /// the domain running.
    pub vanish_between_calls: f64,
    /// A newly started guest ignores ACPI power-down (hung guest).
    pub ignore_powerdown: f64,
    /// The first instance of every VM crashes right after boot.
    pub crash_on_first_boot: bool,
    /// A running guest crashes or powers itself off, checked per call.
    pub spontaneous_exit: f64,
    /// A started migration fails when it would have completed.
    pub migration_fails: f64,
    /// A cancel comes too late: the migration completes anyway.
    pub cancel_too_late: f64,
    /// A started migration stops making progress half-way (until cancelled).
    pub migration_stalls: f64,
    /// The target receives the whole state, but the source reports the
    /// migration failed (the last acknowledgement was lost) and runs on:
    /// a target that ran by itself would run beside it.
    pub handover_unconfirmed: f64,
}

#[derive(Debug, Clone)]
struct SimDomain {
    spec: DomainSpec,
    started_at: Millis,
    state: DomainState,
    powerdown_requested_at: Option<Millis>,
    ignores_powerdown: bool,
    crash_at: Option<Millis>,
    /// Set on a target waiting for an incoming migration.
    incoming: Option<Incoming>,
    /// Set on a source that started a migration.
    outgoing: Option<Outgoing>,
    guest: SimGuest,
}

/// The guest's own side: agent, filesystems, console.
#[derive(Debug, Clone, Default)]
struct SimGuest {
    agent_silent: bool,
    /// The agent was asked to power off (works even when ACPI is ignored).
    agent_shutdown_at: Option<Millis>,
    frozen: bool,
    freezes: u32,
    thaws: u32,
    /// What the guest typed back on its console after boot.
    console_extra: Vec<u8>,
    /// Resets inside this domain (see `sim::reset`).
    resets: u32,
    last_reset_at: Option<Millis>,
    /// The agent takes a reboot request and nothing happens.
    ignores_reboot: bool,
    /// What the console showed in the boots before the last reset.
    console_before_reset: Vec<u8>,
}

/// What the sim guest prints on its console once booted.
pub const SIM_CONSOLE_BOOT: &str = "sim: booting\nKEEL-GUEST-READY boot_id=sim\n";
/// The sim guest's addresses (as qemu-guest-agent would report them).
pub const SIM_GUEST_IPS: [(&str, &str, u8); 2] =
    [("lo", "127.0.0.1", 8), ("eth0", "10.0.2.15", 24)];

#[derive(Debug, Clone)]
struct Incoming {
    /// When the state will have arrived; `None` until the source sends.
    completes_at: Option<Millis>,
    fails: bool,
    /// Set when the stream broke before the end (source gone, cancelled):
    /// the target then never runs, as a real incoming QEMU would not.
    aborted: Arc<AtomicBool>,
    /// The only source node it takes a migration from (QEMU's `tls-authz`);
    /// `None`: any.
    admits: Option<String>,
}

#[derive(Debug, Clone)]
struct Outgoing {
    started_at: Millis,
    completes_at: Millis,
    fails: bool,
    /// Stops progressing half-way and never completes.
    stalls: bool,
    /// Fails from the source's view only: the target got everything.
    unconfirmed: bool,
    cancelled: bool,
    abort: Arc<AtomicBool>,
    params: crate::MigrationParams,
    /// A terminal outcome was reported while the source was alive; the
    /// driver remembers it once the process is gone.
    reported: bool,
}

impl SimDomain {
    /// When `SimState::advance` will next change this domain on the clock
    /// alone: the earliest moment among those it checks, in its order of
    /// precedence.
    fn next_change(&self, now: Millis, boot_ms: Millis, shutdown_ms: Millis) -> NextChange {
        if self.state.is_exited() {
            return NextChange::Never;
        }
        if self.incoming.is_some() {
            // Its source may abort it at any moment.
            return NextChange::Always;
        }
        let mut moments = Vec::new();
        if let Some(out) = &self.outgoing {
            if !out.fails && !out.unconfirmed && !out.cancelled {
                if now >= out.completes_at {
                    // Handed over: it stays paused until told to quit.
                    return NextChange::Never;
                }
                moments.push(out.completes_at);
            }
        }
        moments.extend(self.crash_at);
        moments.extend(self.guest.agent_shutdown_at.map(|at| at + shutdown_ms));
        if let (Some(at), false) = (self.powerdown_requested_at, self.ignores_powerdown) {
            moments.push(at.max(self.started_at + boot_ms) + shutdown_ms);
        }
        if self.state == DomainState::Starting {
            moments.push(self.started_at + boot_ms);
        }
        match moments.into_iter().min() {
            Some(at) => NextChange::At(at),
            None => NextChange::Never,
        }
    }
}

impl SimDomain {
    /// The process ends now. A migration it was still sending breaks off.
    fn exit(&mut self, cause: ExitCause, now: Millis) {
        if let Some(o) = &self.outgoing {
            if now < o.completes_at {
                o.abort.store(true, Ordering::SeqCst);
            }
        }
        self.state = DomainState::Exited(cause);
    }

    /// Whether this domain's guest is the one executing: not exited, not a
    /// target still waiting for state, not a source that handed over.
    fn executing(&self) -> bool {
        !self.state.is_exited()
            && self.incoming.is_none()
            && !self.outgoing.as_ref().is_some_and(|o| {
                !o.fails && !o.unconfirmed && !o.cancelled && self.state == DomainState::Paused
            })
    }
}

/// Connects simulated nodes: where incoming migrations listen, and the
/// storage they share (disks are reachable from every node, as with a
/// shared storage directory).
#[derive(Clone, Default)]
pub struct SimFabric {
    targets: Arc<Mutex<BTreeMap<String, Arc<Mutex<SimState>>>>>,
    disks: Arc<Mutex<BTreeMap<String, SimDisks>>>,
}

/// A VM's disks as the guest sees them: records by slot, and snapshots of
/// them; and which disks (by name) were made.
#[derive(Debug, Clone, Default)]
struct SimDisks {
    made: std::collections::BTreeSet<String>,
    records: BTreeMap<u32, String>,
    snapshots: BTreeMap<String, BTreeMap<u32, String>>,
}

#[derive(Debug)]
struct SimState {
    domains: DomainTable<SimDomain>,
    rng: ChaCha8Rng,
    config: SimConfig,
    starts_per_vm: BTreeMap<String, u32>,
    /// VMs whose next started instance crashes right after boot.
    crash_next_boot: std::collections::BTreeSet<String>,
    /// VMs whose next starts fail (how many, and why), as QEMU does for a
    /// kernel that is not a kernel: nothing is left behind.
    failing_starts: BTreeMap<String, (u32, String)>,
    violations: Vec<String>,
    log: Vec<String>,
    /// The node's fence lease, as the QEMU driver's keepers enforce it:
    /// set by the first `renew_fence` (a node without one has no keepers).
    /// Once it has passed, every guest is killed and nothing starts.
    fence_deadline: Option<Millis>,
    /// The lapsed deadline whose kills were done: a lapse kills once, and
    /// the guests it spares (unfenced ones) keep their own moments.
    lapse_done: Option<Millis>,
    /// Instances whose calls hang (a QMP socket that never answers) until
    /// released, and how many calls hang now.
    hung: std::collections::BTreeSet<String>,
    hanging_calls: usize,
    /// Instances whose QEMU is stopped (SIGSTOP): every call that needs
    /// its monitor gives up unanswered, as the QEMU driver's bounded QMP
    /// calls do; a kill (by pid) still ends it.
    stopped: std::collections::BTreeSet<String>,
    /// Instances whose disks cannot be grown online, and why (a driver
    /// whose `block_resize` fails).
    disk_changes_refused: BTreeMap<String, String>,
    /// Where the domains' events are announced, as the QEMU driver's
    /// monitors announce a process ending or a QMP event.
    events: tokio::sync::broadcast::Sender<DomainEvent>,
}

#[derive(Clone)]
pub struct SimHypervisor {
    clock: Arc<dyn Clock>,
    node: String,
    state: Arc<Mutex<SimState>>,
    fabric: SimFabric,
    consoles: crate::guest_info::ConsoleSlots,
    /// The domains' events (exits, resets, a migration target resumed),
    /// announced as the QEMU driver announces a QEMU process ending or
    /// its monitor's events. The same sender as `SimState::events`.
    events: tokio::sync::broadcast::Sender<DomainEvent>,
    /// Wakes hung calls when their instance is released.
    released: Arc<tokio::sync::Notify>,
}

impl SimHypervisor {
    /// A single node with storage of its own.
    pub fn new(clock: Arc<dyn Clock>, seed: u64, config: SimConfig) -> Self {
        Self::join(clock, seed, config, &SimFabric::default(), "local")
    }

    /// A node `node` attached to `fabric`, shared with the other nodes.
    pub fn join(
        clock: Arc<dyn Clock>,
        seed: u64,
        config: SimConfig,
        fabric: &SimFabric,
        node: &str,
    ) -> Self {
        let events = tokio::sync::broadcast::channel(1024).0;
        Self {
            clock,
            node: node.to_string(),
            fabric: fabric.clone(),
            consoles: Default::default(),
            events: events.clone(),
            released: Default::default(),
            state: Arc::new(Mutex::new(SimState {
                domains: DomainTable::default(),
                rng: ChaCha8Rng::seed_from_u64(seed),
                config,
                starts_per_vm: BTreeMap::new(),
                crash_next_boot: Default::default(),
                disk_changes_refused: Default::default(),
                failing_starts: BTreeMap::new(),
                violations: Vec::new(),
                log: Vec::new(),
                fence_deadline: None,
                lapse_done: None,
                hung: Default::default(),
                hanging_calls: 0,
                stopped: Default::default(),
                events,
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, SimState> {
        let mut state = self.state.lock().expect("sim state poisoned");
        state.advance(self.clock.now_ms());
        state
    }

    pub fn set_faults(&self, faults: SimFaults) {
        self.lock().config.faults = faults;
    }

    /// Every moment a second live instance of a VM was started, a live
    /// instance was asked to be cleaned up, or disks of a running VM deleted.
    pub fn violations(&self) -> Vec<String> {
        self.lock().violations.clone()
    }

    /// Instances of `vm` whose process exists (not exited), at the current time.
    pub fn live_instances(&self, vm: &str) -> Vec<String> {
        self.lock()
            .domains
            .values()
            .filter(|d| d.spec.vm == vm && !d.state.is_exited())
            .map(|d| d.spec.instance.clone())
            .collect()
    }

    /// What the live domains here take together (every process that has
    /// not exited holds its guest's memory, an incoming one too).
    pub fn live_demand(&self) -> keel_api::Demand {
        self.lock()
            .domains
            .values()
            .filter(|d| !d.state.is_exited())
            .fold(keel_api::Demand::default(), |sum, d| {
                sum.plus(keel_api::Demand {
                    cpus: u64::from(d.spec.cpus),
                    memory_mib: d.spec.memory_mib,
                })
            })
    }

    /// Instances of `vm` whose guest executes here: not exited, not waiting
    /// for an incoming migration, not a source that handed over.
    pub fn executing_instances(&self, vm: &str) -> Vec<String> {
        self.lock()
            .domains
            .values()
            .filter(|d| d.spec.vm == vm && d.executing())
            .map(|d| d.spec.instance.clone())
            .collect()
    }

    pub fn node(&self) -> &str {
        &self.node
    }

    /// Every VM that has a live instance.
    pub fn live_vms(&self) -> Vec<String> {
        let state = self.lock();
        let mut vms: Vec<String> = state
            .domains
            .values()
            .filter(|d| !d.state.is_exited())
            .map(|d| d.spec.vm.clone())
            .collect();
        vms.dedup();
        vms
    }

    fn disks(&self) -> MutexGuard<'_, BTreeMap<String, SimDisks>> {
        self.fabric.disks.lock().expect("sim disks poisoned")
    }

    pub fn has_disks(&self, vm: &str) -> bool {
        self.disks().contains_key(vm)
    }

    /// Whether disk `disk` of `vm` was made (and not deleted since).
    pub fn has_disk(&self, vm: &str, disk: &str) -> bool {
        self.disks().get(vm).is_some_and(|d| d.made.contains(disk))
    }

    /// Disk `disk` of `vm` is lost (deleted behind Keel's back, storage
    /// not mounted): a start that may not make it fails.
    pub fn lose_disk(&self, vm: &str, disk: &str) {
        if let Some(d) = self.disks().get_mut(vm) {
            d.made.remove(disk);
        }
    }

    /// Whether `vm`'s disks (as this node sees them) hold snapshot `name`.
    pub fn has_snapshot(&self, vm: &str, name: &str) -> bool {
        self.disks()
            .get(vm)
            .is_some_and(|d| d.snapshots.contains_key(name))
    }

    /// The guest of `vm`'s live instance writes a record to its disk.
    /// Fails when no instance of the VM is live (no guest to write).
    pub fn guest_write(&self, vm: &str, slot: u32, text: &str) -> Result<(), String> {
        let executing = self
            .lock()
            .domains
            .values()
            .any(|d| d.spec.vm == vm && d.executing());
        if !executing {
            return Err(format!(
                "VM {vm} has no executing instance on node {}",
                self.node
            ));
        }
        self.disks()
            .entry(vm.to_string())
            .or_default()
            .records
            .insert(slot, text.to_string());
        Ok(())
    }

    /// What the VM's disk holds at `slot`.
    pub fn disk_record(&self, vm: &str, slot: u32) -> Option<String> {
        self.disks().get(vm)?.records.get(&slot).cloned()
    }

    /// The host loses power: every process on it is gone at once, and after
    /// it comes back the hypervisor knows of no domain.
    pub fn power_failure(&self) {
        let now = self.clock.now_ms();
        let mut s = self.lock();
        s.domains.settle_all(|d| {
            if !d.state.is_exited() {
                // A migration cut off mid-stream never hands over.
                d.exit(ExitCause::Killed, now);
            }
        });
        s.domains.clear();
        s.fence_deadline = None;
        s.log.push("power failure".into());
    }

    /// The next instance of `vm` to start crashes right after it boots.
    pub fn crash_next_boot(&self, vm: &str) {
        self.lock().crash_next_boot.insert(vm.to_string());
    }

    /// The next `count` starts of `vm` fail with `reason`, leaving nothing.
    pub fn fail_next_starts(&self, vm: &str, count: u32, reason: &str) {
        self.lock()
            .failing_starts
            .insert(vm.to_string(), (count, reason.to_string()));
    }

    /// Hangs one guest from now on: it ignores ACPI power-down, and its
    /// guest agent does not answer either.
    pub fn hang_guest(&self, instance: &str) {
        if let Some(d) = self.lock().domains.get_mut(instance) {
            d.ignores_powerdown = true;
            d.guest.agent_silent = true;
        }
    }

    /// Makes one guest ignore the ACPI power button (its agent still
    /// answers), like a guest with the button masked.
    pub fn ignore_acpi(&self, instance: &str) {
        if let Some(d) = self.lock().domains.get_mut(instance) {
            d.ignores_powerdown = true;
        }
    }

    /// Crashes a running instance now (its record stays until cleanup).
    pub fn crash(&self, instance: &str) {
        let now = self.clock.now_ms();
        let exited = match self.lock().domains.get_mut(instance) {
            Some(d) if !d.state.is_exited() => {
                d.exit(ExitCause::Crashed, now);
                d.crash_at = Some(now);
                Some(d.spec.vm.clone())
            }
            _ => None,
        };
        self.announce_exit(exited, instance);
    }

    /// The guest powers itself off now.
    pub fn guest_poweroff(&self, instance: &str) {
        let now = self.clock.now_ms();
        let exited = match self.lock().domains.get_mut(instance) {
            Some(d) if !d.state.is_exited() => {
                d.exit(ExitCause::Poweroff, now);
                Some(d.spec.vm.clone())
            }
            _ => None,
        };
        self.announce_exit(exited, instance);
    }

    fn announce_exit(&self, vm: Option<String>, instance: &str) {
        if let Some(vm) = vm {
            // Nobody listening is fine: events are hints.
            let _ = self
                .events
                .send(DomainEvent::new(&vm, instance, DomainEventKind::Exited));
        }
    }

    /// From now on every call naming `instance` (info, shutdown, kill,
    /// cleanup, guest agent calls, `domains_of` its VM) hangs until
    /// [`Self::release_calls`], as a call on a QMP socket that never
    /// answers; `list` reports it unknown, as the QEMU driver's bounded
    /// look does.
    pub fn hang_calls(&self, instance: &str) {
        self.lock().hung.insert(instance.to_string());
    }

    /// Stops the instance's process from now on, as `kill -STOP` stops a
    /// QEMU: its monitor and guest agent never answer (info, shutdown,
    /// guest agent calls, migration status and cancel, `domains_of` its VM
    /// fail as unavailable; `list` reports it unknown; cleanup finds it
    /// still there), its guest ignores the power button, and only a kill
    /// ends it. A migration it is sending goes on as it was set up (stall
    /// it with `SimFaults::migration_stalls` for one that sends no more).
    pub fn stop_process(&self, instance: &str) {
        let mut s = self.lock();
        if let Some(d) = s.domains.get_mut(instance) {
            d.ignores_powerdown = true;
            d.guest.agent_silent = true;
        }
        s.stopped.insert(instance.to_string());
    }

    /// Lets the calls naming `instance` through again, the hung ones too.
    pub fn release_calls(&self, instance: &str) {
        self.lock().hung.remove(instance);
        self.released.notify_waiters();
    }

    /// How many calls hang right now.
    pub fn hanging_calls(&self) -> usize {
        self.lock().hanging_calls
    }

    /// Waits here while calls naming `instance` hang.
    async fn hang_point(&self, instance: &str) {
        let mut counted = false;
        loop {
            // Registered before looking, so a release in between is not missed.
            let released = self.released.notified();
            {
                let mut s = self.lock();
                if !s.hung.contains(instance) {
                    if counted {
                        s.hanging_calls -= 1;
                    }
                    return;
                }
                if !counted {
                    s.hanging_calls += 1;
                    counted = true;
                }
            }
            released.await;
        }
    }

    /// The instance's guest agent stops answering (or, with `false`,
    /// answers again).
    pub fn silence_agent(&self, instance: &str, silent: bool) {
        if let Some(d) = self.lock().domains.get_mut(instance) {
            d.guest.agent_silent = silent;
        }
    }

    /// Whether the guest's filesystems are frozen now, and how many freezes
    /// and thaws it was sent.
    pub fn freeze_state(&self, instance: &str) -> Option<(bool, u32, u32)> {
        let s = self.lock();
        let g = &s.domains.get(instance)?.guest;
        Some((g.frozen, g.freezes, g.thaws))
    }

    /// Whether the guest agent was asked to power the guest off.
    pub fn agent_shutdown_requested(&self, instance: &str) -> bool {
        self.lock()
            .domains
            .get(instance)
            .is_some_and(|d| d.guest.agent_shutdown_at.is_some())
    }

    /// The spec `instance` was started (or prepared for a migration) with.
    pub fn domain_spec(&self, instance: &str) -> Option<DomainSpec> {
        self.lock().domains.get(instance).map(|d| d.spec.clone())
    }

    /// How the last outgoing migration of `instance` was tuned.
    pub fn migration_params(&self, instance: &str) -> Option<crate::MigrationParams> {
        let s = self.lock();
        s.domains
            .get(instance)?
            .outgoing
            .as_ref()
            .map(|o| o.params.clone())
    }

    /// What the driver did, for replaying a failing seed.
    pub fn log(&self) -> Vec<String> {
        self.lock().log.clone()
    }
}

/// Announces `kind` for `d`. Nobody listening is fine: events are hints.
fn announce(
    events: &tokio::sync::broadcast::Sender<DomainEvent>,
    d: &SimDomain,
    kind: DomainEventKind,
) {
    let _ = events.send(DomainEvent::new(&d.spec.vm, &d.spec.instance, kind));
}

fn sim_failed(instance: &str, op: &'static str, reason: impl Into<String>) -> HvError {
    HvError::Failed {
        instance: instance.to_string(),
        op,
        reason: reason.into(),
        source: None,
    }
}

impl SimDomain {
    /// Why the guest agent does not answer now, if it does not.
    fn agent_silence(&self, now: Millis, ready_after_ms: Millis) -> Option<String> {
        if self.state != DomainState::Running {
            return Some(format!("guest is not running ({:?})", self.state));
        }
        if now < self.booting_since() + ready_after_ms {
            return Some("guest agent not started yet".into());
        }
        if self.guest.agent_silent {
            return Some("guest agent did not answer guest-sync-delimited".into());
        }
        None
    }
}

impl SimState {
    /// The console log of `instance`: the boot banner once it runs, then
    /// what its console sessions produced.
    fn console(&self, instance: &str, now: Millis) -> Result<Vec<u8>, HvError> {
        let mut log = self
            .domain_ref(instance)?
            .guest
            .console_before_reset
            .clone();
        log.extend(self.console_of_this_boot(instance, now)?);
        Ok(log)
    }

    fn domain_ref(&self, instance: &str) -> Result<&SimDomain, HvError> {
        self.domains.get(instance).ok_or_else(|| HvError::NotFound {
            instance: instance.to_string(),
        })
    }

    /// What the console showed since the guest last (re)booted.
    fn console_of_this_boot(&self, instance: &str, now: Millis) -> Result<Vec<u8>, HvError> {
        let d = self.domain_ref(instance)?;
        let rebooted = d
            .guest
            .last_reset_at
            .is_none_or(|at| now >= at + self.config.boot_ms);
        let booted = (d.state == DomainState::Running && rebooted)
            || (d.state.is_exited()
                && d.crash_at
                    .is_none_or(|c| c > d.started_at + self.config.boot_ms));
        let mut log = Vec::new();
        if booted {
            log.extend_from_slice(SIM_CONSOLE_BOOT.as_bytes());
            log.extend_from_slice(&d.guest.console_extra);
        }
        Ok(log)
    }

    /// Moves every domain forward to `now`: boots finish, powered-down
    /// guests exit, scheduled crashes happen.
    fn advance(&mut self, now: Millis) {
        let lapsed = self
            .fence_deadline
            .filter(|d| now >= *d && self.lapse_done != Some(*d));
        if let Some(deadline) = lapsed {
            self.lapse_done = Some(deadline);
            // An unfenced guest runs without a keeper: no lease to lapse,
            // and it goes on booting, powering off, crashing on its own.
            let events = &self.events;
            let fenced = self.domains.settle_where(
                |d| !d.state.is_exited() && d.spec.fenced,
                |d| {
                    d.exit(ExitCause::Killed, deadline);
                    announce(events, d, DomainEventKind::Exited);
                },
            );
            if !fenced.is_empty() {
                self.log
                    .push(format!("fence lease lapsed: killed {fenced:?}"));
            }
        }
        let boot_ms = self.config.boot_ms;
        let shutdown_ms = self.config.graceful_shutdown_ms;
        let events = &self.events;
        // What the clock alone changes is announced as QEMU would announce
        // it (a process ending): the controllers' slow resync is not how
        // a guest's exit is meant to be noticed.
        let step_announcing = |d: &mut SimDomain, step: &dyn Fn(&mut SimDomain)| {
            let was_exited = d.state.is_exited();
            step(d);
            if !was_exited && d.state.is_exited() {
                announce(events, d, DomainEventKind::Exited);
            }
        };
        self.domains.advance(
            now,
            |d| {
                step_announcing(d, &|d: &mut SimDomain| {
                    if d.state.is_exited() {
                        return;
                    }
                    if let Some(inc) = &d.incoming {
                        if inc.aborted.load(Ordering::SeqCst) {
                            d.state = DomainState::Exited(ExitCause::Crashed);
                            d.incoming = None;
                            return;
                        }
                        match inc.completes_at {
                            Some(at) if now >= at => {
                                if inc.fails {
                                    d.state = DomainState::Exited(ExitCause::Crashed);
                                    d.incoming = None;
                                } else {
                                    // Everything arrived: paused until resumed.
                                    d.state = DomainState::Paused;
                                }
                            }
                            _ => {}
                        }
                        return;
                    }
                    if let Some(out) = &d.outgoing {
                        if now >= out.completes_at
                            && !out.fails
                            && !out.unconfirmed
                            && !out.cancelled
                        {
                            // Handed over: the source stays paused until told to quit.
                            d.state = DomainState::Paused;
                            return;
                        }
                    }
                    if let Some(at) = d.crash_at {
                        if now >= at {
                            d.exit(ExitCause::Crashed, at);
                            return;
                        }
                    }
                    if let Some(at) = d.guest.agent_shutdown_at {
                        if now >= at + shutdown_ms {
                            d.exit(ExitCause::Poweroff, at + shutdown_ms);
                            return;
                        }
                    }
                    if let (Some(at), false) = (d.powerdown_requested_at, d.ignores_powerdown) {
                        // A guest still booting acts on the button once it is up.
                        let off_at = at.max(d.started_at + boot_ms) + shutdown_ms;
                        if now >= off_at {
                            d.exit(ExitCause::Poweroff, off_at);
                            return;
                        }
                    }
                    if d.state == DomainState::Starting && now >= d.started_at + boot_ms {
                        d.state = DomainState::Running;
                    }
                })
            },
            |d| d.next_change(now, boot_ms, shutdown_ms),
        );
    }

    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.rng.gen_bool(p.min(1.0))
    }

    /// Faults that strike a domain before the call acts on it.
    fn strike(&mut self, instance: &str, op: &'static str) -> Result<(), HvError> {
        let vanish = self.config.faults.vanish_between_calls;
        let exit = self.config.faults.spontaneous_exit;
        let live = self
            .domains
            .get(instance)
            .is_some_and(|d| d.executing() && d.outgoing.is_none());
        let acts = matches!(op, "shutdown" | "kill");
        if live && acts && self.chance(vanish) {
            self.domains.remove(instance);
            self.log.push(format!("{instance}: vanished before {op}"));
        } else if live && self.chance(exit) {
            let cause = if self.rng.gen_bool(0.5) {
                ExitCause::Crashed
            } else {
                ExitCause::Poweroff
            };
            if let Some(d) = self.domains.get_mut(instance) {
                d.state = DomainState::Exited(cause);
                announce(&self.events, d, DomainEventKind::Exited);
            }
            self.log
                .push(format!("{instance}: exited ({cause:?}) before {op}"));
        }
        Ok(())
    }

    /// A keeper refuses to start QEMU under a lapsed lease; an unfenced
    /// guest has no keeper.
    fn refuse_if_fenced(&mut self, spec: &DomainSpec, now: Millis) -> Result<(), HvError> {
        match self.fence_deadline {
            Some(deadline) if now >= deadline && spec.fenced => {
                self.log.push(format!(
                    "{}: start refused, fence lease lapsed",
                    spec.instance
                ));
                Err(HvError::Fence {
                    reason: "the node's fence lease has lapsed; not starting".into(),
                    source: None,
                })
            }
            _ => Ok(()),
        }
    }

    /// A stopped process's monitor does not answer: the call gives up, as
    /// the QEMU driver's bounded QMP call does.
    fn monitor_answers(&mut self, instance: &str, op: &'static str) -> Result<(), HvError> {
        let live = self
            .domains
            .get(instance)
            .is_some_and(|d| !d.state.is_exited());
        if live && self.stopped.contains(instance) {
            self.log
                .push(format!("{instance}: {op} unanswered (stopped)"));
            return Err(HvError::Unavailable {
                instance: instance.to_string(),
                op,
                reason: "QEMU is alive but QMP is not answered (process stopped)".into(),
                source: None,
            });
        }
        Ok(())
    }

    fn maybe_unavailable(
        &mut self,
        instance: &str,
        op: &'static str,
        p: f64,
    ) -> Result<(), HvError> {
        if self.chance(p) {
            self.log.push(format!("{instance}: {op} unavailable"));
            return Err(HvError::Unavailable {
                instance: instance.to_string(),
                op,
                reason: "injected fault".into(),
                source: None,
            });
        }
        Ok(())
    }

    /// The domain, or NotFound: absent is absent, for every call.
    fn domain_mut(&mut self, instance: &str) -> Result<&mut SimDomain, HvError> {
        self.domains
            .get_mut(instance)
            .ok_or_else(|| HvError::NotFound {
                instance: instance.to_string(),
            })
    }

    /// The domains of `vm`: a range of the map, by the instances' names.
    fn domains_of<'a>(&'a self, vm: &'a str) -> impl Iterator<Item = &'a SimDomain> + 'a {
        let prefix = instance_prefix(vm);
        self.domains
            .range(prefix.clone()..)
            .take_while(move |(instance, _)| instance.starts_with(&prefix))
            .map(|(_, d)| d)
            .filter(move |d| d.spec.vm == vm)
    }

    fn info_of(&self, instance: &str) -> Result<DomainInfo, HvError> {
        let d = self
            .domains
            .get(instance)
            .ok_or_else(|| HvError::NotFound {
                instance: instance.to_string(),
            })?;
        Ok(DomainInfo {
            instance: d.spec.instance.clone(),
            vm: d.spec.vm.clone(),
            state: d.state,
            pid: None,
            started_at: d.started_at,
            fenced: d.spec.fenced,
            resets: d.guest.resets,
        })
    }
}

#[async_trait]
impl Hypervisor for SimHypervisor {
    fn domain_events(&self) -> Option<tokio::sync::broadcast::Receiver<DomainEvent>> {
        Some(self.events.subscribe())
    }

    async fn facts(&self) -> NodeFacts {
        NodeFacts {
            hypervisor: "sim".into(),
            accelerator: Some(Accelerator::Sim),
            accelerator_note: "in-memory simulation driver".into(),
            migration: None,
            storage_id: None,
            // The simulation has no machine types: nothing is recorded.
            hardware: None,
            host: self.lock().config.host,
        }
    }

    async fn renew_fence(&self, valid_for: std::time::Duration) -> Result<(), HvError> {
        let now = self.clock.now_ms();
        self.lock().fence_deadline = Some(now + valid_for.as_millis() as Millis);
        Ok(())
    }

    async fn start(&self, spec: &DomainSpec) -> Result<(), HvError> {
        let now = self.clock.now_ms();
        check_instance_name(spec, "start")?;
        let mut s = self.lock();
        let p = s.config.faults.op_unavailable;
        s.maybe_unavailable(&spec.instance, "start", p)?;
        s.refuse_if_fenced(spec, now)?;
        if s.domains.contains_key(&spec.instance) {
            return Err(HvError::AlreadyExists {
                instance: spec.instance.clone(),
            });
        }
        // Every disk that may not be made must exist before any is made.
        {
            let mut all = self.disks();
            let made = all.get(&spec.vm).map(|d| &d.made);
            let missing = spec.disks.iter().find(|d| {
                !made.is_some_and(|m| m.contains(&d.name)) && !spec.create_disks.allows(&d.name)
            });
            if let Some(disk) = missing {
                return Err(HvError::Failed {
                    instance: spec.instance.clone(),
                    op: "start",
                    reason: format!(
                        "disk {} of VM {} is missing on node {}: the VM has run on it, so no \
                         blank one is made in its place",
                        disk.name, spec.vm, self.node
                    ),
                    source: None,
                });
            }
            // A clone's disks to make are copies of its source's at the
            // snapshot (the guest's records with them), never blank.
            let copied = spec.clone_from.as_ref().filter(|c| {
                spec.disks.iter().any(|d| {
                    c.disks.contains(&d.name)
                        && spec.create_disks.allows(&d.name)
                        && !made.is_some_and(|m| m.contains(&d.name))
                })
            });
            let copy = match copied {
                None => None,
                Some(c) => match all.get(&c.vm).and_then(|d| d.snapshots.get(&c.snapshot)) {
                    Some(records) => Some(records.clone()),
                    None => {
                        return Err(HvError::Failed {
                            instance: spec.instance.clone(),
                            op: "start",
                            reason: format!(
                                "the disks of VM {} are copies of VM {}'s at snapshot {},                                  which is missing on node {}: no blank disk is made in                                  their place",
                                spec.vm, c.vm, c.snapshot, self.node
                            ),
                            source: None,
                        });
                    }
                },
            };
            let disks = all.entry(spec.vm.clone()).or_default();
            disks.made.extend(spec.disks.iter().map(|d| d.name.clone()));
            if let Some(records) = copy {
                disks.records = records;
            }
        }
        if let Some((left, reason)) = s.failing_starts.get_mut(&spec.vm) {
            if *left > 0 {
                *left -= 1;
                return Err(HvError::Failed {
                    instance: spec.instance.clone(),
                    op: "start",
                    reason: reason.clone(),
                    source: None,
                });
            }
        }
        // By the VM's instance names, not a scan of every domain: with
        // 10,000 domains on a node the scan was most of a start's cost.
        let live: Vec<String> = s
            .domains_of(&spec.vm)
            .filter(|d| d.executing())
            .map(|d| d.spec.instance.clone())
            .collect();
        if !live.is_empty() {
            let v = format!(
                "t={now}: started {} while {:?} of VM {} still live",
                spec.instance, live, spec.vm
            );
            s.violations.push(v);
        }
        let starts = s.starts_per_vm.entry(spec.vm.clone()).or_insert(0);
        *starts += 1;
        let first = *starts == 1;
        let crash_next = s.crash_next_boot.remove(&spec.vm);
        let crash_at = ((first && s.config.faults.crash_on_first_boot) || crash_next)
            .then_some(now + s.config.boot_ms + 500);
        let ignore = s.config.faults.ignore_powerdown;
        let ignores_powerdown = s.chance(ignore);
        s.domains.insert(
            spec.instance.clone(),
            SimDomain {
                spec: spec.clone(),
                started_at: now,
                state: DomainState::Starting,
                powerdown_requested_at: None,
                ignores_powerdown,
                crash_at,
                incoming: None,
                outgoing: None,
                guest: SimGuest::default(),
            },
        );
        s.log.push(format!("t={now}: start {}", spec.instance));
        Ok(())
    }

    async fn shutdown(&self, instance: &str) -> Result<(), HvError> {
        self.hang_point(instance).await;
        let now = self.clock.now_ms();
        let mut s = self.lock();
        s.strike(instance, "shutdown")?;
        s.monitor_answers(instance, "shutdown")?;
        let p = s.config.faults.op_unavailable;
        s.maybe_unavailable(instance, "shutdown", p)?;
        let d = s.domain_mut(instance)?;
        if !d.state.is_exited() && d.powerdown_requested_at.is_none() {
            d.powerdown_requested_at = Some(now);
        }
        s.log.push(format!("t={now}: shutdown {instance}"));
        Ok(())
    }

    async fn kill(&self, instance: &str) -> Result<(), HvError> {
        self.hang_point(instance).await;
        let now = self.clock.now_ms();
        let mut s = self.lock();
        s.strike(instance, "kill")?;
        let p = s.config.faults.op_unavailable;
        s.maybe_unavailable(instance, "kill", p)?;
        let d = s.domain_mut(instance)?;
        if !d.state.is_exited() {
            d.exit(ExitCause::Killed, now);
            let vm = d.spec.vm.clone();
            let _ = s
                .events
                .send(DomainEvent::new(&vm, instance, DomainEventKind::Exited));
        }
        s.log.push(format!("t={now}: kill {instance}"));
        Ok(())
    }

    async fn info(&self, instance: &str) -> Result<DomainInfo, HvError> {
        self.hang_point(instance).await;
        let mut s = self.lock();
        s.strike(instance, "info")?;
        s.monitor_answers(instance, "info")?;
        let p = s.config.faults.lookup_unavailable;
        s.maybe_unavailable(instance, "info", p)?;
        s.info_of(instance)
    }

    async fn stats_all(&self) -> Result<Vec<crate::vm_stats::DomainStats>, HvError> {
        Ok(self.stats_now())
    }

    async fn list(&self) -> Result<DomainListing, HvError> {
        let mut s = self.lock();
        let p = s.config.faults.lookup_unavailable;
        s.maybe_unavailable("*", "list", p)?;
        let mut listing = DomainListing::default();
        for (instance, d) in s.domains.iter() {
            if s.hung.contains(instance) || (s.stopped.contains(instance) && !d.state.is_exited()) {
                // As the QEMU driver's bounded QMP look gives up on a hung
                // socket: listed, in a state nobody knows.
                listing.unknown.push(UnknownDomain {
                    instance: instance.clone(),
                    vm: Some(d.spec.vm.clone()),
                    fenced: d.spec.fenced,
                    error: HvError::Unavailable {
                        instance: instance.clone(),
                        op: "list",
                        reason: "calls to this domain hang".into(),
                        source: None,
                    },
                });
            } else {
                listing.domains.push(s.info_of(instance)?);
            }
        }
        Ok(listing)
    }

    async fn domains_of(&self, vm: &str) -> Result<Vec<DomainInfo>, HvError> {
        // Only this VM's domains, by name; a hung one of them hangs this
        // call as it hangs `info`, another VM's is never waited for.
        let hung: Vec<String> = {
            let s = self.lock();
            s.domains_of(vm)
                .filter(|d| s.hung.contains(&d.spec.instance))
                .map(|d| d.spec.instance.clone())
                .collect()
        };
        for instance in &hung {
            self.hang_point(instance).await;
        }
        let mut s = self.lock();
        let p = s.config.faults.lookup_unavailable;
        s.maybe_unavailable(&format!("{}*", instance_prefix(vm)), "list", p)?;
        let instances: Vec<String> = s.domains_of(vm).map(|d| d.spec.instance.clone()).collect();
        for instance in &instances {
            s.monitor_answers(instance, "list")?;
        }
        instances.iter().map(|i| s.info_of(i)).collect()
    }

    async fn cleanup(&self, instance: &str) -> Result<(), HvError> {
        self.hang_point(instance).await;
        let mut s = self.lock();
        let p = s.config.faults.op_unavailable;
        s.maybe_unavailable(instance, "cleanup", p)?;
        let state = s
            .domains
            .get(instance)
            .ok_or_else(|| HvError::NotFound {
                instance: instance.to_string(),
            })?
            .state;
        if !state.is_exited() {
            // The real drivers refuse this too, but a controller that asks
            // has concluded "gone" about a live domain: that is the bug.
            let v = format!("cleanup requested for live instance {instance}");
            s.violations.push(v);
            return Err(HvError::StillRunning {
                instance: instance.to_string(),
                state,
            });
        }
        s.domains.remove(instance);
        s.stopped.remove(instance);
        s.log.push(format!("cleanup {instance}"));
        Ok(())
    }

    async fn delete_disks(&self, vm: &str) -> Result<(), HvError> {
        let mut s = self.lock();
        let p = s.config.faults.op_unavailable;
        s.maybe_unavailable(vm, "delete_disks", p)?;
        if s.domains
            .values()
            .any(|d| d.spec.vm == vm && !d.state.is_exited())
        {
            let v = format!("deleted disks of VM {vm} while an instance is live");
            s.violations.push(v);
        }
        drop(s);
        self.disks().remove(vm);
        Ok(())
    }

    async fn prepare_incoming_from(
        &self,
        spec: &DomainSpec,
        params: &crate::IncomingParams,
    ) -> Result<String, HvError> {
        let now = self.clock.now_ms();
        let uri = format!("sim://{}/{}", self.node, spec.instance);
        check_instance_name(spec, "prepare incoming")?;
        {
            let mut s = self.lock();
            let p = s.config.faults.op_unavailable;
            s.maybe_unavailable(&spec.instance, "prepare incoming", p)?;
            s.refuse_if_fenced(spec, now)?;
            if s.domains.contains_key(&spec.instance) {
                return Err(HvError::AlreadyExists {
                    instance: spec.instance.clone(),
                });
            }
            s.domains.insert(
                spec.instance.clone(),
                SimDomain {
                    spec: spec.clone(),
                    started_at: now,
                    state: DomainState::Starting,
                    powerdown_requested_at: None,
                    ignores_powerdown: false,
                    crash_at: None,
                    incoming: Some(Incoming {
                        completes_at: None,
                        fails: false,
                        aborted: Arc::new(AtomicBool::new(false)),
                        admits: params.tls_peer.clone(),
                    }),
                    outgoing: None,
                    guest: SimGuest::default(),
                },
            );
            s.log
                .push(format!("t={now}: incoming {} at {uri}", spec.instance));
        }
        self.fabric
            .targets
            .lock()
            .expect("fabric poisoned")
            .insert(uri.clone(), self.state.clone());
        Ok(uri)
    }

    async fn migrate_tuned(
        &self,
        instance: &str,
        uri: &str,
        params: &crate::MigrationParams,
    ) -> Result<(), HvError> {
        let now = self.clock.now_ms();
        let target_state = self
            .fabric
            .targets
            .lock()
            .expect("fabric poisoned")
            .get(uri)
            .cloned()
            .ok_or_else(|| HvError::Failed {
                instance: instance.to_string(),
                op: "migrate",
                reason: format!("nothing listens at {uri}"),
                source: None,
            })?;
        if Arc::ptr_eq(&target_state, &self.state) {
            return Err(HvError::Failed {
                instance: instance.to_string(),
                op: "migrate",
                reason: "source and target are the same node".into(),
                source: None,
            });
        }
        let target_instance = uri.rsplit('/').next().unwrap_or_default().to_string();
        let admits = target_state
            .lock()
            .expect("sim state poisoned")
            .domains
            .get(&target_instance)
            .and_then(|d| d.incoming.as_ref()?.admits.clone());
        if admits.as_ref().is_some_and(|node| *node != self.node) {
            return Err(HvError::Failed {
                instance: instance.to_string(),
                op: "migrate",
                reason: format!(
                    "target {target_instance} admits only node {}, not {}",
                    admits.unwrap_or_default(),
                    self.node
                ),
                source: None,
            });
        }
        let (completes_at, fails, abort) = {
            let mut s = self.lock();
            let p = s.config.faults.op_unavailable;
            s.maybe_unavailable(instance, "migrate", p)?;
            let fail_p = s.config.faults.migration_fails;
            let fails = s.chance(fail_p);
            let stall_p = s.config.faults.migration_stalls;
            let stalls = s.chance(stall_p);
            let unconfirmed_p = s.config.faults.handover_unconfirmed;
            let unconfirmed = !fails && s.chance(unconfirmed_p);
            let completes_at = if stalls {
                Millis::MAX
            } else {
                now + s.config.migration_ms
            };
            let d = s.domain_mut(instance)?;
            if !d.executing() || d.state != DomainState::Running {
                return Err(HvError::Failed {
                    instance: instance.to_string(),
                    op: "migrate",
                    reason: format!("source is {:?}", d.state),
                    source: None,
                });
            }
            if d.outgoing
                .as_ref()
                .is_some_and(|o| !o.cancelled && !o.fails)
            {
                // Already under way (a retried call): nothing new to start.
                return Ok(());
            }
            let abort = Arc::new(AtomicBool::new(false));
            d.outgoing = Some(Outgoing {
                started_at: now,
                completes_at,
                fails,
                stalls,
                unconfirmed,
                cancelled: false,
                abort: abort.clone(),
                params: params.clone(),
                reported: false,
            });
            s.log.push(format!("t={now}: migrate {instance} -> {uri}"));
            (completes_at, fails, abort)
        };
        let mut t = target_state.lock().expect("sim state poisoned");
        t.advance(now);
        match t.domains.get_mut(&target_instance) {
            Some(d) if d.incoming.is_some() => {
                d.incoming = Some(Incoming {
                    completes_at: Some(completes_at),
                    fails,
                    aborted: abort,
                    admits,
                });
                Ok(())
            }
            _ => Err(HvError::Failed {
                instance: instance.to_string(),
                op: "migrate",
                reason: format!("target {target_instance} is not waiting for a migration"),
                source: None,
            }),
        }
    }

    async fn migration_status(&self, instance: &str) -> Result<MigrationProgress, HvError> {
        let now = self.clock.now_ms();
        let mut s = self.lock();
        s.monitor_answers(instance, "query migration")?;
        let p = s.config.faults.lookup_unavailable;
        s.maybe_unavailable(instance, "query migration", p)?;
        let migration_ms = s.config.migration_ms;
        let d = s
            .domains
            .get_mut(instance)
            .ok_or_else(|| HvError::NotFound {
                instance: instance.to_string(),
            })?;
        let exited = d.state.is_exited();
        let Some(o) = d.outgoing.as_mut() else {
            return Ok(MigrationProgress::None);
        };
        let progress = if o.cancelled {
            MigrationProgress::Failed {
                reason: "cancelled".into(),
            }
        } else if o.stalls && !exited {
            let transferred = (now - o.started_at).min(migration_ms / 2) * 1000;
            return Ok(MigrationProgress::Active {
                transferred_bytes: transferred,
                total_bytes: migration_ms * 1000,
                remaining_bytes: migration_ms * 1000 - transferred,
            });
        } else if now < o.completes_at && !exited {
            return Ok(MigrationProgress::Active {
                transferred_bytes: (now - o.started_at) * 1000,
                total_bytes: (o.completes_at - o.started_at) * 1000,
                remaining_bytes: (o.completes_at - now) * 1000,
            });
        } else if o.fails || o.unconfirmed {
            MigrationProgress::Failed {
                reason: "injected migration failure".into(),
            }
        } else {
            MigrationProgress::Completed {
                total_ms: o.completes_at - o.started_at,
                downtime_ms: Some(50),
            }
        };
        // As the qemu driver: an outcome is known once it was seen while
        // the source lived; a source that died first leaves it unknown.
        if exited && !o.reported {
            return Ok(MigrationProgress::Unknown {
                reason: format!("source instance {instance} exited before the outcome was seen"),
            });
        }
        o.reported = true;
        Ok(progress)
    }

    async fn resume_incoming(&self, instance: &str) -> Result<(), HvError> {
        let now = self.clock.now_ms();
        let mut s = self.lock();
        s.monitor_answers(instance, "resume incoming")?;
        let p = s.config.faults.op_unavailable;
        s.maybe_unavailable(instance, "resume incoming", p)?;
        let d = s.domain_mut(instance)?;
        match (&d.incoming, d.state) {
            (None, DomainState::Running) => return Ok(()),
            (Some(inc), DomainState::Paused) if inc.completes_at.is_some_and(|at| now >= at) => {
                d.incoming = None;
                d.state = DomainState::Running;
                let vm = d.spec.vm.clone();
                let _ = s
                    .events
                    .send(DomainEvent::new(&vm, instance, DomainEventKind::Resumed));
            }
            (_, state) => {
                return Err(HvError::Failed {
                    instance: instance.to_string(),
                    op: "resume incoming",
                    reason: format!("not an arrived incoming instance ({state:?})"),
                    source: None,
                })
            }
        }
        s.log.push(format!("t={now}: resume incoming {instance}"));
        Ok(())
    }

    async fn cancel_migration(&self, instance: &str) -> Result<(), HvError> {
        let now = self.clock.now_ms();
        let mut s = self.lock();
        s.monitor_answers(instance, "cancel migration")?;
        let too_late_p = s.config.faults.cancel_too_late;
        let too_late = s.chance(too_late_p);
        let d = s.domain_mut(instance)?;
        if let Some(o) = d.outgoing.as_mut() {
            if now < o.completes_at && !o.cancelled && !too_late {
                o.cancelled = true;
                o.abort.store(true, Ordering::SeqCst);
            }
        }
        Ok(())
    }

    async fn console_tail(
        &self,
        instance: &str,
        max_bytes: u64,
    ) -> Result<(Vec<u8>, u64), HvError> {
        let now = self.clock.now_ms();
        let log = self.lock().console(instance, now)?;
        let len = log.len() as u64;
        let start = log.len().saturating_sub(max_bytes.min(len) as usize);
        Ok((log[start..].to_vec(), len))
    }

    async fn console_contains(&self, instance: &str, text: &str) -> Result<bool, HvError> {
        let now = self.clock.now_ms();
        let log = self.lock().console_of_this_boot(instance, now)?;
        let needle = text.as_bytes();
        Ok(needle.is_empty() || log.windows(needle.len()).any(|w| w == needle))
    }

    async fn open_console(&self, instance: &str) -> Result<crate::ConsoleStream, HvError> {
        let op = "attach console";
        {
            let mut s = self.lock();
            let d = s.domain_mut(instance)?;
            if d.state.is_exited() {
                return Err(sim_failed(instance, op, "the instance has exited"));
            }
        }
        let claim = self.consoles.claim(instance).ok_or_else(|| {
            sim_failed(
                instance,
                op,
                "another console session is attached; only one at a time",
            )
        })?;
        // The guest side: a line-echoing shell, so tests can see their
        // input arrive and an answer come back.
        let (ours, guest) = tokio::io::duplex(4096);
        let state = self.state.clone();
        let instance_id = instance.to_string();
        tokio::spawn(async move {
            use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
            let (read, mut write) = tokio::io::split(guest);
            let mut lines = tokio::io::BufReader::new(read).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let answer = format!("{line}\r\nsim: {}\r\n# ", line.trim());
                if let Some(d) = state
                    .lock()
                    .expect("sim state poisoned")
                    .domains
                    .get_mut(&instance_id)
                {
                    d.guest.console_extra.extend_from_slice(answer.as_bytes());
                }
                if write.write_all(answer.as_bytes()).await.is_err() {
                    break;
                }
            }
        });
        Ok(crate::ConsoleStream::new(
            Box::new(ours),
            Some(Box::new(claim)),
        ))
    }

    async fn guest_info(&self, instance: &str) -> Result<crate::GuestInfo, HvError> {
        self.hang_point(instance).await;
        let now = self.clock.now_ms();
        let mut s = self.lock();
        let p = s.config.faults.lookup_unavailable;
        s.maybe_unavailable(instance, "query guest agent", p)?;
        let agent_ready_ms = s.config.boot_ms + s.config.agent_ready_ms;
        let d = s.domain_mut(instance)?;
        if let Some(why) = d.agent_silence(now, agent_ready_ms) {
            return Ok(crate::GuestInfo::silent(why));
        }
        let agent = crate::AgentState::Answering {
            version: Some("sim".into()),
        };
        if let Some(answers) = &s.config.agent_answers {
            let kept = crate::qemu::guest_agent::parse_interfaces(&answers.interfaces);
            return Ok(crate::GuestInfo {
                agent,
                ips: kept.ips,
                hostname: crate::qemu::guest_agent::parse_hostname(&answers.host_name),
                note: (!kept.dropped.is_empty()).then(|| kept.dropped.join("; ")),
            });
        }
        let d = s.domain_mut(instance)?;
        Ok(crate::GuestInfo {
            agent,
            ips: SIM_GUEST_IPS
                .iter()
                .filter_map(|(i, a, p)| crate::GuestIp::parse(i, a, u64::from(*p)))
                .collect(),
            hostname: Some(d.spec.vm.clone()),
            note: None,
        })
    }

    async fn fs_freeze(&self, instance: &str) -> Result<u32, HvError> {
        let now = self.clock.now_ms();
        let mut s = self.lock();
        let agent_ready_ms = s.config.boot_ms + s.config.agent_ready_ms;
        let d = s.domain_mut(instance)?;
        d.guest.freezes += 1;
        if let Some(why) = d.agent_silence(now, agent_ready_ms) {
            return Err(sim_failed(instance, "freeze filesystems", why));
        }
        d.guest.frozen = true;
        Ok(1)
    }

    async fn fs_thaw(&self, instance: &str) -> Result<u32, HvError> {
        let now = self.clock.now_ms();
        let mut s = self.lock();
        let agent_ready_ms = s.config.boot_ms + s.config.agent_ready_ms;
        let d = s.domain_mut(instance)?;
        d.guest.thaws += 1;
        if let Some(why) = d.agent_silence(now, agent_ready_ms) {
            return Err(sim_failed(instance, "thaw filesystems", why));
        }
        let was = d.guest.frozen;
        d.guest.frozen = false;
        Ok(u32::from(was))
    }

    async fn guest_shutdown(&self, instance: &str) -> Result<(), HvError> {
        self.hang_point(instance).await;
        let now = self.clock.now_ms();
        let mut s = self.lock();
        let agent_ready_ms = s.config.boot_ms + s.config.agent_ready_ms;
        let d = s.domain_mut(instance)?;
        if let Some(why) = d.agent_silence(now, agent_ready_ms) {
            return Err(sim_failed(
                instance,
                "shut down through the guest agent",
                why,
            ));
        }
        d.guest.agent_shutdown_at.get_or_insert(now);
        s.log.push(format!("t={now}: guest-shutdown {instance}"));
        Ok(())
    }

    async fn guest_reboot(&self, instance: &str) -> Result<(), HvError> {
        self.reboot_through_agent(instance).await
    }

    async fn reset(&self, instance: &str) -> Result<(), HvError> {
        self.reset_by_hypervisor(instance).await
    }

    async fn attach_disk(&self, plug: &crate::DiskPlug) -> Result<(), HvError> {
        self.attach_now(plug)
    }

    async fn detach_disk(
        &self,
        _vm: &str,
        instance: &str,
        disk: &str,
    ) -> Result<crate::DiskDetach, HvError> {
        self.detach_now(instance, disk)
    }

    async fn grow_disk(
        &self,
        _vm: &str,
        instance: &str,
        disk: &str,
        size_mib: u64,
    ) -> Result<(), HvError> {
        self.grow_disk_now(instance, disk, size_mib)
    }

    async fn snapshot_disks(
        &self,
        vm: &str,
        _disks: &[keel_api::DiskSpec],
        _instance: Option<&str>,
        name: &str,
    ) -> Result<(), HvError> {
        let mut s = self.lock();
        let p = s.config.faults.op_unavailable;
        s.maybe_unavailable(vm, "snapshot", p)?;
        drop(s);
        let mut all = self.disks();
        let disks = all.entry(vm.to_string()).or_default();
        if !disks.snapshots.contains_key(name) {
            let records = disks.records.clone();
            disks.snapshots.insert(name.to_string(), records);
        }
        Ok(())
    }

    async fn restore_disks(
        &self,
        vm: &str,
        _disks: &[keel_api::DiskSpec],
        name: &str,
    ) -> Result<(), HvError> {
        let mut s = self.lock();
        let p = s.config.faults.op_unavailable;
        s.maybe_unavailable(vm, "restore", p)?;
        if s.domains
            .values()
            .any(|d| d.spec.vm == vm && !d.state.is_exited())
        {
            let v = format!("restored disks of VM {vm} while an instance is live");
            s.violations.push(v);
        }
        drop(s);
        let mut all = self.disks();
        let disks = all.entry(vm.to_string()).or_default();
        let records = disks
            .snapshots
            .get(name)
            .cloned()
            .ok_or_else(|| HvError::Storage {
                vm: vm.to_string(),
                op: "restore",
                reason: format!("snapshot {name} not found"),
                source: None,
            })?;
        disks.records = records;
        Ok(())
    }

    async fn export_disks(
        &self,
        vm: &str,
        disks: &[keel_api::DiskSpec],
        snapshot: &str,
        dir: &std::path::Path,
    ) -> Result<Vec<String>, HvError> {
        self.write_export(vm, disks, snapshot, dir)
    }

    async fn import_disks(
        &self,
        vm: &str,
        disks: &[keel_api::DiskSpec],
        dir: &std::path::Path,
    ) -> Result<(), HvError> {
        self.take_import(vm, disks, dir)
    }

    async fn delete_snapshot(
        &self,
        vm: &str,
        _disks: &[keel_api::DiskSpec],
        name: &str,
    ) -> Result<(), HvError> {
        if let Some(disks) = self.disks().get_mut(vm) {
            disks.snapshots.remove(name);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DiskCreation;
    use keel_api::ManualClock;

    fn spec(vm: &str, instance: &str) -> DomainSpec {
        DomainSpec::bare(vm, instance, 1, 64)
    }

    /// A second start of a VM while an instance of it still runs is a
    /// violation the simulations catch; an instance of another VM whose
    /// name extends this one's (`a-b` beside `a`) is not.
    #[tokio::test]
    async fn starting_a_vm_twice_while_live_is_a_violation() {
        let clock = ManualClock::new(0);
        let hv = SimHypervisor::new(Arc::new(clock.clone()), 1, SimConfig::default());
        hv.start(&spec("a", "a-1")).await.unwrap();
        hv.start(&spec("a-b", "a-b-1")).await.unwrap();
        assert!(hv.violations().is_empty(), "{:?}", hv.violations());
        hv.start(&spec("a", "a-2")).await.unwrap();
        let violations = hv.violations();
        assert_eq!(violations.len(), 1, "{violations:?}");
        assert!(
            violations[0].contains("started a-2 while [\"a-1\"] of VM a still live"),
            "{violations:?}"
        );
        hv.kill("a-1").await.unwrap();
        hv.kill("a-2").await.unwrap();
        hv.start(&spec("a", "a-3")).await.unwrap();
        assert_eq!(hv.violations().len(), 1, "{:?}", hv.violations());
    }

    #[tokio::test]
    async fn a_start_that_may_not_create_disks_needs_them_to_exist() {
        let clock = ManualClock::new(0);
        let hv = SimHypervisor::new(Arc::new(clock.clone()), 1, SimConfig::default());
        let disk = |name: &str| keel_api::DiskSpec {
            name: name.into(),
            size_mib: 64,
            image: None,
        };
        let used = DomainSpec {
            disks: vec![disk("root")],
            create_disks: DiskCreation::none(),
            ..spec("a", "a-1")
        };
        let err = hv.start(&used).await.unwrap_err();
        assert!(matches!(err, HvError::Failed { .. }), "{err:?}");
        assert!(!hv.has_disk("a", "root") && hv.live_instances("a").is_empty());
        hv.start(&DomainSpec {
            instance: "a-2".into(),
            create_disks: DiskCreation::all_of(&used.disks),
            ..used.clone()
        })
        .await
        .unwrap();
        hv.kill("a-2").await.unwrap();
        hv.start(&DomainSpec {
            instance: "a-3".into(),
            ..used.clone()
        })
        .await
        .unwrap();
        hv.kill("a-3").await.unwrap();
        // A second disk may be made beside the one that must exist; lost,
        // the first fails the start and the second is not made either.
        let two = DomainSpec {
            disks: vec![disk("root"), disk("extra")],
            create_disks: DiskCreation::Only(vec!["extra".into()]),
            ..used.clone()
        };
        hv.lose_disk("a", "root");
        let err = hv
            .start(&DomainSpec {
                instance: "a-4".into(),
                ..two.clone()
            })
            .await
            .unwrap_err();
        assert!(
            err.to_string().contains("disk root of VM a is missing"),
            "{err}"
        );
        assert!(!hv.has_disk("a", "extra"), "nothing made by a failed start");
        hv.start(&DomainSpec {
            instance: "a-5".into(),
            create_disks: DiskCreation::all_of(&two.disks),
            ..two.clone()
        })
        .await
        .unwrap();
        assert!(hv.has_disk("a", "root") && hv.has_disk("a", "extra"));
    }

    #[tokio::test]
    async fn exited_domains_are_remembered_until_cleanup() {
        let clock = ManualClock::new(0);
        let hv = SimHypervisor::new(Arc::new(clock.clone()), 1, SimConfig::default());
        hv.start(&spec("a", "a-1")).await.unwrap();
        clock.advance(2_000);
        assert_eq!(hv.info("a-1").await.unwrap().state, DomainState::Running);
        hv.shutdown("a-1").await.unwrap();
        // Still running while the guest powers off: bookkeeping must not vanish.
        assert_eq!(hv.info("a-1").await.unwrap().state, DomainState::Running);
        clock.advance(3_000);
        assert_eq!(
            hv.info("a-1").await.unwrap().state,
            DomainState::Exited(ExitCause::Poweroff)
        );
        hv.cleanup("a-1").await.unwrap();
        assert!(hv.info("a-1").await.unwrap_err().is_not_found());
    }

    #[tokio::test]
    async fn cleanup_refuses_a_live_domain_and_second_start_is_flagged() {
        let clock = ManualClock::new(0);
        let hv = SimHypervisor::new(Arc::new(clock.clone()), 1, SimConfig::default());
        hv.start(&spec("a", "a-1")).await.unwrap();
        assert!(matches!(
            hv.cleanup("a-1").await,
            Err(HvError::StillRunning { .. })
        ));
        hv.start(&spec("a", "a-2")).await.unwrap();
        assert_eq!(hv.violations().len(), 2);
    }
}
