//! A VM's TPM: one `swtpm` per instance, its state kept with the disks.
//!
//! - The state is `<disk dir>/<vm>/tpm/` (swtpm's `tpm2-00.permall`): it
//!   is the VM's data, so it lives where the disks live, outlives
//!   instances, and is deleted with the disks. It is made once, by
//!   `swtpm_setup` (the TPM manufactured, with an endorsement key, as
//!   libvirt does) into a private directory renamed into place, so it is
//!   there whole or not at all, and only by a start the controller allows
//!   to make it ([`crate::TpmUse::may_create`]): once an instance has run
//!   with it, a missing state fails the start, naming the path.
//! - swtpm listens on a control socket in the instance's socket dir and
//!   daemonises once it does: its first process exiting 0 means ready.
//!   `--terminate`: it exits once QEMU's connection closes, however QEMU
//!   ended (a stop, a crash, the fence keeper's SIGKILL), so swtpm never
//!   outlives the QEMU it serves, and under a keeper it goes with QEMU
//!   when the lease lapses. swtpm locks the state dir while it runs, so
//!   a second swtpm on the same state (another instance, on shared
//!   storage another node's) fails to start rather than write beside it.
//! - Cleanup (and a failed start's rollback) waits for it to be gone and
//!   kills one that lingers (a QEMU that never connected), found by its
//!   pid file and verified by its command line.
//! - Live migration is refused: swtpm 0.7 cannot hand its locked state
//!   over to a target on the same (shared) state dir.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use super::opts::opt_escape;

/// The state dir's name, in the VM's disk dir.
pub const STATE_DIR: &str = "tpm";
/// swtpm's control socket, in the instance's socket dir.
pub const CONTROL_SOCKET: &str = "swtpm.sock";
/// swtpm's pid file and log, in the instance dir.
pub const PID_FILE: &str = "swtpm.pid";
pub const LOG: &str = "swtpm.log";
/// The file swtpm keeps a TPM 2.0's state in.
const STATE_FILE: &str = "tpm2-00.permall";
/// How long swtpm may take to come up, and swtpm_setup to manufacture.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long cleanup waits for swtpm to follow QEMU out before it kills it.
const EXIT_TIMEOUT: Duration = Duration::from_secs(5);

/// The TPM of one launch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TpmPlan {
    /// `<disk dir>/<vm>/tpm`.
    pub state: PathBuf,
    /// The control socket swtpm listens on and QEMU connects to.
    pub socket: PathBuf,
}

impl TpmPlan {
    pub fn new(vm_disks: &Path, sockets: &Path) -> Self {
        TpmPlan {
            state: vm_disks.join(STATE_DIR),
            socket: sockets.join(CONTROL_SOCKET),
        }
    }

    /// QEMU's side: the emulator backend on swtpm's socket and a CRB
    /// interface (what Windows 11 and Linux's `tpm_crb` expect on q35).
    pub fn qemu_args(&self) -> Vec<String> {
        vec![
            "-chardev".into(),
            format!("socket,id=chrtpm,path={}", opt_escape(&self.socket)),
            "-tpmdev".into(),
            "emulator,id=tpm0,chardev=chrtpm".into(),
            "-device".into(),
            "tpm-crb,tpmdev=tpm0".into(),
        ]
    }

    /// swtpm's arguments: TPM 2.0, the VM's state (files private to the
    /// user), the control socket, gone with QEMU's connection, a daemon
    /// that writes its pid. swtpm's option lists have no escape for a
    /// comma, so a path with one is refused instead ([`Self::check_paths`]).
    pub fn swtpm_args(&self, instance_dir: &Path) -> Vec<String> {
        vec![
            "socket".into(),
            "--tpm2".into(),
            "--tpmstate".into(),
            format!("dir={},mode=0600", self.state.display()),
            "--ctrl".into(),
            format!("type=unixio,path={}", self.socket.display()),
            "--terminate".into(),
            "--daemon".into(),
            "--pid".into(),
            format!("file={}", instance_dir.join(PID_FILE).display()),
            "--log".into(),
            format!("file={}", instance_dir.join(LOG).display()),
        ]
    }

    /// The paths swtpm is given, unless one has a comma (see above).
    pub fn check_paths(&self, instance_dir: &Path) -> Result<(), String> {
        match [self.state.as_path(), &self.socket, instance_dir]
            .into_iter()
            .find(|p| p.to_string_lossy().contains(','))
        {
            Some(path) => Err(format!(
                "swtpm cannot be given a path with a comma ({}): for VMs with a TPM, keep the \
                 data, disk and runtime dirs on paths without one",
                path.display()
            )),
            None => Ok(()),
        }
    }

    /// Whether the state exists (made by an earlier start, or copied).
    pub fn state_exists(&self) -> bool {
        self.state.join(STATE_FILE).is_file()
    }
}

/// The state for a start: there already, or made now if `may_create`;
/// otherwise the reason the start must fail. Blocking (runs swtpm_setup).
pub fn ensure_state(
    swtpm_setup: &Path,
    plan: &TpmPlan,
    vm: &str,
    may_create: bool,
) -> Result<(), String> {
    // swtpm_setup hands the state dir to swtpm in an option list too.
    plan.check_paths(&plan.state)?;
    if plan.state_exists() {
        return Ok(());
    }
    if !may_create {
        return Err(format!(
            "the TPM state of VM {vm} is missing ({}): an instance has run with this TPM, so \
             its state is the VM's data, and Keel does not make a blank one in its place \
             (put the state back, or on shared storage start the VM where its disks are)",
            plan.state.display()
        ));
    }
    let parent = plan
        .state
        .parent()
        .ok_or_else(|| format!("{}: no parent directory", plan.state.display()))?;
    std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
    // Made aside and renamed into place: a state dir is whole or absent.
    let staging = parent.join(format!(".{STATE_DIR}.{}.tmp", std::process::id()));
    let _ = std::fs::remove_dir_all(&staging);
    {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&staging)
            .map_err(|e| format!("{}: {e}", staging.display()))?;
    }
    // rename(2) replaces at most an empty directory (one left without a
    // state), never a state: onto a directory with files it fails.
    let made = manufacture(swtpm_setup, &staging).and_then(|()| {
        std::fs::rename(&staging, &plan.state)
            .and_then(|()| std::fs::File::open(parent)?.sync_all())
            .map_err(|e| format!("{}: {e}", plan.state.display()))
    });
    let _ = std::fs::remove_dir_all(&staging);
    made
}

/// `swtpm_setup`: a TPM 2.0 state with its endorsement key made, in `dir`.
fn manufacture(swtpm_setup: &Path, dir: &Path) -> Result<(), String> {
    let mut child = std::process::Command::new(swtpm_setup)
        .arg("--tpm2")
        .arg("--tpmstate")
        .arg(dir)
        .args(["--createek", "--not-overwrite"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            format!(
                "{} does not run ({e}); install swtpm-tools (scripts/setup): it makes a VM's TPM",
                swtpm_setup.display()
            )
        })?;
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "swtpm_setup did not finish within {}s",
                    START_TIMEOUT.as_secs()
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(format!("swtpm_setup: {e}")),
        }
    }
    let out = child
        .wait_with_output()
        .map_err(|e| format!("swtpm_setup: {e}"))?;
    if !out.status.success() || !dir.join(STATE_FILE).is_file() {
        let said = String::from_utf8_lossy(&out.stderr).trim().to_string();
        let said = if said.is_empty() {
            String::from_utf8_lossy(&out.stdout).trim().to_string()
        } else {
            said
        };
        return Err(format!("swtpm_setup failed ({}): {said}", out.status));
    }
    Ok(())
}

/// Starts the instance's swtpm (its pid file and log in `instance_dir`)
/// and returns once it listens.
pub(crate) async fn start(
    binary: &Path,
    plan: &TpmPlan,
    instance_dir: &Path,
) -> Result<(), String> {
    plan.check_paths(instance_dir)?;
    let log = instance_dir.join(LOG);
    // Its complaints before the log is open go to the log too; not a pipe,
    // which the daemon would hold open.
    let logfile = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)
        .map_err(|e| format!("{}: {e}", log.display()))?;
    let mut cmd = tokio::process::Command::new(binary);
    cmd.args(plan.swtpm_args(instance_dir))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(logfile)
        .kill_on_drop(true);
    // SAFETY: setsid is async-signal-safe and touches no memory of ours.
    // A session of its own, as QEMU's: it outlives agent restarts.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(|e| {
        format!(
            "{} does not run ({e}); install swtpm (scripts/setup): it is the VM's TPM",
            binary.display()
        )
    })?;
    let status = match tokio::time::timeout(START_TIMEOUT, child.wait()).await {
        Ok(status) => status.map_err(|e| format!("swtpm: {e}"))?,
        Err(_) => {
            return Err(format!(
                "swtpm did not come up within {}s",
                START_TIMEOUT.as_secs()
            ))
        }
    };
    if !status.success() || !plan.socket.exists() {
        let logged = std::fs::read_to_string(&log).unwrap_or_default();
        return Err(format!(
            "swtpm failed to start ({status}): {}",
            logged.split_whitespace().collect::<Vec<_>>().join(" ")
        ));
    }
    Ok(())
}

/// The instance's swtpm, if one runs: the pid of its pid file, verified
/// by its command line naming the instance's control socket.
fn running(instance_dir: &Path, socket: &Path) -> Option<libc::pid_t> {
    let pid: libc::pid_t = std::fs::read_to_string(instance_dir.join(PID_FILE))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let ours = String::from_utf8_lossy(&cmdline)
        .contains(&format!("type=unixio,path={}", socket.display()));
    // A zombie (exited, not yet reaped by whoever adopted it) is gone.
    let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let zombie = state
        .rsplit_once(')')
        .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'));
    (ours && !zombie).then_some(pid)
}

/// Waits until the instance's swtpm has exited, which it does once QEMU's
/// connection closed, and kills it if it lingers (QEMU never connected).
/// None running: done. Blocking.
pub(crate) fn await_gone(instance_dir: &Path, sockets: &Path) -> Result<(), String> {
    let socket = sockets.join(CONTROL_SOCKET);
    let deadline = Instant::now() + EXIT_TIMEOUT;
    while let Some(pid) = running(instance_dir, &socket) {
        if Instant::now() >= deadline {
            // SAFETY: kill has no memory preconditions; the pid was just
            // verified to be this instance's swtpm.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            if Instant::now() >= deadline + EXIT_TIMEOUT {
                return Err(format!("swtpm (pid {pid}) does not exit"));
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Why an incoming migration of a VM with a TPM is refused.
pub fn migration_refused(vm: &str) -> String {
    format!(
        "VM {vm} has a TPM (spec.tpm): live migration would have to hand the TPM's state to \
         another swtpm on the same state dir, which this swtpm cannot do; stop the VM and \
         start it on the other node instead (its TPM state goes with its disks)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qemu_gets_a_crb_tpm_on_the_instances_socket_and_swtpm_the_vms_state() {
        let plan = TpmPlan::new(Path::new("/d,isks/web"), Path::new("/run/keel/0123"));
        assert_eq!(plan.state, Path::new("/d,isks/web/tpm"));
        assert_eq!(
            plan.qemu_args(),
            [
                "-chardev",
                "socket,id=chrtpm,path=/run/keel/0123/swtpm.sock",
                "-tpmdev",
                "emulator,id=tpm0,chardev=chrtpm",
                "-device",
                "tpm-crb,tpmdev=tpm0"
            ]
        );
        let why = plan
            .check_paths(Path::new("/data/instances/web-1"))
            .unwrap_err();
        assert!(why.contains("/d,isks/web/tpm"), "{why}");
        let plan = TpmPlan::new(Path::new("/disks/web"), Path::new("/run/keel/0123"));
        plan.check_paths(Path::new("/data/instances/web-1"))
            .unwrap();
        let swtpm = plan
            .swtpm_args(Path::new("/data/instances/web-1"))
            .join(" ");
        assert_eq!(
            swtpm,
            "socket --tpm2 --tpmstate dir=/disks/web/tpm,mode=0600 \
             --ctrl type=unixio,path=/run/keel/0123/swtpm.sock --terminate --daemon \
             --pid file=/data/instances/web-1/swtpm.pid --log file=/data/instances/web-1/swtpm.log"
        );
    }

    #[test]
    fn a_used_tpm_whose_state_is_missing_is_never_made_again() {
        let dir = tempfile::tempdir().unwrap();
        let plan = TpmPlan::new(dir.path(), dir.path());
        // No swtpm_setup is run for a refusal: a missing binary cannot matter.
        let err =
            ensure_state(Path::new("/nonexistent/swtpm_setup"), &plan, "web", false).unwrap_err();
        assert!(
            err.contains("TPM state of VM web is missing") && err.contains("tpm"),
            "{err}"
        );
        assert!(!plan.state.exists(), "nothing made");
        // A state that is there is used, whatever the permission.
        std::fs::create_dir(&plan.state).unwrap();
        std::fs::write(plan.state.join(STATE_FILE), b"state").unwrap();
        ensure_state(Path::new("/nonexistent/swtpm_setup"), &plan, "web", false).unwrap();
        assert_eq!(
            std::fs::read(plan.state.join(STATE_FILE)).unwrap(),
            b"state"
        );
    }

    #[test]
    fn a_missing_swtpm_setup_fails_naming_the_package_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let plan = TpmPlan::new(dir.path(), dir.path());
        let err =
            ensure_state(Path::new("/nonexistent/swtpm_setup"), &plan, "web", true).unwrap_err();
        assert!(err.contains("swtpm-tools"), "{err}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
