//! Host process plumbing: telling whether a pid is still *our* QEMU, waiting
//! for a process we may not be the parent of, and signalling it without
//! hitting a stranger that reused its pid.
//!
//! A pid alone is never trusted. A process counts as an instance's QEMU only
//! if its `/proc/<pid>/cmdline` contains the exact QMP `-chardev` argument
//! built for that instance; that argument holds the absolute path of the
//! instance directory, so it also tells apart two data dirs that use the same
//! instance name.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

use tokio::io::unix::AsyncFd;

/// The NUL-separated argument vector of `pid`, or `None` if it is gone, a
/// zombie (whose cmdline is empty) or unreadable.
pub fn cmdline(pid: u32) -> Option<Vec<String>> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    if raw.is_empty() {
        return None;
    }
    Some(
        raw.split(|b| *b == 0)
            .filter(|s| !s.is_empty())
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .collect(),
    )
}

/// Whether `pid` is alive (not a zombie) and runs with `marker` as one of
/// its arguments.
///
/// Right after `spawn` returns, the child can still be inside execve with an
/// empty cmdline: the kernel closes the spawn pipe before it publishes the
/// new argument area. An empty cmdline of a live process is therefore
/// re-read for a few milliseconds rather than taken as "not ours".
pub fn is_instance_process(pid: u32, marker: &str) -> bool {
    for _ in 0..50 {
        if !is_alive(pid) {
            return false;
        }
        if let Some(args) = cmdline(pid) {
            return args.iter().any(|a| a == marker);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    false
}

/// Alive means not reaped and not a zombie: a dead child we have not reaped
/// yet still has a /proc entry, in state `Z`.
pub fn is_alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // The state follows the parenthesised command name, which may itself
    // contain spaces and parentheses; the last ')' ends it.
    match stat
        .rfind(')')
        .and_then(|i| stat[i + 1..].split_whitespace().next())
    {
        Some(state) => !matches!(state, "Z" | "X" | "x"),
        None => false,
    }
}

/// Scans /proc for a live process carrying `marker`. Used when the pid file
/// is missing, e.g. Keel stopped between spawning QEMU and QEMU writing it.
pub fn find_instance_process(marker: &str) -> Option<u32> {
    let entries = std::fs::read_dir("/proc").ok()?;
    // One read per process, no retries: kernel threads have empty cmdlines
    // too, and a QEMU that is still in execve has not run yet anyway.
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .find(|pid| {
            cmdline(*pid).is_some_and(|args| args.iter().any(|a| a == marker)) && is_alive(*pid)
        })
}

/// A pidfd: a handle on one specific process that stays valid (and never
/// refers to anyone else) after the pid is reused.
#[derive(Debug)]
pub struct PidFd {
    fd: AsyncFd<OwnedFd>,
    pid: u32,
}

impl PidFd {
    /// Opens a pidfd for `pid` and then checks it carries `marker`. The order
    /// matters: a check made before opening could be about a process that
    /// died and whose pid was reused in between.
    pub fn open_verified(pid: u32, marker: &str) -> io::Result<PidFd> {
        let fd = pidfd_open(pid)?;
        if !is_instance_process(pid, marker) {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("pid {pid} is not this instance's QEMU (exited or reused)"),
            ));
        }
        // SAFETY: an OwnedFd always returns the same, open fd, and the
        // AsyncFd owns it until dropped.
        let fd = unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)? };
        Ok(PidFd { fd, pid })
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Sends `signal`; `Ok(false)` if the process has already exited.
    pub fn signal(&self, signal: libc::c_int) -> io::Result<bool> {
        // SAFETY: plain syscall on an fd we own; null siginfo is allowed.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.fd.get_ref().as_raw_fd(),
                signal,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        if rc == 0 {
            return Ok(true);
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::ESRCH) {
            Ok(false)
        } else {
            Err(err)
        }
    }

    /// Resolves once the process has terminated. A pidfd polls readable at
    /// exit whether or not we are its parent.
    pub async fn exited(&self) {
        match self.fd.readable().await {
            // Level-triggered in the kernel; keep tokio's readiness so a
            // second caller also returns at once.
            Ok(mut guard) => guard.retain_ready(),
            Err(_) => {
                // Registration failed (should not happen): poll /proc.
                while is_alive(self.pid) {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }
}

fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just handed us this fd; nobody else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) };
    set_cloexec(&fd)?;
    Ok(fd)
}

/// pidfds are created close-on-exec by the kernel; asserting it keeps a
/// QEMU we spawn from inheriting handles on its siblings.
fn set_cloexec(fd: &OwnedFd) -> io::Result<()> {
    // SAFETY: fcntl on an fd we own.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFD) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    if flags & libc::FD_CLOEXEC == 0 {
        // SAFETY: as above.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, flags | libc::FD_CLOEXEC) } < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn pidfd_follows_one_process_and_checks_its_arguments() {
        let mut child = std::process::Command::new("sleep")
            .arg("30.125")
            .spawn()
            .unwrap();
        let pid = child.id();
        assert!(is_instance_process(pid, "30.125"));
        assert!(!is_instance_process(pid, "30"));
        assert!(PidFd::open_verified(pid, "other").is_err());
        assert_eq!(find_instance_process("30.125"), Some(pid));

        let fd = PidFd::open_verified(pid, "30.125").unwrap();
        assert!(fd.signal(libc::SIGKILL).unwrap());
        tokio::time::timeout(Duration::from_secs(5), fd.exited())
            .await
            .expect("pidfd reports the exit");
        // Dead but not yet reaped: a zombie is not alive.
        assert!(!is_alive(pid));
        assert!(!is_instance_process(pid, "30.125"));
        child.wait().unwrap();
        assert!(!fd.signal(libc::SIGKILL).unwrap(), "ESRCH after exit");
    }
}
