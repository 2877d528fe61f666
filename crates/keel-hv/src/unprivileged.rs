//! Programs Keel runs on a guest's behalf (QEMU, its fence keeper,
//! qemu-img) run without any capability.
//!
//! Why: Keel's units grant CAP_NET_ADMIN ambiently, for the taps Keel makes
//! itself, and ambient capabilities survive exec: QEMU and qemu-img ran
//! with `CapEff: 0000000000001000`, so a guest that broke out of QEMU could
//! reconfigure the host's network. Run as root (tests, hand-started
//! nodes), an exec'd program gains the whole bounding set. None of them
//! needs a capability: Keel opens what needs privilege before QEMU starts
//! (a bridge tap is made owned by Keel's user, so QEMU attaches to it as
//! its owner).
//!
//! How, between fork and exec: the ambient set is cleared; the bounding
//! set is emptied where that is allowed (it takes CAP_SETPCAP, which root
//! has; without it, an exec of a file without file capabilities gains
//! nothing but the ambient set anyway); the inheritable set is cleared; and
//! `no_new_privs` keeps a set-user-ID or file-capability binary from
//! giving any back.

use std::io;

/// The `pre_exec` step: call only between fork and exec.
pub fn drop_capabilities_in_child() -> io::Result<()> {
    // SAFETY: prctl and capget/capset are async-signal-safe system calls
    // that read and write only the structures passed to them.
    unsafe {
        if libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0,
            0,
            0,
        ) != 0
        {
            let e = io::Error::last_os_error();
            // EINVAL: a kernel without ambient capabilities (before 4.3).
            if e.raw_os_error() != Some(libc::EINVAL) {
                return Err(e);
            }
        }
        for cap in 0..64 {
            if libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) != 0 {
                // EINVAL: past the kernel's last capability; EPERM: no
                // CAP_SETPCAP, see above.
                break;
            }
        }
        let mut header = CapHeader {
            version: LINUX_CAPABILITY_VERSION_3,
            pid: 0,
        };
        let mut data = [CapData::default(); 2];
        if capget(&mut header, data.as_mut_ptr()) != 0 {
            return Err(io::Error::last_os_error());
        }
        for d in &mut data {
            d.inheritable = 0;
        }
        if capset(&mut header, data.as_ptr()) != 0 {
            return Err(io::Error::last_os_error());
        }
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Adds [`drop_capabilities_in_child`] to `cmd`.
pub fn without_capabilities(cmd: &mut tokio::process::Command) -> &mut tokio::process::Command {
    // SAFETY: the closure only makes async-signal-safe system calls.
    unsafe { cmd.pre_exec(drop_capabilities_in_child) }
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

unsafe fn capget(header: *mut CapHeader, data: *mut CapData) -> libc::c_long {
    // SAFETY: the caller passes a v3 header and room for two data structs.
    unsafe { libc::syscall(libc::SYS_capget, header, data) }
}

unsafe fn capset(header: *mut CapHeader, data: *const CapData) -> libc::c_long {
    // SAFETY: as for capget.
    unsafe { libc::syscall(libc::SYS_capset, header, data) }
}

/// The capability sets of `pid` from `/proc/<pid>/status`, as
/// `(CapInh, CapPrm, CapEff, CapBnd, CapAmb)` bit masks.
pub fn capabilities_of(pid: u32) -> io::Result<[u64; 5]> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let mut sets = [0u64; 5];
    for (i, key) in ["CapInh:", "CapPrm:", "CapEff:", "CapBnd:", "CapAmb:"]
        .iter()
        .enumerate()
    {
        let line = status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .ok_or_else(|| io::Error::other(format!("no {key} in /proc/{pid}/status")))?;
        sets[i] = u64::from_str_radix(line.trim(), 16).map_err(io::Error::other)?;
    }
    Ok(sets)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_program_run_without_capabilities_has_none_of_any_set() {
        let mut cmd = tokio::process::Command::new("sleep");
        cmd.arg("5").kill_on_drop(true);
        let mut child = without_capabilities(&mut cmd).spawn().unwrap();
        let pid = child.id().unwrap();
        // The child has exec'd once /proc shows sleep's name.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default() != "sleep\n"
        {
            assert!(std::time::Instant::now() < deadline, "sleep never started");
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let [inh, prm, eff, bnd, amb] = capabilities_of(pid).unwrap();
        assert_eq!((inh, prm, eff, amb), (0, 0, 0, 0), "pid {pid}");
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            assert_eq!(bnd, 0, "root can empty the bounding set");
        }
        let _ = child.kill().await;
    }
}
