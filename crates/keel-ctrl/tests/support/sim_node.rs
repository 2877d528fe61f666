//! One simulated node process, wired once for both simulations (`World`
//! in `tests/common`, `Cluster`'s agents in `tests/cluster`): its store
//! handle, its sim hypervisor's host, its controllers and the production
//! runtime that drives them. What differs between the two harnesses is a
//! parameter ([`NodeWiring`]); a restart is [`SimNode::start`] again on the
//! same wiring (same store, host and clock, nothing else carried over).
//!
//! It stays test code beside the simulations rather than in keel-testkit:
//! it needs keel-ctrl, which dev-depends on keel-testkit.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use async_trait::async_trait;

use keel_api::{Clock, Millis};
use keel_ctrl::requeue::Requeue;
use keel_ctrl::runtime::Event;
use keel_ctrl::{
    LifecycleConfig, MigrationController, Reconciler, Runtime, RuntimeConfig, SnapshotController,
    VmController,
};
use keel_hv::sim::{SimConfig, SimFabric, SimHypervisor};
use keel_store::{Store, TypedStore};

/// A node's simulated host. `fabric`: the shared storage it joins as
/// `node` (`None`: a lone host with its own).
pub fn sim_host(
    clock: Arc<dyn Clock>,
    seed: u64,
    sim: SimConfig,
    fabric: Option<(&SimFabric, &str)>,
) -> SimHypervisor {
    match fabric {
        Some((fabric, node)) => SimHypervisor::join(clock, seed, sim, fabric, node),
        None => SimHypervisor::new(clock, seed, sim),
    }
}

/// What one node process is made of, kept across its restarts.
#[derive(Clone)]
pub struct NodeWiring {
    /// The node's own clock (a cluster's nodes may be skewed).
    pub clock: Arc<dyn Clock>,
    /// The node's handle on the store, with whatever faults it suffers.
    pub store: Arc<dyn Store>,
    pub hv: SimHypervisor,
    pub cfg: LifecycleConfig,
    pub runtime_cfg: RuntimeConfig,
    /// While set, the VM controller's looks do nothing (see [`Stuckable`]).
    pub vms_stuck: Arc<AtomicBool>,
    /// While set, the migration controller's looks do nothing.
    pub migrations_stuck: Arc<AtomicBool>,
    /// How soon a stuck controller asks to look again.
    pub stuck_requeue_ms: Millis,
    /// The node's view of a store with per-node copies of the VM records
    /// (`keel_store::node_shards`), as `keel agent` watches it; `None`:
    /// the runtime watches `store`.
    pub own_records: Option<Arc<dyn Store>>,
}

impl NodeWiring {
    /// A node on `clock` and `store` with default configurations; never stuck.
    pub fn new(clock: Arc<dyn Clock>, store: Arc<dyn Store>, hv: SimHypervisor) -> Self {
        Self {
            clock,
            store,
            hv,
            cfg: LifecycleConfig::default(),
            runtime_cfg: RuntimeConfig::default(),
            vms_stuck: Arc::default(),
            migrations_stuck: Arc::default(),
            stuck_requeue_ms: 500,
            own_records: None,
        }
    }
}

/// One node process: its controllers and the runtime driving them.
pub struct SimNode {
    pub vms: Arc<VmController>,
    pub snapshots: Arc<SnapshotController>,
    pub migrations: Arc<MigrationController>,
    pub runtime: Runtime,
}

impl SimNode {
    /// Starts the node's process on `wiring`, as `keel agent` wires it
    /// (`Runtime::for_node`), each controller behind its stuck switch.
    pub fn start(wiring: &NodeWiring) -> Self {
        let clock = wiring.clock.clone();
        let mut vms = VmController::new(
            TypedStore::new(wiring.store.clone()),
            Arc::new(wiring.hv.clone()),
            clock.clone(),
            wiring.cfg.clone(),
        );
        if let Some(view) = &wiring.own_records {
            vms = vms.watching_own_records(view.clone());
        }
        let vms = Arc::new(vms);
        let snapshots = Arc::new(vms.snapshot_controller());
        let migrations = Arc::new(vms.migration_controller());
        let mut runtime = Runtime::new(
            vms.watched_store(),
            vms.domain_events(),
            clock.clone(),
            vms.observer().clone(),
            vms.config().retry_ms,
            &wiring.runtime_cfg,
        );
        runtime.reflect(vms.reflector().clone());
        runtime.add(Arc::new(Stuckable {
            inner: vms.clone(),
            stuck: wiring.vms_stuck.clone(),
            clock: clock.clone(),
            requeue_ms: wiring.stuck_requeue_ms,
        }));
        runtime.add(snapshots.clone());
        runtime.add(Arc::new(Stuckable {
            inner: migrations.clone(),
            stuck: wiring.migrations_stuck.clone(),
            clock,
            requeue_ms: wiring.stuck_requeue_ms,
        }));
        Self {
            vms,
            snapshots,
            migrations,
            runtime,
        }
    }
}

/// A node's controller that can be stuck: while it is, each look does
/// nothing and asks to be looked at again `requeue_ms` later. Unset, it
/// is the controller itself.
struct Stuckable<R> {
    inner: Arc<R>,
    stuck: Arc<AtomicBool>,
    clock: Arc<dyn Clock>,
    requeue_ms: Millis,
}

#[async_trait]
impl<R: Reconciler> Reconciler for Stuckable<R> {
    type Error = R::Error;

    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn triggers(&self, event: &Event) -> Vec<String> {
        self.inner.triggers(event)
    }

    async fn reconcile(&self, key: &str) -> Result<Option<Requeue>, Self::Error> {
        if self.stuck.load(Ordering::SeqCst) {
            return Ok(Some(Requeue::at(
                self.clock.now_ms() + self.requeue_ms,
                "stuck",
            )));
        }
        Reconciler::reconcile(&*self.inner, key).await
    }

    fn error_policy(&self, err: &Self::Error, attempts: u32) -> Millis {
        self.inner.error_policy(err, attempts)
    }
}
