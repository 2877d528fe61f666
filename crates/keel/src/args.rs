//! Command-line arguments (clap derive). `main.rs` parses these and
//! dispatches; nothing here does I/O.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use keel_api::{DiskSpec, RunPolicy};

pub const DEFAULT_SERVER: &str = "http://127.0.0.1:7280";
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
    /// Create, inspect and power VMs.
    Vm(VmCommand),
    /// List (or follow) recorded VM phase changes.
    Events(EventsArgs),
    /// Inspect nodes.
    Node(NodeCommand),
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
    /// Directory for the store (keel.db) and the API token (token).
    #[arg(long, env = "KEEL_DATA_DIR", default_value = DEFAULT_DATA_DIR)]
    pub data_dir: PathBuf,
    /// Address to listen on. Loopback by default: expose it deliberately.
    #[arg(long, env = "KEEL_LISTEN", default_value = DEFAULT_LISTEN)]
    pub listen: SocketAddr,
    /// Hypervisor driver.
    #[arg(long, value_enum, default_value_t = HypervisorKind::Qemu)]
    pub hypervisor: HypervisorKind,
    /// This node's name (default: the host name, lowercased, first label).
    #[arg(long)]
    pub node: Option<String>,
    /// Directory with the default guest kernel and initrd (vmlinuz,
    /// initramfs.cpio.gz) for VMs whose spec names none; default
    /// ./target/guest when built by scripts/build-test-guest.
    #[arg(long, env = "KEEL_GUEST_DIR")]
    pub guest_dir: Option<PathBuf>,
    /// Accelerator: auto probes KVM once (boots the guest to its ready
    /// marker) and falls back to TCG.
    #[arg(long, env = "KEEL_ACCEL", default_value = "auto")]
    pub accel: keel_hv::qemu::AccelChoice,
    /// Create a demo VM (`demo`) if there is none.
    #[arg(long)]
    pub demo: bool,
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
    /// API token (prefer $KEEL_TOKEN: flags are visible in `ps`). Default: read DATA_DIR/token.
    #[arg(long, env = "KEEL_TOKEN", hide_env_values = true, global = true)]
    pub token: Option<String>,
    /// Where to find the token file when no token is given.
    #[arg(long, env = "KEEL_DATA_DIR", default_value = DEFAULT_DATA_DIR, global = true)]
    pub data_dir: PathBuf,
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
    /// Delete a VM (its instance is stopped and its disks removed first).
    Delete(PowerArgs),
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
    /// Run policy: AlwaysOn, AlwaysOff, Manual, AlwaysOnUnlessStoppedManually.
    #[arg(long, value_parser = parse_policy)]
    pub policy: Option<RunPolicy>,
    /// Create it powered off.
    #[arg(long)]
    pub stopped: bool,
    /// Seconds a graceful stop may take before the guest is killed.
    #[arg(long, default_value_t = keel_api::DEFAULT_STOP_GRACE_PERIOD_S)]
    pub grace: u64,
    /// Kernel for direct boot (a path on the node).
    #[arg(long)]
    pub kernel: Option<String>,
    /// Initrd for direct boot (a path on the node).
    #[arg(long)]
    pub initrd: Option<String>,
    /// Kernel command line.
    #[arg(long)]
    pub cmdline: Option<String>,
}

#[derive(Debug, Args)]
pub struct PowerArgs {
    pub name: String,
    /// Wait until the change is done (Running / Stopped / a new instance Running / gone).
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
    })
}

fn parse_policy(s: &str) -> Result<RunPolicy, String> {
    s.parse::<RunPolicy>().map_err(|e| e.message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
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
}
