//! Where an instance's files live, what is written in them, and the QEMU
//! command line built from them.
//!
//! ```text
//! data_dir/
//!   instances/<instance>/   one per start, removed by cleanup
//!     spec.json             LaunchRecord: the spec, start time, argv, socket dir
//!     console.log           serial ttyS0, everything the guest printed (QEMU's logfile=)
//!     qemu.log              QEMU's own stdout/stderr
//!     qemu.pid              written by QEMU (-pidfile), removed by QEMU at exit
//!     shutdown.json         last QMP SHUTDOWN event (why QEMU is exiting)
//!     kill-requested        Keel decided to kill; written before the signal
//!     exit.json             ExitRecord, written once the process is gone
//!     migration-out.json    OutgoingMigration: this instance was told to migrate
//!     snapshot-paused       Keel paused the guest for a live snapshot; resume it
//!     fs-frozen             Keel froze the guest's filesystems; thaw them
//!     cidata.img            cloud-init NoCloud seed, rebuilt at every start
//!   disks/<vm>/<disk>.qcow2 belong to the VM and outlive instances
//!   disks/<vm>/tpm/         the TPM's state (swtpm), the VM's like its disks
//!
//! runtime_dir/<16 hex>/     the instance's sockets (a hash of its directory)
//!   qmp.sock                QMP monitor (QEMU listens)
//!   cmd.sock                guest command channel, serial ttyS1 (QEMU listens)
//!   console.sock            serial console ttyS0, interactive (QEMU listens)
//!   qga.sock                qemu-guest-agent, virtio-serial (QEMU listens)
//!   migrate.sock            incoming live migration (QEMU listens; unix URIs)
//!   swtpm.sock              the TPM's control channel (swtpm listens; see `tpm`)
//! ```
//!
//! Sockets live apart because a Unix socket's path must fit `sun_path`
//! (107 bytes): under a data dir of any real length (`/home/<user>/…/keel-data`)
//! they would not. The runtime dir is short (`/run/keel`, see
//! [`default_runtime_dir`]) and each instance's socket dir is named by a hash
//! of its instance directory, so drivers with different data dirs never
//! collide there. The socket dir is written into `spec.json` at launch, and
//! adoption reads it from there: a driver restarted with another runtime dir
//! still finds the monitors of the guests it left running.
//!
//! The disk directory can be moved out of the data dir (`QemuConfig::disk_dir`):
//! live migration between nodes needs every node to see the same images at
//! the same path, i.e. a shared directory.
//!
//! Every file is under a directory named by a validated name (DNS label), so
//! nothing built here can point outside the data dir (or the disk dir).

use std::io;
use std::path::{Path, PathBuf};

use keel_api::{Accelerator, Millis};
use serde::{de::DeserializeOwned, Deserialize, Serialize};

use super::opts::opt_escape;
use crate::{DomainSpec, ExitCause};

/// Linux `sun_path` is 108 bytes including the NUL.
pub const MAX_SOCKET_PATH: usize = 107;

/// The longest socket path below a runtime dir: `/<16 hex>/migrate.sock`.
pub const SOCKET_SUFFIX_LEN: usize = "/0123456789abcdef/migrate.sock".len();

/// Where sockets go when the configuration names no runtime dir: `/run/keel`
/// for root (tmpfs, like libvirt's `/run/libvirt`: sockets need no
/// persistence, their QEMUs do not survive a reboot either), else
/// `$XDG_RUNTIME_DIR/keel`, else `/tmp/keel-<uid>`.
pub fn default_runtime_dir() -> PathBuf {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    if uid == 0 {
        return PathBuf::from("/run/keel");
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) if Path::new(&dir).is_absolute() => Path::new(&dir).join("keel"),
        _ => PathBuf::from(format!("/tmp/keel-{uid}")),
    }
}

/// FNV-1a, 64 bit: a stable name for an instance's socket dir. Stability
/// across Keel versions is not needed for correctness (the dir is recorded
/// in `spec.json`), only uniqueness among the directories of one host.
fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// The socket dir of the instance (or probe) whose files are in `dir`.
pub fn socket_dir_for(runtime_dir: &Path, dir: &Path) -> PathBuf {
    use std::os::unix::ffi::OsStrExt;
    runtime_dir.join(format!("{:016x}", fnv1a64(dir.as_os_str().as_bytes())))
}

#[derive(Debug, Clone)]
pub struct Layout {
    pub root: PathBuf,
    /// `root/disks` unless configured elsewhere (shared storage).
    pub disks: PathBuf,
    /// Short, absolute: holds each instance's socket dir.
    pub runtime: PathBuf,
}

impl Layout {
    pub fn instances_dir(&self) -> PathBuf {
        self.root.join("instances")
    }
    pub fn disks_dir(&self) -> PathBuf {
        self.disks.clone()
    }
    /// Callers validate `instance` first.
    pub fn instance_dir(&self, instance: &str) -> PathBuf {
        self.instances_dir().join(instance)
    }
    /// The paths a new launch of `instance` uses. An instance that was
    /// launched already has its own in its record ([`Self::launched`]).
    pub fn new_instance(&self, instance: &str) -> InstancePaths {
        let dir = self.instance_dir(instance);
        let sockets = socket_dir_for(&self.runtime, &dir);
        InstancePaths::new(dir, sockets)
    }
    /// The paths of a launched instance, as its record says. Records from
    /// before socket dirs existed kept the sockets in the instance dir.
    pub fn launched(&self, instance: &str, record: &LaunchRecord) -> InstancePaths {
        let dir = self.instance_dir(instance);
        let sockets = record.socket_dir.clone().unwrap_or_else(|| dir.clone());
        InstancePaths::new(dir, sockets)
    }
    /// Callers validate `vm` first.
    pub fn vm_disks(&self, vm: &str) -> PathBuf {
        self.disks_dir().join(vm)
    }
    pub fn disk(&self, vm: &str, disk: &str) -> PathBuf {
        self.vm_disks(vm).join(format!("{disk}.qcow2"))
    }
}

#[derive(Debug, Clone)]
pub struct InstancePaths {
    pub dir: PathBuf,
    /// Holds the sockets; see the module doc.
    pub sockets: PathBuf,
    pub spec: PathBuf,
    pub qmp: PathBuf,
    pub cmd: PathBuf,
    /// Interactive side of ttyS0; its output is also logged to `console`.
    pub console_sock: PathBuf,
    pub qga: PathBuf,
    /// The VNC server of a VM with a graphical console (`qemu::vnc`).
    pub vnc_sock: PathBuf,
    pub console: PathBuf,
    pub qemu_log: PathBuf,
    pub pidfile: PathBuf,
    pub shutdown: PathBuf,
    pub kill_marker: PathBuf,
    pub exit: PathBuf,
    pub migrate_sock: PathBuf,
    pub migration_out: PathBuf,
    pub snapshot_paused: PathBuf,
    pub fs_frozen: PathBuf,
    pub seed: PathBuf,
    /// `resets.json`: the guest's resets so far (see `qemu::reset`).
    pub resets: PathBuf,
}

impl InstancePaths {
    pub fn new(dir: PathBuf, sockets: PathBuf) -> Self {
        Self {
            spec: dir.join("spec.json"),
            qmp: sockets.join("qmp.sock"),
            cmd: sockets.join("cmd.sock"),
            console_sock: sockets.join("console.sock"),
            qga: sockets.join("qga.sock"),
            vnc_sock: sockets.join("vnc.sock"),
            console: dir.join("console.log"),
            qemu_log: dir.join("qemu.log"),
            pidfile: dir.join("qemu.pid"),
            shutdown: dir.join("shutdown.json"),
            kill_marker: dir.join("kill-requested"),
            exit: dir.join("exit.json"),
            migrate_sock: sockets.join("migrate.sock"),
            migration_out: dir.join("migration-out.json"),
            snapshot_paused: dir.join("snapshot-paused"),
            fs_frozen: dir.join("fs-frozen"),
            resets: dir.join("resets.json"),
            seed: dir.join("cidata.img"),
            dir,
            sockets,
        }
    }

    /// A fresh, private socket dir: whatever an earlier launch of the same
    /// directory left there is removed, so a stale `qmp.sock` is never
    /// mistaken for the new QEMU's.
    pub fn prepare_sockets(&self) -> io::Result<()> {
        use std::os::unix::fs::DirBuilderExt;
        if self.sockets == self.dir {
            return Ok(());
        }
        match std::fs::remove_dir_all(&self.sockets) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        std::fs::DirBuilder::new().mode(0o700).create(&self.sockets)
    }

    /// Removes the socket dir (the instance dir is the caller's).
    pub fn remove_sockets(&self) -> io::Result<()> {
        if self.sockets == self.dir {
            return Ok(());
        }
        match std::fs::remove_dir_all(&self.sockets) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// The QMP `-chardev` argument. It doubles as the identity check for a
    /// pid: only this instance's QEMU carries this exact string.
    pub fn qmp_chardev_arg(&self) -> String {
        format!(
            "socket,id=qmp,path={},server=on,wait=off",
            opt_escape(&self.qmp)
        )
    }

    pub fn read_pid(&self) -> Option<u32> {
        std::fs::read_to_string(&self.pidfile)
            .ok()?
            .trim()
            .parse()
            .ok()
    }
}

/// `spec.json`: what was launched, written before QEMU is spawned.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaunchRecord {
    pub spec: DomainSpec,
    pub started_at: Millis,
    pub accelerator: Accelerator,
    pub argv: Vec<String>,
    /// Where the sockets are; `None` in records written before socket dirs
    /// existed, whose sockets are in the instance dir.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub socket_dir: Option<PathBuf>,
}

/// `exit.json`: written exactly once, after the process is observed gone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitRecord {
    pub cause: ExitCause,
    pub at: Millis,
    /// `reason` of the last QMP SHUTDOWN event, if QEMU sent one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shutdown_reason: Option<String>,
    pub kill_requested: bool,
    /// Wait status, known only when Keel was QEMU's parent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_status: Option<String>,
    /// How the exit was observed (parent wait, pidfd, startup scan).
    pub observed_by: String,
}

/// `shutdown.json`: persisted on receipt so that a Keel restart between the
/// event and QEMU's exit still knows the guest powered off.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShutdownRecord {
    pub reason: String,
    pub guest: bool,
    pub at: Millis,
}

/// The exit cause from what was observed. The SHUTDOWN event wins, since
/// QEMU saw why it was stopping; without one (SIGKILL, OOM, a QEMU crash)
/// the kill marker tells our kill from anything else.
pub fn exit_cause(shutdown_reason: Option<&str>, kill_requested: bool) -> ExitCause {
    match shutdown_reason {
        Some("guest-shutdown") => ExitCause::Poweroff,
        Some("host-qmp-quit" | "host-signal" | "host-ui") => ExitCause::Killed,
        // guest-reset (from QEMUs started with -no-reboot by earlier
        // Keels, where a reboot ended the process), guest-panic,
        // host-error and anything newer we do not know.
        Some(_) => ExitCause::Crashed,
        None if kill_requested => ExitCause::Killed,
        None => ExitCause::Crashed,
    }
}

/// Maps QMP `query-status`'s RunState. Unknown (newer) states count as
/// paused: the process is alive, so never as exited, and not as running
/// either, which would let a controller consider a boot settled.
pub fn run_state(status: &str) -> crate::DomainState {
    use crate::DomainState::*;
    match status {
        "running" => Running,
        // Before the vCPUs first run.
        "prelaunch" | "inmigrate" => Starting,
        // Everything else has the vCPUs stopped: paused, suspended, debug,
        // io-error, watchdog, guest-panicked, internal-error, save-vm,
        // restore-vm, finish-migrate, postmigrate, colo, and "shutdown",
        // which is transient here because QEMU exits on guest power-off.
        _ => Paused,
    }
}

/// Writes `value` as JSON to a temporary file and renames it into place, so
/// readers see either nothing or a whole record; the file and then its
/// directory are fsynced, so a record survives a power failure once this
/// returns (an exit record lost that way would leave a gone instance
/// looking as if it never ended, or a launch record lost, a live one as
/// if it never began).
pub fn write_json_atomic<T: Serialize>(path: &Path, value: &T) -> io::Result<()> {
    write_bytes_atomic(path, &json_bytes(value)?)
}

/// The bytes [`write_json_atomic`] writes.
pub fn json_bytes<T: Serialize>(value: &T) -> io::Result<Vec<u8>> {
    serde_json::to_vec_pretty(value).map_err(io::Error::other)
}

/// [`write_json_atomic`] of bytes already serialized.
pub fn write_bytes_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    use std::io::Write;
    let tmp = path.with_extension("json.tmp");
    let mut file = std::fs::File::create(&tmp)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    std::fs::rename(&tmp, path)?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

/// fsync of a directory: makes a rename or a new entry in it durable.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// `Ok(None)` if the file does not exist.
pub fn read_json<T: DeserializeOwned>(path: &Path) -> io::Result<Option<T>> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{}: {e}", path.display()),
            )
        }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Moves a fully prepared directory to `to` unless `to` exists. A plain
/// rename would replace an existing empty directory.
pub fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let from = CString::new(from.as_os_str().as_bytes()).map_err(io::Error::other)?;
    let to = CString::new(to.as_os_str().as_bytes()).map_err(io::Error::other)?;
    // SAFETY: both are valid NUL-terminated paths; AT_FDCWD resolves them
    // like rename(2) would.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Everything the command line depends on.
#[derive(Debug, Clone)]
pub struct LaunchPlan {
    pub instance: String,
    pub paths: InstancePaths,
    pub accelerator: Accelerator,
    pub machine: String,
    /// `-cpu`; `None`: the host's under KVM, QEMU's default under TCG (the
    /// launches of VMs with no recorded hardware).
    pub cpu_model: Option<String>,
    pub cpus: u32,
    pub memory_mib: u64,
    /// Kernel or firmware, see [`super::boot`].
    pub boot: super::boot::BootPlan,
    /// In guest order: the first is /dev/vda.
    pub disks: Vec<PathBuf>,
    /// Wait for an incoming live migration instead of booting
    /// (`-incoming defer`; the listening URI is given over QMP).
    pub incoming: bool,
    /// The VM's NIC (`None`: none, as for the KVM probe).
    pub nic: Option<super::network::NicPlan>,
    /// The cloud-init seed image, attached after the disks.
    pub seed: Option<PathBuf>,
    /// Open the disks with `cache=none` (O_DIRECT, bypassing the host's
    /// page cache) rather than `cache=writeback`: shared storage, where
    /// another host's QEMU takes over the images (see `disks`).
    pub direct_io: bool,
    /// Spare PCIe root ports for disks plugged later (q35 only).
    pub hotplug_ports: u32,
    /// Disks on a root port (a migration target's, plugged on its source):
    /// each after the ports, on its own.
    pub plugged: Vec<PluggedPath>,
    /// A graphical console (`spec.boot.graphics`), see [`super::vnc`].
    pub graphics: Option<keel_api::Graphics>,
    /// The VM's TPM ([`super::tpm`]), on its swtpm's socket.
    pub tpm: Option<super::tpm::TpmPlan>,
    /// A memory balloon device ([`super::balloon`]).
    pub balloon: bool,
}

/// A disk of a launch that sits on a root port.
#[derive(Debug, Clone)]
pub struct PluggedPath {
    pub disk: String,
    pub port: u32,
    pub path: PathBuf,
}

impl LaunchPlan {
    /// The argument vector after the binary. Never passed through a shell.
    pub fn args(&self) -> Vec<String> {
        let p = &self.paths;
        let mut a: Vec<String> = Vec::new();
        let mut push = |items: &[&str]| a.extend(items.iter().map(|s| s.to_string()));
        push(&["-name", &format!("guest={}", self.instance)]);
        // No config files from /etc, no default devices: the VM has exactly
        // what is listed here.
        push(&["-no-user-config", "-nodefaults", "-display", "none"]);
        // Seccomp filter; QEMU needs none of these after start-up.
        push(&[
            "-sandbox",
            "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
        ]);
        let accel = match self.accelerator {
            Accelerator::Kvm => "kvm",
            _ => "tcg",
        };
        push(&["-machine", &self.machine, "-accel", accel]);
        match &self.cpu_model {
            Some(model) => push(&["-cpu", model]),
            None if self.accelerator == Accelerator::Kvm => push(&["-cpu", "host"]),
            None => {}
        }
        push(&[
            "-m",
            &self.memory_mib.to_string(),
            "-smp",
            &self.cpus.to_string(),
        ]);
        // A guest reboot is a reset inside this process, as on every other
        // platform: the instance goes on, and the monitor counts the RESET
        // event (qemu::reset). A kernel panic must not pass for a reboot:
        // the pvpanic device lets the guest say it panicked, and the panic
        // action ends QEMU with SHUTDOWN reason guest-panic, a crash. (A
        // guest without a pvpanic driver whose kernel reboots on panic
        // shows as a reset; its count on the instance tells a loop.)
        push(&["-action", "reboot=reset,shutdown=poweroff,panic=shutdown"]);
        push(&["-device", "pvpanic"]);
        push(&["-pidfile", &p.pidfile.to_string_lossy()]);
        push(&[
            "-chardev",
            &p.qmp_chardev_arg(),
            "-mon",
            "chardev=qmp,mode=control",
        ]);
        // ttyS0: the console, a socket for `keel vm console` whose output
        // QEMU also appends to console.log (kept whether or not anyone is
        // attached). ttyS1: the guest command channel. With wait=off QEMU
        // drops a socket's output while no client is connected, so the
        // guest never blocks on either.
        push(&[
            "-chardev",
            &format!(
                "socket,id=console,path={},server=on,wait=off,logfile={},logappend=on",
                opt_escape(&p.console_sock),
                opt_escape(&p.console)
            ),
            "-serial",
            "chardev:console",
            "-chardev",
            &format!(
                "socket,id=cmd,path={},server=on,wait=off",
                opt_escape(&p.cmd)
            ),
            "-serial",
            "chardev:cmd",
        ]);
        // The guest agent's channel: virtio-serial port
        // org.qemu.guest_agent.0, which qemu-guest-agent opens in the guest.
        push(&[
            "-device",
            "virtio-serial-pci,id=vser0",
            "-chardev",
            &format!(
                "socket,id=qga0,path={},server=on,wait=off",
                opt_escape(&p.qga)
            ),
            "-device",
            "virtserialport,bus=vser0.0,chardev=qga0,name=org.qemu.guest_agent.0",
        ]);
        let boot = self.boot.args();
        push(&boot.iter().map(String::as_str).collect::<Vec<_>>());
        if self.incoming {
            // `defer`: QEMU starts with its images inactive (no image locks
            // taken, nothing read or written) and listens only once told
            // where over QMP, so the URI is chosen after QMP is up.
            push(&["-incoming", "defer"]);
            // `-S`: once the state has arrived the guest stays paused until
            // Keel says `cont`, which it does only after the migration's
            // success is recorded: a target never runs beside a source
            // that did not hand over.
            push(&["-S"]);
        }
        for (i, disk) in self.disks.iter().enumerate() {
            // Both modes show the guest a volatile write cache, so its
            // flushes reach QEMU and become fsync on the image file;
            // cache=none also keeps the host's page cache out of the way.
            let cache = if self.direct_io { "none" } else { "writeback" };
            let drive = format!(
                "file={},format=qcow2,cache={cache},id=disk{i}",
                opt_escape(disk)
            );
            if i == 0 && self.boot.boots_first_disk() {
                // The firmware's boot disk: a device of its own, to carry
                // the bootindex (-drive if=virtio cannot).
                push(&[
                    "-drive",
                    &format!("{drive},if=none"),
                    "-device",
                    &format!(
                        "virtio-blk-pci,drive=disk{i},bootindex={}",
                        self.boot.first_disk_bootindex()
                    ),
                ]);
            } else {
                push(&["-drive", &drive.replacen(",format", ",if=virtio,format", 1)]);
            }
        }
        if let Some(seed) = &self.seed {
            push(&["-drive", &super::cloud_init::drive_arg(seed)]);
        }
        a.extend(self.boot.cdrom_args());
        if let Some(nic) = &self.nic {
            a.extend(nic.args());
        }
        // Not on PCI: it takes no address from the devices after it.
        if let Some(tpm) = &self.tpm {
            a.extend(tpm.qemu_args());
        }
        // Last: every device before keeps the address it has without them.
        a.extend(super::hotplug::port_args(self.hotplug_ports));
        for p in &self.plugged {
            let cache = if self.direct_io { "none" } else { "writeback" };
            let id = super::hotplug::plugged_id(&p.disk);
            a.extend([
                "-drive".to_string(),
                format!(
                    "file={},format=qcow2,cache={cache},id={id},if=none",
                    opt_escape(&p.path)
                ),
                "-device".to_string(),
                format!(
                    "virtio-blk-pci,drive={id},bus={},id={id}",
                    super::hotplug::port_id(p.port)
                ),
            ]);
        }
        // After everything: turning the display on or off moves no other
        // device's PCI address.
        if let Some(graphics) = self.graphics {
            a.extend(super::vnc::args(graphics, &p.vnc_sock));
        }
        // Last too, for the same reason: instances from before it keep
        // every address they had.
        if self.balloon {
            a.extend(super::balloon::device_args());
        }
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DomainState;

    #[test]
    fn causes_follow_the_shutdown_event_then_the_kill_marker() {
        assert_eq!(
            exit_cause(Some("guest-shutdown"), true),
            ExitCause::Poweroff
        );
        assert_eq!(exit_cause(Some("guest-reset"), false), ExitCause::Crashed);
        assert_eq!(exit_cause(Some("guest-panic"), false), ExitCause::Crashed);
        assert_eq!(exit_cause(Some("host-qmp-quit"), false), ExitCause::Killed);
        assert_eq!(exit_cause(Some("host-signal"), false), ExitCause::Killed);
        assert_eq!(exit_cause(None, true), ExitCause::Killed);
        assert_eq!(exit_cause(None, false), ExitCause::Crashed);
    }

    #[test]
    fn run_states() {
        assert_eq!(run_state("running"), DomainState::Running);
        assert_eq!(run_state("prelaunch"), DomainState::Starting);
        assert_eq!(run_state("inmigrate"), DomainState::Starting);
        assert_eq!(run_state("paused"), DomainState::Paused);
        assert_eq!(run_state("guest-panicked"), DomainState::Paused);
    }

    #[test]
    fn command_line_escapes_commas_and_lists_disks_in_order() {
        let paths = InstancePaths::new(
            PathBuf::from("/data,x/instances/web-1"),
            PathBuf::from("/run/k,eel/0123"),
        );
        let plan = LaunchPlan {
            instance: "web-1".into(),
            paths,
            accelerator: Accelerator::Tcg,
            machine: "q35".into(),
            cpu_model: None,
            cpus: 2,
            memory_mib: 256,
            boot: super::super::boot::BootPlan::Kernel {
                kernel: "/k".into(),
                initrd: Some("/i".into()),
                cmdline: "console=ttyS0 quiet".into(),
                uefi: None,
            },
            disks: vec!["/d/a.qcow2".into(), "/d/b,c.qcow2".into()],
            incoming: false,
            nic: Some(
                super::super::network::NicPlan::new(
                    "web",
                    "web-1",
                    &keel_api::NetworkSpec {
                        mac: Some("52:54:00:00:00:01".into()),
                        ..Default::default()
                    },
                )
                .unwrap(),
            ),
            seed: Some("/data,x/instances/web-1/cidata.img".into()),
            direct_io: false,
            hotplug_ports: 0,
            plugged: vec![],
            graphics: None,
            tpm: None,
            balloon: false,
        };
        let args = plan.args();
        let joined = args.join(" ");
        assert!(joined
            .contains("-chardev socket,id=qmp,path=/run/k,,eel/0123/qmp.sock,server=on,wait=off"));
        let drives: Vec<_> = args
            .windows(2)
            .filter(|w| w[0] == "-drive")
            .map(|w| w[1].clone())
            .collect();
        assert_eq!(
            drives,
            [
                "file=/d/a.qcow2,if=virtio,format=qcow2,cache=writeback,id=disk0",
                "file=/d/b,,c.qcow2,if=virtio,format=qcow2,cache=writeback,id=disk1",
                // The seed comes after the VM's own disks, read-only.
                "file=/data,,x/instances/web-1/cidata.img,if=virtio,format=raw,readonly=on,id=cidata"
            ]
        );
        assert!(joined.contains(
            "-netdev stream,id=net0,server=off,addr.type=fd,addr.str=3 -device virtio-net-pci,netdev=net0,mac=52:54:00:00:00:01,romfile="
        ));
        // The cmdline stays one argument, spaces and all.
        assert!(args.iter().any(|a| a == "console=ttyS0 quiet"));
        // Console serial comes before the command channel: ttyS0, then ttyS1.
        let serials: Vec<_> = args
            .windows(2)
            .filter(|w| w[0] == "-serial")
            .map(|w| w[1].as_str())
            .collect();
        assert_eq!(serials, ["chardev:console", "chardev:cmd"]);
        assert!(joined.contains(
            "socket,id=console,path=/run/k,,eel/0123/console.sock,server=on,wait=off,\
             logfile=/data,,x/instances/web-1/console.log,logappend=on"
        ));
        assert!(joined.contains("name=org.qemu.guest_agent.0"), "{joined}");
        assert!(joined.contains("socket,id=qga0,path=/run/k,,eel/0123/qga.sock,server=on"));
        assert!(
            !args.iter().any(|a| a == "-cpu"),
            "TCG keeps the default CPU"
        );
        assert!(!args.iter().any(|a| a == "-incoming"));
        let recorded = LaunchPlan {
            machine: "pc-q35-7.1".into(),
            cpu_model: Some("qemu64-v1".into()),
            accelerator: Accelerator::Kvm,
            ..plan.clone()
        }
        .args()
        .join(" ");
        assert!(
            recorded.contains("-machine pc-q35-7.1 -accel kvm -cpu qemu64-v1 "),
            "the recorded hardware, not the host's CPU: {recorded}"
        );

        let direct = LaunchPlan {
            direct_io: true,
            ..plan.clone()
        };
        assert!(direct
            .args()
            .iter()
            .any(|a| a == "file=/d/a.qcow2,if=virtio,format=qcow2,cache=none,id=disk0"));

        let incoming = LaunchPlan {
            incoming: true,
            ..plan
        };
        let joined = incoming.args().join(" ");
        assert!(joined.contains("-incoming defer"), "{joined}");
        assert!(incoming.args().iter().any(|a| a == "-S"), "{joined}");

        // Spare root ports and a disk plugged on the source: last, after
        // the NIC, so every other device keeps its address.
        let target = LaunchPlan {
            hotplug_ports: 2,
            plugged: vec![PluggedPath {
                disk: "logs".into(),
                port: 1,
                path: "/d/logs.qcow2".into(),
            }],
            ..incoming.clone()
        };
        let joined = target.args().join(" ");
        let tail = joined.split_once("virtio-net-pci").unwrap().1;
        assert!(
            tail.contains(
                &[
                    "-device pcie-root-port,id=keel-hp0,bus=pcie.0,chassis=1,slot=0",
                    "-device pcie-root-port,id=keel-hp1,bus=pcie.0,chassis=2,slot=0",
                    "-drive file=/d/logs.qcow2,format=qcow2,cache=writeback,id=plugged-logs,if=none",
                    "-device virtio-blk-pci,drive=plugged-logs,bus=keel-hp1,id=plugged-logs",
                ]
                .join(" ")
            ),
            "{joined}"
        );
        assert!(!incoming.args().join(" ").contains("pcie-root-port"));

        // A balloon device: at the very end, so the devices before keep
        // the addresses an instance without it gave them; none unasked.
        let ballooned = LaunchPlan {
            balloon: true,
            ..target.clone()
        };
        let args = ballooned.args();
        assert_eq!(args[..args.len() - 2], target.args()[..], "{args:?}");
        assert_eq!(
            args[args.len() - 2..],
            [
                "-device",
                "virtio-balloon-pci,id=balloon0,free-page-reporting=off"
            ]
        );
        assert!(!target.args().join(" ").contains("balloon"));

        // Firmware boot: the first disk carries the bootindex, the others
        // stay as they were; no kernel is handed to QEMU.
        let from_disk = LaunchPlan {
            boot: super::super::boot::BootPlan::Disk {
                uefi: None,
                cdrom: None,
            },
            incoming: false,
            ..incoming
        };
        let args = from_disk.args();
        let joined = args.join(" ");
        assert!(
            joined.contains(
                "-drive file=/d/a.qcow2,format=qcow2,cache=writeback,id=disk0,if=none \
                 -device virtio-blk-pci,drive=disk0,bootindex=0"
            ),
            "{joined}"
        );
        assert!(
            joined.contains(
                "-drive file=/d/b,,c.qcow2,if=virtio,format=qcow2,cache=writeback,id=disk1"
            ),
            "{joined}"
        );
        assert!(
            !args.iter().any(|a| a == "-kernel" || a == "-append"),
            "{joined}"
        );
        assert!(!joined.contains("ide-cd"), "{joined}");

        // An installer CD-ROM that goes first: the disk steps behind it.
        let installer = LaunchPlan {
            boot: super::super::boot::BootPlan::Disk {
                uefi: None,
                cdrom: Some(super::super::cdrom::Cdrom {
                    iso: PathBuf::from("/images/inst.iso"),
                    first: true,
                }),
            },
            ..from_disk.clone()
        };
        let joined = installer.args().join(" ");
        assert!(
            joined.contains("-device virtio-blk-pci,drive=disk0,bootindex=1"),
            "{joined}"
        );
        assert!(
            joined.contains("-device ide-cd,drive=cdrom0,bootindex=0"),
            "{joined}"
        );
        assert!(!joined.contains("-vnc"), "{joined}");

        // A graphical console: VNC on the instance's socket, the display
        // device last.
        let graphical = LaunchPlan {
            graphics: Some(keel_api::Graphics::Vnc),
            ..installer
        };
        let args = graphical.args();
        assert_eq!(
            args[args.len() - 4..],
            ["-vnc", "unix:/run/k,,eel/0123/vnc.sock", "-device", "VGA"]
        );
    }

    #[test]
    fn socket_paths_fit_whatever_the_data_dir() {
        let runtime = Path::new("/run/keel");
        let data = PathBuf::from(format!("/{}", "d".repeat(199)));
        let layout = Layout {
            root: data.clone(),
            disks: data.join("disks"),
            runtime: runtime.to_path_buf(),
        };
        let paths = layout.new_instance(&"i".repeat(keel_api::name::MAX_NAME_LEN));
        for sock in [
            &paths.qmp,
            &paths.cmd,
            &paths.migrate_sock,
            &paths.console_sock,
            &paths.qga,
            &paths.vnc_sock,
        ] {
            assert!(sock.starts_with(runtime), "{}", sock.display());
            assert!(
                sock.as_os_str().len() <= runtime.as_os_str().len() + SOCKET_SUFFIX_LEN,
                "{}",
                sock.display()
            );
        }
        assert!(paths.console.starts_with(&data) && paths.spec.starts_with(&data));
        // Distinct instance dirs get distinct socket dirs.
        assert_ne!(
            layout.new_instance("web-1").sockets,
            layout.new_instance("web-2").sockets
        );
        assert_eq!(
            layout.new_instance("web-1").sockets,
            layout.new_instance("web-1").sockets
        );
    }

    #[test]
    fn records_without_a_socket_dir_keep_their_sockets_in_the_instance_dir() {
        let layout = Layout {
            root: "/k".into(),
            disks: "/k/disks".into(),
            runtime: "/run/keel".into(),
        };
        let spec = DomainSpec::bare("web", "web-1", 1, 128);
        // As an older Keel wrote it: no socket_dir key at all.
        let mut old = serde_json::json!({
            "spec": spec, "started_at": 1, "accelerator": Accelerator::Tcg, "argv": []
        });
        let record: LaunchRecord = serde_json::from_value(old.take()).unwrap();
        let paths = layout.launched("web-1", &record);
        assert_eq!(paths.qmp, Path::new("/k/instances/web-1/qmp.sock"));
        let recorded = LaunchRecord {
            socket_dir: Some("/run/other/ab".into()),
            ..record
        };
        assert_eq!(
            layout.launched("web-1", &recorded).qmp,
            Path::new("/run/other/ab/qmp.sock")
        );
    }

    #[test]
    fn noreplace_rename_refuses_an_existing_directory() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a");
        let b = dir.path().join("b");
        std::fs::create_dir(&a).unwrap();
        std::fs::create_dir(&b).unwrap();
        let err = rename_noreplace(&a, &b).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AlreadyExists);
        std::fs::remove_dir(&b).unwrap();
        rename_noreplace(&a, &b).unwrap();
        assert!(b.exists() && !a.exists());
    }
}
