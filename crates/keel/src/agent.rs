//! `keel agent`: a node agent on its own, for a cluster on etcd. It runs
//! this node's hypervisor driver and the controller runtime (VMs,
//! snapshots, migrations, housekeeping with the heartbeat and self-fencing)
//! for the VMs placed on this node, and leaves placement and the takeover
//! of lost nodes' VMs to the control planes' leader (no VM controller does
//! either).
//! It serves no API.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use keel_api::{validate_name, Clock, Node, SystemClock};
use keel_ctrl::{
    LifecycleConfig, LifecycleObserver, RunningControllers, RuntimeConfig, VmController,
};
use keel_hv::qemu::keeper::KeeperCommand;
use keel_hv::qemu::AccelChoice;
use keel_hv::sim::SimConfig;
use keel_hv::Hypervisor;
use keel_store::TypedStore;

use crate::agent_console::{self, ConsoleServer};
use crate::args::{AgentArgs, HypervisorKind};
use crate::distributed::StoreSpec;
use crate::host;
use crate::hypervisor::{self, make_hypervisor, HypervisorOptions};

/// A node agent's controllers, running on a store.
pub struct NodeAgent {
    node: String,
    controllers: RunningControllers,
}

impl NodeAgent {
    /// Registers the node (heartbeat with the driver's facts), then runs
    /// the controller runtime for it until shut down. `lifecycle.node` is
    /// the node's name. With `own_records` (the node's view of the
    /// cluster's store), the runtime watches only this node's VM records.
    pub async fn spawn(
        store: TypedStore,
        hv: Arc<dyn Hypervisor>,
        clock: Arc<dyn Clock>,
        mut lifecycle: LifecycleConfig,
        observer: Arc<dyn LifecycleObserver>,
        runtime: &RuntimeConfig,
        own_records: Option<Arc<dyn keel_store::Store>>,
    ) -> anyhow::Result<Self> {
        let node = lifecycle.node.clone();
        let facts = hv.facts().await;
        lifecycle.default_machine = default_machine(&facts);
        let mut ctrl =
            VmController::new(store, hv, clock.clone(), lifecycle).with_observer(observer);
        if let Some(view) = own_records {
            ctrl = ctrl.watching_own_records(view);
        }
        let ctrl = Arc::new(ctrl);
        let controllers = RunningControllers::start(ctrl, clock, runtime.clone())
            .await
            .with_context(|| format!("registering node {node}"))?;
        tracing::info!(%node, hypervisor = %facts.hypervisor, accelerator = %crate::hypervisor::accelerator_text(facts.accelerator), "node agent running");
        Ok(Self { node, controllers })
    }

    pub fn node(&self) -> &str {
        &self.node
    }

    /// Stops the controllers; guests keep running, to be re-adopted.
    pub async fn shutdown(self) -> anyhow::Result<()> {
        self.controllers.shutdown().await.context("node agent task")
    }

    /// A planned restart: freezes the node for `freeze_ms` first, then
    /// stops the controllers, heartbeating until the reconciles under way
    /// have finished, and freezes it again from the exit (see
    /// `RunningControllers::freeze_and_shutdown`): its guests keep running
    /// and nothing is taken over until the agent is back or the freeze is
    /// over. If the freeze cannot be written, the guests are fenced once
    /// the normal lease lapses, and the error says so.
    pub async fn freeze_and_shutdown(self, freeze_ms: u64) -> anyhow::Result<()> {
        let end = self
            .controllers
            .freeze_and_shutdown(freeze_ms, "agent restart (SIGTERM)")
            .await?;
        tracing::info!(node = %self.node, until_boottime_ms = end.origin_ms(), "node frozen for the restart");
        Ok(())
    }

    /// Ends the controllers at once, as if the process were killed.
    pub fn abort(self) {
        self.controllers.abort();
    }
}

const INCARNATION_FILE: &str = "incarnation";

/// This agent's incarnation: an id kept in its data dir, so that a restart
/// on the same host (same data dir) is the same agent, and an agent on
/// another host that claims the same node name is not.
pub fn load_or_create_incarnation(data_dir: &Path) -> anyhow::Result<String> {
    let path = data_dir.join(INCARNATION_FILE);
    match std::fs::read_to_string(&path) {
        Ok(id) if !id.trim().is_empty() => return Ok(id.trim().to_string()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    }
    let id = std::fs::read_to_string("/proc/sys/kernel/random/uuid")
        .context("generating an incarnation id")?
        .trim()
        .to_string();
    std::fs::write(&path, format!("{id}\n"))
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(id)
}

/// Before an agent acts for `node`: if another incarnation holds the name,
/// it is refused while that one's heartbeat moves, and the name is taken
/// over only after a full node lease of silence on this agent's monotonic
/// clock (`keel_ctrl::node_lease::name_claim`).
pub async fn claim_node_name(
    store: &TypedStore,
    node: &str,
    ours: &str,
    lease_ms: u64,
) -> anyhow::Result<()> {
    use keel_api::Clock;
    use keel_ctrl::node_lease::name_claim::{ClaimStep, HeldName};
    let clock = keel_api::SystemClock;
    let key = keel_ctrl::keys::node_key(node);
    let first = store.get::<Node>(&key).await?;
    let Some(held) = HeldName::first_look(first.as_ref().map(|e| &e.value), ours, clock.mono())
    else {
        return Ok(());
    };
    tracing::warn!(%node, theirs = %held.theirs, "another agent's incarnation holds this node name; waiting one node lease for it to go silent");
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let latest = store.get::<Node>(&key).await?;
        match held.look(latest.as_ref().map(|e| &e.value), clock.mono(), lease_ms) {
            ClaimStep::Free => return Ok(()),
            ClaimStep::Wait => continue,
            ClaimStep::InUse { by } => bail!(
                "node name {node} is in use by another live agent (incarnation {}); \
                 refusing to run a second agent for it",
                by.as_deref().unwrap_or("none")
            ),
            ClaimStep::TakeOver => {
                let latest = latest.expect("a look that takes over saw the record");
                let mut claimed = latest.value.clone();
                claimed.status.incarnation = Some(ours.to_string());
                store
                    .update(&key, &claimed, latest.revision)
                    .await
                    .with_context(|| format!("claiming node name {node}"))?;
                tracing::warn!(%node, previous = %held.theirs, "took over the node name after a lease of silence");
                return Ok(());
            }
        }
    }
}

/// Everything `keel agent` needs; tests build one directly.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Must be an etcd store: a node agent alone on SQLite has nobody to
    /// place its VMs.
    pub store: StoreSpec,
    /// This node's driver state (`node/`) and lock.
    pub data_dir: PathBuf,
    pub node: String,
    pub hypervisor: HypervisorKind,
    pub sim: SimConfig,
    pub guest_dir: Option<PathBuf>,
    pub accel: AccelChoice,
    pub disk_dir: Option<PathBuf>,
    /// Where the qemu driver's sockets live; default: its own choice.
    pub runtime_dir: Option<PathBuf>,
    pub console_log_max_bytes: u64,
    /// The free-space floor of the disk dir and image store (`--min-free-disk-mib`).
    pub min_free_disk_bytes: u64,
    /// The image store; default `<data_dir>/images`. Must be the storage
    /// the control planes import into, mounted at the same path.
    pub image_dir: Option<PathBuf>,
    /// The fence keeper QEMU runs under (`keel keeper`); `None` only in
    /// tests that have no keel binary.
    pub keeper: Option<KeeperCommand>,
    /// Controller timings; `node` is overwritten.
    pub lifecycle: LifecycleConfig,
    /// How long SIGTERM freezes the node for (0: no freeze).
    pub restart_freeze_ms: u64,
    /// How incoming migrations travel; default: a Unix socket.
    pub migration: crate::migration_setup::MigrationSettings,
    /// Where to serve this node's consoles (`--console-listen`); `None`:
    /// nowhere.
    pub listen: Option<std::net::SocketAddr>,
    /// The controller runtime's settings (`--max-concurrent-reconciles`).
    pub runtime: keel_ctrl::RuntimeConfig,
}

impl AgentConfig {
    pub fn new(
        store: StoreSpec,
        data_dir: PathBuf,
        node: String,
        hypervisor: HypervisorKind,
    ) -> Self {
        Self {
            store,
            data_dir,
            node,
            hypervisor,
            sim: SimConfig::default(),
            guest_dir: None,
            accel: AccelChoice::Auto,
            disk_dir: None,
            runtime_dir: None,
            console_log_max_bytes: keel_hv::qemu::QemuConfig::new("").console_log_max_bytes,
            min_free_disk_bytes: keel_hv::free_space::DEFAULT_MIN_FREE_DISK_MIB << 20,
            image_dir: None,
            keeper: None,
            lifecycle: LifecycleConfig::default(),
            restart_freeze_ms: 5 * 60 * 1000,
            migration: Default::default(),
            listen: None,
            runtime: Default::default(),
        }
    }

    pub fn hypervisor_options(&self) -> HypervisorOptions {
        HypervisorOptions {
            kind: self.hypervisor,
            data_dir: self.data_dir.clone(),
            disk_dir: self.disk_dir.clone(),
            runtime_dir: self.runtime_dir.clone(),
            console_log_max_bytes: self.console_log_max_bytes,
            min_free_disk_bytes: self.min_free_disk_bytes,
            image_dir: hypervisor::image_dir(&self.data_dir, self.image_dir.as_deref()),
            keeper: self.keeper.clone(),
            sim: self.sim.clone(),
            guest_dir: self.guest_dir.clone(),
            accel: self.accel,
            migration: self.migration.clone(),
        }
    }
}

/// A started `keel agent`: its controllers and its data dir lock.
pub struct RunningAgent {
    agent: NodeAgent,
    restart_freeze_ms: u64,
    hv: Arc<dyn Hypervisor>,
    store: TypedStore,
    consoles: Option<ConsoleServer>,
    _lock: File,
}

impl RunningAgent {
    pub fn hypervisor(&self) -> &Arc<dyn Hypervisor> {
        &self.hv
    }

    pub fn store(&self) -> &TypedStore {
        &self.store
    }

    pub fn node(&self) -> &str {
        self.agent.node()
    }

    /// Where it serves its node's consoles, if it does.
    pub fn console_url(&self) -> Option<&str> {
        self.consoles.as_ref().map(|c| c.url.as_str())
    }

    pub async fn shutdown(self) -> anyhow::Result<()> {
        if let Some(consoles) = self.consoles {
            consoles.shutdown().await;
        }
        self.agent.shutdown().await
    }

    /// A planned stop (SIGTERM): with a restart freeze configured, the
    /// node is frozen for it before the agent exits (guests keep running);
    /// without, as [`Self::shutdown`].
    pub async fn stop_for_restart(self) -> anyhow::Result<()> {
        if let Some(consoles) = self.consoles {
            consoles.shutdown().await;
        }
        match self.restart_freeze_ms {
            0 => self.agent.shutdown().await,
            ms => self.agent.freeze_and_shutdown(ms).await,
        }
    }

    /// As if the process were killed: its guests keep running, unmanaged.
    pub fn abort(self) {
        if let Some(consoles) = self.consoles {
            consoles.abort();
        }
        self.agent.abort();
    }
}

/// Connects to the store, starts the driver and the agent.
/// The data dir is made private and locked before the driver starts, as
/// in `keel serve`: the driver adopts instances and records exits there.
pub async fn start(cfg: AgentConfig) -> anyhow::Result<RunningAgent> {
    check(&cfg)?;
    let lock = own_data_dir(&cfg)?;
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let hv = make_hypervisor(&cfg.hypervisor_options(), clock.clone()).await?;
    start_locked(cfg, hv, lock).await
}

/// Like [`start`], with a driver the caller made (tests: sim nodes that
/// share a fabric, so they can migrate to each other).
pub async fn start_with_hypervisor(
    cfg: AgentConfig,
    hv: Arc<dyn Hypervisor>,
) -> anyhow::Result<RunningAgent> {
    check(&cfg)?;
    let lock = own_data_dir(&cfg)?;
    start_locked(cfg, hv, lock).await
}

fn own_data_dir(cfg: &AgentConfig) -> anyhow::Result<std::fs::File> {
    host::create_private_dir(&cfg.data_dir)?;
    host::lock_data_dir(&cfg.data_dir)
}

async fn start_locked(
    cfg: AgentConfig,
    hv: Arc<dyn Hypervisor>,
    lock: std::fs::File,
) -> anyhow::Result<RunningAgent> {
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let sharded = cfg
        .store
        .connect_cluster()
        .await?
        .expect("checked: an etcd store");
    let own_records = sharded.node_view(&cfg.node)?;
    let store = TypedStore::new(sharded);
    let incarnation = load_or_create_incarnation(&cfg.data_dir)?;
    let lifecycle = crate::node_args::node_lifecycle(
        &cfg.lifecycle,
        &cfg.node,
        cfg.disk_dir.as_deref(),
        Some(incarnation.clone()),
    )?;
    claim_node_name(&store, &cfg.node, &incarnation, lifecycle.node_lease_ms).await?;
    // A bare agent serves no metrics endpoint: nothing to report to.
    let agent = NodeAgent::spawn(
        store.clone(),
        hv.clone(),
        clock.clone(),
        lifecycle,
        Arc::new(keel_ctrl::NoObserver),
        &cfg.runtime,
        Some(own_records),
    )
    .await?;
    let consoles = match cfg.listen {
        None => None,
        Some(listen) => {
            let images = keel_hv::images::ImageStore::open(
                &crate::hypervisor::image_dir(&cfg.data_dir, cfg.image_dir.as_deref()),
                Path::new("qemu-img"),
                Duration::from_secs(300),
            )
            .context("image dir")?;
            Some(
                ConsoleServer::start(
                    listen,
                    &cfg.node,
                    store.clone(),
                    hv.clone(),
                    clock,
                    Arc::new(images),
                    &crate::agent_link::creds_dir(&cfg.data_dir),
                )
                .await?,
            )
        }
    };
    agent_console::publish_url(&store, &cfg.node, consoles.as_ref().map(|c| c.url.as_str()))
        .await?;
    tracing::info!(node = %cfg.node, store = %cfg.store, data_dir = %cfg.data_dir.display(), "keel agent running");
    Ok(RunningAgent {
        agent,
        restart_freeze_ms: cfg.restart_freeze_ms,
        hv,
        store,
        consoles,
        _lock: lock,
    })
}

fn check(cfg: &AgentConfig) -> anyhow::Result<()> {
    validate_name("node", &cfg.node).map_err(|e| anyhow!("--node: {e}"))?;
    if cfg.restart_freeze_ms > keel_api::MAX_FREEZE_MS {
        bail!(
            "--restart-freeze: {} s is longer than the longest freeze, {} s",
            cfg.restart_freeze_ms / 1000,
            keel_api::MAX_FREEZE_MS / 1000
        );
    }
    if !cfg.store.is_etcd() {
        bail!(
            "keel agent needs the cluster's etcd store (--store etcds://HOST:PORT[/NAMESPACE]); \
             with SQLite, `keel serve` is the node agent"
        );
    }
    Ok(())
}

/// `keel agent`: runs until SIGINT or SIGTERM.
pub fn main(args: AgentArgs) -> anyhow::Result<()> {
    host::init_logging();
    host::private_umask();
    host::raise_descriptor_limit();
    let node = args.node.resolve()?;
    let store = args.store_access.resolve(args.store)?;
    let mut cfg = AgentConfig::new(store, node.data_dir, node.node, node.hypervisor);
    cfg.guest_dir = node.guest_dir;
    cfg.accel = node.accel;
    cfg.disk_dir = node.disk_dir;
    cfg.runtime_dir = node.runtime_dir;
    cfg.console_log_max_bytes = node.console_log_max_bytes;
    cfg.min_free_disk_bytes = node.min_free_disk_bytes;
    cfg.image_dir = node.image_dir;
    cfg.runtime.max_concurrent_reconciles = node.max_concurrent_reconciles;
    cfg.lifecycle = node.lifecycle;
    cfg.sim = node.sim;
    cfg.restart_freeze_ms = args.restart_freeze * 1000;
    cfg.migration = crate::migration_setup::settings(
        &cfg.data_dir,
        &cfg.store,
        args.migration_listen.as_ref(),
        args.insecure_migration,
    )?;
    cfg.listen = args.console_listen;
    if cfg.hypervisor == HypervisorKind::Qemu {
        cfg.keeper = Some(KeeperCommand::this_binary("keeper").context("finding the keel binary")?);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let agent = start(cfg).await?;
        let signal = host::wait_for_signal().await?;
        tracing::info!(
            signal,
            freeze_s = agent.restart_freeze_ms / 1000,
            "shutting down for a restart; guests keep running and are re-adopted on the next start"
        );
        agent.stop_for_restart().await
    })
}

/// The versioned machine type VMs first started by this node's driver get
/// ([`LifecycleConfig::default_machine`]).
pub fn default_machine(facts: &keel_hv::NodeFacts) -> Option<String> {
    facts.hardware.as_ref().map(|hw| hw.default_machine.clone())
}
