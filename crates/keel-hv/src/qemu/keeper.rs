//! The fence keeper: a small process between the node agent and each QEMU
//! that ends QEMU when the node's local lease lapses, whether or not the
//! agent is still alive.
//!
//! Why: in a cluster, another node may start a VM once this node's lease in
//! the store has run out. The agent ends its own guests before that when it
//! cannot renew it (self-fencing), but an agent that was killed, or is
//! stopped, cannot. QEMU runs in its own session so that it outlives agent
//! restarts (re-adoption without a reboot), so nothing else would end it:
//! `kill -9` of an agent used to leave its guests running while the cluster
//! started them elsewhere. This is Proxmox HA's watchdog and libvirt
//! sanlock's lease, in software: lease, then watchdog, then recovery.
//!
//! How:
//! - The agent renews the lease file after every heartbeat that reached the
//!   store: it holds a deadline on `CLOCK_BOOTTIME` (system-wide, monotonic,
//!   counts suspend), what is left of `self_fence_ms` after the moment the
//!   heartbeat was sent, counted on the agent's monotonic clock. Wall clocks
//!   play no part. The file lives in the runtime dir (tmpfs under
//!   `/run/keel`), not on the data disk: a stalled data disk must neither
//!   hold a renewal up nor keep a keeper from reading it.
//! - The driver starts `keel keeper --instance-dir DIR --lease FILE` instead
//!   of QEMU. The keeper refuses to start QEMU under a lapsed lease, starts
//!   it from the instance's `spec.json` with `PR_SET_PDEATHSIG = SIGKILL`
//!   (if the keeper dies, for any reason, QEMU dies with it), and compares
//!   the deadline it holds in memory with `CLOCK_BOOTTIME` every
//!   [`CHECK_EVERY`]. A thread of its own reads the file into that memory:
//!   a read that hangs leaves the old deadline in force, so the lease can
//!   only lapse. Once the deadline has passed the keeper SIGKILLs QEMU
//!   first, and only then writes the kill marker and `fenced.json` (no
//!   I/O stands between the deadline and the kill), reaps QEMU and exits.
//! - The deadline in force is the one the file held at its last successful
//!   read; an unreadable or missing file leaves the last one in force, so
//!   it lapses. A renewal may shorten it: an agent back from a planned
//!   restart cuts the freeze's long lease back to the normal window before
//!   it lets the cluster count the normal lease again.
//! - Keepers of an older Keel read `<data dir>/fence-lease`; while that
//!   file exists the renewer mirrors each deadline into it from a thread of
//!   its own, so their guests survive the upgrade and a stall there holds
//!   nothing up.
//! - The keeper's own command line does not carry QEMU's identity marker, so
//!   the driver's process scans find QEMU, never the keeper.
//!
//! The cluster takes a node's VMs over only after `node_lease_ms` of its own
//! time without a heartbeat change, well past `self_fence_ms`.

use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::layout::{read_json, write_json_atomic, LaunchRecord};

/// The lease file, in the driver's data dir.
pub const LEASE_FILE: &str = "fence-lease";
/// Written by the keeper into the instance dir when it fenced QEMU.
pub const FENCED_FILE: &str = "fenced.json";
/// How often the keeper looks at the lease and at QEMU.
pub const CHECK_EVERY: Duration = Duration::from_millis(200);

/// How the driver runs a keeper: `program args… --instance-dir D --lease L`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeeperCommand {
    pub program: PathBuf,
    pub args: Vec<String>,
}

impl KeeperCommand {
    /// `keel keeper`, with this process's own binary.
    pub fn this_binary(subcommand: &str) -> io::Result<KeeperCommand> {
        Ok(KeeperCommand {
            program: std::env::current_exe()?,
            args: vec![subcommand.to_string()],
        })
    }
}

pub use keel_api::clock::boottime_ms;

/// The node's local lease: a deadline on `CLOCK_BOOTTIME`.
///
/// The renewer ([`FenceLease::held_open`]) keeps the file open from the
/// start and rewrites it in place: a renewal then needs no free descriptor.
/// 250 idle connections to an agent's console port once took the
/// descriptors a renewal needed (`Too many open files`), and the keeper
/// killed an AlwaysOn guest. An in-place write can be read half done, so
/// each record carries a check of its deadline; a reader takes a record
/// whose check fails for an unreadable one (the last deadline stays in
/// force, so the lease can only lapse sooner, never later).
#[derive(Debug, Clone)]
pub struct FenceLease {
    path: PathBuf,
    held: Option<std::sync::Arc<std::fs::File>>,
    /// The legacy lease file's mirror thread, fed each new deadline.
    mirror: Option<std::sync::mpsc::SyncSender<u64>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct LeaseRecord {
    /// `CLOCK_BOOTTIME` milliseconds after which guests must be gone.
    valid_until_boottime_ms: u64,
    /// [`check_of`] the deadline; absent in records of older Keels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    check: Option<u64>,
}

/// Every in-place record is this long (padded with spaces), so a shorter
/// one never leaves the tail of a longer one behind.
const RECORD_LEN: usize = 96;

fn check_of(deadline: u64) -> u64 {
    (deadline ^ 0x6b65_656c_6c65_6173).rotate_left(17)
}

fn record_bytes(deadline: u64) -> Vec<u8> {
    let record = LeaseRecord {
        valid_until_boottime_ms: deadline,
        check: Some(check_of(deadline)),
    };
    let mut bytes = serde_json::to_vec(&record).expect("a lease record serializes");
    bytes.resize(RECORD_LEN, b' ');
    bytes
}

impl FenceLease {
    /// For readers (the keeper): the file is opened at every read.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            held: None,
            mirror: None,
        }
    }

    /// For the renewer: the file opened now (created 0600 if missing) and
    /// kept open for every renewal.
    pub fn held_open(path: impl Into<PathBuf>) -> io::Result<Self> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = path.into();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)?;
        Ok(Self {
            path,
            held: Some(std::sync::Arc::new(file)),
            mirror: None,
        })
    }

    /// Also renews `legacy` (for keepers of an older Keel), from a thread
    /// of its own: a write there that hangs delays no renewal.
    pub fn mirrored_to(mut self, legacy: PathBuf) -> Self {
        let (tx, rx) = std::sync::mpsc::sync_channel::<u64>(1);
        let spawned = std::thread::Builder::new()
            .name("fence-lease-mirror".into())
            .spawn(move || {
                let legacy = FenceLease::new(legacy);
                while let Ok(mut deadline) = rx.recv() {
                    // Only the newest deadline matters.
                    while let Ok(newer) = rx.try_recv() {
                        deadline = newer;
                    }
                    if let Err(e) = legacy.write_deadline(deadline) {
                        eprintln!("keel: legacy fence lease {}: {e}", legacy.path.display());
                    }
                }
            });
        if spawned.is_ok() {
            self.mirror = Some(tx);
        }
        self
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Extends the lease to `valid_for` from now. The caller passes what is
    /// left of its self-fence window, counted from before the heartbeat that
    /// earned it was sent.
    pub fn renew(&self, valid_for: Duration) -> io::Result<()> {
        let deadline = boottime_ms() + valid_for.as_millis() as u64;
        if let Some(mirror) = &self.mirror {
            // Full: the thread is behind (its disk hangs); it takes the
            // newest it finds when it gets back.
            let _ = mirror.try_send(deadline);
        }
        self.write_deadline(deadline)
    }

    fn write_deadline(&self, deadline: u64) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        match &self.held {
            Some(file) => {
                file.write_all_at(&record_bytes(deadline), 0)?;
                // A longer file of an older Keel would keep its tail.
                if file.metadata()?.len() > RECORD_LEN as u64 {
                    file.set_len(RECORD_LEN as u64)?;
                }
                file.sync_data()
            }
            None => write_json_atomic(
                &self.path,
                &LeaseRecord {
                    valid_until_boottime_ms: deadline,
                    check: Some(check_of(deadline)),
                },
            ),
        }
    }

    /// The deadline, if the file exists and reads (and its check holds).
    pub fn deadline(&self) -> io::Result<Option<u64>> {
        let Some(record) = read_json::<LeaseRecord>(&self.path)? else {
            return Ok(None);
        };
        match record.check {
            Some(check) if check != check_of(record.valid_until_boottime_ms) => Err(
                io::Error::new(io::ErrorKind::InvalidData, "lease record read half written"),
            ),
            _ => Ok(Some(record.valid_until_boottime_ms)),
        }
    }

    /// Whether the lease is in force now.
    pub fn valid_now(&self) -> bool {
        matches!(self.deadline(), Ok(Some(d)) if boottime_ms() < d)
    }
}

/// `fenced.json`: why the keeper ended QEMU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FencedRecord {
    pub lease_deadline_boottime_ms: u64,
    pub fenced_at_boottime_ms: u64,
    pub reason: String,
}

/// Parses `--instance-dir DIR --lease FILE` and runs the keeper; returns
/// the process exit code.
pub fn main_with_args(args: impl IntoIterator<Item = String>) -> i32 {
    let mut instance_dir = None;
    let mut lease = None;
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--instance-dir" => instance_dir = args.next().map(PathBuf::from),
            "--lease" => lease = args.next().map(PathBuf::from),
            other => {
                eprintln!("keel keeper: unexpected argument {other:?}");
                return 2;
            }
        }
    }
    let (Some(instance_dir), Some(lease)) = (instance_dir, lease) else {
        eprintln!("keel keeper: usage: keeper --instance-dir DIR --lease FILE");
        return 2;
    };
    match run(&instance_dir, &FenceLease::new(lease)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("keel keeper: {}: {e}", instance_dir.display());
            1
        }
    }
}

/// Runs QEMU as described by `instance_dir/spec.json` under `lease`.
pub fn run(instance_dir: &Path, lease: &FenceLease) -> io::Result<i32> {
    use std::os::unix::process::CommandExt;
    let record: LaunchRecord = read_json(&instance_dir.join("spec.json"))?
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "spec.json missing"))?;
    let Some((program, args)) = record.argv.split_first() else {
        return Err(io::Error::other("spec.json has an empty argv"));
    };
    let deadline = lease.deadline()?.unwrap_or(0);
    if boottime_ms() >= deadline {
        eprintln!("keel keeper: the node's fence lease has lapsed; not starting QEMU");
        return Ok(3);
    }
    // SAFETY: getpid has no preconditions.
    let keeper = unsafe { libc::getpid() };
    let mut cmd = Command::new(program);
    cmd.args(args).current_dir(instance_dir);
    // SAFETY: prctl and getppid are async-signal-safe and touch no memory
    // of ours.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The keeper may have died between fork and prctl: then no
            // signal would come, so do not run at all.
            if libc::getppid() != keeper {
                return Err(io::Error::other("keeper exited during start"));
            }
            Ok(())
        });
    }
    let mut qemu = cmd.spawn()?;
    let held = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(deadline));
    read_lease_into(lease.clone(), held.clone());
    loop {
        // Neither of these waits on a disk: waitpid, and the clock.
        if let Some(status) = qemu.try_wait()? {
            return Ok(status.code().unwrap_or(128 + status_signal(&status)));
        }
        let deadline = held.load(std::sync::atomic::Ordering::SeqCst);
        let now = boottime_ms();
        if now >= deadline {
            fence(instance_dir, &mut qemu, deadline, now);
            return Ok(0);
        }
        std::thread::sleep(CHECK_EVERY);
    }
}

/// Keeps `held` at the deadline the lease file holds, from a thread of its
/// own, for as long as the process runs. Only a successful read changes it
/// (either way); a read that hangs changes nothing, and the keeper's loop
/// goes on comparing the last deadline with the clock.
fn read_lease_into(lease: FenceLease, held: std::sync::Arc<std::sync::atomic::AtomicU64>) {
    let _ = std::thread::Builder::new()
        .name("lease-reader".into())
        .spawn(move || loop {
            if let Ok(Some(renewed)) = lease.deadline() {
                held.store(renewed, std::sync::atomic::Ordering::SeqCst);
            }
            std::thread::sleep(CHECK_EVERY);
        });
}

fn status_signal(status: &std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status.signal().unwrap_or(0)
}

fn fence(instance_dir: &Path, qemu: &mut std::process::Child, deadline: u64, now: u64) {
    // The kill first: nothing that could wait on a stalled disk comes
    // between the deadline and the signal. The marker follows at once; an
    // agent that sees the exit before it is written calls it a crash, and
    // under the lapsed lease starts nothing for it anyway.
    let _ = qemu.kill();
    let _ = std::fs::write(instance_dir.join("kill-requested"), b"fence keeper\n");
    let record = FencedRecord {
        lease_deadline_boottime_ms: deadline,
        fenced_at_boottime_ms: now,
        reason: format!(
            "the node's fence lease lapsed {} ms ago: its agent did not renew it",
            now - deadline
        ),
    };
    let _ = write_json_atomic(&instance_dir.join(FENCED_FILE), &record);
    eprintln!("keel keeper: {}; QEMU killed", record.reason);
    let _ = qemu.wait();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_is_valid_until_its_deadline_and_missing_means_lapsed() {
        let dir = tempfile::tempdir().unwrap();
        let lease = FenceLease::new(dir.path().join(LEASE_FILE));
        assert!(!lease.valid_now(), "no file: no lease");
        lease.renew(Duration::from_secs(30)).unwrap();
        assert!(lease.valid_now());
        let d = lease.deadline().unwrap().unwrap();
        assert!(d > boottime_ms() + 29_000 && d <= boottime_ms() + 30_000);
        lease.renew(Duration::ZERO).unwrap();
        assert!(!lease.valid_now());
    }

    #[test]
    fn a_held_lease_renews_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LEASE_FILE);
        // An older Keel's record, longer than the in-place one.
        let old = format!(
            "{{\n  \"valid_until_boottime_ms\": 1{}\n}}",
            " ".repeat(200)
        );
        std::fs::write(&path, old).unwrap();
        let held = FenceLease::held_open(&path).unwrap();
        let reader = FenceLease::new(&path);
        let inode = |p: &Path| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).unwrap());
        let before = inode(&path);
        held.renew(Duration::from_secs(30)).unwrap();
        assert!(reader.valid_now());
        assert_eq!(std::fs::metadata(&path).unwrap().len(), RECORD_LEN as u64);
        assert_eq!(inode(&path), before, "rewritten in place");
        held.renew(Duration::ZERO).unwrap();
        assert!(!reader.valid_now(), "a shorter deadline takes effect");
    }

    #[test]
    fn a_record_whose_check_fails_is_unreadable_and_an_old_one_still_reads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LEASE_FILE);
        let torn = r#"{"valid_until_boottime_ms":2999,"check":1}"#;
        std::fs::write(&path, torn).unwrap();
        assert!(FenceLease::new(&path).deadline().is_err());
        std::fs::write(&path, r#"{"valid_until_boottime_ms":2999}"#).unwrap();
        assert_eq!(FenceLease::new(&path).deadline().unwrap(), Some(2999));
    }
}
