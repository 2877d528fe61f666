//! Command-line arguments (clap derive). `main.rs` parses these and
//! dispatches; nothing here does I/O.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use keel_api::{DiskSpec, Readiness, RunPolicy};

use crate::distributed::StoreSpec;
use crate::store_access::StoreAccessArgs;

pub const DEFAULT_SERVER: &str = "https://127.0.0.1:7280";
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7280";
pub const DEFAULT_DATA_DIR: &str = "./keel-data";

#[derive(Debug, Parser)]
#[command(
    name = "keel",
    version,
    about = "Keel: a VM lifecycle manager. `keel serve` runs the server; the other commands talk to it over HTTP.",
    after_help = "Authentication: every /api/v1 request and /metrics need `Authorization: Bearer <token>`; \
the token is generated on first start into DATA_DIR/token (mode 0600). Only /healthz is open."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the server: SQLite store, VM controller, node heartbeat and HTTP API.
    Serve(ServeArgs),
    /// Run a node agent only, for a cluster on etcd: this node's VMs, heartbeat and self-fencing.
    Agent(AgentArgs),
    /// Create, inspect and power VMs.
    Vm(VmCommand),
    /// List (or follow) recorded VM phase changes.
    Events(EventsArgs),
    /// Inspect, cordon, uncordon and drain nodes.
    Node(NodeCommand),
    /// Take, list and delete snapshots of a VM's disks.
    Snapshot(SnapshotCommand),
    /// Restore a VM from one of its snapshots; it comes back in the power state it had.
    Restore(RestoreArgs),
    /// Make the VMs a YAML or JSON file describes exist as described:
    /// create the missing, update the differing (compare-and-swap on the
    /// revision read), delete the others only with --prune.
    Apply(ApplyArgs),
    /// List live migrations (made by node drains and `keel vm migrate`).
    Migration(MigrationCommand),
    /// Check this host for running Keel: QEMU, KVM, disk space, the store.
    Doctor(DoctorArgs),
    /// Create, list and revoke API tokens (roles admin, operator, viewer);
    /// `init-file` writes a token file on this host.
    Token(TokenCommand),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Write man pages (keel.1, keel-serve.1, …) into a directory.
    #[command(hide = true)]
    Man { dir: PathBuf },
    /// Import, list and delete images (disk images, boot kernels, initrds).
    Image(ImageCommand),
    /// Measure Keel itself (`keel bench scale`: many VMs on the sim driver).
    Bench(BenchCommand),
    /// Cluster-wide setup: the CA and node certificates of the migration stream.
    Cluster(ClusterCommand),
    /// Internal: runs one QEMU under the node's fence lease (started by a
    /// node agent's QEMU driver; see keel_hv::qemu::keeper).
    #[command(hide = true)]
    Keeper(KeeperArgs),
}

#[derive(Debug, Args)]
pub struct BenchCommand {
    #[command(subcommand)]
    pub verb: BenchVerb,
}

#[derive(Debug, Subcommand)]
pub enum BenchVerb {
    /// Create, run and restart thousands of sim VMs through the API, on
    /// SQLite and on an etcd cluster; prints rates, latencies, peak RSS
    /// and store size, with the machine they were measured on.
    Scale(crate::bench_scale::ScaleArgs),
    /// Start the test guest through Keel and bare (Keel's own QEMU command
    /// line, spawned by hand), in interleaved rounds; prints the medians,
    /// their spread, Keel/bare and the phases of a Keel start.
    Start(crate::bench_start::StartArgs),
}

#[derive(Debug, Args)]
pub struct TokenCommand {
    #[command(flatten)]
    pub client: ClientArgs,
    #[command(subcommand)]
    pub verb: TokenVerb,
}

#[derive(Debug, Subcommand)]
pub enum TokenVerb {
    /// Create an API token (needs an admin token); its secret is printed
    /// once and stored nowhere, only its hash.
    Create {
        /// Who holds it: the actor named in the audit trail.
        name: String,
        /// viewer reads; operator also powers VMs, takes snapshots,
        /// migrates, attaches consoles; admin does everything.
        #[arg(long)]
        role: keel_api::Role,
        /// Lifetime: 30d, 12h, 90m or 3600s; unset, it never expires.
        #[arg(long, value_name = "DURATION", value_parser = parse_lifetime)]
        expires: Option<u64>,
    },
    /// List the tokens (names, roles, expiry, revocation; never secrets).
    List,
    /// Revoke a token, by name or id: refused on every control plane at once.
    Revoke { token: String },
    /// Write a new random admin token to FILE, unless it already holds
    /// one (e.g. /etc/keel/token shared with group keel). A server given
    /// it as --token-file makes it an admin token on start.
    InitFile {
        file: PathBuf,
        /// Share it with this group (mode 0640, owner unchanged); else 0600.
        #[arg(long)]
        group: Option<String>,
        /// Replace a token that is already there (servers using it must
        /// restart; the old one is revoked when they do).
        #[arg(long)]
        rotate: bool,
    },
}

/// `--expires 30d`: seconds.
pub fn parse_lifetime(s: &str) -> Result<u64, String> {
    let usage = "expected a number with a unit: 30d, 12h, 90m or 3600s";
    let (digits, unit) = s.split_at(s.trim_end_matches(|c: char| c.is_ascii_alphabetic()).len());
    let n: u64 = digits.parse().map_err(|_| format!("{s:?}: {usage}"))?;
    let scale = match unit {
        "d" => 86_400,
        "h" => 3_600,
        "m" => 60,
        "s" => 1,
        _ => return Err(format!("{s:?}: {usage}")),
    };
    match n.checked_mul(scale) {
        Some(0) => Err(format!("{s:?}: must be at least 1s")),
        Some(secs) if secs <= keel_api::api_token::MAX_TOKEN_LIFETIME_S => Ok(secs),
        _ => Err(format!("{s:?}: at most ten years")),
    }
}

#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// Data directory to check (disk space, permissions).
    #[arg(long, env = "KEEL_DATA_DIR", default_value = DEFAULT_DATA_DIR)]
    pub data_dir: PathBuf,
    /// Where VM disks live, if not under the data directory.
    #[arg(long, env = "KEEL_DISK_DIR")]
    pub disk_dir: Option<PathBuf>,
    /// The image store, if not DATA_DIR/images.
    #[arg(long, env = "KEEL_IMAGE_DIR")]
    pub image_dir: Option<PathBuf>,
    /// The store to check: `sqlite`, `etcds://…` or `etcd://…`
    /// (reachability; the clock offset on plain etcd).
    #[arg(long, env = "KEEL_STORE", default_value = "sqlite")]
    pub store: StoreSpec,
    #[command(flatten)]
    pub store_access: StoreAccessArgs,
    /// QEMU binary to check.
    #[arg(long, env = "KEEL_QEMU", default_value = "qemu-system-x86_64")]
    pub qemu: PathBuf,
    /// The guest `keel serve` probes KVM with (see `keel serve --help`);
    /// doctor boots it the same way to tell which accelerator serve uses.
    #[arg(long, env = "KEEL_GUEST_DIR")]
    pub guest_dir: Option<PathBuf>,
    /// The accelerator `keel serve` is configured with: auto (probe KVM),
    /// kvm or tcg.
    #[arg(long, env = "KEEL_ACCEL", default_value = "auto")]
    pub accel: keel_hv::qemu::AccelChoice,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct KeeperArgs {
    /// The instance directory (its spec.json holds QEMU's argv).
    #[arg(long)]
    pub instance_dir: PathBuf,
    /// The node's fence-lease file.
    #[arg(long)]
    pub lease: PathBuf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum HypervisorKind {
    /// Real QEMU guests.
    Qemu,
    /// In-memory simulated guests (for demos and tests; guests vanish with the process).
    Sim,
}

#[derive(Debug, Args)]
#[command(
    after_help = "Endpoints: /api/v1/... (bearer token), /metrics (Prometheus text, \
bearer token too), /healthz (no auth). Stopping the server (SIGINT/SIGTERM) leaves guests \
running; they are re-adopted on the next start."
)]
pub struct ServeArgs {
    /// The node's own flags, shared with `keel agent`.
    #[command(flatten)]
    pub node: NodeArgs,
    /// The API token's file (default DATA_DIR/token, mode 0600). Elsewhere
    /// it may be shared with its group (mode 0640), e.g. /etc/keel/token
    /// for the members of group keel.
    #[arg(long, env = "KEEL_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Address to listen on. Loopback by default: expose it deliberately.
    #[arg(long, env = "KEEL_LISTEN", default_value = DEFAULT_LISTEN)]
    pub listen: SocketAddr,
    /// The API's certificate chain (PEM), instead of the self-signed one
    /// generated into DATA_DIR/tls on first start. With --tls-key.
    #[arg(long, env = "KEEL_TLS_CERT", value_name = "PEM")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "KEEL_TLS_KEY", value_name = "PEM")]
    pub tls_key: Option<PathBuf>,
    /// Serve the API over plain HTTP instead of HTTPS: the token travels
    /// unencrypted. Allowed only on a loopback --listen address.
    #[arg(long)]
    pub insecure_http: bool,
    /// Create a demo VM (`demo`) if there is none.
    #[arg(long)]
    pub demo: bool,
    /// Where the state lives: `sqlite` (DATA_DIR/keel.db; this process does
    /// everything) or `etcds://HOST:PORT[,HOST:PORT…][/NAMESPACE]` (default
    /// namespace /keel; etcd over TLS, see --etcd-ca): a control plane (API,
    /// leader election, placement) with no node agent unless --agent.
    /// `etcd://…` (plain) only with --insecure-store.
    #[arg(long, env = "KEEL_STORE", default_value = "sqlite")]
    pub store: StoreSpec,
    #[command(flatten)]
    pub store_access: StoreAccessArgs,
    /// With an etcd store: also run a node agent (--node) in this process.
    #[arg(long)]
    pub agent: bool,
    /// With an etcd store: how often the control planes take turns at
    /// compacting etcd's history (discarding what is older than one such
    /// interval), so etcd's database does not grow until it refuses
    /// writes. 0s: leave it to etcd's own --auto-compaction-retention.
    #[arg(long, env = "KEEL_ETCD_COMPACTION_INTERVAL", value_name = "DURATION",
          value_parser = parse_window, default_value = "5m")]
    pub etcd_compaction_interval: u64,
    /// With --hypervisor sim on SQLite (benchmarks, demos of placement):
    /// this many simulated nodes in this process, the local one (--node)
    /// and NODE-2 … NODE-N, each with a controller and heartbeat of its own.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub sim_nodes: usize,
    /// With --sim-nodes: the hosts the simulated nodes pretend to be,
    /// CPUS:MEMORY each (e.g. 8:16G,32:128G), taken in turn from the local
    /// node on; default: each like --sim-host-cpus/--sim-host-memory.
    #[arg(long, value_name = "CPUS:SIZE", value_delimiter = ',', value_parser = parse_sim_host)]
    pub sim_node_hosts: Vec<keel_api::HostResources>,
    /// The most VMs the API lets exist; a create past it is refused (409).
    #[arg(long, env = "KEEL_MAX_VMS", value_name = "N", value_parser = parse_cap,
          default_value_t = crate::api::limits::DEFAULT_MAX_VMS)]
    pub max_vms: usize,
    /// The most snapshots one VM may have.
    #[arg(long, env = "KEEL_MAX_SNAPSHOTS_PER_VM", value_name = "N", value_parser = parse_cap,
          default_value_t = crate::api::limits::DEFAULT_MAX_SNAPSHOTS_PER_VM)]
    pub max_snapshots_per_vm: usize,
    /// The most images the image store may hold.
    #[arg(long, env = "KEEL_MAX_IMAGES", value_name = "N", value_parser = parse_cap,
          default_value_t = crate::api::limits::DEFAULT_MAX_IMAGES)]
    pub max_images: usize,
    /// The largest image an import may write, in bytes or with a binary
    /// suffix (KiB, MiB, GiB, TiB; K, M, G, T): an upload or a download
    /// past it is cut off and refused (413), leaving nothing.
    #[arg(long, env = "KEEL_MAX_IMAGE_SIZE", value_name = "SIZE", value_parser = parse_size,
          default_value = "64GiB")]
    pub max_image_size: u64,
    /// The most `events --follow` streams this server serves at once.
    #[arg(long, env = "KEEL_MAX_FOLLOWS", value_name = "N", value_parser = parse_cap,
          default_value_t = crate::api::limits::DEFAULT_MAX_FOLLOWS)]
    pub max_follows: usize,
    /// Events kept per VM: older ones are pruned (about once a minute).
    #[arg(long, env = "KEEL_MAX_EVENTS_PER_VM", value_name = "N", value_parser = parse_cap,
          default_value_t = keel_ctrl::event_retention::DEFAULT_MAX_EVENTS_PER_VM)]
    pub max_events_per_vm: usize,
    /// Events kept overall, the oldest pruned first.
    #[arg(long, env = "KEEL_MAX_EVENTS", value_name = "N", value_parser = parse_cap,
          default_value_t = keel_ctrl::event_retention::DEFAULT_MAX_EVENTS)]
    pub max_events: usize,
    /// Audit events kept (one per mutating request), the oldest pruned first.
    #[arg(long, env = "KEEL_MAX_AUDIT_EVENTS", value_name = "N", value_parser = parse_cap,
          default_value_t = keel_ctrl::event_retention::DEFAULT_MAX_AUDIT_EVENTS)]
    pub max_audit_events: usize,
    /// API requests per second each token may make (bursts of twice that);
    /// beyond it, 429 naming this limit. Counted per control plane.
    #[arg(long, env = "KEEL_MAX_REQUESTS_PER_TOKEN", value_name = "N", value_parser = parse_cap,
          default_value_t = crate::api::token_limits::DEFAULT_REQUESTS_PER_SECOND)]
    pub max_requests_per_token: usize,
    /// Console sessions each token may hold open at once; beyond it, 429.
    #[arg(long, env = "KEEL_MAX_CONSOLES_PER_TOKEN", value_name = "N", value_parser = parse_cap,
          default_value_t = crate::api::token_limits::DEFAULT_CONSOLES_PER_TOKEN)]
    pub max_consoles_per_token: usize,
}

/// `keel agent`: a node agent without API, for a cluster on etcd.
#[derive(Debug, Args)]
pub struct AgentArgs {
    /// The cluster's store: `etcds://HOST:PORT[,HOST:PORT…][/NAMESPACE]`
    /// (default namespace /keel; see --etcd-ca), or `etcd://…` with
    /// --insecure-store.
    #[arg(long, env = "KEEL_STORE")]
    pub store: StoreSpec,
    #[command(flatten)]
    pub store_access: StoreAccessArgs,
    /// The node's own flags, shared with `keel serve`.
    #[command(flatten)]
    pub node: NodeArgs,
    /// On SIGTERM (a planned restart, an upgrade): freeze the node for this
    /// long and exit without stopping the guests. Nothing of the node is
    /// taken over meanwhile; an agent back within it re-adopts the guests,
    /// else they are fenced at its end. 0s: no freeze (guests are fenced
    /// once the lease lapses, about 20 s). At most 1h.
    #[arg(long, value_parser = parse_window, default_value = "5m")]
    pub restart_freeze: u64,
    /// Where incoming live migrations listen: ADDR:FIRST-LAST (a port
    /// range), advertised on the node record. Default: this host's address
    /// towards the store, ports 49152-49215 — when the node has migration
    /// credentials (DATA_DIR/migration-tls, from `keel cluster issue-cert`)
    /// or --insecure-migration; else a Unix socket (same-host migrations
    /// only).
    #[arg(long, env = "KEEL_MIGRATION_LISTEN", value_parser = parse_migration_listen)]
    pub migration_listen: Option<MigrationListen>,
    /// Allow migration streams over plain TCP, unencrypted and
    /// unauthenticated, when this node has no migration credentials.
    #[arg(long)]
    pub insecure_migration: bool,
    /// Serve the consoles of this node's VMs on this address (port 0: any),
    /// for the control planes to pass `vm console` and `vm logs` on to;
    /// guarded by the cluster's API token. Unset: consoles of VMs here are
    /// not reachable from the API. (Not `listen`: one settings file serves
    /// `keel serve` and `keel agent` on a host.)
    #[arg(long, env = "KEEL_CONSOLE_LISTEN")]
    pub console_listen: Option<std::net::SocketAddr>,
}

/// The flags of a node, shared by `keel serve` and `keel agent`: its
/// name, directories, driver, capacity and controller limits
/// (`node_args` turns them into the node's settings).
#[derive(Debug, Args)]
pub struct NodeArgs {
    /// This node's name (default: the host name, lowercased, first label).
    #[arg(id = "node", long = "node", env = "KEEL_NODE")]
    pub name: Option<String>,
    /// Directory for the store (keel.db, with `keel serve` on SQLite), the
    /// API token (token), this node's instances (DATA_DIR/node) and lock.
    #[arg(long, env = "KEEL_DATA_DIR", default_value = DEFAULT_DATA_DIR)]
    pub data_dir: PathBuf,
    /// Hypervisor driver.
    #[arg(long, value_enum, default_value_t = HypervisorKind::Qemu)]
    pub hypervisor: HypervisorKind,
    /// Directory with the default guest kernel and initrd (vmlinuz,
    /// initramfs.cpio.gz) for VMs whose spec names none; default
    /// ./target/guest when built by scripts/build-test-guest.
    #[arg(long, env = "KEEL_GUEST_DIR")]
    pub guest_dir: Option<PathBuf>,
    /// Accelerator: auto probes KVM once (boots the guest to its ready
    /// marker) and falls back to TCG.
    #[arg(long, env = "KEEL_ACCEL", default_value = "auto")]
    pub accel: keel_hv::qemu::AccelChoice,
    #[command(flatten)]
    pub capacity: CapacityArgs,
    /// Where VM disks live (default DATA_DIR/node/disks). Live migration
    /// between nodes needs this on storage they share, at the same path.
    #[arg(long, env = "KEEL_DISK_DIR")]
    pub disk_dir: Option<PathBuf>,
    /// The image store (default DATA_DIR/images). In a cluster, storage
    /// the control planes (which import) and every node (which boot)
    /// mount at the same path, like a shared --disk-dir.
    #[arg(long, env = "KEEL_IMAGE_DIR")]
    pub image_dir: Option<PathBuf>,
    /// Where QEMU's sockets live, which need short paths (default
    /// /run/keel as root, else $XDG_RUNTIME_DIR/keel or /tmp/keel-UID).
    #[arg(long, env = "KEEL_RUNTIME_DIR")]
    pub runtime_dir: Option<PathBuf>,
    /// The cap on each guest's console log, in MiB: past it the log is
    /// rotated (its end kept in console.log.1), so a guest that prints
    /// without end cannot fill the host's disk.
    #[arg(long, env = "KEEL_CONSOLE_LOG_MAX_MIB", value_name = "MIB",
          value_parser = parse_console_log_max_mib, default_value_t = 8)]
    pub console_log_max_mib: u64,
    /// How many reconciles (of distinct VMs, snapshots, migrations) this
    /// node runs at once; one VM is never reconciled twice at once.
    #[arg(long, env = "KEEL_MAX_CONCURRENT_RECONCILES", value_name = "N",
          value_parser = parse_max_concurrent_reconciles,
          default_value_t = keel_ctrl::DEFAULT_MAX_CONCURRENT_RECONCILES)]
    pub max_concurrent_reconciles: usize,
    /// The free-space floor, in MiB, of the filesystems of the disk dir
    /// and the image store: below it no VM disk is created (the start
    /// fails, saying so on the VM) and no image imported. 0: no floor.
    #[arg(long, env = "KEEL_MIN_FREE_DISK_MIB", value_name = "MIB",
          default_value_t = keel_hv::free_space::DEFAULT_MIN_FREE_DISK_MIB)]
    pub min_free_disk_mib: u64,
}

/// `--max-concurrent-reconciles N`: at least 1.
pub fn parse_max_concurrent_reconciles(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{s:?} is not a count of reconciles: {e}")),
    }
}

/// A cap (`--max-vms` and the like): at least 1.
pub fn parse_cap(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{s:?} is not a count: {e}")),
    }
}

/// A size in bytes: `1048576`, `512MiB`, `64G` (suffixes are binary).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let text = s.trim();
    let digits = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(digits);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("{s:?} is not a size (e.g. 64GiB, 512M, 1048576)"))?;
    let shift = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        "t" | "tib" => 40,
        other => {
            return Err(format!(
                "{s:?}: unknown unit {other:?} (use KiB, MiB, GiB or TiB)"
            ))
        }
    };
    match number.checked_mul(1 << shift) {
        Some(0) => Err("must be at least 1 byte".into()),
        Some(bytes) => Ok(bytes),
        None => Err(format!("{s:?} is too large")),
    }
}

pub fn parse_console_log_max_mib(s: &str) -> Result<u64, String> {
    match s.parse::<u64>() {
        Ok(0) => Err("must be at least 1 (MiB)".into()),
        Ok(n) if n > 1 << 20 => Err(format!("{n} MiB is more than a console log needs")),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{s:?} is not a size in MiB: {e}")),
    }
}

/// `--migration-listen ADDR:FIRST-LAST`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationListen {
    pub address: std::net::IpAddr,
    pub ports: std::ops::RangeInclusive<u16>,
}

/// libvirt's default migration ports.
pub const DEFAULT_MIGRATION_PORTS: std::ops::RangeInclusive<u16> = 49152..=49215;

pub fn parse_migration_listen(s: &str) -> Result<MigrationListen, String> {
    let bad = |why: &str| {
        format!(
            "--migration-listen {s:?}: {why} (expected ADDR:FIRST-LAST, e.g. 10.0.0.7:49152-49215)"
        )
    };
    let (addr, ports) = s.rsplit_once(':').ok_or_else(|| bad("no port range"))?;
    let addr = addr
        .strip_prefix('[')
        .and_then(|a| a.strip_suffix(']'))
        .unwrap_or(addr);
    let address: std::net::IpAddr = addr.parse().map_err(|_| bad("not an IP address"))?;
    if address.is_unspecified() || address.is_multicast() {
        return Err(bad(
            "the address is given to other nodes: it must be one they can reach",
        ));
    }
    let (first, last) = match ports.split_once('-') {
        Some((a, b)) => (a, b),
        None => (ports, ports),
    };
    let port = |p: &str| p.parse::<u16>().ok().filter(|p| *p > 0);
    match (port(first), port(last)) {
        (Some(a), Some(b)) if a <= b => Ok(MigrationListen {
            address,
            ports: a..=b,
        }),
        _ => Err(bad("ports must be 1-65535, first <= last")),
    }
}

#[derive(Debug, Args)]
pub struct ClusterCommand {
    #[command(subcommand)]
    pub verb: ClusterVerb,
}

#[derive(Debug, Subcommand)]
pub enum ClusterVerb {
    /// Create the cluster CA (ca-cert.pem, ca-key.pem mode 0600) in CA_DIR: it
    /// issues the nodes' migration certificates and etcd's and Keel's for etcd.
    InitCa {
        #[arg(long, default_value = "./keel-ca")]
        ca_dir: PathBuf,
    },
    /// Issue NODE's migration certificate from the CA into the node's data
    /// dir (DATA_DIR/migration-tls, keys mode 0600); the agent uses it on
    /// its next start.
    IssueCert {
        node: String,
        #[arg(long, default_value = "./keel-ca")]
        ca_dir: PathBuf,
        /// The node agent's --data-dir.
        #[arg(long, default_value = DEFAULT_DATA_DIR)]
        data_dir: PathBuf,
        /// How long the certificate is valid; renew it by issuing it
        /// again before then.
        #[arg(long, default_value_t = keel_hv::qemu::tls::DEFAULT_NODE_VALID_DAYS,
              value_parser = clap::value_parser!(u32).range(1..=i64::from(keel_hv::qemu::tls::MAX_NODE_VALID_DAYS)))]
        valid_days: u32,
        /// Issue a control plane's certificate instead (NODE: its
        /// --node name, DATA_DIR: its --data-dir): what it presents to the
        /// agents to reach their consoles, which no node's certificate can.
        #[arg(long, conflicts_with_all = ["etcd_server", "etcd_client", "api_server"])]
        control_plane: bool,
        /// Instead of a migration certificate: etcd's server certificate
        /// (serverAuth; SANs NODE, --ip and --dns) into --out, for etcd's
        /// --cert-file/--key-file, with the CA for its --trusted-ca-file.
        #[arg(long, conflicts_with_all = ["etcd_client", "api_server"], group = "server_certificate")]
        etcd_server: bool,
        /// Instead of a migration certificate: a client certificate for
        /// etcd (clientAuth) into --out, for keel serve/agent's
        /// --etcd-cert/--etcd-key (and the CA for --etcd-ca).
        #[arg(long, conflicts_with = "api_server")]
        etcd_client: bool,
        /// Instead of a migration certificate: the API's certificate
        /// (serverAuth; SANs NODE, --ip and --dns) into --out, for every
        /// control plane's --tls-cert/--tls-key; clients then verify with
        /// --ca-file CA_DIR/ca-cert.pem whichever control plane answers.
        #[arg(long, group = "server_certificate")]
        api_server: bool,
        /// With --etcd-server/--api-server: an IP address the service is
        /// reached at (repeatable).
        #[arg(long, requires = "server_certificate")]
        ip: Vec<std::net::IpAddr>,
        /// With --etcd-server/--api-server: a DNS name the service is
        /// reached at (repeatable).
        #[arg(long, requires = "server_certificate")]
        dns: Vec<String>,
        /// With --etcd-server/--etcd-client/--api-server: where NODE-cert.pem,
        /// NODE-key.pem (0600) and ca-cert.pem go.
        #[arg(long, default_value = "./etcd-tls")]
        out: PathBuf,
    },
    /// Revoke every certificate issued to NODE so far: the CA's CRL
    /// (CA_DIR/ca-crl.pem) lists them, and is copied into each --data-dir
    /// given; copy it to the other nodes' DATA_DIR/migration-tls. A target
    /// refuses a source presenting a revoked certificate from its next
    /// migration on. A certificate issued to NODE afterwards is valid.
    RevokeCert {
        node: String,
        #[arg(long, default_value = "./keel-ca")]
        ca_dir: PathBuf,
        /// A node agent's --data-dir to copy the new CRL into (repeatable).
        #[arg(long)]
        data_dir: Vec<PathBuf>,
    },
}

#[derive(Debug, Args)]
pub struct ImageCommand {
    #[command(flatten)]
    pub client: ClientArgs,
    #[command(subcommand)]
    pub verb: ImageVerb,
}

#[derive(Debug, Subcommand)]
pub enum ImageVerb {
    /// Upload FILE as image NAME. Disk images must be qcow2 or raw (no
    /// backing file, no external data file); the checksum is recorded.
    Import(ImportArgs),
    /// List images.
    List,
    /// Show one image.
    Get { name: String },
    /// Delete an image (refused while a VM uses it).
    Delete { name: String },
}

#[derive(Debug, Args)]
pub struct ImportArgs {
    pub name: String,
    /// A local file (uploaded), or an http:// or https:// URL the server
    /// downloads itself.
    #[arg(value_name = "FILE|URL")]
    pub source: String,
    /// disk, kernel, initrd or iso (an installer for `keel vm create --cdrom`).
    #[arg(long, default_value = "disk", value_parser = parse_image_kind)]
    pub kind: keel_api::ImageKind,
    /// The SHA-256 the download must have (URL imports; hex).
    #[arg(long, value_name = "HEX", conflicts_with = "sha512")]
    pub sha256: Option<String>,
    /// The SHA-512 the download must have (URL imports; hex), as in
    /// Debian's SHA512SUMS.
    #[arg(long, value_name = "HEX")]
    pub sha512: Option<String>,
}

fn parse_image_kind(s: &str) -> Result<keel_api::ImageKind, String> {
    s.parse().map_err(|e: keel_api::ValidationError| e.message)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    Table,
    Json,
    Yaml,
}

/// How the CLI reaches the server. Global, so the flags may follow the verb.
#[derive(Debug, Clone, Args)]
pub struct ClientArgs {
    /// Keel server URL.
    #[arg(long, env = "KEEL_SERVER", default_value = DEFAULT_SERVER, global = true)]
    pub server: String,
    /// API token (prefer $KEEL_TOKEN: flags are visible in `ps`). Default:
    /// read --token-file, else DATA_DIR/token.
    #[arg(long, env = "KEEL_TOKEN", hide_env_values = true, global = true)]
    pub token: Option<String>,
    /// The API token's file (default DATA_DIR/token).
    #[arg(long, env = "KEEL_TOKEN_FILE", global = true)]
    pub token_file: Option<PathBuf>,
    /// Where to find the token file when no token is given, and the
    /// server's certificate (DATA_DIR/tls/cert.pem), trusted when readable.
    #[arg(long, env = "KEEL_DATA_DIR", default_value = DEFAULT_DATA_DIR, global = true)]
    pub data_dir: PathBuf,
    /// Verify the server's certificate against this CA (PEM) and its host
    /// name, instead of pinning its fingerprint.
    #[arg(long, env = "KEEL_CA_FILE", value_name = "PEM", global = true)]
    pub ca_file: Option<PathBuf>,
    /// Trust (pin) the server's certificate if its fingerprint is this
    /// (sha256:…, as `keel serve` logs it): for the first contact with a
    /// remote server, or to re-pin one whose certificate was replaced.
    #[arg(
        long,
        env = "KEEL_ACCEPT_FINGERPRINT",
        value_name = "SHA256",
        global = true
    )]
    pub accept_fingerprint: Option<String>,
    /// The pinned fingerprints of servers (default
    /// ~/.config/keel/known_servers).
    #[arg(long, env = "KEEL_KNOWN_SERVERS", value_name = "FILE", global = true)]
    pub known_servers: Option<PathBuf>,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Table, global = true)]
    pub output: OutputFormat,
}

#[derive(Debug, Args)]
pub struct VmCommand {
    #[command(flatten)]
    pub client: ClientArgs,
    #[command(subcommand)]
    pub verb: VmVerb,
}

#[derive(Debug, Subcommand)]
pub enum VmVerb {
    /// Create a VM (it starts unless --stopped or the policy says otherwise).
    Create(CreateArgs),
    /// List VMs.
    List,
    /// Show one VM.
    Get { name: String },
    /// Ask a VM to run.
    Start(PowerArgs),
    /// Ask a VM to stop (graceful power-down, forced after its grace period).
    Stop(PowerArgs),
    /// Restart a VM: the old instance is stopped before a new one starts.
    Restart(PowerArgs),
    /// Reboot the running guest inside its instance (no new instance): asked
    /// through its guest agent, reset by the hypervisor if it has not
    /// rebooted within its stop grace period (at once without an agent).
    Reboot(PowerArgs),
    /// Delete a VM (its instance is stopped and its disks removed first).
    Delete(PowerArgs),
    /// Print the serial console log (ttyS0) of the VM's current instance.
    Logs(LogsArgs),
    /// Attach to the VM's serial console (like `virsh console`); Ctrl-]
    /// detaches.
    Console { name: String },
    /// Live-migrate a running VM to another node (the drain's tuning and
    /// limits; drains go first). A failure leaves it running where it is.
    Migrate(MigrateArgs),
    /// Create a new VM whose disks are copies of this one's at a snapshot
    /// (taken now, live if it runs, unless --snapshot names one).
    Clone(CloneArgs),
    /// Write the VM to one file: a consistent copy of each disk at a
    /// snapshot (taken now, live if it runs, and deleted after, unless
    /// --snapshot names one) and its spec. The VM's snapshots do not go
    /// with it.
    Export(VmExportArgs),
    /// Create a VM from a file written by `keel vm export` (its disks as
    /// they were, a MAC and cloud-init instance-id of its own).
    Import(VmImportArgs),
    /// Add, remove or grow one of a VM's disks.
    #[command(subcommand)]
    Disk(DiskVerb),
    /// Put an ISO image in the VM's CD-ROM, eject it, or change which of
    /// it and the first disk boots first (a spec change: a running VM
    /// takes it at its next start).
    Cdrom(CdromArgs),
    /// CPU, memory, disk and network rates of the VMs running on the
    /// server's node, redrawn live on a terminal.
    Top(TopArgs),
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("change").required(true).multiple(true).args(["insert", "eject", "boot_first"])))]
pub struct CdromArgs {
    pub name: String,
    /// An image of kind iso to put in the CD-ROM (replacing any).
    #[arg(long, value_name = "IMAGE", conflicts_with = "eject")]
    pub insert: Option<String>,
    /// Empty the CD-ROM (and drop it from the boot order).
    #[arg(long)]
    pub eject: bool,
    /// What firmware tries first: cdrom or disk.
    #[arg(long = "boot", value_name = "cdrom|disk", value_parser = parse_boot_device)]
    pub boot_first: Option<keel_api::BootDevice>,
}

#[derive(Debug, Args)]
pub struct TopArgs {
    /// Only these VMs (default: every VM on the node).
    pub names: Vec<String>,
    /// Print one table and exit (also when stdout is not a terminal).
    #[arg(long)]
    pub once: bool,
    /// Seconds between redraws.
    #[arg(long, default_value_t = 2.0)]
    pub interval: f64,
}

#[derive(Debug, Subcommand)]
pub enum DiskVerb {
    /// Add a blank disk: plugged into a running VM (up to four per
    /// instance), made at a stopped VM's next start.
    Add(DiskAddArgs),
    /// Remove a disk from the spec. Its file stays in the VM's disk dir
    /// (removed with the VM); added back under its name, it is that disk.
    /// The disk the VM boots from cannot be removed.
    Remove(DiskRemoveArgs),
    /// Grow a disk (never shrink): a running VM's disk is grown under its
    /// guest at once, a stopped VM's file at its next start.
    Resize(DiskAddArgs),
}

#[derive(Debug, Args)]
pub struct DiskAddArgs {
    /// The VM.
    pub name: String,
    /// The disk's name.
    pub disk: String,
    /// Its size: MiB, or with a suffix M, G or T (`2G`).
    #[arg(long, value_parser = parse_size_mib)]
    pub size: u64,
}

#[derive(Debug, Args)]
pub struct DiskRemoveArgs {
    pub name: String,
    pub disk: String,
}

#[derive(Debug, Args)]
pub struct CloneArgs {
    /// The VM to clone.
    pub source: String,
    /// The new VM's name.
    pub name: String,
    /// A Ready snapshot of the source to copy from; without it, snapshot
    /// `clone-NAME` is taken first (and kept: `keel snapshot delete`).
    #[arg(long)]
    pub snapshot: Option<String>,
    /// Run the clone (it is created stopped otherwise).
    #[arg(long)]
    pub start: bool,
    /// Make each disk an overlay on a frozen copy of the source's at the
    /// snapshot (shared by the linked clones of it) instead of a full copy.
    #[arg(long)]
    pub linked: bool,
    /// Seconds to wait for the snapshot taken first.
    #[arg(long, default_value_t = 120)]
    pub timeout: u64,
}

#[derive(Debug, Args)]
pub struct VmExportArgs {
    /// The VM to export.
    pub name: String,
    /// The file to write (a tar archive; replaced only once complete).
    pub file: std::path::PathBuf,
    /// A Ready snapshot to export at (kept); without it, snapshot
    /// `export-<seconds>` is taken first and deleted after.
    #[arg(long)]
    pub snapshot: Option<String>,
    /// Seconds to wait for the snapshot taken first.
    #[arg(long, default_value_t = 120)]
    pub timeout: u64,
}

#[derive(Debug, Args)]
pub struct VmImportArgs {
    /// A file written by `keel vm export`.
    pub file: std::path::PathBuf,
    /// The new VM's name (default: the exported VM's).
    #[arg(long)]
    pub name: Option<String>,
    /// Run the VM (it is created stopped otherwise).
    #[arg(long)]
    pub start: bool,
    /// Keep the exported MAC, cloud-init instance-id and published ports
    /// (for moving a VM, not copying it).
    #[arg(long)]
    pub keep_identity: bool,
}

#[derive(Debug, Args)]
pub struct MigrateArgs {
    pub name: String,
    /// The node to move to (default: the scheduler's best candidate).
    #[arg(long)]
    pub to: Option<String>,
    /// Wait until the migration is over; print its outcome, transport and
    /// downtime (exit status 1 if it failed).
    #[arg(long)]
    pub wait: bool,
    /// Seconds to wait with --wait.
    #[arg(long, default_value_t = 600, requires = "wait")]
    pub timeout: u64,
}

#[derive(Debug, Args)]
pub struct LogsArgs {
    pub name: String,
    /// Only the last N lines.
    #[arg(long)]
    pub tail: Option<u64>,
    /// On a terminal too, write the log's bytes as they are (by default
    /// the guest's control characters are shown escaped there; a pipe
    /// always gets the bytes as they are).
    #[arg(long)]
    pub raw: bool,
}

#[derive(Debug, Args)]
pub struct CreateArgs {
    pub name: String,
    /// Virtual CPUs.
    #[arg(long, default_value_t = 1)]
    pub cpus: u32,
    /// Memory in MiB.
    #[arg(long, default_value_t = 256)]
    pub memory: u64,
    /// A disk as NAME:SIZE_MIB; repeat for more.
    #[arg(long = "disk", value_parser = parse_disk)]
    pub disks: Vec<DiskSpec>,
    /// Run policy: AlwaysOn, AlwaysOff, Manual, AlwaysOnUnlessStoppedManually
    /// (the default), RerunOnFailure, Once.
    #[arg(long, value_parser = parse_policy)]
    pub policy: Option<RunPolicy>,
    /// Create it powered off.
    #[arg(long)]
    pub stopped: bool,
    /// Seconds a graceful stop may take before the guest is killed.
    #[arg(long, default_value_t = keel_api::DEFAULT_STOP_GRACE_PERIOD_S)]
    pub grace: u64,
    /// A disk image of the image store (`keel image import`): the VM gets
    /// its own root disk on it, as its first disk, and boots from it
    /// through firmware.
    #[arg(long)]
    pub image: Option<String>,
    /// Size of the root disk made from --image, in MiB (at least the
    /// image's virtual size, which is the default).
    #[arg(long, requires = "image")]
    pub disk_size: Option<u64>,
    /// Firmware: bios (SeaBIOS, the default), uefi (OVMF, with a
    /// variable store of the VM's own) or uefi-secure (UEFI Secure Boot).
    #[arg(long, value_parser = parse_firmware)]
    pub firmware: Option<keel_api::Firmware>,
    /// UEFI Secure Boot (`--firmware uefi-secure`): OVMF's Secure Boot
    /// build, SMM, and a variable store with Microsoft's keys enrolled.
    /// Needs the q35 machine type; fixed for the VM's life.
    #[arg(long)]
    pub secure_boot: bool,
    /// An emulated TPM 2.0 (swtpm), its state kept with the VM's disks.
    #[arg(long)]
    pub tpm: bool,
    /// Kernel for direct boot: an image of kind kernel in the image store.
    #[arg(long)]
    pub kernel: Option<String>,
    /// An image of kind iso attached as a read-only CD-ROM (an OS
    /// installer); the VM boots through firmware.
    #[arg(long, value_name = "IMAGE", conflicts_with = "kernel")]
    pub cdrom: Option<String>,
    /// What firmware tries first with --cdrom: cdrom (the default) or disk.
    #[arg(long = "boot", value_name = "cdrom|disk", value_parser = parse_boot_device)]
    pub boot_first: Option<keel_api::BootDevice>,
    /// A graphical console: vnc (a VGA display whose screen the API serves
    /// as a WebSocket VNC stream, GET /api/v1/vms/NAME/vnc).
    #[arg(long, value_name = "vnc", value_parser = parse_graphics)]
    pub graphics: Option<keel_api::Graphics>,
    /// Initrd for direct boot: an image of kind initrd in the image store.
    #[arg(long)]
    pub initrd: Option<String>,
    /// Kernel command line.
    #[arg(long)]
    pub cmdline: Option<String>,
    /// When the guest counts as ready: `agent` (qemu-guest-agent answers;
    /// the default), `console:TEXT` (the serial console printed TEXT) or
    /// `none` (as soon as it runs).
    #[arg(long, value_parser = parse_readiness)]
    pub readiness: Option<Readiness>,
    /// High availability on: if its node is lost, the VM is fenced there
    /// and started on another node. Takes effect on shared disks only (on
    /// node-local ones no other node could start it, so nothing is
    /// fenced). Default: on where the disks are shared, off otherwise.
    #[arg(long, conflicts_with = "no_ha")]
    pub ha: bool,
    /// High availability off: the VM is never fenced; it keeps running
    /// through its agent's death and store outages, and waits for its node
    /// if that is lost.
    #[arg(long)]
    pub no_ha: bool,
    /// The guest's CPU model (`qemu-system-x86_64 -cpu help` lists them),
    /// or `host` to pass the host's CPU through (KVM only; the VM then
    /// migrates only to identical CPUs). Default: a migratable baseline
    /// model, kept across restarts and migrations.
    #[arg(long, value_name = "MODEL")]
    pub cpu_model: Option<String>,
    /// Wait until the VM runs and its guest is ready.
    #[arg(long)]
    pub wait: bool,
    /// Seconds to wait with --wait.
    #[arg(long, default_value_t = 300, requires = "wait")]
    pub timeout: u64,
    #[command(flatten)]
    pub net: Box<crate::cli::net::NetArgs>,
    #[command(flatten)]
    pub placement: Box<crate::cli::placement::PlacementArgs>,
}

fn parse_readiness(s: &str) -> Result<Readiness, String> {
    s.parse::<Readiness>()
        .map_err(|e| format!("{}: {}", e.field, e.message))
}

#[derive(Debug, Args)]
pub struct PowerArgs {
    pub name: String,
    /// Wait until the change is done (Running and ready / Stopped / a new
    /// instance Running and ready / gone).
    #[arg(long)]
    pub wait: bool,
    /// Seconds to wait with --wait.
    #[arg(long, default_value_t = 120, requires = "wait")]
    pub timeout: u64,
}

#[derive(Debug, Args)]
pub struct EventsArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    /// Only events of this VM.
    pub vm: Option<String>,
    /// Only the audit trail's requests made with the token of this name.
    #[arg(long, value_name = "TOKEN_NAME")]
    pub actor: Option<String>,
    /// Keep printing new events as they happen.
    #[arg(long, short = 'f')]
    pub follow: bool,
}

#[derive(Debug, Args)]
pub struct NodeCommand {
    #[command(flatten)]
    pub client: ClientArgs,
    #[command(subcommand)]
    pub verb: NodeVerb,
}

#[derive(Debug, Subcommand)]
pub enum NodeVerb {
    /// List nodes.
    List,
    /// Show one node, including its accelerator (default: the only node).
    Info { name: Option<String> },
    /// Cordon a node as its operator: no new VM is placed on it. Only
    /// `uncordon --operator` lifts this cordon.
    Cordon { name: String },
    /// End a drain and lift Keel's own cordon (with --operator, an operator's cordon too).
    Uncordon(UncordonArgs),
    /// Move every VM off a node: live migration first, else stop here and
    /// start elsewhere, each phase bounded by its window. Cordons the node.
    Drain(DrainArgs),
    /// Freeze a node for a planned agent restart: its VMs are not taken
    /// over until the freeze ends, its guests keep running (and are fenced
    /// at its end if the agent has not returned). The agent ends it.
    Freeze(FreezeArgs),
    /// Set (KEY=VALUE) or remove (KEY-) labels on a node; VMs created with
    /// `--node-selector KEY=VALUE` go only to nodes carrying it.
    Label(LabelArgs),
}

#[derive(Debug, Args)]
pub struct LabelArgs {
    pub name: String,
    /// KEY=VALUE to set, KEY- to remove.
    #[arg(required = true, value_name = "KEY=VALUE|KEY-")]
    pub labels: Vec<String>,
}

#[derive(Debug, Args)]
pub struct FreezeArgs {
    pub name: String,
    /// How long (e.g. 90s, 5m; at most 1h).
    #[arg(long = "for", value_parser = parse_window)]
    pub for_s: u64,
    /// Shown on the node.
    #[arg(long)]
    pub reason: Option<String>,
}

#[derive(Debug, Args)]
pub struct UncordonArgs {
    pub name: String,
    /// Lift an operator's cordon too (set by `keel node cordon`).
    #[arg(long)]
    pub operator: bool,
    /// Live-migrate back the VMs that drains moved off this node, each
    /// through the same bounded migration as `keel vm migrate`.
    #[arg(long = "return")]
    pub return_vms: bool,
    /// With --return: wait until each VM is back (or its migration failed).
    #[arg(long, requires = "return_vms")]
    pub wait: bool,
    /// Seconds to wait with --wait.
    #[arg(long, default_value_t = 600, requires = "wait")]
    pub timeout: u64,
}

#[derive(Debug, Args)]
pub struct DrainArgs {
    pub name: String,
    /// How long a VM's migration may take to get under way (e.g. 90s, 10m, 1h; 1s..24h).
    #[arg(long, value_parser = parse_window)]
    pub submit_window: Option<u64>,
    /// How long a migration under way may take to complete.
    #[arg(long, value_parser = parse_window)]
    pub migrate_window: Option<u64>,
    /// How long the fallback (graceful stop, forced at the end) may take.
    #[arg(long, value_parser = parse_window)]
    pub fallback_window: Option<u64>,
    /// A migration is cancelled when running longer than this per GiB of
    /// guest memory (default 150s).
    #[arg(long, value_parser = parse_window)]
    pub completion_timeout_per_gib: Option<u64>,
    /// A migration is cancelled when nothing new was sent for this long
    /// (default 150s).
    #[arg(long, value_parser = parse_window)]
    pub progress_timeout: Option<u64>,
    /// Bandwidth cap per migration, MiB/s (default: the node's setting).
    #[arg(long)]
    pub bandwidth: Option<u64>,
    /// Do not throttle busy guests so that their migration converges.
    #[arg(long)]
    pub no_auto_converge: bool,
    /// Longest pause at switch-over, ms (default: the hypervisor's).
    #[arg(long)]
    pub downtime_limit: Option<u64>,
    /// Migrations in flight across the cluster at most (default 5).
    #[arg(long)]
    pub max_parallel: Option<u32>,
    /// Migrations in flight into or out of one node at most (default 2).
    #[arg(long)]
    pub max_parallel_per_node: Option<u32>,
    /// Wait until no VM is left on the node, printing each VM's eviction progress.
    #[arg(long)]
    pub wait: bool,
    /// Seconds to wait with --wait.
    #[arg(long, default_value_t = 3600, requires = "wait")]
    pub timeout: u64,
}

#[derive(Debug, Args)]
pub struct SnapshotCommand {
    #[command(flatten)]
    pub client: ClientArgs,
    #[command(subcommand)]
    pub verb: SnapshotVerb,
}

#[derive(Debug, Subcommand)]
pub enum SnapshotVerb {
    /// Snapshot a VM's disks (live if it runs: the guest is paused for it).
    Create(SnapshotCreateArgs),
    /// List a VM's snapshots.
    List { vm: String },
    /// Show one snapshot.
    Get { vm: String, name: String },
    /// Delete a snapshot (from the disks, then the record).
    Delete { vm: String, name: String },
}

#[derive(Debug, Args)]
pub struct SnapshotCreateArgs {
    pub vm: String,
    pub name: String,
    /// Wait until the snapshot is taken (Ready) or failed.
    #[arg(long)]
    pub wait: bool,
    /// Seconds to wait with --wait.
    #[arg(long, default_value_t = 120, requires = "wait")]
    pub timeout: u64,
}

#[derive(Debug, Args)]
pub struct ApplyArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    /// The file: one VM (`name`, `spec`), a list, several YAML documents,
    /// or `keel vm get/list -o yaml` output; `-` reads stdin.
    #[arg(short = 'f', long = "file")]
    pub file: PathBuf,
    /// Print what would change (each changed field) and change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Also delete the VMs the file does not name (each is printed).
    #[arg(long)]
    pub prune: bool,
}

#[derive(Debug, Args)]
pub struct RestoreArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    pub vm: String,
    pub snapshot: String,
    /// Wait until the restore is done and the VM is back in its power state
    /// (Running with a new instance, or Stopped).
    #[arg(long)]
    pub wait: bool,
    /// Seconds to wait with --wait.
    #[arg(long, default_value_t = 300, requires = "wait")]
    pub timeout: u64,
}

#[derive(Debug, Args)]
pub struct MigrationCommand {
    #[command(flatten)]
    pub client: ClientArgs,
    #[command(subcommand)]
    pub verb: MigrationVerb,
}

#[derive(Debug, Subcommand)]
pub enum MigrationVerb {
    /// List migrations, oldest first (only of VM, if given).
    List { vm: Option<String> },
}

/// A window as seconds: `600`, `600s`, `10m`, `1h`, `1h30m`. The range is
/// the server's to check (its error names the field).
pub fn parse_window(s: &str) -> Result<u64, String> {
    let bad = || format!("{s:?}: expected a duration like 90s, 10m, 1h or 1h30m");
    let mut total: u64 = 0;
    let mut digits = String::new();
    let mut any = false;
    for c in s.trim().chars() {
        if c.is_ascii_digit() {
            digits.push(c);
            continue;
        }
        let unit = match c {
            's' => 1,
            'm' => 60,
            'h' => 3600,
            'd' => 86_400,
            _ => return Err(bad()),
        };
        let n: u64 = digits.parse().map_err(|_| bad())?;
        total = n
            .checked_mul(unit)
            .and_then(|v| total.checked_add(v))
            .ok_or_else(bad)?;
        digits.clear();
        any = true;
    }
    if !digits.is_empty() {
        let n: u64 = digits.parse().map_err(|_| bad())?;
        total = total.checked_add(n).ok_or_else(bad)?;
        any = true;
    }
    if any {
        Ok(total)
    } else {
        Err(bad())
    }
}

fn parse_firmware(s: &str) -> Result<keel_api::Firmware, String> {
    s.parse().map_err(|e: keel_api::ValidationError| e.message)
}

fn parse_graphics(s: &str) -> Result<keel_api::Graphics, String> {
    s.parse().map_err(|e: keel_api::ValidationError| e.message)
}

fn parse_boot_device(s: &str) -> Result<keel_api::BootDevice, String> {
    s.parse().map_err(|e: keel_api::ValidationError| e.message)
}

fn parse_disk(s: &str) -> Result<DiskSpec, String> {
    let (name, size) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?}: expected NAME:SIZE_MIB, e.g. data:1024"))?;
    let size_mib = size
        .parse::<u64>()
        .map_err(|e| format!("{s:?}: size {size:?} is not a number of MiB: {e}"))?;
    Ok(DiskSpec {
        name: name.to_string(),
        size_mib,
        image: None,
    })
}

/// A size in MiB: a number of MiB, or one with a suffix M, G or T.
/// `CPUS:SIZE` of `--sim-node-hosts`.
fn parse_sim_host(s: &str) -> Result<keel_api::HostResources, String> {
    let (cpus, memory) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?}: expected CPUS:SIZE, e.g. 8:16G"))?;
    let cpus: u32 = cpus
        .parse()
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("{s:?}: the CPUs must be a whole number above 0"))?;
    Ok(keel_api::HostResources {
        cpus,
        memory_mib: parse_size_mib(memory)?,
    })
}

pub fn parse_size_mib(s: &str) -> Result<u64, String> {
    let (number, unit) = match s.trim_end_matches(['i', 'B']).char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => (&s[..i], c.to_ascii_uppercase()),
        _ => (s, 'M'),
    };
    let shift = match unit {
        'M' => 0,
        'G' => 10,
        'T' => 20,
        _ => return Err(format!("{s:?}: the unit is not one of M, G, T")),
    };
    let n = number
        .parse::<u64>()
        .map_err(|e| format!("{s:?}: {number:?} is not a whole number: {e}"))?;
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("{s:?} is too large"))
}

fn parse_policy(s: &str) -> Result<RunPolicy, String> {
    s.parse::<RunPolicy>().map_err(|e| e.message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn sizes_take_binary_units() {
        assert_eq!(parse_size("64GiB"), Ok(64 << 30));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("1048576"), Ok(1 << 20));
        assert!(parse_size("0").is_err());
        assert!(parse_size("12 parsecs")
            .unwrap_err()
            .contains("unknown unit"));
        assert!(parse_size("99999999999T")
            .unwrap_err()
            .contains("too large"));
    }

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn sizes_read_as_mib() {
        assert_eq!(parse_size_mib("512"), Ok(512));
        assert_eq!(parse_size_mib("64M"), Ok(64));
        assert_eq!(parse_size_mib("2G"), Ok(2048));
        assert_eq!(parse_size_mib("2GiB"), Ok(2048));
        assert_eq!(parse_size_mib("1T"), Ok(1 << 20));
        assert!(parse_size_mib("2K").is_err());
        assert!(parse_size_mib("big").is_err());
    }

    #[test]
    fn max_concurrent_reconciles_defaults_to_the_runtimes_and_refuses_zero() {
        let serve = |extra: &[&str]| {
            let mut argv = vec!["keel", "serve"];
            argv.extend_from_slice(extra);
            match Cli::try_parse_from(argv).map(|c| c.command) {
                Ok(Command::Serve(args)) => Ok(args.node.max_concurrent_reconciles),
                Ok(_) => panic!("not serve"),
                Err(e) => Err(e.to_string()),
            }
        };
        assert_eq!(serve(&[]), Ok(keel_ctrl::DEFAULT_MAX_CONCURRENT_RECONCILES));
        assert_eq!(serve(&["--max-concurrent-reconciles", "4"]), Ok(4));
        let err = serve(&["--max-concurrent-reconciles", "0"]).unwrap_err();
        assert!(err.contains("--max-concurrent-reconciles"), "{err}");
        assert!(serve(&["--max-concurrent-reconciles", "many"]).is_err());
    }

    /// `keel serve` and `keel agent` take the node's flags alike, into
    /// one `NodeArgs`.
    #[test]
    fn serve_and_agent_share_the_node_flags() {
        let flags = [
            "--node",
            "n1",
            "--data-dir",
            "/d",
            "--hypervisor",
            "sim",
            "--guest-dir",
            "/g",
            "--accel",
            "tcg",
            "--reserve-memory",
            "2G",
            "--cpu-overcommit",
            "2",
            "--disk-dir",
            "/x",
            "--image-dir",
            "/i",
            "--runtime-dir",
            "/r",
            "--console-log-max-mib",
            "3",
            "--max-concurrent-reconciles",
            "2",
            "--min-free-disk-mib",
            "5",
        ];
        let node_args = |command: &[&str]| {
            let mut argv = vec!["keel"];
            argv.extend_from_slice(command);
            argv.extend_from_slice(&flags);
            match Cli::try_parse_from(argv).unwrap().command {
                Command::Serve(args) => format!("{:?}", args.node),
                Command::Agent(args) => format!("{:?}", args.node),
                _ => panic!("neither serve nor agent"),
            }
        };
        let served = node_args(&["serve"]);
        assert!(served.contains(r#"name: Some("n1")"#), "{served}");
        assert!(served.contains("max_concurrent_reconciles: 2"), "{served}");
        assert_eq!(
            served,
            node_args(&["agent", "--store", "etcd://127.0.0.1:2379"])
        );
    }

    #[test]
    fn the_console_log_cap_defaults_to_8_mib_and_refuses_zero() {
        let serve = |extra: &[&str]| {
            let mut argv = vec!["keel", "serve"];
            argv.extend_from_slice(extra);
            match Cli::try_parse_from(argv).map(|c| c.command) {
                Ok(Command::Serve(args)) => Ok(args.node.console_log_max_mib),
                Ok(_) => panic!("not serve"),
                Err(e) => Err(e.to_string()),
            }
        };
        assert_eq!(serve(&[]), Ok(8));
        assert_eq!(serve(&["--console-log-max-mib", "1"]), Ok(1));
        let err = serve(&["--console-log-max-mib", "0"]).unwrap_err();
        assert!(err.contains("--console-log-max-mib"), "{err}");
    }

    #[test]
    fn parses_create_flags() {
        let cli = Cli::try_parse_from([
            "keel", "vm", "create", "web", "--disk", "data:64", "--policy", "manual", "-o", "json",
        ])
        .unwrap();
        let Command::Vm(vm) = cli.command else {
            panic!("not vm")
        };
        assert_eq!(vm.client.output, OutputFormat::Json);
        let VmVerb::Create(c) = vm.verb else {
            panic!("not create")
        };
        assert_eq!(c.disks[0].size_mib, 64);
        assert_eq!(c.policy, Some(RunPolicy::Manual));
        assert!(parse_disk("nosize").is_err());
    }

    #[test]
    fn every_run_policy_parses_and_is_in_the_help() {
        let help = Cli::command()
            .find_subcommand_mut("vm")
            .and_then(|c| c.find_subcommand_mut("create"))
            .expect("vm create")
            .render_long_help()
            .to_string();
        for p in RunPolicy::ALL {
            assert_eq!(parse_policy(&format!("{p:?}")), Ok(p));
            assert!(
                help.contains(&format!("{p:?}")),
                "{p:?} missing from: {help}"
            );
        }
    }

    #[test]
    fn parses_windows() {
        assert_eq!(parse_window("600"), Ok(600));
        assert_eq!(parse_window("90s"), Ok(90));
        assert_eq!(parse_window("10m"), Ok(600));
        assert_eq!(parse_window("1h30m"), Ok(5400));
        assert_eq!(
            parse_window("0s"),
            Ok(0),
            "the server refuses it, naming the field"
        );
        for bad in ["", "m", "10x", "1.5h", "-5", "99999999999999999999"] {
            assert!(parse_window(bad).is_err(), "{bad:?}");
        }
        let cli = Cli::try_parse_from([
            "keel",
            "node",
            "drain",
            "n1",
            "--submit-window",
            "2m",
            "--wait",
        ])
        .unwrap();
        let Command::Node(node) = cli.command else {
            panic!("not node")
        };
        let NodeVerb::Drain(d) = node.verb else {
            panic!("not drain")
        };
        assert_eq!(
            (d.submit_window, d.migrate_window, d.wait),
            (Some(120), None, true)
        );
        assert!(Cli::try_parse_from(["keel", "node", "drain", "n1", "--timeout", "5"]).is_err());
    }
}

/// How the node's capacity follows from its host (`capacity_args`).
#[derive(Debug, Clone, Args)]
pub struct CapacityArgs {
    /// Memory kept for the host, not offered to guests (MiB, or with
    /// M, G or T).
    #[arg(long, env = "KEEL_RESERVE_MEMORY", value_name = "SIZE",
          value_parser = parse_size_mib, default_value = "1G")]
    pub reserve_memory: u64,
    /// vCPUs offered per host CPU.
    #[arg(
        long,
        env = "KEEL_CPU_OVERCOMMIT",
        value_name = "FACTOR",
        default_value_t = 4.0
    )]
    pub cpu_overcommit: f64,
    /// Guest memory offered per MiB of the host's (less the reserve).
    #[arg(
        long,
        env = "KEEL_MEMORY_OVERCOMMIT",
        value_name = "FACTOR",
        default_value_t = 1.0
    )]
    pub memory_overcommit: f64,
    /// With --hypervisor sim: the CPUs of the host it reports (with
    /// --sim-host-memory; without both, it reports none and no capacity
    /// is judged).
    #[arg(long, value_name = "N", requires = "sim_host_memory")]
    pub sim_host_cpus: Option<u32>,
    /// With --hypervisor sim: the memory of the host it reports.
    #[arg(long, value_name = "SIZE", value_parser = parse_size_mib,
          requires = "sim_host_cpus")]
    pub sim_host_memory: Option<u64>,
}
