//! `keel serve`: with `--store sqlite` (the default), the SQLite store,
//! the VM controller, the cluster controller (always leading: this process
//! alone uses the store), the node heartbeat and the HTTP API in one
//! process.
//! With `--store etcd://…` it is a control plane: the HTTP API plus the
//! leader election and the cluster controller (placement, takeover of lost
//! nodes' VMs), and no node agent unless `--agent` (see `agent` for
//! `keel agent`, the node agent on its own).
//!
//! Shutdown (SIGINT/SIGTERM) stops the HTTP server, the follow streams,
//! the controllers and the heartbeat, and nothing else: guests keep running
//! and the controller re-adopts them on the next start. A leader resigns,
//! so another control plane takes over without waiting for its lease.

use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use keel_api::{validate_name, Clock, SystemClock};
use keel_ctrl::vm_decodes::{VmDecoder, VmDecodes};
use keel_ctrl::{
    run_control_plane, run_vm_controller_with, ClusterController, ElectionConfig, LeaderElection,
    LifecycleConfig, VmController,
};
use keel_hv::images::ImageStore;
use keel_hv::qemu::keeper::KeeperCommand;
use keel_hv::qemu::AccelChoice;
use keel_hv::sim::SimConfig;
use keel_hv::Hypervisor;
use keel_store::sqlite::SqliteStore;
use keel_store::TypedStore;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::agent::NodeAgent;
use crate::api::limits::ApiLimits;
use crate::api::{self, AppState};
use crate::api_tls::{self, ApiTls, ServerIdentity};
use crate::args::{HypervisorKind, ServeArgs};
use crate::auth::{self, Token};
use crate::distributed::StoreSpec;
use crate::host::{
    create_private_dir, init_logging, lock_data_dir, private_umask, wait_for_signal,
};
use crate::hypervisor::{image_dir, make_hypervisor, HypervisorOptions};
use crate::metrics::Metrics;
use crate::node_args::node_lifecycle;
use crate::token_book::{self, TokenBook};
use keel_hv::stats_cache::StatsCache;

pub const DB_FILE: &str = "keel.db";
/// How long in-flight HTTP requests may take to finish at shutdown.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Everything `keel serve` needs; tests build one directly.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub data_dir: PathBuf,
    /// The API token's file; default `<data_dir>/token`.
    pub token_file: Option<PathBuf>,
    /// Requests per second and console sessions per token.
    pub token_limits: crate::api::token_limits::TokenLimits,
    pub listen: SocketAddr,
    pub hypervisor: HypervisorKind,
    pub node: String,
    /// Used only by the sim driver.
    pub sim: SimConfig,
    /// With the sim driver on SQLite: simulated nodes beyond the local one.
    pub sim_nodes: Vec<crate::sim_nodes::SimNode>,
    /// Controller timings; `node` is overwritten with [`ServeConfig::node`].
    pub lifecycle: LifecycleConfig,
    /// The qemu driver's default kernel and initrd (the test guest), used
    /// by VMs whose spec names none, and by the KVM probe.
    pub guest_dir: Option<PathBuf>,
    pub accel: AccelChoice,
    /// Create a demo VM at start if there is none.
    pub demo: bool,
    /// Where VM disks live (shared by the nodes of a cluster, for live
    /// migration); default: under the data dir.
    pub disk_dir: Option<PathBuf>,
    /// Where the qemu driver's sockets live; default: its own choice.
    pub runtime_dir: Option<PathBuf>,
    pub console_log_max_bytes: u64,
    /// The free-space floor of the disk dir and image store (`--min-free-disk-mib`).
    pub min_free_disk_bytes: u64,
    /// The image store; default `<data_dir>/images`. In a cluster, storage
    /// every control plane and node mounts at the same path.
    pub image_dir: Option<PathBuf>,
    /// With `agent`: the fence keeper QEMU runs under (`keel keeper`).
    pub keeper: Option<KeeperCommand>,
    /// SQLite in the data dir, or an etcd cluster (control-plane mode).
    pub store: StoreSpec,
    /// With an etcd store: also run a node agent here (`node`).
    pub agent: bool,
    /// With an etcd store: the leader election's timings.
    pub election: ElectionConfig,
    /// With an etcd store: how often the control planes take turns at
    /// compacting etcd's history (`--etcd-compaction-interval`); `None`
    /// leaves it to etcd's own auto-compaction.
    pub etcd_compaction: Option<Duration>,
    /// The controller runtime's settings (`--max-concurrent-reconciles`).
    pub runtime: keel_ctrl::RuntimeConfig,
    /// The API's caps (`--max-vms` and the like).
    pub api_limits: ApiLimits,
    /// HTTPS (self-signed in the data dir, or the operator's) or, on
    /// loopback only, plain HTTP.
    pub tls: ApiTls,
}

impl ServeConfig {
    pub fn new(
        data_dir: PathBuf,
        listen: SocketAddr,
        hypervisor: HypervisorKind,
        node: String,
    ) -> Self {
        Self {
            data_dir,
            token_file: None,
            listen,
            hypervisor,
            node,
            sim: SimConfig::default(),
            sim_nodes: Vec::new(),
            lifecycle: LifecycleConfig::default(),
            guest_dir: None,
            accel: AccelChoice::Auto,
            demo: false,
            disk_dir: None,
            runtime_dir: None,
            console_log_max_bytes: keel_hv::qemu::QemuConfig::new("").console_log_max_bytes,
            min_free_disk_bytes: keel_hv::free_space::DEFAULT_MIN_FREE_DISK_MIB << 20,
            image_dir: None,
            keeper: None,
            store: StoreSpec::Sqlite,
            agent: false,
            election: ElectionConfig::default(),
            etcd_compaction: Some(crate::etcd_history::DEFAULT_INTERVAL),
            runtime: Default::default(),
            api_limits: ApiLimits::default(),
            tls: ApiTls::default(),
            token_limits: Default::default(),
        }
    }

    pub fn token_path(&self) -> PathBuf {
        self.token_file
            .clone()
            .unwrap_or_else(|| auth::token_path(&self.data_dir))
    }

    pub fn hypervisor_options(&self) -> HypervisorOptions {
        HypervisorOptions {
            kind: self.hypervisor,
            data_dir: self.data_dir.clone(),
            disk_dir: self.disk_dir.clone(),
            runtime_dir: self.runtime_dir.clone(),
            console_log_max_bytes: self.console_log_max_bytes,
            min_free_disk_bytes: self.min_free_disk_bytes,
            image_dir: image_dir(&self.data_dir, self.image_dir.as_deref()),
            // One host, one store: nobody else can start these VMs, so
            // guests may outlive the server for good. A control plane's
            // in-process agent is a cluster node and fences.
            keeper: if self.agent {
                self.keeper.clone()
            } else {
                None
            },
            sim: self.sim.clone(),
            guest_dir: self.guest_dir.clone(),
            accel: self.accel,
            migration: Default::default(),
        }
    }
}

/// The image store the API imports into.
fn open_image_store(cfg: &ServeConfig) -> anyhow::Result<Arc<ImageStore>> {
    let dir = image_dir(&cfg.data_dir, cfg.image_dir.as_deref());
    let store = ImageStore::open(&dir, Path::new("qemu-img"), Duration::from_secs(300))
        .with_context(|| format!("image dir {}", dir.display()))?
        .with_min_free_bytes(cfg.min_free_disk_bytes);
    Ok(Arc::new(store))
}

/// A started server. Dropping it without [`RunningServer::shutdown`]
/// leaves its tasks running on the runtime.
pub struct RunningServer {
    addr: SocketAddr,
    token: Token,
    store: TypedStore,
    stop: watch::Sender<bool>,
    http: JoinHandle<std::io::Result<()>>,
    /// The VM controller (SQLite), or the election and cluster controller (etcd).
    controller: JoinHandle<()>,
    /// Set with an etcd store.
    election: Option<Arc<LeaderElection>>,
    /// The node agent of an etcd control plane started with `agent`.
    agent: Option<NodeAgent>,
    hypervisor: Option<Arc<dyn Hypervisor>>,
    _lock: File,
}

impl RunningServer {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn token(&self) -> &str {
        self.token.secret()
    }

    pub fn store(&self) -> &TypedStore {
        &self.store
    }

    /// This control plane's candidacy (etcd store only).
    pub fn election(&self) -> Option<&Arc<LeaderElection>> {
        self.election.as_ref()
    }

    /// The local node's driver, if this server runs a node agent.
    pub fn hypervisor(&self) -> Option<&Arc<dyn Hypervisor>> {
        self.hypervisor.as_ref()
    }

    /// Ends every task at once, as if the process were killed: no
    /// resignation, no lease revoked (a leader's lease runs out on its own).
    pub fn abort(self) {
        self.http.abort();
        self.controller.abort();
        if let Some(agent) = self.agent {
            agent.abort();
        }
    }

    /// Stops serving and reconciling (a leader resigns). Guests are left as
    /// they are.
    pub async fn shutdown(self) -> anyhow::Result<()> {
        let _ = self.stop.send(true);
        let mut http = self.http;
        let served = match tokio::time::timeout(DRAIN_TIMEOUT, &mut http).await {
            Ok(joined) => joined.context("HTTP server task")?.context("HTTP server"),
            Err(_) => {
                tracing::warn!("requests still open after {DRAIN_TIMEOUT:?}; closing them");
                http.abort();
                Ok(())
            }
        };
        self.controller.await.context("controller task")?;
        if let Some(agent) = self.agent {
            agent.shutdown().await?;
        }
        served
    }
}

/// Opens the store, starts the controllers (and, for SQLite, the node
/// heartbeat) and the API. Returns once the listener is bound (so `listen`
/// may use port 0).
pub async fn start(cfg: ServeConfig) -> anyhow::Result<RunningServer> {
    validate_name("node", &cfg.node).map_err(|e| anyhow!("--node: {e}"))?;
    api_tls::check_listen(&cfg.tls, cfg.listen)?;
    if cfg.store.is_etcd() {
        return start_control_plane(cfg).await;
    }
    if cfg.agent {
        bail!("--agent is for control planes on an etcd store; with SQLite, keel serve is the node agent");
    }
    if !cfg.sim_nodes.is_empty() && cfg.hypervisor != HypervisorKind::Sim {
        bail!("--sim-nodes: only with --hypervisor sim (a QEMU node is a host of its own)");
    }
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    // The data dir is ours (private, locked) before the driver looks into
    // it: a driver adopts instances and records exits there, which a
    // second server on the same dir must never do.
    create_private_dir(&cfg.data_dir)?;
    let lock = lock_data_dir(&cfg.data_dir)?;
    let hv = make_hypervisor(&cfg.hypervisor_options(), clock.clone()).await?;
    let db = cfg.data_dir.join(DB_FILE);
    let store = TypedStore::new(Arc::new(SqliteStore::open(&db)?));
    let tokens = TokenBook::new(store.clone(), clock.clone());
    let token = token_book::bootstrap(&tokens, &cfg.token_path(), &cfg.node).await?;
    let facts = hv.facts().await;
    // Bind before starting anything, so a busy port fails cleanly.
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("listening on {}", cfg.listen))?;
    let addr = listener.local_addr()?;
    let identity = api_tls::load_identity(&cfg.tls, &cfg.data_dir, addr)?;

    let (stop, stop_rx) = watch::channel(false);
    tokens.spawn_reflector(stop_rx.clone());
    let door = api::Door::new(tokens, store.clone(), cfg.token_limits);
    let lifecycle = LifecycleConfig {
        default_machine: crate::agent::default_machine(&facts),
        ..node_lifecycle(
            &cfg.lifecycle,
            &cfg.node,
            cfg.disk_dir.as_deref(),
            cfg.lifecycle.incarnation.clone(),
        )?
    };
    // Every reader of the store here (the cluster controller, this node,
    // the simulated nodes) decodes each VM record once between them.
    let decoder = VmDecoder::sharing(Arc::new(VmDecodes::default()));
    // The same cluster controller as a control plane's, leading for good:
    // this process alone uses the store (the data dir is locked).
    let cluster = Arc::new(
        ClusterController::sole(store.clone(), clock.clone(), lifecycle.clone())
            .decoding_with(decoder.clone()),
    );
    let metrics = Arc::new(Metrics::new());
    metrics.count_from(store.raw().clone(), stop_rx.clone());
    metrics.report_vms_of(
        &cfg.node,
        Arc::new(StatsCache::new(hv.clone(), clock.clone())),
        clock.clone(),
    );
    let ctrl = Arc::new(
        VmController::new(store.clone(), hv.clone(), clock.clone(), lifecycle.clone())
            .decoding_with(decoder.clone())
            .with_observer(metrics.clone()),
    );
    // Register the node (with the hypervisor's facts) before serving; the
    // controller runtime keeps the heartbeat going from here on.
    ctrl.heartbeat_and_renew(Some(&facts))
        .await
        .with_context(|| format!("registering node {}", cfg.node))?;
    let shared = crate::sim_nodes::Shared {
        store: &store,
        clock: &clock,
        lifecycle: &lifecycle,
        sim: &cfg.sim,
        runtime: &cfg.runtime,
        metrics: &metrics,
        decoder: &decoder,
    };
    let sim_nodes = crate::sim_nodes::start(&cfg.sim_nodes, shared, &stop_rx).await?;
    let controller = tokio::spawn({
        let vms = run_vm_controller_with(ctrl, clock.clone(), cfg.runtime.clone(), stop_rx.clone());
        let cluster = run_control_plane(cluster, stop_rx.clone());
        async move {
            tokio::join!(vms, cluster, sim_nodes);
        }
    });
    let console = Some(api::NodeAccess {
        node: cfg.node.clone(),
        hv: hv.clone(),
    });
    let vm_count = api::vm_count::VmCount::kept(store.raw().clone(), stop_rx.clone());
    let state = AppState {
        store: store.clone(),
        clock,
        metrics,
        shutdown: stop_rx,
        node: console,
        images: open_image_store(&cfg)?,
        limits: cfg.api_limits,
        follows: Default::default(),
        vm_count,
        cluster_creds: Some(crate::agent_link::creds_dir(&cfg.data_dir)),
        image_imports: Default::default(),
    };
    let http = serve_api(listener, state, door, identity.as_ref());
    if cfg.demo {
        create_demo_vm(&store).await?;
    }
    tracing::info!(
        %addr,
        url = %api_url(addr, identity.as_ref()),
        fingerprint = %identity.as_ref().map_or("none (plain HTTP)", |i| i.fingerprint.as_str()),
        node = %cfg.node,
        hypervisor = %facts.hypervisor,
        accelerator = %crate::hypervisor::accelerator_text(facts.accelerator),
        data_dir = %cfg.data_dir.display(),
        "keel serving"
    );
    Ok(RunningServer {
        addr,
        token,
        store,
        stop,
        http,
        controller,
        election: None,
        agent: None,
        hypervisor: Some(hv),
        _lock: lock,
    })
}

/// Serves the API until `state.shutdown` turns true: HTTPS with
/// `identity`, else plain HTTP (loopback only, see [`api_tls::check_listen`]).
fn serve_api(
    listener: tokio::net::TcpListener,
    state: AppState,
    door: api::Door,
    identity: Option<&ServerIdentity>,
) -> JoinHandle<std::io::Result<()>> {
    let stop = state.shutdown.clone();
    // The web console's files beside the API, on the same port and TLS.
    let app = api::router(state, door).merge(crate::webui::router());
    let tls = identity.map(|i| tokio_rustls::TlsAcceptor::from(i.config.clone()));
    if tls.is_none() {
        tracing::warn!("--insecure-http: the API speaks plain HTTP (loopback only): the token and all traffic are unencrypted");
    }
    tokio::spawn(crate::http_listener::serve_until(listener, app, tls, stop))
}

/// The URL clients reach the API at.
fn api_url(addr: SocketAddr, identity: Option<&ServerIdentity>) -> String {
    let scheme = if identity.is_some() { "https" } else { "http" };
    format!("{scheme}://{addr}")
}

/// A control plane on etcd: the API, the leader election and the cluster
/// controller, and a node agent (without cluster duties) if `cfg.agent`.
async fn start_control_plane(cfg: ServeConfig) -> anyhow::Result<RunningServer> {
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    create_private_dir(&cfg.data_dir)?;
    let lock = lock_data_dir(&cfg.data_dir)?;
    let etcd = cfg
        .store
        .connect_plain()
        .await?
        .expect("an etcd store spec");
    let sharded = crate::distributed::with_node_copies(Arc::new(etcd.clone()));
    tokio::spawn(crate::distributed::repair_node_copies(sharded.clone()));
    let raw: Arc<dyn keel_store::Store> = sharded.clone();
    let store = TypedStore::new(raw.clone());
    let tokens = TokenBook::new(store.clone(), clock.clone());
    let token = token_book::bootstrap(&tokens, &cfg.token_path(), &cfg.node).await?;
    // Whatever the API serves with, no key stays in the store.
    crate::api_tls_cluster::withdraw_published_key(&*raw, &cfg.data_dir).await?;
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("listening on {}", cfg.listen))?;
    let addr = listener.local_addr()?;
    let identity = api_tls::load_identity(&cfg.tls, &cfg.data_dir, addr)?;
    let incarnation = crate::agent::load_or_create_incarnation(&cfg.data_dir)?;
    let lifecycle = node_lifecycle(
        &cfg.lifecycle,
        &cfg.node,
        cfg.disk_dir.as_deref(),
        cfg.agent.then(|| incarnation.clone()),
    )?;
    if cfg.agent {
        crate::agent::claim_node_name(&store, &cfg.node, &incarnation, lifecycle.node_lease_ms)
            .await?;
    }
    let (stop, stop_rx) = watch::channel(false);
    if let Some(every) = cfg.etcd_compaction {
        tokio::spawn(crate::etcd_history::compact_every(
            etcd,
            every,
            stop_rx.clone(),
        ));
    }
    tokens.spawn_reflector(stop_rx.clone());
    let door = api::Door::new(tokens, store.clone(), cfg.token_limits);
    let metrics = Arc::new(Metrics::new());
    metrics.count_from(raw.clone(), stop_rx.clone());
    let (agent, hypervisor) = if cfg.agent {
        let hv = make_hypervisor(&cfg.hypervisor_options(), clock.clone()).await?;
        metrics.report_vms_of(
            &cfg.node,
            Arc::new(StatsCache::new(hv.clone(), clock.clone())),
            clock.clone(),
        );
        let agent = NodeAgent::spawn(
            store.clone(),
            hv.clone(),
            clock.clone(),
            lifecycle.clone(),
            metrics.clone(),
            &cfg.runtime,
            Some(sharded.node_view(&cfg.node)?),
        )
        .await?;
        (Some(agent), Some(hv))
    } else {
        (None, None)
    };
    // Unique among control planes: the leader key says who leads.
    let candidate = format!("{}@{addr}", cfg.node);
    let election = Arc::new(LeaderElection::new(
        raw.clone(),
        clock.clone(),
        candidate.clone(),
        cfg.election.clone(),
    ));
    let cluster = Arc::new(ClusterController::new(
        store.clone(),
        clock.clone(),
        lifecycle,
        election.clone(),
    ));
    let controller = tokio::spawn(run_control_plane(cluster, stop_rx.clone()));
    // The in-process agent's node is the only one whose consoles this
    // control plane can reach.
    let console = hypervisor.as_ref().map(|hv| api::NodeAccess {
        node: cfg.node.clone(),
        hv: hv.clone(),
    });
    let vm_count = api::vm_count::VmCount::kept(store.raw().clone(), stop_rx.clone());
    let state = AppState {
        store: store.clone(),
        clock,
        metrics,
        shutdown: stop_rx,
        node: console,
        images: open_image_store(&cfg)?,
        limits: cfg.api_limits,
        follows: Default::default(),
        vm_count,
        cluster_creds: Some(crate::agent_link::creds_dir(&cfg.data_dir)),
        image_imports: Default::default(),
    };
    let http = serve_api(listener, state, door, identity.as_ref());
    if cfg.demo {
        create_demo_vm(&store).await?;
    }
    tracing::info!(
        %addr,
        url = %api_url(addr, identity.as_ref()),
        fingerprint = %identity.as_ref().map_or("none (plain HTTP)", |i| i.fingerprint.as_str()),
        store = %cfg.store,
        candidate = %candidate,
        node_agent = cfg.agent,
        data_dir = %cfg.data_dir.display(),
        "keel control plane serving"
    );
    Ok(RunningServer {
        addr,
        token,
        store,
        stop,
        http,
        controller,
        election: Some(election),
        agent,
        hypervisor,
        _lock: lock,
    })
}

/// The demo VM: a small guest with one data disk, restarted after crashes.
pub const DEMO_VM: &str = "demo";

async fn create_demo_vm(store: &TypedStore) -> anyhow::Result<()> {
    use keel_api::{BootSpec, DiskSpec, PowerState, RunPolicy, VirtualMachine, VmSpec};
    let key = keel_ctrl::keys::vm_key(DEMO_VM);
    if store.get::<VirtualMachine>(&key).await?.is_some() {
        return Ok(());
    }
    let mut vm = VirtualMachine::new(
        DEMO_VM,
        VmSpec {
            cpus: 1,
            memory_mib: 256,
            disks: vec![DiskSpec {
                name: "data".into(),
                size_mib: 64,
                image: None,
            }],
            boot: BootSpec::default(),
            run_policy: RunPolicy::AlwaysOnUnlessStoppedManually,
            power: PowerState::Running,
            restart_generation: 0,
            stop_grace_period_s: 60,
            node: None,
            readiness: keel_api::Readiness::Console("KEEL-GUEST-READY".into()),
            network: Default::default(),
            cloud_init: None,
            ha: None,
            cpu_model: None,
            placement: Default::default(),
            tpm: None,
        },
    );
    vm.uid = crate::api::vms::new_vm_uid();
    vm.validate()?;
    match store.create(&key, &vm).await {
        Ok(_) | Err(keel_store::StoreError::Conflict { .. }) => {
            tracing::info!(vm = DEMO_VM, "demo VM created");
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

/// `keel serve`: runs until SIGINT or SIGTERM.
pub fn main(args: ServeArgs) -> anyhow::Result<()> {
    init_logging();
    private_umask();
    crate::host::raise_descriptor_limit();
    let node = args.node.resolve()?;
    let mut cfg = ServeConfig::new(node.data_dir, args.listen, node.hypervisor, node.node);
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
    cfg.token_file = args.token_file;
    cfg.demo = args.demo;
    cfg.store = args.store_access.resolve(args.store)?;
    cfg.agent = args.agent;
    cfg.etcd_compaction = (args.etcd_compaction_interval > 0)
        .then(|| Duration::from_secs(args.etcd_compaction_interval));
    cfg.tls = match (args.tls_cert, args.tls_key, args.insecure_http) {
        (None, None, false) => ApiTls::SelfSigned,
        (None, None, true) => ApiTls::InsecureHttp,
        (Some(cert), Some(key), false) => ApiTls::Files { cert, key },
        (Some(_), Some(_), true) => {
            bail!("--insecure-http: cannot be combined with --tls-cert/--tls-key")
        }
        (Some(_), None, _) => bail!("--tls-cert: needs --tls-key (the certificate's private key)"),
        (None, Some(_), _) => bail!("--tls-key: needs --tls-cert (the certificate chain)"),
    };
    cfg.api_limits = ApiLimits {
        max_vms: args.max_vms,
        max_snapshots_per_vm: args.max_snapshots_per_vm,
        max_images: args.max_images,
        max_follows: args.max_follows,
        max_image_bytes: args.max_image_size,
    };
    cfg.token_limits = crate::api::token_limits::TokenLimits {
        requests_per_second: args.max_requests_per_token,
        consoles_per_token: args.max_consoles_per_token,
    };
    if let Some(first) = args.sim_node_hosts.first() {
        cfg.sim.host = Some(*first);
    }
    cfg.sim_nodes = crate::sim_nodes::extra_nodes(
        &cfg.node,
        args.sim_nodes,
        &args.sim_node_hosts,
        cfg.sim.host,
    )?;
    cfg.lifecycle.event_retention = keel_ctrl::event_retention::EventRetention {
        per_vm: args.max_events_per_vm,
        total: args.max_events,
        audit: args.max_audit_events,
    };
    if cfg.agent && cfg.hypervisor == HypervisorKind::Qemu {
        cfg.keeper = Some(KeeperCommand::this_binary("keeper").context("finding the keel binary")?);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let server = start(cfg).await?;
        let signal = wait_for_signal().await?;
        tracing::info!(
            signal,
            "shutting down; guests keep running and are re-adopted on the next start"
        );
        server.shutdown().await
    })
}
