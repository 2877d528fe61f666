//! A user-mode guest's network: one `passt` process per instance.
//!
//! Why passt and not QEMU's own slirp: slirp maps the gateway (10.0.2.2) to
//! the host's 127.0.0.1, so every guest reached every loopback-only service
//! of its host: etcd and the admin token in it, the API, migration and
//! console ports. With `--no-map-gw` passt maps nothing to the host. The
//! guest gets the host's own address (so that address is the guest's own,
//! and a connection to it stays in the guest), the gateway is the real
//! router, and the guest's 127.0.0.1 is its own loopback. Outbound
//! connections become the host's sockets, as with slirp, so guests keep
//! their way out; published ports are passt's listeners. libvirt and Podman
//! moved to passt for the same reasons.
//!
//! How:
//! - Keel makes a socketpair: passt gets one end (`--fd`), QEMU the other
//!   (`-netdev stream,addr.type=fd`). No socket file, so nothing another
//!   local user could connect to first, and nothing to clean up.
//! - `--one-off`: passt exits once QEMU's end closes, whoever ended QEMU
//!   (a stop, a crash, the fence keeper's kill). A QEMU that never starts
//!   closes its end as well.
//! - passt drops root for `nobody` and sandboxes itself, then daemonises:
//!   its first process exiting 0 means configured and listening; a failure
//!   (a published port in use) exits non-zero with the reason in
//!   `passt.log`. The daemon is in a session of its own, so it outlives
//!   agent restarts as QEMU does.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use keel_api::{PortForward, Protocol};

/// The descriptor number QEMU (and a fence keeper before it) finds its end
/// of the network socket at; QEMU's command line names it.
pub const QEMU_NET_FD: RawFd = 3;
/// The descriptor number passt is handed its end at.
const PASST_FD: RawFd = 3;
/// passt's messages, in the instance dir.
pub const LOG: &str = "passt.log";
/// The inode of passt's end of the socket, in the instance dir: how cleanup
/// finds the daemon (its pid is a grandchild's, never told).
pub const SOCKET_INODE: &str = "passt.inode";
/// How long cleanup waits for passt to follow QEMU out before it kills it.
const EXIT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long passt may take to configure itself and daemonise.
const START_TIMEOUT: Duration = Duration::from_secs(10);
/// The address a guest sends DNS queries to when the host's resolver is on
/// its loopback (systemd-resolved, dnsmasq): passt forwards what reaches it
/// to that resolver, and nothing else of the host's loopback.
const DNS_FORWARD: &str = "169.254.0.53";

/// passt's arguments: quiet, one client, no gateway mapping, the socket at
/// [`PASST_FD`], then one `-t`/`-u` per published port.
pub fn args(forwards: &[PortForward], loopback_resolver: bool) -> Vec<String> {
    let mut a: Vec<String> = ["--quiet", "--one-off", "--no-map-gw", "--fd"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    a.push(PASST_FD.to_string());
    if loopback_resolver {
        a.extend(["--dns-forward", DNS_FORWARD, "--dns", DNS_FORWARD].map(String::from));
    }
    for f in forwards {
        let flag = match f.protocol {
            Protocol::Tcp => "--tcp-ports",
            Protocol::Udp => "--udp-ports",
        };
        a.push(flag.into());
        a.push(format!(
            "{}/{}:{}",
            f.host_address, f.host_port, f.guest_port
        ));
    }
    a
}

/// The IPv4 address and prefix passt hands a guest: the host's own on the
/// interface of its first IPv4 default route (`192.0.2.2/24`). `None`
/// without such a route, where passt refuses to start.
pub fn guest_address() -> Option<String> {
    let routes = std::fs::read_to_string("/proc/net/route").ok()?;
    let dev = default_route_interface(&routes)?;
    interface_ipv4(&dev)
}

/// The interface of the first default route in `/proc/net/route`'s format.
fn default_route_interface(routes: &str) -> Option<String> {
    routes.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        (fields.len() > 7 && fields[1] == "00000000" && fields[7] == "00000000")
            .then(|| fields[0].to_string())
    })
}

fn interface_ipv4(dev: &str) -> Option<String> {
    let mut addrs: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills a list we free below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut addrs) } != 0 {
        return None;
    }
    let mut found = None;
    let mut cur = addrs;
    while !cur.is_null() && found.is_none() {
        // SAFETY: `cur` is a node of the list getifaddrs returned.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_netmask.is_null() {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string of the list.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) };
        // SAFETY: ifa_addr is non-null and names its family.
        let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
        if name.to_bytes() != dev.as_bytes() || family != libc::AF_INET {
            continue;
        }
        // SAFETY: AF_INET addresses and masks are sockaddr_in.
        let (addr, mask) = unsafe {
            (
                (*(ifa.ifa_addr as *const libc::sockaddr_in))
                    .sin_addr
                    .s_addr,
                (*(ifa.ifa_netmask as *const libc::sockaddr_in))
                    .sin_addr
                    .s_addr,
            )
        };
        let ip = std::net::Ipv4Addr::from(u32::from_be(addr));
        found = Some(format!("{ip}/{}", u32::from_be(mask).count_ones()));
    }
    // SAFETY: the list came from getifaddrs and is not used after this.
    unsafe { libc::freeifaddrs(addrs) };
    found
}

/// Whether the first nameserver of `resolv_conf` is a loopback address.
pub fn first_resolver_is_loopback(resolv_conf: &str) -> bool {
    resolv_conf
        .lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|rest| rest.trim().parse::<std::net::IpAddr>().ok())
        .next()
        .is_some_and(|ip| ip.is_loopback())
}

/// Starts passt for the instance in `dir` and returns QEMU's end of its
/// socket; passt's messages go to [`LOG`] there.
pub(crate) async fn start(
    binary: &Path,
    forwards: &[PortForward],
    dir: &Path,
) -> Result<OwnedFd, String> {
    let (passt_end, qemu_end) = socketpair().map_err(|e| format!("socketpair for passt: {e}"))?;
    let inode = socket_inode(passt_end.as_raw_fd()).map_err(|e| format!("passt's socket: {e}"))?;
    std::fs::write(dir.join(SOCKET_INODE), inode.to_string())
        .map_err(|e| format!("{}: {e}", dir.join(SOCKET_INODE).display()))?;
    let log = &dir.join(LOG);
    let resolv = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
    let logfile = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| format!("{}: {e}", log.display()))?;
    let mut cmd = tokio::process::Command::new(binary);
    cmd.args(args(forwards, first_resolver_is_loopback(&resolv)))
        .stdin(Stdio::null())
        .stdout(logfile.try_clone().map_err(|e| e.to_string())?)
        .stderr(logfile)
        .kill_on_drop(true);
    let fd = passt_end.as_raw_fd();
    // SAFETY: setsid, dup2 and fcntl are async-signal-safe and touch no
    // memory of ours.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setsid() < 0 {
                return Err(io::Error::last_os_error());
            }
            inherit_as(fd, PASST_FD)
        });
    }
    let mut child = cmd.spawn().map_err(|e| {
        format!(
            "{} does not run ({e}); install passt (scripts/setup): it is the network of user-mode guests",
            binary.display()
        )
    })?;
    drop(passt_end);
    let status = match tokio::time::timeout(START_TIMEOUT, child.wait()).await {
        Ok(status) => status.map_err(|e| format!("passt: {e}"))?,
        Err(_) => {
            return Err(format!(
                "passt did not come up within {}s: {}",
                START_TIMEOUT.as_secs(),
                reason(log)
            ))
        }
    };
    if !status.success() {
        return Err(format!("passt failed ({status}): {}", reason(log)));
    }
    Ok(qemu_end)
}

/// What passt said, without its complaints about a missing syslog and its
/// notice that it left root.
fn reason(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| {
            !l.is_empty() && !l.starts_with("Failed to send") && !l.starts_with("Don't run as root")
        })
        .collect();
    if lines.is_empty() {
        "(passt said nothing)".into()
    } else {
        lines[lines.len().saturating_sub(3)..].join(" | ")
    }
}

/// Waits until the passt of the instance in `dir` has exited, which it does
/// once QEMU's end of its socket is closed, and kills it if it lingers.
/// Why wait: a published port is passt's listener, and the next instance of
/// the VM (a restart) binds the same port at once. No passt (never started,
/// a bridge NIC, already gone): done.
pub(crate) fn await_gone(dir: &Path) -> Result<(), String> {
    let Ok(text) = std::fs::read_to_string(dir.join(SOCKET_INODE)) else {
        return Ok(());
    };
    let Ok(inode) = text.trim().parse::<u64>() else {
        return Ok(());
    };
    let deadline = std::time::Instant::now() + EXIT_TIMEOUT;
    while let Some(pid) = holder_of(inode) {
        if std::time::Instant::now() >= deadline {
            // SAFETY: kill has no memory preconditions; the pid was seen
            // holding this instance's socket a moment ago.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            if std::time::Instant::now() >= deadline + EXIT_TIMEOUT {
                return Err(format!("passt (pid {pid}) does not exit"));
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// The process whose descriptor [`PASST_FD`] is the socket `inode`.
fn holder_of(inode: u64) -> Option<libc::pid_t> {
    let want = format!("socket:[{inode}]");
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid: libc::pid_t = entry.file_name().to_str()?.parse().ok()?;
            let link =
                std::fs::read_link(entry.path().join("fd").join(PASST_FD.to_string())).ok()?;
            (link.as_os_str() == want.as_str()).then_some(pid)
        })
}

fn socket_inode(fd: RawFd) -> io::Result<u64> {
    let link = std::fs::read_link(format!("/proc/self/fd/{fd}"))?;
    link.to_str()
        .and_then(|l| l.strip_prefix("socket:["))
        .and_then(|l| l.strip_suffix(']'))
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| io::Error::other(format!("not a socket: {}", link.display())))
}

fn socketpair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: socketpair writes two descriptors into the array we own.
    // CLOEXEC: no other child spawned meanwhile inherits either end.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just created and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// In a child between fork and exec: makes `fd` available as `target`
/// across the exec. dup2 onto the same number would keep close-on-exec, so
/// that case clears the flag instead.
pub(super) fn inherit_as(fd: RawFd, target: RawFd) -> io::Result<()> {
    // SAFETY: dup2 and fcntl are async-signal-safe (the caller runs
    // between fork and exec) and only change the descriptor table.
    let rc = unsafe {
        if fd == target {
            libc::fcntl(fd, libc::F_SETFD, 0)
        } else {
            libc::dup2(fd, target)
        }
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn forward(addr: &str, host: u16, guest: u16, protocol: Protocol) -> PortForward {
        PortForward {
            host_address: addr.into(),
            host_port: host,
            guest_port: guest,
            protocol,
        }
    }

    #[test]
    fn no_gateway_mapping_one_client_and_each_published_port() {
        let a = args(
            &[
                forward("127.0.0.1", 2222, 22, Protocol::Tcp),
                forward("0.0.0.0", 5353, 53, Protocol::Udp),
            ],
            false,
        );
        assert_eq!(
            a,
            [
                "--quiet",
                "--one-off",
                "--no-map-gw",
                "--fd",
                "3",
                "--tcp-ports",
                "127.0.0.1/2222:22",
                "--udp-ports",
                "0.0.0.0/5353:53"
            ]
        );
    }

    #[test]
    fn a_loopback_resolver_is_reached_through_one_forwarded_address() {
        assert!(first_resolver_is_loopback("# x\nnameserver 127.0.0.53\n"));
        assert!(first_resolver_is_loopback(
            "nameserver ::1\nnameserver 192.0.2.1\n"
        ));
        assert!(!first_resolver_is_loopback(
            "nameserver 192.0.2.1\nnameserver 127.0.0.1\n"
        ));
        assert!(!first_resolver_is_loopback(""));
        let a = args(&[], true);
        assert!(a.windows(2).any(|w| w == ["--dns-forward", DNS_FORWARD]));
        assert!(a.windows(2).any(|w| w == ["--dns", DNS_FORWARD]));
    }

    #[test]
    fn the_default_routes_interface_is_read_from_proc() {
        let routes = "Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\n\
                      eth1\t0002A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\n\
                      eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\n";
        assert_eq!(default_route_interface(routes).as_deref(), Some("eth0"));
        assert_eq!(default_route_interface("Iface\n"), None);
        assert_eq!(interface_ipv4("lo").as_deref(), Some("127.0.0.1/8"));
    }

    #[test]
    fn reasons_leave_out_passts_syslog_noise() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("passt.log");
        std::fs::write(
            &log,
            "Failed to send 47 bytes to syslog\nDon't run as root. Changing to nobody...\n\
             Failed to bind any port for '-t 127.0.0.1/2345:22', exiting\n",
        )
        .unwrap();
        assert_eq!(
            reason(&log),
            "Failed to bind any port for '-t 127.0.0.1/2345:22', exiting"
        );
    }
}
