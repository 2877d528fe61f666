//! Drives the controllers: events in (store watch events, driver exit
//! hints, "watch broke" followed by a relist), due keys out, time only
//! through [`keel_api::Clock`]. The parts, after kube-rs' runtime:
//! [`event`] (what is heard), [`source`] (watches and relisting),
//! [`reconciler`] (which keys an event wakes, one look at a key, the error
//! policy), [`scheduler`] (one entry per key, earliest wins) and [`runner`]
//! (bounded concurrency, never two reconciles of one key). [`Runtime`]
//! joins them; production waits on tokio between steps
//! ([`Runtime::run`]), the simulations move a manual clock and call
//! [`Runtime::settle`].

pub mod event;
pub mod reason;
pub mod reconciler;
pub mod runner;
mod running;
pub mod scheduler;
pub mod source;

use std::sync::Arc;
use std::time::Duration;

use keel_api::{Clock, Millis};
use keel_store::Store;
use tokio::sync::watch;

pub use event::Event;
pub use reconciler::Reconciler;
pub use runner::{Key, Runner};
pub use running::{RunningControllers, StopError};
pub use source::{EventSource, Incoming};

use crate::node_lease::heartbeat::pause_after;
use crate::node_lease::{Heartbeat, HEARTBEAT_INTERVAL_MS};
use crate::{LifecycleObserver, MigrationController, SnapshotController, VmController};

/// How many reconciles of distinct keys may run at once, by default.
pub const DEFAULT_MAX_CONCURRENT_RECONCILES: usize = 32;

/// Never more between two looks at the clock with nothing due (a guard
/// against a clock that jumps).
const IDLE_WAKE_MS: Millis = 60_000;

/// Rounds [`Runtime::settle`] takes at most at one instant: a bound, so a
/// reconciler that keeps asking for "now" cannot hang a simulation.
const SETTLE_ROUNDS: usize = 10_000;
/// Most events taken in at once, after the one waited for, before the
/// loop looks at its other duties again.
const ARRIVED_AT_ONCE: usize = 1_024;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeConfig {
    /// Reconciles of distinct keys (VMs, snapshots, migrations) running at
    /// once; one key never runs twice at once whatever this is.
    pub max_concurrent_reconciles: usize,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            max_concurrent_reconciles: DEFAULT_MAX_CONCURRENT_RECONCILES,
        }
    }
}

/// The node's reconcile runtime: its event source feeding its runner.
pub struct Runtime {
    clock: Arc<dyn Clock>,
    source: EventSource,
    runner: Runner,
}

impl Runtime {
    /// A runtime without reconcilers, watching `store`.
    pub fn new(
        store: Arc<dyn Store>,
        domain_events: Option<tokio::sync::broadcast::Receiver<keel_hv::DomainEvent>>,
        clock: Arc<dyn Clock>,
        observer: Arc<dyn LifecycleObserver>,
        retry_ms: Millis,
        cfg: &RuntimeConfig,
    ) -> Self {
        Self {
            source: EventSource::new(store, domain_events, retry_ms),
            runner: Runner::new(clock.clone(), observer, cfg.max_concurrent_reconciles),
            clock,
        }
    }

    /// A node's runtime: its VM, snapshot and migration controllers (in
    /// that order, which is the order ties run in), on the VM
    /// controller's store, domain events and retry interval.
    pub fn for_node(
        vms: Arc<VmController>,
        snapshots: Arc<SnapshotController>,
        migrations: Arc<MigrationController>,
        clock: Arc<dyn Clock>,
        cfg: &RuntimeConfig,
    ) -> Self {
        let mut runtime = Self::new(
            vms.watched_store(),
            vms.domain_events(),
            clock,
            vms.observer().clone(),
            vms.config().retry_ms,
            cfg,
        );
        runtime.reflect(vms.reflector().clone());
        runtime.add(vms);
        runtime.add(snapshots);
        runtime.add(migrations);
        runtime
    }

    /// Keeps `vms` current with the VM records this runtime lists and
    /// watches (see [`VmController::reflector`]).
    pub fn reflect(&mut self, vms: Arc<crate::vm_index::ClusterReflector>) {
        self.source.reflect(vms);
    }

    pub fn add<R: Reconciler>(&mut self, reconciler: Arc<R>) {
        self.runner.add(reconciler);
    }

    /// Asks for a look at `name` by the reconciler of `kind` at `at`;
    /// whether such a reconciler exists.
    pub fn schedule(&mut self, kind: &str, name: &str, at: Millis) -> bool {
        let Some(reconciler) = self.runner.reconciler_of(kind) else {
            return false;
        };
        let key = Key {
            reconciler,
            name: name.to_string(),
        };
        self.runner.schedule(key, at, reason::Reason::Asked);
        true
    }

    /// When the reconciler of `kind` is next due to look at `name`, if
    /// queued (not while it runs).
    pub fn due_at(&self, kind: &str, name: &str) -> Option<Millis> {
        let reconciler = self.runner.reconciler_of(kind)?;
        self.runner.due_at(&Key {
            reconciler,
            name: name.to_string(),
        })
    }

    /// The next time anything is due: a queued key or the relist.
    pub fn next_wake(&self) -> Option<Millis> {
        [self.runner.wake_at(), self.source.relist_at()]
            .into_iter()
            .flatten()
            .min()
    }

    /// Reconciles under way.
    pub fn in_flight(&self) -> usize {
        self.runner.in_flight()
    }

    /// Relists if the watches are closed and the retry time has come.
    /// Whether it listed.
    async fn relist_if_due(&mut self) -> bool {
        let now = self.clock.now_ms();
        if self.source.relist_at().is_none_or(|at| at > now) {
            return false;
        }
        match self.source.relist(now).await {
            Ok(events) => {
                for event in &events {
                    self.runner.handle(event);
                }
            }
            Err(err) => tracing::warn!(%err, "cannot list to (re)open the watches; retrying"),
        }
        true
    }

    fn take(&mut self, incoming: Incoming) {
        match incoming {
            Incoming::Event(event) => self.runner.handle(&event),
            Incoming::Elsewhere => {}
            Incoming::Broken(err) => {
                match err {
                    Some(err) => tracing::warn!(%err, "controller watch broke; re-listing"),
                    None => tracing::warn!("controller watch ended; re-listing"),
                }
                self.source.broke(self.clock.now_ms());
            }
        }
    }

    /// Takes in the events that have already arrived too: one event per
    /// turn of the loop (with a timer set and dropped each turn) made a
    /// node that fell behind a burst of writes stay behind, until its
    /// store's history no longer reached back to it and it listed
    /// everything again. The reconciles they wake start together after.
    fn take_arrived(&mut self) {
        for _ in 0..ARRIVED_AT_ONCE {
            match self.source.try_next() {
                Some(incoming) => {
                    let broken = matches!(incoming, Incoming::Broken(_));
                    self.take(incoming);
                    if broken {
                        return;
                    }
                }
                None => return,
            }
        }
    }

    /// Production: runs until `stop` turns true, waiting on tokio for the
    /// next due time, the next event or the next finished reconcile. On
    /// stop, waits for the reconciles under way.
    pub async fn run(mut self, mut stop: watch::Receiver<bool>) {
        while !*stop.borrow() {
            self.relist_if_due().await;
            self.runner.start_due();
            let wait_ms = self
                .next_wake()
                .map(|at| at.saturating_sub(self.clock.now_ms()))
                .unwrap_or(IDLE_WAKE_MS)
                .min(IDLE_WAKE_MS);
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(wait_ms)) => {}
                () = self.runner.finish_next() => {}
                incoming = self.source.next() => {
                    self.take(incoming);
                    self.take_arrived();
                }
                _ = stop.changed() => {}
            }
        }
        self.runner.finish_all().await;
    }

    /// Simulation: does everything that is ready at the clock's current
    /// time, in one defined order, and returns once nothing more is
    /// (reconciles still waiting, e.g. on a hung hypervisor call, go on
    /// running). Delivers arrived events, relists if due, takes in
    /// finished reconciles and starts due ones, round after round. On a
    /// current-thread tokio runtime this replays exactly. Returns how many
    /// reconciles finished.
    pub async fn settle(&mut self) -> usize {
        let mut finished = 0;
        for _ in 0..SETTLE_ROUNDS {
            // Lets the watches' pumps and the started reconciles run.
            tokio::task::yield_now().await;
            tokio::task::yield_now().await;
            let mut progress = self.relist_if_due().await;
            while let Some(incoming) = self.source.try_next() {
                self.take(incoming);
                progress = true;
            }
            let done = self.runner.finish_ready();
            finished += done;
            progress |= done > 0;
            progress |= self.runner.start_due() > 0;
            if !progress {
                break;
            }
        }
        finished
    }
}

/// Runs the VM controller and a snapshot and a migration controller
/// sharing its store, node and clock, until `stop` turns true.
pub async fn run_vm_controller(
    vms: Arc<VmController>,
    clock: Arc<dyn Clock>,
    stop: watch::Receiver<bool>,
) {
    run_vm_controller_with(vms, clock, RuntimeConfig::default(), stop).await
}

/// [`run_vm_controller`] with the runtime's settings (`keel serve` and
/// `keel agent --max-concurrent-reconciles`).
pub async fn run_vm_controller_with(
    vms: Arc<VmController>,
    clock: Arc<dyn Clock>,
    cfg: RuntimeConfig,
    stop: watch::Receiver<bool>,
) {
    let snapshots = Arc::new(vms.snapshot_controller());
    let migrations = Arc::new(vms.migration_controller());
    run_controllers(vms, snapshots, migrations, clock, &cfg, stop).await
}

/// Runs until `stop` turns true and the reconciles under way have
/// finished; the heartbeat goes on until then (see [`run_housekeeping`]).
/// Store outages are retried, never fatal.
pub async fn run_controllers(
    vms: Arc<VmController>,
    snapshots: Arc<SnapshotController>,
    migrations: Arc<MigrationController>,
    clock: Arc<dyn Clock>,
    cfg: &RuntimeConfig,
    stop: watch::Receiver<bool>,
) {
    let runtime = Runtime::for_node(vms.clone(), snapshots, migrations, clock.clone(), cfg);
    // Housekeeping runs on its own: during a store outage the runtime is
    // stuck re-listing, and that is exactly when self-fencing must still
    // happen.
    let (finished, finished_rx) = watch::channel(false);
    let runtime_stop = stop.clone();
    let runtime = async {
        runtime.run(runtime_stop).await;
        let _ = finished.send(true);
    };
    tokio::join!(runtime, run_housekeeping(&vms, &clock, stop, finished_rx));
}

/// The heartbeat (with the fence-lease renewal, [`Heartbeat::beat`]) and
/// the other chores run on loops of their own: a chore stuck on a hung
/// hypervisor or store call must never delay the heartbeat, or a healthy
/// node would be fenced. The chores end with `stop`, the heartbeat only
/// once the runtime has `finished` the reconciles under way at the stop:
/// one may take longer than the fence lease, and the guests must not be
/// fenced while their agent is still there.
async fn run_housekeeping(
    vms: &VmController,
    clock: &Arc<dyn Clock>,
    stop: watch::Receiver<bool>,
    finished: watch::Receiver<bool>,
) {
    let every = Duration::from_millis(HEARTBEAT_INTERVAL_MS);
    let heartbeat = Heartbeat::new(clock.mono());
    let lease = async {
        let mut stop = finished;
        while !*stop.borrow() {
            let started = tokio::time::Instant::now();
            let got_through = heartbeat.beat(vms, clock.as_ref()).await;
            let took_ms = started.elapsed().as_millis() as Millis;
            let pause = Duration::from_millis(pause_after(took_ms, got_through));
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = stop.changed() => {}
            }
        }
    };
    let chores = async {
        let mut stop = stop.clone();
        while !*stop.borrow() {
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = stop.changed() => {}
            }
            // The chores act on the cluster's state only while this node's
            // own heartbeat gets through: a node cut off must not take over
            // others.
            if !*stop.borrow() && heartbeat.recent(clock.mono()) {
                vms.chores().await;
            }
        }
    };
    tokio::join!(lease, chores);
}
