//! The driver's configuration and what can go wrong when it starts.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::accel_choice::AccelChoice;
use super::keeper;

#[derive(Debug, Clone)]
pub struct QemuConfig {
    /// Holds `instances/` and, unless `disk_dir` is set, `disks/`. Created
    /// if missing.
    pub data_dir: PathBuf,
    /// Where VM disks live (`<disk_dir>/<vm>/<disk>.qcow2`); `None` means
    /// `data_dir/disks`. Live migration between nodes requires this to be
    /// shared storage mounted at the same path on every node: only memory
    /// and device state travel, both QEMUs open the same image files. On a
    /// network filesystem the page cache of the two hosts is not coherent,
    /// so with a disk dir set the images are opened `cache=none` wherever
    /// the filesystem takes O_DIRECT (`disks::direct_io`); elsewhere
    /// `writeback`, safe on one host (one page cache) only.
    pub disk_dir: Option<PathBuf>,
    /// Where instances' sockets live (short paths: `sun_path` holds 107
    /// bytes); `None` means [`default_runtime_dir`]. Created 0700 if missing.
    pub runtime_dir: Option<PathBuf>,
    /// Address incoming migrations listen on (TCP, a port of
    /// `migration_ports`) and that is handed to the source, so it must be
    /// this node's address as other nodes reach it. `None`: a Unix socket
    /// in the instance directory, which only a source on the same host can
    /// reach.
    pub migration_address: Option<IpAddr>,
    /// The ports incoming migrations may listen on, the first free one
    /// taken; `None`: a port the kernel picks.
    pub migration_ports: Option<std::ops::RangeInclusive<u16>>,
    /// This node's migration credentials ([`super::tls`]): with it, TCP
    /// streams are TLS with both peers verified. Without it a TCP stream is
    /// neither authenticated nor encrypted (the agent's
    /// `--insecure-migration`).
    pub migration_tls: Option<PathBuf>,
    /// Bandwidth cap for outgoing migrations in bytes/s (QEMU's
    /// `max-bandwidth`); `None` keeps QEMU's default (128 MiB/s).
    pub migration_max_bandwidth: Option<u64>,
    /// The cap on each instance's console log ([`super::console_log`]): the
    /// log and its previous part hold at most twice this.
    pub console_log_max_bytes: u64,
    /// No disk is created while the disk dir's filesystem has less free
    /// ([`crate::free_space`]); 0: no floor.
    pub min_free_disk_bytes: u64,
    /// How often the console logs are looked at against their cap.
    pub console_log_check: Duration,
    /// Bounds each `qemu-img` run and each QMP snapshot command.
    pub storage_timeout: Duration,
    pub qemu_binary: PathBuf,
    pub qemu_img: PathBuf,
    /// The user-mode network of guests ([`super::passt`]).
    pub passt_binary: PathBuf,
    /// Used when a spec's boot section leaves the kernel unset, and by the
    /// KVM probe.
    pub default_kernel: Option<PathBuf>,
    pub default_initrd: Option<PathBuf>,
    pub default_cmdline: String,
    /// The image store VMs' images come from; `None` means
    /// `data_dir/images`. In a cluster: storage shared with the control
    /// planes that import, at the same path on every node.
    pub image_dir: Option<PathBuf>,
    /// OVMF's code (read-only) and the template each UEFI VM's own
    /// variable store is copied from (Debian's `ovmf` package).
    pub ovmf_code: PathBuf,
    pub ovmf_vars: PathBuf,
    /// The same for Secure Boot ([`super::secure_boot`]): OVMF's Secure
    /// Boot build (it needs SMM) and the template with Microsoft's keys
    /// enrolled, so Secure Boot is on from the first boot.
    pub ovmf_code_secure: PathBuf,
    pub ovmf_vars_secure: PathBuf,
    /// The TPM emulator and its manufacturing tool ([`super::tpm`]).
    pub swtpm_binary: PathBuf,
    pub swtpm_setup_binary: PathBuf,
    pub accel: AccelChoice,
    /// How long the KVM probe guest may take to print its ready marker.
    pub probe_timeout: Duration,
    /// How long the probe guest's kernel may stay silent before KVM is
    /// judged not to run it (a working KVM prints the banner within a
    /// second; a nested one without acceleration never does).
    pub probe_banner_timeout: Duration,
    /// `q35` or `pc`.
    pub machine: String,
    /// Bounds every QMP command and handshake.
    pub qmp_timeout: Duration,
    /// How long `start` waits for a new QEMU's QMP to answer.
    pub launch_timeout: Duration,
    /// Bounds each guest-agent conversation (connect, sync, one command):
    /// a silent or hung agent costs at most this.
    pub agent_timeout: Duration,
    /// Bounds a filesystem freeze or thaw (the guest flushes first).
    pub freeze_timeout: Duration,
    /// Run each QEMU under a fence keeper ([`keeper`]) that kills it when
    /// the node's local lease (in the runtime dir, renewed through
    /// [`Hypervisor::renew_fence`]) lapses. For cluster nodes, where another
    /// node may start the VM once this one's lease has run out; `None` (one
    /// host, nobody else can start it) lets guests outlive Keel for good.
    pub keeper: Option<keeper::KeeperCommand>,
}

impl QemuConfig {
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            data_dir: data_dir.into(),
            disk_dir: None,
            runtime_dir: None,
            migration_address: None,
            migration_ports: None,
            migration_tls: None,
            migration_max_bandwidth: None,
            console_log_max_bytes: 8 << 20,
            min_free_disk_bytes: crate::free_space::DEFAULT_MIN_FREE_DISK_MIB << 20,
            console_log_check: Duration::from_secs(5),
            storage_timeout: Duration::from_secs(60),
            qemu_binary: "qemu-system-x86_64".into(),
            qemu_img: "qemu-img".into(),
            passt_binary: "passt".into(),
            default_kernel: None,
            default_initrd: None,
            default_cmdline: "console=ttyS0 panic=-1 quiet".into(),
            image_dir: None,
            ovmf_code: "/usr/share/OVMF/OVMF_CODE_4M.fd".into(),
            ovmf_vars: "/usr/share/OVMF/OVMF_VARS_4M.fd".into(),
            ovmf_code_secure: "/usr/share/OVMF/OVMF_CODE_4M.ms.fd".into(),
            ovmf_vars_secure: "/usr/share/OVMF/OVMF_VARS_4M.ms.fd".into(),
            swtpm_binary: "swtpm".into(),
            swtpm_setup_binary: "swtpm_setup".into(),
            accel: AccelChoice::Auto,
            probe_timeout: Duration::from_secs(20),
            probe_banner_timeout: Duration::from_secs(5),
            machine: "q35".into(),
            qmp_timeout: Duration::from_secs(5),
            launch_timeout: Duration::from_secs(30),
            agent_timeout: Duration::from_secs(2),
            freeze_timeout: Duration::from_secs(10),
            keeper: None,
        }
    }

    /// Sets the default kernel and initrd to the test guest built by
    /// `scripts/build-test-guest` in `dir` (`vmlinuz`, `initramfs.cpio.gz`).
    pub fn with_test_guest(mut self, dir: &Path) -> Self {
        self.default_kernel = Some(dir.join("vmlinuz"));
        self.default_initrd = Some(dir.join("initramfs.cpio.gz"));
        self
    }
}

#[derive(Debug, thiserror::Error)]
pub enum QemuInitError {
    #[error("qemu driver data dir {path}: {reason}")]
    DataDir { path: PathBuf, reason: String },
    #[error("qemu driver disk dir {path}: {reason}")]
    DiskDir { path: PathBuf, reason: String },
    #[error("qemu driver: {0}")]
    ImageDir(crate::images::ImageError),
    #[error("qemu driver runtime dir {path}: {reason}")]
    RuntimeDir { path: PathBuf, reason: String },
    #[error("{binary} does not run ({reason}); install qemu-system-x86 (scripts/setup)")]
    QemuMissing { binary: PathBuf, reason: String },
    #[error("qemu driver migration address {address}: {reason}")]
    MigrationAddress { address: IpAddr, reason: String },
    #[error("qemu driver migration credentials")]
    MigrationTls(#[source] super::tls::TlsError),
}
